//! The block index of a layer file (format version 3): the index entries of the layer, sorted
//! by `(key, lsn)`, cut into index blocks of at most [`BLOCK_ENTRIES`] entries (8 KiB), followed
//! by the *fence array* (the first `(key, lsn)` of each block, the block's checksum and the most
//! records one key has in it) and a footer (`docs/storage-format.md`, "Layer files").
//!
//! Opening a layer reads only the footer and the fences ([`BlockIndex::open`]): a layer costs
//! memory in proportion to its blocks (a fence of 33 bytes per block of 195 values), never to its values.
//! A lookup finds the blocks that can hold a key from the fences (binary search) and reads
//! them through [`BlockCache`], a daemon-wide cache of checked blocks bounded in bytes; within
//! a block it searches the encoded entries and decodes only those it returns.
//!
//! **Invariants:** a block's bytes are checked against the checksum in its fence, and its
//! entries' order (strict `(key, lsn)` order, from its fence to below the next, within the
//! layer's keys), when it is read, before it is searched; every entry handed out is checked
//! (kind and length, inside the data region, inside the layer's LSN range) when it is decoded;
//! so a corrupt file is an error, never a wrong answer or a panic; the cache key includes a
//! per-open number, so a deleted and recreated file never meets a stale block.

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{bail, ensure, Context};
use page_types::{BufferTag, Lsn};
use prometheus::{IntCounter, IntGauge, Registry};

use super::{decode_entry, decode_key_lsn, encode_entry, INDEX_ENTRY_LEN};
use crate::storage::format::{put_key, Cursor, IndexEntry, Kind, FILE_HEADER_LEN, KEY_LEN};
use crate::storage::segment::{read_at, read_cached_at};

/// Entries per index block: the most that fit in 8 KiB.
pub(crate) const BLOCK_ENTRIES: usize = 8192 / INDEX_ENTRY_LEN;
/// Bytes of a full index block.
const BLOCK_BYTES: u64 = (BLOCK_ENTRIES * INDEX_ENTRY_LEN) as u64;
/// One fence: first key, first lsn u64, block crc32c u32, most records of one key u32.
const FENCE_LEN: usize = KEY_LEN + 8 + 4 + 4;
/// Magic at the start of a block-index footer (a version 1 footer starts with `PSLAYER1`).
pub(crate) const FOOTER_MAGIC: [u8; 8] = *b"PSLAYER2";
/// magic(8) entry_count u64 key_count u64 index_offset u64 first_lsn u64 last_lsn u64
/// min_key max_key fence_crc u32 footer_crc u32.
pub(crate) const FOOTER_LEN: u64 = 8 + 8 * 5 + 2 * KEY_LEN as u64 + 4 + 4;
/// Bytes of index blocks the daemon keeps (all layers of all tenants together).
pub(crate) const BLOCK_CACHE_BYTES: u64 = 64 << 20;

/// What the footer of a block-indexed layer says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockIndexFooter {
    pub entry_count: u64,
    /// Distinct keys in the layer.
    pub key_count: u64,
    /// Where the data region ends and the index blocks begin.
    pub index_offset: u64,
    pub first_lsn: Lsn,
    pub last_lsn: Lsn,
    pub min_key: BufferTag,
    pub max_key: BufferTag,
}

/// The first entry of an index block, and what the layer keeps in memory about the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fence {
    pub key: BufferTag,
    pub lsn: Lsn,
    crc: u32,
    /// The most records one key has in this block (for finding long chains without reading
    /// the blocks).
    pub max_records: u32,
}

/// Bytes [`write`] adds after the data region for `entries` entries.
pub(crate) fn encoded_len(entries: usize) -> u64 {
    let blocks = entries.div_ceil(BLOCK_ENTRIES);
    (entries * INDEX_ENTRY_LEN + blocks * FENCE_LEN) as u64 + FOOTER_LEN
}

