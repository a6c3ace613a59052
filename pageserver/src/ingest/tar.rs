//! An incremental reader of the tar archives of a PostgreSQL 15 base backup: fed bytes in any
//! chunking ([`TarReader::feed`]), it yields [`TarEvent`]s ([`TarReader::next`]): a regular
//! file's header, its data in pieces, its end; anything else (directories, symlinks, other
//! entry types) as [`TarEvent::Other`] with its path.
//!
//! What PostgreSQL writes (`src/port/tar.c`, `tarCreateHeader`): POSIX ustar headers of 512
//! bytes (magic `ustar\0`, version `00`), names of at most 99 bytes in the name field (longer
//! ones are refused by the server, so no prefix and no GNU long names from PostgreSQL), octal
//! numbers, and base-256 (the high bit of the first byte) for a size of 8 GiB or more; data
//! padded with zeros to 512; and since PostgreSQL 15 the two zero blocks that end an archive.
//! This reader takes more than that, so that other writers' archives read too: the ustar
//! `prefix` field, GNU long names (type `L`; `K`, the long link name, is read and dropped) and
//! pax headers (types `x`, `g`: skipped, their `path` is not applied).
//!
//! Invariants: nothing here panics on any input; every header's checksum is verified; the
//! reader holds only bytes it was fed and not yet returned (a long name is at most
//! [`MAX_LONG_NAME`]); any chunking of the same bytes gives the same events; once it fails, it
//! fails again on every call. It does no I/O.

use bytes::{Bytes, BytesMut};

/// Size of a tar block (headers, padding).
pub const BLOCK: usize = 512;
/// Longest GNU long name accepted.
pub const MAX_LONG_NAME: u64 = 4096;

/// What the archive holds, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TarEvent {
    /// A regular file starts: its path in the archive and its size.
    File { path: String, size: u64 },
    /// The next bytes of the current file (never empty).
    Data(Bytes),
    /// The current file's data is complete.
    FileEnd,
    /// An entry that is not a regular file (directory, symlink, device, ...): its path.
    Other(String),
}

