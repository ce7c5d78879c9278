//! The ops of the training forward: [`TrainCtx`] picks, op by op, what the vision tower and the decoder
//! run when they are given one (`train: Option<&TrainCtx>`; `None` is the inference path).
//!
//! Key choice: by default the kernels' CustomOps with an explicit backward (`frozen_linear` for a base
//! `W`, a frozen bias add, `rms_norm_frozen` / `layer_norm_frozen`, `attention`, `rope`), so that
//! gradients flow through the LoRA `Var`s only and no base weight gets a gradient; in full training the
//! ops' `Params::Trained` variants and candle's matmul; with `--kernels reference` ([`KernelChoice`]) the
//! ops' plain-candle twins through candle's autograd. LoRA dropout (PEFT's `lora_dropout`) is inverted
//! dropout on the adapter's input whose mask is hashed inside the op from (step seed, layer, element)
//! ([`askgui_kernels::dropout`]). This sits below [`crate::text`] and [`crate::vision`], which take it;
//! the loss and the trainable adapters are [`crate::train`].

use std::rc::Rc;

use askgui_kernels::{ops, AttentionMask, DropoutKey};
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

use crate::attention_memo::{AttentionMemo, Next};
use crate::device::KernelChoice;
use crate::error::{ModelError, Result};
use crate::layers::{matmul_t, Linear};

/// [`crate::StepOptions::vision_rows`] by default: a 1080x2400 phone screenshot at the default pixel budget
/// is 5,088 patch rows, so each runs alone, and the demo's small screens run a whole batch at once.
pub(crate) const VISION_ROWS: usize = 8192;

/// State of one training forward: the LoRA dropout probability and its seed, and which ops run.
pub struct TrainCtx {
    dropout: f64,
    /// The step's dropout seed ([`crate::StepOptions::dropout_seed`]).
    seed: u64,
    /// The first row of the stage's input that this context's linears see ([`Self::for_rows`]).
    row0: usize,
    /// Full training: the base weights are `Var`s and get gradients ([`crate::Qwen2Vl::make_base_trainable`]).
    pub(crate) full: bool,
    kernels: KernelChoice,
    /// [`crate::StepOptions::vision_rows`].
    pub(crate) vision_rows: usize,
    /// The attention forwards that checkpointing's recomputation replays; off unless
    /// [`crate::recompute::forward_backward`] turns it on.
    pub(crate) memo: Rc<AttentionMemo>,
}

impl TrainCtx {
    pub(crate) fn new(dropout: f64, seed: u64, kernels: KernelChoice) -> Result<Self> {
        if !(0.0..1.0).contains(&dropout) {
            return Err(ModelError::Train(format!("lora_dropout is {dropout}; it must be in [0, 1)")));
        }
        Ok(Self { dropout, seed, row0: 0, full: false, kernels, vision_rows: VISION_ROWS, memo: Rc::default() })
    }

    /// This context for the rows from `start` of a stage that runs range by range: its linears' inputs
    /// are rows `start..` of the stage's, so their dropout masks are those rows of the whole stage's (the
    /// split into ranges changes no mask), and the recomputation draws them again.
    pub(crate) fn for_rows(&self, start: usize) -> Self {
        Self { row0: start, memo: self.memo.clone(), ..*self }
    }

    pub(crate) fn reference(&self) -> bool {
        self.kernels == KernelChoice::Reference
    }

    /// RMSNorm of the training path: the op with a frozen weight, or with a trained one in full
    /// training (`Params::Trained`), or the reference, whose autograd covers both.
    pub(crate) fn rms_norm(&self, x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
        match (self.reference(), self.full) {
            (true, _) => askgui_kernels::rms_norm_reference(x, w, eps),
            (false, true) => ops::rms_norm(x, w, eps),
            (false, false) => ops::rms_norm_frozen(x, w, eps),
        }
    }

    /// LayerNorm of the training path, like [`Self::rms_norm`].
    pub(crate) fn layer_norm(&self, x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
        match (self.reference(), self.full) {
            (true, _) => askgui_kernels::layer_norm_reference(x, w, b, eps),
            (false, true) => ops::layer_norm(x, w, b, eps),
            (false, false) => ops::layer_norm_frozen(x, w, b, eps),
        }
    }

