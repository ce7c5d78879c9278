//! Chat completions: the prompt through the Qwen chat template, decoded freely.
//!
//! Key choice: text pieces are streamed as they are decoded, holding back what could still be a partial
//! UTF-8 character or the start of a stop string, so that a client never sees text that the final
//! answer does not have.

use askgui_model::{render_chat, Content, Message};
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::sequence::Seq;
use super::{Decoder, Decoding};
use crate::backend::{BackendError, ChatJob, ChatOutput, ChatPart, ChatRole, FinishReason};
use crate::batcher::Client;
use crate::model_backend::model_err;

impl Decoder {
    /// One chat completion, streaming text pieces to `stream`.
    pub(in crate::model_backend) fn chat(
        &self,
        client: &Client,
        job: &ChatJob,
        stream: Option<&tokio::sync::mpsc::UnboundedSender<String>>,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<ChatOutput, BackendError> {
        let mut images = Vec::new();
        let mut messages = Vec::new();
        for m in &job.messages {
            let role = match m.role {
                ChatRole::System => "system",
                ChatRole::User => "user",
                ChatRole::Assistant => "assistant",
            };
            let mut content = Vec::new();
            for p in &m.parts {
                match p {
                    ChatPart::Text(t) => content.push(Content::Text(t.clone())),
                    ChatPart::Image(img) => {
                        images.push((img.hash, self.processed(img)?));
                        content.push(Content::Image);
                    }
                }
            }
            messages.push(Message::new(role, content));
        }
        let text = render_chat(&messages, true);
        let merge = self.image_config.geometry.merge_size;
        let counts: Vec<usize> = images.iter().map(|(_, i)| i.num_tokens(merge)).collect();
        let ids = self.tokenizer.encode_prompt(&text, &counts).map_err(model_err)?;
        self.check_context(ids.len(), job.max_tokens)?;
        let (seq, _) = Seq::prefill(self, client, &ids, &images)?;
        let rng = StdRng::seed_from_u64(job.seed.unwrap_or(0));
        let mut dec =
            Decoding { seq, temperature: job.temperature, rng, budget: job.max_tokens, generated: 0, cancelled };
        let (mut toks, mut out, mut sent) = (Vec::new(), String::new(), 0usize);
        let mut finish = FinishReason::Length;
        while dec.generated < dec.budget {
            dec.check()?;
            let tok = dec.sample_top_p(job.top_p);
            if self.stop_tokens.contains(&tok) {
                finish = FinishReason::Stop;
                break;
            }
            toks.push(tok);
            dec.generated += 1;
            out = self.tokenizer.decode(&toks, true).map_err(model_err)?;
            if let Some(cut) = job.stop.iter().filter_map(|s| out.find(s.as_str())).min() {
                out.truncate(cut);
                finish = FinishReason::Stop;
                break;
            }
            // Send what is complete: not a partial UTF-8 character, and not a possible stop-string start.
            let hold = job.stop.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
            let safe = out.len().saturating_sub(hold);
            let safe = (0..=safe).rev().find(|&i| out.is_char_boundary(i)).unwrap_or(0);
            if safe > sent && !out[..safe].ends_with('\u{fffd}') {
                if let Some(s) = stream {
                    let _ = s.send(out[sent..safe].to_string());
                }
                sent = safe;
            }
            if dec.generated < dec.budget {
                dec.seq.feed(&[tok])?;
            }
        }
        if let Some(s) = stream {
            if out.len() > sent {
                let _ = s.send(out[sent..].to_string());
            }
        }
        Ok(ChatOutput { text: out, finish_reason: finish, prompt_tokens: ids.len(), completion_tokens: toks.len() })
    }
}
