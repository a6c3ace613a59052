//! The `async` process kind: tokio's `ChildStdin`/`ChildStdout`, tokio mutexes.
//!
//! A round trip yields while it waits for the pipes, so the executor thread runs other tasks
//! meanwhile.
//!
//! Time: the child is timed, not the queue ([`pipeline::Progress`]). A request that waits for
//! the stdin lock, or for the replies of earlier requests, longer than the timeout gives up
//! with [`ProcessError::QueueTimeout`] and the child lives on; only a child that makes no
//! progress for the timeout while work waits on it is a [`ProcessError::Timeout`] (and killed).
//!
//! Cancellation: the mutexes are tokio's because their guards are held across the awaits of a
//! write or a read. A future dropped
//! - before its first byte is written: nothing happened;
//! - during its write, after some bytes: the child has part of a frame and the stream cannot
//!   be repaired: the writer is fenced at once ([`pipeline::Fence`]: no byte follows a partial
//!   frame) and the process is retired;
//! - after its write: its reply slot is marked abandoned and the reply is dropped on arrival;
//! - during a read: the bytes read so far stay in the shared [`pipeline::ReplyReader`], whose
//!   next holder carries on (`AsyncReadExt::read` is cancel-safe).

use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{ChildStdin, ChildStdout};

use super::ProcessError;
use crate::walredo::pipeline::{self, Claim, Fence, Reply, Shared, Turn, Waiter};
use crate::walredo::priority::WriteTicket;

type Writer = pipeline::Writer<ChildStdin>;
type Reader = pipeline::Reader<ChildStdout>;

pub(crate) struct AsyncPipes {
    stdin: tokio::sync::Mutex<Writer>,
    stdout: tokio::sync::Mutex<Reader>,
    shared: Shared,
}

impl AsyncPipes {
    pub(crate) fn new(stdin: ChildStdin, stdout: ChildStdout) -> AsyncPipes {
        AsyncPipes {
            stdin: tokio::sync::Mutex::new(Writer::new(stdin)),
            stdout: tokio::sync::Mutex::new(Reader::new(stdout)),
            shared: Shared::new(),
        }
    }

    /// Reads the first frame of the child (its hello), before any request is written.
    ///
    /// Not cancel-safe: dropped mid-frame, the reader loses its place; the caller (spawn)
    /// discards the child on any failure or drop.
    pub(crate) async fn read_first(&self, timeout: Duration) -> Result<Reply, ProcessError> {
        tokio::time::timeout(timeout, async { read_reply(&mut *self.stdout.lock().await).await })
            .await
            .unwrap_or(Err(ProcessError::Timeout(timeout)))
    }

    /// See [`super::Process::round_trip`]; `on_broken_write` runs if the future is dropped
    /// halfway through writing the request (cancellation: see the module doc).
    pub(crate) async fn round_trip(
        &self,
        request: &[u8],
        ticket: WriteTicket<'_>,
        timeout: Duration,
        on_broken_write: impl FnOnce(),
    ) -> Result<Reply, ProcessError> {
        let queue_deadline = Instant::now() + timeout;
        let seq = {
            let mut writer = Writer::lock(&self.stdin, ticket, queue_deadline, timeout).await?;
            let since = Instant::now();
            let mut fence = Fence::new(&mut *writer, request.len(), on_broken_write);
            while fence.written < request.len() {
                let deadline = self.shared.progress.child_deadline(timeout, since);
                let write = fence.writer.pipe.write(&request[fence.written..]);
                match tokio::time::timeout_at(deadline.into(), write).await {
                    Ok(Ok(0)) => return Err(fence.fail(io_error("walredo stdin accepts no bytes"))),
                    Ok(Ok(n)) => {
                        fence.written += n;
                        self.shared.progress.mark();
                    }
                    Ok(Err(e)) => {
                        let e = anyhow::Error::new(e).context("write to walredo stdin");
                        return Err(fence.fail(ProcessError::Io(e)));
                    }
                    Err(_) if Instant::now() >= self.shared.progress.child_deadline(timeout, since) => {
                        return Err(fence.fail(ProcessError::Timeout(timeout)));
                    }
                    // Another request saw progress meanwhile: wait on.
                    Err(_) => {}
                }
            }
            fence.done();
            writer.written()
        };
        let waiter = Waiter::after_write(&self.shared, seq, queue_deadline, timeout);
        // Dropped with the future while the reply is awaited, the claim abandons the slot.
        Claim::new(&self.shared.replies, seq).settle(self.read_until(&waiter).await)
    }

    async fn read_until(&self, waiter: &Waiter<'_>) -> Result<Reply, ProcessError> {
        let mut stdout = match waiter.turn(&self.stdout).await? {
            Turn::Reply(reply) => return Ok(reply),
            Turn::Reader(stdout) => stdout,
        };
        loop {
            let at_head = match waiter.take() {
                Ok(reply) => return Ok(reply),
                Err(at_head) => at_head,
            };
            match tokio::time::timeout_at(waiter.read_deadline(at_head).into(), read_reply(&mut stdout)).await
            {
                Ok(reply) => self.shared.park(reply?),
                Err(_) => {
                    if let Some(e) = waiter.expired() {
                        return Err(e);
                    }
                }
            }
        }
    }
}

fn io_error(message: &'static str) -> ProcessError {
    ProcessError::Io(anyhow::anyhow!(message))
}

