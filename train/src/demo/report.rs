//! The demo's report: its scores, the seven checks (calibrated and not), `report.json` (stable keys) and
//! `report.md` (Navi-plus Table 1 for the demo's agents, the checks, the timings and how to serve the
//! result). The checks are stated on the metrics as the papers define them (`docs/demo.md`).

use std::path::{Path, PathBuf};

use askgui_eval::metrics::ModeMetrics;
use serde::Serialize;

use super::DemoArgs;
use crate::error::{io, Result};

/// SSR and SR of one evaluation (Navi-plus Appendix F: per-episode means), with the ASK numbers where the
/// mode scores asks.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Scores {
    pub ssr: Option<f64>,
    pub sr: Option<f64>,
    pub ssr_before: Option<f64>,
    pub ssr_after: Option<f64>,
    /// Right steps / steps over all episodes (not the papers' SSR).
    pub ssr_pooled: Option<f64>,
    pub steps: usize,
    pub episodes: usize,
    pub ask_precision: Option<f64>,
    pub ask_recall: Option<f64>,
    /// Per step: needless asks / steps that need none (Standard, Dual; none in Strict).
    pub ask_fpr: Option<f64>,
    /// Per task: tasks with a needless ask / tasks that need none.
    pub ask_task_fpr: Option<f64>,
    pub ask_f1: Option<f64>,
}

impl From<&ModeMetrics> for Scores {
    fn from(m: &ModeMetrics) -> Self {
        let a = m.ask.as_ref();
        Self {
            ssr: m.ssr,
            sr: m.sr,
            ssr_before: m.ssr_before,
            ssr_after: m.ssr_after,
            ssr_pooled: m.ssr_pooled,
            steps: m.steps,
            episodes: m.episodes,
            ask_precision: a.and_then(|a| a.precision),
            ask_recall: a.and_then(|a| a.recall),
            ask_fpr: a.and_then(|a| a.fpr),
            ask_task_fpr: m.task_fpr.as_ref().and_then(|t| t.rate),
            ask_f1: a.and_then(|a| a.f1),
        }
    }
}

/// One of the demo's targets: the measured value, the bound, and whether it was met (None: a value was
/// missing, so it is not met either).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Check {
    pub name: String,
    pub value: Option<f64>,
    pub bound: Option<f64>,
    /// `>=` or `<=`.
    pub op: &'static str,
    pub met: bool,
}

/// What the calibration on the validation split chose and measured (askgui-eval calibrate).
#[derive(Debug, Clone, Serialize)]
pub struct CalibrationSummary {
    pub threshold: f64,
    pub target_fpr: f64,
    /// Some threshold kept the validation FPR within `target_fpr`.
    pub bound_met: bool,
    pub val_episodes: usize,
    /// On validation at `threshold`: +ASK per-step FPR and strict ASK F1.
    pub val_fpr: Option<f64>,
    pub val_strict_f1: Option<f64>,
    /// Reliability of `ask_probability` on validation, before and after temperature scaling.
    pub ece: Option<f64>,
    pub brier: Option<f64>,
    pub temperature: f64,
    pub ece_scaled: Option<f64>,
    pub brier_scaled: Option<f64>,
    /// Where calibration.md, reliability.svg and pr_curve.svg are.
    pub dir: PathBuf,
    pub seconds: f64,
}