/// Encodes the block index, fences and footer of `entries` (sorted by `(key, lsn)`, unique,
/// non-empty, all inside `data_end`), to be written at `data_end`. Returns the bytes and the
/// decoded footer and fences (what [`BlockIndex::open`] would read back).
pub(crate) fn encode(
    data_end: u64,
    entries: &[IndexEntry],
) -> anyhow::Result<(Vec<u8>, BlockIndexFooter, Vec<Fence>)> {
    let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
        bail!("an empty layer");
    };
    ensure!(
        entries.windows(2).all(|w| (w[0].key, w[0].lsn) < (w[1].key, w[1].lsn)),
        "layer entries not sorted by (key, lsn) or not unique"
    );
    let mut buf = Vec::with_capacity(encoded_len(entries.len()) as usize);
    let mut fences = Vec::with_capacity(entries.len().div_ceil(BLOCK_ENTRIES));
    let mut key_count = 0u64;
    let mut prev_key = None;
    for block in entries.chunks(BLOCK_ENTRIES) {
        let start = buf.len();
        let (mut max_records, mut run_key, mut run) = (0u32, None, 0u32);
        for e in block {
            encode_entry(&mut buf, e);
            if prev_key != Some(e.key) {
                key_count += 1;
                prev_key = Some(e.key);
            }
            if run_key != Some(e.key) {
                (run_key, run) = (Some(e.key), 0);
            }
            if e.kind == Kind::Record {
                run += 1;
                max_records = max_records.max(run);
            }
        }
        fences.push(Fence {
            key: block[0].key,
            lsn: block[0].lsn,
            crc: crc32c::crc32c(&buf[start..]),
            max_records,
        });
    }
    let fence_start = buf.len();
    for f in &fences {
        put_key(&mut buf, &f.key);
        buf.extend_from_slice(&f.lsn.0.to_le_bytes());
        buf.extend_from_slice(&f.crc.to_le_bytes());
        buf.extend_from_slice(&f.max_records.to_le_bytes());
    }
    let fence_crc = crc32c::crc32c(&buf[fence_start..]);
    let footer = BlockIndexFooter {
        entry_count: entries.len() as u64,
        key_count,
        index_offset: data_end,
        first_lsn: entries.iter().map(|e| e.lsn).min().unwrap_or(first.lsn),
        last_lsn: entries.iter().map(|e| e.lsn).max().unwrap_or(first.lsn),
        min_key: first.key,
        max_key: last.key,
    };
    let footer_start = buf.len();
    buf.extend_from_slice(&FOOTER_MAGIC);
    for v in
        [footer.entry_count, footer.key_count, footer.index_offset, footer.first_lsn.0, footer.last_lsn.0]
    {
        buf.extend_from_slice(&v.to_le_bytes());
    }
    put_key(&mut buf, &footer.min_key);
    put_key(&mut buf, &footer.max_key);
    buf.extend_from_slice(&fence_crc.to_le_bytes());
    let crc = crc32c::crc32c(&buf[footer_start..]);
    buf.extend_from_slice(&crc.to_le_bytes());
    Ok((buf, footer, fences))
}

/// Whether the last [`FOOTER_LEN`] bytes of a file of `file_len` bytes start with a
/// block-index footer's magic (else the layer is of version 1 or 2: one flat index).
pub(crate) fn has_block_footer(file: &File, file_len: u64) -> bool {
    let mut magic = [0u8; 8];
    file_len >= FILE_HEADER_LEN + FOOTER_LEN
        && read_at(file, &mut magic, file_len - FOOTER_LEN).is_ok()
        && magic == FOOTER_MAGIC
}

