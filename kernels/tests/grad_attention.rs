//! Tests for the attention CustomOp `askgui_kernels::ops::attention` against `attention_reference`.
//!
//! On odd sizes (GQA 6/2 heads, 13 positions, head dim 7; a decode step with 1 query and 9 keys;
//! block-diagonal segments `[0, 5, 6, 13]`; left key padding that leaves whole query rows without a
//! visible key; 150 keys, more than one streaming key block): the f32 forward against the reference, the
//! f32 gradients of q, k, v against candle's autograd through the reference, and the f64 gradients against
//! central finite differences. Query rows with no visible key are compared only through their documented
//! behaviour (exact 0 output, no gradient), since the reference returns an arbitrary finite average there.
//! In bf16, the op and its backward op against the f32 ones on the same bf16-rounded inputs. Every
//! comparison goes through `common::tol` (`REF_ATTN_F32`, `REF_ATTN_F32_GRAD`, `FD`, with their reasons).
//! Run: `cargo test -p askgui-kernels --test grad_attention -- --nocapture` (prints the measured differences).

mod common;

use anyhow::{ensure, Result};
use askgui_kernels::ops::attention;
use askgui_kernels::ops::attention::attention_grads_recomputing_lse;
use askgui_kernels::ops::{attention_replay, attention_saving};
use askgui_kernels::{attention_reference, AttentionMask};
use candle_core::{DType, Device, Tensor, Var};
use common::tol::{compare_tensors, ensure_close, FD, REF_ATTN_F32, REF_ATTN_F32_GRAD};
use common::{bf16, central_differences, flat};

/// Values in [-2, 2) so that the softmax is far from uniform.
fn tensor(dims: &[usize], seed: u64, dtype: DType) -> Result<Tensor> {
    Ok((common::tensor(dims, seed, dtype)? * 2.0)?)
}

/// One test case: sizes, mask, key padding flags `(B, Tk)` if any.
struct Case {
    name: &'static str,
    b: usize,
    hq: usize,
    hkv: usize,
    tq: usize,
    tk: usize,
    d: usize,
    cu: Option<Vec<usize>>,
    causal: bool,
    pad: Option<Vec<f32>>,
}

impl Case {
    fn mask(&self) -> AttentionMask<'_> {
        match (&self.cu, self.causal) {
            (Some(cu), false) => AttentionMask::BlockDiagonal(cu),
            (Some(cu), true) => AttentionMask::CausalBlockDiagonal(cu),
            (None, true) => AttentionMask::Causal,
            (None, false) => AttentionMask::None,
        }
    }

    fn padding(&self) -> Result<Option<Tensor>> {
        Ok(match &self.pad {
            Some(p) => Some(Tensor::from_vec(p.clone(), (self.b, self.tk), &Device::Cpu)?),
            None => None,
        })
    }

    fn inputs(&self, dtype: DType) -> Result<[Tensor; 3]> {
        Ok([
            tensor(&[self.b, self.hq, self.tq, self.d], 11, dtype)?,
            tensor(&[self.b, self.hkv, self.tk, self.d], 12, dtype)?,
            tensor(&[self.b, self.hkv, self.tk, self.d], 13, dtype)?,
        ])
    }

    fn scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }

    /// `(B, Hq, Tq, 1)`: 1 for query rows with at least one visible key, 0 otherwise (computed by hand).
    fn row_mask(&self, dtype: DType) -> Result<Tensor> {
        let mut m = Vec::with_capacity(self.b * self.hq * self.tq);
        for b in 0..self.b {
            for _ in 0..self.hq {
                for i in 0..self.tq {
                    let any = (0..self.tk).any(|j| {
                        let causal_ok = !self.causal || j <= self.tk - self.tq + i;
                        let pad_ok = self.pad.as_ref().is_none_or(|p| p[b * self.tk + j] == 1.0);
                        causal_ok && pad_ok
                    });
                    m.push(if any { 1.0 } else { 0.0 });
                }
            }
        }
        Ok(Tensor::from_vec(m, (self.b, self.hq, self.tq, 1), &Device::Cpu)?.to_dtype(dtype)?)
    }
}

