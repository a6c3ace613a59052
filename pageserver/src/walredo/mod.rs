//! WAL redo: turns a base image and the records above it into the page at an LSN, by piping
//! them to a sandboxed child process (`walredo-proc`).
//!
//! - this file: [`WalRedoManager`], one per tenant: keeps its pool of children (sized by the
//!   adaptive worker controller every [`pool::PERIOD`]), spawns the first child on demand,
//!   retries once on a child failure, retires idle and broken children, switches the process
//!   kind at runtime, shuts down;
//! - [`pool`]: the children in service, the daemon-wide budget of extra children, and the
//!   controller's measurements;
//! - [`priority`]: foreground (GetPage) requests before background ones (compaction);
//! - [`process`]: one child (spawn, hello, stderr, kill and reap) and its two kinds of pipes;
//! - [`request`]: a request in pieces, written with vectored writes (no copy of the image or
//!   records);
//! - [`pipeline`]: reply assembly, matching of pipelined replies to requests, and the child's
//!   progress clock (when a child is stalled, and when it is hung);
//! - [`metrics`]: the registry entries;
//! - [`spin`]: setting the spin window of the child in service.
//!
//! The wire protocol itself lives in `walredo_proc::protocol`; this module does the I/O.
//!
//! Trust model: the child is not trusted once it has seen a request; nothing it sends can
//! panic the daemon, hang it past `wal_redo_timeout`, or reach another request's caller.
//!
//! Invariants:
//! - a tenant's children in service form its pool ([`pool`]); a retired child serves no new
//!   request;
//! - a redo request fails with the error of its own reply or of its own process, never with
//!   another request's page;
//! - after [`WalRedoManager::shutdown`] returns, no child of this manager is alive or a zombie;
//! - a foreground request waits behind at most one background request; a background request
//!   never overtakes a foreground request already queued to write (the rule: [`priority`]).

pub mod metrics;
mod pipeline;
pub mod pool;
mod priority;
mod process;
mod request;
mod spin;
pub mod spin_budget;
#[cfg(test)]
mod tests;
mod write_queue;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use page_types::{BufferTag, Lsn, PAGE_SIZE};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walredo_proc::protocol::{self, ErrorCode};

pub use metrics::{StopCause, WalRedoMetrics};
use pipeline::{ChildReply, Patience, ProcessError};
use pool::{ChildBudget, ControllerStatus, Load, Pool, Sampler};
use priority::{Priority, WriteTicket};
use process::{InUse, Process, Reaping};
use request::Request;
use spin_budget::{Bid, SpinBudget};

use crate::metrics::RequestSeries;
use crate::util::lock;
pub use crate::worker_controller::Wait;
use crate::worker_controller::{
    max_spinning_for_cpus, Decision, Observation, WorkerController, WorkerControllerConf,
};

/// How many times a request may leave a stalled child for another one (each move waited the
/// stall window, at most a second; a request that meets this many stalled children fails).
const MAX_MOVES: u32 = 3;

/// Default of `wal_redo_timeout`.
pub const DEFAULT_WAL_REDO_TIMEOUT: Duration = Duration::from_secs(60);
/// Default idle time after which a child is stopped (Neon: 180 s; an idle child costs memory).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(180);
pub use page_types::MAX_RECORDS_PER_REQUEST;

/// The default process kind, of the daemon (`walredo_process_kind`) and of [`WalRedoConf`]:
/// the one definition, which `config.rs` uses too.
pub const DEFAULT_PROCESS_KIND: ProcessKind = ProcessKind::Auto;

/// How the daemon drives the child's pipes; read each time a child is spawned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessKind {
    /// Non-blocking pipes and `nix::poll` on the calling thread, which hands its other tasks to
    /// another executor thread while it blocks (`block_in_place`).
    Sync,
    /// tokio `ChildStdin`/`ChildStdout`; yields while waiting.
    Async,
    /// The sync kind's pipes, whose round trips block or yield as the pool's controller decides
    /// for the tenant: block while few requests overlap, yield while many do.
    Auto,
}

impl Default for ProcessKind {
    fn default() -> ProcessKind {
        DEFAULT_PROCESS_KIND
    }
}

impl ProcessKind {
    pub const ALL: [ProcessKind; 3] = [ProcessKind::Sync, ProcessKind::Async, ProcessKind::Auto];

    pub fn as_str(self) -> &'static str {
        match self {
            ProcessKind::Sync => "sync",
            ProcessKind::Async => "async",
            ProcessKind::Auto => "auto",
        }
    }
}

impl std::str::FromStr for ProcessKind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<ProcessKind> {
        match s {
            "sync" => Ok(ProcessKind::Sync),
            "async" => Ok(ProcessKind::Async),
            "auto" => Ok(ProcessKind::Auto),
            other => {
                anyhow::bail!(
                    "unknown walredo process kind {other:?}, expected \"sync\", \"async\" or \"auto\""
                )
            }
        }
    }
}

