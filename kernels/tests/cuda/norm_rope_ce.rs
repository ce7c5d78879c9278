//! GPU tests of the CUDA forwards of the training ops (RMSNorm, LayerNorm and their `_frozen` variants,
//! RoPE, the masked cross-entropy, `frozen_linear`) against the CPU ops, forward and gradients through
//! candle's backward (`Var` + `.backward()`), on odd sizes, f32 and bf16.
//!
//! The CPU op is the spec. For bf16 the CPU op runs on the bf16-rounded inputs upcast to f32, so both sides
//! see the same numbers and only the kernels' arithmetic and the output rounding differ. A mismatch fails
//! (through `common::tol::compare`) with the shape, the dtype, the max abs error, how many elements are out
//! and the worst of them (multi-index, got, want).
//! Run on a GPU: `cargo test -p askgui-kernels --features cuda --test cuda -- norm_rope_ce --nocapture`
//! (prints one line per comparison). Without a CUDA device every test prints SKIPPED and passes.

use crate::common;

use anyhow::{bail, ensure, Context, Result};
use askgui_kernels::ops::{
    cross_entropy_masked, frozen_linear, layer_norm, layer_norm_frozen, rms_norm, rms_norm_frozen, rope,
};
use candle_core::{DType, Device, Tensor, Var};
use common::tensor;

// The tolerances of `tests/common/tol.rs`, whose comments give the reasons (shared with `tests/emu/`).
use crate::common::tol::{compare_tensors, Tol, BF16, EXACT, F32_GEMM, F32_PARAMS, F32_ROPE, F32_ROWS};

const EPS: f64 = 1e-6;

/// The cross-entropy loss, a mean of per-row lse - logit (~10-20): f32 error ~1e-6 relative; bf16 rounds
/// it ([`BF16`]).
const CE_LOSS_F32: Tol = Tol { atol: 1e-5, rtol: 1e-5 };
/// Cross-entropy gradient elements are (softmax - onehot) / n_sup, at most 1 / n_sup: the f32 tolerance is
/// relative (the row logsumexp of ~20 carries ~2e-6 absolute error into every exp), with an atol scaled to
/// the largest possible element (these atols are per unit of 1 / n_sup, see [`ce_grad_tol`]); bf16 as
/// everywhere.
const CE_GRAD_F32: Tol = Tol { atol: 1e-5, rtol: 2e-5 };
const CE_GRAD_BF16: Tol = Tol { atol: 1e-4, rtol: BF16.rtol };

/// [`CE_GRAD_F32`] or [`CE_GRAD_BF16`] with the atol scaled to a gradient of `n_sup` supervised rows.
fn ce_grad_tol(dtype: DType, n_sup: f64) -> Tol {
    let t = if dtype == DType::BF16 { CE_GRAD_BF16 } else { CE_GRAD_F32 };
    Tol { atol: t.atol / n_sup, rtol: t.rtol }
}

/// One input of a case: an f64 (or u32) CPU tensor, whether it is converted to the case dtype, whether it
/// is a `Var`, and whether the op must give it a gradient.
struct Input {
    t: Tensor,
    float: bool,
    var: bool,
    grad: bool,
}

fn float(t: Tensor, var: bool, grad: bool) -> Input {
    Input { t, float: true, var, grad }
}

/// What a case compares: forward tolerance and the gradient tolerance of each input.
struct Case<'a> {
    name: String,
    dtype: DType,
    inputs: Vec<Input>,
    fwd: Tol,
    grads: Vec<Tol>,
    op: &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    /// Weight the output by a fixed random tensor before summing (every element its own upstream
    /// gradient); false for scalar outputs (the loss is the output itself).
    weighted: bool,
}

/// Builds the inputs on `dev` in `dtype` (GPU) or rounded to `dtype` then upcast to f32 (CPU reference).
fn build(inputs: &[Input], dev: &Device, dtype: DType) -> Result<(Vec<Option<Var>>, Vec<Tensor>)> {
    let (mut vars, mut ts) = (Vec::new(), Vec::new());
    for inp in inputs {
        let t = if !inp.float {
            inp.t.to_device(dev)?
        } else if dev.is_cpu() {
            inp.t.to_dtype(dtype)?.to_dtype(DType::F32)?
        } else {
            inp.t.to_dtype(dtype)?.to_device(dev)?
        };
        if inp.var {
            let v = Var::from_tensor(&t)?;
            ts.push(v.as_tensor().clone());
            vars.push(Some(v));
        } else {
            ts.push(t);
            vars.push(None);
        }
    }
    Ok((vars, ts))
}

