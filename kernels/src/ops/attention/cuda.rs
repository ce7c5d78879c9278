//! The CUDA side of [`super::attention`] (feature `cuda`): launches the kernels of `cuda/attention.cu`
//! and `cuda/attention_tc.cu`.
//!
//! What: the forward writes `O (B, Hq, Tq, D)` and the per-row logsumexp `(B, Hq, Tq)` in f32, which the
//! op keeps for its backward; the backward computes `D_i = rowsum(dO_i * O_i)`, then dq, dk, dv into one
//! zeroed f32 buffer laid out like the backward op's output `[dq, dk, dv]` (f32 atomics), rounded once to
//! bf16 when the inputs are bf16. If the saved logsumexp is missing (the forward ran on another backend)
//! or does not fit, the backward recomputes it with the forward kernel.
//!
//! Why here: the CPU op's validation (`check_dims`) and mask data (`Spec`) are shared with the CPU path;
//! this file only adds the head-dimension buckets, the device copies of the mask, the launch geometry and
//! the shared-memory opt-in (the tiles need more than the default 48 KiB).
//!
//! Head dimensions: the kernels are compiled for `DP` in [`HEAD_DIMS`]; a `D` below a bucket runs in it
//! with zero padding (64, 80, 96 and 128 run exactly); `D > 128` is refused with a clear error.
//! Kernels: f32 runs the CUDA-core kernels (`cuda/attention.cu`); bf16 runs their tensor-core (wmma)
//! twins (`cuda/attention_tc.cu`) where the device allows their shared memory (every GPU from sm_80;
//! 110 KiB forward, 154 KiB backward at D 128), else the CUDA-core ones. Measured on an H100 at
//! decoder-3b (T 4096, D 128, causal, bf16): forward 1.36 ms (CUDA cores 3.6), forward + backward
//! kernels 6.7 ms (12.1); PyTorch sdpa flash 0.34 / 1.2 ms.
//! Tests: `tests/cuda/attention.rs`; benchmark: `examples/bench_cuda/attention.rs`.

use super::{Dims, Mask, Spec};
use crate::cuda::{ptx, suffix, wrap};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result};

/// The CUDA-core kernels (`cuda/attention.cu`) and their tensor-core twins for bf16 (`cuda/attention_tc.cu`).
const CORE: (&str, &str) = ("askgui_attention", ptx::ATTENTION);
const TENSOR: (&str, &str) = ("askgui_attention_tc", ptx::ATTENTION_TC);
/// Query and key rows per tile, threads per block: as `BQ`, `BK`, `THREADS` in `attention.cu`.
const BQ: usize = 64;
const BK: usize = 64;
const THREADS: u32 = 256;
/// Warps per block of the tensor-core kernels (`TC_WARPS` in `attention_tc.cu`), 16 rows each.
const TC_WARPS: usize = 4;
/// The head-dimension buckets the kernels are compiled for (`ASKGUI_ATTENTION_DTYPE` in the .cu).
pub const HEAD_DIMS: [usize; 5] = [32, 64, 80, 96, 128];

/// The smallest compiled bucket that holds `d`.
fn bucket(op: &str, d: usize) -> Result<usize> {
    match HEAD_DIMS.iter().find(|&&p| d <= p) {
        Some(&p) if d > 0 => Ok(p),
        _ => bail!("{op}: head dim {d} is not supported by the CUDA kernels (1..=128, compiled for {HEAD_DIMS:?})"),
    }
}

