//! Training on the model: trainable LoRA adapters (their `A` and `B` are `candle_core::Var`s), full
//! training of the base weights, and the loss with its gradients.
//!
//! A trainable adapter is an ordinary adapter ([`crate::lora`]) whose tensors are `Var`s: the same
//! [`crate::adapter_slot::LoraSlot`] entries serve inference and training, so an optimiser's `Var::set` is
//! seen by the next forward and saving / merging work unchanged. [`Qwen2Vl::add_trainable_adapter`]
//! initialises as PEFT does (`A ~ U(-1/sqrt(in), 1/sqrt(in))`, i.e. `kaiming_uniform_(a=sqrt(5))`; `B = 0`).
//! Key choice: the loss runs a separate training path, not the inference forward: the vision tower and
//! decoder are given a [`TrainCtx`] ([`crate::train_ops`]: ops with an explicit backward, so no base weight
//! gets a gradient), and the forward is a chain of stages recomputed in the backward
//! ([`crate::recompute`]). The inference path is the code the parity tests check, unchanged. Gradients
//! are checked against PEFT in `tests/lora_grad.rs` and the two op paths against each other in
//! `tests/kernel_choice.rs`.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use askgui_kernels::AttentionMask;
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use crate::adapter_slot::master_dtype;
use crate::adapter_slot::LoraDelta;
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::layers::{matmul_t, Linear};
use crate::model::{mrope_positions, Qwen2Vl};
use crate::peft::{matches_target, Adapter, LoraConfig};
use crate::random_init::write_checkpoint;
use crate::recompute::{self, Stage};
use crate::train_ops::{TrainCtx, VISION_ROWS};

/// One training sequence: token ids, which of them are supervised, and its images.
#[derive(Debug, Clone)]
pub struct TrainExample {
    pub ids: Vec<u32>,
    /// `labels_mask[t]` marks token `t` as supervised: the logits at `t - 1` predict it (so
    /// `labels_mask[0]` is ignored).
    pub labels_mask: Vec<bool>,
    /// `(P, patch_dim)` rows of this sequence's images, in order; `None` for a text-only sequence.
    pub pixel_values: Option<Tensor>,
    pub grid_thw: Vec<[usize; 3]>,
    /// Auxiliary targets `(t, token)`: position `t` (an image token) predicts `token` (e.g. a word of the
    /// widget it shows) from the hidden state after decoder layer [`StepOptions::region_layer`], through
    /// the final norm and the LM head. Their mean loss, times [`StepOptions::region_weight`], is added to
    /// the loss; empty for none.
    pub region_targets: Vec<(usize, u32)>,
}

/// How [`Qwen2Vl::loss_and_grads`] runs.
#[derive(Debug, Clone, Copy)]
pub struct StepOptions {
    /// Recompute every block in the backward instead of keeping its activations (on by default).
    pub checkpointing: bool,
    /// Seeds the LoRA dropout masks (pass e.g. the step number).
    pub dropout_seed: u64,
    /// Weight of the mean region loss ([`TrainExample::region_targets`]) added to the mean next-token
    /// loss; 0 leaves the region targets out.
    pub region_weight: f64,
    /// The decoder layer (1-based, at most the depth) whose output the region loss reads.
    pub region_layer: usize,
    /// Pack the batch's sequences back to back into one row, with attention block-diagonal over them
    /// and causal inside each, instead of right-padding them to the longest: no padding is computed, and
    /// the loss and gradients are those of the padded batch (up to float reassociation). LoRA dropout
    /// draws other masks for the other shape.
    pub pack: bool,
    /// The most patch rows a vision block runs at once (consecutive frames up to it, a larger frame
    /// alone; 0: the whole batch at once): with checkpointing, a vision block's graph then holds one
    /// range, not every image of the batch. The result is the same up to float summation order.
    pub vision_rows: usize,
}

impl Default for StepOptions {
    fn default() -> Self {
        Self {
            checkpointing: true,
            dropout_seed: 0,
            region_weight: 0.0,
            region_layer: 1,
            pack: false,
            vision_rows: VISION_ROWS,
        }
    }
}

