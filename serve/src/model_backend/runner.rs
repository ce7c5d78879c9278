//! The model's owner: runs the jobs' forwards, packed, on the one thread that holds the model.
//!
//! Key choice: every live job's next forward (prefills and decode steps alike) runs as one packed pass,
//! each item over its own KV cache and with its own LoRA adapter (a pack mixes adapters and the base
//! model: each adapted linear gathers each adapter's rows, [`askgui_model::adapter_slot::RowAdapters`]);
//! a pack holds at most [`MAX_PACK_TOKENS`] new tokens, run by [`Packed`] (the forward every askgui tool
//! runs). A ticket whose input cannot be embedded (an adapter the model does not hold included) fails
//! alone; a failing or panicking forward fails its pack.
//!
//! Chunked prefill: a ticket of one item with more new tokens than the prefill chunk (`--prefill-chunk`,
//! default [`PREFILL_CHUNK`]) is embedded once (its screenshots included) and then runs that many rows per
//! forward, held here between forwards, and is answered after its last chunk. So the decode steps packed
//! with a long new prompt wait for one chunk of it per forward, not for all of it.
//!
//! Vision beside the forward (CPU): a new ticket whose screenshots the feature cache lacks, arriving while
//! other rows run, has them encoded on the other core during that forward and starts its prefill in the
//! next round. One forward alone leaves a core idle through its serial ops (15% of the samples at
//! concurrency 16); the two together keep both busy (`docs/benchmarks.md`, 2026-11-28).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use askgui_model::KvPool;
use askgui_runtime::{FreshFeatures, Item, ItemOut, Packed, RuntimeError};
use candle_core::Tensor;

use crate::backend::{Intake, Job};
use crate::batcher::{Batcher, Round, Ticket};

/// Most new tokens in one packed forward: more requests wait for the next (bounds activation memory).
const MAX_PACK_TOKENS: usize = 8192;
/// Most new tokens of one sequence in one forward, by default (see the module docs).
pub const PREFILL_CHUNK: usize = 512;
/// How long the model's owner waits for a busy job before looking for new ones.
const ROUND_WAIT: Duration = Duration::from_millis(2);

/// The model's owner: runs packed forwards for the jobs' [`Ticket`]s.
pub(super) struct Runner {
    pub(super) packed: Packed,
    /// The KV blocks' pool (the runtime's), for the metrics.
    pub(super) kv_pool: Arc<KvPool>,
    /// Rows of one sequence per forward.
    pub(super) prefill_chunk: usize,
    /// Prefills part way through their chunks.
    held: Vec<Held>,
}

/// A chunked prefill between forwards: its ticket (whose one item keeps the cache so far), the item's
/// embeddings `(1, T, H)`, and how many of its rows have run.
struct Held {
    ticket: Ticket,
    embeds: Tensor,
    done: usize,
}

impl Held {
    fn len(&self) -> usize {
        self.ticket.items[0].ids.len()
    }

    /// The next chunk's row count: at most `chunk`, and the last chunk keeps every row that needs logits.
    fn next_rows(&self, chunk: usize) -> usize {
        let (left, want) = (self.len() - self.done, self.ticket.items[0].logits_rows);
        let n = chunk.max(1).min(left);
        if n < left && left - n < want {
            left - want
        } else {
            n
        }
    }
}

impl Runner {
    pub(super) fn new(packed: Packed, kv_pool: Arc<KvPool>) -> Self {
        Self { packed, kv_pool, prefill_chunk: PREFILL_CHUNK, held: Vec::new() }
    }

    /// Runs rounds until no job is live. Between rounds, new jobs from `intake` (while fewer than its
    /// `max_batch` are live) are started with `start`; each forward's size is recorded there.
    pub(super) fn serve(&mut self, batcher: &Batcher, intake: &mut dyn Intake, start: &dyn Fn(Job)) {
        loop {
            let (live, max) = (batcher.live(), intake.max_batch().max(1));
            if live < max {
                intake.take(max - live).into_iter().for_each(start);
            }
            match batcher.next_round(ROUND_WAIT, self.held.len()) {
                Round::Run(tickets) => self.round(tickets, intake),
                Round::Idle => {}
                Round::Done => break,
            }
        }
    }

    /// Whether a new ticket's prefill runs in chunks (forks never: their rows are not appended).
    fn chunked(&self, t: &Ticket) -> bool {
        t.items.len() == 1 && t.items[0].forks.is_empty() && t.items[0].ids.len() > self.prefill_chunk
    }

