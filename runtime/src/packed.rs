//! The model's side of decoding: items embedded (their screenshots through the vision tower, cached),
//! then run as one packed forward, each over its own KV cache.
//!
//! Key choice: every item's new rows go back to back in one pass ([`Qwen2Vl::decode_packed_adapters`]),
//! so a prefill and a decode step of different sequences share one forward, whatever LoRA adapter each
//! runs with (each item names its own; rows of one adapter for all take the one-adapter path). Likewise
//! the screenshots of all the items embedded together that the cache lacks go through one vision forward
//! (batched vision: each image attends only to itself, through the tower's per-image `cu_seqlens`, with
//! its item's adapter). Vision-tower outputs are cached by (content hash, adapter), so the same
//! screenshot sent again is encoded once.

use std::collections::HashMap;

use askgui_model::model::positions_tensor;
use askgui_model::{KvCache, NewRows, ProcessedImage, Qwen2Vl};
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
    /// Empty: `ids` continue the cache and are appended to it. Else runs of `ids` (`forks[f]` each) that
    /// each continue the cache alone, none appended: the options of a constrained choice, scored in one
    /// item ([`NewRows::Forks`]).
    pub forks: Vec<usize>,
    /// The LoRA adapter its rows (and its screenshots) run with; None: the base model.
    pub adapter: Option<String>,
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
    features: ByteCache<FeatureKey, Tensor>,
}

/// A screenshot's vision-tower output is the same for the same content hash and adapter.
pub type FeatureKey = (u64, Option<String>);

/// An image to encode and the adapter to encode it with.
type ToEncode<'a> = (&'a PreparedImage, Option<&'a str>);

impl Packed {
    pub fn new(model: Qwen2Vl) -> Self {
        Self { model, features: ByteCache::new() }
    }

    /// An item's new tokens as embeddings `(1, T, H)`, its image features spliced in.
    pub fn embed(&mut self, item: &Item) -> Result<Tensor> {
        self.embed_all(&[item]).embeds.pop().expect("one item, one result")
    }

    /// Every item's embeddings ([`Self::embed`]), with the images the feature cache lacks encoded
    /// together first: one vision forward per [`MAX_VISION_PATCHES`] patches. An item that cannot be
    /// embedded fails alone; if a batched vision forward fails, its images are encoded one by one, so
    /// that the error reaches only the items that hold the bad image.
    pub fn embed_all(&mut self, items: &[&Item]) -> Embedded {
        let encoded = self.encode_missing(items);
        self.embed_encoded(items, encoded)
    }

    /// Whether an image of `items` is missing from the feature cache (their embedding needs the vision
    /// tower).
    pub fn lacks_images(&self, items: &[Item]) -> bool {
        !self.missing(items.iter().collect::<Vec<_>>().as_slice()).is_empty()
    }

