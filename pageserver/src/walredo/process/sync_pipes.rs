//! The `sync` process kind: non-blocking pipe fds driven by `nix::poll` on the calling thread;
//! and the `auto` kind, the same pipes with a second way to wait ([`Wait::Yield`]).
//!
//! A round trip does its pipe I/O as blocking `poll` loops on the calling thread: no reactor
//! registration, no wake-up through the runtime, which makes it the lower-latency kind at low
//! concurrency. What it must not do is stall other tenants: a blocked executor thread would
//! hold up every task queued on it (with the default two workers, one hung child froze every
//! tenant and the management API for the whole `wal_redo_timeout`). So:
//! - waiting for a pipe (the stdin lock to write, the stdout lock to read) is an async wait on
//!   a tokio mutex, which blocks no thread: at most two threads per child are ever blocked, the
//!   writer holding stdin and the reader holding stdout;
//! - the blocking I/O itself runs under [`tokio::task::block_in_place`] on a multi-thread
//!   runtime, which hands the worker's other tasks to another thread first; it is entered only
//!   when the fd is not ready (a write that fits in the pipe, or a reply already there, costs no
//!   hand-off). On a current-thread runtime there is no other thread, and the I/O blocks it.
//!
//! Spin window ([`super::Process::set_spin`]): with a window `W > 0`, the reader busy-polls
//! (non-blocking reads with `spin_loop` hints between them) for up to `W` before it blocks in
//! `poll`, so a reply that comes within `W` costs no wake-up of this thread. The first spin of a
//! round trip runs before the `block_in_place` hand-off, which a reply within `W` then avoids
//! too; it holds the executor thread for at most `W` (at most `MAX_SPIN_US`, 1 ms), as the
//! blocking read it replaces would have. In the blocking part, every wait for bytes spins first.
//!
//! Time: the child is timed, not the queue, as in the async kind ([`pipeline::Progress`],
//! [`pipeline::Patience`]): every `poll` waits until the child's deadline (no progress for the
//! timeout while work waits on it: [`ProcessError::Timeout`] for its oldest request, the child
//! is killed) or, behind other requests, until the child is stalled ([`ProcessError::Stalled`]:
//! the request goes to another child) or the queue's deadline ([`ProcessError::QueueTimeout`],
//! the child lives on). Requests are written with vectored writes (`writev`), from the buffers
//! their parts were read into, the queued ones together by the holder of the stdin lock
//! ([`crate::walredo::write_queue`]).
//!
//! Waiting ([`Wait`], set per child by [`SyncPipes::set_wait`], read once per round trip): the
//! sync kind always blocks as above. An `auto` child follows the controller's path: blocking
//! while few requests overlap, *yielding* while many do: the fds are registered with tokio's
//! reactor ([`PipeFd`], `tokio::net::unix::pipe`), and every wait for a pipe is an await, as
//! in the async kind; the reader does not spin then (it would busy-loop an executor thread).
//! The registration is made by the first yielding wait on a pipe and dropped by the next
//! blocking one under the same lock, so that a blocking child's replies do not also wake the
//! reactor.
//!
//! Cancellation: a blocking round trip can only be dropped while it waits for a lock (the I/O
//! between two awaits runs to its end); a yielding one also while it waits for a pipe. Before
//! its write nothing happened; dropped halfway through its write (yielding only), the writer is
//! fenced and `on_broken_write` retires the child, as in the async kind; after its write, its
//! reply slot is abandoned ([`pipeline::Claim`]) and the reply is dropped on arrival, and the
//! bytes read so far stay in the shared reader. A write cut short by a timeout or an error
//! fences the writer under the stdin lock: no byte follows a partial frame.

use std::io::{self, IoSlice};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::BufMut;
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};
use tokio::net::unix::pipe;

use super::round_trip::{ChildPipes, KindPipes};
use crate::util::lock;
use crate::walredo::pipeline::ProcessError;
use crate::walredo::pipeline::{self, ChildReply, Patience, Waiter};
use crate::walredo::write_queue::Batch;
use crate::worker_controller::Wait;

type Stdin = pipeline::PipeWriter<PipeFd>;
type Stdout = pipeline::PipeReader<PipeFd>;

/// Which end of a pipe a [`PipeFd`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// The child's stdout, read by the daemon.
    Read,
    /// The child's stdin, written by the daemon.
    Write,
}

