//! One walredo child process: spawn, hello, round trips, and the task that watches it.
//!
//! The process kinds differ only in how they move bytes through the pipes ([`sync_pipes`]:
//! non-blocking fds and `nix::poll` on the calling thread, or, for the `auto` kind, that or
//! awaits on the same fds, as [`Process::set_path`] says; [`async_pipes`]: tokio's
//! `ChildStdin`/`ChildStdout`). Everything else is here, once.
//!
//! Spin window ([`Process::set_spin`]): the daemon's lever on how a child waits between
//! requests. The window goes to the child in an `S` frame, through the same round trip as a
//! request (ordered with them, matched by position like them); the child busy-polls its stdin
//! for up to the window before it blocks. The sync kind's reader does the same for the reply;
//! the async kind never spins on the daemon side (it would busy-loop an executor thread).
//!
//! Each child has one tokio task, its watcher ([`watch`]), that owns the `tokio::process::Child`:
//! it logs the child's stderr ([`stderr`]), kills the child when asked, and awaits its exit, so
//! that a child that dies on its own (killed from outside while idle) is reaped and taken out
//! of service at once. No OS thread per child: spawning (fork and exec) runs on the blocking
//! pool, everything else is a task.
//!
//! Trust model: the child is not trusted once it has seen a request. Every reply header is
//! checked ([`super::pipeline::ReplyReader`]), its stderr is capped in line length and volume,
//! and a misbehaving child is killed, never waited for without a deadline.
//!
//! Invariants:
//! - the child is killed (SIGKILL) and reaped exactly once, by its watcher: at retirement for
//!   a failure, when the last reference to the [`Process`] drops, or when it exits on its own;
//!   no zombie is left behind and nothing blocks the runtime;
//! - the live-process gauge and the stop counter move exactly once per child.

pub(crate) mod async_pipes;
#[cfg(test)]
mod pipe_tests;
mod round_trip;
mod stderr;
pub(crate) mod sync_pipes;

use std::os::fd::AsFd;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, ChildStderr};
use tokio_util::sync::CancellationToken;
use walredo_proc::protocol;

use super::metrics::{StopCause, WalRedoMetrics};
use super::pipeline::{ChildReply, Patience, ProcessError, Progress};
use super::priority::WriteTicket;
use super::request::Request;
use super::{ProcessKind, WalRedoConf};
use crate::util::lock;
use crate::worker_controller::Wait;

/// Pipe buffer size asked for both directions, so that deep pipelines do not stall.
const PIPE_SIZE: i32 = 1024 * 1024;

enum Pipes {
    Sync(sync_pipes::SyncPipes),
    Async(async_pipes::AsyncPipes),
}

impl Pipes {
    /// One frame out, its reply back; `on_broken_write` runs if the future is dropped halfway
    /// through the write (the stream is broken: the caller retires the child).
    async fn round_trip(
        &self,
        request: &Arc<Request>,
        ticket: WriteTicket<'_>,
        patience: Patience,
        on_broken_write: impl FnOnce() + Send,
    ) -> Result<ChildReply, ProcessError> {
        match self {
            Pipes::Sync(pipes) => {
                round_trip::round_trip(pipes, request, ticket, patience, on_broken_write).await
            }
            Pipes::Async(pipes) => {
                round_trip::round_trip(pipes, request, ticket, patience, on_broken_write).await
            }
        }
    }

