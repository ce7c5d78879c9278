//! `askgui-eval calibrate`: the pause level (`pause_threshold`) chosen on a validation split, written into
//! the adapter's `askgui.json` so that askgui-serve and askgui-eval answer with it by default.
//!
//! Key choice: one recorded run, every threshold replayed. The agent answers the split once with
//! `pause_threshold` 1 (+ASK and strict modes), so each call records the model's `ask_probability` and the
//! action it takes when it does not ask. Every input those modes give the agent is built from the
//! annotated history alone, so under any threshold `t` the answer to each call is known: `ask` when
//! `p >= t`, else the recorded action. [`sweep`] replays the two modes through the same episode walk and
//! metrics as `run` ([`crate::modes`], [`crate::metrics`]) at every distinct recorded probability, and
//! [`choose`] keeps the threshold with the best strict ASK F1 (Morae §5.1) whose per-step ask FPR on +ASK
//! (`eval/README.md`, Navi-plus Table 1) stays within the bound. The one input a replay can lack is a
//! strict walk's check for a late pause after an earlier right pause (history with one QA pair but not the
//! next): it only tells a late pause from none, both false negatives, so it is answered "no pause" and
//! counted (`unrecorded`). Questions are not scored here: a replayed ask carries the recorded question, or
//! none.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use askgui_data::{Action, AdapterCard, LoadedEpisode};
use serde::Serialize;
use thiserror::Error;

use crate::agent::{Agent, AgentError, Prediction, StepInput, ASK_PROBABILITY_TOL};
use crate::calibration::{fit_temperature, reliability, scaled, Decision, Reliability};
use crate::matching::MatchConfig;
use crate::metrics::{compute, NoContentScorer};
use crate::modes::{annotated_ask_steps, evaluate_episode, EpisodeResult, Mode};
use crate::runner::{read_results, results_path, run_eval, EvalConfig, RunError};

pub mod report;

/// Bins of the reliability table.
pub const BINS: usize = 10;
/// Thresholds replayed at most (evenly spaced over the sorted distinct probabilities beyond this).
pub const MAX_CANDIDATES: usize = 4096;

#[derive(Debug, Error)]
pub enum CalibrateError {
    #[error("{0}")]
    Run(#[from] RunError),
    #[error(
        "calibrate records each step's answer with pause_threshold 1 and greedy decoding; this agent decodes \
         with {0} (leave --pause-threshold and --temperature unset)"
    )]
    Decoding(String),
    #[error("episode {id} step {step}: the agent reported no ask_probability (askgui-serve and --model do)")]
    NoProbability { id: String, step: usize },
    #[error(
        "episode {id} step {step}: the same input got two answers ({a} and {b}); calibrate needs a deterministic \
         agent"
    )]
    Nondeterministic { id: String, step: usize, a: String, b: String },
    #[error(
        "{}: no step of its {} episodes needs an ask (no ambiguous task with an annotated ask), so asking cannot \
         be measured: any threshold would have no recall or F1 to choose by. Calibrate on a split with \
         ambiguous episodes (askgui-data synth --split puts some in every split)",
        .0.display(),
        .1
    )]
    NoPositives(PathBuf, usize),
    #[error(
        "{}: no step of its {} episodes needs no ask, so no ask FPR can be measured; calibrate on a split with \
         steps that need none (tasks that need no question, or steps before and after an annotated ask)",
        .0.display(),
        .1
    )]
    NoNegatives(PathBuf, usize),
    #[error(
        "no threshold kept the per-step ask FPR within {target}: the lowest FPR was {fpr} (threshold {threshold}), \
         so it was not written to {dir}. Raise --target-fpr, calibrate on more episodes, or give --force to write \
         it anyway"
    )]
    BoundMissed { dir: String, target: f64, fpr: String, threshold: f64 },
    #[error("{path}: {reason}")]
    Card { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// What one recorded call answered.
#[derive(Debug, Clone)]
struct Recorded {
    p: f64,
    action: Option<Action>,
    raw: String,
}

/// The recorded answers by input: (episode id, step, turns of history). Within +ASK and strict an input
/// is fixed by these three (the history is the annotated one, with the QA pairs of a prefix of the
/// annotated steps); [`Table::from_results`] fails if two calls with one key were answered differently.
struct Table(HashMap<(String, usize, usize), Recorded>);

impl Table {
    fn from_results(results: &[&EpisodeResult]) -> Result<Self, CalibrateError> {
        let mut t: HashMap<(String, usize, usize), Recorded> = HashMap::new();
        for r in results {
            for c in &r.calls {
                let p = c
                    .ask_probability
                    .ok_or_else(|| CalibrateError::NoProbability { id: r.id.clone(), step: c.step })?;
                let rec = Recorded { p, action: c.action.clone(), raw: c.raw.clone() };
                match t.get(&(r.id.clone(), c.step, c.history)) {
                    Some(old) if old.action != rec.action || (old.p - p).abs() > ASK_PROBABILITY_TOL => {
                        return Err(CalibrateError::Nondeterministic {
                            id: r.id.clone(),
                            step: c.step,
                            a: format!("{} p={}", old.raw, old.p),
                            b: format!("{} p={p}", rec.raw),
                        });
                    }
                    Some(_) => {}
                    None => {
                        t.insert((r.id.clone(), c.step, c.history), rec);
                    }
                }
            }
        }
        Ok(Self(t))
    }
}

/// An agent that answers from the table as the recorded one would with `pause_threshold` = `threshold`.
struct Replay<'a> {
    table: &'a Table,
    threshold: f64,
    unrecorded: AtomicUsize,
}

