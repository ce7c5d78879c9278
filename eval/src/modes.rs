//! The evaluation modes: how one episode is put to the agent and what each prediction is scored against.
//!
//! Every mode gives the agent the ground-truth history (the annotated actions of earlier steps); they
//! differ in the task shown and in what an `ask` does. Navi-plus scores "the operational actions and the
//! additional ASK action" separately (§1, §2.3): an ASK is an action of its own, scored by ASK timing,
//! and the operational action of an annotated step is scored with the annotated QA pair in its history.
//! - [`Mode::Original`]: the full task; the target of every step is its action ("original task");
//! - [`Mode::Incomplete`]: the ambiguous task, asks are never answered (an `ask` is a wrong step);
//! - [`Mode::Standard`] ("+ASK"): the ambiguous task; at an annotated step the first prediction is the ASK
//!   decision, and the step's action is predicted again after the annotated ASK and SAY turns, whether
//!   the agent asked or not. An ask at any other step is a wrong step and a false positive;
//! - [`Mode::Dual`]: Navi-plus Dual-Stream Trajectory Evaluation (§2.3, Algorithm 1): the first stream is
//!   `Standard`; when the agent first asks at j before the annotated step a (after the previous one), the
//!   annotated QA pair is inserted at j and steps j..=a are predicted again (second stream), replacing
//!   the first stream's predictions;
//! - [`Mode::Strict`]: Morae's task-level pause evaluation (§5.1) on the ambiguous task, offline: the walk
//!   stops at the task's verdict ([`StrictOutcome`]); a wrong action ends it as the online agent would
//!   leave the annotated path there.
//!
//! An episode's annotated ASK steps are its steps with an `ask`, when its ambiguous task differs from the
//! full one (the rule `askgui_data::episode_samples` trains with); several per episode are supported.

use std::fmt;

use askgui_data::{Action, LoadedEpisode, Turn};
use serde::{Deserialize, Serialize};

use crate::agent::{Agent, AgentError, Prediction, StepInput};
use crate::matching::MatchConfig;

/// One way of evaluating an episode (see the module header).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Original,
    Incomplete,
    #[value(alias = "ask")]
    Standard,
    #[value(alias = "dual-stream")]
    Dual,
    Strict,
}

impl Mode {
    pub const ALL: [Mode; 5] = [Mode::Original, Mode::Incomplete, Mode::Standard, Mode::Dual, Mode::Strict];
    /// The four rows of Navi-plus Table 1, in order.
    pub const TABLE: [Mode; 4] = [Mode::Original, Mode::Incomplete, Mode::Standard, Mode::Dual];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Original => "original",
            Mode::Incomplete => "incomplete",
            Mode::Standard => "standard",
            Mode::Dual => "dual",
            Mode::Strict => "strict",
        }
    }

    /// The row label of the Markdown table.
    pub fn row_label(self) -> &'static str {
        match self {
            Mode::Original => "original task",
            Mode::Incomplete => "incomplete task",
            Mode::Standard => "+ASK",
            Mode::Dual => "+Dual eval",
            Mode::Strict => "strict (Morae)",
        }
    }

    /// Whether asks are scored (timing and content) in this mode.
    pub fn scores_asks(self) -> bool {
        matches!(self, Mode::Standard | Mode::Dual | Mode::Strict)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One call to the agent, kept in the results file.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Call {
    pub step: usize,
    /// 1: ground-truth history; 2: Dual-Stream re-prediction with the early QA pair.
    pub stream: u8,
    /// The call predicts the step after an annotated QA pair was put in the history (at an annotated step,
    /// after a right pause in Strict, or at the early ask of a second stream).
    pub answered: bool,
    pub raw: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<Action>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parse_error: Option<String>,
    /// Turns in the history the call was given (with any ASK/SAY turns).
    #[serde(default)]
    pub history: usize,
    /// The model's probability of `ask` (agents that report one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ask_probability: Option<f64>,
}

/// The final verdict on one step.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct StepOutcome {
    pub step: usize,
    pub correct: bool,
    /// The action the verdict scored (None: no parseable action, or a pause in Strict); kept so that a
    /// results file can be scored again under other matching rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted: Option<Action>,
    /// The ASK decision ASK timing counts for this step: the first prediction with ground-truth history,
    /// or in Dual the second stream's for the steps strictly between an early ask and its annotated step.
    #[serde(default)]
    pub asked: bool,
}

