//! The native agent API: stateless `POST /v1/agent/step`, and sessions (`/v1/sessions...`) in which the
//! server keeps the task and the ASK/SAY dialogue.
//!
//! A step request is checked in this order, cheapest first, so that a bad request costs little: JSON and
//! its fields (the [`Strict`] extractor: an unknown field is a 400), [`AgentStepRequest::check`], the
//! backend being ready, the adapter, the limits, then the screenshot (base64, header size, decode on the
//! blocking pool). Only then is a job queued.

use actix_web::http::header;
use actix_web::{web, HttpResponse};
use askgui_data::agent_api::{AgentStepRequest, AgentStepResponse, Observation, StepOptions};
use askgui_data::episode::Screen;
use serde::{Deserialize, Serialize};

use crate::backend::{BackendInfo, ImageInput, JobKind, JobOutput, StepJob};
use crate::error::HttpError;
use crate::sessions::SessionError;
use crate::state::AppState;
use crate::strict::Strict;

/// The longest side of a screen the server accepts (larger is a client bug, not a screen).
const MAX_SCREEN_SIDE: u32 = 1 << 16;

/// A 400 naming the adapters this server has, or `None` when `name` is one of them.
pub fn check_adapter(info: &BackendInfo, name: Option<&str>) -> Result<(), HttpError> {
    match name {
        Some(a) if !info.adapters.iter().any(|b| b == a) => {
            let available = match info.adapters.is_empty() {
                true => "none (leave `adapter` out for the base model)".to_string(),
                false => info.adapters.join(", "),
            };
            let shown: String = a.chars().take(100).collect();
            Err(HttpError::bad_request(format!("unknown adapter `{shown}`; this server has: {available}")))
        }
        _ => Ok(()),
    }
}

/// A token budget: the server default when absent (cut to the model's context), else the request's, which
/// must fit the context.
pub fn check_max_tokens(
    requested: Option<usize>,
    default: usize,
    info: &BackendInfo,
    field: &str,
) -> Result<usize, HttpError> {
    let Some(n) = requested else { return Ok(default.min(info.context_length).max(1)) };
    if n == 0 {
        return Err(HttpError::bad_request(format!("{field}: must be at least 1")));
    }
    if n > info.context_length {
        return Err(HttpError::bad_request(format!(
            "{field}: {n} is more than the model's context of {} tokens",
            info.context_length
        )));
    }
    Ok(n)
}

/// Decodes an image on actix's blocking pool (decoding a large PNG takes tens of milliseconds).
pub async fn decode_image(
    state: &AppState,
    bytes: Vec<u8>,
    what: &'static str,
) -> Result<crate::backend::ImageInput, HttpError> {
    let max = state.config.max_image_pixels;
    web::block(move || crate::images::decode(&bytes, max, what))
        .await
        .map_err(|_| HttpError::internal(format!("{what}: the image decoder failed")))?
}

