//! Qwen2-VL tiling on the GPU (feature `cuda`): a batch of RGB8 images of any sizes -> `pixel_values`
//! `(sum of gh*gw, 3*2*14*14)` in f32 or bf16 and each image's `grid_thw`, equal to
//! [`tile_batch_reference`](super::tile_batch_reference) (the CPU path) bit for bit in f32.
//!
//! Key choice: the host plans ([`BatchPlan`]: `smart_resize`, the reference's own int16 filter taps, one
//! descriptor row per image), the device does the pixel work in two launches for the whole batch
//! (`cuda/tiling.cu`): a horizontal pass into a u8 intermediate, then the vertical pass fused with
//! rescale + normalise + patchify (the resized image is never stored). Integer filters with the CPU's
//! rounding and clamping after each pass make the GPU resize exact, not merely close.
//!
//! Two entry points: [`tile_batch_cuda`] uploads host images; [`tile_batch_cuda_uploaded`] takes images
//! already on the device, concatenated in one u8 tensor (see [`upload_images`]). Inputs are validated on
//! the host before anything is launched, with the CPU path's errors.
//!
//! Tests: `kernels/tests/cuda/tiling.rs`; bench: `cargo run --release -p askgui-kernels --features cuda
//! --example bench_cuda -- tiling`.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, DType, Device, Storage, Tensor};

use super::{BatchPlan, ImageRef, TilingConfig, TilingError};
use crate::cuda::{ptx, suffix, wrap};

const MODULE: &str = "askgui_tiling";
const THREADS: u32 = 256;

fn device_err(e: candle_core::Error) -> TilingError {
    TilingError::Device(e.to_string())
}

fn cuda_device(dev: &Device) -> Result<&CudaDevice, TilingError> {
    match dev {
        Device::Cuda(d) => Ok(d),
        other => {
            Err(TilingError::Device(format!("the CUDA tiling path needs a CUDA device, got {:?}", other.location())))
        }
    }
}

fn check_dtype(dtype: DType) -> Result<(), TilingError> {
    match dtype {
        DType::F32 | DType::BF16 => Ok(()),
        other => Err(TilingError::Device(format!("pixel_values can be f32 or bf16, not {other:?}"))),
    }
}

/// Tiles host images on `dev` (uploads them, then [`tile_batch_cuda_uploaded`]'s work). Returns
/// `pixel_values (rows, patch_dim)` of `dtype` (f32 or bf16) on `dev` and each image's `[1, gh, gw]`.
pub fn tile_batch_cuda(
    dev: &Device,
    images: &[ImageRef],
    cfg: &TilingConfig,
    dtype: DType,
) -> Result<(Tensor, Vec<[usize; 3]>), TilingError> {
    let sizes: Vec<(usize, usize)> = images.iter().map(|i| (i.width, i.height)).collect();
    let lens: Vec<usize> = images.iter().map(|i| i.rgb.len()).collect();
    let plan = BatchPlan::new(&sizes, Some(&lens), cfg)?;
    check_dtype(dtype)?;
    let d = cuda_device(dev)?;
    let input = upload(d, images, plan.input_len).map_err(device_err)?;
    let pv = run(d, input.slice(..), &plan, dtype).map_err(device_err)?;
    Ok((pv, plan.grid_thw))
}

/// Tiles images already on the device: `input` is a contiguous u8 CUDA tensor holding the RGB8 images of
/// `sizes` (`(width, height)` each) concatenated, row-major, `sum(w * h * 3)` bytes.
pub fn tile_batch_cuda_uploaded(
    input: &Tensor,
    sizes: &[(usize, usize)],
    cfg: &TilingConfig,
    dtype: DType,
) -> Result<(Tensor, Vec<[usize; 3]>), TilingError> {
    let plan = BatchPlan::new(sizes, None, cfg)?;
    check_dtype(dtype)?;
    if input.dtype() != DType::U8 {
        return Err(TilingError::Device(format!("the uploaded images must be u8, got {:?}", input.dtype())));
    }
    if input.elem_count() != plan.input_len {
        return Err(TilingError::BatchBuffer { got: input.elem_count(), want: plan.input_len, images: sizes.len() });
    }
    let d = cuda_device(input.device())?;
    let (storage, layout) = input.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(TilingError::Device("the uploaded images are not in CUDA memory".into()));
    };
    let view = crate::cuda::view::<u8>(cs, layout, "tile_batch_cuda_uploaded", "input").map_err(device_err)?;
    let pv = run(d, view, &plan, dtype).map_err(device_err)?;
    Ok((pv, plan.grid_thw))
}

