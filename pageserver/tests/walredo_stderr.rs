//! A child that floods its stderr cannot flood the daemon's log: its lines are capped in
//! volume, and the dropped ones are counted. Its own test binary, because it installs the
//! process-wide log subscriber that counts the lines logged.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pageserver::test_support::walredo_proc_binary;
use pageserver::walredo::{ProcessKind, WalRedoConf, WalRedoManager, WalRedoMetrics};

/// Log lines that carry a line of a child's stderr.
static STDERR_LINES_LOGGED: AtomicU64 = AtomicU64::new(0);

struct CountingWriter;

impl Write for CountingWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        let n = text.lines().filter(|line| line.contains("walredo stderr: flood line")).count();
        STDERR_LINES_LOGGED.fetch_add(n as u64, Ordering::Relaxed);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stderr_flood_of_a_child_is_capped_and_the_dropped_lines_are_counted() {
    tracing_subscriber::fmt().with_writer(|| CountingWriter).with_ansi(false).init();
    const FLOOD: u64 = 100_000;
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(WalRedoMetrics::new(&registry).expect("register metrics"));
    let mut conf = WalRedoConf::with_binary(walredo_proc_binary());
    conf.process_kind = ProcessKind::Async;
    conf.timeout = Duration::from_secs(20);
    conf.args = vec!["--test-stderr-flood-on-ping".to_string()];
    let manager = WalRedoManager::new("tenant-flood", conf, metrics);
    // The ping is answered after the child wrote all of its flood.
    manager.ping().await.expect("ping");
    // Shutdown returns once the child is reaped and its stderr read to the end.
    manager.shutdown().await;

    let logged = STDERR_LINES_LOGGED.load(Ordering::Relaxed);
    let text = prometheus::TextEncoder::new().encode_to_string(&registry.gather()).expect("encode metrics");
    let dropped: u64 = text
        .lines()
        .find(|line| line.starts_with("pageserver_wal_redo_stderr_lines_dropped_total "))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0);
    assert!(logged <= 200, "{logged} of {FLOOD} flood lines reached the log");
    assert_eq!(logged + dropped, FLOOD, "every line is either logged or counted as dropped");
}
