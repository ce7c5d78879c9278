//! The GPU transport of data parallelism: NCCL through cudarc, one communicator per rank on the rank's
//! own GPU and candle's stream. Behind the cargo feature `nccl`, apart from `cuda`, because it links
//! `libnccl`, which a single-GPU build should not need.
//!
//! The collectives take host buffers, like the MPI ones, so the training loop has one path: a buffer is
//! copied to the GPU, reduced there by NCCL (NVLink, PCIe or the network) and copied back. For LoRA the
//! gradients are a few MB per step; full training pays two extra copies of its gradients per step.
//!
//! Run on one H100 (2026-11-27) only as far as one GPU allows: two ranks exchanged the id over the
//! rendezvous, and NCCL refused two ranks on one device, so both exited with that error within a second.
//! No collective has run on GPUs: it compiles in CI's CUDA check (`.ci/cuda-check`).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DeviceRepr};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};

use crate::distributed::DistributedError;

type Result<T> = std::result::Result<T, DistributedError>;

/// The size of an NCCL unique id, the one thing ranks exchange before the communicator exists.
pub const ID_BYTES: usize = 128;

fn error(what: &str, e: impl std::fmt::Debug) -> DistributedError {
    DistributedError::Nccl(format!("{what}: {e:?}"))
}

/// An NCCL failure in NCCL's own words: the result code and NCCL's last error message, for instance
/// "ncclInvalidUsage: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000" (cudarc's
/// `Debug` says "NcclError" and nothing else).
fn nccl_error(what: &str, e: NcclError) -> DistributedError {
    // SAFETY: ncclGetLastError(NULL) returns NULL or a NUL-terminated string in a buffer NCCL owns, which
    // lives as long as the library; it is copied at once.
    let last = unsafe {
        let p = cudarc::nccl::sys::ncclGetLastError(std::ptr::null_mut());
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().trim().to_string()
        }
    };
    DistributedError::Nccl(format!(
        "{what}: {:?}{}",
        e.0,
        if last.is_empty() { String::new() } else { format!(": {last}") }
    ))
}

/// A fresh NCCL unique id (rank 0 makes it; the others receive it through MPI or the rendezvous).
pub fn new_id() -> Result<[u8; ID_BYTES]> {
    let id = Id::new().map_err(|e| nccl_error("ncclGetUniqueId (is libnccl installed?)", e))?;
    Ok(id.internal().map(|c| c as u8))
}

/// The GPU ordinal of a rank with local rank `local_rank`: that GPU of the node, or the only one when the
/// launcher gave each rank one GPU (`CUDA_VISIBLE_DEVICES` per rank, as `srun --gpus-per-task=1` does).
pub fn device_ordinal(local_rank: usize) -> Result<usize> {
    let count = CudaContext::device_count().map_err(|e| error("counting CUDA devices", e))? as usize;
    match count {
        0 => Err(DistributedError::Nccl("no CUDA device is visible to this rank".into())),
        1 => Ok(0),
        n if local_rank < n => Ok(local_rank),
        n => Err(DistributedError::Nccl(format!(
            "local rank {local_rank} has no GPU of its own: this node shows {n}; start at most {n} ranks per node"
        ))),
    }
}

/// One rank's NCCL communicator.
pub struct Nccl {
    comm: Comm,
    stream: Arc<CudaStream>,
}

impl Nccl {
    /// Joins the communicator of `size` ranks named by `id`, on `stream` (candle's stream of this rank's
    /// GPU). Blocks until every rank has joined.
    pub fn connect(stream: Arc<CudaStream>, rank: usize, size: usize, id: [u8; ID_BYTES]) -> Result<Nccl> {
        let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), rank, size, id).map_err(|e| nccl_error("ncclCommInitRank", e))?;
        Ok(Nccl { comm, stream })
    }

    /// Sums `buf` over all ranks, in place, through the GPU.
    pub fn all_reduce_sum<T: NcclType + DeviceRepr + Copy>(&self, buf: &mut [T]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut device = self.stream.clone_htod(buf).map_err(|e| error("copy to the GPU", e))?;
        self.comm.all_reduce_in_place(&mut device, &ReduceOp::Sum).map_err(|e| nccl_error("ncclAllReduce", e))?;
        self.stream.memcpy_dtoh(&device, buf).map_err(|e| error("copy from the GPU", e))?;
        self.stream.synchronize().map_err(|e| error("synchronize", e))
    }

    /// Every rank's `x`, in rank order.
    pub fn all_gather_u64(&self, x: u64, size: usize) -> Result<Vec<u64>> {
        let send = self.stream.clone_htod(&[x]).map_err(|e| error("copy to the GPU", e))?;
        let mut all = self.stream.alloc_zeros::<u64>(size).map_err(|e| error("alloc", e))?;
        self.comm.all_gather(&send, &mut all).map_err(|e| nccl_error("ncclAllGather", e))?;
        let all = self.stream.clone_dtoh(&all).map_err(|e| error("copy from the GPU", e))?;
        self.stream.synchronize().map_err(|e| error("synchronize", e))?;
        Ok(all)
    }

    /// Waits until every rank has called it (an all-reduce of one value).
    pub fn barrier(&self) -> Result<()> {
        self.all_reduce_sum(&mut [0u8])
    }
}
