//! Sealed layer files: immutable files holding values, their index and a footer, named by what
//! they hold ([`LayerName`]: level, key range, LSN range, generation).
//!
//! A layer is what a full active segment becomes: the committer appends the index and the
//! footer after the last frame, fsyncs, and renames the file, so sealing copies no value bytes
//! and open readers keep their file descriptor. The data region before the index is opaque to
//! readers (for a sealed segment it is batch frames; a compactor writes bare values): only index
//! entries point into it.
//!
//! Two index layouts (docs/storage-format.md): layers written from format version 3 on carry a
//! **block index** (`block_index`: 8 KiB blocks, a fence per block, read on demand through a
//! cache); layers of versions 1 and 2 carry one **flat index** block, loaded whole at open
//! ([`open`] tells them apart by the footer's magic). Everything this build writes has a
//! block index.
//!
//! **Invariants:** a file is a layer only if its footer, footer checksum and index (or fence)
//! checksum are valid and its index and footer end exactly at the end of the file; a layer file
//! is never written again once renamed; every entry lies inside the data region.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{ensure, Context};
use page_types::{BufferTag, Lsn};

use super::format::{self, put_key, Cursor, IndexEntry, Kind, FILE_HEADER_LEN, KEY_LEN};
use super::segment::{open_data_file, read_at};

pub(crate) mod block_index;

pub use block_index::DiskWait;
pub(crate) use block_index::{BlockIndex, EntryAt, WouldWait};

/// First 4 bytes of an index block ("INDX"); never equal to a batch frame's magic.
pub(crate) const INDEX_MAGIC: u32 = u32::from_le_bytes(*b"INDX");
/// Size of one index entry: key, lsn u64, kind u8, offset u64, len u32, crc u32.
pub(crate) const INDEX_ENTRY_LEN: usize = KEY_LEN + 8 + 1 + 8 + 4 + 4;
/// Version of the flat footer's layout, independent of the file header's format version.
pub(crate) const FOOTER_VERSION: u32 = 1;
/// Magic at the start of the flat footer.
pub(crate) const FOOTER_MAGIC: [u8; 8] = *b"PSLAYER1";
/// magic(8) version u32 entry_count u64 index_offset u64 index_len u64 first_lsn u64
/// last_lsn u64 index_crc u32 footer_crc u32.
pub(crate) const FOOTER_LEN: u64 = 60;

/// The decoded footer of a layer file with a flat index (`PSLAYER1`; a block-indexed layer's
/// is a [`block_index::BlockIndexFooter`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FlatFooter {
    pub entry_count: u64,
    pub index_offset: u64,
    pub index_len: u64,
    pub first_lsn: Lsn,
    pub last_lsn: Lsn,
    pub index_crc: u32,
}

/// What a layer file holds, as its name says: a seal of the active segment (level 0: whatever
/// keys arrived, in arrival order) or an output of a compaction pass (level 1: sorted by key;
/// the outputs of one pass are key-disjoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    Sealed,
    Compacted,
}

/// Everything a layer's file name says. Names this build writes are
/// `layer_L<level>_<min key>-<max key>_<first lsn>-<last lsn>_g<generation>.layer`
/// ([`file_name`]); names of builds before it (`layer_<first>_<last>[_<id>].layer`, no key
/// range, no generation) are still read ([`parse_file_name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LayerName {
    pub level: Level,
    pub first: Lsn,
    pub last: Lsn,
    /// The smallest and the largest key in the file (names of this build).
    pub keys: Option<(BufferTag, BufferTag)>,
    /// The generation of the manifest that recorded the seal or the compaction pass the file
    /// was written for (names of this build): with the key and LSN ranges it makes the name
    /// unique within the timeline for good, also across an interrupted pass and its retry.
    pub generation: Option<u64>,
    /// The output number of a compaction pass (older names of compaction outputs).
    pub id: Option<u64>,
}

impl LayerName {
    /// The name of a file written by this build.
    pub(crate) fn new(
        level: Level,
        keys: (BufferTag, BufferTag),
        first: Lsn,
        last: Lsn,
        generation: u64,
    ) -> LayerName {
        LayerName { level, first, last, keys: Some(keys), generation: Some(generation), id: None }
    }

