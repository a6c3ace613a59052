//! Recovery tests: crashes at every step of an append or a seal (made by writing the bytes a
//! crash would leave), files deleted or added behind the manifest's back, version 1
//! directories, a client value that forges a layer footer, and a real `kill -9`.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::FileExt;
use std::time::Duration;

use page_types::BufferTag;

use super::*;
use crate::storage::manifest::{ActiveMeta, CompactIntent, SealIntent};
use crate::storage::test_support::*;
use crate::storage::{format, GetError, Timeline, Value};

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
    match tl.get_reconstruct_data(key(1), Lsn(lsn), NO_LIMITS) {
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
        let d = tl.get_reconstruct_data(key(1), Lsn(last + 1), NO_LIMITS).unwrap();
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
                    .map(|i| tl.ingest(batch(vec![(key(1), next + i, record(&format!("v{}", next + i)))])))
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
        let d = recovered.get_reconstruct_data(key(1), acked, NO_LIMITS).unwrap();
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
    let scan = segment::scan(&file, len, Lsn(0), false).unwrap();
    let (first, last) = (scan.entries[0].lsn, scan.entries.last().unwrap().lsn);
    let size = len + layer::flat_index_and_footer_len(scan.entries.len());
    let mut m = manifest::read(dir).unwrap().unwrap();
    let name = LayerName::older_seal(first, last);
    m.sealing = Some(SealIntent { layer: LayerMeta::new(&name, size, None), data_len: len });
    write_manifest(dir, &mut m);
    let end = layer::append_flat_index_and_footer(&file, len, &scan.entries).unwrap();
    assert_eq!(end, size);
    if let Some(keep) = keep {
        assert!(keep < end - len);
        file.set_len(len + keep).unwrap();
    }
    if v1 {
        make_version_1(dir);
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
    assert!(dir.path().join(layer::file_name(&LayerName::older_seal(Lsn(10), Lsn(30)))).exists());
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
        // The intent has no checksum: the seal computes it after writing the index.
        let layer = LayerMeta { crc32c: None, ..layer };
        man.sealing = Some(SealIntent { data_len: layer.size - 200, layer });
        write_manifest(dir.path(), &mut man);
        match leftover {
            None => std::fs::remove_file(active_path(dir.path())).unwrap(),
            Some(n) => File::options().write(true).open(active_path(dir.path())).unwrap().set_len(n).unwrap(),
        }
        let tl = open(dir.path(), 8_000, &m);
        assert_eq!(tl.stats().layers, 2);
        assert_eq!(tl.last_durable_lsn(), Lsn(20));
        let man = manifest::read(dir.path()).unwrap().unwrap();
        assert_eq!((man.layers.len(), man.sealing.is_none(), man.active.base_lsn), (2, true, 20));
        // ... recovery reads the renamed layer for it.
        assert_eq!(check_listed_layers(dir.path()), 2);
        let d = tl.get_reconstruct_data(key(1), Lsn(15), NO_LIMITS).unwrap();
        assert_eq!(d.image, Some((Lsn(10), bytes_of(&image(1)))));
        tl.ingest(batch(vec![(key(1), 30, record("r30"))])).await.unwrap();
        drop(tl);
        let tl = open(dir.path(), 8_000, &m);
        let d = tl.get_reconstruct_data(key(1), Lsn(30), NO_LIMITS).unwrap();
        assert_eq!(d.image.unwrap().0, Lsn(20));
        assert_eq!(d.records, vec![(Lsn(30), bytes_of(&record("r30")))]);
    }
}

