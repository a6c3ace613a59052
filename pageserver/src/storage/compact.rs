//! Compaction of a timeline's layers: one **pass** rewrites every frozen layer into fewer,
//! key-sorted layers, creating page images where record chains are long and dropping what no
//! GetPage at or above the GC cutoff can need. A pass is resumable: it walks the keys in order
//! with a cursor, in slices of bounded time ([`Pass::run_slice`]), so its caller decides when
//! and how much of it runs (`crate::compaction`, the time-sliced driver).
//!
//! Per key (its values in the input layers, oldest first):
//! - **GC**: values older than the newest image at or below the cutoff are dropped;
//! - **image creation**: if more than `image_threshold` records sit above the key's newest
//!   image, the pass asks its caller for the page at the key's newest LSN
//!   ([`Step::NeedImage`]: storage knows nothing of redo) and writes that image in place of the
//!   record at that LSN (and, if that LSN is at or below the cutoff, in place of everything);
//! - the kept values are written back to back into the current output, so that a key's values
//!   in a compacted layer are adjacent and a read of it is one `pread`.
//!
//! Crash safety (docs/storage-format.md, "Compaction"): the pass starts by recording its intent
//! (and the new GC cutoff) in the manifest; outputs are written under temporary names, fsynced,
//! renamed to their layer names; one manifest write swaps the inputs for the outputs and lists
//! the inputs for deletion; then the inputs are deleted (one that cannot be stays listed for
//! later). Recovery removes the leftovers of a pass that did not install, and deletes listed
//! inputs that survived. A failed fsync is fatal for the timeline, as in the committer; an
//! install whose manifest was renamed into place but not made durable keeps both its inputs
//! and its outputs.
//!
//! **Invariants:** the inputs are the oldest layers (a prefix of the layer list) at the start of
//! the pass, and only compaction removes layers, so they still are at install; the outputs
//! cover no LSN above the inputs', so the layer map's order holds; a key keeps every value a
//! read at or above the cutoff needs (the suffix from its newest image at or below the cutoff),
//! so a read at a retained LSN sees the same page before and after; the GC cutoff only grows
//! and is durable before anything below it is dropped; nothing here waits for another thread.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use serde::Serialize;

use super::format::{self, IndexEntry, Kind, FILE_HEADER_LEN};
use super::index::{Frozen, Picked, ReadPlan};
use super::layer;
use super::manifest::{CompactIntent, LayerMeta, RenamedNotSynced};
use super::shared::Shared;
use super::{Key, Lsn, ReconstructData};

/// Prefix of an output's temporary name (`.compact_<id>.tmp`); recovery removes such files.
pub(crate) const TMP_PREFIX: &str = ".compact_";
/// Bytes of values buffered before an output write.
const WRITE_BUFFER: usize = 256 << 10;

/// What a pass does; see the module doc.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactionConf {
    /// Records above a key's newest image from which the pass creates an image.
    pub image_threshold: usize,
    /// GetPage stays possible at LSNs at most this far below the last durable LSN; older
    /// versions may be dropped.
    pub gc_horizon: u64,
    /// Outputs are cut at a key boundary once they reach this size (bytes).
    pub layer_size: u64,
}

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PassStats {
    pub input_layers: u64,
    /// Values in the input layers: each is read once, so `values_read` over this is how far a
    /// pass has got.
    pub input_values: u64,
    pub output_layers: u64,
    pub keys: u64,
    pub values_read: u64,
    pub values_written: u64,
    /// Values dropped: below the GC cutoff, or replaced by a new image.
    pub values_dropped: u64,
    pub images_created: u64,
    /// Images that could not be created (redo failed); the key kept its values.
    pub image_failures: u64,
    pub bytes_before: u64,
    pub bytes_written: u64,
    /// Input files deleted after the install.
    pub files_deleted: u64,
    /// The GC cutoff the pass applied.
    pub gc_cutoff: u64,
}

/// A page the pass needs reconstructed: `key` as of `lsn`, from `data`.
#[derive(Debug)]
pub struct ImageRequest {
    pub key: Key,
    pub lsn: Lsn,
    pub data: ReconstructData,
}

