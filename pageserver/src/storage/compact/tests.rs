#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use page_types::{Lsn, PAGE_SIZE};

use crate::storage::test_support::*;
use crate::storage::{
    CompactionConf, DiskWait, GetError, Pass, PassKind, PassStats, ReadLimits, ReconstructData, Step,
    Timeline,
};

/// A toy redo: the base image (zeros without one) with each record's bytes added into it at a
/// position given by the record, wrapping. Composes like real redo: an image made from a chain
/// and the records after it give the page the whole chain gives.
fn toy_redo(d: &ReconstructData) -> Bytes {
    let mut page = d.image.as_ref().map_or_else(|| vec![0u8; PAGE_SIZE], |(_, b)| b.to_vec());
    for (_, r) in &d.records {
        // Each record adds its checksum and length at a place its first byte picks: a lost,
        // added or changed record changes the page. (Adding every byte of the record, as this
        // did before, took two minutes of a debug build for the long chains below.)
        let at = usize::from(r[0]) * 31 % PAGE_SIZE;
        let mix = ((u64::from(crc32c::crc32c(r)) << 32) | r.len() as u64).to_le_bytes();
        for (i, b) in mix.iter().enumerate() {
            let p = (at + i) % PAGE_SIZE;
            page[p] = page[p].wrapping_add(*b);
        }
    }
    Bytes::from(page)
}

/// The page of every key at every LSN in `lsns` (None where there is none), or the error kind.
fn pages(tl: &Timeline, keys: u32, lsns: &[u64]) -> BTreeMap<(u32, u64), Result<Option<Bytes>, String>> {
    let mut out = BTreeMap::new();
    for k in 0..keys {
        for &lsn in lsns {
            let got = match tl.get_reconstruct_data(key(k), Lsn(lsn), NO_LIMITS) {
                Ok(d) => Ok(Some(toy_redo(&d))),
                Err(GetError::NotFound { .. }) => Ok(None),
                Err(e) => Err(e.to_string()),
            };
            out.insert((k, lsn), got);
        }
    }
    out
}

/// Runs `pass` to its end in slices of `slice`, answering image requests with the toy redo.
fn run(mut pass: Pass, slice: Duration) -> PassStats {
    loop {
        match pass.run_slice(slice).unwrap() {
            Step::Continue => {}
            Step::NeedImage(req) => pass.provide_image(Some(toy_redo(&req.read().unwrap()))),
            Step::Done(stats) => return stats,
        }
    }
}

const KEYS: u32 = 20;

/// Writes `rounds` rounds of one record per key (LSN = round * 100 + key + 1), every fifth
/// round an image for even keys instead; returns the last LSN.
async fn fill(tl: &Timeline, from_round: u64, rounds: u64) -> u64 {
    let mut last = 0;
    for round in from_round..from_round + rounds {
        let values = (0..KEYS)
            .map(|k| {
                let lsn = round * 100 + u64::from(k) + 1;
                last = lsn;
                let v = if round % 5 == 4 && k % 2 == 0 {
                    image((round + u64::from(k)) as u8)
                } else {
                    record(&format!("{}k{k}r{round}", (k as u8 + round as u8) as char))
                };
                (key(k), lsn, v)
            })
            .collect();
        tl.ingest(batch(values)).await.unwrap();
    }
    last
}

fn conf(image_threshold: usize, gc_horizon: u64) -> CompactionConf {
    CompactionConf { image_threshold, image_bytes: 0, gc_horizon, layer_size: 64 << 10 }
}

fn layer_files(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".layer"))
        .collect();
    v.sort();
    v
}

/// The layer files of `dir` written by compaction (level 1 names).
fn compacted_files(dir: &std::path::Path) -> Vec<String> {
    use crate::storage::layer::{parse_file_name, Level};
    layer_files(dir)
        .into_iter()
        .filter(|n| parse_file_name(n).is_some_and(|p| p.level == Level::Compacted))
        .collect()
}

/// Runs `pass` to its end one zero-budget slice at a time, ingesting one round (from `round`
/// on) before each slice; returns its stats and the next round.
async fn run_ingesting(tl: &Timeline, mut pass: Pass, mut round: u64) -> (PassStats, u64) {
    loop {
        // Between slices: more ingest (and seals) on the same keys.
        fill(tl, round, 1).await;
        round += 1;
        match pass.run_slice(Duration::ZERO).unwrap() {
            Step::NeedImage(req) => pass.provide_image(Some(toy_redo(&req.read().unwrap()))),
            Step::Continue => {}
            Step::Done(stats) => return (stats, round),
        }
    }
}

#[tokio::test]
async fn compaction_keeps_every_page_merges_layers_and_creates_images() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let last = fill(&tl, 0, 30).await;
    tl.freeze().await.unwrap();
    let lsns: Vec<u64> = (0..=last + 1).step_by(7).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);
    let layers_before = tl.stats().layers;
    assert!(layers_before > 5, "{layers_before}");
    assert_eq!(check_listed_layers(dir.path()) as u64, layers_before);
    // Seals write block indexes (format version 3): no layer holds its entries in memory.
    let n = layers_before as usize;
    assert_eq!(tl.block_indexed_layers(), (n, n));

    let pass = tl.begin_compaction(conf(3, u64::MAX)).unwrap().unwrap();
    let stats = run(pass, Duration::from_micros(50));
    assert_eq!(stats.input_layers, layers_before);
    let n = stats.output_layers as usize;
    assert_eq!(tl.block_indexed_layers(), (n, n));
    assert!(stats.values_written > 2 * super::super::layer::block_index::BLOCK_ENTRIES as u64, "{stats:?}");
    assert_eq!(stats.keys, u64::from(KEYS));
    // Odd keys have 30 records and no image; even keys end with an image.
    assert_eq!(stats.images_created, u64::from(KEYS / 2), "{stats:?}");
    assert_eq!(stats.values_dropped, 0, "without GC only a record replaced by its image goes: {stats:?}");
    assert_eq!(stats.files_deleted, layers_before);
    assert_eq!(tl.stats().layers, stats.output_layers);
    assert!(stats.output_layers < layers_before);
    assert_eq!(pages(&tl, KEYS, &lsns), before);
    // Every key's newest page is now one image: one read.
    let d = tl.get_reconstruct_data(key(3), Lsn(last), NO_LIMITS).unwrap();
    assert!(d.image.is_some() && d.records.is_empty());
    assert_eq!(layer_files(dir.path()).len() as u64, stats.output_layers);
    assert_eq!(check_listed_layers(dir.path()) as u64, stats.output_layers);

    // Reopened, the same pages, and ingest goes on above.
    drop(tl);
    let tl = open(dir.path(), 2000, &m);
    assert_eq!(tl.block_indexed_layers(), (n, n));
    assert_eq!(pages(&tl, KEYS, &lsns), before);
    fill(&tl, 30, 2).await;
}

