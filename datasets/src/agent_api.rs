//! The wire format of askgui-serve's native agent API, shared by the server and every client (askgui-eval's
//! `--endpoint` backend among them), so the two sides can never drift apart.
//!
//! One stateless call, `POST /v1/agent/step`: the client sends the task, what is on the screen now and the
//! dialogue so far; the server builds the training prompt, runs the model once and answers with the next
//! action. Every coordinate the client sends or gets back in `action` is in *screen pixels* of the
//! screenshot; the server converts to and from its model's frame (`crate::frame`) and reports that frame
//! too (`model_action`, `frame`), so a client can check the conversion.
//!
//! A request (only `task` and `observation.screenshot` are required; `screen` is then read from the image):
//!
//! ```json
//! {
//!   "task": "Buy oat milk",
//!   "observation": {
//!     "screenshot": "data:image/png;base64,iVBORw0KGgo...",
//!     "earlier_screenshots": ["data:image/png;base64,iVBORw0KGgo..."],
//!     "elements": [{"id": "e3", "role": "button", "text": "Search", "bbox": [40, 180, 1040, 260]}],
//!     "screen": {"width": 1080, "height": 2400}
//!   },
//!   "history": [
//!     {"turn": "agent", "action": {"action": "click", "x": 540, "y": 220}},
//!     {"turn": "agent", "action": {"action": "ask", "question": "Which size?"}},
//!     {"turn": "say", "text": "The 1 litre one."}
//!   ],
//!   "adapter": "askgui-lora-v1",
//!   "options": {"max_tokens": 128, "temperature": 0.0, "seed": 7, "constrain": true, "pause_threshold": 0.5}
//! }
//! ```
//!
//! Its answer (`200 OK`):
//!
//! ```json
//! {
//!   "action": {"action": "click", "x": 540, "y": 1210},
//!   "model_action": {"action": "click", "x": 336, "y": 748},
//!   "frame": {
//!     "kind": "resized",
//!     "screen": {"width": 1080, "height": 2400},
//!     "model": {"width": 672, "height": 1484},
//!     "resize_factors": [0.6222222222222222, 0.6183333333333333]
//!   },
//!   "raw": "{\"action\":\"click\",\"x\":336,\"y\":748}",
//!   "ask_probability": 0.04,
//!   "usage": {"prompt_tokens": 1502, "image_tokens": 1272, "completion_tokens": 14},
//!   "timings": {"queue_ms": 0.4, "preprocess_ms": 12.1, "prefill_ms": 85.3, "decode_ms": 61.0}
//! }
//! ```
//!
//! A failure is a 4xx/5xx status with an [`ApiError`] body, e.g.
//! `{"error": {"message": "observation: no screenshot and no elements", "type": "invalid_request_error"}}`;
//! a 429 (`rate_limit_error`) carries a `Retry-After` header in seconds. Clients retry 429 and 5xx, never
//! another 4xx.
//!
//! The types ignore fields they do not know, so a client reads the answers of a newer server. The server
//! is stricter with requests: askgui-serve answers a request field it does not know with a 400 naming its
//! path (`options.max_new_tokens`) and the known fields, so that a misspelt option is never dropped in
//! silence. Optional fields are left out when empty.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::action::{Action, Turn};
use crate::episode::{Element, Screen};
use crate::frame::{rescale, FrameKind, FrameMap};

/// The path of the step call, relative to the server root.
pub const STEP_PATH: &str = "/v1/agent/step";

/// Why a request cannot be served as it is (the server answers it with a 400 `invalid_request_error`).
#[derive(Debug, Error, PartialEq)]
pub enum RequestError {
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
}

fn invalid(field: &'static str, reason: impl Into<String>) -> RequestError {
    RequestError::Invalid { field, reason: reason.into() }
}

/// `POST /v1/agent/step`: one step of an agent, statelessly.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct AgentStepRequest {
    /// The task as the user gave it (possibly ambiguous: the model may `ask`).
    pub task: String,
    pub observation: Observation,
    /// Earlier actions and ASK/SAY turns, oldest first, in screen pixels. Trailing `ask`/`say` turns were
    /// asked at this very step.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Turn>,
    /// The LoRA adapter to answer with, by the name the server knows it under; the base model when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    #[serde(default, skip_serializing_if = "StepOptions::is_empty")]
    pub options: StepOptions,
}

