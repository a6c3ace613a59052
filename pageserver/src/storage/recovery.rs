//! Open-time recovery of a timeline directory: brings whatever a crash left (at any point of an
//! append or a seal) back to "the layers of the manifest + one active segment", checks the
//! directory against the manifest, and builds the in-memory index.
//!
//! Procedure (the normative text is in `docs/storage-format.md`):
//! 1. list the directory: `layer_*.layer`, `active.seg`, `manifest.json`, `lock`; a leftover
//!    temporary manifest is removed; anything else is logged and left alone;
//! 2. with a manifest that records a seal in progress, finish it (the layer was renamed into
//!    place: record it, new `active.seg`) or undo it (it was not: cut `active.seg` back to the
//!    frames the seal started from), and write the manifest;
//! 3. a layer listed but missing, a layer file not listed, or a missing `active.seg` is an
//!    error naming the file;
//! 4. open every layer (footer and index only), oldest first; a layer may overlap an older one
//!    in LSN range only if they share no key (the layer map's order, `index.rs`);
//! 5. scan `active.seg` frame by frame; the first incomplete or checksum-failing frame starts a
//!    torn tail, which is cut (truncate + fsync) and counted.
//!
//! A directory without a manifest (format version 1) is recovered as version 1 did (an
//! `active.seg` that is a complete layer is an interrupted seal; a missing one is created) and
//! then gets a manifest describing what it holds.
//!
//! **Invariants:** recovery only deletes bytes that were never acknowledged (a tail past the
//! last valid frame, or an interrupted seal's index); a checksummed frame or layer that makes
//! no sense is an error, not a tail to cut, because cutting it could lose acknowledged data;
//! with a manifest, whether a seal was in progress is read from the manifest, never guessed
//! from the bytes at the end of `active.seg` (those can be a client's value bytes).

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context};
use bytes::Bytes;
use page_types::Lsn;

use super::format::{self, FILE_HEADER_LEN, LOCK_NAME};
use super::index::Index;
use super::layer::{LayerName, Level};
use super::layer_map::Frozen;
use super::manifest::{self, LayerMeta, Manifest, MANIFEST_NAME, MANIFEST_TMP_NAME};
use super::residence::{Fetch, DOWNLOAD_PREFIX};
use super::segment::{self, open_data_file, read_at, ActiveSegment, ACTIVE_NAME};
use super::{compact, layer, StorageMetrics};

/// What recovery hands to the timeline.
pub(crate) struct Recovered {
    pub index: Index,
    pub segment: ActiveSegment,
    pub next_file_id: u32,
    pub last_lsn: Lsn,
    pub layers: u64,
    pub manifest: Manifest,
}

/// The timeline files found in a directory.
struct Listing {
    layers: Vec<String>,
    active: bool,
}

/// Recovers the timeline directory `dir` (already created and locked).
/// With `fetch`, a layer the manifest lists and the directory lacks is not resident
/// (`storage::residence`); without, it is an error.
pub(crate) fn recover(
    dir: &Path,
    dir_file: &File,
    metrics: &StorageMetrics,
    fetch: Option<&Arc<Fetch>>,
) -> anyhow::Result<Recovered> {
    let mut listing = list(dir)?;
    match manifest::read(dir)? {
        Some(mut m) => {
            resolve_seal(dir, dir_file, &mut m, &mut listing, metrics)?;
            resolve_compaction(dir, dir_file, &mut m, &mut listing, metrics, fetch.is_some())?;
            check_files(&m, &listing, fetch.is_some())?;
            let opened = open_layers(dir, &m.layers, &listing, fetch)?;
            let floor = opened.last_lsn.max(Lsn(m.active.base_lsn));
            let (segment, copies) = open_active(dir, dir_file, opened.next_file_id, floor, metrics)?;
            opened.finish(segment, copies, floor, m)
        }
        None => recover_v1(dir, dir_file, listing, metrics),
    }
}

/// [`super::create_from_copy`]: the manifest of a directory whose layer files were copied in
/// (each name parsed and its range checked against the listing), and an empty active segment.
pub(crate) fn create_from_copy(
    dir: &Path,
    files: &super::LayerFiles,
    metrics: &StorageMetrics,
) -> anyhow::Result<()> {
    let mut m = Manifest::empty();
    for l in &files.layers {
        let name =
            layer::parse_file_name(&l.name).with_context(|| format!("not a layer file name: {}", l.name))?;
        ensure!(
            (name.first, name.last) == (l.first_lsn, l.last_lsn),
            "layer {} is listed with LSNs {}..={}",
            l.name,
            l.first_lsn,
            l.last_lsn
        );
        m.layers.push(LayerMeta::new(&name, l.size, l.crc32c));
    }
    m.generation = files.generation;
    // Opening checks the rest (runs, LSN overlaps between layers that share keys).
    m.active = manifest::ActiveMeta { seq: 1, base_lsn: files.last_lsn().0 };
    m.gc_cutoff = files.gc_cutoff.0;
    let dir_file = File::open(dir).context("open timeline directory")?;
    ActiveSegment::create(dir, &dir_file, 0, metrics)?;
    manifest::write(dir, &dir_file, &mut m, metrics)
}