#[tokio::test]
async fn gc_drops_versions_below_the_horizon_and_refuses_reads_there() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let last = fill(&tl, 0, 40).await;
    tl.freeze().await.unwrap();
    let horizon = 500;
    let cutoff = last - horizon;
    let retained: Vec<u64> = (cutoff..=last).step_by(13).chain([last]).collect();
    let before = pages(&tl, KEYS, &retained);
    let disk_before = tl.stats().on_disk_bytes;

    let stats = run(tl.begin_compaction(conf(3, horizon)).unwrap().unwrap(), Duration::from_millis(1));
    assert_eq!(tl.gc_cutoff(), Lsn(cutoff));
    assert!(stats.values_dropped > stats.images_created, "{stats:?}");
    assert_eq!(pages(&tl, KEYS, &retained), before);
    assert!(tl.stats().on_disk_bytes < disk_before / 2, "{} vs {disk_before}", tl.stats().on_disk_bytes);
    let err = tl.get_reconstruct_data(key(1), Lsn(cutoff - 1), NO_LIMITS).unwrap_err();
    assert!(matches!(err, GetError::BelowGcCutoff { .. }), "{err}");
    assert!(matches!(tl.version_at(key(1), Lsn(10), DiskWait::Allowed), Err(GetError::BelowGcCutoff { .. })));

    // The cutoff is durable.
    drop(tl);
    let tl = open(dir.path(), 2000, &m);
    assert_eq!(tl.gc_cutoff(), Lsn(cutoff));
    assert_eq!(pages(&tl, KEYS, &retained), before);
}

#[tokio::test]
async fn a_crash_at_any_point_of_a_pass_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let last = fill(&tl, 0, 20).await;
    tl.freeze().await.unwrap();
    let lsns: Vec<u64> = (1..=last).step_by(11).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);
    let check = |snap: tempfile::TempDir, what: &str| {
        let m = metrics();
        let tl = open(snap.path(), 2000, &m);
        assert_eq!(pages(&tl, KEYS, &lsns), before, "after a crash {what}");
        let files = layer_files(snap.path());
        assert_eq!(files.len() as u64, tl.stats().layers, "{what}: {files:?}");
        assert_eq!(check_listed_layers(snap.path()), files.len(), "{what}");
        assert!(!std::fs::read_dir(snap.path()).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".tmp")));
    };

    // Crash in the middle of the pass (after some slices, with outputs on disk).
    let mut pass = tl.begin_compaction(conf(3, u64::MAX)).unwrap().unwrap();
    check(snapshot(dir.path()), "right after the intent");
    let mut slices = 0;
    loop {
        match pass.run_slice(Duration::ZERO).unwrap() {
            Step::NeedImage(req) => pass.provide_image(Some(toy_redo(&req.read().unwrap()))),
            Step::Continue => {}
            Step::Done(_) => panic!("the pass ended before the crash"),
        }
        slices += 1;
        if slices == 8 {
            break;
        }
    }
    check(snapshot(dir.path()), "in the middle of a pass");
    // An abandoned pass removes its outputs; the next one installs.
    drop(pass);
    check(snapshot(dir.path()), "after an abandoned pass");
    let stats = run(tl.begin_compaction(conf(3, u64::MAX)).unwrap().unwrap(), Duration::from_millis(1));
    assert!(stats.output_layers >= 1);
    check(snapshot(dir.path()), "after the install");
    assert_eq!(pages(&tl, KEYS, &lsns), before);
}

#[tokio::test]
async fn ingest_and_reads_go_on_during_a_pass_and_a_second_pass_compacts_the_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    fill(&tl, 0, 10).await;
    tl.freeze().await.unwrap();
    let (stats, _) = run_ingesting(&tl, tl.begin_compaction(conf(2, u64::MAX)).unwrap().unwrap(), 10).await;
    assert_eq!(stats.keys, u64::from(KEYS));
    let last = tl.last_durable_lsn().0;
    let lsns: Vec<u64> = (1..=last).step_by(17).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);
    assert!(tl.backlog().sealed_layers > 0);
    tl.freeze().await.unwrap();
    let second = run(tl.begin_compaction(conf(2, u64::MAX)).unwrap().unwrap(), Duration::from_millis(1));
    assert!(second.input_layers > second.output_layers, "{second:?}");
    assert_eq!(tl.backlog().sealed_layers, 0);
    assert_eq!(pages(&tl, KEYS, &lsns), before);
}

