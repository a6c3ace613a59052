//! The committer of a timeline: owns the active segment, turns queued ingest batches into
//! durable frames with one fdatasync per group (group commit), publishes them, and seals the
//! segment into a layer when it is full (the seal's steps are in [`seal`]). Its rounds
//! run on the process's commit pool ([`super::pool`]), one round of a timeline at a time.
//!
//! Why rounds: fsync blocks for milliseconds; while it runs, new batches pile up in the queue
//! and the next round takes them all, so the fsync rate adapts to the load without a timer or a
//! knob.
//!
//! Round: finish a seal left half-done by an earlier failure -> take every queued batch ->
//! append one frame per batch -> fdatasync -> insert the entries into the index -> publish the
//! last LSN (watch) -> acknowledge every batch -> seal if the segment reached `layer_size`.
//!
//! Failures: a round that fails (ENOSPC, EMFILE, EIO, ...) cuts its group off the segment, fails
//! the group and everything queued behind it, and puts the timeline in the failed state: ingests
//! are refused until a retry is due ([`super::shared::RETRY_INTERVAL`]), then the next group is
//! the retry; a round that succeeds ends the episode. A failed fsync makes the state fatal (no
//! retry, no seal, reopen the timeline): the kernel may have dropped the dirty pages, so a later
//! fsync proves nothing.
//! An episode is logged once when it starts (and once more if it turns fatal), and once when it
//! ends.
//!
//! **Invariants:** only the committer writes to the timeline's directory after open; batches are
//! written in queue order, which is LSN order; a failed group is cut off the segment (truncate to
//! the group's start, fdatasync) before its batches get their error, so an error means "not
//! stored"; nothing is appended while the manifest records a seal in progress; the sealing
//! steps run in order, each at most once successfully, so a failed one is retried from where it
//! stopped.

mod seal;

use std::fs::File;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use anyhow::Context;

use super::layer::BlockIndex;
use super::manifest::SealIntent;
use super::pool::{self, Pool};
use super::segment::ActiveSegment;
use super::shared::{fail_all, Pending, Shared, Unrecoverable};
use super::IngestError;

/// A timeline's committer as the commit pool sees it: the committer state, and whether the
/// timeline is in the pool's run queue (or being run).
pub(super) struct Job {
    shared: Arc<Shared>,
    /// `None` once the committer has stopped.
    committer: Mutex<Option<Committer>>,
    scheduled: AtomicBool,
    pool: Arc<Pool>,
}

/// Sets up the committer of a timeline on the process's commit pool; `shared.wake()` then
/// schedules it.
pub(super) fn start(
    shared: &Arc<Shared>,
    dir_file: File,
    segment: ActiveSegment,
) -> anyhow::Result<Arc<Job>> {
    let committer = Committer { shared: Arc::clone(shared), dir_file, segment, seal: SealState::Idle };
    let job = Arc::new(Job {
        shared: Arc::clone(shared),
        committer: Mutex::new(Some(committer)),
        scheduled: AtomicBool::new(false),
        pool: pool::get()?,
    });
    let weak = Arc::downgrade(&job);
    let wake = move || {
        if let Some(job) = weak.upgrade() {
            job.schedule();
        }
    };
    // Set once: a timeline starts one committer.
    let _ = shared.wake.set(Box::new(wake));
    Ok(job)
}

impl Job {
    /// Puts the timeline in the pool's run queue unless it is there (or running) already.
    pub(super) fn schedule(self: &Arc<Self>) {
        if !self.scheduled.swap(true, Ordering::SeqCst) {
            self.pool.push(Arc::clone(self) as Arc<dyn pool::Task>);
        }
    }
}

impl pool::Task for Job {
    /// Runs one round on a pool worker, then reschedules if more work arrived meanwhile.
    fn run(self: Arc<Self>) {
        let mut slot = self.committer.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(committer) = slot.as_mut() else {
            return;
        };
        let step = {
            let _span = self.shared.span.clone().entered();
            std::panic::catch_unwind(AssertUnwindSafe(|| committer.step()))
        };
        let panicked = step.is_err();
        if panicked || step.is_ok_and(|go_on| !go_on) {
            // Stopped (or broken): the committer and its files go; `scheduled` stays set, so
            // the timeline is never queued again.
            *slot = None;
            drop(slot);
            stopped(&self.shared, panicked);
            return;
        }
        drop(slot);
        self.scheduled.store(false, Ordering::SeqCst);
        if self.shared.queue().has_work() {
            self.schedule();
        }
    }
}

