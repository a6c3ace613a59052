//! `pageserver`: the daemon. Parses arguments, sets up logging and signals, and calls
//! [`pageserver::server::run`].
//!
//! Signals: the first SIGTERM or SIGINT starts a clean shutdown (exit status 0 once everything
//! stopped); a second one, or SIGQUIT at any time, exits at once with status
//! [`IMMEDIATE_EXIT_STATUS`] (redo children see EOF and exit by themselves; ingests not yet
//! acknowledged may be lost, acknowledged ones are durable). Signals are blocked in every thread
//! and taken by one thread of their own (`sigwait`), never by the async runtime: a runtime whose
//! threads are all blocked (a log write to a full pipe, a sync redo on a hung child) must still
//! hear the second signal. That thread never logs itself (a log write can block): it hands its
//! log lines to short-lived threads.

use std::path::PathBuf;
use std::process::ExitCode;

use std::time::Duration;

use clap::Parser;
use nix::sys::signal::{SigSet, Signal};
use pageserver::config::{PageServerConf, DEFAULT_WORKDIR};
use pageserver::logging;
use tokio_util::sync::CancellationToken;

/// Exit status of a bad setting or argument.
const BAD_CONFIG_STATUS: u8 = 2;
/// Exit status after a second SIGTERM/SIGINT or a SIGQUIT: not a clean stop.
const IMMEDIATE_EXIT_STATUS: i32 = 1;

/// jemalloc (`heap.rs` says why).
#[global_allocator]
static ALLOCATOR: pageserver::heap::Allocator = pageserver::heap::Allocator {};

/// The pageserver daemon: stores pages and WAL records per tenant, serves pages at any LSN.
#[derive(Parser)]
#[command(version = concat!(env!("CARGO_PKG_VERSION"), " (git ", env!("GIT_COMMIT"), ")"))]
struct Args {
    /// Working directory: settings (pageserver.toml), tenants' data, lock and ports files.
    #[arg(short = 'D', long = "workdir", default_value = DEFAULT_WORKDIR)]
    workdir: PathBuf,
    /// Override one setting, KEY=VALUE (see docs/settings.md); may be repeated.
    #[arg(short = 'c', long = "config-override", value_name = "KEY=VALUE")]
    overrides: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let conf = match PageServerConf::load(&args.workdir, &args.overrides) {
        Ok(conf) => conf,
        Err(e) => {
            logging::eprint_line(&format!("pageserver: refusing to start: {e:#}"));
            return ExitCode::from(BAD_CONFIG_STATUS);
        }
    };
    logging::init(conf.log_format);
    pageserver::heap::start_purging();
    // Before any other thread exists, so that every thread inherits the mask (redo children do
    // not: spawning a process resets its signal mask).
    let signals = stop_signals();
    if let Err(e) = signals.thread_block() {
        tracing::error!("failed to block the stop signals: {e}");
        return ExitCode::FAILURE;
    }
    let shutdown = CancellationToken::new();
    let watcher = shutdown.clone();
    if let Err(e) =
        std::thread::Builder::new().name("signals".into()).spawn(move || watch_signals(signals, watcher))
    {
        tracing::error!("failed to start the signal thread: {e}");
        return ExitCode::FAILURE;
    }
    let runtime =
        // The page service's io_uring rings submit what their threads' connections handed over
        // when the thread runs out of work (page_service/uring.rs).
        match tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("pageserver")
            .on_thread_park(pageserver::util::park::before_park)
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => {
                tracing::error!("failed to start the async runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
    let result = runtime.block_on(pageserver::server::run(conf, shutdown));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("pageserver failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn stop_signals() -> SigSet {
    let mut set = SigSet::empty();
    for signal in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGQUIT] {
        set.add(signal);
    }
    set
}

/// Cancels `shutdown` at the first SIGTERM or SIGINT; exits the process at once at the second,
/// or at a SIGQUIT. Runs on its own thread until the process ends.
fn watch_signals(signals: SigSet, shutdown: CancellationToken) {
    loop {
        let signal = match signals.wait() {
            Ok(signal) => signal,
            Err(e) => {
                // sigwait fails only for an invalid set; without it, SIGKILL is left.
                log_aside(move || {
                    tracing::error!("failed to wait for signals, stop the daemon with SIGKILL: {e}")
                });
                return;
            }
        };
        if signal == Signal::SIGQUIT || shutdown.is_cancelled() {
            exit_at_once(signal);
        }
        shutdown.cancel();
        log_aside(move || {
            tracing::info!(
                "received {signal}: shutting down cleanly (send it again, or SIGQUIT, to exit at once)"
            )
        });
    }
}

/// Exits the process now, after logging why (given at most a second: stderr may be blocked).
fn exit_at_once(signal: Signal) -> ! {
    let (logged, wait) = std::sync::mpsc::channel();
    log_aside(move || {
        tracing::warn!("received {signal}: exiting at once, without a clean shutdown");
        let _ = logged.send(());
    });
    let _ = wait.recv_timeout(Duration::from_secs(1));
    std::process::exit(IMMEDIATE_EXIT_STATUS);
}

/// Runs a log statement on a short-lived thread of its own, so that a blocked stderr never
/// blocks the signal thread.
fn log_aside(log: impl FnOnce() + Send + 'static) {
    // Without a thread the line is lost; the signal is handled all the same.
    let _ = std::thread::Builder::new().name("signal-log".into()).spawn(log);
}
