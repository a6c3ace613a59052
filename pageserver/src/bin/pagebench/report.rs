//! Progress lines (stderr, once a second) and summaries (a JSON line on stdout) of `pagebench`.
//!
//! Counters are atomics shared with the worker tasks; the reporter task only reads them, so a
//! slow terminal never slows the load. The JSON summary is the last line of stdout and the only
//! thing `pagebench` writes there: scripts take `stdout.splitlines()[-1]`.
//!
//! Per-second latency percentiles come from an [`IntervalLatency`]: one histogram that every
//! receiver records into besides its own, which the reporter swaps for an empty one each second.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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

/// What [`every_second`] calls with each tick.
pub type TickFn = Box<dyn FnMut(Tick) + Send>;

/// One second's view of the counters.
pub struct Tick {
    /// Since the start, and since the previous tick (a second, except for the last tick).
    pub elapsed: Duration,
    pub interval: Duration,
    pub done: u64,
    pub errors: u64,
    pub done_in_interval: u64,
    pub errors_in_interval: u64,
    pub done_per_s: f64,
    pub bytes_per_s: f64,
    /// The latencies recorded into the [`IntervalLatency`] during the interval, if one was given.
    pub latency: Option<Percentiles>,
    /// The tick made when the reporter is stopped (only with `last_tick`).
    pub last: bool,
}

/// Prints a line on stderr every second until `stop` is cancelled.
///
/// Cancel-safe: it only reads counters and prints.
pub async fn progress(counters: Arc<Counters>, start: Instant, stop: CancellationToken, line: LineFn) {
    every_second(counters, start, stop, None, false, Box::new(move |tick| errln!("{}", line(tick)))).await
}

/// Calls `on_tick` every second from `start` until `stop` is cancelled; with `last_tick`, once
/// more when stopped, for the part of a second since the last tick, if anything was done in it.
/// With `latency`, each tick takes the latencies recorded since the previous one.
///
/// Cancel-safe: it only reads counters and calls `on_tick`.
pub async fn every_second(
    counters: Arc<Counters>,
    start: Instant,
    stop: CancellationToken,
    latency: Option<Arc<IntervalLatency>>,
    last_tick: bool,
    mut on_tick: TickFn,
) {
    let mut ticker = tokio::time::interval_at(
        tokio::time::Instant::from_std(start) + Duration::from_secs(1),
        Duration::from_secs(1),
    );
    // A reporter that fell behind makes one longer interval, not a burst of empty ones.
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let (mut last_done, mut last_errors, mut last_bytes) = counters.snapshot();
    let mut last_at = start;
    let mut spare = latency_histogram();
    loop {
        let last = tokio::select! {
            _ = stop.cancelled() => true,
            _ = ticker.tick() => false,
        };
        let now = Instant::now();
        let (done, errors, bytes) = counters.snapshot();
        if last && (!last_tick || (done == last_done && errors == last_errors)) {
            return;
        }
        let interval = now.duration_since(last_at);
        let secs = interval.as_secs_f64().max(1e-9);
        let latency = latency.as_ref().map(|shared| {
            shared.swap(&mut spare);
            Percentiles::of(&spare)
        });
        on_tick(Tick {
            elapsed: now.duration_since(start),
            interval,
            done,
            errors,
            done_in_interval: done - last_done,
            errors_in_interval: errors - last_errors,
            done_per_s: (done - last_done) as f64 / secs,
            bytes_per_s: (bytes - last_bytes) as f64 / secs,
            latency,
            last,
        });
        if last {
            return;
        }
        (last_done, last_errors, last_bytes, last_at) = (done, errors, bytes, now);
    }
}

/// The latencies of the requests completed since the reporter last took them, shared by every
/// receiver. A std mutex: it is never held across an await, and with the usual current-thread
/// runtime it is never contended; a record is one lock and one counter increment.
pub struct IntervalLatency {
    histogram: Mutex<Histogram<u64>>,
}

impl IntervalLatency {
    pub fn new() -> Self {
        IntervalLatency { histogram: Mutex::new(latency_histogram()) }
    }

    pub fn record(&self, micros: u64) {
        self.histogram.lock().unwrap_or_else(|poison| poison.into_inner()).saturating_record(micros);
    }

    /// Moves the latencies recorded so far into `into` (emptied first) and starts over with
    /// `into`'s storage: no allocation, and the lock is held only for the swap.
    pub fn swap(&self, into: &mut Histogram<u64>) {
        into.reset();
        std::mem::swap(&mut *self.histogram.lock().unwrap_or_else(|poison| poison.into_inner()), into);
    }
}

/// The percentiles of a progress line and of a `--series` line, in microseconds (0 if empty).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Percentiles {
    pub p50: u64,
    pub p99: u64,
    pub p999: u64,
    pub max: u64,
}

impl Percentiles {
    pub fn of(histogram: &Histogram<u64>) -> Self {
        if histogram.is_empty() {
            return Percentiles::default();
        }
        Percentiles {
            p50: histogram.value_at_quantile(0.5),
            p99: histogram.value_at_quantile(0.99),
            p999: histogram.value_at_quantile(0.999),
            max: histogram.max(),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "p50": self.p50, "p99": self.p99, "p999": self.p999, "max": self.max })
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

    #[test]
    fn interval_latency_swap_hands_over_the_interval_and_starts_empty() {
        let shared = IntervalLatency::new();
        let mut spare = latency_histogram();
        spare.record(7).unwrap(); // stale: must not survive the swap
        for us in 1..=1000 {
            shared.record(us);
        }
        shared.swap(&mut spare);
        assert_eq!(Percentiles::of(&spare), Percentiles { p50: 500, p99: 990, p999: 999, max: 1000 });
        shared.record(3);
        shared.swap(&mut spare);
        assert_eq!(Percentiles::of(&spare), Percentiles { p50: 3, p99: 3, p999: 3, max: 3 });
        shared.swap(&mut spare);
        assert_eq!(Percentiles::of(&spare), Percentiles::default());
        assert_eq!(Percentiles::default().json()["p999"].as_u64(), Some(0));
    }
}
