//! The HTTP server: routes, the two middlewares (metrics outermost, then the API key), `/health`,
//! `/metrics`, the playground page (`ui.rs`, unless `--no-ui`), JSON 404/405 answers, and the ways to run
//! it: [`run`] for the binary (SIGTERM/SIGINT drain in-flight requests, then the backend thread ends with
//! the last engine handle; a model that fails to load ends it with the loader's message) and [`start`] for
//! tests and embedding (a background thread on a free port, stopped through the returned [`ServerHandle`];
//! a failed load stays visible on `/health`).
//!
//! HTTP/1 half-closed connections are not allowed: when a client closes the connection, actix drops
//! the request's handler future at once, whose guard flags the job cancelled (see `engine.rs`).

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use actix_web::body::{BoxBody, MessageBody};
use actix_web::dev::{Server, ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::middleware::{from_fn, Next};
use actix_web::{web, App, HttpResponse, HttpServer, ResponseError};
use serde_json::json;

use crate::config::Config;
use crate::engine::{BackendFactory, LoadState};
use crate::error::HttpError;
use crate::metrics::Gauges;
pub use crate::state::AppState;
use crate::{agent_routes, openai, ui};

/// Compares without an early exit on the first differing byte, so the time taken says nothing about how
/// much of a guessed key was right (a length mismatch is still told apart, as in most such compares).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Paths that stay open when an API key is set (probes, scrapers and the playground page carry no secrets).
fn is_open_path(path: &str) -> bool {
    matches!(path, "/health" | "/metrics") || ui::is_open_path(path)
}

async fn require_key(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<BoxBody>, actix_web::Error> {
    let key = req.app_data::<web::Data<AppState>>().and_then(|s| s.config.api_key.clone());
    if let Some(key) = key.filter(|_| !is_open_path(req.path())) {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
            let (scheme, token) = v.trim().split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
        let ok = given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()));
        if !ok {
            let msg = match given {
                None => "missing API key: send `Authorization: Bearer <key>`",
                Some(_) => "wrong API key",
            };
            let mut res = HttpError::new(StatusCode::UNAUTHORIZED, msg).with_code("invalid_api_key").error_response();
            res.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return Ok(req.into_response(res));
        }
    }
    Ok(next.call(req).await?.map_into_boxed_body())
}

async fn observe(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let start = Instant::now();
    let metrics = req.app_data::<web::Data<AppState>>().map(|s| s.engine.metrics().clone());
    // The pattern, never the path: ids must not become label values.
    let route = req.match_pattern().unwrap_or_else(|| "unmatched".into());
    let res = next.call(req).await;
    if let Some(m) = metrics {
        let status = match &res {
            Ok(r) => r.status(),
            Err(e) => e.as_response_error().status_code(),
        };
        m.observe_request(&route, status.as_u16(), start.elapsed());
    }
    res
}

async fn health(state: web::Data<AppState>) -> HttpResponse {
    match state.engine.state() {
        LoadState::Ready(info) => HttpResponse::Ok().json(json!({
            "status": "ok",
            "model": info.model,
            "adapters": info.adapters,
            "pause_thresholds": info.pauses.by_name(&info.model),
            "history_images": info.history_images,
            "queue_depth": state.engine.queue_depth(),
            "live_sessions": state.sessions.len(),
        })),
        LoadState::Loading => HttpResponse::ServiceUnavailable()
            .insert_header((header::RETRY_AFTER, 1))
            .json(json!({"status": "loading", "model": state.config.model})),
        LoadState::Failed(error) => HttpResponse::ServiceUnavailable()
            .json(json!({"status": "failed", "model": state.config.model, "error": error})),
    }
}

async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    let gauges = Gauges { queue_depth: state.engine.queue_depth(), live_sessions: state.sessions.len() };
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4; charset=utf-8")
        .body(state.engine.metrics().render(gauges))
}

