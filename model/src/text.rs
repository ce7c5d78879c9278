//! The text decoder of every family: Qwen2 or Qwen3 layers with multimodal rotary positions (M-RoPE),
//! GQA and a KV cache.
//!
//! `embeds (B, T, W)` and `positions (3, B, T)` in, hidden states `(B, T, H)` out. Each block is pre-norm:
//! `x + attn(rms(x))`, then `x + mlp(rms(x))` with a SwiGLU MLP. Qwen2's q/k/v projections carry biases;
//! Qwen3's do not, and normalise q and k per head (RMSNorm over `head_dim`) before the rotation. The
//! family's pieces are flags of [`TextConfig`]. DeepStack (Qwen3-VL): the rows carry `W - H` more columns
//! beside the hidden states, the vision features of earlier blocks (zeros on text rows); layer `i` adds the
//! first `H` of them to its output and passes the rest on, so after the last such layer the rows are
//! `(B, T, H)` again. The cache holds keys and values after rotation, so decoding a token costs one row of
//! attention per layer.

use askgui_kernels::{mrope_cos_sin_reference, mrope_interleaved_cos_sin_reference, AttentionMask};
use candle_core::{DType, Device, Tensor};

use crate::adapter_slot::RowAdapters;
use crate::config::{TextConfig, VisionAct};
use crate::device::KernelChoice;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::layers::Linear;
use crate::train_ops::TrainCtx;
use crate::weights::Weights;

struct Layer {
    input_norm: Tensor,
    post_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
    /// Qwen3's per-head RMSNorm weights `(head_dim,)` for q and k.
    qk_norm: Option<(Tensor, Tensor)>,
}

/// One packed sequence's new rows: a continuation of its cache, or forks of it.
#[derive(Clone, Copy, Debug)]
pub enum NewRows<'a> {
    /// `n` rows after the cache, appended to it.
    Append(usize),
    /// Runs of rows (`forks[f]` each) that each continue the cache alone and are not appended to it: the
    /// options of a constrained choice, scored in one attention call per layer. Row `t` of a run sees the
    /// cache and its own run's rows up to `t`.
    Forks(&'a [usize]),
}