/// What a slice ended with.
#[derive(Debug)]
pub enum Step {
    /// Out of time; call [`Pass::run_slice`] again.
    Continue,
    /// Reconstruct this page and hand it to [`Pass::provide_image`] before the next slice.
    NeedImage(ImageRequest),
    /// Installed; the pass is over.
    Done(PassStats),
}

/// A key's input values: the file each is in and its entry, oldest first.
type KeyValues = Vec<(Arc<File>, IndexEntry)>;

/// A key waiting for its image.
struct Waiting {
    key: Key,
    values: KeyValues,
    keep_from: usize,
    image: Option<Option<Bytes>>,
}

/// The output being written.
struct Writer {
    id: u64,
    tmp: PathBuf,
    file: File,
    /// Bytes on disk (header and flushed values).
    len: u64,
    buf: Vec<u8>,
    entries: Vec<IndexEntry>,
}

/// A finished output: its manifest entry and its index.
struct Output {
    meta: LayerMeta,
    layer: Arc<Frozen>,
}

/// One compaction pass of a timeline. See the module doc.
pub struct Pass {
    shared: Arc<Shared>,
    dir_file: File,
    conf: CompactionConf,
    inputs: Vec<Arc<Frozen>>,
    cutoff: Lsn,
    /// The last key done; `None` before the first.
    cursor: Option<Key>,
    waiting: Option<Waiting>,
    writer: Option<Writer>,
    outputs: Vec<Output>,
    next_id: u64,
    stats: PassStats,
    installed: bool,
    /// The install's manifest was renamed into place without being made durable: the inputs
    /// and the outputs both stay, whichever manifest a crash leaves (the timeline has failed
    /// for good; the next open sorts it out).
    outcome_unknown: bool,
}

impl Pass {
    /// Starts a pass over every frozen layer, recording its intent and GC cutoff in the
    /// manifest. `None` if there are no layers. Refused once the timeline has failed for good.
    pub(super) fn begin(shared: &Arc<Shared>, conf: CompactionConf) -> anyhow::Result<Option<Pass>> {
        if let Some(error) = shared.fatal_error() {
            anyhow::bail!("storage failed for good, no compaction until the timeline is reopened: {error}");
        }
        let inputs: Vec<Arc<Frozen>> =
            shared.index.read().unwrap_or_else(PoisonError::into_inner).layers().to_vec();
        let Some(top) = inputs.iter().map(|l| l.last_lsn).max() else {
            return Ok(None);
        };
        let durable = *shared.durable.borrow();
        let horizon = Lsn(durable.0.saturating_sub(conf.gc_horizon));
        let cutoff = Lsn(shared.gc_cutoff.load(Ordering::Relaxed)).max(horizon.min(top));
        let dir_file = File::open(&shared.dir).context("open timeline directory")?;
        let mut next_id = 0;
        shared
            .update_manifest(&dir_file, |m| {
                next_id = m.next_layer_id;
                // A pass that did not finish may have left outputs from its first id on.
                let first = m.compacting.as_ref().map_or(next_id, |c| c.first_layer_id);
                m.compacting = Some(CompactIntent { first_layer_id: first });
                m.gc_cutoff = m.gc_cutoff.max(cutoff.0);
            })
            .context("record compaction intent")
            .inspect_err(|e| shared.record_if_fatal(e))?;
        shared.gc_cutoff.fetch_max(cutoff.0, Ordering::Relaxed);
        // Records ingested from here on are the next pass's debt (also the few that reached the
        // active segment since the caller sealed it, which this pass does not take).
        shared.index.write().unwrap_or_else(PoisonError::into_inner).reset_new_records();
        let stats = PassStats {
            input_layers: inputs.len() as u64,
            input_values: inputs.iter().map(|l| l.entries.len() as u64).sum(),
            bytes_before: inputs.iter().map(|l| l.size).sum(),
            gc_cutoff: cutoff.0,
            ..PassStats::default()
        };
        Ok(Some(Pass {
            shared: Arc::clone(shared),
            dir_file,
            conf,
            inputs,
            cutoff,
            cursor: None,
            waiting: None,
            writer: None,
            outputs: Vec::new(),
            next_id,
            stats,
            installed: false,
            outcome_unknown: false,
        }))
    }

