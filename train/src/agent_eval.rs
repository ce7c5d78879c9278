//! What the periodic eval adds to the validation loss: the model under training run as an agent on
//! validation episodes by askgui-eval (its in-process agent, its matching rules, its metrics), and one
//! validation sample's predicted text next to its target.
//!
//! Agent metrics: the trainer lends its model (with the adapter being trained, active) to askgui-eval's
//! [`InProcessAgent`], which builds the very prompts training uses and answers greedily; the first
//! `--eval-episodes` validation episodes are run in eval's standard mode (the ambiguous task with ASK/SAY;
//! with `--task-mode full`, eval's original mode, which scores no asks) and the model is taken back. The
//! numbers are eval's: SSR and SR over the steps and episodes, ASK precision, recall and F1 per step. A
//! ratio with a zero denominator (no ask predicted: no precision) is `None`, written as `null`, as in
//! askgui-eval's reports; when the episodes cannot measure asking at all (no step needs an ask, or none
//! needs none), `ask_note` says why ([`cannot_measure_asking`]) and the trainer warns once.
//!
//! The sample: the prompt of one validation sample up to its first target (the tokens the loss is on),
//! answered greedily; the target is that span's text. Both are text in the model's coordinate frame, as
//! the model writes them.

use std::path::Path;

use askgui_data::agent_api::StepOptions;
use askgui_data::{LoadedEpisode, PromptConfig, TaskMode};
use askgui_eval::agent::AgentError;
use askgui_eval::backends::InProcessAgent;
use askgui_eval::matching::MatchConfig;
use askgui_eval::metrics::{compute, NoContentScorer};
use askgui_eval::modes::{annotated_ask_steps, evaluate_episode, Mode};
use askgui_model::Qwen2Vl;
use serde::Serialize;

use crate::data::PreparedSample;
use crate::error::{Result, TrainError};

/// Agent metrics of one eval (the keys written to metrics.jsonl).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AgentMetrics {
    /// `standard` or `original`.
    pub eval_mode: String,
    /// Episodes evaluated.
    pub eval_episodes: usize,
    /// Episodes left out because a screenshot could not be read.
    pub eval_skipped: usize,
    /// Steps scored.
    pub eval_steps: usize,
    pub ssr: Option<f64>,
    pub sr: Option<f64>,
    pub ask_precision: Option<f64>,
    pub ask_recall: Option<f64>,
    pub ask_f1: Option<f64>,
    /// Why these episodes cannot measure asking (standard mode), when they cannot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ask_note: Option<String>,
}

/// Why `episodes` cannot measure asking in `mode`: no step needs an ask (recall and F1 stay null), or
/// none needs none (no needless ask can be seen). None when they can, or when `mode` scores no asks.
pub fn cannot_measure_asking(episodes: &[LoadedEpisode], mode: Mode) -> Option<String> {
    if !mode.scores_asks() || episodes.is_empty() {
        return None;
    }
    let steps: usize = episodes.iter().map(|e| e.episode.steps.len()).sum();
    let needed: usize = episodes.iter().map(|e| annotated_ask_steps(e).len()).sum();
    let n = episodes.len();
    if needed == 0 {
        Some(format!(
            "no step of the {n} validation episodes evaluated needs an ask (no ambiguous task): ask recall and F1 \
             stay null. Give a validation split with ambiguous episodes (askgui-data synth --split puts some in \
             every split) or more --eval-episodes"
        ))
    } else if needed == steps {
        Some(format!(
            "every step of the {n} validation episodes evaluated needs an ask: a needless ask cannot happen, so \
             ask precision says nothing about over-asking"
        ))
    } else {
        None
    }
}

/// The eval mode for a training task mode.
pub fn mode_for(task_mode: TaskMode) -> Mode {
    match task_mode {
        TaskMode::Ambiguous => Mode::Standard,
        TaskMode::Full | TaskMode::Steps | TaskMode::Language | TaskMode::Describe => Mode::Original,
    }
}

/// The model under training as an in-process agent: the runtime `askgui-serve` answers with, decoding
/// as the server does by default (constrained, greedy), answers capped at `max_new_tokens`. The error
/// (the agent could not be set up: it only reads the tokenizer, which training has already read)
/// consumes the model.
pub fn lend(model: Qwen2Vl, prompt: &PromptConfig, max_new_tokens: usize) -> Result<InProcessAgent> {
    let options = StepOptions { max_tokens: Some(max_new_tokens), ..StepOptions::default() };
    InProcessAgent::from_model(model, prompt.clone(), options)
        .map_err(|e| TrainError::Data(format!("eval: the in-process agent: {e}")))
}

