//! `page-floor`: the loopback floor of `pagebench get-page`, a page service that answers every
//! GetPage with one constant 8 KiB page and does nothing else, so that a pagebench table can show
//! the daemon's requests/s as a ratio to what the same client, sockets and machine allow in the
//! same run (as `floor/echo` does for bench_walredo's pipes).
//!
//! What it serves:
//! - the page service protocol (docs/page-service-protocol.md) through the project's own codec
//!   (`pageserver::page_service::proto`): Hello gets HelloOk, GetPage gets a Page reply with the
//!   request's id, the request's LSN or, for "latest", the data set's end LSN (below), and the
//!   constant page (zeros); an Ingest, a second Hello, a request before Hello or a malformed
//!   frame get an Error and close their own connection (see [`serve`]);
//! - `GET /v1/tenant/{id}/keyspace` for any valid tenant id: the key space of the data set that
//!   `pagebench ingest --relations R --blocks B --chain-length C` would have loaded, at its end
//!   LSN, so that `pagebench get-page` given the same shape flags accepts it; `GET /v1/tenant`
//!   lists one tenant, `floor` (for `--tenants all`); see [`http`].
//!
//! Run it against pagebench (release builds for numbers; the addresses are printed as one JSON
//! line on stdout, and with `--workdir DIR` also written to `DIR/ports.json` like the daemon's):
//!
//! ```text
//! cargo build --release -p benches --bin page-floor
//! cargo build --release -p pageserver --bin pagebench
//! target/release/page-floor --workdir floor-run &
//! # {"http":"127.0.0.1:HTTP_PORT","pg":"127.0.0.1:PG_PORT"}  (also in floor-run/ports.json)
//! target/release/pagebench get-page --page-service 127.0.0.1:PG_PORT --http 127.0.0.1:HTTP_PORT \
//!     --tenant bench --relations 10 --blocks 1000 --chain-length 10 --lsn latest \
//!     --connections 8 --depth 16 --duration 3
//! ```
//!
//! The shape flags (`--relations`, `--blocks`, `--chain-length`, defaults 10, 1000, 10: the
//! `chain10` scenario of test_runner/performance/measure.py) must be the floor's, or be left out
//! of the pagebench command (pagebench then takes the key space as it is). `--lsn random` works
//! too (the requested LSN is echoed). **Never `--verify`**: it compares every page with the one
//! the data set's seed makes, and the floor's page is zeros; pagebench refuses at its seed check
//! ("its page 0 ... is not the image seed").
//!
//! Design:
//! - std sockets and `nix` epoll, no tokio on the data path: `--threads N` workers (default 2),
//!   each with its own epoll and its own connections, never shared (no locks on the path);
//! - one acceptor thread (blocking `accept`) hands connections to the workers round-robin
//!   (a queue and an eventfd per worker), rather than an `SO_REUSEPORT` listener per worker:
//!   the kernel spreads reuseport connections by a hash of their addresses, so 8 connections
//!   over 2 workers come out 4/4 only about a quarter of the time (as coin flips would), and a
//!   floor must not move with the source ports pagebench happened to get;
//! - level-triggered, one `read` per readable event, and every reply of that read in one
//!   `writev` whose page slices all point at one static page (details in [`serve`]);
//! - the HTTP responder is a blocking std thread of its own, one request per connection.
//!
//! Deliberately absent: storage, tenants (any id is answered), ingest, LSN waits, page
//! contents, metrics (`/metrics` is a 404), idle timeouts, a connection limit other than the
//! descriptor limit, and graceful shutdown (SIGTERM and SIGINT end the process at once; nothing
//! is left to clean up but `ports.json`). It logs only failures, on stderr.
//!
//! Reference (2026-11-23, on top of commit d48fb20, the project's 2-vCPU KVM VM, release build,
//! pagebench with its default 1 thread on the same vCPUs, one 3 s run, chain10 shape, `--lsn
//! latest`): ~750k requests/s at 8 connections x depth 16, 0 errors, p50 116 us. At that point
//! pagebench used ~95% of a vCPU and the floor ~0.8 vCPU (about 1 us of CPU per request): the
//! figure is bounded by the client, so it is what pagebench itself can drive on this machine.
//!
//! Exit status: it runs until killed; 1 with a `page-floor: failed to ...` line if it cannot
//! start or a worker fails (epoll or eventfd errors), 2 for bad arguments.

