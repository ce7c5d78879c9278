//! Aggregate metrics of one mode over the episodes' results (definitions and sources in `eval/README.md`).
//!
//! Step metrics are Navi-plus Appendix F's per-episode averages: SSR = (1/N) Σ C(e)/T_e (F.1), SSR
//! before/after the same over the steps before / from the first annotated ASK step (F.2), SR = successful
//! episodes / episodes (F.3); the pooled ratios (right steps / steps) are extra, named `*_pooled`. ASK
//! timing: per step in Standard and Dual (the positive is an ask exactly at the annotated step, §3.1), per
//! task in Strict (Morae §5.1, precision, recall and F1 only). The ask FPR has one meaning per unit: per
//! step, needless asks / steps that need none; per task, tasks with a needless ask / tasks that need none.
//! A ratio with a zero denominator is `None` (shown as "–"), never 0. What the papers leave open is a
//! [`MetricOptions`] field, so that `askgui-eval sensitivity` can show how far each choice moves the table.

use askgui_data::Action;
use serde::{Deserialize, Serialize};

use crate::ask_behaviour::{ask_behaviour, AskBehaviour};
use crate::modes::{Counts, EpisodeResult, Mode, StepOutcome, StrictOutcome};
use crate::ratio::ratio;
use crate::text::TextMetrics;

/// A metric's value, or why there is none.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    Value(f64),
    Unavailable(String),
}

impl Metric {
    pub fn value(&self) -> Option<f64> {
        match self {
            Metric::Value(v) => Some(*v),
            Metric::Unavailable(_) => None,
        }
    }
}

/// Scores an (annotated question, agent question) pair; implemented by [`TextMetrics`].
pub trait ContentScorer {
    /// Why cosine similarity cannot be computed at all (None: it can).
    fn cosine_unavailable(&self) -> Option<String>;
    /// Why METEOR cannot be computed at all (None: it can).
    fn meteor_unavailable(&self) -> Option<String>;
    /// `(cosine, meteor)` of one pair; None where the metric failed on it.
    fn score(&self, reference: &str, hypothesis: &str) -> (Option<f64>, Option<f64>);
}

impl ContentScorer for TextMetrics {
    fn cosine_unavailable(&self) -> Option<String> {
        self.embedder.as_ref().err().cloned()
    }

    fn meteor_unavailable(&self) -> Option<String> {
        self.meteor.as_ref().err().cloned()
    }

    fn score(&self, reference: &str, hypothesis: &str) -> (Option<f64>, Option<f64>) {
        let s = TextMetrics::score(self, reference, hypothesis);
        (s.cosine, s.meteor)
    }
}

/// A scorer with nothing loaded (both metrics unavailable with `reason`).
pub struct NoContentScorer(pub String);

impl ContentScorer for NoContentScorer {
    fn cosine_unavailable(&self) -> Option<String> {
        Some(self.0.clone())
    }
    fn meteor_unavailable(&self) -> Option<String> {
        Some(self.0.clone())
    }
    fn score(&self, _: &str, _: &str) -> (Option<f64>, Option<f64>) {
        (None, None)
    }
}

/// The annotated ASK step's operational action in Standard and Dual (Navi-plus is silent; see README).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum AskStepRule {
    /// Scored after the annotated QA pair whether the agent asked or not; the ask is scored by ASK timing
    /// only (what Table 1's "after" of +ASK equal to the original task's implies).
    #[default]
    Annotated,
    /// Right only when the agent also asked (Standard: exactly there; Dual: at or before it).
    RequireAsk,
}

/// How Dual-Stream counts an early ask in ASK timing (Navi-plus is silent; see README).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum EarlyAsk {
    /// The positive stays an exact ask (recall equal in +ASK and Dual, as Table 1's precision and F1
    /// imply); the credited early ask's step is a true negative, so the FPR's denominator is every step
    /// that needs no ask in both rows. Content is scored on the exact asks in both rows.
    #[default]
    Negative,
    /// The credited early ask is the positive (TP, no FN) and its step leaves the negatives; content is
    /// scored on the early question.
    Positive,
}

/// Which steps are the negatives of the per-step ask FPR in Standard and Dual (Navi-plus is silent; see
/// README).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum AskNegatives {
    /// Every step that is not annotated, once: each step is one unit of the confusion matrix (an annotated
    /// step is its positive, TP or FN), so positives + negatives = steps.
    #[default]
    Unannotated,
    /// Also the prediction of each annotated step after its QA pair (the one its action is scored on): an
    /// ask there is a FP, anything else a TN.
    WithReprediction,
}

