//! Launch plan of the fused AdamW step (`cuda/adamw.cu`): one thread per element, 256 threads a block, at
//! most [`MAX_BLOCKS`] blocks, grid-stride. The step's constants are plain arguments: nothing is uploaded.
//! Inputs: p `(n)`, g `(n)`, state `(2, n)` = `[m; v]`, all f32; output: `(3, n)` = `[p; m; v]`.

use super::{plan_err, Arg, Elem, Init, Module, Plan, PlanError};
use crate::adamw::AdamWConsts;

/// Threads per block.
pub const THREADS: u32 = 256;
/// Blocks at most: 1M threads a sweep, many waves on any GPU; larger tensors loop.
pub const MAX_BLOCKS: u64 = 4096;

/// The step over `n` elements with the constants `c`.
pub fn step(n: usize, c: &AdamWConsts) -> Result<Plan, PlanError> {
    let op = "adamw_step";
    if n == 0 {
        return Err(plan_err!("{op}: the parameter is empty; the CUDA kernel needs at least one element"));
    }
    let blocks = (n as u64).div_ceil(THREADS as u64).min(MAX_BLOCKS) as u32;
    let mut plan = Plan::new(op);
    let p = plan.buffer("p", Elem::F32, n, Init::Input(0));
    let g = plan.buffer("g", Elem::F32, n, Init::Input(1));
    let state = plan.buffer("state", Elem::F32, 2 * n, Init::Input(2));
    let out = plan.buffer("out", Elem::F32, 3 * n, Init::Uninit);
    let args = vec![
        Arg::Buf { buf: p, offset: 0 },
        Arg::Buf { buf: g, offset: 0 },
        Arg::Buf { buf: state, offset: 0 },
        Arg::Buf { buf: out, offset: 0 },
        Arg::U64(n as u64),
        Arg::I32(c.decay.is_some() as i32),
        Arg::F32(c.decay.unwrap_or(1.0)),
        Arg::F32(c.one_minus_b1),
        Arg::F32(c.b2),
        Arg::F32(c.one_minus_b2),
        Arg::F32(c.inv_bc2_sqrt),
        Arg::F32(c.eps),
        Arg::F32(c.step_size),
    ];
    plan.launch(Module::AdamW, "adamw_step_f32".into(), [blocks, 1, 1], [THREADS, 1, 1], 0, args)?;
    plan.outputs.push(out);
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adamw::AdamWStep;
    use crate::plan::Caps;

    /// One thread per element up to MAX_BLOCKS blocks; an empty parameter is refused.
    #[test]
    fn blocks_follow_the_elements() {
        let c = AdamWStep { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, step: 1 }.consts();
        let grid = |n| step(n, &c).unwrap().launches[0].grid[0];
        assert_eq!((grid(1), grid(256), grid(257)), (1, 1, 2));
        assert_eq!(grid(1 << 40), MAX_BLOCKS as u32);
        for caps in [Caps::SM86, Caps::SM90] {
            step(1 << 20, &c).unwrap().check(&caps).unwrap();
        }
        assert!(step(0, &c).unwrap_err().0.contains("empty"));
    }
}
