//! `pagebench get-page`: GetPage load over `--connections` connections per tenant
//! (`--tenants N` or `all`), each with up to `--depth` requests in flight: a closed loop for
//! `--duration` seconds, or with `--rate` an open loop at a given rate or schedule of rates.
//!
//! Method:
//! - each tenant's key space comes from the daemon (`GET /v1/tenant/{id}/keyspace`); shape flags
//!   are needed only for `--verify`, and when given are checked against it (and the seed against
//!   the first page) before the run;
//! - all connections are opened (Hello) before the clock starts;
//! - per connection a sender task and a receiver task share the split client; a slot is one of
//!   `depth` permits of a semaphore, taken by a send and given back by the receiver, which reads
//!   the replies in order;
//! - closed loop (no `--rate`; `--depth` 1 by default): the sender waits for a free slot, takes
//!   every free slot at once, encodes one GetPage per slot and writes them in one flush. Latency
//!   is from just before the encode to the whole reply read;
//! - open loop (`--rate R` for `--duration`, or steps `R:D,R:D,...` run in order, the run
//!   lasting their sum; `--depth` 256 by default): R requests/s in total over all connections of
//!   all tenants, sent on schedule whatever the replies. Connection i of N sends requests i,
//!   i + N, ... of the schedule (rate.rs): its share R/N, evenly spaced, offset from the other
//!   connections. The sender wakes 1 ms before a request is due (the timer's resolution), takes
//!   a slot, waiting for one if none is free, and writes every request due by then in one flush.
//!   A request sent more than 1 ms after its due time counts as `late` (no free slot, or
//!   pagebench itself behind), and its latency counts from 1 ms after its due time rather than
//!   from its send, so that a server that holds every slot is charged for the wait it causes
//!   (no coordinated omission); an on-time request's latency counts from its send;
//! - latencies, in microseconds, go into an HDR histogram per connection (merged at the end) and
//!   into one shared histogram of the current second (report.rs);
//! - keys are uniform over the tenant's keys (a SplitMix64 per connection, from `--seed`);
//!   `--lsn latest` asks for the latest LSN, `--lsn random` for an LSN uniform over the key
//!   space's [all_keys_from, last durable LSN], where every key exists;
//! - after the duration (or the schedule) the senders stop and the replies in flight are still
//!   read and counted; `rps` is requests over the time until the last one came back.
//!
//! Output: every second a line on stderr (requests/s, with `--rate` the target and the late
//! requests, and the p50/p99/p99.9/max latency of the requests completed in that second); with
//! `--series FILE`, the same second as one JSON line appended to FILE: `{"t": seconds since the
//! start, "requests", "errors", "rps", "target_rps" (null without --rate), "late", "latency_us":
//! {"p50", "p99", "p999", "max"}}`, the last line covering the part of a second before the end.
//! The last line of stdout is the JSON summary of the run (`rate`: the steps, or null; `late`).
//!
//! Errors (an Error reply, a page that fails `--verify`, a timeout, a broken connection and the
//! requests lost with it) are counted and the first few printed; they never stop the run. A
//! broken connection is not reopened. More than `--max-errors` errors (default 0), or a failed
//! write to the `--series` file, make the exit status 1, after the summary.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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
use crate::rate::{self, Schedule};
use crate::report::{self, Counters, IntervalLatency};
use crate::{OptionalShapeArgs, Target};