/// What one training forward and backward gives.
pub struct StepOutput {
    /// The mean loss over the supervised tokens.
    pub loss: f64,
    pub supervised_tokens: usize,
    /// The gradient of every trainable `Var` of the active adapter that the loss depends on, and of
    /// nothing else.
    pub grads: GradStore,
}

/// The training forward as a chain ([`crate::recompute`]).
struct Chain<'a> {
    x0: Tensor,
    stages: Vec<Stage<'a>>,
    supervised: usize,
    /// The flat `(B T)` row of each sequence's first token.
    starts: Vec<usize>,
}

/// The decoder's attention: causal over one sequence a row, or block-diagonal over packed sequences
/// (`cu_seqlens`) and causal inside each.
fn decoder_mask(cu: Option<&[usize]>) -> AttentionMask<'_> {
    match cu {
        Some(cu) => AttentionMask::CausalBlockDiagonal(cu),
        None => AttentionMask::Causal,
    }
}

/// What the chain's last stage returns.
#[derive(Debug, Clone, Copy)]
enum Head {
    /// The masked mean cross-entropy, plus the region loss at decoder layer `region_layer` (1-based) when
    /// `region_weight` is positive.
    Loss { region_weight: f64, region_layer: usize },
    /// The logits `(B T, V)` of every row.
    Logits,
}

impl Head {
    /// The next-token loss alone.
    const PLAIN_LOSS: Head = Head::Loss { region_weight: 0.0, region_layer: 1 };
}

/// A batch's sequences as decoder rows `(B, T)`: right-padded to the longest (`B` sequences), or packed
/// back to back into one row (`B == 1`, `T` = the sum of their lengths: no padding at all). Every flat
/// `(B T)` row is indexed by its sequence's start plus its position, so the two layouts share one loop.
/// Each sequence keeps its own M-RoPE positions, as if it were alone, and row `r` is labelled with the
/// next token of its own sequence; a sequence's last row, and padding, are unsupervised.
struct Rows {
    b: usize,
    t: usize,
    ids: Vec<u32>,
    labels: Vec<u32>,
    mask: Vec<f32>,
    /// `(3, B, T)` flattened.
    pos: Vec<f32>,
    starts: Vec<usize>,
    /// Packed: the sequences' boundaries in the one row (`cu_seqlens`).
    cu: Option<Vec<usize>>,
    region_rows: Vec<u32>,
    region_labels: Vec<u32>,
    pixels: Vec<Tensor>,
    grids: Vec<[usize; 3]>,
}

impl Rows {
    fn new(batch: &[TrainExample], pack: bool, region: bool, cfg: &ModelConfig) -> Result<Self> {
        let lens: Vec<usize> = batch.iter().map(|e| e.ids.len()).collect();
        let (b, t) = match pack {
            true => (1, lens.iter().sum()),
            false => (batch.len(), lens.iter().copied().max().unwrap_or(0)),
        };
        if batch.is_empty() {
            return Err(ModelError::Train("the batch is empty".into()));
        }
        let starts: Vec<usize> = match pack {
            true => lens.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n))).collect(),
            false => (0..batch.len()).map(|i| i * t).collect(),
        };
        let n_rows = b * t;
        let mut rows = Rows {
            b,
            t,
            ids: vec![0; n_rows],
            labels: vec![0; n_rows],
            mask: vec![0.0; n_rows],
            pos: vec![0.0; 3 * n_rows],
            cu: pack.then(|| starts.iter().copied().chain([t]).collect()),
            starts,
            region_rows: vec![],
            region_labels: vec![],
            pixels: vec![],
            grids: vec![],
        };
        for (i, e) in batch.iter().enumerate() {
            rows.add(i, e, region, cfg)?;
        }
        Ok(rows)
    }

    /// Writes sequence `i` at its start.
    fn add(&mut self, i: usize, e: &TrainExample, region: bool, cfg: &ModelConfig) -> Result<()> {
        let (n, s, n_rows) = (e.ids.len(), self.starts[i], self.b * self.t);
        if e.labels_mask.len() != n || n < 2 {
            return Err(ModelError::Train(format!(
                "sequence {i}: {n} tokens and {} mask entries; they must be equal and at least 2",
                e.labels_mask.len()
            )));
        }
        self.ids[s..s + n].copy_from_slice(&e.ids);
        for j in 1..n {
            self.labels[s + j - 1] = e.ids[j];
            self.mask[s + j - 1] = e.labels_mask[j] as u8 as f32;
        }
        if region {
            for &(p, tok) in &e.region_targets {
                if p >= n {
                    return Err(ModelError::Train(format!(
                        "sequence {i}: a region target at position {p} is past its {n} tokens"
                    )));
                }
                self.region_rows.push((s + p) as u32);
                self.region_labels.push(tok);
            }
        }
        let (pos, _) = mrope_positions(&e.ids, &e.grid_thw, cfg)?;
        for (j, xyz) in pos.iter().enumerate() {
            for (a, &v) in xyz.iter().enumerate() {
                self.pos[a * n_rows + s + j] = v as f32;
            }
        }
        match (&e.pixel_values, e.grid_thw.is_empty()) {
            (Some(pv), false) => self.pixels.push(pv.clone()),
            (None, true) => {}
            _ => {
                return Err(ModelError::Train(format!(
                    "sequence {i}: pixel_values and grid_thw must be given together"
                )))
            }
        }
        self.grids.extend_from_slice(&e.grid_thw);
        Ok(())
    }
}

