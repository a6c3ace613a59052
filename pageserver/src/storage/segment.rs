//! The active segment: the one append-only file (`active.seg`) that ingested batches go to.
//!
//! A batch is written as one self-checking frame (a crc32c over the frame header and body), so
//! that after a crash the recovery scan can tell a complete batch from a torn one and a batch is
//! all-or-nothing. This module encodes frames, appends them, and scans a segment back.
//!
//! **Invariants:** bytes are only ever appended at [`ActiveSegment::len`], the end of the last
//! complete frame; nothing here calls fsync (the committer does, once per group, and counts it);
//! the scan never skips over a bad frame: everything from the first bad frame on is a torn tail.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use anyhow::{ensure, Context};
use page_types::{BufferTag, Lsn};

use super::crc;
use super::format::{self, put_key, Cursor, IndexEntry, Kind, FILE_HEADER_LEN, KEY_LEN};
use super::{StorageMetrics, Value};

/// File name of the active segment inside a timeline directory.
pub(crate) const ACTIVE_NAME: &str = "active.seg";
/// First 4 bytes of a batch frame ("BTCH" read as little-endian bytes).
pub(crate) const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"BTCH");
/// `magic u32 | body_len u32 | value_count u32 | crc32c u32`.
pub(crate) const FRAME_HEADER_LEN: usize = 16;
/// Per value inside a frame body: key, lsn u64, kind u8, len u32, value crc32c u32.
pub(crate) const VALUE_HEADER_LEN: usize = KEY_LEN + 8 + 1 + 4 + 4;
/// Largest frame body; bigger batches are rejected at ingest, bigger lengths on disk are torn.
pub(crate) const MAX_FRAME_BODY: usize = 64 << 20;

/// Encoded frame size of a batch (header + body), used for validation and queue budgeting.
pub(crate) fn frame_len(values: &[(BufferTag, Lsn, Value)]) -> usize {
    FRAME_HEADER_LEN + values.iter().map(|(_, _, v)| VALUE_HEADER_LEN + v.bytes().len()).sum::<usize>()
}

/// One batch encoded as a frame, ready to append: made by the task that submits the batch
/// ([`super::Timeline::submit`]), so that the committer, the one thread a timeline's ingest
/// funnels through, only writes it, syncs it and indexes it.
pub(crate) struct EncodedFrame {
    /// Header and body.
    pub bytes: Vec<u8>,
    /// The crc32c of `bytes` (what the file's checksum takes in).
    pub crc: u32,
    /// The index entries of its values, with offsets from the frame's start.
    pub entries: Vec<IndexEntry>,
    /// The bytes of its [`format::is_copied`] records, back to back in entry order (what the
    /// index keeps of them while the segment is active); empty if they pass
    /// [`format::COPIES_MAX`].
    pub copies: bytes::Bytes,
    /// Its values' bytes (no framing).
    pub value_bytes: u64,
}

impl EncodedFrame {
    /// Encodes a batch. The value bytes are read twice (each value's checksum, then the
    /// body's); the frame's and the file's checksums are made from the body's.
    /// The batch must have been validated: its length fits [`MAX_FRAME_BODY`].
    pub(crate) fn encode(values: &[(BufferTag, Lsn, Value)]) -> EncodedFrame {
        let mut out = Vec::with_capacity(frame_len(values));
        let mut entries = Vec::with_capacity(values.len());
        out.extend_from_slice(&[0u8; FRAME_HEADER_LEN]);
        let (mut value_bytes, mut copied) = (0u64, 0u64);
        for (key, lsn, value) in values {
            let bytes = value.bytes();
            let crc = crc32c::crc32c(bytes);
            put_key(&mut out, key);
            out.extend_from_slice(&lsn.0.to_le_bytes());
            out.push(value.kind().to_byte());
            out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(&crc.to_le_bytes());
            let entry = IndexEntry {
                key: *key,
                lsn: *lsn,
                kind: value.kind(),
                offset: out.len() as u64,
                len: bytes.len() as u32,
                crc,
            };
            if format::is_copied(&entry) {
                copied += bytes.len() as u64;
            }
            entries.push(entry);
            value_bytes += bytes.len() as u64;
            out.extend_from_slice(bytes);
        }
        let body_len = (out.len() - FRAME_HEADER_LEN) as u32;
        out[0..4].copy_from_slice(&BATCH_MAGIC.to_le_bytes());
        out[4..8].copy_from_slice(&body_len.to_le_bytes());
        out[8..12].copy_from_slice(&(values.len() as u32).to_le_bytes());
        let body_crc = crc32c::crc32c(&out[FRAME_HEADER_LEN..]);
        let head_crc = crc32c::crc32c(&out[..12]);
        let frame_crc = crc::combine(head_crc, body_crc, body_len as usize);
        out[12..16].copy_from_slice(&frame_crc.to_le_bytes());
        let header_crc = crc32c::crc32c_append(head_crc, &out[12..FRAME_HEADER_LEN]);
        let crc = crc::combine(header_crc, body_crc, body_len as usize);
        let copies = match copied {
            0 => bytes::Bytes::new(),
            n if n > format::COPIES_MAX => bytes::Bytes::new(),
            n => {
                let mut copies = Vec::with_capacity(n as usize);
                for e in entries.iter().filter(|e| format::is_copied(e)) {
                    copies.extend_from_slice(&out[e.offset as usize..e.offset as usize + e.len as usize]);
                }
                bytes::Bytes::from(copies)
            }
        };
        EncodedFrame { bytes: out, crc, entries, copies, value_bytes }
    }
}