/// Which annotated steps a Morae strict task must pause at (Morae §5.1 defines one pause step per task and
/// is silent on tasks with two; see README).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum PauseSteps {
    /// Every one, each exactly, acting right on each answer while another remains.
    #[default]
    Every,
    /// The first one is the task's pause step: a pause exactly there is a TP and a task success.
    First,
}

/// The choices the papers leave open.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetricOptions {
    pub ask_step: AskStepRule,
    pub early_ask: EarlyAsk,
    #[serde(default)]
    pub ask_negatives: AskNegatives,
    #[serde(default)]
    pub pause_steps: PauseSteps,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct AskTiming {
    pub counts: Counts,
    pub precision: Option<f64>,
    pub recall: Option<f64>,
    /// Per step: needless asks / steps that need none, FP / (FP + TN). None for per-task counts (Morae
    /// reports no FPR; the per-task rate is [`ModeMetrics::task_fpr`]).
    pub fpr: Option<f64>,
    pub f1: Option<f64>,
}

impl AskTiming {
    /// Precision, recall, F1, and the FPR when the counts are per step.
    pub fn from_counts(c: Counts, per_step: bool) -> Self {
        Self {
            counts: c,
            precision: ratio(c.tp, c.tp + c.fp),
            recall: ratio(c.tp, c.tp + c.fn_),
            fpr: if per_step { ratio(c.fp, c.fp + c.tn) } else { None },
            f1: ratio(2 * c.tp, 2 * c.tp + c.fp + c.fn_),
        }
    }
}

/// Tasks with a needless ask / tasks that need none (every non-empty one, acted right or not).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct TaskFpr {
    pub needless: usize,
    pub tasks: usize,
    pub rate: Option<f64>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ContentMetrics {
    /// Asks whose question was compared (exact asks; see [`EarlyAsk`]).
    pub pairs: usize,
    pub cosine: Metric,
    pub meteor: Metric,
}

/// Morae's per-task outcome counts.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct StrictCounts {
    pub tp: usize,
    pub fp_early: usize,
    pub fp_spurious: usize,
    pub fn_missed: usize,
    pub fn_late: usize,
    #[serde(default)]
    pub fn_off_path: usize,
    pub tn: usize,
    pub failed_unpaused: usize,
}

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepAccuracy {
    pub step: usize,
    pub correct: usize,
    pub total: usize,
}

/// Every metric of one mode.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ModeMetrics {
    pub mode: Mode,
    /// Non-empty episodes (N of Appendix F).
    pub episodes: usize,
    /// Episodes with no step: counted here, left out of every other number.
    pub empty_episodes: usize,
    pub steps: usize,
    pub correct_steps: usize,
    /// Navi-plus F.1: the mean over episodes of right steps / steps (Strict: none).
    pub ssr: Option<f64>,
    /// Navi-plus F.3 (Strict: Morae's task success rate).
    pub sr: Option<f64>,
    /// Navi-plus F.2: the mean over the episodes with such steps.
    pub ssr_before: Option<f64>,
    pub ssr_after: Option<f64>,
    /// Right steps / steps over all episodes (not the papers' definition).
    pub ssr_pooled: Option<f64>,
    pub ssr_before_pooled: Option<f64>,
    pub ssr_after_pooled: Option<f64>,
    pub steps_before: usize,
    pub steps_after: usize,
    /// Episodes averaged in `ssr_before` / `ssr_after`.
    pub episodes_before: usize,
    pub episodes_after: usize,
    /// None when the mode does not score asks.
    pub ask: Option<AskTiming>,
    /// The per-task ask FPR (modes that score asks).
    pub task_fpr: Option<TaskFpr>,
    pub content: Option<ContentMetrics>,
    pub strict: Option<StrictCounts>,
    /// Strict: Morae's task success over the tasks that need a pause / that need none.
    pub sr_pause_required: Option<f64>,
    pub sr_no_pause: Option<f64>,
    /// Accuracy by step index (Strict: over the steps its walk reached).
    pub step_accuracy: Vec<StepAccuracy>,
    /// `asked_at - annotated step` for every annotated ASK step the agent asked around.
    pub ask_offsets: Vec<i64>,
    /// Asks per task, over-asking, results by details left out, first-ask timing (+ASK and Dual).
    #[serde(default)]
    pub ask_behaviour: Option<AskBehaviour>,
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The metrics of `mode` over its results with the papers' definitions ([`MetricOptions::default`]).
pub fn compute(mode: Mode, results: &[EpisodeResult], scorer: &dyn ContentScorer) -> ModeMetrics {
    compute_with(mode, results, scorer, MetricOptions::default())
}

