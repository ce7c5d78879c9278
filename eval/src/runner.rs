//! Runs a whole episode file in one mode: worker threads over episodes, a progress bar, and a results
//! file that makes an interrupted run resumable.
//!
//! The results file (`results-<mode>.jsonl`) gets one [`EpisodeResult`] line per finished episode, with
//! every prediction's raw text, written (and flushed) as soon as the episode finishes. On start, episodes
//! already in the file (same id and line number) are not run again; a last line cut short by a crash is
//! dropped and its episode redone; any other bad line is an error (the file is not ours to repair).
//! An agent error stops the run: no new episode starts, those in flight finish and are written, and the
//! error is returned, so running the same command again continues where it stopped.
//!
//! Results are only continued by the same run: `identity.json` ([`crate::identity`]) holds the agent and
//! scoring of the results beside it, and [`run_eval`] refuses a folder whose identity differs, or that
//! holds results without one (made before runs were keyed), naming each field that differs.
//! [`discard_results`] clears a folder for a fresh run.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

use askgui_data::episode::EpisodeError;
use askgui_data::{load_episodes, LoadedEpisode};
use indicatif::{ProgressBar, ProgressStyle};
use thiserror::Error;

use crate::agent::{Agent, AgentError};
use crate::identity::{self, Difference, RunIdentity, IDENTITY_FILE};
use crate::matching::MatchConfig;
use crate::metrics::{compute, ContentScorer};
use crate::modes::{evaluate_episode, EpisodeResult, Mode};
use crate::report::{write_report, Report, ReportError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    /// Episodes evaluated at once (at least 1).
    pub concurrency: usize,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self { concurrency: 1, progress: true }
    }
}

#[derive(Debug, Error)]
pub enum RunError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("results file {path}, line {line}: {reason}")]
    Results { path: PathBuf, line: usize, reason: String },
    #[error("episode {id} (line {line}): {error}")]
    Agent { id: String, line: usize, error: AgentError },
    #[error("{0}")]
    Episodes(EpisodeError),
    #[error("{0}")]
    Report(ReportError),
    #[error(
        "{} holds results of another run ({}); use a new --out, or --restart to discard them and run again",
        out.display(),
        list(differences)
    )]
    OtherRun { out: PathBuf, differences: Vec<Difference> },
    #[error(
        "{} holds results without an {IDENTITY_FILE} (made before runs were keyed on the agent), so whose they \
         are is unknown; use a new --out, or --restart to discard them and run again",
        out.display()
    )]
    Unkeyed { out: PathBuf },
    #[error("{0} is not a run identity; use a new --out, or --restart to discard the results there")]
    BadIdentity(String),
}

/// `field: stored X, now Y; ...`
fn list(differences: &[Difference]) -> String {
    let items: Vec<String> =
        differences.iter().map(|d| format!("{}: stored {}, now {}", d.field, d.stored, d.now)).collect();
    items.join("; ")
}

/// A whole evaluation: which file, where to write, which modes.
#[derive(Debug, Clone)]
pub struct EvalConfig {
    pub episodes: PathBuf,
    pub out: PathBuf,
    pub modes: Vec<Mode>,
    pub matching: MatchConfig,
    pub run: RunOptions,
}

/// The results file of `mode` in `out`.
pub fn results_path(out: &Path, mode: Mode) -> PathBuf {
    out.join(format!("results-{mode}.jsonl"))
}

/// Loads the episode file of `cfg`.
pub fn load(cfg: &EvalConfig) -> Result<Vec<LoadedEpisode>, RunError> {
    load_episodes(&cfg.episodes).map_err(RunError::Episodes)
}

