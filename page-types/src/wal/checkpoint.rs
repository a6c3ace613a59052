//! PostgreSQL 15's checkpoint (`CheckPoint`, `catalog/pg_control.h`), read and written
//! byte-exact, and the start point of a data directory: one WAL segment whose only record is a
//! shutdown checkpoint at a chosen position ([`shutdown_checkpoint_segment`]).
//!
//! A `CheckPoint` is the main data of every `XLOG_CHECKPOINT_*` record and the
//! `checkPointCopy` of `pg_control` ([`crate::control_file::ControlFile`]): the redo position,
//! the timeline, `full_page_writes`, and the counters a server starts from (next xid, oid and
//! multixact, the oldest ones). On x86-64 (the layout of every platform we serve: 64-bit,
//! little-endian) it is 88 bytes; the offsets below were checked against the `checkPointCopy`
//! of a cluster made by PostgreSQL 15's `initdb`, `pg_controldata`'s view of it, and the
//! shutdown checkpoint record `initdb` wrote (the test vectors of `checkpoint/tests.rs`).
//!
//! **The start point.** An unpatched PostgreSQL 15 starts from `pg_control`'s `checkPoint`: it
//! reads the checkpoint record there, and for a shutdown checkpoint whose redo is the record
//! itself it replays nothing ("database system was shut down"). So a data directory whose pages
//! are those of LSN X starts at X if its WAL holds such a record at X' >= X (what `initdb` and
//! `pg_resetwal -l` write, but at a segment start only). X' is X taken to 8 bytes, moved past
//! the page header when that lands on or in one; when the 114-byte record would not fit before
//! the end of X's segment, X' is the first record position of the next segment (40 bytes in),
//! as `pg_resetwal` always does: no page of the directory has an LSN above X, so the gap is
//! never read, and one segment file holds the whole start point. The segment is zeros but for
//! the long page header of its first page, a header on X''s page that says the bytes before X'
//! continue a record begun earlier (`XLP_FIRST_IS_CONTRECORD`, `xlp_rem_len`: without it
//! `pg_waldump -s X'` looks for a record right after the header and finds zeros), the record,
//! and a continuation header where the record crosses into the next page. The record's
//! `xl_prev` is 0: PostgreSQL reads the checkpoint record by random access and asks only that
//! `xl_prev` be below it, and the next record it writes points back at X'.
//!
//! **Invariants:** pure; no input makes anything here panic. A record written here decodes with
//! the WAL decoder ([`crate::wal::WalDecoder`]) into the same `CheckPoint`.

use crate::Lsn;

use super::page::{
    LongPageHeader, PageHeader, DEFAULT_SEGMENT_SIZE, LONG_PAGE_HEADER_LEN, SHORT_PAGE_HEADER_LEN,
    WAL_PAGE_SIZE, XLOG_PAGE_MAGIC, XLP_FIRST_IS_CONTRECORD, XLP_LONG_HEADER,
};
use super::record::{
    record_crc, XLogRecordHeader, XLOG_RECORD_HEADER_LEN, XLR_BLOCK_ID_DATA_SHORT, XL_CRC_OFFSET,
};
use super::rmgr::{RM_XLOG_ID, XLOG_CHECKPOINT_SHUTDOWN};
use super::{le_u32, le_u64, MAXALIGN};

/// `sizeof(CheckPoint)` on 64-bit platforms.
pub const CHECKPOINT_LEN: usize = 88;
/// `xl_tot_len` of a checkpoint record: the header, the short main-data header (id and length)
/// and the `CheckPoint`.
pub const CHECKPOINT_RECORD_LEN: usize = XLOG_RECORD_HEADER_LEN + 2 + CHECKPOINT_LEN;

// Offsets in `CheckPoint` (64-bit layout; the gaps are alignment padding, written as zeros).
const REDO: usize = 0;
const THIS_TIMELINE_ID: usize = 8;
const PREV_TIMELINE_ID: usize = 12;
const FULL_PAGE_WRITES: usize = 16; // bool, then 7 bytes of padding before the 8-byte xid
const NEXT_XID: usize = 24;
const NEXT_OID: usize = 32;
const NEXT_MULTI: usize = 36;
const NEXT_MULTI_OFFSET: usize = 40;
const OLDEST_XID: usize = 44;
const OLDEST_XID_DB: usize = 48;
const OLDEST_MULTI: usize = 52;
const OLDEST_MULTI_DB: usize = 56; // then 4 bytes of padding before the 8-byte time
const TIME: usize = 64;
const OLDEST_COMMIT_TS_XID: usize = 72;
const NEWEST_COMMIT_TS_XID: usize = 76;
const OLDEST_ACTIVE_XID: usize = 80; // then 4 bytes of padding to 88

