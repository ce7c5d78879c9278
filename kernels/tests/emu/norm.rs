//! RMSNorm and LayerNorm plans (`cuda/norm.cu`) against the CPU ops in the same dtype, forward and
//! backward, f32 and bf16,
//! trained and frozen parameters, in every thread order.

use crate::common::tol::{compare, Tol, BF16, F32_PARAMS, F32_ROWS};
use crate::common::uniform;
use crate::{cpu_tensor, from_bytes, rounded, run, to_bytes, values, Failures, ORDERS};
use askgui_kernels::ops;
use askgui_kernels::plan::norm::{backward, forward, Kind};
use askgui_kernels::plan::{Caps, Elem};
use candle_core::Var;

const EPS: f64 = 1e-6;

/// The CPU op's output and gradients of `sum(y * g)` for x, w (and b) on `x (rows, d)`.
fn cpu(kind: Kind, x: &[f64], w: &[f64], b: &[f64], g: &[f64], (rows, d): (usize, usize), elem: Elem) -> Vec<Vec<f64>> {
    let t = |v: &[f64], dims: &[usize]| Var::from_tensor(&cpu_tensor(v, dims, elem)).unwrap();
    let (xv, wv, bv) = (t(x, &[rows, d]), t(w, &[d]), t(b, &[d]));
    let y = match kind {
        Kind::Rms => ops::rms_norm(xv.as_tensor(), wv.as_tensor(), EPS),
        Kind::Layer => ops::layer_norm(xv.as_tensor(), wv.as_tensor(), bv.as_tensor(), EPS),
    }
    .unwrap();
    let gt = t(g, &[rows, d]);
    let grads = (&y * gt.as_tensor()).unwrap().sum_all().unwrap().backward().unwrap();
    let flat = values;
    let mut out = vec![flat(&y), flat(grads.get(xv.as_tensor()).unwrap()), flat(grads.get(wv.as_tensor()).unwrap())];
    if kind == Kind::Layer {
        out.push(flat(grads.get(bv.as_tensor()).unwrap()));
    }
    out
}

#[test]
fn norms_forward_backward() {
    let shapes = [(1, 17), (5, 64), (33, 1000), (3, 2049)];
    let cases: Vec<_> = [Kind::Rms, Kind::Layer].into_iter().flat_map(|k| shapes.map(|s| (k, s))).collect();
    check("norms_forward_backward", &cases, &[Caps::SM86]);
}

/// Runs each `(kind, (rows, d))` forward and backward (trained and frozen) in f32 and bf16 with each of
/// `caps`; fails once with every failure.
pub(crate) fn check(test: &str, cases: &[(Kind, (usize, usize))], caps: &[Caps]) {
    let mut f = Failures::default();
    let mut n = 0u64;
    for &(kind, (rows, d)) in cases {
        for elem in [Elem::F32, Elem::Bf16] {
            let order = ORDERS[n as usize % 3];
            n += 1;
            let label = format!("{kind:?} ({rows}, {d}) {elem:?} {order:?}");
            let x = rounded(&uniform(rows * d, n).iter().map(|v| 2.0 * v + 0.5).collect::<Vec<_>>(), elem);
            let w = rounded(&uniform(d, n + 100), elem);
            let b = rounded(&uniform(d, n + 200), elem);
            let g = rounded(&uniform(rows * d, n + 300), elem);
            let want = cpu(kind, &x, &w, &b, &g, (rows, d), elem);
            let (rows_tol, params_tol): (Tol, Tol) =
                if elem == Elem::F32 { (F32_ROWS, F32_PARAMS) } else { (BF16, BF16) };

            for &caps in caps {
                let label = format!("{label} {}", caps.name);
                let mut inputs = vec![to_bytes(&x, elem), to_bytes(&w, elem)];
                if kind == Kind::Layer {
                    inputs.push(to_bytes(&b, elem));
                }
                let y = run(&forward(kind, rows, d, EPS, elem).unwrap(), &inputs, caps, order);
                f.check(compare(&format!("{label} y"), &[rows, d], &from_bytes(&y[0], elem), &want[0], rows_tol));

                let inputs = vec![to_bytes(&x, elem), to_bytes(&w, elem), to_bytes(&g, elem)];
                for trained in [true, false] {
                    let out = run(&backward(kind, rows, d, EPS, trained, elem).unwrap(), &inputs, caps, order);
                    let out = from_bytes(&out[0], elem);
                    let nx = rows * d;
                    f.check(compare(
                        &format!("{label} dx (trained {trained})"),
                        &[rows, d],
                        &out[..nx],
                        &want[1],
                        rows_tol,
                    ));
                    if trained {
                        f.check(compare(&format!("{label} dw"), &[d], &out[nx..nx + d], &want[2], params_tol));
                        if kind == Kind::Layer {
                            f.check(compare(&format!("{label} db"), &[d], &out[nx + d..], &want[3], params_tol));
                        }
                    } else {
                        f.check(
                            (out.len() == nx)
                                .then_some(())
                                .ok_or(format!("{label}: frozen backward has {} values", out.len())),
                        );
                    }
                }
            }
        }
    }
    f.finish(test);
}
