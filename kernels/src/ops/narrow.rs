//! Frozen weights kept narrower than f32 on the CPU, and the GEMM that reads them: `y = x w^T` with `w`
//! in bf16, or in int8 with one f32 scale per output row (weight-only quantisation), accumulated in f32.
//!
//! Why: a served model's weights are most of its memory. candle 0.11 has no bf16 CPU matmul, and
//! widening a whole weight to f32 per call costs a transient f32 copy of it (1.2 GB for a 3B model's tied
//! `lm_head`) and a pass over memory. Here `w` is widened one panel of output rows at a time into a
//! buffer that stays in cache, and each panel goes through the f32 GEMM of [`super::gemm`].
//! - Few rows of `x` (decoding): small panels in parallel, each on one thread: the step is bound by
//!   reading the weight, which is now 2 or 1 bytes a value instead of 4.
//! - Many rows (prefill): larger panels one after the other, each GEMM on every thread.
//!
//! int8 (`--quantize int8`): `w[r][c] ~ scale[r] * q[r][c]`, `q` in -127..=127, `scale[r] =
//! max_c |w[r][c]| / 127` (symmetric, per output channel), so each weight is off by at most `scale[r]/2`.
//! candle has no i8 dtype: `q` is stored as u8 offset by 128 (`q + 128`).
//!
//! The reference twin is widening the whole weight and candle's f32 matmul ([`narrow_linear_reference`]);
//! `tests/narrow.rs` compares them.

use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use super::gemm::{matmul, View};
use super::{contiguous_slice, f32_slice, Float};

/// A frozen weight `(out, in)`, row-major, narrower than f32.
#[derive(Clone, Copy)]
pub(crate) enum Narrow<'a> {
    Bf16(&'a [bf16]),
    /// `q + 128` per value, and one scale per output row.
    Int8 {
        q: &'a [u8],
        scales: &'a [f32],
    },
}

impl Narrow<'_> {
    /// Rows `r0..r0 + rows` widened to f32 into `out` (cleared first).
    fn widen(&self, r0: usize, rows: usize, d_in: usize, out: &mut Vec<f32>) {
        out.clear();
        match *self {
            Narrow::Bf16(w) => out.extend(w[r0 * d_in..(r0 + rows) * d_in].iter().map(|x| x.to_f32())),
            Narrow::Int8 { q, scales } => {
                for r in r0..r0 + rows {
                    let s = scales[r];
                    out.extend(q[r * d_in..(r + 1) * d_in].iter().map(|&u| (i32::from(u) - 128) as f32 * s));
                }
            }
        }
    }
}

/// Below this many rows of `x` a call is a decode step: small panels, in parallel.
const FEW_ROWS: usize = 16;
/// f32 bytes of a decode step's panel (about a core's share of L2).
const SMALL_PANEL_BYTES: usize = 128 << 10;
/// f32 bytes of a prefill's panel: large, because every panel's GEMM packs all of `x` again (with 8 MB
/// panels a 3B model's int8 prefill took 1.5x f32's time, 73% of it in the GEMM kernel).
const LARGE_PANEL_BYTES: usize = 64 << 20;

/// Output rows per panel for `bytes` of f32: a multiple of 8, at least 8.
fn panel_rows(d_in: usize, bytes: usize) -> usize {
    (bytes / (4 * d_in.max(1)) / 8 * 8).max(8)
}

/// `y (n, d_out) = x (n, d_in) @ w (d_out, d_in)^T`, f32 accumulation.
pub(crate) fn linear(x: &[f32], w: Narrow, n: usize, d_in: usize, d_out: usize) -> Vec<f32> {
    linear_in_panels(x, w, (n, d_in, d_out), (SMALL_PANEL_BYTES, LARGE_PANEL_BYTES))
}

/// [`linear`] with the panel sizes `(small, large)` in f32 bytes (the tests use tiny ones).
fn linear_in_panels(x: &[f32], w: Narrow, (n, d_in, d_out): (usize, usize, usize), panels: (usize, usize)) -> Vec<f32> {
    let mut y = vec![0f32; n * d_out];
    if n == 0 || d_out == 0 {
        return y;
    }
    let xv = View::rows(x, n, d_in, d_in);
    if n > FEW_ROWS {
        let p = panel_rows(d_in, panels.1);
        let mut wf = Vec::with_capacity(p.min(d_out) * d_in);
        for r0 in (0..d_out).step_by(p) {
            let rows = p.min(d_out - r0);
            w.widen(r0, rows, d_in, &mut wf);
            // Columns r0.. of y: row stride d_out.
            matmul(&mut y[r0..], d_out, xv, View::rows(&wf, rows, d_in, d_in).t(), 1.0, false, true);
        }
        return y;
    }
    let p = panel_rows(d_in, panels.0);
    let parts: Vec<(usize, Vec<f32>)> = (0..d_out)
        .step_by(p)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map_init(Vec::new, |wf, r0| {
            let rows = p.min(d_out - r0);
            w.widen(r0, rows, d_in, wf);
            let mut part = vec![0f32; n * rows];
            matmul(&mut part, rows, xv, View::rows(wf, rows, d_in, d_in).t(), 1.0, false, false);
            (r0, part)
        })
        .collect();
    for (r0, part) in parts {
        let rows = part.len() / n;
        for (i, chunk) in part.chunks_exact(rows).enumerate() {
            y[i * d_out + r0..][..rows].copy_from_slice(chunk);
        }
    }
    y
}

