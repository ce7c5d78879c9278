//! Free completions: a prompt's continuation, sampled token by token until a stop token, a stop string
//! or the length limit (the server's chat completions, the trainer's sample predictions).
//!
//! Key choice: text pieces go to `on_text` as they are decoded, holding back what could still be a
//! partial UTF-8 character or the start of a stop string, so that a client never sees text that the
//! final answer does not have.

use askgui_model::{render_chat_with, Message};

use crate::decoding::Decoding;
use crate::error::Result;
use crate::forward::Forward;
use crate::prompt::{ImageInput, PreparedImage};
use crate::runtime::Runtime;
use crate::sampling::sample;
use crate::sequence::Seq;

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// What to complete and how.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    /// The prompt, each image's pads expanded.
    pub ids: Vec<u32>,
    pub images: Vec<PreparedImage>,
    pub max_tokens: usize,
    /// 0 is greedy.
    pub temperature: f64,
    pub top_p: f64,
    pub seed: u64,
    /// Stop strings: the text ends before the first occurrence of any.
    pub stop: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct Completion {
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

impl Runtime {
    /// The ids and images of chat `messages` in the checkpoint's template; `images` are the
    /// [`askgui_model::Content::Image`] parts' images, in order.
    pub fn chat_prompt(&self, messages: &[Message], images: &[ImageInput]) -> Result<(Vec<u32>, Vec<PreparedImage>)> {
        let images: Vec<PreparedImage> =
            images.iter().map(|i| Ok((i.hash, self.processed(i)?))).collect::<Result<_>>()?;
        let merge = self.image_config.geometry.merge_size;
        let counts: Vec<usize> = images.iter().map(|(_, i)| i.num_tokens(merge)).collect();
        let text = render_chat_with(messages, true, self.cfg.arch.default_system_prompt());
        let ids = self.tokenizer.encode_prompt(&text, &counts)?;
        Ok((ids, images))
    }

    /// Completes `req.ids` through `fwd`, sending text pieces to `on_text` as they are final.
    pub fn complete(
        &self,
        fwd: &dyn Forward,
        req: &CompletionRequest,
        on_text: &mut dyn FnMut(&str),
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Completion> {
        self.check_context(req.ids.len(), req.max_tokens)?;
        let (seq, _) = Seq::prefill(self, fwd, &req.ids, &req.images)?;
        let mut dec = Decoding::new(seq, req.temperature, req.seed, req.max_tokens, cancelled);
        let (mut toks, mut out, mut sent) = (Vec::new(), String::new(), 0usize);
        let mut finish = FinishReason::Length;
        while dec.generated < dec.budget {
            dec.check()?;
            let tok = sample(&dec.seq.logits, |_| true, req.temperature, req.top_p, &mut dec.rng);
            if self.stop_tokens.contains(&tok) {
                finish = FinishReason::Stop;
                break;
            }
            toks.push(tok);
            dec.generated += 1;
            out = self.tokenizer.decode(&toks, true)?;
            if let Some(cut) = req.stop.iter().filter_map(|s| out.find(s.as_str())).min() {
                out.truncate(cut);
                finish = FinishReason::Stop;
                break;
            }
            // Send what is complete: not a partial UTF-8 character, and not a possible stop-string start.
            let hold = req.stop.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
            let safe = out.len().saturating_sub(hold);
            let safe = (0..=safe).rev().find(|&i| out.is_char_boundary(i)).unwrap_or(0);
            if safe > sent && !out[..safe].ends_with('\u{fffd}') {
                on_text(&out[sent..safe]);
                sent = safe;
            }
            if dec.generated < dec.budget {
                dec.seq.feed(&[tok])?;
            }
        }
        if out.len() > sent {
            on_text(&out[sent..]);
        }
        Ok(Completion { text: out, finish, prompt_tokens: req.ids.len(), completion_tokens: toks.len() })
    }
}
