//! The `async` process kind: tokio's `ChildStdin`/`ChildStdout`, tokio mutexes.
//!
//! A round trip yields while it waits for the pipes, so the executor thread runs other tasks
//! meanwhile; one timeout covers the whole round trip.
//!
//! Cancellation: the mutexes are tokio's because their guards are held across the awaits of a
//! write or a read. A future dropped
//! - before its write: nothing happened;
//! - during its write: the child has part of a frame and the stream cannot be repaired, so the
//!   process is retired ([`super::ProcessError::CancelledWrite`] for the others);
//! - after its write: its reply slot is marked abandoned and the reply is dropped on arrival;
//! - during a read: the bytes read so far stay in the shared [`pipeline::ReplyReader`], whose next holder
//!   carries on (`AsyncReadExt::read` is cancel-safe).

use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{ChildStdin, ChildStdout};

use super::ProcessError;
use crate::walredo::lock;
use crate::walredo::pipeline::{self, Claim, Replies, Reply};

type Writer = pipeline::Writer<ChildStdin>;
type Reader = pipeline::Reader<ChildStdout>;

pub(crate) struct AsyncPipes {
    stdin: tokio::sync::Mutex<Writer>,
    stdout: tokio::sync::Mutex<Reader>,
    /// A std mutex: held only for a few instructions, never across an await, and taken in
    /// `Drop` (abandoning a slot), where an async lock is not possible.
    replies: Mutex<Replies>,
}

impl AsyncPipes {
    pub(crate) fn new(stdin: ChildStdin, stdout: ChildStdout) -> AsyncPipes {
        AsyncPipes {
            stdin: tokio::sync::Mutex::new(Writer::new(stdin)),
            stdout: tokio::sync::Mutex::new(Reader::new(stdout)),
            replies: Mutex::new(Replies::default()),
        }
    }

    /// Reads the first frame of the child (its hello), before any request is written.
    pub(crate) async fn read_first(&self, timeout: Duration) -> Result<Reply, ProcessError> {
        tokio::time::timeout(timeout, async { read_reply(&mut *self.stdout.lock().await).await })
            .await
            .unwrap_or(Err(ProcessError::Timeout(timeout)))
    }

    /// See [`super::Process::round_trip`]; `on_broken_write` runs if the future is dropped
    /// halfway through writing the request.
    pub(crate) async fn round_trip(
        &self,
        request: &[u8],
        timeout: Duration,
        on_broken_write: impl FnOnce(),
    ) -> Result<Reply, ProcessError> {
        let round_trip = async {
            let seq = {
                let mut writer = self.stdin.lock().await;
                let broken = BrokenWriteGuard(Some(on_broken_write));
                let written = writer.pipe.write_all(request).await;
                broken.disarm();
                written.context("write to walredo stdin").map_err(ProcessError::Io)?;
                writer.written()
            };
            let mut claim = Claim::new(&self.replies, seq);
            let reply = self.read_until(seq).await;
            if reply.is_ok() {
                claim.done();
            }
            reply
        };
        tokio::time::timeout(timeout, round_trip).await.unwrap_or(Err(ProcessError::Timeout(timeout)))
    }

    async fn read_until(&self, seq: u64) -> Result<Reply, ProcessError> {
        if let Some(reply) = lock(&self.replies).take(seq) {
            return Ok(reply);
        }
        let mut stdout = self.stdout.lock().await;
        loop {
            // Whoever held the lock before us may have read our reply already.
            if let Some(reply) = lock(&self.replies).take(seq) {
                return Ok(reply);
            }
            let reply = read_reply(&mut stdout).await?;
            lock(&self.replies).push(reply);
        }
    }
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

/// Runs its callback if dropped before [`BrokenWriteGuard::disarm`]: the write was cut short.
struct BrokenWriteGuard<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> BrokenWriteGuard<F> {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl<F: FnOnce()> Drop for BrokenWriteGuard<F> {
    fn drop(&mut self) {
        if let Some(on_broken) = self.0.take() {
            on_broken();
        }
    }
}
