//! `askgui-train check-gpu`'s library: every kernel op against its plain-candle reference on one device,
//! forward and gradients, f32 and bf16, on small odd shapes and on Qwen3-VL's head dims and widths
//! (`selfcheck/qwen3_vl.rs`); one row per compared tensor.
//!
//! The op runs on the device in the row's dtype. The reference is the spec: plain candle in f32 on the
//! CPU, fed the very numbers the op sees (inputs rounded to the dtype, then upcast), so only the op's own
//! arithmetic and its output rounding can differ. Gradients come from `Var`s and `.backward()` of a fixed
//! random projection `sum(y * r)` on both sides, as `tests/grad_ops.rs` does. A row passes when every
//! element is finite and within `atol + rtol * |ref|` (the constants below). Where the CPU refuses bf16
//! the case is reported `unsupported`; any other error, a non-finite value or a panic is a failure. With
//! the `cuda` feature on a CUDA device the tiling kernels are checked too. Run: `askgui-train check-gpu`.

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{DType, Device, Result, Tensor, Var};

use crate::attention::AttentionMask;
use crate::ops;
use crate::rope::{inv_freq, mrope_cos_sin_reference, vision_rope_cos_sin_reference};
use crate::{attention_reference, layer_norm_reference, rms_norm_reference, rope_reference};

mod qwen3_vl;

/// A row passes when `|got - ref| <= atol + rtol * |ref|` for every element.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tol {
    pub atol: f64,
    pub rtol: f64,
}

/// f32 forwards: both sides compute in f32 or better from identical inputs and differ only in summation
/// order (GPU tiles, CPU GEMMs with f64 statistics) and `exp` ulps: below 5e-7 measured on the CPU for outputs
/// of order 1. A wrong term (a mask off by one, a missing scale) costs 1e-2 or more.
pub const F32_FWD: Tol = Tol { atol: 1e-4, rtol: 1e-4 };
/// f32 gradients: sums over every row (and the query heads sharing a kv head) in another order, through f32
/// atomics on the GPU; values reach ~10, so a relative term is needed (the GPU tests' tolerance).
pub const F32_GRAD: Tol = Tol { atol: 5e-4, rtol: 1e-3 };
/// bf16 forwards: f32 math on the same rounded inputs, then one rounding of the output to bf16 (2^-9
/// relative, < 4e-3 of values up to 2) plus f32 noise: 1e-2 leaves ~2.5x margin.
pub const BF16_FWD: Tol = Tol { atol: 1e-2, rtol: 1e-2 };
/// bf16 gradients: the backward reads the bf16-rounded forward output (attention's `rowsum(dO * O)`) and
/// rounds the gradients to bf16 (2^-9 relative of values up to ~10): 2e-2 + 2e-2 |ref|.
pub const BF16_GRAD: Tol = Tol { atol: 2e-2, rtol: 2e-2 };
/// Tiling, f32: the GPU uses the CPU's integer filter taps, so it is designed bit-exact; one uint8 level of
/// the resized image (`1 / 255 / std`, at most 0.0150 for the CLIP std) is what a float rounding order
/// could cost.
pub const TILING_F32: Tol = Tol { atol: 0.0151, rtol: 0.0 };
/// Tiling, bf16: one level plus the output rounding to bf16 (2^-9 relative; 2^-8 leaves a factor 2).
pub const TILING_BF16: Tol = Tol { atol: 0.0151, rtol: 1.0 / 256.0 };

/// The dtypes every op is checked in.
pub const DTYPES: [DType; 2] = [DType::F32, DType::BF16];

/// Every op the table covers (tiling only runs on a CUDA device; elsewhere its row says so).
pub const OPS: [&str; 10] = [
    "attention",
    "rms_norm",
    "rms_norm_frozen",
    "layer_norm",
    "layer_norm_frozen",
    "rope",
    "cross_entropy_masked",
    "frozen_linear",
    "dropout",
    "tiling",
];

/// The outcome of one row.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    Pass,
    /// Out of tolerance, not finite, an error or a panic: the message says which.
    Fail(String),
    /// The device does not take this dtype (or the op does not run there); not a failure.
    Unsupported(String),
}

