//! LoRA adapters as PEFT stores them: `adapter_config.json` ([`LoraConfig`], checked field by field),
//! `adapter_model.safetensors` in either tensor key layout ([`AdapterLayout`]) and the model card
//! (`README.md`, which records the layout); reading an adapter directory checked against the model's
//! linears, writing one, rewriting one's keys ([`convert_adapter`]); plus the adapters a model holds
//! ([`LoraState`]).
//!
//! Key choice: both key layouts are read (the hub's `base_model.model.model.layers.N...` and transformers
//! 5's `base_model.model.model.language_model.layers.N...`, with or without an adapter name) and mapped to
//! hub-layout module names ([`hub_name`]), the names every [`crate::layers::Linear`] carries; the
//! transformers 5 layout is written by default, as PEFT on transformers 5 reads no other. What the adapters
//! do to the model (load, activate, merge, save) is [`crate::lora`]. References: PEFT's `LoraConfig` and
//! `save_pretrained`; parity in `tests/lora.rs`, interop in `scripts/checks/peft_interop.py`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// The names of `dir`'s sub-folders that hold an adapter (a training run's `checkpoint-*`), sorted.
fn adapters_inside(dir: &Path) -> Vec<String> {
    let entries = std::fs::read_dir(dir).into_iter().flatten().flatten();
    let mut names: Vec<String> = entries
        .filter(|e| e.path().join(CONFIG_FILE).is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

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
            reason: match adapters_inside(&dir).as_slice() {
                [] => format!(
                    "cannot read {}: {e}; a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE}",
                    path.display()
                ),
                inside => format!(
                    "not an adapter but a folder of {} ({}); pass one of them, e.g. {} (the last by name)",
                    inside.len(),
                    if inside.len() > 4 {
                        format!("{}, ..., {}", inside[0], inside[inside.len() - 2..].join(", "))
                    } else {
                        inside.join(", ")
                    },
                    dir.join(&inside[inside.len() - 1]).display()
                ),
            },
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
    Hub,
    /// `base_model.model.model.language_model.layers.N...`, `base_model.model.model.visual.blocks.N...`:
    /// what PEFT writes and reads on transformers 5, the default. PEFT on transformers 5 does not map
    /// hub-layout keys onto its renamed modules; it only warns "missing adapter keys" and runs the base model.
    #[default]
    Transformers5,
}

impl AdapterLayout {
    /// The layout's name, as `--adapter-keys` and the model card spell it.
    pub fn name(self) -> &'static str {
        match self {
            AdapterLayout::Hub => "hub",
            AdapterLayout::Transformers5 => "transformers5",
        }
    }

    /// The name of hub-layout module (or tensor) name `hub` in this layout; [`hub_name`] is the inverse.
    pub fn module_name(self, hub: &str) -> String {
        match self {
            AdapterLayout::Hub => hub.to_string(),
            AdapterLayout::Transformers5 => {
                if let Some(r) = hub.strip_prefix("visual.") {
                    format!("model.visual.{r}")
                } else if let Some(r) = hub.strip_prefix("model.") {
                    format!("model.language_model.{r}")
                } else {
                    hub.to_string()
                }
            }
        }
    }

    /// The stored key of `A` or `B` (`half` is `lora_A` / `lora_B`) of a hub-layout module name.
    fn key(self, module: &str, half: &str) -> String {
        format!("base_model.model.{}.{half}.weight", self.module_name(module))
    }

    /// The layout stored PEFT keys are in, from the first key that tells (None: no key does, e.g. an
    /// adapter on `lm_head` only).
    pub fn of_keys<'a>(keys: impl IntoIterator<Item = &'a str>) -> Option<Self> {
        keys.into_iter().find_map(|k| {
            let m = k.strip_prefix("base_model.model.")?;
            if m.starts_with("model.language_model.") || m.starts_with("model.visual.") {
                Some(AdapterLayout::Transformers5)
            } else if m.starts_with("model.") || m.starts_with("visual.") {
                Some(AdapterLayout::Hub)
            } else {
                None
            }
        })
    }
}

