//! Open-time recovery of a timeline directory: brings whatever a crash left (at any point of an
//! append or a seal) back to "layers + one active segment" and builds the in-memory index.
//!
//! Procedure (the normative text is in `docs/storage-format.md`):
//! 1. list the directory: `layer_*.layer`, `active.seg`, `lock`; anything else is logged and
//!    left alone;
//! 2. if `active.seg` is a complete layer (valid footer and index at its end), a seal was
//!    interrupted after its index was written: fsync it, rename it to its layer name, fsync the
//!    directory;
//! 3. open every layer (footer and index only), in LSN order; ranges must not overlap;
//! 4. scan `active.seg` frame by frame; the first incomplete or checksum-failing frame starts a
//!    torn tail, which is cut (truncate + fsync) and counted; a missing `active.seg`, or one
//!    holding only part of its header, is created anew.
//!
//! **Invariants:** recovery only deletes bytes that were never acknowledged (a tail past the
//! last valid frame, or an interrupted seal's partial index); a checksummed frame or layer that
//! makes no sense is an error, not a tail to cut, because cutting it could lose acknowledged
//! data.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context};

use super::format::{self, FILE_HEADER_LEN};
use super::index::Index;
use super::segment::{self, read_at, ActiveSegment, ACTIVE_NAME};
use super::timeline::LOCK_NAME;
use super::{layer, Lsn, StorageMetrics};

/// What recovery hands to the timeline.
pub(crate) struct Recovered {
    pub index: Index,
    pub segment: ActiveSegment,
    pub next_file_id: u32,
    pub last_lsn: Lsn,
    pub layers: u64,
    pub sealed_bytes: u64,
}

/// Recovers the timeline directory `dir` (already created and locked).
pub(crate) fn recover(dir: &Path, dir_file: &File, metrics: &StorageMetrics) -> anyhow::Result<Recovered> {
    let mut layer_paths = Vec::new();
    let mut active = None;
    for entry in std::fs::read_dir(dir).context("list timeline directory")? {
        let entry = entry.context("list timeline directory")?;
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == ACTIVE_NAME {
            active = Some(path);
        } else if let Some((first, last)) = layer::parse_file_name(&name) {
            layer_paths.push((first, last, path));
        } else if name != LOCK_NAME {
            tracing::warn!(file = %name, "ignoring unknown file in timeline directory");
        }
    }

    if let Some(path) = &active {
        if let Some(name) = finish_interrupted_seal(dir, path, dir_file, metrics)? {
            let (first, last) = layer::parse_file_name(&name).context("parse layer name")?;
            layer_paths.push((first, last, dir.join(name)));
            active = None;
        }
    }

    let mut index = Index::default();
    let mut next_file_id = 0u32;
    let mut last_lsn = Lsn(0);
    let mut sealed_bytes = 0;
    layer_paths.sort_by_key(|(first, _, _)| *first);
    for (first, _, path) in &layer_paths {
        ensure!(
            *first > last_lsn || next_file_id == 0,
            "layer {} overlaps an earlier layer ending at {last_lsn}",
            path.display()
        );
        let l = layer::open(path).with_context(|| format!("open layer {}", path.display()))?;
        index.add_file(next_file_id, Arc::new(l.file));
        index.insert(next_file_id, &l.entries).with_context(|| format!("index layer {}", path.display()))?;
        next_file_id += 1;
        last_lsn = l.footer.last_lsn;
        sealed_bytes += l.len;
    }

    let segment = match active {
        Some(path) => open_active(&path, dir, dir_file, next_file_id, last_lsn, metrics)?,
        None => ActiveSegment::create(dir, dir_file, next_file_id, metrics)?,
    };
    index.add_file(next_file_id, segment.file.clone());
    index.insert(next_file_id, &segment.entries).context("index active segment")?;
    if let Some((_, last)) = segment.lsn_range() {
        last_lsn = last;
    }
    Ok(Recovered {
        index,
        segment,
        next_file_id: next_file_id + 1,
        last_lsn,
        layers: layer_paths.len() as u64,
        sealed_bytes,
    })
}

