//! Gradient tests for the training-grade CustomOps in `askgui_kernels::ops`.
//!
//! Each op is checked three ways, on odd sizes: its forward against its plain-candle `*_reference` twin
//! (f32), its backward against candle's autograd through that reference (f32), and its backward against
//! central finite differences (f64). Frozen inputs must get no `GradStore` entry at all. In bf16, each op's
//! forward and backward are checked against the same op in f32 on the bf16-rounded inputs
//! ([`common::bf16`]); the masked cross-entropy is also checked on infinite and NaN logits, against
//! values derived by hand. Every comparison goes through `common::tol` (`REF_F32`, `FD`, `HAND_*`, with
//! their reasons).
//! Run: `cargo test -p askgui-kernels --test grad_ops -- --nocapture` (prints the measured differences).

mod common;

use anyhow::{ensure, Result};
use askgui_kernels::ops::{
    cross_entropy_masked, cross_entropy_masked_reference, frozen_linear, frozen_linear_reference, layer_norm,
    layer_norm_frozen, linear_parts, rms_norm, rms_norm_frozen, swiglu, swiglu_reference,
};
use askgui_kernels::{layer_norm_reference, rms_norm_reference};
use candle_core::{DType, Device, Tensor, Var};
use common::tol::{compare_tensors, ensure_close, FD, HAND_BF16, HAND_F32, REF_F32};
use common::{bf16, central_differences, flat, tensor};

const EPS: f64 = 1e-5;

/// A scalar loss `sum(y * r)` with a fixed random `r`, so that every output element has its own weight.
fn weighted_sum(y: &Tensor, seed: u64) -> Result<Tensor> {
    let r = tensor(y.dims(), seed, y.dtype())?;
    Ok(y.mul(&r)?.sum_all()?)
}

type Op<'a> = dyn Fn(&[Tensor]) -> candle_core::Result<Tensor> + 'a;

/// Forward and autograd gradients of `op` and `reference` agree (f32) for every input in `inputs`.
fn check_against_reference(name: &str, op: &Op<'_>, reference: &Op<'_>, inputs: &[Tensor]) -> Result<()> {
    let vars = inputs.iter().map(|t| Var::from_tensor(t).map_err(Into::into)).collect::<Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let (y, y_ref) = (op(&ts)?, reference(&ts)?);
    compare_tensors(&format!("{name} forward {:?}", ts[0].dims()), &y, &y_ref, REF_F32)?;
    let grads = weighted_sum(&y, 99)?.backward()?;
    let grads_ref = weighted_sum(&y_ref, 99)?.backward()?;
    for (i, t) in ts.iter().enumerate() {
        let (Some(g), Some(g_ref)) = (grads.get(t), grads_ref.get(t)) else {
            anyhow::bail!("{name}: input {i} is missing a gradient")
        };
        compare_tensors(&format!("{name} grad[{i}] {:?}", ts[0].dims()), g, g_ref, REF_F32)?;
    }
    Ok(())
}

/// The op's backward equals central finite differences (f64) for the inputs listed in `check`.
fn check_finite_differences(name: &str, op: &Op<'_>, inputs: &[Tensor], check: &[usize]) -> Result<()> {
    let vars = inputs.iter().map(|t| Var::from_tensor(t).map_err(Into::into)).collect::<Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let grads = weighted_sum(&op(&ts)?, 7)?.backward()?;
    let loss = |xs: &[Tensor]| -> Result<f64> { Ok(weighted_sum(&op(xs)?, 7)?.to_scalar::<f64>()?) };
    for &i in check {
        let analytic = flat(grads.get(&ts[i]).ok_or_else(|| anyhow::anyhow!("{name}: no gradient for input {i}"))?)?;
        let dims = inputs[i].dims();
        let numeric = central_differences(&flat(&inputs[i])?, |v| {
            let mut xs = inputs.to_vec();
            xs[i] = Tensor::from_vec(v.to_vec(), dims, &Device::Cpu)?;
            loss(&xs)
        })?;
        ensure_close(&format!("{name} input {i} vs finite differences"), dims, &analytic, &numeric, FD)?;
    }
    Ok(())
}

