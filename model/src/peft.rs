//! LoRA adapters as PEFT stores them: `adapter_config.json` ([`LoraConfig`], checked field by field),
//! `adapter_model.safetensors` in either tensor key layout ([`AdapterLayout`]), reading an adapter
//! directory checked against the model's linears, and writing one; plus the adapters a model holds
//! ([`LoraState`]).
//!
//! Key choice: both key layouts are read (the hub's `base_model.model.model.layers.N...` and transformers
//! 5's `base_model.model.model.language_model.layers.N...`, with or without an adapter name) and mapped to
//! hub-layout module names, the names every [`crate::layers::Linear`] carries. What the adapters do to the
//! model (load, activate, merge, save) is [`crate::lora`]. References: PEFT's `LoraConfig` and
//! `save_pretrained`; parity in `tests/lora.rs`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// `target_modules` is a list of module names in PEFT, or one regex string (not supported here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    List(Vec<String>),
    Regex(String),
}

/// The fields of PEFT's `adapter_config.json` that decide what a LoRA adapter computes. Other fields
/// PEFT writes (`task_type`, `inference_mode`, `init_lora_weights`, ...) are read and ignored; the
/// fields that would change the computation in ways not implemented here are checked by
/// [`LoraConfig::validate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    pub r: usize,
    pub lora_alpha: f64,
    #[serde(default)]
    pub lora_dropout: f64,
    pub target_modules: TargetModules,
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    pub peft_type: String,
    #[serde(default = "bias_none")]
    pub bias: String,
    #[serde(default)]
    pub fan_in_fan_out: bool,
    #[serde(default)]
    pub use_rslora: bool,
    #[serde(default)]
    pub use_dora: bool,
    #[serde(default)]
    pub lora_bias: bool,
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    pub alpha_pattern: BTreeMap<String, serde_json::Value>,
    #[serde(default)]
    pub layers_to_transform: Option<serde_json::Value>,
    #[serde(default)]
    pub exclude_modules: Option<serde_json::Value>,
    #[serde(default)]
    pub task_type: Option<String>,
}

fn bias_none() -> String {
    "none".into()
}

impl LoraConfig {
    /// A plain LoRA config (PEFT defaults for everything else).
    pub fn new(r: usize, lora_alpha: f64, target_modules: &[&str]) -> Self {
        Self {
            r,
            lora_alpha,
            lora_dropout: 0.0,
            target_modules: TargetModules::List(target_modules.iter().map(|s| s.to_string()).collect()),
            base_model_name_or_path: None,
            peft_type: "LORA".into(),
            bias: bias_none(),
            fan_in_fan_out: false,
            use_rslora: false,
            use_dora: false,
            lora_bias: false,
            modules_to_save: None,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            layers_to_transform: None,
            exclude_modules: None,
            task_type: Some("CAUSAL_LM".into()),
        }
    }

