//! The askgui-serve backend: the server's native agent API, `POST {base}/v1/agent/step`
//! (`askgui_data::agent_api` holds the wire types both sides share).
//!
//! `base` is the server root, e.g. `http://localhost:8080`, with or without a trailing slash; a base that
//! already ends in `/v1` is refused with a hint rather than silently doubled. Each step sends the task,
//! the current screenshot (a base64 `data:` URL; PNG and JPEG as they are, anything else re-encoded as
//! PNG), the earlier steps' screenshots (the last `--history-images` of them when given, else the last
//! [`MAX_EARLIER_SCREENSHOTS`]: the server shows the last ones its model was trained with), the screen
//! size, the history in screen pixels, the adapter name if any, greedy decoding and the token cap; the
//! step's element list goes along when `--elements` is given, as it enters the prompt of the other
//! backends. The server builds the prompt and converts coordinates itself, so `--frame`, `--min-pixels`
//! and `--max-pixels` do not apply here, and the answer's `action` is already in screen pixels.
//!
//! Transport errors, timeouts, 429, 5xx and a 200 whose body is not an `AgentStepResponse` are retried
//! with exponential backoff (a `Retry-After` in seconds is honoured, up to 60 s); any other 4xx is final,
//! reported as [`AgentError::Rejected`] with the server's error message.

use std::path::Path;
use std::time::Duration;

use askgui_data::agent_api::{
    AgentStepRequest, AgentStepResponse, ApiError, Observation, StepOptions, MAX_EARLIER_SCREENSHOTS, STEP_PATH,
};

use super::http::{post_json, snippet, with_retries, Failure};
use crate::agent::{Agent, AgentError, Prediction, StepInput};
use crate::identity::{AgentIdentity, Decoding, PromptIdentity};

/// Everything the backend needs to reach an askgui-serve server.
#[derive(Debug, Clone)]
pub struct EndpointConfig {
    /// The server root, e.g. `http://localhost:8080`; requests go to `{base}/v1/agent/step`.
    pub base: String,
    /// The LoRA adapter to ask for, by the name the server knows it under.
    pub adapter: Option<String>,
    pub timeout_s: f64,
    /// Retries after the first attempt.
    pub retries: u32,
    /// Delay before the first retry; doubles on each further retry, at most 60 s.
    pub backoff_ms: u64,
    /// The decoding options every request carries.
    pub options: StepOptions,
    /// Send the step's element list.
    pub elements: bool,
    /// How many earlier screenshots to send (at most [`MAX_EARLIER_SCREENSHOTS`], the default): the server
    /// shows the last ones its prompt settings name.
    pub history_images: Option<usize>,
}

/// An askgui-serve server as an agent.
pub struct EndpointAgent {
    cfg: EndpointConfig,
    url: String,
    http: ureq::Agent,
}

/// The message of an error body: the [`ApiError`] when it is one, else the start of the body.
fn error_message(body: &str) -> String {
    match serde_json::from_str::<ApiError>(body) {
        Ok(e) => e.to_string(),
        Err(_) => snippet(body, 1000),
    }
}

/// The screenshot as a base64 data URL: PNG and JPEG as they are, anything else re-encoded as PNG.
fn screenshot_data_url(path: &Path) -> Result<String, AgentError> {
    super::http::data_url(path, &[image::ImageFormat::Png, image::ImageFormat::Jpeg])
}

