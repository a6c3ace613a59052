//! WAL records (PostgreSQL 15's `XLogRecord` and what follows it): the fixed header, the block
//! references with their full-page images, and the main data, decoded from one record's bytes
//! the way `DecodeXLogRecord` does; and the restore of a full 8192-byte page from an image
//! (`RestoreBlockImage`).
//!
//! A record is: a 24-byte header (`xl_tot_len`, `xl_xid`, `xl_prev`, `xl_info`, `xl_rmid`, two
//! bytes of padding, `xl_crc`); then fragment headers, each starting with an id byte (a block
//! reference 0..=32 in increasing order, the replication origin 253, the top-level xid 252, and
//! last the main data's length, 255 short or 254 long); then the payloads in the same order:
//! for each block its image and then its data, and last the main data.
//!
//! **Invariants:** [`decode_record`] accepts a record only if its CRC-32C matches (computed
//! over the bytes after the header, then the header up to `xl_crc`) and its fragment headers
//! account for every byte; it never panics and copies no payload (images, block data and main
//! data are slices of the record's `Bytes`). An image is checked to fit a page when decoded, so
//! [`BlockImage::restore_page`] fails only for compression it cannot undo.

use bytes::Bytes;

use crate::{Lsn, PAGE_SIZE};

use super::pglz::{pglz_decompress, PglzError};
use super::rmgr::{rmgr_id_is_valid, RM_XLOG_ID, XLOG_CHECKPOINT_SHUTDOWN, XLOG_SWITCH};
use super::{le_u32, le_u64, WalDecodeError};

/// Size of the fixed record header (`SizeOfXLogRecord`).
pub const XLOG_RECORD_HEADER_LEN: usize = 24;
/// Offset of `xl_crc` in the header: the CRC covers the header bytes before it.
pub const XL_CRC_OFFSET: usize = 20;
/// Longest record the reader assembles (PostgreSQL's `MaxAllocSize`, the most it can
/// allocate for one).
pub const MAX_WAL_RECORD_LEN: u32 = 0x3FFF_FFFF;

/// Largest block reference id.
pub const XLR_MAX_BLOCK_ID: u8 = 32;
/// Main data of fewer than 256 bytes: one length byte follows.
pub const XLR_BLOCK_ID_DATA_SHORT: u8 = 255;
/// Main data of 256 bytes or more: a 4-byte length follows.
pub const XLR_BLOCK_ID_DATA_LONG: u8 = 254;
/// The replication origin (2 bytes) follows.
pub const XLR_BLOCK_ID_ORIGIN: u8 = 253;
/// The top-level transaction id of a subtransaction's record (4 bytes) follows.
pub const XLR_BLOCK_ID_TOPLEVEL_XID: u8 = 252;

/// The low bits of `fork_flags`: the fork number.
pub const BKPBLOCK_FORK_MASK: u8 = 0x0F;
/// The block has a full-page image.
pub const BKPBLOCK_HAS_IMAGE: u8 = 0x10;
/// The block has rmgr data.
pub const BKPBLOCK_HAS_DATA: u8 = 0x20;
/// Redo initializes the page from nothing.
pub const BKPBLOCK_WILL_INIT: u8 = 0x40;
/// The relation is the previous block reference's; no `RelFileNode` follows.
pub const BKPBLOCK_SAME_REL: u8 = 0x80;

/// The image leaves out a "hole" of zeros.
pub const BKPIMAGE_HAS_HOLE: u8 = 0x01;
/// Redo is to restore the image (not only a consistency check copy).
pub const BKPIMAGE_APPLY: u8 = 0x02;
/// The image is PGLZ-compressed.
pub const BKPIMAGE_COMPRESS_PGLZ: u8 = 0x04;
/// The image is LZ4-compressed.
pub const BKPIMAGE_COMPRESS_LZ4: u8 = 0x08;
/// The image is zstd-compressed.
pub const BKPIMAGE_COMPRESS_ZSTD: u8 = 0x10;

const BLCKSZ: u16 = PAGE_SIZE as u16;

/// The fixed header of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XLogRecordHeader {
    pub tot_len: u32,
    pub xid: u32,
    pub prev: Lsn,
    pub info: u8,
    pub rmid: u8,
    pub crc: u32,
}

