//! `pagectl basebackup`: takes a base backup of a PostgreSQL 15 server with the pageserver's
//! own replication client (`postgres::pq`) and runs it through the importer
//! (`ingest::import`) without storing anything: an operator checks with it that
//! a source can be imported (address, authentication, replication permission, what it holds);
//! the tests check the client, the tar reader and the file classes against `pg_basebackup`.
//!
//! It connects, checks the server is PostgreSQL 15, runs `BASE_BACKUP` (a fast checkpoint, no
//! WAL, no manifest; no slot needed), reads every archive, counts the values the importer
//! makes, and runs `IDENTIFY_SYSTEM` on the same connection afterwards (the connection is left
//! ready, as the receiver will use it to start streaming).
//!
//! Invariant: nothing is written anywhere; the values are counted and dropped.

use anyhow::Context;
use page_types::Lsn;
use pageserver::ingest::import::{ImportProgress, ImportedFile, Importer};
use pageserver::postgres::connstr;
use pageserver::postgres::pq::{BackupMessage, ReplicationConn, Tablespace};

/// The label the backup gets on the server (`backup_label`, `pg_stat_progress_basebackup`).
const LABEL: &str = "pagectl basebackup";

pub struct Args {
    pub source: String,
    pub list: bool,
}

/// What one backup held.
pub struct Backup {
    pub start: Lsn,
    pub end: Lsn,
    pub timeline: u32,
    pub system_id: String,
    pub tablespaces: Vec<Tablespace>,
    /// Every regular file, with `--list`.
    pub files: Vec<ImportedFile>,
    pub progress: ImportProgress,
    /// The last progress report of the server (bytes sent).
    pub server_bytes: u64,
}

pub async fn run(args: &Args) -> anyhow::Result<Backup> {
    let config = connstr::parse(&args.source).map_err(|e| anyhow::anyhow!("invalid --source: {e}"))?;
    let mut conn = ReplicationConn::connect(&config).await.with_context(|| format!("connect to {config}"))?;
    conn.require_pg15().with_context(|| format!("{config}"))?;
    let start = conn.base_backup(LABEL).await.context("BASE_BACKUP")?;
    let mut importer = if args.list { Importer::new().with_listing() } else { Importer::new() };
    let mut files = Vec::new();
    let mut server_bytes = 0;
    let (end, timeline) = loop {
        match conn.next_backup_message().await.context("base backup stream")? {
            BackupMessage::Archive { name, location } => {
                importer.begin_archive(&name, location.as_deref())?;
            }
            BackupMessage::Data(data) => {
                importer.feed(&data)?;
                while importer.next_batch()?.is_some() {}
            }
            BackupMessage::Progress(bytes) => server_bytes = bytes,
            BackupMessage::End { end_lsn, timeline } => break (end_lsn, timeline),
        }
        files.extend(importer.take_listing());
    };
    importer.finish()?;
    files.extend(importer.take_listing());
    anyhow::ensure!(
        timeline == start.timeline,
        "the backup started on timeline {} and ended on {timeline}",
        start.timeline
    );
    let system = conn.identify_system().await.context("IDENTIFY_SYSTEM after the backup")?;
    Ok(Backup {
        start: start.start_lsn,
        end,
        timeline,
        system_id: system.system_id,
        tablespaces: start.tablespaces,
        files,
        progress: importer.progress().clone(),
        server_bytes,
    })
}
