//! Decode-step benchmark of the paged attention (`ops::paged_attention`, kernel in
//! `cuda/paged_attention.cu`) against what a cache of one tensor per layer costs per step: appending the
//! new position by concatenation (`Tensor::cat` of keys and of values) and the tiled attention over it
//! (`ops::attention`, one query row). Both are ours; the JSON lines set them side by side.
//!
//! Shape: the Qwen2.5-VL-3B decoder (16 query heads, 2 key heads, head dim 128), one new row, a cache of
//! `cached` positions (in blocks of 32 for the paged side), bf16 and f32. `paged_ms` includes appending
//! the new position to the last block (a copy of at most 32 positions), as the model's cache does.
//! Medians of CUDA-synchronised wall clocks (`crate::median_ms`).
//!
//! Run on a GPU machine: `bench_cuda paged`.

use anyhow::Result;
use askgui_kernels::ops::{attention, paged_attention};
use askgui_kernels::AttentionMask;
use candle_core::{DType, Device, Tensor};

const BLOCK: usize = 32;
const HQ: usize = 16;
const HKV: usize = 2;
const D: usize = 128;

pub fn run(dev: &Device) -> Result<()> {
    for cached in [1_300, 4_096, 16_384] {
        for (dtype, label) in [(DType::BF16, "bf16"), (DType::F32, "f32")] {
            bench(dev, cached, dtype, label)?;
        }
    }
    Ok(())
}

fn bench(dev: &Device, cached: usize, dtype: DType, label: &str) -> Result<()> {
    let randn =
        |h: usize, t: usize| -> Result<Tensor> { Ok(Tensor::randn(0f32, 1.0, (1, h, t, D), dev)?.to_dtype(dtype)?) };
    let (q, k_new, v_new) = (randn(HQ, 1)?, randn(HKV, 1)?, randn(HKV, 1)?);
    let (k_all, v_all) = (randn(HKV, cached)?, randn(HKV, cached)?);
    let scale = 1.0 / (D as f64).sqrt();
    // The cache in blocks; the last one is partly filled, so a step appends into it.
    let mut blocks = Vec::new();
    for at in (0..cached).step_by(BLOCK) {
        let n = BLOCK.min(cached - at);
        blocks.push((k_all.narrow(2, at, n)?.contiguous()?, v_all.narrow(2, at, n)?.contiguous()?));
    }
    let paged_ms = crate::median_ms(dev, 3, 20, || {
        let mut step = blocks.clone();
        let (k, v) = step.pop().expect("a block");
        step.push((Tensor::cat(&[&k, &k_new], 2)?, Tensor::cat(&[&v, &v_new], 2)?));
        paged_attention(&q, &step, scale)?;
        Ok(())
    })?;
    let whole_ms = crate::median_ms(dev, 3, 20, || {
        let (k, v) = (Tensor::cat(&[&k_all, &k_new], 2)?, Tensor::cat(&[&v_all, &v_new], 2)?);
        attention(&q, &k, &v, AttentionMask::Causal, None, scale)?;
        Ok(())
    })?;
    let line = serde_json::json!({
        "bench": "paged_decode",
        "impl": "askgui",
        "dtype": label,
        "hq": HQ,
        "hkv": HKV,
        "d": D,
        "cached": cached,
        "paged_ms": paged_ms,
        "cat_attention_ms": whole_ms,
        "ratio": paged_ms / whole_ms,
    });
    println!("{line}");
    Ok(())
}