/// The hub-layout name of a module or tensor name in either layout (`model.language_model.X` -> `model.X`,
/// `model.visual.X` -> `visual.X`, anything else unchanged): the one mapping adapters, checkpoints and
/// merged checkpoints use.
pub fn hub_name(name: &str) -> String {
    if let Some(r) = name.strip_prefix("model.language_model.") {
        format!("model.{r}")
    } else if let Some(r) = name.strip_prefix("model.visual.") {
        format!("visual.{r}")
    } else {
        name.to_string()
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
    Some((hub_name(module), half))
}

/// PEFT's rule: a target matches a module whose name equals it or ends with `.target`. A target written
/// as a full name in either layout (`model.language_model.layers.0.self_attn.q_proj`) is read as its hub name.
pub(crate) fn matches_target(module: &str, target: &str) -> bool {
    let target = hub_name(target);
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

/// Writes `adapter` into `dir` as PEFT does: `adapter_config.json`, `adapter_model.safetensors` with the
/// tensor keys in `layout`, and the model card ([`write_model_card`]).
pub(crate) fn write_adapter(dir: &Path, adapter: &Adapter, layout: AdapterLayout) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| write_err(dir, "the directory", &e))?;
    let json = serde_json::to_string_pretty(&adapter.config).map_err(|e| write_err(dir, CONFIG_FILE, &e))?;
    std::fs::write(dir.join(CONFIG_FILE), json + "\n").map_err(|e| write_err(dir, CONFIG_FILE, &e))?;
    write_weights(dir, &adapter.modules, layout)?;
    write_model_card(dir, adapter.config.base_model_name_or_path.as_deref(), layout)
}

fn write_err(dir: &Path, what: &str, e: &dyn std::fmt::Display) -> ModelError {
    ModelError::Adapter { dir: dir.to_path_buf(), reason: format!("cannot write {what}: {e}") }
}

/// `adapter_model.safetensors` with the tensor keys in `layout`; the tensors are written as they are held
/// (same dtype), so rewriting an adapter's keys keeps its tensors byte for byte.
fn write_weights(dir: &Path, modules: &BTreeMap<String, (Tensor, Tensor)>, layout: AdapterLayout) -> Result<()> {
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (m, (a, b)) in modules {
        tensors.insert(layout.key(m, "lora_A"), a.to_device(&Device::Cpu)?.contiguous()?);
        tensors.insert(layout.key(m, "lora_B"), b.to_device(&Device::Cpu)?.contiguous()?);
    }
    candle_core::safetensors::save(&tensors, dir.join(WEIGHTS_FILE)).map_err(|e| write_err(dir, WEIGHTS_FILE, &e))
}

/// The model card beside an adapter, as PEFT's `save_pretrained` writes one.
pub const CARD_FILE: &str = "README.md";
/// Front-matter fields of the card that say which stack the adapter is for (no loader reads them; PEFT
/// would warn about unknown fields in `adapter_config.json`).
pub const CARD_LAYOUT_FIELD: &str = "askgui_key_layout";
pub const CARD_VERSION_FIELD: &str = "askgui_version";
const SECTION_BEGIN: &str = "<!-- askgui: tensor key layout -->";
const SECTION_END: &str = "<!-- /askgui: tensor key layout -->";

