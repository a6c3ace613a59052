//! Byte-level building blocks shared by the active segment and sealed layers: the file header,
//! the key encoding, the value kind and the little-endian cursor used to decode them.
//!
//! The whole format is specified in `docs/storage-format.md`; this module is its single source of
//! truth for constants. **Invariant:** nothing here does I/O, and every decoder checks a length
//! before it slices, so a corrupt file yields an error, never a panic.

use anyhow::{bail, ensure, Context};
use page_types::{BufferTag, Lsn, MAX_RECORD_LEN, PAGE_SIZE};

/// Magic at offset 0 of every storage file (active segment and sealed layer).
pub(crate) const FILE_MAGIC: [u8; 8] = *b"PSSTOR01";
/// Format version written right after [`FILE_MAGIC`]: 2 and up mean "this file's directory has
/// a manifest" (such a file with no `manifest.json` beside it means the manifest was lost); 3
/// means "written by a build whose layers carry a block index" (a layer's footer says which
/// index it has). Version 1 and 2 files are still read.
pub(crate) const FORMAT_VERSION: u32 = 3;
/// Oldest file format version still read.
pub(crate) const MIN_FORMAT_VERSION: u32 = 1;
/// `magic(8) | version u32 | crc32c(bytes 0..12) u32`.
pub(crate) const FILE_HEADER_LEN: u64 = 16;

/// Name of the lock file in a timeline directory.
pub(crate) const LOCK_NAME: &str = "lock";

/// Encoded size of a [`BufferTag`] in storage: spcnode, dbnode, relnode (u32 each), forknum
/// (u8), blknum (u32), little-endian. The same length as the wire form's
/// (`page_types::BUFFER_TAG_LEN`), not the same encoding: the file format does not follow the
/// wire's.
pub(crate) const KEY_LEN: usize = 17;

/// Kind byte of a stored value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Image,
    Record,
}

impl Kind {
    pub(crate) fn to_byte(self) -> u8 {
        match self {
            Kind::Image => 0,
            Kind::Record => 1,
        }
    }

    pub(crate) fn from_byte(b: u8) -> anyhow::Result<Kind> {
        match b {
            0 => Ok(Kind::Image),
            1 => Ok(Kind::Record),
            other => bail!("unknown value kind {other}"),
        }
    }

    /// Checks a stored length against the limits of this kind for `key`: an image of a
    /// relation page is a page; the cluster's other keys (`page_types::keys`: relation sizes,
    /// SLRU pages, control and map files, the checkpoint counters) hold images of 0 to
    /// [`PAGE_SIZE`] bytes; records are for relation pages and SLRU pages only
    /// (`keys::holds_pages`: the other keys' values are complete in themselves, nothing
    /// redoes them).
    pub(crate) fn check_len(self, key: &BufferTag, len: usize) -> anyhow::Result<()> {
        let page = page_types::keys::is_rel_page(key);
        match self {
            Kind::Image if page => ensure!(len == PAGE_SIZE, "image of {len} bytes, want {PAGE_SIZE}"),
            Kind::Image => ensure!(len <= PAGE_SIZE, "value of {len} bytes, want at most {PAGE_SIZE}"),
            Kind::Record => {
                ensure!(
                    page_types::keys::holds_pages(key),
                    "a record for {key:?}, which is not a relation or SLRU page (only images)"
                );
                ensure!(
                    (1..=MAX_RECORD_LEN).contains(&len),
                    "record of {len} bytes, want 1..={MAX_RECORD_LEN}"
                )
            }
        }
        Ok(())
    }
}

/// Where one value's bytes live: the unit of both the in-memory index and a layer's index block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IndexEntry {
    pub key: BufferTag,
    pub lsn: Lsn,
    pub kind: Kind,
    /// Absolute byte offset of the value in its file.
    pub offset: u64,
    pub len: u32,
    /// crc32c of the value bytes, checked on every read.
    pub crc: u32,
}

/// Records of at most this many bytes are kept in memory while their segment is active
/// (`index::Index::insert_active`): a GetPage of a page whose records came in many batches reads each
/// of them from its own place in the segment, a `pread` for a few dozen bytes (10 of a redo
/// GetPage's 11 reads at chain length 10), where a copy in memory costs a slice.
pub(crate) const COPIED_RECORD_MAX: usize = 1024;

/// Most bytes of record copies one active segment keeps (copies are taken while they fit; a
/// record that would go past it is read from the file): a tenant's memory for them stays
/// bounded whatever `layer_size` is, about a quarter of the default segment.
pub(crate) const COPIES_MAX: u64 = 16 << 20;

/// Whether `e` is a value the active segment keeps a copy of (bytes allowing).
pub(crate) fn is_copied(e: &IndexEntry) -> bool {
    e.kind == Kind::Record && e.len as usize <= COPIED_RECORD_MAX
}

