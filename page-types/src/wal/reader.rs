//! The streaming WAL decoder: [`WalDecoder::new`] at an LSN, [`WalDecoder::feed`] the bytes
//! that follow in chunks of any size, and [`WalDecoder::next_record`] until it says it needs
//! more. It does what `xlogreader.c` does between pages and records: validates each page header
//! (magic, flags, that the page's address is its position, a long header at each segment
//! start), assembles records that span pages and segments (checking `xlp_rem_len` against what
//! is left of the record), skips the padding to 8 bytes between records and the unused rest of
//! a segment after `XLOG_SWITCH`, and checks each record's prev-link.
//!
//! It starts either at a record boundary, or at the start of a page: then a continuation of a
//! record begun on an earlier page (`XLP_FIRST_IS_CONTRECORD`, `xlp_rem_len` bytes) is skipped
//! and the first record is the first one that begins on that page or later.
//!
//! **Invariants:** no input makes it panic or loop: every pass of the loop consumes a byte,
//! changes state towards consuming one, or returns. It holds at most the bytes fed and not yet
//! consumed plus the part of one record assembled so far (a record's claimed length does not
//! allocate). Once it has returned an error it returns that error again on every call: WAL
//! after damage is not trusted. Every byte before [`WalDecoder::consumed_lsn`] has been used
//! (a page header, padding, a record returned, or the part of the record being assembled).
//!
//! **Record size:** a record may be as long as PostgreSQL can write one
//! ([`MAX_WAL_RECORD_LEN`]), or as long as the caller allows ([`WalDecoder::max_record_len`]):
//! one over it is an error as soon as its length is read, before its bytes are held.

use bytes::Bytes;

use crate::Lsn;

use super::page::{
    PageHeader, DEFAULT_SEGMENT_SIZE, SHORT_PAGE_HEADER_LEN, WAL_PAGE_SIZE, XLP_FIRST_IS_CONTRECORD,
    XLP_FIRST_IS_OVERWRITE_CONTRECORD,
};
use super::record::{
    check_tot_len, decode_record, DecodedRecord, XLogRecordHeader, MAX_WAL_RECORD_LEN, XLOG_RECORD_HEADER_LEN,
};
use super::{le_u32, WalDecodeError, MAXALIGN};

/// Most bytes reserved up front for a record being assembled; beyond it the buffer grows with
/// the bytes that actually arrive.
const RECORD_PREALLOC: usize = 64 << 10;

/// A record being assembled from one or more pages.
#[derive(Debug)]
struct Partial {
    start: u64,
    /// Known once its first four bytes are in.
    tot_len: Option<u32>,
    bytes: Vec<u8>,
}

#[derive(Debug)]
enum State {
    /// At the first page of a decoder started at a page boundary: a continuation there belongs
    /// to a record that began before the start and is skipped.
    FirstPage,
    /// Skipping the rest of a record that began before the start.
    SkipContinuation {
        remaining: u32,
    },
    /// The next byte after the padding to 8 bytes (and a page header, at a page start) begins
    /// a record.
    Between,
    InRecord(Partial),
    /// After `XLOG_SWITCH`: discarding bytes up to the next segment start, unread.
    SkipTo {
        target: u64,
    },
}

/// Decodes a stream of PostgreSQL 15 WAL into records. See the module doc.
#[derive(Debug)]
pub struct WalDecoder {
    /// LSN of `pending[head]`.
    pos: u64,
    pending: Vec<u8>,
    head: usize,
    state: State,
    seg_size: Option<u32>,
    system_id: Option<u64>,
    /// The last record returned, for the next one's prev-link.
    prev_record: Option<Lsn>,
    /// The longest record accepted ([`WalDecoder::max_record_len`]).
    max_record_len: u32,
    failed: Option<WalDecodeError>,
}

