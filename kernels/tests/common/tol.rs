//! The kernel tests' one comparison: `|got - want| <= atol + rtol * |want|` per element (equal values,
//! infinities included, pass; NaN in either side fails), with the tolerances of each kind of result named
//! once, with the reason for each. The attention tolerances are `askgui-train check-gpu`'s own
//! (`askgui_kernels::selfcheck`), where their reasons are written. [`compare`] works on flat `f64` values;
//! [`ensure_close`] and [`compare_tensors`] are the same check as an `anyhow` error.

use anyhow::ensure;
use candle_core::{Device, Tensor};

pub use askgui_kernels::selfcheck::Tol;
use askgui_kernels::selfcheck::{BF16_FWD, BF16_GRAD, F32_FWD, F32_GRAD};

/// Bit-exact (tiling: integer filters and IEEE division on both sides).
pub const EXACT: Tol = Tol { atol: 0.0, rtol: 0.0 };
/// f32 row statistics (sums of up to 12.5k terms) against the CPU op's f64: rounding noise of a few 1e-6
/// relative; 2e-5 leaves margin yet catches a wrong term (which costs O(1)).
pub const F32_ROWS: Tol = Tol { atol: 2e-5, rtol: 2e-5 };
/// f32 parameter gradients are sums over up to 4097 rows, accumulated in f32 partials; |dw| grows like
/// sqrt(rows), rounding noise like rows * 6e-8 in the worst case.
pub const F32_PARAMS: Tol = Tol { atol: 2e-4, rtol: 1e-4 };
/// RoPE: two products and a sum per output, f32 FMA vs f64: two f32 ulps.
pub const F32_ROPE: Tol = Tol { atol: 1e-6, rtol: 1e-6 };
/// cuBLAS f32 (full f32 compute, candle's default: no TF32) against the CPU GEMM: both accumulate up to
/// 1280 products in f32, in different orders.
pub const F32_GEMM: Tol = Tol { atol: 1e-4, rtol: 1e-4 };
/// bf16 outputs are rounded once from f32 math: half an ulp is at most 2^-8 of |ref|, and an f32
/// difference that flips a rounding tie costs one ulp, at most 2^-7 of |ref|. So rtol = 2^-7 and a small
/// atol for values near zero, where f32 cancellation noise (~1e-6 of the operands) dominates.
pub const BF16: Tol = Tol { atol: 1e-4, rtol: 1.0 / 128.0 };
/// f32 attention output (summation order and `exp2f` ulps only).
pub const F32_ATTN: Tol = F32_FWD;
/// f32 attention gradients (sums over up to 4097 rows through f32 atomics; values up to ~10).
pub const F32_ATTN_GRAD: Tol = F32_GRAD;
/// bf16 attention output (O rounded to bf16, P rounded for P V on tensor cores).
pub const BF16_ATTN: Tol = BF16_FWD;
/// bf16 attention gradients (the bf16 O in rowsum(dO * O), P and dS rounded, gradients rounded).
pub const BF16_ATTN_GRAD: Tol = BF16_GRAD;

// The CPU CustomOps against their plain-candle references and finite differences (`tests/grad_*.rs`).