pub(crate) fn file_header() -> [u8; FILE_HEADER_LEN as usize] {
    file_header_of_version(FORMAT_VERSION)
}

pub(crate) fn file_header_of_version(version: u32) -> [u8; FILE_HEADER_LEN as usize] {
    let mut h = [0u8; FILE_HEADER_LEN as usize];
    h[..8].copy_from_slice(&FILE_MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    let crc = crc32c::crc32c(&h[..12]);
    h[12..16].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a file header; returns its format version.
pub(crate) fn check_file_header(h: &[u8]) -> anyhow::Result<u32> {
    ensure!(h.len() >= FILE_HEADER_LEN as usize, "file header too short");
    ensure!(h[..8] == FILE_MAGIC, "bad file magic");
    let mut c = Cursor::new(&h[8..16]);
    let version = c.u32()?;
    let crc = c.u32()?;
    ensure!(crc == crc32c::crc32c(&h[..12]), "file header checksum mismatch");
    ensure!((MIN_FORMAT_VERSION..=FORMAT_VERSION).contains(&version), "unsupported format version {version}");
    Ok(version)
}

pub(crate) fn put_key(out: &mut Vec<u8>, key: &BufferTag) {
    out.extend_from_slice(&key.spcnode.to_le_bytes());
    out.extend_from_slice(&key.dbnode.to_le_bytes());
    out.extend_from_slice(&key.relnode.to_le_bytes());
    out.push(key.forknum);
    out.extend_from_slice(&key.blknum.to_le_bytes());
}

/// A little-endian reader over a byte slice that fails instead of panicking at the end.
pub(crate) struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Cursor { buf, pos: 0 }
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn bytes(&mut self, n: usize) -> anyhow::Result<&'a [u8]> {
        let end = self.pos.checked_add(n).context("length overflow")?;
        let s = self
            .buf
            .get(self.pos..end)
            .with_context(|| format!("truncated: need {n} bytes at {}", self.pos))?;
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> anyhow::Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    pub(crate) fn u8(&mut self) -> anyhow::Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    pub(crate) fn u32(&mut self) -> anyhow::Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub(crate) fn u64(&mut self) -> anyhow::Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub(crate) fn key(&mut self) -> anyhow::Result<BufferTag> {
        Ok(BufferTag {
            spcnode: self.u32()?,
            dbnode: self.u32()?,
            relnode: self.u32()?,
            forknum: self.u8()?,
            blknum: self.u32()?,
        })
    }

    pub(crate) fn lsn(&mut self) -> anyhow::Result<Lsn> {
        Ok(Lsn(self.u64()?))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn key_roundtrip_through_cursor_is_identity() {
        let key = BufferTag { spcnode: 1, dbnode: 2, relnode: 3, forknum: 4, blknum: 0xdead_beef };
        let mut out = Vec::new();
        put_key(&mut out, &key);
        assert_eq!(out.len(), KEY_LEN);
        assert_eq!(Cursor::new(&out).key().unwrap(), key);
    }

    #[test]
    fn file_header_with_flipped_bit_is_rejected() {
        let mut h = file_header();
        check_file_header(&h).unwrap();
        h[9] ^= 1;
        assert!(check_file_header(&h).is_err());
    }

    #[test]
    fn cursor_past_end_fails_without_panic() {
        let mut c = Cursor::new(&[1, 2, 3]);
        assert!(c.u32().is_err());
        assert_eq!(c.u8().unwrap(), 1);
    }

    #[test]
    fn kind_len_limits_are_enforced() {
        let page = BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum: 3 };
        assert!(Kind::Image.check_len(&page, PAGE_SIZE).is_ok());
        assert!(Kind::Image.check_len(&page, PAGE_SIZE - 1).is_err());
        assert!(Kind::Record.check_len(&page, 0).is_err());
        assert!(Kind::Record.check_len(&page, MAX_RECORD_LEN).is_ok());
        assert!(Kind::Record.check_len(&page, MAX_RECORD_LEN + 1).is_err());
        // The cluster's other keys: short images (even empty), never records.
        let size = page_types::keys::RelTag { spcnode: 1663, dbnode: 5, relnode: 16384 }.size_key(0);
        assert!(Kind::Image.check_len(&size, 0).is_ok());
        assert!(Kind::Image.check_len(&size, 4).is_ok());
        assert!(Kind::Image.check_len(&size, PAGE_SIZE + 1).is_err());
        assert!(Kind::Record.check_len(&size, 4).is_err());
        assert!(Kind::Record.check_len(&page_types::keys::checkpoint_key(), 4).is_err());
        // SLRU pages take records (the CLOG's status changes).
        let clog = page_types::keys::slru_page_key(page_types::keys::SlruKind::Clog, 0, 1);
        assert!(Kind::Record.check_len(&clog, 30).is_ok());
        assert!(Kind::Image.check_len(&clog, PAGE_SIZE).is_ok());
        assert!(Kind::from_byte(7).is_err());
    }
}
