//! The LoRA state one linear layer holds: each loaded adapter's low-rank delta ([`LoraDelta`]), which one
//! is active and which one is merged into the weight ([`LoraSlot`]).
//!
//! Key choice: this sits below [`crate::layers`] so that `Linear` can hold and apply adapters without
//! knowing where they come from; reading, merging and switching them is [`crate::lora`] (the PEFT format is
//! [`crate::peft`]), and making them trainable is [`crate::train`]. A delta is `scale * (x A^T) B^T` with
//! `A (r, in)`, `B (out, r)` (Hu et al. 2021, "LoRA"; PEFT's `LoraLayer`).

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};

/// The dtype trainable adapter weights are kept in: f32 master copies for a half-precision (bf16 / f16)
/// model, so that small AdamW updates are not rounded away; the model's own dtype otherwise.
pub fn master_dtype(model: DType) -> DType {
    match model {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// One adapter's low-rank update of one linear: `A (r, in)`, `B (out, r)`.
#[derive(Debug, Clone)]
pub struct LoraDelta {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
}

impl LoraDelta {
    /// `x (..., in) -> scale * (x A^T) B^T (..., out)`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        // Trainable adapters of a bf16 model keep f32 masters ([`master_dtype`]): the product runs
        // in the adapter's dtype and comes back in the activations' (both casts are differentiable). On
        // the CPU, which has no bf16 matmul, a bf16 adapter (loaded for inference) runs in f32 too.
        let dtype = x.dtype();
        let master = match x.device().is_cpu() {
            true => master_dtype(self.a.dtype()),
            false => self.a.dtype(),
        };
        let x = if dtype == master { x.clone() } else { x.to_dtype(master)? };
        let (a, b) = (self.a.to_dtype(master)?, self.b.to_dtype(master)?);
        // (..., in) -> (..., r) -> (..., out)
        let y = (x.broadcast_matmul(&a.t()?)?.broadcast_matmul(&b.t()?)? * self.scale)?;
        if dtype == master {
            Ok(y)
        } else {
            y.to_dtype(dtype)
        }
    }

    /// `scale * B A`, `(out, in)`, computed in f32 and returned in `dtype`.
    pub(crate) fn dense(&self, dtype: DType) -> candle_core::Result<Tensor> {
        (self.b.to_dtype(DType::F32)?.matmul(&self.a.to_dtype(DType::F32)?)? * self.scale)?.to_dtype(dtype)
    }
}

/// The adapters loaded for one linear layer.
#[derive(Debug, Clone, Default)]
pub struct LoraSlot {
    pub(crate) adapters: BTreeMap<String, LoraDelta>,
    pub(crate) active: Option<String>,
    /// The merged adapter's name and the original weight it replaced.
    pub(crate) merged: Option<(String, Tensor)>,
}

impl LoraSlot {
    /// The delta to add in the forward: the active adapter's, unless it is already merged into `W`.
    pub fn active_delta(&self) -> Option<&LoraDelta> {
        let name = self.active.as_deref()?;
        if self.merged.as_ref().is_some_and(|(m, _)| m == name) {
            return None;
        }
        self.adapters.get(name)
    }
}
