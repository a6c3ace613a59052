//! A tenant's timelines: `main`, which the tenant is created with, and its branches.
//!
//! A branch is made at an LSN of a timeline of the tenant (its ancestor; at most that timeline's
//! last durable LSN, at least its GC cutoff) and copies nothing: its storage starts empty, and
//! reads what it does not hold in its ancestor as of the branch point ([`storage::Ancestor`]).
//! So a branch costs the same whatever the size of what it branches from.
//!
//! On disk a branch is `<tenant dir>/branches/<timeline id>/`: `timeline.json` (its ancestor and
//! branch point), its storage in `timeline/` and, once it has one, its WAL source file: what a
//! tenant directory holds for `main`, less `tenant.toml`. Creation writes `timeline.json` into
//! `branches/.creating-<id>/`, fsyncs it, renames the directory into place and fsyncs
//! `branches/`: after a crash there is either no branch or a whole one (its storage, empty, is
//! made at its first open); `.creating-` leftovers are removed at load. Deletion renames the
//! directory to `.deleted-<id>-<n>` and removes it, as a tenant's.
//!
//! **Invariants:** a timeline that has branches is not deleted; a branch is loaded after its
//! ancestor (ordered by ancestry, not by id), and a tenant one of whose branches cannot be
//! loaded is broken as a whole, with the branch named; while a branch is open its point is held
//! in its ancestor's storage, so the ancestor's GC keeps everything the branch reads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::Context;
use page_types::Lsn;
use serde::{Deserialize, Serialize};

use super::{validate_tenant_id, TenantError, Tenants, DELETED_PREFIX, TIMELINE_DIR};
use crate::storage::{self, Ancestor, GetError, StorageConf, StorageMetrics, Timeline};
use crate::tenant::{wal_receiver, Tenant, MAIN_TIMELINE};
use crate::util::lock;

/// The directory of a tenant's branches, in the tenant's.
pub(super) const BRANCHES_DIR: &str = "branches";
/// A branch's description, in its directory.
const TIMELINE_FILE: &str = "timeline.json";
/// Prefix of a branch directory being created.
const CREATING_PREFIX: &str = ".creating-";

/// `timeline.json`: what a branch is a branch of.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TimelineFile {
    ancestor_timeline_id: String,
    ancestor_lsn: Lsn,
}

/// A branch opened at load, before it is served.
pub(super) struct LoadedBranch {
    pub(super) id: String,
    pub(super) dir: PathBuf,
    pub(super) ancestor_id: String,
    pub(super) lsn: Lsn,
    pub(super) timeline: Arc<Timeline>,
    pub(super) source: Option<wal_receiver::SourceFile>,
}

/// Why a branch could not be made or removed (beyond [`TenantError`]'s).
#[derive(Debug, thiserror::Error)]
pub enum TimelineError {
    #[error(transparent)]
    Tenant(#[from] TenantError),
    #[error("tenant {tenant} has no timeline {timeline:?}")]
    NotFound { tenant: String, timeline: String },
    #[error("tenant {tenant} already has a timeline {timeline:?}")]
    Exists { tenant: String, timeline: String },
    /// A request that cannot be done in the state things are in (the message says why).
    #[error("{0}")]
    Refused(String),
    /// A request that is wrong in itself.
    #[error("{0}")]
    Invalid(String),
    /// A branch below its ancestor's GC cutoff.
    #[error("LSN {lsn} is below the GC cutoff {cutoff} of timeline {timeline:?}: its history there is gone")]
    BelowGcCutoff { timeline: String, lsn: Lsn, cutoff: Lsn },
}

impl Tenants {
    /// The timeline `timeline` of the active tenant `id`.
    pub fn timeline(&self, id: &str, timeline: &str) -> Result<Arc<Tenant>, TimelineError> {
        let main = self.get(id)?;
        if timeline == MAIN_TIMELINE {
            return Ok(main);
        }
        lock(&self.branches)
            .get(id)
            .and_then(|branches| branches.get(timeline))
            .cloned()
            .ok_or_else(|| TimelineError::NotFound { tenant: id.to_string(), timeline: timeline.to_string() })
    }

