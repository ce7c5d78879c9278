//! Attention of a sequence's new query rows over its KV cache kept in blocks, read in place.
//!
//! What: [`paged_attention`] computes what [`crate::attention_reference`] computes for `q (1, Hq, T, D)`
//! against the concatenation of the blocks `k_i, v_i (1, Hkv, n_i, D)` under the causal mask (the queries
//! are the last `T` key positions), without concatenating them. [`paged_attention_reference`] is its twin:
//! it concatenates and calls the reference.
//!
//! Why: a serving step appends one token per sequence; concatenating the cache to attend over it copies
//! every cached key and value of every layer at every step, and a fork that shares its parent's cache
//! would have to copy it too. Blocks are shared by reference instead ([`askgui_model`'s `KvCache`]), and
//! this op reads them where they are.
//!
//! How: one task per query head and row (rayon); scores `scale q . k_j` (f64 dot products in eight partial
//! sums, kept in f32) over the visible keys of every block, `exp` vectorised in f32 ([`exp_shifted_f32`])
//! with the sum in f64, `sum p_j v_j` in f64, rounded to the storage dtype once. No
//! GEMM: it is meant for decoding (a few rows); prefills concatenate and take [`super::attention()`].
//! bf16 blocks are widened to f32 one block at a time. On CUDA tensors (feature `cuda`) the same call runs
//! `cuda/paged_attention.cu` through its launch plan (`crate::plan::paged_attention`), all in f32.
//!
//! Tests: `cargo test -p askgui-kernels --test paged_attention` (the CPU op against its twin), `--features
//! cpu-exec --test emu paged` (the CUDA kernel, executed on the CPU, against the CPU op), and on a GPU
//! `--features cuda --test cuda paged`.

use super::exp::{exp_shifted_f32, split_shift};
use super::f32_slice;
use crate::attention::{attention_reference, AttentionMask};
use candle_core::{bail, DType, Device, Layout, Result, Storage, StorageRef, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;

/// Attention of `q (1, Hq, T, D)` over the keys and values of `blocks` (each `(1, Hkv, n_i, D)`, in
/// order), causal with the queries as the last `T` keys: query row `t` sees keys `0..=L - T + t` where
/// `L = sum n_i`. Returns `(1, Hq, T, D)` in `q`'s dtype. `Hq % Hkv == 0` (GQA); CPU tensors, f32 or bf16.
pub fn paged_attention(q: &Tensor, blocks: &[(Tensor, Tensor)], scale: f64) -> Result<Tensor> {
    let (b, hq, t, d) = q.dims4()?;
    let (hkv, lens) = check_blocks(q, blocks)?;
    let total: usize = lens.iter().sum();
    if b != 1 || t == 0 || t > total || hq % hkv != 0 {
        bail!("paged_attention: q {:?} against {total} cached keys of {hkv} heads: need B = 1, 1 <= T <= keys, Hq % Hkv = 0", q.dims());
    }
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return cuda::paged_attention(q, blocks, scale);
    }
    if !matches!(q.device(), Device::Cpu) {
        bail!("paged_attention runs on the CPU and CUDA; concatenate the blocks and call attention() elsewhere");
    }
    // A narrowed block (a cut prefix) is copied; a contiguous one is shared.
    let blocks = &blocks.iter().map(|(k, v)| Ok((k.contiguous()?, v.contiguous()?))).collect::<Result<Vec<_>>>()?;
    let q32 = q.to_dtype(DType::F32)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    // The blocks' storages stay read-locked while the slices borrow them: f32 blocks are read in place.
    let keys: Vec<_> = blocks.iter().map(|(k, _)| k.storage_and_layout()).collect();
    let values: Vec<_> = blocks.iter().map(|(_, v)| v.storage_and_layout()).collect();
    let (ks, vs) = (widened(&keys)?, widened(&values)?);
    let rep = hq / hkv;
    let mut out = vec![0f32; hq * t * d];
    out.par_chunks_mut(d).enumerate().for_each(|(row, o)| {
        let (h, i) = (row / t, row % t);
        let g = h / rep;
        let qr = &q32[row * d..][..d];
        let visible = total - t + i + 1;
        // Scores of the visible keys, block by block: key j of block `n` is row j of head g there.
        let mut s: Vec<f32> = Vec::with_capacity(visible);
        for (kb, &n) in ks.iter().zip(&lens) {
            let take = n.min(visible - s.len());
            s.extend((0..take).map(|j| (scale * dot(qr, &kb[(g * n + j) * d..][..d])) as f32));
            if s.len() == visible {
                break;
            }
        }
        let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (hi, lo) = split_shift(m as f64);
        exp_shifted_f32(&mut s, hi, lo);
        let l = sum(&s);
        let mut acc = vec![0f64; d];
        let mut j0 = 0;
        for (vb, &n) in vs.iter().zip(&lens) {
            let take = n.min(visible - j0);
            for (j, &p) in s[j0..j0 + take].iter().enumerate() {
                let vr = &vb[(g * n + j) * d..][..d];
                acc.iter_mut().zip(vr).for_each(|(a, &x)| *a += p as f64 * x as f64);
            }
            j0 += take;
            if j0 == visible {
                break;
            }
        }
        o.iter_mut().zip(&acc).for_each(|(o, a)| *o = (a / l) as f32);
    });
    // (Hq * T * D) -> (1, Hq, T, D)
    Tensor::from_vec(out, (1, hq, t, d), &Device::Cpu)?.to_dtype(q.dtype())
}