#[tokio::test]
async fn a_full_disk_during_a_pass_fails_it_and_loses_nothing() {
    let fs = Tmpfs::mount(4 << 20);
    let dir = fs.path().join("tl");
    let m = metrics();
    let tl = open(&dir, 20_000, &m);
    let last = fill(&tl, 0, 40).await;
    tl.freeze().await.unwrap();
    let lsns: Vec<u64> = (1..=last).step_by(29).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);
    // Fill the disk, then compact: the pass cannot write its outputs.
    let filler = std::fs::File::create(fs.path().join("filler")).unwrap();
    let _ = std::io::Write::write_all(&mut &filler, &vec![0u8; 8 << 20]);
    let result = tl.begin_compaction(conf(3, u64::MAX)).and_then(|p| {
        let mut p = p.unwrap();
        loop {
            match p.run_slice(Duration::from_millis(5))? {
                Step::NeedImage(req) => p.provide_image(Some(toy_redo(&req.read().unwrap()))),
                Step::Continue => {}
                Step::Done(s) => return Ok(s),
            }
        }
    });
    let err = result.unwrap_err();
    assert!(format!("{err:#}").contains("No space left"), "{err:#}");
    assert_eq!(pages(&tl, KEYS, &lsns), before);
    // Space again: the next pass works, and a reopen sees the same.
    drop(filler);
    std::fs::remove_file(fs.path().join("filler")).unwrap();
    run(tl.begin_compaction(conf(3, u64::MAX)).unwrap().unwrap(), Duration::from_millis(1));
    assert_eq!(pages(&tl, KEYS, &lsns), before);
    drop(tl);
    let tl = open(&dir, 20_000, &m);
    assert_eq!(pages(&tl, KEYS, &lsns), before);
}

/// What one GetPage may read: the redo request's limits.
const REDO_LIMITS: ReadLimits = ReadLimits {
    max_records: page_types::MAX_RECORDS_PER_REQUEST,
    max_bytes: page_types::MAX_RECONSTRUCT_BYTES,
};

#[tokio::test]
async fn a_chain_over_one_redo_request_gets_intermediate_images_and_every_lsn_stays_readable() {
    const RECORDS: u64 = page_types::MAX_RECORDS_PER_REQUEST as u64 + 3000;
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 64 << 20, &m);
    for first in (1..=RECORDS).step_by(5000) {
        let values = (first..(first + 5000).min(RECORDS + 1))
            .map(|lsn| (key(0), lsn, record(&format!("{}r{lsn}", (lsn % 200) as u8 as char))))
            .collect();
        tl.ingest(batch(values)).await.unwrap();
    }
    tl.freeze().await.unwrap();
    let limit = page_types::MAX_RECORDS_PER_REQUEST as u64;
    let lsns = [1, 2, 1000, limit - 1, limit, limit + 1, limit + 2, RECORDS - 1, RECORDS];
    let expected = pages(&tl, 1, &lsns);
    assert!(expected.values().all(|p| matches!(p, Ok(Some(_)))));
    let err = tl.get_reconstruct_data(key(0), Lsn(RECORDS), REDO_LIMITS).unwrap_err();
    assert!(matches!(err, GetError::TooLarge(_)), "{err}");

    let mut pass = tl.begin_compaction(conf(8, u64::MAX)).unwrap().unwrap();
    let stats = loop {
        match pass.run_slice(Duration::from_millis(1)).unwrap() {
            Step::Continue => {}
            Step::NeedImage(req) => {
                let (values, holds) = (req.values(), req.bytes());
                let d = req.read().unwrap();
                let bytes: u64 = d.image.iter().chain(&d.records).map(|(_, b)| b.len() as u64).sum();
                assert_eq!(values, d.records.len() + usize::from(d.image.is_some()));
                assert!(bytes <= holds && holds <= crate::storage::IMAGE_PIECE_BYTES, "{bytes} {holds}");
                assert!(
                    d.records.len() <= page_types::MAX_RECORDS_PER_REQUEST,
                    "{} records",
                    d.records.len()
                );
                assert!(bytes <= page_types::MAX_RECONSTRUCT_BYTES, "{bytes} bytes");
                pass.provide_image(Some(toy_redo(&d)));
            }
            Step::Done(stats) => break stats,
        }
    };
    assert!(stats.images_created >= 2 && stats.image_failures == 0, "{stats:?}");
    for &lsn in &lsns {
        let d = tl
            .get_reconstruct_data(key(0), Lsn(lsn), REDO_LIMITS)
            .unwrap_or_else(|e| panic!("lsn {lsn}: {e}"));
        assert_eq!(Ok(Some(toy_redo(&d))), expected[&(0, lsn)], "lsn {lsn}");
    }
}

/// One key with `n` records of 8000 bytes (LSN 1..=n), sealed: a chain of several pieces.
async fn long_key(tl: &Timeline, n: u64) {
    for first in (1..=n).step_by(100) {
        let values = (first..(first + 100).min(n + 1))
            .map(|lsn| (key(0), lsn, record(&format!("{}", (lsn % 200) as u8 as char).repeat(8000))))
            .collect();
        tl.ingest(batch(values)).await.unwrap();
    }
    tl.freeze().await.unwrap();
}

#[tokio::test]
async fn pieces_at_or_below_the_cutoff_drop_what_is_older_and_every_retained_lsn_reads_the_same() {
    const RECORDS: u64 = 600;
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 64 << 20, &m);
    long_key(&tl, RECORDS).await;
    let horizon = 250;
    let cutoff = RECORDS - horizon;
    let retained: Vec<u64> = (cutoff..=RECORDS).collect();
    let expected = pages(&tl, 1, &retained);

    let stats = run(tl.begin_compaction(conf(8, horizon)).unwrap().unwrap(), Duration::ZERO);
    // 4.8 MB of records: pieces of at most a MiB, some of them at or below the cutoff.
    assert!(stats.images_created >= 5 && stats.image_failures == 0, "{stats:?}");
    assert!(stats.values_dropped > RECORDS - horizon - 130, "{stats:?}");
    assert_eq!(tl.gc_cutoff(), Lsn(cutoff));
    for &lsn in &retained {
        let d = tl.get_reconstruct_data(key(0), Lsn(lsn), REDO_LIMITS).unwrap();
        assert!(d.records.len() < 130, "lsn {lsn}: {} records", d.records.len());
        assert_eq!(Ok(Some(toy_redo(&d))), expected[&(0, lsn)], "lsn {lsn}");
    }
    assert!(matches!(
        tl.get_reconstruct_data(key(0), Lsn(cutoff - 1), NO_LIMITS),
        Err(GetError::BelowGcCutoff { .. })
    ));
}

