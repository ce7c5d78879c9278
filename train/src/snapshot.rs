//! Training snapshots: everything a run needs to continue exactly (for `--resume`), written so that a
//! crash or a failed write never leaves a half snapshot or damages an earlier one.
//!
//! A snapshot is a folder `checkpoint-NNNNNNN` (the optimiser step; the folder and file names stay as
//! earlier runs wrote them, so those runs resume) holding the adapter in PEFT's format
//! (`adapter_config.json`, `adapter_model.safetensors` and the model card `README.md`; keys in
//! PEFT-on-transformers-5's layout, so the folder loads in PEFT as it is, or with `--adapter-keys hub` the
//! hub's), the optimiser state (`optimizer.safetensors`), the trainer state (`trainer_state.json`: step,
//! data position, seed, schedule length) and the resolved config (`config.toml`). There is no RNG state to
//! save: every random draw of a run (the data order, the dropout masks) is a pure function of the seed,
//! the epoch and the step, all of which are in the trainer state.
//!
//! Atomic write: the folder is filled under a temporary name in the same parent, every file and the
//! folder are fsynced, then it is renamed into place and the parent is fsynced. A folder with the final
//! name is therefore always complete; an existing one with the same name is replaced only after the new
//! one is complete (it is moved aside to `.NAME.old-PID` first, so a kill between the two renames leaves
//! it there rather than losing it). Temporaries that a killed run left are removed by the next write of
//! the same name.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::data::DataPosition;
use crate::error::{io, Result, TrainError};

pub const CONFIG_FILE: &str = "config.toml";
pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const PREFIX: &str = "checkpoint-";

/// Where a run stands after a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimiser steps done.
    pub step: usize,
    /// The schedule's length.
    pub total_steps: usize,
    /// The next sample to visit.
    pub position: DataPosition,
    pub seed: u64,
    /// The loss of the last step.
    pub loss: f64,
    /// Tokens seen so far (all tokens of every sequence).
    pub tokens: u64,
    /// The data-parallel ranks of the run that wrote it (1 before data parallelism existed).
    #[serde(default = "one")]
    pub world_size: usize,
}

fn one() -> usize {
    1
}

impl TrainerState {
    /// A run that has not taken a step yet.
    pub fn fresh(seed: u64) -> Self {
        Self {
            step: 0,
            total_steps: 0,
            position: DataPosition::default(),
            seed,
            loss: f64::NAN,
            tokens: 0,
            world_size: 1,
        }
    }
}

/// The folder name of step `step`'s snapshot.
pub fn dir_name(step: usize) -> String {
    format!("{PREFIX}{step:07}")
}