impl XLogRecordHeader {
    /// Parses the header from the start of `bytes`; `None` if fewer than 24 bytes.
    pub fn parse(bytes: &[u8]) -> Option<XLogRecordHeader> {
        Some(XLogRecordHeader {
            tot_len: le_u32(bytes, 0)?,
            xid: le_u32(bytes, 4)?,
            prev: Lsn(le_u64(bytes, 8)?),
            info: *bytes.get(16)?,
            rmid: *bytes.get(17)?,
            crc: le_u32(bytes, 20)?,
        })
    }

    /// Appends the header's 24 bytes (padding zeroed).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.tot_len.to_le_bytes());
        out.extend_from_slice(&self.xid.to_le_bytes());
        out.extend_from_slice(&self.prev.0.to_le_bytes());
        out.push(self.info);
        out.push(self.rmid);
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.crc.to_le_bytes());
    }

    /// The checks `ValidXLogRecordHeader` makes on a record at `lsn` that do not need the rest
    /// of the record: a length that can hold the header (and no more than a record may have)
    /// and a resource manager id PostgreSQL 15 can write.
    pub fn validate(&self, lsn: Lsn) -> Result<(), WalDecodeError> {
        check_tot_len(lsn, self.tot_len)?;
        if !rmgr_id_is_valid(self.rmid) {
            return Err(WalDecodeError::Rmgr { lsn, rmid: self.rmid });
        }
        Ok(())
    }
}

/// Checks a record's `xl_tot_len`.
pub(crate) fn check_tot_len(lsn: Lsn, len: u32) -> Result<(), WalDecodeError> {
    if (len as usize) < XLOG_RECORD_HEADER_LEN || len > MAX_WAL_RECORD_LEN {
        return Err(WalDecodeError::RecordLength { lsn, len, max: MAX_WAL_RECORD_LEN });
    }
    Ok(())
}

/// The CRC-32C PostgreSQL stores in `xl_crc`: the bytes after the header, then the header up
/// to the CRC field. `None` if `record` is shorter than a header.
pub fn record_crc(record: &[u8]) -> Option<u32> {
    let head = record.get(..XL_CRC_OFFSET)?;
    let body = record.get(XLOG_RECORD_HEADER_LEN..)?;
    Some(crc32c::crc32c_append(crc32c::crc32c(body), head))
}

/// A relation, as PostgreSQL 15 names it in WAL (`RelFileNode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RelFileNode {
    pub spcnode: u32,
    pub dbnode: u32,
    pub relnode: u32,
}

/// How a full-page image is compressed (`wal_compression`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageCompression {
    None,
    Pglz,
    Lz4,
    Zstd,
}

/// A full-page image as stored in a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockImage {
    /// The image's bytes as stored: the page without its hole, compressed or not.
    pub bytes: Bytes,
    /// Where the hole of zeros starts in the page.
    pub hole_offset: u16,
    /// How long the hole is (0: no hole).
    pub hole_length: u16,
    pub compression: ImageCompression,
    /// `BKPIMAGE_APPLY`: redo restores this image (otherwise it is for consistency checks).
    pub apply: bool,
}

/// Why a page could not be restored from an image.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    /// The image is compressed with a method this build does not decompress.
    #[error("full-page image is compressed with {method}, which is not supported: set wal_compression to pglz or off")]
    UnsupportedCompression { method: &'static str },
    /// The PGLZ stream is corrupt.
    #[error("full-page image does not decompress: {0}")]
    Pglz(#[from] PglzError),
    /// The image and its hole do not make a page.
    #[error("full-page image of {len} bytes with a hole of {hole_length} at {hole_offset} does not make an 8192-byte page")]
    BadShape { len: usize, hole_offset: u16, hole_length: u16 },
}

impl BlockImage {
    /// The full 8192-byte page: the image decompressed, with its hole filled with zeros.
    pub fn restore_page(&self) -> Result<Vec<u8>, ImageError> {
        let page_len = PAGE_SIZE - usize::from(self.hole_length);
        let raw: std::borrow::Cow<'_, [u8]> = match self.compression {
            ImageCompression::None => std::borrow::Cow::Borrowed(&self.bytes[..]),
            ImageCompression::Pglz => std::borrow::Cow::Owned(pglz_decompress(&self.bytes, page_len)?),
            ImageCompression::Lz4 => return Err(ImageError::UnsupportedCompression { method: "lz4" }),
            ImageCompression::Zstd => return Err(ImageError::UnsupportedCompression { method: "zstd" }),
        };
        let bad = || ImageError::BadShape {
            len: raw.len(),
            hole_offset: self.hole_offset,
            hole_length: self.hole_length,
        };
        let hole_start = usize::from(self.hole_offset);
        let hole_end = hole_start + usize::from(self.hole_length);
        if raw.len() != page_len || hole_end > PAGE_SIZE {
            return Err(bad());
        }
        let mut page = Vec::with_capacity(PAGE_SIZE);
        page.extend_from_slice(raw.get(..hole_start).ok_or_else(bad)?);
        page.resize(hole_end, 0);
        page.extend_from_slice(raw.get(hole_start..).ok_or_else(bad)?);
        Ok(page)
    }
}

