//! Rotary position embedding ("rotate half", as Qwen2 / transformers) as a candle CustomOp with an
//! explicit backward. candle's `rotary_emb::rope*` have no backward (the gradient silently stops there).
//!
//! The reference is [`crate::rope_reference`]: `y = x * cos + rotate_half(x) * sin` with
//! `rotate_half([x1, x2]) = [-x2, x1]`, i.e. per pair `(i, i + D/2)`:
//!
//! ```text
//! y1 = x1 * cos1 - x2 * sin1        y2 = x2 * cos2 + x1 * sin2
//! ```
//!
//! Backward: `y = (diag(cos) + diag(sin) R) x` with `R = rotate_half`, so `dx = cos * g + R^T (sin * g)`
//! and `R^T [v1, v2] = [v2, -v1] = -rotate_half(v)`:
//!
//! ```text
//! dx1 = g1 * cos1 + g2 * sin2       dx2 = g2 * cos2 - g1 * sin1
//! ```
//!
//! (with the usual tables, `cos1 = cos2` and `sin1 = sin2`, this is the rotation by minus the angle).
//!
//! One op serves the decoder and the vision tower: M-RoPE is this same rotation with tables from
//! [`crate::mrope_cos_sin_reference`], the vision 2D rotary uses tables from
//! [`crate::vision_rope_cos_sin_reference`]. Layouts: text `x (B, H, T, D)` with tables `(B, 1, T, D)`
//! (or `(T, D)`, or `(B, T, D)` where that broadcasts, i.e. `B = 1`), vision `x (P, H, D)` with tables
//! `(P, 1, D)`.
//!
//! Broadcasting follows `rope_reference` (numpy rules, right-aligned), with one restriction: the tables
//! must broadcast *to the shape of x* (the output has x's shape; a table that would enlarge x is refused),
//! and their last dimension must be `D` itself. Tables are never materialised at x's size: the kernel
//! reads them through stride-0 views.
//!
//! `cos` and `sin` are constants: the tables are a fixed function of positions and are never trained, so
//! `bwd` returns `None` for them always, and the wrapper detaches them, so that they get no `GradStore`
//! entry even when they are `Var`s (or computed from `Var`s). CPU kernels accept f32, f64 and bf16 (x
//! and tables of one dtype; bf16 widened to f32, rounded once on output) and compute each element in f64. Tests: `cargo test -p askgui-kernels --test grad_rope -- --nocapture`.
//!
//! CUDA (feature `cuda`, kernel in `cuda/rope.cu`): f32 or bf16 storage (x and tables of one dtype), math
//! in f32, one thread per pair; the tables are read through their broadcast strides, passed by value
//! (size-1 dims dropped, mergeable neighbours merged, at most 6 leading dims left). The backward is the
//! same op in the transpose direction, so it runs on the GPU too. GPU tests:
//! `cargo test -p askgui-kernels --features cuda --test cuda -- norm_rope_ce::rope`.

use super::{contiguous_slice, f32_slice, Float};
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, WithDType};
#[cfg(feature = "cuda")]
use {super::gpu, candle_core::backend::BackendStorage, candle_core::CudaStorage};

/// Forward (`y = x cos + rotate_half(x) sin`) or its transpose (`dx = g cos - rotate_half(g sin)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Forward,
    Transpose,
}

struct Rope {
    dir: Direction,
}

/// For every row (all indices but the last) of a tensor of shape `dims`, the storage offset of that row's
/// start in a table laid out by `table` (a stride-0 broadcast view of shape `dims`, last stride 1).
fn row_offsets(dims: &[usize], table: &Layout) -> Vec<usize> {
    let lead = &dims[..dims.len() - 1];
    let stride = &table.stride()[..lead.len()];
    let rows: usize = lead.iter().product();
    let mut idx = vec![0usize; lead.len()];
    let mut out = Vec::with_capacity(rows);
    for _ in 0..rows {
        out.push(table.start_offset() + idx.iter().zip(stride).map(|(i, s)| i * s).sum::<usize>());
        for k in (0..idx.len()).rev() {
            idx[k] += 1;
            if idx[k] < lead[k] {
                break;
            }
            idx[k] = 0;
        }
    }
    out
}

/// Checks x (contiguous, even last dim) and the broadcast views of the tables; returns the head dim.
fn check_layouts(op: &str, x: &Layout, cos: &Layout, sin: &Layout) -> Result<usize> {
    let dims = x.shape().dims();
    let Some(&d) = dims.last() else { bail!("{op}: x must have at least one dimension, got shape {:?}", x.shape()) };
    if d % 2 != 0 {
        bail!("{op}: the head dim (last dim of x) must be even, got x {:?}", x.shape())
    }
    if !x.is_contiguous() {
        bail!("{op}: x must be contiguous, got shape {:?} with strides {:?}", x.shape(), x.stride())
    }
    for (name, l) in [("cos", cos), ("sin", sin)] {
        if l.shape() != x.shape() || l.stride().last().is_some_and(|&s| s != 1) {
            bail!(
                "{op}: `{name}` must be a view of x's shape {:?} with unit last stride, got {:?} strides {:?}",
                x.shape(),
                l.shape(),
                l.stride()
            )
        }
    }
    Ok(d)
}

