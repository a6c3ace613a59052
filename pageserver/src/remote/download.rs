//! What a node reads of the bucket: at attach, the layers an index lists, checked to be there
//! ([`attach_timeline`]: a new timeline directory whose layers are all non-resident); later,
//! one layer at a time as reads need it ([`LayerFetcher`], the timeline's storage source), each
//! checked against the index's size and crc32c before it takes its name.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use futures_util::StreamExt;
use object_store::ObjectStoreExt;
use tokio::io::AsyncWriteExt;

use super::index::{IndexLayer, IndexPart};
use super::{Generation, RemoteStorage};
use crate::storage::{self, LayerSource, StorageMetrics, DOWNLOAD_PREFIX};
use crate::util::lock;

/// A timeline found in the bucket: its id and its newest index.
#[derive(Debug, Clone)]
pub struct AttachedTimeline {
    pub timeline_id: String,
    pub index: IndexPart,
}

/// Makes `dir` (created; it must not exist) a timeline directory holding the layers `index`
/// lists as non-resident ([`storage::create_from_copy`] with no file): reads fetch them
/// ([`LayerFetcher`]). Each listed object is checked to be in the bucket with its listed size
/// (HEAD requests, [`CHECK_CONCURRENCY`] at once): one missing or of another size fails it,
/// naming the object; the caller removes `dir`. A damaged object of the right size is found
/// when a read fetches it (its crc32c), and fails that read.
pub async fn attach_timeline(
    storage: &Arc<RemoteStorage>,
    tenant: &str,
    timeline: &AttachedTimeline,
    dir: &Path,
    metrics: &Arc<StorageMetrics>,
) -> anyhow::Result<()> {
    tokio::fs::create_dir_all(dir).await.with_context(|| format!("create {}", dir.display()))?;
    // Owned futures: a stream of futures borrowing the caller's values makes the attach
    // future fail the compiler's higher-ranked `Send` check in the HTTP handler.
    let checks = timeline.index.layers.iter().map(|layer| {
        let (storage, layer) = (Arc::clone(storage), layer.clone());
        let path = storage.layer_path(tenant, &timeline.timeline_id, &layer.name, layer.generation);
        async move {
            let head =
                storage.store().head(&path).await.with_context(|| format!("object {path} of the index"))?;
            anyhow::ensure!(
                head.size == layer.size,
                "object {path} has {} bytes, the index lists {}",
                head.size,
                layer.size
            );
            Ok(())
        }
    });
    let mut checks =
        futures_util::stream::iter(checks.collect::<Vec<_>>()).buffer_unordered(CHECK_CONCURRENCY);
    while let Some(done) = checks.next().await {
        done?;
    }
    drop(checks);
    let (dir, files, metrics) = (dir.to_path_buf(), timeline.index.layer_files(), Arc::clone(metrics));
    tokio::task::spawn_blocking(move || {
        storage::fsync_dir(&dir)?;
        storage::create_from_copy(&dir, &files, &metrics)
    })
    .await
    .context("write the attached timeline's manifest")?
}

/// Objects one attach checks at once.
const CHECK_CONCURRENCY: usize = 16;

/// The source of a timeline's layers that are not on local disk: downloads one from the bucket
/// (the object its newest index lists; another generation's of the same name and bytes if that
/// index no longer lists it), checked against size and crc32c. The download runs on the
/// runtime it was made on; the caller (a blocking thread) waits for it.
pub struct LayerFetcher {
    storage: Arc<RemoteStorage>,
    tenant: String,
    timeline: String,
    runtime: tokio::runtime::Handle,
    /// The layers of the newest index read, by name.
    known: Arc<Mutex<BTreeMap<String, IndexLayer>>>,
}

impl LayerFetcher {
    /// The source of timeline `timeline` of `tenant`; downloads run on `runtime`.
    pub fn new(
        storage: &Arc<RemoteStorage>,
        tenant: &str,
        timeline: &str,
        runtime: tokio::runtime::Handle,
    ) -> Self {
        LayerFetcher {
            storage: Arc::clone(storage),
            tenant: tenant.to_string(),
            timeline: timeline.to_string(),
            runtime,
            known: Arc::default(),
        }
    }
}