fn cases() -> Vec<Case> {
    let base = |name, causal| Case { name, b: 2, hq: 6, hkv: 2, tq: 13, tk: 13, d: 7, cu: None, causal, pad: None };
    // Batch 1 is left-padded by 4 keys: under the causal mask its query rows 0..4 see no key at all.
    let left_pad: Vec<f32> = (0..26).map(|i| if (13..17).contains(&i) { 0.0 } else { 1.0 }).collect();
    let long = |name, causal| Case { b: 2, hq: 2, hkv: 1, tq: 150, tk: 150, d: 5, ..base(name, causal) };
    let long_pad: Vec<f32> = (0..300).map(|i| if (150..230).contains(&i) { 0.0 } else { 1.0 }).collect();
    vec![
        base("full", false),
        base("causal", true),
        Case { name: "decode", tq: 1, tk: 9, ..base("", true) },
        Case { name: "block_diagonal", b: 1, cu: Some(vec![0, 5, 6, 13]), ..base("", false) },
        Case { name: "causal_left_padding", pad: Some(left_pad.clone()), ..base("", true) },
        Case { name: "full_left_padding", pad: Some(left_pad), ..base("", false) },
        // More keys than one streaming block (64): exercises the online rescaling across blocks.
        Case { name: "long_causal_padding", tq: 70, pad: Some(long_pad), ..long("", true) },
        Case { name: "long_block_diagonal", b: 1, cu: Some(vec![0, 70, 71, 150]), ..long("", false) },
        // Packed sequences: causal inside each segment, the first longer than one query block.
        Case { name: "causal_block_diagonal", b: 1, cu: Some(vec![0, 5, 5, 6, 13]), ..base("", true) },
        Case { name: "long_causal_block_diagonal", b: 1, cu: Some(vec![0, 70, 71, 150]), ..long("", true) },
        // Qwen3-VL: the vision head dim 72 (1152 / 16) over two whole images, and the decoder's head dim
        // 128 with GQA 4 (32 / 8 heads at 8B), causal.
        Case { name: "qwen3_vl_vision_d72", b: 1, hq: 2, hkv: 2, d: 72, cu: Some(vec![0, 9, 13]), ..base("", false) },
        Case { name: "qwen3_vl_decoder_d128_gqa4", b: 1, hq: 4, hkv: 1, d: 128, ..base("", true) },
    ]
}

#[test]
fn forward_and_gradients_match_reference() -> Result<()> {
    for case in cases() {
        let [q, k, v] = case.inputs(DType::F32)?;
        let (qv, kv, vv) = (Var::from_tensor(&q)?, Var::from_tensor(&k)?, Var::from_tensor(&v)?);
        let pad = case.padding()?;
        let y = attention(&qv, &kv, &vv, case.mask(), pad.as_ref(), case.scale())?;
        let y_ref = attention_reference(&qv, &kv, &vv, case.mask(), pad.as_ref(), case.scale())?;
        ensure!(flat(&y)?.iter().all(|x| x.is_finite()), "{}: non-finite output", case.name);
        // Rows with no visible key: exactly 0 (documented); compared rows: the others.
        let rows = case.row_mask(DType::F32)?;
        let hidden = flat(&y.broadcast_mul(&(1.0 - &rows)?)?)?;
        ensure!(hidden.iter().all(|&x| x == 0.0), "{}: a row with no visible key is not 0", case.name);
        let (ym, yrm) = (y.broadcast_mul(&rows)?, y_ref.broadcast_mul(&rows)?);
        compare_tensors(&format!("{} forward", case.name), &ym, &yrm, REF_ATTN_F32)?;

        let r = tensor(y.dims(), 99, DType::F32)?.broadcast_mul(&rows)?;
        let g = (&y * &r)?.sum_all()?.backward()?;
        let g_ref = (&y_ref * &r)?.sum_all()?.backward()?;
        for (what, t) in [("dq", &qv), ("dk", &kv), ("dv", &vv)] {
            let (Some(a), Some(b)) = (g.get(t), g_ref.get(t)) else { anyhow::bail!("{}: missing {what}", case.name) };
            compare_tensors(&format!("{} {what}", case.name), a, b, REF_ATTN_F32_GRAD)?;
        }
    }
    Ok(())
}

