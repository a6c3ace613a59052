//! The tenants of this daemon: load at start-up, create, look up, delete, shut down.
//!
//! On disk, a tenant is `<workdir>/tenants/<id>/` with its `main` timeline's storage in
//! `timeline/`, its overrides in `tenant.toml` and its branches in `branches/` (`timelines`).
//! Creation writes `tenant.toml` last, so a directory without it is an interrupted creation and
//! is removed at start-up. Deletion first renames the directory to `.deleted-<id>-<n>`
//! (atomic), then removes it (its branches with it); leftovers of an interrupted deletion are
//! removed at start-up.
//!
//! Loading opens the tenants' storage on the blocking pool, [`LOAD_PARALLELISM`] at a time,
//! never on the async runtime. A tenant that cannot be loaded (a damaged file, a `tenant.toml`
//! that does not parse, a panic while opening) is held as **broken** with the reason: it shows
//! in the API and the `pageserver_tenants{state}` gauge, refuses connections with
//! `tenant_broken`, and can be deleted; the daemon and every other tenant serve.
//!
//! Invariant: a tenant id is 1 to 64 characters of `[A-Za-z0-9_-]`, so it is a safe file name.
//! Invariant: one tenant's damage never stops the daemon from starting.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use page_types::Lsn;
use prometheus::{IntGaugeVec, Opts, Registry};
use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::compaction::{CompactionMetrics, CompactionSettings, Compactor};
use crate::metrics::sharded::ReadGauge;
use crate::metrics::RequestSeries;
use crate::page_cache::PageCache;
use crate::redo_budget::{RedoBudget, DEFAULT_REDO_MEMORY_BUDGET};
use crate::remote::{self, RemoteMetrics, RemoteStorage, RemoteStorageConfig, RemoteTenant, RemoteTimeline};
use crate::storage::{self, StorageConf, StorageMetrics, Timeline};
use crate::tenant::wal_receiver;
use crate::tenant::{
    read_overrides, write_overrides, Tenant, TenantConfOverrides, TenantDeps, TenantState, TenantStatus,
    DEFAULT_WAIT_LSN_TIMEOUT, MAIN_TIMELINE,
};
use crate::util::lock;
use crate::walredo::{WalRedoConf, WalRedoManager, WalRedoMetrics};

pub(crate) mod eviction;
mod timelines;

pub use timelines::TimelineError;

const TENANTS_DIR: &str = "tenants";
const TIMELINE_DIR: &str = "timeline";
const DELETED_PREFIX: &str = ".deleted-";
/// A tenant being attached is written here first, then renamed to its id.
const ATTACHING_PREFIX: &str = ".attaching-";
/// How long a detach waits for the bucket to hold everything (each of its two waits).
const DETACH_UPLOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// Tenants opened at once at start-up (each open reads its storage's indexes from disk).
pub const LOAD_PARALLELISM: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error("tenant {0} already exists")]
    Exists(String),
    #[error("no tenant {0}")]
    NotFound(String),
    #[error("tenant {id} is broken: {reason}")]
    Broken { id: String, reason: String },
    #[error("invalid tenant id {0:?}: use 1 to 64 characters of A-Z a-z 0-9 _ -")]
    InvalidId(String),
    #[error("the daemon is shutting down")]
    ShuttingDown,
    #[error("no remote_storage is configured: attach and detach need a bucket")]
    NoRemoteStorage,
    #[error("the bucket holds no tenant {0}")]
    NotInBucket(String),
    #[error("{0:#}")]
    Other(#[from] anyhow::Error),
}

pub fn validate_tenant_id(id: &str) -> Result<(), TenantError> {
    let ok = (1..=64).contains(&id.len())
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(TenantError::InvalidId(id.to_string()))
    }
}

/// A tenant whose files could not be loaded; it holds nothing open.
#[derive(Debug)]
pub struct BrokenTenant {
    pub id: String,
    dir: PathBuf,
    /// Why it could not be loaded (the error chain).
    pub reason: String,
}

/// A tenant as the daemon holds it.
#[derive(Clone)]
pub enum TenantSlot {
    Active(Arc<Tenant>),
    Broken(Arc<BrokenTenant>),
}

/// What the API shows of a tenant: the full status, or the reason it is broken.
#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum TenantStatusView {
    Active(Box<TenantStatus>),
    Broken { id: String, state: TenantState, broken_reason: String },
}

impl TenantSlot {
    pub fn status(&self) -> TenantStatusView {
        match self {
            TenantSlot::Active(tenant) => TenantStatusView::Active(Box::new(tenant.status())),
            TenantSlot::Broken(broken) => TenantStatusView::Broken {
                id: broken.id.clone(),
                state: TenantState::Broken,
                broken_reason: broken.reason.clone(),
            },
        }
    }

    fn dir(&self) -> &Path {
        match self {
            TenantSlot::Active(tenant) => tenant.dir(),
            TenantSlot::Broken(broken) => &broken.dir,
        }
    }
}

/// `pageserver_tenants{state}`: tenants by state.
pub struct TenantsMetrics {
    tenants: IntGaugeVec,
    /// The redo memory budget's bytes in use, read at each scrape.
    redo_budget_used: Arc<AtomicU64>,
    pub(crate) compaction: Arc<CompactionMetrics>,
    pub(crate) wal_receiver: Arc<wal_receiver::WalReceiverMetrics>,
    pub(crate) remote: Arc<RemoteMetrics>,
}

impl TenantsMetrics {
    pub fn new(registry: &Registry) -> anyhow::Result<TenantsMetrics> {
        let tenants = IntGaugeVec::new(
            Opts::new("pageserver_tenants", "Tenants by state: active, broken (could not be loaded)"),
            &["state"],
        )?;
        registry.register(Box::new(tenants.clone()))?;
        for state in ["active", "broken"] {
            tenants.with_label_values(&[state]).set(0);
        }
        let redo_budget_used = Arc::new(AtomicU64::new(0));
        registry.register(Box::new(ReadGauge::new(
            Opts::new(
                "pageserver_walredo_memory_budget_used_bytes",
                "Bytes of page reconstruction data reserved in walredo_memory_budget",
            ),
            Arc::clone(&redo_budget_used),
        )?))?;
        let compaction = Arc::new(CompactionMetrics::new(registry)?);
        let wal_receiver = Arc::new(wal_receiver::WalReceiverMetrics::new(registry)?);
        let remote = Arc::new(RemoteMetrics::new(registry)?);
        Ok(TenantsMetrics { tenants, redo_budget_used, compaction, wal_receiver, remote })
    }
}