impl Agent for Replay<'_> {
    fn name(&self) -> String {
        format!("replay at pause threshold {}", self.threshold)
    }

    fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError> {
        let key = (input.episode_id.clone(), input.step, input.history.len());
        let Some(r) = self.table.0.get(&key) else {
            self.unrecorded.fetch_add(1, Ordering::Relaxed);
            return Ok(Prediction { action: None, raw: String::new(), parse_error: None, ask_probability: None });
        };
        let action = if r.p >= self.threshold {
            match &r.action {
                Some(a @ Action::Ask(_)) => Some(a.clone()),
                _ => {
                    Some(Action::Ask(askgui_data::action::Ask { question: String::new(), options: vec![], kind: None }))
                }
            }
        } else {
            r.action.clone()
        };
        Ok(Prediction { action, raw: r.raw.clone(), parse_error: None, ask_probability: Some(r.p) })
    }
}

/// The ask numbers of one threshold on the split.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SweepPoint {
    pub threshold: f64,
    /// +ASK, per step: ask precision, recall, FPR (needless asks / steps that need none).
    pub precision: Option<f64>,
    pub recall: Option<f64>,
    pub fpr: Option<f64>,
    /// Morae strict, per task: precision, recall, F1; and tasks with a needless ask / tasks needing none.
    pub strict_precision: Option<f64>,
    pub strict_recall: Option<f64>,
    pub strict_f1: Option<f64>,
    pub task_fpr: Option<f64>,
    /// Replayed calls with no recorded answer (strict late-pause checks; see the module header).
    pub unrecorded: usize,
}

/// The numbers at `threshold`, replayed from `table`.
fn point(episodes: &[LoadedEpisode], table: &Table, threshold: f64, matching: &MatchConfig) -> SweepPoint {
    let replay = Replay { table, threshold, unrecorded: AtomicUsize::new(0) };
    let run = |mode| -> Vec<EpisodeResult> {
        // The replay answers every call, so no episode fails.
        episodes.iter().filter_map(|e| evaluate_episode(&replay, e, mode, matching).ok()).collect()
    };
    let none = NoContentScorer("calibrate does not score questions".into());
    let standard = compute(Mode::Standard, &run(Mode::Standard), &none);
    let strict = compute(Mode::Strict, &run(Mode::Strict), &none);
    let (a, s) = (standard.ask.as_ref(), strict.ask.as_ref());
    SweepPoint {
        threshold,
        precision: a.and_then(|a| a.precision),
        recall: a.and_then(|a| a.recall),
        fpr: a.and_then(|a| a.fpr),
        strict_precision: s.and_then(|s| s.precision),
        strict_recall: s.and_then(|s| s.recall),
        strict_f1: s.and_then(|s| s.f1),
        task_fpr: strict.task_fpr.as_ref().and_then(|t| t.rate),
        unrecorded: replay.unrecorded.load(Ordering::Relaxed),
    }
}

