//! The tool-call action language of Qwen3-VL agents (GUI-Owl-1.5, UI-Venus-1.5) and Fara-1.5:
//! `<tool_call>\n{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [x, y]}}\n</tool_call>`
//! in 0-1000 coordinates.
//!
//! Action and argument names are the agents' own: Qwen3-VL's cookbook tools (QwenLM/Qwen3-VL,
//! `cookbooks/utils/agent_function_call.py`: `computer_use` with `left_click`, `double_click`,
//! `right_click`, `scroll`/`hscroll` by `pixels` (positive up / right), `key` with `keys`, `type`,
//! `wait` with `time`, `answer`, `terminate` with `status`; `mobile_use` with `long_press`, `swipe` from
//! `coordinate` to `coordinate2`, `system_button` with `button`, `open` with `text`), and Fara-1.5's
//! `ask_user_question` with `question` (microsoft/fara, `fara15_agent.py`, which pauses the run for the
//! user). Our additions, ignored by those front ends: `options` and `kind` on `ask_user_question`, and
//! `start_coordinate` on `left_click_drag` (Anthropic's computer tool names it so; Qwen's drag starts at
//! the cursor). JSON is written as Python's `json.dumps` writes it (`", "`, `": "`), which the Qwen chat
//! templates use, with the arguments in a fixed order.

use serde::Serialize;
use serde_json::Value;

use crate::action::{Action, Ask, AskKind, AskOption, Direction, DoneStatus, Segment, Target};
use crate::frame::FrameKind;
use crate::parse::{json_object_spans, snippet, ParseError, Parsed};

use super::{point_only, Inexpressible};

const LANGUAGE: &str = "tool-call";
/// The one tool's name (Qwen3-VL's desktop tool and Fara's); `mobile_use` is read as well.
pub const TOOL_NAME: &str = "computer_use";
/// What every answer starts with, up to the action's name.
pub const ANSWER_PREFIX: &str = "<tool_call>\n{\"name\": \"computer_use\", \"arguments\": {\"action\": \"";
/// The `pixels` a scroll is written with (its sign is the direction; any amount reads back).
pub const TOOL_SCROLL_PIXELS: i32 = 500;
/// The `action` values this language writes and reads (the constrained decoder's action names).
pub const TOOL_ACTIONS: [&str; 16] = [
    "left_click",
    "double_click",
    "right_click",
    "long_press",
    "left_click_drag",
    "swipe",
    "scroll",
    "hscroll",
    "type",
    "key",
    "system_button",
    "open",
    "wait",
    "answer",
    "terminate",
    "ask_user_question",
];

/// The tool's parameters, as the Qwen function-calling prompt lists them (fixed text, fixed order).
const PARAMETERS: &str = r#"{"properties": {"action": {"description": "The action to perform. The available actions are:\n* `left_click`, `double_click`, `right_click`: Click at the (x, y) `coordinate`.\n* `long_press`: Press the point at `coordinate`.\n* `left_click_drag`: Drag from `start_coordinate` to `coordinate`.\n* `swipe`: Swipe from `coordinate` to `coordinate2`.\n* `scroll`: Scroll vertically by `pixels` (positive up, negative down), at `coordinate` if given.\n* `hscroll`: Scroll horizontally by `pixels` (positive right, negative left), at `coordinate` if given.\n* `type`: Type the string `text`.\n* `key`: Press the `keys` together.\n* `system_button`: Press the system `button`.\n* `open`: Open the app named `text`.\n* `wait`: Wait `time` seconds.\n* `answer`: Answer the user with `text`.\n* `terminate`: End the task with its `status`.\n* `ask_user_question`: Ask the user the `question` when the task leaves out a detail that only the user knows and the screen does not decide it; `options` to choose from and the `kind` of question are optional.", "enum": ["left_click", "double_click", "right_click", "long_press", "left_click_drag", "swipe", "scroll", "hscroll", "type", "key", "system_button", "open", "wait", "answer", "terminate", "ask_user_question"], "type": "string"}, "coordinate": {"description": "(x, y): the point to act at.", "type": "array"}, "start_coordinate": {"description": "(x, y): where `left_click_drag` starts.", "type": "array"}, "coordinate2": {"description": "(x, y): where `swipe` ends.", "type": "array"}, "text": {"description": "Required by `type`, `open` and `answer`.", "type": "string"}, "keys": {"description": "Required by `key`.", "type": "array"}, "pixels": {"description": "Required by `scroll` and `hscroll`.", "type": "number"}, "button": {"description": "Required by `system_button`.", "enum": ["Back", "Home", "Menu", "Enter"], "type": "string"}, "time": {"description": "The seconds to wait. Required by `wait`.", "type": "number"}, "status": {"description": "Required by `terminate`.", "enum": ["success", "failure"], "type": "string"}, "question": {"description": "Required by `ask_user_question`.", "type": "string"}, "options": {"description": "Options of `ask_user_question`: a list of {\"label\", \"detail\"} objects.", "type": "array"}, "kind": {"description": "Kind of `ask_user_question`.", "enum": ["selection", "specification"], "type": "string"}}, "required": ["action"], "type": "object"}"#;

