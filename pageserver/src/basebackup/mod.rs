//! The base backup of a tenant at an LSN X: a tar of a PostgreSQL 15 data directory that an
//! unpatched PostgreSQL 15 starts on at exactly X, with no WAL replay (docs/http-api.md,
//! `GET /v1/tenant/{t}/timeline/{tl}/basebackup`; the design is docs/rfcs/0008).
//!
//! Two steps. [`prepare`] decides everything that can fail before a byte is sent: X durable
//! (waiting up to `wait_lsn_timeout`) and not below the GC cutoff, the cluster's `pg_control`
//! as of X, and the lists of what the directory holds at X (relation forks and their sizes,
//! databases, relation maps, SLRU segments, configuration files, prepared transactions' state
//! files). [`send`] then writes the tar as it builds it, into a channel of [`CHUNK`]-byte chunks
//! that the HTTP body drains: memory is a few chunks whatever the database's size, and a client
//! that goes away ends it at its next chunk. What it writes:
//!
//! - the directories `initdb` makes, `PG_VERSION` at the root and in each `base/<db>`, the
//!   configuration files kept from the import (`keys::CONFIG_FILES`);
//! - the relation maps, and every block of every fork of every relation at X (GetPage at X, so
//!   checksummed where the cluster has data checksums) in 1 GiB segment files, but the free
//!   space map (PostgreSQL rebuilds it); a relation with an init fork (unlogged) gets its init
//!   fork and a main fork copied from it, as PostgreSQL's own reset after a crash makes it (a
//!   start without recovery does not reset unlogged relations);
//! - the SLRU segments (`pg_xact`, `pg_multixact`) as the tenant holds them at X;
//! - `pg_twophase/<xid>` (8 upper-case hex digits) for each transaction prepared at X and not
//!   committed or rolled back by X: the state file its PREPARE record made (`ingest::twophase`);
//! - `pg_wal/` with one segment holding a shutdown checkpoint record at X' (X moved past a page
//!   header and 8-aligned: `page_types::wal::checkpoint`), `standby.signal` when asked, and
//!   `global/pg_control` last (`state` shut down, `checkPoint` X'), so that a tar cut short is
//!   seen to be incomplete.
//!
//! A page that cannot be built (an unsupported record, a redo failure) fails the backup after
//! its first bytes may have gone: the stream then ends with an error (the HTTP connection is
//! cut before the archive's end), never with a tar that lacks the page; the log names the
//! page.
//!
//! The cluster state comes from the WAL as the tenant followed it (`tenant::cluster`): the SLRU
//! pages by GetPage at X (CLOG statuses and MultiXact writes redone), the segments truncated by
//! X left out, and `pg_control`'s counters: the oldest xid and multixact as of X, the next xid,
//! OID, multixact and member offset raised to the newest stored (`backup_counters`: the
//! receiver stores them once per message), with the SLRU pages startup reads at them.
//!
//! Not yet (issue 48's later steps): the parameters of `XLOG_PARAMETER_CHANGE` (`pg_control`
//! keeps the import's), tablespaces other than `pg_default` and `pg_global` (refused),
//! timelines other than `main`.
//!
//! Layer: above `tenant` (it reads through [`Tenant`]), below `http`.

pub mod tar;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use page_types::control_file::ControlFile;
use page_types::control_file::Parameters;
use page_types::keys::{self, KeyKind, RelTag, SlruKind, FSM_FORK, INIT_FORK, MAIN_FORK, VM_FORK};
use page_types::wal::checkpoint::CheckPoint;
use page_types::{BufferTag, Lsn, PAGE_SIZE};
use tokio::sync::mpsc;

use crate::ingest::import::{DEFAULTTABLESPACE_OID, GLOBALTABLESPACE_OID, RELSEG_BLOCKS};
use crate::storage::{DiskWait, GetError, Timeline};
use crate::tenant::{cluster, rel_sizes};
use crate::tenant::{read_error, GetPageError, Tenant};

use self::tar::Entry;

