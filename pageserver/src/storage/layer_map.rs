//! The layer map of one timeline: its frozen layers (sealed segments and compaction outputs,
//! immutable files), oldest first, and which of them a lookup of `(key, lsn)` looks at.
//!
//! A layer of format version 3 keeps only its footer and fences in memory (its index blocks are
//! read on demand through a daemon-wide cache, `layer::block_index`); one of versions 1 and 2
//! keeps its whole index (about 48 bytes per value) until compaction rewrites it ([`Frozen`]).
//! The layers are grouped into runs of key-disjoint layers ([`LayerMap`]); a lookup walks the
//! runs, newest first, looking at the one layer of each run whose key range holds the key (a
//! binary search).
//!
//! Order: layers may overlap in LSN range only if they are disjoint in keys (the outputs of one
//! compaction cover the same LSN range, split by key). So for any one key, walking the layers
//! newest first visits its values newest first; [`check_fits`] refuses a layer that would break
//! this. Within a run at most one layer holds a key, so walking the runs newest first visits the
//! same layers in the same order.
//!
//! **Invariants:** a `(key, lsn)` is in at most one layer; a map is never changed in place (a
//! change makes a new one, which the index swaps in), so a lookup that holds one keeps its view
//! and its files open; this module reads index blocks, never values (the read path,
//! `storage::read`, reads those).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use anyhow::{ensure, Context};

use super::format::{IndexEntry, Kind};
use super::layer::{BlockIndex, DiskWait, EntryAt, LayerIndex, OpenLayer, WouldWait};
use super::residence::{self, Fetch};
use page_types::{BufferTag, Lsn};

use super::Overwritten;

/// An immutable layer file and its index, sorted by `(key, lsn)`: loaded whole (a layer of
/// format version 1 or 2) or as a block index (version 3: fences in memory, blocks read on
/// demand, `layer::block_index`). What its name says (key and LSN ranges, size) is always here;
/// its file and index only while it is resident (`storage::residence`): a non-resident layer is
/// fetched by the first read that needs it, and stays resident (this object never loses its
/// file: eviction puts a non-resident twin in its place in a new layer map).
pub(crate) struct Frozen {
    /// The file's id in this map (not stored on disk; a twin keeps it).
    pub id: u32,
    pub name: String,
    pub first_lsn: Lsn,
    pub last_lsn: Lsn,
    /// File length in bytes.
    pub size: u64,
    /// The smallest and the largest key.
    keys: (BufferTag, BufferTag),
    /// Values and distinct keys, where known (not for a layer never resident here).
    counts: Option<(u64, u64)>,
    resident: OnceLock<Resident>,
    /// How a non-resident layer becomes resident, and the crc32c its file must have.
    remote: Option<(Arc<Fetch>, Option<u32>)>,
    /// Held by the one fetch of this layer at a time.
    fetching: Mutex<()>,
    /// The read clock at the last read (`residence::now`).
    last_read: AtomicU64,
}

/// A resident layer's open file and index.
pub(crate) struct Resident {
    pub file: Arc<File>,
    index: FrozenIndex,
}

enum FrozenIndex {
    Flat { entries: Vec<IndexEntry> },
    Blocks(BlockIndex),
}

impl Frozen {
    /// A layer from its entries (a flat index); sorts them if needed and refuses a
    /// `(key, lsn)` twice.
    pub(crate) fn new(
        id: u32,
        name: String,
        file: Arc<File>,
        entries: Vec<IndexEntry>,
        size: u64,
    ) -> anyhow::Result<Frozen> {
        let entries = sorted(&name, entries)?;
        let first_lsn = entries.iter().map(|e| e.lsn).min().with_context(|| format!("{name} is empty"))?;
        let last_lsn = entries.iter().map(|e| e.lsn).max().unwrap_or(first_lsn);
        let key_count = 1 + entries.windows(2).filter(|w| w[0].key != w[1].key).count() as u64;
        let (Some(min), Some(max)) = (entries.first().map(|e| e.key), entries.last().map(|e| e.key)) else {
            anyhow::bail!("{name} is empty");
        };
        let counts = Some((entries.len() as u64, key_count));
        let index = FrozenIndex::Flat { entries };
        Ok(Frozen::resident_with(id, name, (min, max), (first_lsn, last_lsn), size, counts, file, index))
    }

