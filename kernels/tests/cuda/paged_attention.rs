//! GPU test of the paged attention (`cuda/paged_attention.cu`, through `ops::paged_attention` on CUDA
//! tensors) against the same op on the CPU, from the same numbers: f32 and bf16 storage, decode rows and a
//! few rows, GQA, cut blocks (narrowed views, as a truncated prefix leaves them; read in place on the GPU)
//! and the 3B decoder's shape over 41 blocks and over a 1,000-position view and a short block. The CUDA op computes in f32 and the CPU op in f64; the tolerances are those of
//! the attention forward (`tests/common/tol.rs`).
//!
//! Run on a GPU machine: `cargo test -p askgui-kernels --features cuda --test cuda paged -- --nocapture`.

use anyhow::{ensure, Result};
use askgui_kernels::ops::paged_attention;
use candle_core::{DType, Device, Tensor};

use crate::common::tensor;
use crate::common::tol::{compare_tensors, BF16_ATTN, F32_ATTN};

/// `(Hq, Hkv, T, D, blocks as (positions, positions of the block it is narrowed from))`.
type Case = (usize, usize, usize, usize, Vec<(usize, usize)>);

fn cases() -> Vec<Case> {
    let mut long = vec![(32, 32); 40];
    long.push((3, 3));
    vec![
        (4, 2, 1, 64, vec![(32, 32), (32, 32), (7, 7)]),
        (4, 2, 3, 80, vec![(32, 32), (9, 32)]),
        (8, 8, 2, 17, vec![(5, 5)]),
        (16, 2, 1, 128, long),
        (16, 2, 2, 128, vec![(1_000, 1_302), (9, 9)]),
    ]
}

#[test]
fn paged_attention_on_the_gpu_matches_the_cpu() -> Result<()> {
    let Some(gpu) = crate::cuda_device("paged_attention_on_the_gpu_matches_the_cpu") else { return Ok(()) };
    let mut failures = Vec::new();
    for (n, (hq, hkv, t, d, lens)) in cases().into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let seed = 100 * n as u64;
            let q = (tensor(&[1, hq, t, d], seed, dtype)? * 3.0)?;
            let mut blocks = Vec::new();
            for (b, &(len, parent)) in lens.iter().enumerate() {
                let kv = |s: u64| -> Result<Tensor> {
                    Ok(tensor(&[1, hkv, parent, d], seed + 2 * b as u64 + s, dtype)?.narrow(2, 0, len)?)
                };
                blocks.push((kv(1)?, kv(2)?));
            }
            let scale = 1.0 / (d as f64).sqrt();
            let want = paged_attention(&q, &blocks, scale)?;
            let on_gpu: Vec<(Tensor, Tensor)> =
                blocks.iter().map(|(k, v)| Ok((k.to_device(&gpu)?, v.to_device(&gpu)?))).collect::<Result<_>>()?;
            let got = paged_attention(&q.to_device(&gpu)?, &on_gpu, scale)?.to_device(&Device::Cpu)?;
            let tol = if dtype == DType::F32 { F32_ATTN } else { BF16_ATTN };
            let label = format!("Hq {hq} Hkv {hkv} T {t} D {d} blocks {lens:?} {dtype:?}");
            if let Err(e) = compare_tensors(&label, &got, &want, tol) {
                failures.push(e.to_string());
            }
        }
    }
    ensure!(failures.is_empty(), "{} comparison(s) out of tolerance:\n{}", failures.len(), failures.join("\n"));
    Ok(())
}
