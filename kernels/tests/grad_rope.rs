//! Gradient tests for the RoPE CustomOp `askgui_kernels::ops::rope` against `askgui_kernels::rope_reference`.
//!
//! Checked on odd sizes and on every table layout the model uses (text `(B, H, T, D)` with `(B, 1, T, D)`,
//! `(1, T, D)` and `(T, D)` tables, vision `(P, H, D)` with `(P, 1, D)`, M-RoPE and vision 2D tables built by
//! the reference table functions): forward vs the reference (f32), gradient vs candle's autograd through
//! the reference (f32), gradient vs central finite differences (f64), and no `GradStore` entry for the
//! tables even when they are `Var`s; in bf16, the f32 op on the rounded inputs, rounded once. Every
//! comparison goes through `common::tol` (`REF_ROPE_F32`, `FD`, with their reasons).
//! Run: `cargo test -p askgui-kernels --test grad_rope -- --nocapture`.

mod common;

use anyhow::{ensure, Result};
use askgui_kernels::ops::rope;
use askgui_kernels::rope::inv_freq;
use askgui_kernels::{mrope_cos_sin_reference, rope_reference, vision_rope_cos_sin_reference};
use candle_core::{DType, Device, Tensor, Var};
use common::tol::{compare_tensors, ensure_close, FD, REF_ROPE_F32};
use common::{bf16, central_differences, flat, tensor};

/// `(cos, sin)` of random angles in [-3, 3), shape `dims`; the two halves of the last dim get different
/// angles on purpose, so that a kernel mixing up `cos1`/`cos2` or `sin1`/`sin2` fails.
fn random_tables(dims: &[usize], seed: u64, dtype: DType) -> Result<(Tensor, Tensor)> {
    let a = (tensor(dims, seed, DType::F64)? * 3.0)?;
    Ok((a.cos()?.to_dtype(dtype)?, a.sin()?.to_dtype(dtype)?))
}

/// `sum(y * r)` with a fixed random `r`: every output element gets its own weight.
fn weighted_sum(y: &Tensor, seed: u64) -> Result<Tensor> {
    Ok(y.mul(&tensor(y.dims(), seed, y.dtype())?)?.sum_all()?)
}

/// Forward and x-gradient of `rope` against `rope_reference` (f32) and against finite differences (f64).
fn check(name: &str, x_dims: &[usize], cos: &Tensor, sin: &Tensor) -> Result<()> {
    let label = format!("{name} x {x_dims:?} tables {:?}", cos.dims());
    let (cos32, sin32) = (cos.to_dtype(DType::F32)?, sin.to_dtype(DType::F32)?);
    let x = Var::from_tensor(&tensor(x_dims, 5, DType::F32)?)?;
    let y = rope(&x, &cos32, &sin32)?;
    let y_ref = rope_reference(&x, &cos32, &sin32)?;
    compare_tensors(&format!("{label} forward"), &y, &y_ref, REF_ROPE_F32)?;
    let g = weighted_sum(&y, 9)?.backward()?;
    let g_ref = weighted_sum(&y_ref, 9)?.backward()?;
    let (Some(g), Some(g_ref)) = (g.get(&x), g_ref.get(&x)) else { anyhow::bail!("{label}: no gradient for x") };
    compare_tensors(&format!("{label} grad vs autograd"), g, g_ref, REF_ROPE_F32)?;

    // f64 central finite differences of the same loss.
    let (cos64, sin64) = (cos.to_dtype(DType::F64)?, sin.to_dtype(DType::F64)?);
    let x64 = Var::from_tensor(&tensor(x_dims, 5, DType::F64)?)?;
    let loss = |x: &Tensor| -> Result<f64> { Ok(weighted_sum(&rope(x, &cos64, &sin64)?, 9)?.to_scalar::<f64>()?) };
    let grads = weighted_sum(&rope(&x64, &cos64, &sin64)?, 9)?.backward()?;
    let analytic = flat(grads.get(&x64).ok_or_else(|| anyhow::anyhow!("{label}: no f64 gradient"))?)?;
    let numeric = central_differences(&flat(&x64)?, |v| loss(&Tensor::from_vec(v.to_vec(), x_dims, &Device::Cpu)?))?;
    ensure_close(&format!("{label} f64 vs finite differences"), x_dims, &analytic, &numeric, FD)
}

