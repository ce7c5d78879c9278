//! Converter: **Multimodal-Mind2Web** (osunlp/Multimodal-Mind2Web; one row per action). Input: its published parquet
//! shards (a file, or a folder of them: [`super::mind2web_parquet`]) or a JSONL of the same rows, with
//! `annotation_id`, `action_uid`, `confirmed_task`, `operation` (JSON string `{"op", "original_op", "value"}`),
//! `pos_candidates` (JSON strings whose `attributes` JSON holds `bounding_box_rect` "x,y,w,h"), `target_action_index`,
//! `target_action_reprs`, and `screenshot` (the image column's bytes; in JSONL base64 or a path relative to the file).
//! Rows are grouped by `annotation_id` and ordered by `target_action_index`; platform web. The target is the first positive candidate: the step's
//! `elements` holds its box (id `backend_node_id`) and the click lands on the box's centre. `CLICK` -> click; its
//! `original_op` `ENTER` -> `press enter` (the element had the focus; a click would not submit); `TYPE` -> click on the
//! element, then `type` of the value; `SELECT` -> click on the `<select>`, then `type` of the option (browsers select
//! the option typed into a focused select, the closest our schema has). Screenshots are full pages whose heights differ
//! within a task; an episode has one screen, so smaller ones are padded white at the right and bottom, which keeps
//! every coordinate where the dataset put it. No `done`: there is no final screenshot.

use super::mind2web_parquet::{parquet_files, row_json, screenshot, Shard, COLUMNS, SCREENSHOT};
use super::*;

/// One Mind2Web row, read and checked, with its screenshot.
struct M2wRow {
    /// Where the row is, for messages: `line 3` (JSONL) or `<file> row 2` (parquet).
    place: String,
    uid: String,
    op: String,
    original_op: String,
    value: String,
    element: Element,
    bytes: Vec<u8>,
    ext: &'static str,
    size: Screen,
}

/// A row's task: its `annotation_id` and `confirmed_task`.
fn task_of(v: &Value) -> Result<(String, String), String> {
    Ok((id_of(v, "annotation_id")?, text(v, "confirmed_task")?.trim().to_string()))
}

/// A row checked, with the screenshot bytes from `shot` (read last: they are the large part).
fn m2w_row(place: String, v: &Value, shot: impl FnOnce() -> Result<Vec<u8>, String>) -> Result<M2wRow, String> {
    let index = num(v, "target_action_index")? as i64;
    let uid = id_of(v, "action_uid").unwrap_or_else(|_| format!("step{index}"));
    let op = nested(v.get("operation").ok_or("missing `operation`")?).map_err(|e| format!("`operation`: {e}"))?;
    let op_name = text(&op, "op").map_err(|e| format!("`operation`: {e}"))?.to_uppercase();
    let original_op = op.get("original_op").and_then(Value::as_str).unwrap_or(&op_name).to_uppercase();
    let value = op.get("value").and_then(Value::as_str).unwrap_or("").to_string();
    let cands = v.get("pos_candidates").and_then(Value::as_array).ok_or("missing list `pos_candidates`")?;
    let cand = nested(cands.first().ok_or("no positive candidate: the target element is unknown")?)
        .map_err(|e| format!("positive candidate: {e}"))?;
    let attrs = nested(cand.get("attributes").ok_or("positive candidate has no `attributes`")?)
        .map_err(|e| format!("candidate `attributes`: {e}"))?;
    let rect = text(&attrs, "bounding_box_rect")?;
    let nums: Vec<f64> = rect
        .split(',')
        .map(|s| s.trim().parse::<f64>())
        .collect::<Result<_, _>>()
        .map_err(|_| format!("`bounding_box_rect` {rect:?} is not \"x,y,w,h\""))?;
    let [x, y, w, h] = nums[..] else { return Err(format!("`bounding_box_rect` {rect:?} is not \"x,y,w,h\"")) };
    if !(w > 0.0 && h > 0.0 && x.is_finite() && y.is_finite()) {
        return Err(format!("`bounding_box_rect` {rect:?} is an empty box"));
    }
    let id = id_of(&cand, "backend_node_id").unwrap_or_else(|_| "target".into());
    let role = cand.get("tag").and_then(Value::as_str).unwrap_or("").to_string();
    // "[button]  Search -> CLICK": the element's text sits between the tag and the arrow.
    let repr = v.get("target_action_reprs").and_then(Value::as_str).unwrap_or("");
    let el_text =
        repr.split_once(']').map(|(_, r)| r).unwrap_or("").rsplit_once("->").map(|(t, _)| t.trim()).unwrap_or("");
    let bbox = [x.floor() as i32, y.floor() as i32, (x + w).ceil() as i32, (y + h).ceil() as i32];
    let element = Element { id, role, text: el_text.to_string(), bbox };
    let bytes = shot()?;
    let (ext, size) = image_info(&bytes)?;
    Ok(M2wRow { place, uid, op: op_name, original_op, value, element, bytes, ext, size })
}

