//! The vision tower of every family: patch embedding, 2D rotary, transformer blocks, patch merger.
//!
//! It takes `pixel_values (P, 3 * 2 * p * p)` and the images' `grid_thw`, and returns one embedding per
//! merged 2x2 patch group `(P / 4, W)`. Qwen2-VL blocks are LayerNorm + GELU MLP and attend over each
//! whole image. Qwen2.5-VL blocks are RMSNorm + SwiGLU; most attend inside windows of `window_size / 28`
//! merged patches a side, the blocks in `fullatt_block_indexes` over the whole image. For windows, rows are
//! first permuted window by window (so that each window is a contiguous segment of a block-diagonal
//! attention) and permuted back after the merger (Qwen2.5-VL report, section 2.1.1). Qwen3-VL adds a learned
//! position table, bilinearly resampled to each image's grid, to the patch embeddings, and DeepStack: the
//! outputs of the blocks in `deepstack_visual_indexes` go through mergers of their own (LayerNorm after
//! the 2x2 shuffle), and their features are returned beside the main ones, `W = (1 + k) * text_hidden`
//! (Qwen3-VL report; DeepStack, arXiv 2406.04334). Blocks carry the captured outputs as extra columns of
//! their rows, so the tower stays a chain of row-wise stages for recomputation.

use std::ops::Range;

use askgui_kernels::AttentionMask;
use candle_core::{DType, Device, Tensor};

use crate::adapter_slot::RowAdapters;
use crate::config::{Arch, MlpKind, NormKind, VisionConfig};
use crate::device::KernelChoice;
use crate::error::{ModelError, Result};
use crate::image::ProcessedImage;
use crate::layers::{activation, Linear};
use crate::text::project;
use crate::train_ops::TrainCtx;
use crate::weights::Weights;

/// RMSNorm (Qwen2.5-VL) or LayerNorm (Qwen2-VL, Qwen3-VL), eps 1e-6 in all.
enum Norm {
    Rms(Tensor),
    Layer(Tensor, Tensor),
}

impl Norm {
    fn load(w: &Weights, name: &str, dim: usize, kind: NormKind) -> Result<Self> {
        let weight = w.get(&format!("{name}.weight"), &[dim])?;
        Ok(match kind {
            NormKind::Rms => Norm::Rms(weight),
            NormKind::Layer => Norm::Layer(weight, w.get(&format!("{name}.bias"), &[dim])?),
        })
    }
    fn forward(&self, x: &Tensor, train: Option<&TrainCtx>, kernels: KernelChoice) -> candle_core::Result<Tensor> {
        match (self, train) {
            (Norm::Rms(w), None) => crate::layers::rms_norm(x, w, 1e-6, kernels),
            (Norm::Layer(w, b), None) => crate::layers::layer_norm(x, w, b, 1e-6, kernels),
            (Norm::Rms(w), Some(c)) => c.rms_norm(x, w, 1e-6),
            (Norm::Layer(w, b), Some(c)) => c.layer_norm(x, w, b, 1e-6),
        }
    }

    fn tensors_mut<'a>(&'a mut self, name: &str, out: &mut Vec<(String, &'a mut Tensor)>) {
        match self {
            Norm::Rms(w) => out.push((format!("{name}.weight"), w)),
            Norm::Layer(w, b) => {
                out.push((format!("{name}.weight"), w));
                out.push((format!("{name}.bias"), b));
            }
        }
    }

    fn tensors(&self, name: &str, out: &mut Vec<(String, Tensor)>) {
        match self {
            Norm::Rms(w) => out.push((format!("{name}.weight"), w.clone())),
            Norm::Layer(w, b) => {
                out.push((format!("{name}.weight"), w.clone()));
                out.push((format!("{name}.bias"), b.clone()));
            }
        }
    }
}

enum Mlp {
    /// Qwen2.5-VL: `down(act(gate(x)) * up(x))`.
    Glu { gate: Linear, up: Linear, down: Linear },
    /// Qwen2-VL, Qwen3-VL: `fc2(act(fc1(x)))`.
    Plain { fc1: Linear, fc2: Linear },
}

/// Row-aligned parts `(P, w_i)` as one `(P, sum w_i)`; a single part is returned as it is, not copied.
fn side_by_side(mut parts: Vec<Tensor>) -> Result<Tensor> {
    match parts.len() {
        1 => Ok(parts.remove(0)),
        _ => Ok(Tensor::cat(&parts, 1)?),
    }
}

