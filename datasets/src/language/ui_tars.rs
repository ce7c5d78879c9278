//! The UI-TARS-1.5 action language: `Action: click(start_box='(x,y)')`, points in pixels of the 28-px
//! smart-resized image, the computer and mobile action spaces of UI-TARS-1.5's prompts (bytedance/UI-TARS
//! README, `COMPUTER_USE` and `MOBILE_USE`).
//!
//! ASK is `call_user(content='question', options='[{"label":"Oat"}]', kind='selection')`: UI-TARS's own
//! hand-over to the user, carrying the question in `content` (the argument `finished` shows the user),
//! the options as askgui's option JSON in a string, and the kind. A bare `call_user()` takes its question
//! from the thought, where UI-TARS-1.5 writes it. Strings are Python literals, as UI-TARS-1.5's prompt
//! asks, and we read its `\'`, `\"` and `\n`. The official parser, `@ui-tars/action-parser` 1.2.3, hands
//! a string's body over with its escapes, so `py_unescape` of its `action_inputs` is our text. Its regexes
//! trip on some texts: its argument splitter knows quotes but no escapes (a `\'` ends the string for it,
//! and an ASK whose question has an apostrophe loses its options), and `Action:`, `point=`, `<|box_`,
//! `<point>` inside a string or whitespace at a string's ends are syntax to it. So [`py_escape`] writes an
//! apostrophe as `\x27` and those characters as `\x` escapes, and the official parser reads every text we
//! write as we do (tests/ui_tars_official_parser.rs). UI-TARS-desktop types `content` as it comes, escapes
//! and all, as it does UI-TARS-1.5's own `\'`; only a final `\n` (Enter) is understood.

use crate::action::{Action, Ask, AskKind, AskOption, Direction, DoneStatus, Segment};
use crate::frame::FrameKind;
use crate::parse::{snippet, ParseError, Parsed};

use super::{point_only, Inexpressible};

const LANGUAGE: &str = "ui-tars";
/// UI-TARS-1.5's image bounds (`@ui-tars/shared`: `MIN_PIXELS` 100x28x28, `MAX_PIXELS_V1_5` 16384x28x28):
/// its front end maps points back with these, so an adapter served to it is trained with them.
pub const UI_TARS_MIN_PIXELS: usize = 100 * 28 * 28;
pub const UI_TARS_MAX_PIXELS: usize = 16384 * 28 * 28;
/// The functions this language writes and reads (the constrained decoder's action names).
pub const UI_TARS_ACTIONS: [&str; 14] = [
    "click",
    "left_double",
    "right_single",
    "long_press",
    "drag",
    "scroll",
    "type",
    "hotkey",
    "press_home",
    "press_back",
    "open_app",
    "wait",
    "finished",
    "call_user",
];
/// Whether `text` holds a call whose parenthesis is closed, outside Python strings (`\\` escapes).
pub(super) fn call_closed(text: &str) -> bool {
    let (mut depth, mut quote, mut escaped) = (0usize, None::<char>, false);
    for c in text.chars() {
        match (quote, c) {
            (Some(_), _) if escaped => escaped = false,
            (Some(_), '\\') => escaped = true,
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '(') => depth += 1,
            (None, ')') if depth == 1 => return true,
            (None, ')') => depth = depth.saturating_sub(1),
            (None, _) => {}
        }
    }
    false
}

/// `wait()` sleeps this long in UI-TARS's front ends; other waits carry `time`.
const WAIT_SECONDS: f64 = 5.0;

/// The system message: UI-TARS-1.5's no-thought prompt with both action spaces and our `call_user`.
pub fn system_prompt(frame: FrameKind) -> String {
    format!(
        "You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.\n\n\
## Output Format\n```\nAction: ...\n```\n\n\
## Action Space\n\
click(start_box='(x1,y1)')\n\
left_double(start_box='(x1,y1)')\n\
right_single(start_box='(x1,y1)')\n\
long_press(start_box='(x1,y1)')\n\
drag(start_box='(x1,y1)', end_box='(x3,y3)')\n\
scroll(start_box='(x1,y1)', direction='down or up or right or left')\n\
type(content='xxx') # Write content as a Python string: \\x27 for a quote, \\\\ for a backslash, \\n for a new line. If you want to submit your input, use \\n at the end of content.\n\
hotkey(key='ctrl c') # Split keys with a space.\n\
press_home()\n\
press_back()\n\
open_app(app_name='')\n\
wait() #Sleep for 5s and take a screenshot to check for any changes.\n\
finished(content='xxx') # Submit the task; content is the answer when the task asks for one.\n\
call_user(content='question', options='[{{\"label\":\"option\"}}]', kind='selection or specification') # Ask the user when the task leaves out a detail that only the user knows and the screen does not decide it; options and kind are optional.\n\n\
## Note\n- {}",
        super::super::prompt::frame_sentence(frame)
    )
}