    /// The distinct (image, adapter) pairs of `items` whose features the cache lacks, in order; items of
    /// an adapter the model does not hold are left out (they fail when embedded).
    fn missing<'a>(&self, items: &[&'a Item]) -> Vec<ToEncode<'a>> {
        let mut missing: Vec<ToEncode> = Vec::new();
        for item in items.iter().filter(|i| self.check_adapter(i).is_ok()) {
            let adapter = item.adapter.as_deref();
            for img in &item.images {
                let cached = self.features.get(&(img.0, adapter.map(String::from))).is_some();
                if !cached && !missing.iter().any(|(m, a)| m.0 == img.0 && *a == adapter) {
                    missing.push((img, adapter));
                }
            }
        }
        missing
    }

    /// An error unless the model holds the item's adapter and can run it.
    fn check_adapter(&self, item: &Item) -> Result<()> {
        self.model.row_adapters(&[(1, item.adapter.as_deref())])?;
        Ok(())
    }

    /// [`Self::embed_all`] with the images `encoded` ([`Self::encode_missing`] of the same items) first
    /// put in the feature cache.
    pub fn embed_encoded(&mut self, items: &[&Item], encoded: FreshFeatures) -> Embedded {
        for (key, f) in &encoded.features {
            let bytes = f.elem_count() * f.dtype().size_in_bytes();
            self.features.insert(key.clone(), f.clone(), bytes);
        }
        let embeds = items.iter().map(|item| self.embed_with(item, &encoded.features)).collect();
        Embedded { embeds, images_encoded: encoded.count }
    }

    fn embed_with(&mut self, item: &Item, fresh: &HashMap<FeatureKey, Tensor>) -> Result<Tensor> {
        if item.ids.is_empty() || item.ids.len() != item.positions.len() || item.logits_rows > item.ids.len() {
            return Err(RuntimeError::Internal(format!(
                "a forward item with {} tokens, {} positions and {} logit rows",
                item.ids.len(),
                item.positions.len(),
                item.logits_rows
            )));
        }
        self.check_adapter(item)?;
        let feats = self.image_features(&item.images, item.adapter.as_deref(), fresh)?;
        let ids = Tensor::from_slice(&item.ids, (1, item.ids.len()), &self.model.device)?;
        Ok(self.model.embed(&ids, feats.as_ref())?)
    }

    /// Encodes the distinct images of `items` that the cache lacks, batched by patch count; the cache is
    /// left as it is (see [`Self::embed_encoded`]), so that this can run beside a [`Self::forward`]. A
    /// failing batch is left out (its images are encoded one by one when embedded).
    pub fn encode_missing(&self, items: &[&Item]) -> FreshFeatures {
        let missing = self.missing(items);
        let mut out = FreshFeatures::default();
        for batch in patch_batches(&missing, MAX_VISION_PATCHES) {
            match self.encode(batch) {
                Ok(features) => {
                    out.count += batch.len();
                    let keys = batch.iter().map(|((hash, _), a)| (*hash, a.map(String::from)));
                    out.features.extend(keys.zip(features));
                }
                Err(e) => tracing::debug!(error = %e, images = batch.len(), "batched vision failed; one at a time"),
            }
        }
        out
    }

    /// One vision forward over `images`, each with its adapter; their features `(tokens_i, H)`, in order.
    fn encode(&self, images: &[ToEncode]) -> Result<Vec<Tensor>> {
        // (sum P_i, patch_dim) -> (sum P_i / merge^2, H), image after image
        let pixels: Vec<&ProcessedImage> = images.iter().map(|((_, img), _)| &**img).collect();
        let adapters: Vec<Option<&str>> = images.iter().map(|(_, a)| *a).collect();
        let all = self.model.images_features_adapters(&pixels, &adapters)?;
        let merge = self.model.cfg.vision.spatial_merge_size;
        let mut start = 0;
        let mut out = Vec::with_capacity(images.len());
        for img in pixels {
            let n = img.num_tokens(merge);
            out.push(all.narrow(0, start, n)?);
            start += n;
        }
        Ok(out)
    }

    /// The packed forward: every item's new rows (`embeds[i]`, from [`Self::embed`]) back to back, each
    /// over its own cache (appended in place); the logits of each item's last `logits_rows` rows, in item
    /// order.
    pub fn forward(&self, embeds: &[Tensor], items: &mut [&mut Item]) -> Result<Vec<Vec<Vec<f32>>>> {
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
        let forks: Vec<Vec<usize>> = items.iter().map(|i| i.forks.clone()).collect();
        let new: Vec<NewRows> = lens
            .iter()
            .zip(&forks)
            .map(|(&n, f)| if f.is_empty() { NewRows::Append(n) } else { NewRows::Forks(f) })
            .collect();
        let names: Vec<Option<String>> = items.iter().map(|i| i.adapter.clone()).collect();
        let adapters: Vec<Option<&str>> = names.iter().map(Option::as_deref).collect();
        let mut caches: Vec<&mut KvCache> = items.iter_mut().map(|i| &mut i.cache).collect();
        let hidden = self.model.decode_packed_adapters(&embeds, &positions, (&new, &adapters), &mut caches)?;
        if rows.is_empty() {
            // Only prefill chunks that need no logits yet.
            return Ok(wanted.iter().map(|_| Vec::new()).collect());
        }
        // (1, N, H) -> (R, H) -> (R, V)
        let idx = Tensor::from_vec(rows, wanted.iter().sum::<usize>(), &self.model.device)?;
        let picked = hidden.squeeze(0)?.index_select(&idx, 0)?;
        let logits = self.model.logits(&picked)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        let mut logits = logits.into_iter();
        Ok(wanted.iter().map(|&n| logits.by_ref().take(n).collect()).collect())
    }

    /// The vision tower's output for the images with `adapter`, in order: from `fresh` (this call's
    /// batch), the cache, or encoded alone now (cached by hash and adapter).
    fn image_features(
        &mut self,
        images: &[PreparedImage],
        adapter: Option<&str>,
        fresh: &HashMap<FeatureKey, Tensor>,
    ) -> Result<Option<Tensor>> {
        if images.is_empty() {
            return Ok(None);
        }
        let mut parts = Vec::with_capacity(images.len());
        for image in images {
            let key = (image.0, adapter.map(String::from));
            let f = match fresh.get(&key).cloned().or_else(|| self.features.get(&key)) {
                Some(f) => f,
                None => {
                    let f = self.encode(&[(image, adapter)])?.pop().expect("one image, one output");
                    self.features.insert(key, f.clone(), f.elem_count() * f.dtype().size_in_bytes());
                    f
                }
            };
            parts.push(f);
        }
        Ok(Some(Tensor::cat(&parts, 0)?))
    }
}

