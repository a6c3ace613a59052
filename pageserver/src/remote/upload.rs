//! The uploader of a timeline: a tokio task that follows storage's manifest and makes the bucket
//! hold the same layers. For each manifest it uploads the layers the remote index lacks (a few
//! at a time, each retried for ever with backoff), then the index, then queues the objects the
//! new index no longer lists for deletion (`remote_deletions.json`, written before a deletion is
//! sent), and deletes them once it has seen its generation still the tenant's highest. It also
//! seals the active segment when it has held values for `checkpoint_timeout`, so that what is
//! durable here reaches the bucket within about that long.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use futures_util::StreamExt;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload, WriteMultipart};
use page_types::Lsn;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::index::{IndexLayer, IndexPart, TimelineMetadata, INDEX_VERSION};
use super::{Generation, RemoteStorage};
use crate::storage::{LayerFile, Timeline};
use crate::util::lock;

/// How long the active segment may hold values before the uploader seals it (Neon's
/// `checkpoint_timeout`).
pub const DEFAULT_CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(60);
/// Layers of one timeline uploaded at once.
const UPLOAD_CONCURRENCY: usize = 4;
/// A layer up to this size is one PUT; a larger one a multipart upload of parts this size.
const PART_SIZE: usize = 8 << 20;
/// Backoff between retries of a failed operation: doubling from the first to the last.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How often the uploader looks again without a manifest change (the seal timer, retries).
const TICK: Duration = Duration::from_secs(1);
/// The file of a timeline's directory (next to its `timeline/`) that lists the objects to delete.
pub const DELETIONS_FILE: &str = "remote_deletions.json";
/// The file of a tenant's directory that holds its generation.
pub const GENERATION_FILE: &str = "generation";

/// The remote side of a tenant: the bucket and the tenant's generation, which its timelines'
/// uploaders share.
pub struct RemoteTenant {
    pub storage: Arc<RemoteStorage>,
    pub tenant_id: String,
    /// The tenant's directory (its `generation` file).
    dir: PathBuf,
    /// Who takes a generation (written into the generation object).
    node: String,
    generation: tokio::sync::OnceCell<Generation>,
    /// Set once a listing showed a higher generation than ours: another node attached the
    /// tenant; this one deletes nothing more.
    stale: AtomicBool,
}

impl RemoteTenant {
    /// The remote side of the tenant in `dir`; `known`: its generation, if its `generation`
    /// file was read (else the first uploader reads it, or takes one).
    pub fn new(
        storage: Arc<RemoteStorage>,
        tenant_id: &str,
        dir: &Path,
        node: &str,
        known: Option<Generation>,
    ) -> Arc<RemoteTenant> {
        Arc::new(RemoteTenant {
            storage,
            tenant_id: tenant_id.to_string(),
            dir: dir.to_path_buf(),
            node: node.to_string(),
            generation: tokio::sync::OnceCell::new_with(known),
            stale: AtomicBool::new(false),
        })
    }

    /// The tenant's generation here: its `generation` file, or (a tenant created here and not
    /// yet uploaded) a new one taken from the bucket and written down.
    pub async fn generation(&self) -> anyhow::Result<Generation> {
        self.generation
            .get_or_try_init(|| async {
                if let Some(g) = read_generation_file(&self.dir)? {
                    return Ok(g);
                }
                let g = self.storage.take_generation(&self.tenant_id, &self.node).await?;
                let dir = self.dir.clone();
                tokio::task::spawn_blocking(move || write_generation_file(&dir, g)).await??;
                tracing::info!(tenant_id = self.tenant_id, generation = %g, "took a generation");
                Ok(g)
            })
            .await
            .copied()
    }

    /// The generation, if known yet.
    pub fn known_generation(&self) -> Option<Generation> {
        self.generation.get().copied()
    }

    /// Whether another node took a higher generation (seen at the last check).
    pub fn is_stale(&self) -> bool {
        self.stale.load(Ordering::Relaxed)
    }

