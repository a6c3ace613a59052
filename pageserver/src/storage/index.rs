//! The index of one timeline, behind its lock: the active segment's values in memory (a hash of
//! each key to its entries, with copies of its small records: [`is_copied`]) and the layer map
//! ([`LayerMap`], shared with lookups in progress and replaced whole at each seal and
//! compaction), with the counts of the compaction backlog.
//!
//! Under the lock a lookup only copies out the active segment's entries of its key (and the
//! bytes of those it keeps copies of, into one buffer of its own) and takes the layer map (one
//! shared `Arc`) ([`Index::snapshot`]; a page cache lookup, which needs only the key's newest
//! version, copies nothing: [`Index::version`]); the layers' index blocks and the values are read
//! without it (`storage::read`).
//!
//! **Invariants:** only durable values are in the index (the committer inserts after fsync); a
//! `(key, lsn)` is in at most one file; the lock is held only to copy the active entries out
//! (and, in a page read's lookup, `Timeline::lookup`, to ask the page cache for the version it
//! found there first), never across I/O; a layer list that breaks the layer map's order ([`check_fits`]) is refused
//! whole, the index unchanged.

use std::collections::HashMap;
use std::fs::File;
use std::sync::Arc;

use bytes::Bytes;

use super::format::{is_copied, IndexEntry, Kind, COPIES_MAX};
use super::layer::{BlockIndex, DiskWait};
use super::layer_map::{check_fits, key_runs, Frozen, LayerMap};
#[cfg(test)]
use super::read::ReadPlan;
use super::read::Snapshot;
#[cfg(test)]
use super::ReadLimits;
use page_types::{BufferTag, Lsn};

use super::GetError;

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
    keys: HashMap<BufferTag, Vec<ActiveValue>, ahash::RandomState>,
    /// Number of values in `keys`.
    values: u64,
    /// Copies of the small records ([`is_copied`]), one chunk per batch of inserted values.
    chunks: Vec<Bytes>,
    /// Bytes in `chunks`, at most [`COPIES_MAX`].
    copied: u64,
    /// The highest LSN in `keys`: a value above it is new without a look at its key.
    newest_lsn: Lsn,
}

impl Active {
    fn new(id: u32, file: Arc<File>) -> Active {
        Active {
            id,
            file,
            keys: HashMap::default(),
            values: 0,
            chunks: Vec::new(),
            copied: 0,
            newest_lsn: Lsn(0),
        }
    }

    /// The values of `key` at or below `lsn`, oldest first.
    fn at_or_below(&self, key: BufferTag, lsn: Lsn) -> &[ActiveValue] {
        // At the latest LSN (most GetPage) every value is: one look at the newest instead of a
        // binary search, whose steps are cache misses where the key has many values.
        self.keys.get(&key).map_or(&[], |v| match v.last() {
            Some(newest) if newest.e.lsn <= lsn => v,
            _ => &v[..v.partition_point(|v| v.e.lsn <= lsn)],
        })
    }

