//! (placeholder: the norm_rope_ce benchmarks land here)

use anyhow::Result;
use candle_core::Device;

pub fn run(_dev: &Device) -> Result<()> {
    Ok(())
}
