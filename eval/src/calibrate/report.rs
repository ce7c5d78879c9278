//! The calibration's files: `calibration.json`, `calibration.md` (the choice, the reliability tables, the
//! sweep), `reliability.svg` (the reliability diagram before and after temperature scaling) and
//! `pr_curve.svg` (+ASK precision against recall over the thresholds, the chosen one marked).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::{CalibrateError, Calibration, SweepPoint};
use crate::calibration::Reliability;
use crate::report::{axes, escape, svg_open, BOTTOM, COLORS, H, LEFT, RIGHT, TOP, W};

/// The files [`write`] writes.
pub const FILES: [&str; 4] = ["calibration.json", "calibration.md", "reliability.svg", "pr_curve.svg"];

/// Writes [`FILES`] into `dir`; returns their paths.
pub fn write(dir: &Path, c: &Calibration) -> Result<Vec<PathBuf>, CalibrateError> {
    let json = serde_json::to_string_pretty(c).unwrap_or_default() + "\n";
    let texts = [json, markdown(c), reliability_svg(c), pr_svg(c)];
    let mut paths = Vec::new();
    for (name, text) in FILES.iter().zip(texts) {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|source| CalibrateError::Io { path: path.clone(), source })?;
        paths.push(path);
    }
    Ok(paths)
}

fn num(v: Option<f64>) -> String {
    v.map_or_else(|| "–".into(), |v| format!("{v:.3}"))
}

fn reliability_table(s: &mut String, title: &str, r: &Reliability) {
    let _ = writeln!(s, "\n{title}: ECE {}, Brier {}.\n", num(r.ece), num(r.brier));
    let _ = writeln!(s, "| p bin | steps | mean p | needed an ask |\n|---|---|---|---|");
    for b in &r.bins {
        let _ = writeln!(s, "| {:.1}-{:.1} | {} | {} | {} |", b.lo, b.hi, b.count, num(b.mean_p), num(b.rate));
    }
}

/// A threshold to 4 digits, or in scientific notation below 1e-3.
fn threshold(t: f64) -> String {
    if t > 0.0 && t < 1e-3 {
        format!("{t:.2e}")
    } else {
        format!("{t:.4}")
    }
}

fn sweep_row(s: &mut String, p: &SweepPoint) {
    let _ = writeln!(
        s,
        "| {} | {} | {} | {} | {} | {} | {} | {} |",
        threshold(p.threshold),
        num(p.precision),
        num(p.recall),
        num(p.fpr),
        num(p.strict_precision),
        num(p.strict_recall),
        num(p.strict_f1),
        num(p.task_fpr)
    );
}

/// `calibration.md`.
pub fn markdown(c: &Calibration) -> String {
    let mut s = String::from("# Pause-level calibration\n\n");
    let _ = writeln!(s, "Episodes: {} ({}).", c.episodes, c.episodes_file);
    let verdict = if c.bound_met {
        format!("the best strict ASK F1 with a per-step ask FPR of at most {}", c.target_fpr)
    } else {
        format!("no threshold kept the per-step ask FPR within {}: the lowest FPR", c.target_fpr)
    };
    let _ = writeln!(s, "Chosen pause threshold: **{:.4}** ({verdict}).\n", c.threshold);
    let _ = writeln!(
        s,
        "| threshold | +ASK precision | recall | FPR per step | strict precision | recall | F1 | FPR per task |\n\
         |---|---|---|---|---|---|---|---|"
    );
    sweep_row(&mut s, &c.chosen);
    let _ = writeln!(
        s,
        "\nThe agent asks exactly when its `ask_probability` is at least the threshold (askgui-serve's \
         `pause_threshold`). Thresholds tried: {}; strict late-pause checks without a recorded answer at the \
         chosen threshold: {} (they count as no pause; both are false negatives).",
        c.sweep.len(),
        c.chosen.unrecorded
    );
    reliability_table(&mut s, "\n## Reliability of ask_probability (+ASK step decisions)", &c.reliability);
    reliability_table(
        &mut s,
        &format!(
            "\nAfter temperature scaling (T = {:.3}; the same decisions at the matching threshold)",
            c.temperature
        ),
        &c.reliability_scaled,
    );
    let _ = writeln!(s, "\n## Sweep (at most 20 thresholds, evenly spaced over those tried)\n");
    let _ = writeln!(
        s,
        "| threshold | +ASK precision | recall | FPR per step | strict precision | recall | F1 | FPR per task |\n\
         |---|---|---|---|---|---|---|---|"
    );
    let n = c.sweep.len();
    let every = n.div_ceil(20).max(1);
    for (_, p) in c.sweep.iter().enumerate().filter(|(i, _)| i % every == 0 || *i + 1 == n) {
        sweep_row(&mut s, p);
    }
    s
}

