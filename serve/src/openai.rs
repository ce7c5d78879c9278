//! The OpenAI-compatible surface: `POST /v1/chat/completions` (plain and streamed) and `GET /v1/models`,
//! which is what UI-TARS-desktop, Midscene and most agent frameworks call.
//!
//! `model` is the base model's id or an adapter's name (anything else: 404 `model_not_found`, as OpenAI
//! answers). Images come as `image_url` parts holding `data:` URLs; the server fetches nothing. Every
//! parameter of OpenAI's reference is accepted; those the server cannot honour are refused when their
//! value asks for it (`n` > 1, `logprobs`), the others ignored; an unknown one is a 400 naming it, as
//! OpenAI answers (`--lenient-requests` logs it instead). A streamed answer waits for the model's
//! first piece (or its failure) before sending the 200, so a prompt over the context is still a clean
//! 400; after that, a failure is reported as an `error` event in the stream.
//! The answer is the served action language's own text; a model of the tool-call language asked with
//! `tools` answers OpenAI `tool_calls` instead ([`crate::tool_calls`], [`wants_tool_calls`]).
//! Reference: <https://platform.openai.com/docs/api-reference/chat>.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::{web, HttpResponse};
use askgui_data::language::TOOL_NAME;
use askgui_data::ActionLanguage;
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::agent_routes::{check_max_tokens, decode_image};
use crate::backend::{
    BackendError, BackendInfo, ChatJob, ChatMessage, ChatOutput, ChatPart, ChatRole, FinishReason, JobKind, JobOutput,
};
use crate::engine::{CallError, CancelGuard};
use crate::error::HttpError;
use crate::state::AppState;
use crate::strict::{self, Strict};
use crate::tool_calls::{self, CallStream, ToolCall};

/// The most stop strings a request may give (OpenAI allows 4).
const MAX_STOP: usize = 16;

/// The body of `POST /v1/chat/completions`: every parameter of OpenAI's reference, so that a misspelt
/// one is a 400 (the strict extractor). Grouped by what the server does with it; serve/README.md has the
/// table.
#[derive(Serialize, Deserialize, Debug)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<InMessage>,
    // Used.
    pub max_tokens: Option<usize>,
    /// OpenAI's newer name for `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// 1 only.
    pub n: Option<u64>,
    // Refused when they ask for what the server cannot give (see [`refuse_unsupported`]), else ignored.
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub response_format: Option<Value>,
    pub modalities: Option<Vec<String>>,
    pub audio: Option<Value>,
    pub web_search_options: Option<Value>,
    // The tool-call language's function calls ([`wants_tool_calls`]); refused with the other languages.
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Vec<Value>>,
    pub function_call: Option<Value>,
    // Accepted and ignored: hints and bookkeeping.
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub logit_bias: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub prediction: Option<Value>,
    pub reasoning_effort: Option<String>,
    pub verbosity: Option<String>,
    pub user: Option<String>,
    pub safety_identifier: Option<String>,
    pub prompt_cache_key: Option<String>,
    pub prompt_cache_retention: Option<String>,
    pub metadata: Option<Value>,
    pub store: Option<bool>,
    pub service_tier: Option<String>,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Serialize, Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// Ignored: the server adds no obfuscation padding.
    pub include_obfuscation: Option<bool>,
}

/// A message as sent: `content` is a string, an array of parts, or null; checked by hand for messages
/// that say which message and part is wrong. An assistant's `tool_calls` and the `tool` role are the
/// tool-call language's (refused with the others); `name`, `refusal`, `function_call`, `audio` and
/// `tool_call_id` are ignored (the prompt has the text and images only).
#[derive(Serialize, Deserialize, Debug)]
pub struct InMessage {
    pub role: String,
    #[serde(default)]
    pub content: Value,
    pub name: Option<String>,
    pub refusal: Option<String>,
    pub tool_calls: Option<Vec<Value>>,
    pub tool_call_id: Option<String>,
    pub function_call: Option<Value>,
    pub audio: Option<Value>,
}

/// A content part, by its `type` (OpenAI's five); checked strictly like the request.
#[derive(Serialize, Deserialize, Debug)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Part {
    Text {
        text: String,
    },
    /// `{"url": ...}` as OpenAI documents it; a bare string as some clients send it.
    ImageUrl {
        image_url: Value,
    },
    /// In an assistant message: what it declined, kept as its text.
    Refusal {
        refusal: String,
    },
    InputAudio {
        input_audio: Value,
    },
    File {
        file: Value,
    },
}

