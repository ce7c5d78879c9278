//! The decoder: everything a job needs to build its prompt and decode its answer, shared by the job
//! threads, and the agent step.
//!
//! Key choice: the step's prompt is the training prompt ([`askgui_data::prompt::step_messages`] in
//! ChatML) with the screenshot run through the checkpoint's own image processor, and the model frame is
//! the size that processor resized it to, so the coordinates the model reads and writes are pixels of
//! exactly the image it saw. After the forced prefix `{"action":"`, every action name's tokens are
//! scored from a copy of the KV cache: the model's exact distribution over the 15 names, whose `ask`
//! entry is `ask_probability` (with `pause_threshold` the answer is `ask` exactly when
//! `ask_probability >= pause_threshold`). The arguments follow (`constrained`), then the answer is parsed
//! and converted to screen pixels.

mod chat;
mod constrained;
mod sequence;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context;
use askgui_data::action::ACTION_NAMES;
use askgui_data::agent_api::{AgentStepRequest, AgentStepResponse, FrameInfo, Timings, Usage};
use askgui_data::frame::FrameKind;
use askgui_data::prompt::{render_chatml, step_messages, PromptConfig, StepContext, SystemPrompt, IM_END};
use askgui_model::{preprocess, ImageProcessorConfig, ModelConfig, ProcessedImage, Qwen2Vl, QwenTokenizer};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::cache::ByteCache;
use super::model_err;
use super::sampling::{best, normalise, pick, weighted_pick};
use super::DEFAULT_PREFIX_CACHE_BYTES;
use crate::backend::{BackendError, BackendInfo, ImageInput, Job, JobKind, JobOutput, StepJob};
use crate::batcher::Client;
use crate::prefix_cache::PrefixCache;
use constrained::MAX_INT_DIGITS;
use sequence::Seq;

/// Answer length of an agent step when the request does not say.
const DEFAULT_STEP_TOKENS: usize = 128;

/// Everything a job needs to build its prompt and decode its answer, shared by the job threads.
pub(super) struct Decoder {
    cfg: ModelConfig,
    pub(super) system_prompt: SystemPrompt,
    image_config: ImageProcessorConfig,
    tokenizer: QwenTokenizer,
    stop_tokens: Vec<u32>,
    pub(super) info: BackendInfo,
    /// Per token id: `(value, number of digits)` when its text is one or more ASCII digits.
    digit_token: Vec<Option<(u64, u32)>>,
    /// The token that closes a JSON string (`"`).
    quote_token: Option<u32>,
    /// Per token id: its text is safe inside a JSON string (no quote, backslash or control character)
    /// and is not a special token.
    string_token: Vec<bool>,
    images: Mutex<ByteCache<u64, Arc<ProcessedImage>>>,
    pub(super) prefixes: Mutex<PrefixCache>,
}

impl Decoder {
    /// The decoder of a loaded model served under `model_id`: its tokenizer, stop tokens and the token
    /// classes that constrained decoding allows.
    pub(super) fn new(model: &Qwen2Vl, model_id: &str) -> anyhow::Result<Self> {
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
        Ok(Self {
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
        })
    }

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
    pub(super) fn step(
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

    /// Answers one job (on its own thread), through `client` for the model's work.
    pub(super) fn answer(&self, client: &Client, job: Job) {
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
        match weighted_pick(&w, &mut self.rng) {
            Some(i) => i as u32,
            None => best(l, allowed).map(|(t, _)| t).unwrap_or(0),
        }
    }

    /// The next token by temperature and nucleus (`top_p`) sampling.
    fn sample_top_p(&mut self, top_p: f64) -> u32 {
        let params = askgui_model::SamplingParams { temperature: self.temperature, top_p, ..Default::default() };
        askgui_model::generate::sample(&self.seq.logits, &params, &mut self.rng)
    }
}
