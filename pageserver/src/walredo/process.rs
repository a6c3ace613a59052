//! One walredo child process: spawn, hello, stderr logging, round trips, kill and reap.
//!
//! The two process kinds differ only in how they move bytes through the pipes
//! ([`sync_pipes`]: non-blocking fds and `nix::poll`, blocking the calling thread;
//! [`async_pipes`]: tokio's `ChildStdin`/`ChildStdout`). Everything else is here, once.
//!
//! Trust model: the child is not trusted once it has seen a request. Every reply header is
//! checked ([`super::pipeline::ReplyReader`]), its stderr lines are capped, and a misbehaving
//! child is killed, never waited for without a deadline.
//!
//! Invariants:
//! - the child is killed (SIGKILL) and reaped exactly once: at retirement for a failure, or
//!   when the last reference to the [`Process`] drops; reaping happens on a thread of its own,
//!   never blocking the async runtime, so no zombie is left behind;
//! - the live-process gauge and the stop counter move exactly once per child.

pub(crate) mod async_pipes;
pub(crate) mod sync_pipes;

use std::io::Read;
use std::os::fd::AsFd;
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use walredo_proc::protocol::FrameError;

use super::metrics::{StopCause, WalRedoMetrics};
use super::pipeline::Reply;
use super::{lock, ProcessKind, WalRedoConf};

/// Longest stderr line logged; the rest of a longer line is dropped.
const MAX_STDERR_LINE: usize = 4096;
/// Pipe buffer size asked for both directions, so that deep pipelines do not stall.
const PIPE_SIZE: i32 = 1024 * 1024;

/// How a round trip failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProcessError {
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    #[error("{0:#}")]
    Io(anyhow::Error),
    #[error("protocol violation by the child: {0}")]
    Protocol(#[from] FrameError),
}

impl ProcessError {
    pub(crate) fn stop_cause(&self) -> StopCause {
        match self {
            ProcessError::Timeout(_) => StopCause::Timeout,
            ProcessError::Io(_) => StopCause::Crashed,
            ProcessError::Protocol(_) => StopCause::ProtocolViolation,
        }
    }
}

enum Pipes {
    Sync(sync_pipes::SyncPipes),
    Async(async_pipes::AsyncPipes),
}

/// Children of one manager that are not reaped yet, and the exit status of the last one
/// reaped; shared by the manager and its processes.
pub(crate) struct Reaping {
    last_exit: Mutex<Option<String>>,
    unreaped: tokio::sync::watch::Sender<usize>,
}

impl Reaping {
    pub(crate) fn new() -> Arc<Reaping> {
        Arc::new(Reaping { last_exit: Mutex::new(None), unreaped: tokio::sync::watch::Sender::new(0) })
    }

    /// Exit status of the last child reaped, e.g. `pid 42: killed by SIGKILL`.
    pub(crate) fn last_exit(&self) -> Option<String> {
        lock(&self.last_exit).clone()
    }

    /// Waits until every child spawned so far has been reaped.
    pub(crate) async fn all_reaped(&self) {
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = self.unreaped.subscribe().wait_for(|&n| n == 0).await;
    }

    fn spawned(&self) {
        self.unreaped.send_modify(|n| *n += 1);
    }

    fn reaped(&self, pid: u32, status: std::io::Result<ExitStatus>) {
        let text = match status {
            Ok(status) => describe_exit(status),
            Err(e) => format!("wait failed: {e}"),
        };
        tracing::info!(pid, status = text, "walredo process reaped");
        *lock(&self.last_exit) = Some(format!("pid {pid}: {text}"));
        self.unreaped.send_modify(|n| *n = n.saturating_sub(1));
    }
}

pub(crate) struct Process {
    pub(crate) kind: ProcessKind,
    pub(crate) pid: u32,
    pub(crate) started: Instant,
    /// Requests answered with a page or an error frame.
    pub(crate) served: AtomicU64,
    /// Requests between taking this process and finishing with it (see the idle check).
    pub(crate) in_flight: AtomicUsize,
    /// Milliseconds since `started` at the last finished request.
    last_used_ms: AtomicU64,
    pipes: Pipes,
    /// The child, until it is handed to the reaper.
    child: Mutex<Option<Child>>,
    stop_cause: OnceLock<StopCause>,
    metrics: Arc<WalRedoMetrics>,
    reaping: Arc<Reaping>,
    tenant_id: String,
}

