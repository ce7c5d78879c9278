//! Reports of a run: `report.json` (every metric), `report.md` (a table in the shape of Navi-plus Table 1,
//! plus Morae's strict counts) and two SVG plots drawn by hand (no plotting crate): step accuracy by step
//! index per mode, and the histogram of (predicted ASK step - annotated ASK step).
//!
//! A number that does not exist (zero denominator, mode that does not score asks) is "–"; a metric that
//! could not be computed (missing model or data) is "n/a" with its reason in a note, never 0.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::ask_behaviour::AskBehaviour;
use crate::identity::{Decoding, RunIdentity};
use crate::matching::MatchConfig;
use crate::metrics::{Metric, ModeMetrics};
use crate::modes::Mode;

#[derive(Debug, Error)]
pub enum ReportError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// The files [`write_report`] writes.
pub const REPORT_FILES: [&str; 5] =
    ["report.json", "report.md", "step_accuracy.svg", "ask_offset.svg", "ask_behaviour.svg"];

/// Everything `report.json` holds.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Report {
    /// The agent's short name.
    pub agent: String,
    /// Who answered and how the answers were scored (also the results folder's `identity.json`).
    pub identity: RunIdentity,
    pub episodes_file: String,
    pub matching: MatchConfig,
    pub modes: Vec<ModeMetrics>,
}

impl Report {
    pub fn mode(&self, mode: Mode) -> Option<&ModeMetrics> {
        self.modes.iter().find(|m| m.mode == mode)
    }
}

/// Writes [`REPORT_FILES`] into `dir`; returns their paths.
pub fn write_report(dir: &Path, report: &Report) -> Result<Vec<PathBuf>, ReportError> {
    let json = serde_json::to_string_pretty(report).unwrap_or_default();
    let texts = [
        json + "\n",
        markdown(report),
        step_accuracy_svg(&report.modes),
        ask_offset_svg(report),
        ask_behaviour_svg(&report.modes),
    ];
    let mut out = Vec::new();
    for (name, text) in REPORT_FILES.into_iter().zip(texts) {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|source| ReportError::Io { path: path.clone(), source })?;
        out.push(path);
    }
    Ok(out)
}

fn pct(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{:.1}", 100.0 * v))
}

fn frac(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.3}"))
}

/// A content metric's cell; unavailable reasons are collected as notes.
fn metric_cell(m: Option<&Metric>, notes: &mut Vec<String>) -> String {
    match m {
        None => "–".into(),
        Some(Metric::Value(v)) => format!("{v:.3}"),
        Some(Metric::Unavailable(reason)) => {
            let n = match notes.iter().position(|r| r == reason) {
                Some(i) => i + 1,
                None => {
                    notes.push(reason.clone());
                    notes.len()
                }
            };
            format!("n/a[^{n}]")
        }
    }
}

/// The decoding in words, e.g. `greedy, at most 128 new tokens`.
fn decoding_text(d: &Decoding) -> String {
    let mut parts = vec![match d.temperature {
        Some(0.0) => "greedy".to_string(),
        Some(t) => format!("temperature {t}"),
        None => "the agent's own temperature".to_string(),
    }];
    if let Some(n) = d.max_new_tokens {
        parts.push(format!("at most {n} new tokens"));
    }
    if let Some(seed) = d.seed {
        parts.push(format!("seed {seed}"));
    }
    if d.constrain == Some(true) {
        parts.push("constrained to the action schema".into());
    }
    if let Some(p) = d.pause_threshold {
        parts.push(format!("pause threshold {p}"));
    }
    parts.join(", ")
}

/// `rate (needless / tasks)`, or "–".
fn task_fpr_cell(m: &ModeMetrics) -> String {
    m.task_fpr.as_ref().map_or("–".into(), |t| format!("{} ({}/{})", frac(t.rate), t.needless, t.tasks))
}

