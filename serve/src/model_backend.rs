//! The model backend: a Qwen2.5-VL / Qwen2-VL checkpoint (and its LoRA adapters) behind [`Backend`].
//!
//! Key choice: continuous batching ([`crate::batcher`]). Each job runs the agent runtime
//! ([`askgui_runtime::Runtime`], the decoding `askgui-eval` and the trainer's eval run too) on a thread of
//! its own and asks for forwards through a [`Client`]; the one thread that owns the model (`runner`) runs
//! every live job's next forward (prefills and decode steps alike) as one packed pass. `jobs` turns a
//! request into the runtime's step or completion. The serve README's "How the model answers" tells the
//! decoding from the caller's side.

mod jobs;
mod runner;

use std::path::PathBuf;

use anyhow::{bail, Context};
use askgui_data::agent_api::AgentStepResponse;
use askgui_data::{AdapterCard, PromptConfig, PromptFlags};
use askgui_model::{DTypeChoice, DeviceKind, KernelChoice, Quantize, Qwen2Vl};
use askgui_runtime::{apply_image_bounds, Packed, Runtime};

pub use crate::backend::PauseLevels;
use crate::backend::{Backend, BackendError, BackendInfo, ChatJob, ChatOutput, Intake, Job, StepJob};
use crate::batcher::{Batcher, Client};
use crate::config::Config;
pub use jobs::runtime_step;
use jobs::Jobs;
use runner::Runner;
pub use runner::PREFILL_CHUNK;

/// How the backend is built.
#[derive(Debug, Clone)]
pub struct ModelBackendConfig {
    /// A checkpoint directory or hub id.
    pub model: String,
    /// LoRA adapters (PEFT directories) by the name requests use.
    pub adapters: Vec<(String, PathBuf)>,
    /// Bytes of prompt KV caches kept for reuse ([`crate::prefix_cache`]); 0 turns reuse off.
    pub prefix_cache_bytes: usize,
    /// MiB for the KV caches of all jobs and cached prefixes together (0: no bound).
    pub kv_cache_mb: f64,
    /// The flags of the prompt settings (system prompt, pixel bounds); unset ones take the askgui.json
    /// of the adapters or of the model folder ([`served_card`]).
    pub prompt: PromptFlags,
    /// The pause threshold of requests that give none, over every card's calibrated level.
    pub pause_threshold: Option<f64>,
    /// Where the model runs (and so its weights' default dtype).
    pub device: DeviceKind,
    /// The weights' dtype (`auto`: the device's default).
    pub dtype: DTypeChoice,
    /// askgui's kernels or the plain-candle references.
    pub kernels: KernelChoice,
    /// Weight-only quantisation of the linears (CPU).
    pub quantize: Quantize,
    /// The most new tokens of one sequence in one forward (chunked prefill).
    pub prefill_chunk: usize,
}

impl From<&Config> for ModelBackendConfig {
    fn from(cfg: &Config) -> Self {
        Self {
            model: cfg.model.clone(),
            adapters: cfg.adapters.iter().map(|a| (a.name.clone(), a.dir.clone())).collect(),
            prefix_cache_bytes: cfg.prefix_cache_mb << 20,
            kv_cache_mb: cfg.kv_cache_mb,
            prompt: PromptFlags {
                system_prompt: cfg.system_prompt,
                frame: cfg.frame,
                action_language: cfg.action_language,
                min_pixels: cfg.min_pixels,
                max_pixels: cfg.max_pixels,
                elements: cfg.elements,
                history_images: cfg.history_images,
            },
            pause_threshold: cfg.pause_threshold,
            device: cfg.device,
            dtype: cfg.dtype,
            kernels: cfg.kernels,
            quantize: cfg.quantize,
            prefill_chunk: cfg.prefill_chunk,
        }
    }
}

