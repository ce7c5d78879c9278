//! `frozen_linear`: `y = x w^T` through a frozen base weight, with a gradient for `x` only.
//!
//! Why: candle's `matmul` backward computes (and keeps) a gradient for both operands, so every frozen
//! base projection of a LoRA model would cost a weight-sized gradient buffer per step. This op's `bwd`
//! returns `None` for `w`, so `w` never enters the `GradStore`; `dx = grad @ w` is all that is computed.
//! The CPU forward is one call to the `gemm` crate (the multithreaded, SIMD GEMM candle's own CPU matmul
//! uses); its twin is [`frozen_linear_reference`], candle's matmul, which the tests compare against.
//! bf16 on the CPU (where candle 0.11 has no bf16 matmul): `x` widened to f32, `w` read in f32 panels
//! ([`super::narrow`]), f32 accumulation, `y` rounded once;
//! the CPU backward's `grad @ w` is the same GEMM (`FrozenLinearGrad`), with no weight copy.
//! CUDA (feature `cuda`): candle's own cuBLAS GEMM on the storages (`BackendStorage::matmul` with `w` read
//! transposed through its strides, no copy), f32 or bf16; the backward is candle's matmul, on the GPU too.
//! Tests: `cargo test -p askgui-kernels --test grad_ops`; on a GPU `cargo test -p askgui-kernels
//! --features cuda --test cuda -- norm_rope_ce::frozen_linear`.

use super::gemm::{matmul, View};
use super::{contiguous_slice, f32_slice, narrow, Float};
#[cfg(feature = "cuda")]
use candle_core::{backend::BackendStorage, CudaStorage};
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, WithDType, D};

struct FrozenLinear;

/// `y (N, out) = x (N, in) @ w (out, in)^T` by the `gemm` crate, on candle's CPU thread count.
fn linear_fwd<T: WithDType>(x: &[T], w: &[T], d_in: usize) -> Vec<T> {
    let (n, d_out) = (x.len() / d_in, w.len() / d_in);
    let mut y = vec![T::zero(); n * d_out];
    let (x, w) = (View::rows(x, n, d_in, d_in), View::rows(w, d_out, d_in, d_in));
    matmul(&mut y, d_out, x, w.t(), T::one(), false, true);
    y
}

/// Checks x `(.., in)` against w `(out, in)` for the op `name`; returns `(in, out, shape of y)`.
pub(super) fn check(name: &str, x: &Layout, w: &Layout) -> Result<(usize, usize, Shape)> {
    let (xd, wd) = (x.shape().dims(), w.shape().dims());
    let (Some(&d_in), [d_out, w_in]) = (xd.last(), wd) else {
        bail!("{name}: expected x (.., in) and w (out, in), got x {:?}, w {:?}", x.shape(), w.shape())
    };
    if d_in != *w_in || d_in == 0 {
        bail!("{name}: x {:?} and w {:?} disagree on a non-empty `in` dimension", x.shape(), w.shape())
    }
    let mut dims = xd.to_vec();
    *dims.last_mut().expect("checked non-empty above") = *d_out;
    Ok((d_in, *d_out, Shape::from(dims)))
}

impl CustomOp2 for FrozenLinear {
    fn name(&self) -> &'static str {
        "frozen_linear"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (d_in, d_out, out_shape) = check(self.name(), l1, l2)?;
        let name = self.name();
        let y = match Float::of(name, &[("x", s1, l1), ("w", s2, l2)])? {
            Float::F64 => {
                let (x, w) = (contiguous_slice::<f64>(s1, l1, name, "x")?, contiguous_slice(s2, l2, name, "w")?);
                f64::to_cpu_storage_owned(linear_fwd(x, w, d_in))
            }
            // A bf16 weight is read panel by panel ([`super::narrow`]), never widened whole.
            Float::F32(out) if matches!(s2, CpuStorage::BF16(_)) => {
                let (x, w) = (f32_slice(s1, l1, name, "x")?, contiguous_slice(s2, l2, name, "w")?);
                out.store(narrow::linear(&x, narrow::Narrow::Bf16(w), x.len() / d_in, d_in, d_out))
            }
            Float::F32(out) => {
                let (x, w) = (f32_slice(s1, l1, name, "x")?, f32_slice(s2, l2, name, "w")?);
                out.store(linear_fwd(&x, &w, d_in))
            }
        };
        Ok((y, out_shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let (d_in, d_out, out_shape) = check(self.name(), l1, l2)?;
        let name = self.name();
        super::gpu::elem(name, &[("x", s1.dtype()), ("w", s2.dtype())])?;
        let (Some((x0, _)), Some((w0, _))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            bail!(
                "{name}: x {:?} and w {:?} must be contiguous (strides {:?}, {:?})",
                l1.shape(),
                l2.shape(),
                l1.stride(),
                l2.stride()
            )
        };
        let n = l1.shape().elem_count() / d_in;
        if n == 0 || d_out == 0 {
            bail!("{name}: x {:?} or w {:?} is empty; cuBLAS needs at least one row and output", l1.shape(), l2.shape())
        }
        // (1, N, in) @ (in, out): w (out, in) row-major read as its transpose through strides (1, in).
        let lhs = Layout::contiguous_with_offset((1, n, d_in), x0);
        let rhs = Layout::new(Shape::from((1, d_in, d_out)), vec![d_in * d_out, 1, d_in], w0);
        let y = s1.matmul(s2, (1, n, d_out, d_in), &lhs, &rhs)?;
        Ok((y, out_shape))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !x.track_op() {
            return Ok((None, None));
        }
        Ok((Some(input_grad(grad, w)?), None))
    }
}

/// `dx (.., in) = grad (.., out) @ w (out, in)`, the input gradient of `x w^T`: the CPU GEMM (bf16 too) or
/// candle's matmul. Detached operands: this product must not itself grow a graph.
pub(super) fn input_grad(grad: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (grad, w) = (grad.detach().contiguous()?, w.detach().contiguous()?);
    if grad.device().is_cpu() {
        return grad.apply_op2_no_bwd(&w, &FrozenLinearGrad);
    }
    let mut dims = grad.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = w.dim(1)?;
    }
    grad.reshape(((), grad.dim(D::Minus1)?))?.matmul(&w)?.reshape(dims)
}

