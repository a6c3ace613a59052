//! From the archives of a PostgreSQL 15 base backup to the tenant's values: which file is
//! what ([`classify_path`]), and an [`Importer`] that turns the archives' bytes into
//! `(BufferTag, Bytes)` values of the key space of `page_types::keys`, in bounded batches,
//! with the size of every relation fork at the end.
//!
//! **What is imported:**
//! - relation segments: `global/<relnode>` (tablespace 1664 `pg_global`, database 0),
//!   `base/<db>/<relnode>[_fsm|_vm|_init][.<segno>]` (1663 `pg_default`), and in the archive of
//!   tablespace `<oid>` (`<oid>.tar`), `PG_15_<catversion>/<db>/<relnode>...`; each 8 KiB block
//!   is the value of `rel.page(fork, segno * 131072 + i)`;
//! - SLRU segments `pg_xact/XXXX`, `pg_multixact/offsets/XXXX`, `pg_multixact/members/XXXX`
//!   (4 to 6 upper-case hex digits): page `i` is `keys::slru_page_key(kind, segno, i)`;
//! - `global/pg_control` (8192 bytes) and the relation mapper files `pg_filenode.map` (512
//!   bytes: the shared one in `global/`, a database's own in its directory);
//! - the configuration files of the data directory's root (`keys::CONFIG_FILES`:
//!   `postgresql.conf`, `postgresql.auto.conf`, `pg_hba.conf`, `pg_ident.conf`, at most
//!   `keys::CONFIG_FILE_MAX_BYTES` each), in 8 KiB chunks ending with a shorter one, for the
//!   base backups built from the tenant;
//! - the state files of prepared transactions, `pg_twophase/<xid>` (8 upper-case hex digits, at
//!   most [`TWO_PHASE_FILE_MAX_BYTES`]), in 8 KiB chunks the same way (`keys::two_phase_key`): a
//!   transaction prepared before the backup's checkpoint is there, one prepared after it comes
//!   with the WAL (`ingest::twophase`);
//! - at [`Importer::finish`], the size of each relation fork seen: the highest segment's
//!   number times 131072 plus its whole blocks.
//!
//! **What is skipped, and why:** `pg_wal/` (asked without WAL: it comes by streaming from the
//! backup's start), `backup_label` and `tablespace_map` (the start position comes from the
//! protocol, the tablespaces from the archives), `pg_internal.init` (a relcache cache,
//! rebuilt at start), temporary relations (`t<backend>_<relnode>`) and `pgsql_tmp`, `PG_VERSION`,
//! other configuration files (included ones, in `conf.d/`), logs, the
//! directories PostgreSQL sends empty (`pg_stat_tmp`, `pg_replslot`, `pg_dynshmem`,
//! `pg_notify`, `pg_serial`, `pg_snapshots`, `pg_subtrans`), and the state that this key space
//! does not hold yet: `pg_commit_ts/`, `pg_logical/`,
//! `pg_stat/`. The server itself leaves out the non-init forks of unlogged relations.
//!
//! **Partial blocks:** the server writes each file's size as `stat()` saw it before reading
//! (`basebackup.c`, `sendFile`): a file that shrinks meanwhile is padded with zeros, one that
//! grows is cut at that size, and both are made right by WAL replay from the backup's start.
//! A relation being extended at that moment can therefore show a size that is not a multiple
//! of 8192 (an extension's `pwrite` half done). PostgreSQL counts only whole blocks
//! (`mdnblocks`), so the importer does the same: the partial tail is dropped (counted in
//! [`ImportProgress::partial_tails`]), and the WAL that extended the file re-creates the block.
//!
//! Invariants: pure, no I/O; nothing panics on any input (paths and archives are the
//! server's); a batch holds at most [`BATCH_VALUES`] values; every value is a whole block
//! (8192 bytes), a whole control file or a whole mapper file, or a relation size.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use page_types::keys::{self, RelTag, SlruKind};
use page_types::{BufferTag, PAGE_SIZE};

use super::tar::{TarError, TarEvent, TarReader};

/// Most values in one batch of [`Importer::next_batch`].
pub const BATCH_VALUES: usize = 256;
/// The largest prepared transaction's state file imported (PostgreSQL's own bound is 1 GiB; a
/// transaction with a hundred thousand locks writes a few MiB).
pub const TWO_PHASE_FILE_MAX_BYTES: u64 = 64 << 20;
/// Blocks in a relation segment file (`RELSEG_SIZE`, 1 GiB).
pub const RELSEG_BLOCKS: u32 = 131_072;
/// `pg_global` and `pg_default`.
pub const GLOBALTABLESPACE_OID: u32 = 1664;
pub const DEFAULTTABLESPACE_OID: u32 = 1663;
/// A tablespace's directory for PostgreSQL 15 starts with this (then the catalog version).
const TABLESPACE_VERSION_PREFIX: &str = "PG_15_";

