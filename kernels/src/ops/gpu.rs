//! What the CUDA forwards of the training ops share (feature `cuda`): the plan element type of the inputs,
//! the contiguity check, and running a launch plan (`crate::plan`) on the inputs' device.
//!
//! Every op's CUDA path is: validate on the host (the CPU op's checks), build the plan, run it on the thin
//! executor (`cuda::exec`). The plans are what the CPU executor runs in `tests/emu/`.

use crate::plan::{Elem, Plan};
use candle_core::backend::BackendStorage;
use candle_core::{bail, CudaStorage, DType, Layout, Result};

/// The plan element type of inputs that must all be f32 or all bf16, or an error naming each.
pub(crate) fn elem(op: &str, dtypes: &[(&str, DType)]) -> Result<Elem> {
    let first = dtypes.first().map(|d| d.1);
    let same = dtypes.iter().all(|d| Some(d.1) == first);
    match first {
        Some(DType::F32) if same => Ok(Elem::F32),
        Some(DType::BF16) if same => Ok(Elem::Bf16),
        _ => {
            let got: Vec<String> = dtypes.iter().map(|(w, d)| format!("{w} {d:?}")).collect();
            bail!("{op}: CUDA inputs must all be f32 or all bf16, got {}", got.join(", "))
        }
    }
}

/// A contiguous input: its storage and the element it starts at.
pub(crate) fn input<'a>(op: &str, what: &str, (s, l): (&'a CudaStorage, &Layout)) -> Result<(&'a CudaStorage, usize)> {
    match l.contiguous_offsets() {
        Some((start, _)) => Ok((s, start)),
        None => bail!("{op}: `{what}` must be contiguous, got shape {:?} with strides {:?}", l.shape(), l.stride()),
    }
}

/// Runs `plan` on the device of the first input.
pub(crate) fn run(plan: &Plan, inputs: &[(&CudaStorage, usize)]) -> Result<Vec<CudaStorage>> {
    let Some((first, _)) = inputs.first() else { bail!("{}: a CUDA plan needs an input", plan.op) };
    crate::cuda::exec::run(first.device(), plan, inputs)
}

/// The one output of a plan.
pub(crate) fn single(op: &str, mut out: Vec<CudaStorage>) -> Result<CudaStorage> {
    match out.len() {
        1 => Ok(out.remove(0)),
        n => bail!("{op}: the plan returned {n} outputs, expected 1"),
    }
}