#[tokio::test]
async fn a_piece_that_cannot_be_rebuilt_leaves_its_records_and_keeps_the_images_made_before() {
    const RECORDS: u64 = 600;
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 64 << 20, &m);
    long_key(&tl, RECORDS).await;
    let lsns: Vec<u64> = (1..=RECORDS).collect();
    let expected = pages(&tl, 1, &lsns);

    let mut pass = tl.begin_compaction(conf(8, u64::MAX)).unwrap().unwrap();
    let mut asked = 0;
    let stats = loop {
        match pass.run_slice(Duration::ZERO).unwrap() {
            Step::Continue => {}
            Step::NeedImage(req) => {
                asked += 1;
                let page = (asked < 3).then(|| toy_redo(&req.read().unwrap()));
                pass.provide_image(page);
            }
            Step::Done(stats) => break stats,
        }
    };
    // Two pieces imaged, the third failed: no more pieces asked for.
    assert_eq!((asked, stats.images_created, stats.image_failures), (3, 2, 1), "{stats:?}");
    assert_eq!(stats.values_written, RECORDS);
    assert_eq!(pages(&tl, 1, &lsns), expected);
    let d = tl.get_reconstruct_data(key(0), Lsn(RECORDS), NO_LIMITS).unwrap();
    assert!(d.image.is_some(), "the top is read from the second piece's image");
}

/// A full pass without images (so chains run through it), then `rounds` more rounds sealed
/// above it: level 0 over one run. Returns the last LSN.
async fn run_then_level0(tl: &Timeline, rounds: u64) -> u64 {
    fill(tl, 0, 30).await;
    tl.freeze().await.unwrap();
    let stats = run(tl.begin_compaction(conf(1000, u64::MAX)).unwrap().unwrap(), Duration::from_millis(1));
    assert_eq!((stats.kind, stats.images_created), (PassKind::Full, 0));
    let last = fill(tl, 30, rounds).await;
    tl.freeze().await.unwrap();
    last
}

#[tokio::test]
async fn a_level0_pass_takes_only_the_sealed_layers_and_every_page_stays_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let last = run_then_level0(&tl, 12).await;
    let run1 = compacted_files(dir.path());
    assert!(!run1.is_empty());
    let sealed = tl.backlog().sealed_layers;
    assert!(sealed > 2, "{sealed}");
    assert_eq!(tl.backlog().runs, 1);
    let lsns: Vec<u64> = (0..=last + 1).step_by(7).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);

    // Ingest (and seals) go on above the inputs while the pass runs.
    let pass = tl.begin_pass(conf(1000, u64::MAX), PassKind::Level0).unwrap().unwrap();
    let (stats, round) = run_ingesting(&tl, pass, 42).await;
    assert_eq!(stats.kind, PassKind::Level0);
    assert_eq!(stats.input_layers, sealed, "{stats:?}");
    assert_eq!(stats.values_read, 12 * u64::from(KEYS), "only the new values are read: {stats:?}");
    assert_eq!(stats.values_dropped, 0, "{stats:?}");
    tl.freeze().await.unwrap();
    assert!(tl.backlog().sealed_layers > 0, "the seals made during the pass");
    assert_eq!(tl.backlog().runs, 2);
    // The run below is not rewritten.
    let files = layer_files(dir.path());
    assert!(run1.iter().all(|n| files.contains(n)), "{run1:?} {files:?}");
    assert_eq!(pages(&tl, KEYS, &lsns), before);

    // Reopened (the manifest lists the new run above the old one), the same pages.
    drop(tl);
    let tl = open(dir.path(), 2000, &m);
    assert_eq!(pages(&tl, KEYS, &lsns), before);
    // The next level 0 pass takes the seals made during the last one.
    let stats = run(
        tl.begin_pass(conf(1000, u64::MAX), PassKind::Level0).unwrap().unwrap(),
        Duration::from_millis(1),
    );
    assert_eq!(stats.values_read, (round - 42) * u64::from(KEYS), "{stats:?}");
    assert_eq!(tl.backlog().runs, 3);
    // A full pass makes one run of everything again.
    let stats = run(tl.begin_compaction(conf(1000, u64::MAX)).unwrap().unwrap(), Duration::from_millis(1));
    assert_eq!(stats.values_read, round * u64::from(KEYS), "{stats:?}");
    assert_eq!(tl.backlog().runs, 1);
    assert_eq!(pages(&tl, KEYS, &lsns), before);
}

#[tokio::test]
async fn a_level0_pass_makes_images_of_chains_that_start_below_it() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let last = run_then_level0(&tl, 3).await;
    let lsns: Vec<u64> = (0..=last + 1).step_by(5).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);

    // Each key has 3 new records: an even key's chain starts at its image in the run below,
    // an odd key's at its first record there (it has no image).
    let stats =
        run(tl.begin_pass(conf(3, u64::MAX), PassKind::Level0).unwrap().unwrap(), Duration::from_micros(50));
    assert_eq!(stats.values_read, 3 * u64::from(KEYS), "{stats:?}");
    assert_eq!(stats.images_created, u64::from(KEYS), "{stats:?}");
    assert_eq!(pages(&tl, KEYS, &lsns), before);
    // The newest version of every key is now one image, in the new run.
    for k in 0..KEYS {
        let d = tl.get_reconstruct_data(key(k), Lsn(last), NO_LIMITS).unwrap();
        assert!(d.image.is_some() && d.records.is_empty(), "key {k}: {} records", d.records.len());
    }
}