/// Reads and checks the footer and fences of a block-indexed layer of `file_len` bytes.
fn read_footer_and_fences(file: &File, file_len: u64) -> anyhow::Result<(BlockIndexFooter, Vec<Fence>)> {
    ensure!(file_len >= FILE_HEADER_LEN + FOOTER_LEN, "file too short for a footer");
    let mut raw = [0u8; FOOTER_LEN as usize];
    read_at(file, &mut raw, file_len - FOOTER_LEN).context("read footer")?;
    ensure!(raw[..8] == FOOTER_MAGIC, "bad footer magic");
    let mut c = Cursor::new(&raw[8..]);
    let footer = BlockIndexFooter {
        entry_count: c.u64()?,
        key_count: c.u64()?,
        index_offset: c.u64()?,
        first_lsn: c.lsn()?,
        last_lsn: c.lsn()?,
        min_key: c.key()?,
        max_key: c.key()?,
    };
    let fence_crc = c.u32()?;
    ensure!(c.u32()? == crc32c::crc32c(&raw[..FOOTER_LEN as usize - 4]), "footer checksum mismatch");
    let f = &footer;
    ensure!(
        f.entry_count > 0 && f.first_lsn <= f.last_lsn && f.min_key <= f.max_key,
        "empty or inverted layer"
    );
    ensure!((1..=f.entry_count).contains(&f.key_count), "{} keys in {} entries", f.key_count, f.entry_count);
    ensure!(f.index_offset >= FILE_HEADER_LEN, "index inside the file header");
    let entries = usize::try_from(f.entry_count).context("too many entries")?;
    let end = f.index_offset.checked_add(encoded_len(entries));
    ensure!(end == Some(file_len), "index of {} entries does not end at the end of the file", f.entry_count);
    let blocks = entries.div_ceil(BLOCK_ENTRIES);
    let fence_offset = f.index_offset + (entries * INDEX_ENTRY_LEN) as u64;
    let mut raw = vec![0u8; blocks * FENCE_LEN];
    read_at(file, &mut raw, fence_offset).context("read fences")?;
    ensure!(crc32c::crc32c(&raw) == fence_crc, "fence checksum mismatch");
    let mut c = Cursor::new(&raw);
    let mut fences = Vec::with_capacity(blocks);
    for _ in 0..blocks {
        fences.push(Fence { key: c.key()?, lsn: c.lsn()?, crc: c.u32()?, max_records: c.u32()? });
    }
    ensure!(fences.windows(2).all(|w| (w[0].key, w[0].lsn) < (w[1].key, w[1].lsn)), "fences out of order");
    ensure!(fences.first().map(|f| f.key) == Some(f.min_key), "first fence is not the layer's first key");
    ensure!(fences.iter().all(|x| x.key <= f.max_key), "a fence above the layer's last key");
    Ok((footer, fences))
}

/// An index block as read and checked ([`BlockIndex::read_block`]): its encoded entries, in
/// order; decoded one by one as they are used ([`BlockIndex::decode`]).
pub(crate) struct Block {
    entries: Box<[[u8; INDEX_ENTRY_LEN]]>,
}

impl Block {
    /// The key and LSN of entry `i` (`i < len`).
    fn at(&self, i: usize) -> (BufferTag, Lsn) {
        decode_key_lsn(&self.entries[i])
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    /// The first entry at or above `(key, lsn)` (`len` if none).
    fn find(&self, key: BufferTag, lsn: Lsn) -> usize {
        self.entries.partition_point(|r| decode_key_lsn(r) < (key, lsn))
    }

    /// The first entry above `(key, lsn)` (`len` if none).
    fn end_of(&self, key: BufferTag, lsn: Lsn) -> usize {
        self.entries.partition_point(|r| decode_key_lsn(r) <= (key, lsn))
    }

    /// The entries of `key` at or below `lsn`, oldest first (the block is in order: checked
    /// when read). The end is found by walking on from the first: a key's entries lie side by
    /// side (a few cache lines the walk reads in order), where a second binary search of the
    /// block would miss the cache at most of its steps.
    fn entries_of(&self, key: BufferTag, lsn: Lsn) -> std::ops::Range<usize> {
        let start = self.find(key, Lsn(0));
        let taken = self.entries[start..].iter().take_while(|r| decode_key_lsn(r) <= (key, lsn)).count();
        start..start + taken
    }
}

/// Where an entry is in a layer's index: its block and its place in the block (a flat index:
/// block 0). Found by a lookup and handed to the read planned after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EntryAt {
    pub(crate) block: usize,
    pub(crate) entry: usize,
}

/// Whether a read of an index block may wait for the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiskWait {
    /// A positional read, which waits for the disk if it must: where blocking is allowed.
    Allowed,
    /// Only what the kernel's page cache holds (`RWF_NOWAIT`); anything else fails with
    /// [`WouldWait`]: on an executor thread.
    Refused,
}

/// An index block was needed that the kernel's page cache does not hold, by a read that was not
/// to wait for the disk ([`DiskWait::Refused`]).
#[derive(Debug, thiserror::Error)]
#[error("an index block is not in the page cache, and the read was not to wait for the disk")]
pub(crate) struct WouldWait;

/// The cache of checked index blocks, shared by every layer of the process, and its counters
/// (registered by [`BlockCache::register`]).
pub(crate) struct BlockCache {
    cache: quick_cache::sync::Cache<(u64, u32), Arc<Block>, BlockWeight>,
    pub hits: IntCounter,
    pub misses: IntCounter,
    pub bytes: IntGauge,
}

#[derive(Clone)]
struct BlockWeight;

impl quick_cache::Weighter<(u64, u32), Arc<Block>> for BlockWeight {
    fn weight(&self, _key: &(u64, u32), block: &Arc<Block>) -> u64 {
        (block.len() * INDEX_ENTRY_LEN) as u64 + 64
    }
}

