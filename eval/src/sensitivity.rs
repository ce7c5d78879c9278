//! How far each choice the papers leave open moves the Table 1 numbers: a finished run's results scored
//! again under each variant, without calling the agent (`askgui-eval sensitivity`).
//!
//! Metric choices ([`MetricOptions`], pooled against per-episode SSR) only re-aggregate the results.
//! Matching variants score each step's saved prediction again ([`rescore`]); that is exact for the four
//! Table 1 modes, whose calls do not depend on earlier verdicts, and not possible for Strict, whose walk
//! stops at the first wrong step: Strict gets the metric variants that concern it only.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use askgui_data::{load_episodes, Episode};
use thiserror::Error;

use crate::identity;
use crate::matching::{MatchConfig, RuleSet};
use crate::metrics::{
    compute_with, AskNegatives, AskStepRule, EarlyAsk, MetricOptions, ModeMetrics, NoContentScorer, PauseSteps,
};
use crate::modes::{EpisodeResult, Mode};
use crate::runner::results_path;

#[derive(Debug, Error)]
pub enum SensitivityError {
    #[error("{0}: no identity.json: not a folder written by `askgui-eval run`")]
    NoIdentity(PathBuf),
    #[error("{0}")]
    Identity(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}, line {line}: {reason}")]
    Results { path: PathBuf, line: usize, reason: String },
    #[error("episodes: {0}")]
    Episodes(String),
    #[error("{0}: no results of any mode (results-<mode>.jsonl)")]
    NoResults(PathBuf),
}

/// Which modes a variant is shown for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applies {
    /// Every mode (the defaults).
    All,
    /// The four Table 1 modes.
    Table,
    /// Strict only.
    Strict,
}

impl Applies {
    fn to(self, mode: Mode) -> bool {
        match self {
            Applies::All => true,
            Applies::Table => mode != Mode::Strict,
            Applies::Strict => mode == Mode::Strict,
        }
    }
}

/// One way of scoring: the metric options, pooled or per-episode SSR, and the matching rule.
#[derive(Debug, Clone)]
pub struct Variant {
    pub name: &'static str,
    pub opts: MetricOptions,
    pub pooled: bool,
    pub matching: MatchConfig,
    pub applies: Applies,
}

/// The defaults first, then one open choice changed at a time, then the earlier definitions
/// together (pooled, the ask required at its step, early asks as positives).
pub fn variants(base: &MatchConfig) -> Vec<Variant> {
    let v = |name, opts, pooled, matching| Variant { name, opts, pooled, matching, applies: Applies::Table };
    let d = MetricOptions::default();
    let require = MetricOptions { ask_step: AskStepRule::RequireAsk, ..d };
    let early = MetricOptions { early_ask: EarlyAsk::Positive, ..d };
    let reprediction = MetricOptions { ask_negatives: AskNegatives::WithReprediction, ..d };
    let first = MetricOptions { pause_steps: PauseSteps::First, ..d };
    let old = MetricOptions { ask_step: AskStepRule::RequireAsk, early_ask: EarlyAsk::Positive, ..d };
    let m = *base;
    vec![
        Variant { applies: Applies::All, ..v("papers' definitions (default)", d, false, m) },
        v("SSR pooled over steps", d, true, m),
        v("ask step right only if asked", require, false, m),
        v("Dual: early ask is the positive", early, false, m),
        v("FPR: the re-prediction after the QA pair is a negative", reprediction, false, m),
        Variant {
            applies: Applies::Strict,
            ..v("strict: the first annotated step is the pause step", first, false, m)
        },
        v("text: token F1 > 0.3", d, false, MatchConfig { text_f1: 0.3, ..m }),
        v("text: token F1 > 0.7", d, false, MatchConfig { text_f1: 0.7, ..m }),
        v("text: token F1 = 1", d, false, MatchConfig { text_f1: 1.0 - 1e-9, ..m }),
        v("click: distance 0.07 (no box)", d, false, MatchConfig { distance: 0.07, ..m }),
        v("click: distance 0.20 (no box)", d, false, MatchConfig { distance: 0.20, ..m }),
        v("click: box or distance (AITW)", d, false, MatchConfig { box_or_distance: true, ..m }),
        v("click: no inferred box", d, false, MatchConfig { no_infer_element: true, ..m }),
        v("click: a box's right and bottom edges inside", d, false, MatchConfig { box_edges: true, ..m }),
        v("our rules for every dataset", d, false, MatchConfig { rules: RuleSet::Synthetic, ..m }),
        v("earlier askgui: pooled, ask required, early positive", old, true, m),
    ]
}

