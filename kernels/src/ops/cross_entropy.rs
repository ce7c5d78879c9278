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
use {super::gpu, candle_core::backend::BackendStorage, candle_core::CudaStorage};

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
struct CrossEntropyMasked {
    backward: Option<f64>,
    /// CUDA: the forward's per-row logsumexp and supervised count, handed to the backward op (taken, so a
    /// second backward through the same graph recomputes them).
    #[cfg(feature = "cuda")]
    saved: std::sync::Mutex<Option<gpu_ce::Saved>>,
}

impl CrossEntropyMasked {
    fn new(backward: Option<f64>) -> Self {
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
    fn backward_op(&self, g: f64) -> Self {
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
        crate::cuda::suffix(name, &[("logits", s1.dtype()), ("mask", s3.dtype())])?;
        let k = gpu_ce::Ce { op: name, n, v };
        let (logits, labels, mask) = ((s1, l1), (s2, l2), (s3, l3));
        let mut saved = self.saved.lock().unwrap_or_else(|e| e.into_inner());
        match self.backward {
            None => {
                let (loss, kept) = gpu::dispatch!(name, s1, gpu_ce::fwd(&k, logits, labels, mask))?;
                *saved = Some(kept);
                Ok((loss, Shape::from(())))
            }
            Some(g) => {
                let out = gpu::dispatch!(name, s1, gpu_ce::bwd(&k, g, saved.take(), logits, labels, mask))?;
                Ok((out, Shape::from((n, v))))
            }
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

/// The CUDA launches of the cross-entropy (kernels in `cuda/cross_entropy.cu`).
#[cfg(feature = "cuda")]
mod gpu_ce {
    use super::super::gpu::{kernel, row_threads, to_i32, Elem, Module};
    use super::check_labels;
    use crate::cuda::{per_row, view, wrap};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result};

    type In<'a> = (&'a CudaStorage, &'a Layout);

    /// Threads per row: a 152k-vocabulary row gives each of 512 threads ~300 elements, enough loads in
    /// flight to stream the logits at memory bandwidth with four blocks per SM.
    const ROW_THREADS: u32 = 512;

    /// What the forward keeps for the backward: each row's logsumexp (f32, (N)) and the supervised count.
    pub(super) struct Saved {
        lse: CudaSlice<f32>,
        n_sup: usize,
    }

    pub(super) struct Ce {
        pub op: &'static str,
        pub n: usize,
        pub v: usize,
    }

    /// Validates labels against the vocabulary (on the host) and runs the row pass: per-row losses
    /// (f32, (N), zero on unsupervised rows) and what the backward needs.
    fn rows<T: Elem>(k: &Ce, dev: &CudaDevice, logits: In, labels: In, mask: In) -> Result<(CudaSlice<f32>, Saved)> {
        let op = k.op;
        if k.n == 0 || k.v == 0 {
            bail!("{op}: logits {:?} are empty; the CUDA kernels need at least one row and column", logits.1.shape())
        }
        let lv = view::<T>(logits.0, logits.1, op, "logits")?;
        let labv = view::<u32>(labels.0, labels.1, op, "labels")?;
        let mv = view::<T>(mask.0, mask.1, op, "mask")?;
        // N labels and N mask values: a small copy that lets a bad label fail with the CPU op's message.
        let (labels_h, mask_h) = (dev.clone_dtoh(&labv)?, dev.clone_dtoh(&mv)?);
        let n_sup = check_labels(op, &labels_h, &mask_h, k.v)?;
        // SAFETY: ce_fwd writes loss[r] and lse[r] for every row r (one block per row).
        let (loss, lse) = unsafe { (dev.alloc::<f32>(k.n)?, dev.alloc::<f32>(k.n)?) };
        let v = to_i32(op, "the vocabulary", k.v)?;
        let cfg = per_row(k.n, row_threads(k.v, ROW_THREADS), 0)?;
        let (kn, km, kp) = kernel::<T>("ce_fwd", Module::CrossEntropy)?;
        let f = dev.get_or_load_custom_func(&kn, km, kp)?;
        let mut a = f.builder();
        a.arg(&lv);
        a.arg(&labv);
        a.arg(&mv);
        a.arg(&loss);
        a.arg(&lse);
        a.arg(&v);
        // SAFETY: argument types and order match `ce_fwd_*`; logits hold n * v elements, labels, mask, loss
        // and lse n; every supervised label is below v (checked above), unsupervised ones are never read.
        unsafe { a.launch(cfg) }.w()?;
        Ok((loss, Saved { lse, n_sup }))
    }

    /// The mean loss over supervised rows (a scalar of the logits dtype; 0 when none is supervised).
    pub(super) fn fwd<T: Elem>(
        _: &CudaSlice<T>,
        k: &Ce,
        logits: In,
        labels: In,
        mask: In,
    ) -> Result<(CudaStorage, Saved)> {
        let dev = logits.0.device();
        let (loss, saved) = rows::<T>(k, dev, logits, labels, mask)?;
        let (n, count) = (to_i32(k.op, "rows", k.n)?, to_i32(k.op, "supervised rows", saved.n_sup)?);
        // SAFETY: ce_mean writes out[0].
        let out = unsafe { dev.alloc::<T>(1)? };
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        let (kn, km, kp) = kernel::<T>("ce_mean", Module::CrossEntropy)?;
        let f = dev.get_or_load_custom_func(&kn, km, kp)?;
        let mut a = f.builder();
        a.arg(&loss);
        a.arg(&n);
        a.arg(&count);
        a.arg(&out);
        // SAFETY: matches `ce_mean_*`: loss holds n floats, out one element; one block of 1024 threads.
        unsafe { a.launch(cfg) }.w()?;
        Ok((wrap(out, dev), saved))
    }

    /// dlogits (N, V) = `g / n_sup * (softmax - onehot)` on supervised rows, zeros elsewhere. Uses the
    /// forward's saved logsumexp when given, else recomputes it (one extra pass).
    pub(super) fn bwd<T: Elem>(
        _: &CudaSlice<T>,
        k: &Ce,
        g: f64,
        saved: Option<Saved>,
        logits: In,
        labels: In,
        mask: In,
    ) -> Result<CudaStorage> {
        let dev = logits.0.device();
        let saved = match saved {
            Some(s) => s,
            None => rows::<T>(k, dev, logits, labels, mask)?.1,
        };
        if saved.n_sup == 0 {
            return Ok(wrap(dev.alloc_zeros::<T>(k.n * k.v)?, dev));
        }
        let op = k.op;
        let lv = view::<T>(logits.0, logits.1, op, "logits")?;
        let labv = view::<u32>(labels.0, labels.1, op, "labels")?;
        let mv = view::<T>(mask.0, mask.1, op, "mask")?;
        let scale = (g / saved.n_sup as f64) as f32;
        let v = to_i32(op, "the vocabulary", k.v)?;
        // SAFETY: ce_bwd writes every element of every row (zeros on unsupervised rows).
        let out = unsafe { dev.alloc::<T>(k.n * k.v)? };
        let cfg = per_row(k.n, row_threads(k.v, ROW_THREADS), 0)?;
        let (kn, km, kp) = kernel::<T>("ce_bwd", Module::CrossEntropy)?;
        let f = dev.get_or_load_custom_func(&kn, km, kp)?;
        let mut a = f.builder();
        a.arg(&lv);
        a.arg(&labv);
        a.arg(&mv);
        a.arg(&saved.lse);
        a.arg(&scale);
        a.arg(&out);
        a.arg(&v);
        // SAFETY: matches `ce_bwd_*`; logits and out hold n * v elements, labels, mask and lse n; the
        // labels of supervised rows were checked against v by the forward pass that produced `saved`.
        unsafe { a.launch(cfg) }.w()?;
        Ok(wrap(out, dev))
    }
}