/// Morae's strict table: the outcomes, precision, recall, F1 and task success (§5.1), and the per-task
/// ask FPR.
fn strict_section(s: &mut String, m: &ModeMetrics, notes: &mut Vec<String>) {
    let _ = writeln!(s, "## Strict task-level pausing (Morae)\n");
    let _ = writeln!(
        s,
        "| TP | FP early | FP spurious | FN missed | FN late | FN off path | TN | failed, no pause | precision | \
         recall | F1 | task success | pause required | no pause | ask FPR per task | CosSim | METEOR |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let c = m.strict.clone().unwrap_or_default();
    let a = m.ask.as_ref();
    let content = m.content.as_ref();
    let _ = writeln!(
        s,
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
        c.tp,
        c.fp_early,
        c.fp_spurious,
        c.fn_missed,
        c.fn_late,
        c.fn_off_path,
        c.tn,
        c.failed_unpaused,
        frac(a.and_then(|a| a.precision)),
        frac(a.and_then(|a| a.recall)),
        frac(a.and_then(|a| a.f1)),
        pct(m.sr),
        pct(m.sr_pause_required),
        pct(m.sr_no_pause),
        task_fpr_cell(m),
        metric_cell(content.map(|c| &c.cosine), notes),
        metric_cell(content.map(|c| &c.meteor), notes),
    );
}

/// The Markdown report.
pub fn markdown(report: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# askgui-eval report\n");
    let _ = writeln!(s, "Agent: `{}`; episodes: `{}`.\n", report.agent, report.episodes_file);
    let agent = &report.identity.agent;
    if let Some(adapter) = &agent.adapter {
        let fingerprint = agent.adapter_fingerprint.as_ref().map_or(String::new(), |f| format!(" ({f})"));
        let _ = writeln!(s, "Adapter: `{adapter}`{fingerprint}.\n");
    }
    let _ = writeln!(s, "Decoding: {}. The full identity is in `report.json`.\n", decoding_text(&agent.decoding));
    let mut notes = Vec::new();
    let rows: Vec<&ModeMetrics> = Mode::TABLE.iter().filter_map(|m| report.mode(*m)).collect();
    if !rows.is_empty() {
        let _ = writeln!(
            s,
            "| Setting | SSR | SR | SSR before ASK | SSR after ASK | ASK precision | FPR | F1 | CosSim | METEOR |"
        );
        let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
        for m in rows {
            let ask = m.ask.as_ref();
            let content = m.content.as_ref();
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                m.mode.row_label(),
                pct(m.ssr),
                pct(m.sr),
                pct(m.ssr_before),
                pct(m.ssr_after),
                frac(ask.and_then(|a| a.precision)),
                frac(ask.and_then(|a| a.fpr)),
                frac(ask.and_then(|a| a.f1)),
                metric_cell(content.map(|c| &c.cosine), &mut notes),
                metric_cell(content.map(|c| &c.meteor), &mut notes),
            );
        }
        let _ = writeln!(
            s,
            "\nNavi-plus Appendix F: SSR and SSR before/after are per-episode means, in %; ASK metrics as \
             fractions, the FPR per step. Rows and definitions: eval/README.md.\n"
        );
        let _ = writeln!(s, "| Setting | SSR pooled | before pooled | after pooled | ASK recall | ask FPR per task |");
        let _ = writeln!(s, "|---|---|---|---|---|---|");
        for m in Mode::TABLE.iter().filter_map(|m| report.mode(*m)) {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} |",
                m.mode.row_label(),
                pct(m.ssr_pooled),
                pct(m.ssr_before_pooled),
                pct(m.ssr_after_pooled),
                frac(m.ask.as_ref().and_then(|a| a.recall)),
                task_fpr_cell(m),
            );
        }
        let _ = writeln!(s, "\nPooled: right steps / steps over all episodes (not the papers' definition).\n");
    }
    if let Some(m) = report.mode(Mode::Strict) {
        strict_section(&mut s, m, &mut notes);
    }
    ask_behaviour_section(&mut s, &report.modes);
    let _ = writeln!(s, "## Counts\n");
    let _ = writeln!(
        s,
        "| Mode | episodes | empty episodes (left out) | steps | ASK TP | FP | FN | TN | ASK pairs scored |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for m in &report.modes {
        let c = m.ask.as_ref().map(|a| a.counts);
        let cell = |f: fn(&crate::modes::Counts) -> usize| c.as_ref().map_or("–".to_string(), |c| f(c).to_string());
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            m.mode,
            m.episodes,
            m.empty_episodes,
            m.steps,
            cell(|c| c.tp),
            cell(|c| c.fp),
            cell(|c| c.fn_),
            cell(|c| c.tn),
            m.content.as_ref().map_or("–".to_string(), |c| c.pairs.to_string()),
        );
    }
    if !notes.is_empty() {
        let _ = writeln!(s);
        for (i, n) in notes.iter().enumerate() {
            let _ = writeln!(s, "[^{}]: unavailable: {}", i + 1, n.replace('\n', " "));
        }
    }
    s
}

