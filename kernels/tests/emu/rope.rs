//! Rotary plans (`cuda/rope.cu`) against the CPU op, forward and transpose (the backward), f32 and bf16:
//! M-RoPE tables `(B, 1, T, D)` for text `x (B, H, T, D)`, plain `(T, D)` tables broadcast over batch and
//! heads, and the vision layout `x (P, H, D)` with `(P, 1, D)` tables. The tables are passed as their
//! storage with the broadcast view's strides, as the GPU op passes them.

use crate::common::tol::{compare, BF16, F32_ROPE};
use crate::common::uniform;
use crate::{from_bytes, rounded, run, to_bytes, Failures, ORDERS};
use askgui_kernels::ops::rope;
use askgui_kernels::plan::rope::{plan, Direction};
use askgui_kernels::plan::{Caps, Elem};
use askgui_kernels::{mrope_cos_sin_reference, rope::inv_freq};
use candle_core::{DType, Device, Tensor, Var};

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Strides of a contiguous `table` shape broadcast (right-aligned) to `x` dims.
fn broadcast_strides(table: &[usize], x: &[usize]) -> Vec<usize> {
    let mut contiguous = vec![0; table.len()];
    let mut s = 1;
    for i in (0..table.len()).rev() {
        contiguous[i] = if table[i] == 1 { 0 } else { s };
        s *= table[i];
    }
    let lead = x.len() - table.len();
    (0..x.len()).map(|i| if i < lead { 0 } else { contiguous[i - lead] }).collect()
}

/// A case: name, x dims, the (cos, sin) table values, and the tables' dims.
pub(crate) type Case = (&'static str, Vec<usize>, (Vec<f64>, Vec<f64>), Vec<usize>);

#[test]
fn rope_forward_transpose() {
    let (b, h, t, d) = (2, 3, 37, 16);
    // M-RoPE positions (3, B, T): temporal, height, width ids as Qwen2-VL builds them for text + an image.
    let pos: Vec<f32> = (0..3 * b * t).map(|i| ((i * 7) % 41) as f32).collect();
    let pos = Tensor::from_vec(pos, (3, b, t), &Device::Cpu).unwrap();
    let inv = Tensor::from_vec(inv_freq(d, 10_000.0), d / 2, &Device::Cpu).unwrap();
    let (mc, ms) = mrope_cos_sin_reference(&pos, &inv, &[2, 3, 3]).unwrap();
    let (mc, ms) = (mc.unsqueeze(1).unwrap(), ms.unsqueeze(1).unwrap()); // (B, 1, T, D)
    let plain =
        |f: fn(f64) -> f64| (0..t * d).map(|i| f((i / d) as f64 * 0.1 + (i % d) as f64 * 0.03)).collect::<Vec<f64>>();
    let (p, hv) = (29, 4); // vision: x (P, H, D), tables (P, 1, D)
    let cases: Vec<Case> = vec![
        ("mrope_text", vec![b, h, t, d], (values(&mc), values(&ms)), vec![b, 1, t, d]),
        ("plain_t_d", vec![b, h, t, d], (plain(f64::cos), plain(f64::sin)), vec![t, d]),
        (
            "vision",
            vec![p, hv, d],
            (
                uniform(p * d, 11).iter().map(|x| x.cos()).collect(),
                uniform(p * d, 12).iter().map(|x| x.sin()).collect(),
            ),
            vec![p, 1, d],
        ),
    ];
    check("rope_forward_transpose", &cases, &[Caps::SM86]);
}

/// Runs each case forward and transposed in f32 and bf16 with each of `caps`; fails once with every failure.
pub(crate) fn check(test: &str, cases: &[Case], caps: &[Caps]) {
    let mut f = Failures::default();
    for (n, (name, xd, (cos, sin), td)) in cases.iter().enumerate() {
        for elem in [Elem::F32, Elem::Bf16] {
            let order = ORDERS[n % 3];
            let label = format!("{name} {elem:?} {order:?}");
            let nx: usize = xd.iter().product();
            let (x, g) = (rounded(&uniform(nx, n as u64), elem), rounded(&uniform(nx, n as u64 + 50), elem));
            let (cos, sin) = (rounded(cos, elem), rounded(sin, elem));
            let tensor = |v: &[f64], dims: &[usize]| {
                Tensor::from_vec(v.iter().map(|&a| a as f32).collect::<Vec<_>>(), dims, &Device::Cpu).unwrap()
            };
            let xv = Var::from_tensor(&tensor(&x, xd)).unwrap();
            let y = rope(xv.as_tensor(), &tensor(&cos, td), &tensor(&sin, td)).unwrap();
            let grads = (&y * tensor(&g, xd)).unwrap().sum_all().unwrap().backward().unwrap();
            let want = [values(&y), values(grads.get(xv.as_tensor()).unwrap())];
            let strides = broadcast_strides(td, xd);
            let tol = if elem == Elem::F32 { F32_ROPE } else { BF16 };
            for (k, (dir, input)) in [(Direction::Forward, &x), (Direction::Transpose, &g)].into_iter().enumerate() {
                let pl = plan(dir, xd, (&strides, cos.len()), (&strides, sin.len()), elem).unwrap();
                let ins = vec![to_bytes(input, elem), to_bytes(&cos, elem), to_bytes(&sin, elem)];
                for &caps in caps {
                    let got = from_bytes(&run(&pl, &ins, caps, order)[0], elem);
                    f.check(compare(&format!("{label} {dir:?} {}", caps.name), xd, &got, &want[k], tol));
                }
            }
        }
    }
    f.finish(test);
}