/// Runs every mode of `cfg` over `episodes` (loaded from `cfg.episodes`; each mode resumable), then writes
/// the reports into `cfg.out`.
pub fn run_eval(
    agent: &dyn Agent,
    episodes: &[LoadedEpisode],
    cfg: &EvalConfig,
    scorer: &dyn ContentScorer,
) -> Result<Report, RunError> {
    std::fs::create_dir_all(&cfg.out).map_err(|source| RunError::Io { path: cfg.out.clone(), source })?;
    let identity =
        RunIdentity { agent: agent.identity(), matching: cfg.matching, episodes: identity::canonical(&cfg.episodes) };
    claim(&cfg.out, &identity)?;
    let empty = episodes.iter().filter(|e| e.episode.steps.is_empty()).count();
    if empty > 0 {
        tracing::warn!(empty, "episodes without steps are counted and left out of every metric");
    }
    let mut modes = Vec::new();
    for &mode in &cfg.modes {
        let results = run_mode(agent, episodes, mode, &cfg.matching, &results_path(&cfg.out, mode), &cfg.run)?;
        modes.push(compute(mode, &results, scorer));
    }
    let report = Report {
        agent: agent.name(),
        identity,
        episodes_file: cfg.episodes.display().to_string(),
        matching: cfg.matching,
        modes,
    };
    write_report(&cfg.out, &report).map_err(RunError::Report)?;
    Ok(report)
}

/// Makes `out` the folder of the run `id`: refuses it when it holds results of another run or results
/// without an identity; records `id` when it holds no results.
pub fn claim(out: &Path, id: &RunIdentity) -> Result<(), RunError> {
    if !Mode::ALL.iter().any(|m| results_path(out, *m).exists()) {
        // Nothing to continue: this run's identity replaces whatever is there.
        return identity::write(out, id)
            .map(|_| ())
            .map_err(|source| RunError::Io { path: out.join(IDENTITY_FILE), source });
    }
    let Some(stored) = identity::read(out).map_err(RunError::BadIdentity)? else {
        return Err(RunError::Unkeyed { out: out.to_path_buf() });
    };
    let differences = identity::differences(&stored, id);
    if differences.is_empty() {
        Ok(())
    } else {
        Err(RunError::OtherRun { out: out.to_path_buf(), differences })
    }
}

/// Removes what a run writes into `out` (results of every mode, identity, reports) and nothing else;
/// returns the files removed.
pub fn discard_results(out: &Path) -> Result<Vec<PathBuf>, RunError> {
    let mut files: Vec<PathBuf> = Mode::ALL.iter().map(|m| results_path(out, *m)).collect();
    files.push(out.join(IDENTITY_FILE));
    files.extend(crate::report::REPORT_FILES.iter().map(|f| out.join(f)));
    let mut removed = Vec::new();
    for f in files {
        match std::fs::remove_file(&f) {
            Ok(()) => removed.push(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(RunError::Io { path: f, source }),
        }
    }
    Ok(removed)
}

/// Runs `episodes` in `mode`, continuing the results file at `results`; returns every episode's result in
/// the order of `episodes`.
pub fn run_mode(
    agent: &dyn Agent,
    episodes: &[LoadedEpisode],
    mode: Mode,
    matching: &MatchConfig,
    results: &Path,
    opts: &RunOptions,
) -> Result<Vec<EpisodeResult>, RunError> {
    let io = |source| RunError::Io { path: results.to_path_buf(), source };
    let mut done: HashMap<(String, usize), EpisodeResult> = HashMap::new();
    for r in read_results(results, mode)? {
        done.insert((r.id.clone(), r.line), r);
    }
    let key = |e: &LoadedEpisode| (e.episode.id.clone(), e.line);
    let pending: Vec<usize> = (0..episodes.len()).filter(|&i| !done.contains_key(&key(&episodes[i]))).collect();
    if done.len() + pending.len() > episodes.len() {
        tracing::warn!(path = %results.display(), "the results file holds episodes that are not in the episode file");
    }

    let bar = if opts.progress { ProgressBar::new(episodes.len() as u64) } else { ProgressBar::hidden() };
    if let Ok(style) =
        ProgressStyle::with_template("{msg:>10} {bar:40} {pos}/{len} episodes [{elapsed_precise} < {eta_precise}]")
    {
        bar.set_style(style);
    }
    bar.set_message(mode.name());
    bar.set_position((episodes.len() - pending.len()) as u64);

    let mut first_error = None;
    if !pending.is_empty() {
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(results).map_err(io)?;
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let workers = opts.concurrency.max(1).min(pending.len());
        let (tx, rx) = mpsc::channel::<(usize, Result<EpisodeResult, AgentError>)>();
        std::thread::scope(|s| -> Result<(), RunError> {
            for _ in 0..workers {
                let tx = tx.clone();
                let (next, stop, pending) = (&next, &stop, &pending);
                s.spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        let Some(&i) = pending.get(next.fetch_add(1, Ordering::SeqCst)) else { break };
                        let r = evaluate_episode(agent, &episodes[i], mode, matching);
                        if r.is_err() {
                            stop.store(true, Ordering::SeqCst);
                        }
                        if tx.send((i, r)).is_err() {
                            break;
                        }
                    }
                });
            }
            drop(tx);
            for (i, r) in rx {
                match r {
                    Ok(r) => {
                        // Results hold only strings, numbers and actions: serialising cannot fail.
                        let mut line = serde_json::to_string(&r).unwrap_or_default();
                        line.push('\n');
                        if let Err(e) = file.write_all(line.as_bytes()).and_then(|()| file.flush()) {
                            stop.store(true, Ordering::SeqCst);
                            return Err(io(e));
                        }
                        done.insert(key(&episodes[i]), r);
                        bar.inc(1);
                    }
                    Err(error) => {
                        let e = &episodes[i];
                        tracing::debug!(episode = %e.episode.id, %error, "agent failed; stopping");
                        first_error.get_or_insert(RunError::Agent { id: e.episode.id.clone(), line: e.line, error });
                    }
                }
            }
            Ok(())
        })?;
    }
    bar.finish_and_clear();
    if let Some(e) = first_error {
        return Err(e);
    }
    episodes
        .iter()
        .map(|e| {
            done.remove(&key(e)).ok_or_else(|| RunError::Results {
                path: results.to_path_buf(),
                line: 0,
                reason: format!("episode {} was not evaluated", e.episode.id),
            })
        })
        .collect()
}