    /// Runs the pass for about `budget` (checked after each key), blocking on file I/O: call it
    /// off the async executor. After `NeedImage`, call [`Pass::provide_image`] first.
    ///
    /// An error ends the pass. One that is fatal (a failed fsync, an install whose outcome is
    /// unknown) makes the timeline fail for good, as the committer's do: nothing more is written
    /// until it is reopened.
    pub fn run_slice(&mut self, budget: Duration) -> anyhow::Result<Step> {
        self.slice(budget).inspect_err(|e| self.shared.record_if_fatal(e))
    }

    fn slice(&mut self, budget: Duration) -> anyhow::Result<Step> {
        let start = Instant::now();
        if let Some(w) = self.waiting.take() {
            anyhow::ensure!(w.image.is_some(), "compaction slice run before its image was provided");
            self.finish_key(w)?;
        }
        loop {
            let Some(key) = self.inputs.iter().filter_map(|l| l.next_key(self.cursor)).min() else {
                let stats = self.install()?;
                return Ok(Step::Done(stats));
            };
            self.cursor = Some(key);
            if let Some(request) = self.start_key(key)? {
                return Ok(Step::NeedImage(request));
            }
            if start.elapsed() >= budget {
                return Ok(Step::Continue);
            }
        }
    }

    /// The page asked for by the last `NeedImage`, or `None` if it could not be rebuilt (the
    /// key then keeps its values as they are).
    pub fn provide_image(&mut self, page: Option<Bytes>) {
        if let Some(w) = self.waiting.as_mut() {
            w.image = Some(page);
        }
    }

    /// Where the pass is: keys done and values read so far (of `input_values`).
    pub fn stats(&self) -> &PassStats {
        &self.stats
    }

    /// Collects `key`'s values; writes what it keeps, or returns the image it needs first.
    fn start_key(&mut self, key: Key) -> anyhow::Result<Option<ImageRequest>> {
        let values: KeyValues = self
            .inputs
            .iter()
            .flat_map(|l| l.values_of(key, Lsn(u64::MAX)).iter().map(|e| (Arc::clone(&l.file), *e)))
            .collect();
        self.stats.keys += 1;
        self.stats.values_read += values.len() as u64;
        let keep_from =
            values.iter().rposition(|(_, e)| e.kind == Kind::Image && e.lsn <= self.cutoff).unwrap_or(0);
        let base = values.iter().rposition(|(_, e)| e.kind == Kind::Image);
        let chain = values.len() - base.map_or(0, |i| i + 1);
        let fits = chain <= page_types::MAX_RECORDS_PER_REQUEST
            && values[base.unwrap_or(0)..].iter().map(|(_, e)| u64::from(e.len)).sum::<u64>()
                <= page_types::MAX_RECONSTRUCT_BYTES;
        let w = Waiting { key, values, keep_from, image: None };
        if chain < self.conf.image_threshold.max(1) || !fits {
            self.finish_key(w)?;
            return Ok(None);
        }
        // The chain is not empty here (it reached the threshold), so there is a newest value.
        let top = w.values.last().map_or(Lsn(0), |(_, e)| e.lsn);
        let data = plan_of(&w.values[base.unwrap_or(0)..])
            .execute()
            .with_context(|| format!("read {key:?} for its image"))?;
        self.waiting = Some(w);
        Ok(Some(ImageRequest { key, lsn: top, data }))
    }