/// The op in bf16 against the op in f32 on the same bf16-rounded inputs: the forward, and the gradients of
/// the inputs in `wrt` through `sum(y * r)`. `r` holds bf16 values, so both backward ops get the same
/// upstream gradient and differ only by the rounding of their outputs. Inputs that are not f32 (labels)
/// are passed as they are.
fn check_bf16(name: &str, op: &Op<'_>, inputs: &[Tensor], wrt: &[usize]) -> Result<()> {
    let (mut tb, mut tf) = (vec![], vec![]);
    for t in inputs {
        let (b, f) = match t.dtype() {
            DType::F32 => bf16::pair(t)?,
            _ => (t.clone(), t.clone()),
        };
        let var = |t: Tensor| -> Result<Tensor> {
            Ok(if t.dtype().is_float() { Var::from_tensor(&t)?.as_tensor().clone() } else { t })
        };
        tb.push(var(b)?);
        tf.push(var(f)?);
    }
    let (yb, yf) = (op(&tb)?, op(&tf)?);
    let label = format!("{name} {:?}", inputs[0].dims());
    bf16::check(&format!("{label} forward"), &yb, &yf)?;
    let r = tensor(yb.dims(), 99, DType::BF16)?;
    let gb = yb.mul(&r)?.sum_all()?.backward()?;
    let gf = yf.mul(&r.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
    for &i in wrt {
        let (Some(b), Some(f)) = (gb.get(&tb[i]), gf.get(&tf[i])) else {
            anyhow::bail!("{label}: input {i} is missing a gradient")
        };
        bf16::check(&format!("{label} grad[{i}]"), b, f)?;
    }
    Ok(())
}

const SHAPES: [&[usize]; 2] = [&[7, 13], &[3, 5, 31]];

#[test]
fn ops_in_bf16_are_the_f32_ops_rounded_once() -> Result<()> {
    for dims in SHAPES {
        let d = *dims.last().unwrap();
        let (x, w, b) = (tensor(dims, 1, DType::F32)?, tensor(&[d], 2, DType::F32)?, tensor(&[d], 3, DType::F32)?);
        let rms: &Op = &|t| rms_norm(&t[0], &t[1], EPS);
        check_bf16("rms_norm", rms, &[x.clone(), w.clone()], &[0, 1])?;
        let ln: &Op = &|t| layer_norm(&t[0], &t[1], &t[2], EPS);
        check_bf16("layer_norm", ln, &[x.clone(), w, b], &[0, 1, 2])?;
        let lin: &Op = &|t| frozen_linear(&t[0], &t[1]);
        check_bf16("frozen_linear", lin, &[x.clone(), tensor(&[11, d], 7, DType::F32)?], &[0])?;
        let act: &Op = &|t| swiglu(&t[0], &t[1]);
        check_bf16("swiglu", act, &[(x * 4.0)?, tensor(dims, 8, DType::F32)?], &[0, 1])?;
    }
    for (n, v) in [(7, 13), (15, 31)] {
        let ce: &Op = &|t| cross_entropy_masked(&t[0], &t[1], &t[2]);
        check_bf16("cross_entropy", ce, &ce_inputs(n, v, DType::F32)?, &[0])?;
    }
    Ok(())
}

#[test]
fn rms_norm_matches_reference_and_finite_differences() -> Result<()> {
    let op: &Op = &|t| rms_norm(&t[0], &t[1], EPS);
    for dims in SHAPES {
        let d = *dims.last().unwrap();
        let inputs = [tensor(dims, 1, DType::F32)?, tensor(&[d], 2, DType::F32)?];
        check_against_reference("rms_norm", op, &|t| rms_norm_reference(&t[0], &t[1], EPS), &inputs)?;
        let inputs = [tensor(dims, 1, DType::F64)?, tensor(&[d], 2, DType::F64)?];
        check_finite_differences("rms_norm", op, &inputs, &[0, 1])?;
    }
    Ok(())
}

#[test]
fn layer_norm_matches_reference_and_finite_differences() -> Result<()> {
    let op: &Op = &|t| layer_norm(&t[0], &t[1], &t[2], EPS);
    for dims in SHAPES {
        let d = *dims.last().unwrap();
        let mk = |dtype| -> Result<[Tensor; 3]> {
            Ok([tensor(dims, 3, dtype)?, tensor(&[d], 4, dtype)?, tensor(&[d], 5, dtype)?])
        };
        check_against_reference(
            "layer_norm",
            op,
            &|t| layer_norm_reference(&t[0], &t[1], &t[2], EPS),
            &mk(DType::F32)?,
        )?;
        check_finite_differences("layer_norm", op, &mk(DType::F64)?, &[0, 1, 2])?;
    }
    Ok(())
}

#[test]
fn frozen_linear_matches_reference_and_finite_differences() -> Result<()> {
    let op: &Op = &|t| frozen_linear(&t[0], &t[1]);
    for dims in SHAPES {
        let d_in = *dims.last().unwrap();
        let mk = |dtype| -> Result<[Tensor; 2]> { Ok([tensor(dims, 6, dtype)?, tensor(&[11, d_in], 7, dtype)?]) };
        let [x, w] = mk(DType::F32)?;
        let xv = Var::from_tensor(&x)?;
        let (y, y_ref) = (frozen_linear(&xv, &w)?, frozen_linear_reference(&xv, &w)?);
        compare_tensors(&format!("frozen_linear forward {dims:?}"), &y, &y_ref, REF_F32)?;
        let g = weighted_sum(&y, 8)?.backward()?;
        let g_ref = weighted_sum(&y_ref, 8)?.backward()?;
        let (dx, dx_ref) = (g.get(&xv).unwrap(), g_ref.get(&xv).unwrap());
        compare_tensors(&format!("frozen_linear grad x {dims:?}"), dx, dx_ref, REF_F32)?;
        check_finite_differences("frozen_linear", op, &mk(DType::F64)?, &[0])?;
    }
    Ok(())
}

/// `linear_parts` over rows kept in separate buffers against `frozen_linear_reference` on the rows
/// concatenated (odd part sizes, an empty part), and its errors for a ragged part and a non-f32 weight.
#[test]
fn linear_parts_matches_the_linear_of_the_concatenated_rows() -> Result<()> {
    let d_in = 37;
    let w = tensor(&[11, d_in], 7, DType::F32)?;
    let parts: Vec<Tensor> = [5, 0, 130, 1]
        .iter()
        .enumerate()
        .map(|(i, &n)| tensor(&[n, d_in], 9 + i as u64, DType::F32))
        .collect::<Result<_>>()?;
    let data: Vec<Vec<f32>> = parts.iter().map(|p| Ok(p.flatten_all()?.to_vec1::<f32>()?)).collect::<Result<_>>()?;
    let slices: Vec<&[f32]> = data.iter().map(Vec::as_slice).collect();
    let y = linear_parts(&slices, &w)?;
    let y_ref = frozen_linear_reference(&Tensor::cat(&parts, 0)?, &w)?;
    ensure!(y.dims() == [136, 11], "linear_parts gave {:?}", y.dims());
    compare_tensors("linear_parts", &y, &y_ref, REF_F32)?;
    let ragged = linear_parts(&[&data[0][1..]], &w).unwrap_err().to_string();
    ensure!(ragged.contains("part 0") && ragged.contains("rows of 37"), "{ragged}");
    let f64_w = linear_parts(&slices, &w.to_dtype(DType::F64)?).unwrap_err().to_string();
    ensure!(f64_w.contains("f32 CPU tensor"), "{f64_w}");
    Ok(())
}

/// Gates spread over [-40, 40) so that the sigmoid's two branches and its saturated tails are covered.
#[test]
fn swiglu_matches_reference_and_finite_differences() -> Result<()> {
    let op: &Op = &|t| swiglu(&t[0], &t[1]);
    for dims in SHAPES {
        let mk = |dtype, spread: f64| -> Result<[Tensor; 2]> {
            Ok([(tensor(dims, 9, dtype)? * spread)?, tensor(dims, 10, dtype)?])
        };
        check_against_reference("swiglu", op, &|t| swiglu_reference(&t[0], &t[1]), &mk(DType::F32, 40.0)?)?;
        check_finite_differences("swiglu", op, &mk(DType::F64, 4.0)?, &[0, 1])?;
    }
    let err = swiglu(&tensor(&[3, 4], 1, DType::F32)?, &tensor(&[4, 3], 1, DType::F32)?).err().map(|e| e.to_string());
    ensure!(err.as_deref().is_some_and(|e| e.contains("same shape")), "got {err:?}");
    Ok(())
}

/// Labels with a few unsupervised positions that carry an out-of-vocabulary label on purpose.
fn ce_inputs(n: usize, v: usize, dtype: DType) -> Result<[Tensor; 3]> {
    let mask: Vec<f32> = (0..n).map(|i| if i % 3 == 1 { 0.0 } else { 1.0 }).collect();
    let labels: Vec<u32> = (0..n).map(|i| if i % 3 == 1 { u32::MAX } else { (i * 7 % v) as u32 }).collect();
    // Scale logits up so that softmax is far from uniform.
    let logits = (tensor(&[n, v], 9, dtype)? * 3.0)?;
    Ok([logits, Tensor::new(labels, &Device::Cpu)?, Tensor::new(mask, &Device::Cpu)?])
}

#[test]
fn cross_entropy_matches_reference_and_finite_differences() -> Result<()> {
    let op: &Op = &|t| cross_entropy_masked(&t[0], &t[1], &t[2]);
    for (n, v) in [(7, 13), (15, 31)] {
        let [logits, labels, mask] = ce_inputs(n, v, DType::F32)?;
        let lv = Var::from_tensor(&logits)?;
        let (l, l_ref) = (op(&[lv.as_tensor().clone(), labels.clone(), mask.clone()])?, {
            cross_entropy_masked_reference(&lv, &labels, &mask)?
        });
        compare_tensors(&format!("cross_entropy loss ({n}, {v})"), &l, &l_ref, REF_F32)?;
        let (g, g_ref) = ((l * 1.7)?.backward()?, (l_ref * 1.7)?.backward()?);
        let (d, d_ref) = (g.get(&lv).unwrap(), g_ref.get(&lv).unwrap());
        compare_tensors(&format!("cross_entropy grad logits ({n}, {v})"), d, d_ref, REF_F32)?;
        // Unsupervised rows get an exact zero gradient.
        let rows = d.to_vec2::<f32>()?;
        ensure!(rows[1].iter().all(|&x| x == 0.0), "masked row 1 has a gradient: {:?}", rows[1]);
        ensure!(g.get(&labels).is_none() && g.get(&mask).is_none(), "labels/mask must get no gradient");

        let [logits, labels, mask] = ce_inputs(n, v, DType::F64)?;
        let fd_op: &Op = &|t| cross_entropy_masked(&t[0], &labels, &mask);
        check_finite_differences("cross_entropy", fd_op, &[logits], &[0])?;
    }
    Ok(())
}

#[test]
fn cross_entropy_with_nothing_supervised_is_zero_with_zero_gradient() -> Result<()> {
    let [logits, labels, _] = ce_inputs(5, 9, DType::F32)?;
    let lv = Var::from_tensor(&logits)?;
    let loss = cross_entropy_masked(&lv, &labels, &Tensor::zeros(5, DType::F32, &Device::Cpu)?)?;
    ensure!(loss.to_scalar::<f32>()? == 0.0, "loss {loss}");
    let g = loss.backward()?;
    let d = flat(g.get(&lv).unwrap())?;
    ensure!(d.iter().all(|&x| x == 0.0), "gradient must be all zeros");
    Ok(())
}

/// Loss and dlogits of `cross_entropy_masked` on rows of 4 logits, differentiating `1.5 * loss`.
fn ce_on(rows: &[[f32; 4]], labels: &[u32], mask: &[f32], dtype: DType) -> Result<(f64, Vec<Vec<f64>>)> {
    let flat_rows: Vec<f32> = rows.concat();
    let logits = Var::from_tensor(&Tensor::from_vec(flat_rows, (rows.len(), 4), &Device::Cpu)?.to_dtype(dtype)?)?;
    let labels = Tensor::new(labels, &Device::Cpu)?;
    let loss = cross_entropy_masked(&logits, &labels, &Tensor::new(mask, &Device::Cpu)?)?;
    let g = (&loss * 1.5)?.backward()?;
    let d = g.get(&logits).ok_or_else(|| anyhow::anyhow!("no gradient for the logits"))?;
    let d = d.to_dtype(DType::F64)?.to_vec2::<f64>()?;
    Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, d))
}

