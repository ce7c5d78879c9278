//! Converter: **GUI-Odyssey** (OpenGVLab/GUI-Odyssey, fields as its `introduction.md` documents them). Input: the
//! dataset's `data/` folder (`annotations/*.json`, one episode a file, and `screenshots/*.png`), or one annotation
//! file (screenshots then in `../screenshots/`). Task `task_info.instruction` (the rephrased task naming the apps),
//! step instruction `low_level_instruction`, platform android. Coordinates are given in 0..1000 of the screenshot and
//! are scaled to its pixels, so the screen is the screenshots' size (`device_info` is not trusted for it). `CLICK`
//! `[[x, y]]` -> click, `LONG_PRESS` -> long_press, `KEY_HOME` / `KEY_BACK` / `KEY_APPSELECT` -> press home / back /
//! app_switch, `SCROLL [[x1, y1], [x2, y2]]` -> swipe along the finger's path (the dataset records the finger, not the
//! content's direction), `TYPE` (the released converter says `TEXT`) -> type, `COMPLETE` / `INCOMPLETE` -> done
//! success / infeasible.

use super::*;

/// [`convert_gui_odyssey_with`] with the default options (a bad record is an error).
pub fn convert_gui_odyssey(input: &Path, out: &Path) -> Result<ConvertReport, ConvertError> {
    convert_gui_odyssey_with(input, out, ConvertOptions::default())
}

pub fn convert_gui_odyssey_with(input: &Path, out: &Path, opts: ConvertOptions) -> Result<ConvertReport, ConvertError> {
    let (files, shots) = odyssey_files(input)?;
    info!("GUI-Odyssey: {} annotation files in {}", files.len(), input.display());
    let mut o = Output::create(out, opts)?;
    for file in &files {
        let at = format!("gui-odyssey {}", file.display());
        match odyssey_episode(file, &shots, &mut o) {
            Ok(ep) => o.push(ep, &at)?,
            Err(Fail::Record(why)) => o.bad(&at, &why, "episode skipped")?,
            Err(Fail::Io(e)) => return Err(e),
        }
    }
    o.finish(input)
}

/// The annotation files and the screenshots folder.
fn odyssey_files(input: &Path) -> Result<(Vec<PathBuf>, PathBuf), ConvertError> {
    if input.is_file() {
        let shots = input.parent().and_then(Path::parent).unwrap_or(Path::new(".")).join("screenshots");
        return Ok((vec![input.to_path_buf()], shots));
    }
    let annotations = input.join("annotations");
    let dir = if annotations.is_dir() { annotations } else { input.to_path_buf() };
    let mut files: Vec<PathBuf> = fs::read_dir(&dir)
        .map_err(io_err(&dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ConvertError::NoRecords { input: input.to_path_buf(), expected: "annotations/*.json".into() });
    }
    Ok((files, dir.parent().unwrap_or(Path::new(".")).join("screenshots")))
}

/// Why an episode could not be converted (a bad record), or an I/O error of the output (fatal).
enum Fail {
    Record(String),
    Io(ConvertError),
}

impl<T: Into<String>> From<T> for Fail {
    fn from(why: T) -> Self {
        Fail::Record(why.into())
    }
}

impl From<ConvertError> for Fail {
    fn from(e: ConvertError) -> Self {
        Fail::Io(e)
    }
}