#[tokio::test]
async fn corrupt_layer_index_is_an_error_instead_of_dropped_data() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    two_layers(dir.path(), &m).await;
    let path = dir.path().join(layer_named(dir.path(), 10, 10));
    let f = OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let len = f.metadata().unwrap().len();
    // One value, so one index block (its entry) and one fence before the footer.
    let block = len - layer::block_index::FOOTER_LEN - FENCE_AND_ENTRY;
    let flip = |at: u64| {
        let mut b = [0u8];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0xAA], at).unwrap();
    };
    // A corrupt fence array: the layer does not open, so the timeline does not.
    flip(len - layer::block_index::FOOTER_LEN - 3);
    let err = Timeline::open(dir.path(), Default::default(), m.clone()).err().unwrap();
    assert!(format!("{err:#}").contains("fence checksum mismatch"), "{err:#}");
    flip(len - layer::block_index::FOOTER_LEN - 3);
    // A corrupt index block is read only by a lookup: the lookup fails (never "not found", never
    // an older version) and the newer layer still serves its own key.
    flip(block + 20);
    let tl = Timeline::open(dir.path(), Default::default(), m.clone()).unwrap();
    let err = tl.get_reconstruct_data(key(1), Lsn(10), NO_LIMITS).unwrap_err();
    assert!(matches!(err, GetError::Io(_)), "{err:?}");
    assert!(format!("{err:#}").contains("index block 0 checksum mismatch"), "{err:#}");
    let d = tl.get_reconstruct_data(key(1), Lsn(20), NO_LIMITS).unwrap();
    assert_eq!(d.image.unwrap().0, Lsn(20));
}

/// Bytes of one index entry and one fence.
const FENCE_AND_ENTRY: u64 = layer::INDEX_ENTRY_LEN as u64 + 33;

/// The name of the layer file in `dir` that covers LSNs `first..=last`.
fn layer_named(dir: &Path, first: u64, last: u64) -> String {
    let names =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned());
    let mut found: Vec<String> = names
        .filter(|n| layer::parse_file_name(n).is_some_and(|p| (p.first, p.last) == (Lsn(first), Lsn(last))))
        .collect();
    assert_eq!(found.len(), 1, "layers of {first}..={last}: {found:?}");
    found.remove(0)
}

fn open_err(dir: &Path) -> String {
    format!("{:#}", Timeline::open(dir, Default::default(), metrics()).err().unwrap())
}

#[tokio::test]
async fn missing_layer_or_active_segment_is_refused_naming_the_file() {
    for victim in [Some((10, 10)), Some((20, 20)), None] {
        let dir = tempfile::tempdir().unwrap();
        two_layers(dir.path(), &metrics()).await;
        let victim =
            victim.map_or(ACTIVE_NAME.to_string(), |(first, last)| layer_named(dir.path(), first, last));
        let victim = victim.as_str();
        std::fs::remove_file(dir.path().join(victim)).unwrap();
        let err = open_err(dir.path());
        assert!(err.contains(victim) && err.contains("missing"), "{victim}: {err}");
    }
    // Deleting the newest layer and active.seg together cannot move the durable LSN back.
    let dir = tempfile::tempdir().unwrap();
    two_layers(dir.path(), &metrics()).await;
    std::fs::remove_file(dir.path().join(layer_named(dir.path(), 20, 20))).unwrap();
    std::fs::remove_file(active_path(dir.path())).unwrap();
    assert!(open_err(dir.path()).contains("missing"));
}

#[tokio::test]
async fn unexpected_or_resized_layer_file_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    two_layers(dir.path(), &metrics()).await;
    let stray = layer::file_name(&LayerName::older_seal(Lsn(30), Lsn(40)));
    std::fs::copy(dir.path().join(layer_named(dir.path(), 20, 20)), dir.path().join(&stray)).unwrap();
    let err = open_err(dir.path());
    assert!(err.contains(&stray) && err.contains("not listed"), "{err}");
    std::fs::remove_file(dir.path().join(&stray)).unwrap();

    let first = dir.path().join(layer_named(dir.path(), 10, 10));
    let f = OpenOptions::new().append(true).open(&first).unwrap();
    std::io::Write::write_all(&mut &f, b"x").unwrap();
    let err = open_err(dir.path());
    assert!(err.contains("bytes") && err.contains("layer_"), "{err}");
}

