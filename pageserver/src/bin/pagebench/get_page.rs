//! `pagebench get-page`: closed-loop GetPage load over `--connections` connections per tenant
//! (`--tenants N` or `all`), each with up to `--depth` requests in flight, for `--duration`
//! seconds.
//!
//! Method:
//! - each tenant's key space comes from the daemon (`GET /v1/tenant/{id}/keyspace`); shape flags
//!   are needed only for `--verify`, and when given are checked against it (and the seed against
//!   the first page) before the run;
//! - all connections are opened (Hello) before the clock starts;
//! - per connection a sender task and a receiver task share the split client: the sender waits
//!   for a free slot (a semaphore of `depth` permits), takes every free slot at once, encodes one
//!   GetPage per slot and writes them in one flush; the receiver reads the replies in order and
//!   gives each slot back. Latency is from just before the encode to the whole reply read, in
//!   microseconds, into an HDR histogram per connection (merged at the end);
//! - keys are uniform over the tenant's keys (a SplitMix64 per connection, from `--seed`);
//!   `--lsn latest` asks for the latest LSN, `--lsn random` for an LSN uniform over the key
//!   space's [all_keys_from, last durable LSN], where every key exists;
//! - after the duration the senders stop and the replies in flight are still read and counted;
//!   `rps` is requests over the time until the last one came back.
//!
//! Errors (an Error reply, a page that fails `--verify`, a timeout, a broken connection and the
//! requests lost with it) are counted and the first few printed; they never stop the run. A
//! broken connection is not reopened. More than `--max-errors` errors (default 0) make the exit
//! status 1, after the summary.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use hdrhistogram::Histogram;
use page_types::Lsn;
use pageserver::page_service::client::{describe, Client, ClientReader, ClientWriter};
use pageserver::page_service::proto::{ClientMessage, ServerMessage, LSN_LATEST};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use walredo_proc::protocol::BufferTag;

use crate::dataset::{Shape, SplitMix64, DEFAULT_SEED};
use crate::keyspace::{self, KeySpace};
use crate::report::{self, Counters};
use crate::{OptionalShapeArgs, Target};

/// Error messages printed in full; later ones are only counted.
const PRINTED_ERRORS: usize = 5;
/// The daemon's per-connection bound on requests in flight (page_service::MAX_IN_FLIGHT);
/// a deeper pipeline would only queue in the socket.
const MAX_DEPTH: u32 = 256;

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LsnMode {
    /// The daemon's latest durable LSN.
    Latest,
    /// Uniform among the LSNs at which every page exists (after all images).
    Random,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    target: Target,
    #[command(flatten)]
    shape: OptionalShapeArgs,
    /// Connections per tenant, each one with its own sender and receiver.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    connections: u32,
    /// Seconds of load.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Requests in flight per connection (pipelining).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_DEPTH)))]
    depth: u32,
    /// LSN of the requests.
    #[arg(long, value_enum, default_value_t = LsnMode::Latest)]
    lsn: LsnMode,
    /// Compare every page with the one computed locally from the data set (costs client CPU);
    /// needs the shape flags given to `ingest` (defaults: those of `ingest`).
    #[arg(long)]
    verify: bool,
    /// Errors tolerated before the exit status is 1 (the run goes on either way).
    #[arg(long, default_value_t = 0)]
    max_errors: u64,
    /// Seconds to wait for one reply before the connection counts as broken.
    #[arg(long, default_value_t = 30.0)]
    timeout: f64,
    /// Runtime worker threads of pagebench itself (1: a current-thread runtime).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub threads: u32,
}

/// What the tasks of every connection share.
struct Shared {
    /// With `--verify`: the data set every page is checked against.
    verify: Option<Shape>,
    lsn: LsnMode,
    timeout: Duration,
    depth: usize,
    counters: Arc<Counters>,
    printed_errors: AtomicUsize,
}

impl Shared {
    /// Counts an error under `kind`; prints the first few.
    fn error(&self, stats: &mut ConnStats, kind: &str, count: u64, message: impl FnOnce() -> String) {
        self.counters.errors.fetch_add(count, Ordering::Relaxed);
        self.counters.done.fetch_add(count, Ordering::Relaxed);
        stats.errors += count;
        *stats.error_kinds.entry(kind.to_string()).or_default() += count;
        if self.printed_errors.fetch_add(1, Ordering::Relaxed) < PRINTED_ERRORS {
            errln!("get-page: error ({kind}): {}", message());
        } else if self.printed_errors.load(Ordering::Relaxed) == PRINTED_ERRORS + 1 {
            errln!("get-page: further errors are only counted");
        }
    }
}

