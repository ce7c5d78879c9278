//! The errors of the training library: each one says what to fix (which option, file and line, step).

use std::path::PathBuf;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TrainError {
    #[error("config: {0}")]
    Config(String),
    /// A command-line error or a `--help` request, for the binary to print as clap does.
    #[error("{0}")]
    Cli(Box<clap::Error>),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}: {reason} (pass --skip-bad-records to skip and count such lines)")]
    BadRecord { path: PathBuf, line: usize, reason: String },
    #[error("{path}:{line}: episode `{episode}` step {step}: screenshot {image} {reason}")]
    Image { path: PathBuf, line: usize, episode: String, step: usize, image: PathBuf, reason: String },
    #[error("data: {0}")]
    Data(String),
    #[error("merge: {0}")]
    Merge(String),
    #[error("convert-adapter: {0}")]
    Convert(String),
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error(
        "the {what} is {value} at step {step}{}; the run stopped and wrote no checkpoint of this step; the last \
         good checkpoint is {}",
        micro_batch.map(|m| format!(", micro-batch {m}")).unwrap_or_default(),
        last_checkpoint.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "none (none was written yet)".into())
    )]
    NonFinite {
        /// `loss`, `gradient norm` or `updated adapter`.
        what: &'static str,
        value: f64,
        step: usize,
        micro_batch: Option<usize>,
        last_checkpoint: Option<PathBuf>,
    },
    #[error(transparent)]
    Distributed(#[from] crate::distributed::DistributedError),
    #[error(transparent)]
    Model(#[from] askgui_model::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, TrainError>;

/// Wraps an io error with the path it is about.
pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> TrainError {
    let path = path.into();
    move |source| TrainError::Io { path, source }
}
