//! The time-sliced background compactor of a tenant: decides when a compaction pass
//! ([`crate::storage::Pass`]) runs and how much CPU it may take, runs it in short slices off
//! the executor threads, and rebuilds the page images a pass asks for through the tenant's redo
//! manager, in its background lane (never ahead of a GetPage).
//!
//! Why slices: a pass over a large timeline is seconds of reads, writes and redo; run in one go
//! (the `monolithic` mode, kept only as the benchmark's point of comparison, like Valkey's old
//! cron defrag) it takes an executor thread and the disk for that long, and GetPage tail
//! latency with it. Run as slices of about 1 ms on the blocking pool, separated by gaps, it
//! takes a bounded CPU share and each slice resumes from the pass's cursor.
//!
//! Policy (the pure part is [`crate::compaction_controller`]):
//! - **backlog**: every [`PERIOD`] the debt is measured, normalized so that 1.0 is "a pass is
//!   due": records ingested since the last pass per key over `compaction_image_threshold`, the
//!   most records of one key over [`HOT_CHAIN_FACTOR`] times that threshold, sealed (not yet
//!   compacted) layers over [`SEALED_LAYERS_DUE`], runs of compaction outputs above the
//!   bottom one over [`RUNS_DUE`], their bytes over the bottom run's ([`FULL_PASS_RATIO`]), or
//!   the bytes written over one compaction output's key range since the compactor saw it (or
//!   last collected it) over its size ([`GC_LAYER_DUE`]).
//!   A pass starts at debt 1; its CPU share grows with the debt from `compaction_cpu_floor`
//!   to `compaction_cpu_cap`;
//! - **kind** ([`PassKind`]): full when the runs above the bottom one hold as many bytes as it
//!   (or through the API), upper when [`RUNS_DUE`] runs stand above it, level 0 when its part
//!   of the debt is due, else GC of the most overwritten layer; so what an automatic pass
//!   rewrites follows what was ingested, not the tenant's size;
//! - **latency guard**: the lateness of the compactor's own timer (how long the executor took
//!   to run it after it was due: a measure of scheduling delay) over the controller's target
//!   halves the share; each healthy period adds back a tenth, never below the floor;
//! - a late timer earns a proportionally longer next slice, capped (Valkey's anti-starvation);
//! - nothing due and no retry waiting: the task sleeps until the next ingest (the debt cannot
//!   grow without one), so idle tenants cost no wake-ups;
//! - a timeline whose storage failed for good (a fatal failure: a failed fsync, the committer's
//!   or a pass's own) gets no automatic pass until the tenant is reopened.
//!
//! **Invariants:** at most one pass per tenant at a time, run by this tenant's task; a pass's
//! file work never runs on an executor thread except in `monolithic` mode; the loop stops when
//! the tenant is cancelled, abandoning a pass between slices (which removes its outputs); at
//! most one pass asked for through the API waits behind the one running ([`REQUESTS_QUEUED`]),
//! a further ask is refused at once ([`CompactError::Busy`]), so the callers waiting for a
//! tenant's passes are at most two.

mod unredoable;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use bytes::Bytes;
use page_types::Lsn;

use crate::compaction_controller::{Controller, ControllerConf, Decision, Observation};
use crate::redo_budget::RedoBudget;
use crate::storage::{CompactionConf, ImageRequest, PassKind, PassStats, Step, Timeline};
use crate::util::lock;
use crate::walredo::WalRedoManager;
use unredoable::Unredoable;
pub use unredoable::UNREDOABLE_KEYS_MAX;

/// How often the debt is measured and the controller updated.
pub const PERIOD: Duration = Duration::from_millis(100);
/// Sealed layers at which a pass is due whatever the chains (bounds the files a read touches).
pub const SEALED_LAYERS_DUE: f64 = 8.0;
/// Runs of compaction outputs above the bottom one at which a pass merging them is due (bounds
/// the runs a lookup walks).
pub const RUNS_DUE: f64 = 8.0;
/// Bytes of the runs above the bottom one, as a share of the bottom run's, at which a full pass
/// is due (it rewrites the bottom run and collects the garbage of all: a byte ingested is
/// rewritten by full passes about `1 + 1 / FULL_PASS_RATIO` times, whatever the tenant's size).
pub const FULL_PASS_RATIO: f64 = 1.0;
/// A pass is due when one key has this many times `compaction_image_threshold` new records,
/// whatever the average: a hot key's chain stays bounded, and under uniform writes (where the
/// longest chain is about twice the average) the average decides. The pass's chain cap
/// ([`crate::storage::CHAIN_CAP_FACTOR`]): that key gets its image, whatever its bytes.
pub const HOT_CHAIN_FACTOR: f64 = crate::storage::CHAIN_CAP_FACTOR as f64;
/// GC of one compaction output is due once the layers above it took this many times its size of
/// its key range since it was written or last collected: by then many of its keys likely have
/// a newer image, and what a GC pass costs (reading the layer, writing what stays of it)
/// follows what was ingested over it, not the tenant's size.
pub const GC_LAYER_DUE: f64 = 1.0;
/// After a failed pass, no automatic pass for this long (a full disk is not retried every
/// period, nor logged every period).
pub const RETRY_INTERVAL: Duration = Duration::from_secs(10);
/// Passes asked for through the API ([`Compactor::compact_now`]) that may wait behind the one
/// running; one more is refused ([`CompactError::Busy`]). Each waits with its caller (an API
/// request and its connection): more would let a few impatient clients take every API
/// connection, and would only run the same full pass again and again.
pub const REQUESTS_QUEUED: usize = 1;
/// Bounds of the `Retry-After` a refused ask gets: the last pass's duration, in this range.
const RETRY_AFTER_MIN: Duration = Duration::from_secs(1);
const RETRY_AFTER_MAX: Duration = Duration::from_secs(300);
/// Default of `compaction_image_threshold`.
pub const DEFAULT_IMAGE_THRESHOLD: usize = 8;
/// Default of `gc_horizon` (an LSN distance; Neon's default too).
pub const DEFAULT_GC_HORIZON: u64 = 64 << 20;