    /// Rotary embedding of the training path (the tables never need a gradient).
    pub(crate) fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        match self.reference() {
            true => askgui_kernels::rope_reference(x, cos, sin),
            false => ops::rope(x, cos, sin),
        }
    }

    /// Attention of the training path. The reference keeps the `Tq x Tk` scores for the backward. The op
    /// keeps its forward for checkpointing's recomputation when [`Self::memo`] records, and replays it
    /// there.
    pub(crate) fn attention(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        mask: AttentionMask,
        key_padding: Option<&Tensor>,
        scale: f64,
    ) -> candle_core::Result<Tensor> {
        if self.reference() {
            return askgui_kernels::attention_reference(q, k, v, mask, key_padding, scale);
        }
        match self.memo.next() {
            Next::Compute => ops::attention(q, k, v, mask, key_padding, scale),
            Next::Replay(saved) => ops::attention_replay(q, k, v, (mask, key_padding, scale), saved),
            Next::Record(key) => {
                let (o, saved) = ops::attention_saving(q, k, v, mask, key_padding, scale)?;
                if let Some(saved) = saved {
                    self.memo.save(key, saved);
                }
                Ok(o)
            }
        }
    }

    /// `x W^T` with `W` frozen. Through the reference candle's backward also computes (and drops) a
    /// gradient for `W`: correct, one weight-sized buffer more per linear.
    pub(crate) fn frozen_linear(&self, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        match self.reference() {
            true => ops::frozen_linear_reference(x, w),
            false => ops::frozen_linear(x, w),
        }
    }

    /// The mean masked next-token cross-entropy.
    pub(crate) fn cross_entropy(&self, logits: &Tensor, labels: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        match self.reference() {
            true => ops::cross_entropy_masked_reference(logits, labels, mask),
            false => ops::cross_entropy_masked(logits, labels, mask),
        }
    }

    /// Inverted dropout on the input of linear `name`: each element kept with probability `1 - p` and
    /// scaled by `1 / (1 - p)`. The mask is a hash of the step's seed, the layer (FNV-1a of its name:
    /// each linear runs once per forward) and the element's index in the stage's input, computed inside
    /// the op, so gradient checkpointing's recomputation draws the same mask with no host work.
    fn dropout(&self, name: &str, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.dropout == 0.0 {
            return Ok(x.clone());
        }
        // Rows of `x (.., d)` count from the stage's row `row0`.
        let d = x.dims().last().copied().unwrap_or(1) as u64;
        let key = DropoutKey { seed: self.seed, layer: layer_id(name), offset: self.row0 as u64 * d };
        match self.reference() {
            true => askgui_kernels::dropout_reference(x, self.dropout, key),
            false => ops::dropout(x, self.dropout, key),
        }
    }
}

/// A linear's dropout layer id: the 64-bit FNV-1a hash of its checkpoint name.
fn layer_id(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// `y (.., out) + bias (out)` with the bias frozen: the gradient passes to `y` only.
struct FrozenBias(Vec<f64>);

impl CustomOp1 for FrozenBias {
    fn name(&self) -> &'static str {
        "frozen_bias"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = self.0.len();
        let Some((start, end)) = l.contiguous_offsets() else { bail!("frozen_bias: input must be contiguous") };
        if l.dims().last() != Some(&d) {
            bail!("frozen_bias: input {:?} does not end in the bias size {d}", l.dims());
        }
        let out = match s {
            CpuStorage::F32(v) => {
                CpuStorage::F32(v[start..end].iter().enumerate().map(|(i, &x)| x + self.0[i % d] as f32).collect())
            }
            CpuStorage::F64(v) => {
                CpuStorage::F64(v[start..end].iter().enumerate().map(|(i, &x)| x + self.0[i % d]).collect())
            }
            _ => bail!("frozen_bias: only f32 and f64 are supported"),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad_res.clone()))
    }
}

impl Linear {
    /// [`Self::forward`] (`train` None) or [`Self::forward_train`].
    pub(crate) fn forward_with(&self, x: &Tensor, train: Option<&TrainCtx>) -> candle_core::Result<Tensor> {
        match train {
            None => self.forward(x),
            Some(ctx) => self.forward_train(x, ctx),
        }
    }

