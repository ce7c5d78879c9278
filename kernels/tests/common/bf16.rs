//! bf16 against f32: each CPU op on bf16 storage widens its inputs to f32, runs the f32 kernel and rounds
//! each output once, so its result is the f32 op's on the same (bf16-rounded) inputs, rounded to bf16.

use anyhow::{ensure, Result};
use candle_core::{DType, Tensor};

use super::tol::{compare_tensors, Tol};

/// bf16 rounding to nearest even moves a value `y` by at most half an ulp, `2^-8 |y|` (8 significant
/// bits). Both sides run the same f32 kernel on the same values, so that is the whole difference: rtol is
/// `2^-8` exactly, and the atol (1e-30) only matters for subnormal results, where bf16 loses relative
/// precision (below 1.2e-38; none occur in these tests).
pub const ROUNDING: Tol = Tol { atol: 1e-30, rtol: 1.0 / 256.0 };

/// `t` rounded to bf16, and the same values in f32: the inputs of the bf16 op and of its f32 twin.
pub fn pair(t: &Tensor) -> Result<(Tensor, Tensor)> {
    let b = t.to_dtype(DType::BF16)?;
    let f = b.to_dtype(DType::F32)?;
    Ok((b, f))
}

/// Checks that `got` is bf16 and within [`ROUNDING`] of `want` (the f32 op on the rounded inputs).
pub fn check(label: &str, got: &Tensor, want: &Tensor) -> Result<()> {
    ensure!(got.dtype() == DType::BF16, "{label}: got {:?}, want bf16", got.dtype());
    compare_tensors(&format!("{label} bf16 vs f32"), got, want, ROUNDING)
}