/// f32 op against its plain-candle `*_reference` (norms, `frozen_linear`, masked cross-entropy; forward
/// and autograd gradients): both sides compute in f32-or-better, and 1e-5 covers the rounding of sums over
/// a few hundred terms (the op accumulates in f64, the reference in f32).
pub const REF_F32: Tol = Tol { atol: 1e-5, rtol: 1e-5 };
/// f32 attention forward against `attention_reference`: the reference's f32 softmax and matmul over at
/// most 150 keys round to ~1e-7 relative; the op accumulates in f64 and rounds once. (Written before as
/// `1e-5 * (1 + |ref|)`: the same bound.)
pub const REF_ATTN_F32: Tol = Tol { atol: 1e-5, rtol: 1e-5 };
/// f32 attention gradients against candle's autograd through `attention_reference`: the reference goes
/// through an f32 softmax (exp, sum, divide) and three f32 matmul chains whose rounding (~1e-7 relative
/// each) is amplified by the softmax Jacobian and by sums over keys and GQA heads with values of a few
/// units; 1e-4 leaves a margin over the measured ~1e-6 while still catching any wrong term (those give
/// errors of order 1e-1). (Written before as `1e-4 * (1 + |ref|)`: the same bound.)
pub const REF_ATTN_F32_GRAD: Tol = Tol { atol: 1e-4, rtol: 1e-4 };
/// f32 RoPE against `rope_reference` (forward and gradient): every output is a sum of two products of
/// values below 1 in magnitude, so f32 rounding (the reference rounds each product, the op rounds once
/// from f64) stays below 4e-7. Absolute only: it was a bound on the max abs difference.
pub const REF_ROPE_F32: Tol = Tol { atol: 1e-6, rtol: 0.0 };
/// Step of the f64 central finite differences (`common::central_differences`): truncation error ~1e-12
/// (zero for RoPE, whose loss is linear in x), rounding error ~1e-10 for the losses of these tests.
pub const FD_STEP: f64 = 1e-6;
/// f64 analytic gradients against central differences with [`FD_STEP`] (measured: at most 7e-9). The
/// bound was `1e-6 * max(1, |fd|)` (absolute below 1, relative above): with atol + rtol = 1e-6,
/// `atol + rtol |fd|` never exceeds it, and it still leaves a wide margin yet catches any wrong term in a
/// backward formula, a wrong sign or a swapped table (errors of order 1e-2 or more).
pub const FD: Tol = Tol { atol: 5e-7, rtol: 5e-7 };
/// The masked cross-entropy against values derived by hand (infinite logits): 1e-6 for f32 (or f64)
/// arithmetic on values below 1. Equal infinities pass; a NaN is checked for as such, not compared.
pub const HAND_F32: Tol = Tol { atol: 1e-6, rtol: 0.0 };
/// The same in bf16: plus `rtol = 2^-8`, each output being rounded once to 8 significant bits.
pub const HAND_BF16: Tol = Tol { atol: 1e-6, rtol: 1.0 / 256.0 };

/// What [`compare`] finds: the max abs error (the first NaN sticks), how many elements are out of
/// tolerance, and the flat index of the worst of them (by excess over the tolerance; NaN first).
pub struct Scan {
    pub max_abs: f64,
    pub bad: usize,
    pub worst: Option<usize>,
}

/// The element-wise check behind [`compare`], for a test that names the worst element its own way.
pub fn scan(got: &[f64], want: &[f64], tol: Tol) -> Scan {
    let (mut max_abs, mut bad, mut worst) = (0f64, 0usize, None::<(usize, f64)>);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        // Equal values (infinities included) are exact; NaN on either side is out of tolerance.
        if g == w {
            continue;
        }
        let e = (g - w).abs();
        if !max_abs.is_nan() && (e.is_nan() || e > max_abs) {
            max_abs = e;
        }
        let excess = e - (tol.atol + tol.rtol * w.abs());
        if excess > 0.0 || excess.is_nan() {
            bad += 1;
            if worst.is_none_or(|(_, x)| excess > x || excess.is_nan()) {
                worst = Some((i, excess));
            }
        }
    }
    Scan { max_abs, bad, worst: worst.map(|(i, _)| i) }
}

/// Compares element-wise; prints one summary line either way; `Err` names the worst element (its
/// multi-index in `dims`), how many are out, and the max errors.
pub fn compare(label: &str, dims: &[usize], got: &[f64], want: &[f64], tol: Tol) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{label}: {} values, expected {}", got.len(), want.len()));
    }
    let Scan { max_abs, bad, worst } = scan(got, want, tol);
    let line = format!(
        "{label} {dims:?}: max abs err {max_abs:.3e}; {bad}/{} outside {:e} + {:e} |want|",
        got.len(),
        tol.atol,
        tol.rtol
    );
    eprintln!("{} {line}", if bad > 0 { "FAIL" } else { "ok  " });
    match worst {
        None => Ok(()),
        Some(i) => Err(format!("{line}; worst at {:?}: got {}, want {}", unravel(i, dims), got[i], want[i])),
    }
}

/// [`compare`], its report as an `anyhow` error.
pub fn ensure_close(label: &str, dims: &[usize], got: &[f64], want: &[f64], tol: Tol) -> anyhow::Result<()> {
    compare(label, dims, got, want, tol).map_err(anyhow::Error::msg)
}

/// [`ensure_close`] on two tensors of the same shape (any dtype, any device), named by their dims.
pub fn compare_tensors(label: &str, got: &Tensor, want: &Tensor, tol: Tol) -> anyhow::Result<()> {
    ensure!(got.dims() == want.dims(), "{label}: shapes differ, got {:?}, want {:?}", got.dims(), want.dims());
    let values = |t: &Tensor| super::flat(&t.to_device(&Device::Cpu)?);
    ensure_close(label, got.dims(), &values(got)?, &values(want)?, tol)
}

/// The multi-index of flat index `i` in `dims` (row-major).
pub fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for (x, &n) in idx.iter_mut().zip(dims).rev() {
        *x = i % n.max(1);
        i /= n.max(1);
    }
    idx
}
