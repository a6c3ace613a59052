//! Durable per-timeline storage of page images and WAL redo records, read back "as of" an LSN.
//!
//! One [`Timeline`] owns one directory. Ingested batches are appended as checksummed frames to
//! the active segment by a committer (rounds on a small thread pool shared by all timelines)
//! that writes every queued batch and then fsyncs once (group commit); only then are the
//! batches acknowledged, indexed and visible. A full
//! active segment is sealed in place into an immutable layer file (block index + fences + footer
//! appended, fsync, rename, fsync directory) and recorded in the manifest. On open, recovery
//! checks the directory against the manifest, finishes or undoes an interrupted seal, reads
//! every layer's footer and fences (the whole flat index of a layer of version 1 or 2), and cuts
//! a torn tail off the active segment. The byte format and the recovery
//! procedure are specified in `docs/storage-format.md`.
//!
//! Code map: `format` (shared constants and codecs), `segment` (batch frames, the active
//! segment, the scan), `layer` (layer files: footer, the flat index of versions 1 and 2;
//! `layer/block_index`: the block index of version 3, its fences and the daemon-wide block
//! cache), `manifest` (the list of the timeline's files and the seal intent), `layer_map` (the
//! frozen layers, grouped into runs of key-disjoint layers for lookups), `read` (the read path:
//! a lookup's snapshot, the values it picks within the read limits, their reads), `index` (what
//! the timeline's lock guards: the active segment's entries and the layer map), `shared` (the
//! state the handle and the committer share: queue, index, durable LSN, failure), `timeline`
//! (the handle: ingest queue, reads, waits, shutdown), `commit` (the committer: group commit,
//! failure episodes; `commit/seal` holds sealing as retryable steps), `pool` (the commit
//! threads shared by all timelines, running any `pool::Task`), `recovery` (open-time repair),
//! `residence` (layers not on local disk: the source they are fetched from, eviction's clock),
//! `metrics`.
//!
//! Dependencies point one way: `timeline` -> `commit`, `recovery` -> `compact` -> `shared` ->
//! `index`, `manifest` -> `read` -> `layer_map` -> `residence` -> `layer` -> `segment` -> `format`,
//! `metrics`;
//! `pool` depends on nothing in storage.
//!
//! **Invariants:**
//! - ingested LSNs only grow: a batch's first LSN is above every LSN queued before it (after a
//!   failed round, above the last durable LSN: everything above it was refused);
//! - a batch is acknowledged only after it was written and fdatasync'd, and it is visible to
//!   readers (a read's plan, [`Timeline::last_durable_lsn`]) only then;
//! - value bytes are never held in memory beyond a read or a queued batch;
//! - nothing of a failed group stays in the active segment; after a failed write the timeline
//!   refuses ingests until a retry is due (then the next group is the retry), after a failed
//!   fsync for good (not retryable: the page cache may have dropped the dirty pages; reopening
//!   recovers);
//! - one `Timeline` per directory at a time, enforced by an exclusive `flock` on `lock`;
//! - the directory holds exactly the files its manifest lists (checked at every open), but for
//!   layers that are not resident, where the timeline has a source to fetch them from.

mod commit;
mod compact;
mod crc;
#[cfg(test)]
mod failure_tests;
mod format;
mod index;
mod layer;
mod layer_map;
mod manifest;
mod metrics;
mod pool;
mod read;
mod recovery;
mod residence;
mod segment;
mod shared;
#[cfg(test)]
mod test_support;
mod timeline;

use std::time::Duration;

use bytes::Bytes;
use page_types::{BufferTag, Lsn};

pub use compact::{
    CompactionConf, ImageRequest, Pass, PassKind, PassStats, Step, CHAIN_CAP_FACTOR, IMAGE_PIECE_BYTES,
};
pub use layer::DiskWait;
pub use metrics::{FsyncFailed, StorageMetrics};
pub(crate) use read::{Lookup, ReadPlan, ReadStart};
pub use residence::{tick as tick_read_clock, LayerSource, ResidentLayer, SourceRef, DOWNLOAD_PREFIX};
pub use timeline::{Ancestor, Timeline};