#[tokio::test]
async fn a_chain_of_short_records_gets_an_image_once_it_holds_a_page_of_bytes_or_the_cap_of_records() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 1 << 20, &m);
    // Above an image each: (key, records, bytes of each record).
    let chains = [(0, 5, 10), (1, 5, 2048), (2, 16, 10), (3, 15, 10)];
    let (mut lsn, mut newest, mut values) = (0, Vec::new(), Vec::new());
    for (k, n, len) in chains {
        lsn += 1;
        values.push((key(k), lsn, image(k as u8)));
        for i in 0..n {
            lsn += 1;
            values.push((key(k), lsn, record(&format!("{}", (b'a' + i as u8) as char).repeat(len))));
        }
        newest.push(lsn);
    }
    tl.ingest(batch(values)).await.unwrap();
    tl.freeze().await.unwrap();
    let lsns: Vec<u64> = (1..=lsn).collect();
    let before = pages(&tl, 4, &lsns);

    let conf = CompactionConf {
        image_threshold: 4,
        image_bytes: PAGE_SIZE as u64,
        gc_horizon: u64::MAX,
        layer_size: 64 << 10,
    };
    let stats = run(tl.begin_compaction(conf).unwrap().unwrap(), Duration::from_millis(1));
    // Key 0: 5 records of 10 bytes, over the threshold but far from a page: no image. Key 1:
    // 5 records of 2 KiB (10 KiB): an image. Key 2: 16 short records, the cap (4 x 4): an image. Key
    // 3: 15 short records: none.
    assert_eq!(stats.images_created, 2, "{stats:?}");
    for (k, imaged) in [(0, false), (1, true), (2, true), (3, false)] {
        let d = tl.get_reconstruct_data(key(k), Lsn(newest[k as usize]), NO_LIMITS).unwrap();
        assert_eq!(d.records.is_empty(), imaged, "key {k}: {} records above its image", d.records.len());
    }
    assert_eq!(pages(&tl, 4, &lsns), before);
}

#[tokio::test]
async fn a_level0_pass_collects_garbage_in_its_inputs_only() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let last = run_then_level0(&tl, 20).await;
    let horizon = 300;
    let cutoff = last - horizon;
    let retained: Vec<u64> = (cutoff..=last).step_by(3).chain([last]).collect();
    let before = pages(&tl, KEYS, &retained);
    let run1 = compacted_files(dir.path());

    let stats =
        run(tl.begin_pass(conf(4, horizon), PassKind::Level0).unwrap().unwrap(), Duration::from_micros(50));
    assert_eq!(tl.gc_cutoff(), Lsn(cutoff));
    assert!(stats.values_dropped > 0 && stats.images_created > 0, "{stats:?}");
    assert_eq!(pages(&tl, KEYS, &retained), before);
    let files = layer_files(dir.path());
    assert!(run1.iter().all(|n| files.contains(n)), "{run1:?} {files:?}");
}

#[tokio::test]
async fn a_crash_during_a_level0_pass_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let last = run_then_level0(&tl, 10).await;
    let lsns: Vec<u64> = (1..=last).step_by(11).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);
    let check = |snap: tempfile::TempDir, what: &str| {
        let m = metrics();
        let tl = open(snap.path(), 2000, &m);
        assert_eq!(pages(&tl, KEYS, &lsns), before, "after a crash {what}");
        assert_eq!(layer_files(snap.path()).len() as u64, tl.stats().layers, "{what}");
    };
    let mut pass = tl.begin_pass(conf(3, u64::MAX), PassKind::Level0).unwrap().unwrap();
    for _ in 0..6 {
        match pass.run_slice(Duration::ZERO).unwrap() {
            Step::NeedImage(req) => pass.provide_image(Some(toy_redo(&req.read().unwrap()))),
            Step::Continue => {}
            Step::Done(_) => panic!("the pass ended before the crash"),
        }
    }
    check(snapshot(dir.path()), "in the middle of a level 0 pass");
    let stats = run(pass, Duration::from_millis(1));
    assert_eq!(stats.kind, PassKind::Level0);
    check(snapshot(dir.path()), "after a level 0 install");
}

#[test]
fn upper_passes_merge_the_newest_runs_while_they_are_no_larger_than_those_above() {
    use super::upper_split;
    // The bottom run never joins; at least the two newest runs do.
    assert_eq!(upper_split(&[100]), None);
    assert_eq!(upper_split(&[100, 5]), None);
    assert_eq!(upper_split(&[100, 5, 5]), Some(1));
    assert_eq!(upper_split(&[100, 50, 1, 1]), Some(2));
    assert_eq!(upper_split(&[100, 50, 2, 1, 1]), Some(2));
    assert_eq!(upper_split(&[100, 4, 2, 1, 1]), Some(1));
    assert_eq!(upper_split(&[1000, 8, 30, 1, 1, 1]), Some(3));
}

#[tokio::test]
async fn an_upper_pass_merges_the_runs_above_the_bottom_one_and_leaves_it_alone() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let mut last = run_then_level0(&tl, 2).await;
    let bottom = compacted_files(dir.path());
    let mut round = 32;
    for _ in 0..4 {
        run(
            tl.begin_pass(conf(1000, u64::MAX), PassKind::Level0).unwrap().unwrap(),
            Duration::from_millis(1),
        );
        last = fill(&tl, round, 2).await;
        round += 2;
        tl.freeze().await.unwrap();
    }
    assert_eq!(tl.backlog().runs, 5);
    assert!(tl.backlog().upper_bytes < tl.backlog().bottom_bytes, "{:?}", tl.backlog());
    let lsns: Vec<u64> = (0..=last + 1).step_by(7).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);

    let stats =
        run(tl.begin_pass(conf(3, u64::MAX), PassKind::Upper).unwrap().unwrap(), Duration::from_micros(50));
    assert_eq!(stats.kind, PassKind::Upper);
    // Four runs of the same size above the bottom one, and level 0: all of them are merged.
    assert_eq!(stats.values_read, 10 * u64::from(KEYS), "{stats:?}");
    assert!(stats.images_created > 0, "{stats:?}");
    assert_eq!(tl.backlog().runs, 2);
    let files = layer_files(dir.path());
    assert!(bottom.iter().all(|n| files.contains(n)), "{bottom:?} {files:?}");
    assert_eq!(pages(&tl, KEYS, &lsns), before);
    drop(tl);
    let tl = open(dir.path(), 2000, &m);
    assert_eq!(pages(&tl, KEYS, &lsns), before);
}