    fn progress(&self) -> &Progress {
        match self {
            Pipes::Sync(pipes) => pipes.progress(),
            Pipes::Async(pipes) => pipes.progress(),
        }
    }
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
    ///
    /// Cancel-safe: it only waits.
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

/// What a [`Process`] shares with its watcher task: enough to retire it, kill it and learn of
/// its exit, without keeping the [`Process`] alive (its drop is what kills an unused child).
struct Lifecycle {
    pid: u32,
    kind: ProcessKind,
    stop_cause: OnceLock<StopCause>,
    /// Cancelled to make the watcher kill the child.
    kill: CancellationToken,
    /// Cancelled by the watcher once the child is reaped.
    exited: CancellationToken,
    /// Set just before `exited` is cancelled: read by every pick of a pool's child, which
    /// must not take the token's lock (shared by every thread serving the tenant).
    reaped: AtomicBool,
    metrics: Arc<WalRedoMetrics>,
}

impl Lifecycle {
    /// Records the retirement once, with a log line; returns whether this call did. A
    /// failure after a graceful retirement (a stalled or draining child that is then hung)
    /// is logged too: it is what kills the child.
    fn mark_retired(&self, cause: StopCause) -> bool {
        let first = self.record_stop(cause);
        let killing = !cause.is_graceful() && !self.kill.is_cancelled();
        if cause == StopCause::Stalled {
            if first {
                tracing::warn!(
                    pid = self.pid,
                    "walredo process makes no progress while requests wait: it takes no new \
                     request, and those behind its oldest go to another process"
                );
            }
        } else if cause.is_failure() && (first || killing) {
            tracing::warn!(pid = self.pid, cause = cause.label(), "killing walredo process");
        } else if first {
            tracing::info!(pid = self.pid, cause = cause.label(), "stopping walredo process");
        }
        first
    }

    /// Records the stop once in the metrics; returns whether this call did.
    fn record_stop(&self, cause: StopCause) -> bool {
        if self.stop_cause.set(cause).is_err() {
            return false;
        }
        self.metrics.processes_stopped.with_label_values(&[cause.label()]).inc();
        self.metrics.process_kind.with_label_values(&[self.kind.as_str()]).dec();
        true
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
    /// Time with at least one request in flight (for the pool's controller).
    busy: Mutex<BusyClock>,
    /// The `flags` of the child's hello (0 until it is read).
    hello_flags: AtomicU32,
    /// The spin window the child last acknowledged, in microseconds (0 at start).
    spin_us: AtomicU32,
    /// Serializes [`Process::set_spin`] calls, so that `spin_us` records the window the child
    /// holds (the last one it got); holds whether `spin_us` is known to be the child's window
    /// (false after a call was dropped halfway). A tokio mutex: held across the round trip.
    spin_lock: tokio::sync::Mutex<bool>,
    pipes: Pipes,
    life: Arc<Lifecycle>,
    tenant_id: String,
}

impl Process {
    /// Spawns a child of `kind`, enlarges its pipes and checks its hello.
    ///
    /// Cancel-safe: if dropped, the half-started child is killed and reaped (by its watcher,
    /// or by tokio's `kill_on_drop` if the watcher was not started yet).
    pub(crate) async fn spawn(
        conf: &WalRedoConf,
        kind: ProcessKind,
        tenant_id: &str,
        metrics: Arc<WalRedoMetrics>,
        reaping: Arc<Reaping>,
    ) -> anyhow::Result<Arc<Process>> {
        let start = Instant::now();
        let (binary, args) = (conf.binary.clone(), conf.args.clone());
        // fork and exec take about a millisecond: not on an executor thread.
        let mut child = tokio::task::spawn_blocking(move || {
            tokio::process::Command::new(&binary)
                .args(&args)
                .env_clear()
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .with_context(|| format!("spawn walredo process {}", binary.display()))
        })
        .await
        .context("join the spawning task")??;
        let (Some(pid), Some(stdin), Some(stdout), Some(stderr)) =
            (child.id(), child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            anyhow::bail!("walredo process has no pid or no pipes");
        };
        for fd in [stdin.as_fd(), stdout.as_fd()] {
            // Best effort: the default 64 KiB still works, it only pipelines less deeply.
            if let Err(e) = nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE)) {
                tracing::debug!(pid, "could not enlarge walredo pipe: {e}");
            }
        }

