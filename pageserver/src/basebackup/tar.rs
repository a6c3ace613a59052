//! The tar format the base backup is written in: POSIX ustar headers (512 bytes), each file's
//! bytes padded to 512, and two zero blocks at the end, as `pg_basebackup -Ft` reads and GNU tar
//! and Python's `tarfile` extract. Paths are relative to the data directory and at most 100
//! bytes (the longest a base backup has, `pg_multixact/members/XXXX` or
//! `base/<oid>/<oid>_init.<n>`, is under 40), so no long-name extension is needed.
//!
//! Invariant: pure; a path or a size the format cannot hold is an error, never a wrong header.

/// The tar block.
pub const BLOCK: usize = 512;
/// The end of an archive: two zero blocks.
pub const END: [u8; 2 * BLOCK] = [0; 2 * BLOCK];
/// The longest path a ustar header holds without its prefix field.
const NAME_LEN: usize = 100;
/// The largest size an 11-digit octal field holds (8 GiB - 1).
const MAX_SIZE: u64 = 8u64.pow(11) - 1;

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// A regular file of this many bytes, mode 0600.
    File(u64),
    /// A directory, mode 0700.
    Dir,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TarError {
    #[error("tar path {path:?}: empty, longer than {NAME_LEN} bytes or with a NUL byte")]
    Path { path: String },
    #[error("tar entry {path:?} of {size} bytes: more than a ustar header holds")]
    Size { path: String, size: u64 },
}

/// The header of `entry` at `path` (no trailing slash for a directory: it is added), modified
/// at `mtime` (seconds since the epoch), owned by uid and gid 0 (extraction takes the
/// extracting user's).
pub fn header(path: &str, entry: Entry, mtime: u64) -> Result<[u8; BLOCK], TarError> {
    let name = match entry {
        Entry::File(_) => path.to_owned(),
        Entry::Dir => format!("{path}/"),
    };
    if path.is_empty() || name.len() > NAME_LEN || name.contains('\0') {
        return Err(TarError::Path { path: path.to_owned() });
    }
    let (size, mode, typeflag) = match entry {
        Entry::File(size) if size > MAX_SIZE => return Err(TarError::Size { path: path.to_owned(), size }),
        Entry::File(size) => (size, 0o600, b'0'),
        Entry::Dir => (0, 0o700, b'5'),
    };
    let mut h = [0u8; BLOCK];
    let mut put = |at: usize, bytes: &[u8]| h[at..at + bytes.len()].copy_from_slice(bytes);
    put(0, name.as_bytes());
    put(100, format!("{mode:07o}\0").as_bytes());
    put(108, b"0000000\0"); // uid
    put(116, b"0000000\0"); // gid
    put(124, format!("{size:011o}\0").as_bytes());
    put(136, format!("{:011o}\0", mtime.min(MAX_SIZE)).as_bytes());
    put(148, b"        "); // the checksum counts its own field as spaces
    put(156, &[typeflag]);
    put(257, b"ustar\0");
    put(263, b"00");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    Ok(h)
}

/// The zero bytes that follow a file of `size` bytes to the next block.
pub fn padding(size: u64) -> usize {
    let rest = (size % BLOCK as u64) as usize;
    if rest == 0 {
        0
    } else {
        BLOCK - rest
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::ingest::tar::{TarEvent, TarReader};

    #[test]
    fn the_reader_of_the_import_reads_what_is_written_here() {
        let mut archive = Vec::new();
        archive.extend(header("base", Entry::Dir, 1_700_000_000).unwrap());
        for (path, len) in [("base/5/16384", 8192 * 3), ("PG_VERSION", 3), ("global/pg_filenode.map", 512)] {
            archive.extend(header(path, Entry::File(len as u64), 1_700_000_000).unwrap());
            archive.extend((0..len).map(|i| (i % 253) as u8));
            archive.extend(vec![0u8; padding(len as u64)]);
        }
        archive.extend(END);
        let mut reader = TarReader::new();
        reader.feed(&archive);
        let mut files = Vec::new();
        let mut bytes = 0usize;
        while let Some(event) = reader.next().unwrap() {
            match event {
                TarEvent::File { path, size } => files.push((path, size)),
                TarEvent::Data(data) => bytes += data.len(),
                TarEvent::FileEnd | TarEvent::Other(_) => {}
            }
        }
        reader.finish().unwrap();
        assert_eq!(
            files,
            vec![
                ("base/5/16384".to_owned(), 8192 * 3),
                ("PG_VERSION".to_owned(), 3),
                ("global/pg_filenode.map".to_owned(), 512)
            ]
        );
        assert_eq!(bytes, 8192 * 3 + 3 + 512);
    }

    #[test]
    fn the_checksum_is_the_sum_of_the_header_with_its_field_as_spaces() {
        let h = header("pg_wal/000000010000000000000002", Entry::File(16 << 20), 0).unwrap();
        let stored = u32::from_str_radix(std::str::from_utf8(&h[148..154]).unwrap(), 8).unwrap();
        let mut blanked = h;
        blanked[148..156].copy_from_slice(b"        ");
        assert_eq!(stored, blanked.iter().map(|&b| u32::from(b)).sum::<u32>());
        assert_eq!(&h[124..136], b"00100000000\0");
    }

    #[test]
    fn paths_and_sizes_a_header_cannot_hold_are_errors() {
        assert!(header("", Entry::File(0), 0).is_err());
        assert!(header(&"x".repeat(101), Entry::File(0), 0).is_err());
        assert!(header(&"x".repeat(100), Entry::Dir, 0).is_err());
        assert!(header("a\0b", Entry::File(0), 0).is_err());
        assert!(header("big", Entry::File(MAX_SIZE + 1), 0).is_err());
        assert!(header(&"x".repeat(100), Entry::File(MAX_SIZE), 0).is_ok());
        assert_eq!((padding(0), padding(1), padding(512), padding(513)), (0, 511, 0, 511));
    }
}
