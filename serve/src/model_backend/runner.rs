//! The model's owner: runs the jobs' forwards, packed, on the one thread that holds the model.
//!
//! Key choice: every live job's next forward (prefills and decode steps alike) runs as one packed pass,
//! each item over its own KV cache; tickets are grouped by adapter (a model-wide switch) and a pack holds
//! at most [`MAX_PACK_TOKENS`] new tokens. A ticket whose input cannot be embedded fails alone; a failing
//! or panicking forward fails its pack. Vision-tower outputs are cached by (content hash, adapter), so the
//! same screenshot sent again is encoded once.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use askgui_model::model::positions_tensor;
use askgui_model::text::KvCache;
use askgui_model::{ProcessedImage, Qwen2Vl};
use candle_core::{DType, Tensor};

use super::cache::ByteCache;
use super::{candle_err, model_err};
use crate::backend::{BackendError, Intake, Job};
use crate::batcher::{Batcher, Item, ItemOut, Round, Ticket};

/// Most new tokens in one packed forward: more requests wait for the next (bounds activation memory).
const MAX_PACK_TOKENS: usize = 8192;
/// How long the model's owner waits for a busy job before looking for new ones.
const ROUND_WAIT: Duration = Duration::from_millis(2);

/// The model's owner: runs packed forwards for the jobs' [`Ticket`]s.
pub(super) struct Runner {
    pub(super) model: Qwen2Vl,
    /// Vision-tower outputs `(tokens, H)` by (content hash, adapter): the same screenshot sent again
    /// (every step of a session that did not change the screen) is encoded once.
    pub(super) features: ByteCache<(u64, Option<String>), Tensor>,
}

impl Runner {
    /// Runs rounds until no job is live. Between rounds, new jobs from `intake` (while fewer than its
    /// `max_batch` are live) are started with `start`; each forward's size is recorded there.
    pub(super) fn serve(&mut self, batcher: &Batcher, intake: &mut dyn Intake, start: &dyn Fn(Job)) {
        loop {
            let (live, max) = (batcher.live(), intake.max_batch().max(1));
            if live < max {
                intake.take(max - live).into_iter().for_each(start);
            }
            match batcher.next_round(ROUND_WAIT) {
                Round::Run(tickets) => self.round(tickets, intake),
                Round::Idle => {}
                Round::Done => break,
            }
        }
    }

    /// One round: tickets grouped by adapter (an adapter is a model-wide switch), each group in packed
    /// forwards of at most [`MAX_PACK_TOKENS`] new tokens.
    fn round(&mut self, tickets: Vec<Ticket>, intake: &mut dyn Intake) {
        let mut groups: Vec<(Option<String>, Vec<Ticket>)> = Vec::new();
        for t in tickets {
            match groups.iter_mut().find(|(a, _)| *a == t.adapter) {
                Some((_, g)) => g.push(t),
                None => groups.push((t.adapter.clone(), vec![t])),
            }
        }
        for (adapter, group) in groups {
            if let Err(e) = self.model.set_active_adapter(adapter.as_deref()).map_err(model_err) {
                group.into_iter().for_each(|t| drop(t.reply.send(Err(e.clone()))));
                continue;
            }
            let mut pack = Vec::new();
            let mut rows = 0;
            for t in group {
                let n: usize = t.items.iter().map(|i| i.ids.len()).sum();
                if !pack.is_empty() && rows + n > MAX_PACK_TOKENS {
                    self.pack(std::mem::take(&mut pack), intake);
                    rows = 0;
                }
                rows += n;
                pack.push(t);
            }
            if !pack.is_empty() {
                self.pack(pack, intake);
            }
        }
    }

    /// One packed forward over every item of `tickets`; each ticket gets its answers or the error. A
    /// ticket whose input cannot be embedded fails alone; a failing (or panicking) forward fails the pack.
    fn pack(&mut self, tickets: Vec<Ticket>, intake: &mut dyn Intake) {
        let mut ready = Vec::with_capacity(tickets.len());
        for t in tickets {
            match t.items.iter().map(|it| self.embed(it)).collect::<Result<Vec<_>, _>>() {
                Ok(embeds) => ready.push((t, embeds)),
                Err(e) => drop(t.reply.send(Err(e))),
            }
        }
        if ready.is_empty() {
            return;
        }
        intake.record_batch(ready.iter().map(|(t, _)| t.items.len()).sum());
        let out = catch_unwind(AssertUnwindSafe(|| self.forward(&mut ready))).unwrap_or_else(|p| {
            Err(BackendError::Internal(format!("the forward panicked: {}", crate::engine::panic_message(p.as_ref()))))
        });
        match out {
            Ok(mut logits) => {
                for (t, _) in ready.into_iter().rev() {
                    let mine = logits.split_off(logits.len() - t.items.len());
                    let outs = t.items.into_iter().zip(mine).map(|(i, logits)| ItemOut { cache: i.cache, logits });
                    let _ = t.reply.send(Ok(outs.collect()));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, sequences = ready.len(), "a packed forward failed");
                ready.into_iter().for_each(|(t, _)| drop(t.reply.send(Err(e.clone()))));
            }
        }
    }