#[test]
fn text_layouts_match_reference_and_finite_differences() -> Result<()> {
    // x (B, H, T, D) with tables (B, 1, T, D), (T, D), and (B, T, D) where it broadcasts (B = 1).
    let (cos, sin) = random_tables(&[2, 1, 5, 10], 1, DType::F64)?;
    check("text (B,1,T,D)", &[2, 3, 5, 10], &cos, &sin)?;
    let (cos, sin) = random_tables(&[5, 10], 2, DType::F64)?;
    check("text (T,D)", &[2, 3, 5, 10], &cos, &sin)?;
    let (cos, sin) = random_tables(&[1, 5, 10], 3, DType::F64)?;
    check("text (B,T,D) B=1", &[1, 3, 5, 10], &cos, &sin)?;
    let (cos, sin) = random_tables(&[3, 7, 2], 4, DType::F64)?;
    check("text D=2 per-head tables", &[3, 7, 2], &cos, &sin)?;
    Ok(())
}

#[test]
fn vision_layout_matches_reference_and_finite_differences() -> Result<()> {
    // x (P, H, D) with tables (P, 1, D): random tables at D = 6, the vision tower's 2D tables at D = 8.
    let (cos, sin) = random_tables(&[7, 1, 6], 6, DType::F64)?;
    check("vision random (P,1,D)", &[7, 3, 6], &cos, &sin)?;
    let dev = Device::Cpu;
    let hw: Vec<f32> = (0..7u32).flat_map(|p| [(p / 3) as f32, (p % 3) as f32 * 2.0]).collect();
    let hw = Tensor::from_vec(hw, (7, 2), &dev)?;
    let inv = Tensor::new(inv_freq(4, 10000.0).as_slice(), &dev)?; // q = 2 -> D = 4q = 8
    let (cos, sin) = vision_rope_cos_sin_reference(&hw, &inv)?;
    check("vision 2D tables", &[7, 3, 8], &cos.unsqueeze(1)?, &sin.unsqueeze(1)?)?;
    Ok(())
}

/// Qwen3-VL's head dims: the vision tower's 2D tables at head dim 72 (a rotary of `72 / 2 = 36`, 18
/// frequencies per axis) over 16 heads, and the decoder's head dim 128 with per-token tables (their
/// interleaved M-RoPE layout is data to the op: random angles stand for it).
#[test]
fn qwen3_vl_head_dims_match_reference_and_finite_differences() -> Result<()> {
    let dev = Device::Cpu;
    let hw: Vec<f32> = (0..6u32).flat_map(|p| [(p / 3) as f32, (p % 3) as f32]).collect();
    let inv = Tensor::new(inv_freq(36, 10000.0).as_slice(), &dev)?;
    let (cos, sin) = vision_rope_cos_sin_reference(&Tensor::from_vec(hw, (6, 2), &dev)?, &inv)?;
    ensure!(cos.dims() == [6, 72], "vision tables {:?}", cos.dims());
    check("vision 2D tables D=72", &[6, 16, 72], &cos.unsqueeze(1)?, &sin.unsqueeze(1)?)?;
    let (cos, sin) = random_tables(&[1, 1, 3, 128], 8, DType::F64)?;
    check("decoder (B,1,T,D) D=128", &[1, 4, 3, 128], &cos, &sin)?;
    Ok(())
}

