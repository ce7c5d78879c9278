//! Qwen2-VL image tiling, the CPU reference: smart_resize, bicubic antialiased resize, rescale +
//! normalise, and patchify into the `pixel_values` layout of transformers' `Qwen2VLImageProcessor`.
//!
//! The resize reproduces what that processor does in transformers 5 (torchvision's antialiased bicubic on
//! uint8 images), bit for bit: a horizontal pass then a vertical pass, each a separable filter (Keys cubic,
//! a = -0.5, support stretched by the downscale factor as in Pillow) with weights rounded to int16 fixed
//! point and the result rounded and clamped to uint8 after each pass. Normalisation is fused the same way:
//! `(x - 255 * mean) / (255 * std)` in f32.
//!
//! `smart_resize` lives here, not in the model crate, because the coordinate frames of the agent protocol
//! must use the very same computation (one function, not two copies).
//!
//! [`cpu`] has the fast CPU twins of the resize and the patchify (bit for bit these, tested there), which
//! serve, eval and training run. [`tile_batch_reference`] runs the whole path over a batch, in the layout
//! of the CUDA twin (`cuda::tile_batch_cuda`, feature `cuda`), which gets its filter tables from [`plan`]:
//! both paths share `smart_resize`, the tap tables and the validation, so they agree bit for bit and fail
//! with the same errors.

use thiserror::Error;

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod plan;

pub use cpu::{normalize_patchify, resize_bicubic};
pub use plan::{tile_batch_reference, BatchPlan, ImageRef, TilingConfig};

/// CLIP normalisation used by every Qwen2-VL / Qwen2.5-VL checkpoint.
pub const CLIP_MEAN: [f32; 3] = [0.481_454_66, 0.457_827_5, 0.408_210_73];
pub const CLIP_STD: [f32; 3] = [0.268_629_54, 0.261_302_6, 0.275_777_1];

/// Errors of the tiling path; each says what to change.
#[derive(Debug, Error, PartialEq)]
pub enum TilingError {
    #[error("image is {width}x{height} pixels: both sides must be at least 1")]
    Empty { width: usize, height: usize },
    #[error("image is {width}x{height}: aspect ratio {ratio:.1} exceeds the 200 that Qwen2-VL preprocessing accepts; crop or pad it")]
    AspectRatio { width: usize, height: usize, ratio: f64 },
    #[error("min_pixels {min} is larger than max_pixels {max}")]
    PixelBounds { min: usize, max: usize },
    #[error("buffer holds {got} bytes, expected {want} for a {width}x{height} RGB image")]
    Buffer { got: usize, want: usize, width: usize, height: usize },
    #[error("the batch holds no images: pass at least one")]
    EmptyBatch,
    #[error("image {index} of the batch: {source}")]
    InBatch { index: usize, source: Box<TilingError> },
    #[error("patch geometry {0:?} is invalid: patch, merge and temporal sizes must all be at least 1")]
    Geometry(PatchGeometry),
    #[error("image is {width}x{height}, resized to {new_width}x{new_height}: too large for one launch (at most 2^31 values per image); lower max_pixels")]
    TooLarge { width: usize, height: usize, new_width: usize, new_height: usize },
    #[error(
        "the uploaded batch holds {got} bytes, expected {want} for its {images} RGB images (concatenated, row-major)"
    )]
    BatchBuffer { got: usize, want: usize, images: usize },
    #[error("tiling on the device: {0}")]
    Device(String),
}