        reaping.spawned();
        metrics.processes_started.with_label_values(&[kind.as_str()]).inc();
        metrics.process_kind.with_label_values(&[kind.as_str()]).inc();
        let life = Arc::new(Lifecycle {
            pid,
            kind,
            stop_cause: OnceLock::new(),
            kill: CancellationToken::new(),
            exited: CancellationToken::new(),
            reaped: AtomicBool::new(false),
            metrics,
        });
        tokio::spawn(watch(child, stderr, Arc::clone(&life), reaping, tenant_id.to_string()));

        let pipes = match kind {
            ProcessKind::Sync | ProcessKind::Auto => (|| {
                let stdin = stdin.into_owned_fd().context("take walredo stdin")?;
                let stdout = stdout.into_owned_fd().context("take walredo stdout")?;
                sync_pipes::SyncPipes::new(stdin, stdout)
            })()
            .map(Pipes::Sync),
            ProcessKind::Async => Ok(Pipes::Async(async_pipes::AsyncPipes::new(stdin, stdout))),
        };
        let pipes = match pipes {
            Ok(pipes) => pipes,
            Err(e) => {
                life.mark_retired(StopCause::BadHello);
                life.kill.cancel();
                return Err(e.context("set up walredo pipes"));
            }
        };
        let process = Arc::new(Process {
            kind,
            pid,
            started: start,
            served: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            last_used_ms: AtomicU64::new(0),
            busy: Mutex::new(BusyClock::default()),
            hello_flags: AtomicU32::new(0),
            spin_us: AtomicU32::new(0),
            spin_lock: tokio::sync::Mutex::new(true),
            pipes,
            life,
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
        process.hello_flags.store(hello.flags, Ordering::Relaxed);
        if conf.args.is_empty() && hello.flags & protocol::HELLO_FLAG_SECCOMP == 0 {
            tracing::warn!(pid, "walredo process runs without its seccomp sandbox");
        }
        process.life.metrics.process_launch_seconds.observe(start.elapsed().as_secs_f64());
        tracing::info!(pid, kind = kind.as_str(), tenant_id, "launched walredo process");
        Ok(process)
    }

    async fn read_hello(&self, timeout: Duration) -> Result<walredo_proc::protocol::Hello, ProcessError> {
        let reply = match &self.pipes {
            Pipes::Sync(pipes) => pipes.read_first(timeout).await,
            Pipes::Async(pipes) => pipes.read_first(timeout).await,
        }?;
        match reply {
            ChildReply::Hello(hello) => Ok(hello),
            other => Err(ProcessError::Io(anyhow::anyhow!("expected a hello, got {other:?}"))),
        }
    }

    /// Sends one request and waits for its reply, as `patience` allows (see
    /// [`Patience`]). `ticket` (the request's place in the foreground writer queue) is given
    /// up once the request is written.
    ///
    /// Cancel-safe: if dropped after the request was written, its reply is discarded when it
    /// arrives; if dropped halfway through the write (async kind only: the sync kind writes
    /// without yielding), the process is retired (the stream is broken).
    pub(crate) async fn round_trip(
        &self,
        request: &Arc<Request>,
        ticket: WriteTicket<'_>,
        patience: Patience,
    ) -> Result<ChildReply, ProcessError> {
        let reply = self.exchange(request, ticket, patience).await?;
        self.served.fetch_add(1, Ordering::Relaxed);
        Ok(reply)
    }

    /// One request out, its reply back, through this child's kind of pipes; what
    /// [`Process::round_trip`] and [`Process::set_spin`] share.
    async fn exchange(
        &self,
        request: &Arc<Request>,
        ticket: WriteTicket<'_>,
        patience: Patience,
    ) -> Result<ChildReply, ProcessError> {
        self.pipes.round_trip(request, ticket, patience, || self.retire(StopCause::CancelledWrite)).await
    }

    /// Whether work waits on this child and it has made no progress for `patience.stall`
    /// (see [`Patience`]): new requests must not queue on it.
    pub(crate) fn stalled(&self, now: Instant, patience: Patience) -> bool {
        self.in_flight.load(Ordering::Relaxed) > 0 && now >= self.pipes.progress().stalled_at(patience)
    }

    /// Whether work waits on this child and it has made no progress for a whole `period`.
    pub(crate) fn stuck_for(&self, now: Instant, period: Duration) -> bool {
        self.stalled(now, Patience { timeout: period, stall: period })
    }

    /// Sets how this child's round trips from now on wait for it, if its kind lets the
    /// controller choose (`auto`): blocking ([`Wait::Block`]) or yielding ([`Wait::Yield`]).
    /// Other kinds keep their own.
    pub(crate) fn set_wait(&self, wait: Wait) {
        if let (ProcessKind::Auto, Pipes::Sync(pipes)) = (self.kind, &self.pipes) {
            pipes.set_wait(wait);
        }
    }

    /// How this child's round trips wait now.
    pub(crate) fn wait(&self) -> Wait {
        match &self.pipes {
            Pipes::Sync(pipes) => pipes.wait_mode(),
            Pipes::Async(_) => Wait::Yield,
        }
    }

    /// Total time this child had at least one request in flight, up to now.
    pub(crate) fn busy_time(&self) -> Duration {
        let clock = lock(&self.busy);
        clock.total + clock.since.map_or(Duration::ZERO, |since| since.elapsed())
    }

    /// Sets how long the child busy-polls for its next request before it blocks, and for the
    /// sync kind how long the reader busy-polls for a reply before it blocks; zero: block at
    /// once (how a child starts). `window` is cut to [`protocol::MAX_SPIN_US`] and to whole
    /// microseconds. Returns whether the child took it: `false` when its hello does not
    /// announce the `S` frame (nothing is sent). A window equal to the one the child holds
    /// sends nothing either, so a controller may repeat its decision every period. An error is
    /// a failed round trip, like a request's (the caller retires the child for it); so is any
    /// reply but a zero page. It does not count as use of the child (its idle stop).
    ///
    /// Cancel-safe: the window rides the round-trip path, so a drop never hands its reply to
    /// another request. Dropped after its frame was written, the child may hold the new window
    /// while [`Process::spin_us`] still says the old one, until the next call, which then
    /// sends its window whatever it is: the child spins at most a window per request either
    /// way.
    pub(crate) async fn set_spin(&self, window: Duration, patience: Patience) -> Result<bool, ProcessError> {
        if !self.supports_spin() {
            return Ok(false);
        }
        let micros = spin_micros(window);
        let mut frame = Vec::new();
        protocol::encode_set_spin(&mut frame, micros);
        let request = Arc::new(Request::frames(frame));
        let mut known = self.spin_lock.lock().await;
        if *known && self.spin_us() == micros {
            return Ok(true);
        }
        // Unknown until the child acknowledges (stays so if this future is dropped).
        *known = false;
        // Not `round_trip`: a control frame is not a request served.
        let reply = self.exchange(&request, WriteTicket::none(), patience).await?;
        match reply {
            ChildReply::Page(page) if page.iter().all(|&b| b == 0) => {}
            other => {
                let what = match other {
                    ChildReply::Error(code, message) => format!("{}: {message}", code.name()),
                    ChildReply::Page(_) => "a page that is not zero".to_string(),
                    ChildReply::Hello(_) => "a hello".to_string(),
                };
                return Err(ProcessError::Io(anyhow::anyhow!(
                    "walredo process {} answered a spin window of {micros} us with {what}",
                    self.pid
                )));
            }
        }
        self.spin_us.store(micros, Ordering::Relaxed);
        *known = true;
        if let Pipes::Sync(pipes) = &self.pipes {
            pipes.set_spin(Duration::from_micros(u64::from(micros)));
        }
        tracing::debug!(pid = self.pid, spin_us = micros, "walredo process spin window set");
        Ok(true)
    }

    /// Whether the child's hello announced the `S` frame (spin windows).
    pub(crate) fn supports_spin(&self) -> bool {
        self.hello_flags.load(Ordering::Relaxed) & protocol::HELLO_FLAG_SPIN != 0
    }

    /// The spin window the child last acknowledged, in microseconds (see [`Process::set_spin`]).
    pub(crate) fn spin_us(&self) -> u32 {
        self.spin_us.load(Ordering::Relaxed)
    }

    fn mark_used(&self) {
        self.last_used_ms.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    pub(crate) fn idle_for(&self) -> Duration {
        self.started
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_used_ms.load(Ordering::Relaxed)))
    }

