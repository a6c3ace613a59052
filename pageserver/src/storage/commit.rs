//! The committer: one std thread per timeline that owns the active segment, turns queued ingest
//! batches into durable frames with one fdatasync per group (group commit), publishes them, and
//! seals the segment into a layer when it is full.
//!
//! Why a dedicated thread: fsync blocks for milliseconds; while it runs, new batches pile up in
//! the queue and the next round takes them all, so the fsync rate adapts to the load without a
//! timer or a knob.
//!
//! Round: take every queued batch -> append one frame per batch -> fdatasync -> insert the
//! entries into the index -> publish the last LSN (watch) -> acknowledge every batch -> seal if
//! the segment reached `layer_size`.
//!
//! **Invariants:** only this thread writes to the timeline's directory after open; batches are
//! written in queue order, which is LSN order; a failed group is cut off the segment (truncate
//! to the group's start, fdatasync) before its batches get their error; a write, fsync, index or seal error stops the
//! thread for good and fails every queued batch (an fsync error is not retryable, and a half-done
//! seal must not be appended to); sealing writes the index and footer, fsyncs, renames and
//! fsyncs the directory before the next frame can be written to a new `active.seg`.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::thread::JoinHandle;

use anyhow::Context;

use super::layer;
use super::manifest::{self, LayerMeta, Manifest, SealIntent};
use super::segment::{ActiveSegment, ACTIVE_NAME};
use super::timeline::{failed_error, Pending, Shared};

/// Starts the committer thread of a timeline.
pub(super) fn spawn(
    shared: Arc<Shared>,
    dir_file: File,
    segment: ActiveSegment,
    next_file_id: u32,
    manifest: Manifest,
) -> anyhow::Result<JoinHandle<()>> {
    let committer = Committer { shared, dir_file, segment, next_file_id, manifest, buf: Vec::new() };
    std::thread::Builder::new()
        .name("storage-commit".to_string())
        .spawn(move || committer.run())
        .context("spawn committer thread")
}

struct Committer {
    shared: Arc<Shared>,
    dir_file: File,
    segment: ActiveSegment,
    next_file_id: u32,
    /// The manifest as last written.
    manifest: Manifest,
    /// Reused frame encoding buffer.
    buf: Vec<u8>,
}

/// Marks the committer as stopped however its thread ends (including a panic).
struct StoppedGuard(Arc<Shared>);

impl Drop for StoppedGuard {
    fn drop(&mut self) {
        let mut q = self.0.queue();
        if q.failed.is_none() && std::thread::panicking() {
            q.failed = Some("committer thread panicked".to_string());
        }
        let reason = q.failed.clone().unwrap_or_else(|| "timeline shut down".to_string());
        for p in q.pending.drain(..) {
            let _ = p.done.send(Err(failed_error(&reason)));
        }
        q.stopping = true;
        drop(q);
        self.0.budget.close();
        self.0.stopped.cancel();
    }
}

impl Committer {
    fn run(mut self) {
        let _guard = StoppedGuard(self.shared.clone());
        let _span = self.shared.span.clone().entered();
        while let Some((group, fail_fsync)) = self.next_group() {
            if let Err(e) = self.commit_round(group, fail_fsync) {
                let reason = format!("{e:#}");
                tracing::error!("failed to commit, refusing further ingests: {reason}");
                self.shared.queue().failed = Some(reason);
                break;
            }
        }
    }

