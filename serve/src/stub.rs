//! A deterministic stand-in for the model, a TEST DOUBLE: the server's tests run against it, and
//! `askgui-serve --stub` serves it so front ends can be developed without weights. Its answers mean
//! nothing; they only follow rules that a test can predict.
//!
//! Step jobs: `ask` ("Which one do you mean?") when the task contains `?` and the last turn is not the
//! user's `say`; otherwise a click at the centre of the screen. The frame is the screen itself
//! (`FrameKind::Screen`), usage counts words, timings are zeros but `queue_ms`.
//! Chat jobs: `echo: <text of the last user message>`, streamed word by word, cut at `max_tokens` words
//! (finish `length`) or before the first stop string (finish `stop`). A stub serving another action
//! language ([`StubBackend::with_language`]) adds a line with the step rule's action in that language
//! (the ask when the text has `?`, else a click at (500, 500)), streamed at spaces and line ends. A last
//! user text `STUB_ACT {protocol action as JSON}` answers that action in the language, and nothing else
//! (how a test has the endpoint return every action kind a language has).
//!
//! Markers in the task or the last user text steer it, for the tests of failure paths:
//! `STUB_PANIC` panics in `run`; `STUB_FAIL` answers `BackendError::Internal`; `STUB_OVERFLOW` answers
//! `BackendError::ContextOverflow`; `STUB_BLOCK` holds the backend thread until [`StubLog::release`];
//! `STUB_WAIT_CANCEL` waits (up to 30 s) until the job is cancelled and counts it in
//! [`StubLog::cancelled`]. Every batch size is recorded in [`StubLog::batches`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use askgui_data::agent_api::{AgentStepRequest, AgentStepResponse, FrameInfo, Timings, Usage};
use askgui_data::{Action, ActionLanguage, Ask, AskKind, FrameKind, FrameMap, ResizeBounds, Target, Turn};

use crate::backend::{
    Backend, BackendError, BackendInfo, ChatJob, ChatOutput, ChatPart, ChatRole, FinishReason, Job, JobKind, JobOutput,
    PauseLevels, StepJob,
};

/// What the stub saw, shared with the test that built it.
#[derive(Default)]
pub struct StubLog {
    batches: Mutex<Vec<usize>>,
    steps: Mutex<Vec<AgentStepRequest>>,
    cancelled: AtomicUsize,
    released: Mutex<bool>,
    release: Condvar,
    blocked: AtomicBool,
}