impl Process {
    /// Spawns a child of `kind`, enlarges its pipes and checks its hello.
    ///
    /// Cancel-safe: if dropped, the half-started child is killed and reaped by [`Drop`].
    pub(crate) async fn spawn(
        conf: &WalRedoConf,
        kind: ProcessKind,
        tenant_id: &str,
        metrics: Arc<WalRedoMetrics>,
        reaping: Arc<Reaping>,
    ) -> anyhow::Result<Arc<Process>> {
        let start = Instant::now();
        let mut child = Command::new(&conf.binary)
            .args(&conf.args)
            .env_clear()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawn walredo process {}", conf.binary.display()))?;
        let pid = child.id();
        reaping.spawned();
        let (stdin, stdout, stderr) = match (child.stdin.take(), child.stdout.take(), child.stderr.take()) {
            (Some(stdin), Some(stdout), Some(stderr)) => (stdin, stdout, stderr),
            _ => {
                reaping.reaped(pid, kill_and_reap(child));
                anyhow::bail!("walredo process {pid} has no pipes");
            }
        };
        for fd in [stdin.as_fd(), stdout.as_fd()] {
            // Best effort: the default 64 KiB still works, it only pipelines less deeply.
            if let Err(e) = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE)) {
                tracing::debug!(pid, "could not enlarge walredo pipe: {e}");
            }
        }
        spawn_stderr_logger(stderr, pid, tenant_id.to_string());

        let pipes = match kind {
            ProcessKind::Sync => sync_pipes::SyncPipes::new(stdin, stdout).map(Pipes::Sync),
            ProcessKind::Async => async_pipes::AsyncPipes::new(stdin, stdout).map(Pipes::Async),
        };
        let pipes = match pipes {
            Ok(pipes) => pipes,
            Err(e) => {
                reaping.reaped(pid, kill_and_reap(child));
                return Err(e.context("set up walredo pipes"));
            }
        };
        metrics.processes_started.with_label_values(&[kind.as_str()]).inc();
        metrics.process_kind.with_label_values(&[kind.as_str()]).inc();
        let process = Arc::new(Process {
            kind,
            pid,
            started: start,
            served: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            last_used_ms: AtomicU64::new(0),
            pipes,
            child: Mutex::new(Some(child)),
            stop_cause: OnceLock::new(),
            metrics,
            reaping,
            tenant_id: tenant_id.to_string(),
        });

        // From here on, dropping `process` kills and reaps the child.
        let hello = match process.read_hello(conf.timeout).await {
            Ok(hello) => hello,
            Err(e) => {
                process.retire(StopCause::BadHello);
                return Err(anyhow::Error::new(e).context(format!("read hello of walredo process {pid}")));
            }
        };
        if hello.pid != pid {
            process.retire(StopCause::BadHello);
            anyhow::bail!("walredo process {pid} says its pid is {}", hello.pid);
        }
        if conf.args.is_empty() && hello.flags & walredo_proc::protocol::HELLO_FLAG_SECCOMP == 0 {
            tracing::warn!(pid, "walredo process runs without its seccomp sandbox");
        }
        process.metrics.process_launch_seconds.observe(start.elapsed().as_secs_f64());
        tracing::info!(pid, kind = kind.as_str(), tenant_id, "launched walredo process");
        Ok(process)
    }

    async fn read_hello(&self, timeout: Duration) -> Result<walredo_proc::protocol::Hello, ProcessError> {
        let reply = match &self.pipes {
            Pipes::Sync(pipes) => pipes.read_first(timeout).await,
            Pipes::Async(pipes) => pipes.read_first(timeout).await,
        }?;
        match reply {
            Reply::Hello(hello) => Ok(hello),
            other => Err(ProcessError::Io(anyhow::anyhow!("expected a hello, got {other:?}"))),
        }
    }

    /// Sends one encoded request and waits for its reply, within `timeout`.
    ///
    /// Cancel-safe: if dropped after the request was written, its reply is discarded when it
    /// arrives; if dropped halfway through the write (async kind only: the sync kind writes
    /// without yielding), the process is retired (the stream is broken).
    pub(crate) async fn round_trip(&self, request: &[u8], timeout: Duration) -> Result<Reply, ProcessError> {
        let reply = match &self.pipes {
            Pipes::Sync(pipes) => pipes.round_trip(request, timeout).await,
            Pipes::Async(pipes) => {
                pipes.round_trip(request, timeout, || self.retire(StopCause::CancelledWrite)).await
            }
        }?;
        self.served.fetch_add(1, Ordering::Relaxed);
        Ok(reply)
    }

    fn mark_used(&self) {
        self.last_used_ms.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    pub(crate) fn idle_for(&self) -> Duration {
        self.started
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_used_ms.load(Ordering::Relaxed)))
    }

    /// Takes the process out of service for `cause`; the first cause given wins.
    ///
    /// Failures kill the child now, so every request pipelined on it fails fast; graceful
    /// causes leave it running until the last in-flight request drops its reference.
    pub(crate) fn retire(&self, cause: StopCause) {
        if self.mark_retired(cause) && !cause.is_graceful() {
            self.kill_and_reap_in_background();
        }
    }

    /// Retires the process and kills and reaps the child before returning (shutdown).
    pub(crate) async fn retire_and_wait(&self, cause: StopCause) {
        self.mark_retired(cause);
        let Some(child) = lock(&self.child).take() else { return };
        let (pid, reaping) = (self.pid, Arc::clone(&self.reaping));
        if let Err(e) = tokio::task::spawn_blocking(move || reaping.reaped(pid, kill_and_reap(child))).await {
            tracing::error!(pid, "failed to reap walredo process: {e}");
        }
    }

    /// Records the retirement once; returns whether this call did.
    fn mark_retired(&self, cause: StopCause) -> bool {
        if self.stop_cause.set(cause).is_err() {
            return false;
        }
        self.metrics.processes_stopped.with_label_values(&[cause.label()]).inc();
        self.metrics.process_kind.with_label_values(&[self.kind.as_str()]).dec();
        if cause.is_failure() {
            tracing::warn!(pid = self.pid, cause = cause.label(), "killing walredo process");
        } else {
            tracing::info!(pid = self.pid, cause = cause.label(), "stopping walredo process");
        }
        true
    }

    fn kill_and_reap_in_background(&self) {
        let Some(child) = lock(&self.child).take() else { return };
        let (pid, reaping) = (self.pid, Arc::clone(&self.reaping));
        let spawned = std::thread::Builder::new()
            .name(format!("walredo-reap-{pid}"))
            .spawn(move || reaping.reaped(pid, kill_and_reap(child)));
        if let Err(e) = spawned {
            tracing::error!(pid, "failed to start a reaper thread, the child stays a zombie: {e}");
        }
    }
}