#[test]
fn mrope_tables_match_reference_and_finite_differences() -> Result<()> {
    // positions (3, B, T) with different t / h / w, mrope_section [2, 1, 1] over D / 2 = 4.
    let dev = Device::Cpu;
    let (b, t, d) = (2usize, 5usize, 8usize);
    let pos: Vec<f32> =
        (0..3 * b * t).map(|i| ((i / (b * t)) * 7 + (i % (b * t)) * (i / (b * t) + 1)) as f32).collect();
    let pos = Tensor::from_vec(pos, (3, b, t), &dev)?;
    let inv = Tensor::new(inv_freq(d, 10.0).as_slice(), &dev)?;
    let (cos, sin) = mrope_cos_sin_reference(&pos, &inv, &[2, 1, 1])?;
    ensure!(cos.dims() == [b, t, d], "mrope tables {:?}", cos.dims());
    check("mrope [2,1,1]", &[b, 3, t, d], &cos.unsqueeze(1)?, &sin.unsqueeze(1)?)?;
    let inv6 = Tensor::new(inv_freq(6, 10000.0).as_slice(), &dev)?;
    let (cos, sin) = mrope_cos_sin_reference(&pos, &inv6, &[1, 1, 1])?;
    check("mrope [1,1,1]", &[b, 3, t, 6], &cos.unsqueeze(1)?, &sin.unsqueeze(1)?)?;
    Ok(())
}

/// The tables are never trained: even as `Var`s (or tensors computed from `Var`s) they get no
/// `GradStore` entry, while the reference gives them one.
#[test]
fn tables_get_no_gradient_even_as_vars() -> Result<()> {
    let x = Var::from_tensor(&tensor(&[2, 3, 5, 10], 11, DType::F32)?)?;
    let (c, s) = random_tables(&[2, 1, 5, 10], 12, DType::F32)?;
    let (cos, sin) = (Var::from_tensor(&c)?, Var::from_tensor(&s)?);
    let grads = weighted_sum(&rope(&x, &cos, &sin)?, 3)?.backward()?;
    ensure!(grads.get(&x).is_some(), "x must get a gradient");
    ensure!(grads.get(&cos).is_none() && grads.get(&sin).is_none(), "cos/sin must get no gradient");
    let grads_ref = weighted_sum(&rope_reference(&x, &cos, &sin)?, 3)?.backward()?;
    ensure!(grads_ref.get(&cos).is_some(), "the reference does keep a table gradient (the point of the op)");

    // Tables derived from Vars (a tracked, non-variable node): still no entry, and no panic.
    let (c5, s5) = random_tables(&[2, 5, 10], 13, DType::F32)?;
    let (cv, sv) = (Var::from_tensor(&c5)?, Var::from_tensor(&s5)?);
    let y = rope(&x, &cv.unsqueeze(1)?, &sv.unsqueeze(1)?)?;
    let grads = weighted_sum(&y, 4)?.backward()?;
    ensure!(grads.get(&x).is_some() && grads.get(&cv).is_none() && grads.get(&sv).is_none());

    // x not tracked: nothing at all.
    let xt = tensor(&[2, 3, 5, 10], 14, DType::F32)?;
    let grads = weighted_sum(&rope(&xt, &cos, &sin)?, 4)?.backward()?;
    ensure!(grads.get(&cos).is_none() && grads.get(&sin).is_none());
    Ok(())
}

#[test]
fn non_contiguous_x_is_handled_by_the_wrapper() -> Result<()> {
    // x (B, T, H, D) transposed to (B, H, T, D), as after the q projection.
    let xv = Var::from_tensor(&tensor(&[2, 5, 3, 10], 21, DType::F32)?)?;
    let x = xv.transpose(1, 2)?;
    ensure!(!x.is_contiguous());
    let (cos, sin) = random_tables(&[2, 1, 5, 10], 22, DType::F32)?;
    let (y, y_ref) = (rope(&x, &cos, &sin)?, rope_reference(&x, &cos, &sin)?);
    compare_tensors("non-contiguous x forward", &y, &y_ref, REF_ROPE_F32)?;
    let g = weighted_sum(&y, 5)?.backward()?;
    let g_ref = weighted_sum(&y_ref, 5)?.backward()?;
    let (Some(g), Some(g_ref)) = (g.get(&xv), g_ref.get(&xv)) else { anyhow::bail!("no gradient for x") };
    compare_tensors("non-contiguous x grad", g, g_ref, REF_ROPE_F32)?;
    Ok(())
}

