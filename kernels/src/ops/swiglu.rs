//! `swiglu(gate, up) = silu(gate) * up`, the activation of the Qwen2 decoder's MLP, as one CustomOp with
//! an explicit backward.
//!
//! Why: through candle, `gate.silu() * up` keeps `silu(gate)` for the backward, and the backward takes
//! about ten passes over `T x intermediate` tensors, each into a fresh buffer (silu's alone builds the
//! sigmoid from neg, exp, add and recip, then the gradient store zeroes and adds); in a packed phone step
//! these are the decoder's largest tensors. This op keeps nothing but its inputs and computes both
//! gradients in one pass, with `s = sigmoid(g)`:
//! `y = g s u`, `du = dy g s`, `dg = dy u s (1 + g (1 - s))`.
//!
//! Numerics: f32 takes the sigmoid from [`exp_f32`] of `-|g|` (never overflows; within a few ulp of f64),
//! f64 computes in f64, bf16 is widened to f32 and each output rounded once. Its twin is
//! [`swiglu_reference`] (candle's `silu` and `mul`), which the tests compare it against; CUDA storage takes
//! the twin (no kernel of ours yet).
//! Tests: `cargo test -p askgui-kernels --test grad_ops -- swiglu`.

use super::exp::exp_f32;
use super::{contiguous_slice, f32_slice, Float};
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;
use std::ops::{Add, Div, Mul, Sub};

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// `silu(gate) * up` by candle's ops: the reference of [`swiglu`].
pub fn swiglu_reference(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.silu()? * up
}

/// `silu(gate) * up` for `gate` and `up` of one shape, with the explicit backward of the module docs on
/// CPU (f32, f64, bf16); [`swiglu_reference`] elsewhere.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!("swiglu: gate {:?} and up {:?} must have the same shape", gate.dims(), up.dims())
    }
    if !gate.device().is_cpu() {
        return swiglu_reference(gate, up);
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, Swiglu)
}

/// The kernel's float type: f32 or f64.
trait Act:
    Copy + Send + Sync + PartialOrd + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> + Div<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;

    /// `e^-|x|`, in (0, 1].
    fn exp_neg_abs(self) -> Self;

    /// `1 / (1 + e^-x)` for x >= 0, `e^x / (1 + e^x)` below: no overflow for any x.
    #[inline(always)]
    fn sigmoid(self) -> Self {
        let e = self.exp_neg_abs();
        let r = Self::ONE / (Self::ONE + e);
        if self >= Self::ZERO {
            r
        } else {
            e * r
        }
    }
}

impl Act for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;

    #[inline(always)]
    fn exp_neg_abs(self) -> Self {
        exp_f32(-self.abs())
    }
}

impl Act for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;

    #[inline(always)]
    fn exp_neg_abs(self) -> Self {
        (-self.abs()).exp()
    }
}

/// `y = g s u`.
fn forward<T: Act>(g: &[T], u: &[T]) -> Vec<T> {
    let mut y = vec![T::ZERO; g.len()];
    let tasks = y.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(u.par_chunks(CHUNK));
    tasks.for_each(|((y, g), u)| {
        for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
            *y = g * g.sigmoid() * u;
        }
    });
    y
}

/// `[dg, du]`, each `g.len()` long, for the upstream gradient `dy`.
fn backward<T: Act>(g: &[T], u: &[T], dy: &[T]) -> Vec<T> {
    let n = g.len();
    let mut out = vec![T::ZERO; 2 * n];
    let (dg, du) = out.split_at_mut(n);
    let tasks =
        dg.par_chunks_mut(CHUNK).zip(du.par_chunks_mut(CHUNK)).zip(g.par_chunks(CHUNK)).zip(u.par_chunks(CHUNK));
    tasks.zip(dy.par_chunks(CHUNK)).for_each(|((((dg, du), g), u), dy)| {
        for i in 0..g.len() {
            let s = g[i].sigmoid();
            du[i] = dy[i] * g[i] * s;
            dg[i] = dy[i] * u[i] * s * (T::ONE + g[i] * (T::ONE - s));
        }
    });
    out
}

struct Swiglu;

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let out = match Float::of(name, &[("gate", s1, l1), ("up", s2, l2)])? {
            Float::F64 => {
                let (g, u) = (contiguous_slice::<f64>(s1, l1, name, "gate")?, contiguous_slice(s2, l2, name, "up")?);
                f64::to_cpu_storage_owned(forward(g, u))
            }
            Float::F32(out) => {
                let (g, u) = (f32_slice(s1, l1, name, "gate")?, f32_slice(s2, l2, name, "up")?);
                out.store(forward(&g, &u))
            }
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (want_g, want_u) = (gate.track_op(), up.track_op());
        if !want_g && !want_u {
            return Ok((None, None));
        }
        let both = gate.apply_op3_no_bwd(up, &grad.contiguous()?, &SwigluBwd)?;
        let n = gate.elem_count();
        let dg = if want_g { Some(both.narrow(0, 0, n)?.reshape(gate.shape())?) } else { None };
        let du = if want_u { Some(both.narrow(0, n, n)?.reshape(up.shape())?) } else { None };
        Ok((dg, du))
    }
}

/// The backward kernel: `(gate, up, dy)` to `[dg.flatten(), du.flatten()]`.
struct SwigluBwd;

impl CustomOp3 for SwigluBwd {
    fn name(&self) -> &'static str {
        "swiglu_bwd"
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
        let out = match Float::of(name, &[("gate", s1, l1), ("up", s2, l2), ("dy", s3, l3)])? {
            Float::F64 => {
                let g = contiguous_slice::<f64>(s1, l1, name, "gate")?;
                let (u, dy) = (contiguous_slice(s2, l2, name, "up")?, contiguous_slice(s3, l3, name, "dy")?);
                f64::to_cpu_storage_owned(backward(g, u, dy))
            }
            Float::F32(out) => {
                let g = f32_slice(s1, l1, name, "gate")?;
                let (u, dy) = (f32_slice(s2, l2, name, "up")?, f32_slice(s3, l3, name, "dy")?);
                out.store(backward(&g, &u, &dy))
            }
        };
        Ok((out, Shape::from(2 * l1.shape().elem_count())))
    }
}
