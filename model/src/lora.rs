//! LoRA adapters on the model: load, activate, merge, unmerge, save (inference side).
//!
//! A LoRA adapter adds to a frozen linear `y = x W^T + b` the low-rank term `scale * (x A^T) B^T` with
//! `A (r, in)`, `B (out, r)` and `scale = lora_alpha / r` (Hu et al. 2021, "LoRA"; PEFT's `LoraLayer`).
//! Every [`crate::layers::Linear`] holds, in its [`LoraSlot`], the deltas of every adapter loaded for it;
//! the model keeps the adapters' configs and tensors by name ([`LoraState`]). Key choice: one adapter
//! (or none, the base model) is active for a plain forward, chosen with [`Qwen2Vl::set_active_adapter`];
//! loading does not activate. A server's batch mixes adapters instead: its forwards name each row's
//! adapter ([`RowAdapters`], built by [`Qwen2Vl::row_adapters`]).
//! Merging folds `W += scale * B A` into the weights and keeps the original `W`, so
//! [`Qwen2Vl::unmerge_adapter`] restores it bit-exactly; while merged, the adapter stays the active one.
//! Files are PEFT's ([`crate::peft`]): [`Qwen2Vl::save_adapter`] writes the keys PEFT writes on
//! transformers 5 ([`AdapterLayout::default`]), [`Qwen2Vl::save_adapter_as`] either layout (the hub's is
//! what vLLM, SGLang and PEFT on transformers 4 load). Dropout only acts in training ([`crate::train_ops`]). Parity with PEFT:
//! `tests/lora.rs`.

use std::collections::BTreeMap;
use std::path::Path;

pub use crate::adapter_slot::{LoraDelta, LoraSlot, RowAdapters};
use crate::error::{ModelError, Result};
use crate::model::Qwen2Vl;
use crate::peft::{read_adapter, write_adapter};
pub use crate::peft::{Adapter, AdapterLayout, LoraConfig, LoraState, TargetModules, CONFIG_FILE, WEIGHTS_FILE};

impl Qwen2Vl {
    /// Loads the PEFT adapter in `dir` under `name`, checked against this model. It is not activated:
    /// call [`Self::set_active_adapter`]. On error the model is unchanged.
    pub fn load_adapter(&mut self, name: &str, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        if self.lora.adapters.contains_key(name) {
            return Err(ModelError::Adapter {
                dir: dir.to_path_buf(),
                reason: format!("an adapter named `{name}` is already loaded; remove it first or pick another name"),
            });
        }
        let arch = format!("{:?}", self.arch());
        let mut linears = BTreeMap::new();
        for l in self.linears() {
            let (out, inp) = l.weight.dims2()?;
            linears.insert(l.name.clone(), (out, inp));
        }
        let adapter = read_adapter(dir, &linears, &arch)?;
        let (dtype, device) = (self.dtype(), self.device.clone());
        let mut modules = BTreeMap::new();
        for (m, (a, b)) in adapter.modules {
            modules.insert(m, (a.to_dtype(dtype)?.to_device(&device)?, b.to_dtype(dtype)?.to_device(&device)?));
        }
        let scale = adapter.config.scale();
        for l in self.linears_mut() {
            if let Some((a, b)) = modules.get(&l.name) {
                l.lora.adapters.insert(name.to_string(), LoraDelta { a: a.clone(), b: b.clone(), scale });
            }
        }
        tracing::info!(
            adapter = name,
            dir = %dir.display(),
            r = adapter.config.r,
            scale,
            modules = modules.len(),
            base = adapter.config.base_model_name_or_path.as_deref().unwrap_or("?"),
            "loaded LoRA adapter"
        );
        self.lora.adapters.insert(name.to_string(), Adapter { config: adapter.config, modules });
        Ok(())
    }

    /// Chooses the adapter applied by every forward from now on; `None` runs the base model.
    pub fn set_active_adapter(&mut self, name: Option<&str>) -> Result<()> {
        if let Some(n) = name {
            self.adapter_or_err(n)?;
        }
        if let Some(m) = &self.lora.merged {
            if name != Some(m.as_str()) {
                return Err(
                    self.state_err(format!("adapter `{m}` is merged into the weights; unmerge it before switching"))
                );
            }
        }
        self.lora.active = name.map(str::to_string);
        for l in self.linears_mut() {
            l.lora.active = name.map(str::to_string);
        }
        Ok(())
    }

    /// The plan of a forward whose rows apply their own adapters: consecutive `runs` of `(rows, adapter)`
    /// (None: the base model). Every adapter must be loaded; while one is merged into the weights, every
    /// row must apply it (the others' rows would see the merged weights).
    pub fn row_adapters(&self, runs: &[(usize, Option<&str>)]) -> Result<RowAdapters> {
        for (_, name) in runs {
            if let Some(n) = name {
                self.adapter_or_err(n)?;
            }
            if let Some(m) = self.lora.merged.as_deref().filter(|&m| *name != Some(m)) {
                return Err(self.state_err(format!(
                    "adapter `{m}` is merged into the weights; unmerge it to mix adapters in one forward"
                )));
            }
        }
        Ok(RowAdapters::from_runs(runs, &self.device)?)
    }

