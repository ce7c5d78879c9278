//! The arguments of an agent step's answer in askgui's JSON language, after its action name: a template,
//! or free text (free text in every language; the other languages' templates are in `language_args`).
//!
//! Key choice: with `constrain` (the default) the arguments follow the action's schema as a template:
//! literal keys are forced, integers may only use digit tokens and stay inside the model frame
//! (coordinates) or 0..=60 (`wait` seconds), strings may not contain a quote or a backslash, enums,
//! element ids and optional fields are scored like names (the model's probability of each continuation);
//! the answer therefore always parses and validates. An element target is one of the ids the prompt
//! lists; without a screenshot a click-like action targets an element (text-only front ends). An `ask`
//! may carry up to [`MAX_ASK_OPTIONS`] options and its kind. `max_tokens` bounds the answer: once it is
//! spent, strings and numbers end after their first token and optional fields are left out, but the
//! required keys and brackets are always written, so a constrained answer can exceed it by those. Without `constrain` the model writes the rest freely and an answer
//! that does not parse is an error.

use askgui_data::language::py_escape;
use askgui_data::ActionLanguage;

use crate::decoding::Decoding;
use crate::error::{Result, RuntimeError};
use crate::runtime::{Runtime, MAX_INT_DIGITS};
use crate::sampling::{best, normalise, pick};

/// The longest `wait` a constrained answer may ask for.
pub(crate) const MAX_WAIT_SECONDS: u64 = 60;
/// The most options a constrained `ask` may offer.
pub const MAX_ASK_OPTIONS: usize = 6;

/// What a constrained answer may refer to.
pub(crate) struct Schema<'a> {
    /// The model frame `(width, height)`: coordinates stay inside it.
    pub(crate) frame: (u32, u32),
    /// The ids of the elements the prompt lists: an element target is one of them.
    pub(crate) elements: &'a [String],
    /// Whether the prompt shows a screenshot (without one, click-like actions target elements).
    pub(crate) screenshot: bool,
}

/// Whether the inside `s` of a UI-TARS string, with more to come, holds nothing that `py_escape` escapes
/// (quotes and backslashes are never string tokens; whitespace at the end may still be followed).
fn says_no_syntax(s: &str) -> bool {
    let body = s.trim_end();
    !body.is_empty() && py_escape(body) == body
}

/// `s` as the inside of a JSON string.
fn json_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

impl Runtime {
    /// Brings the sequence to the training tokenisation of the answer `text` (plus `pending`, text chosen
    /// but not yet written): what the model reads is always the text encoded as training encodes it.
    pub(crate) fn settle(&self, dec: &mut Decoding, text: &str, pending: &str) -> Result<()> {
        let canon = self.tokenizer.encode(&format!("{text}{pending}"))?;
        dec.seq.sync(&canon)
    }

    /// Writes the literal `lit` (fed at the next decision, in the text's own tokenisation).
    pub(crate) fn force(&self, dec: &mut Decoding, text: &mut String, lit: &str) -> Result<()> {
        dec.generated += self.tokenizer.encode(lit)?.len();
        text.push_str(lit);
        Ok(())
    }