pub(crate) const W: f64 = 640.0;
pub(crate) const H: f64 = 400.0;
pub(crate) const LEFT: f64 = 60.0;
pub(crate) const RIGHT: f64 = 150.0;
pub(crate) const TOP: f64 = 40.0;
pub(crate) const BOTTOM: f64 = 50.0;
pub(crate) const COLORS: [&str; 5] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"];

pub(crate) fn svg_open(title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{W}\" height=\"{H}\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        W / 2.0,
        escape(title)
    )
}

pub(crate) fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Axes with a y range `0..=y_max` (ticks at fifths) and x labels given by the caller.
pub(crate) fn axes(s: &mut String, y_max: f64, y_label: &str, x_label: &str, y_fmt: impl Fn(f64) -> String) {
    let (x0, y0, x1, y1) = (LEFT, H - BOTTOM, W - RIGHT, TOP);
    let _ = writeln!(s, "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\" stroke=\"black\"/>");
    let _ = writeln!(s, "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x0}\" y2=\"{y1}\" stroke=\"black\"/>");
    for k in 0..=5 {
        let v = y_max * f64::from(k) / 5.0;
        let y = y0 - (y0 - y1) * f64::from(k) / 5.0;
        let _ = writeln!(s, "<line x1=\"{x0}\" y1=\"{y:.1}\" x2=\"{x1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>");
        let _ = writeln!(s, "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>", x0 - 6.0, y + 4.0, y_fmt(v));
    }
    let _ = writeln!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
        (x0 + x1) / 2.0,
        H - 12.0,
        escape(x_label)
    );
    let _ = writeln!(
        s,
        "<text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{}</text>",
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0,
        escape(y_label)
    );
}

/// Step accuracy by step index, one line per mode (Strict: over the steps its walk reached).
pub fn step_accuracy_svg(modes: &[ModeMetrics]) -> String {
    let mut s = svg_open("Step accuracy by step index");
    axes(&mut s, 1.0, "step accuracy", "step index", |v| format!("{v:.1}"));
    let n = modes.iter().map(|m| m.step_accuracy.len()).max().unwrap_or(0);
    if n == 0 {
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">no steps</text>", W / 2.0, H / 2.0);
    }
    let (x0, y0, x1, y1) = (LEFT, H - BOTTOM, W - RIGHT, TOP);
    let x_of =
        |i: usize| if n <= 1 { (x0 + x1) / 2.0 } else { x0 + 10.0 + (x1 - x0 - 20.0) * i as f64 / (n - 1) as f64 };
    let label_every = n.div_ceil(12).max(1);
    for i in (0..n).step_by(label_every) {
        let _ = writeln!(s, "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{i}</text>", x_of(i), y0 + 16.0);
    }
    for (k, m) in modes.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64)> = m
            .step_accuracy
            .iter()
            .filter(|a| a.total > 0)
            .map(|a| (x_of(a.step), y0 - (y0 - y1) * a.correct as f64 / a.total as f64))
            .collect();
        let poly: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            poly.join(" ")
        );
        for (x, y) in &pts {
            let _ = writeln!(s, "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3\" fill=\"{color}\"/>");
        }
        let ly = TOP + 10.0 + 18.0 * k as f64;
        let _ = writeln!(
            s,
            "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"/>",
            x1 + 12.0,
            x1 + 32.0
        );
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\">{}</text>", x1 + 38.0, ly + 4.0, escape(m.mode.row_label()));
    }
    s.push_str("</svg>\n");
    s
}