/// Marks the committer of `shared` as stopped: fails what is still queued, refuses ingests,
/// wakes `wait_lsn` and `shutdown`.
fn stopped(shared: &Shared, panicked: bool) {
    let mut q = shared.queue();
    if panicked {
        tracing::error!(parent: &shared.span, "storage commit round panicked, refusing ingests");
    }
    let error = match &q.failure {
        Some(f) => f.error(),
        None if panicked => IngestError::Io(anyhow::anyhow!("storage commit round panicked")),
        None => IngestError::ShuttingDown,
    };
    let queued = std::mem::take(&mut q.pending);
    q.stopping = true;
    if q.failure.take().is_some() {
        shared.metrics.failed_timelines.dec();
    }
    drop(q);
    fail_all(queued, &error);
    shared.budget.close();
    shared.stopped.cancel();
    *shared.exited.lock().unwrap_or_else(PoisonError::into_inner) = true;
    shared.exited_cv.notify_all();
}

pub(super) struct Committer {
    pub(super) shared: Arc<Shared>,
    pub(super) dir_file: File,
    /// The active segment (during a seal: the one being sealed).
    pub(super) segment: ActiveSegment,
    pub(super) seal: SealState,
}

/// How far a seal has got; the manifest records the intent from `Intent` on.
pub(super) enum SealState {
    /// No seal in progress: groups may be appended.
    Idle,
    /// The intent is durable; `active.seg` is not renamed yet.
    Intent(SealIntent),
    /// `active.seg` is a layer now, with the block index written into it (the file's crc32c
    /// is `crc`); the next active segment, once created, waits for the manifest that records
    /// both.
    Renamed { intent: SealIntent, index: BlockIndex, crc: u32, next: Option<ActiveSegment> },
}

impl Committer {
    /// One round: takes every queued batch (with the test hook `fail_next_fsync`) and commits
    /// it as one group. `false` once stopping with nothing queued: the committer is done.
    fn step(&mut self) -> bool {
        let (group, fail_fsync) = {
            let mut q = self.shared.queue();
            if q.hold && !q.stopping {
                return true;
            }
            if q.pending.is_empty() {
                if !q.seal_now || q.stopping {
                    return !q.stopping;
                }
                drop(q);
                self.seal_on_request();
                return true;
            }
            (std::mem::take(&mut q.pending), std::mem::take(&mut q.fail_next_fsync))
        };
        match self.commit_round(group, fail_fsync) {
            Ok(()) => self.succeeded(),
            Err((e, unanswered)) => self.failed(e, unanswered),
        }
        true
    }

    /// A round without batches that seals the active segment because compaction asked
    /// (`seal_now`). The request is cleared whether the seal worked or not (the requester looks
    /// at the layers), and `seals` is bumped either way.
    ///
    /// After a fatal failure it seals nothing: the end of the active segment is not known (a
    /// cut that failed leaves more bytes than the acknowledged frames, which the seal would
    /// turn into a layer longer than its manifest entry), nor is what an fsync dropped.
    fn seal_on_request(&mut self) {
        let sealed = match self.shared.fatal_error() {
            Some(_) => None,
            None => Some(self.advance_seal().context("seal active segment for compaction")),
        };
        self.shared.queue().seal_now = false;
        match sealed {
            Some(Ok(())) => self.succeeded(),
            Some(Err(e)) => self.failed(e, Vec::new()),
            None => {}
        }
        self.shared.seals.send_modify(|n| *n += 1);
    }

    /// Finishes a pending seal, makes `group` durable and acknowledges it, then seals if the
    /// segment is full. A failure before the group is durable returns the group unanswered.
    fn commit_round(
        &mut self,
        group: Vec<Pending>,
        fail_fsync: bool,
    ) -> Result<(), (anyhow::Error, Vec<Pending>)> {
        if let Some(error) = self.shared.fatal_error() {
            return Err((anyhow::anyhow!("{error}"), group));
        }
        let written = self.advance_seal().and_then(|()| self.write_group(&group, fail_fsync));
        if let Err(e) = written {
            return Err((e, group));
        }
        // The episode ends before the acknowledgements (whoever sees one sees the state
        // healthy), unless a seal still has to run: then it ends when the seal is done too.
        let seal_due =
            !matches!(self.seal, SealState::Idle) || self.segment.len >= self.shared.conf.layer_size;
        if !seal_due {
            self.succeeded();
        }
        for p in group {
            let _ = p.done.send(Ok(p.last_lsn));
        }
        self.advance_seal().context("seal active segment").map_err(|e| (e, Vec::new()))
    }