/// `ce_on`'s loss and dlogits (`got`) against the values derived by hand, under [`HAND_BF16`] in bf16 and
/// [`HAND_F32`] otherwise.
fn ensure_by_hand(label: &str, dtype: DType, got: &(f64, Vec<Vec<f64>>), loss: f64, d: &[[f64; 4]]) -> Result<()> {
    let tol = if dtype == DType::BF16 { HAND_BF16 } else { HAND_F32 };
    ensure_close(&format!("{label} {dtype:?} loss"), &[1], &[got.0], &[loss], tol)?;
    ensure_close(&format!("{label} {dtype:?} dlogits"), &[d.len(), 4], &got.1.concat(), &d.concat(), tol)
}

/// Rows with `+inf` logits are uniform over them, `-inf` logits have probability 0, and an unsupervised row
/// is ignored whatever it holds. Expected values by hand: two supervised rows with softmax `(1/2, 0, 1/2,
/// 0)` and loss `ln 2` each, so the mean is `ln 2` and the gradient scale is `1.5 / 2`.
#[test]
fn cross_entropy_with_infinite_logits_follows_the_uniform_softmax() -> Result<()> {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let rows = [[inf, 0.0, inf, 1.0], [0.0, -inf, 0.0, -inf], [nan, inf, 3.0, -inf]];
    let s = 1.5 / 2.0;
    let want = [[s * 0.5, 0.0, s * -0.5, 0.0], [s * -0.5, 0.0, s * 0.5, 0.0], [0.0; 4]];
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let got = ce_on(&rows, &[2, 0, 1], &[1.0, 1.0, 0.0], dtype)?;
        ensure_by_hand("infinite logits", dtype, &got, std::f64::consts::LN_2, &want)?;
    }
    Ok(())
}