fn list(dir: &Path) -> anyhow::Result<Listing> {
    let mut listing = Listing { layers: Vec::new(), active: false };
    for entry in std::fs::read_dir(dir).context("list timeline directory")? {
        let entry = entry.context("list timeline directory")?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == ACTIVE_NAME {
            listing.active = true;
        } else if layer::parse_file_name(&name).is_some() {
            listing.layers.push(name.into_owned());
        } else if name.starts_with(compact::TMP_PREFIX) && name.ends_with(".tmp") {
            tracing::info!(file = %name, "removing an output of an unfinished compaction");
            std::fs::remove_file(entry.path()).context("remove unfinished compaction output")?;
        } else if name.starts_with(DOWNLOAD_PREFIX) {
            tracing::info!(file = %name, "removing an unfinished download");
            std::fs::remove_file(entry.path()).context("remove unfinished download")?;
        } else if name == MANIFEST_TMP_NAME {
            tracing::info!(file = %name, "removing a manifest that was never put in place");
            std::fs::remove_file(entry.path()).context("remove temporary manifest")?;
        } else if name != LOCK_NAME && name != MANIFEST_NAME {
            tracing::warn!(file = %name, "ignoring unknown file in timeline directory");
        }
    }
    Ok(listing)
}

/// Finishes or undoes the seal the manifest records as in progress, if any.
fn resolve_seal(
    dir: &Path,
    dir_file: &File,
    m: &mut Manifest,
    listing: &mut Listing,
    metrics: &StorageMetrics,
) -> anyhow::Result<()> {
    let Some(intent) = m.sealing.clone() else {
        return Ok(());
    };
    let name = &intent.layer.name;
    if listing.layers.contains(name) {
        // Renamed: the seal is done but for the new active segment and the manifest. Nothing is
        // appended to a new active.seg before the manifest records the seal, so one that exists
        // holds no data and is replaced.
        ActiveSegment::create(dir, dir_file, 0, metrics)?;
        listing.active = true;
        let file = File::open(dir.join(name)).with_context(|| format!("open {name}"))?;
        let crc = layer::file_crc(&file, intent.layer.size).with_context(|| format!("checksum {name}"))?;
        let mut done = m.with_seal_done(&intent, crc);
        manifest::write(dir, dir_file, &mut done, metrics).context("record the finished seal")?;
        *m = done;
        tracing::info!(layer = %name, "finished a seal interrupted by a crash");
        return Ok(());
    }
    ensure!(listing.active, "{ACTIVE_NAME} is missing while the manifest records the seal of {name}");
    let file = OpenOptions::new().write(true).open(dir.join(ACTIVE_NAME)).context("open active.seg")?;
    let len = file.metadata().context("stat active.seg")?.len();
    ensure!(
        len >= intent.data_len,
        "{ACTIVE_NAME} has {len} bytes, fewer than the {} its seal to {name} started from",
        intent.data_len
    );
    if len > intent.data_len {
        file.set_len(intent.data_len).context("cut the index of an interrupted seal")?;
        metrics.fsync(|| file.sync_all()).context("fsync active.seg")?;
    }
    m.sealing = None;
    manifest::write(dir, dir_file, m, metrics).context("record the undone seal")?;
    tracing::info!(layer = %name, "undid a seal interrupted by a crash; it will be sealed again");
    Ok(())
}

