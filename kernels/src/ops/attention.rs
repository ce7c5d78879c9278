//! Scaled dot-product attention as a candle CustomOp with a streaming forward and an explicit backward.
//!
//! What: [`attention`] computes `softmax(q k^T * scale + mask) v` for `q (B, Hq, Tq, D)`, `k, v (B, Hkv, Tk,
//! D)` (GQA, `Hq % Hkv == 0`) with the masks of [`crate::attention_reference`] (its twin and spec): none,
//! causal (queries are the last `Tq` key positions), block-diagonal over `cu_seqlens` (`B == 1`, `Tq == Tk`),
//! and an optional key padding `(B, Tk)` (1 = real key, 0 = padding).
//!
//! Why: the reference materialises a `(Tq x Tk)` score matrix (and a mask tensor) per head and keeps them
//! for candle's autograd; this op never builds either. Its CPU forward follows FlashAttention-2 (Tri Dao,
//! "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023), one query row
//! at a time: keys are visited in blocks of [`KEY_BLOCK`], only the visible ones (the causal prefix, the
//! row's segment, the unpadded keys), with an online softmax (running max `m`, running sum `l`, rescaled
//! output accumulator). It saves the per-row logsumexp `lse = m + ln l` for the backward. The backward is
//! explicit (a second, no-backward CustomOp) with the FlashAttention recurrence: `P_ij = exp(s_ij - lse_i)`
//! recomputed on the fly, `D_i = rowsum(dO_i * O_i)`, `dV_j += P_ij dO_i`, `dS_ij = P_ij (dO_i . v_j - D_i)`,
//! `dQ_i += scale dS_ij k_j`, `dK_j += scale dS_ij q_i`; the `Hq / Hkv` query heads that share a kv head
//! accumulate into its `dK`, `dV`. Inputs that track no gradient get `None`.
//!
//! Choices:
//! - the logsumexp is kept inside the op struct (a `Mutex<Option<Vec<f64>>>` filled by the CPU forward,
//!   `Tq` values per (batch, head): small); if it is absent (a forward run elsewhere) the backward kernel
//!   recomputes it with the same streaming pass;
//! - a query row with no visible key (e.g. a left-padding position under a causal mask) yields an output
//!   of exactly 0 and contributes nothing to any gradient. The reference instead returns a finite average
//!   of `v` there (all its scores equal `MASKED`); both are finite, and such rows are garbage positions
//!   that a training loss masks out, so the tests compare forward values on rows with a visible key only;
//! - key padding with a block-diagonal mask is refused (the reference ignores the padding there);
//! - scores, softmax statistics and gradient sums are computed in f64 whatever the storage dtype (f32 or
//!   f64); the kernel is plain loops, parallel over heads with rayon (query heads in the forward,
//!   key/value heads in the backward, so that no two tasks write one gradient element), O(D) extra
//!   memory per head in the forward, O(B Hkv Tk D) f64 accumulators in the backward.
//!
//! Tests: `cargo test -p askgui-kernels --test grad_attention -- --nocapture`.

use super::{contiguous_slice, dtype_mismatch, dtype_name};
use crate::attention::AttentionMask;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;
use std::sync::{Arc, Mutex};

/// Keys scored at once per query row (one FlashAttention-2 key block).
pub const KEY_BLOCK: usize = 64;

/// The mask as plain data owned by the op.
#[derive(Clone, Debug)]
enum Mask {
    None,
    Causal,
    /// `cu_seqlens`, validated: starts at 0, non-decreasing, ends at `Tk`.
    BlockDiagonal(Vec<usize>),
}

/// Problem sizes: `q (b, hq, tq, d)`, `k, v (b, hkv, tk, d)`.
#[derive(Clone, Copy, Debug)]
struct Dims {
    b: usize,
    hq: usize,
    hkv: usize,
    tq: usize,
    tk: usize,
    d: usize,
}

