//! CPU attention timings on the serve benchmark's shapes (the tiny checkpoint: head dim 16), one JSON line
//! per shape, with the keys of `scripts/bench/bench_attention_cpu.py` (PyTorch's
//! `scaled_dot_product_attention` on the same shapes), so that the two read as ratios.
//!
//! `cargo run --release -p askgui-kernels --example bench_attention_cpu [REPEATS]` (default 20). Times are
//! medians of wall clocks after one warm-up call, on the rayon pool's threads (`RAYON_NUM_THREADS`).

use std::time::Instant;

use anyhow::Result;
use askgui_kernels::ops::attention;
use askgui_kernels::AttentionMask;
use candle_core::{Device, Tensor};

/// A vision screenshot of 640x480 pixels: 34 x 46 patches.
const PATCHES: usize = 1564;

fn median_ms(repeats: usize, f: &dyn Fn() -> Result<()>) -> Result<f64> {
    f()?;
    let mut ts = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t = Instant::now();
        f()?;
        ts.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[ts.len() / 2])
}

fn main() -> Result<()> {
    let repeats = match std::env::args().nth(1) {
        Some(s) => s.parse().map_err(|e| anyhow::anyhow!("REPEATS must be a count, got {s:?}: {e}"))?,
        None => 20,
    };
    let dev = Device::Cpu;
    let qkv = |hq: usize, hkv: usize, tq: usize, tk: usize| -> Result<[Tensor; 3]> {
        Ok([
            Tensor::randn(0f32, 1.0, (1, hq, tq, 16), &dev)?,
            Tensor::randn(0f32, 1.0, (1, hkv, tk, 16), &dev)?,
            Tensor::randn(0f32, 1.0, (1, hkv, tk, 16), &dev)?,
        ])
    };
    let report = |name: &str, ms: f64| println!("{{\"shape\":\"{name}\",\"median_ms\":{ms:.3}}}");
    for images in [1, 16] {
        let [q, k, v] = qkv(2, 2, images * PATCHES, images * PATCHES)?;
        let cu: Vec<usize> = (0..=images).map(|i| i * PATCHES).collect();
        let run = || -> Result<()> {
            attention(&q, &k, &v, AttentionMask::BlockDiagonal(&cu), None, 0.25)?;
            Ok(())
        };
        report(&format!("vision_full_{images}x{PATCHES}"), median_ms(repeats, &run)?);
    }
    let [q, k, v] = qkv(4, 2, 1384, 1384)?;
    let run = || -> Result<()> {
        attention(&q, &k, &v, AttentionMask::Causal, None, 0.25)?;
        Ok(())
    };
    report("text_causal_1384", median_ms(repeats, &run)?);
    let q = Tensor::randn(0f32, 1.0, (1, 4, 512, 16), &dev)?;
    let run = || -> Result<()> {
        attention(&q, &k, &v, AttentionMask::Causal, None, 0.25)?;
        Ok(())
    };
    report("text_chunk_512_of_1384", median_ms(repeats, &run)?);
    Ok(())
}