    /// A layer with a block index, on `index`'s file.
    pub(crate) fn with_blocks(
        id: u32,
        name: String,
        file: Arc<File>,
        index: BlockIndex,
        size: u64,
    ) -> Frozen {
        let f = index.footer;
        let counts = Some((f.entry_count, f.key_count));
        let index = FrozenIndex::Blocks(index);
        Frozen::resident_with(
            id,
            name,
            (f.min_key, f.max_key),
            (f.first_lsn, f.last_lsn),
            size,
            counts,
            file,
            index,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn resident_with(
        id: u32,
        name: String,
        keys: (BufferTag, BufferTag),
        (first_lsn, last_lsn): (Lsn, Lsn),
        size: u64,
        counts: Option<(u64, u64)>,
        file: Arc<File>,
        index: FrozenIndex,
    ) -> Frozen {
        Frozen {
            id,
            name,
            first_lsn,
            last_lsn,
            size,
            keys,
            counts,
            resident: OnceLock::from(Resident { file, index }),
            remote: None,
            fetching: Mutex::new(()),
            last_read: AtomicU64::new(residence::now()),
        }
    }

    /// A layer opened by `layer::open`.
    pub(crate) fn opened(id: u32, name: String, layer: OpenLayer) -> anyhow::Result<Frozen> {
        match layer.index {
            LayerIndex::Flat(entries) => Frozen::new(id, name, layer.file, entries, layer.len),
            LayerIndex::Blocks(index) => Ok(Frozen::with_blocks(id, name, layer.file, index, layer.len)),
        }
    }

    /// A layer whose file is not on local disk: what its name says, `size` and `crc32c` from the
    /// manifest, fetched through `fetch` by the first read that needs it. Fails for a name that
    /// does not carry its key range (such a layer is fetched at once: [`Frozen::fetched`]).
    pub(crate) fn non_resident(
        id: u32,
        name: &str,
        size: u64,
        crc32c: Option<u32>,
        fetch: &Arc<Fetch>,
    ) -> anyhow::Result<Frozen> {
        let parsed =
            super::layer::parse_file_name(name).with_context(|| format!("not a layer file name: {name}"))?;
        let keys = parsed.keys.with_context(|| format!("layer {name} is named without its key range"))?;
        Ok(Frozen {
            id,
            name: name.to_string(),
            first_lsn: parsed.first,
            last_lsn: parsed.last,
            size,
            keys,
            counts: None,
            resident: OnceLock::new(),
            remote: Some((Arc::clone(fetch), crc32c)),
            fetching: Mutex::new(()),
            last_read: AtomicU64::new(residence::now()),
        })
    }

    /// A layer fetched through `fetch` now and opened (recovery, for a layer that cannot wait).
    pub(crate) fn fetched(
        id: u32,
        name: &str,
        size: u64,
        crc32c: Option<u32>,
        fetch: &Fetch,
    ) -> anyhow::Result<Frozen> {
        Frozen::opened(id, name.to_string(), fetch.layer(name, size, crc32c)?)
    }

    /// This layer's non-resident twin (same id, name and ranges), fetched through `fetch` when
    /// read: what eviction puts in its place. `crc32c`: the manifest's.
    pub(crate) fn evicted(&self, crc32c: Option<u32>, fetch: &Arc<Fetch>) -> Frozen {
        Frozen {
            id: self.id,
            name: self.name.clone(),
            first_lsn: self.first_lsn,
            last_lsn: self.last_lsn,
            size: self.size,
            keys: self.keys,
            counts: self.counts,
            resident: OnceLock::new(),
            remote: Some((Arc::clone(fetch), crc32c)),
            fetching: Mutex::new(()),
            last_read: AtomicU64::new(self.last_read()),
        }
    }

    /// The open file and index, fetching the layer first if it is not resident and `wait`
    /// allows (else failing with [`WouldWait`], as a cold index block does). One fetch at a
    /// time: a concurrent caller waits for it and shares it.
    pub(crate) fn resident(&self, wait: DiskWait) -> anyhow::Result<&Resident> {
        let now = residence::now();
        if self.last_read.load(Ordering::Relaxed) != now {
            self.last_read.store(now, Ordering::Relaxed);
        }
        if let Some(r) = self.resident.get() {
            return Ok(r);
        }
        ensure!(wait == DiskWait::Allowed, WouldWait);
        let Some((fetch, crc32c)) = &self.remote else {
            anyhow::bail!("layer {} is not open", self.name);
        };
        let _one = self.fetching.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = self.resident.get() {
            return Ok(r);
        }
        let opened = fetch.layer(&self.name, self.size, *crc32c)?;
        let index = match opened.index {
            LayerIndex::Blocks(index) => FrozenIndex::Blocks(index),
            LayerIndex::Flat(entries) => FrozenIndex::Flat { entries: sorted(&self.name, entries)? },
        };
        Ok(self.resident.get_or_init(|| Resident { file: opened.file, index }))
    }

    /// Whether the file is on local disk and open.
    pub(crate) fn is_resident(&self) -> bool {
        self.resident.get().is_some()
    }

    /// Whether eviction may make this layer non-resident: it can be fetched again (its name
    /// carries its key range, and `fetch` is the timeline's).
    pub(crate) fn can_be_fetched(&self) -> bool {
        super::layer::parse_file_name(&self.name).is_some_and(|n| n.keys.is_some())
    }

    /// The read clock at the last read.
    pub(crate) fn last_read(&self) -> u64 {
        self.last_read.load(Ordering::Relaxed)
    }

    /// Whether the index is a block index (format version 3).
    #[cfg(test)]
    pub(crate) fn block_indexed(&self) -> bool {
        self.resident.get().is_some_and(|r| matches!(r.index, FrozenIndex::Blocks(_)))
    }

    /// Test hook: index blocks read so far and blocks in all (a flat index, or a layer not
    /// resident, has none).
    #[cfg(test)]
    pub(crate) fn blocks_read(&self) -> (u64, u64) {
        match self.resident.get().map(|r| &r.index) {
            Some(FrozenIndex::Blocks(b)) => b.blocks_read(),
            _ => (0, 0),
        }
    }

    pub(super) fn min_key(&self) -> Option<BufferTag> {
        Some(self.keys.0)
    }

    pub(super) fn max_key(&self) -> Option<BufferTag> {
        Some(self.keys.1)
    }

    /// Number of values (0 for a layer never resident here).
    pub(crate) fn values(&self) -> u64 {
        self.counts.map_or(0, |c| c.0)
    }

    /// Number of distinct keys (0 for a layer never resident here).
    pub(crate) fn key_count(&self) -> u64 {
        self.counts.map_or(0, |c| c.1)
    }

    /// The LSN of the newest entry of `key` at or below `lsn`, if any, and where it is in the
    /// index (the first of [`Resident::newest_to_image`], without the list). Reads index blocks
    /// (through the block cache) for a block index, waiting for the disk (and fetching the
    /// layer) only where `wait` allows.
    pub(crate) fn newest(
        &self,
        key: BufferTag,
        lsn: Lsn,
        wait: DiskWait,
    ) -> anyhow::Result<Option<(Lsn, EntryAt)>> {
        let r = self.resident(wait)?;
        r.newest(key, lsn, wait).with_context(|| format!("index of layer {}", self.name))
    }

    /// The first key above `after` (from the first key if `None`), if any.
    pub(crate) fn next_key(&self, after: Option<BufferTag>) -> anyhow::Result<Option<BufferTag>> {
        let r = self.resident(DiskWait::Allowed)?;
        r.next_key(after).with_context(|| format!("index of layer {}", self.name))
    }

    /// Calls `f` with every entry, in `(key, lsn)` order.
    pub(crate) fn for_each(&self, f: &mut dyn FnMut(&IndexEntry)) -> anyhow::Result<()> {
        let r = self.resident(DiskWait::Allowed)?;
        r.for_each(f).with_context(|| format!("index of layer {}", self.name))
    }

    /// About how many of this layer's bytes hold keys of `lo..=hi`: its size times the share of
    /// its index blocks whose keys meet that range (of a flat index: of its entries). An
    /// estimate from what is in memory (at most one block too many at each end), for the
    /// compactor's choice of a layer to collect ([`LayerMap::overwritten`]); 0 for a layer that
    /// is not resident (its fences are not in memory; an evicted layer is a cold one).
    pub(crate) fn bytes_in(&self, lo: BufferTag, hi: BufferTag) -> u64 {
        if self.keys.1 < lo || self.keys.0 > hi {
            return 0;
        }
        let Some(r) = self.resident.get() else {
            return 0;
        };
        let (part, whole) = match &r.index {
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

/// `entries` sorted by `(key, lsn)` (sorted here if they are not); fails on a `(key, lsn)`
/// twice.
fn sorted(name: &str, mut entries: Vec<IndexEntry>) -> anyhow::Result<Vec<IndexEntry>> {
    if !entries.windows(2).all(|w| (w[0].key, w[0].lsn) < (w[1].key, w[1].lsn)) {
        entries.sort_by_key(|e| (e.key, e.lsn));
        if let Some(w) = entries.windows(2).find(|w| (w[0].key, w[0].lsn) == (w[1].key, w[1].lsn)) {
            anyhow::bail!("{name}: duplicate value for {:?} at lsn {}", w[0].key, w[0].lsn);
        }
    }
    Ok(entries)
}

impl Resident {
    /// The entries of `key` at or below `lsn`, oldest first (compaction's: every value of a key).
    pub(crate) fn lookup(&self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Vec<IndexEntry>> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                let start = entries.partition_point(|e| e.key < key);
                let end = entries.partition_point(|e| (e.key, e.lsn) <= (key, lsn));
                Ok(entries[start..end.max(start)].to_vec())
            }
            FrozenIndex::Blocks(b) => b.lookup(key, lsn, wait),
        }
    }

    /// The entries of `key` at or below `lsn`, newest first, down to the newest image (the last
    /// one given; all of them without one): what a read of the page needs of this layer,
    /// whatever lies below the image.
    pub(crate) fn newest_to_image(
        &self,
        key: BufferTag,
        lsn: Lsn,
        wait: DiskWait,
    ) -> anyhow::Result<Vec<IndexEntry>> {
        match self.newest(key, lsn, wait)? {
            Some((_, at)) => self.down_to_image(key, at, wait),
            None => Ok(Vec::new()),
        }
    }

    /// [`Resident::newest_to_image`] from where [`Resident::newest`] found the key's newest
    /// entry (an error if `at` holds no entry of `key`).
    pub(crate) fn down_to_image(
        &self,
        key: BufferTag,
        at: EntryAt,
        wait: DiskWait,
    ) -> anyhow::Result<Vec<IndexEntry>> {
        match &self.index {
            FrozenIndex::Flat { entries } => {
                ensure!(
                    at.block == 0 && entries.get(at.entry).is_some_and(|e| e.key == key),
                    "index entry {} is not one of {key:?}",
                    at.entry
                );
                let mut out = Vec::new();
                for e in entries[..=at.entry].iter().rev().take_while(|e| e.key == key) {
                    out.push(*e);
                    if e.kind == Kind::Image {
                        break;
                    }
                }
                Ok(out)
            }
            FrozenIndex::Blocks(b) => b.down_to_image(key, at, wait),
        }
    }

    fn newest(&self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Option<(Lsn, EntryAt)>> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                let end = entries.partition_point(|e| (e.key, e.lsn) <= (key, lsn));
                let Some(i) = end.checked_sub(1).filter(|&i| entries[i].key == key) else {
                    return Ok(None);
                };
                Ok(Some((entries[i].lsn, EntryAt { block: 0, entry: i })))
            }
            FrozenIndex::Blocks(b) => b.newest(key, lsn, wait),
        }
    }

    fn next_key(&self, after: Option<BufferTag>) -> anyhow::Result<Option<BufferTag>> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                let at = match after {
                    Some(k) => entries.partition_point(|e| e.key <= k),
                    None => 0,
                };
                Ok(entries.get(at).map(|e| e.key))
            }
            FrozenIndex::Blocks(b) => b.next_key(after),
        }
    }

    fn for_each(&self, f: &mut dyn FnMut(&IndexEntry)) -> anyhow::Result<()> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => {
                entries.iter().for_each(f);
                Ok(())
            }
            FrozenIndex::Blocks(b) => b.for_each(f),
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
    pub(crate) fn has_image(&self, key: BufferTag, lsn: Lsn) -> anyhow::Result<bool> {
        for l in self.candidates(key, lsn) {
            let r = l.resident(DiskWait::Allowed)?;
            let newest = r.newest_to_image(key, lsn, DiskWait::Allowed);
            let newest = newest.with_context(|| format!("index of layer {}", l.name))?;
            if newest.last().is_some_and(|e| e.kind == Kind::Image) {
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
    pub(super) fn with_newest(&self, layer: Frozen) -> LayerMap {
        LayerMap::new(self.layers.iter().cloned().chain([Arc::new(layer)]).collect())
    }

    /// Number of lookup runs.
    pub(crate) fn lookup_runs(&self) -> usize {
        self.runs.len()
    }

    /// The layers that may hold values of `key` at or below `lsn`, newest first: the one layer
    /// of each run whose key range holds `key`, if it begins at or below `lsn`.
    pub(super) fn candidates(&self, key: BufferTag, lsn: Lsn) -> impl Iterator<Item = &Arc<Frozen>> {
        self.walk(None, key, lsn).map(|(layer, _)| layer)
    }

    /// The newest value of `key` at or below `lsn` in the layers: the newest candidate that holds
    /// one has it (index blocks read as `wait` allows; nothing decoded but LSNs). `None` if no
    /// layer holds one.
    pub(crate) fn newest(&self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Option<Found>> {
        for (run, layer) in self.candidates_below(self.runs.len(), key, lsn) {
            if let Some((found, at)) = self.layers[layer].newest(key, lsn, wait)? {
                return Ok(Some(Found { lsn: found, layer, run, at }));
            }
        }
        Ok(None)
    }

    /// [`LayerMap::candidates`], or, `from` where [`LayerMap::newest`] found the newest value of
    /// `key` at or below `lsn` in this map, the candidates from there: its layer, with the place
    /// of the value in its index (its entries need not be searched for again), then those of
    /// the runs below its own. The runs above it hold no value of the key at or below `lsn`, and
    /// are not looked at again.
    pub(super) fn walk(
        &self,
        from: Option<Found>,
        key: BufferTag,
        lsn: Lsn,
    ) -> impl Iterator<Item = (&Arc<Frozen>, Option<EntryAt>)> {
        let (first, below) = match from {
            Some(f) => (self.layers.get(f.layer).map(|l| (l, Some(f.at))), f.run.min(self.runs.len())),
            None => (None, self.runs.len()),
        };
        let rest = self.candidates_below(below, key, lsn).map(|(_, layer)| (&self.layers[layer], None));
        first.into_iter().chain(rest)
    }

    /// The candidates of the runs below run `end` (all of them: the number of runs), newest
    /// first: each one's run and its place in the list of layers.
    fn candidates_below(
        &self,
        end: usize,
        key: BufferTag,
        lsn: Lsn,
    ) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.runs[..end].iter().enumerate().rev().filter_map(move |(r, range)| {
            #[cfg(test)]
            RUNS_SEARCHED.with(|c| c.set(c.get() + 1));
            let run = &self.layers[range.clone()];
            let i = run.partition_point(|l| l.max_key().is_some_and(|k| k < key));
            run.get(i)
                .filter(|l| l.min_key().is_some_and(|k| k <= key) && l.first_lsn <= lsn)
                .map(|_| (r, range.start + i))
        })
    }
}

/// Where [`LayerMap::newest`] found the newest value of a key at or below an LSN: its LSN, and
/// the place in that map (and no other) where a walk for the older values goes on
/// ([`LayerMap::walk`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Found {
    /// The value's LSN: the version of the page.
    pub(crate) lsn: Lsn,
    /// The layer that holds it, in [`LayerMap::layers`], and the run it is in.
    layer: usize,
    run: usize,
    /// Its place in that layer's index.
    at: EntryAt,
}

#[cfg(test)]
thread_local! {
    /// Runs binary-searched for a key's candidate layer on this thread: the work of a walk.
    pub(super) static RUNS_SEARCHED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Maximal ranges of adjacent layers of `layers` (oldest first) that `member` accepts, each in
/// increasing key order with disjoint keys; a layer `member` refuses is in none and ends the
/// range before it.
pub(super) fn key_runs(
    layers: &[Arc<Frozen>],
    member: impl Fn(&Frozen) -> bool,
) -> Vec<std::ops::Range<usize>> {
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

/// Fails if `layer`, placed above `older` (oldest first), is not entirely above every one of
/// them that shares a key with it.
pub(super) fn check_fits(older: &[Arc<Frozen>], layer: &Frozen) -> anyhow::Result<()> {
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

/// Every key in key order, with the LSN of its oldest value, from `Index::all`: reads every
/// layer's whole index. O(values).
pub(crate) fn first_lsns(
    active: &[IndexEntry],
    layers: &[Arc<Frozen>],
) -> anyhow::Result<Vec<(BufferTag, Lsn)>> {
    let mut first: BTreeMap<BufferTag, Lsn> = BTreeMap::new();
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
    keep: &dyn Fn(&BufferTag) -> bool,
    skip: &dyn Fn(&BufferTag) -> BufferTag,
) -> anyhow::Result<BTreeSet<BufferTag>> {
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::storage::test_support::{active_with, key, layer};

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
}
