//! `cross_entropy_masked`: mean next-token NLL over supervised positions only, with an explicit backward.
//!
//! Why: candle has no `ignore_index`, and training only on the assistant's tokens needs one. Here a mask
//! marks supervised positions (any non-zero value); unsupervised positions cost nothing, their labels are
//! never read (so `u32::MAX` or any padding id is fine there) and their logits get an exact zero gradient.
//! `loss = sum_{mask != 0} (logsumexp(logits[r]) - logits[r, label[r]]) / n_supervised`.
//! When no position is supervised the loss is 0 and the gradient is all zeros (not NaN), so an all-prompt
//! micro-batch is harmless. The backward is `(softmax - onehot) * grad / n_supervised` on supervised rows.
//! Infinite logits (CPU op), per supervised row: `k > 0` logits at `+inf` make the softmax uniform over
//! them (`1/k` each, 0 elsewhere), so the row's loss is `ln k` if its label's logit is `+inf` and `+inf`
//! otherwise; `-inf` logits get probability 0 (loss `+inf` when the label's is `-inf`); a row of only `-inf`
//! logits has loss `+inf` and a zero gradient (no distribution to move towards); a NaN logit makes the
//! row's loss and gradient NaN. The gradient is `scale * (p - onehot)` with that `p` in every case.
//!
//! CUDA (feature `cuda`, kernels in `cuda/cross_entropy.cu`): logits and mask f32 or bf16, math in f32.
//! The forward is one pass per supervised row (online logsumexp, a block per row) and keeps each row's
//! logsumexp in the op, so the backward is one more pass that writes `scale * (softmax - onehot)` straight
//! into dlogits: the (N, V) probabilities are never materialised. Labels and mask (N elements) are copied
//! to the host once per forward to validate supervised labels and count them, as the CPU op does.
//! Tests: `cargo test -p askgui-kernels --test grad_ops`; on a GPU `cargo test -p askgui-kernels
//! --features cuda --test cuda -- norm_rope_ce::cross_entropy`.

use super::{contiguous_slice, dtype_name, f32_slice, Float};
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType, D};
#[cfg(feature = "cuda")]
use {candle_core::backend::BackendStorage, candle_core::CudaStorage};

/// Checks shapes and supervised labels; returns `(N, V)`.
fn check(op: &str, logits: &Layout, labels: &Layout, mask: &Layout) -> Result<(usize, usize)> {
    let [n, v] = logits.shape().dims() else { bail!("{op}: logits must be (N, V), got {:?}", logits.shape()) };
    if *v == 0 {
        bail!("{op}: logits {:?} have an empty vocabulary", logits.shape())
    }
    if labels.shape().dims() != [*n] || mask.shape().dims() != [*n] {
        bail!(
            "{op}: labels and mask must be ({n}) to match logits {:?}, got labels {:?}, mask {:?}",
            logits.shape(),
            labels.shape(),
            mask.shape()
        )
    }
    Ok((*n, *v))
}

fn check_labels<T: WithDType>(op: &str, labels: &[u32], mask: &[T], v: usize) -> Result<usize> {
    let mut n_sup = 0;
    for (r, (&l, m)) in labels.iter().zip(mask).enumerate() {
        if m.to_f64() != 0.0 {
            if l as usize >= v {
                bail!("{op}: supervised position {r} has label {l}, outside the vocabulary of {v}")
            }
            n_sup += 1;
        }
    }
    Ok(n_sup)
}

/// The softmax of one row of logits, infinities included (see the module doc).
#[derive(Clone, Copy, Debug)]
enum Softmax {
    /// `p_j = exp(x_j - lse)`: 0 for `-inf` logits; NaN everywhere when a logit is NaN (`lse` NaN).
    Finite { lse: f64 },
    /// `k` logits are `+inf`: the softmax is uniform over them, `1 / k` each, 0 elsewhere.
    PosInf { k: usize },
    /// Every logit is `-inf`: there is no distribution; the loss is `+inf` and the gradient 0.
    AllNegInf,
}