/// The active segment as the committer sees it.
pub(crate) struct ActiveSegment {
    pub file: Arc<File>,
    /// Id of this file in the in-memory index; it survives sealing (same inode).
    pub file_id: u32,
    /// End of the last complete frame: where the next frame goes.
    pub len: u64,
    /// Entries of every value in this segment, in append order (becomes the layer index).
    pub entries: Vec<IndexEntry>,
    /// The crc32c of the file's first `len` bytes (a seal appends its index to it).
    pub crc: u32,
}

impl ActiveSegment {
    /// Creates a fresh `active.seg` holding only the file header, durably (file and directory).
    /// An existing file of that name is replaced: callers only do this when there is none or it
    /// holds a torn header and nothing else.
    pub(crate) fn create(
        dir: &Path,
        dir_file: &File,
        file_id: u32,
        metrics: &StorageMetrics,
    ) -> anyhow::Result<Self> {
        let path = dir.join(ACTIVE_NAME);
        let file =
            open_data_file(OpenOptions::new().read(true).write(true).create(true).truncate(true), &path)
                .context("create active segment")?;
        let header = format::file_header();
        file.write_all_at(&header, 0).context("write active segment header")?;
        metrics.fsync(|| file.sync_all()).context("fsync new active segment")?;
        metrics.fsync(|| dir_file.sync_all()).context("fsync timeline directory")?;
        let crc = crc32c::crc32c(&header);
        Ok(ActiveSegment { file: Arc::new(file), file_id, len: FILE_HEADER_LEN, entries: Vec::new(), crc })
    }

    /// First and last LSN stored in this segment, if it holds anything.
    pub(crate) fn lsn_range(&self) -> Option<(Lsn, Lsn)> {
        Some((self.entries.first()?.lsn, self.entries.last()?.lsn))
    }

    /// Appends one encoded frame at the end (not fsync'd). Returns the index of its first entry
    /// in [`ActiveSegment::entries`]. On error the segment must not be appended to again: the
    /// file may hold a partial frame past `len`.
    pub(crate) fn append(&mut self, frame: &EncodedFrame) -> anyhow::Result<usize> {
        let first_entry = self.entries.len();
        self.file.write_all_at(&frame.bytes, self.len).context("write batch frame")?;
        let at = self.len;
        self.entries.extend(frame.entries.iter().map(|e| IndexEntry { offset: at + e.offset, ..*e }));
        self.len += frame.bytes.len() as u64;
        self.crc = crc::combine(self.crc, frame.crc, frame.bytes.len());
        Ok(first_entry)
    }
}

