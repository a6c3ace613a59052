//! `pagebench get-page`: one connection's load, a sender task and a receiver task over the split
//! client (the method is in get_page.rs). The sender sends in the closed loop (whenever a slot is
//! free) or the open loop (on the schedule of rate.rs, whatever the replies); the receiver reads
//! the replies in order, checks and times them, and gives each slot back. What a request asks
//! ([`RequestKind`], [`LsnMode`]) and of which tenant ([`TenantLoad`]) is defined here, below
//! get_page.rs, whose flags choose it.
//!
//! Invariant: the writer outlives the replies: the daemon never sees EOF while replies are owed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::{describe, Client, ClientReader, ClientWriter};
use anyhow::{bail, Context};
use bytes::Bytes;
use hdrhistogram::Histogram;
use page_types::keys::RelTag;
use page_types::{BufferTag, Lsn};
use pageserver::page_service::proto::{ClientMessage, ServerMessage, LSN_LATEST};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::dataset::{Shape, SplitMix64};
use crate::keyspace::KeySpace;
use crate::rate::Schedule;
use crate::report::{self, Counters, IntervalLatency};

/// Error messages printed in full; later ones are only counted.
const PRINTED_ERRORS: usize = 5;
/// In the open loop, a request sent at most this long after its due time is on time: the timer
/// that wakes the sender ticks in milliseconds. Latency counts from the send or from this long
/// after the due time, whichever is earlier; a later send counts as `late`.
const ON_TIME: Duration = Duration::from_millis(1);
/// In the open loop, the sender wakes this long before a request is due and sends what is due
/// within it: tokio's timer rounds a deadline up to its next millisecond tick, and the poll
/// timeout up again, so waiting for the exact time would send many requests 1 to 2 ms late.
/// A request thus goes out between 1 ms early and about 1 ms late.
const TIMER_LEAD: Duration = Duration::from_millis(1);

/// What each request asks.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    /// GetPage of a page of the key space.
    Page,
    /// GetRelSize of the relation fork of a page of the key space (a tenant that follows
    /// PostgreSQL; elsewhere every request is `not_found`).
    RelSize,
    /// GetRelExists of the relation fork of a page of the key space.
    RelExists,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LsnMode {
    /// The daemon's latest durable LSN.
    Latest,
    /// Uniform among the LSNs at which every page exists (after all images).
    Random,
}

/// One tenant's part of the run.
pub struct TenantLoad {
    pub id: String,
    pub keyspace: KeySpace,
}

/// What the tasks of every connection share.
pub struct Shared {
    /// With `--verify`: the data set every page is checked against.
    pub verify: Option<Shape>,
    pub lsn: LsnMode,
    pub request: RequestKind,
    pub timeout: Duration,
    pub depth: usize,
    pub counters: Arc<Counters>,
    pub printed_errors: AtomicUsize,
    /// Latencies of the current second, for the progress line and `--series`.
    pub interval: Arc<IntervalLatency>,
    /// Open loop: requests sent more than [`ON_TIME`] after their due time.
    pub late: AtomicU64,
}

impl Shared {
    /// Counts an error under `kind`; prints the first few.
    pub fn error(&self, stats: &mut ConnStats, kind: &str, count: u64, message: impl FnOnce() -> String) {
        self.counters.errors.fetch_add(count, Ordering::Relaxed);
        self.counters.done.fetch_add(count, Ordering::Relaxed);
        stats.errors += count;
        *stats.error_kinds.entry(kind.to_string()).or_default() += count;
        if self.printed_errors.fetch_add(1, Ordering::Relaxed) < PRINTED_ERRORS {
            errln!("get-page: error ({kind}): {}", message());
        } else if self.printed_errors.load(Ordering::Relaxed) == PRINTED_ERRORS + 1 {
            errln!("get-page: further errors are only counted");
        }
    }
}

/// A request written and not yet answered.
struct InFlight {
    request_id: u64,
    key: BufferTag,
    pub lsn: u64,
    /// Where its latency counts from: the send (closed loop), or in the open loop the send but
    /// at most [`ON_TIME`] after the due time.
    start: Instant,
}

