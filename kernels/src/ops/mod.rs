//! Training-grade ops: candle `CustomOp`s with a real CPU forward and an explicit backward.
//!
//! Why: candle-nn's fused norms have no backward (the gradient silently stops), and candle's own backward
//! computes and keeps a gradient for every input of every tracked op, frozen base weights included. Each op
//! here returns `None` from `bwd` for inputs that must not be trained (frozen weights, labels, masks) and
//! for inputs that track no gradient at all, so the `GradStore` only holds what the optimiser needs.
//!
//! Every op sits beside its plain-candle `*_reference` twin (the spec, differentiable through candle's
//! autograd); the CustomOp is tested against the reference's forward and autograd gradient, and against
//! central finite differences in f64.
//!
//! - [`adamw`](mod@adamw): [`adamw_step`] (one fused AdamW update; inference of nothing, no gradient).
//! - [`norm`]: [`rms_norm`] / [`rms_norm_frozen`], [`layer_norm`] / [`layer_norm_frozen`].
//! - [`linear`]: [`frozen_linear`] (`x w^T`, gradient for `x` only).
//! - [`narrow`]: bf16 and int8 frozen weights read panel by panel ([`int8_linear`], inference only).
//! - [`cross_entropy`]: [`cross_entropy_masked`] (mean NLL over supervised positions).
//! - [`linear_cross_entropy`](mod@linear_cross_entropy): [`linear_cross_entropy()`](fn@linear_cross_entropy)
//!   (the LM head and the cross-entropy in row chunks, no `(N, V)` logits).
//! - [`dropout`](mod@dropout): [`dropout()`](fn@dropout) (inverted dropout, its mask hashed inside the op).
//! - [`attention`](mod@attention): [`attention()`](fn@attention) (streaming FlashAttention-2 softmax, GQA, masks).
//! - [`rope`](mod@rope): [`rope()`] (rotate-half RoPE, M-RoPE and vision tables; gradient for `x` only).
//! - [`swiglu`](mod@swiglu): [`swiglu()`] (`silu(gate) * up`, both gradients in one pass).
//! - [`paged_attention`](mod@paged_attention): decoding attention over a KV cache kept in blocks (inference only).
//!
//! CPU kernels accept f32, f64 (so that finite-difference checks are meaningful) and bf16 (the GPU's
//! dtype, because candle 0.11 has no bf16 CPU matmul): bf16 inputs are widened to f32 ([`f32_slice`]), the
//! f32 kernel runs, and each output is rounded to bf16 once ([`F32Out`]). Mixed dtypes and non-contiguous
//! layouts are refused with a message that prints the shapes (the public wrappers make inputs contiguous
//! first). Run the tests with `cargo test -p askgui-kernels --test grad_ops`.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod dropout;
pub mod exp;
mod gemm;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
pub mod linear;
pub mod linear_cross_entropy;
pub mod narrow;
pub mod norm;
pub mod paged_attention;
pub mod rope;
pub mod swiglu;

pub use adamw::adamw_step;
pub use attention::{attention, attention_replay, attention_saving, AttentionSaved};
pub use cross_entropy::{cross_entropy_masked, cross_entropy_masked_reference};
pub use dropout::dropout;
pub use linear::{frozen_linear, frozen_linear_reference, linear_parts};
pub use linear_cross_entropy::{linear_cross_entropy, linear_cross_entropy_reference};
pub use narrow::{dequantize_int8, int8_linear, narrow_linear_reference, quantize_int8};
pub use norm::{layer_norm, layer_norm_frozen, rms_norm, rms_norm_frozen};
pub use paged_attention::{
    paged_attention, paged_attention_forks, paged_attention_forks_reference, paged_attention_reference,
};
pub use rope::rope;
pub use swiglu::{swiglu, swiglu_reference};

use candle_core::{bail, CpuStorage, Layout, Result, WithDType};
use half::bf16;
use std::borrow::Cow;

/// The contiguous slice of `storage` described by `layout`, or an error naming the op and the input.
pub(crate) fn contiguous_slice<'a, T: WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &str,
    what: &str,
) -> Result<&'a [T]> {
    let data = T::cpu_storage_as_slice(storage)?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!(
            "{op}: `{what}` must be contiguous, got shape {:?} with strides {:?}",
            layout.shape(),
            layout.stride()
        ),
    }
}

/// How a CPU op computes on its float inputs, which share one storage dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Float {
    /// f64 storage: the kernel runs in f64.
    F64,
    /// f32 or bf16 storage: the kernel runs in f32 on [`f32_slice`]s; the output is stored as said.
    F32(F32Out),
}

/// The storage of an f32 kernel's output: the inputs' dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum F32Out {
    F32,
    /// Rounded once, to nearest even (`bf16::from_f32`): at most 2^-8 relative error (8 significant bits).
    Bf16,
}

impl Float {
    /// The dtype `inputs` share, or the error that names each input's dtype and shape.
    pub(crate) fn of(op: &str, inputs: &[(&str, &CpuStorage, &Layout)]) -> Result<Self> {
        let float = |s: &CpuStorage| match s {
            CpuStorage::F64(_) => Some(Self::F64),
            CpuStorage::F32(_) => Some(Self::F32(F32Out::F32)),
            CpuStorage::BF16(_) => Some(Self::F32(F32Out::Bf16)),
            _ => None,
        };
        let first = inputs.first().and_then(|i| float(i.1));
        match first {
            Some(f) if inputs.iter().all(|i| float(i.1) == Some(f)) => Ok(f),
            _ => Err(dtype_mismatch(op, inputs)),
        }
    }
}

impl F32Out {
    /// The kernel's f32 results as storage of the inputs' dtype.
    pub(crate) fn store(self, v: Vec<f32>) -> CpuStorage {
        match self {
            Self::F32 => CpuStorage::F32(v),
            Self::Bf16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        }
    }
}

/// The contiguous part of an f32 or bf16 `storage` described by `layout`, as f32: borrowed for f32,
/// widened (exactly) for bf16; an error naming the op and the input otherwise.
pub(crate) fn f32_slice<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str, what: &str) -> Result<Cow<'a, [f32]>> {
    match storage {
        CpuStorage::BF16(_) => {
            Ok(Cow::Owned(contiguous_slice::<bf16>(storage, layout, op, what)?.iter().map(|x| x.to_f32()).collect()))
        }
        _ => Ok(Cow::Borrowed(contiguous_slice::<f32>(storage, layout, op, what)?)),
    }
}

/// The error for inputs that are not all f32, all f64 or all bf16: each input's name, dtype and shape.
pub(crate) fn dtype_mismatch(op: &str, inputs: &[(&str, &CpuStorage, &Layout)]) -> candle_core::Error {
    let got: Vec<String> =
        inputs.iter().map(|(what, s, l)| format!("{what} {} {:?}", dtype_name(s), l.shape())).collect();
    let names: Vec<&str> = inputs.iter().map(|i| i.0).collect();
    candle_core::Error::Msg(format!(
        "{op}: {} must share one dtype, f32, f64 or bf16, on CPU; got {}",
        names.join(", "),
        got.join(", ")
    ))
}

/// The candle dtype name of a CPU storage, for error messages.
pub(crate) fn dtype_name(s: &CpuStorage) -> &'static str {
    match s {
        CpuStorage::F32(_) => "f32",
        CpuStorage::F64(_) => "f64",
        CpuStorage::F16(_) => "f16",
        CpuStorage::BF16(_) => "bf16",
        CpuStorage::U8(_) => "u8",
        CpuStorage::U32(_) => "u32",
        CpuStorage::I64(_) => "i64",
        _ => "an unsupported dtype",
    }
}
