//! The in-memory index of one timeline: `(key, lsn) -> (file, offset, len, kind, crc)`, plus the
//! open files those entries point into, and the read path that turns a lookup into
//! [`ReconstructData`] with positional reads.
//!
//! Why: values stay on disk and memory grows only with the number of values (about 80 bytes per
//! value), never with their size. One ordered map keyed by `(key, lsn)` keeps a key's versions
//! adjacent, so a lookup is one range scan backwards from `lsn` to the newest image.
//!
//! **Invariants:** the index only holds durable values (the committer inserts after fsync);
//! a read's size (records and bytes) is checked against its limits from the index alone, before
//! any value is read;
//! a `(key, lsn)` is inserted at most once; every entry's file is in `files`. Reads take the lock
//! only to plan, never across I/O, and check each value's crc32c before returning it.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Bound;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use anyhow::{ensure, Context};
use bytes::Bytes;

use super::format::{IndexEntry, Kind};
use super::{GetError, Key, Lsn, ReadLimits, ReconstructData};

#[derive(Debug, Clone, Copy)]
struct ValueRef {
    file: u32,
    kind: Kind,
    offset: u64,
    len: u32,
    crc: u32,
}

/// The index. Lives behind the timeline's `RwLock`.
#[derive(Default)]
pub(crate) struct Index {
    map: BTreeMap<(Key, Lsn), ValueRef>,
    files: HashMap<u32, Arc<File>>,
    keys: u64,
}

/// One value to read: where, how long, and the checksum it must have.
pub(crate) struct ValueRead {
    lsn: Lsn,
    file: Arc<File>,
    offset: u64,
    len: u32,
    crc: u32,
}

/// What a lookup found, planned under the lock and executed without it.
pub(crate) struct ReadPlan {
    image: Option<ValueRead>,
    /// Oldest first.
    records: Vec<ValueRead>,
}

impl Index {
    /// Registers an open file under `id`; entries may then point into it.
    pub(crate) fn add_file(&mut self, id: u32, file: Arc<File>) {
        self.files.insert(id, file);
    }

    /// Adds entries of file `id`. Fails, without adding any, if the file is unknown or a
    /// `(key, lsn)` is already present (overlapping files: a bug or a foreign file).
    pub(crate) fn insert(&mut self, id: u32, entries: &[IndexEntry]) -> anyhow::Result<()> {
        ensure!(self.files.contains_key(&id), "index entries for unknown file {id}");
        if let Some(e) = entries.iter().find(|e| self.map.contains_key(&(e.key, e.lsn))) {
            anyhow::bail!("duplicate value for {:?} at lsn {}", e.key, e.lsn);
        }
        for e in entries {
            let r = ValueRef { file: id, kind: e.kind, offset: e.offset, len: e.len, crc: e.crc };
            if !self.has_key(&e.key) {
                self.keys += 1;
            }
            self.map.insert((e.key, e.lsn), r);
        }
        Ok(())
    }

    fn has_key(&self, key: &Key) -> bool {
        self.map.range((*key, Lsn(0))..=(*key, Lsn(u64::MAX))).next().is_some()
    }

    /// Number of distinct keys.
    pub(crate) fn keys(&self) -> u64 {
        self.keys
    }

    /// Number of values.
    pub(crate) fn values(&self) -> u64 {
        self.map.len() as u64
    }

    /// Every key in key order, with the LSN of its oldest value. Jumps from key to key:
    /// O(keys x log values), not a walk over every value.
    pub(crate) fn first_lsns(&self) -> Vec<(Key, Lsn)> {
        let mut out = Vec::with_capacity(self.keys as usize);
        let mut next = self.map.iter().next().map(|(&k, _)| k);
        while let Some((key, lsn)) = next {
            out.push((key, lsn));
            next = self
                .map
                .range((Bound::Excluded((key, Lsn(u64::MAX))), Bound::Unbounded))
                .next()
                .map(|(&k, _)| k);
        }
        out
    }

    /// The LSN of the newest value of `key` at or below `lsn`.
    pub(crate) fn newest_at(&self, key: Key, lsn: Lsn) -> Option<Lsn> {
        let range = (Bound::Included((key, Lsn(0))), Bound::Included((key, lsn)));
        self.map.range(range).next_back().map(|(&(_, at), _)| at)
    }