/// The results of a Table 1 mode scored again with `m`: each step's verdict from its saved prediction,
/// and the episode's success. Strict results are returned as they are (see the module header).
pub fn rescore(results: &[EpisodeResult], episodes: &HashMap<String, Episode>, m: &MatchConfig) -> Vec<EpisodeResult> {
    results
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let (false, Some(ep)) = (r.mode == Mode::Strict, episodes.get(&r.id)) {
                for s in &mut r.steps {
                    s.correct = s.predicted.as_ref().is_some_and(|a| m.matches_step(a, ep, s.step));
                }
                r.success = r.steps.iter().all(|s| s.correct);
            }
            r
        })
        .collect()
}

/// Reads a results file without touching it (every line must parse).
pub fn read_results(path: &Path) -> Result<Vec<EpisodeResult>, SensitivityError> {
    let text = std::fs::read_to_string(path).map_err(|source| SensitivityError::Io { path: path.into(), source })?;
    let parse = |(i, l): (usize, &str)| {
        serde_json::from_str(l).map_err(|e| SensitivityError::Results {
            path: path.into(),
            line: i + 1,
            reason: e.to_string(),
        })
    };
    text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()).map(parse).collect()
}

/// The Table 1 numbers of one mode under one variant.
fn scored(mode: Mode, results: &[EpisodeResult], v: &Variant, episodes: &HashMap<String, Episode>) -> ModeMetrics {
    let rescored = rescore(results, episodes, &v.matching);
    let mut m = compute_with(mode, &rescored, &NoContentScorer("not scored here".into()), v.opts);
    if v.pooled {
        (m.ssr, m.ssr_before, m.ssr_after) = (m.ssr_pooled, m.ssr_before_pooled, m.ssr_after_pooled);
    }
    m
}

fn cell(v: Option<f64>, base: Option<f64>, scale: f64, digits: usize) -> String {
    match (v, base) {
        (Some(v), Some(b)) if (v - b).abs() * scale >= 0.5 * 10f64.powi(-(digits as i32)) => {
            format!("{:.*} ({:+.*})", digits, v * scale, digits, (v - b) * scale)
        }
        (Some(v), _) => format!("{:.*}", digits, v * scale),
        (None, _) => "–".into(),
    }
}

/// The sensitivity tables of the run folders `dirs` (each written by `askgui-eval run`), Markdown.
/// `episodes` overrides the episode file their `identity.json` names.
pub fn tables(dirs: &[PathBuf], episodes: Option<&Path>) -> Result<String, SensitivityError> {
    let mut s = String::new();
    for dir in dirs {
        let id = identity::read(dir)
            .map_err(SensitivityError::Identity)?
            .ok_or_else(|| SensitivityError::NoIdentity(dir.clone()))?;
        let file = episodes.map_or_else(|| PathBuf::from(&id.episodes), Path::to_path_buf);
        let eps: HashMap<String, Episode> = load_episodes(&file)
            .map_err(|e| SensitivityError::Episodes(e.to_string()))?
            .into_iter()
            .map(|e| (e.episode.id.clone(), e.episode))
            .collect();
        let modes: Vec<Mode> = Mode::ALL.into_iter().filter(|m| results_path(dir, *m).is_file()).collect();
        if modes.is_empty() {
            return Err(SensitivityError::NoResults(dir.clone()));
        }
        for mode in modes {
            let results = read_results(&results_path(dir, mode))?;
            let _ = writeln!(s, "### {} — {}\n", dir.display(), mode.row_label());
            mode_table(&mut s, mode, &results, &variants(&id.matching), &eps);
        }
    }
    Ok(s)
}

fn mode_table(s: &mut String, mode: Mode, results: &[EpisodeResult], vs: &[Variant], eps: &HashMap<String, Episode>) {
    let _ = writeln!(s, "| variant | SSR | SR | SSR before | SSR after | precision | recall | FPR | F1 |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    let base = scored(mode, results, &vs[0], eps);
    let ask = |m: &ModeMetrics, f: fn(&crate::metrics::AskTiming) -> Option<f64>| m.ask.as_ref().and_then(f);
    for v in vs.iter().filter(|v| v.applies.to(mode)) {
        let m = scored(mode, results, v, eps);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            v.name,
            cell(m.ssr, base.ssr, 100.0, 1),
            cell(m.sr, base.sr, 100.0, 1),
            cell(m.ssr_before, base.ssr_before, 100.0, 1),
            cell(m.ssr_after, base.ssr_after, 100.0, 1),
            cell(ask(&m, |a| a.precision), ask(&base, |a| a.precision), 1.0, 3),
            cell(ask(&m, |a| a.recall), ask(&base, |a| a.recall), 1.0, 3),
            cell(ask(&m, |a| a.fpr), ask(&base, |a| a.fpr), 1.0, 3),
            cell(ask(&m, |a| a.f1), ask(&base, |a| a.f1), 1.0, 3),
        );
    }
    let _ = writeln!(s);
}