/// A malformed archive. `offset` is the archive byte where the bad block starts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TarError {
    #[error("tar header at byte {offset}: checksum {stored:?} does not match {computed}")]
    Checksum { offset: u64, stored: String, computed: u32 },
    #[error("tar header at byte {offset}: bad {field} field")]
    BadField { offset: u64, field: &'static str },
    #[error("tar entry at byte {offset}: long name of {size} bytes (at most {MAX_LONG_NAME})")]
    LongName { offset: u64, size: u64 },
    #[error("tar archive cut off at byte {offset} ({what})")]
    Truncated { offset: u64, what: &'static str },
    #[error("tar archive: {len} bytes after its end at byte {offset}")]
    AfterEnd { offset: u64, len: usize },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Waiting for a header block.
    Header,
    /// Inside a regular file: data bytes left, then padding.
    FileData { remaining: u64, padding: usize },
    /// A file's data is all out: `FileEnd` is due, then its padding.
    FileEndDue { padding: usize },
    /// Skipping an entry's data (pax headers, data of non-file entries) and its padding.
    Skip { remaining: u64 },
    /// Reading a GNU long name (`L`) or long link name (`K`) of `size` bytes.
    LongName { size: u64, link: bool },
    /// One zero block seen; a second one ends the archive.
    OneZero,
    /// Both zero blocks seen.
    End,
}

/// The reader. Call [`TarReader::next`] until it returns `Ok(None)` before feeding more, so
/// that it holds at most one chunk and a block.
#[derive(Debug)]
pub struct TarReader {
    buf: BytesMut,
    state: State,
    /// Archive bytes consumed so far.
    offset: u64,
    /// A GNU long name that applies to the next header.
    long_name: Option<String>,
    failed: Option<TarError>,
}

impl Default for TarReader {
    fn default() -> Self {
        Self::new()
    }
}

impl TarReader {
    pub fn new() -> TarReader {
        TarReader { buf: BytesMut::new(), state: State::Header, offset: 0, long_name: None, failed: None }
    }

    /// Adds archive bytes.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Archive bytes consumed so far.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Whether the two zero blocks that end an archive were read.
    pub fn is_done(&self) -> bool {
        self.state == State::End
    }

    /// The next event, `Ok(None)` when more bytes are needed (or the archive ended).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Result<Option<TarEvent>, TarError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.step();
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    /// The input is complete: an error unless the archive ended properly.
    pub fn finish(&mut self) -> Result<(), TarError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let what = match self.state {
            State::End if self.buf.is_empty() => return Ok(()),
            State::End => {
                let e = TarError::AfterEnd { offset: self.offset, len: self.buf.len() };
                self.failed = Some(e.clone());
                return Err(e);
            }
            State::Header => "before the end-of-archive blocks",
            State::OneZero => "after one end-of-archive block",
            State::FileData { .. } | State::FileEndDue { .. } => "in a file",
            State::Skip { .. } | State::LongName { .. } => "in an entry",
        };
        let e = TarError::Truncated { offset: self.offset, what };
        self.failed = Some(e.clone());
        Err(e)
    }

    fn consume(&mut self, n: usize) -> Bytes {
        self.offset += n as u64;
        self.buf.split_to(n).freeze()
    }

    fn step(&mut self) -> Result<Option<TarEvent>, TarError> {
        loop {
            match self.state {
                State::End => {
                    // Zeros past the end are tolerated (writers pad to a record size);
                    // anything else is an error.
                    if let Some(pos) = self.buf.iter().position(|b| *b != 0) {
                        return Err(TarError::AfterEnd {
                            offset: self.offset + pos as u64,
                            len: self.buf.len() - pos,
                        });
                    }
                    let n = self.buf.len();
                    self.consume(n);
                    return Ok(None);
                }
                State::FileData { remaining, padding } => {
                    if remaining == 0 {
                        self.state = State::FileEndDue { padding };
                        continue;
                    }
                    if self.buf.is_empty() {
                        return Ok(None);
                    }
                    let n = usize::try_from(remaining).unwrap_or(usize::MAX).min(self.buf.len());
                    let data = self.consume(n);
                    self.state = State::FileData { remaining: remaining - n as u64, padding };
                    return Ok(Some(TarEvent::Data(data)));
                }
                State::FileEndDue { padding } => {
                    self.state = State::Skip { remaining: padding as u64 };
                    return Ok(Some(TarEvent::FileEnd));
                }
                State::Skip { remaining } => {
                    if remaining == 0 {
                        self.state = State::Header;
                        continue;
                    }
                    if self.buf.is_empty() {
                        return Ok(None);
                    }
                    let n = usize::try_from(remaining).unwrap_or(usize::MAX).min(self.buf.len());
                    self.consume(n);
                    self.state = State::Skip { remaining: remaining - n as u64 };
                }
                State::LongName { size, link } => {
                    let padded = padded(size);
                    let Ok(need) = usize::try_from(padded) else {
                        return Err(TarError::LongName { offset: self.offset, size });
                    };
                    if self.buf.len() < need {
                        return Ok(None);
                    }
                    let bytes = self.consume(need);
                    let name = bytes.get(..size as usize).unwrap_or_default();
                    let name = cstr_field(name);
                    if !link {
                        self.long_name = Some(name);
                    }
                    self.state = State::Header;
                }
                State::Header | State::OneZero => {
                    if self.buf.len() < BLOCK {
                        return Ok(None);
                    }
                    let offset = self.offset;
                    let block = self.consume(BLOCK);
                    if block.iter().all(|b| *b == 0) {
                        if self.long_name.is_some() {
                            return Err(TarError::BadField { offset, field: "entry after a long name" });
                        }
                        self.state = if self.state == State::OneZero { State::End } else { State::OneZero };
                        continue;
                    }
                    if self.state == State::OneZero {
                        return Err(TarError::BadField { offset, field: "second end-of-archive block" });
                    }
                    if let Some(event) = self.header(offset, &block)? {
                        return Ok(Some(event));
                    }
                }
            }
        }
    }

    /// Reads a header block: the event it starts, if any, and the next state.
    fn header(&mut self, offset: u64, h: &[u8]) -> Result<Option<TarEvent>, TarError> {
        let field = |start: usize, len: usize| h.get(start..start + len).unwrap_or_default();
        verify_checksum(offset, h)?;
        let size = parse_number(field(124, 12)).ok_or(TarError::BadField { offset, field: "size" })?;
        let typeflag = field(156, 1).first().copied().unwrap_or(0);
        let ustar = field(257, 5) == b"ustar";
        match typeflag {
            b'L' | b'K' => {
                if size > MAX_LONG_NAME {
                    return Err(TarError::LongName { offset, size });
                }
                self.state = State::LongName { size, link: typeflag == b'K' };
                return Ok(None);
            }
            b'x' | b'g' => {
                self.state = State::Skip { remaining: padded(size) };
                return Ok(None);
            }
            _ => {}
        }
        let path = match self.long_name.take() {
            Some(long) => long,
            None => {
                let name = cstr_field(field(0, 100));
                let prefix = if ustar { cstr_field(field(345, 155)) } else { String::new() };
                if prefix.is_empty() {
                    name
                } else {
                    format!("{prefix}/{name}")
                }
            }
        };
        if path.is_empty() {
            return Err(TarError::BadField { offset, field: "name" });
        }
        match typeflag {
            b'0' | 0 | b'7' => {
                let padding = (padded(size) - size) as usize;
                self.state = State::FileData { remaining: size, padding };
                Ok(Some(TarEvent::File { path, size }))
            }
            // Hard links, symlinks, devices, directories, FIFOs carry no data; skip what an
            // odd writer put there anyway.
            _ => {
                self.state = State::Skip { remaining: padded(size) };
                Ok(Some(TarEvent::Other(path)))
            }
        }
    }
}

