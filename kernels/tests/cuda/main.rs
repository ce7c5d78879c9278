//! GPU tests of the CUDA kernels against the CPU ops and the plain-candle references (feature `cuda`).
//!
//! One test executable, so that a single file is carried to the GPU machine (see
//! `scripts/build_cuda_artifacts.sh`). Each module owns one family of kernels. Without a CUDA device the
//! tests print SKIPPED and pass, so `cargo test --features cuda` stays usable on a GPU-less machine.

#[path = "../common/mod.rs"]
mod common;

mod adamw;
mod attention;
mod dropout;
mod norm_rope_ce;
mod paged_attention;
mod tiling;

/// The first CUDA device, or `None` (with a SKIPPED line naming the test) where there is none.
pub fn cuda_device(test: &str) -> Option<candle_core::Device> {
    match candle_core::Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED {test}: no CUDA device ({e})");
            None
        }
    }
}
