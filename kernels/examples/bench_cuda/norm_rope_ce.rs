//! GPU benchmark of the training ops' CUDA paths at the Qwen2.5-VL-3B shapes: RMSNorm (decoder, 4096 x
//! 2048), LayerNorm (Qwen2-VL vision tower, 16384 x 1280), RoPE on q (1, 16, 4096, 128), the masked
//! cross-entropy over 4096 x 151936 logits with half the rows supervised, and `frozen_linear` (the MLP up
//! projection, 4096 x 2048 -> 11008), and the LM head with the loss over 4096 supervised rows (2048 ->
//! 151936), fused (`linear_cross_entropy`, `"variant": "fused"`: its forward also computes the gradients,
//! as Liger's does) and through the full logits (`"variant": "unfused"`). Norm weights are frozen
//! (`*_frozen`), as in LoRA training.
//!
//! One JSON line per (op, dtype): `{"bench", "impl": "askgui", "dtype", shape fields, "fwd_ms",
//! "fwd_bwd_ms"}`, the same keys as `scripts/gpu/bench_torch_ops.py` (`"impl": "torch"`). `fwd_bwd_ms`
//! is forward plus `backward()` seeded with ones (candle's default), gradient for the activation only.
//! Run: `cargo run --release -p askgui-kernels --features cuda --example bench_cuda -- norm_rope_ce`.

use crate::median_ms;
use anyhow::Result;
use askgui_kernels::ops::{
    cross_entropy_masked, frozen_linear, layer_norm_frozen, linear_cross_entropy, rms_norm_frozen, rope,
};
use candle_core::{DType, Device, Tensor, Var};
use serde_json::{json, Value};

const WARMUP: usize = 3;
const ITERS: usize = 20;

/// Times `f` (forward) and `f` + `backward()` with `x` a `Var`; prints the JSON line.
fn bench(dev: &Device, mut fields: Value, x: &Var, f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>) -> Result<()> {
    let fwd_ms = median_ms(dev, WARMUP, ITERS, || {
        f(x.as_tensor())?;
        Ok(())
    })?;
    let fwd_bwd_ms = median_ms(dev, WARMUP, ITERS, || {
        f(x.as_tensor())?.backward()?;
        Ok(())
    })?;
    fields["impl"] = json!("askgui");
    fields["fwd_ms"] = json!(fwd_ms);
    fields["fwd_bwd_ms"] = json!(fwd_bwd_ms);
    println!("{fields}");
    Ok(())
}

fn randn(dims: &[usize], dtype: DType, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1f32, dims, dev)?.to_dtype(dtype)?)
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

pub fn run(dev: &Device) -> Result<()> {
    for dtype in [DType::BF16, DType::F32] {
        let dt = dtype_name(dtype);

        let (rows, hidden) = (4096, 2048);
        let x = Var::from_tensor(&randn(&[rows, hidden], dtype, dev)?)?;
        let w = randn(&[hidden], dtype, dev)?;
        let f = |x: &Tensor| rms_norm_frozen(x, &w, 1e-6);
        bench(dev, json!({"bench": "rms_norm", "dtype": dt, "rows": rows, "hidden": hidden}), &x, &f)?;

        let (rows, hidden) = (16384, 1280);
        let x = Var::from_tensor(&randn(&[rows, hidden], dtype, dev)?)?;
        let (w, b) = (randn(&[hidden], dtype, dev)?, randn(&[hidden], dtype, dev)?);
        let f = |x: &Tensor| layer_norm_frozen(x, &w, &b, 1e-6);
        bench(dev, json!({"bench": "layer_norm", "dtype": dt, "rows": rows, "hidden": hidden}), &x, &f)?;

        let (bs, h, t, d) = (1, 16, 4096, 128);
        let x = Var::from_tensor(&randn(&[bs, h, t, d], dtype, dev)?)?;
        let angles = randn(&[bs, 1, t, d], DType::F32, dev)?;
        let (cos, sin) = (angles.cos()?.to_dtype(dtype)?, angles.sin()?.to_dtype(dtype)?);
        let f = |x: &Tensor| rope(x, &cos, &sin);
        bench(dev, json!({"bench": "rope", "dtype": dt, "b": bs, "h": h, "t": t, "d": d}), &x, &f)?;

        let (rows, vocab) = (4096, 151936);
        let x = Var::from_tensor(&randn(&[rows, vocab], dtype, dev)?)?;
        let labels: Vec<u32> = (0..rows as u32).map(|r| r.wrapping_mul(2654435761) % vocab as u32).collect();
        let labels = Tensor::from_vec(labels, rows, dev)?;
        let mask: Vec<f32> = (0..rows).map(|r| (r % 2) as f32).collect();
        let mask = Tensor::from_vec(mask, rows, dev)?.to_dtype(dtype)?;
        let f = |x: &Tensor| cross_entropy_masked(x, &labels, &mask);
        let fields = json!({"bench": "cross_entropy", "dtype": dt, "rows": rows, "vocab": vocab, "mask_frac": 0.5});
        bench(dev, fields, &x, &f)?;
        drop(x);

        let (rows, hidden, vocab) = (4096, 2048, 151936);
        let x = Var::from_tensor(&randn(&[rows, hidden], dtype, dev)?)?;
        let w = (randn(&[vocab, hidden], dtype, dev)? * (1.0 / (hidden as f64).sqrt()))?;
        let labels: Vec<u32> = (0..rows as u32).map(|r| r.wrapping_mul(2654435761) % vocab as u32).collect();
        let labels = Tensor::from_vec(labels, rows, dev)?;
        let ones = Tensor::ones(rows, dtype, dev)?;
        let fields =
            json!({"bench": "linear_cross_entropy", "dtype": dt, "rows": rows, "hidden": hidden, "vocab": vocab});
        let mut fused = fields.clone();
        fused["variant"] = json!("fused");
        bench(dev, fused, &x, &|x: &Tensor| linear_cross_entropy(x, &w, &labels, None))?;
        let mut unfused = fields;
        unfused["variant"] = json!("unfused");
        bench(dev, unfused, &x, &|x: &Tensor| cross_entropy_masked(&frozen_linear(x, &w)?, &labels, &ones))?;
        drop((x, w));

        let (rows, d_in, d_out) = (4096, 2048, 11008);
        let x = Var::from_tensor(&randn(&[rows, d_in], dtype, dev)?)?;
        let w = (randn(&[d_out, d_in], dtype, dev)? * (1.0 / (d_in as f64).sqrt()))?;
        let f = |x: &Tensor| frozen_linear(x, &w);
        let fields = json!({"bench": "frozen_linear", "dtype": dt, "rows": rows, "in": d_in, "out": d_out});
        bench(dev, fields, &x, &f)?;
    }
    Ok(())
}