/// `compaction`: how passes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CompactionMode {
    /// In slices, at a CPU share set by the backlog and the latency guard.
    #[default]
    Sliced,
    /// The whole pass at once on an executor thread: only the benchmark's point of comparison.
    Monolithic,
    /// No automatic passes (`POST /v1/tenant/{id}/compact` still runs one).
    Off,
}

/// The compaction settings of the daemon.
#[derive(Debug, Clone, PartialEq)]
pub struct CompactionSettings {
    pub mode: CompactionMode,
    pub gc_horizon: u64,
    pub image_threshold: usize,
    pub controller: ControllerConf,
}

impl Default for CompactionSettings {
    fn default() -> Self {
        CompactionSettings {
            mode: CompactionMode::Sliced,
            gc_horizon: DEFAULT_GC_HORIZON,
            image_threshold: DEFAULT_IMAGE_THRESHOLD,
            controller: ControllerConf::default(),
        }
    }
}

/// Compaction metrics, totals over all tenants.
#[derive(Debug, Clone)]
pub struct CompactionMetrics {
    passes: IntCounterVec,
    slices: IntCounter,
    slice_seconds: Histogram,
    running: IntGauge,
    written_bytes: IntCounter,
    images: IntCounter,
    dropped_values: IntCounter,
    deleted_files: IntCounter,
}

impl CompactionMetrics {
    pub fn new(registry: &Registry) -> anyhow::Result<CompactionMetrics> {
        let counter = |name: &str, help: &str| -> anyhow::Result<IntCounter> {
            let c = IntCounter::new(name, help).with_context(|| format!("create {name}"))?;
            registry.register(Box::new(c.clone())).with_context(|| format!("register {name}"))?;
            Ok(c)
        };
        let passes = IntCounterVec::new(
            Opts::new("pageserver_compaction_passes_total", "Compaction passes ended, by result (ok, error)"),
            &["result"],
        )?;
        registry.register(Box::new(passes.clone()))?;
        let slice_seconds = Histogram::with_opts(
            HistogramOpts::new("pageserver_compaction_slice_seconds", "Duration of one compaction slice")
                .buckets(vec![0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.2, 1.0]),
        )?;
        registry.register(Box::new(slice_seconds.clone()))?;
        let running = IntGauge::new("pageserver_compaction_running_passes", "Compaction passes in progress")?;
        registry.register(Box::new(running.clone()))?;
        Ok(CompactionMetrics {
            passes,
            slices: counter("pageserver_compaction_slices_total", "Compaction slices run")?,
            slice_seconds,
            running,
            written_bytes: counter(
                "pageserver_compaction_written_bytes_total",
                "Bytes of layers written by compaction",
            )?,
            images: counter(
                "pageserver_compaction_images_created_total",
                "Page images created by compaction",
            )?,
            dropped_values: counter(
                "pageserver_compaction_dropped_values_total",
                "Values garbage-collected (below the GC cutoff) or replaced by an image",
            )?,
            deleted_files: counter(
                "pageserver_compaction_deleted_files_total",
                "Layer files deleted after compaction",
            )?,
        })
    }
}

/// What the tenant status shows of compaction.
#[derive(Debug, Clone, Serialize)]
pub struct CompactionStatus {
    pub mode: CompactionMode,
    /// Normalized debt: 1.0 means a pass is due.
    pub backlog: f64,
    /// CPU share of the running pass (0 when idle).
    pub share: f64,
    /// The latency guard's multiplier (1 = no foreground trouble seen).
    pub guard: f64,
    pub running: bool,
    pub passes: u64,
    /// Of `passes`, those over every layer.
    pub full_passes: u64,
    /// Of `passes`, GC of one layer ([`PassKind::Gc`]), and of those, the ones that found too
    /// little to collect and wrote nothing.
    pub gc_passes: u64,
    pub gc_passes_skipped: u64,
    pub failed_passes: u64,
    pub gc_cutoff: Lsn,
    /// The pass running now, and how far it has got.
    pub current_pass: Option<PassProgress>,
    pub last_pass: Option<PassSummary>,
    pub last_error: Option<String>,
    pub bytes_rewritten: u64,
    pub images_created: u64,
    pub values_garbage_collected: u64,
    pub files_garbage_collected: u64,
    /// Keys compaction makes no image of, because their chain holds a record the redo child
    /// does not apply (`unsupported_record`), until a newer image of the key comes above that
    /// record or the daemon restarts (at most [`UNREDOABLE_KEYS_MAX`]).
    pub unredoable_keys: u64,
}