/// Creates the storage metrics and registers them in `registry`, with the counters of the
/// process's index block cache (which registers its own: `metrics` knows nothing of layers).
/// Fails if they are already there: create them once and share the `Arc`.
pub fn register_metrics(registry: &prometheus::Registry) -> anyhow::Result<StorageMetrics> {
    layer::block_index::BlockCache::register(registry)?;
    StorageMetrics::new(registry)
}

/// Default size at which the active segment is sealed into a layer (`layer_size`).
pub const DEFAULT_LAYER_SIZE: u64 = 64 << 20;
/// The active segment is also sealed once it holds this many values, whatever its size: its
/// index is in memory (each value's entry in the committer's list and in the index's map, about
/// 100 bytes together), and `layer_size` of small records would be a million of them. At most
/// about 25 MiB a timeline.
pub(crate) const MAX_ACTIVE_VALUES: usize = 1 << 18;
/// `layer_size` lies in `MIN_LAYER_SIZE..=MAX_LAYER_SIZE`.
pub const MIN_LAYER_SIZE: u64 = 64 << 10;
pub const MAX_LAYER_SIZE: u64 = 16 << 30;

/// Storage settings of a timeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageConf {
    /// The active segment is sealed into a layer once it is at least this large (bytes).
    pub layer_size: u64,
    /// Where layers not on local disk come from (remote storage): with one, a layer the
    /// manifest lists and the directory lacks is fetched when read, and layers can be evicted
    /// ([`Timeline::evict`]); without, such a layer fails the open.
    pub source: Option<SourceRef>,
}

impl Default for StorageConf {
    fn default() -> Self {
        StorageConf { layer_size: DEFAULT_LAYER_SIZE, source: None }
    }
}

/// A timeline's layer files as its manifest lists them ([`Timeline::layer_files`]), or as a copy
/// of the timeline lists them ([`create_from_copy`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerFiles {
    /// The manifest's generation: every layer's name carries one at most this.
    pub generation: u64,
    /// In the manifest's order (the layer map's runs, oldest first).
    pub layers: Vec<LayerFile>,
    pub gc_cutoff: Lsn,
}

/// One layer file of [`LayerFiles`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerFile {
    /// The file name (`layer_L...layer`, docs/storage-format.md).
    pub name: String,
    pub first_lsn: Lsn,
    pub last_lsn: Lsn,
    pub size: u64,
    /// The crc32c of the whole file; `None` for a layer listed before manifests had it.
    pub crc32c: Option<u32>,
}

impl LayerFiles {
    /// The layers' last LSN (0/0 without layers): everything durable at or below it when the
    /// manifest was written is in these layers.
    pub fn last_lsn(&self) -> Lsn {
        self.layers.iter().map(|l| l.last_lsn).max().unwrap_or(Lsn(0))
    }
}

/// Makes `dir`, which holds exactly the layer files `files` lists (copied from elsewhere, each
/// checked against its size and crc32c, fsynced), a timeline directory that
/// [`Timeline::open`] opens: writes its manifest (a generation above `files.generation`, so no
/// later seal or pass gives an existing name to other bytes) and an empty active segment.
/// Blocking.
pub fn create_from_copy(
    dir: &std::path::Path,
    files: &LayerFiles,
    metrics: &StorageMetrics,
) -> anyhow::Result<()> {
    recovery::create_from_copy(dir, files, metrics)
}

/// A value stored at a (key, lsn).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// A full page image, exactly [`page_types::PAGE_SIZE`] bytes.
    Image(Bytes),
    /// An opaque WAL redo record, 1..=[`page_types::MAX_RECORD_LEN`] bytes.
    Record(Bytes),
}

impl Value {
    fn bytes(&self) -> &Bytes {
        match self {
            Value::Image(b) | Value::Record(b) => b,
        }
    }

    fn kind(&self) -> format::Kind {
        match self {
            Value::Image(_) => format::Kind::Image,
            Value::Record(_) => format::Kind::Record,
        }
    }
}

