//! Layers in S3-compatible object storage (docs/rfcs/0009-remote-storage.md): the bucket is the
//! durable home of a timeline's layers, the local disk a cache of it (with `max_local_disk`,
//! `tenants::eviction`).
//!
//! Code map: this file is the client (`RemoteStorage`: an `object_store` store and the prefix
//! in it, the object names, the generations of a tenant); `config` the `remote_storage`
//! setting; `index` the per-timeline index (`index_part.json-<GEN>`); `upload` the uploader of a
//! timeline (layers, then the index, then the deletions the index allows); `download` what a
//! node reads of the bucket (attach's checks, and one layer at a time as reads need it:
//! `LayerFetcher`, storage's `LayerSource`).
//!
//! **Invariants:** an index is uploaded only after every layer it lists; a layer object is
//! deleted only after an index without it was uploaded, and only by a node that has just seen
//! its own generation as the tenant's highest; objects carry the generation of the node that
//! wrote them, and a node writes no object of another generation; a layer object is never
//! overwritten.

mod config;
mod download;
mod index;
mod upload;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

pub use config::RemoteStorageConfig;
pub use download::{attach_timeline, AttachedTimeline, LayerFetcher};
pub use index::{AncestorMeta, IndexLayer, IndexPart, TimelineMetadata};
pub use upload::{
    read_generation_file, write_generation_file, MetadataFn, RemoteStatus, RemoteTenant, RemoteTimeline,
    Uploader, DEFAULT_CHECKPOINT_TIMEOUT,
};

/// A tenant's generation: taken at each attach (and at the first upload of a tenant created
/// here), kept in the tenant's directory; the objects a node writes carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Generation(pub u32);

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:08x}", self.0)
    }
}

impl Generation {
    /// Parses the 8 hex digits of an object name's suffix.
    fn parse(s: &str) -> Option<Generation> {
        (s.len() == 8 && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(s, 16).ok().map(Generation))
            .flatten()
    }
}

/// The remote storage metrics (daemon-wide).
pub struct RemoteMetrics {
    pub(crate) uploads_queued: IntGauge,
    pub(crate) uploaded_bytes: IntCounter,
    pub(crate) uploaded_layers: IntCounter,
    pub(crate) errors: IntCounterVec,
    pub(crate) upload_seconds: Histogram,
    pub(crate) deleted_objects: IntCounter,
    pub(crate) downloaded_bytes: IntCounter,
}

impl RemoteMetrics {
    pub fn new(registry: &Registry) -> anyhow::Result<RemoteMetrics> {
        let m = RemoteMetrics {
            uploads_queued: IntGauge::new(
                "pageserver_remote_upload_queue",
                "Layers durable here and not yet uploaded, over every timeline",
            )?,
            uploaded_bytes: IntCounter::new(
                "pageserver_remote_uploaded_bytes_total",
                "Bytes of layers uploaded",
            )?,
            uploaded_layers: IntCounter::new("pageserver_remote_uploaded_layers_total", "Layers uploaded")?,
            errors: IntCounterVec::new(
                Opts::new(
                    "pageserver_remote_errors_total",
                    "Failed remote storage operations (each retried)",
                ),
                &["op"],
            )?,
            upload_seconds: Histogram::with_opts(
                HistogramOpts::new("pageserver_remote_upload_seconds", "Time to upload one layer")
                    .buckets(vec![0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]),
            )?,
            deleted_objects: IntCounter::new(
                "pageserver_remote_deleted_objects_total",
                "Layer objects deleted after an index without them was uploaded",
            )?,
            downloaded_bytes: IntCounter::new(
                "pageserver_remote_downloaded_bytes_total",
                "Bytes of layers downloaded",
            )?,
        };
        registry.register(Box::new(m.uploads_queued.clone()))?;
        registry.register(Box::new(m.uploaded_bytes.clone()))?;
        registry.register(Box::new(m.uploaded_layers.clone()))?;
        registry.register(Box::new(m.errors.clone()))?;
        registry.register(Box::new(m.upload_seconds.clone()))?;
        registry.register(Box::new(m.deleted_objects.clone()))?;
        registry.register(Box::new(m.downloaded_bytes.clone()))?;
        Ok(m)
    }