/// The histogram of (first predicted ASK step - annotated ASK step), from the Dual-Stream run when there
/// is one (its first stream has ground-truth history at every step), else Standard, else Strict.
pub fn ask_offset_svg(report: &Report) -> String {
    let source = [Mode::Dual, Mode::Standard, Mode::Strict].into_iter().find_map(|m| report.mode(m));
    let title = match source {
        Some(m) => format!("Predicted - annotated ASK step ({})", m.mode),
        None => "Predicted - annotated ASK step".to_string(),
    };
    let mut s = svg_open(&title);
    let offsets: &[i64] = source.map_or(&[], |m| &m.ask_offsets);
    let (lo, hi) =
        (offsets.iter().copied().min().unwrap_or(0).min(0), offsets.iter().copied().max().unwrap_or(0).max(0));
    let bins = (hi - lo + 1) as usize;
    let mut counts = vec![0usize; bins];
    for &o in offsets {
        counts[(o - lo) as usize] += 1;
    }
    let max = counts.iter().copied().max().unwrap_or(0).max(1);
    let y_max = max.div_ceil(5).max(1) * 5;
    axes(&mut s, y_max as f64, "annotated ASK steps", "offset (negative: early, 0: exact, positive: late)", |v| {
        format!("{v:.0}")
    });
    if offsets.is_empty() {
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">no ASK predicted</text>", W / 2.0, H / 2.0);
    }
    let (x0, y0, x1, y1) = (LEFT, H - BOTTOM, W - RIGHT, TOP);
    let bw = (x1 - x0) / bins as f64;
    let label_every = bins.div_ceil(15).max(1);
    for (i, &c) in counts.iter().enumerate() {
        let off = lo + i as i64;
        let h = (y0 - y1) * c as f64 / y_max as f64;
        let x = x0 + bw * i as f64;
        let color = if off == 0 {
            "#2ca02c"
        } else if off < 0 {
            "#1f77b4"
        } else {
            "#d62728"
        };
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{color}\"><title>{off}: {c}</title></rect>",
            x + bw * 0.1,
            y0 - h,
            bw * 0.8
        );
        if i % label_every == 0 || off == 0 {
            let _ =
                writeln!(s, "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{off}</text>", x + bw / 2.0, y0 + 16.0);
        }
    }
    s.push_str("</svg>\n");
    s
}

/// Asks per task, over-asking and first-ask timing per mode, then the results by details left out.
fn ask_behaviour_section(s: &mut String, modes: &[ModeMetrics]) {
    let rows: Vec<(&ModeMetrics, &AskBehaviour)> =
        modes.iter().filter_map(|m| m.ask_behaviour.as_ref().map(|b| (m, b))).collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(s, "## Ask behaviour\n");
    let _ = writeln!(s, "| Mode | asks per task | over-asking rate | needless asks per ambiguous task | first ask early / exact / late / never |");
    let _ = writeln!(s, "|---|---|---|---|---|");
    let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.3}"));
    for (m, b) in &rows {
        let f = b.first_ask;
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} / {} / {} / {} |",
            m.mode,
            num(b.asks_per_task),
            num(b.over_asking_rate),
            num(b.needless_asks_per_ambiguous_task),
            f.early,
            f.exact,
            f.late,
            f.never
        );
    }
    let _ = writeln!(s, "\n| Mode | details left out | tasks | SR | asks per task | ASK recall |");
    let _ = writeln!(s, "|---|---|---|---|---|---|");
    for (m, b) in &rows {
        for d in &b.by_details {
            let (sr, asks, recall) = (pct(d.sr), num(d.asks_per_task), frac(d.ask_recall));
            let _ = writeln!(s, "| {} | {} | {} | {sr} | {asks} | {recall} |", m.mode, d.details, d.tasks);
        }
    }
    let _ = writeln!(
        s,
        "\nFirst stream (ground-truth history at every step). Over-asking rate: asks per task that needs none. \
         Definitions: eval/README.md.\n"
    );
}