/// The tenants' settings: what every tenant is built with (docs/settings.md; `config.rs`
/// composes them from the file, the defaults are the modules' own).
#[derive(Debug, Clone)]
pub struct TenantsConf {
    /// Defaults of every tenant's redo manager; `process_kind` is the global default kind.
    pub walredo: WalRedoConf,
    pub storage: StorageConf,
    pub compaction: CompactionSettings,
    /// `wait_lsn_timeout`.
    pub wait_lsn_timeout: Duration,
    /// `walredo_memory_budget`: bytes of page reconstruction data in flight, daemon-wide.
    pub walredo_memory_budget: u64,
    /// `wal_max_record_size`: the longest WAL record a tenant's receiver takes.
    pub wal_max_record_size: u32,
    /// `remote_storage`: the bucket (or directory) the layers are uploaded to; `None`: local
    /// disk only.
    pub remote_storage: Option<RemoteStorageConfig>,
    /// `checkpoint_timeout`: with remote storage, how long values may wait in the active
    /// segment before it is sealed and uploaded.
    pub checkpoint_timeout: Duration,
    /// `max_local_disk`: the bound on the bytes of layer files on local disk, over all tenants
    /// (`tenants::eviction`); `None`: no bound.
    pub max_local_disk: Option<u64>,
}

impl TenantsConf {
    /// Every setting at its default, with this redo child configuration.
    pub fn with_walredo(walredo: WalRedoConf) -> TenantsConf {
        TenantsConf {
            walredo,
            storage: StorageConf::default(),
            compaction: CompactionSettings::default(),
            wait_lsn_timeout: DEFAULT_WAIT_LSN_TIMEOUT,
            walredo_memory_budget: DEFAULT_REDO_MEMORY_BUDGET,
            wal_max_record_size: wal_receiver::DEFAULT_WAL_MAX_RECORD_SIZE,
            remote_storage: None,
            checkpoint_timeout: remote::DEFAULT_CHECKPOINT_TIMEOUT,
            max_local_disk: None,
        }
    }
}

/// What loading found in one tenant's directory.
enum Loaded {
    Opened(
        TenantConfOverrides,
        Arc<Timeline>,
        Option<wal_receiver::SourceFile>,
        Vec<timelines::LoadedBranch>,
    ),
    /// An interrupted creation, now removed.
    Incomplete,
}

pub struct Tenants {
    dir: PathBuf,
    /// Their `main` timelines.
    tenants: Mutex<BTreeMap<String, TenantSlot>>,
    /// The branches of each active tenant, by tenant id, then timeline id ([`timelines`]).
    branches: Mutex<BTreeMap<String, BTreeMap<String, Arc<Tenant>>>>,
    /// Serializes creations and deletions (they touch the disk); lookups do not wait for it.
    change_lock: tokio::sync::Mutex<()>,
    deps: Arc<TenantDeps>,
    walredo_conf: WalRedoConf,
    confs: TimelineConfs,
    storage_metrics: Arc<StorageMetrics>,
    walredo_metrics: Arc<WalRedoMetrics>,
    metrics: Arc<TenantsMetrics>,
    next_generation: AtomicU64,
    cancel: CancellationToken,
    /// `remote_storage`, if set.
    remote: Option<Arc<RemoteStorage>>,
    /// The remote side of each tenant (its generation), shared by its timelines' uploaders.
    remote_tenants: Mutex<BTreeMap<String, Arc<RemoteTenant>>>,
    checkpoint_timeout: Duration,
    max_local_disk: Option<u64>,
    /// Who this daemon is, in the generation objects it writes.
    node: String,
}

