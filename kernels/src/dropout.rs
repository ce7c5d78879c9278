//! LoRA dropout's mask, the spec: inverted dropout whose keep bit for element `e` is a Philox4x32-10
//! hash of `(seed, layer, e)`, and its plain-candle reference. The fast op is [`crate::ops::dropout()`]
//! (CPU and CUDA); its launch plan is [`crate::plan::dropout`].
//!
//! Mask layout ([`DropoutKey`]): element `e = offset + i` (`i` its row-major index in `x`) takes word
//! `e % 4` of `philox4x32_10(counter = [lo(e / 4), hi(e / 4), lo(layer), hi(layer)], key = [lo(seed),
//! hi(seed)])`, one hash per four elements, and is dropped when that word is below `round(p * 2^32)`.
//! Reference: Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011); known answers from
//! Random123's `kat_vectors` (`tests/dropout.rs`).

use candle_core::{bail, DType, Result, Tensor};

/// What a dropout mask is a function of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DropoutKey {
    /// The step's seed: the trainer derives it from the run's seed, the optimiser step and the
    /// micro-batch, so that every step draws new masks.
    pub seed: u64,
    /// Which layer: distinct layers draw independent masks under one seed.
    pub layer: u64,
    /// The index, in the layer's whole input, of this tensor's first element: a slice of rows that runs on
    /// its own passes the rows before it times the row length, and draws the whole input's mask.
    pub offset: u64,
}

pub(crate) const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
pub(crate) const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox4x32 with 10 rounds (Random123's `philox4x32_10`): four 32-bit words from a 128-bit counter
/// and a 64-bit key. `cuda/dropout.cu` is the same function in C.
#[inline]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(PHILOX_W[0]), k[1].wrapping_add(PHILOX_W[1])];
        }
        let p0 = u64::from(PHILOX_M[0]) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M[1]) * u64::from(c[2]);
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// The Philox output of the group of four elements `group` (elements `4 group .. 4 group + 4`).
#[inline]
fn group_words(key: &DropoutKey, group: u64) -> [u32; 4] {
    let counter = [group as u32, (group >> 32) as u32, key.layer as u32, (key.layer >> 32) as u32];
    philox4x32_10(counter, [key.seed as u32, (key.seed >> 32) as u32])
}

/// The 32-bit word below which an element is dropped: `round(p * 2^32)`, so an element is dropped with
/// probability within 2^-33 of `p`. `p` must be in [0, 1).
pub fn drop_threshold(p: f64) -> u32 {
    (p * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

pub(crate) fn check_p(p: f64) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        bail!("dropout: the probability is {p}; it must be in [0, 1)")
    }
    Ok(())
}

/// Whether each of `n` elements is kept, one Philox evaluation per element: the plain spec of the mask
/// that [`dropout`] computes four elements per evaluation.
pub fn dropout_keep_reference(n: usize, p: f64, key: DropoutKey) -> Result<Vec<bool>> {
    check_p(p)?;
    let t = drop_threshold(p);
    Ok((0..n as u64)
        .map(|i| {
            let e = key.offset + i;
            group_words(&key, e / 4)[(e % 4) as usize] >= t
        })
        .collect())
}

/// [`dropout`] by candle's ops: `x` times the mask of [`dropout_keep_reference`] scaled by `1 / (1 - p)`,
/// computed in f32 for f32 and bf16 (then rounded once) and in f64 for f64, as the op does.
pub fn dropout_reference(x: &Tensor, p: f64, key: DropoutKey) -> Result<Tensor> {
    let keep = dropout_keep_reference(x.elem_count(), p, key)?;
    let scale = 1.0 / (1.0 - p);
    let work = if x.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    let m: Vec<f64> = keep.into_iter().map(|k| if k { scale } else { 0.0 }).collect();
    // The f32 mask holds `scale` rounded to f32, the op's f32 multiplier.
    let mask = Tensor::from_vec(m, x.shape(), x.device())?.to_dtype(work)?;
    (x.to_dtype(work)? * mask)?.to_dtype(x.dtype())
}
