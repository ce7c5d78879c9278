//! The tokenizer and the Qwen-VL ChatML template with images.
//!
//! `<|im_start|>role\n ... <|im_end|>\n` per message, a default system prompt when the first message is
//! not a system message (Qwen2/2.5-VL; Qwen3-VL's template has none, [`crate::Arch::default_system_prompt`]), an image as `<|vision_start|><|image_pad|><|vision_end|>`, and
//! `<|im_start|>assistant\n` as the generation prompt. After tokenising, each image's single
//! `<|image_pad|>` is expanded to one pad per merged patch, as the transformers processor does.

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

pub const DEFAULT_SYSTEM_PROMPT: &str = crate::config::QWEN2_SYSTEM_PROMPT;
pub const IMAGE_PLACEHOLDER: &str = "<|vision_start|><|image_pad|><|vision_end|>";

/// One piece of a message.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    Image,
    Text(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: Vec<Content>,
}

impl Message {
    pub fn new(role: &str, content: Vec<Content>) -> Self {
        Self { role: role.into(), content }
    }
    pub fn text(role: &str, text: &str) -> Self {
        Self::new(role, vec![Content::Text(text.into())])
    }
}

/// Renders messages with the Qwen2.5-VL chat template (images as single placeholders).
pub fn render_chat(messages: &[Message], add_generation_prompt: bool) -> String {
    render_chat_with(messages, add_generation_prompt, Some(DEFAULT_SYSTEM_PROMPT))
}

/// [`render_chat`] with a family's default system prompt (`None`: a chat without a system message has
/// none, as in Qwen3-VL's template).
pub fn render_chat_with(messages: &[Message], add_generation_prompt: bool, default_system: Option<&str>) -> String {
    let mut s = String::new();
    if let Some(system) = default_system.filter(|_| messages.first().is_none_or(|m| m.role != "system")) {
        s.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
    }
    for m in messages {
        s.push_str(&format!("<|im_start|>{}\n", m.role));
        for c in &m.content {
            match c {
                Content::Image => s.push_str(IMAGE_PLACEHOLDER),
                Content::Text(t) => s.push_str(t),
            }
        }
        s.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        s.push_str("<|im_start|>assistant\n");
    }
    s
}

/// A Hugging Face `tokenizer.json` with the ids the model needs.
pub struct QwenTokenizer {
    inner: tokenizers::Tokenizer,
    pub image_pad_id: u32,
}

impl QwenTokenizer {
    /// Loads the tokenizer and checks that its `<|image_pad|>` id is the model's `image_token_id`.
    pub fn from_file(path: &Path, cfg: Option<&ModelConfig>) -> Result<Self> {
        let err = |reason: String| ModelError::Tokenizer { path: path.to_path_buf(), reason };
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| err(format!("cannot load: {e}")))?;
        let image_pad_id = inner
            .token_to_id("<|image_pad|>")
            .ok_or_else(|| err("has no `<|image_pad|>` token; is this a Qwen2-VL tokenizer?".into()))?;
        if let Some(cfg) = cfg {
            if image_pad_id != cfg.image_token_id {
                return Err(err(format!(
                    "`<|image_pad|>` is id {image_pad_id} but config.json says image_token_id {}",
                    cfg.image_token_id
                )));
            }
        }
        Ok(Self { inner, image_pad_id })
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token ids of rendered text, without expanding images.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| ModelError::Prompt(format!("tokenizer failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of a rendered prompt with image `i`'s pad expanded to `image_tokens[i]` pads.
    pub fn encode_prompt(&self, text: &str, image_tokens: &[usize]) -> Result<Vec<u32>> {
        let ids = self.encode(text)?;
        let pads = ids.iter().filter(|&&t| t == self.image_pad_id).count();
        if pads != image_tokens.len() {
            return Err(ModelError::Prompt(format!(
                "the prompt has {pads} image placeholders but {} images were given",
                image_tokens.len()
            )));
        }
        let mut out = Vec::with_capacity(ids.len() + image_tokens.iter().sum::<usize>());
        let mut next = image_tokens.iter();
        for t in ids {
            if t == self.image_pad_id {
                let n = *next.next().unwrap_or(&1);
                out.extend(std::iter::repeat_n(t, n));
            } else {
                out.push(t);
            }
        }
        Ok(out)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| ModelError::Prompt(format!("tokenizer failed to decode: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_adds_default_system_prompt_and_generation_prompt() {
        let m = [Message::new("user", vec![Content::Image, Content::Text("Hi".into())])];
        assert_eq!(
            render_chat(&m, true),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n\
             <|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system = [Message::text("system", "S"), Message::text("user", "U")];
        assert_eq!(
            render_chat(&with_system, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
    }
}
