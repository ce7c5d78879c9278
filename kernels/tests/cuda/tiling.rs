//! GPU tests of the tiling kernels (`tiling::cuda`, `cuda/tiling.cu`) against the CPU path
//! (`tile_batch_reference`): random, gradient, text-like and 1-pixel checkerboard images of odd sizes
//! (1x1 up to 1080x2400 and 3000x200), one at a time and in mixed batches, f32 and bf16, host and
//! already-uploaded inputs, and the errors.
//!
//! Tolerance ([`LEVEL_F32`], [`LEVEL_BF16`]): the GPU uses the CPU's integer filter taps and the same f32
//! normalisation, so the design is bit-exact; the test still accepts a difference of one uint8 level of
//! the resized image (what a different float rounding order could cost), i.e. `1 / 255 / std[c]` in
//! normalised units (0.0146, 0.0150, 0.0142 for the CLIP std), and reports how many values were not
//! bit-identical. bf16 adds half an ulp of bf16 (`2^-8 |ref|`). `grid_thw` must be equal. Each channel is
//! compared through `common::tol::compare`; a failure names the worst element with its image, patch row,
//! channel and pixel position in the resized image.
//!
//! Run: `cargo test --release -p askgui-kernels --features cuda --test cuda -- tiling --nocapture`.

use anyhow::{ensure, Result};
use askgui_kernels::tiling::cuda::{tile_batch_cuda, tile_batch_cuda_uploaded, upload_images};
use askgui_kernels::tiling::{tile_batch_reference, BatchPlan, ImageRef, TilingConfig, TilingError};
use candle_core::{DType, Device, Tensor};

use crate::common::tol::{compare, scan, Tol};

/// f32: one uint8 level of the resized image, plus 1e-4 of it for the f32 rounding of the level itself;
/// the atol is in units of one level of the channel, see [`channel_tol`].
const LEVEL_F32: Tol = Tol { atol: 1.0 + 1e-4, rtol: 0.0 };
/// bf16: the same level, plus half an ulp of bf16 (`2^-8 |ref|`) for the output rounding.
const LEVEL_BF16: Tol = Tol { atol: 1.0 + 1e-4, rtol: 1.0 / 256.0 };

/// [`LEVEL_F32`] or [`LEVEL_BF16`] for the channel of standard deviation `std`: the atol scaled to one
/// level, `1 / 255 / std`, computed in f32 (as the level was before this check went through `compare`).
fn channel_tol(std: f32, bf16: bool) -> Tol {
    let t = if bf16 { LEVEL_BF16 } else { LEVEL_F32 };
    Tol { atol: f64::from(1.0 / 255.0 / std * t.atol as f32), rtol: t.rtol }
}

/// A test image: RGB8, row-major.
struct Img {
    name: String,
    width: usize,
    height: usize,
    rgb: Vec<u8>,
}

impl Img {
    fn as_ref(&self) -> ImageRef<'_> {
        ImageRef { rgb: &self.rgb, width: self.width, height: self.height }
    }
}

/// Seeded LCG; the high byte of each step.
fn random(w: usize, h: usize, seed: u64) -> Img {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let rgb = (0..w * h * 3)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect();
    Img { name: format!("random{w}x{h}"), width: w, height: h, rgb }
}

/// Smooth ramps, a different direction per channel.
fn gradient(w: usize, h: usize) -> Img {
    let mut rgb = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            rgb.push((x * 255 / (w - 1).max(1)) as u8);
            rgb.push((y * 255 / (h - 1).max(1)) as u8);
            rgb.push(((x + y) * 255 / (w + h)) as u8);
        }
    }
    Img { name: format!("gradient{w}x{h}"), width: w, height: h, rgb }
}

/// A screenshot-like page: white background, dark 1-3 px strokes in "glyph" cells, coloured buttons.
/// Sharp edges drive the bicubic overshoot into the clamps at 0 and 255.
fn text_like(w: usize, h: usize) -> Img {
    let mut rgb = vec![255u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let (cx, cy) = (x % 9, y % 16);
            let glyph = (3..13).contains(&cy) && cx < 7 && ((x / 9 * 7 + y / 16 * 13) % 5 != 0);
            let stroke = glyph && (cx == 0 || cx == 6 || cy == 3 || cy == 8 || (cx + cy) % 7 == 0);
            let button = (y / 40) % 6 == 5 && (x / 60) % 3 == 1;
            let px = &mut rgb[(y * w + x) * 3..][..3];
            if stroke {
                px.copy_from_slice(&[20, 20, 30]);
            } else if button {
                px.copy_from_slice(&[26, 115, 232]);
            }
        }
    }
    Img { name: format!("text{w}x{h}"), width: w, height: h, rgb }
}

