//! `adamw_step`: one fused AdamW update of a parameter, in one pass over its elements.
//!
//! Why: written with candle ops the update is about 15 kernels a tensor on a GPU, each reading and writing
//! the parameter's size, for every parameter every step. Here one pass reads `p`, `g` and the moments and
//! writes them back: `(p (N) f32, g (N) f32, state (2, N) f32 = [m; v]) -> (3, N) f32 = [p; m; v]`, the
//! element update of [`crate::adamw`] (its spec, bit for bit). The caller keeps rows 1..3 as the new state
//! (a view, no copy) and sets the parameter from row 0 (an f32 master keeps row 0 itself).
//! CPU: rayon over chunks. CUDA (feature `cuda`): `cuda/adamw.cu` through `plan::adamw` (one launch).
//! Tests: `cargo test -p askgui-kernels --test adamw`; the kernel in the CPU executor: `--features cpu-exec
//! --test emu adamw`; the optimiser against its unfused twin: `cargo test -p askgui-train --lib optim`.

use super::contiguous_slice;
use crate::adamw::{adamw_element, AdamWConsts, AdamWStep};
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
#[cfg(feature = "cuda")]
use {super::gpu, crate::plan::adamw as plan, candle_core::CudaStorage};

/// Elements a CPU task updates.
const CHUNK: usize = 1 << 14;

/// The update of `p (N)` with gradient `g (N)` and moments `state (2, N)` (all f32, any shape of `N`
/// elements for `p` and `g`): returns `(3, N)` f32, the new `[p; m; v]`. No gradient flows through it.
pub fn adamw_step(p: &Tensor, g: &Tensor, state: &Tensor, step: &AdamWStep) -> Result<Tensor> {
    let n = p.elem_count();
    if g.elem_count() != n || state.dims() != [2, n] {
        bail!(
            "adamw_step: p {:?} and g {:?} must have the same size N, and the state must be (2, N): got {:?}",
            p.shape(),
            g.shape(),
            state.shape()
        )
    }
    for (what, t) in [("p", p), ("g", g), ("state", state)] {
        if t.dtype() != DType::F32 {
            bail!("adamw_step: `{what}` must be f32 (masters and moments are f32), got {:?}", t.dtype())
        }
    }
    let flat = |t: &Tensor| t.detach().flatten_all()?.contiguous();
    flat(p)?.apply_op3_no_bwd(&flat(g)?, &state.detach().contiguous()?, &AdamW(step.consts()))
}

struct AdamW(AdamWConsts);

/// `[p; m; v]` after the step, each `n` long.
fn update(c: &AdamWConsts, p: &[f32], g: &[f32], m: &[f32], v: &[f32]) -> Vec<f32> {
    let n = p.len();
    let mut out = vec![0f32; 3 * n];
    let (po, rest) = out.split_at_mut(n);
    let (mo, vo) = rest.split_at_mut(n);
    let chunks = po.par_chunks_mut(CHUNK).zip(mo.par_chunks_mut(CHUNK)).zip(vo.par_chunks_mut(CHUNK));
    chunks.enumerate().for_each(|(k, ((po, mo), vo))| {
        let base = k * CHUNK;
        for i in 0..po.len() {
            let j = base + i;
            (po[i], mo[i], vo[i]) = adamw_element(c, p[j], g[j], m[j], v[j]);
        }
    });
    out
}

impl CustomOp3 for AdamW {
    fn name(&self) -> &'static str {
        "adamw_step"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let name = self.name();
        let (p, g) = (contiguous_slice::<f32>(s1, l1, name, "p")?, contiguous_slice::<f32>(s2, l2, name, "g")?);
        let state = contiguous_slice::<f32>(s3, l3, name, "state")?;
        let n = p.len();
        let (m, v) = state.split_at(n);
        Ok((CpuStorage::F32(update(&self.0, p, g, m, v)), Shape::from((3, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let name = self.name();
        let n = l1.shape().elem_count();
        let plan = plan::step(n, &self.0)?;
        // f32 throughout: `adamw_step`, the op's only maker, checked the dtypes.
        let ins =
            [gpu::input(name, "p", (s1, l1))?, gpu::input(name, "g", (s2, l2))?, gpu::input(name, "state", (s3, l3))?];
        Ok((gpu::single(name, gpu::run(&plan, &ins)?)?, Shape::from((3, n))))
    }
}