/// A patch merger: `norm`, then the 2x2 groups' rows side by side through `fc2(gelu(fc1(.)))`. The main
/// merger normalises each patch row before the shuffle; a DeepStack merger the shuffled row
/// (`post_shuffle`, Qwen3-VL's `use_postshuffle_norm`).
struct Merger {
    /// The norm's checkpoint name, e.g. `visual.merger.ln_q`.
    norm_name: String,
    norm: Norm,
    fc1: Linear,
    fc2: Linear,
    post_shuffle: bool,
}

impl Merger {
    /// `prefix` e.g. `visual.merger` or `visual.deepstack_merger_list.0`.
    fn load(w: &Weights, prefix: &str, cfg: &VisionConfig, arch: Arch, post_shuffle: bool) -> Result<Self> {
        let [norm, fc1, fc2] = arch.merger_names();
        let merged = cfg.hidden_size * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let norm_dim = if post_shuffle { merged } else { cfg.hidden_size };
        Ok(Self {
            norm_name: format!("{prefix}.{norm}"),
            norm: Norm::load(w, &format!("{prefix}.{norm}"), norm_dim, arch.vision_norm())?,
            fc1: Linear::load(w, &format!("{prefix}.{fc1}"), merged, merged, true)?,
            fc2: Linear::load(w, &format!("{prefix}.{fc2}"), merged, cfg.out_hidden_size, true)?,
            post_shuffle,
        })
    }

    /// `x (P, hidden) -> (P / unit, out)`, rows in the order they come; `adapters` are the merged
    /// rows' own (inference).
    fn forward(
        &self,
        x: &Tensor,
        unit: usize,
        (train, adapters): (Option<&TrainCtx>, Option<&RowAdapters>),
        kernels: KernelChoice,
    ) -> Result<Tensor> {
        let (p, hidden) = x.dims2()?;
        // (P, hidden) -> (P / unit, unit * hidden), normalised before or after the shuffle
        let merged = match self.post_shuffle {
            false => self.norm.forward(x, train, kernels)?.reshape((p / unit, unit * hidden))?,
            true => self.norm.forward(&x.reshape((p / unit, unit * hidden))?, train, kernels)?,
        };
        let lin = |l: &Linear, x: &Tensor| project(l, x, train, adapters);
        Ok(lin(&self.fc2, &lin(&self.fc1, &merged)?.gelu_erf()?)?)
    }
}

struct Block {
    norm1: Norm,
    norm2: Norm,
    qkv: Linear,
    proj: Linear,
    mlp: Mlp,
}

pub struct VisionTower {
    cfg: VisionConfig,
    /// Conv3d weight flattened to `(hidden, 3 * t * p * p)`: a stride-equals-kernel conv is a matmul.
    patch_embed: Tensor,
    /// The Conv3d's bias `(hidden,)` (Qwen3-VL).
    patch_bias: Option<Tensor>,
    /// The learned square position table `(side^2, hidden)` (Qwen3-VL).
    pos_embed: Option<Tensor>,
    blocks: Vec<Block>,
    merger: Merger,
    /// One merger per DeepStack block, in block order.
    deepstack: Vec<Merger>,
    /// `(head_dim / 4,)` rotary frequencies shared by the h and w axes.
    inv_freq: Tensor,
    /// The ops of the inference path; the training path takes them from its [`TrainCtx`].
    pub(crate) kernels: KernelChoice,
}

/// What every block of one forward shares: the embedded patches and rotary tables, window-permuted
/// for Qwen2.5-VL, and the attention segments.
pub(crate) struct VisionPrep {
    /// `(P, hidden)` patch embeddings, the first block's input.
    pub x: Tensor,
    /// `(P, 1, head_dim)` rotary tables.
    cos: Tensor,
    sin: Tensor,
    pub(crate) layout: Layout,
    /// Each image's own LoRA adapter, as plans over the patch rows and over the merged rows
    /// ([`VisionTower::forward_images_rows`]); None: the active adapter for all.
    adapters: Option<(RowAdapters, RowAdapters)>,
}

