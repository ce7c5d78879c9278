//! Launch plans of the masked cross-entropy (`cuda/cross_entropy.cu`).
//!
//! Forward: one block per row (online logsumexp over the vocabulary), writing each row's loss and
//! logsumexp (f32), then one block for the mean over the `n_sup` supervised rows (counted on the host,
//! which validates the labels). Backward: one pass writing `scale * (softmax - onehot)` into dlogits,
//! from the forward's saved logsumexp, or with the row pass again when it is not saved. Inputs: logits
//! `(n, v)`, labels `(n)` u32, mask `(n)` of the logits' type (then the saved lse `(n)` f32).

use super::{int, per_row, plan_err, row_threads, Arg, Elem, Init, Module, Plan, PlanError};

/// Threads per row: a 152k-vocabulary row gives each of 512 threads ~300 elements, enough loads in flight
/// to stream the logits at memory bandwidth with four blocks per SM.
pub const ROW_THREADS: u32 = 512;

fn check(op: &str, n: usize, v: usize, elem: Elem) -> Result<(), PlanError> {
    if n == 0 || v == 0 {
        return Err(plan_err!("{op}: logits ({n}, {v}) are empty; the CUDA kernels need a row and a column"));
    }
    super::float_elem(op, elem)
}

/// Adds the row pass; returns the (loss, lse) buffers.
fn rows(
    p: &mut Plan,
    n: usize,
    v: usize,
    elem: Elem,
    [logits, labels, mask]: [usize; 3],
) -> Result<(usize, usize), PlanError> {
    let loss = p.buffer("loss", Elem::F32, n, Init::Uninit);
    let lse = p.buffer("lse", Elem::F32, n, Init::Uninit);
    let args = vec![
        Arg::Buf { buf: logits, offset: 0 },
        Arg::Buf { buf: labels, offset: 0 },
        Arg::Buf { buf: mask, offset: 0 },
        Arg::Buf { buf: loss, offset: 0 },
        Arg::Buf { buf: lse, offset: 0 },
        Arg::I32(int(p.op, "the vocabulary", v)?),
    ];
    let (grid, block) = per_row(p.op, n, row_threads(v, ROW_THREADS))?;
    p.launch(Module::CrossEntropy, format!("ce_fwd_{}", elem.name()), grid, block, 0, args)?;
    Ok((loss, lse))
}

fn inputs(p: &mut Plan, n: usize, v: usize, elem: Elem) -> [usize; 3] {
    [
        p.buffer("logits", elem, n * v, Init::Input(0)),
        p.buffer("labels", Elem::U32, n, Init::Input(1)),
        p.buffer("mask", elem, n, Init::Input(2)),
    ]
}

/// Outputs: the mean loss (one element of `elem`) and each row's logsumexp (f32, kept for the backward).
pub fn forward(n: usize, v: usize, n_sup: usize, elem: Elem) -> Result<Plan, PlanError> {
    let op = "cross_entropy_masked";
    check(op, n, v, elem)?;
    let mut p = Plan::new(op);
    let ins = inputs(&mut p, n, v, elem);
    let (loss, lse) = rows(&mut p, n, v, elem, ins)?;
    let out = p.buffer("mean loss", elem, 1, Init::Uninit);
    let args = vec![
        Arg::Buf { buf: loss, offset: 0 },
        Arg::I32(int(op, "rows", n)?),
        Arg::I32(int(op, "supervised rows", n_sup)?),
        Arg::Buf { buf: out, offset: 0 },
    ];
    p.launch(Module::CrossEntropy, format!("ce_mean_{}", elem.name()), [1, 1, 1], [1024, 1, 1], 0, args)?;
    p.outputs.extend([out, lse]);
    Ok(p)
}

/// dlogits `(n, v)` = `scale * (softmax - onehot)` on supervised rows, zeros elsewhere (all zeros, with no
/// launch, when `n_sup == 0`). With `saved_lse` the plan reads the forward's logsumexp as input 3.
pub fn backward(n: usize, v: usize, n_sup: usize, scale: f64, saved_lse: bool, elem: Elem) -> Result<Plan, PlanError> {
    let op = "cross_entropy_masked_bwd";
    check(op, n, v, elem)?;
    let mut p = Plan::new(op);
    let ins = inputs(&mut p, n, v, elem);
    let lse = if saved_lse { Some(p.buffer("lse", Elem::F32, n, Init::Input(3))) } else { None };
    if n_sup == 0 {
        let out = p.buffer("dlogits", elem, n * v, Init::Zeroed);
        p.outputs.push(out);
        return Ok(p);
    }
    let lse = match lse {
        Some(l) => l,
        None => rows(&mut p, n, v, elem, ins)?.1,
    };
    let out = p.buffer("dlogits", elem, n * v, Init::Uninit);
    let args = vec![
        Arg::Buf { buf: ins[0], offset: 0 },
        Arg::Buf { buf: ins[1], offset: 0 },
        Arg::Buf { buf: ins[2], offset: 0 },
        Arg::Buf { buf: lse, offset: 0 },
        Arg::F32(scale as f32),
        Arg::Buf { buf: out, offset: 0 },
        Arg::I32(int(op, "the vocabulary", v)?),
    ];
    let (grid, block) = per_row(op, n, row_threads(v, ROW_THREADS))?;
    p.launch(Module::CrossEntropy, format!("ce_bwd_{}", elem.name()), grid, block, 0, args)?;
    p.outputs.push(out);
    Ok(p)
}
