//! Metrics of the walredo managers, registered once per daemon and shared by every tenant.
//!
//! Names follow Neon's where one exists, prefixed `pageserver_`. The registry is the caller's
//! (the daemon exports it at `GET /metrics`); tests make a fresh one each.

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use super::ProcessKind;

/// Why a child process stopped; the `cause` label of `pageserver_wal_redo_process_stopped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    /// Unused for longer than the idle timeout.
    Idle,
    /// The manager shut down.
    Shutdown,
    /// The tenant's process kind changed; the old child drained its requests first.
    KindChange,
    /// EOF, a failed read or write, or the child exited on its own.
    Crashed,
    /// The child made no progress for `wal_redo_timeout` while a request waited on it.
    Timeout,
    /// The child sent something that is not the protocol.
    ProtocolViolation,
    /// The hello was missing or wrong.
    BadHello,
    /// A request was cancelled halfway through writing it, leaving the stream unusable.
    CancelledWrite,
    /// The last reference went away without a retirement (the manager was dropped).
    Dropped,
    /// The tenant's pool needs fewer children (its controller decided so).
    PoolShrink,
    /// The child made no progress for the stall window while requests waited on it: it takes
    /// no new request, those queued behind its oldest one go to another child, and it is
    /// killed if it makes no progress for `wal_redo_timeout` (then it exits when its last
    /// request lets go of it).
    Stalled,
}

impl StopCause {
    pub fn label(self) -> &'static str {
        match self {
            StopCause::Idle => "idle",
            StopCause::Shutdown => "shutdown",
            StopCause::KindChange => "kind_change",
            StopCause::Crashed => "crashed",
            StopCause::Timeout => "timeout",
            StopCause::ProtocolViolation => "protocol_violation",
            StopCause::BadHello => "bad_hello",
            StopCause::CancelledWrite => "cancelled_write",
            StopCause::Dropped => "dropped",
            StopCause::PoolShrink => "pool_shrink",
            StopCause::Stalled => "stalled",
        }
    }

    /// Whether the child may still finish what is in flight before it is killed.
    pub fn is_graceful(self) -> bool {
        matches!(
            self,
            StopCause::Idle
                | StopCause::KindChange
                | StopCause::Dropped
                | StopCause::PoolShrink
                | StopCause::Stalled
        )
    }

    /// Whether the stop is a fault (logged as a warning), not part of normal operation.
    pub fn is_failure(self) -> bool {
        !matches!(
            self,
            StopCause::Idle
                | StopCause::KindChange
                | StopCause::Dropped
                | StopCause::Shutdown
                | StopCause::PoolShrink
        )
    }
}

pub struct WalRedoMetrics {
    /// Wall time of a redo request, spawn and retry included.
    pub redo_seconds: Histogram,
    pub records_per_request: Histogram,
    pub bytes_per_request: Histogram,
    /// Requests by outcome: ok, rejected (error frame), timeout, queue_timeout, process_failed,
    /// invalid, shutting_down.
    pub requests: IntCounterVec,
    /// `requests` with the result `ok`, resolved once (a label lookup per request takes the
    /// vector's lock, which every thread serving GetPage would share).
    pub requests_ok: IntCounter,
    /// Background requests (`request_redo_background`) that need a child (not answered from
    /// the base image alone); their outcomes are counted in `requests` with the others.
    pub background_requests: IntCounter,
    /// Requests that left a stalled child for another one (queued behind its oldest request).
    pub requests_moved: IntCounter,
    /// Slots of the daemon-wide spin budget granted now (spinning children and blocking
    /// `auto` tenants).
    pub spin_slots_granted: IntGauge,
    pub process_launch_seconds: Histogram,
    pub processes_started: IntCounterVec,
    pub processes_stopped: IntCounterVec,
    /// Live child processes of each kind (`sync`, `async`, `auto`).
    pub process_kind: IntGaugeVec,
    /// Stderr lines of children dropped over their rate limit.
    pub stderr_lines_dropped: IntCounter,
    /// Pool size changes asked for by the controller and carried out: `grow`, `shrink`.
    pub pool_resizes: IntCounterVec,
    /// Children beyond the first, per tenant; a tenant appears only while it has some, so the
    /// series are at most the daemon-wide budget of extra children (bounded cardinality).
    pub pool_extra_children: IntGaugeVec,
}