    /// Reads and validates `adapter_config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::Adapter {
            dir: dir.clone(),
            reason: format!(
                "cannot read {}: {e}; a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}",
                path.display()
            ),
        })?;
        let cfg: Self = serde_json::from_str(&text)
            .map_err(|e| ModelError::Adapter { dir: dir.clone(), reason: format!("{CONFIG_FILE}: {e}") })?;
        cfg.validate(&dir)?;
        Ok(cfg)
    }

    /// `lora_alpha / r` (plain LoRA; rsLoRA's `alpha / sqrt(r)` is rejected by [`Self::validate`]).
    pub fn scale(&self) -> f64 {
        self.lora_alpha / self.r as f64
    }

    /// The target module names (a validated config always has a list).
    pub fn targets(&self) -> &[String] {
        match &self.target_modules {
            TargetModules::List(v) => v,
            TargetModules::Regex(_) => &[],
        }
    }

    /// Rejects what this implementation does not compute, naming the field.
    pub fn validate(&self, dir: &Path) -> Result<()> {
        let bad = |field: &str, why: String| {
            Err(ModelError::Adapter { dir: dir.to_path_buf(), reason: format!("{CONFIG_FILE}: `{field}` {why}") })
        };
        if self.peft_type != "LORA" {
            return bad("peft_type", format!("is `{}`; only LoRA adapters (\"LORA\") are supported", self.peft_type));
        }
        if self.r == 0 {
            return bad("r", "is 0; the rank must be at least 1".into());
        }
        if !self.lora_alpha.is_finite() {
            return bad("lora_alpha", format!("is {}; it must be a finite number", self.lora_alpha));
        }
        match &self.target_modules {
            TargetModules::Regex(re) => {
                return bad(
                    "target_modules",
                    format!("is the regex/string `{re}`; only a list of module names is supported (e.g. [\"q_proj\", \"v_proj\"])"),
                )
            }
            TargetModules::List(v) if v.is_empty() => return bad("target_modules", "is empty".into()),
            _ => {}
        }
        if self.bias != "none" {
            return bad("bias", format!("is `{}`; only \"none\" is supported (no trained biases)", self.bias));
        }
        if self.fan_in_fan_out {
            return bad(
                "fan_in_fan_out",
                "is true; only false (nn.Linear weights, not GPT-2 Conv1D) is supported".into(),
            );
        }
        if self.use_rslora {
            return bad("use_rslora", "is true; only plain LoRA scaling alpha / r is supported".into());
        }
        if self.use_dora {
            return bad("use_dora", "is true; DoRA is not supported".into());
        }
        if self.lora_bias {
            return bad("lora_bias", "is true; LoRA biases are not supported".into());
        }
        if self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return bad(
                "modules_to_save",
                format!(
                    "is {:?}; fully trained modules are not supported, it must be empty or null",
                    self.modules_to_save.as_deref().unwrap_or_default()
                ),
            );
        }
        if !self.rank_pattern.is_empty() {
            return bad("rank_pattern", "is not empty; per-module ranks are not supported".into());
        }
        if !self.alpha_pattern.is_empty() {
            return bad("alpha_pattern", "is not empty; per-module alphas are not supported".into());
        }
        if self.layers_to_transform.as_ref().is_some_and(|v| !v.is_null()) {
            return bad("layers_to_transform", "is set; only adapters on every layer are supported".into());
        }
        let empty = |v: &serde_json::Value| v.is_null() || v.as_array().is_some_and(|a| a.is_empty());
        if self.exclude_modules.as_ref().is_some_and(|v| !empty(v)) {
            return bad("exclude_modules", "is set; excluded modules are not supported".into());
        }
        Ok(())
    }
}

/// One loaded adapter: its config and `A`, `B` by hub-layout module name.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub config: LoraConfig,
    pub modules: BTreeMap<String, (Tensor, Tensor)>,
}

/// The model-level LoRA state: loaded adapters, the active one, the merged one.
#[derive(Debug, Clone, Default)]
pub struct LoraState {
    pub(crate) adapters: BTreeMap<String, Adapter>,
    pub(crate) active: Option<String>,
    pub(crate) merged: Option<String>,
}

/// The tensor key layout an adapter is saved in (both are read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdapterLayout {
    /// `base_model.model.model.layers.N...`, `base_model.model.visual.blocks.N...` (hub checkpoints,
    /// vLLM, SGLang, PEFT on transformers 4).
    #[default]
    Hub,
    /// `base_model.model.model.language_model.layers.N...`, `base_model.model.model.visual.blocks.N...`
    /// (what PEFT writes and reads on transformers 5). Measured: PEFT 0.21 on transformers 5.23 does not
    /// map hub-layout keys onto its renamed modules; it only warns "missing adapter keys" and runs the
    /// base model, so adapters for that stack are saved in this layout.
    Transformers5,
}

impl AdapterLayout {
    /// The stored key of `A` or `B` (`half` is `lora_A` / `lora_B`) of a hub-layout module name.
    fn key(self, module: &str, half: &str) -> String {
        let module = match self {
            AdapterLayout::Hub => module.to_string(),
            AdapterLayout::Transformers5 => {
                if let Some(r) = module.strip_prefix("visual.") {
                    format!("model.visual.{r}")
                } else if let Some(r) = module.strip_prefix("model.") {
                    format!("model.language_model.{r}")
                } else {
                    module.to_string()
                }
            }
        };
        format!("base_model.model.{module}.{half}.weight")
    }
}

/// Which of the pair a tensor key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    A,
    B,
}

