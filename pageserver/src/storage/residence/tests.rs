//! Eviction and on-demand fetching of layers, with a directory as the source.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use page_types::Lsn;

use super::{LayerSource, SourceRef, DOWNLOAD_PREFIX};
use crate::storage::read::would_wait;
use crate::storage::test_support::*;
use crate::storage::{DiskWait, GetError, ReconstructData, StorageConf, StorageMetrics, Timeline};

/// A directory as the source of layers: copies a file, checking it as a real source does
/// (size and crc32c), after `delay`; counts the fetches of each layer. With `damage`, the copy
/// gets its last byte (the footer's checksum) flipped and is not checked (a source that lets a
/// damaged layer through: opening it fails).
#[derive(Default)]
struct DirSource {
    bucket: PathBuf,
    delay: Duration,
    damage: AtomicBool,
    fetches: Mutex<BTreeMap<String, usize>>,
}

impl LayerSource for DirSource {
    fn fetch(&self, dir: &Path, name: &str, size: u64, crc32c: Option<u32>) -> anyhow::Result<()> {
        *self.fetches.lock().unwrap().entry(name.to_string()).or_default() += 1;
        std::thread::sleep(self.delay);
        let mut bytes = std::fs::read(self.bucket.join(name))?;
        if self.damage.load(Ordering::Relaxed) {
            let end = bytes.len() - 1;
            bytes[end] ^= 0xff;
        } else {
            anyhow::ensure!(bytes.len() as u64 == size, "{name}: {} bytes, {size} listed", bytes.len());
            anyhow::ensure!(crc32c.is_none_or(|c| c == crc32c::crc32c(&bytes)), "{name}: crc32c mismatch");
        }
        let tmp = dir.join(format!("{DOWNLOAD_PREFIX}{name}"));
        std::fs::write(&tmp, &bytes)?;
        std::fs::File::open(&tmp)?.sync_all()?;
        std::fs::rename(&tmp, dir.join(name))?;
        Ok(())
    }
}

impl DirSource {
    fn fetches(&self) -> BTreeMap<String, usize> {
        self.fetches.lock().unwrap().clone()
    }
}

const LAYER_SIZE: u64 = 2000;
const KEYS: u32 = 12;

fn open_with(dir: &Path, source: &Arc<DirSource>, m: &Arc<StorageMetrics>) -> Arc<Timeline> {
    let conf = StorageConf {
        layer_size: LAYER_SIZE,
        source: Some(SourceRef(Arc::clone(source) as Arc<dyn LayerSource>)),
    };
    Timeline::open(dir, conf, Arc::clone(m)).unwrap()
}

/// Ingests `rounds` rounds of a record per key (an image every fourth round), then seals;
/// copies every layer file into `bucket` (what an upload does). Returns the last LSN.
async fn fill(tl: &Timeline, bucket: &Path, rounds: u64) -> u64 {
    let mut last = 0;
    for round in 0..rounds {
        let values = (0..KEYS)
            .map(|k| {
                last = round * 100 + u64::from(k) + 1;
                let v = if round % 4 == 0 { image(round as u8) } else { record(&format!("k{k}r{round}")) };
                (key(k), last, v)
            })
            .collect();
        tl.ingest(batch(values)).await.unwrap();
    }
    tl.freeze().await.unwrap();
    std::fs::create_dir_all(bucket).unwrap();
    for l in tl.layer_files().layers {
        std::fs::copy(tl.dir().join(&l.name), bucket.join(&l.name)).unwrap();
    }
    last
}

/// A timeline filled by `rounds` rounds ([`fill`]), its layers also in a bucket directory that
/// `source` (made of the bucket's path) fetches from. A test binds `dir` and `_bucket` (a field
/// left to `..` is dropped at once, and its directory with it).
struct Filled {
    dir: tempfile::TempDir,
    _bucket: tempfile::TempDir,
    m: Arc<StorageMetrics>,
    source: Arc<DirSource>,
    tl: Arc<Timeline>,
    last: u64,
}

async fn filled(rounds: u64, source: impl FnOnce(&Path) -> DirSource) -> Filled {
    let (dir, bucket) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (m, source) = (metrics(), Arc::new(source(bucket.path())));
    let tl = open_with(dir.path(), &source, &m);
    let last = fill(&tl, bucket.path(), rounds).await;
    Filled { dir, _bucket: bucket, m, source, tl, last }
}

fn plain(bucket: &Path) -> DirSource {
    DirSource { bucket: bucket.to_path_buf(), ..DirSource::default() }
}

