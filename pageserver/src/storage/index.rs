//! The layer map of one timeline: which files hold which values, answering "which values, in
//! which files, do I read for (key, lsn)", and the read path that turns such a plan into
//! [`ReconstructData`] with positional reads.
//!
//! Structure: the frozen layers (sealed or compacted files, immutable), oldest first, and the
//! active segment, whose entries grow with every commit (a hash of each key to its entries in
//! memory, with copies of its small records: [`is_copied`]). A layer of
//! format version 3 keeps only its footer and fences in memory (its index blocks are read on
//! demand through a daemon-wide cache, `layer::block_index`); one of versions 1 and 2 keeps its
//! whole index (about 48 bytes per value) until compaction rewrites it. The layers are grouped
//! into runs of key-disjoint layers ([`LayerMap`]); a lookup walks from the active segment down
//! the runs, newest first, looking at the one layer of each run whose key range holds the key
//! (a binary search), and stops at the first image.
//!
//! Order: layers may overlap in LSN range only if they are disjoint in keys (the outputs of one
//! compaction cover the same LSN range, split by key). So for any one key, walking the layers
//! newest first visits its values newest first; [`Index::push_layer`] refuses a layer that
//! would break this. Within a run at most one layer holds a key, so walking the runs newest
//! first visits the same layers in the same order.
//!
//! Reads: under the lock, a lookup only copies out the active segment's entries of its key (and
//! the bytes of those it keeps copies of, into one buffer of its own) and takes the layer list
//! (one shared `Arc`) ([`Index::snapshot`]); without it, it reads the
//! layers' index blocks ([`Snapshot::pick`]) and a plan ([`ReadPlan::new`], linear in the
//! values) merges values of one file that lie close together into one span, read with one
//! `pread`, of at most [`MAX_SPAN`] bytes. In a compacted layer a key's values are adjacent, so
//! a page is rebuilt with one read per layer it touches (per MiB); in a sealed segment they are
//! spread over the batches that wrote them. [`read_run`] reads values one span at a time into a
//! reused buffer, for a caller (the compactor) that copies any number of values in bounded
//! memory.
//!
//! **Invariants:** only durable values are in the map (the committer inserts after fsync); a
//! read's size (records and bytes) is checked against its limits from the index alone, before
//! any value is read; a `(key, lsn)` is in at most one file; the lock is held only to copy the
//! active entries out, never across I/O; the layer list is replaced, never changed in place, so
//! a lookup's snapshot stays valid (its files stay open); every read checks each value's
//! crc32c before returning it (a record's copy, checked when it was taken, is not checked
//! again); a span is at most [`MAX_SPAN`] bytes (or one value) and [`MAX_SPAN_VALUES`] values.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, OnceLock};

use anyhow::{ensure, Context};
use bytes::Bytes;

use super::format::{is_copied, IndexEntry, Kind, COPIES_MAX};
use super::layer::{BlockIndex, DiskWait, LayerIndex, OpenLayer, WouldWait};
use super::segment::{read_cached_at, read_cached_into};
use super::{GetError, Key, Lsn, Overwritten, ReadLimits, ReconstructData};

/// Values of one file closer than this are read together: reading a few KiB more from the page
/// cache costs less than another system call.
const MERGE_GAP: u64 = 4096;
/// Most bytes one span reads (unless one value is larger): a read's buffer stays bounded
/// whatever the number of values, and a MiB per system call already costs nothing more.
pub(crate) const MAX_SPAN: u64 = 1 << 20;
/// Most values one span holds: bounds the bookkeeping of a span of tiny values.
pub(crate) const MAX_SPAN_VALUES: usize = 4096;

/// An immutable layer file and its index, sorted by `(key, lsn)`: loaded whole (a layer of
/// format version 1 or 2) or as a block index (version 3: fences in memory, blocks read on
/// demand, `layer::block_index`).
pub(crate) struct Frozen {
    /// The file's id in this map (not stored on disk).
    pub id: u32,
    pub name: String,
    pub file: Arc<File>,
    index: FrozenIndex,
    pub first_lsn: Lsn,
    pub last_lsn: Lsn,
    /// File length in bytes.
    pub size: u64,
}

enum FrozenIndex {
    Flat { entries: Vec<IndexEntry>, keys: u64 },
    Blocks(BlockIndex),
}

impl Frozen {
    /// A layer from its entries (a flat index); sorts them if needed and refuses a
    /// `(key, lsn)` twice.
    pub(crate) fn new(
        id: u32,
        name: String,
        file: Arc<File>,
        mut entries: Vec<IndexEntry>,
        size: u64,
    ) -> anyhow::Result<Frozen> {
        if !entries.windows(2).all(|w| (w[0].key, w[0].lsn) < (w[1].key, w[1].lsn)) {
            entries.sort_by_key(|e| (e.key, e.lsn));
            if let Some(w) = entries.windows(2).find(|w| (w[0].key, w[0].lsn) == (w[1].key, w[1].lsn)) {
                anyhow::bail!("{name}: duplicate value for {:?} at lsn {}", w[0].key, w[0].lsn);
            }
        }
        let first_lsn = entries.iter().map(|e| e.lsn).min().with_context(|| format!("{name} is empty"))?;
        let last_lsn = entries.iter().map(|e| e.lsn).max().unwrap_or(first_lsn);
        let keys = 1 + entries.windows(2).filter(|w| w[0].key != w[1].key).count() as u64;
        Ok(Frozen { id, name, file, index: FrozenIndex::Flat { entries, keys }, first_lsn, last_lsn, size })
    }

    /// A layer with a block index, on `index`'s file.
    pub(crate) fn with_blocks(
        id: u32,
        name: String,
        file: Arc<File>,
        index: BlockIndex,
        size: u64,
    ) -> Frozen {
        let (first_lsn, last_lsn) = (index.footer.first_lsn, index.footer.last_lsn);
        Frozen { id, name, file, index: FrozenIndex::Blocks(index), first_lsn, last_lsn, size }
    }

    /// A layer opened by `layer::open`.
    pub(crate) fn opened(id: u32, name: String, layer: OpenLayer) -> anyhow::Result<Frozen> {
        match layer.index {
            LayerIndex::Flat(entries) => Frozen::new(id, name, layer.file, entries, layer.len),
            LayerIndex::Blocks(index) => Ok(Frozen::with_blocks(id, name, layer.file, index, layer.len)),
        }
    }

    /// Whether the index is a block index (format version 3).
    #[cfg(test)]
    pub(crate) fn block_indexed(&self) -> bool {
        matches!(self.index, FrozenIndex::Blocks(_))
    }

    /// Test hook: index blocks read so far and blocks in all (a flat index has none).
    #[cfg(test)]
    pub(crate) fn blocks_read(&self) -> (u64, u64) {
        match &self.index {
            FrozenIndex::Flat { .. } => (0, 0),
            FrozenIndex::Blocks(b) => b.blocks_read(),
        }
    }

    fn min_key(&self) -> Option<Key> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => entries.first().map(|e| e.key),
            FrozenIndex::Blocks(b) => Some(b.footer.min_key),
        }
    }

    fn max_key(&self) -> Option<Key> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => entries.last().map(|e| e.key),
            FrozenIndex::Blocks(b) => Some(b.footer.max_key),
        }
    }

    /// Number of values.
    pub(crate) fn values(&self) -> u64 {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => entries.len() as u64,
            FrozenIndex::Blocks(b) => b.footer.entry_count,
        }
    }

    /// Number of distinct keys.
    pub(crate) fn key_count(&self) -> u64 {
        match &self.index {
            FrozenIndex::Flat { keys, .. } => *keys,
            FrozenIndex::Blocks(b) => b.footer.key_count,
        }
    }

    /// The entries of `key` at or below `lsn`, oldest first. Reads index blocks (through the
    /// block cache) for a block index, waiting for the disk only where `wait` allows.
    pub(crate) fn lookup(&self, key: Key, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Vec<IndexEntry>> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                let start = entries.partition_point(|e| e.key < key);
                let end = entries.partition_point(|e| (e.key, e.lsn) <= (key, lsn));
                Ok(entries[start..end.max(start)].to_vec())
            }
            FrozenIndex::Blocks(b) => {
                b.lookup(key, lsn, wait).with_context(|| format!("index of layer {}", self.name))
            }
        }
    }

    /// The LSN of the newest entry of `key` at or below `lsn`, if any ([`Frozen::lookup`]'s
    /// last, without the list).
    pub(crate) fn newest_lsn(&self, key: Key, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Option<Lsn>> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                let end = entries.partition_point(|e| (e.key, e.lsn) <= (key, lsn));
                Ok(end.checked_sub(1).map(|i| &entries[i]).filter(|e| e.key == key).map(|e| e.lsn))
            }
            FrozenIndex::Blocks(b) => {
                b.newest_lsn(key, lsn, wait).with_context(|| format!("index of layer {}", self.name))
            }
        }
    }

    /// The first key above `after` (from the first key if `None`), if any.
    pub(crate) fn next_key(&self, after: Option<Key>) -> anyhow::Result<Option<Key>> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                let at = match after {
                    Some(k) => entries.partition_point(|e| e.key <= k),
                    None => 0,
                };
                Ok(entries.get(at).map(|e| e.key))
            }
            FrozenIndex::Blocks(b) => {
                b.next_key(after).with_context(|| format!("index of layer {}", self.name))
            }
        }
    }

    /// Calls `f` with every entry, in `(key, lsn)` order.
    pub(crate) fn for_each(&self, f: &mut dyn FnMut(&IndexEntry)) -> anyhow::Result<()> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                entries.iter().for_each(f);
                Ok(())
            }
            FrozenIndex::Blocks(b) => b.for_each(f).with_context(|| format!("index of layer {}", self.name)),
        }
    }

    /// About how many of this layer's bytes hold keys of `lo..=hi`: its size times the share of
    /// its index blocks whose keys meet that range (of a flat index: of its entries). An
    /// estimate from what is in memory (at most one block too many at each end), for the
    /// compactor's choice of a layer to collect ([`LayerMap::overwritten`]).
    pub(crate) fn bytes_in(&self, lo: Key, hi: Key) -> u64 {
        if self.max_key().is_none_or(|k| k < lo) || self.min_key().is_none_or(|k| k > hi) {
            return 0;
        }
        let (part, whole) = match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                let (a, b) =
                    (entries.partition_point(|e| e.key < lo), entries.partition_point(|e| e.key <= hi));
                (b.saturating_sub(a), entries.len())
            }
            FrozenIndex::Blocks(b) => {
                let f = b.fences();
                // The block before the first that starts at or above `lo` may hold `lo`.
                let first = f.partition_point(|x| x.key < lo).saturating_sub(1);
                (f.partition_point(|x| x.key <= hi).saturating_sub(first), f.len())
            }
        };
        if whole == 0 {
            return 0;
        }
        (u128::from(self.size) * part as u128 / whole as u128) as u64
    }

    /// Whether this layer was written by compaction (its values are sorted by key).
    pub(crate) fn compacted(&self) -> bool {
        super::layer::parse_file_name(&self.name).is_some_and(|n| n.level == super::layer::Level::Compacted)
    }
}