/// What a file of a base backup is to the importer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportFile {
    /// Segment `segno` of fork `fork` of `rel`.
    RelSegment { rel: RelTag, fork: u8, segno: u32 },
    /// Segment `segno` of an SLRU.
    Slru { kind: SlruKind, segno: u32 },
    /// `global/pg_control`.
    ControlFile,
    /// A relation mapper file (`pg_filenode.map`).
    RelMap { spc: u32, db: u32 },
    /// Configuration file `index` of `keys::CONFIG_FILES`.
    Config { index: u32 },
    /// The state file of the prepared transaction `xid`.
    TwoPhase { xid: u32 },
    /// Not imported (see the module doc).
    Skip,
}

impl ImportFile {
    /// A short name of the class: `rel`, `slru`, `control`, `relmap`, `config`, `twophase`, `skip`.
    pub fn class(&self) -> &'static str {
        match self {
            ImportFile::RelSegment { .. } => "rel",
            ImportFile::Slru { .. } => "slru",
            ImportFile::ControlFile => "control",
            ImportFile::RelMap { .. } => "relmap",
            ImportFile::Config { .. } => "config",
            ImportFile::TwoPhase { .. } => "twophase",
            ImportFile::Skip => "skip",
        }
    }
}

/// What a file at `path` in an archive is. `archive_location` is the tablespace's location
/// (`None` for the main data directory, `base.tar`) and `spcoid` the tablespace's oid (used
/// only for a tablespace's archive; `None` there makes everything in it skipped).
pub fn classify_path(archive_location: Option<&str>, spcoid: Option<u32>, path: &str) -> ImportFile {
    let parts: Vec<&str> = path.split('/').collect();
    if archive_location.is_some() {
        // PG_15_<catversion>/<db>/<file>
        let Some(spc) = spcoid else { return ImportFile::Skip };
        return match parts.as_slice() {
            [version, db, file] if is_tablespace_version_dir(version) => match parse_oid(db) {
                Some(db) => db_file(spc, db, file),
                None => ImportFile::Skip,
            },
            _ => ImportFile::Skip,
        };
    }
    match parts.as_slice() {
        ["global", "pg_control"] => ImportFile::ControlFile,
        [file] => match keys::CONFIG_FILES.iter().position(|name| name == file) {
            Some(index) => ImportFile::Config { index: index as u32 },
            None => ImportFile::Skip,
        },
        ["global", file] => db_file(GLOBALTABLESPACE_OID, 0, file),
        ["base", db, file] => match parse_oid(db) {
            Some(db) => db_file(DEFAULTTABLESPACE_OID, db, file),
            None => ImportFile::Skip,
        },
        ["pg_xact", seg] => slru(SlruKind::Clog, seg),
        ["pg_twophase", name]
            if name.len() == 8 && name.bytes().all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b)) =>
        {
            match u32::from_str_radix(name, 16) {
                Ok(xid) if xid != 0 => ImportFile::TwoPhase { xid },
                _ => ImportFile::Skip,
            }
        }
        ["pg_multixact", "offsets", seg] => slru(SlruKind::MultiXactOffsets, seg),
        ["pg_multixact", "members", seg] => slru(SlruKind::MultiXactMembers, seg),
        _ => ImportFile::Skip,
    }
}

fn is_tablespace_version_dir(name: &str) -> bool {
    name.strip_prefix(TABLESPACE_VERSION_PREFIX)
        .is_some_and(|cat| !cat.is_empty() && cat.bytes().all(|b| b.is_ascii_digit()))
}

/// A file in a database's directory (or `global/`): the mapper file or a relation segment.
fn db_file(spc: u32, db: u32, file: &str) -> ImportFile {
    if file == "pg_filenode.map" {
        return ImportFile::RelMap { spc, db };
    }
    match parse_rel_file(file) {
        Some((relnode, fork, segno)) => {
            ImportFile::RelSegment { rel: RelTag { spcnode: spc, dbnode: db, relnode }, fork, segno }
        }
        None => ImportFile::Skip,
    }
}

