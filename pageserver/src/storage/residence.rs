//! Layers that are not on local disk: where their files come from ([`LayerSource`], given by
//! remote storage), how a layer becomes resident again ([`Fetch`]: one download, checked, then
//! opened), and the clock by which eviction finds the layers read least recently.
//!
//! A layer is *resident* when its file is in the timeline's directory and open. Recovery takes a
//! layer the manifest lists but the directory lacks as non-resident when the timeline has a
//! source (an error naming the file otherwise), and eviction ([`super::Timeline::evict`]) makes
//! a resident one non-resident: the file is deleted, the layer map gets a non-resident twin. A
//! read that meets a non-resident layer fetches it (`layer_map::Frozen::resident`).
//!
//! **Invariants:** a fetched file takes the layer's name only after its size and crc32c
//! matched what the manifest lists and it was fsynced (the source's work), and it is opened
//! (footer, fences, name against footer) before any read uses it; at most one fetch of a layer
//! runs at a time (concurrent readers wait for it and share it).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context};

use super::layer::{self, OpenLayer};
use super::StorageMetrics;

/// Where the layer files of a timeline that are not on local disk come from.
pub trait LayerSource: Send + Sync {
    /// Puts layer file `name` (`size` bytes; crc32c `crc32c` where the manifest has one) into
    /// `dir` under that name: written under a temporary name beginning with
    /// [`DOWNLOAD_PREFIX`], checked, fsynced, renamed, the directory fsynced. Fails, naming what
    /// it read, if the bytes do not match. Blocking: called off the executor.
    fn fetch(&self, dir: &Path, name: &str, size: u64, crc32c: Option<u32>) -> anyhow::Result<()>;
}

/// Names of a [`LayerSource`]'s temporary files; recovery removes them.
pub const DOWNLOAD_PREFIX: &str = ".download-";

/// A timeline's [`LayerSource`], as its storage configuration holds it: two are equal when they
/// are the same object.
#[derive(Clone)]
pub struct SourceRef(pub Arc<dyn LayerSource>);

impl std::fmt::Debug for SourceRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SourceRef(..)")
    }
}

impl PartialEq for SourceRef {
    fn eq(&self, other: &SourceRef) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SourceRef {}

/// What makes a timeline's non-resident layers resident: its directory and source.
pub(crate) struct Fetch {
    dir: PathBuf,
    source: Arc<dyn LayerSource>,
    metrics: Arc<StorageMetrics>,
}

impl Fetch {
    pub(crate) fn new(dir: &Path, source: &SourceRef, metrics: &Arc<StorageMetrics>) -> Fetch {
        Fetch { dir: dir.to_path_buf(), source: Arc::clone(&source.0), metrics: Arc::clone(metrics) }
    }

    /// Fetches layer `name` into the directory and opens it (blocking).
    pub(crate) fn layer(&self, name: &str, size: u64, crc32c: Option<u32>) -> anyhow::Result<OpenLayer> {
        let begun = Instant::now();
        self.source.fetch(&self.dir, name, size, crc32c).with_context(|| format!("download layer {name}"))?;
        let path = self.dir.join(name);
        let opened =
            layer::open(&path).with_context(|| format!("open downloaded layer {name}")).and_then(|opened| {
                ensure!(
                    opened.len == size,
                    "downloaded layer {name} has {} bytes, the manifest lists {size}",
                    opened.len
                );
                Ok(opened)
            });
        let opened = match opened {
            Ok(opened) => opened,
            Err(e) => {
                // Not a layer to keep under its name: the next read fetches it again.
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        self.metrics.layer_downloads.inc();
        self.metrics.layer_download_seconds.observe(begun.elapsed().as_secs_f64());
        tracing::debug!(layer = name, size, elapsed = ?begun.elapsed(), "downloaded a layer on demand");
        Ok(opened)
    }
}

/// The read clock: advanced by the evictor ([`tick`], about once a second), read by every read
/// of a layer, which records it as the layer's last read when it changed. Without an evictor it
/// stays at 0 and the reads record nothing.
static CLOCK: AtomicU64 = AtomicU64::new(0);

/// Advances the read clock; returns its new value.
pub fn tick() -> u64 {
    CLOCK.fetch_add(1, Ordering::Relaxed) + 1
}

/// The read clock.
pub(crate) fn now() -> u64 {
    CLOCK.load(Ordering::Relaxed)
}

/// A resident layer, as eviction chooses among them ([`super::Timeline::resident_layers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidentLayer {
    pub name: String,
    pub size: u64,
    /// The read clock at its last read (or at its creation, download or open).
    pub last_read: u64,
    /// Whether it can be evicted at all: its timeline has a source and its name carries its key
    /// range (a layer named before names did is kept).
    pub evictable: bool,
}

#[cfg(test)]
mod tests;
