//! Compaction of a timeline's layers: one **pass** rewrites the frozen layers from a point of
//! the list up ([`PassKind`]: all of them, level 0, or level 0 and the newest runs) into one run
//! of key-sorted layers in their place, creating page images where record chains are long and
//! dropping what no GetPage at or above the GC cutoff can need; or (a GC pass) rewrites one
//! compaction output anywhere in the list without what newer images above it shadow. A pass is resumable: it walks
//! the keys in order with a cursor, in slices of bounded time ([`Pass::run_slice`]), so its
//! caller decides when and how much of it runs (`crate::compaction`, the time-sliced driver).
//!
//! Per key (its values in the input layers, oldest first, after its *context*: when the inputs
//! hold no image of it, its values below them from its newest image there on, read to rebuild
//! pages and never written):
//! - **GC**: values older than the newest image at or below the cutoff are dropped;
//! - **image creation**: if at least `image_threshold` records holding `image_bytes` sit
//!   above the key's newest image, or [`CHAIN_CAP_FACTOR`] times that many records of any
//!   size, or more than one redo request can take, the pass asks its caller for the page at
//!   the key's newest LSN ([`Step::NeedImage`]: storage knows nothing of redo) and writes that
//!   image in place of the record at that LSN (and, if that LSN is at or below the cutoff, in
//!   place of everything older). A chain of more than [`IMAGE_PIECE_BYTES`] (or
//!   `MAX_RECORDS_PER_REQUEST` records) is rebuilt in **pieces**, oldest first: each piece's
//!   page is asked for from the previous piece's page and the piece's records, and is written
//!   as an image in place of the piece's last record. So every retained LSN is readable within
//!   one redo request's limits, and an image request reads at most [`IMAGE_PIECE_BYTES`];
//! - the kept values are copied back to back into the current output, one span (at most 1 MiB)
//!   at a time, so that a key's values in a compacted layer are adjacent and a read of it is
//!   one `pread` per MiB. A pass holds a bounded amount of value bytes, whatever a key's size:
//!   one span being copied, the output's write buffer, the page of the last piece, and what an
//!   image request reads (its caller reserves that before reading it).
//!
//! Crash safety (docs/storage-format.md, "Compaction"): the pass starts by recording its intent
//! (and the new GC cutoff) in the manifest; outputs are written under temporary names, fsynced,
//! renamed to their layer names; one manifest write swaps the inputs for the outputs and lists
//! the inputs for deletion; then the inputs are deleted (one that cannot be stays listed for
//! later). Recovery removes the leftovers of a pass that did not install, and deletes listed
//! inputs that survived. A failed fsync is fatal for the timeline, as in the committer; an
//! install whose manifest was renamed into place but not made durable keeps both its inputs
//! and its outputs.
//!
//! **Invariants:** the inputs are a contiguous range of the list at the start of the pass (from a
//! point up, or one layer), and only compaction removes layers (one pass at a time), so they
//! still are at install (seals add layers above them); the outputs cover no key or LSN outside
//! the inputs' ranges, so every layer that shares a key with them is still wholly above or
//! below them and the layer map's order holds; an image is placed only at an LSN of the
//! inputs; a GC pass drops a key's values only below an image at or below the cutoff (its
//! own, or one in a layer above it, which the layer map's order makes newer); a key keeps every value a
//! read at or above the cutoff needs (the suffix from its newest image at or below the cutoff),
//! so a read at a retained LSN sees the same page before and after; the GC cutoff only grows
//! and is durable before anything below it is dropped; nothing here waits for another thread.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use page_types::{BufferTag, Lsn};
use serde::Serialize;

use super::format::{self, IndexEntry, Kind, FILE_HEADER_LEN};
use super::layer::{self, DiskWait, LayerName, Level};
use super::layer_map::{Frozen, LayerMap};
use super::manifest::{CompactIntent, LayerMeta, RenamedNotSynced};
use super::read::{read_run, Picked, ReadPlan, ReadSize};
use super::segment::open_data_file;
use super::shared::Shared;
use super::{GetError, ReadLimits, ReconstructData};
use crate::util::lock;

/// Prefix of an output's temporary name (`.compact_<generation>_<n>.tmp`); recovery removes such files.
pub(crate) const TMP_PREFIX: &str = ".compact_";
/// Bytes of values buffered before an output write.
const WRITE_BUFFER: usize = 256 << 10;
/// Most bytes of values (the base image and the records) one image of a pass is rebuilt from:
/// a longer chain is rebuilt in pieces (see the module doc). Bounds the memory of an image
/// request and what a GetPage at any LSN of the chain reads afterwards, at the cost of an 8 KiB
/// image per MiB of records.
pub const IMAGE_PIECE_BYTES: u64 = 1 << 20;

/// A chain of this many times `image_threshold` records above a key's newest image gets an
/// image whatever its bytes: bounds the records a GetPage redoes after a pass (the compactor's
/// hot-key debt counts in the same unit, so the key that makes a pass due gets its image there).
pub const CHAIN_CAP_FACTOR: usize = 4;