/// One pass, as `POST /v1/tenant/{id}/compact` answers and the status shows.
#[derive(Debug, Clone, Serialize)]
pub struct PassSummary {
    #[serde(flatten)]
    pub stats: PassStats,
    pub seconds: f64,
    pub slices: u64,
    /// RFC 3339, UTC.
    pub finished_at: String,
}

/// The pass running now, as the status shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PassProgress {
    /// Asked for through the API (`POST /v1/tenant/{id}/compact`), not started by the backlog.
    pub requested: bool,
    /// RFC 3339, UTC.
    pub started_at: String,
    pub seconds: f64,
    pub slices: u64,
    /// What it has done so far; `values_read` of `input_values` is how far it has got.
    #[serde(flatten)]
    pub stats: PassStats,
    #[serde(skip)]
    started: Instant,
}

/// Why a pass asked for through the API gave no summary.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// The tenant is shutting down: a pass it cancelled removed its outputs (nothing stored
    /// is lost).
    #[error("the tenant is shutting down")]
    ShuttingDown,
    /// The pass failed (logged by the compactor); nothing stored is lost.
    #[error("compaction pass failed: {0}")]
    Failed(String),
    /// A pass asked for earlier waits already behind the one running ([`REQUESTS_QUEUED`]):
    /// nothing was queued. `retry_after`: the last pass's duration (a guess at when the queue
    /// has room again).
    #[error(
        "a compaction pass of this tenant is running and another is queued behind it: \
         retry later (in about {} s)",
        retry_after.as_secs()
    )]
    Busy { retry_after: Duration },
}

/// A pass asked for through the API: where its outcome goes.
type PassRequest = oneshot::Sender<Result<Option<PassSummary>, CompactError>>;

/// A tenant's compactor: its status and the door for passes asked for through the API.
pub struct Compactor {
    status: Mutex<CompactionStatus>,
    requests: mpsc::Sender<PassRequest>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// What the loop works with.
struct Worker {
    timeline: Arc<Timeline>,
    walredo: Arc<WalRedoManager>,
    /// The daemon's redo memory budget: what an image request reads is reserved there.
    redo_budget: Arc<RedoBudget>,
    settings: CompactionSettings,
    layer_size: u64,
    metrics: Arc<CompactionMetrics>,
    compactor: Arc<Compactor>,
    cancel: CancellationToken,
    /// Per compaction output (by id), what the layers above it held of its key range when the
    /// compactor first saw it, or when a GC pass last took it: GC of it is due once that grew
    /// by its own size ([`GC_LAYER_DUE`]).
    gc_base: Mutex<HashMap<u32, u64>>,
    /// The keys whose chain the child cannot redo: no image is asked for them until that
    /// changes.
    unredoable: Mutex<Unredoable>,
}

impl Compactor {
    /// Starts the compactor's task (inside a tokio runtime); it stops when `cancel` is. The
    /// settings were validated with the config; invalid controller settings fall back to the
    /// defaults (logged). Page images are read within `redo_budget`.
    pub fn start(
        timeline: Arc<Timeline>,
        walredo: Arc<WalRedoManager>,
        redo_budget: Arc<RedoBudget>,
        settings: CompactionSettings,
        layer_size: u64,
        metrics: Arc<CompactionMetrics>,
        cancel: CancellationToken,
    ) -> Arc<Compactor> {
        let controller = Controller::new(settings.controller.clone()).or_else(|e| {
            tracing::error!("invalid compaction settings, using the defaults: {e:#}");
            Controller::new(ControllerConf::default())
        });
        let (requests, rx) = mpsc::channel(REQUESTS_QUEUED);
        let compactor = Arc::new(Compactor {
            status: Mutex::new(CompactionStatus {
                mode: settings.mode,
                backlog: 0.0,
                share: 0.0,
                guard: 1.0,
                running: false,
                passes: 0,
                full_passes: 0,
                gc_passes: 0,
                gc_passes_skipped: 0,
                failed_passes: 0,
                gc_cutoff: timeline.gc_cutoff(),
                current_pass: None,
                last_pass: None,
                last_error: None,
                bytes_rewritten: 0,
                images_created: 0,
                values_garbage_collected: 0,
                files_garbage_collected: 0,
                unredoable_keys: 0,
            }),
            requests,
            task: Mutex::new(None),
        });
        let worker = Worker {
            timeline,
            walredo,
            redo_budget,
            settings,
            layer_size,
            metrics,
            compactor: Arc::clone(&compactor),
            cancel,
            gc_base: Mutex::new(HashMap::new()),
            unredoable: Mutex::new(Unredoable::default()),
        };
        if let Ok(controller) = controller {
            *lock(&compactor.task) = Some(tokio::spawn(worker.run(controller, rx)));
        }
        compactor
    }