/// What a scan of a segment found.
#[derive(Debug)]
pub(crate) struct Scan {
    /// Entries of all complete, valid frames, in file order.
    pub entries: Vec<IndexEntry>,
    /// End of the last valid frame.
    pub valid_len: u64,
    /// Why the scan stopped before the end of the file, if it did.
    pub torn: Option<String>,
    /// The crc32c of the file's first `valid_len` bytes.
    pub crc: u32,
    /// With `copies` asked: the bytes of the records the active segment keeps copies of
    /// ([`format::is_copied`]) that fit in [`format::COPIES_MAX`] bytes, taken in entry order
    /// while they fit, back to back (what [`super::Index::insert_active`] takes with the
    /// entries).
    pub copies: Vec<u8>,
}

/// Scans the frames of a segment whose header has been checked, from [`FILE_HEADER_LEN`] to
/// `file_len`. A frame that is incomplete or fails its checksum ends the scan (a torn tail). A
/// frame that passes its checksum but makes no sense (LSNs going backwards, bad kind or length)
/// is an error: it is not a torn write, and cutting it could lose acknowledged data. With
/// `copies`, it keeps the bytes of the small records ([`Scan::copies`]).
pub(crate) fn scan(file: &File, file_len: u64, mut last_lsn: Lsn, copies: bool) -> anyhow::Result<Scan> {
    let mut entries = Vec::new();
    let mut copied = Vec::new();
    let mut pos = FILE_HEADER_LEN;
    let mut file_header = [0u8; FILE_HEADER_LEN as usize];
    read_at(file, &mut file_header, 0).context("read file header")?;
    let mut file_crc = crc32c::crc32c(&file_header);
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut body = Vec::new();
    let torn = loop {
        if pos == file_len {
            break None;
        }
        if file_len - pos < FRAME_HEADER_LEN as u64 {
            break Some(format!("{} trailing bytes, less than a frame header", file_len - pos));
        }
        read_at(file, &mut header, pos).context("read frame header")?;
        let mut c = Cursor::new(&header);
        let (magic, body_len, count, crc) = (c.u32()?, c.u32()?, c.u32()?, c.u32()?);
        if magic != BATCH_MAGIC {
            break Some(format!("bad frame magic {magic:#010x}"));
        }
        let body_len = body_len as usize;
        let body_start = pos + FRAME_HEADER_LEN as u64;
        if body_len > MAX_FRAME_BODY || body_start + body_len as u64 > file_len {
            break Some(format!("frame body of {body_len} bytes runs past the end"));
        }
        body.resize(body_len, 0);
        read_at(file, &mut body, body_start).context("read frame body")?;
        if crc32c::crc32c_append(crc32c::crc32c(&header[..12]), &body) != crc {
            break Some("frame checksum mismatch".to_string());
        }
        let first = entries.len();
        parse_body(&body, count, body_start, &mut entries)
            .with_context(|| format!("checksummed frame at offset {pos} is invalid"))?;
        let batch = &entries[first..];
        // Each record while it fits, as `Index::insert_active` assigns them: one that does not
        // fit is skipped, and the next smaller one is still taken.
        for e in batch.iter().filter(|e| copies && format::is_copied(e)) {
            if (copied.len() + e.len as usize) as u64 <= format::COPIES_MAX {
                let at = (e.offset - body_start) as usize;
                copied.extend_from_slice(&body[at..at + e.len as usize]);
            }
        }
        ensure!(
            batch[0].lsn > last_lsn,
            "frame at offset {pos} starts at lsn {} after lsn {last_lsn}",
            batch[0].lsn
        );
        ensure!(batch.windows(2).all(|w| w[0].lsn <= w[1].lsn), "frame at offset {pos} has decreasing lsns");
        last_lsn = batch[batch.len() - 1].lsn;
        pos = body_start + body_len as u64;
        file_crc = crc32c::crc32c_append(crc32c::crc32c_append(file_crc, &header), &body);
    };
    Ok(Scan { entries, valid_len: pos, torn, crc: file_crc, copies: copied })
}

/// Decodes `count` values of a checksummed frame body that starts at file offset `body_start`.
fn parse_body(body: &[u8], count: u32, body_start: u64, entries: &mut Vec<IndexEntry>) -> anyhow::Result<()> {
    ensure!(count > 0, "empty frame");
    let mut c = Cursor::new(body);
    for _ in 0..count {
        let key = c.key()?;
        let lsn = c.lsn()?;
        let kind = Kind::from_byte(c.u8()?)?;
        let len = c.u32()?;
        let crc = c.u32()?;
        kind.check_len(&key, len as usize)?;
        let offset = body_start + c.pos() as u64;
        let bytes = c.bytes(len as usize)?;
        ensure!(crc32c::crc32c(bytes) == crc, "value checksum mismatch at {offset}");
        entries.push(IndexEntry { key, lsn, kind, offset, len, crc });
    }
    ensure!(c.pos() == body.len(), "{} stray bytes after the values", body.len() - c.pos());
    Ok(())
}