impl StubLog {
    /// The size of every batch `run` was given, in order.
    pub fn batches(&self) -> Vec<usize> {
        self.batches.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Every agent-step request the stub answered, in order (what a model would have been asked).
    pub fn step_requests(&self) -> Vec<AgentStepRequest> {
        self.steps.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Jobs that were cancelled while the stub waited on them.
    pub fn cancelled(&self) -> usize {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Whether a `STUB_BLOCK` job is holding the backend thread now.
    pub fn is_blocked(&self) -> bool {
        self.blocked.load(Ordering::SeqCst)
    }

    /// Lets every `STUB_BLOCK` job (now and later) go on.
    pub fn release(&self) {
        *self.released.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.release.notify_all();
    }

    fn wait_released(&self) {
        self.blocked.store(true, Ordering::SeqCst);
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        while !*released {
            released = self.release.wait(released).unwrap_or_else(|p| p.into_inner());
        }
        self.blocked.store(false, Ordering::SeqCst);
    }
}

/// The stub backend.
pub struct StubBackend {
    info: BackendInfo,
    log: Arc<StubLog>,
}

impl StubBackend {
    /// A stub named `model` that claims to have `adapters`.
    pub fn new(model: &str, adapters: &[&str]) -> Self {
        Self::with_log(model, adapters, Arc::default())
    }

    pub fn with_log(model: &str, adapters: &[&str], log: Arc<StubLog>) -> Self {
        let info = BackendInfo {
            model: model.to_string(),
            adapters: adapters.iter().map(|a| a.to_string()).collect(),
            context_length: 4096,
            pauses: PauseLevels::default(),
            history_images: 0,
            action_language: ActionLanguage::AskguiJson,
        };
        Self { info, log }
    }

    /// Answers chats in `language` too (askgui JSON, the default, only echoes).
    pub fn with_language(mut self, language: ActionLanguage) -> Self {
        self.info.action_language = language;
        self
    }

    /// Claims these pause levels (the stub itself never pauses by them).
    pub fn with_pause_levels(mut self, pauses: PauseLevels) -> Self {
        self.info.pauses = pauses;
        self
    }

    pub fn log(&self) -> Arc<StubLog> {
        self.log.clone()
    }
}

/// The step rule's action: the ask, or a click at (x, y).
impl StubBackend {
    /// A chat steered by `STUB_ACT`: the action in the served language, streamed at spaces and line ends.
    fn act(&self, job: &Job, c: &ChatJob, json: &str) -> Result<JobOutput, BackendError> {
        let action: Action =
            serde_json::from_str(json).map_err(|e| BackendError::BadInput(format!("STUB_ACT: not an action: {e}")))?;
        let said = self.info.action_language.render(&action).map_err(|e| BackendError::BadInput(e.to_string()))?;
        let pieces: Vec<String> = said.split_inclusive([' ', '\n']).map(String::from).collect();
        self.answer_chat(job, c, pieces)
    }
}

fn rule_action(ask: bool, x: i32, y: i32) -> Action {
    match ask {
        true => Action::Ask(Ask {
            question: "Which one do you mean?".into(),
            options: vec![],
            kind: Some(AskKind::Specification),
        }),
        false => Action::Click(Target::point(x, y)),
    }
}

fn words(s: &str) -> usize {
    s.split_whitespace().count()
}

impl StubBackend {
    /// Holds the thread for the steering markers; `Some` is the answer they force.
    fn steer(&self, job: &Job, text: &str) -> Option<Result<JobOutput, BackendError>> {
        if text.contains("STUB_PANIC") {
            panic!("the stub was told to panic");
        }
        if text.contains("STUB_FAIL") {
            return Some(Err(BackendError::Internal("the stub was told to fail".into())));
        }
        if text.contains("STUB_OVERFLOW") {
            return Some(Err(BackendError::ContextOverflow { tokens: 5000, limit: self.info.context_length }));
        }
        if text.contains("STUB_BLOCK") {
            self.log.wait_released();
        }
        if text.contains("STUB_WAIT_CANCEL") {
            let start = Instant::now();
            while !job.is_cancelled() && start.elapsed() < Duration::from_secs(30) {
                std::thread::sleep(Duration::from_millis(5));
            }
            if job.is_cancelled() {
                self.log.cancelled.fetch_add(1, Ordering::SeqCst);
                return Some(Err(BackendError::Cancelled));
            }
        }
        None
    }

    fn step(&self, job: &Job, s: &StepJob) -> Result<JobOutput, BackendError> {
        let req = &s.request;
        self.log.steps.lock().unwrap_or_else(|p| p.into_inner()).push(req.clone());
        let (w, h) = match (s.screenshot(), req.observation.screen) {
            (_, Some(screen)) => (screen.width, screen.height),
            (Some(img), None) => img.image.dimensions(),
            (None, None) => return Err(BackendError::BadInput("observation: no screen size".into())),
        };
        let frame = FrameMap::new(FrameKind::Screen, w, h, ResizeBounds::default())
            .map_err(|e| BackendError::BadInput(e.to_string()))?;
        // The last ask has its answer (a SAY without an ask before it is a remembered statement).
        let turns = &req.history;
        let last_ask = turns.iter().rposition(|t| matches!(t, Turn::Agent { action: Action::Ask(_) }));
        let answered = last_ask.is_some_and(|i| turns[i + 1..].iter().any(|t| matches!(t, Turn::Say { .. })));
        let action = rule_action(req.task.contains('?') && !answered, (w / 2) as i32, (h / 2) as i32);
        let model_action = frame.action_to_model(&action);
        let raw = model_action.render();
        let image_tokens = s.screenshots.len() * 4;
        let prompt_tokens = words(&req.task) + req.history.len() + image_tokens;
        Ok(JobOutput::Step(Box::new(AgentStepResponse {
            action,
            coordinates: None,
            screen_action: None,
            model_action,
            frame: FrameInfo::from(&frame),
            ask_probability: Some(if req.task.contains('?') && !answered { 0.9 } else { 0.1 }),
            usage: Usage { prompt_tokens, image_tokens, completion_tokens: words(&raw), cached_tokens: 0 },
            timings: Timings { queue_ms: job.enqueued.elapsed().as_secs_f64() * 1e3, ..Default::default() },
            raw,
        })))
    }

    fn chat(&self, job: &Job, c: &ChatJob) -> Result<JobOutput, BackendError> {
        let last_user = c.messages.iter().rev().find(|m| m.role == ChatRole::User);
        let text: String = last_user
            .map(|m| {
                m.parts
                    .iter()
                    .filter_map(|p| match p {
                        ChatPart::Text(t) => Some(t.as_str()),
                        ChatPart::Image(_) => None,
                    })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default();
        if let Some(json) = text.trim().strip_prefix("STUB_ACT ") {
            return self.act(job, c, json);
        }
        let full = format!("echo: {text}");
        let mut pieces: Vec<String> = Vec::new();
        for (i, w) in full.split_whitespace().enumerate() {
            pieces.push(if i == 0 { w.to_string() } else { format!(" {w}") });
        }
        let language = self.info.action_language;
        if language != ActionLanguage::AskguiJson {
            let said = language
                .render(&rule_action(text.contains('?'), 500, 500))
                .map_err(|e| BackendError::Internal(format!("the stub's action is not expressible: {e}")))?;
            pieces.push("\n".into());
            pieces.extend(said.split_inclusive([' ', '\n']).map(String::from));
        }
        self.answer_chat(job, c, pieces)
    }

    /// A chat answer of `pieces`: cut at `max_tokens` pieces or before the first stop string, streamed.
    fn answer_chat(&self, job: &Job, c: &ChatJob, mut pieces: Vec<String>) -> Result<JobOutput, BackendError> {
        let mut finish = FinishReason::Stop;
        if pieces.len() > c.max_tokens {
            pieces.truncate(c.max_tokens);
            finish = FinishReason::Length;
        }
        let mut answer: String = pieces.concat();
        if let Some(cut) = c.stop.iter().filter(|s| !s.is_empty()).filter_map(|s| answer.find(s.as_str())).min() {
            answer.truncate(cut);
            finish = FinishReason::Stop;
            // Re-split so that the streamed pieces still concatenate to the answer.
            let mut len = 0;
            pieces.retain_mut(|p| {
                let keep = len < cut;
                if keep && len + p.len() > cut {
                    p.truncate(cut - len);
                }
                len += p.len();
                keep
            });
        }
        if let Some(tx) = &job.stream {
            for p in &pieces {
                let _ = tx.send(p.clone());
            }
        }
        let prompt_tokens = c.messages.iter().flat_map(|m| &m.parts).map(|p| match p {
            ChatPart::Text(t) => words(t),
            ChatPart::Image(_) => 4,
        });
        Ok(JobOutput::Chat(ChatOutput {
            completion_tokens: pieces.len(),
            prompt_tokens: prompt_tokens.sum(),
            finish_reason: finish,
            text: answer,
        }))
    }
}

/// The text a job's markers are looked for in.
fn steering_text(kind: &JobKind) -> String {
    match kind {
        JobKind::Step(s) => s.request.task.clone(),
        JobKind::Chat(c) => c
            .messages
            .iter()
            .flat_map(|m| &m.parts)
            .filter_map(|p| match p {
                ChatPart::Text(t) => Some(t.as_str()),
                ChatPart::Image(_) => None,
            })
            .collect::<Vec<_>>()
            .join(" "),
    }
}

impl Backend for StubBackend {
    fn info(&self) -> BackendInfo {
        self.info.clone()
    }

    fn run(&mut self, jobs: Vec<Job>) {
        self.log.batches.lock().unwrap_or_else(|p| p.into_inner()).push(jobs.len());
        for job in jobs {
            if let Some(a) = &job.adapter {
                if !self.info.adapters.contains(a) {
                    let available = self.info.adapters.join(", ");
                    let _ = job.reply.send(Err(BackendError::UnknownAdapter { name: a.clone(), available }));
                    continue;
                }
            }
            let text = steering_text(&job.kind);
            let out = match self.steer(&job, &text) {
                Some(forced) => forced,
                None => match &job.kind {
                    JobKind::Step(s) => self.step(&job, s),
                    JobKind::Chat(c) => self.chat(&job, c),
                },
            };
            let _ = job.reply.send(out);
        }
    }
}
