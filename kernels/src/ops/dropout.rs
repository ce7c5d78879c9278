//! Inverted dropout with a counter-based mask ([`crate::dropout`]: the layout, and the reference
//! [`crate::dropout_reference`]) as a CustomOp: the mask is computed inside the op, the same on the CPU and
//! on CUDA (`cuda/dropout.cu`).
//!
//! Why: no random numbers are drawn on the host and no mask is uploaded or kept. The backward, and
//! gradient checkpointing's recomputation, hash the same key again and get the same mask: the backward is
//! this op on the upstream gradient, `dx = dy * mask / (1 - p)`.
//! Tests: `cargo test -p askgui-kernels --test dropout`; the CUDA kernel on the CPU executor:
//! `cargo test -p askgui-kernels --features cpu-exec --test emu -- dropout`.

use super::{contiguous_slice, f32_slice, Float};
use crate::dropout::{check_p, drop_threshold, group_words, DropoutKey};
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;
#[cfg(feature = "cuda")]
use {super::gpu, crate::plan::dropout as plan, candle_core::backend::BackendStorage, candle_core::CudaStorage};

/// Elements per parallel task (a multiple of 4, so that no Philox group straddles two tasks).
const CHUNK: usize = 1 << 14;

/// Inverted dropout of `x` with drop probability `p` and the mask of `key` (module docs): kept elements
/// scaled by `1 / (1 - p)`, dropped ones 0. The gradient is the same mask times the same scale. `p == 0`
/// returns `x`. CPU storage f32, f64 or bf16; CUDA f32 or bf16.
pub fn dropout(x: &Tensor, p: f64, key: DropoutKey) -> Result<Tensor> {
    check_p(p)?;
    if p == 0.0 {
        return Ok(x.clone());
    }
    x.contiguous()?.apply_op1(Dropout { p, key })
}

/// `y[i] = x[i] * (kept ? scale : 0)` for elements `key.offset + i`.
fn apply<T: Copy + Send + Sync + std::ops::Mul<Output = T>>(
    x: &[T],
    key: &DropoutKey,
    t: u32,
    scale: T,
    zero: T,
) -> Vec<T> {
    let mut y = vec![zero; x.len()];
    // Each task starts at an element of its own; its groups follow from there.
    y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).enumerate().for_each(|(c, (y, x))| {
        let first = key.offset + (c * CHUNK) as u64;
        let mut group = first / 4;
        let mut words = group_words(key, group);
        for (i, (y, &x)) in y.iter_mut().zip(x).enumerate() {
            let e = first + i as u64;
            if e / 4 != group {
                group = e / 4;
                words = group_words(key, group);
            }
            *y = x * if words[(e % 4) as usize] >= t { scale } else { zero };
        }
    });
    y
}

struct Dropout {
    p: f64,
    key: DropoutKey,
}

impl CustomOp1 for Dropout {
    fn name(&self) -> &'static str {
        "dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (name, t) = (self.name(), drop_threshold(self.p));
        let y = match Float::of(name, &[("x", s, l)])? {
            Float::F64 => {
                let x = contiguous_slice::<f64>(s, l, name, "x")?;
                f64::to_cpu_storage_owned(apply(x, &self.key, t, 1.0 / (1.0 - self.p), 0.0))
            }
            Float::F32(out) => {
                let x = f32_slice(s, l, name, "x")?;
                out.store(apply(&x, &self.key, t, (1.0 / (1.0 - self.p)) as f32, 0.0))
            }
        };
        Ok((y, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let elem = gpu::elem(name, &[("x", s.dtype())])?;
        let plan = plan::forward(l.shape().elem_count(), self.p, self.key, elem)?;
        let ins = [gpu::input(name, "x", (s, l))?];
        Ok((gpu::single(name, gpu::run(&plan, &ins)?)?, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        if !x.track_op() {
            return Ok(None);
        }
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&Dropout { p: self.p, key: self.key })?))
    }
}
