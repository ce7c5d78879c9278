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
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub use crate::adapter_slot::master_dtype;
use crate::adapter_slot::LoraDelta;
use crate::error::{ModelError, Result};
use crate::layers::{matmul_t, Linear};
use crate::model::{mrope_positions, Qwen2Vl};
use crate::peft::{matches_target, Adapter, LoraConfig};
use crate::random_init::write_checkpoint;
use crate::recompute::{self, Stage};
use crate::train_ops::TrainCtx;

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
}

impl Default for StepOptions {
    fn default() -> Self {
        Self { checkpointing: true, dropout_seed: 0, region_weight: 0.0, region_layer: 1 }
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

    /// The base weights in the hub layout (the patch embedding back in its 5-D conv shape); with adapters
    /// unmerged these are the weights the model was loaded with or trained to.
    pub fn base_checkpoint_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let v = &self.cfg.vision;
        let conv = [v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size];
        self.base_tensors()
            .into_iter()
            .map(|(n, t)| match n.as_str() {
                "visual.patch_embed.proj.weight" => Ok((n, t.reshape(conv.as_slice())?)),
                _ => Ok((n, t)),
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
        let ctx = self.train_ctx(opts.dropout_seed)?;
        let chain = self.train_chain(batch, &ctx, (opts.region_weight, opts.region_layer))?;
        let (loss, grads) = recompute::forward_backward(&chain.x0, &chain.stages, &params, opts.checkpointing)?;
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
        let chain = self.train_chain(batch, &ctx, (0.0, 0))?;
        recompute::graph(&chain.x0, &chain.stages)
    }

    /// The loss of [`Self::loss_and_grads`] without any gradient (e.g. a validation loss): no graph
    /// outlives a stage. Dropout is off. Returns the mean loss and the number of supervised tokens.
    pub fn eval_loss(&self, batch: &[TrainExample]) -> Result<(f64, usize)> {
        let ctx = TrainCtx::new(0.0, 0, self.kernels())?;
        let chain = self.train_chain(batch, &ctx, (0.0, 0))?;
        let loss = recompute::forward_loss(&chain.x0, &chain.stages)?;
        Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, chain.supervised))
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
    /// embedding, the decoder layers, and the head with the loss. Sequences are right-padded to the
    /// longest: with causal attention a real token never sees a pad, so no padding mask is needed, and the
    /// pads are not supervised. With `region = (weight, layer)` and a positive weight, decoder layer
    /// `layer` adds the weighted mean loss of the batch's region targets as a side loss.
    fn train_chain<'a>(
        &'a self,
        batch: &[TrainExample],
        ctx: &'a TrainCtx,
        (region_weight, region_layer): (f64, usize),
    ) -> Result<Chain<'a>> {
        let (b, t) = (batch.len(), batch.iter().map(|e| e.ids.len()).max().unwrap_or(0));
        if b == 0 {
            return Err(ModelError::Train("the batch is empty".into()));
        }
        let mut ids = vec![0u32; b * t];
        let mut labels = vec![0u32; b * (t - 1)];
        let mut mask = vec![0f32; b * (t - 1)];
        // Region targets: rows of the flattened (B T) hidden states and their tokens.
        let (mut region_rows, mut region_labels) = (Vec::new(), Vec::new());
        let mut positions = Vec::with_capacity(b);
        let (mut pixels, mut grids) = (vec![], vec![]);
        for (i, e) in batch.iter().enumerate() {
            let n = e.ids.len();
            if e.labels_mask.len() != n || n < 2 {
                return Err(ModelError::Train(format!(
                    "sequence {i}: {n} tokens and {} mask entries; they must be equal and at least 2",
                    e.labels_mask.len()
                )));
            }
            ids[i * t..i * t + n].copy_from_slice(&e.ids);
            for j in 1..n {
                labels[i * (t - 1) + j - 1] = e.ids[j];
                mask[i * (t - 1) + j - 1] = e.labels_mask[j] as u8 as f32;
            }
            if region_weight > 0.0 {
                for &(p, tok) in &e.region_targets {
                    if p >= n {
                        return Err(ModelError::Train(format!(
                            "sequence {i}: a region target at position {p} is past its {n} tokens"
                        )));
                    }
                    region_rows.push((i * t + p) as u32);
                    region_labels.push(tok);
                }
            }
            let (mut pos, _) = mrope_positions(&e.ids, &e.grid_thw, &self.cfg)?;
            pos.resize(t, [0; 3]);
            positions.push(pos);
            match (&e.pixel_values, e.grid_thw.is_empty()) {
                (Some(pv), false) => pixels.push(pv.clone()),
                (None, true) => {}
                _ => {
                    return Err(ModelError::Train(format!(
                        "sequence {i}: pixel_values and grid_thw must be given together"
                    )))
                }
            }
            grids.extend_from_slice(&e.grid_thw);
        }
        let supervised = mask.iter().filter(|&&m| m > 0.0).count();
        if supervised == 0 {
            return Err(ModelError::Train("no token of the batch is supervised (labels_mask is all false)".into()));
        }
        let dev = &self.device;
        // Positions were padded at the right: (3, B, T) from [B][T][3].
        let mut pos = vec![0f32; 3 * b * t];
        for (i, p) in positions.iter().enumerate() {
            for (j, xyz) in p.iter().enumerate() {
                for (a, &v) in xyz.iter().enumerate() {
                    pos[(a * b + i) * t + j] = v as f32;
                }
            }
        }
        let rope = self.text.rope(&Tensor::from_vec(pos, (3, b, t), &candle_core::Device::Cpu)?, self.dtype(), dev)?;
        let ids = Tensor::from_vec(ids, (b, t), dev)?;
        let labels = Tensor::from_vec(labels, b * (t - 1), dev)?;
        let mask = Tensor::from_vec(mask, b * (t - 1), dev)?;
        let region = match region_rows.len() {
            0 => None,
            k => Some((
                Tensor::from_vec(region_rows, k, dev)?,
                Tensor::from_vec(region_labels, k, dev)?,
                Tensor::ones(k, DType::F32, dev)?,
            )),
        };
        let region_at = region_layer.clamp(1, self.text.depth()) - 1;
        let full = ctx.full;
        let trainable =
            |ls: Vec<&Linear>| full || ls.iter().any(|l| l.lora.active_delta().is_some_and(|d| d.a.is_variable()));

