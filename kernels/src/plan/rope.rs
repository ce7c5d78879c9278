//! Launch plan of the rotary embedding (`cuda/rope.cu`), forward or transpose (its backward).
//!
//! One thread per pair `(i, i + D/2)`, grid-stride. The tables are broadcast views of x's shape: the
//! kernel reads them through their strides, passed by value in a [`RopeIdx`] (size-1 dims dropped,
//! mergeable neighbours merged, at most [`MAX_LEAD`] leading dims), so they are never materialised.
//! Inputs: x (contiguous, `n` elements), cos and sin from their start offsets (`cos_len`, `sin_len`
//! elements reachable through the strides).

use super::{int, plan_err, Arg, Elem, Init, Module, Plan, PlanError};

/// Leading dims the kernel can index (`ROPE_MAX_LEAD` in rope.cu).
pub const MAX_LEAD: usize = 6;

/// x's leading dims and the tables' strides along them: the `RopeIdx` kernel parameter of rope.cu
/// (`#[repr(C)]`, 152 bytes, 8-aligned).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RopeIdx {
    pub rank: u32,
    pub pad: u32,
    pub dims: [u64; MAX_LEAD],
    pub cos_stride: [u64; MAX_LEAD],
    pub sin_stride: [u64; MAX_LEAD],
}

impl RopeIdx {
    /// The leading dims of x (all but the last) with the tables' strides along them: size-1 dims dropped,
    /// and a dim merged into its outer neighbour when both tables allow (outer stride = inner stride * size).
    pub fn new(op: &str, dims: &[usize], cos_stride: &[usize], sin_stride: &[usize]) -> Result<Self, PlanError> {
        let lead = dims.len().saturating_sub(1);
        let mut merged: Vec<(usize, usize, usize)> = Vec::with_capacity(lead);
        for k in 0..lead {
            let (n, c, s) = (dims[k], cos_stride[k], sin_stride[k]);
            if n == 1 {
                continue;
            }
            match merged.last_mut() {
                Some(last) if last.1 == c * n && last.2 == s * n => *last = (last.0 * n, c, s),
                _ => merged.push((n, c, s)),
            }
        }
        if merged.len() > MAX_LEAD {
            return Err(plan_err!(
                "{op}: the CUDA kernel indexes at most {MAX_LEAD} leading dims; x {dims:?} with table strides \
                 {cos_stride:?} / {sin_stride:?} leaves {}",
                merged.len()
            ));
        }
        let mut idx = RopeIdx { rank: merged.len() as u32, ..Default::default() };
        for (k, (n, c, s)) in merged.into_iter().enumerate() {
            (idx.dims[k], idx.cos_stride[k], idx.sin_stride[k]) = (n as u64, c as u64, s as u64);
        }
        Ok(idx)
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(152);
        b.extend(self.rank.to_le_bytes());
        b.extend(self.pad.to_le_bytes());
        for a in [self.dims, self.cos_stride, self.sin_stride] {
            b.extend(a.iter().flat_map(|x| x.to_le_bytes()));
        }
        b
    }
}

/// Forward (`y = x cos + rotate_half(x) sin`) or transpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Transpose,
}

/// `y` of x's shape (`dims`, contiguous, last dim `d` even) from inputs x, cos, sin.
pub fn plan(
    dir: Direction,
    dims: &[usize],
    (cos_stride, cos_len): (&[usize], usize),
    (sin_stride, sin_len): (&[usize], usize),
    elem: Elem,
) -> Result<Plan, PlanError> {
    let op = match dir {
        Direction::Forward => "rope_fwd",
        Direction::Transpose => "rope_bwd",
    };
    let n: usize = dims.iter().product();
    let d = dims.last().copied().unwrap_or(0);
    if n == 0 || d % 2 != 0 {
        return Err(plan_err!("{op}: x {dims:?} is empty or has an odd head dim"));
    }
    super::float_elem(op, elem)?;
    let idx = RopeIdx::new(op, dims, cos_stride, sin_stride)?;
    let mut p = Plan::new(op);
    let x = p.buffer("x", elem, n, Init::Input(0));
    let c = p.buffer("cos", elem, cos_len, Init::Input(1));
    let s = p.buffer("sin", elem, sin_len, Init::Input(2));
    let y = p.buffer("y", elem, n, Init::Uninit);
    let pairs = (n / 2) as u64;
    let args = vec![
        Arg::Buf { buf: x, offset: 0 },
        Arg::Buf { buf: c, offset: 0 },
        Arg::Buf { buf: s, offset: 0 },
        Arg::Buf { buf: y, offset: 0 },
        Arg::Pod { name: "RopeIdx", bytes: idx.bytes() },
        Arg::U64(pairs),
        Arg::I32(int(op, "half the head dim", d / 2)?),
    ];
    let blocks = pairs.div_ceil(256).min(1 << 20) as u32;
    p.launch(Module::Rope, format!("{op}_{}", elem.name()), [blocks, 1, 1], [256, 1, 1], 0, args)?;
    p.outputs.push(y);
    Ok(p)
}
