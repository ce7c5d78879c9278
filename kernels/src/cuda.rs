//! The CUDA side of the ops (feature `cuda`): the PTX that build.rs compiles from `cuda/*.cu`, and the GPU
//! executor of the launch plans ([`exec`]).
//!
//! Every op's CUDA path builds a plan (`crate::plan`: every launch decision as data) and runs it here;
//! the CPU executor (`crate::emu`, feature `cpu-exec`) runs the same plans in `tests/emu/` without a GPU.
//! Kernels store f32 or bf16 (named `<kernel>_f32` / `<kernel>_bf16`) and compute every statistic and
//! accumulator in f32; on a GPU they are tested against the CPU ops in `tests/cuda/`.

use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaDevice, CudaStorage};

pub mod exec;

/// The PTX text of each `cuda/*.cu`, as `ptx::<FILE STEM IN CAPITALS>`.
pub mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// A device buffer as a candle storage.
pub(crate) fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(slice, dev.clone())
}
