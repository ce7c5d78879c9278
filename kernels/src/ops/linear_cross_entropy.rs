//! `linear_cross_entropy`: the LM head and the mean cross-entropy in row chunks, without the `(N, V)` logits.
//!
//! Why: the supervised rows' logits (V = 151,936 for Qwen) are a training step's largest activation, and
//! `lm_head` then [`cross_entropy_masked`](super::cross_entropy_masked) builds them whole, then their
//! gradient beside them. Here the rows go through in chunks of C: the chunk's logits `(C, V)`, its loss and,
//! when `h` or `w` needs a gradient, `g = (softmax - onehot) / N` (the cross-entropy's own backward op),
//! `dh_c = g w` and `dw += g^T h_c`. The gradients are computed in the forward, as Liger-Kernel's fused
//! linear cross-entropy does, so each chunk's logits are built once; the backward only scales them by the
//! upstream gradient. Peak memory: a chunk's logits and their gradient, plus `dh (N, H)` (and `dw (V, H)`
//! in f32 when `w` is trained), instead of `(N, V)` logits, probabilities and gradient.
//! Chunk rows: Liger's rule, the next power of two of `ceil(N / ceil(V / H))`, so that a chunk's logits
//! hold about as many values as `h`.
//!
//! Key choice: candle's `CustomOp`s see storages, not tensors, so the chunk loop is written with tensor
//! ops (the CPU GEMM of [`frozen_linear`], cuBLAS on CUDA, and the cross-entropy kernels of both) and runs
//! without a graph; the returned loss is that value plus [`KeptGrads`], a zero-valued op whose backward
//! hands out the kept `dh` and `dw`. The twin is [`linear_cross_entropy_reference`]: the full logits and
//! [`cross_entropy_masked_reference`](super::cross_entropy_masked_reference), through candle's autograd.
//! Tests: `cargo test -p askgui-kernels --test linear_cross_entropy`.

use super::cross_entropy::CrossEntropyMasked;
use super::linear::{frozen_linear, input_grad};
#[cfg(feature = "cuda")]
use candle_core::{backend::BackendDevice, backend::BackendStorage, CudaStorage};
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};
use half::bf16;

/// Liger-Kernel's chunk rows for `n` rows of width `h` against a vocabulary of `v`.
pub fn chunk_rows(n: usize, h: usize, v: usize) -> usize {
    n.div_ceil(v.div_ceil(h.max(1)).max(1)).max(1).next_power_of_two()
}