impl WalDecoder {
    /// A decoder whose first fed byte is the one at `start`, a record boundary (an end of a
    /// record is taken to the next 8-byte boundary) or a page start. The segment size is
    /// learned from the first long page header; until then an `XLOG_SWITCH` is taken to end a
    /// 16 MiB segment.
    pub fn new(start: Lsn) -> Result<WalDecoder, WalDecodeError> {
        let invalid = WalDecodeError::InvalidStart { lsn: start };
        let pos = start.0.checked_next_multiple_of(MAXALIGN).ok_or(invalid.clone())?;
        let in_page = pos % WAL_PAGE_SIZE;
        let state = if in_page == 0 {
            State::FirstPage
        } else if in_page < SHORT_PAGE_HEADER_LEN as u64 {
            return Err(invalid);
        } else {
            State::Between
        };
        Ok(WalDecoder {
            pos,
            pending: Vec::new(),
            head: 0,
            state,
            seg_size: None,
            system_id: None,
            prev_record: None,
            max_record_len: MAX_WAL_RECORD_LEN,
            failed: None,
        })
    }

    /// Like [`WalDecoder::new`], with the segment size known (and required of long headers).
    pub fn with_segment_size(start: Lsn, seg_size: u32) -> Result<WalDecoder, WalDecodeError> {
        if !super::page::valid_segment_size(seg_size) {
            return Err(WalDecodeError::LongHeader {
                lsn: start,
                reason: format!("segment size {seg_size} is not a power of two from 1 MiB to 1 GiB"),
            });
        }
        let mut decoder = WalDecoder::new(start)?;
        decoder.seg_size = Some(seg_size);
        Ok(decoder)
    }

    /// The decoder, accepting records of at most `max` bytes (header included; at most
    /// [`MAX_WAL_RECORD_LEN`], PostgreSQL's bound, which is also the default): a longer one is
    /// [`WalDecodeError::RecordTooLarge`], found as soon as its length is read, so that no
    /// more than `max` bytes of one record are ever held.
    pub fn max_record_len(mut self, max: u32) -> WalDecoder {
        self.max_record_len = max.min(MAX_WAL_RECORD_LEN);
        self
    }

    /// Appends the WAL bytes that follow those fed before.
    pub fn feed(&mut self, data: &[u8]) {
        // Drop the consumed prefix once it is at least half the buffer: amortized O(1) a byte.
        if self.head > 0 && self.head >= self.pending.len() / 2 {
            self.pending.drain(..self.head);
            self.head = 0;
        }
        self.pending.extend_from_slice(data);
    }

    /// Everything fed before this LSN has been consumed (see the module doc); the bytes from
    /// it to [`WalDecoder::fed_lsn`] wait for the next call.
    pub fn consumed_lsn(&self) -> Lsn {
        Lsn(self.pos)
    }

    /// The LSN just after the last byte fed.
    pub fn fed_lsn(&self) -> Lsn {
        Lsn(self.pos.saturating_add((self.pending.len() - self.head) as u64))
    }

    /// The segment size, once known (given, or read from a long page header).
    pub fn segment_size(&self) -> Option<u32> {
        self.seg_size
    }

    /// The system identifier of the long page headers read so far.
    pub fn system_id(&self) -> Option<u64> {
        self.system_id
    }

    /// The next whole record, `Ok(None)` if the bytes fed so far end before it does.
    pub fn next_record(&mut self) -> Result<Option<DecodedRecord>, WalDecodeError> {
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let result = self.step();
        if let Err(err) = &result {
            self.failed = Some(err.clone());
        }
        result
    }

    fn available(&self) -> usize {
        self.pending.len() - self.head
    }

    /// Takes `n` (at most [`WalDecoder::available`]) bytes.
    fn consume(&mut self, n: usize) -> &[u8] {
        let from = self.head;
        let to = from.saturating_add(n).min(self.pending.len());
        self.head = to;
        self.pos = self.pos.saturating_add((to - from) as u64);
        self.pending.get(from..to).unwrap_or_default()
    }