/// One compared tensor.
#[derive(Debug, Clone)]
pub struct CheckRow {
    pub op: &'static str,
    pub case: String,
    pub dtype: DType,
    pub shape: String,
    /// `forward`, `grad <input>`, or `-` when the case did not run.
    pub tensor: String,
    /// NaN when nothing was compared.
    pub max_abs_err: f64,
    /// The largest `|got - ref| / (atol + rtol * |ref|)`: the row passes at 1 or less.
    pub worst_vs_tol: f64,
    pub tol: Tol,
    pub status: Status,
}

/// How an input of a case is fed to both sides.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// A float `Var`; its gradient is compared.
    Grad,
    /// A float tensor without gradient (frozen weights, rotary tables).
    Frozen,
    /// Non-float data (labels, masks): passed as is.
    Data,
}

type OpFn = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;

/// One op on one set of inputs, with its reference.
struct Case {
    op: &'static str,
    name: String,
    shape: String,
    inputs: Vec<(&'static str, Kind, Tensor)>,
    op_fn: OpFn,
    reference: OpFn,
}

/// Checks every op (and the tiling on CUDA) on `device` in f32 and bf16; never panics.
pub fn check_all(device: &Device) -> Vec<CheckRow> {
    let mut rows = Vec::new();
    let cases = match catch_unwind(all_cases) {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return vec![setup_failure(e.to_string())],
        Err(p) => return vec![setup_failure(panic_message(p))],
    };
    for case in &cases {
        for dtype in DTYPES {
            rows.extend(run_case(case, dtype, device));
        }
    }
    rows.extend(tiling_rows(device));
    rows
}

/// Whether every row passed or is unsupported.
pub fn all_passed(rows: &[CheckRow]) -> bool {
    rows.iter().all(|r| !matches!(r.status, Status::Fail(_)))
}

fn setup_failure(msg: String) -> CheckRow {
    CheckRow {
        op: "setup",
        case: "building the inputs".into(),
        dtype: DType::F32,
        shape: "-".into(),
        tensor: "-".into(),
        max_abs_err: f64::NAN,
        worst_vs_tol: f64::NAN,
        tol: F32_FWD,
        status: Status::Fail(msg),
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned());
    format!("panicked: {}", msg.unwrap_or_else(|| "(no message)".into()))
}

fn tols(dtype: DType) -> (Tol, Tol) {
    match dtype {
        DType::F32 | DType::F64 => (F32_FWD, F32_GRAD),
        _ => (BF16_FWD, BF16_GRAD),
    }
}

/// The case's rows in `dtype`; a case that errors or panics gives one row saying why (`unsupported` for
/// a half dtype on the CPU, whose ops may refuse it).
fn run_case(case: &Case, dtype: DType, dev: &Device) -> Vec<CheckRow> {
    let why = match catch_unwind(AssertUnwindSafe(|| compare_case(case, dtype, dev))) {
        Ok(Ok(rows)) => return rows,
        Ok(Err(e)) => e.to_string(),
        Err(p) => panic_message(p),
    };
    let why = why.lines().next().unwrap_or_default().to_string();
    let status = if dev.is_cpu() && dtype != DType::F32 { Status::Unsupported(why) } else { Status::Fail(why) };
    vec![row(case, dtype, "-", Errors::NONE, tols(dtype).0, status)]
}

/// What a comparison measured.
#[derive(Clone, Copy)]
struct Errors {
    max_abs: f64,
    worst_vs_tol: f64,
}

impl Errors {
    const NONE: Errors = Errors { max_abs: f64::NAN, worst_vs_tol: f64::NAN };
}

fn row(case: &Case, dtype: DType, tensor: &str, e: Errors, tol: Tol, status: Status) -> CheckRow {
    CheckRow {
        op: case.op,
        case: case.name.clone(),
        dtype,
        shape: case.shape.clone(),
        tensor: tensor.into(),
        max_abs_err: e.max_abs,
        worst_vs_tol: e.worst_vs_tol,
        tol,
        status,
    }
}

/// One side's inputs: float inputs converted by `place` (Grad ones as `Var`s), data inputs by `data`.
fn side(
    case: &Case,
    rounded: &[Tensor],
    place: impl Fn(&Tensor) -> Result<Tensor>,
    data: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<(Vec<Tensor>, Vec<Option<Var>>)> {
    let (mut ts, mut vars) = (Vec::new(), Vec::new());
    for ((_, kind, _), t) in case.inputs.iter().zip(rounded) {
        let (t, v) = match kind {
            Kind::Grad => {
                let v = Var::from_tensor(&place(t)?)?;
                (v.as_tensor().clone(), Some(v))
            }
            Kind::Frozen => (place(t)?, None),
            Kind::Data => (data(t)?, None),
        };
        ts.push(t);
        vars.push(v);
    }
    Ok((ts, vars))
}

/// Runs the op on `dev` in `dtype` and the reference in f32 on the CPU; compares the output and the
/// gradient of every `Grad` input.
fn compare_case(case: &Case, dtype: DType, dev: &Device) -> Result<Vec<CheckRow>> {
    let (fwd_tol, grad_tol) = tols(dtype);
    // The numbers both sides see: float inputs rounded to `dtype`, kept as f32 on the CPU.
    let rounded = case
        .inputs
        .iter()
        .map(|(_, kind, t)| match kind {
            Kind::Data => Ok(t.clone()),
            _ => t.to_dtype(dtype)?.to_dtype(DType::F32),
        })
        .collect::<Result<Vec<_>>>()?;
    let (op_in, op_vars) = side(case, &rounded, |t| t.to_dtype(dtype)?.to_device(dev), |t| t.to_device(dev))?;
    let (ref_in, ref_vars) = side(case, &rounded, |t| Ok(t.clone()), |t| Ok(t.clone()))?;
    let y = (case.op_fn)(&op_in)?;
    let y_ref = (case.reference)(&ref_in)?;
    // The projection `r`, rounded to `dtype` so that both backwards start from the same dy.
    let r = uniform(y_ref.dims(), 991)?.to_dtype(dtype)?;
    let grads = (&y * r.to_device(dev)?)?.sum_all()?.backward()?;
    let grads_ref = (&y_ref * r.to_dtype(DType::F32)?)?.sum_all()?.backward()?;
    let mut rows = vec![compared(case, dtype, "forward", &y, &y_ref, fwd_tol)?];
    for (i, (name, _, _)) in case.inputs.iter().enumerate() {
        let (Some(v), Some(v_ref)) = (&op_vars[i], &ref_vars[i]) else { continue };
        let tensor = format!("grad {name}");
        match (grads.get(v.as_tensor()), grads_ref.get(v_ref.as_tensor())) {
            (Some(g), Some(g_ref)) => rows.push(compared(case, dtype, &tensor, g, g_ref, grad_tol)?),
            _ => rows.push(row(case, dtype, &tensor, Errors::NONE, grad_tol, Status::Fail("no gradient".into()))),
        }
    }
    Ok(rows)
}

fn compared(case: &Case, dtype: DType, tensor: &str, got: &Tensor, want: &Tensor, tol: Tol) -> Result<CheckRow> {
    let (e, bad) = max_error(got, want, tol)?;
    Ok(row(case, dtype, tensor, e, tol, bad.map_or(Status::Pass, Status::Fail)))
}

/// The largest errors (NaN if any is NaN) and the first element out of tolerance, if any.
fn max_error(got: &Tensor, want: &Tensor, tol: Tol) -> Result<(Errors, Option<String>)> {
    if got.dims() != want.dims() {
        return Ok((Errors::NONE, Some(format!("shape {:?}, reference {:?}", got.dims(), want.dims()))));
    }
    let flat =
        |t: &Tensor| -> Result<Vec<f64>> { t.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
    let (g, w) = (flat(got)?, flat(want)?);
    let (mut e, mut bad) = (Errors { max_abs: 0.0, worst_vs_tol: 0.0 }, None);
    for (i, (x, y)) in g.iter().zip(&w).enumerate() {
        let d = (x - y).abs();
        let allowed = tol.atol + tol.rtol * y.abs();
        // `within` is false for a NaN on either side, so NaN is out of tolerance.
        let within = d <= allowed;
        if !within && bad.is_none() {
            bad = Some(format!("element {i}: {x} vs reference {y}"));
        }
        // The first NaN sticks.
        if !e.max_abs.is_nan() && (d.is_nan() || d > e.max_abs) {
            e.max_abs = d;
        }
        if !e.worst_vs_tol.is_nan() && (d.is_nan() || d / allowed > e.worst_vs_tol) {
            e.worst_vs_tol = d / allowed;
        }
    }
    Ok((e, bad))
}

/// Deterministic uniform values in [-1, 1) (a 64-bit LCG, the tests' generator), f32 on the CPU.
fn uniform(dims: &[usize], seed: u64) -> Result<Tensor> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let v: Vec<f32> = (0..dims.iter().product::<usize>())
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0) as f32
        })
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
}

