//! The OpenAI-compatible backend: any `/chat/completions` endpoint (vLLM, SGLang, llama.cpp, a hosted API).
//!
//! The step's messages are the training prompt in OpenAI form: text-only messages as a string, messages
//! with screenshots as `text` / `image_url` parts, each image inlined as a base64 data URL. Requests are
//! greedy (`temperature: 0`) and capped at `max_tokens`. Transport errors, timeouts, 429 and 5xx are
//! retried with exponential backoff (a 429's `Retry-After` is honoured up to 60 s); any other 4xx is final
//! and its body is returned ([`AgentError::Rejected`]).
//!
//! The frame is `--frame` (default `resized`: pixels of the image after the endpoint's own smart resize,
//! which is right for Qwen2.5-VL when `--min-pixels`/`--max-pixels` match the server's processor).
//! `relative1000` suits Qwen2-VL and UI-TARS-style models; `screen` suits endpoints that see and answer in
//! the original screenshot's pixels. The answer is converted back to screen pixels either way.

use std::path::Path;
use std::time::Duration;

use askgui_data::{ChatMessage, Part, PromptConfig};
use serde_json::{json, Value};

use super::http::{post_json, snippet, with_retries, Failure};
use super::{frame_for, messages_for, prediction_from_reply, prompt_screenshots};
use crate::agent::{Agent, AgentError, Prediction, StepInput};
use crate::identity::{AgentIdentity, Decoding, PromptIdentity};

/// Everything the backend needs to reach an endpoint.
#[derive(Debug, Clone)]
pub struct OpenAiConfig {
    /// The API base, e.g. `http://localhost:8000/v1`; requests go to `{base}/chat/completions`.
    pub base: String,
    /// The model name the endpoint serves.
    pub model: String,
    /// Sent as `Authorization: Bearer ...` when present.
    pub api_key: Option<String>,
    pub timeout_s: f64,
    /// Retries after the first attempt.
    pub retries: u32,
    /// Delay before the first retry; doubles on each further retry, at most 60 s.
    pub backoff_ms: u64,
    pub max_tokens: usize,
    pub prompt: PromptConfig,
}

/// An OpenAI-compatible chat-completions endpoint as an agent.
pub struct OpenAiAgent {
    cfg: OpenAiConfig,
    url: String,
    http: ureq::Agent,
}

/// A screenshot as a data URL; PNG, JPEG, WebP and GIF are sent as they are, anything else as PNG.
pub fn image_data_url(path: &Path) -> Result<String, AgentError> {
    use image::ImageFormat::{Gif, Jpeg, Png, WebP};
    super::http::data_url(path, &[Png, Jpeg, WebP, Gif])
}

/// Chat messages in OpenAI form: a string when a message is text only, else a list of parts.
pub fn openai_messages(messages: &[ChatMessage]) -> Result<Vec<Value>, AgentError> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let text_only = m.content.iter().all(|p| matches!(p, Part::Text { .. }));
        let content = if text_only {
            let text: String = m
                .content
                .iter()
                .filter_map(|p| match p {
                    Part::Text { text } => Some(text.as_str()),
                    Part::Image { .. } => None,
                })
                .collect();
            Value::String(text)
        } else {
            let mut parts = Vec::with_capacity(m.content.len());
            for p in &m.content {
                parts.push(match p {
                    Part::Text { text } => json!({"type": "text", "text": text}),
                    Part::Image { path } => json!({"type": "image_url", "image_url": {"url": image_data_url(path)?}}),
                });
            }
            Value::Array(parts)
        };
        out.push(json!({"role": m.role, "content": content}));
    }
    Ok(out)
}

/// The text of `choices[0].message.content` (a string, a list of text parts, or null for no text).
fn completion_text(v: &Value) -> Option<String> {
    let content = v.pointer("/choices/0/message")?.get("content")?;
    match content {
        Value::String(s) => Some(s.clone()),
        Value::Null => Some(String::new()),
        Value::Array(parts) => {
            Some(parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().concat())
        }
        _ => None,
    }
}

impl OpenAiAgent {
    pub fn new(cfg: OpenAiConfig) -> Result<Self, AgentError> {
        if !(cfg.timeout_s.is_finite() && cfg.timeout_s > 0.0) {
            return Err(AgentError::Input(format!(
                "the timeout must be a positive number of seconds, got {}",
                cfg.timeout_s
            )));
        }
        let base = cfg.base.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(AgentError::Input(format!(
                "the endpoint base `{}` must start with http:// or https:// (e.g. http://localhost:8000/v1)",
                cfg.base
            )));
        }
        let url = format!("{base}/chat/completions");
        let http = ureq::AgentBuilder::new().timeout(Duration::from_secs_f64(cfg.timeout_s)).build();
        Ok(Self { cfg, url, http })
    }

    /// One request: the completion's text.
    fn send(&self, body: &str) -> Result<String, Failure> {
        let mut req = self.http.post(&self.url);
        if let Some(k) = &self.cfg.api_key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        let text = post_json(req, body, |b| snippet(b, 1000))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            Failure::Transient(format!("the response is not JSON ({e}): {}", snippet(&text, 300)), None)
        })?;
        completion_text(&v).ok_or_else(|| {
            Failure::Transient(
                format!("the response has no `choices[0].message.content`: {}", snippet(&text, 300)),
                None,
            )
        })
    }

    /// Sends with retries; the completion's text or the last failure.
    fn complete(&self, body: &Value, what: &str) -> Result<String, AgentError> {
        let body = body.to_string();
        with_retries(&self.url, self.cfg.retries, self.cfg.backoff_ms, what, || self.send(&body))
    }
}

impl Agent for OpenAiAgent {
    fn name(&self) -> String {
        format!("{} @ {}", self.cfg.model, self.cfg.base.trim_end_matches('/'))
    }

    fn identity(&self) -> AgentIdentity {
        AgentIdentity {
            backend: "openai".into(),
            model: Some(self.cfg.model.clone()),
            url: Some(self.url.clone()),
            adapter: None,
            adapter_fingerprint: None,
            decoding: Decoding::greedy(self.cfg.max_tokens),
            prompt: PromptIdentity::of(&self.cfg.prompt),
            runtime: None,
        }
    }

    fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError> {
        let frame = frame_for(input, &self.cfg.prompt)?;
        let screenshots = prompt_screenshots(input, &self.cfg.prompt)?;
        let messages = openai_messages(&messages_for(input, &self.cfg.prompt, frame, screenshots)?)?;
        let body = json!({
            "model": self.cfg.model,
            "messages": messages,
            "temperature": 0,
            "max_tokens": self.cfg.max_tokens,
        });
        let raw = self.complete(&body, &format!("episode {} step {}", input.episode_id, input.step))?;
        Ok(prediction_from_reply(raw, &frame, self.cfg.prompt.action_language))
    }
}
