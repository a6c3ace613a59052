//! The state a [`super::Timeline`] handle shares with its committer ([`super::commit`]): the
//! ingest queue, the index, the durable LSN and the failure state.
//!
//! Its own module so that the handle and the committer both depend on it and not on each other
//! (the committer learns nothing of the handle; the handle starts the committer).
//!
//! **Invariants:** every lock here is a std lock, never held across an await; a panic under the
//! queue lock leaves a consistent queue (no multi-step updates).

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime};

use page_types::{BufferTag, Lsn};
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::layer::DiskWait;
use super::manifest::{self, Manifest};
use super::read::{Picked, Snapshot};
use super::segment::EncodedFrame;
use super::{
    index, FsyncFailed, GetError, IngestError, ReadLimits, StorageConf, StorageMetrics, StorageWriteError,
};

/// Bytes of encoded batches that may wait for the committer; `ingest` waits for room beyond it.
pub(super) const QUEUE_BUDGET_KIB: usize = 256 << 10;

/// A batch waiting for the committer, encoded by its submitter.
pub(super) struct Pending {
    pub(super) frame: EncodedFrame,
    pub(super) last_lsn: Lsn,
    pub(super) done: oneshot::Sender<Result<Lsn, IngestError>>,
    /// Queue budget held until the batch is written.
    pub(super) _permit: OwnedSemaphorePermit,
}

/// The ingest queue, shared by `ingest` callers and the committer (std mutex: never held across
/// an await).
pub(super) struct Queue {
    pub(super) pending: Vec<Pending>,
    /// Last LSN accepted into the queue (durable or not).
    pub(super) last_queued: Lsn,
    pub(super) stopping: bool,
    /// Set while storage writes fail: why, and when ingests are let through again.
    pub(super) failure: Option<Failure>,
    /// Test hook: the committer leaves the queue alone while set (and not stopping).
    pub(super) hold: bool,
    /// Test hook: the committer's next group fsync fails.
    pub(super) fail_next_fsync: bool,
    /// Test hook: the committer's next cut of a failed group (the truncate) fails.
    pub(super) fail_next_cut: bool,
    /// Seal the active segment at the next round whatever its size (for compaction); cleared
    /// when the seal is done. Watch `seals` for it.
    pub(super) seal_now: bool,
    /// Ingests are refused with this reason while it is set ([`super::Timeline::refuse_ingest`]).
    pub(super) refused: Option<String>,
}

/// A failing storage: the public part, and when the next group may try again.
pub(super) struct Failure {
    pub(super) state: StorageWriteError,
    /// Ingests are refused before this instant (always, if `state.fatal`); from then on they are
    /// queued, and the next group is the retry.
    pub(super) retry_at: Instant,
}

impl Failure {
    pub(super) fn error(&self) -> IngestError {
        IngestError::StorageUnavailable { error: self.state.error.clone(), fatal: self.state.fatal }
    }
}

/// State shared by the [`Timeline`] handle and its committer.
pub(super) struct Shared {
    pub(super) dir: PathBuf,
    pub(super) conf: StorageConf,
    pub(super) metrics: Arc<StorageMetrics>,
    pub(super) queue: Mutex<Queue>,
    /// Schedules the committer on the commit pool (set once by [`super::commit::start`]).
    pub(super) wake: OnceLock<Box<dyn Fn() + Send + Sync>>,
    /// Set (and `exited_cv` notified) when the committer has stopped: what `Drop` waits for.
    pub(super) exited: Mutex<bool>,
    pub(super) exited_cv: Condvar,
    pub(super) index: RwLock<index::Index>,
    pub(super) durable: watch::Sender<Lsn>,
    /// The failure of storage writes, if they are failing (set and cleared with `queue.failure`).
    pub(super) health: watch::Sender<Option<StorageWriteError>>,
    pub(super) layers: AtomicU64,
    pub(super) active_len: AtomicU64,
    /// Cancelled when the committer has stopped: nothing becomes durable after that.
    pub(super) stopped: CancellationToken,
    pub(super) budget: Arc<Semaphore>,
    pub(super) span: tracing::Span,
    /// The manifest as last written. Its lock serializes manifest writes (the committer's seals
    /// and compaction's installs); held only for the write.
    pub(super) manifest: Mutex<Manifest>,
    /// The generation of the manifest as last written, sent after every write (what a copy of
    /// the timeline elsewhere, the remote uploader, follows).
    pub(super) manifest_written: watch::Sender<u64>,
    /// Next in-memory file id (the index's name for a file).
    pub(super) next_file_id: AtomicU32,
    /// GetPage below this LSN is refused (see [`Manifest::gc_cutoff`]); only grows.
    pub(super) gc_cutoff: AtomicU64,
    /// Seals done since open; bumped after each (compaction waits on it after `seal_now`).
    pub(super) seals: watch::Sender<u64>,
    /// Test hook: the next manifest write renames its file into place, then its directory
    /// fsync fails.
    pub(super) fail_next_manifest_sync: AtomicBool,
    /// The timeline this one branched from, and the branch point: what it holds at or below
    /// that LSN is this one's history too (the handle's [`super::Ancestor`], as the modules
    /// below the handle see it).
    pub(super) ancestor: Option<Below>,
    /// The branch points of the timelines open with this one as their ancestor, with how many
    /// at each: no GC cutoff goes above the lowest ([`super::Timeline::hold_branch_point`]).
    /// Its lock is held while a cutoff is chosen and raised.
    pub(super) branch_points: Mutex<std::collections::BTreeMap<Lsn, usize>>,
    /// How layers that are not on local disk are fetched (`storage::residence`), if they can be.
    pub(super) fetch: Option<Arc<super::residence::Fetch>>,
    /// Test hook: the lookups of a key in the index so far (`Timeline::key_lookups`).
    #[cfg(test)]
    pub(super) key_lookups: AtomicU64,
}

