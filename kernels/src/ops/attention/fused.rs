//! The CPU attention forward for f32 with small heads (`D <= 64`) and no key padding, fused: scores,
//! softmax and `P V` of a few query rows at a time, all in L1 cache and registers.
//!
//! Why: with head dim 16 (the tiny model's vision and text towers) a score is a 16-term dot product, and
//! the GEMM forward of `ops/attention.rs` spent its time writing, rereading and repacking `(64, Tk)` score
//! blocks that live in L2, and packing `K` and `V` again for every block of queries: about 4 cycles a
//! score, 3.4 ms for the two 1,564-patch heads of one full-attention vision block (2026-11-28), as long as
//! PyTorch's `scaled_dot_product_attention` on the same shapes.
//!
//! How: `K` is packed once per head in panels of [`KEYS`] keys, `(D, KEYS)` each, so that one dimension
//! of a panel is one 16-lane vector; `V` once in rows padded to `DP` (16, 32 or 64). A tile of `R` query
//! rows (pre-scaled) takes each panel in turn: `R x KEYS` scores accumulate in registers over `D` fused
//! multiply-adds and are written once into an `R`-row buffer that stays in L1. The softmax runs on each
//! row's visible span there (the max in f32, which is exact; `exp` with fused multiply-adds,
//! `exp_f32_fma`; the sum in f32 lanes over blocks of 256, then in f64), then `O += p_j v_j`
//! accumulates `R x DP` outputs in registers over the tile's keys, and each row of `O` is divided by its
//! sum at the end (normalising `O`, not `P`). The tile's two products are written twice: plain `mul_add`
//! loops over 4 rows (compiled for the baseline and for AVX2 + FMA), and AVX-512 intrinsics over 8 rows
//! (4 at `DP = 64`), where the plain loops did not vectorise well. Every operation is exactly rounded
//! and each row's sums run in the same order, so all builds are bitwise equal, which the tests check.
//!
//! Its twin is the GEMM forward (`forward` in `ops/attention.rs`), which still serves f64, key padding and
//! larger heads; the tests below compare the two on every mask, odd sizes and GQA, and
//! `tests/grad_attention.rs` compares the op with `attention_reference`.

use rayon::prelude::*;

use super::super::exp::{exp_sum, max};
use super::{Dims, Spec};

/// The largest head dimension this forward takes; larger heads go through the GEMM forward, whose
/// products are then long enough for its packing to pay.
pub(super) const MAX_HEAD_DIM: usize = 64;
/// Keys per panel: one 16-lane f32 vector.
const KEYS: usize = 16;

/// Whether [`forward`] takes this problem (f32 storage is the caller's condition).
pub(super) fn applies(dims: &Dims, spec: &Spec) -> bool {
    spec.keep.is_none() && dims.d > 0 && dims.d <= MAX_HEAD_DIM
}

/// The forward on f32: `(O (B, Hq, Tq, D), lse (B, Hq, Tq))`, as the GEMM forward returns them (a row with
/// no visible key gets `O = 0` and `lse = -inf`). Query heads run in parallel.
///
/// The head dim is padded to `DP`, and a tile takes `R` query rows: `R x KEYS` scores and `R x DP`
/// outputs stay in registers (AVX-512 has 32 of 16 lanes), with at least 8 independent sums so that the
/// fused multiply-adds do not wait on each other's latency.
pub(super) fn forward(q: &[f32], k: &[f32], v: &[f32], dims: &Dims, spec: &Spec) -> (Vec<f32>, Vec<f64>) {
    forward_build(q, k, v, dims, spec, Build::Best)
}

fn forward_build(q: &[f32], k: &[f32], v: &[f32], dims: &Dims, spec: &Spec, build: Build) -> (Vec<f32>, Vec<f64>) {
    match dims.d {
        0..=16 => forward_padded::<16, 8>(q, k, v, dims, spec, build),
        17..=32 => forward_padded::<32, 8>(q, k, v, dims, spec, build),
        _ => forward_padded::<64, 4>(q, k, v, dims, spec, build),
    }
}

