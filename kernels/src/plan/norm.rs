//! Launch plans of RMSNorm and LayerNorm (`cuda/norm.cu`), forward and backward.
//!
//! Forward: one block per row. Backward: dx per row, and when the parameters are trained, per-block
//! partial column sums (in dynamic shared memory when they fit below the 48 KiB default, else in the
//! block's row of a `partial` buffer), then a second kernel that sums the partials over blocks in a fixed
//! order (deterministic, no atomics). Inputs: x `(rows, d)`, w `(d)`, then b `(d)` (LayerNorm forward) or
//! grad `(rows, d)` (backward).

use super::{int, per_row, plan_err, row_threads, Arg, Elem, Init, Module, Plan, PlanError};

/// Which norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Rms,
    Layer,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Rms => "rms_norm",
            Kind::Layer => "layer_norm",
        }
    }

    /// Parameter-gradient elements after dx when the parameters are trained.
    pub fn params(self, d: usize) -> usize {
        match self {
            Kind::Rms => d,
            Kind::Layer => 2 * d,
        }
    }
}

/// Blocks of the backward when parameter gradients are wanted: each owns a row of partial sums, so fewer
/// blocks mean a smaller `partial` buffer and a shorter final reduction; 512 fill an H100 (132 SMs) about
/// four times over.
pub const BWD_BLOCKS: usize = 512;
/// Dynamic shared memory for the partial sums, below the 48 KiB default minus the static scratch.
pub const SHARED_ACC_MAX: usize = 48 * 1024 - 256;

fn check(op: &str, rows: usize, d: usize, elem: Elem) -> Result<(), PlanError> {
    if rows == 0 || d == 0 {
        return Err(plan_err!("{op}: x ({rows}, {d}) is empty; the CUDA kernels need at least one row"));
    }
    super::float_elem(op, elem)
}

/// `y (rows, d)` from inputs x, w (and b for LayerNorm).
pub fn forward(kind: Kind, rows: usize, d: usize, eps: f64, elem: Elem) -> Result<Plan, PlanError> {
    let op = kind.name();
    check(op, rows, d, elem)?;
    let mut p = Plan::new(op);
    let x = p.buffer("x", elem, rows * d, Init::Input(0));
    let w = p.buffer("w", elem, d, Init::Input(1));
    let b = (kind == Kind::Layer).then(|| p.buffer("b", elem, d, Init::Input(2)));
    let y = p.buffer("y", elem, rows * d, Init::Uninit);
    let mut args = vec![Arg::Buf { buf: x, offset: 0 }, Arg::Buf { buf: w, offset: 0 }];
    args.extend(b.map(|b| Arg::Buf { buf: b, offset: 0 }));
    args.extend([Arg::Buf { buf: y, offset: 0 }, Arg::I32(int(op, "the row length", d)?), Arg::F32(eps as f32)]);
    let (grid, block) = per_row(op, rows, row_threads(d, 1024))?;
    p.launch(Module::Norm, format!("{op}_fwd_{}", elem.name()), grid, block, 0, args)?;
    p.outputs.push(y);
    Ok(p)
}

/// `[dx (rows d), dw (d) (, db (d))]` from inputs x, w, grad; the parameter gradients only if `trained`.
pub fn backward(kind: Kind, rows: usize, d: usize, eps: f64, trained: bool, elem: Elem) -> Result<Plan, PlanError> {
    let op = match kind {
        Kind::Rms => "rms_norm_bwd",
        Kind::Layer => "layer_norm_bwd",
    };
    check(op, rows, d, elem)?;
    let params = if trained { kind.params(d) } else { 0 };
    let blocks = if params > 0 { rows.min(BWD_BLOCKS) } else { rows };
    let acc_shared = params > 0 && params * 4 <= SHARED_ACC_MAX;
    let mut p = Plan::new(op);
    let x = p.buffer("x", elem, rows * d, Init::Input(0));
    let w = p.buffer("w", elem, d, Init::Input(1));
    let g = p.buffer("grad", elem, rows * d, Init::Input(2));
    let out = p.buffer("[dx, dparams]", elem, rows * d + params, Init::Uninit);
    // Every block zeroes its row of partials (or fills it from shared memory) before it is read.
    let partial = p.buffer("partial", Elem::F32, (blocks * params).max(1), Init::Uninit);
    let (pi, blocks_i) = (int(op, "params", params)?, int(op, "blocks", blocks)?);
    let args = vec![
        Arg::Buf { buf: x, offset: 0 },
        Arg::Buf { buf: w, offset: 0 },
        Arg::Buf { buf: g, offset: 0 },
        Arg::Buf { buf: out, offset: 0 },
        Arg::Buf { buf: partial, offset: 0 },
        Arg::I32(int(op, "rows", rows)?),
        Arg::I32(int(op, "the row length", d)?),
        Arg::F32(eps as f32),
        Arg::I32(pi),
        Arg::I32(i32::from(acc_shared)),
    ];
    let (grid, block) = per_row(op, blocks, row_threads(d, 512))?;
    let shared = if acc_shared { params * 4 } else { 0 };
    p.launch(Module::Norm, format!("{op}_{}", elem.name()), grid, block, shared, args)?;
    if params > 0 {
        let args = vec![
            Arg::Buf { buf: partial, offset: 0 },
            Arg::I32(blocks_i),
            Arg::I32(pi),
            Arg::Buf { buf: out, offset: 0 },
            Arg::U64((rows * d) as u64),
        ];
        let grid = [params.div_ceil(256) as u32, 1, 1];
        p.launch(Module::Norm, format!("norm_param_reduce_{}", elem.name()), grid, [256, 1, 1], 0, args)?;
    }
    p.outputs.push(out);
    Ok(p)
}
