//! Attention plans (`cuda/attention.cu`, `cuda/attention_tc.cu`) against the CPU op (`ops::attention` in
//! f32 on the same rounded inputs), forward and gradients, every head-dim bucket, with sm_90's and
//! sm_86's shared memory (so bf16 runs the tensor-core kernels where they fit, the CUDA-core ones
//! elsewhere, and f32 always the CUDA-core ones).
//!
//! The backward is fed as the op feeds it on a GPU: `[q, O, dO]` with the executor's own O (rounded to
//! bf16 for bf16), and the executor forward's logsumexp (one case per test also recomputes it).

use crate::common::tol::{compare, Tol, BF16_ATTN, BF16_ATTN_GRAD, F32_ATTN, F32_ATTN_GRAD};
use crate::common::uniform;
use crate::{from_bytes, rounded, run, to_bytes, Failures, ORDERS};
use askgui_kernels::ops::attention;
use askgui_kernels::plan::attention::{backward, forward, Mask, Problem};
use askgui_kernels::plan::{Caps, Elem};
use askgui_kernels::AttentionMask;
use candle_core::{Device, Tensor, Var};

/// One problem: `(b, hq, hkv)`, `(tq, tk, d)`, a mask, and keys `from..to` of batch `bi` padded.
pub struct Case {
    name: &'static str,
    heads: (usize, usize, usize),
    lens: (usize, usize, usize),
    mask: Mask,
    pad: Option<(usize, usize, usize)>,
}

pub(crate) const fn case(
    name: &'static str,
    heads: (usize, usize, usize),
    lens: (usize, usize, usize),
    mask: Mask,
) -> Case {
    Case { name, heads, lens, mask, pad: None }
}

impl Case {
    fn problem(&self) -> Problem {
        let ((b, hq, hkv), (tq, tk, d)) = (self.heads, self.lens);
        let keep = self
            .pad
            .map(|(bi, from, to)| (0..b * tk).map(|x| !(x / tk == bi && (from..to).contains(&(x % tk)))).collect());
        Problem { b, hq, hkv, tq, tk, d, mask: self.mask.clone(), keep, scale: 1.0 / (d as f64).sqrt() }
    }
}

/// `[O, dq, dk, dv]` of the CPU op in f32 for loss `sum(O * w)`.
fn cpu(p: &Problem, xs: &[Vec<f64>; 4]) -> Vec<Vec<f64>> {
    let dims = [[p.b, p.hq, p.tq, p.d], [p.b, p.hkv, p.tk, p.d], [p.b, p.hkv, p.tk, p.d], [p.b, p.hq, p.tq, p.d]];
    let t = |i: usize| {
        Tensor::from_vec(xs[i].iter().map(|&a| a as f32).collect::<Vec<_>>(), &dims[i][..], &Device::Cpu).unwrap()
    };
    let vars = [Var::from_tensor(&t(0)).unwrap(), Var::from_tensor(&t(1)).unwrap(), Var::from_tensor(&t(2)).unwrap()];
    let pad = p.keep.as_ref().map(|k| {
        Tensor::from_vec(k.iter().map(|&x| x as u8 as f32).collect::<Vec<_>>(), (p.b, p.tk), &Device::Cpu).unwrap()
    });
    let mask = match &p.mask {
        Mask::None => AttentionMask::None,
        Mask::Causal => AttentionMask::Causal,
        Mask::Block(cu) => AttentionMask::BlockDiagonal(cu),
        Mask::CausalBlock(cu) => AttentionMask::CausalBlockDiagonal(cu),
    };
    let o =
        attention(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), mask, pad.as_ref(), p.scale).unwrap();
    let g = (&o * &t(3)).unwrap().sum_all().unwrap().backward().unwrap();
    let flat =
        |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f64::from).collect::<Vec<_>>();
    let mut out = vec![flat(&o)];
    out.extend(vars.iter().map(|v| flat(g.get(v.as_tensor()).expect("a gradient for every input"))));
    out
}

