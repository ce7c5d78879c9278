//! `askgui-serve predict`: one step for one screenshot, with no server: the same request checks, image
//! decoding and job as `POST /v1/agent/step`, handed straight to a backend. For checking a checkpoint or
//! an adapter from a shell before serving it.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use askgui_data::agent_api::{AgentStepRequest, AgentStepResponse, StepOptions};
use thiserror::Error;
use tokio::sync::oneshot;

use crate::backend::{Backend, BackendError, Job, JobKind, JobOutput, StepJob};
use crate::config::PredictArgs;

#[derive(Debug, Error)]
pub enum PredictError {
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{0}")]
    Input(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("the backend gave no answer")]
    NoReply,
}

/// Runs one step of `args.task` on `args.image` with `backend`.
pub fn predict(backend: &mut dyn Backend, args: &PredictArgs) -> Result<AgentStepResponse, PredictError> {
    let bytes = std::fs::read(&args.image)
        .map_err(|source| PredictError::Read { path: args.image.display().to_string(), source })?;
    let config = args.config();
    let screenshot = crate::images::decode(&bytes, config.max_image_pixels, "--image")
        .map_err(|e| PredictError::Input(e.message))?;
    let request = AgentStepRequest {
        adapter: args.adapter_name(),
        options: StepOptions {
            max_tokens: Some(args.max_tokens as usize),
            temperature: Some(0.0),
            ..Default::default()
        },
        ..AgentStepRequest::new(args.task.clone(), askgui_data::convert::base64_encode(&bytes))
    };
    request.check().map_err(|e| PredictError::Input(e.to_string()))?;
    let (reply, mut rx) = oneshot::channel();
    let job = Job {
        adapter: request.adapter.clone(),
        kind: JobKind::Step(StepJob::new(request, Some(screenshot))),
        enqueued: Instant::now(),
        cancelled: Arc::new(AtomicBool::new(false)),
        stream: None,
        reply,
    };
    backend.run(vec![job]);
    match rx.try_recv() {
        Ok(Ok(JobOutput::Step(resp))) => Ok(*resp),
        Ok(Ok(JobOutput::Chat(_))) => Err(PredictError::Input("the backend answered with a chat completion".into())),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(PredictError::NoReply),
    }
}