/// Opens a file that GetPage reads values from (an active segment, a layer) as `options` says,
/// and so that reading it never looks at its access time (`O_NOATIME`): a GetPage that is not a
/// cache hit reads each of its values with a `pread` of its own, and the kernel otherwise checks
/// at every read whether the atime is due for an update (1.8% of the daemon's CPU in a profile of
/// redo GetPage at 64 x 8). The flag is for the file's owner (the daemon, for the files it
/// wrote) or a process with `CAP_FOWNER`; where it is refused (`EPERM`: another user's file),
/// the file is opened without it.
pub(crate) fn open_data_file(options: &OpenOptions, path: &Path) -> std::io::Result<File> {
    let mut noatime = options.clone();
    noatime.custom_flags(libc::O_NOATIME);
    match noatime.open(path) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => options.open(path),
        opened => opened,
    }
}

/// Fills `buf` from `offset` of `file` only if the kernel's page cache holds those bytes
/// (`preadv2` with `RWF_NOWAIT`): `false` if the read would wait for the disk, fails or comes
/// back short (a blocking read then says why).
pub(crate) fn read_cached_at(file: &File, buf: &mut [u8], offset: u64) -> bool {
    if probes_miss() {
        return false;
    }
    let len = buf.len();
    let read = rustix::io::preadv2(
        file,
        &mut [std::io::IoSliceMut::new(buf)],
        offset,
        rustix::io::ReadWriteFlags::NOWAIT,
    );
    read.ok() == Some(len)
}

/// [`read_cached_at`] of `len` bytes appended to `buf`, into its spare capacity (not zeroed
/// first, as a read buffer need not be): `buf` is unchanged when it returns `false`.
pub(crate) fn read_cached_into(file: &File, buf: &mut Vec<u8>, len: usize, offset: u64) -> bool {
    if probes_miss() {
        return false;
    }
    let Ok(offset) = libc::off_t::try_from(offset) else { return false };
    buf.reserve(len);
    let spare = &mut buf.spare_capacity_mut()[..len];
    let iov = libc::iovec { iov_base: spare.as_mut_ptr().cast(), iov_len: len };
    // SAFETY: `iov` describes `len` bytes of `buf`'s spare capacity, valid for writes, which
    // nothing else refers to during the call; the kernel writes at most `len` bytes there.
    let read = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, offset, libc::RWF_NOWAIT) };
    if usize::try_from(read).ok() != Some(len) {
        return false;
    }
    // SAFETY: the read initialized those `len` bytes, right after the vector's length.
    unsafe { buf.set_len(buf.len() + len) };
    true
}