/// Where a row is: (`target_action_index`, line number, byte offset).
type RowRef = (i64, usize, u64);

/// [`convert_mind2web_with`] with the default options (a bad record is an error).
pub fn convert_mind2web(input: &Path, out: &Path) -> Result<ConvertReport, ConvertError> {
    convert_mind2web_with(input, out, ConvertOptions::default())
}

/// Converts parquet shards (a `.parquet` file, or a folder of them) or a JSONL of rows.
pub fn convert_mind2web_with(input: &Path, out: &Path, opts: ConvertOptions) -> Result<ConvertReport, ConvertError> {
    match parquet_files(input)? {
        Some(files) => convert_parquet(input, &files, out, opts),
        None => convert_jsonl(input, out, opts),
    }
}

fn convert_jsonl(input: &Path, out: &Path, opts: ConvertOptions) -> Result<ConvertReport, ConvertError> {
    let base = input.parent().map(Path::to_path_buf).unwrap_or_default();
    info!("Multimodal-Mind2Web: action rows from {}", input.display());
    let mut o = Output::create(out, opts)?;
    // First pass, light: tasks in order of first appearance, with (index, line, offset) of their rows.
    let mut tasks: Vec<(String, String, Vec<RowRef>)> = vec![];
    let mut by_id: HashMap<String, usize> = HashMap::new();
    for_each_line(input, |line, offset, raw| {
        let v: Value = match serde_json::from_str(raw) {
            Ok(v) => v,
            Err(e) => {
                let at = format!("mind2web {} line {line}", input.display());
                return o.bad(&at, &format!("not valid JSON ({e})"), "row skipped");
            }
        };
        match task_of(&v) {
            Ok((aid, task)) => {
                let k = *by_id.entry(aid.clone()).or_insert_with(|| {
                    tasks.push((aid, task, vec![]));
                    tasks.len() - 1
                });
                let index = num(&v, "target_action_index").map(|i| i as i64).unwrap_or(i64::MAX);
                tasks[k].2.push((index, line, offset));
            }
            Err(e) => o.bad(&format!("mind2web {} line {line}", input.display()), &e, "row skipped")?,
        }
        Ok(())
    })?;
    // Second pass, one task (and its screenshots) at a time.
    let mut file = fs::File::open(input).map_err(io_err(input))?;
    for (aid, task, mut rows) in tasks {
        rows.sort_by_key(|r| r.0);
        let mut parsed = vec![];
        for (_, line, offset) in rows {
            let raw = line_at(&mut file, input, offset)?;
            let v = serde_json::from_str(&raw).map_err(|e| format!("not valid JSON ({e})"));
            let shot = |v: &Value| image_bytes(v.get(SCREENSHOT).ok_or("missing `screenshot`")?, &base);
            let row = v.and_then(|v| m2w_row(format!("line {line}"), &v, || shot(&v)));
            parsed.push(row.map_err(|e| format!("line {line}: {e}")));
        }
        let at = format!("mind2web {} task {aid}", input.display());
        if let Some(ep) = m2w_episode(&aid, task, parsed, &at, &mut o)? {
            o.push(ep, &at)?;
        }
    }
    o.finish(input)
}