fn run(dev: &Device, c: &Case) -> Result<()> {
    let label = format!("{} {:?}", c.name, c.dtype);
    let (gvars, gts) = build(&c.inputs, dev, c.dtype)?;
    let (cvars, cts) = build(&c.inputs, &Device::Cpu, c.dtype)?;
    let y = (c.op)(&gts).with_context(|| format!("{label}: CUDA forward"))?;
    let y_ref = (c.op)(&cts).with_context(|| format!("{label}: CPU forward"))?;
    ensure!(y.device().is_cuda(), "{label}: the op's output is not on the GPU");
    compare_tensors(&format!("{label} forward"), &y, &y_ref, c.fwd)?;
    let (loss, loss_ref) = if c.weighted {
        // r rounded to the case dtype, so both sides get the same upstream gradient.
        let r = tensor(y.dims(), 77, c.dtype)?;
        (y.mul(&r.to_device(dev)?)?.sum_all()?, y_ref.mul(&r.to_dtype(DType::F32)?)?.sum_all()?)
    } else {
        (y.clone(), y_ref.clone())
    };
    let grads = loss.backward().with_context(|| format!("{label}: CUDA backward"))?;
    let grads_ref = loss_ref.backward().with_context(|| format!("{label}: CPU backward"))?;
    for (i, inp) in c.inputs.iter().enumerate() {
        let (Some(gv), Some(cv)) = (&gvars[i], &cvars[i]) else { continue };
        match (grads.get(gv), grads_ref.get(cv), inp.grad) {
            (Some(g), Some(g_ref), true) => {
                compare_tensors(&format!("{label} grad of input {i}"), g, g_ref, c.grads[i])?
            }
            (None, _, false) => {}
            (Some(_), _, false) => bail!("{label}: input {i} is frozen but got a CUDA gradient"),
            (None, _, true) => bail!("{label}: input {i} got no CUDA gradient"),
            (Some(_), None, true) => bail!("{label}: input {i} got no CPU gradient"),
        }
    }
    Ok(())
}

fn tols(dtype: DType, f32_tol: Tol) -> Tol {
    if dtype == DType::BF16 {
        BF16
    } else {
        f32_tol
    }
}

const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

/// (rows, hidden): single row, odd rows, the vision (1280) and text (2048) widths, a non-power-of-two
/// 1000, and widths whose LayerNorm / RMSNorm parameter partials no longer fit in shared memory.
const NORM_SIZES: [(usize, usize); 7] =
    [(1, 64), (7, 80), (129, 1280), (1000, 1000), (4097, 2048), (33, 6500), (3, 12500)];

fn norm_inputs(rows: usize, d: usize, params: usize, trained: bool) -> Result<Vec<Input>> {
    let mut v = vec![float(tensor(&[rows, d], 1, DType::F64)?, true, true)];
    // Weights around 1 (as trained norms are), biases around 0.
    v.push(float(tensor(&[d], 2, DType::F64)?.affine(0.5, 1.0)?, true, trained));
    if params == 2 {
        v.push(float((tensor(&[d], 3, DType::F64)? * 0.5)?, true, trained));
    }
    Ok(v)
}

#[test]
fn norms_match_cpu() -> Result<()> {
    let Some(dev) = crate::cuda_device("norms_match_cpu") else { return Ok(()) };
    let rms_t = |t: &[Tensor]| rms_norm(&t[0], &t[1], EPS);
    let rms_f = |t: &[Tensor]| rms_norm_frozen(&t[0], &t[1], EPS);
    let ln_t = |t: &[Tensor]| layer_norm(&t[0], &t[1], &t[2], EPS);
    let ln_f = |t: &[Tensor]| layer_norm_frozen(&t[0], &t[1], &t[2], EPS);
    type NormOp<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;
    let ops: [(&str, usize, bool, NormOp); 4] = [
        ("rms_norm", 1, true, &rms_t),
        ("rms_norm_frozen", 1, false, &rms_f),
        ("layer_norm", 2, true, &ln_t),
        ("layer_norm_frozen", 2, false, &ln_f),
    ];
    for dtype in DTYPES {
        for &(rows, d) in &NORM_SIZES {
            for &(name, params, trained, op) in &ops {
                let mut grads = vec![tols(dtype, F32_ROWS)];
                grads.extend(std::iter::repeat_n(tols(dtype, F32_PARAMS), params));
                let case = Case {
                    name: format!("{name} ({rows}, {d})"),
                    dtype,
                    inputs: norm_inputs(rows, d, params, trained)?,
                    fwd: tols(dtype, F32_ROWS),
                    grads,
                    op,
                    weighted: true,
                };
                run(&dev, &case)?;
            }
        }
    }
    Ok(())
}

