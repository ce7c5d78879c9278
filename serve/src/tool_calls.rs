//! OpenAI tool calls out of the tool-call action language's text: each
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block of an answer becomes a `tool_calls`
//! entry (the arguments as the model wrote them, a JSON string), and the text around the blocks is the
//! message's `content`. Streamed, the text before the first block goes out as it comes; the calls go out
//! at the end, as OpenAI streams them (one `delta.tool_calls` chunk with the id, type and name, one with
//! the arguments), which is what the official Python client's `accumulate_delta` reassembles.
//!
//! Key choice: a block that is not a JSON call object (or not closed, as when the length ran out) stays
//! in the content as the model wrote it, as vLLM's `hermes` tool parser does; nothing is dropped.

use askgui_data::parse::json_object_spans;
use rand::Rng;
use serde_json::{json, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// One call, as OpenAI's `message.tool_calls[i]` carries it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments object as JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// The `message.tool_calls[i]` object.
    pub fn message_json(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }

    /// The two stream deltas of call `index`: the id, type and name (arguments empty), then the arguments.
    pub fn stream_deltas(&self, index: usize) -> [Value; 2] {
        [
            json!({"tool_calls": [{"index": index, "id": self.id, "type": "function",
                                   "function": {"name": self.name, "arguments": ""}}]}),
            json!({"tool_calls": [{"index": index, "function": {"arguments": self.arguments}}]}),
        ]
    }
}

/// An answer split into its content (None when only whitespace is left) and its calls.
pub fn split(text: &str) -> (Option<String>, Vec<ToolCall>) {
    let (mut content, mut calls, mut rest) = (String::new(), Vec::new(), text);
    while let Some(open) = rest.find(OPEN) {
        let inner = &rest[open + OPEN.len()..];
        let Some(close) = inner.find(CLOSE) else { break };
        let after = &inner[close + CLOSE.len()..];
        match call(&inner[..close]) {
            Some(c) => {
                content.push_str(rest[..open].trim_end());
                calls.push(c);
                rest = after.trim_start();
                if !content.is_empty() && !rest.is_empty() && !rest.starts_with(OPEN) {
                    content.push('\n');
                }
            }
            None => {
                content.push_str(&rest[..rest.len() - after.len()]);
                rest = after;
            }
        }
    }
    content.push_str(rest);
    ((!content.trim().is_empty()).then_some(content), calls)
}

/// A block's call: a JSON object with a `name` string and an `arguments` object (or a string holding
/// one, as some agents write it).
fn call(block: &str) -> Option<ToolCall> {
    let block = block.trim();
    let v: Value = serde_json::from_str(block).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments")? {
        Value::String(s) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object).map(|_| s.clone())?,
        a @ Value::Object(_) => as_written(block, a).unwrap_or_else(|| a.to_string()),
        _ => return None,
    };
    let id = format!("call_{:024x}", rand::rng().random::<u128>() >> 32);
    Some(ToolCall { id, name, arguments })
}

/// The arguments object's text as the model wrote it (its key order and spacing), when it can be found.
fn as_written(block: &str, args: &Value) -> Option<String> {
    let tail = &block[block.find("\"arguments\"")?..];
    let raw = &tail[json_object_spans(tail).into_iter().next()?];
    (serde_json::from_str::<Value>(raw).ok()? == *args).then(|| raw.to_string())
}

/// An assistant message's `tool_calls` (at `at`) as the model writes them: `<tool_call>` blocks, one a
/// line, the arguments as given (a JSON object's text), so that the model's own answer reads back unchanged.
pub fn calls_text(calls: &[Value], at: &str) -> Result<String, String> {
    let mut blocks = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let name = c.pointer("/function/name").and_then(Value::as_str);
        let name = name.ok_or_else(|| format!("{at}[{j}].function.name: missing; a call names its function"))?;
        let arguments = match c.pointer("/function/arguments") {
            Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok_and(|v| v.is_object()) => s.clone(),
            Some(a @ Value::Object(_)) => a.to_string(),
            _ => return Err(format!("{at}[{j}].function.arguments: expected a JSON object (as a string)")),
        };
        blocks.push(format!("{OPEN}\n{{\"name\": {}, \"arguments\": {arguments}}}\n{CLOSE}", json!(name)));
    }
    Ok(blocks.join("\n"))
}

/// The content of a streamed answer whose calls are sent at the end: what of each piece can go out now.
#[derive(Debug, Default)]
pub struct CallStream {
    text: String,
    sent: usize,
}

