//! Which writer sends a connection's next batch (`page_service_io`): always `writev`, always the
//! io_uring writer, or (`auto`) whichever measures better on this machine under this load.
//!
//! Why `auto` measures instead of counting connections: which writer wins depends on the
//! machine and the load. With one ring thread (before the rings per executor thread), on 2
//! vCPUs the ring broke even with `writev` from about 256 writing connections (0.90-1.03x its
//! rps); on a 16-core machine that thread capped at about 125k replies/s and lost at every load
//! (0.50-0.52x of `writev` at 64-512 connections). A threshold fitted on one machine loses on the
//! other (issue 18, docs/performance.md "Page service writers"). The rings per executor thread
//! are even with `writev` on 2 vCPUs from 64 connections on (0.97-1.04x its rps;
//! docs/performance.md "A ring per executor thread").
//!
//! So `auto` writes with `writev` and, while enough connections write that the ring could win
//! ([`PROBE_FROM`] per [`PERIOD`]), now and then moves every connection to the other writer for a
//! short probe and keeps whichever did better ([`Chooser`], a pure state machine fed one
//! [`Sample`] per period: replies handed to the writers, the daemon's CPU time, writing
//! connections):
//! - the probe is judged against the periods just before it on the current writer: it wins with
//!   [`MARGIN`] more replies per second, or, with the same replies per second (within
//!   [`MARGIN`]), with [`MARGIN`] less daemon CPU per reply; a probe that lowers throughput never
//!   wins (the CPU it saves would be the work it did not do);
//! - the first probe comes [`FIRST_PROBE`] after the load began; every probe that does not win
//!   stretches the wait before the next one [`BACKOFF`]-fold, up to [`LAST_PROBE`], so a losing
//!   writer costs at most a few tenths of a second now and then (a probe that loses a fifth of
//!   the rate in its first measured period ends there); a load (the most connections that wrote
//!   in one period of the last second) that doubles or halves, and stays so for
//!   [`LOAD_SHIFT_PERIODS`], begins the waits again, since the winner may differ;
//! - below [`PROBE_FROM`] writing connections it is `writev`, without probes: with a few
//!   connections per executor thread, a reply that waits for its thread's park costs the thread
//!   a sleep and a wake-up per request, where `writev` sends while the next request is on its way
//!   (the rings: 0.73x of `writev`'s rps at 1 and 8 connections on 2 vCPUs). After such a period the connections write with
//!   `writev` until the load is back, then with the chosen writer again; the period is no
//!   baseline and the waits stand still. During a probe it counts as the probe's: a writer so
//!   slow that the clients stall waiting for its replies loses.
//!
//! Clients are bursty: a period may see half the connections of the one before it, or none
//! while the clients pause. Neither says anything about the writers, so neither shortens the
//! waits. (Before, one such period did, and a ring slow enough to stall the clients during its
//! probe was probed again every second or two, never judged.)
//!
//! Each verdict is logged with both writers' figures, counted
//! (`pageserver_page_service_io_probes_total{result}`), and its figures are kept as gauges
//! (`_io_replies_per_second{io}`, `_io_cpu_per_reply_seconds{io}`).
//!
//! A connection follows the choice at its next batch boundary ([`IoChoice::use_ring`]):
//! to the ring at once; back to `writev` only once the ring has sent all of its batches, so
//! its bytes never overtake each other. The period after each switch is left out of the
//! measurements, while connections move.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus::{GaugeVec, IntCounterVec, IntGauge};
use tokio_util::sync::CancellationToken;

use super::uring::Rings;
use super::PageServiceIo;
use crate::metrics::sharded::ShardedHistogram;
use crate::util::lock;

/// How often `auto` measures.
pub const PERIOD: Duration = Duration::from_millis(100);
/// `auto` probes the other writer only while at least this many connections write per period.
pub const PROBE_FROM: u64 = 32;
/// A probe must beat the current writer by this share (rps, or CPU per reply at equal rps).
pub const MARGIN: f64 = 0.05;
/// Load on the probed writer's side this long before the first probe.
pub const FIRST_PROBE: Duration = Duration::from_secs(1);
/// The load is the most connections that wrote in one of this many periods (a second).
pub const LOAD_PERIODS: usize = 10;
/// Periods in a row with twice (or half) that load that make it a new load.
pub const LOAD_SHIFT_PERIODS: u32 = 3;
/// The wait before the next probe grows this many times after a probe that did not win...
pub const BACKOFF: u32 = 4;
/// ... up to this.
pub const LAST_PROBE: Duration = Duration::from_secs(64);
/// Periods on the current writer that make the baseline a probe is judged against.
const BASELINE_PERIODS: usize = 3;
/// Periods a probe is measured over (after the one in which connections move).
const PROBE_PERIODS: u32 = 3;
/// A probe whose first measured period serves less than this share of the baseline's rate
/// has lost already.
const CLEAR_LOSS: f64 = 0.8;

