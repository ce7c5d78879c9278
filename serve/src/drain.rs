//! How fast the backend answers jobs, for the `Retry-After` of a 429 (queue full) or a 503 (KV cache full):
//! the completions of the last [`WINDOW`], and the seconds that `n` more take at that rate.
//!
//! Why: a fixed `Retry-After: 1` sends every refused client back at once, into the same full queue; the
//! measured rate spreads them over the time the backlog takes to drain.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How far back completions count.
const WINDOW: Duration = Duration::from_secs(30);

/// The most `Retry-After` says, in seconds (a stalled backend is the health check's business).
const MAX_RETRY_S: u32 = 60;

/// Completion times of the last [`WINDOW`].
#[derive(Default)]
pub struct DrainRate {
    done: Mutex<VecDeque<Instant>>,
}

impl DrainRate {
    /// One job answered now.
    pub fn record(&self) {
        self.record_at(Instant::now());
    }

    fn record_at(&self, t: Instant) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        done.push_back(t);
        while done.front().is_some_and(|&f| t.duration_since(f) > WINDOW) {
            done.pop_front();
        }
    }

    /// Seconds until `jobs` more complete at the recent rate, rounded up, between 1 and [`MAX_RETRY_S`];
    /// 1 before two completions give a rate.
    pub fn retry_after(&self, jobs: usize) -> u32 {
        let done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let (Some(first), Some(last)) = (done.front(), done.back()) else { return 1 };
        let span = last.duration_since(*first).as_secs_f64();
        if done.len() < 2 || span <= 0.0 {
            return 1;
        }
        let per_s = (done.len() - 1) as f64 / span;
        (jobs.max(1) as f64 / per_s).ceil().clamp(1.0, MAX_RETRY_S as f64) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ten completions 0.5 s apart: 2 per second, so 7 jobs take 3.5 s (4 rounded up), and a long backlog
    /// is capped; completions older than the window are forgotten.
    #[test]
    fn retry_after_follows_the_measured_rate() {
        let d = DrainRate::default();
        assert_eq!(d.retry_after(100), 1, "no rate yet");
        let t0 = Instant::now();
        for i in 0..10 {
            d.record_at(t0 + Duration::from_millis(500 * i));
        }
        assert_eq!(d.retry_after(7), 4);
        assert_eq!(d.retry_after(1), 1);
        assert_eq!(d.retry_after(10_000), MAX_RETRY_S);
        d.record_at(t0 + Duration::from_secs(34));
        assert_eq!(d.done.lock().unwrap().len(), 3, "only the last 30 s count: 4.0 s, 4.5 s and 34 s");
    }
}
