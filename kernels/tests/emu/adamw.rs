//! The fused AdamW kernel (`cuda/adamw.cu`) against the CPU op, bit for bit: `[p; m; v]` after a step,
//! with and without weight decay, at the first step and a later one, with sm_90's and sm_86's
//! capabilities, in every thread order, for sizes from one element to several grid sweeps.

use crate::common::uniform;
use crate::{from_bytes, run, to_bytes, Failures, ORDERS};
use askgui_kernels::adamw::AdamWStep;
use askgui_kernels::ops;
use askgui_kernels::plan::adamw::step;
use askgui_kernels::plan::{Caps, Elem};
use candle_core::{Device, Tensor};

#[test]
fn adamw_bitwise_against_the_cpu_op() {
    let mut f = Failures::default();
    let mut n_case = 0;
    for n in [1usize, 257, 5000] {
        for (weight_decay, t, caps) in [(0.01, 1, Caps::SM90), (0.0, 7, Caps::SM86)] {
            let order = ORDERS[n_case % 3];
            n_case += 1;
            let hp = AdamWStep { lr: 3e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay, step: t };
            let label = format!("n {n} wd {weight_decay} step {t} {} {order:?}", caps.name);
            let (p, g) = (uniform(n, n_case as u64), uniform(n, 50 + n_case as u64));
            // Moments as a few steps leave them: m of either sign, v >= 0.
            let m: Vec<f64> = uniform(n, 90 + n_case as u64).iter().map(|x| x * 0.1).collect();
            let v: Vec<f64> = uniform(n, 130 + n_case as u64).iter().map(|x| x * x * 0.01).collect();
            let state: Vec<f64> = m.iter().chain(&v).copied().collect();
            let tensor = |x: &[f64], dims: &[usize]| {
                Tensor::from_vec(x.iter().map(|&x| x as f32).collect::<Vec<_>>(), dims, &Device::Cpu).unwrap()
            };
            let cpu = ops::adamw_step(&tensor(&p, &[n]), &tensor(&g, &[n]), &tensor(&state, &[2, n]), &hp).unwrap();
            let want = cpu.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let ins = [to_bytes(&p, Elem::F32), to_bytes(&g, Elem::F32), to_bytes(&state, Elem::F32)];
            let got = from_bytes(&run(&step(n, &hp.consts()).unwrap(), &ins, caps, order).remove(0), Elem::F32);
            let same =
                got.len() == want.len() && got.iter().zip(&want).all(|(&a, &b)| (a as f32).to_bits() == b.to_bits());
            f.check(same.then_some(()).ok_or(format!("{label}: [p; m; v] differs from the CPU op's")));
            eprintln!("{label}: bitwise equal");
        }
    }
    f.finish("adamw_bitwise_against_the_cpu_op");
}
