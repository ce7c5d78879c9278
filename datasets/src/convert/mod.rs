//! Converters from public GUI-agent datasets to our episode JSONL: ScreenAgent, AndroidControl, Multimodal-Mind2Web and
//! GUI-Odyssey.
//!
//! Each converter writes `out/episodes.jsonl` and the screenshots under `out/images/`, with paths in the JSONL relative
//! to `out` and coordinates in pixels of the screenshot that is written. Two kinds of skips: what the dataset holds but
//! our schema has no place for (planning records, hovers, sessions without screenshots) is skipped and counted; a bad
//! record (truncated, wrong schema, missing image, a point off the screen) is an error naming the file and record, or,
//! with [`ConvertOptions::skip_bad_records`], a skip. Every skip is one line in [`ConvertReport::skipped`] and counted by
//! reason in [`ConvertReport::skip_counts`]; nothing is dropped silently. Every episode is checked with
//! [`crate::validate::check_episode`] before it is written, so the output validates with zero problems. Ids are
//! prefixed with the source (`screenagent-`, `androidcontrol-`, `mind2web-`, `guiodyssey-`) so converted sets can be
//! mixed.
//!
//! One file per source: [`screenagent`], [`android_control`], [`mind2web`], [`gui_odyssey`]; this file holds what they
//! share.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::{BufRead, BufReader, Cursor, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde_json::Value;
use thiserror::Error;
use tracing::{debug, info, warn};

use crate::action::{Action, Direction, DoneStatus, Segment, Target};
use crate::episode::{Element, Episode, EpisodeError, Platform, Screen, Step};
use crate::plural;
use crate::validate::check_episode;

/// What a conversion produced, and every record it skipped with the reason.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConvertReport {
    pub episodes: usize,
    pub steps: usize,
    /// One line per skipped record or action, naming it and saying why (plus, for ScreenAgent, one summary
    /// line for the planning and evaluation actions, which are not GUI actions).
    pub skipped: Vec<String>,
    /// How many records or actions were skipped, by reason ([`BAD_RECORD`] for the bad ones).
    pub skip_counts: BTreeMap<String, usize>,
    /// With a split file (AndroidControl): the split files written beside `episodes.jsonl`, as
    /// `(split, file, episodes)`.
    pub splits: crate::split::SplitReport,
    /// With a split file: converted episodes that are in none of its splits (they are in `episodes.jsonl` only).
    pub unsplit: usize,
    /// With a split file: its splits none of whose episodes was converted (no file is written for them),
    /// with how many ids each lists.
    pub empty_splits: Vec<(String, usize)>,
    /// With a split file: its ids that are no converted episode (another part of the dataset, or records
    /// skipped), in id order.
    pub unknown_split_ids: Vec<String>,
}

impl Drop for Output {
    /// A failed conversion: `remove_dir` removes a folder only while it is empty, so images written stay.
    fn drop(&mut self) {
        for dir in &self.created {
            if fs::remove_dir(dir).is_err() {
                break;
            }
        }
    }
}

impl ConvertReport {
    /// What a split file gave, a line each: the files written, then the splits that got none, the
    /// episodes in no split and the split file's ids that are no converted episode (the first five).
    pub fn split_lines(&self) -> Vec<String> {
        let is = |n: usize| if n == 1 { "is" } else { "are" };
        let mut lines: Vec<String> =
            self.splits.iter().map(|(s, f, n)| format!("{s}: {} -> {}", plural(*n, "episode"), f.display())).collect();
        for (split, ids) in &self.empty_splits {
            let which = if *ids == 1 { "its one id is no".into() } else { format!("none of its {ids} ids is a") };
            lines.push(format!("{split}: no file written: {which} converted episode"));
        }
        if self.unsplit > 0 {
            let n = self.unsplit;
            lines.push(format!(
                "{} {} in no split of the split file (only in episodes.jsonl)",
                plural(n, "episode"),
                is(n)
            ));
        }
        let unknown = &self.unknown_split_ids;
        if !unknown.is_empty() {
            let more = if unknown.len() > 5 { ", ..." } else { "" };
            lines.push(format!(
                "{} of the split file {} no converted episode ({}{more}): another part of the dataset, or skipped",
                plural(unknown.len(), "id"),
                is(unknown.len()),
                unknown[..unknown.len().min(5)].join(", ")
            ));
        }
        lines
    }
}

/// The reason under which bad records are counted when they are skipped.
pub const BAD_RECORD: &str = "bad record";