    /// Writes the values `w` keeps (with its new image, if one was made).
    fn finish_key(&mut self, w: Waiting) -> anyhow::Result<()> {
        let total = w.values.len();
        let mut kept = read_entries(&w.values[w.keep_from..]).with_context(|| format!("read {:?}", w.key))?;
        if let Some(Some(image)) = w.image {
            let top = kept.pop().map(|(lsn, _, _)| lsn).context("a key without values")?;
            if top <= self.cutoff {
                kept.clear();
            }
            kept.push((top, Kind::Image, image));
            self.stats.images_created += 1;
        } else if w.image.is_some() {
            self.stats.image_failures += 1;
        }
        self.stats.values_dropped += (total - kept.len()) as u64;
        self.stats.values_written += kept.len() as u64;
        let writer = match self.writer.as_mut() {
            Some(w) => w,
            None => {
                let id = self.next_id;
                self.next_id += 1;
                self.writer.insert(Writer::create(&self.shared.dir, id)?)
            }
        };
        for (lsn, kind, bytes) in kept {
            writer.push(w.key, lsn, kind, &bytes)?;
        }
        if writer.len + writer.buf.len() as u64 >= self.conf.layer_size {
            self.finish_output()?;
        }
        Ok(())
    }

    /// Seals the current output: index, footer, fdatasync, rename to its layer name.
    fn finish_output(&mut self) -> anyhow::Result<()> {
        let Some(mut w) = self.writer.take() else {
            return Ok(());
        };
        w.flush()?;
        let file_id = self.shared.next_file_id.fetch_add(1, Ordering::Relaxed);
        let size = layer::append_index_and_footer(&w.file, w.len, &w.entries)?;
        self.shared.metrics.fsync(|| w.file.sync_data()).context("fdatasync compaction output")?;
        let layer = Frozen::new(file_id, String::new(), Arc::new(w.file), w.entries, size)?;
        let name = layer::file_name(layer.first_lsn, layer.last_lsn, Some(w.id));
        std::fs::rename(&w.tmp, self.shared.dir.join(&name)).context("rename compaction output")?;
        let meta =
            LayerMeta { name: name.clone(), first_lsn: layer.first_lsn.0, last_lsn: layer.last_lsn.0, size };
        self.stats.bytes_written += size;
        self.stats.output_layers += 1;
        self.outputs.push(Output { meta, layer: Arc::new(Frozen { name, ..layer }) });
        Ok(())
    }

    /// Makes the outputs the timeline's layers in place of the inputs, then deletes the inputs.
    fn install(&mut self) -> anyhow::Result<PassStats> {
        self.finish_output()?;
        let sh = &self.shared;
        sh.metrics.fsync(|| self.dir_file.sync_all()).context("fsync timeline directory")?;
        let input_ids: Vec<u32> = self.inputs.iter().map(|l| l.id).collect();
        let outputs: Vec<Arc<Frozen>> = self.outputs.iter().map(|o| Arc::clone(&o.layer)).collect();
        // Checked before the manifest names the outputs; only this pass removes layers, so the
        // check still holds below.
        sh.index.read().unwrap_or_else(PoisonError::into_inner).replaced(&input_ids, &outputs)?;
        let inputs: Vec<String> = self.inputs.iter().map(|l| l.name.clone()).collect();
        let metas: Vec<LayerMeta> = self.outputs.iter().map(|o| o.meta.clone()).collect();
        let next_id = self.next_id;
        let installed = sh.update_manifest(&self.dir_file, |m| {
            m.layers.retain(|l| !inputs.contains(&l.name));
            m.layers.splice(0..0, metas);
            m.compacting = None;
            // Inputs of an earlier pass that could not be deleted stay listed with these.
            m.deleting.retain(|n| !inputs.contains(n));
            m.deleting.extend(inputs.iter().cloned());
            m.next_layer_id = m.next_layer_id.max(next_id);
        });
        if let Err(e) = installed {
            if RenamedNotSynced::is_in(&e) {
                // Logged once, as the timeline's fatal failure.
                self.outcome_unknown = true;
                return Err(e.context(
                    "install compaction outputs (outcome unknown: its inputs and outputs are both kept)",
                ));
            }
            return Err(e.context("install compaction outputs"));
        }
        self.installed = true;
        sh.index.write().unwrap_or_else(PoisonError::into_inner).replace_layers(&input_ids, &outputs)?;
        let (before, after) = (self.inputs.len() as u64, self.outputs.len() as u64);
        sh.layers.fetch_add(after, Ordering::Relaxed);
        sh.layers.fetch_sub(before, Ordering::Relaxed);
        sh.sealed_bytes.fetch_add(self.stats.bytes_written, Ordering::Relaxed);
        sh.sealed_bytes.fetch_sub(self.stats.bytes_before, Ordering::Relaxed);
        sh.metrics.layer_files.add(after as i64 - before as i64);
        self.inputs.clear();
        self.stats.files_deleted = delete_files(sh, &self.dir_file);
        Ok(self.stats.clone())
    }
}