impl std::fmt::Display for ProcessKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Settings of a manager (the daemon fills them from its config).
#[derive(Debug, Clone)]
pub struct WalRedoConf {
    /// The `walredo-proc` binary.
    pub binary: PathBuf,
    /// Extra arguments for the child; only tests and debugging set them.
    pub args: Vec<String>,
    /// Kind of the children spawned from now on; [`WalRedoManager::set_process_kind`] changes it.
    pub process_kind: ProcessKind,
    /// `wal_redo_timeout`: the longest a child may make no progress while work waits on it
    /// (then it is killed), the longest a request waits behind others (then it fails alone
    /// with [`RedoError::QueueTimeout`]), and the bound on spawning and the hello.
    pub timeout: Duration,
    /// How long a child may make no progress while work waits on it before it takes no new
    /// request and the requests queued behind its oldest move to another child; `None`: a
    /// quarter of `timeout`, at most 1 s. Only tests set it (to `timeout`, so that requests
    /// stay queued on a child they stopped on purpose).
    pub stall_after: Option<Duration>,
    /// A child unused this long is stopped; the next request spawns a new one.
    pub idle_timeout: Duration,
    /// Most children of one tenant (`walredo_pool_max`; default one per CPU, at least 2).
    pub max_pool_size: usize,
    /// The daemon-wide budget of children beyond the first of each tenant.
    pub budget: Arc<ChildBudget>,
    /// The daemon-wide budget of spinning children and blocking round trips ([`spin_budget`]).
    pub spin_budget: Arc<SpinBudget>,
    /// Whether the controller sets the children's spin windows (the daemon: always; off only
    /// for benchmarks of the plain blocking round trip).
    pub adaptive_spin: bool,
    /// How `auto` children wait: `None` (the daemon), as the controller says; tests and
    /// benchmarks pin one to measure or exercise it alone.
    pub auto_wait: Option<Wait>,
}

impl WalRedoConf {
    /// Defaults, with the child binary found next to the running executable.
    pub fn with_binary(binary: PathBuf) -> WalRedoConf {
        WalRedoConf {
            binary,
            args: Vec::new(),
            process_kind: ProcessKind::default(),
            timeout: DEFAULT_WAL_REDO_TIMEOUT,
            stall_after: None,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_pool_size: pool::default_max_pool_size(),
            budget: ChildBudget::global(),
            spin_budget: SpinBudget::global(),
            adaptive_spin: true,
            auto_wait: None,
        }
    }
}

impl WalRedoConf {
    /// How long requests wait on a child that makes no progress ([`pipeline::Patience`]).
    pub(crate) fn patience(&self) -> Patience {
        let derived = Patience::of_timeout(self.timeout);
        match self.stall_after {
            Some(stall) => Patience { stall: stall.min(self.timeout), ..derived },
            None => derived,
        }
    }
}

/// Bytes the reconstruction of a page from `values` values (an image and records) of `bytes`
/// bytes in all holds while it runs: the values read, storage's list of them (which the redo
/// request borrows as it is), the frames of the request (which sends the image and the long records from
/// where they were read, and copies only short ones) and the reply. What a GetPage and a
/// compaction image reserve of the redo memory budget before they read: one formula, so that
/// both count alike.
pub fn reconstruction_bytes(values: usize, bytes: u64) -> u64 {
    bytes
        + (values * std::mem::size_of::<(Lsn, Bytes)>()) as u64
        + Request::overhead(values, bytes)
        + request::REPLY_BYTES
}

/// The path of `walredo-proc` next to the running executable (how the daemon is shipped).
pub fn default_binary_path() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().map_err(|e| anyhow::anyhow!("locate the running executable: {e}"))?;
    let dir = exe.parent().ok_or_else(|| anyhow::anyhow!("executable {} has no directory", exe.display()))?;
    Ok(dir.join("walredo-proc"))
}

/// Why a redo request failed; callers branch on it (retry, report, give up).
#[derive(Debug, thiserror::Error)]
pub enum RedoError {
    /// The child answered this request with an error frame; the child lives on.
    #[error("redo rejected by walredo process ({}): {message}", .code.name())]
    Rejected { code: ErrorCode, message: String },
    /// The child made no progress for `wal_redo_timeout` while the request waited on it; the
    /// child was killed.
    #[error("walredo request timed out after {0:?}")]
    Timeout(Duration),
    /// The request waited `wal_redo_timeout` behind other requests (for the pipes, or for a
    /// child being spawned) without its turn coming; the child is not blamed and lives on.
    #[error("walredo request waited {0:?} in the queue for its walredo process")]
    QueueTimeout(Duration),
    #[error("walredo process failed: {0:#}")]
    ProcessFailed(anyhow::Error),
    #[error("invalid redo request: {0}")]
    InvalidRequest(String),
    #[error("walredo manager is shutting down")]
    ShuttingDown,
}

impl RedoError {
    /// The error of a request whose round trip on a child failed (the child is retired for
    /// it); `what` says which child, and doing what.
    fn of_process(e: ProcessError, what: String) -> RedoError {
        match e {
            ProcessError::Timeout(t) => RedoError::Timeout(t),
            other => RedoError::ProcessFailed(anyhow::Error::new(other).context(what)),
        }
    }

    fn result_label(&self) -> &'static str {
        match self {
            RedoError::Rejected { code: ErrorCode::UnsupportedRecord, .. } => "unsupported",
            RedoError::Rejected { .. } => "rejected",
            RedoError::Timeout(_) => "timeout",
            RedoError::QueueTimeout(_) => "queue_timeout",
            RedoError::ProcessFailed(_) => "process_failed",
            RedoError::InvalidRequest(_) => "invalid",
            RedoError::ShuttingDown => "shutting_down",
        }
    }
}