/// `(cos, sin)` of random angles in [-3, 3) of shape `dims`, the two halves different (so that a kernel
/// mixing up cos1 / cos2 fails), as f64 CPU tensors.
fn tables(dims: &[usize], seed: u64) -> Result<(Tensor, Tensor)> {
    let a = (tensor(dims, seed, DType::F64)? * 3.0)?;
    Ok((a.cos()?, a.sin()?))
}

#[test]
fn rope_matches_cpu() -> Result<()> {
    let Some(dev) = crate::cuda_device("rope_matches_cpu") else { return Ok(()) };
    // x dims, table dims: text (B, H, T, D) with (B, 1, T, D), (T, D) and (1, T, D) tables (the decoder's
    // M-RoPE tables are (B, 1, T, D)); vision (P, H, D) with (P, 1, D); a table broadcast along T only.
    let layouts: [(&[usize], &[usize]); 7] = [
        (&[1, 1, 1, 2], &[1, 1, 1, 2]),
        (&[2, 3, 7, 64], &[2, 1, 7, 64]),
        (&[1, 16, 129, 128], &[129, 128]),
        (&[1, 2, 1000, 80], &[1, 1000, 80]),
        (&[1, 16, 4097, 128], &[1, 1, 4097, 128]),
        (&[4097, 16, 80], &[4097, 1, 80]),
        (&[3, 5, 7, 64], &[3, 5, 1, 64]),
    ];
    let op = |t: &[Tensor]| rope(&t[0], &t[1], &t[2]);
    for dtype in DTYPES {
        for (i, &(xd, td)) in layouts.iter().enumerate() {
            let (c, s) = tables(td, 10 + i as u64)?;
            let case = Case {
                name: format!("rope x {xd:?} tables {td:?}"),
                dtype,
                inputs: vec![
                    float(tensor(xd, 20 + i as u64, DType::F64)?, true, true),
                    // The tables are Vars here on purpose: the op must still give them no gradient.
                    float(c, true, false),
                    float(s, true, false),
                ],
                fwd: tols(dtype, F32_ROPE),
                grads: vec![tols(dtype, F32_ROPE); 3],
                op: &op,
                weighted: true,
            };
            run(&dev, &case)?;
        }
    }
    Ok(())
}

/// Labels in [0, v) from the seeded uniform values, `u32::MAX` on unsupervised rows (never read); mask
/// 1 except on rows where `masked(r)`.
fn ce_inputs(n: usize, v: usize, seed: u64, masked: impl Fn(usize) -> bool) -> Result<Vec<Input>> {
    // Logits in [-8, 8): peaky enough that the softmax spans many orders of magnitude.
    let logits = (tensor(&[n, v], seed, DType::F64)? * 8.0)?;
    let u = common::uniform(n, seed + 1);
    let labels: Vec<u32> = (0..n)
        .map(|r| if masked(r) { u32::MAX } else { (((u[r] + 1.0) / 2.0 * v as f64) as usize).min(v - 1) as u32 })
        .collect();
    let mask: Vec<f64> = (0..n).map(|r| if masked(r) { 0.0 } else { 1.0 }).collect();
    Ok(vec![
        float(logits, true, true),
        Input { t: Tensor::from_vec(labels, n, &Device::Cpu)?, float: false, var: false, grad: false },
        float(Tensor::from_vec(mask, n, &Device::Cpu)?, false, false),
    ])
}