#[derive(Serialize, Deserialize, Debug)]
struct ImageUrl {
    url: String,
    /// Ignored: the image processor's settings decide the resolution.
    detail: Option<String>,
}

/// A 400 for parameters whose value asks for what this server cannot give (anything else it does not use
/// is ignored).
fn refuse_unsupported(req: &ChatRequest, language: ActionLanguage) -> Result<(), HttpError> {
    let refuse = |field: &str, why: &str| Err(HttpError::bad_request(format!("{field}: {why}")));
    if let Some(n) = req.n.filter(|&n| n != 1) {
        return refuse("n", &format!("{n} choices asked; this server answers n = 1 only"));
    }
    if req.logprobs == Some(true) || req.top_logprobs.is_some_and(|k| k > 0) {
        return refuse("logprobs", "this server does not return log probabilities; leave it out or false");
    }
    let format = req.response_format.as_ref().map(|f| f.get("type").and_then(Value::as_str).unwrap_or("?"));
    if format.is_some_and(|t| t != "text") {
        let why = format!("only `text`: the model writes its action in its own action language ({})", language.name());
        return refuse("response_format", &why);
    }
    if req.modalities.as_ref().is_some_and(|m| m.iter().any(|m| m != "text")) || req.audio.is_some() {
        return refuse("modalities", "this server answers text only (no `audio`)");
    }
    if req.web_search_options.is_some() {
        return refuse("web_search_options", "this server does not search the web");
    }
    Ok(())
}