/// The system message: the task, the frame and the tool, in Qwen's function-calling prompt layout.
pub fn system_prompt(frame: FrameKind) -> String {
    format!(
        "You are a GUI agent. You see a screenshot and a task, and you call the tool with the next action. \
When the task leaves out a detail that only the user knows and the screen does not decide it, ask instead of guessing; otherwise act. {}\n\n\
# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n\
{{\"type\": \"function\", \"function\": {{\"name\": \"{TOOL_NAME}\", \"description\": \"Use a mouse, keyboard or touchscreen to interact with the device, and take screenshots.\", \"parameters\": {PARAMETERS}}}}}\n\
</tools>\n\n\
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
        super::super::prompt::frame_sentence(frame)
    )
}

/// The compact system message: one line naming the tool, its actions and the ASK, as askgui JSON's compact
/// prompt does for JSON (the arguments are learned from the targets).
pub fn compact_system_prompt() -> String {
    format!(
        "GUI agent. Answer with the next action as a <tool_call> of {TOOL_NAME}, action one of {}; \
         ask_user_question when the task misses a detail.",
        TOOL_ACTIONS.join(", ")
    )
}

/// serde_json's compact output with Python `json.dumps`'s separators.
struct PySeparators;

impl serde_json::ser::Formatter for PySeparators {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.begin_array_value(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// One value as `json.dumps` writes it (UTF-8 kept, as the chat templates keep it).
fn py_json<T: Serialize + ?Sized>(v: &T) -> String {
    let mut out = Vec::new();
    v.serialize(&mut serde_json::Serializer::with_formatter(&mut out, PySeparators)).expect("values serialise");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// The tool call of `action` with `args` (values already JSON text), in that order.
fn call(action: &str, args: &[(&str, String)]) -> String {
    let mut body = format!("\"action\": {}", py_json(action));
    for (k, v) in args {
        body.push_str(&format!(", {}: {v}", py_json(*k)));
    }
    format!("<tool_call>\n{{\"name\": \"{TOOL_NAME}\", \"arguments\": {{{body}}}}}\n</tool_call>")
}

fn xy((x, y): (i32, i32)) -> String {
    py_json(&[x, y])
}

/// The action as a tool call, or why it has none.
pub fn render(a: &Action) -> Result<String, Inexpressible> {
    let at = |t: &Target| point_only(LANGUAGE, a, t).map(xy);
    Ok(match a {
        Action::Click(t) => call("left_click", &[("coordinate", at(t)?)]),
        Action::DoubleClick(t) => call("double_click", &[("coordinate", at(t)?)]),
        Action::RightClick(t) => call("right_click", &[("coordinate", at(t)?)]),
        Action::LongPress(t) => call("long_press", &[("coordinate", at(t)?)]),
        Action::Drag(s) => {
            call("left_click_drag", &[("start_coordinate", xy((s.x1, s.y1))), ("coordinate", xy((s.x2, s.y2)))])
        }
        Action::Swipe(s) => call("swipe", &[("coordinate", xy((s.x1, s.y1))), ("coordinate2", xy((s.x2, s.y2)))]),
        Action::Scroll { x, y, direction } => {
            let (name, pixels) = match direction {
                Direction::Up => ("scroll", TOOL_SCROLL_PIXELS),
                Direction::Down => ("scroll", -TOOL_SCROLL_PIXELS),
                Direction::Right => ("hscroll", TOOL_SCROLL_PIXELS),
                Direction::Left => ("hscroll", -TOOL_SCROLL_PIXELS),
            };
            let mut args = vec![("pixels", pixels.to_string())];
            if let Some(p) = x.zip(*y) {
                args.insert(0, ("coordinate", xy(p)));
            }
            call(name, &args)
        }
        Action::Type { text } => call("type", &[("text", py_json(text))]),
        Action::Press { key } if key == "back" => call("system_button", &[("button", py_json("Back"))]),
        Action::Press { key } if key == "home" => call("system_button", &[("button", py_json("Home"))]),
        Action::Press { key } => call("key", &[("keys", py_json(std::slice::from_ref(key)))]),
        Action::Hotkey { keys } => call("key", &[("keys", py_json(keys))]),
        Action::OpenApp { name } => call("open", &[("text", py_json(name))]),
        Action::Wait { seconds } => call("wait", &[("time", py_json(seconds))]),
        Action::Answer { text } => call("answer", &[("text", py_json(text))]),
        Action::Done { status } => {
            let s = if *status == DoneStatus::Success { "success" } else { "failure" };
            call("terminate", &[("status", py_json(s))])
        }
        Action::Ask(ask) => {
            let mut args = vec![("question", py_json(&ask.question))];
            if !ask.options.is_empty() {
                args.push(("options", py_json(&ask.options)));
            }
            if let Some(kind) = ask.kind {
                args.push(("kind", py_json(&kind)));
            }
            call("ask_user_question", &args)
        }
    })
}

/// A tool-call answer back to an action: the first JSON object after `<tool_call>`, a call of
/// `computer_use` (or `mobile_use`); the text before the tag is the thought.
pub fn parse(text: &str) -> Result<Parsed, ParseError> {
    let no_call = || ParseError::NoLanguageAction {
        language: LANGUAGE,
        expected: "<tool_call>{\"name\": \"computer_use\", \"arguments\": {...}}</tool_call>",
        snippet: snippet(text),
    };
    let open = text.find("<tool_call>").ok_or_else(no_call)?;
    let body = &text[open + "<tool_call>".len()..];
    let body = &body[..body.find("</tool_call>").unwrap_or(body.len())];
    let span = json_object_spans(body).into_iter().next().ok_or_else(no_call)?;
    let raw = &body[span];
    let v: Value =
        serde_json::from_str(raw).map_err(|e| ParseError::BadJson { reason: e.to_string(), snippet: snippet(raw) })?;
    let tool = v.get("name").and_then(Value::as_str).unwrap_or_default();
    if tool != TOOL_NAME && tool != "mobile_use" {
        return Err(ParseError::Invalid {
            action: tool.to_string(),
            reason: format!("the tool call names `{tool}`; this language calls `{TOOL_NAME}`"),
        });
    }
    let args = match v.get("arguments") {
        // Some servers hand the arguments over as a JSON string.
        Some(Value::String(s)) => {
            serde_json::from_str(s).map_err(|e| ParseError::BadJson { reason: e.to_string(), snippet: snippet(s) })?
        }
        Some(a @ Value::Object(_)) => a.clone(),
        _ => return Err(invalid(tool, "needs an `arguments` object".into())),
    };
    let name = match args.get("action") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(invalid(tool, "`arguments` needs an `action` string".into())),
    };
    let action = to_action(&name, &args)?;
    action.check().map_err(|reason| invalid(&name, reason))?;
    let thought = text[..open].trim();
    Ok(Parsed { action, thought: (!thought.is_empty()).then(|| thought.to_string()) })
}

fn invalid(action: &str, reason: String) -> ParseError {
    ParseError::Invalid { action: action.to_string(), reason }
}

/// The action a tool call's arguments stand for.
fn to_action(name: &str, args: &Value) -> Result<Action, ParseError> {
    let arg = |k: &str| args.get(k).filter(|v| !v.is_null());
    let need = |k: &str| arg(k).ok_or_else(|| invalid(name, format!("needs `{k}`")));
    let string =
        |k: &str| need(k)?.as_str().map(String::from).ok_or_else(|| invalid(name, format!("`{k}` must be a string")));
    let number = |k: &str| need(k)?.as_f64().ok_or_else(|| invalid(name, format!("`{k}` must be a number")));
    let point = |k: &str| read_point(name, k, need(k)?);
    let target = |k: &str| point(k).map(|(x, y)| Target::point(x, y));
    Ok(match name {
        "left_click" | "click" => Action::Click(target("coordinate")?),
        "double_click" => Action::DoubleClick(target("coordinate")?),
        "right_click" => Action::RightClick(target("coordinate")?),
        "long_press" => Action::LongPress(target("coordinate")?),
        "left_click_drag" => {
            let ((x1, y1), (x2, y2)) = (point("start_coordinate")?, point("coordinate")?);
            Action::Drag(Segment { x1, y1, x2, y2 })
        }
        "swipe" => {
            let ((x1, y1), (x2, y2)) = (point("coordinate")?, point("coordinate2")?);
            Action::Swipe(Segment { x1, y1, x2, y2 })
        }
        "scroll" | "hscroll" => {
            let p = arg("coordinate").map(|v| read_point(name, "coordinate", v)).transpose()?;
            let pixels = number("pixels")?;
            let direction = match (name, pixels > 0.0, pixels < 0.0) {
                ("scroll", true, _) => Direction::Up,
                ("scroll", _, true) => Direction::Down,
                (_, true, _) => Direction::Right,
                (_, _, true) => Direction::Left,
                _ => return Err(invalid(name, "`pixels` 0 scrolls nowhere".into())),
            };
            Action::Scroll { x: p.map(|p| p.0), y: p.map(|p| p.1), direction }
        }
        "type" => Action::Type { text: string("text")? },
        "key" => {
            let keys: Vec<String> = match arg("keys").or_else(|| arg("text")) {
                Some(Value::Array(a)) => a.iter().filter_map(|k| k.as_str().map(String::from)).collect(),
                Some(Value::String(s)) => vec![s.clone()],
                _ => return Err(invalid(name, "needs `keys`, a list of key names".into())),
            };
            match keys.as_slice() {
                [one] => Action::Press { key: one.clone() },
                _ => Action::Hotkey { keys },
            }
        }
        "system_button" => Action::Press { key: string("button")?.to_lowercase() },
        "open" => Action::OpenApp { name: string("text")? },
        "wait" => Action::Wait { seconds: number("time")? },
        "answer" => Action::Answer { text: string("text")? },
        "terminate" => match string("status")?.as_str() {
            "success" => Action::Done { status: DoneStatus::Success },
            "failure" => Action::Done { status: DoneStatus::Infeasible },
            other => return Err(invalid(name, format!("`status` {other:?} is not success or failure"))),
        },
        "ask_user_question" => {
            let options: Vec<AskOption> = match arg("options") {
                None => Vec::new(),
                Some(o) => serde_json::from_value(o.clone()).map_err(|e| {
                    invalid(name, format!("`options` is not a list of {{\"label\", \"detail\"}} objects ({e})"))
                })?,
            };
            let kind: Option<AskKind> = match arg("kind") {
                None => None,
                Some(k) => Some(
                    serde_json::from_value(k.clone())
                        .map_err(|_| invalid(name, format!("`kind` {k} is not \"selection\" or \"specification\"")))?,
                ),
            };
            Action::Ask(Ask { question: string("question")?, options, kind })
        }
        other => {
            return Err(ParseError::UnknownLanguageAction {
                language: LANGUAGE,
                name: other.to_string(),
                known: TOOL_ACTIONS.join(", "),
            })
        }
    })
}

/// `[x, y]` (numbers, rounded) to a point.
fn read_point(action: &str, key: &str, v: &Value) -> Result<(i32, i32), ParseError> {
    let coord =
        |c: &Value| c.as_f64().filter(|f| f.is_finite() && f.abs() <= i32::MAX as f64).map(|f| f.round() as i32);
    match v.as_array().map(Vec::as_slice) {
        Some([x, y]) => coord(x).zip(coord(y)),
        _ => None,
    }
    .ok_or_else(|| invalid(action, format!("`{key}` {v} is not an [x, y] pair of numbers")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_with_pythons_separators() {
        let a = Action::Click(Target::point(500, 250));
        assert_eq!(
            render(&a).unwrap(),
            "<tool_call>\n{\"name\": \"computer_use\", \"arguments\": {\"action\": \"left_click\", \"coordinate\": [500, 250]}}\n</tool_call>"
        );
        let ask = Action::Ask(Ask {
            question: "Which milk?".into(),
            options: vec![AskOption { label: "Oat".into(), detail: Some("1 L".into()) }],
            kind: Some(AskKind::Selection),
        });
        assert!(render(&ask).unwrap().contains(
            "{\"action\": \"ask_user_question\", \"question\": \"Which milk?\", \"options\": [{\"label\": \"Oat\", \"detail\": \"1 L\"}], \"kind\": \"selection\"}"
        ));
    }

    #[test]
    fn the_prompts_tool_is_json_and_lists_the_actions_the_parser_reads() {
        let prompt = system_prompt(FrameKind::Relative1000);
        let tool = prompt.split("<tools>\n").nth(1).and_then(|r| r.split("\n</tools>").next()).unwrap();
        let v: Value = serde_json::from_str(tool).unwrap_or_else(|e| panic!("{e}: {tool}"));
        assert_eq!(v["function"]["name"], TOOL_NAME);
        let listed: Vec<&str> = v["function"]["parameters"]["properties"]["action"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(listed, TOOL_ACTIONS);
        assert!(prompt.contains("0..1000"), "the frame is said");
    }

    #[test]
    fn the_compact_prompt_is_one_line_naming_the_tool_and_every_action() {
        let compact = compact_system_prompt();
        assert!(!compact.contains('\n'), "{compact}");
        assert!(compact.contains("<tool_call> of computer_use"), "the answer's form: {compact}");
        let listed: Vec<&str> =
            compact.split(" one of ").nth(1).unwrap().split(';').next().unwrap().split(", ").collect();
        assert_eq!(listed, TOOL_ACTIONS);
        assert!(compact.ends_with("ask_user_question when the task misses a detail."), "{compact}");
        assert!(compact.len() * 4 < system_prompt(FrameKind::Relative1000).len(), "a fraction of the full prompt");
    }

    #[test]
    fn errors_name_the_problem() {
        let e = parse("I would click.").unwrap_err();
        assert!(matches!(e, ParseError::NoLanguageAction { .. }), "{e}");
        let e = parse("<tool_call>\n{\"name\": \"computer_use\", \"arguments\": {\"action\": \"tap\"}}\n</tool_call>")
            .unwrap_err();
        assert!(e.to_string().contains("`tap`") && e.to_string().contains("ask_user_question"), "{e}");
        let e = parse("<tool_call>{\"name\": \"computer_use\", \"arguments\": {\"action\": \"left_click\", \"coordinate\": [1]}}</tool_call>")
            .unwrap_err();
        assert!(e.to_string().contains("coordinate"), "{e}");
        let e = parse("<tool_call>{\"name\": \"browser\", \"arguments\": {\"action\": \"left_click\"}}</tool_call>")
            .unwrap_err();
        assert!(e.to_string().contains("browser"), "{e}");
        let e = parse("<tool_call>{\"name\": \"computer_use\", \"arguments\": {\"action\": \"scroll\", \"pixels\": 0}}</tool_call>")
            .unwrap_err();
        assert!(e.to_string().contains("pixels"), "{e}");
    }
}