    /// Metrics registered nowhere (tests).
    pub fn unregistered() -> RemoteMetrics {
        #[allow(clippy::unwrap_used)] // a fresh registry takes every name once
        RemoteMetrics::new(&Registry::new()).unwrap()
    }
}

/// The bucket (or directory) and the prefix in it that hold this daemon's tenants.
pub struct RemoteStorage {
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
    pub(crate) metrics: Arc<RemoteMetrics>,
    /// What the `remote_storage` setting named, for messages.
    describe: String,
}

/// How long the start-up check waits for the bucket to answer.
const START_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

impl RemoteStorage {
    /// The store `conf` names (no request is made; see [`RemoteStorage::check`]).
    pub fn connect(conf: &RemoteStorageConfig, metrics: Arc<RemoteMetrics>) -> anyhow::Result<RemoteStorage> {
        let (store, prefix) = conf.build()?;
        Ok(RemoteStorage { store, prefix, metrics, describe: conf.describe() })
    }

    /// A store of the caller's (tests: `object_store`'s in-memory store).
    pub fn with_store(
        store: Arc<dyn ObjectStore>,
        prefix: &str,
        metrics: Arc<RemoteMetrics>,
    ) -> RemoteStorage {
        RemoteStorage {
            store,
            prefix: ObjectPath::from(prefix),
            metrics,
            describe: "a store given in code".into(),
        }
    }