/// One block reference of a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRef {
    /// The block reference id (0..=32), unique and increasing within a record.
    pub id: u8,
    pub rel: RelFileNode,
    pub fork: u8,
    pub blkno: u32,
    /// `BKPBLOCK_WILL_INIT`: redo does not need the page's previous contents.
    pub will_init: bool,
    /// `BKPBLOCK_HAS_DATA`: `data` is not empty.
    pub has_data: bool,
    /// The rmgr's data for this block.
    pub data: Bytes,
    pub image: Option<BlockImage>,
}

/// A record, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedRecord {
    /// Where the record starts.
    pub lsn: Lsn,
    /// Where the record ends (the byte after its last one; the next record starts at the next
    /// 8-byte boundary, after a page header if that is a page start).
    pub end_lsn: Lsn,
    pub xid: u32,
    pub prev: Lsn,
    pub info: u8,
    pub rmid: u8,
    pub blocks: Vec<BlockRef>,
    pub main_data: Bytes,
    /// The replication origin, if the record has one.
    pub origin: Option<u16>,
    /// The top-level transaction id, if the record has one.
    pub toplevel_xid: Option<u32>,
}

impl DecodedRecord {
    /// The resource manager's name as `pg_waldump` prints it.
    pub fn rmgr_name(&self) -> std::borrow::Cow<'static, str> {
        super::rmgr::rmgr_name(self.rmid).unwrap_or(std::borrow::Cow::Borrowed("invalid"))
    }

    /// Whether this is `XLOG_SWITCH`, after which the rest of the segment is unused.
    pub fn is_xlog_switch(&self) -> bool {
        self.rmid == RM_XLOG_ID && self.info & 0xF0 == XLOG_SWITCH
    }

    /// Whether this is `XLOG_CHECKPOINT_SHUTDOWN`: the checkpoint a primary writes as it shuts
    /// down cleanly (and the one a base backup begins with).
    pub fn is_shutdown_checkpoint(&self) -> bool {
        self.rmid == RM_XLOG_ID && self.info & 0xF0 == XLOG_CHECKPOINT_SHUTDOWN
    }

    /// `xl_tot_len`: the record's length in bytes.
    pub fn len(&self) -> u64 {
        self.end_lsn.0.saturating_sub(self.lsn.0)
    }

    /// Whether the record has no bytes (never true of a decoded record).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Reads the fragment headers of a record front to back.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    lsn: Lsn,
}

