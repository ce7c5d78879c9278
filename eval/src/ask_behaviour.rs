//! How an agent asks, beyond ASK timing's precision and recall, as recent ask-benchmarks report it:
//! asks per task, the over-asking rate (needless asks per task that needs none, AmbiBench's and
//! Mobile-Aptus' over-clarification), the results split by how many details the task leaves out, and
//! where the first ask came relative to the informative step.
//!
//! Key choice: everything is counted on the first stream (ground-truth history at every step), the
//! decision [`StepOutcome::asked`] that ASK timing counts, so the numbers do not depend on how well the
//! agent acts. A task's details left out are its annotated ASK steps (one per detail in the synthetic
//! world). `eval/README.md` defines each number.

use serde::{Deserialize, Serialize};

use crate::modes::EpisodeResult;
use crate::ratio::ratio;

/// The results of the tasks that leave out one number of details.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ByDetails {
    /// Details the task leaves out (its annotated ASK steps).
    pub details: usize,
    pub tasks: usize,
    /// Tasks with every step right.
    pub sr: Option<f64>,
    /// Asks per task.
    pub asks_per_task: Option<f64>,
    /// Annotated steps asked at exactly / annotated steps.
    pub ask_recall: Option<f64>,
}

/// Where the first ask of a task that needs one came, relative to its first annotated (informative) step.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FirstAsk {
    pub early: usize,
    pub exact: usize,
    pub late: usize,
    pub never: usize,
}

/// The ask-behaviour numbers of one mode.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct AskBehaviour {
    /// Asks per task, over every task.
    pub asks_per_task: Option<f64>,
    /// Asks per task over the tasks that need none (every such ask is needless).
    pub over_asking_rate: Option<f64>,
    /// Needless asks (at a step that is not annotated) per task, over the tasks that need one.
    pub needless_asks_per_ambiguous_task: Option<f64>,
    /// One row per number of details left out, ascending.
    pub by_details: Vec<ByDetails>,
    pub first_ask: FirstAsk,
}

fn asks(r: &EpisodeResult) -> usize {
    r.steps.iter().filter(|s| s.asked).count()
}

fn needless(r: &EpisodeResult) -> usize {
    r.steps.iter().filter(|s| s.asked && !r.ask_steps.contains(&s.step)).count()
}

fn per_task(tasks: &[&EpisodeResult], count: impl Fn(&EpisodeResult) -> usize) -> Option<f64> {
    ratio(tasks.iter().map(|r| count(r)).sum(), tasks.len())
}

/// The numbers over `results` (one mode's non-empty episodes).
pub fn ask_behaviour(results: &[&EpisodeResult]) -> AskBehaviour {
    let (clear, ambiguous): (Vec<&EpisodeResult>, Vec<&EpisodeResult>) =
        results.iter().partition(|r| r.ask_steps.is_empty());
    let mut details: Vec<usize> = results.iter().map(|r| r.ask_steps.len()).collect();
    details.sort_unstable();
    details.dedup();
    let by_details = details
        .into_iter()
        .map(|d| {
            let tasks: Vec<&EpisodeResult> = results.iter().copied().filter(|r| r.ask_steps.len() == d).collect();
            let exact = tasks.iter().flat_map(|r| &r.asks).filter(|a| a.exact).count();
            ByDetails {
                details: d,
                tasks: tasks.len(),
                sr: ratio(tasks.iter().filter(|r| r.success).count(), tasks.len()),
                asks_per_task: per_task(&tasks, asks),
                ask_recall: ratio(exact, d * tasks.len()),
            }
        })
        .collect();
    let mut first_ask = FirstAsk::default();
    for a in ambiguous.iter().filter_map(|r| r.asks.first()) {
        match a.asked_at {
            None => first_ask.never += 1,
            Some(at) if at < a.step => first_ask.early += 1,
            Some(at) if at == a.step => first_ask.exact += 1,
            Some(_) => first_ask.late += 1,
        }
    }
    AskBehaviour {
        asks_per_task: per_task(results, asks),
        over_asking_rate: per_task(&clear, asks),
        needless_asks_per_ambiguous_task: per_task(&ambiguous, needless),
        by_details,
        first_ask,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modes::{AskOutcome, Mode, StepOutcome};

    /// An episode of `n` steps whose annotated ASK steps are `annotated`, the agent asking (first stream)
    /// at `asked`, every step right unless `wrong`.
    fn ep(n: usize, annotated: &[usize], asked: &[usize], wrong: bool) -> EpisodeResult {
        let steps = (0..n)
            .map(|step| StepOutcome { step, correct: !wrong, predicted: None, asked: asked.contains(&step) })
            .collect();
        let asks = annotated
            .iter()
            .map(|&step| AskOutcome {
                step,
                question: "Which?".into(),
                asked_at: asked.iter().copied().find(|&a| a <= step).or(asked.iter().copied().find(|&a| a > step)),
                exact: asked.contains(&step),
                credited: asked.contains(&step),
                agent_question: None,
                exact_question: None,
            })
            .collect();
        EpisodeResult {
            id: "e".into(),
            line: 1,
            mode: Mode::Dual,
            num_steps: n,
            ask_steps: annotated.to_vec(),
            split: annotated.first().copied(),
            steps,
            asks,
            strict: None,
            needless_pause_at: None,
            success: !wrong,
            calls: vec![],
        }
    }

    #[test]
    fn counts_by_hand() {
        // Two clear tasks (one asks twice needlessly, one never asks), one task with one detail asked
        // exactly, one with two details: asked early (step 0 for the annotated step 1) and never at 3, and
        // wrong.
        let rs =
            [ep(3, &[], &[0, 2], false), ep(3, &[], &[], false), ep(4, &[2], &[2], false), ep(5, &[1, 3], &[0], true)];
        let refs: Vec<&EpisodeResult> = rs.iter().collect();
        let b = ask_behaviour(&refs);
        // Asks: 2 + 0 + 1 + 1 = 4 over 4 tasks; over-asking: 2 asks over the 2 clear tasks; needless asks
        // in the ambiguous tasks: the early ask at 0 (not annotated) over 2 tasks.
        assert_eq!(b.asks_per_task, Some(1.0));
        assert_eq!(b.over_asking_rate, Some(1.0));
        assert_eq!(b.needless_asks_per_ambiguous_task, Some(0.5));
        // By details: 0 -> 2 tasks, SR 1, 1 ask per task, no recall (no annotated step); 1 -> recall 1/1;
        // 2 -> SR 0, 1 ask, recall 0/2.
        let row = |d: usize| b.by_details.iter().find(|r| r.details == d).unwrap().clone();
        assert_eq!((row(0).tasks, row(0).sr, row(0).asks_per_task, row(0).ask_recall), (2, Some(1.0), Some(1.0), None));
        assert_eq!((row(1).tasks, row(1).ask_recall), (1, Some(1.0)));
        assert_eq!((row(2).tasks, row(2).sr, row(2).ask_recall), (1, Some(0.0), Some(0.0)));
        // First asks: exact (task 3), early (task 4: asked at 0 for step 1).
        assert_eq!(b.first_ask, FirstAsk { early: 1, exact: 1, late: 0, never: 0 });
    }

    #[test]
    fn no_tasks_no_numbers() {
        let b = ask_behaviour(&[]);
        assert_eq!((b.asks_per_task, b.over_asking_rate, b.by_details.len()), (None, None, 0));
    }
}