/// An unlisted compaction output is a leftover of the pass the manifest records (and removed at
/// open) if its generation is at least the pass's first, or, for a pass recorded by a build
/// whose outputs carried a number instead, if its number is at least the pass's first; any
/// other unlisted layer stops the open.
#[tokio::test]
async fn compaction_leftovers_are_told_by_generation_or_by_an_older_builds_output_number() {
    let older = |id| LayerName {
        level: Level::Compacted,
        first: Lsn(10),
        last: Lsn(20),
        keys: None,
        generation: None,
        id,
    };
    let newer = |level, generation| LayerName::new(level, (key(1), key(1)), Lsn(10), Lsn(20), generation);
    let cases = [
        (CompactIntent { first_layer_id: Some(5), first_generation: None }, older(Some(5)), true),
        (CompactIntent { first_layer_id: Some(5), first_generation: None }, older(Some(4)), false),
        (CompactIntent { first_layer_id: None, first_generation: Some(9) }, newer(Level::Compacted, 9), true),
        (
            CompactIntent { first_layer_id: None, first_generation: Some(9) },
            newer(Level::Compacted, 8),
            false,
        ),
        (CompactIntent { first_layer_id: None, first_generation: Some(9) }, newer(Level::Sealed, 9), false),
    ];
    for (intent, name, leftover) in cases {
        let dir = tempfile::tempdir().unwrap();
        two_layers(dir.path(), &metrics()).await;
        let mut man = manifest::read(dir.path()).unwrap().unwrap();
        man.compacting = Some(intent.clone());
        write_manifest(dir.path(), &mut man);
        let name = layer::file_name(&name);
        std::fs::copy(dir.path().join(layer_named(dir.path(), 10, 10)), dir.path().join(&name)).unwrap();
        match Timeline::open(dir.path(), Default::default(), metrics()) {
            Ok(tl) => {
                assert!(leftover, "{intent:?} {name}: kept");
                assert!(!dir.path().join(&name).exists(), "{intent:?} {name}");
                assert_eq!(tl.stats().layers, 2);
                assert_eq!(manifest::read(dir.path()).unwrap().unwrap().compacting, None);
            }
            Err(e) => {
                assert!(!leftover, "{intent:?} {name}: {e:#}");
                assert!(format!("{e:#}").contains("not listed"), "{e:#}");
            }
        }
    }
}

/// Turns `dir` into what a version 1 pageserver would have left: no manifest, and version 1
/// file headers on the active segment and every layer.
fn make_version_1(dir: &Path) {
    std::fs::remove_file(dir.join(MANIFEST_NAME)).unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name == ACTIVE_NAME || layer::parse_file_name(&name).is_some() {
            let f = OpenOptions::new().write(true).open(&path).unwrap();
            f.write_all_at(&format::file_header_of_version(1), 0).unwrap();
        }
    }
}

#[tokio::test]
async fn lost_manifest_is_refused_when_the_files_were_written_with_one() {
    let dir = tempfile::tempdir().unwrap();
    two_layers(dir.path(), &metrics()).await;
    std::fs::remove_file(dir.path().join(MANIFEST_NAME)).unwrap();
    // Without the manifest, deleting the newest layer would go unnoticed: refuse instead.
    std::fs::remove_file(dir.path().join(layer_named(dir.path(), 20, 20))).unwrap();
    let err = open_err(dir.path());
    assert!(err.contains("manifest.json is missing"), "{err}");

    // A new timeline whose first open stopped before its manifest: nothing to lose, it opens.
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path(), BIG, &metrics()));
    std::fs::remove_file(dir.path().join(MANIFEST_NAME)).unwrap();
    let tl = open(dir.path(), BIG, &metrics());
    assert_eq!(tl.last_durable_lsn(), Lsn(0));
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
    make_version_1(dir.path());

    let tl = open(dir.path(), BIG, &m);
    assert_eq!((tl.stats().layers, tl.last_durable_lsn()), (2, Lsn(30)));
    let after = manifest::read(dir.path()).unwrap().unwrap();
    // The same files; a directory without a manifest has no checksums to carry over.
    let unchecked = before.layers.iter().map(|l| LayerMeta { crc32c: None, ..l.clone() }).collect::<Vec<_>>();
    assert_eq!((after.layers.clone(), after.active.base_lsn), (unchecked, 20));
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