impl VisionPrep {
    /// The patch rows split at frame boundaries into consecutive ranges of at most `max_rows` rows (a
    /// larger frame alone; 0: one range), for a training stage that runs a block range by range.
    pub(crate) fn frame_ranges(&self, max_rows: usize) -> Vec<Range<usize>> {
        let cu = &self.layout.cu_full;
        let total = *cu.last().expect("cu_full starts at 0");
        if max_rows == 0 {
            return std::iter::once(0..total).collect();
        }
        let mut out: Vec<Range<usize>> = Vec::new();
        for w in cu.windows(2) {
            match out.last_mut() {
                Some(r) if w[1] - r.start <= max_rows => r.end = w[1],
                _ => out.push(w[0]..w[1]),
            }
        }
        out
    }
}

/// Patch coordinates and attention segments of a batch of images.
pub(crate) struct Layout {
    /// The images' grids, as given.
    grids: Vec<[usize; 3]>,
    /// `(P, 2)` (row, column) of each patch, in pixel_values order.
    hw: Vec<f32>,
    /// Boundaries of whole images (per temporal frame).
    cu_full: Vec<usize>,
    /// Boundaries of windows, in the window-permuted order (Qwen2.5-VL).
    cu_window: Vec<usize>,
    /// Merged-group order that makes windows contiguous (Qwen2.5-VL).
    window_index: Vec<u32>,
}

