//! The read path of one timeline: what one lookup of `(key, lsn)` holds ([`Snapshot`], taken
//! under the index's lock by `Index::snapshot`), the values it picks from the index without the
//! lock ([`Snapshot::pick`]: the layers' index blocks), and their reads ([`ReadPlan`], made in
//! time linear in the values): values of one file that lie close together are merged into one
//! span, read with one `pread`, of at most [`MAX_SPAN`] bytes. In a compacted layer a key's
//! values are adjacent, so a page is rebuilt with one read per layer it touches (per MiB); in a
//! sealed segment they are spread over the batches that wrote them. [`read_run`] reads values
//! one span at a time into a reused buffer, for a caller (the compactor) that copies any number
//! of values in bounded memory.
//!
//! **Invariants:** a read's size (records and bytes) is checked against its limits from the
//! index alone, before any value is read; every read checks each value's crc32c before
//! returning it (a record's copy, checked when it was taken, is not checked again); a span is
//! at most [`MAX_SPAN`] bytes (or one value) and [`MAX_SPAN_VALUES`] values; nothing here takes
//! the index's lock: a snapshot is all a read needs, and its files stay open while it lives.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use anyhow::{ensure, Context};
use bytes::Bytes;

use super::format::{IndexEntry, Kind};
use super::layer::{DiskWait, WouldWait};
use super::layer_map::{Found, LayerMap};
use super::segment::{read_cached_at, read_cached_into};
use page_types::{BufferTag, Lsn};

use super::{GetError, ReadLimits, ReconstructData};

/// Values of one file closer than this are read together: reading a few KiB more from the page
/// cache costs less than another system call.
const MERGE_GAP: u64 = 4096;
/// Most bytes one span reads (unless one value is larger): a read's buffer stays bounded
/// whatever the number of values, and a MiB per system call already costs nothing more.
pub(crate) const MAX_SPAN: u64 = 1 << 20;
/// Most values one span holds: bounds the bookkeeping of a span of tiny values.
pub(crate) const MAX_SPAN_VALUES: usize = 4096;