    fn step(&mut self) -> Result<Option<DecodedRecord>, WalDecodeError> {
        loop {
            let avail = self.available();
            if let State::SkipTo { target } = self.state {
                let n = usize::try_from(target.saturating_sub(self.pos)).unwrap_or(usize::MAX).min(avail);
                self.consume(n);
                if self.pos >= target {
                    self.state = State::Between;
                    continue;
                }
                return Ok(None);
            }
            if self.pos % WAL_PAGE_SIZE == 0 {
                let Some(header) = PageHeader::parse(self.pending.get(self.head..).unwrap_or_default())
                else {
                    return Ok(None);
                };
                self.on_page_header(&header)?;
                self.consume(header.size());
                continue;
            }
            if avail == 0 {
                return Ok(None);
            }
            // Bytes left on this page: never zero here, the page start was handled above.
            let in_page = usize::try_from(WAL_PAGE_SIZE - self.pos % WAL_PAGE_SIZE).unwrap_or(usize::MAX);
            match std::mem::replace(&mut self.state, State::Between) {
                State::FirstPage | State::Between => {
                    let pad = usize::try_from((MAXALIGN - self.pos % MAXALIGN) % MAXALIGN).unwrap_or(0);
                    if pad > 0 {
                        self.consume(pad.min(avail));
                    } else {
                        // The record's whole length when its first 4 bytes are here (most
                        // records): one allocation of the right size, where growing from
                        // empty took two or three.
                        let room = le_u32(self.pending.get(self.head..).unwrap_or_default(), 0)
                            .map_or(0, |tot_len| (tot_len as usize).min(RECORD_PREALLOC));
                        let bytes = Vec::with_capacity(room);
                        self.state = State::InRecord(Partial { start: self.pos, tot_len: None, bytes });
                    }
                }
                State::SkipContinuation { remaining } => {
                    let n = usize::try_from(remaining).unwrap_or(usize::MAX).min(in_page).min(avail);
                    self.consume(n);
                    let remaining = remaining.saturating_sub(n as u32);
                    if remaining > 0 {
                        self.state = State::SkipContinuation { remaining };
                    }
                }
                State::InRecord(partial) => {
                    if let Some(record) = self.assemble(partial, in_page, avail)? {
                        return Ok(Some(record));
                    }
                }
                State::SkipTo { target } => self.state = State::SkipTo { target },
            }
        }
    }

    /// Adds what this page and the bytes fed hold of `partial`; the record once it is whole.
    fn assemble(
        &mut self,
        mut partial: Partial,
        in_page: usize,
        avail: usize,
    ) -> Result<Option<DecodedRecord>, WalDecodeError> {
        let start = Lsn(partial.start);
        let got = partial.bytes.len();
        // The length first (it bounds what is held), then the rest: the header is checked once
        // its bytes are in, in the same call.
        let want = match partial.tot_len {
            None => 4usize.saturating_sub(got),
            Some(tot_len) => (tot_len as usize).saturating_sub(got),
        };
        let n = want.min(in_page).min(avail);
        let piece = self.consume(n);
        partial.bytes.extend_from_slice(piece);
        let got_now = partial.bytes.len();

        if partial.tot_len.is_none() {
            if let Some(tot_len) = le_u32(&partial.bytes, 0) {
                check_tot_len(start, tot_len)?;
                if tot_len > self.max_record_len {
                    return Err(WalDecodeError::RecordTooLarge {
                        lsn: start,
                        len: tot_len,
                        max: self.max_record_len,
                    });
                }
                partial.tot_len = Some(tot_len);
                partial.bytes.reserve((tot_len as usize).min(RECORD_PREALLOC).saturating_sub(got_now));
            }
        }
        if got < XLOG_RECORD_HEADER_LEN && got_now >= XLOG_RECORD_HEADER_LEN {
            if let Some(header) = XLogRecordHeader::parse(&partial.bytes) {
                header.validate(start)?;
                let prev_ok = match self.prev_record {
                    Some(prev) => header.prev == prev,
                    None => header.prev < start,
                };
                if !prev_ok {
                    return Err(WalDecodeError::PrevLink {
                        lsn: start,
                        prev: header.prev,
                        expected: self.prev_record,
                    });
                }
            }
        }
        match partial.tot_len {
            Some(tot_len) if got_now >= XLOG_RECORD_HEADER_LEN && got_now == tot_len as usize => {
                let end = Lsn(self.pos);
                let record = decode_record(start, end, Bytes::from(partial.bytes))?;
                self.prev_record = Some(start);
                self.state = State::Between;
                if record.is_xlog_switch() {
                    let seg = u64::from(self.seg_size.unwrap_or(DEFAULT_SEGMENT_SIZE));
                    let target = self.pos.checked_next_multiple_of(seg).ok_or(WalDecodeError::Malformed {
                        lsn: start,
                        reason: "XLOG_SWITCH at the end of the LSN space".to_owned(),
                    })?;
                    self.state = State::SkipTo { target };
                }
                Ok(Some(record))
            }
            _ => {
                self.state = State::InRecord(partial);
                Ok(None)
            }
        }
    }

