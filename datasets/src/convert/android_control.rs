//! Converter: **AndroidControl** (google-research/android_control), read from the published GZIP TFRecord files of
//! `tf.train.Example` (one episode a record; a file, or a folder of them), or from a JSONL export with the same
//! feature names. Features: `episode_id`, `goal`, `screenshots` (PNG bytes), `screenshot_widths`/`_heights`,
//! `accessibility_trees` (serialized `AndroidAccessibilityForest`, see [`super::android_control_a11y`]), `actions`
//! (JSON strings) and `step_instructions`. The JSONL form has one episode a line, screenshots as base64 (a `data:`
//! URL prefix is allowed) or paths relative to the JSONL, trees as base64 (or empty):
//! ```json
//! {"episode_id": 42, "goal": "Add oat milk to my cart", "screenshots": ["iVBORw0KGgo...", "shots/42_1.png"],
//!  "screenshot_widths": [1080, 1080], "screenshot_heights": [2400, 2400], "accessibility_trees": ["", ""],
//!  "actions": ["{\"action_type\":\"click\",\"x\":540,\"y\":1210}"], "step_instructions": ["Tap the search bar"]}
//! ```
//! Both readers give an [`AndroidRecord`], converted once. There is one screenshot more than actions (the final
//! state); steps are the actions, with the step instruction as `instruction` and the screenshot's accessibility
//! tree as `elements`, and the final screenshot gets `done {success}` (the dataset has no status action; its
//! demonstrations are taken to end with the goal done). `click`, `long_press`, `scroll {direction}`, `open_app
//! {app_name}`, `input_text {text}` -> `type`, `navigate_back`/`navigate_home` -> `press back/home`, `wait` -> `wait
//! 2 s` (the dataset gives no duration), and the dataset's `type {x, y, text}` (click, type, Enter) -> three steps
//! on one screenshot. A step that cannot be converted cuts its episode there: later screenshots assume that it
//! happened. An unreadable screenshot or tree, sizes that disagree, a missing feature, a bad CRC or a truncated
//! file are bad records, named by file and record (counted from 1). With the split file (`splits.json`: episode
//! ids by split), the episodes are also written to `train.jsonl`, `val.jsonl` and `test.jsonl`.

use std::collections::BTreeMap;
use std::io::Read;

use flate2::read::MultiGzDecoder;

use super::android_control_a11y::forest_elements;
use super::android_control_tfrecord::{parse_example, Feature, Records};
use super::*;
use crate::split::SplitReport;

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

/// Converts AndroidControl from `input`: a TFRecord file (GZIP or not), a folder of them, or a JSONL export.
pub fn convert_android_control_with(
    input: &Path,
    out: &Path,
    opts: ConvertOptions,
) -> Result<ConvertReport, ConvertError> {
    convert_android_control_split(input, None, out, opts)
}

/// [`convert_android_control_with`], and with `split_file` (AndroidControl's `splits.json`) also one JSONL file
/// per split beside `episodes.jsonl` (`validation` is written as `val.jsonl`).
pub fn convert_android_control_split(
    input: &Path,
    split_file: Option<&Path>,
    out: &Path,
    opts: ConvertOptions,
) -> Result<ConvertReport, ConvertError> {
    let splits = split_file.map(read_split_file).transpose()?;
    let mut o = Output::create(out, opts)?;
    match input_kind(input)? {
        Input::Jsonl => convert_jsonl(input, &mut o)?,
        Input::TfRecords(files) => {
            for file in &files {
                convert_tfrecord_file(file, &mut o)?;
            }
        }
    }
    let written = match (&splits, o.episodes.is_empty()) {
        (Some((path, ids)), false) => Some(write_splits(out, path, ids, &o.episodes)?),
        _ => None,
    };
    let mut report = o.finish(input)?;
    if let Some(w) = written {
        (report.splits, report.unsplit, report.empty_splits, report.unknown_split_ids) =
            (w.files, w.unsplit, w.empty, w.unknown);
    }
    Ok(report)
}

