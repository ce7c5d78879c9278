//! `paged_attention` (a decode step's attention over KV blocks read in place) against its twin, the blocks
//! concatenated and the plain-candle reference attention: GQA, one and several query rows, blocks of
//! uneven sizes (a partly filled last block, a one-token block), f32 and bf16; and its errors. Then
//! `paged_attention_forks` (the rows of several forks of one cache in one call) against its twin, each
//! fork alone through the reference.

use askgui_kernels::ops::{
    paged_attention, paged_attention_forks, paged_attention_forks_reference, paged_attention_reference,
};
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

fn f32(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}

/// bf16 blocks as f32 (the same values).
fn widened(blocks: &[(Tensor, Tensor)]) -> Vec<(Tensor, Tensor)> {
    blocks.iter().map(|(k, v)| (f32(k), f32(v))).collect()
}

fn max_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
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
    let want = paged_attention_reference(&f32(&q), &widened(&blocks), 0.25).unwrap();
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

/// `(q (1, hq, t, d), new (k, v) (1, hkv, t, d))` for `t = sum forks`, the new keys and values narrowed
/// out of a longer tensor (as the model's packed projections are).
fn fork_rows(hq: usize, hkv: usize, d: usize, forks: &[usize], seed: u64, dtype: DType) -> (Tensor, Tensor, Tensor) {
    let t: usize = forks.iter().sum();
    let q = common::tensor(&[1, hq, t, d], seed, dtype).unwrap();
    let wide = |s| common::tensor(&[1, hkv, t + 3, d], s, dtype).unwrap().narrow(2, 2, t).unwrap();
    (q, wide(seed + 1), wide(seed + 2))
}

/// f32: every fork's rows see the cached keys and their own fork's keys only, as if each fork ran alone.
/// Within 1e-6 of the values' scale (an output row is a convex combination of value rows): up to four rows
/// run the f64 online softmax (about 1e-8 here), more rows the f32 fused forward over the cache and over
/// the forks, merged by logsumexp, whose f32 `exp` and sums round at about 1e-7.
#[test]
fn paged_attention_forks_matches_each_fork_alone() {
    // (Hq, Hkv, D, cached block lengths, fork lengths)
    type Case = (usize, usize, usize, &'static [usize], &'static [usize]);
    let cases: [Case; 8] = [
        // Merged: scoring 15 action names after a serving prompt on 32-position blocks.
        (4, 2, 16, &[32; 43], &[5, 4, 6, 7, 8, 5, 5, 9, 6, 4, 5, 4, 10, 6, 4]),
        // Merged: one fork (a plain continuation); forks of one row; D = 24 and 32, GQA 6:1.
        (2, 1, 24, &[64, 5], &[6]),
        (4, 2, 16, &[32, 32, 9], &[1, 2, 1, 1, 3, 1]),
        (4, 2, 16, &[1384, 5], &[9, 4, 11]),
        (6, 1, 32, &[64, 64, 1], &[2, 7]),
        // Online softmax, one group of four rows that spans three forks.
        (4, 2, 16, &[32, 32, 9], &[1, 2, 1]),
        // Online softmax (fewer cached keys than rows): groups that span forks.
        (4, 4, 8, &[3], &[2, 1, 1, 3, 1]),
        // No cached keys: each fork attends over its own rows alone.
        (4, 2, 16, &[], &[3, 5]),
    ];
    for (i, &(hq, hkv, d, lens, forks)) in cases.iter().enumerate() {
        let (_, blocks) = case(hq, hkv, 1, d, lens, 40 + i as u64, DType::F32);
        let (q, k, v) = fork_rows(hq, hkv, d, forks, 60 + i as u64, DType::F32);
        let scale = (d as f64).powf(-0.5);
        let got = paged_attention_forks(&q, &blocks, (&k, &v), forks, scale).unwrap();
        let want = paged_attention_forks_reference(&q, &blocks, (&k, &v), forks, scale).unwrap();
        assert_eq!(got.dims(), q.dims());
        let (diff, _) = max_abs_diff(&got, &want);
        let size = blocks.iter().map(|(_, v)| v).chain([&v]).map(max_abs).fold(0f32, f32::max);
        assert!(diff <= 1e-6 * size, "case {i}: max |diff| {diff} against the values' scale {size}");
    }
}

/// The twin is what its name says: each fork's rows against the cache with that fork's keys appended,
/// under the plain causal reference.
#[test]
fn paged_attention_forks_twin_is_each_fork_appended() {
    let (_, blocks) = case(4, 2, 1, 16, &[32, 7], 80, DType::F32);
    let forks = [3, 1, 4];
    let (q, k, v) = fork_rows(4, 2, 16, &forks, 81, DType::F32);
    let got = paged_attention_forks_reference(&q, &blocks, (&k, &v), &forks, 0.25).unwrap();
    let mut start = 0;
    for n in forks {
        let mut mine = blocks.clone();
        mine.push((k.narrow(2, start, n).unwrap(), v.narrow(2, start, n).unwrap()));
        let alone = paged_attention_reference(&q.narrow(2, start, n).unwrap(), &mine, 0.25).unwrap();
        let (diff, _) = max_abs_diff(&got.narrow(2, start, n).unwrap(), &alone);
        assert_eq!(diff, 0.0, "fork at row {start}");
        start += n;
    }
}

/// bf16: within one bf16 rounding of the f32 twin on the same values widened (as for `paged_attention`).
#[test]
fn paged_attention_forks_bf16_rounds_its_output_once() {
    let forks = [2, 5, 1];
    let (_, blocks) = case(4, 2, 1, 16, &[32, 32, 3], 90, DType::BF16);
    let (q, k, v) = fork_rows(4, 2, 16, &forks, 91, DType::BF16);
    let got = paged_attention_forks(&q, &blocks, (&k, &v), &forks, 0.25).unwrap();
    let want =
        paged_attention_forks_reference(&f32(&q), &widened(&blocks), (&f32(&k), &f32(&v)), &forks, 0.25).unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    let (diff, size) = max_abs_diff(&got, &want);
    assert!(diff <= size / 256.0, "max |diff| {diff} against output scale {size}");
}

#[test]
fn paged_attention_forks_refuses_forks_that_do_not_cover_the_rows() {
    let (_, blocks) = case(4, 2, 1, 16, &[8], 95, DType::F32);
    let (q, k, v) = fork_rows(4, 2, 16, &[2, 3], 96, DType::F32);
    for forks in [&[2, 2][..], &[2, 0, 3], &[6]] {
        let err = paged_attention_forks(&q, &blocks, (&k, &v), forks, 0.25).unwrap_err().to_string();
        assert!(err.contains("add up"), "{forks:?}: {err}");
    }
    let short = k.narrow(2, 0, 4).unwrap();
    let err = paged_attention_forks(&q, &blocks, (&short, &short), &[2, 3], 0.25).unwrap_err().to_string();
    assert!(err.contains("add up"), "{err}");
    let (q3, ..) = fork_rows(3, 2, 16, &[2, 3], 97, DType::F32);
    let err = paged_attention_forks(&q3, &blocks, (&k, &v), &[2, 3], 0.25).unwrap_err().to_string();
    assert!(err.contains("Hq % Hkv"), "{err}");
}