/// The compact system message: one line naming the functions and the ASK, as askgui JSON's compact prompt
/// does for JSON (the arguments are learned from the targets).
pub fn compact_system_prompt() -> String {
    format!(
        "GUI agent. Answer with the next action as `Action: f(...)`, f one of {}; call_user when the task misses a detail.",
        UI_TARS_ACTIONS.join(", ")
    )
}

/// `name(key='value', ...)` with each value a Python string literal.
fn call(name: &str, args: &[(&str, String)]) -> String {
    let args: Vec<String> = args.iter().map(|(k, v)| format!("{k}='{}'", py_escape(v))).collect();
    format!("{name}({})", args.join(", "))
}

fn point((x, y): (i32, i32)) -> String {
    format!("({x},{y})")
}

/// The action in UI-TARS-1.5's words (`Action: ...`), or why it has none.
pub fn render(a: &Action) -> Result<String, Inexpressible> {
    let refuse = |reason: &str| Inexpressible { language: LANGUAGE, action: a.name(), reason: reason.into() };
    let at = |t| point_only(LANGUAGE, a, t).map(point);
    let body = match a {
        Action::Click(t) => call("click", &[("start_box", at(t)?)]),
        Action::DoubleClick(t) => call("left_double", &[("start_box", at(t)?)]),
        Action::RightClick(t) => call("right_single", &[("start_box", at(t)?)]),
        Action::LongPress(t) => call("long_press", &[("start_box", at(t)?)]),
        Action::Swipe(s) | Action::Drag(s) => {
            call("drag", &[("start_box", point((s.x1, s.y1))), ("end_box", point((s.x2, s.y2)))])
        }
        Action::Scroll { x, y, direction } => {
            let dir = ("direction", direction_name(*direction).to_string());
            match x.zip(*y) {
                Some(p) => call("scroll", &[("start_box", point(p)), dir]),
                None => call("scroll", &[dir]),
            }
        }
        Action::Type { text } => call("type", &[("content", text.clone())]),
        Action::Press { key } if key == "home" => call("press_home", &[]),
        Action::Press { key } if key == "back" => call("press_back", &[]),
        Action::Press { key } => call("hotkey", &[("key", hotkey(a, std::slice::from_ref(key))?)]),
        Action::Hotkey { keys } => call("hotkey", &[("key", hotkey(a, keys)?)]),
        Action::OpenApp { name } => call("open_app", &[("app_name", name.clone())]),
        Action::Wait { seconds } if *seconds == WAIT_SECONDS => call("wait", &[]),
        Action::Wait { seconds } => call("wait", &[("time", seconds.to_string())]),
        Action::Ask(ask) => {
            let mut args = vec![("content", ask.question.clone())];
            if !ask.options.is_empty() {
                args.push(("options", serde_json::to_string(&ask.options).expect("options serialise")));
            }
            if let Some(kind) = ask.kind {
                args.push(("kind", kind_name(kind).into()));
            }
            call("call_user", &args)
        }
        Action::Answer { text } => call("finished", &[("content", text.clone())]),
        Action::Done { status: DoneStatus::Success } => call("finished", &[]),
        Action::Done { status: DoneStatus::Infeasible } => {
            return Err(refuse(
                "UI-TARS's finished() ends a task whether it succeeded or not: mark the episode's last step `done` with status success, or answer the user with `answer`",
            ))
        }
    };
    Ok(format!("Action: {body}"))
}

/// The keys of a hotkey joined by spaces, as UI-TARS writes them; a key with a space in it cannot be.
fn hotkey(a: &Action, keys: &[String]) -> Result<String, Inexpressible> {
    match keys.iter().find(|k| k.is_empty() || k.chars().any(char::is_whitespace)) {
        Some(k) => Err(Inexpressible {
            language: LANGUAGE,
            action: a.name(),
            reason: format!(
                "key {k:?} is empty or has a space, and UI-TARS's hotkey(key=...) separates keys by spaces"
            ),
        }),
        None => Ok(keys.join(" ")),
    }
}

