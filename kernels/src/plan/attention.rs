//! Launch plans of attention (`cuda/attention.cu` on CUDA cores, `cuda/attention_tc.cu` on tensor cores),
//! forward and backward, for `ops::attention`.
//!
//! Choices, all made here from the problem and the device's [`Caps`]:
//! - head dims run in compiled buckets ([`HEAD_DIMS`]); a smaller `D` is zero-padded into the next one;
//! - bf16 runs the tensor-core kernels where their shared memory fits the device's opt-in, else the
//!   CUDA-core ones; f32 always runs on CUDA cores; the CUDA-core backward takes 64 x 64 tiles, or
//!   32 x 32 where those do not fit (head dims 96 and 128 on sm_86/sm_89, 101,376 bytes);
//! - the backward reads the forward's saved logsumexp, or recomputes it with the forward kernel reading q
//!   out of the packed `[q, O, dO]`; then `D_i = rowsum(dO * O)`, the backward kernel (dq, dk, dv into one
//!   zeroed f32 buffer by atomics), and for bf16 one rounding pass;
//! - masks go to the device as host tables (`cu_seqlens` as i32, key padding as u8).
//!
//! Shapes: q `(B, Hq, Tq, D)`, k and v `(B, Hkv, Tk, D)`, the backward's packed `[q, O, dO]`
//! `(B, Hq, Tq, 3D)`. The shared-memory sizes below must equal the layouts in the `.cu` files; the CPU
//! executor (`emu`) runs every launch with exactly these sizes, so a mismatch shows there.

use super::{int, plan_err, Arg, Caps, Elem, Init, Module, Plan, PlanError};

/// Query and key rows per tile, threads per block of the CUDA-core kernels (`BQ`, `BK`, `THREADS`).
pub const BQ: usize = 64;
pub const BK: usize = 64;
pub const THREADS: u32 = 256;
/// Warps per block of the tensor-core kernels (`TC_WARPS`), 16 query rows each.
pub const TC_WARPS: usize = 4;
/// The head-dimension buckets the kernels are compiled for (`ASKGUI_ATTENTION_DTYPE` in the .cu).
pub const HEAD_DIMS: [usize; 5] = [32, 64, 80, 96, 128];

/// Which keys each query may see (as `AttentionMask`, owned).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mask {
    None,
    Causal,
    /// `cu_seqlens`: non-decreasing from 0 to `Tk`; needs `B == 1`, `Tq == Tk`.
    Block(Vec<usize>),
    /// The same segments, causal inside each (packed sequences).
    CausalBlock(Vec<usize>),
}

/// One attention call, validated by the op (`ops::attention`'s `check_dims`).
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
    pub mask: Mask,
    /// `B * Tk` flags, true = real key.
    pub keep: Option<Vec<bool>>,
    pub scale: f64,
}

/// The smallest compiled bucket that holds `d`.
pub fn bucket(op: &str, d: usize) -> Result<usize, PlanError> {
    match HEAD_DIMS.iter().find(|&&p| d <= p) {
        Some(&p) if d > 0 => Ok(p),
        _ => Err(plan_err!(
            "{op}: head dim {d} is not supported by the CUDA kernels (1..=128, compiled for {HEAD_DIMS:?})"
        )),
    }
}

/// Dynamic shared bytes of the CUDA-core forward (`fwd_smem_bytes` in attention.cu).
pub fn fwd_smem(dp: usize) -> usize {
    (BQ * (dp + 1) + BK * (dp + 1) + BQ * (BK + 1)) * 4 + (2 * BQ + BK) * 4
}

/// The CUDA-core backward with `tq`-row query and `tk`-row key tiles (`bwd_smem_bytes<DP, TQ, TK>`).
pub fn bwd_smem(dp: usize, tq: usize, tk: usize) -> usize {
    (2 * tq * (dp + 1) + 2 * tk * (dp + 1) + tk * (tq + 1)) * 4 + (4 * tq + tk) * 4
}

/// The backward's tiles `(query rows, key rows, kernel-name infix)`, largest first: the 32 x 32 tiles fit
/// 101,376 bytes (the sm_86/sm_89 opt-in) at every head dim up to 128.
pub const BWD_TILES: [(usize, usize, &str); 2] = [(64, 64, ""), (32, 32, "small_")];

