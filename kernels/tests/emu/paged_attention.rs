//! The paged attention plan (`cuda/paged_attention.cu`) against the CPU op `ops::paged_attention` on the
//! same blocks, f32 and bf16, in every thread order: decode rows and a few rows at once, GQA, head dims
//! that are and are not multiples of a warp, full blocks, a cut last block, one block, and a cache of 41
//! blocks (what a 1,300-token prompt and a few decoded tokens hold).

use crate::common::tol::{compare, BF16_ATTN, F32_ATTN};
use crate::common::uniform;
use crate::{cpu_tensor, from_bytes, rounded, run, to_bytes, values, Failures, ORDERS};
use askgui_kernels::ops;
use askgui_kernels::plan::paged_attention::forward;
use askgui_kernels::plan::{Caps, Elem};

/// `(Hq, Hkv, T, D, block lengths)`.
type Case = (usize, usize, usize, usize, Vec<usize>);

fn cases() -> Vec<Case> {
    let mut long = vec![32; 40];
    long.push(3);
    vec![
        (2, 1, 1, 32, vec![5]),
        (4, 2, 1, 64, vec![32, 32, 7]),
        (4, 2, 3, 80, vec![13, 32, 20]),
        (14, 2, 1, 128, vec![32, 32, 32, 1]),
        (8, 8, 4, 17, vec![32, 4]),
        (16, 2, 1, 128, long),
    ]
}

#[test]
fn paged_attention_against_the_cpu_op() {
    let mut f = Failures::default();
    for (n, (hq, hkv, t, d, lens)) in cases().into_iter().enumerate() {
        for elem in [Elem::F32, Elem::Bf16] {
            let order = ORDERS[n % 3];
            let seed = 10 * n as u64 + (elem == Elem::Bf16) as u64;
            let label = format!("Hq {hq} Hkv {hkv} T {t} D {d} blocks {lens:?} {elem:?} {order:?}");
            let scale = 1.0 / (d as f64).sqrt();
            // Values of a few units, so that the softmax is far from uniform.
            let q = rounded(&uniform(hq * t * d, seed).iter().map(|x| 3.0 * x).collect::<Vec<_>>(), elem);
            let blocks: Vec<(Vec<f64>, Vec<f64>)> = lens
                .iter()
                .enumerate()
                .map(|(b, &len)| {
                    let kv = |s: u64| rounded(&uniform(hkv * len * d, seed * 1000 + s), elem);
                    (kv(2 * b as u64 + 1), kv(2 * b as u64 + 2))
                })
                .collect();

            let tensors: Vec<_> = blocks
                .iter()
                .zip(&lens)
                .map(|((k, v), &len)| (cpu_tensor(k, &[1, hkv, len, d], elem), cpu_tensor(v, &[1, hkv, len, d], elem)))
                .collect();
            let want = values(&ops::paged_attention(&cpu_tensor(&q, &[1, hq, t, d], elem), &tensors, scale).unwrap());

            let mut inputs = vec![to_bytes(&q, elem)];
            for (k, v) in &blocks {
                inputs.push(to_bytes(k, elem));
                inputs.push(to_bytes(v, elem));
            }
            let plan = forward((hq, hkv, t, d), &lens, scale, elem).unwrap();
            let out = run(&plan, &inputs, Caps::SM86, order);
            let tol = if elem == Elem::F32 { F32_ATTN } else { BF16_ATTN };
            f.check(compare(&label, &[hq, t, d], &from_bytes(&out[0], elem), &want, tol));
        }
    }
    f.finish("paged_attention_against_the_cpu_op");
}

#[test]
fn paged_attention_refuses_what_it_cannot_run() {
    let bad = [
        ((4, 3, 1, 64), vec![8], "Hq % Hkv"),
        ((4, 2, 9, 64), vec![8], "T <= keys"),
        ((4, 2, 1, 64), vec![8, 0], "no empty block"),
    ];
    for (dims, lens, says) in bad {
        let e = forward(dims, &lens, 0.125, Elem::F32).unwrap_err();
        assert!(e.0.contains(says), "{dims:?} {lens:?}: {e}");
    }
    let e = forward((4, 2, 1, 64), &[8], 0.125, Elem::I32).unwrap_err();
    assert!(e.0.contains("f32 and bf16"), "{e}");
}