/// Most patches in one batched vision forward, which bounds its activation memory: about six phone
/// screenshots at the default pixel budget (5,088 patches each).
pub const MAX_VISION_PATCHES: usize = 32_768;

/// Consecutive groups of `images` of at most `max_patches` patches each (an image larger than that
/// alone).
fn patch_batches<'a, 'b>(images: &'a [ToEncode<'b>], max_patches: usize) -> Vec<&'a [ToEncode<'b>]> {
    let mut out = Vec::new();
    let (mut start, mut patches) = (0, 0);
    for (i, ((_, img), _)) in images.iter().enumerate() {
        let n = img.grid_thw.iter().product::<usize>();
        if i > start && patches + n > max_patches {
            out.push(&images[start..i]);
            (start, patches) = (i, 0);
        }
        patches += n;
    }
    if start < images.len() {
        out.push(&images[start..]);
    }
    out
}

/// The vision tower's outputs `(tokens, H)` of a batch's missing images by content hash and adapter
/// ([`Packed::encode_missing`]), and how many images were encoded.
#[derive(Default)]
pub struct FreshFeatures {
    pub features: HashMap<FeatureKey, Tensor>,
    pub count: usize,
}

/// What [`Packed::embed_all`] gives: each item's embeddings or error, in order, and how many images
/// the vision tower encoded for them (the vision batch size; cached images are not counted).
pub struct Embedded {
    pub embeds: Vec<Result<Tensor>>,
    pub images_encoded: usize,
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use askgui_model::ProcessedImage;

    use super::*;

    fn image(hash: u64, patches: usize) -> PreparedImage {
        let img =
            ProcessedImage { pixel_values: vec![], grid_thw: [1, 2, patches / 2], original: (0, 0), resized: (0, 0) };
        (hash, Arc::new(img))
    }

    #[test]
    fn batches_keep_order_and_the_patch_bound() {
        let images: Vec<PreparedImage> = [(1, 8), (2, 8), (3, 16), (4, 40), (5, 4)].map(|(h, p)| image(h, p)).into();
        let refs: Vec<ToEncode> = images.iter().map(|i| (i, None)).collect();
        let hashes: Vec<Vec<u64>> =
            patch_batches(&refs, 20).iter().map(|b| b.iter().map(|(i, _)| i.0).collect()).collect();
        // 8+8 fit, 16 starts a batch, 40 is alone (over the bound), 4 starts the last.
        assert_eq!(hashes, vec![vec![1, 2], vec![3], vec![4], vec![5]]);
        assert!(patch_batches(&[], 20).is_empty());
    }
}
