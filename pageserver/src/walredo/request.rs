//! A request as the child reads it, held in pieces and written with vectored writes: the small
//! parts of its frames (headers, buffer tags, LSNs) and the short records encoded into one
//! buffer, the base page and the long records sent from the `Bytes` they were read into.
//!
//! Why: a redo request is mostly page and record bytes that storage has just read. Encoding it
//! into one contiguous buffer copied all of them once more per redo (CPU on every request) and
//! held that copy, as large as what was read, outside the redo memory budget: a GetPage of
//! 12 MiB of records held 24 MiB. Here only the frames' own bytes (13 per record, a few dozen
//! per request) and records shorter than [`COPY_BELOW`] are copied ([`Request::overhead`]
//! bounds both). Copying the short ones is deliberate: each slice costs the kernel more than
//! copying a few hundred bytes does, and a request of a hundred small records as slices took
//! four `writev` calls and ran 1.2-1.4x slower in bench_walredo `medium/8` than one copy.
//!
//! Invariants:
//! - the bytes given by [`Request::slices`] from the start to the end are exactly the frames of
//!   the encoded form (`B [P] A* G`), byte for byte ([`tests`]);
//! - no I/O here: writers take slices from a [`Cursor`] and advance it by what the pipe took.

use std::io::IoSlice;
use std::ops::Range;

use bytes::Bytes;
use page_types::{BufferTag, Lsn, BUFFER_TAG_LEN, PAGE_SIZE};
use walredo_proc::protocol;

/// Slices handed to one vectored write; a longer request takes several writes (only records of
/// at least [`COPY_BELOW`] bytes take slices of their own, so 32 of them are 32 KiB or more,
/// and the pipe holds 1 MiB).
pub(crate) const SLICES_PER_WRITE: usize = 64;

/// Records shorter than this are copied into the request's own buffer rather than sent as
/// slices of their own (see the module doc).
pub(crate) const COPY_BELOW: usize = 1024;

/// Bytes a request holds beyond its page and records, per record (the `A` frame's header and
/// LSN, and the part that points at the record).
const OVERHEAD_PER_RECORD: usize = protocol::HEADER_LEN + 8 + std::mem::size_of::<Part>();
/// Bytes a request holds beyond its page and records, once (the `B`, `P` and `G` frames' own
/// bytes and the request's bookkeeping).
const OVERHEAD_FIXED: usize = 4 * (protocol::HEADER_LEN + BUFFER_TAG_LEN) + 256;

/// Bytes of the child's reply to a redo request (a page and its header).
pub(crate) const REPLY_BYTES: u64 = (protocol::HEADER_LEN + PAGE_SIZE) as u64;

/// One piece of a request.
#[derive(Debug, Clone)]
enum Part {
    /// A range of [`Request::head`].
    Head(Range<usize>),
    /// Bytes sent as they are (a page, a record).
    Data(Bytes),
}

/// A request to the child, ready to be written; see the module doc.
#[derive(Debug, Clone, Default)]
pub(crate) struct Request {
    /// The frames' own bytes, in order.
    head: Vec<u8>,
    parts: Vec<Part>,
    len: usize,
}

/// A position in a [`Request`]: how much of it a writer has written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Cursor {
    part: usize,
    /// Bytes of `part` already written.
    offset: usize,
    written: usize,
}

impl Cursor {
    /// Bytes written so far.
    pub(crate) fn written(&self) -> usize {
        self.written
    }
}

impl Request {
    /// A request of already encoded frames (a ping, a spin window, tests).
    pub(crate) fn frames(bytes: Vec<u8>) -> Request {
        let mut request = Request::default();
        request.push_head(|out| out.extend_from_slice(&bytes));
        request
    }

    /// The redo request `B [P] A* G` for `tag` from `base` (a page of `PAGE_SIZE` bytes, checked by
    /// the caller) and `records` (each within [`protocol::check_record_len`], checked by the
    /// caller); the page and the records of [`COPY_BELOW`] bytes or more are referenced, not
    /// copied.
    pub(crate) fn redo(tag: &BufferTag, base: Option<&Bytes>, records: &[(Lsn, Bytes)]) -> Request {
        let copied: usize = records.iter().map(|(_, r)| r.len()).filter(|&n| n < COPY_BELOW).sum();
        let long = records.iter().filter(|(_, r)| r.len() >= COPY_BELOW).count();
        let mut request = Request {
            head: Vec::with_capacity(records.len() * (protocol::HEADER_LEN + 8) + copied + OVERHEAD_FIXED),
            parts: Vec::with_capacity(2 * long + 4),
            len: 0,
        };
        request.push_head(|out| protocol::encode_begin(out, tag));
        if let Some(page) = base {
            request.push_head(|out| protocol::encode_push_page_head(out, tag));
            request.push_data(page.clone());
        }
        // The wire form of an LSN is its integer (the protocol's one conversion).
        for &(Lsn(lsn), ref record) in records {
            if record.len() < COPY_BELOW {
                request.push_head(|out| protocol::encode_apply_raw(out, lsn, record));
            } else {
                request.push_head(|out| protocol::encode_apply_head(out, lsn, record.len()));
                request.push_data(record.clone());
            }
        }
        request.push_head(|out| protocol::encode_get_page(out, tag));
        request
    }

    /// Bytes a redo request of `records` records of `bytes` bytes in all holds beyond its page
    /// and records (for the redo memory budget): the frames, and at most `bytes` of short
    /// records copied; its reply is [`REPLY_BYTES`] more.
    pub(crate) fn overhead(records: usize, bytes: u64) -> u64 {
        let copied = bytes.min((records * COPY_BELOW) as u64);
        (records * OVERHEAD_PER_RECORD + OVERHEAD_FIXED) as u64 + copied
    }