/// What happened around one annotated ASK step.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct AskOutcome {
    /// The annotated step.
    pub step: usize,
    /// The annotated question.
    pub question: String,
    /// The first step, after the previous annotated step and before the next one, at which the agent
    /// asked with ground-truth history (the first stream); None when it never did. `asked_at - step` is
    /// the offset plotted in `ask_offset.svg`.
    pub asked_at: Option<usize>,
    /// The agent asked exactly at the annotated step (first stream; Strict: paused there): the ASK timing
    /// positive of every mode ("exact matches of ASK actions", Navi-plus §3.1).
    #[serde(default)]
    pub exact: bool,
    /// Correct by the mode's rule: Standard, Strict: `exact`; Dual: an ask at or before the step
    /// (Algorithm 1), which earns the second stream.
    pub credited: bool,
    /// The question of the agent's ask at `asked_at`.
    pub agent_question: Option<String>,
    /// The question of the agent's ask at the annotated step itself (when `exact`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact_question: Option<String>,
}

/// A confusion matrix of ASK decisions.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    pub tp: usize,
    pub fp: usize,
    #[serde(rename = "fn")]
    pub fn_: usize,
    pub tn: usize,
}

impl Counts {
    pub fn add(&mut self, o: &Counts) {
        self.tp += o.tp;
        self.fp += o.fp;
        self.fn_ += o.fn_;
        self.tn += o.tn;
    }
}

/// Morae's verdict on one task (§5.1), offline.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum StrictOutcome {
    /// Every step before it right, then a pause exactly at every annotated step, each followed by the
    /// right action while another remains (TP; a task success).
    Tp,
    /// Paused before an annotated step, the steps before the pause right (FP).
    FpEarly,
    /// Paused in a task that needs no pause, the steps before the pause right (FP).
    FpSpurious,
    /// Reached an annotated step and did not pause there, nor later (FN).
    FnMissed,
    /// Reached an annotated step and did not pause there, but later (FN).
    FnLate,
    /// A wrong action before an annotated step: online the agent would leave the annotated path and never
    /// reach the step to pause at (FN).
    FnOffPath,
    /// Completed a task that needs no pause, every step right, without pausing (TN; a task success).
    Tn,
    /// A task that needs no pause with a wrong action before any pause: Morae leaves it out of TN (and of
    /// the confusion matrix).
    FailedUnpaused,
}

/// Everything one episode gave in one mode: a line of `results-<mode>.jsonl`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct EpisodeResult {
    pub id: String,
    /// 1-based line of the episode file.
    pub line: usize,
    pub mode: Mode,
    pub num_steps: usize,
    /// Annotated ASK steps (empty when the episode is not ambiguous).
    pub ask_steps: Vec<usize>,
    /// Steps before it are "before the ASK", the others "after" (the first annotated ASK step).
    pub split: Option<usize>,
    /// The steps evaluated (all of them, except in Strict, which stops at the task's verdict).
    pub steps: Vec<StepOutcome>,
    pub asks: Vec<AskOutcome>,
    pub strict: Option<StrictOutcome>,
    /// Strict, tasks without annotated steps: the first step at which the agent paused with ground-truth
    /// history, every step visited whether acted right or not (the per-task ask FPR's numerator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needless_pause_at: Option<usize>,
    /// Every step right (Strict: the task's success by Morae's rule).
    pub success: bool,
    pub calls: Vec<Call>,
}

/// The annotated ASK steps of an episode.
pub fn annotated_ask_steps(ep: &LoadedEpisode) -> Vec<usize> {
    if !ep.episode.is_ambiguous() {
        return Vec::new();
    }
    ep.episode.steps.iter().enumerate().filter(|(_, s)| s.ask.is_some()).map(|(i, _)| i).collect()
}

fn question_of(p: &Prediction) -> Option<String> {
    match &p.action {
        Some(Action::Ask(a)) => Some(a.question.clone()),
        _ => None,
    }
}

