//! The page service: the TCP data path (docs/page-service-protocol.md).
//!
//! - [`proto`]: frames and messages (pure);
//! - [`connection`]: one connection: reading, dispatch to the tenant, wire <-> domain
//!   conversions and error codes;
//! - [`reply_order`]: which replies go out in the next write (a pure policy);
//! - [`writer`]: the reply path: replies as shared bytes, their queue in request order (with
//!   the requests still running), the writers;
//! - `chunks`: a batch's chunks and how a partial send consumes them (under both writers);
//! - [`uring`]: the io_uring writer (a ring per executor thread);
//! - [`io_choice`]: which writer sends a batch (`page_service_io`; `auto` by load);
//! - this file: accepting connections, the bounds, the metrics.
//!
//! Invariants:
//! - `pageserver_page_service_connections` never reads below the `max_connections` slots in
//!   use: a [`ConnectionSlot`] is counted before it is taken and until after it is freed;
//! - replies leave in the order the requests came, whatever order they finish in;
//! - ingest batches of one connection reach storage in the order sent (they are queued by the
//!   reader itself before the next frame is read);
//! - every bound is explicit: connections (`max_connections`), requests in flight per
//!   connection ([`MAX_IN_FLIGHT`]), frame size ([`proto::MAX_FRAME_LEN`]), replies per write;
//! - a bad frame gets an error reply and closes its own connection, nothing else.

mod chunks;
/// The pagebench client (`src/bin/pagebench/client.rs`), for this module's tests.
#[cfg(test)]
#[path = "../bin/pagebench/client.rs"]
mod client;
mod connection;
pub mod io_choice;
pub mod proto;
mod reply_order;
#[cfg(test)]
mod serve_tests;
pub mod uring;
mod writer;

use std::sync::Arc;
use std::time::Duration;

use prometheus::{GaugeVec, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::metrics::sharded::{ShardedCounter, ShardedHistogram};
use crate::tenants::Tenants;
use crate::util::Signal;
use connection::{handle_connection, refuse_now, ConnectionConf};
use proto::ErrorCode;

/// Requests a connection may have in flight; the reader stops reading beyond that.
pub const MAX_IN_FLIGHT: usize = 256;
/// Most replies gathered into one write.
pub(crate) const MAX_REPLIES_PER_WRITE: usize = 64;
/// How long a new connection may take to send its Hello.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// Default of `page_service_idle_timeout`.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Default of `max_connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1000;
/// `max_connections` lies in `1..=MAX_MAX_CONNECTIONS`.
pub const MAX_MAX_CONNECTIONS: usize = 100_000;

/// The page service's settings (docs/settings.md); [`PageServiceConf`] is what the server
/// makes of them at start (the connection bound lowered to the descriptor limit, the writers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageServiceSettings {
    /// `max_connections`.
    pub max_connections: usize,
    /// `page_service_idle_timeout`.
    pub idle_timeout: Duration,
    /// `page_service_io`: how replies are written (the io_uring writer falls back to `epoll`
    /// when the kernel refuses a ring).
    pub io: PageServiceIo,
}

impl Default for PageServiceSettings {
    fn default() -> Self {
        PageServiceSettings {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            io: PageServiceIo::default(),
        }
    }
}

/// How the page service writes replies (`page_service_io`; docs/settings.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PageServiceIo {
    /// `epoll`, and `io_uring` while it measures better ([`io_choice`]); `epoll`
    /// when the kernel refuses a ring.
    #[default]
    Auto,
    /// Each connection writes its own replies with a vectored `write` when tokio's epoll says
    /// the socket has room.
    Epoll,
    /// Connections hand their reply batches to the io_uring ring of their executor thread, which
    /// sends the batches of that thread's connections with one submit when the thread runs out
    /// of work ([`uring`]); `epoll` when the kernel refuses a ring.
    IoUring,
}

impl PageServiceIo {
    pub fn as_str(self) -> &'static str {
        match self {
            PageServiceIo::Auto => "auto",
            PageServiceIo::Epoll => "epoll",
            PageServiceIo::IoUring => "io_uring",
        }
    }
}

/// How the page service runs.
#[derive(Debug, Clone)]
pub struct PageServiceConf {
    /// Connections at once; more are refused with `too_many_connections`.
    pub max_connections: usize,
    /// A connection with nothing in flight that sends nothing this long is closed
    /// (`idle_timeout`); a client that accepts no reply bytes this long is disconnected.
    pub idle_timeout: Duration,
    /// Cancelled when shutdown's grace is over: every connection is dropped at once, whatever
    /// it was writing (a client that never reads cannot hold up shutdown).
    pub abort: CancellationToken,
    /// Which writer sends each batch of replies (with the io_uring writers, if any).
    pub io: Arc<io_choice::IoChoice>,
}

