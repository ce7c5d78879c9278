//! The CPU fast path of the tiling: the bicubic resize and the normalise + patchify that serve and eval run
//! on every screenshot, bit for bit those of the references in the parent module (tests below).
//!
//! Why: the references took 9 ms of a 53 ms next-action step on a 640x480 screenshot (2026-11-28). Four
//! changes, none of which changes a bit:
//! - the horizontal pass keeps the three channels of a pixel in three registers instead of walking a
//!   three-element slice per tap (the sums are integers, so their order does not matter);
//! - both passes' row kernels are compiled for AVX2 where the CPU has it (SSE2 has no 32-bit multiply);
//! - normalisation reads a 256-entry table per channel, filled with the very f32 expression of the
//!   reference (`(v - mean) / std`), and patchify copies runs of `patch` values out of it;
//! - both resize passes and the patchify split their output rows over the rayon pool.

use rayon::prelude::*;

use super::{check_patchify, check_resize, scaled_mean_std, taps, PatchGeometry, TilingError};

/// The taps of one pass laid out flat: output `i` reads inputs `start[i]..start[i] + width` with weights
/// `weights[i * width..][..width]` (zero past its own count).
struct FlatTaps {
    start: Vec<usize>,
    weights: Vec<i32>,
    width: usize,
    round: i32,
    precision: u32,
}

fn flat_taps(n_in: usize, n_out: usize) -> FlatTaps {
    let t = taps(n_in, n_out);
    // Never more than `n_in` (the taps are clipped to the input).
    let width = t.weights.iter().map(Vec::len).max().unwrap_or(0);
    let mut start = Vec::with_capacity(n_out);
    let mut weights = vec![0; n_out * width];
    for (dst, (&lo, w)) in weights.chunks_exact_mut(width.max(1)).zip(t.start.iter().zip(&t.weights)) {
        // An output near the right edge has fewer taps: its window moves left so that it stays inside the
        // input, and its weights right by as much (`lo + w.len() <= n_in`, so they still fit).
        let first = lo.min(n_in - width);
        dst[lo - first..][..w.len()].copy_from_slice(w);
        start.push(first);
    }
    FlatTaps { start, weights, width, round: t.round(), precision: t.precision }
}

fn clamp_shift(a: i32, precision: u32) -> u8 {
    (a >> precision).clamp(0, 255) as u8
}

/// Horizontal pass over interleaved RGB rows: `height x n_in x 3 -> height x n_out x 3`.
fn horizontal(src: &[u8], height: usize, n_in: usize, n_out: usize) -> Vec<u8> {
    let (t, fast) = (flat_taps(n_in, n_out), avx2());
    let mut dst = vec![0u8; height * n_out * 3];
    dst.par_chunks_mut(n_out * 3).zip(src.par_chunks(n_in * 3)).for_each(|(out, row)| {
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: the CPU has AVX2 (`avx2()`).
            return unsafe { horizontal_row_avx2(&t, row, out) };
        }
        horizontal_row(&t, row, out)
    });
    dst
}

#[inline(always)]
fn horizontal_row(t: &FlatTaps, row: &[u8], out: &mut [u8]) {
    for (i, px) in out.chunks_exact_mut(3).enumerate() {
        let w = &t.weights[i * t.width..][..t.width];
        let s = &row[t.start[i] * 3..][..t.width * 3];
        let (mut r, mut g, mut b) = (t.round, t.round, t.round);
        for (&wj, p) in w.iter().zip(s.chunks_exact(3)) {
            r += wj * p[0] as i32;
            g += wj * p[1] as i32;
            b += wj * p[2] as i32;
        }
        px[0] = clamp_shift(r, t.precision);
        px[1] = clamp_shift(g, t.precision);
        px[2] = clamp_shift(b, t.precision);
    }
}

