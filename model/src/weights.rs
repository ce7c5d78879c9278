//! Weight files: finding and memory-mapping a checkpoint's weights (a local directory or a hub id,
//! single-file or sharded safetensors). Not training snapshots (`askgui-train`) nor recomputation
//! ([`crate::recompute`]).
//!
//! Hub ids go through `hf-hub`. Offline (no network, or `HF_HUB_OFFLINE=1`) only the local cache is used,
//! and a missing file is an error that names the file, the cache directory searched and how to fix it.
//! Tensor names are looked up in the hub layout (`model.layers.N`, `visual.*`) and, failing that, in the
//! transformers 5 in-memory layout (`model.language_model.layers.N`, `model.visual.*`), so checkpoints saved
//! either way load.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

/// The files of one checkpoint, all on local disk.
#[derive(Debug, Clone)]
pub struct CheckpointFiles {
    /// The directory (or hub snapshot) the files came from, for messages.
    pub dir: PathBuf,
    pub config: PathBuf,
    pub weights: Vec<PathBuf>,
    pub tokenizer: Option<PathBuf>,
    pub preprocessor: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
}

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// Shard file names listed by a `model.safetensors.index.json`, in first-use order.
fn shard_names(index: &Path) -> Result<Vec<String>> {
    let err = |reason: String| ModelError::Checkpoint { dir: index.to_path_buf(), reason };
    let text = std::fs::read_to_string(index).map_err(|e| err(format!("cannot read: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("invalid JSON: {e}")))?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| err("no `weight_map` object".into()))?;
    let mut names: Vec<String> = Vec::new();
    for f in map.values().filter_map(|f| f.as_str()) {
        if !names.iter().any(|n| n == f) {
            names.push(f.to_string());
        }
    }
    if names.is_empty() {
        return Err(err("`weight_map` lists no files".into()));
    }
    Ok(names)
}

fn existing(p: PathBuf) -> Option<PathBuf> {
    p.is_file().then_some(p)
}

impl CheckpointFiles {
    /// A local directory or a hub id (`org/name`).
    pub fn resolve(model: &str) -> Result<Self> {
        let path = Path::new(model);
        if path.is_dir() {
            return Self::from_dir(path);
        }
        let looks_like_id = model.split('/').count() == 2
            && !model.starts_with(['.', '/', '~'])
            && model.split('/').all(|s| !s.is_empty());
        if looks_like_id && !path.exists() {
            return Self::from_hub(model);
        }
        Err(ModelError::Checkpoint {
            dir: path.to_path_buf(),
            reason: "not a directory, and not a hub id of the form `org/name`".into(),
        })
    }

    /// A local checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let err = |reason: String| ModelError::Checkpoint { dir: dir.to_path_buf(), reason };
        let config = existing(dir.join("config.json")).ok_or_else(|| err("no config.json".into()))?;
        let weights = if let Some(index) = existing(dir.join(INDEX)) {
            let mut files = Vec::new();
            for name in shard_names(&index)? {
                files.push(
                    existing(dir.join(&name))
                        .ok_or_else(|| err(format!("{INDEX} lists `{name}`, which is missing")))?,
                );
            }
            files
        } else {
            vec![existing(dir.join(SINGLE)).ok_or_else(|| err(format!("neither {SINGLE} nor {INDEX} is present")))?]
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
            tokenizer: existing(dir.join("tokenizer.json")),
            preprocessor: existing(dir.join("preprocessor_config.json")),
            generation_config: existing(dir.join("generation_config.json")),
        })
    }

    /// A hub id: download through hf-hub where the hub is reachable, else the local cache.
    pub fn from_hub(id: &str) -> Result<Self> {
        let offline = std::env::var("HF_HUB_OFFLINE").map(|v| v == "1" || v == "true").unwrap_or(false);
        let cache = hf_hub::Cache::from_env();
        if !offline {
            if let Ok(api) = hf_hub::api::sync::Api::new() {
                let repo = api.model(id.to_string());
                if let Ok(config) = repo.get("config.json") {
                    let get = |f: &str| repo.get(f).ok();
                    return Self::from_fetched(id, config, get);
                }
            }
            tracing::warn!("hub not reachable for `{id}`; using the local cache at {}", cache.path().display());
        }
        Self::from_cache(id, &cache, offline)
    }

    /// A hub id from an hf-hub cache directory only (no network).
    pub fn from_cache(id: &str, cache: &hf_hub::Cache, offline: bool) -> Result<Self> {
        let repo = cache.repo(hf_hub::Repo::model(id.to_string()));
        let why = if offline { "HF_HUB_OFFLINE is set" } else { "the hub is not reachable" };
        let config = repo.get("config.json").ok_or_else(|| ModelError::Hub {
            id: id.into(),
            reason: format!(
                "{why} and config.json is not in the local cache at {}; download the model where the hub is reachable or pass a local directory",
                cache.path().display()
            ),
        })?;
        let get = |f: &str| repo.get(f);
        let files = Self::from_fetched(id, config, get);
        files.map_err(|e| match e {
            ModelError::Hub { id, reason } => {
                ModelError::Hub { id, reason: format!("{why}; {reason} (cache: {})", cache.path().display()) }
            }
            e => e,
        })
    }

    fn from_fetched(id: &str, config: PathBuf, get: impl Fn(&str) -> Option<PathBuf>) -> Result<Self> {
        let missing =
            |f: &str| ModelError::Hub { id: id.into(), reason: format!("`{f}` could not be found or downloaded") };
        let weights = match get(INDEX) {
            Some(index) => {
                let mut files = Vec::new();
                for name in shard_names(&index)? {
                    files.push(get(&name).ok_or_else(|| missing(&name))?);
                }
                files
            }
            None => vec![get(SINGLE).ok_or_else(|| missing(SINGLE))?],
        };
        Ok(Self {
            dir: config.parent().map(Path::to_path_buf).unwrap_or_default(),
            config,
            weights,
            tokenizer: get("tokenizer.json"),
            preprocessor: get("preprocessor_config.json"),
            generation_config: get("generation_config.json"),
        })
    }

    /// End-of-sequence ids from `generation_config.json`, if it lists any.
    pub fn generation_eos_ids(&self) -> Vec<u32> {
        let Some(p) = &self.generation_config else { return vec![] };
        let Ok(text) = std::fs::read_to_string(p) else { return vec![] };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { return vec![] };
        match v.get("eos_token_id") {
            Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
            _ => vec![],
        }
    }
}

/// Memory-mapped weights with shape checks and the two key layouts.
pub struct Weights {
    dir: PathBuf,
    files: Vec<(PathBuf, MmapedSafetensors)>,
    /// tensor name -> index into `files`
    index: HashMap<String, usize>,
    dtype: DType,
    device: Device,
}

/// The transformers 5 in-memory name for a hub-layout name, if it differs.
fn alternate_name(name: &str) -> Option<String> {
    let alt = crate::peft::AdapterLayout::Transformers5.module_name(name);
    (alt != name).then_some(alt)
}

impl Weights {
    pub fn open(files: &CheckpointFiles, dtype: DType, device: &Device) -> Result<Self> {
        let mut mapped = Vec::new();
        let mut index = HashMap::new();
        for path in &files.weights {
            // SAFETY: the file is mapped read-only; like every safetensors loader we rely on nobody
            // truncating the checkpoint while it is loaded.
            let st = unsafe { MmapedSafetensors::new(path) }.map_err(|e| ModelError::Checkpoint {
                dir: path.clone(),
                reason: format!("not a readable safetensors file: {e}"),
            })?;
            for (name, _) in st.tensors() {
                index.insert(name, mapped.len());
            }
            mapped.push((path.clone(), st));
        }
        Ok(Self { dir: files.dir.clone(), files: mapped, index, dtype, device: device.clone() })
    }

    /// The stored name for `name`, trying the hub layout first.
    fn stored_name(&self, name: &str) -> Option<String> {
        if self.index.contains_key(name) {
            return Some(name.to_string());
        }
        alternate_name(name).filter(|alt| self.index.contains_key(alt))
    }

    pub fn contains(&self, name: &str) -> bool {
        self.stored_name(name).is_some()
    }

    /// Loads `name` with exactly `shape`, converted to the model dtype and device.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let stored = self.stored_name(name).ok_or_else(|| ModelError::MissingTensor {
            dir: self.dir.clone(),
            name: name.into(),
            tried: match alternate_name(name) {
                Some(alt) => format!("`{name}` and `{alt}`"),
                None => format!("`{name}`"),
            },
        })?;
        let (path, st) = &self.files[self.index[&stored]];
        let view = st.get(&stored).map_err(|e| ModelError::Checkpoint { dir: path.clone(), reason: e.to_string() })?;
        if view.shape() != shape {
            return Err(ModelError::TensorShape {
                dir: path.clone(),
                name: stored,
                got: view.shape().to_vec(),
                want: shape.to_vec(),
            });
        }
        let t = st
            .load(&stored, &Device::Cpu)
            .map_err(|e| ModelError::Checkpoint { dir: path.clone(), reason: format!("tensor `{stored}`: {e}") })?;
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
    }
}
