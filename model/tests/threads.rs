//! `pin_cpu_threads` sets the process-wide thread count once (its own test binary: it changes the
//! environment, which no other test may read at the same time).

use askgui_model::pin_cpu_threads;

#[test]
fn pin_cpu_threads_sets_candles_count_once_and_keeps_a_users() {
    std::env::remove_var("RAYON_NUM_THREADS");
    let n = pin_cpu_threads();
    assert!(n >= 1);
    assert_eq!(std::env::var("RAYON_NUM_THREADS").as_deref(), Ok(n.to_string().as_str()));
    assert_eq!(candle_core::utils::get_num_threads(), n, "candle must read the pinned count");

    // A count the user gave is kept; one that is not a positive count is replaced.
    std::env::set_var("RAYON_NUM_THREADS", "3");
    assert_eq!(pin_cpu_threads(), 3);
    std::env::set_var("RAYON_NUM_THREADS", "0");
    assert_eq!(pin_cpu_threads(), n);
    assert_eq!(std::env::var("RAYON_NUM_THREADS").as_deref(), Ok(n.to_string().as_str()));
}