impl LayerSource for LayerFetcher {
    fn fetch(&self, dir: &Path, name: &str, size: u64, crc32c: Option<u32>) -> anyhow::Result<()> {
        let (storage, tenant, timeline) =
            (Arc::clone(&self.storage), self.tenant.clone(), self.timeline.clone());
        let (known, dir, name) = (Arc::clone(&self.known), dir.to_path_buf(), name.to_string());
        let (tx, rx) = std::sync::mpsc::channel();
        self.runtime.spawn(async move {
            let fetched = async {
                let layer = find_object(&storage, &tenant, &timeline, &known, &name, size, crc32c).await?;
                download_layer(&storage, &tenant, &timeline, &layer, &dir).await
            };
            let _ = tx.send(fetched.await);
        });
        let wait = || rx.recv();
        // On a worker of the runtime (a read that may wait on the executor), the worker's other
        // tasks move to another thread while this one waits.
        let answer = match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(wait),
            _ => wait(),
        };
        answer.context("the download task ended without an answer (the runtime is shutting down)")?
    }
}

/// The object of layer `name` with this size (and crc32c, where the manifest has one): the one
/// the newest index lists (read again when the last one read does not list it), else one of
/// another generation found by listing the timeline's objects.
async fn find_object(
    storage: &RemoteStorage,
    tenant: &str,
    timeline: &str,
    known: &Mutex<BTreeMap<String, IndexLayer>>,
    name: &str,
    size: u64,
    crc32c: Option<u32>,
) -> anyhow::Result<IndexLayer> {
    let matches = |l: &IndexLayer| l.size == size && crc32c.is_none_or(|c| c == l.crc32c);
    if let Some(l) = lock(known).get(name).filter(|l| matches(l)) {
        return Ok(l.clone());
    }
    if let Some((_, index)) = storage.newest_index(tenant, timeline).await? {
        *lock(known) = index.layers.iter().map(|l| (l.name.clone(), l.clone())).collect();
    }
    if let Some(l) = lock(known).get(name).filter(|l| matches(l)) {
        return Ok(l.clone());
    }
    // Not in the newest index (another node compacted it away, or this node's own index was
    // not read yet): any generation's object of this name, newest first; the download checks it.
    let prefix = format!("{name}-");
    let mut generations: Vec<Generation> = storage
        .list_names(&storage.timeline_path(tenant, timeline))
        .await?
        .iter()
        .filter_map(|n| Generation::parse(n.strip_prefix(&prefix)?))
        .collect();
    generations.sort();
    let generation = generations.pop().with_context(|| {
        format!(
            "layer {name} is in neither the local disk nor the bucket (tenant {tenant}, timeline {timeline})"
        )
    })?;
    let crc32c = crc32c.context("the manifest lists no crc32c for it to be checked against")?;
    Ok(IndexLayer {
        name: name.to_string(),
        generation,
        size,
        crc32c,
        first_lsn: Default::default(),
        last_lsn: Default::default(),
    })
}

/// Downloads one layer into `dir`: a temporary name, checked against the index (size,
/// crc32c), fsynced, renamed.
async fn download_layer(
    storage: &RemoteStorage,
    tenant: &str,
    timeline_id: &str,
    layer: &IndexLayer,
    dir: &Path,
) -> anyhow::Result<()> {
    let path = storage.layer_path(tenant, timeline_id, &layer.name, layer.generation);
    let tmp = dir.join(format!("{DOWNLOAD_PREFIX}{}", layer.name));
    let got = storage.store().get(&path).await.with_context(|| format!("download {path}"))?;
    let mut file =
        tokio::fs::File::create(&tmp).await.with_context(|| format!("create {}", tmp.display()))?;
    let mut stream = got.into_stream();
    let (mut crc, mut len) = (0u32, 0u64);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.with_context(|| format!("download {path}"))?;
        crc = crc32c::crc32c_append(crc, &chunk);
        len += chunk.len() as u64;
        anyhow::ensure!(len <= layer.size, "object {path} is longer than the index's {} bytes", layer.size);
        file.write_all(&chunk).await.with_context(|| format!("write {}", tmp.display()))?;
    }
    anyhow::ensure!(len == layer.size, "object {path} has {len} bytes, the index lists {}", layer.size);
    anyhow::ensure!(
        crc == layer.crc32c,
        "object {path} has crc32c {crc:08x}, the index lists {:08x}: it is damaged",
        layer.crc32c
    );
    file.sync_all().await.with_context(|| format!("fsync {}", tmp.display()))?;
    drop(file);
    tokio::fs::rename(&tmp, dir.join(&layer.name))
        .await
        .with_context(|| format!("rename {}", tmp.display()))?;
    storage.metrics.downloaded_bytes.inc_by(len);
    Ok(())
}