    /// The timelines of the active tenant `id`: `main` first, then its branches by id.
    pub fn timelines(&self, id: &str) -> Result<Vec<Arc<Tenant>>, TimelineError> {
        let main = self.get(id)?;
        let branches = lock(&self.branches).get(id).map(|b| b.values().cloned().collect::<Vec<_>>());
        Ok(std::iter::once(main).chain(branches.into_iter().flatten()).collect())
    }

    /// Branches `new_id` from the timeline `ancestor_id` of tenant `id` at `lsn` (default: its
    /// last durable LSN). Copies nothing. See the module doc for what is refused and for what a
    /// crash leaves.
    ///
    /// Cancel-safe as [`Tenants::create`]: the disk holds no branch or a whole one; the caller
    /// may not know which.
    pub async fn create_branch(
        &self,
        id: &str,
        new_id: &str,
        ancestor_id: &str,
        lsn: Option<Lsn>,
    ) -> Result<Arc<Tenant>, TimelineError> {
        validate_tenant_id(new_id).map_err(|_| {
            TimelineError::Invalid(format!(
                "invalid timeline id {new_id:?}: use 1 to 64 characters of A-Z a-z 0-9 _ -"
            ))
        })?;
        let _changing = self.change_lock.lock().await;
        if self.cancel.is_cancelled() {
            return Err(TenantError::ShuttingDown.into());
        }
        let ancestor = self.timeline(id, ancestor_id)?;
        if new_id == MAIN_TIMELINE || self.timeline(id, new_id).is_ok() {
            return Err(TimelineError::Exists { tenant: id.to_string(), timeline: new_id.to_string() });
        }
        if ancestor.import_incomplete.load(Ordering::Acquire) {
            return Err(TimelineError::Refused(format!(
                "timeline {ancestor_id:?} has not finished importing its PostgreSQL's base backup: \
                 nothing to branch from yet"
            )));
        }
        let durable = ancestor.last_durable_lsn();
        let lsn = lsn.unwrap_or(durable);
        if lsn > durable || lsn.is_reserved() {
            return Err(TimelineError::Refused(format!(
                "LSN {lsn} is above the last durable LSN {durable} of timeline {ancestor_id:?}"
            )));
        }
        let main = self.get(id)?;
        let branches_dir = main.dir().join(BRANCHES_DIR);
        let dir = branches_dir.join(new_id);
        let (storage_conf, storage_metrics) = (self.confs.of(id, new_id), Arc::clone(&self.storage_metrics));
        let (parent, file) = (
            Arc::clone(&ancestor.timeline),
            TimelineFile { ancestor_timeline_id: ancestor_id.to_string(), ancestor_lsn: lsn },
        );
        let new_name = new_id.to_string();
        let timeline = tokio::task::spawn_blocking(move || {
            // Held for the creation: the ancestor's GC cannot pass the point meanwhile.
            parent.hold_branch_point(lsn)?;
            let made = make_branch(&branches_dir, &new_name, &file, storage_conf, storage_metrics, &parent);
            parent.release_branch_point(lsn);
            made
        })
        .await
        .map_err(|e| TenantError::Other(anyhow::anyhow!("branch creation task failed: {e}")))?
        .map_err(|e| match e {
            GetError::BelowGcCutoff { lsn, cutoff } => {
                TimelineError::BelowGcCutoff { timeline: ancestor_id.to_string(), lsn, cutoff }
            }
            other => TenantError::Other(anyhow::anyhow!("create branch {new_id}: {other}")).into(),
        })?;
        let branch =
            self.assemble(id, new_id, &dir, main.overrides(), timeline, Some((Arc::clone(&ancestor), lsn)));
        lock(&self.branches)
            .entry(id.to_string())
            .or_default()
            .insert(new_id.to_string(), Arc::clone(&branch));
        tracing::info!(tenant_id = id, timeline_id = new_id, ancestor = ancestor_id, %lsn, "created branch");
        Ok(branch)
    }