/// A task's rows, in file order, with `target_action_index` (`i64::MAX` when unreadable) to order them by.
type TaskRows = Vec<(i64, Result<M2wRow, String>)>;

/// The parquet path: a light pass reads each row's task, a full pass parses the rows and makes a task's episode as
/// soon as its last row is read (a task's rows are adjacent in the published shards, so few are held at once).
fn convert_parquet(
    input: &Path,
    files: &[PathBuf],
    out: &Path,
    opts: ConvertOptions,
) -> Result<ConvertReport, ConvertError> {
    info!("Multimodal-Mind2Web: {} parquet file(s) from {}", files.len(), input.display());
    let mut o = Output::create(out, opts)?;
    let mut shards = vec![];
    for file in files {
        shards.extend(Shard::open(file, &mut o)?);
    }
    let (tasks, row_task) = parquet_tasks(&shards, &mut o)?;
    let mut pending: HashMap<usize, TaskRows> = HashMap::new();
    let columns: Vec<&str> = COLUMNS.iter().copied().chain([SCREENSHOT]).collect();
    for (s, of_rows) in shards.iter().zip(&row_task) {
        s.rows(&columns, Some(of_rows.len()), &mut o, |o, n, row| {
            let Some(&Some(k)) = of_rows.get(n) else { return Ok(()) };
            let (index, parsed) = match row_json(&row) {
                Ok(v) => {
                    let index = num(&v, "target_action_index").map(|i| i as i64).unwrap_or(i64::MAX);
                    (index, m2w_row(s.at(n), &v, || screenshot(&row)))
                }
                Err(e) => (i64::MAX, Err(e)),
            };
            let rows = pending.entry(k).or_default();
            rows.push((index, parsed.map_err(|e| format!("{}: {e}", s.at(n)))));
            if rows.len() < tasks[k].2 {
                return Ok(());
            }
            let rows = pending.remove(&k).unwrap_or_default();
            m2w_task(&tasks[k], rows, o)
        })?;
    }
    // Tasks whose last rows could not be read (reported): what was read of them.
    let mut left: Vec<(usize, TaskRows)> = pending.into_iter().collect();
    left.sort_by_key(|(k, _)| *k);
    for (k, rows) in left {
        m2w_task(&tasks[k], rows, &mut o)?;
    }
    o.finish(input)
}

/// A task: `annotation_id`, `confirmed_task`, its number of rows.
type Task = (String, String, usize);

/// Each row's task (an index into the tasks), by shard; `None`: a bad row, reported.
type RowTasks = Vec<Vec<Option<usize>>>;

/// The light pass: tasks in order of first appearance, and each row's task.
fn parquet_tasks(shards: &[Shard], o: &mut Output) -> Result<(Vec<Task>, RowTasks), ConvertError> {
    let mut tasks: Vec<Task> = vec![];
    let mut row_task = vec![];
    let mut by_id: HashMap<String, usize> = HashMap::new();
    for s in shards {
        let mut of_rows = vec![];
        s.rows(&COLUMNS[..2], None, o, |o, n, row| {
            let k = match row_json(&row).and_then(|v| task_of(&v)) {
                Ok((aid, task)) => *by_id.entry(aid.clone()).or_insert_with(|| {
                    tasks.push((aid, task, 0));
                    tasks.len() - 1
                }),
                Err(e) => {
                    of_rows.push(None);
                    return o.bad(&format!("mind2web {}", s.at(n)), &e, "row skipped");
                }
            };
            tasks[k].2 += 1;
            of_rows.push(Some(k));
            Ok(())
        })?;
        row_task.push(of_rows);
    }
    Ok((tasks, row_task))
}

/// A task's episode from its parquet rows, ordered by `target_action_index`.
fn m2w_task(task: &Task, mut rows: TaskRows, o: &mut Output) -> Result<(), ConvertError> {
    rows.sort_by_key(|r| r.0);
    let (aid, text) = (&task.0, task.1.clone());
    let at = format!("mind2web task {aid}");
    if let Some(ep) = m2w_episode(aid, text, rows.into_iter().map(|r| r.1).collect(), &at, o)? {
        o.push(ep, &at)?;
    }
    Ok(())
}