    /// Length of the request on the wire.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Fills `out` with the request's unwritten bytes from `at` on, as many slices as fit;
    /// returns how many it filled (0 once all is written).
    pub(crate) fn slices<'a>(&'a self, at: &Cursor, out: &mut [IoSlice<'a>]) -> usize {
        let mut filled = 0;
        let mut offset = at.offset;
        for part in self.parts.iter().skip(at.part) {
            if filled == out.len() {
                break;
            }
            let bytes = self.bytes_of(part);
            out[filled] = IoSlice::new(&bytes[offset..]);
            offset = 0;
            filled += 1;
        }
        filled
    }

    /// Moves `at` past `n` more bytes written.
    pub(crate) fn advance(&self, at: &mut Cursor, mut n: usize) {
        at.written += n;
        while n > 0 {
            let Some(part) = self.parts.get(at.part) else {
                debug_assert!(false, "advanced past the end of the request");
                return;
            };
            let left = self.bytes_of(part).len() - at.offset;
            if n < left {
                at.offset += n;
                return;
            }
            n -= left;
            at.part += 1;
            at.offset = 0;
        }
    }

    fn bytes_of<'a>(&'a self, part: &'a Part) -> &'a [u8] {
        match part {
            Part::Head(range) => &self.head[range.clone()],
            Part::Data(bytes) => bytes,
        }
    }

    /// Appends frame bytes written by `encode`, into the last part if it is of the head too.
    fn push_head(&mut self, encode: impl FnOnce(&mut Vec<u8>)) {
        let start = self.head.len();
        encode(&mut self.head);
        let end = self.head.len();
        self.len += end - start;
        match self.parts.last_mut() {
            Some(Part::Head(range)) if range.end == start => range.end = end,
            _ => self.parts.push(Part::Head(start..end)),
        }
    }

    fn push_data(&mut self, bytes: Bytes) {
        if !bytes.is_empty() {
            self.len += bytes.len();
            self.parts.push(Part::Data(bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tag() -> BufferTag {
        BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum: 7 }
    }

    /// The encoded form, made the old way: one buffer.
    fn contiguous(base: Option<&Bytes>, records: &[(Lsn, Bytes)]) -> Vec<u8> {
        let mut out = Vec::new();
        protocol::encode_begin(&mut out, &tag());
        if let Some(page) = base {
            let page: &walredo_proc::page::Page = page.as_ref().try_into().expect("a page");
            protocol::encode_push_page(&mut out, &tag(), page);
        }
        for (lsn, record) in records {
            protocol::encode_apply_raw(&mut out, lsn.0, record);
        }
        protocol::encode_get_page(&mut out, &tag());
        out
    }

    /// Writes `request` through slices of at most `per_write` slices and `max_bytes` bytes a
    /// write, as a pipe taking part of each write would.
    fn write_all(request: &Request, per_write: usize, max_bytes: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut at = Cursor::default();
        let mut slices = vec![IoSlice::new(&[]); per_write];
        loop {
            let n = request.slices(&at, &mut slices);
            if n == 0 {
                break;
            }
            let mut taken = 0;
            for slice in &slices[..n] {
                let take = slice.len().min(max_bytes - taken);
                out.extend_from_slice(&slice[..take]);
                taken += take;
                if taken == max_bytes {
                    break;
                }
            }
            request.advance(&mut at, taken);
            assert_eq!(at.written(), out.len());
        }
        out
    }

    #[test]
    fn a_request_written_in_any_pieces_is_its_encoded_frames() {
        let page = Bytes::from(vec![7u8; PAGE_SIZE]);
        // Short ones (copied) and long ones (sent from where they are), mixed.
        let records: Vec<(Lsn, Bytes)> = (1..=40u64)
            .map(|i| (Lsn(i * 16), Bytes::from(vec![i as u8; 1 + (i as usize * 397) % 9000])))
            .collect();
        for base in [None, Some(&page)] {
            for count in [0, 1, 2, 40] {
                let request = Request::redo(&tag(), base, &records[..count]);
                let expected = contiguous(base, &records[..count]);
                assert_eq!(request.len(), expected.len());
                for (per_write, max_bytes) in [(64, usize::MAX), (1, 1), (3, 100), (2, 8200), (64, 4096)] {
                    assert!(
                        write_all(&request, per_write, max_bytes) == expected,
                        "{count} records, {per_write} slices of at most {max_bytes} bytes a write"
                    );
                }
            }
        }
    }

    #[test]
    fn a_redo_request_copies_no_page_or_long_record_bytes() {
        let page = Bytes::from(vec![1u8; PAGE_SIZE]);
        let mut records: Vec<(Lsn, Bytes)> =
            (1..=3u64).map(|i| (Lsn(i), Bytes::from(vec![2u8; 5000]))).collect();
        records.extend((4..=100u64).map(|i| (Lsn(i), Bytes::from(vec![3u8; 100]))));
        let bytes: u64 = records.iter().map(|(_, r)| r.len() as u64).sum();
        let request = Request::redo(&tag(), Some(&page), &records);
        assert!(request.head.len() as u64 <= Request::overhead(records.len(), bytes));
        let mut slices = [IoSlice::new(&[]); SLICES_PER_WRITE];
        let n = request.slices(&Cursor::default(), &mut slices);
        let pointers: Vec<*const u8> = slices[..n].iter().map(|s| s.as_ptr()).collect();
        assert!(pointers.contains(&page.as_ptr()), "the page is sent from where it was read");
        for (_, record) in &records[..3] {
            assert!(pointers.contains(&record.as_ptr()), "a long record is sent from where it was read");
        }
        // The 97 short records ride in the head: one slice between two long parts at most.
        assert!(n <= 2 * 4 + 1, "{n} slices");
    }
}