    /// The name a seal got before names carried key ranges (what version 1 recovery gives an
    /// interrupted seal of such a directory).
    pub(crate) fn older_seal(first: Lsn, last: Lsn) -> LayerName {
        LayerName { level: Level::Sealed, first, last, keys: None, generation: None, id: None }
    }
}

/// The file name of `n`: the names this build writes when `n` has keys and a generation, else
/// the older form (tests of old directories, and version 1 recovery).
pub(crate) fn file_name(n: &LayerName) -> String {
    match (n.keys, n.generation) {
        (Some((min, max)), Some(generation)) => format!(
            "layer_L{}_{}-{}_{:016X}-{:016X}_g{generation:016X}.layer",
            match n.level {
                Level::Sealed => 0,
                Level::Compacted => 1,
            },
            key_hex(&min),
            key_hex(&max),
            n.first.0,
            n.last.0
        ),
        _ => match n.id {
            None => format!("layer_{:016X}_{:016X}.layer", n.first.0, n.last.0),
            Some(id) => format!("layer_{:016X}_{:016X}_{id:016X}.layer", n.first.0, n.last.0),
        },
    }
}

/// A key as 34 upper-case hex digits: spcnode, dbnode, relnode (8 each), forknum (2), blknum
/// (8), so that names sort by key as keys do.
fn key_hex(k: &BufferTag) -> String {
    format!("{:08X}{:08X}{:08X}{:02X}{:08X}", k.spcnode, k.dbnode, k.relnode, k.forknum, k.blknum)
}

/// Parses a name of either form [`file_name`] makes; `None` for anything else.
pub(crate) fn parse_file_name(name: &str) -> Option<LayerName> {
    let rest = name.strip_prefix("layer_")?.strip_suffix(".layer")?;
    let hex = |s: &str, digits: usize| {
        (s.len() == digits && s.bytes().all(|c| c.is_ascii_hexdigit()))
            .then(|| u64::from_str_radix(s, 16).ok())
            .flatten()
    };
    let pair = |s: &str, digits: usize| {
        let (a, b) = s.split_once('-')?;
        Some((hex(a, digits)?, hex(b, digits)?))
    };
    let key = |k: &str| {
        let field = |from: usize, to: usize| hex(k.get(from..to)?, to - from);
        (k.len() == 34).then_some(())?;
        Some(BufferTag {
            spcnode: field(0, 8)? as u32,
            dbnode: field(8, 16)? as u32,
            relnode: field(16, 24)? as u32,
            forknum: field(24, 26)? as u8,
            blknum: field(26, 34)? as u32,
        })
    };
    let parts: Vec<&str> = rest.split('_').collect();
    match parts[..] {
        [level, keys, lsns, generation] => {
            let level = match level {
                "L0" => Level::Sealed,
                "L1" => Level::Compacted,
                _ => return None,
            };
            let (min, max) = keys.split_once('-')?;
            let (first, last) = pair(lsns, 16)?;
            Some(LayerName {
                level,
                first: Lsn(first),
                last: Lsn(last),
                keys: Some((key(min)?, key(max)?)),
                generation: Some(hex(generation.strip_prefix('g')?, 16)?),
                id: None,
            })
        }
        [first, last] => Some(LayerName {
            level: Level::Sealed,
            first: Lsn(hex(first, 16)?),
            last: Lsn(hex(last, 16)?),
            keys: None,
            generation: None,
            id: None,
        }),
        [first, last, id] => Some(LayerName {
            level: Level::Compacted,
            first: Lsn(hex(first, 16)?),
            last: Lsn(hex(last, 16)?),
            keys: None,
            generation: None,
            id: Some(hex(id, 16)?),
        }),
        _ => None,
    }
}

/// Bytes that [`append_index_and_footer`] adds for `entries` index entries.
pub(crate) fn index_and_footer_len(entries: usize) -> u64 {
    block_index::encoded_len(entries)
}

/// A layer file as written: its length, its index (as [`BlockIndex::open`] would read it
/// back) and the crc32c of all its bytes (what the manifest lists).
pub(crate) struct Written {
    pub len: u64,
    pub index: BlockIndex,
    pub crc: u32,
}

