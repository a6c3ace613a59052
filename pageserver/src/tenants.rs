//! The tenants of this daemon: load at start-up, create, look up, delete, shut down.
//!
//! On disk, a tenant is `<workdir>/tenants/<id>/` with its storage in `timeline/` and its
//! overrides in `tenant.toml`. Creation writes `tenant.toml` last, so a directory without it is
//! an interrupted creation and is removed at start-up. Deletion first renames the directory to
//! `.deleted-<id>-<n>` (atomic), then removes it; leftovers of an interrupted deletion are
//! removed at start-up.
//!
//! Invariant: a tenant id is 1 to 64 characters of `[A-Za-z0-9_-]`, so it is a safe file name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::config::PageServerConf;
use crate::page_cache::PageCache;
use crate::storage::{self, StorageConf, StorageMetrics, Timeline};
use crate::tenant::{read_overrides, write_overrides, Tenant, TenantConfOverrides, TenantDeps};
use crate::walredo::{lock, WalRedoConf, WalRedoManager, WalRedoMetrics};

const TENANTS_DIR: &str = "tenants";
const TIMELINE_DIR: &str = "timeline";
const DELETED_PREFIX: &str = ".deleted-";

#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error("tenant {0} already exists")]
    Exists(String),
    #[error("no tenant {0}")]
    NotFound(String),
    #[error("invalid tenant id {0:?}: use 1 to 64 characters of A-Z a-z 0-9 _ -")]
    InvalidId(String),
    #[error("the daemon is shutting down")]
    ShuttingDown,
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

pub struct Tenants {
    dir: PathBuf,
    tenants: Mutex<BTreeMap<String, Arc<Tenant>>>,
    /// Serializes creations and deletions (they touch the disk); lookups do not wait for it.
    change_lock: tokio::sync::Mutex<()>,
    deps: Arc<TenantDeps>,
    walredo_conf: WalRedoConf,
    storage_conf: StorageConf,
    storage_metrics: Arc<StorageMetrics>,
    walredo_metrics: Arc<WalRedoMetrics>,
    next_generation: AtomicU64,
    cancel: CancellationToken,
}

impl Tenants {
    /// Loads every tenant under `<workdir>/tenants`, recovering their storage.
    pub fn load(
        conf: &PageServerConf,
        cache: Arc<PageCache>,
        storage_metrics: Arc<StorageMetrics>,
        walredo_metrics: Arc<WalRedoMetrics>,
        cancel: CancellationToken,
    ) -> anyhow::Result<Tenants> {
        let dir = conf.workdir.join(TENANTS_DIR);
        std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        let tenants = Tenants {
            dir,
            tenants: Mutex::new(BTreeMap::new()),
            change_lock: tokio::sync::Mutex::new(()),
            deps: Arc::new(TenantDeps {
                cache,
                wait_lsn_timeout: conf.wait_lsn_timeout,
                default_process_kind: conf.walredo.process_kind,
            }),
            walredo_conf: conf.walredo.clone(),
            storage_conf: StorageConf { layer_size: conf.layer_size },
            storage_metrics,
            walredo_metrics,
            next_generation: AtomicU64::new(1),
            cancel,
        };
        let mut entries: Vec<_> = std::fs::read_dir(&tenants.dir)
            .with_context(|| format!("list {}", tenants.dir.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("list {}", tenants.dir.display()))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if name.starts_with(DELETED_PREFIX) {
                tracing::info!(path = %path.display(), "removing the rest of a deleted tenant");
                std::fs::remove_dir_all(&path).with_context(|| format!("remove {}", path.display()))?;
                continue;
            }
            if validate_tenant_id(&name).is_err() {
                tracing::warn!(path = %path.display(), "ignoring a file that is not a tenant");
                continue;
            }
            match read_overrides(&path)? {
                None => {
                    tracing::warn!(tenant_id = name, "removing a tenant whose creation did not finish");
                    std::fs::remove_dir_all(&path).with_context(|| format!("remove {}", path.display()))?;
                }
                Some(overrides) => {
                    let tenant = tenants
                        .open(&name, &path, overrides)
                        .with_context(|| format!("load tenant {name}"))?;
                    tracing::info!(
                        tenant_id = name,
                        last_durable_lsn = %crate::storage::Lsn(tenant.last_durable_lsn()),
                        "loaded tenant"
                    );
                    lock(&tenants.tenants).insert(name, tenant);
                }
            }
        }
        Ok(tenants)
    }

