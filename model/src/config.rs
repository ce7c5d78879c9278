//! Model configuration from a checkpoint's `config.json`, flat (hub) or nested (transformers 5).
//!
//! Hub Qwen2/2.5-VL checkpoints keep the text fields at the top level with `rope_scaling: {type: mrope,
//! mrope_section}`; transformers 5 writes them under `text_config` with `rope_parameters`; released Qwen3-VL
//! checkpoints are nested with `rope_scaling` plus `rope_theta` (written by transformers 4.57). All read into
//! one [`ModelConfig`]. A family is data: [`Arch`] names it, and each family's vision fields are read by a
//! small function of its own ([`qwen2_vision`], [`qwen25_vision`], [`qwen3_vision`]). Fields transformers
//! would default are defaulted the same way; fields that define the shapes are required, and their absence
//! is an error naming the field.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// The system prompt of Qwen2/2.5-VL's chat template.
pub(crate) const QWEN2_SYSTEM_PROMPT: &str = "You are a helpful assistant.";

/// The model family: which small pieces the one implementation is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Qwen2-VL: LayerNorm + GELU vision blocks, full attention per image.
    Qwen2Vl,
    /// Qwen2.5-VL: RMSNorm + SwiGLU vision blocks, window attention with full-attention blocks.
    Qwen25Vl,
    /// Qwen3-VL: 16-px patches with a learned position table, LayerNorm + GELU-tanh vision blocks,
    /// DeepStack features added after the first decoder layers, q/k norms and interleaved M-RoPE.
    Qwen3Vl,
}

impl Arch {
    /// The `model_type` of config.json.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen2Vl => "qwen2_vl",
            Arch::Qwen25Vl => "qwen2_5_vl",
            Arch::Qwen3Vl => "qwen3_vl",
        }
    }

    /// The vision blocks' norm: RMSNorm (Qwen2.5-VL) or LayerNorm with a bias.
    pub fn vision_norm(self) -> NormKind {
        match self {
            Arch::Qwen25Vl => NormKind::Rms,
            Arch::Qwen2Vl | Arch::Qwen3Vl => NormKind::Layer,
        }
    }

    /// The checkpoint names of a vision block's MLP linears under `blocks.N.mlp.`: gated (gate, up, down)
    /// or plain (in, out).
    pub fn vision_mlp(self) -> MlpKind {
        match self {
            Arch::Qwen25Vl => MlpKind::Glu,
            Arch::Qwen2Vl => MlpKind::Plain { fc1: "fc1", fc2: "fc2" },
            Arch::Qwen3Vl => MlpKind::Plain { fc1: "linear_fc1", fc2: "linear_fc2" },
        }
    }

    /// The merger's `(norm, first linear, second linear)` names under `visual.merger.`.
    pub fn merger_names(self) -> [&'static str; 3] {
        match self {
            Arch::Qwen2Vl | Arch::Qwen25Vl => ["ln_q", "mlp.0", "mlp.2"],
            Arch::Qwen3Vl => ["norm", "linear_fc1", "linear_fc2"],
        }
    }

    /// Whether the patch embedding (a Conv3d) has a bias.
    pub fn patch_bias(self) -> bool {
        self == Arch::Qwen3Vl
    }

    /// The system prompt the family's chat template adds when a chat has none (Qwen3-VL's adds none).
    pub fn default_system_prompt(self) -> Option<&'static str> {
        match self {
            Arch::Qwen2Vl | Arch::Qwen25Vl => Some(QWEN2_SYSTEM_PROMPT),
            Arch::Qwen3Vl => None,
        }
    }

    /// The key a tensor is saved under in this family's checkpoints, from its hub-layout name: Qwen2/2.5-VL
    /// checkpoints keep `model.layers.N...` and `visual.*` (transformers 5 renames them on load); Qwen3-VL's
    /// are `model.language_model.*` and `model.visual.*`, which transformers 5.24 expects as they are (it
    /// has no renaming for Qwen3-VL).
    pub fn checkpoint_key(self, hub: &str) -> String {
        match (self, hub.strip_prefix("visual."), hub.strip_prefix("model.")) {
            (Arch::Qwen3Vl, Some(rest), _) => format!("model.visual.{rest}"),
            (Arch::Qwen3Vl, None, Some(rest))
                if !rest.starts_with("language_model.") && !rest.starts_with("visual.") =>
            {
                format!("model.language_model.{rest}")
            }
            _ => hub.to_string(),
        }
    }

    /// Whether the family grounds in relative 0-1000 coordinates (Qwen3-VL) rather than in pixels of the
    /// resized image (Qwen2.5-VL): its native coordinate frame.
    pub fn grounds_relative(self) -> bool {
        self == Arch::Qwen3Vl
    }

    /// The default image processor's normalisation: CLIP's mean and std, or 0.5 (Qwen3-VL).
    pub fn image_mean_std(self) -> ([f32; 3], [f32; 3]) {
        match self {
            Arch::Qwen2Vl | Arch::Qwen25Vl => (askgui_kernels::tiling::CLIP_MEAN, askgui_kernels::tiling::CLIP_STD),
            Arch::Qwen3Vl => ([0.5; 3], [0.5; 3]),
        }
    }
}

