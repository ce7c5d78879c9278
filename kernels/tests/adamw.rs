//! The fused AdamW op against its spec (`askgui_kernels::adamw`), element by element and bit for bit, and
//! its input checks. The optimiser's own test (`askgui-train`, `optim.rs`) holds the spec to the unfused
//! candle update it replaces, bit for bit over several steps.

mod common;

use anyhow::{ensure, Result};
use askgui_kernels::adamw::{adamw_reference, AdamWStep};
use askgui_kernels::ops::adamw_step;
use candle_core::{DType, Device, Tensor};
use common::uniform;

fn f32s(n: usize, seed: u64, scale: f64) -> Vec<f32> {
    uniform(n, seed).iter().map(|&x| (x * scale) as f32).collect()
}

#[test]
fn the_op_is_the_spec_bitwise_across_parallel_chunks() -> Result<()> {
    // Past one CPU chunk (16,384 elements), so several tasks write their own ranges.
    let n = 40_001;
    let (p, g, m) = (f32s(n, 1, 1.0), f32s(n, 2, 1.0), f32s(n, 3, 0.1));
    let v: Vec<f32> = f32s(n, 4, 0.1).iter().map(|x| x * x).collect();
    for (weight_decay, step) in [(0.01, 1), (0.0, 1000)] {
        let hp = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-6, weight_decay, step };
        let (wp, wm, wv) = adamw_reference(&hp.consts(), &p, &g, &m, &v);
        let state = Tensor::from_vec([m.clone(), v.clone()].concat(), (2, n), &Device::Cpu)?;
        let out = adamw_step(
            &Tensor::new(p.as_slice(), &Device::Cpu)?,
            &Tensor::new(g.as_slice(), &Device::Cpu)?,
            &state,
            &hp,
        )?;
        let rows = out.to_vec2::<f32>()?;
        for (name, got, want) in [("p", &rows[0], &wp), ("m", &rows[1], &wm), ("v", &rows[2], &wv)] {
            let bad = got.iter().zip(want.iter()).position(|(a, b)| a.to_bits() != b.to_bits());
            ensure!(bad.is_none(), "wd {weight_decay} step {step}: {name} differs at {bad:?}");
        }
    }
    Ok(())
}

#[test]
fn bad_inputs_are_refused_with_their_shapes() -> Result<()> {
    let hp = AdamWStep { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, step: 1 };
    let dev = Device::Cpu;
    let (p, g) = (Tensor::zeros(4, DType::F32, &dev)?, Tensor::zeros(4, DType::F32, &dev)?);
    let e = adamw_step(&p, &g, &Tensor::zeros((2, 3), DType::F32, &dev)?, &hp).unwrap_err().to_string();
    ensure!(e.contains("(2, N)") && e.contains("[2, 3]"), "{e}");
    let e = adamw_step(&p.to_dtype(DType::BF16)?, &g, &Tensor::zeros((2, 4), DType::F32, &dev)?, &hp)
        .unwrap_err()
        .to_string();
    ensure!(e.contains("`p` must be f32"), "{e}");
    Ok(())
}