fn direction_name(d: Direction) -> &'static str {
    match d {
        Direction::Up => "up",
        Direction::Down => "down",
        Direction::Left => "left",
        Direction::Right => "right",
    }
}

fn kind_name(k: AskKind) -> &'static str {
    match k {
        AskKind::Selection => "selection",
        AskKind::Specification => "specification",
    }
}

/// The body of a single-quoted Python literal holding `s`: the backslash and control characters escaped
/// (a newline as `\n`), and what `@ui-tars/action-parser`'s regexes would read as syntax written with
/// `\x` escapes: the apostrophe (`\x27`), the colon of `Action:` / `Thought:`, the `=` of `point=`, the
/// `<` of `<|box_`, `<point>`, `<bbox>`, and whitespace at either end (it trims values).
pub fn py_escape(s: &str) -> String {
    let chars: Vec<char> = s.chars().collect();
    let mut out = String::with_capacity(s.len() + 2);
    for (i, &c) in chars.iter().enumerate() {
        let rest: String = chars[i + 1..].iter().take(6).collect();
        let at_end = i == 0 || i + 1 == chars.len();
        let syntax = match c {
            ':' | '\u{ff1a}' => out.ends_with("Action") || out.ends_with("Thought"),
            '=' => out.ends_with("point"),
            '<' => ["|box_", "point>", "/point", "bbox>", "/bbox>"].iter().any(|p| rest.starts_with(p)),
            _ => false,
        };
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\x27"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            _ if syntax || c.is_control() || matches!(c, '\u{2028}' | '\u{2029}' | '\u{feff}') => hex(&mut out, c),
            _ if at_end && c.is_whitespace() => hex(&mut out, c),
            _ => out.push(c),
        }
    }
    out
}

fn hex(out: &mut String, c: char) {
    match c as u32 {
        v @ 0..=0xff => out.push_str(&format!("\\x{v:02x}")),
        v @ 0x100..=0xffff => out.push_str(&format!("\\u{v:04x}")),
        v => out.push_str(&format!("\\U{v:08x}")),
    }
}

/// The text of a Python string literal's body: `\\ \' \" \n \r \t \xHH \uHHHH \UHHHHHHHH` and a
/// backslash-newline; any other backslash stays as written (Python's rule).
pub fn py_unescape(s: &str) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        let Some(e) = it.next() else { return Err("the string ends in a lone backslash".into()) };
        let digits = match e {
            '\\' | '\'' | '"' => {
                out.push(e);
                continue;
            }
            'n' => {
                out.push('\n');
                continue;
            }
            'r' => {
                out.push('\r');
                continue;
            }
            't' => {
                out.push('\t');
                continue;
            }
            '\n' => continue,
            'x' => 2,
            'u' => 4,
            'U' => 8,
            other => {
                out.push('\\');
                out.push(other);
                continue;
            }
        };
        let h: String = it.by_ref().take(digits).collect();
        let v = u32::from_str_radix(&h, 16).ok().filter(|_| h.len() == digits);
        match v.and_then(char::from_u32) {
            Some(ch) => out.push(ch),
            None => return Err(format!("bad escape \\{e}{h}")),
        }
    }
    Ok(out)
}

/// A UI-TARS answer back to an action. Like `@ui-tars/action-parser`: the thought is what follows
/// `Thought:` up to `Action:`, the action what follows the last `Action:` (or the whole answer);
/// `<|box_start|>` tokens, `point=`, `(x,y)`, `[x1,y1,x2,y2]` (its centre), `<point>x y</point>` and
/// `<bbox>` are read. Several actions (blank-line separated) are an error: askgui takes one a step.
pub fn parse(text: &str) -> Result<Parsed, ParseError> {
    let text = text.trim();
    let label = |s: &str| s.find("Action:").or_else(|| s.find("Action\u{ff1a}"));
    let thought = text.find("Thought:").map(|i| {
        let rest = &text[i + "Thought:".len()..];
        rest[..label(rest).unwrap_or(rest.len())].trim().to_string()
    });
    let labels = ["Action:", "Action\u{ff1a}"].map(|l| text.rfind(l).map(|i| i + l.len()));
    let action = match labels.into_iter().flatten().max() {
        Some(end) => &text[end..],
        None => text,
    };
    let chunks: Vec<&str> = action.split("\n\n").map(str::trim).filter(|c| !c.is_empty()).collect();
    let chunk = match chunks.as_slice() {
        [one] => *one,
        [] => return Err(no_action(text)),
        many => {
            return Err(ParseError::Invalid {
                action: "Action".into(),
                reason: format!("the answer has {} actions; askgui takes one action a step", many.len()),
            })
        }
    };
    let (name, args) = parse_call(chunk).ok_or_else(|| no_action(text))?;
    let action = to_action(&name, &args, thought.as_deref().filter(|t| !t.is_empty()))?;
    action.check().map_err(|reason| ParseError::Invalid { action: name, reason })?;
    Ok(Parsed { action, thought: thought.filter(|t| !t.is_empty()) })
}