/// `report.json`. Keys are stable: scripts read them.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// Base agent, original tasks.
    pub base_original: Scores,
    /// Base agent, incomplete (ambiguous) tasks, no asking expected of it.
    pub base_incomplete: Scores,
    /// Base agent, original tasks, every screenshot replaced by a blank one of the same size.
    pub base_blank_screen: Scores,
    /// LoRA+ASK agent, original tasks.
    pub lora_original: Scores,
    /// LoRA+ASK agent, standard evaluation (+ASK).
    pub lora_standard: Scores,
    /// LoRA+ASK agent, Navi-plus Dual-Stream evaluation.
    pub lora_dual: Scores,
    /// LoRA+ASK agent, Morae strict task-level pausing.
    pub lora_strict: Scores,
    /// The LoRA+ASK agent with the calibrated pause threshold (as askgui-serve answers with its adapter):
    /// original, standard, Dual-Stream and strict.
    pub calibrated_original: Scores,
    pub calibrated_standard: Scores,
    pub calibrated_dual: Scores,
    pub calibrated_strict: Scores,
    pub calibration: CalibrationSummary,
    /// The targets with the calibrated threshold (the adapter as served).
    pub checks: Vec<Check>,
    /// Every threshold met, calibrated.
    pub all_met: bool,
    /// The targets with the model's own ask decision (no threshold).
    pub checks_uncalibrated: Vec<Check>,
    pub all_met_uncalibrated: bool,
    /// Seconds per stage, and in all.
    pub timings_s: Vec<(String, f64)>,
    pub total_s: f64,
    pub train_final_loss: Option<f64>,
    pub lora_final_loss: Option<f64>,
    pub test_episodes: usize,
    /// The base agent's model folder and the LoRA+ASK adapter (what to serve).
    pub base_model: PathBuf,
    pub adapter: PathBuf,
    pub args: DemoArgs,
}

/// The demo's targets over a report's scores, with the LoRA agent's calibrated runs (`calibrated`) or
/// its uncalibrated ones.
pub fn checks(r: &DemoReport, calibrated: bool) -> Vec<Check> {
    let mul = |a: Option<f64>, k: f64| a.map(|a| a * k);
    let check = |name: &str, value: Option<f64>, op: &'static str, bound: Option<f64>| {
        let met = match (value, bound) {
            (Some(v), Some(b)) => {
                if op == ">=" {
                    v >= b
                } else {
                    v <= b
                }
            }
            _ => false,
        };
        Check { name: name.into(), value, bound, op, met }
    };
    let (bo, bi) = (&r.base_original, &r.base_incomplete);
    let (dual, strict) =
        if calibrated { (&r.calibrated_dual, &r.calibrated_strict) } else { (&r.lora_dual, &r.lora_strict) };
    vec![
        check("base_original_ssr", bo.ssr, ">=", Some(0.80)),
        check("base_incomplete_sr_vs_original", bi.sr, "<=", mul(bo.sr, 0.7)),
        check("lora_dual_ssr_vs_base_original", dual.ssr, ">=", mul(bo.ssr, 0.95)),
        check("lora_dual_sr_vs_base_original", dual.sr, ">=", mul(bo.sr, 0.9)),
        check("lora_strict_ask_f1", strict.ask_f1, ">=", Some(0.8)),
        // Navi-plus Table 1's regime: per-step ask FPR 0.055 (+ASK) and 0.004 (Dual-Stream).
        check("lora_dual_ask_fpr", dual.ask_fpr, "<=", Some(0.05)),
        check("blank_screen_ssr_vs_base_original", r.base_blank_screen.ssr, "<=", mul(bo.ssr, 0.5)),
    ]
}

/// Fills `r`'s checks from its scores and writes `report.json` and `report.md` into `out`.
pub(super) fn check_and_write(r: &mut DemoReport, out: &Path) -> Result<()> {
    r.checks = checks(r, true);
    r.all_met = r.checks.iter().all(|c| c.met);
    r.checks_uncalibrated = checks(r, false);
    r.all_met_uncalibrated = r.checks_uncalibrated.iter().all(|c| c.met);
    let json = out.join("report.json");
    std::fs::write(&json, serde_json::to_string_pretty(r).expect("report serialises")).map_err(io(&json))?;
    let md = out.join("report.md");
    std::fs::write(&md, markdown(r)).map_err(io(&md))?;
    Ok(())
}

/// Where askgui-serve's playground page is with its default `--host` and `--port`.
pub const PLAYGROUND_URL: &str = "http://127.0.0.1:8000/";

/// How to serve the demo's LoRA+ASK agent (the model was trained with the compact system prompt).
pub fn serve_command(r: &DemoReport) -> String {
    format!(
        "askgui-serve --model {} --adapter ask={} --system-prompt compact",
        r.base_model.display(),
        r.adapter.display()
    )
}

fn pct(v: Option<f64>) -> String {
    v.map(|v| format!("{:.1}", 100.0 * v)).unwrap_or_else(|| "–".into())
}