/// One AndroidControl episode with the dataset's features, as both readers give it.
struct AndroidRecord {
    id: String,
    goal: String,
    /// Image bytes, one per observation.
    screenshots: Vec<Vec<u8>>,
    /// Declared sizes, where given.
    widths: Vec<Option<f64>>,
    heights: Vec<Option<f64>>,
    /// A serialized `AndroidAccessibilityForest` per observation (empty: none).
    trees: Vec<Vec<u8>>,
    /// The dataset's JSON actions (strings holding JSON, or objects).
    actions: Vec<Value>,
    instructions: Vec<String>,
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

/// Keeps a converted record's episode, or reports why it was not converted.
fn keep(converted: Result<Option<Episode>, Fail>, at: &str, o: &mut Output) -> Result<(), ConvertError> {
    match converted {
        Ok(Some(ep)) => o.push(ep, at),
        Ok(None) => Ok(()),
        Err(Fail::Record(why)) => o.bad(at, &why, "episode skipped"),
        Err(Fail::Io(e)) => Err(e),
    }
}

// ---------------------------------------------------------------------------------------------------
// Reading the input.

enum Input {
    Jsonl,
    TfRecords(Vec<PathBuf>),
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// A folder holds TFRecord files (GZIP ones found by their magic bytes, others by a `.tfrecord` in the name);
/// a file is GZIP TFRecord, JSONL (its first non-blank byte is `{`) or uncompressed TFRecord.
fn input_kind(input: &Path) -> Result<Input, ConvertError> {
    if !input.is_dir() {
        let head = file_head(input)?;
        let first = head.iter().find(|b| !b.is_ascii_whitespace());
        return Ok(if !head.starts_with(&GZIP_MAGIC) && first == Some(&b'{') {
            Input::Jsonl
        } else {
            Input::TfRecords(vec![input.to_path_buf()])
        });
    }
    let mut files = vec![];
    for entry in fs::read_dir(input).map_err(io_err(input))? {
        let path = entry.map_err(io_err(input))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name.starts_with('.') || !path.is_file() {
            continue;
        }
        if name.contains(".tfrecord") || file_head(&path)?.starts_with(&GZIP_MAGIC) {
            files.push(path);
        } else {
            debug!("AndroidControl: {} is not a TFRecord file: left out", path.display());
        }
    }
    if files.is_empty() {
        let expected = "GZIP TFRecord files like android_control-00000-of-00020".to_string();
        return Err(ConvertError::NoRecords { input: input.to_path_buf(), expected });
    }
    files.sort();
    Ok(Input::TfRecords(files))
}

fn file_head(path: &Path) -> Result<Vec<u8>, ConvertError> {
    let mut head = Vec::with_capacity(64);
    let file = fs::File::open(path).map_err(io_err(path))?;
    file.take(64).read_to_end(&mut head).map_err(io_err(path))?;
    Ok(head)
}

fn convert_jsonl(input: &Path, o: &mut Output) -> Result<(), ConvertError> {
    let base = input.parent().map(Path::to_path_buf).unwrap_or_default();
    info!("AndroidControl: episodes from the JSONL export {}", input.display());
    for_each_line(input, |line, _, raw| {
        let at = format!("androidcontrol {} line {line}", input.display());
        let converted = json_record(raw, &base).map_err(Fail::Record).and_then(|r| android_episode(r, &at, o));
        keep(converted, &at, o)
    })
}

fn convert_tfrecord_file(file: &Path, o: &mut Output) -> Result<(), ConvertError> {
    info!("AndroidControl: episodes from the TFRecord file {}", file.display());
    let reader = std::io::BufReader::new(fs::File::open(file).map_err(io_err(file))?);
    let reader: Box<dyn Read> = if file_head(file)?.starts_with(&GZIP_MAGIC) {
        Box::new(MultiGzDecoder::new(reader))
    } else {
        Box::new(reader)
    };
    for (i, record) in Records::new(reader).enumerate() {
        let at = format!("androidcontrol {} record {}", file.display(), i + 1);
        let bytes = match record {
            Ok(bytes) => bytes,
            Err(e) => {
                let then = if e.resumable() { "record skipped" } else { "the rest of the file is skipped" };
                o.bad(&at, &e.to_string(), then)?;
                continue;
            }
        };
        let converted = example_record(&bytes).map_err(Fail::Record).and_then(|r| android_episode(r, &at, o));
        keep(converted, &at, o)?;
    }
    Ok(())
}

/// The features of one `tf.train.Example` record.
fn example_record(bytes: &[u8]) -> Result<AndroidRecord, String> {
    let ex = parse_example(bytes).map_err(|e| format!("not a tf.train.Example ({e})"))?;
    let id = match feature(&ex, "episode_id", true)? {
        Feature::Ints(v) if v.len() == 1 => v[0].to_string(),
        Feature::Bytes(v) if v.len() == 1 => utf8("episode_id", 0, v[0])?,
        f => return Err(format!("feature `episode_id` is {} of {} values, not one id", f.kind(), list_len(f))),
    };
    let goal = strings(&ex, "goal", true)?.into_iter().next().ok_or("feature `goal` is empty")?;
    Ok(AndroidRecord {
        id,
        goal,
        screenshots: bytes_list(&ex, "screenshots", true)?.into_iter().map(<[u8]>::to_vec).collect(),
        widths: numbers(&ex, "screenshot_widths")?,
        heights: numbers(&ex, "screenshot_heights")?,
        trees: bytes_list(&ex, "accessibility_trees", false)?.into_iter().map(<[u8]>::to_vec).collect(),
        actions: strings(&ex, "actions", true)?.into_iter().map(Value::String).collect(),
        instructions: strings(&ex, "step_instructions", false)?,
    })
}

const FEATURES: &str = "episode_id, goal, screenshots, screenshot_widths, screenshot_heights, \
                        accessibility_trees, actions, step_instructions";

/// A feature by name; a missing optional one is an empty list.
fn feature<'a>(ex: &'a BTreeMap<String, Feature<'a>>, name: &str, required: bool) -> Result<&'a Feature<'a>, String> {
    match ex.get(name) {
        Some(f) => Ok(f),
        None if !required => Ok(&Feature::Empty),
        None => {
            let have: Vec<&str> = ex.keys().map(String::as_str).collect();
            Err(format!("missing feature `{name}` (AndroidControl has {FEATURES}; this record has {have:?})"))
        }
    }
}

fn list_len(f: &Feature<'_>) -> usize {
    match f {
        Feature::Empty => 0,
        Feature::Bytes(v) => v.len(),
        Feature::Floats(v) => v.len(),
        Feature::Ints(v) => v.len(),
    }
}

fn bytes_list<'a>(ex: &'a BTreeMap<String, Feature<'a>>, name: &str, required: bool) -> Result<Vec<&'a [u8]>, String> {
    match feature(ex, name, required)? {
        Feature::Empty => Ok(vec![]),
        Feature::Bytes(v) => Ok(v.clone()),
        f => Err(format!("feature `{name}` is {}, not a bytes_list", f.kind())),
    }
}

fn strings(ex: &BTreeMap<String, Feature<'_>>, name: &str, required: bool) -> Result<Vec<String>, String> {
    bytes_list(ex, name, required)?.into_iter().enumerate().map(|(i, b)| utf8(name, i, b)).collect()
}

fn utf8(name: &str, i: usize, b: &[u8]) -> Result<String, String> {
    String::from_utf8(b.to_vec()).map_err(|_| format!("feature `{name}` value {i} is not UTF-8 text"))
}

fn numbers(ex: &BTreeMap<String, Feature<'_>>, name: &str) -> Result<Vec<Option<f64>>, String> {
    match feature(ex, name, false)? {
        Feature::Empty => Ok(vec![]),
        Feature::Ints(v) => Ok(v.iter().map(|&x| Some(x as f64)).collect()),
        Feature::Floats(v) => Ok(v.iter().map(|&x| Some(x as f64)).collect()),
        f => Err(format!("feature `{name}` is {}, not numbers", f.kind())),
    }
}

/// One line of the JSONL export.
fn json_record(raw: &str, base: &Path) -> Result<AndroidRecord, String> {
    let v: Value = serde_json::from_str(raw).map_err(|e| format!("not valid JSON ({e})"))?;
    let list = |f: &str| v.get(f).and_then(Value::as_array).ok_or_else(|| format!("missing list `{f}`"));
    let (shots, actions) = (list("screenshots")?, list("actions")?);
    let screenshots = shots.iter().take(actions.len() + 1).enumerate();
    let screenshots = screenshots.map(|(i, s)| image_bytes(s, base).map_err(|e| format!("screenshot {i}: {e}")));
    let numbers = |f: &str| v.get(f).and_then(Value::as_array).map(|a| a.iter().map(Value::as_f64));
    let trees = v.get("accessibility_trees").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    let trees = trees.iter().enumerate().map(|(i, t)| match t.as_str() {
        Some(s) => base64_decode(s).map_err(|e| format!("accessibility_trees {i}: {e}")),
        None => Err(format!("accessibility_trees {i} is {}, not base64 text", snippet(&t.to_string()))),
    });
    let instructions = v.get("step_instructions").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
    Ok(AndroidRecord {
        id: id_of(&v, "episode_id")?,
        goal: text(&v, "goal")?.to_string(),
        screenshots: screenshots.collect::<Result<_, _>>()?,
        widths: numbers("screenshot_widths").map(Iterator::collect).unwrap_or_default(),
        heights: numbers("screenshot_heights").map(Iterator::collect).unwrap_or_default(),
        trees: trees.collect::<Result<_, _>>()?,
        actions: actions.clone(),
        instructions: instructions.iter().map(|t| t.as_str().unwrap_or_default().to_string()).collect(),
    })
}

// ---------------------------------------------------------------------------------------------------
// Converting a record.

fn android_episode(rec: AndroidRecord, at: &str, o: &mut Output) -> Result<Option<Episode>, Fail> {
    let (shots, actions) = (&rec.screenshots, &rec.actions);
    if actions.is_empty() || shots.len() < actions.len() {
        let why = format!("{} screenshots for {} actions: need one per action", shots.len(), actions.len());
        return Err(Fail::Record(why + " (plus the final state)"));
    }
    let at = format!("{at} (episode {})", rec.id);
    let dir = format!("images/androidcontrol-{}", file_safe(&rec.id));
    let (mut first, mut steps) = (None::<Screen>, vec![]);
    // One screenshot per action, then the final state (which gets `done`).
    for (i, bytes) in shots.iter().enumerate().take(actions.len() + 1) {
        let (ext, screen) = screenshot(&rec, i, &mut first)?;
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
        let elements = match rec.trees.get(i).filter(|t| !t.is_empty()) {
            Some(t) => Some(forest_elements(t, screen).map_err(|e| format!("accessibility_trees {i}: {e}"))?),
            None => None,
        };
        o.put(&rel, bytes)?;
        let instruction = actions.get(i).and(rec.instructions.get(i)).map(|t| t.trim()).filter(|t| !t.is_empty());
        for action in acts {
            let mut s = step(&rel, action);
            s.instruction = instruction.map(String::from);
            s.elements.clone_from(&elements);
            steps.push(s);
        }
    }
    let actionable = steps.iter().any(|s| !matches!(s.action, Action::Done { .. }));
    let Some(screen) = first.filter(|_| actionable) else {
        o.skip("no convertible action", format!("{at}: no convertible action: episode skipped"));
        return Ok(None);
    };
    let (id, task) = (format!("androidcontrol-{}", rec.id), rec.goal.trim().to_string());
    Ok(Some(Episode { id, platform: Platform::Android, screen, task, ambiguous_task: None, steps }))
}

/// Screenshot `i`'s file extension and size, checked against the declared size and screenshot 0's.
fn screenshot(rec: &AndroidRecord, i: usize, first: &mut Option<Screen>) -> Result<(&'static str, Screen), String> {
    let (ext, size) = image_info(&rec.screenshots[i]).map_err(|e| format!("screenshot {i}: {e}"))?;
    if let (Some(&Some(w)), Some(&Some(h))) = (rec.widths.get(i), rec.heights.get(i)) {
        if (w, h) != (size.width as f64, size.height as f64) {
            return Err(format!("screenshot {i} is {}x{} but declared {w}x{h}", size.width, size.height));
        }
    }
    let screen = *first.get_or_insert(size);
    if size != screen {
        let (w, h) = (screen.width, screen.height);
        return Err(format!("screenshot {i} is {}x{}, screenshot 0 {w}x{h}", size.width, size.height));
    }
    Ok((ext, screen))
}

// ---------------------------------------------------------------------------------------------------
// The split file.

/// Episode ids by split name, from AndroidControl's `splits.json` (`{"train": [ids], "validation": [...], ...}`).
type SplitIds = BTreeMap<String, String>;

fn read_split_file(path: &Path) -> Result<(PathBuf, SplitIds), ConvertError> {
    let bad = |why: String| ConvertError::SplitFile { path: path.to_path_buf(), why };
    let text = fs::read_to_string(path).map_err(io_err(path))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON ({e})")))?;
    let splits = v.as_object().ok_or_else(|| bad("not a JSON object of split name -> episode ids".into()))?;
    let mut ids = SplitIds::new();
    for (name, list) in splits {
        let name = if name == "validation" { "val".to_string() } else { file_safe(name) };
        if name == "episodes" {
            return Err(bad("a split named `episodes` would overwrite episodes.jsonl".into()));
        }
        let list = list.as_array().ok_or_else(|| bad(format!("`{name}` is not a list of episode ids")))?;
        for id in list {
            let id = match id {
                Value::Number(n) => n.to_string(),
                Value::String(s) => s.trim().to_string(),
                other => return Err(bad(format!("`{name}` holds {other}, not an episode id"))),
            };
            if let Some(was) = ids.insert(id.clone(), name.clone()) {
                return Err(bad(format!("episode {id} is in both `{was}` and `{name}`")));
            }
        }
    }
    Ok((path.to_path_buf(), ids))
}

/// What [`write_splits`] wrote, and what of the split file matched nothing.
struct SplitsWritten {
    files: SplitReport,
    /// Converted episodes in no split.
    unsplit: usize,
    /// Splits none of whose ids was converted (no file is written for them), with their id counts.
    empty: Vec<(String, usize)>,
    /// The split file's ids that are no converted episode, in id order.
    unknown: Vec<String>,
}

/// Writes `<split>.jsonl` for each split that has converted episodes; says which splits and ids of the
/// split file matched no converted episode, and how many episodes are in no split.
fn write_splits(
    out: &Path,
    split_file: &Path,
    ids: &SplitIds,
    episodes: &[Episode],
) -> Result<SplitsWritten, ConvertError> {
    let mut by_split: BTreeMap<&str, Vec<&Episode>> = BTreeMap::new();
    let mut unsplit = 0;
    let mut converted = std::collections::HashSet::new();
    for ep in episodes {
        let id = ep.id.strip_prefix("androidcontrol-").unwrap_or(&ep.id);
        converted.insert(id);
        match ids.get(id) {
            Some(split) => by_split.entry(split).or_default().push(ep),
            None => unsplit += 1,
        }
    }
    info!("{unsplit} converted episodes are in no split of {}", split_file.display());
    let mut unknown: Vec<String> = ids.keys().filter(|id| !converted.contains(id.as_str())).cloned().collect();
    unknown.sort_by_key(|id| (id.parse::<u64>().ok(), id.clone()));
    let mut empty: BTreeMap<String, usize> = BTreeMap::new();
    for split in ids.values().filter(|s| !by_split.contains_key(s.as_str())) {
        *empty.entry(split.clone()).or_default() += 1;
    }
    let mut by_split: Vec<_> = by_split.into_iter().collect();
    by_split.sort_by_key(|(split, _)| (["train", "val", "test"].iter().position(|s| s == split).unwrap_or(3), *split));
    let mut files = vec![];
    for (split, eps) in by_split {
        let path = out.join(format!("{split}.jsonl"));
        crate::episode::write_episodes(&path, eps.iter().copied())?;
        files.push((split.to_string(), path, eps.len()));
    }
    Ok(SplitsWritten { files, unsplit, empty: empty.into_iter().collect(), unknown })
}