    /// Plans the reads for `key` as of `lsn`: the newest image at or below `lsn` and the records
    /// above it, or all records at or below `lsn` if there is no image. `None` if nothing.
    /// Fails with `TooLarge`, before any value is read, when more than `limits` would be read.
    pub(crate) fn plan(&self, key: Key, lsn: Lsn, limits: ReadLimits) -> Result<Option<ReadPlan>, GetError> {
        let range = (Bound::Included((key, Lsn(0))), Bound::Included((key, lsn)));
        let mut image = None;
        let mut records = Vec::new();
        let mut bytes = 0u64;
        for (&(_, at), r) in self.map.range(range).rev() {
            bytes += u64::from(r.len);
            if bytes > limits.max_bytes {
                return Err(GetError::TooLarge(format!(
                    "{key:?} at lsn {lsn}: more than {} bytes of image and records from lsn {at} up",
                    limits.max_bytes
                )));
            }
            if r.kind == Kind::Record && records.len() == limits.max_records {
                return Err(GetError::TooLarge(format!(
                    "{key:?} at lsn {lsn}: more than {} records above the newest image (at lsn {at} and up)",
                    limits.max_records
                )));
            }
            let file = self
                .files
                .get(&r.file)
                .with_context(|| format!("file {} gone", r.file))
                .map_err(GetError::Io)?;
            let read = ValueRead { lsn: at, file: file.clone(), offset: r.offset, len: r.len, crc: r.crc };
            match r.kind {
                Kind::Image => {
                    image = Some(read);
                    break;
                }
                Kind::Record => records.push(read),
            }
        }
        if image.is_none() && records.is_empty() {
            return Ok(None);
        }
        records.reverse();
        Ok(Some(ReadPlan { image, records }))
    }
}

impl ReadPlan {
    /// Bytes the plan reads: the lengths of its values.
    pub(crate) fn bytes(&self) -> u64 {
        self.image.iter().chain(&self.records).map(|r| u64::from(r.len)).sum()
    }

    /// Reads every planned value if the kernel's page cache holds all of them, without
    /// waiting for the disk (`preadv2` with `RWF_NOWAIT`, checksums checked); `None` if any
    /// read would wait (or fails, or comes back short): then run [`ReadPlan::execute`] where
    /// blocking is allowed, which also reports any error.
    pub(crate) fn try_execute_cached(&self) -> Option<anyhow::Result<ReconstructData>> {
        let read = |r: &ValueRead| read_value_nowait(r).map(|v| v.map(|v| (r.lsn, v)));
        let image = match &self.image {
            Some(r) => match read(r)? {
                Ok(v) => Some(v),
                Err(e) => return Some(Err(e)),
            },
            None => None,
        };
        let mut records = Vec::with_capacity(self.records.len());
        for r in &self.records {
            match read(r)? {
                Ok(v) => records.push(v),
                Err(e) => return Some(Err(e)),
            }
        }
        Some(Ok(ReconstructData { image, records }))
    }

    /// Reads every planned value with positional reads and checks its checksum.
    pub(crate) fn execute(self) -> anyhow::Result<ReconstructData> {
        let image = self.image.map(|r| Ok::<_, anyhow::Error>((r.lsn, read_value(&r)?)));
        Ok(ReconstructData {
            image: image.transpose()?,
            records: self
                .records
                .iter()
                .map(|r| Ok((r.lsn, read_value(r)?)))
                .collect::<anyhow::Result<_>>()?,
        })
    }
}

/// One value from the page cache, or `None` if reading it would wait for the disk (or the read
/// fails or comes back short: the blocking read then reports why). A checksum mismatch is an
/// error either way.
fn read_value_nowait(r: &ValueRead) -> Option<anyhow::Result<Bytes>> {
    let mut buf = vec![0u8; r.len as usize];
    let read = rustix::io::preadv2(
        &*r.file,
        &mut [std::io::IoSliceMut::new(&mut buf)],
        r.offset,
        rustix::io::ReadWriteFlags::NOWAIT,
    );
    if read.ok()? != buf.len() {
        return None;
    }
    Some(check_value(r, buf))
}

fn read_value(r: &ValueRead) -> anyhow::Result<Bytes> {
    let mut buf = vec![0u8; r.len as usize];
    r.file
        .read_exact_at(&mut buf, r.offset)
        .with_context(|| format!("read value at lsn {} (offset {})", r.lsn, r.offset))?;
    check_value(r, buf)
}

