//! The dropout kernel (`cuda/dropout.cu`) against the CPU op, bit for bit: the mask (the output on ones)
//! and the output on random inputs; the gradient (the same plan on the upstream gradient) exactly, f32 and bf16,
//! with sm_90's and sm_86's capabilities, in every thread order; the same bytes on a second run (a
//! recomputation); and the emulated mask's keep rate within the binomial bound of `common`.

use crate::common::{binomial_within, uniform};
use crate::{cpu_tensor, from_bytes, rounded, run, to_bytes, Failures, ORDERS};
use askgui_kernels::ops;
use askgui_kernels::plan::dropout::forward;
use askgui_kernels::plan::{Caps, Elem};
use askgui_kernels::DropoutKey;
use candle_core::{Tensor, Var};

/// The bytes of a CPU tensor in `elem`'s storage (what a device buffer of the same values holds).
fn bytes(t: &Tensor, elem: Elem) -> Vec<u8> {
    to_bytes(&crate::values(t), elem)
}

/// The CPU op's output on `x` and its gradient for the upstream `g`, as device bytes.
fn cpu(x: &[f64], g: &[f64], p: f64, key: DropoutKey, elem: Elem) -> (Vec<u8>, Vec<u8>) {
    let xv = Var::from_tensor(&cpu_tensor(x, &[x.len()], elem)).unwrap();
    let y = ops::dropout(xv.as_tensor(), p, key).unwrap();
    let gt = cpu_tensor(g, &[g.len()], elem);
    let grads = (&y * &gt).unwrap().sum_all().unwrap().backward().unwrap();
    (bytes(&y, elem), bytes(grads.get(xv.as_tensor()).unwrap(), elem))
}

#[test]
fn dropout_bitwise_against_the_cpu_op() {
    let mut f = Failures::default();
    // Sizes from one element to several blocks; offsets not a multiple of 4 and past 2^32 groups.
    let cases = [(1usize, 0u64), (7, 3), (4099, 5), (20_001, (1 << 34) + 2)];
    let mut n_case = 0;
    for (n, offset) in cases {
        for elem in [Elem::F32, Elem::Bf16] {
            for (p, caps) in [(0.05, Caps::SM90), (0.5, Caps::SM86)] {
                let order = ORDERS[n_case % 3];
                n_case += 1;
                let key = DropoutKey { seed: 0x5eed ^ n as u64, layer: 0xa11ce + n_case as u64, offset };
                let label = format!("n {n} offset {offset} {elem:?} p {p} {} {order:?}", caps.name);
                let x = rounded(&uniform(n, n_case as u64), elem);
                let g = rounded(&uniform(n, 100 + n_case as u64), elem);
                let plan = forward(n, p, key, elem).unwrap();
                let ones = vec![1.0; n];
                let (mask_cpu, _) = cpu(&ones, &ones, p, key, elem);
                let mask = run(&plan, &[to_bytes(&ones, elem)], caps, order).remove(0);
                f.check((mask == mask_cpu).then_some(()).ok_or(format!("{label}: mask differs from the CPU op's")));
                let again = run(&plan, &[to_bytes(&ones, elem)], caps, order).remove(0);
                f.check((again == mask).then_some(()).ok_or(format!("{label}: a second run drew another mask")));
                let (y_cpu, dx_cpu) = cpu(&x, &g, p, key, elem);
                let y = run(&plan, &[to_bytes(&x, elem)], caps, order).remove(0);
                f.check((y == y_cpu).then_some(()).ok_or(format!("{label}: y differs from the CPU op's")));
                // Equal values: candle adds the gradient to zeros, so the CPU side's dropped `-0.0` is `+0.0`.
                let dx = from_bytes(&run(&plan, &[to_bytes(&g, elem)], caps, order).remove(0), elem);
                f.check(
                    (dx == from_bytes(&dx_cpu, elem))
                        .then_some(())
                        .ok_or(format!("{label}: dx differs from the CPU op's")),
                );
                if n > 4000 {
                    let dropped = from_bytes(&mask, elem).iter().filter(|&&v| v == 0.0).count();
                    f.check(binomial_within(dropped, n, p, &label));
                }
                eprintln!("{label}: bitwise equal");
            }
        }
    }
    f.finish("dropout_bitwise_against_the_cpu_op");
}