/// Step verdicts of one episode under `opts` (`RequireAsk` also wants the ask at annotated steps).
pub fn step_verdicts(r: &EpisodeResult, opts: MetricOptions) -> Vec<StepOutcome> {
    let mut steps = r.steps.clone();
    if opts.ask_step == AskStepRule::RequireAsk && matches!(r.mode, Mode::Standard | Mode::Dual) {
        for o in &r.asks {
            let asked = if r.mode == Mode::Dual { o.credited } else { o.exact };
            if let Some(s) = steps.iter_mut().find(|s| s.step == o.step) {
                s.correct &= asked;
            }
        }
    }
    steps
}

/// Step-level sums of one mode.
#[derive(Default)]
struct StepSums {
    steps: usize,
    correct: usize,
    per_episode: Vec<f64>,
    successes: usize,
    before: (usize, usize, Vec<f64>),
    after: (usize, usize, Vec<f64>),
    by_step: Vec<StepAccuracy>,
}

fn step_sums(nonempty: &[&EpisodeResult], opts: MetricOptions) -> StepSums {
    let mut t = StepSums::default();
    for r in nonempty {
        let steps = step_verdicts(r, opts);
        let right = steps.iter().filter(|s| s.correct).count();
        t.steps += steps.len();
        t.correct += right;
        if let Some(v) = ratio(right, steps.len()) {
            t.per_episode.push(v);
        }
        t.successes += usize::from(if r.mode == Mode::Strict { r.success } else { steps.iter().all(|s| s.correct) });
        if let Some(split) = r.split {
            for (part, keep) in [(&mut t.before, true), (&mut t.after, false)] {
                let these: Vec<&StepOutcome> = steps.iter().filter(|s| (s.step < split) == keep).collect();
                let ok = these.iter().filter(|s| s.correct).count();
                part.0 += these.len();
                part.1 += ok;
                part.2.extend(ratio(ok, these.len()));
            }
        }
        for s in &steps {
            while t.by_step.len() <= s.step {
                t.by_step.push(StepAccuracy { step: t.by_step.len(), correct: 0, total: 0 });
            }
            t.by_step[s.step].total += 1;
            t.by_step[s.step].correct += usize::from(s.correct);
        }
    }
    t
}

/// Per-step ASK counts of one Standard or Dual episode (see [`EarlyAsk`]).
pub fn step_counts(r: &EpisodeResult, opts: MetricOptions) -> Counts {
    let positive_early = r.mode == Mode::Dual && opts.early_ask == EarlyAsk::Positive;
    let mut c = Counts::default();
    // The steps of credited early asks: merged into their positive, or true negatives.
    let mut early = Vec::new();
    for o in &r.asks {
        if o.exact || (positive_early && o.credited) {
            c.tp += 1;
        } else {
            c.fn_ += 1;
        }
        // Credited and early, whether or not the agent also asked at the annotated step itself.
        if r.mode == Mode::Dual && o.credited {
            early.extend(o.asked_at.filter(|&j| j < o.step));
        }
    }
    for s in &r.steps {
        if r.ask_steps.contains(&s.step) {
            if opts.ask_negatives == AskNegatives::WithReprediction {
                // The prediction after the QA pair, which the step's action is scored on.
                match s.predicted {
                    Some(Action::Ask(_)) => c.fp += 1,
                    _ => c.tn += 1,
                }
            }
            continue;
        }
        let credited_early = early.contains(&s.step);
        match (s.asked, credited_early, positive_early) {
            (true, true, true) => {}
            (true, false, _) => c.fp += 1,
            _ => c.tn += 1,
        }
    }
    c
}

