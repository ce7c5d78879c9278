//! askgui-train: LoRA fine-tuning of Qwen2.5-VL / Qwen2-VL GUI agents on askgui episodes.
//!
//! [`config`] (clap + serde options, TOML files, presets), [`data`] (episodes -> token ids with a loss
//! mask, the data order), [`optim`] (AdamW, the warmup + cosine schedule, clipping), [`snapshot`]
//! (atomic training snapshots: the PEFT-format adapter with the optimiser and trainer state),
//! [`check_gpu`] (every kernel against its reference on a device), [`merge`] (an adapter folded into a
//! plain Hugging Face checkpoint), [`convert_adapter`] (an adapter's keys rewritten for another stack),
//! [`adapter_card`] (`askgui.json`, the prompt and image settings beside each adapter), [`plot`]
//! (curves.svg), [`bpe`] (a small tokenizer learned from a corpus), [`init`] (random models),
//! [`agent_eval`] (the agent metrics and sample prediction of the periodic eval, through askgui-eval), [`pack`]
//! (`--packing`: a step's sequences grouped into padding-free packs), [`prefetch`] (the next micro-batches
//! made on a background thread while a step runs) and [`trainer`] (the loop). The model's training path (LoRA `Var`s, loss and gradients) is askgui-model's;
//! prompts are askgui-data's, the same code that serve and eval use, so a model is trained on exactly the
//! prompts it will be asked.

pub mod adapter_card;
pub mod agent_eval;
pub mod alloc;
pub mod bpe;
pub mod check_gpu;
pub mod cli;
pub mod config;
pub mod convert_adapter;
pub mod data;
pub mod data_parallel;
pub mod demo;
pub mod distributed;
pub mod error;
pub mod init;
pub mod interrupt;
pub mod lock;
pub mod merge;
pub mod micro_threads;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod optim;
pub mod pack;
pub mod plot;
pub mod prefetch;
pub mod rendezvous;
pub mod snapshot;
pub mod trainer;

pub use config::{Mode, Preset, RunControl, TrainConfig};
pub use error::{Result, TrainError};
pub use trainer::{train, StepLog, TrainSummary};