/// What the timeline holds of every key at a few LSNs.
fn pages(tl: &Timeline, last: u64) -> BTreeMap<(u32, u64), Result<ReconstructData, String>> {
    let mut out = BTreeMap::new();
    for k in 0..KEYS {
        for lsn in [150, last / 2, last] {
            out.insert(
                (k, lsn),
                tl.get_reconstruct_data(key(k), Lsn(lsn), NO_LIMITS).map_err(|e| e.to_string()),
            );
        }
    }
    out
}

/// Evicts every resident layer; returns how many.
fn evict_all(tl: &Timeline) -> usize {
    let resident = tl.resident_layers();
    assert!(resident.iter().all(|l| l.evictable), "{resident:?}");
    resident.iter().filter(|l| tl.evict(&l.name).unwrap()).count()
}

fn layer_files_on_disk(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".layer"))
        .count()
}

#[tokio::test]
async fn evicted_layers_are_deleted_and_the_first_read_fetches_them_back_answering_as_before() {
    let Filled { dir, _bucket, m, source, tl, last, .. } = filled(24, plain).await;
    let before = pages(&tl, last);
    let layers = tl.layer_files().layers.len();
    assert!(layers > 4, "{layers}");

    assert_eq!(evict_all(&tl), layers);
    assert_eq!(layer_files_on_disk(dir.path()), 0);
    assert!(tl.resident_layers().is_empty());
    assert_eq!(m.layer_evictions.get(), layers as u64);
    // A read that may not wait for the disk does not wait for a download either.
    let refused = tl.version_at(key(1), Lsn(last), DiskWait::Refused).unwrap_err();
    assert!(would_wait(&refused), "{refused}");
    assert!(source.fetches().is_empty());

    assert_eq!(pages(&tl, last), before);
    let fetches = source.fetches();
    assert!(!fetches.is_empty() && fetches.values().all(|&n| n == 1), "{fetches:?}");
    assert_eq!(tl.resident_layers().len(), fetches.len());
    assert_eq!(layer_files_on_disk(dir.path()), fetches.len());
    assert_eq!(m.layer_downloads.get(), fetches.len() as u64);
    // Resident again: read without fetching.
    assert_eq!(pages(&tl, last), before);
    assert_eq!(source.fetches(), fetches);
}

#[tokio::test]
async fn concurrent_readers_of_an_evicted_layer_share_one_download() {
    let Filled { dir: _dir, _bucket, source, tl, last, .. } =
        filled(12, |bucket| DirSource { delay: Duration::from_millis(200), ..plain(bucket) }).await;
    let expected = tl.get_reconstruct_data(key(3), Lsn(last), NO_LIMITS).unwrap();
    evict_all(&tl);
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let tl = Arc::clone(&tl);
            std::thread::spawn(move || tl.get_reconstruct_data(key(3), Lsn(last), NO_LIMITS).unwrap())
        })
        .collect();
    for r in readers {
        assert_eq!(r.join().unwrap(), expected);
    }
    let fetches = source.fetches();
    assert!(!fetches.is_empty() && fetches.values().all(|&n| n == 1), "{fetches:?}");
}

#[tokio::test]
async fn a_reopened_timeline_takes_missing_layers_as_evicted_and_without_a_source_names_them() {
    let Filled { dir, _bucket, m, source, tl, last, .. } = filled(16, plain).await;
    let before = pages(&tl, last);
    let layers = tl.layer_files().layers.len();
    evict_all(&tl);
    tl.shutdown().await;
    drop(tl);

    let err = Timeline::open(
        dir.path(),
        StorageConf { layer_size: LAYER_SIZE, ..Default::default() },
        Arc::clone(&m),
    )
    .err()
    .unwrap();
    assert!(format!("{err:#}").contains("listed in manifest.json is missing"), "{err:#}");

    // A download interrupted by the crash is removed at open.
    std::fs::write(dir.path().join(format!("{DOWNLOAD_PREFIX}junk")), b"half").unwrap();
    let tl = open_with(dir.path(), &source, &m);
    assert!(!dir.path().join(format!("{DOWNLOAD_PREFIX}junk")).exists());
    assert!(tl.resident_layers().is_empty());
    assert_eq!(tl.stats().layers, layers as u64);
    assert_eq!(pages(&tl, last), before);
}

#[tokio::test]
async fn a_damaged_download_fails_the_read_naming_the_layer_and_is_not_kept() {
    let Filled { dir, _bucket, source, tl, last, .. } = filled(8, plain).await;
    let expected = tl.get_reconstruct_data(key(2), Lsn(last), NO_LIMITS).unwrap();
    evict_all(&tl);
    source.damage.store(true, Ordering::Relaxed);
    let err = tl.get_reconstruct_data(key(2), Lsn(last), NO_LIMITS).unwrap_err();
    let GetError::Io(e) = &err else { panic!("{err}") };
    let text = format!("{e:#}");
    let fetched = source.fetches().into_keys().next().unwrap();
    assert!(text.contains(&fetched) && text.contains("download"), "{text}");
    assert_eq!(layer_files_on_disk(dir.path()), 0, "a damaged layer file was kept");
    source.damage.store(false, Ordering::Relaxed);
    assert_eq!(tl.get_reconstruct_data(key(2), Lsn(last), NO_LIMITS).unwrap(), expected);
}