/// Appends the block index of `entries` (sorted here by key, then LSN), its fences and its
/// footer at `data_end` of `file`, without fsync. `data_crc` is the crc32c of the file's bytes
/// before `data_end`. `entries` must be non-empty, unique and lie below `data_end`.
pub(crate) fn append_index_and_footer(
    file: &Arc<File>,
    data_end: u64,
    data_crc: u32,
    entries: &[IndexEntry],
) -> anyhow::Result<Written> {
    let mut sorted;
    let entries = if entries.windows(2).all(|w| (w[0].key, w[0].lsn) < (w[1].key, w[1].lsn)) {
        entries
    } else {
        sorted = entries.to_vec();
        // No two entries share a `(key, lsn)` (the index refuses a second), so an unstable
        // sort gives the one order, and quicker than a stable one.
        sorted.sort_unstable_by_key(|e| (e.key, e.lsn));
        &sorted[..]
    };
    let (buf, footer, fences) = block_index::encode(data_end, entries)?;
    file.write_all_at(&buf, data_end).context("write layer index and footer")?;
    Ok(Written {
        len: data_end + buf.len() as u64,
        index: BlockIndex::written(Arc::clone(file), footer, fences),
        crc: crc32c::crc32c_append(data_crc, &buf),
    })
}

/// The crc32c of the first `len` bytes of `file`, read 1 MiB at a time.
pub(crate) fn file_crc(file: &File, len: u64) -> anyhow::Result<u32> {
    let mut buf = vec![0u8; 1 << 20];
    let (mut crc, mut at) = (0u32, 0u64);
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        read_at(file, &mut buf[..n], at).context("read layer file")?;
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        at += n as u64;
    }
    Ok(crc)
}

/// Bytes that [`append_flat_index_and_footer`] adds for `entries` index entries.
#[cfg(test)]
pub(crate) fn flat_index_and_footer_len(entries: usize) -> u64 {
    4 + (entries * INDEX_ENTRY_LEN) as u64 + FOOTER_LEN
}

/// Appends a flat index (versions 1 and 2: one block, entries sorted by key, then LSN) and its
/// footer at `data_end` of `file`, as builds before version 3 did: for tests of old files.
#[cfg(test)]
pub(crate) fn append_flat_index_and_footer(
    file: &File,
    data_end: u64,
    entries: &[IndexEntry],
) -> anyhow::Result<u64> {
    let mut sorted = entries.to_vec();
    sorted.sort_by_key(|e| (e.key, e.lsn));
    let first_lsn = sorted.iter().map(|e| e.lsn).min().context("seal an empty layer")?;
    let last_lsn = sorted.iter().map(|e| e.lsn).max().context("seal an empty layer")?;

    let mut buf = Vec::with_capacity(4 + sorted.len() * INDEX_ENTRY_LEN + FOOTER_LEN as usize);
    buf.extend_from_slice(&INDEX_MAGIC.to_le_bytes());
    for e in &sorted {
        encode_entry(&mut buf, e);
    }
    let index_len = buf.len() as u64;
    let footer = FlatFooter {
        entry_count: sorted.len() as u64,
        index_offset: data_end,
        index_len,
        first_lsn,
        last_lsn,
        index_crc: crc32c::crc32c(&buf),
    };
    encode_footer(&footer, &mut buf);
    file.write_all_at(&buf, data_end).context("write layer index and footer")?;
    Ok(data_end + buf.len() as u64)
}

/// Appends the encoding of one index entry (key, lsn, kind, offset, len, crc).
pub(crate) fn encode_entry(buf: &mut Vec<u8>, e: &IndexEntry) {
    put_key(buf, &e.key);
    buf.extend_from_slice(&e.lsn.0.to_le_bytes());
    buf.push(e.kind.to_byte());
    buf.extend_from_slice(&e.offset.to_le_bytes());
    buf.extend_from_slice(&e.len.to_le_bytes());
    buf.extend_from_slice(&e.crc.to_le_bytes());
}