/// How a conversion treats bad input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConvertOptions {
    /// Skip (and report) a bad record instead of stopping at it with an error.
    pub skip_bad_records: bool,
}

#[derive(Debug, Error)]
pub enum ConvertError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "{input}: no ScreenAgent step records (`<session>/<timestamp>_translate.json` of the train split or \
         `<session>/<timestamp>.json` of the test split) found: pass the folder of session folders, or one session folder"
    )]
    NoScreenAgentRecords { input: PathBuf },
    #[error("{input}: no records ({expected}) found")]
    NoRecords { input: PathBuf, expected: String },
    #[error("{input}: nothing could be converted ({} skipped); the first reason: {first}", plural(*.count, "record"))]
    NothingConverted { input: PathBuf, count: usize, first: String },
    #[error("{at}: {why} (fix or remove that record, or pass --skip-bad-records to skip it and go on)")]
    BadRecord { at: String, why: String },
    #[error(
        "{path}: {why} (a split file is a JSON object of episode id lists by split, like AndroidControl's splits.json)"
    )]
    SplitFile { path: PathBuf, why: String },
    #[error("writing the episodes: {0}")]
    Write(#[from] EpisodeError),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ConvertError + '_ {
    move |source| ConvertError::Io { path: path.to_path_buf(), source }
}

/// Seconds of an AndroidControl `wait`, which carries no duration.
pub const ANDROID_WAIT_SECONDS: f64 = 2.0;

// ---------------------------------------------------------------------------------------------------
// Base64 (standard alphabet, RFC 4648), for screenshots embedded in JSONL.

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with `=` padding.
pub fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decodes base64 (standard or URL-safe alphabet; whitespace ignored; padding optional).
pub fn base64_decode(text: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut acc, mut bits) = (0u32, 0u32);
    for (i, c) in text.bytes().enumerate() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => break,
            c if c.is_ascii_whitespace() => continue,
            c => return Err(format!("byte {i} ({:?}) is not base64", c as char)),
        };
        acc = acc << 6 | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    if bits >= 6 {
        return Err("truncated base64 (one character too many)".into());
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------------
// Shared helpers.

/// A file-name-safe version of an id.
fn file_safe(s: &str) -> String {
    let mut t: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    if t.is_empty() || t.starts_with('.') {
        t.insert(0, '_');
    }
    t
}

fn snippet(s: &str) -> String {
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

/// A JSON value that may also arrive as a JSON string holding it (as HF exports nested fields).
fn nested(v: &Value) -> Result<Value, String> {
    match v {
        Value::String(s) => serde_json::from_str(s).map_err(|e| format!("not JSON ({e}): {:?}", snippet(s))),
        other => Ok(other.clone()),
    }
}

fn num(v: &Value, field: &str) -> Result<f64, String> {
    match v.get(field) {
        Some(Value::Number(n)) => n.as_f64().ok_or_else(|| format!("`{field}` is not a number")),
        Some(Value::String(s)) => s.trim().parse().map_err(|_| format!("`{field}` is {s:?}, not a number")),
        Some(other) => Err(format!("`{field}` is {other}, not a number")),
        None => Err(format!("missing `{field}`")),
    }
}

fn text<'a>(v: &'a Value, field: &str) -> Result<&'a str, String> {
    match v.get(field) {
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s),
        Some(Value::String(_)) => Err(format!("`{field}` is empty")),
        Some(other) => Err(format!("`{field}` is {other}, not a string")),
        None => Err(format!("missing `{field}`")),
    }
}

/// An id field that may be a string or a number.
fn id_of(v: &Value, field: &str) -> Result<String, String> {
    match v.get(field) {
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.trim().to_string()),
        Some(Value::Number(n)) => Ok(n.to_string()),
        Some(other) => Err(format!("`{field}` is {other}, not an id")),
        None => Err(format!("missing `{field}`")),
    }
}

/// A point in a screen: rounded, and checked to lie inside it.
fn point_in(x: f64, y: f64, screen: Screen) -> Result<(i32, i32), String> {
    let (px, py) = (x.round(), y.round());
    if !(px >= 0.0 && py >= 0.0 && px < screen.width as f64 && py < screen.height as f64) {
        return Err(format!("point ({x}, {y}) is outside the {}x{} screen", screen.width, screen.height));
    }
    Ok((px as i32, py as i32))
}