impl BlockCache {
    fn new(bytes: u64) -> anyhow::Result<BlockCache> {
        let blocks = (bytes / BLOCK_BYTES).max(1) as usize;
        Ok(BlockCache {
            cache: quick_cache::sync::Cache::with_weighter(blocks, bytes, BlockWeight),
            hits: IntCounter::new(
                "pageserver_storage_index_block_cache_hits_total",
                "Layer index blocks found in the block cache",
            )?,
            misses: IntCounter::new(
                "pageserver_storage_index_block_cache_misses_total",
                "Layer index blocks read from their file (and added to the block cache)",
            )?,
            bytes: IntGauge::new(
                "pageserver_storage_index_block_cache_bytes",
                "Bytes of index blocks in the block cache (all tenants)",
            )?,
        })
    }

    /// The process's cache.
    pub(crate) fn global() -> &'static BlockCache {
        static CACHE: OnceLock<BlockCache> = OnceLock::new();
        // Only an invalid metric name fails, and the names are constants.
        CACHE.get_or_init(|| BlockCache::new(BLOCK_CACHE_BYTES).expect("block cache metrics"))
    }

    /// Registers the process's cache's counters in `registry`. Fails if they are already there.
    pub(crate) fn register(registry: &Registry) -> anyhow::Result<()> {
        let cache = BlockCache::global();
        for c in [&cache.hits, &cache.misses] {
            registry.register(Box::new(c.clone())).context("register the block cache's counters")?;
        }
        registry.register(Box::new(cache.bytes.clone())).context("register the block cache's size")?;
        Ok(())
    }
}

/// A number no other opened layer of this process has: the layer's part of a cache key.
fn next_uid() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The index of one block-indexed layer: its footer and fences in memory, its blocks on disk.
pub(crate) struct BlockIndex {
    uid: u64,
    file: Arc<File>,
    pub footer: BlockIndexFooter,
    fences: Box<[Fence]>,
    /// Index blocks handed out (from the cache or the file), for tests that bound a read's blocks.
    #[cfg(test)]
    blocks_read: AtomicU64,
}

impl BlockIndex {
    /// Reads the footer and fences of `file` (`file_len` bytes).
    pub(crate) fn open(file: Arc<File>, file_len: u64) -> anyhow::Result<BlockIndex> {
        let (footer, fences) = read_footer_and_fences(&file, file_len)?;
        Ok(BlockIndex::new(file, footer, fences))
    }

    /// The index just written by [`encode`] (no read).
    pub(crate) fn written(file: Arc<File>, footer: BlockIndexFooter, fences: Vec<Fence>) -> BlockIndex {
        BlockIndex::new(file, footer, fences)
    }

    fn new(file: Arc<File>, footer: BlockIndexFooter, fences: Vec<Fence>) -> BlockIndex {
        BlockIndex {
            uid: next_uid(),
            file,
            footer,
            fences: fences.into(),
            #[cfg(test)]
            blocks_read: AtomicU64::new(0),
        }
    }

    /// Test hook: index blocks handed out so far (cache hits and file reads), and blocks in all.
    #[cfg(test)]
    pub(crate) fn blocks_read(&self) -> (u64, u64) {
        (self.blocks_read.load(Ordering::Relaxed), self.fences.len() as u64)
    }

    /// The first `(key, lsn)` of each index block, in order.
    pub(crate) fn fences(&self) -> &[Fence] {
        &self.fences
    }

    /// Block `i`, from the cache or read and checked (waiting for the disk only where `wait`
    /// allows).
    fn block(&self, i: usize, wait: DiskWait) -> anyhow::Result<Arc<Block>> {
        let global = BlockCache::global();
        let key = (self.uid, i as u32);
        if let Some(b) = global.cache.get(&key) {
            global.hits.inc();
            #[cfg(test)]
            self.blocks_read.fetch_add(1, Ordering::Relaxed);
            return Ok(b);
        }
        let b = Arc::new(self.read_block(i, wait)?);
        global.misses.inc();
        global.cache.insert(key, Arc::clone(&b));
        global.bytes.set(i64::try_from(global.cache.weight()).unwrap_or(i64::MAX));
        Ok(b)
    }