/// Dynamic shared memory in bytes; must equal `fwd_smem_bytes` / `bwd_smem_bytes` in attention.cu and
/// `TcLayout::BYTES` / `TcBwdLayout::BYTES` in attention_tc.cu (the CuPy check script uses the same).
fn fwd_smem(dp: usize) -> usize {
    (BQ * (dp + 1) + BK * (dp + 1) + BQ * (BK + 1)) * 4 + (2 * BQ + BK) * 4
}
fn bwd_smem(dp: usize) -> usize {
    (2 * BQ * (dp + 1) + 2 * BK * (dp + 1) + BK * (BQ + 1)) * 4 + (4 * BQ + BK) * 4
}
/// The tensor-core forward (bf16), `TcLayout::BYTES`: Q, K, V tiles in bf16 (row stride DP + 8), per
/// warp (4) scores f32 (16 x 68), probabilities bf16 (16 x 72) and P V f32 (16 x (DP + 4)).
fn tc_smem(dp: usize) -> usize {
    3 * BQ * (dp + 8) * 2 + TC_WARPS * (16 * (BK + 4) * 4 + 16 * (BK + 8) * 2 + 16 * (dp + 4) * 4) + (2 * BQ + BK) * 4
}
/// The tensor-core backward (bf16), `TcBwdLayout::BYTES`: K, V, Q, dO tiles in bf16, S^T and dP^T in f32
/// (64 x 68), P^T and dS^T in bf16 (64 x 72), a (64 x (DP + 4)) f32 staging area, per-row data.
fn tc_bwd_smem(dp: usize) -> usize {
    4 * BQ * (dp + 8) * 2
        + 2 * BK * (BQ + 4) * 4
        + 2 * BK * (BQ + 8) * 2
        + BQ * (dp + 4) * 4
        + 2 * BQ * 4
        + (2 * BQ + BK) * 4
}

/// The contiguous part of a device buffer that `layout` describes.
fn contiguous<'a, T>(s: &'a CudaSlice<T>, layout: &Layout, op: &str, what: &str) -> Result<CudaView<'a, T>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(s.slice(start..end)),
        None => bail!(
            "{op}: `{what}` must be contiguous, got shape {:?} with strides {:?}",
            layout.shape(),
            layout.stride()
        ),
    }
}

fn int(op: &str, what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{op}: {what} = {x} does not fit the kernels' i32")))
}

/// Sizes as the kernels take them, checked to fit their integer types and the grid.
struct Geometry {
    nb: i32,
    hq: i32,
    hkv: i32,
    tq: i32,
    tk: i32,
    d: i32,
    dp: usize,
}

impl Geometry {
    fn new(op: &str, dims: &Dims) -> Result<Self> {
        let dp = bucket(op, dims.d)?;
        if dims.b * dims.hq > 65535 {
            bail!("{op}: B * Hq = {} * {} exceeds the 65535 blocks of a CUDA grid's y dimension", dims.b, dims.hq)
        }
        // Row indices (bh * Tq + i) are formed in 64 bits in the kernels; single sizes must fit i32.
        Ok(Self {
            nb: int(op, "B", dims.b)?,
            hq: int(op, "Hq", dims.hq)?,
            hkv: int(op, "Hkv", dims.hkv)?,
            tq: int(op, "Tq", dims.tq)?,
            tk: int(op, "Tk", dims.tk)?,
            d: int(op, "D", dims.d)?,
            dp,
        })
    }
}

/// The mask on the device: kind (0 none, 1 causal, 2 block-diagonal), `cu_seqlens` as i32, key padding
/// as u8 `(B, Tk)`. Absent parts are one-element dummies (the kernels never read them).
struct DeviceMask {
    kind: i32,
    cu: CudaSlice<i32>,
    nseg: i32,
    keep: CudaSlice<u8>,
    has_keep: i32,
}

impl DeviceMask {
    fn upload(op: &str, spec: &Spec, dev: &CudaDevice) -> Result<Self> {
        let (kind, cu) = match &spec.mask {
            Mask::None => (0, vec![0]),
            Mask::Causal => (1, vec![0]),
            Mask::BlockDiagonal(cu) => {
                (2, cu.iter().map(|&c| int(op, "a cu_seqlens entry", c)).collect::<Result<Vec<i32>>>()?)
            }
        };
        let nseg = int(op, "the number of segments", cu.len().saturating_sub(1))?;
        let (keep, has_keep) = match &spec.keep {
            Some(k) => (k.iter().map(|&x| x as u8).collect(), 1),
            None => (vec![1u8], 0),
        };
        Ok(Self { kind, cu: dev.clone_htod(&cu)?, nseg, keep: dev.clone_htod(&keep)?, has_keep })
    }
}