/// The tensor-core forward (`TcLayout::BYTES`): Q, K, V tiles in bf16 (row stride DP + 8), per warp the
/// f32 scores (16 x 68) sharing their bytes with the f32 P V (16 x (DP + 4)), bf16 probabilities
/// (16 x 72), per-row data.
pub fn tc_smem(dp: usize) -> usize {
    let scores_or_pv = (16 * (BK + 4) * 4).max(16 * (dp + 4) * 4);
    3 * BQ * (dp + 8) * 2 + TC_WARPS * (scores_or_pv + 16 * (BK + 8) * 2) + (2 * BQ + BK) * 4
}

/// The tensor-core backward (`TcBwdLayout::BYTES`): K, V, Q, dO tiles in bf16, S^T and dP^T in f32
/// (64 x 68) sharing their bytes with the (64 x (DP + 4)) f32 staging rows, P^T and dS^T in bf16
/// (64 x 72), per-row data.
pub fn tc_bwd_smem(dp: usize) -> usize {
    let st_or_stage = (2 * BK * (BQ + 4) * 4).max(BQ * (dp + 4) * 4);
    4 * BQ * (dp + 8) * 2 + st_or_stage + 2 * BK * (BQ + 8) * 2 + 2 * BQ * 4 + (2 * BQ + BK) * 4
}

/// Sizes as the kernels take them.
struct Geometry {
    nb: i32,
    hq: i32,
    hkv: i32,
    tq: i32,
    tk: i32,
    d: i32,
    dp: usize,
    /// `B * Hq * Tq`.
    rows: usize,
}

impl Geometry {
    fn new(op: &str, p: &Problem) -> Result<Self, PlanError> {
        let dp = bucket(op, p.d)?;
        if p.b * p.hq > 65_535 {
            return Err(plan_err!(
                "{op}: B * Hq = {} * {} exceeds the 65535 blocks of a CUDA grid's y dimension",
                p.b,
                p.hq
            ));
        }
        // Row indices (bh * Tq + i) are formed in 64 bits in the kernels; single sizes must fit i32.
        Ok(Self {
            nb: int(op, "B", p.b)?,
            hq: int(op, "Hq", p.hq)?,
            hkv: int(op, "Hkv", p.hkv)?,
            tq: int(op, "Tq", p.tq)?,
            tk: int(op, "Tk", p.tk)?,
            d: int(op, "D", p.d)?,
            dp,
            rows: p.b * p.hq * p.tq,
        })
    }
}

/// The mask's device tables and scalars: kind (0 none, 1 causal, 2 block-diagonal, 3 causal
/// block-diagonal: `Mask` in attention.cuh), `cu` as i32, `nseg`,
/// key padding as u8 `(B, Tk)`, `has_keep`. Absent parts are one-element dummies the kernels never read.
struct MaskArgs {
    kind: i32,
    cu: usize,
    nseg: i32,
    keep: usize,
    has_keep: i32,
}

fn mask_args(op: &str, plan: &mut Plan, p: &Problem) -> Result<MaskArgs, PlanError> {
    let table = |cu: &[usize]| cu.iter().map(|&c| int(op, "a cu_seqlens entry", c)).collect::<Result<Vec<i32>, _>>();
    let (kind, cu) = match &p.mask {
        Mask::None => (0, vec![0]),
        Mask::Causal => (1, vec![0]),
        Mask::Block(cu) => (2, table(cu)?),
        Mask::CausalBlock(cu) => (3, table(cu)?),
    };
    let nseg = int(op, "the number of segments", cu.len().saturating_sub(1))?;
    let (keep, has_keep) = match &p.keep {
        Some(k) => (k.iter().map(|&x| x as u8).collect(), 1),
        None => (vec![1u8], 0),
    };
    let cu_buf = plan.buffer("cu_seqlens", Elem::I32, cu.len(), Init::Host(super::bytes_of(&cu)));
    let keep_buf = plan.buffer("key padding", Elem::U8, keep.len(), Init::Host(keep));
    Ok(MaskArgs { kind, cu: cu_buf, nseg, keep: keep_buf, has_keep })
}

