//! `pagectl receivewal`: streams WAL from a PostgreSQL 15 primary over physical replication,
//! with the pageserver's own replication client (`postgres::pq`), into segment
//! files named and laid out as in `pg_wal` (as `pg_receivewal` does). An operator checks with it
//! that a WAL source is reachable and streams (address, authentication, slot); the tests check
//! the client with it against the server's own `pg_wal`, byte for byte.
//!
//! It connects, checks the server is PostgreSQL 15, creates the physical slot if it is missing,
//! and streams from `--start` (default: the start of the segment of the server's current flush
//! position, as `pg_receivewal` starts, so that every file is whole from its beginning) until `--end` is received (default: until interrupted). Each XLogData is written
//! at its position in its segment file; written bytes are made durable (fdatasync) before the
//! position is reported back as flushed, so the slot keeps everything not yet on disk here.
//!
//! Invariant: a file gets only the bytes the server sent for its range; nothing is written past
//! `--end` (the tail of the last message is cut), and a reconnect is not attempted (a tool run
//! by hand reports the error and exits 1).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use page_types::Lsn;
use pageserver::postgres::connstr;
use pageserver::postgres::pq::{ReplicationConn, ReplicationMessage};

/// How often the received position is reported (PostgreSQL's `wal_receiver_status_interval`).
const STATUS_INTERVAL: Duration = Duration::from_secs(10);

pub struct Args {
    pub source: String,
    pub slot: String,
    pub start: Option<Lsn>,
    pub end: Option<Lsn>,
    pub dir: PathBuf,
}

/// What one run received.
pub struct Received {
    pub start: Lsn,
    pub end: Lsn,
    pub timeline: u32,
    pub created_slot: bool,
}

pub async fn run(args: &Args) -> anyhow::Result<Received> {
    let config = connstr::parse(&args.source).map_err(|e| anyhow::anyhow!("invalid --source: {e}"))?;
    let mut conn = ReplicationConn::connect(&config).await.with_context(|| format!("connect to {config}"))?;
    conn.require_pg15().with_context(|| format!("{config}"))?;
    let system = conn.identify_system().await.context("IDENTIFY_SYSTEM")?;
    let seg_size = conn.wal_segment_size().await.context("SHOW wal_segment_size")?;
    let created_slot = conn.ensure_physical_slot(&args.slot).await.context("create the slot")?;
    let start = args.start.unwrap_or(Lsn(system.xlog_pos.0 - system.xlog_pos.0 % seg_size));
    if let Some(end) = args.end {
        anyhow::ensure!(end > start, "--end {end} is not above the start {start}");
    }
    std::fs::create_dir_all(&args.dir).with_context(|| format!("create {}", args.dir.display()))?;
    conn.start_replication(&args.slot, start, system.timeline).await.context("START_REPLICATION")?;

    let mut segments = Segments { dir: args.dir.clone(), timeline: system.timeline, seg_size, open: None };
    let mut received = start;
    let mut flushed = start;
    let mut last_status = Instant::now();
    loop {
        if args.end.is_some_and(|end| received >= end) {
            break;
        }
        let message = tokio::time::timeout(STATUS_INTERVAL, conn.next_message()).await;
        let reply_now = match message {
            Err(_) => true,
            Ok(Err(e)) => return Err(e).context("replication stream"),
            Ok(Ok(ReplicationMessage::End)) => {
                anyhow::bail!(
                    "the server ended the stream at {received}: its timeline {} ended",
                    system.timeline
                )
            }
            Ok(Ok(ReplicationMessage::Keepalive { reply, .. })) => reply,
            Ok(Ok(ReplicationMessage::XLogData { start: at, data, .. })) => {
                anyhow::ensure!(at == received, "the server sent WAL at {at}, expected {received}: a gap");
                let keep = match args.end {
                    Some(end) => data.len().min(usize::try_from(end.0 - at.0).unwrap_or(usize::MAX)),
                    None => data.len(),
                };
                segments.write(at, &data[..keep])?;
                received = Lsn(at.0 + keep as u64);
                false
            }
        };
        if reply_now || last_status.elapsed() >= STATUS_INTERVAL {
            segments.sync()?;
            flushed = received;
            conn.send_status(received, flushed, flushed).await.context("send a status update")?;
            last_status = Instant::now();
        }
    }
    segments.sync()?;
    if flushed < received {
        conn.send_status(received, received, received).await.context("send a status update")?;
    }
    Ok(Received { start, end: received, timeline: system.timeline, created_slot })
}

/// The segment files being written.
struct Segments {
    dir: PathBuf,
    timeline: u32,
    seg_size: u64,
    open: Option<(u64, File)>,
}

impl Segments {
    fn write(&mut self, mut at: Lsn, mut data: &[u8]) -> anyhow::Result<()> {
        while !data.is_empty() {
            let segno = at.0 / self.seg_size;
            let offset = at.0 % self.seg_size;
            let n = data.len().min((self.seg_size - offset) as usize);
            let file = self.file(segno)?;
            file.write_all_at(&data[..n], offset).context("write WAL")?;
            data = &data[n..];
            at = Lsn(at.0 + n as u64);
        }
        Ok(())
    }

    fn file(&mut self, segno: u64) -> anyhow::Result<&File> {
        if self.open.as_ref().map(|(n, _)| *n) != Some(segno) {
            self.sync()?;
            let segs_per_id = 0x1_0000_0000 / self.seg_size;
            let name = format!("{:08X}{:08X}{:08X}", self.timeline, segno / segs_per_id, segno % segs_per_id);
            let path = self.dir.join(name);
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
                .with_context(|| format!("open {}", path.display()))?;
            file.set_len(self.seg_size).with_context(|| format!("size {}", path.display()))?;
            self.open = Some((segno, file));
        }
        let (_, file) = self.open.as_ref().context("a segment file is open")?;
        Ok(file)
    }

    fn sync(&mut self) -> anyhow::Result<()> {
        if let Some((_, file)) = &self.open {
            file.sync_data().context("fdatasync WAL")?;
        }
        sync_dir(&self.dir)
    }
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("fsync {}", dir.display()))
}