    /// Opens an existing tenant's storage (blocking) and assembles the tenant.
    fn open(&self, id: &str, dir: &Path, overrides: TenantConfOverrides) -> anyhow::Result<Arc<Tenant>> {
        let timeline = Timeline::open(
            &dir.join(TIMELINE_DIR),
            self.storage_conf.clone(),
            Arc::clone(&self.storage_metrics),
        )?;
        Ok(self.assemble(id, dir, overrides, timeline))
    }

    fn assemble(
        &self,
        id: &str,
        dir: &Path,
        overrides: TenantConfOverrides,
        timeline: Arc<Timeline>,
    ) -> Arc<Tenant> {
        let mut walredo_conf = self.walredo_conf.clone();
        walredo_conf.process_kind = overrides.walredo_process_kind.unwrap_or(self.deps.default_process_kind);
        let walredo = WalRedoManager::new(id, walredo_conf, Arc::clone(&self.walredo_metrics));
        Arc::new(Tenant {
            id: id.to_string(),
            generation: self.next_generation.fetch_add(1, Ordering::Relaxed),
            dir: dir.to_path_buf(),
            timeline,
            walredo,
            overrides: Mutex::new(overrides),
            deps: Arc::clone(&self.deps),
            cancel: self.cancel.child_token(),
            counters: Default::default(),
        })
    }

    pub fn get(&self, id: &str) -> Option<Arc<Tenant>> {
        lock(&self.tenants).get(id).cloned()
    }

    /// Every tenant, sorted by id.
    pub fn list(&self) -> Vec<Arc<Tenant>> {
        lock(&self.tenants).values().cloned().collect()
    }

    pub fn len(&self) -> usize {
        lock(&self.tenants).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Creates a tenant with empty storage. Cancel-safe up to the final insert: an interrupted
    /// creation leaves a directory without `tenant.toml`, removed at the next start.
    pub async fn create(&self, id: &str, overrides: TenantConfOverrides) -> Result<Arc<Tenant>, TenantError> {
        validate_tenant_id(id)?;
        let _changing = self.change_lock.lock().await;
        if self.cancel.is_cancelled() {
            return Err(TenantError::ShuttingDown);
        }
        if self.get(id).is_some() {
            return Err(TenantError::Exists(id.to_string()));
        }
        let dir = self.dir.join(id);
        if dir.exists() {
            // A leftover of a creation that did not finish while we run: start afresh.
            std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
        }
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        // Opening storage and writing the config wait on the disk: keep that off the executor.
        let (storage_conf, storage_metrics) = (self.storage_conf.clone(), Arc::clone(&self.storage_metrics));
        let (tenant_dir, tenants_dir, written) = (dir.clone(), self.dir.clone(), overrides.clone());
        let timeline = tokio::task::spawn_blocking(move || -> anyhow::Result<Arc<Timeline>> {
            let timeline = Timeline::open(&tenant_dir.join(TIMELINE_DIR), storage_conf, storage_metrics)?;
            write_overrides(&tenant_dir, &written)?;
            storage::fsync_dir(&tenants_dir).context("sync tenants directory")?;
            Ok(timeline)
        })
        .await
        .context("create tenant storage")??;
        let tenant = self.assemble(id, &dir, overrides, timeline);
        lock(&self.tenants).insert(id.to_string(), Arc::clone(&tenant));
        tracing::info!(tenant_id = id, "created tenant");
        Ok(tenant)
    }

    /// Stops a tenant (its connections are told, its child is reaped) and removes its data.
    pub async fn delete(&self, id: &str) -> Result<(), TenantError> {
        let _changing = self.change_lock.lock().await;
        let tenant = lock(&self.tenants).remove(id).ok_or_else(|| TenantError::NotFound(id.to_string()))?;
        tenant.shutdown().await;
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let doomed = self.dir.join(format!("{DELETED_PREFIX}{id}-{generation}"));
        let (tenant_dir, tenants_dir) = (tenant.dir().to_path_buf(), self.dir.clone());
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            std::fs::rename(&tenant_dir, &doomed)
                .with_context(|| format!("rename {}", tenant_dir.display()))?;
            storage::fsync_dir(&tenants_dir).context("sync tenants directory")?;
            std::fs::remove_dir_all(&doomed).with_context(|| format!("remove {}", doomed.display()))
        })
        .await
        .context("remove tenant data")??;
        tracing::info!(tenant_id = id, "deleted tenant");
        Ok(())
    }

    /// Stops every tenant: ingests made durable, children reaped.
    pub async fn shutdown(&self) {
        let _changing = self.change_lock.lock().await;
        let tenants = self.list();
        for tenant in &tenants {
            tenant.cancel.cancel();
        }
        for tenant in tenants {
            tenant.shutdown().await;
        }
    }
}
