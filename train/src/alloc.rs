//! Allocator settings for training on the CPU.
//!
//! A training step allocates and frees the same large activation and gradient buffers every step. glibc
//! returns blocks above its mmap threshold to the kernel as soon as they are freed and trims the top of the
//! heap, so each step faults its buffers in again and the kernel zeroes every page: about a quarter of a
//! step's time under `perf` (issue 4's benchmark). Keeping freed memory in the process (the mmap threshold
//! at glibc's maximum, no trimming, a padded heap top) makes the steps faster at the same peak RSS, since
//! the peak is what a step holds anyway (numbers in docs/benchmarks.md).
//!
//! The user's own `MALLOC_*_` / `GLIBC_TUNABLES` settings win: nothing is changed when one is set.

/// Sets the allocator up for training (glibc on Linux; elsewhere a no-op). Call once, at start.
pub fn tune_for_training() {
    let user_set = std::env::vars_os().any(|(k, _)| {
        let k = k.to_string_lossy();
        k.starts_with("MALLOC_") || k == "GLIBC_TUNABLES"
    });
    if user_set {
        tracing::debug!("allocator settings left to the environment");
        return;
    }
    set();
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set() {
    // glibc accepts mmap thresholds up to 32 MiB on 64-bit targets (half its largest heap).
    const MMAP_THRESHOLD: libc::c_int = 32 << 20;
    const TRIM_THRESHOLD: libc::c_int = 1 << 30;
    const TOP_PAD: libc::c_int = 256 << 20;
    // SAFETY: mallopt only changes malloc's parameters; it is called before the threads that allocate
    // heavily start, and glibc serialises it with allocation anyway.
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            && libc::mallopt(libc::M_TOP_PAD, TOP_PAD) == 1
    };
    if !ok {
        tracing::debug!("glibc refused an allocator setting; keeping its defaults");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set() {}
