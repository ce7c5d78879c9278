//! Tiling benchmark: a batch of 8 random RGB8 screenshots (1080x2400, 1920x1080, 1024x768) through the
//! Qwen2-VL preprocessing, with `max_pixels` 1280*28*28 and transformers' default 12845056, f32 output.
//!
//! Implementations, one JSON line each (keys shared with the PyTorch side in `scripts/gpu/`):
//! - `askgui-cuda`, `input: host`: `tile_batch_cuda` from host memory, upload of the u8 images included;
//! - `askgui-cuda`, `input: device`: `tile_batch_cuda_uploaded` on u8 images already on the GPU;
//! - `askgui-cpu`, `input: host`: the CPU path (`tile_batch_reference`, one thread, as the model's
//!   `preprocess` runs it) plus the upload of its `pixel_values` to the GPU, which is what a CUDA model
//!   needs either way.
//!
//! The pixel_values stay on the device (not copied back). Before timing, the GPU result is checked
//! against the CPU's (grid equal, values within one uint8 level), so a wrong kernel cannot post a time.
//!
//! Run: `cargo run --release -p askgui-kernels --features cuda --example bench_cuda -- tiling`.

use anyhow::{ensure, Result};
use askgui_kernels::tiling::cuda::{tile_batch_cuda, tile_batch_cuda_uploaded, upload_images};
use askgui_kernels::tiling::{tile_batch_reference, ImageRef, TilingConfig};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

const BATCH: usize = 8;

fn random_rgb(w: usize, h: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..w * h * 3)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect()
}

pub fn run(dev: &Device) -> Result<()> {
    for (w, h) in [(1080, 2400), (1920, 1080), (1024, 768)] {
        let imgs: Vec<Vec<u8>> = (0..BATCH).map(|i| random_rgb(w, h, i as u64 + 1)).collect();
        let refs: Vec<ImageRef> = imgs.iter().map(|rgb| ImageRef { rgb, width: w, height: h }).collect();
        let sizes = vec![(w, h); BATCH];
        for max_pixels in [1280 * 28 * 28, 12_845_056] {
            let cfg = TilingConfig::with_pixels(56 * 56, max_pixels);
            // Correctness gate.
            let (want, want_grid) = tile_batch_reference(&refs, &cfg)?;
            let (pv, grid) = tile_batch_cuda(dev, &refs, &cfg, DType::F32)?;
            ensure!(grid == want_grid, "{w}x{h}: grid_thw GPU {grid:?} != CPU {want_grid:?}");
            let got = pv.flatten_all()?.to_vec1::<f32>()?;
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            ensure!(worst <= 0.016, "{w}x{h}: GPU pixel_values differ from the CPU's by {worst} (> one uint8 level)");
            let patches: usize = grid.iter().map(|g| g.iter().product::<usize>()).sum();

            let input = upload_images(dev, &refs)?;
            let cases: [(&str, &str, usize, usize); 3] =
                [("askgui-cuda", "host", 3, 20), ("askgui-cuda", "device", 3, 20), ("askgui-cpu", "host", 1, 3)];
            for (imp, from, warmup, iters) in cases {
                let ms = match (imp, from) {
                    ("askgui-cuda", "host") => crate::median_ms(dev, warmup, iters, || {
                        tile_batch_cuda(dev, &refs, &cfg, DType::F32)?;
                        Ok(())
                    })?,
                    ("askgui-cuda", _) => crate::median_ms(dev, warmup, iters, || {
                        tile_batch_cuda_uploaded(&input, &sizes, &cfg, DType::F32)?;
                        Ok(())
                    })?,
                    _ => crate::median_ms(dev, warmup, iters, || {
                        let (pv, _) = tile_batch_reference(&refs, &cfg)?;
                        let n = pv.len();
                        Tensor::from_vec(pv, (n / cfg.geometry.patch_dim(), cfg.geometry.patch_dim()), dev)?;
                        Ok(())
                    })?,
                };
                println!(
                    "{}",
                    json!({
                        "bench": "tiling", "impl": imp, "input": from, "dtype": "f32",
                        "width": w, "height": h, "batch": BATCH, "max_pixels": max_pixels,
                        "ms_per_batch": ms, "images_per_s": BATCH as f64 * 1e3 / ms, "patches": patches,
                    })
                );
            }
        }
    }
    Ok(())
}
