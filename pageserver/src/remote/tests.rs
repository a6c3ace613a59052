//! The uploader, generations, attach and on-demand downloads on `object_store`'s in-memory
//! store.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::memory::InMemory;
use object_store::ObjectStore;
use page_types::{BufferTag, Lsn};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::storage::{
    CompactionConf, IngestBatch, PassKind, ReadLimits, Step, StorageConf, StorageMetrics, Timeline, Value,
};

fn storage_with(store: Arc<dyn ObjectStore>) -> Arc<RemoteStorage> {
    Arc::new(RemoteStorage::with_store(store, "pfx", Arc::new(RemoteMetrics::unregistered())))
}

fn key(blk: u32) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 1, relnode: 1, forknum: 0, blknum: blk }
}

fn page(fill: u8) -> Value {
    Value::Image(Bytes::from(vec![fill; page_types::PAGE_SIZE]))
}

async fn open(dir: &std::path::Path) -> Arc<Timeline> {
    open_fetching(dir, None).await
}

/// [`open`] with the bucket of `storage` as the source of the layers not on local disk (as
/// `main` of tenant `t1`).
async fn open_fetching(dir: &std::path::Path, storage: Option<&Arc<RemoteStorage>>) -> Arc<Timeline> {
    let dir = dir.to_path_buf();
    let source = storage.map(|s| {
        let fetcher = LayerFetcher::new(s, "t1", "main", tokio::runtime::Handle::current());
        crate::storage::SourceRef(Arc::new(fetcher))
    });
    tokio::task::spawn_blocking(move || {
        let conf = StorageConf { layer_size: 64 << 10, source };
        Timeline::open(&dir, conf, Arc::new(StorageMetrics::unregistered()))
    })
    .await
    .unwrap()
    .unwrap()
}

/// Ingests `n` batches of 4 pages at LSNs from `first` on.
async fn ingest(t: &Timeline, first: u64, n: u64, fill: u8) {
    for i in 0..n {
        let lsn = Lsn(first + i);
        let values = (0..4).map(|b| (key(b), lsn, page(fill))).collect();
        t.ingest(IngestBatch { values }).await.unwrap();
    }
}

/// A full compaction pass (the values are images: no redo).
async fn compact_fully(t: &Arc<Timeline>) {
    t.freeze().await.unwrap();
    let t = Arc::clone(t);
    tokio::task::spawn_blocking(move || {
        let conf =
            CompactionConf { image_threshold: 10, image_bytes: 0, gc_horizon: 0, layer_size: 64 << 10 };
        let mut pass = t.begin_pass(conf, PassKind::Full).unwrap().unwrap();
        loop {
            match pass.run_slice(Duration::from_millis(50)).unwrap() {
                Step::Done(_) => break,
                Step::Continue => {}
                Step::NeedImage(_) => panic!("images only: nothing to redo"),
            }
        }
    })
    .await
    .unwrap();
}

/// The newest image of `key` at `lsn` (they are all images).
fn page_at(t: &Timeline, key: BufferTag, lsn: Lsn) -> Option<Bytes> {
    let limits = ReadLimits { max_records: 1000, max_bytes: 1 << 30 };
    t.get_reconstruct_data(key, lsn, limits).ok().and_then(|d| d.image.map(|(_, b)| b))
}