/// Whether the answer's tool calls go out as OpenAI `tool_calls`: with `tools` naming the tool-call
/// language's function (`computer_use`) and `tool_choice` not `none`. `tools` with another language,
/// a list without that function, and a choice that would force a call (free decoding promises none) are
/// 400s that say what to send.
fn wants_tool_calls(req: &ChatRequest, language: ActionLanguage) -> Result<bool, HttpError> {
    let refuse = |field: &str, why: String| Err(HttpError::bad_request(format!("{field}: {why}")));
    let tool_call = language == ActionLanguage::ToolCall;
    let own = match tool_call {
        true => format!("send `tools` with the function `{TOOL_NAME}`"),
        false => format!("this model answers in its own action language ({}), as text", language.name()),
    };
    if req.functions.as_ref().is_some_and(|f| !f.is_empty()) {
        return refuse("functions", format!("the deprecated `functions` is not served; {own}"));
    }
    for (field, choice) in [("tool_choice", &req.tool_choice), ("function_call", &req.function_call)] {
        if choice.as_ref().is_some_and(|c| c != "none" && c != "auto") {
            return refuse(
                field,
                "`none` or `auto` only: this endpoint decodes freely and cannot force a call (a model of the                  tool-call language writes one anyway; the agent API always answers an action)"
                    .into(),
            );
        }
    }
    let Some(tools) = req.tools.as_deref().filter(|t| !t.is_empty()) else { return Ok(false) };
    if !tool_call {
        return refuse("tools", format!("{own} in `content`, and calls no tools; leave `tools` out"));
    }
    let names: Vec<&str> = tools
        .iter()
        .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
        .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
        .collect();
    if !names.contains(&TOOL_NAME) {
        let given: String = format!("{names:?}").chars().take(200).collect();
        return refuse(
            "tools",
            format!("the model calls one function, `{TOOL_NAME}` (the tool-call action language), and the function tools given are {given}; add `{TOOL_NAME}`"),
        );
    }
    Ok(req.tool_choice.as_ref().is_none_or(|c| c != "none"))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The adapter a `model` names: `None` for the base model.
fn resolve_model(state: &AppState, info: &BackendInfo, model: &str) -> Result<Option<String>, HttpError> {
    if model == info.model || model == state.config.model {
        return Ok(None);
    }
    if info.adapters.iter().any(|a| a == model) {
        return Ok(Some(model.to_string()));
    }
    let shown: String = model.chars().take(100).collect();
    let mut have = vec![info.model.clone()];
    have.extend(info.adapters.iter().cloned());
    Err(HttpError::not_found(format!("the model `{shown}` does not exist; this server has: {}", have.join(", ")))
        .with_code("model_not_found"))
}

/// The messages, images decoded. With the tool-call language, an assistant's `tool_calls` are written
/// back as the model wrote them and `tool` messages are a user turn of `<tool_response>` blocks, as the
/// Qwen chat templates render them.
async fn convert_messages(
    state: &AppState,
    messages: Vec<InMessage>,
    language: ActionLanguage,
    lenient: bool,
) -> Result<Vec<ChatMessage>, HttpError> {
    if messages.is_empty() {
        return Err(HttpError::bad_request("messages: empty; send at least one user message"));
    }
    let tool_call = language == ActionLanguage::ToolCall;
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    let mut after_tool = false;
    for (i, m) in messages.into_iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => ChatRole::System,
            "user" => ChatRole::User,
            "assistant" => ChatRole::Assistant,
            "tool" if tool_call => ChatRole::User,
            other => {
                let shown: String = other.chars().take(40).collect();
                let roles = if tool_call { "system, user, assistant or tool" } else { "system, user or assistant" };
                return Err(HttpError::bad_request(format!(
                    "messages[{i}].role: `{shown}` is not supported; use {roles}"
                )));
            }
        };
        let mut parts = Vec::new();
        match m.content {
            Value::String(s) => parts.push(ChatPart::Text(s)),
            Value::Null if role == ChatRole::Assistant => {}
            Value::Array(items) => {
                for (j, item) in items.into_iter().enumerate() {
                    parts.push(convert_part(state, item, i, j, lenient).await?);
                }
            }
            _ => {
                return Err(HttpError::bad_request(format!(
                    "messages[{i}].content: expected a string or an array of text / image_url parts"
                )))
            }
        }
        if let Some(calls) = m.tool_calls.filter(|c| !c.is_empty() && role == ChatRole::Assistant) {
            let at = format!("messages[{i}].tool_calls");
            if !tool_call {
                let why =
                    format!("this model answers in its own action language ({}) and calls no tools", language.name());
                return Err(HttpError::bad_request(format!("{at}: {why}")));
            }
            let text = tool_calls::calls_text(&calls, &at).map_err(HttpError::bad_request)?;
            let sep = if parts.is_empty() { "" } else { "\n" };
            parts.push(ChatPart::Text(format!("{sep}{text}")));
        }
        if m.role == "tool" {
            let open = if after_tool { "\n<tool_response>\n" } else { "<tool_response>\n" };
            parts.insert(0, ChatPart::Text(open.into()));
            parts.push(ChatPart::Text("\n</tool_response>".into()));
            if let Some(prev) = out.last_mut().filter(|_| after_tool) {
                prev.parts.extend(parts);
                continue;
            }
        }
        after_tool = m.role == "tool";
        out.push(ChatMessage { role, parts });
    }
    if !out.iter().any(|m| m.role == ChatRole::User) {
        return Err(HttpError::bad_request("messages: no user message"));
    }
    Ok(out)
}

async fn convert_part(state: &AppState, item: Value, i: usize, j: usize, lenient: bool) -> Result<ChatPart, HttpError> {
    let at = format!("messages[{i}].content[{j}]");
    let bad = |what: &str| HttpError::bad_request(format!("{at}: {what}"));
    let url = match strict::from_value::<Part>(&item, &at, lenient)? {
        Part::Text { text } | Part::Refusal { refusal: text } => return Ok(ChatPart::Text(text)),
        Part::InputAudio { .. } | Part::File { .. } => {
            return Err(bad("audio and file parts are not supported; use text or image_url"))
        }
        Part::ImageUrl { image_url: Value::String(url) } => url,
        Part::ImageUrl { image_url } => {
            strict::from_value::<ImageUrl>(&image_url, &format!("{at}.image_url"), lenient)?.url
        }
    };
    let bytes = crate::images::data_url_bytes(&url, "image_url.url").map_err(|e| bad(&e.message))?;
    let image = decode_image(state, bytes, "image_url").await.map_err(|e| match e.status.is_client_error() {
        true => bad(&e.message),
        false => e,
    })?;
    Ok(ChatPart::Image(image))
}