#[test]
fn cross_entropy_matches_cpu() -> Result<()> {
    let Some(dev) = crate::cuda_device("cross_entropy_matches_cpu") else { return Ok(()) };
    let op = |t: &[Tensor]| cross_entropy_masked(&t[0], &t[1], &t[2]);
    // (rows, vocab): tiny, odd, many rows over a small vocabulary, and the Qwen2.5-VL vocabulary.
    let sizes = [(1, 7), (7, 1000), (4097, 300), (129, 151936)];
    for dtype in DTYPES {
        for (i, &(n, v)) in sizes.iter().enumerate() {
            // Every third row unsupervised (none when n == 1).
            let masked = |r: usize| n > 1 && r % 3 == 1;
            let n_sup = (0..n).filter(|&r| !masked(r)).count() as f64;
            let (fwd, grad_tol) = (tols(dtype, CE_LOSS_F32), ce_grad_tol(dtype, n_sup));
            let case = Case {
                name: format!("cross_entropy ({n}, {v})"),
                dtype,
                inputs: ce_inputs(n, v, 30 + i as u64, masked)?,
                fwd,
                grads: vec![grad_tol, grad_tol, grad_tol],
                op: &op,
                weighted: false,
            };
            run(&dev, &case)?;
        }
    }
    Ok(())
}

#[test]
fn cross_entropy_all_masked_and_bad_labels() -> Result<()> {
    let Some(dev) = crate::cuda_device("cross_entropy_all_masked_and_bad_labels") else { return Ok(()) };
    for dtype in DTYPES {
        // Nothing supervised: loss 0 and an all-zero gradient, as the CPU op.
        let inputs = ce_inputs(5, 1000, 40, |_| true)?;
        let (vars, ts) = build(&inputs, &dev, dtype)?;
        let loss = cross_entropy_masked(&ts[0], &ts[1], &ts[2])?;
        let l = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        ensure!(l == 0.0, "all-masked cross_entropy {dtype:?}: loss {l}, want 0");
        let g = loss.backward()?;
        let dl = g.get(vars[0].as_ref().context("logits are a Var")?).context("all-masked: no logits gradient")?;
        // Exactly zero (a NaN fails too).
        compare_tensors(&format!("cross_entropy all-masked {dtype:?} gradient"), dl, &dl.zeros_like()?, EXACT)?;

        // A supervised label outside the vocabulary: a clear error, no launch.
        let mut inputs = ce_inputs(4, 100, 41, |_| false)?;
        inputs[1].t = Tensor::new(&[1u32, 2, 100, 3], &Device::Cpu)?;
        let (_, ts) = build(&inputs, &dev, dtype)?;
        match cross_entropy_masked(&ts[0], &ts[1], &ts[2]) {
            Err(e) => {
                let msg = e.to_string();
                ensure!(msg.contains("outside the vocabulary"), "bad label {dtype:?}: unexpected error: {msg}");
                eprintln!("cross_entropy bad label {dtype:?}: error as expected: {msg}");
            }
            Ok(l) => bail!("bad label {dtype:?}: expected an error, got loss {l}"),
        }
    }
    Ok(())
}

#[test]
fn frozen_linear_matches_cpu() -> Result<()> {
    let Some(dev) = crate::cuda_device("frozen_linear_matches_cpu") else { return Ok(()) };
    let op = |t: &[Tensor]| frozen_linear(&t[0], &t[1]);
    // x dims, (out, in): a single row, a batch with odd sizes, and a vision-sized projection.
    let sizes: [(&[usize], (usize, usize)); 3] =
        [(&[1, 64], (7, 64)), (&[2, 7, 80], (129, 80)), (&[1000, 1280], (2048, 1280))];
    for dtype in DTYPES {
        for (i, &(xd, (o, k))) in sizes.iter().enumerate() {
            // Weights scaled like a trained projection (1 / sqrt(in)), so outputs stay O(1).
            let w = (tensor(&[o, k], 50 + i as u64, DType::F64)? / (k as f64).sqrt())?;
            let case = Case {
                name: format!("frozen_linear x {xd:?} w ({o}, {k})"),
                dtype,
                inputs: vec![float(tensor(xd, 60 + i as u64, DType::F64)?, true, true), float(w, true, false)],
                fwd: tols(dtype, F32_GEMM),
                grads: vec![tols(dtype, F32_GEMM); 2],
                op: &op,
                weighted: true,
            };
            run(&dev, &case)?;
        }
    }
    Ok(())
}
