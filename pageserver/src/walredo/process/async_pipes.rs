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
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWrite};
use tokio::process::{ChildStdin, ChildStdout};

use crate::walredo::pipeline::ProcessError;
use crate::walredo::pipeline::{self, Claim, Patience, Reply, Shared, Turn, Waiter};
use crate::walredo::priority::WriteTicket;
use crate::walredo::request::Request;
use crate::walredo::write_queue::{Batch, WriteQueue, WriteTurn};

type Writer = pipeline::Writer<ChildStdin>;
type Reader = pipeline::Reader<ChildStdout>;

pub(crate) struct AsyncPipes {
    stdin: tokio::sync::Mutex<Writer>,
    /// Requests waiting to be written, by whichever of them holds `stdin`.
    queue: WriteQueue,
    stdout: tokio::sync::Mutex<Reader>,
    shared: Shared,
}

impl AsyncPipes {
    pub(crate) fn new(stdin: ChildStdin, stdout: ChildStdout) -> AsyncPipes {
        AsyncPipes {
            stdin: tokio::sync::Mutex::new(Writer::new(stdin)),
            queue: WriteQueue::default(),
            stdout: tokio::sync::Mutex::new(Reader::new(stdout)),
            shared: Shared::new(),
        }
    }

    /// The child's progress clock.
    pub(crate) fn progress(&self) -> &pipeline::Progress {
        &self.shared.progress
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
        request: &Arc<Request>,
        ticket: WriteTicket<'_>,
        patience: Patience,
        on_broken_write: impl FnOnce(),
    ) -> Result<Reply, ProcessError> {
        let queue_deadline = Instant::now() + patience.timeout;
        let mut on_broken_write = Some(on_broken_write);
        let mut queued = self.queue.push(&self.shared, request);
        let seq = loop {
            let mut writer = match queued.turn(&self.stdin, queue_deadline, patience).await? {
                WriteTurn::Written(seq) => break seq,
                WriteTurn::Writer(writer) => writer,
            };
            // Everything queued, this request among it.
            let mut batch = Batch::take(&mut writer, &self.shared, &self.queue, on_broken_write.take());
            while !batch.finished() {
                let deadline = self.shared.write_deadline(batch.written(), patience);
                // Whether the pipe was full on the way: then the bytes it took are room the
                // child made, its progress.
                let mut waited = false;
                let write = std::future::poll_fn(|cx| {
                    let poll =
                        batch.write_with(|pipe, slices| Pin::new(pipe).poll_write_vectored(cx, slices));
                    waited |= poll.is_pending();
                    poll
                });
                match crate::util::timeout_if_pending(|| deadline.into(), write).await {
                    Some(Ok(0)) => batch.fail(&io_error("walredo stdin accepts no bytes")),
                    Some(Ok(n)) => {
                        batch.advance(n);
                        if waited {
                            self.shared.progress.mark();
                        }
                    }
                    Some(Err(e)) => {
                        batch
                            .fail(&ProcessError::Io(anyhow::Error::new(e).context("write to walredo stdin")));
                    }
                    None => {
                        if let Some(e) =
                            self.shared.write_expired(batch.seq(), batch.written(), Instant::now(), patience)
                        {
                            batch.fail(&e);
                        }
                        // Else the child made progress meanwhile: wait on.
                    }
                }
            }
        };
        // The request is written: its place in the foreground writer queue goes.
        drop(ticket);
        let waiter = Waiter { shared: &self.shared, seq, queue_deadline, patience };
        // Dropped with the future while the reply is awaited, the claim abandons the slot.
        Claim::new(&self.shared.replies, seq).settle(self.read_until(&waiter).await)
    }

    async fn read_until(&self, waiter: &Waiter<'_>) -> Result<Reply, ProcessError> {
        let mut stdout = match waiter.turn(&self.stdout).await? {
            Turn::Reply(reply) => return Ok(reply),
            Turn::Reader(stdout) => stdout,
        };
        let result = loop {
            let at_head = match waiter.take() {
                Ok(reply) => break Ok(reply),
                Err(at_head) => at_head,
            };
            match tokio::time::timeout_at(waiter.read_deadline(at_head).into(), read_reply(&mut stdout)).await
            {
                Ok(Ok(reply)) => self.shared.park(reply),
                Ok(Err(e)) => break Err(e),
                Err(_) => {
                    if let Some(e) = waiter.expired() {
                        break Err(e);
                    }
                }
            }
        };
        self.shared.park_read(&mut stdout.replies);
        result
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
            .read_buf(&mut stdout.replies.spare())
            .await
            .context("read walredo stdout")
            .map_err(ProcessError::Io)?;
        if n == 0 {
            return Err(ProcessError::Io(anyhow::anyhow!("walredo stdout closed (EOF)")));
        }
    }
}
