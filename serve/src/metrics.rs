//! Prometheus metrics, kept in a few counters and histograms and written out in the text exposition
//! format by hand (a dozen lines; no metrics framework to depend on).
//!
//! Requests are labelled by route *pattern* (`/v1/sessions/{id}/step`), never by the raw path, so session
//! ids never reach a label and the number of series stays bounded; unknown paths share `unmatched`.
//! Format: <https://prometheus.io/docs/instrumenting/exposition_formats/>.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Upper bounds of the request-duration buckets, in seconds (a step takes ~0.1-2 s on a GPU, more on CPU).
const DURATION_BUCKETS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Upper bounds of the queue-wait buckets, in seconds.
const WAIT_BUCKETS: [f64; 12] = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];
/// Upper bounds of the time-per-output-token buckets, in seconds.
const TPOT_BUCKETS: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];
/// Upper bounds of the batch-size buckets.
const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative; summed when written).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", self.count);
        let braces = |l: &str| if l.is_empty() { String::new() } else { format!("{{{l}}}") };
        let _ = writeln!(out, "{name}_sum{} {}", braces(labels), self.sum);
        let _ = writeln!(out, "{name}_count{} {}", braces(labels), self.count);
    }
}

#[derive(Default)]
struct Requests {
    /// (route, status) -> count
    totals: BTreeMap<(String, u16), u64>,
    durations: BTreeMap<String, Histogram>,
}

/// The server's metrics; shared by the middleware, the handlers and the backend thread.
pub struct Metrics {
    requests: Mutex<Requests>,
    batches: Mutex<Histogram>,
    vision_batches: Mutex<Histogram>,
    queue_wait: Mutex<Histogram>,
    time_per_token: Mutex<Histogram>,
    cached_tokens: AtomicU64,
    prefix_hits: AtomicU64,
    prompt_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    cancelled: AtomicU64,
    panics: AtomicU64,
    kv_in_use: AtomicU64,
    kv_capacity: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Mutex::default(),
            batches: Mutex::new(Histogram::new(&BATCH_BUCKETS)),
            vision_batches: Mutex::new(Histogram::new(&BATCH_BUCKETS)),
            queue_wait: Mutex::new(Histogram::new(&WAIT_BUCKETS)),
            time_per_token: Mutex::new(Histogram::new(&TPOT_BUCKETS)),
            cached_tokens: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            panics: AtomicU64::new(0),
            kv_in_use: AtomicU64::new(0),
            kv_capacity: AtomicU64::new(0),
        }
    }
}

/// A label value with `\`, `"` and newlines escaped, as the format wants.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Gauges read at scrape time from elsewhere (the queue, the session store).
#[derive(Debug, Clone, Copy, Default)]
pub struct Gauges {
    pub queue_depth: usize,
    pub live_sessions: usize,
}

impl Metrics {
    /// One answered request: its route pattern, status and time to the response head.
    pub fn observe_request(&self, route: &str, status: u16, elapsed: Duration) {
        let mut r = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *r.totals.entry((route.to_string(), status)).or_insert(0) += 1;
        r.durations
            .entry(route.to_string())
            .or_insert_with(|| Histogram::new(&DURATION_BUCKETS))
            .observe(elapsed.as_secs_f64());
    }

    pub fn observe_batch(&self, size: usize) {
        self.batches.lock().unwrap_or_else(|p| p.into_inner()).observe(size as f64);
    }

    /// One batched vision forward's screenshots (cached screenshots are not encoded, so not counted).
    /// The KV blocks in use and the pool's capacity (0: unbounded), as of the last forward.
    pub fn set_kv_blocks(&self, in_use: usize, capacity: usize) {
        self.kv_in_use.store(in_use as u64, Ordering::Relaxed);
        self.kv_capacity.store(capacity as u64, Ordering::Relaxed);
    }

    pub fn observe_vision_batch(&self, images: usize) {
        self.vision_batches.lock().unwrap_or_else(|p| p.into_inner()).observe(images as f64);
    }

    /// How long a job waited in the queue before the backend took it.
    pub fn observe_queue_wait(&self, waited: Duration) {
        self.queue_wait.lock().unwrap_or_else(|p| p.into_inner()).observe(waited.as_secs_f64());
    }

    /// An agent step's prefix-cache use and its time per output token (decode time over the tokens
    /// after the first, which ends the prefill).
    pub fn observe_step(&self, cached_tokens: usize, completion_tokens: usize, decode_ms: f64) {
        self.cached_tokens.fetch_add(cached_tokens as u64, Ordering::Relaxed);
        if cached_tokens > 0 {
            self.prefix_hits.fetch_add(1, Ordering::Relaxed);
        }
        if completion_tokens > 1 {
            let tpot = decode_ms / 1e3 / (completion_tokens - 1) as f64;
            self.time_per_token.lock().unwrap_or_else(|p| p.into_inner()).observe(tpot);
        }
    }