/// A label that the softmax gives probability 0 costs `+inf`: a finite label among `+inf` logits, a `-inf`
/// label among finite ones, a row of only `-inf`. The gradient stays `scale * (p - onehot)` (scale
/// `1.5 / 3`), except on the all-`-inf` row, which has no distribution and gets 0.
#[test]
fn cross_entropy_of_an_impossible_label_is_infinite() -> Result<()> {
    let inf = f32::INFINITY;
    let rows = [[inf, 2.0, inf, inf], [1.0, -inf, 1.0, 1.0], [-inf; 4]];
    let (s, t) = (1.5 / 3.0, 1.0 / 3.0);
    let want = [[s * t, -s, s * t, s * t], [s * t, -s, s * t, s * t], [0.0; 4]];
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let got = ce_on(&rows, &[1, 1, 0], &[1.0; 3], dtype)?;
        ensure_by_hand("impossible label", dtype, &got, f64::INFINITY, &want)?;
    }
    // The all-`-inf` row alone: loss `+inf`, gradient 0.
    let got = ce_on(&[[-inf; 4]], &[3], &[1.0], DType::F32)?;
    ensure_by_hand("all -inf alone", DType::F32, &got, f64::INFINITY, &[[0.0; 4]])
}

/// A NaN logit in a supervised row makes the loss and that row's gradient NaN (checked as such: a NaN is
/// no value to compare); the other rows keep theirs (uniform over four equal logits: `p = 1/4`, scale
/// `1.5 / 2`). With nothing supervised, infinities and NaN are never read: loss 0, gradient 0.
#[test]
fn cross_entropy_nan_propagates_and_an_all_masked_batch_stays_zero() -> Result<()> {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let (loss, d) = ce_on(&[[0.0, nan, 1.0, 2.0], [0.0; 4]], &[2, 3], &[1.0, 1.0], DType::F32)?;
    ensure!(loss.is_nan() && d[0].iter().all(|x| x.is_nan()), "NaN logit: loss {loss}, d row 0 {:?}", d[0]);
    let s = 1.5 / 2.0;
    ensure_close("NaN logit d row 1", &[4], &d[1], &[s * 0.25, s * 0.25, s * 0.25, s * -0.75], HAND_F32)?;

    let rows = [[nan, inf, 0.0, -inf], [-inf; 4], [inf; 4]];
    let got = ce_on(&rows, &[0, 1, 2], &[0.0; 3], DType::F32)?;
    ensure_by_hand("all masked", DType::F32, &got, 0.0, &[[0.0; 4]; 3])
}

