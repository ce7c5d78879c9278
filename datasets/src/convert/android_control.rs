//! Converter: **AndroidControl** (google-research/android_control). The real data is GZIP TFRecord; we read a JSONL export of it,
//! one episode a line, with the TFRecord feature names, `screenshots` as base64 PNG strings (a `data:` URL prefix is
//! allowed) or paths relative to the JSONL, and `actions` as the dataset's JSON strings (or objects);
//! `accessibility_trees` (protobuf) is ignored:
//! ```json
//! {"episode_id": 42, "goal": "Add oat milk to my cart",
//!  "screenshots": ["iVBORw0KGgo...", "shots/42_1.png", "..."],
//!  "screenshot_widths": [1080, 1080, 1080], "screenshot_heights": [2400, 2400, 2400],
//!  "actions": ["{\"action_type\":\"click\",\"x\":540,\"y\":1210}", "{\"action_type\":\"navigate_back\"}"],
//!  "step_instructions": ["Tap the search bar", "Go back"]}
//! ```
//! There is one screenshot more than actions (the final state); steps are the actions, with the step instruction as
//! `instruction`, and the final screenshot gets `done {success}` (the dataset has no status action; its demonstrations
//! are taken to end with the goal done). `click`, `long_press`, `scroll {direction}`, `open_app {app_name}`,
//! `input_text {text}` -> `type`, `navigate_back`/`navigate_home` -> `press back/home`, `wait` -> `wait 2 s` (the
//! dataset gives no duration), and the dataset's `type {x, y, text}` (click, type, Enter) -> three steps on one
//! screenshot. A step that cannot be converted cuts its episode there: later screenshots assume that it happened. An
//! unreadable screenshot, or sizes that disagree, skip the episode.

use super::*;

/// One AndroidControl action as our actions (its `type` is three of ours).
fn android_actions(a: &Value, screen: Screen) -> Result<Vec<Action>, String> {
    let point = || point_in(num(a, "x")?, num(a, "y")?, screen);
    let kind = a.get("action_type").and_then(Value::as_str).ok_or("missing `action_type`")?;
    Ok(match kind {
        "click" => point().map(|(x, y)| vec![Action::Click(Target::point(x, y))])?,
        "long_press" => point().map(|(x, y)| vec![Action::LongPress(Target::point(x, y))])?,
        "scroll" => vec![Action::Scroll { x: None, y: None, direction: direction(text(a, "direction")?)? }],
        "open_app" => vec![Action::OpenApp { name: text(a, "app_name")?.trim().to_string() }],
        "input_text" => vec![Action::Type { text: text(a, "text")?.to_string() }],
        "type" => {
            let (x, y) = point()?;
            let t = text(a, "text")?.to_string();
            vec![Action::Click(Target::point(x, y)), Action::Type { text: t }, Action::Press { key: "enter".into() }]
        }
        "navigate_back" => vec![Action::Press { key: "back".into() }],
        "navigate_home" => vec![Action::Press { key: "home".into() }],
        "wait" => vec![Action::Wait { seconds: ANDROID_WAIT_SECONDS }],
        other => return Err(format!("unknown action_type {other:?}")),
    })
}

/// [`convert_android_control_with`] with the default options (a bad record is an error).
pub fn convert_android_control(input: &Path, out: &Path) -> Result<ConvertReport, ConvertError> {
    convert_android_control_with(input, out, ConvertOptions::default())
}

pub fn convert_android_control_with(
    input: &Path,
    out: &Path,
    opts: ConvertOptions,
) -> Result<ConvertReport, ConvertError> {
    let base = input.parent().map(Path::to_path_buf).unwrap_or_default();
    info!("AndroidControl: episodes from {}", input.display());
    let mut o = Output::create(out, opts)?;
    for_each_line(input, |line, _, raw| {
        let at = format!("androidcontrol {} line {line}", input.display());
        match android_episode(raw, &base, &at, &mut o) {
            Ok(Some(ep)) => {
                let at = format!("{at} (episode {})", ep.id);
                o.push(ep, &at)?;
            }
            Ok(None) => {}
            Err(Fail::Record(why)) => o.bad(&at, &why, "episode skipped")?,
            Err(Fail::Io(e)) => return Err(e),
        }
        Ok(())
    })?;
    o.finish(input)
}

