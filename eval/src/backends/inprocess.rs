//! The in-process backend: a Qwen2.5-VL / Qwen2-VL checkpoint run by askgui-model (`--device`, `--dtype`,
//! `--kernels`), greedy.
//!
//! The prompt is the training prompt rendered in ChatML; each screenshot goes through the checkpoint's own
//! image processor (`preprocessor_config.json`), and for the `resized` frame the model frame is the size
//! that processor resized the current screenshot to, so the coordinates in the prompt and in the answer are
//! pixels of exactly the image the vision tower saw. The prompt flags left unset take the adapter's (or a
//! merged model folder's) `askgui.json`, whose pixel bounds replace the processor's, as a given
//! `--min-pixels`/`--max-pixels` does. Predictions are serialised through a mutex: one CPU model answering
//! several steps at once would only split the same cores.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use askgui_data::{render_chatml, AdapterCard, FrameKind, FrameMap, PromptConfig, PromptFlags};
use askgui_model::{
    generate, load_image, preprocess, LoadOptions, ModelError, ProcessedImage, Prompt, Qwen2Vl, QwenTokenizer,
    SamplingParams,
};
use candle_core::Device;

use super::{frame_for, messages_for, prediction_from_reply, prompt_screenshots};
use crate::agent::{Agent, AgentError, Prediction, StepInput};
use crate::identity::{adapter_fingerprint, canonical, AgentIdentity, Decoding, PromptIdentity, Runtime};

struct Loaded {
    model: Qwen2Vl,
    tokenizer: QwenTokenizer,
}

/// A checkpoint evaluated in this process.
pub struct InProcessAgent {
    inner: Mutex<Loaded>,
    name: String,
    identity: AgentIdentity,
    prompt: PromptConfig,
    max_new_tokens: usize,
    stop_tokens: Vec<u32>,
}