    /// Stops the branch `timeline` of tenant `id` and removes its data. Refused for `main` (the
    /// tenant's deletion removes it) and for a timeline with branches. Cancel-safe as
    /// [`Tenants::delete`]: it runs as a task of its own.
    pub async fn delete_branch(self: &Arc<Self>, id: &str, timeline: &str) -> Result<(), TimelineError> {
        let (tenants, id, timeline) = (Arc::clone(self), id.to_string(), timeline.to_string());
        let deletion = tokio::spawn(async move { tenants.delete_branch_now(&id, &timeline).await });
        deletion.await.map_err(|e| TenantError::Other(anyhow::anyhow!("branch deletion task failed: {e}")))?
    }

    async fn delete_branch_now(&self, id: &str, timeline: &str) -> Result<(), TimelineError> {
        let _changing = self.change_lock.lock().await;
        if timeline == MAIN_TIMELINE {
            return Err(TimelineError::Refused(format!(
                "timeline {MAIN_TIMELINE:?} goes with its tenant: delete the tenant"
            )));
        }
        let branch = self.timeline(id, timeline)?;
        let children: Vec<String> = self
            .timelines(id)?
            .iter()
            .filter(|t| t.ancestor.as_ref().is_some_and(|(a, _)| a.timeline_id == timeline))
            .map(|t| t.timeline_id.clone())
            .collect();
        if !children.is_empty() {
            return Err(TimelineError::Refused(format!(
                "timeline {timeline:?} has branches ({}): delete them first",
                children.join(", ")
            )));
        }
        if let Some(branches) = lock(&self.branches).get_mut(id) {
            branches.remove(timeline);
        }
        branch.shutdown().await;
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let dir = branch.dir().to_path_buf();
        drop(branch);
        tokio::task::spawn_blocking(move || remove_dir(&dir, generation))
            .await
            .context("remove branch data")
            .and_then(|r| r)
            .map_err(TenantError::Other)?;
        tracing::info!(tenant_id = id, timeline_id = timeline, "deleted branch");
        Ok(())
    }
}

/// Writes a branch's directory (see the module doc) and opens its storage. Blocking.
fn make_branch(
    branches_dir: &Path,
    id: &str,
    file: &TimelineFile,
    storage_conf: StorageConf,
    storage_metrics: Arc<StorageMetrics>,
    ancestor: &Arc<Timeline>,
) -> Result<Arc<Timeline>, GetError> {
    let io = |e: anyhow::Error| GetError::Io(e);
    let dir = branches_dir.join(id);
    let creating = branches_dir.join(format!("{CREATING_PREFIX}{id}"));
    (|| -> anyhow::Result<()> {
        if !branches_dir.is_dir() {
            std::fs::create_dir(branches_dir)
                .with_context(|| format!("create {}", branches_dir.display()))?;
            if let Some(parent) = branches_dir.parent() {
                storage::fsync_dir(parent)?;
            }
        }
        if creating.exists() {
            std::fs::remove_dir_all(&creating).with_context(|| format!("remove {}", creating.display()))?;
        }
        std::fs::create_dir(&creating).with_context(|| format!("create {}", creating.display()))?;
        let text = serde_json::to_vec_pretty(file).context("encode timeline.json")?;
        storage::durable_write(&creating, TIMELINE_FILE, &text)?;
        std::fs::rename(&creating, &dir).with_context(|| format!("rename to {}", dir.display()))?;
        storage::fsync_dir(branches_dir)
    })()
    .map_err(io)?;
    let ancestor = Ancestor { timeline: Arc::clone(ancestor), lsn: file.ancestor_lsn };
    Timeline::open_branch(&dir.join(TIMELINE_DIR), storage_conf, storage_metrics, Some(ancestor)).map_err(
        |e| match e.downcast::<GetError>() {
            Ok(e) => e,
            Err(e) => GetError::Io(e),
        },
    )
}

/// Writes a branch's `timeline.json` into `dir` (an attach's copy), durably.
pub(super) fn write_timeline_file(dir: &Path, ancestor_id: &str, lsn: Lsn) -> anyhow::Result<()> {
    let file = TimelineFile { ancestor_timeline_id: ancestor_id.to_string(), ancestor_lsn: lsn };
    let text = serde_json::to_vec_pretty(&file).context("encode timeline.json")?;
    storage::durable_write(dir, TIMELINE_FILE, &text)
}

/// Renames a branch directory to a tombstone, makes that durable, and removes it.
fn remove_dir(dir: &Path, generation: u64) -> anyhow::Result<()> {
    let parent = dir.parent().context("a branch directory has a parent")?;
    let name = dir.file_name().context("a branch directory has a name")?.to_string_lossy();
    let doomed = parent.join(format!("{DELETED_PREFIX}{name}-{generation}"));
    std::fs::rename(dir, &doomed).with_context(|| format!("rename {}", dir.display()))?;
    storage::fsync_dir(parent)?;
    std::fs::remove_dir_all(&doomed).with_context(|| format!("remove {}", doomed.display()))
}

/// Opens the branches of a tenant whose `main` storage is `main` (blocking), ancestors first;
/// removes the leftovers of interrupted creations and deletions. Fails, naming the branch, if
/// one cannot be opened or its ancestor is not among them.
pub(super) fn open_branches(
    tenant_dir: &Path,
    main: &Arc<Timeline>,
    storage_conf: &dyn Fn(&str) -> StorageConf,
    storage_metrics: &Arc<StorageMetrics>,
) -> anyhow::Result<Vec<LoadedBranch>> {
    let branches_dir = tenant_dir.join(BRANCHES_DIR);
    if !branches_dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut described = BTreeMap::new();
    for entry in
        std::fs::read_dir(&branches_dir).with_context(|| format!("list {}", branches_dir.display()))?
    {
        let entry = entry.with_context(|| format!("list {}", branches_dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if name.starts_with(CREATING_PREFIX) || name.starts_with(DELETED_PREFIX) {
            tracing::info!(path = %path.display(), "removing the rest of an interrupted branch creation or deletion");
            std::fs::remove_dir_all(&path).with_context(|| format!("remove {}", path.display()))?;
            continue;
        }
        if validate_tenant_id(&name).is_err() || name == MAIN_TIMELINE {
            tracing::warn!(path = %path.display(), "ignoring a file that is not a branch");
            continue;
        }
        let file_path = path.join(TIMELINE_FILE);
        let text = std::fs::read(&file_path)
            .with_context(|| format!("branch {name}: read {}", file_path.display()))?;
        let file: TimelineFile = serde_json::from_slice(&text)
            .with_context(|| format!("branch {name}: parse {}", file_path.display()))?;
        described.insert(name, (path, file));
    }
    let mut opened: BTreeMap<String, Arc<Timeline>> = BTreeMap::new();
    opened.insert(MAIN_TIMELINE.to_string(), Arc::clone(main));
    let mut loaded = Vec::new();
    while !described.is_empty() {
        let ready: Vec<String> = described
            .iter()
            .filter(|(_, (_, f))| opened.contains_key(&f.ancestor_timeline_id))
            .map(|(name, _)| name.clone())
            .collect();
        if ready.is_empty() {
            let stuck: Vec<String> = described
                .iter()
                .map(|(name, (_, f))| format!("{name} (of {:?})", f.ancestor_timeline_id))
                .collect();
            anyhow::bail!("branches whose ancestor is missing: {}", stuck.join(", "));
        }
        for name in ready {
            let Some((dir, file)) = described.remove(&name) else { continue };
            let source = wal_receiver::read_source_file(&dir).with_context(|| format!("branch {name}"))?;
            let ancestor = Ancestor {
                timeline: Arc::clone(&opened[&file.ancestor_timeline_id]),
                lsn: file.ancestor_lsn,
            };
            let timeline = Timeline::open_branch(
                &dir.join(TIMELINE_DIR),
                storage_conf(&name),
                Arc::clone(storage_metrics),
                Some(ancestor),
            )
            .with_context(|| format!("open branch {name}"))?;
            opened.insert(name.clone(), Arc::clone(&timeline));
            loaded.push(LoadedBranch {
                id: name,
                dir,
                ancestor_id: file.ancestor_timeline_id,
                lsn: file.ancestor_lsn,
                timeline,
                source,
            });
        }
    }
    Ok(loaded)
}
