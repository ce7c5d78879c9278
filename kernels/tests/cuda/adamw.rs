//! The fused AdamW kernel on a GPU against the CPU op, bit for bit (`[p; m; v]` after a step), with and
//! without weight decay, from one element to a 3B-shaped LoRA matrix (64 x 11,008) and a full-training one
//! (2,048 x 11,008). Run: `cargo test -p askgui-kernels --features cuda --test cuda -- adamw`. Without a
//! CUDA device it prints SKIPPED and passes.

use anyhow::{ensure, Result};
use askgui_kernels::adamw::AdamWStep;
use askgui_kernels::ops::adamw_step;
use candle_core::{DType, Device, Tensor};

use crate::common::tensor;

#[test]
fn adamw_bitwise_against_the_cpu_op() -> Result<()> {
    let Some(dev) = crate::cuda_device("adamw_bitwise_against_the_cpu_op") else { return Ok(()) };
    for (k, n) in [1usize, 4097, 64 * 11008, 2048 * 11008].into_iter().enumerate() {
        for (weight_decay, step) in [(0.01, 1), (0.0, 9)] {
            let hp = AdamWStep { lr: 2e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay, step };
            let (p, g) = (tensor(&[n], k as u64, DType::F32)?, tensor(&[n], 10 + k as u64, DType::F32)?);
            let m = (tensor(&[n], 20 + k as u64, DType::F32)? * 0.1)?;
            let v = (tensor(&[n], 30 + k as u64, DType::F32)?.sqr()? * 0.01)?;
            let state = Tensor::stack(&[m, v], 0)?;
            let cpu = adamw_step(&p, &g, &state, &hp)?;
            let on = |t: &Tensor| t.to_device(&dev);
            let gpu = adamw_step(&on(&p)?, &on(&g)?, &on(&state)?, &hp)?.to_device(&Device::Cpu)?;
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
            };
            ensure!(
                bits(&gpu)? == bits(&cpu)?,
                "n {n} wd {weight_decay} step {step}: [p; m; v] differs from the CPU op's"
            );
            eprintln!("adamw n {n} wd {weight_decay} step {step}: bitwise equal to the CPU op");
        }
    }
    Ok(())
}