/// A norm kind (see [`Arch::vision_norm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    Rms,
    Layer,
}

/// A vision MLP kind (see [`Arch::vision_mlp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// `down(act(gate(x)) * up(x))`.
    Glu,
    /// `fc2(act(fc1(x)))`, with the two linears' names.
    Plain { fc1: &'static str, fc2: &'static str },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionAct {
    Silu,
    QuickGelu,
    /// GELU with the exact erf.
    Gelu,
    /// GELU's tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Width of one attention head: `hidden / heads` (Qwen2) or set apart from it (Qwen3's 128).
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub mrope_section: Vec<usize>,
    /// M-RoPE frequencies interleaved `t h w t h w ...` (Qwen3-VL) instead of in three chunks.
    pub mrope_interleaved: bool,
    /// Whether q, k and v carry biases (Qwen2) or not (Qwen3's `attention_bias: false`).
    pub qkv_bias: bool,
    /// A per-head RMSNorm on q and on k before the rotation (Qwen3).
    pub qk_norm: bool,
    /// The longest sequence (prompt and answer) the model was trained for.
    pub max_position_embeddings: usize,
}

impl TextConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim
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
    /// Rows of the learned square position table, interpolated to each image's grid (Qwen3-VL: 2304 =
    /// 48x48); `None` for rotary positions alone.
    pub num_position_embeddings: Option<usize>,
    /// Blocks whose output goes through a merger of its own and is added after decoder layer `j` for the
    /// `j`-th of them (DeepStack, Qwen3-VL); empty for none.
    pub deepstack_visual_indexes: Vec<usize>,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// The side of one language-model token in pixels: patch times merge (28, or 32 for Qwen3-VL).
    pub fn token_side(&self) -> usize {
        self.patch_size * self.spatial_merge_size
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

impl ModelConfig {
    /// The number of DeepStack feature sets the vision tower gives beside its main output.
    pub fn deepstack(&self) -> usize {
        self.vision.deepstack_visual_indexes.len()
    }

    /// The width of one image token's features and of the decoder's input rows: the text hidden size,
    /// times one plus the DeepStack feature sets carried beside it (see [`crate::Qwen2Vl::embed`]).
    pub fn embed_width(&self) -> usize {
        self.text.hidden_size * (1 + self.deepstack())
    }
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

/// The decoder's fields, from `t` (the text object) with `root` for what hub files keep at the top.
fn text_config(root: &Obj, t: &Obj, arch: Arch) -> Result<TextConfig> {
    let rope = t
        .obj("rope_parameters")
        .or_else(|| t.obj("rope_scaling"))
        .or_else(|| root.obj("rope_parameters"))
        .or_else(|| root.obj("rope_scaling"));
    let rope_theta = match rope.and_then(|r| r.get("rope_theta")).and_then(Value::as_f64) {
        Some(x) => x,
        None => t.f64_or("rope_theta", root.f64_or("rope_theta", 1_000_000.0)?)?,
    };
    let qwen3 = arch == Arch::Qwen3Vl;
    let mrope_section: Vec<usize> = match rope.and_then(|r| r.get("mrope_section")) {
        Some(Value::Array(a)) => a.iter().map(|x| x.as_u64().unwrap_or(0) as usize).collect(),
        _ if qwen3 => vec![24, 20, 20],
        _ => vec![16, 24, 24],
    };
    // transformers' Qwen3-VL always interleaves; the flag in its files says so.
    let mrope_interleaved =
        rope.and_then(|r| r.get("mrope_interleaved")).and_then(Value::as_bool).unwrap_or(false) || qwen3;
    let num_attention_heads = t.usize("num_attention_heads")?;
    let hidden_size = t.usize("hidden_size")?;
    let head_dim = match qwen3 {
        true => t.usize_or("head_dim", 128)?,
        false => hidden_size / num_attention_heads.max(1),
    };
    if t.map.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return Err(t.err("`use_sliding_window: true` is not supported (Qwen2-VL checkpoints ship with false)".into()));
    }
    Ok(TextConfig {
        vocab_size: t.usize("vocab_size")?,
        hidden_size,
        intermediate_size: t.usize("intermediate_size")?,
        num_hidden_layers: t.usize("num_hidden_layers")?,
        num_attention_heads,
        num_key_value_heads: t.usize_or("num_key_value_heads", num_attention_heads)?,
        head_dim,
        rms_norm_eps: t.f64_or("rms_norm_eps", 1e-6)?,
        rope_theta,
        mrope_section,
        mrope_interleaved,
        qkv_bias: !qwen3 || t.map.get("attention_bias").and_then(Value::as_bool) == Some(true),
        qk_norm: qwen3,
        max_position_embeddings: t.usize_or("max_position_embeddings", if qwen3 { 262_144 } else { 32768 })?,
    })
}

/// The vision rotary base: `vision_config.rope_parameters.rope_theta`, else 10000.
fn vision_rope_theta(v: &Obj) -> f64 {
    v.obj("rope_parameters").and_then(|r| r.get("rope_theta")).and_then(Value::as_f64).unwrap_or(10_000.0)
}

fn vision_act(v: &Obj, default: &str) -> Result<VisionAct> {
    match v.str_or("hidden_act", default) {
        "silu" => Ok(VisionAct::Silu),
        "quick_gelu" => Ok(VisionAct::QuickGelu),
        "gelu" => Ok(VisionAct::Gelu),
        "gelu_pytorch_tanh" => Ok(VisionAct::GeluTanh),
        other => Err(v.err(format!(
            "unsupported `vision_config.hidden_act` `{other}` (silu, quick_gelu, gelu, gelu_pytorch_tanh)"
        ))),
    }
}

fn usize_list(v: &Obj, key: &str, default: &[usize]) -> Vec<usize> {
    match v.map.get(key) {
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect(),
        _ => default.to_vec(),
    }
}

/// The vision fields every family reads alike, with a family's patch size and activation defaults; no
/// windows, no position table, no DeepStack (the families that have them set them over this).
fn vision_common(v: &Obj, patch: usize, act: &str) -> Result<VisionConfig> {
    Ok(VisionConfig {
        depth: v.usize("depth")?,
        hidden_size: v.usize_or("hidden_size", 0)?,
        intermediate_size: v.usize_or("intermediate_size", 0)?,
        num_heads: v.usize("num_heads")?,
        out_hidden_size: v.usize_or("out_hidden_size", 0)?,
        patch_size: v.usize_or("patch_size", patch)?,
        spatial_merge_size: v.usize_or("spatial_merge_size", 2)?,
        temporal_patch_size: v.usize_or("temporal_patch_size", 2)?,
        in_channels: v.usize_or("in_channels", 3)?,
        hidden_act: vision_act(v, act)?,
        window_size: None,
        fullatt_block_indexes: vec![],
        rope_theta: vision_rope_theta(v),
        num_position_embeddings: None,
        deepstack_visual_indexes: vec![],
    })
}

/// Qwen2-VL's vision fields: `embed_dim` wide, `mlp_ratio`, the text width as `hidden_size`.
fn qwen2_vision(v: &Obj) -> Result<VisionConfig> {
    let embed = v.usize("embed_dim")?;
    Ok(VisionConfig {
        hidden_size: embed,
        intermediate_size: embed * v.usize_or("mlp_ratio", 4)?,
        out_hidden_size: v.usize("hidden_size")?,
        ..vision_common(v, 14, "quick_gelu")?
    })
}

/// The widths Qwen2.5-VL and Qwen3-VL name alike, required.
fn vision_widths(v: &Obj, patch: usize, act: &str) -> Result<VisionConfig> {
    Ok(VisionConfig {
        hidden_size: v.usize("hidden_size")?,
        intermediate_size: v.usize("intermediate_size")?,
        out_hidden_size: v.usize("out_hidden_size")?,
        ..vision_common(v, patch, act)?
    })
}

/// Qwen2.5-VL's vision fields: windows of `window_size` pixels, full attention in the listed blocks.
fn qwen25_vision(v: &Obj) -> Result<VisionConfig> {
    Ok(VisionConfig {
        window_size: Some(v.usize_or("window_size", 112)?),
        fullatt_block_indexes: usize_list(v, "fullatt_block_indexes", &[7, 15, 23, 31]),
        ..vision_widths(v, 14, "silu")?
    })
}

/// Qwen3-VL's vision fields: 16-px patches, a learned position table, DeepStack blocks, no windows.
fn qwen3_vision(v: &Obj) -> Result<VisionConfig> {
    Ok(VisionConfig {
        num_position_embeddings: Some(v.usize_or("num_position_embeddings", 2304)?),
        deepstack_visual_indexes: usize_list(v, "deepstack_visual_indexes", &[8, 16, 24]),
        ..vision_widths(v, 16, "gelu_pytorch_tanh")?
    })
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
        let arch = match root.str_or("model_type", "") {
            "qwen2_5_vl" => Arch::Qwen25Vl,
            "qwen2_vl" => Arch::Qwen2Vl,
            "qwen3_vl" => Arch::Qwen3Vl,
            "" => return Err(root.err("missing required field `model_type`".into())),
            other => return Err(ModelError::UnsupportedModel { path: path.to_path_buf(), model_type: other.into() }),
        };
        // Nested (transformers 5, Qwen3-VL) or flat (Qwen2/2.5-VL hub) text fields.
        let text_map = root.obj("text_config");
        let t = match text_map {
            Some(m) => Obj { map: m, prefix: "text_config.", path },
            None => Obj { map, prefix: "", path },
        };
        let text = text_config(&root, &t, arch)?;
        let vmap =
            root.obj("vision_config").ok_or_else(|| root.err("missing required object `vision_config`".into()))?;
        let v = Obj { map: vmap, prefix: "vision_config.", path };
        let vision = match arch {
            Arch::Qwen2Vl => qwen2_vision(&v)?,
            Arch::Qwen25Vl => qwen25_vision(&v)?,
            Arch::Qwen3Vl => qwen3_vision(&v)?,
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
        let explicit_head_dim = self.arch == Arch::Qwen3Vl;
        if t.num_attention_heads == 0 || (!explicit_head_dim && t.hidden_size % t.num_attention_heads != 0) {
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
        if t.head_dim == 0 || t.head_dim % 2 != 0 {
            return err(format!("text_config.head_dim {} must be a positive even number", t.head_dim));
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
        let ds = &v.deepstack_visual_indexes;
        if let Some(bad) = ds.iter().find(|&&i| i >= v.depth) {
            return err(format!("deepstack_visual_indexes names block {bad} but the vision depth is {}", v.depth));
        }
        if ds.windows(2).any(|w| w[0] >= w[1]) || ds.len() > t.num_hidden_layers {
            return err(format!(
                "deepstack_visual_indexes {ds:?} must be increasing and at most the {} decoder layers",
                t.num_hidden_layers
            ));
        }
        if let Some(n) = v.num_position_embeddings {
            let side = (n as f64).sqrt().round() as usize;
            if n == 0 || side * side != n {
                return err(format!("vision_config.num_position_embeddings {n} is not a positive square"));
            }
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