/// One non-blocking end of a pipe to the child: a plain fd, or the same fd registered with
/// tokio's reactor (`tokio::net::unix::pipe`) while waits on it yield.
pub(crate) struct PipeFd {
    end: End,
    state: PipeState,
}

enum PipeState {
    Plain(OwnedFd),
    Receiver(pipe::Receiver),
    Sender(pipe::Sender),
    /// Registering or deregistering failed, which closes the fd: every use fails from now on
    /// (and the child is retired for it).
    Lost,
}

impl PipeFd {
    fn new(fd: OwnedFd, end: End) -> PipeFd {
        PipeFd { end, state: PipeState::Plain(fd) }
    }

    fn fd(&self) -> io::Result<BorrowedFd<'_>> {
        match &self.state {
            PipeState::Plain(fd) => Ok(fd.as_fd()),
            PipeState::Receiver(receiver) => Ok(receiver.as_fd()),
            PipeState::Sender(sender) => Ok(sender.as_fd()),
            PipeState::Lost => Err(lost()),
        }
    }

    /// A non-blocking read into `buf`'s spare room, not zeroed first (`WouldBlock` when the pipe
    /// is empty). On the reactor, a `WouldBlock` also clears the readiness that the next
    /// [`PipeFd::ready`] waits for.
    fn read(&self, buf: &mut impl BufMut) -> io::Result<usize> {
        match &self.state {
            PipeState::Receiver(receiver) => receiver.try_read_buf(buf),
            _ => {
                let fd = self.fd()?;
                // SAFETY: the slice is only written, by the kernel; nothing is de-initialized.
                let spare = unsafe { buf.chunk_mut().as_uninit_slice_mut() };
                let n = rustix::io::read(fd, spare)?.0.len();
                // SAFETY: the read initialized the first `n` bytes of the chunk.
                unsafe { buf.advance_mut(n) };
                Ok(n)
            }
        }
    }

    /// A non-blocking vectored write (`WouldBlock` when the pipe is full); see [`PipeFd::read`].
    fn write(&self, slices: &[IoSlice<'_>]) -> io::Result<usize> {
        match &self.state {
            PipeState::Sender(sender) => sender.try_write_vectored(slices),
            _ => Ok(nix::sys::uio::writev(self.fd()?, slices)?),
        }
    }

    /// Waits on the reactor until the pipe may be read (or written, for the write end), or
    /// `deadline` passes; registers the fd first if it is not. Readiness, a hang-up or an error
    /// is only a hint: the next read or write says which. Cancel-safe: it only waits.
    async fn ready(&mut self, deadline: Instant, timeout: Duration) -> Result<(), ProcessError> {
        if let PipeState::Plain(_) = self.state {
            self.state = match (std::mem::replace(&mut self.state, PipeState::Lost), self.end) {
                (PipeState::Plain(fd), End::Read) => {
                    pipe::Receiver::from_owned_fd_unchecked(fd).map(PipeState::Receiver)
                }
                (PipeState::Plain(fd), End::Write) => {
                    pipe::Sender::from_owned_fd_unchecked(fd).map(PipeState::Sender)
                }
                (other, _) => Ok(other),
            }
            .context("register walredo pipe with the reactor")
            .map_err(ProcessError::Io)?;
        }
        let ready = async {
            match &self.state {
                PipeState::Receiver(receiver) => receiver.readable().await,
                PipeState::Sender(sender) => sender.writable().await,
                PipeState::Plain(_) | PipeState::Lost => Err(lost()),
            }
        };
        match crate::util::timeout_if_pending(|| deadline.into(), ready).await {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(ProcessError::Io(anyhow::Error::new(e).context("wait for walredo pipe"))),
            None => Err(ProcessError::Timeout(timeout)),
        }
    }

    /// Takes the fd off the reactor, if it is on it (before blocking waits, which do not need
    /// it: a registered fd's events would also wake the reactor for nothing).
    fn unregister(&mut self) -> Result<(), ProcessError> {
        if matches!(self.state, PipeState::Receiver(_) | PipeState::Sender(_)) {
            self.state = match std::mem::replace(&mut self.state, PipeState::Lost) {
                PipeState::Receiver(receiver) => receiver.into_nonblocking_fd().map(PipeState::Plain),
                PipeState::Sender(sender) => sender.into_nonblocking_fd().map(PipeState::Plain),
                other => Ok(other),
            }
            .context("take walredo pipe off the reactor")
            .map_err(ProcessError::Io)?;
        }
        Ok(())
    }
}