fn frac(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.3}")).unwrap_or_else(|| "–".into())
}

/// `report.md`: Navi-plus Table 1 for the demo's agents, the blank-screen control, the checks, timings.
pub fn markdown(r: &DemoReport) -> String {
    use std::fmt::Write;
    let mut s = String::from("# askgui-train demo\n\n");
    let _ = writeln!(
        s,
        "Test episodes: {}. Action language: {} (both trainings; askgui.json carries it to eval and serve).\n",
        r.test_episodes,
        r.args.action_language.name()
    );
    let _ = writeln!(
        s,
        "| Setting | SSR | SR | SSR before / after | ASK precision | recall | FPR per step | F1 | FPR per task |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    for (label, x) in [
        ("base, original task", &r.base_original),
        ("base, incomplete task", &r.base_incomplete),
        ("LoRA +ASK (standard)", &r.lora_standard),
        ("LoRA +ASK, Dual-Stream eval", &r.lora_dual),
        ("LoRA +ASK, strict (Morae)", &r.lora_strict),
        ("LoRA +ASK, original task", &r.lora_original),
        ("LoRA +ASK calibrated (standard)", &r.calibrated_standard),
        ("LoRA +ASK calibrated, Dual-Stream eval", &r.calibrated_dual),
        ("LoRA +ASK calibrated, strict (Morae)", &r.calibrated_strict),
        ("LoRA +ASK calibrated, original task", &r.calibrated_original),
        ("base, original task, blank screens", &r.base_blank_screen),
    ] {
        let _ = writeln!(
            s,
            "| {label} | {} | {} | {} / {} | {} | {} | {} | {} | {} |",
            pct(x.ssr),
            pct(x.sr),
            pct(x.ssr_before),
            pct(x.ssr_after),
            frac(x.ask_precision),
            frac(x.ask_recall),
            frac(x.ask_fpr),
            frac(x.ask_f1),
            frac(x.ask_task_fpr)
        );
    }
    let _ = writeln!(
        s,
        "\nSSR and SSR before/after: per-episode means (Navi-plus Appendix F), in %; strict: Morae's task \
         success, precision, recall and F1 per task (eval/README.md)."
    );
    let c = &r.calibration;
    let _ = writeln!(
        s,
        "\nCalibrated pause threshold: {:.4}, chosen on {} validation episodes for the best strict ASK F1 \
         ({}) within a per-step ask FPR of {} ({}; bound met: {}). ask_probability on validation: ECE {}, \
         Brier {}; after temperature scaling (T = {:.3}) ECE {}, Brier {}. Plots: {}.",
        c.threshold,
        c.val_episodes,
        frac(c.val_strict_f1),
        c.target_fpr,
        frac(c.val_fpr),
        c.bound_met,
        frac(c.ece),
        frac(c.brier),
        c.temperature,
        frac(c.ece_scaled),
        frac(c.brier_scaled),
        c.dir.display()
    );
    let _ = writeln!(
        s,
        "\n| Check | value calibrated | met | value uncalibrated | met | target |\n|---|---|---|---|---|---|"
    );
    for (c, u) in r.checks.iter().zip(&r.checks_uncalibrated) {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} {} |",
            c.name,
            frac(c.value),
            c.met,
            frac(u.value),
            u.met,
            c.op,
            frac(c.bound)
        );
    }
    let _ = writeln!(
        s,
        "\nAll targets met: {} calibrated, {} uncalibrated.\n\n| Stage | seconds |\n|---|---|",
        r.all_met, r.all_met_uncalibrated
    );
    for (n, t) in &r.timings_s {
        let _ = writeln!(s, "| {n} | {t:.1} |");
    }
    let _ = writeln!(s, "| total | {:.1} |", r.total_s);
    let _ = writeln!(
        s,
        "\nServe the LoRA+ASK agent (requests pick the adapter `ask`; its askgui.json holds the calibrated \
         pause threshold):\n\n    {}\n\nthen open {PLAYGROUND_URL} and pick a synthetic screen: the playground \
         answers with `ask`, the server's only adapter.",
        serve_command(r)
    );
    s
}