/// If `active.seg` at `path` already is a complete layer, finishes its seal (fsync, rename,
/// fsync directory) and returns the layer's file name.
fn finish_interrupted_seal(
    dir: &Path,
    path: &Path,
    dir_file: &File,
    metrics: &StorageMetrics,
) -> anyhow::Result<Option<String>> {
    let file = OpenOptions::new().read(true).write(true).open(path).context("open active.seg")?;
    let len = file.metadata().context("stat active.seg")?.len();
    let mut header = [0u8; FILE_HEADER_LEN as usize];
    if len < FILE_HEADER_LEN || read_at(&file, &mut header, 0).is_err() {
        return Ok(None);
    }
    let Ok(footer) = layer::read_footer(&file, len) else {
        return Ok(None);
    };
    if format::check_file_header(&header).is_err() || layer::read_index(&file, &footer).is_err() {
        return Ok(None);
    }
    let name = layer::file_name(footer.first_lsn, footer.last_lsn);
    let target: PathBuf = dir.join(&name);
    ensure!(!target.exists(), "interrupted seal of {name}, but that layer already exists");
    metrics.fsync(|| file.sync_all()).context("fsync interrupted layer")?;
    std::fs::rename(path, &target).context("rename interrupted layer")?;
    metrics.fsync(|| dir_file.sync_all()).context("fsync timeline directory")?;
    tracing::info!(layer = %name, "finished a seal interrupted by a crash");
    Ok(Some(name))
}

