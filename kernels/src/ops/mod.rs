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
//! - [`norm`]: [`rms_norm`] / [`rms_norm_frozen`], [`layer_norm`] / [`layer_norm_frozen`].
//! - [`linear`]: [`frozen_linear`] (`x w^T`, gradient for `x` only).
//! - [`cross_entropy`]: [`cross_entropy_masked`] (mean NLL over supervised positions).
//! - [`attention`](mod@attention): [`attention()`](fn@attention) (streaming FlashAttention-2 softmax, GQA, masks).
//! - [`rope`](mod@rope): [`rope()`] (rotate-half RoPE, M-RoPE and vision tables; gradient for `x` only).
//!
//! CPU kernels accept f32 and f64 (f64 so that finite-difference checks are meaningful); other dtypes and
//! non-contiguous layouts are refused with a message that prints the shapes (the public wrappers make
//! inputs contiguous first). Run the tests with `cargo test -p askgui-kernels --test grad_ops`.

pub mod attention;
pub mod cross_entropy;
mod gemm;
#[cfg(feature = "cuda")]
mod gpu;
pub mod linear;
pub mod norm;
pub mod rope;

pub use attention::attention;
pub use cross_entropy::{cross_entropy_masked, cross_entropy_masked_reference};
pub use linear::{frozen_linear, frozen_linear_reference};
pub use norm::{layer_norm, layer_norm_frozen, rms_norm, rms_norm_frozen};
pub use rope::rope;

use candle_core::{bail, CpuStorage, Layout, Result, WithDType};

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

/// The error for inputs that are not all f32 or all f64: each input's name, dtype and shape.
pub(crate) fn dtype_mismatch(op: &str, inputs: &[(&str, &CpuStorage, &Layout)]) -> candle_core::Error {
    let got: Vec<String> =
        inputs.iter().map(|(what, s, l)| format!("{what} {} {:?}", dtype_name(s), l.shape())).collect();
    let names: Vec<&str> = inputs.iter().map(|i| i.0).collect();
    candle_core::Error::Msg(format!("{op}: {} must share f32 or f64 on CPU, got {}", names.join(", "), got.join(", ")))
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
