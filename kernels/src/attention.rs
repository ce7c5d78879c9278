//! Scaled dot-product attention, the plain-candle reference.
//!
//! Shapes follow the decoder: `q (B, Hq, Tq, D)`, `k, v (B, Hkv, Tk, D)` with `Hq % Hkv == 0` (GQA: each
//! key/value head serves `Hq / Hkv` query heads). Masks:
//! - [`AttentionMask::Causal`]: the queries are the last `Tq` positions of the key sequence (prefill when
//!   `Tq == Tk`, decode with a KV cache when `Tq < Tk`);
//! - [`AttentionMask::BlockDiagonal`]: tokens attend only inside their segment, given as cumulative
//!   boundaries (`cu_seqlens`, e.g. `[0, 64, 128, 150]`), as in the vision tower's windows. Segments are
//!   computed one by one, so no `(T x T)` mask is ever built;
//! - [`AttentionMask::CausalBlockDiagonal`]: the same segments, causal inside each: several sequences
//!   packed back to back into one row (padding-free training), each attending only to its own past.
//!
//! `key_padding (B, Tk)` (1 = real token, 0 = padding) masks left-padded keys in batched generation.
//! Masked scores get a large finite negative value rather than `-inf`, so that a query row with no visible
//! key (a padding row) yields finite values instead of NaN that would leak through `0 * NaN`.

use candle_core::{DType, Result, Tensor, D};

/// Added to masked scores; `exp` of it underflows to exactly zero next to any real score.
const MASKED: f64 = -1e30;

/// Which keys each query may see.
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every query sees every key.
    None,
    /// Query `i` (absolute position `Tk - Tq + i`) sees keys `0..=Tk - Tq + i`.
    Causal,
    /// Block-diagonal over segments `cu_seqlens[s]..cu_seqlens[s + 1]`; needs `B == 1` and `Tq == Tk`.
    BlockDiagonal(&'a [usize]),
    /// Block-diagonal over `cu_seqlens` as above, and causal inside each segment: query `i` of segment
    /// `s` sees keys `cu[s]..=i`. Needs `B == 1` and `Tq == Tk`.
    CausalBlockDiagonal(&'a [usize]),
}

/// Softmax over the last dimension in plain ops (differentiable, unlike candle-nn's fused one).
pub fn softmax_last_dim_reference(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Repeats each key/value head `n_rep` times: `(B, Hkv, T, D) -> (B, Hkv * n_rep, T, D)`.
pub fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, h, t, d) = x.dims4()?;
    x.unsqueeze(2)?.expand((b, h, n_rep, t, d))?.reshape((b, h * n_rep, t, d))
}

/// Attention output `(B, Hq, Tq, D)`; see the module docs for shapes and masks.
pub fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: AttentionMask,
    key_padding: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    let (b, hq, tq, d) = q.dims4()?;
    let (bk, hkv, tk, dk) = k.dims4()?;
    if bk != b || dk != d || v.dims4()? != (b, hkv, tk, d) || hkv == 0 || hq % hkv != 0 {
        candle_core::bail!(
            "attention: q {:?}, k {:?}, v {:?} do not fit (B, Hq, Tq, D) / (B, Hkv, Tk, D) with Hq % Hkv == 0",
            q.dims(),
            k.dims(),
            v.dims()
        )
    }
    if tq > tk {
        candle_core::bail!("attention: {tq} queries but only {tk} keys")
    }
    let k = repeat_kv(k, hq / hkv)?;
    let v = repeat_kv(v, hq / hkv)?;
    match mask {
        AttentionMask::BlockDiagonal(cu) | AttentionMask::CausalBlockDiagonal(cu) => {
            if b != 1 || tq != tk || cu.first() != Some(&0) || cu.last() != Some(&tk) {
                candle_core::bail!(
                    "attention: block-diagonal needs B == 1, Tq == Tk and cu_seqlens from 0 to {tk}, got B {b}, Tq {tq}, cu_seqlens {cu:?}"
                )
            }
            let mut outs = Vec::with_capacity(cu.len());
            for w in cu.windows(2) {
                let (s, len) = (w[0], w[1].saturating_sub(w[0]));
                if len == 0 {
                    continue;
                }
                let (qs, ks, vs) = (q.narrow(2, s, len)?, k.narrow(2, s, len)?, v.narrow(2, s, len)?);
                let bias = match mask {
                    AttentionMask::CausalBlockDiagonal(_) => causal_bias(len, len, q)?,
                    _ => None,
                };
                outs.push(dense(&qs, &ks, &vs, bias.as_ref(), scale)?);
            }
            Tensor::cat(&outs, 2)
        }
        AttentionMask::None | AttentionMask::Causal => {
            let mut bias = match mask {
                AttentionMask::Causal => causal_bias(tq, tk, q)?,
                _ => None,
            };
            if let Some(pad) = key_padding {
                if pad.dims() != [b, tk] {
                    candle_core::bail!("attention: key_padding must be (B, Tk) = ({b}, {tk}), got {:?}", pad.dims())
                }
                // (B, 1, 1, Tk): 0 where valid, MASKED where padded
                let p = ((pad.to_dtype(DType::F32)? - 1.0)? * -MASKED)?.to_dtype(q.dtype())?.reshape((b, 1, 1, tk))?;
                bias = Some(match bias {
                    Some(c) => c.broadcast_add(&p)?,
                    None => p,
                });
            }
            dense(q, &k, &v, bias.as_ref(), scale)
        }
    }
}