/// Values to make durable together: all or none of them survive a crash.
#[derive(Debug, Clone, Default)]
pub struct IngestBatch {
    /// LSNs non-decreasing; the first above every LSN ingested before; no (key, lsn) twice.
    pub values: Vec<(BufferTag, Lsn, Value)>,
}

/// What a page at an LSN is rebuilt from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconstructData {
    /// The newest image at or below the requested LSN.
    pub image: Option<(Lsn, Bytes)>,
    /// Records above the image (or all, without one) up to the requested LSN, oldest first.
    pub records: Vec<(Lsn, Bytes)>,
}

/// The compaction work waiting in a timeline (see [`Timeline::backlog`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    pub keys: u64,
    /// Records ingested since the last compaction pass began (after an open: the records of
    /// the active segment).
    pub new_records: u64,
    /// The most of them for one key.
    pub longest_new_chain: u64,
    /// Frozen layers written by seals (not yet compacted): level 0.
    pub sealed_layers: u64,
    /// Runs of compaction outputs (each level 0 pass adds one above the others; a full pass
    /// leaves one): what a lookup may walk below level 0.
    pub runs: u64,
    /// Bytes of the bottom run (the last full pass's outputs) and of the runs above it.
    pub bottom_bytes: u64,
    pub upper_bytes: u64,
}

/// A compaction output and what the layers above it hold of its key range
/// ([`Timeline::overwritten`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overwritten {
    /// The layer's id (for [`Timeline::begin_gc`]; not stable across opens).
    pub layer: u32,
    /// Its size in bytes.
    pub size: u64,
    /// About how many bytes of the layers above it hold keys of its range.
    pub above: u64,
}

/// Counters describing a timeline's storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimelineStats {
    pub keys: u64,
    pub values: u64,
    pub layers: u64,
    /// Groups of layers a lookup looks at, one layer in each (see `layer_map::LayerMap`).
    pub runs: u64,
    /// Layers whose files are on local disk (the others are in the bucket only).
    pub resident_layers: u64,
    /// Bytes on local disk: the resident layers and the active segment.
    pub on_disk_bytes: u64,
    /// Bytes of the active segment's record copies (`format::COPIES_MAX` at most).
    pub record_copy_bytes: u64,
    pub last_durable_lsn: Lsn,
}

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("timeline is shutting down")]
    ShuttingDown,
    #[error("invalid ingest batch: {0}")]
    Invalid(String),
    #[error("ingest lsn went backwards: batch starts at {got}, last ingested is {last}")]
    LsnWentBackwards { last: Lsn, got: Lsn },
    /// A contiguous writer's batch ([`Timeline::submit_after`]) whose predecessor is no longer
    /// the last LSN queued: a failed group commit dropped what it queued after `last`.
    #[error(
        "ingest not contiguous: the batch follows {after}, but the last LSN queued is {last} \
         (a failed write dropped the batches in between)"
    )]
    NotContiguous { after: Lsn, last: Lsn },
    /// Writing to storage failed (this batch's group, or an earlier one: then the timeline
    /// refuses ingests until a retry is due). Nothing of the batch was stored.
    #[error("storage unavailable{}: {error}", if *.fatal { " for good (fatal, reopen the timeline)" } else { "" })]
    StorageUnavailable { error: String, fatal: bool },
    /// The committer went away without answering (a bug or a panic).
    #[error("storage I/O failed: {0:#}")]
    Io(anyhow::Error),
}

/// Why a timeline's storage writes are failing: what the tenant status shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageWriteError {
    /// The last error, with its context.
    pub error: String,
    /// When the current episode of failures began.
    pub since: std::time::SystemTime,
    /// An fsync failed: the timeline refuses ingests until it is reopened.
    pub fatal: bool,
}