/// Mean next-token cross-entropy of `h (N, H) @ w (V, H)^T` against `labels (N)` (u32; every row
/// supervised), in chunks of `chunk` rows ([`chunk_rows`] when `None`). Gradients for `h` and for `w`
/// when they track one (a frozen `w` gets none). `h` and `w` f32, f64 or bf16, of one dtype.
pub fn linear_cross_entropy(h: &Tensor, w: &Tensor, labels: &Tensor, chunk: Option<usize>) -> Result<Tensor> {
    let ((n, d), (v, wd)) = (h.dims2()?, w.dims2()?);
    if d != wd || labels.dims() != [n] {
        bail!(
            "linear_cross_entropy: expected h (N, H), w (V, H), labels (N); got {:?}, {:?}, {:?}",
            h.shape(),
            w.shape(),
            labels.shape()
        )
    }
    if n == 0 {
        bail!("linear_cross_entropy: no row to take the loss of (h is {:?})", h.shape())
    }
    let chunk = chunk.unwrap_or_else(|| chunk_rows(n, d, v)).max(1);
    let (need_dh, need_dw) = (h.track_op(), w.track_op());
    let (hc, wc) = (h.detach().contiguous()?, w.detach().contiguous()?);
    let labels = labels.detach().contiguous()?;
    // Every row supervised: the cross-entropy's mask, narrowed for the last chunk.
    let ones = Tensor::ones(chunk.min(n), hc.dtype(), hc.device())?;
    // The loss sums in f64 for f64 inputs, in f32 otherwise.
    let sum_dtype = if h.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let (mut total, mut dh, mut dw) = (None::<Tensor>, Vec::new(), None::<Tensor>);
    for start in (0..n).step_by(chunk) {
        let c = chunk.min(n - start);
        let (h_c, labels_c) = (hc.narrow(0, start, c)?, labels.narrow(0, start, c)?);
        let ones = ones.narrow(0, 0, c)?;
        // (C, H) @ (V, H)^T -> (C, V); the chunk's mean loss, weighted by its share of the rows.
        let logits = frozen_linear(&h_c, &wc)?;
        let ce = CrossEntropyMasked::new(None);
        let loss_c = (logits.apply_op3_no_bwd(&labels_c, &ones, &ce)?.to_dtype(sum_dtype)? * c as f64)?;
        total = Some(match total {
            Some(t) => (t + loss_c)?,
            None => loss_c,
        });
        if !(need_dh || need_dw) {
            continue;
        }
        // (C, V): (softmax - onehot) / N, the backward op's `grad / n_supervised` with grad = C / N.
        let g = logits.apply_op3_no_bwd(&labels_c, &ones, &ce.backward_op(c as f64 / n as f64))?;
        drop(logits);
        if need_dh {
            dh.push(input_grad(&g, &wc)?);
        }
        if need_dw {
            let part = gram(&g, &h_c)?;
            dw = Some(match dw {
                Some(acc) => (acc + part)?,
                None => part,
            });
        }
    }
    let loss = (total.expect("n > 0: one chunk at least") / n as f64)?.to_dtype(h.dtype())?;
    if !(need_dh || need_dw) {
        return Ok(loss);
    }
    let kept = KeptGrads {
        dh: need_dh.then(|| Tensor::cat(&dh, 0)).transpose()?,
        dw: dw.map(|dw| dw.to_dtype(w.dtype())).transpose()?,
    };
    loss + h.apply_op2(w, kept)?
}

/// `g^T h_c`: `(C, V)^T @ (C, H) -> (V, H)`, in f32 or f64 (candle's CPU matmul has no bf16; the sum over
/// chunks is kept in f32 on every device).
fn gram(g: &Tensor, h_c: &Tensor) -> Result<Tensor> {
    match (g.dtype(), g.device().is_cpu()) {
        (DType::F32 | DType::F64, _) => g.t()?.matmul(h_c),
        (_, true) => g.to_dtype(DType::F32)?.t()?.matmul(&h_c.to_dtype(DType::F32)?),
        (_, false) => g.t()?.matmul(h_c)?.to_dtype(DType::F32),
    }
}

/// Plain-candle twin of [`linear_cross_entropy`]: the full logits, then the reference cross-entropy.
pub fn linear_cross_entropy_reference(h: &Tensor, w: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let ones = Tensor::ones(labels.dims1()?, h.dtype(), h.device())?;
    super::cross_entropy_masked_reference(&h.matmul(&w.t()?)?, labels, &ones)
}

/// A zero scalar over `(h, w)` whose backward is the gradients [`linear_cross_entropy`] kept, scaled.
struct KeptGrads {
    dh: Option<Tensor>,
    dw: Option<Tensor>,
}

impl CustomOp2 for KeptGrads {
    fn name(&self) -> &'static str {
        "linear_cross_entropy_grads"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let zero = match s1 {
            CpuStorage::F32(_) => CpuStorage::F32(vec![0.0]),
            CpuStorage::F64(_) => CpuStorage::F64(vec![0.0]),
            CpuStorage::BF16(_) => CpuStorage::BF16(vec![bf16::ZERO]),
            _ => bail!("{}: h must be f32, f64 or bf16, got {}", self.name(), super::dtype_name(s1)),
        };
        Ok((zero, Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, _: &Layout, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let shape = Shape::from(());
        Ok((s1.device().zeros_impl(&shape, s1.dtype())?, shape))
    }

    fn bwd(&self, _h: &Tensor, _w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let scale = |g: &Option<Tensor>| g.as_ref().map(|g| g.broadcast_mul(&grad.to_dtype(g.dtype())?)).transpose();
        Ok((scale(&self.dh)?, scale(&self.dw)?))
    }
}