/// A full compaction pass (no image made: a pass that cannot get one skips it), with `busy`
/// (a file name) made impossible to delete meanwhile; returns the pass's inputs.
fn compact(tl: &Timeline, busy: Option<&str>) -> Vec<String> {
    let conf = crate::storage::CompactionConf {
        image_threshold: 3,
        image_bytes: 0,
        gc_horizon: u64::MAX,
        layer_size: LAYER_SIZE,
    };
    let inputs: Vec<String> = tl.layer_files().layers.into_iter().map(|l| l.name).collect();
    let mut pass = tl.begin_compaction(conf).unwrap().unwrap();
    let _busy = busy.map(|name| BindMount::over(&tl.dir().join(name)));
    loop {
        match pass.run_slice(Duration::from_millis(10)).unwrap() {
            crate::storage::Step::Done(_) => return inputs,
            crate::storage::Step::NeedImage(req) => {
                let _ = req.read().unwrap();
                pass.provide_image(None)
            }
            crate::storage::Step::Continue => {}
        }
    }
}

#[tokio::test]
async fn compaction_inputs_left_to_delete_are_kept_at_open_while_a_listed_layer_is_evicted() {
    let Filled { dir, _bucket, m, source, tl, last } = filled(24, plain).await;
    let before = pages(&tl, last);
    let victim = tl.layer_files().layers[0].name.clone();
    // The pass installs its outputs; one input cannot be deleted and stays to be deleted.
    let inputs = compact(&tl, Some(&victim));
    assert!(inputs.contains(&victim) && dir.path().join(&victim).exists());
    for l in tl.layer_files().layers {
        std::fs::copy(dir.path().join(&l.name), source.bucket.join(&l.name)).unwrap();
    }
    assert!(evict_all(&tl) > 0);
    tl.shutdown().await;
    drop(tl);
    let manifest = crate::storage::manifest::read(dir.path()).unwrap().unwrap();
    assert_eq!(manifest.deleting, vec![victim.clone()]);

    // Without a source the open fails, keeping the input that holds the missing layers' data.
    let conf = StorageConf { layer_size: LAYER_SIZE, ..Default::default() };
    let err = format!("{:#}", Timeline::open(dir.path(), conf, Arc::clone(&m)).err().unwrap());
    assert!(err.contains("is missing") && err.contains(&victim), "{err}");
    // With it, the open takes the missing layers as evicted and keeps the input, still to delete.
    let tl = open_with(dir.path(), &source, &m);
    assert!(dir.path().join(&victim).exists());
    assert_eq!(pages(&tl, last), before);
    let manifest = crate::storage::manifest::read(dir.path()).unwrap().unwrap();
    assert_eq!(manifest.deleting, vec![victim.clone()]);
}

#[tokio::test]
async fn compaction_reads_evicted_inputs_and_ingest_can_be_refused() {
    let Filled { dir: _dir, _bucket, source, tl, last, .. } = filled(24, plain).await;
    let before = pages(&tl, last);
    evict_all(&tl);
    compact(&tl, None);
    assert!(!source.fetches().is_empty());
    assert_eq!(pages(&tl, last), before);

    tl.refuse_ingest(Some("local disk bound reached".into()));
    let err = tl.ingest(batch(vec![(key(1), last + 1, record("x"))])).await.unwrap_err();
    assert!(err.to_string().contains("local disk bound reached"), "{err}");
    tl.refuse_ingest(None);
    assert_eq!(tl.ingest(batch(vec![(key(1), last + 1, record("x"))])).await.unwrap(), Lsn(last + 1));
}

#[tokio::test]
async fn reads_racing_evictions_always_answer_as_before() {
    let Filled { dir: _dir, _bucket, tl, last, .. } = filled(16, plain).await;
    let before = Arc::new(pages(&tl, last));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (tl, before, stop) = (Arc::clone(&tl), Arc::clone(&before), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut rounds = 0;
                while !stop.load(Ordering::Relaxed) || rounds == 0 {
                    assert_eq!(pages(&tl, last), *before);
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    let mut evicted = 0;
    for _ in 0..30 {
        evicted += evict_all(&tl);
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    assert!(evicted > tl.layer_files().layers.len(), "{evicted}");
    assert_eq!(pages(&tl, last), *before);
}