/// The arguments every attention kernel ends with: `keep, cu, nseg, [nb,] hq, hkv, tq, tk, d, mask,
/// has_keep, scale` (the backward also takes the batch `nb`).
fn mask_and_sizes(g: &Geometry, m: &MaskArgs, scale: f64, nb: Option<i32>) -> Vec<Arg> {
    let mut args = vec![buf(m.keep), buf(m.cu), Arg::I32(m.nseg)];
    args.extend(nb.map(Arg::I32));
    args.extend([g.hq, g.hkv, g.tq, g.tk, g.d, m.kind, m.has_keep].map(Arg::I32));
    args.push(Arg::F32(scale as f32));
    args
}

fn buf(b: usize) -> Arg {
    Arg::Buf { buf: b, offset: 0 }
}

/// Adds the forward launch reading q (rows `q_stride` elements apart, starting at element `q_offset` of
/// buffer `q`); writes `out` and `lse`.
#[allow(clippy::too_many_arguments)]
fn add_forward(
    plan: &mut Plan,
    p: &Problem,
    g: &Geometry,
    m: &MaskArgs,
    elem: Elem,
    caps: &Caps,
    (q, q_stride): (usize, i32),
    [k, v, out, lse]: [usize; 4],
) -> Result<(), PlanError> {
    let sfx = elem.name();
    let (module, name, smem, threads) = if elem == Elem::Bf16 && tc_smem(g.dp) <= caps.smem_optin {
        (Module::AttentionTc, format!("attention_fwd_tc_bf16_{}", g.dp), tc_smem(g.dp), 32 * TC_WARPS as u32)
    } else {
        (Module::Attention, format!("attention_fwd_{sfx}_{}", g.dp), fwd_smem(g.dp), THREADS)
    };
    let mut args = vec![buf(q), Arg::I32(q_stride), buf(k), buf(v), buf(out), buf(lse)];
    args.extend(mask_and_sizes(g, m, p.scale, None));
    let grid = [p.tq.div_ceil(BQ) as u32, (p.b * p.hq) as u32, 1];
    plan.launch(module, name, grid, [threads, 1, 1], smem, args)
}

/// Inputs q, k, v; outputs `O (B, Hq, Tq, D)` of `elem` and the logsumexp `(B, Hq, Tq)` f32 (`-inf` for
/// a row that sees no key, whose output is 0).
pub fn forward(p: &Problem, elem: Elem, caps: &Caps) -> Result<Plan, PlanError> {
    let op = "attention";
    super::float_elem(op, elem)?;
    let g = Geometry::new(op, p)?;
    let mut plan = Plan::new(op);
    let nk = p.b * p.hkv * p.tk * p.d;
    let q = plan.buffer("q", elem, g.rows * p.d, Init::Input(0));
    let k = plan.buffer("k", elem, nk, Init::Input(1));
    let v = plan.buffer("v", elem, nk, Init::Input(2));
    let m = mask_args(op, &mut plan, p)?;
    // Every element of out (rows < Tq, columns < D) and of lse is written: blocks cover every query tile.
    let out = plan.buffer("O", elem, g.rows * p.d, Init::Uninit);
    let lse = plan.buffer("lse", Elem::F32, g.rows, Init::Uninit);
    if g.rows > 0 {
        add_forward(&mut plan, p, &g, &m, elem, caps, (q, g.d), [k, v, out, lse])?;
    }
    plan.outputs.extend([out, lse]);
    Ok(plan)
}