/// What the agent sees now.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Observation {
    /// The current screenshot, PNG or JPEG, as standard (or URL-safe) base64; a `data:image/...;base64,`
    /// prefix is allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub screenshot: Option<String>,
    /// The screenshots of the earlier steps, oldest first, each as `screenshot` is written (at most
    /// [`MAX_EARLIER_SCREENSHOTS`]). A model trained with `--history-images k` is shown the last `k` of them
    /// before the current one, as in training; others show the current one only. A session keeps its own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub earlier_screenshots: Vec<String>,
    /// The element list (accessibility / DOM nodes), in screen pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elements: Option<Vec<Element>>,
    /// The screen size in pixels. Required when there is no screenshot; with one, it defaults to the
    /// image's size (and must equal it when given, up to the client having scaled the screenshot: the
    /// server then answers in `screen` pixels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub screen: Option<Screen>,
}

/// Per-request generation options; every field falls back to the server's default when absent.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct StepOptions {
    /// The longest answer, in tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Sampling temperature; 0 is greedy (the usual server default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Seed for sampling, for reproducible answers at temperature > 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Constrain decoding to the action schema (the answer always parses).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constrain: Option<bool>,
    /// Ask whenever the model's probability of asking at this step is at least this (0..=1), instead of
    /// only when the decoded answer is an `ask`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_threshold: Option<f64>,
    /// The frame the answer's `action` is written in: screen pixels when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinates: Option<Coordinates>,
}

/// The coordinate frames front ends use for an answer's `action`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(tag = "frame", rename_all = "snake_case")]
pub enum Coordinates {
    /// Pixels of the screen (`observation.screen`, else the screenshot).
    Screen,
    /// 0..1000 across the width and down the height (UI-TARS, Qwen2-VL grounding).
    Relative1000,
    /// Pixels of a size the client declares, as Agent S3 declares its grounding size.
    Grounding { width: u32, height: u32 },
}

/// The largest declared grounding side.
const MAX_GROUNDING_SIDE: u32 = 100_000;

impl Coordinates {
    /// The frame's size for a `screen` of `(width, height)` pixels.
    pub fn size(&self, screen: (u32, u32)) -> (u32, u32) {
        match *self {
            Coordinates::Screen => screen,
            Coordinates::Relative1000 => (1000, 1000),
            Coordinates::Grounding { width, height } => (width, height),
        }
    }

    /// `action`, given in pixels of `screen`, in this frame.
    pub fn from_screen(&self, action: &Action, screen: (u32, u32)) -> Action {
        let size = self.size(screen);
        action.map_points(|x, y| (rescale(x, screen.0, size.0), rescale(y, screen.1, size.1)))
    }
}

impl StepOptions {
    pub fn is_empty(&self) -> bool {
        self == &Self::default()
    }
}

/// The most earlier screenshots a request may carry (the longest screenshot history a model is trained
/// with is far shorter; this bounds one request's decoding work).
pub const MAX_EARLIER_SCREENSHOTS: usize = 16;

/// An image field's bytes: the base64 payload decoded, after any `data:` URL prefix; the error is the
/// reason, for the caller to name the field.
fn image_bytes(s: &str) -> Result<Vec<u8>, String> {
    let payload = match s.trim_start().strip_prefix("data:") {
        Some(url) => match url.split_once(',') {
            Some((meta, data)) if meta.ends_with(";base64") => data,
            Some(_) => return Err("a data: URL must be base64 (`;base64,`)".into()),
            None => return Err("a data: URL without a `,`".into()),
        },
        None => s,
    };
    let bytes = crate::convert::base64_decode(payload).map_err(|e| e.to_string())?;
    if bytes.is_empty() {
        return Err("empty image".into());
    }
    Ok(bytes)
}

