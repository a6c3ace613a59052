//! Helpers shared by the unit tests of every storage module: keys and values, opening a
//! timeline with throwaway metrics, an in-order concurrent join, a crash snapshot, and files,
//! layers and indexes holding given values.
#![allow(clippy::unwrap_used)]

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use page_types::{BufferTag, Lsn, PAGE_SIZE};

use super::format::{IndexEntry, Kind};
use super::index::Index;
use super::layer_map::Frozen;

use super::{IngestBatch, StorageConf, StorageMetrics, Timeline, Value};
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

/// Polls all `futs` concurrently, each round in order (so ingests are queued in order),
/// and returns their outputs in order.
pub(crate) async fn join_in_order<F: Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *o = Some(v),
                    Poll::Pending => done = false,
                }
            }
        }
        if done {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    out.into_iter().map(|o| o.unwrap()).collect()
}

pub(crate) fn key(blk: u32) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 13010, relnode: 16384, forknum: 0, blknum: blk }
}

/// A page image whose bytes are all `fill`.
pub(crate) fn image(fill: u8) -> Value {
    Value::Image(Bytes::from(vec![fill; PAGE_SIZE]))
}

pub(crate) fn record(text: &str) -> Value {
    Value::Record(Bytes::copy_from_slice(text.as_bytes()))
}

pub(crate) fn batch(values: Vec<(BufferTag, u64, Value)>) -> IngestBatch {
    IngestBatch { values: values.into_iter().map(|(k, l, v)| (k, Lsn(l), v)).collect() }
}

pub(crate) fn metrics() -> Arc<StorageMetrics> {
    Arc::new(StorageMetrics::unregistered())
}

pub(crate) fn open(dir: &Path, layer_size: u64, metrics: &Arc<StorageMetrics>) -> Arc<Timeline> {
    Timeline::open(dir, StorageConf { layer_size, ..Default::default() }, metrics.clone()).unwrap()
}

/// The bytes of `v`, for comparing with what a read returns.
pub(crate) fn bytes_of(v: &Value) -> Bytes {
    v.bytes().clone()
}

/// Copies every file of `from` into a new directory: what `kill -9` at this moment would
/// leave on disk (the page cache survives a process crash). Not atomic across files, so
/// callers avoid seals while copying.
pub(crate) fn snapshot(from: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.path().join(entry.file_name())).unwrap();
    }
    to
}

/// A real tmpfs of a fixed size, mounted on a fresh temp directory and unmounted on drop: the
/// way tests make a disk fill up (needs root, which the test environment has).
pub(crate) struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    pub(crate) fn mount(size_bytes: u64) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_bytes}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "mount tmpfs: {status}");
        Tmpfs { dir }
    }

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// A file bind-mounted over `target` until dropped: `unlink(target)` then fails with `EBUSY`,
/// a real failure to delete a file (needs root, as [`Tmpfs`]).
pub(crate) struct BindMount {
    target: std::path::PathBuf,
    _source: tempfile::NamedTempFile,
}

impl BindMount {
    pub(crate) fn over(target: &Path) -> BindMount {
        let source = tempfile::NamedTempFile::new().unwrap();
        let status = std::process::Command::new("mount")
            .arg("--bind")
            .arg(source.path())
            .arg(target)
            .status()
            .unwrap();
        assert!(status.success(), "bind mount over {}: {status}", target.display());
        BindMount { target: target.to_path_buf(), _source: source }
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.target).status();
    }
}

/// Read limits that never refuse.
pub(crate) const NO_LIMITS: super::ReadLimits =
    super::ReadLimits { max_records: usize::MAX, max_bytes: u64::MAX };

/// Checks every layer the manifest of `dir` lists: its file's crc32c is the listed one, and
/// its name's key and LSN ranges are its footer's (it opens). Returns how many it checked.
pub(crate) fn check_listed_layers(dir: &Path) -> usize {
    let m = super::manifest::read(dir).unwrap().unwrap();
    for l in &m.layers {
        let path = dir.join(&l.name);
        let opened = super::layer::open(&path).unwrap();
        let name = super::layer::parse_file_name(&l.name).unwrap();
        assert!(name.keys.is_some() && name.generation.is_some_and(|g| g <= m.generation), "{}", l.name);
        let crc = super::layer::file_crc(&opened.file, opened.len).unwrap();
        assert_eq!(l.crc32c, Some(crc), "{}", l.name);
    }
    m.layers.len()
}

/// A file holding `vals` back to back (each after a gap of `gap` bytes), and their entries.
pub(crate) fn file_with_gap(
    vals: &[(BufferTag, u64, Kind, &[u8])],
    gap: usize,
) -> (Arc<File>, Vec<IndexEntry>) {
    let mut f = tempfile::tempfile().unwrap();
    let mut entries = Vec::new();
    let mut off = 0u64;
    for (k, lsn, kind, b) in vals {
        std::io::Write::write_all(&mut f, &vec![0xee; gap]).unwrap();
        off += gap as u64;
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

/// A file holding `vals` back to back, and their entries.
pub(crate) fn file_with(vals: &[(BufferTag, u64, Kind, &[u8])]) -> (Arc<File>, Vec<IndexEntry>) {
    file_with_gap(vals, 0)
}

/// A map whose only content is the active segment holding `vals`.
pub(crate) fn active_with(vals: &[(BufferTag, u64, Kind, &[u8])]) -> Index {
    let (f, entries) = file_with(vals);
    let mut idx = Index::new(0, f);
    idx.insert_active(&entries, Bytes::new()).unwrap();
    idx
}

/// A layer (flat index) named `l{id}` holding `vals`.
pub(crate) fn layer(id: u32, vals: &[(BufferTag, u64, Kind, &[u8])]) -> Frozen {
    let (f, entries) = file_with(vals);
    Frozen::new(id, format!("l{id}"), f, entries, 0).unwrap()
}
