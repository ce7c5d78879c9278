//! askgui-data: the agent protocol and the data tools.
//!
//! The protocol (one source of truth for train, serve and eval): [`action`] (the schema, with `ask` and
//! the user's `say` turn), [`parse`] (a model's answer back to an action), [`frame`] (screen pixels <->
//! the model's coordinate frame), [`language`] (the action languages a model writes: askgui's JSON,
//! UI-TARS-1.5's, the tool calls of Qwen3-VL agents and Fara-1.5), [`episode`] (the JSONL episode format), [`prompt`] (chat messages and
//! training samples with their loss spans), [`adapter_card`] (the prompt and image settings an adapter
//! was trained with, `askgui.json`). The tools: [`validate`], [`synth`] (a synthetic GUI world in
//! which asking is necessary), [`convert`] (ScreenAgent, AndroidControl, Multimodal-Mind2Web, GUI-Odyssey),
//! [`ambiguate`] (the Navi-plus ambiguity pipeline through any OpenAI-compatible endpoint), [`split`], [`stats`] and
//! [`render`] (HTML pages to look at the data).

pub mod action;
pub mod adapter_card;
pub mod agent_api;
pub mod ambiguate;
mod canvas;
pub mod convert;
pub mod episode;
pub mod frame;
pub mod language;
pub mod parse;
pub mod prompt;
pub mod render;
pub mod split;
pub mod stats;
pub mod synth;
pub mod validate;

pub use action::{Action, Ask, AskKind, AskOption, Direction, DoneStatus, Segment, Target, Turn};
pub use adapter_card::{AdapterArg, AdapterCard, PromptFlags};
pub use episode::{
    load_episodes, read_episodes, write_episodes, Element, Episode, LoadedEpisode, Platform, Screen, Step, StepAsk,
};
pub use frame::{FrameKind, FrameMap, ResizeBounds};
pub use language::{ActionLanguage, Inexpressible};
pub use parse::{parse_answer, ParseError, Parsed};
pub use prompt::{
    episode_samples, render_chatml, step_messages, ChatMessage, Part, PromptConfig, Sample, SampleKind, SystemPrompt,
    TaskMode,
};

/// `n` and the noun, plural unless `n` is 1 (`1 episode`, `3 episodes`): counts in messages and reports.
pub fn plural(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}