/// The point of the frozen variants: a frozen weight, even a `Var`, never enters the `GradStore`,
/// whereas candle's autograd through the plain reference does store one.
#[test]
fn frozen_weights_get_no_gradient() -> Result<()> {
    let x = Var::from_tensor(&tensor(&[3, 5, 31], 10, DType::F32)?)?;
    let w = Var::from_tensor(&tensor(&[31], 11, DType::F32)?)?;
    let b = Var::from_tensor(&tensor(&[31], 12, DType::F32)?)?;
    let lin = Var::from_tensor(&tensor(&[11, 31], 13, DType::F32)?)?;

    let g = rms_norm_frozen(&x, &w, EPS)?.sqr()?.sum_all()?.backward()?;
    ensure!(g.get(&w).is_none() && g.get(&x).is_some(), "rms_norm_frozen: w must get no gradient, x one");
    let g = layer_norm_frozen(&x, &w, &b, EPS)?.sqr()?.sum_all()?.backward()?;
    ensure!(g.get(&w).is_none() && g.get(&b).is_none(), "layer_norm_frozen: w and b must get no gradient");
    ensure!(g.get(&x).is_some(), "layer_norm_frozen: x must get a gradient");
    let g = frozen_linear(&x, &lin)?.sqr()?.sum_all()?.backward()?;
    ensure!(g.get(&lin).is_none() && g.get(&x).is_some(), "frozen_linear: w must get no gradient, x one");

    // The trap these ops avoid: plain matmul stores a weight-sized gradient for the frozen weight.
    let g = frozen_linear_reference(&x, &lin)?.sqr()?.sum_all()?.backward()?;
    ensure!(g.get(&lin).is_some(), "expected candle's matmul backward to store a gradient for w");

    // Trained variants do produce the weight gradients.
    let g = layer_norm(&x, &w, &b, EPS)?.sqr()?.sum_all()?.backward()?;
    ensure!(g.get(&w).is_some() && g.get(&b).is_some(), "layer_norm: trained w and b need gradients");
    Ok(())
}

