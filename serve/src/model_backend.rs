//! The model backend: a Qwen2.5-VL / Qwen2-VL checkpoint (and its LoRA adapters) behind [`Backend`].
//!
//! Agent steps: the prompt is the training prompt ([`askgui_data::prompt::step_messages`] in ChatML) with
//! the screenshot run through the checkpoint's own image processor; the model frame is the size that
//! processor resized the screenshot to (for the `resized` frame), so the coordinates the model reads and
//! writes are pixels of exactly the image it saw. The answer is decoded in three parts:
//!
//! 1. the action name: after the forced prefix `{"action":"`, every name's canonical tokens are scored
//!    from a copy of the KV cache, which gives the model's exact distribution over the 15 actions;
//!    `ask_probability` is its `ask` entry. The name is the most likely one (sampled at temperature > 0);
//!    with `pause_threshold` the answer is `ask` exactly when `ask_probability >= pause_threshold`;
//! 2. with `constrain` (the default) the arguments follow the action's schema as a template: literal
//!    keys are forced, integers may only use digit tokens and stay inside the model frame (coordinates)
//!    or 0..=60 (`wait` seconds), strings may not contain a quote or a
//!    backslash, enums are scored like names; the answer therefore always parses. `max_tokens` bounds the
//!    model's free choices (digits and string contents); the template's keys and brackets are always
//!    written, so a constrained answer can exceed it by those. Without `constrain`
//!    the model writes the rest freely and an answer that does not parse is an error;
//! 3. the action is parsed, converted to screen pixels, and answered with both frames.
//!
//! Chat completions run the prompt through the Qwen chat template and decode freely, streaming text
//! pieces as they are decoded.
//!
//! Concurrency is continuous batching ([`crate::batcher`]): each job's decoding logic runs on a thread of
//! its own, and the thread that owns the model runs every live job's next forward (prefills and decode
//! steps alike) as one packed pass. Preprocessed screenshots and their vision-tower outputs are cached by
//! content hash (and adapter), and prompt prefixes by their tokens ([`crate::prefix_cache`]): the step
//! after an `ask` prefills only the question and the answer.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use askgui_data::action::ACTION_NAMES;
use askgui_data::agent_api::{AgentStepRequest, AgentStepResponse, FrameInfo, Timings, Usage};
use askgui_data::frame::FrameKind;
use askgui_data::prompt::{render_chatml, step_messages, PromptConfig, StepContext, SystemPrompt, IM_END};
use askgui_model::model::positions_tensor;
use askgui_model::text::KvCache;
use askgui_model::{
    mrope_positions, preprocess, render_chat, Content, DTypeChoice, DeviceKind, ImageProcessorConfig, KernelChoice,
    Message, ModelConfig, ModelError, ProcessedImage, Qwen2Vl, QwenTokenizer,
};
use candle_core::{DType, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::{
    Backend, BackendError, BackendInfo, ChatJob, ChatOutput, ChatPart, ChatRole, FinishReason, ImageInput, Intake, Job,
    JobKind, JobOutput, StepJob,
};
use crate::batcher::{Batcher, Client, Item, ItemOut, Round, Ticket};
use crate::config::Config;
use crate::prefix_cache::{images_before, prompt_key, PrefixCache};

/// How the backend is built.
#[derive(Debug, Clone)]
pub struct ModelBackendConfig {
    /// A checkpoint directory or hub id.
    pub model: String,
    /// LoRA adapters (PEFT directories) by the name requests use.
    pub adapters: Vec<(String, PathBuf)>,
    /// Bytes of prompt KV caches kept for reuse ([`crate::prefix_cache`]); 0 turns reuse off.
    pub prefix_cache_bytes: usize,
    /// The system prompt the model was trained with.
    pub system_prompt: SystemPrompt,
    /// Where the model runs (and so its weights' default dtype).
    pub device: DeviceKind,
    /// The weights' dtype (`auto`: the device's default).
    pub dtype: DTypeChoice,
    /// askgui's kernels or the plain-candle references.
    pub kernels: KernelChoice,
}

impl From<&Config> for ModelBackendConfig {
    fn from(cfg: &Config) -> Self {
        Self {
            model: cfg.model.clone(),
            adapters: cfg.adapters.iter().map(|a| (a.name.clone(), a.dir.clone())).collect(),
            prefix_cache_bytes: cfg.prefix_cache_mb << 20,
            system_prompt: cfg.system_prompt,
            device: cfg.device,
            dtype: cfg.dtype,
            kernels: cfg.kernels,
        }
    }
}

/// The prefix cache's size when nothing says otherwise.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 256 << 20;

/// Answer length of an agent step when the request does not say.
const DEFAULT_STEP_TOKENS: usize = 128;
/// Longest integer a constrained answer may write (coordinates, seconds).
const MAX_INT_DIGITS: usize = 6;
/// The longest `wait` a constrained answer may ask for.
const MAX_WAIT_SECONDS: u64 = 60;
/// Bytes of preprocessed screenshots, and of vision features, kept by content hash (each cache).
const CACHE_BYTES: usize = 256 << 20;
/// Most new tokens in one packed forward: more requests wait for the next (bounds activation memory).
const MAX_PACK_TOKENS: usize = 8192;
/// How long the model's owner waits for a busy job before looking for new ones.
const ROUND_WAIT: Duration = Duration::from_millis(2);

/// A map bounded in bytes: when an insert would go over the budget it starts again empty (screens of a
/// session repeat back to back, so recency matters more than a careful eviction order).
struct ByteCache<K, V> {
    map: HashMap<K, V>,
    bytes: usize,
}

impl<K: std::hash::Hash + Eq, V: Clone> ByteCache<K, V> {
    fn new() -> Self {
        Self { map: HashMap::new(), bytes: 0 }
    }

    fn get(&self, k: &K) -> Option<V> {
        self.map.get(k).cloned()
    }

    fn insert(&mut self, k: K, v: V, bytes: usize) {
        if self.bytes + bytes > CACHE_BYTES {
            self.map.clear();
            self.bytes = 0;
        }
        if bytes <= CACHE_BYTES {
            self.map.insert(k, v);
            self.bytes += bytes;
        }
    }
}

/// The model backend: the [`Runner`] that owns the model and the [`Decoder`] that jobs share.
pub struct ModelBackend {
    runner: Runner,
    decoder: Decoder,
}

/// The model's owner: runs packed forwards for the jobs' [`Ticket`]s.
struct Runner {
    model: Qwen2Vl,
    /// Vision-tower outputs `(tokens, H)` by (content hash, adapter): the same screenshot sent again
    /// (every step of a session that did not change the screen) is encoded once.
    features: ByteCache<(u64, Option<String>), Tensor>,
}

/// Everything a job needs to build its prompt and decode its answer, shared by the job threads.
struct Decoder {
    cfg: ModelConfig,
    system_prompt: SystemPrompt,
    image_config: ImageProcessorConfig,
    tokenizer: QwenTokenizer,
    stop_tokens: Vec<u32>,
    info: BackendInfo,
    /// Per token id: `(value, number of digits)` when its text is one or more ASCII digits.
    digit_token: Vec<Option<(u64, u32)>>,
    /// The token that closes a JSON string (`"`).
    quote_token: Option<u32>,
    /// Per token id: its text is safe inside a JSON string (no quote, backslash or control character)
    /// and is not a special token.
    string_token: Vec<bool>,
    images: Mutex<ByteCache<u64, Arc<ProcessedImage>>>,
    prefixes: Mutex<PrefixCache>,
}

fn model_err(e: ModelError) -> BackendError {
    match e {
        ModelError::Image { .. }
        | ModelError::ImageTooLarge { .. }
        | ModelError::ImageTooSmall { .. }
        | ModelError::Tiling { .. }
        | ModelError::Prompt(_) => BackendError::BadInput(e.to_string()),
        e => BackendError::Internal(e.to_string()),
    }
}

fn candle_err(e: candle_core::Error) -> BackendError {
    BackendError::Internal(e.to_string())
}

impl ModelBackend {
    /// Loads the checkpoint on the configured device and dtype (by default f32 on the CPU, bf16 on a GPU)
    /// with the configured kernels, and every adapter.
    pub fn load(cfg: &ModelBackendConfig) -> anyhow::Result<Self> {
        let (device, dtype) = cfg.device.pick_with(cfg.dtype)?;
        tracing::info!("serving on {device:?} with {dtype:?} weights");
        let mut model = Qwen2Vl::load_with(&cfg.model, &device, dtype, cfg.kernels)
            .with_context(|| format!("loading the model {}", cfg.model))?;
        for (name, dir) in &cfg.adapters {
            model
                .load_adapter(name, dir)
                .with_context(|| format!("loading adapter `{name}` from {}", dir.display()))?;
        }
        Ok(Self::from_model(model, &cfg.model)?
            .with_prefix_cache(cfg.prefix_cache_bytes)
            .with_system_prompt(cfg.system_prompt))
    }

    /// Sets the system prompt of every step's prompt (the one the model was trained with).
    pub fn with_system_prompt(mut self, system: SystemPrompt) -> Self {
        self.decoder.system_prompt = system;
        self
    }

    /// Sets the prefix cache's size in bytes (0: no reuse).
    pub fn with_prefix_cache(mut self, bytes: usize) -> Self {
        self.decoder.prefixes = Mutex::new(PrefixCache::new(bytes));
        self
    }

    /// Wraps a loaded model (its adapters already loaded), served under `model_id`.
    pub fn from_model(model: Qwen2Vl, model_id: &str) -> anyhow::Result<Self> {
        let tokenizer = model.tokenizer().context("the checkpoint's tokenizer")?;
        let mut stop_tokens = model.eos_token_ids.clone();
        if let Some(id) = tokenizer.token_id(IM_END) {
            if !stop_tokens.contains(&id) {
                stop_tokens.push(id);
            }
        }
        let vocab = model.cfg.text.vocab_size;
        let specials = [model.cfg.image_token_id, model.cfg.vision_start_token_id, model.cfg.vision_end_token_id];
        let (mut digit_token, mut string_token) = (vec![None; vocab], vec![false; vocab]);
        for id in 0..vocab as u32 {
            let Ok(text) = tokenizer.decode(&[id], false) else { continue };
            let special = specials.contains(&id) || stop_tokens.contains(&id) || text.contains("<|");
            if !text.is_empty() && text.len() <= MAX_INT_DIGITS && text.bytes().all(|b| b.is_ascii_digit()) {
                digit_token[id as usize] = text.parse().ok().map(|v| (v, text.len() as u32));
            }
            string_token[id as usize] = !special
                && !text.is_empty()
                && !text.contains('\u{fffd}')
                && !text.chars().any(|c| c == '"' || c == '\\' || c.is_control());
        }
        let mut adapters: Vec<String> = model.adapter_names().into_iter().map(String::from).collect();
        adapters.sort();
        let info = BackendInfo {
            model: model_id.to_string(),
            adapters,
            context_length: model.cfg.text.max_position_embeddings,
        };
        let quote_token = tokenizer.encode("\"").context("tokenising a quote")?.first().copied();
        let decoder = Decoder {
            cfg: model.cfg.clone(),
            system_prompt: SystemPrompt::Full,
            image_config: model.image_config.clone(),
            tokenizer,
            stop_tokens,
            info,
            digit_token,
            quote_token,
            string_token,
            images: Mutex::new(ByteCache::new()),
            prefixes: Mutex::new(PrefixCache::new(DEFAULT_PREFIX_CACHE_BYTES)),
        };
        Ok(Self { runner: Runner { model, features: ByteCache::new() }, decoder })
    }

    /// One agent step with the model's active adapter (what `POST /v1/agent/step` runs, without a server).
    pub fn step(&mut self, job: &StepJob, cancelled: &dyn Fn() -> bool) -> Result<AgentStepResponse, BackendError> {
        self.solo(|d, c| d.step(c, job, cancelled))
    }

    /// One chat completion with the model's active adapter, streaming text pieces to `stream`.
    pub fn chat(
        &mut self,
        job: &ChatJob,
        stream: Option<&tokio::sync::mpsc::UnboundedSender<String>>,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<ChatOutput, BackendError> {
        self.solo(|d, c| d.chat(c, job, stream, cancelled))
    }

    /// Runs one job's logic on this thread while the model runs its forwards on another.
    fn solo<T>(&mut self, work: impl FnOnce(&Decoder, &Client) -> T) -> T {
        let batcher = Batcher::default();
        let Self { runner, decoder } = self;
        let adapter = runner.model.active_adapter().map(String::from);
        std::thread::scope(|s| {
            batcher.job_started();
            let owner = s.spawn(|| runner.serve(&batcher, &mut crate::backend::NoIntake, &|_| {}));
            let out = work(decoder, &Client::new(&batcher, adapter));
            if let Err(p) = owner.join() {
                std::panic::resume_unwind(p);
            }
            out
        })
    }
}

impl Decoder {
    fn check_adapter(&self, adapter: Option<&str>) -> Result<(), BackendError> {
        if let Some(name) = adapter {
            if !self.info.adapters.iter().any(|a| a == name) {
                return Err(BackendError::UnknownAdapter {
                    name: name.to_string(),
                    available: if self.info.adapters.is_empty() {
                        "no adapters".into()
                    } else {
                        self.info.adapters.join(", ")
                    },
                });
            }
        }
        Ok(())
    }

    /// The checkpoint's preprocessing of an image, cached by content hash.
    fn processed(&self, img: &ImageInput) -> Result<Arc<ProcessedImage>, BackendError> {
        if let Some(p) = self.images.lock().unwrap_or_else(|p| p.into_inner()).get(&img.hash) {
            return Ok(p);
        }
        let p = Arc::new(preprocess(&img.image, &self.image_config).map_err(model_err)?);
        let bytes = p.pixel_values.len() * 4;
        self.images.lock().unwrap_or_else(|p| p.into_inner()).insert(img.hash, p.clone(), bytes);
        Ok(p)
    }

    fn check_context(&self, prompt: usize, answer: usize) -> Result<(), BackendError> {
        let limit = self.info.context_length;
        if prompt + answer > limit {
            return Err(BackendError::ContextOverflow { tokens: prompt + answer, limit });
        }
        Ok(())
    }

    /// One agent step.
    fn step(
        &self,
        client: &Client,
        job: &StepJob,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<AgentStepResponse, BackendError> {
        let t_start = Instant::now();
        let req: &AgentStepRequest = &job.request;
        let images: Vec<(u64, Arc<ProcessedImage>)> =
            job.screenshot.iter().map(|s| Ok((s.hash, self.processed(s)?))).collect::<Result<_, BackendError>>()?;
        let screen = match (&req.observation.screen, &job.screenshot) {
            (Some(s), _) => (s.width, s.height),
            (None, Some(img)) => (img.image.width(), img.image.height()),
            (None, None) => {
                return Err(BackendError::BadInput("observation.screen is required without a screenshot".into()))
            }
        };
        let ic = &self.image_config;
        let cfg = PromptConfig { min_pixels: ic.min_pixels, max_pixels: ic.max_pixels, ..PromptConfig::default() };
        let mut frame = cfg.frame_map(screen.0, screen.1).map_err(|e| BackendError::BadInput(e.to_string()))?;
        if let (FrameKind::Resized, Some((_, p))) = (frame.kind, images.first()) {
            frame.model = (p.resized.0 as u32, p.resized.1 as u32);
        }
        let shots: Vec<PathBuf> = images.iter().map(|_| PathBuf::from("screenshot")).collect();
        let ctx = StepContext {
            task: &req.task,
            history: &req.history,
            screenshots: shots,
            elements: req.observation.elements.as_deref(),
            frame,
            system: self.system_prompt,
        };
        let rendered = render_chatml(&step_messages(&ctx), true);
        let merge = ic.geometry.merge_size;
        let counts: Vec<usize> = images.iter().map(|(_, i)| i.num_tokens(merge)).collect();
        let mut ids = self.tokenizer.encode_prompt(&rendered.text, &counts).map_err(model_err)?;
        let prefix = self.tokenizer.encode("{\"action\":\"").map_err(model_err)?;
        ids.extend(&prefix);
        let max_tokens = req.options.max_tokens.unwrap_or(DEFAULT_STEP_TOKENS);
        self.check_context(ids.len(), max_tokens)?;
        let preprocess_ms = t_start.elapsed().as_secs_f64() * 1e3;

        let t0 = Instant::now();
        let (mut seq, cached) = Seq::prefill(self, client, &ids, &images)?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t0 = Instant::now();
        // The exact distribution over action names: log p of each name's closing `name"` tokens.
        let names: Vec<Vec<u32>> = ACTION_NAMES
            .iter()
            .map(|n| self.tokenizer.encode(&format!("{n}\"")).map_err(model_err))
            .collect::<Result<_, _>>()?;
        let logp = seq.logprobs(&names)?;
        let probs = normalise(&logp);
        let ask = ACTION_NAMES.iter().position(|&n| n == "ask").expect("ask is an action");
        let ask_probability = probs[ask];
        let temperature = req.options.temperature.unwrap_or(0.0);
        let mut rng = StdRng::seed_from_u64(req.options.seed.unwrap_or(0));
        let choice = match req.options.pause_threshold {
            Some(th) if ask_probability >= th => ask,
            Some(_) => pick(&probs, temperature, &mut rng, Some(ask)),
            None => pick(&probs, temperature, &mut rng, None),
        };
        seq.feed(&names[choice])?;
        let mut text = format!("{{\"action\":\"{}\"", ACTION_NAMES[choice]);
        let mut generated = names[choice].len();
        let budget = max_tokens.saturating_sub(generated);
        let mut dec = Decoding { seq, temperature, rng, budget, generated: 0, cancelled };
        let constrain = req.options.constrain.unwrap_or(true);
        if constrain {
            self.constrained_args(&mut dec, ACTION_NAMES[choice], &mut text, frame.model)?;
        } else {
            self.free_args(&mut dec, &mut text)?;
        }
        generated += dec.generated;
        let decode_ms = t0.elapsed().as_secs_f64() * 1e3;
        let parsed = askgui_data::parse::parse_answer(&text).map_err(|e| match constrain {
            true => BackendError::Internal(format!("a constrained answer did not parse ({e}): {text:?}")),
            false => BackendError::Internal(format!(
                "the model's answer does not parse ({e}); leave options.constrain on to get one that does"
            )),
        })?;
        let model_action = parsed.action;
        let action = frame.action_to_screen(&model_action);
        Ok(AgentStepResponse {
            action,
            model_action,
            frame: FrameInfo::from(&frame),
            raw: text,
            ask_probability: Some(ask_probability),
            usage: Usage {
                prompt_tokens: ids.len() - prefix.len(),
                image_tokens: counts.iter().sum(),
                cached_tokens: cached,
                completion_tokens: prefix.len() + generated,
            },
            timings: Timings { queue_ms: 0.0, preprocess_ms, prefill_ms, decode_ms },
        })
    }

    fn force(&self, dec: &mut Decoding, text: &mut String, lit: &str) -> Result<(), BackendError> {
        let toks = self.tokenizer.encode(lit).map_err(model_err)?;
        dec.seq.feed(&toks)?;
        dec.generated += toks.len();
        text.push_str(lit);
        Ok(())
    }

    /// Decodes one integer in `0..=max`: digit tokens that keep the value in range, ended when a
    /// non-digit token would be more likely than any of them (or at [`MAX_INT_DIGITS`]).
    fn int(&self, dec: &mut Decoding, text: &mut String, max: u64) -> Result<(), BackendError> {
        // The digits so far: their value and how many (leading zeros count towards the length only).
        let (mut value, mut len) = (0u64, 0u32);
        while dec.generated < dec.budget || len == 0 {
            dec.check()?;
            let fits = |i: usize| {
                self.digit_token[i]
                    .is_some_and(|(v, l)| len + l <= MAX_INT_DIGITS as u32 && value * 10u64.pow(l) + v <= max)
            };
            let logits = &dec.seq.logits;
            let Some((tok, v)) = best(logits, fits) else { break };
            let best_other = best(logits, |i| self.digit_token[i].is_none());
            if len > 0 && best_other.is_some_and(|(_, o)| o > v) {
                break;
            }
            let (v, l) = self.digit_token[tok as usize].expect("a digit token");
            (value, len) = (value * 10u64.pow(l) + v, len + l);
            dec.seq.feed(&[tok])?;
            dec.generated += 1;
        }
        if len == 0 {
            self.force(dec, text, "0")
        } else {
            // As a JSON number: no leading zeros.
            text.push_str(&value.to_string());
            Ok(())
        }
    }

    /// Decodes the inside of a JSON string: tokens safe in a string until the model prefers to close it
    /// (the quote token is more likely than any string token) or the budget ends.
    fn string(&self, dec: &mut Decoding, text: &mut String) -> Result<(), BackendError> {
        let mut n = 0;
        // At least one token: the schema has no empty strings (an `ask` needs a question).
        while n == 0 || dec.generated < dec.budget {
            dec.check()?;
            let logits = &dec.seq.logits;
            let Some((tok, v)) = best(logits, |i| self.string_token[i]) else { break };
            let close_v = self.quote_token.map_or(f32::NEG_INFINITY, |c| logits[c as usize]);
            if n > 0 && close_v > v {
                break;
            }
            let tok = if dec.temperature > 0.0 { dec.sample(|i| self.string_token[i]) } else { tok };
            text.push_str(&self.tokenizer.decode(&[tok], false).map_err(model_err)?);
            dec.seq.feed(&[tok])?;
            dec.generated += 1;
            n += 1;
        }
        Ok(())
    }

    /// Picks one of `options` (each followed by `after`) by the model's probability.
    fn choose(&self, dec: &mut Decoding, text: &mut String, options: &[&str], after: &str) -> Result<(), BackendError> {
        let toks: Vec<Vec<u32>> = options
            .iter()
            .map(|o| self.tokenizer.encode(&format!("{o}{after}")).map_err(model_err))
            .collect::<Result<_, _>>()?;
        let logp = dec.seq.logprobs(&toks)?;
        let probs = normalise(&logp);
        let i = pick(&probs, dec.temperature, &mut dec.rng, None);
        dec.seq.feed(&toks[i])?;
        dec.generated += toks[i].len();
        text.push_str(options[i]);
        text.push_str(after);
        Ok(())
    }

    /// The action's arguments as a template of forced keys and typed values (see the module docs).
    /// Coordinates stay inside the model frame `(width, height)`.
    fn constrained_args(
        &self,
        dec: &mut Decoding,
        name: &str,
        text: &mut String,
        frame: (u32, u32),
    ) -> Result<(), BackendError> {
        let ints = |keys: &[&str], dec: &mut Decoding, text: &mut String| -> Result<(), BackendError> {
            for k in keys {
                self.force(dec, text, &format!(",\"{k}\":"))?;
                let max = match k.chars().next() {
                    Some('x') => frame.0.saturating_sub(1) as u64,
                    Some('y') => frame.1.saturating_sub(1) as u64,
                    _ => MAX_WAIT_SECONDS,
                };
                self.int(dec, text, max)?;
            }
            Ok(())
        };
        let string_field = |key: &str, dec: &mut Decoding, text: &mut String| -> Result<(), BackendError> {
            self.force(dec, text, &format!(",\"{key}\":\""))?;
            self.string(dec, text)?;
            self.force(dec, text, "\"")
        };
        match name {
            "click" | "long_press" | "double_click" | "right_click" => ints(&["x", "y"], dec, text)?,
            "scroll" => {
                ints(&["x", "y"], dec, text)?;
                self.force(dec, text, ",\"direction\":\"")?;
                self.choose(dec, text, &["up", "down", "left", "right"], "\"")?;
            }
            "swipe" | "drag" => ints(&["x1", "y1", "x2", "y2"], dec, text)?,
            "type" | "answer" => string_field("text", dec, text)?,
            "press" => string_field("key", dec, text)?,
            "open_app" => string_field("name", dec, text)?,
            "ask" => string_field("question", dec, text)?,
            "wait" => ints(&["seconds"], dec, text)?,
            "done" => {
                self.force(dec, text, ",\"status\":\"")?;
                self.choose(dec, text, &["success", "infeasible"], "\"")?;
            }
            "hotkey" => {
                self.force(dec, text, ",\"keys\":[\"")?;
                for _ in 0..4 {
                    self.string(dec, text)?;
                    let before = text.len();
                    self.choose(dec, text, &["\"]", "\",\""], "")?;
                    if text[before..].starts_with("\"]") {
                        break;
                    }
                }
                if !text.ends_with("\"]") {
                    self.force(dec, text, "\"]")?;
                }
            }
            other => return Err(BackendError::Internal(format!("no template for action `{other}`"))),
        }
        self.force(dec, text, "}")
    }

    /// The rest of the answer decoded freely, until the object closes, a stop token, or the budget.
    fn free_args(&self, dec: &mut Decoding, text: &mut String) -> Result<(), BackendError> {
        let mut toks = Vec::new();
        let start = text.len();
        while dec.generated < dec.budget {
            dec.check()?;
            let tok = dec.sample(|_| true);
            if self.stop_tokens.contains(&tok) {
                break;
            }
            toks.push(tok);
            dec.seq.feed(&[tok])?;
            dec.generated += 1;
            text.truncate(start);
            text.push_str(&self.tokenizer.decode(&toks, true).map_err(model_err)?);
            if askgui_data::parse::json_object_spans(text).first().is_some_and(|r| r.start == 0) {
                break;
            }
        }
        Ok(())
    }

    /// One chat completion, streaming text pieces to `stream`.
    fn chat(
        &self,
        client: &Client,
        job: &ChatJob,
        stream: Option<&tokio::sync::mpsc::UnboundedSender<String>>,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<ChatOutput, BackendError> {
        let mut images = Vec::new();
        let mut messages = Vec::new();
        for m in &job.messages {
            let role = match m.role {
                ChatRole::System => "system",
                ChatRole::User => "user",
                ChatRole::Assistant => "assistant",
            };
            let mut content = Vec::new();
            for p in &m.parts {
                match p {
                    ChatPart::Text(t) => content.push(Content::Text(t.clone())),
                    ChatPart::Image(img) => {
                        images.push((img.hash, self.processed(img)?));
                        content.push(Content::Image);
                    }
                }
            }
            messages.push(Message::new(role, content));
        }
        let text = render_chat(&messages, true);
        let merge = self.image_config.geometry.merge_size;
        let counts: Vec<usize> = images.iter().map(|(_, i)| i.num_tokens(merge)).collect();
        let ids = self.tokenizer.encode_prompt(&text, &counts).map_err(model_err)?;
        self.check_context(ids.len(), job.max_tokens)?;
        let (seq, _) = Seq::prefill(self, client, &ids, &images)?;
        let rng = StdRng::seed_from_u64(job.seed.unwrap_or(0));
        let mut dec =
            Decoding { seq, temperature: job.temperature, rng, budget: job.max_tokens, generated: 0, cancelled };
        let (mut toks, mut out, mut sent) = (Vec::new(), String::new(), 0usize);
        let mut finish = FinishReason::Length;
        while dec.generated < dec.budget {
            dec.check()?;
            let tok = dec.sample_top_p(job.top_p);
            if self.stop_tokens.contains(&tok) {
                finish = FinishReason::Stop;
                break;
            }
            toks.push(tok);
            dec.generated += 1;
            out = self.tokenizer.decode(&toks, true).map_err(model_err)?;
            if let Some(cut) = job.stop.iter().filter_map(|s| out.find(s.as_str())).min() {
                out.truncate(cut);
                finish = FinishReason::Stop;
                break;
            }
            // Send what is complete: not a partial UTF-8 character, and not a possible stop-string start.
            let hold = job.stop.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
            let safe = out.len().saturating_sub(hold);
            let safe = (0..=safe).rev().find(|&i| out.is_char_boundary(i)).unwrap_or(0);
            if safe > sent && !out[..safe].ends_with('\u{fffd}') {
                if let Some(s) = stream {
                    let _ = s.send(out[sent..safe].to_string());
                }
                sent = safe;
            }
            if dec.generated < dec.budget {
                dec.seq.feed(&[tok])?;
            }
        }
        if let Some(s) = stream {
            if out.len() > sent {
                let _ = s.send(out[sent..].to_string());
            }
        }
        Ok(ChatOutput { text: out, finish_reason: finish, prompt_tokens: ids.len(), completion_tokens: toks.len() })
    }
}

impl Decoder {
    /// Answers one job (on its own thread), through `client` for the model's work.
    fn answer(&self, client: &Client, job: Job) {
        if job.is_cancelled() {
            let _ = job.reply.send(Err(BackendError::Cancelled));
            return;
        }
        let queue_ms = job.enqueued.elapsed().as_secs_f64() * 1e3;
        let cancelled = || job.is_cancelled();
        let work = || {
            self.check_adapter(job.adapter.as_deref())?;
            match &job.kind {
                JobKind::Step(s) => self.step(client, s, &cancelled).map(|mut r| {
                    r.timings.queue_ms = queue_ms;
                    JobOutput::Step(Box::new(r))
                }),
                JobKind::Chat(c) => self.chat(client, c, job.stream.as_ref(), &cancelled).map(JobOutput::Chat),
            }
        };
        let result = catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|p| {
            let msg = crate::engine::panic_message(p.as_ref());
            tracing::error!(panic = %msg, "a job panicked; it gets 500");
            Err(BackendError::Internal(format!("the backend failed on this request: {msg}")))
        });
        if let Err(e) = &result {
            tracing::debug!(error = %e, "job failed");
        }
        let _ = job.reply.send(result);
    }
}

impl Backend for ModelBackend {
    fn info(&self) -> BackendInfo {
        self.decoder.info.clone()
    }

    fn run(&mut self, jobs: Vec<Job>) {
        self.run_continuous(jobs, &mut crate::backend::NoIntake);
    }

    /// Every job on a thread of its own; this thread runs their forwards, packed, and takes in new jobs
    /// between forwards while fewer than `max_batch` are live.
    fn run_continuous(&mut self, jobs: Vec<Job>, intake: &mut dyn Intake) {
        let batcher = Batcher::default();
        let Self { runner, decoder } = self;
        let decoder = &*decoder;
        std::thread::scope(|s| {
            let start = |job: Job| {
                batcher.job_started();
                let batcher = &batcher;
                let body = move || decoder.answer(&Client::new(batcher, job.adapter.clone()), job);
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

impl Runner {
    /// Runs rounds until no job is live. Between rounds, new jobs from `intake` (while fewer than its
    /// `max_batch` are live) are started with `start`; each forward's size is recorded there.
    fn serve(&mut self, batcher: &Batcher, intake: &mut dyn Intake, start: &dyn Fn(Job)) {
        loop {
            let (live, max) = (batcher.live(), intake.max_batch().max(1));
            if live < max {
                intake.take(max - live).into_iter().for_each(start);
            }
            match batcher.next_round(ROUND_WAIT) {
                Round::Run(tickets) => self.round(tickets, intake),
                Round::Idle => {}
                Round::Done => break,
            }
        }
    }

    /// One round: tickets grouped by adapter (an adapter is a model-wide switch), each group in packed
    /// forwards of at most [`MAX_PACK_TOKENS`] new tokens.
    fn round(&mut self, tickets: Vec<Ticket>, intake: &mut dyn Intake) {
        let mut groups: Vec<(Option<String>, Vec<Ticket>)> = Vec::new();
        for t in tickets {
            match groups.iter_mut().find(|(a, _)| *a == t.adapter) {
                Some((_, g)) => g.push(t),
                None => groups.push((t.adapter.clone(), vec![t])),
            }
        }
        for (adapter, group) in groups {
            if let Err(e) = self.model.set_active_adapter(adapter.as_deref()).map_err(model_err) {
                group.into_iter().for_each(|t| drop(t.reply.send(Err(e.clone()))));
                continue;
            }
            let mut pack = Vec::new();
            let mut rows = 0;
            for t in group {
                let n: usize = t.items.iter().map(|i| i.ids.len()).sum();
                if !pack.is_empty() && rows + n > MAX_PACK_TOKENS {
                    self.pack(std::mem::take(&mut pack), intake);
                    rows = 0;
                }
                rows += n;
                pack.push(t);
            }
            if !pack.is_empty() {
                self.pack(pack, intake);
            }
        }
    }

    /// One packed forward over every item of `tickets`; each ticket gets its answers or the error. A
    /// ticket whose input cannot be embedded fails alone; a failing (or panicking) forward fails the pack.
    fn pack(&mut self, tickets: Vec<Ticket>, intake: &mut dyn Intake) {
        let mut ready = Vec::with_capacity(tickets.len());
        for t in tickets {
            match t.items.iter().map(|it| self.embed(it)).collect::<Result<Vec<_>, _>>() {
                Ok(embeds) => ready.push((t, embeds)),
                Err(e) => drop(t.reply.send(Err(e))),
            }
        }
        if ready.is_empty() {
            return;
        }
        intake.record_batch(ready.iter().map(|(t, _)| t.items.len()).sum());
        let out = catch_unwind(AssertUnwindSafe(|| self.forward(&mut ready))).unwrap_or_else(|p| {
            Err(BackendError::Internal(format!("the forward panicked: {}", crate::engine::panic_message(p.as_ref()))))
        });
        match out {
            Ok(mut logits) => {
                for (t, _) in ready.into_iter().rev() {
                    let mine = logits.split_off(logits.len() - t.items.len());
                    let outs = t.items.into_iter().zip(mine).map(|(i, logits)| ItemOut { cache: i.cache, logits });
                    let _ = t.reply.send(Ok(outs.collect()));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, sequences = ready.len(), "a packed forward failed");
                ready.into_iter().for_each(|(t, _)| drop(t.reply.send(Err(e.clone()))));
            }
        }
    }

    /// An item's new tokens as embeddings `(1, T, H)`, its image features spliced in.
    fn embed(&mut self, item: &Item) -> Result<Tensor, BackendError> {
        if item.ids.is_empty() || item.ids.len() != item.positions.len() || item.logits_rows > item.ids.len() {
            return Err(BackendError::Internal(format!(
                "a forward item with {} tokens, {} positions and {} logit rows",
                item.ids.len(),
                item.positions.len(),
                item.logits_rows
            )));
        }
        let feats = self.image_features(&item.images)?;
        let ids = Tensor::from_slice(&item.ids, (1, item.ids.len()), &self.model.device).map_err(candle_err)?;
        self.model.embed(&ids, feats.as_ref()).map_err(model_err)
    }

    /// The packed forward: every item's new rows back to back, each over its own cache (appended in
    /// place); the logits of each item's last `logits_rows` rows, in item order.
    fn forward(&mut self, ready: &mut [(Ticket, Vec<Tensor>)]) -> Result<Vec<Vec<Vec<f32>>>, BackendError> {
        let embeds: Vec<&Tensor> = ready.iter().flat_map(|(_, e)| e).collect();
        let embeds = Tensor::cat(&embeds, 1).map_err(candle_err)?;
        let items: Vec<&mut Item> = ready.iter_mut().flat_map(|(t, _)| t.items.iter_mut()).collect();
        let lens: Vec<usize> = items.iter().map(|i| i.ids.len()).collect();
        let positions: Vec<[u32; 3]> = items.iter().flat_map(|i| i.positions.iter().copied()).collect();
        let total = positions.len();
        let positions = positions_tensor(&[positions], total).map_err(model_err)?;
        // Rows whose logits are wanted, in the packed order.
        let mut rows = Vec::new();
        let mut start = 0;
        for i in &items {
            rows.extend((start + i.ids.len() - i.logits_rows..start + i.ids.len()).map(|r| r as u32));
            start += i.ids.len();
        }
        let wanted: Vec<usize> = items.iter().map(|i| i.logits_rows).collect();
        let mut caches: Vec<&mut KvCache> = items.into_iter().map(|i| &mut i.cache).collect();
        let hidden = self.model.decode_packed(&embeds, &positions, &lens, &mut caches).map_err(model_err)?;
        // (1, N, H) -> (R, H) -> (R, V)
        let idx = Tensor::from_vec(rows, wanted.iter().sum::<usize>(), &self.model.device).map_err(candle_err)?;
        let picked = hidden.squeeze(0).and_then(|h| h.index_select(&idx, 0)).map_err(candle_err)?;
        let logits = self.model.logits(&picked).map_err(model_err)?;
        let mut logits = logits.to_dtype(DType::F32).and_then(|l| l.to_vec2::<f32>()).map_err(candle_err)?.into_iter();
        Ok(wanted.iter().map(|&n| logits.by_ref().take(n).collect()).collect())
    }

    /// The vision tower's output for the images, in order, each cached by (hash, active adapter). Each
    /// image attends only to itself, so encoding them one by one equals encoding them together.
    fn image_features(&mut self, images: &[(u64, Arc<ProcessedImage>)]) -> Result<Option<Tensor>, BackendError> {
        if images.is_empty() {
            return Ok(None);
        }
        let adapter = self.model.active_adapter().map(String::from);
        let mut parts = Vec::with_capacity(images.len());
        for (hash, img) in images {
            let key = (*hash, adapter.clone());
            let f = match self.features.get(&key) {
                Some(f) => f,
                None => {
                    let pv = img.pixel_tensor(&self.model.device).map_err(model_err)?;
                    let f = self.model.image_features(&pv, &[img.grid_thw]).map_err(model_err)?;
                    self.features.insert(key, f.clone(), f.elem_count() * f.dtype().size_in_bytes());
                    f
                }
            };
            parts.push(f);
        }
        Ok(Some(Tensor::cat(&parts, 0).map_err(candle_err)?))
    }
}

/// Softmax of log-probabilities.
fn normalise(logp: &[f64]) -> Vec<f64> {
    let m = logp.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = logp.iter().map(|l| (l - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// The most likely index (temperature 0) or a sample at `temperature`; `exclude` is never picked.
fn pick(probs: &[f64], temperature: f64, rng: &mut StdRng, exclude: Option<usize>) -> usize {
    let w: Vec<f64> = probs
        .iter()
        .enumerate()
        .map(|(i, &p)| {
            if Some(i) == exclude {
                0.0
            } else if temperature > 0.0 {
                p.powf(1.0 / temperature)
            } else {
                p
            }
        })
        .collect();
    if temperature <= 0.0 {
        return w.iter().enumerate().fold(0, |b, (i, &x)| if x > w[b] { i } else { b });
    }
    let total: f64 = w.iter().sum();
    let mut r = rng.random::<f64>() * total;
    for (i, &x) in w.iter().enumerate() {
        if r < x {
            return i;
        }
        r -= x;
    }
    w.iter().rposition(|&x| x > 0.0).unwrap_or(0)
}

/// The best-scoring token among those `allowed`, with its logit.
fn best(logits: &[f32], allowed: impl Fn(usize) -> bool) -> Option<(u32, f32)> {
    let mut out: Option<(u32, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if allowed(i) && out.is_none_or(|(_, b)| v > b) {
            out = Some((i as u32, v));
        }
    }
    out
}

/// The state of one answer being decoded.
struct Decoding<'a> {
    seq: Seq<'a>,
    temperature: f64,
    rng: StdRng,
    /// Tokens the answer may still take, counted by `generated`.
    budget: usize,
    generated: usize,
    cancelled: &'a dyn Fn() -> bool,
}

impl Decoding<'_> {
    fn check(&self) -> Result<(), BackendError> {
        if (self.cancelled)() {
            return Err(BackendError::Cancelled);
        }
        Ok(())
    }

    /// The next token among `allowed`: the best one at temperature 0, else a sample.
    fn sample(&mut self, allowed: impl Fn(usize) -> bool) -> u32 {
        if self.temperature <= 0.0 {
            return best(&self.seq.logits, allowed).map(|(t, _)| t).unwrap_or(0);
        }
        let l = &self.seq.logits;
        let m = l.iter().enumerate().filter(|(i, _)| allowed(*i)).map(|(_, &v)| v).fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = l
            .iter()
            .enumerate()
            .map(|(i, &v)| if allowed(i) { (((v - m) as f64) / self.temperature).exp() } else { 0.0 })
            .collect();
        let total: f64 = w.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (i, &x) in w.iter().enumerate() {
            if r < x {
                return i as u32;
            }
            r -= x;
        }
        best(l, allowed).map(|(t, _)| t).unwrap_or(0)
    }

    /// The next token by temperature and nucleus (`top_p`) sampling.
    fn sample_top_p(&mut self, top_p: f64) -> u32 {
        let params = askgui_model::SamplingParams { temperature: self.temperature, top_p, ..Default::default() };
        askgui_model::generate::sample(&self.seq.logits, &params, &mut self.rng)
    }
}

/// One sequence being decoded: its KV cache, the next M-RoPE position and the logits for the next token.
/// Its model work goes through the job's [`Client`].
struct Seq<'c> {
    client: &'c Client<'c>,
    cache: KvCache,
    next: u32,
    logits: Vec<f32>,
}

impl<'c> Seq<'c> {
    /// Prefills the prompt `ids` with its `images`, starting from the longest cached prefix; returns the
    /// sequence and how many prompt tokens came from the cache.
    fn prefill(
        d: &Decoder,
        client: &'c Client<'c>,
        ids: &[u32],
        images: &[(u64, Arc<ProcessedImage>)],
    ) -> Result<(Self, usize), BackendError> {
        let grids: Vec<[usize; 3]> = images.iter().map(|(_, i)| i.grid_thw).collect();
        let (pos, next) = mrope_positions(ids, &grids, &d.cfg).map_err(model_err)?;
        let hashes: Vec<u64> = images.iter().map(|(h, _)| *h).collect();
        let key = prompt_key(ids, d.cfg.image_token_id, &hashes);
        let adapter = client.adapter.as_deref();
        let found = d.prefixes.lock().unwrap_or_else(|p| p.into_inner()).lookup(adapter, &key);
        let (start, cache) = found.unwrap_or_default();
        let item = Item {
            ids: ids[start..].to_vec(),
            positions: pos[start..].to_vec(),
            images: images[images_before(&key, start)..].to_vec(),
            cache,
            logits_rows: 1,
        };
        let ItemOut { cache, mut logits } = one(client.run(vec![item])?)?;
        d.prefixes.lock().unwrap_or_else(|p| p.into_inner()).insert(adapter, key, cache.clone());
        let logits = logits.pop().unwrap_or_default();
        Ok((Self { client, cache, next, logits }, start))
    }

    /// An item running `tokens` after this sequence (on a copy of its cache), with logits for its last
    /// `logits_rows` rows.
    fn item(&self, tokens: &[u32], logits_rows: usize) -> Item {
        Item {
            ids: tokens.to_vec(),
            positions: (0..tokens.len() as u32).map(|i| [self.next + i; 3]).collect(),
            images: vec![],
            cache: self.cache.clone(),
            logits_rows,
        }
    }

    /// Appends `tokens` to the sequence.
    fn feed(&mut self, tokens: &[u32]) -> Result<(), BackendError> {
        if tokens.is_empty() {
            return Ok(());
        }
        let ItemOut { cache, mut logits } = one(self.client.run(vec![self.item(tokens, 1)])?)?;
        self.cache = cache;
        self.next += tokens.len() as u32;
        self.logits = logits.pop().unwrap_or_default();
        Ok(())
    }

    /// `log p(option | sequence)` for each option, without changing the sequence: the options of more
    /// than one token run together in one forward, each on a copy of the cache.
    fn logprobs(&self, options: &[Vec<u32>]) -> Result<Vec<f64>, BackendError> {
        // Logits after each of option[..n-1] score option[1..].
        let forks: Vec<Item> =
            options.iter().filter(|o| o.len() > 1).map(|o| self.item(&o[..o.len() - 1], o.len() - 1)).collect();
        let mut outs = if forks.is_empty() { Vec::new() } else { self.client.run(forks)? }.into_iter();
        let mut total = Vec::with_capacity(options.len());
        for o in options {
            let Some((&first, rest)) = o.split_first() else {
                total.push(0.0);
                continue;
            };
            let mut l = log_softmax_at(&self.logits, first);
            if !rest.is_empty() {
                let out = outs.next().ok_or_else(|| BackendError::Internal("a scoring forward went missing".into()))?;
                for (row, &tok) in out.logits.iter().zip(rest) {
                    l += log_softmax_at(row, tok);
                }
            }
            total.push(l);
        }
        Ok(total)
    }
}

/// The single answer of a one-item request.
fn one(mut outs: Vec<ItemOut>) -> Result<ItemOut, BackendError> {
    match (outs.pop(), outs.is_empty()) {
        (Some(out), true) => Ok(out),
        _ => Err(BackendError::Internal("a forward answered the wrong number of items".into())),
    }
}

fn log_softmax_at(logits: &[f32], tok: u32) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = logits.iter().map(|&v| (v as f64 - m).exp()).sum();
    logits[tok as usize] as f64 - m - s.ln()
}
