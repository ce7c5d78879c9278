//! `askgui-data render`: a self-contained folder of HTML pages to look at an episode file.
//!
//! `index.html` lists the episodes; each episode gets a page with its task and ambiguous task and, for
//! every step, the screenshot with the action drawn on it and, beside it, the instruction, the ASK/SAY
//! dialogue (before the action, as the agent would see it) and the action as an action language writes it
//! (askgui's JSON by default; in the data's screen pixels, with a warning where the language cannot say
//! it). The overlay is an inline
//! SVG whose `viewBox` is the episode's screen, so it is drawn in the same screen pixels the data stores
//! and any frame bug shows up as a ring in the wrong place. Screenshots are copied into `img/` (each file
//! once, however many steps share it) so the folder can be zipped or served as it is. Bad lines and
//! missing screenshots are shown on the pages, never a reason to fail.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Component, Path, PathBuf};

use thiserror::Error;

use crate::action::{Action, Direction};
use crate::episode::{read_episodes, resolve, Element, Episode, EpisodeError, Step};
use crate::language::ActionLanguage;

#[derive(Debug, Error)]
pub enum RenderError {
    #[error("cannot read the episode file: {0}")]
    Episodes(#[from] EpisodeError),
    #[error("cannot create the output folder {path}: {source}; pass an --out folder that can be created (not a file)")]
    CreateDir { path: PathBuf, source: std::io::Error },
    #[error("cannot write {path}: {source}; check that the output folder is writable and has free space")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot copy screenshot {from} to {to}: {source}; check the output folder's permissions and free space")]
    Copy { from: PathBuf, to: PathBuf, source: std::io::Error },
}

#[derive(Debug, Clone)]
pub struct RenderReport {
    /// Episode pages written (the index not counted).
    pub pages: usize,
    /// `out/index.html`.
    pub index: PathBuf,
    /// Distinct screenshots copied into `out/img/`.
    pub images: usize,
    /// Steps whose screenshot is missing or unreadable (rendered as a placeholder).
    pub missing_images: usize,
    /// Lines of the file that are not a valid episode (listed on the index).
    pub bad_lines: usize,
}

/// Renders every episode of a JSONL file into `out` (created if needed), each action in `language`.
pub fn render_html(path: &Path, out: &Path, language: ActionLanguage) -> Result<RenderReport, RenderError> {
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let lines = read_episodes(path)?;
    let img_dir = out.join("img");
    std::fs::create_dir_all(&img_dir).map_err(|source| RenderError::CreateDir { path: img_dir.clone(), source })?;

    let mut episodes = Vec::new();
    let mut bad = Vec::new();
    for (line, parsed) in lines {
        match parsed {
            Ok(ep) => episodes.push((line, ep)),
            Err(reason) => bad.push((line, reason)),
        }
    }
    let mut used = HashSet::from(["index".to_owned()]);
    let names: Vec<String> =
        episodes.iter().map(|(_, ep)| unique_name(&sanitise(&ep.id, "episode"), &mut used)).collect();

    let mut store = ImageStore { dir: img_dir, shots: HashMap::new(), used: HashSet::new(), copied: 0 };
    let mut missing_images = 0;
    let bar = indicatif::ProgressBar::new(episodes.len() as u64);
    for (i, (line, ep)) in episodes.iter().enumerate() {
        let nav = Nav { prev: i.checked_sub(1).map(|j| names[j].as_str()), next: names.get(i + 1).map(String::as_str) };
        let shots = ep.steps.iter().map(|s| store.place(&base, &s.screenshot)).collect::<Result<Vec<_>, _>>()?;
        missing_images += shots.iter().filter(|s| matches!(s, Shot::Missing(_))).count();
        let html = episode_page(ep, *line, &shots, &nav, language);
        write(&out.join(format!("{}.html", names[i])), &html)?;
        bar.inc(1);
    }
    bar.finish_and_clear();

    let index = out.join("index.html");
    write(&index, &index_page(path, &episodes, &names, &bad))?;
    tracing::info!(pages = episodes.len(), images = store.copied, missing_images, bad_lines = bad.len(), "rendered");
    Ok(RenderReport { pages: episodes.len(), index, images: store.copied, missing_images, bad_lines: bad.len() })
}

fn write(path: &Path, text: &str) -> Result<(), RenderError> {
    std::fs::write(path, text).map_err(|source| RenderError::Write { path: path.into(), source })
}

/// Escapes text for HTML content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// A file-name-safe version of `s`: ASCII letters, digits, `-`, `_` and inner `.` kept, the rest `_`,
/// at most 100 characters (a long name loses the end of its stem, not its extension); `fallback` when
/// nothing is left.
pub fn sanitise(s: &str, fallback: &str) -> String {
    const MAX: usize = 100;
    let mut out: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' }).collect();
    if out.len() > MAX {
        let ext = match out.rfind('.') {
            Some(i) if out.len() - i <= 10 => out[i..].to_owned(),
            _ => String::new(),
        };
        out.truncate(MAX - ext.len());
        out.push_str(&ext);
    }
    if out.starts_with('.') {
        out.replace_range(..1, "_");
    }
    if out.trim_matches('_').is_empty() {
        fallback.to_owned()
    } else {
        out
    }
}

/// `name`, or `name-2`, `name-3`... (before the extension) so that no two files collide, also on
/// case-insensitive file systems.
fn unique_name(name: &str, used: &mut HashSet<String>) -> String {
    let (stem, ext) = match name.rfind('.') {
        Some(i) if i > 0 => name.split_at(i),
        _ => (name, ""),
    };
    let mut candidate = name.to_owned();
    let mut n = 2;
    while !used.insert(candidate.to_lowercase()) {
        candidate = format!("{stem}-{n}{ext}");
        n += 1;
    }
    candidate
}

/// A step's screenshot as the page shows it.
#[derive(Debug, Clone)]
enum Shot {
    /// `src` relative to the page, and the size read from the file.
    Copied { src: String, width: u32, height: u32 },
    /// Why there is no image (shown in the placeholder).
    Missing(String),
}

/// Copies each distinct screenshot once into `dir` under a unique name.
struct ImageStore {
    dir: PathBuf,
    shots: HashMap<PathBuf, Shot>,
    used: HashSet<String>,
    copied: usize,
}

impl ImageStore {
    fn place(&mut self, base: &Path, rel: &str) -> Result<Shot, RenderError> {
        let from = resolve(base, rel);
        if let Some(shot) = self.shots.get(&from) {
            return Ok(shot.clone());
        }
        let shot = match image::image_dimensions(&from) {
            Err(_) if !from.is_file() => Shot::Missing(format!("screenshot missing: {rel}")),
            Err(e) => Shot::Missing(format!("screenshot unreadable: {rel} ({e})")),
            Ok((width, height)) => {
                // The path's last three parts joined, so `a/0.png` and `b/0.png` keep apart and stay
                // readable, and an absolute path does not spell out the machine's folders.
                let parts: Vec<String> = Path::new(rel)
                    .components()
                    .filter_map(|c| match c {
                        Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                        _ => None,
                    })
                    .collect();
                let joined = parts[parts.len().saturating_sub(3)..].join("_");
                let name = unique_name(&sanitise(&joined, "image"), &mut self.used);
                let to = self.dir.join(&name);
                if !same_file(&from, &to) {
                    std::fs::copy(&from, &to).map_err(|source| RenderError::Copy { from: from.clone(), to, source })?;
                }
                self.copied += 1;
                Shot::Copied { src: format!("img/{name}"), width, height }
            }
        };
        self.shots.insert(from, shot.clone());
        Ok(shot)
    }
}

/// True when both paths name one existing file (copying a file onto itself would empty it).
fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

struct Nav<'a> {
    prev: Option<&'a str>,
    next: Option<&'a str>,
}

