//! GPU tests of the CUDA attention kernels (`cuda/attention.cu`) against the CPU op (`ops::attention` on
//! f32, itself tested against `attention_reference` and finite differences in `tests/grad_attention.rs`).
//!
//! Each case runs the op on the GPU (f32 and bf16 storage) and on the CPU in f32 from the same numbers
//! (for bf16: the bf16-rounded inputs upcast to f32, so both sides see identical inputs), then compares
//! the output and the q, k, v gradients that candle's `backward` produces through the op's explicit
//! backward (loss `sum(O * W)`, so dO = W). Cases cover sequence lengths 1, 7, 129, 1000, 4097; causal
//! prefill and decode (Tq < Tk); no mask; block-diagonal windows (a size-1 and an empty segment, windows
//! of 64); GQA ratios 1, 2, 7; head dims 64, 80, 128 (exact kernels) and 17, 32, 48, 96 (bucketed, zero
//! padded); key padding, including rows that see no key at all (output exactly 0, no gradient).
//!
//! On a GPU from sm_80 bf16 runs the tensor-core kernels (`cuda/attention_tc.cu`) and f32 the CUDA-core
//! ones (`cuda/attention.cu`); the CUDA-core bf16 instances (the fallback on GPUs with less shared memory)
//! are not reached here.
//!
//! Failures are collected over all cases of a test and reported together, each from
//! `common::tol::compare`: per tensor the max abs error, how many elements are out of tolerance and the
//! worst of them (multi-index, got, want), with the case's shapes. Every comparison line is printed, so a run
//! with `--nocapture` is a full accuracy report.
//!
//! Run on a GPU machine: `cargo test -p askgui-kernels --features cuda --test cuda attention -- --nocapture`
//! (or the prebuilt test executable with the filter `attention`). Without a device the tests print
//! SKIPPED and pass.

use anyhow::{bail, ensure, Result};
use askgui_kernels::ops::attention;
use askgui_kernels::AttentionMask;
use candle_core::{DType, Device, Tensor, Var};
use std::time::Instant;

use crate::common;

// The tolerances of `tests/common/tol.rs`, whose comments give the reasons (shared with `tests/emu/`).
use crate::common::tol::{
    compare_tensors, Tol, BF16_ATTN as BF16_FWD, BF16_ATTN_GRAD as BF16_GRAD, F32_ATTN as F32_FWD,
    F32_ATTN_GRAD as F32_GRAD,
};

// The backward with the logsumexp recomputed against the one with the forward's saved logsumexp: the same
// kernels on the same inputs, only the order of the f32 atomics differs (f32: ~1e-7), which in bf16 can
// flip the final rounding by one bf16 step (2^-8 relative).
const RECOMPUTED_LSE_F32: Tol = Tol { atol: 1e-5, rtol: 1e-5 };
const RECOMPUTED_LSE_BF16: Tol = Tol { atol: 1e-2, rtol: 1e-2 };

#[derive(Clone, Debug)]
enum Mask {
    None,
    Causal,
    Windows(Vec<usize>),
    /// The same segments, causal inside each (packed training sequences).
    Packed(Vec<usize>),
}

/// One problem: `q (b, hq, tq, d)`, `k, v (b, hkv, tk, d)`, a mask, optional key padding `(b, tk)`.
#[derive(Clone, Debug)]
struct Case {
    name: String,
    b: usize,
    hq: usize,
    hkv: usize,
    tq: usize,
    tk: usize,
    d: usize,
    mask: Mask,
    pad: Option<Vec<f32>>,
}

fn case(name: &str, (b, hq, hkv): (usize, usize, usize), (tq, tk, d): (usize, usize, usize), mask: Mask) -> Case {
    Case { name: name.into(), b, hq, hkv, tq, tk, d, mask, pad: None }
}

/// Key padding `(b, tk)`: batch `bi` has keys `from..to` padded (0), everything else real (1).
fn padded(mut c: Case, bi: usize, from: usize, to: usize) -> Case {
    let tk = c.tk;
    c.pad =
        Some((0..c.b * tk).map(|x| if x / tk == bi && (from..to).contains(&(x % tk)) { 0.0 } else { 1.0 }).collect());
    c.name = format!("{}_pad{bi}[{from}..{to}]", c.name);
    c
}

/// Windows of `w` tokens over `t` (the last one shorter): cumulative boundaries.
fn windows(t: usize, w: usize) -> Vec<usize> {
    (0..t).step_by(w).chain([t]).collect()
}