/// PostgreSQL 15's `CheckPoint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CheckPoint {
    /// Where replay starts (`redo`); for a shutdown checkpoint, the record's own position.
    pub redo: Lsn,
    pub this_timeline_id: u32,
    /// The timeline before this one when the checkpoint begins a timeline, else the same.
    pub prev_timeline_id: u32,
    pub full_page_writes: bool,
    /// `nextXid`, a `FullTransactionId`: the epoch in the high 32 bits, the xid in the low.
    pub next_xid: u64,
    pub next_oid: u32,
    pub next_multi: u32,
    pub next_multi_offset: u32,
    pub oldest_xid: u32,
    pub oldest_xid_db: u32,
    pub oldest_multi: u32,
    pub oldest_multi_db: u32,
    /// `pg_time_t`: seconds since the Unix epoch.
    pub time: i64,
    pub oldest_commit_ts_xid: u32,
    pub newest_commit_ts_xid: u32,
    /// The oldest running xid (online checkpoints with `wal_level` replica); 0 in a shutdown one.
    pub oldest_active_xid: u32,
}

/// Why bytes are not a `CheckPoint`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckPointError {
    #[error("checkpoint data is {len} bytes, PostgreSQL 15's CheckPoint is {CHECKPOINT_LEN}")]
    Length { len: usize },
    #[error("checkpoint's fullPageWrites is {value}, not a bool (0 or 1)")]
    FullPageWrites { value: u8 },
}

impl CheckPoint {
    /// Reads the 88 bytes of a `CheckPoint` (a checkpoint record's main data, or
    /// `checkPointCopy`); the padding is not looked at.
    pub fn decode(bytes: &[u8]) -> Result<CheckPoint, CheckPointError> {
        let length = || CheckPointError::Length { len: bytes.len() };
        if bytes.len() != CHECKPOINT_LEN {
            return Err(length());
        }
        let u32_at = |at| le_u32(bytes, at).ok_or_else(length);
        let fpw = *bytes.get(FULL_PAGE_WRITES).ok_or_else(length)?;
        let full_page_writes = match fpw {
            0 => false,
            1 => true,
            value => return Err(CheckPointError::FullPageWrites { value }),
        };
        Ok(CheckPoint {
            redo: Lsn(le_u64(bytes, REDO).ok_or_else(length)?),
            this_timeline_id: u32_at(THIS_TIMELINE_ID)?,
            prev_timeline_id: u32_at(PREV_TIMELINE_ID)?,
            full_page_writes,
            next_xid: le_u64(bytes, NEXT_XID).ok_or_else(length)?,
            next_oid: u32_at(NEXT_OID)?,
            next_multi: u32_at(NEXT_MULTI)?,
            next_multi_offset: u32_at(NEXT_MULTI_OFFSET)?,
            oldest_xid: u32_at(OLDEST_XID)?,
            oldest_xid_db: u32_at(OLDEST_XID_DB)?,
            oldest_multi: u32_at(OLDEST_MULTI)?,
            oldest_multi_db: u32_at(OLDEST_MULTI_DB)?,
            time: le_u64(bytes, TIME).ok_or_else(length)? as i64,
            oldest_commit_ts_xid: u32_at(OLDEST_COMMIT_TS_XID)?,
            newest_commit_ts_xid: u32_at(NEWEST_COMMIT_TS_XID)?,
            oldest_active_xid: u32_at(OLDEST_ACTIVE_XID)?,
        })
    }

    /// The 88 bytes PostgreSQL writes for this checkpoint, padding zeroed.
    pub fn encode(&self) -> [u8; CHECKPOINT_LEN] {
        let mut out = [0u8; CHECKPOINT_LEN];
        let mut put = |at: usize, bytes: &[u8]| out[at..at + bytes.len()].copy_from_slice(bytes);
        put(REDO, &self.redo.0.to_le_bytes());
        put(THIS_TIMELINE_ID, &self.this_timeline_id.to_le_bytes());
        put(PREV_TIMELINE_ID, &self.prev_timeline_id.to_le_bytes());
        put(FULL_PAGE_WRITES, &[u8::from(self.full_page_writes)]);
        put(NEXT_XID, &self.next_xid.to_le_bytes());
        put(NEXT_OID, &self.next_oid.to_le_bytes());
        put(NEXT_MULTI, &self.next_multi.to_le_bytes());
        put(NEXT_MULTI_OFFSET, &self.next_multi_offset.to_le_bytes());
        put(OLDEST_XID, &self.oldest_xid.to_le_bytes());
        put(OLDEST_XID_DB, &self.oldest_xid_db.to_le_bytes());
        put(OLDEST_MULTI, &self.oldest_multi.to_le_bytes());
        put(OLDEST_MULTI_DB, &self.oldest_multi_db.to_le_bytes());
        put(TIME, &self.time.to_le_bytes());
        put(OLDEST_COMMIT_TS_XID, &self.oldest_commit_ts_xid.to_le_bytes());
        put(NEWEST_COMMIT_TS_XID, &self.newest_commit_ts_xid.to_le_bytes());
        put(OLDEST_ACTIVE_XID, &self.oldest_active_xid.to_le_bytes());
        out
    }
}