impl Tenants {
    /// Loads every tenant under `<workdir>/tenants`, recovering their storage on the blocking
    /// pool ([`LOAD_PARALLELISM`] at once). A tenant that fails to load is held as broken
    /// (logged as an ERROR with its reason); only a tenants directory that cannot be created
    /// or listed is an error.
    ///
    /// Not cancel-safe: dropped midway, the storage opened so far is closed again (nothing is
    /// lost, but the blocking opens still in flight run to their end).
    pub async fn load(
        workdir: &Path,
        conf: &TenantsConf,
        cache: Arc<PageCache>,
        storage_metrics: Arc<StorageMetrics>,
        walredo_metrics: Arc<WalRedoMetrics>,
        metrics: Arc<TenantsMetrics>,
        cancel: CancellationToken,
    ) -> anyhow::Result<Tenants> {
        let remote = match &conf.remote_storage {
            None => None,
            Some(remote_conf) => {
                let storage = RemoteStorage::connect(remote_conf, Arc::clone(&metrics.remote))?;
                storage.check().await?;
                tracing::info!("layers are uploaded to remote storage {}", remote_conf.describe());
                Some(Arc::new(storage))
            }
        };
        let remote_for_confs = remote.clone();
        let tenants = Tenants {
            remote,
            remote_tenants: Mutex::new(BTreeMap::new()),
            checkpoint_timeout: conf.checkpoint_timeout,
            max_local_disk: conf.max_local_disk,
            node: format!("pid {} in {}", std::process::id(), workdir.display()),
            dir: workdir.join(TENANTS_DIR),
            tenants: Mutex::new(BTreeMap::new()),
            branches: Mutex::new(BTreeMap::new()),
            change_lock: tokio::sync::Mutex::new(()),
            deps: Arc::new(TenantDeps {
                cache,
                compaction: conf.compaction.clone(),
                compaction_metrics: Arc::clone(&metrics.compaction),
                wal_receiver_metrics: Arc::clone(&metrics.wal_receiver),
                redo_budget: Arc::new(RedoBudget::new(
                    conf.walredo_memory_budget,
                    conf.walredo.timeout,
                    Arc::clone(&metrics.redo_budget_used),
                )),
                wait_lsn_timeout: conf.wait_lsn_timeout,
                wal_max_record_size: conf.wal_max_record_size,
                default_process_kind: conf.walredo.process_kind,
            }),
            walredo_conf: conf.walredo.clone(),
            confs: TimelineConfs {
                base: conf.storage.clone(),
                remote: remote_for_confs.map(|r| (r, tokio::runtime::Handle::current())),
            },
            storage_metrics,
            walredo_metrics,
            metrics,
            next_generation: AtomicU64::new(1),
            cancel,
        };
        let dir = tenants.dir.clone();
        let candidates =
            tokio::task::spawn_blocking(move || list_tenant_dirs(&dir)).await.context("list tenants")??;

        let limit = Arc::new(tokio::sync::Semaphore::new(LOAD_PARALLELISM));
        let mut opening = Vec::with_capacity(candidates.len());
        for (id, path) in candidates {
            let permit = Arc::clone(&limit).acquire_owned().await.context("load tenants")?;
            let (confs, storage_metrics) = (tenants.confs.clone(), Arc::clone(&tenants.storage_metrics));
            let tenant_dir = path.clone();
            let span = tracing::info_span!("load_tenant", tenant_id = id);
            let job = tokio::task::spawn_blocking(move || {
                let _permit = permit;
                let _entered = span.enter();
                load_tenant_dir(&tenant_dir, &confs, storage_metrics)
            });
            opening.push((id, path, job));
        }
        let (mut active, mut broken) = (0, 0);
        for (id, path, job) in opening {
            let loaded = match job.await {
                Ok(loaded) => loaded,
                Err(e) => Err(anyhow::anyhow!("loading it failed: {e}")),
            };
            let slot = match loaded {
                Ok(Loaded::Incomplete) => continue,
                Ok(Loaded::Opened(overrides, timeline, source, branches)) => {
                    let tenant = tenants.serve_opened(&id, &path, overrides, timeline, source, branches);
                    tracing::info!(
                        tenant_id = id,
                        last_durable_lsn = %tenant.last_durable_lsn(),
                        "loaded tenant"
                    );
                    active += 1;
                    TenantSlot::Active(tenant)
                }
                Err(e) => {
                    let reason = format!("{e:#}");
                    tracing::error!(tenant_id = id, "failed to load tenant, it is broken: {reason}");
                    broken += 1;
                    TenantSlot::Broken(Arc::new(BrokenTenant { id: id.clone(), dir: path, reason }))
                }
            };
            lock(&tenants.tenants).insert(id, slot);
        }
        tenants.update_metrics();
        tracing::info!(active, broken, "loaded tenants");
        Ok(tenants)
    }

    /// Serves a tenant whose directory was opened ([`load_tenant_dir`]): its `main`, its WAL
    /// source, its branches. At start-up and after an attach.
    fn serve_opened(
        &self,
        id: &str,
        path: &Path,
        overrides: TenantConfOverrides,
        timeline: Arc<Timeline>,
        source: Option<wal_receiver::SourceFile>,
        branches: Vec<timelines::LoadedBranch>,
    ) -> Arc<Tenant> {
        let tenant = self.assemble(id, MAIN_TIMELINE, path, overrides.clone(), timeline, None);
        if let Some(source) = source {
            tenant.load_wal_source(source);
        }
        self.serve_branches(&tenant, overrides, branches);
        tenant
    }

    /// Serves the branches loaded with the tenant whose `main` is `main` (ancestors first).
    fn serve_branches(
        &self,
        main: &Arc<Tenant>,
        overrides: TenantConfOverrides,
        branches: Vec<timelines::LoadedBranch>,
    ) {
        let mut served: BTreeMap<String, Arc<Tenant>> = BTreeMap::new();
        for b in branches {
            let ancestor = match served.get(&b.ancestor_id) {
                Some(a) => Arc::clone(a),
                // Opened in ancestry order: a branch's ancestor is `main` or served already.
                None => Arc::clone(main),
            };
            let branch = self.assemble(
                &main.id,
                &b.id,
                &b.dir,
                overrides.clone(),
                b.timeline,
                Some((ancestor, b.lsn)),
            );
            if let Some(source) = b.source {
                branch.load_wal_source(source);
            }
            tracing::info!(tenant_id = main.id, timeline_id = b.id, ancestor = b.ancestor_id, lsn = %b.lsn, "loaded branch");
            served.insert(b.id, branch);
        }
        if !served.is_empty() {
            lock(&self.branches).insert(main.id.clone(), served);
        }
    }

    /// Builds what serves one timeline of tenant `id` from its opened storage.
    fn assemble(
        &self,
        id: &str,
        timeline_id: &str,
        dir: &Path,
        overrides: TenantConfOverrides,
        timeline: Arc<Timeline>,
        ancestor: Option<(Arc<Tenant>, Lsn)>,
    ) -> Arc<Tenant> {
        let mut walredo_conf = self.walredo_conf.clone();
        walredo_conf.process_kind = overrides.walredo_process_kind.unwrap_or(self.deps.default_process_kind);
        let walredo = WalRedoManager::new(id, walredo_conf, Arc::clone(&self.walredo_metrics));
        let cancel = self.cancel.child_token();
        let compactor = Compactor::start(
            Arc::clone(&timeline),
            Arc::clone(&walredo),
            Arc::clone(&self.deps.redo_budget),
            self.deps.compaction.clone(),
            self.confs.base.layer_size,
            Arc::clone(&self.deps.compaction_metrics),
            cancel.clone(),
        );
        let follows_postgres =
            ancestor.as_ref().is_some_and(|(a, _)| a.follows_postgres.load(Ordering::Relaxed));
        let remote = self.remote.as_ref().map(|storage| {
            // The tenant's directory is `main`'s, at the root of the ancestry.
            let mut main_dir = dir.to_path_buf();
            let mut up = ancestor.as_ref().map(|(a, _)| Arc::clone(a));
            while let Some(a) = up {
                main_dir = a.dir.clone();
                up = a.ancestor.as_ref().map(|(b, _)| Arc::clone(b));
            }
            let tenant = Arc::clone(lock(&self.remote_tenants).entry(id.to_string()).or_insert_with(|| {
                // Once per tenant (load, create, attach): a file of a few bytes, read
                // here so that the status shows the generation from the start. An
                // unreadable one is taken up again by the uploader, which reports it.
                let known = remote::read_generation_file(&main_dir).ok().flatten();
                RemoteTenant::new(Arc::clone(storage), id, &main_dir, &self.node, known)
            }));
            let ancestor_meta = ancestor.as_ref().map(|(a, lsn)| (a.timeline_id.clone(), *lsn));
            RemoteTimeline::start(
                remote::Uploader {
                    tenant,
                    timeline_id: timeline_id.to_string(),
                    timeline: Arc::clone(&timeline),
                    meta_dir: dir.to_path_buf(),
                    metadata: crate::tenant::remote_metadata(&main_dir, dir, ancestor_meta),
                    checkpoint_timeout: self.checkpoint_timeout,
                },
                // Not the tenant's token: a detach stops serving and goes on uploading.
                self.cancel.child_token(),
            )
        });
        let series_label =
            if timeline_id == MAIN_TIMELINE { id.to_string() } else { format!("{id}/{timeline_id}") };
        Arc::new_cyclic(|me| Tenant {
            me: me.clone(),
            id: id.to_string(),
            timeline_id: timeline_id.to_string(),
            ancestor,
            generation: self.next_generation.fetch_add(1, Ordering::Relaxed),
            dir: dir.to_path_buf(),
            timeline,
            walredo,
            compactor,
            overrides: Mutex::new(overrides),
            deps: Arc::clone(&self.deps),
            cancel,
            stopping: Arc::default(),
            counters: Default::default(),
            get_page_series: RequestSeries::get_page(&series_label),
            wal_receiver: Mutex::new(None),
            wal_source_change: tokio::sync::Mutex::new(()),
            import_incomplete: Arc::default(),
            follows_postgres: follows_postgres.into(),
            data_checksums: Default::default(),
            remote,
        })
    }

