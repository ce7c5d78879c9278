//! The constrained arguments of the UI-TARS and tool-call action languages, after their action name:
//! the same template approach as askgui's JSON ([`crate::constrained`]), mirroring each language's
//! rendering (`askgui_data::language`) so that every answer parses in that language.
//!
//! Key choice: literal keys and brackets are forced, coordinates are digit tokens inside the model frame,
//! enums and optional arguments are scored like names. UI-TARS strings are single-quoted Python literals:
//! their tokens hold no quote of either kind and no backslash (an option's label sits in JSON inside the
//! literal), so nothing needs an escape; tool-call strings are JSON strings, as in askgui's JSON. Neither
//! language names elements: click-like actions always point. References: UI-TARS-1.5's action space
//! (`@ui-tars/action-parser`), the Qwen3-VL cookbook's `computer_use` tool and Fara-1.5's
//! `ask_user_question` (cited in `datasets/src/language/`).

use crate::constrained::{Schema, MAX_ASK_OPTIONS, MAX_WAIT_SECONDS};
use crate::decoding::Decoding;
use crate::error::{Result, RuntimeError};
use crate::runtime::Runtime;
use crate::sampling::pick;

/// What closes a tool call after its arguments.
const TOOL_CALL_END: &str = "}}\n</tool_call>";

impl Runtime {
    /// Which of `options` comes next, by the model's probability (scored, not written), or the first once
    /// the budget is spent (the first always ends the optional part).
    fn next_of(&self, dec: &mut Decoding, text: &str, options: &[&str]) -> Result<usize> {
        if dec.generated >= dec.budget {
            return Ok(0);
        }
        let (probs, _) = self.score(dec, text, options, "")?;
        Ok(pick(&probs, dec.temperature, &mut dec.rng, None))
    }

    /// A point as `(x,y)'` after the text that opens it, inside the frame.
    fn tars_point(&self, dec: &mut Decoding, text: &mut String, open: &str, frame: (u32, u32)) -> Result<()> {
        self.force(dec, text, open)?;
        self.int(dec, text, u64::from(frame.0.saturating_sub(1)))?;
        self.force(dec, text, ",")?;
        self.int(dec, text, u64::from(frame.1.saturating_sub(1)))?;
        self.force(dec, text, ")'")
    }

    /// A quoted UI-TARS string argument after the text that opens it (`content='`), and its closing quote.
    fn tars_string(&self, dec: &mut Decoding, text: &mut String, open: &str) -> Result<()> {
        self.force(dec, text, open)?;
        self.string(dec, text)?;
        self.force(dec, text, "'")
    }

    /// UI-TARS-1.5's arguments for `name`, after `name(`, and the closing parenthesis.
    pub(crate) fn ui_tars_args(&self, dec: &mut Decoding, name: &str, text: &mut String, s: &Schema) -> Result<()> {
        let start_box = "start_box='(";
        match name {
            "click" | "left_double" | "right_single" | "long_press" => {
                self.tars_point(dec, text, start_box, s.frame)?
            }
            "drag" => {
                self.tars_point(dec, text, start_box, s.frame)?;
                self.tars_point(dec, text, ", end_box='(", s.frame)?;
            }
            "scroll" => {
                if self.next_of(dec, text, &["direction='", start_box])? == 1 {
                    self.tars_point(dec, text, start_box, s.frame)?;
                    self.force(dec, text, ", ")?;
                }
                self.force(dec, text, "direction='")?;
                self.choose(dec, text, &["up", "down", "left", "right"], "'")?;
            }
            "type" => self.tars_string(dec, text, "content='")?,
            "finished" => {
                if self.next_of(dec, text, &[")", "content='"])? == 1 {
                    self.tars_string(dec, text, "content='")?;
                }
            }
            "hotkey" => self.tars_string(dec, text, "key='")?,
            "open_app" => self.tars_string(dec, text, "app_name='")?,
            "press_home" | "press_back" => {}
            "wait" => {
                if self.next_of(dec, text, &[")", "time='"])? == 1 {
                    self.force(dec, text, "time='")?;
                    self.int(dec, text, MAX_WAIT_SECONDS)?;
                    self.force(dec, text, "'")?;
                }
            }
            "call_user" => self.tars_ask(dec, text)?,
            other => return Err(RuntimeError::Internal(format!("no UI-TARS template for `{other}`"))),
        }
        self.force(dec, text, ")")
    }

    /// `call_user`'s question, then optionally its options (askgui's option JSON) and its kind.
    fn tars_ask(&self, dec: &mut Decoding, text: &mut String) -> Result<()> {
        self.tars_string(dec, text, "content='")?;
        let (options, kind) = (", options='[", ", kind='");
        let mut field = self.next_of(dec, text, &[")", options, kind])?;
        if field == 1 {
            self.force(dec, text, options)?;
            self.options(dec, text, "{\"label\":\"", "\"}", ",")?;
            self.force(dec, text, "'")?;
            field = 2 * self.next_of(dec, text, &[")", kind])?;
        }
        if field == 2 {
            self.force(dec, text, kind)?;
            self.choose(dec, text, &["selection", "specification"], "'")?;
        }
        Ok(())
    }

