//! Converter: **ScreenAgent** (niuzaisheng/ScreenAgent; input: the folder of session folders, or one session). Both
//! published layouts: the train split's `<session>/<timestamp>_translate.json` (bilingual: `task_prompt_en`,
//! `task_prompt_zh`, ...) and the test split's `<session>/<timestamp>.json` (English only: `task_prompt`,
//! `current_task`, `status`), screenshots in `<session>/images/`. `*_neg_plan` / `*_neg_eval` records (negative
//! examples for the planner and evaluator) and sessions without screenshots are skipped and counted. One episode per
//! session, records ordered by timestamp, task `task_prompt_en` (else `task_prompt`), step instruction the English
//! `current_task` (the sub-task being acted on), screen `video_width` x `video_height`, platform desktop. A record's
//! several actions (click, type, Enter) each become a step on the record's screenshot: the screens in between were never
//! captured. Mouse: `click` (left/right), `double_click`, `scroll_up`/`scroll_down` (at the pointer, so no x/y),
//! `drag` from the pointer set by the preceding `move`, and `down` + `up` (a click where they coincide, else a drag); a
//! `move` that starts no drag is a hover, which the schema has no action for: counted. Keyboard: `text` -> `type`,
//! `press` of one key -> `press`, of a list or `Ctrl+A` -> `hotkey`, X11 names normalised (`Return` -> `enter`).
//! `WaitAction` -> `wait`. `PlanAction` / `EvaluateSubTaskAction` are planning and self-evaluation, not GUI actions; a
//! session whose last record only evaluates `sub_task_success` ends with `done {success}` on that screenshot.

use super::*;

/// Normalises a key name (X11 keysym names as ScreenAgent writes them) to the lower-case names of the
/// protocol.
pub fn key_name(key: &str) -> String {
    let lower = key.trim().to_lowercase();
    let base = lower.strip_suffix("_l").or_else(|| lower.strip_suffix("_r")).unwrap_or(&lower);
    let name = match base {
        "return" | "enter" | "kp_enter" => "enter",
        "control" | "ctrl" => "ctrl",
        "alt" | "option" => "alt",
        "super" | "win" | "windows" | "meta" | "cmd" | "command" => "super",
        "escape" | "esc" => "escape",
        "backspace" => "backspace",
        "delete" | "del" => "delete",
        "page_up" | "prior" | "pageup" => "pageup",
        "page_down" | "next" | "pagedown" => "pagedown",
        other => other,
    };
    name.to_string()
}

/// A keyboard `press`: one key, a list of keys, or a `Ctrl+A` combination.
fn key_action(v: &Value) -> Result<Action, String> {
    let keys: Vec<String> = match v.get("keyboard_key") {
        Some(Value::String(s)) if s.len() > 1 && s.contains('+') => s.split('+').map(key_name).collect(),
        Some(Value::String(s)) => vec![key_name(s)],
        Some(Value::Array(a)) => a
            .iter()
            .map(|k| k.as_str().map(key_name).ok_or(format!("key {k} is not a string")))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("`keyboard_key` is {other}")),
        None => return Err("missing `keyboard_key`".into()),
    };
    match keys.as_slice() {
        _ if keys.is_empty() || keys.iter().any(|k| k.is_empty()) => Err("empty key name".into()),
        [one] => Ok(Action::Press { key: one.clone() }),
        _ => Ok(Action::Hotkey { keys }),
    }
}

fn mouse_point(v: &Value, screen: Screen) -> Result<(i32, i32), String> {
    let p = v.get("mouse_position").ok_or("missing `mouse_position`")?;
    point_in(num(p, "width")?, num(p, "height")?, screen)
}

/// One session folder: its step records in timestamp order, and its negative-example records by kind.
struct Session {
    name: String,
    dir: PathBuf,
    records: Vec<PathBuf>,
    negatives: BTreeMap<String, usize>,
}

/// What a file of a session folder is: a step record (`None`) or a negative example (`Some("neg_eval")`).
/// Other files (`.DS_Store`, notes) are not records.
fn record_kind(name: &str) -> Option<Option<String>> {
    let stem = name.strip_suffix(".json")?;
    if !stem.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    if let Some(i) = stem.find("_neg_") {
        return Some(Some(stem[i + 1..].to_string()));
    }
    Some(None)
}