impl Case {
    fn mask(&self) -> AttentionMask<'_> {
        match &self.mask {
            Mask::None => AttentionMask::None,
            Mask::Causal => AttentionMask::Causal,
            Mask::Windows(cu) => AttentionMask::BlockDiagonal(cu),
            Mask::Packed(cu) => AttentionMask::CausalBlockDiagonal(cu),
        }
    }

    fn shapes(&self) -> String {
        let mask = match &self.mask {
            Mask::None => "none".to_string(),
            Mask::Causal => "causal".to_string(),
            Mask::Windows(cu) if cu.len() <= 12 => format!("block-diagonal {cu:?}"),
            Mask::Windows(cu) => format!("block-diagonal ({} segments)", cu.len() - 1),
            Mask::Packed(cu) => format!("causal block-diagonal {cu:?}"),
        };
        let pad = if self.pad.is_some() { ", key padding" } else { "" };
        format!(
            "q ({}, {}, {}, {}), k/v ({}, {}, {}, {}), {mask}{pad}",
            self.b, self.hq, self.tq, self.d, self.b, self.hkv, self.tk, self.d
        )
    }
}

/// What one run of the op gives: output and gradients, as f32 on the CPU.
struct Run {
    out: Tensor,
    grads: [Tensor; 3],
}

/// `attention` on `device` with inputs (and W = dO) converted to `dtype` there; `sum(O * W).backward()`.
fn run(c: &Case, xs: &[Tensor; 4], dtype: DType, device: &Device) -> Result<Run> {
    let on = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(device)?) };
    let vars = [Var::from_tensor(&on(&xs[0])?)?, Var::from_tensor(&on(&xs[1])?)?, Var::from_tensor(&on(&xs[2])?)?];
    let w = on(&xs[3])?;
    let pad = match &c.pad {
        Some(p) => Some(Tensor::from_vec(p.clone(), (c.b, c.tk), &Device::Cpu)?.to_device(device)?),
        None => None,
    };
    let scale = 1.0 / (c.d as f64).sqrt();
    let out = attention(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), c.mask(), pad.as_ref(), scale)?;
    let grads = (&out * &w)?.sum_all()?.backward()?;
    let grad = |i: usize| -> Result<Tensor> {
        match grads.get(vars[i].as_tensor()) {
            Some(g) => Ok(g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?),
            None => bail!("{}: no gradient for input {i}", c.name),
        }
    };
    let grads = [grad(0)?, grad(1)?, grad(2)?];
    Ok(Run { out: out.to_dtype(DType::F32)?.to_device(&Device::Cpu)?, grads })
}

/// Runs every case in f32 and bf16 against the CPU op; fails with all the failures together.
fn check_cases(test: &str, cases: &[Case]) -> Result<()> {
    let Some(gpu) = crate::cuda_device(test) else { return Ok(()) };
    let mut failures = Vec::new();
    for (n, c) in cases.iter().enumerate() {
        let seed = 1000 * n as u64;
        // Values in [-2, 2) for q, k, v (softmax far from uniform), W = dO in [-1, 1).
        let xs = [
            (common::tensor(&[c.b, c.hq, c.tq, c.d], seed + 1, DType::F32)? * 2.0)?,
            (common::tensor(&[c.b, c.hkv, c.tk, c.d], seed + 2, DType::F32)? * 2.0)?,
            (common::tensor(&[c.b, c.hkv, c.tk, c.d], seed + 3, DType::F32)? * 2.0)?,
            common::tensor(&[c.b, c.hq, c.tq, c.d], seed + 4, DType::F32)?,
        ];
        for (dtype, fwd_tol, grad_tol) in [(DType::F32, F32_FWD, F32_GRAD), (DType::BF16, BF16_FWD, BF16_GRAD)] {
            let label = format!("{test}/{} {dtype:?}", c.name);
            // The CPU side sees exactly the numbers the GPU sees: rounded to `dtype`, back in f32.
            let rounded: Vec<Tensor> =
                xs.iter().map(|x| x.to_dtype(dtype)?.to_dtype(DType::F32)).collect::<candle_core::Result<_>>()?;
            let rounded: [Tensor; 4] = [rounded[0].clone(), rounded[1].clone(), rounded[2].clone(), rounded[3].clone()];
            let t0 = Instant::now();
            let got = match run(c, &rounded, dtype, &gpu) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("FAIL {label}: {} : the GPU op failed: {e}", c.shapes());
                    failures.push(format!("{label} ({}): GPU op error: {e}", c.shapes()));
                    continue;
                }
            };
            let gpu_s = t0.elapsed().as_secs_f64();
            let t0 = Instant::now();
            let want = run(c, &rounded, DType::F32, &Device::Cpu)?;
            eprintln!(
                "{label}: {} (GPU {gpu_s:.3} s incl. copies, CPU {:.3} s)",
                c.shapes(),
                t0.elapsed().as_secs_f64()
            );
            let parts = [("O", &got.out, &want.out, fwd_tol)];
            let grads = [("dq", 0, grad_tol), ("dk", 1, grad_tol), ("dv", 2, grad_tol)];
            let grads = grads.iter().map(|&(w, i, t)| (w, &got.grads[i], &want.grads[i], t));
            for (what, g, w, tol) in parts.into_iter().chain(grads) {
                if let Err(f) = compare_tensors(&format!("  {label} {what}"), g, w, tol) {
                    failures.push(format!("{label} ({}): {f}", c.shapes()));
                }
            }
        }
    }
    if !failures.is_empty() {
        bail!("{} comparison(s) out of tolerance:\n{}", failures.len(), failures.join("\n"))
    }
    Ok(())
}

