//! Rotary position embeddings: the rotation itself, M-RoPE tables for the Qwen2-VL decoder and the 2D
//! tables of its vision tower. Plain-candle references.
//!
//! The rotation is the "rotate half" convention of transformers: `x * cos + rotate_half(x) * sin` with
//! `rotate_half([x1, x2]) = [-x2, x1]`. M-RoPE (Qwen2-VL paper, section 2.1) gives every token three
//! positions (temporal, height, width); the rotary frequencies are split into `mrope_section` chunks
//! (e.g. `[16, 24, 24]` over `head_dim / 2`) and chunk `i` takes its angle from position axis `i % 3`.
//! Interleaved M-RoPE (Qwen3-VL) deals the frequencies out `t h w t h w ...` instead: frequency `j` takes
//! axis `j % 3` while that axis's section lasts (`j < 3 * section`), the temporal axis after that, so that
//! each axis spans low and high frequencies alike.

use candle_core::{Result, Tensor, D};

/// `1 / theta^(2i / dim)` for `i in 0..dim/2`, in f32 as transformers computes it.
pub fn inv_freq(dim: usize, theta: f64) -> Vec<f32> {
    (0..dim / 2).map(|i| 1f32 / (theta as f32).powf((2 * i) as f32 / dim as f32)).collect()
}

fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// `x * cos + rotate_half(x) * sin`; `cos`/`sin` broadcast against `x` (e.g. x `(B, H, T, D)` with
/// tables `(B, 1, T, D)`).
pub fn rope_reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    x.broadcast_mul(cos)? + rotate_half(x)?.broadcast_mul(sin)?
}

/// M-RoPE tables from `positions (3, B, T)` (f32): `(cos, sin)`, each `(B, T, 2 * sum(sections))`.
pub fn mrope_cos_sin_reference(positions: &Tensor, inv_freq: &Tensor, sections: &[usize]) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.dim(0)?;
    if sections.iter().sum::<usize>() != half {
        candle_core::bail!("mrope_section {sections:?} must sum to head_dim / 2 = {half}")
    }
    // (3, B, T, half)
    let freqs = positions.unsqueeze(D::Minus1)?.broadcast_mul(&inv_freq.reshape((1, 1, 1, half))?)?;
    let mut chunks = Vec::with_capacity(sections.len());
    let mut off = 0;
    for (i, &s) in sections.iter().enumerate() {
        chunks.push(freqs.get(i % 3)?.narrow(D::Minus1, off, s)?);
        off += s;
    }
    // (B, T, half) -> (B, T, 2 * half)
    let f = Tensor::cat(&chunks, D::Minus1)?;
    let f = Tensor::cat(&[&f, &f], D::Minus1)?;
    Ok((f.cos()?, f.sin()?))
}

/// The position axis (0 = t, 1 = h, 2 = w) of each of the `sum(sections)` frequencies of interleaved
/// M-RoPE (transformers' `Qwen3VLTextRotaryEmbedding`): `j % 3` where that axis's `3 * section` lasts.
pub fn mrope_interleaved_axes(sections: &[usize]) -> Result<Vec<usize>> {
    if sections.len() != 3 {
        candle_core::bail!("interleaved mrope_section {sections:?} must have three entries (t, h, w)")
    }
    let half: usize = sections.iter().sum();
    let axis = |j: usize| match j % 3 {
        a @ (1 | 2) if j < 3 * sections[a] => a,
        _ => 0,
    };
    let axes: Vec<usize> = (0..half).map(axis).collect();
    for (a, &s) in sections.iter().enumerate() {
        if axes.iter().filter(|&&x| x == a).count() != s {
            candle_core::bail!("interleaved mrope_section {sections:?}: axis {a} gets other than {s} frequencies")
        }
    }
    Ok(axes)
}

/// Interleaved M-RoPE tables ([`mrope_interleaved_axes`]) from `positions (3, B, T)` (f32): `(cos, sin)`,
/// each `(B, T, 2 * sum(sections))`.
pub fn mrope_interleaved_cos_sin_reference(
    positions: &Tensor,
    inv_freq: &Tensor,
    sections: &[usize],
) -> Result<(Tensor, Tensor)> {
    let half = inv_freq.dim(0)?;
    let axes = mrope_interleaved_axes(sections)?;
    if axes.len() != half {
        candle_core::bail!("mrope_section {sections:?} must sum to head_dim / 2 = {half}")
    }
    // (3, B, T, half), then each frequency's own axis: a sum of one-hot selections, exact in f32.
    let freqs = positions.unsqueeze(D::Minus1)?.broadcast_mul(&inv_freq.reshape((1, 1, 1, half))?)?;
    let mut f = freqs.get(0)?.zeros_like()?;
    for a in 0..3 {
        let pick: Vec<f32> = axes.iter().map(|&x| (x == a) as u8 as f32).collect();
        let pick = Tensor::from_vec(pick, (1, 1, half), positions.device())?.to_dtype(freqs.dtype())?;
        f = (f + freqs.get(a)?.broadcast_mul(&pick)?)?;
    }
    // (B, T, half) -> (B, T, 2 * half)
    let f = Tensor::cat(&[&f, &f], D::Minus1)?;
    Ok((f.cos()?, f.sin()?))
}