    /// Reads block `i` from the file (not through the cache) and checks its checksum and its
    /// entries' order: strictly increasing `(key, lsn)`, the first at its fence, all below the
    /// next fence (the last block's: at most the layer's last key).
    fn read_block(&self, i: usize, wait: DiskWait) -> anyhow::Result<Block> {
        #[cfg(test)]
        self.blocks_read.fetch_add(1, Ordering::Relaxed);
        let fence =
            self.fences.get(i).with_context(|| format!("index block {i} of {}", self.fences.len()))?;
        let entries = self.footer.entry_count as usize;
        let count = (entries - i * BLOCK_ENTRIES).min(BLOCK_ENTRIES);
        let mut raw = vec![[0u8; INDEX_ENTRY_LEN]; count].into_boxed_slice();
        let offset = self.footer.index_offset + i as u64 * BLOCK_BYTES;
        match wait {
            DiskWait::Allowed => read_at(&self.file, raw.as_flattened_mut(), offset)
                .with_context(|| format!("read index block {i}"))?,
            DiskWait::Refused => {
                ensure!(read_cached_at(&self.file, raw.as_flattened_mut(), offset), WouldWait)
            }
        }
        ensure!(crc32c::crc32c(raw.as_flattened()) == fence.crc, "index block {i} checksum mismatch");
        let block = Block { entries: raw };
        ensure!(
            block.len() > 0 && block.at(0) == (fence.key, fence.lsn),
            "index block {i} does not start at its fence"
        );
        let mut last = block.at(0);
        for j in 1..block.len() {
            let at = block.at(j);
            ensure!(last < at, "index block {i} out of order");
            last = at;
        }
        match self.fences.get(i + 1) {
            Some(n) => ensure!(last < (n.key, n.lsn), "index block {i} reaches into the next block"),
            None => {
                ensure!(last.0 <= self.footer.max_key, "entry key {:?} outside the layer's range", last.0)
            }
        }
        Ok(block)
    }

    /// Entry `j` of `block`, decoded and checked (kind and length, data region, LSN range).
    fn decode(&self, block: &Block, j: usize) -> anyhow::Result<IndexEntry> {
        let f = &self.footer;
        decode_entry(&block.entries[j], f.index_offset, f.first_lsn..=f.last_lsn)
    }

    /// The blocks that may hold entries of `key` at or below `lsn` (none outside the layer's
    /// keys and LSNs, as its footer says: no block is read for them).
    fn blocks_of(&self, key: BufferTag, lsn: Lsn) -> std::ops::Range<usize> {
        if key < self.footer.min_key || key > self.footer.max_key || lsn < self.footer.first_lsn {
            return 0..0;
        }
        // The block before the first one starting at or after (key, 0) may end with key's values.
        let start = self.fences.partition_point(|f| (f.key, f.lsn) < (key, Lsn(0))).saturating_sub(1);
        let end = self.fences.partition_point(|f| (f.key, f.lsn) <= (key, lsn));
        start..end.max(start)
    }

    /// The entries of `key` at or below `lsn`, oldest first; index blocks are read waiting for
    /// the disk only where `wait` allows.
    pub(crate) fn lookup(&self, key: BufferTag, lsn: Lsn, wait: DiskWait) -> anyhow::Result<Vec<IndexEntry>> {
        let mut out = Vec::new();
        for i in self.blocks_of(key, lsn) {
            let block = self.block(i, wait)?;
            for j in block.entries_of(key, lsn) {
                out.push(self.decode(&block, j)?);
            }
        }
        Ok(out)
    }

    /// The entries of `key` from the one at `at` (the newest at or below an LSN, as
    /// [`BlockIndex::newest`] found it) down to the newest image (the last one given; all of
    /// them if there is none): what a read of the page needs of this layer. Decodes entries from
    /// `at` down, reading the blocks below only while the key's entries go on, until the image:
    /// however long the key's history below it, a read costs what lies above the image. An `at`
    /// that does not hold an entry of `key` (not one this index's lookup gave) is an error.
    pub(crate) fn down_to_image(
        &self,
        key: BufferTag,
        at: EntryAt,
        wait: DiskWait,
    ) -> anyhow::Result<Vec<IndexEntry>> {
        let mut block = self.block(at.block, wait)?;
        ensure!(
            at.entry < block.len() && block.at(at.entry).0 == key,
            "index entry {} of block {} is not one of {key:?}",
            at.entry,
            at.block
        );
        let mut out = Vec::new();
        let (mut i, mut end) = (at.block, at.entry + 1);
        loop {
            for j in (0..end).rev() {
                if block.at(j).0 != key {
                    return Ok(out);
                }
                let e = self.decode(&block, j)?;
                let image = e.kind == Kind::Image;
                out.push(e);
                if image {
                    return Ok(out);
                }
            }
            // The key's entries reach the start of this block: they may go on in the one before.
            let Some(before) = i.checked_sub(1) else {
                return Ok(out);
            };
            (i, block) = (before, self.block(before, wait)?);
            end = block.len();
        }
    }

