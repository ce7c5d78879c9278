//! The counter-based dropout (`ops::dropout`) against its spec: Philox4x32-10 against Random123's
//! published known answers, the op bit for bit against `dropout_reference` (f32, bf16, f64, odd sizes,
//! offsets past 2^32, inputs across the op's parallel chunks), the gradient as the same mask times the
//! same scale, the same mask on every recomputation and for a slice of rows, and the keep rate within a
//! binomial bound. Run: `cargo test -p askgui-kernels --test dropout`.

mod common;

use anyhow::Result;
use askgui_kernels::dropout::{drop_threshold, philox4x32_10};
use askgui_kernels::ops::dropout;
use askgui_kernels::{dropout_keep_reference, dropout_reference, DropoutKey};
use candle_core::{DType, Device, Tensor, Var};
use common::{binomial_within, tensor};

/// Bits of a float tensor (any dtype), for bitwise comparisons.
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => t.to_vec1::<f32>()?.iter().map(|x| x.to_bits() as u64).collect(),
        DType::F64 => t.to_vec1::<f64>()?.iter().map(|x| x.to_bits()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>()?.iter().map(|x| x.to_bits() as u64).collect(),
        other => anyhow::bail!("bits: {other:?}"),
    })
}

const KEY: DropoutKey = DropoutKey { seed: 0x0123_4567_89ab_cdef, layer: 0xfeed_f00d_1234_5678, offset: 0 };

/// Random123's `kat_vectors` for philox4x32_10 (counter, key, output), an outside reference.
#[test]
fn philox_matches_random123_known_answers() {
    let kat: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        ([0; 4], [0; 2], [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
        ([u32::MAX; 4], [u32::MAX; 2], [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]),
        (
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
    ];
    for (counter, key, want) in kat {
        assert_eq!(philox4x32_10(counter, key), want, "counter {counter:x?} key {key:x?}");
    }
}

/// The threshold is round(p * 2^32): 0.05 * 2^32 = 214,748,364.8 rounds up; 0.5 is exactly 2^31.
#[test]
fn threshold_is_p_times_two_to_the_32() {
    assert_eq!(drop_threshold(0.05), 214_748_365);
    assert_eq!(drop_threshold(0.5), 1 << 31);
    assert_eq!(drop_threshold(0.0), 0);
}

/// Sizes across the op's 16,384-element chunks with an offset that is not a multiple of 4, and offsets
/// whose group index needs the counter's high word; every dtype; bit for bit.
#[test]
fn op_equals_reference_bitwise() -> Result<()> {
    let cases: [(&[usize], u64); 5] =
        [(&[1], 0), (&[7, 13], 3), (&[3, 5, 131], 1 << 34), (&[40_001], 6), (&[2, 2049], (1 << 34) + 5)];
    for (n, (dims, offset)) in cases.into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16, DType::F64] {
            for p in [0.05, 0.5] {
                let x = tensor(dims, n as u64, dtype)?;
                let key = DropoutKey { offset, ..KEY };
                let (got, want) = (dropout(&x, p, key)?, dropout_reference(&x, p, key)?);
                assert_eq!(got.dtype(), dtype);
                assert_eq!(got.dims(), dims);
                assert!(bits(&got)? == bits(&want)?, "{dims:?} offset {offset} {dtype:?} p {p}: op != reference");
                // Every element is x * scale or 0, as the keep bits say.
                let keep = dropout_keep_reference(x.elem_count(), p, key)?;
                let (g, xs) = (common::flat(&got)?, common::flat(&x)?);
                for ((&k, &g), &x) in keep.iter().zip(&g).zip(&xs) {
                    assert!(if k { g != 0.0 || x == 0.0 } else { g == 0.0 }, "keep {k}: {x} -> {g}");
                }
            }
        }
    }
    Ok(())
}