/// Uploads host images into one u8 tensor on `dev` (concatenated, as [`tile_batch_cuda_uploaded`] takes
/// them), checking each buffer's length.
pub fn upload_images(dev: &Device, images: &[ImageRef]) -> Result<Tensor, TilingError> {
    let mut total = 0;
    for (index, i) in images.iter().enumerate() {
        let want = i.width * i.height * 3;
        if i.rgb.len() != want {
            let source = Box::new(TilingError::Buffer { got: i.rgb.len(), want, width: i.width, height: i.height });
            return Err(TilingError::InBatch { index, source });
        }
        total += want;
    }
    let d = cuda_device(dev)?;
    let slice = upload(d, images, total).map_err(device_err)?;
    Ok(Tensor::from_storage(Storage::Cuda(wrap(slice, d)), total, BackpropOp::none(), false))
}

/// One device buffer holding the images back to back (lengths already checked).
fn upload(d: &CudaDevice, images: &[ImageRef], total: usize) -> candle_core::Result<CudaSlice<u8>> {
    // SAFETY: every byte is written by the copies below (the lengths sum to `total`) before any read.
    let mut buf = unsafe { d.alloc::<u8>(total.max(1)) }?;
    let mut off = 0;
    for i in images {
        if !i.rgb.is_empty() {
            d.memcpy_htod(i.rgb, &mut buf.slice_mut(off..off + i.rgb.len()))?;
        }
        off += i.rgb.len();
    }
    Ok(buf)
}

/// Grid of `work` items per image (grid-stride loops inside), one grid row per image.
fn grid(work: usize, images: usize) -> candle_core::Result<LaunchConfig> {
    if images > 65_535 {
        candle_core::bail!("tiling: a batch of {images} images exceeds the 65535 of one launch; split it");
    }
    let blocks = work.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    Ok(LaunchConfig { grid_dim: (blocks, images as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 })
}

fn run(d: &CudaDevice, input: CudaView<u8>, plan: &BatchPlan, dtype: DType) -> candle_core::Result<Tensor> {
    let desc = d.clone_htod(&plan.desc)?;
    let taps = d.clone_htod(&plan.taps)?;
    let weights = d.clone_htod(&plan.weights)?;
    // SAFETY: tiling_hpass writes every byte of every image's (h, nw, 3) intermediate, and the
    // intermediates tile the buffer exactly (offsets from the plan).
    let mut inter = unsafe { d.alloc::<u8>(plan.inter_len.max(1)) }?;
    let hpass = d.get_or_load_custom_func("tiling_hpass", MODULE, ptx::TILING)?;
    let mut b = hpass.builder();
    b.arg(&input);
    b.arg(&mut inter);
    b.arg(&desc);
    b.arg(&taps);
    b.arg(&weights);
    // SAFETY: the kernel reads `input` within each image's `w * h * 3` bytes at its offset (the plan's
    // offsets tile `input_len`, checked against the buffer), taps and weights within the tables the plan
    // built for exactly these sizes, and writes `inter` within `inter_len`.
    unsafe { b.launch(grid(plan.max_h_work, plan.len())?) }.w()?;
    let shape = (plan.rows, plan.patch_dim);
    let storage = match suffix("tile_batch_cuda", &[("pixel_values", dtype)])? {
        "f32" => vpass::<f32>(d, &inter, &desc, &taps, &weights, plan, "f32")?,
        sfx => vpass::<half::bf16>(d, &inter, &desc, &taps, &weights, plan, sfx)?,
    };
    Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false))
}

fn vpass<T: CudaDType + DeviceRepr>(
    d: &CudaDevice,
    inter: &CudaSlice<u8>,
    desc: &CudaSlice<i64>,
    taps: &CudaSlice<i32>,
    weights: &CudaSlice<i32>,
    plan: &BatchPlan,
    suffix: &str,
) -> candle_core::Result<candle_core::CudaStorage> {
    let n = plan.rows * plan.patch_dim;
    // SAFETY: the kernel writes every element: per image, each (row, channel, y, x) thread writes all
    // temporal copies of its value, and the images' rows tile `plan.rows`.
    let mut out = unsafe { d.alloc::<T>(n.max(1)) }?;
    let func = d.get_or_load_custom_func(&format!("tiling_vpass_patchify_{suffix}"), MODULE, ptx::TILING)?;
    let g = plan.geometry;
    let (m, s) = (plan.mean255, plan.std255);
    let (p, merge, tp) = (g.patch_size as i32, g.merge_size as i32, g.temporal_patch_size as i32);
    let mut b = func.builder();
    b.arg(inter);
    b.arg(&mut out);
    b.arg(desc);
    b.arg(taps);
    b.arg(weights);
    b.arg(&m[0]);
    b.arg(&m[1]);
    b.arg(&m[2]);
    b.arg(&s[0]);
    b.arg(&s[1]);
    b.arg(&s[2]);
    b.arg(&p);
    b.arg(&merge);
    b.arg(&tp);
    // SAFETY: reads `inter` within each image's intermediate (vertical taps index rows < h), writes `out`
    // within `rows * patch_dim` (row offsets and grids from the plan), all on candle's stream after the
    // horizontal pass.
    unsafe { b.launch(grid(plan.max_v_work, plan.len())?) }.w()?;
    Ok(wrap(out, d))
}