/// Bytes of one chunk of the stream.
pub const CHUNK: usize = 256 << 10;
/// Chunks the channel to the client holds.
pub const CHUNKS_IN_FLIGHT: usize = 4;
/// Pages read at once (in order) while a relation fork is written.
const PAGES_IN_FLIGHT: usize = 32;
/// The directories `initdb` makes that a base backup has empty (or whose content is written
/// after them), parents first.
const DIRS: [&str; 22] = [
    "base",
    "global",
    "pg_commit_ts",
    "pg_dynshmem",
    "pg_logical",
    "pg_logical/mappings",
    "pg_logical/snapshots",
    "pg_multixact",
    "pg_multixact/members",
    "pg_multixact/offsets",
    "pg_notify",
    "pg_replslot",
    "pg_serial",
    "pg_snapshots",
    "pg_stat",
    "pg_stat_tmp",
    "pg_subtrans",
    "pg_tblspc",
    "pg_twophase",
    "pg_wal",
    "pg_wal/archive_status",
    "pg_xact",
];
/// `PG_VERSION`'s content.
const PG_VERSION: &[u8] = b"15\n";

/// Why a base backup was not built.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// X not durable in time, below the GC cutoff, the tenant stopping or not yet imported.
    #[error(transparent)]
    Lsn(GetPageError),
    #[error(
        "the tenant has no pg_control at {lsn}: it does not follow a PostgreSQL 15 primary, or its import has not \
         stored one yet"
    )]
    NoControlFile { lsn: Lsn },
    /// A tenant imported by a build that did not keep the configuration files.
    #[error(
        "the tenant kept no {name} from its import (imported by an older build): PostgreSQL cannot start without \
         it; import the tenant again (a new tenant attached to the primary)"
    )]
    NoConfigFile { name: &'static str },
    #[error(
        "relation {rel} is in tablespace {}: base backups of clusters with tablespaces other than pg_default \
         and pg_global are not built yet",
        rel.spcnode
    )]
    Tablespace { rel: RelTag },
    /// A page or value that could not be read or rebuilt at X.
    #[error("{what} at {lsn}: {source}")]
    Page {
        what: String,
        lsn: Lsn,
        #[source]
        source: GetPageError,
    },
    #[error("base backup: {0:#}")]
    Internal(anyhow::Error),
    /// The client went away: nothing to report to it.
    #[error("the client went away")]
    Gone,
}

/// One fork of a relation, as of X.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Fork {
    rel: RelTag,
    fork: u8,
    blocks: u32,
}