impl WalRedoMetrics {
    pub fn new(registry: &Registry) -> anyhow::Result<WalRedoMetrics> {
        let histogram = |name: &str, help: &str, buckets: Vec<f64>| -> anyhow::Result<Histogram> {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))?;
            registry.register(Box::new(h.clone()))?;
            Ok(h)
        };
        let counter_vec = |name: &str, help: &str, label: &str| -> anyhow::Result<IntCounterVec> {
            let c = IntCounterVec::new(Opts::new(name, help), &[label])?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let requests =
            counter_vec("pageserver_wal_redo_requests_total", "WAL redo requests by outcome", "result")?;
        let metrics = WalRedoMetrics {
            requests_ok: requests.with_label_values(&["ok"]),
            requests,
            redo_seconds: histogram(
                "pageserver_wal_redo_seconds",
                "Time spent on WAL redo requests",
                exponential_buckets(5e-6, 2.0, 22)?,
            )?,
            records_per_request: histogram(
                "pageserver_wal_redo_request_records",
                "Number of records per WAL redo request",
                exponential_buckets(1.0, 2.0, 14)?,
            )?,
            bytes_per_request: histogram(
                "pageserver_wal_redo_request_bytes",
                "Bytes of records (and base image) per WAL redo request",
                exponential_buckets(64.0, 2.0, 16)?,
            )?,
            background_requests: {
                let c = IntCounter::new(
                    "pageserver_wal_redo_background_requests_total",
                    "Background WAL redo requests, which yield to GetPage requests",
                )?;
                registry.register(Box::new(c.clone()))?;
                c
            },
            spin_slots_granted: {
                let g = IntGauge::new(
                    "pageserver_wal_redo_spin_slots_granted",
                    "Slots of the daemon-wide spin budget granted now (spinning redo children, blocking tenants)",
                )?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            requests_moved: {
                let c = IntCounter::new(
                    "pageserver_wal_redo_requests_moved_total",
                    "WAL redo requests that left a walredo process making no progress for another one",
                )?;
                registry.register(Box::new(c.clone()))?;
                c
            },
            process_launch_seconds: histogram(
                "pageserver_wal_redo_process_launch_seconds",
                "Time to spawn a walredo process and read its hello",
                exponential_buckets(1e-4, 2.0, 16)?,
            )?,
            processes_started: counter_vec(
                "pageserver_wal_redo_process_started_total",
                "walredo processes started, by process kind",
                "kind",
            )?,
            processes_stopped: counter_vec(
                "pageserver_wal_redo_process_stopped_total",
                "walredo processes stopped, by cause",
                "cause",
            )?,
            process_kind: {
                let g = IntGaugeVec::new(
                    Opts::new("pageserver_walredo_process_kind", "Live walredo processes of each kind"),
                    &["kind"],
                )?;
                registry.register(Box::new(g.clone()))?;
                for kind in ProcessKind::ALL {
                    g.with_label_values(&[kind.as_str()]).set(0);
                }
                g
            },
            pool_resizes: counter_vec(
                "pageserver_wal_redo_pool_resizes_total",
                "Redo pool size changes carried out, by direction",
                "direction",
            )?,
            pool_extra_children: {
                let g = IntGaugeVec::new(
                    Opts::new(
                        "pageserver_wal_redo_pool_extra_children",
                        "Redo children beyond the first of a tenant (tenants with none are left out)",
                    ),
                    &["tenant_id"],
                )?;
                registry.register(Box::new(g.clone()))?;
                g
            },
            stderr_lines_dropped: {
                let c = IntCounter::new(
                    "pageserver_wal_redo_stderr_lines_dropped_total",
                    "Stderr lines of walredo processes dropped over their rate limit",
                )?;
                registry.register(Box::new(c.clone()))?;
                c
            },
        };
        Ok(metrics)
    }
}