    /// Whether the child has exited and been reaped (it can serve nothing any more).
    pub(crate) fn has_exited(&self) -> bool {
        self.life.reaped.load(Ordering::Acquire)
    }

    /// Takes the process out of service for `cause`; the first cause given wins.
    ///
    /// Failures kill the child now, so every request pipelined on it fails fast; graceful
    /// causes leave it running until the last in-flight request drops its reference.
    pub(crate) fn retire(&self, cause: StopCause) {
        self.life.mark_retired(cause);
        // Also after a graceful retirement: a child draining after a kind change that then
        // hangs or fails must die now, not when its last request gives up.
        if !cause.is_graceful() {
            self.life.kill.cancel();
        }
    }

    /// Retires the process and kills and reaps the child before returning (shutdown).
    ///
    /// Cancel-safe: if dropped, the child is still killed and reaped by its watcher.
    pub(crate) async fn retire_and_wait(&self, cause: StopCause) {
        self.life.mark_retired(cause);
        self.life.kill.cancel();
        self.life.exited.cancelled().await;
    }
}

/// A spin window as the child holds it: whole microseconds, at most [`protocol::MAX_SPIN_US`].
pub(crate) fn spin_micros(window: Duration) -> u32 {
    u32::try_from(window.as_micros()).unwrap_or(u32::MAX).min(protocol::MAX_SPIN_US)
}

/// Busy time of a child: the periods with at least one request in flight, summed.
#[derive(Debug, Default)]
struct BusyClock {
    /// When the current busy period began, if one is going on.
    since: Option<Instant>,
    /// Busy periods that ended.
    total: Duration,
}

/// A process taken by one request: counted in its `in_flight` (which keeps the idle check
/// away) until dropped, also when the request is cancelled halfway.
pub(crate) struct InUse(Arc<Process>);

impl InUse {
    /// Counts a new user of `process`; callers hold the manager's slot lock while they call it.
    pub(crate) fn new(process: &Arc<Process>) -> InUse {
        let mut clock = lock(&process.busy);
        if process.in_flight.fetch_add(1, Ordering::Relaxed) == 0 {
            clock.since = Some(Instant::now());
            // Work waits on the child from now on: its progress clock starts here, not at
            // whatever it last did before it went idle.
            process.pipes.progress().mark();
        }
        drop(clock);
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
        let mut clock = lock(&self.0.busy);
        if self.0.in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            if let Some(since) = clock.since.take() {
                clock.total += since.elapsed();
            }
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.retire(StopCause::Dropped);
        self.life.kill.cancel();
        tracing::debug!(pid = self.pid, tenant_id = self.tenant_id, "dropped walredo process");
    }
}

/// The child's watcher: logs its stderr, kills it when asked, reaps it when it exits, and
/// takes it out of service if it exited on its own. Ends once the child is reaped.
async fn watch(
    mut child: Child,
    stderr: ChildStderr,
    life: Arc<Lifecycle>,
    reaping: Arc<Reaping>,
    tenant_id: String,
) {
    let pid = life.pid;
    let mut log = stderr::StderrLog::new(Instant::now());
    let mut stderr = Some(stderr);
    let mut chunk = [0u8; 4096];
    let mut killed = false;
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            () = life.kill.cancelled(), if !killed => {
                killed = true;
                // Harmless if it exited already: it is not reaped yet, so the pid is still ours.
                if let Err(e) = child.start_kill() {
                    tracing::debug!(pid, "kill walredo process: {e}");
                }
            }
            n = read_some(&mut stderr, &mut chunk) => match n {
                Some(n) => log.feed(Instant::now(), &chunk[..n], |e| log_stderr(pid, &tenant_id, &life, e)),
                None => stderr = None,
            },
        }
    };
    // What the child wrote just before it died; bounded, in case a descendant holds the pipe.
    let drain = async {
        while stderr.is_some() {
            match read_some(&mut stderr, &mut chunk).await {
                Some(n) => log.feed(Instant::now(), &chunk[..n], |e| log_stderr(pid, &tenant_id, &life, e)),
                None => stderr = None,
            }
        }
    };
    let _ = tokio::time::timeout(stderr::DRAIN_AFTER_EXIT, drain).await;
    log.end(Instant::now(), |e| log_stderr(pid, &tenant_id, &life, e));

    if life.record_stop(StopCause::Crashed) {
        tracing::warn!(pid, tenant_id, "walredo process exited on its own");
    }
    reaping.reaped(pid, status);
    life.reaped.store(true, Ordering::Release);
    life.exited.cancel();
}

