//! Launch plan of the counter-based dropout (`cuda/dropout.cu`), forward and backward alike (the backward
//! is the forward on the upstream gradient).
//!
//! One thread per group of four elements (one Philox evaluation, `ops::dropout`'s mask layout), 256
//! threads a block, grid-stride past [`MAX_BLOCKS`] blocks. The key, the threshold and the scale are
//! plain arguments: nothing is uploaded. Input: x `(n)`; output: y `(n)`.

use super::{plan_err, Arg, Elem, Init, Module, Plan, PlanError};
use crate::dropout::{drop_threshold, DropoutKey};

/// Threads per block.
pub const THREADS: u32 = 256;
/// Blocks at most: 4,096 x 256 threads cover 4M elements a sweep, many waves on any GPU; larger inputs
/// loop.
pub const MAX_BLOCKS: u64 = 4096;

/// `y = x * mask / (1 - p)` over `n` elements of `elem` with the mask of `key`.
pub fn forward(n: usize, p: f64, key: DropoutKey, elem: Elem) -> Result<Plan, PlanError> {
    let op = "dropout";
    if n == 0 {
        return Err(plan_err!("{op}: x is empty; the CUDA kernel needs at least one element"));
    }
    if !(0.0..1.0).contains(&p) {
        return Err(plan_err!("{op}: the probability is {p}; it must be in [0, 1)"));
    }
    super::float_elem(op, elem)?;
    let last = key.offset.checked_add(n as u64 - 1).ok_or_else(|| {
        plan_err!("{op}: offset {} + {n} elements passes 2^64; the mask layout counts elements in a u64", key.offset)
    })?;
    let groups = last / 4 - key.offset / 4 + 1;
    let blocks = groups.div_ceil(THREADS as u64).min(MAX_BLOCKS) as u32;
    let mut plan = Plan::new(op);
    let x = plan.buffer("x", elem, n, Init::Input(0));
    let y = plan.buffer("y", elem, n, Init::Uninit);
    let args = vec![
        Arg::Buf { buf: x, offset: 0 },
        Arg::Buf { buf: y, offset: 0 },
        Arg::U64(n as u64),
        Arg::U64(key.seed),
        Arg::U64(key.layer),
        Arg::U64(key.offset),
        Arg::U32(drop_threshold(p)),
        Arg::F32((1.0 / (1.0 - p)) as f32),
    ];
    plan.launch(Module::Dropout, format!("dropout_{}", elem.name()), [blocks, 1, 1], [THREADS, 1, 1], 0, args)?;
    plan.outputs.push(y);
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Caps;

    /// Groups are counted from the first one the elements touch: 5 elements from offset 3 touch groups
    /// 0 (element 3) and 1 (elements 4..8), so one block; 2^20 + 1 elements from 0 need 2^18 + 1 groups,
    /// 1,025 blocks of 256; 2^40 elements stop at MAX_BLOCKS.
    #[test]
    fn blocks_follow_the_groups() {
        let key = |offset| DropoutKey { seed: 1, layer: 2, offset };
        let grid = |n, offset| forward(n, 0.1, key(offset), Elem::F32).unwrap().launches[0].grid[0];
        assert_eq!(grid(5, 3), 1);
        assert_eq!(grid((1 << 20) + 1, 0), 1025);
        assert_eq!(grid(1 << 40, 0), MAX_BLOCKS as u32);
        for caps in [Caps::SM86, Caps::SM90] {
            forward(1 << 20, 0.05, key(7), Elem::Bf16).unwrap().check(&caps).unwrap();
        }
        assert!(forward(0, 0.1, key(0), Elem::F32).is_err());
        assert!(forward(4, 1.0, key(0), Elem::F32).unwrap_err().0.contains("[0, 1)"));
        assert!(forward(4, 0.1, key(u64::MAX - 2), Elem::F32).unwrap_err().0.contains("2^64"));
    }
}