/// Error messages printed in full; later ones are only counted.
const PRINTED_ERRORS: usize = 5;
/// The daemon's per-connection bound on requests in flight (page_service::MAX_IN_FLIGHT);
/// a deeper pipeline would only queue in the socket.
const MAX_DEPTH: u32 = 256;
/// In the open loop, a request sent at most this long after its due time is on time: the timer
/// that wakes the sender ticks in milliseconds. Latency counts from the send or from this long
/// after the due time, whichever is earlier; a later send counts as `late`.
const ON_TIME: Duration = Duration::from_millis(1);
/// In the open loop, the sender wakes this long before a request is due and sends what is due
/// within it: tokio's timer rounds a deadline up to its next millisecond tick, and the poll
/// timeout up again, so waiting for the exact time would send many requests 1 to 2 ms late.
/// A request thus goes out between 1 ms early and about 1 ms late.
const TIMER_LEAD: Duration = Duration::from_millis(1);

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
    /// Seconds of load [default: 10]; with a `--rate` schedule of steps, leave it out (the run
    /// lasts the steps' sum).
    #[arg(long)]
    duration: Option<f64>,
    /// Requests in flight per connection (pipelining) [default: 1; with --rate, 256].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_DEPTH)))]
    depth: Option<u32>,
    /// Open loop: R GetPage requests/s in total over all connections of all tenants, sent on
    /// schedule whatever the replies (while a slot of --depth is free), for --duration; or steps
    /// R:D,R:D,... run in order (D: 5s, 500ms, 2m), e.g. 2000:5s,20000:10s,2000:5s.
    #[arg(long, value_name = "R|R:D,...")]
    rate: Option<String>,
    /// Append one JSON line per second to FILE: t, requests, errors, rps, target_rps, late,
    /// latency_us {p50, p99, p999, max} of the requests completed in that second.
    #[arg(long, value_name = "FILE")]
    series: Option<PathBuf>,
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
    /// Latencies of the current second, for the progress line and `--series`.
    interval: Arc<IntervalLatency>,
    /// Open loop: requests sent more than [`ON_TIME`] after their due time.
    late: AtomicU64,
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
    /// Where its latency counts from: the send (closed loop), or in the open loop the send but
    /// at most [`ON_TIME`] after the due time.
    start: Instant,
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
    let rate::Plan { duration, schedule } = rate::plan(args.rate.as_deref(), args.duration)?;
    let schedule = schedule.map(Arc::new);
    let depth = args.depth.unwrap_or(if schedule.is_some() { MAX_DEPTH } else { 1 });
    let timeout = Some(args.timeout).filter(|t| *t > 0.0).and_then(|t| Duration::try_from_secs_f64(t).ok());
    let timeout = timeout.with_context(|| {
        format!("check --timeout: {:?} is not a positive number of seconds", args.timeout)
    })?;
    let series = match &args.series {
        Some(path) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .with_context(|| format!("open the --series file {}", path.display()))?,
        ),
        None => None,
    };
    let shape = args.shape.shape(args.verify);
    let tenants = discover(&args, shape.as_ref()).await?;
    let clients = connect_all(&args, &tenants, shape.as_ref()).await?;
    let pages: u64 = tenants.iter().map(|t| t.keyspace.keys).sum();

    let shared = Arc::new(Shared {
        verify: shape.filter(|_| args.verify),
        lsn: args.lsn,
        timeout,
        depth: depth as usize,
        counters: Arc::new(Counters::default()),
        printed_errors: AtomicUsize::new(0),
        interval: Arc::new(IntervalLatency::new()),
        late: AtomicU64::new(0),
    });
    errln!(
        "get-page: {} tenant(s) x {} connections, depth {depth}, lsn {:?}, {pages} pages, {}{}",
        tenants.len(),
        args.connections,
        args.lsn,
        match &schedule {
            Some(schedule) => format!("open loop at {}", schedule.describe()),
            None => format!("closed loop for {} s", duration.as_secs_f64()),
        },
        if args.verify { ", verifying pages" } else { "" }
    );

    let start = Instant::now();
    let deadline = start + duration;
    let stop_progress = CancellationToken::new();
    let series_error = Arc::new(Mutex::new(None::<anyhow::Error>));
    let progress = tokio::spawn(report::every_second(
        shared.counters.clone(),
        start,
        stop_progress.clone(),
        Some(shared.interval.clone()),
        series.is_some(),
        on_tick(shared.clone(), schedule.clone(), series, args.series.clone(), series_error.clone()),
    ));

    let seed = args.shape.seed.unwrap_or(DEFAULT_SEED);
    let total_connections = clients.len() as u64;
    let mut connections = JoinSet::new();
    for (index, (tenant, client)) in clients.into_iter().enumerate() {
        let rng = SplitMix64::new(
            seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x0067_6574_7061_6765,
        );
        let pace = match &schedule {
            // Connection i of N sends requests i, i + N, ... of the schedule (rate.rs).
            Some(schedule) => Pace::Open {
                schedule: schedule.clone(),
                start,
                first: index as u64,
                stride: total_connections,
            },
            None => Pace::Closed { deadline },
        };
        connections.spawn(run_connection(client, tenant, index, rng, shared.clone(), pace, cancel.clone()));
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
    let late = shared.late.load(Ordering::Relaxed);
    let latency_us = report::latency_json(&latency);
    errln!(
        "get-page: {requests} requests, {errors} errors{} in {elapsed:.2} s: {rps:.0} requests/s, latency us p50 {} p99 {} p99.9 {} p99.99 {}",
        if schedule.is_some() { format!(", {late} late") } else { String::new() },
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
        "depth": depth,
        "lsn": match args.lsn { LsnMode::Latest => "latest", LsnMode::Random => "random" },
        "verify": args.verify,
        "pages": pages,
        "chain_length": shape.map(|s| s.chain_length),
        "latency_us": latency_us,
        "rate": schedule.as_ref().map(|s| s.json()),
        "late": late,
    });
    outln!("{summary}");
    if errors > args.max_errors {
        bail!(
            "run without errors: {errors} of {} requests failed (--max-errors {})",
            requests + errors,
            args.max_errors
        );
    }
    if let Some(e) = series_error.lock().unwrap_or_else(|poison| poison.into_inner()).take() {
        return Err(e);
    }
    Ok(())
}