fn rope_kernel<T: WithDType>(
    x: &[T],
    (cos, cos_rows): (&[T], &[usize]),
    (sin, sin_rows): (&[T], &[usize]),
    d: usize,
    dir: Direction,
) -> Vec<T> {
    let h = d / 2;
    let mut y = vec![T::zero(); x.len()];
    if d == 0 {
        return y;
    }
    for ((xr, yr), (&co, &so)) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).zip(cos_rows.iter().zip(sin_rows)) {
        let (c, s) = (&cos[co..co + d], &sin[so..so + d]);
        for i in 0..h {
            let (x1, x2) = (xr[i].to_f64(), xr[i + h].to_f64());
            let (c1, c2, s1, s2) = (c[i].to_f64(), c[i + h].to_f64(), s[i].to_f64(), s[i + h].to_f64());
            let (y1, y2) = match dir {
                Direction::Forward => (x1 * c1 - x2 * s1, x2 * c2 + x1 * s2),
                Direction::Transpose => (x1 * c1 + x2 * s2, x2 * c2 - x1 * s1),
            };
            yr[i] = T::from_f64(y1);
            yr[i + h] = T::from_f64(y2);
        }
    }
    y
}

/// The span of storage a (possibly broadcast) table view reads, as a contiguous layout, and each row's
/// offset into that span.
fn table_span(l: &Layout, dims: &[usize]) -> (Layout, Vec<usize>) {
    let (start, d) = (l.start_offset(), dims.last().copied().unwrap_or(0));
    let rows = row_offsets(dims, l);
    let end = rows.iter().max().map_or(start, |&r| r + d);
    (Layout::contiguous_with_offset(end - start, start), rows.into_iter().map(|r| r - start).collect())
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        match self.dir {
            Direction::Forward => "rope",
            Direction::Transpose => "rope_bwd",
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let d = check_layouts(name, l1, l2, l3)?;
        let dims = l1.shape().dims();
        let ((cl, cr), (sl, sr)) = (table_span(l2, dims), table_span(l3, dims));
        let y = match Float::of(name, &[("x", s1, l1), ("cos", s2, l2), ("sin", s3, l3)])? {
            Float::F64 => {
                let x = contiguous_slice::<f64>(s1, l1, name, "x")?;
                let (c, s) = (contiguous_slice(s2, &cl, name, "cos")?, contiguous_slice(s3, &sl, name, "sin")?);
                f64::to_cpu_storage_owned(rope_kernel(x, (c, &cr), (s, &sr), d, self.dir))
            }
            Float::F32(out) => {
                let x = f32_slice(s1, l1, name, "x")?;
                let (c, s) = (f32_slice(s2, &cl, name, "cos")?, f32_slice(s3, &sl, name, "sin")?);
                out.store(rope_kernel(&x, (&c, &cr), (&s, &sr), d, self.dir))
            }
        };
        Ok((y, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let d = check_layouts(name, l1, l2, l3)?;
        crate::cuda::suffix(name, &[("x", s1.dtype()), ("cos", s2.dtype()), ("sin", s3.dtype())])?;
        let y = gpu::dispatch!(name, s1, gpu_rope::run(self.dir, d, (s1, l1), (s2, l2), (s3, l3)))?;
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The tables are never trained: no gradient for cos and sin, ever.
        if self.dir != Direction::Forward || !x.track_op() {
            return Ok((None, None, None));
        }
        let dx = grad.contiguous()?.apply_op3_no_bwd(cos, sin, &Rope { dir: Direction::Transpose })?;
        Ok((Some(dx), None, None))
    }
}

/// Checks that `table` broadcasts to `x` (right-aligned, sizes equal or 1, last dim equal to D) and
/// returns it detached, contiguous and viewed (stride 0, no copy) at x's shape.
fn broadcast_table(name: &str, table: &Tensor, x: &Tensor) -> Result<Tensor> {
    let (xd, td) = (x.dims(), table.dims());
    let ok = td.len() <= xd.len()
        && td.last() == xd.last()
        && td.iter().rev().zip(xd.iter().rev()).all(|(&t, &x)| t == x || t == 1);
    if !ok {
        bail!(
            "rope: `{name}` {td:?} must broadcast to x {xd:?} (right-aligned, each dim equal or 1, last dim equal \
             to the head dim {})",
            xd.last().copied().unwrap_or(0)
        )
    }
    table.detach().contiguous()?.broadcast_as(xd)
}

/// Rotary embedding of `x (.., D)` (D even) with tables `cos`, `sin` that broadcast to x's shape:
/// `x * cos + rotate_half(x) * sin`, as [`crate::rope_reference`]. Gradient for `x` only: the tables are
/// detached and never get a `GradStore` entry.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if let Some(&d) = x.dims().last() {
        if d % 2 != 0 {
            bail!("rope: the head dim (last dim of x) must be even, got x {:?}", x.dims())
        }
    } else {
        bail!("rope: x must have at least one dimension, got shape {:?}", x.dims())
    }
    let (c, s) = (broadcast_table("cos", cos, x)?, broadcast_table("sin", sin, x)?);
    x.contiguous()?.apply_op3(&c, &s, Rope { dir: Direction::Forward })
}