/// The thresholds worth trying: every distinct recorded probability (a threshold between two of them
/// decides as the upper one), at most [`MAX_CANDIDATES`] evenly spaced over them.
fn candidates(table: &Table) -> Vec<f64> {
    let mut ps: Vec<f64> = table.0.values().map(|r| r.p).collect();
    ps.sort_by(f64::total_cmp);
    ps.dedup();
    if ps.len() <= MAX_CANDIDATES {
        return ps;
    }
    let n = ps.len() - 1;
    (0..MAX_CANDIDATES).map(|k| ps[k * n / (MAX_CANDIDATES - 1)]).collect()
}

/// Every candidate threshold's numbers on `episodes` from the recorded `results` (+ASK and strict).
fn sweep(episodes: &[LoadedEpisode], table: &Table, matching: &MatchConfig) -> Vec<SweepPoint> {
    candidates(table).into_iter().map(|t| point(episodes, table, t, matching)).collect()
}

/// The index of the point with the best strict F1 among those whose FPR is within `target_fpr` (ties:
/// the lower FPR, then the higher threshold), and whether any was; with none within, the lowest FPR
/// (ties: the better F1, then the higher threshold). None when no point has an FPR.
pub fn choose(points: &[SweepPoint], target_fpr: f64) -> Option<(usize, bool)> {
    let with_fpr = || points.iter().enumerate().filter_map(|(i, p)| Some((i, p, p.fpr?)));
    let f1 = |p: &SweepPoint| p.strict_f1.unwrap_or(0.0);
    let best = |keys: Vec<(usize, [f64; 3])>| {
        keys.into_iter().max_by(|(_, a), (_, b)| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal)).map(|(i, _)| i)
    };
    let within = with_fpr().filter(|&(_, _, f)| f <= target_fpr).map(|(i, p, f)| (i, [f1(p), -f, p.threshold]));
    if let Some(i) = best(within.collect()) {
        return Some((i, true));
    }
    best(with_fpr().map(|(i, p, f)| (i, [-f, f1(p), p.threshold])).collect()).map(|i| (i, false))
}

/// The calibration of one agent on one split: `calibration.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    pub episodes_file: String,
    pub episodes: usize,
    pub target_fpr: f64,
    /// The chosen pause threshold, and whether its FPR is within `target_fpr`.
    pub threshold: f64,
    pub bound_met: bool,
    pub chosen: SweepPoint,
    /// Every threshold tried, in increasing order (the precision-recall curve of asking).
    pub sweep: Vec<SweepPoint>,
    /// `ask_probability` of each +ASK step decision against whether the step needed an ask.
    pub reliability: Reliability,
    /// The fitted temperature of the ask logit, and the table of the scaled probabilities.
    pub temperature: f64,
    pub reliability_scaled: Reliability,
}

/// The +ASK step decisions of `standard`: each step's first call with ground-truth history, labelled by
/// whether the step is annotated.
fn decisions(standard: &[EpisodeResult]) -> Vec<Decision> {
    let mut out = Vec::new();
    for r in standard {
        for c in r.calls.iter().filter(|c| c.stream == 1 && !c.answered) {
            if let Some(p) = c.ask_probability {
                out.push(Decision { p, needed: r.ask_steps.contains(&c.step) });
            }
        }
    }
    out
}