impl Softmax {
    fn of<T: WithDType>(row: &[T]) -> Self {
        let (mut max, mut k, mut nan) = (f64::NEG_INFINITY, 0, false);
        for x in row.iter().map(|x| x.to_f64()) {
            match x {
                f64::INFINITY => k += 1,
                x if x.is_nan() => nan = true,
                x => max = max.max(x),
            }
        }
        match (nan, k, max) {
            (true, _, _) => Self::Finite { lse: f64::NAN },
            (false, 1.., _) => Self::PosInf { k },
            (false, 0, f64::NEG_INFINITY) => Self::AllNegInf,
            // Shifted by the largest finite logit: each term is at most 1, `-inf` logits add exactly 0.
            _ => Self::Finite { lse: max + row.iter().map(|x| (x.to_f64() - max).exp()).sum::<f64>().ln() },
        }
    }

    /// `-ln p(label)` for the label's logit `x`.
    fn nll(self, x: f64) -> f64 {
        match self {
            // `+inf` when `x` is `-inf` (p = 0), NaN when `lse` is.
            Self::Finite { lse } => lse - x,
            Self::PosInf { k } if x == f64::INFINITY => (k as f64).ln(),
            Self::PosInf { .. } | Self::AllNegInf => f64::INFINITY,
        }
    }

    /// The probability of a logit `x`.
    fn p(self, x: f64) -> f64 {
        match self {
            Self::Finite { lse } => (x - lse).exp(),
            Self::PosInf { k } if x == f64::INFINITY => 1.0 / k as f64,
            Self::PosInf { .. } | Self::AllNegInf => 0.0,
        }
    }
}

fn ce_fwd<T: WithDType>(logits: &[T], labels: &[u32], mask: &[T], v: usize, n_sup: usize) -> T {
    let mut total = 0f64;
    for ((row, &l), m) in logits.chunks_exact(v).zip(labels).zip(mask) {
        if m.to_f64() != 0.0 {
            total += Softmax::of(row).nll(row[l as usize].to_f64());
        }
    }
    T::from_f64(if n_sup == 0 { 0.0 } else { total / n_sup as f64 })
}

/// `scale * (softmax - onehot)` on supervised rows, zeros elsewhere (and on rows whose logits are all
/// `-inf`); `scale = grad / n_supervised`.
fn ce_bwd<T: WithDType>(logits: &[T], labels: &[u32], mask: &[T], v: usize, scale: f64) -> Vec<T> {
    let mut out = Vec::with_capacity(logits.len());
    for ((row, &l), m) in logits.chunks_exact(v).zip(labels).zip(mask) {
        let softmax = (m.to_f64() != 0.0).then(|| Softmax::of(row));
        let Some(softmax) = softmax.filter(|s| !matches!(s, Softmax::AllNegInf)) else {
            out.extend(std::iter::repeat_n(T::from_f64(0.0), v));
            continue;
        };
        out.extend(row.iter().enumerate().map(|(j, x)| {
            let onehot = if j == l as usize { 1.0 } else { 0.0 };
            T::from_f64(scale * (softmax.p(x.to_f64()) - onehot))
        }));
    }
    out
}

/// Forward (`backward == None`) or backward kernel (`Some(grad)`) over `(logits, labels, mask)`.
pub(super) struct CrossEntropyMasked {
    backward: Option<f64>,
    /// CUDA: the forward's per-row logsumexp and supervised count, handed to the backward op (taken, so a
    /// second backward through the same graph recomputes them).
    #[cfg(feature = "cuda")]
    saved: std::sync::Mutex<Option<gpu_ce::Saved>>,
}

impl CrossEntropyMasked {
    pub(super) fn new(backward: Option<f64>) -> Self {
        Self {
            backward,
            #[cfg(feature = "cuda")]
            saved: std::sync::Mutex::new(None),
        }
    }

    /// The CPU kernel: the loss (one element) or, for the backward op, dlogits `(N, V)`.
    fn run<T: WithDType>(&self, logits: &[T], labels: &[u32], mask: &[T], v: usize) -> Result<Vec<T>> {
        let n_sup = check_labels(self.name(), labels, mask, v)?;
        Ok(match self.backward {
            None => vec![ce_fwd(logits, labels, mask, v, n_sup)],
            Some(_) if n_sup == 0 => vec![T::from_f64(0.0); logits.len()],
            Some(g) => ce_bwd(logits, labels, mask, v, g / n_sup as f64),
        })
    }

