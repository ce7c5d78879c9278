//! The model's owner: runs the jobs' forwards, packed, on the one thread that holds the model.
//!
//! Key choice: every live job's next forward (prefills and decode steps alike) runs as one packed pass,
//! each item over its own KV cache; tickets are grouped by adapter (a model-wide switch) and a pack holds
//! at most [`MAX_PACK_TOKENS`] new tokens, run by [`Packed`] (the forward every askgui tool runs). A
//! ticket whose input cannot be embedded fails alone; a failing or panicking forward fails its pack.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use askgui_runtime::{Item, ItemOut, Packed, RuntimeError};

use crate::backend::{Intake, Job};
use crate::batcher::{Batcher, Round, Ticket};

/// Most new tokens in one packed forward: more requests wait for the next (bounds activation memory).
const MAX_PACK_TOKENS: usize = 8192;
/// How long the model's owner waits for a busy job before looking for new ones.
const ROUND_WAIT: Duration = Duration::from_millis(2);

/// The model's owner: runs packed forwards for the jobs' [`Ticket`]s.
pub(super) struct Runner {
    pub(super) packed: Packed,
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
            if let Err(e) = self.packed.model.set_active_adapter(adapter.as_deref()).map_err(RuntimeError::from) {
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
        // Every ticket's items embedded together: the screenshots the cache lacks in one vision forward.
        let all: Vec<&Item> = tickets.iter().flat_map(|t| &t.items).collect();
        let embedded = self.packed.embed_all(&all);
        if embedded.images_encoded > 0 {
            intake.record_vision_batch(embedded.images_encoded);
        }
        let mut results = embedded.embeds.into_iter();
        let (mut ready, mut embeds) = (Vec::with_capacity(tickets.len()), Vec::new());
        for t in tickets {
            match results.by_ref().take(t.items.len()).collect::<Result<Vec<_>, _>>() {
                Ok(e) => {
                    embeds.extend(e);
                    ready.push(t);
                }
                Err(e) => drop(t.reply.send(Err(e))),
            }
        }
        if ready.is_empty() {
            return;
        }
        intake.record_batch(ready.iter().map(|t| t.items.len()).sum());
        let mut items: Vec<&mut Item> = ready.iter_mut().flat_map(|t| t.items.iter_mut()).collect();
        let out = catch_unwind(AssertUnwindSafe(|| self.packed.forward(&embeds, &mut items))).unwrap_or_else(|p| {
            Err(RuntimeError::Internal(format!("the forward panicked: {}", crate::engine::panic_message(p.as_ref()))))
        });
        match out {
            Ok(mut logits) => {
                for t in ready.into_iter().rev() {
                    let mine = logits.split_off(logits.len() - t.items.len());
                    let outs = t.items.into_iter().zip(mine).map(|(i, logits)| ItemOut { cache: i.cache, logits });
                    let _ = t.reply.send(Ok(outs.collect()));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, sequences = ready.len(), "a packed forward failed");
                ready.into_iter().for_each(|t| drop(t.reply.send(Err(e.clone()))));
            }
        }
    }
}