    /// Runs a pass now (at the cap share) and returns what it did; `None` if there was nothing
    /// to compact. Waits for a pass in progress to end first; refused at once
    /// ([`CompactError::Busy`]) if a pass asked for earlier waits already
    /// ([`REQUESTS_QUEUED`]).
    ///
    /// Cancel-safe in this sense: once the request is queued (at the first poll, or refused
    /// then), the pass runs to its end whether or not this future is still awaited; the status
    /// shows it (`current_pass`) and its result (`last_pass`).
    pub async fn compact_now(&self) -> Result<Option<PassSummary>, CompactError> {
        let (tx, rx) = oneshot::channel();
        match self.requests.try_send(tx) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                return Err(CompactError::Busy { retry_after: self.retry_after() })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return Err(CompactError::ShuttingDown),
        }
        rx.await.map_err(|_| CompactError::ShuttingDown)?
    }

    /// When a refused ask might find room: the last pass's duration, within bounds.
    fn retry_after(&self) -> Duration {
        let last = lock(&self.status).last_pass.as_ref().map(|p| p.seconds);
        let last = last.and_then(|s| Duration::try_from_secs_f64(s.ceil()).ok()).unwrap_or(RETRY_AFTER_MIN);
        last.clamp(RETRY_AFTER_MIN, RETRY_AFTER_MAX)
    }

    pub fn status(&self) -> CompactionStatus {
        let mut status = lock(&self.status).clone();
        if let Some(p) = status.current_pass.as_mut() {
            p.seconds = p.started.elapsed().as_secs_f64();
        }
        status
    }