/// A PEFT key -> (hub-layout module name, A or B). Accepts both layouts and an optional adapter name.
fn parse_key(key: &str) -> Option<(String, Half)> {
    let rest = key.strip_prefix("base_model.model.")?;
    let (module, half, tail) = if let Some(i) = rest.rfind(".lora_A.") {
        (&rest[..i], Half::A, &rest[i + ".lora_A.".len()..])
    } else if let Some(i) = rest.rfind(".lora_B.") {
        (&rest[..i], Half::B, &rest[i + ".lora_B.".len()..])
    } else {
        return None;
    };
    // "weight" or "<adapter name>.weight"
    if tail != "weight" && !tail.strip_suffix(".weight").is_some_and(|n| !n.is_empty() && !n.contains('.')) {
        return None;
    }
    let module = if let Some(r) = module.strip_prefix("model.language_model.") {
        format!("model.{r}")
    } else if let Some(r) = module.strip_prefix("model.visual.") {
        format!("visual.{r}")
    } else {
        module.to_string()
    };
    Some((module, half))
}

/// PEFT's rule: a target matches a module whose name equals it or ends with `.target`.
pub(crate) fn matches_target(module: &str, target: &str) -> bool {
    module == target || module.ends_with(&format!(".{target}"))
}

/// Reads and checks an adapter directory against the model's linears `(name, (out, in))`.
pub(crate) fn read_adapter(dir: &Path, linears: &BTreeMap<String, (usize, usize)>, arch: &str) -> Result<Adapter> {
    let err = |reason: String| ModelError::Adapter { dir: dir.to_path_buf(), reason };
    if !dir.is_dir() {
        return Err(err(format!("not a directory; a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")));
    }
    let config = LoraConfig::from_file(&dir.join(CONFIG_FILE))?;
    let weights = dir.join(WEIGHTS_FILE);
    if !weights.is_file() {
        let hint = if dir.join("adapter_model.bin").is_file() {
            " (found adapter_model.bin: re-save it with safetensors, `save_pretrained(..., safe_serialization=True)`)"
        } else {
            ""
        };
        return Err(err(format!("{WEIGHTS_FILE} is missing{hint}")));
    }
    let tensors = candle_core::safetensors::load(&weights, &Device::Cpu)
        .map_err(|e| err(format!("{WEIGHTS_FILE} is not a readable safetensors file: {e}")))?;

    // Which linears the config targets; every target must name at least one.
    let mut targeted = BTreeSet::new();
    for t in config.targets() {
        let hits: Vec<&String> = linears.keys().filter(|m| matches_target(m, t)).collect();
        if hits.is_empty() {
            // Last name component, or the last two where the last is an index (`merger.mlp.0` -> `mlp.0`).
            let kind = |m: &str| -> String {
                let parts: Vec<&str> = m.rsplit('.').take(2).collect();
                match parts.as_slice() {
                    [last, parent] if last.parse::<usize>().is_ok() => format!("{parent}.{last}"),
                    [last, ..] => last.to_string(),
                    [] => String::new(),
                }
            };
            let mut kinds: Vec<String> = linears.keys().map(|m| kind(m)).collect();
            kinds.sort_unstable();
            kinds.dedup();
            return Err(err(format!(
                "{CONFIG_FILE}: target module `{t}` matches no linear layer of this {arch} model (its linear layers are named {})",
                kinds.join(", ")
            )));
        }
        targeted.extend(hits.into_iter().cloned());
    }

    // module -> (A, B), each with its stored key for error messages
    type Stored = Option<(String, Tensor)>;
    let mut pairs: BTreeMap<String, (Stored, Stored)> = BTreeMap::new();
    for (key, t) in tensors {
        let Some((module, half)) = parse_key(&key) else {
            return Err(err(format!(
                "tensor `{key}` is not a LoRA weight (expected `base_model.model.<module>.lora_A.weight` or `.lora_B.weight`)"
            )));
        };
        if !linears.contains_key(&module) {
            return Err(err(format!(
                "tensor `{key}` is for module `{module}`, which this {arch} model does not have; the adapter was made for another architecture or size"
            )));
        }
        if !targeted.contains(&module) {
            return Err(err(format!(
                "tensor `{key}` is for module `{module}`, which no entry of `target_modules` names"
            )));
        }
        let slot = pairs.entry(module).or_default();
        let place = match half {
            Half::A => &mut slot.0,
            Half::B => &mut slot.1,
        };
        if place.replace((key.clone(), t)).is_some() {
            return Err(err(format!("tensor `{key}` appears twice (under two layouts or adapter names)")));
        }
    }

    let r = config.r;
    let mut modules = BTreeMap::new();
    for module in &targeted {
        let (out, inp) = linears[module];
        let ((ka, a), (kb, b)) = match pairs.remove(module) {
            Some((Some(a), Some(b))) => (a, b),
            Some((a, _)) => {
                let half = if a.is_none() { "lora_A" } else { "lora_B" };
                return Err(err(format!("module `{module}` has no `{half}` tensor")));
            }
            None => {
                return Err(err(format!(
                    "`target_modules` selects module `{module}` but {WEIGHTS_FILE} has no tensors for it"
                )))
            }
        };
        let (ad, bd) = (a.dims().to_vec(), b.dims().to_vec());
        if ad.len() == 2 && bd.len() == 2 && ad[0] == bd[1] && ad[0] != r {
            return Err(err(format!(
                "{CONFIG_FILE} says r = {r} but the tensors of `{module}` have rank {} (lora_A {ad:?}, lora_B {bd:?}); fix `r` or the tensors",
                ad[0]
            )));
        }
        for (key, got, want) in [(ka, &ad, vec![r, inp]), (kb, &bd, vec![out, r])] {
            if *got != want {
                return Err(ModelError::AdapterShape { dir: dir.to_path_buf(), name: key, got: got.clone(), want });
            }
        }
        modules.insert(module.clone(), (a, b));
    }
    Ok(Adapter { config, modules })
}