impl Qwen2Vl {
    /// Adds a new trainable adapter `name` on every linear that `config` targets, initialised as PEFT:
    /// `A (r, in)` uniform in `±1/sqrt(in)` (`kaiming_uniform_(a=sqrt(5))`) from `seed`, `B (out, r)` zeros.
    /// It is not activated: call [`Qwen2Vl::set_active_adapter`].
    pub fn add_trainable_adapter(&mut self, name: &str, config: LoraConfig, seed: u64) -> Result<()> {
        config.validate(Path::new("<new adapter>"))?;
        if self.lora.adapters.contains_key(name) {
            return Err(ModelError::Train(format!("an adapter named `{name}` is already loaded")));
        }
        let (dtype, device, r) = (master_dtype(self.dtype()), self.device.clone(), config.r);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut modules = BTreeMap::new();
        for l in self.linears() {
            if !config.targets().iter().any(|t| matches_target(&l.name, t)) {
                continue;
            }
            let (out, inp) = l.weight.dims2()?;
            let bound = 1.0 / (inp as f64).sqrt();
            let a: Vec<f64> = (0..r * inp).map(|_| rng.random_range(-bound..bound)).collect();
            let a = Var::from_tensor(&Tensor::from_vec(a, (r, inp), &device)?.to_dtype(dtype)?)?;
            let b = Var::zeros((out, r), dtype, &device)?;
            modules.insert(l.name.clone(), (a.as_tensor().clone(), b.as_tensor().clone()));
        }
        if modules.is_empty() {
            return Err(ModelError::Train(format!("target_modules {:?} match no linear layer", config.targets())));
        }
        self.install_adapter(name, Adapter { config, modules });
        Ok(())
    }

    /// Makes the loaded adapter `name` trainable: its `A` and `B` are copied into fresh `Var`s.
    pub fn make_adapter_trainable(&mut self, name: &str) -> Result<()> {
        if self.merged_adapter() == Some(name) {
            return Err(ModelError::Train(format!("adapter `{name}` is merged; unmerge it before training it")));
        }
        let Some(adapter) = self.lora.adapters.get(name) else {
            return Err(ModelError::Train(format!("no adapter named `{name}` is loaded")));
        };
        let mut modules = BTreeMap::new();
        for (m, (a, b)) in &adapter.modules {
            let master = master_dtype(a.dtype());
            let (a, b) =
                (Var::from_tensor(&a.to_dtype(master)?.copy()?)?, Var::from_tensor(&b.to_dtype(master)?.copy()?)?);
            modules.insert(m.clone(), (a.as_tensor().clone(), b.as_tensor().clone()));
        }
        let config = adapter.config.clone();
        self.install_adapter(name, Adapter { config, modules });
        Ok(())
    }

    /// Sets the LoRA dropout probability of adapter `name` (in `[0, 1)`; used by the training path only).
    pub fn set_adapter_dropout(&mut self, name: &str, p: f64) -> Result<()> {
        TrainCtx::new(p, 0, self.kernels())?;
        let adapter = self
            .lora
            .adapters
            .get_mut(name)
            .ok_or_else(|| ModelError::Train(format!("no adapter named `{name}` is loaded")))?;
        adapter.config.lora_dropout = p;
        Ok(())
    }

