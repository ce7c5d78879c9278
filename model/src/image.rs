//! Image preprocessing equal to transformers' `Qwen2VLImageProcessor`: decode, smart_resize, bicubic
//! resize, rescale + normalise, patchify, `image_grid_thw`. The arithmetic is the CPU tiling reference in
//! askgui-kernels; this file adds configuration, decoding, limits and the resize factors that the
//! coordinate contract needs (a point in the resized image is the screen point times the factors).
//!
//! [`preprocess_batch`] does a whole batch for a device: on a CUDA device (feature `cuda`) it runs the GPU
//! tiling kernels (`askgui_kernels::tiling::cuda`, bit-exact with the CPU path), elsewhere the CPU path,
//! and logs once which one it uses. It is the one place that choice is made: the trainer's batches call it,
//! and the agent runtime (serve, eval) through [`preprocess_on`].

use std::path::Path;

use askgui_kernels::tiling::{normalize_patchify, resize_bicubic, PatchGeometry, TilingConfig, TilingError};
use candle_core::{Device, Tensor};

use crate::error::{ModelError, Result};

/// CLIP normalisation used by every Qwen2-VL / Qwen2.5-VL checkpoint.
pub const CLIP_MEAN: [f32; 3] = askgui_kernels::tiling::CLIP_MEAN;
pub const CLIP_STD: [f32; 3] = askgui_kernels::tiling::CLIP_STD;

/// Preprocessing settings; defaults are transformers' class defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorConfig {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub geometry: PatchGeometry,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Inputs larger than this (before resizing) are refused instead of decoded into memory.
    pub max_input_pixels: usize,
    /// Inputs with a shorter side are refused. transformers 5 upsamples even a 1x1 image to 56x56; a
    /// one-pixel side is never a screenshot, so it is an error here (the first Qwen2-VL processor refused
    /// sides under 28).
    pub min_side: usize,
}

impl Default for ImageProcessorConfig {
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            geometry: PatchGeometry::default(),
            image_mean: CLIP_MEAN,
            image_std: CLIP_STD,
            max_input_pixels: 8192 * 8192,
            min_side: 2,
        }
    }
}

impl ImageProcessorConfig {
    /// A family's processor when the checkpoint ships none: transformers' class defaults for Qwen2/2.5-VL;
    /// for Qwen3-VL the released `preprocessor_config.json`'s (16-px patches, mean and std 0.5, `size`
    /// 65,536 to 16,777,216 pixels).
    pub fn for_arch(arch: crate::config::Arch) -> Self {
        let (image_mean, image_std) = arch.image_mean_std();
        let mut cfg = Self { image_mean, image_std, ..Self::default() };
        if arch == crate::config::Arch::Qwen3Vl {
            (cfg.min_pixels, cfg.max_pixels, cfg.geometry.patch_size) = (65_536, 16_777_216, 16);
        }
        cfg
    }

    /// The settings the tiling kernels take.
    pub fn tiling(&self) -> TilingConfig {
        TilingConfig {
            min_pixels: self.min_pixels,
            max_pixels: self.max_pixels,
            geometry: self.geometry,
            mean: self.image_mean,
            std: self.image_std,
        }
    }

