//! Every mode and metric on small hand-made episodes, through a scripted fake agent; the expected values
//! are computed by hand in the comments. Also the runner: resume after an interruption, and concurrency 3
//! equal to concurrency 1.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use askgui_data::{Action, Ask, Episode, LoadedEpisode, Turn};
use askgui_eval::agent::{Agent, AgentError, Prediction, StepInput};
use askgui_eval::matching::MatchConfig;
use askgui_eval::metrics::{
    compute, compute_with, AskNegatives, AskStepRule, ContentScorer, EarlyAsk, Metric, MetricOptions, ModeMetrics,
    PauseSteps, StepAccuracy,
};
use askgui_eval::modes::{evaluate_episode, Counts, EpisodeResult, Mode, StrictOutcome};
use askgui_eval::runner::{run_eval, run_mode, EvalConfig, RunOptions};
use common::episode;

/// What the fake agent answers.
#[derive(Clone)]
enum Reply {
    Ask(&'static str),
    /// A wrong action (a `press home`, never annotated here).
    Wrong,
    /// An unparseable reply.
    Garbage,
}

/// Answers from a table keyed by (episode, step, SAY turns in the history); anything not in the table is
/// the annotated action. Ambiguous episodes given their full task are always answered right.
struct Scripted {
    table: HashMap<(&'static str, usize, usize), Reply>,
    gold: HashMap<String, Episode>,
    full_tasks: HashSet<String>,
    /// Every call's (episode, step, history), in order.
    seen: Mutex<Vec<(String, usize, Vec<Turn>)>>,
}

/// The agent for `eps` with `table` (see [`Scripted`]).
fn scripted(eps: &[LoadedEpisode], table: &[((&'static str, usize, usize), Reply)]) -> Scripted {
    Scripted {
        table: table.iter().cloned().collect(),
        gold: eps.iter().map(|e| (e.episode.id.clone(), e.episode.clone())).collect(),
        full_tasks: eps.iter().filter(|e| e.episode.is_ambiguous()).map(|e| e.episode.task.clone()).collect(),
        seen: Mutex::new(Vec::new()),
    }
}

impl Agent for Scripted {
    fn name(&self) -> String {
        "scripted".into()
    }

    fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError> {
        let ep = self.gold.get(&input.episode_id).ok_or_else(|| AgentError::Input("unknown episode".into()))?;
        self.seen.lock().unwrap().push((input.episode_id.clone(), input.step, input.history.clone()));
        let says = input.history.iter().filter(|t| matches!(t, Turn::Say { .. })).count();
        let key = (ep.id.as_str(), input.step, says);
        let scripted = if self.full_tasks.contains(&input.task) {
            None
        } else {
            self.table.iter().find(|(k, _)| **k == key).map(|(_, r)| r.clone())
        };
        let action = match scripted {
            None => Some(ep.steps[input.step].action.clone()),
            Some(Reply::Ask(q)) => Some(Action::Ask(Ask { question: q.into(), options: vec![], kind: None })),
            Some(Reply::Wrong) => Some(Action::Press { key: "home".into() }),
            Some(Reply::Garbage) => None,
        };
        Ok(match action {
            Some(a) => Prediction { raw: a.render(), action: Some(a), parse_error: None, ask_probability: None },
            None => Prediction {
                action: None,
                raw: "I think I'd tap".into(),
                parse_error: Some("no JSON".into()),
                ask_probability: None,
            },
        })
    }
}

fn fixture() -> (Vec<LoadedEpisode>, Scripted) {
    let mut eps = vec![
        episode("e1_exact", 4, &[(2, "Which flavour do you want?")], true),
        episode("e2_early", 5, &[(3, "What flavour?")], true),
        episode("e3_late", 4, &[(1, "Which date?")], true),
        episode("e4_needless", 3, &[], false),
        episode("e5_missing", 3, &[(1, "Which account?")], true),
        episode("e6_two", 5, &[(1, "Which size?"), (3, "Which milk?")], true),
        episode("e7_empty", 0, &[], true),
        episode("e8_plain", 2, &[], false),
        episode("e9_fails", 2, &[], false),
    ];
    for (i, e) in eps.iter_mut().enumerate() {
        e.line = i + 1;
    }
    use Reply::*;
    let table = [
        (("e1_exact", 2, 0), Ask("Which flavour do you want?")),
        (("e2_early", 1, 0), Ask("What flavour?")),
        (("e2_early", 2, 0), Wrong),
        (("e2_early", 3, 0), Wrong),
        (("e3_late", 1, 0), Wrong),
        (("e3_late", 2, 0), Ask("Which day?")),
        (("e3_late", 2, 1), Ask("Which day?")),
        (("e4_needless", 1, 0), Ask("Sure?")),
        (("e4_needless", 2, 0), Garbage),
        (("e5_missing", 1, 0), Wrong),
        (("e6_two", 1, 0), Ask("What size?")),
        (("e6_two", 2, 1), Ask("Which milk?")),
        (("e6_two", 3, 1), Wrong),
        (("e9_fails", 1, 0), Wrong),
    ];
    let agent = scripted(&eps, &table);
    (eps, agent)
}

/// Cosine 1 for equal questions, 0.5 otherwise; METEOR unavailable.
struct FakeText;

impl ContentScorer for FakeText {
    fn cosine_unavailable(&self) -> Option<String> {
        None
    }
    fn meteor_unavailable(&self) -> Option<String> {
        Some("WordNet not found".into())
    }
    fn score(&self, r: &str, h: &str) -> (Option<f64>, Option<f64>) {
        (Some(if r == h { 1.0 } else { 0.5 }), None)
    }
}

fn run(mode: Mode) -> (Vec<EpisodeResult>, ModeMetrics) {
    let (results, _) = fixture_results(mode);
    let m = compute(mode, &results, &FakeText);
    (results, m)
}

/// The fixture's results in `mode` (twice, for the tests that score them again).
fn fixture_results(mode: Mode) -> (Vec<EpisodeResult>, Vec<EpisodeResult>) {
    let (eps, agent) = fixture();
    let results = evaluate(&agent, &eps, mode);
    (results.clone(), results)
}

fn evaluate(agent: &dyn Agent, eps: &[LoadedEpisode], mode: Mode) -> Vec<EpisodeResult> {
    eps.iter().map(|e| evaluate_episode(agent, e, mode, &MatchConfig::default()).unwrap()).collect()
}

fn correct_steps(r: &EpisodeResult) -> Vec<bool> {
    r.steps.iter().map(|s| s.correct).collect()
}

fn close(a: Option<f64>, b: f64) {
    let a = a.expect("a value");
    assert!((a - b).abs() < 1e-12, "{a} != {b}");
}

#[test]
fn original_task() {
    let (res, m) = run(Mode::Original);
    // Full tasks of ambiguous episodes are answered right: e1 4/4, e2 5/5, e3 4/4, e5 3/3, e6 5/5, e8 2/2;
    // e4 (not ambiguous: the script applies) 1/3 (ask, garbage); e9 1/2. 25 of 28 steps; SR 6/8.
    assert_eq!((m.episodes, m.empty_episodes, m.steps, m.correct_steps), (8, 1, 28, 25));
    // Navi-plus F.1, per episode: (6 x 1 + 1/3 + 1/2) / 8 = (41/6) / 8 = 41/48; pooled 25/28.
    close(m.ssr, 41.0 / 48.0);
    close(m.ssr_pooled, 25.0 / 28.0);
    close(m.sr, 6.0 / 8.0);
    // Before the first annotated step: e1 2, e2 3, e3 1, e5 1, e6 1 steps, all right; after: all right.
    close(m.ssr_before, 1.0);
    close(m.ssr_after, 1.0);
    assert_eq!((m.episodes_before, m.episodes_after), (5, 5));
    assert!(m.ask.is_none() && m.content.is_none() && m.task_fpr.is_none());
    assert_eq!(res[3].calls[2].raw, "I think I'd tap");
}

#[test]
fn incomplete_task() {
    let (res, m) = run(Mode::Incomplete);
    // Asks are never answered (no SAY in any history): e1 3/4 (ask at 2), e2 2/5 (1 ask, 2 and 3 wrong),
    // e3 2/4 (1 wrong, 2 ask), e4 1/3, e5 2/3, e6 4/5 (ask at 1), e8 2/2, e9 1/2: 17/28; SR 1/8 (e8).
    let per: Vec<usize> = res.iter().map(|r| r.steps.iter().filter(|s| s.correct).count()).collect();
    assert_eq!(per, [3, 2, 2, 1, 2, 4, 0, 2, 1]);
    // Per episode: 3/4 + 2/5 + 2/4 + 1/3 + 2/3 + 4/5 + 1 + 1/2 = 4.95, over 8 = 0.61875.
    close(m.ssr, 4.95 / 8.0);
    close(m.ssr_pooled, 17.0 / 28.0);
    close(m.sr, 1.0 / 8.0);
    assert!(res.iter().all(|r| r.calls.iter().all(|c| !c.answered)));
    assert!(m.ask.is_none());
}

#[test]
fn standard_with_ask() {
    let (res, m) = run(Mode::Standard);
    // At an annotated step the action is predicted again after the annotated QA pair, asked or not.
    assert_eq!(correct_steps(&res[0]), [true, true, true, true]); // asked at 2, then right with the answer
    assert_eq!(correct_steps(&res[1]), [true, false, false, true, true]); // early ask is a wrong step
    assert_eq!(correct_steps(&res[2]), [true, true, false, true]); // missed at 1 (acts right after QA), late ask at 2
    assert_eq!(correct_steps(&res[3]), [true, false, false]); // needless ask, then garbage
    assert_eq!(correct_steps(&res[4]), [true, true, true]); // never asks, acts right after the QA pair
    assert_eq!(correct_steps(&res[5]), [true, true, false, true, true]); // ask at 1; early ask at 2
    assert!(res[6].steps.is_empty() && res[6].calls.is_empty());
    // e1 re-predicts step 2 after the QA pair: 5 calls, the 4th answered.
    assert_eq!(res[0].calls.len(), 5);
    assert!(res[0].calls[3].answered && res[0].calls[3].step == 2);
    // Per episode: 1 + 3/5 + 3/4 + 1/3 + 1 + 4/5 + 1 + 1/2 = 359/60, over 8 = 359/480; pooled 21/28.
    close(m.ssr, 359.0 / 480.0);
    close(m.ssr_pooled, 0.75);
    // SR: e1, e5, e8.
    close(m.sr, 3.0 / 8.0);
    // Before: e1 1, e2 1/3, e3 1, e5 1, e6 1 -> 13/15 (pooled 6/8); after: e1 1, e2 1, e3 2/3, e5 1, e6 3/4
    // -> (53/12) / 5 = 53/60 (pooled 11/13).
    close(m.ssr_before, 13.0 / 15.0);
    close(m.ssr_after, 53.0 / 60.0);
    close(m.ssr_before_pooled, 0.75);
    close(m.ssr_after_pooled, 11.0 / 13.0);
    // One unit per step. TP: e1@2, e6@1 = 2. FN: e2@3, e3@1, e5@1, e6@3 = 4. FP: e2@1, e3@2, e4@1, e6@2 = 4.
    // TN: 28 - 10 = 18 (e1 3, e2 3, e3 2, e4 2, e5 2, e6 2, e8 2, e9 2).
    let t = m.ask.as_ref().unwrap();
    assert_eq!(t.counts, Counts { tp: 2, fp: 4, fn_: 4, tn: 18 });
    close(t.precision, 2.0 / 6.0);
    close(t.recall, 2.0 / 6.0);
    close(t.fpr, 4.0 / 22.0);
    close(t.f1, 4.0 / 12.0); // 2TP / (2TP + FP + FN)
                             // Per task: of e4, e8, e9 (no annotated step), e4 asked.
    let task = m.task_fpr.as_ref().unwrap();
    assert_eq!((task.needless, task.tasks), (1, 3));
    // Content over exact asks: e1 (same question: 1.0), e6@1 ("What size?" vs "Which size?": 0.5).
    let c = m.content.as_ref().unwrap();
    assert_eq!(c.pairs, 2);
    assert_eq!(c.cosine, Metric::Value(0.75));
    assert_eq!(c.meteor, Metric::Unavailable("WordNet not found".into()));
    // First asks around each annotated step: e1 2-2, e2 1-3, e3 2-1, e6 1-1 and 2-3.
    assert_eq!(m.ask_offsets, [0, -2, 1, 0, -1]);
    // Step index 1: right in e1, e3, e5, e6, e8 (of 8 episodes).
    assert_eq!(m.step_accuracy[1], StepAccuracy { step: 1, correct: 5, total: 8 });
}

#[test]
fn dual_stream() {
    let (res, m) = run(Mode::Dual);
    // e2: the ask at 1 (before the annotated 3) counts; steps 1..=3 are predicted again after the
    // annotated QA pair (one SAY in the history) and are right: 5/5.
    assert_eq!(correct_steps(&res[1]), [true; 5]);
    let second: Vec<usize> = res[1].calls.iter().filter(|c| c.stream == 2).map(|c| c.step).collect();
    assert_eq!(second, [1, 2, 3]);
    assert!(res[1].asks[0].credited && !res[1].asks[0].exact && res[1].asks[0].asked_at == Some(1));
    // e3: the late ask does not count.
    assert_eq!(correct_steps(&res[2]), [true, true, false, true]);
    assert!(!res[2].asks[0].credited);
    // e6: exact at 1, early (2) for 3: both credited, all right.
    assert_eq!(correct_steps(&res[5]), [true; 5]);
    assert!(res[5].asks.iter().all(|a| a.credited));
    // Per episode: 1 + 1 + 3/4 + 1/3 + 1 + 1 + 1 + 1/2 = 79/12, over 8 = 79/96; pooled 24/28.
    close(m.ssr, 79.0 / 96.0);
    close(m.ssr_pooled, 24.0 / 28.0);
    // SR: e1, e2, e5, e6, e8.
    close(m.sr, 5.0 / 8.0);
    // Before: all right -> 1; after: e1 1, e2 1, e3 2/3, e5 1, e6 1 -> 14/15.
    close(m.ssr_before, 1.0);
    close(m.ssr_after, 14.0 / 15.0);
    // The positive is the exact ask, as in +ASK: TP e1@2, e6@1; FN e2@3, e3@1, e5@1, e6@3 (recall 2/6 in
    // both rows). The credited early asks (e2@1, e6@2) are true negatives: FP e3@2, e4@1 = 2 of the same
    // 22 negatives as +ASK, TN 20.
    let t = m.ask.as_ref().unwrap();
    assert_eq!(t.counts, Counts { tp: 2, fp: 2, fn_: 4, tn: 20 });
    close(t.precision, 0.5);
    close(t.recall, 2.0 / 6.0);
    close(t.fpr, 2.0 / 22.0);
    close(t.f1, 0.4); // 4 / (4 + 2 + 4)
                      // Content on the exact asks, as +ASK: e1 1.0, e6@1 0.5.
    let c = m.content.as_ref().unwrap();
    assert_eq!((c.pairs, c.cosine.clone()), (2, Metric::Value(0.75)));
    assert_eq!(m.ask_offsets, [0, -2, 1, 0, -1]);
    // The early-ask-as-positive variant: TP e1, e2, e6 x2 = 4, FN e3, e5 = 2; e2@1 and e6@2 leave the
    // negatives (20), FP 2, TN 18; content on the early questions: 1.0, 1.0, 0.5, 1.0 -> 0.875.
    let (_, eps) = fixture_results(Mode::Dual);
    let opts = MetricOptions { early_ask: EarlyAsk::Positive, ..MetricOptions::default() };
    let v = compute_with(Mode::Dual, &eps, &FakeText, opts);
    assert_eq!(v.ask.as_ref().unwrap().counts, Counts { tp: 4, fp: 2, fn_: 2, tn: 18 });
    assert_eq!(v.content.as_ref().unwrap().cosine, Metric::Value(0.875));
}

#[test]
fn strict_pauses() {
    let (res, m) = run(Mode::Strict);
    let outcomes: Vec<Option<StrictOutcome>> = res.iter().map(|r| r.strict).collect();
    use StrictOutcome::*;
    assert_eq!(
        outcomes,
        [
            Some(Tp),
            Some(FpEarly),
            Some(FnLate),
            Some(FpSpurious),
            Some(FnMissed),
            Some(FpEarly),
            None,
            Some(Tn),
            Some(FailedUnpaused)
        ]
    );
    // e1 stops at its (only) pause: 3 calls. e6 pauses right at 1, acts right on the answer, then pauses
    // early at 2 (before 3): 4 calls.
    assert_eq!(res[0].calls.len(), 3);
    assert_eq!(res[5].calls.len(), 4);
    assert_eq!(res[5].asks[0].asked_at, Some(1));
    assert!(res[5].asks[0].credited);
    assert_eq!(res[5].asks[1].asked_at, Some(2));
    // TP 1 (e1), FP 3 (e2, e4, e6), FN 2 (e3, e5), TN 1 (e8); e9 is left out. Morae reports no FPR.
    let t = m.ask.as_ref().unwrap();
    assert_eq!(t.counts, Counts { tp: 1, fp: 3, fn_: 2, tn: 1 });
    close(t.precision, 0.25);
    close(t.recall, 1.0 / 3.0);
    assert_eq!(t.fpr, None);
    close(t.f1, 2.0 / 7.0);
    // Task success: e1 (TP) and e8 (TN) of 8; 1 of the 5 pause tasks, 1 of the 3 others.
    close(m.sr, 0.25);
    close(m.sr_pause_required, 0.2);
    close(m.sr_no_pause, 1.0 / 3.0);
    assert!(m.ssr.is_none());
    let s = m.strict.as_ref().unwrap();
    assert_eq!((s.failed_unpaused, s.fn_late, s.fn_missed, s.fn_off_path), (1, 1, 1, 0));
    // Per task: e4 paused needlessly (at 1), e8 and e9 never did: 1/3.
    assert_eq!(res[3].needless_pause_at, Some(1));
    let task = m.task_fpr.as_ref().unwrap();
    assert_eq!((task.needless, task.tasks), (1, 3));
    // Content: e1 1.0 and e6@1 0.5.
    assert_eq!(m.content.as_ref().unwrap().cosine, Metric::Value(0.75));
    assert_eq!(m.ask_offsets, [0, -2, 1, 0, -1]);
}

/// `eps` (lines numbered) and their results in `mode` with the script `table`.
fn case(
    mut eps: Vec<LoadedEpisode>,
    table: &[((&'static str, usize, usize), Reply)],
    mode: Mode,
) -> (Vec<EpisodeResult>, ModeMetrics, Scripted) {
    for (i, e) in eps.iter_mut().enumerate() {
        e.line = i + 1;
    }
    let agent = scripted(&eps, table);
    let results = evaluate(&agent, &eps, mode);
    let m = compute(mode, &results, &FakeText);
    (results, m, agent)
}

#[test]
fn ssr_is_a_mean_over_episodes_not_over_steps() {
    // Case 1 of the review against the papers: a 2-step episode with 1 right step and an 8-step episode all right.
    let eps = vec![episode("short", 2, &[], false), episode("long", 8, &[], false)];
    let (_, m, _) = case(eps, &[(("short", 1, 0), Reply::Wrong)], Mode::Original);
    // Navi-plus F.1: (1/2 + 8/8) / 2 = 0.75; pooled over steps: 9/10 = 0.9. F.3: 1 of 2 episodes.
    close(m.ssr, 0.75);
    close(m.ssr_pooled, 0.9);
    close(m.sr, 0.5);
    // Neither has an annotated ASK step: no before/after.
    assert_eq!((m.ssr_before, m.ssr_after, m.episodes_before), (None, None, 0));
}

#[test]
fn a_perfect_actor_that_never_asks_loses_only_ask_recall() {
    // Case 2 of the review against the papers: 4 steps, the annotated ASK at step 1; the agent always acts right and never asks.
    let eps = || vec![episode("never", 4, &[(1, "Which size?")], true)];
    let (_, original, _) = case(eps(), &[], Mode::Original);
    let (res, m, _) = case(eps(), &[], Mode::Standard);
    // The step-1 action is scored after the annotated QA pair: right. SSR 4/4, SR 1, after (steps 1..=3)
    // 3/3, equal to the original task's row (Table 1: +ASK "after" 70.3 against 70.2).
    close(m.ssr, 1.0);
    close(m.sr, 1.0);
    close(m.ssr_after, 1.0);
    assert_eq!(m.ssr_after, original.ssr_after);
    // ASK timing: the annotated step is a FN; steps 0, 2, 3 are TN. Recall 0, precision undefined,
    // F1 = 0 / (0 + 0 + 1) = 0, FPR 0/3.
    let t = m.ask.as_ref().unwrap();
    assert_eq!(t.counts, Counts { tp: 0, fp: 0, fn_: 1, tn: 3 });
    assert_eq!((t.precision, t.recall, t.f1, t.fpr), (None, Some(0.0), Some(0.0), Some(0.0)));
    // askgui's earlier rule (the ask step right only if asked): after 2/3, SR 0.
    let old = compute_with(
        Mode::Standard,
        &res,
        &FakeText,
        MetricOptions { ask_step: AskStepRule::RequireAsk, ..MetricOptions::default() },
    );
    close(old.ssr_after, 2.0 / 3.0);
    close(old.sr, 0.0);
}

#[test]
fn only_pause_tasks_have_no_task_fpr() {
    // Case 3 of the review against the papers: four tasks that need a pause at step 2; p1..p3 pause there, p4 pauses early at 1.
    use Reply::Ask;
    let eps = || (1..=4).map(|k| episode(["p1", "p2", "p3", "p4"][k - 1], 4, &[(2, "Which one?")], true)).collect();
    let table = [
        (("p1", 2, 0), Ask("Which one?")),
        (("p2", 2, 0), Ask("Which one?")),
        (("p3", 2, 0), Ask("Which one?")),
        (("p4", 1, 0), Ask("Which one?")),
    ];
    let (_, m, _) = case(eps(), &table, Mode::Strict);
    // Morae §5.1: TP 3, FP 1 (early), FN 0, TN 0: precision 3/4, recall 1, F1 6/(6+1) = 6/7. No FPR: with
    // no task that needs none there is no per-task rate (the old strict FPR read 1/(1+0) = 1.0).
    let t = m.ask.as_ref().unwrap();
    assert_eq!(t.counts, Counts { tp: 3, fp: 1, fn_: 0, tn: 0 });
    close(t.precision, 0.75);
    close(t.recall, 1.0);
    close(t.f1, 6.0 / 7.0);
    assert_eq!(t.fpr, None);
    assert_eq!(m.task_fpr.as_ref().map(|f| (f.tasks, f.rate)), Some((0, None)));
    close(m.sr, 0.75);
    // Per step: +ASK counts p4's early ask as FP among the 12 steps that need none (3 per task): 1/12;
    // Dual-Stream credits it: 0/12.
    let (_, standard, _) = case(eps(), &table, Mode::Standard);
    let (_, dual, _) = case(eps(), &table, Mode::Dual);
    close(standard.ask.as_ref().unwrap().fpr, 1.0 / 12.0);
    close(dual.ask.as_ref().unwrap().fpr, 0.0);
}

#[test]
fn strict_needs_the_steps_before_a_pause_right() {
    // Case 4 of the review against the papers. "derail": step 0 wrong, then the pause exactly at 2; "after": a right pause at 1,
    // then a wrong action on the answer before the pause at 3; "onpath": every step right and the pause
    // at 2.
    use Reply::{Ask, Wrong};
    let eps = vec![
        episode("derail", 4, &[(2, "Which one?")], true),
        episode("after", 5, &[(1, "Which size?"), (3, "Which milk?")], true),
        episode("onpath", 4, &[(2, "Which one?")], true),
    ];
    let table = [
        (("derail", 0, 0), Wrong),
        (("derail", 2, 0), Ask("Which one?")),
        (("after", 1, 0), Ask("Which size?")),
        (("after", 1, 1), Wrong),
        (("after", 3, 1), Ask("Which milk?")),
        (("onpath", 2, 0), Ask("Which one?")),
    ];
    let (res, m, _) = case(eps, &table, Mode::Strict);
    // Online the agent would leave the path at the wrong step and never reach the pause: FN, not TP.
    let outcomes: Vec<_> = res.iter().map(|r| r.strict).collect();
    use StrictOutcome::{FnOffPath, Tp};
    assert_eq!(outcomes, [Some(FnOffPath), Some(FnOffPath), Some(Tp)]);
    // The walk stops at the wrong step: "derail" asked once; "after": 0, 1 (pause), 1 (answered).
    assert_eq!((res[0].calls.len(), res[1].calls.len()), (1, 3));
    // TP 1, FN 2: precision 1, recall 1/3, F1 2/(2+0+2) = 0.5; task success 1/3.
    let t = m.ask.as_ref().unwrap();
    assert_eq!(t.counts, Counts { tp: 1, fp: 0, fn_: 2, tn: 0 });
    close(t.f1, 0.5);
    close(m.sr, 1.0 / 3.0);
    assert_eq!(m.strict.as_ref().unwrap().fn_off_path, 2);
}

#[test]
fn dual_early_ask_keeps_recall_and_inserts_the_annotated_pair() {
    // Case 5 of the review against the papers: 5 steps, the annotated ASK at 3 ("Which milk?"); the agent asks its own question
    // at 1 and nowhere else.
    let eps = || vec![episode("early", 5, &[(3, "Which milk?")], true)];
    let table = [(("early", 1, 0), Reply::Ask("Is it oat?"))];
    let (_, standard, _) = case(eps(), &table, Mode::Standard);
    let (res, dual, agent) = case(eps(), &table, Mode::Dual);
    // +ASK: the ask at 1 is a wrong step and a FP; step 3 is a FN (no ask there). Dual-Stream: the early
    // ask is credited (a TN: Dual calls it right), steps 1..=3 are predicted again and right: SSR 5/5.
    let (s, d) = (standard.ask.as_ref().unwrap(), dual.ask.as_ref().unwrap());
    assert_eq!(s.counts, Counts { tp: 0, fp: 1, fn_: 1, tn: 3 });
    assert_eq!(d.counts, Counts { tp: 0, fp: 0, fn_: 1, tn: 4 });
    // Recall 0 in both rows, the FPR over the same 4 steps: 1/4 and 0/4.
    assert_eq!((s.recall, d.recall), (Some(0.0), Some(0.0)));
    assert_eq!((s.fpr, d.fpr), (Some(0.25), Some(0.0)));
    close(standard.ssr, 4.0 / 5.0);
    close(dual.ssr, 1.0);
    assert!(res[0].asks[0].credited && !res[0].asks[0].exact);
    // Content is scored on exact asks only: none here, in both rows.
    assert_eq!(dual.content.as_ref().unwrap().pairs, 0);
    // Algorithm 1 inserts the ASK QA pair: the annotated question and answer, not the agent's question.
    let seen = agent.seen.lock().unwrap();
    let (_, _, h) = seen.iter().find(|(_, step, h)| *step == 1 && h.len() == 3).expect("the second stream at 1");
    let asked = Action::Ask(Ask { question: "Which milk?".into(), options: vec![], kind: None });
    assert_eq!(h[1..], [Turn::Agent { action: asked }, Turn::Say { text: "answer to Which milk?".into() }]);
}

#[test]
fn dual_credits_an_early_ask_also_when_the_agent_asks_at_the_annotated_step() {
    // 5 steps, the annotated ASK at 3 ("Which milk?"); the agent asks at 1 (early) and again at 3 (exact),
    // and acts right everywhere else, and on every prediction after a QA pair.
    let eps = || vec![episode("both", 5, &[(3, "Which milk?")], true)];
    let table = [(("both", 1, 0), Reply::Ask("Which milk?")), (("both", 3, 0), Reply::Ask("Which milk?"))];
    let (res, dual, _) = case(eps(), &table, Mode::Dual);
    // Algorithm 1: the first ask of the window is at 1 <= 3, so it is credited, and steps 1..=3 are
    // predicted again with the annotated QA pair at 1: all right, and no ask at 2 in the second stream.
    let o = &res[0].asks[0];
    assert!((o.credited, o.exact, o.asked_at) == (true, true, Some(1)));
    assert_eq!(correct_steps(&res[0]), [true; 5]);
    // By hand, the stated rule (a credited early ask is a TN in Dual): positive step 3 asked exactly: TP 1,
    // FN 0. Negatives are the steps 0, 1, 2, 4: 0 and 4 no ask (TN), 1 the credited early ask (TN), 2 the
    // second stream's decision, no ask (TN): FP 0, TN 4. P = 1/1, R = 1/1, FPR = 0/4, F1 = 2/(2+0+0) = 1.
    let d = dual.ask.as_ref().unwrap();
    assert_eq!(d.counts, Counts { tp: 1, fp: 0, fn_: 0, tn: 4 });
    assert_eq!((d.precision, d.recall, d.fpr, d.f1), (Some(1.0), Some(1.0), Some(0.0), Some(1.0)));
    // +ASK gives no credit: the ask at 1 is a FP among the same 4 negatives (TN 0, 2, 4), the exact ask TP.
    let (_, standard, _) = case(eps(), &table, Mode::Standard);
    assert_eq!(standard.ask.as_ref().unwrap().counts, Counts { tp: 1, fp: 1, fn_: 0, tn: 3 });
    // Early ask as the positive: the exact ask is the TP already; step 1 leaves the negatives: TN 0, 2, 4.
    let opts = MetricOptions { early_ask: EarlyAsk::Positive, ..MetricOptions::default() };
    let v = compute_with(Mode::Dual, &res, &FakeText, opts);
    assert_eq!(v.ask.as_ref().unwrap().counts, Counts { tp: 1, fp: 0, fn_: 0, tn: 3 });
}

#[test]
fn the_reprediction_after_the_qa_pair_as_a_negative() {
    // 3 steps, annotated ASK at 1; the agent asks at 1, and again at 1 once the QA pair is in its history.
    let eps = || vec![episode("again", 3, &[(1, "Which one?")], true)];
    let table = [(("again", 1, 0), Reply::Ask("Which one?")), (("again", 1, 1), Reply::Ask("Which one?"))];
    let (res, m, _) = case(eps(), &table, Mode::Standard);
    // Default: one unit per step. TP at 1, TN at 0 and 2; the second ask only makes step 1's action wrong.
    assert_eq!(m.ask.as_ref().unwrap().counts, Counts { tp: 1, fp: 0, fn_: 0, tn: 2 });
    assert_eq!(correct_steps(&res[0]), [true, false, true]);
    // Counting the re-prediction as a negative: its ask is a FP (FPR 1/3 instead of 0/2).
    let opts = MetricOptions { ask_negatives: AskNegatives::WithReprediction, ..MetricOptions::default() };
    let v = compute_with(Mode::Standard, &res, &FakeText, opts);
    assert_eq!(v.ask.as_ref().unwrap().counts, Counts { tp: 1, fp: 1, fn_: 0, tn: 2 });
    close(v.ask.as_ref().unwrap().fpr, 1.0 / 3.0);
    // The fixture's six annotated steps are all re-predicted without an ask: six more TNs (18 -> 24).
    let (_, six) = fixture_results(Mode::Standard);
    let v = compute_with(Mode::Standard, &six, &FakeText, opts);
    assert_eq!(v.ask.as_ref().unwrap().counts, Counts { tp: 2, fp: 4, fn_: 4, tn: 24 });
}

#[test]
fn strict_with_the_first_annotated_step_as_the_pause_step() {
    // The fixture's e6 pauses right at 1, acts right on the answer, then pauses early at 2 (before 3):
    // FP by default. With step 1 as its one pause step it is a TP and a success; nothing else changes
    // (every other verdict is reached at or before the first annotated step). Default TP 1, FP 3, FN 2,
    // TN 1 -> TP 2, FP 2, FN 2, TN 1; task success 2/8 -> 3/8, of the pause tasks 1/5 -> 2/5.
    let (res, _) = fixture_results(Mode::Strict);
    let opts = MetricOptions { pause_steps: PauseSteps::First, ..MetricOptions::default() };
    let m = compute_with(Mode::Strict, &res, &FakeText, opts);
    assert_eq!(m.ask.as_ref().unwrap().counts, Counts { tp: 2, fp: 2, fn_: 2, tn: 1 });
    close(m.sr, 3.0 / 8.0);
    close(m.sr_pause_required, 2.0 / 5.0);
    // A right pause at the first step then a wrong action on its answer ("after" of the off-path test):
    // FN off path by default, a TP here.
    use Reply::{Ask, Wrong};
    let eps = vec![episode("after", 5, &[(1, "Which size?"), (3, "Which milk?")], true)];
    let table = [(("after", 1, 0), Ask("Which size?")), (("after", 1, 1), Wrong)];
    let (res, m, _) = case(eps, &table, Mode::Strict);
    assert_eq!(m.ask.as_ref().unwrap().counts, Counts { tp: 0, fp: 0, fn_: 1, tn: 0 });
    let v = compute_with(Mode::Strict, &res, &FakeText, opts);
    assert_eq!(v.ask.as_ref().unwrap().counts, Counts { tp: 1, fp: 0, fn_: 0, tn: 0 });
    close(v.sr, 1.0);
}

#[test]
fn an_ask_at_step_0_has_no_before() {
    let eps = || vec![episode("zero", 3, &[(0, "Which one?")], true)];
    let table = [(("zero", 0, 0), Reply::Ask("Which one?"))];
    for mode in [Mode::Standard, Mode::Dual] {
        let (res, m, _) = case(eps(), &table, mode);
        // TP at 0; step 0 acted right after the QA pair; T_before = 0, so the episode is not in the
        // before average (F.2 divides by T_before(e)): before undefined, after 3/3.
        assert_eq!(m.ask.as_ref().unwrap().counts, Counts { tp: 1, fp: 0, fn_: 0, tn: 2 });
        assert_eq!((m.ssr_before, m.episodes_before), (None, 0));
        close(m.ssr_after, 1.0);
        assert_eq!(res[0].asks[0].asked_at, Some(0));
    }
    let (res, m, _) = case(eps(), &table, Mode::Strict);
    assert_eq!((res[0].strict, res[0].calls.len()), (Some(StrictOutcome::Tp), 1));
    close(m.sr, 1.0);
}

#[test]
fn tasks_without_an_ask_count_in_the_ask_fpr_acted_right_or_not() {
    // "plain" asks needlessly at 2 after two right steps; "wrong" acts wrong at 0, then asks at 2; "quiet"
    // acts right and never asks; "needs" has its annotated ASK at 1 and asks there.
    use Reply::{Ask, Wrong};
    let eps = || {
        vec![
            episode("plain", 3, &[], false),
            episode("wrong", 3, &[], false),
            episode("quiet", 3, &[], false),
            episode("needs", 2, &[(1, "Which one?")], true),
        ]
    };
    let table = [
        (("plain", 2, 0), Ask("Sure?")),
        (("wrong", 0, 0), Wrong),
        (("wrong", 2, 0), Ask("Sure?")),
        (("needs", 1, 0), Ask("Which one?")),
    ];
    let (res, m, _) = case(eps(), &table, Mode::Strict);
    use StrictOutcome::{FailedUnpaused, FpSpurious, Tn, Tp};
    let outcomes: Vec<_> = res.iter().map(|r| r.strict).collect();
    assert_eq!(outcomes, [Some(FpSpurious), Some(FailedUnpaused), Some(Tn), Some(Tp)]);
    // Per task: "plain" and "wrong" asked needlessly (with ground-truth history), of the 3 tasks that
    // need none: 2/3, though Morae leaves "wrong" out of its matrix (TP 1, FP 1, TN 1).
    assert_eq!(res[1].needless_pause_at, Some(2));
    let f = m.task_fpr.as_ref().unwrap();
    assert_eq!((f.needless, f.tasks), (2, 3));
    assert_eq!(m.ask.as_ref().unwrap().counts, Counts { tp: 1, fp: 1, fn_: 0, tn: 1 });
    // Morae's task success: "needs" 1/1 of the pause tasks, "quiet" 1/3 of the others.
    close(m.sr_pause_required, 1.0);
    close(m.sr_no_pause, 1.0 / 3.0);
    // +ASK: episodes without an annotated step have no before/after; only "needs" (before: step 0,
    // after: step 1) is averaged. Per step: FP plain@2, wrong@2 among 3 + 3 + 3 + 1 = 10 steps needing none.
    let (_, m, _) = case(eps(), &table, Mode::Standard);
    assert_eq!((m.episodes_before, m.episodes_after), (1, 1));
    close(m.ask.as_ref().unwrap().fpr, 0.2);
    // SSR per episode: plain 2/3, wrong 1/3 (0 wrong, 2 an ask), quiet 1, needs 1 -> 3/4.
    close(m.ssr, 0.75);
}

#[test]
fn no_episodes_at_all() {
    for mode in Mode::ALL {
        let m = compute(mode, &[], &FakeText);
        assert_eq!((m.episodes, m.ssr, m.sr), (0, None, None));
    }
}

/// Fails on its first call for the 2nd episode, once; counts calls.
struct Flaky {
    inner: Scripted,
    failed: Mutex<bool>,
    calls: AtomicUsize,
}

impl Agent for Flaky {
    fn name(&self) -> String {
        "flaky".into()
    }
    fn predict(&self, input: &StepInput) -> Result<Prediction, AgentError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if input.episode_id == "e2_early" {
            let mut failed = self.failed.lock().unwrap();
            if !*failed {
                *failed = true;
                return Err(AgentError::Transport { url: "fake".into(), reason: "connection reset".into() });
            }
        }
        self.inner.predict(input)
    }
}

#[test]
fn runner_resumes_and_concurrency_does_not_change_results() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("askgui-eval-runner-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (eps, agent) = fixture();
    let opts = |concurrency| RunOptions { concurrency, progress: false };
    let m = MatchConfig::default();

    // Reference: concurrency 1, no interruption.
    let one = dir.join("one.jsonl");
    let _ = std::fs::remove_file(&one);
    let reference = run_mode(&agent, &eps, Mode::Dual, &m, &one, &opts(1))?;
    assert_eq!(reference.len(), eps.len());

    // Concurrency 3 gives the same results, in episode order.
    let three = dir.join("three.jsonl");
    let _ = std::fs::remove_file(&three);
    assert_eq!(run_mode(&agent, &eps, Mode::Dual, &m, &three, &opts(3))?, reference);

    // Interrupted on the 2nd episode, then resumed: the first episode is not asked again.
    let flaky = Flaky { inner: fixture().1, failed: Mutex::new(false), calls: AtomicUsize::new(0) };
    let resumed = dir.join("resumed.jsonl");
    let _ = std::fs::remove_file(&resumed);
    let err = run_mode(&flaky, &eps, Mode::Dual, &m, &resumed, &opts(1)).unwrap_err();
    assert!(err.to_string().contains("connection reset"), "{err}");
    let written = std::fs::read_to_string(&resumed)?;
    assert_eq!(written.lines().count(), 1, "only e1 finished");
    // A truncated last line (a crash mid-write) is dropped and redone.
    std::fs::write(&resumed, format!("{written}{{\"id\":\"e2_ea"))?;
    let before = flaky.calls.load(Ordering::SeqCst);
    let again = run_mode(&flaky, &eps, Mode::Dual, &m, &resumed, &opts(3))?;
    assert_eq!(again, reference);
    // e1 (5 calls in Dual) was not re-run: all calls minus e1's, as in the reference.
    let total: usize = reference.iter().map(|r| r.calls.len()).sum();
    assert_eq!(flaky.calls.load(Ordering::SeqCst) - before, total - reference[0].calls.len());
    assert_eq!(std::fs::read_to_string(&resumed)?.lines().count(), eps.len());
    // A finished file is not re-run at all.
    let before = flaky.calls.load(Ordering::SeqCst);
    assert_eq!(run_mode(&flaky, &eps, Mode::Dual, &m, &resumed, &opts(2))?, reference);
    assert_eq!(flaky.calls.load(Ordering::SeqCst), before);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn run_eval_writes_every_report() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("askgui-eval-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let (eps, agent) = fixture();
    let file = dir.join("episodes.jsonl");
    askgui_data::write_episodes(&file, eps.iter().map(|e| &e.episode))?;
    let mut modes = Mode::TABLE.to_vec();
    modes.push(Mode::Strict);
    let cfg = EvalConfig {
        episodes: file,
        out: dir.join("out"),
        modes,
        matching: MatchConfig::default(),
        run: RunOptions { concurrency: 2, progress: false },
    };
    let report = run_eval(&agent, &askgui_eval::runner::load(&cfg)?, &cfg, &FakeText)?;
    // The file's lines are 1..=9 as in the fixture, so the numbers are those of the tests above.
    close(report.mode(Mode::Dual).and_then(|m| m.ssr), 79.0 / 96.0);
    for f in [
        "report.json",
        "report.md",
        "step_accuracy.svg",
        "ask_offset.svg",
        "ask_behaviour.svg",
        "results-dual.jsonl",
        "results-strict.jsonl",
    ] {
        assert!(cfg.out.join(f).is_file(), "{f}");
    }
    let md = std::fs::read_to_string(cfg.out.join("report.md"))?;
    // +ASK: SSR 359/480 = 74.8%, SR 37.5, before 13/15 = 86.7, after 53/60 = 88.3, P 0.333, FPR 4/22 = 0.182,
    // F1 0.333, cosine 0.750, METEOR unavailable.
    assert!(md.contains("| +ASK | 74.8 | 37.5 | 86.7 | 88.3 | 0.333 | 0.182 | 0.333 | 0.750 | n/a[^1] |"), "{md}");
    assert!(md.contains("| original task | 85.4 | 75.0 | 100.0 | 100.0 | – | – | – | – | – |"), "{md}");
    // Pooled: 21/28 = 75.0, 6/8 = 75.0, 11/13 = 84.6; recall 2/6; one needless-ask task of three.
    assert!(md.contains("| +ASK | 75.0 | 75.0 | 84.6 | 0.333 | 0.333 (1/3) |"), "{md}");
    assert!(md.contains("[^1]: unavailable: WordNet not found"), "{md}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(cfg.out.join("report.json"))?)?;
    assert_eq!(json["modes"][3]["ask"]["counts"]["fn"], 4);
    assert!(std::fs::read_to_string(cfg.out.join("ask_offset.svg"))?.contains("<title>-2: 1</title>"));
    // The sensitivity tables score the saved results again. With the earlier definitions (pooled,
    // the ask required at its step, early asks positive) +ASK is 17/28 = 60.7 (-14.1 from 74.8), SR 2/8,
    // before 6/8, after 7/13 = 53.8 (-34.5 from 88.3); +ASK's ask counts do not change. Dual is 22/28 = 78.6,
    // SR 4/8, after 10/13 = 76.9, TP 4 FP 2 FN 2 TN 18 (P, R, F1 0.667, FPR 0.1): the old numbers.
    let tables = askgui_eval::sensitivity::tables(std::slice::from_ref(&cfg.out), None)?;
    let old = "| earlier askgui: pooled, ask required, early positive |";
    let row = |mode: &str| {
        let at = tables.find(&format!("— {mode}\n")).unwrap_or_else(|| panic!("{mode}: {tables}"));
        tables[at..].lines().find(|l| l.starts_with(old)).unwrap_or_else(|| panic!("{tables}")).to_string()
    };
    assert_eq!(
        row("+ASK"),
        format!("{old} 60.7 (-14.1) | 25.0 (-12.5) | 75.0 (-11.7) | 53.8 (-34.5) | 0.333 | 0.333 | 0.182 | 0.333 |")
    );
    assert!(row("+Dual eval").contains("| 78.6 (-3.7) | 50.0 (-12.5) | 100.0 | 76.9 (-16.4) | 0.667 (+0.167) |"));
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
