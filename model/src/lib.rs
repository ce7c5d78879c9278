//! askgui-model: Qwen2.5-VL and Qwen2-VL in candle.
//!
//! Weight and tokenizer loading ([`weights`], [`chat`]), image preprocessing equal to transformers'
//! `Qwen2VLImageProcessor` ([`image`]), the vision tower ([`vision`]), the M-RoPE decoder with a KV cache
//! ([`text`]), the model that joins them ([`model`]) and batched generation ([`generate`](mod@generate)).
//! PEFT-format LoRA adapters ([`peft`]) are loaded, applied, merged and saved by [`lora`] (parity with PEFT
//! in `tests/lora.rs`) and trained through [`train`] (loss and gradients against PEFT in
//! `tests/lora_grad.rs`). The crate knows nothing about GUI actions. Correctness is measured against
//! Hugging Face transformers on tiny random checkpoints made by `scripts/fixtures/make_fixtures.py` (see
//! `tests/parity.rs`).
//!
//! Modules import only downwards, in this order: [`error`], [`attention_memo`]; [`adapter_slot`],
//! [`config`], [`device`], [`weights`], [`image`], [`peft`], [`recompute`]; [`chat`], [`layers`],
//! [`random_init`]; [`train_ops`]; [`text`]; [`vision`]; [`model`]; [`lora`], [`generate`](mod@generate),
//! [`train`].

pub mod adapter_slot;
pub mod attention_memo;
pub mod chat;
pub mod config;
pub mod device;
pub mod error;
pub mod generate;
pub mod image;
pub mod kv_cache;
pub mod layers;
pub mod lora;
pub mod model;
pub mod peft;
pub mod random_init;
pub mod recompute;
pub mod text;
pub mod train;
pub mod train_ops;
pub mod vision;
pub mod weights;

pub use chat::{render_chat, render_chat_with, Content, Message, QwenTokenizer};
pub use config::{Arch, ModelConfig};
pub use device::{bind_thread, pin_cpu_threads, DTypeChoice, DeviceKind, KernelChoice, LoadOptions, Quantize};
pub use error::{ModelError, Result};
pub use generate::{generate, FinishReason, Generation, Prompt, SamplingParams, Timings};
pub use image::{
    load_image, pixel_rows, preprocess, preprocess_batch, ImageProcessorConfig, PreprocessedBatch, ProcessedImage,
};
pub use kv_cache::{KvCache, KvPool, Reservation, KV_BLOCK};
pub use model::{mrope_positions, Qwen2Vl};
pub use peft::{AdapterLayout, LoraConfig};
pub use text::NewRows;
pub use train::{master_dtype, StepOptions, StepOutput, TrainExample};
pub use weights::{CheckpointFiles, Weights};