    /// Reads `preprocessor_config.json` (`min_pixels`/`max_pixels` or `size.shortest_edge/longest_edge`),
    /// with Qwen2/2.5-VL's defaults for what it leaves out.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_file_over(path, Self::default())
    }

    /// [`Self::from_file`] with `defaults` for what the file leaves out (see [`Self::for_arch`]).
    pub fn from_file_over(path: &Path, defaults: Self) -> Result<Self> {
        let err = |reason: String| ModelError::Config { path: path.to_path_buf(), reason };
        let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))?;
        let mut cfg = defaults;
        let num = |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_u64()).map(|x| x as usize);
        if let Some(size) = v.get("size") {
            cfg.min_pixels = num(size, "shortest_edge").unwrap_or(cfg.min_pixels);
            cfg.max_pixels = num(size, "longest_edge").unwrap_or(cfg.max_pixels);
        }
        cfg.min_pixels = num(&v, "min_pixels").unwrap_or(cfg.min_pixels);
        cfg.max_pixels = num(&v, "max_pixels").unwrap_or(cfg.max_pixels);
        let g = &mut cfg.geometry;
        g.patch_size = num(&v, "patch_size").unwrap_or(g.patch_size);
        g.merge_size = num(&v, "merge_size").unwrap_or(g.merge_size);
        g.temporal_patch_size = num(&v, "temporal_patch_size").unwrap_or(g.temporal_patch_size);
        let triple = |k: &str, d: [f32; 3]| -> Result<[f32; 3]> {
            match v.get(k).and_then(|x| x.as_array()) {
                None => Ok(d),
                Some(a) if a.len() == 3 && a.iter().all(|x| x.is_number()) => {
                    Ok([0, 1, 2].map(|i| a[i].as_f64().unwrap_or_default() as f32))
                }
                Some(_) => Err(err(format!("`{k}` must be three numbers"))),
            }
        };
        cfg.image_mean = triple("image_mean", cfg.image_mean)?;
        cfg.image_std = triple("image_std", cfg.image_std)?;
        if cfg.min_pixels > cfg.max_pixels {
            return Err(err(format!("min_pixels {} is larger than max_pixels {}", cfg.min_pixels, cfg.max_pixels)));
        }
        Ok(cfg)
    }
}

/// One preprocessed image.
#[derive(Debug, Clone)]
pub struct ProcessedImage {
    /// `(grid_t * grid_h * grid_w, 3 * temporal * patch * patch)` f32, row-major.
    pub pixel_values: Vec<f32>,
    /// `[t, h, w]` in patches.
    pub grid_thw: [usize; 3],
    /// Original `(width, height)`.
    pub original: (usize, usize),
    /// Resized `(width, height)`, multiples of the token side (28, or 32 for Qwen3-VL).
    pub resized: (usize, usize),
}

impl ProcessedImage {
    /// `(resized_w / original_w, resized_h / original_h)`: screen pixels times these are model pixels.
    pub fn resize_factors(&self) -> (f64, f64) {
        (self.resized.0 as f64 / self.original.0 as f64, self.resized.1 as f64 / self.original.1 as f64)
    }

    /// Number of `<|image_pad|>` tokens the image takes in the prompt.
    pub fn num_tokens(&self, merge_size: usize) -> usize {
        self.grid_thw.iter().product::<usize>() / (merge_size * merge_size)
    }

    pub fn pixel_tensor(&self, device: &Device) -> Result<Tensor> {
        pixel_rows(&[self], device)
    }
}

/// The pixel rows of `images` back to back, `(sum P_i, patch_dim)`, copied once (a 640x480 screenshot is
/// 7 MB of f32): the vision tower's input for a batch.
pub fn pixel_rows(images: &[&ProcessedImage], device: &Device) -> Result<Tensor> {
    let rows: usize = images.iter().map(|i| i.grid_thw.iter().product::<usize>()).sum();
    let mut pixels = Vec::with_capacity(images.iter().map(|i| i.pixel_values.len()).sum());
    images.iter().for_each(|i| pixels.extend_from_slice(&i.pixel_values));
    let dim = pixels.len() / rows.max(1);
    if pixels.len() != rows * dim {
        return Err(ModelError::Generation(format!("{} pixel values do not fill {rows} patch rows", pixels.len())));
    }
    Ok(Tensor::from_vec(pixels, (rows, dim), device)?)
}

