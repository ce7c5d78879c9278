//! The engine: a bounded job queue in front of ONE thread that owns the [`Backend`].
//!
//! Handlers get a cheap cloneable [`Engine`] handle and [`Engine::submit`] jobs; a full queue fails at once
//! (the handler answers 429 instead of holding memory for a backlog). The backend thread builds the backend
//! itself from a factory (loading weights takes a while; until then [`Engine::state`] is
//! [`LoadState::Loading`] and submissions are refused), then loops: block for one job, take whatever else
//! is already queued up to `max_batch`, drop jobs whose client has gone, run the batch inside
//! `catch_unwind`. A panicking backend drops the batch's reply senders, so exactly those requests get a
//! 500, and the thread goes on serving. The thread ends when every handle is dropped (server shutdown).
//!
//! [`Engine::call`] is the handler's side: submit, then await the reply with a guard that flags the job
//! cancelled if the handler future is dropped (actix drops it when the client disconnects).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, RwLock};
use std::time::Instant;

use thiserror::Error;
use tokio::sync::{mpsc, oneshot, watch};

use crate::backend::{Backend, BackendError, BackendInfo, Intake, Job, JobKind, JobOutput};
use crate::drain::DrainRate;
use crate::metrics::Metrics;

/// Any error a backend factory may fail with (an `anyhow::Error` converts into it).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Builds the backend, on the backend thread.
pub type BackendFactory = Box<dyn FnOnce() -> Result<Box<dyn Backend>, BoxError> + Send + 'static>;

/// Where the backend is in its life.
#[derive(Debug, Clone)]
pub enum LoadState {
    Loading,
    Ready(BackendInfo),
    /// Loading failed (or panicked): the message says why. Inference is refused for good.
    Failed(String),
}

/// Why a job was not queued.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SubmitError {
    #[error("the model is still loading; retry shortly")]
    Loading,
    #[error("the model failed to load: {0}")]
    Failed(String),
    #[error("the server is busy ({queued} requests queued); retry in {retry_after} s")]
    QueueFull { queued: usize, retry_after: u32 },
    #[error("the server is shutting down")]
    Stopped,
}

/// Why [`Engine::call`] has no output.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CallError {
    #[error(transparent)]
    Submit(#[from] SubmitError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The backend had no room for the job (its KV cache is full); `retry_after` from the drain rate.
    #[error("{message}; retry in {retry_after} s")]
    Busy { message: String, retry_after: u32 },
    /// The backend dropped the job without answering (it panicked, or it broke the contract).
    #[error("the model failed on this request without an answer (see the server log)")]
    NoReply,
}

struct Shared {
    state: RwLock<LoadState>,
    /// Flips to true once loading has ended, ready or failed.
    settled: watch::Sender<bool>,
    depth: AtomicUsize,
    metrics: Arc<Metrics>,
    /// Answers per second of late, for `Retry-After`.
    drain: DrainRate,
}

/// A handle on the queue and the backend thread; clone it freely.
#[derive(Clone)]
pub struct Engine {
    tx: SyncSender<Job>,
    shared: Arc<Shared>,
    max_queue: usize,
}

/// Sets a job's cancelled flag when dropped, unless the job finished first.
pub struct CancelGuard {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl CancelGuard {
    pub fn new(flag: Arc<AtomicBool>) -> Self {
        Self { flag, armed: true }
    }

    /// The job is over: dropping the guard no longer cancels anything.
    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::Relaxed);
        }
    }
}

/// A job being answered: its reply channel, the guard that cancels it, and its text pieces if streamed.
pub struct Pending {
    pub reply: oneshot::Receiver<Result<JobOutput, BackendError>>,
    pub guard: CancelGuard,
    pub stream: Option<mpsc::UnboundedReceiver<String>>,
}

impl Engine {
    /// Starts the backend thread; `factory` runs on it.
    pub fn start(factory: BackendFactory, max_queue: usize, max_batch: usize, metrics: Arc<Metrics>) -> Self {
        let max_queue = max_queue.max(1);
        let (tx, rx) = sync_channel(max_queue);
        let shared = Arc::new(Shared {
            state: RwLock::new(LoadState::Loading),
            settled: watch::Sender::new(false),
            depth: AtomicUsize::new(0),
            metrics,
            drain: DrainRate::default(),
        });
        let thread_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("askgui-backend".into())
            .spawn(move || backend_thread(factory, rx, thread_shared, max_batch.max(1)));
        if let Err(e) = spawned {
            shared.set_state(LoadState::Failed(format!("cannot start the backend thread: {e}")));
        }
        Self { tx, shared, max_queue }
    }

