//! `pagebench`: the load tool of the pageserver (method and results: docs/performance.md).
//!
//! - `pagebench ingest` creates a tenant through the management API and loads a synthetic,
//!   seed-determined data set through the page service ([`dataset`] documents its LSN layout);
//! - `pagebench get-page` drives GetPage requests over many pipelined connections for a fixed
//!   time, prints requests/s every second on stderr, and ends stdout with one JSON line of
//!   totals and latency percentiles.
//!
//! The modules (in `src/bin/pagebench/`) are [`dataset`] (what is loaded and where), [`ingest`],
//! [`get_page`], [`http`] (the one management call) and [`report`] (progress and summaries).
//! This file only parses arguments, builds the runtime and maps the outcome to an exit status.
//!
//! Reference numbers (2026-11-22, commit a98c7fa, the 2-vCPU KVM VM of the project, pagebench
//! on the same vCPUs; method, full table and what bounds each figure in docs/performance.md):
//! cached pages at depth 1: ~15k requests/s on 1 connection (p50 ~70 us), ~70k on 8; a chain
//! of 10 records with the page cache off, 8 connections: ~29k/s async, ~21k/s sync.
//!
//! Invariant: a benchmark run ends by itself (duration, per-reply timeout) and prints its
//! summary even when requests fail; only set-up failures (cannot create the tenant, cannot
//! connect, data set not loaded) are fatal.

// A binary's root resolves `mod` next to itself (src/bin/); its modules live in src/bin/pagebench/.
#[path = "pagebench/dataset.rs"]
mod dataset;
#[path = "pagebench/get_page.rs"]
mod get_page;
#[path = "pagebench/http.rs"]
mod http;
#[path = "pagebench/ingest.rs"]
mod ingest;
#[path = "pagebench/report.rs"]
mod report;

use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
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

/// Where the daemon is and which tenant to use: the same for every subcommand.
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
}

/// The data set's shape: give `get-page` the same values as `ingest`.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct ShapeArgs {
    /// Number of relations.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub relations: u32,
    /// Blocks (pages) per relation.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    pub blocks: u32,
    /// Records per page above its image.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    pub chain_length: u32,
    /// Seed of the data set's bytes (and of the key choice of get-page).
    #[arg(long, default_value_t = 1)]
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pagebench: failed to {e:#}");
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
                eprintln!("pagebench: interrupted, finishing");
                on_signal.cancel();
            }
        });
        match cli.command {
            Command::Ingest(args) => ingest::run(args, cancel).await,
            Command::GetPage(args) => get_page::run(args, cancel).await,
        }
    })
}
