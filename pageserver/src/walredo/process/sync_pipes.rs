//! The `sync` process kind: non-blocking pipe fds driven by `nix::poll`, std mutexes.
//!
//! A round trip blocks the calling thread (an executor thread, when called from async code)
//! from the write of the request to the read of its reply. That is the design under comparison:
//! it bounds the requests in flight by the number of threads and stalls the other tasks of a
//! blocked executor thread (docs/performance.md compares the two kinds).
//!
//! Every wait is a `poll` with the time left until the round trip's deadline; a poll that runs
//! out is a [`ProcessError::Timeout`]. Nothing here can be cancelled halfway: the calling
//! future does not yield during a round trip.

use std::os::fd::{AsFd, BorrowedFd};
use std::process::{ChildStdin, ChildStdout};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout};

use super::ProcessError;
use crate::walredo::lock;
use crate::walredo::pipeline::{self, Replies, Reply};

type Writer = pipeline::Writer<ChildStdin>;
type Reader = pipeline::Reader<ChildStdout>;

pub(crate) struct SyncPipes {
    stdin: Mutex<Writer>,
    stdout: Mutex<Reader>,
    replies: Mutex<Replies>,
}

impl SyncPipes {
    pub(crate) fn new(stdin: ChildStdin, stdout: ChildStdout) -> anyhow::Result<SyncPipes> {
        for fd in [stdin.as_fd(), stdout.as_fd()] {
            set_nonblocking(fd).context("make walredo pipe non-blocking")?;
        }
        Ok(SyncPipes {
            stdin: Mutex::new(Writer::new(stdin)),
            stdout: Mutex::new(Reader::new(stdout)),
            replies: Mutex::new(Replies::default()),
        })
    }

    /// Reads the first frame of the child (its hello), before any request is written.
    pub(crate) fn read_first(&self, timeout: Duration) -> Result<Reply, ProcessError> {
        let deadline = Instant::now() + timeout;
        let mut stdout = lock(&self.stdout);
        read_reply(&mut stdout, deadline, timeout)
    }

    pub(crate) fn round_trip(&self, request: &[u8], timeout: Duration) -> Result<Reply, ProcessError> {
        let deadline = Instant::now() + timeout;
        let seq = {
            let mut writer = lock(&self.stdin);
            write_all(writer.pipe.as_fd(), request, deadline, timeout)?;
            writer.written()
        };
        let mut stdout = lock(&self.stdout);
        loop {
            // Whoever held the lock before us may have read our reply already.
            if let Some(reply) = lock(&self.replies).take(seq) {
                return Ok(reply);
            }
            let reply = read_reply(&mut stdout, deadline, timeout)?;
            lock(&self.replies).push(reply);
        }
    }
}

fn set_nonblocking(fd: BorrowedFd<'_>) -> nix::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = OFlag::from_bits_truncate(fcntl(fd, FcntlArg::F_GETFL)?);
    fcntl(fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK)).map(drop)
}

/// Waits until `fd` is ready for `events` or the deadline passes.
fn wait(
    fd: BorrowedFd<'_>,
    events: PollFlags,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), ProcessError> {
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

fn write_all(
    fd: BorrowedFd<'_>,
    mut buf: &[u8],
    deadline: Instant,
    timeout: Duration,
) -> Result<(), ProcessError> {
    while !buf.is_empty() {
        match nix::unistd::write(fd, buf) {
            Ok(n) => buf = &buf[n..],
            Err(Errno::EAGAIN) => wait(fd, PollFlags::POLLOUT, deadline, timeout)?,
            Err(Errno::EINTR) => {}
            Err(e) => return Err(ProcessError::Io(anyhow::Error::new(e).context("write to walredo stdin"))),
        }
    }
    Ok(())
}

fn read_reply(stdout: &mut Reader, deadline: Instant, timeout: Duration) -> Result<Reply, ProcessError> {
    loop {
        if let Some(reply) = stdout.replies.take()? {
            return Ok(reply);
        }
        match nix::unistd::read(stdout.pipe.as_fd(), stdout.replies.spare()) {
            Ok(0) => return Err(ProcessError::Io(anyhow::anyhow!("walredo stdout closed (EOF)"))),
            Ok(n) => stdout.replies.advance(n),
            Err(Errno::EAGAIN) => wait(stdout.pipe.as_fd(), PollFlags::POLLIN, deadline, timeout)?,
            Err(Errno::EINTR) => {}
            Err(e) => return Err(ProcessError::Io(anyhow::Error::new(e).context("read walredo stdout"))),
        }
    }
}
