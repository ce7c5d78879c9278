//! The launch plan of the paged attention (`cuda/paged_attention.cu`): a sequence's new query rows over
//! its KV cache in blocks, read in place.
//!
//! Inputs: q `(Hq, T, D)`, then each block's keys and values (input `1 + 2b` and `2 + 2b`): `Hkv` heads of
//! [`Block::len`] rows of `D`, rows contiguous, heads [`Block::head_stride`] elements apart (a block narrowed
//! along its positions keeps its parent's stride). The kernel reaches the blocks through one table
//! (`Init::Table`: addresses, start positions, strides). Two launches: the keys split into chunks of
//! [`CHUNK`], one block of [`THREADS`] per chunk, row and head, each writing its max, sum and partial output;
//! then one block per row and head combines them.

use super::{float_elem, int, plan_err, Arg, Elem, Init, Module, Plan, PlanError, Word};

/// Threads of a block: four warps share the keys of the score pass; the output pass gives each thread
/// columns of D (one at D 128).
pub const THREADS: u32 = 128;
/// Keys a block takes: a decode step of 16 heads over 1,300 keys makes 176 blocks, more than an H100 or
/// H200 has SMs, and the scores fit in shared memory.
pub const CHUNK: usize = 128;

/// One block of the cache as the kernel reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    /// Positions (rows of D).
    pub len: usize,
    /// Elements from one key head to the next (`len * D` when contiguous).
    pub head_stride: usize,
}

/// `out (Hq, T, D)` of `q (Hq, T, D)` over `blocks` (`Hkv` heads, GQA), the scores scaled by `scale`.
pub fn forward(
    (hq, hkv, t, d): (usize, usize, usize, usize),
    blocks: &[Block],
    scale: f64,
    elem: Elem,
) -> Result<Plan, PlanError> {
    let op = "paged_attention";
    float_elem(op, elem)?;
    let total: usize = blocks.iter().map(|b| b.len).sum();
    let strided = blocks.iter().all(|b| b.head_stride >= b.len * d);
    if hq == 0 || hkv == 0 || hq % hkv != 0 || d == 0 || t == 0 || t > total || blocks.iter().any(|b| b.len == 0) {
        return Err(plan_err!(
            "{op}: {hq} query heads over {hkv} key heads, T {t}, D {d}, {} blocks of {total} keys: need \
             Hq % Hkv = 0, D > 0, 1 <= T <= keys and no empty block",
            blocks.len()
        ));
    }
    if !strided {
        return Err(plan_err!("{op}: a block's head stride is shorter than its {d}-wide rows: {blocks:?}"));
    }
    let splits = total.div_ceil(CHUNK);
    let mut p = Plan::new(op);
    let q = p.buffer("q", elem, hq * t * d, Init::Input(0));
    let mut words = Vec::with_capacity(4 * blocks.len() + 3);
    let mut start = 0;
    for (b, blk) in blocks.iter().enumerate() {
        let span = (hkv - 1) * blk.head_stride + blk.len * d;
        let k = p.buffer("k block", elem, span, Init::Input(1 + 2 * b));
        let v = p.buffer("v block", elem, span, Init::Input(2 + 2 * b));
        words.extend([
            Word::Address(k),
            Word::Address(v),
            Word::Value(start as u64),
            Word::Value(blk.head_stride as u64),
        ]);
        start += blk.len;
    }
    words.extend([Word::Value(0), Word::Value(0), Word::Value(total as u64)]);
    let table = p.buffer("blocks", Elem::U64, words.len(), Init::Table(words));
    // Every (chunk, row, head) record is written by its block, empty chunks included.
    let part = p.buffer("partials", Elem::F32, hq * t * splits * (d + 2), Init::Uninit);
    let out = p.buffer("out", elem, hq * t * d, Init::Uninit);
    let (ti, hqi, di) = (int(op, "T", t)? as u32, int(op, "Hq", hq)? as u32, int(op, "D", d)?);
    let args = vec![
        Arg::Buf { buf: q, offset: 0 },
        Arg::Buf { buf: table, offset: 0 },
        Arg::Buf { buf: part, offset: 0 },
        Arg::I32(int(op, "Hkv", hkv)?),
        Arg::I32(int(op, "blocks", blocks.len())?),
        Arg::I32(di),
        Arg::I32(CHUNK as i32),
        Arg::F32(scale as f32),
    ];
    let grid = [int(op, "splits", splits)? as u32, ti, hqi];
    let kernel = format!("{op}_part_{}", elem.name());
    p.launch(Module::PagedAttention, kernel, grid, [THREADS, 1, 1], (d + CHUNK) * 4, args)?;
    let args = vec![
        Arg::Buf { buf: part, offset: 0 },
        Arg::Buf { buf: out, offset: 0 },
        Arg::I32(int(op, "splits", splits)?),
        Arg::I32(di),
    ];
    let kernel = format!("{op}_combine_{}", elem.name());
    p.launch(Module::PagedAttention, kernel, [ti, hqi, 1], [THREADS, 1, 1], 0, args)?;
    p.outputs.push(out);
    Ok(p)
}
