//! RMSNorm and LayerNorm as candle CustomOps with an explicit backward.
//!
//! The references are [`crate::rms_norm_reference`] and [`crate::layer_norm_reference`] in `norm.rs`.
//! Row statistics and reductions are accumulated in f64 whatever the storage dtype, so the f32 op is at
//! least as accurate as the f32 reference. `*_frozen` variants never produce a weight (or bias) gradient:
//! their `bwd` returns `None` for those inputs, so they get no `GradStore` entry at all. CPU storage is
//! f32, f64 or bf16 (all inputs of one dtype; bf16 runs the f32 kernel and rounds its outputs once).
//!
//! CUDA (feature `cuda`, kernels in `cuda/norm.cu`): f32 or bf16 storage, statistics in f32, one block per
//! row; the backward's parameter gradients are per-block partial column sums reduced in a fixed order
//! (deterministic, no atomics). The backward is the same [`NormBwd`] op, so it runs on the GPU too.
//! Tests: `cargo test -p askgui-kernels --test grad_ops`; on a GPU `cargo test -p askgui-kernels
//! --features cuda --test cuda -- norm_rope_ce::norms`.

use super::{contiguous_slice, f32_slice, Float};
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType};
#[cfg(feature = "cuda")]
use {super::gpu, crate::plan::norm as plan, candle_core::backend::BackendStorage, candle_core::CudaStorage};

/// Checks `x (.., D)` against the per-feature params `(D)` and returns `(rows, D)`.
fn rows_and_dim(op: &str, x: &Layout, params: &[(&str, &Layout)]) -> Result<(usize, usize)> {
    let dims = x.shape().dims();
    let Some(&d) = dims.last() else { bail!("{op}: x must have at least one dimension, got shape {:?}", x.shape()) };
    for (name, l) in params {
        if l.shape().dims() != [d] {
            bail!("{op}: {name} must have shape [{d}] to match x {:?}, got {:?}", x.shape(), l.shape())
        }
    }
    if d == 0 {
        bail!("{op}: the normalised dimension is empty (x {:?})", x.shape())
    }
    Ok((x.shape().elem_count() / d, d))
}

/// Frozen or trained per-feature parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Params {
    Trained,
    Frozen,
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm: y = x * inv * w, inv = 1 / sqrt(mean(x^2) + eps).

struct RmsNorm {
    eps: f64,
    params: Params,
}

fn rms_inv<T: WithDType>(row: &[T], eps: f64) -> f64 {
    let ms = row.iter().map(|v| v.to_f64() * v.to_f64()).sum::<f64>() / row.len() as f64;
    1.0 / (ms + eps).sqrt()
}

fn rms_fwd<T: WithDType>(x: &[T], w: &[T], d: usize, eps: f64) -> Vec<T> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let inv = rms_inv(row, eps);
        y.extend(row.iter().zip(w).map(|(v, w)| T::from_f64(v.to_f64() * inv * w.to_f64())));
    }
    y
}