/// The bytes of a shutdown-checkpoint record of `checkpoint` (`xl_xid` 0, `xl_prev` 0), CRC-32C
/// included: what [`shutdown_checkpoint_segment`] places at X'.
pub fn shutdown_checkpoint_record(checkpoint: &CheckPoint) -> [u8; CHECKPOINT_RECORD_LEN] {
    let mut out = Vec::with_capacity(CHECKPOINT_RECORD_LEN);
    XLogRecordHeader {
        tot_len: CHECKPOINT_RECORD_LEN as u32,
        xid: 0,
        prev: Lsn::INVALID,
        info: XLOG_CHECKPOINT_SHUTDOWN,
        rmid: RM_XLOG_ID,
        crc: 0,
    }
    .encode(&mut out);
    out.push(XLR_BLOCK_ID_DATA_SHORT);
    out.push(CHECKPOINT_LEN as u8);
    out.extend_from_slice(&checkpoint.encode());
    let mut record = [0u8; CHECKPOINT_RECORD_LEN];
    record.copy_from_slice(&out);
    let crc = record_crc(&record).expect("the record has a whole header");
    record[XL_CRC_OFFSET..XLOG_RECORD_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    record
}

/// Why no start point was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StartPointError {
    #[error("WAL segment size {size} is not supported: only 16 MiB (initdb's default)")]
    SegmentSize { size: u32 },
    #[error("timeline 0 is not a timeline")]
    Timeline,
    #[error("LSN {lsn} is not a start point: it is in the first WAL segment, where a cluster never writes, or at the end of the LSN space")]
    Lsn { lsn: Lsn },
}

/// A WAL segment that starts a cluster at X: see the module doc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartSegment {
    /// X': where the shutdown checkpoint record starts, its `redo` and `pg_control`'s
    /// `checkPoint`.
    pub lsn: Lsn,
    /// Where the record ends: the server's first record starts at the next 8-byte boundary.
    pub end_lsn: Lsn,
    /// The segment file's name in `pg_wal` (timeline, then the segment number in two halves).
    pub file_name: String,
    /// The whole segment.
    pub bytes: Vec<u8>,
    /// The checkpoint as written (`redo` = X').
    pub checkpoint: CheckPoint,
}

/// The header size of the WAL page that starts at `page`: long at a segment start.
fn header_len_at(page: u64, seg: u64) -> u64 {
    if page % seg == 0 {
        LONG_PAGE_HEADER_LEN as u64
    } else {
        SHORT_PAGE_HEADER_LEN as u64
    }
}

/// Where a checkpoint record written at `at` ends, `None` if it would cross the end of `at`'s
/// segment. `at` is a record position (past the page header, 8-aligned).
fn record_end(at: u64, seg: u64) -> Option<u64> {
    let seg_end = at - at % seg + seg;
    let mut pos = at;
    let mut left = CHECKPOINT_RECORD_LEN as u64;
    loop {
        let page_end = pos - pos % WAL_PAGE_SIZE + WAL_PAGE_SIZE;
        let n = left.min(page_end - pos);
        pos += n;
        left -= n;
        if left == 0 {
            return Some(pos);
        }
        if page_end >= seg_end {
            return None;
        }
        pos = page_end + SHORT_PAGE_HEADER_LEN as u64;
    }
}