/// The askgui.json the server's prompt settings default to: those of the model folder and of every
/// adapter (`cards`, by what they belong to) must agree on each setting no flag gives, since one server
/// builds every prompt alike; every disagreement is named at once.
pub fn served_card(flags: &PromptFlags, cards: &[(String, AdapterCard)]) -> anyhow::Result<Option<AdapterCard>> {
    let Some((first_name, first)) = cards.first() else { return Ok(None) };
    let mut conflicts = Vec::new();
    let mut settings: Vec<&str> = Vec::new();
    for (name, c) in cards {
        let differs = differing(flags, first, c);
        if !differs.is_empty() {
            let listed: Vec<String> = differs.iter().map(|(s, a, b)| format!("{s} {a} vs {b}")).collect();
            conflicts.push(format!("{first_name} and {name}: {}", listed.join(", ")));
            settings.extend(differs.iter().map(|d| d.0).filter(|s| !settings.contains(s)).collect::<Vec<_>>());
        }
    }
    if !conflicts.is_empty() {
        let flags: Vec<String> = settings.iter().map(|s| format!("--{s}")).collect();
        bail!(
            "the askgui.json cards disagree ({}): one server builds every prompt alike; give {} to serve them \
             with one value, or serve them from separate servers",
            conflicts.join("; "),
            flags.join(" and ")
        );
    }
    Ok(Some(first.clone()))
}

/// The settings no flag gives on which `b` differs from `a`: (flag, a's value, b's value).
fn differing(flags: &PromptFlags, a: &AdapterCard, b: &AdapterCard) -> Vec<(&'static str, String, String)> {
    fn named<T: clap::ValueEnum>(v: &T) -> String {
        v.to_possible_value().map(|p| p.get_name().to_string()).unwrap_or_default()
    }
    let (pa, pb) = (&a.prompt, &b.prompt);
    let candidates = [
        ("system-prompt", flags.system_prompt.is_none(), named(&pa.system_prompt), named(&pb.system_prompt)),
        ("frame", flags.frame.is_none(), named(&pa.frame), named(&pb.frame)),
        ("action-language", flags.action_language.is_none(), named(&pa.action_language), named(&pb.action_language)),
        ("min-pixels", flags.min_pixels.is_none(), a.image.min_pixels.to_string(), b.image.min_pixels.to_string()),
        ("max-pixels", flags.max_pixels.is_none(), a.image.max_pixels.to_string(), b.image.max_pixels.to_string()),
        ("elements", flags.elements.is_none(), pa.elements.to_string(), pb.elements.to_string()),
        (
            "history-images",
            flags.history_images.is_none(),
            pa.history_images.to_string(),
            pb.history_images.to_string(),
        ),
    ];
    candidates.into_iter().filter(|(_, unset, x, y)| *unset && x != y).map(|(s, _, x, y)| (s, x, y)).collect()
}

/// The model backend: the `Runner` that owns the model and the `Jobs` that answer requests.
pub struct ModelBackend {
    runner: Runner,
    jobs: Jobs,
}