/// A process taken by one request: counted in its `in_flight` (which keeps the idle check
/// away) until dropped, also when the request is cancelled halfway.
pub(crate) struct InUse(Arc<Process>);

impl InUse {
    /// Counts a new user of `process`; callers hold the manager's slot lock while they call it.
    pub(crate) fn new(process: &Arc<Process>) -> InUse {
        process.in_flight.fetch_add(1, Ordering::Relaxed);
        InUse(Arc::clone(process))
    }
}

impl std::ops::Deref for InUse {
    type Target = Arc<Process>;
    fn deref(&self) -> &Arc<Process> {
        &self.0
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        self.0.mark_used();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.retire(StopCause::Dropped);
        self.kill_and_reap_in_background();
        tracing::debug!(pid = self.pid, tenant_id = self.tenant_id, "dropped walredo process");
    }
}

/// SIGKILL (harmless if it already exited: it is not reaped yet, so the pid is still ours) and wait.
fn kill_and_reap(mut child: Child) -> std::io::Result<ExitStatus> {
    let _ = child.kill();
    child.wait()
}

fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => match nix::sys::signal::Signal::try_from(signal) {
            Ok(signal) => format!("killed by {signal}"),
            Err(_) => format!("killed by signal {signal}"),
        },
        _ => status.to_string(),
    }
}

/// Logs the child's stderr line by line with its pid, each line capped at [`MAX_STDERR_LINE`].
/// Runs on a thread of its own that ends at EOF, when the child is gone.
fn spawn_stderr_logger(mut stderr: ChildStderr, pid: u32, tenant_id: String) {
    let run = move || {
        let mut line = Vec::with_capacity(256);
        let mut truncated = false;
        let mut chunk = [0u8; 4096];
        let emit = |line: &mut Vec<u8>, truncated: bool| {
            let text = String::from_utf8_lossy(line);
            let suffix = if truncated { " [line truncated]" } else { "" };
            tracing::info!(pid, tenant_id, "walredo stderr: {}{suffix}", text.trim_end());
            line.clear();
        };
        loop {
            let n = match stderr.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!(pid, "stop reading walredo stderr: {e}");
                    break;
                }
            };
            for &byte in &chunk[..n] {
                if byte == b'\n' {
                    emit(&mut line, truncated);
                    truncated = false;
                } else if line.len() < MAX_STDERR_LINE {
                    line.push(byte);
                } else {
                    truncated = true;
                }
            }
        }
        if !line.is_empty() {
            emit(&mut line, truncated);
        }
    };
    if let Err(e) = std::thread::Builder::new().name(format!("walredo-stderr-{pid}")).spawn(run) {
        tracing::warn!(pid, "failed to start the stderr logger, stderr is not logged: {e}");
    }
}
