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

    /// The system message: the action space as the language writes it, when to ask, and the frame
    /// (`Full`); or one line naming the action space and the ASK (`Compact`, for small models trained
    /// from scratch).
    pub fn system_prompt(self, system: SystemPrompt, frame: FrameKind) -> String {
        match (self, system) {
            (ActionLanguage::AskguiJson, _) => system.text(frame),
            (ActionLanguage::UiTars, SystemPrompt::Full) => ui_tars::system_prompt(frame),
            (ActionLanguage::UiTars, SystemPrompt::Compact) => ui_tars::compact_system_prompt(),
            (ActionLanguage::ToolCall, SystemPrompt::Full) => tool_call::system_prompt(frame),
            (ActionLanguage::ToolCall, SystemPrompt::Compact) => tool_call::compact_system_prompt(),
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

    /// The text every answer starts with, up to its action name: the decoder forces it and scores the
    /// names after it ([`Self::action_names`]).
    pub fn answer_prefix(self) -> &'static str {
        match self {
            ActionLanguage::AskguiJson => "{\"action\":\"",
            ActionLanguage::UiTars => "Action: ",
            ActionLanguage::ToolCall => tool_call::ANSWER_PREFIX,
        }
    }

    /// The names the answer chooses among after [`Self::answer_prefix`], each followed by
    /// [`Self::name_end`] (so that no name is a prefix of another).
    pub fn action_names(self) -> &'static [&'static str] {
        match self {
            ActionLanguage::AskguiJson => &crate::action::ACTION_NAMES,
            ActionLanguage::UiTars => &UI_TARS_ACTIONS,
            ActionLanguage::ToolCall => &TOOL_ACTIONS,
        }
    }

    /// The text that closes an action name: `"` in the JSON languages, `(` in UI-TARS's calls.
    pub fn name_end(self) -> &'static str {
        match self {
            ActionLanguage::AskguiJson | ActionLanguage::ToolCall => "\"",
            ActionLanguage::UiTars => "(",
        }
    }

    /// The action name of ASK (whose probability is `ask_probability`).
    pub fn ask_name(self) -> &'static str {
        match self {
            ActionLanguage::AskguiJson => "ask",
            ActionLanguage::UiTars => "call_user",
            ActionLanguage::ToolCall => "ask_user_question",
        }
    }

    /// Whether `answer` (which starts with [`Self::answer_prefix`]) is a whole action: its JSON object,
    /// its call's parenthesis or its `</tool_call>` closed. Free decoding stops there.
    pub fn answer_closed(self, answer: &str) -> bool {
        match self {
            ActionLanguage::AskguiJson => crate::parse::json_object_spans(answer).first().is_some_and(|r| r.start == 0),
            ActionLanguage::UiTars => ui_tars::call_closed(answer),
            ActionLanguage::ToolCall => answer.contains("</tool_call>"),
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
    fn every_answer_is_the_prefix_a_name_and_closes_only_at_its_end() {
        use crate::action::{Ask, AskKind, AskOption, Direction, Segment};
        let actions = [
            Action::Click(Target::point(5, 7)),
            Action::Drag(Segment { x1: 1, y1: 2, x2: 3, y2: 4 }),
            Action::Scroll { x: Some(3), y: Some(4), direction: Direction::Left },
            Action::Type { text: "a) b' \\\"c\n".into() },
            Action::Hotkey { keys: vec!["ctrl".into(), "c".into()] },
            Action::Wait { seconds: 2.0 },
            Action::Answer { text: "done (really)".into() },
            Action::Ask(Ask {
                question: "Which (one)?".into(),
                options: vec![AskOption { label: "Oat's".into(), detail: None }],
                kind: Some(AskKind::Selection),
            }),
        ];
        for l in LANGUAGES {
            for a in &actions {
                let text = l.render(a).unwrap();
                let rest = text.strip_prefix(l.answer_prefix()).unwrap_or_else(|| panic!("{l:?}: {text}"));
                let named: Vec<_> =
                    l.action_names().iter().filter(|n| rest.starts_with(&format!("{n}{}", l.name_end()))).collect();
                assert_eq!(named.len(), 1, "{l:?}: {text}");
                assert!(l.answer_closed(&text), "{l:?}: {text}");
                // Every shorter text is still open: free decoding does not stop inside a string.
                let open = text.char_indices().map(|(i, _)| &text[..i]).find(|t| l.answer_closed(t));
                assert_eq!(open, None, "{l:?}: {text}");
            }
            let ask = actions.last().unwrap();
            let asked = l.render(ask).unwrap();
            assert!(asked[l.answer_prefix().len()..].starts_with(l.ask_name()), "{asked}");
        }
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