    /// The backward op for upstream gradient `g`, with what this forward saved (CUDA).
    pub(super) fn backward_op(&self, g: f64) -> Self {
        #[allow(unused_mut)]
        let mut op = Self::new(Some(g));
        #[cfg(feature = "cuda")]
        {
            op.saved = std::sync::Mutex::new(self.saved.lock().unwrap_or_else(|e| e.into_inner()).take());
        }
        op
    }
}

impl CustomOp3 for CrossEntropyMasked {
    fn name(&self) -> &'static str {
        if self.backward.is_some() {
            "cross_entropy_masked_bwd"
        } else {
            "cross_entropy_masked"
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (n, v) = check(name, l1, l2, l3)?;
        let labels = match s2 {
            CpuStorage::U32(_) => contiguous_slice::<u32>(s2, l2, name, "labels")?,
            _ => bail!("{name}: labels must be u32, got {} {:?}", dtype_name(s2), l2.shape()),
        };
        let out = match Float::of(name, &[("logits", s1, l1), ("mask", s3, l3)])? {
            Float::F64 => {
                let (logits, mask) =
                    (contiguous_slice(s1, l1, name, "logits")?, contiguous_slice(s3, l3, name, "mask")?);
                f64::to_cpu_storage_owned(self.run::<f64>(logits, labels, mask, v)?)
            }
            Float::F32(out) => {
                let (logits, mask) = (f32_slice(s1, l1, name, "logits")?, f32_slice(s3, l3, name, "mask")?);
                out.store(self.run::<f32>(&logits, labels, &mask, v)?)
            }
        };
        let shape = if self.backward.is_some() { Shape::from((n, v)) } else { Shape::from(()) };
        Ok((out, shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let (n, v) = check(name, l1, l2, l3)?;
        if s2.dtype() != DType::U32 {
            bail!("{name}: labels must be u32, got {:?} {:?}", s2.dtype(), l2.shape())
        }
        let elem = super::gpu::elem(name, &[("logits", s1.dtype()), ("mask", s3.dtype())])?;
        let ins = gpu_ce::Inputs { op: name, n, v, elem, logits: (s1, l1), labels: (s2, l2), mask: (s3, l3) };
        let mut saved = self.saved.lock().unwrap_or_else(|e| e.into_inner());
        match self.backward {
            None => {
                let (loss, kept) = gpu_ce::fwd(&ins)?;
                *saved = Some(kept);
                Ok((loss, Shape::from(())))
            }
            Some(g) => Ok((gpu_ce::bwd(&ins, g, saved.take())?, Shape::from((n, v)))),
        }
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        mask: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Labels and mask are data: they never get a gradient.
        if !logits.track_op() {
            return Ok((None, None, None));
        }
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let dlogits = logits.apply_op3_no_bwd(labels, mask, &self.backward_op(g))?;
        Ok((Some(dlogits), None, None))
    }
}

/// Mean cross-entropy of `logits (N, V)` (f32, f64 or bf16) against `labels (N)` u32 over the positions where
/// `mask (N)` (any dtype; converted to the logits dtype) is non-zero. Returns a scalar; 0 when nothing is
/// supervised. Gradient for `logits` only.
pub fn cross_entropy_masked(logits: &Tensor, labels: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let mask = mask.detach().to_dtype(logits.dtype())?.contiguous()?;
    logits.contiguous()?.apply_op3(&labels.detach().contiguous()?, &mask, CrossEntropyMasked::new(None))
}

/// Plain-candle twin of [`cross_entropy_masked`] (log-softmax, gather, masked mean), differentiable.
pub fn cross_entropy_masked_reference(logits: &Tensor, labels: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let keep = mask.ne(0f64)?;
    let maskf = keep.to_dtype(logits.dtype())?;
    let n_sup = maskf.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    // Unsupervised labels may be anything (u32::MAX): point them at column 0 before gathering.
    let safe = keep.where_cond(labels, &labels.zeros_like()?)?;
    // The max is a constant shift for stability; detaching it keeps the gradient exact and simple.
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let logp = shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(D::Minus1)?.log()?)?;
    let picked = logp.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?;
    let nll = picked.neg()?.mul(&maskf)?.sum_all()?;
    nll / n_sup.max(1.0)
}

/// The CUDA path of the cross-entropy: host validation of the labels, then the plans of
/// `plan::cross_entropy` (kernels in `cuda/cross_entropy.cu`).
#[cfg(feature = "cuda")]
mod gpu_ce {
    use super::super::gpu;
    use super::check_labels;
    use crate::plan::{cross_entropy as plan, Elem};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::CudaStorageSlice;
    use candle_core::{bail, CudaStorage, Layout, Result};