/// The causal bias `(1, 1, Tq, Tk)` for queries that are the last `Tq` of `Tk` keys (`None` for one query,
/// which sees every key), in `like`'s dtype and device.
fn causal_bias(tq: usize, tk: usize, like: &Tensor) -> Result<Option<Tensor>> {
    if tq <= 1 {
        return Ok(None);
    }
    let off = tk - tq;
    let m: Vec<f32> =
        (0..tq).flat_map(|i| (0..tk).map(move |j| if j > off + i { MASKED as f32 } else { 0.0 })).collect();
    Ok(Some(Tensor::from_vec(m, (1, 1, tq, tk), like.device())?.to_dtype(like.dtype())?))
}

/// `softmax(q k^T * scale + bias) v` with already repeated heads.
fn dense(q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>, scale: f64) -> Result<Tensor> {
    // (B, H, Tq, Tk)
    let mut s = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * scale)?;
    if let Some(bias) = bias {
        s = s.broadcast_add(bias)?;
    }
    softmax_last_dim_reference(&s)?.matmul(&v.contiguous()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Scores computed by hand, one query row at a time, as an independent check of masks and GQA.
    fn naive(q: &[f32], k: &[f32], v: &[f32], dims: (usize, usize, usize, usize, usize), causal: bool) -> Vec<f32> {
        let (hq, hkv, tq, tk, d) = dims;
        let mut out = vec![0f32; hq * tq * d];
        for h in 0..hq {
            let kh = h / (hq / hkv);
            for i in 0..tq {
                let lim = if causal { tk - tq + i + 1 } else { tk };
                let s: Vec<f32> = (0..lim)
                    .map(|j| (0..d).map(|x| q[(h * tq + i) * d + x] * k[(kh * tk + j) * d + x]).sum::<f32>() * 0.5)
                    .collect();
                let m = s.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for (j, w) in e.iter().enumerate() {
                    for x in 0..d {
                        out[(h * tq + i) * d + x] += w / z * v[(kh * tk + j) * d + x];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn causal_gqa_matches_naive() -> Result<()> {
        let dev = Device::Cpu;
        for (hq, hkv, tq, tk) in [(4, 2, 5, 5), (6, 3, 2, 7), (7, 1, 1, 9)] {
            let d = 4;
            let q = Tensor::randn(0f32, 1., (1, hq, tq, d), &dev)?;
            let k = Tensor::randn(0f32, 1., (1, hkv, tk, d), &dev)?;
            let v = Tensor::randn(0f32, 1., (1, hkv, tk, d), &dev)?;
            let got = attention_reference(&q, &k, &v, AttentionMask::Causal, None, 0.5)?;
            let want = naive(
                &q.flatten_all()?.to_vec1()?,
                &k.flatten_all()?.to_vec1()?,
                &v.flatten_all()?.to_vec1()?,
                (hq, hkv, tq, tk, d),
                true,
            );
            let diff =
                got.flatten_all()?.to_vec1::<f32>()?.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-5, "hq {hq} hkv {hkv} tq {tq} tk {tk}: max diff {diff}");
        }
        Ok(())
    }

    #[test]
    fn block_diagonal_equals_separate_segments_and_padding_masks_keys() -> Result<()> {
        let dev = Device::Cpu;
        let (h, t, d) = (2, 10, 4);
        let q = Tensor::randn(0f32, 1., (1, h, t, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, h, t, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, h, t, d), &dev)?;
        let cu = [0, 3, 3, 10];
        let got = attention_reference(&q, &k, &v, AttentionMask::BlockDiagonal(&cu), None, 0.5)?;
        // The second segment alone, through the key-padding path: keys 0..3 padded away.
        let pad = Tensor::from_vec(vec![0f32, 0., 0., 1., 1., 1., 1., 1., 1., 1.], (1, t), &dev)?;
        let masked = attention_reference(&q, &k, &v, AttentionMask::None, Some(&pad), 0.5)?;
        let a = got.narrow(2, 3, 7)?;
        let b = masked.narrow(2, 3, 7)?;
        let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "max diff {diff}");
        assert!(attention_reference(&q, &k, &v, AttentionMask::BlockDiagonal(&[0, 4]), None, 0.5).is_err());
        Ok(())
    }

    #[test]
    fn causal_block_diagonal_equals_each_segment_alone_under_the_naive_causal_mask() -> Result<()> {
        let dev = Device::Cpu;
        let (hq, hkv, t, d) = (4, 2, 12, 4);
        let q = Tensor::randn(0f32, 1., (1, hq, t, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (1, hkv, t, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (1, hkv, t, d), &dev)?;
        let cu = [0, 5, 5, 6, 12];
        let got = attention_reference(&q, &k, &v, AttentionMask::CausalBlockDiagonal(&cu), None, 0.5)?;
        for w in cu.windows(2).filter(|w| w[1] > w[0]) {
            let (s, n) = (w[0], w[1] - w[0]);
            let part = |x: &Tensor| -> Result<Vec<f32>> { x.narrow(2, s, n)?.flatten_all()?.to_vec1() };
            let want = naive(&part(&q)?, &part(&k)?, &part(&v)?, (hq, hkv, n, n, d), true);
            let diff = part(&got)?.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-5, "segment {s}..{}: max diff {diff}", w[1]);
        }
        Ok(())
    }
}