    fn update_metrics(&self) {
        let (mut active, mut broken) = (0, 0);
        for slot in lock(&self.tenants).values() {
            match slot {
                TenantSlot::Active(_) => active += 1,
                TenantSlot::Broken(_) => broken += 1,
            }
        }
        self.metrics.tenants.with_label_values(&["active"]).set(active);
        self.metrics.tenants.with_label_values(&["broken"]).set(broken);
    }

    /// The active tenant `id`; [`TenantError::Broken`] or [`TenantError::NotFound`] otherwise.
    pub fn get(&self, id: &str) -> Result<Arc<Tenant>, TenantError> {
        match self.slot(id) {
            Some(TenantSlot::Active(tenant)) => Ok(tenant),
            Some(TenantSlot::Broken(broken)) => {
                Err(TenantError::Broken { id: broken.id.clone(), reason: broken.reason.clone() })
            }
            None => Err(TenantError::NotFound(id.to_string())),
        }
    }

    /// The tenant `id`, active or broken.
    pub fn slot(&self, id: &str) -> Option<TenantSlot> {
        lock(&self.tenants).get(id).cloned()
    }

    /// Every tenant, active or broken, sorted by id.
    pub fn list(&self) -> Vec<TenantSlot> {
        lock(&self.tenants).values().cloned().collect()
    }

    /// The active tenants, sorted by id.
    pub fn active(&self) -> Vec<Arc<Tenant>> {
        let tenants = lock(&self.tenants);
        tenants
            .values()
            .filter_map(|slot| match slot {
                TenantSlot::Active(tenant) => Some(Arc::clone(tenant)),
                TenantSlot::Broken(_) => None,
            })
            .collect()
    }

    /// Every timeline served: the active tenants' `main` and their branches.
    pub(crate) fn serving(&self) -> Vec<Arc<Tenant>> {
        let mut all = self.active();
        all.extend(lock(&self.branches).values().flat_map(|b| b.values().cloned()));
        all
    }

    /// Starts the evictor (`tenants::eviction`) when `max_local_disk` is set; it stops with
    /// the tenants.
    pub fn start_evictor(self: &Arc<Self>) {
        if let Some(max) = self.max_local_disk {
            tracing::info!(max_local_disk = max, "layer files on local disk are kept under max_local_disk");
            tokio::spawn(eviction::run(
                Arc::downgrade(self),
                max,
                Arc::clone(&self.storage_metrics),
                self.cancel.clone(),
            ));
        }
    }