/// Removes what compaction left: the outputs of a pass that did not install (unlisted level 1
/// layers with a generation, or an older build's output number, from the intent's first on),
/// and the inputs of one that did (`deleting`), but those only while every layer the manifest
/// lists is there.
fn resolve_compaction(
    dir: &Path,
    dir_file: &File,
    m: &mut Manifest,
    listing: &mut Listing,
    metrics: &StorageMetrics,
    fetchable: bool,
) -> anyhow::Result<()> {
    if m.compacting.is_none() && m.deleting.is_empty() {
        return Ok(());
    }
    // The inputs hold what the outputs that replaced them hold: never delete them while a
    // listed layer is missing (the open fails, naming it, with the data still there).
    let missing: Vec<&str> =
        m.layers.iter().map(|l| l.name.as_str()).filter(|n| !listing.layers.iter().any(|f| f == n)).collect();
    // Missing layers may be evicted ones, which the bucket holds (`fetchable`): then the inputs
    // stay, still to be deleted, until a pass or an open finds every listed layer here.
    let keep_inputs = !missing.is_empty() && fetchable;
    if !missing.is_empty() && !m.deleting.is_empty() && !fetchable {
        bail!(
            "layer file {} listed in {MANIFEST_NAME} is missing; the compaction inputs it replaced are \
             kept ({})",
            missing.join(", "),
            m.deleting.join(", ")
        );
    }
    let intent = m.compacting.clone().unwrap_or_default();
    let leftover = |name: &String| {
        let unlisted = !m.layers.iter().any(|l| &l.name == name);
        let output = layer::parse_file_name(name).is_some_and(|n| {
            n.level == Level::Compacted
                && (matches!((n.generation, intent.first_generation), (Some(g), Some(first)) if g >= first)
                    || matches!((n.id, intent.first_layer_id), (Some(id), Some(first)) if id >= first))
        });
        unlisted && ((m.deleting.contains(name) && !keep_inputs) || output)
    };
    let (gone, kept): (Vec<String>, Vec<String>) = listing.layers.drain(..).partition(leftover);
    listing.layers = kept;
    for name in &gone {
        std::fs::remove_file(dir.join(name)).with_context(|| format!("remove compaction leftover {name}"))?;
        tracing::info!(file = %name, "removed a file compaction left behind");
    }
    metrics.fsync(|| dir_file.sync_all()).context("fsync timeline directory")?;
    m.compacting = None;
    if !keep_inputs {
        m.deleting.clear();
    }
    manifest::write(dir, dir_file, m, metrics).context("record the compaction cleanup")
}

/// Checks that the directory holds exactly the files the manifest lists (some of its layers
/// may be absent where they can be fetched: `fetchable`).
fn check_files(m: &Manifest, listing: &Listing, fetchable: bool) -> anyhow::Result<()> {
    for l in &m.layers {
        ensure!(
            fetchable || listing.layers.contains(&l.name),
            "layer file {} listed in {MANIFEST_NAME} is missing",
            l.name
        );
    }
    for name in &listing.layers {
        ensure!(
            m.layers.iter().any(|l| &l.name == name) || m.deleting.contains(name),
            "unexpected layer file {name}: it is not listed in {MANIFEST_NAME}"
        );
    }
    ensure!(
        listing.active,
        "{ACTIVE_NAME} is missing (the manifest lists active segment #{} above LSN {})",
        m.active.seq,
        Lsn(m.active.base_lsn)
    );
    Ok(())
}

/// Layers opened, oldest first.
struct OpenedLayers {
    layers: Vec<Frozen>,
    next_file_id: u32,
    last_lsn: Lsn,
    metas: Vec<LayerMeta>,
}

/// Opens the layers `metas` (in LSN order), checking each file's size against its entry; one
/// the directory lacks (`listing`) is not resident, fetched through `fetch` when read (at once
/// if its name does not carry its key range).
fn open_layers(
    dir: &Path,
    metas: &[LayerMeta],
    listing: &Listing,
    fetch: Option<&Arc<Fetch>>,
) -> anyhow::Result<OpenedLayers> {
    let mut o = OpenedLayers { layers: Vec::new(), next_file_id: 0, last_lsn: Lsn(0), metas: Vec::new() };
    for meta in metas {
        let id = o.next_file_id;
        // The last LSN: the footer's (for a layer not here, its manifest entry's, from its name,
        // which opening checks against the footer).
        let (frozen, last_lsn) = match fetch.filter(|_| !listing.layers.contains(&meta.name)) {
            Some(fetch) => {
                let f = match Frozen::non_resident(id, &meta.name, meta.size, meta.crc32c, fetch) {
                    Ok(f) => f,
                    Err(_) => Frozen::fetched(id, &meta.name, meta.size, meta.crc32c, fetch)?,
                };
                (f, Lsn(meta.last_lsn))
            }
            None => open_listed(dir, id, meta)?,
        };
        o.next_file_id += 1;
        o.last_lsn = o.last_lsn.max(last_lsn);
        o.layers.push(frozen);
        o.metas.push(meta.clone());
    }
    Ok(o)
}

