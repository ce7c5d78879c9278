//! Small building blocks shared by the vision tower and the decoder: a linear layer over a frozen weight,
//! the activations, and the inference path's norms, rotary embedding and attention.
//!
//! Linear is ours (not candle-nn's) so that LoRA can wrap it: each one knows its hub-layout checkpoint
//! name and holds the LoRA deltas loaded for it ([`crate::adapter_slot`]); with none loaded its forward
//! is exactly `x W^T + b`. A batch that mixes adapters applies each row's own ([`Linear::forward_rows`]).
//! Its training forward is [`crate::train_ops`]. The norms, rope and attention
//! take the kernels' CustomOp where it has a kernel for the device and dtype, else the plain-candle
//! reference (`--kernels reference` always), chosen per call from the model's [`KernelChoice`].

use askgui_kernels::{attention_reference, ops, AttentionMask};
use candle_core::{DType, Result, Tensor};

use crate::adapter_slot::{LoraSlot, RowAdapters};
use crate::config::VisionAct;
use crate::device::KernelChoice;
use crate::weights::Weights;

/// `y = x W^T + b (+ scale * (x A^T) B^T for the active LoRA adapter)` with `W (out, in)`.
#[derive(Debug, Clone)]
pub struct Linear {
    /// Hub-layout checkpoint name without `.weight`, e.g. `model.layers.0.self_attn.q_proj`.
    pub name: String,
    /// `W (out, in)`; with [`Self::scales`], int8 as `q + 128` (u8).
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// The per-row scales of an int8 weight ([`Self::quantize_int8`]); `None` for a float weight.
    pub scales: Option<Tensor>,
    /// LoRA adapters loaded for this layer (empty for the base model).
    pub lora: LoraSlot,
}

impl Linear {
    pub fn load(w: &Weights, name: &str, in_dim: usize, out_dim: usize, bias: bool) -> crate::error::Result<Self> {
        Ok(Self {
            name: name.to_string(),
            lora: LoraSlot::default(),
            scales: None,
            weight: w.get(&format!("{name}.weight"), &[out_dim, in_dim])?,
            bias: if bias { Some(w.get(&format!("{name}.bias"), &[out_dim])?) } else { None },
        })
    }