/// Opens and scans an existing `active.seg`, cutting a torn tail.
fn open_active(
    path: &Path,
    dir: &Path,
    dir_file: &File,
    file_id: u32,
    last_lsn: Lsn,
    metrics: &StorageMetrics,
) -> anyhow::Result<ActiveSegment> {
    let file = OpenOptions::new().read(true).write(true).open(path).context("open active.seg")?;
    let len = file.metadata().context("stat active.seg")?.len();
    let mut header = [0u8; FILE_HEADER_LEN as usize];
    let header_ok = len >= FILE_HEADER_LEN
        && read_at(&file, &mut header, 0).is_ok()
        && format::check_file_header(&header).is_ok();
    if !header_ok {
        if len > FILE_HEADER_LEN {
            bail!("active.seg has a bad header and {len} bytes: not a torn creation");
        }
        tracing::warn!(len, "recreating active.seg with a torn header");
        drop(file);
        return ActiveSegment::create(dir, dir_file, file_id, metrics);
    }
    let scan = segment::scan(&file, len, last_lsn).context("scan active.seg")?;
    if let Some(why) = &scan.torn {
        let cut = len - scan.valid_len;
        tracing::warn!(
            valid_len = scan.valid_len, cut_bytes = cut, reason = %why,
            "cutting torn tail of active.seg"
        );
        file.set_len(scan.valid_len).context("truncate torn tail")?;
        metrics.fsync(|| file.sync_all()).context("fsync truncated active.seg")?;
        metrics.torn_tail_truncations.inc();
    }
    Ok(ActiveSegment { file: Arc::new(file), file_id, len: scan.valid_len, entries: scan.entries })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::time::Duration;

    use super::*;
    use crate::storage::test_support::*;
    use crate::storage::{GetError, Key, Timeline, Value};

    const BIG: u64 = 1 << 30;

    fn active_path(dir: &Path) -> PathBuf {
        dir.join(ACTIVE_NAME)
    }

    fn layer_count(dir: &Path) -> usize {
        std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| layer::parse_file_name(&e.as_ref().unwrap().file_name().to_string_lossy()).is_some())
            .count()
    }

    /// Ingests batches at lsn 10, 20, 30 (one record each for key 1, "r10".."r30"), then shuts
    /// down and drops the timeline.
    /// After recovery of `three_batches`: a new batch is accepted and survives another reopen.
    async fn ingest_survives_reopen(tl: Arc<Timeline>, dir: &Path, m: &Arc<StorageMetrics>) {
        tl.ingest(batch(vec![(key(1), 40, record("r40"))])).await.unwrap();
        drop(tl);
        let tl = open(dir, BIG, m);
        assert_eq!(records_of(&tl, 40), [10, 20, 30, 40]);
    }

    async fn three_batches(dir: &Path, m: &Arc<StorageMetrics>) {
        let tl = open(dir, BIG, m);
        for lsn in [10u64, 20, 30] {
            tl.ingest(batch(vec![(key(1), lsn, record(&format!("r{lsn}")))])).await.unwrap();
        }
        tl.shutdown().await;
    }

    fn records_of(tl: &Timeline, lsn: u64) -> Vec<u64> {
        match tl.get_reconstruct_data(key(1), Lsn(lsn)) {
            Ok(d) => d.records.iter().map(|r| r.0 .0).collect(),
            Err(GetError::NotFound { .. }) => vec![],
            Err(e) => panic!("{e}"),
        }
    }

    #[tokio::test]
    async fn torn_tail_of_active_segment_is_cut_and_later_ingests_survive_reopen() {
        for damage in ["truncate", "flip", "garbage"] {
            let dir = tempfile::tempdir().unwrap();
            let m = metrics();
            three_batches(dir.path(), &m).await;
            let f = OpenOptions::new().write(true).open(active_path(dir.path())).unwrap();
            let len = f.metadata().unwrap().len();
            match damage {
                "truncate" => f.set_len(len - 3).unwrap(),
                "flip" => f.write_all_at(b"X", len - 2).unwrap(),
                _ => f.write_all_at(&[0x42; 100], len).unwrap(),
            }

            let tl = open(dir.path(), BIG, &m);
            assert_eq!(m.torn_tail_truncations.get(), 1, "{damage}");
            let want: &[u64] = if damage == "garbage" { &[10, 20, 30] } else { &[10, 20] };
            assert_eq!(records_of(&tl, 100), want, "{damage}");
            let last = *want.last().unwrap();
            assert_eq!(tl.last_durable_lsn(), Lsn(last));
            tl.ingest(batch(vec![(key(1), last + 1, record("after"))])).await.unwrap();
            drop(tl);

            let m2 = metrics();
            let tl = open(dir.path(), BIG, &m2);
            assert_eq!(m2.torn_tail_truncations.get(), 0, "{damage}");
            let mut want = want.to_vec();
            want.push(last + 1);
            assert_eq!(records_of(&tl, 100), want, "{damage}");
            let d = tl.get_reconstruct_data(key(1), Lsn(last + 1)).unwrap();
            assert_eq!(d.records.last().unwrap().1, bytes_of(&record("after")));
        }
    }

    #[tokio::test]
    async fn crash_during_concurrent_ingest_keeps_every_batch_acknowledged_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        let tl = open(dir.path(), BIG, &m);
        let writer = tokio::spawn({
            let tl = tl.clone();
            async move {
                let mut next = 1u64;
                loop {
                    let futs = (0..8)
                        .map(|i| {
                            tl.ingest(batch(vec![(key(1), next + i, record(&format!("v{}", next + i)))]))
                        })
                        .collect();
                    for r in join_in_order(futs).await {
                        if r.is_err() {
                            return;
                        }
                    }
                    next += 8;
                }
            }
        });
        // Crash (copy what is on disk) at several points while ingests are in flight.
        for round in 1..=5u64 {
            tl.wait_lsn(Lsn(round * 40), Duration::from_secs(30)).await.unwrap();
            let acked = tl.last_durable_lsn();
            let crashed = snapshot(dir.path());
            let recovered = open(crashed.path(), BIG, &metrics());
            assert!(recovered.last_durable_lsn() >= acked);
            let d = recovered.get_reconstruct_data(key(1), acked).unwrap();
            assert_eq!(d.records.len() as u64, acked.0);
            assert!(d
                .records
                .iter()
                .enumerate()
                .all(|(i, r)| r.0 == Lsn(i as u64 + 1) && r.1 == bytes_of(&record(&format!("v{}", i + 1)))));
        }
        tl.shutdown().await;
        writer.await.unwrap();
    }

    /// Leaves `dir` as a crash after seal step 1 or 2 would: `active.seg` with its index and
    /// footer appended (all of it, or only its first `keep` bytes), not renamed.
    fn append_seal_index(dir: &Path, keep: Option<u64>) {
        let file = OpenOptions::new().read(true).write(true).open(active_path(dir)).unwrap();
        let len = file.metadata().unwrap().len();
        let scan = segment::scan(&file, len, Lsn(0)).unwrap();
        let end = layer::append_index_and_footer(&file, len, &scan.entries).unwrap();
        if let Some(keep) = keep {
            assert!(keep < end - len);
            file.set_len(len + keep).unwrap();
        }
    }

    #[tokio::test]
    async fn crash_after_seal_wrote_index_but_before_rename_finishes_the_seal() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        three_batches(dir.path(), &m).await;
        append_seal_index(dir.path(), None);

        let tl = open(dir.path(), BIG, &m);
        assert_eq!(layer_count(dir.path()), 1);
        assert!(dir.path().join(layer::file_name(Lsn(10), Lsn(30))).exists());
        assert_eq!(tl.stats().layers, 1);
        assert_eq!(m.torn_tail_truncations.get(), 0);
        assert_eq!(records_of(&tl, 30), [10, 20, 30]);
        ingest_survives_reopen(tl, dir.path(), &m).await;
    }

    #[tokio::test]
    async fn crash_while_seal_wrote_a_partial_index_cuts_it_and_keeps_the_segment() {
        for keep in [1u64, 4, 50] {
            let dir = tempfile::tempdir().unwrap();
            let m = metrics();
            three_batches(dir.path(), &m).await;
            append_seal_index(dir.path(), Some(keep));
            let tl = open(dir.path(), BIG, &m);
            assert_eq!((layer_count(dir.path()), m.torn_tail_truncations.get()), (0, 1), "{keep}");
            assert_eq!(records_of(&tl, 30), [10, 20, 30]);
            ingest_survives_reopen(tl, dir.path(), &m).await;
        }
    }

    #[tokio::test]
    async fn crash_after_rename_before_new_active_segment_recreates_it() {
        for leftover in [None, Some(0u64), Some(7)] {
            let dir = tempfile::tempdir().unwrap();
            let m = metrics();
            let tl = open(dir.path(), 8_000, &m);
            tl.ingest(batch(vec![(key(1), 10, image(1))])).await.unwrap();
            tl.ingest(batch(vec![(key(1), 20, image(2))])).await.unwrap();
            tl.shutdown().await;
            drop(tl);
            assert_eq!(layer_count(dir.path()), 2);
            match leftover {
                None => std::fs::remove_file(active_path(dir.path())).unwrap(),
                Some(n) => {
                    File::options().write(true).open(active_path(dir.path())).unwrap().set_len(n).unwrap()
                }
            }
            let tl = open(dir.path(), 8_000, &m);
            assert_eq!(tl.stats().layers, 2);
            assert_eq!(tl.last_durable_lsn(), Lsn(20));
            let d = tl.get_reconstruct_data(key(1), Lsn(15)).unwrap();
            assert_eq!(d.image, Some((Lsn(10), bytes_of(&image(1)))));
            tl.ingest(batch(vec![(key(1), 30, record("r30"))])).await.unwrap();
            drop(tl);
            let tl = open(dir.path(), 8_000, &m);
            let d = tl.get_reconstruct_data(key(1), Lsn(30)).unwrap();
            assert_eq!(d.image.unwrap().0, Lsn(20));
            assert_eq!(d.records, vec![(Lsn(30), bytes_of(&record("r30")))]);
        }
    }

    #[tokio::test]
    async fn corrupt_layer_index_makes_open_fail_instead_of_dropping_data() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        three_batches(dir.path(), &m).await;
        append_seal_index(dir.path(), None);
        drop(open(dir.path(), BIG, &m));
        let path = dir.path().join(layer::file_name(Lsn(10), Lsn(30)));
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        let len = f.metadata().unwrap().len();
        f.write_all_at(&[0xAA], len - layer::FOOTER_LEN - 3).unwrap();
        let err = Timeline::open(dir.path(), Default::default(), m.clone()).err().unwrap();
        assert!(format!("{err:#}").contains("index checksum mismatch"), "{err:#}");
    }

    #[tokio::test]
    async fn active_segment_with_bad_header_and_data_makes_open_fail() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        three_batches(dir.path(), &m).await;
        let f = OpenOptions::new().write(true).open(active_path(dir.path())).unwrap();
        f.write_all_at(b"NOTOURS!", 0).unwrap();
        let err = Timeline::open(dir.path(), Default::default(), m.clone()).err().unwrap();
        assert!(format!("{err:#}").contains("bad header"), "{err:#}");
    }

    #[tokio::test]
    async fn unknown_files_in_the_directory_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        three_batches(dir.path(), &m).await;
        std::fs::write(dir.path().join("notes.txt"), b"hello").unwrap();
        let tl = open(dir.path(), BIG, &m);
        assert_eq!(records_of(&tl, 30), [10, 20, 30]);
        assert_eq!(std::fs::read(dir.path().join("notes.txt")).unwrap(), b"hello");
    }

    const KILL9_DIR_ENV: &str = "PAGESERVER_STORAGE_KILL9_CHILD_DIR";
    const KILL9_LAYER_SIZE: u64 = 64 << 10;

    /// The value the kill -9 child ingests at `lsn` (one per batch): an image every 10th LSN.
    fn kill9_value(lsn: u64) -> (Key, Value) {
        let k = key((lsn % 50) as u32);
        if lsn % 10 == 0 {
            (k, image(lsn as u8))
        } else {
            (k, record(&format!("rec{lsn}")))
        }
    }

    /// Child role: ingests 16 batches at a time in LSN order and prints `ACK <lsn>` after each
    /// acknowledgement, until killed (or a safety cap).
    fn kill9_child(dir: &Path) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let tl = open(dir, KILL9_LAYER_SIZE, &metrics());
            let mut next = tl.last_durable_lsn().0 + 1;
            while next < 1_000_000 {
                let futs = (next..next + 16)
                    .map(|lsn| {
                        let (k, v) = kill9_value(lsn);
                        tl.ingest(batch(vec![(k, lsn, v)]))
                    })
                    .collect();
                for r in join_in_order(futs).await {
                    println!("ACK {}", r.unwrap().0);
                }
                next += 16;
            }
        });
    }

    /// Kills the child on drop, so a failing parent does not leak it.
    struct KillOnDrop(std::process::Child);

    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// Runs a real process that ingests (and seals every few batches) and SIGKILLs it at
    /// several points; every batch it acknowledged must be served after recovery, and
    /// recovery must leave a directory that the next run continues in.
    #[test]
    fn kill_9_during_ingest_and_seals_loses_no_acknowledged_batch() {
        if let Some(dir) = std::env::var_os(KILL9_DIR_ENV) {
            return kill9_child(Path::new(&dir));
        }
        use std::io::BufRead;
        let dir = tempfile::tempdir().unwrap();
        let mut max_acked = 0u64;
        for kill_after in [50u64, 333, 1000, 2017] {
            let child = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "storage::recovery::tests::kill_9_during_ingest_and_seals_loses_no_acknowledged_batch",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(KILL9_DIR_ENV, dir.path())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            let mut child = KillOnDrop(child);
            let stdout = child.0.stdout.take().unwrap();
            let mut acks = 0;
            for line in std::io::BufReader::new(stdout).lines() {
                let Some(lsn) = line.unwrap().strip_prefix("ACK ").map(|l| l.parse::<u64>().unwrap()) else {
                    continue;
                };
                assert!(lsn > max_acked, "child acknowledged {lsn} after {max_acked}");
                max_acked = lsn;
                acks += 1;
                if acks == kill_after {
                    break;
                }
            }
            assert_eq!(acks, kill_after, "child ended early");
            drop(child); // SIGKILL, then reap

            let tl = open(dir.path(), KILL9_LAYER_SIZE, &metrics());
            assert!(tl.last_durable_lsn() >= Lsn(max_acked));
            for lsn in 1..=max_acked {
                let (k, v) = kill9_value(lsn);
                let d = tl.get_reconstruct_data(k, Lsn(lsn)).unwrap();
                let newest = d.records.last().or(d.image.as_ref()).unwrap();
                assert_eq!(newest, &(Lsn(lsn), bytes_of(&v)), "lsn {lsn}");
            }
        }
        assert!(layer_count(dir.path()) > 10);
    }
}
