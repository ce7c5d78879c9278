//! Qwen3-VL's shapes through the launch plans, against the CPU ops, f32 and bf16, with sm_90's and
//! sm_86's capabilities: real head dims and widths, few tokens and rows.
//!
//! Sizes of the released checkpoints (transformers' `qwen3_vl` configs): vision width 1152 in 16 heads
//! of 72 (not a multiple of 16 or 32: attention pads it into the 80 bucket), 2-D rotary over halves of
//! 36; decoder head dim 128 with GQA (32 / 8 heads at 8B, 16 / 8 at 2B) and a per-head RMSNorm of width
//! 128 on q and k; vision LayerNorm with bias at 1152, and the DeepStack mergers' LayerNorm at
//! 4 * 1152 = 4608. The patch embedding and the mergers' Linears are GEMMs (`frozen_linear`: cuBLAS on a
//! GPU, no plan of ours), checked in `tests/qwen3_vl_shapes.rs` and by `check-gpu`.

use crate::attention::{self, case};
use crate::{norm, paged_attention, rope};
use askgui_kernels::plan::attention::Mask;
use askgui_kernels::plan::norm::Kind;
use askgui_kernels::plan::Caps;
use askgui_kernels::rope::inv_freq;
use askgui_kernels::vision_rope_cos_sin_reference;
use candle_core::{Device, Tensor};

const BOTH: [Caps; 2] = [Caps::SM90, Caps::SM86];

#[test]
fn qwen3_vl_attention_vision_d72_and_decoder_d128_gqa() {
    attention::check(
        "qwen3_vl_attention_vision_d72_and_decoder_d128_gqa",
        &[
            // The vision tower attends within each whole image: two images of 40 and 24 patches packed.
            case("vision_two_images_d72", (1, 2, 2), (64, 64, 72), Mask::Block(vec![0, 40, 64])),
            // Decoder prefill, GQA 4 as at 8B (32 q / 8 kv heads).
            case("decoder_causal_gqa4_d128", (1, 4, 1), (37, 37, 128), Mask::Causal),
            // Two packed samples, GQA 2 as at 2B (16 / 8).
            case("decoder_packed_gqa2_d128", (1, 4, 2), (45, 45, 128), Mask::CausalBlock(vec![0, 20, 45])),
            // Decode of 2 new tokens over a 70-key cache.
            case("decoder_decode_gqa4_d128", (1, 4, 1), (2, 70, 128), Mask::Causal),
        ],
    );
}

#[test]
fn qwen3_vl_paged_decode_d128_gqa() {
    // (Hq, Hkv, T, D, blocks): the decoder's heads at 8B (GQA 4) and 2B (GQA 2), blocks of uneven length.
    let cases = vec![(8, 2, 1, 128, vec![(32, 32), (32, 32), (5, 5)]), (4, 2, 2, 128, vec![(20, 32), (9, 9)])];
    paged_attention::check("qwen3_vl_paged_decode_d128_gqa", cases, &BOTH);
}

#[test]
fn qwen3_vl_norms_q_k_norm_vision_and_merger_widths() {
    let cases = [
        // q/k norm: RMSNorm over the last dim of (B, H, T, 128) = 2 * 4 * 3 rows.
        (Kind::Rms, (24, 128)),
        // Vision blocks' and the merger's LayerNorm at 1152, DeepStack mergers' at 4608.
        (Kind::Layer, (3, 1152)),
        (Kind::Layer, (2, 4608)),
    ];
    norm::check("qwen3_vl_norms_q_k_norm_vision_and_merger_widths", &cases, &BOTH);
}

/// The interleaved M-RoPE tables of Qwen3-VL's decoder (`apply_interleaved_mrope` in transformers:
/// frequency `j` takes the height position when `j % 3 == 1` and the width when `j % 3 == 2`, for
/// `j < 3 * section`, else the temporal one), `(T, 2 * half)` as `[f, f]`, for positions `(3, T)`.
fn interleaved_mrope(pos: &[[f32; 3]], inv: &[f32], sections: [usize; 3]) -> (Vec<f64>, Vec<f64>) {
    let axis = |j: usize| match j % 3 {
        1 if j < 3 * sections[1] => 1,
        2 if j < 3 * sections[2] => 2,
        _ => 0,
    };
    let angles: Vec<f64> = pos
        .iter()
        .flat_map(|p| {
            let half: Vec<f64> = inv.iter().enumerate().map(|(j, f)| (p[axis(j)] * f) as f64).collect();
            [half.clone(), half].concat()
        })
        .collect();
    (angles.iter().map(|a| a.cos()).collect(), angles.iter().map(|a| a.sin()).collect())
}

#[test]
fn qwen3_vl_rope_vision_half_36_and_interleaved_mrope_d128() {
    // Vision: x (P, H, 72), tables (P, 1, 72) from (h, w) patch coordinates of a 4 x 5 grid; the rotary
    // is `head_dim / 2 = 36` wide, 18 frequencies per axis, laid out [h, w, h, w] (theta 1e4).
    let (p, hv, dv) = (20, 2, 72);
    let hw: Vec<f32> = (0..p).flat_map(|i| [(i / 5) as f32, (i % 5) as f32]).collect();
    let inv = Tensor::new(inv_freq(dv / 2, 1e4).as_slice(), &Device::Cpu).unwrap();
    let (c, s) = vision_rope_cos_sin_reference(&Tensor::from_vec(hw, (p, 2), &Device::Cpu).unwrap(), &inv).unwrap();
    let vision = (crate::values(&c), crate::values(&s));
    // Decoder: x (1, 4, 11, 128) with interleaved M-RoPE, sections [24, 20, 20], theta 5e6; tokens 3..9
    // are a 2 x 3 image (t, h, w differ), the rest text.
    let (h, t, d) = (4, 11, 128);
    let pos: Vec<[f32; 3]> = (0..t)
        .map(|j| match j {
            3..=8 => [3.0, 3.0 + ((j - 3) / 3) as f32, 3.0 + ((j - 3) % 3) as f32],
            _ => [j as f32; 3],
        })
        .collect();
    let text = interleaved_mrope(&pos, &inv_freq(d, 5e6), [24, 20, 20]);
    let cases: Vec<rope::Case> = vec![
        ("vision_d72", vec![p, hv, dv], vision, vec![p, 1, dv]),
        ("interleaved_mrope_d128", vec![1, h, t, d], text, vec![t, d]),
    ];
    rope::check("qwen3_vl_rope_vision_half_36_and_interleaved_mrope_d128", &cases, &BOTH);
}
