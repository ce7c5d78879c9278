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

/// How far two answers to one input may differ in `ask_probability` and still be the same answer: a
/// prompt prefilled in one piece or after a cached prefix runs other GEMM shapes, which moves f32 logits in
/// their last bits (5e-9 measured on the tiny test checkpoint, 1.1e-8 on the demo's agent).
pub const ASK_PROBABILITY_TOL: f64 = 1e-5;

impl Prediction {
    pub fn is_ask(&self) -> bool {
        self.action.as_ref().is_some_and(Action::is_ask)
    }

    /// The same action, text and parse error, and `ask_probability` within [`ASK_PROBABILITY_TOL`].
    pub fn same_answer(&self, other: &Prediction) -> bool {
        let p = match (self.ask_probability, other.ask_probability) {
            (Some(a), Some(b)) => (a - b).abs() <= ASK_PROBABILITY_TOL,
            (a, b) => a == b,
        };
        p && self.action == other.action && self.raw == other.raw && self.parse_error == other.parse_error
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
