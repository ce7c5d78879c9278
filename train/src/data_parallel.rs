//! Data parallelism in the training loop, over the ranks of a [`World`] (`mpirun -np N askgui-train ...`):
//! each rank takes its contiguous shard of every step's samples (a function of the seed, the epoch, the
//! data position and the rank: the step's global sample list is the same on every rank), computes its
//! micro-batches weighted by their share of the whole step's supervised tokens, and the ranks sum their
//! gradients, loss and counts here. Every rank then holds the one-process step's gradient and takes the
//! same optimiser step. With one sequence per micro-batch the sums are bitwise those of one process
//! running the step's micro-batches in rank order: a sum of two values does not depend on its order.

use std::ops::Range;

use candle_core::{DType, Tensor, Var};

use crate::distributed::World;
use crate::error::Result;

/// The range of a step's `n` samples that rank `rank` of `size` takes: contiguous and as even as possible
/// (a short last step of an epoch may leave a rank none).
pub fn shard(n: usize, rank: usize, size: usize) -> Range<usize> {
    n * rank / size..n * (rank + 1) / size
}

/// Sums every rank's `grads` (in the order of `vars`) and `scalars` in place. A gradient that no rank has
/// stays `None`, as in one process; one that some rank lacks counts as zeros there. One all-reduce for the
/// presence flags and scalars, one for every gradient flattened into one f32 buffer.
pub fn all_reduce(world: &World, grads: &mut [Option<Tensor>], vars: &[Var], scalars: &mut [f64]) -> Result<()> {
    if world.size() == 1 {
        return Ok(());
    }
    let mut flags: Vec<f64> = grads.iter().map(|g| g.is_some() as u8 as f64).collect();
    flags.extend_from_slice(scalars);
    world.all_reduce_sum_f64(&mut flags)?;
    scalars.copy_from_slice(&flags[grads.len()..]);

    let (mut flat, mut spans) = (Vec::<f32>::new(), Vec::with_capacity(grads.len()));
    for ((g, v), &present) in grads.iter().zip(vars).zip(&flags) {
        if present == 0.0 {
            spans.push(None);
            continue;
        }
        let start = flat.len();
        match g {
            Some(g) => flat.extend(g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => flat.resize(start + v.elem_count(), 0.0),
        }
        spans.push(Some(start..flat.len()));
    }
    world.all_reduce_sum_f32(&mut flat)?;
    for ((g, v), span) in grads.iter_mut().zip(vars).zip(spans) {
        if let Some(r) = span {
            *g = Some(Tensor::from_slice(&flat[r], v.shape(), v.device())?.to_dtype(v.dtype())?);
        }
    }
    Ok(())
}

/// Whether any rank's `flag` is set (an interrupt seen by one rank stops all of them after the same step).
pub fn any(world: &World, flag: bool) -> Result<bool> {
    let mut x = [flag as u8 as f64];
    world.all_reduce_sum_f64(&mut x)?;
    Ok(x[0] > 0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_a_step_once_in_order() {
        for (n, size) in [(8, 2), (7, 3), (2, 4), (0, 2)] {
            let ranges: Vec<_> = (0..size).map(|r| shard(n, r, size)).collect();
            let joined: Vec<usize> = ranges.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(joined, (0..n).collect::<Vec<_>>(), "n {n}, size {size}");
            let lens: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
            assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1, "n {n}, size {size}: {lens:?}");
        }
    }

    #[test]
    fn one_process_keeps_its_gradients() -> Result<()> {
        let v = Var::zeros((2, 2), DType::F32, &candle_core::Device::Cpu)?;
        let g = Tensor::new(&[[1f32, 2.], [3., 4.]], &candle_core::Device::Cpu)?;
        let mut grads = vec![Some(g.clone()), None];
        let mut scalars = [1.5];
        all_reduce(&World::single(), &mut grads, &[v.clone(), v], &mut scalars)?;
        assert_eq!(grads[0].as_ref().unwrap().to_vec2::<f32>()?, g.to_vec2::<f32>()?);
        assert!(grads[1].is_none() && scalars == [1.5]);
        assert!(!any(&World::single(), false)? && any(&World::single(), true)?);
        Ok(())
    }
}
