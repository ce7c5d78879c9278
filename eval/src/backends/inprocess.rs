//! The in-process backend: a Qwen2.5-VL / Qwen2-VL checkpoint run by askgui-model (`--device`, `--dtype`,
//! `--kernels`) through the agent runtime ([`askgui_runtime::Runtime`]), the decoding `askgui-serve`
//! answers with: constrained by default, greedy unless `--temperature` says otherwise.
//!
//! The prompt flags left unset take the adapter's (or a merged model folder's) `askgui.json`, whose pixel
//! bounds replace the processor's, as a given `--min-pixels`/`--max-pixels` does; so does an unset
//! `--pause-threshold`, from the card's calibrated pause level. Predictions are
//! serialised through a mutex: one CPU model answering several steps at once would only split the same
//! cores.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use askgui_data::agent_api::StepOptions;
use askgui_data::{AdapterCard, PromptConfig, PromptFlags};
use askgui_model::{LoadOptions, Qwen2Vl};
use askgui_runtime::{apply_image_bounds, CompletionRequest, ImageInput, Packed, Runtime, RuntimeError, Solo, Step};
use candle_core::Device;

use super::prompt_screenshots;
use crate::agent::{Agent, AgentError, Prediction, StepInput};
use crate::identity::{adapter_fingerprint, canonical, AgentIdentity, Decoding, PromptIdentity};

/// A checkpoint evaluated in this process.
pub struct InProcessAgent {
    packed: Mutex<Packed>,
    runtime: Runtime,
    options: StepOptions,
    max_input_pixels: usize,
    name: String,
    identity: AgentIdentity,
}

/// A model that does not load (a wrong path, a bad checkpoint or adapter): the message names what to fix.
fn load_err(e: askgui_model::ModelError) -> AgentError {
    AgentError::Model(e.to_string())
}

/// Errors about the input (an unreadable or unusable screenshot) are the step's, not the model's.
fn runtime_err(e: RuntimeError) -> AgentError {
    match e {
        RuntimeError::BadInput(m) => AgentError::Input(m),
        e => AgentError::Model(e.to_string()),
    }
}

impl InProcessAgent {
    /// Loads a checkpoint directory or hub id on `load`'s device and dtype (by default f32 on the CPU,
    /// bf16 on a GPU) with its kernels, and a PEFT LoRA adapter merged into its weights when given (on
    /// bf16 weights the merged weight is rounded once, as PEFT's `merge_and_unload` does). Unset `prompt`
    /// flags take the adapter's askgui.json (else the model folder's, else their defaults).
    pub fn load(
        model: &str,
        adapter: Option<&Path>,
        prompt: &PromptFlags,
        mut options: StepOptions,
        load: LoadOptions,
    ) -> Result<Self, AgentError> {
        let (device, dtype) = load.resolve().map_err(load_err)?;
        tracing::info!("evaluating on {device:?} with {dtype:?} weights");
        let mut m = Qwen2Vl::load_with(model, &device, dtype, load.kernels).map_err(load_err)?;
        let card_dir = adapter.unwrap_or(&m.files.dir).to_path_buf();
        let card = AdapterCard::read(&card_dir).map_err(|e| AgentError::Model(e.to_string()))?;
        if let Some(c) = &card {
            let file = card_dir.join(askgui_data::adapter_card::FILE);
            tracing::info!(?c, "prompt and image settings from {}", file.display());
        }
        let flags = prompt.with_card(card.as_ref());
        if let Some(th) = card.as_ref().and_then(AdapterCard::pause_threshold) {
            match options.pause_threshold {
                Some(given) => tracing::info!("--pause-threshold {given} instead of the calibrated {th} (askgui.json)"),
                None => tracing::info!("pause threshold {th}, calibrated (askgui.json)"),
            }
            options.pause_threshold = options.pause_threshold.or(Some(th));
        }
        apply_image_bounds(&mut m, &flags).map_err(|e| AgentError::Model(e.to_string()))?;
        if let Some(dir) = adapter {
            // This agent only ever runs this adapter, so it is folded into the weights and each forward
            // costs the base model's (measured on a 2-core CPU, the demo's LoRA agent on 40 episodes in
            // two modes: 4.6 s unmerged, 3.8 s merged, the same predictions).
            m.load_adapter("adapter", dir).map_err(load_err)?;
            m.merge_and_unload("adapter").map_err(|e| runtime_err(e.into()))?;
        }
        let prompt = flags.config_in(askgui_runtime::native_frame(m.arch()));
        let mut agent = Self::from_model(m, prompt, options)?;
        if !Path::new(model).is_dir() {
            // A hub id names its revision through the snapshot folder the files came from.
            let dir = &agent.packed.get_mut().unwrap_or_else(|p| p.into_inner()).model.files.dir;
            let snapshot = dir.file_name().map(|s| s.to_string_lossy().into_owned());
            agent.identity.model = Some(format!("{model}@{}", snapshot.unwrap_or_default()));
        }
        if let Some(dir) = adapter {
            let fingerprint =
                adapter_fingerprint(dir).map_err(|e| AgentError::Model(format!("adapter {}: {e}", dir.display())))?;
            agent.identity.adapter = Some(canonical(dir));
            agent.identity.adapter_fingerprint = Some(fingerprint);
            agent.name = format!("{} + adapter {}", agent.name, dir.display());
        }
        Ok(agent)
    }

