//! The daemon's log setup (`pageserver::logging`): panics become log events, so a JSON log stays
//! JSON; a writer that fails never makes logging panic.

#![allow(clippy::unwrap_used)]

use std::io::{self, Write};
use std::sync::{Arc, Mutex};

use pageserver::logging;
use pageserver::logging::LogFormat;
use tracing_subscriber::fmt::MakeWriter;

/// Collects what the subscriber writes.
#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Buffer {
    type Writer = Buffer;
    fn make_writer(&'a self) -> Buffer {
        self.clone()
    }
}

/// Fails every write, as stderr does once the reader of its pipe went away.
struct Broken;

impl Write for Broken {
    fn write(&mut self, _: &[u8]) -> io::Result<usize> {
        Err(io::Error::from(io::ErrorKind::BrokenPipe))
    }
    fn flush(&mut self) -> io::Result<()> {
        Err(io::Error::from(io::ErrorKind::BrokenPipe))
    }
}

// One test function: the panic hook is process-wide.
#[test]
fn a_panic_is_one_json_log_event_and_a_failing_writer_never_panics() {
    logging::install_panic_hook();

    let buffer = Buffer::default();
    let subscriber = logging::subscriber(LogFormat::Json, buffer.clone());
    tracing::subscriber::with_default(subscriber, || {
        let result = std::panic::catch_unwind(|| panic!("boom {}", 42));
        assert!(result.is_err());
    });
    let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "{text}");
    let event: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(event["level"], "ERROR", "{event}");
    assert_eq!(event["fields"]["message"], "panicked: boom 42", "{event}");
    assert!(event["fields"]["location"].as_str().unwrap().contains("logging.rs"), "{event}");

    let subscriber = logging::subscriber(LogFormat::Plain, || Broken);
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..3 {
            tracing::info!(i, "a line nobody reads");
        }
    });
    let subscriber = logging::subscriber(LogFormat::Plain, || logging::LossyStderr);
    tracing::subscriber::with_default(subscriber, || tracing::info!("stderr may be gone; no panic"));
}