/// What a base backup at X holds, decided before its first byte ([`prepare`]).
#[derive(Debug)]
pub struct Contents {
    /// X, as asked (or the last durable LSN).
    pub lsn: Lsn,
    /// X': where the shutdown checkpoint record goes, and PostgreSQL's start.
    pub start_lsn: Lsn,
    control: ControlFile,
    counters: CheckPoint,
    forks: Vec<Fork>,
    /// Databases of `pg_default` (those with a relation map at X and no newer drop).
    databases: Vec<u32>,
    /// (tablespace, database, the file).
    relmaps: Vec<(u32, u32, Bytes)>,
    /// (kind, segment number, pages: one past the highest page the tenant has).
    slru: Vec<(SlruKind, u32, u32)>,
    /// (name, the file).
    config: Vec<(&'static str, Bytes)>,
    /// (xid, the state file) of the transactions prepared at X.
    two_phase: Vec<(u32, Bytes)>,
}

impl Contents {
    /// Relation forks written (each in its segment files), the free space maps left out.
    pub fn forks(&self) -> usize {
        self.forks.len()
    }
}

/// Everything of a base backup of `tenant` at `lsn` ([`Lsn::LATEST`]: its last durable LSN)
/// that can fail before a byte is sent (see the module doc).
pub async fn prepare(tenant: &Tenant, lsn: Lsn) -> Result<Contents, BackupError> {
    let lsn = tenant.wait_for(lsn).await.map_err(BackupError::Lsn)?;
    let timeline = Arc::clone(&tenant.timeline);
    let cutoff = timeline.gc_cutoff();
    if lsn < cutoff {
        return Err(BackupError::Lsn(GetPageError::BelowGcCutoff { lsn, cutoff }));
    }
    let control_bytes = value_at(&timeline, keys::control_file_key(), lsn)
        .await?
        .ok_or(BackupError::NoControlFile { lsn })?;
    let control = ControlFile::decode(&control_bytes)
        .map_err(|e| BackupError::Internal(anyhow::anyhow!("the tenant's pg_control: {e}")))?;
    // The parameters as the WAL last changed them (else the import's, in its pg_control).
    let parameters = match value_at(&timeline, keys::parameters_key(), lsn).await? {
        Some(bytes) => Some(Parameters::decode(&bytes).map_err(|e| {
            BackupError::Internal(anyhow::anyhow!("the control file's parameters at {lsn}: {e}"))
        })?),
        None => None,
    };
    let control = match &parameters {
        Some(p) => control.with_parameters(p),
        None => control,
    };
    let counters = backup_counters(&timeline, lsn).await?;
    let start_lsn = control
        .start_point(lsn)
        .map_err(|e| BackupError::Internal(anyhow::anyhow!("the start point at {lsn}: {e}")))?;

    // The key lists, off the executor (index blocks may be read from disk).
    let listed = Arc::clone(&timeline);
    let (size_keys, meta_keys) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let sizes = rel_sizes::rel_size_keys(&listed)?;
        let meta = listed.scan_keys(
            &|key| {
                matches!(
                    keys::classify(key),
                    KeyKind::Slru { .. }
                        | KeyKind::RelMap
                        | KeyKind::ConfigFile { .. }
                        | KeyKind::TwoPhase { .. }
                )
            },
            &meta_skip,
        )?;
        Ok((sizes, meta))
    })
    .await
    .map_err(|e| BackupError::Internal(anyhow::anyhow!("list the key space: {e}")))?
    .map_err(BackupError::Internal)?;

    let mut forks = Vec::new();
    for key in size_keys {
        let KeyKind::RelSize { rel, fork } = keys::classify(&key) else { continue };
        if fork == FSM_FORK {
            continue;
        }
        let size =
            rel_sizes::rel_size_at(&timeline, rel, fork, lsn).await.map_err(|e| BackupError::Page {
                what: format!("the size of {rel} fork {fork}"),
                lsn,
                source: read_error(key, lsn, e),
            })?;
        let Some(blocks) = size else { continue };
        if rel.spcnode != DEFAULTTABLESPACE_OID && rel.spcnode != GLOBALTABLESPACE_OID {
            return Err(BackupError::Tablespace { rel });
        }
        forks.push(Fork { rel, fork, blocks });
    }

    let mut databases = Vec::new();
    let mut relmaps = Vec::new();
    let mut slru: BTreeMap<(SlruKind, u32), u32> = BTreeMap::new();
    let mut config = Vec::new();
    let mut config_parts: BTreeMap<u32, Vec<Bytes>> = BTreeMap::new();
    let mut two_phase_parts: BTreeMap<u32, Vec<Bytes>> = BTreeMap::new();
    for key in meta_keys {
        match keys::classify(&key) {
            KeyKind::RelMap => {
                let Some(map) = value_at(&timeline, key, lsn).await? else { continue };
                if key.dbnode != 0 {
                    if key.spcnode != DEFAULTTABLESPACE_OID {
                        return Err(BackupError::Tablespace {
                            rel: RelTag { spcnode: key.spcnode, dbnode: key.dbnode, relnode: 0 },
                        });
                    }
                    if database_dropped(&timeline, key, lsn)? {
                        continue;
                    }
                    databases.push(key.dbnode);
                }
                relmaps.push((key.spcnode, key.dbnode, map));
            }
            KeyKind::Slru { kind, segno, page } => {
                // A page first written after X, or of a segment truncated since its newest
                // value, is not in the backup.
                let version =
                    timeline.version_at(key, lsn, DiskWait::Allowed).map_err(|e| page_error(key, lsn, e))?;
                let Some(version) = version else { continue };
                let truncated =
                    cluster::slru_segment_dropped(&timeline, kind, segno, version, lsn, DiskWait::Allowed)
                        .map_err(|e| page_error(key, lsn, e))?;
                if truncated {
                    continue;
                }
                let pages = slru.entry((kind, segno)).or_insert(0);
                *pages = (*pages).max(page + 1);
            }
            KeyKind::ConfigFile { index, chunk } => {
                collect_chunk(config_parts.entry(index).or_default(), chunk, &timeline, key, lsn).await?
            }
            // The same chunks for a prepared transaction's state file (empty chunk 0: none).
            KeyKind::TwoPhase { xid, chunk } => {
                collect_chunk(two_phase_parts.entry(xid).or_default(), chunk, &timeline, key, lsn).await?
            }
            _ => {}
        }
    }
    for (index, parts) in config_parts {
        let Some(name) = keys::CONFIG_FILES.get(index as usize) else { continue };
        if let Some(file) = whole_file(&parts) {
            config.push((*name, file));
        }
    }
    let two_phase: Vec<(u32, Bytes)> = two_phase_parts
        .into_iter()
        .filter_map(|(xid, parts)| whole_file(&parts).map(|file| (xid, file)))
        .filter(|(_, file)| !file.is_empty())
        .collect();
    // The SLRU pages PostgreSQL's startup reads at the next xid, multixact and member offset
    // (to zero the rest of them) must exist, also where the counters are ahead of X's pages.
    for (kind, segno, page) in next_slru_pages(&counters) {
        let pages = slru.entry((kind, segno)).or_insert(0);
        *pages = (*pages).max(page + 1);
    }
    for name in ["postgresql.conf", "pg_hba.conf"] {
        if !config.iter().any(|(n, _)| *n == name) {
            return Err(BackupError::NoConfigFile { name });
        }
    }
    if let Some(p) = &parameters {
        raise_settings(&mut config, p);
    }
    Ok(Contents {
        lsn,
        start_lsn,
        control,
        counters,
        forks,
        databases,
        relmaps,
        slru: slru.into_iter().map(|((kind, segno), pages)| (kind, segno, pages)).collect(),
        config,
        two_phase,
    })
}