/// Asks per task by the details a task leaves out, one bar per mode that scores asks.
pub fn ask_behaviour_svg(modes: &[ModeMetrics]) -> String {
    let mut s = svg_open("Asks per task by details left out");
    let rows: Vec<(&ModeMetrics, &AskBehaviour)> =
        modes.iter().filter_map(|m| m.ask_behaviour.as_ref().map(|b| (m, b))).collect();
    let details: Vec<usize> = {
        let mut d: Vec<usize> = rows.iter().flat_map(|(_, b)| b.by_details.iter().map(|r| r.details)).collect();
        d.sort_unstable();
        d.dedup();
        d
    };
    // None (no task of that kind): no bar, a "–" where it would stand, never a bar of height 0.
    let value = |b: &AskBehaviour, d: usize| b.by_details.iter().find(|r| r.details == d).and_then(|r| r.asks_per_task);
    let max = rows.iter().flat_map(|(_, b)| details.iter().filter_map(|&d| value(b, d))).fold(0.0, f64::max);
    let y_max = (max * 2.0).ceil().max(1.0) / 2.0;
    axes(&mut s, y_max, "asks per task", "details the task leaves out", |v| format!("{v:.1}"));
    if details.is_empty() {
        let _ =
            writeln!(s, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">no mode scores asks</text>", W / 2.0, H / 2.0);
    }
    let (x0, y0, x1, y1) = (LEFT, H - BOTTOM, W - RIGHT, TOP);
    let group = (x1 - x0) / details.len().max(1) as f64;
    let bw = group * 0.8 / rows.len().max(1) as f64;
    for (gi, &d) in details.iter().enumerate() {
        let gx = x0 + group * gi as f64 + group * 0.1;
        for (k, (m, b)) in rows.iter().enumerate() {
            let Some(v) = value(b, d) else {
                let x = gx + bw * k as f64 + bw * 0.45;
                let _ = writeln!(s, "<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">–</text>", y0 - 4.0);
                continue;
            };
            let h = (y0 - y1) * v / y_max;
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{h:.1}\" fill=\"{}\"><title>{}: {v:.3}</title></rect>",
                gx + bw * k as f64,
                y0 - h,
                bw * 0.9,
                COLORS[k % COLORS.len()],
                m.mode
            );
        }
        let _ =
            writeln!(s, "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{d}</text>", gx + group * 0.4, y0 + 16.0);
    }
    for (k, (m, _)) in rows.iter().enumerate() {
        let y = TOP + 16.0 * k as f64;
        let _ = writeln!(
            s,
            "<rect x=\"{}\" y=\"{y}\" width=\"12\" height=\"12\" fill=\"{}\"/>",
            x1 + 10.0,
            COLORS[k % COLORS.len()]
        );
        let _ = writeln!(s, "<text x=\"{}\" y=\"{}\">{}</text>", x1 + 28.0, y + 10.0, m.mode);
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::AgentIdentity;
    use crate::metrics::{compute, NoContentScorer};

    #[test]
    fn empty_report_renders() {
        let none = NoContentScorer("no model".into());
        let modes: Vec<ModeMetrics> = Mode::ALL.iter().map(|m| compute(*m, &[], &none)).collect();
        let mut agent = AgentIdentity::custom("a<b".into());
        agent.adapter = Some("/adapters/v2".into());
        agent.decoding = Decoding::greedy(16);
        let identity = RunIdentity { agent, matching: MatchConfig::default(), episodes: "x".into() };
        let r = Report {
            agent: "a<b".into(),
            identity,
            episodes_file: "x".into(),
            matching: MatchConfig::default(),
            modes,
        };
        let md = markdown(&r);
        assert!(
            md.contains("Adapter: `/adapters/v2`.") && md.contains("Decoding: greedy, at most 16 new tokens."),
            "{md}"
        );
        assert!(md.contains("| +Dual eval | – | – |"), "{md}");
        assert!(md.contains("n/a[^1]") && md.contains("[^1]: unavailable: no model"), "{md}");
        let svg = ask_offset_svg(&r);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n") && svg.contains("no ASK predicted"));
        assert!(step_accuracy_svg(&r.modes).contains("no steps"));
    }

    #[test]
    fn a_missing_value_is_a_dash_in_the_plot_not_a_bar_of_zero() {
        use crate::ask_behaviour::{AskBehaviour, ByDetails, FirstAsk};
        let none = NoContentScorer("no model".into());
        let row = |details, asks| ByDetails { details, tasks: 1, sr: None, asks_per_task: asks, ask_recall: None };
        let behaviour = |rows| AskBehaviour {
            asks_per_task: None,
            over_asking_rate: None,
            needless_asks_per_ambiguous_task: None,
            by_details: rows,
            first_ask: FirstAsk::default(),
        };
        // +ASK has tasks with 0 and 1 details left out; Dual only with 0: its bar at 1 has no value.
        let mut standard = compute(Mode::Standard, &[], &none);
        standard.ask_behaviour = Some(behaviour(vec![row(0, Some(0.0)), row(1, Some(1.0))]));
        let mut dual = compute(Mode::Dual, &[], &none);
        dual.ask_behaviour = Some(behaviour(vec![row(0, Some(0.0))]));
        let svg = ask_behaviour_svg(&[standard, dual]);
        // Three bars with a value (two of them a true 0.000), one dash.
        assert_eq!(svg.matches("<rect x=").count() - 2, 3, "{svg}"); // less the two legend swatches
        assert_eq!(svg.matches(">–</text>").count(), 1, "{svg}");
        assert_eq!(svg.matches("<title>standard: 0.000</title>").count(), 1, "{svg}");
        assert_eq!(svg.matches("<title>dual: ").count(), 1, "{svg}");
    }
}