    fn contains(&self, key: BufferTag, lsn: Lsn) -> bool {
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
        self.newest_lsn = self.newest_lsn.max(v.e.lsn);
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
    new_chains: HashMap<BufferTag, u32, ahash::RandomState>,
    /// The largest count in `new_chains`.
    longest_new_chain: u32,
}

impl Index {
    /// An empty map whose active segment is the file `id`.
    pub(crate) fn new(active_id: u32, active_file: Arc<File>) -> Index {
        Index {
            layers: Arc::new(LayerMap::new(Vec::new())),
            active: Active::new(active_id, active_file),
            new_records: 0,
            new_chains: HashMap::default(),
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

    /// Adds committed values of the active segment: `entries`, in frames of the sizes `frames`
    /// gives, each frame with its `copies`: the bytes of its [`is_copied`] records, back to back
    /// in entry order (all of them or none, `segment::EncodedFrame::copies`). They are kept
    /// for reads while the segment is active, unless the segment's copies would pass
    /// [`COPIES_MAX`]. Fails, without adding any, if a `(key, lsn)` is already present. A debug
    /// build checks each copy's checksum against its entry's, a release build does not read
    /// them again.
    pub(crate) fn insert_frames<'a>(
        &mut self,
        entries: &[IndexEntry],
        frames: impl IntoIterator<Item = (usize, &'a Bytes)>,
    ) -> anyhow::Result<()> {
        // The committer's values are above every one before them: no probe of their keys.
        let newest = self.active.newest_lsn;
        if let Some(e) =
            entries.iter().filter(|e| e.lsn <= newest).find(|e| self.active.contains(e.key, e.lsn))
        {
            anyhow::bail!("duplicate value for {:?} at lsn {}", e.key, e.lsn);
        }
        let mut rest = entries;
        for (n, copies) in frames {
            let (frame, after) = rest.split_at(n.min(rest.len()));
            self.insert_frame(frame, copies);
            rest = after;
        }
        debug_assert!(rest.is_empty(), "{} entries without a frame", rest.len());
        self.insert_frame(rest, &Bytes::new());
        Ok(())
    }

    /// [`Index::insert_frames`] of one frame, whose `copies` may also be those of its records
    /// taken in order while they fit in a size (a record whose bytes would go past the end of
    /// `copies` has none, and the next one's are at the same place): the recovery scan's.
    pub(crate) fn insert_active(&mut self, entries: &[IndexEntry], copies: Bytes) -> anyhow::Result<()> {
        self.insert_frames(entries, [(entries.len(), &copies)])
    }

    fn insert_frame(&mut self, entries: &[IndexEntry], copies: &Bytes) {
        let keep = !copies.is_empty() && self.active.copied + copies.len() as u64 <= COPIES_MAX;
        let chunk = self.active.chunks.len() as u64;
        let mut at = 0;
        for e in entries {
            let mut copy = NO_COPY;
            if keep && is_copied(e) && at + e.len as usize <= copies.len() {
                debug_assert_eq!(
                    crc32c::crc32c(&copies[at..at + e.len as usize]),
                    e.crc,
                    "copy of the value at lsn {} is not its bytes",
                    e.lsn
                );
                copy = (chunk << 32) | at as u64;
                at += e.len as usize;
            }
            let v = ActiveValue { e: *e, copy };
            self.active.insert(v);
            if v.e.kind == Kind::Record {
                self.new_records += 1;
                let chain = self.new_chains.entry(v.e.key).or_default();
                *chain = chain.saturating_add(1);
                self.longest_new_chain = self.longest_new_chain.max(*chain);
            }
        }
        if keep {
            self.active.copied += copies.len() as u64;
            self.active.chunks.push(copies.clone());
        }
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
        self.new_chains = HashMap::default();
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

    /// Puts `twin` in the place of `layer` (the same object) in a new layer map: eviction's
    /// swap ([`Frozen::evicted`]). Whether `layer` was there.
    pub(crate) fn swap_twin(&mut self, layer: &Arc<Frozen>, twin: Frozen) -> bool {
        let Some(at) = self.layers().iter().position(|l| Arc::ptr_eq(l, layer)) else {
            return false;
        };
        let mut next = self.layers().to_vec();
        next[at] = Arc::new(twin);
        self.layers = Arc::new(LayerMap::new(next));
        true
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
    /// `skip_scan` needs, taken under the lock.
    pub(crate) fn keys_where(&self, keep: &dyn Fn(&BufferTag) -> bool) -> (Vec<BufferTag>, Arc<LayerMap>) {
        (self.active.keys.keys().filter(|k| keep(k)).copied().collect(), Arc::clone(&self.layers))
    }

    /// What `first_lsns` needs, copied out under the lock: the active segment's entries and
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
    pub(crate) fn snapshot(&self, key: BufferTag, lsn: Lsn) -> Snapshot {
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
        Snapshot::new(Arc::clone(&self.active.file), active, Arc::clone(&self.layers))
    }

    /// [`Index::snapshot`] and `Snapshot::pick` and its plan, for tests.
    #[cfg(test)]
    pub(crate) fn plan(
        &self,
        key: BufferTag,
        lsn: Lsn,
        limits: ReadLimits,
    ) -> Result<Option<ReadPlan>, GetError> {
        Ok(self.snapshot(key, lsn).pick(key, lsn, limits, DiskWait::Allowed)?.map(ReadPlan::new))
    }

    /// [`Index::version`] and its [`Version::newest`], for tests.
    #[cfg(test)]
    pub(crate) fn newest_at(&self, key: BufferTag, lsn: Lsn) -> Option<Lsn> {
        self.version(key, lsn).newest(key, lsn, DiskWait::Allowed).unwrap()
    }

    /// The LSN of the newest value of `key` at or below `lsn` if the active segment holds one;
    /// else the layer map to look in, outside the index's lock ([`Version::newest`]). What a
    /// page cache lookup needs, without [`Index::snapshot`]'s list of entries.
    pub(crate) fn version(&self, key: BufferTag, lsn: Lsn) -> Version {
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
    pub(crate) fn newest(self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> Result<Option<Lsn>, GetError> {
        match self {
            Version::Found(found) => Ok(Some(found)),
            Version::InLayers(layers) => {
                Ok(layers.newest(key, lsn, wait).map_err(GetError::Io)?.map(|found| found.lsn))
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::storage::test_support::{active_with, file_with, key, layer, NO_LIMITS};

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
        let newest_first = |lsn| idx.snapshot(key(1), Lsn(lsn)).active_lsns();
        assert_eq!(newest_first(35), vec![30, 20, 10]);
        assert_eq!(newest_first(40), vec![40]);
        assert_eq!(newest_first(99), vec![50, 40]);
        assert_eq!(newest_first(5), Vec::<u64>::new());
        assert_eq!(idx.newest_at(key(1), Lsn(25)), Some(Lsn(20)));
        assert_eq!(idx.newest_at(key(2), Lsn(25)), None);
        assert_eq!((idx.values(), idx.keys()), (5, 1), "the failed batch added nothing");
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

    /// A copy must be the bytes of its record (checked by the entry's checksum): a batch whose
    /// copies are not is refused whole. A batch whose copies would take the segment's past the
    /// limit is indexed without them (its records read from the file).
    #[test]
    fn copies_are_read_from_memory_and_those_over_the_limit_are_not_kept() {
        let (f, entries) =
            file_with(&[(key(1), 10, Kind::Record, b"abc"), (key(2), 10, Kind::Record, b"de")]);
        let mut idx = Index::new(0, f);
        idx.insert_active(&entries, Bytes::from_static(b"abcde")).unwrap();
        assert_eq!(idx.plan(key(2), Lsn(10), NO_LIMITS).unwrap().unwrap().reads(), 0);

        let rec = vec![5u8; super::super::format::COPIED_RECORD_MAX];
        let n = (COPIES_MAX as usize / rec.len()) + 1;
        let vals: Vec<(BufferTag, u64, Kind, &[u8])> =
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
}