/// PostgreSQL's defaults of the settings [`Parameters::standby_minimums`] names.
const SETTING_DEFAULTS: [(&str, i32); 5] = [
    ("max_connections", 100),
    ("max_worker_processes", 8),
    ("max_wal_senders", 10),
    ("max_prepared_transactions", 0),
    ("max_locks_per_transaction", 64),
];

/// Appends to `postgresql.auto.conf` each setting the kept configuration files set lower than
/// the primary had it at X (`p`, its `XLOG_PARAMETER_CHANGE`): those files are the import's,
/// and a primary raises these settings with `ALTER SYSTEM` and a restart; a server started on
/// the backup needs at least the primary's (prepared transactions to restore, a hot standby's
/// `CheckRequiredParameterValues`). Settings are read as PostgreSQL reads them, the last line
/// naming one winning, `postgresql.auto.conf` after `postgresql.conf`; `include` directives are
/// not followed. Never lowers a setting.
fn raise_settings(config: &mut Vec<(&'static str, Bytes)>, p: &Parameters) {
    let text = |name: &str| {
        config.iter().find(|(n, _)| *n == name).map(|(_, b)| String::from_utf8_lossy(b).into_owned())
    };
    let (conf, auto) = (text("postgresql.conf").unwrap_or_default(), text("postgresql.auto.conf"));
    let mut raised = String::new();
    for (name, at_least) in p.standby_minimums() {
        let default = SETTING_DEFAULTS.iter().find(|(n, _)| *n == name).map_or(0, |(_, v)| *v);
        let set = [conf.as_str(), auto.as_deref().unwrap_or("")].iter().rev().find_map(|t| setting(t, name));
        let current = set.and_then(|v| v.parse::<i32>().ok()).unwrap_or(default);
        if current < at_least {
            raised.push_str(&format!("{name} = {at_least}\n"));
        }
    }
    if raised.is_empty() {
        return;
    }
    let mut file = auto.unwrap_or_default();
    if !file.is_empty() && !file.ends_with('\n') {
        file.push('\n');
    }
    file.push_str("# Raised by the pageserver's base backup to the primary's settings at its LSN\n");
    file.push_str(&raised);
    config.retain(|(n, _)| *n != "postgresql.auto.conf");
    config.push(("postgresql.auto.conf", Bytes::from(file)));
}

/// The value the last line of configuration file `text` that sets `name` gives it (quotes
/// taken off), if one does: `name = value` or `name value`, comments after `#`.
fn setting(text: &str, name: &str) -> Option<String> {
    text.lines().rev().find_map(|line| {
        let line = line.split('#').next().unwrap_or("").trim();
        let rest =
            line.get(..name.len()).filter(|n| n.eq_ignore_ascii_case(name)).map(|_| &line[name.len()..])?;
        if !rest.starts_with(|c: char| c == '=' || c.is_whitespace()) {
            return None;
        }
        let value = rest.trim_start().trim_start_matches('=').trim();
        Some(value.trim_matches('\'').to_string())
    })
}

/// Adds chunk `chunk` of a file kept in 8 KiB chunks (configuration files, two-phase state
/// files) to `parts`, read at `lsn`: chunks come in key order, and a file ends at its first
/// short chunk (a chunk past it, left by a longer file of earlier, is not read).
async fn collect_chunk(
    parts: &mut Vec<Bytes>,
    chunk: u32,
    timeline: &Timeline,
    key: BufferTag,
    lsn: Lsn,
) -> Result<(), BackupError> {
    if parts.len() as u32 != chunk || parts.last().is_some_and(|p| p.len() < PAGE_SIZE) {
        return Ok(());
    }
    if let Some(part) = value_at(timeline, key, lsn).await? {
        parts.push(part);
    }
    Ok(())
}

/// The file of `parts` ([`collect_chunk`]) if it is whole (it ends with a short chunk).
fn whole_file(parts: &[Bytes]) -> Option<Bytes> {
    if parts.last().is_none_or(|p| p.len() >= PAGE_SIZE) {
        return None;
    }
    let mut file = BytesMut::new();
    parts.iter().for_each(|p| file.extend_from_slice(p));
    Some(file.freeze())
}

/// The counters `pg_control` gets for a start at `lsn`. The receiver stores them once per
/// message of the primary's, at the end of the last record in it that moved them, so the value
/// at or below `lsn` may lag records of the same message at or below `lsn`: its oldest xid and
/// multixact are kept (lower bounds, which are safe: nothing older is read), and its next xid,
/// OID, multixact and member offset are raised to the newest value's (upper bounds: every xid
/// at or below `lsn` is below them; the ones between were used by transactions after `lsn`,
/// which the backup's CLOG leaves uncommitted, so a server started on it reads them as
/// aborted and never assigns them again).
async fn backup_counters(timeline: &Timeline, lsn: Lsn) -> Result<CheckPoint, BackupError> {
    let at = cluster::counters_at(timeline, lsn).await.map_err(BackupError::Internal)?;
    let newest = cluster::counters_at(timeline, Lsn::LATEST).await.map_err(BackupError::Internal)?;
    let mut counters = at;
    counters.next_xid = at.next_xid.max(newest.next_xid);
    counters.next_oid = at.next_oid.max(newest.next_oid);
    if (newest.next_multi.wrapping_sub(at.next_multi) as i32) > 0 {
        counters.next_multi = newest.next_multi;
    }
    if (newest.next_multi_offset.wrapping_sub(at.next_multi_offset) as i32) > 0 {
        counters.next_multi_offset = newest.next_multi_offset;
    }
    Ok(counters)
}

/// Xids a CLOG page holds (2 bits each).
const CLOG_XACTS_PER_PAGE: u64 = PAGE_SIZE as u64 * 4;
/// Multixact offsets an offsets page holds (4 bytes each).
const MULTIXACT_OFFSETS_PER_PAGE: u32 = PAGE_SIZE as u32 / 4;
/// Members a members page holds: groups of 4 (4 flag bytes and 4 xids, 20 bytes).
const MULTIXACT_MEMBERS_PER_PAGE: u32 = (PAGE_SIZE as u32 / 20) * 4;

/// (kind, segment, page) of the CLOG page of the next xid, the offsets page of the next
/// multixact and the members page of the next member offset: PostgreSQL's startup
/// (`TrimCLOG`, `TrimMultiXact`) reads each to zero what follows the next one in it.
fn next_slru_pages(counters: &CheckPoint) -> [(SlruKind, u32, u32); 3] {
    let per_segment = keys::SLRU_PAGES_PER_SEGMENT;
    let split = |kind, pageno: u32| (kind, pageno / per_segment, pageno % per_segment);
    let clog_page = (u64::from(counters.next_xid as u32) / CLOG_XACTS_PER_PAGE) as u32;
    [
        split(SlruKind::Clog, clog_page),
        split(SlruKind::MultiXactOffsets, counters.next_multi / MULTIXACT_OFFSETS_PER_PAGE),
        split(SlruKind::MultiXactMembers, counters.next_multi_offset / MULTIXACT_MEMBERS_PER_PAGE),
    ]
}

/// Where a scan for the keys [`prepare`] lists goes from `key` (see `Timeline::scan_keys`):
/// the cluster-wide values (SLRU pages, pg_control, configuration files, two-phase state files)
/// live at tablespace numbers below 16 and are read one by one; in a real tablespace, a
/// relation's keys are skipped to the end of its database (a database's relation map is at
/// relation 0, before them).
fn meta_skip(key: &BufferTag) -> BufferTag {
    if key.spcnode < 16 || key.relnode == 0 {
        *key
    } else {
        BufferTag {
            spcnode: key.spcnode,
            dbnode: key.dbnode,
            relnode: u32::MAX,
            forknum: u8::MAX,
            blknum: u32::MAX,
        }
    }
}

/// Whether the database of relation map `key` was dropped after that map was written, at or
/// below `lsn` (a database re-created since has a newer map).
fn database_dropped(timeline: &Timeline, key: BufferTag, lsn: Lsn) -> Result<bool, BackupError> {
    let map = timeline.version_at(key, lsn, DiskWait::Allowed).map_err(|e| page_error(key, lsn, e))?;
    let drop_key = keys::db_drop_key(key.spcnode, key.dbnode);
    let dropped =
        timeline.version_at(drop_key, lsn, DiskWait::Allowed).map_err(|e| page_error(drop_key, lsn, e))?;
    Ok(dropped.is_some_and(|d| map.is_none_or(|m| m < d)))
}

fn page_error(key: BufferTag, lsn: Lsn, e: GetError) -> BackupError {
    BackupError::Page { what: format!("{key}"), lsn, source: read_error(key, lsn, e) }
}

/// The newest value of a key whose values are whole (no redo: `pg_control`, relation maps,
/// configuration chunks) at or below `lsn`, `None` if it has none.
async fn value_at(timeline: &Timeline, key: BufferTag, lsn: Lsn) -> Result<Option<Bytes>, BackupError> {
    let value = cluster::image_at(timeline, key, lsn).await.map_err(BackupError::Internal)?;
    Ok(value.map(|(_, bytes)| bytes))
}

/// The tar stream's writer: chunks of about [`CHUNK`] bytes into the channel.
struct Out<'a> {
    tx: &'a mpsc::Sender<Result<Bytes, std::io::Error>>,
    buf: BytesMut,
    mtime: u64,
    sent: u64,
}