/// `sum(dropout(x) * r)` has gradient `r * mask / (1 - p)` with respect to x, built here by hand from
/// the keep bits (f32 products, as the op's), and the reference's autograd gives the same bits.
#[test]
fn gradient_is_the_mask_times_the_scale() -> Result<()> {
    let (p, dims) = (0.3, [5usize, 37]);
    let x = Var::from_tensor(&tensor(&dims, 1, DType::F32)?)?;
    let r = tensor(&dims, 2, DType::F32)?;
    let grad = |y: Tensor| -> Result<Tensor> {
        Ok((y * &r)?.sum_all()?.backward()?.get(x.as_tensor()).expect("x has a gradient").clone())
    };
    let got = grad(dropout(x.as_tensor(), p, KEY)?)?;
    let scale = (1.0 / (1.0 - p)) as f32;
    let keep = dropout_keep_reference(x.elem_count(), p, KEY)?;
    let want: Vec<f32> =
        r.flatten_all()?.to_vec1::<f32>()?.iter().zip(&keep).map(|(&r, &k)| r * if k { scale } else { 0.0 }).collect();
    // Exactly equal values (candle adds each gradient to zeros, so a dropped `-0.0` arrives as `+0.0`).
    assert_eq!(got.flatten_all()?.to_vec1::<f32>()?, want, "gradient != r * mask * scale");
    assert!(bits(&got)? == bits(&grad(dropout_reference(x.as_tensor(), p, KEY)?)?)?, "op and reference gradients");
    Ok(())
}

/// Recomputation hashes the same key: the same bits every time, and for a slice of rows run alone with
/// its offset, the whole input's rows. Another seed or layer gives another mask.
#[test]
fn recomputation_and_row_slices_draw_the_same_mask() -> Result<()> {
    let (rows, d, p) = (9usize, 1001usize, 0.05);
    let x = tensor(&[rows, d], 3, DType::F32)?;
    let whole = dropout(&x, p, KEY)?;
    assert!(bits(&whole)? == bits(&dropout(&x, p, KEY)?)?, "the same key drew another mask");
    let (start, len) = (2usize, 5usize);
    let key = DropoutKey { offset: (start * d) as u64, ..KEY };
    let part = dropout(&x.narrow(0, start, len)?, p, key)?;
    assert!(bits(&part)? == bits(&whole.narrow(0, start, len)?)?, "rows 2..7 alone drew another mask");
    for other in [DropoutKey { seed: KEY.seed + 1, ..KEY }, DropoutKey { layer: KEY.layer ^ 1, ..KEY }] {
        let differ = bits(&dropout(&x, p, other)?)?.iter().zip(bits(&whole)?).filter(|(a, b)| **a != *b).count();
        // Two independent masks disagree where exactly one drops: 2 p (1 - p) of 9,009 elements, ~856.
        assert!(differ > 400, "{other:?}: only {differ} elements differ from {KEY:?}");
    }
    Ok(())
}

/// The number of dropped elements of 2^20, for several keys and p = 0.05 and 0.5, is within the
/// binomial bound of `common::binomial_within` (5 standard deviations); so are the elements dropped by
/// two layers at once and the pairs of neighbours (one Philox word apart) dropped together (p^2 each,
/// as independent draws would give).
#[test]
fn keep_rate_within_a_binomial_bound() -> Result<()> {
    let n = 1usize << 20;
    let ones = Tensor::ones(n, DType::F32, &Device::Cpu)?;
    let dropped = |p: f64, key: DropoutKey| -> Result<Vec<bool>> {
        Ok(dropout(&ones, p, key)?.to_vec1::<f32>()?.iter().map(|&v| v == 0.0).collect())
    };
    for p in [0.05, 0.5] {
        for (i, seed) in [0u64, 1, 0xdead_beef, u64::MAX].into_iter().enumerate() {
            let key = DropoutKey { seed, layer: i as u64, offset: (i as u64) << 33 };
            let a = dropped(p, key)?;
            binomial_within(a.iter().filter(|&&d| d).count(), n, p, "dropped").map_err(anyhow::Error::msg)?;
            let b = dropped(p, DropoutKey { layer: key.layer + 1, ..key })?;
            let both = a.iter().zip(&b).filter(|(a, b)| **a && **b).count();
            binomial_within(both, n, p * p, "dropped by two layers").map_err(anyhow::Error::msg)?;
            let pairs = a.chunks_exact(2).filter(|c| c[0] && c[1]).count();
            binomial_within(pairs, n / 2, p * p, "neighbours dropped together").map_err(anyhow::Error::msg)?;
        }
    }
    Ok(())
}

/// p outside [0, 1) is refused with a message that says so; p = 0 is the identity.
#[test]
fn probability_is_checked() -> Result<()> {
    let x = tensor(&[3, 4], 9, DType::F32)?;
    for p in [1.0, -0.1, f64::NAN] {
        let e = dropout(&x, p, KEY).unwrap_err().to_string();
        assert!(e.contains("[0, 1)"), "{p}: {e}");
    }
    assert!(bits(&dropout(&x, 0.0, KEY)?)? == bits(&x)?);
    Ok(())
}
