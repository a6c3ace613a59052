//! The [`Timeline`] handle: the ingest queue in front of the committer, reads, `wait_lsn`,
//! shutdown, and the directory lock.
//!
//! Why separate from the committer: callers (async tasks) only validate, queue and wait here;
//! all file writes happen in the committer's rounds on the commit pool ([`super::commit`]).
//!
//! **Invariants:** the queue's `last_queued` is checked and advanced under the queue lock, in
//! the same critical section that queues the batch; it only grows, except that a failed round
//! sets it back to the last durable LSN (everything above was refused); nothing is queued once
//! `stopping` is set, nor while `failure` is set and its retry is not due; the directory lock is
//! held until the handle is dropped, which waits for the committer to stop.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::fcntl::{Flock, FlockArg};
use page_types::{BufferTag, Lsn};
use tokio::sync::{oneshot, watch, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::util::lock;

use super::format::LOCK_NAME;
use super::index::Version;
use super::layer::DiskWait;
use super::read::{would_wait, Lookup, ReadPlan, ReadStart, Snapshot};
use super::residence::{Fetch, ResidentLayer};
use super::segment::EncodedFrame;
use super::shared::{pick_through, Below, Pending, Queue, Shared, QUEUE_BUDGET_KIB};
use super::{
    commit, recovery, validate, GetError, IngestBatch, IngestError, ReadLimits, ReconstructData, StorageConf,
    StorageMetrics, StorageWriteError, TimelineStats, WaitLsnError,
};

/// What a branch reads below its branch point: the timeline it branched from and the branch
/// point. A branch's history is its own values (all above `lsn`) over its ancestor's history at
/// or below `lsn` (which is, in turn, the ancestor's own values over its ancestor's, and so on).
#[derive(Clone)]
pub struct Ancestor {
    pub timeline: Arc<Timeline>,
    pub lsn: Lsn,
}

/// The storage of one timeline. See the module doc.
pub struct Timeline {
    shared: Arc<Shared>,
    /// Keeps the committer alive (the pool holds it only while it is queued or running).
    _job: Arc<commit::Job>,
    /// The directory lock, released when the handle is dropped (after the committer stopped;
    /// a pool worker may hold `shared` a moment longer, but writes nothing any more).
    _lock: Flock<File>,
    /// A branch's ancestor (the same link as `shared`'s, at the handle's level: its handle is
    /// kept open while this one is, and its branch point held).
    ancestor: Option<Ancestor>,
}

impl Timeline {
    /// Opens or creates the storage in `dir` (creating it), recovering from a crash: finishes an
    /// interrupted seal and cuts a torn tail. Fails if another `Timeline` has `dir` open.
    /// Blocking (reads every layer's footer and fences, and the active segment): from async
    /// code, call it in `spawn_blocking`.
    pub fn open(
        dir: &Path,
        conf: StorageConf,
        metrics: Arc<StorageMetrics>,
    ) -> anyhow::Result<Arc<Timeline>> {
        Timeline::open_branch(dir, conf, metrics, None)
    }

    /// [`Timeline::open`] of a branch of `ancestor` (of a timeline of its own with `None`). The
    /// branch point is held in the ancestor while the handle lives ([`Timeline::hold_branch_point`]:
    /// fails, opening nothing, if the ancestor's GC cutoff is above it, with a
    /// [`GetError::BelowGcCutoff`] inside), and the last durable LSN starts at it: what is
    /// ingested comes above it. Blocking, as [`Timeline::open`].
    pub fn open_branch(
        dir: &Path,
        conf: StorageConf,
        metrics: Arc<StorageMetrics>,
        ancestor: Option<Ancestor>,
    ) -> anyhow::Result<Arc<Timeline>> {
        if let Some(a) = &ancestor {
            a.timeline.hold_branch_point(a.lsn).map_err(anyhow::Error::new)?;
        }
        let opened = Timeline::open_storage(dir, conf, metrics, ancestor.clone());
        match (&opened, &ancestor) {
            (Ok(timeline), Some(a)) => {
                timeline.advance_durable(a.lsn);
            }
            (Err(_), Some(a)) => a.timeline.release_branch_point(a.lsn),
            _ => {}
        }
        opened
    }

    fn open_storage(
        dir: &Path,
        conf: StorageConf,
        metrics: Arc<StorageMetrics>,
        ancestor: Option<Ancestor>,
    ) -> anyhow::Result<Arc<Timeline>> {
        anyhow::ensure!(conf.layer_size > 0, "layer_size must be positive");
        let span = tracing::info_span!("timeline", dir = %dir.display());
        let _enter = span.enter();
        create_dir_durably(dir)?;
        let dir_file = File::open(dir).context("open timeline directory")?;
        let lock = lock_dir(dir)?;
        let fetch = conf.source.as_ref().map(|source| Arc::new(Fetch::new(dir, source, &metrics)));
        let rec = recovery::recover(dir, &dir_file, &metrics, fetch.as_ref())?;
        tracing::info!(
            last_lsn = %rec.last_lsn, layers = rec.layers, values = rec.index.values(),
            "opened timeline storage"
        );
        let layers = rec.layers;
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            conf,
            metrics,
            queue: Mutex::new(Queue {
                pending: Vec::new(),
                last_queued: rec.last_lsn,
                stopping: false,
                failure: None,
                hold: false,
                fail_next_fsync: false,
                fail_next_cut: false,
                seal_now: false,
                refused: None,
            }),
            wake: OnceLock::new(),
            exited: Mutex::new(false),
            exited_cv: Condvar::new(),
            index: RwLock::new(rec.index),
            durable: watch::Sender::new(rec.last_lsn),
            health: watch::Sender::new(None),
            layers: AtomicU64::new(rec.layers),
            active_len: AtomicU64::new(rec.segment.len),
            stopped: CancellationToken::new(),
            budget: Arc::new(Semaphore::new(QUEUE_BUDGET_KIB)),
            span: span.clone(),
            gc_cutoff: AtomicU64::new(rec.manifest.gc_cutoff),
            manifest_written: watch::Sender::new(rec.manifest.generation),
            manifest: Mutex::new(rec.manifest),
            next_file_id: AtomicU32::new(rec.next_file_id),
            seals: watch::Sender::new(0),
            fail_next_manifest_sync: AtomicBool::new(false),
            ancestor: ancestor.as_ref().map(|a| Below { shared: Arc::clone(&a.timeline.shared), lsn: a.lsn }),
            branch_points: Mutex::new(BTreeMap::new()),
            fetch,
            #[cfg(test)]
            key_lookups: AtomicU64::new(0),
        });
        let job = commit::start(&shared, dir_file, rec.segment)?;
        // Added only once `Drop` (which subtracts the timeline's layers) can run.
        shared.metrics.layer_files.add(layers as i64);
        Ok(Arc::new(Timeline { shared, _job: job, _lock: lock, ancestor }))
    }

    /// Queues `batch` and returns its last LSN once it is durable (written and fdatasync'd,
    /// together with whatever else was queued: group commit).
    ///
    /// The LSN check happens when the batch is queued, normally at the future's first poll
    /// (later only if the queue budget is exhausted), so a caller that pipelines several ingests
    /// must poll them in LSN order (e.g. with an ordered join), or one may be rejected as
    /// `LsnWentBackwards`.
    ///
    /// The batch is checked completely before anything is written; an invalid batch changes
    /// nothing. Cancel-safe in this sense: dropped before the batch is queued (while waiting for
    /// queue room), nothing happens; dropped after, the batch still becomes durable (or fails
    /// with the timeline), it is just not acknowledged, and its LSNs count as ingested.
    pub async fn ingest(&self, batch: IngestBatch) -> Result<Lsn, IngestError> {
        self.submit(batch).await?.await
    }

    /// Queues `batch` and returns once it is queued (its LSN order fixed), with a future that
    /// resolves when it is durable. Callers that pipeline ingests call this in LSN order and
    /// await the returned futures in any order. Waits only for queue room (the memory budget).
    ///
    /// Cancel-safe: dropped while waiting for room, nothing happens. The returned future, if
    /// dropped, leaves the batch queued: it becomes durable (or fails) unacknowledged.
    pub async fn submit(
        &self,
        batch: IngestBatch,
    ) -> Result<impl std::future::Future<Output = Result<Lsn, IngestError>> + Send + 'static, IngestError>
    {
        self.submit_checked(batch, None).await
    }

    /// [`Timeline::submit`] for a writer whose batches must be contiguous (a WAL receiver:
    /// each batch continues the WAL of the one before): refused with `NotContiguous`, nothing
    /// queued, unless the last LSN queued is still `after`, what this writer queued last (or
    /// moved the durable LSN to, [`Timeline::advance_durable`]). A failed group commit sets the
    /// queue back to the last durable LSN; without this check the writer's next batch would be
    /// stored above the lost ones once the retry is due, a gap for ever.
    ///
    /// Cancel-safe as [`Timeline::submit`].
    pub async fn submit_after(
        &self,
        after: Lsn,
        batch: IngestBatch,
    ) -> Result<impl std::future::Future<Output = Result<Lsn, IngestError>> + Send + 'static, IngestError>
    {
        self.submit_checked(batch, Some(after)).await
    }

    async fn submit_checked(
        &self,
        batch: IngestBatch,
        after: Option<Lsn>,
    ) -> Result<impl std::future::Future<Output = Result<Lsn, IngestError>> + Send + 'static, IngestError>
    {
        let (first, last, frame_len) = validate(&batch.values)?;
        let permits = u32::try_from(frame_len.div_ceil(1024))
            .map_err(|_| IngestError::Invalid("batch too large".to_string()))?;
        let permit =
            self.shared.budget.clone().acquire_many_owned(permits).await.map_err(|_| self.refusal())?;
        // Encoded here, by the submitting task, not by the committer: a timeline's batches all
        // pass through its committer, which then only writes, syncs and indexes them.
        let frame = EncodedFrame::encode(&batch.values);
        drop(batch);
        let (done, rx) = oneshot::channel();
        {
            let mut q = self.shared.queue();
            if let Some(f) = q.failure.as_ref().filter(|f| f.state.fatal || Instant::now() < f.retry_at) {
                return Err(f.error());
            }
            if q.stopping {
                return Err(IngestError::ShuttingDown);
            }
            if let Some(why) = &q.refused {
                return Err(IngestError::StorageUnavailable { error: why.clone(), fatal: false });
            }
            if let Some(after) = after.filter(|a| *a != q.last_queued) {
                return Err(IngestError::NotContiguous { after, last: q.last_queued });
            }
            if first <= q.last_queued {
                return Err(IngestError::LsnWentBackwards { last: q.last_queued, got: first });
            }
            q.last_queued = last;
            q.pending.push(Pending { frame, last_lsn: last, done, _permit: permit });
        }
        self.shared.wake();
        Ok(async move {
            match rx.await {
                Ok(result) => result,
                Err(_) => Err(IngestError::Io(anyhow::anyhow!("committer exited without an answer"))),
            }
        })
    }

    /// Why an ingest is refused once the queue budget is closed.
    fn refusal(&self) -> IngestError {
        match &self.shared.queue().failure {
            Some(f) => f.error(),
            None => IngestError::ShuttingDown,
        }
    }

    /// Moves the last durable LSN up to `lsn` without storing anything, when nothing is in
    /// flight (every queued batch is durable) and `lsn` is above it; later ingests must be above
    /// `lsn`. For a WAL receiver: its caller vouches that everything up to `lsn` it had to store
    /// is durable (the WAL after its last value held records that carry none), so GetPage up to
    /// `lsn` need not wait. Not persisted: after a reopen the receiver moves it again. Whether
    /// it moved.
    pub fn advance_durable(&self, lsn: Lsn) -> bool {
        let mut q = self.shared.queue();
        let durable = *self.shared.durable.borrow();
        if q.failure.is_some() || q.last_queued != durable || lsn <= durable {
            return false;
        }
        q.last_queued = lsn;
        self.shared.durable.send_replace(lsn);
        true
    }

    /// The highest LSN whose batch is durable (0/0 for an empty timeline).
    pub fn last_durable_lsn(&self) -> Lsn {
        *self.shared.durable.borrow()
    }

    /// Waits until [`Timeline::last_durable_lsn`] is above `lsn` (an ingest), or forever once
    /// the committer has stopped. Cancel-safe: it only watches.
    pub async fn ingested_above(&self, lsn: Lsn) {
        let mut rx = self.shared.durable.subscribe();
        if rx.wait_for(|d| *d > lsn).await.is_err() {
            std::future::pending::<()>().await;
        }
    }

    /// Waits until [`Timeline::last_durable_lsn`] is at least `lsn`, for at most `timeout`.
    /// Fails early with `ShuttingDown` once the committer has stopped below `lsn`, and at once
    /// with `StorageUnavailable` while storage writes fail (now or as soon as they start to).
    /// Cancel-safe: it only watches.
    pub async fn wait_lsn(&self, lsn: Lsn, timeout: Duration) -> Result<(), WaitLsnError> {
        let mut rx = self.shared.durable.subscribe();
        let mut health = self.shared.health.subscribe();
        let reached = tokio::select! {
            biased;
            r = tokio::time::timeout(timeout, rx.wait_for(|d| *d >= lsn)) => match r {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(_)) => false,
                Err(_) => {
                    let last_durable = self.last_durable_lsn();
                    return Err(WaitLsnError::Timeout { wanted: lsn, last_durable, timeout });
                }
            },
            h = health.wait_for(|h| h.is_some()) => {
                let error = match h {
                    Ok(h) => h.as_ref().map(|e| e.error.clone()).unwrap_or_default(),
                    Err(_) => String::new(),
                };
                if self.last_durable_lsn() >= lsn {
                    return Ok(());
                }
                let last_durable = self.last_durable_lsn();
                return Err(WaitLsnError::StorageUnavailable { wanted: lsn, last_durable, error });
            }
            _ = self.shared.stopped.cancelled() => self.last_durable_lsn() >= lsn,
        };
        if reached {
            return Ok(());
        }
        Err(WaitLsnError::ShuttingDown { wanted: lsn, last_durable: self.last_durable_lsn() })
    }

    /// The LSN of the newest value of `key` at or below `lsn`: which version of the page `lsn`
    /// sees. Reads only the index: the layers' index blocks (through the block cache), waiting
    /// for the disk only where `wait` allows (else an error, with nothing read). `Ok(None)` if
    /// the key has nothing at or below `lsn`; `BelowGcCutoff` if `lsn` is below the GC cutoff.
    /// On a branch, a key it holds no value of is looked up in its ancestor at the branch point
    /// (or at `lsn` below it).
    pub fn version_at(&self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> Result<Option<Lsn>, GetError> {
        self.shared.count_lookup();
        let version = self.shared.index.read().unwrap_or_else(PoisonError::into_inner).version(key, lsn);
        let found = version.newest(key, lsn, wait)?;
        self.shared.check_retained(lsn)?;
        match (found, &self.ancestor) {
            (None, Some(a)) => a.timeline.version_at(key, lsn.min(a.lsn), wait),
            (found, _) => Ok(found),
        }
    }

    /// One lookup of `key` at `lsn` for a page read: the page's version (the LSN of the newest
    /// value at or below `lsn`) and what `cached` has for it, or, when it has nothing, the read
    /// begun ([`Lookup::Read`]: [`Timeline::plan_read_from`] plans it without looking the key up
    /// again). `cached` is asked once, and for a version found in the active segment under the
    /// index's lock (so that the entries the plan needs are copied out under that same lock,
    /// and only on a miss: a hit copies nothing): it must be quick and must not call into this
    /// timeline. Never waits for the disk: an index block the kernel's page cache does not hold
    /// fails the lookup with an error that `would_wait` tells, nothing read. `BelowGcCutoff` if
    /// `lsn` is below the GC cutoff. On a branch, a key it holds no value of is looked up in
    /// its ancestor at the branch point (or at `lsn` below it), and the read begun there is
    /// planned there.
    pub(crate) fn lookup<T>(
        &self,
        key: BufferTag,
        lsn: Lsn,
        cached: impl FnOnce(Lsn) -> Option<T>,
    ) -> Result<Lookup<T>, GetError> {
        self.shared.count_lookup();
        let mut cached = Some(cached);
        let mut ask = |version: Lsn| cached.take().and_then(|f| f(version));
        let index = self.shared.index.read().unwrap_or_else(PoisonError::into_inner);
        let found = match index.version(key, lsn) {
            Version::Found(version) => match ask(version) {
                Some(value) => Lookup::Cached { version, value },
                None => Lookup::Read(ReadStart::new(key, lsn, version, index.snapshot(key, lsn))),
            },
            Version::InLayers(layers) => {
                drop(index);
                match layers.newest(key, lsn, DiskWait::Refused).map_err(GetError::Io)? {
                    None => Lookup::NotFound,
                    Some(found) => match ask(found.lsn) {
                        Some(value) => Lookup::Cached { version: found.lsn, value },
                        None => {
                            let snapshot = Snapshot::in_layers(layers, found);
                            Lookup::Read(ReadStart::new(key, lsn, found.lsn, snapshot))
                        }
                    },
                }
            }
        };
        self.shared.check_retained(lsn)?;
        match (found, &self.ancestor, cached) {
            (Lookup::NotFound, Some(a), Some(cached)) => {
                Ok(match a.timeline.lookup(key, lsn.min(a.lsn), cached)? {
                    Lookup::Read(start) => Lookup::Read(start.in_ancestor()),
                    other => other,
                })
            }
            (found, _, _) => Ok(found),
        }
    }

    /// Test hook: how many times a key was looked up in the index (each call of
    /// [`Timeline::version_at`], [`Timeline::lookup`] or a plan made from the key).
    #[cfg(test)]
    pub(crate) fn key_lookups(&self) -> u64 {
        self.shared.key_lookups.load(Ordering::Relaxed)
    }

    /// The GC cutoff: GetPage below it is refused (compaction may have dropped what it needs).
    pub fn gc_cutoff(&self) -> Lsn {
        Lsn(self.shared.gc_cutoff.load(Ordering::Relaxed))
    }

    /// Raises the GC cutoff to at least `lsn` (in memory; a compaction pass makes it durable,
    /// and the caller says it again after a restart until then): a timeline whose history
    /// starts at `lsn` (a PostgreSQL base backup imported, consistent from its end) refuses
    /// reads below it as it refuses reads below what GC dropped.
    pub fn raise_gc_cutoff(&self, lsn: Lsn) {
        self.shared.gc_cutoff.fetch_max(lsn.0, Ordering::Relaxed);
    }

    /// Holds `lsn` as the branch point of a timeline branched from this one: until
    /// [`Timeline::release_branch_point`], no GC cutoff goes above it, so every version a read
    /// at or below it needs is kept. Fails with `BelowGcCutoff` if the cutoff already is.
    pub fn hold_branch_point(&self, lsn: Lsn) -> Result<(), GetError> {
        let mut points = lock(&self.shared.branch_points);
        self.shared.check_retained(lsn)?;
        *points.entry(lsn).or_default() += 1;
        Ok(())
    }

    /// Lets go of a branch point [`Timeline::hold_branch_point`] held.
    pub fn release_branch_point(&self, lsn: Lsn) {
        let mut points = lock(&self.shared.branch_points);
        if let Some(n) = points.get_mut(&lsn) {
            *n -= 1;
            if *n == 0 {
                points.remove(&lsn);
            }
        }
    }

    /// The branch points held in this timeline, lowest first.
    pub fn branch_points(&self) -> Vec<Lsn> {
        lock(&self.shared.branch_points).keys().copied().collect()
    }

    /// The ancestor of a branch.
    pub fn ancestor(&self) -> Option<&Ancestor> {
        self.ancestor.as_ref()
    }

    /// The newest image of `key` at or below `lsn` and the records above it up to `lsn`, oldest
    /// first; without an image, all records at or below `lsn`: [`Timeline::plan_read`] and its
    /// reads, on the calling thread (blocking, positional, mostly from the page cache). For
    /// tests: the daemon plans with [`Timeline::plan_read_async`] (or
    /// [`Timeline::plan_read_from`]) and reads with [`Timeline::read_planned`].
    #[cfg(test)]
    pub(crate) fn get_reconstruct_data(
        &self,
        key: BufferTag,
        lsn: Lsn,
        limits: ReadLimits,
    ) -> Result<ReconstructData, GetError> {
        self.plan_read(key, lsn, limits)?.execute().map_err(GetError::Io)
    }

    /// [`Timeline::plan_read_async`] made on the calling thread, reading the index blocks it
    /// needs whatever the wait. For tests.
    #[cfg(test)]
    pub(crate) fn plan_read(
        &self,
        key: BufferTag,
        lsn: Lsn,
        limits: ReadLimits,
    ) -> Result<ReadPlan, GetError> {
        let plan = self.shared.pick_at(key, lsn, limits, DiskWait::Allowed)?.map(ReadPlan::new);
        self.planned(key, lsn, plan)
    }

    /// The reads for `key` at `lsn`, from the index alone (its lock held only to copy the
    /// entries out, the spans planned after): what they will cost ([`ReadPlan::bytes`], for
    /// reserving memory before reading) and `TooLarge` over `limits`, with nothing read. The
    /// plan keeps its files open; [`Timeline::read_planned`] reads it. Every value's checksum is
    /// verified when it is read.
    ///
    /// When the kernel's page cache holds every
    /// index block the plan needs, it is made here, on the calling thread; if one would wait
    /// for the disk, the plan is made on the blocking pool, so an index block missing from the
    /// page cache never stalls an executor thread (as [`Timeline::read_planned`] does for the
    /// values), and there the values are brought into the page cache too
    /// ([`ReadPlan::warm_values`]): the read then runs inline, one trip to the pool for both.
    ///
    /// Cancel-safe: dropped, it leaves nothing behind (a plan being made on the blocking pool
    /// is made and dropped there).
    pub(crate) async fn plan_read_async(
        &self,
        key: BufferTag,
        lsn: Lsn,
        limits: ReadLimits,
    ) -> Result<ReadPlan, GetError> {
        self.shared.count_lookup();
        let snapshot = self.shared.index.read().unwrap_or_else(PoisonError::into_inner).snapshot(key, lsn);
        self.plan_snapshot(snapshot, key, lsn, limits).await
    }

    /// The reads for `key` at `lsn` of a chain too long for one plan, as consecutive plans of
    /// at most `piece` each, oldest first ([`super::read::Picked::into_pieces`]): the first starts from the
    /// key's newest image (if any), each of the others from the page the one before rebuilds.
    /// The index entries of the whole chain (not its values) are held at once: fails with
    /// `TooLarge` past `chain`, with nothing read. Made on the blocking pool if an index block
    /// would wait for the disk, as [`Timeline::plan_read_async`] is; cancel-safe as it is.
    pub(crate) async fn plan_read_pieces(
        &self,
        key: BufferTag,
        lsn: Lsn,
        chain: ReadLimits,
        piece: ReadLimits,
    ) -> Result<Vec<ReadPlan>, GetError> {
        self.shared.count_lookup();
        let snapshot = self.shared.index.read().unwrap_or_else(PoisonError::into_inner).snapshot(key, lsn);
        let ancestor = self.shared.ancestor.clone();
        let pick = move |wait| pick_through(&snapshot, ancestor.as_ref(), key, lsn, chain, wait);
        let picked = match pick(DiskWait::Refused) {
            Err(e) if would_wait(&e) => {
                self.shared.metrics.plans_offloaded.inc();
                tokio::task::spawn_blocking(move || pick(DiskWait::Allowed))
                    .await
                    .map_err(|e| GetError::Io(anyhow::anyhow!("storage plan task failed: {e}")))??
            }
            picked => picked?,
        };
        self.shared.check_retained(lsn)?;
        let picked = picked.ok_or(GetError::NotFound { key, lsn })?;
        Ok(picked.into_pieces(piece).into_iter().map(ReadPlan::new).collect())
    }

    /// The plan of a read that [`Timeline::lookup`] began, made from what the lookup found (the
    /// active segment's entries it copied out, or the layer it found the version in and the
    /// runs below it) without looking the key up again, as [`Timeline::plan_read_async`] makes
    /// one (on the blocking pool if an index block would wait for the disk). The plan's
    /// [`ReadPlan::newest_lsn`] is the lookup's version.
    ///
    /// Cancel-safe as [`Timeline::plan_read_async`].
    pub(crate) async fn plan_read_from(
        &self,
        start: ReadStart,
        limits: ReadLimits,
    ) -> Result<ReadPlan, GetError> {
        let (key, lsn) = (start.key, start.lsn);
        // Begun in an ancestor: planned there, against its own ancestors.
        let mut owner = self;
        for _ in 0..start.depth {
            owner = match &owner.ancestor {
                Some(a) => &a.timeline,
                None => {
                    return Err(GetError::Io(anyhow::anyhow!(
                        "a read begun in an ancestor this timeline lacks"
                    )))
                }
            };
        }
        owner.plan_snapshot(start.snapshot, key, lsn, limits).await
    }

    /// The plan for `key` at `lsn` from `snapshot` (see [`Timeline::plan_read_async`]).
    async fn plan_snapshot(
        &self,
        snapshot: Snapshot,
        key: BufferTag,
        lsn: Lsn,
        limits: ReadLimits,
    ) -> Result<ReadPlan, GetError> {
        let ancestor = self.shared.ancestor.clone();
        let pick = move |wait| pick_through(&snapshot, ancestor.as_ref(), key, lsn, limits, wait);
        let plan = match pick(DiskWait::Refused) {
            Err(e) if would_wait(&e) => {
                self.shared.metrics.plans_offloaded.inc();
                tokio::task::spawn_blocking(move || {
                    let plan = pick(DiskWait::Allowed)?.map(ReadPlan::new);
                    if let Some(plan) = &plan {
                        plan.warm_values();
                    }
                    Ok::<_, GetError>(plan)
                })
                .await
                .map_err(|e| GetError::Io(anyhow::anyhow!("storage plan task failed: {e}")))??
            }
            picked => picked?.map(ReadPlan::new),
        };
        self.planned(key, lsn, plan)
    }

    /// The plan for `key` at `lsn`, if the index snapshot picked any values.
    fn planned(&self, key: BufferTag, lsn: Lsn, plan: Option<ReadPlan>) -> Result<ReadPlan, GetError> {
        self.shared.check_retained(lsn)?;
        plan.ok_or(GetError::NotFound { key, lsn })
    }

    /// Seals the active segment now if it holds anything (so that compaction can take its
    /// values), and waits until the committer has tried. Fails, sealing nothing, once the
    /// timeline has failed for good (a fatal storage failure: reopen it). Cancel-safe.
    pub async fn freeze(&self) -> anyhow::Result<()> {
        self.refuse_if_failed_for_good()?;
        if self.shared.active_len.load(Ordering::Relaxed) <= super::format::FILE_HEADER_LEN {
            return Ok(());
        }
        let mut seals = self.shared.seals.subscribe();
        seals.borrow_and_update();
        self.shared.queue().seal_now = true;
        self.shared.wake();
        tokio::select! {
            changed = seals.changed() => changed.context("committer stopped")?,
            () = self.shared.stopped.cancelled() => anyhow::bail!("timeline shut down"),
        }
        self.refuse_if_failed_for_good()
    }

    /// Fails once a fatal storage failure stopped every write until the timeline is reopened.
    fn refuse_if_failed_for_good(&self) -> anyhow::Result<()> {
        match self.shared.fatal_error() {
            Some(error) => anyhow::bail!("storage failed for good, reopen the timeline: {error}"),
            None => Ok(()),
        }
    }

    /// A full compaction pass ([`Timeline::begin_pass`] of [`super::PassKind::Full`]), for tests.
    #[cfg(test)]
    pub(crate) fn begin_compaction(
        &self,
        conf: super::CompactionConf,
    ) -> anyhow::Result<Option<super::Pass>> {
        self.begin_pass(conf, super::PassKind::Full)
    }

    /// Starts a compaction pass of `kind` ([`super::PassKind`]) over the frozen layers it takes
    /// (see [`super::Pass`]); `None` if there are none. Writes the manifest (blocking): call it
    /// off the executor.
    pub fn begin_pass(
        &self,
        conf: super::CompactionConf,
        kind: super::PassKind,
    ) -> anyhow::Result<Option<super::Pass>> {
        super::Pass::begin(&self.shared, conf, kind, None)
    }

    /// Starts a GC pass of the one compaction output `layer` ([`super::PassKind::Gc`], an id of
    /// [`Timeline::overwritten`]); `None` if it is no longer a layer of the timeline.
    pub fn begin_gc(&self, conf: super::CompactionConf, layer: u32) -> anyhow::Result<Option<super::Pass>> {
        super::Pass::begin(&self.shared, conf, super::PassKind::Gc, Some(layer))
    }

    /// For each compaction output, what the layers above it hold of its key range (see
    /// [`super::Overwritten`]): where GC of one layer may pay.
    pub fn overwritten(&self) -> std::sync::Arc<[super::Overwritten]> {
        let map = std::sync::Arc::clone(
            self.shared.index.read().unwrap_or_else(PoisonError::into_inner).layer_map(),
        );
        map.overwritten()
    }

    /// How much compaction work waits: records ingested since the last pass began, and the
    /// frozen layers that are not compaction outputs.
    pub fn backlog(&self) -> super::Backlog {
        let index = self.shared.index.read().unwrap_or_else(PoisonError::into_inner);
        let runs = index.runs();
        let size = |r: std::ops::Range<usize>| index.layers()[r].iter().map(|l| l.size).sum::<u64>();
        super::Backlog {
            keys: index.keys(),
            new_records: index.new_records(),
            longest_new_chain: u64::from(index.longest_new_chain()),
            sealed_layers: index.layers().iter().filter(|l| !l.compacted()).count() as u64,
            runs: runs.len() as u64,
            bottom_bytes: runs.first().map_or(0, |r| size(r.clone())),
            upper_bytes: runs.get(1..).unwrap_or_default().iter().map(|r| size(r.clone())).sum(),
        }
    }

    /// Runs a plan of [`Timeline::plan_read_async`] or [`Timeline::plan_read_from`]: when the kernel's page cache
    /// holds every value, the reads run here, on the calling thread; if any would wait for the
    /// disk, the whole plan runs on the blocking pool, so a cold read never stalls an executor
    /// thread.
    ///
    /// Cancel-safe: dropping it abandons a read in progress on the blocking pool, which has no
    /// side effects.
    pub(crate) async fn read_planned(&self, plan: ReadPlan) -> Result<ReconstructData, GetError> {
        if let Some(read) = plan.try_execute_cached() {
            self.shared.metrics.reads_inline.inc();
            return read.map_err(GetError::Io);
        }
        self.shared.metrics.reads_offloaded.inc();
        tokio::task::spawn_blocking(move || plan.execute())
            .await
            .map_err(|e| GetError::Io(anyhow::anyhow!("storage read task failed: {e}")))?
            .map_err(GetError::Io)
    }

    /// Stops accepting ingests, completes the queued ones (durable), stops the committer.
    /// Reads keep working. Idempotent; cancel-safe (the stop, once begun, goes on without it).
    pub async fn shutdown(&self) {
        self.shared.begin_stop();
        self.shared.stopped.cancelled().await;
    }

    /// The timeline's files as its manifest last listed them: what a copy of the timeline
    /// elsewhere (the remote uploader) copies. Layers listed here exist in the directory until a
    /// later manifest drops them, unless they were evicted ([`Timeline::evict`]: the bucket holds
    /// them).
    pub fn layer_files(&self) -> super::LayerFiles {
        let m = self.shared.manifest.lock().unwrap_or_else(PoisonError::into_inner);
        super::LayerFiles {
            generation: m.generation,
            layers: m
                .layers
                .iter()
                .map(|l| super::LayerFile {
                    name: l.name.clone(),
                    first_lsn: Lsn(l.first_lsn),
                    last_lsn: Lsn(l.last_lsn),
                    size: l.size,
                    crc32c: l.crc32c,
                })
                .collect(),
            gc_cutoff: Lsn(m.gc_cutoff),
        }
    }

    /// Refuses ingests with `why` as a storage failure that is not fatal (the daemon's bound on
    /// local disk is reached), until called with `None`.
    pub fn refuse_ingest(&self, why: Option<String>) {
        self.shared.queue().refused = why;
    }

    /// The layers whose files are on local disk, with their last read: what eviction chooses
    /// from.
    pub fn resident_layers(&self) -> Vec<ResidentLayer> {
        let map = Arc::clone(self.shared.index.read().unwrap_or_else(PoisonError::into_inner).layer_map());
        let fetchable = self.shared.fetch.is_some();
        map.layers()
            .iter()
            .filter(|l| l.is_resident())
            .map(|l| ResidentLayer {
                name: l.name.clone(),
                size: l.size,
                last_read: l.last_read(),
                evictable: fetchable && l.can_be_fetched(),
            })
            .collect()
    }

    /// Evicts layer `name` from local disk: deletes its file and puts a non-resident twin in its
    /// place in the layer map, which a read fetches again (`storage::residence`); readers
    /// holding the old map keep its open file. The caller makes sure the source can give it
    /// back (the bucket's index lists it). Whether it was evicted: not when the timeline has no
    /// source, or the layer is not listed, not resident, or named without its key range.
    /// Blocking (an unlink).
    pub fn evict(&self, name: &str) -> anyhow::Result<bool> {
        let Some(fetch) = &self.shared.fetch else {
            return Ok(false);
        };
        let map = Arc::clone(self.shared.index.read().unwrap_or_else(PoisonError::into_inner).layer_map());
        let Some(layer) = map.layers().iter().find(|l| l.name == name) else {
            return Ok(false);
        };
        if !layer.is_resident() || !layer.can_be_fetched() {
            return Ok(false);
        }
        let crc32c = {
            let m = self.shared.manifest.lock().unwrap_or_else(PoisonError::into_inner);
            match m.layers.iter().find(|l| l.name == name) {
                Some(l) => l.crc32c,
                None => return Ok(false),
            }
        };
        // Deleted first: a twin in the map may be fetched at once, into the same name.
        match std::fs::remove_file(self.shared.dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("delete evicted layer {name}")),
        }
        let twin = layer.evicted(crc32c, fetch);
        let swapped =
            self.shared.index.write().unwrap_or_else(PoisonError::into_inner).swap_twin(layer, twin);
        if swapped {
            self.shared.metrics.layer_evictions.inc();
        }
        Ok(swapped)
    }

    /// Sends the manifest's generation after every manifest write (see [`Timeline::layer_files`]).
    pub fn manifest_changes(&self) -> watch::Receiver<u64> {
        self.shared.manifest_written.subscribe()
    }

    /// Whether the active segment holds values not yet sealed into a layer.
    pub fn holds_unsealed_values(&self) -> bool {
        self.shared.active_len.load(Ordering::Relaxed) > super::format::FILE_HEADER_LEN
    }

    /// The timeline's directory.
    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Why storage writes are failing, if they are (`None` when healthy).
    pub fn write_error(&self) -> Option<StorageWriteError> {
        self.shared.health.borrow().clone()
    }

    /// Every key, in key order, with the LSN of its oldest value (the key space, for
    /// `GET /v1/tenant/{id}/keyspace`). Reads every layer's whole index (the lock held only to
    /// copy the active segment's entries): O(values), blocking; call it from a blocking thread.
    /// On a branch, with the keys its ancestor has at or below the branch point.
    pub fn keyspace(&self) -> anyhow::Result<Vec<(BufferTag, Lsn)>> {
        let (active, layers) = self.shared.index.read().unwrap_or_else(PoisonError::into_inner).all();
        let own = super::layer_map::first_lsns(&active, layers.layers())?;
        let Some(a) = &self.ancestor else {
            return Ok(own);
        };
        let mut all: BTreeMap<BufferTag, Lsn> =
            a.timeline.keyspace()?.into_iter().filter(|(_, first)| *first <= a.lsn).collect();
        for (key, first) in own {
            all.entry(key).or_insert(first);
        }
        Ok(all.into_iter().collect())
    }

    /// The keys that `keep` accepts, in key order, without reading the whole key space: a skip
    /// scan of each layer that goes from each key it finds to the first key above
    /// `skip(key)` (which must leave out no key `keep` accepts), and the active segment's keys
    /// (in memory). At most one index block read (through the block cache) per key found per
    /// layer, and no block that holds only keys skipped; the memory held is the keys kept.
    /// Blocking: call it from a blocking thread.
    pub fn scan_keys(
        &self,
        keep: &dyn Fn(&BufferTag) -> bool,
        skip: &dyn Fn(&BufferTag) -> BufferTag,
    ) -> anyhow::Result<Vec<BufferTag>> {
        let (active, layers) =
            self.shared.index.read().unwrap_or_else(PoisonError::into_inner).keys_where(keep);
        let mut kept = super::layer_map::skip_scan(layers.layers(), keep, skip)?;
        kept.extend(active);
        if let Some(a) = &self.ancestor {
            kept.extend(a.timeline.scan_keys(keep, skip)?);
        }
        Ok(kept.into_iter().collect())
    }

    /// Keys, values, layers, bytes on disk, last durable LSN.
    pub fn stats(&self) -> TimelineStats {
        let (keys, values, runs, record_copy_bytes, map) = {
            let index = self.shared.index.read().unwrap_or_else(PoisonError::into_inner);
            let map = Arc::clone(index.layer_map());
            (index.keys(), index.values(), map.lookup_runs() as u64, index.copied_bytes(), map)
        };
        let resident = map.layers().iter().filter(|l| l.is_resident());
        let (resident_layers, resident_bytes) = resident.fold((0, 0), |(n, b), l| (n + 1, b + l.size));
        TimelineStats {
            keys,
            values,
            layers: self.shared.layers.load(Ordering::Relaxed),
            runs,
            resident_layers,
            on_disk_bytes: resident_bytes + self.shared.active_len.load(Ordering::Relaxed),
            record_copy_bytes,
            last_durable_lsn: self.last_durable_lsn(),
        }
    }

    /// Test hook: how many frozen layers have a block index (only their fences in memory), of
    /// how many.
    #[cfg(test)]
    pub(super) fn block_indexed_layers(&self) -> (usize, usize) {
        let index = self.shared.index.read().unwrap_or_else(PoisonError::into_inner);
        (index.layers().iter().filter(|l| l.block_indexed()).count(), index.layers().len())
    }

    /// Test hook: index blocks read so far from this timeline's layers (from the block cache or
    /// their files), and index blocks in all.
    #[cfg(test)]
    pub(crate) fn index_blocks_read(&self) -> (u64, u64) {
        let index = self.shared.index.read().unwrap_or_else(PoisonError::into_inner);
        index.layers().iter().map(|l| l.blocks_read()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Test hook: while held, the committer leaves queued batches alone.
    #[cfg(test)]
    pub(super) fn hold_commits(&self, hold: bool) {
        self.shared.queue().hold = hold;
        self.shared.wake();
    }

    /// Test hook: makes the next group fsync fail.
    #[cfg(test)]
    pub(super) fn fail_next_fsync(&self) {
        self.shared.queue().fail_next_fsync = true;
    }

    /// Test hook: makes the next cut of a failed group (after a failed write or fsync) fail.
    #[cfg(test)]
    pub(super) fn fail_next_cut(&self) {
        self.shared.queue().fail_next_cut = true;
    }

    /// Test hook: the next manifest write (a seal's, or a compaction's) renames the new
    /// manifest into place, then fails the directory fsync that would make it durable.
    #[cfg(test)]
    pub(super) fn fail_next_manifest_sync(&self) {
        self.shared.fail_next_manifest_sync.store(true, Ordering::Relaxed);
    }

    #[cfg(test)]
    pub(super) fn queued_batches(&self) -> usize {
        self.shared.queue().pending.len()
    }
}

impl Drop for Timeline {
    /// Stops the committer like `shutdown` and blocks until it has finished the queued batches,
    /// so that the directory can be reopened as soon as this returns.
    fn drop(&mut self) {
        self.shared.begin_stop();
        let mut exited = self.shared.exited.lock().unwrap_or_else(PoisonError::into_inner);
        while !*exited {
            exited = self.shared.exited_cv.wait(exited).unwrap_or_else(PoisonError::into_inner);
        }
        let layers = self.shared.layers.load(Ordering::Relaxed);
        self.shared.metrics.layer_files.sub(layers as i64);
        if let Some(a) = &self.ancestor {
            a.timeline.release_branch_point(a.lsn);
        }
    }
}

/// Creates `dir` if missing and makes its directory entry durable.
fn create_dir_durably(dir: &Path) -> anyhow::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::create_dir_all(dir).context("create timeline directory")?;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        File::open(parent).and_then(|p| p.sync_all()).context("fsync parent of timeline directory")?;
    }
    Ok(())
}