/// Bytes `at..at + N` of an index entry.
fn le<const N: usize>(raw: &[u8; INDEX_ENTRY_LEN], at: usize) -> [u8; N] {
    std::array::from_fn(|i| raw[at + i])
}

/// The key and LSN of an encoded index entry (nothing checked): what ordering and searching
/// an index block need.
pub(crate) fn decode_key_lsn(raw: &[u8; INDEX_ENTRY_LEN]) -> (BufferTag, Lsn) {
    let key = BufferTag {
        spcnode: u32::from_le_bytes(le(raw, 0)),
        dbnode: u32::from_le_bytes(le(raw, 4)),
        relnode: u32::from_le_bytes(le(raw, 8)),
        forknum: raw[12],
        blknum: u32::from_le_bytes(le(raw, 13)),
    };
    (key, Lsn(u64::from_le_bytes(le(raw, KEY_LEN))))
}

/// Decodes one index entry (the layout of [`encode_entry`]) of a layer whose data region ends
/// at `data_end` and whose values lie in `lsns`; checks its kind and length, that its value
/// lies in the data region and its LSN in `lsns`. Fixed offsets into a fixed-size entry: no
/// bounds to check per field, so a block of entries decodes at memory speed.
pub(crate) fn decode_entry(
    raw: &[u8; INDEX_ENTRY_LEN],
    data_end: u64,
    lsns: std::ops::RangeInclusive<Lsn>,
) -> anyhow::Result<IndexEntry> {
    let (key, lsn) = decode_key_lsn(raw);
    let e = IndexEntry {
        key,
        lsn,
        kind: Kind::from_byte(raw[KEY_LEN + 8])?,
        offset: u64::from_le_bytes(le(raw, KEY_LEN + 9)),
        len: u32::from_le_bytes(le(raw, KEY_LEN + 17)),
        crc: u32::from_le_bytes(le(raw, KEY_LEN + 21)),
    };
    e.kind.check_len(&e.key, e.len as usize)?;
    ensure!(
        e.offset >= FILE_HEADER_LEN && e.offset + u64::from(e.len) <= data_end,
        "entry outside the data region"
    );
    ensure!(lsns.contains(&e.lsn), "entry lsn {} outside the layer's range", e.lsn);
    Ok(e)
}

