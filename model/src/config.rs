//! Model configuration from a checkpoint's `config.json`, flat (hub) or nested (transformers 5).
//!
//! Hub checkpoints keep the text fields at the top level with `rope_scaling: {type: mrope, mrope_section}`;
//! transformers 5 writes them under `text_config` with `rope_parameters`. Both read into one
//! [`ModelConfig`]. Fields transformers would default are defaulted the same way; fields that define the
//! shapes are required, and their absence is an error naming the field.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Qwen2-VL: LayerNorm + GELU vision blocks, full attention per image.
    Qwen2Vl,
    /// Qwen2.5-VL: RMSNorm + SwiGLU vision blocks, window attention with full-attention blocks.
    Qwen25Vl,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionAct {
    Silu,
    QuickGelu,
    Gelu,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub mrope_section: Vec<usize>,
    /// The longest sequence (prompt and answer) the model was trained for.
    pub max_position_embeddings: usize,
}

impl TextConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    /// Width of the vision transformer (`hidden_size` in Qwen2.5-VL, `embed_dim` in Qwen2-VL).
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    /// Width of the merger output, equal to the text hidden size.
    pub out_hidden_size: usize,
    pub patch_size: usize,
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    pub in_channels: usize,
    pub hidden_act: VisionAct,
    /// Qwen2.5-VL window side in pixels (112); `None` for Qwen2-VL (no windows).
    pub window_size: Option<usize>,
    /// Blocks that attend over the whole image instead of windows (Qwen2.5-VL).
    pub fullatt_block_indexes: Vec<usize>,
    pub rope_theta: f64,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub text: TextConfig,
    pub vision: VisionConfig,
    pub image_token_id: u32,
    pub video_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
    pub tie_word_embeddings: bool,
    /// End-of-sequence ids from config.json (generation_config.json may add more, see `checkpoint`).
    pub eos_token_ids: Vec<u32>,
}

/// Field access that reports the full path of a missing or mistyped field.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    prefix: &'a str,
    path: &'a Path,
}

impl<'a> Obj<'a> {
    fn err(&self, reason: String) -> ModelError {
        ModelError::Config { path: self.path.to_path_buf(), reason }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        match self.map.get(key) {
            None | Some(Value::Null) => Err(self.err(format!("missing required field `{}{key}`", self.prefix))),
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| {
                self.err(format!("field `{}{key}` must be a non-negative integer, got {v}", self.prefix))
            }),
        }
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.usize(key),
        }
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => {
                v.as_f64().ok_or_else(|| self.err(format!("field `{}{key}` must be a number, got {v}", self.prefix)))
            }
        }
    }
    fn str_or(&self, key: &str, default: &'a str) -> &'a str {
        self.map.get(key).and_then(Value::as_str).unwrap_or(default)
    }
    fn obj(&self, key: &str) -> Option<&'a Map<String, Value>> {
        self.map.get(key).and_then(Value::as_object)
    }
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => vec![],
    }
}