fn m2w_episode(
    aid: &str,
    task: String,
    rows: Vec<Result<M2wRow, String>>,
    at: &str,
    o: &mut Output,
) -> Result<Option<Episode>, ConvertError> {
    // The usable prefix: a later row's page assumes the earlier actions happened.
    let mut good = vec![];
    for (k, r) in rows.into_iter().enumerate() {
        match r {
            Ok(r) => good.push(r),
            Err(e) => {
                o.bad(
                    &format!("{at} action {k}"),
                    &e,
                    "the episode is cut before it (later pages assume it happened)",
                )?;
                break;
            }
        }
    }
    let screen = Screen {
        width: good.iter().map(|r| r.size.width).max().unwrap_or(0),
        height: good.iter().map(|r| r.size.height).max().unwrap_or(0),
    };
    let dir = format!("images/mind2web-{}", file_safe(aid));
    let mut steps = vec![];
    for r in good {
        let (x1, y1, x2, y2) =
            (r.element.bbox[0].max(0), r.element.bbox[1].max(0), r.element.bbox[2], r.element.bbox[3]);
        let (x2, y2) = (x2.min(r.size.width as i32), y2.min(r.size.height as i32));
        if x1 >= x2 || y1 >= y2 {
            let why =
                format!("target box {:?} is outside the {}x{} screenshot", r.element.bbox, r.size.width, r.size.height);
            o.bad(&format!("{at} {}", r.place), &why, "the episode is cut before it")?;
            break;
        }
        let (bytes, ext) = if r.size == screen {
            (r.bytes, r.ext)
        } else {
            match pad_png(&r.bytes, screen) {
                Ok(b) => (b, "png"),
                Err(e) => {
                    o.bad(&format!("{at} {}", r.place), &e, "the episode is cut before it")?;
                    break;
                }
            }
        };
        let rel = format!("{dir}/{}.{ext}", file_safe(&r.uid));
        o.put(&rel, &bytes)?;
        let target = Target { x: Some((x1 + x2) / 2), y: Some((y1 + y2) / 2), element: Some(r.element.id.clone()) };
        let click = Action::Click(target);
        let actions = match (r.op.as_str(), r.original_op.as_str()) {
            ("CLICK", "ENTER") => vec![Action::Press { key: "enter".into() }],
            ("CLICK", _) => vec![click],
            ("TYPE" | "SELECT", _) if !r.value.trim().is_empty() => vec![click, Action::Type { text: r.value.clone() }],
            ("TYPE" | "SELECT", _) => {
                warn!("{at} {}: {} without a value: only the click is kept", r.place, r.op);
                vec![click]
            }
            (op, _) => {
                let why = format!("unknown operation {op:?}");
                o.bad(&format!("{at} {}", r.place), &why, "the episode is cut before it")?;
                break;
            }
        };
        for action in actions {
            let mut s = step(&rel, action);
            s.elements = Some(vec![r.element.clone()]);
            steps.push(s);
        }
    }
    if steps.is_empty() {
        o.skip("no convertible action", format!("{at}: no convertible action: task skipped"));
        return Ok(None);
    }
    let id = format!("mind2web-{aid}");
    Ok(Some(Episode { id, platform: Platform::Web, screen, task, ambiguous_task: None, steps }))
}

/// The image padded white at the right and bottom to `screen`, as PNG: coordinates do not move.
fn pad_png(bytes: &[u8], screen: Screen) -> Result<Vec<u8>, String> {
    let img = image::load_from_memory(bytes).map_err(|e| format!("cannot decode the screenshot: {e}"))?.to_rgb8();
    let mut canvas = image::RgbImage::from_pixel(screen.width, screen.height, image::Rgb([255, 255, 255]));
    image::imageops::replace(&mut canvas, &img, 0, 0);
    let mut out = Cursor::new(vec![]);
    canvas
        .write_to(&mut out, image::ImageFormat::Png)
        .map_err(|e| format!("cannot encode the padded screenshot: {e}"))?;
    Ok(out.into_inner())
}