/// Errors about the input (an unreadable or unusable screenshot) are the step's, not the model's.
fn model_err(e: ModelError) -> AgentError {
    match e {
        ModelError::Image { .. }
        | ModelError::ImageTooLarge { .. }
        | ModelError::ImageTooSmall { .. }
        | ModelError::Tiling { .. } => AgentError::Input(e.to_string()),
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
        max_new_tokens: usize,
        load: LoadOptions,
    ) -> Result<Self, AgentError> {
        let (device, dtype) = load.resolve().map_err(model_err)?;
        tracing::info!("evaluating on {device:?} with {dtype:?} weights");
        let mut m = Qwen2Vl::load_with(model, &device, dtype, load.kernels).map_err(model_err)?;
        let card_dir = adapter.unwrap_or(&m.files.dir).to_path_buf();
        let card = AdapterCard::read(&card_dir).map_err(|e| AgentError::Model(e.to_string()))?;
        if let Some(c) = &card {
            tracing::info!(
                ?c,
                "prompt and image settings from {}",
                card_dir.join(askgui_data::adapter_card::FILE).display()
            );
        }
        let flags = prompt.with_card(card.as_ref());
        let ic = &mut m.image_config;
        ic.min_pixels = flags.min_pixels.unwrap_or(ic.min_pixels);
        ic.max_pixels = flags.max_pixels.unwrap_or(ic.max_pixels);
        if ic.min_pixels > ic.max_pixels {
            return Err(AgentError::Model(format!(
                "min_pixels {} > max_pixels {}: give --min-pixels and --max-pixels that fit",
                ic.min_pixels, ic.max_pixels
            )));
        }
        let prompt = PromptConfig { min_pixels: ic.min_pixels, max_pixels: ic.max_pixels, ..flags.config() };
        if let Some(dir) = adapter {
            // This agent only ever runs this adapter, so it is folded into the weights and each forward
            // costs the base model's (measured on a 2-core CPU, the demo's LoRA agent on 40 episodes in
            // two modes: 4.6 s unmerged, 3.8 s merged, the same predictions).
            m.load_adapter("adapter", dir).map_err(model_err)?;
            m.merge_and_unload("adapter").map_err(model_err)?;
        }
        let mut agent = Self::from_model(m, prompt, max_new_tokens)?;
        let local = Path::new(model).is_dir();
        if !local {
            // A hub id names its revision through the snapshot folder the files came from.
            let inner = agent.inner.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
            let snapshot = inner.model.files.dir.file_name().map(|s| s.to_string_lossy().into_owned());
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

    /// Wraps a loaded model; stops on the checkpoint's end-of-sequence ids and `<|im_end|>`.
    pub fn from_model(model: Qwen2Vl, prompt: PromptConfig, max_new_tokens: usize) -> Result<Self, AgentError> {
        let tokenizer = model.tokenizer().map_err(|e| AgentError::Model(e.to_string()))?;
        let mut stop_tokens = model.eos_token_ids.clone();
        if let Some(id) = tokenizer.token_id(askgui_data::prompt::IM_END) {
            if !stop_tokens.contains(&id) {
                stop_tokens.push(id);
            }
        }
        let name = format!("in-process {}", model.files.dir.display());
        let identity = identity_of(&model, &prompt, max_new_tokens);
        Ok(Self { inner: Mutex::new(Loaded { model, tokenizer }), name, identity, prompt, max_new_tokens, stop_tokens })
    }

    /// Gives the model back, with its adapters as they are (a trainer lends its model for a periodic eval).
    pub fn into_model(self) -> Qwen2Vl {
        self.inner.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner()).model
    }

    /// The model frame for this step. For `resized`, the size the processor gave the current screenshot.
    fn frame(&self, input: &StepInput, model: &Qwen2Vl, current: &ProcessedImage) -> Result<FrameMap, AgentError> {
        let ic = &model.image_config;
        let cfg = PromptConfig { min_pixels: ic.min_pixels, max_pixels: ic.max_pixels, ..self.prompt.clone() };
        let mut frame = frame_for(input, &cfg)?;
        if frame.kind == FrameKind::Resized {
            let seen = (current.resized.0 as u32, current.resized.1 as u32);
            if seen != frame.model {
                tracing::debug!(
                    episode = %input.episode_id,
                    step = input.step,
                    screen = ?frame.screen,
                    screenshot = ?current.original,
                    "the screenshot's size differs from the episode's screen; using the size the model saw"
                );
                frame.model = seen;
            }
        }
        Ok(frame)
    }

    /// The raw reply to one step's prompt, with the frame it is in.
    fn reply(&self, input: &StepInput) -> Result<(String, FrameMap), AgentError> {
        let screenshots: Vec<PathBuf> = prompt_screenshots(input, &self.prompt)?;
        let guard = self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Loaded { model, tokenizer } = &*guard;
        let ic = &model.image_config;
        let mut images = Vec::with_capacity(screenshots.len());
        for p in &screenshots {
            let img = load_image(p, ic.max_input_pixels).map_err(model_err)?;
            images.push(preprocess(&img, ic).map_err(model_err)?);
        }
        let Some(current) = images.last() else {
            return Err(AgentError::Input("no screenshot to show the agent".into()));
        };
        let frame = self.frame(input, model, current)?;
        let rendered = render_chatml(&messages_for(input, &self.prompt, frame, screenshots.clone()), true);
        if rendered.images != screenshots {
            return Err(AgentError::Model(format!(
                "the prompt shows {} images but {} screenshots were prepared",
                rendered.images.len(),
                screenshots.len()
            )));
        }
        let merge = ic.geometry.merge_size;
        let counts: Vec<usize> = images.iter().map(|i| i.num_tokens(merge)).collect();
        let ids = tokenizer.encode_prompt(&rendered.text, &counts).map_err(model_err)?;
        let params = SamplingParams {
            max_new_tokens: self.max_new_tokens,
            temperature: 0.0,
            stop_tokens: self.stop_tokens.clone(),
            ..Default::default()
        };
        let (gens, _) = generate(model, &[Prompt { ids, images }], &params, false).map_err(model_err)?;
        let mut tokens = gens.into_iter().next().map(|g| g.tokens).unwrap_or_default();
        if tokens.last().is_some_and(|t| self.stop_tokens.contains(t)) {
            tokens.pop();
        }
        let raw = tokenizer.decode(&tokens, true).map_err(model_err)?;
        Ok((raw, frame))
    }
}

/// The identity of `model` answering greedily with `prompt`: its folder, the adapter it runs by name (a
/// lent model's; [`InProcessAgent::load`] puts the directory and fingerprint instead), the pixel bounds of
/// its own processor, its device, dtype and kernels.
fn identity_of(model: &Qwen2Vl, prompt: &PromptConfig, max_new_tokens: usize) -> AgentIdentity {
    let ic = &model.image_config;
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
        decoding: Decoding::greedy(max_new_tokens),
        prompt: PromptIdentity {
            min_pixels: Some(ic.min_pixels),
            max_pixels: Some(ic.max_pixels),
            ..PromptIdentity::of(prompt)
        },
        runtime: Some(Runtime {
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
        let (raw, frame) = self.reply(input)?;
        Ok(prediction_from_reply(raw, &frame))
    }
}
