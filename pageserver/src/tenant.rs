//! One tenant: its storage (a [`Timeline`]), its redo manager, its config overrides, and the
//! GetPage@LSN path that ties them together through the page cache.
//!
//! GetPage(key, lsn):
//! 1. "latest" resolves to the last durable LSN; a higher LSN waits (bounded) for ingest;
//! 2. the page version (LSN of the newest value at or below `lsn`) is looked up in the index;
//!    none: not found;
//! 3. page cache hit: done;
//! 4. otherwise the newest image and the records above it are read from disk (after checking
//!    their count and size against the redo limits from the index alone); an image with no
//!    records is the page itself, else the redo manager reconstructs it; for a cluster with
//!    data checksums it gets its checksum ([`data_checksums`]); the page is cached.
//!
//! Besides relation pages, GetPage serves the cluster's SLRU pages (built the same way; not
//! found once their segment is truncated, [`cluster`]) and the checkpoint counters (their
//! value, zero-padded to a page); the cluster's other keys are no GetPage's.
//!
//! Steps 2 to 4 look the key up in the index once and the page cache once: at a durable LSN,
//! [`Tenant::get_page_now`] takes the version and the cache's page for it in one lookup, and on
//! a miss [`Tenant::get_page_later`] plans the read from that lookup; a request that waits for
//! its LSN (or whose lookup would wait for the disk) makes its one lookup after the wait, the
//! read's plan, which names the version.
//!
//! Invariant: every request carries the tenant id in its tracing span; page bytes are shared
//! `Bytes` end to end (storage or redo child -> cache -> reply).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use page_types::keys::RelTag;
use page_types::{BufferTag, Lsn};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::compaction::{
    CompactError, CompactionMetrics, CompactionSettings, CompactionStatus, Compactor, PassSummary,
};
use crate::metrics::sharded::{ShardedSums, TENANT_SHARDS};
use crate::metrics::RequestSeries;
use crate::page_cache::PageCache;
use crate::redo_budget::{Overloaded, RedoBudget};
use crate::remote::{self, RemoteStatus, RemoteTimeline};
use crate::storage::{
    self, DiskWait, GetError, IngestBatch, IngestError, Lookup, ReadLimits, ReadPlan, ReadStart, Timeline,
    WaitLsnError,
};
use crate::util::{lock, Signal};
use crate::walredo::{ProcessKind, RedoError, WalRedoManager, WalRedoStatus};

pub mod cluster;
mod data_checksums;
pub mod database_copy;
pub mod rel_sizes;
pub mod wal_receiver;

use wal_receiver::{SourceFile, WalReceiver, WalSource, WalSourceStatus};

/// What one GetPage may read to rebuild a page (checked from the index before reading).
const RECONSTRUCT_LIMITS: ReadLimits = ReadLimits {
    max_records: page_types::MAX_RECORDS_PER_REQUEST,
    max_bytes: page_types::MAX_RECONSTRUCT_BYTES,
};

/// A chain of records longer than one redo request takes ([`RECONSTRUCT_LIMITS`]) is rebuilt
/// in pieces of at most this much, oldest first, each from the page the one before built: as a
/// compaction pass rebuilds one ([`storage::IMAGE_PIECE_BYTES`]). Such a chain is one that
/// compaction has not imaged yet, or cannot (a record the child refuses): its GetPage then fails
/// only as its records do (`unsupported_record`), never for its length.
const PIECE_LIMITS: ReadLimits =
    ReadLimits { max_records: page_types::MAX_RECORDS_PER_REQUEST, max_bytes: storage::IMAGE_PIECE_BYTES };

/// The longest chain rebuilt in pieces: the index entries of the whole chain are held while it
/// is (about 100 bytes each), and its values are read a piece at a time. Past it a GetPage fails
/// (`redo_failed`, "too expensive to rebuild").
const PIECED_CHAIN_LIMITS: ReadLimits = ReadLimits { max_records: 1 << 18, max_bytes: 4 << 30 };

/// Default of `wait_lsn_timeout`: the longest a GetPage waits for ingest to reach its LSN.
pub const DEFAULT_WAIT_LSN_TIMEOUT: Duration = Duration::from_secs(60);

/// File in the tenant's directory holding its overrides; its presence marks a complete tenant.
pub const TENANT_CONFIG_FILE: &str = "tenant.toml";

/// A tenant's own settings; `None` falls back to the daemon's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfOverrides {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub walredo_process_kind: Option<ProcessKind>,
}

/// The settings in force for a tenant.
#[derive(Debug, Clone, Serialize)]
pub struct EffectiveTenantConf {
    pub walredo_process_kind: ProcessKind,
}

/// Why a GetPage failed; the page service maps each to an error code.
#[derive(Debug, thiserror::Error)]
pub enum GetPageError {
    #[error("no page {key} at or below LSN {lsn}")]
    NotFound { key: BufferTag, lsn: Lsn },
    #[error("LSN {lsn} is below the GC cutoff {cutoff} (gc_horizon): older page versions are gone")]
    BelowGcCutoff { lsn: Lsn, cutoff: Lsn },
    /// The tenant's initial import has not finished (or was interrupted and not yet taken
    /// again): what it stored so far is a part of a fuzzy base backup.
    #[error(
        "the tenant's import of its PostgreSQL's base backup is not complete (see wal_source.import \
         in its status): its pages are partial until it is"
    )]
    ImportIncomplete,
    #[error(transparent)]
    WaitLsn(#[from] WaitLsnError),
    #[error(transparent)]
    Redo(#[from] RedoError),
    #[error("tenant is shutting down")]
    ShuttingDown,
    /// A request for something that is not a relation page or fork.
    #[error("invalid request: {0}")]
    InvalidKey(String),
    #[error(
        "the daemon's redo memory budget (walredo_memory_budget) had no room for this request's {bytes} bytes within {waited:?}"
    )]
    Overloaded { bytes: u64, waited: Duration },
    #[error("read page: {0:#}")]
    Internal(anyhow::Error),
}

impl From<Overloaded> for GetPageError {
    fn from(Overloaded { bytes, waited }: Overloaded) -> GetPageError {
        GetPageError::Overloaded { bytes, waited }
    }
}