    /// The adapter every forward applies (None: the base model).
    pub fn active_adapter(&self) -> Option<&str> {
        self.lora.active.as_deref()
    }

    /// The adapter merged into the base weights, if any.
    pub fn merged_adapter(&self) -> Option<&str> {
        self.lora.merged.as_deref()
    }

    /// Names of the loaded adapters, sorted.
    pub fn adapter_names(&self) -> Vec<&str> {
        self.lora.adapters.keys().map(String::as_str).collect()
    }

    /// A loaded adapter's config and tensors.
    pub fn adapter(&self, name: &str) -> Option<&Adapter> {
        self.lora.adapters.get(name)
    }

    /// Drops a loaded adapter (deactivating it if active). A merged adapter must be unmerged first.
    pub fn remove_adapter(&mut self, name: &str) -> Result<()> {
        self.adapter_or_err(name)?;
        if self.lora.merged.as_deref() == Some(name) {
            return Err(self.state_err(format!("adapter `{name}` is merged; unmerge it before removing it")));
        }
        if self.lora.active.as_deref() == Some(name) {
            self.set_active_adapter(None)?;
        }
        self.lora.adapters.remove(name);
        for l in self.linears_mut() {
            l.lora.adapters.remove(name);
        }
        Ok(())
    }

    /// Folds `W += scale * B A` of adapter `name` into the base weights and makes it the active adapter.
    /// The original weights are kept for [`Self::unmerge_adapter`].
    pub fn merge_adapter(&mut self, name: &str) -> Result<()> {
        self.adapter_or_err(name)?;
        match self.lora.merged.as_deref() {
            Some(m) if m == name => return Ok(()),
            Some(m) => return Err(self.state_err(format!("adapter `{m}` is already merged; unmerge it first"))),
            None => {}
        }
        // Compute every new weight before changing any, so an error leaves the model unchanged.
        let mut merged = Vec::new();
        for l in self.linears_mut() {
            if let Some(d) = l.lora.adapters.get(name) {
                merged.push(Some((l.weight.clone() + d.dense(l.weight.dtype())?)?));
            } else {
                merged.push(None);
            }
        }
        for (l, w) in self.linears_mut().into_iter().zip(merged) {
            if let Some(w) = w {
                let original = std::mem::replace(&mut l.weight, w);
                l.lora.merged = Some((name.to_string(), original));
            }
        }
        self.lora.merged = Some(name.to_string());
        self.set_active_adapter(Some(name))
    }

    /// Folds adapter `name` into the base weights for good, as PEFT's `merge_and_unload`: afterwards the
    /// model is a plain model that keeps neither the original weights nor any adapter (the others were
    /// trained against the old weights, so they are dropped too). For a process that only ever runs this
    /// adapter (an evaluation) a forward then costs what the base model's does: no low-rank matmuls beside
    /// each linear, and no second copy of its weights once the merge is done.
    pub fn merge_and_unload(&mut self, name: &str) -> Result<()> {
        self.merge_adapter(name)?;
        for l in self.linears_mut() {
            l.lora = LoraSlot::default();
        }
        self.lora = LoraState::default();
        Ok(())
    }

    /// Restores the base weights kept by [`Self::merge_adapter`] (bit-exact); `name` stays active,
    /// now applied as an unmerged delta.
    pub fn unmerge_adapter(&mut self, name: &str) -> Result<()> {
        if self.lora.merged.as_deref() != Some(name) {
            return Err(self.state_err(format!(
                "adapter `{name}` is not merged (merged: {})",
                self.lora.merged.as_deref().unwrap_or("none")
            )));
        }
        for l in self.linears_mut() {
            if let Some((_, original)) = l.lora.merged.take() {
                l.weight = original;
            }
        }
        self.lora.merged = None;
        Ok(())
    }

    /// Writes adapter `name` as PEFT on transformers 5 does: `adapter_config.json`,
    /// `adapter_model.safetensors` in [`AdapterLayout::default`] and the model card (`README.md`).
    pub fn save_adapter(&self, name: &str, dir: impl AsRef<Path>) -> Result<()> {
        self.save_adapter_as(name, dir, AdapterLayout::default())
    }

    /// [`Self::save_adapter`] with the tensor keys in `layout`.
    pub fn save_adapter_as(&self, name: &str, dir: impl AsRef<Path>, layout: AdapterLayout) -> Result<()> {
        write_adapter(dir.as_ref(), self.adapter_or_err(name)?, layout)
    }

    fn adapter_or_err(&self, name: &str) -> Result<&Adapter> {
        self.lora.adapters.get(name).ok_or_else(|| {
            self.state_err(format!("no adapter named `{name}` is loaded (loaded: {:?})", self.adapter_names()))
        })
    }

    fn state_err(&self, reason: String) -> ModelError {
        ModelError::AdapterState(reason)
    }
}
