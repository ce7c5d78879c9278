//! `e^x` in f32 for the attention softmax, written so that a loop over a slice vectorises (no call, no
//! branch, SSE2 integer tricks only): the twin of `f32::exp`, which the CPU attention called once per
//! score, three times per score with gradient checkpointing (forward, recomputed forward, backward), and
//! which took 11% of a packed training step on phone screenshots (perf, 2026-11-27).
//!
//! Range reduction `x = k ln2 + r`, `|r| <= ln2 / 2`, with `k` rounded by adding 1.5 * 2^23 (its low
//! mantissa bits are then `k` itself) and `ln2` in two parts (Cody and Waite); `e^r` by its Taylor series
//! to degree 7 (truncation below 5e-9 relative), Horner in f32; `2^k` built from its exponent bits.
//! Relative error against f64 `exp` below [`MAX_REL_ERR`] (one ulp) on `[-87, 0]` (tests sweep it densely); inputs
//! below -87.3 give 0 (`e^x` is then below f32's normal range, and a softmax score there is nothing), and
//! NaN stays NaN.
//! Only `x <= 0` is supported: a softmax takes `exp(s - max)` and `exp(s - lse)`.

/// Lanes of the softmax row helpers ([`max`], [`exp_sum`]): one AVX-512 register of f32.
const LANES: usize = 16;

/// The bound the tests hold [`exp_f32`] to, against f64 `exp`: one ulp of f32 at 1 (measured: 9.5e-8).
pub const MAX_REL_ERR: f64 = f32::EPSILON as f64;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `k * LN2_HI` is exact for `|k| < 2^10`.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding it rounds a float below 2^22 in magnitude to an integer, held in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
/// Below it `e^x` is under f32's smallest normal number.
const LOWEST: f32 = -87.3;

/// `e^x` for `x <= 0` (see the module docs); branch-free, so loops over it vectorise.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    exp_f32_in::<false>(x)
}

/// [`exp_f32`] with its products and sums fused (`mul_add`: 12 vector operations instead of 21), for loops
/// compiled where the CPU has FMA (elsewhere each `mul_add` is a library call). Within the same bound of
/// f64 `exp`, but not bitwise [`exp_f32`].
#[inline(always)]
pub fn exp_f32_fma(x: f32) -> f32 {
    exp_f32_in::<true>(x)
}

#[inline(always)]
fn exp_f32_in<const FMA: bool>(x: f32) -> f32 {
    let madd = |a: f32, b: f32, c: f32| if FMA { a.mul_add(b, c) } else { a * b + c };
    // Not `max`: a NaN score must stay NaN (it must reach the trainer's non-finite check).
    let xc = if x < LOWEST { LOWEST } else { x };
    let t = madd(xc, LOG2E, ROUND);
    let k = t - ROUND;
    // The integer k, from t's mantissa bits: t = ROUND + k exactly.
    let ki = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = madd(-k, LN2_LO, madd(-k, LN2_HI, xc));
    let mut p = 1.0 / 5040.0;
    for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = madd(p, r, c);
    }
    let scale = f32::from_bits((ki.wrapping_add(127) as u32) << 23);
    let e = p * scale;
    if x < LOWEST {
        0.0
    } else {
        e
    }
}

/// `xs[i] = e^((xs[i] - hi) - lo)`: [`exp_f32`] over a slice, with the shift given as an f32 pair
/// (`hi + lo` carries an f64 shift such as a logsumexp to about 2^-48 of itself). On x86-64 CPUs with
/// AVX-512F, or AVX2 and FMA, the same loop is compiled for them (16 or 8 lanes instead of SSE2's 4; no
/// contraction into fused multiply-adds, so the results are bitwise those of the plain loop).
pub fn exp_shifted_f32(xs: &mut [f32], hi: f32, lo: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { exp_shifted_avx512(xs, hi, lo) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA, checked just above.
        return unsafe { exp_shifted_avx2(xs, hi, lo) };
    }
    exp_shifted_plain(xs, hi, lo)
}