/// What one connection measured.
pub struct ConnStats {
    pub latency: Histogram<u64>,
    pub requests: u64,
    pub errors: u64,
    pub error_kinds: BTreeMap<String, u64>,
}

impl ConnStats {
    fn new() -> Self {
        ConnStats {
            latency: report::latency_histogram(),
            requests: 0,
            errors: 0,
            error_kinds: BTreeMap::new(),
        }
    }
}

/// When a connection's sender sends.
pub enum Pace {
    /// Whenever a slot is free, until the deadline.
    Closed { deadline: Instant },
    /// Requests `first`, `first + stride`, ... of the schedule, each at its due time from
    /// `start` (once a slot is free), until the schedule is over.
    Open { schedule: Arc<Schedule>, start: Instant, first: u64, stride: u64 },
}

pub async fn run_connection(
    client: Client,
    tenant: Arc<TenantLoad>,
    index: usize,
    rng: SplitMix64,
    shared: Arc<Shared>,
    pace: Pace,
    cancel: CancellationToken,
) -> ConnStats {
    let (reader, writer) = client.into_split();
    let permits = Arc::new(Semaphore::new(shared.depth));
    let (in_flight_tx, in_flight_rx) = mpsc::channel::<InFlight>(shared.depth);
    // Cancelled by Ctrl-C, or by the receiver when the connection breaks.
    let stop = cancel.child_token();
    let sender = Sender {
        writer,
        in_flight_tx,
        permits: permits.clone(),
        shared: shared.clone(),
        tenant: tenant.clone(),
        rng,
        request_id: 0,
        stop: stop.clone(),
        error: None,
    };
    let sender = tokio::spawn(sender.run(pace));
    let mut stats = receive(reader, in_flight_rx, permits, &shared, stop).await;
    // The writer is dropped only now: the daemon never sees EOF while replies are owed.
    let (_writer, failed_write) = match sender.await {
        Ok((writer, error)) => (Some(writer), error),
        Err(e) => (None, Some(anyhow::Error::new(e).context("run the sender task"))),
    };
    if let Some(e) = failed_write {
        shared.error(&mut stats, "connection", 0, || {
            format!("connection {index} (tenant {}): failed to {e:#}", tenant.id)
        });
    }
    stats
}

/// The sending half of a connection.
struct Sender {
    writer: ClientWriter<OwnedWriteHalf>,
    in_flight_tx: mpsc::Sender<InFlight>,
    /// One per slot of `--depth`; taken by a send, given back by the receiver with the reply.
    permits: Arc<Semaphore>,
    shared: Arc<Shared>,
    tenant: Arc<TenantLoad>,
    rng: SplitMix64,
    request_id: u64,
    stop: CancellationToken,
    /// Why a write failed, for the receiver's side to count.
    error: Option<anyhow::Error>,
}

impl Sender {
    /// Sends until the pace says to stop, `stop`, or a failed write (which cancels `stop`).
    /// Gives back the writer, so that it outlives the replies, and why a write failed; drops
    /// the rest (closing the in-flight channel ends the receiver once it has read every reply).
    async fn run(mut self, pace: Pace) -> (ClientWriter<OwnedWriteHalf>, Option<anyhow::Error>) {
        match pace {
            Pace::Closed { deadline } => self.closed_loop(deadline).await,
            Pace::Open { schedule, start, first, stride } => {
                self.open_loop(&schedule, start, first, stride).await
            }
        }
        let Sender { writer, error, .. } = self;
        (writer, error)
    }

    async fn closed_loop(&mut self, deadline: Instant) {
        let deadline = tokio::time::Instant::from_std(deadline);
        loop {
            let permit = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => return,
                permit = self.permits.acquire() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
            permit.forget();
            let mut slots = 1;
            while slots < self.shared.depth && self.take_free_slot() {
                slots += 1;
            }
            let start = Instant::now();
            for _ in 0..slots {
                if !self.push(start).await {
                    return;
                }
            }
            if !self.flush().await {
                return;
            }
        }
    }