/// A strict result read with the first annotated step as the task's pause step ([`PauseSteps::First`]):
/// a pause exactly there is a TP and a success, and the walk ends there. Every other verdict is reached
/// at or before that step, so it is the same under both readings.
fn first_pause_step(r: &EpisodeResult) -> EpisodeResult {
    let mut r = r.clone();
    let Some(&a) = r.ask_steps.first() else { return r };
    r.ask_steps.truncate(1);
    r.asks.retain(|o| o.step == a);
    if r.asks.first().is_some_and(|o| o.exact) {
        r.strict = Some(StrictOutcome::Tp);
        r.success = true;
        if let Some(pause) = r.steps.iter().position(|s| s.step == a && s.asked) {
            r.steps.truncate(pause + 1);
        }
    }
    r
}

fn strict_counts(nonempty: &[&EpisodeResult]) -> StrictCounts {
    let mut sc = StrictCounts::default();
    for o in nonempty.iter().filter_map(|r| r.strict) {
        match o {
            StrictOutcome::Tp => sc.tp += 1,
            StrictOutcome::FpEarly => sc.fp_early += 1,
            StrictOutcome::FpSpurious => sc.fp_spurious += 1,
            StrictOutcome::FnMissed => sc.fn_missed += 1,
            StrictOutcome::FnLate => sc.fn_late += 1,
            StrictOutcome::FnOffPath => sc.fn_off_path += 1,
            StrictOutcome::Tn => sc.tn += 1,
            StrictOutcome::FailedUnpaused => sc.failed_unpaused += 1,
        }
    }
    sc
}

/// Tasks that need no ask with a needless one / tasks that need none.
fn task_fpr(nonempty: &[&EpisodeResult]) -> TaskFpr {
    let none_needed: Vec<&&EpisodeResult> = nonempty.iter().filter(|r| r.ask_steps.is_empty()).collect();
    let needless = none_needed
        .iter()
        .filter(
            |r| if r.mode == Mode::Strict { r.needless_pause_at.is_some() } else { r.steps.iter().any(|s| s.asked) },
        )
        .count();
    TaskFpr { needless, tasks: none_needed.len(), rate: ratio(needless, none_needed.len()) }
}

/// The (annotated question, agent question) pairs ASK content scores.
fn content_pairs<'a>(nonempty: &[&'a EpisodeResult], mode: Mode, opts: MetricOptions) -> Vec<(&'a str, &'a str)> {
    let early = mode == Mode::Dual && opts.early_ask == EarlyAsk::Positive;
    nonempty
        .iter()
        .flat_map(|r| &r.asks)
        .filter_map(|a| {
            let q = if early && a.credited { a.agent_question.as_deref() } else { a.exact_question.as_deref() };
            q.map(|q| (a.question.as_str(), q))
        })
        .collect()
}

/// The metrics of `mode` over its results, with the open choices set by `opts`.
pub fn compute_with(
    mode: Mode,
    results: &[EpisodeResult],
    scorer: &dyn ContentScorer,
    opts: MetricOptions,
) -> ModeMetrics {
    let first_pause: Vec<EpisodeResult>;
    let results = if mode == Mode::Strict && opts.pause_steps == PauseSteps::First {
        first_pause = results.iter().map(first_pause_step).collect();
        &first_pause[..]
    } else {
        results
    };
    let nonempty: Vec<&EpisodeResult> = results.iter().filter(|r| r.num_steps > 0).collect();
    let t = step_sums(&nonempty, opts);
    let strict_mode = mode == Mode::Strict;
    let step_metric = |v: Option<f64>| if strict_mode { None } else { v };
    let (ask, strict) = if strict_mode {
        let sc = strict_counts(&nonempty);
        let fn_ = sc.fn_missed + sc.fn_late + sc.fn_off_path;
        let c = Counts { tp: sc.tp, fp: sc.fp_early + sc.fp_spurious, fn_, tn: sc.tn };
        (Some(AskTiming::from_counts(c, false)), Some(sc))
    } else if mode.scores_asks() {
        let mut c = Counts::default();
        for r in &nonempty {
            c.add(&step_counts(r, opts));
        }
        (Some(AskTiming::from_counts(c, true)), None)
    } else {
        (None, None)
    };
    let (content, ask_offsets) = if mode.scores_asks() {
        let offsets = nonempty
            .iter()
            .flat_map(|r| &r.asks)
            .filter_map(|a| a.asked_at.map(|at| at as i64 - a.step as i64))
            .collect();
        (Some(content_metrics(&content_pairs(&nonempty, mode, opts), scorer)), offsets)
    } else {
        (None, Vec::new())
    };
    let strict_sr = |pause: bool| {
        let tasks: Vec<&&EpisodeResult> = nonempty.iter().filter(|r| r.ask_steps.is_empty() != pause).collect();
        ratio(tasks.iter().filter(|r| r.success).count(), tasks.len()).filter(|_| strict_mode)
    };
    ModeMetrics {
        mode,
        episodes: nonempty.len(),
        empty_episodes: results.len() - nonempty.len(),
        steps: t.steps,
        correct_steps: t.correct,
        ssr: step_metric(mean(&t.per_episode)),
        sr: ratio(t.successes, nonempty.len()),
        ssr_before: step_metric(mean(&t.before.2)),
        ssr_after: step_metric(mean(&t.after.2)),
        ssr_pooled: step_metric(ratio(t.correct, t.steps)),
        ssr_before_pooled: step_metric(ratio(t.before.1, t.before.0)),
        ssr_after_pooled: step_metric(ratio(t.after.1, t.after.0)),
        steps_before: t.before.0,
        steps_after: t.after.0,
        episodes_before: t.before.2.len(),
        episodes_after: t.after.2.len(),
        ask,
        task_fpr: mode.scores_asks().then(|| task_fpr(&nonempty)),
        content,
        strict,
        sr_pause_required: strict_sr(true),
        sr_no_pause: strict_sr(false),
        step_accuracy: t.by_step,
        ask_offsets,
        ask_behaviour: (mode.scores_asks() && !strict_mode).then(|| ask_behaviour(&nonempty)),
    }
}