/// Limits on what one read of a page (its plan) may read, checked from the in-memory index
/// before any value is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// Records above the newest image.
    pub max_records: usize,
    /// Bytes of the image and the records together.
    pub max_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum GetError {
    #[error("no value for {key:?} at or below lsn {lsn}")]
    NotFound { key: BufferTag, lsn: Lsn },
    /// Compaction may have dropped what a page below the GC cutoff needs.
    #[error("lsn {lsn} is below the gc cutoff {cutoff}: older page versions are garbage-collected")]
    BelowGcCutoff { lsn: Lsn, cutoff: Lsn },
    /// Rebuilding the page would need more than the read limits allow; nothing was read.
    #[error("page too expensive to rebuild: {0}")]
    TooLarge(String),
    #[error("storage read failed: {0:#}")]
    Io(anyhow::Error),
}

#[derive(Debug, thiserror::Error)]
pub enum WaitLsnError {
    #[error("timed out after {timeout:?} waiting for lsn {wanted}, last durable is {last_durable}")]
    Timeout { wanted: Lsn, last_durable: Lsn, timeout: Duration },
    #[error("timeline shut down while waiting for lsn {wanted}, last durable is {last_durable}")]
    ShuttingDown { wanted: Lsn, last_durable: Lsn },
    #[error("storage writes are failing, lsn {wanted} is above the last durable {last_durable}: {error}")]
    StorageUnavailable { wanted: Lsn, last_durable: Lsn, error: String },
}

/// Writes a small file durably: a temp file, fsync, rename over `name`, fsync of `dir`.
/// Readers see the old content or the new, never a mix; after a crash, one of the two.
pub fn durable_write(dir: &std::path::Path, name: &str, data: &[u8]) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::io::Write;
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut file = std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
    file.write_all(data).with_context(|| format!("write {}", tmp.display()))?;
    file.sync_all().with_context(|| format!("sync {}", tmp.display()))?;
    let path = dir.join(name);
    std::fs::rename(&tmp, &path)
        .with_context(|| format!("rename {} to {}", tmp.display(), path.display()))?;
    fsync_dir(dir)
}

/// Makes the entries of `dir` (creations, renames, removals) durable.
pub fn fsync_dir(dir: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("sync directory {}", dir.display()))
}

