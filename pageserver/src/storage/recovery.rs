//! Open-time recovery of a timeline directory: brings whatever a crash left (at any point of an
//! append or a seal) back to "the layers of the manifest + one active segment", checks the
//! directory against the manifest, and builds the in-memory index.
//!
//! Procedure (the normative text is in `docs/storage-format.md`):
//! 1. list the directory: `layer_*.layer`, `active.seg`, `manifest.json`, `lock`; a leftover
//!    temporary manifest is removed; anything else is logged and left alone;
//! 2. with a manifest that records a seal in progress, finish it (the layer was renamed into
//!    place: record it, new `active.seg`) or undo it (it was not: cut `active.seg` back to the
//!    frames the seal started from), and write the manifest;
//! 3. a layer listed but missing, a layer file not listed, or a missing `active.seg` is an
//!    error naming the file;
//! 4. open every layer (footer and index only), in LSN order; ranges must not overlap;
//! 5. scan `active.seg` frame by frame; the first incomplete or checksum-failing frame starts a
//!    torn tail, which is cut (truncate + fsync) and counted.
//!
//! A directory without a manifest (format version 1) is recovered as version 1 did (an
//! `active.seg` that is a complete layer is an interrupted seal; a missing one is created) and
//! then gets a manifest describing what it holds.
//!
//! **Invariants:** recovery only deletes bytes that were never acknowledged (a tail past the
//! last valid frame, or an interrupted seal's index); a checksummed frame or layer that makes
//! no sense is an error, not a tail to cut, because cutting it could lose acknowledged data;
//! with a manifest, whether a seal was in progress is read from the manifest, never guessed
//! from the bytes at the end of `active.seg` (those can be a client's value bytes).

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context};

use super::format::{self, FILE_HEADER_LEN};
use super::index::Index;
use super::manifest::{self, LayerMeta, Manifest, MANIFEST_NAME, MANIFEST_TMP_NAME};
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
    pub manifest: Manifest,
}

/// The timeline files found in a directory.
struct Listing {
    layers: Vec<String>,
    active: bool,
}

/// Recovers the timeline directory `dir` (already created and locked).
pub(crate) fn recover(dir: &Path, dir_file: &File, metrics: &StorageMetrics) -> anyhow::Result<Recovered> {
    let mut listing = list(dir)?;
    match manifest::read(dir)? {
        Some(mut m) => {
            resolve_seal(dir, dir_file, &mut m, &mut listing, metrics)?;
            check_files(&m, &listing)?;
            let opened = open_layers(dir, &m.layers)?;
            let floor = opened.last_lsn.max(Lsn(m.active.base_lsn));
            let segment = open_active(dir, dir_file, opened.next_file_id, floor, metrics)?;
            opened.finish(segment, floor, m)
        }
        None => recover_v1(dir, dir_file, listing, metrics),
    }
}

fn list(dir: &Path) -> anyhow::Result<Listing> {
    let mut listing = Listing { layers: Vec::new(), active: false };
    for entry in std::fs::read_dir(dir).context("list timeline directory")? {
        let entry = entry.context("list timeline directory")?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == ACTIVE_NAME {
            listing.active = true;
        } else if layer::parse_file_name(&name).is_some() {
            listing.layers.push(name.into_owned());
        } else if name == MANIFEST_TMP_NAME {
            tracing::info!(file = %name, "removing a manifest that was never put in place");
            std::fs::remove_file(entry.path()).context("remove temporary manifest")?;
        } else if name != LOCK_NAME && name != MANIFEST_NAME {
            tracing::warn!(file = %name, "ignoring unknown file in timeline directory");
        }
    }
    Ok(listing)
}

