//! The CUDA side of the ops (feature `cuda`): the PTX that build.rs compiles from `cuda/*.cu`, and the
//! plumbing every `cuda_fwd` shares.
//!
//! Each op's `cuda_fwd` sits beside its `cpu_fwd` in `ops/` and launches a kernel of `cuda/<module>.cu`
//! through candle's `CudaDevice` (which loads a PTX module once and caches it by name). Kernels store f32
//! or bf16 (named `<kernel>_f32` / `<kernel>_bf16`) and compute every statistic and accumulator in f32;
//! they are tested against the CPU ops and the plain-candle references in `tests/cuda_ops.rs`.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda_backend::CudaDType;
use candle_core::{bail, CudaDevice, CudaStorage, DType, Layout, Result};

/// The PTX text of each `cuda/*.cu`, as `ptx::<FILE STEM IN CAPITALS>`.
pub mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// The contiguous part of `storage` that `layout` describes, or an error naming the op and the input.
pub(crate) fn view<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
    op: &str,
    what: &str,
) -> Result<CudaView<'a, T>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(storage.as_cuda_slice::<T>()?.slice(start..end)),
        None => bail!(
            "{op}: `{what}` must be contiguous, got shape {:?} with strides {:?}",
            layout.shape(),
            layout.stride()
        ),
    }
}

/// A device buffer as a candle storage.
pub(crate) fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice) -> CudaStorage {
    CudaStorage::wrap_cuda_slice(slice, dev.clone())
}

/// The kernel-name suffix of a storage dtype (`f32` or `bf16`), or an error naming the op and the inputs.
pub(crate) fn suffix(op: &str, dtypes: &[(&str, DType)]) -> Result<&'static str> {
    let first = dtypes.first().map(|d| d.1);
    let same = dtypes.iter().all(|d| Some(d.1) == first);
    match first {
        Some(DType::F32) if same => Ok("f32"),
        Some(DType::BF16) if same => Ok("bf16"),
        _ => {
            let got: Vec<String> = dtypes.iter().map(|(w, d)| format!("{w} {d:?}")).collect();
            bail!("{op}: CUDA inputs must all be f32 or all bf16, got {}", got.join(", "))
        }
    }
}

/// One block of `threads` threads per row, with `shared` bytes of dynamic shared memory.
pub(crate) fn per_row(rows: usize, threads: u32, shared: u32) -> Result<LaunchConfig> {
    let rows = u32::try_from(rows).map_err(|_| candle_core::Error::Msg(format!("{rows} rows exceed a CUDA grid")))?;
    Ok(LaunchConfig { grid_dim: (rows.max(1), 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: shared })
}
