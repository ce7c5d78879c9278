//! The `askgui.json` of every folder askgui-train writes: the prompt and image settings the run's data
//! loader was given ([`askgui_data::AdapterCard`]), so that eval and serve default to them.
//!
//! Key choice: the card is built from the [`DataOptions`] the samples were made with (pixel bounds
//! resolved against the checkpoint's processor), not from the flags, so it says what the model saw.
//! The training loop calls [`write`] on each snapshot folder it fills; `merge` copies the adapter's.

use std::path::Path;

use askgui_data::AdapterCard;

use crate::data::DataOptions;
use crate::error::{Result, TrainError};

/// Writes `dir/askgui.json` for a run whose data loader was given `opts`.
pub fn write(dir: &Path, opts: &DataOptions) -> Result<()> {
    AdapterCard::new(&opts.prompt, opts.history_length)
        .write(dir)
        .map_err(|e| TrainError::Checkpoint { path: dir.into(), reason: e.to_string() })
}