    /// The LSN of the newest entry of `key` at or below `lsn`, if any, and where it is:
    /// [`BlockIndex::lookup`]'s last, without collecting the others or decoding any (the page
    /// cache's version lookup). Reads the blocks from the last one that may hold it down, until
    /// one does.
    pub(crate) fn newest(
        &self,
        key: BufferTag,
        lsn: Lsn,
        wait: DiskWait,
    ) -> anyhow::Result<Option<(Lsn, EntryAt)>> {
        for i in self.blocks_of(key, lsn).rev() {
            let block = self.block(i, wait)?;
            // A binary search for the end, not a walk of the key's entries: a long history
            // costs nothing here.
            let Some(j) = block.end_of(key, lsn).checked_sub(1) else {
                continue;
            };
            let (k, found) = block.at(j);
            return Ok((k == key).then_some((found, EntryAt { block: i, entry: j })));
        }
        Ok(None)
    }

    /// The first key above `after` (the layer's first key if `None`), if any.
    pub(crate) fn next_key(&self, after: Option<BufferTag>) -> anyhow::Result<Option<BufferTag>> {
        let Some(after) = after else {
            return Ok(Some(self.footer.min_key));
        };
        if after >= self.footer.max_key {
            return Ok(None);
        }
        // Blocks starting at or below `after` come before `i`: the first key above it is in
        // block i - 1 or is block i's first.
        let i = self.fences.partition_point(|f| f.key <= after);
        if i > 0 {
            let block = self.block(i - 1, DiskWait::Allowed)?;
            let j = block.find(after, Lsn(u64::MAX));
            if j < block.len() {
                return Ok(Some(self.decode(&block, j)?.key));
            }
        }
        Ok(self.fences.get(i).map(|f| f.key))
    }