/// A branch's ancestor below the handle: its shared state and the branch point.
#[derive(Clone)]
pub(super) struct Below {
    pub(super) shared: Arc<Shared>,
    pub(super) lsn: Lsn,
}

impl Shared {
    /// Fails for an LSN below the GC cutoff. Checked after a lookup: the cutoff is raised before
    /// compaction drops anything, so a lookup it does not refuse saw every value it needs.
    pub(super) fn check_retained(&self, lsn: Lsn) -> Result<(), GetError> {
        let cutoff = Lsn(self.gc_cutoff.load(Ordering::Relaxed));
        if lsn < cutoff {
            return Err(GetError::BelowGcCutoff { lsn, cutoff });
        }
        Ok(())
    }

    /// Counts a lookup of a key in the index, for tests (`Timeline::key_lookups`).
    pub(super) fn count_lookup(&self) {
        #[cfg(test)]
        self.key_lookups.fetch_add(1, Ordering::Relaxed);
    }

    /// The values to read for `key` as of `lsn` from a snapshot of the index taken now
    /// ([`pick_through`]). Blocking where `wait` allows.
    pub(super) fn pick_at(
        &self,
        key: BufferTag,
        lsn: Lsn,
        limits: ReadLimits,
        wait: DiskWait,
    ) -> Result<Option<Picked>, GetError> {
        self.count_lookup();
        let snapshot = self.index.read().unwrap_or_else(PoisonError::into_inner).snapshot(key, lsn);
        let picked = pick_through(&snapshot, self.ancestor.as_ref(), key, lsn, limits, wait)?;
        self.check_retained(lsn)?;
        Ok(picked)
    }
}

/// The values of `key` at or below `lsn` that one timeline's `snapshot` picks (`Snapshot::pick`,
/// oldest first, or none), with the values the timeline's `ancestor` has for `key` at the branch
/// point (or at `lsn` below it) before them, when they do not begin with an image: the
/// ancestor's history below its own values, within what `limits` leaves. Reads index blocks
/// waiting for the disk only where `wait` allows.
pub(super) fn pick_through(
    snapshot: &Snapshot,
    ancestor: Option<&Below>,
    key: BufferTag,
    lsn: Lsn,
    limits: ReadLimits,
    wait: DiskWait,
) -> Result<Option<Picked>, GetError> {
    let picked = snapshot.pick(key, lsn, limits, wait)?;
    let Some(a) = ancestor else {
        return Ok(picked);
    };
    if picked.as_ref().is_some_and(Picked::starts_with_image) {
        return Ok(picked);
    }
    let (records, bytes) = picked.as_ref().map_or((0, 0), Picked::size);
    let rest = ReadLimits {
        max_records: limits.max_records.saturating_sub(records),
        max_bytes: limits.max_bytes.saturating_sub(bytes),
    };
    let below = a.shared.pick_at(key, lsn.min(a.lsn), rest, wait)?;
    Ok(match (below, picked) {
        (Some(below), Some(picked)) => Some(below.followed_by(picked)),
        (below, picked) => below.or(picked),
    })
}

/// How long ingests are refused after a failed round before the next group may retry.
pub(crate) const RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// A failure after which the state on disk is not known: fatal like a failed fsync.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(super) struct Unrecoverable(pub(super) String);

/// Whether `e` is fatal for the timeline: a failed fsync (see [`FsyncFailed`]), or a failure
/// that leaves the state on disk unknown ([`Unrecoverable`]).
pub(super) fn is_fatal(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.is::<FsyncFailed>() || c.is::<Unrecoverable>())
}