fn no_action(text: &str) -> ParseError {
    ParseError::NoLanguageAction {
        language: LANGUAGE,
        expected: "Action: name(key='value', ...)",
        snippet: snippet(text),
    }
}

/// `name(key='value', key=value, ...)`: the function's name and its arguments (strings unescaped).
fn parse_call(s: &str) -> Option<(String, Vec<(String, String)>)> {
    let s = s.replace("<|box_start|>", "").replace("<|box_end|>", "");
    let s = s.trim();
    let open = s.find('(')?;
    let name = s[..open].trim();
    if name.is_empty() || !name.chars().all(|c| c.is_alphanumeric() || c == '_') || !s.ends_with(')') {
        return None;
    }
    let mut it = s[open + 1..s.len() - 1].chars().peekable();
    let mut args = Vec::new();
    loop {
        while it.next_if(|c| c.is_whitespace() || *c == ',').is_some() {}
        if it.peek().is_none() {
            return Some((name.to_string(), args));
        }
        let key: String = std::iter::from_fn(|| it.next_if(|c| c.is_alphanumeric() || *c == '_')).collect();
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        if key.is_empty() || it.next() != Some('=') {
            return None;
        }
        while it.next_if(|c| c.is_whitespace()).is_some() {}
        let value = match it.next_if(|c| *c == '\'' || *c == '"') {
            Some(q) => {
                let mut raw = String::new();
                loop {
                    match it.next()? {
                        '\\' => raw.extend(['\\', it.next()?]),
                        c if c == q => break,
                        c => raw.push(c),
                    }
                }
                py_unescape(&raw).ok()?
            }
            None => std::iter::from_fn(|| it.next_if(|c| *c != ',')).collect::<String>().trim().to_string(),
        };
        let key = match key.as_str() {
            "point" | "start_point" => "start_box".to_string(),
            "end_point" => "end_box".to_string(),
            _ => key,
        };
        args.push((key, value));
    }
}

/// A `start_box` / `end_box` value to a point: two numbers, or a box's four (its centre).
fn read_point(action: &str, key: &str, v: &str) -> Result<(i32, i32), ParseError> {
    let bad = |why: &str| ParseError::Invalid { action: action.into(), reason: format!("`{key}` {v:?}: {why}") };
    let cleaned: String = v
        .replace("<point>", "")
        .replace("</point>", "")
        .replace("<bbox>", "")
        .replace("</bbox>", "")
        .chars()
        .map(|c| if matches!(c, '(' | ')' | '[' | ']' | ',') { ' ' } else { c })
        .collect();
    let nums: Vec<f64> =
        cleaned.split_whitespace().map(str::parse).collect::<Result<_, _>>().map_err(|_| bad("not numbers"))?;
    let (x, y) = match nums.as_slice() {
        [x, y] => (*x, *y),
        [x1, y1, x2, y2] => ((x1 + x2) / 2.0, (y1 + y2) / 2.0),
        _ => return Err(bad("needs (x,y) or [x1,y1,x2,y2]")),
    };
    let coord = |v: f64| (v.is_finite() && v.abs() <= i32::MAX as f64).then(|| v.round() as i32);
    coord(x).zip(coord(y)).ok_or_else(|| bad("not a finite point"))
}