/// Image bytes from a field that holds base64 (optionally a `data:` URL), a path relative to `base`, or
/// an object `{"bytes": base64}` / `{"path": ...}` (Hugging Face's image feature).
fn image_bytes(v: &Value, base: &Path) -> Result<Vec<u8>, String> {
    let s = match v {
        Value::String(s) => s.trim(),
        Value::Object(o) => match (o.get("bytes"), o.get("path")) {
            (Some(b @ Value::String(_)), _) => return image_bytes(b, base),
            (_, Some(p @ Value::String(_))) => return image_bytes(p, base),
            _ => return Err("screenshot object has neither `bytes` nor `path`".into()),
        },
        other => return Err(format!("screenshot is {}, not a string", snippet(&other.to_string()))),
    };
    if let Some(rest) = s.strip_prefix("data:") {
        let data = rest.split_once(',').map(|(_, d)| d).unwrap_or(rest);
        return base64_decode(data).map_err(|e| format!("screenshot data URL: {e}"));
    }
    let path = crate::episode::resolve(base, s);
    if s.len() < 1024 && path.is_file() {
        return fs::read(&path).map_err(|e| format!("screenshot {}: {e}", path.display()));
    }
    base64_decode(s).map_err(|e| format!("screenshot is neither a file next to the input nor base64 ({e})"))
}

/// The file extension and size of PNG or JPEG bytes.
fn image_info(bytes: &[u8]) -> Result<(&'static str, Screen), String> {
    let ext = match image::guess_format(bytes) {
        Ok(image::ImageFormat::Png) => "png",
        Ok(image::ImageFormat::Jpeg) => "jpg",
        Ok(f) => return Err(format!("screenshot is {f:?}: only PNG and JPEG are supported")),
        Err(_) => return Err("screenshot bytes are not an image".into()),
    };
    let (width, height) = image::ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| e.to_string())
        .and_then(|r| r.into_dimensions().map_err(|e| e.to_string()))
        .map_err(|e| format!("unreadable screenshot: {e}"))?;
    Ok((ext, Screen { width, height }))
}

fn step(screenshot: &str, action: Action) -> Step {
    Step { screenshot: screenshot.to_string(), elements: None, instruction: None, informative: None, action, ask: None }
}

/// The output folder: images are written as they come, episodes are checked and written at the end. A
/// conversion that fails removes the folders it created while they are still empty.
struct Output {
    dir: PathBuf,
    opts: ConvertOptions,
    episodes: Vec<Episode>,
    images: HashSet<String>,
    report: ConvertReport,
    /// The folders `create` made, deepest first; emptied on success ([`Output::finish`]).
    created: Vec<PathBuf>,
}

impl Output {
    fn create(dir: &Path, opts: ConvertOptions) -> Result<Self, ConvertError> {
        let images = dir.join("images");
        let created = images
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        fs::create_dir_all(&images).map_err(io_err(&images))?;
        let report = Default::default();
        Ok(Self { dir: dir.to_path_buf(), opts, episodes: vec![], images: HashSet::new(), report, created })
    }

    /// Skips something the dataset holds on purpose but our schema has no place for, counted under `reason`.
    fn skip(&mut self, reason: &str, line: String) {
        self.skip_n(reason, 1, line);
    }

    fn skip_n(&mut self, reason: &str, n: usize, line: String) {
        debug!("skipped: {line}");
        self.report.skipped.push(line);
        *self.report.skip_counts.entry(reason.to_string()).or_default() += n;
    }

    /// A bad record at `at`: an error, or a skip under [`BAD_RECORD`] with `--skip-bad-records`.
    fn bad(&mut self, at: &str, why: &str, then: &str) -> Result<(), ConvertError> {
        if !self.opts.skip_bad_records {
            return Err(ConvertError::BadRecord { at: at.to_string(), why: why.to_string() });
        }
        self.skip(BAD_RECORD, format!("{at}: {why}: {then}"));
        Ok(())
    }