#[test]
fn bad_shapes_and_dtypes_are_refused_with_the_shapes_in_the_message() -> Result<()> {
    let x = tensor(&[7, 13], 1, DType::F32)?;
    let err = rms_norm(&x, &tensor(&[12], 2, DType::F32)?, EPS).unwrap_err().to_string();
    ensure!(err.contains("[12]") && err.contains("[7, 13]"), "unexpected message: {err}");
    let err = frozen_linear(&x, &tensor(&[4, 13], 2, DType::F64)?).unwrap_err().to_string();
    ensure!(err.contains("f64") && err.contains("f32"), "unexpected message: {err}");
    let err = rms_norm(&x.to_dtype(DType::BF16)?, &tensor(&[13], 2, DType::F32)?, EPS).unwrap_err().to_string();
    ensure!(err.contains("x bf16 [7, 13]") && err.contains("w f32 [13]"), "unexpected message: {err}");
    let labels = Tensor::new(&[0u32, 99, 1, 2, 3, 4, 5], &Device::Cpu)?;
    let ones = Tensor::ones(7, DType::F32, &Device::Cpu)?;
    let err = cross_entropy_masked(&x, &labels, &ones).unwrap_err().to_string();
    ensure!(err.contains("label 99"), "unexpected message: {err}");
    Ok(())
}

/// Transposed (non-contiguous) inputs go through the public wrappers, which make them contiguous, and the
/// gradient flows back through that copy to the original layout.
#[test]
fn non_contiguous_inputs_are_handled_by_the_wrappers() -> Result<()> {
    let xt = Var::from_tensor(&tensor(&[13, 7], 14, DType::F32)?)?;
    let w = tensor(&[13], 15, DType::F32)?;
    let x = xt.t()?;
    ensure!(!x.is_contiguous(), "the test needs a non-contiguous input");
    let y = rms_norm(&x, &w, EPS)?;
    compare_tensors("rms_norm forward, transposed x", &y, &rms_norm_reference(&x, &w, EPS)?, REF_F32)?;
    let g = weighted_sum(&y, 16)?.backward()?;
    let g_ref = weighted_sum(&rms_norm_reference(&x, &w, EPS)?, 16)?.backward()?;
    compare_tensors("rms_norm grad, transposed x", g.get(&xt).unwrap(), g_ref.get(&xt).unwrap(), REF_F32)?;
    Ok(())
}

