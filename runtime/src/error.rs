//! What can go wrong in one agent step or completion, by whose fault: the input's (a screenshot the
//! processor cannot take, a prompt past the context), the caller's (it went away), or ours.

use askgui_model::ModelError;
use thiserror::Error;

#[derive(Debug, Clone, Error, PartialEq)]
pub enum RuntimeError {
    /// The input cannot be answered as it is (a request, or the files and flags the model was loaded
    /// from); the message says what to change.
    #[error("{0}")]
    BadInput(String),
    #[error("the prompt is {tokens} tokens but the model's context is {limit}; shorten the history or the messages")]
    ContextOverflow { tokens: usize, limit: usize },
    /// The caller's `cancelled` said so.
    #[error("the client went away")]
    Cancelled,
    /// No room in the KV cache for this prompt now; the running sequences will make some.
    #[error("the KV cache is full ({capacity} blocks in use); retry shortly, or raise the cache's size")]
    KvCacheFull { capacity: usize },
    #[error("internal error: {0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, RuntimeError>;

impl From<ModelError> for RuntimeError {
    /// A failing tensor op, generation or training step is ours; every other variant names what the user
    /// gave (a checkpoint, adapter, tokenizer, hub id, device, image or prompt) and says what to fix.
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Candle(_) | ModelError::Generation(_) | ModelError::Train(_) => {
                RuntimeError::Internal(e.to_string())
            }
            ModelError::KvCacheFull { capacity } => RuntimeError::KvCacheFull { capacity },
            e => RuntimeError::BadInput(e.to_string()),
        }
    }
}

impl From<candle_core::Error> for RuntimeError {
    fn from(e: candle_core::Error) -> Self {
        RuntimeError::Internal(e.to_string())
    }
}