/// Runs one episode in one mode. Only a failure to get an answer at all is an error.
pub fn evaluate_episode(
    agent: &dyn Agent,
    ep: &LoadedEpisode,
    mode: Mode,
    matching: &MatchConfig,
) -> Result<EpisodeResult, AgentError> {
    let mut ev = EpisodeEval { agent, ep, mode, matching, ask_steps: annotated_ask_steps(ep), calls: Vec::new() };
    let mut r = EpisodeResult {
        id: ep.episode.id.clone(),
        line: ep.line,
        mode,
        num_steps: ep.episode.steps.len(),
        ask_steps: ev.ask_steps.clone(),
        split: ev.ask_steps.first().copied(),
        steps: Vec::new(),
        asks: Vec::new(),
        strict: None,
        needless_pause_at: None,
        success: false,
        calls: Vec::new(),
    };
    if ep.episode.steps.is_empty() {
        return Ok(r);
    }
    match mode {
        Mode::Original | Mode::Incomplete | Mode::Standard | Mode::Dual => ev.streams(&mut r)?,
        Mode::Strict => ev.strict(&mut r)?,
    }
    r.calls = std::mem::take(&mut ev.calls);
    Ok(r)
}

struct EpisodeEval<'a> {
    agent: &'a dyn Agent,
    ep: &'a LoadedEpisode,
    mode: Mode,
    matching: &'a MatchConfig,
    ask_steps: Vec<usize>,
    calls: Vec<Call>,
}

/// The first stream's view of one step.
struct FirstStream {
    /// The first prediction (with no QA pair for this step) was an ask.
    asked: bool,
    question: Option<String>,
    /// The prediction the step's verdict scores (at an annotated step: the one after the QA pair).
    scored: Option<Action>,
    correct: bool,
}