/// Qwen3-VL's norm widths: the per-head q/k RMSNorm over the last dim of a `(B, H, T, 128)` view (a
/// transpose of `(B, T, H, 128)`, as the decoder makes it), the vision LayerNorm with bias at 1152 and
/// the DeepStack mergers' at 4 * 1152 = 4608; against the reference, finite differences (one or two
/// rows: the wide row is what is new) and in bf16.
#[test]
fn norms_at_qwen3_vl_widths() -> Result<()> {
    let xt = Var::from_tensor(&tensor(&[1, 3, 2, 128], 20, DType::F32)?)?; // (B, T, H, D)
    let w = tensor(&[128], 21, DType::F32)?;
    let x = xt.transpose(1, 2)?; // (B, H, T, D)
    let (y, y_ref) = (rms_norm(&x, &w, EPS)?, rms_norm_reference(&x, &w, EPS)?);
    compare_tensors("q/k rms_norm forward, (B, H, T, 128) view", &y, &y_ref, REF_F32)?;
    let (g, g_ref) = (weighted_sum(&y, 22)?.backward()?, weighted_sum(&y_ref, 22)?.backward()?);
    compare_tensors("q/k rms_norm grad, (B, H, T, 128) view", g.get(&xt).unwrap(), g_ref.get(&xt).unwrap(), REF_F32)?;

    let rms: &Op = &|t| rms_norm(&t[0], &t[1], EPS);
    let rms_ref: &Op = &|t| rms_norm_reference(&t[0], &t[1], EPS);
    let ln: &Op = &|t| layer_norm(&t[0], &t[1], &t[2], EPS);
    let ln_ref: &Op = &|t| layer_norm_reference(&t[0], &t[1], &t[2], EPS);
    let mk = |dims: &[usize], params: usize, dtype| -> Result<Vec<Tensor>> {
        let d = *dims.last().unwrap();
        let mut v = vec![tensor(dims, 23, dtype)?];
        for p in 0..params {
            v.push(tensor(&[d], 24 + p as u64, dtype)?);
        }
        Ok(v)
    };
    for dims in [&[2usize, 4, 3, 128][..], &[2usize, 128][..]] {
        check_against_reference("q/k rms_norm", rms, rms_ref, &mk(dims, 1, DType::F32)?)?;
        check_bf16("q/k rms_norm", rms, &mk(dims, 1, DType::F32)?, &[0, 1])?;
    }
    check_finite_differences("q/k rms_norm", rms, &mk(&[2, 128], 1, DType::F64)?, &[0, 1])?;
    for d in [1152, 4608] {
        check_against_reference("layer_norm", ln, ln_ref, &mk(&[3, d], 2, DType::F32)?)?;
        check_bf16("layer_norm", ln, &mk(&[3, d], 2, DType::F32)?, &[0, 1, 2])?;
        check_finite_differences("layer_norm", ln, &mk(&[1, d], 2, DType::F64)?, &[0, 1, 2])?;
    }
    Ok(())
}

/// Qwen3-VL's GEMMs through `frozen_linear`: the patch embedding (a Conv3d whose kernel equals its stride,
/// so rows of 3 * 2 * 16 * 16 = 1536 pixel values times a (1152, 1536) weight) and a DeepStack merger's
/// Linears (4608 -> 4608 -> 2048, the 2B text width); few rows. Against candle's matmul in f32 (forward
/// and dx) and as the f32 op rounded once in bf16.
#[test]
fn frozen_linear_at_qwen3_vl_shapes() -> Result<()> {
    let op: &Op = &|t| frozen_linear(&t[0], &t[1]);
    let reference: &Op = &|t| frozen_linear_reference(&t[0], &t[1]);
    for (rows, d_in, d_out) in [(5, 1536, 1152), (2, 4608, 4608), (2, 4608, 2048)] {
        let x = tensor(&[rows, d_in], 30, DType::F32)?;
        // Weights of a trained layer's scale, ~1 / sqrt(in), so that outputs are of order 1.
        let w = (tensor(&[d_out, d_in], 31, DType::F32)? * (1.0 / (d_in as f64).sqrt()))?;
        let xv = Var::from_tensor(&x)?;
        let (y, y_ref) = (op(&[xv.as_tensor().clone(), w.clone()])?, reference(&[xv.as_tensor().clone(), w.clone()])?);
        compare_tensors(&format!("frozen_linear forward ({rows}, {d_in}) x ({d_out}, {d_in})^T"), &y, &y_ref, REF_F32)?;
        let (g, g_ref) = (weighted_sum(&y, 32)?.backward()?, weighted_sum(&y_ref, 32)?.backward()?);
        compare_tensors(
            &format!("frozen_linear dx ({rows}, {d_in})"),
            g.get(&xv).unwrap(),
            g_ref.get(&xv).unwrap(),
            REF_F32,
        )?;
        check_bf16("frozen_linear", op, &[x, w], &[0])?;
    }
    Ok(())
}