/// One value of the active segment: its entry, and where its copy is if it has one.
#[derive(Clone, Copy)]
struct ActiveValue {
    e: IndexEntry,
    /// `(chunk << 32) | offset` in [`Active::chunks`], or [`NO_COPY`].
    copy: u64,
}

const NO_COPY: u64 = u64::MAX;

/// The active segment's file and values.
struct Active {
    id: u32,
    file: Arc<File>,
    /// Each key's values, oldest first. A lookup is one hash probe and a binary search among
    /// the key's own values, where an ordered map of every value took two searches down a tree
    /// of the whole segment (docs/performance.md, "The active segment's entries by key").
    keys: HashMap<Key, Vec<ActiveValue>>,
    /// Number of values in `keys`.
    values: u64,
    /// Copies of the small records ([`is_copied`]), one chunk per batch of inserted values.
    chunks: Vec<Bytes>,
    /// Bytes in `chunks`, at most [`COPIES_MAX`].
    copied: u64,
}

impl Active {
    fn new(id: u32, file: Arc<File>) -> Active {
        Active { id, file, keys: HashMap::new(), values: 0, chunks: Vec::new(), copied: 0 }
    }

    /// The values of `key` at or below `lsn`, oldest first.
    fn at_or_below(&self, key: Key, lsn: Lsn) -> &[ActiveValue] {
        // At the latest LSN (most GetPage) every value is: one look at the newest instead of a
        // binary search, whose steps are cache misses where the key has many values.
        self.keys.get(&key).map_or(&[], |v| match v.last() {
            Some(newest) if newest.e.lsn <= lsn => v,
            _ => &v[..v.partition_point(|v| v.e.lsn <= lsn)],
        })
    }

    fn contains(&self, key: Key, lsn: Lsn) -> bool {
        // Values mostly come in LSN order: above the key's newest, the LSN is new (one cache
        // line, where a binary search among thousands of a hot key's values misses on each step).
        self.keys.get(&key).is_some_and(|v| {
            v.last().is_some_and(|newest| newest.e.lsn >= lsn)
                && v.binary_search_by_key(&lsn, |v| v.e.lsn).is_ok()
        })
    }

    /// The copy of `v`'s bytes, if kept.
    fn copy_of(&self, v: &ActiveValue) -> Option<&[u8]> {
        let chunk = self.chunks.get((v.copy >> 32) as usize)?;
        let at = (v.copy & u64::from(u32::MAX)) as usize;
        chunk.get(at..at + v.e.len as usize)
    }

    /// Adds `v` in its key's LSN order (replacing a value of the same key and LSN).
    fn insert(&mut self, v: ActiveValue) {
        // Most keys get one value or a few: room for one at first, not the four a push makes.
        let values = self.keys.entry(v.e.key).or_insert_with(|| Vec::with_capacity(1));
        if values.last().is_none_or(|newest| newest.e.lsn < v.e.lsn) {
            values.push(v);
            self.values += 1;
            return;
        }
        match values.binary_search_by_key(&v.e.lsn, |x| x.e.lsn) {
            Ok(at) => values[at] = v,
            Err(at) => {
                values.insert(at, v);
                self.values += 1;
            }
        }
    }
}

/// The frozen layers, oldest first, grouped into *runs* for lookups: maximal ranges of
/// adjacent layers in increasing key order whose keys are disjoint (each layer's first key is
/// above the last key of the layer before it). A key is in at most one layer of a run, found by
/// binary search, so a lookup looks at one candidate per run: O(runs x log(layers of a run)).
/// Compaction bounds the runs (the outputs of one pass form one run, a sealed layer is one),
/// whatever the number of layers.
pub(crate) struct LayerMap {
    layers: Vec<Arc<Frozen>>,
    /// Ranges of `layers`, oldest first, covering it.
    runs: Vec<std::ops::Range<usize>>,
    /// [`LayerMap::overwritten`], computed on first use.
    overwritten: OnceLock<Arc<[Overwritten]>>,
}

impl LayerMap {
    pub(crate) fn new(layers: Vec<Arc<Frozen>>) -> LayerMap {
        let runs = key_runs(&layers, |_| true);
        LayerMap { layers, runs, overwritten: OnceLock::new() }
    }

    /// For each compaction output, oldest first, about how many bytes the layers above it hold
    /// of its key range ([`Frozen::bytes_in`]): what was written over its keys since it was
    /// (the layers of its own run share none). Where that grew by its own size, its values are
    /// likely shadowed by newer images: GC of that one layer is due. O(layers x layers above)
    /// binary searches in memory, once per map (the map is replaced at each seal and pass).
    pub(crate) fn overwritten(&self) -> Arc<[Overwritten]> {
        let compute = || {
            let mut out = Vec::new();
            for r in &self.runs {
                for l in self.layers[r.clone()].iter().filter(|l| l.compacted()) {
                    let (Some(lo), Some(hi)) = (l.min_key(), l.max_key()) else { continue };
                    let above = self.layers[r.end..].iter().map(|u| u.bytes_in(lo, hi)).sum();
                    out.push(Overwritten { layer: l.id, size: l.size, above });
                }
            }
            out.into()
        };
        Arc::clone(self.overwritten.get_or_init(compute))
    }