/// The reads of a page: one plan, or a chain too long for one redo request in pieces, oldest
/// first ([`PIECE_LIMITS`]).
enum Planned {
    Whole(ReadPlan),
    Pieces(Vec<ReadPlan>),
}

impl Planned {
    /// The page's version: the LSN of its newest value, the page cache's key.
    fn version(&self) -> Lsn {
        match self {
            Planned::Whole(plan) => plan.newest_lsn(),
            Planned::Pieces(pieces) => pieces.last().map_or(Lsn(0), ReadPlan::newest_lsn),
        }
    }
}

/// What [`Tenant::get_page_now`] answers.
pub enum PageNow {
    /// The page, from the page cache, and the LSN served (counted as a GetPage).
    Page(Lsn, Bytes),
    /// Not answered without waiting: [`Tenant::get_page_later`] answers it.
    Later(PageRead),
}

impl PageNow {
    /// The page, if it was answered now.
    #[cfg(test)]
    pub(crate) fn page(self) -> Option<(Lsn, Bytes)> {
        match self {
            PageNow::Page(lsn, page) => Some((lsn, page)),
            PageNow::Later(_) => None,
        }
    }
}

/// A GetPage that [`Tenant::get_page_now`] did not answer: the key, the LSN asked for, and,
/// where it looked the key up, the LSN served (durable) and the read that lookup began.
pub struct PageRead {
    key: BufferTag,
    lsn: Lsn,
    begun: Option<(Lsn, ReadStart)>,
}

/// A storage read's failure as a GetPage's, for `key` at `lsn`.
pub(crate) fn read_error(key: BufferTag, lsn: Lsn, e: GetError) -> GetPageError {
    match e {
        GetError::NotFound { .. } => GetPageError::NotFound { key, lsn },
        GetError::BelowGcCutoff { lsn, cutoff } => GetPageError::BelowGcCutoff { lsn, cutoff },
        // The same refusal the redo manager would give, before anything is read.
        GetError::TooLarge(why) => GetPageError::Redo(RedoError::InvalidRequest(why)),
        GetError::Io(e) => GetPageError::Internal(e),
    }
}

/// Whether a tenant serves (`active`) or could not be loaded (`broken`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantState {
    Active,
    Broken,
}

#[derive(Debug, Clone, Serialize)]
pub struct TenantStatus {
    pub id: String,
    pub state: TenantState,
    pub last_durable_lsn: Lsn,
    pub config: TenantConfOverrides,
    pub effective_config: EffectiveTenantConf,
    pub walredo: WalRedoStatus,
    pub storage: StorageStatus,
    pub compaction: CompactionStatus,
    pub counters: TenantCounters,
    /// Its WAL source (`PUT /v1/tenant/{id}/wal_source`), if it has one.
    pub wal_source: Option<WalSourceStatus>,
    /// With remote storage, its uploads.
    pub remote: Option<RemoteStatus>,
}

