//! The `async` process kind: tokio's `ChildStdin`/`ChildStdout`, tokio mutexes.
//!
//! A round trip yields while it waits for the pipes, so the executor thread runs other tasks
//! meanwhile.
//!
//! Time: the child is timed, not the queue ([`pipeline::Progress`], [`pipeline::Patience`]). A
//! request that waits for the stdin lock, or for the replies of earlier requests, longer than
//! the timeout behind a child that works gives up with [`ProcessError::QueueTimeout`] and the
//! child lives on; behind a child that makes no progress for the stall window it leaves for
//! another child ([`ProcessError::Stalled`]); the oldest request of a child that makes no
//! progress for the timeout fails with [`ProcessError::Timeout`] (and the child is killed).
//! Requests are written with vectored writes, from the buffers their parts were read into, the
//! queued ones together by the holder of the stdin lock ([`crate::walredo::write_queue`]).
//!
//! Cancellation: the mutexes are tokio's because their guards are held across the awaits of a
//! write or a read. A future dropped
//! - before its request is written: its request leaves the queue (or, in another request's
//!   batch, is written and its reply dropped);
//! - while it writes the queue, partway through a request: the child has part of a frame and
//!   the stream cannot be repaired: the writer is fenced at once (no byte follows a partial
//!   frame), the requests behind fail, and the process is retired; between two requests, the
//!   unwritten ones go back to the queue;
//! - after its write: its reply slot is marked abandoned and the reply is dropped on arrival;
//! - during a read: the bytes read so far stay in the shared [`pipeline::ReplyReader`], whose
//!   next holder carries on (`AsyncReadExt::read` is cancel-safe).

use std::pin::Pin;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWrite};
use tokio::process::{ChildStdin, ChildStdout};

use super::round_trip::{ChildPipes, KindPipes};
use crate::walredo::pipeline::ProcessError;
use crate::walredo::pipeline::{self, ChildReply, Patience, Waiter};
use crate::walredo::write_queue::Batch;

type Stdin = pipeline::PipeWriter<ChildStdin>;
type Stdout = pipeline::PipeReader<ChildStdout>;

pub(crate) struct AsyncPipes {
    pipes: ChildPipes<ChildStdin, ChildStdout>,
}

impl AsyncPipes {
    pub(crate) fn new(stdin: ChildStdin, stdout: ChildStdout) -> AsyncPipes {
        AsyncPipes { pipes: ChildPipes::new(stdin, stdout) }
    }

    /// The child's progress clock.
    pub(crate) fn progress(&self) -> &pipeline::Progress {
        &self.pipes.shared.progress
    }

    /// Reads the first frame of the child (its hello), before any request is written.
    ///
    /// Not cancel-safe: dropped mid-frame, the reader loses its place; the caller (spawn)
    /// discards the child on any failure or drop.
    pub(crate) async fn read_first(&self, timeout: Duration) -> Result<ChildReply, ProcessError> {
        tokio::time::timeout(timeout, async { read_reply(&mut *self.pipes.stdout.lock().await).await })
            .await
            .unwrap_or(Err(ProcessError::Timeout(timeout)))
    }
}

/// The waits are awaits: nothing to choose per round trip. Cancellation: see the module doc.
impl KindPipes for AsyncPipes {
    type In = ChildStdin;
    type Out = ChildStdout;
    type Mode = ();

    fn mode(&self) {}

    fn pipes(&self) -> &ChildPipes<Self::In, Self::Out> {
        &self.pipes
    }

    async fn write_queued<F: FnOnce() + Send>(
        &self,
        writer: &mut Stdin,
        on_broken_write: Option<F>,
        (): (),
        patience: Patience,
    ) -> Result<(), ProcessError> {
        let mut batch = Batch::take(writer, &self.pipes.shared, &self.pipes.queue, on_broken_write);
        while !batch.finished() {
            let deadline = self.pipes.shared.write_deadline(batch.written(), patience);
            // Whether the pipe was full on the way: then the bytes it took are room the
            // child made, its progress.
            let mut waited = false;
            let write = std::future::poll_fn(|cx| {
                let poll = batch.write_with(|pipe, slices| Pin::new(pipe).poll_write_vectored(cx, slices));
                waited |= poll.is_pending();
                poll
            });
            match crate::util::timeout_if_pending(|| deadline.into(), write).await {
                Some(Ok(0)) => batch.fail(&io_error("walredo stdin accepts no bytes")),
                Some(Ok(n)) => {
                    batch.advance(n);
                    if waited {
                        self.pipes.shared.progress.mark();
                    }
                }
                Some(Err(e)) => {
                    batch.fail(&ProcessError::Io(anyhow::Error::new(e).context("write to walredo stdin")));
                }
                None => {
                    if let Some(e) = self.pipes.shared.write_expired(
                        batch.seq(),
                        batch.written(),
                        Instant::now(),
                        patience,
                    ) {
                        batch.fail(&e);
                    }
                    // Else the child made progress meanwhile: wait on.
                }
            }
        }
        Ok(())
    }

    async fn read_own(
        &self,
        stdout: &mut Stdout,
        waiter: &Waiter<'_>,
        (): (),
    ) -> Result<ChildReply, ProcessError> {
        loop {
            let at_head = match waiter.take() {
                Ok(reply) => return Ok(reply),
                Err(at_head) => at_head,
            };
            match tokio::time::timeout_at(waiter.read_deadline(at_head).into(), read_reply(stdout)).await {
                Ok(Ok(reply)) => self.pipes.shared.park(reply),
                Ok(Err(e)) => return Err(e),
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

async fn read_reply(stdout: &mut Stdout) -> Result<ChildReply, ProcessError> {
    loop {
        if let Some(reply) = stdout.replies.take()? {
            return Ok(reply);
        }
        let n = stdout
            .pipe
            .read_buf(&mut stdout.replies.spare())
            .await
            .context("read walredo stdout")
            .map_err(ProcessError::Io)?;
        if n == 0 {
            return Err(ProcessError::Io(anyhow::anyhow!("walredo stdout closed (EOF)")));
        }
    }
}