    /// Calls `f` with every entry in `(key, lsn)` order, reading the blocks directly (a scan
    /// does not push the lookups' blocks out of the cache).
    pub(crate) fn for_each(&self, f: &mut dyn FnMut(&IndexEntry)) -> anyhow::Result<()> {
        for i in 0..self.fences.len() {
            let block = self.read_block(i, DiskWait::Allowed)?;
            for j in 0..block.len() {
                f(&self.decode(&block, j)?);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    fn key(rel: u32, blk: u32) -> BufferTag {
        BufferTag { spcnode: 1, dbnode: 2, relnode: rel, forknum: 0, blknum: blk }
    }

    /// A layer file of `entries` (their values are not written: a data region of zeros).
    fn layer_of(entries: &[IndexEntry]) -> (Arc<File>, u64) {
        let file = tempfile::tempfile().unwrap();
        let data_end = entries.iter().map(|e| e.offset + u64::from(e.len)).max().unwrap();
        let (bytes, _, _) = encode(data_end, entries).unwrap();
        file.write_all_at(&bytes, data_end).unwrap();
        (Arc::new(file), data_end + bytes.len() as u64)
    }

    /// `keys` keys with `per_key` values each (an image, then records), sorted.
    fn entries(keys: u32, per_key: u64) -> Vec<IndexEntry> {
        let mut out = Vec::new();
        let mut offset = FILE_HEADER_LEN;
        for k in 0..keys {
            for l in 0..per_key {
                let kind = if l == 0 { Kind::Image } else { Kind::Record };
                let len = if l == 0 { 8192 } else { 40 };
                out.push(IndexEntry {
                    key: key(1 + k / 100, k % 100),
                    lsn: Lsn(10 + l * 3 + u64::from(k % 2)),
                    kind,
                    offset,
                    len,
                    crc: k,
                });
                offset += u64::from(len);
            }
        }
        out
    }

    #[test]
    fn lookups_equal_a_filter_of_the_entries_across_block_boundaries() {
        for (keys, per_key) in [(1, 1), (3, 500), (700, 3), (40, 177)] {
            let all = entries(keys, per_key);
            let (file, len) = layer_of(&all);
            let idx = BlockIndex::open(file, len).unwrap();
            assert_eq!(idx.footer.entry_count, all.len() as u64);
            assert_eq!(idx.footer.key_count, u64::from(keys));
            assert_eq!(idx.fences().len(), all.len().div_ceil(BLOCK_ENTRIES));
            let mut distinct: Vec<BufferTag> = all.iter().map(|e| e.key).collect();
            distinct.dedup();
            for (n, k) in
                distinct.iter().enumerate().step_by(7).chain([(distinct.len() - 1, distinct.last().unwrap())])
            {
                for lsn in [0, 9, 10, 11, 13, 40, 200, u64::MAX] {
                    let want: Vec<_> =
                        all.iter().filter(|e| e.key == *k && e.lsn <= Lsn(lsn)).copied().collect();
                    assert_eq!(
                        idx.lookup(*k, Lsn(lsn), DiskWait::Allowed).unwrap(),
                        want,
                        "{k:?}@{lsn} ({keys}x{per_key})"
                    );
                    assert_eq!(
                        idx.newest(*k, Lsn(lsn), DiskWait::Allowed).unwrap().map(|(found, _)| found),
                        want.last().map(|e| e.lsn),
                        "newest of {k:?}@{lsn} ({keys}x{per_key})"
                    );
                }
                let next = distinct.get(n + 1).copied();
                assert_eq!(idx.next_key(Some(*k)).unwrap(), next, "next after {k:?}");
            }
            assert_eq!(idx.next_key(None).unwrap(), distinct.first().copied());
            assert!(idx.lookup(key(999, 0), Lsn(u64::MAX), DiskWait::Allowed).unwrap().is_empty());
            assert!(idx.lookup(key(0, 0), Lsn(u64::MAX), DiskWait::Allowed).unwrap().is_empty());
            assert_eq!(idx.newest(key(999, 0), Lsn(u64::MAX), DiskWait::Allowed).unwrap(), None);
            assert_eq!(idx.newest(key(0, 0), Lsn(u64::MAX), DiskWait::Allowed).unwrap(), None);
            let mut seen = Vec::new();
            idx.for_each(&mut |e| seen.push(*e)).unwrap();
            assert_eq!(seen, all);
        }
    }

    #[test]
    fn down_to_image_is_the_newest_entries_down_to_the_image_and_reads_no_block_below_it() {
        // 3 keys of 600 values, an image every 100th: a key spans several blocks.
        let mut all = entries(3, 600);
        let mut offset = FILE_HEADER_LEN;
        for (i, e) in all.iter_mut().enumerate() {
            (e.kind, e.len) = if i % 100 == 0 { (Kind::Image, 8192) } else { (Kind::Record, 40) };
            e.offset = offset;
            offset += u64::from(e.len);
        }
        let (file, len) = layer_of(&all);
        let idx = BlockIndex::open(file, len).unwrap();
        for k in [key(1, 0), key(1, 1), key(1, 2)] {
            for lsn in [0, 10, 12, 300, 1000, 1500, u64::MAX] {
                let mut want: Vec<_> =
                    all.iter().filter(|e| e.key == k && e.lsn <= Lsn(lsn)).rev().copied().collect();
                if let Some(i) = want.iter().position(|e| e.kind == Kind::Image) {
                    want.truncate(i + 1);
                }
                let at = idx.newest(k, Lsn(lsn), DiskWait::Allowed).unwrap();
                assert_eq!(at.map(|(found, _)| found), want.first().map(|e| e.lsn), "{k:?}@{lsn}");
                let (before, blocks) = idx.blocks_read();
                let from_lookup = match at {
                    Some((_, at)) => idx.down_to_image(k, at, DiskWait::Allowed).unwrap(),
                    None => Vec::new(),
                };
                assert_eq!(from_lookup, want, "{k:?}@{lsn} from {at:?}");
                let read = idx.blocks_read().0 - before;
                // At most the blocks the entries down to the image lie in (and the one after).
                let span = 100usize.div_ceil(BLOCK_ENTRIES) as u64 + 2;
                assert!(read <= span, "{k:?}@{lsn}: {read} of {blocks} blocks");
            }
        }
        assert_eq!(idx.newest(key(999, 0), Lsn(u64::MAX), DiskWait::Allowed).unwrap(), None);
        // A place that is not one of the key's entries is refused, not read as "no entries".
        let (_, at) = idx.newest(key(1, 1), Lsn(u64::MAX), DiskWait::Allowed).unwrap().unwrap();
        assert!(idx.down_to_image(key(1, 0), at, DiskWait::Allowed).is_err());
        let past = EntryAt { block: at.block, entry: BLOCK_ENTRIES };
        assert!(idx.down_to_image(key(1, 1), past, DiskWait::Allowed).is_err());
        assert!(idx
            .down_to_image(key(1, 1), EntryAt { block: 1 << 20, entry: 0 }, DiskWait::Allowed)
            .is_err());
    }

    #[test]
    fn fences_carry_the_longest_record_run_per_block() {
        let all = entries(2, 30);
        let (_, _, fences) = encode(1 << 20, &all).unwrap();
        assert_eq!(fences.len(), 1);
        assert_eq!(fences[0].max_records, 29);
    }

    #[test]
    fn encoded_len_is_what_encode_writes() {
        for n in [1, BLOCK_ENTRIES - 1, BLOCK_ENTRIES, BLOCK_ENTRIES + 1, 5000] {
            let all = entries(n as u32, 1);
            let (bytes, _, _) = encode(1 << 30, &all).unwrap();
            assert_eq!(bytes.len() as u64, encoded_len(n), "{n} entries");
        }
    }

    #[test]
    fn unsorted_or_duplicate_entries_are_refused() {
        let mut all = entries(3, 2);
        all.swap(0, 1);
        assert!(encode(1 << 20, &all).is_err());
        let mut all = entries(3, 2);
        all[1] = all[0];
        assert!(encode(1 << 20, &all).is_err());
        assert!(encode(1 << 20, &[]).is_err());
    }

    #[test]
    fn a_block_out_of_order_under_a_good_checksum_is_an_error_for_lookups_and_scans() {
        // What a writer's bug would leave: entries 1 and 2 of block 0 swapped, the block's
        // checksum computed over the swapped bytes.
        let all = entries(30, 9);
        let data_end = all.iter().map(|e| e.offset + u64::from(e.len)).max().unwrap();
        let (mut bytes, footer, mut fences) = encode(data_end, &all).unwrap();
        let (a, b) = (INDEX_ENTRY_LEN, 2 * INDEX_ENTRY_LEN);
        let second: Vec<u8> = bytes[a..b].to_vec();
        bytes.copy_within(b..b + INDEX_ENTRY_LEN, a);
        bytes[b..b + INDEX_ENTRY_LEN].copy_from_slice(&second);
        fences[0].crc = crc32c::crc32c(&bytes[..BLOCK_BYTES as usize]);
        let file = tempfile::tempfile().unwrap();
        file.write_all_at(&bytes, data_end).unwrap();
        let idx = BlockIndex::written(Arc::new(file), footer, fences);
        let err = idx.lookup(all[1].key, Lsn(u64::MAX), DiskWait::Allowed).unwrap_err();
        assert!(format!("{err:#}").contains("index block 0 out of order"), "{err:#}");
        assert!(idx.for_each(&mut |_| ()).is_err());
        // The other blocks are fine.
        let last = all.last().unwrap();
        assert_eq!(idx.lookup(last.key, Lsn(u64::MAX), DiskWait::Allowed).unwrap().last(), Some(last));
    }

    #[test]
    fn any_flipped_byte_of_the_index_is_an_error_never_a_panic_or_a_wrong_answer() {
        let all = entries(30, 9);
        let (file, len) = layer_of(&all);
        let data_end = BlockIndex::open(Arc::clone(&file), len).unwrap().footer.index_offset;
        for at in (data_end..len).step_by(13) {
            let mut b = [0u8];
            file.read_exact_at(&mut b, at).unwrap();
            file.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
            // A fresh open each time: nothing of the good file is cached.
            if let Ok(idx) = BlockIndex::open(Arc::clone(&file), len) {
                let mut all_ok = true;
                for e in all.iter().step_by(11) {
                    match idx.lookup(e.key, Lsn(u64::MAX), DiskWait::Allowed) {
                        Ok(got) => {
                            let want: Vec<_> = all.iter().filter(|x| x.key == e.key).copied().collect();
                            assert_eq!(got, want, "flipped byte at {at}");
                        }
                        Err(_) => all_ok = false,
                    }
                }
                assert!(!all_ok || idx.for_each(&mut |_| ()).is_err(), "flipped byte at {at} went unnoticed");
            }
            file.write_all_at(&b, at).unwrap();
        }
    }
}