impl ModelBackend {
    /// Loads the checkpoint on the configured device and dtype (by default f32 on the CPU, bf16 on a GPU)
    /// with the configured kernels, and every adapter; the prompt settings are the flags, else the
    /// adapters' (or model folder's) askgui.json, else the checkpoint's processor and the full prompt.
    pub fn load(cfg: &ModelBackendConfig) -> anyhow::Result<Self> {
        let (device, dtype) = cfg.device.pick_with(cfg.dtype)?;
        tracing::info!("serving on {device:?} with {dtype:?} weights");
        let mut model = Qwen2Vl::load_with(&cfg.model, &device, dtype, cfg.kernels)
            .with_context(|| format!("loading the model {}", cfg.model))?;
        if cfg.quantize == Quantize::Int8 {
            let n = model.quantize_int8().context("--quantize int8")?;
            tracing::info!("{n} linears quantised to int8 (weight-only, per-row scales)");
        }
        let mut cards = Vec::new();
        let mut pauses = PauseLevels::default();
        if let Some(c) = AdapterCard::read(&model.files.dir)? {
            pauses.base = c.pause_threshold();
            cards.push((format!("the model {}", cfg.model), c));
        }
        for (name, dir) in &cfg.adapters {
            model
                .load_adapter(name, dir)
                .with_context(|| format!("loading adapter `{name}` from {}", dir.display()))?;
            if let Some(c) = AdapterCard::read(dir)? {
                pauses.adapters.extend(c.pause_threshold().map(|t| (name.clone(), t)));
                cards.push((format!("adapter `{name}`"), c));
            }
        }
        if let Some(t) = cfg.pause_threshold {
            if pauses != PauseLevels::default() {
                tracing::warn!(?pauses, "--pause-threshold {t} overrides the calibrated levels of askgui.json");
            }
            let adapters = cfg.adapters.iter().map(|(name, _)| (name.clone(), t)).collect();
            pauses = PauseLevels { base: Some(t), adapters };
        } else if pauses != PauseLevels::default() {
            tracing::info!(?pauses, "calibrated pause thresholds (askgui.json); a request's pause_threshold wins");
        }
        let flags = cfg.prompt.with_card(served_card(&cfg.prompt, &cards)?.as_ref());
        apply_image_bounds(&mut model, &flags)?;
        let prompt = served_prompt(&flags, askgui_runtime::native_frame(model.arch()));
        let ic = &model.image_config;
        tracing::info!(?prompt.system_prompt, ?prompt.frame, min_pixels = ic.min_pixels, max_pixels = ic.max_pixels, "prompt settings");
        Ok(Self::new(model, &cfg.model, prompt)?
            .with_pause_levels(pauses)
            .with_prefix_cache(cfg.prefix_cache_bytes)
            .with_kv_cache_mb(cfg.kv_cache_mb)
            .with_prefill_chunk(cfg.prefill_chunk))
    }

    /// Wraps a loaded model (its adapters already loaded), served under `model_id` with `prompt`.
    pub fn new(model: Qwen2Vl, model_id: &str, prompt: PromptConfig) -> anyhow::Result<Self> {
        let runtime = Runtime::new(&model, prompt).context("the model's tokenizer")?;
        let mut adapters: Vec<String> = model.adapter_names().into_iter().map(String::from).collect();
        adapters.sort();
        let context_length = runtime.context_length();
        let history_images = runtime.prompt_config().history_images;
        let action_language = runtime.prompt_config().action_language;
        let pauses = PauseLevels::default();
        let info =
            BackendInfo { model: model_id.into(), adapters, context_length, pauses, history_images, action_language };
        let jobs = Jobs { runtime, info };
        let kv_pool = jobs.runtime.kv_pool().clone();
        Ok(Self { runner: Runner::new(Packed::new(model), kv_pool), jobs })
    }

    /// Sets the calibrated pause thresholds requests default to.
    pub fn with_pause_levels(mut self, pauses: PauseLevels) -> Self {
        self.jobs.info.pauses = pauses;
        self
    }

    /// [`Self::new`] with the default prompt settings.
    pub fn from_model(model: Qwen2Vl, model_id: &str) -> anyhow::Result<Self> {
        let native = askgui_runtime::native_frame(model.arch());
        Self::new(model, model_id, served_prompt(&PromptFlags::default(), native))
    }

    /// Sets the prefix cache's size in bytes (0: no reuse).
    pub fn with_prefix_cache(self, bytes: usize) -> Self {
        let Self { runner, jobs: Jobs { runtime, info } } = self;
        Self { runner, jobs: Jobs { runtime: runtime.with_prefix_cache(bytes), info } }
    }

    /// Bounds the KV caches of all jobs and cached prefixes to `megabytes` (0: no bound); a prompt that
    /// does not fit after dropping cached prefixes is answered 503.
    pub fn with_kv_cache_mb(self, megabytes: f64) -> Self {
        let Self { mut runner, jobs: Jobs { runtime, info } } = self;
        let runtime = runtime.with_kv_cache_mb(megabytes);
        runner.kv_pool = runtime.kv_pool().clone();
        Self { runner, jobs: Jobs { runtime, info } }
    }

