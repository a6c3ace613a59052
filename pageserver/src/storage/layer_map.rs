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
use std::sync::{Arc, OnceLock};

use anyhow::{ensure, Context};

use super::format::{IndexEntry, Kind};
use super::layer::{BlockIndex, DiskWait, LayerIndex, OpenLayer};
use page_types::{BufferTag, Lsn};

use super::Overwritten;

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

    pub(super) fn min_key(&self) -> Option<BufferTag> {
        match &self.index {
            FrozenIndex::Flat { entries, .. } => entries.first().map(|e| e.key),
            FrozenIndex::Blocks(b) => Some(b.footer.min_key),
        }
    }

    pub(super) fn max_key(&self) -> Option<BufferTag> {
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
    pub(crate) fn lookup(&self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Vec<IndexEntry>> {
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
    pub(crate) fn newest_lsn(&self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Option<Lsn>> {
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
    pub(crate) fn next_key(&self, after: Option<BufferTag>) -> anyhow::Result<Option<BufferTag>> {
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
    pub(crate) fn bytes_in(&self, lo: BufferTag, hi: BufferTag) -> u64 {
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
        self.walk(None, key, lsn)
    }

    /// The newest value of `key` at or below `lsn` in the layers: the newest candidate that holds
    /// one has it (index blocks read as `wait` allows; nothing decoded but LSNs). `None` if no
    /// layer holds one.
    pub(crate) fn newest(&self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Option<Found>> {
        for (run, layer) in self.candidates_below(self.runs.len(), key, lsn) {
            if let Some(found) = self.layers[layer].newest_lsn(key, lsn, wait)? {
                return Ok(Some(Found { lsn: found, layer, run }));
            }
        }
        Ok(None)
    }

    /// [`LayerMap::candidates`], or, `from` where [`LayerMap::newest`] found the newest value of
    /// `key` at or below `lsn` in this map, the candidates from there: its layer, then those of
    /// the runs below its own. The runs above it hold no value of the key at or below `lsn`, and
    /// are not looked at again.
    pub(super) fn walk(
        &self,
        from: Option<Found>,
        key: BufferTag,
        lsn: Lsn,
    ) -> impl Iterator<Item = &Arc<Frozen>> {
        let (first, below) = match from {
            Some(f) => (self.layers.get(f.layer), f.run.min(self.runs.len())),
            None => (None, self.runs.len()),
        };
        first.into_iter().chain(self.candidates_below(below, key, lsn).map(|(_, layer)| &self.layers[layer]))
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