#[inline(always)]
fn exp_shifted_plain(xs: &mut [f32], hi: f32, lo: f32) {
    xs.iter_mut().for_each(|x| *x = exp_f32((*x - hi) - lo));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(xs: &mut [f32], hi: f32, lo: f32) {
    exp_shifted_plain(xs, hi, lo)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_shifted_avx512(xs: &mut [f32], hi: f32, lo: f32) {
    exp_shifted_plain(xs, hi, lo)
}

/// An f64 shift as `(hi, lo)` f32 parts for [`exp_shifted_f32`].
pub fn split_shift(shift: f64) -> (f32, f32) {
    let hi = shift as f32;
    (hi, (shift - hi as f64) as f32)
}

/// The largest element (NaN ignored, as `f32::max`), in [`LANES`] lanes: a softmax row's shift.
#[inline(always)]
pub(crate) fn max(xs: &[f32]) -> f32 {
    let pick = |m: f32, x: f32| if x > m { x } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| pick(m, x));
    for c in chunks {
        lanes.iter_mut().zip(c).for_each(|(m, &x)| *m = pick(*m, x));
    }
    lanes.into_iter().fold(tail, pick)
}

/// Elements summed in f32 lanes before their sum joins the f64 total: each lane adds [`SUM_BLOCK`] / 16
/// terms in f32 (relative error below 16 ulps), and the blocks add up in f64.
const SUM_BLOCK: usize = 256;

/// `xs[i] = e^(xs[i] - m)` (with [`exp_f32_fma`]) and their sum, block by block while the block is in L1.
#[inline(always)]
pub(crate) fn exp_sum(xs: &mut [f32], m: f32) -> f64 {
    let mut total = 0f64;
    for block in xs.chunks_mut(SUM_BLOCK) {
        block.iter_mut().for_each(|x| *x = exp_f32_fma(*x - m));
        let mut lanes = [0f32; LANES];
        let chunks = block.chunks_exact(LANES);
        let tail: f32 = chunks.remainder().iter().sum();
        for c in chunks {
            lanes.iter_mut().zip(c).for_each(|(l, &x)| *l += x);
        }
        total += lanes.iter().map(|&l| l as f64).sum::<f64>() + tail as f64;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slice_form_equals_the_scalar_one_and_carries_an_f64_shift() {
        let xs: Vec<f32> = (0..1000).map(|i| (i as f32) * -0.037 + 1.5).collect();
        let shift = 1.5f64 + 1e-9;
        let (hi, lo) = split_shift(shift);
        let mut got = xs.clone();
        exp_shifted_f32(&mut got, hi, lo);
        for (x, g) in xs.iter().zip(&got) {
            assert_eq!(g.to_bits(), exp_f32((x - hi) - lo).to_bits());
            let want = (*x as f64 - shift).exp();
            assert!((*g as f64 - want).abs() <= 4.0 * MAX_REL_ERR * want + 1e-37, "{x}: {g} vs {want}");
        }
    }

    #[test]
    fn every_compiled_variant_is_bitwise_the_plain_loop() {
        // Odd length (a vector tail), the clamp at the low end, NaN and every binade of [-87, 0].
        let mut xs: Vec<f32> = (0..4099).map(|i| -(i as f32) * 0.0213 + 0.25).collect();
        xs.extend([-87.2, -87.4, -1e30, f32::NEG_INFINITY, f32::NAN, 0.25]);
        let mut want = xs.clone();
        exp_shifted_plain(&mut want, 0.25, 1e-9);
        let same = |got: &[f32]| got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
        let mut got = xs.clone();
        exp_shifted_f32(&mut got, 0.25, 1e-9);
        assert!(same(&got), "the dispatched loop");
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                let mut got = xs.clone();
                // SAFETY: checked just above.
                unsafe { exp_shifted_avx512(&mut got, 0.25, 1e-9) };
                assert!(same(&got), "AVX-512F");
            }
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                let mut got = xs.clone();
                // SAFETY: checked just above.
                unsafe { exp_shifted_avx2(&mut got, 0.25, 1e-9) };
                assert!(same(&got), "AVX2");
            }
        }
    }

    fn rel(exp: fn(f32) -> f32, x: f32) -> f64 {
        let want = (x as f64).exp();
        (exp(x) as f64 - want).abs() / want
    }

    #[test]
    fn exp_f32_is_within_its_bound_of_f64_exp() {
        for (name, exp) in [("exp_f32", exp_f32 as fn(f32) -> f32), ("exp_f32_fma", exp_f32_fma)] {
            // A dense sweep of [-87, 0] (step 2^-10 near 0 and 1e-3 below), plus the ends.
            let mut worst = (0f64, 0f32);
            let near = (0..=4096).map(|i| -(i as f32) / 1024.0);
            let far = (0..=87_000).map(|i| -(i as f32) * 1e-3);
            for x in near.chain(far).chain([-87.0, -1e-30, 0.0]) {
                let e = rel(exp, x);
                if e > worst.0 {
                    worst = (e, x);
                }
            }
            eprintln!("{name}: largest relative error {:.3e} at x = {}", worst.0, worst.1);
            assert!(worst.0 <= MAX_REL_ERR, "{name}: relative error {:.3e} at x = {}", worst.0, worst.1);
            // As f32::exp does within its ulp.
            assert_eq!(exp(0.0), 1.0, "{name}");
        }
    }

    #[test]
    fn exp_f32_of_very_negative_scores_is_zero_and_never_nan() {
        for exp in [exp_f32 as fn(f32) -> f32, exp_f32_fma] {
            for x in [-87.4f32, -100.0, -1e30, f32::MIN, f32::NEG_INFINITY] {
                assert_eq!(exp(x), 0.0, "x = {x}");
            }
            assert!(exp(f32::NAN).is_nan(), "NaN stays NaN");
        }
    }
}