/// A writer `auto` can choose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// Each connection's own vectored `write` (`epoll`).
    Writev,
    /// The io_uring writer (the ring of the connection's executor thread).
    Ring,
}

impl Via {
    fn other(self) -> Via {
        match self {
            Via::Writev => Via::Ring,
            Via::Ring => Via::Writev,
        }
    }

    /// The `io` label of the page service's metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Writev => PageServiceIo::Epoll.as_str(),
            Via::Ring => PageServiceIo::IoUring.as_str(),
        }
    }
}

/// What one period showed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sample {
    /// How long the period was.
    pub elapsed: Duration,
    /// Replies handed to the writers.
    pub replies: u64,
    /// CPU time the daemon spent (all of its threads).
    pub cpu: Duration,
    /// Connections that wrote.
    pub writing: u64,
}

/// Samples added up: a writer's rate over some periods.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Rate {
    elapsed: Duration,
    replies: u64,
    cpu: Duration,
}

impl Rate {
    fn add(&mut self, sample: &Sample) {
        self.elapsed += sample.elapsed;
        self.replies += sample.replies;
        self.cpu += sample.cpu;
    }

    /// Replies per second.
    pub fn replies_per_second(&self) -> f64 {
        self.replies as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The daemon's CPU seconds per reply.
    pub fn cpu_per_reply(&self) -> f64 {
        self.cpu.as_secs_f64() / self.replies.max(1) as f64
    }

    /// Whether `self` (the probe) beats `base`: more replies per second, or as many for less
    /// CPU each; never while it serves fewer.
    fn beats(&self, base: &Rate) -> bool {
        let (rps, base_rps) = (self.replies_per_second(), base.replies_per_second());
        if rps < base_rps * (1.0 - MARGIN) {
            return false;
        }
        rps > base_rps * (1.0 + MARGIN) || self.cpu_per_reply() < base.cpu_per_reply() * (1.0 - MARGIN)
    }
}

/// How a probe ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Verdict {
    /// The writer probed.
    pub probed: Via,
    /// It beat the writer before it, and stays.
    pub won: bool,
    /// The writer before the probe, over the periods just before it.
    pub before: Rate,
    /// The probed writer, over the probe.
    pub probe: Rate,
}

/// `auto`'s choice as a state machine: one [`Sample`] per period in, the writer for the next
/// period (and a probe's verdict when one ends) out. No clock and no I/O: the time is the
/// samples' `elapsed`.
#[derive(Debug)]
pub struct Chooser {
    via: Via,
    phase: Phase,
    /// Load this long since the last probe ended (or the load began).
    waited: Duration,
    /// How long to wait before the next probe.
    wait: Duration,
    /// Writing connections when the wait began; a load twice or half this (for
    /// [`LOAD_SHIFT_PERIODS`]) begins it again. 0: no load yet.
    load: u64,
    /// Periods in a row whose [`Chooser::busiest`] was twice or half `load`.
    shifted: u32,
    /// The writers of the last [`LOAD_PERIODS`] periods.
    writers: VecDeque<u64>,
    /// Fewer than [`PROBE_FROM`] connections wrote in the last period (outside a probe).
    paused: bool,
}

#[derive(Debug)]
enum Phase {
    /// On the chosen writer: its newest periods (at most [`BASELINE_PERIODS`]), after
    /// `settling` more periods in which connections move.
    Settled { recent: VecDeque<Sample>, settling: u32 },
    /// Trying `via` against `before`, the writer it replaced, whose `baseline` it must beat.
    Probing { before: Via, baseline: Rate, settling: u32, measured: Rate, periods: u32 },
}

impl Phase {
    fn settling() -> Phase {
        Phase::Settled { recent: VecDeque::with_capacity(BASELINE_PERIODS), settling: 1 }
    }
}

impl Default for Chooser {
    fn default() -> Self {
        Chooser {
            via: Via::Writev,
            phase: Phase::Settled { recent: VecDeque::new(), settling: 0 },
            waited: Duration::ZERO,
            wait: FIRST_PROBE,
            load: 0,
            shifted: 0,
            writers: VecDeque::with_capacity(LOAD_PERIODS),
            paused: false,
        }
    }
}

impl Chooser {
    /// The writer for the next period: the chosen one, or `writev` after a period in which
    /// fewer than [`PROBE_FROM`] connections wrote.
    pub fn via(&self) -> Via {
        if self.paused {
            Via::Writev
        } else {
            self.via
        }
    }

