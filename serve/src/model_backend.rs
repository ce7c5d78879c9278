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
//! Preprocessed screenshots and their vision-tower outputs are cached by content hash (and adapter).
//! Jobs of a batch run one after another (batch 1 per forward): batched prefill/decode across jobs and
//! KV-prefix reuse across a session's steps are not done yet.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use askgui_data::action::ACTION_NAMES;
use askgui_data::agent_api::{AgentStepRequest, AgentStepResponse, FrameInfo, Timings, Usage};
use askgui_data::frame::FrameKind;
use askgui_data::prompt::{render_chatml, step_messages, PromptConfig, StepContext, IM_END};
use askgui_model::model::positions_tensor;
use askgui_model::text::KvCache;
use askgui_model::{
    mrope_positions, preprocess, render_chat, Content, Message, ModelError, ProcessedImage, Qwen2Vl, QwenTokenizer,
};
use candle_core::{DType, Device, Tensor, D};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::{
    Backend, BackendError, BackendInfo, ChatJob, ChatOutput, ChatPart, ChatRole, FinishReason, ImageInput, Job,
    JobKind, JobOutput, StepJob,
};

/// How the backend is built.
#[derive(Debug, Clone)]
pub struct ModelBackendConfig {
    /// A checkpoint directory or hub id.
    pub model: String,
    /// LoRA adapters (PEFT directories) by the name requests use.
    pub adapters: Vec<(String, PathBuf)>,
}

/// Answer length of an agent step when the request does not say.
const DEFAULT_STEP_TOKENS: usize = 128;
/// Longest integer a constrained answer may write (coordinates, seconds).
const MAX_INT_DIGITS: usize = 6;
/// The longest `wait` a constrained answer may ask for.
const MAX_WAIT_SECONDS: u64 = 60;
/// Bytes of preprocessed screenshots, and of vision features, kept by content hash (each cache).
const CACHE_BYTES: usize = 256 << 20;

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

pub struct ModelBackend {
    model: Qwen2Vl,
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
    images: ByteCache<u64, ProcessedImage>,
    /// Vision-tower outputs `(tokens, H)` by (content hash, adapter): the same screenshot sent again
    /// (every step of a session that did not change the screen) is encoded once.
    features: ByteCache<(u64, Option<String>), Tensor>,
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
    /// Loads the checkpoint in f32 on the CPU and every adapter.
    pub fn load(cfg: &ModelBackendConfig) -> anyhow::Result<Self> {
        let mut model = Qwen2Vl::load(&cfg.model, &Device::Cpu, DType::F32)
            .with_context(|| format!("loading the model {}", cfg.model))?;
        for (name, dir) in &cfg.adapters {
            model
                .load_adapter(name, dir)
                .with_context(|| format!("loading adapter `{name}` from {}", dir.display()))?;
        }
        Self::from_model(model, &cfg.model)
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
        let (images, features) = (ByteCache::new(), ByteCache::new());
        let quote_token = tokenizer.encode("\"").context("tokenising a quote")?.first().copied();
        Ok(Self { model, tokenizer, stop_tokens, info, digit_token, quote_token, string_token, images, features })
    }

    fn use_adapter(&mut self, adapter: Option<&str>) -> Result<(), BackendError> {
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
        self.model.set_active_adapter(adapter).map_err(model_err)
    }

    /// The checkpoint's preprocessing of an image, cached by content hash.
    fn processed(&mut self, img: &ImageInput) -> Result<ProcessedImage, BackendError> {
        if let Some(p) = self.images.get(&img.hash) {
            return Ok(p);
        }
        let p = preprocess(&img.image, &self.model.image_config).map_err(model_err)?;
        self.images.insert(img.hash, p.clone(), p.pixel_values.len() * 4);
        Ok(p)
    }