    /// Training twin of [`Linear::forward`]: `x W^T + b` with `W`, `b` frozen, plus the active adapter's
    /// `scale * (dropout(x) A^T) B^T`, differentiable through `A` and `B`.
    /// In full training `W` and `b` are `Var`s: candle's own matmul and broadcast add, whose backward
    /// gives their gradients.
    pub(crate) fn forward_train(&self, x: &Tensor, ctx: &TrainCtx) -> candle_core::Result<Tensor> {
        if self.scales.is_some() {
            candle_core::bail!("{}: int8 weights are for inference; train on the float checkpoint", self.name)
        }
        // (..., in) -> (..., out)
        let y = match (ctx.full, &self.bias) {
            (true, Some(b)) => matmul_t(x, &self.weight)?.broadcast_add(b)?,
            (true, None) => matmul_t(x, &self.weight)?,
            // On CUDA, in bf16 and with the references, candle's broadcast add: its extra bias gradient is
            // one row of `out` floats.
            (false, Some(b))
                if !x.device().is_cpu() || ctx.reference() || !matches!(x.dtype(), DType::F32 | DType::F64) =>
            {
                ctx.frozen_linear(x, &self.weight)?.broadcast_add(b)?
            }
            (false, Some(b)) => ctx
                .frozen_linear(x, &self.weight)?
                .contiguous()?
                .apply_op1(FrozenBias(b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?))?,
            (false, None) => ctx.frozen_linear(x, &self.weight)?,
        };
        match self.lora.active_delta() {
            Some(d) => y + d.forward(&ctx.dropout(&self.name, x)?)?,
            None => Ok(y),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapter_slot::{LoraDelta, LoraSlot};
    use crate::recompute::{forward_backward, Stage};
    use candle_core::{Device, Var};
    use std::ops::Range;

    /// A chain of two attention stages (the second row-wise, in two ranges) and a loss: with
    /// checkpointing, the recomputation replays the three attention forwards of the forward and gives
    /// bitwise the gradients of computing them again, within 1e-12 of the chain without checkpointing
    /// (f64; candle may add the gradients in another order), and the step ends with nothing kept.
    /// A run's loss, its parameters' gradients, and the memo's `(kept, replayed)` counts at its end.
    type Run = (f64, Vec<Vec<f64>>, (usize, usize));

    #[test]
    fn checkpointing_replays_the_attention_forwards() -> Result<()> {
        let dev = Device::Cpu;
        // x (3, 5, 4): three heads' rows of five positions.
        let x0 = Tensor::arange(0f64, 60.0, &dev)?.reshape((3, 5, 4))?.affine(0.05, -1.4)?.sin()?;
        let w: Vec<Var> =
            (0..3).map(|i| Var::from_tensor(&(x0.narrow(0, i, 1).unwrap() + 0.5).unwrap()).unwrap()).collect();
        let att = |ctx: &TrainCtx, x: &Tensor, w: &Var| -> candle_core::Result<Tensor> {
            // (n, 5, 4) -> (1, n, 5, 4): q scaled by the parameter, k = v = x.
            let (q, kv) = (x.broadcast_mul(w.as_tensor())?.unsqueeze(0)?, x.unsqueeze(0)?);
            ctx.attention((&q, &kv, &kv), AttentionMask::Causal, None, 0.5)?.squeeze(0)
        };
        let run = |checkpointing: bool, memo: bool| -> Result<Run> {
            let ctx = TrainCtx::new(0.0, 0, KernelChoice::Askgui)?;
            let stages = vec![
                Stage::new(true, |x: &Tensor| Ok(att(&ctx, x, &w[0])?)),
                Stage::rowwise(true, vec![0..1, 1..3], |r: &Range<usize>, x: &Tensor| {
                    Ok(att(&ctx.for_rows(r.start), x, &w[1])?)
                }),
                Stage::new(true, |x: &Tensor| Ok(x.broadcast_mul(w[2].as_tensor())?.sum_all()?)),
            ];
            let memo_arg = memo.then_some(&*ctx.memo);
            let (loss, g) = forward_backward(&x0, &stages, &w, (checkpointing, memo_arg))?;
            let grads =
                w.iter().map(|v| g.get(v.as_tensor()).unwrap().flatten_all()?.to_vec1::<f64>()).collect::<Vec<_>>();
            Ok((loss.to_scalar::<f64>()?, grads.into_iter().collect::<candle_core::Result<_>>()?, ctx.memo.counts()))
        };
        let (l_graph, g_graph, _) = run(false, true)?;
        let (l_plain, g_plain, counts_plain) = run(true, false)?;
        let (l_memo, g_memo, counts_memo) = run(true, true)?;
        assert_eq!(counts_plain, (0, 0), "without a memo nothing is kept");
        assert_eq!(counts_memo, (0, 3), "three forwards replayed, none left");
        assert_eq!(l_memo.to_bits(), l_plain.to_bits());
        assert_eq!(g_memo, g_plain, "replayed gradients differ from recomputed ones");
        assert!((l_memo - l_graph).abs() < 1e-12);
        for (a, b) in g_memo.iter().flatten().zip(g_graph.iter().flatten()) {
            assert!((a - b).abs() < 1e-12, "{a} vs {b}");
        }
        Ok(())
    }

    /// Deterministic values in [-1, 1): a sine of the index, for shapes below.
    fn values(dims: &[usize], phase: f64) -> candle_core::Result<Tensor> {
        let n = dims.iter().product::<usize>();
        Tensor::arange(0f64, n as f64, &Device::Cpu)?.affine(0.731, phase)?.sin()?.to_dtype(DType::F32)?.reshape(dims)
    }

    /// A LoRA linear `(13 -> 11)` with a bias, rank 3, scale 2, B non-zero so that A gets a gradient.
    fn lora_linear() -> candle_core::Result<(Linear, Var, Var)> {
        let (a, b) = (Var::from_tensor(&values(&[3, 13], 0.3)?)?, Var::from_tensor(&(values(&[11, 3], 0.7)? * 0.5)?)?);
        let delta = LoraDelta { a: a.as_tensor().clone(), b: b.as_tensor().clone(), scale: 2.0 };
        let lora = LoraSlot { adapters: [("t".to_string(), delta)].into(), active: Some("t".into()), merged: None };
        let (weight, bias) = (values(&[11, 13], 1.1)?, Some(values(&[11], 1.9)?));
        Ok((Linear { name: "model.layers.2.mlp.up_proj".into(), weight, bias, scales: None, lora }, a, b))
    }

    /// A LoRA step through the op's dropout equals the step written out by hand with the same mask (the
    /// reference's keep bits for this seed, layer and rows): `y = x W^T + b + 2 ((x m / (1 - p)) A^T) B^T`,
    /// loss `sum(y r)`, gradients of x, A and B within 1e-5 of their largest magnitude (f32, another
    /// summation order through candle's matmul backward). The reference kernels give the same; a second
    /// forward (checkpointing's recomputation) gives the same bits; the rows from 4 run alone through
    /// [`TrainCtx::for_rows`] give those rows of the whole.
    #[test]
    fn lora_step_with_dropout_equals_the_reference_step_with_its_mask() -> Result<()> {
        let (p, seed, dims) = (0.3, 77, [7usize, 13]);
        let (linear, a, b) = lora_linear()?;
        let x = Var::from_tensor(&values(&dims, 0.1)?)?;
        let r = values(&[7, 11], 2.3)?;
        let step = |y: &Tensor| -> candle_core::Result<(f32, Vec<Vec<f32>>)> {
            let loss = (y * &r)?.sum_all()?;
            let g = loss.backward()?;
            let mut grads = Vec::new();
            for v in [&x, &a, &b] {
                grads.push(g.get(v.as_tensor()).expect("a gradient").flatten_all()?.to_vec1::<f32>()?);
            }
            Ok((loss.to_scalar::<f32>()?, grads))
        };
        let key = DropoutKey { seed, layer: layer_id(&linear.name), offset: 0 };
        let keep = askgui_kernels::dropout_keep_reference(7 * 13, p, key)?;
        let m: Vec<f32> = keep.iter().map(|&k| if k { (1.0 / (1.0 - p)) as f32 } else { 0.0 }).collect();
        assert!(keep.iter().any(|k| !k) && keep.iter().any(|&k| k), "the mask keeps all or nothing");
        let xm = (x.as_tensor() * Tensor::from_vec(m, dims.as_slice(), &Device::Cpu)?)?;
        let lora = xm.matmul(&a.as_tensor().t()?)?.matmul(&b.as_tensor().t()?)?;
        let base = x.as_tensor().matmul(&linear.weight.t()?)?.broadcast_add(linear.bias.as_ref().unwrap())?;
        let (l_ref, g_ref) = step(&(base + (lora * 2.0)?)?)?;
        for kernels in [KernelChoice::Askgui, KernelChoice::Reference] {
            let ctx = TrainCtx::new(p, seed, kernels)?;
            let y = linear.forward_train(x.as_tensor(), &ctx)?;
            let (l, g) = step(&y)?;
            assert!((l - l_ref).abs() <= 1e-5 * l_ref.abs(), "{kernels:?}: loss {l} vs {l_ref}");
            for (name, (g, want)) in ["x", "A", "B"].iter().zip(g.iter().zip(&g_ref)) {
                let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let worst = g.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(worst <= 1e-5 * scale, "{kernels:?} grad {name}: {worst} (scale {scale})");
            }
            let again = linear.forward_train(x.as_tensor(), &ctx)?;
            let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
                Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
            };
            assert_eq!(bits(&again)?, bits(&y)?, "{kernels:?}: the recomputation drew another mask");
            let whole = ctx.dropout(&linear.name, x.as_tensor())?;
            let rows = ctx.for_rows(4).dropout(&linear.name, &x.as_tensor().narrow(0, 4, 3)?)?;
            assert_eq!(bits(&rows)?, bits(&whole.narrow(0, 4, 3)?)?, "{kernels:?}: rows 4.. alone drew another mask");
        }
        Ok(())
    }
}