/// The results already in `path` (none when it does not exist). A last line that does not parse (a
/// crash mid-write) is dropped from the file; results of another mode are an error.
pub fn read_results(path: &Path, mode: Mode) -> Result<Vec<EpisodeResult>, RunError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(RunError::Io { path: path.to_path_buf(), source }),
    };
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let mut out = Vec::new();
    let mut keep = 0usize;
    for (n, raw) in lines.iter().enumerate() {
        let last = n + 1 == lines.len();
        if raw.trim().is_empty() {
            keep += raw.len();
            continue;
        }
        match serde_json::from_str::<EpisodeResult>(raw.trim_end()) {
            Ok(r) if r.mode != mode => {
                return Err(RunError::Results {
                    path: path.to_path_buf(),
                    line: n + 1,
                    reason: format!("holds results of mode `{}`, not `{mode}`: use another --out", r.mode),
                })
            }
            Ok(r) if raw.ends_with('\n') || !last => {
                keep += raw.len();
                out.push(r);
            }
            // A complete result without its newline: keep it and end the line.
            Ok(r) => {
                keep += raw.len();
                out.push(r);
                return finish_file(path, &text, keep, true).map(|()| out);
            }
            Err(_) if last => {
                tracing::warn!(path = %path.display(), line = n + 1, "dropping a truncated last line; its episode is redone");
                return finish_file(path, &text, keep, false).map(|()| out);
            }
            Err(e) => {
                return Err(RunError::Results { path: path.to_path_buf(), line: n + 1, reason: e.to_string() });
            }
        }
    }
    Ok(out)
}

/// Rewrites `path` as its first `keep` bytes (plus a newline when `newline`).
fn finish_file(path: &Path, text: &str, keep: usize, newline: bool) -> Result<(), RunError> {
    let mut kept = text[..keep].to_string();
    if newline {
        kept.push('\n');
    }
    std::fs::write(path, kept).map_err(|source| RunError::Io { path: path.to_path_buf(), source })
}
