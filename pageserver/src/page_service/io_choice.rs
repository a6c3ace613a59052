//! Which writer sends a connection's next batch (`page_service_io`): always `writev`, always the
//! io_uring writer, or (`auto`) whichever the load favours.
//!
//! Why `auto` decides by load: a batch handed to the io_uring writer crosses to its thread,
//! and that hop costs more than the `writev` it saves while few connections write (0.6x of
//! `writev`'s rps at 1 and 8 connections here); with many connections one submit covers many
//! batches (0.19 `io_uring_enter` per reply at 64 connections) and the ring holds its own at
//! 256 (1.02x rps, p99 4.1 against 5.9 ms). The load measure is the number of connections that
//! wrote during the last period ([`PERIOD`]), the "requests in flight" of the
//! [`WorkerController`](crate::worker_controller::WorkerController)'s path choice:
//! [`Path::Async`] (batched through the ring) above [`RING_ABOVE`] such connections,
//! [`Path::Sync`] (`writev`) below [`WRITEV_BELOW`], the last choice in between (hysteresis);
//! `writev` at first. docs/performance.md ("Page service writers") has the measurements.
//!
//! A connection follows the choice at its next batch boundary ([`IoChoice::use_ring`]):
//! to the ring at once; back to `writev` only once the ring has sent all of its batches, so
//! its bytes never overtake each other.
//!
//! The writer count is not sized by the controller: one ring thread (the daemon has one ring
//! per `Rings`), since on this 2-vCPU machine a second would only take CPU from the executor.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::IntGauge;
use tokio_util::sync::CancellationToken;

use super::uring::Rings;
use super::PageServiceIo;
use crate::walredo::lock;
use crate::worker_controller::{Observation, Path, WorkerController, WorkerControllerConf};

/// How often `auto` looks at the load.
pub const PERIOD: Duration = Duration::from_millis(100);
/// `auto` moves to the io_uring writer above this many connections writing per period...
pub const RING_ABOVE: f64 = 192.0;
/// ... and back to `writev` below this many.
pub const WRITEV_BELOW: f64 = 128.0;

/// The page service's writers and the choice between them; shared by every connection.
pub struct IoChoice {
    /// What the setting asked for.
    mode: PageServiceIo,
    /// The io_uring writers, when the kernel allows a ring and the mode may use them.
    rings: Option<Rings>,
    /// Batches go through the ring (`auto`: the controller's latest choice).
    ring_now: AtomicBool,
    /// Counts periods; a connection remembers the last one it was counted in.
    period: AtomicU64,
    /// Connections that wrote in the current period.
    writing: AtomicU64,
    /// `auto`'s path policy.
    controller: Mutex<WorkerController>,
    metrics: ChoiceMetrics,
}

/// The gauges of `auto`'s choice.
#[derive(Clone)]
pub struct ChoiceMetrics {
    /// Connections that wrote during the last period.
    pub writing_connections: IntGauge,
    /// 1 while batches go through the io_uring writer.
    pub ring_chosen: IntGauge,
}

impl std::fmt::Debug for IoChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoChoice")
            .field("mode", &self.mode)
            .field("rings", &self.rings)
            .field("ring_now", &self.ring_now)
            .finish_non_exhaustive()
    }
}

impl IoChoice {
    /// The choice for `mode`, with `rings` if io_uring is available.
    pub fn new(
        mode: PageServiceIo,
        rings: Option<Rings>,
        metrics: ChoiceMetrics,
    ) -> anyhow::Result<IoChoice> {
        let mut conf = WorkerControllerConf::new(1, 1);
        conf.sync_below = WRITEV_BELOW;
        conf.async_above = RING_ABOVE;
        let controller = WorkerController::new(conf)?;
        let rings = if mode == PageServiceIo::Epoll { None } else { rings };
        let ring_now = mode == PageServiceIo::IoUring && rings.is_some();
        metrics.ring_chosen.set(i64::from(ring_now));
        Ok(IoChoice {
            mode,
            rings,
            ring_now: AtomicBool::new(ring_now),
            period: AtomicU64::new(1),
            writing: AtomicU64::new(0),
            controller: Mutex::new(controller),
            metrics,
        })
    }