/// `size` rounded up to whole blocks (saturating: such a size fails later as truncated).
fn padded(size: u64) -> u64 {
    size.div_ceil(BLOCK as u64).saturating_mul(BLOCK as u64)
}

/// A NUL-terminated (or full-width) text field.
fn cstr_field(f: &[u8]) -> String {
    let end = f.iter().position(|b| *b == 0).unwrap_or(f.len());
    String::from_utf8_lossy(f.get(..end).unwrap_or_default()).into_owned()
}

/// An octal number (spaces and NULs around it), or base-256 when the high bit of the first
/// byte is set (GNU; PostgreSQL's `print_tar_number` for values of 8^11 and more).
fn parse_number(f: &[u8]) -> Option<u64> {
    let first = *f.first()?;
    if first & 0x80 != 0 {
        if first & 0x40 != 0 {
            return None; // negative
        }
        let mut v: u64 = u64::from(first & 0x3F);
        for b in f.get(1..)? {
            v = v.checked_mul(256)?.checked_add(u64::from(*b))?;
        }
        return Some(v);
    }
    let text = f.iter().skip_while(|b| **b == b' ').take_while(|b| **b != 0 && **b != b' ');
    // An empty field is zero (some writers leave it so).
    let mut v: u64 = 0;
    for b in text {
        if !(b'0'..=b'7').contains(b) {
            return None;
        }
        v = v.checked_mul(8)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(v)
}

fn verify_checksum(offset: u64, h: &[u8]) -> Result<(), TarError> {
    let stored_field = h.get(148..156).unwrap_or_default();
    let computed: u32 = h
        .iter()
        .enumerate()
        .map(|(i, b)| if (148..156).contains(&i) { u32::from(b' ') } else { u32::from(*b) })
        .sum();
    let stored = parse_number(stored_field);
    if stored != Some(u64::from(computed)) {
        return Err(TarError::Checksum {
            offset,
            stored: String::from_utf8_lossy(stored_field).into_owned(),
            computed,
        });
    }
    Ok(())
}

/// A ustar writer for tests: the archives PostgreSQL writes, and the extensions read here.
#[cfg(test)]
pub(crate) mod testtar {
    use super::BLOCK;

    pub fn header(name: &str, typeflag: u8, size: u64, prefix: &str) -> Vec<u8> {
        let mut h = vec![0u8; BLOCK];
        h[..name.len().min(100)].copy_from_slice(&name.as_bytes()[..name.len().min(100)]);
        h[100..108].copy_from_slice(b"0000600\0");
        h[108..116].copy_from_slice(b"0000000\0");
        h[116..124].copy_from_slice(b"0000000\0");
        if size >= 8u64.pow(11) {
            h[124] = 0x80;
            h[128..136].copy_from_slice(&size.to_be_bytes());
        } else {
            h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
        }
        h[136..148].copy_from_slice(b"00000000000\0");
        h[156] = typeflag;
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|b| u32::from(*b)).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        h
    }

    /// Appends a regular file.
    pub fn file(out: &mut Vec<u8>, name: &str, data: &[u8]) {
        if name.len() > 100 {
            out.extend(header("././@LongLink", b'L', name.len() as u64 + 1, ""));
            out.extend(name.as_bytes());
            out.push(0);
            pad(out);
        }
        out.extend(header(name, b'0', data.len() as u64, ""));
        out.extend(data);
        pad(out);
    }

    pub fn pad(out: &mut Vec<u8>) {
        while out.len() % BLOCK != 0 {
            out.push(0);
        }
    }

    pub fn end(out: &mut Vec<u8>) {
        out.extend([0u8; 2 * BLOCK]);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::testtar::*;
    use super::*;
    use proptest::prelude::*;

    /// The events of `bytes` fed in chunks cut at `cuts`, with data merged per file.
    fn read_all(bytes: &[u8], cuts: &[usize]) -> Result<Vec<TarEvent>, TarError> {
        let mut r = TarReader::new();
        let mut events: Vec<TarEvent> = Vec::new();
        let mut at = 0;
        let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        cuts.push(bytes.len());
        for cut in cuts {
            r.feed(&bytes[at..cut.max(at)]);
            at = cut.max(at);
            while let Some(e) = r.next()? {
                match (events.last_mut(), e) {
                    (Some(TarEvent::Data(prev)), TarEvent::Data(d)) => {
                        let mut m = BytesMut::from(&prev[..]);
                        m.extend_from_slice(&d);
                        *prev = m.freeze();
                    }
                    (_, TarEvent::Data(d)) if d.is_empty() => panic!("empty data event"),
                    (_, e) => events.push(e),
                }
            }
        }
        r.finish()?;
        Ok(events)
    }

    fn sample() -> (Vec<u8>, Vec<TarEvent>) {
        let mut t = Vec::new();
        let long = format!("base/1/{}", "x".repeat(150));
        t.extend(header("base/", b'5', 0, ""));
        file(&mut t, "base/1/16384", &[7u8; 8192 * 2]);
        file(&mut t, "PG_VERSION", b"15\n");
        file(&mut t, "empty", b"");
        t.extend(header("pg_tblspc/16385", b'2', 0, ""));
        t.extend(header("16384_vm", b'0', 3, "base/5"));
        t.extend(b"abc");
        pad(&mut t);
        file(&mut t, &long, &[1, 2, 3, 4, 5]);
        end(&mut t);
        let want = vec![
            TarEvent::Other("base/".into()),
            TarEvent::File { path: "base/1/16384".into(), size: 16384 },
            TarEvent::Data(Bytes::from(vec![7u8; 16384])),
            TarEvent::FileEnd,
            TarEvent::File { path: "PG_VERSION".into(), size: 3 },
            TarEvent::Data(Bytes::from_static(b"15\n")),
            TarEvent::FileEnd,
            TarEvent::File { path: "empty".into(), size: 0 },
            TarEvent::FileEnd,
            TarEvent::Other("pg_tblspc/16385".into()),
            TarEvent::File { path: "base/5/16384_vm".into(), size: 3 },
            TarEvent::Data(Bytes::from_static(b"abc")),
            TarEvent::FileEnd,
            TarEvent::File { path: long, size: 5 },
            TarEvent::Data(Bytes::from_static(&[1, 2, 3, 4, 5])),
            TarEvent::FileEnd,
        ];
        (t, want)
    }

    #[test]
    fn archive_in_one_piece_yields_files_others_prefix_and_long_names() {
        let (t, want) = sample();
        assert_eq!(read_all(&t, &[]).unwrap(), want);
    }

    #[test]
    fn header_with_base256_size_reads_its_size() {
        let h = header("big", b'0', 9 << 30, "");
        let mut r = TarReader::new();
        r.feed(&h);
        assert_eq!(r.next().unwrap(), Some(TarEvent::File { path: "big".into(), size: 9 << 30 }));
    }

    #[test]
    fn flipped_header_byte_fails_checksum_and_stays_failed() {
        let (mut t, _) = sample();
        t[0] ^= 1;
        let mut r = TarReader::new();
        r.feed(&t);
        assert!(matches!(r.next(), Err(TarError::Checksum { offset: 0, .. })));
        assert!(matches!(r.next(), Err(TarError::Checksum { .. })));
        assert!(r.finish().is_err());
    }

    #[test]
    fn archive_without_end_blocks_is_truncated() {
        let (t, _) = sample();
        assert!(matches!(read_all(&t[..t.len() - 1024], &[]), Err(TarError::Truncated { .. })));
        assert!(matches!(read_all(&t[..t.len() - 512], &[]), Err(TarError::Truncated { .. })));
        assert!(matches!(read_all(&t[..700], &[]), Err(TarError::Truncated { .. })));
    }

    #[test]
    fn bytes_after_the_end_are_an_error_but_zeros_are_not() {
        let (mut t, want) = sample();
        t.extend([0u8; 1024]);
        assert_eq!(read_all(&t, &[]).unwrap(), want);
        t.push(1);
        assert!(matches!(read_all(&t, &[]), Err(TarError::AfterEnd { .. })));
    }

    proptest! {
        #[test]
        fn any_chunking_yields_the_same_events(cuts in proptest::collection::vec(0usize..40_000, 0..20)) {
            let (t, want) = sample();
            prop_assert_eq!(read_all(&t, &cuts).unwrap(), want);
        }

        #[test]
        fn garbled_or_cut_archives_never_panic(
            flips in proptest::collection::vec((0usize..40_000, any::<u8>()), 0..8),
            len in 0usize..40_000,
            cuts in proptest::collection::vec(0usize..40_000, 0..8),
        ) {
            let (mut t, _) = sample();
            for (at, v) in flips {
                let n = t.len();
                t[at % n] = v;
            }
            t.truncate(len);
            let _ = read_all(&t, &cuts);
        }
    }
}
