//! The dropout kernel on a GPU against the CPU op, bit for bit: output and gradient (the same kernel on
//! the upstream gradient), f32 and bf16, odd sizes, an offset past 2^32 groups, and the 3B shape's
//! largest LoRA input (4,096 tokens x 11,008). Run: `cargo test -p askgui-kernels --features cuda --test
//! cuda -- dropout`. Without a CUDA device it prints SKIPPED and passes.

use anyhow::{ensure, Result};
use askgui_kernels::ops::dropout;
use askgui_kernels::DropoutKey;
use candle_core::{DType, Device, Tensor, Var};

use crate::common::tensor;

/// `dropout(x)` and its gradient for the upstream `g`, on `dev`, back on the CPU.
fn run(x: &Tensor, g: &Tensor, p: f64, key: DropoutKey, dev: &Device) -> Result<(Tensor, Tensor)> {
    let xv = Var::from_tensor(&x.to_device(dev)?)?;
    let y = dropout(xv.as_tensor(), p, key)?;
    let grads = (&y * g.to_device(dev)?)?.sum_all()?.backward()?;
    let dx = grads.get(xv.as_tensor()).expect("x has a gradient").to_device(&Device::Cpu)?;
    Ok((y.to_device(&Device::Cpu)?, dx))
}

/// Bitwise equal (both outputs through `f32`, which holds every bf16 exactly).
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    let f = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    };
    Ok(f(a)? == f(b)?)
}

#[test]
fn dropout_bitwise_against_the_cpu_op() -> Result<()> {
    let Some(dev) = crate::cuda_device("dropout_bitwise_against_the_cpu_op") else { return Ok(()) };
    let cases: [(&[usize], u64); 4] = [(&[1], 0), (&[7, 13], 3), (&[129, 2049], (1 << 34) + 5), (&[4096, 11008], 0)];
    for (n, (dims, offset)) in cases.into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let key = DropoutKey { seed: 17 + n as u64, layer: 0xabc, offset };
            let (x, g) = (tensor(dims, n as u64, dtype)?, tensor(dims, 50 + n as u64, dtype)?);
            let (y, dx) = run(&x, &g, 0.05, key, &dev)?;
            let (y_cpu, dx_cpu) = run(&x, &g, 0.05, key, &Device::Cpu)?;
            ensure!(same_bits(&y, &y_cpu)?, "{dims:?} {dtype:?} offset {offset}: y differs from the CPU op's");
            ensure!(same_bits(&dx, &dx_cpu)?, "{dims:?} {dtype:?} offset {offset}: dx differs from the CPU op's");
            eprintln!("dropout {dims:?} {dtype:?} offset {offset}: bitwise equal to the CPU op");
        }
    }
    Ok(())
}