fn lost() -> io::Error {
    io::Error::other("walredo pipe closed after a failed reactor (de)registration")
}

/// `spin_loop` hints between two non-blocking reads while spinning: a read is a syscall, the
/// hints keep the loop from hammering the pipe's lock in between, for well under a microsecond.
const SPIN_HINTS_PER_READ: u32 = 16;

pub(crate) struct SyncPipes {
    /// Waiting for a pipe's lock blocks no thread (see the module doc); the guards are held
    /// across the awaits of the other lock and of `block_in_place`.
    pipes: ChildPipes<PipeFd, PipeFd>,
    /// The spin window of the reader, in microseconds (0: block at once).
    spin_us: AtomicU64,
    /// Whether round trips wait by yielding ([`Wait::Yield`]: awaits on tokio's reactor, no
    /// spin) rather than blocking ([`Wait::Block`]: `poll` on the calling thread under
    /// `block_in_place`, the reader spinning first).
    yields: AtomicBool,
}

impl SyncPipes {
    pub(crate) fn new(stdin: OwnedFd, stdout: OwnedFd) -> anyhow::Result<SyncPipes> {
        for fd in [stdin.as_fd(), stdout.as_fd()] {
            set_nonblocking(fd).context("make walredo pipe non-blocking")?;
        }
        Ok(SyncPipes {
            pipes: ChildPipes::new(PipeFd::new(stdin, End::Write), PipeFd::new(stdout, End::Read)),
            spin_us: AtomicU64::new(0),
            yields: AtomicBool::new(false),
        })
    }

    /// Sets how round trips that start from now on wait for the pipes.
    pub(crate) fn set_wait(&self, wait: Wait) {
        self.yields.store(wait == Wait::Yield, Ordering::Relaxed);
    }

    pub(crate) fn wait_mode(&self) -> Wait {
        if self.yields.load(Ordering::Relaxed) {
            Wait::Yield
        } else {
            Wait::Block
        }
    }