    /// Adds a period's writers; the most that wrote in one of the last [`LOAD_PERIODS`]
    /// periods: the load, as bursty clients (and a probe that slows them) do not move it.
    fn busiest(&mut self, writing: u64) -> u64 {
        if self.writers.len() == LOAD_PERIODS {
            self.writers.pop_front();
        }
        self.writers.push_back(writing);
        self.writers.iter().copied().max().unwrap_or(0)
    }

    /// Ends a period: returns the verdict of a probe that ended with it. [`Chooser::via`] is
    /// the writer for the next period.
    pub fn period(&mut self, sample: Sample) -> Option<Verdict> {
        let busiest = self.busiest(sample.writing);
        if let Phase::Settled { recent, .. } = &mut self.phase {
            if sample.writing < PROBE_FROM {
                // Too few writers for the ring, or the clients paused: writev until the load is
                // back ([`Chooser::via`]); no baseline, and the waits stand still.
                recent.clear();
                self.paused = true;
                return None;
            }
        }
        if self.load != 0 && (busiest > 2 * self.load || 2 * busiest < self.load) {
            self.shifted += 1;
        } else {
            self.shifted = 0;
        }
        if self.load == 0 || self.shifted >= LOAD_SHIFT_PERIODS {
            tracing::debug!(
                writing_connections = busiest,
                was = self.load,
                "page service replies: a new load"
            );
            self.load = busiest;
            self.shifted = 0;
            self.waited = Duration::ZERO;
            self.wait = FIRST_PROBE;
        }
        if std::mem::take(&mut self.paused) && self.via != Via::Writev {
            // This period was on writev; in the next the connections move to the chosen writer
            // again.
            self.phase = Phase::settling();
            return None;
        }
        match &mut self.phase {
            Phase::Settled { settling, .. } if *settling > 0 => {
                *settling -= 1;
                None
            }
            Phase::Settled { recent, .. } => {
                if recent.len() == BASELINE_PERIODS {
                    recent.pop_front();
                }
                recent.push_back(sample);
                self.waited += sample.elapsed;
                if self.waited >= self.wait && recent.len() == BASELINE_PERIODS {
                    let mut baseline = Rate::default();
                    recent.iter().for_each(|s| baseline.add(s));
                    let before = self.via;
                    self.via = before.other();
                    self.phase = Phase::Probing {
                        before,
                        baseline,
                        settling: 1,
                        measured: Rate::default(),
                        periods: 0,
                    };
                }
                None
            }
            Phase::Probing { settling, .. } if *settling > 0 => {
                *settling -= 1;
                None
            }
            Phase::Probing { before, baseline, measured, periods, .. } => {
                measured.add(&sample);
                *periods += 1;
                let clear_loss = *periods == 1
                    && measured.replies_per_second() < baseline.replies_per_second() * CLEAR_LOSS;
                if !clear_loss && *periods < PROBE_PERIODS {
                    return None;
                }
                let verdict = Verdict {
                    probed: self.via,
                    won: !clear_loss && measured.beats(baseline),
                    before: *baseline,
                    probe: *measured,
                };
                if !verdict.won {
                    self.via = *before;
                    self.wait = (self.wait * BACKOFF).min(LAST_PROBE);
                }
                self.waited = Duration::ZERO;
                self.phase = Phase::settling();
                Some(verdict)
            }
        }
    }
}

/// The page service's writers and the choice between them; shared by every connection.
pub struct IoChoice {
    /// What the setting asked for.
    mode: PageServiceIo,
    /// The io_uring writers, when the kernel allows a ring and the mode may use them.
    rings: Option<Rings>,
    /// Batches go through the ring (`auto`: the chooser's latest choice).
    ring_now: AtomicBool,
    /// Counts periods; a connection remembers the last one it was counted in.
    period: AtomicU64,
    /// Connections that wrote in the current period.
    writing: AtomicU64,
    /// `auto`'s choice.
    chooser: Mutex<Chooser>,
    metrics: ChoiceMetrics,
}

