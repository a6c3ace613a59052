//! Log setup of the daemon: `tracing` lines on stderr, plain or JSON (`log_format`), and panics
//! reported through `tracing` so that a JSON log stays JSON.
//!
//! **Invariant:** logging never panics and never stops the daemon. A write to stderr that fails
//! (the reader of a pipe went away: EPIPE; a full disk behind a redirect) loses that line and
//! nothing else: the writer swallows the error, and the fmt layer's own report of write errors
//! (an `eprintln!`, which panics on a closed stderr) is turned off. A blocking stderr (a pipe
//! nobody reads) still blocks the thread that logs.

use std::io::{self, Write};

use tracing_subscriber::fmt::MakeWriter;

/// Log line format on stderr (`log_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Plain,
    Json,
}

/// Sets the global subscriber (stderr, `RUST_LOG` or `info`) and the panic hook.
pub fn init(format: LogFormat) {
    let subscriber = subscriber(format, || LossyStderr);
    // Fails only if a subscriber is set already (a test that called init twice): keep that one.
    let _ = tracing::subscriber::set_global_default(subscriber);
    install_panic_hook();
}

/// The daemon's subscriber, writing to `writer`.
pub fn subscriber<W>(format: LogFormat, writer: W) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
        .with_ansi(false)
        .log_internal_errors(false);
    match format {
        LogFormat::Plain => Box::new(builder.finish()),
        LogFormat::Json => Box::new(builder.json().finish()),
    }
}

/// Replaces the default panic output (plain text on stderr) with one ERROR event carrying the
/// message, the location and, when `RUST_BACKTRACE` asks for it, the backtrace. The default
/// behaviour after the hook (unwinding) is unchanged.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(a panic payload that is not a string)");
        let location = info.location().map(|l| l.to_string()).unwrap_or_default();
        let backtrace = std::backtrace::Backtrace::capture();
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("unnamed");
        if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
            tracing::error!(target: "panic", thread, location, %backtrace, "panicked: {message}");
        } else {
            tracing::error!(target: "panic", thread, location, "panicked: {message}");
        }
    }));
}

/// stderr, losing a line rather than failing: the caller of a log macro cannot handle an error.
#[derive(Debug, Clone, Copy, Default)]
pub struct LossyStderr;

impl Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _ = io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for LossyStderr {
    type Writer = LossyStderr;

    fn make_writer(&'a self) -> LossyStderr {
        LossyStderr
    }
}

/// Writes a line to stderr, ignoring failure: for messages before logging is set up.
pub fn eprint_line(line: &str) {
    let mut stderr = io::stderr().lock();
    let _ = stderr.write_all(line.as_bytes());
    let _ = stderr.write_all(b"\n");
}