/// Waits until `condition` holds, at most `within`.
async fn wait_until<F, Fut>(within: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + within;
    while !condition().await {
        assert!(std::time::Instant::now() < deadline, "timed out");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A bucket in memory and a timeline (tenant `t1`) with its directory.
struct Setup {
    store: Arc<dyn ObjectStore>,
    storage: Arc<RemoteStorage>,
    dir: tempfile::TempDir,
    t: Arc<Timeline>,
}

async fn setup() -> Setup {
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let storage = storage_with(Arc::clone(&store));
    let dir = tempfile::tempdir().unwrap();
    let t = open(&dir.path().join("timeline")).await;
    Setup { store, storage, dir, t }
}

/// The uploader of `t` as `main` of tenant `t1` (a new generation), with a fixed metadata.
fn start_uploader(
    storage: &Arc<RemoteStorage>,
    t: &Arc<Timeline>,
    meta_dir: &std::path::Path,
) -> Arc<RemoteTimeline> {
    let metadata: MetadataFn =
        Arc::new(|_, _| Some(TimelineMetadata { tenant_conf: "x = 1\n".into(), ..Default::default() }));
    start_uploader_with(storage, t, meta_dir, metadata, Duration::from_millis(200))
}

/// [`start_uploader`] with this metadata and seal timer.
fn start_uploader_with(
    storage: &Arc<RemoteStorage>,
    t: &Arc<Timeline>,
    meta_dir: &std::path::Path,
    metadata: MetadataFn,
    checkpoint_timeout: Duration,
) -> Arc<RemoteTimeline> {
    let tenant = RemoteTenant::new(Arc::clone(storage), "t1", meta_dir, "node-a", None);
    RemoteTimeline::start(
        Uploader {
            tenant,
            timeline_id: "main".into(),
            timeline: Arc::clone(t),
            meta_dir: meta_dir.to_path_buf(),
            metadata,
            checkpoint_timeout,
        },
        CancellationToken::new(),
    )
}

async fn objects(store: &Arc<dyn ObjectStore>) -> Vec<String> {
    use futures_util::StreamExt;
    let mut out: Vec<String> = store.list(None).map(|m| m.unwrap().location.to_string()).collect().await;
    out.sort();
    out
}

#[tokio::test]
async fn generations_are_taken_one_above_the_highest_and_never_twice() {
    let storage = storage_with(Arc::new(InMemory::new()));
    assert_eq!(storage.current_generation("t").await.unwrap(), None);
    assert_eq!(storage.take_generation("t", "a").await.unwrap(), Generation(1));
    assert_eq!(storage.take_generation("t", "b").await.unwrap(), Generation(2));
    assert_eq!(storage.current_generation("t").await.unwrap(), Some(Generation(2)));
    // Ten nodes at once: ten distinct generations.
    let mut takes = Vec::new();
    for i in 0..10 {
        let s = Arc::clone(&storage);
        takes.push(tokio::spawn(async move { s.take_generation("t", &format!("n{i}")).await.unwrap() }));
    }
    let mut got: Vec<u32> = Vec::new();
    for t in takes {
        got.push(t.await.unwrap().0);
    }
    got.sort();
    assert_eq!(got, (3..13).collect::<Vec<_>>());
    assert_eq!(storage.current_generation("other").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_follow_seals_and_compaction_and_an_attached_copy_serves_the_same_pages() {
    let Setup { store, storage, dir, t } = setup().await;
    let up = start_uploader(&storage, &t, dir.path());
    // Nine layers' worth (64 KiB each) and a tail in the active segment.
    ingest(&t, 10, 20, 1).await;
    ingest(&t, 100, 3, 2).await;
    let durable = t.last_durable_lsn();
    // The tail is sealed by the checkpoint timer and uploaded.
    up.wait_uploaded(durable, Duration::from_secs(20)).await.unwrap();
    let status = up.status();
    assert_eq!(status.generation.as_deref(), Some("00000001"));
    assert_eq!(read_generation_file(dir.path()).unwrap(), Some(Generation(1)));
    let (g, index) = storage.newest_index("t1", "main").await.unwrap().unwrap();
    assert_eq!(g, Generation(1));
    assert_eq!(index.disk_consistent_lsn, durable);
    assert_eq!(index.metadata.tenant_conf, "x = 1\n");
    let listed: Vec<String> = t.layer_files().layers.iter().map(|l| l.name.clone()).collect();
    assert_eq!(index.layers.iter().map(|l| l.name.clone()).collect::<Vec<_>>(), listed);
    for l in &index.layers {
        assert!(objects(&store)
            .await
            .contains(&format!("pfx/tenants/t1/timelines/main/{}-00000001", l.name)));
    }

    // A full compaction replaces the layers: the new index lists the outputs, and the inputs'
    // objects are deleted once it is uploaded.
    let before: Vec<String> = index.layers.iter().map(|l| l.name.clone()).collect();
    compact_fully(&t).await;
    let after: Vec<String> = t.layer_files().layers.iter().map(|l| l.name.clone()).collect();
    assert_ne!(after, before);
    wait_until(Duration::from_secs(20), || async {
        let objs = objects(&store).await;
        let layers: Vec<&String> = objs.iter().filter(|o| o.contains("/layer_")).collect();
        layers.len() == after.len()
            && after.iter().all(|a| objs.iter().any(|o| o.contains(a.as_str())))
            // The queue is emptied (and the count lowered) after the objects are gone.
            && up.status().queued_deletions == 0
    })
    .await;
    assert!(
        !dir.path().join(upload::DELETIONS_FILE).exists()
            || std::fs::read_to_string(dir.path().join(upload::DELETIONS_FILE)).unwrap().contains("[]")
    );
    up.shutdown().await;

    // A timeline attached from the bucket (no layer on its disk) serves every page as the
    // original, downloading each layer the first time a read needs it.
    let (g, index) = storage.newest_index("t1", "main").await.unwrap().unwrap();
    let copy_dir = tempfile::tempdir().unwrap();
    let attached = AttachedTimeline { timeline_id: "main".into(), index };
    attach_timeline(
        &storage,
        "t1",
        &attached,
        &copy_dir.path().join("timeline"),
        &Arc::new(StorageMetrics::unregistered()),
    )
    .await
    .unwrap();
    assert_eq!(g, Generation(1));
    let copy = open_fetching(&copy_dir.path().join("timeline"), Some(&storage)).await;
    assert_eq!(copy.last_durable_lsn(), durable);
    assert_eq!(copy.resident_layers().len(), 0);
    for lsn in [Lsn(10), Lsn(29), Lsn(101), durable] {
        for b in 0..4 {
            assert_eq!(page_at(&copy, key(b), lsn), page_at(&t, key(b), lsn), "block {b} at {lsn}");
        }
    }
    // The copy goes on above what it copied, with names of its own.
    ingest(&copy, durable.0 + 1, 30, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_object_fails_the_attach_and_a_damaged_one_the_read_naming_it() {
    let Setup { store, storage, dir, t } = setup().await;
    let up = start_uploader(&storage, &t, dir.path());
    ingest(&t, 10, 12, 1).await;
    up.wait_uploaded(t.last_durable_lsn(), Duration::from_secs(20)).await.unwrap();
    up.shutdown().await;
    let (_, index) = storage.newest_index("t1", "main").await.unwrap().unwrap();
    let victim = &index.layers[0];
    let path = storage.layer_path("t1", "main", &victim.name, victim.generation);
    let good = store.get(&path).await.unwrap().bytes().await.unwrap();
    let attached = AttachedTimeline { timeline_id: "main".into(), index: index.clone() };
    let copy_dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(StorageMetrics::unregistered());

    store.delete(&path).await.unwrap();
    let e = format!(
        "{:#}",
        attach_timeline(&storage, "t1", &attached, &copy_dir.path().join("a"), &metrics).await.unwrap_err()
    );
    assert!(e.contains(&victim.name), "{e}");

    // Damaged, of the right size: the attach cannot tell; the read that downloads it fails,
    // naming it, and keeps nothing of it. Once the object is whole again, the read succeeds.
    let mut bytes = good.to_vec();
    bytes[100] ^= 0xff;
    store.put(&path, object_store::PutPayload::from(bytes)).await.unwrap();
    let copy_path = copy_dir.path().join("b");
    attach_timeline(&storage, "t1", &attached, &copy_path, &metrics).await.unwrap();
    let copy = open_fetching(&copy_path, Some(&storage)).await;
    let lsn = t.last_durable_lsn();
    let limits = ReadLimits { max_records: 1000, max_bytes: 1 << 30 };
    let e = copy.get_reconstruct_data(key(0), Lsn(10), limits).unwrap_err().to_string();
    let e = format!("{e} / {:#}", copy.get_reconstruct_data(key(0), Lsn(10), limits).unwrap_err());
    assert!(e.contains("crc32c") && e.contains(&victim.name), "{e}");
    assert!(!copy_path.join(&victim.name).exists());
    store.put(&path, object_store::PutPayload::from(good)).await.unwrap();
    for b in 0..4 {
        assert_eq!(page_at(&copy, key(b), lsn), page_at(&t, key(b), lsn), "block {b}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploaded_layer_evicted_is_downloaded_again_by_the_first_read() {
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let storage = storage_with(Arc::clone(&store));
    let dir = tempfile::tempdir().unwrap();
    let t = open_fetching(&dir.path().join("timeline"), Some(&storage)).await;
    let up = start_uploader(&storage, &t, dir.path());
    ingest(&t, 10, 40, 1).await;
    ingest(&t, 50, 40, 2).await;
    t.freeze().await.unwrap();
    up.wait_uploaded(t.last_durable_lsn(), Duration::from_secs(20)).await.unwrap();
    let lsns = [Lsn(20), Lsn(49), Lsn(60), t.last_durable_lsn()];
    let before: Vec<Option<Bytes>> = lsns
        .iter()
        .flat_map(|&lsn| (0..4).map(move |b| (b, lsn)))
        .map(|(b, lsn)| page_at(&t, key(b), lsn))
        .collect();
    let resident = t.resident_layers();
    assert!(resident.len() >= 2, "{resident:?}");
    for l in &resident {
        assert!(up.is_uploaded(&l.name), "{} is not in the uploaded index", l.name);
        let t = Arc::clone(&t);
        let name = l.name.clone();
        assert!(tokio::task::spawn_blocking(move || t.evict(&name)).await.unwrap().unwrap());
    }
    assert!(t.resident_layers().is_empty());
    let t2 = Arc::clone(&t);
    let after: Vec<Option<Bytes>> = tokio::task::spawn_blocking(move || {
        lsns.iter()
            .flat_map(|&lsn| (0..4).map(move |b| (b, lsn)))
            .map(|(b, lsn)| page_at(&t2, key(b), lsn))
            .collect()
    })
    .await
    .unwrap();
    assert_eq!(after, before);
    assert!(!t.resident_layers().is_empty());
    // The uploader does not upload what it evicted again, and the index still lists it.
    ingest(&t, 100, 10, 3).await;
    up.wait_uploaded(t.last_durable_lsn(), Duration::from_secs(20)).await.unwrap();
    let (_, index) = storage.newest_index("t1", "main").await.unwrap().unwrap();
    for l in &resident {
        assert!(index.layers.iter().any(|i| i.name == l.name), "{} left the index", l.name);
    }
    up.shutdown().await;
}

#[tokio::test]
async fn a_stale_generation_deletes_nothing_and_its_index_is_not_the_newest() {
    let Setup { store, storage, dir, t } = setup().await;
    let up = start_uploader(&storage, &t, dir.path());
    ingest(&t, 10, 12, 1).await;
    up.wait_uploaded(t.last_durable_lsn(), Duration::from_secs(20)).await.unwrap();
    // Another node attaches: takes generation 2 and uploads its index.
    let g2 = storage.take_generation("t1", "node-b").await.unwrap();
    let (_, mut index) = storage.newest_index("t1", "main").await.unwrap().unwrap();
    index.generation = g2;
    storage.put_index("t1", "main", &index).await.unwrap();
    let objects_then = objects(&store).await;
    // The stale node compacts: it uploads (under generation 1) but deletes nothing.
    compact_fully(&t).await;
    ingest(&t, 100, 12, 2).await;
    up.wait_uploaded(t.last_durable_lsn(), Duration::from_secs(20)).await.unwrap();
    wait_until(Duration::from_secs(20), || async { up.status().stale }).await;
    let objects_now = objects(&store).await;
    for o in &objects_then {
        assert!(objects_now.contains(o), "{o} was deleted by a stale node");
    }
    let (newest, _) = storage.newest_index("t1", "main").await.unwrap().unwrap();
    assert_eq!(newest, g2);
    assert!(up.status().queued_deletions > 0);
    up.shutdown().await;
}

#[tokio::test]
async fn a_damaged_local_layer_is_never_uploaded() {
    let Setup { store, storage, dir, t } = setup().await;
    ingest(&t, 10, 12, 1).await;
    t.freeze().await.unwrap();
    let victim = t.layer_files().layers[0].clone();
    assert!(victim.crc32c.is_some());
    let path = dir.path().join("timeline").join(&victim.name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4096] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let up = start_uploader(&storage, &t, dir.path());
    wait_until(Duration::from_secs(20), || async {
        up.status().last_error.is_some_and(|e| e.contains("damaged") && e.contains(&victim.name))
    })
    .await;
    assert!(!objects(&store).await.iter().any(|o| o.contains(&victim.name)));
    assert!(storage.newest_index("t1", "main").await.unwrap().is_none());
    up.shutdown().await;
}

#[tokio::test]
async fn a_metadata_change_alone_uploads_the_index_again() {
    let Setup { storage, dir, t, .. } = setup().await;
    ingest(&t, 10, 12, 1).await;
    let conf = Arc::new(std::sync::Mutex::new("a = 1\n".to_string()));
    let read_conf = Arc::clone(&conf);
    let metadata: MetadataFn = Arc::new(move |_, _| {
        Some(TimelineMetadata { tenant_conf: read_conf.lock().unwrap().clone(), ..Default::default() })
    });
    let up = start_uploader_with(&storage, &t, dir.path(), metadata, Duration::from_millis(100));
    up.wait_uploaded(t.last_durable_lsn(), Duration::from_secs(20)).await.unwrap();
    let conf_of_index =
        || async { storage.newest_index("t1", "main").await.unwrap().unwrap().1.metadata.tenant_conf };
    assert_eq!(conf_of_index().await, "a = 1\n");
    *conf.lock().unwrap() = "a = 2\n".to_string();
    up.metadata_changed();
    wait_until(Duration::from_secs(20), || async { conf_of_index().await == "a = 2\n" }).await;
    up.shutdown().await;
}

#[tokio::test]
async fn upload_now_seals_and_uploads_without_the_seal_timer_and_the_status_carries_the_metadata() {
    let Setup { storage, dir, t, .. } = setup().await;
    // Says which layers' end it was made for.
    let metadata: MetadataFn = Arc::new(|disk_consistent, _| {
        let tenant_conf = format!("end = {}\n", disk_consistent.0);
        Some(TimelineMetadata { tenant_conf, ..Default::default() })
    });
    let up = start_uploader_with(&storage, &t, dir.path(), metadata, Duration::from_secs(3600));
    // Half a layer: the values stay in the active segment, an hour from their seal.
    ingest(&t, 10, 1, 1).await;
    let durable = t.last_durable_lsn();
    assert!(t.holds_unsealed_values());
    assert!(up.wait_uploaded(durable, Duration::from_millis(1500)).await.is_err());
    up.upload_now();
    up.wait_uploaded(durable, Duration::from_secs(20)).await.unwrap();
    assert!(!t.holds_unsealed_values());
    let (_, index) = storage.newest_index("t1", "main").await.unwrap().unwrap();
    assert_eq!(index.metadata.tenant_conf, format!("end = {}\n", durable.0));
    assert_eq!(up.status().metadata.as_deref(), Some(&index.metadata));
    up.shutdown().await;
}