async fn read_reply(stdout: &mut Reader) -> Result<Reply, ProcessError> {
    loop {
        if let Some(reply) = stdout.replies.take()? {
            return Ok(reply);
        }
        let n = stdout
            .pipe
            .read(stdout.replies.spare())
            .await
            .context("read walredo stdout")
            .map_err(ProcessError::Io)?;
        if n == 0 {
            return Err(ProcessError::Io(anyhow::anyhow!("walredo stdout closed (EOF)")));
        }
        stdout.replies.advance(n);
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, OwnedFd};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    use super::*;

    /// Pipes like a child's, whose other ends the test holds: (pipes, requests read end,
    /// requests write end duplicate, replies write end).
    fn fake_child() -> (Arc<AsyncPipes>, OwnedFd, OwnedFd, OwnedFd) {
        let (requests_r, requests_w) = nix::unistd::pipe().expect("pipe");
        let (replies_r, replies_w) = nix::unistd::pipe().expect("pipe");
        for fd in [&requests_r, &requests_w] {
            let flags = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GETFL).expect("getfl");
            let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
            nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_SETFL(flags)).expect("setfl");
        }
        let requests_w_dup = requests_w.try_clone().expect("dup");
        let stdin = ChildStdin::from_std(std::process::ChildStdin::from(requests_w)).expect("stdin");
        let stdout = ChildStdout::from_std(std::process::ChildStdout::from(replies_r)).expect("stdout");
        (Arc::new(AsyncPipes::new(stdin, stdout)), requests_r, requests_w_dup, replies_w)
    }

    /// Whether the pipe read by `fd` holds bytes.
    fn has_bytes(fd: &OwnedFd) -> bool {
        let mut fds = [nix::poll::PollFd::new(fd.as_fd(), nix::poll::PollFlags::POLLIN)];
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0)
    }

    /// Polls `future` once; whether it finished.
    async fn poll_once<F: std::future::Future + Unpin>(future: &mut F) -> bool {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::pin::Pin::new(&mut *future).poll(cx).is_ready())
        })
        .await
    }

    #[tokio::test]
    async fn no_byte_follows_a_request_whose_write_was_cut_short() {
        let (pipes, requests_r, _requests_w, _replies_w) = fake_child();
        let broken = Arc::new(AtomicUsize::new(0));
        let big = vec![b'1'; 4 << 20];
        let on_broken = {
            let broken = Arc::clone(&broken);
            move || {
                broken.fetch_add(1, Ordering::Relaxed);
            }
        };
        let mut first =
            Box::pin(pipes.round_trip(&big, WriteTicket::none(), Duration::from_secs(30), on_broken));
        // Poll until part of it is in the pipe (the first poll may only register the fd).
        let deadline = Instant::now() + Duration::from_secs(5);
        while !has_bytes(&requests_r) {
            assert!(!poll_once(&mut first).await, "a 4 MiB write cannot fit in a pipe");
            assert!(Instant::now() < deadline, "the request never reached the pipe");
            tokio::task::yield_now().await;
        }
        assert!(!poll_once(&mut first).await, "a 4 MiB write cannot fit in a pipe");
        // A second request queues for the stdin lock behind the cut-short one.
        let second = tokio::spawn({
            let pipes = Arc::clone(&pipes);
            async move {
                pipes.round_trip(b"second request", WriteTicket::none(), Duration::from_secs(30), || {}).await
            }
        });
        tokio::task::yield_now().await;
        drop(first);
        assert_eq!(broken.load(Ordering::Relaxed), 1, "the cut-short write is reported");

        // Drain the pipe: only bytes of the first request may ever be there.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut buf = vec![0u8; 1 << 16];
        let mut drained = 0usize;
        while !second.is_finished() && Instant::now() < deadline {
            match nix::unistd::read(requests_r.as_fd(), &mut buf) {
                Ok(n) => {
                    assert!(
                        buf[..n].iter().all(|&b| b == b'1'),
                        "bytes of another request follow a partial frame"
                    );
                    drained += n;
                }
                Err(nix::errno::Errno::EAGAIN) => tokio::task::yield_now().await,
                Err(e) => panic!("read: {e}"),
            }
        }
        assert!(drained > 0 && drained < big.len());
        let result = second.await.expect("task");
        assert!(matches!(result, Err(ProcessError::Io(_))), "{result:?}");
    }

    #[tokio::test]
    async fn a_request_cancelled_before_writing_a_byte_does_not_break_the_stream() {
        let (pipes, _requests_r, requests_w, _replies_w) = fake_child();
        // Fill the pipe, as a busy child would leave it.
        let chunk = vec![0u8; 1 << 16];
        loop {
            match nix::unistd::write(requests_w.as_fd(), &chunk) {
                Ok(_) => {}
                Err(nix::errno::Errno::EAGAIN) => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        let broken = Arc::new(AtomicUsize::new(0));
        let on_broken = {
            let broken = Arc::clone(&broken);
            move || {
                broken.fetch_add(1, Ordering::Relaxed);
            }
        };
        let mut request =
            Box::pin(pipes.round_trip(b"request", WriteTicket::none(), Duration::from_secs(30), on_broken));
        assert!(!poll_once(&mut request).await, "the pipe is full");
        drop(request);
        assert_eq!(broken.load(Ordering::Relaxed), 0, "nothing was written, nothing is broken");
    }
}
