//! Attention of a sequence's new query rows over its KV cache kept in blocks, read in place.
//!
//! What: [`paged_attention`] computes what [`crate::attention_reference`] computes for `q (1, Hq, T, D)`
//! against the concatenation of the blocks `k_i, v_i (1, Hkv, n_i, D)` under the causal mask (the queries
//! are the last `T` key positions), without concatenating them. [`paged_attention_reference`] is its twin:
//! it concatenates and calls the reference. [`paged_attention_forks`] runs the rows of several forks of
//! one cache in one call, each fork seeing the cache and its own rows only (scoring the options of a
//! constrained choice); its twin runs each fork alone through the reference.
//!
//! Why: a serving step appends one token per sequence; concatenating the cache to attend over it copies
//! every cached key and value of every layer at every step, and a fork that shares its parent's cache
//! would have to copy it too. Blocks are shared by reference instead ([`askgui_model`'s `KvCache`]), and
//! this op reads them where they are.
//!
//! How: one task per query head (rayon), its rows four at a time so that they share each key and value
//! read; an online softmax over steps of at most 128 keys of one block (scores in L1; the serving cache's
//! blocks hold 32 positions, so there a step is a block): scores `(scale q) . k_j` as f32 dot
//! products in 16 partial sums, `exp` vectorised in f32 ([`exp_sum`]), the step's `sum p_j v_j`
//! in f32 registers, and the running sums, rescaled at each step, in f64; rounded to the storage dtype
//! once. Each row folds in only the keys it sees (a `Sight`: the causal end, less the other forks' rows
//! for forks). No GEMM: it is meant for decoding (a few rows); prefills concatenate and take
//! [`super::attention()`]. Forks of more rows than one group concatenate the cache too: the fused forward
//! of [`super::attention()`] over the cache and over the forks' own keys, merged by logsumexp.
//! bf16 blocks are widened to f32 one block at a time. On CUDA tensors (feature `cuda`) the same call runs
//! `cuda/paged_attention.cu` through its launch plan (`crate::plan::paged_attention`), all in f32.
//!
//! Tests: `cargo test -p askgui-kernels --test paged_attention` (the CPU op against its twin), `--features
//! cpu-exec --test emu paged` (the CUDA kernel, executed on the CPU, against the CPU op), and on a GPU
//! `--features cuda --test cuda paged`.

use super::attention::attention_lse;
use super::exp::{exp_sum, max};
use super::f32_slice;
use crate::attention::{attention_reference, AttentionMask};
use candle_core::{bail, DType, Device, Layout, Result, Storage, StorageRef, Tensor};
use rayon::prelude::*;
use std::borrow::Cow;

/// Attention of `q (1, Hq, T, D)` over the keys and values of `blocks` (each `(1, Hkv, n_i, D)`, in
/// order), causal with the queries as the last `T` keys: query row `t` sees keys `0..=L - T + t` where
/// `L = sum n_i`. Returns `(1, Hq, T, D)` in `q`'s dtype. `Hq % Hkv == 0` (GQA); CPU tensors, f32 or bf16.
pub fn paged_attention(q: &Tensor, blocks: &[(Tensor, Tensor)], scale: f64) -> Result<Tensor> {
    let (hkv, lens) = check_blocks(q, blocks)?;
    let (t, total) = (q.dim(2)?, lens.iter().sum::<usize>());
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return cuda::paged_attention(q, blocks, scale);
    }
    // Row i sees the first `total - t + i + 1` keys.
    let sights: Vec<Sight> = (0..t).map(|i| Sight { end: total - t + i + 1, hole: (0, 0) }).collect();
    on_cpu(q, blocks, hkv, &lens, &sights, scale)
}