/// What a pass does; see the module doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactionConf {
    /// Records above a key's newest image from which the pass creates an image, once they
    /// also hold `image_bytes` ([`CompactionConf::wants_image`]).
    pub image_threshold: usize,
    /// Bytes of records above a key's newest image that make an image worth writing (the
    /// daemon: a page, so that an 8 KiB image is not written for a few short records; 0: the
    /// record count alone decides).
    pub image_bytes: u64,
    /// GetPage stays possible at LSNs at most this far below the last durable LSN; older
    /// versions may be dropped.
    pub gc_horizon: u64,
    /// Outputs are cut at a key boundary once they reach this size (bytes).
    pub layer_size: u64,
}

impl CompactionConf {
    /// Whether a chain of `records` records holding `bytes` bytes above a key's newest image
    /// gets an image: at least `image_threshold` records that hold `image_bytes`, or
    /// [`CHAIN_CAP_FACTOR`] times `image_threshold` records of any size. So the bytes a pass
    /// writes in images follow the bytes of records ingested (8 records of 51 bytes make no
    /// 8 KiB image), and a GetPage's chain stays bounded.
    pub fn wants_image(&self, records: usize, bytes: u64) -> bool {
        let threshold = self.image_threshold.max(1);
        (records >= threshold && bytes >= self.image_bytes)
            || records >= threshold.saturating_mul(CHAIN_CAP_FACTOR)
    }
}

/// Which layers a pass takes: the frozen layers from a point of the list up (the newest). The
/// layers below are not rewritten; a key's values there are read only as the context of an
/// image the pass makes. The outputs, one run of layers disjoint in keys, take the inputs'
/// place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PassKind {
    /// Every frozen layer: the whole timeline is rewritten and GC applies to all of it; the
    /// outputs are the one bottom run.
    #[default]
    Full,
    /// The sealed layers above the last run (level 0): the cost follows what was ingested
    /// since the last pass.
    Level0,
    /// The newest runs above the bottom one (size-tiered, [`upper_split`]) and level 0:
    /// merges the runs level 0 passes stacked up, so lookups walk few runs; the cost follows
    /// what changed since the last full pass.
    Upper,
    /// GC of one compaction output ([`super::Timeline::begin_gc`]), wherever it is in the list:
    /// a key's values there are dropped when a layer above holds an image of the key at or
    /// below the cutoff (or the layer itself a newer one), so garbage below the newest runs
    /// does not wait for a full pass. No images are made. The pass first *surveys* its layer
    /// (index blocks only, nothing written) and writes it again only if at least
    /// [`GC_MIN_GARBAGE`] of its bytes would go; else it ends with nothing changed.
    Gc,
}

/// The share of a layer's bytes a GC pass must find droppable to rewrite it: rewriting costs
/// the layer's size in writes, so this bounds that cost to 4 bytes per byte collected.
pub const GC_MIN_GARBAGE: f64 = 0.25;

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PassStats {
    pub kind: PassKind,
    pub input_layers: u64,
    /// Values in the input layers: each is read once, so `values_read` over this is how far a
    /// pass has got.
    pub input_values: u64,
    pub output_layers: u64,
    pub keys: u64,
    pub values_read: u64,
    pub values_written: u64,
    /// Values dropped: below the GC cutoff, or replaced by a new image.
    pub values_dropped: u64,
    pub images_created: u64,
    /// Images that could not be created (redo failed); the key kept its values.
    pub image_failures: u64,
    /// Images not asked for because the caller knew their chain cannot be redone
    /// ([`Pass::skip_image`]); the key kept its values.
    pub images_skipped: u64,
    pub bytes_before: u64,
    pub bytes_written: u64,
    /// Input files deleted after the install.
    pub files_deleted: u64,
    /// The GC cutoff the pass applied.
    pub gc_cutoff: Lsn,
    /// A GC pass: bytes of values its survey found droppable.
    pub garbage_bytes: u64,
    /// A GC pass that found too little to drop ([`GC_MIN_GARBAGE`]): it wrote nothing and its
    /// layer stays as it was.
    pub skipped: bool,
}

/// A page the pass needs reconstructed: `key` as of `lsn`, from an image and the records above
/// it: at most `MAX_RECORDS_PER_REQUEST` records, and [`IMAGE_PIECE_BYTES`] read (values and
/// the gaps read with them) and held, unless one record alone is more.
/// Nothing is read yet: reserve what it holds ([`ImageRequest::bytes`]), then
/// [`ImageRequest::read`].
pub struct ImageRequest {
    pub key: BufferTag,
    pub lsn: Lsn,
    /// The LSN of the image the records apply to (the key's newest image, or the page of the
    /// previous piece); `None` if there is none (the chain starts from nothing).
    pub from: Option<Lsn>,
    /// The page of the previous piece, when this pass made it (else the plan reads the image).
    base: Option<(Lsn, Bytes)>,
    plan: ReadPlan,
}

impl ImageRequest {
    /// Bytes of values the request holds once read: what it reads and the base image it has.
    pub fn bytes(&self) -> u64 {
        self.plan.bytes() + self.base.as_ref().map_or(0, |(_, b)| b.len() as u64)
    }

    /// Values it holds once read: the base image, if any, and the records.
    pub fn values(&self) -> usize {
        self.plan.values() + usize::from(self.base.is_some())
    }

    /// Reads the image and records, checking their checksums. Blocking: call it off the
    /// async executor.
    pub fn read(self) -> anyhow::Result<ReconstructData> {
        let mut data = self
            .plan
            .execute()
            .with_context(|| format!("read {:?} up to lsn {} for its image", self.key, self.lsn))?;
        if self.base.is_some() {
            data.image = self.base;
        }
        Ok(data)
    }
}

