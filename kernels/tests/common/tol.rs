//! The kernel tests' one comparison: `|got - want| <= atol + rtol * |want|` per element (NaN in either
//! side fails), with the tolerances of each kind of result named once, with the reason for each. The
//! attention tolerances are `askgui-train check-gpu`'s own (`askgui_kernels::selfcheck`), where their
//! reasons are written.

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

/// Compares element-wise; prints one summary line either way; `Err` names the worst element (its
/// multi-index in `dims`), how many are out, and the max errors.
pub fn compare(label: &str, dims: &[usize], got: &[f64], want: &[f64], tol: Tol) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{label}: {} values, expected {}", got.len(), want.len()));
    }
    let (mut max_abs, mut bad, mut worst) = (0f64, 0usize, None::<(usize, f64)>);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        // Equal values (infinities included) are exact; NaN on either side is out of tolerance.
        let e = if g == w { 0.0 } else { (g - w).abs() };
        // The first NaN sticks as the maximum.
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
    let line = format!(
        "{label} {dims:?}: max abs err {max_abs:.3e}; {bad}/{} outside {:e} + {:e} |want|",
        got.len(),
        tol.atol,
        tol.rtol
    );
    eprintln!("{} {line}", if bad > 0 { "FAIL" } else { "ok  " });
    match worst {
        None => Ok(()),
        Some((i, _)) => Err(format!("{line}; worst at {:?}: got {}, want {}", unravel(i, dims), got[i], want[i])),
    }
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