/// `<relnode>[_fsm|_vm|_init][.<segno>]`, as PostgreSQL's `parse_filename_for_nontemp_relation`
/// takes it (temporary relations, `t<n>_<relnode>`, are not matched).
fn parse_rel_file(file: &str) -> Option<(u32, u8, u32)> {
    let (stem, segno) = match file.split_once('.') {
        Some((stem, seg)) => (stem, parse_decimal(seg)?),
        None => (file, 0),
    };
    if segno == 0 && file.contains('.') {
        return None; // segment 0 has no suffix
    }
    if segno > u32::MAX / RELSEG_BLOCKS {
        return None; // its blocks would be past the largest block number
    }
    let (relnode, fork) = match stem.split_once('_') {
        Some((rel, "fsm")) => (rel, keys::FSM_FORK),
        Some((rel, "vm")) => (rel, keys::VM_FORK),
        Some((rel, "init")) => (rel, keys::INIT_FORK),
        Some(_) => return None,
        None => (stem, keys::MAIN_FORK),
    };
    Some((parse_oid(relnode)?, fork, segno))
}

/// A positive decimal number without leading zeros that fits a `u32`.
fn parse_decimal(s: &str) -> Option<u32> {
    if s.is_empty() || s.len() > 10 || s.starts_with('0') || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// An oid: a positive decimal number.
fn parse_oid(s: &str) -> Option<u32> {
    parse_decimal(s)
}

fn slru(kind: SlruKind, seg: &str) -> ImportFile {
    let hex =
        (4..=6).contains(&seg.len()) && seg.bytes().all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b));
    match (hex, u32::from_str_radix(seg, 16)) {
        (true, Ok(segno)) => ImportFile::Slru { kind, segno },
        _ => ImportFile::Skip,
    }
}

/// A malformed archive or a file that cannot be what its path says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImportError {
    #[error("archive {archive}: {source}")]
    Tar {
        archive: String,
        #[source]
        source: TarError,
    },
    #[error("archive {archive}: {path} is {size} bytes, {want}")]
    FileSize { archive: String, path: String, size: u64, want: &'static str },
    #[error("archive {name}: a tablespace archive is named <oid>.tar")]
    ArchiveName { name: String },
    #[error("archive data before any archive began")]
    NoArchive,
}

/// How far an import is, for a status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportProgress {
    pub archives: u64,
    /// Regular files seen, and those of them skipped.
    pub files: u64,
    pub skipped_files: u64,
    /// Archive bytes read (headers and padding included).
    pub bytes: u64,
    /// Values made, by kind.
    pub rel_pages: u64,
    pub slru_pages: u64,
    pub control_files: u64,
    pub relmaps: u64,
    pub config_files: u64,
    pub two_phase_files: u64,
    pub rel_sizes: u64,
    /// Relation and SLRU files whose size was not whole blocks (the tail was dropped).
    pub partial_tails: u64,
}

/// A regular file as the importer saw it (for listings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedFile {
    pub archive: String,
    pub path: String,
    pub size: u64,
    pub class: ImportFile,
}

struct Archive {
    name: String,
    location: Option<String>,
    spcoid: Option<u32>,
    tar: TarReader,
    /// Archive bytes already counted in the progress.
    counted: u64,
}

/// The file being read.
struct Current {
    class: ImportFile,
    /// The next block (or page) number in the file.
    next_block: u32,
    /// Bytes of an incomplete block (or of a whole small file) carried over between chunks.
    carry: BytesMut,
}

/// Turns a base backup's archives into values. Call [`Importer::begin_archive`] at each
/// archive, [`Importer::feed`] its bytes, then [`Importer::next_batch`] until `None` before
/// feeding more; [`Importer::finish`] at the end.
pub struct Importer {
    archive: Option<Archive>,
    current: Option<Current>,
    out: Vec<(BufferTag, Bytes)>,
    /// Blocks of each relation fork seen.
    sizes: BTreeMap<(RelTag, u8), u32>,
    progress: ImportProgress,
    listing: Option<Vec<ImportedFile>>,
}

impl Default for Importer {
    fn default() -> Self {
        Self::new()
    }
}

impl Importer {
    pub fn new() -> Importer {
        Importer {
            archive: None,
            current: None,
            out: Vec::new(),
            sizes: BTreeMap::new(),
            progress: ImportProgress::default(),
            listing: None,
        }
    }

    /// Keeps a list of every regular file seen ([`Importer::take_listing`]).
    pub fn with_listing(mut self) -> Importer {
        self.listing = Some(Vec::new());
        self
    }

