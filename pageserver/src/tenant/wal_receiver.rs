//! A tenant's WAL receiver: it follows a PostgreSQL 15 primary over physical replication
//! (`PUT /v1/tenant/{id}/wal_source`), decodes the WAL with `page_types::wal` and stores each
//! block reference as a value of the tenant ([`wal_values`]), reporting what is durable back to the
//! primary's slot.
//!
//! What it drives lives in rooms of its own: the protocol client (`crate::postgres`:
//! [`connstr`], libpq connection strings; [`pq`], the replication protocol client), the pure
//! ingest steps (`crate::ingest`: [`import`], a base backup to values; [`wal_values`], a
//! decoded record to values, and the size cache [`wal_values::RelSizes`]), and the sizes and
//! drops read back from storage ([`rel_sizes`], beside it under `tenant`). This file: the
//! source file of the tenant, the receiver task, its status.
//!
//! **The source file** `wal_source.json` in the tenant's directory holds the source (connection
//! string, slot), the cluster it follows (system id, timeline, learned at the first connection)
//! and the position: the end of the last record whose values are durable (with the records
//! that carry none), rounded up to the 8-byte boundary where the next record may start. It is written atomically (temp file, fsync, rename, fsync of the
//! directory), at most once a second while streaming, and always before that position is
//! reported to the primary as flushed, so the slot keeps everything not yet durable here.
//!
//! **Resuming** (a reconnect, a restart, a kill -9): from the larger of the file's position and
//! the storage's last durable LSN (a batch may have become durable after the file was last
//! written). Values are stored at their record's end LSN, and a batch holds whole records, so
//! every record that ends at or below that point is stored and every later one is not:
//! streaming restarts at the start of that point's WAL page and skips records ending at or
//! below it. No gap, no duplicate. That needs storage to hold no batch above a lost one: a
//! group commit that fails (a full disk) fails every batch queued, and once its retry is due
//! storage takes any batch above its durable LSN, so each batch is queued only right after
//! the one this receiver queued before it ([`InFlight`]); a refusal ends the connection.
//!
//! **The checkpoint counters** ([`Counters`], PostgreSQL's `CheckPoint`) are kept in memory
//! while streaming: read from storage as each connection starts (the newest value, else the
//! imported `pg_control`'s; `tenant::cluster::counters_at`), moved by every record, and stored
//! as one value per message whose records changed them, at the end of the last such record.
//! What storage holds at the position a connection resumes from is what the records below it
//! left, so a reconnect, a restart or a failed batch starts again from the right counters.
//!
//! **Failures** are the source's, never the daemon's: a refused connection, a server that is
//! not PostgreSQL 15, another cluster, a timeline switch, a WAL decode error or a failed ingest
//! put the receiver in the `error` state with its reason and it tries again with backoff (100
//! ms doubling to 10 s); no panic, nothing acknowledged is lost.
//!
//! **The initial import.** A source without a position (newly attached) first takes a base
//! backup over the same connection, after creating the slot (which reserves the WAL from
//! before the backup's start): [`import`] turns its archives into values (every block of every
//! relation fork, the relation sizes, the SLRU pages, `pg_control`, the relation maps), stored
//! in batches at LSNs 1, 2, 3.. (below any WAL position: PostgreSQL's WAL starts at 16 MiB),
//! then streaming starts at the backup's start. The backup's pages are fuzzy until its end
//! LSN (pages copied while being written; the WAL from the start repairs them with full-page
//! images): the tenant's history starts there, its GC cutoff is raised to it. From the moment
//! an import begins until one is complete (across restarts: the source file says), the
//! tenant refuses reads (`import_incomplete`). The source file
//! records the import before it begins and when it is complete; an import interrupted (an
//! error, a kill -9) begins again with a new backup at the next LSNs, and ends by marking
//! dropped every relation fork the interrupted attempt stored a size for that the new backup
//! does not have, so nothing of the old attempt is seen above the new one.
//!
//! Layer: under `tenant`; it uses `storage`, `ingest`, `postgres`, `tenant::rel_sizes` and
//! `page_types::wal`, never `tenants`,
//! `page_service` or `http`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use page_types::wal::{rmgr, DecodedRecord, WalDecodeError, WalDecoder, MAXALIGN, WAL_PAGE_SIZE};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use prometheus::{IntCounter, Registry};

use bytes::Bytes;
use page_types::keys;
use page_types::{BufferTag, Lsn};

use super::{cluster, database_copy, rel_sizes};
use crate::ingest::counters::Counters;
use crate::ingest::{import, wal_values};
use crate::postgres::{connstr, pq};
use crate::remote::{RemoteStatus, RemoteTimeline};
use crate::storage::{IngestBatch, IngestError, Timeline, Value};
use crate::util::lock;
use pq::{BackupMessage, ReplicationConn, ReplicationMessage};

/// The file in the tenant's directory that holds its WAL source.
pub const SOURCE_FILE: &str = "wal_source.json";
/// How long a connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// With no message at all for this long, the connection is given up (the primary sends
/// keepalives every `wal_sender_timeout / 2`, 30 s by default).
const SILENCE_TIMEOUT: Duration = Duration::from_secs(90);
/// How often the position is made durable and reported while streaming.
const STATUS_INTERVAL: Duration = Duration::from_secs(1);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Default of `wal_max_record_size`, the longest WAL record a receiver takes: the decoder
/// holds a record whole until it is decoded, so this bounds what one tenant's stream can make
/// the daemon allocate for one record (about twice it, with the buffer's growth). PostgreSQL's
/// records are far shorter in practice: full-page images are at most 32 blocks of 8 KiB (264
/// KiB); a commit that drops many relations (12 bytes each) or carries many invalidation
/// messages (16 bytes each: a schema of 100,000 tables restored in one transaction) reaches
/// megabytes, rarely tens of them. Only `pg_logical_emit_message` (or a PREPARE of a huge
/// transaction) writes records near PostgreSQL's own bound of 1 GiB; such a stream stops with
/// an error naming the record and this setting, which can be raised to take it.
pub const DEFAULT_WAL_MAX_RECORD_SIZE: u32 = 128 << 20;

/// Where a tenant's WAL comes from (the body of `PUT /v1/tenant/{id}/wal_source`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WalSource {
    /// libpq keyword/value connection string of the primary.
    pub postgres: String,
    /// Its physical replication slot (created if missing).
    pub slot: String,
}