/// Attention of the rows of several forks of one cached sequence, in one call: `q (1, Hq, T, D)` holds
/// runs of `forks[f]` rows, each of which continues the cache alone, and `new = (k, v)`, each
/// `(1, Hkv, T, D)`, their keys and values, not in the cache. Row `t` of a fork sees every cached key and
/// the fork's own new keys up to `t`, as if that fork alone had been appended to the cache and attended
/// with [`paged_attention`]. Returns `(1, Hq, T, D)` in `q`'s dtype; CPU tensors, f32 or bf16.
///
/// Why: scoring the options of a constrained choice (15 action names) runs one short fork per option
/// over the same prompt; as separate sequences each pays its own attention call and copy of the cache's
/// last block in every layer.
///
/// How: up to four rows (or fewer cached keys than rows), the online softmax of [`paged_attention`]
/// with each row's hole for the other forks; more rows, `forks_by_merge` (the fused forward twice, merged
/// by logsumexp). On CUDA tensors the forks run one [`paged_attention`] call each (the kernel has no
/// forks).
pub fn paged_attention_forks(
    q: &Tensor,
    blocks: &[(Tensor, Tensor)],
    new: (&Tensor, &Tensor),
    forks: &[usize],
    scale: f64,
) -> Result<Tensor> {
    let t = q.dim(2)?;
    if forks.iter().sum::<usize>() != t || forks.contains(&0) || new.0.dim(2)? != t {
        bail!("paged_attention_forks: q {:?} with new keys {:?} split into forks {forks:?}: need forks of at least one row that add up to both", q.dims(), new.0.dims());
    }
    if q.device().is_cuda() {
        return per_fork(q, blocks, new, forks, scale, paged_attention);
    }
    let mut all = blocks.to_vec();
    all.push((new.0.clone(), new.1.clone()));
    let (hkv, lens) = check_blocks(q, &all)?;
    let cached = lens.iter().sum::<usize>() - t;
    if t > ROWS && cached >= t {
        return forks_by_merge(q, blocks, new, forks, scale);
    }
    // Row i of the fork that starts at row s sees the cached keys and new keys s..=i.
    let mut sights = Vec::with_capacity(t);
    for (s, n) in starts(forks) {
        sights.extend((s..s + n).map(|i| Sight { end: cached + i + 1, hole: (cached, cached + s) }));
    }
    on_cpu(q, &all, hkv, &lens, &sights, scale)
}

/// [`paged_attention_forks`] for more rows than one group of [`ROWS`]: every row over the cache in one
/// attention forward (no mask: the GEMM-like fused kernel, whose products pay at this many rows), the
/// forks over their own keys in another (causal, block-diagonal over the forks), and the two merged by
/// their logsumexps, in f64. The cache is concatenated once (the rows of one head must be contiguous).
fn forks_by_merge(
    q: &Tensor,
    blocks: &[(Tensor, Tensor)],
    (k, v): (&Tensor, &Tensor),
    forks: &[usize],
    scale: f64,
) -> Result<Tensor> {
    let (keys, values): (Vec<&Tensor>, Vec<&Tensor>) = blocks.iter().map(|(k, v)| (k, v)).unzip();
    let cached = (Tensor::cat(&keys, 2)?, Tensor::cat(&values, 2)?);
    let (o1, lse1) = attention_lse(q, &cached.0, &cached.1, AttentionMask::None, scale)?;
    let cu: Vec<usize> = std::iter::once(0).chain(starts(forks).map(|(s, n)| s + n)).collect();
    let (o2, lse2) = attention_lse(q, k, v, AttentionMask::CausalBlockDiagonal(&cu), scale)?;
    let d = q.dim(3)?;
    // Row r: o = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2), both finite (every row sees a key of each).
    let mut out = o1;
    for (r, ((o, &a), &b)) in out.chunks_exact_mut(d).zip(&lse1).zip(&lse2).enumerate() {
        let m = a.max(b);
        let (wa, wb) = ((a - m).exp(), (b - m).exp());
        let (wa, wb) = (wa / (wa + wb), wb / (wa + wb));
        o.iter_mut().zip(&o2[r * d..][..d]).for_each(|(x, &y)| *x = (*x as f64 * wa + y as f64 * wb) as f32);
    }
    Tensor::from_vec(out, q.dims(), &Device::Cpu)?.to_dtype(q.dtype())
}