/// Returns `dx` followed (unless `with_dw` is false) by `dw`, in one buffer.
///
/// With `gw = g * w`: `dx = inv * gw - x * inv^3 * mean(gw * x)`; `dw = sum_rows g * x * inv`.
fn rms_bwd<T: WithDType>(x: &[T], w: &[T], g: &[T], d: usize, eps: f64, with_dw: bool) -> Vec<T> {
    let mut out = Vec::with_capacity(x.len() + if with_dw { d } else { 0 });
    let mut dw = vec![0f64; if with_dw { d } else { 0 }];
    for (xr, gr) in x.chunks_exact(d).zip(g.chunks_exact(d)) {
        let inv = rms_inv(xr, eps);
        let dot = xr.iter().zip(gr).zip(w).map(|((x, g), w)| x.to_f64() * g.to_f64() * w.to_f64()).sum::<f64>();
        let c = inv * inv * inv * dot / d as f64;
        out.extend(
            xr.iter().zip(gr).zip(w).map(|((x, g), w)| T::from_f64(inv * g.to_f64() * w.to_f64() - x.to_f64() * c)),
        );
        for ((acc, x), g) in dw.iter_mut().zip(xr).zip(gr) {
            *acc += g.to_f64() * x.to_f64() * inv;
        }
    }
    out.extend(dw.into_iter().map(T::from_f64));
    out
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms_norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (_, d) = rows_and_dim(name, l1, &[("w", l2)])?;
        let y = match Float::of(name, &[("x", s1, l1), ("w", s2, l2)])? {
            Float::F64 => {
                let (x, w) = (contiguous_slice::<f64>(s1, l1, name, "x")?, contiguous_slice(s2, l2, name, "w")?);
                f64::to_cpu_storage_owned(rms_fwd(x, w, d, self.eps))
            }
            Float::F32(out) => {
                let (x, w) = (f32_slice(s1, l1, name, "x")?, f32_slice(s2, l2, name, "w")?);
                out.store(rms_fwd(&x, &w, d, self.eps))
            }
        };
        Ok((y, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let (rows, d) = rows_and_dim(name, l1, &[("w", l2)])?;
        let elem = gpu::elem(name, &[("x", s1.dtype()), ("w", s2.dtype())])?;
        let plan = plan::forward(plan::Kind::Rms, rows, d, self.eps, elem)?;
        let ins = [gpu::input(name, "x", (s1, l1))?, gpu::input(name, "w", (s2, l2))?];
        Ok((gpu::single(name, gpu::run(&plan, &ins)?)?, l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let want_dw = self.params == Params::Trained && w.track_op();
        if !x.track_op() && !want_dw {
            return Ok((None, None));
        }
        let op = NormBwd { kind: NormKind::Rms, eps: self.eps, with_params: want_dw };
        let flat = x.contiguous()?.apply_op3_no_bwd(w, &grad.contiguous()?, &op)?;
        let n = x.elem_count();
        let dx = if x.track_op() { Some(flat.narrow(0, 0, n)?.reshape(x.shape())?) } else { None };
        let dw = if want_dw { Some(flat.narrow(0, n, w.elem_count())?) } else { None };
        Ok((dx, dw))
    }
}

/// RMSNorm over the last dimension of `x (.., D)` with a trained weight `w (D)`; gradients for x and w.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps, params: Params::Trained })
}

/// RMSNorm with a frozen weight: gradient for `x` only, `w` never gets a `GradStore` entry.
pub fn rms_norm_frozen(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm { eps, params: Params::Frozen })
}

// ---------------------------------------------------------------------------------------------------------
// LayerNorm: y = xhat * w + b, xhat = (x - mean) * inv, inv = 1 / sqrt(var + eps) (biased variance).

struct LayerNorm {
    eps: f64,
    params: Params,
}

/// `(mean, inv)` of one row.
fn ln_stats<T: WithDType>(row: &[T], eps: f64) -> (f64, f64) {
    let d = row.len() as f64;
    let mean = row.iter().map(|v| v.to_f64()).sum::<f64>() / d;
    let var = row.iter().map(|v| (v.to_f64() - mean).powi(2)).sum::<f64>() / d;
    (mean, 1.0 / (var + eps).sqrt())
}

fn ln_fwd<T: WithDType>(x: &[T], w: &[T], b: &[T], d: usize, eps: f64) -> Vec<T> {
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(d) {
        let (mean, inv) = ln_stats(row, eps);
        y.extend(
            row.iter()
                .zip(w)
                .zip(b)
                .map(|((v, w), b)| T::from_f64((v.to_f64() - mean) * inv * w.to_f64() + b.to_f64())),
        );
    }
    y
}

/// Returns `dx`, then (when `with_params`) `dw` and `db`, in one buffer.
///
/// With `h = g * w`: `dx = inv * (h - mean(h) - xhat * mean(h * xhat))`; `dw = sum g * xhat`; `db = sum g`.
fn ln_bwd<T: WithDType>(x: &[T], w: &[T], g: &[T], d: usize, eps: f64, with_params: bool) -> Vec<T> {
    let p = if with_params { d } else { 0 };
    let mut out = Vec::with_capacity(x.len() + 2 * p);
    let (mut dw, mut db) = (vec![0f64; p], vec![0f64; p]);
    let mut xhat = vec![0f64; d];
    for (xr, gr) in x.chunks_exact(d).zip(g.chunks_exact(d)) {
        let (mean, inv) = ln_stats(xr, eps);
        for (xh, x) in xhat.iter_mut().zip(xr) {
            *xh = (x.to_f64() - mean) * inv;
        }
        let (mut mh, mut mhx) = (0f64, 0f64);
        for ((g, w), xh) in gr.iter().zip(w).zip(&xhat) {
            let h = g.to_f64() * w.to_f64();
            mh += h;
            mhx += h * xh;
        }
        let (mh, mhx) = (mh / d as f64, mhx / d as f64);
        out.extend(
            gr.iter()
                .zip(w)
                .zip(&xhat)
                .map(|((g, w), xh)| T::from_f64(inv * (g.to_f64() * w.to_f64() - mh - xh * mhx))),
        );
        for (((dw, db), g), xh) in dw.iter_mut().zip(db.iter_mut()).zip(gr).zip(&xhat) {
            *dw += g.to_f64() * xh;
            *db += g.to_f64();
        }
    }
    out.extend(dw.into_iter().chain(db).map(T::from_f64));
    out
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "layer_norm"
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
        let (_, d) = rows_and_dim(name, l1, &[("w", l2), ("b", l3)])?;
        let y = match Float::of(name, &[("x", s1, l1), ("w", s2, l2), ("b", s3, l3)])? {
            Float::F64 => {
                let x = contiguous_slice::<f64>(s1, l1, name, "x")?;
                let (w, b) = (contiguous_slice(s2, l2, name, "w")?, contiguous_slice(s3, l3, name, "b")?);
                f64::to_cpu_storage_owned(ln_fwd(x, w, b, d, self.eps))
            }
            Float::F32(out) => {
                let x = f32_slice(s1, l1, name, "x")?;
                let (w, b) = (f32_slice(s2, l2, name, "w")?, f32_slice(s3, l3, name, "b")?);
                out.store(ln_fwd(&x, &w, &b, d, self.eps))
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
        let (rows, d) = rows_and_dim(name, l1, &[("w", l2), ("b", l3)])?;
        let elem = gpu::elem(name, &[("x", s1.dtype()), ("w", s2.dtype()), ("b", s3.dtype())])?;
        let plan = plan::forward(plan::Kind::Layer, rows, d, self.eps, elem)?;
        let ins =
            [gpu::input(name, "x", (s1, l1))?, gpu::input(name, "w", (s2, l2))?, gpu::input(name, "b", (s3, l3))?];
        Ok((gpu::single(name, gpu::run(&plan, &ins)?)?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let trained = self.params == Params::Trained;
        let (want_dw, want_db) = (trained && w.track_op(), trained && b.track_op());
        if !x.track_op() && !want_dw && !want_db {
            return Ok((None, None, None));
        }
        let op = NormBwd { kind: NormKind::Layer, eps: self.eps, with_params: want_dw || want_db };
        let flat = x.contiguous()?.apply_op3_no_bwd(w, &grad.contiguous()?, &op)?;
        let (n, d) = (x.elem_count(), w.elem_count());
        let dx = if x.track_op() { Some(flat.narrow(0, 0, n)?.reshape(x.shape())?) } else { None };
        let dw = if want_dw { Some(flat.narrow(0, n, d)?) } else { None };
        let db = if want_db { Some(flat.narrow(0, n + d, d)?) } else { None };
        Ok((dx, dw, db))
    }
}

/// Which norm a [`NormBwd`] differentiates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NormKind {
    Rms,
    Layer,
}

/// The backward kernel of both norms: inputs `(x, w, grad)`, output `[dx.flatten(), dw (, db)]`, the
/// parameter gradients only when they are trained.
struct NormBwd {
    kind: NormKind,
    eps: f64,
    with_params: bool,
}

impl NormBwd {
    fn run<T: WithDType>(&self, x: &[T], w: &[T], g: &[T], d: usize) -> Vec<T> {
        match self.kind {
            NormKind::Rms => rms_bwd(x, w, g, d, self.eps, self.with_params),
            NormKind::Layer => ln_bwd(x, w, g, d, self.eps, self.with_params),
        }
    }
}

impl CustomOp3 for NormBwd {
    fn name(&self) -> &'static str {
        match self.kind {
            NormKind::Rms => "rms_norm_bwd",
            NormKind::Layer => "layer_norm_bwd",
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
        let (_, d) = rows_and_dim(name, l1, &[("w", l2)])?;
        if l3.shape() != l1.shape() {
            bail!("{name}: grad {:?} must have the shape of x {:?}", l3.shape(), l1.shape())
        }
        let params = match (self.with_params, self.kind) {
            (false, _) => 0,
            (true, NormKind::Rms) => d,
            (true, NormKind::Layer) => 2 * d,
        };
        let out = match Float::of(name, &[("x", s1, l1), ("w", s2, l2), ("grad", s3, l3)])? {
            Float::F64 => {
                let x = contiguous_slice::<f64>(s1, l1, name, "x")?;
                let (w, g) = (contiguous_slice(s2, l2, name, "w")?, contiguous_slice(s3, l3, name, "grad")?);
                f64::to_cpu_storage_owned(self.run(x, w, g, d))
            }
            Float::F32(out) => {
                let x = f32_slice(s1, l1, name, "x")?;
                let (w, g) = (f32_slice(s2, l2, name, "w")?, f32_slice(s3, l3, name, "grad")?);
                out.store(self.run(&x, &w, &g, d))
            }
        };
        Ok((out, Shape::from(l1.shape().elem_count() + params)))
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
        let (rows, d) = rows_and_dim(name, l1, &[("w", l2)])?;
        if l3.shape() != l1.shape() {
            bail!("{name}: grad {:?} must have the shape of x {:?}", l3.shape(), l1.shape())
        }
        let elem = gpu::elem(name, &[("x", s1.dtype()), ("w", s2.dtype()), ("grad", s3.dtype())])?;
        let kind = match self.kind {
            NormKind::Rms => plan::Kind::Rms,
            NormKind::Layer => plan::Kind::Layer,
        };
        let plan = plan::backward(kind, rows, d, self.eps, self.with_params, elem)?;
        let ins =
            [gpu::input(name, "x", (s1, l1))?, gpu::input(name, "w", (s2, l2))?, gpu::input(name, "grad", (s3, l3))?];
        let params = if self.with_params { kind.params(d) } else { 0 };
        Ok((gpu::single(name, gpu::run(&plan, &ins)?)?, Shape::from(rows * d + params)))
    }
}

/// LayerNorm over the last dimension of `x (.., D)` with trained `w (D)`, `b (D)`; gradients for all three.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps, params: Params::Trained })
}

/// LayerNorm with frozen `w` and `b`: gradient for `x` only, `w` and `b` never get a `GradStore` entry.
pub fn layer_norm_frozen(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op3(&w.contiguous()?, &b.contiguous()?, LayerNorm { eps, params: Params::Frozen })
}