/// Vision 2D rotary tables from `(h, w)` patch coordinates: `(cos, sin)`, each `(N, 2 * 2 * inv_freq.len())`
/// laid out `[h freqs, w freqs, h freqs, w freqs]`.
pub fn vision_rope_cos_sin_reference(hw: &Tensor, inv_freq: &Tensor) -> Result<(Tensor, Tensor)> {
    let (n, two) = hw.dims2()?;
    if two != 2 {
        candle_core::bail!("vision rope: positions must be (N, 2), got {:?}", hw.dims())
    }
    let q = inv_freq.dim(0)?;
    // (N, 2, q) -> (N, 2q)
    let f = hw.unsqueeze(D::Minus1)?.broadcast_mul(&inv_freq.reshape((1, 1, q))?)?.reshape((n, 2 * q))?;
    let f = Tensor::cat(&[&f, &f], D::Minus1)?;
    Ok((f.cos()?, f.sin()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Qwen3-VL's [24, 20, 20] over 64 frequencies: `t h w` repeated while h and w last (j < 60), then
    /// the last four all temporal; each axis gets its section's count.
    #[test]
    fn interleaved_axes_deal_t_h_w() -> Result<()> {
        let axes = mrope_interleaved_axes(&[24, 20, 20])?;
        assert_eq!(&axes[..6], &[0, 1, 2, 0, 1, 2]);
        assert_eq!(&axes[57..], &[0, 1, 2, 0, 0, 0, 0]);
        // Over 8 frequencies w can take only 2 and 5: a section of 3 cannot be dealt.
        assert!(mrope_interleaved_axes(&[2, 3, 3]).is_err());
        // A text token (t = h = w) rotates the same whatever the layout.
        let pos = Tensor::from_vec(vec![5f32; 3], (3, 1, 1), &Device::Cpu)?;
        let inv = Tensor::new(inv_freq(16, 1e4).as_slice(), &Device::Cpu)?;
        let (a, _) = mrope_interleaved_cos_sin_reference(&pos, &inv, &[4, 2, 2])?;
        let (b, _) = mrope_cos_sin_reference(&pos, &inv, &[4, 2, 2])?;
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
        // Distinct axes: frequency 1 takes h's angle, frequency 2 w's, frequency 7 (past h's 3 * 2) t's.
        let pos = Tensor::from_vec(vec![1f32, 2., 3.], (3, 1, 1), &Device::Cpu)?;
        let (c, _) = mrope_interleaved_cos_sin_reference(&pos, &inv, &[4, 2, 2])?;
        let c = c.flatten_all()?.to_vec1::<f32>()?;
        let inv = inv_freq(16, 1e4);
        for (j, p) in [(0usize, 1f32), (1, 2.), (2, 3.), (4, 2.), (5, 3.), (7, 1.)] {
            assert!((c[j] - (p * inv[j]).cos()).abs() < 1e-6, "frequency {j}");
        }
        Ok(())
    }

    #[test]
    fn rope_is_a_rotation_by_position_times_frequency() -> Result<()> {
        let dev = Device::Cpu;
        // One pair (x0, x2) rotated by angle p * f0 with dim 4, theta 1 -> inv_freq [1, 1].
        let inv = Tensor::new(inv_freq(4, 1.0).as_slice(), &dev)?;
        let pos = Tensor::new(&[[[2f32]], [[2.]], [[2.]]], &dev)?; // (3, 1, 1)
        let (cos, sin) = mrope_cos_sin_reference(&pos, &inv, &[1, 1])?;
        let x = Tensor::new(&[[[[1f32, 0., 0., 0.]]]], &dev)?; // (1, 1, 1, 4)
        let y = rope_reference(&x, &cos.unsqueeze(1)?, &sin.unsqueeze(1)?)?.flatten_all()?.to_vec1::<f32>()?;
        assert!((y[0] - 2f32.cos()).abs() < 1e-6 && (y[2] - 2f32.sin()).abs() < 1e-6, "{y:?}");
        Ok(())
    }

    #[test]
    fn mrope_sections_pick_their_axis() -> Result<()> {
        let dev = Device::Cpu;
        let inv = Tensor::new(&[1f32, 1., 1.], &dev)?;
        // t = 1, h = 2, w = 3 for the single token
        let pos = Tensor::new(&[[[1f32]], [[2.]], [[3.]]], &dev)?;
        let (cos, _) = mrope_cos_sin_reference(&pos, &inv, &[1, 1, 1])?;
        let c = cos.flatten_all()?.to_vec1::<f32>()?;
        let want = [1f32.cos(), 2f32.cos(), 3f32.cos()];
        for (i, w) in want.iter().chain(want.iter()).enumerate() {
            assert!((c[i] - w).abs() < 1e-6);
        }
        assert!(mrope_cos_sin_reference(&pos, &inv, &[1, 1]).is_err());
        Ok(())
    }
}