/// 1-pixel checkerboard in black and white: the highest frequency there is.
fn checker(w: usize, h: usize) -> Img {
    let rgb = (0..w * h).flat_map(|i| [if (i % w + i / w).is_multiple_of(2) { 0u8 } else { 255 }; 3]).collect();
    Img { name: format!("checker{w}x{h}"), width: w, height: h, rgb }
}

fn qwen_cfg() -> TilingConfig {
    TilingConfig::with_pixels(256 * 28 * 28, 1280 * 28 * 28)
}

fn default_max_cfg() -> TilingConfig {
    TilingConfig::with_pixels(56 * 56, 12_845_056)
}

/// Compares GPU `pixel_values` with the CPU's, channel by channel, under [`channel_tol`].
fn compare_values(what: &str, imgs: &[&Img], cfg: &TilingConfig, got: &[f32], want: &[f32], bf16: bool) -> Result<()> {
    ensure!(got.len() == want.len(), "{what}: GPU gave {} values, CPU {}", got.len(), want.len());
    let geo = cfg.geometry;
    let (dim, cs) = (geo.patch_dim(), geo.temporal_patch_size * geo.patch_size * geo.patch_size);
    let dims = [got.len() / dim, geo.temporal_patch_size, geo.patch_size, geo.patch_size];
    let exact = got.iter().zip(want).filter(|(g, w)| g.to_bits() == w.to_bits()).count();
    eprintln!("tiling {what}: {} values, {exact} bit-identical", want.len());
    let mut failures = Vec::new();
    for (c, &std) in cfg.std.iter().enumerate() {
        // Channel c of every patch row: columns c * cs .. (c + 1) * cs.
        let channel = |v: &[f32]| -> Vec<f64> {
            v.chunks(dim).flat_map(|row| &row[c * cs..(c + 1) * cs]).map(|&x| f64::from(x)).collect()
        };
        let (g, w, tol) = (channel(got), channel(want), channel_tol(std, bf16));
        if let Err(e) = compare(&format!("tiling {what} channel {c}"), &dims, &g, &w, tol) {
            let j = scan(&g, &w, tol).worst.unwrap_or(0);
            failures.push(format!("{e}; {}", locate(imgs, cfg, j / cs * dim + c * cs + j % cs)?));
        }
    }
    ensure!(failures.is_empty(), "{what}: values out of tolerance against the CPU path:\n{}", failures.join("\n"));
    Ok(())
}

/// Where value `k` of `pixel_values` comes from: its image, patch row, channel, frame and pixel position
/// in the resized image.
fn locate(imgs: &[&Img], cfg: &TilingConfig, k: usize) -> Result<String> {
    let geo = cfg.geometry;
    let (p, tp, m, dim) = (geo.patch_size, geo.temporal_patch_size, geo.merge_size, geo.patch_dim());
    let plan = BatchPlan::new(&imgs.iter().map(|i| (i.width, i.height)).collect::<Vec<_>>(), None, cfg)?;
    // First row of each image.
    let mut starts = vec![0usize];
    for g in &plan.grid_thw {
        starts.push(starts.last().unwrap() + g[1] * g[2]);
    }
    let (row, col) = (k / dim, k % dim);
    let img = starts.partition_point(|&s| s <= row) - 1;
    let [_, _gh, gw] = plan.grid_thw[img];
    let r = row - starts[img];
    let (c, t, py, px) = (col / (tp * p * p), col / (p * p) % tp, col / p % p, col % p);
    let (mw, mh, blk) = (r % m, r / m % m, r / (m * m));
    let (bh, bw) = (blk / (gw / m), blk % (gw / m));
    let (y, x) = ((bh * m + mh) * p + py, (bw * m + mw) * p + px);
    let name = &imgs[img].name;
    Ok(format!("image {img} ({name}) patch row {r} channel {c} t {t} resized pixel (x {x}, y {y})"))
}