/// A bottom run of 30 rounds, then a level 0 pass without new images over 20 more (even keys'
/// images of rounds 34 to 49 from `fill`, odd keys' records only), then 3 rounds sealed above:
/// the bottom run's values of even keys are shadowed by newer images, odd keys' are not.
/// Returns the last LSN and the bottom run's layers.
async fn two_runs_with_images_above(
    tl: &Timeline,
    dir: &std::path::Path,
) -> (u64, Vec<crate::storage::Overwritten>) {
    run_then_level0(tl, 20).await;
    let bottom = compacted_files(dir).len();
    run(tl.begin_pass(conf(1000, u64::MAX), PassKind::Level0).unwrap().unwrap(), Duration::from_millis(1));
    let last = fill(tl, 50, 3).await;
    tl.freeze().await.unwrap();
    assert_eq!(tl.backlog().runs, 2);
    // Oldest first: the bottom run's layers come first, each with layers above it sharing its
    // keys.
    let bottom: Vec<_> = tl.overwritten()[..bottom].to_vec();
    assert!(!bottom.is_empty() && bottom.iter().all(|l| l.above > 0), "{bottom:?}");
    (last, bottom)
}

#[tokio::test]
async fn a_gc_pass_drops_a_layers_values_that_newer_images_shadow_and_every_retained_lsn_reads_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let (last, bottom) = two_runs_with_images_above(&tl, dir.path()).await;
    let newest_run_above = tl.overwritten().iter().rev().map(|l| l.above).next().unwrap();
    assert!(newest_run_above > 0, "the seals above the newest run share its keys");

    // First a cutoff below every image above the bottom run (those of round 34 and up): a
    // layer keeps each key's values from its own newest image at or below the cutoff on.
    let cutoff = 33 * 100 + 50;
    let retained: Vec<u64> = (cutoff..=last).step_by(3).chain([last]).collect();
    let before = pages(&tl, KEYS, &retained);
    let files_before = layer_files(dir.path());
    let stats = run(
        tl.begin_gc(conf(4, last - cutoff), bottom[0].layer).unwrap().unwrap(),
        Duration::from_micros(50),
    );
    assert_eq!(stats.kind, PassKind::Gc);
    assert_eq!(tl.gc_cutoff(), Lsn(cutoff));
    assert!(!stats.skipped, "{stats:?}");
    assert_eq!((stats.input_layers, stats.output_layers, stats.images_created), (1, 1, 0), "{stats:?}");
    assert!(stats.values_dropped > 0 && stats.values_written > 0, "{stats:?}");
    assert_eq!(stats.values_dropped + stats.values_written, stats.input_values, "{stats:?}");
    assert!(stats.garbage_bytes * 4 >= stats.bytes_before, "{stats:?}");
    assert_eq!(stats.files_deleted, 1, "{stats:?}");
    assert_eq!(pages(&tl, KEYS, &retained), before);
    assert!(matches!(
        tl.get_reconstruct_data(key(0), Lsn(cutoff - 1), NO_LIMITS),
        Err(GetError::BelowGcCutoff { .. })
    ));
    // Only that layer was replaced, in its place: the runs are as they were.
    let files = layer_files(dir.path());
    let gone: Vec<&String> = files_before.iter().filter(|n| !files.contains(n)).collect();
    assert_eq!(gone.len(), 1, "{gone:?}");
    assert_eq!(tl.backlog().runs, 2);
    assert_eq!(check_listed_layers(dir.path()), files.len());
    for l in &bottom[1..] {
        run(tl.begin_gc(conf(4, last - cutoff), l.layer).unwrap().unwrap(), Duration::from_micros(50));
    }
    assert_eq!(pages(&tl, KEYS, &retained), before);

    // Then a cutoff above the even keys' images of round 44: every value of an even key in
    // the bottom run goes, every value of an odd key stays (no image anywhere: the whole
    // chain is needed).
    let cutoff = 45 * 100;
    let retained: Vec<u64> = (cutoff..=last).step_by(3).chain([last]).collect();
    let before = pages(&tl, KEYS, &retained);
    let bottom: Vec<_> = tl.overwritten()[..bottom.len()].to_vec();
    let mut dropped = 0;
    for l in &bottom {
        let stats =
            run(tl.begin_gc(conf(4, last - cutoff), l.layer).unwrap().unwrap(), Duration::from_micros(50));
        // A layer of odd keys only has nothing to drop.
        assert!(stats.skipped || stats.values_dropped > 0, "{stats:?}");
        dropped += stats.values_dropped;
    }
    assert!(dropped > 0);
    assert_eq!(pages(&tl, KEYS, &retained), before);
    for k in 0..KEYS {
        let mut lsns = Vec::new();
        let all = tl.get_reconstruct_data(key(k), Lsn(last), NO_LIMITS).unwrap();
        lsns.extend(all.image.iter().map(|(l, _)| l.0));
        lsns.extend(all.records.iter().map(|(l, _)| l.0));
        if k % 2 == 0 {
            assert!(lsns[0] >= 4900, "key {k} reads from its image of round 49: {lsns:?}");
        } else {
            assert_eq!(lsns[0], u64::from(k) + 1, "key {k} keeps its whole chain: {lsns:?}");
        }
    }
    drop(tl);
    let tl = open(dir.path(), 2000, &m);
    assert_eq!(pages(&tl, KEYS, &retained), before);
    // A layer that is gone starts nothing.
    assert!(tl.begin_gc(conf(4, last - cutoff), u32::MAX).unwrap().is_none());
}