pub struct PageServiceMetrics {
    connections: IntGauge,
    errors: IntCounterVec,
    get_page_seconds: ShardedHistogram,
    replies_per_write: ShardedHistogram,
    /// `requests{type="get_page"}`, in shards (every thread serving GetPage counts it), and
    /// `{type="ingest"}`, resolved once (a label lookup per request costs a hash).
    get_page_requests: ShardedCounter,
    ingest_requests: IntCounter,
    /// `{type="rel"}`: GetRelSize and GetRelExists.
    rel_requests: IntCounter,
    /// How replies left, per writer (`io` label resolved once).
    epoll_io: IoCounters,
    uring_io: IoCounters,
    /// Replies of the batches handed to a ring between two of its submits.
    replies_per_submit: ShardedHistogram,
    /// io_uring sends that found the socket full and waited for room.
    send_waits: IntCounter,
    /// `SENDMSG_ZC` operations, and those whose bytes the kernel copied after all.
    zero_copy_sends: IntCounter,
    zero_copy_copied: IntCounter,
    /// 1 once an io_uring writer failed (its thread is gone): batches go through `writev`.
    uring_failed: IntGauge,
    /// `auto`'s input and choice.
    pub choice: io_choice::ChoiceMetrics,
}

impl PageServiceMetrics {
    pub fn new(registry: &Registry) -> anyhow::Result<PageServiceMetrics> {
        let connections = IntGauge::new(
            "pageserver_page_service_connections",
            "Page service connections holding a slot of max_connections (one whose last replies an \
             io_uring writer still sends counts until they are sent)",
        )?;
        // One counter per type (GetPage's in shards), each with a constant `type` label: one
        // family cannot mix constant and variable labels.
        let requests = Opts::new("pageserver_page_service_requests_total", "Page service requests by type");
        let request_counter = |kind: &str| -> anyhow::Result<IntCounter> {
            let c = IntCounter::with_opts(requests.clone().const_label("type", kind))?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let errors = IntCounterVec::new(
            Opts::new("pageserver_page_service_errors_total", "Page service error replies by code"),
            &["code"],
        )?;
        let get_page_seconds = ShardedHistogram::new(
            HistogramOpts::new(
                "pageserver_page_service_get_page_seconds",
                "GetPage time, request read to reply ready",
            )
            .buckets(prometheus::exponential_buckets(5e-6, 2.0, 22)?),
        )?;
        let replies_per_write = ShardedHistogram::new(
            HistogramOpts::new(
                "pageserver_page_service_replies_per_write",
                "Replies gathered into one socket write",
            )
            .buckets(prometheus::exponential_buckets(1.0, 2.0, 7)?),
        )?;
        // One counter per writer and name, in shards (each family is one in a scrape).
        let by_io = |(name, help): (&str, &str), io: PageServiceIo| -> anyhow::Result<ShardedCounter> {
            let counter = ShardedCounter::new(Opts::new(name, help).const_label("io", io.as_str()))?;
            registry.register(Box::new(counter.clone()))?;
            Ok(counter)
        };
        let send_syscalls = (
            "pageserver_page_service_send_syscalls_total",
            "Syscalls that sent replies: writev (io=epoll); io_uring_enter, and the eventfd writes that wake the ring (io=io_uring)",
        );
        let sends = (
            "pageserver_page_service_sends_total",
            "Reply send operations: writev calls (io=epoll), SENDMSG operations (io=io_uring)",
        );
        let sent_bytes = ("pageserver_page_service_sent_bytes_total", "Reply bytes sent");
        let io = |io: PageServiceIo| -> anyhow::Result<IoCounters> {
            Ok(IoCounters {
                send_syscalls: by_io(send_syscalls, io)?,
                sends: by_io(sends, io)?,
                sent_bytes: by_io(sent_bytes, io)?,
            })
        };
        let (epoll_io, uring_io) = (io(PageServiceIo::Epoll)?, io(PageServiceIo::IoUring)?);
        let get_page_requests = ShardedCounter::new(requests.clone().const_label("type", "get_page"))?;
        registry.register(Box::new(get_page_requests.clone()))?;
        let replies_per_submit = ShardedHistogram::new(
            HistogramOpts::new(
                "pageserver_page_service_replies_per_submit",
                "Replies handed to an io_uring writer between two of its submits",
            )
            .buckets(prometheus::exponential_buckets(1.0, 2.0, 11)?),
        )?;
        let send_waits = IntCounter::new(
            "pageserver_page_service_send_waits_total",
            "io_uring sends that found the socket full and waited for room",
        )?;
        let zero_copy_sends = IntCounter::new(
            "pageserver_page_service_zero_copy_sends_total",
            "io_uring sends that went zero-copy (SENDMSG_ZC)",
        )?;
        let zero_copy_copied = IntCounter::new(
            "pageserver_page_service_zero_copy_copied_total",
            "Zero-copy sends whose bytes the kernel copied after all (loopback, devices that cannot \
             send from user pages), as IORING_SEND_ZC_REPORT_USAGE reports",
        )?;
        let uring_failed = IntGauge::new(
            "pageserver_page_service_io_uring_failed",
            "1 once the io_uring writer failed (a ring error): reply batches go through writev \
             until the daemon restarts",
        )?;
        let choice = io_choice::ChoiceMetrics {
            writing_connections: IntGauge::new(
                "pageserver_page_service_writing_connections",
                "Connections that wrote replies during the last 100 ms (page_service_io = \"auto\" only)",
            )?,
            ring_chosen: IntGauge::new(
                "pageserver_page_service_io_uring_chosen",
                "1 while reply batches go through the io_uring writer, else 0",
            )?,
            replies: replies_per_write.clone(),
            probes: IntCounterVec::new(
                Opts::new(
                    "pageserver_page_service_io_probes_total",
                    "Probes of the other writer by page_service_io = \"auto\", by result (won: kept)",
                ),
                &["result"],
            )?,
            replies_per_second: GaugeVec::new(
                Opts::new(
                    "pageserver_page_service_io_replies_per_second",
                    "Replies per second of each writer as auto's last probe measured it",
                ),
                &["io"],
            )?,
            cpu_per_reply: GaugeVec::new(
                Opts::new(
                    "pageserver_page_service_io_cpu_per_reply_seconds",
                    "The daemon's CPU seconds per reply with each writer as auto's last probe measured it",
                ),
                &["io"],
            )?,
        };
        registry.register(Box::new(choice.probes.clone()))?;
        registry.register(Box::new(choice.replies_per_second.clone()))?;
        registry.register(Box::new(choice.cpu_per_reply.clone()))?;
        registry.register(Box::new(choice.writing_connections.clone()))?;
        registry.register(Box::new(choice.ring_chosen.clone()))?;
        registry.register(Box::new(zero_copy_sends.clone()))?;
        registry.register(Box::new(zero_copy_copied.clone()))?;
        registry.register(Box::new(uring_failed.clone()))?;
        registry.register(Box::new(connections.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(get_page_seconds.clone()))?;
        registry.register(Box::new(replies_per_write.clone()))?;
        registry.register(Box::new(replies_per_submit.clone()))?;
        registry.register(Box::new(send_waits.clone()))?;
        Ok(PageServiceMetrics {
            connections,
            get_page_requests,
            ingest_requests: request_counter("ingest")?,
            rel_requests: request_counter("rel")?,
            errors,
            get_page_seconds,
            replies_per_write,
            epoll_io,
            uring_io,
            replies_per_submit,
            send_waits,
            zero_copy_sends,
            zero_copy_copied,
            uring_failed,
            choice,
        })
    }
}

/// The send counters of one writer: `pageserver_page_service_send_syscalls_total{io}` (`writev`
/// calls for `epoll`, `io_uring_enter` calls for `io_uring`), `_sends_total{io}` (`writev` calls,
/// `SENDMSG` operations) and `_sent_bytes_total{io}`.
pub(crate) struct IoCounters {
    pub(crate) send_syscalls: ShardedCounter,
    pub(crate) sends: ShardedCounter,
    pub(crate) sent_bytes: ShardedCounter,
}

/// Accepts connections until `cancel`; each runs on `tracker`. Connections stop reading when
/// `cancel` fires and finish the requests they have.
///
/// Cancel-safe: dropping it only stops accepting; the connections run on `tracker`.
pub async fn serve(
    listener: TcpListener,
    tenants: Arc<Tenants>,
    conf: PageServiceConf,
    metrics: Arc<PageServiceMetrics>,
    cancel: CancellationToken,
    tracker: TaskTracker,
) {
    let PageServiceConf { max_connections, idle_timeout, abort, io } = conf;
    // `auto`'s controller, for as long as connections are accepted.
    tokio::spawn(Arc::clone(&io).run(cancel.clone()));
    let connection_conf = ConnectionConf { idle_timeout, io };
    // What the connections watch for `cancel` (without its lock: see `Signal`).
    let stop = Arc::new(Signal::default());
    tokio::spawn({
        let (cancel, stop) = (cancel.clone(), Arc::clone(&stop));
        async move {
            cancel.cancelled().await;
            stop.raise();
        }
    });
    let slots = ConnectionSlots::new(max_connections, metrics.connections.clone());
    let mut next_id: u64 = 0;
    let (mut refusals, mut accept_failures) = (LogEvery::new(), LogEvery::new());
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of fds and the like: back off briefly instead of spinning.
                if let Some(failed) = accept_failures.count() {
                    tracing::warn!(
                        "failed to accept a page service connection ({failed} since the last such line): {e}"
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        next_id += 1;
        let span = tracing::info_span!("connection", conn_id = next_id, %peer);
        let _ = stream.set_nodelay(true);
        match slots.try_acquire() {
            Some(slot) => {
                let (tenants, metrics) = (Arc::clone(&tenants), Arc::clone(&metrics));
                let (stop, abort) = (Arc::clone(&stop), abort.clone());
                let connection_conf = connection_conf.clone();
                tracker.spawn(
                    async move {
                        // The slot goes with the connection's socket: an io_uring writer may
                        // hold both after the connection ended, until its sends are over (the
                        // gauge counts the slot, not this task).
                        let served =
                            handle_connection(stream, slot, &tenants, &metrics, connection_conf, stop, abort);
                        if let Err(e) = served.await {
                            tracing::debug!("connection ended: {e:#}");
                        }
                    }
                    .instrument(span),
                );
            }
            None => {
                metrics.errors.with_label_values(&[ErrorCode::TooManyConnections.name()]).inc();
                // Refused here and now, without waiting on the client: under a flood, refused
                // connections must not pile up holding descriptors.
                let _entered = span.enter();
                if let Some(refused) = refusals.count() {
                    tracing::warn!(
                        max_connections,
                        refused,
                        "refusing a connection: too many connections ({refused} refused since the last such line)"
                    );
                }
                let message = format!("the daemon serves at most {max_connections} connections");
                refuse_now(&stream, ErrorCode::TooManyConnections, message);
            }
        }
    }
}

/// The `max_connections` slots of a page service, counted in
/// `pageserver_page_service_connections`.
struct ConnectionSlots {
    slots: Arc<Semaphore>,
    gauge: IntGauge,
}

impl ConnectionSlots {
    fn new(max_connections: usize, gauge: IntGauge) -> ConnectionSlots {
        ConnectionSlots { slots: Arc::new(Semaphore::new(max_connections)), gauge }
    }

    /// A free slot, if there is one. The gauge counts it before it is taken (and a refusal
    /// after that), so that it never reads below the slots in use.
    fn try_acquire(&self) -> Option<ConnectionSlot> {
        self.gauge.inc();
        match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => Some(ConnectionSlot { permit: Some(permit), gauge: self.gauge.clone() }),
            Err(_) => {
                self.gauge.dec();
                None
            }
        }
    }
}

/// A connection's slot of `max_connections`, held as long as its socket is (by an io_uring
/// writer too, after the connection ended, until its sends are over). Counted in
/// `pageserver_page_service_connections` until after it is freed.
pub(crate) struct ConnectionSlot {
    permit: Option<OwnedSemaphorePermit>,
    gauge: IntGauge,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        drop(self.permit.take());
        self.gauge.dec();
    }
}

/// Counts events that would flood the log (a connection flood): the first is logged, then at
/// most one line per [`LogEvery::INTERVAL`], with the count since the last line.
struct LogEvery {
    since_last: u64,
    last: Option<std::time::Instant>,
}

impl LogEvery {
    const INTERVAL: Duration = Duration::from_secs(10);