/// What a manager reports about itself (tenant status, tests).
#[derive(Debug, Clone, Serialize)]
pub struct WalRedoStatus {
    /// Kind of the next child spawned.
    pub process_kind: ProcessKind,
    /// The oldest child in service, if one is running (the first of `pool.children`).
    pub process: Option<ProcessStatus>,
    /// The children in service and the controller that sizes them.
    pub pool: PoolStatus,
    /// Requests answered (page or error frame) over the manager's life.
    pub requests_served: u64,
    /// Exit status of the last child reaped, e.g. `pid 42: killed by SIGKILL`.
    pub last_exit: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcessStatus {
    pub kind: ProcessKind,
    pub pid: u32,
    pub uptime_seconds: f64,
    pub requests_served: u64,
    /// Requests on this child now.
    pub in_flight: usize,
    /// The child's spin window in microseconds (0: it blocks at once); see [`WalRedoManager::set_spin`].
    pub spin_us: u32,
    /// How requests reach the child now: `sync` (blocking round trips) or `async` (yielding);
    /// fixed by the kind, except for `auto` children, which follow the controller.
    pub path: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct PoolStatus {
    /// Oldest first.
    pub children: Vec<ProcessStatus>,
    /// Most children this tenant may have.
    pub max_children: usize,
    /// The controller's last inputs and decision (`None` before its first period).
    pub controller: Option<ControllerStatus>,
}

/// Whether round trips of `kind` waiting as `wait` says block their thread (see
/// [`WalRedoManager::may_block`]).
fn blocks(kind: ProcessKind, wait: Wait) -> bool {
    match kind {
        ProcessKind::Sync => true,
        ProcessKind::Async => false,
        ProcessKind::Auto => wait == Wait::Block,
    }
}

/// One tenant's access to WAL redo. See the module doc.
pub struct WalRedoManager {
    tenant_id: String,
    /// Unique in the daemon: the manager's name in the spin budget.
    id: u64,
    conf: WalRedoConf,
    kind: Mutex<ProcessKind>,
    /// The children in service. A std mutex: held for a few instructions, never across an await.
    pool: Mutex<Pool>,
    /// Requests and their times, for the pool's controller.
    load: Arc<Load>,
    /// The controller's last look, for the status.
    controller: Mutex<Option<ControllerStatus>>,
    /// How the controller last said `auto` children wait (set on each one spawned).
    wait: Mutex<Wait>,
    /// Whether a round trip may block its thread: the kind is `sync`, or `auto` on the
    /// blocking path. Kept with `kind` and `path` (under their locks), read without a lock.
    blocks: AtomicBool,
    /// A background spawn for the pool is under way.
    growing: AtomicBool,
    me: Weak<WalRedoManager>,
    /// Serializes spawning, so that a burst of requests spawns one child, not one each. Holds
    /// the last spawn's failure (attempt number, error), if it failed; held across the spawn.
    spawn_lock: tokio::sync::Mutex<Option<(u64, String)>>,
    /// Spawn attempts finished.
    spawn_attempts: AtomicU64,
    metrics: Arc<WalRedoMetrics>,
    series: RequestSeries,
    /// Foreground requests before background ones.
    priority: Priority,
    reaping: Arc<Reaping>,
    cancel: CancellationToken,
    /// Set with `cancel` (by `shutdown`), read per request without the token's lock.
    stopping: AtomicBool,
    in_flight: TaskTracker,
}

impl WalRedoManager {
    /// Creates the manager; no child is spawned until the first request. Inside a tokio
    /// runtime, also starts the tasks that stop idle children and size the pool.
    pub fn new(tenant_id: &str, conf: WalRedoConf, metrics: Arc<WalRedoMetrics>) -> Arc<WalRedoManager> {
        static IDS: AtomicU64 = AtomicU64::new(0);
        let manager = Arc::new_cyclic(|me| WalRedoManager {
            tenant_id: tenant_id.to_string(),
            id: IDS.fetch_add(1, Ordering::Relaxed),
            kind: Mutex::new(conf.process_kind),
            pool: Mutex::new(Pool::new(Arc::clone(&conf.budget))),
            // Yielding until the controller's first period: blocking takes a slot of the
            // spin budget, which only the controller asks for.
            wait: Mutex::new(conf.auto_wait.unwrap_or(Wait::Yield)),
            blocks: AtomicBool::new(blocks(conf.process_kind, conf.auto_wait.unwrap_or(Wait::Yield))),
            conf,
            load: Arc::new(Load::default()),
            controller: Mutex::new(None),
            growing: AtomicBool::new(false),
            me: me.clone(),
            spawn_lock: tokio::sync::Mutex::new(None),
            spawn_attempts: AtomicU64::new(0),
            metrics,
            series: RequestSeries::redo(tenant_id),
            priority: Priority::new(),
            reaping: Reaping::new(),
            cancel: CancellationToken::new(),
            stopping: AtomicBool::new(false),
            in_flight: TaskTracker::new(),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(idle_watcher(
                Arc::downgrade(&manager),
                manager.cancel.clone(),
                manager.conf.idle_timeout,
            ));
            runtime.spawn(pool_controller(Arc::downgrade(&manager), manager.cancel.clone()));
        }
        manager
    }

    /// Reconstructs the page `tag` at `lsn` from an optional base image and the records above
    /// it (oldest first, each already encoded, with its LSN).
    ///
    /// Without records, the base image is returned as is and no child is involved. A child
    /// failure (crash, EOF, protocol violation) is retried once on a new child, since redo is a
    /// pure function of its input; a timeout or an error frame is not.
    ///
    /// Cancel-safe, for every kind: dropping the future never hands its reply to another
    /// request (a blocking round trip yields only while it waits for a pipe's lock, never
    /// mid-I/O; a yielding one dropped halfway through its write retires its child).
    pub async fn request_redo(
        &self,
        tag: BufferTag,
        lsn: Lsn,
        base: Option<Bytes>,
        records: &[(Lsn, Bytes)],
    ) -> Result<Bytes, RedoError> {
        let mut waited = Duration::ZERO;
        self.redo(tag, lsn, base, records, Class::Foreground, &mut waited).await
    }

    /// [`WalRedoManager::request_redo`] for background work (a compactor materializing page
    /// images): the same validation, shortcut without records, retry and cancel-safety, but it
    /// yields to foreground requests.
    ///
    /// The rule: background requests of a manager go one at a time, in arrival order (the next
    /// one waits until the previous one has its reply). The one whose turn it is waits while
    /// foreground requests are queued to write to the child (or wait for a child to be
    /// spawned), and goes once that queue is empty, or has been empty at some moment since it
    /// started waiting (under a closed-loop GetPage load, between two requests), or after
    /// waiting `wal_redo_timeout` at the latest, so that it cannot starve forever. It then
    /// queues for the child's writer behind the foreground requests already there. So a
    /// foreground request waits behind at most one background request, and a background
    /// request never overtakes a foreground one already queued to write. The wait blocks no
    /// thread and holds no child: it neither spawns one nor keeps an idle one alive.
    ///
    /// Cancel-safe, as [`WalRedoManager::request_redo`]; dropped while it waits for its turn,
    /// it gives up its place and the next background request goes.
    pub async fn request_redo_background(
        &self,
        tag: BufferTag,
        lsn: Lsn,
        base: Option<Bytes>,
        records: &[(Lsn, Bytes)],
    ) -> Result<Bytes, RedoError> {
        self.request_redo_background_timed(tag, lsn, base, records).await.0
    }

    /// [`WalRedoManager::request_redo_background`], and how long the request waited for its
    /// turn (before its first attempt and a retry): the time it did no work, for a caller that
    /// paces itself by the work it does.
    ///
    /// Cancel-safe, as [`WalRedoManager::request_redo_background`].
    pub async fn request_redo_background_timed(
        &self,
        tag: BufferTag,
        lsn: Lsn,
        base: Option<Bytes>,
        records: &[(Lsn, Bytes)],
    ) -> (Result<Bytes, RedoError>, Duration) {
        let mut waited = Duration::ZERO;
        let result = self.redo(tag, lsn, base, records, Class::Background, &mut waited).await;
        (result, waited)
    }

    /// Test hook: a place in the foreground writer queue, as a GetPage queued to write holds
    /// one, until dropped; background requests wait for their turn behind it (at most
    /// `wal_redo_timeout`).
    #[cfg(test)]
    pub(crate) fn hold_foreground_queue(&self) -> priority::WriteTicket<'_> {
        self.priority.foreground()
    }

    async fn redo(
        &self,
        tag: BufferTag,
        lsn: Lsn,
        base: Option<Bytes>,
        records: &[(Lsn, Bytes)],
        class: Class,
        waited: &mut Duration,
    ) -> Result<Bytes, RedoError> {
        validate_request(lsn, base.as_ref(), records)?;
        if records.is_empty() {
            if let Some(base) = base {
                return Ok(base);
            }
        }
        let request = Arc::new(Request::redo(&tag, base.as_ref(), records));
        self.metrics.records_per_request.observe(records.len() as f64);
        self.metrics.bytes_per_request.observe(request.len() as f64);
        match self.execute(&request, true, class, waited).await? {
            ChildReply::Page(page) => Ok(page),
            ChildReply::Error(code, message) => Err(self.count(RedoError::Rejected { code, message })),
            ChildReply::Hello(_) => {
                Err(self.count(RedoError::ProcessFailed(anyhow::anyhow!("unexpected hello"))))
            }
        }
    }

    /// Round trip to the child with a ping (spawning it if needed); the reply is a zero page.
    ///
    /// Cancel-safe in the same way as [`WalRedoManager::request_redo`].
    pub async fn ping(&self) -> Result<(), RedoError> {
        let mut frame = Vec::new();
        protocol::encode_ping(&mut frame);
        let mut waited = Duration::ZERO;
        match self.execute(&Arc::new(Request::frames(frame)), true, Class::Foreground, &mut waited).await? {
            ChildReply::Page(page) if page.len() == PAGE_SIZE && page.iter().all(|&b| b == 0) => Ok(()),
            other => Err(self.count(RedoError::ProcessFailed(anyhow::anyhow!("bad ping reply {other:?}")))),
        }
    }

    /// Sends `request` to the child in service, retrying once on a new child after a failure,
    /// and moving to another child (without using up the retry, up to [`MAX_MOVES`] times)
    /// when its child stalls with it queued behind another request; a background request
    /// first waits for its turn (see [`priority`]), before each attempt; those waits are added
    /// to `waited`.
    async fn execute(
        &self,
        request: &Arc<Request>,
        retry: bool,
        class: Class,
        waited: &mut Duration,
    ) -> Result<ChildReply, RedoError> {
        if self.shutting_down() {
            return Err(self.count(RedoError::ShuttingDown));
        }
        let _background_slot = match class {
            Class::Foreground => None,
            Class::Background => {
                self.metrics.background_requests.inc();
                let turn = self.priority.background_turn(self.conf.timeout);
                let wait = Instant::now();
                let slot = self.unless_shutting_down(turn).await;
                *waited += wait.elapsed();
                Some(slot?)
            }
        };
        let _in_flight = self.in_flight.token();
        // Timed from here: a background request's wait for its turn is not redo time.
        let started = Instant::now();
        self.load.arrive();
        let patience = self.conf.patience();
        let mut attempts_left = if retry { 2 } else { 1 };
        let mut moves_left = MAX_MOVES;
        let mut retrying = false;
        loop {
            attempts_left -= 1;
            let ticket = match class {
                Class::Foreground => self.priority.foreground(),
                Class::Background => {
                    if retrying {
                        // A retry waits for its turn again: the failure may have let
                        // foreground requests queue up for the new child.
                        let turn = self.priority.yield_to_foreground(self.conf.timeout);
                        let wait = Instant::now();
                        let yielded = self.unless_shutting_down(turn).await;
                        *waited += wait.elapsed();
                        yielded?;
                    }
                    WriteTicket::none()
                }
            };
            let process = self.get_or_spawn().await.map_err(|e| self.count(e))?;
            let taken = Instant::now();
            let result = process.round_trip(request, ticket, patience).await;
            self.load.finish(taken.elapsed());
            match result {
                // The child is working, only busy: it stays in service.
                Err(ProcessError::QueueTimeout(t)) => return Err(self.count(RedoError::QueueTimeout(t))),
                // Not this request's fault: it goes to another child, this one leaves service.
                Err(e @ ProcessError::Stalled { .. }) if moves_left > 0 && !self.shutting_down() => {
                    moves_left -= 1;
                    attempts_left += 1;
                    self.metrics.requests_moved.inc();
                    self.retire(&process, e.stop_cause());
                    continue;
                }
                Ok(reply) => {
                    self.load.served();
                    let took = started.elapsed().as_secs_f64();
                    self.metrics.redo_seconds.observe(took);
                    self.series.seconds.observe(took);
                    if matches!(reply, ChildReply::Page(_)) {
                        self.metrics.requests_ok.inc();
                    }
                    return Ok(reply);
                }
                Err(e) => {
                    self.retire(&process, e.stop_cause());
                    let retryable = !matches!(e, ProcessError::Timeout(_)) && !self.shutting_down();
                    if retryable && attempts_left > 0 {
                        tracing::warn!(
                            tenant_id = self.tenant_id,
                            pid = process.pid,
                            "walredo round trip failed, retrying on a new process: {e:#}"
                        );
                        retrying = true;
                        continue;
                    }
                    return Err(
                        self.count(RedoError::of_process(e, format!("walredo process {}", process.pid)))
                    );
                }
            }
        }
    }

    /// Runs `wait` unless or until the manager shuts down ([`RedoError::ShuttingDown`]).
    async fn unless_shutting_down<T>(
        &self,
        wait: impl std::future::Future<Output = T>,
    ) -> Result<T, RedoError> {
        let result = tokio::select! {
            output = wait => Ok(output),
            () = self.cancel.cancelled() => Err(()),
        };
        match result {
            Ok(output) if !self.shutting_down() => Ok(output),
            _ => Err(self.count(RedoError::ShuttingDown)),
        }
    }

    /// Counts a failed request by outcome and hands the error back.
    fn count(&self, e: RedoError) -> RedoError {
        if let Some(failed) = self.metrics.requests_failed(e.result_label()) {
            failed.inc();
        }
        self.series.errors.inc();
        e
    }

    /// Returns the child in service, counted as in use, spawning one if needed.
    ///
    /// Waiting for another request's spawn is bounded by `wal_redo_timeout` (then
    /// [`RedoError::QueueTimeout`]), and a spawn that fails fails every request that waited
    /// for it, instead of each spawning (and waiting out the hello timeout) in turn.
    async fn get_or_spawn(&self) -> Result<InUse, RedoError> {
        if let Some(process) = self.take_current() {
            return Ok(process);
        }
        let deadline = Instant::now() + self.conf.timeout;
        let attempts_seen = self.spawn_attempts.load(Ordering::Acquire);
        let mut spawning = tokio::time::timeout_at(deadline.into(), self.spawn_lock.lock())
            .await
            .map_err(|_| RedoError::QueueTimeout(self.conf.timeout))?;
        if let Some(process) = self.take_current() {
            return Ok(process);
        }
        if self.shutting_down() {
            return Err(RedoError::ShuttingDown);
        }
        if let Some((attempt, failure)) = spawning.as_ref() {
            if *attempt > attempts_seen {
                return Err(RedoError::ProcessFailed(anyhow::anyhow!(
                    "{failure} (a spawn this request waited for)"
                )));
            }
        }
        let (kind, spawned) = self.spawn_child().await;
        let attempt = self.spawn_attempts.fetch_add(1, Ordering::AcqRel) + 1;
        let process = match spawned {
            Ok(process) => {
                *spawning = None;
                process
            }
            Err(e) => {
                *spawning = Some((attempt, format!("{e:#}")));
                return Err(RedoError::ProcessFailed(e));
            }
        };
        let mut pool = lock(&self.pool);
        if self.shutting_down() {
            drop(pool);
            process.retire(StopCause::Shutdown);
            return Err(RedoError::ShuttingDown);
        }
        let in_use = InUse::new(&process);
        // The kind may have changed while the child started (set_process_kind takes the kind,
        // then the pool; we hold the pool): an old-kind child serves this request only.
        if *lock(&self.kind) != kind {
            drop(pool);
            process.retire(StopCause::KindChange);
            return Ok(in_use);
        }
        // Only the first child is spawned on the request path (the pool was empty, and under
        // the spawn lock nobody else adds one): it needs no budget token.
        pool.add(process);
        Ok(in_use)
    }

    /// Spawns a child of the current kind (not yet in the pool), on the controller's current
    /// path; returns the kind with it.
    async fn spawn_child(&self) -> (ProcessKind, anyhow::Result<Arc<Process>>) {
        let kind = *lock(&self.kind);
        let spawned = Process::spawn(
            &self.conf,
            kind,
            &self.tenant_id,
            Arc::clone(&self.metrics),
            Arc::clone(&self.reaping),
        )
        .await;
        if let Ok(process) = &spawned {
            process.set_wait(*lock(&self.wait));
        }
        (kind, spawned)
    }

    /// Sets how `auto` children wait (see [`ProcessKind::Auto`]): those in service now, and
    /// those spawned from now on; a wait pinned by the conf wins.
    fn set_wait(&self, wait: Wait) {
        let wait = self.conf.auto_wait.unwrap_or(wait);
        let mut current = lock(&self.wait);
        if *current != wait {
            tracing::debug!(tenant_id = self.tenant_id, path = wait.as_str(), "walredo path changes");
        }
        *current = wait;
        for child in lock(&self.pool).children() {
            child.set_wait(wait);
        }
        drop(current);
        self.refresh_blocks();
    }

    /// Spawns one more child in the background if the pool is below `target` and may grow;
    /// one such spawn at a time.
    fn grow(&self, target: usize) {
        let Some(me) = self.me.upgrade() else { return };
        if self.growing.swap(true, Ordering::AcqRel) {
            return;
        }
        tokio::spawn(async move {
            let _spawning = me.spawn_lock.lock().await;
            let reserved = {
                let mut pool = lock(&me.pool);
                pool.len() < target && pool.reserve(me.conf.max_pool_size)
            };
            if reserved && !me.shutting_down() {
                let (kind, spawned) = me.spawn_child().await;
                let mut pool = lock(&me.pool);
                match spawned {
                    Ok(process) if *lock(&me.kind) == kind && !me.shutting_down() => {
                        pool.add(process);
                        me.metrics.pool_resizes.with_label_values(&["grow"]).inc();
                    }
                    Ok(process) => {
                        pool.cancel_growth();
                        drop(pool);
                        let cause =
                            if me.shutting_down() { StopCause::Shutdown } else { StopCause::KindChange };
                        process.retire(cause);
                    }
                    Err(e) => {
                        pool.cancel_growth();
                        tracing::warn!(
                            tenant_id = me.tenant_id,
                            "could not add a walredo process to the pool: {e:#}"
                        );
                    }
                }
            }
            me.growing.store(false, Ordering::Release);
        });
    }

    /// Moves the pool towards `target` children: one more spawned in the background, or one
    /// idle child retired. An empty pool stays empty until a request needs a child.
    fn resize(&self, target: usize) {
        let (len, shrunk) = {
            let mut pool = lock(&self.pool);
            let shrunk = if pool.len() > target { pool.shrink_one(target) } else { None };
            (pool.len(), shrunk)
        };
        if let Some(process) = shrunk {
            tracing::info!(
                tenant_id = self.tenant_id,
                pid = process.pid,
                children = len,
                "walredo pool shrinks"
            );
            self.metrics.pool_resizes.with_label_values(&["shrink"]).inc();
            process.retire(StopCause::PoolShrink);
        } else if len > 0 && len < target {
            self.grow(target);
        }
    }

    /// The least-loaded child in service, if any, counted as in use under the pool's lock (so
    /// that the idle check never retires a child that a request has just taken); children
    /// found stalled on the way leave service.
    fn take_current(&self) -> Option<InUse> {
        let mut stalled = Vec::new();
        let picked = lock(&self.pool).pick(self.conf.patience(), &mut stalled);
        for process in stalled {
            process.retire(StopCause::Stalled);
        }
        picked
    }

    /// Takes `process` out of service (if it still is) and retires it for `cause`.
    fn retire(&self, process: &Arc<Process>, cause: StopCause) {
        let mut pool = lock(&self.pool);
        if cause == StopCause::Stalled {
            pool.remove_stalled(process);
        } else {
            pool.remove(process);
        }
        drop(pool);
        process.retire(cause);
    }

    /// Changes the kind of children spawned from now on. The child in service (if of the other
    /// kind) is taken out of service at once: requests already on it finish, then it exits.
    pub fn set_process_kind(&self, kind: ProcessKind) {
        *lock(&self.kind) = kind;
        self.refresh_blocks();
        let old = lock(&self.pool).remove_where(|p| p.kind != kind);
        for old in old {
            tracing::info!(
                tenant_id = self.tenant_id,
                pid = old.pid,
                kind = kind.as_str(),
                "walredo process kind changed"
            );
            old.retire(StopCause::KindChange);
        }
    }

    pub fn process_kind(&self) -> ProcessKind {
        *lock(&self.kind)
    }

    /// Shutdown began: no new request starts, none retries.
    fn shutting_down(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Recomputes [`WalRedoManager::may_block`] after a change of the kind or the path (under
    /// both locks, taken in that order, so that the last change's value stays).
    fn refresh_blocks(&self) {
        let kind = lock(&self.kind);
        let wait = lock(&self.wait);
        self.blocks.store(blocks(*kind, *wait), Ordering::Relaxed);
    }

    /// Whether a request's round trip may block the thread that awaits it (the `sync` kind, or
    /// `auto` on its blocking path), rather than only yield. A hint, read without a lock: the
    /// path can change while a request runs.
    pub fn may_block(&self) -> bool {
        self.blocks.load(Ordering::Relaxed)
    }

    pub fn status(&self) -> WalRedoStatus {
        let children: Vec<ProcessStatus> = lock(&self.pool)
            .children()
            .iter()
            .filter(|p| !p.has_exited())
            .map(|p| ProcessStatus {
                kind: p.kind,
                pid: p.pid,
                uptime_seconds: p.started.elapsed().as_secs_f64(),
                requests_served: p.served.load(Ordering::Relaxed),
                in_flight: p.in_flight.load(Ordering::Relaxed),
                spin_us: p.spin_us(),
                path: p.wait().as_str(),
            })
            .collect();
        WalRedoStatus {
            process_kind: self.process_kind(),
            process: children.first().cloned(),
            pool: PoolStatus {
                children,
                max_children: self.conf.max_pool_size,
                controller: lock(&self.controller).clone(),
            },
            requests_served: self.load.requests_served(),
            last_exit: self.reaping.last_exit(),
        }
    }

    /// The tenant's redo series (`tenant_series`).
    pub fn series(&self) -> &RequestSeries {
        &self.series
    }

    /// Children in the pool now, and how many of them spin between requests.
    pub fn children_and_spinning(&self) -> (usize, usize) {
        let pool = lock(&self.pool);
        let children = pool.children();
        (children.len(), children.iter().filter(|p| p.spin_us() > 0).count())
    }

    /// Stops taking requests, waits for the ones in flight, then kills and reaps the child.
    /// Idempotent. Cancel-safe: if dropped, the child is still killed and reaped, in the
    /// background, once the last request lets go of it.
    pub async fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        self.cancel.cancel();
        self.in_flight.close();
        self.in_flight.wait().await;
        // Take the spawn lock so that no spawn is half done while we look at the slot.
        let _spawning = self.spawn_lock.lock().await;
        let children = lock(&self.pool).remove_where(|_| true);
        self.conf.spin_budget.withdraw(self.id);
        for process in children {
            process.retire_and_wait(StopCause::Shutdown).await;
        }
        self.publish_extra_children();
        // Children retired earlier (failed, drained after a kind change) may still be reaping.
        self.reaping.all_reaped().await;
    }

    /// Gives the `spinning` oldest children the spin window `spin` and the others none (a
    /// parked child blocks between requests). Only windows that change are sent, each by a
    /// task of its own, so a busy child (the frame queues behind its requests) holds up
    /// nothing; windows of one child are serialized by the child's own lock.
    fn apply_spin(&self, spinning: usize, spin: Duration) {
        let Some(me) = self.me.upgrade() else { return };
        if self.shutting_down() {
            return;
        }
        let children = lock(&self.pool).children().to_vec();
        for (i, child) in children.into_iter().enumerate() {
            let window = if i < spinning { spin } else { Duration::ZERO };
            if child.spin_us() == process::spin_micros(window) || !child.supports_spin() {
                continue;
            }
            let me = Arc::clone(&me);
            let _in_flight = self.in_flight.token();
            tokio::spawn(async move {
                let _in_flight = _in_flight;
                if let Err(e) = me.set_spin_of(&child, window).await {
                    tracing::debug!(
                        tenant_id = me.tenant_id,
                        pid = child.pid,
                        "could not set the spin window: {e}"
                    );
                }
            });
        }
    }

    /// The controller's decision cut to what the daemon-wide [`SpinBudget`] grants this
    /// tenant: spinning children, and for an `auto` tenant the blocking path, each take a slot;
    /// without one (none are granted under CPU pressure), its children park and its round
    /// trips yield. The bid's score is the gain per CPU of spinning, one over the period's idle
    /// gap per child (0 without requests).
    fn within_spin_budget(&self, decision: Decision, obs: &Observation) -> Decision {
        let blocks = decision.wait == Wait::Block
            && self.conf.auto_wait.is_none()
            && *lock(&self.kind) == ProcessKind::Auto;
        let spins = if self.conf.adaptive_spin { decision.spinning } else { 0 };
        let wanted = spins.max(usize::from(blocks));
        // An idle tenant (no request this period) bids last: its path costs nothing until
        // requests come, and then the next period bids for them.
        let score = if obs.arrivals == 0 { 0.0 } else { 1.0 / obs.idle_gap().as_secs_f64().max(1e-9) };
        let bid = (wanted > 0).then_some(Bid { score, wanted });
        let granted = self.conf.spin_budget.grant(self.id, bid, Instant::now());
        self.metrics.spin_slots_granted.set(self.conf.spin_budget.granted() as i64);
        self.metrics.spin_held_back.set(i64::from(self.conf.spin_budget.pressed()));
        let spinning = decision.spinning.min(granted);
        Decision {
            spinning,
            spin: if spinning == 0 { Duration::ZERO } else { decision.spin },
            wait: if blocks && granted == 0 { Wait::Yield } else { decision.wait },
            ..decision
        }
    }

    /// Sets this tenant's `pageserver_wal_redo_pool_extra_children`, or removes it at 0.
    fn publish_extra_children(&self) {
        let extra = lock(&self.pool).len().saturating_sub(1);
        let gauge = &self.metrics.pool_extra_children;
        if extra > 0 {
            gauge.with_label_values(&[&self.tenant_id]).set(extra as i64);
        } else {
            // Absent already is fine.
            let _ = gauge.remove_label_values(&[&self.tenant_id]);
        }
    }

    /// Stops every child idle for `idle_timeout` with nothing in flight.
    fn stop_if_idle(&self, idle_timeout: Duration) {
        let idle = lock(&self.pool)
            .remove_where(|p| p.in_flight.load(Ordering::Relaxed) == 0 && p.idle_for() >= idle_timeout);
        for process in idle {
            process.retire(StopCause::Idle);
        }
    }
}

/// Whose request it is: foreground (GetPage) requests go before background ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Foreground,
    Background,
}

/// Checks the idle child now and then, until the manager is gone or shut down.
async fn idle_watcher(manager: Weak<WalRedoManager>, cancel: CancellationToken, idle_timeout: Duration) {
    let period = (idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(10));
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(period) => {}
        }
        match manager.upgrade() {
            Some(manager) => manager.stop_if_idle(idle_timeout),
            None => return,
        }
    }
}