    /// Tenants, active and broken.
    pub fn len(&self) -> usize {
        lock(&self.tenants).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Creates a tenant with empty storage.
    ///
    /// Cancel-safe as far as the disk goes: an interrupted creation leaves a directory without
    /// `tenant.toml` (removed at the next start or by the next creation of that id), or, when
    /// dropped while the files were being written, a complete tenant that is served from the
    /// next start on; the caller was not told either way.
    pub async fn create(&self, id: &str, overrides: TenantConfOverrides) -> Result<Arc<Tenant>, TenantError> {
        validate_tenant_id(id)?;
        let _changing = self.change_lock.lock().await;
        if self.cancel.is_cancelled() {
            return Err(TenantError::ShuttingDown);
        }
        if self.slot(id).is_some() {
            return Err(TenantError::Exists(id.to_string()));
        }
        let dir = self.dir.join(id);
        // Everything here waits on the disk: keep it off the executor.
        let (storage_conf, storage_metrics) =
            (self.confs.of(id, MAIN_TIMELINE), Arc::clone(&self.storage_metrics));
        let (tenant_dir, tenants_dir, written) = (dir.clone(), self.dir.clone(), overrides.clone());
        let timeline = tokio::task::spawn_blocking(move || -> anyhow::Result<Arc<Timeline>> {
            if tenant_dir.exists() {
                // A leftover of a creation that did not finish while we run: start afresh.
                std::fs::remove_dir_all(&tenant_dir)
                    .with_context(|| format!("remove {}", tenant_dir.display()))?;
            }
            std::fs::create_dir(&tenant_dir).with_context(|| format!("create {}", tenant_dir.display()))?;
            let timeline = Timeline::open(&tenant_dir.join(TIMELINE_DIR), storage_conf, storage_metrics)?;
            write_overrides(&tenant_dir, &written)?;
            storage::fsync_dir(&tenants_dir).context("sync tenants directory")?;
            Ok(timeline)
        })
        .await
        .context("create tenant storage")??;
        let tenant = self.assemble(id, MAIN_TIMELINE, &dir, overrides, timeline, None);
        lock(&self.tenants).insert(id.to_string(), TenantSlot::Active(Arc::clone(&tenant)));
        self.update_metrics();
        tracing::info!(tenant_id = id, "created tenant");
        Ok(tenant)
    }

    /// Stops a tenant (its connections are told, its child is reaped) and removes its data.
    ///
    /// Cancel-safe: the deletion runs as a task of its own, so a caller that goes away (an
    /// HTTP client hanging up) does not stop it halfway: once called, the tenant is gone from
    /// memory and disk (or the error is logged). On disk the point of no return is the atomic
    /// rename to a `.deleted-` tombstone, which the next start removes if the daemon dies first.
    pub async fn delete(self: &Arc<Self>, id: &str) -> Result<(), TenantError> {
        let (tenants, id) = (Arc::clone(self), id.to_string());
        let span = tracing::info_span!("delete_tenant", tenant_id = id);
        let deletion = tokio::spawn(
            async move {
                let result = tenants.delete_now(&id).await;
                if let Err(e @ TenantError::Other(_)) = &result {
                    tracing::error!("failed to delete tenant: {e:#}");
                }
                result
            }
            .instrument(span),
        );
        deletion.await.map_err(|e| TenantError::Other(anyhow::anyhow!("tenant deletion task failed: {e}")))?
    }

    /// The body of [`Tenants::delete`]; not cancel-safe (dropped after the tenant left the map
    /// and before the rename, the tenant would come back at the next start).
    async fn delete_now(&self, id: &str) -> Result<(), TenantError> {
        let changing = self.change_lock.lock().await;
        self.remove(id, changing).await
    }

    /// Takes tenant `id` out of memory and off the disk (its objects in the bucket stay).
    async fn remove(&self, id: &str, _changing: tokio::sync::MutexGuard<'_, ()>) -> Result<(), TenantError> {
        let slot = lock(&self.tenants).remove(id).ok_or_else(|| TenantError::NotFound(id.to_string()))?;
        self.update_metrics();
        let branches = lock(&self.branches).remove(id).unwrap_or_default();
        // Branches first, newest first: a branch reads its ancestor until it stops.
        for branch in branches.values().rev() {
            branch.shutdown().await;
        }
        drop(branches);
        if let TenantSlot::Active(tenant) = &slot {
            tenant.shutdown().await;
        }
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let doomed = self.dir.join(format!("{DELETED_PREFIX}{id}-{generation}"));
        let (tenant_dir, tenants_dir) = (slot.dir().to_path_buf(), self.dir.clone());
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            std::fs::rename(&tenant_dir, &doomed)
                .with_context(|| format!("rename {}", tenant_dir.display()))?;
            storage::fsync_dir(&tenants_dir).context("sync tenants directory")?;
            std::fs::remove_dir_all(&doomed).with_context(|| format!("remove {}", doomed.display()))
        })
        .await
        .context("remove tenant data")??;
        lock(&self.remote_tenants).remove(id);
        tracing::info!(tenant_id = id, "deleted tenant");
        Ok(())
    }

    /// Attaches tenant `id` from the bucket (`POST /v1/tenant/{id}/attach`): takes a new
    /// generation, copies every timeline's newest index and layers into a new directory
    /// (`.attaching-<id>`, renamed to the tenant's once complete, `tenant.toml` written last),
    /// uploads the indexes under the new generation, and serves it. An object missing or
    /// damaged fails it, naming the object, and leaves nothing on disk.
    pub async fn attach(&self, id: &str) -> Result<Arc<Tenant>, TenantError> {
        validate_tenant_id(id)?;
        let storage = self.remote.clone().ok_or(TenantError::NoRemoteStorage)?;
        let _changing = self.change_lock.lock().await;
        if self.cancel.is_cancelled() {
            return Err(TenantError::ShuttingDown);
        }
        if self.slot(id).is_some() {
            return Err(TenantError::Exists(id.to_string()));
        }
        let mut found = Vec::new();
        for timeline_id in storage.list_timelines(id).await? {
            if let Some((_, index)) = storage.newest_index(id, &timeline_id).await? {
                found.push(remote::AttachedTimeline { timeline_id, index });
            }
        }
        let Some(main) = found.iter().find(|t| t.timeline_id == MAIN_TIMELINE) else {
            return Err(TenantError::NotInBucket(id.to_string()));
        };
        let tenant_conf = main.index.metadata.tenant_conf.clone();
        let generation = storage.take_generation(id, &self.node).await?;
        let span = tracing::info_span!("attach_tenant", tenant_id = id, generation = %generation);
        let staging = self.dir.join(format!("{ATTACHING_PREFIX}{id}"));
        let built = async {
            if tokio::fs::try_exists(&staging).await.unwrap_or(false) {
                tokio::fs::remove_dir_all(&staging).await.context("remove an earlier attach's leftovers")?;
            }
            for t in &found {
                let meta_dir = match t.timeline_id.as_str() {
                    MAIN_TIMELINE => staging.clone(),
                    branch => staging.join(timelines::BRANCHES_DIR).join(branch),
                };
                remote::attach_timeline(&storage, id, t, &meta_dir.join(TIMELINE_DIR), &self.storage_metrics)
                    .await?;
                let (meta_dir, metadata) = (meta_dir.clone(), t.index.metadata.clone());
                tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                    if let Some(a) = &metadata.ancestor {
                        timelines::write_timeline_file(&meta_dir, &a.timeline, a.lsn)?;
                    }
                    if let Some(source) = &metadata.wal_source {
                        let raw = serde_json::to_vec_pretty(source).context("encode the WAL source file")?;
                        storage::durable_write(&meta_dir, wal_receiver::SOURCE_FILE, &raw)?;
                    }
                    Ok(())
                })
                .await??;
            }
            for t in &found {
                let mut index = t.index.clone();
                index.generation = generation;
                storage.put_index(id, &t.timeline_id, &index).await?;
            }
            let (staging, target, tenants_dir) = (staging.clone(), self.dir.join(id), self.dir.clone());
            tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                // The directories the copies made, inner first (the files are synced).
                let branches_dir = staging.join(timelines::BRANCHES_DIR);
                if branches_dir.is_dir() {
                    for entry in std::fs::read_dir(&branches_dir).context("list the copied branches")? {
                        storage::fsync_dir(&entry.context("list the copied branches")?.path())?;
                    }
                    storage::fsync_dir(&branches_dir)?;
                }
                remote::write_generation_file(&staging, generation)?;
                storage::durable_write(&staging, crate::tenant::TENANT_CONFIG_FILE, tenant_conf.as_bytes())?;
                std::fs::rename(&staging, &target)
                    .with_context(|| format!("rename to {}", target.display()))?;
                storage::fsync_dir(&tenants_dir)
            })
            .await?
        }
        .instrument(span.clone())
        .await;
        if let Err(e) = built {
            let _ = tokio::fs::remove_dir_all(&staging).await;
            return Err(TenantError::Other(e.context("attach")));
        }
        let path = self.dir.join(id);
        let (confs, storage_metrics, load_path) =
            (self.confs.clone(), Arc::clone(&self.storage_metrics), path.clone());
        let loaded =
            tokio::task::spawn_blocking(move || load_tenant_dir(&load_path, &confs, storage_metrics))
                .await
                .context("load the attached tenant")??;
        let Loaded::Opened(overrides, timeline, source, branches) = loaded else {
            return Err(TenantError::Other(anyhow::anyhow!("the attached tenant has no tenant.toml")));
        };
        let tenant = self.serve_opened(id, &path, overrides, timeline, source, branches);
        lock(&self.tenants).insert(id.to_string(), TenantSlot::Active(Arc::clone(&tenant)));
        self.update_metrics();
        span.in_scope(|| {
            tracing::info!(timelines = found.len(), last_durable_lsn = %tenant.last_durable_lsn(), "attached tenant")
        });
        Ok(tenant)
    }

    /// Detaches tenant `id` (`POST /v1/tenant/{id}/detach`): waits until the bucket holds
    /// everything durable here (its branches' too), then drops it from memory and disk. A
    /// bucket that does not take the uploads in time fails it (the tenant serves on if the
    /// first wait failed).
    pub async fn detach(&self, id: &str) -> Result<(), TenantError> {
        if self.remote.is_none() {
            return Err(TenantError::NoRemoteStorage);
        }
        let changing = self.change_lock.lock().await;
        let tenant = self.get(id)?;
        let branches: Vec<Arc<Tenant>> =
            lock(&self.branches).get(id).map(|b| b.values().cloned().collect()).unwrap_or_default();
        for t in branches.iter().rev().chain(std::iter::once(&tenant)) {
            t.upload_all(DETACH_UPLOAD_TIMEOUT)
                .await
                .with_context(|| format!("upload timeline {} before the detach", t.timeline_id))?;
        }
        self.remove(id, changing).await?;
        tracing::info!(tenant_id = id, "detached tenant");
        Ok(())
    }

    /// Stops every tenant: ingests made durable, children reaped.
    ///
    /// Not cancel-safe: dropped midway, some tenants are stopped and others not (every
    /// tenant is cancelled first, so none serves new requests). Call it once, at the end.
    pub async fn shutdown(&self) {
        let _changing = self.change_lock.lock().await;
        let branches: Vec<Arc<Tenant>> =
            lock(&self.branches).values().flat_map(|b| b.values().cloned()).collect();
        let tenants = self.active();
        for tenant in branches.iter().chain(&tenants) {
            tenant.stop_serving();
        }
        for tenant in branches.into_iter().chain(tenants) {
            tenant.shutdown().await;
        }
    }
}