fn odyssey_episode(file: &Path, shots: &Path, o: &mut Output) -> Result<Episode, Fail> {
    let raw = fs::read_to_string(file).map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_str(&raw).map_err(|e| format!("not valid JSON ({e})"))?;
    let id = id_of(&v, "episode_id")?;
    let task_info = v.get("task_info").ok_or("missing `task_info`")?;
    let task = text(task_info, "instruction").or_else(|_| text(task_info, "task"))?.trim().to_string();
    let steps_in = v.get("steps").and_then(Value::as_array).filter(|s| !s.is_empty()).ok_or("no `steps` list")?;
    let (mut screen, mut steps) = (None::<Screen>, vec![]);
    for (i, s) in steps_in.iter().enumerate() {
        let name = text(s, "screenshot").map_err(|e| format!("step {i}: {e}"))?;
        let src = shots.join(name);
        let (w, h) =
            image::image_dimensions(&src).map_err(|e| format!("step {i}: screenshot {}: {e}", src.display()))?;
        let size = *screen.get_or_insert(Screen { width: w, height: h });
        if (w, h) != (size.width, size.height) {
            return Err(format!(
                "step {i}: screenshot {name} is {w}x{h}, the first one {}x{}",
                size.width, size.height
            )
            .into());
        }
        let action = odyssey_action(s, size).map_err(|e| format!("step {i}: {e}"))?;
        let rel = format!("images/guiodyssey-{}/{}", file_safe(&id), file_safe(name));
        o.copy(&rel, &src)?;
        let mut st = step(&rel, action);
        st.instruction = text(s, "low_level_instruction").ok().map(|t| t.trim().to_string());
        steps.push(st);
    }
    let screen = screen.expect("at least one step");
    Ok(Episode {
        id: format!("guiodyssey-{id}"),
        platform: Platform::Android,
        screen,
        task,
        ambiguous_task: None,
        steps,
    })
}

/// A 0..1000 point of `info` scaled to the screen's pixels.
fn odyssey_point(p: &Value, screen: Screen) -> Result<(i32, i32), String> {
    let xy = p.as_array().filter(|a| a.len() == 2).ok_or_else(|| format!("point {p} is not [x, y]"))?;
    let c = |v: &Value| {
        v.as_f64().filter(|c| (0.0..=1000.0).contains(c)).ok_or(format!("coordinate {v} is not in 0..1000"))
    };
    let (x, y) = (c(&xy[0])?, c(&xy[1])?);
    let px = (x / 1000.0 * screen.width as f64).min(screen.width as f64 - 1.0);
    let py = (y / 1000.0 * screen.height as f64).min(screen.height as f64 - 1.0);
    point_in(px, py, screen)
}

fn odyssey_action(s: &Value, screen: Screen) -> Result<Action, String> {
    let kind = text(s, "action")?;
    let info = s.get("info").cloned().unwrap_or(Value::Null);
    let points = || info.as_array().cloned().ok_or_else(|| format!("{kind} `info` {info} is not a list of points"));
    Ok(match (kind, info.as_str()) {
        ("CLICK" | "LONG_PRESS", Some("KEY_HOME")) => Action::Press { key: "home".into() },
        ("CLICK" | "LONG_PRESS", Some("KEY_BACK")) => Action::Press { key: "back".into() },
        ("CLICK" | "LONG_PRESS", Some("KEY_APPSELECT")) => Action::Press { key: "app_switch".into() },
        ("CLICK" | "LONG_PRESS", _) => {
            let p = points()?;
            let (x, y) = odyssey_point(p.first().ok_or("empty `info`")?, screen)?;
            match kind {
                "CLICK" => Action::Click(Target::point(x, y)),
                _ => Action::LongPress(Target::point(x, y)),
            }
        }
        ("SCROLL", _) => match points()?.as_slice() {
            [a, b] => {
                let ((x1, y1), (x2, y2)) = (odyssey_point(a, screen)?, odyssey_point(b, screen)?);
                Action::Swipe(Segment { x1, y1, x2, y2 })
            }
            _ => return Err(format!("SCROLL `info` {info} is not [[x1, y1], [x2, y2]]")),
        },
        ("TYPE" | "TEXT", Some(t)) if !t.is_empty() => Action::Type { text: t.to_string() },
        ("COMPLETE", _) => Action::Done { status: DoneStatus::Success },
        ("INCOMPLETE", _) => Action::Done { status: DoneStatus::Infeasible },
        (other, _) => return Err(format!("unknown action {other:?} with info {}", snippet(&info.to_string()))),
    })
}