/// Runs `agent` (decoding with pause threshold 1, greedy) over `episodes` in +ASK and strict modes into
/// `cfg.out` (resumable, as `run`), then replays every threshold and chooses one under `target_fpr`.
pub fn calibrate(
    agent: &dyn Agent,
    episodes: &[LoadedEpisode],
    cfg: &EvalConfig,
    target_fpr: f64,
) -> Result<Calibration, CalibrateError> {
    let d = agent.identity().decoding;
    if d.pause_threshold != Some(1.0) || d.temperature.unwrap_or(0.0) != 0.0 {
        return Err(CalibrateError::Decoding(format!(
            "pause threshold {:?}, temperature {:?}",
            d.pause_threshold, d.temperature
        )));
    }
    check_split(episodes, &cfg.episodes)?;
    let cfg = EvalConfig { modes: vec![Mode::Standard, Mode::Strict], ..cfg.clone() };
    run_eval(agent, episodes, &cfg, &NoContentScorer("calibrate does not score questions".into()))?;
    let standard = read_results(&results_path(&cfg.out, Mode::Standard), Mode::Standard)?;
    let strict = read_results(&results_path(&cfg.out, Mode::Strict), Mode::Strict)?;
    let table = Table::from_results(&standard.iter().chain(&strict).collect::<Vec<_>>())?;
    let sweep = sweep(episodes, &table, &cfg.matching);
    let Some((i, bound_met)) = choose(&sweep, target_fpr) else {
        return Err(CalibrateError::NoNegatives(cfg.episodes.clone(), episodes.len()));
    };
    let ds = decisions(&standard);
    let temperature = fit_temperature(&ds);
    let ambiguous = episodes.iter().filter(|e| !annotated_ask_steps(e).is_empty()).count();
    tracing::info!(episodes = episodes.len(), ambiguous, candidates = sweep.len(), "calibrated");
    Ok(Calibration {
        episodes_file: cfg.episodes.display().to_string(),
        episodes: episodes.len(),
        target_fpr,
        threshold: sweep[i].threshold,
        bound_met,
        chosen: sweep[i].clone(),
        reliability: reliability(&ds, BINS),
        temperature,
        reliability_scaled: reliability(&scaled(&ds, temperature), BINS),
        sweep,
    })
}

/// Refuses a split that cannot calibrate, before the agent is called: one without a step that needs an
/// ask (no recall, so every threshold ties) or without one that needs none (no FPR).
fn check_split(episodes: &[LoadedEpisode], path: &Path) -> Result<(), CalibrateError> {
    let (mut positives, mut negatives) = (0, 0);
    for e in episodes {
        let annotated = annotated_ask_steps(e).len();
        positives += annotated;
        negatives += e.episode.steps.len() - annotated;
    }
    match (positives, negatives) {
        (0, _) => Err(CalibrateError::NoPositives(path.to_path_buf(), episodes.len())),
        (_, 0) => Err(CalibrateError::NoNegatives(path.to_path_buf(), episodes.len())),
        _ => Ok(()),
    }
}

/// Writes the chosen threshold into `dir`'s askgui.json (which must exist: it also holds the prompt
/// settings the threshold was measured with). A threshold whose FPR misses the bound is written only
/// with `force`.
pub fn write_to_card(dir: &Path, c: &Calibration, force: bool) -> Result<PathBuf, CalibrateError> {
    if !c.bound_met && !force {
        return Err(CalibrateError::BoundMissed {
            dir: dir.display().to_string(),
            target: c.target_fpr,
            fpr: c.chosen.fpr.map_or("–".into(), |f| format!("{f:.4}")),
            threshold: c.threshold,
        });
    }
    let path = dir.join(askgui_data::adapter_card::FILE);
    let card_err = |reason: String| CalibrateError::Card { path: path.clone(), reason };
    let mut card = AdapterCard::read(dir).map_err(|e| card_err(e.to_string()))?.ok_or_else(|| {
        card_err(
            "no askgui.json here (askgui-train writes one beside each adapter); pass --no-write and give \
                 --pause-threshold to askgui-eval and options.pause_threshold to askgui-serve instead"
                .into(),
        )
    })?;
    card.pause = Some(askgui_data::adapter_card::CardPause {
        threshold: c.threshold,
        target_fpr: c.target_fpr,
        episodes: c.episodes_file.clone(),
        strict_f1: c.chosen.strict_f1,
        fpr: c.chosen.fpr,
        bound_met: c.bound_met,
    });
    card.write(dir).map_err(|e| card_err(e.to_string()))?;
    Ok(path)
}