/// The CUDA path: the launch plan of `cuda/paged_attention.cu` (`crate::plan::paged_attention`), run as a
/// CustomOp on `q` that reads the blocks' storages in place, narrowed views included.
#[cfg(feature = "cuda")]
mod cuda {
    use crate::ops::gpu;
    use crate::plan::paged_attention::{self as plan, Block};
    use candle_core::backend::BackendStorage;
    use candle_core::{bail, CudaStorage, CustomOp1, Layout, Result, Shape, Storage, Tensor};

    pub(super) fn paged_attention(q: &Tensor, blocks: &[(Tensor, Tensor)], scale: f64) -> Result<Tensor> {
        let d = q.dim(3)?;
        // Rows of D contiguous and heads apart (a block narrowed along its positions is), keys and values
        // laid out alike: else a copy of that block.
        let rows = |t: &Tensor| {
            let (s, n) = (t.stride(), t.dim(2).unwrap_or(0));
            s[3] == 1 && (n == 1 || s[2] == d) && s[1] >= n * d
        };
        let blocks = blocks
            .iter()
            .map(|(k, v)| match rows(k) && rows(v) && k.stride()[1] == v.stride()[1] {
                true => Ok((k.clone(), v.clone())),
                false => Ok((k.contiguous()?, v.contiguous()?)),
            })
            .collect::<Result<Vec<_>>>()?;
        q.contiguous()?.apply_op1_no_bwd(&Paged { blocks, scale })
    }

    struct Paged {
        blocks: Vec<(Tensor, Tensor)>,
        scale: f64,
    }

    impl CustomOp1 for Paged {
        fn name(&self) -> &'static str {
            "paged_attention"
        }

        fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
            bail!("paged_attention: the CUDA op was given a CPU tensor")
        }

        fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
            let op = self.name();
            let (_, hq, t, d) = l.shape().dims4()?;
            let hkv = self.blocks[0].0.dim(1)?;
            // check_blocks made every block's dtype q's.
            let elem = gpu::elem(op, &[("q", s.dtype())])?;
            let layout = |k: &Tensor| Ok(Block { len: k.dim(2)?, head_stride: k.stride()[1] });
            let blocks: Vec<Block> = self.blocks.iter().map(|(k, _)| layout(k)).collect::<Result<_>>()?;
            let plan = plan::forward((hq, hkv, t, d), &blocks, self.scale, elem)?;
            // The blocks' storages stay read-locked while the kernel's inputs borrow them.
            let locked: Vec<_> =
                self.blocks.iter().flat_map(|(k, v)| [k.storage_and_layout(), v.storage_and_layout()]).collect();
            let mut inputs = vec![gpu::input(op, "q", (s, l))?];
            for (storage, layout) in &locked {
                match &**storage {
                    Storage::Cuda(c) => inputs.push((c, layout.start_offset())),
                    _ => bail!("{op}: q is on a CUDA device and a cached block is not"),
                }
            }
            let out = gpu::single(op, gpu::run(&plan, &inputs)?)?;
            Ok((out, l.shape().clone()))
        }
    }
}

/// The twin: the blocks concatenated, then [`attention_reference`] under the causal mask.
pub fn paged_attention_reference(q: &Tensor, blocks: &[(Tensor, Tensor)], scale: f64) -> Result<Tensor> {
    let k = Tensor::cat(&blocks.iter().map(|(k, _)| k).collect::<Vec<_>>(), 2)?;
    let v = Tensor::cat(&blocks.iter().map(|(_, v)| v).collect::<Vec<_>>(), 2)?;
    attention_reference(q, &k, &v, AttentionMask::Causal, None, scale)
}

/// `(Hkv, n_i per block)`, after checking that every block is `(1, Hkv, n, D)` with `D` of `q`, in `q`'s
/// dtype, keys and values alike.
fn check_blocks(q: &Tensor, blocks: &[(Tensor, Tensor)]) -> Result<(usize, Vec<usize>)> {
    let d = q.dim(3)?;
    let mut hkv = None;
    let mut lens = Vec::with_capacity(blocks.len());
    for (i, (k, v)) in blocks.iter().enumerate() {
        let (b, h, n, dk) = k.dims4()?;
        if b != 1
            || dk != d
            || v.dims() != k.dims()
            || *hkv.get_or_insert(h) != h
            || k.dtype() != q.dtype()
            || v.dtype() != q.dtype()
        {
            bail!(
                "paged_attention: block {i} k {:?} {:?}, v {:?} {:?} does not fit q {:?} {:?} (blocks (1, Hkv, n, D) in q's dtype)",
                k.dims(), k.dtype(), v.dims(), v.dtype(), q.dims(), q.dtype()
            );
        }
        lens.push(n);
    }
    match hkv {
        Some(h) => Ok((h, lens)),
        None => bail!("paged_attention: no cached blocks"),
    }
}

/// Each locked block storage as a contiguous f32 slice: borrowed for f32, widened for bf16.
fn widened<'a>(locked: &'a [(StorageRef<'a>, &'a Layout)]) -> Result<Vec<Cow<'a, [f32]>>> {
    locked
        .iter()
        .map(|(storage, layout)| match &**storage {
            Storage::Cpu(cpu) => f32_slice(cpu, layout, "paged_attention", "block"),
            _ => bail!("paged_attention: a block is not on the CPU"),
        })
        .collect()
}

/// Independent partial sums, so that the reductions vectorise (a chain of dependent f64 additions cannot
/// be reordered by the compiler).
const LANES: usize = 8;

/// `a . b` in f64, in [`LANES`] partial sums.
fn dot(a: &[f32], b: &[f32]) -> f64 {
    let mut lanes = [0f64; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(&x, &y)| x as f64 * y as f64).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            lanes[l] += x[l] as f64 * y[l] as f64;
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// The sum of `xs` in f64, in [`LANES`] partial sums.
fn sum(xs: &[f32]) -> f64 {
    let mut lanes = [0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail: f64 = chunks.remainder().iter().map(|&x| x as f64).sum();
    for c in chunks {
        lanes.iter_mut().zip(c).for_each(|(l, &x)| *l += x as f64);
    }
    lanes.iter().sum::<f64>() + tail
}