    /// Checks the header of the page at the current position and applies its continuation
    /// fields to the state.
    fn on_page_header(&mut self, header: &PageHeader) -> Result<(), WalDecodeError> {
        let at = Lsn(self.pos);
        header.validate(at, self.seg_size)?;
        if let Some(long) = header.long {
            match self.system_id {
                Some(expected) if expected != long.system_id => {
                    return Err(WalDecodeError::SystemId { lsn: at, got: long.system_id, expected });
                }
                _ => self.system_id = Some(long.system_id),
            }
            self.seg_size = Some(long.seg_size);
        }
        let contrec = header.info & XLP_FIRST_IS_CONTRECORD != 0;
        let overwrite = header.info & XLP_FIRST_IS_OVERWRITE_CONTRECORD != 0;
        self.state = match std::mem::replace(&mut self.state, State::Between) {
            State::FirstPage if contrec && !overwrite && header.rem_len > 0 => {
                State::SkipContinuation { remaining: header.rem_len }
            }
            State::FirstPage | State::Between if contrec && !overwrite => {
                return Err(WalDecodeError::UnexpectedContrecord { lsn: at });
            }
            State::FirstPage | State::Between => State::Between,
            // The record being continued was never completed; the writer went on here.
            State::SkipContinuation { .. } | State::InRecord(_) if overwrite => State::Between,
            State::SkipContinuation { remaining } => {
                if !contrec {
                    return Err(WalDecodeError::MissingContrecord { lsn: at, record: at });
                }
                if header.rem_len != remaining {
                    return Err(WalDecodeError::ContrecordLength {
                        lsn: at,
                        record: at,
                        got: header.rem_len,
                        expected: remaining,
                    });
                }
                State::SkipContinuation { remaining }
            }
            State::InRecord(partial) => {
                let record = Lsn(partial.start);
                if !contrec {
                    return Err(WalDecodeError::MissingContrecord { lsn: at, record });
                }
                let got = u32::try_from(partial.bytes.len()).unwrap_or(u32::MAX);
                let Some(expected) = partial.tot_len.map(|t| t.saturating_sub(got)) else {
                    return Err(WalDecodeError::Malformed {
                        lsn: record,
                        reason: "record length cut by a page".to_owned(),
                    });
                };
                if header.rem_len == 0 || header.rem_len != expected {
                    return Err(WalDecodeError::ContrecordLength {
                        lsn: at,
                        record,
                        got: header.rem_len,
                        expected,
                    });
                }
                State::InRecord(partial)
            }
            State::SkipTo { target } => State::SkipTo { target },
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests;
