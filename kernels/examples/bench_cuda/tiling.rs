//! (placeholder: the tiling benchmarks land here)

use anyhow::Result;
use candle_core::Device;

pub fn run(_dev: &Device) -> Result<()> {
    Ok(())
}