/// Takes the exclusive lock that keeps a second `Timeline` off `dir`.
fn lock_dir(dir: &Path) -> anyhow::Result<Flock<File>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK_NAME))
        .context("open lock file")?;
    Flock::lock(file, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
        anyhow::anyhow!("timeline directory is already open ({errno}): {}", dir.display())
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;
    use crate::storage::layer_map::RUNS_SEARCHED;
    use crate::storage::segment::ProbesMiss;
    use crate::storage::test_support::*;
    use crate::storage::DEFAULT_LAYER_SIZE;

    const T: Duration = Duration::from_secs(30);

    /// Drops the timeline's files from the kernel's page cache, and checks that it did.
    ///
    /// `POSIX_FADV_DONTNEED` skips the pages it cannot drop at that moment: dirty ones, and
    /// ones locked for a read in flight (readahead too). So each file is written out first,
    /// and advised again until `mincore` finds none of its pages resident (`mincore` reads
    /// nothing in, where a `RWF_NOWAIT` probe of an absent page starts readahead).
    fn evict_from_page_cache(dir: &Path) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if !path.is_file() {
                continue;
            }
            let file = File::open(&path).unwrap();
            file.sync_all().unwrap();
            let mut tries = 0;
            loop {
                nix::fcntl::posix_fadvise(&file, 0, 0, nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED)
                    .unwrap();
                if resident_pages(&file) == 0 {
                    break;
                }
                tries += 1;
                assert!(tries < 200, "the kernel keeps pages of {} in its page cache", path.display());
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    /// How many pages of `file` the kernel's page cache holds (`mincore` of a mapping of it).
    fn resident_pages(file: &File) -> usize {
        let len = usize::try_from(file.metadata().unwrap().len()).unwrap();
        if len == 0 {
            return 0;
        }
        // SAFETY: a fresh read-only shared mapping of the file's `len` bytes, which nothing
        // reads through (`mincore` only looks at its pages) and which is unmapped below.
        let addr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0)
        };
        assert_ne!(addr, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        // One byte per page; pages are at least 4 KiB, so this is room enough.
        let mut pages = vec![0u8; len.div_ceil(4096)];
        // SAFETY: `addr` maps `len` bytes, and `pages` has a byte for each of their pages.
        let rc = unsafe { libc::mincore(addr, len, pages.as_mut_ptr()) };
        let error = std::io::Error::last_os_error();
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(addr, len) };
        assert_eq!(rc, 0, "mincore: {error}");
        pages.iter().filter(|&&page| page & 1 != 0).count()
    }

    /// Runs `step` until it returns `true`, at most 20 times; panics naming `what` if it never
    /// does. For a read of values the page cache holds, which should run inline: its probe can
    /// still, now and then, find a page it cannot read at once (a page the kernel is migrating
    /// is locked, for one), and the read then runs on the blocking pool. That happened once in
    /// several hundred runs of these tests here, and once in CI; a read that never runs inline
    /// still fails the test.
    async fn until_taken(what: &str, mut step: impl AsyncFnMut() -> bool) {
        const TRIES: u32 = 20;
        for _ in 0..TRIES {
            if step().await {
                return;
            }
        }
        panic!("{what}: not once in {TRIES} tries");
    }

    /// Shuts `tl` (the timeline of `dir`) down and opens `dir` again, its files dropped from the
    /// kernel's page cache: no block of it is in any cache of this process or the kernel's.
    async fn reopen_cold(tl: Arc<Timeline>, dir: &Path, m: &Arc<StorageMetrics>) -> Arc<Timeline> {
        tl.shutdown().await;
        drop(tl);
        let tl = open(dir, DEFAULT_LAYER_SIZE, m);
        evict_from_page_cache(dir);
        tl
    }

    #[tokio::test]
    async fn a_segment_of_small_records_is_sealed_at_its_value_bound_far_below_layer_size() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), 1 << 30, &m);
        const BATCH: usize = 8192;
        let mut lsn = 0;
        for _ in 0..crate::storage::MAX_ACTIVE_VALUES / BATCH {
            let values = (0..BATCH)
                .map(|i| {
                    lsn += 1;
                    (key(i as u32), lsn, record("r"))
                })
                .collect();
            tl.ingest(batch(values)).await.unwrap();
        }
        // The seal runs after the round that filled the segment: one more commit, and a moment.
        lsn += 1;
        tl.ingest(batch(vec![(key(7), lsn, record("r"))])).await.unwrap();
        for _ in 0..500 {
            if tl.stats().layers > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        // The segment is some 10 MB, of a 1 GiB `layer_size`: only its count of values sealed it.
        assert_eq!(tl.stats().layers, 1, "{:?}", tl.stats());
        assert!(tl.stats().on_disk_bytes < 64 << 20, "{:?}", tl.stats());
        assert_eq!(tl.get_reconstruct_data(key(7), Lsn(lsn), NO_LIMITS).unwrap().records.len(), 33);
    }

    #[tokio::test]
    async fn a_read_that_would_wait_for_the_disk_runs_on_the_blocking_pool_and_a_cached_one_inline() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &m);
        let values = vec![(key(1), 10, image(7)), (key(1), 11, record("a")), (key(1), 12, record("b"))];
        tl.ingest(batch(values)).await.unwrap();
        let expected = tl.get_reconstruct_data(key(1), Lsn(12), NO_LIMITS).unwrap();
        assert_eq!(expected.records.len(), 2);

        // Reads the page, counted once, inline or offloaded; says whether it was offloaded.
        let read = async || {
            let (inline, offloaded) = (m.reads_inline.get(), m.reads_offloaded.get());
            assert_eq!(
                tl.read_planned(tl.plan_read(key(1), Lsn(12), NO_LIMITS).unwrap()).await.unwrap(),
                expected
            );
            assert_eq!(m.reads_inline.get() + m.reads_offloaded.get(), inline + offloaded + 1);
            m.reads_offloaded.get() > offloaded
        };
        evict_from_page_cache(dir.path());
        let miss = ProbesMiss::start();
        assert!(read().await, "the read that would wait was offloaded");
        drop(miss);
        // Its blocking reads brought the values into the page cache.
        until_taken("a cached read run inline", async || !read().await).await;
    }

    #[tokio::test]
    async fn an_index_block_that_would_wait_for_the_disk_is_read_on_the_blocking_pool() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &m);
        tl.ingest(batch(vec![(key(1), 10, image(7)), (key(1), 11, record("a"))])).await.unwrap();
        tl.freeze().await.unwrap();
        let expected = tl.get_reconstruct_data(key(1), Lsn(11), NO_LIMITS).unwrap();

        let tl = reopen_cold(tl, dir.path(), &m).await;
        let miss = ProbesMiss::start();
        let mut plan = Some(tl.plan_read_async(key(1), Lsn(11), NO_LIMITS).await.unwrap());
        assert_eq!(m.plans_offloaded.get(), 1, "the plan was made on the blocking pool");
        // The block is in the block cache now: later plans and lookups are made here without a
        // probe of the page cache.
        tl.plan_read_async(key(1), Lsn(11), NO_LIMITS).await.unwrap();
        assert_eq!(m.plans_offloaded.get(), 1, "the second plan was made inline");
        assert_eq!(tl.version_at(key(1), Lsn(11), DiskWait::Refused).unwrap(), Some(Lsn(11)));
        drop(miss);
        // The blocking pool brought the values into the page cache too: the read runs inline.
        until_taken("the read of a plan made on the blocking pool run inline", async || {
            let plan = match plan.take() {
                Some(plan) => plan,
                None => tl.plan_read_async(key(1), Lsn(11), NO_LIMITS).await.unwrap(),
            };
            let offloaded = m.reads_offloaded.get();
            assert_eq!(tl.read_planned(plan).await.unwrap(), expected);
            m.reads_offloaded.get() == offloaded
        })
        .await;

        // Cold again (opened again, nothing read in flight): a lookup that may not wait fails,
        // one that may wait finds the version.
        let tl = reopen_cold(tl, dir.path(), &m).await;
        let _miss = ProbesMiss::start();
        let refused = tl.version_at(key(1), Lsn(11), DiskWait::Refused).unwrap_err();
        assert!(would_wait(&refused), "{refused:?}");
        assert_eq!(tl.version_at(key(1), Lsn(11), DiskWait::Allowed).unwrap(), Some(Lsn(11)));
    }

    /// `tl.lookup` of `key` at `lsn` with a cache that has nothing, and the runs of the layer
    /// map it binary-searched (on this thread). Looked up again, up to 20 times, while an index
    /// block would wait for the disk (the lookup never waits: see `until_taken`).
    fn lookup_uncached(tl: &Timeline, key: BufferTag, lsn: Lsn) -> (Lookup<()>, u64) {
        for _ in 0..20 {
            let before = RUNS_SEARCHED.with(|c| c.get());
            match tl.lookup(key, lsn, |_| None) {
                Err(e) if would_wait(&e) => continue,
                found => return (found.unwrap(), RUNS_SEARCHED.with(|c| c.get()) - before),
            }
        }
        panic!("an index block would wait for the disk in 20 lookups");
    }

    /// A read that `lookup` began (the page cache had nothing for its version) is planned from
    /// what the lookup found: from the layer that holds the version, no run the lookup searched
    /// is searched again; in the active segment, the entries it copied out are the plan's. The
    /// plan reads what a fresh one does.
    #[tokio::test]
    async fn a_read_a_lookup_began_is_planned_without_searching_the_layer_map_again() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        // BufferTag 1 in the oldest of three seals; the two above it hold keys 0 and 2, so that their
        // key ranges hold key 1 and a lookup looks at them too.
        tl.ingest(batch(vec![(key(1), 10, image(1)), (key(1), 11, record("a"))])).await.unwrap();
        tl.freeze().await.unwrap();
        for lsn in [20, 30] {
            tl.ingest(batch(vec![(key(0), lsn, image(2)), (key(2), lsn, image(2))])).await.unwrap();
            tl.freeze().await.unwrap();
        }
        assert_eq!(tl.stats().runs, 3);

        let (found, searched) = lookup_uncached(&tl, key(1), Lsn(40));
        let Lookup::Read(start) = found else { panic!("key 1 is not found, or cached") };
        assert_eq!((start.version(), searched), (Lsn(11), 3), "the newest value, in the oldest run");
        let before = RUNS_SEARCHED.with(|c| c.get());
        let plan = tl.plan_read_from(start, NO_LIMITS).await.unwrap();
        assert_eq!(RUNS_SEARCHED.with(|c| c.get()) - before, 0, "runs searched again by the plan");
        assert_eq!(plan.newest_lsn(), Lsn(11));
        let expected = tl.get_reconstruct_data(key(1), Lsn(40), NO_LIMITS).unwrap();
        assert_eq!(tl.read_planned(plan).await.unwrap(), expected);

        // A version in the active segment: its entries are the plan's, the layers below read.
        tl.ingest(batch(vec![(key(1), 50, record("b"))])).await.unwrap();
        let (Lookup::Read(start), _) = lookup_uncached(&tl, key(1), Lsn(50)) else { panic!("key 1 at 50") };
        assert_eq!(start.version(), Lsn(50));
        let d = tl.read_planned(tl.plan_read_from(start, NO_LIMITS).await.unwrap()).await.unwrap();
        assert_eq!(d, tl.get_reconstruct_data(key(1), Lsn(50), NO_LIMITS).unwrap());
        assert_eq!(d.records.iter().map(|r| r.0).collect::<Vec<_>>(), vec![Lsn(11), Lsn(50)]);

        // The cache's answer for the version, or nothing to read.
        let cached = tl.lookup(key(1), Lsn(40), |version| Some(version.0)).unwrap();
        assert!(matches!(cached, Lookup::Cached { version: Lsn(11), value: 11 }));
        let cached = tl.lookup(key(1), Lsn(60), |version| Some(version.0)).unwrap();
        assert!(matches!(cached, Lookup::Cached { version: Lsn(50), value: 50 }));
        assert!(matches!(lookup_uncached(&tl, key(5), Lsn(60)).0, Lookup::NotFound));
        assert!(matches!(lookup_uncached(&tl, key(1), Lsn(9)).0, Lookup::NotFound));
    }

    #[tokio::test]
    async fn the_durable_lsn_moves_up_without_a_value_only_when_nothing_is_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        tl.ingest(batch(vec![(key(1), 10, image(1))])).await.unwrap();
        assert!(tl.advance_durable(Lsn(40)));
        assert_eq!(tl.last_durable_lsn(), Lsn(40));
        // GetPage up to it need not wait; it never goes back.
        tl.wait_lsn(Lsn(40), std::time::Duration::from_millis(10)).await.unwrap();
        assert!(!tl.advance_durable(Lsn(30)) && !tl.advance_durable(Lsn(40)));
        // Later ingests must be above it.
        let err = tl.ingest(batch(vec![(key(1), 35, image(2))])).await.unwrap_err();
        assert!(matches!(err, IngestError::LsnWentBackwards { .. }), "{err}");
        tl.ingest(batch(vec![(key(1), 50, image(2))])).await.unwrap();
        assert_eq!(tl.last_durable_lsn(), Lsn(50));
        // Not persisted: a reopen knows only the values.
        drop(tl);
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        assert_eq!(tl.last_durable_lsn(), Lsn(50));
    }

    #[tokio::test]
    async fn ingest_then_get_returns_exact_image_and_records_at_latest_and_historical_lsns() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        let (k, other) = (key(1), key(2));
        let lsn = tl
            .ingest(batch(vec![(k, 10, record("init")), (other, 10, image(9)), (k, 20, record("r20"))]))
            .await
            .unwrap();
        assert_eq!(lsn, Lsn(20));
        tl.ingest(batch(vec![(k, 30, image(3))])).await.unwrap();
        tl.ingest(batch(vec![(k, 40, record("r40")), (k, 50, record("r50"))])).await.unwrap();
        assert_eq!(tl.last_durable_lsn(), Lsn(50));

        let latest = tl.get_reconstruct_data(k, Lsn(u64::MAX), NO_LIMITS).unwrap();
        assert_eq!(latest.image, Some((Lsn(30), bytes_of(&image(3)))));
        let recs = vec![(Lsn(40), bytes_of(&record("r40"))), (Lsn(50), bytes_of(&record("r50")))];
        assert_eq!(latest.records, recs);

        let at45 = tl.get_reconstruct_data(k, Lsn(45), NO_LIMITS).unwrap();
        assert_eq!(at45.image, Some((Lsn(30), bytes_of(&image(3)))));
        assert_eq!(at45.records, recs[..1]);

        let at30 = tl.get_reconstruct_data(k, Lsn(30), NO_LIMITS).unwrap();
        assert_eq!((at30.image.map(|i| i.0), at30.records.len()), (Some(Lsn(30)), 0));

        let at29 = tl.get_reconstruct_data(k, Lsn(29), NO_LIMITS).unwrap();
        assert_eq!(at29.image, None);
        let old = vec![(Lsn(10), bytes_of(&record("init"))), (Lsn(20), bytes_of(&record("r20")))];
        assert_eq!(at29.records, old);

        let o = tl.get_reconstruct_data(other, Lsn(10), NO_LIMITS).unwrap();
        assert_eq!((o.image, o.records.len()), (Some((Lsn(10), bytes_of(&image(9)))), 0));
        assert_eq!(
            tl.stats(),
            TimelineStats {
                keys: 2,
                values: 6,
                layers: 0,
                runs: 0,
                resident_layers: 0,
                on_disk_bytes: std::fs::metadata(dir.path().join("active.seg")).unwrap().len(),
                record_copy_bytes: 13,
                last_durable_lsn: Lsn(50),
            }
        );
    }

    #[tokio::test]
    async fn several_keys_sharing_one_lsn_are_all_stored() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        let values = (0..100).map(|b| (key(b), 7, record(&format!("v{b}")))).collect();
        tl.ingest(batch(values)).await.unwrap();
        for b in 0..100 {
            let d = tl.get_reconstruct_data(key(b), Lsn(7), NO_LIMITS).unwrap();
            assert_eq!(d.records, vec![(Lsn(7), bytes_of(&record(&format!("v{b}"))))]);
        }
    }

    #[tokio::test]
    async fn wait_lsn_succeeds_when_ingest_arrives() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        let waiter = tokio::spawn({
            let tl = tl.clone();
            async move { tl.wait_lsn(Lsn(100), T).await }
        });
        tl.ingest(batch(vec![(key(1), 50, record("a"))])).await.unwrap();
        // Durable is 50 now, below what the waiter wants: it cannot have finished.
        assert!(!waiter.is_finished());
        tl.ingest(batch(vec![(key(1), 100, record("b"))])).await.unwrap();
        waiter.await.unwrap().unwrap();
        tl.wait_lsn(Lsn(100), Duration::ZERO).await.unwrap();
    }

    #[tokio::test]
    async fn wait_lsn_without_ingest_times_out_naming_both_lsns() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        tl.ingest(batch(vec![(key(1), 0x10, record("a"))])).await.unwrap();
        let err = tl.wait_lsn(Lsn(0x1_0000_0020), Duration::from_millis(20)).await.unwrap_err();
        assert!(matches!(err, WaitLsnError::Timeout { .. }));
        let msg = err.to_string();
        assert!(msg.contains("1/20") && msg.contains("0/10"), "{msg}");
    }

    #[tokio::test]
    async fn shutdown_completes_queued_ingests_then_refuses_new_ones_and_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        tl.hold_commits(true);
        let queued = tokio::spawn({
            let tl = tl.clone();
            async move { tl.ingest(batch(vec![(key(1), 5, record("a"))])).await }
        });
        while tl.queued_batches() == 0 {
            tokio::task::yield_now().await;
        }
        tl.shutdown().await;
        assert_eq!(queued.await.unwrap().unwrap(), Lsn(5));
        tl.shutdown().await;
        let err = tl.ingest(batch(vec![(key(1), 6, record("b"))])).await.unwrap_err();
        assert!(matches!(err, IngestError::ShuttingDown), "{err}");
        let err = tl.wait_lsn(Lsn(6), T).await.unwrap_err();
        assert!(matches!(err, WaitLsnError::ShuttingDown { .. }), "{err}");
        // Reads keep working after shutdown.
        assert_eq!(tl.get_reconstruct_data(key(1), Lsn(5), NO_LIMITS).unwrap().records.len(), 1);
    }

    #[tokio::test]
    async fn second_open_of_an_open_directory_fails_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &m);
        let err = Timeline::open(dir.path(), StorageConf::default(), m.clone()).err().unwrap();
        assert!(format!("{err:#}").contains("already open"), "{err:#}");
        drop(tl);
        open(dir.path(), DEFAULT_LAYER_SIZE, &m);
    }

    #[tokio::test]
    async fn reopen_after_shutdown_serves_everything_and_continues_lsns() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(&dir.path().join("tenant/timeline"), DEFAULT_LAYER_SIZE, &m);
        for i in 1..=20u32 {
            let v = if i % 5 == 0 { image(i as u8) } else { record(&format!("r{i}")) };
            tl.ingest(batch(vec![(key(i % 3), u64::from(i) * 10, v)])).await.unwrap();
        }
        tl.shutdown().await;
        let stats = tl.stats();
        drop(tl);

        let tl = open(&dir.path().join("tenant/timeline"), DEFAULT_LAYER_SIZE, &m);
        assert_eq!(tl.stats(), stats);
        for i in 1..=20u32 {
            let d = tl.get_reconstruct_data(key(i % 3), Lsn(u64::from(i) * 10), NO_LIMITS).unwrap();
            let newest = d.records.last().map(|r| r.0).or(d.image.as_ref().map(|i| i.0));
            assert_eq!(newest, Some(Lsn(u64::from(i) * 10)));
        }
        let err = tl.ingest(batch(vec![(key(0), 200, record("x"))])).await.unwrap_err();
        assert!(matches!(err, IngestError::LsnWentBackwards { .. }));
        tl.ingest(batch(vec![(key(0), 201, record("x"))])).await.unwrap();
    }

    #[tokio::test]
    async fn reopen_after_drop_without_shutdown_keeps_every_acknowledged_batch() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &m);
        for i in 1..=10u64 {
            tl.ingest(batch(vec![(key(1), i, record(&format!("r{i}")))])).await.unwrap();
        }
        drop(tl);
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &m);
        let d = tl.get_reconstruct_data(key(1), Lsn(10), NO_LIMITS).unwrap();
        let want: Vec<_> = (1..=10u64).map(|i| (Lsn(i), bytes_of(&record(&format!("r{i}"))))).collect();
        assert_eq!(d.records, want);
    }
}