const CSS: &str = "
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; padding: 16px 24px; max-width: 1400px; color: #1b1b1b; }
a { color: #1565c0; }
nav { margin-bottom: 8px; }
h1 { font-size: 20px; margin: 4px 0; word-break: break-all; }
h2 { font-size: 16px; margin: 0 0 6px; }
.meta { color: #555; margin: 0 0 10px; }
.task { padding: 8px 12px; border-radius: 6px; background: #f1f3f4; margin: 6px 0; max-width: 1000px; }
.task.ambiguous { background: #fff8e1; }
.label { display: inline-block; min-width: 150px; font-weight: 600; color: #444; }
.legend { margin: 10px 0 4px; color: #333; }
.legend span { margin-right: 14px; white-space: nowrap; }
.legend i { display: inline-block; width: 11px; height: 11px; border-radius: 50%; margin-right: 4px; vertical-align: -1px; }
.step { display: flex; gap: 24px; padding: 16px 0; border-top: 1px solid #ddd; align-items: flex-start; }
.shot { position: relative; flex: none; max-width: 100%; background: #222; box-shadow: 0 1px 4px rgba(0,0,0,.35); }
.shot img, .shot svg, .shot .missing { position: absolute; left: 0; top: 0; width: 100%; height: 100%; }
.shot .missing { display: flex; align-items: center; justify-content: center; text-align: center; box-sizing: border-box;
  padding: 12px; color: #ddd; background: repeating-linear-gradient(45deg, #333, #333 12px, #3c3c3c 12px, #3c3c3c 24px);
  font-weight: 600; word-break: break-all; }
.info { flex: 1; min-width: 280px; }
.instruction { font-size: 15px; margin: 0 0 6px; }
.flags { color: #555; margin: 0 0 8px; }
.flags b { color: #b26a00; }
.dialogue { margin: 10px 0; max-width: 640px; }
.bubble { border-radius: 10px; padding: 8px 12px; margin: 6px 0; border: 2px solid; }
.bubble.ask { background: #fff3e0; border-color: #fb8c00; margin-right: 48px; }
.bubble.say { background: #e8f5e9; border-color: #43a047; margin-left: 48px; }
.who { display: inline-block; font-weight: 700; font-size: 12px; letter-spacing: .05em; color: #fff; border-radius: 4px;
  padding: 1px 6px; margin-right: 8px; }
.ask .who { background: #e65100; }
.say .who { background: #2e7d32; }
.bubble ul { margin: 4px 0 0; padding-left: 22px; }
.muted { color: #666; }
pre.action { background: #263238; color: #eceff1; padding: 8px 10px; border-radius: 6px; white-space: pre-wrap;
  word-break: break-all; margin: 6px 0; max-width: 640px; }
.warn { color: #b71c1c; font-weight: 600; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid #ddd; padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: #f1f3f4; position: sticky; top: 0; }
td.num { text-align: right; }
td.ask { white-space: nowrap; }
";

/// Colour of each drawn action kind (the page legend lists them).
fn colour(action: &str) -> &'static str {
    match action {
        "click" => "#e53935",
        "long_press" => "#fb8c00",
        "double_click" => "#8e24aa",
        "right_click" => "#1e88e5",
        "swipe" => "#43a047",
        "drag" => "#6d4c41",
        "scroll" => "#fdd835",
        _ => "#9e9e9e",
    }
}

const ELEMENT: &str = "#00acc1";
const TARGET_ELEMENT: &str = "#00e5ff";

fn head(title: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n<style>{CSS}</style>\n</head>\n<body>\n",
        escape(title)
    )
}

fn index_page(path: &Path, episodes: &[(usize, Episode)], names: &[String], bad: &[(usize, String)]) -> String {
    let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
    let mut h = head(&format!("{file}: episodes"));
    let steps: usize = episodes.iter().map(|(_, e)| e.steps.len()).sum();
    let ambiguous = episodes.iter().filter(|(_, e)| e.is_ambiguous()).count();
    let _ = writeln!(h, "<h1>{}</h1>", escape(&file));
    let _ = writeln!(
        h,
        "<p class=\"meta\">{}, {}, {ambiguous} ambiguous, {}</p>",
        crate::plural(episodes.len(), "episode"),
        crate::plural(steps, "step"),
        crate::plural(bad.len(), "bad line")
    );
    if !bad.is_empty() {
        h.push_str(
            "<p class=\"warn\">Lines that are not episodes (run <code>askgui-data validate</code>):</p>\n<ul>\n",
        );
        for (line, reason) in bad {
            let _ = writeln!(h, "<li>line {line}: {}</li>", escape(reason));
        }
        h.push_str("</ul>\n");
    }
    h.push_str(
        "<table>\n<tr><th>#</th><th>id</th><th>platform</th><th>task</th><th>ambiguous task</th><th>steps</th><th>ask</th></tr>\n",
    );
    for (i, ((line, ep), name)) in episodes.iter().zip(names).enumerate() {
        let ask = match ep.first_ask_step() {
            Some(s) => format!("<a href=\"{name}.html#step-{s}\">yes, step {s}</a>"),
            None => "<span class=\"muted\">no</span>".into(),
        };
        let ambiguous = match &ep.ambiguous_task {
            Some(a) => escape(a),
            None => "<span class=\"muted\">none</span>".into(),
        };
        let _ = writeln!(
            h,
            "<tr title=\"line {line}\"><td class=\"num\">{i}</td><td><a href=\"{name}.html\">{}</a></td><td>{}</td>\
             <td>{}</td><td>{ambiguous}</td><td class=\"num\">{}</td><td class=\"ask\">{ask}</td></tr>",
            escape(&ep.id),
            platform(ep),
            escape(&ep.task),
            ep.steps.len()
        );
    }
    h.push_str("</table>\n</body>\n</html>\n");
    h
}

fn platform(ep: &Episode) -> String {
    serde_json::to_value(ep.platform).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
}

fn episode_page(ep: &Episode, line: usize, shots: &[Shot], nav: &Nav, language: ActionLanguage) -> String {
    let mut h = head(&ep.id);
    h.push_str("<nav><a href=\"index.html\">index</a>");
    if let Some(p) = nav.prev {
        let _ = write!(h, " · <a href=\"{p}.html\">← previous</a>");
    }
    if let Some(n) = nav.next {
        let _ = write!(h, " · <a href=\"{n}.html\">next →</a>");
    }
    h.push_str("</nav>\n");
    let _ = writeln!(h, "<h1>{}</h1>", escape(&ep.id));
    let _ = writeln!(
        h,
        "<p class=\"meta\">{} · screen {}x{} · {} steps · line {line}</p>",
        platform(ep),
        ep.screen.width,
        ep.screen.height,
        ep.steps.len()
    );
    let _ = writeln!(h, "<div class=\"task\"><span class=\"label\">Task</span>{}</div>", escape(&ep.task));
    match &ep.ambiguous_task {
        Some(a) => {
            let _ = writeln!(
                h,
                "<div class=\"task ambiguous\"><span class=\"label\">Ambiguous task</span>{}</div>",
                escape(a)
            );
        }
        None => h.push_str("<div class=\"task muted\"><span class=\"label\">Ambiguous task</span>none</div>\n"),
    }
    h.push_str("<div class=\"legend\">");
    for name in ["click", "long_press", "double_click", "right_click", "swipe", "drag", "scroll"] {
        let _ = write!(h, "<span><i style=\"background:{}\"></i>{name}</span>", colour(name));
    }
    let _ = write!(h, "<span><i style=\"background:{TARGET_ELEMENT};border-radius:0\"></i>target element</span>");
    let _ = write!(h, "<span><i style=\"border:1px solid {ELEMENT};border-radius:0\"></i>elements</span>");
    h.push_str("</div>\n");
    for (i, (step, shot)) in ep.steps.iter().zip(shots).enumerate() {
        step_section(&mut h, ep, i, step, shot, language);
    }
    h.push_str("</body>\n</html>\n");
    h
}

/// On-page width of a screenshot: portrait screens narrower than landscape ones so both stay readable.
fn display_width(w: u32, h: u32) -> u32 {
    let side = if h > w { 400 } else { 640 };
    side.min(w.max(1) * 2)
}

fn step_section(h: &mut String, ep: &Episode, i: usize, step: &Step, shot: &Shot, language: ActionLanguage) {
    let (w, hh) = (ep.screen.width.max(1), ep.screen.height.max(1));
    let disp = display_width(w, hh);
    let _ = writeln!(h, "<section class=\"step\" id=\"step-{i}\">");
    let _ = writeln!(h, "<div class=\"shot\" style=\"width:{disp}px;aspect-ratio:{w} / {hh}\">");
    match shot {
        Shot::Copied { src, .. } => {
            let _ = writeln!(h, "<img src=\"{}\" alt=\"step {i} screenshot\" loading=\"lazy\">", escape(src));
        }
        Shot::Missing(why) => {
            let _ = writeln!(h, "<div class=\"missing\">{}</div>", escape(why));
        }
    }
    // User units per CSS pixel, so strokes and rings have the same on-page size on every screen.
    let k = w as f64 / disp as f64;
    h.push_str(&overlay(step, w, hh, k));
    h.push_str("</div>\n<div class=\"info\">\n");
    let _ = writeln!(h, "<h2>Step {i} <span class=\"muted\">· {}</span></h2>", step.action.name());
    if let Some(ins) = &step.instruction {
        let _ = writeln!(h, "<p class=\"instruction\">{}</p>", escape(ins));
    }
    let informative = match step.informative {
        Some(true) => "<b>informative</b>",
        Some(false) => "not informative",
        None => "informative: not marked",
    };
    let elements = step.elements.as_ref().map_or("no element list".to_owned(), |e| format!("{} elements", e.len()));
    let _ = writeln!(h, "<p class=\"flags\">{informative} · {elements}</p>");
    if let Some(ask) = &step.ask {
        h.push_str("<div class=\"dialogue\">\n<div class=\"bubble ask\"><span class=\"who\">ASK</span>");
        h.push_str(&escape(&ask.question));
        if let Some(kind) = ask.kind {
            let _ = write!(h, " <span class=\"muted\">({})</span>", format!("{kind:?}").to_lowercase());
        }
        if !ask.options.is_empty() {
            h.push_str("<ul>");
            for o in &ask.options {
                let _ = write!(h, "<li>{}", escape(&o.label));
                if let Some(d) = &o.detail {
                    let _ = write!(h, " <span class=\"muted\">— {}</span>", escape(d));
                }
                h.push_str("</li>");
            }
            h.push_str("</ul>");
        }
        let _ = writeln!(
            h,
            "</div>\n<div class=\"bubble say\"><span class=\"who\">SAY</span>{}</div>\n</div>",
            escape(&ask.answer)
        );
    }
    match language.render(&step.action) {
        Ok(text) => {
            let _ = writeln!(h, "<pre class=\"action\">{}</pre>", escape(&text));
        }
        Err(e) => {
            let _ = writeln!(h, "<pre class=\"action\">{}</pre>", escape(&step.action.render()));
            let _ = writeln!(h, "<p class=\"warn\">{}</p>", escape(&e.to_string()));
        }
    }
    if let Some(el) = target_element(step) {
        let _ = writeln!(
            h,
            "<p class=\"muted\">target element <code>{}</code> {} {} {:?}</p>",
            escape(&el.id),
            escape(&el.role),
            escape(&el.text),
            el.bbox
        );
    }
    if let Shot::Copied { width, height, .. } = shot {
        if (*width, *height) != (ep.screen.width, ep.screen.height) {
            let _ = writeln!(
                h,
                "<p class=\"warn\">image is {width}x{height} but the screen is {}x{}: the overlay may be misplaced</p>",
                ep.screen.width, ep.screen.height
            );
        }
    }
    h.push_str("</div>\n</section>\n");
}

/// The element the step's click-like action names, else the smallest element containing its point.
fn target_element(step: &Step) -> Option<&Element> {
    let els = step.elements.as_ref()?;
    let t = step.action.target()?;
    if let Some(id) = &t.element {
        if let Some(e) = els.iter().find(|e| &e.id == id) {
            return Some(e);
        }
    }
    let (x, y) = t.xy()?;
    els.iter().filter(|e| e.contains(x, y)).min_by_key(|e| {
        let [x1, y1, x2, y2] = e.bbox;
        (x2 - x1) as i64 * (y2 - y1) as i64
    })
}

/// A number for SVG attributes: integers as they are, others with one decimal.
fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e9 {
        format!("{}", v as i64)
    } else {
        format!("{v:.1}")
    }
}

/// The SVG overlay of one step in screen pixels (`viewBox` = the screen); `k` is user units per CSS pixel.
fn overlay(step: &Step, w: u32, h: u32, k: f64) -> String {
    let mut s =
        format!("<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {w} {h}\" preserveAspectRatio=\"none\">\n");
    let target = target_element(step);
    if let Some(els) = &step.elements {
        for e in els {
            let is_target = target.is_some_and(|t| std::ptr::eq(t, e));
            let [x1, y1, x2, y2] = e.bbox;
            let style = if is_target {
                format!(
                    "fill=\"{TARGET_ELEMENT}\" fill-opacity=\"0.18\" stroke=\"{TARGET_ELEMENT}\" stroke-width=\"{}\"",
                    num(2.5 * k)
                )
            } else {
                format!("fill=\"none\" stroke=\"{ELEMENT}\" stroke-opacity=\"0.85\" stroke-width=\"{}\"", num(k))
            };
            let _ = writeln!(
                s,
                "<rect class=\"{}\" x=\"{x1}\" y=\"{y1}\" width=\"{}\" height=\"{}\" {style}><title>{}</title></rect>",
                if is_target { "element target" } else { "element" },
                x2 - x1,
                y2 - y1,
                escape(&format!("{} {} {}", e.id, e.role, e.text).replace("  ", " "))
            );
        }
    }
    let name = step.action.name();
    let c = colour(name);
    match &step.action {
        Action::Click(t) | Action::LongPress(t) | Action::DoubleClick(t) | Action::RightClick(t) => {
            let point = t.xy().or_else(|| target.map(Element::center));
            if let Some((x, y)) = point {
                ring(&mut s, x, y, 14.0 * k, c, k, name);
                if matches!(step.action, Action::DoubleClick(_)) {
                    ring(&mut s, x, y, 8.0 * k, c, k, name);
                }
                let _ = writeln!(
                    s,
                    "<circle class=\"dot\" cx=\"{x}\" cy=\"{y}\" r=\"{}\" fill=\"{c}\" stroke=\"#fff\" stroke-width=\"{}\"/>",
                    num(4.0 * k),
                    num(k)
                );
            }
        }
        Action::Swipe(g) | Action::Drag(g) => {
            arrow(&mut s, (g.x1 as f64, g.y1 as f64), (g.x2 as f64, g.y2 as f64), c, k, name);
        }
        Action::Scroll { x, y, direction } => {
            let (fx, fy) = match (x, y) {
                (Some(x), Some(y)) => (*x as f64, *y as f64),
                _ => (w as f64 / 2.0, h as f64 / 2.0),
            };
            let (dx, dy) = match direction {
                Direction::Up => (0.0, -0.2 * h as f64),
                Direction::Down => (0.0, 0.2 * h as f64),
                Direction::Left => (-0.2 * w as f64, 0.0),
                Direction::Right => (0.2 * w as f64, 0.0),
            };
            arrow(&mut s, (fx, fy), (fx + dx, fy + dy), c, k, name);
        }
        _ => {}
    }
    s.push_str("</svg>\n");
    s
}

/// A ring with a white halo so it shows on dark and light screens alike.
fn ring(s: &mut String, x: i32, y: i32, r: f64, c: &str, k: f64, title: &str) {
    let _ = writeln!(
        s,
        "<circle class=\"halo\" cx=\"{x}\" cy=\"{y}\" r=\"{r}\" fill=\"none\" stroke=\"#fff\" stroke-width=\"{}\"/>\n\
         <circle class=\"ring\" cx=\"{x}\" cy=\"{y}\" r=\"{r}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"{}\"><title>{title}</title></circle>",
        num(5.0 * k),
        num(3.0 * k),
        r = num(r)
    );
}

/// A line from `a` to `b` ending in a filled head at `b`, with a dot at `a`.
fn arrow(s: &mut String, a: (f64, f64), b: (f64, f64), c: &str, k: f64, title: &str) {
    let (dx, dy) = (b.0 - a.0, b.1 - a.1);
    let len = (dx * dx + dy * dy).sqrt();
    let _ = writeln!(
        s,
        "<circle class=\"start\" cx=\"{}\" cy=\"{}\" r=\"{}\" fill=\"{c}\" stroke=\"#fff\" stroke-width=\"{}\"/>",
        num(a.0),
        num(a.1),
        num(5.0 * k),
        num(k)
    );
    if len < 1.0 {
        return;
    }
    let (ux, uy) = (dx / len, dy / len);
    let head = (18.0 * k).min(len);
    let (bx, by) = (b.0 - ux * head, b.1 - uy * head);
    let (nx, ny) = (-uy * 9.0 * k, ux * 9.0 * k);
    for (colour, width) in [("#fff", 6.0), (c, 3.5)] {
        let _ = writeln!(
            s,
            "<line class=\"arrow\" x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"{colour}\" stroke-width=\"{}\" stroke-linecap=\"round\"/>",
            num(a.0),
            num(a.1),
            num(bx),
            num(by),
            num(width * k)
        );
    }
    let _ = writeln!(
        s,
        "<polygon class=\"arrowhead\" points=\"{},{} {},{} {},{}\" fill=\"{c}\" stroke=\"#fff\" stroke-width=\"{}\" stroke-linejoin=\"round\"><title>{title}</title></polygon>",
        num(b.0),
        num(b.1),
        num(bx + nx),
        num(by + ny),
        num(bx - nx),
        num(by - ny),
        num(k)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(escape("<b>\"a\" & 'b'</b>"), "&lt;b&gt;&quot;a&quot; &amp; &#39;b&#39;&lt;/b&gt;");
    }

    #[test]
    fn sanitised_names_are_safe_and_unique() {
        assert_eq!(sanitise("../etc/passwd", "x"), "_._etc_passwd");
        assert_eq!(sanitise("///", "episode"), "episode");
        let long = sanitise(&format!("{}.jpeg", "a".repeat(200)), "x");
        assert_eq!((long.len(), long.ends_with("a.jpeg")), (100, true));
        let mut used = HashSet::from(["index".to_owned()]);
        assert_eq!(unique_name("Index", &mut used), "Index-2");
        assert_eq!(unique_name("a.png", &mut used), "a.png");
        assert_eq!(unique_name("A.png", &mut used), "A-2.png");
    }

    #[test]
    fn numbers_are_compact() {
        assert_eq!(num(540.0), "540");
        assert_eq!(num(2.26), "2.3");
    }
}
