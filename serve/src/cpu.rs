//! CPU settings of a serving process, made once at the top of `main`, before any thread starts. Each
//! leaves a setting the user made in the environment alone.
//!
//! Why (`scripts/bench/bench_serve.py` at concurrency 16, `docs/benchmarks.md`, 2026-11-28):
//! - candle 0.11 runs its elementwise ops (a linear's bias, the residual adds) on a barrier pool of its
//!   own threads beside rayon's pool, which runs the matmuls and the attention, and the calling thread
//!   spins until that pool's threads are done. When rayon's threads hold the cores, they are not: that
//!   spin was 20% of the server's CPU. `CANDLE_NUM_THREADS=1` runs those ops on the calling thread.
//! - glibc's malloc gives every freed block above its mmap threshold back to the kernel, and the next
//!   round faults the same pages in again (a round's activations and screenshots are megabytes).
//!   Blocks below 64 MiB stay in its heap, and the heap's free top is kept up to 256 MiB.

/// Applies the settings above (see the module docs).
pub fn tune_for_serving() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    keep_freed_blocks();
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_blocks() {
    const MMAP_THRESHOLD: libc::c_int = 64 << 20;
    const TRIM_THRESHOLD: libc::c_int = 256 << 20;
    let set = |var: &str| std::env::var_os(var).is_some();
    if set("MALLOC_MMAP_THRESHOLD_") || set("MALLOC_TRIM_THRESHOLD_") {
        return;
    }
    // SAFETY: mallopt only sets allocator parameters; it is called before any other thread exists.
    let ok = unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    };
    if !ok {
        eprintln!("askgui-serve: glibc refused the malloc thresholds; serving with its defaults");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_blocks() {}