/// Checks, decodes and runs one step. `kept` is a session's earlier screenshots; a stateless request's are
/// its own `observation.earlier_screenshots`, of which the last ones the prompt shows are decoded. Returns
/// the answer and the current screenshot, decoded (a session keeps it).
pub async fn run_step(
    state: &AppState,
    mut req: AgentStepRequest,
    kept: Option<Vec<ImageInput>>,
) -> Result<(AgentStepResponse, Option<ImageInput>), HttpError> {
    req.check()?;
    let info = state.engine.info()?;
    check_adapter(&info, req.adapter.as_deref())?;
    let max_tokens =
        check_max_tokens(req.options.max_tokens, state.config.max_tokens as usize, &info, "options.max_tokens")?;
    req.options.max_tokens = Some(max_tokens);
    if let Some(Screen { width, height }) = req.observation.screen {
        if width > MAX_SCREEN_SIDE || height > MAX_SCREEN_SIDE {
            return Err(HttpError::bad_request(format!(
                "observation.screen: {width}x{height} has a side above {MAX_SCREEN_SIDE} pixels"
            )));
        }
    }
    let screenshot = match req.observation.screenshot_bytes()? {
        Some(bytes) => Some(decode_image(state, bytes, "observation.screenshot").await?),
        None => None,
    };
    let mut screenshots = match kept {
        Some(kept) => kept,
        None => {
            let mut earlier = Vec::new();
            for bytes in req.observation.earlier_screenshot_bytes(info.history_images)? {
                earlier.push(decode_image(state, bytes, "observation.earlier_screenshots").await?);
            }
            earlier
        }
    };
    // Earlier screenshots go with a current one only (`check` refuses them alone in a request).
    match &screenshot {
        Some(current) => screenshots.push(current.clone()),
        None => screenshots.clear(),
    }
    // Decoded: the base64 text is not needed past this point.
    req.observation.earlier_screenshots.clear();
    let (adapter, coordinates) = (req.adapter.clone(), req.options.coordinates);
    match state.engine.call(JobKind::Step(StepJob { request: req, screenshots }), adapter).await? {
        JobOutput::Step(resp) => {
            let metrics = state.engine.metrics();
            metrics.tokens(resp.usage.prompt_tokens, resp.usage.completion_tokens);
            metrics.observe_step(resp.usage.cached_tokens, resp.usage.completion_tokens, resp.timings.decode_ms);
            Ok((resp.in_coordinates(coordinates), screenshot))
        }
        JobOutput::Chat(_) => Err(HttpError::internal("the backend answered a step with a chat completion")),
    }
}

/// `POST /v1/agent/step`.
pub async fn step(state: web::Data<AppState>, body: Strict<AgentStepRequest>) -> Result<HttpResponse, HttpError> {
    let (resp, _) = run_step(&state, body.into_inner(), None).await?;
    Ok(HttpResponse::Ok().json(resp))
}

impl From<SessionError> for HttpError {
    fn from(e: SessionError) -> Self {
        match e {
            SessionError::NotFound(_) => HttpError::not_found(e.to_string()),
            SessionError::Busy(_) | SessionError::NotWaiting(_) => HttpError::conflict(e.to_string()),
            SessionError::Full(_) => HttpError::too_many(e.to_string()),
        }
    }
}

/// `POST /v1/sessions` body.
#[derive(Serialize, Deserialize, Debug)]
pub struct CreateSession {
    pub task: String,
    #[serde(default)]
    pub adapter: Option<String>,
    #[serde(default)]
    pub options: StepOptions,
    /// What the user states for the whole session ("I am vegan"): kept in every step's context.
    #[serde(default)]
    pub remember: Vec<String>,
}

/// `POST /v1/sessions/{id}/tasks` body: the next task of the same user.
#[derive(Serialize, Deserialize, Debug)]
pub struct NextTask {
    pub task: String,
    /// More statements to keep, as at creation.
    #[serde(default)]
    pub remember: Vec<String>,
}

#[derive(Serialize, Debug)]
pub struct Created {
    pub id: String,
    pub expires_in: u64,
}

/// `POST /v1/sessions/{id}/step` body.
#[derive(Serialize, Deserialize, Debug)]
pub struct SessionStep {
    pub observation: Observation,
    /// Replaces the session's options for this step.
    #[serde(default)]
    pub options: Option<StepOptions>,
}

/// `POST /v1/sessions/{id}/say` body.
#[derive(Serialize, Deserialize, Debug)]
pub struct Say {
    pub text: String,
}

