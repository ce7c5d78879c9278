//! The contract between the HTTP layer and the thread that owns the model.
//!
//! Handlers parse and validate a request (JSON, base64, image format and size) into a [`Job`]; the engine
//! queues jobs and hands batches of them to one [`Backend`] on its own thread; the backend answers every
//! job on the job's reply channel (and streams text pieces when the job asks for it). Handlers never touch
//! tensors and backends never see HTTP, so the handlers are tested against a stub backend and the model
//! backend ([`crate::model_backend`]) without a server.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use askgui_data::agent_api::{AgentStepRequest, AgentStepResponse};
use askgui_data::ActionLanguage;
use thiserror::Error;
use tokio::sync::{mpsc, oneshot};

/// A decoded image, already checked against the server's pixel limit, with a hash of its encoded bytes
/// (so that the same screenshot sent twice is recognised).
pub use askgui_runtime::ImageInput;

/// `POST /v1/agent/step` (or a session step turned into one).
#[derive(Debug, Clone)]
pub struct StepJob {
    /// Checked with [`AgentStepRequest::check`]; its base64 screenshots have been decoded into `screenshots`.
    pub request: AgentStepRequest,
    /// The earlier screenshots the prompt shows, oldest first, then the current one; empty for a step
    /// without a screenshot.
    pub screenshots: Vec<ImageInput>,
}

impl StepJob {
    /// A job with the current screenshot only (or none).
    pub fn new(request: AgentStepRequest, screenshot: Option<ImageInput>) -> Self {
        Self { request, screenshots: screenshot.into_iter().collect() }
    }

    /// The current screenshot.
    pub fn screenshot(&self) -> Option<&ImageInput> {
        self.screenshots.last()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChatRole {
    System,
    User,
    Assistant,
}

#[derive(Debug, Clone)]
pub enum ChatPart {
    Text(String),
    Image(ImageInput),
}

#[derive(Debug, Clone)]
pub struct ChatMessage {
    pub role: ChatRole,
    pub parts: Vec<ChatPart>,
}

/// `POST /v1/chat/completions`, validated.
#[derive(Debug, Clone)]
pub struct ChatJob {
    pub messages: Vec<ChatMessage>,
    pub max_tokens: usize,
    /// 0 is greedy.
    pub temperature: f64,
    pub top_p: f64,
    pub seed: Option<u64>,
    /// Stop strings: generation ends before the first occurrence of any.
    pub stop: Vec<String>,
}

#[derive(Debug, Clone)]
pub enum JobKind {
    Step(StepJob),
    Chat(ChatJob),
}

/// One unit of work for the backend, with the channels its answer goes back on.
#[derive(Debug)]
pub struct Job {
    pub kind: JobKind,
    /// The LoRA adapter to answer with (a name the backend lists in [`BackendInfo::adapters`]); `None`
    /// is the base model.
    pub adapter: Option<String>,
    pub enqueued: Instant,
    /// Set when the client goes away: the backend stops generating for this job and answers
    /// [`BackendError::Cancelled`].
    pub cancelled: Arc<AtomicBool>,
    /// Text pieces, in order, as they are decoded (chat streaming); their concatenation is the final text.
    pub stream: Option<mpsc::UnboundedSender<String>>,
    pub reply: oneshot::Sender<Result<JobOutput, BackendError>>,
}

impl Job {
    /// A job (no streaming, not cancelled) and the receiver of its answer.
    pub fn new(kind: JobKind, adapter: Option<String>) -> (Self, oneshot::Receiver<Result<JobOutput, BackendError>>) {
        let (reply, rx) = oneshot::channel();
        let job = Self { kind, adapter, enqueued: Instant::now(), cancelled: Arc::default(), stream: None, reply };
        (job, rx)
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed) || self.reply.is_closed()
    }
}

/// Why a chat completion ended.
pub use askgui_runtime::FinishReason;

/// The answer to a [`ChatJob`].
#[derive(Debug, Clone)]
pub struct ChatOutput {
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

#[derive(Debug, Clone)]
pub enum JobOutput {
    Step(Box<AgentStepResponse>),
    Chat(ChatOutput),
}

/// Why a job was not answered. The HTTP layer maps each to a status: `BadInput`, `UnknownAdapter` and
/// `ContextOverflow` are the client's (4xx), `Cancelled` is never seen by a client that is still there,
/// `Internal` is a 500 for this request only.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum BackendError {
    #[error("{0}")]
    BadInput(String),
    #[error("unknown adapter `{name}`; this server has: {available}")]
    UnknownAdapter { name: String, available: String },
    #[error("the prompt is {tokens} tokens but the model's context is {limit}; shorten the history or the messages")]
    ContextOverflow { tokens: usize, limit: usize },
    #[error("the client went away")]
    Cancelled,
    /// No room for the job now (the KV cache is full); retrying later will do.
    #[error("{0}")]
    Busy(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<askgui_runtime::RuntimeError> for BackendError {
    fn from(e: askgui_runtime::RuntimeError) -> Self {
        use askgui_runtime::RuntimeError as R;
        match e {
            R::BadInput(m) => BackendError::BadInput(m),
            R::ContextOverflow { tokens, limit } => BackendError::ContextOverflow { tokens, limit },
            R::Cancelled => BackendError::Cancelled,
            e @ R::KvCacheFull { .. } => BackendError::Busy(e.to_string()),
            R::Internal(m) => BackendError::Internal(m),
        }
    }
}

/// What the backend serves, for `/v1/models`, `/health` and request validation.
#[derive(Debug, Clone)]
pub struct BackendInfo {
    /// The model's id (a directory name or hub id).
    pub model: String,
    /// Loaded LoRA adapters by name.
    pub adapters: Vec<String>,
    /// The longest prompt plus answer, in tokens.
    pub context_length: usize,
    /// The pause thresholds requests default to.
    pub pauses: PauseLevels,
    /// The earlier screenshots a step's prompt shows before the current one.
    pub history_images: usize,
    /// The action language the model writes (what the OpenAI endpoint's `tools` depend on).
    pub action_language: ActionLanguage,
}

/// The pause thresholds requests default to: `--pause-threshold`, else the calibrated level of the
/// askgui.json cards (the model folder's for the base model, each adapter's for requests that name it).
/// A request's own `options.pause_threshold` wins.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PauseLevels {
    pub base: Option<f64>,
    pub adapters: Vec<(String, f64)>,
}

impl PauseLevels {
    /// The default threshold of requests answered with `adapter` (None: the base model).
    pub fn of(&self, adapter: Option<&str>) -> Option<f64> {
        match adapter {
            None => self.base,
            Some(name) => self.adapters.iter().find(|(n, _)| n == name).map(|(_, t)| *t),
        }
    }

