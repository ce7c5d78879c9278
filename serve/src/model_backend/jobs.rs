//! A job's answer: the request turned into the runtime's step or completion, run through the job's
//! [`Client`], on the job's own thread.

use std::panic::{catch_unwind, AssertUnwindSafe};

use askgui_data::agent_api::AgentStepResponse;
use askgui_model::{Content, Message};
use askgui_runtime::{CompletionRequest, Runtime, Step};

use crate::backend::{
    BackendError, BackendInfo, ChatJob, ChatOutput, ChatPart, ChatRole, Job, JobKind, JobOutput, StepJob,
};
use crate::batcher::Client;

/// What the job threads share: the runtime and what the backend serves (its pause levels included).
pub(super) struct Jobs {
    pub(super) runtime: Runtime,
    pub(super) info: BackendInfo,
}

/// The runtime's step for an agent-API request: its screenshots (the earlier ones the prompt shows, then
/// the current one; or none, with `observation.screen` and an element list), its history and its elements.
pub fn runtime_step(job: &StepJob) -> Step<'_> {
    let obs = &job.request.observation;
    Step {
        task: &job.request.task,
        history: &job.request.history,
        screenshots: &job.screenshots,
        elements: obs.elements.as_deref(),
        screen: obs.screen.as_ref().map(|s| (s.width, s.height)),
    }
}

impl Jobs {
    fn check_adapter(&self, adapter: Option<&str>) -> Result<(), BackendError> {
        match adapter {
            Some(name) if !self.info.adapters.iter().any(|a| a == name) => Err(BackendError::UnknownAdapter {
                name: name.to_string(),
                available: match self.info.adapters.is_empty() {
                    true => "no adapters".into(),
                    false => self.info.adapters.join(", "),
                },
            }),
            _ => Ok(()),
        }
    }

    /// One agent step.
    pub(super) fn step(
        &self,
        client: &Client,
        job: &StepJob,
        adapter: Option<&str>,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<AgentStepResponse, BackendError> {
        let mut options = job.request.options.clone();
        options.pause_threshold = options.pause_threshold.or(self.info.pauses.of(adapter));
        let out = self.runtime.step(client, &runtime_step(job), &options, cancelled)?;
        Ok(out.into_response()?)
    }

    /// One chat completion, streaming text pieces to `stream`.
    pub(super) fn chat(
        &self,
        client: &Client,
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
                        images.push(img.clone());
                        content.push(Content::Image);
                    }
                }
            }
            messages.push(Message::new(role, content));
        }
        let (ids, images) = self.runtime.chat_prompt(&messages, &images)?;
        let req = CompletionRequest {
            ids,
            images,
            max_tokens: job.max_tokens,
            temperature: job.temperature,
            top_p: job.top_p,
            seed: job.seed.unwrap_or(0),
            stop: job.stop.clone(),
        };
        let mut send = |piece: &str| {
            if let Some(s) = stream {
                let _ = s.send(piece.to_string());
            }
        };
        let c = self.runtime.complete(client, &req, &mut send, cancelled)?;
        Ok(ChatOutput {
            text: c.text,
            finish_reason: c.finish,
            prompt_tokens: c.prompt_tokens,
            completion_tokens: c.completion_tokens,
        })
    }

    /// Answers one job (on its own thread), through `client` for the model's work.
    pub(super) fn answer(&self, client: &Client, job: Job) {
        if job.is_cancelled() {
            let _ = job.reply.send(Err(BackendError::Cancelled));
            return;
        }
        let queue_ms = job.enqueued.elapsed().as_secs_f64() * 1e3;
        let cancelled = || job.is_cancelled();
        let work = || {
            self.check_adapter(job.adapter.as_deref())?;
            match &job.kind {
                JobKind::Step(s) => self.step(client, s, job.adapter.as_deref(), &cancelled).map(|mut r| {
                    r.timings.queue_ms = queue_ms;
                    JobOutput::Step(Box::new(r))
                }),
                JobKind::Chat(c) => self.chat(client, c, job.stream.as_ref(), &cancelled).map(JobOutput::Chat),
            }
        };
        let result = catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|p| {
            let msg = crate::engine::panic_message(p.as_ref());
            tracing::error!(panic = %msg, "a job panicked; it gets 500");
            Err(BackendError::Internal(format!("the backend failed on this request: {msg}")))
        });
        if let Err(e) = &result {
            tracing::debug!(error = %e, "job failed");
        }
        let _ = job.reply.send(result);
    }
}
