//! Action languages: how a model writes the protocol's actions.
//!
//! The protocol's [`Action`] is one thing; the text a model writes for it is another. askgui's own JSON
//! is one language; an existing agent's own are others, so that a fine-tuned agent keeps the grammar it
//! knows and its own front end still parses it (ARCHITECTURE.md, "Action languages"). Each language is
//! written once, in its own file: its system prompt, the rendering of an action, the parsing back, and
//! its coordinate frame. Where a language cannot say an action of ours, rendering is an error naming the
//! action ([`Inexpressible`]), never a silent drop. Where it says two of ours the same way (a one-key
//! `hotkey` is a `press`), [`ActionLanguage::normal_form`] is what it reads back.

mod tool_call;
mod ui_tars;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::action::{Action, Target};
use crate::frame::FrameKind;
use crate::parse::{ParseError, Parsed};
use crate::prompt::SystemPrompt;

pub use tool_call::{TOOL_ACTIONS, TOOL_NAME, TOOL_SCROLL_PIXELS};
pub use ui_tars::{py_escape, py_unescape, UI_TARS_ACTIONS, UI_TARS_MAX_PIXELS, UI_TARS_MIN_PIXELS};

/// The language a model reads and writes actions in. Serde names are the flag's values.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default, clap::ValueEnum)]
pub enum ActionLanguage {
    /// askgui's JSON objects, `{"action":"click","x":540,"y":1210}`, in the prompt's frame.
    #[default]
    #[serde(rename = "askgui")]
    #[value(name = "askgui")]
    AskguiJson,
    /// UI-TARS-1.5: `Action: click(start_box='(x,y)')` in pixels of the smart-resized image; ASK as
    /// `call_user(content='question', ...)`.
    #[serde(rename = "ui-tars")]
    #[value(name = "ui-tars")]
    UiTars,
    /// Qwen3-VL agents (GUI-Owl-1.5, UI-Venus-1.5) and Fara-1.5: `<tool_call>{"name": "computer_use",
    /// "arguments": {...}}</tool_call>` in 0-1000; ASK as `ask_user_question`.
    #[serde(rename = "tool-call")]
    #[value(name = "tool-call")]
    ToolCall,
}

/// Every language, in flag order (for tests and help).
pub const LANGUAGES: [ActionLanguage; 3] =
    [ActionLanguage::AskguiJson, ActionLanguage::UiTars, ActionLanguage::ToolCall];

/// An action the language has no way to say.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("the {language} action language cannot express `{action}`: {reason}")]
pub struct Inexpressible {
    pub language: &'static str,
    /// The protocol's action name (`done`, `click`, ...).
    pub action: &'static str,
    /// Why, and what to do instead.
    pub reason: String,
}

impl ActionLanguage {
    /// The language's flag value (`askgui`, `ui-tars`, `tool-call`).
    pub fn name(self) -> &'static str {
        match self {
            ActionLanguage::AskguiJson => "askgui",
            ActionLanguage::UiTars => "ui-tars",
            ActionLanguage::ToolCall => "tool-call",
        }
    }

    /// The frame the language's agents point in: UI-TARS-1.5 in pixels of the smart-resized image,
    /// the tool-call agents in 0-1000; None for askgui's JSON, which follows `--frame`.
    pub fn native_frame(self) -> Option<FrameKind> {
        match self {
            ActionLanguage::AskguiJson => None,
            ActionLanguage::UiTars => Some(FrameKind::Resized),
            ActionLanguage::ToolCall => Some(FrameKind::Relative1000),
        }
    }

    /// The system message: the action space as the language writes it, when to ask, and the frame.
    /// `system` picks askgui's full or compact prompt; the other languages have one prompt each.
    pub fn system_prompt(self, system: SystemPrompt, frame: FrameKind) -> String {
        match self {
            ActionLanguage::AskguiJson => system.text(frame),
            ActionLanguage::UiTars => ui_tars::system_prompt(frame),
            ActionLanguage::ToolCall => tool_call::system_prompt(frame),
        }
    }

    /// The text a model of this language writes for `action` (coordinates already in the model frame).
    pub fn render(self, action: &Action) -> Result<String, Inexpressible> {
        match self {
            ActionLanguage::AskguiJson => Ok(action.render()),
            ActionLanguage::UiTars => ui_tars::render(action),
            ActionLanguage::ToolCall => tool_call::render(action),
        }
    }

    /// A model's answer in this language back to an action (in the model frame) and its thought.
    pub fn parse(self, text: &str) -> Result<Parsed, ParseError> {
        match self {
            ActionLanguage::AskguiJson => crate::parse::parse_answer(text),
            ActionLanguage::UiTars => ui_tars::parse(text),
            ActionLanguage::ToolCall => tool_call::parse(text),
        }
    }

    /// Whether the language can say `action` (the check of `askgui-data validate --action-language`).
    pub fn check(self, action: &Action) -> Result<(), Inexpressible> {
        self.render(action).map(drop)
    }

    /// The action as this language reads it back after writing it: the same action, except where the
    /// language says two of ours one way. Both non-JSON languages write a one-key `hotkey` as the key's
    /// press; UI-TARS has one `drag` for our `drag` and `swipe` (its mobile front end swipes with it).
    pub fn normal_form(self, action: &Action) -> Action {
        match (self, action) {
            (ActionLanguage::AskguiJson, _) => action.clone(),
            (_, Action::Hotkey { keys }) if keys.len() == 1 => Action::Press { key: keys[0].clone() },
            (ActionLanguage::UiTars, Action::Swipe(s)) => Action::Drag(*s),
            _ => action.clone(),
        }
    }
}

/// The point of a click-like target, or why a language that points in pixels only cannot say it.
fn point_only(language: &'static str, action: &Action, t: &Target) -> Result<(i32, i32), Inexpressible> {
    let refuse = |reason: String| Inexpressible { language, action: action.name(), reason };
    match (t.xy(), &t.element) {
        (Some(p), None) => Ok(p),
        (_, Some(id)) => Err(refuse(format!(
            "it names element `{id}` and this language points at pixels only: give x/y and leave out the element list (no --elements)"
        ))),
        (None, None) => Err(refuse("it has no point".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_flag_values_and_the_serde_names() {
        use clap::ValueEnum;
        for l in LANGUAGES {
            assert_eq!(l.to_possible_value().unwrap().get_name(), l.name());
            assert_eq!(serde_json::to_value(l).unwrap(), serde_json::Value::String(l.name().into()));
        }
        assert_eq!(ActionLanguage::default(), ActionLanguage::AskguiJson, "today's JSON stays the default");
    }

    #[test]
    fn the_json_language_is_todays_rendering_and_parser() {
        let a = Action::Click(Target::point(540, 1210));
        let l = ActionLanguage::AskguiJson;
        assert_eq!(l.render(&a).unwrap(), a.render());
        assert_eq!(l.parse(&a.render()).unwrap(), crate::parse::parse_answer(&a.render()).unwrap());
        assert_eq!(
            l.system_prompt(SystemPrompt::Full, FrameKind::Resized),
            crate::prompt::system_prompt(FrameKind::Resized)
        );
        assert_eq!(l.system_prompt(SystemPrompt::Compact, FrameKind::Resized), crate::prompt::COMPACT_SYSTEM_PROMPT);
    }
}