async fn not_found(req: actix_web::HttpRequest) -> HttpResponse {
    let path: String = req.path().chars().take(200).collect();
    HttpError::not_found(format!(
        "no route {} {path}; see /v1/agent/step, /v1/sessions, /v1/chat/completions, /v1/models, /health, /metrics",
        req.method()
    ))
    .error_response()
}

/// A resource whose other methods get a JSON 405 with `Allow`.
fn resource(path: &str, allow: &'static str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move |req: actix_web::HttpRequest| async move {
        let mut res = HttpError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{} is not allowed on {}; use {allow}", req.method(), req.match_pattern().unwrap_or_default()),
        )
        .error_response();
        res.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
        res
    }))
}

/// The routes and middleware, on `state`.
pub fn configure(state: web::Data<AppState>) -> impl Fn(&mut web::ServiceConfig) + Clone {
    move |cfg: &mut web::ServiceConfig| {
        let limit = state.config.max_body_bytes;
        cfg.app_data(state.clone())
            .app_data(
                web::JsonConfig::default()
                    .limit(limit)
                    // curl -d sends form content type; the body is JSON whatever the header says.
                    .content_type_required(false)
                    .content_type(|_| true)
                    .error_handler(|err, _req| HttpError::from_json(&err).into()),
            )
            .app_data(web::PayloadConfig::new(limit))
            .service(resource("/health", "GET").route(web::get().to(health)))
            .service(resource("/metrics", "GET").route(web::get().to(metrics)))
            .service(resource(askgui_data::agent_api::STEP_PATH, "POST").route(web::post().to(agent_routes::step)))
            .service(resource("/v1/sessions", "POST").route(web::post().to(agent_routes::create_session)))
            .service(
                resource("/v1/sessions/{id}", "GET, DELETE")
                    .route(web::get().to(agent_routes::get_session))
                    .route(web::delete().to(agent_routes::delete_session)),
            )
            .service(resource("/v1/sessions/{id}/step", "POST").route(web::post().to(agent_routes::session_step)))
            .service(resource("/v1/sessions/{id}/say", "POST").route(web::post().to(agent_routes::session_say)))
            .service(resource("/v1/sessions/{id}/tasks", "POST").route(web::post().to(agent_routes::next_task)))
            .service(resource("/v1/chat/completions", "POST").route(web::post().to(openai::chat_completions)))
            .service(resource("/v1/models", "GET").route(web::get().to(openai::models)));
        if !state.config.no_ui {
            cfg.service(resource("/", "GET").route(web::get().to(ui::page)))
                .service(resource("/ui/screens/{n}", "GET").route(web::get().to(ui::screen)));
        }
    }
}

/// Sweeps expired sessions every so often even when nobody calls (ends when the state is gone).
fn spawn_sweeper(state: Weak<AppState>, every: Duration) {
    actix_web::rt::spawn(async move {
        loop {
            actix_web::rt::time::sleep(every).await;
            let Some(s) = state.upgrade() else { break };
            s.sessions.sweep();
        }
    });
}

/// The listening socket, or an error that says which address and what to do about it.
fn listen(host: &str, port: u16) -> io::Result<TcpListener> {
    TcpListener::bind((host, port)).map_err(|e| {
        let hint = match e.kind() {
            io::ErrorKind::AddrInUse => format!(
                "port {port} is in use (another askgui-serve?); pick another with --port, or --port 0 for a free one"
            ),
            io::ErrorKind::PermissionDenied => format!("port {port} needs privileges here; use a port above 1023"),
            _ => format!("check --host {host} and --port {port}"),
        };
        io::Error::new(e.kind(), format!("cannot listen on {host}:{port}: {e}; {hint}"))
    })
}