/// Opens the layer file of `meta`, checking its size against the entry's; with its footer's last
/// LSN.
fn open_listed(dir: &Path, id: u32, meta: &LayerMeta) -> anyhow::Result<(Frozen, Lsn)> {
    let path = dir.join(&meta.name);
    let len = std::fs::metadata(&path).with_context(|| format!("stat layer {}", path.display()))?.len();
    ensure!(len == meta.size, "layer file {} has {len} bytes, {MANIFEST_NAME} says {}", meta.name, meta.size);
    let l = layer::open(&path).with_context(|| format!("open layer {}", path.display()))?;
    let last_lsn = l.last_lsn;
    let frozen = Frozen::opened(id, meta.name.clone(), l)
        .with_context(|| format!("index layer {}", path.display()))?;
    Ok((frozen, last_lsn))
}

impl OpenedLayers {
    /// The recovered timeline, with the active segment's record copies (`copies`, as
    /// [`Index::insert_active`] takes them).
    fn finish(
        self,
        segment: ActiveSegment,
        copies: Bytes,
        floor: Lsn,
        manifest: Manifest,
    ) -> anyhow::Result<Recovered> {
        let mut index = Index::new(segment.file_id, segment.file.clone());
        for layer in self.layers {
            let name = layer.name.clone();
            index.push_layer(layer).with_context(|| format!("index layer {name}"))?;
        }
        index.insert_active(&segment.entries, copies).context("index active segment")?;
        let last_lsn = segment.lsn_range().map_or(floor, |(_, last)| last);
        Ok(Recovered {
            index,
            segment,
            next_file_id: self.next_file_id + 1,
            last_lsn,
            layers: self.metas.len() as u64,
            manifest,
        })
    }
}

/// Recovers a directory without a manifest (format version 1, or a new timeline) and writes
/// its first manifest.
fn recover_v1(
    dir: &Path,
    dir_file: &File,
    mut listing: Listing,
    metrics: &StorageMetrics,
) -> anyhow::Result<Recovered> {
    refuse_lost_manifest(dir, &listing)?;
    if listing.active {
        if let Some(name) = finish_interrupted_seal(dir, &dir.join(ACTIVE_NAME), dir_file, metrics)? {
            listing.layers.push(name);
            listing.active = false;
        }
    }
    let mut metas = Vec::new();
    for name in &listing.layers {
        let parsed = layer::parse_file_name(name).context("parse layer name")?;
        let size = std::fs::metadata(dir.join(name)).with_context(|| format!("stat {name}"))?.len();
        metas.push(LayerMeta { name: name.clone(), ..LayerMeta::new(&parsed, size, None) });
    }
    metas.sort_by_key(|l| l.first_lsn);
    let opened = open_layers(dir, &metas, &listing, None)?;
    let (segment, copies) = match listing.active {
        true => open_active(dir, dir_file, opened.next_file_id, opened.last_lsn, metrics)?,
        false => (ActiveSegment::create(dir, dir_file, opened.next_file_id, metrics)?, Bytes::new()),
    };
    let mut m = Manifest::empty();
    m.layers = metas;
    m.active.base_lsn = opened.last_lsn.0;
    let first_open = m.layers.is_empty() && segment.entries.is_empty();
    manifest::write(dir, dir_file, &mut m, metrics).context("write the first manifest")?;
    if !first_open {
        tracing::info!(layers = m.layers.len(), "wrote a manifest for a version 1 timeline directory");
    }
    let floor = opened.last_lsn;
    opened.finish(segment, copies, floor, m)
}