/// Inputs `[q, O, dO]` packed, k, v (and the forward's logsumexp as input 3 when `saved_lse`); output
/// `[dq, dk, dv]` flattened, in `elem`.
pub fn backward(p: &Problem, elem: Elem, caps: &Caps, saved_lse: bool) -> Result<Plan, PlanError> {
    let op = "attention_bwd";
    super::float_elem(op, elem)?;
    let g = Geometry::new(op, p)?;
    let mut plan = Plan::new(op);
    let (nq, nk) = (g.rows * p.d, p.b * p.hkv * p.tk * p.d);
    let total = nq + 2 * nk;
    let qod = plan.buffer("[q, O, dO]", elem, 3 * nq, Init::Input(0));
    let k = plan.buffer("k", elem, nk, Init::Input(1));
    let v = plan.buffer("v", elem, nk, Init::Input(2));
    let saved = saved_lse.then(|| plan.buffer("lse", Elem::F32, g.rows, Init::Input(3)));
    let m = mask_args(op, &mut plan, p)?;
    // Zeroed: the kernel accumulates into it with atomicAdd; keys no query sees keep a 0 gradient.
    let dacc = plan.buffer("[dq, dk, dv] f32", Elem::F32, total, Init::Zeroed);
    if g.rows > 0 && p.tk > 0 {
        let lse = match saved {
            Some(l) => l,
            None => {
                let out = plan.buffer("O (recomputed, unused)", elem, nq, Init::Uninit);
                let lse = plan.buffer("lse (recomputed)", Elem::F32, g.rows, Init::Uninit);
                add_forward(&mut plan, p, &g, &m, elem, caps, (qod, 3 * g.d), [k, v, out, lse])?;
                lse
            }
        };
        // D_i = rowsum(dO_i * O_i): one warp per row, 8 rows per block; every entry is written.
        let delta = plan.buffer("D", Elem::F32, g.rows, Init::Uninit);
        let grid = [
            u32::try_from(g.rows.div_ceil(8))
                .map_err(|_| plan_err!("{op}: {} query rows exceed a CUDA grid", g.rows))?,
            1,
            1,
        ];
        let args = vec![buf(qod), buf(delta), Arg::I64(g.rows as i64), Arg::I32(g.d)];
        plan.launch(Module::Attention, format!("attention_delta_{}", elem.name()), grid, [256, 1, 1], 0, args)?;

        // Tensor cores for bf16 where they fit, else the largest CUDA-core tiles that fit.
        let (module, name, smem, threads, tk_rows) = if elem == Elem::Bf16 && tc_bwd_smem(g.dp) <= caps.smem_optin {
            (
                Module::AttentionTc,
                format!("attention_bwd_tc_bf16_{}", g.dp),
                tc_bwd_smem(g.dp),
                32 * TC_WARPS as u32,
                BK,
            )
        } else {
            let fits = BWD_TILES.iter().find(|(tq, tk, _)| bwd_smem(g.dp, *tq, *tk) <= caps.smem_optin);
            let &(tq, tk, infix) = fits.ok_or_else(|| {
                plan_err!(
                    "{op}: no backward tiling of head dim {} fits {} bytes of shared memory ({})",
                    g.dp,
                    caps.smem_optin,
                    caps.name
                )
            })?;
            let name = format!("attention_bwd_{infix}{}_{}", elem.name(), g.dp);
            (Module::Attention, name, bwd_smem(g.dp, tq, tk), THREADS, tk)
        };
        let mut args = vec![buf(qod), buf(k), buf(v), buf(lse), buf(delta), buf(dacc)];
        args.extend(mask_and_sizes(&g, &m, p.scale, Some(g.nb)));
        let grid = [p.tk.div_ceil(tk_rows) as u32, (p.b * p.hq) as u32, 1];
        plan.launch(module, name, grid, [threads, 1, 1], smem, args)?;
    }
    if elem == Elem::F32 {
        plan.outputs.push(dacc);
        return Ok(plan);
    }
    // The f32 accumulator rounded once to bf16; the cast writes all `total` elements.
    let out = plan.buffer("[dq, dk, dv]", elem, total, Init::Uninit);
    if total > 0 {
        let grid = [total.div_ceil(256).min(65_535) as u32, 1, 1];
        let args = vec![buf(dacc), buf(out), Arg::I64(total as i64)];
        plan.launch(Module::Attention, "attention_cast_bf16".into(), grid, [256, 1, 1], 0, args)?;
    }
    plan.outputs.push(out);
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(d: usize) -> Problem {
        Problem { b: 1, hq: 2, hkv: 1, tq: 100, tk: 100, d, mask: Mask::Causal, keep: None, scale: 0.1 }
    }

    /// `(kernel, shared bytes)` of each launch.
    fn launches(p: &Plan) -> Vec<(String, u32)> {
        p.launches.iter().map(|l| (l.kernel.clone(), l.shared_bytes)).collect()
    }

    /// The shared-memory sizes, derived by hand from the layouts in the .cu files.
    #[test]
    fn shared_bytes_match_the_layouts() {
        // CUDA-core backward at D 128: 64x64 tiles (2*64*129*2 + 64*65) * 4 + (4*64 + 64) * 4.
        assert_eq!(bwd_smem(128, 64, 64), (33_024 + 4_160) * 4 + 1_280);
        assert_eq!(bwd_smem(128, 64, 64), 150_016);
        // 32x32 tiles: (2*32*129*2 + 32*33) * 4 + (4*32 + 32) * 4.
        assert_eq!(bwd_smem(128, 32, 32), (16_512 + 1_056) * 4 + 640);
        // Tensor-core forward at D 128: Q, K, V 3*64*136*2, per warp max(16*68*4, 16*132*4) + 16*72*2.
        assert_eq!(tc_smem(128), 52_224 + 4 * (8_448 + 2_304) + 768);
        // Tensor-core backward at D 80: 4*64*88*2 + max(2*64*68*4, 64*84*4) + 2*64*72*2 + 2*64*4 + 192*4.
        assert_eq!(tc_bwd_smem(80), 45_056 + 34_816 + 18_432 + 512 + 768);
    }

    /// sm_86/sm_89 (101,376 bytes): every head dim has a plan; bf16 takes tensor cores where they fit.
    #[test]
    fn sm86_plans_fit_every_head_dim() {
        for d in HEAD_DIMS {
            for elem in [Elem::F32, Elem::Bf16] {
                for saved in [true, false] {
                    let b = backward(&problem(d), elem, &Caps::SM86, saved).unwrap();
                    b.check(&Caps::SM86).unwrap();
                }
                forward(&problem(d), elem, &Caps::SM86).unwrap().check(&Caps::SM86).unwrap();
            }
        }
        let f = launches(&forward(&problem(128), Elem::Bf16, &Caps::SM86).unwrap());
        assert_eq!(f, [("attention_fwd_tc_bf16_128".to_string(), 96_000)]);
        let b = launches(&backward(&problem(128), Elem::Bf16, &Caps::SM86, true).unwrap());
        assert_eq!(b[1], ("attention_bwd_small_bf16_128".to_string(), 70_912));
        let b = launches(&backward(&problem(80), Elem::Bf16, &Caps::SM86, true).unwrap());
        assert_eq!(b[1], ("attention_bwd_tc_bf16_80".to_string(), 99_584));
        let b = launches(&backward(&problem(80), Elem::F32, &Caps::SM86, true).unwrap());
        assert_eq!(b[1], ("attention_bwd_f32_80".to_string(), 100_864));
    }

    /// Qwen3-VL's vision head dim 72 (1152 / 16) runs in the 80 bucket, on tensor cores in bf16 both ways
    /// on both devices: 65,280 and 99,584 bytes fit sm_86's 101,376 (`shared_bytes_match_the_layouts`).
    #[test]
    fn qwen3_vl_vision_head_dim_72_pads_into_80() {
        assert_eq!(bucket("attention", 72).unwrap(), 80);
        assert_eq!(tc_smem(80), 3 * 64 * 88 * 2 + 4 * (16 * 84 * 4 + 16 * 72 * 2) + 192 * 4);
        for caps in [Caps::SM90, Caps::SM86] {
            let p = Problem { d: 72, mask: Mask::Block(vec![0, 40, 100]), ..problem(72) };
            let f = launches(&forward(&p, Elem::Bf16, &caps).unwrap());
            assert_eq!(f, [("attention_fwd_tc_bf16_80".to_string(), 65_280)], "{}", caps.name);
            let b = launches(&backward(&p, Elem::Bf16, &caps, true).unwrap());
            assert_eq!(b[1], ("attention_bwd_tc_bf16_80".to_string(), 99_584), "{}", caps.name);
            backward(&p, Elem::F32, &caps, true).unwrap().check(&caps).unwrap();
        }
        assert!(bucket("attention", 129).unwrap_err().0.contains("head dim 129"));
    }

    /// sm_90: bf16 runs both directions on tensor cores at D 128; without a saved logsumexp the backward
    /// starts with the forward kernel.
    #[test]
    fn sm90_takes_tensor_cores_and_recomputes_lse() {
        let b = launches(&backward(&problem(128), Elem::Bf16, &Caps::SM90, false).unwrap());
        let names: Vec<&str> = b.iter().map(|x| x.0.as_str()).collect();
        assert_eq!(
            names,
            ["attention_fwd_tc_bf16_128", "attention_delta_bf16", "attention_bwd_tc_bf16_128", "attention_cast_bf16"]
        );
        assert_eq!(b[2].1, 124_160);
    }
}