#[cfg(test)]
thread_local! {
    /// Whether this thread's page-cache probes answer "would wait" ([`ProbesMiss`]).
    static PROBES_MISS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[cfg(test)]
fn probes_miss() -> bool {
    PROBES_MISS.get()
}

#[cfg(not(test))]
fn probes_miss() -> bool {
    false
}

/// While it lives, the page-cache probes of this thread ([`read_cached_at`],
/// [`read_cached_into`]) answer "would wait", as they do where the page cache lacks the bytes;
/// blocking reads, and the probes of every other thread (the blocking pool's), are untouched.
///
/// For tests, which cannot make a real probe miss at will: a probe of a page evicted from the
/// page cache starts the page's readahead, and on a fast disk that read can finish before the
/// probe looks at the page, which it then finds cached (up to a third of such probes here, and
/// at times twenty in a row).
#[cfg(test)]
pub(crate) struct ProbesMiss(());

#[cfg(test)]
impl ProbesMiss {
    pub(crate) fn start() -> ProbesMiss {
        PROBES_MISS.set(true);
        ProbesMiss(())
    }
}

#[cfg(test)]
impl Drop for ProbesMiss {
    fn drop(&mut self) {
        PROBES_MISS.set(false);
    }
}

/// `read_exact_at` that reports a short file as `UnexpectedEof` context rather than a bare error.
pub(crate) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> anyhow::Result<()> {
    file.read_exact_at(buf, offset).map_err(|e| {
        if e.kind() == ErrorKind::UnexpectedEof {
            anyhow::anyhow!("file ends before {} bytes at offset {offset}", buf.len())
        } else {
            anyhow::Error::new(e).context(format!("read {} bytes at offset {offset}", buf.len()))
        }
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn key(blk: u32) -> BufferTag {
        BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum: blk }
    }

    #[test]
    fn a_cached_read_appends_exactly_its_bytes_or_leaves_the_buffer_as_it_was() {
        let mut file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut file, b"0123456789").unwrap();
        let mut buf = b"ab".to_vec();
        assert!(read_cached_into(&file, &mut buf, 4, 3));
        assert_eq!(buf, b"ab3456");
        // Past the end: the read comes back short, and the buffer keeps its length.
        assert!(!read_cached_into(&file, &mut buf, 4, 8));
        assert_eq!(buf, b"ab3456");
        assert!(read_cached_into(&file, &mut buf, 0, 20));
        assert_eq!(buf, b"ab3456");
    }

    fn segment_with(batches: &[Vec<(BufferTag, Lsn, Value)>]) -> (tempfile::TempDir, ActiveSegment) {
        let dir = tempfile::tempdir().unwrap();
        let dir_file = File::open(dir.path()).unwrap();
        let mut seg =
            ActiveSegment::create(dir.path(), &dir_file, 0, &StorageMetrics::unregistered()).unwrap();
        for b in batches {
            seg.append(&EncodedFrame::encode(b)).unwrap();
        }
        (dir, seg)
    }

    fn two_batches() -> Vec<Vec<(BufferTag, Lsn, Value)>> {
        vec![
            vec![
                (key(1), Lsn(10), Value::Image(Bytes::from(vec![7u8; page_types::PAGE_SIZE]))),
                (key(2), Lsn(10), Value::Record(Bytes::from_static(b"abc"))),
            ],
            vec![(key(1), Lsn(20), Value::Record(Bytes::from_static(b"xy")))],
        ]
    }

    #[test]
    fn scan_of_appended_frames_returns_every_entry_with_exact_offsets() {
        let (_dir, seg) = segment_with(&two_batches());
        let scan = scan(&seg.file, seg.len, Lsn(0), false).unwrap();
        assert!(scan.torn.is_none());
        assert_eq!(scan.valid_len, seg.len);
        assert_eq!(scan.entries, seg.entries);
        let e = &scan.entries[2];
        let mut b = vec![0u8; e.len as usize];
        seg.file.read_exact_at(&mut b, e.offset).unwrap();
        assert_eq!(b, b"xy");
        assert_eq!(frame_len(&two_batches()[1]), FRAME_HEADER_LEN + VALUE_HEADER_LEN + 2);
    }

    #[test]
    fn scan_with_truncated_last_frame_stops_at_previous_frame() {
        let (_dir, seg) = segment_with(&two_batches());
        let end_of_first = seg.entries[1].offset + 3;
        for cut in [seg.len - 1, end_of_first + 5, end_of_first + 20] {
            let scan = scan(&seg.file, cut, Lsn(0), false).unwrap();
            assert!(scan.torn.is_some(), "cut at {cut}");
            assert_eq!(scan.valid_len, end_of_first);
            assert_eq!(scan.entries.len(), 2);
        }
    }

    #[test]
    fn scan_with_flipped_bit_in_last_frame_stops_at_previous_frame() {
        let (_dir, seg) = segment_with(&two_batches());
        seg.file.write_all_at(&[0xff], seg.len - 1).unwrap();
        let scan = scan(&seg.file, seg.len, Lsn(0), false).unwrap();
        assert_eq!(scan.torn.as_deref(), Some("frame checksum mismatch"));
        assert_eq!(scan.entries.len(), 2);
    }

    #[test]
    fn scan_of_valid_frame_at_or_below_previous_lsn_is_an_error() {
        let (_dir, seg) = segment_with(&two_batches());
        assert!(scan(&seg.file, seg.len, Lsn(10), false).is_err());
    }
}