/// The action a UI-TARS call stands for.
fn to_action(name: &str, args: &[(String, String)], thought: Option<&str>) -> Result<Action, ParseError> {
    let get = |k: &str| args.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty());
    let need =
        |k: &str| get(k).ok_or_else(|| ParseError::Invalid { action: name.into(), reason: format!("needs `{k}`") });
    let at = |k: &str| need(k).and_then(|v| read_point(name, k, v));
    let target = |k: &str| at(k).map(|(x, y)| crate::action::Target::point(x, y));
    Ok(match name {
        "click" | "left_single" => Action::Click(target("start_box")?),
        "left_double" => Action::DoubleClick(target("start_box")?),
        "right_single" => Action::RightClick(target("start_box")?),
        "long_press" => Action::LongPress(target("start_box")?),
        "drag" | "select" => {
            let ((x1, y1), (x2, y2)) = (at("start_box")?, at("end_box")?);
            Action::Drag(Segment { x1, y1, x2, y2 })
        }
        "scroll" => {
            let p = get("start_box").map(|v| read_point(name, "start_box", v)).transpose()?;
            let direction = match need("direction")?.to_lowercase().as_str() {
                "up" => Direction::Up,
                "down" => Direction::Down,
                "left" => Direction::Left,
                "right" => Direction::Right,
                other => {
                    return Err(ParseError::Invalid {
                        action: name.into(),
                        reason: format!("direction {other:?} is not up, down, left or right"),
                    })
                }
            };
            Action::Scroll { x: p.map(|p| p.0), y: p.map(|p| p.1), direction }
        }
        "type" => Action::Type { text: need("content")?.to_string() },
        "hotkey" => {
            let keys: Vec<String> = need("key")?.split_whitespace().map(String::from).collect();
            match keys.as_slice() {
                [one] => Action::Press { key: one.clone() },
                _ => Action::Hotkey { keys },
            }
        }
        "press_home" => Action::Press { key: "home".into() },
        "press_back" => Action::Press { key: "back".into() },
        "press_enter" => Action::Press { key: "enter".into() },
        "open_app" => Action::OpenApp { name: need("app_name")?.to_string() },
        "wait" => {
            let seconds = match get("time") {
                None => WAIT_SECONDS,
                Some(t) => t.trim().parse().map_err(|_| ParseError::Invalid {
                    action: name.into(),
                    reason: format!("`time` {t:?} is not a number of seconds"),
                })?,
            };
            Action::Wait { seconds }
        }
        "finished" => match get("content") {
            Some(text) => Action::Answer { text: text.to_string() },
            None => Action::Done { status: DoneStatus::Success },
        },
        "call_user" => Action::Ask(ask(args_question(get("content"), thought, name)?, get("options"), get("kind"))?),
        other => {
            return Err(ParseError::UnknownLanguageAction {
                language: LANGUAGE,
                name: other.to_string(),
                known: UI_TARS_ACTIONS.join(", "),
            })
        }
    })
}

/// The question of a `call_user`: its `content`, else the thought (where UI-TARS-1.5 writes it).
fn args_question(content: Option<&str>, thought: Option<&str>, name: &str) -> Result<String, ParseError> {
    content.or(thought).map(String::from).ok_or_else(|| ParseError::Invalid {
        action: name.into(),
        reason: "needs the question: `content`, or a Thought before the action".into(),
    })
}