impl Out<'_> {
    async fn put(&mut self, bytes: &[u8]) -> Result<(), BackupError> {
        self.buf.extend_from_slice(bytes);
        if self.buf.len() >= CHUNK {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), BackupError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = self.buf.split().freeze();
        self.sent += chunk.len() as u64;
        self.tx.send(Ok(chunk)).await.map_err(|_| BackupError::Gone)
    }

    async fn header(&mut self, path: &str, entry: Entry) -> Result<(), BackupError> {
        let header = tar::header(path, entry, self.mtime).map_err(|e| BackupError::Internal(e.into()))?;
        self.put(&header).await
    }

    async fn dir(&mut self, path: &str) -> Result<(), BackupError> {
        self.header(path, Entry::Dir).await
    }

    async fn file(&mut self, path: &str, bytes: &[u8]) -> Result<(), BackupError> {
        self.header(path, Entry::File(bytes.len() as u64)).await?;
        self.put(bytes).await?;
        self.put(&[0u8; tar::BLOCK][..tar::padding(bytes.len() as u64)]).await
    }
}

/// Writes the base backup `contents` describes into `tx` (see the module doc), `standby.signal`
/// with it when `standby`; the bytes sent. Ends with [`BackupError::Gone`] when the receiver is
/// dropped.
pub async fn send(
    tenant: &Tenant,
    contents: Contents,
    standby: bool,
    tx: &mpsc::Sender<Result<Bytes, std::io::Error>>,
) -> Result<u64, BackupError> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut out = Out { tx, buf: BytesMut::with_capacity(CHUNK + PAGE_SIZE), mtime: now, sent: 0 };
    let lsn = contents.lsn;

    for dir in DIRS {
        out.dir(dir).await?;
    }
    out.file("PG_VERSION", PG_VERSION).await?;
    for (name, file) in &contents.config {
        out.file(name, file).await?;
    }
    for db in &contents.databases {
        out.dir(&format!("base/{db}")).await?;
        out.file(&format!("base/{db}/PG_VERSION"), PG_VERSION).await?;
    }
    for (spc, db, map) in &contents.relmaps {
        out.file(&format!("{}/pg_filenode.map", db_dir(*spc, *db)), map).await?;
    }

    // Unlogged relations: their init fork, and a main fork that is a copy of it.
    let unlogged: Vec<RelTag> =
        contents.forks.iter().filter(|f| f.fork == INIT_FORK).map(|f| f.rel).collect();
    for f in &contents.forks {
        if f.fork == MAIN_FORK && unlogged.contains(&f.rel) {
            continue;
        }
        write_fork(tenant, &mut out, *f, f.fork, lsn).await?;
        if f.fork == INIT_FORK {
            write_fork(tenant, &mut out, *f, MAIN_FORK, lsn).await?;
        }
    }

    for &(kind, segno, pages) in &contents.slru {
        let path = format!("{}/{segno:04X}", kind.dir());
        out.header(&path, Entry::File(u64::from(pages) * PAGE_SIZE as u64)).await?;
        for page in 0..pages {
            let key = keys::slru_page_key(kind, segno, page);
            // GetPage: an SLRU page may hold records (CLOG statuses, MultiXact writes).
            match tenant.get_page(key, lsn).await {
                Ok((_, bytes)) if bytes.len() == PAGE_SIZE => out.put(&bytes).await?,
                Ok((_, bytes)) => {
                    return Err(BackupError::Internal(anyhow::anyhow!(
                        "{path} page {page} is {} bytes, not a page",
                        bytes.len()
                    )))
                }
                // A page between two the tenant has: PostgreSQL zeroes a page before it uses it.
                Err(GetPageError::NotFound { .. }) => out.put(&[0u8; PAGE_SIZE]).await?,
                Err(source) => {
                    return Err(BackupError::Page { what: format!("{path} page {page}"), lsn, source })
                }
            }
        }
    }

    // Prepared transactions: PostgreSQL's startup reads them back (`restoreTwoPhaseData`).
    for (xid, file) in &contents.two_phase {
        out.file(&format!("pg_twophase/{xid:08X}"), file).await?;
    }

    let unix_now = i64::try_from(now).unwrap_or(i64::MAX);
    let (control, start) = contents
        .control
        .started_at(&contents.counters, lsn, unix_now)
        .map_err(|e| BackupError::Internal(anyhow::anyhow!("the start point at {lsn}: {e}")))?;
    debug_assert_eq!(start.lsn, contents.start_lsn);
    out.file(&format!("pg_wal/{}", start.file_name), &start.bytes).await?;
    if standby {
        out.file("standby.signal", b"").await?;
    }
    out.file("global/pg_control", &control.encode()).await?;
    out.put(&tar::END).await?;
    out.flush().await?;
    Ok(out.sent)
}