/// The CUDA launch of the rotation (kernel in `cuda/rope.cu`).
#[cfg(feature = "cuda")]
mod gpu_rope {
    use super::super::gpu::{kernel, to_i32, Elem, Module};
    use super::Direction;
    use crate::cuda::{view, wrap};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{bail, CudaStorage, Layout, Result};

    type In<'a> = (&'a CudaStorage, &'a Layout);

    /// Leading dims the kernel can index (`ROPE_MAX_LEAD` in rope.cu).
    const MAX_LEAD: usize = 6;

    /// x's leading dims and the tables' strides along them; the layout of `RopeIdx` in rope.cu.
    #[repr(C)]
    #[derive(Clone, Copy, Debug, Default)]
    struct RopeIdx {
        rank: u32,
        pad: u32,
        dims: [u64; MAX_LEAD],
        cos_stride: [u64; MAX_LEAD],
        sin_stride: [u64; MAX_LEAD],
    }

    // SAFETY: a plain #[repr(C)] struct of integers (no pointers, no padding the kernel reads), laid out
    // as the `RopeIdx` kernel parameter in rope.cu (152 bytes, 8-aligned).
    unsafe impl DeviceRepr for RopeIdx {}

    /// Leading dims of x (all but the last) with the tables' strides: size-1 dims dropped, and a dim merged
    /// into its outer neighbour when both tables allow (outer stride = inner stride * inner size).
    fn index(op: &str, x: &Layout, cos: &Layout, sin: &Layout) -> Result<RopeIdx> {
        let dims = x.shape().dims();
        let lead = dims.len() - 1;
        let (cs, ss) = (&cos.stride()[..lead], &sin.stride()[..lead]);
        let mut merged: Vec<(usize, usize, usize)> = Vec::with_capacity(lead);
        for k in 0..lead {
            let (n, c, s) = (dims[k], cs[k], ss[k]);
            if n == 1 {
                continue;
            }
            match merged.last_mut() {
                Some(last) if last.1 == c * n && last.2 == s * n => *last = (last.0 * n, c, s),
                _ => merged.push((n, c, s)),
            }
        }
        if merged.len() > MAX_LEAD {
            bail!(
                "{op}: the CUDA kernel indexes at most {MAX_LEAD} leading dims; x {:?} with table strides {:?} / \
                 {:?} leaves {}",
                x.shape(),
                cos.stride(),
                sin.stride(),
                merged.len()
            )
        }
        let mut idx = RopeIdx { rank: merged.len() as u32, ..Default::default() };
        for (k, (n, c, s)) in merged.into_iter().enumerate() {
            (idx.dims[k], idx.cos_stride[k], idx.sin_stride[k]) = (n as u64, c as u64, s as u64);
        }
        Ok(idx)
    }

    /// `y` of x's shape: the rotation (or its transpose) of x with the broadcast tables.
    pub(super) fn run<T: Elem>(
        _: &CudaSlice<T>,
        dir: Direction,
        d: usize,
        x: In,
        cos: In,
        sin: In,
    ) -> Result<CudaStorage> {
        let op = match dir {
            Direction::Forward => "rope_fwd",
            Direction::Transpose => "rope_bwd",
        };
        let dev = x.0.device();
        let n = x.1.shape().elem_count();
        if n == 0 {
            bail!("{op}: x {:?} is empty; the CUDA kernel needs at least one pair", x.1.shape())
        }
        let idx = index(op, x.1, cos.1, sin.1)?;
        let xv = view::<T>(x.0, x.1, op, "x")?;
        // The tables are stride-0 views: the kernel reads them from their start offset through `idx`.
        let cv = cos.0.as_cuda_slice::<T>()?.slice(cos.1.start_offset()..);
        let sv = sin.0.as_cuda_slice::<T>()?.slice(sin.1.start_offset()..);
        let pairs = (n / 2) as u64;
        let h = to_i32(op, "half the head dim", d / 2)?;
        // SAFETY: every pair (i, i + h) of every row is written by the grid-stride loop below.
        let y = unsafe { dev.alloc::<T>(n)? };
        let blocks = pairs.div_ceil(256).min(1 << 20) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (kn, km, kp) = kernel::<T>(op, Module::Rope)?;
        let f = dev.get_or_load_custom_func(&kn, km, kp)?;
        let mut a = f.builder();
        a.arg(&xv);
        a.arg(&cv);
        a.arg(&sv);
        a.arg(&y);
        a.arg(&idx);
        a.arg(&pairs);
        a.arg(&h);
        // SAFETY: argument types and order match `rope_{fwd,bwd}_*` in rope.cu. x and y hold n elements;
        // check_layouts proved the tables are views of x's shape with unit last stride, so every offset
        // the kernel forms from idx (strides of those views, from their start) lies inside their storage.
        unsafe { a.launch(cfg) }.w()?;
        Ok(wrap(y, dev))
    }
}