fn dims(t: &Tensor) -> String {
    format!("{:?}", t.dims()).replace(' ', "")
}

fn all_cases() -> Result<Vec<Case>> {
    let mut cases = attention_cases()?;
    cases.extend(norm_cases()?);
    cases.extend(rope_cases()?);
    cases.extend(cross_entropy_cases()?);
    cases.extend(frozen_linear_cases()?);
    cases.extend(dropout_cases()?);
    cases.extend(qwen3_vl::cases()?);
    Ok(cases)
}

/// Which keys each query sees, as owned data for the closures.
#[derive(Clone)]
enum Mask {
    None,
    Causal,
    Windows(Vec<usize>),
}

impl Mask {
    fn get(&self) -> AttentionMask<'_> {
        match self {
            Mask::None => AttentionMask::None,
            Mask::Causal => AttentionMask::Causal,
            Mask::Windows(cu) => AttentionMask::BlockDiagonal(cu),
        }
    }
}

/// `(name, (B, Hq, Hkv), (Tq, Tk, D), mask, padded keys of the last batch row)`: causal prefill past one
/// 64-row query block, GQA 2, decode with a KV cache (Tq < Tk) over left padding, block-diagonal windows
/// with a size-1 and an empty segment, no mask with padding; head dims 64, 80 and 128. No case has a query
/// row that sees no key (the op gives 0 there, the reference an average; no real token reads such rows).
type AttentionSpec = (&'static str, (usize, usize, usize), (usize, usize, usize), Mask, usize);

fn attention_cases() -> Result<Vec<Case>> {
    let specs: [AttentionSpec; 5] = [
        ("causal prefill", (1, 2, 2), (67, 67, 64), Mask::Causal, 0),
        ("causal GQA 2", (2, 4, 2), (29, 29, 80), Mask::Causal, 0),
        ("decode Tq<Tk, key padding, GQA 2", (2, 4, 2), (3, 71, 128), Mask::Causal, 5),
        ("block-diagonal cu_seqlens", (1, 2, 2), (45, 45, 80), Mask::Windows(vec![0, 1, 17, 17, 45]), 0),
        ("no mask, key padding, GQA 2", (2, 2, 1), (13, 13, 64), Mask::None, 4),
    ];
    specs.into_iter().enumerate().map(|(n, s)| attention_case(s, 10 * n as u64)).collect()
}

fn attention_case((name, (b, hq, hkv), (tq, tk, d), mask, pad): AttentionSpec, seed: u64) -> Result<Case> {
    let q = uniform(&[b, hq, tq, d], seed + 1)?;
    let (k, v) = (uniform(&[b, hkv, tk, d], seed + 2)?, uniform(&[b, hkv, tk, d], seed + 3)?);
    let shape = format!("q{} k{}", dims(&q), dims(&k));
    let mut inputs = vec![("q", Kind::Grad, q), ("k", Kind::Grad, k), ("v", Kind::Grad, v)];
    if pad > 0 {
        // The last batch row's first `pad` keys are left padding.
        let keep: Vec<f32> = (0..b * tk).map(|i| if i / tk == b - 1 && i % tk < pad { 0.0 } else { 1.0 }).collect();
        inputs.push(("key_padding", Kind::Data, Tensor::from_vec(keep, (b, tk), &Device::Cpu)?));
    }
    let scale = 1.0 / (d as f64).sqrt();
    let m = mask.clone();
    Ok(Case {
        op: "attention",
        name: name.into(),
        shape,
        inputs,
        op_fn: Box::new(move |t| ops::attention(&t[0], &t[1], &t[2], m.get(), t.get(3), scale)),
        reference: Box::new(move |t| attention_reference(&t[0], &t[1], &t[2], mask.get(), t.get(3), scale)),
    })
}

const NORM_EPS: f64 = 1e-6;

/// RMSNorm and LayerNorm, trained and frozen parameters, on one row, an odd row count of the vision head
/// width, and a 3-d input with an odd width.
fn norm_cases() -> Result<Vec<Case>> {
    let shapes = [("one row", vec![1usize, 64]), ("37 rows", vec![37, 80]), ("3-d, odd width", vec![3, 5, 131])];
    let mut inputs = Vec::new();
    for (n, (name, shape)) in shapes.into_iter().enumerate() {
        let seed = 100 + 10 * n as u64;
        let d = *shape.last().unwrap_or(&1);
        // Weights around 1 (as trained norms are), biases around 0.
        let w = uniform(&[d], seed + 1)?.affine(0.5, 1.0)?;
        inputs.push((name, uniform(&shape, seed)?, w, (uniform(&[d], seed + 2)? * 0.5)?));
    }
    let mut out = Vec::new();
    for trained in [true, false] {
        out.extend(inputs.iter().map(|(name, x, w, _)| rms_case(name, x, w, trained)));
        out.extend(inputs.iter().map(|(name, x, w, b)| layer_case(name, x, w, b, trained)));
    }
    Ok(out)
}

fn param_kind(trained: bool) -> Kind {
    if trained {
        Kind::Grad
    } else {
        Kind::Frozen
    }
}

fn rms_case(name: &str, x: &Tensor, w: &Tensor, trained: bool) -> Case {
    let op_fn: OpFn = match trained {
        true => Box::new(|t| ops::rms_norm(&t[0], &t[1], NORM_EPS)),
        false => Box::new(|t| ops::rms_norm_frozen(&t[0], &t[1], NORM_EPS)),
    };
    Case {
        op: if trained { "rms_norm" } else { "rms_norm_frozen" },
        name: name.into(),
        shape: format!("x{} w{}", dims(x), dims(w)),
        inputs: vec![("x", Kind::Grad, x.clone()), ("w", param_kind(trained), w.clone())],
        op_fn,
        reference: Box::new(|t| rms_norm_reference(&t[0], &t[1], NORM_EPS)),
    }
}

fn layer_case(name: &str, x: &Tensor, w: &Tensor, b: &Tensor, trained: bool) -> Case {
    let op_fn: OpFn = match trained {
        true => Box::new(|t| ops::layer_norm(&t[0], &t[1], &t[2], NORM_EPS)),
        false => Box::new(|t| ops::layer_norm_frozen(&t[0], &t[1], &t[2], NORM_EPS)),
    };
    let k = param_kind(trained);
    Case {
        op: if trained { "layer_norm" } else { "layer_norm_frozen" },
        name: name.into(),
        shape: format!("x{} w{}", dims(x), dims(w)),
        inputs: vec![("x", Kind::Grad, x.clone()), ("w", k, w.clone()), ("b", k, b.clone())],
        op_fn,
        reference: Box::new(|t| layer_norm_reference(&t[0], &t[1], &t[2], NORM_EPS)),
    }
}

/// The decoder's M-RoPE tables (Qwen2.5-VL's sections [16, 24, 24], head dim 128, positions of an image
/// grid then text) and the vision tower's 2D tables (head dim 80), broadcast over the heads.
fn rope_cases() -> Result<Vec<Case>> {
    let (b, h, t, d) = (2, 3, 19, 128);
    let mut pos = vec![0f32; 3 * b * t];
    for (i, p) in pos.iter_mut().enumerate() {
        let (axis, j) = (i / (b * t), i % t);
        // Tokens 4..13 are a 3x3 image grid (t, h, w differ), the rest text (all three equal).
        *p = match j {
            4..=12 => [4.0, 4.0 + ((j - 4) / 3) as f32, 4.0 + ((j - 4) % 3) as f32][axis],
            _ => j as f32,
        };
    }
    let pos = Tensor::from_vec(pos, (3, b, t), &Device::Cpu)?;
    let inv = Tensor::new(inv_freq(d, 1e6).as_slice(), &Device::Cpu)?;
    let (cos, sin) = mrope_cos_sin_reference(&pos, &inv, &[16, 24, 24])?;
    let text =
        rope_case("M-RoPE [16,24,24] tables", uniform(&[b, h, t, d], 300)?, cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    let (n, heads, hd) = (37, 5, 80);
    let hw: Vec<f32> = (0..n).flat_map(|i| [(i / 7) as f32, (i % 7) as f32]).collect();
    let inv = Tensor::new(inv_freq(hd / 2, 1e4).as_slice(), &Device::Cpu)?;
    let (cos, sin) = vision_rope_cos_sin_reference(&Tensor::from_vec(hw, (n, 2), &Device::Cpu)?, &inv)?;
    let vision = rope_case("vision 2D tables", uniform(&[n, heads, hd], 301)?, cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    Ok(vec![text, vision])
}

fn rope_case(name: &str, x: Tensor, cos: Tensor, sin: Tensor) -> Case {
    Case {
        op: "rope",
        name: name.into(),
        shape: format!("x{} cos{}", dims(&x), dims(&cos)),
        inputs: vec![("x", Kind::Grad, x), ("cos", Kind::Frozen, cos), ("sin", Kind::Frozen, sin)],
        op_fn: Box::new(|t| ops::rope(&t[0], &t[1], &t[2])),
        reference: Box::new(|t| rope_reference(&t[0], &t[1], &t[2])),
    }
}

/// Masked cross-entropy over an odd vocabulary: some positions supervised (the others' labels are
/// `u32::MAX`, never read), and none supervised (loss and gradient exactly 0).
fn cross_entropy_cases() -> Result<Vec<Case>> {
    let (n, v) = (23, 269);
    let mut out = Vec::new();
    for (name, supervised) in [("partly supervised", 3usize), ("nothing supervised", 0)] {
        let logits = (uniform(&[n, v], 400)? * 3.0)?;
        let sup = |i: usize| supervised > 0 && !i.is_multiple_of(supervised);
        let labels: Vec<u32> = (0..n).map(|i| if sup(i) { (i * 37 % v) as u32 } else { u32::MAX }).collect();
        let mask: Vec<f32> = (0..n).map(|i| sup(i) as u8 as f32).collect();
        out.push(Case {
            op: "cross_entropy_masked",
            name: name.into(),
            shape: format!("logits{}", dims(&logits)),
            inputs: vec![
                ("logits", Kind::Grad, logits),
                ("labels", Kind::Data, Tensor::from_vec(labels, n, &Device::Cpu)?),
                ("mask", Kind::Data, Tensor::from_vec(mask, n, &Device::Cpu)?),
            ],
            op_fn: Box::new(|t| ops::cross_entropy_masked(&t[0], &t[1], &t[2])),
            reference: Box::new(|t| ops::cross_entropy_masked_reference(&t[0], &t[1], &t[2])),
        });
    }
    Ok(out)
}

/// `x W^T` with a frozen `W`: a 3-d activation and a tall 2-d one, odd sizes.
fn frozen_linear_cases() -> Result<Vec<Case>> {
    let mut out = Vec::new();
    for (n, (xd, out_dim)) in [(vec![3usize, 7, 96], 50usize), (vec![129, 40], 17)].into_iter().enumerate() {
        let seed = 500 + 10 * n as u64;
        let x = uniform(&xd, seed)?;
        let w = (uniform(&[out_dim, xd[xd.len() - 1]], seed + 1)? * 0.2)?;
        out.push(Case {
            op: "frozen_linear",
            name: format!("{} rows, {out_dim} outputs", xd[..xd.len() - 1].iter().product::<usize>()),
            shape: format!("x{} w{}", dims(&x), dims(&w)),
            inputs: vec![("x", Kind::Grad, x), ("w", Kind::Frozen, w)],
            op_fn: Box::new(|t| ops::frozen_linear(&t[0], &t[1])),
            reference: Box::new(|t| ops::frozen_linear_reference(&t[0], &t[1])),
        });
    }
    Ok(out)
}

/// LoRA dropout at the default p = 0.05 and at 0.5, with an odd element count and an offset past 2^32
/// groups: the op hashes its mask on the device, the reference on the CPU; the gradient is the mask again.
fn dropout_cases() -> Result<Vec<Case>> {
    let mut out = Vec::new();
    let specs = [(vec![3usize, 7, 41], 0.05, 0u64), (vec![129, 17], 0.5, (1 << 34) + 3)];
    for (n, (shape, p, offset)) in specs.into_iter().enumerate() {
        let x = uniform(&shape, 600 + n as u64)?;
        let key = crate::DropoutKey { seed: 0x5eed + n as u64, layer: 42, offset };
        out.push(Case {
            op: "dropout",
            name: format!("p {p}, offset {offset}"),
            shape: format!("x{}", dims(&x)),
            inputs: vec![("x", Kind::Grad, x)],
            op_fn: Box::new(move |t| ops::dropout(&t[0], p, key)),
            reference: Box::new(move |t| crate::dropout_reference(&t[0], p, key)),
        });
    }
    Ok(out)
}

/// The tiling rows: on a CUDA device the GPU path against `tile_batch_reference`; elsewhere one row
/// saying that there is nothing to compare (the CPU path is the reference itself).
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn tiling_rows(dev: &Device) -> Vec<CheckRow> {
    #[cfg(feature = "cuda")]
    if dev.is_cuda() {
        return cuda_tiling::rows(dev);
    }
    vec![CheckRow {
        op: "tiling",
        case: "resize + normalise + patchify".into(),
        dtype: DType::F32,
        shape: "-".into(),
        tensor: "-".into(),
        max_abs_err: f64::NAN,
        worst_vs_tol: f64::NAN,
        tol: TILING_F32,
        status: Status::Unsupported("CUDA only: on the CPU the reference is the path itself".into()),
    }]
}

#[cfg(feature = "cuda")]
mod cuda_tiling {
    use super::*;
    use crate::tiling::cuda::tile_batch_cuda;
    use crate::tiling::{tile_batch_reference, ImageRef, TilingConfig};

    /// Deterministic RGB8 noise with a gradient, `w x h`.
    fn image(w: usize, h: usize, seed: u64) -> Vec<u8> {
        let noise = uniform(&[w * h * 3], seed).and_then(|t| t.to_vec1::<f32>()).unwrap_or_default();
        (0..w * h * 3)
            .map(|i| {
                let (x, y) = (i / 3 % w, i / 3 / w);
                let base = (x * 255 / w.max(1) + y * 255 / h.max(1)) / 2;
                (base as f32 + 40.0 * noise.get(i).copied().unwrap_or(0.0)).clamp(0.0, 255.0) as u8
            })
            .collect()
    }

    /// An odd small image, a 16:9 screenshot-like one, and both as one batch, in f32 and bf16.
    pub(super) fn rows(dev: &Device) -> Vec<CheckRow> {
        let imgs = [(29usize, 31usize, image(29, 31, 1)), (1280, 720, image(1280, 720, 2))];
        let refs: Vec<ImageRef> = imgs.iter().map(|(w, h, rgb)| ImageRef { rgb, width: *w, height: *h }).collect();
        let cfg = TilingConfig::default();
        let batches: [(&str, &[ImageRef]); 3] =
            [("29x31", &refs[..1]), ("1280x720", &refs[1..]), ("batch 29x31 + 1280x720", &refs[..])];
        let mut out = Vec::new();
        for (name, batch) in batches {
            for dtype in DTYPES {
                let tol = if dtype == DType::F32 { TILING_F32 } else { TILING_BF16 };
                let r = catch_unwind(AssertUnwindSafe(|| compare(dev, batch, &cfg, dtype, tol)));
                let (shape, e, status) = match r {
                    Ok(Ok(x)) => x,
                    Ok(Err(e)) => ("-".into(), Errors::NONE, Status::Fail(e)),
                    Err(p) => ("-".into(), Errors::NONE, Status::Fail(panic_message(p))),
                };
                out.push(CheckRow {
                    op: "tiling",
                    case: name.into(),
                    dtype,
                    shape,
                    tensor: "pixel_values".into(),
                    max_abs_err: e.max_abs,
                    worst_vs_tol: e.worst_vs_tol,
                    tol,
                    status,
                });
            }
        }
        out
    }

    fn compare(
        dev: &Device,
        batch: &[ImageRef],
        cfg: &TilingConfig,
        dtype: DType,
        tol: Tol,
    ) -> std::result::Result<(String, Errors, Status), String> {
        let (want, want_grid) = tile_batch_reference(batch, cfg).map_err(|e| e.to_string())?;
        let (pv, grid) = tile_batch_cuda(dev, batch, cfg, dtype).map_err(|e| e.to_string())?;
        if grid != want_grid {
            return Err(format!("grid_thw GPU {grid:?}, CPU {want_grid:?}"));
        }
        let want = Tensor::from_vec(want, pv.dims(), &Device::Cpu).map_err(|e| e.to_string())?;
        let (e, bad) = max_error(&pv, &want, tol).map_err(|e| e.to_string())?;
        Ok((format!("pixel_values{}", dims(&pv)), e, bad.map_or(Status::Pass, Status::Fail)))
    }
}

/// The rows as an aligned text table with a summary line.
pub fn table(rows: &[CheckRow]) -> String {
    let head = ["op", "case", "dtype", "shape", "tensor", "max abs err", "tolerance", "err/tol", "result"];
    let cells: Vec<[String; 9]> = rows.iter().map(cells).collect();
    let mut width = head.map(str::len);
    for c in &cells {
        for (w, s) in width.iter_mut().zip(c) {
            *w = (*w).max(s.len());
        }
    }
    let line = |c: &[String]| -> String {
        let mut s: String = c.iter().zip(&width).map(|(x, w)| format!("{x:<w$}  ")).collect();
        s.truncate(s.trim_end().len());
        s + "\n"
    };
    let mut out = line(&head.map(String::from));
    out += &line(&width.map(|w| "-".repeat(w)));
    for c in &cells {
        out += &line(c);
    }
    let count = |f: fn(&Status) -> bool| rows.iter().filter(|r| f(&r.status)).count();
    let (pass, fail) = (count(|s| *s == Status::Pass), count(|s| matches!(s, Status::Fail(_))));
    let unsupported = count(|s| matches!(s, Status::Unsupported(_)));
    out + &format!("{} checks: {pass} pass, {fail} FAIL, {unsupported} unsupported\n", rows.len())
}

fn cells(r: &CheckRow) -> [String; 9] {
    let num = |x: f64, f: fn(f64) -> String| if x.is_nan() && r.tensor == "-" { "-".into() } else { f(x) };
    let result = match &r.status {
        Status::Pass => "pass".into(),
        Status::Fail(m) => format!("FAIL: {m}"),
        Status::Unsupported(m) => format!("unsupported: {m}"),
    };
    [
        r.op.into(),
        r.case.clone(),
        format!("{:?}", r.dtype).to_lowercase(),
        r.shape.clone(),
        r.tensor.clone(),
        num(r.max_abs_err, |x| format!("{x:.2e}")),
        format!("{:e} + {:e}|ref|", r.tol.atol, r.tol.rtol),
        num(r.worst_vs_tol, |x| format!("{x:.3}")),
        result,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_or_a_large_error_fails_and_the_table_says_so() -> Result<()> {
        let want = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu)?;
        let close = Tensor::new(&[1.00001f32, 2.0, 3.0], &Device::Cpu)?;
        assert!(max_error(&close, &want, F32_FWD)?.1.is_none());
        for bad in [[1.1f32, 2.0, 3.0], [1.0, f32::NAN, 3.0]] {
            let (e, why) = max_error(&Tensor::new(&bad, &Device::Cpu)?, &want, F32_FWD)?;
            assert!(why.is_some() && (e.worst_vs_tol.is_nan() || e.worst_vs_tol > 1.0), "{bad:?}");
        }
        let mut rows = tiling_rows(&Device::Cpu);
        assert!(all_passed(&rows) && table(&rows).contains("unsupported"));
        rows[0].status = Status::Fail("planted".into());
        assert!(!all_passed(&rows) && table(&rows).contains("FAIL: planted"));
        Ok(())
    }
}
