//! The launch plan of the paged attention (`cuda/paged_attention.cu`): a sequence's new query rows over
//! its KV cache in blocks, read in place.
//!
//! Inputs: q `(Hq, T, D)`, then each block's keys and values `(Hkv, n_b, D)`, in order (input `1 + 2b` and
//! `2 + 2b`). The kernel reaches the blocks through a table of their addresses (`Init::Addresses`) and
//! their start positions (a host table). One launch, grid `(T, Hq)`: one block of [`THREADS`] per query
//! row and head; its scores go to a global scratch of `L` floats a row (`L` keys in all).

use super::{bytes_of, float_elem, int, plan_err, Arg, Elem, Init, Module, Plan, PlanError};

/// Threads of a block: four warps share the keys of the score pass; the output pass gives each thread
/// columns of D (one at D 128).
pub const THREADS: u32 = 128;

/// `out (Hq, T, D)` of `q (Hq, T, D)` over the blocks of `lens[b]` positions each (`Hkv` heads, GQA), the
/// scores scaled by `scale`.
pub fn forward(
    (hq, hkv, t, d): (usize, usize, usize, usize),
    lens: &[usize],
    scale: f64,
    elem: Elem,
) -> Result<Plan, PlanError> {
    let op = "paged_attention";
    float_elem(op, elem)?;
    let total: usize = lens.iter().sum();
    if hq == 0 || hkv == 0 || hq % hkv != 0 || d == 0 || t == 0 || t > total || lens.contains(&0) {
        return Err(plan_err!(
            "{op}: {hq} query heads over {hkv} key heads, T {t}, D {d}, blocks {lens:?}: need Hq % Hkv = 0, \
             D > 0, 1 <= T <= keys and no empty block"
        ));
    }
    let mut starts = vec![0i32];
    for &n in lens {
        starts.push(int(op, "the cached keys", starts.last().copied().unwrap_or(0) as usize + n)?);
    }
    let mut p = Plan::new(op);
    let q = p.buffer("q", elem, hq * t * d, Init::Input(0));
    let mut blocks = Vec::with_capacity(2 * lens.len());
    for (b, &n) in lens.iter().enumerate() {
        blocks.push(p.buffer("k block", elem, hkv * n * d, Init::Input(1 + 2 * b)));
        blocks.push(p.buffer("v block", elem, hkv * n * d, Init::Input(2 + 2 * b)));
    }
    let table = p.buffer("block addresses", Elem::U64, blocks.len(), Init::Addresses(blocks));
    let starts = p.buffer("block starts", Elem::I32, starts.len(), Init::Host(bytes_of(&starts)));
    let out = p.buffer("out", elem, hq * t * d, Init::Uninit);
    // Pass 1 writes every visible score of a row before pass 2 reads it; the rest are never read.
    let scores = p.buffer("scores", Elem::F32, hq * t * total, Init::Uninit);
    let args = vec![
        Arg::Buf { buf: q, offset: 0 },
        Arg::Buf { buf: table, offset: 0 },
        Arg::Buf { buf: starts, offset: 0 },
        Arg::Buf { buf: out, offset: 0 },
        Arg::Buf { buf: scores, offset: 0 },
        Arg::I32(int(op, "Hkv", hkv)?),
        Arg::I32(int(op, "blocks", lens.len())?),
        Arg::I32(int(op, "D", d)?),
        Arg::F32(scale as f32),
    ];
    let grid = [int(op, "T", t)? as u32, int(op, "Hq", hq)? as u32, 1];
    p.launch(Module::PagedAttention, format!("{op}_{}", elem.name()), grid, [THREADS, 1, 1], d * 4, args)?;
    p.outputs.push(out);
    Ok(p)
}