    /// Waits for the task to stop (after the tenant was cancelled).
    pub async fn stopped(&self) {
        let task = lock(&self.task).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

impl Worker {
    async fn run(self, mut controller: Controller, mut requests: mpsc::Receiver<PassRequest>) {
        let mut retry_at: Option<Instant> = None;
        // Set while nothing is due and no retry waits: the debt cannot grow until an ingest
        // passes this LSN, so the task sleeps until then (no wake-ups per idle tenant).
        let mut idle_since: Option<Lsn> = None;
        loop {
            let tick = async {
                if let Some(lsn) = idle_since {
                    self.timeline.ingested_above(lsn).await;
                }
                tokio::time::sleep(PERIOD).await;
            };
            let request = tokio::select! {
                biased;
                () = self.cancel.cancelled() => return,
                r = requests.recv() => match r {
                    Some(r) => Some(r),
                    None => return,
                },
                () = tick => None,
            };
            let debt = self.debt();
            let decision = controller.update(Observation { debt, sched_delay: Duration::ZERO });
            self.show(debt, &controller, decision, false);
            // A timeline whose storage failed for good writes nothing until it is reopened:
            // no automatic pass (a requested one answers why).
            let failed_for_good = self.timeline.write_error().is_some_and(|e| e.fatal);
            let due = self.settings.mode != CompactionMode::Off
                && debt >= 1.0
                && !failed_for_good
                && retry_at.is_none_or(|t| Instant::now() >= t);
            if request.is_none() && !due {
                idle_since = retry_at.is_none().then(|| self.timeline.last_durable_lsn());
                continue;
            }
            idle_since = None;
            let start_debt = if request.is_some() { controller.conf().full_debt } else { debt };
            let result = self.pass(&mut controller, start_debt, request.is_some()).await;
            let answer = match &result {
                Ok(summary) => Ok(summary.clone()),
                Err(_) if self.cancel.is_cancelled() => Err(CompactError::ShuttingDown),
                Err(e) => Err(CompactError::Failed(format!("{e:#}"))),
            };
            retry_at = result.is_err().then(|| Instant::now() + RETRY_INTERVAL);
            self.record(result);
            if let Some(reply) = request {
                let _ = reply.send(answer);
            }
        }
    }

    /// The normalized debt (see the module doc).
    fn debt(&self) -> f64 {
        let b = self.timeline.backlog();
        let upper_runs = b.runs.saturating_sub(1) as f64 / RUNS_DUE;
        let upper_bytes = b.upper_bytes as f64 / (b.bottom_bytes.max(1) as f64 * FULL_PASS_RATIO);
        let gc = self.gc_due().map_or(0.0, |(_, due)| due);
        self.level0_debt(&b).max(upper_runs).max(upper_bytes).max(gc)
    }

    /// The part of the debt a level 0 pass pays: records per key, the hottest key's chain, the
    /// sealed layers.
    fn level0_debt(&self, b: &crate::storage::Backlog) -> f64 {
        let threshold = self.settings.image_threshold.max(1) as f64;
        let per_key = b.new_records as f64 / (b.keys.max(1) as f64 * threshold);
        let hot_key = b.longest_new_chain as f64 / (HOT_CHAIN_FACTOR * threshold);
        per_key.max(hot_key).max(b.sealed_layers as f64 / SEALED_LAYERS_DUE)
    }

    /// The compaction output most overwritten since it was written (or last collected): its
    /// id and how many times its size the layers above it took of its key range since then
    /// (over [`GC_LAYER_DUE`]). Forgets the layers that are gone.
    fn gc_due(&self) -> Option<(u32, f64)> {
        let layers = self.timeline.overwritten();
        let mut base = lock(&self.gc_base);
        // Rebuilt from the layers there are (O(layers), every period under ingest).
        let seen: HashMap<u32, u64> =
            layers.iter().map(|l| (l.layer, base.get(&l.layer).copied().unwrap_or(l.above))).collect();
        *base = seen;
        let mut best: Option<(u32, f64)> = None;
        for l in layers.iter() {
            let seen = base[&l.layer];
            let due = l.above.saturating_sub(seen) as f64 / (l.size.max(1) as f64 * GC_LAYER_DUE);
            if best.is_none_or(|(_, d)| due > d) {
                best = Some((l.layer, due));
            }
        }
        best
    }

    /// A GC pass takes `layer`: what is above it now is its new base (a pass that finds too
    /// little to collect leaves it, and it is not due again until as much more is written
    /// over it).
    fn gc_taken(&self, layer: u32) {
        if let Some(l) = self.timeline.overwritten().iter().find(|l| l.layer == layer) {
            lock(&self.gc_base).insert(layer, l.above);
        }
    }

    /// Which pass a due debt calls for: a full one when the runs above the bottom one hold as
    /// much as it (or an operator asked), one merging those runs when there are many, else GC
    /// of the most overwritten layer when it is due and its part of the debt is larger than
    /// level 0's (so that neither starves the other while ingest keeps level 0 due: a GC pass
    /// makes no images and is cheap), else one of level 0.
    fn pass_kind(&self, requested: bool) -> (PassKind, Option<u32>) {
        let b = self.timeline.backlog();
        if requested || b.upper_bytes as f64 >= b.bottom_bytes as f64 * FULL_PASS_RATIO && b.runs > 1 {
            return (PassKind::Full, None);
        }
        if b.runs.saturating_sub(1) as f64 >= RUNS_DUE {
            return (PassKind::Upper, None);
        }
        let level0 = self.level0_debt(&b);
        match self.gc_due() {
            Some((layer, due)) if due >= 1.0 && due > level0 => {
                tracing::debug!(layer, due, level0, "GC of one layer");
                (PassKind::Gc, Some(layer))
            }
            _ => (PassKind::Level0, None),
        }
    }

    fn show(&self, debt: f64, controller: &Controller, decision: Decision, running: bool) {
        let mut s = lock(&self.compactor.status);
        s.backlog = debt;
        s.share = if running { decision.share } else { 0.0 };
        s.guard = controller.guard();
        s.running = running;
        s.gc_cutoff = self.timeline.gc_cutoff();
    }

    /// One pass from the freeze of the active segment to the install; `requested` through the
    /// API (as the status shows it).
    async fn pass(
        &self,
        controller: &mut Controller,
        start_debt: f64,
        requested: bool,
    ) -> anyhow::Result<Option<PassSummary>> {
        let (kind, gc_layer) = self.pass_kind(requested);
        if kind != PassKind::Gc {
            self.timeline.freeze().await.context("seal the active segment")?;
        }
        let conf = CompactionConf {
            image_threshold: self.settings.image_threshold,
            image_bytes: page_types::PAGE_SIZE as u64,
            gc_horizon: self.settings.gc_horizon,
            layer_size: self.layer_size,
        };
        let timeline = Arc::clone(&self.timeline);
        let begun = tokio::task::spawn_blocking(move || match gc_layer {
            Some(layer) => timeline.begin_gc(conf, layer),
            None => timeline.begin_pass(conf, kind),
        })
        .await
        .context("compaction task")??;
        if let Some(layer) = gc_layer {
            self.gc_taken(layer);
        }
        let Some(mut pass) = begun else {
            return Ok(None);
        };
        self.metrics.running.inc();
        let _running = scopeguard(|| self.metrics.running.dec());
        let started = Instant::now();
        lock(&self.compactor.status).current_pass = Some(PassProgress {
            requested,
            started_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            seconds: 0.0,
            slices: 0,
            stats: pass.stats().clone(),
            started,
        });
        let monolithic = self.settings.mode == CompactionMode::Monolithic;
        let mut decision = controller.update(Observation { debt: start_debt, sched_delay: Duration::ZERO });
        self.show(start_debt, controller, decision, true);
        let (mut planned, mut actual, mut worst_delay) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let mut last_update = Instant::now();
        let mut slices = 0u64;
        loop {
            // One turn: slices, and the page images they ask for, until the turn has worked its
            // budget (the redo round trips count: they take the child that GetPage needs too),
            // then a gap in proportion to the work done. Only work counts: the time an image
            // waited for room in the redo budget or for its redo turn (up to
            // `wal_redo_timeout` behind GetPage) is not work, and is paid for by nobody.
            let budget =
                if monolithic { Duration::MAX } else { controller.slice_for(decision, planned, actual) };
            let turn_start = Instant::now();
            let mut waited = Duration::ZERO;
            loop {
                let remaining = budget.saturating_sub(turn_start.elapsed().saturating_sub(waited));
                let slice_start = Instant::now();
                let step;
                (pass, step) = if monolithic {
                    let step = pass.run_slice(remaining);
                    (pass, step)
                } else {
                    tokio::task::spawn_blocking(move || {
                        let step = pass.run_slice(remaining);
                        (pass, step)
                    })
                    .await
                    .context("compaction slice task")?
                };
                slices += 1;
                self.progress(&pass, slices);
                self.metrics.slices.inc();
                self.metrics.slice_seconds.observe(slice_start.elapsed().as_secs_f64());
                match step? {
                    Step::Continue => break,
                    Step::NeedImage(req) => {
                        // A redo known to fail again is not asked for (nor its values read).
                        if lock(&self.unredoable).fails(req.key, req.from, req.lsn) {
                            pass.skip_image();
                            continue;
                        }
                        let (page, idle) = self.rebuild(req).await?;
                        waited += idle;
                        pass.provide_image(page);
                        if turn_start.elapsed().saturating_sub(waited) >= budget || self.cancel.is_cancelled()
                        {
                            break;
                        }
                    }
                    Step::Done(stats) => {
                        return Ok(Some(PassSummary {
                            stats,
                            seconds: started.elapsed().as_secs_f64(),
                            slices,
                            finished_at: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
                        }));
                    }
                }
            }
            let worked = turn_start.elapsed().saturating_sub(waited);
            if self.cancel.is_cancelled() {
                anyhow::bail!("the tenant is shutting down");
            }
            if monolithic {
                continue;
            }
            if last_update.elapsed() >= PERIOD {
                let debt = start_debt.max(self.debt());
                decision = controller.update(Observation { debt, sched_delay: worst_delay });
                self.show(debt, controller, decision, true);
                (last_update, worst_delay) = (Instant::now(), Duration::ZERO);
            }
            planned = decision.gap_after(worked);
            let gap_start = Instant::now();
            tokio::select! {
                () = tokio::time::sleep(planned) => {}
                () = self.cancel.cancelled() => anyhow::bail!("the tenant is shutting down"),
            }
            actual = gap_start.elapsed();
            worst_delay = worst_delay.max(actual.saturating_sub(planned));
        }
    }

    /// Shows how far the running pass has got.
    fn progress(&self, pass: &crate::storage::Pass, slices: u64) {
        if let Some(p) = lock(&self.compactor.status).current_pass.as_mut() {
            p.stats.clone_from(pass.stats());
            p.slices = slices;
        }
    }

    /// Rebuilds the page a pass asked for: reserves what it holds from the redo memory budget
    /// (waiting for room as long as it takes: a pass can wait, a GetPage cannot), reads it on
    /// the blocking pool, and has the redo manager rebuild it in its background lane. `None`
    /// if the redo failed (the pass keeps the key's records); an error if the read failed or
    /// the tenant is shutting down. With the page, the time it waited (for room in the budget,
    /// and for its redo turn) rather than worked. A record the child does not apply is
    /// remembered ([`Unredoable`]).
    async fn rebuild(&self, req: ImageRequest) -> anyhow::Result<(Option<Bytes>, Duration)> {
        let (key, lsn) = (req.key, req.lsn);
        // As a GetPage counts it.
        let holds = crate::walredo::reconstruction_bytes(req.values(), req.bytes());
        let waiting = Instant::now();
        let _reserved = loop {
            let reserved = tokio::select! {
                reserved = self.redo_budget.reserve(holds) => reserved,
                () = self.cancel.cancelled() => anyhow::bail!("the tenant is shutting down"),
            };
            // Overloaded: a background image waits on, behind the GetPage requests.
            if let Ok(reserved) = reserved {
                break reserved;
            }
        };
        let mut waited = waiting.elapsed();
        let data =
            tokio::task::spawn_blocking(move || req.read()).await.context("compaction read task")??;
        let base = data.image.map(|(_, b)| b);
        let (page, turn) = self.walredo.request_redo_background_timed(key, lsn, base, &data.records).await;
        waited += turn;
        match page {
            Ok(page) => Ok((Some(page), waited)),
            Err(e) => {
                tracing::debug!(%key, %lsn, "compaction could not rebuild a page: {e}");
                lock(&self.unredoable).failed(key, &data.records, &e);
                Ok((None, waited))
            }
        }
    }

    /// Logs a pass (INFO, once per pass) and adds it to the status and metrics.
    fn record(&self, result: anyhow::Result<Option<PassSummary>>) {
        let mut s = lock(&self.compactor.status);
        s.running = false;
        s.share = 0.0;
        s.gc_cutoff = self.timeline.gc_cutoff();
        s.unredoable_keys = lock(&self.unredoable).len() as u64;
        let current = s.current_pass.take();
        match result {
            Ok(None) => {}
            Ok(Some(p)) => {
                let st = &p.stats;
                tracing::info!(
                    seconds = p.seconds,
                    slices = p.slices,
                    kind = ?st.kind,
                    layers_in = st.input_layers,
                    layers_out = st.output_layers,
                    keys = st.keys,
                    images = st.images_created,
                    dropped = st.values_dropped,
                    bytes_before = st.bytes_before,
                    bytes_written = st.bytes_written,
                    gc_cutoff = %st.gc_cutoff,
                    "compaction pass done"
                );
                self.metrics.passes.with_label_values(&["ok"]).inc();
                self.metrics.written_bytes.inc_by(st.bytes_written);
                self.metrics.images.inc_by(st.images_created);
                self.metrics.dropped_values.inc_by(st.values_dropped);
                self.metrics.deleted_files.inc_by(st.files_deleted);
                s.passes += 1;
                s.full_passes += u64::from(st.kind == PassKind::Full);
                s.gc_passes += u64::from(st.kind == PassKind::Gc);
                s.gc_passes_skipped += u64::from(st.skipped);
                s.bytes_rewritten += st.bytes_written;
                s.images_created += st.images_created;
                s.values_garbage_collected += st.values_dropped;
                s.files_garbage_collected += st.files_deleted;
                s.last_pass = Some(p);
                s.last_error = None;
            }
            Err(e) => {
                if self.cancel.is_cancelled() {
                    if let Some(p) = current {
                        let st = &p.stats;
                        tracing::info!(
                            seconds = p.started.elapsed().as_secs_f64(),
                            requested = p.requested,
                            values_read = st.values_read,
                            input_values = st.input_values,
                            gc_cutoff = %st.gc_cutoff,
                            "compaction pass cancelled by shutdown: its outputs are removed, the layers \
                             it read stay as they were (nothing stored is lost, the GC cutoff it set \
                             stays); the next pass starts over"
                        );
                    }
                    return;
                }
                tracing::warn!("compaction pass failed, retrying when due: {e:#}");
                self.metrics.passes.with_label_values(&["error"]).inc();
                s.failed_passes += 1;
                s.last_error = Some(format!("{e:#}"));
            }
        }
    }
}

/// Runs `f` when dropped.
fn scopeguard<F: FnOnce()>(f: F) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use page_types::BufferTag;
    use walredo_proc::record::Record;

    use super::*;
    use crate::storage::{IngestBatch, StorageConf, StorageMetrics, Value};
    use crate::walredo::metrics::WalRedoMetrics;
    use crate::walredo::WalRedoConf;

    const KEY: BufferTag = BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum: 7 };

