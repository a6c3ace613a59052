//! `pagebench get-page`: GetPage load over `--connections` connections per tenant
//! (`--tenants N` or `all`), each with up to `--depth` requests in flight: a closed loop for
//! `--duration` seconds, or with `--rate` an open loop at a given rate or schedule of rates.
//!
//! Method:
//! - each tenant's key space comes from the daemon (`GET /v1/tenant/{id}/keyspace`); shape flags
//!   are needed only for `--verify`, and when given are checked against it (and the seed against
//!   the first page) before the run;
//! - all connections are opened (Hello) before the clock starts;
//! - per connection (connection.rs) a sender task and a receiver task share the split client; a
//!   slot is one of `depth` permits of a semaphore, taken by a send and given back by the
//!   receiver, which reads the replies in order;
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
use std::time::Instant;

use crate::client::Client;
use anyhow::{bail, Context};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::connection::{run_connection, LsnMode, Pace, RequestKind, Shared, TenantLoad};
use crate::dataset::{Shape, SplitMix64, DEFAULT_SEED};
use crate::keyspace::{self, KeySpace};
use crate::rate::{self, Schedule};
use crate::report::{self, Counters, IntervalLatency};
use crate::{OptionalShapeArgs, Target};

/// The daemon's per-connection bound on requests in flight (page_service::MAX_IN_FLIGHT);
/// a deeper pipeline would only queue in the socket.
const MAX_DEPTH: u32 = 256;

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
    /// What each request asks: a page, or the size or existence of the page's relation fork.
    #[arg(long, value_enum, default_value_t = RequestKind::Page)]
    request: RequestKind,
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

/// Runs the benchmark until its duration is over or `cancel`, then prints the summary.
///
/// Cancel-safe in effect: dropping it drops the connections; nothing on the daemon is left half
/// done (GetPage has no side effects).
pub async fn run(args: Args, cancel: CancellationToken) -> anyhow::Result<()> {
    let rate::Plan { duration, schedule } = rate::plan(args.rate.as_deref(), args.duration)?;
    let schedule = schedule.map(Arc::new);
    let depth = args.depth.unwrap_or(if schedule.is_some() { MAX_DEPTH } else { 1 });
    let timeout = crate::positive_seconds("--timeout", args.timeout)?;
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
    anyhow::ensure!(
        !args.verify || args.request == RequestKind::Page,
        "--verify checks pages: use it with --request page"
    );
    let shape = args.shape.shape(args.verify);
    let tenants = discover(&args, shape.as_ref()).await?;
    let clients = connect_all(&args, &tenants, shape.as_ref()).await?;
    let pages: u64 = tenants.iter().map(|t| t.keyspace.keys).sum();

    let shared = Arc::new(Shared {
        verify: shape.filter(|_| args.verify),
        lsn: args.lsn,
        request: args.request,
        timeout,
        depth: depth as usize,
        counters: Arc::new(Counters::default()),
        printed_errors: AtomicUsize::new(0),
        interval: Arc::new(IntervalLatency::new()),
        late: AtomicU64::new(0),
    });
    errln!(
        "get-page: {} tenant(s) x {} connections, depth {depth}, {:?} requests, lsn {:?}, {pages} pages, {}{}",
        tenants.len(),
        args.connections,
        args.request,
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
