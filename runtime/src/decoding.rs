//! The state of one answer being decoded: its sequence (KV cache and last logits), its sampler's
//! temperature and seeded generator, and its token budget. The step's action-name choice, the constrained
//! arguments and free completions all advance it.

use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::error::{Result, RuntimeError};
use crate::sampling::sample;
use crate::sequence::Seq;

/// The state of one answer being decoded.
pub(crate) struct Decoding<'a> {
    pub(crate) seq: Seq<'a>,
    pub(crate) temperature: f64,
    pub(crate) rng: StdRng,
    /// Tokens the answer may still take, counted by `generated`.
    pub(crate) budget: usize,
    pub(crate) generated: usize,
    cancelled: &'a dyn Fn() -> bool,
}

impl<'a> Decoding<'a> {
    pub(crate) fn new(
        seq: Seq<'a>,
        temperature: f64,
        seed: u64,
        budget: usize,
        cancelled: &'a dyn Fn() -> bool,
    ) -> Self {
        Self { seq, temperature, rng: StdRng::seed_from_u64(seed), budget, generated: 0, cancelled }
    }

    pub(crate) fn check(&self) -> Result<()> {
        if (self.cancelled)() {
            return Err(RuntimeError::Cancelled);
        }
        Ok(())
    }

    /// The next token among `allowed`, by [`sample`] at this answer's temperature (no nucleus cut).
    pub(crate) fn sample(&mut self, allowed: impl Fn(usize) -> bool) -> u32 {
        sample(&self.seq.logits, allowed, self.temperature, 1.0, &mut self.rng)
    }
}