    /// One round: the new tickets and the held prefills, whatever their adapters, in packed forwards of
    /// at most [`MAX_PACK_TOKENS`] new tokens.
    fn round(&mut self, tickets: Vec<Ticket>, intake: &mut dyn Intake) {
        let held = std::mem::take(&mut self.held);
        // The held prefills' next chunks go into the first pack.
        let mut rows: usize = held.iter().map(|h| h.next_rows(self.prefill_chunk)).sum();
        let (mut pack, mut held) = (Vec::new(), Some(held));
        for t in tickets {
            let n = if self.chunked(&t) { self.prefill_chunk } else { t.items.iter().map(|i| i.ids.len()).sum() };
            if rows > 0 && rows + n > MAX_PACK_TOKENS {
                self.pack(std::mem::take(&mut pack), held.take().unwrap_or_default(), intake);
                rows = 0;
            }
            rows += n;
            pack.push(t);
        }
        let held = held.unwrap_or_default();
        if !pack.is_empty() || !held.is_empty() {
            self.pack(pack, held, intake);
        }
        intake.record_kv_blocks(self.kv_pool.blocks_in_use(), self.kv_pool.capacity());
    }

    /// One packed forward over every item of `tickets` and the next chunk of every prefill in `held`
    /// (new chunked tickets join `held` first); each ticket gets its answers or the error. A ticket whose
    /// input cannot be embedded fails alone; a failing (or panicking) forward fails the whole pack.
    ///
    /// On the CPU, when there are other rows to run, the tickets whose screenshots the feature cache
    /// lacks are encoded beside the forward, not before it ([`Self::admit`]): the two share the cores
    /// where one alone leaves one idle (its serial ops), and their prefill starts in the next round.
    fn pack(&mut self, tickets: Vec<Ticket>, held: Vec<Held>, intake: &mut dyn Intake) {
        let cpu = self.packed.model.device.is_cpu();
        let (beside, now): (Vec<Ticket>, Vec<Ticket>) =
            tickets.into_iter().partition(|t| cpu && self.packed.lacks_images(&t.items));
        if now.is_empty() && held.is_empty() {
            self.run_pack(beside, held, intake, &[]);
            return;
        }
        let items: Vec<&Item> = beside.iter().flat_map(|t| &t.items).collect();
        let encoded = self.run_pack(now, held, intake, &items);
        self.admit(beside, encoded, intake);
    }

    /// Tickets whose screenshots were encoded beside a forward (`encoded`; `None`: that forward did not
    /// run): embedded, a chunked prefill held for the next round, any other ticket run now.
    fn admit(&mut self, tickets: Vec<Ticket>, encoded: Option<FreshFeatures>, intake: &mut dyn Intake) {
        if tickets.is_empty() {
            return;
        }
        let Some(encoded) = encoded else {
            self.run_pack(tickets, Vec::new(), intake, &[]);
            return;
        };
        let all: Vec<&Item> = tickets.iter().flat_map(|t| &t.items).collect();
        let embedded = self.packed.embed_encoded(&all, encoded);
        if embedded.images_encoded > 0 {
            intake.record_vision_batch(embedded.images_encoded);
        }
        let (mut results, mut whole) = (embedded.embeds.into_iter(), Vec::new());
        for t in tickets {
            match results.by_ref().take(t.items.len()).collect::<Result<Vec<_>, _>>() {
                Ok(mut e) if self.chunked(&t) => self.held.push(Held { ticket: t, embeds: e.remove(0), done: 0 }),
                // Embedded again by the next pack, from the feature cache.
                Ok(_) => whole.push(t),
                Err(e) => drop(t.reply.send(Err(e))),
            }
        }
        if !whole.is_empty() {
            self.run_pack(whole, Vec::new(), intake, &[]);
        }
    }