/// Writes `dir/README.md`, or updates the one there (a card someone else wrote keeps its text): front-matter
/// fields [`CARD_LAYOUT_FIELD`] and [`CARD_VERSION_FIELD`], and a section that says which stack loads the
/// adapter and how to rewrite its keys for another.
pub fn write_model_card(dir: &Path, base_model: Option<&str>, layout: AdapterLayout) -> Result<()> {
    let path = dir.join(CARD_FILE);
    let old = if path.is_file() {
        std::fs::read_to_string(&path).map_err(|e| write_err(dir, CARD_FILE, &e))?
    } else {
        String::new()
    };
    // Split off an existing front matter (`---` ... `---` at the top).
    let (mut front, body): (Vec<String>, &str) = match old.strip_prefix("---\n").and_then(|r| r.split_once("\n---")) {
        Some((f, rest)) => (f.lines().map(str::to_string).collect(), rest.strip_prefix('\n').unwrap_or(rest)),
        None => {
            let mut f = Vec::new();
            if let Some(base) = base_model {
                // A JSON string is a YAML string, whatever the path holds.
                f.push(format!("base_model: {}", serde_json::Value::from(base)));
            }
            f.extend(["library_name: peft", "tags:", "- lora", "- askgui"].map(str::to_string));
            (f, old.as_str())
        }
    };
    front.retain(|l| {
        !l.starts_with(&format!("{CARD_LAYOUT_FIELD}:")) && !l.starts_with(&format!("{CARD_VERSION_FIELD}:"))
    });
    front.push(format!("{CARD_LAYOUT_FIELD}: {}", layout.name()));
    front.push(format!("{CARD_VERSION_FIELD}: {}", env!("CARGO_PKG_VERSION")));
    // Drop the section an earlier write left, keep everything else.
    let mut body = body.to_string();
    if let (Some(b), Some(e)) = (body.find(SECTION_BEGIN), body.find(SECTION_END)) {
        if b < e {
            body.replace_range(b..e + SECTION_END.len(), "");
        }
    }
    let body = body.trim();
    let stack = match layout {
        AdapterLayout::Transformers5 => {
            "PEFT on transformers 5 loads it as it is (`PeftModel.from_pretrained(model, dir)`)".to_string()
        }
        AdapterLayout::Hub => {
            "it is for PEFT on transformers 4, vLLM and SGLang; PEFT on transformers 5 would load none of it"
                .to_string()
        }
    };
    let section = format!(
        "{SECTION_BEGIN}\n## Tensor key layout\n\nThe tensor keys of this LoRA adapter are in the `{name}` layout \
         (`{example}`), written by askgui {version}: {stack}. Rewrite them for another stack with \
         `askgui-train convert-adapter --in DIR --out DIR --to transformers5|hub`.\n{SECTION_END}\n",
        name = layout.name(),
        example = layout.key("model.layers.0.self_attn.q_proj", "lora_A"),
        version = env!("CARGO_PKG_VERSION"),
    );
    let sep = if body.is_empty() { "" } else { "\n\n" };
    let text = format!("---\n{}\n---\n\n{body}{sep}{section}", front.join("\n"));
    std::fs::write(&path, text).map_err(|e| write_err(dir, CARD_FILE, &e))
}

/// What [`convert_adapter`] wrote.
#[derive(Debug, Clone)]
pub struct Conversion {
    /// The layout the input's keys were in (None: no key tells).
    pub from: Option<AdapterLayout>,
    /// Modules whose `A` and `B` were rewritten.
    pub modules: usize,
    /// The input's other files, copied as they are (the model card is then updated).
    pub copied: Vec<String>,
}

