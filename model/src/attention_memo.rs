//! Attention forwards kept from the checkpointed forward for the recomputation in the backward.
//!
//! Why: with gradient checkpointing every decoder layer ran its attention forward twice, once in the
//! forward and again when the backward recomputed the layer; on a packed phone step that second run is
//! about a tenth of the step's FLOPs. Its output (`T x hidden`) and logsumexp (`T` per head) are small next
//! to a layer's graph, so the forward keeps them and the recomputation replays them
//! ([`askgui_kernels::ops::attention_replay`]): the same output and gradients, bitwise. The idea of
//! selective activation recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in
//! Large Transformer Models"): keep what is cheap to store and costly to compute again.
//!
//! How: [`crate::recompute`] says which stage (and row range) runs and whether it is the forward that
//! will be recomputed ([`Phase::Record`]) or the recomputation ([`Phase::Replay`]); every other run is
//! [`Phase::Off`]. Calls are keyed by `(stage, first row, call number in that run)`, which the forward and
//! its recomputation share because they run the same code on the same input. A replayed entry is dropped,
//! and [`AttentionMemo::clear`] drops the rest when the step ends.

use std::cell::RefCell;
use std::collections::HashMap;

use askgui_kernels::ops::AttentionSaved;

/// What the chain is running.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Nothing is kept or replayed: inference, the plain graph, stages that are not recomputed.
    #[default]
    Off,
    /// The forward of a stage that the backward will recompute.
    Record,
    /// That recomputation.
    Replay,
}

/// `(stage, first row of its range, call number)`.
type Key = (usize, usize, usize);

/// What one attention call does, from [`AttentionMemo::next`].
pub(crate) enum Next {
    /// Compute, keep nothing.
    Compute,
    /// Compute and [`AttentionMemo::save`] under this key.
    Record(Key),
    /// Replay this forward.
    Replay(AttentionSaved),
}

#[derive(Default)]
struct State {
    phase: Phase,
    at: (usize, usize),
    call: usize,
    saved: HashMap<Key, AttentionSaved>,
    replayed: usize,
}

/// The kept forwards of one training step (shared by its [`crate::train_ops::TrainCtx`]s).
#[derive(Default)]
pub(crate) struct AttentionMemo(RefCell<State>);

impl AttentionMemo {
    /// The chain now runs `stage`'s rows from `start` in `phase`; the calls that follow count from 0.
    pub fn enter(&self, phase: Phase, stage: usize, start: usize) {
        let mut s = self.0.borrow_mut();
        (s.phase, s.at, s.call) = (phase, (stage, start), 0);
    }

    /// The next attention call's instruction. A replay whose forward was not kept computes.
    pub fn next(&self) -> Next {
        let mut s = self.0.borrow_mut();
        let key = (s.at.0, s.at.1, s.call);
        s.call += 1;
        match s.phase {
            Phase::Off => Next::Compute,
            Phase::Record => Next::Record(key),
            Phase::Replay => match s.saved.remove(&key) {
                Some(saved) => {
                    s.replayed += 1;
                    Next::Replay(saved)
                }
                None => Next::Compute,
            },
        }
    }

    pub fn save(&self, key: Key, saved: AttentionSaved) {
        self.0.borrow_mut().saved.insert(key, saved);
    }

    /// Drops every kept forward and turns the memo off.
    pub fn clear(&self) {
        let mut s = self.0.borrow_mut();
        s.saved.clear();
        (s.phase, s.call) = (Phase::Off, 0);
    }

    /// `(forwards kept now, forwards replayed so far)`, for tests.
    #[cfg(test)]
    pub fn counts(&self) -> (usize, usize) {
        let s = self.0.borrow();
        (s.saved.len(), s.replayed)
    }
}