    /// The vision tower's output for the images, in order, each cached by (hash, active adapter). Each
    /// image attends only to itself, so encoding them one by one equals encoding them together.
    fn image_features(&mut self, images: &[(u64, ProcessedImage)]) -> Result<Option<Tensor>, BackendError> {
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

    fn check_context(&self, prompt: usize, answer: usize) -> Result<(), BackendError> {
        let limit = self.info.context_length;
        if prompt + answer > limit {
            return Err(BackendError::ContextOverflow { tokens: prompt + answer, limit });
        }
        Ok(())
    }

    /// One agent step.
    pub fn step(&mut self, job: &StepJob, cancelled: &dyn Fn() -> bool) -> Result<AgentStepResponse, BackendError> {
        let t_start = Instant::now();
        let req: &AgentStepRequest = &job.request;
        let images: Vec<(u64, ProcessedImage)> =
            job.screenshot.iter().map(|s| Ok((s.hash, self.processed(s)?))).collect::<Result<_, BackendError>>()?;
        let screen = match (&req.observation.screen, &job.screenshot) {
            (Some(s), _) => (s.width, s.height),
            (None, Some(img)) => (img.image.width(), img.image.height()),
            (None, None) => {
                return Err(BackendError::BadInput("observation.screen is required without a screenshot".into()))
            }
        };
        let ic = &self.model.image_config;
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
        let feats = self.image_features(&images)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|(_, i)| i.grid_thw).collect();
        let mut seq = Seq::prefill(&self.model, &ids, &grids, feats.as_ref())?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t0 = Instant::now();
        // The exact distribution over action names: log p of each name's closing `name"` tokens.
        let names: Vec<Vec<u32>> = ACTION_NAMES
            .iter()
            .map(|n| self.tokenizer.encode(&format!("{n}\"")).map_err(model_err))
            .collect::<Result<_, _>>()?;
        let logp: Vec<f64> = names.iter().map(|t| seq.logprob(&self.model, t)).collect::<Result<_, _>>()?;
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
        seq.feed(&self.model, &names[choice])?;
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
                completion_tokens: prefix.len() + generated,
            },
            timings: Timings { queue_ms: 0.0, preprocess_ms, prefill_ms, decode_ms },
        })
    }

    fn force(&self, dec: &mut Decoding, text: &mut String, lit: &str) -> Result<(), BackendError> {
        let toks = self.tokenizer.encode(lit).map_err(model_err)?;
        dec.seq.feed(&self.model, &toks)?;
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
            dec.seq.feed(&self.model, &[tok])?;
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
            dec.seq.feed(&self.model, &[tok])?;
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
        let logp: Vec<f64> = toks.iter().map(|t| dec.seq.logprob(&self.model, t)).collect::<Result<_, _>>()?;
        let probs = normalise(&logp);
        let i = pick(&probs, dec.temperature, &mut dec.rng, None);
        dec.seq.feed(&self.model, &toks[i])?;
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
            dec.seq.feed(&self.model, &[tok])?;
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
    pub fn chat(
        &mut self,
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
        let merge = self.model.image_config.geometry.merge_size;
        let counts: Vec<usize> = images.iter().map(|(_, i)| i.num_tokens(merge)).collect();
        let ids = self.tokenizer.encode_prompt(&text, &counts).map_err(model_err)?;
        self.check_context(ids.len(), job.max_tokens)?;
        let feats = self.image_features(&images)?;
        let grids: Vec<[usize; 3]> = images.iter().map(|(_, i)| i.grid_thw).collect();
        let seq = Seq::prefill(&self.model, &ids, &grids, feats.as_ref())?;
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
                dec.seq.feed(&self.model, &[tok])?;
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

impl Backend for ModelBackend {
    fn info(&self) -> BackendInfo {
        self.info.clone()
    }

    fn run(&mut self, jobs: Vec<Job>) {
        for job in jobs {
            if job.is_cancelled() {
                let _ = job.reply.send(Err(BackendError::Cancelled));
                continue;
            }
            let queue_ms = job.enqueued.elapsed().as_secs_f64() * 1e3;
            let cancelled = || job.is_cancelled();
            let result = self.use_adapter(job.adapter.as_deref()).and_then(|()| match &job.kind {
                JobKind::Step(s) => self.step(s, &cancelled).map(|mut r| {
                    r.timings.queue_ms = queue_ms;
                    JobOutput::Step(Box::new(r))
                }),
                JobKind::Chat(c) => self.chat(c, job.stream.as_ref(), &cancelled).map(JobOutput::Chat),
            });
            if let Err(e) = &result {
                tracing::debug!(error = %e, "job failed");
            }
            let _ = job.reply.send(result);
        }
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
    seq: Seq,
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

/// One sequence on the model: its KV cache, the next M-RoPE position and the logits for the next token.
struct Seq {
    cache: KvCache,
    next: u32,
    logits: Vec<f32>,
}

impl Seq {
    /// Prefills `ids` whose images have `grids` and vision features `feats`.
    fn prefill(
        model: &Qwen2Vl,
        ids: &[u32],
        grids: &[[usize; 3]],
        feats: Option<&Tensor>,
    ) -> Result<Self, BackendError> {
        let dev = &model.device;
        let t = ids.len();
        let ids_t = Tensor::from_slice(ids, (1, t), dev).map_err(candle_err)?;
        let embeds = model.embed(&ids_t, feats).map_err(model_err)?;
        let (pos, next) = mrope_positions(ids, grids, &model.cfg).map_err(model_err)?;
        let mut cache = model.new_cache();
        let hidden = model
            .decode(&embeds, &positions_tensor(&[pos], t).map_err(model_err)?, None, &mut cache)
            .map_err(model_err)?;
        let last = hidden.narrow(1, t - 1, 1).map_err(candle_err)?;
        let logits = Self::row(model, &last)?;
        Ok(Self { cache, next, logits })
    }

    /// `(1, 1, H)` hidden state -> its logits.
    fn row(model: &Qwen2Vl, h: &Tensor) -> Result<Vec<f32>, BackendError> {
        model
            .logits(h)
            .map_err(model_err)?
            .flatten_all()
            .and_then(|l| l.to_dtype(DType::F32))
            .and_then(|l| l.to_vec1::<f32>())
            .map_err(candle_err)
    }

    /// Runs `tokens` through the model; returns the `(n, H)` hidden states.
    fn forward(&mut self, model: &Qwen2Vl, tokens: &[u32]) -> Result<Tensor, BackendError> {
        let dev = &model.device;
        let n = tokens.len();
        let ids = Tensor::from_slice(tokens, (1, n), dev).map_err(candle_err)?;
        let emb = model.embed(&ids, None).map_err(model_err)?;
        let pos: Vec<[u32; 3]> = (0..n as u32).map(|i| [self.next + i; 3]).collect();
        let h = model
            .decode(&emb, &positions_tensor(&[pos], n).map_err(model_err)?, None, &mut self.cache)
            .map_err(model_err)?;
        self.next += n as u32;
        Ok(h)
    }

    /// Appends `tokens` to the sequence.
    fn feed(&mut self, model: &Qwen2Vl, tokens: &[u32]) -> Result<(), BackendError> {
        if tokens.is_empty() {
            return Ok(());
        }
        let h = self.forward(model, tokens)?;
        let n = tokens.len();
        self.logits = Self::row(model, &h.narrow(1, n - 1, 1).map_err(candle_err)?)?;
        Ok(())
    }

    /// `log p(tokens | sequence)`, without changing the sequence (a copy of the cache is extended).
    fn logprob(&self, model: &Qwen2Vl, tokens: &[u32]) -> Result<f64, BackendError> {
        let Some((&first, rest)) = tokens.split_first() else { return Ok(0.0) };
        let mut total = log_softmax_at(&self.logits, first);
        if !rest.is_empty() {
            let mut fork = Seq { cache: self.cache.clone(), next: self.next, logits: vec![] };
            // Logits after each of tokens[..n-1] score tokens[1..].
            let h = fork.forward(model, &tokens[..tokens.len() - 1])?;
            let logits = model.logits(&h).map_err(model_err)?.squeeze(0).map_err(candle_err)?;
            let lsm = log_softmax_rows(&logits)?;
            for (row, &tok) in lsm.iter().zip(rest) {
                total += row[tok as usize] as f64;
            }
        }
        Ok(total)
    }
}

fn log_softmax_at(logits: &[f32], tok: u32) -> f64 {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = logits.iter().map(|&v| (v as f64 - m).exp()).sum();
    logits[tok as usize] as f64 - m - s.ln()
}

/// Row-wise log-softmax of `(n, V)` logits, as rows of f32.
fn log_softmax_rows(logits: &Tensor) -> Result<Vec<Vec<f32>>, BackendError> {
    let l = logits.to_dtype(DType::F32).map_err(candle_err)?;
    let m = l.max_keepdim(D::Minus1).map_err(candle_err)?;
    let shifted = l.broadcast_sub(&m).map_err(candle_err)?;
    let lse = shifted.exp().and_then(|e| e.sum_keepdim(D::Minus1)).and_then(|s| s.log()).map_err(candle_err)?;
    shifted.broadcast_sub(&lse).and_then(|t| t.to_vec2::<f32>()).map_err(candle_err)
}
