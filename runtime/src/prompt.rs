//! Steps 1 and 2 of the chain: screenshots through the checkpoint's image processor, the coordinate
//! frame, the training prompt, and its token ids.
//!
//! Key choice: the step's prompt is the training prompt ([`askgui_data::step_messages`] in ChatML) and
//! its ids come from [`encode_chat`], the function the trainer's data loader tokenises samples with, so a
//! model is asked exactly what it was trained on. For the `resized` frame the model frame is the size
//! the processor resized the current screenshot to, so the coordinates the model reads and writes are
//! pixels of exactly the image it saw.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use askgui_data::prompt::{render_chatml, step_messages, Rendered, StepContext};
use askgui_data::{Element, FrameKind, FrameMap, Turn};
use askgui_model::image::preprocess_on;
use askgui_model::{load_image, ProcessedImage, QwenTokenizer};

use crate::error::{Result, RuntimeError};
use crate::runtime::Runtime;

/// A decoded screenshot and a hash of its content (the key of the preprocessing and vision caches).
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub image: Arc<image::RgbImage>,
    pub hash: u64,
}

impl ImageInput {
    /// A screenshot file, decoded within `max_pixels`; hashed by its pixels.
    pub fn load(path: &Path, max_pixels: usize) -> Result<Self> {
        let image = load_image(path, max_pixels)?;
        let hash = content_hash(image.as_raw());
        Ok(Self { image: Arc::new(image), hash })
    }
}

/// The cache key of some bytes: SipHash with keys drawn at random once per process, so that no client
/// can craft an image whose key collides with another client's screenshot (and be answered from that
/// screenshot's cached vision features).
pub fn content_hash(bytes: &[u8]) -> u64 {
    static KEYS: OnceLock<RandomState> = OnceLock::new();
    KEYS.get_or_init(RandomState::new).hash_one(bytes)
}

/// An image through the checkpoint's processor, with its content hash.
pub type PreparedImage = (u64, Arc<ProcessedImage>);

/// One agent step as every tool hands it to the runtime.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    pub task: &'a str,
    /// Everything before this step in screen pixels, ASK and SAY turns included.
    pub history: &'a [Turn],
    /// Earlier screenshots, oldest first, then the current one; the prompt shows the current one and at
    /// most `history_images` before it. Empty for a step answered from its element list alone.
    pub screenshots: &'a [ImageInput],
    /// The step's element list; the prompt lists it when the prompt settings say `elements`.
    pub elements: Option<&'a [Element]>,
    /// The screen in pixels; the current screenshot's size when `None`.
    pub screen: Option<(u32, u32)>,
}

/// A step's prompt, ready to prefill.
#[derive(Debug, Clone)]
pub struct StepPrompt {
    /// Up to and including `<|im_start|>assistant\n`, each image's pad expanded.
    pub ids: Vec<u32>,
    /// The images shown, in prompt order, with their hashes.
    pub images: Vec<PreparedImage>,
    pub frame: FrameMap,
    pub image_tokens: usize,
    /// The ids of the elements the prompt lists (an element target must be one of them).
    pub element_ids: Vec<String>,
}

/// Rendered text as token ids, with the loss mask and where each image's pads start.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    /// True on the tokens of the rendering's loss spans.
    pub mask: Vec<bool>,
    pub starts: Vec<usize>,
}

