//! `pagebench`: the load tool of the pageserver (method and results: docs/performance.md).
//!
//! - `pagebench ingest` creates a tenant through the management API and loads a synthetic,
//!   seed-determined data set through the page service ([`dataset`] documents its LSN layout);
//! - `pagebench get-page` drives GetPage requests over many pipelined connections (of one tenant
//!   or of `--tenants N`) for a fixed time, in a closed loop or (`--rate`) an open loop at a rate
//!   or schedule of rates, choosing keys and LSNs from the key space the daemon reports, prints
//!   requests/s and latency percentiles every second on stderr (and with `--series` as JSON
//!   lines to a file), and ends stdout with one JSON line of totals and latency percentiles.
//!
//! The modules (in `src/bin/pagebench/`) are [`client`] (the page service client, which the
//! library's page service tests compile in too), [`dataset`] (what is loaded and where),
//! [`ingest`], [`get_page`] with [`connection`] (one connection's sender and receiver) and
//! [`rate`] (`--rate`: the open loop's schedule), [`keyspace`] (the daemon's key space, and its
//! check against a shape), [`http`] (the management calls) and [`report`] (progress and
//! summaries). This file only parses arguments, builds the runtime and maps the outcome to an
//! exit status.
//!
//! Exit status: 0 only when every request succeeded (get-page: at most `--max-errors` failed);
//! 1 otherwise, after the summary line.
//!
//! Reference numbers (2026-11-22, commit a98c7fa, the 2-vCPU KVM VM of the project, pagebench
//! on the same vCPUs; method, full table and what bounds each figure in docs/performance.md):
//! cached pages at depth 1: ~15k requests/s on 1 connection (p50 ~70 us), ~70k on 8; a chain
//! of 10 records with the page cache off, 8 connections: ~29k/s async, ~21k/s sync.
//!
//! Invariant: a benchmark run ends by itself (duration, per-reply timeout) and prints its
//! summary even when requests fail; only set-up failures (cannot create the tenant, cannot
//! connect, data set not loaded) are fatal.

/// `outln!` that never panics: with stdout gone (`pagebench ... | head -1`) the line is lost
/// and the run goes on to its normal end and exit status.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `errln!` that never panics (stderr gone: the line is lost).
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

// A binary's root resolves `mod` next to itself (src/bin/); its modules live in src/bin/pagebench/.
#[path = "pagebench/client.rs"]
mod client;
#[path = "pagebench/connection.rs"]
mod connection;
#[path = "pagebench/dataset.rs"]
mod dataset;
#[path = "pagebench/get_page.rs"]
mod get_page;
#[path = "pagebench/http.rs"]
mod http;
#[path = "pagebench/ingest.rs"]
mod ingest;
#[path = "pagebench/keyspace.rs"]
mod keyspace;
#[path = "pagebench/rate.rs"]
mod rate;
#[path = "pagebench/report.rs"]
mod report;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
// The wire protocol, where the client (a module of the library's tests too) finds it.
use pageserver::page_service::proto;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(
    name = "pagebench",
    version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("GIT_COMMIT"), ")"),
    about = "Load tool of the pageserver: ingest a synthetic data set, then time GetPage"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create the tenant (HTTP) and load the synthetic data set (page service).
    Ingest(ingest::Args),
    /// Send GetPage requests for a while; the last line of stdout is a JSON summary.
    GetPage(get_page::Args),
}

/// Where the daemon is and which tenants to use: the same for every subcommand.
#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// Page service address (the daemon's `listen_pg_addr`).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:64000")]
    pub page_service: String,
    /// Management API address (the daemon's `listen_http_addr`).
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:9898")]
    pub http: String,
    /// Tenant id (1 to 64 characters of [A-Za-z0-9_-]).
    #[arg(long, default_value = "pagebench")]
    pub tenant: String,
    /// Number of tenants: N > 1 uses `<tenant>-0` .. `<tenant>-<N-1>`, each with its own
    /// connections; `get-page` also takes `all` (every tenant of the daemon).
    #[arg(long, default_value = "1", value_name = "N|all", value_parser = parse_tenant_count)]
    pub tenants: TenantCount,
}

/// `--tenants`: a number, or every tenant of the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantCount {
    Count(u32),
    All,
}

/// A flag's number of seconds as a `Duration`: positive, finite and representable, else a
/// `check <flag>` error (never a panic on input).
pub fn positive_seconds(flag: &str, seconds: f64) -> anyhow::Result<std::time::Duration> {
    Some(seconds)
        .filter(|s| *s > 0.0)
        .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
        .with_context(|| format!("check {flag}: {seconds:?} is not a positive number of seconds"))
}