/// Decodes an image file (PNG, JPEG) to RGB8, refusing images above `max_input_pixels`.
pub fn load_image(path: &Path, max_input_pixels: usize) -> Result<image::RgbImage> {
    let err = |reason: String| ModelError::Image { path: path.display().to_string(), reason };
    let reader = image::ImageReader::open(path)
        .map_err(|e| err(format!("cannot open: {e}")))?
        .with_guessed_format()
        .map_err(|e| err(format!("cannot read: {e}")))?;
    let (w, h) = reader.into_dimensions().map_err(|e| err(format!("not a readable image: {e}")))?;
    let pixels = w as usize * h as usize;
    if pixels > max_input_pixels {
        return Err(ModelError::ImageTooLarge {
            width: w as usize,
            height: h as usize,
            pixels,
            limit: max_input_pixels,
        });
    }
    let img = image::ImageReader::open(path)
        .map_err(|e| err(format!("cannot open: {e}")))?
        .with_guessed_format()
        .map_err(|e| err(format!("cannot read: {e}")))?
        .decode()
        .map_err(|e| err(format!("cannot decode: {e}")))?;
    Ok(img.to_rgb8())
}

/// The input limits of the processor (before any resizing).
fn check_limits(w: usize, h: usize, cfg: &ImageProcessorConfig) -> Result<()> {
    if w * h > cfg.max_input_pixels {
        return Err(ModelError::ImageTooLarge { width: w, height: h, pixels: w * h, limit: cfg.max_input_pixels });
    }
    if w.min(h) < cfg.min_side {
        return Err(ModelError::ImageTooSmall { width: w, height: h, min_side: cfg.min_side });
    }
    Ok(())
}

/// Preprocesses an RGB image the way `Qwen2VLImageProcessor` does.
pub fn preprocess(img: &image::RgbImage, cfg: &ImageProcessorConfig) -> Result<ProcessedImage> {
    let (w, h) = (img.width() as usize, img.height() as usize);
    check_limits(w, h, cfg)?;
    let tiling = |source| ModelError::Tiling { width: w, height: h, source };
    let (nh, nw) =
        askgui_kernels::smart_resize(h, w, cfg.geometry.factor(), cfg.min_pixels, cfg.max_pixels).map_err(tiling)?;
    let resized = resize_bicubic(img.as_raw(), w, h, nw, nh).map_err(tiling)?;
    let (pixel_values, (gh, gw)) =
        normalize_patchify(&resized, nw, nh, cfg.geometry, cfg.image_mean, cfg.image_std).map_err(tiling)?;
    Ok(ProcessedImage { pixel_values, grid_thw: [1, gh, gw], original: (w, h), resized: (nw, nh) })
}

/// A preprocessed batch, `pixel_values` already on the target device.
#[derive(Debug, Clone)]
pub struct PreprocessedBatch {
    /// `(sum of t * h * w, 3 * temporal * patch * patch)` f32, images in batch order.
    pub pixel_values: Tensor,
    /// `[t, h, w]` in patches, per image.
    pub grid_thw: Vec<[usize; 3]>,
    /// Original and resized `(width, height)` per image (see [`ProcessedImage::resize_factors`]).
    pub original: Vec<(usize, usize)>,
    pub resized: Vec<(usize, usize)>,
}

static LOG_GPU_PATH: std::sync::Once = std::sync::Once::new();
static LOG_CPU_PATH: std::sync::Once = std::sync::Once::new();

/// Logs, once per process, that images are preprocessed on the CPU.
fn log_cpu_path(device: &Device) {
    LOG_CPU_PATH.call_once(|| tracing::info!(?device, "image preprocessing: CPU path"));
}

/// Whether [`preprocess_batch`] tiles on `device` with the GPU kernels: a CUDA device in a build with the
/// `cuda` feature.
pub fn tiles_on_gpu(device: &Device) -> bool {
    cfg!(feature = "cuda") && device.is_cuda()
}

/// One image for a model on `device`: on a CUDA device tiled by the GPU kernels ([`preprocess_batch`]) and
/// its pixel rows copied back to the host, where the agent runtime caches them by content; elsewhere
/// [`preprocess`]. The same grid, sizes and errors either way, and the same values (the GPU kernels are
/// bit-exact with the CPU path by design).
pub fn preprocess_on(img: &image::RgbImage, cfg: &ImageProcessorConfig, device: &Device) -> Result<ProcessedImage> {
    if !tiles_on_gpu(device) {
        log_cpu_path(device);
        return preprocess(img, cfg);
    }
    let b = preprocess_batch(&[img], cfg, device)?;
    Ok(ProcessedImage {
        pixel_values: b.pixel_values.flatten_all()?.to_vec1::<f32>()?,
        grid_thw: b.grid_thw[0],
        original: b.original[0],
        resized: b.resized[0],
    })
}

