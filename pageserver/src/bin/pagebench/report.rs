//! Progress lines (stderr, once a second) and summaries (a JSON line on stdout) of `pagebench`.
//!
//! Counters are atomics shared with the worker tasks; the reporter task only reads them, so a
//! slow terminal never slows the load. The JSON summary is the last line of stdout and the only
//! thing `pagebench` writes there: scripts take `stdout.splitlines()[-1]`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use tokio_util::sync::CancellationToken;

/// Counters the workers bump and the reporter reads.
#[derive(Debug, Default)]
pub struct Counters {
    pub done: AtomicU64,
    pub errors: AtomicU64,
    pub bytes: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> (u64, u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.errors.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

/// What one progress line says; `line` gets the totals and the deltas of the last second.
pub type LineFn = Box<dyn Fn(Tick) -> String + Send>;

/// One second's view of the counters.
pub struct Tick {
    pub elapsed: Duration,
    pub done: u64,
    pub errors: u64,
    pub done_per_s: f64,
    pub bytes_per_s: f64,
}

/// Prints a line on stderr every second until `stop` is cancelled.
///
/// Cancel-safe: it only reads counters and prints.
pub async fn progress(counters: Arc<Counters>, start: Instant, stop: CancellationToken, line: LineFn) {
    let mut ticker = tokio::time::interval_at(
        tokio::time::Instant::from_std(start) + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    let (mut last_done, _, mut last_bytes) = counters.snapshot();
    let mut last_at = start;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let now = Instant::now();
        let (done, errors, bytes) = counters.snapshot();
        let secs = now.duration_since(last_at).as_secs_f64().max(1e-9);
        errln!(
            "{}",
            line(Tick {
                elapsed: now.duration_since(start),
                done,
                errors,
                done_per_s: (done - last_done) as f64 / secs,
                bytes_per_s: (bytes - last_bytes) as f64 / secs,
            })
        );
        (last_done, last_bytes, last_at) = (done, bytes, now);
    }
}

/// An empty latency histogram in microseconds: 1 us to 10 min, 3 significant digits.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("constant bounds are valid")
}

/// The `latency_us` object of the summary.
pub fn latency_json(histogram: &Histogram<u64>) -> serde_json::Value {
    let q = |quantile: f64| if histogram.is_empty() { 0 } else { histogram.value_at_quantile(quantile) };
    serde_json::json!({
        "mean": if histogram.is_empty() { 0.0 } else { (histogram.mean() * 10.0).round() / 10.0 },
        "min": if histogram.is_empty() { 0 } else { histogram.min() },
        "p50": q(0.5),
        "p90": q(0.9),
        "p99": q(0.99),
        "p999": q(0.999),
        "p9999": q(0.9999),
        "max": if histogram.is_empty() { 0 } else { histogram.max() },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_json_has_the_documented_fields_and_handles_empty() {
        let empty = latency_json(&latency_histogram());
        for field in ["mean", "p50", "p99", "p999", "p9999"] {
            assert_eq!(empty[field].as_f64(), Some(0.0), "{field}");
        }
        let mut h = latency_histogram();
        for us in 1..=1000 {
            h.record(us).unwrap();
        }
        let full = latency_json(&h);
        assert_eq!(full["p50"].as_u64(), Some(500));
        assert_eq!(full["p99"].as_u64(), Some(990));
        assert_eq!(full["max"].as_u64(), Some(1000));
    }
}