    fn new() -> LogEvery {
        LogEvery { since_last: 0, last: None }
    }

    /// Counts one event; `Some(count since the last line)` when this one is to be logged.
    fn count(&mut self) -> Option<u64> {
        self.since_last += 1;
        let now = std::time::Instant::now();
        if self.last.is_some_and(|last| now.duration_since(last) < Self::INTERVAL) {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since_last))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_of_events_makes_one_log_line_per_interval() {
        let mut every = LogEvery::new();
        assert_eq!(every.count(), Some(1));
        for _ in 0..1000 {
            assert_eq!(every.count(), None);
        }
        every.last = every.last.and_then(|last| last.checked_sub(LogEvery::INTERVAL));
        assert_eq!(every.count(), Some(1001));
    }

    #[test]
    fn the_connections_gauge_counts_a_slot_while_it_is_held_and_not_a_refusal() {
        let gauge = IntGauge::new("connections", "test").unwrap();
        let slots = ConnectionSlots::new(1, gauge.clone());
        let slot = slots.try_acquire().expect("a free slot");
        assert_eq!(gauge.get(), 1);
        assert!(slots.try_acquire().is_none(), "the one slot is taken");
        assert_eq!(gauge.get(), 1, "a refusal leaves the count as it was");
        let shared = Arc::new(slot);
        let held_by_ring = Arc::clone(&shared);
        drop(shared);
        assert_eq!(gauge.get(), 1, "the slot is still held (by a ring, after its connection)");
        drop(held_by_ring);
        assert_eq!(gauge.get(), 0);
        assert_eq!(slots.slots.available_permits(), 1, "the slot is free again");
    }
}
