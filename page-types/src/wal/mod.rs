//! A pure decoder of PostgreSQL 15 write-ahead log: page headers ([`page`]), records and their
//! block references ([`record`]), full-page image restore with PGLZ ([`pglz`]), the resource
//! manager names `pg_waldump` prints ([`rmgr`]), and a streaming decoder that takes WAL bytes in
//! any chunking and gives back whole records ([`reader`]); and the one thing written here:
//! checkpoints and the WAL segment that starts a cluster at a chosen LSN ([`checkpoint`]).
//!
//! It exists so that the pageserver can ingest real PostgreSQL WAL (and `pagectl waldump` can
//! check it against `pg_waldump`) without linking PostgreSQL. The layouts follow PostgreSQL 15's
//! `xlogrecord.h`, `xlog_internal.h` and `xlogreader.c`; multi-byte fields are little-endian
//! (WAL is written in the writer's byte order, and every platform we serve is little-endian).
//!
//! **Invariants:** no I/O; no input makes anything here panic (every length is checked before
//! it is used, arithmetic on input values is checked or saturating, slices are taken with
//! `get`); no allocation is sized by an input value beyond the bytes actually fed (a record's
//! claimed length only bounds how much is kept; the start segment is 16 MiB, the one segment
//! size it is written for); an error names the LSN it was found at.

pub mod checkpoint;
pub mod page;
pub mod pglz;
pub mod reader;
pub mod record;
pub mod rmgr;

#[cfg(test)]
mod testenc;

use crate::Lsn;

pub use checkpoint::{shutdown_checkpoint_segment, CheckPoint, StartSegment};
pub use page::{LongPageHeader, PageHeader, WAL_PAGE_SIZE, XLOG_PAGE_MAGIC};
pub use reader::WalDecoder;
pub use record::{
    decode_record, BlockImage, BlockRef, DecodedRecord, ImageCompression, ImageError, RelFileNode,
    XLogRecordHeader,
};
pub use rmgr::rmgr_name;

/// PostgreSQL's `MAXALIGN` on 64-bit platforms: records start at multiples of this.
pub const MAXALIGN: u64 = 8;

/// Why WAL could not be decoded. Every variant names the LSN where the problem was found: the
/// page's address for page-level errors, the record's start for record-level ones.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WalDecodeError {
    /// The decoder was asked to start where no record or page can begin.
    #[error("invalid start LSN {lsn}: not a page start and not after a page header on an 8-byte boundary")]
    InvalidStart { lsn: Lsn },
    /// The page header's magic is not PostgreSQL 15's (a zeroed page has magic 0).
    #[error("invalid magic number {magic:04X} in WAL page at {lsn}")]
    PageMagic { lsn: Lsn, magic: u16 },
    /// Unknown flag bits in `xlp_info`.
    #[error("invalid info bits {info:04X} in WAL page at {lsn}")]
    PageInfo { lsn: Lsn, info: u16 },
    /// The page says it is somewhere else (a recycled segment, or the wrong file).
    #[error("unexpected pageaddr {pageaddr} in WAL page at {lsn}")]
    PageAddr { lsn: Lsn, pageaddr: Lsn },
    /// A segment's first page has a short header.
    #[error("WAL page at {lsn} starts a segment but has no long header")]
    MissingLongHeader { lsn: Lsn },
    /// The long header's cross-check fields are not usable.
    #[error("invalid long page header at {lsn}: {reason}")]
    LongHeader { lsn: Lsn, reason: String },
    /// The long header names another database cluster than the segments before it.
    #[error("WAL page at {lsn} has system identifier {got}, expected {expected}")]
    SystemId { lsn: Lsn, got: u64, expected: u64 },
    /// A record continues onto a page that does not say it holds a continuation.
    #[error("there is no contrecord flag at {lsn} (record at {record})")]
    MissingContrecord { lsn: Lsn, record: Lsn },
    /// The continuation's remaining length disagrees with the record's.
    #[error("invalid contrecord length {got} (expected {expected}) at {lsn} (record at {record})")]
    ContrecordLength { lsn: Lsn, record: Lsn, got: u32, expected: u32 },
    /// A page starts with a continuation where a new record was expected.
    #[error("contrecord is requested by {lsn}")]
    UnexpectedContrecord { lsn: Lsn },
    /// `xl_tot_len` is shorter than a record header or longer than any record may be (0 is
    /// where the written WAL ends).
    #[error("invalid record length at {lsn}: wanted at least 24 and at most {max}, got {len}")]
    RecordLength { lsn: Lsn, len: u32, max: u32 },
    /// `xl_tot_len` is a length PostgreSQL may write but more than the decoder was told to
    /// accept ([`WalDecoder::max_record_len`]): the bound a caller puts on what one stream can
    /// make it hold.
    #[error("record at {lsn} is {len} bytes long, over the limit of {max} bytes")]
    RecordTooLarge { lsn: Lsn, len: u32, max: u32 },
    /// `xl_rmid` names no resource manager PostgreSQL 15 can have.
    #[error("invalid resource manager ID {rmid} at {lsn}")]
    Rmgr { lsn: Lsn, rmid: u8 },
    /// `xl_prev` does not point at the record before (`expected`), or, for the first record
    /// decoded (`expected` is `None`), not below the record.
    #[error("record with incorrect prev-link {prev} at {lsn}{}", expected_prev(.expected))]
    PrevLink { lsn: Lsn, prev: Lsn, expected: Option<Lsn> },
    /// The record's CRC-32C does not match its bytes.
    #[error("incorrect resource manager data checksum in record at {lsn}: stored {stored:08X}, computed {computed:08X}")]
    Crc { lsn: Lsn, stored: u32, computed: u32 },
    /// The record's block headers and payloads do not add up.
    #[error("malformed record at {lsn}: {reason}")]
    Malformed { lsn: Lsn, reason: String },
}