/// Which compiled copy of [`head`] runs (all but `Best` are for the tests, which compare them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(test), allow(dead_code))]
enum Build {
    /// The widest the CPU has.
    Best,
    Plain,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn forward_padded<const DP: usize, const R: usize>(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: &Dims,
    spec: &Spec,
    build: Build,
) -> (Vec<f32>, Vec<f64>) {
    let Dims { hq, hkv, tq, tk, d, .. } = *dims;
    let rep = hq / hkv;
    let mut out = vec![0f32; q.len()];
    let mut lse = vec![f64::NEG_INFINITY; dims.b * hq * tq];
    let heads = out.par_chunks_mut(tq * d).zip(lse.par_chunks_mut(tq)).enumerate();
    heads.for_each(|(bh, (out, lse))| {
        let kvh = bh / rep;
        let head_in = Head {
            q: &q[bh * tq * d..][..tq * d],
            panels: &pack_panels(&k[kvh * tk * d..][..tk * d], tk, d),
            v: &pad_rows::<DP>(&v[kvh * tk * d..][..tk * d], tk, d),
            dims,
            spec,
        };
        run::<DP, R>(build, &head_in, out, lse);
    });
    (out, lse)
}

/// One query head's inputs: its queries `(Tq, D)`, its key/value head packed.
struct Head<'a> {
    q: &'a [f32],
    /// `(ceil(Tk / KEYS), D, KEYS)`, zero past `Tk`.
    panels: &'a [f32],
    /// `(Tk, DP)`, zero past `D`.
    v: &'a [f32],
    dims: &'a Dims,
    spec: &'a Spec,
}

/// `k (Tk, D)` as panels `(ceil(Tk / KEYS), D, KEYS)`: panel `p`, dimension `c`, lane `l` is `k[p KEYS + l, c]`.
fn pack_panels(k: &[f32], tk: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; tk.div_ceil(KEYS) * d * KEYS];
    for (j, row) in k.chunks_exact(d).enumerate() {
        let panel = &mut out[(j / KEYS) * d * KEYS..][..d * KEYS];
        for (c, &x) in row.iter().enumerate() {
            panel[c * KEYS + j % KEYS] = x;
        }
    }
    out
}

/// `v (Tk, D)` as rows of `DP >= D` floats, zero past `D`.
fn pad_rows<const DP: usize>(v: &[f32], tk: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0f32; tk * DP];
    for (dst, src) in out.chunks_exact_mut(DP).zip(v.chunks_exact(d)) {
        dst[..d].copy_from_slice(src);
    }
    out
}