/// Vertical pass over whole rows of `inner` values: `n_in x inner -> n_out x inner`.
fn vertical(src: &[u8], n_in: usize, inner: usize, n_out: usize) -> Vec<u8> {
    let (t, fast) = (flat_taps(n_in, n_out), avx2());
    let mut dst = vec![0u8; n_out * inner];
    dst.par_chunks_mut(inner).enumerate().for_each_init(
        || vec![0i32; inner],
        |acc, (i, out)| {
            #[cfg(target_arch = "x86_64")]
            if fast {
                // SAFETY: the CPU has AVX2 (`avx2()`).
                return unsafe { vertical_line_avx2(&t, src, i, acc, out) };
            }
            vertical_line(&t, src, i, acc, out)
        },
    );
    dst
}

#[inline(always)]
fn vertical_line(t: &FlatTaps, src: &[u8], i: usize, acc: &mut [i32], out: &mut [u8]) {
    let inner = out.len();
    acc.fill(t.round);
    let w = &t.weights[i * t.width..][..t.width];
    for (j, &wj) in w.iter().enumerate().filter(|(_, &wj)| wj != 0) {
        let line = &src[(t.start[i] + j) * inner..][..inner];
        acc.iter_mut().zip(line).for_each(|(a, &x)| *a += wj * x as i32);
    }
    out.iter_mut().zip(acc.iter()).for_each(|(y, &a)| *y = clamp_shift(a, t.precision));
}