impl WalSource {
    /// Checks the connection string and the slot name.
    pub fn validate(&self) -> Result<(), String> {
        connstr::parse(&self.postgres).map_err(|e| format!("postgres: {e}"))?;
        let ok = !self.slot.is_empty()
            && self.slot.len() <= 63
            && self.slot.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !ok {
            return Err(format!(
                "slot {:?}: use 1 to 63 characters of a-z 0-9 _ (PostgreSQL's rule)",
                self.slot
            ));
        }
        Ok(())
    }
}

/// `wal_source.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceFile {
    #[serde(flatten)]
    pub source: WalSource,
    /// Detached (`DELETE .../wal_source`): no receiver follows it, and the rest of the file
    /// still says what the tenant's storage holds (a re-attach resumes from it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub detached: bool,
    /// The cluster followed (`IDENTIFY_SYSTEM`'s system id), from the first connection on.
    #[serde(default)]
    pub system_id: Option<String>,
    #[serde(default)]
    pub timeline: Option<u32>,
    /// The end of the last record whose values are durable.
    #[serde(default)]
    pub position: Option<Lsn>,
    /// The initial import, from the moment it begins.
    #[serde(default)]
    pub import: Option<ImportRecord>,
    /// A branch's first source, until its first record is seen: the LSN of the shutdown
    /// checkpoint that the branch's base backup wrote, which must be the first record the
    /// PostgreSQL started on that backup streams (else it is not the branch's primary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_checkpoint: Option<Lsn>,
}

/// The initial import of a source's tenant (`wal_source.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImportRecord {
    /// Attempts begun (the last one may have been interrupted).
    pub attempts: u32,
    /// The backup's start and end LSNs, once an attempt is complete.
    pub start_lsn: Option<Lsn>,
    pub end_lsn: Option<Lsn>,
}