/// `global` or `base/<db>`.
fn db_dir(spc: u32, db: u32) -> String {
    if spc == GLOBALTABLESPACE_OID {
        "global".to_owned()
    } else {
        format!("base/{db}")
    }
}

/// The segment files of fork `f` written as fork `as_fork` (the same, or the main fork of an
/// unlogged relation copied from its init fork).
async fn write_fork(
    tenant: &Tenant,
    out: &mut Out<'_>,
    f: Fork,
    as_fork: u8,
    lsn: Lsn,
) -> Result<(), BackupError> {
    let suffix = match as_fork {
        VM_FORK => "_vm",
        INIT_FORK => "_init",
        _ => "",
    };
    let base = format!("{}/{}{suffix}", db_dir(f.rel.spcnode, f.rel.dbnode), f.rel.relnode);
    let segments = f.blocks.div_ceil(RELSEG_BLOCKS).max(1);
    for segno in 0..segments {
        let first = segno * RELSEG_BLOCKS;
        let blocks = f.blocks.saturating_sub(first).min(RELSEG_BLOCKS);
        let path = if segno == 0 { base.clone() } else { format!("{base}.{segno}") };
        out.header(&path, Entry::File(u64::from(blocks) * PAGE_SIZE as u64)).await?;
        let mut pages = futures_util::stream::iter(first..first + blocks)
            .map(|blkno| async move {
                let key = f.rel.page(f.fork, blkno);
                tenant.get_page(key, lsn).await.map(|(_, page)| page).map_err(|source| BackupError::Page {
                    what: format!("block {blkno} of {} fork {}", f.rel, f.fork),
                    lsn,
                    source,
                })
            })
            .buffered(PAGES_IN_FLIGHT);
        while let Some(page) = pages.next().await {
            let page = page?;
            if page.len() != PAGE_SIZE {
                return Err(BackupError::Internal(anyhow::anyhow!("{path}: a page of {} bytes", page.len())));
            }
            out.put(&page).await?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setting_is_what_its_last_line_says() {
        let text = "max_connections = 100\n#max_connections = 5\nmax_connections_x = 1\n\
                    MAX_CONNECTIONS 50 # a comment\nmax_prepared_transactions = '7'\n";
        assert_eq!(setting(text, "max_connections").as_deref(), Some("50"));
        assert_eq!(setting(text, "max_prepared_transactions").as_deref(), Some("7"));
        assert_eq!(setting(text, "max_wal_senders"), None);
    }

    #[test]
    fn settings_below_the_primarys_are_raised_in_the_auto_conf_and_none_is_lowered() {
        let p = Parameters {
            max_connections: 40,
            max_worker_processes: 8,
            max_wal_senders: 10,
            max_prepared_xacts: 6,
            max_locks_per_xact: 128,
            wal_level: 1,
            wal_log_hints: false,
            track_commit_timestamp: false,
        };
        let conf = "max_connections = 100\nmax_prepared_transactions = 20\n";
        let auto = "max_prepared_transactions = '3'";
        let mut config = vec![
            ("postgresql.conf", Bytes::from_static(conf.as_bytes())),
            ("postgresql.auto.conf", Bytes::from_static(auto.as_bytes())),
        ];
        raise_settings(&mut config, &p);
        let (_, file) = config.iter().find(|(n, _)| *n == "postgresql.auto.conf").unwrap();
        let file = std::str::from_utf8(file).unwrap();
        assert!(file.starts_with("max_prepared_transactions = '3'\n"), "{file}");
        assert_eq!(setting(file, "max_prepared_transactions").as_deref(), Some("6"));
        // Unset: PostgreSQL's default of 64, below the primary's.
        assert_eq!(setting(file, "max_locks_per_transaction").as_deref(), Some("128"));
        assert_eq!(setting(file, "max_connections"), None, "100 is not lowered to 40");
        // At the primary's settings already: nothing to add.
        let before = config.clone();
        raise_settings(&mut config, &p);
        assert_eq!(config, before);
    }

    #[test]
    fn the_pages_startup_reads_are_those_of_the_next_ids() {
        let counters = CheckPoint {
            next_xid: (3 << 32) | (32_768 * 33 + 5),
            next_multi: 2048 * 40 + 1,
            next_multi_offset: 1636 * 2,
            ..CheckPoint::default()
        };
        assert_eq!(
            next_slru_pages(&counters),
            [(SlruKind::Clog, 1, 1), (SlruKind::MultiXactOffsets, 1, 8), (SlruKind::MultiXactMembers, 0, 2)]
        );
    }

    #[test]
    fn the_meta_scan_skips_no_key_it_keeps() {
        let mut all = Vec::new();
        for spcnode in [0, 1, 2, 1663, 1664] {
            for dbnode in [0, 5, 16384] {
                for relnode in [0, 1, 16385, u32::MAX] {
                    for forknum in [0, 2, 0x80, 0x90, 0xA0, 0xA1, 0xA4, 0xB0, 0xC0, 0xFF] {
                        for blknum in [0, 1, 31, u32::MAX] {
                            all.push(BufferTag { spcnode, dbnode, relnode, forknum, blknum });
                        }
                    }
                }
            }
        }
        let keep = |k: &BufferTag| {
            matches!(
                keys::classify(k),
                KeyKind::Slru { .. }
                    | KeyKind::RelMap
                    | KeyKind::ConfigFile { .. }
                    | KeyKind::TwoPhase { .. }
            )
        };
        assert!(all.iter().filter(|k| keep(k)).count() > 10);
        assert!(all.iter().any(|k| matches!(keys::classify(k), KeyKind::TwoPhase { .. })));
        for key in [keys::two_phase_key(0, 0), keys::two_phase_key(u32::MAX, 3)] {
            assert!(keep(&key) && meta_skip(&key) == key, "{key:?}");
        }
        for key in &all {
            let skip = meta_skip(key);
            assert!(skip >= *key);
            assert!(!all.iter().any(|k| keep(k) && k > key && *k <= skip), "{key:?} skips to {skip:?}");
        }
        // A relation's pages are skipped to the end of its database.
        let page = BufferTag { spcnode: 1663, dbnode: 5, relnode: 16385, forknum: 0, blknum: 0 };
        assert!(meta_skip(&page) > BufferTag { relnode: u32::MAX - 1, ..page });
    }
}