    /// One to [`MAX_ASK_OPTIONS`] labels, each `open` + string + `close`, separated by `sep`; then `]`.
    fn options(&self, dec: &mut Decoding, text: &mut String, open: &str, close: &str, sep: &str) -> Result<()> {
        for n in 1..=MAX_ASK_OPTIONS {
            self.force(dec, text, open)?;
            self.string(dec, text)?;
            self.force(dec, text, close)?;
            if n == MAX_ASK_OPTIONS || self.next_of(dec, text, &["]", sep])? == 0 {
                break;
            }
            self.force(dec, text, sep)?;
        }
        self.force(dec, text, "]")
    }

    /// `, "key": [x, y]` inside the frame.
    fn tool_point(&self, dec: &mut Decoding, text: &mut String, key: &str, frame: (u32, u32)) -> Result<()> {
        self.force(dec, text, &format!(", \"{key}\": ["))?;
        self.int(dec, text, u64::from(frame.0.saturating_sub(1)))?;
        self.force(dec, text, ", ")?;
        self.int(dec, text, u64::from(frame.1.saturating_sub(1)))?;
        self.force(dec, text, "]")
    }

    /// `, "key": "..."`.
    fn tool_string(&self, dec: &mut Decoding, text: &mut String, key: &str) -> Result<()> {
        self.force(dec, text, &format!(", \"{key}\": \""))?;
        self.string(dec, text)?;
        self.force(dec, text, "\"")
    }

    /// The tool call's arguments for `name`, after `"action": "name"`, and the end of the call.
    pub(crate) fn tool_call_args(&self, dec: &mut Decoding, name: &str, text: &mut String, s: &Schema) -> Result<()> {
        match name {
            "left_click" | "double_click" | "right_click" | "long_press" => {
                self.tool_point(dec, text, "coordinate", s.frame)?
            }
            "left_click_drag" => {
                self.tool_point(dec, text, "start_coordinate", s.frame)?;
                self.tool_point(dec, text, "coordinate", s.frame)?;
            }
            "swipe" => {
                self.tool_point(dec, text, "coordinate", s.frame)?;
                self.tool_point(dec, text, "coordinate2", s.frame)?;
            }
            "scroll" | "hscroll" => {
                if self.next_of(dec, text, &[", \"pixels\": ", ", \"coordinate\": ["])? == 1 {
                    self.tool_point(dec, text, "coordinate", s.frame)?;
                }
                self.force(dec, text, ", \"pixels\": ")?;
                let pixels = askgui_data::language::TOOL_SCROLL_PIXELS;
                let (plus, minus) = (pixels.to_string(), (-pixels).to_string());
                self.choose(dec, text, &[&plus, &minus], "")?;
            }
            "type" | "open" | "answer" => self.tool_string(dec, text, "text")?,
            "key" => self.tool_keys(dec, text)?,
            "system_button" => {
                self.force(dec, text, ", \"button\": \"")?;
                self.choose(dec, text, &["Back", "Home", "Menu", "Enter"], "\"")?;
            }
            "wait" => {
                self.force(dec, text, ", \"time\": ")?;
                self.int(dec, text, MAX_WAIT_SECONDS)?;
                // `json.dumps` writes the float seconds of a training target with their point.
                self.force(dec, text, ".0")?;
            }
            "terminate" => {
                self.force(dec, text, ", \"status\": \"")?;
                self.choose(dec, text, &["success", "failure"], "\"")?;
            }
            "ask_user_question" => self.tool_ask(dec, text)?,
            other => return Err(RuntimeError::Internal(format!("no tool-call template for `{other}`"))),
        }
        self.force(dec, text, TOOL_CALL_END)
    }

    /// `, "keys": [...]`: one to four strings.
    fn tool_keys(&self, dec: &mut Decoding, text: &mut String) -> Result<()> {
        self.force(dec, text, ", \"keys\": [\"")?;
        for n in 1..=4 {
            self.string(dec, text)?;
            if n == 4 || self.next_of(dec, text, &["\"]", "\", \""])? == 0 {
                break;
            }
            self.force(dec, text, "\", \"")?;
        }
        self.force(dec, text, "\"]")
    }

    /// `ask_user_question`'s question, then optionally its options and its kind.
    fn tool_ask(&self, dec: &mut Decoding, text: &mut String) -> Result<()> {
        self.tool_string(dec, text, "question")?;
        let (options, kind) = (", \"options\": [", ", \"kind\": \"");
        let mut field = self.next_of(dec, text, &[TOOL_CALL_END, options, kind])?;
        if field == 1 {
            self.force(dec, text, options)?;
            self.options(dec, text, "{\"label\": \"", "\"}", ", ")?;
            field = 2 * self.next_of(dec, text, &[TOOL_CALL_END, kind])?;
        }
        if field == 2 {
            self.force(dec, text, kind)?;
            self.choose(dec, text, &["selection", "specification"], "\"")?;
        }
        Ok(())
    }
}