/// In bf16, Attention is the f32 op on the bf16-rounded q, k, v with `O` rounded once, and AttentionBwd
/// the f32 backward op on its own inputs `[q, O, dO]`, k, v with the gradients rounded once. `O` is one of
/// those inputs, so the f32 twin of the backward gets the bf16 `O` (through
/// `attention_grads_recomputing_lse`, whose recomputed logsumexp is the f32 forward's); `dO = r` holds bf16
/// values. Tolerance: [`common::bf16::ROUNDING`]. Rows with no visible key are 0 on both sides.
#[test]
fn bf16_is_the_f32_op_rounded_once() -> Result<()> {
    for case in cases() {
        let [q, k, v] = case.inputs(DType::F32)?;
        let ((qb, qf), (kb, kf), (vb, vf)) = (bf16::pair(&q)?, bf16::pair(&k)?, bf16::pair(&v)?);
        let (qb, kb, vb) = (Var::from_tensor(&qb)?, Var::from_tensor(&kb)?, Var::from_tensor(&vb)?);
        let pad = case.padding()?;
        let (padb, scale) = (pad.as_ref().map(|p| p.to_dtype(DType::BF16)).transpose()?, case.scale());
        let yb = attention(&qb, &kb, &vb, case.mask(), padb.as_ref(), scale)?;
        let yf = attention(&qf, &kf, &vf, case.mask(), pad.as_ref(), scale)?;
        bf16::check(&format!("{} forward", case.name), &yb, &yf)?;

        let r = tensor(yb.dims(), 99, DType::BF16)?;
        let g = (&yb * &r)?.sum_all()?.backward()?;
        let (ob, rf) = (yb.detach().to_dtype(DType::F32)?, r.to_dtype(DType::F32)?);
        let want = attention_grads_recomputing_lse(&qf, &kf, &vf, &ob, &rf, case.mask(), pad.as_ref(), case.scale())?;
        for ((what, t), want) in [("dq", &qb), ("dk", &kb), ("dv", &vb)].into_iter().zip(&want) {
            let got = g.get(t).ok_or_else(|| anyhow::anyhow!("{}: missing {what}", case.name))?;
            bf16::check(&format!("{} {what}", case.name), got, want)?;
        }
    }
    Ok(())
}

/// `sum(attention(q, k, v) * r)` in f64.
fn loss(case: &Case, xs: &[Tensor], r: &Tensor) -> Result<Tensor> {
    let pad = case.padding()?.map(|p| p.to_dtype(DType::F64)).transpose()?;
    let y = attention(&xs[0], &xs[1], &xs[2], case.mask(), pad.as_ref(), case.scale())?;
    Ok((y * r)?.sum_all()?)
}

#[test]
fn gradients_match_finite_differences_f64() -> Result<()> {
    let small = |name| Case { name, b: 2, hq: 4, hkv: 2, tq: 5, tk: 5, d: 3, cu: None, causal: true, pad: None };
    let pad: Vec<f32> = (0..10).map(|i| if (5..7).contains(&i) { 0.0 } else { 1.0 }).collect();
    let fd_cases = [
        Case { pad: Some(pad), ..small("causal_left_padding") },
        Case { tq: 2, tk: 6, ..small("decode") },
        Case { b: 1, tk: 6, tq: 6, causal: false, cu: Some(vec![0, 2, 2, 6]), ..small("block_diagonal") },
    ];
    for case in fd_cases {
        let inputs = case.inputs(DType::F64)?;
        let vars = inputs.iter().map(Var::from_tensor).collect::<candle_core::Result<Vec<_>>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let r = tensor(&[case.b, case.hq, case.tq, case.d], 7, DType::F64)?;
        let grads = loss(&case, &ts, &r)?.backward()?;
        for (i, what) in ["dq", "dk", "dv"].iter().enumerate() {
            let analytic = flat(grads.get(&ts[i]).ok_or_else(|| anyhow::anyhow!("{}: no {what}", case.name))?)?;
            let dims = inputs[i].dims();
            let numeric = central_differences(&flat(&inputs[i])?, |v| {
                let mut xs = inputs.to_vec();
                xs[i] = Tensor::from_vec(v.to_vec(), dims, &Device::Cpu)?;
                Ok(loss(&case, &xs, &r)?.to_scalar::<f64>()?)
            })?;
            ensure_close(&format!("{} {what} vs finite differences", case.name), dims, &analytic, &numeric, FD)?;
        }
    }
    Ok(())
}

