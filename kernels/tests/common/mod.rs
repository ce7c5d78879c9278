//! What the gradient tests share: seeded inputs with no RNG crate (the same numbers on every machine),
//! flattening for comparisons (all through [`tol`]) and central finite differences.
#![allow(dead_code)]

pub mod bf16;
pub mod tol;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};

/// Deterministic uniform values in [-1, 1) (a 64-bit LCG).
pub fn uniform(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

/// A tensor of `uniform` values in [-1, 1), made in f64 and converted to `dtype`.
pub fn tensor(dims: &[usize], seed: u64, dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_vec(uniform(dims.iter().product(), seed), dims, &Device::Cpu)?.to_dtype(dtype)?)
}

pub fn flat(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Central finite differences of `loss` at `base`, one element at a time, with step [`tol::FD_STEP`]:
/// the reference of the f64 gradient checks (compared under [`tol::FD`]).
pub fn central_differences(base: &[f64], loss: impl Fn(&[f64]) -> Result<f64>) -> Result<Vec<f64>> {
    let h = tol::FD_STEP;
    let probe = |j: usize, delta: f64| -> Result<f64> {
        let mut v = base.to_vec();
        v[j] += delta;
        loss(&v)
    };
    (0..base.len()).map(|j| Ok((probe(j, h)? - probe(j, -h)?) / (2.0 * h))).collect()
}