    /// [`Self::pack`] of `tickets` and `held`, with the screenshots of `beside` (tickets not in this
    /// pack) encoded beside its forward: their features, or `None` if the forward did not run.
    fn run_pack(
        &mut self,
        tickets: Vec<Ticket>,
        mut held: Vec<Held>,
        intake: &mut dyn Intake,
        beside: &[&Item],
    ) -> Option<FreshFeatures> {
        // Every ticket's items embedded together: the screenshots the cache lacks in one vision forward.
        let all: Vec<&Item> = tickets.iter().flat_map(|t| &t.items).collect();
        let packed = &mut self.packed;
        let embedded = in_pool(packed.model.device.is_cpu(), || packed.embed_all(&all));
        if embedded.images_encoded > 0 {
            intake.record_vision_batch(embedded.images_encoded);
        }
        let mut results = embedded.embeds.into_iter();
        let (mut ready, mut embeds) = (Vec::with_capacity(tickets.len()), Vec::new());
        for t in tickets {
            match results.by_ref().take(t.items.len()).collect::<Result<Vec<_>, _>>() {
                Ok(mut e) if self.chunked(&t) => held.push(Held { ticket: t, embeds: e.remove(0), done: 0 }),
                Ok(e) => {
                    embeds.extend(e);
                    ready.push(t);
                }
                Err(e) => drop(t.reply.send(Err(e))),
            }
        }
        // The held prefills' next chunks, after the whole items.
        let mut chunks = Vec::with_capacity(held.len());
        let mut bad = None;
        for h in &mut held {
            let n = h.next_rows(self.prefill_chunk);
            let last = h.done + n == h.len();
            match h.embeds.narrow(1, h.done, n) {
                Ok(e) => embeds.push(e),
                Err(e) => {
                    bad = Some(RuntimeError::from(e));
                    break;
                }
            }
            let item = &mut h.ticket.items[0];
            chunks.push(Item {
                ids: item.ids[h.done..h.done + n].to_vec(),
                positions: item.positions[h.done..h.done + n].to_vec(),
                images: vec![],
                cache: std::mem::take(&mut item.cache),
                logits_rows: if last { item.logits_rows } else { 0 },
                forks: vec![],
                adapter: item.adapter.clone(),
            });
        }
        if let Some(e) = bad {
            self.fail(ready, held, e);
            return None;
        }
        if ready.is_empty() && chunks.is_empty() {
            return None;
        }
        intake.record_batch(ready.iter().map(|t| t.items.len()).sum::<usize>() + chunks.len());
        let mut items: Vec<&mut Item> = ready.iter_mut().flat_map(|t| t.items.iter_mut()).collect();
        items.extend(chunks.iter_mut());
        let packed = &self.packed;
        let cpu = packed.model.device.is_cpu();
        let forward = || {
            catch_unwind(AssertUnwindSafe(|| packed.forward(&embeds, &mut items))).unwrap_or_else(|p| {
                let why = crate::engine::panic_message(p.as_ref());
                Err(RuntimeError::Internal(format!("the forward panicked: {why}")))
            })
        };
        // `beside` is empty off the CPU (see `pack`).
        let (out, encoded) = match beside.is_empty() {
            true => (in_pool(cpu, forward), None),
            false => {
                let vision = || packed.encode_missing(beside);
                let (out, encoded) = in_pool(cpu, || rayon::join(forward, vision));
                (out, Some(encoded))
            }
        };
        let mut logits = match out {
            Ok(logits) => logits,
            Err(e) => {
                self.fail(ready, held, e);
                return encoded;
            }
        };
        // The chunks' answers come last.
        let chunk_logits = logits.split_off(logits.len() - chunks.len());
        for ((mut h, chunk), l) in held.into_iter().zip(chunks).zip(chunk_logits) {
            h.done += chunk.ids.len();
            if h.done == h.len() {
                let _ = h.ticket.reply.send(Ok(vec![ItemOut { cache: chunk.cache, logits: l }]));
            } else {
                h.ticket.items[0].cache = chunk.cache;
                self.held.push(h);
            }
        }
        for t in ready.into_iter().rev() {
            let mine = logits.split_off(logits.len() - t.items.len());
            let outs = t.items.into_iter().zip(mine).map(|(i, logits)| ItemOut { cache: i.cache, logits });
            let _ = t.reply.send(Ok(outs.collect()));
        }
        encoded
    }

    /// A failed forward: every ticket of the pack, held prefills included, gets the error.
    fn fail(&mut self, ready: Vec<Ticket>, held: Vec<Held>, e: RuntimeError) {
        tracing::error!(error = %e, sequences = ready.len() + held.len(), "a packed forward failed");
        ready.into_iter().for_each(|t| drop(t.reply.send(Err(e.clone()))));
        held.into_iter().for_each(|h| drop(h.ticket.reply.send(Err(e.clone()))));
    }
}

/// Runs `f` on one of rayon's worker threads when `cpu`, else here (a GPU's context is bound to this
/// thread).
///
/// Why: a CPU forward is hundreds of small ops, most split over rayon's pool. Called from outside the
/// pool, this thread hands each op over and sleeps until it is done, then has to be woken and scheduled
/// among the job threads to issue the next one. Run on a worker, the forward's own thread takes part in
/// each op and runs the serial ones without a hand-over: at concurrency 16 in `bench_serve.py` a
/// screenshot's vision forward went from about 20 to 15 ms (`docs/benchmarks.md`, 2026-11-28).
fn in_pool<R: Send>(cpu: bool, f: impl FnOnce() -> R + Send) -> R {
    match cpu {
        true => rayon::scope(|_| f()),
        false => f(),
    }
}

#[cfg(test)]
mod tests {
    use askgui_model::KvCache;

    use super::*;

    fn held(len: usize, logits_rows: usize, done: usize) -> Held {
        let item = Item {
            ids: vec![1; len],
            positions: vec![[0; 3]; len],
            images: vec![],
            cache: KvCache::default(),
            logits_rows,
            forks: vec![],
            adapter: None,
        };
        let ticket = Ticket { items: vec![item], reply: std::sync::mpsc::channel().0 };
        Held {
            ticket,
            embeds: Tensor::zeros((1, len, 2), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
            done,
        }
    }

    #[test]
    fn chunks_cover_the_prompt_and_the_last_keeps_the_logit_rows() {
        // 1,000 rows in chunks of 512: 512 then 488.
        assert_eq!(held(1000, 1, 0).next_rows(512), 512);
        assert_eq!(held(1000, 1, 512).next_rows(512), 488);
        // 515 rows, 4 of them scored: the first chunk leaves 4 rows, not 3.
        assert_eq!(held(515, 4, 0).next_rows(512), 511);
        assert_eq!(held(515, 4, 511).next_rows(512), 4);
        // A chunk of 0 still moves.
        assert_eq!(held(3, 1, 0).next_rows(0), 1);
    }
}
