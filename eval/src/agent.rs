//! The agent under evaluation, whatever runs it: the in-process model, askgui-serve, or any
//! OpenAI-compatible endpoint. The evaluator only ever sees this trait.
//!
//! Coordinates crossing this boundary are screen pixels of the episode's screenshots; a backend converts
//! to and from its model's frame itself (through `askgui_data::frame`).

use std::path::PathBuf;

use askgui_data::{Action, Element, Platform, Screen, Turn};
use thiserror::Error;

use crate::identity::AgentIdentity;

/// What the agent sees at one step.
#[derive(Debug, Clone)]
pub struct StepInput {
    pub episode_id: String,
    pub step: usize,
    /// The task as the agent is given it (the full or the ambiguous one).
    pub task: String,
    /// Earlier actions and ASK/SAY turns, in screen pixels. Trailing `ask`/`say` turns were asked at
    /// this very step.
    pub history: Vec<Turn>,
    /// Earlier screenshots (oldest first) followed by the current one.
    pub screenshots: Vec<PathBuf>,
    pub elements: Option<Vec<Element>>,
    pub screen: Screen,
    pub platform: Platform,
}

/// The agent's answer at one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    /// The parsed action in screen pixels; None when the reply did not parse (a wrong step, not an error).
    pub action: Option<Action>,
    /// The raw reply, kept for the results file.
    pub raw: String,
    /// Why the reply did not parse.
    pub parse_error: Option<String>,
    /// The model's probability of `ask` at this step (askgui's runtime reports it; other endpoints do
    /// not). `askgui-eval calibrate` chooses the pause level on it.
    pub ask_probability: Option<f64>,
}

impl Prediction {
    pub fn is_ask(&self) -> bool {
        self.action.as_ref().is_some_and(Action::is_ask)
    }
}

/// A failure to get any answer (the run stops or retries; an unparseable answer is not an error).
#[derive(Debug, Error)]
pub enum AgentError {
    #[error("endpoint {url}: {reason}")]
    Transport { url: String, reason: String },
    #[error("endpoint {url} answered {status}: {body}")]
    Rejected { url: String, status: u16, body: String },
    #[error("model: {0}")]
    Model(String),
    #[error("input: {0}")]
    Input(String),
}

pub trait Agent: Send + Sync {
    /// A short name for reports (model dir, endpoint URL and model name).
    fn name(&self) -> String;
    /// Everything that can change the answers; a results folder is continued only by an equal identity.
    /// An agent that only has a name is keyed on it.
    fn identity(&self) -> AgentIdentity {
        AgentIdentity::custom(self.name())
    }
    fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError>;
}