/// The most dynamic shared memory a block may opt in to on this device.
fn smem_limit(dev: &CudaDevice) -> Result<usize> {
    let ctx = dev.cuda_stream().context().clone();
    let limit = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).w()?;
    Ok(limit.max(0) as usize)
}

/// Loads `name` and lets it use `bytes` of dynamic shared memory (checked against the device's opt-in
/// limit first, so that a too-small GPU gets a message rather than a launch failure).
fn kernel(op: &str, dev: &CudaDevice, (module, ptx): (&str, &str), name: &str, bytes: usize) -> Result<CudaFunction> {
    let func = dev.get_or_load_custom_func(name, module, ptx)?.into_cuda_function();
    if bytes > 48 * 1024 {
        let limit = smem_limit(dev)?;
        if bytes > limit {
            bail!("{op}: kernel {name} needs {bytes} bytes of shared memory per block, this GPU allows {limit}")
        }
        func.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32).w()?;
    }
    Ok(func)
}

/// Forward launch: `q` rows are `q_stride` elements apart (D for q, 3D for the packed `[q, O, dO]` when
/// the backward recomputes the logsumexp). Returns `(O, lse)`.
#[allow(clippy::too_many_arguments)]
fn launch_forward<T: DeviceRepr>(
    op: &str,
    dev: &CudaDevice,
    dt: &str,
    g: &Geometry,
    m: &DeviceMask,
    scale: f32,
    q: &CudaView<T>,
    q_stride: i32,
    k: &CudaView<T>,
    v: &CudaView<T>,
) -> Result<(CudaSlice<T>, CudaSlice<f32>)> {
    let rows = (g.nb * g.hq) as usize * g.tq as usize;
    // SAFETY: every element of `out` (rows < Tq, columns < D) and of `lse` is written by the kernel
    // before anything reads them (one thread per (row, column); blocks cover every query tile).
    let mut out = unsafe { dev.alloc::<T>(rows * g.d as usize)? };
    let mut lse = unsafe { dev.alloc::<f32>(rows)? };
    if rows == 0 {
        return Ok((out, lse));
    }
    // bf16 runs on tensor cores where the device has the shared memory (every GPU from sm_80 does).
    let (module, name, smem, threads) = if dt == "bf16" && tc_smem(g.dp) <= smem_limit(dev)? {
        (TENSOR, format!("attention_fwd_tc_bf16_{}", g.dp), tc_smem(g.dp), 32 * TC_WARPS as u32)
    } else {
        (CORE, format!("attention_fwd_{dt}_{}", g.dp), fwd_smem(g.dp), THREADS)
    };
    let func = kernel(op, dev, module, &name, smem)?;
    let cfg = LaunchConfig {
        grid_dim: ((g.tq as u32).div_ceil(BQ as u32), (g.nb * g.hq) as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&func);
    b.arg(q).arg(&q_stride).arg(k).arg(v).arg(&mut out).arg(&mut lse).arg(&m.keep).arg(&m.cu).arg(&m.nseg);
    b.arg(&g.hq).arg(&g.hkv).arg(&g.tq).arg(&g.tk).arg(&g.d).arg(&m.kind).arg(&m.has_keep).arg(&scale);
    // SAFETY: the argument list matches `attention_fwd_*` (attention.cu) and `attention_fwd_tc_bf16_*`
    // (attention_tc.cu), which take the same parameters; shapes were validated by `check_dims`, so every
    // index the kernel forms stays inside q, k, v, out, lse, keep and cu.
    unsafe { b.launch(cfg) }.w()?;
    Ok((out, lse))
}

/// The forward: `(O, lse)` for `q`, `k`, `v` (all f32 or all bf16, contiguous).
pub(super) fn forward(
    op: &str,
    spec: &Spec,
    dims: &Dims,
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaSlice<f32>)> {
    let dt = suffix(op, &[("q", s1.dtype()), ("k", s2.dtype()), ("v", s3.dtype())])?;
    let dev = s1.device();
    let g = Geometry::new(op, dims)?;
    let m = DeviceMask::upload(op, spec, dev)?;
    let scale = spec.scale as f32;
    #[allow(clippy::too_many_arguments)]
    fn run<T: DeviceRepr + CudaDType>(
        op: &str,
        dev: &CudaDevice,
        dt: &str,
        g: &Geometry,
        m: &DeviceMask,
        scale: f32,
        (q, l1): (&CudaSlice<T>, &Layout),
        (k, l2): (&CudaSlice<T>, &Layout),
        (v, l3): (&CudaSlice<T>, &Layout),
    ) -> Result<(CudaStorage, CudaSlice<f32>)> {
        let (q, k, v) = (contiguous(q, l1, op, "q")?, contiguous(k, l2, op, "k")?, contiguous(v, l3, op, "v")?);
        let (out, lse) = launch_forward(op, dev, dt, g, m, scale, &q, g.d, &k, &v)?;
        Ok((wrap(out, dev), lse))
    }
    match (&s1.slice, &s2.slice, &s3.slice) {
        (CudaStorageSlice::F32(q), CudaStorageSlice::F32(k), CudaStorageSlice::F32(v)) => {
            run(op, dev, dt, &g, &m, scale, (q, l1), (k, l2), (v, l3))
        }
        (CudaStorageSlice::BF16(q), CudaStorageSlice::BF16(k), CudaStorageSlice::BF16(v)) => {
            run(op, dev, dt, &g, &m, scale, (q, l1), (k, l2), (v, l3))
        }
        _ => bail!("{op}: unreachable dtype combination {dt} (checked above)"),
    }
}

/// The backward: packed `[q, O, dO]` `(B, Hq, Tq, 3D)`, `k`, `v`, and the forward's logsumexp if kept;
/// returns `[dq, dk, dv]` flattened, in the inputs' dtype.
pub(super) fn backward(
    op: &str,
    spec: &Spec,
    dims: &Dims,
    lse: Option<&CudaSlice<f32>>,
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let dt = suffix(op, &[("[q, O, dO]", s1.dtype()), ("k", s2.dtype()), ("v", s3.dtype())])?;
    let dev = s1.device();
    let g = Geometry::new(op, dims)?;
    let m = DeviceMask::upload(op, spec, dev)?;
    let rows = dims.b * dims.hq * dims.tq;
    // A logsumexp of another size belongs to another call: recompute rather than read out of bounds.
    let lse = lse.filter(|l| l.len() == rows);
    let ctx = Ctx { op, dev, dt, g: &g, m: &m, scale: spec.scale as f32, lse };
    match (&s1.slice, &s2.slice, &s3.slice) {
        (CudaStorageSlice::F32(p), CudaStorageSlice::F32(k), CudaStorageSlice::F32(v)) => {
            ctx.backward((p, l1), (k, l2), (v, l3))
        }
        (CudaStorageSlice::BF16(p), CudaStorageSlice::BF16(k), CudaStorageSlice::BF16(v)) => {
            ctx.backward((p, l1), (k, l2), (v, l3))
        }
        _ => bail!("{op}: unreachable dtype combination {dt} (checked above)"),
    }
}

/// What one backward call shares between its launches.
struct Ctx<'a> {
    op: &'a str,
    dev: &'a CudaDevice,
    dt: &'a str,
    g: &'a Geometry,
    m: &'a DeviceMask,
    scale: f32,
    lse: Option<&'a CudaSlice<f32>>,
}