    pub fn tokens(&self, prompt: usize, completion: usize) {
        self.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.completion_tokens.fetch_add(completion as u64, Ordering::Relaxed);
    }

    pub fn jobs_cancelled(&self, n: usize) {
        self.cancelled.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn backend_panic(&self) {
        self.panics.fetch_add(1, Ordering::Relaxed);
    }

    /// The batch sizes seen so far: (number of batches, sum of sizes).
    pub fn batch_totals(&self) -> (u64, f64) {
        let b = self.batches.lock().unwrap_or_else(|p| p.into_inner());
        (b.count, b.sum)
    }

    /// Everything, in the Prometheus text format.
    pub fn render(&self, gauges: Gauges) -> String {
        let mut out = String::new();
        {
            let r = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            out.push_str("# HELP askgui_requests_total HTTP requests answered, by route pattern and status.\n");
            out.push_str("# TYPE askgui_requests_total counter\n");
            for ((route, status), n) in &r.totals {
                let _ = writeln!(out, "askgui_requests_total{{route=\"{}\",status=\"{status}\"}} {n}", escape(route));
            }
            out.push_str("# HELP askgui_request_duration_seconds Time to the response head, by route pattern.\n");
            out.push_str("# TYPE askgui_request_duration_seconds histogram\n");
            for (route, h) in &r.durations {
                h.write(&mut out, "askgui_request_duration_seconds", &format!("route=\"{}\"", escape(route)));
            }
        }
        out.push_str("# HELP askgui_queue_depth Jobs waiting for the backend.\n");
        out.push_str("# TYPE askgui_queue_depth gauge\n");
        let _ = writeln!(out, "askgui_queue_depth {}", gauges.queue_depth);
        out.push_str("# HELP askgui_batch_size Jobs per backend batch.\n");
        out.push_str("# TYPE askgui_batch_size histogram\n");
        self.batches.lock().unwrap_or_else(|p| p.into_inner()).write(&mut out, "askgui_batch_size", "");
        out.push_str("# HELP askgui_vision_batch_size Screenshots encoded per packed forward (cache misses).\n");
        out.push_str("# TYPE askgui_vision_batch_size histogram\n");
        self.vision_batches.lock().unwrap_or_else(|p| p.into_inner()).write(&mut out, "askgui_vision_batch_size", "");
        out.push_str("# HELP askgui_queue_wait_seconds Time a job waited in the queue for the backend.\n");
        out.push_str("# TYPE askgui_queue_wait_seconds histogram\n");
        self.queue_wait.lock().unwrap_or_else(|p| p.into_inner()).write(&mut out, "askgui_queue_wait_seconds", "");
        out.push_str(
            "# HELP askgui_time_per_output_token_seconds Agent steps: decode time per token after the first.\n",
        );
        out.push_str("# TYPE askgui_time_per_output_token_seconds histogram\n");
        let tpot = self.time_per_token.lock().unwrap_or_else(|p| p.into_inner());
        tpot.write(&mut out, "askgui_time_per_output_token_seconds", "");
        drop(tpot);
        out.push_str("# HELP askgui_prefix_cache_hits_total Agent steps that reused a cached prompt prefix.\n");
        out.push_str("# TYPE askgui_prefix_cache_hits_total counter\n");
        let _ = writeln!(out, "askgui_prefix_cache_hits_total {}", self.prefix_hits.load(Ordering::Relaxed));
        let (kv_used, kv_cap) = (self.kv_in_use.load(Ordering::Relaxed), self.kv_capacity.load(Ordering::Relaxed));
        out.push_str("# HELP askgui_kv_blocks_in_use KV cache blocks (one layer, 32 positions) held by sequences and cached prefixes.\n");
        out.push_str("# TYPE askgui_kv_blocks_in_use gauge\n");
        let _ = writeln!(out, "askgui_kv_blocks_in_use {kv_used}");
        if kv_cap > 0 {
            out.push_str("# HELP askgui_kv_blocks_free KV cache blocks left under --kv-cache-mb.\n");
            out.push_str("# TYPE askgui_kv_blocks_free gauge\n");
            let _ = writeln!(out, "askgui_kv_blocks_free {}", kv_cap.saturating_sub(kv_used));
        }
        out.push_str("# HELP askgui_tokens_total Tokens processed: prompt (images included) and completion.\n");
        out.push_str("# TYPE askgui_tokens_total counter\n");
        let _ = writeln!(out, "askgui_tokens_total{{kind=\"prompt\"}} {}", self.prompt_tokens.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "askgui_tokens_total{{kind=\"completion\"}} {}",
            self.completion_tokens.load(Ordering::Relaxed)
        );
        let _ = writeln!(out, "askgui_tokens_total{{kind=\"cached\"}} {}", self.cached_tokens.load(Ordering::Relaxed));
        out.push_str("# HELP askgui_live_sessions Sessions that have not expired.\n");
        out.push_str("# TYPE askgui_live_sessions gauge\n");
        let _ = writeln!(out, "askgui_live_sessions {}", gauges.live_sessions);
        out.push_str("# HELP askgui_jobs_cancelled_total Jobs dropped before running because the client left.\n");
        out.push_str("# TYPE askgui_jobs_cancelled_total counter\n");
        let _ = writeln!(out, "askgui_jobs_cancelled_total {}", self.cancelled.load(Ordering::Relaxed));
        out.push_str("# HELP askgui_backend_panics_total Batches whose backend run panicked (answered 500).\n");
        out.push_str("# TYPE askgui_backend_panics_total counter\n");
        let _ = writeln!(out, "askgui_backend_panics_total {}", self.panics.load(Ordering::Relaxed));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_labels_escaped() {
        let m = Metrics::default();
        m.observe_request("/v1/agent/step", 200, Duration::from_millis(30));
        m.observe_request("/v1/agent/step", 200, Duration::from_millis(3));
        m.observe_request("/a\"b", 404, Duration::from_secs(1000));
        m.observe_batch(3);
        m.observe_vision_batch(2);
        m.observe_vision_batch(5);
        m.observe_queue_wait(Duration::from_millis(3));
        m.observe_step(120, 11, 40.0); // 40 ms over the 10 tokens after the first: 4 ms a token
        m.observe_step(0, 1, 9.0); // one token: no decode time to divide
        m.tokens(10, 2);
        let text = m.render(Gauges { queue_depth: 2, live_sessions: 5 });
        assert!(text.contains("askgui_requests_total{route=\"/v1/agent/step\",status=\"200\"} 2\n"), "{text}");
        assert!(text.contains("route=\"/a\\\"b\",status=\"404\"} 1\n"), "{text}");
        assert!(text.contains("askgui_request_duration_seconds_bucket{route=\"/v1/agent/step\",le=\"0.005\"} 1\n"));
        assert!(text.contains("askgui_request_duration_seconds_bucket{route=\"/v1/agent/step\",le=\"0.05\"} 2\n"));
        assert!(text.contains("askgui_request_duration_seconds_bucket{route=\"/a\\\"b\",le=\"120\"} 0\n"), "{text}");
        assert!(text.contains("askgui_request_duration_seconds_bucket{route=\"/a\\\"b\",le=\"+Inf\"} 1\n"));
        assert!(text.contains("askgui_batch_size_bucket{le=\"4\"} 1\n") && text.contains("askgui_batch_size_sum 3\n"));
        assert!(text.contains("askgui_vision_batch_size_bucket{le=\"2\"} 1\n"), "{text}");
        assert!(text.contains("askgui_vision_batch_size_bucket{le=\"8\"} 2\n"), "{text}");
        assert!(text.contains("askgui_vision_batch_size_sum 7\n"), "{text}");
        assert!(text.contains("askgui_queue_wait_seconds_bucket{le=\"0.001\"} 0\n"), "{text}");
        assert!(text.contains("askgui_queue_wait_seconds_bucket{le=\"0.005\"} 1\n"), "{text}");
        assert!(text.contains("askgui_time_per_output_token_seconds_bucket{le=\"0.0025\"} 0\n"), "{text}");
        assert!(text.contains("askgui_time_per_output_token_seconds_bucket{le=\"0.005\"} 1\n"), "{text}");
        assert!(text.contains("askgui_time_per_output_token_seconds_count 1\n"), "{text}");
        assert!(text.contains("askgui_prefix_cache_hits_total 1\n"), "{text}");
        assert!(text.contains("askgui_tokens_total{kind=\"cached\"} 120\n"), "{text}");
        assert!(text.contains("askgui_queue_depth 2\n") && text.contains("askgui_live_sessions 5\n"));
        assert!(text.contains("askgui_tokens_total{kind=\"prompt\"} 10\n"));
        assert!(text.contains("askgui_tokens_total{kind=\"completion\"} 2\n"));
    }
}