    /// Waits for queued batches and takes them all (with the test hook `fail_next_fsync`);
    /// `None` once stopping with nothing queued.
    fn next_group(&self) -> Option<(Vec<Pending>, bool)> {
        let mut q = self.shared.queue();
        loop {
            if !q.pending.is_empty() && (!q.hold || q.stopping) {
                let fail_fsync = std::mem::take(&mut q.fail_next_fsync);
                return Some((std::mem::take(&mut q.pending), fail_fsync));
            }
            if q.stopping {
                return None;
            }
            q = self.shared.queue_cv.wait(q).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Makes `group` durable and acknowledges it, then seals if the segment is full. On error,
    /// every batch of the group gets the error.
    fn commit_round(&mut self, group: Vec<Pending>, fail_fsync: bool) -> anyhow::Result<()> {
        match self.write_group(&group, fail_fsync) {
            Ok(()) => {
                for p in group {
                    let _ = p.done.send(Ok(p.last_lsn));
                }
            }
            Err(e) => {
                for p in group {
                    let _ = p.done.send(Err(failed_error(&format!("{e:#}"))));
                }
                return Err(e);
            }
        }
        if self.segment.len >= self.shared.conf.layer_size {
            self.seal().context("seal active segment")?;
        }
        Ok(())
    }

    /// Writes and fsyncs `group`, then publishes it. If the write or the fsync fails, the
    /// segment is cut back to where the group started (and synced), so that nothing of a group
    /// answered with an error survives, not even the frames written before the failure.
    fn write_group(&mut self, group: &[Pending], fail_fsync: bool) -> anyhow::Result<()> {
        let start = self.segment.len;
        let first_entry = self.segment.entries.len();
        if let Err(e) = self.append_and_sync(group, fail_fsync) {
            return Err(match self.roll_back(start, first_entry) {
                Ok(()) => e,
                Err(cut) => e.context(format!(
                    "and cutting the failed group off failed too ({cut:#}): it may survive a restart"
                )),
            });
        }
        let m = &self.shared.metrics;
        let bytes: u64 = group.iter().flat_map(|p| &p.values).map(|(_, _, v)| v.bytes().len() as u64).sum();
        m.group_commit_batches.observe(group.len() as f64);
        m.ingested_batches.inc_by(group.len() as u64);
        m.ingested_values.inc_by((self.segment.entries.len() - first_entry) as u64);
        m.ingested_bytes.inc_by(bytes);

        self.shared
            .index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(self.segment.file_id, &self.segment.entries[first_entry..])
            .context("index committed values")?;
        self.shared.active_len.store(self.segment.len, Ordering::Relaxed);
        if let Some(last) = group.last() {
            self.shared.durable.send_replace(last.last_lsn);
        }
        Ok(())
    }

    fn append_and_sync(&mut self, group: &[Pending], fail_fsync: bool) -> anyhow::Result<()> {
        for p in group {
            self.segment.append(&p.values, &mut self.buf)?;
        }
        self.shared
            .metrics
            .fsync(|| match fail_fsync {
                true => Err(std::io::Error::other("injected fsync failure")),
                false => self.segment.file.sync_data(),
            })
            .context("fdatasync active segment")
    }

    /// Cuts the active segment back to `len` bytes and `entries` entries and makes the cut
    /// durable: what a failed group wrote (whole frames or part of one) is gone from the file.
    fn roll_back(&mut self, len: u64, entries: usize) -> anyhow::Result<()> {
        self.segment.entries.truncate(entries);
        self.segment.len = len;
        let file = &self.segment.file;
        file.set_len(len).context("truncate active segment")?;
        self.shared.metrics.fsync(|| file.sync_data()).context("fdatasync truncated active segment")
    }

    /// Turns the active segment into a layer in place and starts a new active segment.
    /// Steps (see docs/storage-format.md for what recovery does after a crash at each):
    /// 0. record the seal intent in the manifest, 1. append index block and footer,
    /// 2. fdatasync, 3. rename `active.seg` to the layer name, 4. fsync the directory,
    /// 5. create a new `active.seg` (header, fsync, fsync directory), 6. record the layer and
    /// the new active segment in the manifest. Nothing is appended to the new `active.seg`
    /// before step 6.
    fn seal(&mut self) -> anyhow::Result<()> {
        let (first, last) = self.segment.lsn_range().context("seal an empty segment")?;
        let m = self.shared.metrics.clone();
        let dir = &self.shared.dir;
        let data_len = self.segment.len;
        let size = data_len + layer::index_and_footer_len(self.segment.entries.len());
        let intent = SealIntent { layer: LayerMeta::new(first, last, size), data_len };
        let mut with_intent = self.manifest.clone();
        with_intent.sealing = Some(intent.clone());
        manifest::write(dir, &self.dir_file, &mut with_intent, &m).context("record seal intent")?;
        self.manifest = with_intent;

        let file = &self.segment.file;
        let len = layer::append_index_and_footer(file, data_len, &self.segment.entries)?;
        anyhow::ensure!(len == size, "sealed layer has {len} bytes, expected {size}");
        m.fsync(|| file.sync_data()).context("fdatasync sealed layer")?;
        let name = &intent.layer.name;
        std::fs::rename(dir.join(ACTIVE_NAME), dir.join(name)).context("rename sealed layer")?;
        m.fsync(|| self.dir_file.sync_all()).context("fsync timeline directory")?;

        let id = self.next_file_id;
        self.next_file_id += 1;
        let segment = ActiveSegment::create(dir, &self.dir_file, id, &m)?;
        let mut done = self.manifest.with_seal_done(&intent);
        manifest::write(dir, &self.dir_file, &mut done, &m).context("record sealed layer")?;
        self.manifest = done;

        self.shared.layers.fetch_add(1, Ordering::Relaxed);
        self.shared.sealed_bytes.fetch_add(len, Ordering::Relaxed);
        m.layer_files.inc();
        tracing::info!(layer = %name, values = self.segment.entries.len(), bytes = len, "sealed layer");
        self.shared.index.write().unwrap_or_else(PoisonError::into_inner).add_file(id, segment.file.clone());
        self.shared.active_len.store(segment.len, Ordering::Relaxed);
        self.segment = segment;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use crate::storage::test_support::*;
    use crate::storage::{GetError, IngestError, Lsn, Timeline};

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
            tl.get_reconstruct_data(key(i), Lsn(64)).unwrap();
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
        let d = tl.get_reconstruct_data(key(1), Lsn(42)).unwrap();
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
        assert!(matches!(err, IngestError::Io(_)), "{err}");
        assert!(format!("{err}").contains("refuses ingests"), "{err}");
        // Nothing of the failed batch is visible; earlier data still is.
        assert_eq!(tl.last_durable_lsn(), Lsn(1));
        assert_eq!(tl.get_reconstruct_data(key(1), Lsn(2)).unwrap().records.len(), 1);
        tl.shutdown().await;
        drop(tl);

        // Reopening recovers: the failed batch was never acknowledged, either outcome is fine,
        // but the timeline accepts ingests again.
        let tl = open(dir.path(), 1 << 30, &m);
        let next = tl.last_durable_lsn().0 + 1;
        tl.ingest(batch(vec![(key(1), next, record("d"))])).await.unwrap();
    }

    /// Whether the value ingested at `lsn` for `k` is served after a reopen.
    fn stored_at(tl: &Timeline, k: u32, lsn: u64) -> bool {
        match tl.get_reconstruct_data(key(k), Lsn(lsn)) {
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
                let d = tl.get_reconstruct_data(key(1), Lsn(i * 10 + 5)).unwrap();
                assert_eq!(d.image, Some((Lsn(i * 10), bytes_of(&image(i as u8)))));
                let d = tl.get_reconstruct_data(key(2), Lsn(i * 10)).unwrap();
                assert_eq!(d.records.len(), i as usize);
                assert_eq!(d.records[i as usize - 1], (Lsn(i * 10), bytes_of(&record(&format!("r{i}")))));
            }
            assert!(matches!(tl.get_reconstruct_data(key(1), Lsn(9)), Err(GetError::NotFound { .. })));
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
