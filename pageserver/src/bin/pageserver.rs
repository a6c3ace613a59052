//! `pageserver`: the daemon. Parses arguments, sets up logging and signals, and calls
//! [`pageserver::server::run`].
//!
//! Signals: the first SIGTERM or SIGINT starts a clean shutdown (exit status 0 once everything
//! stopped); a second one, or SIGQUIT at any time, exits at once with status
//! [`IMMEDIATE_EXIT_STATUS`] (redo children see EOF and exit by themselves; ingests not yet
//! acknowledged may be lost, acknowledged ones are durable). The signal task never ends before
//! the process does, so no signal is ever swallowed.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use pageserver::config::{PageServerConf, DEFAULT_WORKDIR};
use pageserver::logging;
use tokio_util::sync::CancellationToken;

/// Exit status of a bad setting or argument.
const BAD_CONFIG_STATUS: u8 = 2;
/// Exit status after a second SIGTERM/SIGINT or a SIGQUIT: not a clean stop.
const IMMEDIATE_EXIT_STATUS: i32 = 1;

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
    let runtime =
        match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("pageserver").build() {
            Ok(runtime) => runtime,
            Err(e) => {
                tracing::error!("failed to start the async runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
    let result = runtime.block_on(async {
        let shutdown = CancellationToken::new();
        tokio::spawn(watch_signals(shutdown.clone()));
        pageserver::server::run(conf, shutdown).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("pageserver failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Cancels `shutdown` at the first SIGTERM or SIGINT; exits the process at once at the second,
/// or at a SIGQUIT. Runs until the process ends.
async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int, mut quit) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
        signal(SignalKind::quit()),
    ) {
        (Ok(term), Ok(int), Ok(quit)) => (term, int, quit),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            tracing::error!("failed to install signal handlers, stop the daemon with SIGKILL: {e}");
            return;
        }
    };
    loop {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
            _ = quit.recv() => "SIGQUIT",
        };
        if name == "SIGQUIT" || shutdown.is_cancelled() {
            tracing::warn!("received {name}: exiting at once, without a clean shutdown");
            std::process::exit(IMMEDIATE_EXIT_STATUS);
        }
        // Cancel first: the shutdown starts even if the log line cannot be written.
        shutdown.cancel();
        tracing::info!("received {name}: shutting down cleanly (send it again, or SIGQUIT, to exit at once)");
    }
}