impl NewRows<'_> {
    pub fn len(&self) -> usize {
        match self {
            NewRows::Append(n) => *n,
            NewRows::Forks(f) => f.iter().sum(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// New rows of a sequence up to which its attention reads the cache's blocks in place (a decode step, a
/// few fed tokens); longer runs (prefills) concatenate the blocks and take the GEMM-based attention.
const PAGED_ROWS: usize = 4;

pub struct TextDecoder {
    cfg: TextConfig,
    pub embed_tokens: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    inv_freq: Tensor,
    /// The ops of the inference path; the training path takes them from its [`TrainCtx`].
    pub(crate) kernels: KernelChoice,
}

impl TextDecoder {
    pub fn load(w: &Weights, cfg: &TextConfig) -> Result<Self> {
        let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
        let (nq, nkv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let n = format!("model.layers.{l}");
            layers.push(Layer {
                input_norm: w.get(&format!("{n}.input_layernorm.weight"), &[h])?,
                post_norm: w.get(&format!("{n}.post_attention_layernorm.weight"), &[h])?,
                q: Linear::load(w, &format!("{n}.self_attn.q_proj"), h, nq, cfg.qkv_bias)?,
                k: Linear::load(w, &format!("{n}.self_attn.k_proj"), h, nkv, cfg.qkv_bias)?,
                v: Linear::load(w, &format!("{n}.self_attn.v_proj"), h, nkv, cfg.qkv_bias)?,
                o: Linear::load(w, &format!("{n}.self_attn.o_proj"), nq, h, false)?,
                gate: Linear::load(w, &format!("{n}.mlp.gate_proj"), h, i, false)?,
                up: Linear::load(w, &format!("{n}.mlp.up_proj"), h, i, false)?,
                down: Linear::load(w, &format!("{n}.mlp.down_proj"), i, h, false)?,
                qk_norm: match cfg.qk_norm {
                    true => Some((
                        w.get(&format!("{n}.self_attn.q_norm.weight"), &[hd])?,
                        w.get(&format!("{n}.self_attn.k_norm.weight"), &[hd])?,
                    )),
                    false => None,
                },
            });
        }
        let inv = askgui_kernels::rope::inv_freq(hd, cfg.rope_theta);
        Ok(Self {
            cfg: cfg.clone(),
            embed_tokens: w.get("model.embed_tokens.weight", &[cfg.vocab_size, h])?,
            layers,
            norm: w.get("model.norm.weight", &[h])?,
            inv_freq: Tensor::new(inv.as_slice(), &Device::Cpu)?,
            kernels: KernelChoice::default(),
        })
    }

    /// Every linear layer of the decoder, for LoRA.
    pub(crate) fn linears(&self) -> Vec<&Linear> {
        self.layers.iter().flat_map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]).collect()
    }

    /// [`Self::linears`], mutable (same order).
    pub(crate) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out = Vec::new();
        for l in &mut self.layers {
            out.extend([&mut l.q, &mut l.k, &mut l.v, &mut l.o, &mut l.gate, &mut l.up, &mut l.down]);
        }
        out
    }

    /// The decoder's base (non-linear) tensors: embedding and norm weights, for [`crate::train`].
    pub(crate) fn base_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), self.embed_tokens.clone())];
        for (i, l) in self.layers.iter().enumerate() {
            out.push((format!("model.layers.{i}.input_layernorm.weight"), l.input_norm.clone()));
            out.push((format!("model.layers.{i}.post_attention_layernorm.weight"), l.post_norm.clone()));
            if let Some((q, k)) = &l.qk_norm {
                out.push((format!("model.layers.{i}.self_attn.q_norm.weight"), q.clone()));
                out.push((format!("model.layers.{i}.self_attn.k_norm.weight"), k.clone()));
            }
        }
        out.push(("model.norm.weight".to_string(), self.norm.clone()));
        out
    }

    /// [`Self::base_tensors`], mutable (same order), for full training.
    pub(crate) fn base_tensors_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        let mut out = vec![("model.embed_tokens.weight".to_string(), &mut self.embed_tokens)];
        for (i, l) in self.layers.iter_mut().enumerate() {
            out.push((format!("model.layers.{i}.input_layernorm.weight"), &mut l.input_norm));
            out.push((format!("model.layers.{i}.post_attention_layernorm.weight"), &mut l.post_norm));
            if let Some((q, k)) = &mut l.qk_norm {
                out.push((format!("model.layers.{i}.self_attn.q_norm.weight"), q));
                out.push((format!("model.layers.{i}.self_attn.k_norm.weight"), k));
            }
        }
        out.push(("model.norm.weight".to_string(), &mut self.norm));
        out
    }

    pub fn new_cache(&self) -> KvCache {
        let mut cache = KvCache::default();
        cache.fit(self.layers.len());
        cache
    }

    /// Token embeddings `(B, T) -> (B, T, H)`.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let (b, t) = ids.dims2()?;
        Ok(self.embed_tokens.index_select(&ids.flatten_all()?, 0)?.reshape((b, t, self.cfg.hidden_size))?)
    }

    /// Runs the decoder over new positions, appending to `cache`.
    ///
    /// `positions (3, B, T)` f32; `key_padding (B, T_cached + T)` marks real tokens with 1 (None: all real).
    pub fn forward(
        &self,
        embeds: &Tensor,
        positions: &Tensor,
        key_padding: Option<&Tensor>,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        self.forward_with(embeds, positions, key_padding, cache, None)
    }

    /// [`Self::forward`], or with `train` its training twin: the same function built from the kernels'
    /// CustomOps (frozen linears and norms, attention and rope with explicit backward) so that only the
    /// LoRA parameters get gradients ([`crate::train`]).
    pub(crate) fn forward_with(
        &self,
        embeds: &Tensor,
        positions: &Tensor,
        key_padding: Option<&Tensor>,
        cache: &mut KvCache,
        train: Option<&TrainCtx>,
    ) -> Result<Tensor> {
        let rope = self.rope(positions, embeds.dtype(), embeds.device())?;
        let mut x = embeds.clone();
        cache.fit(self.layers.len());
        for i in 0..self.layers.len() {
            x = self.layer(i, &x, (&rope, AttentionMask::Causal), key_padding, Some(&mut *cache), train)?;
        }
        self.final_norm(&x, train)
    }

    /// Several sequences in one pass: `embeds (1, N, H)` is their new tokens back to back (`rows[i]` of
    /// sequence `i`, `N` in all), `positions (3, 1, N)` likewise, and `caches[i]` is sequence `i`'s cache.
    /// Norms, projections and MLPs run once over all `N` rows (one GEMM per weight instead of one per
    /// sequence: on a CPU the weights are read once per step, not once per sequence); only attention is
    /// per sequence, over its own cache. Each sequence's rows come out exactly as [`Self::forward`] would
    /// give them alone, up to float reassociation in the GEMMs.
    pub fn forward_packed(
        &self,
        embeds: &Tensor,
        positions: &Tensor,
        rows: &[NewRows],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        self.forward_packed_rows(embeds, positions, rows, caches, None)
    }

    /// [`Self::forward_packed`] with each row's own LoRA adapter (`adapters` over the `N` rows; None: the
    /// active adapter for all), so that one pass mixes sequences of different adapters.
    pub fn forward_packed_rows(
        &self,
        embeds: &Tensor,
        positions: &Tensor,
        rows: &[NewRows],
        caches: &mut [&mut KvCache],
        adapters: Option<&RowAdapters>,
    ) -> Result<Tensor> {
        let rope = self.rope(positions, embeds.dtype(), embeds.device())?;
        let mut x = embeds.clone();
        caches.iter_mut().for_each(|c| c.fit(self.layers.len()));
        for i in 0..self.layers.len() {
            x = self.layer_packed(i, &x, &rope, (rows, adapters), caches)?;
        }
        self.final_norm(&x, None)
    }

    /// Number of decoder layers.
    pub(crate) fn depth(&self) -> usize {
        self.layers.len()
    }

    /// The seven linears of layer `i`, for [`crate::train`].
    pub(crate) fn layer_linears(&self, i: usize) -> Vec<&Linear> {
        let l = &self.layers[i];
        vec![&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down]
    }

    /// M-RoPE tables for `positions (3, B, T)`: `(cos, sin)`, each `(B, 1, T, hd)`, shared by all layers.
    pub(crate) fn rope(&self, positions: &Tensor, dtype: DType, dev: &Device) -> Result<(Tensor, Tensor)> {
        let (pos, sections) = (positions.to_device(&Device::Cpu)?, &self.cfg.mrope_section);
        let (cos, sin) = match self.cfg.mrope_interleaved {
            true => mrope_interleaved_cos_sin_reference(&pos, &self.inv_freq, sections)?,
            false => mrope_cos_sin_reference(&pos, &self.inv_freq, sections)?,
        };
        let cos = cos.to_device(dev)?.to_dtype(dtype)?.unsqueeze(1)?;
        let sin = sin.to_device(dev)?.to_dtype(dtype)?.unsqueeze(1)?;
        Ok((cos, sin))
    }

    /// Layer `i`: `x (B, T, W) -> (B, T, W - H)` (or `(B, T, H)` when no DeepStack features are
    /// carried): [`Self::block`] over the hidden states, then the first carried feature set added to them.
    pub(crate) fn layer(
        &self,
        i: usize,
        x: &Tensor,
        rope_mask: (&(Tensor, Tensor), AttentionMask),
        key_padding: Option<&Tensor>,
        cache: Option<&mut KvCache>,
        train: Option<&TrainCtx>,
    ) -> Result<Tensor> {
        let (h, carried) = self.split_carried(x)?;
        let y = self.block(i, &h, rope_mask, key_padding, cache, train)?;
        self.add_carried(y, carried)
    }

    /// `x (B, T, W)` -> the hidden states `(B, T, H)` and the DeepStack features carried beside them.
    fn split_carried(&self, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let (h, w) = (self.cfg.hidden_size, x.dim(2)?);
        match w > h {
            true => Ok((x.narrow(2, 0, h)?, Some(x.narrow(2, h, w - h)?))),
            false => Ok((x.clone(), None)),
        }
    }

    /// A layer's output `y (B, T, H)` plus the first carried feature set, with the rest carried on.
    fn add_carried(&self, y: Tensor, carried: Option<Tensor>) -> Result<Tensor> {
        let Some(c) = carried else { return Ok(y) };
        let h = self.cfg.hidden_size;
        let y = (y + c.narrow(2, 0, h)?)?;
        match c.dim(2)? > h {
            true => Ok(Tensor::cat(&[&y, &c.narrow(2, h, c.dim(2)? - h)?], 2)?),
            false => Ok(y),
        }
    }

    /// Decoder block `i`: `x (B, T, H) -> (B, T, H)`, attention under `mask` then MLP, both pre-norm and
    /// residual. With a `cache` the block appends its keys and values to it and attends over all of them.
    /// The training path passes a causal block-diagonal mask for packed sequences (`B == 1`).
    fn block(
        &self,
        i: usize,
        x: &Tensor,
        (rope, mask): (&(Tensor, Tensor), AttentionMask),
        key_padding: Option<&Tensor>,
        cache: Option<&mut KvCache>,
        train: Option<&TrainCtx>,
    ) -> Result<Tensor> {
        let (q, mut k, mut v) = self.qkv(i, x, rope, train, None)?;
        let scale = (self.cfg.head_dim() as f64).powf(-0.5);
        if let Some(cache) = cache {
            let past = cache.layer_len(i);
            cache.append(i, &k, &v)?;
            let plain = train.is_none() && key_padding.is_none() && matches!(mask, AttentionMask::Causal);
            if plain && self.reads_paged(&q, past)? {
                let o = askgui_kernels::ops::paged_attention(&q, &cache.blocks(i), scale)?;
                return self.attn_out_mlp(i, x, &o, None, None);
            }
            if past > 0 {
                (k, v) = cache.keys_values(i)?;
            }
        }
        let o = match train {
            None => crate::layers::attention(&q, &k, &v, mask, key_padding, scale, self.kernels)?,
            Some(ctx) => ctx.attention((&q, &k, &v), mask, key_padding, scale)?,
        };
        self.attn_out_mlp(i, x, &o, train, None)
    }

    /// [`Self::layer`] over packed sequences (see [`Self::forward_packed_rows`]): `x (1, N, H)`.
    fn layer_packed(
        &self,
        i: usize,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        (rows, adapters): (&[NewRows], Option<&RowAdapters>),
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let (x, carried) = self.split_carried(x)?;
        let (q, k, v) = self.qkv(i, &x, rope, None, adapters)?;
        let scale = (self.cfg.head_dim() as f64).powf(-0.5);
        let mut outs = Vec::with_capacity(rows.len());
        let mut start = 0;
        for (new, cache) in rows.iter().zip(caches.iter_mut()) {
            // (1, n, N, hd) -> this sequence's (1, n, len, hd)
            let len = new.len();
            let part = |t: &Tensor| t.narrow(2, start, len);
            let (q, k, v) = (part(&q)?, part(&k)?, part(&v)?);
            outs.push(match *new {
                NewRows::Append(_) => self.appended_attention(i, &q, (k, v), cache, scale)?,
                NewRows::Forks(forks) => {
                    let blocks = cache.blocks(i);
                    match self.paged_kernels(&q) {
                        true => askgui_kernels::ops::paged_attention_forks(&q, &blocks, (&k, &v), forks, scale)?,
                        false => {
                            askgui_kernels::ops::paged_attention_forks_reference(&q, &blocks, (&k, &v), forks, scale)?
                        }
                    }
                }
            });
            start += len;
        }
        let y = self.attn_out_mlp(i, &x, &Tensor::cat(&outs, 2)?, None, adapters)?;
        self.add_carried(y, carried)
    }

    /// One sequence's attention in layer `i` after appending its new keys and values to `cache`:
    /// `q (1, nh, T, hd)` over the cache's blocks in place for a few rows, else over them concatenated.
    fn appended_attention(
        &self,
        i: usize,
        q: &Tensor,
        (k, v): (Tensor, Tensor),
        cache: &mut KvCache,
        scale: f64,
    ) -> Result<Tensor> {
        let past = cache.layer_len(i);
        cache.append(i, &k, &v)?;
        if self.reads_paged(q, past)? {
            return Ok(askgui_kernels::ops::paged_attention(q, &cache.blocks(i), scale)?);
        }
        // A first prefill attends over its own keys: the cache need not be read back.
        let (k, v) = if past == 0 { (k, v) } else { cache.keys_values(i)? };
        Ok(crate::layers::attention(q, &k, &v, AttentionMask::Causal, None, scale, self.kernels)?)
    }

    /// Whether the attention of `q (B, nh, T, hd)` reads its layer's cache blocks in place (after `past`
    /// cached positions): a few new rows of one sequence (a decode step, a few fed tokens), on the paged
    /// kernels ([`Self::paged_kernels`]).
    fn reads_paged(&self, q: &Tensor, past: usize) -> Result<bool> {
        let (b, _, t, _) = q.dims4()?;
        Ok(past > 0 && b == 1 && t <= PAGED_ROWS && self.paged_kernels(q))
    }

    /// Whether the paged attention ops take `q`: f32 or bf16, on a device that has them, with askgui's
    /// kernels.
    fn paged_kernels(&self, q: &Tensor) -> bool {
        matches!(q.dtype(), DType::F32 | DType::BF16)
            && crate::kv_cache::paged_device(q.device())
            && self.kernels == KernelChoice::Askgui
    }

    /// Layer `i`'s pre-norm and projections: `x (B, T, H)` -> rotated `q (B, nh, T, hd)`, rotated
    /// `k (B, nkv, T, hd)` and `v (B, nkv, T, hd)`; the rows' own adapters with `adapters` (inference).
    fn qkv(
        &self,
        i: usize,
        x: &Tensor,
        (cos, sin): &(Tensor, Tensor),
        train: Option<&TrainCtx>,
        adapters: Option<&RowAdapters>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let layer = &self.layers[i];
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim());
        let rot = |x: &Tensor| match train {
            None => crate::layers::rope(x, cos, sin, self.kernels),
            Some(ctx) => ctx.rope(x, cos, sin),
        };
        let a = self.rms(x, &layer.input_norm, train)?;
        // (B, T, n * hd) -> (B, n, T, hd)
        // (B, T, n * hd) -> (B, T, n, hd), normalised per head (Qwen3), -> (B, n, T, hd)
        let heads = |lin: &Linear, n: usize, norm: Option<&Tensor>| -> candle_core::Result<Tensor> {
            let x = project(lin, &a, train, adapters)?.reshape((b, t, n, hd))?;
            let x = match norm {
                Some(w) => self.rms(&x, w, train)?,
                None => x,
            };
            x.transpose(1, 2)
        };
        let (qn, kn) = layer.qk_norm.as_ref().map(|(q, k)| (Some(q), Some(k))).unwrap_or_default();
        Ok((rot(&heads(&layer.q, nh, qn)?)?, rot(&heads(&layer.k, nkv, kn)?)?, heads(&layer.v, nkv, None)?))
    }

    /// The rest of layer `i` after attention: `o (B, nh, T, hd)` through o_proj onto the residual `x`,
    /// then the MLP block; the rows' own adapters with `adapters` (inference).
    fn attn_out_mlp(
        &self,
        i: usize,
        x: &Tensor,
        o: &Tensor,
        train: Option<&TrainCtx>,
        adapters: Option<&RowAdapters>,
    ) -> Result<Tensor> {
        let layer = &self.layers[i];
        let (b, t, _) = x.dims3()?;
        let lin = |l: &Linear, x: &Tensor| project(l, x, train, adapters);
        // (B, nh, T, hd) -> (B, T, nh * hd)
        let o = o.transpose(1, 2)?.reshape((b, t, self.cfg.num_attention_heads * self.cfg.head_dim()))?;
        let x = (x + lin(&layer.o, &o)?)?;
        let m = self.rms(&x, &layer.post_norm, train)?;
        // The decoder's MLP is SiLU-gated (Qwen2's `hidden_act`; the act enum is the vision tower's).
        let (gate, up) = (lin(&layer.gate, &m)?, lin(&layer.up, &m)?);
        let mlp = lin(&layer.down, &crate::layers::gated(&gate, &up, VisionAct::Silu, self.kernels)?)?;
        Ok((x + mlp)?)
    }

    /// The final RMSNorm.
    pub(crate) fn final_norm(&self, x: &Tensor, train: Option<&TrainCtx>) -> Result<Tensor> {
        Ok(self.rms(x, &self.norm, train)?.to_dtype(x.dtype())?)
    }

    fn rms(&self, x: &Tensor, w: &Tensor, train: Option<&TrainCtx>) -> candle_core::Result<Tensor> {
        match train {
            None => crate::layers::rms_norm(x, w, self.cfg.rms_norm_eps, self.kernels),
            Some(ctx) => ctx.rms_norm(x, w, self.cfg.rms_norm_eps),
        }
    }

    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }
}

/// A linear of the decoder or the vision tower: the training forward with `train`, else the inference
/// forward with the rows' own adapters (`adapters`; None: the active adapter). Training never mixes
/// adapters.
pub(crate) fn project(
    lin: &Linear,
    x: &Tensor,
    train: Option<&TrainCtx>,
    adapters: Option<&RowAdapters>,
) -> candle_core::Result<Tensor> {
    match train {
        Some(_) => lin.forward_with(x, train),
        None => lin.forward_rows(x, adapters),
    }
}