/// The storage configuration of each timeline: the daemon's, with the bucket as the source of
/// the layers that are not on local disk when remote storage is configured (downloads run on
/// the runtime the tenants were loaded on).
#[derive(Clone)]
pub(crate) struct TimelineConfs {
    base: StorageConf,
    remote: Option<(Arc<RemoteStorage>, tokio::runtime::Handle)>,
}

impl TimelineConfs {
    /// The configuration of timeline `timeline` of tenant `tenant`.
    pub(crate) fn of(&self, tenant: &str, timeline: &str) -> StorageConf {
        let mut conf = self.base.clone();
        if let Some((storage, runtime)) = &self.remote {
            let fetcher = remote::LayerFetcher::new(storage, tenant, timeline, runtime.clone());
            conf.source = Some(storage::SourceRef(Arc::new(fetcher)));
        }
        conf
    }
}

/// Lists the tenant directories to load, removing the leftovers of interrupted deletions.
fn list_tenant_dirs(dir: &Path) -> anyhow::Result<Vec<(String, PathBuf)>> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("list {}", dir.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("list {}", dir.display()))?;
    entries.sort_by_key(|e| e.file_name());
    let mut tenants = Vec::new();
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(DELETED_PREFIX) || name.starts_with(ATTACHING_PREFIX) {
            tracing::info!(path = %path.display(), "removing the rest of a deleted tenant");
            if let Err(e) = std::fs::remove_dir_all(&path) {
                // It is no tenant any more; try again at the next start.
                tracing::warn!(path = %path.display(), "failed to remove the rest of a deleted tenant: {e}");
            }
            continue;
        }
        if validate_tenant_id(&name).is_err() {
            tracing::warn!(path = %path.display(), "ignoring a file that is not a tenant");
            continue;
        }
        tenants.push((name, path));
    }
    Ok(tenants)
}