    pub fn state(&self) -> LoadState {
        self.shared.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The state once loading has ended: `Ready` or `Failed`, never `Loading`.
    pub async fn settled(&self) -> LoadState {
        let mut rx = self.shared.settled.subscribe();
        // The sender lives in `shared`, which `self` holds: waiting cannot fail.
        let _ = rx.wait_for(|done| *done).await;
        self.state()
    }

    /// The backend's description, once it is ready.
    pub fn info(&self) -> Result<BackendInfo, SubmitError> {
        match self.state() {
            LoadState::Ready(info) => Ok(info),
            LoadState::Loading => Err(SubmitError::Loading),
            LoadState::Failed(e) => Err(SubmitError::Failed(e)),
        }
    }

    /// Jobs queued and not yet taken by the backend.
    pub fn queue_depth(&self) -> usize {
        self.shared.depth.load(Ordering::Relaxed)
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// Queues a job, or fails at once (not ready, queue full, stopped).
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.info()?;
        // Count before sending so the backend's decrement can never run first and wrap below zero.
        self.shared.depth.fetch_add(1, Ordering::Relaxed);
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.shared.depth.fetch_sub(1, Ordering::Relaxed);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::QueueFull {
                        queued: self.max_queue,
                        retry_after: self.shared.drain.retry_after(self.max_queue),
                    },
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Builds and queues a job; `stream` asks for the text pieces as they are decoded.
    pub fn enqueue(&self, kind: JobKind, adapter: Option<String>, stream: bool) -> Result<Pending, SubmitError> {
        let (reply_tx, reply) = oneshot::channel();
        let (stream_tx, stream_rx) = match stream {
            true => {
                let (t, r) = mpsc::unbounded_channel();
                (Some(t), Some(r))
            }
            false => (None, None),
        };
        let cancelled = Arc::new(AtomicBool::new(false));
        let job = Job {
            kind,
            adapter,
            enqueued: Instant::now(),
            cancelled: cancelled.clone(),
            stream: stream_tx,
            reply: reply_tx,
        };
        self.submit(job)?;
        Ok(Pending { reply, guard: CancelGuard::new(cancelled), stream: stream_rx })
    }

    /// Queues a job and waits for its answer. If the caller's future is dropped meanwhile (the client went
    /// away), the job is flagged cancelled so the backend can stop working on it.
    pub async fn call(&self, kind: JobKind, adapter: Option<String>) -> Result<JobOutput, CallError> {
        let mut pending = self.enqueue(kind, adapter, false)?;
        let out = pending.reply.await;
        pending.guard.disarm();
        self.shared.drain.record();
        match out {
            Ok(Ok(output)) => Ok(output),
            // Room comes back as jobs finish: one job's time at the recent rate.
            Ok(Err(BackendError::Busy(message))) => {
                Err(CallError::Busy { message, retry_after: self.shared.drain.retry_after(1) })
            }
            Ok(Err(e)) => Err(CallError::Backend(e)),
            Err(_) => Err(CallError::NoReply),
        }
    }
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a non-string panic".into(),
    }
}

/// The error and its causes, `outer: inner: ...`.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

/// The queue seen from a running batch ([`Intake`]): what is waiting, without blocking, minus the jobs
/// whose clients have gone.
struct Queue<'a> {
    rx: &'a Receiver<Job>,
    shared: &'a Shared,
    max_batch: usize,
}

impl Intake for Queue<'_> {
    fn take(&mut self, max: usize) -> Vec<Job> {
        let mut jobs = Vec::new();
        let mut cancelled = 0;
        while jobs.len() < max {
            let Ok(job) = self.rx.try_recv() else { break };
            self.shared.depth.fetch_sub(1, Ordering::Relaxed);
            if job.is_cancelled() {
                cancelled += 1;
            } else {
                self.shared.metrics.observe_queue_wait(job.enqueued.elapsed());
                jobs.push(job);
            }
        }
        self.shared.metrics.jobs_cancelled(cancelled);
        jobs
    }

    fn record_batch(&mut self, sequences: usize) {
        self.shared.metrics.observe_batch(sequences);
    }

    fn record_vision_batch(&mut self, images: usize) {
        self.shared.metrics.observe_vision_batch(images);
    }

    fn record_kv_blocks(&mut self, in_use: usize, capacity: usize) {
        self.shared.metrics.set_kv_blocks(in_use, capacity);
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }
}

impl Shared {
    fn set_state(&self, s: LoadState) {
        let settled = !matches!(s, LoadState::Loading);
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = s;
        self.settled.send_replace(settled);
    }
}

fn backend_thread(factory: BackendFactory, rx: Receiver<Job>, shared: Arc<Shared>, max_batch: usize) {
    let set_state = |s: LoadState| shared.set_state(s);
    let started = Instant::now();
    let mut backend = match catch_unwind(AssertUnwindSafe(factory)) {
        Ok(Ok(backend)) => backend,
        Ok(Err(e)) => {
            let msg = error_chain(e.as_ref());
            tracing::error!(error = %msg, "the backend failed to load");
            return set_state(LoadState::Failed(msg));
        }
        Err(p) => {
            let msg = format!("the backend panicked while loading: {}", panic_message(p.as_ref()));
            tracing::error!("{msg}");
            return set_state(LoadState::Failed(msg));
        }
    };
    let info = backend.info();
    tracing::info!(
        model = %info.model,
        adapters = ?info.adapters,
        context_length = info.context_length,
        seconds = started.elapsed().as_secs_f64(),
        "backend ready"
    );
    set_state(LoadState::Ready(info));

    // `recv` fails once every sender is gone: the server has stopped.
    while let Ok(first) = rx.recv() {
        shared.depth.fetch_sub(1, Ordering::Relaxed);
        let mut batch = if first.is_cancelled() {
            shared.metrics.jobs_cancelled(1);
            vec![]
        } else {
            shared.metrics.observe_queue_wait(first.enqueued.elapsed());
            vec![first]
        };
        batch.extend(Queue { rx: &rx, shared: &shared, max_batch }.take(max_batch - batch.len()));
        if batch.is_empty() {
            continue;
        }
        let size = batch.len();
        let span = tracing::debug_span!("batch", size);
        let _enter = span.enter();
        let mut intake = Queue { rx: &rx, shared: &shared, max_batch };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| backend.run_continuous(batch, &mut intake))) {
            shared.metrics.backend_panic();
            tracing::error!(size, panic = %panic_message(p.as_ref()), "the backend panicked; its batch gets 500");
        }
    }
    tracing::info!("backend thread stopped");
}
