//! Parsing a model's answer back into an [`Action`].
//!
//! Models wrap the action JSON in many ways: code fences, a leading "Thought: ..." paragraph, an
//! "Action:" label, trailing explanations. We take the first balanced JSON object (string-aware brace
//! matching) that has an `action` field, and keep the text before it as the thought. Everything that is
//! wrong gets an error naming the problem: no JSON object, an unknown action (with the known ones), a
//! missing or mistyped field (with the action it belongs to).

use thiserror::Error;

use crate::action::{Action, ACTION_NAMES};

#[derive(Debug, Error, PartialEq)]
pub enum ParseError {
    #[error("no JSON object with an `action` field in the answer: {snippet:?}")]
    NoAction { snippet: String },
    #[error("the action object is not valid JSON ({reason}): {snippet:?}")]
    BadJson { reason: String, snippet: String },
    #[error("unknown action `{name}` (known: {})", ACTION_NAMES.join(", "))]
    UnknownAction { name: String },
    #[error("`action` must be a string naming the action, got {got}")]
    BadTag { got: String },
    #[error("action `{action}`: {reason}")]
    Invalid { action: String, reason: String },
    /// An answer with no action of an action language in it.
    #[error("no {language} action in the answer (expected {expected}): {snippet:?}")]
    NoLanguageAction { language: &'static str, expected: &'static str, snippet: String },
    /// An action name the language does not have.
    #[error("unknown {language} action `{name}` (known: {known})")]
    UnknownLanguageAction { language: &'static str, name: String, known: String },
}

/// A parsed answer: the action and any free text the model wrote before it.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub action: Action,
    pub thought: Option<String>,
}

pub(crate) fn snippet(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// Byte ranges of the top-level balanced `{...}` objects in `s`, in order (braces in strings ignored).
pub fn json_object_spans(s: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut depth, mut start, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for (i, c) in s.char_indices() {
        if in_str {
            match c {
                _ if esc => esc = false,
                '\\' => esc = true,
                '"' => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' if depth > 0 => in_str = true,
            '{' => {
                if depth == 0 {
                    start = i;
                }
                depth += 1;
            }
            '}' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    out.push(start..i + 1);
                }
            }
            _ => {}
        }
    }
    out
}

/// Parses one action from a JSON value, checking the fields serde cannot.
pub fn action_from_value(v: serde_json::Value) -> Result<Action, ParseError> {
    let name = match v.get("action") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => return Err(ParseError::BadTag { got: other.to_string() }),
        None => return Err(ParseError::NoAction { snippet: snippet(&v.to_string()) }),
    };
    if !ACTION_NAMES.contains(&name.as_str()) {
        return Err(ParseError::UnknownAction { name });
    }
    let action: Action =
        serde_json::from_value(v).map_err(|e| ParseError::Invalid { action: name.clone(), reason: e.to_string() })?;
    action.check().map_err(|reason| ParseError::Invalid { action: name, reason })?;
    Ok(action)
}

/// Parses a model's answer (see the module docs for what is tolerated).
pub fn parse_answer(text: &str) -> Result<Parsed, ParseError> {
    let mut first_err = None;
    for r in json_object_spans(text) {
        let raw = &text[r.clone()];
        let v: serde_json::Value = match serde_json::from_str(raw) {
            Ok(v) => v,
            Err(e) => {
                first_err.get_or_insert(ParseError::BadJson { reason: e.to_string(), snippet: snippet(raw) });
                continue;
            }
        };
        if v.get("action").is_none() {
            continue;
        }
        let action = action_from_value(v)?;
        return Ok(Parsed { action, thought: thought(&text[..r.start]) });
    }
    Err(first_err.unwrap_or(ParseError::NoAction { snippet: snippet(text) }))
}

/// The prose before the action, without fences and labels; None when nothing is left.
fn thought(prefix: &str) -> Option<String> {
    let mut t = prefix.trim();
    for fence in ["```json", "```JSON", "```"] {
        if let Some(s) = t.strip_suffix(fence) {
            t = s.trim_end();
            break;
        }
    }
    for label in ["Action:", "action:", "ACTION:"] {
        if let Some(s) = t.strip_suffix(label) {
            t = s.trim_end();
        }
    }
    for label in ["Thought:", "thought:", "THOUGHT:"] {
        if let Some(s) = t.strip_prefix(label) {
            t = s.trim_start();
        }
    }
    (!t.is_empty()).then(|| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::{Ask, AskKind, AskOption, Direction, Target};

    #[test]
    fn tolerates_fences_thoughts_and_trailing_text() {
        let want = Action::Click(Target::point(540, 1210));
        for text in [
            r#"{"action":"click","x":540,"y":1210}"#,
            "  \n{\"action\": \"click\", \"x\": 540, \"y\": 1210}\n\n",
            "```json\n{\"action\": \"click\", \"x\": 540.2, \"y\": 1209.7}\n```",
            "Thought: the search box is at the top.\nAction: {\"action\":\"click\",\"x\":540,\"y\":1210} because it is.",
            "I see {braces} in prose. {\"note\": \"}\"} {\"action\":\"click\",\"y\":1210,\"x\":540}",
        ] {
            let p = parse_answer(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!(p.action, want, "{text:?}");
        }
        let p = parse_answer("Thought: top bar.\n```json\n{\"action\":\"click\",\"x\":1,\"y\":2}\n```").unwrap();
        assert_eq!(p.thought.as_deref(), Some("top bar."));
    }

    #[test]
    fn errors_say_what_is_wrong() {
        let e = parse_answer("I would click the button.").unwrap_err();
        assert!(matches!(e, ParseError::NoAction { .. }), "{e}");
        let e = parse_answer(r#"{"action":"tap","x":1,"y":2}"#).unwrap_err();
        assert_eq!(e, ParseError::UnknownAction { name: "tap".into() });
        assert!(e.to_string().contains("long_press"), "{e}");
        let e = parse_answer(r#"{"action":"type"}"#).unwrap_err();
        assert!(e.to_string().contains("`type`") && e.to_string().contains("text"), "{e}");
        let e = parse_answer(r#"{"action":"click","x":5}"#).unwrap_err();
        assert!(e.to_string().contains("no `y`"), "{e}");
        let e = parse_answer(r#"{"action":"scroll","direction":"sideways"}"#).unwrap_err();
        assert!(e.to_string().contains("scroll") && e.to_string().contains("sideways"), "{e}");
        let e = parse_answer(r#"{"action": 3}"#).unwrap_err();
        assert!(matches!(e, ParseError::BadTag { .. }), "{e}");
        let e = parse_answer(r#"{"action":"click","x":1,"y":2"#).unwrap_err();
        assert!(matches!(e, ParseError::NoAction { .. }), "{e}");
    }

    #[test]
    fn ask_and_scroll_forms() {
        let p = parse_answer(
            r#"{"action":"ask","question":"Which milk?","options":[{"label":"Oat"},{"label":"Soy","detail":"1 L"}],"kind":"selection"}"#,
        )
        .unwrap();
        assert_eq!(
            p.action,
            Action::Ask(Ask {
                question: "Which milk?".into(),
                options: vec![
                    AskOption { label: "Oat".into(), detail: None },
                    AskOption { label: "Soy".into(), detail: Some("1 L".into()) }
                ],
                kind: Some(AskKind::Selection),
            })
        );
        let p = parse_answer(r#"{"action":"scroll","direction":"down"}"#).unwrap();
        assert_eq!(p.action, Action::Scroll { x: None, y: None, direction: Direction::Down });
    }
}