impl Ctx<'_> {
    fn backward<T: DeviceRepr + CudaDType + ValidAsZeroBits>(
        &self,
        (p, l1): (&CudaSlice<T>, &Layout),
        (k, l2): (&CudaSlice<T>, &Layout),
        (v, l3): (&CudaSlice<T>, &Layout),
    ) -> Result<CudaStorage> {
        let (op, dev, g) = (self.op, self.dev, self.g);
        let qod = contiguous(p, l1, op, "[q, O, dO]")?;
        let (k, v) = (contiguous(k, l2, op, "k")?, contiguous(v, l3, op, "v")?);
        let rows = (g.nb * g.hq) as usize * g.tq as usize;
        let (nq, nk) = (rows * g.d as usize, (g.nb * g.hkv) as usize * g.tk as usize * g.d as usize);
        let total = nq + 2 * nk;
        // Zeroed: the kernel accumulates into it with atomicAdd; keys no query sees keep a 0 gradient.
        let mut dacc = self.dev.alloc_zeros::<f32>(total)?;
        if rows > 0 && g.tk > 0 {
            let recomputed;
            let lse = match self.lse {
                Some(l) => l,
                None => {
                    recomputed = launch_forward(op, dev, self.dt, g, self.m, self.scale, &qod, 3 * g.d, &k, &v)?.1;
                    &recomputed
                }
            };
            // D_i = rowsum(dO_i * O_i): one warp per row, 8 rows per block.
            // SAFETY: all `rows` entries are written by the delta kernel before the backward reads them.
            let mut delta = unsafe { dev.alloc::<f32>(rows)? };
            let func = kernel(op, dev, CORE, &format!("attention_delta_{}", self.dt), 0)?;
            let cfg = LaunchConfig {
                grid_dim: (u32::try_from(rows.div_ceil(8)).map_err(|_| int_err(op, rows))?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let (n_rows, d) = (rows as i64, g.d);
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&qod).arg(&mut delta).arg(&n_rows).arg(&d);
            // SAFETY: matches `attention_delta_*`; `qod` holds `rows` rows of 3D elements.
            unsafe { b.launch(cfg) }.w()?;

            let (module, name, smem, threads) = if self.dt == "bf16" && tc_bwd_smem(g.dp) <= smem_limit(dev)? {
                (TENSOR, format!("attention_bwd_tc_bf16_{}", g.dp), tc_bwd_smem(g.dp), 32 * TC_WARPS as u32)
            } else {
                (CORE, format!("attention_bwd_{}_{}", self.dt, g.dp), bwd_smem(g.dp), THREADS)
            };
            let func = kernel(op, dev, module, &name, smem)?;
            let cfg = LaunchConfig {
                grid_dim: ((g.tk as u32).div_ceil(BK as u32), (g.nb * g.hq) as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let m = self.m;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&qod).arg(&k).arg(&v).arg(lse).arg(&delta).arg(&mut dacc).arg(&m.keep).arg(&m.cu).arg(&m.nseg);
            b.arg(&g.nb).arg(&g.hq).arg(&g.hkv).arg(&g.tq).arg(&g.tk).arg(&g.d).arg(&m.kind).arg(&m.has_keep);
            b.arg(&self.scale);
            // SAFETY: matches `attention_bwd_*` and `attention_bwd_tc_bf16_*` (the same parameters); dacc
            // holds dq, dk, dv for the validated shapes.
            unsafe { b.launch(cfg) }.w()?;
        }
        if self.dt == "f32" {
            return Ok(wrap(dacc, dev));
        }
        // SAFETY: the cast kernel writes all `total` elements.
        let mut out = unsafe { dev.alloc::<T>(total)? };
        if total > 0 {
            let func = kernel(op, dev, CORE, "attention_cast_bf16", 0)?;
            let blocks = total.div_ceil(256).min(65535) as u32;
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            let n = total as i64;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&func);
            b.arg(&dacc).arg(&mut out).arg(&n);
            // SAFETY: matches `attention_cast_bf16` (a grid-stride loop over n); only reached for bf16,
            // so `out` holds bf16.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(wrap(out, dev))
    }
}

fn int_err(op: &str, rows: usize) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: {rows} query rows exceed a CUDA grid"))
}