#[tokio::test]
async fn a_gc_pass_that_finds_too_little_garbage_writes_nothing_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let (last, bottom) = two_runs_with_images_above(&tl, dir.path()).await;
    let lsns: Vec<u64> = (0..=last + 1).step_by(7).chain([last]).collect();
    let before = pages(&tl, KEYS, &lsns);
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    let layers = layer_files(dir.path());
    // No GC horizon: nothing is below the cutoff, so nothing is garbage.
    let stats = run(tl.begin_gc(conf(4, u64::MAX), bottom[0].layer).unwrap().unwrap(), Duration::ZERO);
    assert!(stats.skipped, "{stats:?}");
    assert_eq!((stats.garbage_bytes, stats.bytes_written, stats.values_read), (0, 0, 0), "{stats:?}");
    assert_eq!(layer_files(dir.path()), layers);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), files, "no file left behind");
    assert_eq!(pages(&tl, KEYS, &lsns), before);
    // The pass's intent stays recorded; the next pass and a reopen go on as usual.
    let stats = run(tl.begin_compaction(conf(4, u64::MAX)).unwrap().unwrap(), Duration::from_millis(1));
    assert_eq!(stats.kind, PassKind::Full);
    drop(tl);
    let tl = open(dir.path(), 2000, &m);
    assert_eq!(pages(&tl, KEYS, &lsns), before);
}

#[tokio::test]
async fn a_crash_during_a_gc_pass_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 2000, &m);
    let (last, bottom) = two_runs_with_images_above(&tl, dir.path()).await;
    let cutoff = 45 * 100;
    let retained: Vec<u64> = (cutoff..=last).step_by(3).chain([last]).collect();
    let before = pages(&tl, KEYS, &retained);
    let check = |snap: tempfile::TempDir, what: &str| {
        let m = metrics();
        let tl = open(snap.path(), 2000, &m);
        assert_eq!(pages(&tl, KEYS, &retained), before, "after a crash {what}");
        assert_eq!(layer_files(snap.path()).len() as u64, tl.stats().layers, "{what}");
        assert_eq!(check_listed_layers(snap.path()), layer_files(snap.path()).len(), "{what}");
    };
    let mut pass = tl.begin_gc(conf(4, last - cutoff), bottom[0].layer).unwrap().unwrap();
    let mut snapshots = 0;
    loop {
        // A crash after every slice: in the survey, while writing, after the install.
        match pass.run_slice(Duration::ZERO).unwrap() {
            Step::Continue => {
                check(snapshot(dir.path()), "during a GC pass");
                snapshots += 1;
            }
            Step::NeedImage(_) => panic!("a GC pass makes no images"),
            Step::Done(stats) => {
                assert!(!stats.skipped && stats.values_dropped > 0, "{stats:?}");
                break;
            }
        }
    }
    assert!(snapshots > 4, "{snapshots}");
    check(snapshot(dir.path()), "after a GC install");
}

// Branches: a timeline opened with an ancestor reads its own values over the ancestor's history
// at the branch point. The oracle is a timeline of its own holding both (flat).

/// [`fill`] with records marked `tag`, so that two timelines given the same rounds differ.
async fn fill_as(tl: &Timeline, tag: char, from_round: u64, rounds: u64) -> u64 {
    let mut last = 0;
    for round in from_round..from_round + rounds {
        let values = (0..KEYS)
            .map(|k| {
                last = round * 100 + u64::from(k) + 1;
                (key(k), last, record(&format!("{tag}k{k}r{round}")))
            })
            .collect();
        tl.ingest(batch(values)).await.unwrap();
    }
    last
}

fn branch(
    dir: &std::path::Path,
    m: &std::sync::Arc<crate::storage::StorageMetrics>,
    of: &std::sync::Arc<Timeline>,
    lsn: u64,
) -> std::sync::Arc<Timeline> {
    let ancestor = crate::storage::Ancestor { timeline: std::sync::Arc::clone(of), lsn: Lsn(lsn) };
    Timeline::open_branch(
        dir,
        crate::storage::StorageConf { layer_size: 2000, ..Default::default() },
        m.clone(),
        Some(ancestor),
    )
    .unwrap()
}

/// The page of `k` at `lsn` through the daemon's path: one lookup, its plan, its read.
async fn page_via_lookup(tl: &Timeline, k: u32, lsn: u64) -> Option<Bytes> {
    match tl.lookup(key(k), Lsn(lsn), |_| None::<()>).unwrap() {
        crate::storage::Lookup::NotFound => None,
        crate::storage::Lookup::Cached { .. } => unreachable!("nothing is cached"),
        crate::storage::Lookup::Read(start) => {
            let plan = tl.plan_read_from(start, NO_LIMITS).await.unwrap();
            Some(toy_redo(&tl.read_planned(plan).await.unwrap()))
        }
    }
}