impl EndpointAgent {
    pub fn new(cfg: EndpointConfig) -> Result<Self, AgentError> {
        if !(cfg.timeout_s.is_finite() && cfg.timeout_s > 0.0) {
            return Err(AgentError::Input(format!(
                "the timeout must be a positive number of seconds, got {}",
                cfg.timeout_s
            )));
        }
        cfg.options.check().map_err(|e| AgentError::Input(format!("decoding options: {e}")))?;
        if cfg.adapter.as_deref().is_some_and(|a| a.trim().is_empty()) {
            return Err(AgentError::Input("the adapter name is empty".into()));
        }
        let base = cfg.base.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(AgentError::Input(format!(
                "the endpoint `{}` must start with http:// or https:// (e.g. http://localhost:8080)",
                cfg.base
            )));
        }
        if base.ends_with("/v1") {
            return Err(AgentError::Input(format!(
                "the endpoint `{}` is the server root, without /v1 (requests go to {{base}}{STEP_PATH})",
                cfg.base
            )));
        }
        let url = format!("{base}{STEP_PATH}");
        let http = ureq::AgentBuilder::new().timeout(Duration::from_secs_f64(cfg.timeout_s)).build();
        Ok(Self { cfg, url, http })
    }

    /// The URL requests go to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The request for one step.
    pub fn request(&self, input: &StepInput) -> Result<AgentStepRequest, AgentError> {
        let Some(current) = input.screenshots.last() else {
            return Err(AgentError::Input(format!(
                "episode {} step {}: no screenshot to show the agent",
                input.episode_id, input.step
            )));
        };
        let earlier = &input.screenshots[..input.screenshots.len() - 1];
        let k = self.cfg.history_images.unwrap_or(MAX_EARLIER_SCREENSHOTS).min(MAX_EARLIER_SCREENSHOTS);
        let earlier = &earlier[earlier.len().saturating_sub(k)..];
        Ok(AgentStepRequest {
            task: input.task.clone(),
            observation: Observation {
                screenshot: Some(screenshot_data_url(current)?),
                earlier_screenshots: earlier.iter().map(|p| screenshot_data_url(p)).collect::<Result<_, _>>()?,
                elements: if self.cfg.elements { input.elements.clone() } else { None },
                screen: Some(input.screen),
            },
            history: input.history.clone(),
            adapter: self.cfg.adapter.clone(),
            options: self.cfg.options.clone(),
        })
    }

    /// One request: the server's answer.
    fn send(&self, body: &str) -> Result<AgentStepResponse, Failure> {
        let text = post_json(self.http.post(&self.url), body, error_message)?;
        serde_json::from_str(&text).map_err(|e| {
            Failure::Transient(format!("the response is not an agent step answer ({e}): {}", snippet(&text, 300)), None)
        })
    }

    /// Sends with retries; the answer or the last failure.
    fn step(&self, request: &AgentStepRequest, what: &str) -> Result<AgentStepResponse, AgentError> {
        let body = serde_json::to_string(request)
            .map_err(|e| AgentError::Input(format!("{what}: the request does not serialise: {e}")))?;
        with_retries(&self.url, self.cfg.retries, self.cfg.backoff_ms, what, || self.send(&body))
    }
}

impl Agent for EndpointAgent {
    fn name(&self) -> String {
        let base = self.cfg.base.trim_end_matches('/');
        match &self.cfg.adapter {
            Some(adapter) => format!("askgui-serve {adapter} @ {base}"),
            None => format!("askgui-serve @ {base}"),
        }
    }

    /// The server builds the prompt from its own settings: only the element list is ours to send.
    fn identity(&self) -> AgentIdentity {
        AgentIdentity {
            backend: "askgui-serve".into(),
            model: None,
            url: Some(self.url.clone()),
            adapter: self.cfg.adapter.clone(),
            adapter_fingerprint: None,
            decoding: Decoding::of(&self.cfg.options),
            prompt: PromptIdentity { elements: self.cfg.elements, ..Default::default() },
            runtime: None,
        }
    }

    fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError> {
        let what = format!("episode {} step {}", input.episode_id, input.step);
        let request = self.request(input)?;
        let resp = self.step(&request, &what)?;
        let s = resp.frame.screen;
        if (s.width, s.height) != (input.screen.width, input.screen.height) {
            tracing::warn!(
                "{what}: the server answered for a {}x{} screen, the step's is {}x{}",
                s.width,
                s.height,
                input.screen.width,
                input.screen.height
            );
        }
        Ok(Prediction {
            action: Some(resp.action),
            raw: resp.raw,
            parse_error: None,
            ask_probability: resp.ask_probability,
        })
    }
}