/// Mean cosine and METEOR over `(reference, hypothesis)` pairs.
pub fn content_metrics(pairs: &[(&str, &str)], scorer: &dyn ContentScorer) -> ContentMetrics {
    let (cos_off, met_off) = (scorer.cosine_unavailable(), scorer.meteor_unavailable());
    let (mut cos, mut met) = (Vec::new(), Vec::new());
    if cos_off.is_none() || met_off.is_none() {
        for (r, h) in pairs {
            let (c, m) = scorer.score(r, h);
            cos.extend(c);
            met.extend(m);
        }
    }
    let mean = |off: Option<String>, v: &[f64]| match off {
        Some(reason) => Metric::Unavailable(reason),
        None if pairs.is_empty() => Metric::Unavailable("no correct ASK to score".into()),
        None if v.is_empty() => Metric::Unavailable("the metric failed on every pair (see the log)".into()),
        None => Metric::Value(v.iter().sum::<f64>() / v.len() as f64),
    };
    ContentMetrics { pairs: pairs.len(), cosine: mean(cos_off, &cos), meteor: mean(met_off, &met) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_with_empty_denominators_are_none() {
        let t = AskTiming::from_counts(Counts::default(), true);
        assert_eq!((t.precision, t.recall, t.fpr, t.f1), (None, None, None, None));
        // TP 1, FP 1, FN 2, TN 6: P = 1/2, R = 1/3, FPR = 1/7, F1 = 2/(2+1+2) = 0.4 = 2PR/(P+R).
        let t = AskTiming::from_counts(Counts { tp: 1, fp: 1, fn_: 2, tn: 6 }, true);
        assert_eq!(t.precision, Some(0.5));
        assert_eq!(t.recall, Some(1.0 / 3.0));
        assert_eq!(t.fpr, Some(1.0 / 7.0));
        assert_eq!(t.f1, Some(0.4));
        // No positive and no ask (TN only): precision 0/0, recall 0/0, F1 0/(0+0+0): "–"; FPR 0/5 = 0.
        let t = AskTiming::from_counts(Counts { tn: 5, ..Counts::default() }, true);
        assert_eq!((t.precision, t.recall, t.fpr, t.f1), (None, None, Some(0.0), None));
        // Never asked where an ask was needed: precision 0/0 is "–", but recall 0/1 and F1 0/(0+0+1) are
        // real zeros (the agent found none of the asks it had to find).
        let t = AskTiming::from_counts(Counts { fn_: 1, tn: 5, ..Counts::default() }, false);
        assert_eq!((t.precision, t.recall, t.fpr, t.f1), (None, Some(0.0), None, Some(0.0)));
    }

    #[test]
    fn unavailable_metric_is_not_zero() {
        let c = content_metrics(&[("a", "b")], &NoContentScorer("no model".into()));
        assert_eq!(c.cosine, Metric::Unavailable("no model".into()));
        assert_eq!(c.pairs, 1);
    }
}