impl Cursor<'_> {
    fn take<const N: usize>(&mut self, what: &str) -> Result<[u8; N], WalDecodeError> {
        let end = self.at.checked_add(N);
        let got: Option<[u8; N]> =
            end.and_then(|end| self.bytes.get(self.at..end)).and_then(|s| s.try_into().ok());
        match got {
            Some(v) => {
                self.at += N;
                Ok(v)
            }
            None => Err(malformed(self.lsn, format!("record too short for {what}"))),
        }
    }
    fn u8(&mut self, what: &str) -> Result<u8, WalDecodeError> {
        Ok(self.take::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, WalDecodeError> {
        Ok(u16::from_le_bytes(self.take(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32, WalDecodeError> {
        Ok(u32::from_le_bytes(self.take(what)?))
    }
}

fn malformed(lsn: Lsn, reason: String) -> WalDecodeError {
    WalDecodeError::Malformed { lsn, reason }
}

/// A block reference whose payload has not been cut out yet.
struct PendingBlock {
    block: BlockRef,
    data_len: usize,
    image: Option<(usize, u16, u16, ImageCompression, bool)>,
}

/// Decodes one whole record, `record` holding exactly its `xl_tot_len` bytes, that starts at
/// `lsn` and ends at `end_lsn`. Checks the header's length and rmgr id, the CRC, and that the
/// fragment headers account for every byte, as PostgreSQL does.
pub fn decode_record(lsn: Lsn, end_lsn: Lsn, record: Bytes) -> Result<DecodedRecord, WalDecodeError> {
    let header = XLogRecordHeader::parse(&record).ok_or(WalDecodeError::RecordLength {
        lsn,
        len: record.len() as u32,
        max: MAX_WAL_RECORD_LEN,
    })?;
    header.validate(lsn)?;
    if header.tot_len as usize != record.len() {
        return Err(malformed(
            lsn,
            format!("xl_tot_len is {} but the record has {} bytes", header.tot_len, record.len()),
        ));
    }
    let computed = record_crc(&record).unwrap_or(0);
    if computed != header.crc {
        return Err(WalDecodeError::Crc { lsn, stored: header.crc, computed });
    }

    let mut cur = Cursor { bytes: &record, at: XLOG_RECORD_HEADER_LEN, lsn };
    let mut pending: Vec<PendingBlock> = Vec::new();
    let mut main_len = 0usize;
    let mut origin = None;
    let mut toplevel_xid = None;
    // Bytes of payload the headers read so far announce; the loop ends when what is left is
    // all payload (PostgreSQL's `remaining > datatotal`).
    let mut datatotal = 0usize;
    let mut last_rel: Option<RelFileNode> = None;
    while record.len() - cur.at > datatotal {
        let id = cur.u8("a fragment id")?;
        match id {
            XLR_BLOCK_ID_DATA_SHORT => {
                main_len = usize::from(cur.u8("the main data length")?);
                datatotal += main_len;
                break;
            }
            XLR_BLOCK_ID_DATA_LONG => {
                main_len = cur.u32("the main data length")? as usize;
                datatotal = datatotal.saturating_add(main_len);
                break;
            }
            XLR_BLOCK_ID_ORIGIN => origin = Some(cur.u16("the replication origin")?),
            XLR_BLOCK_ID_TOPLEVEL_XID => toplevel_xid = Some(cur.u32("the top-level xid")?),
            id if id <= XLR_MAX_BLOCK_ID => {
                if pending.last().is_some_and(|p| p.block.id >= id) {
                    return Err(malformed(lsn, format!("out-of-order block_id {id}")));
                }
                let fork_flags = cur.u8("a block header")?;
                let data_len = cur.u16("a block header")?;
                let has_data = fork_flags & BKPBLOCK_HAS_DATA != 0;
                if has_data && data_len == 0 {
                    return Err(malformed(
                        lsn,
                        format!("BKPBLOCK_HAS_DATA set, but no data included (block {id})"),
                    ));
                }
                if !has_data && data_len != 0 {
                    return Err(malformed(
                        lsn,
                        format!("BKPBLOCK_HAS_DATA not set, but data length is {data_len} (block {id})"),
                    ));
                }
                datatotal += usize::from(data_len);
                let image = if fork_flags & BKPBLOCK_HAS_IMAGE != 0 {
                    let image = decode_image_header(&mut cur, lsn, id)?;
                    datatotal += image.0;
                    Some(image)
                } else {
                    None
                };
                let rel = if fork_flags & BKPBLOCK_SAME_REL == 0 {
                    let rel = RelFileNode {
                        spcnode: cur.u32("a RelFileNode")?,
                        dbnode: cur.u32("a RelFileNode")?,
                        relnode: cur.u32("a RelFileNode")?,
                    };
                    last_rel = Some(rel);
                    rel
                } else {
                    last_rel.ok_or_else(|| {
                        malformed(lsn, format!("BKPBLOCK_SAME_REL set but no previous rel (block {id})"))
                    })?
                };
                let blkno = cur.u32("a block number")?;
                pending.push(PendingBlock {
                    block: BlockRef {
                        id,
                        rel,
                        fork: fork_flags & BKPBLOCK_FORK_MASK,
                        blkno,
                        will_init: fork_flags & BKPBLOCK_WILL_INIT != 0,
                        has_data,
                        data: Bytes::new(),
                        image: None,
                    },
                    data_len: usize::from(data_len),
                    image,
                });
            }
            id => return Err(malformed(lsn, format!("invalid block_id {id}"))),
        }
    }
    let remaining = record.len() - cur.at;
    if remaining != datatotal {
        return Err(malformed(
            lsn,
            format!("fragment headers announce {datatotal} payload bytes, {remaining} follow"),
        ));
    }

    // Payloads, in header order: each block's image then its data, then the main data.
    let mut at = cur.at;
    let mut cut = |len: usize| -> Result<Bytes, WalDecodeError> {
        // In bounds by the check above (the lengths add up to what follows); checked again
        // so that no slice is ever taken unchecked.
        let end = at.checked_add(len).filter(|&end| end <= record.len());
        let end = end.ok_or_else(|| malformed(lsn, "payload runs past the record".to_owned()))?;
        let piece = record.slice(at..end);
        at = end;
        Ok(piece)
    };
    let mut blocks = Vec::with_capacity(pending.len());
    for p in pending {
        let mut block = p.block;
        if let Some((len, hole_offset, hole_length, compression, apply)) = p.image {
            block.image = Some(BlockImage { bytes: cut(len)?, hole_offset, hole_length, compression, apply });
        }
        block.data = cut(p.data_len)?;
        blocks.push(block);
    }
    let main_data = cut(main_len)?;
    Ok(DecodedRecord {
        lsn,
        end_lsn,
        xid: header.xid,
        prev: header.prev,
        info: header.info,
        rmid: header.rmid,
        blocks,
        main_data,
        origin,
        toplevel_xid,
    })
}

/// Reads an `XLogRecordBlockImageHeader` (and the compressed hole length) and checks it the way
/// `DecodeXLogRecord` does, plus that the hole lies within the page. Returns the stored length,
/// hole offset and length, compression and apply flag.
fn decode_image_header(
    cur: &mut Cursor<'_>,
    lsn: Lsn,
    id: u8,
) -> Result<(usize, u16, u16, ImageCompression, bool), WalDecodeError> {
    let bimg_len = cur.u16("an image header")?;
    let hole_offset = cur.u16("an image header")?;
    let bimg_info = cur.u8("an image header")?;
    let compression = if bimg_info & BKPIMAGE_COMPRESS_PGLZ != 0 {
        ImageCompression::Pglz
    } else if bimg_info & BKPIMAGE_COMPRESS_LZ4 != 0 {
        ImageCompression::Lz4
    } else if bimg_info & BKPIMAGE_COMPRESS_ZSTD != 0 {
        ImageCompression::Zstd
    } else {
        ImageCompression::None
    };
    let compressed = compression != ImageCompression::None;
    let has_hole = bimg_info & BKPIMAGE_HAS_HOLE != 0;
    let hole_length = if compressed {
        if has_hole {
            cur.u16("an image's hole length")?
        } else {
            0
        }
    } else {
        BLCKSZ.saturating_sub(bimg_len)
    };
    let bad = |what: String| Err(malformed(lsn, format!("{what} (block {id})")));
    if has_hole && (hole_offset == 0 || hole_length == 0 || bimg_len == BLCKSZ) {
        return bad(format!("BKPIMAGE_HAS_HOLE set, but hole offset {hole_offset} length {hole_length} block image length {bimg_len}"));
    }
    if !has_hole && (hole_offset != 0 || hole_length != 0) {
        return bad(format!("BKPIMAGE_HAS_HOLE not set, but hole offset {hole_offset} length {hole_length}"));
    }
    if compressed && bimg_len >= BLCKSZ {
        return bad(format!("BKPIMAGE_COMPRESSED set, but block image length {bimg_len}"));
    }
    if !has_hole && !compressed && bimg_len != BLCKSZ {
        return bad(format!(
            "neither BKPIMAGE_HAS_HOLE nor BKPIMAGE_COMPRESSED set, but block image length is {bimg_len}"
        ));
    }
    if bimg_len > BLCKSZ || u32::from(hole_offset) + u32::from(hole_length) > u32::from(BLCKSZ) {
        return bad(format!(
            "image of {bimg_len} bytes with a hole of {hole_length} at {hole_offset} does not fit a page"
        ));
    }
    Ok((usize::from(bimg_len), hole_offset, hole_length, compression, bimg_info & BKPIMAGE_APPLY != 0))
}

#[cfg(test)]
mod tests;