impl std::fmt::Debug for ImageRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageRequest")
            .field("key", &self.key)
            .field("lsn", &self.lsn)
            .field("from", &self.from)
            .field("values", &self.values())
            .field("bytes", &self.bytes())
            .finish()
    }
}

/// What a slice ended with.
#[derive(Debug)]
pub enum Step {
    /// Out of time; call [`Pass::run_slice`] again.
    Continue,
    /// Reconstruct this page and hand it to [`Pass::provide_image`] before the next slice.
    NeedImage(ImageRequest),
    /// Installed; the pass is over.
    Done(PassStats),
}

/// Where a pass of kind [`PassKind::Upper`] starts, given the sizes of the runs (oldest first):
/// the run from which the newest runs are merged, size-tiered: from the newest run down, a run
/// joins while it is no larger than the runs above it together (at least two join), and the
/// bottom run never does. So a byte is merged again only when the runs above it have grown as
/// large as it: about log2(runs' bytes / a level 0 pass's bytes) times before a full pass.
/// `None` with fewer than two runs above the bottom one.
pub(crate) fn upper_split(sizes: &[u64]) -> Option<usize> {
    let newest = sizes.len().checked_sub(1).filter(|&n| n >= 2)?;
    let mut pile = sizes[newest];
    let mut from = newest - 1;
    pile += sizes[from];
    while from > 1 && sizes[from - 1] <= pile {
        from -= 1;
        pile += sizes[from];
    }
    Some(from)
}

/// A key's values, oldest first: first its *context* (for a pass whose inputs hold no
/// image of the key: the key's values in the layers below the inputs, from its newest image
/// there on; they are read for images, never written), then its run of entries in each input
/// layer that holds it (the inputs are oldest first, and layers that share a key do not
/// overlap in LSN), copied out of the layers' indexes.
struct KeyValues {
    runs: Vec<(Arc<File>, Vec<IndexEntry>)>,
    len: usize,
    /// The first `context` values are the context.
    context: usize,
}

impl KeyValues {
    fn of(inputs: &[Arc<Frozen>], below: &[Arc<Frozen>], key: BufferTag) -> anyhow::Result<KeyValues> {
        let mut runs = Vec::new();
        for l in inputs {
            let r = l.resident(DiskWait::Allowed)?;
            let entries = r.lookup(key, Lsn(u64::MAX), DiskWait::Allowed)?;
            if !entries.is_empty() {
                runs.push((Arc::clone(&r.file), entries));
            }
        }
        let has_image = runs.iter().any(|(_, r)| r.iter().any(|e| e.kind == Kind::Image));
        let mut context = Vec::new();
        if !has_image {
            // Newest layer first, down to the newest image.
            for l in below.iter().rev() {
                let r = l.resident(DiskWait::Allowed)?;
                let mut entries = r.lookup(key, Lsn(u64::MAX), DiskWait::Allowed)?;
                if let Some(i) = entries.iter().rposition(|e| e.kind == Kind::Image) {
                    entries.drain(..i);
                    context.push((Arc::clone(&r.file), entries));
                    break;
                }
                if !entries.is_empty() {
                    context.push((Arc::clone(&r.file), entries));
                }
            }
        }
        let context_len = context.iter().map(|(_, r)| r.len()).sum();
        let runs: Vec<_> = context.into_iter().rev().chain(runs).collect();
        let len = runs.iter().map(|(_, r)| r.len()).sum();
        Ok(KeyValues { runs, len, context: context_len })
    }

    /// The values from the `from`th on, with their files (skipping whole runs, so that a key of
    /// many pieces is not walked from its start for each).
    fn iter_from(&self, mut from: usize) -> impl Iterator<Item = (&Arc<File>, &IndexEntry)> {
        let mut first = self.runs.len();
        for (i, (_, r)) in self.runs.iter().enumerate() {
            if from < r.len() {
                first = i;
                break;
            }
            from -= r.len();
        }
        self.runs[first..].iter().enumerate().flat_map(move |(i, (file, r))| {
            let start = if i == 0 { from } else { 0 };
            r[start..].iter().map(move |e| (file, e))
        })
    }

    fn get(&self, i: usize) -> anyhow::Result<(&Arc<File>, &IndexEntry)> {
        self.iter_from(i).next().with_context(|| format!("value {i} of a key of {}", self.len))
    }

    /// The file of the `from`th value and the entries of that file from it on.
    fn run_from(&self, mut from: usize) -> anyhow::Result<(&Arc<File>, &[IndexEntry])> {
        for (file, r) in &self.runs {
            if from < r.len() {
                return Ok((file, &r[from..]));
            }
            from -= r.len();
        }
        anyhow::bail!("value past the end of a key of {}", self.len)
    }
}

