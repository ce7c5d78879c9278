//! The runtime's state: the prompt settings, the tokenizer with its stop tokens and the token classes
//! constrained decoding allows, and the caches, shared by the threads of concurrent jobs. Each stage of
//! the chain adds its methods in its own file (`prompt`, `step`, `constrained`, `complete`).

use std::sync::{Arc, Mutex};

use askgui_data::prompt::IM_END;
use askgui_data::{PromptConfig, PromptFlags};
use askgui_model::{ImageProcessorConfig, KvPool, ModelConfig, Qwen2Vl, QwenTokenizer, Reservation, KV_BLOCK};

use crate::cache::ByteCache;
use crate::error::{Result, RuntimeError};
use crate::prefix_cache::PrefixCache;

/// The prefix cache's size when nothing says otherwise.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 256 << 20;

/// Blocks per layer a prompt's admission keeps free beyond the prompt's own: the first tokens of its
/// answer. (The forks that score options write none: their rows are not appended.)
const ANSWER_BLOCKS: usize = 3;

/// Answer length of an agent step when the options do not say.
pub const DEFAULT_STEP_TOKENS: usize = 128;

/// Longest integer a constrained answer may write (coordinates, seconds).
pub(crate) const MAX_INT_DIGITS: usize = 6;

/// Everything a step needs besides the model: the prompt settings, the tokenizer with its stop tokens
/// and the token classes constrained decoding allows, and the caches. Shared by the threads of
/// concurrent jobs.
pub struct Runtime {
    pub(crate) cfg: ModelConfig,
    pub(crate) prompt: PromptConfig,
    pub(crate) image_config: ImageProcessorConfig,
    pub(crate) tokenizer: QwenTokenizer,
    pub(crate) stop_tokens: Vec<u32>,
    pub(crate) context_length: usize,
    /// Per token id: `(value, number of digits)` when its text is one or more ASCII digits.
    pub(crate) digit_token: Vec<Option<(u64, u32)>>,
    /// The tokens that close a JSON string: `"` and every token that starts with it (`"}`, `","`: a
    /// string ends in training with whatever merges with its quote).
    pub(crate) closing_tokens: Vec<u32>,
    /// Per token id: its text is safe inside a JSON string (no quote, backslash or control character)
    /// and is not a special token.
    pub(crate) string_token: Vec<bool>,
    pub(crate) images: Mutex<ByteCache<u64, std::sync::Arc<askgui_model::ProcessedImage>>>,
    /// The model's device: screenshots are tiled there ([`askgui_model::image::preprocess_on`]).
    pub(crate) device: candle_core::Device,
    pub(crate) prefixes: Mutex<PrefixCache>,
    /// Where every sequence's KV blocks come from, and the bound on them.
    pub(crate) kv_pool: Arc<KvPool>,
    /// Bytes of one layer's keys and values of [`KV_BLOCK`] positions.
    kv_block_bytes: usize,
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
        let mut closing_tokens = Vec::new();
        // The quotes a string's tokens may not hold, and that close it: UI-TARS's single-quoted literals
        // may hold an option's JSON, so neither quote there; JSON's double quote elsewhere.
        let quotes: &[char] = match prompt.action_language {
            askgui_data::ActionLanguage::UiTars => &['\'', '"'],
            _ => &['"'],
        };
        for id in 0..vocab as u32 {
            let Ok(text) = tokenizer.decode(&[id], false) else { continue };
            let special = specials.contains(&id) || stop_tokens.contains(&id) || text.contains("<|");
            if !text.is_empty() && text.len() <= MAX_INT_DIGITS && text.bytes().all(|b| b.is_ascii_digit()) {
                digit_token[id as usize] = text.parse().ok().map(|v| (v, text.len() as u32));
            }
            if !special && text.starts_with(quotes) {
                closing_tokens.push(id);
            }
            string_token[id as usize] = !special
                && !text.is_empty()
                && !text.contains('\u{fffd}')
                && !text.chars().any(|c| quotes.contains(&c) || c == '\\' || c.is_control());
        }
        let ic = &model.image_config;
        let (min_pixels, max_pixels, token_side) = (ic.min_pixels, ic.max_pixels, ic.geometry.factor());
        let prompt = PromptConfig { min_pixels, max_pixels, token_side, ..prompt };
        Ok(Self {
            cfg: model.cfg.clone(),
            prompt,
            image_config: ic.clone(),
            tokenizer,
            stop_tokens,
            context_length: model.cfg.text.max_position_embeddings,
            digit_token,
            closing_tokens,
            string_token,
            images: Mutex::new(ByteCache::new()),
            device: model.device.clone(),
            prefixes: Mutex::new(PrefixCache::new(DEFAULT_PREFIX_CACHE_BYTES)),
            kv_pool: KvPool::new(0),
            kv_block_bytes: 2
                * model.cfg.text.num_key_value_heads
                * KV_BLOCK
                * model.cfg.text.head_dim()
                * model.dtype().size_in_bytes(),
        })
    }

    /// Bounds the KV caches of all sequences and cached prefixes together to `megabytes` (0: no bound).
    /// A prompt that does not fit drops cached prefixes, oldest first, and is refused with
    /// [`RuntimeError::KvCacheFull`] if it still does not.
    pub fn with_kv_cache_mb(mut self, megabytes: f64) -> Self {
        let blocks = (megabytes * (1u64 << 20) as f64 / self.kv_block_bytes as f64) as usize;
        self.kv_pool = KvPool::new(if megabytes > 0.0 { blocks.max(1) } else { 0 });
        self
    }

    /// The KV block pool (for its counts).
    pub fn kv_pool(&self) -> &Arc<KvPool> {
        &self.kv_pool
    }

    /// Reserves room for a prompt of `new_tokens` more positions until it has run: its blocks in every
    /// layer plus [`ANSWER_BLOCKS`]. Drops cached prefixes, oldest first, while the pool is short, and
    /// answers [`RuntimeError::KvCacheFull`] when that is not enough.
    pub(crate) fn admit(&self, new_tokens: usize) -> Result<Reservation> {
        let need = self.cfg.text.num_hidden_layers * (new_tokens.div_ceil(KV_BLOCK) + ANSWER_BLOCKS);
        let mut prefixes = self.prefixes.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match self.kv_pool.reserve(need) {
                Ok(room) => return Ok(room),
                Err(e) if !prefixes.evict_oldest() => return Err(e.into()),
                Err(_) => {}
            }
        }
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

    pub(crate) fn check_context(&self, prompt: usize, answer: usize) -> Result<()> {
        if prompt + answer > self.context_length {
            return Err(RuntimeError::ContextOverflow { tokens: prompt + answer, limit: self.context_length });
        }
        Ok(())
    }
}

/// The coordinate frame a family grounds in when nothing says otherwise: pixels of the resized image for
/// Qwen2/2.5-VL, relative 0-1000 for Qwen3-VL (its native frame; training, serving and evaluating it in
/// another one fights what it learned).
pub fn native_frame(arch: askgui_model::Arch) -> askgui_data::FrameKind {
    match arch.grounds_relative() {
        true => askgui_data::FrameKind::Relative1000,
        false => askgui_data::FrameKind::Resized,
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