/// Sizes the pool every [`pool::PERIOD`] with the adaptive worker controller, until the manager
/// is gone or shut down.
async fn pool_controller(weak: Weak<WalRedoManager>, cancel: CancellationToken) {
    let Some(max) = weak.upgrade().map(|m| m.conf.max_pool_size) else { return };
    let conf = WorkerControllerConf::new(max.max(1), max_spinning_for_cpus(pool::cpus()));
    let mut controller = match WorkerController::new(conf) {
        Ok(controller) => controller,
        Err(e) => {
            tracing::error!("walredo pool controller not started: {e:#}");
            return;
        }
    };
    let mut sampler = Sampler::new();
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(pool::PERIOD) => {}
        }
        let Some(manager) = weak.upgrade() else { return };
        let (children, stuck) = {
            let mut pool = lock(&manager.pool);
            let stuck = pool.stuck(Instant::now(), pool::PERIOD);
            (pool.children().to_vec(), stuck)
        };
        let obs = sampler.observe(&manager.load, &children, stuck);
        drop(children);
        let decision = manager.within_spin_budget(controller.update(obs), &obs);
        *lock(&manager.controller) =
            Some(ControllerStatus::new(&obs, controller.smoothed_demand(), &decision));
        manager.resize(decision.workers);
        manager.set_wait(decision.wait);
        if manager.conf.adaptive_spin {
            manager.apply_spin(decision.spinning, decision.spin);
        }
        manager.publish_extra_children();
        // Nothing to decide until a request comes: no request this period, at most one child,
        // and none spinning.
        let settled = obs.arrivals == 0 && decision.spinning == 0 && {
            let pool = lock(&manager.pool);
            pool.len() <= 1 && pool.children().iter().all(|p| p.spin_us() == 0)
        };
        if settled {
            // Without holding the manager: a manager dropped meanwhile ends this task at the
            // next check.
            let load = Arc::clone(&manager.load);
            drop(manager);
            loop {
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = load.next_arrival() => break,
                    () = tokio::time::sleep(Duration::from_secs(10)) => {
                        if weak.strong_count() == 0 {
                            return;
                        }
                    }
                }
            }
            // The sleep is not a period of the controller's: the next period starts now (and
            // counts the request that ended the sleep).
            sampler.restart_period();
        }
    }
}

/// Checks a request before anything is spawned or written: the base image is a page, the
/// records are within the limits and in LSN order.
fn validate_request(lsn: Lsn, base: Option<&Bytes>, records: &[(Lsn, Bytes)]) -> Result<(), RedoError> {
    let invalid = |message: String| Err(RedoError::InvalidRequest(message));
    if base.is_none() && records.is_empty() {
        return invalid("no base image and no records".to_string());
    }
    if records.len() > MAX_RECORDS_PER_REQUEST {
        return invalid(format!("{} records, at most {MAX_RECORDS_PER_REQUEST} allowed", records.len()));
    }
    let mut previous = Lsn::INVALID;
    for &(record_lsn, ref record) in records {
        if let Err(e) = protocol::check_record_len(record) {
            return invalid(format!("record at LSN {record_lsn}: {e}"));
        }
        if record_lsn < previous || record_lsn > lsn {
            return invalid(format!("record LSN {record_lsn} out of order or above the request LSN {lsn}"));
        }
        previous = record_lsn;
    }
    match base {
        Some(base) if base.len() != PAGE_SIZE => {
            invalid(format!("base image of {} bytes, expected {PAGE_SIZE}", base.len()))
        }
        _ => Ok(()),
    }
}