/// Target `(height, width)`: multiples of `factor`, area within `[min_pixels, max_pixels]`, aspect kept.
/// Same arithmetic as transformers' `smart_resize` (Python `round` is round-half-to-even).
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), TilingError> {
    if height == 0 || width == 0 {
        return Err(TilingError::Empty { width, height });
    }
    if min_pixels > max_pixels {
        return Err(TilingError::PixelBounds { min: min_pixels, max: max_pixels });
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(TilingError::AspectRatio { width, height, ratio });
    }
    let mut h_bar = (h / f).round_ties_even() * f;
    let mut w_bar = (w / f).round_ties_even() * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = ((height * width) as f64 / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (height * width) as f64).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Keys' cubic convolution kernel with a = -0.5 (Pillow's and torchvision's antialiased bicubic).
fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output index: first input index and int16 fixed-point weights; plus the fixed-point precision.
pub(crate) struct Taps {
    pub(crate) start: Vec<usize>,
    pub(crate) weights: Vec<Vec<i32>>,
    pub(crate) precision: u32,
}

impl Taps {
    /// The rounding constant added before the shift (`1 << (precision - 1)`, 1 at precision 0).
    pub(crate) fn round(&self) -> i32 {
        1i32 << self.precision.saturating_sub(1)
    }
}

pub(crate) fn taps(n_in: usize, n_out: usize) -> Taps {
    let scale = n_in as f64 / n_out as f64;
    let (support, inv) = if scale >= 1.0 { (2.0 * scale, 1.0 / scale) } else { (2.0, 1.0) };
    let max_taps = support.ceil() as usize * 2 + 1;
    let mut start = Vec::with_capacity(n_out);
    let mut float_w = Vec::with_capacity(n_out);
    let mut w_max = 0f64;
    for i in 0..n_out {
        let center = scale * (i as f64 + 0.5);
        // `as i64` truncates toward zero, as the C++ casts do.
        let lo = ((center - support + 0.5) as i64).max(0) as usize;
        let hi = ((center + support + 0.5) as i64).min(n_in as i64) as usize;
        let len = hi.saturating_sub(lo).min(max_taps);
        let mut w: Vec<f64> = (0..len).map(|j| cubic((j as f64 + lo as f64 - center + 0.5) * inv)).collect();
        let total: f64 = w.iter().sum();
        if total != 0.0 {
            w.iter_mut().for_each(|x| *x /= total);
            w_max = w.iter().cloned().fold(w_max, f64::max);
        }
        start.push(lo);
        float_w.push(w);
    }
    // The largest precision whose doubled max weight still fits in int16.
    let mut precision = 0u32;
    while precision < 22 && ((0.5 + w_max * (1u64 << (precision + 1)) as f64) as i64) < (1 << 15) {
        precision += 1;
    }
    let one = (1u64 << precision) as f64;
    let weights = float_w
        .into_iter()
        .map(|w| {
            w.into_iter()
                .map(|x| {
                    let v = x * one;
                    if v < 0.0 {
                        (v - 0.5) as i32
                    } else {
                        (v + 0.5) as i32
                    }
                })
                .collect()
        })
        .collect();
    Taps { start, weights, precision }
}

/// One separable pass over an interleaved RGB buffer viewed as `outer x n_in x inner` (the filtered
/// axis in the middle); returns `outer x n_out x inner`. One output line (`inner` values) at a time: tap
/// `j` adds its weight times input line `lo + j`, a contiguous slice, so the inner loop walks memory in
/// order and vectorises (the vertical pass's lines are whole image rows). The sums are integers, so the
/// order of the taps does not change a bit of the result.
fn pass(src: &[u8], outer: usize, n_in: usize, inner: usize, n_out: usize) -> Vec<u8> {
    let t = taps(n_in, n_out);
    let round = t.round();
    let mut dst = vec![0u8; outer * n_out * inner];
    let mut acc = vec![0i32; inner];
    for o in 0..outer {
        let s = &src[o * n_in * inner..(o + 1) * n_in * inner];
        let d = &mut dst[o * n_out * inner..(o + 1) * n_out * inner];
        for ((&lo, w), out) in t.start.iter().zip(&t.weights).zip(d.chunks_exact_mut(inner)) {
            acc.fill(round);
            for (j, &wj) in w.iter().enumerate() {
                let line = &s[(lo + j) * inner..][..inner];
                acc.iter_mut().zip(line).for_each(|(a, &x)| *a += wj * x as i32);
            }
            out.iter_mut().zip(&acc).for_each(|(y, &a)| *y = (a >> t.precision).clamp(0, 255) as u8);
        }
    }
    dst
}

/// The input checks of both resizes: an RGB buffer of `width x height` pixels, no side 0.
fn check_resize(
    rgb: &[u8],
    width: usize,
    height: usize,
    new_width: usize,
    new_height: usize,
) -> Result<(), TilingError> {
    let want = width * height * 3;
    if rgb.len() != want {
        return Err(TilingError::Buffer { got: rgb.len(), want, width, height });
    }
    if width == 0 || height == 0 || new_width == 0 || new_height == 0 {
        return Err(TilingError::Empty { width: new_width.min(width), height: new_height.min(height) });
    }
    Ok(())
}

/// Antialiased bicubic resize of an interleaved RGB `width x height` image (horizontal pass first).
pub fn resize_bicubic_reference(
    rgb: &[u8],
    width: usize,
    height: usize,
    new_width: usize,
    new_height: usize,
) -> Result<Vec<u8>, TilingError> {
    check_resize(rgb, width, height, new_width, new_height)?;
    let mut img = rgb.to_vec();
    if new_width != width {
        // rows x width x 3
        img = pass(&img, height, width, 3, new_width);
    }
    if new_height != height {
        // 1 x height x (new_width * 3)
        img = pass(&img, 1, height, new_width * 3, new_height);
    }
    Ok(img)
}

/// Geometry of the processor: patch 14, merge 2, temporal patch 2 for every Qwen2-VL / Qwen2.5-VL.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PatchGeometry {
    pub patch_size: usize,
    pub merge_size: usize,
    pub temporal_patch_size: usize,
}