    /// Sets how long the reader busy-polls for a reply before it blocks (see the module doc);
    /// the caller caps it.
    pub(crate) fn set_spin(&self, window: Duration) {
        self.spin_us.store(u64::try_from(window.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn spin(&self) -> Duration {
        Duration::from_micros(self.spin_us.load(Ordering::Relaxed))
    }

    /// The child's progress clock.
    pub(crate) fn progress(&self) -> &pipeline::Progress {
        &self.pipes.shared.progress
    }

    /// Reads the first frame of the child (its hello), before any request is written.
    ///
    /// Cancel-safe while it waits for the stdout lock; the read itself runs to its end.
    pub(crate) async fn read_first(&self, timeout: Duration) -> Result<ChildReply, ProcessError> {
        let deadline = Instant::now() + timeout;
        let mut stdout = lock_until(&self.pipes.stdout, deadline, timeout).await?;
        blocking(|| read_reply(&mut stdout, deadline, timeout, Duration::ZERO))
    }

    /// Writes the rest of the batch, blocking while the child makes progress.
    fn write_rest<F: FnOnce()>(
        &self,
        batch: &mut Batch<'_, PipeFd, F>,
        patience: Patience,
    ) -> Result<(), ProcessError> {
        while !batch.finished() {
            let deadline = self.pipes.shared.write_deadline(batch.written(), patience);
            let waited = wait(&batch.writer.pipe, PollFlags::POLLOUT, deadline, patience.timeout);
            self.write_after_wait(waited, batch, patience)?;
        }
        Ok(())
    }

    /// [`SyncPipes::write_rest`], yielding while it waits.
    async fn write_rest_yielding<F: FnOnce()>(
        &self,
        batch: &mut Batch<'_, PipeFd, F>,
        patience: Patience,
    ) -> Result<(), ProcessError> {
        while !batch.finished() {
            let deadline = self.pipes.shared.write_deadline(batch.written(), patience);
            let waited = batch.writer.pipe.ready(deadline, patience.timeout).await;
            self.write_after_wait(waited, batch, patience)?;
        }
        Ok(())
    }

    /// After a wait for the pipe to take bytes: writes what fits, counting it as progress of
    /// the child (it made room); or, if the wait ended at its deadline, fails as
    /// [`Shared::write_expired`] says for the request being written, or writes nothing (the
    /// child made progress meanwhile, the caller waits on); else the wait's error.
    fn write_after_wait<F: FnOnce()>(
        &self,
        waited: Result<(), ProcessError>,
        batch: &mut Batch<'_, PipeFd, F>,
        patience: Patience,
    ) -> Result<(), ProcessError> {
        match waited {
            Ok(()) => {}
            Err(ProcessError::Timeout(_)) => {
                return match self.pipes.shared.write_expired(
                    batch.seq(),
                    batch.written(),
                    Instant::now(),
                    patience,
                ) {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            }
            Err(e) => return Err(e),
        }
        let before = (batch.seq(), batch.written());
        let result = write_some(batch);
        if (batch.seq(), batch.written()) != before {
            self.pipes.shared.progress.mark();
        }
        result
    }

    /// Reads replies (parking the others') until ours comes, yielding while the pipe is empty.
    ///
    /// Cancel-safe: dropped while it waits, the bytes read so far stay in the shared reader.
    async fn read_yielding(
        &self,
        stdout: &mut Stdout,
        waiter: &Waiter<'_>,
    ) -> Result<ChildReply, ProcessError> {
        loop {
            if let Some(reply) = self.read_available(stdout, waiter.seq)? {
                return Ok(reply);
            }
            let at_head = match waiter.take() {
                Ok(reply) => return Ok(reply),
                Err(at_head) => at_head,
            };
            match stdout.pipe.ready(waiter.read_deadline(at_head), waiter.patience.timeout).await {
                Ok(()) => {}
                Err(ProcessError::Timeout(_)) => {
                    if let Some(e) = waiter.expired() {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Busy-polls for up to `window` for our reply, reading (and parking) the others' on the
    /// way; `None` if it did not come within it.
    fn spin_for_reply(
        &self,
        stdout: &mut Stdout,
        seq: u64,
        window: Duration,
    ) -> Result<Option<ChildReply>, ProcessError> {
        if window.is_zero() {
            return Ok(None);
        }
        let until = Instant::now() + window;
        while Instant::now() < until {
            spin_hints();
            if let Some(reply) = self.read_available(stdout, seq)? {
                return Ok(Some(reply));
            }
        }
        Ok(None)
    }

    /// Reads the replies that can be read without waiting; returns ours if it was among them.
    fn read_available(&self, stdout: &mut Stdout, seq: u64) -> Result<Option<ChildReply>, ProcessError> {
        loop {
            if let Some(reply) = lock(&self.pipes.shared.replies).take(seq) {
                return Ok(Some(reply));
            }
            match stdout.replies.take()? {
                Some(reply) => self.pipes.shared.park(reply),
                None => match read_some(stdout)? {
                    Some(0) => return Err(eof()),
                    Some(_) => {}
                    None => return Ok(None),
                },
            }
        }
    }
}

/// Waits chosen per round trip: blocking or yielding ([`Wait`], see the module doc).
impl KindPipes for SyncPipes {
    type In = PipeFd;
    type Out = PipeFd;
    type Mode = Wait;

    fn mode(&self) -> Wait {
        self.wait_mode()
    }

    fn pipes(&self) -> &ChildPipes<Self::In, Self::Out> {
        &self.pipes
    }

    async fn write_queued<F: FnOnce() + Send>(
        &self,
        writer: &mut Stdin,
        on_broken_write: Option<F>,
        wait: Wait,
        patience: Patience,
    ) -> Result<(), ProcessError> {
        if wait == Wait::Block {
            writer.pipe.unregister()?;
        }
        // Fences the writer at once, under the lock, if the write ends halfway: no byte may
        // follow a partial frame.
        let mut batch = Batch::take(writer, &self.pipes.shared, &self.pipes.queue, on_broken_write);
        let mut result = write_some(&mut batch);
        if result.is_ok() && !batch.finished() {
            result = match wait {
                Wait::Block => blocking(|| self.write_rest(&mut batch, patience)),
                Wait::Yield => self.write_rest_yielding(&mut batch, patience).await,
            };
        }
        if let Err(e) = result {
            batch.fail(&e);
        }
        Ok(())
    }

    async fn read_own(
        &self,
        stdout: &mut Stdout,
        waiter: &Waiter<'_>,
        wait: Wait,
    ) -> Result<ChildReply, ProcessError> {
        if wait == Wait::Yield {
            return self.read_yielding(stdout, waiter).await;
        }
        stdout.pipe.unregister()?;
        // First what is there already, then what comes within the spin window, without a
        // hand-off; then block for the rest.
        if let Some(reply) = self.read_available(stdout, waiter.seq)? {
            return Ok(reply);
        }
        let spin = self.spin();
        if let Some(reply) = self.spin_for_reply(stdout, waiter.seq, spin)? {
            return Ok(reply);
        }
        blocking(|| loop {
            let at_head = match waiter.take() {
                Ok(reply) => return Ok(reply),
                Err(at_head) => at_head,
            };
            match read_reply(stdout, waiter.read_deadline(at_head), waiter.patience.timeout, spin) {
                Ok(reply) => self.pipes.shared.park(reply),
                Err(ProcessError::Timeout(_)) => {
                    if let Some(e) = waiter.expired() {
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        })
    }
}

/// Runs blocking pipe I/O without stalling the other tasks of this executor thread.
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    crate::util::park::block_in_place(f)
}

async fn lock_until<T>(
    mutex: &tokio::sync::Mutex<T>,
    deadline: Instant,
    timeout: Duration,
) -> Result<tokio::sync::MutexGuard<'_, T>, ProcessError> {
    tokio::time::timeout_at(deadline.into(), mutex.lock()).await.map_err(|_| ProcessError::Timeout(timeout))
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> nix::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map(drop)
}

/// Waits (blocking) until `pipe` is ready for `events` or the deadline passes.
fn wait(pipe: &PipeFd, events: PollFlags, deadline: Instant, timeout: Duration) -> Result<(), ProcessError> {
    let fd = pipe.fd().context("poll walredo pipe").map_err(ProcessError::Io)?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ProcessError::Timeout(timeout));
        }
        // Round up so that a sub-millisecond remainder still waits.
        let millis = PollTimeout::try_from(left.as_millis().saturating_add(1).min(i32::MAX as u128) as i32)
            .unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(fd, events)];
        match nix::poll::poll(&mut fds, millis) {
            Ok(0) | Err(Errno::EINTR) => continue,
            // Readable, writable, or HUP/ERR: the next read or write reports which.
            Ok(_) => return Ok(()),
            Err(e) => return Err(ProcessError::Io(anyhow::Error::new(e).context("poll walredo pipe"))),
        }
    }
}

/// Writes what fits of the batch without waiting; the error that stopped it, if any.
fn write_some<F: FnOnce()>(batch: &mut Batch<'_, PipeFd, F>) -> Result<(), ProcessError> {
    while !batch.finished() {
        match batch.write_with(|pipe, slices| pipe.write(slices)) {
            Ok(written) => batch.advance(written),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ProcessError::Io(anyhow::Error::new(e).context("write to walredo stdin"))),
        }
    }
    Ok(())
}

/// One non-blocking read into the reply buffer: `None` when nothing is there yet.
fn read_some(stdout: &mut Stdout) -> Result<Option<usize>, ProcessError> {
    loop {
        match stdout.pipe.read(&mut stdout.replies.spare()) {
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ProcessError::Io(anyhow::Error::new(e).context("read walredo stdout"))),
        }
    }
}

/// Reads the next reply, waiting until `deadline`; each wait for bytes busy-polls for up to
/// `spin` before it blocks in `poll`.
fn read_reply(
    stdout: &mut Stdout,
    deadline: Instant,
    timeout: Duration,
    spin: Duration,
) -> Result<ChildReply, ProcessError> {
    // When the current busy-poll ends; `None` while not spinning.
    let mut spin_until = None;
    loop {
        if let Some(reply) = stdout.replies.take()? {
            return Ok(reply);
        }
        match read_some(stdout)? {
            Some(0) => return Err(eof()),
            Some(_) => spin_until = None,
            None if spin.is_zero() => wait(&stdout.pipe, PollFlags::POLLIN, deadline, timeout)?,
            None => {
                let until = *spin_until.get_or_insert_with(|| Instant::now() + spin);
                if Instant::now() < until {
                    spin_hints();
                } else {
                    wait(&stdout.pipe, PollFlags::POLLIN, deadline, timeout)?;
                    spin_until = None;
                }
            }
        }
    }
}

fn spin_hints() {
    for _ in 0..SPIN_HINTS_PER_READ {
        std::hint::spin_loop();
    }
}

fn eof() -> ProcessError {
    ProcessError::Io(anyhow::anyhow!("walredo stdout closed (EOF)"))
}