        let mut stages = Vec::new();
        let x0 = if pixels.is_empty() {
            if full {
                // The embedding is trained: a first stage that ignores its (constant) input recomputes it.
                let ids = ids.clone();
                stages.push(Stage::new(true, move |_: &Tensor| self.embed(&ids, None)));
            }
            self.embed(&ids, None)?.detach()
        } else {
            let pv = Tensor::cat(&pixels, 0)?;
            let prep = std::rc::Rc::new(self.vision.prepare(&pv, &grids)?);
            let x0 = prep.x.detach();
            if full {
                // The patch embedding is trained: recompute it in a first stage (`prepare` is outside the chain).
                let prep = prep.clone();
                stages.push(Stage::new(true, move |_: &Tensor| self.vision.embed_patches(&pv, &prep.layout)));
            }
            for i in 0..self.vision.depth() {
                let prep = prep.clone();
                stages.push(Stage::new(trainable(self.vision.stage_linears(i)), move |x: &Tensor| {
                    self.vision.block(i, x, &prep, Some(ctx))
                }));
            }
            let ids = ids.clone();
            stages.push(Stage::new(trainable(self.vision.stage_linears(self.vision.depth())), move |x: &Tensor| {
                let feats = self.vision.merge(x, &prep, Some(ctx))?;
                self.embed(&ids, Some(&feats))
            }));
            x0
        };
        let rope = std::rc::Rc::new(rope);
        // The LM head over (N, H) hidden rows.
        let head = move |h: &Tensor| -> Result<Tensor> {
            Ok(match full {
                true => matmul_t(h, &self.lm_head)?,
                false => ctx.frozen_linear(h, &self.lm_head)?,
            })
        };
        let mut region = region;
        for i in 0..self.text.depth() {
            let rope = rope.clone();
            let has_params = trainable(self.text.layer_linears(i));
            match region.take_if(|_| i == region_at) {
                Some((rows, labels, ones)) => stages.push(Stage::with_side_loss(has_params, move |x: &Tensor| {
                    let y = self.text.layer(i, x, &rope, None, None, Some(ctx))?;
                    // (B, T, H) -> (B T, H) -> (K, H): the region rows, through the final norm and the head.
                    let h = y.reshape((b * t, ()))?.index_select(&rows, 0)?;
                    let logits = head(&self.text.final_norm(&h, Some(ctx))?)?;
                    let side = (ctx.cross_entropy(&logits, &labels, &ones)? * region_weight)?;
                    Ok((y, side))
                })),
                None => stages.push(Stage::new(has_params, move |x: &Tensor| {
                    self.text.layer(i, x, &rope, None, None, Some(ctx))
                })),
            }
        }
        stages.push(Stage::new(full, move |x: &Tensor| {
            // (B, T, H) -> (B, T - 1, H) -> (B (T - 1), V): the logits at t - 1 predict token t.
            let h = self.text.final_norm(x, Some(ctx))?.narrow(1, 0, t - 1)?.reshape((b * (t - 1), ()))?;
            Ok(ctx.cross_entropy(&head(&h)?, &labels, &mask)?)
        }));
        Ok(Chain { x0, stages, supervised })
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
