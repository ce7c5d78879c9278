//! Masked cross-entropy plans (`cuda/cross_entropy.cu`) against the CPU op (in the same dtype): the mean
//! loss and dlogits,
//! f32 and bf16, a 152k vocabulary, infinite logits (the CPU op's definition), an all-masked batch, the
//! logsumexp recomputed when it is not saved.

use crate::common::tol::{compare, BF16, F32_ROWS};
use crate::common::uniform;
use crate::{cpu_tensor, from_bytes, rounded, run, to_bytes, values, Failures, ORDERS};
use askgui_kernels::ops::cross_entropy_masked;
use askgui_kernels::plan::cross_entropy::{backward, forward};
use askgui_kernels::plan::{Caps, Elem};
use candle_core::{Device, Tensor, Var};

const INF: f64 = f64::INFINITY;

/// One batch: logits `(n, v)` with some entries overridden, labels, mask.
struct Case {
    name: &'static str,
    n: usize,
    v: usize,
    set: Vec<(usize, usize, f64)>,
    labels: Vec<u32>,
    mask: Vec<f64>,
}

fn case(
    name: &'static str,
    (n, v): (usize, usize),
    set: Vec<(usize, usize, f64)>,
    labels: Vec<u32>,
    mask: Vec<f64>,
) -> Case {
    Case { name, n, v, set, labels, mask }
}

/// The CPU op's mean loss and its dlogits (upstream gradient 1), in `elem`'s dtype.
fn cpu(c: &Case, logits: &[f64], elem: Elem) -> (f64, Vec<f64>) {
    let lv = Var::from_tensor(&cpu_tensor(logits, &[c.n, c.v], elem)).unwrap();
    let labels = Tensor::from_vec(c.labels.clone(), c.n, &Device::Cpu).unwrap();
    let mask = Tensor::from_vec(c.mask.iter().map(|&m| m as f32).collect::<Vec<_>>(), c.n, &Device::Cpu).unwrap();
    let loss = cross_entropy_masked(lv.as_tensor(), &labels, &mask).unwrap();
    let g = loss.backward().unwrap();
    (values(&loss)[0], g.get(lv.as_tensor()).map(values).unwrap_or_else(|| vec![0.0; c.n * c.v]))
}

#[test]
fn cross_entropy_finite_infinite_masked() {
    let v = 1001;
    let cases = [
        case("finite", (5, v), vec![], vec![3, 1000, 7, 0, 500], vec![1.0, 1.0, 0.0, 1.0, 1.0]),
        case("vocab_151936", (2, 151_936), vec![], vec![151_935, 17], vec![1.0, 1.0]),
        case("pos_inf_at_label", (3, v), vec![(0, 7, INF)], vec![7, 2, 3], vec![1.0, 1.0, 1.0]),
        case("two_pos_inf_label_elsewhere", (2, v), vec![(1, 5, INF), (1, 900, INF)], vec![0, 6], vec![1.0, 1.0]),
        case("two_pos_inf_one_is_label", (2, v), vec![(1, 5, INF), (1, 900, INF)], vec![0, 900], vec![1.0, 1.0]),
        case("neg_inf_logits", (2, v), vec![(0, 4, -INF), (0, 9, -INF), (1, 3, -INF)], vec![1, 3], vec![1.0, 1.0]),
        case("all_neg_inf_row", (2, v), (0..v).map(|j| (1, j, -INF)).collect(), vec![4, 4], vec![1.0, 1.0]),
        case("all_masked", (3, v), vec![(1, 2, INF)], vec![u32::MAX, 1, u32::MAX], vec![0.0, 0.0, 0.0]),
    ];
    let mut f = Failures::default();
    for (n, c) in cases.iter().enumerate() {
        for elem in [Elem::F32, Elem::Bf16] {
            let order = ORDERS[n % 3];
            let label = format!("{} {elem:?} {order:?}", c.name);
            let mut logits: Vec<f64> = uniform(c.n * c.v, n as u64 + 7).iter().map(|x| 4.0 * x).collect();
            for &(r, j, x) in &c.set {
                logits[r * c.v + j] = x;
            }
            let logits = rounded(&logits, elem);
            let (loss, dlogits) = cpu(c, &logits, elem);
            let n_sup = c.mask.iter().filter(|&&m| m != 0.0).count();
            let tol = if elem == Elem::F32 { F32_ROWS } else { BF16 };
            let labels: Vec<u8> = c.labels.iter().flat_map(|l| l.to_le_bytes()).collect();
            let ins = vec![to_bytes(&logits, elem), labels, to_bytes(&c.mask, elem)];
            let out = run(&forward(c.n, c.v, n_sup, elem).unwrap(), &ins, Caps::SM86, order);
            f.check(compare(
                &format!("{label} loss"),
                &[1],
                &from_bytes(&out[0], elem),
                &[rounded(&[loss], elem)[0]],
                tol,
            ));
            for saved in [true, false] {
                let mut ins = ins.clone();
                if saved {
                    ins.push(out[1].clone());
                }
                let plan = backward(c.n, c.v, n_sup, 1.0 / n_sup.max(1) as f64, saved, elem).unwrap();
                let d = from_bytes(&run(&plan, &ins, Caps::SM86, order)[0], elem);
                f.check(compare(&format!("{label} dlogits (lse saved {saved})"), &[c.n, c.v], &d, &dlogits, tol));
            }
        }
    }
    f.finish("cross_entropy_finite_infinite_masked");
}

/// A NaN logit makes the loss NaN on both sides (the comparison helper fails on NaN, so this is checked
/// on its own).
#[test]
fn cross_entropy_nan_logit_is_nan() {
    let c = case("nan", (2, 33), vec![(1, 4, f64::NAN)], vec![0, 1], vec![1.0, 1.0]);
    let mut logits = uniform(66, 3);
    logits[33 + 4] = f64::NAN;
    let (loss, _) = cpu(&c, &logits, Elem::F32);
    let labels: Vec<u8> = c.labels.iter().flat_map(|l| l.to_le_bytes()).collect();
    let ins = vec![to_bytes(&logits, Elem::F32), labels, to_bytes(&c.mask, Elem::F32)];
    let out = run(&forward(2, 33, 2, Elem::F32).unwrap(), &ins, Caps::SM86, ORDERS[0]);
    let got = from_bytes(&out[0], Elem::F32)[0];
    assert!(loss.is_nan() && got.is_nan(), "a NaN logit: CPU loss {loss}, executor loss {got}");
}