#[test]
fn attention_short_causal_gqa_head_dims() -> Result<()> {
    let c = |n, h, t, m| case(n, h, t, m);
    check_cases(
        "attention_short_causal_gqa_head_dims",
        &[
            c("t1_causal_gqa2_d64", (1, 4, 2), (1, 1, 64), Mask::Causal),
            c("t7_causal_gqa7_d80", (2, 7, 1), (7, 7, 80), Mask::Causal),
            c("t129_causal_gqa7_d128", (1, 14, 2), (129, 129, 128), Mask::Causal),
            c("t129_none_gqa1_d80", (1, 2, 2), (129, 129, 80), Mask::None),
            // Batch 1's first 5 keys are padding: under the causal mask its rows 0..5 see no key.
            padded(c("t70_causal_d64", (2, 2, 1), (70, 70, 64), Mask::Causal), 1, 0, 5),
            c("decode_t7_tk1000_gqa7_d128", (1, 7, 1), (7, 1000, 128), Mask::Causal),
            padded(c("decode_t1_tk129_gqa2_d64", (2, 4, 2), (1, 129, 64), Mask::Causal), 1, 0, 40),
        ],
    )
}

#[test]
fn attention_long_sequences() -> Result<()> {
    let c = |n, h, t, m| case(n, h, t, m);
    check_cases(
        "attention_long_sequences",
        &[
            padded(c("t1000_none_gqa1_d64", (2, 2, 2), (1000, 1000, 64), Mask::None), 1, 900, 1000),
            c("t4097_causal_gqa2_d128", (1, 4, 2), (4097, 4097, 128), Mask::Causal),
            c("decode_t129_tk4097_gqa2_d80", (1, 4, 2), (129, 4097, 80), Mask::Causal),
            padded(c("decode_t1_tk1000_gqa7_d128", (2, 14, 2), (1, 1000, 128), Mask::Causal), 1, 0, 300),
        ],
    )
}

#[test]
fn attention_block_diagonal_windows() -> Result<()> {
    let c = |n, h, t, m| case(n, h, t, m);
    check_cases(
        "attention_block_diagonal_windows",
        &[
            // Segments of 64, 1, 35, 129, 0 and 771 tokens: unaligned to the 64-row tiles.
            c("varied_gqa2_d80", (1, 4, 2), (1000, 1000, 80), Mask::Windows(vec![0, 64, 65, 100, 229, 229, 1000])),
            c("windows64_gqa1_d80", (1, 4, 4), (1000, 1000, 80), Mask::Windows(windows(1000, 64))),
            c("odd_gqa7_d128", (1, 7, 1), (300, 300, 128), Mask::Windows(vec![0, 1, 130, 300])),
            c("one_window_d64", (1, 2, 1), (129, 129, 64), Mask::Windows(vec![0, 129])),
            // Packed sequences of 64, 1, 35, 129, 0 and 771 tokens, causal inside each.
            c("packed_gqa2_d128", (1, 4, 2), (1000, 1000, 128), Mask::Packed(vec![0, 64, 65, 100, 229, 229, 1000])),
            c("packed_odd_gqa7_d80", (1, 7, 1), (300, 300, 80), Mask::Packed(vec![0, 1, 130, 300])),
        ],
    )
}