/// The CPU backward of [`FrozenLinear`]: `dx (.., in) = grad (.., out) @ w (out, in)`, the forward's GEMM
/// with `w` read as it is (candle's CPU matmul has no bf16).
struct FrozenLinearGrad;

/// `dx (n, in) = g (n, out) @ w (out, in)`.
fn linear_grad<T: WithDType>(g: &[T], w: &[T], n: usize, d_out: usize, d_in: usize) -> Vec<T> {
    let mut dx = vec![T::zero(); n * d_in];
    let (g, w) = (View::rows(g, n, d_out, d_out), View::rows(w, d_out, d_in, d_in));
    matmul(&mut dx, d_in, g, w, T::one(), false, true);
    dx
}

impl CustomOp2 for FrozenLinearGrad {
    fn name(&self) -> &'static str {
        "frozen_linear_bwd"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (gd, wd) = (l1.shape().dims(), l2.shape().dims());
        let (Some((&d_out, lead)), [w_out, d_in]) = (gd.split_last(), wd) else {
            bail!("{name}: expected grad (.., out) and w (out, in), got grad {:?}, w {:?}", l1.shape(), l2.shape())
        };
        if d_out != *w_out {
            bail!("{name}: grad {:?} and w {:?} disagree on the `out` dimension", l1.shape(), l2.shape())
        }
        let (n, d_in) = (lead.iter().product::<usize>(), *d_in);
        let dx = match Float::of(name, &[("grad", s1, l1), ("w", s2, l2)])? {
            Float::F64 => {
                let (g, w) = (contiguous_slice::<f64>(s1, l1, name, "grad")?, contiguous_slice(s2, l2, name, "w")?);
                f64::to_cpu_storage_owned(linear_grad(g, w, n, d_out, d_in))
            }
            Float::F32(out) => {
                let (g, w) = (f32_slice(s1, l1, name, "grad")?, f32_slice(s2, l2, name, "w")?);
                out.store(linear_grad(&g, &w, n, d_out, d_in))
            }
        };
        Ok((dx, Shape::from(lead.iter().copied().chain([d_in]).collect::<Vec<_>>())))
    }
}

/// `x (.., in) @ w (out, in)^T -> (.., out)`; `w` is frozen: it never gets a gradient.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, FrozenLinear)
}

/// `y (sum n_i, out)`: the rows of every part `x_i (n_i, in)`, in order, times `w (out, in)^T`, for f32 on
/// the CPU. Each part is multiplied where it lies, so rows kept in separate buffers (a batch's
/// screenshots, about 7 MB of pixels each at 640x480) need no copy into one tensor first. A part whose
/// length is not a multiple of `in` is an error; `w` must be an f32 CPU tensor. Its twin is
/// [`frozen_linear`] on the concatenated rows, which the tests compare it with.
pub fn linear_parts(parts: &[&[f32]], w: &Tensor) -> Result<Tensor> {
    let (d_out, d_in) = w.dims2()?;
    if !w.device().is_cpu() || w.dtype() != candle_core::DType::F32 || d_in == 0 {
        bail!(
            "linear_parts: w must be a non-empty f32 CPU tensor, got {:?} {:?} on {:?}",
            w.dtype(),
            w.shape(),
            w.device()
        )
    }
    if let Some((i, p)) = parts.iter().enumerate().find(|(_, p)| p.len() % d_in != 0) {
        bail!("linear_parts: part {i} has {} values, not a whole number of rows of {d_in}", p.len())
    }
    let w = w.contiguous()?;
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(storage) = &*storage else { unreachable!("checked to be on the CPU above") };
    let w = View::rows(contiguous_slice::<f32>(storage, layout, "linear_parts", "w")?, d_out, d_in, d_in);
    let n: usize = parts.iter().map(|p| p.len() / d_in).sum();
    let mut y = vec![0f32; n * d_out];
    let mut rest = y.as_mut_slice();
    for p in parts {
        let rows = p.len() / d_in;
        let (dst, tail) = rest.split_at_mut(rows * d_out);
        matmul(dst, d_out, View::rows(p, rows, d_in, d_in), w.t(), 1.0, false, true);
        rest = tail;
    }
    Tensor::from_vec(y, (n, d_out), &candle_core::Device::Cpu)
}

/// Plain-candle twin of [`frozen_linear`]. Differentiable, but candle's autograd also computes a
/// (wasted) gradient for `w` through it: that is the point of the CustomOp.
pub fn frozen_linear_reference(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.broadcast_matmul(&w.t()?)
}