/// A replayed forward (gradient checkpointing's recomputation) gives bitwise the output and gradients of
/// computing it again, in f32, f64 and bf16 and for every mask; a saved forward of another shape is
/// refused.
#[test]
fn replay_is_bitwise_the_op() -> Result<()> {
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        for case in cases() {
            let pad = case.padding()?;
            let args = (case.mask(), pad.as_ref(), case.scale());
            let [q, k, v] = case.inputs(dtype)?;
            let (o, saved) = attention_saving(&q, &k, &v, args.0, args.1, args.2)?;
            let saved = saved.ok_or_else(|| anyhow::anyhow!("{}: the CPU forward saved nothing", case.name))?;
            let r = tensor(o.dims(), 99, dtype)?;
            let run = |replay: bool| -> Result<Vec<Vec<f64>>> {
                let vars = [&q, &k, &v].map(|t| Var::from_tensor(t).expect("a contiguous tensor"));
                let [qv, kv, vv] = &vars;
                let y = match replay {
                    true => attention_replay(qv, kv, vv, args, saved.clone())?,
                    false => attention(qv, kv, vv, args.0, args.1, args.2)?,
                };
                let g = (&y * &r)?.sum_all()?.backward()?;
                let mut out = vec![flat(&y)?];
                for t in &vars {
                    let gt = g.get(t).ok_or_else(|| anyhow::anyhow!("{}: missing a gradient", case.name))?;
                    out.push(flat(gt)?);
                }
                Ok(out)
            };
            let (fresh, replayed) = (run(false)?, run(true)?);
            let same = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            ensure!(same(&flat(&o)?, &fresh[0]), "{} {dtype:?}: the saving forward differs from the op", case.name);
            for (what, (a, b)) in ["output", "dq", "dk", "dv"].iter().zip(fresh.iter().zip(&replayed)) {
                ensure!(a.len() == b.len() && same(a, b), "{} {dtype:?}: replayed {what} differs", case.name);
            }
        }
    }
    let case = &cases()[0];
    let [q, k, v] = case.inputs(DType::F32)?;
    let (_, saved) = attention_saving(&q, &k, &v, case.mask(), None, case.scale())?;
    let q2 = q.narrow(2, 0, 5)?;
    let args = (case.mask(), None, case.scale());
    let err = attention_replay(&q2, &k, &v, args, saved.expect("saved")).err().map(|e| e.to_string());
    ensure!(err.as_deref().is_some_and(|e| e.contains("does not match q")), "got {err:?}");
    Ok(())
}

#[test]
fn inputs_without_gradient_get_none() -> Result<()> {
    let case = &cases()[1];
    let [q, k, v] = case.inputs(DType::F32)?;
    let qv = Var::from_tensor(&q)?;
    let g = attention(&qv, &k, &v, case.mask(), None, case.scale())?.sum_all()?.backward()?;
    ensure!(g.get(&qv).is_some(), "q must get a gradient");
    ensure!(g.get(&k).is_none() && g.get(&v).is_none(), "k and v track no gradient and must get no entry");
    Ok(())
}

#[test]
fn bad_inputs_are_refused_with_shapes() -> Result<()> {
    let t = |dims: &[usize]| tensor(dims, 1, DType::F32);
    let expect = |r: candle_core::Result<Tensor>, needle: &str| -> Result<()> {
        let msg = r.err().map(|e| e.to_string()).unwrap_or_default();
        ensure!(msg.contains(needle), "expected an error mentioning {needle:?}, got {msg:?}");
        Ok(())
    };
    let (q, kv) = (t(&[1, 4, 6, 3])?, t(&[1, 2, 6, 3])?);
    expect(attention(&t(&[4, 6, 3])?, &kv, &kv, AttentionMask::None, None, 1.0), "[4, 6, 3]")?;
    expect(attention(&q, &t(&[1, 3, 6, 3])?, &t(&[1, 3, 6, 3])?, AttentionMask::None, None, 1.0), "Hq % Hkv")?;
    expect(attention(&t(&[1, 4, 7, 3])?, &kv, &kv, AttentionMask::Causal, None, 1.0), "7 queries but only 6")?;
    expect(attention(&q, &kv, &kv, AttentionMask::BlockDiagonal(&[0, 4]), None, 1.0), "cu_seqlens [0, 4]")?;
    let (q2, kv2) = (t(&[2, 4, 6, 3])?, t(&[2, 2, 6, 3])?);
    expect(attention(&q2, &kv2, &kv2, AttentionMask::BlockDiagonal(&[0, 6]), None, 1.0), "B == 1")?;
    let pad = Tensor::ones((1, 5), DType::F32, &Device::Cpu)?;
    expect(attention(&q, &kv, &kv, AttentionMask::None, Some(&pad), 1.0), "key_padding must be (B, Tk)")?;
    let q64 = q.to_dtype(DType::F64)?;
    expect(attention(&q64, &kv, &kv, AttentionMask::None, None, 1.0), "f32, f64 or bf16")?;
    Ok(())
}