fn finish_str(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn usage_json(out: &ChatOutput) -> Value {
    json!({
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    })
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    state: web::Data<AppState>,
    body: Strict<ChatRequest>,
) -> Result<HttpResponse, HttpError> {
    let req = body.into_inner();
    let info = state.engine.info()?;
    let adapter = resolve_model(&state, &info, &req.model)?;
    refuse_unsupported(&req, info.action_language)?;
    let tool_calls = wants_tool_calls(&req, info.action_language)?;
    let temperature = req.temperature.unwrap_or(0.0);
    if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
        return Err(HttpError::bad_request(format!("temperature: must be in 0..=2, got {temperature}")));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p.is_finite() && top_p > 0.0 && top_p <= 1.0) {
        return Err(HttpError::bad_request(format!("top_p: must be in (0, 1], got {top_p}")));
    }
    let (field, requested) = match (req.max_completion_tokens, req.max_tokens) {
        (Some(n), _) => ("max_completion_tokens", Some(n)),
        (None, n) => ("max_tokens", n),
    };
    let max_tokens = check_max_tokens(requested, state.config.max_tokens as usize, &info, field)?;
    let stop = match req.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOP || stop.iter().any(|s| s.is_empty()) {
        return Err(HttpError::bad_request(format!("stop: at most {MAX_STOP} non-empty strings")));
    }
    let messages = convert_messages(&state, req.messages, info.action_language, state.config.lenient_requests).await?;
    let job = ChatJob { messages, max_tokens, temperature, top_p, seed: req.seed.map(|s| s as u64), stop };
    let meta = Meta {
        id: format!("chatcmpl-{:024x}", rand::rng().random::<u128>() >> 32),
        created: unix_now(),
        model: req.model,
    };
    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.unwrap_or_default().include_usage;
        return stream(&state, job, adapter, meta, include_usage, tool_calls).await;
    }
    let out = match state.engine.call(JobKind::Chat(job), adapter).await? {
        JobOutput::Chat(out) => out,
        JobOutput::Step(_) => return Err(HttpError::internal("the backend answered a chat with a step")),
    };
    state.engine.metrics().tokens(out.prompt_tokens, out.completion_tokens);
    let mut message = json!({"role": "assistant", "content": out.text});
    let mut finish = finish_str(out.finish_reason);
    if tool_calls {
        let (content, calls) = tool_calls::split(&out.text);
        message["content"] = json!(content);
        if !calls.is_empty() {
            message["tool_calls"] = calls.iter().map(ToolCall::message_json).collect();
            finish = "tool_calls";
        }
    }
    Ok(HttpResponse::Ok().json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
        "usage": usage_json(&out),
    })))
}

/// What every chunk of one answer repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
}

impl Meta {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        })
    }
}

fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

type Reply = Result<Result<JobOutput, BackendError>, oneshot::error::RecvError>;

/// The state of one streamed answer; dropping it (the client left) cancels the job through `guard`.
struct Streaming {
    meta: Meta,
    pieces: mpsc::UnboundedReceiver<String>,
    pieces_open: bool,
    reply: oneshot::Receiver<Result<JobOutput, BackendError>>,
    outcome: Option<Reply>,
    guard: CancelGuard,
    include_usage: bool,
    /// With `tools`: holds a call's text back from the content, to send it as `tool_calls` at the end.
    calls: Option<CallStream>,
    state: web::Data<AppState>,
    /// Events ready to send before anything else (the role chunk, a first piece).
    queued: String,
    done: bool,
}

impl Streaming {
    /// The event of a text piece: a content chunk, or nothing while a tool call's text is held back.
    fn piece_event(&mut self, piece: &str) -> String {
        let content = match &mut self.calls {
            Some(calls) => calls.piece(piece),
            None => piece.to_string(),
        };
        match content.is_empty() {
            true => String::new(),
            false => sse(&self.meta.chunk(json!({"content": content}), None)),
        }
    }

    /// With `tools`: the content held back and the calls' chunks, and the finish reason.
    fn calls_events(&self, o: &ChatOutput) -> (String, &'static str) {
        let Some(calls) = &self.calls else { return (String::new(), finish_str(o.finish_reason)) };
        let (rest, calls) = calls.finish(&o.text);
        let mut out = String::new();
        if !rest.is_empty() {
            out += &sse(&self.meta.chunk(json!({"content": rest}), None));
        }
        for (i, call) in calls.iter().enumerate() {
            for delta in call.stream_deltas(i) {
                out += &sse(&self.meta.chunk(delta, None));
            }
        }
        (out, if calls.is_empty() { finish_str(o.finish_reason) } else { "tool_calls" })
    }