/// Symmetric per-output-row int8 quantisation of `w (out, in)` (f32, bf16 or f64): `(q + 128 as u8
/// (out, in), scales f32 (out,))`. A row of zeros gets scale 0.
pub fn quantize_int8(w: &Tensor) -> Result<(Tensor, Tensor)> {
    let (d_out, d_in) = w.dims2()?;
    let w = w.to_dtype(DType::F32)?.to_device(&candle_core::Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    let mut q = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(d_out);
    for row in w.chunks_exact(d_in.max(1)).take(d_out) {
        let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = max / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        q.extend(row.iter().map(|x| ((x * inv).round().clamp(-127.0, 127.0) as i32 + 128) as u8));
        scales.push(scale);
    }
    let dev = candle_core::Device::Cpu;
    Ok((Tensor::from_vec(q, (d_out, d_in), &dev)?, Tensor::from_vec(scales, d_out, &dev)?))
}

/// The f32 weight an int8 `(q, scales)` stands for: `(q - 128) * scale` per row.
pub fn dequantize_int8(q: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let centred = (q.to_dtype(DType::F32)? - 128.0)?;
    centred.broadcast_mul(&scales.unsqueeze(1)?)
}

struct Int8Linear;

impl CustomOp3 for Int8Linear {
    fn name(&self) -> &'static str {
        "int8_linear"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sq: &CpuStorage,
        lq: &Layout,
        ss: &CpuStorage,
        ls: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (d_in, d_out, out_shape) = super::linear::check(name, lx, lq)?;
        if ls.shape().dims() != [d_out] {
            bail!("{name}: q {:?} and scales {:?} disagree: one scale per row of q", lq.shape(), ls.shape())
        }
        let out = match Float::of(name, &[("x", sx, lx)])? {
            Float::F32(out) => out,
            Float::F64 => bail!("{name}: x must be f32 or bf16, not f64"),
        };
        let x = f32_slice(sx, lx, name, "x")?;
        let q = contiguous_slice::<u8>(sq, lq, name, "q")?;
        let scales = contiguous_slice::<f32>(ss, ls, name, "scales")?;
        let y = linear(&x, Narrow::Int8 { q, scales }, x.len() / d_in, d_in, d_out);
        Ok((out.store(y), out_shape))
    }
}

/// `x (.., in) @ w^T -> (.., out)` for an int8 weight `(q, scales)` from [`quantize_int8`]; CPU only,
/// inference only (no gradient), `x` f32 or bf16 (the output has `x`'s dtype).
pub fn int8_linear(x: &Tensor, q: &Tensor, scales: &Tensor) -> Result<Tensor> {
    if !x.device().is_cpu() {
        bail!("int8_linear: int8 weights run on the CPU only (x is on {:?})", x.device())
    }
    x.contiguous()?.apply_op3_no_bwd(&q.contiguous()?, &scales.contiguous()?, &Int8Linear)
}

/// The twin of the narrow GEMMs: the whole weight widened to f32 and candle's matmul. `w` is a bf16
/// weight, or `(q, scales)` through [`dequantize_int8`] first.
pub fn narrow_linear_reference(x: &Tensor, w_f32: &Tensor) -> Result<Tensor> {
    let y = x.to_dtype(DType::F32)?.broadcast_matmul(&w_f32.to_dtype(DType::F32)?.t()?)?;
    y.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many small and many large panels (8-row panels at these sizes) against the plain triple loop over
    /// the dequantised weight; f32 sums of 40 terms of O(1) in another order: within 1e-5.
    #[test]
    fn every_panel_size_gives_the_plain_product() {
        let (d_in, d_out) = (40, 37);
        let q: Vec<u8> = (0..d_in * d_out).map(|i| (i * 37 % 255) as u8 + 1).collect();
        let scales: Vec<f32> = (0..d_out).map(|r| 0.01 + r as f32 * 1e-3).collect();
        for n in [3, 20] {
            let x: Vec<f32> = (0..n * d_in).map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0).collect();
            let got = linear_in_panels(&x, Narrow::Int8 { q: &q, scales: &scales }, (n, d_in, d_out), (1, 1));
            for i in 0..n {
                for r in 0..d_out {
                    let want: f32 =
                        (0..d_in).map(|c| x[i * d_in + c] * (q[r * d_in + c] as f32 - 128.0) * scales[r]).sum();
                    let g = got[i * d_out + r];
                    assert!((g - want).abs() <= 1e-5 * (1.0 + want.abs()), "n {n} ({i}, {r}): {g} vs {want}");
                }
            }
        }
    }
}
