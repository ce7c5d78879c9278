//! What a results folder is keyed on: who answered ([`AgentIdentity`]: backend, model, adapter with a
//! content fingerprint, decoding, prompt, runtime) and how the answers were scored ([`RunIdentity`]:
//! matching rule, episode file).
//!
//! A run stores its identity in `identity.json` beside its results; a later run into the same folder
//! continues only when its identity is equal, field by field ([`differences`] names every field that is
//! not). A field that is `null` does not apply to the backend or is left to its default. The evaluation
//! mode is not a field: each mode has its own results file, and each result line names its mode.

use std::io::Read;
use std::path::{Path, PathBuf};

use askgui_data::agent_api::StepOptions;
use askgui_data::{ActionLanguage, FrameKind, PromptConfig, SystemPrompt};
use askgui_model::KernelChoice;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::matching::MatchConfig;

/// The file in a results folder that holds its [`RunIdentity`].
pub const IDENTITY_FILE: &str = "identity.json";

/// The agent that answered: everything that can change its answers.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct AgentIdentity {
    /// `in-process`, `openai` or `askgui-serve`; an agent of a library user reports `custom`.
    pub backend: String,
    /// In-process: the checkpoint directory (canonical), or `org/name@<snapshot>` for a hub id; OpenAI:
    /// the model name sent; custom: the agent's name. None for askgui-serve, which serves its own.
    pub model: Option<String>,
    /// The URL requests go to (endpoints only).
    pub url: Option<String>,
    /// In-process: the adapter directory (canonical) or, for a lent model, the active adapter's name;
    /// askgui-serve: the adapter's name on the server.
    pub adapter: Option<String>,
    /// In-process adapter directories: size and FNV-1a 64 of `adapter_config.json` and
    /// `adapter_model.safetensors`, so an adapter retrained in place is another agent.
    pub adapter_fingerprint: Option<String>,
    pub decoding: Decoding,
    pub prompt: PromptIdentity,
    /// In-process only: where and how the weights run.
    pub runtime: Option<Runtime>,
}

/// Decoding options; None: not sent (the server's default) or not used by the backend.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Decoding {
    pub max_new_tokens: Option<usize>,
    /// 0: greedy.
    pub temperature: Option<f64>,
    pub seed: Option<u64>,
    pub constrain: Option<bool>,
    pub pause_threshold: Option<f64>,
}

impl Decoding {
    /// The decoding askgui's runtime runs for `options`, its defaults filled in (the in-process agent,
    /// and askgui-serve, which has the same defaults).
    pub fn of(options: &StepOptions) -> Self {
        Self {
            max_new_tokens: Some(options.max_tokens.unwrap_or(askgui_runtime::DEFAULT_STEP_TOKENS)),
            temperature: Some(options.temperature.unwrap_or(0.0)),
            seed: Some(options.seed.unwrap_or(0)),
            constrain: Some(options.constrain.unwrap_or(true)),
            pause_threshold: options.pause_threshold,
        }
    }

    /// Greedy decoding capped at `max_new_tokens` (an OpenAI-compatible endpoint's).
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self { max_new_tokens: Some(max_new_tokens), temperature: Some(0.0), ..Default::default() }
    }
}

/// The prompt options that apply to the backend; None where the backend (or its server) decides.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct PromptIdentity {
    pub frame: Option<FrameKind>,
    /// In-process: the checkpoint processor's, which is what applies there; endpoints: the flags.
    pub min_pixels: Option<usize>,
    pub max_pixels: Option<usize>,
    pub history_images: Option<usize>,
    pub elements: bool,
    pub system_prompt: Option<SystemPrompt>,
    /// Absent for askgui's JSON, so the identities of results written before languages still match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_language: Option<ActionLanguage>,
}

impl PromptIdentity {
    /// Every option of `cfg`, as a backend that builds the prompt itself uses them.
    pub fn of(cfg: &PromptConfig) -> Self {
        Self {
            frame: Some(cfg.frame),
            min_pixels: Some(cfg.min_pixels),
            max_pixels: Some(cfg.max_pixels),
            history_images: Some(cfg.history_images),
            elements: cfg.elements,
            system_prompt: Some(cfg.system_prompt),
            action_language: Some(cfg.action_language).filter(|l| *l != ActionLanguage::AskguiJson),
        }
    }
}

/// Where the in-process weights run.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Runtime {
    /// `cpu` or `cuda` (bf16 and f32 on either give different answers, the device index does not).
    pub device: String,
    /// `f32` or `bf16`.
    pub dtype: String,
    pub kernels: KernelChoice,
}

impl AgentIdentity {
    /// The identity of an agent that only has a name.
    pub fn custom(name: String) -> Self {
        Self {
            backend: "custom".into(),
            model: Some(name),
            url: None,
            adapter: None,
            adapter_fingerprint: None,
            decoding: Decoding::default(),
            prompt: PromptIdentity::default(),
            runtime: None,
        }
    }
}

