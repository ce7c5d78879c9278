//! Micro-batches of a step computed at once on the CPU (`--micro-batch-threads N`).
//!
//! Why: a small model's kernels cannot keep several cores busy. Its GEMMs are a few hundred rows, and
//! every elementwise op meets the thread pools again: on the demo's model, two threads per kernel ran a
//! step only 1.2x faster than one (2026-11-27). Here each of `N` micro-batches runs whole on a thread of
//! its own, with single-threaded kernels, so the threads meet once per micro-batch instead of once per op.
//!
//! How: one single-thread rayon pool per worker, made once. A micro-batch runs inside its pool
//! (`ThreadPool::install`), so `rayon::current_num_threads()` is 1 there: the attention op's heads and
//! the GEMMs (`askgui_kernels::ops::gemm`) run serially on that thread. candle's own elementwise ops use
//! a process-wide pool of their own; [`single_threaded_candle`] sizes it to one thread. The results come
//! back in micro-batch order, so the trainer sums them in the order a one-thread run does: the step is
//! bitwise that of the same micro-batches run one after another.

use crate::error::{Result, TrainError};

/// `N` single-thread pools that run up to `N` micro-batches at once ([`Self::run`]); with `N == 1`
/// nothing is made and work runs on the calling thread, its kernels on every core.
pub struct MicroThreads {
    pools: Vec<rayon::ThreadPool>,
}

impl MicroThreads {
    pub fn new(n: usize) -> Result<Self> {
        let pool = |i| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(move |_| format!("askgui-micro-{i}"))
                .build()
                .map_err(|e| TrainError::Config(format!("--micro-batch-threads {n}: cannot start thread {i}: {e}")))
        };
        let pools = match n {
            0 | 1 => vec![],
            _ => (0..n).map(pool).collect::<Result<_>>()?,
        };
        Ok(Self { pools })
    }

    /// How many micro-batches run at once.
    pub fn at_once(&self) -> usize {
        self.pools.len().max(1)
    }

    /// `f(0), .., f(n - 1)` with `n <= self.at_once()`, each on its own pool at once; the results in order.
    pub fn run<T: Send>(&self, n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
        assert!(n <= self.at_once(), "{n} micro-batches at once on {} threads", self.at_once());
        if self.pools.is_empty() {
            return (0..n).map(&f).collect();
        }
        let f = &f;
        std::thread::scope(|s| {
            let running: Vec<_> =
                self.pools[..n].iter().enumerate().map(|(i, pool)| s.spawn(move || pool.install(|| f(i)))).collect();
            // A panic in `f` is the caller's bug; it propagates like one on the calling thread.
            running.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        })
    }
}

/// Sizes candle's process-wide pool for elementwise ops to one thread (`CANDLE_NUM_THREADS=1`, unless
/// the variable is set), so that concurrent micro-batches do not queue on it. candle reads the variable
/// when it first starts that pool: call this before the process's first tensor op (the trainer does,
/// before it loads the model); later, it has no effect and ops still queue (slower, the same results).
pub fn single_threaded_candle() {
    const VAR: &str = "CANDLE_NUM_THREADS";
    if std::env::var_os(VAR).is_none() {
        std::env::set_var(VAR, "1");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_order_from_distinct_threads() {
        let t = MicroThreads::new(3).unwrap();
        assert_eq!(t.at_once(), 3);
        let out = t.run(3, |i| (i, rayon::current_num_threads(), std::thread::current().name().map(String::from)));
        assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(out.iter().all(|o| o.1 == 1), "each micro-batch sees a one-thread pool: {out:?}");
        let names: std::collections::BTreeSet<_> = out.iter().map(|o| o.2.clone()).collect();
        assert_eq!(names.len(), 3, "{out:?}");
    }

    #[test]
    fn one_thread_runs_on_the_caller() {
        let t = MicroThreads::new(1).unwrap();
        let me = std::thread::current().id();
        assert_eq!(t.run(1, |_| std::thread::current().id()), [me]);
    }
}