impl Observation {
    /// The screenshot's bytes: the base64 payload decoded, after any `data:` URL prefix. `None` when the
    /// observation has no screenshot.
    pub fn screenshot_bytes(&self) -> Result<Option<Vec<u8>>, RequestError> {
        let bytes = self.screenshot.as_deref().map(image_bytes).transpose();
        bytes.map_err(|e| invalid("observation.screenshot", e))
    }

    /// The bytes of the last `k` earlier screenshots (those a prompt that shows `k` can show), oldest
    /// first; each named by its index in errors.
    pub fn earlier_screenshot_bytes(&self, k: usize) -> Result<Vec<Vec<u8>>, RequestError> {
        let first = self.earlier_screenshots.len().saturating_sub(k);
        (first..self.earlier_screenshots.len())
            .map(|i| {
                let bytes = image_bytes(&self.earlier_screenshots[i]);
                bytes.map_err(|e| invalid("observation.earlier_screenshots", format!("screenshot {i}: {e}")))
            })
            .collect()
    }
}

impl AgentStepRequest {
    /// A request with the task and a screenshot only (everything else defaulted).
    pub fn new(task: impl Into<String>, screenshot_base64: impl Into<String>) -> Self {
        Self {
            task: task.into(),
            observation: Observation { screenshot: Some(screenshot_base64.into()), ..Default::default() },
            history: Vec::new(),
            adapter: None,
            options: StepOptions::default(),
        }
    }

    /// Checks what serde cannot (without decoding the screenshot): a non-empty task; a screenshot or
    /// elements, and a screen size when there is no screenshot; a non-empty screen; valid history actions;
    /// options in range.
    pub fn check(&self) -> Result<(), RequestError> {
        if self.task.trim().is_empty() {
            return Err(invalid("task", "empty"));
        }
        let o = &self.observation;
        if o.screenshot.is_none() {
            if o.elements.is_none() {
                return Err(invalid("observation", "no screenshot and no elements"));
            }
            if o.screen.is_none() {
                return Err(invalid("observation.screen", "required when there is no screenshot"));
            }
        }
        if !o.earlier_screenshots.is_empty() && o.screenshot.is_none() {
            return Err(invalid("observation.earlier_screenshots", "given without the current `screenshot`"));
        }
        if o.earlier_screenshots.len() > MAX_EARLIER_SCREENSHOTS {
            return Err(invalid(
                "observation.earlier_screenshots",
                format!("{} screenshots; at most {MAX_EARLIER_SCREENSHOTS}", o.earlier_screenshots.len()),
            ));
        }
        if let Some(s) = o.screen {
            if s.width == 0 || s.height == 0 {
                return Err(invalid("observation.screen", format!("{}x{} is empty", s.width, s.height)));
            }
        }
        for (i, t) in self.history.iter().enumerate() {
            if let Turn::Agent { action } = t {
                action.check().map_err(|e| invalid("history", format!("turn {i}: {e}")))?;
            }
        }
        if self.adapter.as_deref().is_some_and(|a| a.trim().is_empty()) {
            return Err(invalid("adapter", "empty name (leave it out for the base model)"));
        }
        self.options.check()
    }
}

impl StepOptions {
    /// Checks that each option is in range.
    pub fn check(&self) -> Result<(), RequestError> {
        if self.max_tokens == Some(0) {
            return Err(invalid("options.max_tokens", "must be at least 1"));
        }
        if let Some(t) = self.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return Err(invalid("options.temperature", format!("must be a finite number >= 0, got {t}")));
            }
        }
        if let Some(p) = self.pause_threshold {
            if !(0.0..=1.0).contains(&p) {
                return Err(invalid("options.pause_threshold", format!("must be in 0..=1, got {p}")));
            }
        }
        if let Some(Coordinates::Grounding { width, height }) = self.coordinates {
            if !(1..=MAX_GROUNDING_SIDE).contains(&width) || !(1..=MAX_GROUNDING_SIDE).contains(&height) {
                return Err(invalid(
                    "options.coordinates",
                    format!("a grounding size of {width}x{height}; each side must be 1..={MAX_GROUNDING_SIDE}"),
                ));
            }
        }
        Ok(())
    }
}