    /// The final events once the reply is in: pieces still buffered, the finish chunk, usage, `[DONE]`.
    fn finish(&mut self, outcome: Reply) -> String {
        let mut out = std::mem::take(&mut self.queued);
        while let Ok(p) = self.pieces.try_recv() {
            out += &self.piece_event(&p);
        }
        self.guard.disarm();
        self.done = true;
        let err = match outcome {
            Ok(Ok(JobOutput::Chat(o))) => {
                self.state.engine.metrics().tokens(o.prompt_tokens, o.completion_tokens);
                let (calls, finish) = self.calls_events(&o);
                out += &calls;
                out += &sse(&self.meta.chunk(json!({}), Some(finish)));
                if self.include_usage {
                    let mut usage = self.meta.chunk(json!({}), None);
                    usage["choices"] = json!([]);
                    usage["usage"] = usage_json(&o);
                    out += &sse(&usage);
                }
                out += "data: [DONE]\n\n";
                return out;
            }
            Ok(Ok(JobOutput::Step(_))) => HttpError::internal("the backend answered a chat with a step"),
            Ok(Err(e)) => HttpError::from(e),
            Err(_) => HttpError::from(CallError::NoReply),
        };
        tracing::warn!(error = %err, "a streamed chat completion failed after its first piece");
        out + &sse(&err.body())
    }

    async fn next_bytes(&mut self) -> Option<String> {
        if self.done {
            return None;
        }
        if let Some(outcome) = self.outcome.take() {
            return Some(self.finish(outcome));
        }
        if !self.queued.is_empty() {
            return Some(std::mem::take(&mut self.queued));
        }
        loop {
            tokio::select! {
                biased;
                p = self.pieces.recv(), if self.pieces_open => match p {
                    Some(p) => {
                        let event = self.piece_event(&p);
                        if !event.is_empty() {
                            return Some(event);
                        }
                    }
                    None => self.pieces_open = false,
                },
                r = &mut self.reply => return Some(self.finish(r)),
            }
        }
    }
}

/// A streamed answer: waits for the first piece or the outcome, then sends server-sent events.
async fn stream(
    state: &web::Data<AppState>,
    job: ChatJob,
    adapter: Option<String>,
    meta: Meta,
    include_usage: bool,
    tool_calls: bool,
) -> Result<HttpResponse, HttpError> {
    let pending = state.engine.enqueue(JobKind::Chat(job), adapter, true)?;
    let Some(pieces) = pending.stream else {
        return Err(HttpError::internal("no stream channel for a streamed job"));
    };
    let role = sse(&meta.chunk(json!({"role": "assistant", "content": ""}), None));
    let mut st = Streaming {
        meta,
        pieces,
        pieces_open: true,
        reply: pending.reply,
        outcome: None,
        guard: pending.guard,
        include_usage,
        calls: tool_calls.then(CallStream::default),
        state: state.clone(),
        queued: role,
        done: false,
    };
    // Before the 200: the first piece, or the whole outcome (an error becomes a proper status).
    loop {
        tokio::select! {
            biased;
            p = st.pieces.recv(), if st.pieces_open => match p {
                Some(p) => {
                    let event = st.piece_event(&p);
                    st.queued += &event;
                    break;
                }
                None => st.pieces_open = false,
            },
            r = &mut st.reply => {
                match r {
                    Ok(Err(e)) => {
                        st.guard.disarm();
                        return Err(e.into());
                    }
                    Err(_) => {
                        st.guard.disarm();
                        return Err(CallError::NoReply.into());
                    }
                    ok => st.outcome = Some(ok),
                }
                break;
            }
        }
    }
    let body = futures_util::stream::unfold(st, |mut st| async move {
        let bytes = st.next_bytes().await?;
        Some((Ok::<_, Infallible>(web::Bytes::from(bytes)), st))
    });
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header(("Cache-Control", "no-cache"))
        .streaming(body))
}

/// `GET /v1/models`: the base model and every adapter.
pub async fn models(state: web::Data<AppState>) -> Result<HttpResponse, HttpError> {
    let info = state.engine.info()?;
    let created = state.started;
    let mut data = vec![json!({"id": info.model, "object": "model", "created": created, "owned_by": "askgui"})];
    for a in &info.adapters {
        data.push(json!({"id": a, "object": "model", "created": created, "owned_by": "askgui", "parent": info.model}));
    }
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}