impl Drop for Pass {
    /// A pass that ends without installing (an error, a shutdown) removes its files; its intent
    /// stays in the manifest, so a crash before this cleanup is cleaned up by recovery.
    fn drop(&mut self) {
        if self.installed || self.outcome_unknown {
            return;
        }
        let mut files: Vec<PathBuf> =
            self.outputs.iter().map(|o| self.shared.dir.join(&o.meta.name)).collect();
        files.extend(self.writer.as_ref().map(|w| w.tmp.clone()));
        for f in files {
            if let Err(e) = std::fs::remove_file(&f) {
                tracing::warn!(file = %f.display(), "could not remove an output of an unfinished compaction: {e}");
            }
        }
    }
}

/// Deletes the files the manifest lists in `deleting` (the inputs of installed passes) and
/// records the deletion; returns how many it deleted. A file that cannot be deleted stays
/// listed (logged), so that the next pass or the next open deletes it: dropped from the list,
/// it would be a file the manifest does not know, which stops the open.
fn delete_files(sh: &Shared, dir_file: &File) -> u64 {
    let names = sh.manifest.lock().unwrap_or_else(PoisonError::into_inner).deleting.clone();
    let mut gone = Vec::new();
    for name in names {
        match std::fs::remove_file(sh.dir.join(&name)) {
            Ok(()) => gone.push((name, true)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => gone.push((name, false)),
            Err(e) => {
                tracing::warn!(file = %name, "could not delete a compacted layer, deleting it later: {e}")
            }
        }
    }
    if gone.is_empty() {
        return 0;
    }
    let synced = sh.metrics.fsync(|| dir_file.sync_all()).context("fsync timeline directory");
    let recorded = synced.and_then(|()| {
        sh.update_manifest(dir_file, |m| m.deleting.retain(|n| !gone.iter().any(|(g, _)| g == n)))
    });
    if let Err(e) = recorded {
        sh.record_if_fatal(&e);
        tracing::warn!("could not record the deletion of compacted layers: {e:#}");
    }
    gone.iter().filter(|(_, deleted)| *deleted).count() as u64
}

/// The reads of `entries` (oldest first).
fn plan_of(entries: &[(Arc<File>, IndexEntry)]) -> ReadPlan {
    let mut picked = Picked::with_capacity(entries.len());
    for (f, e) in entries {
        picked.push(f, e);
    }
    ReadPlan::new(picked)
}

/// Reads the values of `entries` (oldest first), checking their checksums.
fn read_entries(entries: &[(Arc<File>, IndexEntry)]) -> anyhow::Result<Vec<(Lsn, Kind, Bytes)>> {
    plan_of(entries).execute_values()
}

impl Writer {
    fn create(dir: &std::path::Path, id: u64) -> anyhow::Result<Writer> {
        let tmp = dir.join(format!("{TMP_PREFIX}{id:016X}.tmp"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .with_context(|| format!("create {}", tmp.display()))?;
        file.write_all_at(&format::file_header(), 0).context("write compaction output header")?;
        Ok(Writer { id, tmp, file, len: FILE_HEADER_LEN, buf: Vec::new(), entries: Vec::new() })
    }

    fn push(&mut self, key: Key, lsn: Lsn, kind: Kind, bytes: &[u8]) -> anyhow::Result<()> {
        let offset = self.len + self.buf.len() as u64;
        let crc = crc32c::crc32c(bytes);
        self.entries.push(IndexEntry { key, lsn, kind, offset, len: bytes.len() as u32, crc });
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= WRITE_BUFFER {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> anyhow::Result<()> {
        self.file.write_all_at(&self.buf, self.len).context("write compaction output")?;
        self.len += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests;
