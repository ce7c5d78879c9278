//! The paged attention plan (`cuda/paged_attention.cu`) against the CPU op `ops::paged_attention` on the
//! same blocks, f32 and bf16, in every thread order: decode rows and a few rows at once, GQA, head dims
//! that are and are not multiples of a warp, blocks of uneven length, blocks narrowed from longer ones (a
//! cut prefix: read in place through their head stride), one block, a cache of 41 blocks (what a
//! 1,300-token prompt and a few decoded tokens hold) and one of a 1,300-position block and a short one
//! (a GPU cache after a prefill and a few decoded tokens).

use crate::common::tol::{compare, BF16_ATTN, F32_ATTN};
use crate::common::uniform;
use crate::{cpu_tensor, from_bytes, rounded, run, to_bytes, values, Failures, ORDERS};
use askgui_kernels::ops;
use askgui_kernels::plan::paged_attention::{forward, Block};
use askgui_kernels::plan::{Caps, Elem};

/// `(Hq, Hkv, T, D, blocks as (positions, positions of the block it is narrowed from))`.
pub(crate) type Case = (usize, usize, usize, usize, Vec<(usize, usize)>);

fn cases() -> Vec<Case> {
    let full = |lens: &[usize]| lens.iter().map(|&n| (n, n)).collect::<Vec<_>>();
    let mut long = full(&[32; 40]);
    long.push((3, 3));
    vec![
        (2, 1, 1, 32, full(&[5])),
        (4, 2, 1, 64, full(&[32, 32, 7])),
        (4, 2, 3, 80, full(&[13, 32, 20])),
        (14, 2, 1, 128, vec![(32, 32), (20, 32), (32, 32), (1, 1)]),
        (8, 8, 4, 17, vec![(30, 32), (4, 4)]),
        (16, 2, 1, 128, long),
        (16, 2, 2, 128, vec![(1_000, 1_302), (9, 9)]),
    ]
}

#[test]
fn paged_attention_against_the_cpu_op() {
    check("paged_attention_against_the_cpu_op", cases(), &[Caps::SM86]);
}

/// Runs every case in f32 and bf16 with each of `caps`; fails once with every failure.
pub(crate) fn check(test: &str, cases: Vec<Case>, caps: &[Caps]) {
    let mut f = Failures::default();
    for (n, (hq, hkv, t, d, blocks)) in cases.into_iter().enumerate() {
        for (elem, &caps) in [Elem::F32, Elem::Bf16].into_iter().flat_map(|e| caps.iter().map(move |c| (e, c))) {
            let order = ORDERS[n % 3];
            let seed = 10 * n as u64 + (elem == Elem::Bf16) as u64;
            let lens: Vec<usize> = blocks.iter().map(|b| b.0).collect();
            let label = format!("Hq {hq} Hkv {hkv} T {t} D {d} blocks {lens:?} {elem:?} {} {order:?}", caps.name);
            let scale = 1.0 / (d as f64).sqrt();
            // Values of a few units, so that the softmax is far from uniform.
            let q = rounded(&uniform(hq * t * d, seed).iter().map(|x| 3.0 * x).collect::<Vec<_>>(), elem);
            // Each block's parent (Hkv, parent, D); the block is its first `len` positions of every head.
            let parents: Vec<(Vec<f64>, Vec<f64>)> = blocks
                .iter()
                .enumerate()
                .map(|(b, &(_, parent))| {
                    let kv = |s: u64| rounded(&uniform(hkv * parent * d, seed * 1000 + s), elem);
                    (kv(2 * b as u64 + 1), kv(2 * b as u64 + 2))
                })
                .collect();

            let tensors: Vec<_> = parents
                .iter()
                .zip(&blocks)
                .map(|((k, v), &(len, parent))| {
                    let t = |x: &[f64]| cpu_tensor(x, &[1, hkv, parent, d], elem).narrow(2, 0, len).unwrap();
                    (t(k), t(v))
                })
                .collect();
            let want = values(&ops::paged_attention(&cpu_tensor(&q, &[1, hq, t, d], elem), &tensors, scale).unwrap());

            let mut inputs = vec![to_bytes(&q, elem)];
            let mut layout = Vec::new();
            for ((k, v), &(len, parent)) in parents.iter().zip(&blocks) {
                let span = (hkv - 1) * parent * d + len * d;
                inputs.push(to_bytes(&k[..span], elem));
                inputs.push(to_bytes(&v[..span], elem));
                layout.push(Block { len, head_stride: parent * d });
            }
            let plan = forward((hq, hkv, t, d), &layout, scale, elem).unwrap();
            let out = run(&plan, &inputs, caps, order);
            let tol = if elem == Elem::F32 { F32_ATTN } else { BF16_ATTN };
            f.check(compare(&label, &[hq, t, d], &from_bytes(&out[0], elem), &want, tol));
        }
    }
    f.finish(test);
}

#[test]
fn paged_attention_refuses_what_it_cannot_run() {
    let b = |len: usize| Block { len, head_stride: len * 64 };
    let bad = [
        ((4, 3, 1, 64), vec![b(8)], "Hq % Hkv"),
        ((4, 2, 9, 64), vec![b(8)], "T <= keys"),
        ((4, 2, 1, 64), vec![b(8), b(0)], "no empty block"),
        ((4, 2, 1, 64), vec![Block { len: 8, head_stride: 64 }], "head stride"),
    ];
    for (dims, blocks, says) in bad {
        let e = forward(dims, &blocks, 0.125, Elem::F32).unwrap_err();
        assert!(e.0.contains(says), "{dims:?} {blocks:?}: {e}");
    }
    let e = forward((4, 2, 1, 64), &[b(8)], 0.125, Elem::I32).unwrap_err();
    assert!(e.0.contains("f32 and bf16"), "{e}");
}