    /// `x (..., in) -> (..., out)`, with the active adapter's delta.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.base(x)?;
        match self.lora.active_delta() {
            Some(d) => y + d.forward(x)?,
            None => Ok(y),
        }
    }

    /// [`Self::forward`] with each row's own adapter (`rows`; None: the active adapter). One adapter for
    /// all rows is the path of [`Self::forward`]. Mixed rows: the base product once over all rows, then
    /// for each adapter its rows gathered, `scale * (x A^T) B^T` on them, added back at their places.
    pub fn forward_rows(&self, x: &Tensor, rows: Option<&RowAdapters>) -> Result<Tensor> {
        let (n, groups) = match rows {
            None => return self.forward(x),
            Some(RowAdapters::Uniform(name)) => {
                let y = self.base(x)?;
                return match self.lora.delta(name.as_deref()) {
                    Some(d) => y + d.forward(x)?,
                    None => Ok(y),
                };
            }
            Some(RowAdapters::Mixed { runs, groups }) => (runs.iter().map(|r| r.0).sum::<usize>(), groups),
        };
        let y = self.base(x)?;
        let dims = y.dims().to_vec();
        let (inp, out) = (x.dim(x.rank() - 1)?, y.dim(y.rank() - 1)?);
        if x.elem_count() != n * inp {
            candle_core::bail!("{}: {:?} rows for a plan of {n} rows of adapters", self.name, x.dims())
        }
        // (..., in) -> (N, in); (..., out) -> (N, out)
        let x = x.reshape((n, inp))?;
        let mut y = y.reshape((n, out))?;
        for (name, idx) in groups {
            if let Some(d) = self.lora.delta(Some(name)) {
                y = y.index_add(idx, &d.forward(&x.index_select(idx, 0)?)?, 0)?;
            }
        }
        y.reshape(dims)
    }

    /// `x W^T + b`, no adapter.
    fn base(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.scales {
            Some(scales) => ops::int8_linear(x, &self.weight, scales)?,
            None => matmul_t(x, &self.weight)?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

impl Linear {
    /// Replaces the weight by its int8 weight-only quantisation (per output row, [`ops::quantize_int8`]):
    /// a quarter of f32's bytes. Inference only; the bias and LoRA deltas stay as they are.
    pub fn quantize_int8(&mut self) -> Result<()> {
        if self.scales.is_none() {
            let (q, scales) = ops::quantize_int8(&self.weight)?;
            (self.weight, self.scales) = (q, Some(scales));
        }
        Ok(())
    }
}

/// `x (.., in) @ w (out, in)^T -> (.., out)`. candle 0.11 has no bf16 matmul on the CPU: there a frozen
/// `w` goes through [`ops::frozen_linear`] (the f32 GEMM, gradient for `x` only), a trained one (a `Var`
/// in full training) through f32 casts, which candle's autograd differentiates in both operands.
pub(crate) fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let cpu_bf16 = x.device().is_cpu() && x.dtype() == DType::BF16;
    match (cpu_bf16, w.track_op()) {
        (false, _) => x.broadcast_matmul(&w.t()?),
        (true, false) => ops::frozen_linear(x, w),
        (true, true) => x.to_dtype(DType::F32)?.broadcast_matmul(&w.to_dtype(DType::F32)?.t()?)?.to_dtype(x.dtype()),
    }
}

pub fn activation(x: &Tensor, act: VisionAct) -> Result<Tensor> {
    match act {
        VisionAct::Silu => x.silu(),
        // x * sigmoid(1.702 x)
        VisionAct::QuickGelu => x.mul(&((x * -1.702)?.exp()? + 1.0)?.recip()?),
        VisionAct::Gelu => x.gelu_erf(),
        VisionAct::GeluTanh => x.gelu(),
    }
}

/// `act(gate) * up`, a gated MLP's activation, for inference and training alike: with SiLU the kernels'
/// one-pass op ([`ops::swiglu`], both gradients in one pass, `silu(gate)` never kept) where it has a
/// kernel, else candle's ops (equal to 1e-5, `kernels/tests/grad_ops.rs`).
pub(crate) fn gated(gate: &Tensor, up: &Tensor, act: VisionAct, kernels: KernelChoice) -> Result<Tensor> {
    match act {
        VisionAct::Silu if has_kernel(gate, kernels) => ops::swiglu(gate, up),
        _ => activation(gate, act)? * up,
    }
}

/// Whether the kernels' CustomOps take this tensor: on CPU f32 / f64 / bf16, on CUDA f32 / bf16 (the `cuda`
/// feature's kernels); elsewhere, and always with `--kernels reference`, the inference forward uses the
/// plain-candle references.
fn has_kernel(x: &Tensor, kernels: KernelChoice) -> bool {
    if kernels == KernelChoice::Reference {
        return false;
    }
    match x.device() {
        candle_core::Device::Cpu => matches!(x.dtype(), DType::F32 | DType::F64 | DType::BF16),
        candle_core::Device::Cuda(_) => matches!(x.dtype(), DType::F32 | DType::BF16),
        _ => false,
    }
}

/// RMSNorm for the inference forward: the kernels' op where it has a kernel, else the reference (equal
/// to 1e-6, `kernels/tests`): one pass over each row instead of five candle ops.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, kernels: KernelChoice) -> Result<Tensor> {
    match has_kernel(x, kernels) {
        true => ops::rms_norm_frozen(x, w, eps),
        false => askgui_kernels::rms_norm_reference(x, w, eps),
    }
}

/// LayerNorm for the inference forward, like [`rms_norm`].
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64, kernels: KernelChoice) -> Result<Tensor> {
    match has_kernel(x, kernels) {
        true => ops::layer_norm_frozen(x, w, b, eps),
        false => askgui_kernels::layer_norm_reference(x, w, b, eps),
    }
}

/// Rotary embedding for the inference forward, like [`rms_norm`].
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, kernels: KernelChoice) -> Result<Tensor> {
    match has_kernel(x, kernels) {
        true => ops::rope(x, cos, sin),
        false => askgui_kernels::rope_reference(x, cos, sin),
    }
}

/// Attention for the inference forward: the kernels' blocked-GEMM CustomOp (no `T x T` score matrix)
/// where it has a kernel (`has_kernel`), else the plain-candle reference. The two agree to 1e-6
/// (`kernels/tests/grad_attention.rs`) except on query rows that see no key at all (left-padding
/// positions of a batch), which the op sets to 0 and the reference to an average: no real token reads
/// those rows.
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: AttentionMask,
    key_padding: Option<&Tensor>,
    scale: f64,
    kernels: KernelChoice,
) -> Result<Tensor> {
    let has_kernel = has_kernel(q, kernels);
    let block_diagonal = matches!(mask, AttentionMask::BlockDiagonal(_));
    if has_kernel && !(block_diagonal && key_padding.is_some()) {
        ops::attention(q, k, v, mask, key_padding, scale)
    } else {
        attention_reference(q, k, v, mask, key_padding, scale)
    }
}