/// Token ids of a rendering: the text is split at its loss spans and each piece encoded on its own, so
/// the supervised tokens are exactly the targets' tokens (a span starts after `<|im_start|>assistant\n`
/// and ends at a special token, so the split falls on a pre-tokenizer boundary); image `i`'s one
/// `<|image_pad|>` becomes `pads[i]` pads.
pub fn encode_chat(tok: &QwenTokenizer, r: &Rendered, pads: &[usize]) -> Result<Encoded> {
    let mut pieces = Vec::new();
    let mut at = 0;
    for s in &r.loss_spans {
        pieces.push((at, s.start, false));
        pieces.push((s.start, s.end, true));
        at = s.end;
    }
    pieces.push((at, r.text.len(), false));
    let mut counts = pads.iter();
    let mut out = Encoded { ids: Vec::new(), mask: Vec::new(), starts: Vec::new() };
    for (a, b, sup) in pieces.into_iter().filter(|(a, b, _)| a < b) {
        for t in tok.encode(&r.text[a..b])? {
            let n = match t == tok.image_pad_id {
                true => {
                    out.starts.push(out.ids.len());
                    *counts.next().ok_or_else(|| bad_images(pads.len(), out.starts.len()))?
                }
                false => 1,
            };
            out.ids.extend(std::iter::repeat_n(t, n));
            out.mask.extend(std::iter::repeat_n(sup, n));
        }
    }
    if out.starts.len() != pads.len() {
        return Err(bad_images(pads.len(), out.starts.len()));
    }
    Ok(out)
}

fn bad_images(images: usize, placeholders: usize) -> RuntimeError {
    RuntimeError::Internal(format!("the prompt has {placeholders} or more image placeholders for {images} images"))
}

impl Runtime {
    /// An image through the checkpoint's processor, with its hash.
    pub fn prepare(&self, img: &ImageInput) -> Result<PreparedImage> {
        Ok((img.hash, self.processed(img)?))
    }

    /// The checkpoint's preprocessing of an image, cached by content hash.
    pub(crate) fn processed(&self, img: &ImageInput) -> Result<Arc<ProcessedImage>> {
        if let Some(p) = self.images.lock().unwrap_or_else(|p| p.into_inner()).get(&img.hash) {
            return Ok(p);
        }
        let p = Arc::new(preprocess_on(&img.image, &self.image_config, &self.device)?);
        let bytes = p.pixel_values.len() * 4;
        self.images.lock().unwrap_or_else(|p| p.into_inner()).insert(img.hash, p.clone(), bytes);
        Ok(p)
    }

    /// The step's frame, prompt and ids (what [`Runtime::step`] prefills).
    pub fn prompt(&self, step: &Step) -> Result<StepPrompt> {
        let first = step.screenshots.len().saturating_sub(self.prompt.history_images + 1);
        let shown = &step.screenshots[first..];
        let images: Vec<PreparedImage> =
            shown.iter().map(|s| Ok((s.hash, self.processed(s)?))).collect::<Result<_>>()?;
        let screen = match (step.screen, shown.last()) {
            (Some(s), _) => s,
            (None, Some(img)) => (img.image.width(), img.image.height()),
            (None, None) => {
                return Err(RuntimeError::BadInput("a step without a screenshot needs its screen size".into()))
            }
        };
        let mut frame = self.prompt.frame_map(screen.0, screen.1).map_err(|e| RuntimeError::BadInput(e.to_string()))?;
        if let (FrameKind::Resized, Some((_, current))) = (frame.kind, images.last()) {
            let seen = (current.resized.0 as u32, current.resized.1 as u32);
            if seen != frame.model {
                tracing::debug!(
                    ?screen,
                    ?seen,
                    "the screenshot's size differs from the screen; using the size the model saw"
                );
                frame.model = seen;
            }
        }
        let elements = if self.prompt.elements { step.elements } else { None };
        let ctx = StepContext {
            task: step.task,
            history: step.history,
            screenshots: (0..images.len()).map(|i| PathBuf::from(format!("screenshot {i}"))).collect(),
            elements,
            frame,
            system: self.prompt.system_prompt,
            language: self.prompt.action_language,
        };
        let messages = step_messages(&ctx).map_err(|e| RuntimeError::BadInput(e.to_string()))?;
        let rendered = render_chatml(&messages, true);
        let merge = self.image_config.geometry.merge_size;
        let pads: Vec<usize> = images.iter().map(|(_, i)| i.num_tokens(merge)).collect();
        let ids = encode_chat(&self.tokenizer, &rendered, &pads)?.ids;
        let element_ids = elements.unwrap_or_default().iter().map(|e| e.id.clone()).collect();
        Ok(StepPrompt { ids, images, frame, image_tokens: pads.iter().sum(), element_ids })
    }
}