/// `[O, dq, dk, dv]` from the executor: the forward plan, then the backward plan on `[q, O, dO]`.
fn emu(
    p: &Problem,
    xs: &[Vec<f64>; 4],
    elem: Elem,
    caps: Caps,
    order: crate::emu::Order,
    recompute: bool,
) -> Vec<Vec<f64>> {
    let fwd = forward(p, elem, &caps).unwrap();
    let ins: Vec<Vec<u8>> = xs[..3].iter().map(|x| to_bytes(x, elem)).collect();
    let out = run(&fwd, &ins, caps, order);
    let o = from_bytes(&out[0], elem);
    let d = p.d;
    let qod: Vec<f64> = (0..p.b * p.hq * p.tq)
        .flat_map(|r| [&xs[0][r * d..][..d], &o[r * d..][..d], &xs[3][r * d..][..d]].concat())
        .collect();
    let mut ins = vec![to_bytes(&qod, elem), ins[1].clone(), ins[2].clone()];
    if !recompute {
        ins.push(out[1].clone());
    }
    let bwd = backward(p, elem, &caps, !recompute).unwrap();
    let grads = from_bytes(&run(&bwd, &ins, caps, order)[0], elem);
    let (nq, nk) = (p.b * p.hq * p.tq * d, p.b * p.hkv * p.tk * d);
    vec![o, grads[..nq].to_vec(), grads[nq..nq + nk].to_vec(), grads[nq + nk..].to_vec()]
}

/// Runs every case in f32 and bf16 with both capability sets; fails once with every failure.
pub(crate) fn check(test: &str, cases: &[Case]) {
    let mut f = Failures::default();
    for (n, c) in cases.iter().enumerate() {
        let p = c.problem();
        let seed = 1000 * n as u64;
        let mut xs: [Vec<f64>; 4] = [
            uniform(p.b * p.hq * p.tq * p.d, seed + 1).iter().map(|x| 2.0 * x).collect(),
            uniform(p.b * p.hkv * p.tk * p.d, seed + 2).iter().map(|x| 2.0 * x).collect(),
            uniform(p.b * p.hkv * p.tk * p.d, seed + 3).iter().map(|x| 2.0 * x).collect(),
            uniform(p.b * p.hq * p.tq * p.d, seed + 4),
        ];
        for (i, (elem, fwd_tol, grad_tol)) in
            [(Elem::F32, F32_ATTN, F32_ATTN_GRAD), (Elem::Bf16, BF16_ATTN, BF16_ATTN_GRAD)].into_iter().enumerate()
        {
            for x in xs.iter_mut() {
                *x = rounded(x, elem);
            }
            let want = cpu(&p, &xs);
            for (j, caps) in [Caps::SM90, Caps::SM86].into_iter().enumerate() {
                let order = ORDERS[(n + i + j) % 3];
                let recompute = n == 0 && j == 0;
                let label = format!(
                    "{test}/{} {elem:?} {} {order:?}{}",
                    c.name,
                    caps.name,
                    if recompute { " lse recomputed" } else { "" }
                );
                let got = emu(&p, &xs, elem, caps, order, recompute);
                let dims =
                    [[p.b, p.hq, p.tq, p.d], [p.b, p.hq, p.tq, p.d], [p.b, p.hkv, p.tk, p.d], [p.b, p.hkv, p.tk, p.d]];
                for (k, what) in ["O", "dq", "dk", "dv"].iter().enumerate() {
                    let tol: Tol = if k == 0 { fwd_tol } else { grad_tol };
                    f.check(compare(&format!("{label} {what}"), &dims[k], &got[k], &want[k], tol));
                }
            }
        }
    }
    f.finish(test);
}

#[test]
fn attention_causal_gqa_padding_decode() {
    let mut padded = case("t70_causal_pad_d64", (2, 2, 1), (70, 70, 64), Mask::Causal);
    padded.pad = Some((1, 0, 5)); // batch 1's rows 0..5 see no key at all
    let mut decode = case("decode_t3_tk130_gqa2_d32", (2, 4, 2), (3, 130, 32), Mask::Causal);
    decode.pad = Some((1, 0, 40));
    check(
        "attention_causal_gqa_padding_decode",
        &[
            case("t1_causal_gqa2_d64", (1, 4, 2), (1, 1, 64), Mask::Causal),
            case("t7_causal_gqa7_d80", (1, 7, 1), (7, 7, 80), Mask::Causal),
            padded,
            decode,
        ],
    );
}

#[test]
fn attention_head_dims_and_windows() {
    check(
        "attention_head_dims_and_windows",
        &[
            case("t129_none_d128", (1, 2, 2), (129, 129, 128), Mask::None),
            case("windows_d96", (1, 2, 1), (150, 150, 96), Mask::Block(vec![0, 64, 65, 100, 100, 150])),
            // Packed sequences of 64, 1, 35, 0 and 50 tokens, causal inside each: unaligned to the tiles.
            case("packed_gqa2_d64", (1, 4, 2), (150, 150, 64), Mask::CausalBlock(vec![0, 64, 65, 100, 100, 150])),
            case("d17_causal", (1, 2, 1), (77, 77, 17), Mask::Causal),
            case("d48_none_tq20_tk70", (1, 2, 2), (20, 70, 48), Mask::None),
        ],
    );
}
