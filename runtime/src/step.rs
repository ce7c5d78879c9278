//! Steps 3 and 4 of the chain: decoding an agent step's answer, and the action back in screen pixels.
//!
//! Key choice: after the action language's forced prefix (`{"action":"`, `Action: `, `<tool_call>...`),
//! every action name's tokens are scored from a copy of the KV cache: the model's exact distribution over
//! the language's names, whose ASK entry (`ask`, `call_user`, `ask_user_question`) is `ask_probability`
//! (with `pause_threshold` the answer is ASK exactly when `ask_probability >= pause_threshold`). The
//! arguments follow ([`crate::constrained`], [`crate::language_args`]), then the answer is parsed in the
//! language and converted to screen pixels.

use std::time::Instant;

use askgui_data::agent_api::{AgentStepResponse, FrameInfo, StepOptions, Timings, Usage};
use askgui_data::{Action, ActionLanguage, FrameMap};

use crate::constrained::Schema;
use crate::decoding::Decoding;
use crate::error::{Result, RuntimeError};
use crate::forward::Forward;
use crate::prompt::Step;
use crate::runtime::{Runtime, DEFAULT_STEP_TOKENS};
use crate::sampling::pick;
use crate::sequence::Seq;

/// The answer to one step.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// The answer as the model wrote it, in the model frame.
    pub raw: String,
    /// `(action in screen pixels, action in the model frame)`, or why the answer does not parse (only
    /// free decoding can write one that does not).
    pub parsed: std::result::Result<(Action, Action), String>,
    pub frame: FrameMap,
    pub ask_probability: f64,
    pub usage: Usage,
    pub timings: Timings,
}

impl StepOutput {
    /// The agent API's answer; an answer that does not parse is an error.
    pub fn into_response(self) -> Result<AgentStepResponse> {
        let (action, model_action) = self.parsed.map_err(|e| {
            RuntimeError::Internal(format!(
                "the model's answer does not parse ({e}); leave options.constrain on to get one that does"
            ))
        })?;
        Ok(AgentStepResponse {
            action,
            coordinates: None,
            screen_action: None,
            model_action,
            frame: FrameInfo::from(&self.frame),
            raw: self.raw,
            ask_probability: Some(self.ask_probability),
            usage: self.usage,
            timings: self.timings,
        })
    }
}

impl Runtime {
    /// One agent step: `step`'s prompt prefilled through `fwd`, the answer decoded with `opts`.
    pub fn step(
        &self,
        fwd: &dyn Forward,
        step: &Step,
        opts: &StepOptions,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<StepOutput> {
        let t_start = Instant::now();
        let prompt = self.prompt(step)?;
        let language = self.prompt.action_language;
        let constrain = opts.constrain.unwrap_or(true);
        let lead = language.answer_prefix();
        let prefix = self.tokenizer.encode(lead)?;
        let ids: Vec<u32> = prompt.ids.iter().chain(&prefix).copied().collect();
        let max_tokens = opts.max_tokens.unwrap_or(DEFAULT_STEP_TOKENS);
        self.check_context(ids.len(), max_tokens)?;
        let preprocess_ms = t_start.elapsed().as_secs_f64() * 1e3;

        let t0 = Instant::now();
        let (seq, cached) = Seq::prefill(self, fwd, &prompt.ids, &prompt.images)?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t0 = Instant::now();
        let temperature = opts.temperature.unwrap_or(0.0);
        let mut dec = Decoding::new(seq, temperature, opts.seed.unwrap_or(0), 0, cancelled);
        // The exact distribution over action names after the forced prefix, each name in the
        // tokenisation training gives it. The JSON names are scored alone, as they always were (none is a
        // prefix of another); the other languages' with their end (tool-call's `left_click` is a prefix
        // of `left_click_drag`).
        let mut text = String::from(lead);
        let names = language.action_names();
        let scored_end = if language == ActionLanguage::AskguiJson { "" } else { language.name_end() };
        let (probs, lens) = self.score(&mut dec, &text, names, scored_end)?;
        let ask = names.iter().position(|&n| n == language.ask_name()).expect("every language can ask");
        let ask_probability = probs[ask];
        let choice = match opts.pause_threshold {
            Some(th) if ask_probability >= th => ask,
            Some(_) => pick(&probs, temperature, &mut dec.rng, Some(ask)),
            None => pick(&probs, temperature, &mut dec.rng, None),
        };
        text.push_str(names[choice]);
        text.push_str(language.name_end());
        dec.budget = max_tokens.saturating_sub(lens[choice]);
        if constrain {
            let schema = Schema {
                frame: prompt.frame.model,
                elements: &prompt.element_ids,
                screenshot: !prompt.images.is_empty(),
            };
            match language {
                ActionLanguage::AskguiJson => self.constrained_args(&mut dec, names[choice], &mut text, &schema)?,
                ActionLanguage::UiTars => self.ui_tars_args(&mut dec, names[choice], &mut text, &schema)?,
                ActionLanguage::ToolCall => self.tool_call_args(&mut dec, names[choice], &mut text, &schema)?,
            }
        } else {
            self.free_args(&mut dec, &mut text, language)?;
        }
        let decode_ms = t0.elapsed().as_secs_f64() * 1e3;
        let parsed = language
            .parse(&text)
            .map(|p| (prompt.frame.action_to_screen(&p.action), p.action))
            .map_err(|e| e.to_string());
        if constrain {
            if let Err(e) = &parsed {
                return Err(RuntimeError::Internal(format!("a constrained answer did not parse ({e}): {text:?}")));
            }
        }
        Ok(StepOutput {
            raw: text,
            parsed,
            frame: prompt.frame,
            ask_probability,
            usage: Usage {
                prompt_tokens: prompt.ids.len(),
                image_tokens: prompt.image_tokens,
                cached_tokens: cached,
                completion_tokens: prefix.len() + lens[choice] + dec.generated,
            },
            timings: Timings { queue_ms: 0.0, preprocess_ms, prefill_ms, decode_ms },
        })
    }
}
