//! `paged_attention` (a decode step's attention over KV blocks read in place) against its twin, the blocks
//! concatenated and the plain-candle reference attention: GQA, one and several query rows, blocks of
//! uneven sizes (a partly filled last block, a one-token block), f32 and bf16; and its errors.

use askgui_kernels::ops::{paged_attention, paged_attention_reference};
use candle_core::{DType, Tensor};

mod common;

/// `(q (1, hq, t, d), blocks (1, hkv, n_i, d))` with values from `seed`.
fn case(
    hq: usize,
    hkv: usize,
    t: usize,
    d: usize,
    lens: &[usize],
    seed: u64,
    dtype: DType,
) -> (Tensor, Vec<(Tensor, Tensor)>) {
    let q = common::tensor(&[1, hq, t, d], seed, dtype).unwrap();
    let blocks = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let s = seed + 100 * (i as u64 + 1);
            (common::tensor(&[1, hkv, n, d], s, dtype).unwrap(), common::tensor(&[1, hkv, n, d], s + 7, dtype).unwrap())
        })
        .collect();
    (q, blocks)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> (f32, f32) {
    let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
    let diff = (&a - &b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    (diff, scale)
}

/// f32: the same sums in another order and blocking (an online softmax here): within 1e-6 of the
/// output's scale.
#[test]
fn paged_attention_matches_the_concatenated_reference() {
    let cases: [(usize, usize, usize, usize, &[usize]); 9] = [
        (4, 2, 1, 16, &[64, 64, 17]),
        // A serving prompt's length: the online softmax over several steps of 128 keys, a block that ends
        // inside a step, and 6 rows (two groups of query rows) whose last keys differ.
        (4, 2, 6, 16, &[1384, 5, 3]),
        (2, 1, 1, 24, &[300]),
        (4, 2, 3, 16, &[64, 5]),
        (2, 2, 1, 8, &[1]),
        (6, 1, 2, 32, &[64, 64, 64, 1]),
        (4, 4, 4, 16, &[3, 64, 2]),
        // The serving cache's blocks of 32, with rows whose last keys fall in different blocks (rows that
        // see 127, 128, 129 and 130 keys), and three groups of query rows over ten blocks.
        (4, 2, 4, 16, &[32, 32, 32, 32, 2]),
        (2, 1, 11, 32, &[32, 32, 32, 32, 32, 32, 32, 32, 32, 7]),
    ];
    for (i, &(hq, hkv, t, d, lens)) in cases.iter().enumerate() {
        let (q, blocks) = case(hq, hkv, t, d, lens, 10 + i as u64, DType::F32);
        let scale = (d as f64).powf(-0.5);
        let got = paged_attention(&q, &blocks, scale).unwrap();
        let want = paged_attention_reference(&q, &blocks, scale).unwrap();
        assert_eq!(got.dims(), want.dims());
        let (diff, size) = max_abs_diff(&got, &want);
        assert!(diff <= 1e-6 * size.max(1e-3), "case {i}: max |diff| {diff} against output scale {size}");
    }
}

/// bf16 blocks and queries: the op computes in f64 from the bf16 values and rounds the output once, so it
/// is within one bf16 rounding (2^-8 of the output's scale) of the f32 reference on the same values
/// widened. (The bf16 reference itself rounds its scores and probabilities to bf16, so it is not the twin
/// here.)
#[test]
fn paged_attention_bf16_rounds_its_output_once() {
    let (q, blocks) = case(4, 2, 2, 16, &[64, 9], 3, DType::BF16);
    let got = paged_attention(&q, &blocks, 0.25).unwrap();
    let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let wide: Vec<(Tensor, Tensor)> = blocks.iter().map(|(k, v)| (f32(k), f32(v))).collect();
    let want = paged_attention_reference(&f32(&q), &wide, 0.25).unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    let (diff, size) = max_abs_diff(&got, &want);
    assert!(diff <= size / 256.0, "max |diff| {diff} against output scale {size}");
}

#[test]
fn paged_attention_refuses_what_does_not_fit() {
    let (q, blocks) = case(4, 2, 3, 16, &[2], 5, DType::F32);
    let err = paged_attention(&q, &blocks, 0.25).unwrap_err().to_string();
    assert!(err.contains("1 <= T <= keys"), "{err}");
    let (q, blocks) = case(3, 2, 1, 16, &[4], 5, DType::F32);
    let err = paged_attention(&q, &blocks, 0.25).unwrap_err().to_string();
    assert!(err.contains("Hq % Hkv"), "{err}");
    let (q, mut blocks) = case(4, 2, 1, 16, &[4, 4], 5, DType::F32);
    blocks[1].0 = blocks[1].0.to_dtype(DType::BF16).unwrap();
    let err = paged_attention(&q, &blocks, 0.25).unwrap_err().to_string();
    assert!(err.contains("block 1"), "{err}");
    let err = paged_attention(&q, &[], 0.25).unwrap_err().to_string();
    assert!(err.contains("no cached blocks"), "{err}");
}
