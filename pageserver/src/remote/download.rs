//! What attach copies from the bucket: every layer an index lists, into a new timeline
//! directory, each checked against the index's size and crc32c before it takes its name.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use futures_util::StreamExt;
use object_store::ObjectStoreExt;
use tokio::io::AsyncWriteExt;

use super::index::{IndexLayer, IndexPart};
use super::RemoteStorage;
use crate::storage::{self, StorageMetrics};

/// A timeline found in the bucket: its id and its newest index.
#[derive(Debug, Clone)]
pub struct AttachedTimeline {
    pub timeline_id: String,
    pub index: IndexPart,
}

/// Downloads every layer `index` lists into `dir` (created; it must not exist) and makes it a
/// timeline directory ([`storage::create_from_copy`]). Each layer is written to a temporary
/// name, checked (size, crc32c), fsynced and renamed, four at a time. An object that is missing or fails its
/// check is an error naming it; the caller removes `dir`.
pub async fn attach_copy(
    storage: &Arc<RemoteStorage>,
    tenant: &str,
    timeline: &AttachedTimeline,
    dir: &Path,
    metrics: &Arc<StorageMetrics>,
) -> anyhow::Result<()> {
    tokio::fs::create_dir_all(dir).await.with_context(|| format!("create {}", dir.display()))?;
    // Owned futures: a stream of futures borrowing the caller's values makes the attach
    // future fail the compiler's higher-ranked `Send` check in the HTTP handler.
    let downloads = timeline.index.layers.iter().map(|layer| {
        let (storage, tenant, timeline_id) =
            (Arc::clone(storage), tenant.to_string(), timeline.timeline_id.clone());
        let (layer, dir) = (layer.clone(), dir.to_path_buf());
        async move { download_layer(&storage, &tenant, &timeline_id, &layer, &dir).await }
    });
    let mut downloads =
        futures_util::stream::iter(downloads.collect::<Vec<_>>()).buffer_unordered(DOWNLOAD_CONCURRENCY);
    while let Some(done) = downloads.next().await {
        done?;
    }
    drop(downloads);
    let (dir, files, metrics) = (dir.to_path_buf(), timeline.index.layer_files(), Arc::clone(metrics));
    tokio::task::spawn_blocking(move || {
        storage::fsync_dir(&dir)?;
        storage::create_from_copy(&dir, &files, &metrics)
    })
    .await
    .context("write the copy's manifest")?
}

/// Layers one attach downloads at once.
const DOWNLOAD_CONCURRENCY: usize = 4;

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
    let tmp = dir.join(format!(".download-{}", layer.name));
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