/// Preprocesses a batch for `device`: with the GPU tiling kernels on a CUDA device (feature `cuda`), else
/// with the CPU path ([`preprocess`] per image). Both give the same values and the same errors.
pub fn preprocess_batch(
    imgs: &[&image::RgbImage],
    cfg: &ImageProcessorConfig,
    device: &Device,
) -> Result<PreprocessedBatch> {
    let original: Vec<(usize, usize)> = imgs.iter().map(|i| (i.width() as usize, i.height() as usize)).collect();
    for &(w, h) in &original {
        check_limits(w, h, cfg)?;
    }
    let (pixel_values, grid_thw) = match tile_on_gpu(imgs, &original, cfg, device)? {
        Some(done) => {
            LOG_GPU_PATH.call_once(|| tracing::info!(?device, "image preprocessing: GPU tiling kernels"));
            done
        }
        None => {
            log_cpu_path(device);
            if imgs.is_empty() {
                return Err(ModelError::Tiling { width: 0, height: 0, source: TilingError::EmptyBatch });
            }
            let done: Vec<ProcessedImage> = imgs.iter().map(|i| preprocess(i, cfg)).collect::<Result<_>>()?;
            let rows = done.iter().map(|p| p.grid_thw.iter().product::<usize>()).sum::<usize>();
            let values: Vec<f32> = done.iter().flat_map(|p| p.pixel_values.iter().copied()).collect();
            let pv = Tensor::from_vec(values, (rows, cfg.geometry.patch_dim()), device)?;
            (pv, done.iter().map(|p| p.grid_thw).collect())
        }
    };
    let p = cfg.geometry.patch_size;
    let resized = grid_thw.iter().map(|g| (g[2] * p, g[1] * p)).collect();
    Ok(PreprocessedBatch { pixel_values, grid_thw, original, resized })
}

/// The GPU path where `device` is a CUDA device, `None` elsewhere.
#[cfg(feature = "cuda")]
fn tile_on_gpu(
    imgs: &[&image::RgbImage],
    original: &[(usize, usize)],
    cfg: &ImageProcessorConfig,
    device: &Device,
) -> Result<Option<(Tensor, Vec<[usize; 3]>)>> {
    use askgui_kernels::tiling::{cuda::tile_batch_cuda, ImageRef};
    if !device.is_cuda() {
        return Ok(None);
    }
    // The trainer's prefetch thread and the server's job threads tile on a device they did not open.
    crate::device::bind_thread(device)?;
    let refs: Vec<ImageRef> =
        imgs.iter().zip(original).map(|(i, &(width, height))| ImageRef { rgb: i.as_raw(), width, height }).collect();
    let done = tile_batch_cuda(device, &refs, &cfg.tiling(), candle_core::DType::F32).map_err(|e| match e {
        TilingError::InBatch { index, source } => {
            let (width, height) = original[index];
            ModelError::Tiling { width, height, source: *source }
        }
        other => ModelError::Tiling { width: 0, height: 0, source: other },
    })?;
    Ok(Some(done))
}

