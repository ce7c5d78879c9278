//! askgui's agent runtime: one agent step, the same in `askgui-serve`, `askgui-eval` and the trainer's
//! periodic eval.
//!
//! The chain, in order:
//! 1. the screenshots through the checkpoint's own image processor, then the coordinate frame
//!    ([`prompt`]);
//! 2. the training prompt ([`askgui_data::step_messages`] in ChatML), then token ids with each image's
//!    pads expanded ([`encode_chat`], which the trainer's data loader calls too);
//! 3. decoding ([`step`]): the forced prefix `{"action":"`, the action names scored exactly, the
//!    arguments constrained to the action's schema (or free), one sampler, one set of stop rules;
//! 4. the parsed action, back in screen pixels.
//!
//! Key choice: the decoding logic never holds the model; it asks a [`Forward`] for model work. The
//! server's forward packs concurrent jobs into one pass, [`Solo`] runs on a model this thread holds, and
//! both run [`Packed::forward`], so what is served is what is evaluated.

mod cache;
mod complete;
mod constrained;
mod error;
pub mod forward;
mod packed;
pub mod prefix_cache;
mod prompt;
mod sampling;
mod sequence;
mod step;

use std::sync::Mutex;

use askgui_data::prompt::IM_END;
use askgui_data::{PromptConfig, PromptFlags};
use askgui_model::{ImageProcessorConfig, ModelConfig, Qwen2Vl, QwenTokenizer};

pub use complete::{Completion, CompletionRequest, FinishReason};
pub use error::{Result, RuntimeError};
pub use forward::{Forward, Item, ItemOut, Solo};
pub use packed::Packed;
pub use prompt::{content_hash, encode_chat, Encoded, ImageInput, PreparedImage, Step, StepPrompt};
pub use step::StepOutput;

use cache::ByteCache;
use constrained::MAX_INT_DIGITS;
use prefix_cache::PrefixCache;

/// The prefix cache's size when nothing says otherwise.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 256 << 20;

/// Answer length of an agent step when the options do not say.
pub const DEFAULT_STEP_TOKENS: usize = 128;

/// Everything a step needs besides the model: the prompt settings, the tokenizer with its stop tokens
/// and the token classes constrained decoding allows, and the caches. Shared by the threads of
/// concurrent jobs.
pub struct Runtime {
    cfg: ModelConfig,
    prompt: PromptConfig,
    image_config: ImageProcessorConfig,
    tokenizer: QwenTokenizer,
    stop_tokens: Vec<u32>,
    context_length: usize,
    /// Per token id: `(value, number of digits)` when its text is one or more ASCII digits.
    digit_token: Vec<Option<(u64, u32)>>,
    /// The token that closes a JSON string (`"`).
    quote_token: Option<u32>,
    /// Per token id: its text is safe inside a JSON string (no quote, backslash or control character)
    /// and is not a special token.
    string_token: Vec<bool>,
    images: Mutex<ByteCache<u64, std::sync::Arc<askgui_model::ProcessedImage>>>,
    prefixes: Mutex<PrefixCache>,
}

impl Runtime {
    /// The runtime of a loaded model with the prompt settings `prompt`; the pixel bounds are the
    /// model's image processor's (set them with [`apply_image_bounds`] first), so the frame in the prompt
    /// is always the size of the image the model sees.
    pub fn new(model: &Qwen2Vl, prompt: PromptConfig) -> Result<Self> {
        let tokenizer = model.tokenizer()?;
        let mut stop_tokens = model.eos_token_ids.clone();
        if let Some(id) = tokenizer.token_id(IM_END) {
            if !stop_tokens.contains(&id) {
                stop_tokens.push(id);
            }
        }
        let vocab = model.cfg.text.vocab_size;
        let specials = [model.cfg.image_token_id, model.cfg.vision_start_token_id, model.cfg.vision_end_token_id];
        let (mut digit_token, mut string_token) = (vec![None; vocab], vec![false; vocab]);
        for id in 0..vocab as u32 {
            let Ok(text) = tokenizer.decode(&[id], false) else { continue };
            let special = specials.contains(&id) || stop_tokens.contains(&id) || text.contains("<|");
            if !text.is_empty() && text.len() <= MAX_INT_DIGITS && text.bytes().all(|b| b.is_ascii_digit()) {
                digit_token[id as usize] = text.parse().ok().map(|v| (v, text.len() as u32));
            }
            string_token[id as usize] = !special
                && !text.is_empty()
                && !text.contains('\u{fffd}')
                && !text.chars().any(|c| c == '"' || c == '\\' || c.is_control());
        }
        let quote_token = tokenizer.encode("\"")?.first().copied();
        let ic = &model.image_config;
        let prompt = PromptConfig { min_pixels: ic.min_pixels, max_pixels: ic.max_pixels, ..prompt };
        Ok(Self {
            cfg: model.cfg.clone(),
            prompt,
            image_config: ic.clone(),
            tokenizer,
            stop_tokens,
            context_length: model.cfg.text.max_position_embeddings,
            digit_token,
            quote_token,
            string_token,
            images: Mutex::new(ByteCache::new()),
            prefixes: Mutex::new(PrefixCache::new(DEFAULT_PREFIX_CACHE_BYTES)),
        })
    }

    /// Sets the prefix cache's size in bytes (0: no reuse).
    pub fn with_prefix_cache(mut self, bytes: usize) -> Self {
        self.prefixes = Mutex::new(PrefixCache::new(bytes));
        self
    }

    /// The prompt settings every step is built with.
    pub fn prompt_config(&self) -> &PromptConfig {
        &self.prompt
    }

    pub fn tokenizer(&self) -> &QwenTokenizer {
        &self.tokenizer
    }

    /// The longest prompt plus answer, in tokens.
    pub fn context_length(&self) -> usize {
        self.context_length
    }

    fn check_context(&self, prompt: usize, answer: usize) -> Result<()> {
        if prompt + answer > self.context_length {
            return Err(RuntimeError::ContextOverflow { tokens: prompt + answer, limit: self.context_length });
        }
        Ok(())
    }
}

/// Sets the model's image processor to the pixel bounds `flags` give (unset ones keep the processor's),
/// refusing bounds that do not fit.
pub fn apply_image_bounds(model: &mut Qwen2Vl, flags: &PromptFlags) -> Result<()> {
    let ic = &mut model.image_config;
    ic.min_pixels = flags.min_pixels.unwrap_or(ic.min_pixels);
    ic.max_pixels = flags.max_pixels.unwrap_or(ic.max_pixels);
    if ic.min_pixels > ic.max_pixels {
        return Err(RuntimeError::BadInput(format!(
            "min_pixels {} > max_pixels {}: give --min-pixels and --max-pixels that fit",
            ic.min_pixels, ic.max_pixels
        )));
    }
    Ok(())
}
