//! Launch plan of the batched image tiling (`cuda/tiling.cu`): two launches for a whole batch of RGB8
//! images of any sizes, from the host-side [`BatchPlan`] (target sizes, the CPU reference's own int16
//! filter taps, one descriptor row per image).
//!
//! `tiling_hpass` resizes horizontally into a u8 intermediate; `tiling_vpass_patchify_<T>` resizes
//! vertically fused with rescale, normalise and patchify into `pixel_values (rows, patch_dim)`. Grid:
//! `(blocks over the largest image's work, images)`, 256 threads, grid-stride loops inside. Input 0 is
//! the images' bytes concatenated.

use super::{bytes_of, plan_err, Arg, Elem, Init, Module, Plan, PlanError};
use crate::tiling::BatchPlan;

const THREADS: u32 = 256;

fn grid(work: usize, images: usize) -> Result<[u32; 3], PlanError> {
    if images > 65_535 {
        return Err(plan_err!("tiling: a batch of {images} images exceeds the 65535 of one launch; split it"));
    }
    Ok([work.div_ceil(THREADS as usize).clamp(1, 65_535) as u32, images as u32, 1])
}

/// `pixel_values` (f32 or bf16) of the batch `b`.
pub fn plan(b: &BatchPlan, elem: Elem) -> Result<Plan, PlanError> {
    if !matches!(elem, Elem::F32 | Elem::Bf16) {
        return Err(plan_err!("tiling: pixel_values can be f32 or bf16, not {}", elem.name()));
    }
    let mut p = Plan::new("tiling");
    let input = p.buffer("images", Elem::U8, b.input_len, Init::Input(0));
    let desc =
        p.buffer("desc", Elem::I64, b.desc.len(), Init::Host(b.desc.iter().flat_map(|x| x.to_le_bytes()).collect()));
    let taps = p.buffer("taps", Elem::I32, b.taps.len(), Init::Host(bytes_of(&b.taps)));
    let weights = p.buffer("weights", Elem::I32, b.weights.len(), Init::Host(bytes_of(&b.weights)));
    // Every byte of every intermediate is written by the horizontal pass; they tile the buffer exactly.
    let inter = p.buffer("intermediate", Elem::U8, b.inter_len.max(1), Init::Uninit);
    let out = p.buffer("pixel_values", elem, (b.rows * b.patch_dim).max(1), Init::Uninit);
    let buf = |buf| Arg::Buf { buf, offset: 0 };
    let hargs = vec![buf(input), buf(inter), buf(desc), buf(taps), buf(weights)];
    p.launch(Module::Tiling, "tiling_hpass".into(), grid(b.max_h_work, b.len())?, [THREADS, 1, 1], 0, hargs)?;
    let g = b.geometry;
    let (m, s) = (b.mean255, b.std255);
    let mut vargs = vec![buf(inter), buf(out), buf(desc), buf(taps), buf(weights)];
    vargs.extend([m[0], m[1], m[2], s[0], s[1], s[2]].map(Arg::F32));
    vargs.extend([g.patch_size, g.merge_size, g.temporal_patch_size].map(|x| Arg::I32(x as i32)));
    let kernel = format!("tiling_vpass_patchify_{}", elem.name());
    p.launch(Module::Tiling, kernel, grid(b.max_v_work, b.len())?, [THREADS, 1, 1], 0, vargs)?;
    p.outputs.push(out);
    Ok(p)
}