    /// Every level by the name a request uses (`model` for the base model), for `/health`.
    pub fn by_name(&self, model: &str) -> BTreeMap<String, f64> {
        let base = self.base.map(|t| (model.to_string(), t));
        base.into_iter().chain(self.adapters.iter().cloned()).collect()
    }
}

/// The engine's side of a running batch, for backends that batch continuously: jobs that arrived since
/// the batch started, and the batch-size metric.
pub trait Intake {
    /// Up to `max` queued jobs whose clients are still there, without waiting.
    fn take(&mut self, max: usize) -> Vec<Job>;
    /// Records one forward pass (or one batch) over `sequences` jobs.
    fn record_batch(&mut self, sequences: usize);
    /// Records one batched vision forward over `images` screenshots.
    fn record_vision_batch(&mut self, images: usize);
    /// Records the KV blocks in use after a forward, and the pool's capacity (0: unbounded).
    fn record_kv_blocks(&mut self, _in_use: usize, _capacity: usize) {}
    /// The most jobs a backend may run at once (`--max-batch`).
    fn max_batch(&self) -> usize;
}

/// An [`Intake`] with nothing more to give (a batch run on its own, as `predict` does).
pub struct NoIntake;

impl Intake for NoIntake {
    fn take(&mut self, _: usize) -> Vec<Job> {
        Vec::new()
    }
    fn record_batch(&mut self, _: usize) {}
    fn record_vision_batch(&mut self, _: usize) {}
    fn max_batch(&self) -> usize {
        usize::MAX
    }
}

/// The thing that owns the model. Runs on one thread of its own; `run` gets a batch of jobs that arrived
/// together and must send exactly one reply per job (a job whose client has gone may be dropped).
pub trait Backend: Send + 'static {
    fn info(&self) -> BackendInfo;
    fn run(&mut self, jobs: Vec<Job>);
    /// What the engine calls: `run` the batch, or (a continuously batching backend) also take jobs from
    /// `intake` while it runs. The default runs the batch as it is.
    fn run_continuous(&mut self, jobs: Vec<Job>, intake: &mut dyn Intake) {
        intake.record_batch(jobs.len());
        self.run(jobs);
    }
}