impl Default for PatchGeometry {
    fn default() -> Self {
        Self { patch_size: 14, merge_size: 2, temporal_patch_size: 2 }
    }
}

impl PatchGeometry {
    /// Side length that resized images are multiples of (28).
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }
    /// Length of one `pixel_values` row: `3 * temporal * patch * patch` (1176).
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// transformers fuses rescale into normalise: mean and std times 1 / (1/255), in f32. A pixel level `v`
/// becomes `(v as f32 - mean) / std` with these (the CUDA kernel does the same f32 operations).
pub(crate) fn scaled_mean_std(mean: [f32; 3], std: [f32; 3]) -> ([f32; 3], [f32; 3]) {
    let scale = (1.0f64 / (1.0f64 / 255.0)) as f32;
    (mean.map(|x| x * scale), std.map(|x| x * scale))
}

/// The input checks of both patchifies: an RGB buffer of `width x height` pixels, no patch size 0.
fn check_patchify(rgb: &[u8], width: usize, height: usize, geo: PatchGeometry) -> Result<(), TilingError> {
    let want = width * height * 3;
    if rgb.len() != want {
        return Err(TilingError::Buffer { got: rgb.len(), want, width, height });
    }
    if geo.patch_size == 0 || geo.merge_size == 0 || geo.temporal_patch_size == 0 {
        return Err(TilingError::Geometry(geo));
    }
    Ok(())
}

/// Normalises a resized RGB image and lays it out as `pixel_values (grid_h * grid_w, patch_dim)`.
///
/// Rows run over (merge-block row, merge-block column, row in block, column in block), so that each run
/// of `merge^2` rows is one merged token; columns over (channel, temporal copy, y, x). A still image is
/// repeated over the temporal patch. Returns the values and `(grid_h, grid_w)`.
pub fn normalize_patchify_reference(
    rgb: &[u8],
    width: usize,
    height: usize,
    geo: PatchGeometry,
    mean: [f32; 3],
    std: [f32; 3],
) -> Result<(Vec<f32>, (usize, usize)), TilingError> {
    check_patchify(rgb, width, height, geo)?;
    let (p, m, tp) = (geo.patch_size, geo.merge_size, geo.temporal_patch_size);
    let (gh, gw) = (height / p, width / p);
    let (mean, std) = scaled_mean_std(mean, std);
    let dim = geo.patch_dim();
    let mut out = Vec::with_capacity(gh * gw * dim);
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        for _ in 0..tp {
                            for y in 0..p {
                                let row = &rgb[((y0 + y) * width + x0) * 3..];
                                for x in 0..p {
                                    out.push((row[x * 3 + c] as f32 - mean[c]) / std[c]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok((out, (gh, gw)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_known_values() {
        // FACTS.md: 1024x768 with max 1280*28*28 -> grid 54x74 patches.
        assert_eq!(smart_resize(768, 1024, 28, 256 * 784, 1280 * 784), Ok((756, 1036)));
        // Ties round to even like Python: 42 / 28 = 1.5 -> 2, 70 / 28 = 2.5 -> 2.
        assert_eq!(smart_resize(42, 70, 28, 1, 1 << 30), Ok((56, 56)));
        assert!(matches!(smart_resize(1, 300, 28, 3136, 1_003_520), Err(TilingError::AspectRatio { .. })));
        assert!(matches!(smart_resize(0, 3, 28, 3136, 1_003_520), Err(TilingError::Empty { .. })));
    }

    #[test]
    fn resize_keeps_constant_images_and_identity() {
        let img = vec![77u8; 31 * 17 * 3];
        let out = resize_bicubic_reference(&img, 31, 17, 56, 28).unwrap();
        assert!(out.iter().all(|&v| v == 77));
        let ramp: Vec<u8> = (0..20 * 10 * 3).map(|i| (i % 251) as u8).collect();
        assert_eq!(resize_bicubic_reference(&ramp, 20, 10, 20, 10).unwrap(), ramp);
    }

    #[test]
    fn patch_layout_puts_merge_blocks_together() {
        // 56x28 image: grid 2x4 patches; pixel value encodes its patch column.
        let (w, h) = (56, 28);
        let rgb: Vec<u8> = (0..h).flat_map(|_| (0..w).flat_map(|x| [(x / 14) as u8; 3])).collect();
        let (pv, grid) =
            normalize_patchify_reference(&rgb, w, h, PatchGeometry::default(), [0.0; 3], [1.0 / 255.0; 3]).unwrap();
        assert_eq!(grid, (2, 4));
        let col = |r: usize| pv[r * 1176].round() as usize;
        // rows: block (0,0): (0,0) (0,1) (1,0) (1,1); block (0,1): columns 2,3
        assert_eq!((0..8).map(col).collect::<Vec<_>>(), vec![0, 1, 0, 1, 2, 3, 2, 3]);
    }
}