/// The metrics of `auto`'s choice.
#[derive(Clone)]
pub struct ChoiceMetrics {
    /// Connections that wrote during the last period.
    pub writing_connections: IntGauge,
    /// 1 while batches go through the io_uring writer.
    pub ring_chosen: IntGauge,
    /// Replies per batch handed to a writer: its sum counts the replies.
    pub replies: ShardedHistogram,
    /// Probes, by `result` (`won`, `lost`).
    pub probes: IntCounterVec,
    /// Each writer's figures as last measured (by `io`).
    pub replies_per_second: GaugeVec,
    pub cpu_per_reply: GaugeVec,
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
    pub fn new(mode: PageServiceIo, rings: Option<Rings>, metrics: ChoiceMetrics) -> IoChoice {
        let rings = if mode == PageServiceIo::Epoll { None } else { rings };
        let ring_now = mode == PageServiceIo::IoUring && rings.is_some();
        metrics.ring_chosen.set(i64::from(ring_now));
        IoChoice {
            mode,
            rings,
            ring_now: AtomicBool::new(ring_now),
            period: AtomicU64::new(1),
            writing: AtomicU64::new(0),
            chooser: Mutex::new(Chooser::default()),
            metrics,
        }
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

    /// `auto`: measures every [`PERIOD`] and switches writers as the [`Chooser`] says, until
    /// `cancel`. Returns at once in the other modes (or without rings).
    pub async fn run(self: Arc<Self>, cancel: CancellationToken) {
        if self.mode != PageServiceIo::Auto || self.rings.is_none() {
            return;
        }
        let mut ticks = tokio::time::interval(PERIOD);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (mut last, mut last_cpu, mut last_replies) =
            (Instant::now(), process_cpu(), self.metrics.replies.get_sample_sum());
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let (now, cpu, replies) = (Instant::now(), process_cpu(), self.metrics.replies.get_sample_sum());
            self.observe(Sample {
                elapsed: now.duration_since(last),
                replies: (replies - last_replies).max(0.0) as u64,
                cpu: cpu.saturating_sub(last_cpu),
                writing: 0,
            });
            (last, last_cpu, last_replies) = (now, cpu, replies);
        }
    }

    /// Ends a period (its `writing` is counted here): feeds the chooser and applies its choice.
    fn observe(&self, mut sample: Sample) {
        sample.writing = self.writing.swap(0, Ordering::Relaxed);
        self.period.fetch_add(1, Ordering::Relaxed);
        let mut chooser = lock(&self.chooser);
        let verdict = chooser.period(sample);
        // A failed ring is never chosen.
        let ring = chooser.via() == Via::Ring && !self.ring_failed();
        drop(chooser);
        self.metrics.writing_connections.set(i64::try_from(sample.writing).unwrap_or(i64::MAX));
        if let Some(verdict) = verdict {
            self.report(&verdict, sample.writing);
        }
        if self.ring_now.swap(ring, Ordering::Relaxed) != ring {
            self.metrics.ring_chosen.set(i64::from(ring));
            if verdict.is_some() {
                // Said by the verdict's line.
            } else if sample.writing < PROBE_FROM {
                tracing::info!(
                    writing_connections = sample.writing,
                    "page service replies: writev per connection (fewer than {PROBE_FROM} \
                     connections write)"
                );
            } else {
                tracing::debug!(
                    writing_connections = sample.writing,
                    "page service replies: probing {}",
                    if ring { Via::Ring } else { Via::Writev }.as_str()
                );
            }
        }
    }

    /// Logs and counts a probe's verdict, and keeps both writers' figures.
    fn report(&self, verdict: &Verdict, writing: u64) {
        let before = verdict.probed.other();
        for (via, rate) in [(before, &verdict.before), (verdict.probed, &verdict.probe)] {
            let io = [via.as_str()];
            self.metrics.replies_per_second.with_label_values(&io).set(rate.replies_per_second());
            self.metrics.cpu_per_reply.with_label_values(&io).set(rate.cpu_per_reply());
        }
        let result = if verdict.won { "won" } else { "lost" };
        self.metrics.probes.with_label_values(&[result]).inc();
        let kept = if verdict.won { verdict.probed } else { before };
        tracing::info!(
            writing_connections = writing,
            "page service replies: {} {result} a probe ({:.0} replies/s at {:.1} us of CPU each, \
             against {:.0} at {:.1} us with {}): {} it is",
            verdict.probed.as_str(),
            verdict.probe.replies_per_second(),
            verdict.probe.cpu_per_reply() * 1e6,
            verdict.before.replies_per_second(),
            verdict.before.cpu_per_reply() * 1e6,
            before.as_str(),
            kept.as_str(),
        );
    }
}

/// The daemon's CPU time so far (user and system, all threads); zero if it cannot be read.
fn process_cpu() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    match getrusage(UsageWho::RUSAGE_SELF) {
        Ok(usage) => {
            let micros = |t: nix::sys::time::TimeVal| {
                Duration::from_secs(t.tv_sec().max(0) as u64)
                    + Duration::from_micros(t.tv_usec().max(0) as u64)
            };
            micros(usage.user_time()) + micros(usage.system_time())
        }
        Err(_) => Duration::ZERO,
    }
}

#[cfg(test)]
mod tests;