/// Reads the tenant's source file; `Ok(None)` if it has none.
pub fn read_source_file(dir: &Path) -> anyhow::Result<Option<SourceFile>> {
    let path = dir.join(SOURCE_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            serde_json::from_str(&text).map(Some).with_context(|| format!("parse {}", path.display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// Writes the source file durably.
pub fn write_source_file(dir: &Path, file: &SourceFile) -> anyhow::Result<()> {
    let text = serde_json::to_vec_pretty(file).context("encode the WAL source")?;
    crate::storage::durable_write(dir, SOURCE_FILE, &text).context("write the WAL source")
}

/// What the source file says of the tenant's storage, told to its timeline at load (attached
/// or detached): everything up to the position is stored (the file is written after the
/// values), and the history of a finished import starts at the backup's end (its GC cutoff).
pub fn restore(timeline: &Timeline, file: &SourceFile) {
    if let Some(position) = file.position {
        timeline.advance_durable(position);
    }
    if let Some(end) = file.import.as_ref().and_then(|i| i.end_lsn) {
        timeline.raise_gc_cutoff(end);
    }
}

/// The receivers' metrics, totals over all tenants (per-tenant figures are in the status).
pub struct WalReceiverMetrics {
    received_bytes: IntCounter,
    records: IntCounter,
    values: IntCounter,
    connection_errors: IntCounter,
}

impl WalReceiverMetrics {
    pub fn new(registry: &Registry) -> anyhow::Result<WalReceiverMetrics> {
        let counter = |name: &str, help: &str| -> anyhow::Result<IntCounter> {
            let c = IntCounter::new(name, help).with_context(|| format!("create {name}"))?;
            registry.register(Box::new(c.clone())).with_context(|| format!("register {name}"))?;
            Ok(c)
        };
        Ok(WalReceiverMetrics {
            received_bytes: counter(
                "pageserver_wal_receiver_received_bytes_total",
                "WAL bytes received from the tenants' PostgreSQL primaries",
            )?,
            records: counter(
                "pageserver_wal_receiver_records_total",
                "WAL records decoded and stored (with their values, if any) by the WAL receivers",
            )?,
            values: counter(
                "pageserver_wal_receiver_values_total",
                "Values (page images and PostgreSQL records) stored from WAL, one per block reference",
            )?,
            connection_errors: counter(
                "pageserver_wal_receiver_connection_errors_total",
                "Connections of a WAL receiver that ended in an error (then it reconnects with backoff)",
            )?,
        })
    }
}

/// What the receiver is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReceiverState {
    Connecting,
    /// Taking the initial base backup.
    Importing,
    Streaming,
    Error,
}

/// `wal_source` in the tenant status.
#[derive(Debug, Clone, Serialize)]
pub struct WalSourceStatus {
    /// `user@host:port` of the source (never its password).
    pub postgres: String,
    pub slot: String,
    pub state: ReceiverState,
    /// The reason of the `error` state, kept while reconnecting after it (until streaming).
    pub error: Option<String>,
    /// Where the current (or last) connection resumed: every record ending at or below it was
    /// stored before, every later one is stored by this connection.
    pub resumed_at: Lsn,
    /// WAL received up to here.
    pub received_lsn: Lsn,
    /// Durable here up to this LSN (and reported to the slot as flushed).
    pub durable_lsn: Lsn,
    /// The primary's end of WAL, as of its last message.
    pub server_wal_end: Lsn,
    /// `server_wal_end - durable_lsn`.
    pub lag_bytes: u64,
    /// When the last message came (RFC 3339, UTC).
    pub last_message: Option<String>,
    /// Connection attempts after the first.
    pub reconnects: u64,
    /// The initial import (none for a source attached before it existed).
    pub import: Option<ImportStatus>,
}

/// `wal_source.import` in the tenant status.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ImportStatus {
    /// Running, or done.
    pub done: bool,
    pub attempts: u32,
    /// The backup's start LSN (streaming starts there) and end LSN (the tenant's history, and
    /// its GC cutoff, start there), once known.
    pub start_lsn: Option<Lsn>,
    pub end_lsn: Option<Lsn>,
    /// The backup's bytes received, and the server's estimate of its size.
    pub bytes: u64,
    pub estimated_bytes: u64,
    pub files: u64,
    /// Values stored (relation pages, sizes, SLRU pages, files).
    pub values: u64,
}

struct Shared {
    status: WalSourceStatus,
    last_message: Option<SystemTime>,
}

/// A running receiver; stopping it ([`WalReceiver::stop`]) waits for its task.
pub struct WalReceiver {
    pub source: WalSource,
    shared: Arc<Mutex<Shared>>,
    cancel: CancellationToken,
    task: tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// What a receiver shares with its tenant and the daemon.
pub struct ReceiverDeps {
    /// The tenant's storage, which the receiver writes.
    pub timeline: Arc<Timeline>,
    pub metrics: Arc<WalReceiverMetrics>,
    /// The tenant's: raised from the moment an import begins until one is complete (reads of
    /// the tenant are refused meanwhile).
    pub import_incomplete: Arc<AtomicBool>,
    /// `wal_max_record_size`: a longer record stops the stream with an error.
    pub max_record_size: u32,
    /// The tenant's GetPage, for the template's pages of a database copy.
    pub pages: database_copy::PageSource,
    /// With remote storage, the timeline's uploads: no more than the position the uploaded
    /// index resumes from ([`bucket_resume_lsn`]) is reported to the primary as flushed, so that
    /// the slot keeps what a node that lost this disk must stream again; a shutdown checkpoint
    /// has them upload at once ([`RemoteTimeline::upload_now`]).
    pub uploaded: Option<Arc<RemoteTimeline>>,
}

impl WalReceiver {
    /// Starts following `file`'s source for the tenant in `dir`; it stops when [`WalReceiver::stop`]
    /// is called, when it is dropped, or when `tenant_cancel` (the tenant's) fires.
    pub fn start(
        tenant_id: &str,
        dir: PathBuf,
        file: SourceFile,
        deps: ReceiverDeps,
        tenant_cancel: &CancellationToken,
    ) -> Arc<WalReceiver> {
        let ReceiverDeps { timeline, metrics, import_incomplete, max_record_size, pages, uploaded } = deps;
        let postgres = connstr::parse(&file.source.postgres).map(|c| c.to_string()).unwrap_or_default();
        let durable = file.position.unwrap_or(Lsn::INVALID);
        let shared = Arc::new(Mutex::new(Shared {
            status: WalSourceStatus {
                postgres,
                slot: file.source.slot.clone(),
                state: ReceiverState::Connecting,
                error: None,
                resumed_at: durable,
                received_lsn: durable,
                durable_lsn: durable,
                server_wal_end: Lsn::INVALID,
                lag_bytes: 0,
                last_message: None,
                reconnects: 0,
                import: file.import.as_ref().map(|i| ImportStatus {
                    done: i.end_lsn.is_some(),
                    attempts: i.attempts,
                    start_lsn: i.start_lsn,
                    end_lsn: i.end_lsn,
                    ..ImportStatus::default()
                }),
            },
            last_message: None,
        }));
        let cancel = tenant_cancel.child_token();
        let source = file.source.clone();
        let task = Task {
            sizes: wal_values::RelSizes::default(),
            counters: None,
            in_flight: InFlight::default(),
            dir,
            file,
            timeline,
            metrics,
            import_incomplete,
            max_record_size,
            pages,
            uploaded,
            upload_at: None,
            shared: Arc::clone(&shared),
            cancel: cancel.clone(),
        };
        let span = tracing::info_span!("wal_receiver", tenant_id = tenant_id);
        let handle = tokio::spawn(tracing::Instrument::instrument(task.run(), span));
        Arc::new(WalReceiver { source, shared, cancel, task: tokio::sync::Mutex::new(Some(handle)) })
    }

    pub fn status(&self) -> WalSourceStatus {
        let shared = lock(&self.shared);
        let mut status = shared.status.clone();
        status.last_message = shared.last_message.map(|t| humantime::format_rfc3339_millis(t).to_string());
        status.lag_bytes = status.server_wal_end.bytes_since(status.durable_lsn);
        status
    }

    /// Stops the receiver and waits for its task (which makes its position durable first).
    /// Cancel-safe: the task stops either way.
    pub async fn stop(&self) {
        self.cancel.cancel();
        if let Some(task) = self.task.lock().await.take() {
            if let Err(e) = task.await {
                tracing::error!("WAL receiver task failed: {e}");
            }
        }
    }
}

impl Drop for WalReceiver {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// The label of the receiver's base backups on the server.
const IMPORT_LABEL: &str = "pageserver import";

/// The import's batches: each at the next LSN from just above what storage holds, all below
/// the backup's start; up to [`MAX_IN_FLIGHT`] in flight.
struct ImportBatches<'a> {
    timeline: &'a Timeline,
    next_lsn: Lsn,
    below: Lsn,
    in_flight: VecDeque<Durable>,
    /// Values stored so far.
    values: u64,
}

impl<'a> ImportBatches<'a> {
    fn new(timeline: &'a Timeline, below: Lsn) -> anyhow::Result<ImportBatches<'a>> {
        let next_lsn =
            timeline.last_durable_lsn().checked_add(1).context("no LSN above what storage holds")?;
        Ok(ImportBatches { timeline, next_lsn, below, in_flight: VecDeque::new(), values: 0 })
    }

    async fn store(&mut self, values: Vec<(BufferTag, Bytes)>) -> anyhow::Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        anyhow::ensure!(
            self.next_lsn < self.below,
            "the import needs more batches than there are LSNs below the backup's start {}",
            self.below
        );
        let lsn = self.next_lsn;
        self.next_lsn = lsn.checked_add(1).expect("below `below`, so not the last LSN");
        self.values += values.len() as u64;
        let batch =
            IngestBatch { values: values.into_iter().map(|(k, v)| (k, lsn, Value::Image(v))).collect() };
        let durable = self.timeline.submit(batch).await.context("store imported values")?;
        self.in_flight.push_back(tokio::spawn(durable));
        self.settle(MAX_IN_FLIGHT).await
    }

    /// Waits until at most `keep` batches are in flight.
    async fn settle(&mut self, keep: usize) -> anyhow::Result<()> {
        while self.in_flight.len() > keep {
            if let Some(durable) = self.in_flight.pop_front() {
                durable.await.context("ingest task")?.context("store imported values")?;
            }
        }
        Ok(())
    }
}

/// Most batches submitted to storage and not yet known durable: decoding goes on while they
/// are written and synced (group commit takes several at once).
const MAX_IN_FLIGHT: usize = 32;

/// The batches submitted and not yet known durable, oldest first, each with the position it
/// completes (WAL whose records carried no values rides on the batch before it).
///
/// **Invariant:** the values stored from WAL have no gap. Each batch is queued only right after
/// the one before it ([`Timeline::submit_after`] with `queued`): if a failed write dropped that
/// one (storage then takes any batch above its durable LSN once its retry is due), the next is
/// refused and the connection ends; the next one resumes from what storage holds.
#[derive(Default)]
struct InFlight {
    queue: VecDeque<(Option<Durable>, Lsn)>,
    /// The last LSN this receiver had the timeline take: its last batch's, or what it moved the
    /// durable LSN to; the timeline's durable LSN when a connection begins (nothing in flight).
    queued: Lsn,
}

/// A submitted batch's way to durability (its last LSN, or why it failed).
type Durable = tokio::task::JoinHandle<Result<Lsn, IngestError>>;

impl InFlight {
    /// Queues `values` right after what this receiver queued last (see the invariant); the way
    /// to its durability, to push with the position it completes.
    async fn submit(
        &mut self,
        timeline: &Timeline,
        values: Vec<(BufferTag, Lsn, Value)>,
    ) -> anyhow::Result<Durable> {
        let last = values.last().map_or(self.queued, |(_, lsn, _)| *lsn);
        let durable =
            timeline.submit_after(self.queued, IngestBatch { values }).await.context("store WAL values")?;
        self.queued = last;
        Ok(tokio::spawn(durable))
    }

    /// The end of the WAL whose values are queued (written to storage, maybe not yet durable):
    /// the write position reported to the primary.
    fn written(&self, processed: Lsn) -> Lsn {
        self.queue.back().map_or(processed, |(_, end)| *end).max(processed)
    }

    /// Waits for every batch in flight to be durable or to fail, and forgets them all: the end
    /// of a connection (a batch that failed is logged; the next connection resumes from what
    /// storage holds). Not [`InFlight::settle`], which stops at the first failure and would
    /// leave the later batches, and the positions they complete, to the next connection.
    async fn drain(&mut self) {
        let mut failed = None;
        for (durable, _) in self.queue.drain(..) {
            if let Some(durable) = durable {
                match durable.await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => failed = failed.or(Some(anyhow::Error::new(e))),
                    Err(e) => failed = failed.or(Some(anyhow::Error::new(e).context("ingest task"))),
                }
            }
        }
        if let Some(e) = failed {
            tracing::warn!("WAL receiver: a batch of the last connection failed: {e:#}");
        }
    }

    /// Takes the durable batches off the front (all of them if `all`, and the oldest while
    /// more than [`MAX_IN_FLIGHT`] wait), moving `processed` to what they complete; with
    /// nothing left in flight, the timeline's durable LSN follows (GetPage need not wait for a
    /// later value). An ingest that failed is this connection's error.
    async fn settle(&mut self, timeline: &Timeline, processed: &mut Lsn, all: bool) -> anyhow::Result<()> {
        while let Some((durable, _)) = self.queue.front() {
            let done = durable.as_ref().is_none_or(|d| d.is_finished());
            if !done && !all && self.queue.len() <= MAX_IN_FLIGHT {
                break;
            }
            let Some((durable, end)) = self.queue.pop_front() else { break };
            if let Some(durable) = durable {
                durable.await.context("ingest task")?.context("store WAL values")?;
            }
            *processed = end;
        }
        if self.queue.is_empty() && timeline.advance_durable(*processed) {
            self.queued = *processed;
        }
        Ok(())
    }
}

/// Messages of WAL the decoding stage may hold (taken and not yet decoded, or decoded and not
/// yet stored): the next message is read only below it, which bounds what a connection holds
/// in memory to about this many messages (the primary sends at most 128 KiB in one).
const DECODE_AHEAD: usize = 8;

/// The decoding stage of a connection: its own task turns each message of WAL into records
/// while the receiver stores the previous message's values, so that decoding and value
/// building run on two threads. Records come back in the order the messages went in; the
/// task ends with the stage (dropped with the connection) or at its first decode error.
struct DecodeStage {
    to_decode: tokio::sync::mpsc::UnboundedSender<Bytes>,
    decoded: tokio::sync::mpsc::UnboundedReceiver<Result<Vec<DecodedRecord>, WalDecodeError>>,
    /// Messages fed and not yet taken back by [`DecodeStage::next`].
    in_stage: usize,
    task: tokio::task::JoinHandle<()>,
}

impl DecodeStage {
    fn start(mut decoder: WalDecoder) -> DecodeStage {
        let (to_decode, mut data) = tokio::sync::mpsc::unbounded_channel::<Bytes>();
        let (records, decoded) = tokio::sync::mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            while let Some(data) = data.recv().await {
                decoder.feed(&data);
                // Every whole record fed so far, or the first error.
                let result: Result<Vec<_>, _> =
                    std::iter::from_fn(|| decoder.next_record().transpose()).collect();
                let failed = result.is_err();
                if records.send(result).is_err() || failed {
                    return;
                }
            }
        });
        DecodeStage { to_decode, decoded, in_stage: 0, task }
    }

    /// Whether another message may be read (see [`DECODE_AHEAD`]).
    fn has_room(&self) -> bool {
        self.in_stage < DECODE_AHEAD
    }

    /// Whether a message fed is still to be taken back.
    fn busy(&self) -> bool {
        self.in_stage > 0
    }

    fn feed(&mut self, data: Bytes) {
        // Sent while the task lives; once it stopped (a decode error), `next` reports it.
        let _ = self.to_decode.send(data);
        self.in_stage += 1;
    }

    /// The records of the oldest message fed. Cancel-safe.
    async fn next(&mut self) -> anyhow::Result<Vec<DecodedRecord>> {
        let decoded = self.decoded.recv().await.context("the WAL decoding task ended")?;
        self.in_stage -= 1;
        decoded.map_err(decode_error)
    }
}