    /// Writes an image at `rel` (relative to the output folder) once.
    fn put(&mut self, rel: &str, bytes: &[u8]) -> Result<(), ConvertError> {
        if self.images.insert(rel.to_string()) {
            let path = self.dir.join(rel);
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(io_err(parent))?;
            }
            fs::write(&path, bytes).map_err(io_err(&path))?;
        }
        Ok(())
    }

    fn copy(&mut self, rel: &str, src: &Path) -> Result<(), ConvertError> {
        if !self.images.contains(rel) {
            let bytes = fs::read(src).map_err(io_err(src))?;
            self.put(rel, &bytes)?;
        }
        Ok(())
    }

    /// Keeps the episode if it passes validation; one that does not is a bad record.
    fn push(&mut self, ep: Episode, source: &str) -> Result<(), ConvertError> {
        let mut problems = vec![];
        if self.episodes.iter().any(|e| e.id == ep.id) {
            problems.push(format!("duplicate episode id `{}`", ep.id));
        }
        check_episode(&ep, &self.dir, true, &mut |step, msg| {
            problems.push(match step {
                Some(s) => format!("step {s}: {msg}"),
                None => msg,
            })
        });
        if problems.is_empty() {
            self.episodes.push(ep);
            return Ok(());
        }
        let why = format!("the episode would not validate: {}", problems.join("; "));
        self.bad(source, &why, "episode dropped")
    }

    fn finish(mut self, input: &Path) -> Result<ConvertReport, ConvertError> {
        if self.episodes.is_empty() {
            return Err(ConvertError::NothingConverted {
                input: input.to_path_buf(),
                count: self.report.skipped.len(),
                first: self.report.skipped.first().cloned().unwrap_or_else(|| "the input holds no records".into()),
            });
        }
        let path = self.dir.join("episodes.jsonl");
        crate::episode::write_episodes(&path, &self.episodes)?;
        self.report.episodes = self.episodes.len();
        self.report.steps = self.episodes.iter().map(|e| e.steps.len()).sum();
        info!(
            "wrote {}, {} to {} ({} skipped)",
            plural(self.report.episodes, "episode"),
            plural(self.report.steps, "step"),
            path.display(),
            self.report.skipped.len()
        );
        self.created.clear();
        Ok(std::mem::take(&mut self.report))
    }
}

/// Calls `f(line number, byte offset, text)` for each non-empty line of a JSONL file, one at a time (a
/// file of embedded screenshots can be far larger than memory).
fn for_each_line(
    path: &Path,
    mut f: impl FnMut(usize, u64, &str) -> Result<(), ConvertError>,
) -> Result<(), ConvertError> {
    let mut reader = BufReader::new(fs::File::open(path).map_err(io_err(path))?);
    let (mut buf, mut offset, mut n) = (String::new(), 0u64, 0usize);
    loop {
        buf.clear();
        let len = reader.read_line(&mut buf).map_err(io_err(path))?;
        if len == 0 {
            return Ok(());
        }
        n += 1;
        if !buf.trim().is_empty() {
            f(n, offset, buf.trim_end())?;
        }
        offset += len as u64;
    }
}

/// The line that starts at byte `offset`.
fn line_at(file: &mut fs::File, path: &Path, offset: u64) -> Result<String, ConvertError> {
    file.seek(SeekFrom::Start(offset)).map_err(io_err(path))?;
    let mut line = String::new();
    BufReader::new(file).read_line(&mut line).map_err(io_err(path))?;
    Ok(line)
}

fn direction(d: &str) -> Result<Direction, String> {
    match d {
        "up" => Ok(Direction::Up),
        "down" => Ok(Direction::Down),
        "left" => Ok(Direction::Left),
        "right" => Ok(Direction::Right),
        d => Err(format!("unknown scroll direction {d:?}")),
    }
}

mod android_control;
mod android_control_a11y;
mod android_control_tfrecord;
mod gui_odyssey;
mod mind2web;
mod mind2web_parquet;
mod screenagent;

pub use android_control::{convert_android_control, convert_android_control_split, convert_android_control_with};
pub use gui_odyssey::{convert_gui_odyssey, convert_gui_odyssey_with};
pub use mind2web::{convert_mind2web, convert_mind2web_with};
pub use screenagent::{convert_screenagent, convert_screenagent_with, key_name};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips_and_matches_rfc4648() {
        for (plain, coded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64_encode(plain.as_bytes()), coded);
            assert_eq!(base64_decode(coded).unwrap(), plain.as_bytes());
        }
        let bytes: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
        for n in [0, 1, 2, 3, 254, 255, 511, 512] {
            assert_eq!(base64_decode(&base64_encode(&bytes[..n])).unwrap(), &bytes[..n], "{n} bytes");
        }
        assert_eq!(base64_decode("Zm9v\nYmFy").unwrap(), b"foobar", "whitespace is ignored");
        assert_eq!(base64_decode("Zm9vYg").unwrap(), b"foob", "padding is optional");
        assert!(base64_decode("Zm9v*").unwrap_err().contains("byte 4"));
        assert!(base64_decode("Zm9vY").is_err(), "one character past a group is not base64");
    }
}
