//! `pagebench ingest`: creates the tenant (`POST /v1/tenant`) and loads the data set of
//! [`crate::dataset`] over one page service connection, in batches of many values per Ingest
//! frame with several batches in flight.
//!
//! One connection, because the daemon applies the batches of a connection in the order sent and
//! ingest LSNs must only grow; the pipeline hides the fsync of each batch behind the next ones.
//! A sender (this task) generates and writes batches while a receiver task reads the IngestOks;
//! a semaphore of `--in-flight` permits bounds the batches written but not yet acknowledged.
//!
//! `--tenants N` loads the same data set into `<tenant>-0` .. `<tenant>-<N-1>`, one after the
//! other.
//!
//! Resuming (`--exists-ok`): the tenant must hold this data set or a prefix of it, which is
//! checked against the daemon's key space (same keys, last durable LSN on the data set's LSN
//! grid, not past its end) and the seed's first image; anything else is refused, so a resume
//! never mixes two data sets. The load then continues with the first value above the last
//! durable LSN; at the end there is nothing to do.
//!
//! Steady ingest (`--rate`, `--duration`): with `--rate R` the values go out at R per second
//! (a batch every 10 ms holds the values due by then, at most `--batch-bytes`), and with
//! `--duration S` the load stops after S seconds, the batches in flight still acknowledged; such
//! a stop is an end, not an interruption. Together with `--exists-ok` and a long
//! `--chain-length` they give a write load of updates, one record per page per round, at a fixed
//! rate, next to a `get-page` run (test_runner/performance/compaction_mixed.py). The summary
//! then also holds `acked_lsn`, the last acknowledged LSN.
//!
//! Any Error reply or broken connection stops the load: a partial data set would make every
//! later measurement wrong.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::{describe, Client, ClientReader, ServerError};
use anyhow::{bail, Context};
use page_types::Lsn;
use pageserver::page_service::proto::{ClientMessage, ServerMessage, MAX_FRAME_LEN};
use tokio::net::tcp::OwnedReadHalf;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::dataset::{Shape, FIRST_LSN};
use crate::http;
use crate::keyspace::{self, KeySpace};
use crate::report::{self, Counters};
use crate::{ShapeArgs, Target, TenantCount};

/// Longest wait for one IngestOk (an fsync of a batch, behind at most `in_flight` others).
const ACK_TIMEOUT: Duration = Duration::from_secs(120);
/// Room left in a frame for its header (len, type, request id, count).
const FRAME_OVERHEAD: usize = 4 + 1 + 8 + 4;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    shape: ShapeArgs,
    /// Go on if the tenant exists already (HTTP 409), resuming after its last durable LSN.
    #[arg(long)]
    exists_ok: bool,
    /// Target size of one Ingest frame in bytes (at most 8 MiB).
    #[arg(long, default_value_t = 1 << 20, value_parser = clap::value_parser!(u32).range(9000..=i64::from(MAX_FRAME_LEN)))]
    batch_bytes: u32,
    /// Ingest frames written and not yet acknowledged.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    in_flight: u32,
    /// Values per second (a steady write load); default: as fast as the daemon takes them.
    #[arg(long, value_name = "VALUES_PER_S")]
    rate: Option<f64>,
    /// Stop after this many seconds (the batches in flight are still acknowledged); default:
    /// when the data set is loaded.
    #[arg(long, value_name = "SECONDS")]
    duration: Option<f64>,
    /// Per-tenant walredo process kind, set when the tenant is created (default: the daemon's).
    #[arg(long, value_parser = ["sync", "async", "auto"])]
    walredo_process_kind: Option<String>,
}

/// A batch written and not yet acknowledged.
struct Pending {
    request_id: u64,
    last_lsn: u64,
    values: u64,
    bytes: u64,
}

