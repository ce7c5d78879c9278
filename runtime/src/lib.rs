//! askgui's agent runtime: one agent step, the same in `askgui-serve`, `askgui-eval` and the trainer's
//! periodic eval.
//!
//! The chain, in order:
//! 1. the screenshots through the checkpoint's own image processor, then the coordinate frame
//!    ([`prompt`]);
//! 2. the training prompt ([`askgui_data::step_messages`] in ChatML), then token ids with each image's
//!    pads expanded ([`encode_chat`], which the trainer's data loader calls too);
//! 3. decoding ([`step`]): the action language's forced prefix (`{"action":"` in askgui's JSON), its
//!    action names scored exactly, the
//!    arguments constrained to the action's schema (or free), one sampler, one set of stop rules;
//! 4. the parsed action, back in screen pixels.
//!
//! Key choice: the decoding logic never holds the model; it asks a [`Forward`] for model work. The
//! server's forward packs concurrent jobs into one pass, [`Solo`] runs on a model this thread holds, and
//! both run [`Packed::forward`], so what is served is what is evaluated.

mod cache;
mod complete;
mod constrained;
mod decoding;
mod error;
mod forward;
mod language_args;
mod packed;
pub mod prefix_cache;
mod prompt;
mod runtime;
mod sampling;
mod sequence;
mod step;

pub use complete::{Completion, CompletionRequest, FinishReason};
pub use constrained::MAX_ASK_OPTIONS;
pub use error::{Result, RuntimeError};
pub use forward::{Forward, Solo};
pub use packed::{Embedded, FeatureKey, FreshFeatures, Item, ItemOut, Packed, MAX_VISION_PATCHES};
pub use prompt::{content_hash, encode_chat, Encoded, ImageInput, PreparedImage, Step, StepPrompt};
pub use runtime::{apply_image_bounds, native_frame, Runtime, DEFAULT_PREFIX_CACHE_BYTES, DEFAULT_STEP_TOKENS};
pub use step::StepOutput;
