//! askgui-kernels: the ops the askgui model needs, each with a plain reference twin.
//!
//! Every op here exists first as a `*_reference` function written in plain candle tensor ops (or plain
//! Rust for image tiling). The references are the spec: they are differentiable through candle's autograd,
//! easy to read, and they are what the fast CustomOps (CPU and CUDA, added beside them) are tested against.
//!
//! - [`attention`]: scaled dot-product attention with causal / block-diagonal masks, key padding and GQA.
//! - [`norm`]: RMSNorm and LayerNorm.
//! - [`dropout`](mod@dropout): LoRA dropout's counter-based mask (Philox of seed, layer and element).
//! - [`rope`]: rotary embeddings, the multimodal M-RoPE of Qwen2-VL and the 2D rotary of its vision tower.
//! - [`tiling`]: Qwen2-VL image preprocessing (smart_resize, bicubic antialiased resize, normalise, patchify),
//!   batched; with the `cuda` feature also on the GPU (`tiling::cuda`), bit-exact with the CPU path.
//! - [`plan`]: every CUDA launch as plain data, run by the GPU executor (`cuda`) or, with the `cpu-exec`
//!   feature, by [`emu`], which executes the same `.cu` kernels on the CPU with sanitizer-style checks.

pub mod adamw;
pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dropout;
#[cfg(feature = "cpu-exec")]
pub mod emu;
pub mod norm;
pub mod ops;
pub mod plan;
pub mod rope;
pub mod selfcheck;
pub mod tiling;

pub use attention::{attention_reference, AttentionMask};
pub use dropout::{dropout_keep_reference, dropout_reference, DropoutKey};
pub use norm::{layer_norm_reference, rms_norm_reference};
pub use rope::{
    mrope_cos_sin_reference, mrope_interleaved_cos_sin_reference, rope_reference, vision_rope_cos_sin_reference,
};
pub use tiling::{smart_resize, TilingError};