/// The twin of [`paged_attention_forks`]: each fork alone, its keys after the blocks, through
/// [`paged_attention_reference`].
pub fn paged_attention_forks_reference(
    q: &Tensor,
    blocks: &[(Tensor, Tensor)],
    new: (&Tensor, &Tensor),
    forks: &[usize],
    scale: f64,
) -> Result<Tensor> {
    per_fork(q, blocks, new, forks, scale, paged_attention_reference)
}

/// An attention over blocks: [`paged_attention`] or its twin.
type Attend = fn(&Tensor, &[(Tensor, Tensor)], f64) -> Result<Tensor>;

/// `attend` on each fork's rows with its keys and values after `blocks`, the outputs in order.
fn per_fork(
    q: &Tensor,
    blocks: &[(Tensor, Tensor)],
    (k, v): (&Tensor, &Tensor),
    forks: &[usize],
    scale: f64,
    attend: Attend,
) -> Result<Tensor> {
    let mut outs = Vec::with_capacity(forks.len());
    for (s, n) in starts(forks) {
        let mut mine = blocks.to_vec();
        mine.push((k.narrow(2, s, n)?, v.narrow(2, s, n)?));
        outs.push(attend(&q.narrow(2, s, n)?, &mine, scale)?);
    }
    Tensor::cat(&outs, 2)
}

/// `(first row, rows)` of each fork.
fn starts(forks: &[usize]) -> impl Iterator<Item = (usize, usize)> + '_ {
    forks.iter().scan(0, |s, &n| {
        *s += n;
        Some((*s - n, n))
    })
}

