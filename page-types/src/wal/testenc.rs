//! Test-only WAL encoder: the inverse of [`super::record::decode_record`] and
//! [`super::reader::WalDecoder`], writing records as `XLogInsert` lays them out and pages as
//! the WAL writer does (short headers, a long one at each segment start, continuation flags and
//! `xlp_rem_len`, padding to 8 bytes), plus proptest strategies for random records. The
//! decoder's tests check that what this writes decodes back equal.
//!
//! **Invariants:** test code only; it writes what PostgreSQL 15 would for the same record, so
//! a round-trip failure is the decoder's (or this file's) bug, never an accepted difference.

use bytes::Bytes;
use proptest::prelude::*;

use crate::Lsn;

use super::page::{
    LongPageHeader, PageHeader, WAL_PAGE_SIZE, XLOG_PAGE_MAGIC, XLP_FIRST_IS_CONTRECORD,
    XLP_FIRST_IS_OVERWRITE_CONTRECORD, XLP_LONG_HEADER,
};
use super::pglz::pglz_compress_runs;
use super::record::*;
use super::rmgr::{RM_XLOG_ID, XLOG_SWITCH};

/// The bytes of `rec` as a record whose prev-link is `prev`, CRC included.
pub fn encode_record(rec: &DecodedRecord, prev: Lsn) -> Vec<u8> {
    let mut headers = Vec::new();
    let mut payload = Vec::new();
    let mut prev_rel = None;
    for b in &rec.blocks {
        let mut fork_flags = b.fork & BKPBLOCK_FORK_MASK;
        if b.image.is_some() {
            fork_flags |= BKPBLOCK_HAS_IMAGE;
        }
        if b.has_data {
            fork_flags |= BKPBLOCK_HAS_DATA;
        }
        if b.will_init {
            fork_flags |= BKPBLOCK_WILL_INIT;
        }
        let same_rel = prev_rel == Some(b.rel);
        if same_rel {
            fork_flags |= BKPBLOCK_SAME_REL;
        }
        headers.push(b.id);
        headers.push(fork_flags);
        headers.extend_from_slice(&(b.data.len() as u16).to_le_bytes());
        if let Some(img) = &b.image {
            let mut info = 0u8;
            if img.hole_length > 0 {
                info |= BKPIMAGE_HAS_HOLE;
            }
            if img.apply {
                info |= BKPIMAGE_APPLY;
            }
            info |= match img.compression {
                ImageCompression::None => 0,
                ImageCompression::Pglz => BKPIMAGE_COMPRESS_PGLZ,
                ImageCompression::Lz4 => BKPIMAGE_COMPRESS_LZ4,
                ImageCompression::Zstd => BKPIMAGE_COMPRESS_ZSTD,
            };
            headers.extend_from_slice(&(img.bytes.len() as u16).to_le_bytes());
            headers.extend_from_slice(&img.hole_offset.to_le_bytes());
            headers.push(info);
            if img.compression != ImageCompression::None && img.hole_length > 0 {
                headers.extend_from_slice(&img.hole_length.to_le_bytes());
            }
            payload.extend_from_slice(&img.bytes);
        }
        if !same_rel {
            headers.extend_from_slice(&b.rel.spcnode.to_le_bytes());
            headers.extend_from_slice(&b.rel.dbnode.to_le_bytes());
            headers.extend_from_slice(&b.rel.relnode.to_le_bytes());
        }
        headers.extend_from_slice(&b.blkno.to_le_bytes());
        payload.extend_from_slice(&b.data);
        prev_rel = Some(b.rel);
    }
    if let Some(origin) = rec.origin {
        headers.push(XLR_BLOCK_ID_ORIGIN);
        headers.extend_from_slice(&origin.to_le_bytes());
    }
    if let Some(xid) = rec.toplevel_xid {
        headers.push(XLR_BLOCK_ID_TOPLEVEL_XID);
        headers.extend_from_slice(&xid.to_le_bytes());
    }
    if !rec.main_data.is_empty() {
        if rec.main_data.len() < 256 {
            headers.push(XLR_BLOCK_ID_DATA_SHORT);
            headers.push(rec.main_data.len() as u8);
        } else {
            headers.push(XLR_BLOCK_ID_DATA_LONG);
            headers.extend_from_slice(&(rec.main_data.len() as u32).to_le_bytes());
        }
        payload.extend_from_slice(&rec.main_data);
    }
    let tot_len = (XLOG_RECORD_HEADER_LEN + headers.len() + payload.len()) as u32;
    let header = XLogRecordHeader { tot_len, xid: rec.xid, prev, info: rec.info, rmid: rec.rmid, crc: 0 };
    let mut out = Vec::with_capacity(tot_len as usize);
    header.encode(&mut out);
    out.extend_from_slice(&headers);
    out.extend_from_slice(&payload);
    let crc = record_crc(&out).expect("a whole header");
    out[XL_CRC_OFFSET..XLOG_RECORD_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    out
}

/// Writes records into WAL pages from a page-aligned start.
pub struct WalWriter {
    pub seg_size: u32,
    pub system_id: u64,
    pub start: Lsn,
    pub pos: u64,
    /// The WAL from `start` to `pos`.
    pub bytes: Vec<u8>,
    pub prev: Lsn,
}

impl WalWriter {
    pub fn new(start: u64, seg_size: u32) -> WalWriter {
        assert_eq!(start % WAL_PAGE_SIZE, 0);
        WalWriter {
            seg_size,
            system_id: 0x1234_5678_9abc,
            start: Lsn(start),
            pos: start,
            bytes: Vec::new(),
            prev: Lsn(0),
        }
    }

    fn put(&mut self, b: &[u8]) {
        self.bytes.extend_from_slice(b);
        self.pos += b.len() as u64;
    }

    fn page_header(&mut self, rem_len: u32) {
        let long = self.pos % u64::from(self.seg_size) == 0;
        let mut info = if rem_len > 0 { XLP_FIRST_IS_CONTRECORD } else { 0 };
        if long {
            info |= XLP_LONG_HEADER;
        }
        let header = PageHeader {
            magic: XLOG_PAGE_MAGIC,
            info,
            tli: 1,
            pageaddr: Lsn(self.pos),
            rem_len,
            long: long.then_some(LongPageHeader {
                system_id: self.system_id,
                seg_size: self.seg_size,
                xlog_blcksz: 8192,
            }),
        };
        let mut out = Vec::new();
        header.encode(&mut out);
        self.put(&out);
    }

    /// Pads to the next 8-byte boundary (and past a page header) where a record may begin.
    fn align(&mut self) {
        while self.pos % 8 != 0 {
            self.put(&[0]);
        }
        if self.pos % WAL_PAGE_SIZE == 0 {
            self.page_header(0);
        }
    }

    /// Appends `rec`, setting its `lsn`, `end_lsn` and `prev` to where it was written.
    pub fn append(&mut self, rec: &mut DecodedRecord) {
        self.append_bytes_of(rec, None);
    }

    /// Appends `rec` but writes only its first `cut` bytes, as a writer that died would.
    pub fn append_bytes_of(&mut self, rec: &mut DecodedRecord, cut: Option<usize>) {
        self.align();
        rec.lsn = Lsn(self.pos);
        rec.prev = self.prev;
        let bytes = encode_record(rec, self.prev);
        let len = cut.unwrap_or(bytes.len()).min(bytes.len());
        let mut off = 0;
        while off < len {
            if self.pos % WAL_PAGE_SIZE == 0 {
                self.page_header((bytes.len() - off) as u32);
            }
            let room = (WAL_PAGE_SIZE - self.pos % WAL_PAGE_SIZE) as usize;
            let n = room.min(len - off);
            self.put(&bytes[off..off + n]);
            off += n;
        }
        rec.end_lsn = Lsn(self.pos);
        if cut.is_none() {
            self.prev = rec.lsn;
        }
    }

    /// Leaves the record being written unfinished: zeros to the page end, and the next page
    /// marked `XLP_FIRST_IS_OVERWRITE_CONTRECORD`, as a new primary writes after recovery
    /// found the record's continuation missing.
    pub fn overwrite_contrecord(&mut self) {
        while self.pos % WAL_PAGE_SIZE != 0 {
            self.put(&[0]);
        }
        let at = self.bytes.len();
        self.page_header(0);
        self.bytes[at + 2] |= XLP_FIRST_IS_OVERWRITE_CONTRECORD as u8;
    }

    /// Appends an `XLOG_SWITCH` record and zeros to the end of its segment.
    pub fn switch(&mut self) -> DecodedRecord {
        let mut rec = plain_record(RM_XLOG_ID, XLOG_SWITCH, Vec::new());
        self.append(&mut rec);
        while self.pos % u64::from(self.seg_size) != 0 {
            self.put(&[0]);
        }
        rec
    }
}

/// A record with no block references.
pub fn plain_record(rmid: u8, info: u8, main_data: Vec<u8>) -> DecodedRecord {
    DecodedRecord {
        lsn: Lsn(0),
        end_lsn: Lsn(0),
        xid: 7,
        prev: Lsn(0),
        info,
        rmid,
        blocks: Vec::new(),
        main_data: Bytes::from(main_data),
        origin: None,
        toplevel_xid: None,
    }
}

/// A page of runs of bytes, which [`pglz_compress_runs`] compresses well.
pub fn runs_page(seed: u8) -> Vec<u8> {
    let mut page = Vec::with_capacity(8192);
    let mut b = seed;
    while page.len() < 8192 {
        let run = 1 + usize::from(b) % 97;
        page.extend(std::iter::repeat_n(b, run.min(8192 - page.len())));
        b = b.wrapping_mul(31).wrapping_add(17);
    }
    page
}

/// An image of `page` with a hole, compressed or not, as `XLogRecordAssemble` stores it; the
/// hole is zeroed in `page` so that restoring gives `page` back.
pub fn make_image(
    page: &mut [u8],
    hole_offset: u16,
    hole_length: u16,
    pglz: bool,
    apply: bool,
) -> BlockImage {
    let (hole_offset, hole_length) =
        if hole_length == 0 { (0, 0) } else { (hole_offset.max(1), hole_length) };
    let hole_end = (usize::from(hole_offset) + usize::from(hole_length)).min(8192);
    let hole_length = (hole_end - usize::from(hole_offset)) as u16;
    let (hole_offset, hole_length) = if hole_length == 0 { (0, 0) } else { (hole_offset, hole_length) };
    page[usize::from(hole_offset)..usize::from(hole_offset) + usize::from(hole_length)].fill(0);
    let mut stored = page[..usize::from(hole_offset)].to_vec();
    stored.extend_from_slice(&page[usize::from(hole_offset) + usize::from(hole_length)..]);
    if pglz {
        let packed = pglz_compress_runs(&stored);
        if packed.len() < 8192 {
            return BlockImage {
                bytes: Bytes::from(packed),
                hole_offset,
                hole_length,
                compression: ImageCompression::Pglz,
                apply,
            };
        }
    }
    BlockImage {
        bytes: Bytes::from(stored),
        hole_offset,
        hole_length,
        compression: ImageCompression::None,
        apply,
    }
}

fn arb_image() -> impl Strategy<Value = BlockImage> {
    (
        any::<u8>(),
        0u16..8192,
        prop_oneof![Just(0u16), 1u16..8192, 7000u16..8191],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(seed, hole_offset, hole_length, pglz, apply)| {
            let mut page = runs_page(seed);
            make_image(&mut page, hole_offset, hole_length, pglz, apply)
        })
}

fn arb_block(id: u8) -> impl Strategy<Value = BlockRef> {
    (
        0u32..3,
        0u8..4,
        any::<u32>(),
        any::<bool>(),
        proptest::collection::vec(any::<u8>(), 0..120),
        proptest::option::weighted(0.3, arb_image()),
    )
        .prop_map(move |(rel, fork, blkno, will_init, data, image)| BlockRef {
            id,
            rel: RelFileNode { spcnode: 1663, dbnode: 5, relnode: 16384 + rel },
            fork,
            blkno,
            will_init,
            has_data: !data.is_empty(),
            data: Bytes::from(data),
            image,
        })
}

/// A random record: up to four block references with increasing ids, some with images (holes,
/// PGLZ), main data of any size class, sometimes an origin and a top-level xid. Never an
/// `XLOG_SWITCH`.
pub fn arb_record() -> impl Strategy<Value = DecodedRecord> {
    let ids = proptest::sample::subsequence((0..=XLR_MAX_BLOCK_ID).collect::<Vec<u8>>(), 0..4);
    let blocks = ids.prop_flat_map(|ids| ids.into_iter().map(arb_block).collect::<Vec<_>>());
    let main = prop_oneof![
        4 => proptest::collection::vec(any::<u8>(), 0..255),
        1 => proptest::collection::vec(any::<u8>(), 255..3000),
        1 => (0usize..20000).prop_map(|n| (0..n).map(|i| i as u8).collect()),
    ];
    (
        any::<u32>(),
        any::<u8>(),
        prop_oneof![0u8..=21, 128u8..=255],
        blocks,
        main,
        proptest::option::of(any::<u16>()),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(|(xid, info, rmid, blocks, main, origin, toplevel_xid)| {
            let info = if rmid == RM_XLOG_ID && info & 0xF0 == XLOG_SWITCH { info ^ 0x10 } else { info };
            DecodedRecord {
                lsn: Lsn(0),
                end_lsn: Lsn(0),
                xid,
                prev: Lsn(0),
                info,
                rmid,
                blocks,
                main_data: Bytes::from(main),
                origin,
                toplevel_xid,
            }
        })
}