impl WalDecodeError {
    /// Whether this is what the end of written WAL looks like rather than damage: a zeroed
    /// record length or page (the unwritten rest of a segment), or a page from an older
    /// position (a recycled segment). PostgreSQL's recovery stops at these the same way.
    pub fn is_end_of_wal(&self) -> bool {
        match self {
            WalDecodeError::RecordLength { len: 0, .. } => true,
            WalDecodeError::PageMagic { magic: 0, .. } => true,
            WalDecodeError::PageAddr { lsn, pageaddr } => pageaddr < lsn,
            _ => false,
        }
    }

    /// The LSN the error names.
    pub fn lsn(&self) -> Lsn {
        match self {
            WalDecodeError::InvalidStart { lsn }
            | WalDecodeError::PageMagic { lsn, .. }
            | WalDecodeError::PageInfo { lsn, .. }
            | WalDecodeError::PageAddr { lsn, .. }
            | WalDecodeError::MissingLongHeader { lsn }
            | WalDecodeError::LongHeader { lsn, .. }
            | WalDecodeError::SystemId { lsn, .. }
            | WalDecodeError::MissingContrecord { lsn, .. }
            | WalDecodeError::ContrecordLength { lsn, .. }
            | WalDecodeError::UnexpectedContrecord { lsn }
            | WalDecodeError::RecordLength { lsn, .. }
            | WalDecodeError::RecordTooLarge { lsn, .. }
            | WalDecodeError::Rmgr { lsn, .. }
            | WalDecodeError::PrevLink { lsn, .. }
            | WalDecodeError::Crc { lsn, .. }
            | WalDecodeError::Malformed { lsn, .. } => *lsn,
        }
    }
}

fn expected_prev(expected: &Option<Lsn>) -> String {
    match expected {
        Some(lsn) => format!(" (expected {lsn})"),
        None => " (expected an LSN below the record)".to_owned(),
    }
}

/// Little-endian reads that return `None` past the end of `b`, never panic.
pub(crate) fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_le_bytes([s[0], s[1]]))
}

pub(crate) fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

pub(crate) fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    let s: [u8; 8] = b.get(at..at.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(s))
}