#[cfg(test)]
thread_local! {
    /// Spans looked at while planning, on this thread: the work of [`ReadPlan::new`].
    static SPAN_PROBES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// One value to take out of a span.
struct SpanValue {
    lsn: Lsn,
    kind: Kind,
    /// Offset within the span.
    at: usize,
    len: usize,
    crc: u32,
}

/// Bytes of one file read with one `pread`, holding one or more values.
struct Span {
    file: Arc<File>,
    offset: u64,
    len: usize,
    /// Its values: a range of [`ReadPlan`]'s list (a span's values come one after another).
    values: Range<usize>,
}

/// The values a lookup needs, oldest first, copied out of the map under its lock (a copy of
/// each entry, one handle per file): everything else is done without the lock.
pub(crate) struct Picked {
    files: Vec<Arc<File>>,
    /// Index into `files`, the entry, and the copy of its bytes if the active segment keeps one.
    values: Vec<(usize, IndexEntry, Option<Bytes>)>,
}

impl Picked {
    /// An empty list for `values` values (at most).
    pub(crate) fn with_capacity(values: usize) -> Picked {
        Picked { files: Vec::new(), values: Vec::with_capacity(values) }
    }

    /// Adds a value after the others (they must come oldest first for a plan), with the copy
    /// of its bytes if there is one (then it is not read from `file`).
    pub(crate) fn push(&mut self, file: &Arc<File>, e: &IndexEntry, copy: Option<&Bytes>) {
        if !self.files.last().is_some_and(|f| Arc::ptr_eq(f, file)) {
            self.files.push(Arc::clone(file));
        }
        self.values.push((self.files.len() - 1, *e, copy.cloned()));
    }

    /// Cuts a list (oldest first) into consecutive pieces of at most `limits` each, oldest
    /// first: the first keeps the image, if any; a value larger than `limits` alone is a piece
    /// of its own. For a chain too long for one redo request, rebuilt piece by piece.
    pub(crate) fn into_pieces(self, limits: ReadLimits) -> Vec<Picked> {
        let mut pieces = Vec::new();
        let mut piece = Picked::with_capacity(PICKED_CAPACITY);
        let (mut bytes, mut records) = (0u64, 0usize);
        for (f, e, copy) in self.values {
            let len = u64::from(e.len);
            let record = e.kind == Kind::Record;
            if !piece.values.is_empty()
                && (bytes.saturating_add(len) > limits.max_bytes || (record && records >= limits.max_records))
            {
                pieces.push(std::mem::replace(&mut piece, Picked::with_capacity(PICKED_CAPACITY)));
                (bytes, records) = (0, 0);
            }
            bytes = bytes.saturating_add(len);
            records += usize::from(record);
            piece.push(&self.files[f], &e, copy.as_ref());
        }
        if !piece.values.is_empty() {
            pieces.push(piece);
        }
        pieces
    }

    /// Whether its oldest value is an image (a chain that needs nothing older).
    pub(crate) fn starts_with_image(&self) -> bool {
        self.values.first().is_some_and(|(_, e, _)| e.kind == Kind::Image)
    }

    /// Its records and bytes (as [`Snapshot::pick`] counts them against its limits).
    pub(crate) fn size(&self) -> (usize, u64) {
        let records = self.values.iter().filter(|(_, e, _)| e.kind == Kind::Record).count();
        (records, self.values.iter().map(|(_, e, _)| u64::from(e.len)).sum())
    }

    /// The LSN of its oldest value.
    pub(crate) fn oldest_lsn(&self) -> Option<Lsn> {
        self.values.first().map(|(_, e, _)| e.lsn)
    }

    /// This list (older values, of an ancestor) followed by `newer`.
    pub(crate) fn followed_by(mut self, newer: Picked) -> Picked {
        let shift = self.files.len();
        self.files.extend(newer.files);
        self.values.extend(newer.values.into_iter().map(|(f, e, copy)| (f + shift, e, copy)));
        self
    }

    /// Turns a list pushed newest first into one oldest first, in place.
    fn reverse(&mut self) {
        let last = self.files.len() - 1;
        self.files.reverse();
        self.values.reverse();
        for (f, _, _) in &mut self.values {
            *f = last - *f;
        }
    }
}

/// Values [`Snapshot::pick`] makes room for at first: a chain of an image and a few records
/// fits without growing the list.
const PICKED_CAPACITY: usize = 16;

/// What a lookup found, planned from [`Picked`] without the lock, and executed.
pub(crate) struct ReadPlan {
    spans: Vec<Span>,
    /// Every value read from a file, oldest first; each span names its range (one list, not
    /// one per span: a plan makes two allocations however many spans it has).
    values: Vec<SpanValue>,
    /// The records taken from the active segment's copies, oldest first: nothing to read.
    copies: Vec<(Lsn, Bytes)>,
    /// The LSN of the newest value: the version of the page the plan rebuilds.
    newest: Lsn,
}

/// One lookup's view of the index (`Index::snapshot`): the active segment's entries of its key,
/// and the layer map.
pub(crate) struct Snapshot {
    /// The active segment's file, if any of `active` are in it.
    active_file: Option<Arc<File>>,
    /// Newest first, with the copies of their bytes the segment keeps.
    active: Vec<(IndexEntry, Option<Bytes>)>,
    layers: Arc<LayerMap>,
    /// Where in `layers` the walk begins: from the newest run, or where a version lookup found
    /// the key's newest value ([`LayerMap::walk`]).
    from: Option<Found>,
}

impl Snapshot {
    /// A view of the active segment's entries of a key, newest first (with the copies of their
    /// bytes it keeps), in `active_file`, and of `layers`.
    pub(super) fn new(
        active_file: Arc<File>,
        active: Vec<(IndexEntry, Option<Bytes>)>,
        layers: Arc<LayerMap>,
    ) -> Snapshot {
        Snapshot { active_file: Some(active_file), active, layers, from: None }
    }

    /// A view of a key that the active segment holds no value of (at or below the LSN looked
    /// up), whose newest value `layers` holds where `found` says: a walk of it begins there.
    pub(super) fn in_layers(layers: Arc<LayerMap>, found: Found) -> Snapshot {
        Snapshot { active_file: None, active: Vec::new(), layers, from: Some(found) }
    }

    /// The LSNs of the active segment's entries it holds, newest first.
    #[cfg(test)]
    pub(super) fn active_lsns(&self) -> Vec<u64> {
        self.active.iter().map(|(e, _)| e.lsn.0).collect()
    }

    /// Calls `f` with the entries of `key` at or below `lsn`, newest first, with the file each
    /// is in (the active segment's, then each layer's from the newest layer down, or from the
    /// one a version lookup found the newest in), until it returns `false`; with the copy of
    /// the value's bytes where the active segment keeps one. Index blocks are read waiting for
    /// the disk only where `wait` allows.
    fn newest_first<'a, F>(
        &'a self,
        key: BufferTag,
        lsn: Lsn,
        wait: DiskWait,
        mut f: F,
    ) -> Result<(), GetError>
    where
        F: FnMut(&'a Arc<File>, &IndexEntry, Option<&Bytes>) -> Result<bool, GetError>,
    {
        if let Some(active_file) = &self.active_file {
            for (e, copy) in &self.active {
                if !f(active_file, e, copy.as_ref())? {
                    return Ok(());
                }
            }
        }
        for (l, at) in self.layers.walk(self.from, key, lsn) {
            let r = l.resident(wait).map_err(GetError::Io)?;
            let entries = match at {
                Some(at) => r.down_to_image(key, at, wait),
                None => r.newest_to_image(key, lsn, wait),
            };
            let entries = entries.with_context(|| format!("index of layer {}", l.name));
            for e in entries.map_err(GetError::Io)?.iter() {
                if !f(&r.file, e, None)? {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// The values to read for `key` as of `lsn`: the newest image at or below `lsn` and the
    /// records above it, or all records at or below `lsn` if there is no image. `None` if
    /// nothing. Fails with `TooLarge`, before any value is read, when more than `limits` would
    /// be read. Reads only index blocks, waiting for the disk only where `wait` allows (else
    /// failing with an error that [`would_wait`] tells); plan the values with [`ReadPlan::new`].
    pub(crate) fn pick(
        &self,
        key: BufferTag,
        lsn: Lsn,
        limits: ReadLimits,
        wait: DiskWait,
    ) -> Result<Option<Picked>, GetError> {
        let mut picked = Picked::with_capacity(PICKED_CAPACITY);
        let mut bytes = 0u64;
        let mut records = 0usize;
        self.newest_first(key, lsn, wait, |file, e, copy| {
            bytes += u64::from(e.len);
            if bytes > limits.max_bytes {
                return Err(GetError::TooLarge(format!(
                    "{key:?} at lsn {lsn}: more than {} bytes of image and records from lsn {} up",
                    limits.max_bytes, e.lsn
                )));
            }
            if e.kind == Kind::Record {
                if records == limits.max_records {
                    return Err(GetError::TooLarge(format!(
                        "{key:?} at lsn {lsn}: more than {} records above the newest image (at lsn {} and up)",
                        limits.max_records, e.lsn
                    )));
                }
                records += 1;
            }
            picked.push(file, e, copy);
            Ok(e.kind != Kind::Image)
        })?;
        if picked.values.is_empty() {
            return Ok(None);
        }
        picked.reverse();
        Ok(Some(picked))
    }
}

/// Whether `e`, of the same file, can be read with the span of `values` values that starts at
/// `offset` and is `len` bytes long: it starts after the span's end, within [`MERGE_GAP`] of
/// it, and the span stays within its bounds with it.
fn joins(offset: u64, len: u64, values: usize, e: &IndexEntry) -> bool {
    #[cfg(test)]
    SPAN_PROBES.with(|c| c.set(c.get() + 1));
    let end = offset + len;
    e.offset >= end
        && e.offset - end <= MERGE_GAP
        && e.offset + u64::from(e.len) - offset <= MAX_SPAN
        && values < MAX_SPAN_VALUES
}

/// The bytes a plan of values reads ([`ReadPlan::bytes`]), counted as values are added oldest
/// first, with the rule of [`ReadPlan::new`]: for a caller that bounds what a plan reads before
/// making it.
#[derive(Debug, Default)]
pub(crate) struct ReadSize {
    /// The last span: its file (by address), offset, length and values.
    last: Option<(usize, u64, u64, usize)>,
    bytes: u64,
}

impl ReadSize {
    /// Bytes read so far.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The bytes that adding `e`, of `file`, adds: its own, and the gap before it when it joins
    /// the last span.
    pub(crate) fn cost(&self, file: &Arc<File>, e: &IndexEntry) -> u64 {
        match self.last {
            Some((f, offset, len, values))
                if f == Arc::as_ptr(file) as usize && joins(offset, len, values, e) =>
            {
                e.offset + u64::from(e.len) - (offset + len)
            }
            _ => u64::from(e.len),
        }
    }

    /// Adds `e`, of `file`.
    pub(crate) fn add(&mut self, file: &Arc<File>, e: &IndexEntry) {
        self.bytes += self.cost(file, e);
        let f = Arc::as_ptr(file) as usize;
        self.last = match self.last {
            Some((lf, offset, len, values)) if lf == f && joins(offset, len, values, e) => {
                Some((f, offset, e.offset + u64::from(e.len) - offset, values + 1))
            }
            _ => Some((f, e.offset, u64::from(e.len), 1)),
        };
    }
}

/// Reads the longest prefix of `entries` (values of `file`, in file order) that one span holds
/// (the rule of [`ReadPlan::new`]) into `buf`, replacing its contents, checks each value's
/// checksum, and returns how many values that is (0 for none). Value `e` of them is
/// `buf[e.offset - entries[0].offset..][..e.len]`. So a caller that reuses `buf` reads any
/// number of values in at most [`MAX_SPAN`] bytes (or one value) of memory.
pub(crate) fn read_run(file: &File, entries: &[IndexEntry], buf: &mut Vec<u8>) -> anyhow::Result<usize> {
    let Some(first) = entries.first() else {
        return Ok(0);
    };
    let mut len = u64::from(first.len);
    let mut n = 1;
    while let Some(e) = entries.get(n).filter(|e| joins(first.offset, len, n, e)) {
        len = e.offset + u64::from(e.len) - first.offset;
        n += 1;
    }
    buf.clear();
    buf.resize(len as usize, 0);
    file.read_exact_at(buf, first.offset).with_context(|| {
        format!("read {len} bytes at offset {} (value at lsn {})", first.offset, first.lsn)
    })?;
    for e in &entries[..n] {
        let at = (e.offset - first.offset) as usize;
        ensure!(
            crc32c::crc32c(&buf[at..at + e.len as usize]) == e.crc,
            "checksum mismatch in value at lsn {} (offset {})",
            e.lsn,
            e.offset
        );
    }
    Ok(n)
}

impl ReadPlan {
    /// A plan for `picked` (oldest first): a value joins the span before it when it is of the
    /// same file and within [`MERGE_GAP`] after it (and the span stays within its bounds).
    /// Linear: a file's values come in one run (a key's values in a layer, then the next
    /// layer's), in file order, so only the last span can take the next value.
    pub(crate) fn new(picked: Picked) -> ReadPlan {
        let mut spans: Vec<Span> = Vec::with_capacity(picked.values.len());
        let mut values: Vec<SpanValue> = Vec::with_capacity(picked.values.len());
        let mut copies = Vec::new();
        let newest = picked.values.last().map_or(Lsn(0), |(_, e, _)| e.lsn);
        let mut last_file = usize::MAX;
        for (f, e, copy) in picked.values {
            if let Some(copy) = copy {
                copies.push((e.lsn, copy));
                continue;
            }
            let end = e.offset + u64::from(e.len);
            let joins = spans
                .last_mut()
                .filter(|s| f == last_file && joins(s.offset, s.len as u64, s.values.len(), &e));
            last_file = f;
            let at = match joins {
                Some(s) => {
                    s.len = (end - s.offset) as usize;
                    s.values.end += 1;
                    (e.offset - s.offset) as usize
                }
                None => {
                    spans.push(Span {
                        file: Arc::clone(&picked.files[f]),
                        offset: e.offset,
                        len: e.len as usize,
                        values: values.len()..values.len() + 1,
                    });
                    0
                }
            };
            values.push(SpanValue { lsn: e.lsn, kind: e.kind, at, len: e.len as usize, crc: e.crc });
        }
        ReadPlan { spans, values, copies, newest }
    }

    /// The LSN of the newest value read: which version of the page `lsn` sees (the answer of
    /// `Version::newest`).
    pub(crate) fn newest_lsn(&self) -> Lsn {
        self.newest
    }

    /// Bytes the plan holds: what it reads (its values and the gaps between values read
    /// together) and its records' copies.
    pub(crate) fn bytes(&self) -> u64 {
        self.spans.iter().map(|s| s.len as u64).sum::<u64>()
            + self.copies.iter().map(|(_, c)| c.len() as u64).sum::<u64>()
    }

    /// Number of values the plan gives, read or copied.
    pub(crate) fn values(&self) -> usize {
        self.values.len() + self.copies.len()
    }

    /// Number of `pread` calls the plan makes.
    #[cfg(test)]
    pub(crate) fn reads(&self) -> usize {
        self.spans.len()
    }

    /// Reads every planned value if the kernel's page cache holds all of them, without
    /// waiting for the disk (`preadv2` with `RWF_NOWAIT`, checksums checked); `None` if any
    /// read would wait (or fails, or comes back short): then run [`ReadPlan::execute`] where
    /// blocking is allowed, which also reports any error.
    pub(crate) fn try_execute_cached(&self) -> Option<anyhow::Result<ReconstructData>> {
        let bufs = self.read_spans(|s, buf| {
            Ok::<_, std::convert::Infallible>(read_cached_into(&s.file, buf, s.len, s.offset))
        });
        Some(self.assemble(bufs.ok()??))
    }

    /// Brings the plan's value bytes into the kernel's page cache where they are not there yet
    /// (blocking reads through one buffer of at most [`WARM_CHUNK`] bytes; nothing is kept), so
    /// that [`ReadPlan::try_execute_cached`] then reads them without waiting for the disk. For
    /// the blocking pool: a plan made there because an index block was not in memory most
    /// likely needs its values from the disk too, and this spares the read a trip of its own
    /// (wasted where the page cache then holds the page: rare, as a page read often keeps its
    /// index block in the block cache). A read that fails is left for the read itself to report.
    pub(crate) fn warm_values(&self) {
        let mut buf = vec![0u8; self.spans.iter().map(|s| s.len).max().unwrap_or(0).min(WARM_CHUNK)];
        for s in &self.spans {
            let mut at = 0;
            while at < s.len {
                let n = (s.len - at).min(buf.len());
                let offset = s.offset + at as u64;
                if !read_cached_at(&s.file, &mut buf[..n], offset)
                    && s.file.read_exact_at(&mut buf[..n], offset).is_err()
                {
                    break;
                }
                at += n;
            }
        }
    }

    /// Reads every planned value with positional reads and checks its checksum.
    pub(crate) fn execute(self) -> anyhow::Result<ReconstructData> {
        let bufs =
            self.read_spans(|s, buf| read_span(s, self.values[s.values.start].lsn, buf).map(|()| true))?;
        self.assemble(bufs.context("a blocking read gave up")?)
    }

    /// Reads every span with `read` (which appends the span's bytes to the buffer given, or
    /// says to give up: then `None`): a span holding an image into a buffer of its own (an
    /// image may stay in the page cache, which must not keep the records' bytes alive with it),
    /// the others into one buffer they share, so that a read of many records makes two
    /// allocations, not one per record.
    fn read_spans<E>(
        &self,
        mut read: impl FnMut(&Span, &mut Vec<u8>) -> Result<bool, E>,
    ) -> Result<Option<Vec<Bytes>>, E> {
        let own = |s: &Span| self.values[s.values.clone()].iter().any(|v| v.kind == Kind::Image);
        let mut shared = Vec::with_capacity(self.spans.iter().filter(|s| !own(s)).map(|s| s.len).sum());
        for s in self.spans.iter().filter(|s| !own(s)) {
            if !read(s, &mut shared)? {
                return Ok(None);
            }
        }
        let shared = Bytes::from(shared);
        let (mut bufs, mut at) = (Vec::with_capacity(self.spans.len()), 0);
        for s in &self.spans {
            if own(s) {
                let mut buf = Vec::with_capacity(s.len);
                if !read(s, &mut buf)? {
                    return Ok(None);
                }
                bufs.push(Bytes::from(buf));
            } else {
                bufs.push(shared.slice(at..at + s.len));
                at += s.len;
            }
        }
        Ok(Some(bufs))
    }

    /// Cuts the values out of the spans' bytes (records share the span's memory; an image is
    /// copied out of a larger span, since it may be kept in the page cache), checking each
    /// one's checksum, and adds the records' copies: the newest image and the records, oldest
    /// first.
    fn assemble(&self, bufs: Vec<Bytes>) -> anyhow::Result<ReconstructData> {
        let mut image: Option<(Lsn, Bytes)> = None;
        let mut records = Vec::with_capacity(self.values());
        for (s, buf) in self.spans.iter().zip(bufs) {
            for v in &self.values[s.values.clone()] {
                let bytes = buf.slice(v.at..v.at + v.len);
                ensure!(
                    crc32c::crc32c(&bytes) == v.crc,
                    "checksum mismatch in value at lsn {} (offset {})",
                    v.lsn,
                    s.offset + v.at as u64
                );
                match v.kind {
                    Kind::Image if image.as_ref().is_some_and(|(newest, _)| *newest > v.lsn) => {}
                    Kind::Image if bytes.len() < buf.len() => {
                        image = Some((v.lsn, Bytes::copy_from_slice(&bytes)))
                    }
                    Kind::Image => image = Some((v.lsn, bytes)),
                    Kind::Record => records.push((v.lsn, bytes)),
                }
            }
        }
        records.extend(self.copies.iter().cloned());
        // Two lists oldest first (those read, those copied; one of them mostly empty), or more
        // where layers overlap: a stable sort merges such runs in a pass or two.
        records.sort_by_key(|(lsn, _)| *lsn);
        Ok(ReconstructData { image, records })
    }
}

/// What one lookup of a key for a page read found (`Timeline::lookup`).
pub(crate) enum Lookup<T> {
    /// No value of the key at or below the LSN.
    NotFound,
    /// The page's version (the LSN of the newest value at or below the LSN), and what the
    /// caller's cache had for it.
    Cached { version: Lsn, value: T },
    /// The caller's cache had nothing for the version: the read goes on from here.
    Read(ReadStart),
}

/// A page read that a lookup began: the key, the LSN, the page's version, and the view of the
/// index its plan is picked from (the active segment's entries, copied out under the lock the
/// lookup took, or the layer the lookup found the version in), so that the plan looks the key
/// up no more. Holds its files open, as a snapshot does.
pub(crate) struct ReadStart {
    pub(super) key: BufferTag,
    pub(super) lsn: Lsn,
    version: Lsn,
    pub(super) snapshot: Snapshot,
    /// How many ancestors down the timeline whose index `snapshot` is of lies, when the lookup
    /// went on in an ancestor: the plan is made there (0: in the timeline looked up).
    pub(super) depth: usize,
}

impl ReadStart {
    pub(super) fn new(key: BufferTag, lsn: Lsn, version: Lsn, snapshot: Snapshot) -> ReadStart {
        ReadStart { key, lsn, version, snapshot, depth: 0 }
    }

    /// This read, begun in the ancestor of the timeline it was begun in, seen from the branch.
    pub(super) fn in_ancestor(mut self) -> ReadStart {
        self.depth += 1;
        self
    }

    /// The page's version: the LSN of the newest value of the key at or below the LSN.
    pub(crate) fn version(&self) -> Lsn {
        self.version
    }
}

/// Whether `e` is a [`Snapshot::pick`] with [`DiskWait::Refused`] that needed an index block the
/// kernel's page cache does not hold (it is to be made again where blocking is allowed).
pub(crate) fn would_wait(e: &GetError) -> bool {
    matches!(e, GetError::Io(e) if e.is::<WouldWait>())
}

/// Bytes [`ReadPlan::warm_values`] reads at a time.
const WARM_CHUNK: usize = 64 << 10;

/// One span appended to `buf`, read where blocking is allowed (`lsn`: its oldest value's, for
/// the error).
fn read_span(s: &Span, lsn: Lsn, buf: &mut Vec<u8>) -> anyhow::Result<()> {
    let at = buf.len();
    buf.resize(at + s.len, 0);
    s.file
        .read_exact_at(&mut buf[at..], s.offset)
        .with_context(|| format!("read {} bytes at offset {} (value at lsn {lsn})", s.len, s.offset))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::storage::index::Index;
    use crate::storage::layer_map::{first_lsns, Frozen};
    use crate::storage::test_support::{active_with, file_with, file_with_gap, key, layer, NO_LIMITS};

    #[test]
    fn plan_picks_newest_image_and_later_records_oldest_first() {
        let idx = active_with(&[
            (key(1), 10, Kind::Record, b"r10"),
            (key(1), 20, Kind::Image, b"i20"),
            (key(1), 30, Kind::Record, b"r30"),
            (key(1), 40, Kind::Record, b"r40"),
            (key(2), 15, Kind::Record, b"k2"),
        ]);
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
    fn lookup_walks_active_segment_then_layers_newest_first() {
        let mut idx = active_with(&[(key(1), 50, Kind::Record, b"r50")]);
        idx.push_layer(layer(1, &[(key(1), 10, Kind::Image, b"i10"), (key(2), 12, Kind::Record, b"x")]))
            .unwrap();
        idx.push_layer(layer(2, &[(key(1), 20, Kind::Record, b"r20"), (key(1), 30, Kind::Record, b"r30")]))
            .unwrap();
        let plan = idx.plan(key(1), Lsn(60), NO_LIMITS).unwrap().unwrap();
        // One read per file: the two records of layer 2 are adjacent.
        assert_eq!(plan.reads(), 3);
        let d = plan.execute().unwrap();
        assert_eq!(d.image, Some((Lsn(10), Bytes::from_static(b"i10"))));
        let lsns: Vec<_> = d.records.iter().map(|(l, _)| l.0).collect();
        assert_eq!(lsns, vec![20, 30, 50]);
        assert_eq!(idx.newest_at(key(1), Lsn(49)), Some(Lsn(30)));
        assert_eq!(idx.newest_at(key(2), Lsn(100)), Some(Lsn(12)));
        assert_eq!(idx.newest_at(key(1), Lsn(60)), Some(Lsn(50)), "the active segment's first");
        assert_eq!(idx.newest_at(key(1), Lsn(25)), Some(Lsn(20)));
        assert_eq!(idx.newest_at(key(1), Lsn(15)), Some(Lsn(10)), "below layer 2's, in layer 1");
        assert_eq!(idx.newest_at(key(1), Lsn(9)), None);
        assert_eq!(idx.newest_at(key(2), Lsn(11)), None, "not key 1's entry before key 2's");
        assert_eq!(idx.newest_at(key(3), Lsn(100)), None);
        let (active, layers) = idx.all();
        assert_eq!(first_lsns(&active, layers.layers()).unwrap(), vec![(key(1), Lsn(10)), (key(2), Lsn(12))]);
        assert_eq!((idx.keys(), idx.values()), (2, 5));
    }

    #[test]
    fn values_close_together_are_read_with_one_pread_and_far_apart_with_several() {
        let vals: Vec<(BufferTag, u64, Kind, &[u8])> =
            std::iter::once((key(1), 1, Kind::Image, &[7u8; 8192][..]))
                .chain((2..=10).map(|lsn| (key(1), lsn, Kind::Record, &b"record"[..])))
                .collect();
        for (gap, reads) in [(0, 1), (100, 1), (MERGE_GAP as usize + 1, 10)] {
            let (f, entries) = file_with_gap(&vals, gap);
            let mut idx = Index::new(0, tempfile::tempfile().map(Arc::new).unwrap());
            idx.push_layer(Frozen::new(1, "l".into(), f, entries, 0).unwrap()).unwrap();
            let plan = idx.plan(key(1), Lsn(10), NO_LIMITS).unwrap().unwrap();
            assert_eq!(plan.reads(), reads, "gap {gap}");
            let cached = plan.try_execute_cached().unwrap().unwrap();
            let d = plan.execute().unwrap();
            assert_eq!(cached, d);
            assert_eq!(d.image.as_ref().map(|(l, b)| (l.0, b.len())), Some((1, 8192)));
            assert_eq!(d.records.len(), 9);
            assert!(d.records.iter().all(|(_, r)| &r[..] == b"record"));
        }
    }

    #[test]
    fn planning_values_far_apart_looks_at_each_span_a_bounded_number_of_times() {
        // A key's values spread over a sealed segment, each more than MERGE_GAP from the next
        // (records of other keys in between): one span each. Planning them is linear.
        const VALUES: u64 = 4096;
        let entries: Vec<IndexEntry> = (0..VALUES)
            .map(|i| IndexEntry {
                key: key(1),
                lsn: Lsn(i + 1),
                kind: Kind::Record,
                offset: i * (MERGE_GAP + 1000),
                len: 100,
                crc: 0,
            })
            .collect();
        let mut idx = Index::new(0, tempfile::tempfile().map(Arc::new).unwrap());
        idx.push_layer(
            Frozen::new(1, "l".into(), tempfile::tempfile().map(Arc::new).unwrap(), entries, 0).unwrap(),
        )
        .unwrap();
        let before = SPAN_PROBES.with(|c| c.get());
        let plan = idx.plan(key(1), Lsn(VALUES), NO_LIMITS).unwrap().unwrap();
        let probes = SPAN_PROBES.with(|c| c.get()) - before;
        assert_eq!((plan.reads(), plan.values()), (VALUES as usize, VALUES as usize));
        assert!(probes <= 2 * VALUES, "{probes} spans looked at to plan {VALUES} values");
    }

    #[test]
    fn adjacent_values_are_read_in_spans_of_at_most_a_mib() {
        let page = [3u8; 8192];
        let vals: Vec<(BufferTag, u64, Kind, &[u8])> =
            (1..=300).map(|lsn| (key(1), lsn, Kind::Record, &page[..])).collect();
        let (f, entries) = file_with(&vals);
        let mut idx = Index::new(0, tempfile::tempfile().map(Arc::new).unwrap());
        idx.push_layer(Frozen::new(1, "l".into(), f, entries, 0).unwrap()).unwrap();
        let plan = idx.plan(key(1), Lsn(300), NO_LIMITS).unwrap().unwrap();
        // 128 values of 8 KiB fill a MiB.
        assert_eq!((plan.reads(), plan.bytes()), (3, 300 * 8192));
        assert!(plan.spans.iter().all(|s| s.len as u64 <= MAX_SPAN));
        let d = plan.execute().unwrap();
        assert_eq!(d.records.len(), 300);
        assert!(d.records.iter().all(|(_, r)| r[..] == page[..]));
    }

    /// Records kept in memory are not read from the file: the plan reads only what has no
    /// copy, and the file's bytes of a copied record no longer matter (here overwritten).
    #[test]
    fn records_with_copies_are_taken_from_memory_and_the_others_read() {
        let vals = [
            (key(1), 10, Kind::Image, &[3u8; 8192][..]),
            (key(1), 20, Kind::Record, b"r20"),
            (key(1), 30, Kind::Record, b"r30"),
            (key(1), 40, Kind::Record, b"r40"),
        ];
        let (f, entries) = file_with_gap(&vals, 5000);
        let mut idx = Index::new(0, Arc::clone(&f));
        // Copies of the first two records of the first batch only.
        idx.insert_active(&entries[..3], Bytes::from_static(b"r20r30")).unwrap();
        idx.insert_active(&entries[3..], Bytes::new()).unwrap();
        for e in &entries[1..3] {
            f.write_all_at(b"xxx", e.offset).unwrap();
        }
        let plan = idx.plan(key(1), Lsn(40), NO_LIMITS).unwrap().unwrap();
        assert_eq!((plan.reads(), plan.values(), plan.bytes()), (2, 4, 8192 + 9));
        let d = plan.try_execute_cached().unwrap().unwrap();
        assert_eq!(d.image.unwrap().1.len(), 8192);
        let want = [(20, &b"r20"[..]), (30, b"r30"), (40, b"r40")].map(|(l, b)| (Lsn(l), Bytes::from(b)));
        assert_eq!(d.records, want);
    }

    /// A chain too long for one plan, cut into pieces oldest first: the image starts the first,
    /// each piece stays within the limits, a value larger than them is a piece alone, and the
    /// pieces read back the chain's values in order.
    #[test]
    fn a_chain_cut_into_pieces_keeps_its_order_and_each_piece_within_the_limits() {
        let mut vals = vec![(key(1), 10, Kind::Image, vec![7u8; 100])];
        for lsn in 11..40 {
            vals.push((key(1), lsn, Kind::Record, vec![lsn as u8; if lsn == 25 { 90 } else { 10 }]));
        }
        let idx =
            active_with(&vals.iter().map(|(k, l, kind, b)| (*k, *l, *kind, &b[..])).collect::<Vec<_>>());
        let picked =
            idx.snapshot(key(1), Lsn(39)).pick(key(1), Lsn(39), NO_LIMITS, DiskWait::Allowed).unwrap();
        let limits = ReadLimits { max_records: 4, max_bytes: 60 };
        let pieces: Vec<_> = picked.unwrap().into_pieces(limits).into_iter().map(ReadPlan::new).collect();
        let mut lsns = Vec::new();
        for (i, piece) in pieces.into_iter().enumerate() {
            let d = piece.execute().unwrap();
            assert_eq!(d.image.is_some(), i == 0, "only the first piece has the image");
            let bytes: usize = d.records.iter().map(|(_, r)| r.len()).sum();
            assert!(d.records.len() <= 4 && (bytes <= 60 || d.records.len() == 1), "piece {i}: {d:?}");
            lsns.extend(d.image.iter().map(|(l, _)| l.0).chain(d.records.iter().map(|(l, _)| l.0)));
        }
        assert_eq!(lsns, (10..40).collect::<Vec<_>>());
    }

    #[test]
    fn read_of_value_with_wrong_checksum_is_an_error() {
        let (f, mut entries) = file_with(&[(key(1), 10, Kind::Record, b"abc")]);
        entries[0].crc ^= 1;
        let mut idx = Index::new(0, f);
        idx.insert_active(&entries, Bytes::new()).unwrap();
        let err = idx.plan(key(1), Lsn(10), NO_LIMITS).unwrap().unwrap().execute().err().unwrap();
        assert!(format!("{err:#}").contains("checksum mismatch"), "{err:#}");
    }

    #[test]
    fn plan_over_the_limits_fails_before_reading_any_value() {
        // Every stored checksum is wrong: reading any value would fail with a mismatch.
        let vals: Vec<(BufferTag, u64, Kind, &[u8])> = std::iter::once((key(1), 1, Kind::Image, &b"img"[..]))
            .chain((2..=11).map(|lsn| (key(1), lsn, Kind::Record, &b"rec"[..])))
            .collect();
        let (f, mut entries) = file_with(&vals);
        entries.iter_mut().for_each(|e| e.crc ^= 1);
        let mut idx = Index::new(0, f);
        idx.insert_active(&entries, Bytes::new()).unwrap();

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