/// The CPU op: `q (1, Hq, T, D)` over `blocks` (checked: `Hkv` heads, `lens` positions each), row `i`
/// seeing the keys of `sights[i]`.
fn on_cpu(
    q: &Tensor,
    blocks: &[(Tensor, Tensor)],
    hkv: usize,
    lens: &[usize],
    sights: &[Sight],
    scale: f64,
) -> Result<Tensor> {
    if !matches!(q.device(), Device::Cpu) {
        bail!("paged_attention runs on the CPU and CUDA; concatenate the blocks and call attention() elsewhere");
    }
    let (_, hq, t, d) = q.dims4()?;
    // A narrowed block (a cut prefix) is copied; a contiguous one is shared.
    let blocks = &blocks.iter().map(|(k, v)| Ok((k.contiguous()?, v.contiguous()?))).collect::<Result<Vec<_>>>()?;
    let q32 = q.to_dtype(DType::F32)?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    // The blocks' storages stay read-locked while the slices borrow them: f32 blocks are read in place.
    let keys: Vec<_> = blocks.iter().map(|(k, _)| k.storage_and_layout()).collect();
    let values: Vec<_> = blocks.iter().map(|(_, v)| v.storage_and_layout()).collect();
    let (ks, vs) = (widened(&keys)?, widened(&values)?);
    let rep = hq / hkv;
    let src = Source { keys: &ks, values: &vs, lens, d };
    let mut out = vec![0f32; hq * t * d];
    // One task per query head: its T rows, [`ROWS`] at a time.
    out.par_chunks_mut(t * d).enumerate().for_each(|(h, o)| {
        let rows: Vec<f32> = q32[h * t * d..][..t * d].iter().map(|&x| x * scale as f32).collect();
        for (r0, (qr, or)) in rows.chunks(ROWS * d).zip(o.chunks_mut(ROWS * d)).enumerate() {
            head_rows(&src, h / rep, qr, &sights[r0 * ROWS..], or);
        }
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
/// dtype, keys and values alike, and that `q (1, Hq, T, D)` has `Hq % Hkv == 0` and `1 <= T <= sum n_i`.
fn check_blocks(q: &Tensor, blocks: &[(Tensor, Tensor)]) -> Result<(usize, Vec<usize>)> {
    let (b, hq, t, d) = q.dims4()?;
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
    let Some(hkv) = hkv else { bail!("paged_attention: no cached blocks") };
    let total: usize = lens.iter().sum();
    if b != 1 || t == 0 || t > total || hq % hkv != 0 {
        bail!("paged_attention: q {:?} against {total} cached keys of {hkv} heads: need B = 1, 1 <= T <= keys, Hq % Hkv = 0", q.dims());
    }
    Ok((hkv, lens))
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

/// Query rows that share each key and value read.
const ROWS: usize = 4;
/// Keys per step of the online softmax: their scores stay in L1.
const KEYS: usize = 128;
/// Lanes of the dot products' partial sums (one AVX-512 register of f32).
const LANES: usize = 16;

/// One kv head's cache, block by block, as f32 rows of `d`: key `j` of block `b` for head `g` is row
/// `g * lens[b] + j` of `keys[b]`.
struct Source<'a> {
    keys: &'a [Cow<'a, [f32]>],
    values: &'a [Cow<'a, [f32]>],
    lens: &'a [usize],
    d: usize,
}

/// The keys one query row sees: those before `end`, but for the `hole` `[from, to)` (the rows of other
/// forks; empty for a plain sequence).
#[derive(Clone, Copy, Debug)]
struct Sight {
    end: usize,
    hole: (usize, usize),
}

impl Sight {
    /// The parts of keys `a..b` this row sees, as offsets from `a`: at most two, the one before the hole
    /// and the one after it.
    fn parts(&self, a: usize, b: usize) -> [(usize, usize); 2] {
        let (e, (h0, h1)) = (self.end.min(b), self.hole);
        let part = |x: usize, y: usize| if x < y { (x - a, y - a) } else { (0, 0) };
        [part(a, e.min(h0)), part(a.max(h1), e)]
    }
}

/// Attention of up to [`ROWS`] query rows `q (n, d)` (already scaled) of kv head `g`, row `r` seeing the
/// keys of `sights[r]`. Writes `out (n, d)`.
fn head_rows(src: &Source, g: usize, q: &[f32], sights: &[Sight], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX-512F and FMA, checked just above.
        return unsafe { head_rows_avx512(src, g, q, sights, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA, checked just above.
        return unsafe { head_rows_avx2(src, g, q, sights, out) };
    }
    head_rows_with(src, g, q, sights, out, dot)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn head_rows_avx512(src: &Source, g: usize, q: &[f32], sights: &[Sight], out: &mut [f32]) {
    head_rows_with(src, g, q, sights, out, |a, b| dot_avx512(a, b))
}

/// [`dot`] with one 16-lane register of partial sums for `a.len() % 16 == 0` (the compiler splits
/// [`dot`]'s array into pairs), else [`dot`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    if !a.len().is_multiple_of(16) {
        return dot(a, b);
    }
    let mut acc = _mm512_setzero_ps();
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        // SAFETY: both chunks hold 16 f32.
        let (x, y) = unsafe { (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(y.as_ptr())) };
        acc = _mm512_fmadd_ps(x, y, acc);
    }
    _mm512_reduce_add_ps(acc)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn head_rows_avx2(src: &Source, g: usize, q: &[f32], sights: &[Sight], out: &mut [f32]) {
    head_rows_with(src, g, q, sights, out, dot)
}

/// [`head_rows`] with the dot product `dot`: an online softmax over steps of [`KEYS`] keys. Scores and the
/// step's `sum p v` in f32 (fused multiply-adds); the running sums, rescaled at each step, in f64. The
/// builds differ only in the dot product's order of additions (within the tests' 1e-6 of scale).
#[inline(always)]
fn head_rows_with(
    src: &Source,
    g: usize,
    q: &[f32],
    sights: &[Sight],
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    let d = src.d;
    let n = q.len() / d;
    let (mut m, mut l) = ([f32::NEG_INFINITY; ROWS], [0f64; ROWS]);
    let mut acc = vec![0f64; n * d];
    let (mut s, mut part) = ([[0f32; KEYS]; ROWS], vec![0f32; d]);
    let last = sights[..n].iter().map(|s| s.end).max().unwrap_or(0);
    let mut j0 = 0;
    for ((kb, vb), &len) in src.keys.iter().zip(src.values).zip(src.lens) {
        let (kb, vb) = (&kb[g * len * d..][..len * d], &vb[g * len * d..][..len * d]);
        let stop = len.min(last - j0);
        for c in (0..stop).step_by(KEYS) {
            let keys = KEYS.min(stop - c);
            for (r, sr) in s.iter_mut().enumerate().take(n) {
                let qr = &q[r * d..][..d];
                for (j, k) in kb[c * d..][..keys * d].chunks_exact(d).enumerate() {
                    sr[j] = dot(qr, k);
                }
            }
            for r in 0..n {
                // Keys j0 + c + j with j in a part are visible to row r.
                for (lo, hi) in sights[r].parts(j0 + c, j0 + c + keys) {
                    if lo == hi {
                        continue;
                    }
                    let p = &mut s[r][lo..hi];
                    let m_new = max(p).max(m[r]);
                    let rescale = ((m[r] - m_new) as f64).exp();
                    let step_sum = exp_sum(p, m_new);
                    weighted_values(p, &vb[(c + lo) * d..], &mut part);
                    l[r] = l[r] * rescale + step_sum;
                    acc[r * d..][..d].iter_mut().zip(&part).for_each(|(a, &x)| *a = *a * rescale + x as f64);
                    m[r] = m_new;
                }
            }
        }
        j0 += len;
        if j0 >= last {
            break;
        }
    }
    for r in 0..n {
        out[r * d..][..d].iter_mut().zip(&acc[r * d..][..d]).for_each(|(o, &a)| *o = (a / l[r]) as f32);
    }
}

/// `out (d) = sum_j p_j v_j` over the rows `v_j` of `values (.., d)`, [`LANES`] columns at a time in a
/// fixed-size array, so that the sums stay in registers.
#[inline(always)]
fn weighted_values(p: &[f32], values: &[f32], out: &mut [f32]) {
    let d = out.len();
    let mut o = out.chunks_exact_mut(LANES);
    let row = |j: usize, c: usize| -> &[f32; LANES] { values[j * d + c * LANES..][..LANES].try_into().expect("LANES") };
    for (c, o) in o.by_ref().enumerate() {
        // Four independent sums (keys j mod 4), so that the adds do not wait on each other.
        let mut lanes = [[0f32; LANES]; 4];
        let whole = p.len() / 4 * 4;
        for j in (0..whole).step_by(4) {
            for (u, sum) in lanes.iter_mut().enumerate() {
                let v = row(j + u, c);
                for l in 0..LANES {
                    sum[l] = p[j + u].mul_add(v[l], sum[l]);
                }
            }
        }
        for (j, &pj) in p.iter().enumerate().skip(whole) {
            let v = row(j, c);
            for l in 0..LANES {
                lanes[0][l] = pj.mul_add(v[l], lanes[0][l]);
            }
        }
        for l in 0..LANES {
            o[l] = (lanes[0][l] + lanes[1][l]) + (lanes[2][l] + lanes[3][l]);
        }
    }
    let rest = o.into_remainder();
    let c0 = d - rest.len();
    rest.fill(0.0);
    for (j, &pj) in p.iter().enumerate() {
        rest.iter_mut().zip(&values[j * d + c0..][..d - c0]).for_each(|(a, &x)| *a = pj.mul_add(x, *a));
    }
}

/// `a . b` in f32, in [`LANES`] partial sums (fused multiply-adds) added in a fixed tree.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = ca.remainder().iter().zip(cb.remainder()).fold(0f32, |t, (&x, &y)| x.mul_add(y, t));
    for (x, y) in ca.zip(cb) {
        let (x, y): (&[f32; LANES], &[f32; LANES]) = (x.try_into().expect("LANES"), y.try_into().expect("LANES"));
        for l in 0..LANES {
            lanes[l] = x[l].mul_add(y[l], lanes[l]);
        }
    }
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            lanes[l] += lanes[l + w];
        }
    }
    lanes[0] + tail
}
