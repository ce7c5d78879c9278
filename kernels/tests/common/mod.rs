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

/// Whether `count` events among `n` independent trials of probability `p` are within the binomial bound
/// `|count - n p| <= 5 sqrt(n p (1 - p)) + 1`: the count has mean `n p` and standard deviation
/// `sqrt(n p (1 - p))`, and with `n p` in the hundreds or more it is close to normal, so a fair draw lands
/// past 5 standard deviations with probability 5.7e-7 (the `+ 1` covers a dropout threshold's rounding
/// of `p`, at most 2^-33 per trial). Used for dropout keep rates.
pub fn binomial_within(count: usize, n: usize, p: f64, what: &str) -> Result<(), String> {
    let (mean, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
    let bound = 5.0 * sd + 1.0;
    match (count as f64 - mean).abs() <= bound {
        true => Ok(()),
        false => Err(format!("{what}: {count} of {n} at p {p}; expected {mean:.1} +- {bound:.1} (5 sd {sd:.1})")),
    }
}