#[path = "page-floor/http.rs"]
mod http;
#[path = "page-floor/serve.rs"]
mod serve;

use std::io::Write as _;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;

use anyhow::Context;
use clap::Parser;

use crate::http::DataSet;

#[derive(Parser, Debug)]
#[command(name = "page-floor", about = "Loopback floor of pagebench get-page: constant pages over epoll")]
struct Args {
    /// Page service address (HOST:PORT; port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen_pg: String,
    /// HTTP address for pagebench's key space request (HOST:PORT; port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen_http: String,
    /// Page service worker threads, each with its own epoll.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=256))]
    threads: u32,
    /// Write DIR/ports.json (`{"pg": ..., "http": ...}`, as the daemon does); DIR is created.
    #[arg(long, value_name = "DIR")]
    workdir: Option<PathBuf>,
    /// Relations of the key space served (as `pagebench ingest --relations`).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    relations: u32,
    /// Blocks per relation (as `pagebench ingest --blocks`).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    blocks: u32,
    /// Records per page of the data set pretended (as `pagebench ingest --chain-length`): it
    /// sets the end LSN that pagebench's shape check expects.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=10_000))]
    chain_length: u32,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "page-floor: failed to {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Binds, announces the addresses, starts every thread, and returns only when one of them
/// fails (they run until the process is killed).
fn run(args: Args) -> anyhow::Result<()> {
    let Args { listen_pg, listen_http, threads, workdir, relations, blocks, chain_length } = args;
    let data = DataSet::new(relations, blocks, chain_length)?;

    let pg = TcpListener::bind(&listen_pg).with_context(|| format!("listen on {listen_pg}"))?;
    let http = TcpListener::bind(&listen_http).with_context(|| format!("listen on {listen_http}"))?;
    let pg_addr = pg.local_addr().context("read the page service address")?;
    let http_addr = http.local_addr().context("read the HTTP address")?;
    let ports = serde_json::json!({ "pg": pg_addr.to_string(), "http": http_addr.to_string() }).to_string();

    // Workers first: a connection accepted once the addresses are out has somewhere to go.
    let (ended_tx, ended_rx) = mpsc::channel::<anyhow::Result<()>>();
    let mut inboxes = Vec::new();
    for i in 0..threads {
        let inbox = serve::Inbox::new()?;
        inboxes.push(inbox.clone());
        let lsn = data.end_lsn;
        spawn(format!("floor-pg-{i}"), &ended_tx, move || serve::worker(inbox, lsn))?;
    }
    spawn("floor-accept".into(), &ended_tx, move || serve::accept(pg, inboxes))?;
    spawn("floor-http".into(), &ended_tx, move || http::serve(http, &data))?;

    if let Some(dir) = &workdir {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        pageserver::storage::durable_write(dir, pageserver::server::PORTS_FILE, ports.as_bytes())
            .context("write ports.json")?;
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{ports}").and_then(|()| stdout.flush()).context("print the addresses")?;
    drop(stdout);

    drop(ended_tx);
    match ended_rx.recv() {
        Ok(result) => result.and_then(|()| anyhow::bail!("serve: a thread stopped")),
        Err(_) => anyhow::bail!("serve: every thread stopped"),
    }
}

/// Starts a named thread that reports its end on `ended`.
fn spawn(
    name: String,
    ended: &mpsc::Sender<anyhow::Result<()>>,
    body: impl FnOnce() -> anyhow::Result<()> + Send + 'static,
) -> anyhow::Result<()> {
    let ended = ended.clone();
    let context = format!("run thread {name}");
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
                .unwrap_or_else(|_| Err(anyhow::anyhow!("the thread panicked")));
            let _ = ended.send(result.context(context));
        })
        .with_context(|| format!("start thread {name}"))?;
    Ok(())
}