/// What happens every second: the progress line on stderr and, with `--series`, a JSON line
/// appended to the file. A failed write is kept in `error` (the run goes on; the exit status
/// will be 1) and ends the series.
fn on_tick(
    shared: Arc<Shared>,
    schedule: Option<Arc<Schedule>>,
    mut series: Option<std::fs::File>,
    path: Option<PathBuf>,
    error: Arc<Mutex<Option<anyhow::Error>>>,
) -> report::TickFn {
    let mut last_late = 0;
    Box::new(move |t| {
        let late_total = shared.late.load(Ordering::Relaxed);
        let late = late_total - last_late;
        last_late = late_total;
        let secs = t.interval.as_secs_f64().max(1e-9);
        // The step in the middle of the interval: ticks fall on whole seconds, as steps usually do.
        let target = schedule.as_ref().map(|s| s.rate_at((t.elapsed.as_secs_f64() - secs / 2.0).max(0.0)));
        let latency = t.latency.unwrap_or_default();
        if !t.last {
            errln!(
                "get-page: {:5.1} s: {:.0} requests/s{}, {} done, {} errors{}, latency us p50 {} p99 {} p99.9 {} max {}",
                t.elapsed.as_secs_f64(),
                t.done_per_s,
                target.map(|r| format!(" (target {r})")).unwrap_or_default(),
                t.done,
                t.errors,
                if schedule.is_some() { format!(", {late} late") } else { String::new() },
                latency.p50,
                latency.p99,
                latency.p999,
                latency.max
            );
        }
        if let Some(file) = &mut series {
            if let Err(e) = writeln!(file, "{}", series_line(&t, late, target)) {
                let path = path.as_deref().unwrap_or(Path::new("?")).display();
                errln!("get-page: failed to write the --series file {path}: {e}; no more lines go there");
                *error.lock().unwrap_or_else(|poison| poison.into_inner()) =
                    Some(anyhow::Error::new(e).context(format!("write the --series file {path}")));
                series = None;
            }
        }
    })
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

/// One line of `--series`: the requests completed in the tick's interval (`requests` without
/// the errors, as in the summary) and their latencies.
fn series_line(t: &report::Tick, late: u64, target_rps: Option<f64>) -> serde_json::Value {
    let requests = t.done_in_interval.saturating_sub(t.errors_in_interval);
    let secs = t.interval.as_secs_f64().max(1e-9);
    serde_json::json!({
        "t": (t.elapsed.as_secs_f64() * 1000.0).round() / 1000.0,
        "requests": requests,
        "errors": t.errors_in_interval,
        "rps": (requests as f64 / secs * 10.0).round() / 10.0,
        "target_rps": target_rps,
        "late": late,
        "latency_us": t.latency.unwrap_or_default().json(),
    })
}

/// When a connection's sender sends.
enum Pace {
    /// Whenever a slot is free, until the deadline.
    Closed { deadline: Instant },
    /// Requests `first`, `first + stride`, ... of the schedule, each at its due time from
    /// `start` (once a slot is free), until the schedule is over.
    Open { schedule: Arc<Schedule>, start: Instant, first: u64, stride: u64 },
}

async fn run_connection(
    client: Client,
    tenant: Arc<TenantLoad>,
    index: usize,
    rng: SplitMix64,
    shared: Arc<Shared>,
    pace: Pace,
    cancel: CancellationToken,
) -> ConnStats {
    let (reader, writer) = client.into_split();
    let permits = Arc::new(Semaphore::new(shared.depth));
    let (in_flight_tx, in_flight_rx) = mpsc::channel::<InFlight>(shared.depth);
    // Cancelled by Ctrl-C, or by the receiver when the connection breaks.
    let stop = cancel.child_token();
    let sender = Sender {
        writer,
        in_flight_tx,
        permits: permits.clone(),
        shared: shared.clone(),
        tenant: tenant.clone(),
        rng,
        request_id: 0,
        stop: stop.clone(),
        error: None,
    };
    let sender = tokio::spawn(sender.run(pace));
    let mut stats = receive(reader, in_flight_rx, permits, &shared, stop).await;
    // The writer is dropped only now: the daemon never sees EOF while replies are owed.
    let (_writer, failed_write) = match sender.await {
        Ok((writer, error)) => (Some(writer), error),
        Err(e) => (None, Some(anyhow::Error::new(e).context("run the sender task"))),
    };
    if let Some(e) = failed_write {
        shared.error(&mut stats, "connection", 0, || {
            format!("connection {index} (tenant {}): failed to {e:#}", tenant.id)
        });
    }
    stats
}

/// The sending half of a connection.
struct Sender {
    writer: ClientWriter<OwnedWriteHalf>,
    in_flight_tx: mpsc::Sender<InFlight>,
    /// One per slot of `--depth`; taken by a send, given back by the receiver with the reply.
    permits: Arc<Semaphore>,
    shared: Arc<Shared>,
    tenant: Arc<TenantLoad>,
    rng: SplitMix64,
    request_id: u64,
    stop: CancellationToken,
    /// Why a write failed, for the receiver's side to count.
    error: Option<anyhow::Error>,
}

impl Sender {
    /// Sends until the pace says to stop, `stop`, or a failed write (which cancels `stop`).
    /// Gives back the writer, so that it outlives the replies, and why a write failed; drops
    /// the rest (closing the in-flight channel ends the receiver once it has read every reply).
    async fn run(mut self, pace: Pace) -> (ClientWriter<OwnedWriteHalf>, Option<anyhow::Error>) {
        match pace {
            Pace::Closed { deadline } => self.closed_loop(deadline).await,
            Pace::Open { schedule, start, first, stride } => {
                self.open_loop(&schedule, start, first, stride).await
            }
        }
        let Sender { writer, error, .. } = self;
        (writer, error)
    }

    async fn closed_loop(&mut self, deadline: Instant) {
        let deadline = tokio::time::Instant::from_std(deadline);
        loop {
            let permit = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep_until(deadline) => return,
                permit = self.permits.acquire() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
            permit.forget();
            let mut slots = 1;
            while slots < self.shared.depth && self.take_free_slot() {
                slots += 1;
            }
            let start = Instant::now();
            for _ in 0..slots {
                if !self.push(start).await {
                    return;
                }
            }
            if !self.flush().await {
                return;
            }
        }
    }

    /// Sends each request of the schedule at its due time, whatever the replies: a request
    /// that finds no free slot waits for one, and every other request already due (within
    /// [`TIMER_LEAD`]) goes into the same write.
    async fn open_loop(&mut self, schedule: &Schedule, start: Instant, first: u64, stride: u64) {
        let mut next = first;
        while let Some(offset) = schedule.send_time(next) {
            let due = start + offset;
            let wake = due.checked_sub(TIMER_LEAD).unwrap_or(due);
            if Instant::now() < wake {
                tokio::select! {
                    biased;
                    _ = self.stop.cancelled() => return,
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(wake)) => {}
                }
            }
            if !self.take_free_slot() {
                tokio::select! {
                    biased;
                    _ = self.stop.cancelled() => return,
                    permit = self.permits.acquire() => match permit {
                        Ok(permit) => permit.forget(),
                        Err(_) => return,
                    },
                }
            }
            let now = Instant::now();
            let mut due = Some(due);
            while let Some(at) = due {
                if !self.push(self.latency_start(at, now)).await {
                    return;
                }
                next = next.saturating_add(stride);
                due = schedule
                    .send_time(next)
                    .map(|offset| start + offset)
                    .filter(|&at| at <= now + TIMER_LEAD && self.take_free_slot());
            }
            if !self.flush().await {
                return;
            }
        }
    }

    /// Where the latency of a request due at `due` and sent at `now` counts from; counts it
    /// as late if it is.
    fn latency_start(&self, due: Instant, now: Instant) -> Instant {
        let (start, late) = latency_start(due, now);
        if late {
            self.shared.late.fetch_add(1, Ordering::Relaxed);
        }
        start
    }

    fn take_free_slot(&self) -> bool {
        match self.permits.try_acquire() {
            Ok(permit) => {
                permit.forget();
                true
            }
            Err(_) => false,
        }
    }

    /// Encodes one GetPage for a slot already taken; false once the receiver has stopped.
    async fn push(&mut self, start: Instant) -> bool {
        let keyspace = &self.tenant.keyspace;
        self.request_id += 1;
        let request_id = self.request_id;
        let key = keyspace.key(self.rng.below(keyspace.keys));
        let lsn = match self.shared.lsn {
            LsnMode::Latest => LSN_LATEST,
            LsnMode::Random => {
                let (low, high) =
                    (keyspace.all_keys_from, keyspace.last_durable_lsn.max(keyspace.all_keys_from));
                low + self.rng.below(high - low + 1)
            }
        };
        self.writer.send(&ClientMessage::GetPage { request_id, key, lsn });
        // Never waits: at most `depth` requests exist, and the channel holds `depth`.
        self.in_flight_tx.send(InFlight { request_id, key, lsn, start }).await.is_ok()
    }

    /// Writes what was encoded; false (and `stop` cancelled on a failed write) to stop sending.
    async fn flush(&mut self) -> bool {
        tokio::select! {
            biased;
            flushed = self.writer.flush() => match flushed {
                Ok(()) => true,
                Err(e) => {
                    self.error = Some(e);
                    self.stop.cancel();
                    false
                }
            },
            _ = self.stop.cancelled() => false,
        }
    }
}