/// Ingests, as the last batch, a record whose bytes are a valid layer index and footer for
/// where they land in `active.seg` (one entry, pointing at the first value "r10").
async fn ingest_forged_footer(tl: &Timeline, dir: &Path, lsn: u64) {
    let seg_len = std::fs::metadata(active_path(dir)).unwrap().len();
    let index_offset = seg_len + segment::FRAME_HEADER_LEN as u64 + segment::VALUE_HEADER_LEN as u64;
    let first_value = FILE_HEADER_LEN + (segment::FRAME_HEADER_LEN + segment::VALUE_HEADER_LEN) as u64;
    let entry = format::IndexEntry {
        key: key(1),
        lsn: Lsn(10),
        kind: format::Kind::Record,
        offset: first_value,
        len: 3,
        crc: crc32c::crc32c(b"r10"),
    };
    let scratch = tempfile::tempfile().unwrap();
    let end = layer::append_flat_index_and_footer(&scratch, index_offset, &[entry]).unwrap();
    let mut forged = vec![0u8; (end - index_offset) as usize];
    scratch.read_exact_at(&mut forged, index_offset).unwrap();
    let value = Value::Record(bytes::Bytes::from(forged));
    tl.ingest(batch(vec![(key(2), lsn, value.clone())])).await.unwrap();
    // It really is a valid footer and index at the end of the file.
    let f = File::open(active_path(dir)).unwrap();
    let len = f.metadata().unwrap().len();
    assert_eq!(len, end);
    let footer = layer::read_footer(&f, len).unwrap();
    layer::read_index(&f, &footer).unwrap();
}

#[tokio::test]
async fn client_value_that_forges_a_layer_footer_is_not_taken_for_an_interrupted_seal() {
    for v1 in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let m = metrics();
        three_batches(dir.path(), &m).await;
        let tl = open(dir.path(), BIG, &m);
        ingest_forged_footer(&tl, dir.path(), 40).await;
        drop(tl);
        if v1 {
            make_version_1(dir.path());
        }
        let tl = open(dir.path(), BIG, &m);
        assert_eq!(layer_count(dir.path()), 0, "v1: {v1}");
        assert_eq!(records_of(&tl, 40), [10, 20, 30], "v1: {v1}");
        assert_eq!(tl.last_durable_lsn(), Lsn(40));
        assert!(tl.get_reconstruct_data(key(2), Lsn(40), NO_LIMITS).is_ok());
        tl.ingest(batch(vec![(key(1), 50, record("r50"))])).await.unwrap();
        drop(tl);
        let tl = open(dir.path(), BIG, &m);
        assert_eq!(records_of(&tl, 50), [10, 20, 30, 50], "v1: {v1}");
    }
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
fn kill9_value(lsn: u64) -> (BufferTag, Value) {
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
            let d = tl.get_reconstruct_data(k, Lsn(lsn), NO_LIMITS).unwrap();
            let newest = d.records.last().or(d.image.as_ref()).unwrap();
            assert_eq!(newest, &(Lsn(lsn), bytes_of(&v)), "lsn {lsn}");
        }
    }
    assert!(layer_count(dir.path()) > 10);
}