    /// The `Var`s of trainable adapter `name`, named `<module>.lora_A` / `<module>.lora_B`
    /// (hub-layout module names), sorted by name.
    pub fn trainable_vars(&self, name: &str) -> Result<Vec<(String, Var)>> {
        let adapter = self
            .lora
            .adapters
            .get(name)
            .ok_or_else(|| ModelError::Train(format!("no adapter named `{name}` is loaded")))?;
        let mut out = Vec::new();
        for (m, (a, b)) in &adapter.modules {
            for (half, t) in [("lora_A", a), ("lora_B", b)] {
                if !t.is_variable() {
                    return Err(ModelError::Train(format!(
                        "adapter `{name}` is not trainable; call make_adapter_trainable first"
                    )));
                }
                out.push((format!("{m}.{half}"), Var::from_tensor(t)?));
            }
        }
        Ok(out)
    }

    /// Every frozen base tensor by checkpoint name (linears, norms, embeddings, lm_head when untied).
    pub fn base_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = self.vision.base_tensors();
        out.extend(self.text.base_tensors());
        for l in self.linears() {
            out.push((format!("{}.weight", l.name), l.weight.clone()));
            if let Some(b) = &l.bias {
                out.push((format!("{}.bias", l.name), b.clone()));
            }
        }
        if !self.cfg.tie_word_embeddings {
            out.push(("lm_head.weight".into(), self.lm_head.clone()));
        }
        out
    }

    /// Whether [`Self::make_base_trainable`] was called: the base weights are `Var`s.
    pub fn base_is_trainable(&self) -> bool {
        self.text.embed_tokens.is_variable()
    }

    /// Full training: turns every base tensor (linears, biases, norms, embeddings, patch embedding,
    /// lm_head) into a `Var`, so that [`Self::loss_and_grads`] also returns their gradients (the training
    /// path then uses candle's matmul, whose backward covers the weight, and the norm ops'
    /// `Params::Trained` variants). A tied lm_head stays the embedding matrix itself.
    pub fn make_base_trainable(&mut self) -> Result<()> {
        if self.base_is_trainable() {
            return Ok(());
        }
        if let Some(m) = self.merged_adapter() {
            return Err(ModelError::Train(format!("adapter `{m}` is merged; unmerge it before full training")));
        }
        let var = |t: &mut Tensor| -> Result<()> {
            *t = Var::from_tensor(t)?.as_tensor().clone();
            Ok(())
        };
        for (_, t) in self.vision.base_tensors_mut() {
            var(t)?;
        }
        for (_, t) in self.text.base_tensors_mut() {
            var(t)?;
        }
        for l in self.linears_mut() {
            var(&mut l.weight)?;
            if let Some(b) = &mut l.bias {
                var(b)?;
            }
        }
        if self.cfg.tie_word_embeddings {
            self.lm_head = self.text.embed_tokens.clone();
        } else {
            var(&mut self.lm_head)?;
        }
        Ok(())
    }

    /// The base `Var`s by checkpoint name (each tensor once), after [`Self::make_base_trainable`].
    pub fn base_vars(&self) -> Result<Vec<(String, Var)>> {
        if !self.base_is_trainable() {
            return Err(ModelError::Train("the base weights are frozen; call make_base_trainable first".into()));
        }
        self.base_tensors().into_iter().map(|(n, t)| Ok((n, Var::from_tensor(&t)?))).collect()
    }

    /// The base weights under the family's checkpoint keys ([`crate::Arch::checkpoint_key`]; the patch
    /// embedding back in its 5-D conv shape); with adapters unmerged these are the weights the model was
    /// loaded with or trained to.
    pub fn base_checkpoint_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let v = &self.cfg.vision;
        let conv = [v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size];
        let arch = self.cfg.arch;
        self.base_tensors()
            .into_iter()
            .map(|(n, t)| match n.as_str() {
                "visual.patch_embed.proj.weight" => Ok((arch.checkpoint_key(&n), t.reshape(conv.as_slice())?)),
                _ => Ok((arch.checkpoint_key(&n), t)),
            })
            .collect()
    }

    /// Writes the base weights as `dir/model.safetensors` (see [`Self::base_checkpoint_tensors`]); the
    /// caller copies config.json and the tokenizer files beside it.
    pub fn save_base(&self, dir: &Path) -> Result<()> {
        if let Some(m) = self.merged_adapter() {
            return Err(ModelError::Train(format!("adapter `{m}` is merged; unmerge it before saving the base")));
        }
        write_checkpoint(&self.base_checkpoint_tensors()?, dir)
    }

    /// One training step's forward and backward over `batch` with the active adapter: the masked
    /// next-token cross-entropy (the mean over every supervised token of the batch, as transformers'
    /// `labels` with -100 elsewhere) and the gradients of the adapter's `Var`s, and of nothing else.
    /// With `opts.checkpointing` every vision block and decoder layer is recomputed in the backward
    /// ([`crate::recompute`]); the result is the same.
    pub fn loss_and_grads(&self, batch: &[TrainExample], opts: &StepOptions) -> Result<StepOutput> {
        let mut params: Vec<Var> = match self.active_adapter() {
            Some(name) => self.trainable_vars(name)?.into_iter().map(|(_, v)| v).collect(),
            None => vec![],
        };
        if self.base_is_trainable() {
            params.extend(self.base_vars()?.into_iter().map(|(_, v)| v));
        }
        let mut ctx = self.train_ctx(opts.dropout_seed)?;
        ctx.vision_rows = opts.vision_rows;
        let head = Head::Loss { region_weight: opts.region_weight, region_layer: opts.region_layer };
        let chain = self.train_chain(batch, &ctx, opts.pack, head)?;
        let (loss, grads) =
            recompute::forward_backward(&chain.x0, &chain.stages, &params, (opts.checkpointing, Some(&ctx.memo)))?;
        Ok(StepOutput {
            loss: loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            supervised_tokens: chain.supervised,
            grads,
        })
    }

    /// The loss of [`Self::loss_and_grads`] as one candle graph (no checkpointing), for a caller that
    /// runs `backward` itself and wants candle's whole `GradStore` (tests and the memory benchmark look
    /// in it for gradients of base weights).
    pub fn loss(&self, batch: &[TrainExample], dropout_seed: u64) -> Result<Tensor> {
        let ctx = self.train_ctx(dropout_seed)?;
        let chain = self.train_chain(batch, &ctx, false, Head::PLAIN_LOSS)?;
        recompute::graph(&chain.x0, &chain.stages)
    }

    /// The loss of [`Self::loss_and_grads`] without any gradient (e.g. a validation loss): no graph
    /// outlives a stage. Dropout is off. Returns the mean loss and the number of supervised tokens.
    pub fn eval_loss(&self, batch: &[TrainExample]) -> Result<(f64, usize)> {
        let ctx = TrainCtx::new(0.0, 0, self.kernels())?;
        let chain = self.train_chain(batch, &ctx, false, Head::PLAIN_LOSS)?;
        let loss = recompute::forward_loss(&chain.x0, &chain.stages)?;
        Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, chain.supervised))
    }

    /// The training forward's logits of each sequence of `batch`, `(n_i, V)` for sequence `i` of `n_i`
    /// tokens (row `j` predicts token `j + 1`), with dropout off and no gradient; `pack` lays the batch
    /// out as [`StepOptions::pack`] does. A sequence's logits do not depend on the others it is batched
    /// or packed with (`tests/packing.rs`).
    pub fn train_logits(&self, batch: &[TrainExample], pack: bool) -> Result<Vec<Tensor>> {
        let ctx = TrainCtx::new(0.0, 0, self.kernels())?;
        let chain = self.train_chain(batch, &ctx, pack, Head::Logits)?;
        let (logits, _) = recompute::forward(&chain.x0, &chain.stages)?;
        Ok(chain
            .starts
            .iter()
            .zip(batch)
            .map(|(&s, e)| logits.narrow(0, s, e.ids.len()))
            .collect::<candle_core::Result<_>>()?)
    }

    fn train_ctx(&self, seed: u64) -> Result<TrainCtx> {
        if let Some(m) = self.merged_adapter() {
            return Err(ModelError::Train(format!("adapter `{m}` is merged; unmerge it before training")));
        }
        let p = self.active_adapter().and_then(|a| self.adapter(a)).map(|a| a.config.lora_dropout).unwrap_or(0.0);
        let mut ctx = TrainCtx::new(p, seed, self.kernels())?;
        ctx.full = self.base_is_trainable();
        Ok(ctx)
    }

    /// The training forward of `batch` as a chain of stages: the vision blocks, the merger with the
    /// embedding, the decoder layers, and `head` (the loss, or the logits). The sequences are laid out by
    /// [`Rows::new`]: right-padded to the longest, or packed back to back. With `region = (weight, layer)`
    /// and a positive weight, decoder layer `layer` adds the weighted mean loss of the batch's region
    /// targets as a side loss.
    fn train_chain<'a>(
        &'a self,
        batch: &[TrainExample],
        ctx: &'a TrainCtx,
        pack: bool,
        head: Head,
    ) -> Result<Chain<'a>> {
        let region_weight = match head {
            Head::Loss { region_weight, .. } => region_weight,
            Head::Logits => 0.0,
        };
        let rows = Rows::new(batch, pack, region_weight > 0.0, &self.cfg)?;
        let (b, t) = (rows.b, rows.t);
        let supervised = rows.mask.iter().filter(|&&m| m > 0.0).count();
        if supervised == 0 && matches!(head, Head::Loss { .. }) {
            return Err(ModelError::Train("no token of the batch is supervised (labels_mask is all false)".into()));
        }
        let dev = &self.device;
        let pos = Tensor::from_vec(rows.pos, (3, b, t), &candle_core::Device::Cpu)?;
        let rope = std::rc::Rc::new(self.text.rope(&pos, self.dtype(), dev)?);
        let ids = Tensor::from_vec(rows.ids, (b, t), dev)?;
        // The loss reads only the supervised rows: the head's GEMMs and softmax skip the prompt and padding.
        let (sup_rows, sup_labels): (Vec<u32>, Vec<u32>) =
            (0..b * t).filter(|&r| rows.mask[r] > 0.0).map(|r| (r as u32, rows.labels[r])).unzip();
        let sup = (
            Tensor::from_vec(sup_rows, supervised, dev)?,
            Tensor::from_vec(sup_labels, supervised, dev)?,
            Tensor::ones(supervised, DType::F32, dev)?,
        );
        let region = match rows.region_rows.len() {
            0 => None,
            k => Some((
                Tensor::from_vec(rows.region_rows, k, dev)?,
                Tensor::from_vec(rows.region_labels, k, dev)?,
                Tensor::ones(k, DType::F32, dev)?,
            )),
        };
        let cu = std::rc::Rc::new(rows.cu);
        let full = ctx.full;
        let trainable =
            |ls: Vec<&Linear>| full || ls.iter().any(|l| l.lora.active_delta().is_some_and(|d| d.a.is_variable()));

        let mut stages = Vec::new();
        let x0 = self.embed_stages(&mut stages, &ids, (rows.pixels, &rows.grids), ctx, trainable)?;
        // The LM head over (N, H) hidden rows.
        let lm_head = move |h: &Tensor| -> Result<Tensor> {
            Ok(match full {
                true => matmul_t(h, &self.lm_head)?,
                false => ctx.frozen_linear(h, &self.lm_head)?,
            })
        };
        // The mean cross-entropy of (N, H) rows through the head: fused in row chunks (no (N, V) logits),
        // or the full logits and the reference cross-entropy under `--kernels reference`.
        let head_loss = move |h: &Tensor, labels: &Tensor, ones: &Tensor| -> Result<Tensor> {
            Ok(match ctx.reference() {
                true => ctx.cross_entropy(&lm_head(h)?, labels, ones)?,
                false => askgui_kernels::ops::linear_cross_entropy(h, &self.lm_head, labels, None)?,
            })
        };
        let region_at = match head {
            Head::Loss { region_layer, .. } => region_layer.clamp(1, self.text.depth()) - 1,
            Head::Logits => usize::MAX,
        };
        let mut region = region;
        for i in 0..self.text.depth() {
            let (rope, cu) = (rope.clone(), cu.clone());
            let has_params = trainable(self.text.layer_linears(i));
            match region.take_if(|_| i == region_at) {
                Some((rows, labels, ones)) => stages.push(Stage::with_side_loss(has_params, move |x: &Tensor| {
                    let y = self.text.layer(i, x, (&rope, decoder_mask(cu.as_deref())), None, None, Some(ctx))?;
                    // (B, T, H) -> (B T, H) -> (K, H): the region rows, through the final norm and the head
                    // (DeepStack features still carried beside them left out).
                    let h = y.narrow(2, 0, self.cfg.text.hidden_size)?.reshape((b * t, ()))?.index_select(&rows, 0)?;
                    let side = (head_loss(&self.text.final_norm(&h, Some(ctx))?, &labels, &ones)? * region_weight)?;
                    Ok((y, side))
                })),
                None => stages.push(Stage::new(has_params, move |x: &Tensor| {
                    self.text.layer(i, x, (&rope, decoder_mask(cu.as_deref())), None, None, Some(ctx))
                })),
            }
        }
        stages.push(Stage::new(full, move |x: &Tensor| {
            // (B, T, H) -> (B T, H): row r's logits predict the next token of r's own sequence.
            let h = x.reshape((b * t, ()))?;
            match head {
                Head::Loss { .. } => {
                    // (B T, H) -> (S, H): the supervised rows alone, through the head in chunks.
                    let (rows, labels, ones) = &sup;
                    head_loss(&self.text.final_norm(&h.index_select(rows, 0)?, Some(ctx))?, labels, ones)
                }
                Head::Logits => Ok(lm_head(&self.text.final_norm(&h, Some(ctx))?)?),
            }
        }));
        Ok(Chain { x0, stages, supervised, starts: rows.starts })
    }

    /// The stages before the decoder: the vision blocks and the merger spliced into the token embeddings
    /// (or the embeddings alone for text), and a first stage that recomputes a trained embedding or patch
    /// embedding. Returns the chain's input.
    fn embed_stages<'a>(
        &'a self,
        stages: &mut Vec<Stage<'a>>,
        ids: &Tensor,
        (pixels, grids): (Vec<Tensor>, &[[usize; 3]]),
        ctx: &'a TrainCtx,
        trainable: impl Fn(Vec<&Linear>) -> bool,
    ) -> Result<Tensor> {
        let full = ctx.full;
        if pixels.is_empty() {
            if full {
                // The embedding is trained: a first stage that ignores its (constant) input recomputes it.
                let ids = ids.clone();
                stages.push(Stage::new(true, move |_: &Tensor| self.embed(&ids, None)));
            }
            return Ok(self.embed(ids, None)?.detach());
        }
        let pv = Tensor::cat(&pixels, 0)?;
        let prep = std::rc::Rc::new(self.vision.prepare(&pv, grids)?);
        let x0 = prep.x.detach();
        if full {
            // The patch embedding is trained: recompute it in a first stage (`prepare` is outside the chain).
            let prep = prep.clone();
            stages.push(Stage::new(true, move |_: &Tensor| self.vision.embed_patches(&pv, &prep.layout)));
        }
        // Each block runs frame range by frame range: with checkpointing, its graph holds one range.
        let ranges = prep.frame_ranges(ctx.vision_rows);
        for i in 0..self.vision.depth() {
            let prep = prep.clone();
            let f = move |r: &Range<usize>, x: &Tensor| {
                self.vision.block_rows(i, x, &prep, r, Some(&ctx.for_rows(r.start)))
            };
            stages.push(Stage::rowwise(trainable(self.vision.stage_linears(i)), ranges.clone(), f));
        }
        let ids = ids.clone();
        stages.push(Stage::new(trainable(self.vision.stage_linears(self.vision.depth())), move |x: &Tensor| {
            let feats = self.vision.merge(x, &prep, Some(ctx))?;
            self.embed(&ids, Some(&feats))
        }));
        Ok(x0)
    }

    /// Puts `adapter` under `name` into the model state and every targeted linear's slot.
    fn install_adapter(&mut self, name: &str, adapter: Adapter) {
        let scale = adapter.config.scale();
        for l in self.linears_mut() {
            if let Some((a, b)) = adapter.modules.get(&l.name) {
                l.lora.adapters.insert(name.to_string(), LoraDelta { a: a.clone(), b: b.clone(), scale });
            }
        }
        self.lora.adapters.insert(name.to_string(), adapter);
    }
}