    /// Sends each request of the schedule at its due time, whatever the replies: a request
    /// that finds no free slot waits for one, and every other request already due (within
    /// [`TIMER_LEAD`]) goes into the same write.
    async fn open_loop(&mut self, schedule: &Schedule, start: Instant, first: u64, stride: u64) {
        let mut next = first;
        while let Some(offset) = schedule.send_time(next) {
            let due = start + offset;
            let wake = due.checked_sub(TIMER_LEAD).unwrap_or(due);
            if Instant::now() < wake {
                tokio::select! {
                    biased;
                    _ = self.stop.cancelled() => return,
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(wake)) => {}
                }
            }
            if !self.take_free_slot() {
                tokio::select! {
                    biased;
                    _ = self.stop.cancelled() => return,
                    permit = self.permits.acquire() => match permit {
                        Ok(permit) => permit.forget(),
                        Err(_) => return,
                    },
                }
            }
            let now = Instant::now();
            let mut due = Some(due);
            while let Some(at) = due {
                if !self.push(self.latency_start(at, now)).await {
                    return;
                }
                next = next.saturating_add(stride);
                due = schedule
                    .send_time(next)
                    .map(|offset| start + offset)
                    .filter(|&at| at <= now + TIMER_LEAD && self.take_free_slot());
            }
            if !self.flush().await {
                return;
            }
        }
    }

    /// Where the latency of a request due at `due` and sent at `now` counts from; counts it
    /// as late if it is.
    fn latency_start(&self, due: Instant, now: Instant) -> Instant {
        let (start, late) = latency_start(due, now);
        if late {
            self.shared.late.fetch_add(1, Ordering::Relaxed);
        }
        start
    }

    fn take_free_slot(&self) -> bool {
        match self.permits.try_acquire() {
            Ok(permit) => {
                permit.forget();
                true
            }
            Err(_) => false,
        }
    }

    /// Encodes one GetPage for a slot already taken; false once the receiver has stopped.
    async fn push(&mut self, start: Instant) -> bool {
        let keyspace = &self.tenant.keyspace;
        self.request_id += 1;
        let request_id = self.request_id;
        let key = keyspace.key(self.rng.below(keyspace.keys));
        let lsn = match self.shared.lsn {
            LsnMode::Latest => LSN_LATEST,
            LsnMode::Random => {
                let (low, high) =
                    (keyspace.all_keys_from, keyspace.last_durable_lsn.max(keyspace.all_keys_from));
                low + self.rng.below(high - low + 1)
            }
        };
        let rel = RelTag::of(&key);
        let fork = key.forknum;
        self.writer.send(&match self.shared.request {
            RequestKind::Page => ClientMessage::GetPage { request_id, key, lsn },
            RequestKind::RelSize => ClientMessage::GetRelSize { request_id, rel, fork, lsn },
            RequestKind::RelExists => ClientMessage::GetRelExists { request_id, rel, fork, lsn },
        });
        // Never waits: at most `depth` requests exist, and the channel holds `depth`.
        self.in_flight_tx.send(InFlight { request_id, key, lsn, start }).await.is_ok()
    }

    /// Writes what was encoded; false (and `stop` cancelled on a failed write) to stop sending.
    async fn flush(&mut self) -> bool {
        tokio::select! {
            biased;
            flushed = self.writer.flush() => match flushed {
                Ok(()) => true,
                Err(e) => {
                    self.error = Some(e);
                    self.stop.cancel();
                    false
                }
            },
            _ = self.stop.cancelled() => false,
        }
    }
}

/// Open loop: the latency of a request due at `due` and sent at `sent` counts from the send,
/// but from no later than [`ON_TIME`] after the due time, so that a server that holds every
/// slot is charged for the wait it causes (no coordinated omission) while the timer's own
/// millisecond is not; `true` if the request is late (sent more than `ON_TIME` after `due`).
fn latency_start(due: Instant, sent: Instant) -> (Instant, bool) {
    let limit = due + ON_TIME;
    if sent > limit {
        (limit, true)
    } else {
        (sent, false)
    }
}