impl VisionTower {
    pub fn load(w: &Weights, cfg: &VisionConfig, arch: Arch) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let (tp, p) = (cfg.temporal_patch_size, cfg.patch_size);
        let patch_embed = w
            .get("visual.patch_embed.proj.weight", &[h, cfg.in_channels, tp, p, p])?
            .reshape((h, cfg.in_channels * tp * p * p))?;
        let mut blocks = Vec::with_capacity(cfg.depth);
        for b in 0..cfg.depth {
            let n = format!("visual.blocks.{b}");
            let mlp = match arch.vision_mlp() {
                MlpKind::Glu => Mlp::Glu {
                    gate: Linear::load(w, &format!("{n}.mlp.gate_proj"), h, i, true)?,
                    up: Linear::load(w, &format!("{n}.mlp.up_proj"), h, i, true)?,
                    down: Linear::load(w, &format!("{n}.mlp.down_proj"), i, h, true)?,
                },
                MlpKind::Plain { fc1, fc2 } => Mlp::Plain {
                    fc1: Linear::load(w, &format!("{n}.mlp.{fc1}"), h, i, true)?,
                    fc2: Linear::load(w, &format!("{n}.mlp.{fc2}"), i, h, true)?,
                },
            };
            blocks.push(Block {
                norm1: Norm::load(w, &format!("{n}.norm1"), h, arch.vision_norm())?,
                norm2: Norm::load(w, &format!("{n}.norm2"), h, arch.vision_norm())?,
                qkv: Linear::load(w, &format!("{n}.attn.qkv"), h, 3 * h, true)?,
                proj: Linear::load(w, &format!("{n}.attn.proj"), h, h, true)?,
                mlp,
            });
        }
        let deepstack = (0..cfg.deepstack_visual_indexes.len())
            .map(|j| Merger::load(w, &format!("visual.deepstack_merger_list.{j}"), cfg, arch, true))
            .collect::<Result<_>>()?;
        let inv: Vec<f32> = askgui_kernels::rope::inv_freq(cfg.head_dim() / 2, cfg.rope_theta);
        Ok(Self {
            cfg: cfg.clone(),
            patch_embed,
            patch_bias: match arch.patch_bias() {
                true => Some(w.get("visual.patch_embed.proj.bias", &[h])?),
                false => None,
            },
            pos_embed: match cfg.num_position_embeddings {
                Some(n) => Some(w.get("visual.pos_embed.weight", &[n, h])?),
                None => None,
            },
            blocks,
            merger: Merger::load(w, "visual.merger", cfg, arch, false)?,
            deepstack,
            inv_freq: Tensor::new(inv.as_slice(), &Device::Cpu)?,
            kernels: KernelChoice::default(),
        })
    }

    fn layout(&self, grid_thw: &[[usize; 3]]) -> Layout {
        let m = self.cfg.spatial_merge_size;
        let unit = m * m;
        let mut l =
            Layout { grids: grid_thw.to_vec(), hw: vec![], cu_full: vec![0], cu_window: vec![0], window_index: vec![] };
        let mut group_offset = 0usize;
        for &[t, h, w] in grid_thw {
            for _ in 0..t {
                for bh in 0..h / m {
                    for bw in 0..w / m {
                        for mh in 0..m {
                            for mw in 0..m {
                                l.hw.extend([(bh * m + mh) as f32, (bw * m + mw) as f32]);
                            }
                        }
                    }
                }
                l.cu_full.push(l.cu_full.last().unwrap() + h * w);
            }
            // Windows of `ws` merged groups a side, scanned window by window; partial windows at the
            // right and bottom edges, empty ones dropped.
            let (gh, gw) = (h / m, w / m);
            let ws = self.cfg.window_size.unwrap_or(1) / m / self.cfg.patch_size;
            for f in 0..t {
                for wy in (0..gh).step_by(ws.max(1)) {
                    for wx in (0..gw).step_by(ws.max(1)) {
                        let mut n = 0;
                        for y in wy..(wy + ws).min(gh) {
                            for x in wx..(wx + ws).min(gw) {
                                l.window_index.push((group_offset + f * gh * gw + y * gw + x) as u32);
                                n += 1;
                            }
                        }
                        l.cu_window.push(l.cu_window.last().unwrap() + n * unit);
                    }
                }
            }
            group_offset += t * gh * gw;
        }
        l
    }

    /// Every linear layer of the tower (blocks, then the merger), for LoRA.
    pub(crate) fn linears(&self) -> Vec<&Linear> {
        let mut out = Vec::new();
        for b in &self.blocks {
            out.extend([&b.qkv, &b.proj]);
            match &b.mlp {
                Mlp::Glu { gate, up, down } => out.extend([gate, up, down]),
                Mlp::Plain { fc1, fc2 } => out.extend([fc1, fc2]),
            }
        }
        out.extend(self.merger_linears());
        out
    }

    /// The linears of the main merger, then of each DeepStack merger.
    fn merger_linears(&self) -> Vec<&Linear> {
        std::iter::once(&self.merger).chain(&self.deepstack).flat_map(|m| [&m.fc1, &m.fc2]).collect()
    }

    /// [`Self::linears`], mutable (same order).
    pub(crate) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out = Vec::new();
        for b in &mut self.blocks {
            out.push(&mut b.qkv);
            out.push(&mut b.proj);
            match &mut b.mlp {
                Mlp::Glu { gate, up, down } => out.extend([gate, up, down]),
                Mlp::Plain { fc1, fc2 } => out.extend([fc1, fc2]),
            }
        }
        for m in std::iter::once(&mut self.merger).chain(&mut self.deepstack) {
            out.extend([&mut m.fc1, &mut m.fc2]);
        }
        out
    }

    /// `pixel_values (P, patch_dim)` and `grid_thw` -> merged embeddings `(P / merge^2, out_hidden)`.
    pub fn forward(&self, pixel_values: &Tensor, grid_thw: &[[usize; 3]]) -> Result<Tensor> {
        self.forward_with(pixel_values, grid_thw, None)
    }

    /// [`Self::forward`], or with `train` its training twin (kernels' CustomOps, frozen base weights).
    pub(crate) fn forward_with(
        &self,
        pixel_values: &Tensor,
        grid_thw: &[[usize; 3]],
        train: Option<&TrainCtx>,
    ) -> Result<Tensor> {
        self.run(&self.prepare(pixel_values, grid_thw)?, train)
    }

    /// [`Self::forward`] over whole images, without first copying their pixels into one tensor on the
    /// CPU (see [`Self::prepare_images`]).
    pub fn forward_images(&self, images: &[&ProcessedImage]) -> Result<Tensor> {
        self.run(&self.prepare_images(images)?, None)
    }

    /// [`Self::forward_images`] with each image's own LoRA adapter: `adapters` over the images' patch
    /// rows, one run per image (each image's rows stay contiguous in window order too, as windows never
    /// cross images). Vision-tower LoRA keeps working in a batch that mixes adapters.
    pub fn forward_images_rows(&self, images: &[&ProcessedImage], adapters: RowAdapters) -> Result<Tensor> {
        let mut prep = self.prepare_images(images)?;
        let merged = adapters.grouped(self.cfg.spatial_merge_size.pow(2), prep.x.device())?;
        prep.adapters = Some((adapters, merged));
        self.run(&prep, None)
    }

    /// The blocks and the merger over prepared patch rows.
    fn run(&self, prep: &VisionPrep, train: Option<&TrainCtx>) -> Result<Tensor> {
        let mut x = prep.x.clone();
        for i in 0..self.blocks.len() {
            x = self.block(i, &x, prep, train)?;
        }
        self.merge(&x, prep, train)
    }

    /// Number of transformer blocks.
    pub(crate) fn depth(&self) -> usize {
        self.blocks.len()
    }

    /// The linears of block `i` (`i == depth()`: the merger's), for [`crate::train`].
    pub(crate) fn stage_linears(&self, i: usize) -> Vec<&Linear> {
        match self.blocks.get(i) {
            Some(b) => {
                let mut out = vec![&b.qkv, &b.proj];
                match &b.mlp {
                    Mlp::Glu { gate, up, down } => out.extend([gate, up, down]),
                    Mlp::Plain { fc1, fc2 } => out.extend([fc1, fc2]),
                }
                out
            }
            None => self.merger_linears(),
        }
    }

    /// Checks the inputs, embeds the patches (window-permuted for Qwen2.5-VL) and builds the rotary
    /// tables: everything before the first block. Holds no trainable parameter.
    pub(crate) fn prepare(&self, pixel_values: &Tensor, grid_thw: &[[usize; 3]]) -> Result<VisionPrep> {
        let rows: usize = grid_thw.iter().map(|g| g[0] * g[1] * g[2]).sum();
        let dim = self.patch_embed.dim(1)?;
        if pixel_values.dims2()? != (rows, dim) {
            return Err(ModelError::Generation(format!(
                "pixel_values is {:?} but image_grid_thw {grid_thw:?} needs ({rows}, {dim})",
                pixel_values.dims()
            )));
        }
        self.prepare_embedded(grid_thw, |layout| self.embed_patches(pixel_values, layout))
    }

    /// [`Self::prepare`] for whole images. On the CPU with f32 weights each image is patch-embedded from
    /// its own pixel buffer ([`askgui_kernels::ops::linear_parts`]): a batch's pixels (about 7 MB per
    /// 640x480 screenshot) are never copied into one tensor. Elsewhere they are, and go through
    /// [`Self::prepare`].
    fn prepare_images(&self, images: &[&ProcessedImage]) -> Result<VisionPrep> {
        let grids: Vec<[usize; 3]> = images.iter().map(|i| i.grid_thw).collect();
        let dev = self.patch_embed.device();
        if !dev.is_cpu() || self.patch_embed.dtype() != DType::F32 {
            return self.prepare(&crate::image::pixel_rows(images, dev)?, &grids);
        }
        let dim = self.patch_embed.dim(1)?;
        for (i, img) in images.iter().enumerate() {
            let rows = img.grid_thw.iter().product::<usize>();
            if img.pixel_values.len() != rows * dim {
                return Err(ModelError::Generation(format!(
                    "image {i} has {} pixel values but its grid {:?} needs {rows} rows of {dim}",
                    img.pixel_values.len(),
                    img.grid_thw
                )));
            }
        }
        let parts: Vec<&[f32]> = images.iter().map(|i| i.pixel_values.as_slice()).collect();
        self.prepare_embedded(&grids, |layout| {
            self.finish_patches(askgui_kernels::ops::linear_parts(&parts, &self.patch_embed)?, layout)
        })
    }

    /// The rest of [`Self::prepare`] once the pixel rows are checked: the layout, `embed(layout)` as the
    /// patch rows `(P, hidden)` in window order, and the rotary tables.
    fn prepare_embedded(
        &self,
        grid_thw: &[[usize; 3]],
        embed: impl FnOnce(&Layout) -> Result<Tensor>,
    ) -> Result<VisionPrep> {
        let m = self.cfg.spatial_merge_size;
        if let Some(g) = grid_thw.iter().find(|g| g[1] % m != 0 || g[2] % m != 0 || g[0] == 0) {
            return Err(ModelError::Generation(format!("image grid {g:?} is not a multiple of the merge size {m}")));
        }
        let dev = self.patch_embed.device();
        let dtype = self.patch_embed.dtype();
        let layout = self.layout(grid_thw);
        let p = layout.hw.len() / 2;
        let x = embed(&layout)?;
        // (P, 2) -> cos/sin (P, head_dim)
        let hw = Tensor::from_vec(layout.hw.clone(), (p, 2), &Device::Cpu)?;
        let (mut cos, mut sin) = askgui_kernels::vision_rope_cos_sin_reference(&hw, &self.inv_freq)?;
        if self.cfg.window_size.is_some() {
            let idx = self.window_rows(&layout)?;
            cos = cos.to_device(dev)?.index_select(&idx, 0)?;
            sin = sin.to_device(dev)?.index_select(&idx, 0)?;
        }
        // (P, 1, head_dim) to broadcast over heads
        let cos = cos.to_device(dev)?.to_dtype(dtype)?.unsqueeze(1)?;
        let sin = sin.to_device(dev)?.to_dtype(dtype)?.unsqueeze(1)?;
        Ok(VisionPrep { x, cos, sin, layout, adapters: None })
    }

    /// The patch embedding `(P, patch_dim) -> (P, hidden)`, rows in window order for Qwen2.5-VL (as
    /// [`Self::prepare`] leaves them). Differentiable in the patch embedding (full training).
    pub(crate) fn embed_patches(&self, pixel_values: &Tensor, layout: &Layout) -> Result<Tensor> {
        let x = crate::layers::matmul_t(&pixel_values.to_dtype(self.patch_embed.dtype())?, &self.patch_embed)?;
        self.finish_patches(x, layout)
    }

    /// The patch rows `x (P, hidden)` (pixel order) plus the Conv3d's bias and the interpolated position
    /// table where the family has them, then in window order.
    fn finish_patches(&self, x: Tensor, layout: &Layout) -> Result<Tensor> {
        let x = match &self.patch_bias {
            Some(b) => x.broadcast_add(b)?,
            None => x,
        };
        let x = match &self.pos_embed {
            Some(table) => (&x + self.positions(table, layout)?.to_dtype(x.dtype())?)?,
            None => x,
        };
        self.window_order(x, layout)
    }

    /// The learned square position table `(side^2, hidden)` resampled to every patch `(P, hidden)`, in the
    /// layout's patch order: bilinear with aligned corners (transformers' `fast_pos_embed_interpolate`:
    /// four taps a patch, each axis `src = i * (side - 1) / max(size - 1, 1)`). Differentiable in the table.
    fn positions(&self, table: &Tensor, layout: &Layout) -> Result<Tensor> {
        let side = (table.dim(0)? as f64).sqrt().round() as usize;
        let m = self.cfg.spatial_merge_size;
        // Per axis: the two taps of target index `i` on an axis of `size`, and their weights.
        let axis = |i: usize, size: usize| -> [(usize, f32); 2] {
            let src = (i as f32 * (side - 1) as f32) / (size.max(2) - 1) as f32;
            let f = src.floor();
            [0usize, 1].map(|o| ((f as usize + o).min(side - 1), (1.0 - (src - (f + o as f32)).abs()).max(0.0)))
        };
        let (mut idx, mut wts) = (Vec::new(), Vec::new());
        for &[t, h, w] in &layout.grids {
            for _ in 0..t {
                for (bh, bw, mh, mw) in (0..h / m).flat_map(|bh| {
                    (0..w / m).flat_map(move |bw| (0..m).flat_map(move |mh| (0..m).map(move |mw| (bh, bw, mh, mw))))
                }) {
                    let (rows, cols) = (axis(bh * m + mh, h), axis(bw * m + mw, w));
                    for (r, wr) in rows {
                        for (c, wc) in cols {
                            idx.push((r * side + c) as u32);
                            wts.push(wr * wc);
                        }
                    }
                }
            }
        }
        let (p, dev) = (idx.len() / 4, table.device());
        // (4P,) rows of the table -> (P, 4, hidden), weighted -> (P, hidden)
        let rows = table.index_select(&Tensor::from_vec(idx, 4 * p, dev)?, 0)?.reshape((p, 4, ()))?;
        let wts = Tensor::from_vec(wts, (p, 4, 1), dev)?.to_dtype(rows.dtype())?;
        Ok(rows.broadcast_mul(&wts)?.sum(1)?)
    }

    /// Patch rows `(P, ..)` from pixel order into window order (Qwen2.5-VL; unchanged without windows).
    fn window_order(&self, x: Tensor, layout: &Layout) -> Result<Tensor> {
        match self.cfg.window_size {
            Some(_) => Ok(x.index_select(&self.window_rows(layout)?, 0)?),
            None => Ok(x),
        }
    }

    /// The pixel-order row of each window-order row: every merged group's `merge^2` patches, group by group.
    fn window_rows(&self, layout: &Layout) -> Result<Tensor> {
        let unit = (self.cfg.spatial_merge_size * self.cfg.spatial_merge_size) as u32;
        let idx: Vec<u32> = layout.window_index.iter().flat_map(|&g| (0..unit).map(move |j| g * unit + j)).collect();
        let n = idx.len();
        Ok(Tensor::from_vec(idx, n, self.patch_embed.device())?)
    }

    /// Block `i`: `x (P, hidden) -> (P, hidden)`, pre-norm attention then MLP, both residual.
    pub(crate) fn block(&self, i: usize, x: &Tensor, prep: &VisionPrep, train: Option<&TrainCtx>) -> Result<Tensor> {
        self.block_rows(i, x, prep, &(0..x.dim(0)?), train)
    }

    /// Block `i` over the patch rows `rows` alone (`x` holds those rows): `rows` must start and end on
    /// frame boundaries ([`VisionPrep::frame_ranges`]), where attention does not cross. `x` is
    /// `(rows, hidden * (1 + c))`: the hidden states, then the `c` DeepStack outputs captured so far, which
    /// pass through; a DeepStack block appends its own output to them.
    pub(crate) fn block_rows(
        &self,
        i: usize,
        x: &Tensor,
        prep: &VisionPrep,
        rows: &Range<usize>,
        train: Option<&TrainCtx>,
    ) -> Result<Tensor> {
        let (hidden, width) = (self.cfg.hidden_size, x.dim(1)?);
        let y = self.block_hidden(i, &x.narrow(1, 0, hidden)?, prep, rows, train)?;
        let mut parts = vec![y.clone()];
        if width > hidden {
            parts.push(x.narrow(1, hidden, width - hidden)?);
        }
        if self.cfg.deepstack_visual_indexes.contains(&i) {
            parts.push(y);
        }
        side_by_side(parts)
    }

    /// [`Self::block_rows`] over the hidden states `(rows, hidden)` alone.
    fn block_hidden(
        &self,
        i: usize,
        x: &Tensor,
        prep: &VisionPrep,
        rows: &Range<usize>,
        train: Option<&TrainCtx>,
    ) -> Result<Tensor> {
        let b = &self.blocks[i];
        let cu = if self.cfg.window_size.is_some() && !self.cfg.fullatt_block_indexes.contains(&i) {
            &prep.layout.cu_window
        } else {
            &prep.layout.cu_full
        };
        let cu: Vec<usize> =
            cu.iter().filter(|c| rows.contains(c) || **c == rows.end).map(|c| c - rows.start).collect();
        if cu.first() != Some(&0) || cu.last() != Some(&rows.len()) {
            return Err(ModelError::Train(format!("vision rows {rows:?} do not fall on attention segment boundaries")));
        }
        let (cos, sin) = (prep.cos.narrow(0, rows.start, rows.len())?, prep.sin.narrow(0, rows.start, rows.len())?);
        let adapters = prep.adapters.as_ref().map(|a| &a.0);
        let x = (x + self.attention(
            b,
            &b.norm1.forward(x, train, self.kernels)?,
            (&cos, &sin),
            &cu,
            (train, adapters),
        )?)?;
        let h = b.norm2.forward(&x, train, self.kernels)?;
        let act = self.cfg.hidden_act;
        let lin = |l: &Linear, x: &Tensor| project(l, x, train, adapters);
        let mlp = match &b.mlp {
            Mlp::Glu { gate, up, down } => {
                let (g, u) = (lin(gate, &h)?, lin(up, &h)?);
                lin(down, &crate::layers::gated(&g, &u, act, self.kernels)?)?
            }
            Mlp::Plain { fc1, fc2 } => lin(fc2, &activation(&lin(fc1, &h)?, act)?)?,
        };
        Ok((x + mlp)?)
    }

    /// The patch merger: `x (P, hidden * (1 + k))` (the last block's output and the `k` DeepStack captures)
    /// -> `(P / merge^2, out_hidden * (1 + k))`, the main features then each DeepStack set, back in the
    /// images' row order.
    pub(crate) fn merge(&self, x: &Tensor, prep: &VisionPrep, train: Option<&TrainCtx>) -> Result<Tensor> {
        let (unit, hidden) = (self.cfg.spatial_merge_size.pow(2), self.cfg.hidden_size);
        let p = x.dim(0)?;
        if x.dim(1)? != hidden * (1 + self.deepstack.len()) {
            return Err(ModelError::Generation(format!(
                "vision merger: rows of width {} for {} DeepStack mergers of width {hidden}",
                x.dim(1)?,
                self.deepstack.len()
            )));
        }
        let run = (train, prep.adapters.as_ref().map(|a| &a.1));
        let mut outs = vec![self.merger.forward(&x.narrow(1, 0, hidden)?, unit, run, self.kernels)?];
        for (j, m) in self.deepstack.iter().enumerate() {
            outs.push(m.forward(&x.narrow(1, hidden * (1 + j), hidden)?, unit, run, self.kernels)?);
        }
        let mut out = side_by_side(outs)?;
        if self.cfg.window_size.is_some() {
            let window_index = &prep.layout.window_index;
            let mut inverse = vec![0u32; window_index.len()];
            for (pos, &g) in window_index.iter().enumerate() {
                inverse[g as usize] = pos as u32;
            }
            out = out.index_select(&Tensor::from_vec(inverse, p / unit, x.device())?, 0)?;
        }
        Ok(out)
    }

    fn attention(
        &self,
        b: &Block,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        cu: &[usize],
        (train, adapters): (Option<&TrainCtx>, Option<&RowAdapters>),
    ) -> Result<Tensor> {
        let (p, hidden) = x.dims2()?;
        let (heads, hd) = (self.cfg.num_heads, self.cfg.head_dim());
        // (P, 3, H, hd)
        let qkv = project(&b.qkv, x, train, adapters)?.reshape((p, 3, heads, hd))?;
        let part = |i: usize| -> candle_core::Result<Tensor> {
            // (P, H, hd); transformers rotates q and k in f32 whatever the model dtype
            let t = qkv.narrow(1, i, 1)?.squeeze(1)?;
            let t = if i < 2 {
                let f = DType::F32;
                let (t, c, s) = (t.to_dtype(f)?, cos.to_dtype(f)?, sin.to_dtype(f)?);
                match train {
                    None => crate::layers::rope(&t, &c, &s, self.kernels)?,
                    Some(ctx) => ctx.rope(&t, &c, &s)?,
                }
                .to_dtype(x.dtype())?
            } else {
                t
            };
            t.transpose(0, 1)?.unsqueeze(0) // (1, H, P, hd)
        };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let (mask, scale) = (AttentionMask::BlockDiagonal(cu), (hd as f64).powf(-0.5));
        let o = match train {
            None => crate::layers::attention(&q, &k, &v, mask, None, scale, self.kernels)?,
            Some(ctx) => ctx.attention((&q, &k, &v), mask, None, scale)?,
        };
        // (1, H, P, hd) -> (P, H * hd)
        let o = o.squeeze(0)?.transpose(0, 1)?.reshape((p, hidden))?;
        Ok(project(&b.proj, &o, train, adapters)?)
    }

    /// The tower's base (non-linear) tensors: patch embedding and norm parameters, for [`crate::train`].
    pub(crate) fn base_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("visual.patch_embed.proj.weight".to_string(), self.patch_embed.clone())];
        for (i, b) in self.blocks.iter().enumerate() {
            b.norm1.tensors(&format!("visual.blocks.{i}.norm1"), &mut out);
            b.norm2.tensors(&format!("visual.blocks.{i}.norm2"), &mut out);
        }
        for m in std::iter::once(&self.merger).chain(&self.deepstack) {
            m.norm.tensors(&m.norm_name, &mut out);
        }
        if let Some(b) = &self.patch_bias {
            out.push(("visual.patch_embed.proj.bias".to_string(), b.clone()));
        }
        if let Some(t) = &self.pos_embed {
            out.push(("visual.pos_embed.weight".to_string(), t.clone()));
        }
        out
    }

    /// [`Self::base_tensors`], mutable (same order), for full training.
    pub(crate) fn base_tensors_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut out = vec![("visual.patch_embed.proj.weight".to_string(), &mut self.patch_embed)];
        for (i, b) in self.blocks.iter_mut().enumerate() {
            b.norm1.tensors_mut(&format!("visual.blocks.{i}.norm1"), &mut out);
            b.norm2.tensors_mut(&format!("visual.blocks.{i}.norm2"), &mut out);
        }
        for m in std::iter::once(&mut self.merger).chain(&mut self.deepstack) {
            m.norm.tensors_mut(&m.norm_name, &mut out);
        }
        if let Some(b) = &mut self.patch_bias {
            out.push(("visual.patch_embed.proj.bias".to_string(), b));
        }
        if let Some(t) = &mut self.pos_embed {
            out.push(("visual.pos_embed.weight".to_string(), t));
        }
        out
    }

    /// Number of merged embeddings for the images.
    pub fn num_tokens(&self, grid_thw: &[[usize; 3]]) -> usize {
        grid_thw.iter().map(|g| g[0] * g[1] * g[2]).sum::<usize>() / (self.cfg.spatial_merge_size.pow(2))
    }
}