impl CallStream {
    /// The content to send after `piece`: the text before the first `<tool_call>`, holding back a tail
    /// that could begin one and the whitespace that would precede it.
    pub fn piece(&mut self, piece: &str) -> String {
        self.text.push_str(piece);
        let upto = match self.text.find(OPEN) {
            Some(i) => i,
            None => self.text.len() - partial_open(&self.text),
        };
        let safe = self.text[..upto].trim_end().len();
        if safe <= self.sent {
            return String::new();
        }
        let out = self.text[self.sent..safe].to_string();
        self.sent = safe;
        out
    }

    /// The final `text`'s content not sent yet, and its calls. What was sent is a prefix of the content:
    /// the text before the first block, less its trailing whitespace.
    pub fn finish(&self, text: &str) -> (String, Vec<ToolCall>) {
        let (content, calls) = split(text);
        let rest = content.as_deref().and_then(|c| c.get(self.sent..)).unwrap_or_default();
        (rest.to_string(), calls)
    }
}

/// The length of the longest tail of `text` that is a proper beginning of `<tool_call>`.
fn partial_open(text: &str) -> usize {
    (1..OPEN.len()).rev().find(|&k| text.ends_with(&OPEN[..k])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALL: &str = "<tool_call>\n{\"name\": \"computer_use\", \"arguments\": {\"action\": \"left_click\", \"coordinate\": [500, 250]}}\n</tool_call>";

    #[test]
    fn a_call_becomes_tool_calls_with_the_arguments_as_written() {
        let (content, calls) = split(CALL);
        assert_eq!(content, None);
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "computer_use");
        // The model's key order (action before coordinate) and Python's separators, not serde's sorted
        // compact form.
        assert_eq!(calls[0].arguments, "{\"action\": \"left_click\", \"coordinate\": [500, 250]}");
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 5 + 24, "{}", calls[0].id);
        let (content, calls) = split(&format!("I click OK.\n{CALL}\n"));
        assert_eq!((content.as_deref(), calls.len()), (Some("I click OK."), 1));
    }

    #[test]
    fn text_without_a_whole_call_is_the_content_unchanged() {
        for text in [
            "plain words",
            "<tool_call>\n{\"name\": \"computer_use\", \"arguments\": {\"action\": \"left_",
            "<tool_call>not json</tool_call>",
            "<tool_call>{\"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"computer_use\", \"arguments\": \"[1, 2]\"}</tool_call>",
        ] {
            assert_eq!(split(text), (Some(text.to_string()), vec![]), "{text}");
        }
        // Arguments written as a JSON string are handed over as that string.
        let (_, calls) = split("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>");
        assert_eq!(calls[0].arguments, "{\"a\": 1}");
    }

    #[test]
    fn a_call_handed_back_reads_as_the_model_wrote_it() {
        let (_, calls) = split(CALL);
        let back = calls_text(&[calls[0].message_json()], "messages[1].tool_calls").unwrap();
        assert_eq!(back, CALL);
        let e = calls_text(&[json!({"function": {"name": "f", "arguments": "[1]"}})], "m").unwrap_err();
        assert!(e.contains("m[0].function.arguments"), "{e}");
    }

    #[test]
    fn streamed_content_is_a_prefix_of_the_content_whatever_the_pieces() {
        let texts = [
            format!("Thought: the OK button.\n{CALL}"),
            format!("a <tool_ b\n{CALL} after"),
            "no call < here <tool".to_string(),
            "<tool_call>broken</tool_call> tail".to_string(),
        ];
        for text in &texts {
            let (content, calls) = split(text);
            // Every cut of the text into pieces of 1, 2 and 3 bytes (at char boundaries: ASCII here).
            for size in 1..=3 {
                let mut s = CallStream::default();
                let mut sent = String::new();
                for chunk in text.as_bytes().chunks(size) {
                    sent += &s.piece(std::str::from_utf8(chunk).unwrap());
                    assert!(calls.is_empty() || !sent.contains(OPEN), "a call's tag went out as content: {sent:?}");
                }
                let (rest, streamed_calls) = s.finish(text);
                assert_eq!(Some(sent + &rest).filter(|c| !c.is_empty()), content, "{text:?} in pieces of {size}");
                let names =
                    |c: &[ToolCall]| c.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect::<Vec<_>>();
                assert_eq!(names(&streamed_calls), names(&calls));
            }
        }
    }
}