    /// What the forward keeps for the backward: each row's logsumexp (f32, (N)) and the supervised count.
    pub(super) struct Saved {
        lse: CudaStorage,
        n_sup: usize,
    }

    pub(super) struct Inputs<'a> {
        pub op: &'static str,
        pub n: usize,
        pub v: usize,
        pub elem: Elem,
        pub logits: (&'a CudaStorage, &'a Layout),
        pub labels: (&'a CudaStorage, &'a Layout),
        pub mask: (&'a CudaStorage, &'a Layout),
    }

    impl Inputs<'_> {
        fn plan_inputs(&self) -> Result<Vec<(&CudaStorage, usize)>> {
            let op = self.op;
            Ok(vec![
                gpu::input(op, "logits", self.logits)?,
                gpu::input(op, "labels", self.labels)?,
                gpu::input(op, "mask", self.mask)?,
            ])
        }

        /// Copies the N labels and mask values to the host (small) so that a bad label fails with the CPU
        /// op's message, and counts the supervised rows.
        fn supervised(&self) -> Result<usize> {
            let (op, n) = (self.op, self.n);
            let ((ls, ll), (ms, ml)) = (self.labels, self.mask);
            let (lstart, mstart) = (ll.start_offset(), ml.start_offset());
            let dev = ls.device();
            let labels = match &ls.slice {
                CudaStorageSlice::U32(x) => dev.clone_dtoh(&x.slice(lstart..lstart + n))?,
                _ => bail!("{op}: labels must be u32, got {:?}", ls.dtype()),
            };
            match &ms.slice {
                CudaStorageSlice::F32(x) => {
                    check_labels(op, &labels, &dev.clone_dtoh(&x.slice(mstart..mstart + n))?, self.v)
                }
                CudaStorageSlice::BF16(x) => {
                    check_labels(op, &labels, &dev.clone_dtoh(&x.slice(mstart..mstart + n))?, self.v)
                }
                _ => bail!("{op}: the mask must be f32 or bf16 on CUDA, got {:?}", ms.dtype()),
            }
        }
    }

    /// The mean loss over supervised rows (a scalar of the logits dtype) and what the backward needs.
    pub(super) fn fwd(ins: &Inputs) -> Result<(CudaStorage, Saved)> {
        let n_sup = ins.supervised()?;
        let plan = plan::forward(ins.n, ins.v, n_sup, ins.elem)?;
        let mut out = gpu::run(&plan, &ins.plan_inputs()?)?.into_iter();
        let (Some(loss), Some(lse)) = (out.next(), out.next()) else {
            bail!("{}: the plan returns the loss and lse", ins.op)
        };
        Ok((loss, Saved { lse, n_sup }))
    }

    /// dlogits (N, V) = `g / n_sup * (softmax - onehot)` on supervised rows, zeros elsewhere, from the
    /// forward's saved logsumexp when given (else the plan recomputes it).
    pub(super) fn bwd(ins: &Inputs, g: f64, saved: Option<Saved>) -> Result<CudaStorage> {
        let n_sup = match &saved {
            Some(s) => s.n_sup,
            None => ins.supervised()?,
        };
        let plan = plan::backward(ins.n, ins.v, n_sup, g / n_sup.max(1) as f64, saved.is_some(), ins.elem)?;
        let mut inputs = ins.plan_inputs()?;
        if let Some(s) = &saved {
            inputs.push((&s.lse, 0));
        }
        gpu::single(ins.op, gpu::run(&plan, &inputs)?)
    }
}