    fn encode(record: Record<'_>) -> Value {
        let mut out = Vec::new();
        record.encode(&mut out);
        Value::Record(Bytes::from(out))
    }

    /// A compactor of `timeline` with its own redo budget (waits up to `budget_wait` for room)
    /// and metrics in `registry`; cancelled with `cancel`.
    fn start_compactor(
        timeline: &Arc<Timeline>,
        walredo: &Arc<WalRedoManager>,
        settings: CompactionSettings,
        budget_wait: Duration,
        registry: &Registry,
        cancel: &CancellationToken,
    ) -> Arc<Compactor> {
        let budget = Arc::new(RedoBudget::new(
            crate::redo_budget::DEFAULT_REDO_MEMORY_BUDGET,
            budget_wait,
            Arc::new(std::sync::atomic::AtomicU64::new(0)),
        ));
        Compactor::start(
            Arc::clone(timeline),
            Arc::clone(walredo),
            budget,
            settings,
            crate::storage::DEFAULT_LAYER_SIZE,
            Arc::new(CompactionMetrics::new(registry).unwrap()),
            cancel.clone(),
        )
    }

    /// Waits until `condition` holds, failing the test after `within`.
    async fn wait_for(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
        let deadline = Instant::now() + within;
        while !condition() {
            assert!(Instant::now() < deadline, "timed out after {within:?} waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A PostgreSQL 15 Heap2 NEW_CID record given for `key`, ending at `lsn`: a record the
    /// redo child never applies (it changes no page; `unsupported_record`).
    fn unredoable(key: BufferTag, lsn: u64) -> Value {
        let record = walredo_proc::pg15::Pg15Record {
            rmid: 9,
            info: 0x70,
            xid: 1,
            lsn: lsn - 1,
            end_lsn: lsn,
            target: 0,
            blocks: vec![walredo_proc::pg15::BlockHeader {
                id: 0,
                // Never skipped as already in the page, whatever the page's LSN.
                flags: walredo_proc::pg15::FLAG_WILL_INIT,
                fork: key.forknum,
                spcnode: key.spcnode,
                dbnode: key.dbnode,
                relnode: key.relnode,
                blkno: key.blknum,
                data: &[],
            }],
            main_data: &[0; 34],
        };
        let mut out = Vec::new();
        record.encode(&mut out).unwrap();
        Value::Record(Bytes::from(out))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_whose_chain_the_child_cannot_redo_is_not_retried_until_an_image_comes_above_it() {
        let dir = tempfile::tempdir().unwrap();
        let timeline =
            Timeline::open(dir.path(), StorageConf::default(), Arc::new(StorageMetrics::unregistered()))
                .unwrap();
        let settings = CompactionSettings { mode: CompactionMode::Off, ..CompactionSettings::default() };
        let threshold = settings.image_threshold as u64;
        // Two keys, each a chain of more than `compaction_image_threshold` records with an
        // unredoable record near its start.
        let (a, b) = (KEY, BufferTag { blknum: 8, ..KEY });
        let mut values = Vec::new();
        for key in [a, b] {
            values.push((key, Lsn(1), encode(Record::InitPage { special_size: 0 })));
        }
        for key in [a, b] {
            values.push((key, Lsn(2), unredoable(key, 2)));
        }
        // Records the child can redo, on both keys at each LSN of `lsns`; of 2 KiB, so that
        // `threshold` of them hold a page's bytes and make an image worth writing.
        let put_bytes = |values: &mut Vec<_>, lsns: std::ops::RangeInclusive<u64>, offset: u16| {
            for lsn in lsns {
                for key in [a, b] {
                    values.push((
                        key,
                        Lsn(lsn),
                        encode(Record::PutBytes { offset, data: &[lsn as u8; 2048] }),
                    ));
                }
            }
        };
        put_bytes(&mut values, 3..=threshold + 1, 100);
        timeline.ingest(IngestBatch { values }).await.unwrap();

        let redo_metrics = Arc::new(WalRedoMetrics::new(&Registry::new()).unwrap());
        let walredo = WalRedoManager::new(
            "t",
            WalRedoConf::with_binary(crate::test_support::walredo_proc_binary()),
            Arc::clone(&redo_metrics),
        );
        let cancel = CancellationToken::new();
        let compactor = start_compactor(
            &timeline,
            &walredo,
            settings,
            Duration::from_secs(60),
            &Registry::new(),
            &cancel,
        );
        let requests = || redo_metrics.background_requests.get();

        // The first pass asks for both pages, and the child refuses both.
        let first = compactor.compact_now().await.unwrap().unwrap();
        assert_eq!((first.stats.images_created, first.stats.image_failures), (0, 2), "{first:?}");
        assert_eq!(requests(), 2);
        assert_eq!(compactor.status().unredoable_keys, 2);

        // Then `a` gets more records (its chain still holds the unredoable record) and `b` a page
        // image above its unredoable record, with a chain above that the child can redo.
        let mut values = vec![(b, Lsn(100), Value::Image(Bytes::from(vec![0u8; 8192])))];
        put_bytes(&mut values, 101..=100 + threshold, 200);
        timeline.ingest(IngestBatch { values }).await.unwrap();

        // The second pass asks for `b` alone, and makes its image.
        let second = compactor.compact_now().await.unwrap().unwrap();
        assert_eq!(
            requests(),
            3,
            "one redo request, for the key imaged above its unredoable record: {second:?}"
        );
        assert_eq!((second.stats.images_created, second.stats.image_failures), (1, 0), "{second:?}");
        assert_eq!(second.stats.images_skipped, 1, "{second:?}");
        assert_eq!(compactor.status().unredoable_keys, 1, "`a` is still remembered, `b` forgotten");
        cancel.cancel();
        compactor.stopped().await;
        walredo.shutdown().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pass_at_the_floor_share_does_not_pause_for_the_time_its_image_waited_for_a_redo_turn() {
        // The background redo waits this long for its turn (a GetPage stays queued to write).
        const TURN_WAIT: Duration = Duration::from_secs(2);
        let dir = tempfile::tempdir().unwrap();
        let timeline =
            Timeline::open(dir.path(), StorageConf::default(), Arc::new(StorageMetrics::unregistered()))
                .unwrap();
        // One key, a chain of exactly `compaction_image_threshold` records of 2 KiB (more than
        // a page's bytes): the debt is 1.0, so a pass starts at the floor share (a gap 19 times
        // the work), and it needs one image.
        let settings = CompactionSettings::default();
        let mut values = vec![(KEY, Lsn(1), encode(Record::InitPage { special_size: 0 }))];
        for lsn in 2..=settings.image_threshold as u64 {
            values.push((KEY, Lsn(lsn), encode(Record::PutBytes { offset: 100, data: &[lsn as u8; 2048] })));
        }
        timeline.ingest(IngestBatch { values }).await.unwrap();

        let mut conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
        conf.timeout = TURN_WAIT;
        let registry = Registry::new();
        let walredo = WalRedoManager::new("t", conf, Arc::new(WalRedoMetrics::new(&registry).unwrap()));
        let held = walredo.hold_foreground_queue();
        let cancel = CancellationToken::new();
        let compactor = start_compactor(&timeline, &walredo, settings, TURN_WAIT, &registry, &cancel);
        // The pass waits TURN_WAIT for its image, then works for milliseconds: it ends within
        // a few seconds, not after a pause of 19 x TURN_WAIT.
        wait_for("the pass to end", TURN_WAIT * 8, || compactor.status().passes == 1).await;
        let status = compactor.status();
        let pass = status.last_pass.unwrap();
        assert_eq!((pass.stats.images_created, pass.stats.image_failures), (1, 0), "{pass:?}");
        drop(held);
        cancel.cancel();
        compactor.stopped().await;
        walredo.shutdown().await;
    }
}