#[test]
fn attention_bucketed_head_dims() -> Result<()> {
    let c = |n, h, t, m| case(n, h, t, m);
    check_cases(
        "attention_bucketed_head_dims",
        &[
            c("d17_causal", (1, 4, 2), (77, 77, 17), Mask::Causal),
            c("d32_causal", (1, 4, 2), (77, 77, 32), Mask::Causal),
            c("d48_none", (1, 2, 1), (77, 100, 48), Mask::None),
            c("d96_windows", (1, 2, 2), (150, 150, 96), Mask::Windows(vec![0, 70, 150])),
        ],
    )
}

/// The backward without the forward's saved logsumexp (recomputed on the device, the forward kernel
/// reading q out of the packed [q, O, dO]) equals the one with it, in f32 and bf16.
#[test]
fn attention_backward_recomputes_missing_logsumexp() -> Result<()> {
    let test = "attention_backward_recomputes_missing_logsumexp";
    let Some(gpu) = crate::cuda_device(test) else { return Ok(()) };
    let (b, hq, hkv, t, d) = (1, 4, 2, 150, 80);
    let scale = 1.0 / (d as f64).sqrt();
    let mask = AttentionMask::BlockDiagonal(&[0, 70, 71, 150]);
    let mut failures = Vec::new();
    for (dtype, tol) in [(DType::F32, RECOMPUTED_LSE_F32), (DType::BF16, RECOMPUTED_LSE_BF16)] {
        let x = |dims: &[usize], s| -> Result<Tensor> {
            Ok((common::tensor(dims, s, DType::F32)? * 2.0)?.to_dtype(dtype)?.to_device(&gpu)?)
        };
        let (q, k, v, w) =
            (x(&[b, hq, t, d], 1)?, x(&[b, hkv, t, d], 2)?, x(&[b, hkv, t, d], 3)?, x(&[b, hq, t, d], 4)?);
        let vars = [Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?];
        let o = attention(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), mask, None, scale)?;
        let g = (&o * &w)?.sum_all()?.backward()?;
        let recomputed = attention::attention_grads_recomputing_lse(&q, &k, &v, &o.detach(), &w, mask, None, scale)?;
        for (i, what) in ["dq", "dk", "dv"].iter().enumerate() {
            let Some(saved) = g.get(vars[i].as_tensor()) else { bail!("{test}: no {what}") };
            let cpu = |t: &Tensor| t.to_dtype(DType::F32)?.to_device(&Device::Cpu);
            let label = format!("  {test} {dtype:?} {what}");
            if let Err(f) = compare_tensors(&label, &cpu(&recomputed[i])?, &cpu(saved)?, tol) {
                failures.push(f.to_string());
            }
        }
    }
    ensure!(failures.is_empty(), "{test}:\n{}", failures.join("\n"));
    Ok(())
}

/// Unsupported head dims and mixed dtypes are refused with messages that say why.
#[test]
fn attention_refuses_bad_inputs_on_gpu() -> Result<()> {
    let test = "attention_refuses_bad_inputs_on_gpu";
    let Some(gpu) = crate::cuda_device(test) else { return Ok(()) };
    let x = |dims: &[usize], dt: DType| -> Result<Tensor> { Ok(common::tensor(dims, 5, dt)?.to_device(&gpu)?) };
    let expect = |r: candle_core::Result<Tensor>, needle: &str| -> Result<()> {
        let msg = r.err().map(|e| e.to_string()).unwrap_or_default();
        eprintln!("{test}: expected error mentioning {needle:?}: {msg}");
        ensure!(msg.contains(needle), "expected an error mentioning {needle:?}, got {msg:?}");
        Ok(())
    };
    let (q, kv) = (x(&[1, 2, 8, 200], DType::F32)?, x(&[1, 2, 8, 200], DType::F32)?);
    expect(attention(&q, &kv, &kv, AttentionMask::Causal, None, 0.1), "head dim 200")?;
    let (q, kv) = (x(&[1, 2, 8, 64], DType::F32)?, x(&[1, 2, 8, 64], DType::BF16)?);
    expect(attention(&q, &kv, &kv, AttentionMask::Causal, None, 0.1), "must all be f32 or all bf16")?;
    let (q, kv) = (x(&[1, 2, 8, 64], DType::F16)?, x(&[1, 2, 8, 64], DType::F16)?);
    expect(attention(&q, &kv, &kv, AttentionMask::Causal, None, 0.1), "must all be f32 or all bf16")?;
    Ok(())
}