/// Checks the shapes (and the mask against them) and returns the sizes.
fn check_dims(op: &str, q: &[usize], k: &[usize], v: &[usize], mask: &Mask, padded: bool) -> Result<Dims> {
    let (&[b, hq, tq, d], &[bk, hkv, tk, dk]) = (q, k) else {
        bail!("{op}: q must be (B, Hq, Tq, D) and k, v (B, Hkv, Tk, D), got q {q:?}, k {k:?}, v {v:?}")
    };
    if bk != b || dk != d || v != k || hkv == 0 || hq % hkv != 0 {
        bail!("{op}: q {q:?}, k {k:?}, v {v:?} do not fit (B, Hq, Tq, D) / (B, Hkv, Tk, D) with Hq % Hkv == 0")
    }
    if tq > tk {
        bail!("{op}: {tq} queries but only {tk} keys (q {q:?}, k {k:?}); the queries must be the last Tq keys")
    }
    if let Mask::BlockDiagonal(cu) = mask {
        let ordered = cu.windows(2).all(|w| w[0] <= w[1]);
        if b != 1 || tq != tk || cu.first() != Some(&0) || cu.last() != Some(&tk) || !ordered {
            bail!(
                "{op}: block-diagonal needs B == 1, Tq == Tk, non-decreasing cu_seqlens from 0 to {tk}; \
                 got q {q:?}, k {k:?}, cu_seqlens {cu:?}"
            )
        }
        if padded {
            bail!("{op}: key_padding is not supported with a block-diagonal mask (q {q:?}, cu_seqlens {cu:?})")
        }
    }
    Ok(Dims { b, hq, hkv, tq, tk, d })
}

/// Mask, padding and scale shared by the forward and backward kernels.
#[derive(Clone, Debug)]
struct Spec {
    mask: Mask,
    /// `B * Tk` flags, `true` = real key.
    keep: Option<Vec<bool>>,
    scale: f64,
}

impl Spec {
    /// The key range `lo..hi` query row `i` may see before padding (`hi <= lo` when empty).
    fn key_range(&self, dims: &Dims, i: usize) -> (usize, usize) {
        match &self.mask {
            Mask::None => (0, dims.tk),
            Mask::Causal => (0, dims.tk - dims.tq + i + 1),
            Mask::BlockDiagonal(cu) => {
                // The segment s with cu[s] <= i < cu[s + 1] (empty segments are skipped by the search).
                let s = cu.partition_point(|&c| c <= i) - 1;
                (cu[s], cu[s + 1])
            }
        }
    }

    fn visible(&self, dims: &Dims, b: usize, j: usize) -> bool {
        self.keep.as_ref().is_none_or(|k| k[b * dims.tk + j])
    }
}

fn dot<T: WithDType>(a: &[T], b: &[T]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x.to_f64() * y.to_f64()).sum()
}