    /// Lists the prefix once, at start-up: wrong credentials, a missing bucket or a refused
    /// listing are an error (the daemon does not start); a bucket that does not answer in time
    /// is only logged (ingest goes on locally, uploads catch up).
    pub async fn check(&self) -> anyhow::Result<()> {
        let listing = self.store.list_with_delimiter(Some(&self.prefix));
        match tokio::time::timeout(START_CHECK_TIMEOUT, listing).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) if is_refusal(&e) => {
                Err(anyhow::Error::new(e)
                    .context(format!("remote storage {} refused a listing", self.describe)))
            }
            Ok(Err(e)) => {
                tracing::warn!("remote storage {} failed a listing, going on: {e}", self.describe);
                Ok(())
            }
            Err(_) => {
                tracing::warn!(
                    "remote storage {} did not answer a listing in {START_CHECK_TIMEOUT:?}, going on",
                    self.describe
                );
                Ok(())
            }
        }
    }

    fn path(&self, parts: &[&str]) -> ObjectPath {
        let mut p = self.prefix.clone();
        for part in parts {
            p = p.clone().join(*part);
        }
        p
    }

    fn generations_path(&self, tenant: &str) -> ObjectPath {
        self.path(&["tenants", tenant, "generations"])
    }

    fn timelines_path(&self, tenant: &str) -> ObjectPath {
        self.path(&["tenants", tenant, "timelines"])
    }

    fn timeline_path(&self, tenant: &str, timeline: &str) -> ObjectPath {
        self.path(&["tenants", tenant, "timelines", timeline])
    }

    pub(crate) fn layer_path(
        &self,
        tenant: &str,
        timeline: &str,
        name: &str,
        generation: Generation,
    ) -> ObjectPath {
        self.timeline_path(tenant, timeline).join(format!("{name}-{generation}"))
    }

    fn index_path(&self, tenant: &str, timeline: &str, generation: Generation) -> ObjectPath {
        self.timeline_path(tenant, timeline).join(format!("{}-{generation}", index::INDEX_NAME))
    }

    /// The tenant's highest generation, `None` if none was ever taken.
    pub async fn current_generation(&self, tenant: &str) -> anyhow::Result<Option<Generation>> {
        let names = self.list_names(&self.generations_path(tenant)).await?;
        Ok(names.iter().filter_map(|n| Generation::parse(n)).max())
    }

    /// Takes the tenant's next generation: the highest listed plus one, created only if absent
    /// (`If-None-Match: *`); when another node created it first, lists again.
    pub async fn take_generation(&self, tenant: &str, node: &str) -> anyhow::Result<Generation> {
        for _ in 0..64 {
            let next = match self.current_generation(tenant).await? {
                None => Generation(1),
                Some(g) => Generation(g.0.checked_add(1).context("generations exhausted")?),
            };
            let path = self.generations_path(tenant).join(next.to_string());
            let body = serde_json::to_vec(&serde_json::json!({ "node": node }))?;
            let put = self
                .store
                .put_opts(
                    &path,
                    PutPayload::from(body),
                    PutOptions { mode: PutMode::Create, ..Default::default() },
                )
                .await;
            match put {
                Ok(_) => return Ok(next),
                Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => {
                    tracing::info!(tenant_id = tenant, generation = %next, "another node took the generation, listing again");
                }
                Err(e) => return Err(anyhow::Error::new(e).context(format!("create {path}"))),
            }
        }
        anyhow::bail!("could not take a generation of tenant {tenant}: 64 other nodes took one first")
    }

    /// The ids of the timelines the bucket holds of `tenant`.
    pub async fn list_timelines(&self, tenant: &str) -> anyhow::Result<Vec<String>> {
        let base = self.timelines_path(tenant);
        let listing =
            self.store.list_with_delimiter(Some(&base)).await.with_context(|| format!("list {base}"))?;
        let mut ids: Vec<String> =
            listing.common_prefixes.iter().filter_map(|p| p.filename().map(str::to_string)).collect();
        ids.sort();
        Ok(ids)
    }

    /// The timeline's index of the highest generation, with that generation; `None` if it has
    /// none.
    pub async fn newest_index(
        &self,
        tenant: &str,
        timeline: &str,
    ) -> anyhow::Result<Option<(Generation, IndexPart)>> {
        let names = self.list_names(&self.timeline_path(tenant, timeline)).await?;
        let newest = names
            .iter()
            .filter_map(|n| n.strip_prefix(index::INDEX_NAME)?.strip_prefix('-'))
            .filter_map(Generation::parse)
            .max();
        match newest {
            None => Ok(None),
            Some(g) => Ok(self.index_of(tenant, timeline, g).await?.map(|i| (g, i))),
        }
    }

    /// The timeline's index of generation `generation`; `None` if there is none.
    pub async fn index_of(
        &self,
        tenant: &str,
        timeline: &str,
        generation: Generation,
    ) -> anyhow::Result<Option<IndexPart>> {
        let path = self.index_path(tenant, timeline, generation);
        match self.store.get(&path).await {
            Ok(got) => {
                let raw = got.bytes().await.with_context(|| format!("read {path}"))?;
                IndexPart::decode(&raw).with_context(|| format!("decode {path}")).map(Some)
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(anyhow::Error::new(e).context(format!("get {path}"))),
        }
    }

    /// Uploads `index` as the timeline's index of its generation.
    pub async fn put_index(&self, tenant: &str, timeline: &str, index: &IndexPart) -> anyhow::Result<()> {
        let path = self.index_path(tenant, timeline, index.generation);
        let body = index.encode()?;
        self.store.put(&path, PutPayload::from(body)).await.with_context(|| format!("put {path}"))?;
        Ok(())
    }

    /// The last part of the name of every object right under `dir`.
    async fn list_names(&self, dir: &ObjectPath) -> anyhow::Result<Vec<String>> {
        let mut names = Vec::new();
        let mut listing = self.store.list(Some(dir));
        while let Some(meta) = listing.next().await {
            let meta = meta.with_context(|| format!("list {dir}"))?;
            if let Some(name) = meta.location.filename() {
                names.push(name.to_string());
            }
        }
        Ok(names)
    }

    pub(crate) fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Deletes one object; one already gone is no error.
    pub(crate) async fn delete(&self, path: &ObjectPath) -> anyhow::Result<()> {
        match self.store.delete(path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(anyhow::Error::new(e).context(format!("delete {path}"))),
        }
    }
}

/// Whether `e` is the store refusing us (credentials, permissions, no such bucket), as opposed
/// to failing to answer. `object_store` reports some refusals of a listing as a generic error
/// with the HTTP status in its message (its retry error type is private).
fn is_refusal(e: &object_store::Error) -> bool {
    match e {
        object_store::Error::Unauthenticated { .. }
        | object_store::Error::PermissionDenied { .. }
        | object_store::Error::NotFound { .. } => true,
        e => {
            let text = e.to_string();
            ["401 Unauthorized", "403 Forbidden", "404 Not Found", "NoSuchBucket"]
                .iter()
                .any(|s| text.contains(s))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
