//! Metrics of the walredo managers, registered once per daemon and shared by every tenant.
//!
//! Names follow Neon's where one exists, prefixed `pageserver_`. The registry is the caller's
//! (the daemon exports it at `GET /metrics`); tests make a fresh one each.

use prometheus::{
    exponential_buckets, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

use super::ProcessKind;
use crate::metrics::sharded::{ShardedCounter, ShardedHistogram};

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
    /// Wall time of a redo request, spawn and retry included. The per-request series are in
    /// shards (`metrics::sharded`): every thread serving GetPage updates them.
    pub redo_seconds: ShardedHistogram,
    pub records_per_request: ShardedHistogram,
    pub bytes_per_request: ShardedHistogram,
    /// Requests that failed, by outcome ([`FAILED_RESULTS`]; one counter with a constant
    /// `result` label each, as `requests_ok`, since one family cannot mix constant and variable
    /// labels).
    requests_failed: Vec<(&'static str, IntCounter)>,
    /// `requests` with the result `ok`: a counter of its own, in shards (a label lookup per
    /// request takes the vector's lock, and one counter's line would bounce between the
    /// threads serving GetPage); the vector has the other results.
    pub requests_ok: ShardedCounter,
    /// Background requests (`request_redo_background`) that need a child (not answered from
    /// the base image alone); their outcomes are counted in `requests` with the others.
    pub background_requests: IntCounter,
    /// Requests that left a stalled child for another one (queued behind its oldest request).
    pub requests_moved: IntCounter,
    /// Slots of the daemon-wide spin budget granted now (spinning children and blocking
    /// `auto` tenants).
    pub spin_slots_granted: IntGauge,
    /// 1 while CPU pressure holds back every slot of the spin budget.
    pub spin_held_back: IntGauge,
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

/// The outcomes of a failed request (`RedoError`'s `result_label`), the `result` label of
/// `pageserver_wal_redo_requests_total` besides `ok`.
pub const FAILED_RESULTS: [&str; 7] =
    ["unsupported", "rejected", "timeout", "queue_timeout", "process_failed", "invalid", "shutting_down"];

impl WalRedoMetrics {
    /// The counter of failed requests with the outcome `result` (one of [`FAILED_RESULTS`]).
    pub fn requests_failed(&self, result: &str) -> Option<&IntCounter> {
        self.requests_failed.iter().find(|(r, _)| *r == result).map(|(_, c)| c)
    }

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
        let sharded = |name: &str, help: &str, buckets: Vec<f64>| -> anyhow::Result<ShardedHistogram> {
            let h = ShardedHistogram::new(HistogramOpts::new(name, help).buckets(buckets))?;
            registry.register(Box::new(h.clone()))?;
            Ok(h)
        };
        let requests = Opts::new("pageserver_wal_redo_requests_total", "WAL redo requests by outcome");
        let requests_ok = ShardedCounter::new(requests.clone().const_label("result", "ok"))?;
        registry.register(Box::new(requests_ok.clone()))?;
        let mut requests_failed = Vec::with_capacity(FAILED_RESULTS.len());
        for result in FAILED_RESULTS {
            let c = IntCounter::with_opts(requests.clone().const_label("result", result))?;
            registry.register(Box::new(c.clone()))?;
            requests_failed.push((result, c));
        }
        let metrics = WalRedoMetrics {
            requests_ok,
            requests_failed,
            redo_seconds: sharded(
                "pageserver_wal_redo_seconds",
                "Time spent on WAL redo requests",
                exponential_buckets(5e-6, 2.0, 22)?,
            )?,
            records_per_request: sharded(
                "pageserver_wal_redo_request_records",
                "Number of records per WAL redo request",
                exponential_buckets(1.0, 2.0, 14)?,
            )?,
            bytes_per_request: sharded(
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
            spin_held_back: {
                let g = IntGauge::new(
                    "pageserver_wal_redo_spin_held_back",
                    "1 while CPU pressure (tasks waiting for a CPU) holds back every slot of the spin budget: no redo child spins, no tenant blocks",
                )?;
                registry.register(Box::new(g.clone()))?;
                g
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