/// The parent and name of the folder `flag` (`--out`) that a command is about to write: it must not exist,
/// or be an empty folder, so that nothing is overwritten. `err` makes the command's error from a message.
pub(crate) fn fresh_folder(path: &Path, flag: &str, err: fn(String) -> TrainError) -> Result<(PathBuf, String)> {
    if path.exists() {
        let non_empty = std::fs::read_dir(path).map_err(io(path))?.next().is_some();
        if !path.is_dir() || non_empty {
            return Err(err(format!(
                "{flag} {} already exists and is not an empty folder; choose a new folder (nothing is overwritten)",
                path.display()
            )));
        }
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path.file_name().ok_or_else(|| err(format!("{flag} {}: not a folder name", path.display())))?;
    Ok((parent, name.to_string_lossy().into_owned()))
}

/// Fills a new folder `parent/name` through `fill` and moves it into place only when `fill` succeeded
/// and everything is on disk. On error nothing named `name` is touched and the temporary folder is
/// removed.
pub fn write_atomically(parent: &Path, name: &str, fill: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
    std::fs::create_dir_all(parent).map_err(io(parent))?;
    let pid = std::process::id();
    let tmp = parent.join(format!(".{name}.tmp-{pid}"));
    let fin = parent.join(name);
    let result = (|| {
        // Temporaries of this name left by a killed run (any process id) are incomplete by construction.
        let stale = format!(".{name}.tmp-");
        for e in std::fs::read_dir(parent).map_err(io(parent))?.flatten() {
            if e.file_name().to_string_lossy().starts_with(&stale) {
                std::fs::remove_dir_all(e.path()).map_err(io(e.path()))?;
            }
        }
        std::fs::create_dir(&tmp).map_err(io(&tmp))?;
        fill(&tmp)?;
        for entry in std::fs::read_dir(&tmp).map_err(io(&tmp))? {
            let p = entry.map_err(io(&tmp))?.path();
            std::fs::File::open(&p).and_then(|f| f.sync_all()).map_err(io(&p))?;
        }
        sync_dir(&tmp)?;
        if fin.exists() {
            // Replace: move the old one aside, the new one in, then drop the old one.
            let old = parent.join(format!(".{name}.old-{pid}"));
            std::fs::rename(&fin, &old).map_err(io(&fin))?;
            std::fs::rename(&tmp, &fin).map_err(io(&fin))?;
            std::fs::remove_dir_all(&old).map_err(io(&old))?;
        } else {
            std::fs::rename(&tmp, &fin).map_err(io(&fin))?;
        }
        sync_dir(parent)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(fin)
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).map_err(io(dir))
}

/// The snapshot folder `dir` names: `dir` itself if it holds a trainer state, else its newest complete
/// `checkpoint-*` folder.
pub fn find(dir: &Path) -> Result<PathBuf> {
    if dir.join(STATE_FILE).is_file() {
        return Ok(dir.to_path_buf());
    }
    let err = |reason: String| TrainError::Checkpoint { path: dir.into(), reason };
    let entries = std::fs::read_dir(dir).map_err(|e| err(format!("cannot read: {e}")))?;
    let mut best: Option<(usize, PathBuf)> = None;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(step) = name.strip_prefix(PREFIX).and_then(|s| s.parse::<usize>().ok()) else { continue };
        if e.path().join(STATE_FILE).is_file() && best.as_ref().is_none_or(|(s, _)| step > *s) {
            best = Some((step, e.path()));
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| err(format!("neither a checkpoint (no {STATE_FILE}) nor a folder of them")))
}

pub fn read_state(ckpt: &Path) -> Result<TrainerState> {
    let path = ckpt.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    serde_json::from_str(&text).map_err(|e| TrainError::Checkpoint { path, reason: format!("bad trainer state: {e}") })
}

pub fn write_state(dir: &Path, state: &TrainerState) -> Result<()> {
    let path = dir.join(STATE_FILE);
    let text = serde_json::to_string_pretty(state).expect("the state serialises");
    std::fs::write(&path, text + "\n").map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_previous_checkpoint_alone() {
        let parent = std::env::temp_dir().join(format!("askgui-train-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        let state = TrainerState {
            step: 3,
            total_steps: 10,
            position: DataPosition { epoch: 0, index: 6 },
            seed: 1,
            loss: 1.5,
            tokens: 100,
            world_size: 2,
        };
        let name = dir_name(3);
        // A temporary that a killed run left behind goes away with the next write of that name.
        std::fs::create_dir_all(parent.join(format!(".{name}.tmp-1"))).unwrap();
        let good = write_atomically(&parent, &name, |d| write_state(d, &state)).unwrap();
        assert_eq!(read_state(&good).unwrap(), state);
        // A write of the same name that fails half way: the complete one stays, no temporary is left.
        let e = write_atomically(&parent, &name, |d| {
            std::fs::write(d.join(STATE_FILE), "{ half").unwrap();
            Err(TrainError::Data("disk full".into()))
        })
        .unwrap_err();
        assert!(e.to_string().contains("disk full"));
        assert_eq!(read_state(&good).unwrap(), state);
        let names: Vec<_> = std::fs::read_dir(&parent).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from(&name)]);
        // A later step is found as the newest; a successful rewrite replaces.
        let later = TrainerState { step: 12, ..state.clone() };
        write_atomically(&parent, &dir_name(12), |d| write_state(d, &later)).unwrap();
        assert_eq!(find(&parent).unwrap(), parent.join(dir_name(12)));
        assert_eq!(find(&good).unwrap(), good);
        let again = TrainerState { loss: 0.5, ..state };
        write_atomically(&parent, &name, |d| write_state(d, &again)).unwrap();
        assert_eq!(read_state(&good).unwrap().loss, 0.5);
        std::fs::remove_dir_all(&parent).unwrap();
    }
}
