//! `check-gpu`'s Qwen3-VL cases: the shapes of the released checkpoints with few tokens and rows.
//!
//! Vision: width 1152 in 16 heads of 72 (padded into the CUDA kernels' 80 bucket), attention within each
//! whole image, 2-D rotary over halves of 36, LayerNorm with bias at 1152, the patch embedding as a GEMM
//! (rows of 3 * 2 * 16 * 16 = 1536 pixel values, weight (1152, 1536)). DeepStack mergers: LayerNorm at
//! 4 * 1152 = 4608, Linear 4608 -> 4608 -> text width (2048 at 2B). Decoder: head dim 128 with GQA 4
//! (32 / 8 heads at 8B), a per-head RMSNorm of width 128 on q and k, M-RoPE sections [24, 20, 20].
//! Reference: transformers' `models/qwen3_vl/configuration_qwen3_vl.py`.

use candle_core::{Device, Result, Tensor};

use super::{attention_case, dims, layer_case, rms_case, rope_case, uniform, Case, Kind, Mask, OpFn, NORM_EPS};
use crate::ops;
use crate::rms_norm_reference;
use crate::rope::{inv_freq, mrope_cos_sin_reference, vision_rope_cos_sin_reference};

/// Every Qwen3-VL case, in the table's order.
pub(super) fn cases() -> Result<Vec<Case>> {
    let mut out = attention()?;
    out.extend(norms()?);
    out.extend(rope()?);
    out.extend(linear()?);
    Ok(out)
}

fn attention() -> Result<Vec<Case>> {
    let specs: [super::AttentionSpec; 3] = [
        ("Qwen3-VL vision, 2 images, D 72", (1, 2, 2), (40, 40, 72), Mask::Windows(vec![0, 24, 40]), 0),
        ("Qwen3-VL decoder causal, GQA 4, D 128", (1, 8, 2), (33, 33, 128), Mask::Causal, 0),
        ("Qwen3-VL decode Tq<Tk, key padding, GQA 4, D 128", (2, 4, 1), (2, 50, 128), Mask::Causal, 3),
    ];
    specs.into_iter().enumerate().map(|(n, s)| attention_case(s, 700 + 10 * n as u64)).collect()
}

/// The q/k norm on a `(B, H, T, 128)` view of `(B, T, H, 128)` (as the decoder makes it), the vision
/// LayerNorm at 1152 and the mergers' at 4608, trained and frozen.
fn norms() -> Result<Vec<Case>> {
    let mut out = Vec::new();
    let x = uniform(&[2, 5, 4, 128], 800)?; // (B, T, H, D)
    let w = uniform(&[128], 801)?.affine(0.5, 1.0)?;
    for trained in [true, false] {
        let mut c = rms_case("Qwen3-VL q/k norm, (B, H, T, 128) view", &x, &w, trained);
        let op = c.op_fn;
        let view = |op: OpFn| -> OpFn { Box::new(move |t: &[Tensor]| op(&[t[0].transpose(1, 2)?, t[1].clone()])) };
        c.op_fn = view(op);
        c.reference = view(Box::new(|t: &[Tensor]| rms_norm_reference(&t[0], &t[1], NORM_EPS)));
        c.shape = format!("x{}^T(1,2) w{}", dims(&x), dims(&w));
        out.push(c);
    }
    for (n, (name, rows, d)) in
        [("Qwen3-VL vision LayerNorm", 3, 1152), ("Qwen3-VL merger LayerNorm", 2, 4608)].into_iter().enumerate()
    {
        let seed = 810 + 10 * n as u64;
        let x = uniform(&[rows, d], seed)?;
        let (w, b) = (uniform(&[d], seed + 1)?.affine(0.5, 1.0)?, (uniform(&[d], seed + 2)? * 0.5)?);
        for trained in [true, false] {
            out.push(layer_case(name, &x, &w, &b, trained));
        }
    }
    Ok(out)
}

/// The vision tower's 2-D tables at head dim 72 (18 frequencies per axis) and the decoder's M-RoPE tables
/// at 128 with sections [24, 20, 20] and theta 5e6.
fn rope() -> Result<Vec<Case>> {
    let dev = Device::Cpu;
    let (n, heads, hd) = (24, 4, 72);
    let hw: Vec<f32> = (0..n).flat_map(|i| [(i / 6) as f32, (i % 6) as f32]).collect();
    let inv = Tensor::new(inv_freq(hd / 2, 1e4).as_slice(), &dev)?;
    let (cos, sin) = vision_rope_cos_sin_reference(&Tensor::from_vec(hw, (n, 2), &dev)?, &inv)?;
    let vision = rope_case(
        "Qwen3-VL vision 2D tables, D 72",
        uniform(&[n, heads, hd], 850)?,
        cos.unsqueeze(1)?,
        sin.unsqueeze(1)?,
    );
    let (b, h, t, d) = (1, 4, 13, 128);
    let pos: Vec<f32> = (0..3 * t).map(|i| ((i % t) + (i / t) * (i % t) / 2) as f32).collect();
    let inv = Tensor::new(inv_freq(d, 5e6).as_slice(), &dev)?;
    let (cos, sin) = mrope_cos_sin_reference(&Tensor::from_vec(pos, (3, b, t), &dev)?, &inv, &[24, 20, 20])?;
    let text = rope_case(
        "Qwen3-VL M-RoPE [24,20,20], D 128",
        uniform(&[b, h, t, d], 851)?,
        cos.unsqueeze(1)?,
        sin.unsqueeze(1)?,
    );
    Ok(vec![vision, text])
}

/// The patch embedding and a DeepStack merger's two Linears, weights of a trained layer's scale
/// (~1 / sqrt(in)) so that outputs are of order 1.
fn linear() -> Result<Vec<Case>> {
    let shapes = [
        ("Qwen3-VL patch embedding", 5usize, 1536usize, 1152usize),
        ("Qwen3-VL merger fc1", 2, 4608, 4608),
        ("Qwen3-VL merger fc2 to 2B text width", 2, 4608, 2048),
    ];
    let mut out = Vec::new();
    for (n, (name, rows, d_in, d_out)) in shapes.into_iter().enumerate() {
        let seed = 900 + 10 * n as u64;
        let x = uniform(&[rows, d_in], seed)?;
        let w = (uniform(&[d_out, d_in], seed + 1)? * (1.0 / (d_in as f64).sqrt()))?;
        out.push(Case {
            op: "frozen_linear",
            name: name.into(),
            shape: format!("x{} w{}", dims(&x), dims(&w)),
            inputs: vec![("x", Kind::Grad, x), ("w", Kind::Frozen, w)],
            op_fn: Box::new(|t| ops::frozen_linear(&t[0], &t[1])),
            reference: Box::new(|t| ops::frozen_linear_reference(&t[0], &t[1])),
        });
    }
    Ok(out)
}