fn parse_tenant_count(text: &str) -> Result<TenantCount, String> {
    match text {
        "all" => Ok(TenantCount::All),
        n => match n.parse::<u32>() {
            Ok(n) if (1..=100_000).contains(&n) => Ok(TenantCount::Count(n)),
            _ => Err(format!("{text:?} is neither `all` nor a number from 1 to 100000")),
        },
    }
}

impl Target {
    /// The tenant ids this run uses.
    ///
    /// Cancel-safe: at most one HTTP exchange.
    pub async fn tenant_ids(&self) -> anyhow::Result<Vec<String>> {
        match self.tenants {
            TenantCount::Count(1) => Ok(vec![self.tenant.clone()]),
            TenantCount::Count(n) => Ok((0..n).map(|i| format!("{}-{i}", self.tenant)).collect()),
            TenantCount::All => {
                let response = http::request_json(&self.http, "GET", "/v1/tenant", None).await?;
                anyhow::ensure!(
                    response.status == 200,
                    "list tenants: HTTP {}: {}",
                    response.status,
                    response.body
                );
                let list: Vec<serde_json::Value> =
                    serde_json::from_str(&response.body).context("parse the tenant list")?;
                let ids: Vec<String> =
                    list.iter().filter_map(|t| t["id"].as_str().map(str::to_string)).collect();
                anyhow::ensure!(!ids.is_empty(), "--tenants all: the daemon has no tenants");
                Ok(ids)
            }
        }
    }
}

/// The data set's shape, for `ingest`.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct ShapeArgs {
    /// Number of relations.
    #[arg(long, default_value_t = dataset::DEFAULT_RELATIONS, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub relations: u32,
    /// Blocks (pages) per relation.
    #[arg(long, default_value_t = dataset::DEFAULT_BLOCKS, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    pub blocks: u32,
    /// Records per page above its image.
    #[arg(long, default_value_t = dataset::DEFAULT_CHAIN_LENGTH, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub chain_length: u32,
    /// Seed of the data set's bytes.
    #[arg(long, default_value_t = dataset::DEFAULT_SEED)]
    pub seed: u64,
}

impl ShapeArgs {
    pub fn shape(&self) -> dataset::Shape {
        dataset::Shape {
            relations: self.relations,
            blocks: self.blocks,
            chain_length: self.chain_length,
            seed: self.seed,
        }
    }
}

/// The data set's shape, for `get-page`: needed only by `--verify` (to compute the expected
/// pages); when given, checked against the key space the daemon reports. A flag left out takes
/// the default of `ingest`.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct OptionalShapeArgs {
    /// Number of relations (as given to `ingest`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub relations: Option<u32>,
    /// Blocks (pages) per relation (as given to `ingest`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    pub blocks: Option<u32>,
    /// Records per page above its image (as given to `ingest`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub chain_length: Option<u32>,
    /// Seed of the data set's bytes (as given to `ingest`); also seeds the key choice.
    #[arg(long)]
    pub seed: Option<u64>,
}

impl OptionalShapeArgs {
    /// The shape, if any flag was given or `needed`; missing flags take `ingest`'s defaults.
    pub fn shape(&self, needed: bool) -> Option<dataset::Shape> {
        let given = self.relations.is_some()
            || self.blocks.is_some()
            || self.chain_length.is_some()
            || self.seed.is_some();
        (given || needed).then(|| dataset::Shape {
            relations: self.relations.unwrap_or(dataset::DEFAULT_RELATIONS),
            blocks: self.blocks.unwrap_or(dataset::DEFAULT_BLOCKS),
            chain_length: self.chain_length.unwrap_or(dataset::DEFAULT_CHAIN_LENGTH),
            seed: self.seed.unwrap_or(dataset::DEFAULT_SEED),
        })
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("pagebench: failed to {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let threads = match &cli.command {
        Command::Ingest(_) => 1,
        Command::GetPage(args) => args.threads as usize,
    };
    // One thread by default: on a small machine the load tool should take as little CPU from
    // the daemon as it can, and a current-thread runtime is the cheapest way to drive sockets.
    let runtime = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build()
    }
    .context("build the tokio runtime")?;
    runtime.block_on(async move {
        let cancel = CancellationToken::new();
        let on_signal = cancel.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                errln!("pagebench: interrupted, finishing");
                on_signal.cancel();
            }
        });
        match cli.command {
            Command::Ingest(args) => ingest::run(args, cancel).await,
            Command::GetPage(args) => get_page::run(args, cancel).await,
        }
    })
}
