//! The arguments of an agent step's answer, after its action name: a template, or free text.
//!
//! Key choice: with `constrain` (the default) the arguments follow the action's schema as a template:
//! literal keys are forced, integers may only use digit tokens and stay inside the model frame
//! (coordinates) or 0..=60 (`wait` seconds), strings may not contain a quote or a backslash, enums are
//! scored like names; the answer therefore always parses. `max_tokens` bounds the model's free choices
//! (digits and string contents); the template's keys and brackets are always written, so a constrained
//! answer can exceed it by those. Without `constrain` the model writes the rest freely and an answer
//! that does not parse is an error.

use crate::error::{Result, RuntimeError};
use crate::runtime::{Runtime, MAX_INT_DIGITS};
use crate::sampling::{best, normalise, pick};
use crate::step::Decoding;

/// The longest `wait` a constrained answer may ask for.
const MAX_WAIT_SECONDS: u64 = 60;

impl Runtime {
    fn force(&self, dec: &mut Decoding, text: &mut String, lit: &str) -> Result<()> {
        let toks = self.tokenizer.encode(lit)?;
        dec.seq.feed(&toks)?;
        dec.generated += toks.len();
        text.push_str(lit);
        Ok(())
    }

    /// Decodes one integer in `0..=max`: digit tokens that keep the value in range, ended when a
    /// non-digit token would be more likely than any of them (or at [`MAX_INT_DIGITS`]).
    fn int(&self, dec: &mut Decoding, text: &mut String, max: u64) -> Result<()> {
        // The digits so far: their value and how many (leading zeros count towards the length only).
        let (mut value, mut len) = (0u64, 0u32);
        while dec.generated < dec.budget || len == 0 {
            dec.check()?;
            let fits = |i: usize| {
                self.digit_token[i]
                    .is_some_and(|(v, l)| len + l <= MAX_INT_DIGITS as u32 && value * 10u64.pow(l) + v <= max)
            };
            let logits = &dec.seq.logits;
            let Some((tok, v)) = best(logits, fits) else { break };
            let best_other = best(logits, |i| self.digit_token[i].is_none());
            if len > 0 && best_other.is_some_and(|(_, o)| o > v) {
                break;
            }
            let (v, l) = self.digit_token[tok as usize].expect("a digit token");
            (value, len) = (value * 10u64.pow(l) + v, len + l);
            dec.seq.feed(&[tok])?;
            dec.generated += 1;
        }
        if len == 0 {
            self.force(dec, text, "0")
        } else {
            // As a JSON number: no leading zeros.
            text.push_str(&value.to_string());
            Ok(())
        }
    }

    /// Decodes the inside of a JSON string: tokens safe in a string until the model prefers to close it
    /// (the quote token is more likely than any string token) or the budget ends.
    fn string(&self, dec: &mut Decoding, text: &mut String) -> Result<()> {
        let mut n = 0;
        // At least one token: the schema has no empty strings (an `ask` needs a question).
        while n == 0 || dec.generated < dec.budget {
            dec.check()?;
            let logits = &dec.seq.logits;
            let Some((tok, v)) = best(logits, |i| self.string_token[i]) else { break };
            let close_v = self.quote_token.map_or(f32::NEG_INFINITY, |c| logits[c as usize]);
            if n > 0 && close_v > v {
                break;
            }
            let tok = if dec.temperature > 0.0 { dec.sample(|i| self.string_token[i]) } else { tok };
            text.push_str(&self.tokenizer.decode(&[tok], false)?);
            dec.seq.feed(&[tok])?;
            dec.generated += 1;
            n += 1;
        }
        Ok(())
    }

    /// Picks one of `options` (each followed by `after`) by the model's probability.
    fn choose(&self, dec: &mut Decoding, text: &mut String, options: &[&str], after: &str) -> Result<()> {
        let toks: Vec<Vec<u32>> = options
            .iter()
            .map(|o| self.tokenizer.encode(&format!("{o}{after}")))
            .collect::<std::result::Result<_, _>>()?;
        let logp = dec.seq.logprobs(&toks)?;
        let probs = normalise(&logp);
        let i = pick(&probs, dec.temperature, &mut dec.rng, None);
        dec.seq.feed(&toks[i])?;
        dec.generated += toks[i].len();
        text.push_str(options[i]);
        text.push_str(after);
        Ok(())
    }

    /// The action's arguments as a template of forced keys and typed values (see the module docs).
    /// Coordinates stay inside the model frame `(width, height)`.
    pub(crate) fn constrained_args(
        &self,
        dec: &mut Decoding,
        name: &str,
        text: &mut String,
        frame: (u32, u32),
    ) -> Result<()> {
        let ints = |keys: &[&str], dec: &mut Decoding, text: &mut String| -> Result<()> {
            for k in keys {
                self.force(dec, text, &format!(",\"{k}\":"))?;
                let max = match k.chars().next() {
                    Some('x') => frame.0.saturating_sub(1) as u64,
                    Some('y') => frame.1.saturating_sub(1) as u64,
                    _ => MAX_WAIT_SECONDS,
                };
                self.int(dec, text, max)?;
            }
            Ok(())
        };
        let string_field = |key: &str, dec: &mut Decoding, text: &mut String| -> Result<()> {
            self.force(dec, text, &format!(",\"{key}\":\""))?;
            self.string(dec, text)?;
            self.force(dec, text, "\"")
        };
        match name {
            "click" | "long_press" | "double_click" | "right_click" => ints(&["x", "y"], dec, text)?,
            "scroll" => {
                ints(&["x", "y"], dec, text)?;
                self.force(dec, text, ",\"direction\":\"")?;
                self.choose(dec, text, &["up", "down", "left", "right"], "\"")?;
            }
            "swipe" | "drag" => ints(&["x1", "y1", "x2", "y2"], dec, text)?,
            "type" | "answer" => string_field("text", dec, text)?,
            "press" => string_field("key", dec, text)?,
            "open_app" => string_field("name", dec, text)?,
            "ask" => string_field("question", dec, text)?,
            "wait" => ints(&["seconds"], dec, text)?,
            "done" => {
                self.force(dec, text, ",\"status\":\"")?;
                self.choose(dec, text, &["success", "infeasible"], "\"")?;
            }
            "hotkey" => {
                self.force(dec, text, ",\"keys\":[\"")?;
                for _ in 0..4 {
                    self.string(dec, text)?;
                    let before = text.len();
                    self.choose(dec, text, &["\"]", "\",\""], "")?;
                    if text[before..].starts_with("\"]") {
                        break;
                    }
                }
                if !text.ends_with("\"]") {
                    self.force(dec, text, "\"]")?;
                }
            }
            other => return Err(RuntimeError::Internal(format!("no template for action `{other}`"))),
        }
        self.force(dec, text, "}")
    }

    /// The rest of the answer decoded freely, until the object closes, a stop token, or the budget.
    pub(crate) fn free_args(&self, dec: &mut Decoding, text: &mut String) -> Result<()> {
        let mut toks = Vec::new();
        let start = text.len();
        while dec.generated < dec.budget {
            dec.check()?;
            let tok = dec.sample(|_| true);
            if self.stop_tokens.contains(&tok) {
                break;
            }
            toks.push(tok);
            dec.seq.feed(&[tok])?;
            dec.generated += 1;
            text.truncate(start);
            text.push_str(&self.tokenizer.decode(&toks, true)?);
            if askgui_data::parse::json_object_spans(text).first().is_some_and(|r| r.start == 0) {
                break;
            }
        }
        Ok(())
    }
}