/// In bf16 the op (forward, and its transpose in the backward) is the f32 op on the bf16-rounded x and
/// tables, with each output rounded once ([`common::bf16::ROUNDING`]); the upstream gradient `r` holds bf16
/// values, so both backward ops get the same input.
#[test]
fn bf16_is_the_f32_op_rounded_once() -> Result<()> {
    let cases: [(&[usize], &[usize]); 3] =
        [(&[2, 3, 5, 10], &[2, 1, 5, 10]), (&[2, 3, 5, 10], &[5, 10]), (&[7, 3, 6], &[7, 1, 6])];
    for (x_dims, t_dims) in cases {
        let (c, s) = random_tables(t_dims, 41, DType::F32)?;
        let ((cb, cf), (sb, sf)) = (bf16::pair(&c)?, bf16::pair(&s)?);
        let (xb, xf) = bf16::pair(&tensor(x_dims, 42, DType::F32)?)?;
        let (xb, xf) = (Var::from_tensor(&xb)?, Var::from_tensor(&xf)?);
        let (yb, yf) = (rope(&xb, &cb, &sb)?, rope(&xf, &cf, &sf)?);
        let label = format!("rope x {x_dims:?} tables {t_dims:?}");
        bf16::check(&format!("{label} forward"), &yb, &yf)?;
        let r = tensor(x_dims, 43, DType::BF16)?;
        let gb = yb.mul(&r)?.sum_all()?.backward()?;
        let gf = yf.mul(&r.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
        let (Some(gb), Some(gf)) = (gb.get(&xb), gf.get(&xf)) else { anyhow::bail!("{label}: no gradient for x") };
        bf16::check(&format!("{label} grad"), gb, gf)?;
    }
    Ok(())
}

#[test]
fn bad_shapes_and_dtypes_are_refused_with_the_shapes_in_the_message() -> Result<()> {
    let x = tensor(&[2, 3, 5, 10], 31, DType::F32)?;
    let (cos, sin) = random_tables(&[2, 1, 5, 10], 32, DType::F32)?;
    let err = |r: candle_core::Result<Tensor>| r.err().map(|e| e.to_string()).unwrap_or_default();

    let odd = tensor(&[2, 3, 5, 9], 33, DType::F32)?;
    let (c9, s9) = random_tables(&[5, 9], 34, DType::F32)?;
    let e = err(rope(&odd, &c9, &s9));
    ensure!(e.contains("even") && e.contains("[2, 3, 5, 9]"), "odd head dim: {e}");

    let (c8, s8) = random_tables(&[5, 8], 35, DType::F32)?;
    let e = err(rope(&x, &c8, &sin));
    ensure!(e.contains("[5, 8]") && e.contains("[2, 3, 5, 10]"), "wrong head dim: {e}");
    let e = err(rope(&x, &cos, &s8));
    ensure!(e.contains("sin") && e.contains("[5, 8]"), "wrong sin: {e}");

    // A table that would enlarge x (the reference would broadcast x up; the op refuses).
    let (cb, sb) = random_tables(&[4, 3, 5, 10], 36, DType::F32)?;
    let e = err(rope(&tensor(&[1, 3, 5, 10], 37, DType::F32)?, &cb, &sb));
    ensure!(e.contains("[4, 3, 5, 10]") && e.contains("[1, 3, 5, 10]"), "enlarging table: {e}");
    // (B, T, D) tables against (B, H, T, D) with B != H do not broadcast, as in the reference.
    let (c3, s3) = random_tables(&[2, 5, 10], 38, DType::F32)?;
    ensure!(rope_reference(&x, &c3, &s3).is_err());
    let e = err(rope(&x, &c3, &s3));
    ensure!(e.contains("[2, 5, 10]"), "(B, T, D) tables: {e}");

    let e = err(rope(&x.to_dtype(DType::F64)?, &cos, &sin));
    ensure!(e.contains("f64") && e.contains("f32"), "dtype mismatch: {e}");
    let e = err(rope(&x.to_dtype(DType::BF16)?, &cos, &sin));
    ensure!(e.contains("x bf16 [2, 3, 5, 10]") && e.contains("cos f32"), "mixed bf16 and f32: {e}");
    eprintln!("errors refused as expected, e.g.: {}", err(rope(&x, &c8, &sin)));
    Ok(())
}