fn ask(question: String, options: Option<&str>, kind: Option<&str>) -> Result<Ask, ParseError> {
    let bad = |reason: String| ParseError::Invalid { action: "call_user".into(), reason };
    let options: Vec<AskOption> = match options {
        None => Vec::new(),
        Some(o) => serde_json::from_str(o)
            .map_err(|e| bad(format!("`options` is not a JSON list of {{\"label\", \"detail\"}} objects ({e})")))?,
    };
    let kind = match kind {
        None => None,
        Some("selection") => Some(AskKind::Selection),
        Some("specification") => Some(AskKind::Specification),
        Some(other) => return Err(bad(format!("`kind` {other:?} is not selection or specification"))),
    };
    Ok(Ask { question, options, kind })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::Target;

    #[test]
    fn python_escapes_round_trip_and_dodge_the_official_parsers_regexes() {
        for s in
            ["it's", "a\\b", "line\nnext", " lead", "trail ", "Action: go", "endpoint=5", "<point>1 2</point>", "é中"]
        {
            assert_eq!(py_unescape(&py_escape(s)).unwrap(), s, "{s:?} -> {:?}", py_escape(s));
        }
        // By hand: the apostrophe is `\x27`, the backslash doubled, the newline `\n`.
        assert_eq!(py_escape("it's a\\b\n"), "it\\x27s a\\\\b\\n");
        assert_eq!(py_escape(" x "), "\\x20x\\x20", "ends are escaped: the official parser trims values");
        assert_eq!(py_escape("Action: x"), "Action\\x3a x");
        assert_eq!(py_escape("endpoint=1"), "endpoint\\x3d1");
        // Python's own rules for what the model writes: `\"` is a quote, an unknown escape stays.
        assert_eq!(py_unescape("say \\\"hi\\\" \\d").unwrap(), "say \"hi\" \\d");
        assert!(py_unescape("\\x4").is_err());
    }

    #[test]
    fn renders_as_the_ui_tars_prompt_writes_it() {
        let click = Action::Click(Target::point(540, 1210));
        assert_eq!(render(&click).unwrap(), "Action: click(start_box='(540,1210)')");
        let t = Action::Type { text: "it's\n".into() };
        assert_eq!(render(&t).unwrap(), "Action: type(content='it\\x27s\\n')");
        let w = Action::Wait { seconds: 2.0 };
        assert_eq!(render(&w).unwrap(), "Action: wait(time='2')");
        assert_eq!(render(&Action::Wait { seconds: 5.0 }).unwrap(), "Action: wait()");
        let e = render(&Action::Done { status: DoneStatus::Infeasible }).unwrap_err();
        assert_eq!((e.language, e.action), ("ui-tars", "done"));
        let e = render(&Action::Click(Target { x: None, y: None, element: Some("e3".into()) })).unwrap_err();
        assert!(e.to_string().contains("e3") && e.to_string().contains("--elements"), "{e}");
    }

    #[test]
    fn the_prompt_lists_every_function_the_parser_reads() {
        let prompt = system_prompt(FrameKind::Resized);
        let space = &prompt[prompt.find("## Action Space").unwrap()..prompt.find("## Note").unwrap()];
        let listed: Vec<&str> = space.lines().filter_map(|l| l.split_once('(').map(|(name, _)| name)).collect();
        assert_eq!(listed, UI_TARS_ACTIONS);
        assert!(prompt.ends_with("absolute pixels of the screenshot as you see it."), "the frame is said");
        // The escapes the prompt teaches are the ones the targets use.
        for c in ["'", "\\", "\n"] {
            assert!(prompt.contains(&format!(" {} for a", py_escape(c))), "{c:?} -> {}", py_escape(c));
        }
    }

    #[test]
    fn the_compact_prompt_is_one_line_naming_every_function() {
        let compact = compact_system_prompt();
        assert!(!compact.contains('\n'), "{compact}");
        assert!(compact.contains("`Action: f(...)`"), "the answer's form: {compact}");
        // The list, read back word by word, is the parser's functions in order.
        let listed: Vec<&str> =
            compact.split(" one of ").nth(1).unwrap().split(';').next().unwrap().split(", ").collect();
        assert_eq!(listed, UI_TARS_ACTIONS);
        assert!(compact.ends_with("call_user when the task misses a detail."), "{compact}");
        assert!(compact.len() * 4 < system_prompt(FrameKind::Resized).len(), "a fraction of the full prompt");
    }

    #[test]
    fn a_bare_call_user_asks_its_thought() {
        let p = parse("Thought: Which account should I use?\nAction: call_user()").unwrap();
        assert_eq!(
            p.action,
            Action::Ask(Ask { question: "Which account should I use?".into(), options: vec![], kind: None })
        );
        let e = parse("Action: call_user()").unwrap_err();
        assert!(e.to_string().contains("question"), "{e}");
    }

    #[test]
    fn errors_name_the_problem() {
        let e = parse("I would click it.").unwrap_err();
        assert!(matches!(e, ParseError::NoLanguageAction { .. }), "{e}");
        let e = parse("Action: tap(start_box='(1,2)')").unwrap_err();
        assert!(e.to_string().contains("`tap`") && e.to_string().contains("call_user"), "{e}");
        let e = parse("Action: click(start_box='(1)')").unwrap_err();
        assert!(e.to_string().contains("start_box"), "{e}");
        let e = parse("Action: scroll(direction='sideways')").unwrap_err();
        assert!(e.to_string().contains("sideways"), "{e}");
        let e = parse("Action: hotkey(key='ctrl c')\n\ntype(content='x')").unwrap_err();
        assert!(e.to_string().contains("2 actions"), "{e}");
    }
}