    /// Decodes one integer in `0..=max`: digit tokens that keep the value in range, ended when a
    /// non-digit token would be more likely than any of them (or at [`MAX_INT_DIGITS`]).
    pub(crate) fn int(&self, dec: &mut Decoding, text: &mut String, max: u64) -> Result<()> {
        // The digits so far: their text, value and count (leading zeros count towards the length only).
        let (mut digits, mut value, mut len) = (String::new(), 0u64, 0u32);
        while dec.generated < dec.budget || len == 0 {
            dec.check()?;
            self.settle(dec, text, &digits)?;
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
            digits.push_str(&self.tokenizer.decode(&[tok], false)?);
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

    /// Decodes the inside of a string: tokens safe in a string until the model prefers to close it (a
    /// token that starts with a quote is more likely than any string token) or the budget ends. In UI-TARS
    /// a token is also refused where the string would then hold what `@ui-tars/action-parser` reads as
    /// syntax (`Action:`, `point=`, `<|box_`, `<point>`, a leading space: what [`py_escape`] escapes, and
    /// the decoder writes no escapes), and a string ending in whitespace is not closed while the budget
    /// lasts (that parser trims it).
    pub(crate) fn string(&self, dec: &mut Decoding, text: &mut String) -> Result<()> {
        let (start, mut n) = (text.len(), 0);
        let tars = self.prompt.action_language == ActionLanguage::UiTars;
        // At least one token: the schema has no empty strings (an `ask` needs a question).
        while n == 0 || dec.generated < dec.budget {
            dec.check()?;
            self.settle(dec, text, "")?;
            let mut banned: Vec<u32> = Vec::new();
            let allowed = |i: usize, banned: &[u32]| self.string_token[i] && !banned.contains(&(i as u32));
            let picked = loop {
                let Some((tok, v)) = best(&dec.seq.logits, |i| allowed(i, &banned)) else { break None };
                let tok = if dec.temperature > 0.0 { dec.sample(|i| allowed(i, &banned)) } else { tok };
                let piece = self.tokenizer.decode(&[tok], false)?;
                if !tars || says_no_syntax(&format!("{}{piece}", &text[start..])) {
                    break Some((tok, v, piece));
                }
                banned.push(tok);
            };
            let Some((_, v, piece)) = picked else { break };
            let logits = &dec.seq.logits;
            let close_v = self.closing_tokens.iter().map(|&c| logits[c as usize]).fold(f32::NEG_INFINITY, f32::max);
            let open_end = tars && text[start..].ends_with(char::is_whitespace);
            if n > 0 && close_v > v && !open_end {
                break;
            }
            text.push_str(&piece);
            dec.generated += 1;
            n += 1;
        }
        Ok(())
    }

    /// The model's probability of each of `options` (each followed by `after`) as the continuation of
    /// `text`, every one scored in the tokenisation training gives `text` + it; and each one's tokens.
    pub(crate) fn score(
        &self,
        dec: &mut Decoding,
        text: &str,
        options: &[&str],
        after: &str,
    ) -> Result<(Vec<f64>, Vec<usize>)> {
        let base = self.tokenizer.encode(text)?;
        let full: Vec<Vec<u32>> = options
            .iter()
            .map(|o| self.tokenizer.encode(&format!("{text}{o}{after}")))
            .collect::<std::result::Result<_, _>>()?;
        // Where every option's tokens part from the text's (an option may merge with its last tokens).
        let common = |f: &Vec<u32>| base.iter().zip(f).take_while(|(a, b)| a == b).count();
        let from = full.iter().map(common).min().unwrap_or(base.len());
        dec.seq.sync(&base[..from])?;
        let tails: Vec<Vec<u32>> = full.iter().map(|f| f[from..].to_vec()).collect();
        let probs = normalise(&dec.seq.logprobs(&tails)?);
        Ok((probs, tails.iter().map(Vec::len).collect()))
    }

    /// Picks one of `options` (each followed by `after`) by the model's probability.
    pub(crate) fn choose(&self, dec: &mut Decoding, text: &mut String, options: &[&str], after: &str) -> Result<()> {
        let (probs, lens) = self.score(dec, text, options, after)?;
        let i = pick(&probs, dec.temperature, &mut dec.rng, None);
        dec.generated += lens[i];
        text.push_str(options[i]);
        text.push_str(after);
        Ok(())
    }

    /// One of `fields` (each the text that opens it, e.g. `,"kind":"`), or the end of the object: `None`
    /// when the model closes it.
    /// With the budget spent, the object is closed.
    fn next_field(&self, dec: &mut Decoding, text: &mut String, fields: &[&str]) -> Result<Option<usize>> {
        if dec.generated >= dec.budget {
            self.force(dec, text, "}")?;
            return Ok(None);
        }
        let options: Vec<&str> = std::iter::once("}").chain(fields.iter().copied()).collect();
        let before = text.len();
        self.choose(dec, text, &options, "")?;
        Ok(options.iter().skip(1).position(|f| text[before..] == **f))
    }

    /// Integers for `keys` (`x`/`y` coordinates inside the frame, else seconds).
    fn ints(&self, dec: &mut Decoding, text: &mut String, keys: &[&str], frame: (u32, u32)) -> Result<()> {
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
    }

    /// A string field: its key, its contents, its closing quote.
    fn string_field(&self, dec: &mut Decoding, text: &mut String, key: &str) -> Result<()> {
        self.force(dec, text, &format!(",\"{key}\":\""))?;
        self.string(dec, text)?;
        self.force(dec, text, "\"")
    }

    /// One of the listed element ids, inside an opened string, and its closing quote.
    fn element(&self, dec: &mut Decoding, text: &mut String, ids: &[String]) -> Result<()> {
        let escaped: Vec<String> = ids.iter().map(|id| json_escape(id)).collect();
        let options: Vec<&str> = escaped.iter().map(String::as_str).collect();
        self.choose(dec, text, &options, "\"")
    }

    /// A click-like target: a point, then optionally one of the listed elements; without a screenshot, an
    /// element alone (or a point when no element is listed). Returns whether the object is closed.
    fn target(&self, dec: &mut Decoding, text: &mut String, s: &Schema) -> Result<bool> {
        if !s.screenshot && !s.elements.is_empty() {
            self.force(dec, text, ",\"element\":\"")?;
            self.element(dec, text, s.elements)?;
            return Ok(false);
        }
        self.ints(dec, text, &["x", "y"], s.frame)?;
        if s.elements.is_empty() {
            return Ok(false);
        }
        match self.next_field(dec, text, &[",\"element\":\""])? {
            None => Ok(true),
            Some(_) => self.element(dec, text, s.elements).map(|_| false),
        }
    }

    /// An `ask`'s fields: the question, then optionally its options and its kind. Returns whether the
    /// object is closed.
    fn ask(&self, dec: &mut Decoding, text: &mut String) -> Result<bool> {
        self.string_field(dec, text, "question")?;
        let (options, kind) = (",\"options\":[", ",\"kind\":\"");
        let mut field = self.next_field(dec, text, &[options, kind])?;
        if field == Some(0) {
            for n in 1..=MAX_ASK_OPTIONS {
                self.force(dec, text, "{\"label\":\"")?;
                self.string(dec, text)?;
                self.force(dec, text, "\"}")?;
                let before = text.len();
                if n == MAX_ASK_OPTIONS || dec.generated >= dec.budget {
                    self.force(dec, text, "]")?;
                } else {
                    self.choose(dec, text, &["]", ","], "")?;
                }
                if text[before..].starts_with(']') {
                    break;
                }
            }
            field = self.next_field(dec, text, &[kind])?.map(|_| 1);
        }
        match field {
            None => Ok(true),
            Some(_) => {
                self.choose(dec, text, &["selection", "specification"], "\"")?;
                Ok(false)
            }
        }
    }

    /// The action's arguments as a template of forced keys and typed values (see the module docs).
    pub(crate) fn constrained_args(&self, dec: &mut Decoding, name: &str, text: &mut String, s: &Schema) -> Result<()> {
        let closed = match name {
            "click" | "long_press" | "double_click" | "right_click" => self.target(dec, text, s)?,
            "scroll" => {
                if s.screenshot {
                    self.ints(dec, text, &["x", "y"], s.frame)?;
                }
                self.force(dec, text, ",\"direction\":\"")?;
                self.choose(dec, text, &["up", "down", "left", "right"], "\"")?;
                false
            }
            "swipe" | "drag" => {
                self.ints(dec, text, &["x1", "y1", "x2", "y2"], s.frame)?;
                false
            }
            "type" | "answer" => self.string_field(dec, text, "text").map(|_| false)?,
            "press" => self.string_field(dec, text, "key").map(|_| false)?,
            "open_app" => self.string_field(dec, text, "name").map(|_| false)?,
            "ask" => self.ask(dec, text)?,
            "wait" => {
                self.ints(dec, text, &["seconds"], s.frame)?;
                false
            }
            "done" => {
                self.force(dec, text, ",\"status\":\"")?;
                self.choose(dec, text, &["success", "infeasible"], "\"")?;
                false
            }
            "hotkey" => {
                self.hotkey(dec, text)?;
                false
            }
            other => return Err(RuntimeError::Internal(format!("no template for action `{other}`"))),
        };
        if !closed {
            self.force(dec, text, "}")?;
        }
        Ok(())
    }

    /// A hotkey's keys: one to four strings.
    fn hotkey(&self, dec: &mut Decoding, text: &mut String) -> Result<()> {
        self.force(dec, text, ",\"keys\":[\"")?;
        for _ in 1..4 {
            self.string(dec, text)?;
            let before = text.len();
            self.choose(dec, text, &["\"]", "\",\""], "")?;
            if text[before..].starts_with("\"]") {
                return Ok(());
            }
        }
        self.string(dec, text)?;
        self.force(dec, text, "\"]")
    }

    /// The rest of the answer decoded freely, until the language's answer closes
    /// ([`ActionLanguage::answer_closed`]), a stop token, or the budget.
    pub(crate) fn free_args(&self, dec: &mut Decoding, text: &mut String, language: ActionLanguage) -> Result<()> {
        let mut toks = Vec::new();
        let start = text.len();
        while dec.generated < dec.budget {
            dec.check()?;
            self.settle(dec, text, "")?;
            let tok = dec.sample(|_| true);
            if self.stop_tokens.contains(&tok) {
                break;
            }
            toks.push(tok);
            dec.generated += 1;
            text.truncate(start);
            text.push_str(&self.tokenizer.decode(&toks, true)?);
            if language.answer_closed(text) {
                break;
            }
        }
        Ok(())
    }
}