/// Tiles `imgs` on both paths and compares values and grids; returns the grids.
fn check_batch(dev: &Device, what: &str, imgs: &[&Img], cfg: &TilingConfig, dtype: DType) -> Result<Vec<[usize; 3]>> {
    let refs: Vec<ImageRef> = imgs.iter().map(|i| i.as_ref()).collect();
    let (want, want_grid) = tile_batch_reference(&refs, cfg)?;
    let (pv, grid) = tile_batch_cuda(dev, &refs, cfg, dtype)?;
    ensure!(grid == want_grid, "{what}: grid_thw GPU {grid:?} != CPU {want_grid:?}");
    let rows: usize = grid.iter().map(|g| g.iter().product::<usize>()).sum();
    ensure!(
        pv.dims() == [rows, cfg.geometry.patch_dim()] && pv.dtype() == dtype,
        "{what}: pixel_values is {:?} {:?}, expected ({rows}, {}) {dtype:?}",
        pv.dims(),
        pv.dtype(),
        cfg.geometry.patch_dim()
    );
    let got = pv.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let want = if dtype == DType::BF16 {
        // The CPU values rounded to bf16 the way the kernel rounds (nearest even).
        Tensor::from_slice(&want, want.len(), &Device::Cpu)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
    } else {
        want
    };
    compare_values(what, imgs, cfg, &got, &want, dtype == DType::BF16)?;
    Ok(grid)
}

#[test]
fn tiling_single_images_match_cpu() -> Result<()> {
    let Some(dev) = crate::cuda_device("tiling_single_images_match_cpu") else { return Ok(()) };
    let cfg = qwen_cfg();
    let sizes = [(1, 1), (2, 3), (29, 31), (28, 28), (1024, 768), (1080, 2400), (3000, 200), (200, 3000)];
    for (n, &(w, h)) in sizes.iter().enumerate() {
        for img in [random(w, h, n as u64), gradient(w, h), text_like(w, h), checker(w, h)] {
            let grid = check_batch(&dev, &img.name, &[&img], &cfg, DType::F32)?;
            if (w, h) == (1024, 768) {
                // FACTS.md: transformers gives pixel_values (3996, 1176) and grid [1, 54, 74].
                ensure!(grid == vec![[1, 54, 74]], "1024x768: grid {grid:?}, transformers gives [1, 54, 74]");
            }
        }
    }
    Ok(())
}

#[test]
fn tiling_mixed_batches_match_cpu() -> Result<()> {
    let Some(dev) = crate::cuda_device("tiling_mixed_batches_match_cpu") else { return Ok(()) };
    let imgs = [
        random(1080, 2400, 1),
        text_like(1024, 768),
        gradient(29, 31),
        random(1, 1, 2),
        checker(3000, 200),
        text_like(1920, 1080),
        random(57, 1000, 3),
    ];
    let all: Vec<&Img> = imgs.iter().collect();
    for (name, cfg) in [("max 1280*28*28", qwen_cfg()), ("default max 12845056", default_max_cfg())] {
        check_batch(&dev, &format!("batch of {} ({name})", all.len()), &all, &cfg, DType::F32)?;
        // Reversed order: offsets of every image change.
        let rev: Vec<&Img> = all.iter().rev().copied().collect();
        check_batch(&dev, &format!("reversed batch ({name})"), &rev, &cfg, DType::F32)?;
    }
    Ok(())
}

#[test]
fn tiling_bf16_matches_cpu() -> Result<()> {
    let Some(dev) = crate::cuda_device("tiling_bf16_matches_cpu") else { return Ok(()) };
    let imgs = [text_like(1080, 2400), random(29, 31, 5), gradient(1024, 768)];
    let all: Vec<&Img> = imgs.iter().collect();
    check_batch(&dev, "bf16 batch", &all, &qwen_cfg(), DType::BF16)?;
    Ok(())
}

