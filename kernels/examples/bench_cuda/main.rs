//! GPU benchmarks of the CUDA kernels (feature `cuda`): one JSON line per measurement on stdout, with the
//! same keys as the PyTorch side in `scripts/gpu/`, so the two can be set side by side as ratios.
//!
//! `bench_cuda [attention|norm_rope_ce|tiling|paged|all]` (default all). Times are medians of CUDA-synchronised
//! wall clocks after warm-up.

use anyhow::{bail, Result};
use candle_core::Device;

mod attention;
mod norm_rope_ce;
mod paged;
mod tiling;

fn main() -> Result<()> {
    let which = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    let dev = Device::new_cuda(0)?;
    match which.as_str() {
        "attention" => attention::run(&dev),
        "norm_rope_ce" => norm_rope_ce::run(&dev),
        "tiling" => tiling::run(&dev),
        "paged" => paged::run(&dev),
        "all" => {
            attention::run(&dev)?;
            norm_rope_ce::run(&dev)?;
            tiling::run(&dev)?;
            paged::run(&dev)
        }
        other => bail!("unknown benchmark `{other}`: use attention, norm_rope_ce, tiling, paged or all"),
    }
}

/// Median wall time in milliseconds of `f` over `iters` runs after `warmup` runs, synchronising the device
/// around each run so that queued kernels are counted.
pub fn median_ms(dev: &Device, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    dev.synchronize()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = std::time::Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