impl Drop for DecodeStage {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the streaming loop woke for.
enum Event {
    Message(Result<ReplicationMessage, pq::PqError>),
    Decoded(anyhow::Result<Vec<DecodedRecord>>),
    Tick,
}

struct Task {
    /// The relation sizes as this connection's records left them (cleared at each connection:
    /// a failed batch may have lost what they say; bounded between messages).
    sizes: wal_values::RelSizes,
    /// The checkpoint counters as this connection's records left them: read from storage when
    /// a connection starts streaming (what the batches before it stored), then kept here.
    counters: Option<Counters>,
    /// This connection's batches not yet known durable; settled before the next connection
    /// resumes, so that it resumes after them.
    in_flight: InFlight,
    dir: PathBuf,
    file: SourceFile,
    timeline: Arc<Timeline>,
    metrics: Arc<WalReceiverMetrics>,
    /// The tenant's: raised from the moment an import begins until it is complete (reads of
    /// the tenant are refused meanwhile).
    import_incomplete: Arc<AtomicBool>,
    /// `wal_max_record_size`.
    max_record_size: u32,
    pages: database_copy::PageSource,
    /// See [`ReceiverDeps::uploaded`].
    uploaded: Option<Arc<RemoteTimeline>>,
    /// The end of a shutdown checkpoint stored and not yet persisted as the position: once it
    /// is, the uploader is asked to upload at once. The primary waits, before it exits, until
    /// its WAL is reported flushed, which is no more than the bucket's index resumes from; the
    /// seal timer (`checkpoint_timeout`) would hold its shutdown that long.
    upload_at: Option<Lsn>,
    shared: Arc<Mutex<Shared>>,
    cancel: CancellationToken,
}

impl Task {
    async fn run(mut self) {
        let mut backoff = BACKOFF_MIN;
        let mut attempts = 0u64;
        loop {
            {
                let mut shared = lock(&self.shared);
                shared.status.state = ReceiverState::Connecting;
                shared.status.reconnects = attempts;
            }
            attempts += 1;
            let began = Instant::now();
            let result = self.stream_once().await;
            // What this connection submitted becomes durable (or fails) before the next one
            // reads the storage's durable LSN to resume after it.
            self.in_flight.drain().await;
            if self.cancel.is_cancelled() {
                return;
            }
            let reason = match result {
                Ok(()) => "the connection ended".to_string(),
                Err(e) => format!("{e:#}"),
            };
            tracing::warn!("WAL receiver: {reason}; reconnecting in {backoff:?}");
            self.metrics.connection_errors.inc();
            {
                let mut shared = lock(&self.shared);
                shared.status.state = ReceiverState::Error;
                shared.status.error = Some(reason);
            }
            if began.elapsed() > BACKOFF_MAX {
                backoff = BACKOFF_MIN;
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = self.cancel.cancelled() => return,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    }

    /// One connection: from connecting to the first error (or cancellation: `Ok`).
    async fn stream_once(&mut self) -> anyhow::Result<()> {
        self.sizes = wal_values::RelSizes::default();
        self.counters = None;
        let config =
            connstr::parse(&self.file.source.postgres).map_err(|e| anyhow::anyhow!("postgres: {e}"))?;
        let mut conn = tokio::select! {
            conn = tokio::time::timeout(CONNECT_TIMEOUT, ReplicationConn::connect(&config)) => conn
                .map_err(|_| anyhow::anyhow!("connect to {config}: no answer within {CONNECT_TIMEOUT:?}"))?
                .with_context(|| format!("connect to {config}"))?,
            () = self.cancel.cancelled() => return Ok(()),
        };
        conn.require_pg15().with_context(|| format!("{config}"))?;
        let system = conn.identify_system().await.context("IDENTIFY_SYSTEM")?;
        if let Some(id) = &self.file.system_id {
            anyhow::ensure!(
                *id == system.system_id,
                "{config} is another cluster (system id {}) than the one this tenant follows ({id})",
                system.system_id
            );
        }
        if let Some(timeline) = self.file.timeline {
            anyhow::ensure!(
                timeline == system.timeline,
                "timeline switch: the tenant follows timeline {timeline}, {config} is on timeline {} \
                 (a promotion); following a new timeline is not supported",
                system.timeline
            );
        }
        let seg_size = conn.wal_segment_size().await.context("SHOW wal_segment_size")?;
        let created = conn.ensure_physical_slot(&self.file.source.slot).await.context("create the slot")?;
        if created {
            tracing::info!(slot = self.file.source.slot, "created the replication slot");
        }
        if self.file.system_id.is_none() || self.file.timeline.is_none() {
            self.update_file(|f| {
                f.system_id = Some(system.system_id.clone());
                f.timeline = Some(system.timeline);
            })
            .await?;
        }
        if self.file.position.is_none() {
            self.import(&mut conn, system.timeline).await.context("import the base backup")?;
        }
        // Nothing is in flight (the last connection's batches were settled): what storage holds
        // is contiguous (see `InFlight`), and the next batch follows it.
        let durable_storage = self.timeline.last_durable_lsn();
        self.counters = Some(
            cluster::counters_at(&self.timeline, Lsn::LATEST)
                .await
                .context("load the checkpoint counters")?,
        );
        self.in_flight.queued = durable_storage;
        let resume = self.file.position.unwrap_or(Lsn::INVALID).max(durable_storage);
        // Streaming resumes at the start of a WAL page.
        let start = resume.block_start(WAL_PAGE_SIZE);
        conn.start_replication(&self.file.source.slot, start, system.timeline)
            .await
            .context("START_REPLICATION")?;
        let seg_size = u32::try_from(seg_size).context("wal_segment_size")?;
        let decoder = WalDecoder::with_segment_size(start, seg_size)
            .context("start the WAL decoder")?
            .max_record_len(self.max_record_size);
        let mut decoding = DecodeStage::start(decoder);
        tracing::info!(%config, start = %start, resume = %resume, timeline = system.timeline, "streaming WAL");
        {
            let mut shared = lock(&self.shared);
            shared.status.state = ReceiverState::Streaming;
            shared.status.error = None;
            shared.status.resumed_at = resume;
            shared.status.received_lsn = start;
            shared.status.durable_lsn = resume;
        }

        let mut received = start;
        let mut processed = resume;
        // What the source file says: only that is reported to the slot as flushed (`resume` may
        // be storage's durable LSN, moved past the file's position by records with no values
        // and never written down), so that a restart never resumes below the slot.
        let mut persisted = self.file.position.unwrap_or(Lsn::INVALID);
        let mut last_status = Instant::now();
        let mut last_message = Instant::now();
        loop {
            // Wake for the next status update even while the primary is quiet, so that what
            // was processed becomes durable and reported within a status interval.
            let tick = tokio::time::sleep_until((last_status + STATUS_INTERVAL).into());
            let event = tokio::select! {
                m = conn.next_message(), if decoding.has_room() => Event::Message(m),
                d = decoding.next(), if decoding.busy() => Event::Decoded(d),
                () = tick => Event::Tick,
                () = self.cancel.cancelled() => {
                    self.in_flight.settle(&self.timeline, &mut processed, true).await?;
                    self.persist(processed, &mut persisted).await?;
                    return Ok(());
                }
            };
            let mut reply_now = false;
            match event {
                // The status tick: nothing came.
                Event::Tick => anyhow::ensure!(
                    last_message.elapsed() < SILENCE_TIMEOUT,
                    "no message from {config} for {SILENCE_TIMEOUT:?}"
                ),
                Event::Message(message) => {
                    let message = message.context("replication stream")?;
                    if matches!(message, ReplicationMessage::End) {
                        // The WAL before the end is stored first: after a promotion, no later
                        // connection streams this timeline's last records again.
                        while decoding.busy() {
                            self.store(decoding.next().await?, resume, &mut processed).await?;
                        }
                    }
                    last_message = Instant::now();
                    lock(&self.shared).last_message = Some(SystemTime::now());
                    reply_now = self.handle(message, &mut decoding, &mut received)?;
                }
                Event::Decoded(decoded) => self.store(decoded?, resume, &mut processed).await?,
            }
            self.in_flight.settle(&self.timeline, &mut processed, false).await?;
            if reply_now || last_status.elapsed() >= STATUS_INTERVAL {
                self.persist(processed, &mut persisted).await?;
                if let (Some(at), Some(remote)) = (self.upload_at, &self.uploaded) {
                    if persisted >= at {
                        tracing::info!(lsn = %at, "stored the primary's shutdown checkpoint: uploading now");
                        remote.upload_now();
                        self.upload_at = None;
                    }
                }
                let written = self.in_flight.written(processed);
                let flushed = match &self.uploaded {
                    Some(remote) => persisted.min(bucket_resume_lsn(&remote.status())),
                    None => persisted,
                };
                conn.send_status(written, flushed, flushed).await.context("status update")?;
                last_status = Instant::now();
            }
        }
    }

    /// Takes one message of the stream: WAL goes to the decoding stage (its records come back
    /// through [`DecodeStage::next`], for [`Task::store`]). Whether the primary asked for a
    /// status update now.
    fn handle(
        &mut self,
        message: ReplicationMessage,
        decoding: &mut DecodeStage,
        received: &mut Lsn,
    ) -> anyhow::Result<bool> {
        match message {
            ReplicationMessage::XLogData { start: at, wal_end, data } => {
                anyhow::ensure!(at == *received, "the primary sent WAL at {at}, expected {received}: a gap");
                *received = received
                    .checked_add(data.len() as u64)
                    .with_context(|| format!("the primary sent WAL past the last LSN, at {at}"))?;
                self.metrics.received_bytes.inc_by(data.len() as u64);
                decoding.feed(data);
                let mut shared = lock(&self.shared);
                shared.status.received_lsn = *received;
                shared.status.server_wal_end = wal_end.max(*received);
                Ok(false)
            }
            ReplicationMessage::Keepalive { wal_end, reply } => {
                lock(&self.shared).status.server_wal_end = wal_end;
                Ok(reply)
            }
            ReplicationMessage::End => anyhow::bail!(
                "the primary ended the stream at {} (it shuts down, or its timeline {} ended: a \
                 promotion, which the next connection reports)",
                *received,
                self.file.timeline.unwrap_or(0)
            ),
        }
    }

    /// Takes the records one message of WAL held, in order: the values of those that end past
    /// `resume` (where this connection resumed) are submitted to storage (in LSN order;
    /// durable later, see [`InFlight`]).
    async fn store(
        &mut self,
        mut decoded: Vec<DecodedRecord>,
        resume: Lsn,
        processed: &mut Lsn,
    ) -> anyhow::Result<()> {
        decoded.retain(|r| r.end_lsn > resume);
        let mut values = Vec::new();
        let mut last_end = None;
        // The counters change with most transactions: one value per message, at the end of
        // the last record that changed them, where that record's values end.
        let mut counters_at = None;
        if let (Some(start), Some(first)) = (self.file.start_checkpoint, decoded.first()) {
            let is_ours = first.lsn == start && first.is_shutdown_checkpoint();
            anyhow::ensure!(
                is_ours,
                "this PostgreSQL was not started on the branch's base backup: its WAL must begin \
                 with the backup's shutdown checkpoint at {start}, it has a {} record (info {:#04x}) \
                 at {}",
                rmgr::rmgr_name(first.rmid).unwrap_or_default(),
                first.info,
                first.lsn
            );
            self.update_file(|f| f.start_checkpoint = None).await?;
        }
        self.load_sizes(&decoded, processed).await?;
        let records = decoded.len() as u64;
        let mut counters = self.counters.take().context("the checkpoint counters are not loaded")?;
        for record in &decoded {
            if let Some(copy) = wal_values::database_copy(record, &mut counters)? {
                // The values of the records before it stored first: the copy reads
                // them back.
                self.submit_values(&mut values, &counters, counters_at.take(), last_end.take()).await?;
                self.in_flight.settle(&self.timeline, processed, true).await?;
                let read_at = self.timeline.last_durable_lsn();
                values = database_copy::values(
                    &self.timeline,
                    &self.pages,
                    &copy,
                    read_at,
                    record.end_lsn,
                    &mut self.sizes,
                )
                .await
                .with_context(|| format!("copy database {} (FILE_COPY at {})", copy.src_db, record.lsn))?;
                counters_at = Some((values.len(), record.end_lsn));
                tracing::info!(
                    db = copy.db, template = copy.src_db, lsn = %record.lsn, values = values.len(),
                    "copied a database (CREATE DATABASE ... STRATEGY FILE_COPY)"
                );
            } else if wal_values::record_values(record, &mut self.sizes, &mut counters, &mut values)? {
                counters_at = Some((values.len(), record.end_lsn));
            }
            if self.uploaded.is_some() && record.is_shutdown_checkpoint() {
                // Persisted at its end with the padding after it, as every position is.
                self.upload_at = record.end_lsn.checked_align_up(MAXALIGN);
            }
            last_end = Some(record.end_lsn);
        }
        self.submit_values(&mut values, &counters, counters_at, last_end).await?;
        self.counters = Some(counters);
        // Between messages: what it forgets is loaded again (`load_sizes`) once this
        // message's batch, which holds the sizes it set, is durable.
        self.sizes.trim();
        self.metrics.records.inc_by(records);
        Ok(())
    }

    /// Submits `values` (taken), with the counters' value inserted where `counters_at` says,
    /// as one batch completing the WAL up to `last_end` (the end of the last record it holds
    /// the values of; `None`: no record, nothing to do).
    async fn submit_values(
        &mut self,
        values: &mut Vec<(BufferTag, Lsn, Value)>,
        counters: &Counters,
        counters_at: Option<(usize, Lsn)>,
        last_end: Option<Lsn>,
    ) -> anyhow::Result<()> {
        let mut values = std::mem::take(values);
        if let Some((at, lsn)) = counters_at {
            let value = Value::Image(Bytes::copy_from_slice(&counters.encode()));
            values.insert(at, (keys::checkpoint_key(), lsn, value));
        }
        self.metrics.values.inc_by(values.len() as u64);
        let durable = match values.is_empty() {
            true => None,
            false => Some(self.in_flight.submit(&self.timeline, values).await?),
        };
        if let Some(end) = last_end {
            // The padding to the next 8-byte boundary is processed too: no record starts in it
            // (PostgreSQL's flush position counts it as well).
            let end = end.checked_align_up(MAXALIGN).with_context(|| format!("a record ends at {end}"))?;
            self.in_flight.queue.push_back((durable, end));
        }
        Ok(())
    }

    /// Learns the sizes of the relation forks `records` touch that this connection has not
    /// seen, from storage, after every batch in flight is durable (so storage has all this
    /// receiver stored, drops included).
    async fn load_sizes(
        &mut self,
        records: &[page_types::wal::DecodedRecord],
        processed: &mut Lsn,
    ) -> anyhow::Result<()> {
        let mut missing: Vec<(page_types::keys::RelTag, u8)> = Vec::new();
        for record in records {
            for m in self.sizes.missing(record) {
                if !missing.contains(&m) {
                    missing.push(m);
                }
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        self.in_flight.settle(&self.timeline, processed, true).await?;
        for (rel, fork) in missing {
            let blocks = rel_sizes::rel_size_at(&self.timeline, rel, fork, Lsn::LATEST)
                .await
                .context("read relation sizes")?;
            self.sizes.insert(rel, fork, blocks);
        }
        Ok(())
    }

    /// Changes the source file durably: `self.file` is what the file on disk says, so it
    /// changes only once the write succeeded (a position that failed to persist must not be
    /// taken for a persisted one by the next connection).
    async fn update_file(&mut self, change: impl FnOnce(&mut SourceFile)) -> anyhow::Result<()> {
        let mut file = self.file.clone();
        change(&mut file);
        let dir = self.dir.clone();
        self.file = tokio::task::spawn_blocking(move || write_source_file(&dir, &file).map(|()| file))
            .await
            .context("write task")??;
        Ok(())
    }

    /// The initial import: a base backup over `conn` into storage (see the module doc). On
    /// success the source file has the backup's LSNs and the position at its start.
    async fn import(&mut self, conn: &mut ReplicationConn, timeline: u32) -> anyhow::Result<()> {
        let previous = self.file.import.clone();
        if previous.is_none() {
            anyhow::ensure!(
                self.timeline.stats().values == 0,
                "the tenant holds values already; a PostgreSQL source imports its cluster into a new tenant"
            );
        }
        let attempts = previous.as_ref().map_or(0, |i| i.attempts) + 1;
        // Before the file says the import began, and before anything is stored.
        self.import_incomplete.store(true, Ordering::Release);
        self.update_file(|f| f.import = Some(ImportRecord { attempts, start_lsn: None, end_lsn: None }))
            .await?;
        // The relation sizes an interrupted attempt may have stored.
        let stale: Vec<BufferTag> = if previous.is_some() {
            let tl = Arc::clone(&self.timeline);
            tokio::task::spawn_blocking(move || rel_sizes::rel_size_keys(&tl))
                .await
                .context("size keys task")?
                .context("list the relation size keys")?
        } else {
            Vec::new()
        };
        let set_status = |shared: &Mutex<Shared>, f: &dyn Fn(&mut ImportStatus)| {
            let mut shared = lock(shared);
            f(shared.status.import.get_or_insert_with(ImportStatus::default));
        };
        {
            let mut shared = lock(&self.shared);
            shared.status.state = ReceiverState::Importing;
            shared.status.import = Some(ImportStatus { attempts, ..ImportStatus::default() });
        }
        let begun = Instant::now();
        let backup = conn.base_backup(IMPORT_LABEL).await.context("BASE_BACKUP")?;
        anyhow::ensure!(
            backup.timeline == timeline,
            "the backup is of timeline {}, the server said {timeline}",
            backup.timeline
        );
        let estimated = backup.tablespaces.iter().filter_map(|t| t.size_kb).sum::<u64>() * 1024;
        set_status(&self.shared, &|i| {
            i.start_lsn = Some(backup.start_lsn);
            i.estimated_bytes = estimated;
        });
        tracing::info!(start = %backup.start_lsn, attempt = attempts, "importing a base backup");
        let mut importer = import::Importer::new();
        let mut batches = ImportBatches::new(&self.timeline, backup.start_lsn)?;
        // Every relation an interrupted attempt stored is dropped below this attempt's values:
        // its pages this attempt does not store again (blocks past a size that shrank, a
        // relation gone since) are not served as the relation's (`rel_sizes::dropped_incarnation`).
        let mut dropped: Vec<(BufferTag, Bytes)> = stale
            .iter()
            .filter_map(|k| match keys::classify(k) {
                keys::KeyKind::RelSize { rel, .. } => Some((rel.drop_key(), Bytes::new())),
                _ => None,
            })
            .collect();
        dropped.dedup();
        for chunk in dropped.chunks(4096) {
            batches.store(chunk.to_vec()).await?;
        }
        let end = loop {
            let message = tokio::select! {
                m = conn.next_backup_message() => m.context("base backup stream")?,
                () = self.cancel.cancelled() => anyhow::bail!("the import was cancelled"),
            };
            match message {
                BackupMessage::Archive { name, location } => {
                    importer.begin_archive(&name, location.as_deref())?
                }
                BackupMessage::Data(data) => {
                    importer.feed(&data)?;
                    while let Some(values) = importer.next_batch()? {
                        batches.store(values).await?;
                    }
                }
                BackupMessage::Progress(_) => {}
                BackupMessage::End { end_lsn, timeline: end_timeline } => {
                    anyhow::ensure!(end_timeline == timeline, "the backup ended on timeline {end_timeline}");
                    break end_lsn;
                }
            }
            let (progress, stored) = (importer.progress().clone(), batches.values);
            set_status(&self.shared, &|i| {
                i.bytes = progress.bytes;
                i.files = progress.files;
                i.values = stored;
            });
        };
        let mut last = importer.finish()?;
        let sized: std::collections::HashSet<BufferTag> = last.iter().map(|(k, _)| *k).collect();
        last.extend(
            stale
                .into_iter()
                .filter(|k| !sized.contains(k))
                .map(|k| (k, Bytes::from(keys::encode_rel_size(None)))),
        );
        for chunk in last.chunks(4096) {
            batches.store(chunk.to_vec()).await?;
        }
        batches.settle(0).await?;
        let progress = importer.progress().clone();
        let stored = batches.values;
        drop(batches);
        self.update_file(|f| {
            f.import = Some(ImportRecord { attempts, start_lsn: Some(backup.start_lsn), end_lsn: Some(end) });
            f.position = Some(backup.start_lsn);
        })
        .await?;
        self.timeline.advance_durable(backup.start_lsn);
        self.timeline.raise_gc_cutoff(end);
        self.import_incomplete.store(false, Ordering::Release);
        set_status(&self.shared, &|i| {
            i.done = true;
            i.end_lsn = Some(end);
            i.bytes = progress.bytes;
            i.files = progress.files;
            i.values = stored;
        });
        tracing::info!(
            start = %backup.start_lsn, end = %end, files = progress.files, bytes = progress.bytes,
            values = stored, seconds = begun.elapsed().as_secs_f64(), "imported the base backup"
        );
        Ok(())
    }

    /// Makes `processed` the durable position (the source file), if it moved.
    async fn persist(&mut self, processed: Lsn, persisted: &mut Lsn) -> anyhow::Result<()> {
        if processed > *persisted {
            self.update_file(|f| f.position = Some(processed)).await?;
            *persisted = processed;
            lock(&self.shared).status.durable_lsn = processed;
        }
        Ok(())
    }
}

/// Where a node attaching the timeline from the bucket resumes streaming: the WAL source
/// position in the uploaded index's metadata (`Lsn(0)` without one: that node would need all of
/// the WAL).
fn bucket_resume_lsn(status: &RemoteStatus) -> Lsn {
    let wal_source = status.metadata.as_ref().and_then(|m| m.wal_source.clone());
    let file = wal_source.and_then(|v| serde_json::from_value::<SourceFile>(v).ok());
    file.and_then(|f| f.position).unwrap_or(Lsn(0))
}

/// A decode error; one for a record over `wal_max_record_size` names the setting.
fn decode_error(e: WalDecodeError) -> anyhow::Error {
    let e = match e {
        WalDecodeError::RecordTooLarge { .. } => anyhow::anyhow!("{e} (the setting wal_max_record_size)"),
        e => anyhow::Error::new(e),
    };
    e.context("decode WAL")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_record_over_the_limit_is_an_error_naming_its_lsn_length_and_the_setting() {
        let e = decode_error(WalDecodeError::RecordTooLarge {
            lsn: Lsn(0x1_0000_0028),
            len: 200 << 20,
            max: 128 << 20,
        });
        let text = format!("{e:#}");
        for part in ["1/28", "209715200", "134217728", "wal_max_record_size"] {
            assert!(text.contains(part), "{text} names {part}");
        }
    }

    #[test]
    fn the_source_file_round_trips_and_refuses_what_it_does_not_know() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_source_file(dir.path()).unwrap(), None);
        let mut file = SourceFile {
            source: WalSource { postgres: "host=h user=u".into(), slot: "s".into() },
            detached: false,
            system_id: Some("7309".into()),
            timeline: Some(1),
            position: Some(Lsn(0x1_0000_0028)),
            import: Some(ImportRecord {
                attempts: 2,
                start_lsn: Some(Lsn(0x1_0000_0000)),
                end_lsn: Some(Lsn(0x1_0000_0100)),
            }),
            start_checkpoint: Some(Lsn(0x1_0000_0028)),
        };
        write_source_file(dir.path(), &file).unwrap();
        assert_eq!(read_source_file(dir.path()).unwrap().as_ref(), Some(&file));
        let text = std::fs::read_to_string(dir.path().join(SOURCE_FILE)).unwrap();
        assert!(!text.contains("detached"), "an attached source's file is as it was: {text}");
        // LSNs are written as the plain integers they always were.
        for part in ["\"position\": 4294967336", "\"start_lsn\": 4294967296", "\"end_lsn\": 4294967552"] {
            assert!(text.contains(part), "{part} in {text}");
        }
        file.detached = true;
        write_source_file(dir.path(), &file).unwrap();
        assert_eq!(read_source_file(dir.path()).unwrap(), Some(file));
        std::fs::write(dir.path().join(SOURCE_FILE), r#"{"postgres": "host=h user=u", "slot": "s"}"#)
            .unwrap();
        let minimal = read_source_file(dir.path()).unwrap().unwrap();
        assert_eq!((minimal.system_id, minimal.position, minimal.import), (None, None, None));
        assert!(!minimal.detached);
        std::fs::write(dir.path().join(SOURCE_FILE), r#"{"postgres": "x", "slot": "s", "extra": 1}"#)
            .unwrap();
        assert!(read_source_file(dir.path()).is_err());
        std::fs::write(dir.path().join(SOURCE_FILE), "{").unwrap();
        assert!(read_source_file(dir.path()).is_err());
    }

    #[test]
    fn the_status_shows_lsns_as_plain_integers() {
        let status = WalSourceStatus {
            postgres: "u@h:5432".into(),
            slot: "s".into(),
            state: ReceiverState::Streaming,
            error: None,
            resumed_at: Lsn(0x1_0000_0028),
            received_lsn: Lsn(0x1_0000_2000),
            durable_lsn: Lsn(0x1_0000_1000),
            server_wal_end: Lsn(0x1_0000_3000),
            lag_bytes: 0x2000,
            last_message: None,
            reconnects: 0,
            import: Some(ImportStatus {
                done: true,
                start_lsn: Some(Lsn(0x1_0000_0000)),
                end_lsn: None,
                ..ImportStatus::default()
            }),
        };
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["resumed_at"], 0x1_0000_0028_u64);
        assert_eq!(json["received_lsn"], 0x1_0000_2000_u64);
        assert_eq!(json["durable_lsn"], 0x1_0000_1000_u64);
        assert_eq!(json["server_wal_end"], 0x1_0000_3000_u64);
        assert_eq!(json["import"]["start_lsn"], 0x1_0000_0000_u64);
        assert!(json["import"]["end_lsn"].is_null());
    }

    #[test]
    fn sources_are_validated() {
        let ok = WalSource { postgres: "host=h user=u".into(), slot: "page_server_1".into() };
        assert!(ok.validate().is_ok());
        for (postgres, slot) in [
            ("host=h", "s"),
            ("host=h user=u", "Upper"),
            ("host=h user=u", ""),
            ("user=u sslmode=verify-full", "s"),
        ] {
            assert!(
                WalSource { postgres: postgres.into(), slot: slot.into() }.validate().is_err(),
                "{postgres} {slot}"
            );
        }
    }
}