/// The key a pass is working on: what it keeps, and its images as they are made. Values are
/// written in order; `next` is the first not yet written (those before it are written or
/// dropped).
struct KeyWork {
    key: BufferTag,
    values: KeyValues,
    next: usize,
    /// Values up to here (excluded) are due to be written now.
    copy_until: usize,
    /// A new image at or below the cutoff, in place of the value `next`: written unless a
    /// newer one at or below the cutoff comes (which drops it and what is before).
    held: Option<(usize, Bytes)>,
    /// A new image above the cutoff, in place of the value at its index (`copy_until - 1`).
    image_at: Option<(usize, Bytes)>,
    /// While images are still to be made: the first record of the next piece.
    piece_start: Option<usize>,
    /// The page of the last piece, which the next piece starts from.
    base: Option<(Lsn, Bytes)>,
    /// The last value of the piece whose page was asked for, and the answer once provided.
    asked: Option<usize>,
    answer: Option<Option<Bytes>>,
    /// Values written, images included.
    written: usize,
}

/// Where a key's work stopped.
enum KeyStep {
    Done,
    OutOfTime,
    NeedImage(ImageRequest),
}

/// The output being written.
struct OutputWriter {
    tmp: PathBuf,
    file: Arc<File>,
    /// Bytes on disk (header and flushed values).
    len: u64,
    /// The crc32c of the first `len` bytes.
    crc: u32,
    buf: Vec<u8>,
    entries: Vec<IndexEntry>,
}

/// A finished output: its manifest entry and its index.
struct Output {
    meta: LayerMeta,
    layer: Arc<Frozen>,
}

/// One compaction pass of a timeline. See the module doc.
pub struct Pass {
    shared: Arc<Shared>,
    dir_file: File,
    conf: CompactionConf,
    inputs: Vec<Arc<Frozen>>,
    /// The layers below the inputs (none for a full pass): where a key's context comes from.
    below: Vec<Arc<Frozen>>,
    /// A GC pass: the layers above its input, where a newer image makes the input's values of
    /// a key garbage.
    above: Option<LayerMap>,
    /// A GC pass, first walk: decisions only, nothing read beyond index blocks or written.
    survey: bool,
    cutoff: Lsn,
    /// The last key begun; `None` before the first.
    cursor: Option<BufferTag>,
    /// The key begun and not done.
    current: Option<KeyWork>,
    /// The span being copied (reused).
    copy_buf: Vec<u8>,
    writer: Option<OutputWriter>,
    outputs: Vec<Output>,
    /// The generation of the manifest that recorded this pass: its outputs' names carry it.
    generation: u64,
    /// The number of the next output of this pass (its temporary file's name).
    next_output: u64,
    stats: PassStats,
    installed: bool,
    /// The install's manifest was renamed into place without being made durable: the inputs
    /// and the outputs both stay, whichever manifest a crash leaves (the timeline has failed
    /// for good; the next open sorts it out).
    outcome_unknown: bool,
}

impl Pass {
    /// Starts a pass of `kind`, recording its intent and GC cutoff in the manifest. `None` if
    /// there are no layers to take. Refused once the timeline has failed for good.
    /// `gc_layer` is the input of a [`PassKind::Gc`] (ignored for other kinds).
    pub(super) fn begin(
        shared: &Arc<Shared>,
        conf: CompactionConf,
        kind: PassKind,
        gc_layer: Option<u32>,
    ) -> anyhow::Result<Option<Pass>> {
        if let Some(error) = shared.fatal_error() {
            anyhow::bail!("storage failed for good, no compaction until the timeline is reopened: {error}");
        }
        let (mut inputs, runs) = {
            let index = shared.index.read().unwrap_or_else(PoisonError::into_inner);
            (index.layers().to_vec(), index.runs())
        };
        // The first input, and (a GC pass) the end of the inputs: the layers above are read.
        let (split, end) = match kind {
            PassKind::Full => (0, inputs.len()),
            // The sealed layers above the last compaction output.
            PassKind::Level0 => {
                (inputs.iter().rposition(|l| l.compacted()).map_or(0, |i| i + 1), inputs.len())
            }
            PassKind::Upper => {
                let size = |r: &std::ops::Range<usize>| inputs[r.clone()].iter().map(|l| l.size).sum::<u64>();
                let split = upper_split(&runs.iter().map(size).collect::<Vec<_>>())
                    .map_or(inputs.len(), |run| runs[run].start);
                (split, inputs.len())
            }
            PassKind::Gc => {
                let at = gc_layer.and_then(|id| inputs.iter().position(|l| l.id == id && l.compacted()));
                let Some(at) = at else {
                    return Ok(None);
                };
                (at, at + 1)
            }
        };
        let above = (kind == PassKind::Gc).then(|| LayerMap::new(inputs.split_off(end)));
        let taken = inputs.split_off(split);
        let below = std::mem::replace(&mut inputs, taken);
        // No context for a GC pass: it makes no images.
        let below = if kind == PassKind::Gc { Vec::new() } else { below };
        let above_layers = above.iter().flat_map(|m| m.layers());
        let Some(top) = inputs.iter().chain(above_layers).map(|l| l.last_lsn).max() else {
            return Ok(None);
        };
        let durable = *shared.durable.borrow();
        let horizon = Lsn(durable.0.saturating_sub(conf.gc_horizon)).min(top);
        let cutoff = {
            // Chosen and raised under the branch points' lock: a branch is made at or above
            // the cutoff, and the cutoff stays at or below every branch point.
            let points = lock(&shared.branch_points);
            let lowest = points.keys().next().map_or(horizon, |&point| horizon.min(point));
            let cutoff = Lsn(shared.gc_cutoff.load(Ordering::Relaxed)).max(lowest);
            shared.gc_cutoff.fetch_max(cutoff.0, Ordering::Relaxed);
            cutoff
        };
        let dir_file = File::open(&shared.dir).context("open timeline directory")?;
        let mut generation = 0;
        shared
            .update_manifest(&dir_file, |m| {
                generation = m.generation + 1;
                // A pass that did not finish may have left outputs from its first generation on.
                let before = m.compacting.take().unwrap_or_default();
                let first = before.first_generation.unwrap_or(generation);
                m.compacting = Some(CompactIntent { first_generation: Some(first), ..before });
                m.gc_cutoff = m.gc_cutoff.max(cutoff.0);
            })
            .context("record compaction intent")
            .inspect_err(|e| shared.record_if_fatal(e))?;
        if kind != PassKind::Gc {
            // Records ingested from here on are the next pass's debt (also the few that reached
            // the active segment since the caller sealed it, which this pass does not take).
            shared.index.write().unwrap_or_else(PoisonError::into_inner).reset_new_records();
        }
        let stats = PassStats {
            kind,
            input_layers: inputs.len() as u64,
            input_values: inputs.iter().map(|l| l.values()).sum(),
            bytes_before: inputs.iter().map(|l| l.size).sum(),
            gc_cutoff: cutoff,
            ..PassStats::default()
        };
        Ok(Some(Pass {
            shared: Arc::clone(shared),
            dir_file,
            conf,
            inputs,
            below,
            survey: above.is_some(),
            above,
            cutoff,
            cursor: None,
            current: None,
            copy_buf: Vec::new(),
            writer: None,
            outputs: Vec::new(),
            generation,
            next_output: 0,
            stats,
            installed: false,
            outcome_unknown: false,
        }))
    }