/// Open loop: the latency of a request due at `due` and sent at `sent` counts from the send,
/// but from no later than [`ON_TIME`] after the due time, so that a server that holds every
/// slot is charged for the wait it causes (no coordinated omission) while the timer's own
/// millisecond is not; `true` if the request is late (sent more than `ON_TIME` after `due`).
fn latency_start(due: Instant, sent: Instant) -> (Instant, bool) {
    let limit = due + ON_TIME;
    if sent > limit {
        (limit, true)
    } else {
        (sent, false)
    }
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
        let latency = request.start.elapsed();
        let broken = match reply {
            Err(_) => Some(format!("no reply to request {} within {:?}", request.request_id, shared.timeout)),
            Ok(Err(e)) => Some(format!("failed to {e:#}")),
            Ok(Ok(ServerMessage::Page { request_id, lsn, page })) if request_id == request.request_id => {
                let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX).max(1);
                stats.latency.saturating_record(micros);
                shared.interval.record(micros);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_counts_from_the_send_unless_it_is_more_than_on_time_late() {
        let due = Instant::now();
        let early = due + Duration::from_micros(300);
        assert_eq!(latency_start(due, early), (early, false));
        assert_eq!(latency_start(due, due + ON_TIME), (due + ON_TIME, false));
        // a request that waited 50 ms for a slot is charged from its due time (+ ON_TIME)
        assert_eq!(latency_start(due, due + Duration::from_millis(50)), (due + ON_TIME, true));
    }

    #[test]
    fn series_line_has_the_documented_fields_and_counts_requests_without_errors() {
        let tick = report::Tick {
            elapsed: Duration::from_micros(2_000_400),
            interval: Duration::from_millis(500),
            done: 1000,
            errors: 10,
            done_in_interval: 260,
            errors_in_interval: 10,
            done_per_s: 520.0,
            bytes_per_s: 0.0,
            latency: Some(report::Percentiles { p50: 80, p99: 300, p999: 900, max: 1200 }),
            last: true,
        };
        let line = series_line(&tick, 3, Some(2000.0));
        assert_eq!(
            line,
            serde_json::json!({
                "t": 2.0, "requests": 250, "errors": 10, "rps": 500.0, "target_rps": 2000.0, "late": 3,
                "latency_us": {"p50": 80, "p99": 300, "p999": 900, "max": 1200},
            })
        );
        assert!(series_line(&report::Tick { latency: None, ..tick }, 0, None)["target_rps"].is_null());
    }
}