#[cfg(not(feature = "cuda"))]
fn tile_on_gpu(
    _imgs: &[&image::RgbImage],
    _original: &[(usize, usize)],
    _cfg: &ImageProcessorConfig,
    _device: &Device,
) -> Result<Option<(Tensor, Vec<[usize; 3]>)>> {
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_equals_single_images_on_cpu() -> Result<()> {
        let imgs: Vec<image::RgbImage> = [(29u32, 31u32), (100, 57)]
            .iter()
            .map(|&(w, h)| {
                image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7) as u8, (y * 5) as u8, ((x + y) * 3) as u8]))
            })
            .collect();
        let cfg = ImageProcessorConfig::default();
        let batch = preprocess_batch(&imgs.iter().collect::<Vec<_>>(), &cfg, &Device::Cpu)?;
        let single: Vec<ProcessedImage> = imgs.iter().map(|i| preprocess(i, &cfg)).collect::<Result<_>>()?;
        let want: Vec<f32> = single.iter().flat_map(|p| p.pixel_values.clone()).collect();
        assert_eq!(batch.pixel_values.flatten_all()?.to_vec1::<f32>()?, want);
        assert_eq!(batch.grid_thw, single.iter().map(|p| p.grid_thw).collect::<Vec<_>>());
        assert_eq!(batch.resized, single.iter().map(|p| p.resized).collect::<Vec<_>>());
        assert!(matches!(preprocess_batch(&[], &cfg, &Device::Cpu), Err(ModelError::Tiling { .. })));
        // On the CPU the runtime's entry point is the CPU path itself.
        assert!(!tiles_on_gpu(&Device::Cpu));
        assert_eq!(preprocess_on(&imgs[1], &cfg, &Device::Cpu)?.pixel_values, single[1].pixel_values);
        Ok(())
    }

    /// On a CUDA device the runtime's images are tiled by the GPU kernels and come back to the host with
    /// the CPU path's grid and sizes, and its values within one uint8 level of the resized image
    /// (`1 / 255 / std` normalised): the bound of the kernels' own test (`kernels/tests/cuda/tiling.rs`),
    /// whose design is bit-exact.
    #[cfg(feature = "cuda")]
    #[test]
    fn preprocess_on_cuda_equals_the_cpu_path() -> Result<()> {
        let Ok(dev) = Device::new_cuda(0) else {
            println!("SKIPPED: no CUDA device");
            return Ok(());
        };
        let img = image::RgbImage::from_fn(331, 517, |x, y| image::Rgb([(x * 7) as u8, (y * 5) as u8, (x ^ y) as u8]));
        let cfg = ImageProcessorConfig::default();
        assert!(tiles_on_gpu(&dev));
        let (gpu, cpu) = (preprocess_on(&img, &cfg, &dev)?, preprocess(&img, &cfg)?);
        assert_eq!((gpu.grid_thw, gpu.original, gpu.resized), (cpu.grid_thw, cpu.original, cpu.resized));
        assert_eq!(gpu.pixel_values.len(), cpu.pixel_values.len());
        let level = 1.0001 / 255.0 / cfg.image_std.iter().fold(f32::MAX, |a, &b| a.min(b));
        let worst = gpu.pixel_values.iter().zip(&cpu.pixel_values).map(|(g, c)| (g - c).abs()).fold(0.0, f32::max);
        assert!(worst <= level, "largest difference {worst}, one level is {level}");
        Ok(())
    }

    #[test]
    fn pixel_rows_stack_images_and_refuse_a_ragged_one() -> Result<()> {
        let img = |grid: [usize; 3], dim: usize, v0: f32| ProcessedImage {
            pixel_values: (0..grid.iter().product::<usize>() * dim).map(|i| v0 + i as f32).collect(),
            grid_thw: grid,
            original: (1, 1),
            resized: (1, 1),
        };
        let (a, b) = (img([1, 2, 2], 3, 0.0), img([1, 2, 4], 3, 100.0));
        let rows = pixel_rows(&[&a, &b], &Device::Cpu)?;
        assert_eq!(rows.dims(), &[12, 3]);
        let want: Vec<f32> = a.pixel_values.iter().chain(&b.pixel_values).copied().collect();
        assert_eq!(rows.flatten_all()?.to_vec1::<f32>()?, want);
        let mut ragged = img([1, 2, 2], 3, 0.0);
        ragged.pixel_values.pop();
        let err = pixel_rows(&[&a, &ragged], &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("do not fill 8 patch rows"), "{err}");
        Ok(())
    }
}