/// Why a record could not be converted (skipped and reported), or an I/O error (fatal).
enum Fail {
    Record(String),
    Io(ConvertError),
}

impl From<ConvertError> for Fail {
    fn from(e: ConvertError) -> Self {
        Fail::Io(e)
    }
}

impl From<String> for Fail {
    fn from(why: String) -> Self {
        Fail::Record(why)
    }
}

fn android_episode(raw: &str, base: &Path, at: &str, o: &mut Output) -> Result<Option<Episode>, Fail> {
    let v: Value = serde_json::from_str(raw).map_err(|e| format!("not valid JSON ({e})"))?;
    let id = id_of(&v, "episode_id")?;
    let goal = text(&v, "goal")?.trim().to_string();
    let list = |f: &str| v.get(f).and_then(Value::as_array).ok_or_else(|| format!("missing list `{f}`"));
    let (shots, actions) = (list("screenshots")?, list("actions")?);
    let instructions = v.get("step_instructions").and_then(Value::as_array);
    if actions.is_empty() || shots.len() < actions.len() {
        let why = format!("{} screenshots for {} actions: need one per action", shots.len(), actions.len());
        return Err(Fail::Record(why + " (plus the final state)"));
    }
    let at = format!("{at} (episode {id})");
    let dir = format!("images/androidcontrol-{}", file_safe(&id));
    let (mut screen, mut steps) = (None::<Screen>, vec![]);
    // One screenshot per action, then the final state (which gets `done`).
    for (i, shot) in shots.iter().enumerate().take(actions.len() + 1) {
        let bytes = image_bytes(shot, base).map_err(|e| format!("screenshot {i}: {e}"))?;
        let (ext, size) = image_info(&bytes).map_err(|e| format!("screenshot {i}: {e}"))?;
        if let (Some(w), Some(h)) = (num_at(&v, "screenshot_widths", i), num_at(&v, "screenshot_heights", i)) {
            if (w, h) != (size.width as f64, size.height as f64) {
                return Err(Fail::Record(format!(
                    "screenshot {i} is {}x{} but declared {w}x{h}",
                    size.width, size.height
                )));
            }
        }
        let screen = *screen.get_or_insert(size);
        if size != screen {
            let (w, h) = (screen.width, screen.height);
            return Err(Fail::Record(format!(
                "screenshot {i} is {}x{}, screenshot 0 {w}x{h}",
                size.width, size.height
            )));
        }
        let rel = format!("{dir}/{i}.{ext}");
        let converted = match actions.get(i) {
            None => Ok(vec![Action::Done { status: DoneStatus::Success }]),
            Some(a) => nested(a).and_then(|a| android_actions(&a, screen)),
        };
        let acts = match converted {
            Ok(acts) => acts,
            Err(e) => {
                let then = "the episode is cut before it (later screenshots assume it happened)";
                o.bad(&format!("{at} action {i}"), &e, then)?;
                break;
            }
        };
        o.put(&rel, &bytes)?;
        let instruction = match actions.get(i) {
            Some(_) => {
                instructions.and_then(|l| l.get(i)).and_then(Value::as_str).map(str::trim).filter(|t| !t.is_empty())
            }
            None => None,
        };
        for action in acts {
            let mut s = step(&rel, action);
            s.instruction = instruction.map(String::from);
            steps.push(s);
        }
    }
    let actionable = steps.iter().any(|s| !matches!(s.action, Action::Done { .. }));
    let Some(screen) = screen.filter(|_| actionable) else {
        o.skip("no convertible action", format!("{at}: no convertible action: episode skipped"));
        return Ok(None);
    };
    let id = format!("androidcontrol-{id}");
    Ok(Some(Episode { id, platform: Platform::Android, screen, task: goal, ambiguous_task: None, steps }))
}

fn num_at(v: &Value, field: &str, i: usize) -> Option<f64> {
    v.get(field)?.as_array()?.get(i)?.as_f64()
}