/// Loads the data set (or resumes it with `--exists-ok`) until done or `cancel`.
///
/// Not cancel-safe in the sense that batches already sent stay ingested; a later run with
/// `--exists-ok` resumes after the last durable one.
pub async fn run(args: Args, cancel: CancellationToken) -> anyhow::Result<()> {
    if args.target.tenants == TenantCount::All {
        bail!("check --tenants: ingest creates its tenants, give a number");
    }
    if let Some(rate) = args.rate.filter(|r| !(r.is_finite() && *r > 0.0)) {
        bail!("check --rate: {rate} is not a positive number of values per second");
    }
    let duration = args.duration.map(|d| crate::positive_seconds("--duration", d)).transpose()?;
    let shape = args.shape.shape();
    let ids = args.target.tenant_ids().await?;
    let (mut values, mut bytes, mut interrupted, mut acked_lsn) = (0, 0, false, 0);
    let start = Instant::now();
    let deadline = duration.and_then(|d| start.checked_add(d));
    for id in &ids {
        if cancel.is_cancelled() {
            interrupted = true;
            break;
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            break;
        }
        let loaded = ingest_one(&args, id, shape, deadline, cancel.clone()).await?;
        values += loaded.values;
        bytes += loaded.bytes;
        interrupted |= loaded.interrupted;
        acked_lsn = loaded.acked_lsn;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let summary = serde_json::json!({
        "tenants": ids.len(),
        "values": values,
        "bytes": bytes,
        "seconds": (elapsed * 1000.0).round() / 1000.0,
        "values_per_s": (values as f64 / elapsed.max(1e-9)).round(),
        "mb_per_s": (bytes as f64 / 1e6 / elapsed.max(1e-9) * 10.0).round() / 10.0,
        "end_lsn": shape.end_lsn(),
        "acked_lsn": acked_lsn,
        "complete": !interrupted,
    });
    outln!("{summary}");
    if interrupted {
        bail!("load the whole data set: interrupted");
    }
    Ok(())
}

/// What one tenant's load did.
struct Loaded {
    values: u64,
    bytes: u64,
    interrupted: bool,
    /// The last acknowledged LSN (the tenant's last durable LSN if nothing was loaded).
    acked_lsn: u64,
}

/// Creates `tenant` (or, with `--exists-ok`, checks that it holds this shape's data set or a
/// prefix of it) and loads the values it does not have yet.
async fn ingest_one(
    args: &Args,
    tenant: &str,
    shape: Shape,
    deadline: Option<Instant>,
    cancel: CancellationToken,
) -> anyhow::Result<Loaded> {
    let existed = create_tenant(args, tenant).await?;
    let mut client = Client::connect(args.target.page_service.as_str(), tenant).await?;
    if existed {
        check_existing(args, tenant, &shape, &mut client).await.with_context(|| {
            format!(
                "resume tenant {tenant}: it holds another data set than --relations {} --blocks {} \
                 --chain-length {} --seed {} (use another --tenant, or the flags it was loaded with)",
                shape.relations, shape.blocks, shape.chain_length, shape.seed
            )
        })?;
    }
    let last_durable_lsn = client.last_durable_lsn();
    let first_value = shape.first_value_above(last_durable_lsn);
    let total = shape.values();
    if last_durable_lsn >= FIRST_LSN && first_value < total {
        errln!(
            "ingest: tenant {tenant} is at LSN {}: resuming with value {first_value} of {total}",
            Lsn(last_durable_lsn)
        );
    }
    if first_value >= total {
        errln!(
            "ingest: tenant {tenant} is at LSN {}, the data set's end LSN: nothing to load",
            Lsn(last_durable_lsn)
        );
    }
    errln!(
        "ingest: {} pages ({} relations x {} blocks), chain length {}, {} values, LSNs {}..={}",
        shape.pages(),
        shape.relations,
        shape.blocks,
        shape.chain_length,
        total,
        Lsn(shape.lsn_of_value(0)),
        Lsn(shape.end_lsn())
    );

    let start = Instant::now();
    let counters = Arc::new(Counters::default());
    let stop_progress = CancellationToken::new();
    let to_load = total - first_value;
    let progress = tokio::spawn(report::progress(
        counters.clone(),
        start,
        stop_progress.clone(),
        Box::new(move |t| {
            format!(
                "ingest: {:5.1}% {}/{} values, {:.0} values/s, {:.1} MB/s",
                100.0 * t.done as f64 / to_load.max(1) as f64,
                t.done,
                to_load,
                t.done_per_s,
                t.bytes_per_s / 1e6
            )
        }),
    ));

    let acked = Arc::new(AtomicU64::new(last_durable_lsn));
    let pace = Pace { rate: args.rate, deadline };
    let outcome =
        load(client, shape, first_value, args, pace, counters.clone(), acked.clone(), cancel.clone()).await;
    stop_progress.cancel();
    let _ = progress.await;
    outcome.with_context(|| format!("load tenant {tenant}"))?;

    let elapsed = start.elapsed().as_secs_f64();
    let (values, _, bytes) = counters.snapshot();
    let interrupted = cancel.is_cancelled() && first_value + values < total;
    errln!(
        "ingest: {}tenant {tenant}: loaded {values} values ({:.1} MB) in {elapsed:.1} s: {:.0} values/s, {:.1} MB/s",
        if interrupted { "interrupted: " } else { "" },
        bytes as f64 / 1e6,
        values as f64 / elapsed.max(1e-9),
        bytes as f64 / 1e6 / elapsed.max(1e-9),
    );
    Ok(Loaded { values, bytes, interrupted, acked_lsn: acked.load(Ordering::Relaxed) })
}

/// An existing tenant must hold `shape`'s data set, or a prefix of it: the same keys, a last
/// durable LSN on the data set's LSN grid, and (if any page is stored) the seed's first image.
async fn check_existing(args: &Args, tenant: &str, shape: &Shape, client: &mut Client) -> anyhow::Result<()> {
    let keyspace = KeySpace::fetch(&args.target.http, tenant).await?;
    keyspace.check_shape(shape, false)?;
    if keyspace.keys > 0 {
        keyspace::check_seed(client, shape).await?;
    }
    Ok(())
}

/// `POST /v1/tenant`; 409 is fine only with `--exists-ok`. Returns whether the tenant existed.
async fn create_tenant(args: &Args, tenant: &str) -> anyhow::Result<bool> {
    let mut body = serde_json::json!({ "id": tenant });
    if let Some(kind) = &args.walredo_process_kind {
        body["config"] = serde_json::json!({ "walredo_process_kind": kind });
    }
    let response = http::request_json(&args.target.http, "POST", "/v1/tenant", Some(&body)).await?;
    match response.status {
        200 | 201 => {
            errln!("ingest: created tenant {tenant}");
            Ok(false)
        }
        409 if args.exists_ok => {
            errln!("ingest: tenant {tenant} exists already (--exists-ok)");
            Ok(true)
        }
        409 => bail!("create tenant {tenant}: it exists already (pass --exists-ok to load into it)"),
        status => bail!("create tenant {tenant}: HTTP {status}: {}", response.body.trim()),
    }
}

/// How fast and how long `load` writes.
struct Pace {
    /// Values per second, if limited.
    rate: Option<f64>,
    /// No batch is started after this.
    deadline: Option<Instant>,
}

/// How often a rate-limited load sends the values due.
const RATE_TICK: Duration = Duration::from_millis(10);

impl Pace {
    /// How many values may be sent now, `elapsed` after the start with `sent` sent already
    /// (`u64::MAX` without a rate), or `Err(wait)` until the next value is due.
    fn allowance(&self, elapsed: Duration, sent: u64) -> Result<u64, Duration> {
        let Some(rate) = self.rate else { return Ok(u64::MAX) };
        let due = (rate * elapsed.as_secs_f64()) as u64;
        if due > sent {
            return Ok(due - sent);
        }
        let next_due = Duration::from_secs_f64((sent + 1) as f64 / rate);
        Err(next_due.saturating_sub(elapsed).max(RATE_TICK))
    }
}

/// Writes every value from `first_value` on (or until the pace's deadline), in batches, and
/// waits for the last IngestOk.
#[allow(clippy::too_many_arguments)]
async fn load(
    client: Client,
    shape: Shape,
    first_value: u64,
    args: &Args,
    pace: Pace,
    counters: Arc<Counters>,
    acked: Arc<AtomicU64>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let in_flight = args.in_flight as usize;
    let (reader, mut writer) = client.into_split();
    let permits = Arc::new(Semaphore::new(in_flight));
    let (pending_tx, pending_rx) = mpsc::channel::<Pending>(in_flight);
    // The receiver cancels this when it fails, so that the sender stops waiting for permits.
    let failed = cancel.child_token();
    let receiver =
        tokio::spawn(receive(reader, pending_rx, permits.clone(), counters, acked, failed.clone()));

    let budget = args.batch_bytes as usize - FRAME_OVERHEAD;
    let mut next = first_value;
    let mut request_id = 0u64;
    let start = Instant::now();
    let sent: anyhow::Result<()> = async {
        while next < shape.values() {
            if pace.deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            let allowed = match pace.allowance(start.elapsed(), next - first_value) {
                Ok(allowed) => allowed,
                Err(wait) => {
                    tokio::select! {
                        _ = failed.cancelled() => break,
                        _ = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            let permit = tokio::select! {
                _ = failed.cancelled() => break,
                permit = permits.acquire() => permit.context("wait for an ingest slot")?,
            };
            permit.forget();
            let mut values = Vec::new();
            let mut bytes = FRAME_OVERHEAD;
            while next < shape.values() && (values.len() as u64) < allowed {
                let value = shape.value(next);
                let len = Shape::encoded_len(&value);
                if !values.is_empty() && bytes + len > budget {
                    break;
                }
                bytes += len;
                values.push(value);
                next += 1;
            }
            request_id += 1;
            let last_lsn = values.last().map_or(0, |v| v.lsn);
            let pending = Pending { request_id, last_lsn, values: values.len() as u64, bytes: bytes as u64 };
            writer.send(&ClientMessage::Ingest { request_id, values });
            if pending_tx.send(pending).await.is_err() {
                break; // the receiver stopped; its error is the one to report
            }
            tokio::select! {
                _ = failed.cancelled() => break,
                flushed = writer.flush() => flushed?,
            }
        }
        Ok(())
    }
    .await;
    // No more batches: the receiver ends after the last acknowledgement. The writer stays open
    // until then, so the daemon does not see EOF with batches still in flight.
    drop(pending_tx);
    let received = match sent {
        Ok(()) => receiver.await.context("join the ingest receiver")?,
        Err(send_error) => {
            // The connection broke under the sender; the receiver may hold the daemon's reason
            // (an Error reply before the close), which says more than a write error.
            match tokio::time::timeout(Duration::from_secs(2), receiver).await {
                Ok(Ok(Err(receive_error))) => Err(receive_error),
                _ => Err(send_error),
            }
        }
    };
    drop(writer);
    received
}

/// Reads one IngestOk per pending batch, in order.
async fn receive(
    mut reader: ClientReader<OwnedReadHalf>,
    mut pending_rx: mpsc::Receiver<Pending>,
    permits: Arc<Semaphore>,
    counters: Arc<Counters>,
    acked: Arc<AtomicU64>,
    failed: CancellationToken,
) -> anyhow::Result<()> {
    let result = async {
        while let Some(pending) = pending_rx.recv().await {
            let reply = tokio::time::timeout(ACK_TIMEOUT, reader.recv()).await.with_context(|| {
                format!("wait for ingest batch {}: no answer in {ACK_TIMEOUT:?}", pending.request_id)
            })?;
            match reply.context("read an ingest acknowledgement")? {
                ServerMessage::IngestOk { request_id, durable_lsn }
                    if request_id == pending.request_id && durable_lsn == pending.last_lsn => {}
                ServerMessage::Error { request_id, code, message } => {
                    return Err(ServerError { request_id, code, message }).with_context(|| {
                        format!("ingest batch {} (up to LSN {})", pending.request_id, Lsn(pending.last_lsn))
                    });
                }
                other => bail!(
                    "ingest batch {} up to LSN {}: expected its IngestOk, got {}",
                    pending.request_id,
                    Lsn(pending.last_lsn),
                    describe(&other)
                ),
            }
            acked.store(pending.last_lsn, Ordering::Relaxed);
            counters.done.fetch_add(pending.values, Ordering::Relaxed);
            counters.bytes.fetch_add(pending.bytes, Ordering::Relaxed);
            permits.add_permits(1);
        }
        Ok(())
    }
    .await;
    if result.is_err() {
        failed.cancel();
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pace_without_rate_allows_everything() {
        let pace = Pace { rate: None, deadline: None };
        assert_eq!(pace.allowance(Duration::ZERO, 0), Ok(u64::MAX));
    }

    #[test]
    fn pace_with_rate_allows_what_is_due_and_waits_for_the_next() {
        let pace = Pace { rate: Some(1000.0), deadline: None };
        // 1000 values/s: 25 due after 25 ms, 20 sent already.
        assert_eq!(pace.allowance(Duration::from_millis(25), 20), Ok(5));
        // All due values sent: wait at least one tick.
        assert_eq!(pace.allowance(Duration::from_millis(25), 25), Err(RATE_TICK));
        // A slow rate waits until its next value is due.
        let slow = Pace { rate: Some(10.0), deadline: None };
        assert_eq!(slow.allowance(Duration::from_millis(150), 1), Err(Duration::from_millis(50)));
        assert_eq!(slow.allowance(Duration::from_millis(200), 1), Ok(1));
    }
}