/// Checks a batch; returns its first and last LSN and encoded frame length.
pub(crate) fn validate(values: &[(BufferTag, Lsn, Value)]) -> Result<(Lsn, Lsn, usize), IngestError> {
    let invalid = |i: usize, what: String| {
        let (key, lsn, _) = &values[i];
        IngestError::Invalid(format!("value {i} ({key:?} at {lsn}): {what}"))
    };
    let (first, last) = match (values.first(), values.last()) {
        (Some(f), Some(l)) => (f.1, l.1),
        _ => return Err(IngestError::Invalid("empty batch".to_string())),
    };
    let mut seen = std::collections::HashSet::<BufferTag, ahash::RandomState>::default();
    for (i, (key, lsn, value)) in values.iter().enumerate() {
        value.kind().check_len(key, value.bytes().len()).map_err(|e| invalid(i, format!("{e}")))?;
        if i > 0 && *lsn < values[i - 1].1 {
            return Err(invalid(i, format!("lsn below the previous value's {}", values[i - 1].1)));
        }
        if i > 0 && *lsn != values[i - 1].1 {
            seen.clear();
        }
        if !seen.insert(*key) {
            return Err(invalid(i, "same key and lsn twice in the batch".to_string()));
        }
    }
    let frame_len = segment::frame_len(values);
    if frame_len > segment::FRAME_HEADER_LEN + segment::MAX_FRAME_BODY {
        return Err(IngestError::Invalid(format!(
            "batch encodes to {frame_len} bytes, more than {}",
            segment::MAX_FRAME_BODY
        )));
    }
    Ok((first, last, frame_len))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::test_support::*;
    use super::*;
    use page_types::{MAX_RECORD_LEN, PAGE_SIZE};

    #[test]
    fn lsn_displays_like_postgres() {
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(0).to_string(), "0/0");
    }

    #[test]
    fn metrics_registered_twice_in_one_registry_fail_and_names_are_prefixed() {
        let registry = prometheus::Registry::new();
        let m = register_metrics(&registry).unwrap();
        m.fsync(|| Ok(())).unwrap();
        assert!(register_metrics(&registry).is_err());
        let families = registry.gather();
        assert_eq!(families.len(), 20);
        assert!(families.iter().all(|f| f.name().starts_with("pageserver_storage_")));
        assert_eq!(m.fsyncs.get(), 1);
    }

    #[test]
    fn validate_returns_lsn_range_and_frame_length_of_a_good_batch() {
        let b = batch(vec![(key(1), 5, record("ab")), (key(2), 5, image(0)), (key(1), 9, record("c"))]);
        let (first, last, len) = validate(&b.values).unwrap();
        assert_eq!((first, last), (Lsn(5), Lsn(9)));
        assert_eq!(len, segment::frame_len(&b.values));
    }

    #[tokio::test]
    async fn get_of_unknown_key_or_below_first_value_is_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        assert!(matches!(tl.get_reconstruct_data(key(1), Lsn(5), NO_LIMITS), Err(GetError::NotFound { .. })));
        tl.ingest(batch(vec![(key(1), 10, record("a"))])).await.unwrap();
        let err = tl.get_reconstruct_data(key(1), Lsn(9), NO_LIMITS).unwrap_err();
        assert!(matches!(err, GetError::NotFound { lsn: Lsn(9), .. }), "{err}");
        assert!(matches!(
            tl.get_reconstruct_data(key(2), Lsn(10), NO_LIMITS),
            Err(GetError::NotFound { .. })
        ));
    }

    #[tokio::test]
    async fn ingest_starting_at_or_below_last_lsn_is_rejected_as_backwards() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        tl.ingest(batch(vec![(key(1), 10, record("a")), (key(2), 20, record("b"))])).await.unwrap();
        for got in [20, 15, 1] {
            let err = tl.ingest(batch(vec![(key(3), got, record("x"))])).await.unwrap_err();
            match err {
                IngestError::LsnWentBackwards { last, got: g } => {
                    assert_eq!((last, g), (Lsn(20), Lsn(got)));
                }
                other => panic!("unexpected {other}"),
            }
        }
        let err = tl.ingest(batch(vec![(key(3), 0, record("x"))])).await.unwrap_err();
        assert!(err.to_string().contains("last ingested is 0/14"), "{err}");
        tl.ingest(batch(vec![(key(3), 21, record("c"))])).await.unwrap();
        assert!(matches!(
            tl.get_reconstruct_data(key(3), Lsn(20), NO_LIMITS),
            Err(GetError::NotFound { .. })
        ));
    }

    #[tokio::test]
    async fn invalid_batches_are_rejected_and_write_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let tl = open(dir.path(), DEFAULT_LAYER_SIZE, &metrics());
        tl.ingest(batch(vec![(key(1), 10, record("a"))])).await.unwrap();
        let before = tl.stats();
        let file_len = || std::fs::metadata(dir.path().join("active.seg")).unwrap().len();
        let len_before = file_len();
        let short_image = Value::Image(Bytes::from(vec![0u8; PAGE_SIZE - 1]));
        let long_record = Value::Record(Bytes::from(vec![0u8; MAX_RECORD_LEN + 1]));
        let cases = vec![
            ("empty batch", vec![]),
            ("image of 8191", vec![(key(2), 20, record("ok")), (key(2), 21, short_image)]),
            ("record of 0", vec![(key(2), 20, Value::Record(Bytes::new()))]),
            ("record of 16385", vec![(key(2), 20, long_record)]),
            ("below the previous", vec![(key(2), 30, record("a")), (key(3), 29, record("b"))]),
            ("twice", vec![(key(2), 30, record("a")), (key(3), 30, record("b")), (key(2), 30, record("c"))]),
        ];
        for (want, values) in cases {
            let err = tl.ingest(batch(values)).await.unwrap_err();
            assert!(matches!(err, IngestError::Invalid(_)), "{want}: {err}");
            assert!(err.to_string().contains(want), "{want}: {err}");
        }
        assert_eq!(tl.stats(), before);
        assert_eq!(file_len(), len_before);
        // The rejected batches did not advance the LSN either.
        tl.ingest(batch(vec![(key(2), 11, record("b"))])).await.unwrap();
    }
}
