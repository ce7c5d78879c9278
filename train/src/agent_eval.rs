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
//! askgui-eval's reports.
//!
//! The sample: the prompt of one validation sample up to its first target (the tokens the loss is on),
//! answered greedily; the target is that span's text. Both are text in the model's coordinate frame, as
//! the model writes them.

use std::path::Path;

use askgui_data::{LoadedEpisode, PromptConfig, TaskMode};
use askgui_eval::agent::AgentError;
use askgui_eval::backends::InProcessAgent;
use askgui_eval::matching::MatchConfig;
use askgui_eval::metrics::{compute, NoContentScorer};
use askgui_eval::modes::{evaluate_episode, Mode};
use askgui_model::{generate, load_image, preprocess, Prompt, Qwen2Vl, QwenTokenizer, SamplingParams};
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
}

/// The eval mode for a training task mode.
pub fn mode_for(task_mode: TaskMode) -> Mode {
    match task_mode {
        TaskMode::Ambiguous => Mode::Standard,
        TaskMode::Full | TaskMode::Steps | TaskMode::Language | TaskMode::Describe => Mode::Original,
    }
}

/// Runs `model` as an agent on `episodes` in `mode` and gives it back with the metrics (or the error of
/// an episode). The outer error (the agent could not be set up: it only reads the tokenizer, which
/// training has already read) consumes the model.
pub fn run_agent_eval(
    model: Qwen2Vl,
    episodes: &[LoadedEpisode],
    mode: Mode,
    prompt: &PromptConfig,
    max_new_tokens: usize,
) -> Result<(Qwen2Vl, Result<AgentMetrics>)> {
    let agent = InProcessAgent::from_model(model, prompt.clone(), max_new_tokens)
        .map_err(|e| TrainError::Data(format!("eval: the in-process agent: {e}")))?;
    let matching = MatchConfig::default();
    let (mut results, mut skipped) = (Vec::new(), 0);
    let mut failure = None;
    for ep in episodes {
        match evaluate_episode(&agent, ep, mode, &matching) {
            Ok(r) => results.push(r),
            Err(AgentError::Input(reason)) => {
                tracing::warn!(episode = %ep.episode.id, line = ep.line, %reason, "eval: episode left out");
                skipped += 1;
            }
            Err(e) => {
                failure = Some(TrainError::Data(format!("eval: episode {} (line {}): {e}", ep.episode.id, ep.line)));
                break;
            }
        }
    }
    let model = agent.into_model();
    if let Some(e) = failure {
        return Ok((model, Err(e)));
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
    };
    Ok((model, Ok(metrics)))
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

/// Greedily answers the prompt of `sample` up to its first supervised span; the target is that span.
pub fn sample_prediction(
    model: &Qwen2Vl,
    tokenizer: &QwenTokenizer,
    sample: &PreparedSample,
    max_new_tokens: usize,
) -> Result<SamplePrediction> {
    let bad = |m: &str| TrainError::Data(format!("sample of episode {} step {}: {m}", sample.episode, sample.step));
    let start = sample.labels_mask.iter().position(|&m| m).ok_or_else(|| bad("no supervised token"))?;
    let end = start + sample.labels_mask[start..].iter().take_while(|&&m| m).count();
    let prompt_ids = sample.ids[..start].to_vec();
    // The images whose placeholders are in the prompt (all of a step's images come before its answer).
    let ic = &model.image_config;
    let merge = ic.geometry.merge_size * ic.geometry.merge_size;
    let pads = prompt_ids.iter().filter(|&&t| t == model.cfg.image_token_id).count();
    let mut images = Vec::new();
    let mut covered = 0;
    for (path, grid) in sample.images.iter().zip(&sample.grids) {
        let n = grid.iter().product::<usize>() / merge;
        if covered + n > pads {
            break;
        }
        covered += n;
        images.push(preprocess(&load_image(path, ic.max_input_pixels)?, ic)?);
    }
    let mut stop = model.eos_token_ids.clone();
    stop.extend(tokenizer.token_id(askgui_data::prompt::IM_END));
    let params = SamplingParams { max_new_tokens, temperature: 0.0, stop_tokens: stop.clone(), ..Default::default() };
    let (gens, _) = generate(model, &[Prompt { ids: prompt_ids, images }], &params, false)?;
    let mut tokens = gens.into_iter().next().map(|g| g.tokens).unwrap_or_default();
    if tokens.last().is_some_and(|t| stop.contains(t)) {
        tokens.pop();
    }
    let mut target = sample.ids[start..end].to_vec();
    if target.last().is_some_and(|t| stop.contains(t)) {
        target.pop();
    }
    Ok(SamplePrediction {
        episode: sample.episode.clone(),
        episode_step: sample.step,
        predicted: tokenizer.decode(&tokens, true)?,
        target: tokenizer.decode(&target, true)?,
    })
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