/// The streaming forward: returns `(O (B, Hq, Tq, D), lse (B, Hq, Tq))`; `lse` is `-inf` for a row with no
/// visible key, whose output is 0. The `B * Hq` heads run in parallel on candle's CPU thread pool.
fn forward<T: WithDType>(q: &[T], k: &[T], v: &[T], dims: &Dims, spec: &Spec) -> (Vec<T>, Vec<f64>) {
    let Dims { hq, hkv, tq, tk, d, .. } = *dims;
    let rep = hq / hkv;
    let mut out = vec![T::zero(); q.len()];
    let mut lse = vec![0f64; dims.b * hq * tq];
    let heads = out.par_chunks_mut(tq * d).zip(lse.par_chunks_mut(tq)).enumerate();
    heads.for_each(|(bh, (out, lse))| {
        let (b, h) = (bh / hq, bh % hq);
        let kv = (b * hkv + h / rep) * tk;
        let mut acc = vec![0f64; d];
        let mut scores = [0f64; KEY_BLOCK];
        let mut cols = [0usize; KEY_BLOCK];
        for i in 0..tq {
            let qi = &q[(bh * tq + i) * d..][..d];
            let (lo, hi) = spec.key_range(dims, i);
            let (mut m, mut l) = (f64::NEG_INFINITY, 0f64);
            acc.fill(0.0);
            let mut j = lo;
            while j < hi {
                // Score one block of visible keys, then fold it into the running statistics.
                let mut n = 0;
                let mut block_max = f64::NEG_INFINITY;
                while j < hi && n < KEY_BLOCK {
                    if spec.visible(dims, b, j) {
                        let s = spec.scale * dot(qi, &k[(kv + j) * d..][..d]);
                        block_max = block_max.max(s);
                        (scores[n], cols[n]) = (s, j);
                        n += 1;
                    }
                    j += 1;
                }
                if n == 0 {
                    continue;
                }
                let m_new = m.max(block_max);
                let c = (m - m_new).exp(); // 0 on the first block (m = -inf)
                l *= c;
                acc.iter_mut().for_each(|a| *a *= c);
                for (&s, &col) in scores[..n].iter().zip(&cols[..n]) {
                    let p = (s - m_new).exp();
                    l += p;
                    for (a, x) in acc.iter_mut().zip(&v[(kv + col) * d..][..d]) {
                        *a += p * x.to_f64();
                    }
                }
                m = m_new;
            }
            // A row with no visible key keeps its zeros.
            if l > 0.0 {
                for (o, a) in out[i * d..][..d].iter_mut().zip(&acc) {
                    *o = T::from_f64(a / l);
                }
                lse[i] = m + l.ln();
            } else {
                lse[i] = f64::NEG_INFINITY;
            }
        }
    });
    (out, lse)
}

/// The backward: `qod (B, Hq, Tq, 3D)` packs `[q, O, dO]` per row; returns `[dq, dk, dv]` flattened.
/// The `B * Hkv` key/value heads run in parallel: each owns its `dk`, `dv` and the `dq` of the query
/// heads that share it, so no two tasks write the same element.
fn backward<T: WithDType>(qod: &[T], k: &[T], v: &[T], lse: Option<&[f64]>, dims: &Dims, spec: &Spec) -> Vec<T> {
    let Dims { b: nb, hq, hkv, tq, tk, d } = *dims;
    let rep = hq / hkv;
    let recomputed;
    let lse = match lse {
        Some(l) => l,
        None => {
            let q: Vec<T> = qod.chunks_exact(3 * d).flat_map(|r| r[..d].iter().copied()).collect();
            recomputed = forward(&q, k, v, dims, spec).1;
            &recomputed
        }
    };
    let mut dq = vec![0f64; nb * hq * tq * d];
    let mut dk = vec![0f64; k.len()];
    let mut dv = vec![0f64; v.len()];
    let groups = dq.par_chunks_mut(rep * tq * d).zip(dk.par_chunks_mut(tk * d).zip(dv.par_chunks_mut(tk * d)));
    groups.enumerate().for_each(|(bg, (dq, (dk, dv)))| {
        let (b, kv) = (bg / hkv, bg * tk);
        for r in 0..rep {
            for i in 0..tq {
                let row = (bg * rep + r) * tq + i;
                let li = lse[row];
                if li == f64::NEG_INFINITY {
                    continue; // no visible key: output 0, no gradient
                }
                let x = &qod[row * 3 * d..][..3 * d];
                let (qi, oi, doi) = (&x[..d], &x[d..2 * d], &x[2 * d..]);
                let delta = dot(doi, oi);
                let dqi = &mut dq[(r * tq + i) * d..][..d];
                let (lo, hi) = spec.key_range(dims, i);
                for j in lo..hi {
                    if !spec.visible(dims, b, j) {
                        continue;
                    }
                    let (kj, vj) = (&k[(kv + j) * d..][..d], &v[(kv + j) * d..][..d]);
                    let p = (spec.scale * dot(qi, kj) - li).exp();
                    let ds = spec.scale * p * (dot(doi, vj) - delta);
                    let (dkj, dvj) = (&mut dk[j * d..][..d], &mut dv[j * d..][..d]);
                    for x in 0..d {
                        dvj[x] += p * doi[x].to_f64();
                        dqi[x] += ds * kj[x].to_f64();
                        dkj[x] += ds * qi[x].to_f64();
                    }
                }
            }
        }
    });
    dq.into_iter().chain(dk).chain(dv).map(T::from_f64).collect()
}