    /// An item's new tokens as embeddings `(1, T, H)`, its image features spliced in.
    fn embed(&mut self, item: &Item) -> Result<Tensor, BackendError> {
        if item.ids.is_empty() || item.ids.len() != item.positions.len() || item.logits_rows > item.ids.len() {
            return Err(BackendError::Internal(format!(
                "a forward item with {} tokens, {} positions and {} logit rows",
                item.ids.len(),
                item.positions.len(),
                item.logits_rows
            )));
        }
        let feats = self.image_features(&item.images)?;
        let ids = Tensor::from_slice(&item.ids, (1, item.ids.len()), &self.model.device).map_err(candle_err)?;
        self.model.embed(&ids, feats.as_ref()).map_err(model_err)
    }

    /// The packed forward: every item's new rows back to back, each over its own cache (appended in
    /// place); the logits of each item's last `logits_rows` rows, in item order.
    fn forward(&mut self, ready: &mut [(Ticket, Vec<Tensor>)]) -> Result<Vec<Vec<Vec<f32>>>, BackendError> {
        let embeds: Vec<&Tensor> = ready.iter().flat_map(|(_, e)| e).collect();
        let embeds = Tensor::cat(&embeds, 1).map_err(candle_err)?;
        let items: Vec<&mut Item> = ready.iter_mut().flat_map(|(t, _)| t.items.iter_mut()).collect();
        let lens: Vec<usize> = items.iter().map(|i| i.ids.len()).collect();
        let positions: Vec<[u32; 3]> = items.iter().flat_map(|i| i.positions.iter().copied()).collect();
        let total = positions.len();
        let positions = positions_tensor(&[positions], total).map_err(model_err)?;
        // Rows whose logits are wanted, in the packed order.
        let mut rows = Vec::new();
        let mut start = 0;
        for i in &items {
            rows.extend((start + i.ids.len() - i.logits_rows..start + i.ids.len()).map(|r| r as u32));
            start += i.ids.len();
        }
        let wanted: Vec<usize> = items.iter().map(|i| i.logits_rows).collect();
        let mut caches: Vec<&mut KvCache> = items.into_iter().map(|i| &mut i.cache).collect();
        let hidden = self.model.decode_packed(&embeds, &positions, &lens, &mut caches).map_err(model_err)?;
        // (1, N, H) -> (R, H) -> (R, V)
        let idx = Tensor::from_vec(rows, wanted.iter().sum::<usize>(), &self.model.device).map_err(candle_err)?;
        let picked = hidden.squeeze(0).and_then(|h| h.index_select(&idx, 0)).map_err(candle_err)?;
        let logits = self.model.logits(&picked).map_err(model_err)?;
        let mut logits = logits.to_dtype(DType::F32).and_then(|l| l.to_vec2::<f32>()).map_err(candle_err)?.into_iter();
        Ok(wanted.iter().map(|&n| logits.by_ref().take(n).collect()).collect())
    }

    /// The vision tower's output for the images, in order, each cached by (hash, active adapter). Each
    /// image attends only to itself, so encoding them one by one equals encoding them together.
    fn image_features(&mut self, images: &[(u64, Arc<ProcessedImage>)]) -> Result<Option<Tensor>, BackendError> {
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
                    let pv = img.pixel_tensor(&self.model.device).map_err(model_err)?;
                    let f = self.model.image_features(&pv, &[img.grid_thw]).map_err(model_err)?;
                    self.features.insert(key, f.clone(), f.elem_count() * f.dtype().size_in_bytes());
                    f
                }
            };
            parts.push(f);
        }
        Ok(Some(Tensor::cat(&parts, 0).map_err(candle_err)?))
    }
}
