//! `pageserver`: the daemon. Parses arguments, sets up logging and signals, and calls
//! [`pageserver::server::run`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use pageserver::config::{LogFormat, PageServerConf, DEFAULT_WORKDIR};
use tokio_util::sync::CancellationToken;

/// The pageserver daemon: stores pages and WAL records per tenant, serves pages at any LSN.
#[derive(Parser)]
#[command(version)]
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
            eprintln!("pageserver: refusing to start: {e:#}");
            return ExitCode::from(2);
        }
    };
    init_logging(conf.log_format);
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

/// Cancels `shutdown` at the first SIGTERM or SIGINT.
async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!("failed to install signal handlers, stop the daemon with SIGKILL: {e}");
            return;
        }
    };
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!("received {name}");
    shutdown.cancel();
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false);
    match format {
        LogFormat::Plain => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