/// Finishes or undoes the seal the manifest records as in progress, if any.
fn resolve_seal(
    dir: &Path,
    dir_file: &File,
    m: &mut Manifest,
    listing: &mut Listing,
    metrics: &StorageMetrics,
) -> anyhow::Result<()> {
    let Some(intent) = m.sealing.clone() else {
        return Ok(());
    };
    let name = &intent.layer.name;
    if listing.layers.contains(name) {
        // Renamed: the seal is done but for the new active segment and the manifest. Nothing is
        // appended to a new active.seg before the manifest records the seal, so one that exists
        // holds no data and is replaced.
        ActiveSegment::create(dir, dir_file, 0, metrics)?;
        listing.active = true;
        let mut done = m.with_seal_done(&intent);
        manifest::write(dir, dir_file, &mut done, metrics).context("record the finished seal")?;
        *m = done;
        tracing::info!(layer = %name, "finished a seal interrupted by a crash");
        return Ok(());
    }
    ensure!(listing.active, "{ACTIVE_NAME} is missing while the manifest records the seal of {name}");
    let file = OpenOptions::new().write(true).open(dir.join(ACTIVE_NAME)).context("open active.seg")?;
    let len = file.metadata().context("stat active.seg")?.len();
    ensure!(
        len >= intent.data_len,
        "{ACTIVE_NAME} has {len} bytes, fewer than the {} its seal to {name} started from",
        intent.data_len
    );
    if len > intent.data_len {
        file.set_len(intent.data_len).context("cut the index of an interrupted seal")?;
        metrics.fsync(|| file.sync_all()).context("fsync active.seg")?;
    }
    m.sealing = None;
    manifest::write(dir, dir_file, m, metrics).context("record the undone seal")?;
    tracing::info!(layer = %name, "undid a seal interrupted by a crash; it will be sealed again");
    Ok(())
}

/// Checks that the directory holds exactly the files the manifest lists.
fn check_files(m: &Manifest, listing: &Listing) -> anyhow::Result<()> {
    for l in &m.layers {
        ensure!(
            listing.layers.contains(&l.name),
            "layer file {} listed in {MANIFEST_NAME} is missing",
            l.name
        );
    }
    for name in &listing.layers {
        ensure!(
            m.layers.iter().any(|l| &l.name == name),
            "unexpected layer file {name}: it is not listed in {MANIFEST_NAME}"
        );
    }
    ensure!(
        listing.active,
        "{ACTIVE_NAME} is missing (the manifest lists active segment #{} above LSN {})",
        m.active.seq,
        Lsn(m.active.base_lsn)
    );
    Ok(())
}

/// Layers opened into a fresh index.
struct OpenedLayers {
    index: Index,
    next_file_id: u32,
    last_lsn: Lsn,
    sealed_bytes: u64,
    metas: Vec<LayerMeta>,
}

/// Opens the layers `metas` (in LSN order), checking each file's size against its entry.
fn open_layers(dir: &Path, metas: &[LayerMeta]) -> anyhow::Result<OpenedLayers> {
    let mut o = OpenedLayers {
        index: Index::default(),
        next_file_id: 0,
        last_lsn: Lsn(0),
        sealed_bytes: 0,
        metas: Vec::new(),
    };
    for meta in metas {
        let path = dir.join(&meta.name);
        ensure!(
            Lsn(meta.first_lsn) > o.last_lsn || o.next_file_id == 0,
            "layer {} overlaps an earlier layer ending at {}",
            meta.name,
            o.last_lsn
        );
        let len = std::fs::metadata(&path).with_context(|| format!("stat layer {}", path.display()))?.len();
        ensure!(
            len == meta.size,
            "layer file {} has {len} bytes, {MANIFEST_NAME} says {}",
            meta.name,
            meta.size
        );
        let l = layer::open(&path).with_context(|| format!("open layer {}", path.display()))?;
        let id = o.next_file_id;
        o.index.add_file(id, Arc::new(l.file));
        o.index.insert(id, &l.entries).with_context(|| format!("index layer {}", path.display()))?;
        o.next_file_id += 1;
        o.last_lsn = l.footer.last_lsn;
        o.sealed_bytes += l.len;
        o.metas.push(meta.clone());
    }
    Ok(o)
}

impl OpenedLayers {
    fn finish(mut self, segment: ActiveSegment, floor: Lsn, manifest: Manifest) -> anyhow::Result<Recovered> {
        self.index.add_file(self.next_file_id, segment.file.clone());
        self.index.insert(self.next_file_id, &segment.entries).context("index active segment")?;
        let last_lsn = segment.lsn_range().map_or(floor, |(_, last)| last);
        Ok(Recovered {
            index: self.index,
            segment,
            next_file_id: self.next_file_id + 1,
            last_lsn,
            layers: self.metas.len() as u64,
            sealed_bytes: self.sealed_bytes,
            manifest,
        })
    }
}