    /// Ends a failure episode after a round that succeeded.
    fn succeeded(&mut self) {
        let mut q = self.shared.queue();
        if q.failure.as_ref().is_some_and(|f| !f.state.fatal) {
            if let Some(f) = q.failure.take() {
                let failing_for = f.state.since.elapsed().unwrap_or_default();
                tracing::info!(?failing_for, "storage writes work again, accepting ingests");
                self.shared.metrics.failed_timelines.dec();
                self.shared.health.send_replace(None);
            }
        }
    }

    /// Starts or continues a failure episode (see [`Shared::record_failure`]) and fails
    /// `unanswered` with it.
    fn failed(&mut self, e: anyhow::Error, unanswered: Vec<Pending>) {
        let error = self.shared.record_failure(&e);
        fail_all(unanswered, &error);
    }

    /// Writes and fsyncs `group`, then publishes it. If the write or the fsync fails, the
    /// segment is cut back to where the group started (and synced), so that nothing of a group
    /// answered with an error survives, not even the frames written before the failure.
    fn write_group(&mut self, group: &[Pending], fail_fsync: bool) -> anyhow::Result<()> {
        let start = (self.segment.len, self.segment.crc);
        let first_entry = self.segment.entries.len();
        if let Err(e) = self.append_and_sync(group, fail_fsync) {
            return Err(match self.roll_back(start, first_entry) {
                Ok(()) => e,
                Err(cut) => anyhow::Error::new(Unrecoverable(format!(
                    "{e:#}; cutting the failed group off failed too ({cut:#}): it may survive a restart"
                ))),
            });
        }
        let m = &self.shared.metrics;
        let bytes: u64 = group.iter().map(|p| p.frame.value_bytes).sum();
        m.group_commit_batches.observe(group.len() as f64);
        m.ingested_batches.inc_by(group.len() as u64);
        let values = (self.segment.entries.len() - first_entry) as u64;
        m.ingested_values.inc_by(values);
        m.ingested_bytes.inc_by(bytes);

        let entries = &self.segment.entries[first_entry..];
        self.shared
            .index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert_frames(entries, group.iter().map(|p| (p.frame.entries.len(), &p.frame.copies)))
            .context("index committed values")?;
        self.shared.active_len.store(self.segment.len, Ordering::Relaxed);
        if let Some(last) = group.last() {
            self.shared.durable.send_replace(last.last_lsn);
        }
        Ok(())
    }

    fn append_and_sync(&mut self, group: &[Pending], fail_fsync: bool) -> anyhow::Result<()> {
        for p in group {
            self.segment.append(&p.frame)?;
        }
        self.shared
            .metrics
            .fsync(|| match fail_fsync {
                true => Err(std::io::Error::other("injected fsync failure")),
                false => self.segment.file.sync_data(),
            })
            .context("fdatasync active segment")?;
        Ok(())
    }

    /// Cuts the active segment back to `len` bytes (whose crc32c is `crc`) and `entries`
    /// entries and makes the cut durable: what a failed group wrote (whole frames or part of
    /// one) is gone from the file.
    fn roll_back(&mut self, (len, crc): (u64, u32), entries: usize) -> anyhow::Result<()> {
        self.segment.entries.truncate(entries);
        (self.segment.len, self.segment.crc) = (len, crc);
        let file = &self.segment.file;
        let fail = std::mem::take(&mut self.shared.queue().fail_next_cut);
        match fail {
            true => Err(std::io::Error::other("injected truncate failure")),
            false => file.set_len(len),
        }
        .context("truncate active segment")?;
        self.shared.metrics.fsync(|| file.sync_data()).context("fdatasync truncated active segment")?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use page_types::Lsn;

    use crate::storage::test_support::*;
    use crate::storage::{GetError, IngestError, Timeline};

    const T: Duration = Duration::from_secs(30);

    fn ingest_n(
        tl: &Timeline,
        n: u64,
        first_lsn: u64,
    ) -> Vec<impl std::future::Future<Output = Result<Lsn, IngestError>> + '_> {
        (0..n)
            .map(|i| {
                let lsn = first_lsn + i;
                tl.ingest(batch(vec![(key(i as u32), lsn, record(&format!("v{lsn}")))]))
            })
            .collect()
    }