/// Fails if a file of the directory was written next to a manifest (format version 2 or 3): then the
/// manifest was lost, and the listing alone cannot show what else is missing. One exception: an
/// `active.seg` holding nothing but its header and no layers is a new timeline whose first open
/// stopped before its manifest was written.
fn refuse_lost_manifest(dir: &Path, listing: &Listing) -> anyhow::Result<()> {
    let active = listing.active.then_some(ACTIVE_NAME);
    for name in listing.layers.iter().map(String::as_str).chain(active) {
        let Ok(file) = File::open(dir.join(name)) else {
            continue;
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let mut header = [0u8; FILE_HEADER_LEN as usize];
        let version = match read_at(&file, &mut header, 0) {
            Ok(()) => format::check_file_header(&header).unwrap_or(0),
            Err(_) => 0,
        };
        let new_timeline = name == ACTIVE_NAME && listing.layers.is_empty() && len <= FILE_HEADER_LEN;
        if version >= 2 && !new_timeline {
            bail!(
                "{MANIFEST_NAME} is missing, but {name} was written with one (format version {version}): \
                 restore the manifest; the directory alone cannot show which files are gone"
            );
        }
    }
    Ok(())
}

/// If `active.seg` at `path` already is a complete layer (a sealed segment: frames, then an
/// index of exactly those frames, then a footer), finishes its seal (fsync, rename, fsync
/// directory) and returns the layer's file name. Version 1 directories only: with a manifest,
/// the seal intent says whether a seal was in progress.
fn finish_interrupted_seal(
    dir: &Path,
    path: &Path,
    dir_file: &File,
    metrics: &StorageMetrics,
) -> anyhow::Result<Option<String>> {
    let file = open_data_file(OpenOptions::new().read(true).write(true), path).context("open active.seg")?;
    let len = file.metadata().context("stat active.seg")?.len();
    let mut header = [0u8; FILE_HEADER_LEN as usize];
    if len < FILE_HEADER_LEN || read_at(&file, &mut header, 0).is_err() {
        return Ok(None);
    }
    let Ok(footer) = layer::read_footer(&file, len) else {
        return Ok(None);
    };
    if format::check_file_header(&header).is_err() {
        return Ok(None);
    }
    let Ok(index) = layer::read_index(&file, &footer) else {
        return Ok(None);
    };
    if !is_sealed_segment(&file, &footer, index) {
        tracing::info!("active.seg ends in bytes that parse as a layer footer inside a frame: not a seal");
        return Ok(None);
    }
    let name = layer::file_name(&LayerName::older_seal(footer.first_lsn, footer.last_lsn));
    let target: PathBuf = dir.join(&name);
    ensure!(!target.exists(), "interrupted seal of {name}, but that layer already exists");
    metrics.fsync(|| file.sync_all()).context("fsync interrupted layer")?;
    std::fs::rename(path, &target).context("rename interrupted layer")?;
    metrics.fsync(|| dir_file.sync_all()).context("fsync timeline directory")?;
    tracing::info!(layer = %name, "finished a seal interrupted by a crash");
    Ok(Some(name))
}

/// Whether a segment whose end parses as `footer` and `index` really is a sealed segment: its
/// frames end exactly where the index starts, and the index lists exactly their values. Bytes
/// inside a frame (a client's value) can parse as a footer, but then the index offset they
/// claim lies inside that frame, so the frames do not end there.
fn is_sealed_segment(file: &File, footer: &layer::FlatFooter, mut index: Vec<format::IndexEntry>) -> bool {
    let Ok(scan) = segment::scan(file, footer.index_offset, Lsn(0), false) else {
        return false;
    };
    let mut frames = scan.entries;
    frames.sort_by_key(|e| (e.key, e.lsn));
    index.sort_by_key(|e| (e.key, e.lsn));
    scan.torn.is_none() && scan.valid_len == footer.index_offset && frames == index
}

/// Opens and scans the existing `active.seg` of `dir`, cutting a torn tail; every value in it
/// must be above `last_lsn`. With the segment, the copies of its small records to index.
fn open_active(
    dir: &Path,
    dir_file: &File,
    file_id: u32,
    last_lsn: Lsn,
    metrics: &StorageMetrics,
) -> anyhow::Result<(ActiveSegment, Bytes)> {
    let path = dir.join(ACTIVE_NAME);
    let file = open_data_file(OpenOptions::new().read(true).write(true), &path).context("open active.seg")?;
    let len = file.metadata().context("stat active.seg")?.len();
    let mut header = [0u8; FILE_HEADER_LEN as usize];
    let header_ok = len >= FILE_HEADER_LEN
        && read_at(&file, &mut header, 0).is_ok()
        && format::check_file_header(&header).is_ok();
    if !header_ok {
        if len > FILE_HEADER_LEN {
            bail!("active.seg has a bad header and {len} bytes: not a torn creation");
        }
        tracing::warn!(len, "recreating active.seg with a torn header");
        drop(file);
        return Ok((ActiveSegment::create(dir, dir_file, file_id, metrics)?, Bytes::new()));
    }
    let scan = segment::scan(&file, len, last_lsn, true).context("scan active.seg")?;
    if let Some(why) = &scan.torn {
        let cut = len - scan.valid_len;
        tracing::warn!(
            valid_len = scan.valid_len, cut_bytes = cut, reason = %why,
            "cutting torn tail of active.seg"
        );
        file.set_len(scan.valid_len).context("truncate torn tail")?;
        metrics.fsync(|| file.sync_all()).context("fsync truncated active.seg")?;
        metrics.torn_tail_truncations.inc();
    }
    let segment = ActiveSegment {
        file: Arc::new(file),
        file_id,
        len: scan.valid_len,
        entries: scan.entries,
        crc: scan.crc,
    };
    Ok((segment, Bytes::from(scan.copies)))
}

#[cfg(test)]
mod tests;