    /// Runs the pass for about `budget` (checked after each key, and after each span of a
    /// long key's copy), blocking on file I/O: call it off the async executor. After
    /// `NeedImage`, call [`Pass::provide_image`] first.
    ///
    /// An error ends the pass. One that is fatal (a failed fsync, an install whose outcome is
    /// unknown) makes the timeline fail for good, as the committer's do: nothing more is written
    /// until it is reopened.
    pub fn run_slice(&mut self, budget: Duration) -> anyhow::Result<Step> {
        self.slice(budget).inspect_err(|e| self.shared.record_if_fatal(e))
    }

    fn slice(&mut self, budget: Duration) -> anyhow::Result<Step> {
        let deadline = Instant::now().checked_add(budget);
        loop {
            let mut w = match self.current.take() {
                Some(w) => w,
                None => {
                    let mut next = None;
                    for l in &self.inputs {
                        if let Some(k) = l.next_key(self.cursor)? {
                            next = Some(next.map_or(k, |n: BufferTag| n.min(k)));
                        }
                    }
                    let Some(key) = next else {
                        if self.survey {
                            self.survey = false;
                            self.cursor = None;
                            let worth = self.stats.bytes_before as f64 * GC_MIN_GARBAGE;
                            if (self.stats.garbage_bytes as f64) < worth || self.stats.garbage_bytes == 0 {
                                self.stats.skipped = true;
                                return Ok(Step::Done(self.stats.clone()));
                            }
                            continue;
                        }
                        let stats = self.install()?;
                        return Ok(Step::Done(stats));
                    };
                    self.cursor = Some(key);
                    let w = self.start_key(key)?;
                    if self.survey {
                        let dropped = w.values.iter_from(0).take(w.next).map(|(_, e)| u64::from(e.len));
                        self.stats.garbage_bytes += dropped.sum::<u64>();
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            return Ok(Step::Continue);
                        }
                        continue;
                    }
                    self.stats.keys += 1;
                    self.stats.values_read += (w.values.len - w.values.context) as u64;
                    w
                }
            };
            match self.work_on(&mut w, deadline)? {
                KeyStep::NeedImage(request) => {
                    self.current = Some(w);
                    return Ok(Step::NeedImage(request));
                }
                KeyStep::OutOfTime => {
                    self.current = Some(w);
                    return Ok(Step::Continue);
                }
                KeyStep::Done => self.end_key(w)?,
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(Step::Continue);
            }
        }
    }

    /// The page asked for by the last `NeedImage`, or `None` if it could not be rebuilt (the
    /// key then keeps its values from there on as they are).
    pub fn provide_image(&mut self, page: Option<Bytes>) {
        if let Some(w) = self.current.as_mut().filter(|w| w.asked.is_some()) {
            w.answer = Some(page);
        }
    }

    /// In place of [`Pass::provide_image`]: the page asked for by the last `NeedImage` is not
    /// rebuilt (its caller knows the redo would fail); the key keeps its values from there on
    /// as they are, as after a failed one, and counts in `images_skipped`.
    pub fn skip_image(&mut self) {
        if let Some(w) = self.current.as_mut().filter(|w| w.asked.is_some()) {
            w.asked = None;
            w.answer = None;
            w.piece_start = None;
            self.stats.images_skipped += 1;
        }
    }

    /// Where the pass is: keys done and values read so far (of `input_values`).
    pub fn stats(&self) -> &PassStats {
        &self.stats
    }

    /// Looks at `key`'s values: which it keeps, and whether it needs images.
    fn start_key(&mut self, key: BufferTag) -> anyhow::Result<KeyWork> {
        let values = KeyValues::of(&self.inputs, &self.below, key)?;
        let (mut keep_from, mut base) = (0, None);
        for (i, (_, e)) in values.iter_from(0).enumerate() {
            if e.kind == Kind::Image {
                base = Some(i);
                if e.lsn <= self.cutoff {
                    keep_from = i;
                }
            }
        }
        // The context is never written (it stays in its layers).
        let mut keep_from = keep_from.max(values.context);
        if let Some(above) = &self.above {
            if above.has_image(key, self.cutoff)? {
                // A read at or above the cutoff stops at that image, above this layer.
                keep_from = values.len;
            }
        }
        let start = base.map_or(0, |i| i + 1);
        let chain = values.len - start;
        let record_bytes: u64 = values.iter_from(start).map(|(_, e)| u64::from(e.len)).sum();
        let base_bytes = base.map_or(Ok(0), |i| values.get(i).map(|(_, e)| u64::from(e.len)))?;
        let fits = chain <= page_types::MAX_RECORDS_PER_REQUEST
            && base_bytes + record_bytes <= page_types::MAX_RECONSTRUCT_BYTES;
        let imaging =
            self.above.is_none() && chain > 0 && (!fits || self.conf.wants_image(chain, record_bytes));
        Ok(KeyWork {
            key,
            values,
            next: keep_from,
            copy_until: keep_from,
            held: None,
            image_at: None,
            piece_start: imaging.then_some(start),
            base: None,
            asked: None,
            answer: None,
            written: 0,
        })
    }

    /// Goes on with `w` until it is done, needs an image, or (after some copying) is past
    /// `deadline`.
    fn work_on(&mut self, w: &mut KeyWork, deadline: Option<Instant>) -> anyhow::Result<KeyStep> {
        if let Some(end) = w.asked.take() {
            let answer = w.answer.take().context("compaction slice run before its image was provided")?;
            self.took_image(w, end, answer)?;
        }
        let mut copied = false;
        loop {
            if w.next < w.copy_until {
                if copied && deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(KeyStep::OutOfTime);
                }
                self.copy_some(w)?;
                copied = true;
            } else if let Some(start) = w.piece_start {
                if let Some(request) = self.next_piece(w, start)? {
                    return Ok(KeyStep::NeedImage(request));
                }
            } else if w.copy_until < w.values.len {
                w.copy_until = w.values.len;
            } else {
                return Ok(KeyStep::Done);
            }
        }
    }

    /// Takes the answer to the image of the piece ending at value `end`.
    fn took_image(&mut self, w: &mut KeyWork, end: usize, page: Option<Bytes>) -> anyhow::Result<()> {
        let Some(page) = page else {
            // The records from the last image on stay as they are.
            self.stats.image_failures += 1;
            w.piece_start = None;
            return Ok(());
        };
        self.stats.images_created += 1;
        let lsn = w.values.get(end)?.1.lsn;
        w.base = Some((lsn, page.clone()));
        w.piece_start = Some(end + 1).filter(|&i| i < w.values.len);
        if lsn <= self.cutoff {
            // Everything older is dropped, an older image held too.
            w.next = end;
            w.copy_until = w.copy_until.max(end);
            w.held = Some((end, page));
        } else {
            w.image_at = Some((end, page));
            w.copy_until = end + 1;
        }
        Ok(())
    }

    /// The request for the next piece of `w`'s chain, from its first record `start`; `None`
    /// (and no more pieces) when the chain is done.
    fn next_piece(&mut self, w: &mut KeyWork, start: usize) -> anyhow::Result<Option<ImageRequest>> {
        if start >= w.values.len {
            w.piece_start = None;
            return Ok(None);
        }
        // What the piece reads (gaps read with its values included) and holds.
        let mut picked = Picked::with_capacity(64);
        let mut size = ReadSize::default();
        let base = w.base.as_ref().map_or(0, |(_, page)| page.len() as u64);
        if w.base.is_none() && start > 0 {
            // The first piece: from the key's newest image, the value before it.
            let (file, e) = w.values.get(start - 1)?;
            size.add(file, e);
            picked.push(file, e, None);
        }
        let (mut records, mut end) = (0, start);
        for (i, (file, e)) in w.values.iter_from(start).enumerate() {
            let over = records == page_types::MAX_RECORDS_PER_REQUEST
                || base + size.bytes() + size.cost(file, e) > IMAGE_PIECE_BYTES;
            if records > 0 && over {
                break;
            }
            size.add(file, e);
            records += 1;
            end = start + i;
            picked.push(file, e, None);
        }
        if end < w.values.context {
            // The first piece ends in the context (a long chain below the inputs): an image can
            // take only an input's place, so this pass makes none for the key.
            w.piece_start = None;
            return Ok(None);
        }
        let lsn = w.values.get(end)?.1.lsn;
        let mut from = match &w.base {
            Some((at, _)) => Some(*at),
            // The first piece: from the key's newest image, if it has one.
            None if start > 0 => Some(w.values.get(start - 1)?.1.lsn),
            None => None,
        };
        if let (None, None, Some(a)) = (from, &w.base, &self.shared.ancestor) {
            // A branch's chain with no image of its own: it begins in the ancestor, whose values
            // for the key at the branch point come first, within what the piece leaves.
            let rest = ReadLimits {
                max_records: page_types::MAX_RECORDS_PER_REQUEST.saturating_sub(records),
                max_bytes: IMAGE_PIECE_BYTES.saturating_sub(size.bytes()),
            };
            match a.shared.pick_at(w.key, a.lsn, rest, DiskWait::Allowed) {
                Ok(None) | Err(GetError::NotFound { .. }) => {}
                Ok(Some(below)) => {
                    from = below.starts_with_image().then(|| below.oldest_lsn()).flatten();
                    picked = below.followed_by(picked);
                }
                Err(GetError::TooLarge(_) | GetError::BelowGcCutoff { .. }) => {
                    // Too long a chain there for one request (the ancestor's compaction will
                    // image it): no image of the key this pass, as for a chain in the context.
                    self.stats.images_skipped += 1;
                    w.piece_start = None;
                    return Ok(None);
                }
                Err(GetError::Io(e)) => return Err(e.context(format!("read {:?} in the ancestor", w.key))),
            }
        }
        w.asked = Some(end);
        Ok(Some(ImageRequest { key: w.key, lsn, from, base: w.base.clone(), plan: ReadPlan::new(picked) }))
    }

    /// Writes what comes next of `w`: a new image in place of the value `next`, or the values
    /// from `next` that one span holds (up to `copy_until` and to a new image's place).
    fn copy_some(&mut self, w: &mut KeyWork) -> anyhow::Result<()> {
        for slot in [&mut w.held, &mut w.image_at] {
            if slot.as_ref().is_some_and(|(at, _)| *at == w.next) {
                if let Some((at, page)) = slot.take() {
                    let lsn = w.values.get(at)?.1.lsn;
                    self.push(w.key, lsn, Kind::Image, &page)?;
                    w.next += 1;
                    w.written += 1;
                    return Ok(());
                }
            }
        }
        let until = w.image_at.as_ref().map_or(w.copy_until, |(at, _)| w.copy_until.min(*at));
        let (file, entries) = w.values.run_from(w.next)?;
        let entries = &entries[..entries.len().min(until - w.next)];
        let mut buf = std::mem::take(&mut self.copy_buf);
        let n = read_run(file, entries, &mut buf).with_context(|| format!("read {:?}", w.key))?;
        let first = entries.first().map_or(0, |e| e.offset);
        for e in &entries[..n] {
            let at = (e.offset - first) as usize;
            self.push(w.key, e.lsn, e.kind, &buf[at..at + e.len as usize])?;
        }
        self.copy_buf = buf;
        w.next += n;
        w.written += n;
        Ok(())
    }

    /// Appends a value to the current output (a new one if there is none).
    fn push(&mut self, key: BufferTag, lsn: Lsn, kind: Kind, bytes: &[u8]) -> anyhow::Result<()> {
        let writer = match self.writer.as_mut() {
            Some(w) => w,
            None => {
                let tmp = format!("{TMP_PREFIX}{:016X}_{:016X}.tmp", self.generation, self.next_output);
                self.next_output += 1;
                self.writer.insert(OutputWriter::create(self.shared.dir.join(tmp))?)
            }
        };
        self.stats.values_written += 1;
        writer.push(key, lsn, kind, bytes)
    }

    /// A key is written: counts what it dropped, and cuts the output if it is full.
    fn end_key(&mut self, w: KeyWork) -> anyhow::Result<()> {
        self.stats.values_dropped += (w.values.len - w.values.context - w.written) as u64;
        if self.writer.as_ref().is_some_and(|wr| wr.len + wr.buf.len() as u64 >= self.conf.layer_size) {
            self.finish_output()?;
        }
        Ok(())
    }

    /// Seals the current output: index, footer, fdatasync, rename to its layer name.
    fn finish_output(&mut self) -> anyhow::Result<()> {
        let Some(mut w) = self.writer.take() else {
            return Ok(());
        };
        w.flush()?;
        let file_id = self.shared.next_file_id.fetch_add(1, Ordering::Relaxed);
        let written = layer::append_index_and_footer(&w.file, w.len, w.crc, &w.entries)?;
        let (size, index) = (written.len, written.index);
        self.shared.metrics.fsync(|| w.file.sync_data()).context("fdatasync compaction output")?;
        let f = index.footer;
        let name = LayerName::new(
            Level::Compacted,
            (f.min_key, f.max_key),
            f.first_lsn,
            f.last_lsn,
            self.generation,
        );
        let meta = LayerMeta::new(&name, size, Some(written.crc));
        let name = meta.name.clone();
        std::fs::rename(&w.tmp, self.shared.dir.join(&name)).context("rename compaction output")?;
        self.stats.bytes_written += size;
        self.stats.output_layers += 1;
        let layer = Frozen::with_blocks(file_id, name, w.file, index, size);
        self.outputs.push(Output { meta, layer: Arc::new(layer) });
        Ok(())
    }

    /// Makes the outputs the timeline's layers in place of the inputs, then deletes the inputs.
    fn install(&mut self) -> anyhow::Result<PassStats> {
        self.finish_output()?;
        let sh = &self.shared;
        sh.metrics.fsync(|| self.dir_file.sync_all()).context("fsync timeline directory")?;
        let input_ids: Vec<u32> = self.inputs.iter().map(|l| l.id).collect();
        let outputs: Vec<Arc<Frozen>> = self.outputs.iter().map(|o| Arc::clone(&o.layer)).collect();
        // Checked before the manifest names the outputs; only this pass removes layers, so the
        // check still holds below.
        sh.index.read().unwrap_or_else(PoisonError::into_inner).replaced(&input_ids, &outputs)?;
        let inputs: Vec<String> = self.inputs.iter().map(|l| l.name.clone()).collect();
        let metas: Vec<LayerMeta> = self.outputs.iter().map(|o| o.meta.clone()).collect();
        let installed = sh.update_manifest(&self.dir_file, |m| {
            // The outputs take the inputs' place (they are listed together, oldest first).
            let at = m.layers.iter().position(|l| inputs.contains(&l.name)).unwrap_or(0);
            m.layers.retain(|l| !inputs.contains(&l.name));
            m.layers.splice(at..at, metas);
            m.compacting = None;
            // Inputs of an earlier pass that could not be deleted stay listed with these.
            m.deleting.retain(|n| !inputs.contains(n));
            m.deleting.extend(inputs.iter().cloned());
        });
        if let Err(e) = installed {
            if RenamedNotSynced::is_in(&e) {
                // Logged once, as the timeline's fatal failure.
                self.outcome_unknown = true;
                return Err(e.context(
                    "install compaction outputs (outcome unknown: its inputs and outputs are both kept)",
                ));
            }
            return Err(e.context("install compaction outputs"));
        }
        self.installed = true;
        sh.index.write().unwrap_or_else(PoisonError::into_inner).replace_layers(&input_ids, &outputs)?;
        let (before, after) = (self.inputs.len() as u64, self.outputs.len() as u64);
        sh.layers.fetch_add(after, Ordering::Relaxed);
        sh.layers.fetch_sub(before, Ordering::Relaxed);
        sh.metrics.layer_files.add(after as i64 - before as i64);
        self.inputs.clear();
        self.stats.files_deleted = delete_files(sh, &self.dir_file);
        Ok(self.stats.clone())
    }
}

