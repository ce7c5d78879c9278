//! How decoding asks for model work: "run these new tokens after this KV cache and give me the logits
//! of the last rows" ([`Item`]), through a [`Forward`].
//!
//! Key choice: the decoding logic ([`crate::Runtime`]) is plain sequential code that never holds the
//! model. The server's implementation hands items to the thread that owns the model, which packs every
//! live job's items into one forward; [`Solo`] runs them at once on a model this thread holds (eval,
//! the trainer's periodic eval). Both run the same [`Packed::forward`], so an answer does not depend on
//! which one asked.

use std::cell::RefCell;

use crate::error::Result;
use crate::packed::{Item, ItemOut, Packed};

/// Runs items for one sequence's decoding.
pub trait Forward {
    /// Runs `items` in one forward and answers them in order.
    fn run(&self, items: Vec<Item>) -> Result<Vec<ItemOut>>;
    /// The LoRA adapter the forwards run with: what the items name ([`Item::adapter`]), and a
    /// prefix-cache key (an adapter changes every value).
    fn adapter(&self) -> Option<&str>;
}

/// A [`Forward`] on a model this thread holds, with its active adapter.
pub struct Solo<'m> {
    packed: RefCell<&'m mut Packed>,
    adapter: Option<String>,
}

impl<'m> Solo<'m> {
    pub fn new(packed: &'m mut Packed) -> Self {
        let adapter = packed.model.active_adapter().map(String::from);
        Self { packed: RefCell::new(packed), adapter }
    }
}

impl Forward for Solo<'_> {
    fn run(&self, mut items: Vec<Item>) -> Result<Vec<ItemOut>> {
        let mut packed = self.packed.borrow_mut();
        let embeds =
            packed.embed_all(&items.iter().collect::<Vec<_>>()).embeds.into_iter().collect::<Result<Vec<_>>>()?;
        let logits = packed.forward(&embeds, &mut items.iter_mut().collect::<Vec<_>>())?;
        Ok(items.into_iter().zip(logits).map(|(i, logits)| ItemOut { cache: i.cache, logits }).collect())
    }

    fn adapter(&self) -> Option<&str> {
        self.adapter.as_deref()
    }
}