    /// Lists the generations: is ours still the highest? Sets [`RemoteTenant::is_stale`] if not.
    async fn check_current(&self, ours: Generation) -> anyhow::Result<bool> {
        let current = self.storage.current_generation(&self.tenant_id).await?;
        let is_current = current.is_none_or(|c| c <= ours);
        if !is_current && !self.stale.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                tenant_id = self.tenant_id,
                ours = %ours,
                current = ?current.map(|c| c.to_string()),
                "another node attached this tenant: deleting nothing more from the bucket"
            );
        }
        Ok(is_current)
    }
}

/// Reads a tenant directory's `generation` file; `None` if it has none.
pub fn read_generation_file(dir: &Path) -> anyhow::Result<Option<Generation>> {
    let path = dir.join(GENERATION_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let g = Generation::parse(text.trim())
                .with_context(|| format!("{} does not hold a generation (8 hex digits)", path.display()))?;
            Ok(Some(g))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// Writes a tenant directory's `generation` file durably.
pub fn write_generation_file(dir: &Path, g: Generation) -> anyhow::Result<()> {
    crate::storage::durable_write(dir, GENERATION_FILE, format!("{g}\n").as_bytes())
}

/// What the API shows of a timeline's uploads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RemoteStatus {
    /// This node's generation of the tenant (`None` until known).
    pub generation: Option<String>,
    /// Everything durable here at or below this LSN is in the bucket (the uploaded index's
    /// `disk_consistent_lsn`).
    pub remote_consistent_lsn: Lsn,
    /// Layers the uploaded index lists.
    pub remote_layers: usize,
    /// Layers durable here and not yet uploaded.
    pub queued_uploads: usize,
    /// Objects waiting to be deleted.
    pub queued_deletions: usize,
    pub uploaded_bytes: u64,
    /// Another node attached the tenant since: nothing more is deleted from here.
    pub stale: bool,
    /// The last failure of a remote operation (each is retried), until one succeeds.
    pub last_error: Option<String>,
    /// The metadata of the uploaded index: what a node attaching from the bucket takes (the
    /// WAL source's position, where it resumes streaming). Not shown.
    #[serde(skip)]
    pub metadata: Option<Arc<TimelineMetadata>>,
}

/// A timeline's uploads: the task and what it reports.
pub struct RemoteTimeline {
    status: watch::Sender<RemoteStatus>,
    /// The names of the layers the index uploaded last lists (what may be evicted).
    uploaded: Arc<Mutex<BTreeSet<String>>>,
    /// Woken when the timeline's metadata changed ([`RemoteTimeline::metadata_changed`]).
    metadata_changed: Arc<tokio::sync::Notify>,
    /// Woken by [`RemoteTimeline::upload_now`].
    upload_now: Arc<tokio::sync::Notify>,
    cancel: CancellationToken,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// What the metadata of a timeline's index is made of, given the index's `disk_consistent_lsn`
/// and, if the layers held every value durable when they were listed (the active segment held
/// none just before), the timeline's durable LSN read before that: every value at or below it
/// is in the layers. `None` while the timeline cannot be served from what the layers hold yet
/// (an index is then not uploaded).
pub type MetadataFn = Arc<dyn Fn(Lsn, Option<Lsn>) -> Option<TimelineMetadata> + Send + Sync>;

/// What starts a timeline's uploader.
pub struct Uploader {
    pub tenant: Arc<RemoteTenant>,
    pub timeline_id: String,
    pub timeline: Arc<Timeline>,
    /// The directory of the timeline's own files (its `DELETIONS_FILE`).
    pub meta_dir: PathBuf,
    pub metadata: MetadataFn,
    pub checkpoint_timeout: Duration,
}

impl RemoteTimeline {
    /// Starts the uploader (a task on the current runtime) until `cancel` or
    /// [`RemoteTimeline::shutdown`].
    pub fn start(uploader: Uploader, cancel: CancellationToken) -> Arc<RemoteTimeline> {
        let known = uploader.tenant.known_generation().map(|g| g.to_string());
        let uploaded = Arc::new(Mutex::new(BTreeSet::new()));
        let remote = Arc::new(RemoteTimeline {
            status: watch::Sender::new(RemoteStatus { generation: known, ..RemoteStatus::default() }),
            uploaded: Arc::clone(&uploaded),
            metadata_changed: Arc::new(tokio::sync::Notify::new()),
            upload_now: Arc::new(tokio::sync::Notify::new()),
            cancel: cancel.clone(),
            task: Mutex::new(None),
        });
        let span = tracing::info_span!(
            "uploader",
            tenant_id = uploader.tenant.tenant_id,
            timeline_id = uploader.timeline_id
        );
        let state = State {
            u: uploader,
            status: remote.status.clone(),
            uploaded,
            metadata_changed: Arc::clone(&remote.metadata_changed),
            upload_now: Arc::clone(&remote.upload_now),
            metadata_dirty: false,
            seal_now: false,
            cancel,
            remote: BTreeMap::new(),
            orphans: BTreeMap::new(),
            last_index: None,
            unsealed_since: None,
            queued_counted: 0,
        };
        *lock(&remote.task) = Some(tokio::spawn(state.run().instrument(span)));
        remote
    }

    pub fn status(&self) -> RemoteStatus {
        self.status.borrow().clone()
    }

    /// Whether the index this node uploaded last lists layer `name` (the bucket holds it).
    pub fn is_uploaded(&self, name: &str) -> bool {
        lock(&self.uploaded).contains(name)
    }

    /// The timeline's metadata (the files its index carries) changed: the index is uploaded
    /// again even if its layers did not change.
    pub fn metadata_changed(&self) {
        self.metadata_changed.notify_one();
    }

    /// Seals the active segment if it holds values and uploads, with the metadata of now,
    /// without waiting for `checkpoint_timeout`: the WAL receiver asks for it at a shutdown
    /// checkpoint, whose primary waits for its WAL to be reported flushed before it exits.
    pub fn upload_now(&self) {
        self.upload_now.notify_one();
    }

    /// Waits until the bucket's index covers `lsn` (the layers hold everything durable up to
    /// it), at most `timeout`.
    pub async fn wait_uploaded(&self, lsn: Lsn, timeout: Duration) -> anyhow::Result<()> {
        let mut status = self.status.subscribe();
        let reached = tokio::time::timeout(timeout, async {
            status.wait_for(|s| s.remote_consistent_lsn >= lsn).await.map(|_| ())
        })
        .await;
        match reached {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => anyhow::bail!("the uploader stopped"),
            Err(_) => {
                let s = self.status();
                anyhow::bail!(
                    "the bucket's index reached {} of {lsn} in {timeout:?} (last error: {})",
                    s.remote_consistent_lsn,
                    s.last_error.as_deref().unwrap_or("none")
                )
            }
        }
    }

    /// Stops the uploader and waits for its task. What was not uploaded is uploaded by the next
    /// uploader of the timeline (after a restart: the manifest still lists it).
    pub async fn shutdown(&self) {
        self.cancel.cancel();
        let task = lock(&self.task).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

/// The uploader task's state.
struct State {
    u: Uploader,
    status: watch::Sender<RemoteStatus>,
    /// [`RemoteTimeline::is_uploaded`]'s names: those of `remote`.
    uploaded: Arc<Mutex<BTreeSet<String>>>,
    metadata_changed: Arc<tokio::sync::Notify>,
    upload_now: Arc<tokio::sync::Notify>,
    /// The metadata may differ from the uploaded index's.
    metadata_dirty: bool,
    /// [`RemoteTimeline::upload_now`] was called: seal at the next look, whatever the timer.
    seal_now: bool,
    cancel: CancellationToken,
    /// The layers the uploaded index lists, by name.
    remote: BTreeMap<String, IndexLayer>,
    /// Layers uploaded by this node and not (yet) in an uploaded index.
    orphans: BTreeMap<String, IndexLayer>,
    last_index: Option<IndexPart>,
    /// Since when the active segment has held values (the seal timer).
    unsealed_since: Option<Instant>,
    /// What this timeline adds to the daemon-wide upload queue gauge.
    queued_counted: i64,
}

/// A cancelled uploader: stop.
struct Cancelled;

impl State {
    async fn run(mut self) {
        if self.start().await.is_err() {
            return;
        }
        let mut changes = self.u.timeline.manifest_changes();
        loop {
            if self.sync().await.is_err() || self.delete_queued().await.is_err() {
                break;
            }
            let (nudged, asked) = (Arc::clone(&self.metadata_changed), Arc::clone(&self.upload_now));
            tokio::select! {
                _ = changes.changed() => {}
                () = nudged.notified() => self.metadata_dirty = true,
                () = asked.notified() => {
                    self.metadata_dirty = true;
                    self.seal_now = true;
                }
                () = tokio::time::sleep(TICK) => {}
                () = self.cancel.cancelled() => break,
            }
            self.seal_if_due().await;
        }
        self.count_queued(0);
    }

    /// Learns the generation and what the bucket holds of this generation's index.
    async fn start(&mut self) -> Result<(), Cancelled> {
        let tenant = Arc::clone(&self.u.tenant);
        let g = self.retry("take a generation", || tenant.generation()).await?;
        self.status.send_modify(|s| s.generation = Some(g.to_string()));
        // A restart keeps the generation: say at once if another node attached meanwhile.
        if !self.retry("check the generation", || tenant.check_current(g)).await? {
            self.status.send_modify(|s| s.stale = true);
        }
        let (id, tl) = (self.u.tenant.tenant_id.clone(), self.u.timeline_id.clone());
        let storage = Arc::clone(&self.u.tenant.storage);
        let index = self.retry("read the index", || storage.index_of(&id, &tl, g)).await?;
        let queued = self.read_deletions().await?.objects.len();
        self.status.send_modify(|s| s.queued_deletions = queued);
        if let Some(index) = index {
            self.remote = index.layers.iter().map(|l| (l.name.clone(), l.clone())).collect();
            *lock(&self.uploaded) = self.remote.keys().cloned().collect();
            let (lsn, metadata) = (index.disk_consistent_lsn, Arc::new(index.metadata.clone()));
            self.status.send_modify(|s| {
                s.remote_consistent_lsn = lsn;
                s.remote_layers = index.layers.len();
                s.metadata = Some(metadata);
            });
            self.last_index = Some(index);
        }
        Ok(())
    }

    /// Uploads until the bucket's index lists what the manifest lists (with the metadata of now).
    async fn sync(&mut self) -> Result<(), Cancelled> {
        loop {
            // Read before the layers: if the active segment was empty then, every value durable
            // then is in the layers listed after, and every value durable at the LSN read before
            // that was.
            let durable = self.u.timeline.last_durable_lsn();
            let all_in_layers = (!self.u.timeline.holds_unsealed_values()).then_some(durable);
            let files = self.u.timeline.layer_files();
            let missing: Vec<LayerFile> = files
                .layers
                .iter()
                .filter(|l| !self.remote.contains_key(&l.name) && !self.orphans.contains_key(&l.name))
                .cloned()
                .collect();
            self.count_queued(missing.len());
            let g = self.u.tenant.known_generation().unwrap_or(Generation(0));
            // Whether the uploaded index lists these layers and GC cutoff (and this metadata).
            let indexed = |last: &Option<IndexPart>, metadata: Option<&TimelineMetadata>| {
                last.as_ref().is_some_and(|i| {
                    i.layers.iter().map(|l| &l.name).eq(files.layers.iter().map(|l| &l.name))
                        && i.gc_cutoff == files.gc_cutoff
                        && metadata.is_none_or(|m| *m == i.metadata)
                })
            };
            if missing.is_empty() && !self.metadata_dirty && indexed(&self.last_index, None) {
                return Ok(());
            }
            let none_missing = missing.is_empty();
            let mut gone = false;
            let uploads = futures_util::stream::iter(missing.into_iter().map(|l| self.upload_layer(l, g)))
                .buffer_unordered(UPLOAD_CONCURRENCY)
                .collect::<Vec<_>>()
                .await;
            for up in uploads {
                match up? {
                    Some(layer) => {
                        self.orphans.insert(layer.name.clone(), layer);
                    }
                    None => gone = true,
                }
            }
            if gone {
                // Compaction replaced a layer before it was uploaded: a newer manifest lists
                // what replaced it.
                continue;
            }
            // Read from files (small ones) off the executor; only when an index is due. Until the
            // timeline can be served from its layers, they are uploaded and no index is.
            let (metadata_fn, last_lsn) = (Arc::clone(&self.u.metadata), files.last_lsn());
            let metadata = tokio::task::spawn_blocking(move || metadata_fn(last_lsn, all_in_layers))
                .await
                .ok()
                .flatten();
            let Some(metadata) = metadata else {
                return Ok(());
            };
            self.metadata_dirty = false;
            if none_missing && indexed(&self.last_index, Some(&metadata)) {
                return Ok(());
            }
            let layers: Vec<IndexLayer> = files
                .layers
                .iter()
                .filter_map(|l| self.remote.get(&l.name).or_else(|| self.orphans.get(&l.name)).cloned())
                .collect();
            let index = IndexPart {
                version: INDEX_VERSION,
                generation: g,
                manifest_generation: files.generation,
                disk_consistent_lsn: files.last_lsn(),
                gc_cutoff: files.gc_cutoff,
                layers,
                metadata,
            };
            let (id, tl) = (self.u.tenant.tenant_id.clone(), self.u.timeline_id.clone());
            let storage = Arc::clone(&self.u.tenant.storage);
            self.retry("upload the index", || storage.put_index(&id, &tl, &index)).await?;
            // Objects of this generation or older that the new index does not list: the old
            // index's and those uploaded and replaced before an index listed them.
            let listed: BTreeMap<String, IndexLayer> =
                index.layers.iter().map(|l| (l.name.clone(), l.clone())).collect();
            let mut dropped: Vec<String> = Vec::new();
            for (name, l) in self.remote.iter().chain(self.orphans.iter()) {
                if !listed.contains_key(name) {
                    dropped.push(storage.layer_path(&id, &tl, name, l.generation).to_string());
                }
            }
            self.remote = listed;
            *lock(&self.uploaded) = self.remote.keys().cloned().collect();
            self.orphans.clear();
            let (lsn, metadata) = (index.disk_consistent_lsn, Arc::new(index.metadata.clone()));
            let count = index.layers.len();
            self.last_index = Some(index);
            self.status.send_modify(|s| {
                s.remote_consistent_lsn = lsn;
                s.remote_layers = count;
                s.last_error = None;
                s.metadata = Some(metadata);
            });
            if !dropped.is_empty() {
                let dir = self.u.meta_dir.clone();
                let queued = self
                    .retry("queue deletions", || {
                        let (dir, dropped) = (dir.clone(), dropped.clone());
                        async move {
                            tokio::task::spawn_blocking(move || {
                                let mut queue = read_deletions(&dir)?;
                                queue.objects.extend(dropped);
                                write_deletions(&dir, &queue)?;
                                Ok::<_, anyhow::Error>(queue.objects.len())
                            })
                            .await?
                        }
                    })
                    .await?;
                self.status.send_modify(|s| s.queued_deletions = queued);
            }
        }
    }

    /// Uploads one layer file as an object of generation `g`; `None` if the file is gone
    /// (compaction deleted it). The file is checked against its listed size and crc32c as it is
    /// read: a damaged local file is never uploaded.
    async fn upload_layer(&self, layer: LayerFile, g: Generation) -> Result<Option<IndexLayer>, Cancelled> {
        let storage = Arc::clone(&self.u.tenant.storage);
        let path = storage.layer_path(&self.u.tenant.tenant_id, &self.u.timeline_id, &layer.name, g);
        let file = self.u.timeline.dir().join(&layer.name);
        let what = format!("upload {}", layer.name);
        let begun = Instant::now();
        let crc = self.retry(&what, || upload_file(&storage, &file, &path, &layer)).await?;
        let Some(crc) = crc else {
            return Ok(None);
        };
        storage.metrics.upload_seconds.observe(begun.elapsed().as_secs_f64());
        storage.metrics.uploaded_bytes.inc_by(layer.size);
        storage.metrics.uploaded_layers.inc();
        self.status.send_modify(|s| s.uploaded_bytes += layer.size);
        Ok(Some(IndexLayer {
            name: layer.name,
            generation: g,
            size: layer.size,
            crc32c: crc,
            first_lsn: layer.first_lsn,
            last_lsn: layer.last_lsn,
        }))
    }

    /// Deletes the queued objects, after checking that our generation is still the highest
    /// (a stale node deletes nothing: the objects may be the newer node's layers too).
    async fn delete_queued(&mut self) -> Result<(), Cancelled> {
        // The count kept in the status (read from the file at start, raised as objects are
        // queued) spares a read of the file at every turn.
        if self.status.borrow().queued_deletions == 0 || self.u.tenant.is_stale() {
            return Ok(());
        }
        let dir = self.u.meta_dir.clone();
        let queue = self.read_deletions().await?;
        if queue.objects.is_empty() || self.u.tenant.is_stale() {
            return Ok(());
        }
        let tenant = Arc::clone(&self.u.tenant);
        let g = self.u.tenant.known_generation().unwrap_or(Generation(0));
        let current = self.retry("check the generation", || tenant.check_current(g)).await?;
        if !current {
            self.status.send_modify(|s| s.stale = true);
            return Ok(());
        }
        let storage = Arc::clone(&self.u.tenant.storage);
        for object in &queue.objects {
            let path = ObjectPath::from(object.as_str());
            self.retry("delete a replaced layer", || storage.delete(&path)).await?;
            storage.metrics.deleted_objects.inc();
        }
        self.retry("empty the deletion queue", || {
            let dir = dir.clone();
            async move { tokio::task::spawn_blocking(move || write_deletions(&dir, &Deletions::default())).await? }
        })
        .await?;
        self.status.send_modify(|s| s.queued_deletions = 0);
        Ok(())
    }

    /// Reads the deletion queue's file (retried as every operation).
    async fn read_deletions(&self) -> Result<Deletions, Cancelled> {
        let dir = self.u.meta_dir.clone();
        self.retry("read the deletion queue", || {
            let dir = dir.clone();
            async move { tokio::task::spawn_blocking(move || read_deletions(&dir)).await? }
        })
        .await
    }

    /// Seals the active segment once it has held values for `checkpoint_timeout`, or at once
    /// if [`RemoteTimeline::upload_now`] asked.
    async fn seal_if_due(&mut self) {
        let asked = std::mem::take(&mut self.seal_now);
        if !self.u.timeline.holds_unsealed_values() {
            self.unsealed_since = None;
            return;
        }
        let since = *self.unsealed_since.get_or_insert_with(Instant::now);
        if asked || since.elapsed() >= self.u.checkpoint_timeout {
            if let Err(e) = self.u.timeline.freeze().await {
                tracing::warn!("failed to seal the active segment for upload: {e:#}");
            }
            self.unsealed_since = None;
        }
    }

    fn count_queued(&mut self, queued: usize) {
        let queued = i64::try_from(queued).unwrap_or(i64::MAX);
        self.u.tenant.storage.metrics.uploads_queued.add(queued - self.queued_counted);
        self.queued_counted = queued;
        self.status.send_modify(|s| s.queued_uploads = usize::try_from(queued).unwrap_or(usize::MAX));
    }

    /// Runs `op` until it succeeds, backing off between failures (logged once per episode,
    /// counted every time, shown in the status); `Err(Cancelled)` once the uploader is stopped.
    async fn retry<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T, Cancelled>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<T>>,
    {
        let mut backoff = BACKOFF_FIRST;
        let mut failures = 0u32;
        loop {
            let outcome = tokio::select! {
                r = op() => r,
                () = self.cancel.cancelled() => return Err(Cancelled),
            };
            match outcome {
                Ok(v) => {
                    if failures > 0 {
                        tracing::info!(failures, "{what}: succeeded after retrying");
                    }
                    return Ok(v);
                }
                Err(e) => {
                    failures += 1;
                    let error = format!("{what}: {e:#}");
                    let op_label = what.split_whitespace().next().unwrap_or("op");
                    self.u.tenant.storage.metrics.errors.with_label_values(&[op_label]).inc();
                    if failures == 1 {
                        tracing::warn!("{error}; retrying every {BACKOFF_MAX:?} at most");
                    } else {
                        tracing::debug!("{error}");
                    }
                    self.status.send_modify(|s| s.last_error = Some(error));
                    tokio::select! {
                        () = tokio::time::sleep(backoff) => {}
                        () = self.cancel.cancelled() => return Err(Cancelled),
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }
}

/// Uploads `file` to `path`: one PUT up to [`PART_SIZE`], else a multipart upload of such parts
/// (at most three in flight). Returns its crc32c, checked against `layer`'s when it has one, and
/// `None` if the file is gone.
async fn upload_file(
    storage: &RemoteStorage,
    file: &Path,
    path: &ObjectPath,
    layer: &LayerFile,
) -> anyhow::Result<Option<u32>> {
    let opened = {
        let file = file.to_path_buf();
        tokio::task::spawn_blocking(move || std::fs::File::open(&file)).await?
    };
    let f = match opened {
        Ok(f) => Arc::new(f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("open {}", file.display())),
    };
    let read_part = |offset: u64, len: usize| {
        let f = Arc::clone(&f);
        async move {
            tokio::task::spawn_blocking(move || {
                let mut buf = vec![0u8; len];
                std::os::unix::fs::FileExt::read_exact_at(&*f, &mut buf, offset)?;
                Ok::<_, std::io::Error>(Bytes::from(buf))
            })
            .await?
            .context("read layer file")
        }
    };
    let size = layer.size;
    let mut crc = 0u32;
    if size <= PART_SIZE as u64 {
        let bytes = read_part(0, usize::try_from(size)?).await?;
        crc = crc32c::crc32c_append(crc, &bytes);
        check_crc(layer, crc)?;
        storage.store().put(path, PutPayload::from(bytes)).await.with_context(|| format!("put {path}"))?;
        return Ok(Some(crc));
    }
    let upload =
        storage.store().put_multipart(path).await.with_context(|| format!("start multipart {path}"))?;
    let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_SIZE);
    let mut offset = 0u64;
    while offset < size {
        let len = usize::try_from((size - offset).min(PART_SIZE as u64))?;
        let bytes = match read_part(offset, len).await {
            Ok(b) => b,
            Err(e) => {
                let _ = writer.abort().await;
                return Err(e);
            }
        };
        crc = crc32c::crc32c_append(crc, &bytes);
        writer.wait_for_capacity(2).await.with_context(|| format!("upload part of {path}"))?;
        writer.put(bytes);
        offset += len as u64;
    }
    if let Err(e) = check_crc(layer, crc) {
        let _ = writer.abort().await;
        return Err(e);
    }
    writer.finish().await.with_context(|| format!("finish multipart {path}"))?;
    Ok(Some(crc))
}

fn check_crc(layer: &LayerFile, crc: u32) -> anyhow::Result<()> {
    match layer.crc32c {
        Some(listed) if listed != crc => anyhow::bail!(
            "layer {} has crc32c {crc:08x}, its manifest lists {listed:08x}: the local file is damaged, not uploading it",
            layer.name
        ),
        _ => Ok(()),
    }
}

/// `remote_deletions.json`: the objects to delete, in the order they were dropped.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Deletions {
    objects: Vec<String>,
}

fn read_deletions(dir: &Path) -> anyhow::Result<Deletions> {
    let path = dir.join(DELETIONS_FILE);
    match std::fs::read(&path) {
        Ok(raw) => serde_json::from_slice(&raw).with_context(|| format!("decode {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Deletions::default()),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

fn write_deletions(dir: &Path, queue: &Deletions) -> anyhow::Result<()> {
    let raw = serde_json::to_vec_pretty(queue).context("encode the deletion queue")?;
    crate::storage::durable_write(dir, DELETIONS_FILE, &raw)
}