#[cfg(test)]
fn encode_footer(f: &FlatFooter, out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&FOOTER_MAGIC);
    out.extend_from_slice(&FOOTER_VERSION.to_le_bytes());
    for v in [f.entry_count, f.index_offset, f.index_len, f.first_lsn.0, f.last_lsn.0] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&f.index_crc.to_le_bytes());
    let crc = crc32c::crc32c(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Reads and checks the footer of a file of `file_len` bytes. An error means "not a complete
/// layer" (for the active segment: sealing had not finished).
pub(crate) fn read_footer(file: &File, file_len: u64) -> anyhow::Result<FlatFooter> {
    ensure!(file_len >= FILE_HEADER_LEN + 4 + FOOTER_LEN, "file too short for a footer");
    let mut raw = [0u8; FOOTER_LEN as usize];
    read_at(file, &mut raw, file_len - FOOTER_LEN).context("read footer")?;
    ensure!(raw[..8] == FOOTER_MAGIC, "bad footer magic");
    let body = &raw[..FOOTER_LEN as usize - 4];
    let mut c = Cursor::new(&raw[8..]);
    let version = c.u32()?;
    let f = FlatFooter {
        entry_count: c.u64()?,
        index_offset: c.u64()?,
        index_len: c.u64()?,
        first_lsn: c.lsn()?,
        last_lsn: c.lsn()?,
        index_crc: c.u32()?,
    };
    ensure!(c.u32()? == crc32c::crc32c(body), "footer checksum mismatch");
    ensure!(version == FOOTER_VERSION, "unsupported layer footer version {version}");
    ensure!(f.index_offset >= FILE_HEADER_LEN, "index inside the file header");
    ensure!(
        f.index_offset.checked_add(f.index_len).and_then(|x| x.checked_add(FOOTER_LEN)) == Some(file_len),
        "index and footer do not end at the end of the file"
    );
    ensure!(
        f.entry_count.checked_mul(INDEX_ENTRY_LEN as u64).and_then(|x| x.checked_add(4)) == Some(f.index_len),
        "index length does not match {} entries",
        f.entry_count
    );
    ensure!(f.entry_count > 0 && f.first_lsn <= f.last_lsn, "empty or inverted layer");
    Ok(f)
}

/// Reads and checks the index block described by `footer`.
pub(crate) fn read_index(file: &File, footer: &FlatFooter) -> anyhow::Result<Vec<IndexEntry>> {
    let len = usize::try_from(footer.index_len).context("index too large")?;
    let mut raw = vec![0u8; len];
    read_at(file, &mut raw, footer.index_offset).context("read layer index")?;
    ensure!(crc32c::crc32c(&raw) == footer.index_crc, "index checksum mismatch");
    let mut c = Cursor::new(&raw);
    ensure!(c.u32()? == INDEX_MAGIC, "bad index magic");
    let raw_entries = raw[c.pos()..].chunks_exact(INDEX_ENTRY_LEN);
    ensure!(
        raw_entries.len() as u64 == footer.entry_count && raw_entries.remainder().is_empty(),
        "index length mismatch"
    );
    raw_entries
        .map(|r| decode_entry(r.try_into()?, footer.index_offset, footer.first_lsn..=footer.last_lsn))
        .collect()
}

/// The index of an opened layer.
pub(crate) enum LayerIndex {
    /// Versions 1 and 2: the whole index, loaded.
    Flat(Vec<IndexEntry>),
    /// Version 3: footer and fences; blocks read on demand.
    Blocks(BlockIndex),
}

/// An opened, checked layer file.
pub(crate) struct OpenLayer {
    pub file: Arc<File>,
    pub last_lsn: Lsn,
    pub index: LayerIndex,
    pub len: u64,
}

/// Opens the layer at `path` read-only and reads its index (a block index's footer and fences,
/// or a flat index whole); checks its header, footer, fences or index, and that its name
/// matches its LSN range.
pub(crate) fn open(path: &Path) -> anyhow::Result<OpenLayer> {
    let file = Arc::new(open_data_file(OpenOptions::new().read(true), path).context("open layer file")?);
    let len = file.metadata().context("stat layer file")?.len();
    let mut header = [0u8; FILE_HEADER_LEN as usize];
    read_at(&file, &mut header, 0).context("read layer header")?;
    format::check_file_header(&header)?;
    let (first_lsn, last_lsn, keys, index) = if block_index::has_block_footer(&file, len) {
        let index = BlockIndex::open(Arc::clone(&file), len)?;
        let f = index.footer;
        (f.first_lsn, f.last_lsn, Some((f.min_key, f.max_key)), LayerIndex::Blocks(index))
    } else {
        let footer = read_footer(&file, len)?;
        (footer.first_lsn, footer.last_lsn, None, LayerIndex::Flat(read_index(&file, &footer)?))
    };
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let parsed = parse_file_name(name).context("not a layer file name")?;
    ensure!(
        (parsed.first, parsed.last) == (first_lsn, last_lsn),
        "name does not match the footer's lsn range {first_lsn}..={last_lsn}"
    );
    if let Some((min, max)) = parsed.keys {
        ensure!(keys == Some((min, max)), "name does not match the footer's key range {keys:?}");
    }
    Ok(OpenLayer { file, last_lsn, index, len })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use page_types::BufferTag;

    use super::*;
    use crate::storage::segment::{ActiveSegment, EncodedFrame};
    use crate::storage::{StorageMetrics, Value};
    use bytes::Bytes;

    fn key(blk: u32) -> BufferTag {
        BufferTag { spcnode: 1, dbnode: 2, relnode: 3, forknum: 0, blknum: blk }
    }

    #[test]
    fn file_name_roundtrip_and_foreign_names_rejected() {
        let min = BufferTag { spcnode: 1663, dbnode: 5, relnode: 0xABCD_EF01, forknum: 2, blknum: 7 };
        let max = BufferTag { spcnode: u32::MAX, dbnode: 0, relnode: 1, forknum: 0x80, blknum: u32::MAX };
        let n = LayerName::new(Level::Compacted, (min, max), Lsn(0x1_0000_002A), Lsn(u64::MAX), 0x2b);
        let name = file_name(&n);
        let want = concat!(
            "layer_L1_0000067F00000005ABCDEF010200000007-FFFFFFFF000000000000000180FFFFFFFF_",
            "000000010000002A-FFFFFFFFFFFFFFFF_g000000000000002B.layer"
        );
        assert_eq!(name, want);
        assert_eq!(parse_file_name(&name), Some(n));
        let sealed = LayerName::new(Level::Sealed, (min, min), Lsn(1), Lsn(2), 3);
        assert_eq!(parse_file_name(&file_name(&sealed)), Some(sealed));
        // names of builds before key ranges
        let name = file_name(&LayerName::older_seal(Lsn(0x1_0000_002A), Lsn(u64::MAX)));
        assert_eq!(name, "layer_000000010000002A_FFFFFFFFFFFFFFFF.layer");
        let parsed = parse_file_name(&name).unwrap();
        assert_eq!(
            (parsed.level, parsed.first, parsed.last),
            (Level::Sealed, Lsn(0x1_0000_002A), Lsn(u64::MAX))
        );
        assert_eq!((parsed.keys, parsed.generation, parsed.id), (None, None, None));
        let parsed =
            parse_file_name("layer_0000000000000001_0000000000000002_000000000000002B.layer").unwrap();
        assert_eq!((parsed.level, parsed.id, parsed.keys), (Level::Compacted, Some(0x2b), None));
        let new = file_name(&n);
        for bad in [
            "layer_1_2.layer".to_string(),
            "active.seg".to_string(),
            "layer_000000010000002A_FFFFFFFFFFFFFFFF".to_string(),
            "layer_0000000000000001_0000000000000002_000000000000002B_0000000000000001.layer".to_string(),
            new.replace("layer_L1", "layer_L2"),
            new.replace("_g0", "_0"),
            new.replace("_g000000000000002B", "_g2B"),
            new.replace("0000067F", "000067F"),
            new.replace("-FFFFFFFF0000", "FFFFFFFF0000"),
            new.replace("_000000010000002A-", "_000000010000002A_"),
        ] {
            assert_eq!(parse_file_name(&bad), None, "{bad}");
        }
    }

    /// The entries of an opened layer, in file order.
    fn entries_of(layer: &OpenLayer) -> Vec<IndexEntry> {
        match &layer.index {
            LayerIndex::Flat(entries) => entries.clone(),
            LayerIndex::Blocks(index) => {
                let mut out = Vec::new();
                index.for_each(&mut |e| out.push(*e)).unwrap();
                out
            }
        }
    }

    fn rec(b: &'static [u8]) -> Value {
        Value::Record(Bytes::from_static(b))
    }

    /// An active segment in `dir` holding `batches`, with a flat or a block index and its footer
    /// appended (not renamed); and the file's length.
    fn sealed_segment(
        dir: &Path,
        batches: &[&[(BufferTag, Lsn, Value)]],
        flat: bool,
    ) -> (ActiveSegment, u64) {
        let dir_file = File::open(dir).unwrap();
        let mut seg = ActiveSegment::create(dir, &dir_file, 0, &StorageMetrics::unregistered()).unwrap();
        for batch in batches {
            seg.append(&EncodedFrame::encode(batch)).unwrap();
        }
        let end = if flat {
            append_flat_index_and_footer(&seg.file, seg.len, &seg.entries).unwrap()
        } else {
            let written = append_index_and_footer(&seg.file, seg.len, seg.crc, &seg.entries).unwrap();
            // The crc kept while appending, and the index's, make the whole file's.
            assert_eq!(written.crc, file_crc(&seg.file, written.len).unwrap());
            assert_ne!(written.crc, file_crc(&seg.file, written.len - 1).unwrap());
            written.len
        };
        (seg, end)
    }

    /// Reads of an active segment and of a layer leave the file's access time alone
    /// (`O_NOATIME`): under `relatime`, the usual mount option, the kernel would set an atime
    /// older than the file's mtime to now at the next read.
    #[test]
    fn reads_of_segments_and_layers_leave_the_atime_alone() {
        let dir = tempfile::tempdir().unwrap();
        let batches: [&[_]; 2] = [&[(key(1), Lsn(5), rec(b"a"))], &[(key(1), Lsn(7), rec(b"b"))]];
        let (seg, _) = sealed_segment(dir.path(), &batches, false);
        let read_keeps_atime = |file: &File, path: &Path| {
            let old = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1);
            let times = std::fs::FileTimes::new().set_accessed(old);
            File::options().write(true).open(path).unwrap().set_times(times).unwrap();
            read_at(file, &mut [0u8; 8], 0).unwrap();
            let atime = std::fs::metadata(path).unwrap().accessed().unwrap();
            assert_eq!(atime, old, "{} read through the daemon's descriptor", path.display());
        };
        let active = dir.path().join("active.seg");
        read_keeps_atime(&seg.file, &active);
        let path = dir.path().join(file_name(&LayerName::older_seal(Lsn(5), Lsn(7))));
        std::fs::rename(&active, &path).unwrap();
        read_keeps_atime(&open(&path).unwrap().file, &path);
    }

    #[test]
    fn sealed_segment_opens_as_layer_with_sorted_index_in_either_layout() {
        for flat in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let batches: [&[_]; 2] =
                [&[(key(9), Lsn(5), rec(b"a")), (key(1), Lsn(5), rec(b"b"))], &[(key(1), Lsn(7), rec(b"c"))]];
            let (seg, end) = sealed_segment(dir.path(), &batches, flat);
            let path = dir.path().join(file_name(&LayerName::older_seal(Lsn(5), Lsn(7))));
            std::fs::rename(dir.path().join("active.seg"), &path).unwrap();

            let layer = open(&path).unwrap();
            assert_eq!(matches!(layer.index, LayerIndex::Flat(_)), flat);
            assert_eq!(layer.len, end);
            assert_eq!(layer.last_lsn, Lsn(7));
            let entries = entries_of(&layer);
            let order: Vec<_> = entries.iter().map(|e| (e.key.blknum, e.lsn.0)).collect();
            assert_eq!(order, vec![(1, 5), (1, 7), (9, 5)]);
            let mut sorted = seg.entries.clone();
            sorted.sort_by_key(|e| (e.key, e.lsn));
            assert_eq!(entries, sorted);
        }
    }

    #[test]
    fn layer_with_corrupt_index_or_wrong_name_fails_to_open() {
        for flat in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let (seg, _) = sealed_segment(dir.path(), &[&[(key(1), Lsn(5), rec(b"a"))]], flat);
            let wrong = dir.path().join(file_name(&LayerName::older_seal(Lsn(5), Lsn(6))));
            std::fs::rename(dir.path().join("active.seg"), &wrong).unwrap();
            assert!(open(&wrong).is_err());
            // A name with a key range must give the footer's: a flat index has none.
            let named = |keys| file_name(&LayerName::new(Level::Sealed, keys, Lsn(5), Lsn(5), 1));
            for (keys, opens) in [((key(1), key(2)), false), ((key(1), key(1)), !flat)] {
                let path = dir.path().join(named(keys));
                std::fs::rename(&wrong, &path).unwrap();
                assert_eq!(open(&path).is_ok(), opens, "{path:?}");
                std::fs::rename(&path, &wrong).unwrap();
            }

            let right = dir.path().join(file_name(&LayerName::older_seal(Lsn(5), Lsn(5))));
            std::fs::rename(&wrong, &right).unwrap();
            open(&right).unwrap();
            // In the flat index, an entry; in a block index, the fence array (one block of one
            // entry: the fence follows it).
            let at = if flat { seg.len + 6 } else { seg.len + INDEX_ENTRY_LEN as u64 + 6 };
            seg.file.write_all_at(&[0xee], at).unwrap();
            let err = open(&right).err().unwrap();
            let want = if flat { "index checksum mismatch" } else { "fence checksum mismatch" };
            assert!(format!("{err:#}").contains(want), "{err:#}");
        }
    }
}