/// Rewrites the PEFT adapter in `src` into the folder `dst` with its tensor keys in `layout`, after
/// checking it against a `cfg` model as loading does (a module the model lacks, or of another shape, is
/// refused and named). The tensors keep their bytes; `adapter_config.json` keeps every field, its
/// `target_modules` given as full module names are renamed; the model card says the new layout.
pub fn convert_adapter(src: &Path, dst: &Path, cfg: &ModelConfig, layout: AdapterLayout) -> Result<Conversion> {
    let adapter = read_adapter(src, &crate::random_init::linear_shapes(cfg), &format!("{:?}", cfg.arch))?;
    let err = |reason: String| ModelError::Adapter { dir: src.to_path_buf(), reason };
    // SAFETY: read-only map of a file read a moment ago, for its key names only.
    let stored = unsafe { candle_core::safetensors::MmapedSafetensors::new(src.join(WEIGHTS_FILE)) }
        .map_err(|e| err(format!("{WEIGHTS_FILE}: {e}")))?;
    let keys: Vec<String> = stored.tensors().into_iter().map(|(k, _)| k).collect();
    let from = AdapterLayout::of_keys(keys.iter().map(String::as_str));

    std::fs::create_dir_all(dst).map_err(|e| write_err(dst, "the directory", &e))?;
    let mut copied = Vec::new();
    for entry in std::fs::read_dir(src).map_err(|e| err(format!("cannot list: {e}")))? {
        let path = entry.map_err(|e| err(format!("cannot list: {e}")))?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        // adapter_model.bin would hold the old keys beside the new file; PEFT prefers the safetensors.
        if !path.is_file() || [CONFIG_FILE, WEIGHTS_FILE, "adapter_model.bin"].contains(&name.as_str()) {
            continue;
        }
        std::fs::copy(&path, dst.join(&name)).map_err(|e| write_err(dst, &name, &e))?;
        copied.push(name);
    }
    copied.sort();

    // The config as written, every field kept; only full module names in target_modules change.
    let text = std::fs::read_to_string(src.join(CONFIG_FILE)).map_err(|e| err(format!("{CONFIG_FILE}: {e}")))?;
    let mut json: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("{CONFIG_FILE}: {e}")))?;
    if let Some(list) = json.get_mut("target_modules").and_then(|t| t.as_array_mut()) {
        for t in list.iter_mut() {
            if let Some(s) = t.as_str() {
                *t = layout.module_name(&hub_name(s)).into();
            }
        }
    }
    let json = serde_json::to_string_pretty(&json).map_err(|e| write_err(dst, CONFIG_FILE, &e))?;
    std::fs::write(dst.join(CONFIG_FILE), json + "\n").map_err(|e| write_err(dst, CONFIG_FILE, &e))?;
    write_weights(dst, &adapter.modules, layout)?;
    write_model_card(dst, adapter.config.base_model_name_or_path.as_deref(), layout)?;
    Ok(Conversion { from, modules: adapter.modules.len(), copied })
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
        assert_eq!(
            AdapterLayout::Hub.key("visual.blocks.0.attn.qkv", "lora_B"),
            "base_model.model.visual.blocks.0.attn.qkv.lora_B.weight"
        );
    }

    #[test]
    fn the_layout_of_stored_keys_is_told_by_the_first_key_that_tells() {
        let t5 =
            ["base_model.model.lm_head.lora_A.weight", "base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight"];
        assert_eq!(AdapterLayout::of_keys(t5), Some(AdapterLayout::Transformers5));
        let hub = ["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"];
        assert_eq!(AdapterLayout::of_keys(hub), Some(AdapterLayout::Hub));
        assert_eq!(AdapterLayout::of_keys(["base_model.model.lm_head.lora_A.weight"]), None);
    }

    #[test]
    fn the_model_card_records_the_layout_and_keeps_a_card_written_by_others() {
        let dir = std::env::temp_dir().join(format!("askgui-peft-card-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let card = dir.join(CARD_FILE);
        std::fs::write(
            &card,
            "---\nlicense: apache-2.0\nlibrary_name: peft\n---\n\n# Their adapter\n\nTrained on X.\n",
        )
        .unwrap();
        write_model_card(&dir, Some("Qwen/Qwen2.5-VL-3B-Instruct"), AdapterLayout::Hub).unwrap();
        write_model_card(&dir, Some("Qwen/Qwen2.5-VL-3B-Instruct"), AdapterLayout::Transformers5).unwrap();
        let text = std::fs::read_to_string(&card).unwrap();
        let front = text.strip_prefix("---\n").unwrap().split_once("\n---\n").unwrap().0;
        let lines: Vec<&str> = front.lines().collect();
        assert_eq!(
            lines,
            [
                "license: apache-2.0",
                "library_name: peft",
                "askgui_key_layout: transformers5",
                &format!("askgui_version: {}", env!("CARGO_PKG_VERSION"))
            ]
        );
        assert!(text.contains("# Their adapter\n\nTrained on X."), "{text}");
        assert_eq!(text.matches(SECTION_BEGIN).count(), 1, "{text}");
        assert!(text.contains("`transformers5` layout") && !text.contains("`hub` layout"), "{text}");

        // A fresh card names the base model and PEFT, as PEFT's own does.
        std::fs::remove_file(&card).unwrap();
        write_model_card(&dir, Some("C:\\models: x"), AdapterLayout::Hub).unwrap();
        let text = std::fs::read_to_string(&card).unwrap();
        assert!(text.starts_with("---\nbase_model: \"C:\\\\models: x\"\nlibrary_name: peft\n"), "{text}");
        assert!(text.contains("askgui_key_layout: hub\n"), "{text}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn targets_match_by_suffix() {
        assert!(matches_target("model.layers.0.self_attn.q_proj", "q_proj"));
        assert!(matches_target("model.layers.0.self_attn.q_proj", "self_attn.q_proj"));
        assert!(!matches_target("model.layers.0.self_attn.q_proj", "_proj"));
        // Full names in either layout.
        assert!(matches_target("model.layers.0.self_attn.q_proj", "model.language_model.layers.0.self_attn.q_proj"));
        assert!(matches_target("visual.blocks.1.attn.qkv", "model.visual.blocks.1.attn.qkv"));
        assert!(!matches_target("model.layers.1.self_attn.q_proj", "model.language_model.layers.0.self_attn.q_proj"));
    }
}