/// What `GET /v1/tenant/{id}/timeline/{timeline}` shows of a timeline.
#[derive(Debug, Clone, Serialize)]
pub struct TimelineStatus {
    pub tenant_id: String,
    pub timeline_id: String,
    /// The timeline it branched from (`null` for `main`).
    pub ancestor_timeline_id: Option<String>,
    /// Its branch point: what it reads of its ancestor is as of this LSN.
    pub ancestor_lsn: Option<Lsn>,
    pub durable_lsn: Lsn,
    /// Reads below it are refused; a branch below it is refused.
    pub gc_cutoff: Lsn,
    /// The branch points of the timelines branched from it: GC keeps what they read.
    pub branch_points: Vec<Lsn>,
    pub storage: StorageStatus,
    pub wal_source: Option<WalSourceStatus>,
    /// With remote storage, its uploads.
    pub remote: Option<RemoteStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StorageStatus {
    pub keys: u64,
    pub values: u64,
    pub layers: u64,
    /// Groups of layers a lookup looks at (one layer in each): what a GetPage may read below
    /// the active segment.
    pub runs: u64,
    /// Layers whose files are on local disk (with remote storage, the others are fetched from
    /// the bucket when read).
    pub resident_layers: u64,
    /// Bytes on local disk: the resident layers and the active segment.
    pub disk_bytes: u64,
    /// Bytes of the active segment's small records kept in memory for reads (at most 16 MiB):
    /// see docs/storage-format.md, "Reading".
    pub record_copy_bytes: u64,
    /// Set while the tenant's storage writes fail (ingest refused): see docs/storage-format.md.
    pub write_error: Option<StorageWriteErrorStatus>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StorageWriteErrorStatus {
    pub error: String,
    /// When this episode of failures began (RFC 3339, UTC).
    pub since: String,
    /// Not retried: the tenant must be reloaded (daemon restart).
    pub fatal: bool,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct TenantCounters {
    pub get_page_requests: u64,
    pub ingest_batches: u64,
    pub ingested_values: u64,
}

/// What a tenant needs from the daemon.
pub struct TenantDeps {
    pub cache: Arc<PageCache>,
    pub compaction: CompactionSettings,
    pub compaction_metrics: Arc<CompactionMetrics>,
    pub wal_receiver_metrics: Arc<wal_receiver::WalReceiverMetrics>,
    pub redo_budget: Arc<RedoBudget>,
    pub wait_lsn_timeout: Duration,
    /// `wal_max_record_size`.
    pub wal_max_record_size: u32,
    pub default_process_kind: ProcessKind,
}

/// The id of a tenant's first timeline, the one it is created with (its other timelines are
/// branches: [`crate::tenants`]).
pub const MAIN_TIMELINE: &str = "main";

/// One timeline of a tenant, served: its storage, redo manager, compactor and WAL receiver. The
/// tenant's `main` timeline carries the tenant's settings (`tenant.toml`); a branch is built
/// with them. Built by [`crate::tenants::Tenants`], which owns the directory layout.
pub struct Tenant {
    /// Itself, for what it hands out that calls back into it (its WAL receiver's GetPage).
    pub(crate) me: std::sync::Weak<Tenant>,
    pub id: String,
    /// Which of the tenant's timelines this is: [`MAIN_TIMELINE`], or a branch's id.
    pub timeline_id: String,
    /// A branch's ancestor (what serves it) and branch point; its storage reads the
    /// ancestor's at or below that point ([`storage::Ancestor`]).
    pub(crate) ancestor: Option<(Arc<Tenant>, Lsn)>,
    /// Unique per process, so that a re-created tenant never sees its predecessor's cache.
    pub(crate) generation: u64,
    pub(crate) dir: PathBuf,
    pub(crate) timeline: Arc<Timeline>,
    pub(crate) walredo: Arc<WalRedoManager>,
    pub(crate) compactor: Arc<Compactor>,
    pub(crate) overrides: Mutex<TenantConfOverrides>,
    pub(crate) deps: Arc<TenantDeps>,
    /// Cancelled when the tenant stops.
    pub cancel: CancellationToken,
    /// Raised with `cancel` ([`Tenant::stop_serving`]): what its connections watch (without
    /// the token's lock).
    pub(crate) stopping: Arc<Signal>,
    pub(crate) counters: Counters,
    /// Its GetPage series, exported while it is among the busiest tenants (`tenant_series`).
    pub(crate) get_page_series: RequestSeries,
    /// The receiver following its WAL source, if it has one.
    pub(crate) wal_receiver: Mutex<Option<Arc<WalReceiver>>>,
    /// Serializes attaching and detaching the WAL source.
    pub(crate) wal_source_change: tokio::sync::Mutex<()>,
    /// Raised while its initial import is incomplete (running, or interrupted): reads are
    /// refused ([`GetPageError::ImportIncomplete`]). Its WAL receiver raises and lowers it; at
    /// load, the source file says.
    pub(crate) import_incomplete: Arc<AtomicBool>,
    /// Raised once it has a WAL source file (attached or detached): its keys are a PostgreSQL
    /// cluster's, whose relfilenodes can be dropped and reused, so a page read checks that its
    /// newest value is of the relation that has the relfilenode then
    /// ([`rel_sizes::dropped_incarnation`]).
    pub(crate) follows_postgres: AtomicBool,
    /// Whether its cluster has data checksums, which pages get as they are built.
    pub(crate) data_checksums: data_checksums::DataChecksums,
    /// With remote storage, the timeline's uploader.
    pub(crate) remote: Option<Arc<RemoteTimeline>>,
}

/// Request counters of a tenant (GetPage's in shards: every executor thread counts it).
pub(crate) struct Counters {
    /// Exported in the tenant status only (sum 0).
    get_page_requests: ShardedSums,
    ingest_batches: AtomicU64,
    ingested_values: AtomicU64,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters {
            get_page_requests: ShardedSums::new(1, TENANT_SHARDS),
            ingest_batches: AtomicU64::new(0),
            ingested_values: AtomicU64::new(0),
        }
    }
}

impl Tenant {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn last_durable_lsn(&self) -> Lsn {
        self.timeline.last_durable_lsn()
    }

    /// The page `key` as of `lsn` ([`Lsn::LATEST`]: the last durable LSN), and the LSN served.
    ///
    /// Cancel-safe: dropping it abandons the wait or the redo (see
    /// [`WalRedoManager::request_redo`]); nothing is left half done.
    pub async fn get_page(&self, key: BufferTag, lsn: Lsn) -> Result<(Lsn, Bytes), GetPageError> {
        self.get_page_later(PageRead { key, lsn, begun: None }).await
    }

    /// The page of a GetPage that [`Tenant::get_page_now`] did not answer, and the LSN served:
    /// [`Tenant::get_page`], going on from what `get_page_now` found (the page's version and
    /// the read's plan-to-be) where it found anything, instead of looking the key up again.
    ///
    /// Cancel-safe as [`Tenant::get_page`].
    pub async fn get_page_later(&self, read: PageRead) -> Result<(Lsn, Bytes), GetPageError> {
        self.counters.get_page_requests.add(0, 1);
        let started = Instant::now();
        let result = self.read_page(read).await;
        self.get_page_series.seconds.observe(started.elapsed().as_secs_f64());
        if result.is_err() {
            self.get_page_series.errors.inc();
        }
        result
    }

    /// What [`Tenant::get_page`] would answer without waiting for anything: a page in the page
    /// cache at an LSN already durable (counted as a GetPage). Otherwise (the LSN is ahead, the
    /// page must be read or rebuilt, or the request fails) the request for
    /// [`Tenant::get_page_later`], with what this found: one lookup of the index names the
    /// page's version, which the page cache is asked for, and on a miss the read goes on from
    /// that lookup (a miss looks the key up once and the page cache once).
    ///
    /// For callers that would spawn a task per request: a cache hit needs none.
    pub fn get_page_now(&self, key: BufferTag, lsn: Lsn) -> PageNow {
        let later = |begun| PageNow::Later(PageRead { key, lsn, begun });
        let started = Instant::now();
        // The cluster's other values (SLRU pages, the counters) take the long way: their
        // existence is checked otherwise (`read_page`).
        if !self.deps.cache.enabled()
            || !page_types::keys::is_rel_page(&key)
            || self.stopping.is_raised()
            || self.import_incomplete.load(Ordering::Acquire)
        {
            return later(None);
        }
        let durable = self.timeline.last_durable_lsn();
        let served = match lsn {
            Lsn::LATEST => durable,
            lsn if lsn <= durable => lsn,
            _ => return later(None),
        };
        // Without waiting for the disk: an index block missing from the kernel's page cache
        // sends the request the other way, which reads it off the executor.
        let cached = |version: Lsn| self.deps.cache.get(&(self.generation, key, version));
        let (version, found) = match self.timeline.lookup(key, served, cached) {
            Ok(Lookup::Cached { version, value: page }) => (version, Ok(page)),
            Ok(Lookup::Read(start)) => (start.version(), Err(start)),
            Ok(Lookup::NotFound) | Err(_) => return later(None),
        };
        if self.follows_postgres.load(Ordering::Relaxed)
            && rel_sizes::dropped_incarnation(&self.timeline, key, Some(version), served, DiskWait::Refused)
                .unwrap_or(true)
        {
            return later(None);
        }
        match found {
            Ok(page) => {
                self.counters.get_page_requests.add(0, 1);
                self.get_page_series.seconds.observe(started.elapsed().as_secs_f64());
                PageNow::Page(served, page)
            }
            Err(start) => later(Some((served, start))),
        }
    }

    /// Whether [`Tenant::get_page`] may block the thread that polls it while it waits for a
    /// redo child (see [`WalRedoManager::may_block`]), rather than only yield: a caller that
    /// polls other requests' futures alongside gives such a request a task of its own.
    pub fn get_page_may_block(&self) -> bool {
        self.walredo.may_block()
    }

    /// Fails while the tenant stops or its initial import is incomplete: it serves no read then.
    fn check_serving(&self) -> Result<(), GetPageError> {
        if self.stopping.is_raised() {
            return Err(GetPageError::ShuttingDown);
        }
        if self.import_incomplete.load(Ordering::Acquire) {
            return Err(GetPageError::ImportIncomplete);
        }
        Ok(())
    }

    /// `lsn` once it is durable here ([`Lsn::LATEST`]: the last durable LSN), waiting up to
    /// `wait_lsn_timeout` for it.
    pub(crate) async fn wait_for(&self, lsn: Lsn) -> Result<Lsn, GetPageError> {
        self.check_serving()?;
        if lsn == Lsn::LATEST {
            return Ok(self.timeline.last_durable_lsn());
        }
        tokio::select! {
            waited = self.timeline.wait_lsn(lsn, self.deps.wait_lsn_timeout) => waited?,
            () = self.cancel.cancelled() => return Err(GetPageError::ShuttingDown),
        }
        Ok(lsn)
    }

    /// The number of blocks of `fork` of `rel` as of `lsn` (`None`: the fork does not exist
    /// then), and the LSN served: [`rel_sizes::rel_size_at`] once `lsn` is durable.
    pub async fn get_rel_size(
        &self,
        rel: RelTag,
        fork: u8,
        lsn: Lsn,
    ) -> Result<(Lsn, Option<u32>), GetPageError> {
        if fork > page_types::keys::MAX_FORK {
            return Err(GetPageError::InvalidKey(format!("fork {fork} of {rel}: forks are 0 to 3")));
        }
        let lsn = self.wait_for(lsn).await?;
        let blocks = rel_sizes::rel_size_at(&self.timeline, rel, fork, lsn).await.map_err(|e| match e {
            GetError::BelowGcCutoff { lsn, cutoff } => GetPageError::BelowGcCutoff { lsn, cutoff },
            e => GetPageError::Internal(anyhow::Error::new(e)),
        })?;
        Ok((lsn, blocks))
    }

    /// [`Tenant::get_page_later`] without its accounting.
    async fn read_page(&self, read: PageRead) -> Result<(Lsn, Bytes), GetPageError> {
        let PageRead { key, lsn, begun } = read;
        if !page_types::keys::is_rel_page(&key) {
            return self.read_cluster_value(key, lsn).await;
        }
        if let Some((lsn, start)) = begun {
            // `get_page_now` looked the key up at a durable LSN: the page cache had no page of
            // its version, which (for a tenant that follows PostgreSQL) is of the relation that
            // has the relfilenode then. The read goes on from that lookup.
            self.check_serving()?;
            let plan = self.plan(key, lsn, Some(start)).await.map_err(|e| read_error(key, lsn, e))?;
            return self.build_page(key, lsn, plan).await;
        }
        let lsn = self.wait_for(lsn).await?;
        // One lookup of the index: the plan (the limits are checked there) names the page's
        // version, its newest value, which is what the page cache knows it by.
        let plan = match self.plan(key, lsn, None).await {
            Ok(plan) => Some(plan),
            Err(GetError::NotFound { .. }) => None,
            Err(e) => return Err(read_error(key, lsn, e)),
        };
        if self.follows_postgres.load(Ordering::Relaxed) {
            let version = plan.as_ref().map(|p| p.version());
            if version.is_none()
                || rel_sizes::dropped_incarnation(&self.timeline, key, version, lsn, DiskWait::Allowed)
                    .map_err(|e| read_error(key, lsn, e))?
            {
                return match rel_sizes::unwritten_page(&self.timeline, key, lsn).await {
                    Ok(Some(page)) => Ok((lsn, page)),
                    Ok(None) => Err(GetPageError::NotFound { key, lsn }),
                    Err(e) => Err(read_error(key, lsn, e)),
                };
            }
        }
        let plan = plan.ok_or(GetPageError::NotFound { key, lsn })?;
        if let Some(page) = self.deps.cache.get(&(self.generation, key, plan.version())) {
            return Ok((lsn, page));
        }
        self.build_page(key, lsn, plan).await
    }

    /// GetPage of a key that is no relation page: an SLRU page (not found if its segment was
    /// truncated after its newest value) or the checkpoint counters (their value, zero-padded
    /// to a page); any other key is no GetPage's.
    async fn read_cluster_value(&self, key: BufferTag, lsn: Lsn) -> Result<(Lsn, Bytes), GetPageError> {
        let slru = match page_types::keys::classify(&key) {
            page_types::keys::KeyKind::Slru { kind, segno, .. } => Some((kind, segno)),
            page_types::keys::KeyKind::Checkpoint => None,
            _ => {
                return Err(GetPageError::InvalidKey(format!(
                    "{key}: fork {} is not a relation fork (0 main, 1 fsm, 2 vm, 3 init), an SLRU page \
                     or the checkpoint counters",
                    key.forknum
                )))
            }
        };
        let lsn = self.wait_for(lsn).await?;
        let plan = self.plan(key, lsn, None).await.map_err(|e| read_error(key, lsn, e))?;
        if let Some((kind, segno)) = slru {
            if cluster::slru_segment_dropped(
                &self.timeline,
                kind,
                segno,
                plan.version(),
                lsn,
                DiskWait::Allowed,
            )
            .map_err(|e| read_error(key, lsn, e))?
            {
                return Err(GetPageError::NotFound { key, lsn });
            }
        }
        if let Some(page) = self.deps.cache.get(&(self.generation, key, plan.version())) {
            return Ok((lsn, page));
        }
        self.build_page(key, lsn, plan).await
    }

    /// The reads of `key` at `lsn` (from what `start`, a lookup, found, or else a lookup now):
    /// one plan within [`RECONSTRUCT_LIMITS`], or a longer chain in pieces ([`PIECE_LIMITS`]).
    async fn plan(&self, key: BufferTag, lsn: Lsn, start: Option<ReadStart>) -> Result<Planned, GetError> {
        let whole = match start {
            Some(start) => self.timeline.plan_read_from(start, RECONSTRUCT_LIMITS).await,
            None => self.timeline.plan_read_async(key, lsn, RECONSTRUCT_LIMITS).await,
        };
        match whole {
            Ok(plan) => Ok(Planned::Whole(plan)),
            Err(GetError::TooLarge(_)) => {
                let pieces =
                    self.timeline.plan_read_pieces(key, lsn, PIECED_CHAIN_LIMITS, PIECE_LIMITS).await?;
                Ok(Planned::Pieces(pieces))
            }
            Err(e) => Err(e),
        }
    }

    /// The page `key` as of `lsn` built from `plan` (its values read, redone if they are more
    /// than an image; a chain in pieces, oldest first, each from the page before), and cached.
    async fn build_page(
        &self,
        key: BufferTag,
        lsn: Lsn,
        plan: Planned,
    ) -> Result<(Lsn, Bytes), GetPageError> {
        let cache_key = (self.generation, key, plan.version());
        let page = match plan {
            Planned::Whole(plan) => self.rebuild(key, lsn, None, plan).await?,
            Planned::Pieces(pieces) => {
                let (mut page, last) = (None, pieces.len().saturating_sub(1));
                for (i, piece) in pieces.into_iter().enumerate() {
                    let at = if i == last { lsn } else { piece.newest_lsn() };
                    page = Some(self.rebuild(key, at, page, piece).await?);
                }
                page.ok_or(GetPageError::NotFound { key, lsn })?
            }
        };
        // Only a PostgreSQL cluster's import stores a pg_control that can ask for checksums,
        // and only relation pages have them; a shorter value (the counters) fills a page.
        let page = if page.len() < page_types::PAGE_SIZE {
            let mut padded = page.to_vec();
            padded.resize(page_types::PAGE_SIZE, 0);
            Bytes::from(padded)
        } else if self.follows_postgres.load(Ordering::Relaxed) && page_types::keys::is_rel_page(&key) {
            self.data_checksums.apply(&self.timeline, key, lsn, page).await.map_err(GetPageError::Internal)?
        } else {
            page
        };
        self.deps.cache.insert(cache_key, &page);
        Ok((lsn, page))
    }

    /// The page `key` as of `lsn` from `plan`'s values, on top of `base` (the page of the piece
    /// before, if any): its image if that is all, else redone.
    async fn rebuild(
        &self,
        key: BufferTag,
        lsn: Lsn,
        base: Option<Bytes>,
        plan: ReadPlan,
    ) -> Result<Bytes, GetPageError> {
        // Reserve the memory before reading; held until the page is built.
        let base_bytes = base.as_ref().map_or(0, |b| b.len() as u64);
        let holds = crate::walredo::reconstruction_bytes(
            plan.values() + usize::from(base.is_some()),
            plan.bytes() + base_bytes,
        );
        // Biased: a budget with room answers at once, and then the cancellation is not
        // polled (which would register with the tenant's token, a lock every request takes).
        let _reserved = tokio::select! {
            biased;
            reserved = self.deps.redo_budget.reserve(holds) => reserved?,
            () = self.cancel.cancelled() => return Err(GetPageError::ShuttingDown),
        };
        let data = self.timeline.read_planned(plan).await.map_err(|e| read_error(key, lsn, e))?;
        let image = data.image.map(|(_, page)| page).or(base);
        match (image, data.records.is_empty()) {
            (Some(image), true) => Ok(image),
            (image, _) => Ok(self.walredo.request_redo(key, lsn, image, &data.records).await?),
        }
    }

    /// Queues a batch for durable storage, in call order; the returned future resolves once
    /// it is durable (fsync'd) with its last LSN. Refused (`Invalid`) while the tenant follows
    /// a PostgreSQL primary.
    ///
    /// Not cancel-safe in the sense that a queued batch stays queued: dropping the returned
    /// future means the batch becomes durable (or fails) unacknowledged.
    pub async fn submit_ingest(
        &self,
        batch: IngestBatch,
    ) -> Result<impl std::future::Future<Output = Result<Lsn, IngestError>> + Send + 'static, IngestError>
    {
        if self.cancel.is_cancelled() {
            return Err(IngestError::ShuttingDown);
        }
        if lock(&self.wal_receiver).is_some() {
            // Its LSNs are the primary's: values from elsewhere would collide with the WAL's.
            return Err(IngestError::Invalid(format!(
                "tenant {} follows a PostgreSQL primary (wal_source): its values come from that WAL; \
                 detach the source to ingest through the page service",
                self.id
            )));
        }
        let count = batch.values.len() as u64;
        let durable = self.timeline.submit(batch).await?;
        self.counters.ingest_batches.fetch_add(1, Ordering::Relaxed);
        self.counters.ingested_values.fetch_add(count, Ordering::Relaxed);
        Ok(durable)
    }

    pub fn overrides(&self) -> TenantConfOverrides {
        lock(&self.overrides).clone()
    }

    pub fn effective_conf(&self) -> EffectiveTenantConf {
        let overrides = lock(&self.overrides);
        EffectiveTenantConf {
            walredo_process_kind: overrides.walredo_process_kind.unwrap_or(self.deps.default_process_kind),
        }
    }

    /// Stores new overrides with the tenant and puts them in force: a changed process kind
    /// applies to the next child (the current one drains and exits).
    pub fn set_overrides(&self, overrides: TenantConfOverrides) -> anyhow::Result<()> {
        write_overrides(&self.dir, &overrides)?;
        *lock(&self.overrides) = overrides;
        self.walredo.set_process_kind(self.effective_conf().walredo_process_kind);
        self.metadata_changed();
        Ok(())
    }

    /// Tells the uploader that what the bucket's index says of the timeline besides its layers
    /// changed (its overrides, its WAL source), so that the index is uploaded again.
    fn metadata_changed(&self) {
        if let Some(remote) = &self.remote {
            remote.metadata_changed();
        }
    }

    /// Puts overrides in force without storing them: a branch takes its tenant's
    /// ([`Tenant::set_overrides`] on `main` stores them).
    pub(crate) fn apply_overrides(&self, overrides: TenantConfOverrides) {
        *lock(&self.overrides) = overrides;
        self.walredo.set_process_kind(self.effective_conf().walredo_process_kind);
    }

    fn storage_status(&self) -> StorageStatus {
        let stats = self.timeline.stats();
        StorageStatus {
            keys: stats.keys,
            values: stats.values,
            layers: stats.layers,
            runs: stats.runs,
            resident_layers: stats.resident_layers,
            disk_bytes: stats.on_disk_bytes,
            record_copy_bytes: stats.record_copy_bytes,
            write_error: self.timeline.write_error().map(|e| StorageWriteErrorStatus {
                error: e.error,
                since: humantime::format_rfc3339_seconds(e.since).to_string(),
                fatal: e.fatal,
            }),
        }
    }

    pub fn timeline_status(&self) -> TimelineStatus {
        TimelineStatus {
            tenant_id: self.id.clone(),
            timeline_id: self.timeline_id.clone(),
            ancestor_timeline_id: self.ancestor.as_ref().map(|(a, _)| a.timeline_id.clone()),
            ancestor_lsn: self.ancestor.as_ref().map(|(_, lsn)| *lsn),
            durable_lsn: self.timeline.last_durable_lsn(),
            gc_cutoff: self.timeline.gc_cutoff(),
            branch_points: self.timeline.branch_points(),
            storage: self.storage_status(),
            wal_source: lock(&self.wal_receiver).as_ref().map(|r| r.status()),
            remote: self.remote.as_ref().map(|r| r.status()),
        }
    }

    pub fn status(&self) -> TenantStatus {
        TenantStatus {
            id: self.id.clone(),
            state: TenantState::Active,
            last_durable_lsn: self.timeline.last_durable_lsn(),
            config: self.overrides(),
            effective_config: self.effective_conf(),
            walredo: self.walredo.status(),
            compaction: self.compactor.status(),
            storage: self.storage_status(),
            wal_source: lock(&self.wal_receiver).as_ref().map(|r| r.status()),
            remote: self.remote.as_ref().map(|r| r.status()),
            counters: TenantCounters {
                get_page_requests: self.counters.get_page_requests.sum(0),
                ingest_batches: self.counters.ingest_batches.load(Ordering::Relaxed),
                ingested_values: self.counters.ingested_values.load(Ordering::Relaxed),
            },
        }
    }

    /// Cancels the tenant: its connections stop reading and its waits end.
    pub(crate) fn stop_serving(&self) {
        self.stopping.raise();
        self.cancel.cancel();
    }

    /// Stops the tenant: connections are told, queued ingests become durable, the redo child
    /// is stopped and reaped. Idempotent.
    ///
    /// Cancel-safe in the sense that calling it again finishes the job: the tenant is
    /// cancelled at the first poll, and each step is idempotent.
    pub async fn shutdown(&self) {
        self.stop_serving();
        // Before storage stops: the receiver makes its position durable as it stops.
        let receiver = lock(&self.wal_receiver).take();
        if let Some(receiver) = receiver {
            receiver.stop().await;
        }
        self.compactor.stopped().await;
        if let Some(remote) = &self.remote {
            remote.shutdown().await;
        }
        self.timeline.shutdown().await;
        self.walredo.shutdown().await;
    }

    /// Before a detach: seals what storage holds and waits until the bucket has all of it,
    /// first while serving (the bulk), then with the tenant stopped (ingest refused, the WAL
    /// receiver stopped: what it streamed after is still in the primary's slot, which was told
    /// no more than was uploaded). Each wait at most `timeout`; on a failure of the first the
    /// tenant serves on.
    pub(crate) async fn upload_all(&self, timeout: Duration) -> anyhow::Result<()> {
        let remote = self.remote.as_ref().context("no remote storage")?;
        self.timeline.freeze().await?;
        remote.wait_uploaded(self.timeline.layer_files().last_lsn(), timeout).await?;
        self.stop_serving();
        let receiver = lock(&self.wal_receiver).take();
        if let Some(receiver) = receiver {
            receiver.stop().await;
        }
        self.compactor.stopped().await;
        self.timeline.freeze().await?;
        remote.wait_uploaded(self.timeline.layer_files().last_lsn(), timeout).await
    }

    /// Takes up the tenant's source file at load: what it says of storage (the position the
    /// receiver reached, the GC cutoff of a finished import, an import not finished), for an
    /// attached source and a detached one alike; then follows the source if it is attached.
    pub(crate) fn load_wal_source(&self, file: SourceFile) {
        self.follows_postgres.store(true, Ordering::Relaxed);
        wal_receiver::restore(&self.timeline, &file);
        if file.import.as_ref().is_some_and(|i| i.end_lsn.is_none()) {
            self.import_incomplete.store(true, Ordering::Release);
        }
        if !file.detached {
            self.start_wal_receiver(file);
        }
    }

    /// Starts following `source` ([`Tenant::load_wal_source`], [`Tenant::attach_wal_source`]).
    fn start_wal_receiver(&self, source: SourceFile) {
        let receiver = WalReceiver::start(
            &self.id,
            self.dir.clone(),
            source,
            wal_receiver::ReceiverDeps {
                timeline: Arc::clone(&self.timeline),
                metrics: Arc::clone(&self.deps.wal_receiver_metrics),
                import_incomplete: Arc::clone(&self.import_incomplete),
                max_record_size: self.deps.wal_max_record_size,
                pages: self.page_source(),
                uploaded: self.remote.clone(),
            },
            &self.cancel,
        );
        if let Some(old) = lock(&self.wal_receiver).replace(receiver) {
            // Never two receivers at once: callers stop the old one first.
            tracing::error!(tenant_id = self.id, "a WAL receiver was replaced while running");
            drop(old);
        }
    }

    /// Its GetPage as a database copy reads the template's pages ([`database_copy`]).
    fn page_source(&self) -> database_copy::PageSource {
        let me = self.me.clone();
        Arc::new(move |key, lsn| {
            let me = me.clone();
            Box::pin(async move {
                let tenant = me.upgrade().context("the tenant is gone")?;
                match tenant.get_page(key, lsn).await {
                    Ok((_, page)) => Ok(Some(page)),
                    Err(GetPageError::NotFound { .. }) => Ok(None),
                    Err(e) => Err(anyhow::Error::new(e)),
                }
            })
        })
    }

    /// Attaches the tenant to `source` (made durable first), replacing the source it had; the
    /// cluster it follows, its timeline and position are kept (a new connection string of the
    /// same cluster resumes where the old one stopped; another cluster is refused at connect).
    /// A branch's first source is the PostgreSQL started on the branch's base backup at its last
    /// durable LSN: no import, its WAL is streamed from that backup's start point (the
    /// checkpoint record the backup wrote, `ControlFile::start_point`).
    /// Cancel-safe: the change is made or not; the caller may not see which.
    pub async fn attach_wal_source(&self, source: WalSource) -> anyhow::Result<WalSourceStatus> {
        source.validate().map_err(|e| anyhow::anyhow!("invalid WAL source: {e}"))?;
        let _change = self.wal_source_change.lock().await;
        // A tenant stopping (deleted, or the daemon shutting down) takes no new receiver.
        anyhow::ensure!(!self.cancel.is_cancelled(), "tenant {} is shutting down", self.id);
        if let Some(running) = lock(&self.wal_receiver).as_ref() {
            if running.source == source {
                return Ok(running.status());
            }
        }
        self.stop_wal_receiver().await;
        // Where a branch's first primary starts, and the cluster it is (unused once the branch
        // has a source file).
        let branch_start = match &self.ancestor {
            Some(_) => {
                let durable = self.timeline.last_durable_lsn();
                let control = cluster::control_file_at(&self.timeline, durable).await?;
                let start = control
                    .start_point(durable)
                    .map_err(|e| anyhow::anyhow!("the branch's start point at {durable}: {e}"))?;
                Some((start, control.system_identifier))
            }
            None => None,
        };
        let dir = self.dir.clone();
        let file = tokio::task::spawn_blocking(move || -> anyhow::Result<SourceFile> {
            let previous = wal_receiver::read_source_file(&dir)?;
            let file = match previous {
                Some(previous) => SourceFile { source, detached: false, ..previous },
                None => SourceFile {
                    source,
                    detached: false,
                    system_id: branch_start.map(|(_, id)| id.to_string()),
                    timeline: None,
                    position: branch_start.map(|(start, _)| start),
                    import: None,
                    start_checkpoint: branch_start.map(|(start, _)| start),
                },
            };
            wal_receiver::write_source_file(&dir, &file)?;
            Ok(file)
        })
        .await
        .context("write task")??;
        tracing::info!(tenant_id = self.id, slot = file.source.slot, "attached a WAL source");
        self.follows_postgres.store(true, Ordering::Relaxed);
        self.metadata_changed();
        self.start_wal_receiver(file);
        let status = lock(&self.wal_receiver).as_ref().map(|r| r.status());
        status.context("the receiver just started")
    }

    /// Detaches the tenant from its WAL source; `false` if it had none. The source file stays,
    /// marked detached: the cluster followed, the position reached and the import's LSNs are
    /// what the tenant's storage means (its GC cutoff after a restart, where a re-attach to
    /// the same cluster resumes; another cluster is refused at connect).
    pub async fn detach_wal_source(&self) -> anyhow::Result<bool> {
        let _change = self.wal_source_change.lock().await;
        let had = self.stop_wal_receiver().await;
        let dir = self.dir.clone();
        let was_attached = tokio::task::spawn_blocking(move || -> anyhow::Result<bool> {
            match wal_receiver::read_source_file(&dir)? {
                Some(file) if !file.detached => {
                    wal_receiver::write_source_file(&dir, &SourceFile { detached: true, ..file })?;
                    Ok(true)
                }
                _ => Ok(false),
            }
        })
        .await
        .context("write task")??;
        if had || was_attached {
            tracing::info!(tenant_id = self.id, "detached the WAL source");
            self.metadata_changed();
        }
        Ok(had || was_attached)
    }

    async fn stop_wal_receiver(&self) -> bool {
        let receiver = lock(&self.wal_receiver).take();
        match receiver {
            Some(receiver) => {
                receiver.stop().await;
                true
            }
            None => false,
        }
    }

    /// Runs a compaction pass now and returns what it did (`None`: no layers to compact).
    /// Cancel-safe as [`Compactor::compact_now`]: the pass, once queued, runs to its end.
    pub async fn compact(&self) -> Result<Option<PassSummary>, CompactError> {
        self.compactor.compact_now().await
    }
}

/// What a timeline's index in the bucket says besides its layers ([`remote::MetadataFn`]): the
/// tenant's `tenant.toml` (in `tenant_dir`), the branch's ancestor, and its WAL source file (in
/// `meta_dir`) with the position a node that has only these layers resumes from. `None` (no
/// index yet) while the layers alone cannot serve the timeline: an import not complete, or
/// values durable here and not in the layers yet (the active segment held some when the layers
/// were listed) and none of the source's WAL in the layers (its values are not known to be all
/// there before one is). The position is at most what the layers are known to cover: their last
/// LSN, or the durable LSN that `all_in_layers` carries (the WAL up to a shutdown checkpoint,
/// whose records after the last value carry none, is then covered too).
pub(crate) fn remote_metadata(
    tenant_dir: &Path,
    meta_dir: &Path,
    ancestor: Option<(String, Lsn)>,
) -> remote::MetadataFn {
    let (tenant_dir, meta_dir) = (tenant_dir.to_path_buf(), meta_dir.to_path_buf());
    Arc::new(move |disk_consistent: Lsn, all_in_layers: Option<Lsn>| {
        let tenant_conf = std::fs::read_to_string(tenant_dir.join(TENANT_CONFIG_FILE)).ok()?;
        let wal_source = match wal_receiver::read_source_file(&meta_dir).ok()? {
            None => None,
            Some(mut file) => {
                let position = file.position?;
                // Every value at or below it is in the layers.
                let covered = all_in_layers.map_or(disk_consistent, |durable| durable.max(disk_consistent));
                file.position = Some(match (&file.import, &ancestor) {
                    // The import's values are below its start; the WAL's above it.
                    (Some(import), _) => {
                        let start = import.start_lsn?;
                        match (covered > start, all_in_layers) {
                            (true, _) => position.min(covered),
                            (false, Some(_)) => position.min(start),
                            (false, None) => return None,
                        }
                    }
                    // A branch's values are above its point; until its first record is seen
                    // (`start_checkpoint`) it has none, and streams from its start point.
                    (None, Some((_, point))) => match (covered > *point, file.start_checkpoint) {
                        (true, _) => position.min(covered),
                        (false, Some(_)) if all_in_layers.is_some() => position,
                        (false, _) => return None,
                    },
                    (None, None) => match (all_in_layers, disk_consistent > Lsn(0)) {
                        (Some(_), _) | (None, true) => position.min(covered),
                        (None, false) => return None,
                    },
                });
                Some(serde_json::to_value(&file).ok()?)
            }
        };
        Some(remote::TimelineMetadata {
            ancestor: ancestor.clone().map(|(timeline, lsn)| remote::AncestorMeta { timeline, lsn }),
            tenant_conf,
            wal_source,
        })
    })
}

/// Reads a tenant's overrides; `Ok(None)` if the file is missing (an incomplete tenant).
pub(crate) fn read_overrides(dir: &Path) -> anyhow::Result<Option<TenantConfOverrides>> {
    let path = dir.join(TENANT_CONFIG_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => toml::from_str(&text).map(Some).with_context(|| format!("parse {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// Writes the overrides durably: temp file, fsync, rename, fsync of the directory.
pub(crate) fn write_overrides(dir: &Path, overrides: &TenantConfOverrides) -> anyhow::Result<()> {
    let text = toml::to_string(overrides).context("encode tenant config")?;
    storage::durable_write(dir, TENANT_CONFIG_FILE, text.as_bytes()).context("write tenant config")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod remote_metadata_tests {
    use super::*;
    use wal_receiver::ImportRecord;

    fn source(position: u64, import: Option<(u64, u64)>, start_checkpoint: Option<u64>) -> SourceFile {
        SourceFile {
            source: WalSource { postgres: "host=db".into(), slot: "s".into() },
            detached: false,
            system_id: Some("1".into()),
            timeline: Some(1),
            position: Some(Lsn(position)),
            import: import.map(|(start, end)| ImportRecord {
                attempts: 1,
                start_lsn: Some(Lsn(start)),
                end_lsn: Some(Lsn(end)),
            }),
            start_checkpoint: start_checkpoint.map(Lsn),
        }
    }

    /// The position the index carries for `file`, or `None` when no index is due.
    fn position_in_index(
        file: &SourceFile,
        ancestor: Option<(String, Lsn)>,
        disk_consistent: u64,
        all_in_layers: Option<u64>,
    ) -> Option<u64> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(TENANT_CONFIG_FILE), "").unwrap();
        wal_receiver::write_source_file(dir.path(), file).unwrap();
        let metadata =
            remote_metadata(dir.path(), dir.path(), ancestor)(Lsn(disk_consistent), all_in_layers.map(Lsn))?;
        let file: SourceFile = serde_json::from_value(metadata.wal_source.unwrap()).unwrap();
        Some(file.position.unwrap().0)
    }

    #[test]
    fn the_index_resumes_where_the_layers_end_and_waits_while_they_cannot_tell() {
        // An imported tenant (values at 1.., WAL from 1000): the position is lowered to the
        // layers' end once they hold WAL values; with only the import's values in the layers,
        // an index is due only if nothing is left in the active segment, and resumes at the start.
        let imported = source(5000, Some((1000, 1200)), None);
        assert_eq!(position_in_index(&imported, None, 3000, None), Some(3000));
        assert_eq!(position_in_index(&imported, None, 7000, None), Some(5000));
        assert_eq!(position_in_index(&imported, None, 40, None), None);
        assert_eq!(position_in_index(&imported, None, 40, Some(40)), Some(1000));
        // All in the layers: up to the durable LSN read before, past the last value (WAL that
        // carries no value, such as a shutdown checkpoint's end), never past it.
        assert_eq!(position_in_index(&imported, None, 3000, Some(5000)), Some(5000));
        assert_eq!(position_in_index(&imported, None, 3000, Some(4000)), Some(4000));
        let mut incomplete = imported.clone();
        incomplete.import = Some(ImportRecord { attempts: 1, start_lsn: None, end_lsn: None });
        assert_eq!(position_in_index(&incomplete, None, 3000, Some(3000)), None);
        // A branch at 800: its own values are above its point; before its first record it has
        // none and resumes at its start point.
        let branch = Some(("main".to_string(), Lsn(800)));
        let fresh = source(900, None, Some(900));
        assert_eq!(position_in_index(&fresh, branch.clone(), 0, Some(800)), Some(900));
        assert_eq!(position_in_index(&fresh, branch.clone(), 0, None), None);
        let streaming = source(5000, None, None);
        assert_eq!(position_in_index(&streaming, branch.clone(), 2000, None), Some(2000));
        assert_eq!(position_in_index(&streaming, branch.clone(), 2000, Some(5000)), Some(5000));
        assert_eq!(position_in_index(&streaming, branch, 0, Some(0)), None);
        // Not imported, not a branch: the same bounds.
        assert_eq!(position_in_index(&streaming, None, 4990, None), Some(4990));
        assert_eq!(position_in_index(&streaming, None, 4990, Some(5000)), Some(5000));
        assert_eq!(position_in_index(&streaming, None, 4990, Some(4995)), Some(4995));
        assert_eq!(position_in_index(&streaming, None, 0, None), None);
        // No index without the tenant's overrides.
        let dir = tempfile::tempdir().unwrap();
        assert!(remote_metadata(dir.path(), dir.path(), None)(Lsn(1), Some(Lsn(1))).is_none());
    }
}
