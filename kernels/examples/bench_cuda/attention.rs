//! Attention benchmark: our CUDA op (`ops::attention`, kernels in `cuda/attention.cu`) at the Qwen2.5-VL-3B
//! shapes, one JSON line per config and dtype, named like the PyTorch side
//! (`scripts/gpu/bench_torch_attention.py`, sdpa flash) so the two can be set side by side.
//!
//! Configs (name: B, Hq, Hkv, T, D, mask): decoder-3b 1, 16, 2, 4096, 128, causal; decoder-3b-1k
//! 1, 16, 2, 1024, 128, causal; decoder-3b-8k 1, 16, 2, 8192, 128, causal (multi-screenshot samples); vision-window 1, 16, 16, 4096, 80, block-diagonal windows of 64 (PyTorch
//! runs these as B=64 batches of T=64: the same work); vision-full 1, 16, 16, 4096, 80, none. Each in
//! bf16 and f32. `fwd_ms`: the forward of (q, k, v) that track no gradient; `fwd_bwd_ms`: the forward on
//! `Var`s plus candle's backward of `sum(O * W)` (dO = W random; the mul and sum add ~0.05 ms), which
//! runs our backward op (including candle's concatenation of [q, O, dO]). Inputs standard normal.
//! Medians of CUDA-synchronised wall clocks (`crate::median_ms`).
//!
//! Run on a GPU machine: `bench_cuda attention` (built with
//! `cargo build --release -p askgui-kernels --features cuda --example bench_cuda`).

use anyhow::Result;
use askgui_kernels::ops::attention;
use askgui_kernels::AttentionMask;
use candle_core::{DType, Device, Tensor, Var};

struct Config {
    name: &'static str,
    b: usize,
    hq: usize,
    hkv: usize,
    t: usize,
    d: usize,
    causal: bool,
    /// Block-diagonal windows of this many tokens.
    window: Option<usize>,
}

const CONFIGS: [Config; 5] = [
    Config { name: "decoder-3b", b: 1, hq: 16, hkv: 2, t: 4096, d: 128, causal: true, window: None },
    Config { name: "decoder-3b-1k", b: 1, hq: 16, hkv: 2, t: 1024, d: 128, causal: true, window: None },
    Config { name: "decoder-3b-8k", b: 1, hq: 16, hkv: 2, t: 8192, d: 128, causal: true, window: None },
    Config { name: "vision-window", b: 1, hq: 16, hkv: 16, t: 4096, d: 80, causal: false, window: Some(64) },
    Config { name: "vision-full", b: 1, hq: 16, hkv: 16, t: 4096, d: 80, causal: false, window: None },
];

pub fn run(dev: &Device) -> Result<()> {
    for c in &CONFIGS {
        for (dtype, label) in [(DType::BF16, "bf16"), (DType::F32, "f32")] {
            bench(dev, c, dtype, label)?;
        }
    }
    Ok(())
}

fn bench(dev: &Device, c: &Config, dtype: DType, label: &str) -> Result<()> {
    let randn =
        |h: usize| -> Result<Tensor> { Ok(Tensor::randn(0f32, 1.0, (c.b, h, c.t, c.d), dev)?.to_dtype(dtype)?) };
    // (B, Hq, T, D), (B, Hkv, T, D) x 2, dO (B, Hq, T, D)
    let (q, k, v, w) = (randn(c.hq)?, randn(c.hkv)?, randn(c.hkv)?, randn(c.hq)?);
    let cu: Vec<usize> = match c.window {
        Some(w) => (0..c.t).step_by(w).chain([c.t]).collect(),
        None => Vec::new(),
    };
    let mask = match (c.window, c.causal) {
        (Some(_), _) => AttentionMask::BlockDiagonal(&cu),
        (None, true) => AttentionMask::Causal,
        (None, false) => AttentionMask::None,
    };
    let scale = 1.0 / (c.d as f64).sqrt();
    let fwd_ms = crate::median_ms(dev, 3, 10, || {
        attention(&q, &k, &v, mask, None, scale)?;
        Ok(())
    })?;
    let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
    let fwd_bwd_ms = crate::median_ms(dev, 2, 10, || {
        let o = attention(qv.as_tensor(), kv.as_tensor(), vv.as_tensor(), mask, None, scale)?;
        (o * &w)?.sum_all()?.backward()?;
        Ok(())
    })?;
    // FLOPs as the PyTorch side counts them: forward 4 B Hq T^2 D (halved when causal), fwd+bwd 3.5x.
    let mut flops = 4.0 * (c.b * c.hq) as f64 * (c.t * c.t) as f64 * c.d as f64;
    if c.causal {
        flops /= 2.0;
    }
    if let Some(w) = c.window {
        flops *= w as f64 / c.t as f64;
    }
    let line = serde_json::json!({
        "bench": "attention",
        "name": c.name,
        "impl": "askgui",
        "dtype": label,
        "b": c.b,
        "hq": c.hq,
        "hkv": c.hkv,
        "t": c.t,
        "d": c.d,
        "causal": c.causal,
        "windows": c.window,
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": fwd_bwd_ms,
        "fwd_tflops": flops / fwd_ms * 1e-9,
        "fwd_bwd_tflops": 3.5 * flops / fwd_bwd_ms * 1e-9,
    });
    println!("{line}");
    Ok(())
}