#[tokio::test]
async fn a_branch_reads_its_ancestor_below_its_point_and_its_own_writes_above_and_gc_keeps_the_point() {
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let m = metrics();
    let (parent, flat) = (open(dirs[0].path(), 2000, &m), open(dirs[1].path(), 2000, &m));
    let point = fill(&parent, 0, 11).await;
    fill(&flat, 0, 11).await;
    parent.freeze().await.unwrap();
    let child = branch(dirs[2].path(), &m, &parent, point);
    assert_eq!(child.last_durable_lsn(), Lsn(point), "a branch starts at its point");
    assert_eq!(parent.branch_points(), vec![Lsn(point)]);
    // Writes go on in both, differently; the child's are above the point.
    let err = child.ingest(batch(vec![(key(0), point, record("x"))])).await.unwrap_err();
    assert!(matches!(err, crate::storage::IngestError::LsnWentBackwards { .. }), "{err}");
    let parent_last = fill(&parent, 11, 10).await;
    let parent_pages = pages(&parent, KEYS, &[point, parent_last]);
    let last = fill_as(&child, 'c', 11, 12).await;
    fill_as(&flat, 'c', 11, 12).await;
    // A key only the child has, and one only the parent has after the point.
    child.ingest(batch(vec![(key(KEYS), last + 1, image(7))])).await.unwrap();
    flat.ingest(batch(vec![(key(KEYS), last + 1, image(7))])).await.unwrap();
    parent.ingest(batch(vec![(key(KEYS + 1), parent_last + 1, image(8))])).await.unwrap();
    let last = last + 1;
    let lsns: Vec<u64> = (0..=last).step_by(97).chain([point, point + 1, last]).collect();
    let want = pages(&flat, KEYS + 2, &lsns);
    assert_eq!(pages(&child, KEYS + 2, &lsns), want);
    assert_eq!(pages(&parent, KEYS, &[point, parent_last]), parent_pages, "the parent is untouched");
    for (k, lsn) in [(0, point), (3, last), (KEYS, last), (KEYS + 1, last), (5, 388)] {
        assert_eq!(
            page_via_lookup(&child, k, lsn).await,
            want[&(k, lsn)].clone().unwrap(),
            "key {k} at {lsn}"
        );
    }
    assert_eq!(child.version_at(key(KEYS + 1), Lsn(last), DiskWait::Allowed).unwrap(), None);
    assert_eq!(
        child.version_at(key(1), Lsn(point + 5), DiskWait::Allowed).unwrap(),
        Some(Lsn(point - KEYS as u64 + 2))
    );
    let keys: Vec<u32> = child.keyspace().unwrap().iter().map(|(k, _)| k.blknum).collect();
    assert_eq!(
        keys,
        (0..=KEYS).collect::<Vec<_>>(),
        "the parent's key made after the point is not the child's"
    );

    // GC on the parent with no horizon stops at the branch point, and the child reads on.
    let parent_retained: Vec<u64> = vec![point, point + 50, parent_last];
    let parent_pages = pages(&parent, KEYS, &parent_retained);
    parent.freeze().await.unwrap();
    let stats = run(parent.begin_compaction(conf(3, 0)).unwrap().unwrap(), Duration::from_millis(1));
    assert_eq!(parent.gc_cutoff(), Lsn(point), "{stats:?}");
    assert!(stats.values_dropped > 0, "{stats:?}");
    assert_eq!(pages(&parent, KEYS, &parent_retained), parent_pages);
    let at_or_above: Vec<u64> = lsns.iter().copied().filter(|&l| l >= point).collect();
    let want_above = pages(&flat, KEYS + 2, &at_or_above);
    assert_eq!(pages(&child, KEYS + 2, &at_or_above), want_above);
    // A branch below the cutoff is refused, naming it.
    let err = Timeline::open_branch(
        dirs[3].path(),
        crate::storage::StorageConf { layer_size: 2000, ..Default::default() },
        m.clone(),
        Some(crate::storage::Ancestor { timeline: std::sync::Arc::clone(&parent), lsn: Lsn(point - 1) }),
    )
    .err()
    .unwrap();
    assert!(matches!(err.downcast_ref::<GetError>(), Some(GetError::BelowGcCutoff { .. })), "{err:#}");
    assert_eq!(parent.branch_points(), vec![Lsn(point)]);

    // The child's compaction images its chains from the parent's page at the point.
    child.freeze().await.unwrap();
    let stats = run(child.begin_compaction(conf(3, u64::MAX)).unwrap().unwrap(), Duration::from_millis(1));
    assert_eq!(stats.images_created, u64::from(KEYS), "{stats:?}");
    assert_eq!(pages(&child, KEYS + 2, &at_or_above), want_above);
    let d = child.get_reconstruct_data(key(3), Lsn(last), NO_LIMITS).unwrap();
    assert!(d.image.is_some() && d.records.is_empty(), "one image of the child's own");

    // Reopened (the parent first), the same; dropped, the point is let go.
    drop(child);
    assert!(parent.branch_points().is_empty());
    let child = branch(dirs[2].path(), &m, &parent, point);
    assert_eq!(pages(&child, KEYS + 2, &at_or_above), want_above);
    drop(child);
    parent.ingest(batch(vec![(key(0), parent_last + 10, image(1))])).await.unwrap();
    parent.freeze().await.unwrap();
    run(parent.begin_compaction(conf(3, 0)).unwrap().unwrap(), Duration::from_millis(1));
    assert!(parent.gc_cutoff() > Lsn(point), "without the branch, GC goes on: {}", parent.gc_cutoff());
}

#[tokio::test]
async fn a_branch_of_a_branch_reads_three_levels() {
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let m = metrics();
    let (root, flat) = (open(dirs[0].path(), 2000, &m), open(dirs[1].path(), 2000, &m));
    let p1 = fill(&root, 0, 5).await;
    fill(&flat, 0, 5).await;
    let mid = branch(dirs[2].path(), &m, &root, p1);
    let p2 = fill_as(&mid, 'm', 5, 5).await;
    fill_as(&flat, 'm', 5, 5).await;
    fill_as(&root, 'r', 5, 9).await;
    let leaf = branch(dirs[3].path(), &m, &mid, p2);
    let last = fill_as(&leaf, 'l', 10, 4).await;
    fill_as(&flat, 'l', 10, 4).await;
    fill_as(&mid, 'n', 10, 2).await;
    let lsns: Vec<u64> = (0..=last).step_by(53).chain([p1, p2, last]).collect();
    assert_eq!(pages(&leaf, KEYS, &lsns), pages(&flat, KEYS, &lsns));
    for (k, lsn) in [(1, p1), (2, p2), (4, last), (6, 30)] {
        let want = pages(&flat, KEYS, &[lsn])[&(k, lsn)].clone().unwrap();
        assert_eq!(page_via_lookup(&leaf, k, lsn).await, want, "key {k} at {lsn}");
    }
}
