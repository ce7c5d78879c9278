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
use {super::gpu, crate::plan::rope as plan, candle_core::backend::BackendStorage, candle_core::CudaStorage};

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
        check_layouts(name, l1, l2, l3)?;
        let elem = gpu::elem(name, &[("x", s1.dtype()), ("cos", s2.dtype()), ("sin", s3.dtype())])?;
        let dir = match self.dir {
            Direction::Forward => plan::Direction::Forward,
            Direction::Transpose => plan::Direction::Transpose,
        };
        let dims = l1.shape().dims();
        // The tables are stride-0 views of x's shape: the kernel reads them from their start offset, up to
        // the furthest element their strides reach.
        let reach = |l: &Layout| 1 + dims.iter().zip(l.stride()).map(|(&n, &s)| n.saturating_sub(1) * s).sum::<usize>();
        let plan = plan::plan(dir, dims, (l2.stride(), reach(l2)), (l3.stride(), reach(l3)), elem)?;
        let ins = [gpu::input(name, "x", (s1, l1))?, (s2, l2.start_offset()), (s3, l3.start_offset())];
        Ok((gpu::single(name, gpu::run(&plan, &ins)?)?, l1.shape().clone()))
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