#[test]
fn tiling_uploaded_input_equals_host_input() -> Result<()> {
    let Some(dev) = crate::cuda_device("tiling_uploaded_input_equals_host_input") else { return Ok(()) };
    let imgs = [random(1080, 2400, 7), text_like(3000, 200), gradient(29, 31)];
    let refs: Vec<ImageRef> = imgs.iter().map(|i| i.as_ref()).collect();
    let sizes: Vec<(usize, usize)> = imgs.iter().map(|i| (i.width, i.height)).collect();
    let cfg = qwen_cfg();
    let (host, host_grid) = tile_batch_cuda(&dev, &refs, &cfg, DType::F32)?;
    let input = upload_images(&dev, &refs)?;
    let (dev_pv, dev_grid) = tile_batch_cuda_uploaded(&input, &sizes, &cfg, DType::F32)?;
    ensure!(host_grid == dev_grid, "grid_thw host {host_grid:?} != uploaded {dev_grid:?}");
    let (a, b) = (host.flatten_all()?.to_vec1::<f32>()?, dev_pv.flatten_all()?.to_vec1::<f32>()?);
    let differ = a.iter().zip(&b).filter(|(x, y)| x.to_bits() != y.to_bits()).count();
    ensure!(
        a.len() == b.len() && differ == 0,
        "uploaded path: {differ} of {} values differ from the host path",
        a.len()
    );
    // A view into a larger buffer (non-zero start offset) must work too.
    let padded = Tensor::cat(&[&Tensor::zeros(5, DType::U8, &dev)?, &input], 0)?;
    let (off_pv, _) = tile_batch_cuda_uploaded(&padded.narrow(0, 5, input.elem_count())?, &sizes, &cfg, DType::F32)?;
    let c = off_pv.flatten_all()?.to_vec1::<f32>()?;
    ensure!(c == a, "uploaded path with a start offset differs from the host path");
    let e = tile_batch_cuda_uploaded(&input.narrow(0, 0, 10)?, &sizes, &cfg, DType::F32).unwrap_err();
    ensure!(matches!(e, TilingError::BatchBuffer { .. }), "short uploaded buffer: {e}");
    Ok(())
}

/// Validation happens on the host before any launch, so these run with or without a GPU.
#[test]
fn tiling_errors_match_cpu() -> Result<()> {
    let dev = crate::cuda_device("tiling_errors_match_cpu (device part)");
    let cfg = qwen_cfg();
    let ok = random(30, 30, 9);
    // (what, [(width, height, buffer bytes)]).
    type Case = (&'static str, Vec<(usize, usize, usize)>);
    let cases: Vec<Case> = vec![
        ("empty batch", vec![]),
        ("zero-size image", vec![(30, 30, 2700), (0, 7, 0)]),
        ("aspect ratio over 200", vec![(30, 30, 2700), (1, 300, 900)]),
        ("short buffer", vec![(30, 30, 2700), (30, 30, 2699)]),
    ];
    for (what, spec) in cases {
        let bufs: Vec<Vec<u8>> =
            spec.iter().map(|&(_, _, n)| ok.rgb.iter().cycle().take(n).copied().collect()).collect();
        let refs: Vec<ImageRef> =
            spec.iter().zip(&bufs).map(|(&(width, height, _), rgb)| ImageRef { rgb, width, height }).collect();
        let want = tile_batch_reference(&refs, &cfg).unwrap_err();
        // Device::Cpu: validation must fail first, with the CPU path's error.
        for d in [Some(Device::Cpu), dev.clone()].into_iter().flatten() {
            let got = tile_batch_cuda(&d, &refs, &cfg, DType::F32).unwrap_err();
            ensure!(got == want, "{what} on {:?}: GPU path says `{got}`, CPU path `{want}`", d.location());
        }
        eprintln!("tiling error {what}: {want}");
    }
    // Valid input on a CPU device, or an unsupported dtype: clear errors, no panic.
    let e = tile_batch_cuda(&Device::Cpu, &[ok.as_ref()], &cfg, DType::F32).unwrap_err();
    ensure!(matches!(e, TilingError::Device(_)), "CPU device: {e}");
    if let Some(d) = dev {
        let e = tile_batch_cuda(&d, &[ok.as_ref()], &cfg, DType::F16).unwrap_err();
        ensure!(matches!(e, TilingError::Device(_)), "f16: {e}");
    }
    Ok(())
}