/// Opens one tenant's directory (blocking): its overrides, then its storage.
fn load_tenant_dir(
    dir: &Path,
    confs: &TimelineConfs,
    storage_metrics: Arc<StorageMetrics>,
) -> anyhow::Result<Loaded> {
    let id = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match read_overrides(dir)? {
        None => {
            tracing::warn!("removing a tenant whose creation did not finish");
            std::fs::remove_dir_all(dir).with_context(|| format!("remove {}", dir.display()))?;
            Ok(Loaded::Incomplete)
        }
        Some(overrides) => {
            // Read first: a damaged source file makes the tenant broken before storage opens.
            let source = wal_receiver::read_source_file(dir)?;
            let conf = confs.of(&id, MAIN_TIMELINE);
            let timeline = Timeline::open(&dir.join(TIMELINE_DIR), conf, Arc::clone(&storage_metrics))?;
            let confs = |branch: &str| confs.of(&id, branch);
            let branches = timelines::open_branches(dir, &timeline, &confs, &storage_metrics)?;
            Ok(Loaded::Opened(overrides, timeline, source, branches))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::tenant::PageNow;
    use crate::test_support::wait_for;
    use std::time::Duration;

    struct Conf {
        workdir: PathBuf,
        tenants: TenantsConf,
    }

    fn conf(workdir: &Path) -> Conf {
        // No test here redoes a page: the child is never started.
        let tenants = TenantsConf::with_walredo(WalRedoConf::with_binary(PathBuf::from("/bin/false")));
        Conf { workdir: workdir.to_path_buf(), tenants }
    }

    async fn load(conf: &Conf) -> Arc<Tenants> {
        load_with_cache(conf, 0).await
    }

    async fn load_with_cache(conf: &Conf, cache_bytes: u64) -> Arc<Tenants> {
        load_with_registry(conf, cache_bytes).await.0
    }

    /// [`load_with_cache`], and the registry of the daemon's metrics.
    async fn load_with_registry(conf: &Conf, cache_bytes: u64) -> (Arc<Tenants>, prometheus::Registry) {
        let registry = prometheus::Registry::new();
        let cache = Arc::new(PageCache::new(cache_bytes, &registry).unwrap());
        let storage_metrics = Arc::new(storage::register_metrics(&registry).unwrap());
        let walredo_metrics = Arc::new(WalRedoMetrics::new(&registry).unwrap());
        let metrics = Arc::new(TenantsMetrics::new(&registry).unwrap());
        let cancel = CancellationToken::new();
        let tenants = Tenants::load(
            &conf.workdir,
            &conf.tenants,
            cache,
            storage_metrics,
            walredo_metrics,
            metrics,
            cancel,
        )
        .await;
        (Arc::new(tenants.unwrap()), registry)
    }

    #[tokio::test]
    async fn delete_whose_caller_goes_away_midway_still_deletes_for_good() {
        let workdir = tempfile::tempdir().unwrap();
        let conf = conf(workdir.path());
        let tenants = load(&conf).await;
        tenants.create("t1", TenantConfOverrides::default()).await.unwrap();
        let dir = workdir.path().join(TENANTS_DIR).join("t1");

        // Poll the deletion once, then drop it, as when the HTTP client hangs up.
        let mut deletion = Box::pin(tenants.delete("t1"));
        tokio::select! {
            biased;
            _ = &mut deletion => {}
            () = std::future::ready(()) => {}
        }
        drop(deletion);

        wait_for("the deletion to finish without its caller", Duration::from_secs(10), || {
            tenants.slot("t1").is_none() && !dir.exists()
        })
        .await;
        tenants.shutdown().await;
        drop(tenants);
        let tenants = load(&conf).await;
        assert!(tenants.slot("t1").is_none(), "the deleted tenant came back at the next start");
        tenants.shutdown().await;
    }

    #[tokio::test]
    async fn a_cached_page_at_a_durable_lsn_is_answered_now_anything_else_is_left_to_get_page() {
        let workdir = tempfile::tempdir().unwrap();
        let conf = conf(workdir.path());
        let tenants = load_with_cache(&conf, 1 << 20).await;
        let tenant = tenants.create("t", TenantConfOverrides::default()).await.unwrap();
        let key = page_types::BufferTag { spcnode: 1663, dbnode: 5, relnode: 1, forknum: 0, blknum: 1 };
        let missing = page_types::BufferTag { blknum: 2, ..key };
        let image = bytes::Bytes::from(vec![7u8; page_types::PAGE_SIZE]);
        let batch =
            storage::IngestBatch { values: vec![(key, page_types::Lsn(10), storage::Value::Image(image))] };
        let durable = tenant.submit_ingest(batch).await.unwrap().await.unwrap();

        assert!(
            tenant.get_page_now(key, page_types::Lsn::LATEST).page().is_none(),
            "not in the page cache yet"
        );
        let (lsn, page) = tenant.get_page(key, page_types::Lsn::LATEST).await.unwrap();
        assert_eq!(tenant.get_page_now(key, page_types::Lsn::LATEST).page(), Some((lsn, page.clone())));
        assert_eq!(tenant.get_page_now(key, durable).page(), Some((durable, page)));
        // Ahead of the durable LSN, get_page would wait; a missing key is get_page's error.
        assert!(tenant.get_page_now(key, page_types::Lsn(durable.0 + 1)).page().is_none());
        assert!(tenant.get_page_now(missing, page_types::Lsn::LATEST).page().is_none());
        assert_eq!(tenant.status().counters.get_page_requests, 3, "hits are counted as GetPage requests");
        tenants.shutdown().await;
    }

    /// A GetPage the page cache cannot answer looks its key up in the index once and asks the
    /// page cache once: `get_page_later` goes on from `get_page_now`'s lookup (its version, and
    /// the read's plan-to-be). So for a key in the active segment and in a layer, and a hit then
    /// costs one lookup of each too.
    #[tokio::test]
    async fn a_get_page_the_cache_misses_looks_its_key_up_once_and_the_page_cache_once() {
        let workdir = tempfile::tempdir().unwrap();
        let conf = conf(workdir.path());
        let (tenants, registry) = load_with_registry(&conf, 1 << 20).await;
        let tenant = tenants.create("t", TenantConfOverrides::default()).await.unwrap();
        let key = |blknum| page_types::BufferTag { spcnode: 1663, dbnode: 5, relnode: 1, forknum: 0, blknum };
        let image = |fill| storage::Value::Image(bytes::Bytes::from(vec![fill; page_types::PAGE_SIZE]));
        let in_layer = storage::IngestBatch { values: vec![(key(1), page_types::Lsn(10), image(1))] };
        tenant.submit_ingest(in_layer).await.unwrap().await.unwrap();
        tenant.timeline.freeze().await.unwrap();
        let active = storage::IngestBatch { values: vec![(key(2), page_types::Lsn(20), image(2))] };
        tenant.submit_ingest(active).await.unwrap().await.unwrap();

        let misses = || crate::metrics::gathered_value(&registry, "pageserver_page_cache_misses_total");
        let hits = || crate::metrics::gathered_value(&registry, "pageserver_page_cache_hits_total");
        for (blknum, fill, lsn) in [(1, 1, 10), (2, 2, 20)] {
            let (lookups, missed, hit) = (tenant.timeline.key_lookups(), misses(), hits());
            let read = match tenant.get_page_now(key(blknum), page_types::Lsn::LATEST) {
                PageNow::Later(read) => read,
                PageNow::Page(..) => panic!("block {blknum}: a page the cache never had"),
            };
            let (_, page) = tenant.get_page_later(read).await.unwrap();
            assert_eq!(page[..], [fill; page_types::PAGE_SIZE][..], "block {blknum}");
            assert_eq!(tenant.timeline.key_lookups() - lookups, 1, "block {blknum}: index lookups of a miss");
            assert_eq!((misses() - missed, hits() - hit), (1.0, 0.0), "block {blknum}: page cache lookups");

            let lookups = tenant.timeline.key_lookups();
            let now = tenant.get_page_now(key(blknum), page_types::Lsn(lsn)).page();
            assert_eq!(now.map(|(_, page)| page), Some(page), "block {blknum}: cached now");
            assert_eq!(tenant.timeline.key_lookups() - lookups, 1, "block {blknum}: index lookups of a hit");
            assert_eq!((misses() - missed, hits() - hit), (1.0, 1.0), "block {blknum}: page cache lookups");
        }
        assert_eq!(tenant.status().counters.get_page_requests, 4, "two misses and two hits");
        tenants.shutdown().await;
    }

    /// GetPage of the cluster's other values: an SLRU page until its segment is truncated (and
    /// again once a newer value comes), the checkpoint counters padded to a page, and no other
    /// key of theirs.
    #[tokio::test]
    async fn get_page_serves_slru_pages_of_live_segments_and_the_counters_and_no_other_value() {
        use page_types::keys::{self, SlruKind};
        use page_types::{Lsn, PAGE_SIZE};
        let workdir = tempfile::tempdir().unwrap();
        let conf = conf(workdir.path());
        let tenants = load_with_cache(&conf, 1 << 20).await;
        let tenant = tenants.create("t", TenantConfOverrides::default()).await.unwrap();
        let page = keys::slru_page_key(SlruKind::Clog, 2, 5);
        let image = |fill| storage::Value::Image(bytes::Bytes::from(vec![fill; PAGE_SIZE]));
        let empty = || storage::Value::Image(bytes::Bytes::new());
        let counters = storage::Value::Image(bytes::Bytes::from(vec![9u8; 88]));
        for (key, lsn, value) in [
            (page, 10, image(1)),
            (keys::checkpoint_key(), 11, counters),
            (keys::slru_segment_drop_key(SlruKind::Clog, 2), 20, empty()),
            (page, 30, image(3)),
            (keys::control_file_key(), 31, image(4)),
        ] {
            let batch = storage::IngestBatch { values: vec![(key, Lsn(lsn), value)] };
            tenant.submit_ingest(batch).await.unwrap().await.unwrap();
        }
        for (lsn, want) in [(15, Some(1)), (25, None), (31, Some(3))] {
            match (tenant.get_page(page, Lsn(lsn)).await, want) {
                (Ok((_, got)), Some(fill)) => assert_eq!(got[..], [fill; PAGE_SIZE][..], "at {lsn}"),
                (Err(crate::tenant::GetPageError::NotFound { .. }), None) => {}
                (other, _) => panic!("at {lsn}: {other:?}"),
            }
        }
        let (_, got) = tenant.get_page(keys::checkpoint_key(), Lsn::LATEST).await.unwrap();
        assert_eq!(
            (got.len(), &got[..88], got[88..].iter().all(|&b| b == 0)),
            (PAGE_SIZE, &[9u8; 88][..], true)
        );
        for other in [keys::control_file_key(), keys::slru_segment_drop_key(SlruKind::Clog, 2)] {
            let err = tenant.get_page(other, Lsn::LATEST).await.unwrap_err();
            assert!(matches!(err, crate::tenant::GetPageError::InvalidKey(_)), "{other:?}: {err:?}");
        }
        tenants.shutdown().await;
    }

    /// t3's tenant.toml is a FIFO: reading it blocks until a task of the (single-threaded)
    /// runtime opens it and writes a damaged config. If loading ran on the runtime's thread,
    /// that task could never run: the load would hang, and the test fails on its deadline.
    #[test]
    fn loading_leaves_the_runtime_free_and_holds_a_damaged_tenant_as_broken() {
        let workdir = tempfile::tempdir().unwrap();
        let conf = conf(workdir.path());
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let workdir_path = workdir.path().to_path_buf();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            runtime.block_on(loading_while_a_task_feeds_a_fifo(&workdir_path, &conf));
            let _ = done_tx.send(());
        });
        done_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("loading blocked the runtime: the task feeding the FIFO never ran");
    }

    async fn loading_while_a_task_feeds_a_fifo(workdir: &Path, conf: &Conf) {
        use std::os::unix::fs::OpenOptionsExt;
        let tenants = load(conf).await;
        for i in 0..8 {
            tenants.create(&format!("t{i}"), TenantConfOverrides::default()).await.unwrap();
        }
        tenants.shutdown().await;
        drop(tenants);
        let config = workdir.join(TENANTS_DIR).join("t3").join("tenant.toml");
        std::fs::remove_file(&config).unwrap();
        nix::unistd::mkfifo(&config, nix::sys::stat::Mode::S_IRWXU).unwrap();

        let feeder = tokio::spawn(async move {
            loop {
                // Non-blocking: fails (ENXIO) until the loader opens the FIFO for reading.
                let opened =
                    std::fs::OpenOptions::new().write(true).custom_flags(nix::libc::O_NONBLOCK).open(&config);
                match opened {
                    Ok(mut fifo) => {
                        std::io::Write::write_all(&mut fifo, b"[[[").unwrap();
                        return;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
                }
            }
        });
        let tenants = load(conf).await;
        feeder.await.unwrap();
        assert_eq!(tenants.active().len(), 7);
        match tenants.get("t3") {
            Err(TenantError::Broken { reason, .. }) => assert!(reason.contains("tenant.toml"), "{reason}"),
            Err(e) => panic!("t3 is not broken but {e}"),
            Ok(_) => panic!("t3 loaded although its tenant.toml is damaged"),
        }
        tenants.shutdown().await;
    }
}