fn clone_error(e: &IngestError) -> IngestError {
    match e {
        IngestError::StorageUnavailable { error, fatal } => {
            IngestError::StorageUnavailable { error: error.clone(), fatal: *fatal }
        }
        IngestError::ShuttingDown => IngestError::ShuttingDown,
        other => IngestError::Io(anyhow::anyhow!("{other}")),
    }
}

/// Answers every batch of `batches` with `error`.
pub(super) fn fail_all(batches: Vec<Pending>, error: &IngestError) {
    for p in batches {
        let _ = p.done.send(Err(clone_error(error)));
    }
}

impl Queue {
    /// Whether the committer has something to do: batches to commit (unless held), or a stop.
    pub(super) fn has_work(&self) -> bool {
        ((!self.pending.is_empty() || self.seal_now) && !self.hold) || self.stopping
    }
}

impl Shared {
    pub(super) fn queue(&self) -> MutexGuard<'_, Queue> {
        // A panic under this lock leaves a consistent queue (no multi-step updates).
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn begin_stop(&self) {
        self.queue().stopping = true;
        self.wake();
        self.budget.close();
    }

    /// Writes the manifest changed by `change`, atomically and durably, under the manifest lock
    /// (so that the committer and compaction never write over each other's changes). Refused
    /// once the timeline has failed for good: after a failed fsync nothing more is written
    /// until it is reopened. If the new manifest was renamed into place but its directory
    /// fsync failed ([`manifest::RenamedNotSynced`]), the manifest kept here is the new one, as
    /// the directory names it, and the caller must treat the change as perhaps made.
    pub(super) fn update_manifest(
        &self,
        dir_file: &File,
        change: impl FnOnce(&mut Manifest),
    ) -> anyhow::Result<()> {
        let mut m = self.manifest.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(error) = self.fatal_error() {
            anyhow::bail!("storage failed for good, reopen the timeline: {error}");
        }
        let mut next = m.clone();
        change(&mut next);
        let fail_sync = self.fail_next_manifest_sync.swap(false, Ordering::Relaxed);
        let written = manifest::write_with(&self.dir, dir_file, &mut next, &self.metrics, fail_sync);
        if written.is_ok() || written.as_ref().is_err_and(manifest::RenamedNotSynced::is_in) {
            *m = next;
            self.manifest_written.send_replace(m.generation);
        }
        written
    }

    /// Makes the timeline fail for good if `e` (a compaction's failure) [`is_fatal`], as the
    /// committer does with its own; any other failure of compaction leaves ingest alone.
    pub(super) fn record_if_fatal(&self, e: &anyhow::Error) {
        if is_fatal(e) && self.fatal_error().is_none() {
            self.record_failure(e);
        }
    }

    /// Starts or continues a failure episode with `e` (the committer's failed rounds, and the
    /// fatal failures of compaction): refuses ingests until the retry is due, or for good if
    /// `e` [`is_fatal`]; fails everything queued (after the state is visible); lets the next
    /// batch start right above the durable LSN. Returns the error the refused batches get.
    pub(super) fn record_failure(&self, e: &anyhow::Error) -> IngestError {
        let fatal = is_fatal(e);
        let error = format!("{e:#}");
        self.metrics.write_errors.inc();
        let mut q = self.queue();
        let (since, was_fatal) = match &q.failure {
            Some(f) => (f.state.since, f.state.fatal),
            None => {
                self.metrics.failed_timelines.inc();
                (SystemTime::now(), false)
            }
        };
        match (&q.failure, fatal && !was_fatal) {
            (None, false) => tracing::error!(
                retry_every = ?RETRY_INTERVAL,
                "failed to write to storage, refusing ingests until a retry succeeds: {error}"
            ),
            (_, true) => tracing::error!(
                "failed to sync storage, refusing ingests until the timeline is reopened: {error}"
            ),
            (Some(_), false) => tracing::debug!("failed to write to storage again: {error}"),
        }
        let state = StorageWriteError { error, since, fatal: fatal || was_fatal };
        let failure = Failure { state: state.clone(), retry_at: Instant::now() + RETRY_INTERVAL };
        let error = failure.error();
        let queued = std::mem::take(&mut q.pending);
        q.failure = Some(failure);
        q.last_queued = *self.durable.borrow();
        self.health.send_replace(Some(state));
        drop(q);
        fail_all(queued, &error);
        error
    }

    /// Why the timeline failed for good (a fatal failure: nothing is written until it is
    /// reopened), if it did.
    pub(super) fn fatal_error(&self) -> Option<String> {
        self.queue().failure.as_ref().filter(|f| f.state.fatal).map(|f| f.state.error.clone())
    }

    /// Schedules the committer on the commit pool to look at the queue.
    pub(super) fn wake(&self) {
        if let Some(wake) = self.wake.get() {
            wake();
        }
    }
}