impl Drop for Pass {
    /// A pass that ends without installing (an error, a shutdown) removes its files; its intent
    /// stays in the manifest, so a crash before this cleanup is cleaned up by recovery.
    fn drop(&mut self) {
        if self.installed || self.outcome_unknown {
            return;
        }
        let mut files: Vec<PathBuf> =
            self.outputs.iter().map(|o| self.shared.dir.join(&o.meta.name)).collect();
        files.extend(self.writer.as_ref().map(|w| w.tmp.clone()));
        for f in files {
            if let Err(e) = std::fs::remove_file(&f) {
                tracing::warn!(file = %f.display(), "could not remove an output of an unfinished compaction: {e}");
            }
        }
    }
}

/// Deletes the files the manifest lists in `deleting` (the inputs of installed passes) and
/// records the deletion; returns how many it deleted. A file that cannot be deleted stays
/// listed (logged), so that the next pass or the next open deletes it: dropped from the list,
/// it would be a file the manifest does not know, which stops the open.
fn delete_files(sh: &Shared, dir_file: &File) -> u64 {
    let names = sh.manifest.lock().unwrap_or_else(PoisonError::into_inner).deleting.clone();
    let mut gone = Vec::new();
    for name in names {
        match std::fs::remove_file(sh.dir.join(&name)) {
            Ok(()) => gone.push((name, true)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => gone.push((name, false)),
            Err(e) => {
                tracing::warn!(file = %name, "could not delete a compacted layer, deleting it later: {e}")
            }
        }
    }
    if gone.is_empty() {
        return 0;
    }
    let synced = sh.metrics.fsync(|| dir_file.sync_all()).context("fsync timeline directory");
    let recorded = synced.and_then(|()| {
        sh.update_manifest(dir_file, |m| m.deleting.retain(|n| !gone.iter().any(|(g, _)| g == n)))
    });
    if let Err(e) = recorded {
        sh.record_if_fatal(&e);
        tracing::warn!("could not record the deletion of compacted layers: {e:#}");
    }
    gone.iter().filter(|(_, deleted)| *deleted).count() as u64
}

impl OutputWriter {
    fn create(tmp: PathBuf) -> anyhow::Result<OutputWriter> {
        let file =
            open_data_file(OpenOptions::new().read(true).write(true).create(true).truncate(true), &tmp)
                .with_context(|| format!("create {}", tmp.display()))?;
        let header = format::file_header();
        file.write_all_at(&header, 0).context("write compaction output header")?;
        Ok(OutputWriter {
            tmp,
            file: Arc::new(file),
            len: FILE_HEADER_LEN,
            crc: crc32c::crc32c(&header),
            buf: Vec::new(),
            entries: Vec::new(),
        })
    }

    fn push(&mut self, key: BufferTag, lsn: Lsn, kind: Kind, bytes: &[u8]) -> anyhow::Result<()> {
        let offset = self.len + self.buf.len() as u64;
        let crc = crc32c::crc32c(bytes);
        self.entries.push(IndexEntry { key, lsn, kind, offset, len: bytes.len() as u32, crc });
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= WRITE_BUFFER {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        self.file.write_all_at(&self.buf, self.len).context("write compaction output")?;
        self.len += self.buf.len() as u64;
        self.crc = crc32c::crc32c_append(self.crc, &self.buf);
        self.buf.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests;