    /// Wraps a loaded model, answering with `prompt` (its pixel bounds are the model's processor's) and
    /// decoding `options`.
    pub fn from_model(model: Qwen2Vl, prompt: PromptConfig, options: StepOptions) -> Result<Self, AgentError> {
        let runtime = Runtime::new(&model, prompt).map_err(|e| AgentError::Model(e.to_string()))?;
        let name = format!("in-process {}", model.files.dir.display());
        let identity = identity_of(&model, runtime.prompt_config(), &options);
        let max_input_pixels = model.image_config.max_input_pixels;
        Ok(Self { packed: Mutex::new(Packed::new(model)), runtime, options, max_input_pixels, name, identity })
    }

    /// Gives the model back, with its adapters as they are (a trainer lends its model for a periodic eval).
    pub fn into_model(self) -> Qwen2Vl {
        self.packed.into_inner().unwrap_or_else(|p| p.into_inner()).model
    }

    /// The runtime this agent answers with (its prompt settings and tokenizer).
    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// A greedy free completion of the prompt `ids` that shows the screenshots at `paths`, through the
    /// runtime's sampler and stop rules (the trainer's sample predictions).
    pub fn complete(&self, ids: Vec<u32>, paths: &[PathBuf], max_tokens: usize) -> Result<String, AgentError> {
        let load = |p: &PathBuf| self.runtime.prepare(&ImageInput::load(p, self.max_input_pixels)?);
        let images = paths.iter().map(load).collect::<Result<Vec<_>, _>>().map_err(runtime_err)?;
        let req = CompletionRequest { ids, images, max_tokens, temperature: 0.0, top_p: 1.0, seed: 0, stop: vec![] };
        let mut packed = self.packed.lock().unwrap_or_else(|p| p.into_inner());
        let c = self.runtime.complete(&Solo::new(&mut packed), &req, &mut |_| {}, &|| false).map_err(runtime_err)?;
        Ok(c.text)
    }

    /// The screenshots the prompt shows, decoded.
    pub fn screenshots(&self, input: &StepInput) -> Result<Vec<ImageInput>, AgentError> {
        let paths = prompt_screenshots(input, self.runtime.prompt_config())?;
        paths.iter().map(|p| ImageInput::load(p, self.max_input_pixels).map_err(runtime_err)).collect()
    }
}

/// The runtime's step for an episode step with its `screenshots` decoded.
pub fn runtime_step<'a>(input: &'a StepInput, screenshots: &'a [ImageInput]) -> Step<'a> {
    Step {
        task: &input.task,
        history: &input.history,
        screenshots,
        elements: input.elements.as_deref(),
        screen: Some((input.screen.width, input.screen.height)),
    }
}

/// The identity of `model` answering with `prompt` and `options`: its folder, the adapter it runs by name
/// (a lent model's; [`InProcessAgent::load`] puts the directory and fingerprint instead), its device,
/// dtype and kernels.
fn identity_of(model: &Qwen2Vl, prompt: &PromptConfig, options: &StepOptions) -> AgentIdentity {
    let device = match &model.device {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
        Device::Metal(_) => "metal",
    };
    AgentIdentity {
        backend: "in-process".into(),
        model: Some(canonical(&model.files.dir)),
        url: None,
        adapter: model.merged_adapter().or(model.active_adapter()).map(str::to_string),
        adapter_fingerprint: None,
        decoding: Decoding::of(options),
        prompt: PromptIdentity::of(prompt),
        runtime: Some(crate::identity::Runtime {
            device: device.into(),
            dtype: format!("{:?}", model.dtype()).to_lowercase(),
            kernels: model.kernels(),
        }),
    }
}

impl Agent for InProcessAgent {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn identity(&self) -> AgentIdentity {
        self.identity.clone()
    }

    fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError> {
        let screenshots = self.screenshots(input)?;
        let step = runtime_step(input, &screenshots);
        let mut packed = self.packed.lock().unwrap_or_else(|p| p.into_inner());
        // Episodes run on worker threads, not the one that loaded the model.
        askgui_model::bind_thread(&packed.model.device).map_err(|e| AgentError::Model(e.to_string()))?;
        let out = self.runtime.step(&Solo::new(&mut packed), &step, &self.options, &|| false).map_err(runtime_err)?;
        let (action, parse_error) = match out.parsed {
            Ok((action, _)) => (Some(action), None),
            Err(e) => (None, Some(e)),
        };
        Ok(Prediction { action, raw: out.raw, parse_error, ask_probability: Some(out.ask_probability) })
    }
}