/// A request written and not yet answered.
struct InFlight {
    request_id: u64,
    key: BufferTag,
    lsn: u64,
    sent: Instant,
}

/// One tenant's part of the run.
struct TenantLoad {
    id: String,
    keyspace: KeySpace,
}

/// What one connection measured.
struct ConnStats {
    latency: Histogram<u64>,
    requests: u64,
    errors: u64,
    error_kinds: BTreeMap<String, u64>,
}

impl ConnStats {
    fn new() -> Self {
        ConnStats {
            latency: report::latency_histogram(),
            requests: 0,
            errors: 0,
            error_kinds: BTreeMap::new(),
        }
    }
}

/// Runs the benchmark until its duration is over or `cancel`, then prints the summary.
///
/// Cancel-safe in effect: dropping it drops the connections; nothing on the daemon is left half
/// done (GetPage has no side effects).
pub async fn run(args: Args, cancel: CancellationToken) -> anyhow::Result<()> {
    if !(args.duration.is_finite() && args.duration > 0.0) {
        bail!("check --duration: {} is not a positive number of seconds", args.duration);
    }
    if !(args.timeout.is_finite() && args.timeout > 0.0) {
        bail!("check --timeout: {} is not a positive number of seconds", args.timeout);
    }
    let shape = args.shape.shape(args.verify);
    let tenants = discover(&args, shape.as_ref()).await?;
    let clients = connect_all(&args, &tenants, shape.as_ref()).await?;
    let pages: u64 = tenants.iter().map(|t| t.keyspace.keys).sum();

    let shared = Arc::new(Shared {
        verify: shape.filter(|_| args.verify),
        lsn: args.lsn,
        timeout: Duration::from_secs_f64(args.timeout),
        depth: args.depth as usize,
        counters: Arc::new(Counters::default()),
        printed_errors: AtomicUsize::new(0),
    });
    errln!(
        "get-page: {} tenant(s) x {} connections, depth {}, lsn {:?}, {pages} pages, {} s{}",
        tenants.len(),
        args.connections,
        args.depth,
        args.lsn,
        args.duration,
        if args.verify { ", verifying pages" } else { "" }
    );

    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.duration);
    let stop_progress = CancellationToken::new();
    let progress = tokio::spawn(report::progress(
        shared.counters.clone(),
        start,
        stop_progress.clone(),
        Box::new(move |t| {
            format!(
                "get-page: {:5.1} s: {:.0} requests/s, {} done, {} errors",
                t.elapsed.as_secs_f64(),
                t.done_per_s,
                t.done,
                t.errors
            )
        }),
    ));

    let seed = args.shape.seed.unwrap_or(DEFAULT_SEED);
    let mut connections = JoinSet::new();
    for (index, (tenant, client)) in clients.into_iter().enumerate() {
        let rng = SplitMix64::new(
            seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x0067_6574_7061_6765,
        );
        connections.spawn(run_connection(
            client,
            tenant,
            index,
            rng,
            shared.clone(),
            deadline,
            cancel.clone(),
        ));
    }
    let mut latency = report::latency_histogram();
    let (mut requests, mut errors) = (0u64, 0u64);
    let mut error_kinds = BTreeMap::<String, u64>::new();
    while let Some(joined) = connections.join_next().await {
        let stats = joined.context("join a connection task")?;
        latency.add(&stats.latency).context("merge latency histograms")?;
        requests += stats.requests;
        errors += stats.errors;
        for (kind, count) in stats.error_kinds {
            *error_kinds.entry(kind).or_default() += count;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    stop_progress.cancel();
    let _ = progress.await;

    let rps = requests as f64 / elapsed.max(1e-9);
    let latency_us = report::latency_json(&latency);
    errln!(
        "get-page: {requests} requests, {errors} errors in {elapsed:.2} s: {rps:.0} requests/s, latency us p50 {} p99 {} p99.9 {} p99.99 {}",
        latency_us["p50"], latency_us["p99"], latency_us["p999"], latency_us["p9999"]
    );
    let summary = serde_json::json!({
        "requests": requests,
        "errors": errors,
        "error_kinds": error_kinds,
        "rps": (rps * 10.0).round() / 10.0,
        "duration_s": (elapsed * 1000.0).round() / 1000.0,
        "tenants": tenants.len(),
        "connections": args.connections,
        "depth": args.depth,
        "lsn": match args.lsn { LsnMode::Latest => "latest", LsnMode::Random => "random" },
        "verify": args.verify,
        "pages": pages,
        "chain_length": shape.map(|s| s.chain_length),
        "latency_us": latency_us,
    });
    outln!("{summary}");
    if errors > args.max_errors {
        bail!(
            "run without errors: {errors} of {} requests failed (--max-errors {})",
            requests + errors,
            args.max_errors
        );
    }
    Ok(())
}

/// Each tenant's key space; with a shape, checks that every tenant holds that data set.
async fn discover(args: &Args, shape: Option<&Shape>) -> anyhow::Result<Vec<Arc<TenantLoad>>> {
    let mut tenants = Vec::new();
    for id in args.target.tenant_ids().await? {
        let keyspace = KeySpace::fetch(&args.target.http, &id).await?;
        if keyspace.keys == 0 {
            bail!("check the data set: tenant {id} has no pages; load one with `pagebench ingest`");
        }
        if let Some(shape) = shape {
            keyspace.check_shape(shape, true).with_context(|| {
                format!(
                    "check the data set: tenant {id} does not hold the data set of --relations {} --blocks {} \
                     --chain-length {} (get-page needs these only for --verify; run `pagebench ingest` with them)",
                    shape.relations, shape.blocks, shape.chain_length
                )
            })?;
        }
        tenants.push(Arc::new(TenantLoad { id, keyspace }));
    }
    Ok(tenants)
}

/// Opens every connection (concurrently), `--connections` per tenant; with `--verify`, checks
/// the seed on the first connection of each tenant.
async fn connect_all(
    args: &Args,
    tenants: &[Arc<TenantLoad>],
    shape: Option<&Shape>,
) -> anyhow::Result<Vec<(Arc<TenantLoad>, Client)>> {
    let mut connecting = JoinSet::new();
    for tenant in tenants {
        for _ in 0..args.connections {
            let (addr, tenant) = (args.target.page_service.clone(), tenant.clone());
            connecting.spawn(async move {
                let client = Client::connect(addr.as_str(), &tenant.id).await;
                (tenant, client)
            });
        }
    }
    let mut clients = Vec::with_capacity(tenants.len() * args.connections as usize);
    while let Some(joined) = connecting.join_next().await {
        let (tenant, client) = joined.context("join a connect task")?;
        clients.push((tenant, client?));
    }
    if let (Some(shape), true) = (shape, args.verify) {
        for tenant in tenants {
            if let Some((_, client)) = clients.iter_mut().find(|(t, _)| Arc::ptr_eq(t, tenant)) {
                keyspace::check_seed(client, shape).await.with_context(|| {
                    format!("check the data set of tenant {} (--seed {})", tenant.id, shape.seed)
                })?;
            }
        }
    }
    Ok(clients)
}

async fn run_connection(
    client: Client,
    tenant: Arc<TenantLoad>,
    index: usize,
    rng: SplitMix64,
    shared: Arc<Shared>,
    deadline: Instant,
    cancel: CancellationToken,
) -> ConnStats {
    let (reader, writer) = client.into_split();
    let permits = Arc::new(Semaphore::new(shared.depth));
    let (in_flight_tx, in_flight_rx) = mpsc::channel::<InFlight>(shared.depth);
    // Cancelled by Ctrl-C, or by the receiver when the connection breaks.
    let stop = cancel.child_token();
    let sender_error = Arc::new(Mutex::new(None::<anyhow::Error>));
    let sender = tokio::spawn(send(
        writer,
        in_flight_tx,
        permits.clone(),
        shared.clone(),
        tenant.clone(),
        rng,
        deadline,
        stop.clone(),
        sender_error.clone(),
    ));
    let mut stats = receive(reader, in_flight_rx, permits, &shared, stop).await;
    // The writer is dropped only now: the daemon never sees EOF while replies are owed.
    let _writer = sender.await;
    let failed_write = sender_error.lock().unwrap_or_else(|poison| poison.into_inner()).take();
    if let Some(e) = failed_write {
        shared.error(&mut stats, "connection", 0, || {
            format!("connection {index} (tenant {}): failed to {e:#}", tenant.id)
        });
    }
    stats
}

#[allow(clippy::too_many_arguments)]
async fn send(
    mut writer: ClientWriter<OwnedWriteHalf>,
    in_flight_tx: mpsc::Sender<InFlight>,
    permits: Arc<Semaphore>,
    shared: Arc<Shared>,
    tenant: Arc<TenantLoad>,
    mut rng: SplitMix64,
    deadline: Instant,
    stop: CancellationToken,
    error: Arc<Mutex<Option<anyhow::Error>>>,
) -> ClientWriter<OwnedWriteHalf> {
    let keyspace = &tenant.keyspace;
    let (low_lsn, high_lsn) = (keyspace.all_keys_from, keyspace.last_durable_lsn.max(keyspace.all_keys_from));
    let mut request_id = 0u64;
    let deadline = tokio::time::Instant::from_std(deadline);
    loop {
        let permit = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep_until(deadline) => break,
            permit = permits.acquire() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        permit.forget();
        let mut slots = 1;
        while slots < shared.depth {
            match permits.try_acquire() {
                Ok(permit) => {
                    permit.forget();
                    slots += 1;
                }
                Err(_) => break,
            }
        }
        let sent = Instant::now();
        for _ in 0..slots {
            request_id += 1;
            let key = keyspace.key(rng.below(keyspace.keys));
            let lsn = match shared.lsn {
                LsnMode::Latest => LSN_LATEST,
                LsnMode::Random => low_lsn + rng.below(high_lsn - low_lsn + 1),
            };
            writer.send(&ClientMessage::GetPage { request_id, key, lsn });
            // Never waits: at most `depth` requests exist, and the channel holds `depth`.
            if in_flight_tx.send(InFlight { request_id, key, lsn, sent }).await.is_err() {
                return writer; // the receiver stopped
            }
        }
        tokio::select! {
            biased;
            flushed = writer.flush() => if let Err(e) = flushed {
                *error.lock().unwrap_or_else(|poison| poison.into_inner()) = Some(e);
                stop.cancel();
                break;
            },
            _ = stop.cancelled() => break,
        }
    }
    writer
}

async fn receive(
    mut reader: ClientReader<OwnedReadHalf>,
    mut in_flight_rx: mpsc::Receiver<InFlight>,
    permits: Arc<Semaphore>,
    shared: &Shared,
    stop: CancellationToken,
) -> ConnStats {
    let mut stats = ConnStats::new();
    while let Some(request) = in_flight_rx.recv().await {
        let reply = tokio::time::timeout(shared.timeout, reader.recv()).await;
        let latency = request.sent.elapsed();
        let broken = match reply {
            Err(_) => Some(format!("no reply to request {} within {:?}", request.request_id, shared.timeout)),
            Ok(Err(e)) => Some(format!("failed to {e:#}")),
            Ok(Ok(ServerMessage::Page { request_id, lsn, page })) if request_id == request.request_id => {
                let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX).max(1);
                stats.latency.saturating_record(micros);
                match verify(shared, &request, lsn, &page) {
                    Ok(()) => {
                        stats.requests += 1;
                        shared.counters.done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => shared.error(&mut stats, "verify", 1, || format!("{e:#}")),
                }
                None
            }
            Ok(Ok(ServerMessage::Error { request_id, code, message }))
                if request_id == request.request_id =>
            {
                shared.error(&mut stats, code.name(), 1, || {
                    format!(
                        "request {request_id} for page {} at LSN {}: {message}",
                        request.key,
                        Lsn(request.lsn)
                    )
                });
                code.closes_connection()
                    .then(|| format!("the daemon closed the connection after {}", code.name()))
            }
            Ok(Ok(other)) => Some(format!(
                "expected the reply to request {}, got {}",
                request.request_id,
                describe(&other)
            )),
        };
        if let Some(reason) = broken {
            stop.cancel();
            in_flight_rx.close();
            // This request and every later one of the connection are lost.
            let mut lost = 1;
            while in_flight_rx.try_recv().is_ok() {
                lost += 1;
            }
            shared.error(&mut stats, "connection", lost, || format!("{reason} ({lost} requests lost)"));
            break;
        }
        permits.add_permits(1);
    }
    stats
}

/// With `--verify`: the LSN served and the page must match the data set.
fn verify(shared: &Shared, request: &InFlight, served_lsn: u64, page: &Bytes) -> anyhow::Result<()> {
    let Some(shape) = &shared.verify else {
        return Ok(());
    };
    if request.lsn != LSN_LATEST && served_lsn != request.lsn {
        bail!(
            "request {}: asked for LSN {}, served {}",
            request.request_id,
            Lsn(request.lsn),
            Lsn(served_lsn)
        );
    }
    let index = shape.page_of_key(&request.key).with_context(|| {
        format!("request {}: page {} is not in the data set", request.request_id, request.key)
    })?;
    let expected = shape
        .expected_page(index, served_lsn)?
        .with_context(|| format!("page {} does not exist at LSN {}", request.key, Lsn(served_lsn)))?;
    if page[..] != expected[..] {
        let first = page.iter().zip(expected.iter()).position(|(a, b)| a != b).unwrap_or(0);
        bail!(
            "request {}: page {} at LSN {} differs from the expected page from byte {first}",
            request.request_id,
            request.key,
            Lsn(served_lsn)
        );
    }
    Ok(())
}