/// `POST /v1/sessions`.
pub async fn create_session(
    state: web::Data<AppState>,
    body: Strict<CreateSession>,
) -> Result<HttpResponse, HttpError> {
    let CreateSession { task, adapter, options, remember } = body.into_inner();
    check_remember(&remember)?;
    // The stateless request's checks, on a request with a stand-in observation.
    let probe = AgentStepRequest {
        task,
        observation: Observation {
            elements: Some(vec![]),
            screen: Some(Screen { width: 1, height: 1 }),
            ..Observation::default()
        },
        history: vec![],
        adapter,
        options,
    };
    probe.check()?;
    let info = state.engine.info()?;
    check_adapter(&info, probe.adapter.as_deref())?;
    check_max_tokens(probe.options.max_tokens, state.config.max_tokens as usize, &info, "options.max_tokens")?;
    let id = state.sessions.create(probe.task, probe.adapter, probe.options, remember)?;
    tracing::debug!(session = %id, "session created");
    Ok(HttpResponse::Created()
        .insert_header((header::LOCATION, format!("/v1/sessions/{id}")))
        .json(Created { id, expires_in: state.sessions.ttl().as_secs() }))
}

/// `POST /v1/sessions/{id}/step`: the next action given the session's task and history; the action is
/// appended to the history.
pub async fn session_step(
    state: web::Data<AppState>,
    id: web::Path<String>,
    body: Strict<SessionStep>,
) -> Result<HttpResponse, HttpError> {
    let SessionStep { observation, options } = body.into_inner();
    if !observation.earlier_screenshots.is_empty() {
        return Err(HttpError::bad_request(
            "observation.earlier_screenshots: a session keeps its earlier screenshots itself; send the current one",
        ));
    }
    // How many screenshots the session keeps: read before the step, so nothing can fail after it.
    let keep = state.engine.info()?.history_images;
    let (session, lease) = state.sessions.begin_step(&id)?;
    let req = AgentStepRequest {
        history: session.context(),
        task: session.task,
        observation,
        adapter: session.adapter,
        options: options.unwrap_or(session.options),
    };
    // On an error (or the client leaving) the lease is dropped: the session is freed, its history unchanged.
    let (resp, screenshot) = run_step(&state, req, Some(session.screenshots)).await?;
    let action = resp.screen_action.clone().unwrap_or_else(|| resp.action.clone());
    state.sessions.finish_step(lease, action, screenshot, keep);
    Ok(HttpResponse::Ok().json(resp))
}

/// `POST /v1/sessions/{id}/say`: the user's answer to the pending `ask`.
pub async fn session_say(
    state: web::Data<AppState>,
    id: web::Path<String>,
    body: Strict<Say>,
) -> Result<HttpResponse, HttpError> {
    let Say { text } = body.into_inner();
    if text.trim().is_empty() {
        return Err(HttpError::bad_request("text: empty (the user's answer to the agent's question)"));
    }
    Ok(HttpResponse::Ok().json(state.sessions.say(&id, text)?))
}

/// `POST /v1/sessions/{id}/tasks`: the next task in the same session; the finished task's questions and
/// answers (and `remember`) stay in the context of the steps to come.
pub async fn next_task(
    state: web::Data<AppState>,
    id: web::Path<String>,
    body: Strict<NextTask>,
) -> Result<HttpResponse, HttpError> {
    let NextTask { task, remember } = body.into_inner();
    if task.trim().is_empty() {
        return Err(HttpError::bad_request("task: empty (the user's next task)"));
    }
    check_remember(&remember)?;
    Ok(HttpResponse::Ok().json(state.sessions.next_task(&id, task, remember)?))
}

/// Statements to remember must say something.
fn check_remember(remember: &[String]) -> Result<(), HttpError> {
    match remember.iter().position(|r| r.trim().is_empty()) {
        Some(i) => Err(HttpError::bad_request(format!("remember[{i}]: empty; leave it out or say something"))),
        None => Ok(()),
    }
}

/// `GET /v1/sessions/{id}`.
pub async fn get_session(state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, HttpError> {
    Ok(HttpResponse::Ok().json(state.sessions.view(&id)?))
}

/// `DELETE /v1/sessions/{id}`.
pub async fn delete_session(state: web::Data<AppState>, id: web::Path<String>) -> Result<HttpResponse, HttpError> {
    state.sessions.delete(&id)?;
    Ok(HttpResponse::NoContent().finish())
}