/// Maps `[0, 1]` to the plot's x and y.
fn xy(x: f64, y: f64) -> (f64, f64) {
    let (x0, y0, x1, y1) = (LEFT, H - BOTTOM, W - RIGHT, TOP);
    (x0 + (x1 - x0) * x, y0 - (y0 - y1) * y)
}

fn x_ticks(s: &mut String) {
    for k in 0..=5 {
        let v = f64::from(k) / 5.0;
        let (x, y) = xy(v, 0.0);
        let _ = writeln!(s, "<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{v:.1}</text>", y + 16.0);
    }
}

fn legend(s: &mut String, k: usize, color: &str, label: &str) {
    let (x1, ly) = (W - RIGHT, TOP + 10.0 + 18.0 * k as f64);
    let _ = writeln!(s, "<circle cx=\"{}\" cy=\"{ly}\" r=\"4\" fill=\"{color}\"/>", x1 + 22.0);
    let _ = writeln!(s, "<text x=\"{}\" y=\"{}\">{}</text>", x1 + 32.0, ly + 4.0, escape(label));
}

/// The reliability diagram: each bin's positive rate against its mean probability, before and after
/// temperature scaling, with the diagonal of perfect calibration; dot area grows with the bin's count.
pub fn reliability_svg(c: &Calibration) -> String {
    let mut s = svg_open("Reliability of ask_probability");
    axes(&mut s, 1.0, "steps that needed an ask", "mean ask_probability in the bin", |v| format!("{v:.1}"));
    x_ticks(&mut s);
    let ((ax, ay), (bx, by)) = (xy(0.0, 0.0), xy(1.0, 1.0));
    let _ =
        writeln!(s, "<line x1=\"{ax}\" y1=\"{ay}\" x2=\"{bx}\" y2=\"{by}\" stroke=\"#999\" stroke-dasharray=\"4 4\"/>");
    let series = [
        (&c.reliability, format!("raw, ECE {}", num(c.reliability.ece))),
        (&c.reliability_scaled, format!("T={:.2}, ECE {}", c.temperature, num(c.reliability_scaled.ece))),
    ];
    for (k, (r, label)) in series.iter().enumerate() {
        let color = COLORS[k];
        let n = r.decisions.max(1) as f64;
        let pts: Vec<(f64, f64, usize)> = r.bins.iter().filter_map(|b| Some((b.mean_p?, b.rate?, b.count))).collect();
        let poly: Vec<String> = pts.iter().map(|&(x, y, _)| xy(x, y)).map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(s, "<polyline fill=\"none\" stroke=\"{color}\" points=\"{}\"/>", poly.join(" "));
        for (x, y, count) in pts {
            let (px, py) = xy(x, y);
            let radius = 2.5 + 8.0 * (count as f64 / n).sqrt();
            let _ = writeln!(
                s,
                "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"{radius:.1}\" fill=\"{color}\" fill-opacity=\"0.6\">\
                 <title>mean p {x:.3}, rate {y:.3}, {count} steps</title></circle>"
            );
        }
        legend(&mut s, k, color, label);
    }
    s.push_str("</svg>\n");
    s
}

/// +ASK ask precision against recall, a dot per threshold tried (one per pixel); the chosen threshold
/// ringed.
pub fn pr_svg(c: &Calibration) -> String {
    let mut s = svg_open("Asking: precision against recall over pause thresholds (+ASK, per step)");
    axes(&mut s, 1.0, "precision", "recall", |v| format!("{v:.1}"));
    x_ticks(&mut s);
    let mut drawn = std::collections::HashSet::new();
    for p in &c.sweep {
        if let (Some(r), Some(pr)) = (p.recall, p.precision) {
            let (x, y) = xy(r, pr);
            // Thresholds that land on the same pixel are drawn once (thousands share a few pixels).
            if !drawn.insert((x as i64, y as i64)) {
                continue;
            }
            let _ = writeln!(
                s,
                "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2.5\" fill=\"{}\"><title>threshold {:.4}: precision {pr:.3}, \
                 recall {r:.3}, FPR {}</title></circle>",
                COLORS[0],
                p.threshold,
                num(p.fpr)
            );
        }
    }
    if let (Some(r), Some(pr)) = (c.chosen.recall, c.chosen.precision) {
        let (x, y) = xy(r, pr);
        let _ = writeln!(
            s,
            "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"7\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>",
            COLORS[3]
        );
    }
    legend(&mut s, 0, COLORS[0], "a threshold");
    legend(&mut s, 1, COLORS[3], &format!("chosen {:.3}", c.threshold));
    s.push_str("</svg>\n");
    s
}