/// Binds and builds the server (inside an actix system); the backend starts loading at once.
fn bind(config: Config, factory: BackendFactory, signals: bool) -> io::Result<(Server, SocketAddr, Arc<AppState>)> {
    config.check().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    tracing::info!(config = %config.to_log_line(), "askgui-serve starting");
    let listener = listen(&config.host, config.port)?;
    let addr = listener.local_addr()?;
    let workers = config.workers;
    let state = web::Data::new(AppState::new(config, factory));
    let every = Duration::from_secs(state.config.session_ttl.clamp(1, 60));
    spawn_sweeper(Arc::downgrade(&state.clone().into_inner()), every);
    let routes = configure(state.clone());
    let mut server = HttpServer::new(move || {
        App::new()
            .configure(routes.clone())
            .default_service(web::to(not_found))
            .wrap(from_fn(require_key))
            .wrap(from_fn(observe))
    })
    // A client that closes its side is gone: stop its request, so the backend can drop the job
    // (half-closing clients, rare, would otherwise keep finished-for-nobody work alive).
    .h1_allow_half_closed(false)
    .listen(listener)?;
    if workers > 0 {
        server = server.workers(workers);
    }
    if !signals {
        server = server.disable_signals();
    }
    tracing::info!("listening on http://{addr}");
    Ok((server.run(), addr, state.into_inner()))
}

/// Serves until SIGINT/SIGTERM (then drains in-flight requests, up to 30 s). Call from an actix system,
/// e.g. `actix_web::rt::System::new().block_on(run(config, factory))`.
///
/// A model that fails to load stops the server with the loader's message as the error (a process
/// supervisor then sees the failure, as with TEI), unless `--stay-up-on-load-failure` keeps it up with
/// `/health` saying `failed` and every inference a 503.
pub async fn run(config: Config, factory: BackendFactory) -> io::Result<()> {
    let (stay_up, model) = (config.stay_up_on_load_failure, config.model.clone());
    let (server, _, state) = bind(config, factory, true)?;
    let handle = server.handle();
    let failed: Arc<Mutex<Option<String>>> = Arc::default();
    let slot = failed.clone();
    actix_web::rt::spawn(async move {
        let LoadState::Failed(why) = state.engine.settled().await else { return };
        if stay_up {
            tracing::warn!("staying up with a failed model (--stay-up-on-load-failure): every inference is a 503");
            return;
        }
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
        handle.stop(false).await;
    });
    server.await?;
    let why = failed.lock().unwrap_or_else(|p| p.into_inner()).take();
    match why {
        Some(why) => Err(io::Error::other(format!(
            "the model `{model}` failed to load: {why} (--stay-up-on-load-failure keeps the server up instead)"
        ))),
        None => Ok(()),
    }
}

/// A server running on a background thread.
pub struct ServerHandle {
    /// Where it listens (with `--port 0`, the port the OS picked).
    pub addr: SocketAddr,
    server: actix_web::dev::ServerHandle,
    thread: Option<std::thread::JoinHandle<io::Result<()>>>,
    state: Arc<AppState>,
}

impl ServerHandle {
    /// `http://ADDR{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The shared state (engine, sessions, metrics), for tests.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Stops accepting, lets in-flight requests finish, and waits for the server thread.
    pub fn stop(mut self) {
        drop(self.server.stop(true));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if self.thread.is_some() {
            drop(self.server.stop(false));
        }
    }
}

/// Starts the server on its own thread (signals left to the caller) and returns once it listens; the
/// backend may still be loading (poll `/health`). Tests use `--port 0` for a free port.
pub fn start(config: Config, factory: BackendFactory) -> io::Result<ServerHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new().name("askgui-http".into()).spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            match bind(config, factory, false) {
                Ok((server, addr, state)) => {
                    let _ = tx.send(Ok((addr, server.handle(), state)));
                    server.await
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    Ok(())
                }
            }
        })
    })?;
    let (addr, server, state) =
        rx.recv().map_err(|_| io::Error::other("the server thread ended before listening"))??;
    Ok(ServerHandle { addr, server, thread: Some(thread), state })
}
