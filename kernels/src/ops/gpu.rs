//! What the CUDA forwards of the training ops share (feature `cuda`): the element-type bound, a dispatch
//! from a storage to its typed slice, kernel loading and launch sizes.
//!
//! Why a dispatch macro: the kernels are generic over the storage type (f32 or bf16), and matching on
//! candle's `CudaStorageSlice` hands a generic launcher its `CudaSlice<T>` with `T` inferred, so this
//! crate never has to name `half::bf16` (no extra dependency).

use crate::cuda::ptx;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::CudaDType;
use candle_core::{bail, DType, Result, WithDType};

/// A storage element type of the kernels (f32 or bf16; the dispatch refuses others before any launch).
pub(crate) trait Elem: CudaDType + DeviceRepr + WithDType + ValidAsZeroBits {}
impl<T: CudaDType + DeviceRepr + WithDType + ValidAsZeroBits> Elem for T {}

/// The kernel-name suffix of `T`: `f32` or `bf16`.
fn suffix<T: Elem>(op: &str) -> Result<&'static str> {
    match T::DTYPE {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        other => bail!("{op}: CUDA kernels exist for f32 and bf16, got {other:?}"),
    }
}

/// Calls `$f(typed_slice, args...)` with the `CudaSlice<T>` of `$storage` (f32 or bf16), `T` inferred.
macro_rules! dispatch {
    ($op:expr, $storage:expr, $($f:ident)::+ ( $($arg:expr),* $(,)? )) => {
        match &$storage.slice {
            candle_core::cuda_backend::CudaStorageSlice::F32(s) => $($f)::+(s, $($arg),*),
            candle_core::cuda_backend::CudaStorageSlice::BF16(s) => $($f)::+(s, $($arg),*),
            _ => candle_core::bail!("{}: CUDA inputs must be f32 or bf16, got {:?}", $op, $storage.dtype()),
        }
    };
}
pub(crate) use dispatch;

/// `(kernel name, module name, PTX)` of the kernel `<base>_<suffix of T>` in `cuda/<module>.cu`, for
/// `CudaDevice::get_or_load_custom_func` (which loads a module once per device; candle does not export
/// the function type it returns, so the call stays at the launch site).
pub(crate) fn kernel<T: Elem>(base: &str, module: Module) -> Result<(String, &'static str, &'static str)> {
    let (name, ptx) = match module {
        Module::Norm => ("askgui_norm", ptx::NORM),
        Module::Rope => ("askgui_rope", ptx::ROPE),
        Module::CrossEntropy => ("askgui_cross_entropy", ptx::CROSS_ENTROPY),
    };
    Ok((format!("{base}_{}", suffix::<T>(base)?), name, ptx))
}

/// The PTX modules of this crate's training ops.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Module {
    Norm,
    Rope,
    CrossEntropy,
}

/// `v` as a kernel's `int`, or an error naming the op and the quantity.
pub(crate) fn to_i32(op: &str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("{op}: {what} = {v} exceeds a CUDA int")))
}

/// Threads of a block that reduces rows of `d` elements: about 4 elements per thread, a multiple of 32
/// (the block reductions need whole warps), between 32 and `max`.
pub(crate) fn row_threads(d: usize, max: u32) -> u32 {
    (d.div_ceil(4).next_multiple_of(32)).clamp(32, max as usize) as u32
}