async fn receive(
    mut reader: ClientReader<OwnedReadHalf>,
    mut in_flight_rx: mpsc::Receiver<InFlight>,
    permits: Arc<Semaphore>,
    shared: &Shared,
    stop: CancellationToken,
) -> ConnStats {
    let mut stats = ConnStats::new();
    while let Some(request) = in_flight_rx.recv().await {
        let reply = tokio::time::timeout(shared.timeout, reader.recv()).await;
        let latency = request.start.elapsed();
        let broken = match reply {
            Err(_) => Some(format!("no reply to request {} within {:?}", request.request_id, shared.timeout)),
            Ok(Err(e)) => Some(format!("failed to {e:#}")),
            Ok(Ok(ServerMessage::Page { request_id, lsn, page })) if request_id == request.request_id => {
                let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX).max(1);
                stats.latency.saturating_record(micros);
                shared.interval.record(micros);
                match verify(shared, &request, lsn, &page) {
                    Ok(()) => {
                        stats.requests += 1;
                        shared.counters.done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => shared.error(&mut stats, "verify", 1, || format!("{e:#}")),
                }
                None
            }
            Ok(Ok(
                ServerMessage::RelSize { request_id, .. } | ServerMessage::RelExists { request_id, .. },
            )) if request_id == request.request_id && shared.request != RequestKind::Page => {
                let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX).max(1);
                stats.latency.saturating_record(micros);
                shared.interval.record(micros);
                stats.requests += 1;
                shared.counters.done.fetch_add(1, Ordering::Relaxed);
                None
            }
            Ok(Ok(ServerMessage::Error { request_id, code, message }))
                if request_id == request.request_id =>
            {
                shared.error(&mut stats, code.name(), 1, || {
                    format!("request {request_id} for {} at LSN {}: {message}", request.key, Lsn(request.lsn))
                });
                code.closes_connection()
                    .then(|| format!("the daemon closed the connection after {}", code.name()))
            }
            Ok(Ok(other)) => Some(format!(
                "expected the reply to request {}, got {}",
                request.request_id,
                describe(&other)
            )),
        };
        if let Some(reason) = broken {
            stop.cancel();
            in_flight_rx.close();
            // This request and every later one of the connection are lost.
            let mut lost = 1;
            while in_flight_rx.try_recv().is_ok() {
                lost += 1;
            }
            shared.error(&mut stats, "connection", lost, || format!("{reason} ({lost} requests lost)"));
            break;
        }
        permits.add_permits(1);
    }
    stats
}

/// With `--verify`: the LSN served and the page must match the data set.
fn verify(shared: &Shared, request: &InFlight, served_lsn: u64, page: &Bytes) -> anyhow::Result<()> {
    let Some(shape) = &shared.verify else {
        return Ok(());
    };
    if request.lsn != LSN_LATEST && served_lsn != request.lsn {
        bail!(
            "request {}: asked for LSN {}, served {}",
            request.request_id,
            Lsn(request.lsn),
            Lsn(served_lsn)
        );
    }
    let index = shape.page_of_key(&request.key).with_context(|| {
        format!("request {}: page {} is not in the data set", request.request_id, request.key)
    })?;
    let expected = shape
        .expected_page(index, served_lsn)?
        .with_context(|| format!("page {} does not exist at LSN {}", request.key, Lsn(served_lsn)))?;
    if page[..] != expected[..] {
        let first = page.iter().zip(expected.iter()).position(|(a, b)| a != b).unwrap_or(0);
        bail!(
            "request {}: page {} at LSN {} differs from the expected page from byte {first}",
            request.request_id,
            request.key,
            Lsn(served_lsn)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_counts_from_the_send_unless_it_is_more_than_on_time_late() {
        let due = Instant::now();
        let early = due + Duration::from_micros(300);
        assert_eq!(latency_start(due, early), (early, false));
        assert_eq!(latency_start(due, due + ON_TIME), (due + ON_TIME, false));
        // a request that waited 50 ms for a slot is charged from its due time (+ ON_TIME)
        assert_eq!(latency_start(due, due + Duration::from_millis(50)), (due + ON_TIME, true));
    }
}