/// The forward op on `(q, k, v)`; keeps the logsumexp of its CPU forward for [`Attention::bwd`].
struct Attention {
    spec: Spec,
    lse: Mutex<Option<Arc<Vec<f64>>>>,
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "attention"
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
        let (qd, kd, vd) = (l1.shape().dims(), l2.shape().dims(), l3.shape().dims());
        let dims = check_dims(name, qd, kd, vd, &self.spec.mask, self.spec.keep.is_some())?;
        let (out, lse) = match (s1, s2, s3) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                let q = contiguous_slice::<f32>(s1, l1, name, "q")?;
                let (k, v) = (contiguous_slice(s2, l2, name, "k")?, contiguous_slice(s3, l3, name, "v")?);
                let (o, lse) = forward(q, k, v, &dims, &self.spec);
                (f32::to_cpu_storage_owned(o), lse)
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                let q = contiguous_slice::<f64>(s1, l1, name, "q")?;
                let (k, v) = (contiguous_slice(s2, l2, name, "k")?, contiguous_slice(s3, l3, name, "v")?);
                let (o, lse) = forward(q, k, v, &dims, &self.spec);
                (f64::to_cpu_storage_owned(o), lse)
            }
            _ => return Err(dtype_mismatch("attention", &[("q", s1, l1), ("k", s2, l2), ("v", s3, l3)])),
        };
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(lse));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (want_q, want_k, want_v) = (q.track_op(), k.track_op(), v.track_op());
        if !want_q && !want_k && !want_v {
            return Ok((None, None, None));
        }
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let op = AttentionBwd { spec: self.spec.clone(), lse };
        let qod = Tensor::cat(&[q, res, grad], 3)?;
        let flat = qod.apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let dq = if want_q { Some(flat.narrow(0, 0, nq)?.reshape(q.shape())?) } else { None };
        let dk = if want_k { Some(flat.narrow(0, nq, nk)?.reshape(k.shape())?) } else { None };
        let dv = if want_v { Some(flat.narrow(0, nq + nk, nk)?.reshape(v.shape())?) } else { None };
        Ok((dq, dk, dv))
    }
}

/// The backward kernel: inputs `([q, O, dO] concatenated on the last dim, k, v)`, output
/// `[dq.flatten(), dk.flatten(), dv.flatten()]`.
struct AttentionBwd {
    spec: Spec,
    lse: Option<Arc<Vec<f64>>>,
}