/// The answer to `POST /v1/agent/step`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct AgentStepResponse {
    /// The next action, in screen pixels, or in `options.coordinates` when the request gave them.
    pub action: Action,
    /// The frame `action` is in, when the request asked for one other than screen pixels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinates: Option<Coordinates>,
    /// The action in screen pixels, when `action` is in another frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub screen_action: Option<Action>,
    /// The same action in the model's frame, as the model wrote it (see `frame`).
    pub model_action: Action,
    pub frame: FrameInfo,
    /// The model's raw text (thought and action).
    pub raw: String,
    /// The model's probability of asking at this step, when the server computes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ask_probability: Option<f64>,
    #[serde(default)]
    pub usage: Usage,
    #[serde(default)]
    pub timings: Timings,
}

/// The model frame the server answered in: [`FrameMap`] on the wire.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct FrameInfo {
    pub kind: FrameKind,
    /// The screen, in pixels.
    pub screen: Screen,
    /// The size of the model frame: the resized image, 1000x1000, or the screen.
    pub model: Screen,
    /// Model frame units per screen pixel, `[sx, sy]`.
    pub resize_factors: (f64, f64),
}

impl AgentStepResponse {
    /// The answer with its `action` in `coordinates` (screen pixels when `None` or `Screen`); the
    /// screen-pixel action moves to `screen_action`.
    pub fn in_coordinates(mut self, coordinates: Option<Coordinates>) -> Self {
        let Some(c) = coordinates.filter(|c| *c != Coordinates::Screen) else { return self };
        let screen = (self.frame.screen.width, self.frame.screen.height);
        let action = c.from_screen(&self.action, screen);
        self.screen_action = Some(std::mem::replace(&mut self.action, action));
        self.coordinates = Some(c);
        self
    }
}

impl From<&FrameMap> for FrameInfo {
    fn from(m: &FrameMap) -> Self {
        Self {
            kind: m.kind,
            screen: Screen { width: m.screen.0, height: m.screen.1 },
            model: Screen { width: m.model.0, height: m.model.1 },
            resize_factors: m.resize_factors(),
        }
    }
}

impl FrameInfo {
    /// The frame map this describes (`resize_factors` follow from the two sizes).
    pub fn frame_map(&self) -> FrameMap {
        FrameMap {
            kind: self.kind,
            screen: (self.screen.width, self.screen.height),
            model: (self.model.width, self.model.height),
        }
    }
}

/// Token counts of one step. `prompt_tokens` includes `image_tokens`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: usize,
    #[serde(default)]
    pub image_tokens: usize,
    /// Prompt tokens whose keys and values were reused from an earlier prompt with the same beginning
    /// (the server's prefix cache), so they cost no prefill.
    #[serde(default)]
    pub cached_tokens: usize,
    #[serde(default)]
    pub completion_tokens: usize,
}

/// Where one step's time went on the server, in milliseconds.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Default)]
pub struct Timings {
    /// Waiting for a slot.
    #[serde(default)]
    pub queue_ms: f64,
    /// Decoding and resizing the image, building the prompt, tokenising.
    #[serde(default)]
    pub preprocess_ms: f64,
    /// The vision tower and the prompt's forward pass, up to the first token.
    #[serde(default)]
    pub prefill_ms: f64,
    /// Generating the remaining tokens.
    #[serde(default)]
    pub decode_ms: f64,
}

impl Timings {
    pub fn total_ms(&self) -> f64 {
        self.queue_ms + self.preprocess_ms + self.prefill_ms + self.decode_ms
    }
}

/// The body of every 4xx/5xx answer: `{"error": {"message": ..., "type": ...}}`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub error: ApiErrorBody,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ApiErrorBody {
    /// What went wrong, for a person.
    pub message: String,
    /// The class of error, for a program: one of the `ERROR_*` constants (a client must accept others).
    #[serde(rename = "type", default)]
    pub kind: String,
}