fn check_value(r: &ValueRead, buf: Vec<u8>) -> anyhow::Result<Bytes> {
    ensure!(
        crc32c::crc32c(&buf) == r.crc,
        "checksum mismatch in value at lsn {} (offset {})",
        r.lsn,
        r.offset
    );
    Ok(Bytes::from(buf))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::storage::test_support::NO_LIMITS;

    fn key(blk: u32) -> Key {
        Key { spcnode: 1, dbnode: 1, relnode: 1, forknum: 0, blknum: blk }
    }

    /// A file holding `vals` back to back, and their entries.
    fn file_with(vals: &[(Key, u64, Kind, &[u8])]) -> (Arc<File>, Vec<IndexEntry>) {
        let mut f = tempfile::tempfile().unwrap();
        let mut entries = Vec::new();
        let mut off = 0u64;
        for (k, lsn, kind, b) in vals {
            std::io::Write::write_all(&mut f, b).unwrap();
            let len = b.len() as u32;
            entries.push(IndexEntry {
                key: *k,
                lsn: Lsn(*lsn),
                kind: *kind,
                offset: off,
                len,
                crc: crc32c::crc32c(b),
            });
            off += u64::from(len);
        }
        (Arc::new(f), entries)
    }

    #[test]
    fn plan_picks_newest_image_and_later_records_oldest_first() {
        let (f, entries) = file_with(&[
            (key(1), 10, Kind::Record, b"r10"),
            (key(1), 20, Kind::Image, b"i20"),
            (key(1), 30, Kind::Record, b"r30"),
            (key(1), 40, Kind::Record, b"r40"),
            (key(2), 15, Kind::Record, b"k2"),
        ]);
        let mut idx = Index::default();
        idx.add_file(3, f);
        idx.insert(3, &entries).unwrap();
        assert_eq!((idx.keys(), idx.values()), (2, 5));

        let d = idx.plan(key(1), Lsn(35), NO_LIMITS).unwrap().unwrap().execute().unwrap();
        assert_eq!(d.image, Some((Lsn(20), Bytes::from_static(b"i20"))));
        assert_eq!(d.records, vec![(Lsn(30), Bytes::from_static(b"r30"))]);

        let d = idx.plan(key(1), Lsn(19), NO_LIMITS).unwrap().unwrap().execute().unwrap();
        assert_eq!(d.image, None);
        assert_eq!(d.records, vec![(Lsn(10), Bytes::from_static(b"r10"))]);

        assert!(idx.plan(key(1), Lsn(9), NO_LIMITS).unwrap().is_none());
        assert!(idx.plan(key(2), Lsn(14), NO_LIMITS).unwrap().is_none());
        assert!(idx.plan(key(3), Lsn(100), NO_LIMITS).unwrap().is_none());
    }

    #[test]
    fn first_lsns_lists_every_key_once_with_its_oldest_lsn() {
        let (f, entries) = file_with(&[
            (key(2), 15, Kind::Record, b"a"),
            (key(1), 20, Kind::Image, b"b"),
            (key(1), 30, Kind::Record, b"c"),
            (key(2), 40, Kind::Record, b"d"),
            (key(7), 50, Kind::Image, b"e"),
        ]);
        let mut idx = Index::default();
        assert!(idx.first_lsns().is_empty());
        idx.add_file(0, f);
        idx.insert(0, &entries).unwrap();
        assert_eq!(idx.first_lsns(), vec![(key(1), Lsn(20)), (key(2), Lsn(15)), (key(7), Lsn(50))]);
    }

    #[test]
    fn insert_of_duplicate_key_lsn_fails_and_adds_nothing() {
        let (f, entries) = file_with(&[(key(1), 10, Kind::Record, b"a"), (key(2), 10, Kind::Record, b"b")]);
        let mut idx = Index::default();
        idx.add_file(0, f);
        idx.insert(0, &entries[..1]).unwrap();
        assert!(idx.insert(0, &entries).is_err());
        assert_eq!(idx.values(), 1);
        assert!(idx.insert(9, &entries[1..]).is_err());
    }

    #[test]
    fn read_of_value_with_wrong_checksum_is_an_error() {
        let (f, mut entries) = file_with(&[(key(1), 10, Kind::Record, b"abc")]);
        entries[0].crc ^= 1;
        let mut idx = Index::default();
        idx.add_file(0, f);
        idx.insert(0, &entries).unwrap();
        let err = idx.plan(key(1), Lsn(10), NO_LIMITS).unwrap().unwrap().execute().err().unwrap();
        assert!(format!("{err:#}").contains("checksum mismatch"), "{err:#}");
    }

    #[test]
    fn plan_over_the_limits_fails_before_reading_any_value() {
        // Every stored checksum is wrong: reading any value would fail with a mismatch.
        let vals: Vec<(Key, u64, Kind, &[u8])> = std::iter::once((key(1), 1, Kind::Image, &b"img"[..]))
            .chain((2..=11).map(|lsn| (key(1), lsn, Kind::Record, &b"rec"[..])))
            .collect();
        let (f, mut entries) = file_with(&vals);
        entries.iter_mut().for_each(|e| e.crc ^= 1);
        let mut idx = Index::default();
        idx.add_file(0, f);
        idx.insert(0, &entries).unwrap();

        let limits = |max_records, max_bytes| ReadLimits { max_records, max_bytes };
        let err = idx.plan(key(1), Lsn(11), limits(9, u64::MAX)).err().unwrap();
        assert!(matches!(&err, GetError::TooLarge(m) if m.contains("more than 9 records")), "{err}");
        let err = idx.plan(key(1), Lsn(11), limits(100, 32)).err().unwrap();
        assert!(matches!(&err, GetError::TooLarge(m) if m.contains("more than 32 bytes")), "{err}");
        // Exactly at the limits: planned (and only then read, which finds the bad checksums).
        let plan = idx.plan(key(1), Lsn(11), limits(10, 33)).unwrap().unwrap();
        assert!(format!("{:#}", plan.execute().err().unwrap()).contains("checksum mismatch"));
        // A key with fewer records than the limit above its image is unaffected by older ones.
        assert!(idx.plan(key(1), Lsn(3), limits(2, 9)).unwrap().is_some());
    }
}