impl EpisodeEval<'_> {
    fn task(&self) -> String {
        let e = &self.ep.episode;
        match (self.mode, &e.ambiguous_task) {
            (Mode::Original, _) | (_, None) => e.task.clone(),
            (_, Some(a)) => a.clone(),
        }
    }

    fn is_annotated(&self, i: usize) -> bool {
        self.ask_steps.binary_search(&i).is_ok()
    }

    /// The annotated QA pair of step `a`: its ASK action and the user's answer as a SAY turn.
    fn qa_turns(&self, a: usize) -> Vec<Turn> {
        match &self.ep.episode.steps[a].ask {
            Some(q) => vec![Turn::Agent { action: q.action() }, Turn::Say { text: q.answer.clone() }],
            None => Vec::new(),
        }
    }

    /// The annotated history before `step`: actions, with the annotated QA pairs when `with_asks`.
    fn gold_history(&self, step: usize, with_asks: bool) -> Vec<Turn> {
        let mut h = Vec::new();
        for (i, s) in self.ep.episode.steps.iter().enumerate().take(step) {
            if with_asks && self.is_annotated(i) {
                h.extend(self.qa_turns(i));
            }
            h.push(Turn::Agent { action: s.action.clone() });
        }
        h
    }

    fn predict(
        &mut self,
        step: usize,
        history: Vec<Turn>,
        stream: u8,
        answered: bool,
    ) -> Result<Prediction, AgentError> {
        let e = &self.ep.episode;
        let input = StepInput {
            episode_id: e.id.clone(),
            step,
            task: self.task(),
            history,
            screenshots: (0..=step).map(|j| self.ep.image_path(j)).collect(),
            elements: e.steps[step].elements.clone(),
            screen: e.screen,
            platform: e.platform,
        };
        let p = self.agent.predict(&input)?;
        self.calls.push(Call {
            step,
            stream,
            answered,
            raw: p.raw.clone(),
            action: p.action.clone(),
            parse_error: p.parse_error.clone(),
            history: input.history.len(),
            ask_probability: p.ask_probability,
        });
        Ok(p)
    }

    fn correct(&self, p: &Prediction, step: usize) -> bool {
        p.action.as_ref().is_some_and(|a| self.matching.matches_step(a, &self.ep.episode, step))
    }

    /// One step with ground-truth history. At an annotated step (Standard, Dual) the first prediction is
    /// the ASK decision; the operational action is predicted again after the annotated QA pair.
    fn first_stream_step(&mut self, i: usize) -> Result<FirstStream, AgentError> {
        let with_asks = matches!(self.mode, Mode::Standard | Mode::Dual);
        let history = self.gold_history(i, with_asks);
        let p = self.predict(i, history.clone(), 1, false)?;
        let (asked, question) = (p.is_ask(), question_of(&p));
        let scored = if with_asks && self.is_annotated(i) {
            let mut h = history;
            h.extend(self.qa_turns(i));
            self.predict(i, h, 1, true)?
        } else {
            p
        };
        Ok(FirstStream { asked, question, correct: self.correct(&scored, i), scored: scored.action })
    }

    /// Algorithm 1's second stream for an early ask at `j` before the annotated step `a`: the annotated QA
    /// pair inserted at `j`, steps `j..=a` predicted again; their verdicts replace the first stream's.
    fn second_stream(&mut self, j: usize, a: usize, steps: &mut [StepOutcome]) -> Result<(), AgentError> {
        let mut h = self.gold_history(j, true);
        h.extend(self.qa_turns(a));
        for (t, outcome) in steps.iter_mut().enumerate().take(a + 1).skip(j) {
            let p = self.predict(t, h.clone(), 2, t == j)?;
            outcome.correct = self.correct(&p, t);
            // The ask decisions of j (credited) and a (the positive) stay the first stream's.
            if t > j && t < a {
                outcome.asked = p.is_ask();
            }
            outcome.predicted = p.action;
            h.push(Turn::Agent { action: self.ep.episode.steps[t].action.clone() });
        }
        Ok(())
    }

    /// Original, Incomplete, Standard, and Dual (first stream, then the second where needed).
    fn streams(&mut self, r: &mut EpisodeResult) -> Result<(), AgentError> {
        let n = self.ep.episode.steps.len();
        let mut first = Vec::with_capacity(n);
        for i in 0..n {
            first.push(self.first_stream_step(i)?);
        }
        let mut steps: Vec<StepOutcome> = first
            .iter()
            .enumerate()
            .map(|(step, f)| StepOutcome { step, correct: f.correct, predicted: f.scored.clone(), asked: f.asked })
            .collect();
        let ask_steps = self.ask_steps.clone();
        for (k, &a) in ask_steps.iter().enumerate() {
            let lo = if k == 0 { 0 } else { ask_steps[k - 1] + 1 };
            let hi = ask_steps.get(k + 1).copied().unwrap_or(n);
            let asked_at = (lo..hi).find(|&i| first[i].asked);
            let exact = first[a].asked;
            let credited = match self.mode {
                Mode::Dual => asked_at.is_some_and(|j| j <= a),
                _ => exact,
            };
            if let (Mode::Dual, Some(j)) = (self.mode, asked_at) {
                if j < a {
                    self.second_stream(j, a, &mut steps)?;
                }
            }
            r.asks.push(AskOutcome {
                step: a,
                question: self.ep.episode.steps[a].ask.as_ref().map(|q| q.question.clone()).unwrap_or_default(),
                asked_at,
                exact,
                credited,
                agent_question: asked_at.and_then(|j| first[j].question.clone()),
                exact_question: if exact { first[a].question.clone() } else { None },
            });
        }
        r.success = steps.iter().all(|s| s.correct);
        r.steps = steps;
        Ok(())
    }

    /// Morae, offline: walk with ground-truth history until the task's verdict. A step is reached only
    /// when every step before it was acted right, as online.
    fn strict(&mut self, r: &mut EpisodeResult) -> Result<(), AgentError> {
        let n = self.ep.episode.steps.len();
        let mut history = Vec::new();
        let mut outcome = None;
        for i in 0..n {
            let p = self.predict(i, history.clone(), 1, false)?;
            let gold = self.ep.episode.steps[i].action.clone();
            if p.is_ask() {
                outcome = self.strict_pause(r, i, &p, &mut history)?;
                if outcome.is_some() {
                    break;
                }
                continue;
            }
            if self.is_annotated(i) {
                r.steps.push(StepOutcome { step: i, correct: false, predicted: p.action.clone(), asked: false });
                outcome = Some(self.strict_missed(r, i, history.clone())?);
                break;
            }
            let ok = self.correct(&p, i);
            r.steps.push(StepOutcome { step: i, correct: ok, predicted: p.action.clone(), asked: false });
            history.push(Turn::Agent { action: gold });
            if !ok {
                outcome = Some(if self.ask_steps.iter().any(|&a| a > i) {
                    StrictOutcome::FnOffPath
                } else {
                    StrictOutcome::FailedUnpaused
                });
                break;
            }
        }
        let outcome = outcome.unwrap_or(StrictOutcome::Tn);
        if self.ask_steps.is_empty() {
            r.needless_pause_at = self.needless_pause(r, outcome, history)?;
        }
        // Annotated steps the walk never reached.
        for a in self.ask_steps.clone() {
            if !r.asks.iter().any(|o| o.step == a) {
                r.asks.push(self.strict_ask(a, None, false, None));
            }
        }
        r.asks.sort_by_key(|a| a.step);
        r.success = matches!(outcome, StrictOutcome::Tp | StrictOutcome::Tn);
        r.strict = Some(outcome);
        Ok(())
    }

    /// A pause at reached step `i`: the verdict, or None when it was right at an annotated step that is
    /// not the last and the agent then acted right on the answer (the walk goes on).
    fn strict_pause(
        &mut self,
        r: &mut EpisodeResult,
        i: usize,
        p: &Prediction,
        history: &mut Vec<Turn>,
    ) -> Result<Option<StrictOutcome>, AgentError> {
        r.steps.push(StepOutcome { step: i, correct: self.is_annotated(i), predicted: None, asked: true });
        if !self.is_annotated(i) {
            return Ok(Some(match self.ask_steps.iter().copied().find(|&a| a > i) {
                Some(a) => {
                    r.asks.push(self.strict_ask(a, Some(i), false, question_of(p)));
                    StrictOutcome::FpEarly
                }
                None => StrictOutcome::FpSpurious,
            }));
        }
        r.asks.push(self.strict_ask(i, Some(i), true, question_of(p)));
        if self.ask_steps.last() == Some(&i) {
            return Ok(Some(StrictOutcome::Tp));
        }
        // Another pause is still ahead: the agent acts on the answer, as it would online.
        history.extend(self.qa_turns(i));
        let q = self.predict(i, history.clone(), 1, true)?;
        let ok = self.correct(&q, i);
        r.steps.push(StepOutcome { step: i, correct: ok, predicted: q.action, asked: false });
        history.push(Turn::Agent { action: self.ep.episode.steps[i].action.clone() });
        Ok((!ok).then_some(StrictOutcome::FnOffPath))
    }

    /// No pause at annotated step `i`: FN, late when the agent pauses at a later step (ground-truth
    /// history, no answer, acting not scored).
    fn strict_missed(
        &mut self,
        r: &mut EpisodeResult,
        i: usize,
        mut history: Vec<Turn>,
    ) -> Result<StrictOutcome, AgentError> {
        history.push(Turn::Agent { action: self.ep.episode.steps[i].action.clone() });
        let mut late = None;
        for t in i + 1..self.ep.episode.steps.len() {
            let q = self.predict(t, history.clone(), 1, false)?;
            if q.is_ask() {
                late = Some((t, question_of(&q)));
                break;
            }
            history.push(Turn::Agent { action: self.ep.episode.steps[t].action.clone() });
        }
        let outcome = if late.is_some() { StrictOutcome::FnLate } else { StrictOutcome::FnMissed };
        let (at, q) = late.map_or((None, None), |(t, q)| (Some(t), q));
        r.asks.push(self.strict_ask(i, at, false, q));
        Ok(outcome)
    }

    /// A task without annotated steps: the first step at which the agent pauses with ground-truth
    /// history, visiting the steps the walk did not reach (the walk's `history` covers those it did).
    fn needless_pause(
        &mut self,
        r: &EpisodeResult,
        outcome: StrictOutcome,
        mut history: Vec<Turn>,
    ) -> Result<Option<usize>, AgentError> {
        if outcome == StrictOutcome::FpSpurious {
            return Ok(r.steps.last().map(|s| s.step));
        }
        for t in r.steps.len()..self.ep.episode.steps.len() {
            if self.predict(t, history.clone(), 1, false)?.is_ask() {
                return Ok(Some(t));
            }
            history.push(Turn::Agent { action: self.ep.episode.steps[t].action.clone() });
        }
        Ok(None)
    }

    fn strict_ask(&self, step: usize, asked_at: Option<usize>, exact: bool, q: Option<String>) -> AskOutcome {
        AskOutcome {
            step,
            question: self.ep.episode.steps[step].ask.as_ref().map(|q| q.question.clone()).unwrap_or_default(),
            asked_at,
            exact,
            credited: exact,
            agent_question: q.clone(),
            exact_question: if exact { q } else { None },
        }
    }
}