/// Runs `agent` on `episodes` in `mode`: the metrics, or the error of an episode.
pub fn run_agent_eval(agent: &InProcessAgent, episodes: &[LoadedEpisode], mode: Mode) -> Result<AgentMetrics> {
    let matching = MatchConfig::default();
    let (mut results, mut skipped) = (Vec::new(), 0);
    for ep in episodes {
        match evaluate_episode(agent, ep, mode, &matching) {
            Ok(r) => results.push(r),
            Err(AgentError::Input(reason)) => {
                tracing::warn!(episode = %ep.episode.id, line = ep.line, %reason, "eval: episode left out");
                skipped += 1;
            }
            Err(e) => return Err(TrainError::Data(format!("eval: episode {} (line {}): {e}", ep.episode.id, ep.line))),
        }
    }
    let m = compute(mode, &results, &NoContentScorer("not computed during training".into()));
    let ask = m.ask.as_ref();
    let metrics = AgentMetrics {
        eval_mode: mode.name().to_string(),
        eval_episodes: m.episodes,
        eval_skipped: skipped,
        eval_steps: m.steps,
        ssr: m.ssr,
        sr: m.sr,
        ask_precision: ask.and_then(|a| a.precision),
        ask_recall: ask.and_then(|a| a.recall),
        ask_f1: ask.and_then(|a| a.f1),
        ask_note: cannot_measure_asking(episodes, mode),
    };
    Ok(metrics)
}

/// One validation sample answered by the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SamplePrediction {
    pub episode: String,
    /// The step of the episode the sample is.
    pub episode_step: usize,
    pub predicted: String,
    pub target: String,
}

/// Greedily answers the prompt of `sample` up to its first supervised span through the agent's runtime
/// (its sampler and stop rules); the target is that span.
pub fn sample_prediction(
    agent: &InProcessAgent,
    sample: &PreparedSample,
    max_new_tokens: usize,
) -> Result<SamplePrediction> {
    let bad = |m: &str| TrainError::Data(format!("sample of episode {} step {}: {m}", sample.episode, sample.step));
    let start = sample.labels_mask.iter().position(|&m| m).ok_or_else(|| bad("no supervised token"))?;
    let end = start + sample.labels_mask[start..].iter().take_while(|&&m| m).count();
    let ids = sample.ids[..start].to_vec();
    // The images whose pads are in the prompt (all of a step's images come before its answer).
    // The images whose pads are in the prompt (all of a step's images come before its answer): one run
    // of pads each.
    let tokenizer = agent.runtime().tokenizer();
    let pad = tokenizer.image_pad_id;
    let shown = (0..ids.len()).filter(|&i| ids[i] == pad && (i == 0 || ids[i - 1] != pad)).count();
    let paths = &sample.images[..shown.min(sample.images.len())];
    let text = agent.complete(ids, paths, max_new_tokens).map_err(|e| bad(&e.to_string()))?;
    let target = tokenizer.decode(&sample.ids[start..end], true)?;
    Ok(SamplePrediction { episode: sample.episode.clone(), episode_step: sample.step, predicted: text, target })
}

/// The validation episodes for the agent eval: the first `limit` readable ones of `path` (unreadable
/// lines are left out when `skip_bad` is set, as the loader does; otherwise they are errors).
pub fn load_val_episodes(path: &Path, limit: usize, skip_bad: bool) -> Result<Vec<LoadedEpisode>> {
    let lines = askgui_data::read_episodes(path).map_err(|e| TrainError::Data(e.to_string()))?;
    let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let mut out = Vec::new();
    for (line, r) in lines {
        if out.len() == limit {
            break;
        }
        match r {
            Ok(episode) => out.push(LoadedEpisode { episode, base: base.clone(), line }),
            Err(_) if skip_bad => {}
            Err(reason) => {
                return Err(TrainError::BadRecord { path: path.to_path_buf(), line, reason: reason.to_string() })
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use askgui_data::{Action, Episode, Platform, Screen, Step, StepAsk};

    /// An episode of `n` steps whose step `ask` (if any) needs an ask (ambiguous task).
    fn ep(id: &str, n: usize, ask: Option<usize>) -> LoadedEpisode {
        let steps = (0..n)
            .map(|i| Step {
                screenshot: format!("{id}-{i}.png"),
                elements: None,
                instruction: None,
                informative: None,
                action: Action::Press { key: "back".into() },
                ask: (ask == Some(i)).then(|| StepAsk {
                    question: "Which one?".into(),
                    answer: "That one".into(),
                    options: vec![],
                    kind: None,
                }),
            })
            .collect();
        let episode = Episode {
            id: id.into(),
            platform: Platform::Android,
            screen: Screen { width: 100, height: 100 },
            task: "full".into(),
            ambiguous_task: ask.map(|_| "vague".into()),
            steps,
        };
        LoadedEpisode { episode, base: ".".into(), line: 1 }
    }

    #[test]
    fn says_when_the_split_cannot_measure_asking() {
        // Two plain episodes: no step needs an ask.
        let plain = [ep("a", 3, None), ep("b", 2, None)];
        let why = cannot_measure_asking(&plain, Mode::Standard).expect("nothing to measure");
        assert!(why.contains("no step of the 2 validation episodes") && why.contains("recall"), "{why}");
        // One-step episodes whose step needs an ask: no step needs none.
        let only = [ep("c", 1, Some(0))];
        assert!(cannot_measure_asking(&only, Mode::Standard).unwrap().contains("needless ask cannot happen"));
        // One of each: measurable. The original mode scores no asks: nothing to say.
        let mixed = [ep("a", 3, None), ep("d", 3, Some(1))];
        assert_eq!(cannot_measure_asking(&mixed, Mode::Standard), None);
        assert_eq!(cannot_measure_asking(&plain, Mode::Original), None);
    }
}