/// 400 (and other 4xx): the request is malformed or names something the server does not have.
pub const ERROR_INVALID_REQUEST: &str = "invalid_request_error";
/// 404: no such path, or no such adapter.
pub const ERROR_NOT_FOUND: &str = "not_found_error";
/// 429: the queue is full; retry after the `Retry-After` header's seconds.
pub const ERROR_RATE_LIMIT: &str = "rate_limit_error";
/// 500: the server failed (a bug or a model error).
pub const ERROR_SERVER: &str = "server_error";
/// 503: the server is loading or shutting down.
pub const ERROR_UNAVAILABLE: &str = "unavailable_error";

impl ApiError {
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        Self { error: ApiErrorBody { message: message.into(), kind: kind.into() } }
    }

    /// The error type that goes with an HTTP status.
    pub fn kind_for_status(status: u16) -> &'static str {
        match status {
            404 => ERROR_NOT_FOUND,
            429 => ERROR_RATE_LIMIT,
            503 => ERROR_UNAVAILABLE,
            s if s >= 500 => ERROR_SERVER,
            _ => ERROR_INVALID_REQUEST,
        }
    }
}

impl From<&RequestError> for ApiError {
    fn from(e: &RequestError) -> Self {
        Self::new(ERROR_INVALID_REQUEST, e.to_string())
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.error.kind.as_str() {
            "" => write!(f, "{}", self.error.message),
            kind => write!(f, "{} ({kind})", self.error.message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::{Ask, DoneStatus, Target};
    use crate::frame::ResizeBounds;
    use serde_json::{json, Value};

    fn full_request() -> AgentStepRequest {
        AgentStepRequest {
            task: "Buy oat milk".into(),
            observation: Observation {
                screenshot: Some(format!("data:image/png;base64,{}", crate::convert::base64_encode(b"\x89PNG..."))),
                elements: Some(vec![Element {
                    id: "e3".into(),
                    role: "button".into(),
                    text: "Search".into(),
                    bbox: [40, 180, 1040, 260],
                }]),
                screen: Some(Screen { width: 1080, height: 2400 }),
                ..Observation::default()
            },
            history: vec![
                Turn::Agent { action: Action::Click(Target::point(540, 220)) },
                Turn::Agent {
                    action: Action::Ask(Ask { question: "Which size?".into(), options: vec![], kind: None }),
                },
                Turn::Say { text: "The 1 litre one.".into() },
            ],
            adapter: Some("askgui-lora-v1".into()),
            options: StepOptions {
                max_tokens: Some(128),
                temperature: Some(0.0),
                seed: Some(7),
                constrain: Some(true),
                pause_threshold: Some(0.5),
                coordinates: None,
            },
        }
    }

    fn response() -> AgentStepResponse {
        let m = FrameMap::new(FrameKind::Resized, 1080, 2400, ResizeBounds::default()).unwrap();
        let action = Action::Click(Target::point(540, 1210));
        let model_action = m.action_to_model(&action);
        AgentStepResponse {
            raw: model_action.render(),
            action,
            coordinates: None,
            screen_action: None,
            model_action,
            frame: FrameInfo::from(&m),
            ask_probability: Some(0.04),
            usage: Usage { prompt_tokens: 1502, image_tokens: 1272, completion_tokens: 14, cached_tokens: 0 },
            timings: Timings { queue_ms: 0.4, preprocess_ms: 12.1, prefill_ms: 85.3, decode_ms: 61.0 },
        }
    }

    #[test]
    fn request_and_response_round_trip() {
        let req = full_request();
        let text = serde_json::to_string(&req).unwrap();
        assert_eq!(serde_json::from_str::<AgentStepRequest>(&text).unwrap(), req);
        assert_eq!(req.check(), Ok(()));
        assert_eq!(req.observation.screenshot_bytes().unwrap().unwrap(), b"\x89PNG...");

        let resp = response();
        let v = serde_json::to_value(&resp).unwrap();
        assert_eq!(v["action"], json!({"action": "click", "x": 540, "y": 1210}));
        assert_eq!(v["model_action"], json!({"action": "click", "x": 336, "y": 748}));
        assert_eq!(v["frame"]["kind"], "resized");
        assert_eq!(v["frame"]["model"], json!({"width": 672, "height": 1484}));
        assert!(v["frame"]["resize_factors"].as_array().is_some_and(|a| a.len() == 2));
        assert_eq!(serde_json::from_value::<AgentStepResponse>(v).unwrap(), resp);
        assert_eq!(resp.frame.frame_map(), FrameMap::new(FrameKind::Resized, 1080, 2400, Default::default()).unwrap());
    }

    #[test]
    fn the_module_doc_examples_parse() {
        // The JSON in the header, screenshot shortened to something decodable.
        let req: AgentStepRequest = serde_json::from_value(json!({
            "task": "Buy oat milk",
            "observation": {
                "screenshot": "data:image/png;base64,iVBORw0KGgo=",
                "elements": [{"id": "e3", "role": "button", "text": "Search", "bbox": [40, 180, 1040, 260]}],
                "screen": {"width": 1080, "height": 2400}
            },
            "history": [
                {"turn": "agent", "action": {"action": "click", "x": 540, "y": 220}},
                {"turn": "agent", "action": {"action": "ask", "question": "Which size?"}},
                {"turn": "say", "text": "The 1 litre one."}
            ],
            "adapter": "askgui-lora-v1",
            "options": {"max_tokens": 128, "temperature": 0.0, "seed": 7, "constrain": true, "pause_threshold": 0.5}
        }))
        .unwrap();
        assert_eq!(AgentStepRequest { observation: full_request().observation, ..req.clone() }, full_request());
        let resp: AgentStepResponse = serde_json::from_value(json!({
            "action": {"action": "click", "x": 540, "y": 1210},
            "model_action": {"action": "click", "x": 336, "y": 748},
            "frame": {
                "kind": "resized",
                "screen": {"width": 1080, "height": 2400},
                "model": {"width": 672, "height": 1484},
                "resize_factors": [0.6222222222222222, 0.6183333333333333]
            },
            "raw": "{\"action\":\"click\",\"x\":336,\"y\":748}",
            "ask_probability": 0.04,
            "usage": {"prompt_tokens": 1502, "image_tokens": 1272, "completion_tokens": 14},
            "timings": {"queue_ms": 0.4, "preprocess_ms": 12.1, "prefill_ms": 85.3, "decode_ms": 61.0}
        }))
        .unwrap();
        assert_eq!(resp, response());
    }

    #[test]
    fn a_minimal_request_gets_defaults_and_unknown_fields_are_ignored() {
        let req: AgentStepRequest = serde_json::from_value(json!({
            "task": "Open settings",
            "observation": {"screenshot": "aGVsbG8=", "future_field": 1},
            "client_version": "9.9"
        }))
        .unwrap();
        assert_eq!(req, AgentStepRequest::new("Open settings", "aGVsbG8="));
        assert!(req.history.is_empty() && req.adapter.is_none() && req.options.is_empty());
        assert_eq!(req.check(), Ok(()));
        assert_eq!(req.observation.screenshot_bytes().unwrap().unwrap(), b"hello");
        // Empty optional parts are left out on the wire.
        let v = serde_json::to_value(&req).unwrap();
        assert_eq!(v, json!({"task": "Open settings", "observation": {"screenshot": "aGVsbG8="}}));

        // A response from a server that reports no usage or timings.
        let resp: AgentStepResponse = serde_json::from_value(json!({
            "action": {"action": "done", "status": "success"},
            "model_action": {"action": "done", "status": "success"},
            "frame": {"kind": "screen", "screen": {"width": 8, "height": 6}, "model": {"width": 8, "height": 6},
                      "resize_factors": [1.0, 1.0]},
            "raw": "done",
            "extra": {"anything": true}
        }))
        .unwrap();
        assert_eq!(resp.action, Action::Done { status: DoneStatus::Success });
        assert_eq!((resp.usage, resp.timings, resp.ask_probability), (Usage::default(), Timings::default(), None));
    }

    #[test]
    fn check_and_screenshot_errors_name_the_field() {
        let field = |req: &AgentStepRequest| match req.check() {
            Err(RequestError::Invalid { field, .. }) => field,
            Ok(()) => "ok",
        };
        let base = AgentStepRequest::new("t", "aGVsbG8=");
        assert_eq!(field(&AgentStepRequest { task: " ".into(), ..base.clone() }), "task");
        let no_shot = AgentStepRequest { observation: Observation::default(), ..base.clone() };
        assert_eq!(field(&no_shot), "observation");
        let elements_only = AgentStepRequest {
            observation: Observation { elements: Some(vec![]), ..Default::default() },
            ..base.clone()
        };
        assert_eq!(field(&elements_only), "observation.screen");
        let mut opts = base.clone();
        opts.options.pause_threshold = Some(1.5);
        assert_eq!(field(&opts), "options.pause_threshold");
        opts.options = StepOptions { temperature: Some(f64::NAN), ..Default::default() };
        assert_eq!(field(&opts), "options.temperature");
        let mut hist = base.clone();
        hist.history.push(Turn::Agent { action: Action::Type { text: "".into() } });
        assert_eq!(field(&hist), "history");

        let shot = |s: &str| Observation { screenshot: Some(s.into()), ..Default::default() }.screenshot_bytes();
        assert!(shot("not base64!").is_err());
        assert!(shot("data:image/png,abc").is_err());
        assert!(shot("").is_err());
        assert_eq!(shot("data:image/jpeg;base64,aGVsbG8").unwrap().unwrap(), b"hello");
        assert_eq!(Observation::default().screenshot_bytes(), Ok(None));

        // Earlier screenshots: only beside a current one, at most MAX_EARLIER_SCREENSHOTS; the last k are
        // read, and a bad one is named by its index.
        let mut earlier = base.clone();
        earlier.observation.earlier_screenshots = vec!["aGVsbG8".into(), "!".into(), "d29ybGQ".into()];
        assert_eq!(earlier.check(), Ok(()));
        assert_eq!(earlier.observation.earlier_screenshot_bytes(1).unwrap(), [b"world".to_vec()]);
        let e = earlier.observation.earlier_screenshot_bytes(2).unwrap_err().to_string();
        assert!(e.starts_with("observation.earlier_screenshots: screenshot 1:"), "{e}");
        assert!(earlier.observation.earlier_screenshot_bytes(0).unwrap().is_empty());
        let mut alone = earlier.clone();
        alone.observation.screenshot = None;
        alone.observation.elements = Some(vec![]);
        alone.observation.screen = Some(Screen { width: 4, height: 4 });
        assert_eq!(field(&alone), "observation.earlier_screenshots");
        let mut many = earlier.clone();
        many.observation.earlier_screenshots = vec!["aGVsbG8".into(); MAX_EARLIER_SCREENSHOTS + 1];
        assert_eq!(field(&many), "observation.earlier_screenshots");
    }

    #[test]
    fn api_errors_use_type_on_the_wire() {
        let e = ApiError::new(ERROR_RATE_LIMIT, "queue full");
        let v: Value = serde_json::to_value(&e).unwrap();
        assert_eq!(v, json!({"error": {"message": "queue full", "type": "rate_limit_error"}}));
        assert_eq!(serde_json::from_value::<ApiError>(v).unwrap(), e);
        assert_eq!(e.to_string(), "queue full (rate_limit_error)");
        // Bodies from other servers: no type, extra fields.
        let other: ApiError = serde_json::from_str(r#"{"error": {"message": "bad", "code": 12}}"#).unwrap();
        assert_eq!(other.to_string(), "bad");
        assert_eq!(ApiError::kind_for_status(429), ERROR_RATE_LIMIT);
        assert_eq!(ApiError::kind_for_status(502), ERROR_SERVER);
        assert_eq!(ApiError::kind_for_status(422), ERROR_INVALID_REQUEST);
        let bad = AgentStepRequest::new("", "aGVsbG8=").check().unwrap_err();
        assert_eq!(ApiError::from(&bad).error.kind, ERROR_INVALID_REQUEST);
    }
}