impl ModelConfig {
    /// Reads and validates `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::Config { path: path.to_path_buf(), reason: format!("cannot read: {e}") })?;
        Self::from_json_str(&text, path)
    }

    /// Parses `config.json` text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let root: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::Config { path: path.to_path_buf(), reason: format!("invalid JSON: {e}") })?;
        let map = root
            .as_object()
            .ok_or_else(|| ModelError::Config { path: path.to_path_buf(), reason: "not a JSON object".into() })?;
        let root = Obj { map, prefix: "", path };
        let model_type = root.str_or("model_type", "");
        let arch = match model_type {
            "qwen2_5_vl" => Arch::Qwen25Vl,
            "qwen2_vl" => Arch::Qwen2Vl,
            "" => return Err(root.err("missing required field `model_type`".into())),
            other => return Err(ModelError::UnsupportedModel { path: path.to_path_buf(), model_type: other.into() }),
        };
        // Nested (transformers 5) or flat (hub) text fields.
        let text_map = root.obj("text_config");
        let t = match text_map {
            Some(m) => Obj { map: m, prefix: "text_config.", path },
            None => Obj { map, prefix: "", path },
        };
        let rope = t
            .obj("rope_parameters")
            .or_else(|| t.obj("rope_scaling"))
            .or_else(|| root.obj("rope_parameters"))
            .or_else(|| root.obj("rope_scaling"));
        let rope_theta = match rope.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64) {
            Some(x) => x,
            None => t.f64_or("rope_theta", root.f64_or("rope_theta", 1_000_000.0)?)?,
        };
        let mrope_section: Vec<usize> = match rope.and_then(|r| r.get("mrope_section")) {
            Some(Value::Array(a)) => a.iter().map(|x| x.as_u64().unwrap_or(0) as usize).collect(),
            _ => vec![16, 24, 24],
        };
        let num_attention_heads = t.usize("num_attention_heads")?;
        let text = TextConfig {
            vocab_size: t.usize("vocab_size")?,
            hidden_size: t.usize("hidden_size")?,
            intermediate_size: t.usize("intermediate_size")?,
            num_hidden_layers: t.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: t.usize_or("num_key_value_heads", num_attention_heads)?,
            rms_norm_eps: t.f64_or("rms_norm_eps", 1e-6)?,
            rope_theta,
            mrope_section,
            max_position_embeddings: t.usize_or("max_position_embeddings", 32768)?,
        };
        if t.map.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(
                t.err("`use_sliding_window: true` is not supported (Qwen2-VL checkpoints ship with false)".into())
            );
        }
        let vmap =
            root.obj("vision_config").ok_or_else(|| root.err("missing required object `vision_config`".into()))?;
        let v = Obj { map: vmap, prefix: "vision_config.", path };
        let vision_rope_theta =
            v.obj("rope_parameters").and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).unwrap_or(10_000.0);
        let act = |name: &str| match name {
            "silu" => Ok(VisionAct::Silu),
            "quick_gelu" => Ok(VisionAct::QuickGelu),
            "gelu" => Ok(VisionAct::Gelu),
            other => Err(v.err(format!("unsupported `vision_config.hidden_act` `{other}` (silu, quick_gelu, gelu)"))),
        };
        let vision = match arch {
            Arch::Qwen25Vl => VisionConfig {
                depth: v.usize("depth")?,
                hidden_size: v.usize("hidden_size")?,
                intermediate_size: v.usize("intermediate_size")?,
                num_heads: v.usize("num_heads")?,
                out_hidden_size: v.usize("out_hidden_size")?,
                patch_size: v.usize_or("patch_size", 14)?,
                spatial_merge_size: v.usize_or("spatial_merge_size", 2)?,
                temporal_patch_size: v.usize_or("temporal_patch_size", 2)?,
                in_channels: v.usize_or("in_channels", 3)?,
                hidden_act: act(v.str_or("hidden_act", "silu"))?,
                window_size: Some(v.usize_or("window_size", 112)?),
                fullatt_block_indexes: match vmap.get("fullatt_block_indexes") {
                    Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect(),
                    _ => vec![7, 15, 23, 31],
                },
                rope_theta: vision_rope_theta,
            },
            Arch::Qwen2Vl => {
                let embed = v.usize("embed_dim")?;
                VisionConfig {
                    depth: v.usize("depth")?,
                    hidden_size: embed,
                    intermediate_size: embed * v.usize_or("mlp_ratio", 4)?,
                    num_heads: v.usize("num_heads")?,
                    out_hidden_size: v.usize("hidden_size")?,
                    patch_size: v.usize_or("patch_size", 14)?,
                    spatial_merge_size: v.usize_or("spatial_merge_size", 2)?,
                    temporal_patch_size: v.usize_or("temporal_patch_size", 2)?,
                    in_channels: v.usize_or("in_channels", 3)?,
                    hidden_act: act(v.str_or("hidden_act", "quick_gelu"))?,
                    window_size: None,
                    fullatt_block_indexes: vec![],
                    rope_theta: vision_rope_theta,
                }
            }
        };
        // transformers: a tie set in either place ties the head.
        let tie = |o: &Obj| o.map.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false);
        let tie_word_embeddings = tie(&root) || (text_map.is_some() && tie(&t));
        let mut eos_token_ids = ids(t.map.get("eos_token_id"));
        if eos_token_ids.is_empty() {
            eos_token_ids = ids(map.get("eos_token_id"));
        }
        let token =
            |key: &str, default: usize| -> Result<u32> { Ok(root.usize_or(key, t.usize_or(key, default)?)? as u32) };
        let cfg = ModelConfig {
            arch,
            text,
            vision,
            image_token_id: token("image_token_id", 151655)?,
            video_token_id: token("video_token_id", 151656)?,
            vision_start_token_id: token("vision_start_token_id", 151652)?,
            vision_end_token_id: token("vision_end_token_id", 151653)?,
            tie_word_embeddings,
            eos_token_ids,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let err = |reason: String| Err(ModelError::Config { path: path.to_path_buf(), reason });
        let (t, v) = (&self.text, &self.vision);
        if t.num_attention_heads == 0 || t.hidden_size % t.num_attention_heads != 0 {
            return err(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                t.hidden_size, t.num_attention_heads
            ));
        }
        if t.num_key_value_heads == 0 || t.num_attention_heads % t.num_key_value_heads != 0 {
            return err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                t.num_attention_heads, t.num_key_value_heads
            ));
        }
        if t.mrope_section.iter().sum::<usize>() * 2 != t.head_dim() {
            return err(format!("mrope_section {:?} must sum to head_dim / 2 = {}", t.mrope_section, t.head_dim() / 2));
        }
        if v.num_heads == 0 || v.hidden_size % v.num_heads != 0 || v.head_dim() % 4 != 0 {
            return err(format!(
                "vision hidden size {} with {} heads: head dim must be a multiple of 4",
                v.hidden_size, v.num_heads
            ));
        }
        if v.out_hidden_size != t.hidden_size {
            return err(format!(
                "vision output size {} differs from the text hidden size {}",
                v.out_hidden_size, t.hidden_size
            ));
        }
        if v.in_channels != 3 {
            return err(format!("vision_config.in_channels {} is not 3 (RGB)", v.in_channels));
        }
        if let Some(bad) = v.fullatt_block_indexes.iter().find(|&&i| i >= v.depth) {
            return err(format!("fullatt_block_indexes names block {bad} but the vision depth is {}", v.depth));
        }
        if let Some(w) = v.window_size {
            if w % (v.patch_size * v.spatial_merge_size) != 0 || w == 0 {
                return err(format!(
                    "window_size {w} is not a positive multiple of patch * merge = {}",
                    v.patch_size * v.spatial_merge_size
                ));
            }
        }
        Ok(())
    }
}
