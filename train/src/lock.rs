//! One trainer per output folder: `askgui-train.lock` in `--output-dir` holds the PID of the trainer that
//! writes there, so a second one started on the same folder is refused (two trainers would interleave
//! their checkpoints and logs). A lock whose PID is no longer running (a killed trainer) is taken over.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{io, Result, TrainError};

/// The lock file's name in the output folder.
pub const FILE: &str = "askgui-train.lock";

/// The held lock; dropping it removes the file, and the folders [`Lock::acquire`] created if they are
/// still empty (a run that failed before writing anything leaves no empty output folder behind).
#[derive(Debug)]
pub struct Lock {
    path: PathBuf,
    /// The folders that did not exist before, deepest first.
    created: Vec<PathBuf>,
}

/// Whether process `pid` is running (a process we may not signal is running too).
fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

impl Lock {
    /// Takes `dir`'s lock (creating `dir`), or fails naming the PID of the running trainer that holds it.
    pub fn acquire(dir: &Path) -> Result<Self> {
        let created: Vec<PathBuf> =
            dir.ancestors().take_while(|d| !d.as_os_str().is_empty() && !d.exists()).map(Path::to_path_buf).collect();
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let path = dir.join(FILE);
        for _ in 0..3 {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(mut f) => {
                    writeln!(f, "{}", std::process::id()).map_err(io(&path))?;
                    return Ok(Self { path, created });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    match text.trim().parse::<i32>() {
                        Ok(pid) if alive(pid) => {
                            return Err(TrainError::Config(format!(
                                "{} is in use by the trainer with PID {pid} ({}); stop it, or use another \
                                 --output-dir",
                                dir.display(),
                                path.display()
                            )))
                        }
                        held => {
                            tracing::warn!(lock = %path.display(), ?held, "taking over the lock of a trainer that is not running");
                            let _ = std::fs::remove_file(&path);
                        }
                    }
                }
                Err(e) => return Err(io(&path)(e)),
            }
        }
        Err(TrainError::Config(format!("{}: could not take the lock; remove it if no trainer runs", path.display())))
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        // remove_dir removes only an empty folder: what a run wrote stays.
        for dir in &self.created {
            if std::fs::remove_dir(dir).is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_trainer_is_refused_and_a_dead_ones_lock_is_taken_over() {
        let dir = std::env::temp_dir().join(format!("askgui-lock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let held = Lock::acquire(&dir).unwrap();
        let err = Lock::acquire(&dir).unwrap_err().to_string();
        assert!(err.contains(&format!("PID {}", std::process::id())), "{err}");
        drop(held);
        assert!(!dir.join(FILE).exists(), "dropping the lock removes it");
        assert!(!dir.exists(), "and the folder it created, left empty");
        std::fs::create_dir_all(&dir).unwrap();

        // A PID that has exited: its lock is stale.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        std::fs::write(dir.join(FILE), format!("{dead}\n")).unwrap();
        let taken = Lock::acquire(&dir).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join(FILE)).unwrap().trim(), std::process::id().to_string());
        drop(taken);
        std::fs::write(dir.join(FILE), "not a pid").unwrap();
        drop(Lock::acquire(&dir).unwrap());
        assert!(dir.is_dir(), "a folder that was there before stays");
        // Two levels created, one file written in the deeper one: both stay.
        let (outer, inner) = (dir.join("a"), dir.join("a/b"));
        let lock = Lock::acquire(&inner).unwrap();
        std::fs::write(inner.join("metrics.jsonl"), "").unwrap();
        drop(lock);
        assert!(inner.join("metrics.jsonl").is_file());
        std::fs::remove_file(inner.join("metrics.jsonl")).unwrap();
        std::fs::remove_dir(&inner).unwrap();
        std::fs::remove_dir(&outer).unwrap();
        // Two levels created and nothing written: both go.
        drop(Lock::acquire(&inner).unwrap());
        assert!(!outer.exists() && dir.is_dir());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