/// One read of the child's stderr: `None` at EOF or on an error (or when already closed,
/// after which it never completes, so that `select!` leaves it alone).
async fn read_some(stderr: &mut Option<ChildStderr>, chunk: &mut [u8]) -> Option<usize> {
    let Some(pipe) = stderr else {
        return std::future::pending().await;
    };
    match pipe.read(chunk).await {
        Ok(0) => None,
        Ok(n) => Some(n),
        Err(e) => {
            tracing::debug!("stop reading walredo stderr: {e}");
            None
        }
    }
}

fn log_stderr(pid: u32, tenant_id: &str, life: &Lifecycle, event: stderr::Event) {
    match event {
        stderr::Event::Line { text, truncated } => {
            let suffix = if truncated { " [line truncated]" } else { "" };
            tracing::info!(pid, tenant_id, "walredo stderr: {text}{suffix}");
        }
        stderr::Event::DroppingStarted => {
            tracing::warn!(pid, tenant_id, "walredo stderr over its rate limit, dropping lines");
        }
        stderr::Event::Dropped { lines } => {
            life.metrics.stderr_lines_dropped.inc_by(lines);
            tracing::warn!(pid, tenant_id, lines, "walredo stderr: dropped lines over the rate limit");
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    // The request and page of number `n`, shared with the manager's tests.
    use crate::walredo::tests::{expected_for, records_for, tag};

    async fn redo(process: &Process, n: u32) {
        let request = Arc::new(Request::redo(&tag(n), None, &records_for(n)));
        let reply = process
            .round_trip(&request, WriteTicket::none(), Patience::of_timeout(Duration::from_secs(20)))
            .await
            .unwrap_or_else(|e| panic!("request {n}: {e}"));
        assert!(reply == ChildReply::Page(expected_for(n)), "request {n} got {reply:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn set_spin_on_a_live_process_keeps_its_round_trips_correct() {
        let conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
        let metrics = Arc::new(WalRedoMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let timeout = Patience::of_timeout(Duration::from_secs(20));
        for kind in ProcessKind::ALL {
            let reaping = Reaping::new();
            let process = Process::spawn(&conf, kind, "tenant", Arc::clone(&metrics), Arc::clone(&reaping))
                .await
                .expect("spawn");
            assert_eq!(process.spin_us(), 0, "{kind}: a child starts parked");
            let mut n = 0;
            // 5 ms is above the cap: cut to 1 ms.
            for (window, expect_us) in [(100, 100), (5000, 1000), (0, 0), (200, 200)] {
                let window = Duration::from_micros(window);
                assert!(process.set_spin(window, timeout).await.expect("set_spin"), "{kind}");
                assert_eq!(process.spin_us(), expect_us, "{kind}");
                // One at a time (each side waits, spinning or not, between requests) ...
                for _ in 0..30 {
                    redo(&process, n).await;
                    n += 1;
                }
                // ... and pipelined, with windows set in between, as a controller would.
                let mut tasks = tokio::task::JoinSet::new();
                for i in 0..24u32 {
                    let process = Arc::clone(&process);
                    let m = n + i;
                    tasks.spawn(async move {
                        if m % 8 == 0 {
                            let window = Duration::from_micros(u64::from(m % 300));
                            assert!(process.set_spin(window, timeout).await.expect("set_spin"));
                        }
                        redo(&process, m).await;
                    });
                }
                n += 24;
                while let Some(joined) = tasks.join_next().await {
                    joined.expect("client task");
                }
                assert!(process.set_spin(window, timeout).await.expect("set_spin"));
                assert_eq!(process.spin_us(), expect_us, "{kind}: the last window set is the one held");
            }
            assert_eq!(process.served.load(Ordering::Relaxed), u64::from(n), "{kind}: S is not a request");
            assert!(!process.has_exited(), "{kind}");
            process.retire_and_wait(StopCause::Shutdown).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_auto_child_switches_path_under_pipelined_load_and_stays_correct() {
        let conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
        let metrics = Arc::new(WalRedoMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let process =
            Process::spawn(&conf, ProcessKind::Auto, "tenant", metrics, Reaping::new()).await.expect("spawn");
        assert_eq!(process.wait(), Wait::Block, "an auto child starts blocking");
        assert!(process
            .set_spin(Duration::from_micros(50), Patience::of_timeout(Duration::from_secs(20)))
            .await
            .expect("set_spin"));
        let mut n = 0;
        for round in 0..6u32 {
            // Requests in flight on both paths at once: the switch lands between their waits.
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..48u32 {
                let client = Arc::clone(&process);
                let m = n + i;
                tasks.spawn(async move { redo(&client, m).await });
                if i % 12 == 5 {
                    let wait = if (round + i) % 2 == 0 { Wait::Yield } else { Wait::Block };
                    process.set_wait(wait);
                    assert_eq!(process.wait(), wait);
                }
            }
            n += 48;
            while let Some(joined) = tasks.join_next().await {
                joined.expect("client task");
            }
            // And one at a time on each path.
            for wait in [Wait::Yield, Wait::Block] {
                process.set_wait(wait);
                for _ in 0..5 {
                    redo(&process, n).await;
                    n += 1;
                }
            }
        }
        assert_eq!(process.served.load(Ordering::Relaxed), u64::from(n));
        // Only `auto` lets the path be chosen.
        let metrics = Arc::new(WalRedoMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let sync =
            Process::spawn(&conf, ProcessKind::Sync, "tenant", metrics, Reaping::new()).await.expect("spawn");
        sync.set_wait(Wait::Yield);
        assert_eq!(sync.wait(), Wait::Block);
        process.retire_and_wait(StopCause::Shutdown).await;
        sync.retire_and_wait(StopCause::Shutdown).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_child_draining_after_a_kind_change_is_still_killed_when_it_fails() {
        let conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
        let metrics = Arc::new(WalRedoMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        for kind in ProcessKind::ALL {
            let reaping = Reaping::new();
            let process = Process::spawn(&conf, kind, "tenant", Arc::clone(&metrics), Arc::clone(&reaping))
                .await
                .expect("spawn");
            // Draining: out of service, alive while requests still hold it (we do).
            process.retire(StopCause::KindChange);
            assert!(!process.has_exited(), "{kind}: a draining child is not killed");
            // Then one of those requests times out: the child must die now, not when the last
            // request lets go of it.
            process.retire(StopCause::Timeout);
            let deadline = Instant::now() + Duration::from_secs(10);
            while !process.has_exited() {
                assert!(Instant::now() < deadline, "{kind}: the failed draining child was not killed");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert!(reaping.last_exit().is_some_and(|exit| exit.contains("SIGKILL")), "{kind}");
        }
    }
}