    /// Whether a layer of this map holds an image of `key` at or below `lsn` (reads index
    /// blocks, waiting for the disk).
    pub(crate) fn has_image(&self, key: Key, lsn: Lsn) -> anyhow::Result<bool> {
        for l in self.candidates(key, lsn) {
            if l.lookup(key, lsn, DiskWait::Allowed)?.iter().any(|e| e.kind == Kind::Image) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// The layers, oldest first.
    pub(crate) fn layers(&self) -> &[Arc<Frozen>] {
        &self.layers
    }

    /// This map with `layer` above every layer.
    fn with_newest(&self, layer: Frozen) -> LayerMap {
        LayerMap::new(self.layers.iter().cloned().chain([Arc::new(layer)]).collect())
    }

    /// Number of lookup runs.
    pub(crate) fn lookup_runs(&self) -> usize {
        self.runs.len()
    }

    /// The layers that may hold values of `key` at or below `lsn`, newest first: the one layer
    /// of each run whose key range holds `key`, if it begins at or below `lsn`.
    fn candidates(&self, key: Key, lsn: Lsn) -> impl Iterator<Item = &Arc<Frozen>> {
        self.runs.iter().rev().filter_map(move |r| {
            let run = &self.layers[r.clone()];
            let i = run.partition_point(|l| l.max_key().is_some_and(|k| k < key));
            run.get(i).filter(|l| l.min_key().is_some_and(|k| k <= key) && l.first_lsn <= lsn)
        })
    }
}

/// Maximal ranges of adjacent layers of `layers` (oldest first) that `member` accepts, each in
/// increasing key order with disjoint keys; a layer `member` refuses is in none and ends the
/// range before it.
fn key_runs(layers: &[Arc<Frozen>], member: impl Fn(&Frozen) -> bool) -> Vec<std::ops::Range<usize>> {
    let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
    let mut last_key = None;
    for (i, l) in layers.iter().enumerate() {
        if !member(l) {
            last_key = None;
            continue;
        }
        match runs.last_mut() {
            Some(r) if r.end == i && last_key.is_some() && l.min_key() > last_key => r.end = i + 1,
            _ => runs.push(i..i + 1),
        }
        last_key = l.max_key();
    }
    runs
}

/// The layer map. Lives behind the timeline's `RwLock`.
pub(crate) struct Index {
    /// Shared with lookups in progress (replaced, never changed in place).
    layers: Arc<LayerMap>,
    active: Active,
    /// Records committed since the last compaction pass began (or, after an open, those of
    /// the active segment): the backlog of compaction.
    new_records: u64,
    /// The same per key: the hot-key part of the backlog (a pass takes every key, so it is due
    /// for one key's long chain too).
    new_chains: HashMap<Key, u32>,
    /// The largest count in `new_chains`.
    longest_new_chain: u32,
}

/// Fails if `layer`, placed above `older` (oldest first), is not entirely above every one of
/// them that shares a key with it.
fn check_fits(older: &[Arc<Frozen>], layer: &Frozen) -> anyhow::Result<()> {
    let (Some(lo), Some(hi)) = (layer.min_key(), layer.max_key()) else {
        anyhow::bail!("{} is empty", layer.name);
    };
    for o in older {
        let shares_keys = o.min_key().is_some_and(|k| k <= hi) && o.max_key().is_some_and(|k| k >= lo);
        ensure!(
            !shares_keys || o.last_lsn < layer.first_lsn,
            "layer {} (lsn {}..={}) overlaps layer {} (lsn {}..={})",
            layer.name,
            layer.first_lsn,
            layer.last_lsn,
            o.name,
            o.first_lsn,
            o.last_lsn
        );
    }
    Ok(())
}

#[cfg(test)]
thread_local! {
    /// Spans looked at while planning, on this thread: the work of [`ReadPlan::new`].
    static SPAN_PROBES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// One value to take out of a span.
struct SpanValue {
    lsn: Lsn,
    kind: Kind,
    /// Offset within the span.
    at: usize,
    len: usize,
    crc: u32,
}

/// Bytes of one file read with one `pread`, holding one or more values.
struct Span {
    file: Arc<File>,
    offset: u64,
    len: usize,
    /// Its values: a range of [`ReadPlan`]'s list (a span's values come one after another).
    values: Range<usize>,
}

/// The values a lookup needs, oldest first, copied out of the map under its lock (a copy of
/// each entry, one handle per file): everything else is done without the lock.
pub(crate) struct Picked {
    files: Vec<Arc<File>>,
    /// Index into `files`, the entry, and the copy of its bytes if the active segment keeps one.
    values: Vec<(usize, IndexEntry, Option<Bytes>)>,
}

impl Picked {
    /// An empty list for `values` values (at most).
    pub(crate) fn with_capacity(values: usize) -> Picked {
        Picked { files: Vec::new(), values: Vec::with_capacity(values) }
    }

    /// Adds a value after the others (they must come oldest first for a plan), with the copy
    /// of its bytes if there is one (then it is not read from `file`).
    pub(crate) fn push(&mut self, file: &Arc<File>, e: &IndexEntry, copy: Option<&Bytes>) {
        if !self.files.last().is_some_and(|f| Arc::ptr_eq(f, file)) {
            self.files.push(Arc::clone(file));
        }
        self.values.push((self.files.len() - 1, *e, copy.cloned()));
    }

    /// Turns a list pushed newest first into one oldest first, in place.
    fn reverse(&mut self) {
        let last = self.files.len() - 1;
        self.files.reverse();
        self.values.reverse();
        for (f, _, _) in &mut self.values {
            *f = last - *f;
        }
    }
}

/// Values [`Snapshot::pick`] makes room for at first: a chain of an image and a few records
/// fits without growing the list.
const PICKED_CAPACITY: usize = 16;

/// What a lookup found, planned from [`Picked`] without the lock, and executed.
pub(crate) struct ReadPlan {
    spans: Vec<Span>,
    /// Every value read from a file, oldest first; each span names its range (one list, not
    /// one per span: a plan makes two allocations however many spans it has).
    values: Vec<SpanValue>,
    /// The records taken from the active segment's copies, oldest first: nothing to read.
    copies: Vec<(Lsn, Bytes)>,
    /// The LSN of the newest value: the version of the page the plan rebuilds.
    newest: Lsn,
}

impl Index {
    /// An empty map whose active segment is the file `id`.
    pub(crate) fn new(active_id: u32, active_file: Arc<File>) -> Index {
        Index {
            layers: Arc::new(LayerMap::new(Vec::new())),
            active: Active::new(active_id, active_file),
            new_records: 0,
            new_chains: HashMap::new(),
            longest_new_chain: 0,
        }
    }

    /// Adds a layer above the others. Fails if it breaks the order (an LSN range that overlaps
    /// an earlier layer holding any of its keys, or starting at or below the active segment's
    /// values).
    pub(crate) fn push_layer(&mut self, layer: Frozen) -> anyhow::Result<()> {
        check_fits(self.layers(), &layer)?;
        self.layers = Arc::new(self.layers.with_newest(layer));
        Ok(())
    }

    /// Adds committed values of the active segment, with `copies`: the bytes of [`is_copied`]
    /// records among `entries`, back to back in entry order: all of them, none, or those taken
    /// in order while they fit in a size (a record whose bytes would go past the end of
    /// `copies` has none, and the next one's are at the same place). They are kept for reads
    /// while the segment is active, unless the segment's copies would pass [`COPIES_MAX`].
    /// Fails, without adding any, if a `(key, lsn)` is already present or a copy's checksum is
    /// not its entry's.
    pub(crate) fn insert_active(&mut self, entries: &[IndexEntry], copies: Bytes) -> anyhow::Result<()> {
        if let Some(e) = entries.iter().find(|e| self.active.contains(e.key, e.lsn)) {
            anyhow::bail!("duplicate value for {:?} at lsn {}", e.key, e.lsn);
        }
        let keep = !copies.is_empty() && self.active.copied + copies.len() as u64 <= COPIES_MAX;
        let chunk = self.active.chunks.len() as u64;
        let mut values = Vec::with_capacity(entries.len());
        let mut at = 0;
        for e in entries {
            let mut copy = NO_COPY;
            if keep && is_copied(e) && at + e.len as usize <= copies.len() {
                let bytes = &copies[at..at + e.len as usize];
                ensure!(
                    crc32c::crc32c(bytes) == e.crc,
                    "copy of the value at lsn {} is not its bytes",
                    e.lsn
                );
                copy = (chunk << 32) | at as u64;
                at += e.len as usize;
            }
            values.push(ActiveValue { e: *e, copy });
        }
        if keep {
            self.active.copied += copies.len() as u64;
            self.active.chunks.push(copies);
        }
        for v in values {
            self.active.insert(v);
            if v.e.kind == Kind::Record {
                self.new_records += 1;
                let chain = self.new_chains.entry(v.e.key).or_default();
                *chain = chain.saturating_add(1);
                self.longest_new_chain = self.longest_new_chain.max(*chain);
            }
        }
        Ok(())
    }

    /// Records committed since the last [`Index::reset_new_records`].
    pub(crate) fn new_records(&self) -> u64 {
        self.new_records
    }

    /// The most records committed for one key since the last [`Index::reset_new_records`].
    pub(crate) fn longest_new_chain(&self) -> u32 {
        self.longest_new_chain
    }

    /// A compaction pass began: the records committed from now on are the next pass's debt.
    pub(crate) fn reset_new_records(&mut self) {
        self.new_records = 0;
        self.new_chains = HashMap::new();
        self.longest_new_chain = 0;
    }

    /// The active segment became the layer `name` (same file) with the block index `index`
    /// written from its entries: it joins the layers (above every one), and the file `next_id`
    /// is the new, empty active segment.
    pub(crate) fn freeze_active(
        &mut self,
        name: String,
        index: BlockIndex,
        size: u64,
        next_id: u32,
        next_file: Arc<File>,
    ) {
        let old = std::mem::replace(&mut self.active, Active::new(next_id, next_file));
        let layer = Frozen::with_blocks(old.id, name, old.file, index, size);
        self.layers = Arc::new(self.layers.with_newest(layer));
    }

    /// The frozen layers, oldest first.
    pub(crate) fn layers(&self) -> &[Arc<Frozen>] {
        self.layers.layers()
    }

    /// The layer map (shared: clone it to keep it once the lock is released).
    pub(crate) fn layer_map(&self) -> &Arc<LayerMap> {
        &self.layers
    }

    /// The layer list with the layers `inputs` (adjacent in the list, in order) replaced by
    /// `outputs` (disjoint in keys), in their place. Fails if the inputs are not adjacent
    /// layers of the list or an output breaks the order.
    pub(crate) fn replaced(
        &self,
        inputs: &[u32],
        outputs: &[Arc<Frozen>],
    ) -> anyhow::Result<Vec<Arc<Frozen>>> {
        let n = inputs.len();
        let layers = self.layers();
        let at = inputs.first().and_then(|first| layers.iter().position(|l| l.id == *first));
        let at = at.filter(|&at| {
            layers.len() >= at + n && layers[at..at + n].iter().map(|l| l.id).eq(inputs.iter().copied())
        });
        let Some(at) = at else {
            anyhow::bail!("compaction inputs are no longer adjacent layers of the timeline");
        };
        let next: Vec<Arc<Frozen>> =
            layers[..at].iter().chain(outputs).chain(&layers[at + n..]).cloned().collect();
        for (i, layer) in next.iter().enumerate() {
            check_fits(&next[..i], layer)?;
        }
        Ok(next)
    }

    /// Replaces the layers, as [`Index::replaced`] does; changes nothing if that fails.
    pub(crate) fn replace_layers(&mut self, inputs: &[u32], outputs: &[Arc<Frozen>]) -> anyhow::Result<()> {
        self.layers = Arc::new(LayerMap::new(self.replaced(inputs, outputs)?));
        Ok(())
    }

    /// The runs of compaction outputs, oldest first, as ranges of [`Index::layers`]: the
    /// outputs of one pass are adjacent in the list and in increasing key order, so a layer
    /// whose first key is not above the last key of the layer before it begins a new run.
    /// (A run whose keys all lie above the one below it joins it: the two never share a key.)
    pub(crate) fn runs(&self) -> Vec<std::ops::Range<usize>> {
        key_runs(self.layers(), Frozen::compacted)
    }

    /// Distinct keys, from the counts each file keeps: the most of the active segment's, any
    /// sealed layer's, and any run's (its layers are disjoint in keys). Exact when one of them
    /// holds every key (after a full pass, or before the first seal); otherwise a lower bound.
    pub(crate) fn keys(&self) -> u64 {
        let layers = self.layers();
        let sealed = layers.iter().filter(|l| !l.compacted()).map(|l| l.key_count()).max().unwrap_or(0);
        let runs = self.runs().into_iter().map(|r| layers[r].iter().map(|l| l.key_count()).sum());
        runs.max().unwrap_or(0).max(sealed).max(self.active.keys.len() as u64)
    }

    /// Bytes of the active segment's record copies.
    pub(crate) fn copied_bytes(&self) -> u64 {
        self.active.copied
    }

    /// Number of values.
    pub(crate) fn values(&self) -> u64 {
        self.layers().iter().map(|l| l.values()).sum::<u64>() + self.active.values
    }

    /// The active segment's keys that `keep` accepts (in no order), and the layers: what
    /// [`skip_scan`] needs, taken under the lock.
    pub(crate) fn keys_where(&self, keep: &dyn Fn(&Key) -> bool) -> (Vec<Key>, Arc<LayerMap>) {
        (self.active.keys.keys().filter(|k| keep(k)).copied().collect(), Arc::clone(&self.layers))
    }

    /// What [`first_lsns`] needs, copied out under the lock: the active segment's entries and
    /// the layers.
    pub(crate) fn all(&self) -> (Vec<IndexEntry>, Arc<LayerMap>) {
        (self.active.keys.values().flatten().map(|v| v.e).collect(), Arc::clone(&self.layers))
    }

    /// What a lookup of `key` at `lsn` reads, copied out under the lock: the active segment's
    /// entries of `key` down to its newest image at or below `lsn`, and the layers (one shared
    /// list). The layers' indexes are read without the lock.
    ///
    /// The records the segment keeps copies of are copied once more, into one buffer of this
    /// lookup's own: a slice of the segment's chunk would take a reference on it, and every
    /// lookup of every core would count on the few chunks' shared counts (several times per
    /// record, as the bytes pass from the snapshot to the plan to the redo request).
    pub(crate) fn snapshot(&self, key: Key, lsn: Lsn) -> Snapshot {
        let values = self.active.at_or_below(key, lsn);
        let from = values.iter().rposition(|v| v.e.kind == Kind::Image).unwrap_or(0);
        let values = &values[from..];
        let copied: usize = values.iter().filter_map(|v| self.active.copy_of(v)).map(<[u8]>::len).sum();
        let mut bytes = Vec::with_capacity(copied);
        for copy in values.iter().filter_map(|v| self.active.copy_of(v)) {
            bytes.extend_from_slice(copy);
        }
        let bytes = Bytes::from(bytes);
        // Newest first: each copy ends where the next newer one begins.
        let mut end = bytes.len();
        let active = values
            .iter()
            .rev()
            .map(|v| {
                let copy = self.active.copy_of(v).map(|c| {
                    end -= c.len();
                    bytes.slice(end..end + c.len())
                });
                (v.e, copy)
            })
            .collect();
        Snapshot { active_file: Arc::clone(&self.active.file), active, layers: Arc::clone(&self.layers) }
    }

    /// [`Index::snapshot`] and [`Snapshot::pick`] and its plan, for tests.
    #[cfg(test)]
    pub(crate) fn plan(&self, key: Key, lsn: Lsn, limits: ReadLimits) -> Result<Option<ReadPlan>, GetError> {
        Ok(self.snapshot(key, lsn).pick(key, lsn, limits, DiskWait::Allowed)?.map(ReadPlan::new))
    }

    /// [`Index::version`] and its [`Version::newest`], for tests.
    #[cfg(test)]
    pub(crate) fn newest_at(&self, key: Key, lsn: Lsn) -> Option<Lsn> {
        self.version(key, lsn).newest(key, lsn, DiskWait::Allowed).unwrap()
    }

    /// The LSN of the newest value of `key` at or below `lsn` if the active segment holds one;
    /// else the layer map to look in, outside the index's lock ([`Version::newest`]). What a
    /// page cache lookup needs, without [`Index::snapshot`]'s list of entries.
    pub(crate) fn version(&self, key: Key, lsn: Lsn) -> Version {
        match self.active.at_or_below(key, lsn).last() {
            Some(v) => Version::Found(v.e.lsn),
            None => Version::InLayers(Arc::clone(&self.layers)),
        }
    }
}

/// The newest version of a key, found or still to look for in the layers ([`Index::version`]).
pub(crate) enum Version {
    Found(Lsn),
    InLayers(Arc<LayerMap>),
}

impl Version {
    /// The LSN of the newest value of `key` at or below `lsn`: the newest layer that holds one
    /// has it (index blocks read as `wait` allows).
    pub(crate) fn newest(self, key: Key, lsn: Lsn, wait: DiskWait) -> Result<Option<Lsn>, GetError> {
        let layers = match self {
            Version::Found(found) => return Ok(Some(found)),
            Version::InLayers(layers) => layers,
        };
        for l in layers.candidates(key, lsn) {
            if let Some(found) = l.newest_lsn(key, lsn, wait).map_err(GetError::Io)? {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }
}

/// Every key in key order, with the LSN of its oldest value, from [`Index::all`]: reads every
/// layer's whole index. O(values).
pub(crate) fn first_lsns(active: &[IndexEntry], layers: &[Arc<Frozen>]) -> anyhow::Result<Vec<(Key, Lsn)>> {
    let mut first: BTreeMap<Key, Lsn> = BTreeMap::new();
    let mut add = |e: &IndexEntry| {
        first.entry(e.key).and_modify(|l| *l = (*l).min(e.lsn)).or_insert(e.lsn);
    };
    for l in layers {
        l.for_each(&mut add)?;
    }
    active.iter().for_each(add);
    Ok(first.into_iter().collect())
}

/// The keys of `layers` that `keep` accepts, in key order, once each: in each layer, from each
/// key found the scan goes on at the first key above `skip(key)`, so the keys in between, and
/// the index blocks that hold only them, are never read. One [`Frozen::next_key`] (at most one
/// index block, through the block cache) per key found; the memory held is the keys kept.
pub(crate) fn skip_scan(
    layers: &[Arc<Frozen>],
    keep: &dyn Fn(&Key) -> bool,
    skip: &dyn Fn(&Key) -> Key,
) -> anyhow::Result<BTreeSet<Key>> {
    let mut kept = BTreeSet::new();
    for l in layers {
        let mut after = None;
        while let Some(key) = l.next_key(after)? {
            if keep(&key) {
                kept.insert(key);
            }
            after = Some(skip(&key).max(key));
        }
    }
    Ok(kept)
}

/// One lookup's view of the map (see [`Index::snapshot`]).
pub(crate) struct Snapshot {
    active_file: Arc<File>,
    /// Newest first, with the copies of their bytes the segment keeps.
    active: Vec<(IndexEntry, Option<Bytes>)>,
    layers: Arc<LayerMap>,
}

impl Snapshot {
    /// Calls `f` with the entries of `key` at or below `lsn`, newest first, with the file each
    /// is in (the active segment's, then each layer's from the newest layer down), until it
    /// returns `false`; with the copy of the value's bytes where the active segment keeps one.
    /// Index blocks are read waiting for the disk only where `wait` allows.
    fn newest_first<'a, F>(&'a self, key: Key, lsn: Lsn, wait: DiskWait, mut f: F) -> Result<(), GetError>
    where
        F: FnMut(&'a Arc<File>, &IndexEntry, Option<&Bytes>) -> Result<bool, GetError>,
    {
        for (e, copy) in &self.active {
            if !f(&self.active_file, e, copy.as_ref())? {
                return Ok(());
            }
        }
        for l in self.layers.candidates(key, lsn) {
            for e in l.lookup(key, lsn, wait).map_err(GetError::Io)?.iter().rev() {
                if !f(&l.file, e, None)? {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The values to read for `key` as of `lsn`: the newest image at or below `lsn` and the
    /// records above it, or all records at or below `lsn` if there is no image. `None` if
    /// nothing. Fails with `TooLarge`, before any value is read, when more than `limits` would
    /// be read. Reads only index blocks, waiting for the disk only where `wait` allows (else
    /// failing with an error that [`would_wait`] tells); plan the values with [`ReadPlan::new`].
    pub(crate) fn pick(
        &self,
        key: Key,
        lsn: Lsn,
        limits: ReadLimits,
        wait: DiskWait,
    ) -> Result<Option<Picked>, GetError> {
        let mut picked = Picked::with_capacity(PICKED_CAPACITY);
        let mut bytes = 0u64;
        let mut records = 0usize;
        self.newest_first(key, lsn, wait, |file, e, copy| {
            bytes += u64::from(e.len);
            if bytes > limits.max_bytes {
                return Err(GetError::TooLarge(format!(
                    "{key:?} at lsn {lsn}: more than {} bytes of image and records from lsn {} up",
                    limits.max_bytes, e.lsn
                )));
            }
            if e.kind == Kind::Record {
                if records == limits.max_records {
                    return Err(GetError::TooLarge(format!(
                        "{key:?} at lsn {lsn}: more than {} records above the newest image (at lsn {} and up)",
                        limits.max_records, e.lsn
                    )));
                }
                records += 1;
            }
            picked.push(file, e, copy);
            Ok(e.kind != Kind::Image)
        })?;
        if picked.values.is_empty() {
            return Ok(None);
        }
        picked.reverse();
        Ok(Some(picked))
    }
}

/// Whether `e`, of the same file, can be read with the span of `values` values that starts at
/// `offset` and is `len` bytes long: it starts after the span's end, within [`MERGE_GAP`] of
/// it, and the span stays within its bounds with it.
fn joins(offset: u64, len: u64, values: usize, e: &IndexEntry) -> bool {
    #[cfg(test)]
    SPAN_PROBES.with(|c| c.set(c.get() + 1));
    let end = offset + len;
    e.offset >= end
        && e.offset - end <= MERGE_GAP
        && e.offset + u64::from(e.len) - offset <= MAX_SPAN
        && values < MAX_SPAN_VALUES
}

/// The bytes a plan of values reads ([`ReadPlan::bytes`]), counted as values are added oldest
/// first, with the rule of [`ReadPlan::new`]: for a caller that bounds what a plan reads before
/// making it.
#[derive(Debug, Default)]
pub(crate) struct ReadSize {
    /// The last span: its file (by address), offset, length and values.
    last: Option<(usize, u64, u64, usize)>,
    bytes: u64,
}

impl ReadSize {
    /// Bytes read so far.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The bytes that adding `e`, of `file`, adds: its own, and the gap before it when it joins
    /// the last span.
    pub(crate) fn cost(&self, file: &Arc<File>, e: &IndexEntry) -> u64 {
        match self.last {
            Some((f, offset, len, values))
                if f == Arc::as_ptr(file) as usize && joins(offset, len, values, e) =>
            {
                e.offset + u64::from(e.len) - (offset + len)
            }
            _ => u64::from(e.len),
        }
    }

    /// Adds `e`, of `file`.
    pub(crate) fn add(&mut self, file: &Arc<File>, e: &IndexEntry) {
        self.bytes += self.cost(file, e);
        let f = Arc::as_ptr(file) as usize;
        self.last = match self.last {
            Some((lf, offset, len, values)) if lf == f && joins(offset, len, values, e) => {
                Some((f, offset, e.offset + u64::from(e.len) - offset, values + 1))
            }
            _ => Some((f, e.offset, u64::from(e.len), 1)),
        };
    }
}

/// Reads the longest prefix of `entries` (values of `file`, in file order) that one span holds
/// (the rule of [`ReadPlan::new`]) into `buf`, replacing its contents, checks each value's
/// checksum, and returns how many values that is (0 for none). Value `e` of them is
/// `buf[e.offset - entries[0].offset..][..e.len]`. So a caller that reuses `buf` reads any
/// number of values in at most [`MAX_SPAN`] bytes (or one value) of memory.
pub(crate) fn read_run(file: &File, entries: &[IndexEntry], buf: &mut Vec<u8>) -> anyhow::Result<usize> {
    let Some(first) = entries.first() else {
        return Ok(0);
    };
    let mut len = u64::from(first.len);
    let mut n = 1;
    while let Some(e) = entries.get(n).filter(|e| joins(first.offset, len, n, e)) {
        len = e.offset + u64::from(e.len) - first.offset;
        n += 1;
    }
    buf.clear();
    buf.resize(len as usize, 0);
    file.read_exact_at(buf, first.offset).with_context(|| {
        format!("read {len} bytes at offset {} (value at lsn {})", first.offset, first.lsn)
    })?;
    for e in &entries[..n] {
        let at = (e.offset - first.offset) as usize;
        ensure!(
            crc32c::crc32c(&buf[at..at + e.len as usize]) == e.crc,
            "checksum mismatch in value at lsn {} (offset {})",
            e.lsn,
            e.offset
        );
    }
    Ok(n)
}

impl ReadPlan {
    /// A plan for `picked` (oldest first): a value joins the span before it when it is of the
    /// same file and within [`MERGE_GAP`] after it (and the span stays within its bounds).
    /// Linear: a file's values come in one run (a key's values in a layer, then the next
    /// layer's), in file order, so only the last span can take the next value.
    pub(crate) fn new(picked: Picked) -> ReadPlan {
        let mut spans: Vec<Span> = Vec::with_capacity(picked.values.len());
        let mut values: Vec<SpanValue> = Vec::with_capacity(picked.values.len());
        let mut copies = Vec::new();
        let newest = picked.values.last().map_or(Lsn(0), |(_, e, _)| e.lsn);
        let mut last_file = usize::MAX;
        for (f, e, copy) in picked.values {
            if let Some(copy) = copy {
                copies.push((e.lsn, copy));
                continue;
            }
            let end = e.offset + u64::from(e.len);
            let joins = spans
                .last_mut()
                .filter(|s| f == last_file && joins(s.offset, s.len as u64, s.values.len(), &e));
            last_file = f;
            let at = match joins {
                Some(s) => {
                    s.len = (end - s.offset) as usize;
                    s.values.end += 1;
                    (e.offset - s.offset) as usize
                }
                None => {
                    spans.push(Span {
                        file: Arc::clone(&picked.files[f]),
                        offset: e.offset,
                        len: e.len as usize,
                        values: values.len()..values.len() + 1,
                    });
                    0
                }
            };
            values.push(SpanValue { lsn: e.lsn, kind: e.kind, at, len: e.len as usize, crc: e.crc });
        }
        ReadPlan { spans, values, copies, newest }
    }

    /// The LSN of the newest value read: which version of the page `lsn` sees (the answer of
    /// [`Version::newest`]).
    pub(crate) fn newest_lsn(&self) -> Lsn {
        self.newest
    }

    /// Bytes the plan holds: what it reads (its values and the gaps between values read
    /// together) and its records' copies.
    pub(crate) fn bytes(&self) -> u64 {
        self.spans.iter().map(|s| s.len as u64).sum::<u64>()
            + self.copies.iter().map(|(_, c)| c.len() as u64).sum::<u64>()
    }

    /// Number of values the plan gives, read or copied.
    pub(crate) fn values(&self) -> usize {
        self.values.len() + self.copies.len()
    }

    /// Number of `pread` calls the plan makes.
    #[cfg(test)]
    pub(crate) fn reads(&self) -> usize {
        self.spans.len()
    }

    /// Reads every planned value if the kernel's page cache holds all of them, without
    /// waiting for the disk (`preadv2` with `RWF_NOWAIT`, checksums checked); `None` if any
    /// read would wait (or fails, or comes back short): then run [`ReadPlan::execute`] where
    /// blocking is allowed, which also reports any error.
    pub(crate) fn try_execute_cached(&self) -> Option<anyhow::Result<ReconstructData>> {
        let bufs = self.read_spans(|s, buf| {
            Ok::<_, std::convert::Infallible>(read_cached_into(&s.file, buf, s.len, s.offset))
        });
        Some(self.assemble(bufs.ok()??))
    }

    /// Brings the plan's value bytes into the kernel's page cache where they are not there yet
    /// (blocking reads through one buffer of at most [`WARM_CHUNK`] bytes; nothing is kept), so
    /// that [`ReadPlan::try_execute_cached`] then reads them without waiting for the disk. For
    /// the blocking pool: a plan made there because an index block was not in memory most
    /// likely needs its values from the disk too, and this spares the read a trip of its own
    /// (wasted where the page cache then holds the page: rare, as a page read often keeps its
    /// index block in the block cache). A read that fails is left for the read itself to report.
    pub(crate) fn warm_values(&self) {
        let mut buf = vec![0u8; self.spans.iter().map(|s| s.len).max().unwrap_or(0).min(WARM_CHUNK)];
        for s in &self.spans {
            let mut at = 0;
            while at < s.len {
                let n = (s.len - at).min(buf.len());
                let offset = s.offset + at as u64;
                if !read_cached_at(&s.file, &mut buf[..n], offset)
                    && s.file.read_exact_at(&mut buf[..n], offset).is_err()
                {
                    break;
                }
                at += n;
            }
        }
    }

    /// Reads every planned value with positional reads and checks its checksum.
    pub(crate) fn execute(self) -> anyhow::Result<ReconstructData> {
        let bufs =
            self.read_spans(|s, buf| read_span(s, self.values[s.values.start].lsn, buf).map(|()| true))?;
        self.assemble(bufs.context("a blocking read gave up")?)
    }

    /// Reads every span with `read` (which appends the span's bytes to the buffer given, or
    /// says to give up: then `None`): a span holding an image into a buffer of its own (an
    /// image may stay in the page cache, which must not keep the records' bytes alive with it),
    /// the others into one buffer they share, so that a read of many records makes two
    /// allocations, not one per record.
    fn read_spans<E>(
        &self,
        mut read: impl FnMut(&Span, &mut Vec<u8>) -> Result<bool, E>,
    ) -> Result<Option<Vec<Bytes>>, E> {
        let own = |s: &Span| self.values[s.values.clone()].iter().any(|v| v.kind == Kind::Image);
        let mut shared = Vec::with_capacity(self.spans.iter().filter(|s| !own(s)).map(|s| s.len).sum());
        for s in self.spans.iter().filter(|s| !own(s)) {
            if !read(s, &mut shared)? {
                return Ok(None);
            }
        }
        let shared = Bytes::from(shared);
        let (mut bufs, mut at) = (Vec::with_capacity(self.spans.len()), 0);
        for s in &self.spans {
            if own(s) {
                let mut buf = Vec::with_capacity(s.len);
                if !read(s, &mut buf)? {
                    return Ok(None);
                }
                bufs.push(Bytes::from(buf));
            } else {
                bufs.push(shared.slice(at..at + s.len));
                at += s.len;
            }
        }
        Ok(Some(bufs))
    }

    /// Cuts the values out of the spans' bytes (records share the span's memory; an image is
    /// copied out of a larger span, since it may be kept in the page cache), checking each
    /// one's checksum, and adds the records' copies: the newest image and the records, oldest
    /// first.
    fn assemble(&self, bufs: Vec<Bytes>) -> anyhow::Result<ReconstructData> {
        let mut image: Option<(Lsn, Bytes)> = None;
        let mut records = Vec::with_capacity(self.values());
        for (s, buf) in self.spans.iter().zip(bufs) {
            for v in &self.values[s.values.clone()] {
                let bytes = buf.slice(v.at..v.at + v.len);
                ensure!(
                    crc32c::crc32c(&bytes) == v.crc,
                    "checksum mismatch in value at lsn {} (offset {})",
                    v.lsn,
                    s.offset + v.at as u64
                );
                match v.kind {
                    Kind::Image if image.as_ref().is_some_and(|(newest, _)| *newest > v.lsn) => {}
                    Kind::Image if bytes.len() < buf.len() => {
                        image = Some((v.lsn, Bytes::copy_from_slice(&bytes)))
                    }
                    Kind::Image => image = Some((v.lsn, bytes)),
                    Kind::Record => records.push((v.lsn, bytes)),
                }
            }
        }
        records.extend(self.copies.iter().cloned());
        // Two lists oldest first (those read, those copied; one of them mostly empty), or more
        // where layers overlap: a stable sort merges such runs in a pass or two.
        records.sort_by_key(|(lsn, _)| *lsn);
        Ok(ReconstructData { image, records })
    }
}

/// Whether `e` is a [`Snapshot::pick`] with [`DiskWait::Refused`] that needed an index block the
/// kernel's page cache does not hold (it is to be made again where blocking is allowed).
pub(crate) fn would_wait(e: &GetError) -> bool {
    matches!(e, GetError::Io(e) if e.is::<WouldWait>())
}

/// Bytes [`ReadPlan::warm_values`] reads at a time.
const WARM_CHUNK: usize = 64 << 10;

/// One span appended to `buf`, read where blocking is allowed (`lsn`: its oldest value's, for
/// the error).
fn read_span(s: &Span, lsn: Lsn, buf: &mut Vec<u8>) -> anyhow::Result<()> {
    let at = buf.len();
    buf.resize(at + s.len, 0);
    s.file
        .read_exact_at(&mut buf[at..], s.offset)
        .with_context(|| format!("read {} bytes at offset {} (value at lsn {lsn})", s.len, s.offset))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::storage::test_support::NO_LIMITS;

    fn key(blk: u32) -> Key {
        Key { spcnode: 1, dbnode: 1, relnode: 1, forknum: 0, blknum: blk }
    }

    /// The active segment keeps each key's values in LSN order whatever order they come in, so
    /// that a lookup's binary search and its walk down to the newest image are right.
    #[test]
    fn active_values_that_come_out_of_lsn_order_are_looked_up_in_order() {
        let mut idx = Index::new(0, tempfile::tempfile().map(Arc::new).unwrap());
        let e = |lsn: u64, kind| IndexEntry { key: key(1), lsn: Lsn(lsn), kind, offset: lsn, len: 1, crc: 0 };
        idx.insert_active(&[e(30, Kind::Record), e(10, Kind::Image)], Bytes::new()).unwrap();
        idx.insert_active(&[e(20, Kind::Record), e(50, Kind::Record), e(40, Kind::Image)], Bytes::new())
            .unwrap();
        assert!(
            idx.insert_active(&[e(60, Kind::Record), e(20, Kind::Record)], Bytes::new()).is_err(),
            "a duplicate"
        );
        let newest_first =
            |lsn| idx.snapshot(key(1), Lsn(lsn)).active.iter().map(|(e, _)| e.lsn.0).collect::<Vec<_>>();
        assert_eq!(newest_first(35), vec![30, 20, 10]);
        assert_eq!(newest_first(40), vec![40]);
        assert_eq!(newest_first(99), vec![50, 40]);
        assert_eq!(newest_first(5), Vec::<u64>::new());
        assert_eq!(idx.newest_at(key(1), Lsn(25)), Some(Lsn(20)));
        assert_eq!(idx.newest_at(key(2), Lsn(25)), None);
        assert_eq!((idx.values(), idx.keys()), (5, 1), "the failed batch added nothing");
    }

    /// A file holding `vals` back to back (each after a gap of `gap` bytes), and their entries.
    fn file_with_gap(vals: &[(Key, u64, Kind, &[u8])], gap: usize) -> (Arc<File>, Vec<IndexEntry>) {
        let mut f = tempfile::tempfile().unwrap();
        let mut entries = Vec::new();
        let mut off = 0u64;
        for (k, lsn, kind, b) in vals {
            std::io::Write::write_all(&mut f, &vec![0xee; gap]).unwrap();
            off += gap as u64;
            std::io::Write::write_all(&mut f, b).unwrap();
            let len = b.len() as u32;
            entries.push(IndexEntry {
                key: *k,
                lsn: Lsn(*lsn),
                kind: *kind,
                offset: off,
                len,
                crc: crc32c::crc32c(b),
            });
            off += u64::from(len);
        }
        (Arc::new(f), entries)
    }

    fn file_with(vals: &[(Key, u64, Kind, &[u8])]) -> (Arc<File>, Vec<IndexEntry>) {
        file_with_gap(vals, 0)
    }

    /// A map whose only content is the active segment holding `vals`.
    fn active_with(vals: &[(Key, u64, Kind, &[u8])]) -> Index {
        let (f, entries) = file_with(vals);
        let mut idx = Index::new(0, f);
        idx.insert_active(&entries, Bytes::new()).unwrap();
        idx
    }

    fn layer(id: u32, vals: &[(Key, u64, Kind, &[u8])]) -> Frozen {
        let (f, entries) = file_with(vals);
        Frozen::new(id, format!("l{id}"), f, entries, 0).unwrap()
    }

    #[test]
    fn new_records_are_counted_in_all_and_per_key_until_reset() {
        let mut idx = active_with(&[
            (key(1), 10, Kind::Image, b"i10"),
            (key(1), 20, Kind::Record, b"r20"),
            (key(2), 25, Kind::Record, b"k2"),
            (key(1), 30, Kind::Record, b"r30"),
        ]);
        assert_eq!((idx.new_records(), idx.longest_new_chain()), (3, 2));
        idx.reset_new_records();
        assert_eq!((idx.new_records(), idx.longest_new_chain()), (0, 0));
        let (_, entries) = file_with(&[(key(2), 40, Kind::Record, b"k2")]);
        idx.insert_active(&entries, Bytes::new()).unwrap();
        assert_eq!((idx.new_records(), idx.longest_new_chain()), (1, 1));
    }

    #[test]
    fn plan_picks_newest_image_and_later_records_oldest_first() {
        let idx = active_with(&[
            (key(1), 10, Kind::Record, b"r10"),
            (key(1), 20, Kind::Image, b"i20"),
            (key(1), 30, Kind::Record, b"r30"),
            (key(1), 40, Kind::Record, b"r40"),
            (key(2), 15, Kind::Record, b"k2"),
        ]);
        assert_eq!((idx.keys(), idx.values()), (2, 5));

        let d = idx.plan(key(1), Lsn(35), NO_LIMITS).unwrap().unwrap().execute().unwrap();
        assert_eq!(d.image, Some((Lsn(20), Bytes::from_static(b"i20"))));
        assert_eq!(d.records, vec![(Lsn(30), Bytes::from_static(b"r30"))]);

        let d = idx.plan(key(1), Lsn(19), NO_LIMITS).unwrap().unwrap().execute().unwrap();
        assert_eq!(d.image, None);
        assert_eq!(d.records, vec![(Lsn(10), Bytes::from_static(b"r10"))]);

        assert!(idx.plan(key(1), Lsn(9), NO_LIMITS).unwrap().is_none());
        assert!(idx.plan(key(2), Lsn(14), NO_LIMITS).unwrap().is_none());
        assert!(idx.plan(key(3), Lsn(100), NO_LIMITS).unwrap().is_none());
    }

    #[test]
    fn lookup_walks_active_segment_then_layers_newest_first() {
        let mut idx = active_with(&[(key(1), 50, Kind::Record, b"r50")]);
        idx.push_layer(layer(1, &[(key(1), 10, Kind::Image, b"i10"), (key(2), 12, Kind::Record, b"x")]))
            .unwrap();
        idx.push_layer(layer(2, &[(key(1), 20, Kind::Record, b"r20"), (key(1), 30, Kind::Record, b"r30")]))
            .unwrap();
        let plan = idx.plan(key(1), Lsn(60), NO_LIMITS).unwrap().unwrap();
        // One read per file: the two records of layer 2 are adjacent.
        assert_eq!(plan.reads(), 3);
        let d = plan.execute().unwrap();
        assert_eq!(d.image, Some((Lsn(10), Bytes::from_static(b"i10"))));
        let lsns: Vec<_> = d.records.iter().map(|(l, _)| l.0).collect();
        assert_eq!(lsns, vec![20, 30, 50]);
        assert_eq!(idx.newest_at(key(1), Lsn(49)), Some(Lsn(30)));
        assert_eq!(idx.newest_at(key(2), Lsn(100)), Some(Lsn(12)));
        assert_eq!(idx.newest_at(key(1), Lsn(60)), Some(Lsn(50)), "the active segment's first");
        assert_eq!(idx.newest_at(key(1), Lsn(25)), Some(Lsn(20)));
        assert_eq!(idx.newest_at(key(1), Lsn(15)), Some(Lsn(10)), "below layer 2's, in layer 1");
        assert_eq!(idx.newest_at(key(1), Lsn(9)), None);
        assert_eq!(idx.newest_at(key(2), Lsn(11)), None, "not key 1's entry before key 2's");
        assert_eq!(idx.newest_at(key(3), Lsn(100)), None);
        let (active, layers) = idx.all();
        assert_eq!(first_lsns(&active, layers.layers()).unwrap(), vec![(key(1), Lsn(10)), (key(2), Lsn(12))]);
        assert_eq!((idx.keys(), idx.values()), (2, 5));
    }

    #[test]
    fn values_close_together_are_read_with_one_pread_and_far_apart_with_several() {
        let vals: Vec<(Key, u64, Kind, &[u8])> = std::iter::once((key(1), 1, Kind::Image, &[7u8; 8192][..]))
            .chain((2..=10).map(|lsn| (key(1), lsn, Kind::Record, &b"record"[..])))
            .collect();
        for (gap, reads) in [(0, 1), (100, 1), (MERGE_GAP as usize + 1, 10)] {
            let (f, entries) = file_with_gap(&vals, gap);
            let mut idx = Index::new(0, tempfile::tempfile().map(Arc::new).unwrap());
            idx.push_layer(Frozen::new(1, "l".into(), f, entries, 0).unwrap()).unwrap();
            let plan = idx.plan(key(1), Lsn(10), NO_LIMITS).unwrap().unwrap();
            assert_eq!(plan.reads(), reads, "gap {gap}");
            let cached = plan.try_execute_cached().unwrap().unwrap();
            let d = plan.execute().unwrap();
            assert_eq!(cached, d);
            assert_eq!(d.image.as_ref().map(|(l, b)| (l.0, b.len())), Some((1, 8192)));
            assert_eq!(d.records.len(), 9);
            assert!(d.records.iter().all(|(_, r)| &r[..] == b"record"));
        }
    }

    #[test]
    fn planning_values_far_apart_looks_at_each_span_a_bounded_number_of_times() {
        // A key's values spread over a sealed segment, each more than MERGE_GAP from the next
        // (records of other keys in between): one span each. Planning them is linear.
        const VALUES: u64 = 4096;
        let entries: Vec<IndexEntry> = (0..VALUES)
            .map(|i| IndexEntry {
                key: key(1),
                lsn: Lsn(i + 1),
                kind: Kind::Record,
                offset: i * (MERGE_GAP + 1000),
                len: 100,
                crc: 0,
            })
            .collect();
        let mut idx = Index::new(0, tempfile::tempfile().map(Arc::new).unwrap());
        idx.push_layer(
            Frozen::new(1, "l".into(), tempfile::tempfile().map(Arc::new).unwrap(), entries, 0).unwrap(),
        )
        .unwrap();
        let before = SPAN_PROBES.with(|c| c.get());
        let plan = idx.plan(key(1), Lsn(VALUES), NO_LIMITS).unwrap().unwrap();
        let probes = SPAN_PROBES.with(|c| c.get()) - before;
        assert_eq!((plan.reads(), plan.values()), (VALUES as usize, VALUES as usize));
        assert!(probes <= 2 * VALUES, "{probes} spans looked at to plan {VALUES} values");
    }

    #[test]
    fn adjacent_values_are_read_in_spans_of_at_most_a_mib() {
        let page = [3u8; 8192];
        let vals: Vec<(Key, u64, Kind, &[u8])> =
            (1..=300).map(|lsn| (key(1), lsn, Kind::Record, &page[..])).collect();
        let (f, entries) = file_with(&vals);
        let mut idx = Index::new(0, tempfile::tempfile().map(Arc::new).unwrap());
        idx.push_layer(Frozen::new(1, "l".into(), f, entries, 0).unwrap()).unwrap();
        let plan = idx.plan(key(1), Lsn(300), NO_LIMITS).unwrap().unwrap();
        // 128 values of 8 KiB fill a MiB.
        assert_eq!((plan.reads(), plan.bytes()), (3, 300 * 8192));
        assert!(plan.spans.iter().all(|s| s.len as u64 <= MAX_SPAN));
        let d = plan.execute().unwrap();
        assert_eq!(d.records.len(), 300);
        assert!(d.records.iter().all(|(_, r)| r[..] == page[..]));
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(32))]
        /// Stacks of "passes" (each a few layers, disjoint and in increasing key order, over
        /// one LSN range: a compaction's outputs; one layer: a seal): for every key and LSN the
        /// layer map looks at exactly the layers a walk of every layer, newest first, would (key
        /// range holds the key, first LSN at or below the LSN), and keeps at most one run per
        /// pass.
        #[test]
        fn layer_map_candidates_equal_a_walk_of_every_layer(
            passes in proptest::collection::vec((1u32..6, 0u32..150, 0u32..60), 1..25)
        ) {
            let mut idx = active_with(&[]);
            let mut id = 0;
            for (i, (pieces, start, width)) in passes.iter().enumerate() {
                let lsn = 10 * i as u64 + 1;
                for p in 0..*pieces {
                    let lo = start + p * (width / pieces + 1);
                    let hi = lo + width / pieces;
                    id += 1;
                    let vals = [(key(lo), lsn, Kind::Record, &b"a"[..]), (key(hi), lsn + 4, Kind::Record, &b"b"[..])];
                    idx.push_layer(layer(id, &vals[..if lo == hi { 1 } else { 2 }])).unwrap();
                }
            }
            let map = idx.layer_map();
            proptest::prop_assert!(map.lookup_runs() <= passes.len(), "{} runs", map.lookup_runs());
            // Every key; the LSNs on both sides of each pass's first one, and the last.
            let lsns: Vec<Lsn> =
                (0..passes.len() as u64).flat_map(|i| [Lsn(10 * i), Lsn(10 * i + 1)]).chain([Lsn(u64::MAX)]).collect();
            for k in 0..220 {
                for &lsn in &lsns {
                    let walk: Vec<u32> = idx
                        .layers()
                        .iter()
                        .rev()
                        .filter(|l| l.first_lsn <= lsn && l.min_key() <= Some(key(k)) && Some(key(k)) <= l.max_key())
                        .map(|l| l.id)
                        .collect();
                    let found: Vec<u32> = map.candidates(key(k), lsn).map(|l| l.id).collect();
                    proptest::prop_assert_eq!(found, walk, "key {} lsn {}", k, lsn);
                }
            }
        }
    }

    #[test]
    fn layer_overlapping_an_older_one_in_keys_and_lsns_is_refused() {
        let mut idx = active_with(&[]);
        idx.push_layer(layer(1, &[(key(1), 10, Kind::Record, b"a"), (key(5), 20, Kind::Record, b"b")]))
            .unwrap();
        // Same LSN range, other keys: the outputs of one compaction.
        idx.push_layer(layer(2, &[(key(6), 15, Kind::Record, b"c")])).unwrap();
        let err = idx.push_layer(layer(3, &[(key(3), 20, Kind::Record, b"d")])).unwrap_err();
        assert!(err.to_string().contains("overlaps layer l1"), "{err}");
        assert_eq!(idx.layers().len(), 2);
    }

    #[test]
    fn replace_layers_swaps_adjacent_layers_in_place_and_checks_the_order() {
        let mut idx = active_with(&[]);
        idx.push_layer(layer(1, &[(key(1), 10, Kind::Record, b"a")])).unwrap();
        idx.push_layer(layer(2, &[(key(1), 20, Kind::Record, b"b")])).unwrap();
        idx.push_layer(layer(3, &[(key(1), 30, Kind::Record, b"c")])).unwrap();
        // Layers that are not adjacent, or not there, are refused.
        let out = || Arc::new(layer(9, &[(key(1), 20, Kind::Image, &[0; 8192])]));
        assert!(idx.replace_layers(&[1, 3], &[out()]).is_err());
        assert!(idx.replace_layers(&[3, 2], &[out()]).is_err());
        assert!(idx.replace_layers(&[7], &[out()]).is_err());
        // A layer in the middle is replaced in its place (a level 0 pass's outputs).
        let mut middle = active_with(&[]);
        for l in [1, 2, 3] {
            middle.push_layer(layer(l, &[(key(1), u64::from(l) * 10, Kind::Record, b"r")])).unwrap();
        }
        middle.replace_layers(&[2], &[out()]).unwrap();
        assert_eq!(middle.layers().iter().map(|l| l.id).collect::<Vec<_>>(), vec![1, 9, 3]);
        // An output reaching into a newer layer's range is refused and nothing changes.
        let err = idx
            .replace_layers(&[1, 2], &[Arc::new(layer(8, &[(key(1), 30, Kind::Record, b"x")]))])
            .unwrap_err();
        assert!(err.to_string().contains("overlaps"), "{err}");
        assert_eq!(idx.layers().iter().map(|l| l.id).collect::<Vec<_>>(), vec![1, 2, 3]);
        idx.replace_layers(&[1, 2], &[Arc::new(layer(9, &[(key(1), 20, Kind::Image, &[1; 8192])]))]).unwrap();
        assert_eq!(idx.layers().iter().map(|l| l.id).collect::<Vec<_>>(), vec![9, 3]);
        assert_eq!(idx.values(), 2);
        let d = idx.plan(key(1), Lsn(30), NO_LIMITS).unwrap().unwrap().execute().unwrap();
        assert_eq!(d.image.map(|(l, _)| l), Some(Lsn(20)));
        assert_eq!(d.records, vec![(Lsn(30), Bytes::from_static(b"c"))]);
    }

    /// Records kept in memory are not read from the file: the plan reads only what has no
    /// copy, and the file's bytes of a copied record no longer matter (here overwritten).
    #[test]
    fn records_with_copies_are_taken_from_memory_and_the_others_read() {
        let vals = [
            (key(1), 10, Kind::Image, &[3u8; 8192][..]),
            (key(1), 20, Kind::Record, b"r20"),
            (key(1), 30, Kind::Record, b"r30"),
            (key(1), 40, Kind::Record, b"r40"),
        ];
        let (f, entries) = file_with_gap(&vals, 5000);
        let mut idx = Index::new(0, Arc::clone(&f));
        // Copies of the first two records of the first batch only.
        idx.insert_active(&entries[..3], Bytes::from_static(b"r20r30")).unwrap();
        idx.insert_active(&entries[3..], Bytes::new()).unwrap();
        for e in &entries[1..3] {
            f.write_all_at(b"xxx", e.offset).unwrap();
        }
        let plan = idx.plan(key(1), Lsn(40), NO_LIMITS).unwrap().unwrap();
        assert_eq!((plan.reads(), plan.values(), plan.bytes()), (2, 4, 8192 + 9));
        let d = plan.try_execute_cached().unwrap().unwrap();
        assert_eq!(d.image.unwrap().1.len(), 8192);
        let want = [(20, &b"r20"[..]), (30, b"r30"), (40, b"r40")].map(|(l, b)| (Lsn(l), Bytes::from(b)));
        assert_eq!(d.records, want);
    }

    /// A copy must be the bytes of its record (checked by the entry's checksum): a batch whose
    /// copies are not is refused whole. A batch whose copies would take the segment's past the
    /// limit is indexed without them (its records read from the file).
    #[test]
    fn copies_that_are_not_the_records_or_over_the_limit_are_not_kept() {
        let (f, entries) =
            file_with(&[(key(1), 10, Kind::Record, b"abc"), (key(2), 10, Kind::Record, b"de")]);
        let mut idx = Index::new(0, f);
        assert!(idx.insert_active(&entries, Bytes::from_static(b"abcxy")).is_err());
        assert_eq!(idx.values(), 0);
        idx.insert_active(&entries, Bytes::from_static(b"abcde")).unwrap();
        assert_eq!(idx.plan(key(2), Lsn(10), NO_LIMITS).unwrap().unwrap().reads(), 0);

        let rec = vec![5u8; super::super::format::COPIED_RECORD_MAX];
        let n = (COPIES_MAX as usize / rec.len()) + 1;
        let vals: Vec<(Key, u64, Kind, &[u8])> =
            (0..n).map(|i| (key(10 + i as u32), 20, Kind::Record, &rec[..])).collect();
        let (f, entries) = file_with(&vals);
        let mut idx = Index::new(0, f);
        idx.insert_active(&entries, Bytes::from(rec.repeat(n))).unwrap();
        let plan = idx.plan(key(10), Lsn(20), NO_LIMITS).unwrap().unwrap();
        assert_eq!(plan.reads(), 1, "over the limit: read from the file");
        assert_eq!(plan.execute().unwrap().records[0].1, Bytes::from(rec));
    }

    #[test]
    fn insert_of_duplicate_key_lsn_fails_and_adds_nothing() {
        let (f, entries) = file_with(&[(key(1), 10, Kind::Record, b"a"), (key(2), 10, Kind::Record, b"b")]);
        let mut idx = Index::new(0, f);
        idx.insert_active(&entries[..1], Bytes::new()).unwrap();
        assert!(idx.insert_active(&entries, Bytes::new()).is_err());
        assert_eq!(idx.values(), 1);
        let (f, mut entries) =
            file_with(&[(key(1), 10, Kind::Record, b"a"), (key(2), 10, Kind::Record, b"b")]);
        entries[1].key = key(1);
        assert!(Frozen::new(1, "l".into(), f, entries, 0).is_err());
    }

    #[test]
    fn read_of_value_with_wrong_checksum_is_an_error() {
        let (f, mut entries) = file_with(&[(key(1), 10, Kind::Record, b"abc")]);
        entries[0].crc ^= 1;
        let mut idx = Index::new(0, f);
        idx.insert_active(&entries, Bytes::new()).unwrap();
        let err = idx.plan(key(1), Lsn(10), NO_LIMITS).unwrap().unwrap().execute().err().unwrap();
        assert!(format!("{err:#}").contains("checksum mismatch"), "{err:#}");
    }

    #[test]
    fn plan_over_the_limits_fails_before_reading_any_value() {
        // Every stored checksum is wrong: reading any value would fail with a mismatch.
        let vals: Vec<(Key, u64, Kind, &[u8])> = std::iter::once((key(1), 1, Kind::Image, &b"img"[..]))
            .chain((2..=11).map(|lsn| (key(1), lsn, Kind::Record, &b"rec"[..])))
            .collect();
        let (f, mut entries) = file_with(&vals);
        entries.iter_mut().for_each(|e| e.crc ^= 1);
        let mut idx = Index::new(0, f);
        idx.insert_active(&entries, Bytes::new()).unwrap();

        let limits = |max_records, max_bytes| ReadLimits { max_records, max_bytes };
        let err = idx.plan(key(1), Lsn(11), limits(9, u64::MAX)).err().unwrap();
        assert!(matches!(&err, GetError::TooLarge(m) if m.contains("more than 9 records")), "{err}");
        let err = idx.plan(key(1), Lsn(11), limits(100, 32)).err().unwrap();
        assert!(matches!(&err, GetError::TooLarge(m) if m.contains("more than 32 bytes")), "{err}");
        // Exactly at the limits: planned (and only then read, which finds the bad checksums).
        let plan = idx.plan(key(1), Lsn(11), limits(10, 33)).unwrap().unwrap();
        assert!(format!("{:#}", plan.execute().err().unwrap()).contains("checksum mismatch"));
        // A key with fewer records than the limit above its image is unaffected by older ones.
        assert!(idx.plan(key(1), Lsn(3), limits(2, 9)).unwrap().is_some());
    }
}