/// The two row kernels compiled for AVX2 where the CPU has it (8 lanes and a 32-bit multiply; the
/// baseline SSE2 has neither), else as they are. Integer arithmetic: the result is the same either way.
fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn horizontal_row_avx2(t: &FlatTaps, row: &[u8], out: &mut [u8]) {
    horizontal_row(t, row, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vertical_line_avx2(t: &FlatTaps, src: &[u8], i: usize, acc: &mut [i32], out: &mut [u8]) {
    vertical_line(t, src, i, acc, out)
}

/// [`super::resize_bicubic_reference`], bit for bit, faster (see the module docs).
pub fn resize_bicubic(
    rgb: &[u8],
    width: usize,
    height: usize,
    new_width: usize,
    new_height: usize,
) -> Result<Vec<u8>, TilingError> {
    check_resize(rgb, width, height, new_width, new_height)?;
    let img = match new_width != width {
        true => horizontal(rgb, height, width, new_width),
        false => rgb.to_vec(),
    };
    Ok(match new_height != height {
        true => vertical(&img, height, new_width * 3, new_height),
        false => img,
    })
}

/// [`super::normalize_patchify_reference`], bit for bit, faster (see the module docs).
pub fn normalize_patchify(
    rgb: &[u8],
    width: usize,
    height: usize,
    geo: PatchGeometry,
    mean: [f32; 3],
    std: [f32; 3],
) -> Result<(Vec<f32>, (usize, usize)), TilingError> {
    check_patchify(rgb, width, height, geo)?;
    let (p, m, tp) = (geo.patch_size, geo.merge_size, geo.temporal_patch_size);
    let (gh, gw) = (height / p, width / p);
    let (mean, std) = scaled_mean_std(mean, std);
    let lut: Vec<[f32; 256]> = (0..3).map(|c| std::array::from_fn(|v| (v as f32 - mean[c]) / std[c])).collect();
    let dim = geo.patch_dim();
    let block_row = (gw / m) * m * m * dim;
    let mut out = vec![0f32; (gh / m) * block_row];
    if block_row == 0 {
        return Ok((out, (gh, gw)));
    }
    out.par_chunks_mut(block_row).enumerate().for_each(|(bh, rows)| {
        for (k, patch) in rows.chunks_exact_mut(dim).enumerate() {
            let (bw, mh, mw) = (k / (m * m), (k / m) % m, k % m);
            let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
            // Columns run over (channel, temporal copy, y, x): the first copy, then the others repeat it.
            for (c, plane) in patch.chunks_exact_mut(tp * p * p).enumerate() {
                let (first, rest) = plane.split_at_mut(p * p);
                for (y, dst) in first.chunks_exact_mut(p).enumerate() {
                    let src = &rgb[((y0 + y) * width + x0) * 3..][..p * 3];
                    dst.iter_mut().zip(src.chunks_exact(3)).for_each(|(d, px)| *d = lut[c][px[c] as usize]);
                }
                rest.chunks_exact_mut(p * p).for_each(|copy| copy.copy_from_slice(first));
            }
        }
    });
    Ok((out, (gh, gw)))
}

#[cfg(test)]
mod tests {
    use super::super::{normalize_patchify_reference, resize_bicubic_reference, CLIP_MEAN, CLIP_STD};
    use super::*;

    /// Deterministic noise, so that every tap and every table entry is exercised.
    fn image(w: usize, h: usize, seed: usize) -> Vec<u8> {
        (0..w * h * 3).map(|i| (((i + seed) * 2_654_435_761) >> 13) as u8).collect()
    }

    #[test]
    fn resize_is_bitwise_the_reference() {
        // Up, down, one axis only, strong downscale (wide support, clipped taps at both edges), tiny.
        let cases = [
            ((640, 480), (644, 476)),
            ((1080, 2400), (504, 1120)),
            ((300, 200), (300, 56)),
            ((300, 200), (56, 200)),
            ((1000, 30), (28, 28)),
            ((3, 2), (56, 84)),
            ((31, 17), (31, 17)),
        ];
        for (k, ((w, h), (nw, nh))) in cases.into_iter().enumerate() {
            let img = image(w, h, k);
            let fast = resize_bicubic(&img, w, h, nw, nh).unwrap();
            assert_eq!(fast, resize_bicubic_reference(&img, w, h, nw, nh).unwrap(), "{w}x{h} -> {nw}x{nh}");
        }
    }

    #[test]
    fn patchify_is_bitwise_the_reference() {
        let geos = [
            PatchGeometry::default(),
            PatchGeometry { patch_size: 14, merge_size: 2, temporal_patch_size: 1 },
            PatchGeometry { patch_size: 16, merge_size: 1, temporal_patch_size: 3 },
        ];
        for (k, geo) in geos.into_iter().enumerate() {
            // Sides that are not multiples of the merged patch too: both paths drop the same remainder.
            for (w, h) in [(644, 476), (56, 28), (90, 60)] {
                let img = image(w, h, k);
                let fast = normalize_patchify(&img, w, h, geo, CLIP_MEAN, CLIP_STD).unwrap();
                let reference = normalize_patchify_reference(&img, w, h, geo, CLIP_MEAN, CLIP_STD).unwrap();
                assert_eq!(fast.1, reference.1);
                let same = fast.0.iter().zip(&reference.0).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same && fast.0.len() == reference.0.len(), "{w}x{h} {geo:?}");
            }
        }
    }

    #[test]
    fn bad_buffers_are_refused_as_the_reference_refuses_them() {
        let geo = PatchGeometry::default();
        assert_eq!(resize_bicubic(&[0; 5], 2, 1, 4, 4), resize_bicubic_reference(&[0; 5], 2, 1, 4, 4));
        assert_eq!(resize_bicubic(&[], 0, 0, 4, 4), resize_bicubic_reference(&[], 0, 0, 4, 4));
        let bad = normalize_patchify(&[0; 5], 2, 1, geo, CLIP_MEAN, CLIP_STD);
        assert_eq!(bad, normalize_patchify_reference(&[0; 5], 2, 1, geo, CLIP_MEAN, CLIP_STD));
        assert!(matches!(bad, Err(TilingError::Buffer { got: 5, want: 6, .. })));
        let zero = PatchGeometry { merge_size: 0, ..geo };
        let bad = normalize_patchify(&[0; 12], 2, 2, zero, CLIP_MEAN, CLIP_STD);
        assert_eq!(bad, normalize_patchify_reference(&[0; 12], 2, 2, zero, CLIP_MEAN, CLIP_STD));
        assert_eq!(bad, Err(TilingError::Geometry(zero)));
    }
}