/// The active segment keeps copies of its small records, made at ingest and again by the scan
/// of a reopen: a page whose image and records came in separate batches, far apart in the file,
/// is read with one `pread` (its image) instead of one per record, and its records are the
/// bytes ingested. A record over the size limit is read from the file.
#[tokio::test]
async fn small_records_of_the_active_segment_are_read_from_memory_before_and_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let long = Value::Record(Bytes::from(vec![7u8; format::COPIED_RECORD_MAX + 1]));
    let ingested: Vec<Bytes> = vec![bytes_of(&record("r20")), bytes_of(&record("r30")), bytes_of(&long)];
    let tl = open(dir.path(), BIG, &m);
    tl.ingest(batch(vec![(key(1), 10, image(1))])).await.unwrap();
    for (lsn, value) in [(20, record("r20")), (30, record("r30")), (40, long)] {
        // Another page's image between them: no two values of key 1 are read together.
        tl.ingest(batch(vec![(key(2), lsn - 1, image(2)), (key(1), lsn, value)])).await.unwrap();
    }
    let check = |tl: &Timeline, when: &str| {
        let plan = tl.plan_read(key(1), Lsn(40), NO_LIMITS).unwrap();
        assert_eq!((plan.reads(), plan.values()), (2, 4), "{when}: the image and the long record are read");
        let d = plan.execute().unwrap();
        assert_eq!(d.image.unwrap().1, bytes_of(&image(1)), "{when}");
        let records: Vec<(Lsn, Bytes)> = [20, 30, 40].map(Lsn).into_iter().zip(ingested.clone()).collect();
        assert_eq!(d.records, records, "{when}");
        let plan = tl.plan_read(key(1), Lsn(30), NO_LIMITS).unwrap();
        assert_eq!((plan.reads(), plan.values()), (1, 3), "{when}: only the image is read");
    };
    check(&tl, "after ingest");
    tl.shutdown().await;
    drop(tl);
    let tl = open(dir.path(), BIG, &m);
    check(&tl, "after reopen");
}

/// A reopen keeps copies of small records while they fit in the limit: a record that does not
/// fit is read from the file, and a smaller one after it, in the same frame or a later one,
/// still gets its copy (its own bytes, not the skipped record's place nor the next one's).
#[tokio::test]
async fn a_reopen_copies_records_while_they_fit_and_reads_the_others_from_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), BIG, &m);
    let fill = format::COPIES_MAX as usize / 1000;
    let rec = |n: usize, b: u8| Value::Record(Bytes::from(vec![b; n]));
    let mut lsn = 0;
    for chunk in (0..fill).collect::<Vec<_>>().chunks(2000) {
        let values = chunk
            .iter()
            .map(|&i| {
                lsn += 1;
                (key(10 + i as u32), lsn, rec(1000, 1))
            })
            .collect();
        tl.ingest(batch(values)).await.unwrap();
    }
    // The first does not fit in what is left; the next two, smaller, do: one in the same frame,
    // one in the next.
    tl.ingest(batch(vec![(key(1), lsn + 1, rec(1024, 2)), (key(2), lsn + 2, rec(100, 3))])).await.unwrap();
    tl.ingest(batch(vec![(key(3), lsn + 3, rec(100, 4))])).await.unwrap();
    tl.shutdown().await;
    drop(tl);
    let tl = open(dir.path(), BIG, &m);
    assert_eq!(tl.stats().record_copy_bytes, fill as u64 * 1000 + 200);
    let reads = |k| tl.plan_read(k, Lsn(u64::MAX >> 1), NO_LIMITS).unwrap().reads();
    assert_eq!((reads(key(1)), reads(key(2)), reads(key(3)), reads(key(10))), (1, 0, 0, 0));
    let values =
        [(key(1), rec(1024, 2)), (key(2), rec(100, 3)), (key(3), rec(100, 4)), (key(10), rec(1000, 1))];
    for (k, want) in values {
        let d = tl.get_reconstruct_data(k, Lsn(u64::MAX >> 1), NO_LIMITS).unwrap();
        assert_eq!(d.records.len(), 1);
        assert_eq!(d.records[0].1, bytes_of(&want));
    }
}