/// X' for a start at `x` (see the module doc): `x` taken to 8 bytes and past a page header, or
/// the first record position of the next segment when the record would not fit in `x`'s.
pub fn shutdown_checkpoint_lsn(x: Lsn, seg_size: u32) -> Result<Lsn, StartPointError> {
    if seg_size != DEFAULT_SEGMENT_SIZE {
        return Err(StartPointError::SegmentSize { size: seg_size });
    }
    let seg = u64::from(seg_size);
    // Below: the first segment holds no cluster's WAL; above: room for two segments, so that
    // the arithmetic below cannot overflow.
    if x.0 < seg || x.0 > u64::MAX - 2 * seg {
        return Err(StartPointError::Lsn { lsn: x });
    }
    let aligned = x.0.next_multiple_of(MAXALIGN);
    let page = aligned - aligned % WAL_PAGE_SIZE;
    let at = aligned.max(page + header_len_at(page, seg));
    if record_end(at, seg).is_some() {
        return Ok(Lsn(at));
    }
    let next_segment = at - at % seg + seg;
    Ok(Lsn(next_segment + LONG_PAGE_HEADER_LEN as u64))
}

/// The name PostgreSQL gives the segment holding `lsn` on `timeline` (`XLogFileName`).
pub fn segment_file_name(timeline: u32, lsn: Lsn, seg_size: u32) -> String {
    let seg = u64::from(seg_size.max(1));
    let segno = lsn.0 / seg;
    let per_xlogid = (1u64 << 32) / seg;
    format!("{timeline:08X}{:08X}{:08X}", segno / per_xlogid.max(1), segno % per_xlogid.max(1))
}

/// The WAL segment that starts a cluster at `x` (the end of a record, or any position that no
/// page's LSN exceeds): a shutdown checkpoint record of `checkpoint` with its `redo` set to X'
/// (see the module doc), on `timeline`, for the cluster `system_id`. Only 16 MiB segments.
pub fn shutdown_checkpoint_segment(
    x: Lsn,
    timeline: u32,
    system_id: u64,
    seg_size: u32,
    checkpoint: &CheckPoint,
) -> Result<StartSegment, StartPointError> {
    if timeline == 0 {
        return Err(StartPointError::Timeline);
    }
    let lsn = shutdown_checkpoint_lsn(x, seg_size)?;
    let seg = u64::from(seg_size);
    let seg_start = lsn.0 - lsn.0 % seg;
    let checkpoint = CheckPoint { redo: lsn, ..*checkpoint };
    let record = shutdown_checkpoint_record(&checkpoint);

    let mut bytes = vec![0u8; seg_size as usize];
    let long = LongPageHeader { system_id, seg_size, xlog_blcksz: WAL_PAGE_SIZE as u32 };
    // Writes the header of the page at `page` (`info` gets the long flag at a segment start).
    let put_header = |bytes: &mut Vec<u8>, page: u64, info: u16, rem_len: u32| {
        let is_long = page == seg_start;
        let header = PageHeader {
            magic: XLOG_PAGE_MAGIC,
            info: if is_long { info | XLP_LONG_HEADER } else { info },
            tli: timeline,
            pageaddr: Lsn(page),
            rem_len,
            long: is_long.then_some(long),
        };
        let mut encoded = Vec::with_capacity(LONG_PAGE_HEADER_LEN);
        header.encode(&mut encoded);
        let at = (page - seg_start) as usize;
        bytes[at..at + encoded.len()].copy_from_slice(&encoded);
    };
    put_header(&mut bytes, seg_start, 0, 0);
    // X''s page: the bytes between its header and X' are a continuation, so that a reader
    // looking for the first record on the page lands on X'. A record right after the header
    // must not have the flag (PostgreSQL: "contrecord is requested").
    let page = lsn.0 - lsn.0 % WAL_PAGE_SIZE;
    let rem_len = (lsn.0 - page - header_len_at(page, seg)) as u32;
    put_header(&mut bytes, page, if rem_len > 0 { XLP_FIRST_IS_CONTRECORD } else { 0 }, rem_len);

    let mut pos = lsn.0;
    let mut rest = &record[..];
    loop {
        let page_end = pos - pos % WAL_PAGE_SIZE + WAL_PAGE_SIZE;
        let n = rest.len().min((page_end - pos) as usize);
        let at = (pos - seg_start) as usize;
        bytes[at..at + n].copy_from_slice(&rest[..n]);
        rest = &rest[n..];
        pos += n as u64;
        if rest.is_empty() {
            break;
        }
        // shutdown_checkpoint_lsn chose X' so that the record ends in this segment.
        put_header(&mut bytes, page_end, XLP_FIRST_IS_CONTRECORD, rest.len() as u32);
        pos = page_end + SHORT_PAGE_HEADER_LEN as u64;
    }
    Ok(StartSegment {
        lsn,
        end_lsn: Lsn(pos),
        file_name: segment_file_name(timeline, lsn, seg_size),
        bytes,
        checkpoint,
    })
}

#[cfg(test)]
mod tests;