/// Recovers a directory without a manifest (format version 1, or a new timeline) and writes
/// its first manifest.
fn recover_v1(
    dir: &Path,
    dir_file: &File,
    mut listing: Listing,
    metrics: &StorageMetrics,
) -> anyhow::Result<Recovered> {
    if listing.active {
        if let Some(name) = finish_interrupted_seal(dir, &dir.join(ACTIVE_NAME), dir_file, metrics)? {
            listing.layers.push(name);
            listing.active = false;
        }
    }
    let mut metas = Vec::new();
    for name in &listing.layers {
        let (first, last) = layer::parse_file_name(name).context("parse layer name")?;
        let size = std::fs::metadata(dir.join(name)).with_context(|| format!("stat {name}"))?.len();
        metas.push(LayerMeta::new(first, last, size));
    }
    metas.sort_by_key(|l| l.first_lsn);
    let opened = open_layers(dir, &metas)?;
    let segment = match listing.active {
        true => open_active(dir, dir_file, opened.next_file_id, opened.last_lsn, metrics)?,
        false => ActiveSegment::create(dir, dir_file, opened.next_file_id, metrics)?,
    };
    let mut m = Manifest::empty();
    m.layers = metas;
    m.active.base_lsn = opened.last_lsn.0;
    let first_open = m.layers.is_empty() && segment.entries.is_empty();
    manifest::write(dir, dir_file, &mut m, metrics).context("write the first manifest")?;
    if !first_open {
        tracing::info!(layers = m.layers.len(), "wrote a manifest for a version 1 timeline directory");
    }
    let floor = opened.last_lsn;
    opened.finish(segment, floor, m)
}

/// If `active.seg` at `path` already is a complete layer, finishes its seal (fsync, rename,
/// fsync directory) and returns the layer's file name. Version 1 directories only.
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