    /// Sets the prefill chunk: the most new tokens of one sequence in one forward (`usize::MAX`: none).
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.runner.prefill_chunk = tokens.max(1);
        self
    }

    /// The runtime every job answers through (its prompt settings and tokenizer).
    pub fn runtime(&self) -> &Runtime {
        &self.jobs.runtime
    }

    /// One agent step with the model's active adapter (what `POST /v1/agent/step` runs, without a server).
    pub fn step(&mut self, job: &StepJob, cancelled: &dyn Fn() -> bool) -> Result<AgentStepResponse, BackendError> {
        let adapter = self.runner.packed.model.active_adapter().map(String::from);
        self.solo(|j, c| j.step(c, job, adapter.as_deref(), cancelled))
    }

    /// One chat completion with the model's active adapter, streaming text pieces to `stream`.
    pub fn chat(
        &mut self,
        job: &ChatJob,
        stream: Option<&tokio::sync::mpsc::UnboundedSender<String>>,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<ChatOutput, BackendError> {
        self.solo(|j, c| j.chat(c, job, stream, cancelled))
    }

    /// Runs one job's logic on this thread while the model runs its forwards on another.
    fn solo<T>(&mut self, work: impl FnOnce(&Jobs, &Client) -> T) -> T {
        let batcher = Batcher::default();
        let Self { runner, jobs } = self;
        let adapter = runner.packed.model.active_adapter().map(String::from);
        let device = runner.packed.model.device.clone();
        std::thread::scope(|s| {
            batcher.job_started();
            let owner = s.spawn(|| {
                bind_or_log(&device);
                runner.serve(&batcher, &mut crate::backend::NoIntake, &|_| {})
            });
            let out = work(jobs, &Client::new(&batcher, adapter));
            if let Err(p) = owner.join() {
                std::panic::resume_unwind(p);
            }
            out
        })
    }
}

/// Makes the model's CUDA context current on a job or forward thread (see [`askgui_model::bind_thread`]);
/// a failure is logged, and the job's first device operation then answers with the error.
fn bind_or_log(device: &candle_core::Device) {
    if let Err(e) = askgui_model::bind_thread(device) {
        tracing::error!(error = %e, "cannot use the GPU on this thread");
    }
}

/// The server's prompt settings: the flags (after askgui.json) and, unless a flag or card says otherwise, a
/// request's element list shown in askgui's JSON (the other languages point at pixels only); `native` is
/// the model family's frame, for when neither a flag nor a card sets one. The earlier screenshots shown
/// are the card's (`--history-images` of training), else none.
fn served_prompt(flags: &PromptFlags, native: askgui_data::FrameKind) -> PromptConfig {
    let json = flags.action_language.unwrap_or_default() == askgui_data::ActionLanguage::AskguiJson;
    PromptConfig { elements: flags.elements.unwrap_or(json), ..flags.config_in(native) }
}

impl Backend for ModelBackend {
    fn info(&self) -> BackendInfo {
        self.jobs.info.clone()
    }

    fn run(&mut self, jobs: Vec<Job>) {
        self.run_continuous(jobs, &mut crate::backend::NoIntake);
    }

    /// Every job on a thread of its own; this thread runs their forwards, packed, and takes in new jobs
    /// between forwards while fewer than `max_batch` are live.
    fn run_continuous(&mut self, jobs: Vec<Job>, intake: &mut dyn Intake) {
        let batcher = Batcher::default();
        let Self { runner, jobs: shared } = self;
        let shared = &*shared;
        let device = &runner.packed.model.device.clone();
        std::thread::scope(|s| {
            let start = |job: Job| {
                batcher.job_started();
                let batcher = &batcher;
                let body = move || {
                    bind_or_log(device);
                    shared.answer(&Client::new(batcher, job.adapter.clone()), job)
                };
                if let Err(e) = std::thread::Builder::new().name("askgui-job".into()).spawn_scoped(s, body) {
                    // The job (and its reply sender) went with the closure: its client gets a 500.
                    tracing::error!(error = %e, "cannot start a job thread");
                    batcher.not_started();
                }
            };
            jobs.into_iter().for_each(start);
            runner.serve(&batcher, intake, &start);
        });
    }
}