fn session_in(dir: &Path) -> Result<Option<Session>, ConvertError> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io_err(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("session").to_string();
    let mut s = Session { name, dir: dir.to_path_buf(), records: vec![], negatives: BTreeMap::new() };
    for f in files {
        match f.file_name().and_then(|n| n.to_str()).and_then(record_kind) {
            Some(None) => s.records.push(f),
            Some(Some(kind)) => *s.negatives.entry(kind).or_default() += 1,
            None => {}
        }
    }
    Ok((!s.records.is_empty()).then_some(s))
}

/// The session folders: `input` itself, or its sub-folders.
fn screenagent_sessions(input: &Path) -> Result<Vec<Session>, ConvertError> {
    if let Some(s) = session_in(input)? {
        return Ok(vec![s]);
    }
    let mut dirs: Vec<PathBuf> = fs::read_dir(input)
        .map_err(io_err(input))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    let mut out = vec![];
    for d in dirs {
        out.extend(session_in(&d)?);
    }
    if out.is_empty() {
        return Err(ConvertError::NoScreenAgentRecords { input: input.to_path_buf() });
    }
    Ok(out)
}

/// Counts of the non-GUI actions, for the report's summary line.
#[derive(Default)]
struct NonGui {
    plan: usize,
    eval: usize,
}

/// [`convert_screenagent_with`] with the default options (a bad record is an error).
pub fn convert_screenagent(input: &Path, out: &Path) -> Result<ConvertReport, ConvertError> {
    convert_screenagent_with(input, out, ConvertOptions::default())
}

pub fn convert_screenagent_with(input: &Path, out: &Path, opts: ConvertOptions) -> Result<ConvertReport, ConvertError> {
    let sessions = screenagent_sessions(input)?;
    info!("ScreenAgent: {} sessions in {}", sessions.len(), input.display());
    let mut o = Output::create(out, opts)?;
    let (mut non_gui, mut negatives) = (NonGui::default(), BTreeMap::<String, usize>::new());
    for s in &sessions {
        for (kind, n) in &s.negatives {
            *negatives.entry(kind.clone()).or_default() += n;
        }
        if !has_screenshots(&s.dir) {
            let why = format!(
                "screenagent {}: {} has no screenshots (no images/ folder): session skipped",
                s.name,
                s.dir.display()
            );
            o.skip("session without screenshots", why);
            continue;
        }
        screenagent_session(s, &mut o, &mut non_gui)?;
    }
    for (kind, n) in negatives {
        let line = format!("screenagent: {n} `_{kind}` records are negative examples for the planner or evaluator, not demonstrations: not converted");
        o.skip_n(&format!("negative example record (_{kind})"), n, line);
    }
    if non_gui.plan + non_gui.eval > 0 {
        let line = format!(
            "screenagent: {} PlanAction and {} EvaluateSubTaskAction actions are the recorder's planning and \
             self-evaluation, not GUI actions: not converted (a final `sub_task_success` evaluation became `done`)",
            non_gui.plan, non_gui.eval
        );
        o.skip_n("planning or evaluation action", non_gui.plan + non_gui.eval, line);
    }
    o.finish(input)
}

fn has_screenshots(dir: &Path) -> bool {
    fs::read_dir(dir.join("images")).is_ok_and(|mut it| it.any(|e| e.is_ok_and(|e| e.path().is_file())))
}

/// A record's JSON, screen and screenshot (which must exist at the video size, and the session's).
fn screenagent_record(path: &Path, dir: &Path, session: Option<Screen>) -> Result<(Value, Screen, PathBuf), String> {
    let text_of = fs::read_to_string(path).map_err(|e| e.to_string());
    let rec: Value = text_of.and_then(|t| serde_json::from_str(&t).map_err(|e| format!("not valid JSON ({e})")))?;
    let (w, h) = (num(&rec, "video_width")?, num(&rec, "video_height")?);
    if !(w >= 1.0 && h >= 1.0) {
        return Err(format!("video size {w}x{h} is not a screen"));
    }
    let screen = Screen { width: w as u32, height: h as u32 };
    if let Some(s) = session.filter(|s| *s != screen) {
        return Err(format!("video size {w}x{h} differs from the session's {}x{}", s.width, s.height));
    }
    let image = text(&rec, "saved_image_name")?;
    let src = dir.join("images").join(image);
    let (iw, ih) = image::image_dimensions(&src).map_err(|e| format!("image {}: {e}", src.display()))?;
    if (iw, ih) != (screen.width, screen.height) {
        return Err(format!("image {image} is {iw}x{ih}, not the video's {w}x{h}"));
    }
    Ok((rec, screen, src))
}