/// Opens and scans the existing `active.seg` of `dir`, cutting a torn tail; every value in it
/// must be above `last_lsn`.
fn open_active(
    dir: &Path,
    dir_file: &File,
    file_id: u32,
    last_lsn: Lsn,
    metrics: &StorageMetrics,
) -> anyhow::Result<ActiveSegment> {
    let path = dir.join(ACTIVE_NAME);
    let file = OpenOptions::new().read(true).write(true).open(&path).context("open active.seg")?;
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
    use crate::storage::manifest::{ActiveMeta, SealIntent};
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
    async fn ingest_survives_reopen(tl: Arc<Timeline>, dir: &Path, m: &Arc<StorageMetrics>, layer_size: u64) {
        let next = tl.last_durable_lsn().0 + 10;
        tl.ingest(batch(vec![(key(1), next, record("r"))])).await.unwrap();
        drop(tl);
        let tl = open(dir, layer_size, m);
        let want: Vec<u64> = (1..=next / 10).map(|i| i * 10).collect();
        assert_eq!(records_of(&tl, next), want);
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

    /// Leaves `dir` as a crash after seal step 1 or 2 would: the seal intent in the manifest
    /// (unless `v1`: then the manifest is removed, as in a version 1 directory), and `active.seg`
    /// with its index and footer appended (all of it, or only its first `keep` bytes).
    fn append_seal_index(dir: &Path, keep: Option<u64>, v1: bool) {
        let file = OpenOptions::new().read(true).write(true).open(active_path(dir)).unwrap();
        let len = file.metadata().unwrap().len();
        let scan = segment::scan(&file, len, Lsn(0)).unwrap();
        let (first, last) = (scan.entries[0].lsn, scan.entries.last().unwrap().lsn);
        let size = len + layer::index_and_footer_len(scan.entries.len());
        let mut m = manifest::read(dir).unwrap().unwrap();
        m.sealing = Some(SealIntent { layer: LayerMeta::new(first, last, size), data_len: len });
        write_manifest(dir, &mut m);
        let end = layer::append_index_and_footer(&file, len, &scan.entries).unwrap();
        assert_eq!(end, size);
        if let Some(keep) = keep {
            assert!(keep < end - len);
            file.set_len(len + keep).unwrap();
        }
        if v1 {
            std::fs::remove_file(dir.join(MANIFEST_NAME)).unwrap();
        }
    }

    fn write_manifest(dir: &Path, m: &mut Manifest) {
        manifest::write(dir, &File::open(dir).unwrap(), m, &StorageMetrics::unregistered()).unwrap();
    }

    #[tokio::test]
    async fn crash_after_seal_wrote_its_index_keeps_the_segment_and_seals_it_again() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        three_batches(dir.path(), &m).await;
        let len = std::fs::metadata(active_path(dir.path())).unwrap().len();
        append_seal_index(dir.path(), None, false);

        let tl = open(dir.path(), BIG, &m);
        assert_eq!((layer_count(dir.path()), tl.stats().layers), (0, 0));
        assert_eq!(std::fs::metadata(active_path(dir.path())).unwrap().len(), len);
        assert_eq!(manifest::read(dir.path()).unwrap().unwrap().sealing, None);
        assert_eq!(records_of(&tl, 30), [10, 20, 30]);
        drop(tl);
        // With a small layer size, the next ingest seals it (again) for good.
        let tl = open(dir.path(), 100, &m);
        tl.ingest(batch(vec![(key(1), 40, record("r40"))])).await.unwrap();
        drop(tl);
        let tl = open(dir.path(), 100, &m);
        assert_eq!((tl.stats().layers, layer_count(dir.path())), (1, 1));
        ingest_survives_reopen(tl, dir.path(), &m, 100).await;
    }

    #[tokio::test]
    async fn version_1_crash_after_seal_wrote_index_but_before_rename_finishes_the_seal() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        three_batches(dir.path(), &m).await;
        append_seal_index(dir.path(), None, true);

        let tl = open(dir.path(), BIG, &m);
        assert_eq!(layer_count(dir.path()), 1);
        assert!(dir.path().join(layer::file_name(Lsn(10), Lsn(30))).exists());
        assert_eq!(tl.stats().layers, 1);
        assert_eq!(m.torn_tail_truncations.get(), 0);
        assert_eq!(records_of(&tl, 30), [10, 20, 30]);
        ingest_survives_reopen(tl, dir.path(), &m, BIG).await;
    }

    #[tokio::test]
    async fn crash_while_seal_wrote_a_partial_index_cuts_it_and_keeps_the_segment() {
        for v1 in [false, true] {
            for keep in [1u64, 4, 50] {
                let dir = tempfile::tempdir().unwrap();
                let m = metrics();
                three_batches(dir.path(), &m).await;
                append_seal_index(dir.path(), Some(keep), v1);
                let tl = open(dir.path(), BIG, &m);
                // Version 1 finds the partial index as a torn tail; with a manifest, the
                // seal intent says where the frames end.
                let torn = u64::from(v1);
                assert_eq!((layer_count(dir.path()), m.torn_tail_truncations.get()), (0, torn), "{keep}");
                assert_eq!(records_of(&tl, 30), [10, 20, 30]);
                ingest_survives_reopen(tl, dir.path(), &m, BIG).await;
            }
        }
    }

    /// Ingests two images with a layer size that seals after each: two layers.
    async fn two_layers(dir: &Path, m: &Arc<StorageMetrics>) {
        let tl = open(dir, 8_000, m);
        tl.ingest(batch(vec![(key(1), 10, image(1))])).await.unwrap();
        tl.ingest(batch(vec![(key(1), 20, image(2))])).await.unwrap();
        tl.shutdown().await;
        drop(tl);
        assert_eq!(layer_count(dir), 2);
    }

    #[tokio::test]
    async fn crash_after_rename_before_new_active_segment_recreates_it() {
        for leftover in [None, Some(0u64), Some(7), Some(16)] {
            let dir = tempfile::tempdir().unwrap();
            let m = metrics();
            two_layers(dir.path(), &m).await;
            // The manifest as it was during the second seal: intent recorded, layer not yet.
            let mut man = manifest::read(dir.path()).unwrap().unwrap();
            let layer = man.layers.pop().unwrap();
            man.active = ActiveMeta { seq: man.active.seq - 1, base_lsn: man.layers_last_lsn().0 };
            man.sealing = Some(SealIntent { data_len: layer.size - 200, layer });
            write_manifest(dir.path(), &mut man);
            match leftover {
                None => std::fs::remove_file(active_path(dir.path())).unwrap(),
                Some(n) => {
                    File::options().write(true).open(active_path(dir.path())).unwrap().set_len(n).unwrap()
                }
            }
            let tl = open(dir.path(), 8_000, &m);
            assert_eq!(tl.stats().layers, 2);
            assert_eq!(tl.last_durable_lsn(), Lsn(20));
            let man = manifest::read(dir.path()).unwrap().unwrap();
            assert_eq!((man.layers.len(), man.sealing.is_none(), man.active.base_lsn), (2, true, 20));
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
        two_layers(dir.path(), &m).await;
        let path = dir.path().join(layer::file_name(Lsn(10), Lsn(10)));
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        let len = f.metadata().unwrap().len();
        f.write_all_at(&[0xAA], len - layer::FOOTER_LEN - 3).unwrap();
        let err = Timeline::open(dir.path(), Default::default(), m.clone()).err().unwrap();
        assert!(format!("{err:#}").contains("index checksum mismatch"), "{err:#}");
    }

    fn open_err(dir: &Path) -> String {
        format!("{:#}", Timeline::open(dir, Default::default(), metrics()).err().unwrap())
    }

    #[tokio::test]
    async fn missing_layer_or_active_segment_is_refused_naming_the_file() {
        let first = layer::file_name(Lsn(10), Lsn(10));
        let second = layer::file_name(Lsn(20), Lsn(20));
        for victim in [first.as_str(), second.as_str(), ACTIVE_NAME] {
            let dir = tempfile::tempdir().unwrap();
            two_layers(dir.path(), &metrics()).await;
            std::fs::remove_file(dir.path().join(victim)).unwrap();
            let err = open_err(dir.path());
            assert!(err.contains(victim) && err.contains("missing"), "{victim}: {err}");
        }
        // Deleting the newest layer and active.seg together cannot move the durable LSN back.
        let dir = tempfile::tempdir().unwrap();
        two_layers(dir.path(), &metrics()).await;
        std::fs::remove_file(dir.path().join(&second)).unwrap();
        std::fs::remove_file(active_path(dir.path())).unwrap();
        assert!(open_err(dir.path()).contains("missing"));
    }

    #[tokio::test]
    async fn unexpected_or_resized_layer_file_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        two_layers(dir.path(), &metrics()).await;
        let stray = layer::file_name(Lsn(30), Lsn(40));
        std::fs::copy(dir.path().join(layer::file_name(Lsn(20), Lsn(20))), dir.path().join(&stray)).unwrap();
        let err = open_err(dir.path());
        assert!(err.contains(&stray) && err.contains("not listed"), "{err}");
        std::fs::remove_file(dir.path().join(&stray)).unwrap();

        let first = dir.path().join(layer::file_name(Lsn(10), Lsn(10)));
        let f = OpenOptions::new().append(true).open(&first).unwrap();
        std::io::Write::write_all(&mut &f, b"x").unwrap();
        let err = open_err(dir.path());
        assert!(err.contains("bytes") && err.contains("layer_"), "{err}");
    }

    #[tokio::test]
    async fn version_1_directory_without_manifest_opens_and_gets_one() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        two_layers(dir.path(), &m).await;
        let tl = open(dir.path(), 8_000, &m);
        tl.ingest(batch(vec![(key(1), 30, record("r30"))])).await.unwrap();
        drop(tl);
        let before = manifest::read(dir.path()).unwrap().unwrap();
        std::fs::remove_file(dir.path().join(MANIFEST_NAME)).unwrap();

        let tl = open(dir.path(), BIG, &m);
        assert_eq!((tl.stats().layers, tl.last_durable_lsn()), (2, Lsn(30)));
        let after = manifest::read(dir.path()).unwrap().unwrap();
        assert_eq!((after.layers.clone(), after.active.base_lsn), (before.layers, 20));
        assert_eq!(after.sealing, None);
        drop(tl);
        // From now on the manifest guards the directory.
        std::fs::remove_file(active_path(dir.path())).unwrap();
        assert!(open_err(dir.path()).contains("missing"));
    }

    #[tokio::test]
    async fn leftover_temporary_manifest_is_removed_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        three_batches(dir.path(), &m).await;
        std::fs::write(dir.path().join(MANIFEST_TMP_NAME), b"half a manif").unwrap();
        let tl = open(dir.path(), BIG, &m);
        assert_eq!(records_of(&tl, 30), [10, 20, 30]);
        assert!(!dir.path().join(MANIFEST_TMP_NAME).exists());
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