    /// The files seen since the last call (empty without [`Importer::with_listing`]).
    pub fn take_listing(&mut self) -> Vec<ImportedFile> {
        self.listing.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn progress(&self) -> &ImportProgress {
        &self.progress
    }

    /// A new archive begins (`base.tar` with no location, or `<oid>.tar` with the
    /// tablespace's location); the previous one must have ended properly.
    pub fn begin_archive(&mut self, name: &str, location: Option<&str>) -> Result<(), ImportError> {
        self.end_archive()?;
        let spcoid = match location {
            None => None,
            Some(_) => Some(
                name.strip_suffix(".tar")
                    .and_then(parse_oid)
                    .ok_or_else(|| ImportError::ArchiveName { name: name.to_string() })?,
            ),
        };
        self.archive = Some(Archive {
            name: name.to_string(),
            location: location.map(str::to_string),
            spcoid,
            tar: TarReader::new(),
            counted: 0,
        });
        self.progress.archives += 1;
        Ok(())
    }

    /// Bytes of the current archive.
    pub fn feed(&mut self, data: &[u8]) -> Result<(), ImportError> {
        let archive = self.archive.as_mut().ok_or(ImportError::NoArchive)?;
        archive.tar.feed(data);
        Ok(())
    }

    /// The next batch of values (at most [`BATCH_VALUES`]), `None` when the bytes fed so far
    /// give no more.
    pub fn next_batch(&mut self) -> Result<Option<Vec<(BufferTag, Bytes)>>, ImportError> {
        while self.out.len() < BATCH_VALUES {
            match self.next_event()? {
                Some(event) => self.event(event)?,
                None => break,
            }
        }
        if self.out.is_empty() {
            return Ok(None);
        }
        let n = self.out.len().min(BATCH_VALUES);
        let rest = self.out.split_off(n);
        Ok(Some(std::mem::replace(&mut self.out, rest)))
    }

    /// The backup ended: checks the last archive ended, and returns the size of every
    /// relation fork seen (one value per fork, after any values not yet taken).
    pub fn finish(&mut self) -> Result<Vec<(BufferTag, Bytes)>, ImportError> {
        self.end_archive()?;
        let mut out = std::mem::take(&mut self.out);
        for ((rel, fork), blocks) in std::mem::take(&mut self.sizes) {
            out.push((rel.size_key(fork), Bytes::from(keys::encode_rel_size(Some(blocks)))));
            self.progress.rel_sizes += 1;
        }
        Ok(out)
    }

    fn end_archive(&mut self) -> Result<(), ImportError> {
        // Events still buffered (a caller that did not drain) go to the next values.
        while let Some(event) = self.next_event()? {
            self.event(event)?;
        }
        if let Some(mut archive) = self.archive.take() {
            archive.tar.finish().map_err(|source| ImportError::Tar { archive: archive.name, source })?;
        }
        Ok(())
    }

    /// The next event of the current archive, counting the bytes it consumed.
    fn next_event(&mut self) -> Result<Option<TarEvent>, ImportError> {
        let Some(archive) = self.archive.as_mut() else { return Ok(None) };
        let event = archive.tar.next();
        let offset = archive.tar.offset();
        self.progress.bytes += offset.saturating_sub(archive.counted);
        archive.counted = offset;
        event.map_err(|source| ImportError::Tar { archive: archive.name.clone(), source })
    }

    fn event(&mut self, event: TarEvent) -> Result<(), ImportError> {
        let Some(archive) = self.archive.as_ref() else { return Err(ImportError::NoArchive) };
        match event {
            TarEvent::Other(_) => Ok(()),
            TarEvent::File { path, size } => {
                let class = classify_path(archive.location.as_deref(), archive.spcoid, &path);
                self.progress.files += 1;
                if class == ImportFile::Skip {
                    self.progress.skipped_files += 1;
                }
                let bad = |want| ImportError::FileSize {
                    archive: archive.name.clone(),
                    path: path.clone(),
                    size,
                    want,
                };
                match class {
                    ImportFile::RelSegment { .. } if size > u64::from(RELSEG_BLOCKS) * PAGE_SIZE as u64 => {
                        return Err(bad("more than a relation segment (1 GiB)"))
                    }
                    ImportFile::Slru { .. }
                        if size > u64::from(keys::SLRU_PAGES_PER_SEGMENT) * PAGE_SIZE as u64 =>
                    {
                        return Err(bad("more than an SLRU segment (32 pages)"))
                    }
                    ImportFile::ControlFile if size != keys::CONTROL_FILE_SIZE as u64 => {
                        return Err(bad("not a control file (8192 bytes)"))
                    }
                    ImportFile::RelMap { .. } if size != keys::RELMAP_FILE_SIZE as u64 => {
                        return Err(bad("not a relation mapper file (512 bytes)"))
                    }
                    ImportFile::Config { .. } if size > keys::CONFIG_FILE_MAX_BYTES as u64 => {
                        return Err(bad("more than a configuration file is kept (1 MiB)"))
                    }
                    ImportFile::TwoPhase { .. } if size > TWO_PHASE_FILE_MAX_BYTES => {
                        return Err(bad("more than a prepared transaction's state file is kept (64 MiB)"))
                    }
                    _ => {}
                }
                if let Some(listing) = self.listing.as_mut() {
                    listing.push(ImportedFile { archive: archive.name.clone(), path, size, class });
                }
                self.current = Some(Current { class, next_block: 0, carry: BytesMut::new() });
                Ok(())
            }
            TarEvent::Data(mut data) => {
                let Some(cur) = self.current.as_mut() else { return Ok(()) };
                match cur.class {
                    ImportFile::Skip => {}
                    ImportFile::ControlFile
                    | ImportFile::RelMap { .. }
                    | ImportFile::Config { .. }
                    | ImportFile::TwoPhase { .. } => cur.carry.extend_from_slice(&data),
                    ImportFile::RelSegment { .. } | ImportFile::Slru { .. } => {
                        // Complete the carried block, then whole blocks without a copy.
                        if !cur.carry.is_empty() {
                            let n = (PAGE_SIZE - cur.carry.len()).min(data.len());
                            cur.carry.extend_from_slice(&data.split_to(n));
                            if cur.carry.len() == PAGE_SIZE {
                                let block = std::mem::take(&mut cur.carry).freeze();
                                push_block(&mut self.out, &mut self.progress, cur, block);
                            }
                        }
                        while data.len() >= PAGE_SIZE {
                            let block = data.split_to(PAGE_SIZE);
                            push_block(&mut self.out, &mut self.progress, cur, block);
                        }
                        if !data.is_empty() {
                            cur.carry.extend_from_slice(&data);
                        }
                    }
                }
                Ok(())
            }
            TarEvent::FileEnd => {
                let Some(cur) = self.current.take() else { return Ok(()) };
                match cur.class {
                    ImportFile::Skip => {}
                    ImportFile::ControlFile => {
                        self.out.push((keys::control_file_key(), cur.carry.freeze()));
                        self.progress.control_files += 1;
                    }
                    ImportFile::RelMap { spc, db } => {
                        self.out.push((keys::relmap_key(spc, db), cur.carry.freeze()));
                        self.progress.relmaps += 1;
                    }
                    ImportFile::Config { index } => {
                        let file = cur.carry.freeze();
                        for (chunk, part) in (0u32..).zip(super::twophase::chunks(&file)) {
                            self.out.push((keys::config_file_key(index, chunk), file.slice(part)));
                        }
                        self.progress.config_files += 1;
                    }
                    ImportFile::TwoPhase { xid } => {
                        let file = cur.carry.freeze();
                        for (chunk, part) in (0u32..).zip(super::twophase::chunks(&file)) {
                            self.out.push((keys::two_phase_key(xid, chunk), file.slice(part)));
                        }
                        self.progress.two_phase_files += 1;
                    }
                    ImportFile::RelSegment { rel, fork, segno } => {
                        if !cur.carry.is_empty() {
                            self.progress.partial_tails += 1;
                        }
                        // segno < 32768 (parse_rel_file) and next_block <= RELSEG_BLOCKS.
                        let blocks = segno.saturating_mul(RELSEG_BLOCKS).saturating_add(cur.next_block);
                        let size = self.sizes.entry((rel, fork)).or_insert(0);
                        *size = (*size).max(blocks);
                    }
                    ImportFile::Slru { .. } => {
                        if !cur.carry.is_empty() {
                            self.progress.partial_tails += 1;
                        }
                    }
                }
                Ok(())
            }
        }
    }
}

/// The value of the next whole block of the current relation or SLRU segment.
fn push_block(
    out: &mut Vec<(BufferTag, Bytes)>,
    progress: &mut ImportProgress,
    cur: &mut Current,
    block: Bytes,
) {
    let i = cur.next_block;
    cur.next_block = cur.next_block.saturating_add(1);
    match cur.class {
        ImportFile::RelSegment { rel, fork, segno } => {
            out.push((rel.page(fork, segno.saturating_mul(RELSEG_BLOCKS).saturating_add(i)), block));
            progress.rel_pages += 1;
        }
        ImportFile::Slru { kind, segno } => {
            out.push((keys::slru_page_key(kind, segno, i), block));
            progress.slru_pages += 1;
        }
        ImportFile::ControlFile
        | ImportFile::RelMap { .. }
        | ImportFile::Config { .. }
        | ImportFile::TwoPhase { .. }
        | ImportFile::Skip => {}
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::tar::testtar;
    use super::*;
    use proptest::prelude::*;

    const DB: u32 = 5;

    fn rel(spc: u32, db: u32, relnode: u32) -> RelTag {
        RelTag { spcnode: spc, dbnode: db, relnode }
    }

    #[test]
    fn paths_of_a_data_directory_classify_as_postgres_lays_them_out() {
        let main = |p: &str| classify_path(None, None, p);
        let seg = |spc, db, relnode, fork, segno| ImportFile::RelSegment {
            rel: rel(spc, db, relnode),
            fork,
            segno,
        };
        assert_eq!(main("global/1262"), seg(1664, 0, 1262, keys::MAIN_FORK, 0));
        assert_eq!(main("global/pg_control"), ImportFile::ControlFile);
        assert_eq!(main("global/pg_filenode.map"), ImportFile::RelMap { spc: 1664, db: 0 });
        assert_eq!(main("global/pg_internal.init"), ImportFile::Skip);
        assert_eq!(main("base/5/16384"), seg(1663, 5, 16384, keys::MAIN_FORK, 0));
        assert_eq!(main("base/5/16384.2"), seg(1663, 5, 16384, keys::MAIN_FORK, 2));
        assert_eq!(main("base/5/16384_fsm"), seg(1663, 5, 16384, keys::FSM_FORK, 0));
        assert_eq!(main("base/5/16384_vm.1"), seg(1663, 5, 16384, keys::VM_FORK, 1));
        assert_eq!(main("base/5/16384_init"), seg(1663, 5, 16384, keys::INIT_FORK, 0));
        assert_eq!(main("base/5/pg_filenode.map"), ImportFile::RelMap { spc: 1663, db: 5 });
        assert_eq!(main("pg_xact/0000"), ImportFile::Slru { kind: SlruKind::Clog, segno: 0 });
        assert_eq!(
            main("pg_multixact/offsets/0A1B2"),
            ImportFile::Slru { kind: SlruKind::MultiXactOffsets, segno: 0xA1B2 }
        );
        assert_eq!(
            main("pg_multixact/members/FFFFFF"),
            ImportFile::Slru { kind: SlruKind::MultiXactMembers, segno: 0xFFFFFF }
        );
        let ts = |p: &str| classify_path(Some("/srv/ts"), Some(16385), p);
        assert_eq!(ts("PG_15_202209061/5/16400"), seg(16385, 5, 16400, keys::MAIN_FORK, 0));
        assert_eq!(ts("PG_15_202209061/5/16400_vm"), seg(16385, 5, 16400, keys::VM_FORK, 0));
        assert_eq!(ts("PG_15_202209061/5/pg_filenode.map"), ImportFile::RelMap { spc: 16385, db: 5 });
        for skipped in [
            "backup_label",
            "tablespace_map",
            "PG_VERSION",
            "conf.d/extra.conf",
            "postgresql.conf.bak",
            "pg_wal/000000010000000000000001",
            "base/5/PG_VERSION",
            "base/5/pg_internal.init",
            "base/5/t3_16384",
            "base/5/16384.0",
            "base/5/016384",
            "base/5/16384_xyz",
            "base/5/16384.32768",
            "base/5/99999999999",
            "base/pgsql_tmp/pgsql_tmp1.0",
            "base/x/16384",
            "global/1262/extra",
            "pg_xact/000",
            "pg_xact/0000000",
            "pg_xact/00g0",
            "pg_xact/00a0",
            "pg_commit_ts/0000",
            "pg_twophase/00000300.tmp",
            "pg_twophase/00000000",
            "pg_tblspc/16385",
        ] {
            assert_eq!(main(skipped), ImportFile::Skip, "{skipped}");
        }
        assert_eq!(ts("PG_16_202307071/5/16400"), ImportFile::Skip);
        assert_eq!(ts("PG_15_202209061/5/16400/x"), ImportFile::Skip);
        assert_eq!(classify_path(Some("/srv/ts"), None, "PG_15_202209061/5/16400"), ImportFile::Skip);
    }

    fn block(tag: u8) -> Vec<u8> {
        vec![tag; PAGE_SIZE]
    }

    /// A base.tar and a tablespace's archive as PostgreSQL sends them.
    fn archives() -> Vec<(&'static str, Option<&'static str>, Vec<u8>)> {
        let mut base = Vec::new();
        base.extend(testtar::header("backup_label", b'0', 3, ""));
        base.extend(b"abc");
        testtar::pad(&mut base);
        base.extend(testtar::header("pg_wal", b'5', 0, ""));
        testtar::file(&mut base, "global/pg_filenode.map", &[1; 512]);
        testtar::file(&mut base, "base/5/16384", &[block(1), block(2), block(3)].concat());
        testtar::file(&mut base, "base/5/16384.1", &block(4));
        testtar::file(&mut base, "base/5/16384_fsm", &block(5));
        testtar::file(&mut base, "base/5/16390", &[block(6), vec![9; 100]].concat());
        testtar::file(&mut base, "base/5/16391", b"");
        testtar::file(&mut base, "pg_xact/0000", &[block(7), block(8)].concat());
        base.extend(testtar::header("pg_tblspc/16385", b'2', 0, ""));
        testtar::file(&mut base, "global/pg_control", &block(10));
        testtar::end(&mut base);
        let mut ts = Vec::new();
        ts.extend(testtar::header("PG_15_202209061", b'5', 0, ""));
        testtar::file(&mut ts, "PG_15_202209061/5/16400", &block(11));
        testtar::end(&mut ts);
        vec![("base.tar", None, base), ("16385.tar", Some("/srv/ts"), ts)]
    }

    fn import(cuts: &[usize]) -> Result<(Vec<(BufferTag, Bytes)>, ImportProgress), ImportError> {
        let mut imp = Importer::new();
        let mut values = Vec::new();
        for (name, location, bytes) in archives() {
            imp.begin_archive(name, location)?;
            let mut at = 0;
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            cuts.push(bytes.len());
            for cut in cuts {
                imp.feed(&bytes[at..cut.max(at)])?;
                at = cut.max(at);
                while let Some(batch) = imp.next_batch()? {
                    assert!(!batch.is_empty() && batch.len() <= BATCH_VALUES);
                    values.extend(batch);
                }
            }
        }
        values.extend(imp.finish()?);
        Ok((values, imp.progress().clone()))
    }

    fn expected() -> Vec<(BufferTag, Bytes)> {
        let r = rel(1663, DB, 16384);
        let b = |tag: u8| Bytes::from(block(tag));
        let size = |blocks: u32| Bytes::from(keys::encode_rel_size(Some(blocks)));
        let mut want = vec![
            (keys::relmap_key(1664, 0), Bytes::from(vec![1; 512])),
            (r.page(0, 0), b(1)),
            (r.page(0, 1), b(2)),
            (r.page(0, 2), b(3)),
            (r.page(0, RELSEG_BLOCKS), b(4)),
            (r.page(1, 0), b(5)),
            (rel(1663, DB, 16390).page(0, 0), b(6)),
            (keys::slru_page_key(SlruKind::Clog, 0, 0), b(7)),
            (keys::slru_page_key(SlruKind::Clog, 0, 1), b(8)),
            (keys::control_file_key(), b(10)),
            (rel(16385, DB, 16400).page(0, 0), b(11)),
        ];
        let mut sizes = vec![
            (r.size_key(0), size(RELSEG_BLOCKS + 1)),
            (r.size_key(1), size(1)),
            (rel(1663, DB, 16390).size_key(0), size(1)),
            (rel(1663, DB, 16391).size_key(0), size(0)),
            (rel(16385, DB, 16400).size_key(0), size(1)),
        ];
        sizes.sort_by_key(|(k, _)| (k.spcnode, k.dbnode, k.relnode, k.forknum));
        want.extend(sizes);
        want
    }

    #[test]
    fn backup_archives_import_to_pages_slru_control_maps_and_sizes() {
        let (values, progress) = import(&[]).unwrap();
        assert_eq!(values, expected());
        assert_eq!(progress.archives, 2);
        assert_eq!(progress.files, 10);
        assert_eq!(progress.skipped_files, 1);
        assert_eq!(progress.partial_tails, 1);
        assert_eq!(
            (
                progress.rel_pages,
                progress.slru_pages,
                progress.control_files,
                progress.relmaps,
                progress.rel_sizes
            ),
            (7, 2, 1, 1, 5)
        );
        let total: u64 = archives().iter().map(|(_, _, b)| b.len() as u64).sum();
        assert_eq!(progress.bytes, total);
    }

    #[test]
    fn many_blocks_come_in_bounded_batches() {
        let mut t = Vec::new();
        testtar::file(&mut t, "base/5/1", &vec![3; PAGE_SIZE * (BATCH_VALUES * 2 + 3)]);
        testtar::end(&mut t);
        let mut imp = Importer::new();
        imp.begin_archive("base.tar", None).unwrap();
        imp.feed(&t).unwrap();
        let mut sizes = Vec::new();
        while let Some(batch) = imp.next_batch().unwrap() {
            sizes.push(batch.len());
        }
        assert_eq!(sizes, vec![BATCH_VALUES, BATCH_VALUES, 3]);
        assert_eq!(imp.finish().unwrap().len(), 1);
    }

    #[test]
    fn configuration_files_are_kept_in_chunks_that_end_with_a_shorter_one() {
        assert_eq!(classify_path(None, None, "postgresql.conf"), ImportFile::Config { index: 0 });
        assert_eq!(classify_path(None, None, "pg_ident.conf"), ImportFile::Config { index: 3 });
        assert_eq!(classify_path(None, None, "pg_twophase/0000030A"), ImportFile::TwoPhase { xid: 0x30A });
        for (size, chunks) in [
            (0, vec![0]),
            (100, vec![100]),
            (PAGE_SIZE, vec![PAGE_SIZE, 0]),
            (PAGE_SIZE * 2 + 7, vec![PAGE_SIZE, PAGE_SIZE, 7]),
        ] {
            let file: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            let mut t = Vec::new();
            testtar::file(&mut t, "pg_hba.conf", &file);
            testtar::end(&mut t);
            let mut imp = Importer::new();
            imp.begin_archive("base.tar", None).unwrap();
            imp.feed(&t).unwrap();
            let values = imp.finish().unwrap();
            let keys: Vec<BufferTag> =
                (0..chunks.len() as u32).map(|c| keys::config_file_key(2, c)).collect();
            assert_eq!(values.iter().map(|(k, _)| *k).collect::<Vec<_>>(), keys, "{size}");
            assert_eq!(values.iter().map(|(_, v)| v.len()).collect::<Vec<_>>(), chunks, "{size}");
            assert_eq!(values.iter().flat_map(|(_, v)| v.iter().copied()).collect::<Vec<u8>>(), file);
        }
        let mut t = Vec::new();
        testtar::file(&mut t, "postgresql.conf", &vec![b'#'; keys::CONFIG_FILE_MAX_BYTES + 1]);
        testtar::end(&mut t);
        let mut imp = Importer::new();
        imp.begin_archive("base.tar", None).unwrap();
        imp.feed(&t).unwrap();
        let err = imp.next_batch().unwrap_err();
        assert!(err.to_string().contains("postgresql.conf"), "{err}");
    }

    #[test]
    fn control_file_of_the_wrong_size_is_an_error_naming_it() {
        let mut t = Vec::new();
        testtar::file(&mut t, "global/pg_control", &[0; 100]);
        testtar::end(&mut t);
        let mut imp = Importer::new();
        imp.begin_archive("base.tar", None).unwrap();
        imp.feed(&t).unwrap();
        let err = imp.next_batch().unwrap_err();
        assert!(err.to_string().contains("global/pg_control"), "{err}");
    }

    #[test]
    fn archive_cut_short_is_an_error_at_the_next_archive_or_the_finish() {
        let (_, _, base) = archives().remove(0);
        let mut imp = Importer::new();
        imp.begin_archive("base.tar", None).unwrap();
        imp.feed(&base[..base.len() - 1024]).unwrap();
        while imp.next_batch().unwrap().is_some() {}
        assert!(matches!(imp.begin_archive("16385.tar", Some("/srv/ts")), Err(ImportError::Tar { .. })));
        let mut imp = Importer::new();
        imp.begin_archive("base.tar", None).unwrap();
        imp.feed(&base[..base.len() - 1]).unwrap();
        assert!(matches!(imp.finish(), Err(ImportError::Tar { .. })));
        assert!(matches!(
            Importer::new().begin_archive("x.tar", Some("/srv")),
            Err(ImportError::ArchiveName { .. })
        ));
        assert_eq!(Importer::new().feed(b"x"), Err(ImportError::NoArchive));
    }

    proptest! {
        #[test]
        fn any_chunking_imports_the_same_values(cuts in proptest::collection::vec(0usize..60_000, 0..12)) {
            let (values, _) = import(&cuts).unwrap();
            prop_assert_eq!(values, expected());
        }

        #[test]
        fn garbled_or_cut_archives_never_panic_and_batches_stay_bounded(
            flips in proptest::collection::vec((0usize..60_000, any::<u8>()), 1..6),
            len in 0usize..60_000,
        ) {
            let mut imp = Importer::new();
            let mut result = Ok(());
            for (name, location, mut bytes) in archives() {
                for (at, v) in &flips {
                    let n = bytes.len();
                    bytes[at % n] = *v;
                }
                bytes.truncate(len);
                result = imp.begin_archive(name, location).and_then(|()| imp.feed(&bytes));
                while result.is_ok() {
                    match imp.next_batch() {
                        Ok(Some(batch)) => prop_assert!(batch.len() <= BATCH_VALUES),
                        Ok(None) => break,
                        Err(e) => result = Err(e),
                    }
                }
                if result.is_err() {
                    break;
                }
            }
            let _ = result.and_then(|()| imp.finish().map(drop));
        }
    }
}