/// Writes `adapter` into `dir` as PEFT does: `adapter_config.json`, and `adapter_model.safetensors` with
/// the tensor keys in `layout`.
pub(crate) fn write_adapter(dir: &Path, adapter: &Adapter, layout: AdapterLayout) -> Result<()> {
    let io = |what: &str, e: &dyn std::fmt::Display| ModelError::Adapter {
        dir: dir.to_path_buf(),
        reason: format!("cannot write {what}: {e}"),
    };
    std::fs::create_dir_all(dir).map_err(|e| io("the directory", &e))?;
    let json = serde_json::to_string_pretty(&adapter.config).map_err(|e| io(CONFIG_FILE, &e))?;
    std::fs::write(dir.join(CONFIG_FILE), json + "\n").map_err(|e| io(CONFIG_FILE, &e))?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (m, (a, b)) in &adapter.modules {
        tensors.insert(layout.key(m, "lora_A"), a.to_device(&Device::Cpu)?.contiguous()?);
        tensors.insert(layout.key(m, "lora_B"), b.to_device(&Device::Cpu)?.contiguous()?);
    }
    candle_core::safetensors::save(&tensors, dir.join(WEIGHTS_FILE)).map_err(|e| io(WEIGHTS_FILE, &e))?;
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_both_layouts_and_adapter_names() {
        let hub = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
        let t5 = "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight";
        let vis = "base_model.model.model.visual.blocks.1.mlp.up_proj.lora_B.weight";
        assert_eq!(parse_key(hub), Some(("model.layers.0.self_attn.q_proj".into(), Half::A)));
        assert_eq!(parse_key(t5), Some(("model.layers.0.self_attn.q_proj".into(), Half::A)));
        assert_eq!(parse_key(vis), Some(("visual.blocks.1.mlp.up_proj".into(), Half::B)));
        assert_eq!(parse_key("model.layers.0.self_attn.q_proj.weight"), None);
        assert_eq!(parse_key("base_model.model.model.layers.0.q_proj.lora_magnitude_vector"), None);
    }

    #[test]
    fn saved_keys_parse_back() {
        for m in ["model.layers.3.mlp.down_proj", "visual.blocks.0.attn.qkv", "visual.merger.mlp.0"] {
            for layout in [AdapterLayout::Hub, AdapterLayout::Transformers5] {
                assert_eq!(parse_key(&layout.key(m, "lora_B")), Some((m.to_string(), Half::B)), "{layout:?}");
            }
        }
        assert_eq!(
            AdapterLayout::Transformers5.key("model.layers.0.self_attn.q_proj", "lora_A"),
            "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"
        );
    }

    #[test]
    fn targets_match_by_suffix() {
        assert!(matches_target("model.layers.0.self_attn.q_proj", "q_proj"));
        assert!(matches_target("model.layers.0.self_attn.q_proj", "self_attn.q_proj"));
        assert!(!matches_target("model.layers.0.self_attn.q_proj", "_proj"));
    }
}