impl CustomOp3 for AttentionBwd {
    fn name(&self) -> &'static str {
        "attention_bwd"
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
        let (pd, kd, vd) = (l1.shape().dims(), l2.shape().dims(), l3.shape().dims());
        let Some((&d3, lead)) = pd.split_last() else { bail!("{name}: packed [q, O, dO] must be 4D, got {pd:?}") };
        if d3 % 3 != 0 {
            bail!("{name}: packed [q, O, dO] {pd:?} must have a last dimension of 3 D")
        }
        let qd: Vec<usize> = lead.iter().copied().chain([d3 / 3]).collect();
        let dims = check_dims(name, &qd, kd, vd, &self.spec.mask, self.spec.keep.is_some())?;
        let lse = self.lse.as_deref().map(|l| l.as_slice());
        if lse.is_some_and(|l| l.len() != dims.b * dims.hq * dims.tq) {
            bail!("{name}: saved logsumexp has {} rows, q {qd:?} needs B * Hq * Tq", lse.map_or(0, |l| l.len()))
        }
        let n = l1.shape().elem_count() / 3 + 2 * l2.shape().elem_count();
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(_), CpuStorage::F32(_), CpuStorage::F32(_)) => {
                let p = contiguous_slice::<f32>(s1, l1, name, "[q, O, dO]")?;
                let (k, v) = (contiguous_slice(s2, l2, name, "k")?, contiguous_slice(s3, l3, name, "v")?);
                f32::to_cpu_storage_owned(backward(p, k, v, lse, &dims, &self.spec))
            }
            (CpuStorage::F64(_), CpuStorage::F64(_), CpuStorage::F64(_)) => {
                let p = contiguous_slice::<f64>(s1, l1, name, "[q, O, dO]")?;
                let (k, v) = (contiguous_slice(s2, l2, name, "k")?, contiguous_slice(s3, l3, name, "v")?);
                f64::to_cpu_storage_owned(backward(p, k, v, lse, &dims, &self.spec))
            }
            _ => bail!(
                "{name}: [q, O, dO], k, v must share f32 or f64, got {}, {}, {}",
                dtype_name(s1),
                dtype_name(s2),
                dtype_name(s3)
            ),
        };
        Ok((out, Shape::from(n)))
    }
}

/// Attention output `(B, Hq, Tq, D)` with an explicit backward; same arguments and masks as
/// [`crate::attention_reference`] (see the module docs for the one difference: rows with no visible key
/// give 0). `key_padding (B, Tk)` holds 1 for real keys and 0 for padding; it is read once into plain data.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: AttentionMask,
    key_padding: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let mask = match mask {
        AttentionMask::None => Mask::None,
        AttentionMask::Causal => Mask::Causal,
        AttentionMask::BlockDiagonal(cu) => Mask::BlockDiagonal(cu.to_vec()),
    };
    let dims = check_dims("attention", q.dims(), k.dims(), v.dims(), &mask, key_padding.is_some())?;
    let keep = match key_padding {
        None => None,
        Some(pad) => {
            if pad.dims() != [dims.b, dims.tk] {
                bail!("attention: key_padding must be (B, Tk) = ({}, {}), got {:?}", dims.b, dims.tk, pad.dims())
            }
            let flags = pad.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            if let Some(x) = flags.iter().find(|&&x| x != 0.0 && x != 1.0) {
                bail!("attention: key_padding {:?} must hold only 0 (padding) and 1 (real key), found {x}", pad.dims())
            }
            Some(flags.into_iter().map(|x| x == 1.0).collect())
        }
    };
    let op = Attention { spec: Spec { mask, keep, scale }, lse: Mutex::new(None) };
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backward kernel gives the same gradients with the saved logsumexp and with a recomputed one.
    #[test]
    fn backward_recomputes_missing_logsumexp() {
        let dims = Dims { b: 1, hq: 4, hkv: 2, tq: 3, tk: 70, d: 2 };
        let spec = Spec { mask: Mask::Causal, keep: None, scale: 0.7 };
        let gen = |n: usize, s: f64| (0..n).map(|i| ((i as f64 + s) * 0.37).sin()).collect::<Vec<f64>>();
        let (q, k, v) = (gen(4 * 3 * 2, 1.0), gen(2 * 70 * 2, 2.0), gen(2 * 70 * 2, 3.0));
        let (o, lse) = forward(&q, &k, &v, &dims, &spec);
        let g = gen(o.len(), 4.0);
        let qod: Vec<f64> =
            (0..4 * 3).flat_map(|r| [&q[r * 2..][..2], &o[r * 2..][..2], &g[r * 2..][..2]].concat()).collect();
        let saved = backward(&qod, &k, &v, Some(&lse), &dims, &spec);
        let recomputed = backward(&qod, &k, &v, None, &dims, &spec);
        assert_eq!(saved, recomputed);
    }
}