    #[tokio::test]
    async fn concurrent_ingest_of_64_batches_needs_fewer_fsyncs_than_batches() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), 1 << 30, &m);
        let fsyncs_before = m.fsyncs.get();
        let results = join_in_order(ingest_n(&tl, 64, 1)).await;
        for (i, r) in results.into_iter().enumerate() {
            assert_eq!(r.unwrap(), Lsn(i as u64 + 1));
        }
        let fsyncs = m.fsyncs.get() - fsyncs_before;
        assert!(fsyncs < 64, "{fsyncs} fsyncs for 64 batches");
        assert_eq!(m.ingested_batches.get(), 64);
        assert_eq!(m.ingested_values.get(), 64);
        let bytes: usize = (1..=64).map(|lsn| format!("v{lsn}").len()).sum();
        assert_eq!(m.ingested_bytes.get(), bytes as u64);
        assert_eq!(m.group_commit_batches.get_sample_sum(), 64.0);
        assert_eq!(m.group_commit_batches.get_sample_count(), fsyncs);
        for i in 0..64u32 {
            tl.get_reconstruct_data(key(i), Lsn(64), NO_LIMITS).unwrap();
        }
    }

    #[tokio::test]
    async fn held_queue_of_64_batches_is_made_durable_by_one_fsync() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), 1 << 30, &m);
        let fsyncs_before = m.fsyncs.get();
        tl.hold_commits(true);
        let all = tokio::spawn({
            let tl = tl.clone();
            async move { join_in_order(ingest_n(&tl, 64, 100)).await }
        });
        while tl.queued_batches() < 64 {
            tokio::task::yield_now().await;
        }
        assert_eq!(tl.last_durable_lsn(), Lsn(0));
        tl.hold_commits(false);
        assert!(all.await.unwrap().into_iter().all(|r| r.is_ok()));
        assert_eq!(m.fsyncs.get() - fsyncs_before, 1);
        assert_eq!(m.group_commit_batches.get_sample_count(), 1);
        assert_eq!(tl.last_durable_lsn(), Lsn(163));
    }

    #[tokio::test]
    async fn ingest_dropped_after_queueing_still_becomes_durable() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), 1 << 30, &metrics());
        tl.hold_commits(true);
        let task = tokio::spawn({
            let tl = tl.clone();
            async move { tl.ingest(batch(vec![(key(1), 42, record("x"))])).await }
        });
        while tl.queued_batches() == 0 {
            tokio::task::yield_now().await;
        }
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        tl.hold_commits(false);
        tl.wait_lsn(Lsn(42), T).await.unwrap();
        let d = tl.get_reconstruct_data(key(1), Lsn(42), NO_LIMITS).unwrap();
        assert_eq!(d.records, vec![(Lsn(42), bytes_of(&record("x")))]);
        let err = tl.ingest(batch(vec![(key(2), 42, record("y"))])).await.unwrap_err();
        assert!(matches!(err, IngestError::LsnWentBackwards { .. }), "{err}");
    }

    #[tokio::test]
    async fn fsync_failure_fails_the_group_and_refuses_every_later_ingest() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), 1 << 30, &m);
        tl.ingest(batch(vec![(key(1), 1, record("a"))])).await.unwrap();
        tl.fail_next_fsync();
        let err = tl.ingest(batch(vec![(key(1), 2, record("b"))])).await.unwrap_err();
        assert!(format!("{err}").contains("injected fsync failure"), "{err}");
        let err = tl.ingest(batch(vec![(key(1), 3, record("c"))])).await.unwrap_err();
        assert!(matches!(err, IngestError::StorageUnavailable { fatal: true, .. }), "{err}");
        assert!(format!("{err}").contains("reopen"), "{err}");
        let state = tl.write_error().unwrap();
        assert!(state.fatal && state.error.contains("injected fsync failure"), "{state:?}");
        assert_eq!((m.write_errors.get(), m.failed_timelines.get()), (1, 1));
        // Nothing of the failed batch is visible; earlier data still is.
        assert_eq!(tl.last_durable_lsn(), Lsn(1));
        assert_eq!(tl.get_reconstruct_data(key(1), Lsn(2), NO_LIMITS).unwrap().records.len(), 1);
        tl.shutdown().await;
        drop(tl);
        assert_eq!(m.failed_timelines.get(), 0);

        // Reopening recovers: the failed batch was never acknowledged, either outcome is fine,
        // but the timeline accepts ingests again.
        let tl = open(dir.path(), 1 << 30, &m);
        let next = tl.last_durable_lsn().0 + 1;
        tl.ingest(batch(vec![(key(1), next, record("d"))])).await.unwrap();
    }

    /// Whether the value ingested at `lsn` for `k` is served after a reopen.
    fn stored_at(tl: &Timeline, k: u32, lsn: u64) -> bool {
        match tl.get_reconstruct_data(key(k), Lsn(lsn), NO_LIMITS) {
            Ok(d) => d.image.is_some_and(|(at, _)| at == Lsn(lsn)),
            Err(GetError::NotFound { .. }) => false,
            Err(e) => panic!("{e}"),
        }
    }

    #[tokio::test]
    async fn disk_full_in_the_middle_of_a_group_leaves_nothing_of_the_failed_batches() {
        let fs = Tmpfs::mount(1 << 20);
        let dir = fs.path().join("timeline");
        let m = metrics();
        let tl = open(&dir, 1 << 30, &m);
        for lsn in 1..=10u64 {
            tl.ingest(batch(vec![(key(lsn as u32), lsn, image(lsn as u8))])).await.unwrap();
        }
        // 200 images queued as one group: about 1.6 MiB, so the disk fills part-way through it.
        tl.hold_commits(true);
        let group = tokio::spawn({
            let tl = tl.clone();
            async move {
                let futs = (11..=210u64)
                    .map(|lsn| tl.ingest(batch(vec![(key(lsn as u32), lsn, image(lsn as u8))])))
                    .collect();
                join_in_order(futs).await
            }
        });
        while tl.queued_batches() < 200 {
            tokio::task::yield_now().await;
        }
        tl.hold_commits(false);
        let results = group.await.unwrap();
        let failed: Vec<u64> = (11..=210u64).filter(|lsn| results[(*lsn - 11) as usize].is_err()).collect();
        assert!(!failed.is_empty(), "the tmpfs did not fill up");
        let acked: Vec<u64> = (1..=210u64).filter(|lsn| !failed.contains(lsn)).collect();
        tl.shutdown().await;
        drop(tl);

        let tl = open(&dir, 1 << 30, &m);
        for &lsn in &acked {
            assert!(stored_at(&tl, lsn as u32, lsn), "acknowledged lsn {lsn} lost");
        }
        let found: Vec<u64> = failed.iter().copied().filter(|&lsn| stored_at(&tl, lsn as u32, lsn)).collect();
        assert!(found.is_empty(), "batches answered with an error were stored: {found:?}");
        assert_eq!(tl.last_durable_lsn(), Lsn(*acked.last().unwrap()));
    }

    #[tokio::test]
    async fn small_layer_size_seals_several_layers_and_reopen_serves_every_value() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), 20_000, &m);
        for i in 1..=30u64 {
            let values = vec![(key(1), i * 10, image(i as u8)), (key(2), i * 10, record(&format!("r{i}")))];
            tl.ingest(batch(values)).await.unwrap();
        }
        // A seal runs after the acknowledgements of its round: let it finish before counting.
        tl.shutdown().await;
        let stats = tl.stats();
        assert!(stats.layers >= 5, "{stats:?}");
        assert_eq!(m.layer_files.get(), stats.layers as i64);
        let layer_files = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".layer"))
            .count();
        assert_eq!(layer_files as u64, stats.layers);

        let check = |tl: &Timeline| {
            for i in 1..=30u64 {
                let d = tl.get_reconstruct_data(key(1), Lsn(i * 10 + 5), NO_LIMITS).unwrap();
                assert_eq!(d.image, Some((Lsn(i * 10), bytes_of(&image(i as u8)))));
                let d = tl.get_reconstruct_data(key(2), Lsn(i * 10), NO_LIMITS).unwrap();
                assert_eq!(d.records.len(), i as usize);
                assert_eq!(d.records[i as usize - 1], (Lsn(i * 10), bytes_of(&record(&format!("r{i}")))));
            }
            assert!(matches!(
                tl.get_reconstruct_data(key(1), Lsn(9), NO_LIMITS),
                Err(GetError::NotFound { .. })
            ));
        };
        check(&tl);
        drop(tl);
        assert_eq!(m.layer_files.get(), 0);

        let tl = open(dir.path(), 20_000, &m);
        assert_eq!(tl.stats(), stats);
        assert_eq!(m.layer_files.get(), stats.layers as i64);
        check(&tl);
    }
}
