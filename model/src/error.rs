//! The model crate's error type: every variant names the file, tensor or limit involved and what to fix.

use std::path::PathBuf;

use askgui_kernels::TilingError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ModelError {
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("{path}: model_type `{model_type}` is not supported; askgui-model runs `qwen2_5_vl` (Qwen2.5-VL) and `qwen2_vl` (Qwen2-VL)")]
    UnsupportedModel { path: PathBuf, model_type: String },
    #[error("checkpoint {dir}: {reason}")]
    Checkpoint { dir: PathBuf, reason: String },
    #[error("checkpoint {dir}: tensor `{name}` is missing (looked for {tried})")]
    MissingTensor { dir: PathBuf, name: String, tried: String },
    #[error("checkpoint {dir}: tensor `{name}` has shape {got:?} but config.json implies {want:?}")]
    TensorShape { dir: PathBuf, name: String, got: Vec<usize>, want: Vec<usize> },
    #[error("LoRA adapter {dir}: {reason}")]
    Adapter { dir: PathBuf, reason: String },
    #[error("LoRA adapter {dir}: tensor `{name}` has shape {got:?} but the model's linear layer needs {want:?} (lora_A is (r, in), lora_B is (out, r)); the adapter was made for another model or rank")]
    AdapterShape { dir: PathBuf, name: String, got: Vec<usize>, want: Vec<usize> },
    #[error("LoRA: {0}")]
    AdapterState(String),
    #[error("LoRA training: {0}")]
    Train(String),
    #[error("hub model `{id}`: {reason}")]
    Hub { id: String, reason: String },
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("image {path}: {reason}")]
    Image { path: String, reason: String },
    #[error("image is {width}x{height}: {source}")]
    Tiling { width: usize, height: usize, source: TilingError },
    #[error("image is {width}x{height}: a side of fewer than {min_side} pixels has no structure to resize; pass a real screenshot")]
    ImageTooSmall { width: usize, height: usize, min_side: usize },
    #[error("image is {width}x{height} = {pixels} pixels, above the limit of {limit} pixels; downscale it or raise the limit")]
    ImageTooLarge { width: usize, height: usize, pixels: usize, limit: usize },
    #[error("prompt: {0}")]
    Prompt(String),
    #[error("--device {0}")]
    Device(String),
    #[error("generation: {0}")]
    Generation(String),
    #[error("the KV cache is full ({capacity} blocks in use): wait for running sequences to finish, or give the cache more memory")]
    KvCacheFull { capacity: usize },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;