/// Runs [`head`] in the build asked for: the AVX-512 one takes `R` rows a tile through intrinsics, the
/// others 4 rows through plain loops (LLVM vectorises those well at 4 rows, not at 8).
fn run<const DP: usize, const R: usize>(build: Build, h: &Head, out: &mut [f32], lse: &mut [f64]) {
    #[cfg(target_arch = "x86_64")]
    {
        let avx512 = || std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma");
        let avx2 = || std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
        match build {
            // SAFETY: the CPU has AVX-512F and FMA, checked in the guard.
            Build::Best | Build::Avx512 if avx512() => return unsafe { head_avx512::<DP, R>(h, out, lse) },
            // SAFETY: the CPU has AVX2 and FMA, checked in the guard.
            Build::Best | Build::Avx2 if avx2() => return unsafe { head_avx2::<DP>(h, out, lse) },
            Build::Avx512 | Build::Avx2 => panic!("{build:?} asked for on a CPU without it"),
            Build::Best | Build::Plain => {}
        }
    }
    head::<DP, 4, false>(h, out, lse)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn head_avx512<const DP: usize, const R: usize>(h: &Head, out: &mut [f32], lse: &mut [f64]) {
    head::<DP, R, true>(h, out, lse)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_avx2<const DP: usize>(h: &Head, out: &mut [f32], lse: &mut [f64]) {
    head::<DP, 4, false>(h, out, lse)
}

/// One query head, tile by tile: `out (Tq, D)`, `lse (Tq)`. `AVX512`: the tile products through
/// [`avx512`]'s intrinsics (only inside [`head_avx512`]); otherwise through the plain loops.
#[inline(always)]
fn head<const DP: usize, const R: usize, const AVX512: bool>(h: &Head, out: &mut [f32], lse: &mut [f64]) {
    let Dims { tq, tk, d, .. } = *h.dims;
    let mut scores = Vec::new();
    for i0 in (0..tq).step_by(R) {
        let n = R.min(tq - i0);
        // Each row's visible keys, and the span that covers them all.
        let mut rows = [(0usize, 0usize); R];
        for (r, span) in rows.iter_mut().enumerate().take(n) {
            let (lo, hi) = h.spec.key_range(h.dims, i0 + r);
            *span = (lo, hi.min(tk));
        }
        let seen = rows.iter().filter(|(lo, hi)| hi > lo);
        let (lo, hi) = seen.fold((usize::MAX, 0), |(a, b), &(lo, hi)| (a.min(lo), b.max(hi)));
        if hi <= lo {
            continue; // no row sees a key: O stays 0, lse -inf
        }
        let (p0, p1) = (lo / KEYS, hi.div_ceil(KEYS));
        let width = (p1 - p0) * KEYS;
        scores.resize(R * width, 0f32);
        // (R, D), scaled; zero rows past the tile
        let mut qs = [[0f32; DP]; R];
        for (r, qr) in qs.iter_mut().enumerate().take(n) {
            let src = &h.q[(i0 + r) * d..][..d];
            qr.iter_mut().zip(src).for_each(|(a, &x)| *a = x * h.spec.scale as f32);
        }
        let panels = &h.panels[p0 * d * KEYS..p1 * d * KEYS];
        scores_of::<DP, R, AVX512>(&qs, panels, d, &mut scores, width);
        let inv = softmax_rows(&mut scores, width, &rows, (lo, hi), p0 * KEYS, &mut lse[i0..i0 + n]);
        let o = values_of::<DP, R, AVX512>(&scores, width, lo - p0 * KEYS, &h.v[lo * DP..hi * DP]);
        for (r, or) in o.iter().enumerate().take(n) {
            let dst = &mut out[(i0 + r) * d..][..d];
            dst.iter_mut().zip(or).for_each(|(y, &x)| *y = x * inv[r]);
        }
    }
}

/// The softmax of each tile row over its visible keys `rows[r]`, in place in `scores (R, width)` (whose
/// column 0 is key `base`): the columns of the tile's span `lo..hi` that a row does not see become 0.
/// Writes the rows' logsumexps into `lse` (one per real row) and returns `1 / sum` per row (0 for a row
/// that sees no key), by which its `P V` is divided.
#[inline(always)]
fn softmax_rows<const R: usize>(
    scores: &mut [f32],
    width: usize,
    rows: &[(usize, usize); R],
    (lo, hi): (usize, usize),
    base: usize,
    lse: &mut [f64],
) -> [f32; R] {
    let mut inv = [0f32; R];
    for (r, &(rlo, rhi)) in rows.iter().enumerate() {
        let row = &mut scores[r * width..][..width];
        let (a, b) = (lo - base, hi - base);
        if rhi <= rlo {
            row[a..b].fill(0.0);
            continue;
        }
        let (ra, rb) = (rlo - base, rhi - base);
        row[a..ra].fill(0.0);
        row[rb..b].fill(0.0);
        let span = &mut row[ra..rb];
        let m = max(span);
        let l = exp_sum(span, m);
        lse[r] = m as f64 + l.ln();
        inv[r] = (1.0 / l) as f32;
    }
    inv
}

/// [`tile_scores`], through [`avx512`]'s intrinsics when `AVX512` (set only inside [`head_avx512`]).
#[inline(always)]
fn scores_of<const DP: usize, const R: usize, const AVX512: bool>(
    qs: &[[f32; DP]; R],
    panels: &[f32],
    d: usize,
    scores: &mut [f32],
    width: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if AVX512 {
        // SAFETY: `AVX512` is set only by `head_avx512`, which runs on CPUs with AVX-512F and FMA.
        return unsafe { avx512::tile_scores(qs, panels, d, scores, width) };
    }
    tile_scores(qs, panels, d, scores, width)
}

/// [`tile_values`], through [`avx512`]'s intrinsics when `AVX512` (as [`scores_of`]).
#[inline(always)]
fn values_of<const DP: usize, const R: usize, const AVX512: bool>(
    probs: &[f32],
    width: usize,
    first: usize,
    v: &[f32],
) -> [[f32; DP]; R] {
    #[cfg(target_arch = "x86_64")]
    if AVX512 {
        // SAFETY: as in `scores_of`.
        return unsafe { avx512::tile_values(probs, width, first, v) };
    }
    tile_values(probs, width, first, v)
}

/// `scores (R, width)` of the tile against `panels` (`width / KEYS` panels of `(d, KEYS)`):
/// `R x KEYS` accumulators over `d` fused multiply-adds per panel.
#[inline(always)]
fn tile_scores<const DP: usize, const R: usize>(
    qs: &[[f32; DP]; R],
    panels: &[f32],
    d: usize,
    scores: &mut [f32],
    width: usize,
) {
    for (p, panel) in panels.chunks_exact(d * KEYS).enumerate() {
        let mut acc = [[0f32; KEYS]; R];
        for (c, keys) in panel.chunks_exact(KEYS).enumerate() {
            for (a, qr) in acc.iter_mut().zip(qs) {
                a.iter_mut().zip(keys).for_each(|(s, &kx)| *s = qr[c].mul_add(kx, *s));
            }
        }
        for (r, a) in acc.iter().enumerate() {
            scores[r * width + p * KEYS..][..KEYS].copy_from_slice(a);
        }
    }
}

/// `sum_j p[r, first + j] v[j]` for the tile's rows: `v` holds the tile's keys `(n, DP)`, `probs` the
/// `(R, width)` probabilities (unnormalised), whose column `first` is `v`'s row 0.
#[inline(always)]
fn tile_values<const DP: usize, const R: usize>(
    probs: &[f32],
    width: usize,
    first: usize,
    v: &[f32],
) -> [[f32; DP]; R] {
    let mut o = [[0f32; DP]; R];
    for (j, vr) in v.chunks_exact(DP).enumerate() {
        for (r, or) in o.iter_mut().enumerate() {
            let p = probs[r * width + first + j];
            or.iter_mut().zip(vr).for_each(|(y, &x)| *y = p.mul_add(x, *y));
        }
    }
    o
}

/// [`tile_scores`] and [`tile_values`] in AVX-512 intrinsics, the same operations in the same order
/// (so bitwise equal), for 8 rows a tile, which the plain loops do not vectorise well.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::KEYS;
    use std::arch::x86_64::*;

    /// The most 16-lane vectors in a padded row of `O` (`DP = 64`).
    const MAX_VECS: usize = 4;

    /// [`super::tile_scores`].
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    pub(super) unsafe fn tile_scores<const DP: usize, const R: usize>(
        qs: &[[f32; DP]; R],
        panels: &[f32],
        d: usize,
        scores: &mut [f32],
        width: usize,
    ) {
        assert!(d <= DP && scores.len() >= R * width && panels.len() / (d * KEYS) * KEYS <= width);
        for (p, panel) in panels.chunks_exact(d * KEYS).enumerate() {
            let mut acc = [_mm512_setzero_ps(); R];
            for (c, keys) in panel.chunks_exact(KEYS).enumerate() {
                // SAFETY: `keys` holds KEYS floats.
                let keys = unsafe { _mm512_loadu_ps(keys.as_ptr()) };
                for (a, qr) in acc.iter_mut().zip(qs) {
                    *a = _mm512_fmadd_ps(_mm512_set1_ps(qr[c]), keys, *a);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                // SAFETY: row r of `scores` has `width >= (p + 1) KEYS` floats (asserted above).
                unsafe { _mm512_storeu_ps(scores.as_mut_ptr().add(r * width + p * KEYS), *a) };
            }
        }
    }

    /// [`super::tile_values`].
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    pub(super) unsafe fn tile_values<const DP: usize, const R: usize>(
        probs: &[f32],
        width: usize,
        first: usize,
        v: &[f32],
    ) -> [[f32; DP]; R] {
        let vecs = DP / KEYS;
        assert!(vecs <= MAX_VECS && DP.is_multiple_of(KEYS) && probs.len() >= (R - 1) * width + first + v.len() / DP);
        let keys = v.len() / DP;
        // Each row's probabilities of the tile's keys, as slices of exactly `keys` (no bounds checks below).
        let rows: [&[f32]; R] = std::array::from_fn(|r| &probs[r * width + first..][..keys]);
        let mut o = [[_mm512_setzero_ps(); MAX_VECS]; R];
        for (j, vr) in v.chunks_exact(DP).enumerate() {
            let mut x = [_mm512_setzero_ps(); MAX_VECS];
            for (c, xc) in x.iter_mut().enumerate().take(vecs) {
                // SAFETY: `vr` holds DP = vecs * KEYS floats.
                *xc = unsafe { _mm512_loadu_ps(vr.as_ptr().add(c * KEYS)) };
            }
            for (r, or) in o.iter_mut().enumerate() {
                let p = _mm512_set1_ps(rows[r][j]);
                for (oc, xc) in or.iter_mut().zip(&x).take(vecs) {
                    *oc = _mm512_fmadd_ps(p, *xc, *oc);
                }
            }
        }
        let mut out = [[0f32; DP]; R];
        for (dst, or) in out.iter_mut().zip(&o) {
            for (c, oc) in or.iter().enumerate().take(vecs) {
                // SAFETY: `dst` holds DP = vecs * KEYS floats.
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(c * KEYS), *oc) };
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::{forward as gemm_forward, Mask};
    use super::*;

    /// Deterministic values in [-2, 2), so that the softmax is far from uniform.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    struct Case {
        dims: Dims,
        mask: Mask,
    }

    fn cases() -> Vec<Case> {
        let dims = |b, hq, hkv, tq, tk, d| Dims { b, hq, hkv, tq, tk, d };
        let cu = vec![0, 5, 5, 6, 70, 71, 150];
        vec![
            Case { dims: dims(2, 6, 2, 13, 13, 7), mask: Mask::None },
            Case { dims: dims(2, 6, 2, 13, 13, 7), mask: Mask::Causal },
            // Decode and chunked prefill: the queries are the last Tq of Tk keys.
            Case { dims: dims(1, 4, 2, 1, 9, 16), mask: Mask::Causal },
            Case { dims: dims(1, 4, 2, 37, 150, 16), mask: Mask::Causal },
            Case { dims: dims(1, 2, 2, 150, 150, 16), mask: Mask::BlockDiagonal(cu.clone()) },
            Case { dims: dims(1, 4, 1, 150, 150, 24), mask: Mask::CausalBlockDiagonal(cu) },
            Case { dims: dims(1, 2, 1, 67, 67, 1), mask: Mask::None },
            Case { dims: dims(1, 2, 2, 40, 40, 33), mask: Mask::Causal },
            Case { dims: dims(1, 1, 1, 33, 33, 64), mask: Mask::None },
        ]
    }

    fn inputs(d: &Dims) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (nq, nk) = (d.b * d.hq * d.tq * d.d, d.b * d.hkv * d.tk * d.d);
        (values(nq, 1), values(nk, 2), values(nk, 3))
    }

    fn run_build(build: Build, c: &Case) -> (Vec<f32>, Vec<f64>) {
        let spec = Spec { mask: c.mask.clone(), keep: None, scale: 1.0 / (c.dims.d as f64).sqrt() };
        let (q, k, v) = inputs(&c.dims);
        forward_build(&q, &k, &v, &c.dims, &spec, build)
    }

    /// Against the GEMM forward. The two differ only in rounding: the scores' products are summed in
    /// another order (and `q` is scaled before them, not the sums after), which moves a score by a few
    /// ulps of its size (|s| < 12 here, so about 1e-6, and `p` by that relative amount), and `O` is
    /// normalised after `P V` instead of before: `O` within 1e-5 of the largest |v| (2), `lse` within
    /// 1e-5 absolute.
    #[test]
    fn fused_forward_matches_the_gemm_forward() {
        for c in cases() {
            let spec = Spec { mask: c.mask.clone(), keep: None, scale: 1.0 / (c.dims.d as f64).sqrt() };
            assert!(applies(&c.dims, &spec), "{:?} should be fused", c.dims);
            let (q, k, v) = inputs(&c.dims);
            let (o, lse) = forward(&q, &k, &v, &c.dims, &spec);
            let (o_ref, lse_ref) = gemm_forward(&q, &k, &v, &c.dims, &spec);
            let od = o.iter().zip(&o_ref).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let ld =
                lse.iter().zip(&lse_ref).map(|(a, b)| if a == b { 0.0 } else { (a - b).abs() }).fold(0f64, f64::max);
            println!("{:?} {:?}: max |dO| {od:.2e}, max |dlse| {ld:.2e}", c.dims, c.mask);
            assert!(od <= 2e-5, "{:?} {:?}: O differs by {od}", c.dims, c.mask);
            assert!(ld <= 1e-5, "{:?} {:?}: lse differs by {ld}", c.dims, c.mask);
            // Rows without a visible key (empty segments) agree exactly: O = 0 and lse = -inf.
            for (a, b) in lse.iter().zip(&lse_ref) {
                assert_eq!(a.is_finite(), b.is_finite());
            }
        }
    }

    /// Every compiled copy computes bit for bit what the plain one does (all of its operations are
    /// exactly rounded; `mul_add` is one rounding whatever the instruction set).
    #[test]
    fn every_compiled_build_is_bitwise_the_plain_one() {
        for c in cases() {
            let plain = run_build(Build::Plain, &c);
            #[cfg(target_arch = "x86_64")]
            {
                let fma = std::arch::is_x86_feature_detected!("fma");
                if fma && std::arch::is_x86_feature_detected!("avx512f") {
                    assert_eq!(run_build(Build::Avx512, &c), plain, "avx512 {:?}", c.dims);
                } else {
                    println!("SKIPPED: no AVX-512F and FMA on this CPU");
                }
                if fma && std::arch::is_x86_feature_detected!("avx2") {
                    assert_eq!(run_build(Build::Avx2, &c), plain, "avx2 {:?}", c.dims);
                } else {
                    println!("SKIPPED: no AVX2 and FMA on this CPU");
                }
            }
            assert_eq!(run_build(Build::Best, &c), plain);
        }
    }

    #[test]
    fn larger_heads_and_key_padding_stay_on_the_gemm_forward() {
        let d = |d| Dims { b: 1, hq: 1, hkv: 1, tq: 2, tk: 2, d };
        let spec = Spec { mask: Mask::None, keep: None, scale: 1.0 };
        assert!(applies(&d(64), &spec) && !applies(&d(65), &spec) && !applies(&d(0), &spec));
        let padded = Spec { keep: Some(vec![true, false]), ..spec };
        assert!(!applies(&d(16), &padded));
    }
}