/// The step instruction of a record: the English sub-task (`current_task_en`, or `current_task` in the test
/// split's English-only records; the train split's `current_task` is Chinese).
fn instruction_of(rec: &Value) -> Option<String> {
    let t = text(rec, "current_task_en").or_else(|e| match rec.get("task_prompt_en") {
        None => text(rec, "current_task"),
        Some(_) => Err(e),
    });
    t.ok().map(|t| t.trim().to_string())
}

/// Why an action was not converted: the schema has no action for it (counted under the reason), or it is bad.
enum ActionSkip {
    NoSchemaAction(&'static str, String),
    Bad(String),
}

impl<T: Into<String>> From<T> for ActionSkip {
    fn from(why: T) -> Self {
        ActionSkip::Bad(why.into())
    }
}

fn mouse_kind(a: Option<&Value>) -> Option<&str> {
    a.and_then(|a| a.get("mouse_action_type")).and_then(Value::as_str)
}

fn button_click(a: &Value, double: bool, x: i32, y: i32) -> Result<Action, ActionSkip> {
    Ok(match (double, a.get("mouse_button").and_then(Value::as_str).unwrap_or("left")) {
        (true, _) => Action::DoubleClick(Target::point(x, y)),
        (_, "left") => Action::Click(Target::point(x, y)),
        (_, "right") => Action::RightClick(Target::point(x, y)),
        (_, b) => return Err(format!("mouse button {b:?} has no action in the schema").into()),
    })
}

/// One GUI action of a record (`None`: a move or a button press that starts the next action). `pointer` is
/// where the mouse is, after a click, a move or a button press: a drag starts there.
fn screenagent_action(
    actions: &[Value],
    k: usize,
    screen: Screen,
    pointer: &mut Option<(i32, i32)>,
) -> Result<Option<Action>, ActionSkip> {
    let a = &actions[k];
    let kind = a.get("action_type").and_then(Value::as_str).unwrap_or("");
    let sub = a.get("mouse_action_type").or_else(|| a.get("keyboard_action_type")).and_then(Value::as_str);
    Ok(Some(match (kind, sub) {
        ("MouseAction", Some(click @ ("click" | "double_click"))) => {
            let (x, y) = mouse_point(a, screen)?;
            *pointer = Some((x, y));
            button_click(a, click == "double_click", x, y)?
        }
        ("MouseAction", Some(m @ ("move" | "down"))) => {
            *pointer = Some(mouse_point(a, screen)?);
            match (m, mouse_kind(actions.get(k + 1))) {
                ("move", Some("drag")) | ("down", Some("up")) => return Ok(None),
                ("down", _) => return Err("a mouse `down` with no `up` after it".into()),
                _ => {
                    let why = "a mouse move that starts no drag is a hover, which the schema has no action for";
                    return Err(ActionSkip::NoSchemaAction("hover (mouse move without a drag)", why.into()));
                }
            }
        }
        ("MouseAction", Some(m @ ("drag" | "up"))) => {
            let (x2, y2) = mouse_point(a, screen)?;
            if m == "up" && mouse_kind(k.checked_sub(1).and_then(|j| actions.get(j))) != Some("down") {
                return Err("a mouse `up` with no `down` before it".into());
            }
            let (x1, y1) = pointer.ok_or("drag with no known start (no earlier move or click)")?;
            *pointer = Some((x2, y2));
            match (x1, y1) == (x2, y2) {
                true => button_click(a, false, x2, y2)?,
                false => Action::Drag(Segment { x1, y1, x2, y2 }),
            }
        }
        ("MouseAction", Some(s)) if s.starts_with("scroll_") => {
            Action::Scroll { x: None, y: None, direction: direction(&s["scroll_".len()..])? }
        }
        ("KeyboardAction", Some("text") | None) if a.get("keyboard_text").is_some() => {
            Action::Type { text: text(a, "keyboard_text")?.to_string() }
        }
        ("KeyboardAction", Some("press" | "hotkey" | "combination")) => key_action(a)?,
        ("WaitAction", _) => match num(a, "wait_time")? {
            s if s.is_finite() && s >= 0.0 => Action::Wait { seconds: s },
            s => return Err(format!("wait_time {s} is not a duration").into()),
        },
        _ => return Err(format!("unknown action {}", snippet(&a.to_string())).into()),
    }))
}

/// The GUI steps of one record (counting its planning and evaluation actions); true when the record
/// holds a `sub_task_success` evaluation.
fn record_steps(
    rec: &Value,
    at: &str,
    screen: Screen,
    rel: &str,
    pointer: &mut Option<(i32, i32)>,
    o: &mut Output,
    non_gui: &mut NonGui,
) -> Result<(Vec<Step>, bool), ConvertError> {
    let instruction = instruction_of(rec);
    let actions = rec.get("actions").and_then(Value::as_array).cloned().unwrap_or_default();
    let (mut steps, mut success) = (vec![], false);
    for (k, a) in actions.iter().enumerate() {
        match a.get("action_type").and_then(Value::as_str) {
            Some("PlanAction") => non_gui.plan += 1,
            Some("EvaluateSubTaskAction") => {
                non_gui.eval += 1;
                success |= a.get("situation").and_then(Value::as_str) == Some("sub_task_success");
            }
            _ => match screenagent_action(&actions, k, screen, pointer) {
                Ok(Some(action)) => {
                    let mut s = step(rel, action);
                    s.instruction.clone_from(&instruction);
                    steps.push(s);
                }
                Ok(None) => {}
                Err(ActionSkip::NoSchemaAction(reason, why)) => {
                    o.skip(reason, format!("{at} action {k}: {why}: action skipped"))
                }
                Err(ActionSkip::Bad(why)) => o.bad(&format!("{at} action {k}"), &why, "action skipped")?,
            },
        }
    }
    Ok((steps, success))
}

fn screenagent_session(s: &Session, o: &mut Output, non_gui: &mut NonGui) -> Result<(), ConvertError> {
    let (mut steps, mut screen, mut task, mut pointer) = (vec![], None::<Screen>, None::<String>, None);
    // The last record held only a success evaluation: its screenshot ends the episode with `done`.
    let mut final_success: Option<(String, PathBuf)> = None;
    for path in &s.records {
        let at = format!("screenagent {}", path.display());
        let (rec, size, src) = match screenagent_record(path, &s.dir, screen) {
            Ok(r) => r,
            Err(e) => {
                o.bad(&at, &e, "record skipped")?;
                continue;
            }
        };
        screen = Some(size);
        if task.is_none() {
            let t = text(&rec, "task_prompt_en").or_else(|_| text(&rec, "task_prompt"));
            task = t.ok().map(|t| t.trim().to_string());
        }
        let image = src.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let rel = format!("images/{}/{}", file_safe(&s.name), file_safe(image));
        let (record_steps, success) = record_steps(&rec, &at, size, &rel, &mut pointer, o, non_gui)?;
        if !record_steps.is_empty() {
            o.copy(&rel, &src)?;
        }
        final_success = (record_steps.is_empty() && success).then(|| (rel.clone(), src.clone()));
        steps.extend(record_steps);
    }
    let at = format!("screenagent {}", s.dir.display());
    let (Some(screen), Some(task)) = (screen, task) else {
        o.skip(
            "session without a usable record",
            format!("{at}: no record with a screen size and a task: session skipped"),
        );
        return Ok(());
    };
    if steps.is_empty() {
        o.skip("session without GUI actions", format!("{at}: no GUI action in the session: session skipped"));
        return Ok(());
    }
    if let Some((rel, src)) = final_success {
        o.copy(&rel, &src)?;
        steps.push(step(&rel, Action::Done { status: DoneStatus::Success }));
    }
    let id = format!("screenagent-{}", s.name);
    o.push(Episode { id, platform: Platform::Desktop, screen, task, ambiguous_task: None, steps }, &at)
}
