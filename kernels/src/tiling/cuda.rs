//! Qwen2-VL tiling on the GPU (feature `cuda`): a batch of RGB8 images of any sizes -> `pixel_values`
//! `(sum of gh*gw, 3*2*14*14)` in f32 or bf16 and each image's `grid_thw`, equal to
//! [`tile_batch_reference`](super::tile_batch_reference) (the CPU path) bit for bit in f32.
//!
//! Key choice: the host plans ([`BatchPlan`]: `smart_resize`, the reference's own int16 filter taps, one
//! descriptor row per image; its launches in `plan::tiling`), the device does the pixel work in two
//! launches for the whole batch (`cuda/tiling.cu`): a horizontal pass into a u8 intermediate, then the vertical pass fused with
//! rescale + normalise + patchify (the resized image is never stored). Integer filters with the CPU's
//! rounding and clamping after each pass make the GPU resize exact, not merely close.
//!
//! Two entry points: [`tile_batch_cuda`] uploads host images; [`tile_batch_cuda_uploaded`] takes images
//! already on the device, concatenated in one u8 tensor (see [`upload_images`]). Inputs are validated on
//! the host before anything is launched, with the CPU path's errors.
//!
//! Tests: `kernels/tests/cuda/tiling.rs`; bench: `cargo run --release -p askgui-kernels --features cuda
//! --example bench_cuda -- tiling`.

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};

use super::{BatchPlan, ImageRef, TilingConfig, TilingError};
use crate::cuda::wrap;
use crate::plan::Elem;

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

fn check_dtype(dtype: DType) -> Result<Elem, TilingError> {
    match dtype {
        DType::F32 => Ok(Elem::F32),
        DType::BF16 => Ok(Elem::Bf16),
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
    let elem = check_dtype(dtype)?;
    let d = cuda_device(dev)?;
    let input = wrap(upload(d, images, plan.input_len).map_err(device_err)?, d);
    let pv = run(&input, 0, &plan, elem).map_err(device_err)?;
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
    let elem = check_dtype(dtype)?;
    if input.dtype() != DType::U8 {
        return Err(TilingError::Device(format!("the uploaded images must be u8, got {:?}", input.dtype())));
    }
    if input.elem_count() != plan.input_len {
        return Err(TilingError::BatchBuffer { got: input.elem_count(), want: plan.input_len, images: sizes.len() });
    }
    cuda_device(input.device())?;
    let (storage, layout) = input.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(TilingError::Device("the uploaded images are not in CUDA memory".into()));
    };
    let Some((start, _)) = layout.contiguous_offsets() else {
        return Err(TilingError::Device("the uploaded images must be one contiguous u8 tensor".into()));
    };
    let pv = run(cs, start, &plan, elem).map_err(device_err)?;
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

/// Runs the tiling plan (`plan::tiling`) on the images in `input` from byte `start`.
fn run(input: &CudaStorage, start: usize, plan: &BatchPlan, elem: Elem) -> candle_core::Result<Tensor> {
    let p = crate::plan::tiling::plan(plan, elem)?;
    let out = crate::ops::gpu::single("tiling", crate::ops::gpu::run(&p, &[(input, start)])?)?;
    Ok(Tensor::from_storage(Storage::Cuda(out), (plan.rows, plan.patch_dim), BackpropOp::none(), false))
}