/// A whole run's key: the agent, and the matching rule its results were scored with (each result line
/// holds the verdicts, not only the answers) on which episode file.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RunIdentity {
    pub agent: AgentIdentity,
    pub matching: MatchConfig,
    /// The episode file, canonical.
    pub episodes: String,
}

/// One field on which two identities differ, values as JSON (`null`: absent).
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    /// Dotted path, e.g. `agent.decoding.max_new_tokens`.
    pub field: String,
    pub stored: String,
    pub now: String,
}

/// Every field on which `stored` and `now` differ (an object that is `null` on one side is one field).
pub fn differences(stored: &RunIdentity, now: &RunIdentity) -> Vec<Difference> {
    let mut out = Vec::new();
    let json = |id| serde_json::to_value(id).unwrap_or(Value::Null);
    diff("", &json(stored), &json(now), &mut out);
    out
}

/// The leaves at which `a` and `b` differ, below the dotted path `path`.
fn diff(path: &str, a: &Value, b: &Value, out: &mut Vec<Difference>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let extra = y.keys().filter(|k| !x.contains_key(*k));
            for k in x.keys().chain(extra) {
                let sub = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                diff(&sub, x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null), out);
            }
        }
        _ if a != b => out.push(Difference { field: path.to_string(), stored: a.to_string(), now: b.to_string() }),
        _ => {}
    }
}

/// The identity stored in `dir`; None when there is no identity file.
pub fn read(dir: &Path) -> Result<Option<RunIdentity>, String> {
    let path = dir.join(IDENTITY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text).map(Some).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Writes `id` into `dir`; returns the file's path.
pub fn write(dir: &Path, id: &RunIdentity) -> std::io::Result<PathBuf> {
    let path = dir.join(IDENTITY_FILE);
    std::fs::write(&path, serde_json::to_string_pretty(id).unwrap_or_default() + "\n")?;
    Ok(path)
}

/// `path` made absolute with links resolved, as text; as given when it does not exist.
pub fn canonical(path: &Path) -> String {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf()).display().to_string()
}

/// Size and FNV-1a 64 of a PEFT adapter's two files, read in order. FNV is no defence against an
/// adversary, only against a different adapter; it needs no dependency and reads ~1 GB/s.
pub fn adapter_fingerprint(dir: &Path) -> std::io::Result<String> {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let (mut hash, mut size) = (OFFSET, 0u64);
    let mut buf = vec![0u8; 1 << 20];
    for name in [askgui_model::lora::CONFIG_FILE, askgui_model::lora::WEIGHTS_FILE] {
        let mut f = std::fs::File::open(dir.join(name))?;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            for &b in &buf[..n] {
                hash = (hash ^ u64::from(b)).wrapping_mul(PRIME);
            }
            size += n as u64;
        }
    }
    Ok(format!("{size} bytes, fnv1a64 {hash:016x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> RunIdentity {
        let mut agent = AgentIdentity::custom("m".into());
        agent.decoding = Decoding::greedy(128);
        RunIdentity { agent, matching: MatchConfig::default(), episodes: "/e.jsonl".into() }
    }

    #[test]
    fn equal_identities_have_no_difference_and_each_changed_field_is_named() {
        assert!(differences(&id(), &id()).is_empty());
        let mut now = id();
        now.agent.decoding.max_new_tokens = Some(64);
        now.agent.adapter = Some("/a".into());
        now.matching.distance = 0.1;
        let d = differences(&id(), &now);
        let fields: Vec<&str> = d.iter().map(|d| d.field.as_str()).collect();
        assert_eq!(fields, ["agent.adapter", "agent.decoding.max_new_tokens", "matching.distance"]);
        assert_eq!((d[0].stored.as_str(), d[0].now.as_str()), ("null", "\"/a\""));
        assert_eq!((d[1].stored.as_str(), d[1].now.as_str()), ("128", "64"));
    }

    #[test]
    fn a_runtime_that_appears_is_a_difference() {
        let mut now = id();
        now.agent.runtime =
            Some(Runtime { device: "cpu".into(), dtype: "f32".into(), kernels: KernelChoice::default() });
        let d = differences(&id(), &now);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].field, "agent.runtime");
    }

    #[test]
    fn fingerprints_tell_adapters_apart() -> std::io::Result<()> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures/lora");
        let a = adapter_fingerprint(&dir.join("tiny-qwen2_5_vl-peft"))?;
        assert_eq!(a, adapter_fingerprint(&dir.join("tiny-qwen2_5_vl-peft"))?);
        assert_ne!(a, adapter_fingerprint(&dir.join("tiny-qwen2_5_vl-peft-qv"))?);
        assert!(adapter_fingerprint(&dir).is_err(), "not an adapter directory");
        Ok(())
    }
}
