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
use crate::dropout::{check_p, drop_threshold, DropoutKey, PHILOX_M, PHILOX_W};
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
        let (first, n) = (key.offset + (c * CHUNK) as u64, x.len() as u64);
        let (g_end, mut g0) = ((first + n - 1) / 4 + 1, first / 4);
        while g0 < g_end {
            let groups = philox_lanes(key, g0);
            for (j, words) in groups.iter().enumerate().take((g_end - g0) as usize) {
                for (w, &word) in words.iter().enumerate() {
                    let e = (g0 + j as u64) * 4 + w as u64;
                    if e >= first && e - first < n {
                        let i = (e - first) as usize;
                        y[i] = x[i] * if word >= t { scale } else { zero };
                    }
                }
            }
            g0 += LANES as u64;
        }
    });
    y
}

/// Groups of four elements a Philox batch hashes at once.
const LANES: usize = 16;

/// Philox4x32-10 of groups `g0 .. g0 + LANES` (group `g0 + j` at `[j]`): the spec's
/// [`crate::dropout::philox4x32_10`] lane by lane, which the compiler turns into SIMD 32 x 32 -> 64-bit
/// multiplies. On x86-64 with AVX-512F or AVX2 the same loop is compiled for them (8 or 4 products an
/// instruction instead of SSE2's 2); integer arithmetic, so every variant is bitwise the spec.
fn philox_lanes(key: &DropoutKey, g0: u64) -> [[u32; 4]; LANES] {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F, checked just above.
        return unsafe { philox_lanes_avx512(key, g0) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { philox_lanes_avx2(key, g0) };
    }
    philox_lanes_plain(key, g0)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn philox_lanes_avx512(key: &DropoutKey, g0: u64) -> [[u32; 4]; LANES] {
    philox_lanes_plain(key, g0)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn philox_lanes_avx2(key: &DropoutKey, g0: u64) -> [[u32; 4]; LANES] {
    philox_lanes_plain(key, g0)
}

// The lanes are indexed in step across the four word arrays: the form the compiler vectorises.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn philox_lanes_plain(key: &DropoutKey, g0: u64) -> [[u32; 4]; LANES] {
    // Word by word across the lanes (structure of arrays), so each step of a round is one loop.
    let mut c = [[0u32; LANES]; 4];
    for j in 0..LANES {
        let g = g0 + j as u64;
        c[0][j] = g as u32;
        c[1][j] = (g >> 32) as u32;
        c[2][j] = key.layer as u32;
        c[3][j] = (key.layer >> 32) as u32;
    }
    let (mut k0, mut k1) = (key.seed as u32, (key.seed >> 32) as u32);
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(PHILOX_W[0]);
            k1 = k1.wrapping_add(PHILOX_W[1]);
        }
        for j in 0..LANES {
            let p0 = u64::from(PHILOX_M[0]) * u64::from(c[0][j]);
            let p1 = u64::from(PHILOX_M[1]) * u64::from(c[2][j]);
            c[0][j] = (p1 >> 32) as u32 ^ c[1][j] ^ k0;
            c[1][j] = p1 as u32;
            c[2][j] = (p0 >> 32) as u32 ^ c[3][j] ^ k1;
            c[3][j] = p0 as u32;
        }
    }
    let mut out = [[0u32; 4]; LANES];
    for (j, o) in out.iter_mut().enumerate() {
        *o = [c[0][j], c[1][j], c[2][j], c[3][j]];
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dropout::philox4x32_10;

    /// Every compiled batch is the spec's Philox group by group, across a carry into the counter's high
    /// word.
    #[test]
    fn every_compiled_batch_is_the_spec() {
        let key = DropoutKey { seed: 0x0123_4567_89ab_cdef, layer: 0xfeed_f00d_1234_5678, offset: 0 };
        for g0 in [0u64, (1 << 32) - 7] {
            let spec: Vec<[u32; 4]> = (0..LANES as u64)
                .map(|j| {
                    let g = g0 + j;
                    let counter = [g as u32, (g >> 32) as u32, key.layer as u32, (key.layer >> 32) as u32];
                    philox4x32_10(counter, [key.seed as u32, (key.seed >> 32) as u32])
                })
                .collect();
            assert_eq!(philox_lanes_plain(&key, g0).to_vec(), spec);
            assert_eq!(philox_lanes(&key, g0).to_vec(), spec, "the dispatched variant");
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2, checked just above.
                assert_eq!(unsafe { philox_lanes_avx2(&key, g0) }.to_vec(), spec, "AVX2");
            }
        }
    }
}