    /// The io_uring writers, if any batch may go through them.
    pub(super) fn rings(&self) -> Option<&Rings> {
        self.rings.as_ref()
    }

    /// Whether a connection's next batch should go through the ring (never once the ring
    /// failed); counts the connection as writing in this period (`counted`: the last period it
    /// was counted in, its own).
    pub(super) fn use_ring(&self, counted: &mut u64) -> bool {
        if self.mode == PageServiceIo::Auto {
            let period = self.period.load(Ordering::Relaxed);
            if *counted != period {
                *counted = period;
                self.writing.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.ring_now.load(Ordering::Relaxed) && !self.ring_failed()
    }

    /// The io_uring writer failed: its thread is gone.
    fn ring_failed(&self) -> bool {
        self.rings.as_ref().is_some_and(Rings::dead)
    }

    /// `auto`: looks at the load every [`PERIOD`] and switches writers when the controller
    /// says so, until `cancel`. Returns at once in the other modes (or without rings).
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        if self.mode != PageServiceIo::Auto || self.rings.is_none() {
            return;
        }
        let mut ticks = tokio::time::interval(PERIOD);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = Instant::now();
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let now = Instant::now();
            self.observe(now.duration_since(last));
            last = now;
        }
    }

    /// Ends a period of length `period`: counts its writing connections and applies the
    /// controller's path.
    fn observe(&self, period: Duration) {
        let writing = self.writing.swap(0, Ordering::Relaxed);
        self.period.fetch_add(1, Ordering::Relaxed);
        let decision = lock(&self.controller).update(Observation {
            period,
            arrivals: writing,
            completions: writing,
            busy: Duration::ZERO,
            queue_wait: Duration::ZERO,
            in_flight_avg: writing as f64,
            workers: 1,
            stuck: false,
        });
        // A failed ring is never chosen.
        let ring = decision.path == Path::Async && !self.ring_failed();
        self.metrics.writing_connections.set(i64::try_from(writing).unwrap_or(i64::MAX));
        if self.ring_now.swap(ring, Ordering::Relaxed) != ring {
            self.metrics.ring_chosen.set(i64::from(ring));
            tracing::info!(
                writing_connections = writing,
                "page service replies: {}",
                if ring {
                    "io_uring (many connections write)"
                } else {
                    "writev per connection (few connections write)"
                }
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice() -> IoChoice {
        let metrics = ChoiceMetrics {
            writing_connections: IntGauge::new("w", "w").expect("gauge"),
            ring_chosen: IntGauge::new("r", "r").expect("gauge"),
        };
        IoChoice::new(PageServiceIo::Auto, None, metrics).expect("choice")
    }

    /// `n` connections write once each in this period (each twice: counted once).
    fn write(choice: &IoChoice, n: usize) {
        for _ in 0..n {
            let mut counted = 0;
            choice.use_ring(&mut counted);
            choice.use_ring(&mut counted);
        }
    }

    #[test]
    fn auto_moves_to_the_ring_with_many_writers_and_back_with_few_with_hysteresis() {
        let choice = choice();
        assert!(!choice.ring_now.load(Ordering::Relaxed), "writev at first");
        for (writers, ring) in
            [(8, false), (160, false), (200, true), (160, true), (100, false), (160, false)]
        {
            write(&choice, writers);
            choice.observe(PERIOD);
            assert_eq!(choice.ring_now.load(Ordering::Relaxed), ring, "{writers} writers");
            assert_eq!(choice.metrics.writing_connections.get(), writers as i64);
            assert_eq!(choice.metrics.ring_chosen.get(), i64::from(ring));
        }
    }

    #[test]
    fn a_connection_counts_once_per_period() {
        let choice = choice();
        let mut counted = 0;
        for _ in 0..5 {
            choice.use_ring(&mut counted);
        }
        choice.observe(PERIOD);
        assert_eq!(choice.metrics.writing_connections.get(), 1);
        choice.use_ring(&mut counted);
        choice.observe(PERIOD);
        assert_eq!(choice.metrics.writing_connections.get(), 1, "counted again in the next period");
        choice.observe(PERIOD);
        assert_eq!(choice.metrics.writing_connections.get(), 0);
    }
}
