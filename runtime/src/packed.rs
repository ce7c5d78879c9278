//! The model's side of decoding: items embedded (their screenshots through the vision tower, cached),
//! then run as one packed forward, each over its own KV cache.
//!
//! Key choice: every item's new rows go back to back in one pass ([`Qwen2Vl::decode_packed`]), so a
//! prefill and a decode step of different sequences share one forward. Vision-tower outputs are cached
//! by (content hash, adapter), so the same screenshot sent again is encoded once.

use askgui_model::model::positions_tensor;
use askgui_model::text::KvCache;
use askgui_model::Qwen2Vl;
use candle_core::{DType, Tensor};

use crate::cache::ByteCache;
use crate::error::{Result, RuntimeError};
use crate::prompt::PreparedImage;

/// One sequence's share of a forward.
pub struct Item {
    /// New tokens, run after what `cache` holds.
    pub ids: Vec<u32>,
    /// Their M-RoPE positions.
    pub positions: Vec<[u32; 3]>,
    /// The images whose `<|image_pad|>` runs are in `ids`, in order, with their content hashes.
    pub images: Vec<PreparedImage>,
    pub cache: KvCache,
    /// How many of the last rows need logits (1 for the next token; more to score a continuation).
    pub logits_rows: usize,
}

/// The answer to one [`Item`]: its cache with the new tokens appended, and the logits of its last rows.
pub struct ItemOut {
    pub cache: KvCache,
    pub logits: Vec<Vec<f32>>,
}

/// The model with its cache of vision-tower outputs.
pub struct Packed {
    pub model: Qwen2Vl,
    /// Vision-tower outputs `(tokens, H)` by (content hash, adapter): the same screenshot sent again
    /// (every step of a session that did not change the screen) is encoded once.
    features: ByteCache<(u64, Option<String>), Tensor>,
}

impl Packed {
    pub fn new(model: Qwen2Vl) -> Self {
        Self { model, features: ByteCache::new() }
    }

    /// An item's new tokens as embeddings `(1, T, H)`, its image features spliced in.
    pub fn embed(&mut self, item: &Item) -> Result<Tensor> {
        if item.ids.is_empty() || item.ids.len() != item.positions.len() || item.logits_rows > item.ids.len() {
            return Err(RuntimeError::Internal(format!(
                "a forward item with {} tokens, {} positions and {} logit rows",
                item.ids.len(),
                item.positions.len(),
                item.logits_rows
            )));
        }
        let feats = self.image_features(&item.images)?;
        let ids = Tensor::from_slice(&item.ids, (1, item.ids.len()), &self.model.device)?;
        Ok(self.model.embed(&ids, feats.as_ref())?)
    }

    /// The packed forward: every item's new rows (`embeds[i]`, from [`Self::embed`]) back to back, each
    /// over its own cache (appended in place); the logits of each item's last `logits_rows` rows, in item
    /// order.
    pub fn forward(&mut self, embeds: &[Tensor], items: &mut [&mut Item]) -> Result<Vec<Vec<Vec<f32>>>> {
        let embeds = Tensor::cat(embeds, 1)?;
        let lens: Vec<usize> = items.iter().map(|i| i.ids.len()).collect();
        let positions: Vec<[u32; 3]> = items.iter().flat_map(|i| i.positions.iter().copied()).collect();
        let total = positions.len();
        let positions = positions_tensor(&[positions], total)?;
        // Rows whose logits are wanted, in the packed order.
        let mut rows = Vec::new();
        let mut start = 0;
        for i in items.iter() {
            rows.extend((start + i.ids.len() - i.logits_rows..start + i.ids.len()).map(|r| r as u32));
            start += i.ids.len();
        }
        let wanted: Vec<usize> = items.iter().map(|i| i.logits_rows).collect();
        let mut caches: Vec<&mut KvCache> = items.iter_mut().map(|i| &mut i.cache).collect();
        let hidden = self.model.decode_packed(&embeds, &positions, &lens, &mut caches)?;
        // (1, N, H) -> (R, H) -> (R, V)
        let idx = Tensor::from_vec(rows, wanted.iter().sum::<usize>(), &self.model.device)?;
        let picked = hidden.squeeze(0)?.index_select(&idx, 0)?;
        let logits = self.model.logits(&picked)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let mut logits = logits.into_iter();
        Ok(wanted.iter().map(|&n| logits.by_ref().take(n).collect()).collect())
    }

    /// The vision tower's output for the images, in order, each cached by (hash, active adapter). Each
    /// image attends only to itself, so encoding them one by one equals encoding them together.
    fn image_features(&mut self, images: &[PreparedImage]) -> Result<Option<Tensor>> {
        if images.is_empty() {
            return Ok(None);
        }
        let adapter = self.model.active_adapter().map(String::from);
        let mut parts = Vec::with_capacity(images.len());
        for (hash, img) in images {
            let key = (*hash, adapter.clone());
            let f = match self.features.get(&key) {
                Some(f) => f,
                None => {
                    let pv = img.pixel_tensor(&self.model.device)?;
                    let f = self.model.image_features(&pv, &[img.grid_thw])?;
                    self.features.insert(key, f.clone(), f.elem_count() * f.dtype().size_in_bytes());
                    f
                }
            };
            parts.push(f);
        }
        Ok(Some(Tensor::cat(&parts, 0)?))
    }
}
