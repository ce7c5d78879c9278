//! The narrow-weight GEMMs (`ops::narrow`) against their twin, the whole weight widened to f32 and
//! candle's matmul: int8 weight-only linears and bf16 frozen linears, on the decode path (few rows, small
//! parallel panels) and the prefill path (many rows, large panels), with output sizes that leave a short
//! last panel. Plus the quantisation's own error bound.

use askgui_kernels::ops::{dequantize_int8, frozen_linear, int8_linear, narrow_linear_reference, quantize_int8};
use candle_core::{DType, Device, Tensor};

mod common;

fn values(n: usize, seed: u64) -> Vec<f32> {
    common::uniform(n, seed).into_iter().map(|x| x as f32).collect()
}

fn tensor(shape: (usize, usize), seed: u64) -> Tensor {
    common::tensor(&[shape.0, shape.1], seed, DType::F32).unwrap()
}

fn max_abs(t: &Tensor) -> f32 {
    t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_dtype(DType::F32).unwrap().to_scalar().unwrap()
}

/// (rows of x, in, out): decode-sized and prefill-sized, out not a multiple of any panel.
const SHAPES: [(usize, usize, usize); 4] = [(1, 4096, 1100), (3, 96, 1003), (20, 4096, 1100), (40, 72, 37)];

/// int8: the GEMM equals the dequantised weight's f32 matmul up to summation order. Tolerance 1e-5 of
/// the largest output: f32 dot products of up to 4,096 terms of O(1), summed in another order.
#[test]
fn int8_linear_matches_the_dequantised_matmul() {
    for (i, &(n, d_in, d_out)) in SHAPES.iter().enumerate() {
        let x = tensor((n, d_in), 10 + i as u64);
        let w = tensor((d_out, d_in), 20 + i as u64);
        let (q, scales) = quantize_int8(&w).unwrap();
        let got = int8_linear(&x, &q, &scales).unwrap();
        let want = narrow_linear_reference(&x, &dequantize_int8(&q, &scales).unwrap()).unwrap();
        assert_eq!(got.dims(), &[n, d_out]);
        let err = max_abs(&(&got - &want).unwrap());
        let tol = 1e-5 * max_abs(&want);
        assert!(err <= tol, "{n}x{d_in} @ {d_out}: |int8_linear - reference| = {err} > {tol}");
    }
}

/// Each quantised weight is within half a step (its row's scale / 2) of the original; a zero row stays
/// zero; an all-equal row is exact at its extreme.
#[test]
fn quantisation_is_within_half_a_step() {
    let mut w = values(64 * 48, 7);
    w[..48].fill(0.0); // row 0: zeros
    w[48..96].fill(-0.5); // row 1: constant
    let w = Tensor::from_vec(w, (64, 48), &Device::Cpu).unwrap();
    let (q, scales) = quantize_int8(&w).unwrap();
    assert_eq!((q.dtype(), scales.dtype()), (DType::U8, DType::F32));
    let back = dequantize_int8(&q, &scales).unwrap();
    let err = (&back - &w).unwrap().abs().unwrap().to_vec2::<f32>().unwrap();
    let s = scales.to_vec1::<f32>().unwrap();
    for (r, row) in err.iter().enumerate() {
        let worst = row.iter().fold(0f32, |m, &e| m.max(e));
        assert!(worst <= s[r] / 2.0 * (1.0 + 1e-6), "row {r}: error {worst} over half the scale {}", s[r]);
    }
    assert_eq!(s[0], 0.0);
    assert_eq!(back.get(0).unwrap().to_vec1::<f32>().unwrap(), vec![0.0; 48]);
    assert_eq!(back.get(1).unwrap().to_vec1::<f32>().unwrap(), vec![-0.5; 48]);
    let q = q.to_vec2::<u8>().unwrap();
    assert!(q.iter().flatten().all(|&u| (1..=255).contains(&u)), "q stays in -127..=127");
}

/// bf16 weights through `frozen_linear` (panel by panel) against the whole weight widened: both round
/// the f32 result to bf16 once, so they differ by at most one bf16 step (2^-8 relative) where summation
/// order moves a value across a rounding boundary.
#[test]
fn bf16_frozen_linear_reads_panels_as_the_whole_weight() {
    for (i, &(n, d_in, d_out)) in SHAPES.iter().enumerate() {
        let x = tensor((n, d_in), 30 + i as u64).to_dtype(DType::BF16).unwrap();
        let w = tensor((d_out, d_in), 40 + i as u64).to_dtype(DType::BF16).unwrap();
        let got = frozen_linear(&x, &w).unwrap().to_dtype(DType::F32).unwrap();
        let want = narrow_linear_reference(&x, &w).unwrap().to_dtype(DType::F32).unwrap();
        let diff = (&got - &want).unwrap().abs().unwrap().to_vec2::<f32>().unwrap();
        let want = want.abs().unwrap().to_vec2::<f32>().unwrap();
        for (r, (d, w)) in diff.iter().zip(&want).enumerate() {
            for (c, (d, w)) in d.iter().zip(w).enumerate() {
                assert!(*d <= w / 256.0 + 1e-6, "{n}x{d_in} @ {d_out}: ({r}, {c}) differs by {d} at {w}");
            }
        }
    }
}

/// Bad shapes and devices are errors that say what is wrong.
#[test]
fn mismatched_shapes_are_refused() {
    let (q, scales) = quantize_int8(&tensor((8, 16), 1)).unwrap();
    let message = int8_linear(&tensor((2, 12), 2), &q, &scales).unwrap_err().to_string();
    assert!(message.contains("int8_linear") && message.contains("disagree"), "{message}");
    let f64x = tensor((2, 16), 3).to_dtype(DType::F64).unwrap();
    let message = int8_linear(&f64x, &q, &scales).unwrap_err().to_string();
    assert!(message.contains("f32 or bf16"), "{message}");
}
