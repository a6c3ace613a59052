//! The reply path of a connection: replies as frames of shared bytes, the loop that writes them
//! in request order ([`write_replies`], with the policy of [`super::reply_order`]), and the
//! writers that put bytes on the socket ([`Writer`]).
//!
//! A reply is a list of `Bytes` chunks: a header encoded for it, and for a page the page's own
//! bytes, shared with the page cache or the redo reply (never copied into a send buffer). A
//! writer sends the chunks of a batch of replies as they are.
//!
//! Writers:
//! - [`Writer::Writev`]: one vectored `write` per batch on the connection's own socket (tokio),
//!   resuming mid-chunk after a short write;
//! - [`Writer::Uring`]: the batch goes to an io_uring writer thread ([`super::uring`]), which
//!   sends the batches of many connections with one submit; the connection waits for the
//!   outcome.
//!
//! Invariant: a reply's in-flight slot is freed only once its bytes are written, so a client
//! that does not read holds at most [`super::MAX_IN_FLIGHT`] replies of its own.

use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};
use tokio::task::JoinHandle;

use super::proto::{self, ErrorCode, ServerMessage};
use super::reply_order::{self, ReplyOrder};
use super::uring::{Job, Ring};
use super::{PageServiceMetrics, MAX_REPLIES_PER_WRITE};

/// The bytes of one reply frame, and whether the connection closes after it.
pub(super) struct Reply {
    pub(super) chunks: Vec<Bytes>,
    pub(super) close: bool,
}

impl Reply {
    pub(super) fn message(message: &ServerMessage) -> Reply {
        let mut out = BytesMut::new();
        message.encode(&mut out);
        Reply { chunks: vec![out.freeze()], close: false }
    }

    pub(super) fn error(
        metrics: &PageServiceMetrics,
        request_id: u64,
        code: ErrorCode,
        message: String,
    ) -> Reply {
        metrics.errors.with_label_values(&[code.name()]).inc();
        let mut reply = Reply::message(&ServerMessage::Error { request_id, code, message });
        reply.close = code.closes_connection();
        reply
    }

    pub(super) fn page(request_id: u64, lsn: u64, page: Bytes) -> Reply {
        let mut header = BytesMut::with_capacity(proto::PAGE_REPLY_HEADER_LEN);
        proto::encode_page_header(&mut header, request_id, lsn, page.len());
        Reply { chunks: vec![header.freeze(), page], close: false }
    }

    /// Nothing to send; the connection closes.
    pub(super) fn close() -> Reply {
        Reply { chunks: Vec::new(), close: true }
    }
}

/// A reply on its way to the writer.
pub(super) enum Pending {
    Ready(Reply),
    Task(JoinHandle<Reply>),
}

/// A reply in the writer's queue, with the in-flight slot it holds until it is written.
pub(super) struct Queued {
    pub(super) pending: Pending,
    pub(super) slot: OwnedSemaphorePermit,
}

impl reply_order::Queued for Queued {
    /// Its bytes are here. A finished task's are not until [`Queued::resolve`] took them: the
    /// writer resolves before it asks for a batch, and a task finishing in between waits for
    /// the next write.
    fn is_done(&self) -> bool {
        matches!(self.pending, Pending::Ready(_))
    }

    fn closes(&self) -> bool {
        matches!(&self.pending, Pending::Ready(reply) if reply.close)
    }
}

impl Queued {
    /// Waits for the reply if its task still runs (at once if it finished).
    async fn resolve(&mut self) -> anyhow::Result<()> {
        if let Pending::Task(task) = &mut self.pending {
            let reply = task.await.map_err(|e| anyhow::anyhow!("request task failed: {e}"))?;
            self.pending = Pending::Ready(reply);
        }
        Ok(())
    }
}

/// Puts reply bytes on a connection's socket (shared with the connection's reader).
pub(super) enum Writer {
    /// Vectored writes on the connection's own socket, when tokio's epoll says it has room.
    Writev(Arc<TcpStream>),
    /// Batches handed to an io_uring writer thread ([`super::uring`]); each batch carries the
    /// socket, so its descriptor stays open while the ring works on it.
    Uring { socket: Arc<TcpStream>, ring: Ring },
}

impl Writer {
    /// Writes every chunk of `replies` replies, resuming after a short write; `chunks` is
    /// empty after success.
    async fn write_all(
        &mut self,
        chunks: &mut Vec<Bytes>,
        replies: usize,
        metrics: &PageServiceMetrics,
    ) -> std::io::Result<()> {
        match self {
            Writer::Writev(socket) => write_all_vectored(socket, chunks, metrics).await,
            Writer::Uring { socket, ring } => {
                if chunks.is_empty() {
                    return Ok(());
                }
                let (done, outcome) = oneshot::channel();
                let job = Job { socket: Arc::clone(socket), chunks: std::mem::take(chunks), replies, done };
                if let Err(job) = ring.submit(job) {
                    // The ring's thread is gone (it logged why): this connection writes itself.
                    *chunks = job.chunks;
                    return write_all_vectored(socket, chunks, metrics).await;
                }
                // Given up before the ring answered (timeout, abort): the socket is shut down,
                // which ends the ring's operations on it at once.
                let give_up = ShutdownOnDrop(Some(Arc::clone(socket)));
                let result = outcome
                    .await
                    .unwrap_or_else(|_| Err(std::io::Error::other("the io_uring writer stopped")));
                give_up.defuse();
                result
            }
        }
    }

    /// Sends FIN after the last reply.
    fn shutdown(&self) {
        let (Writer::Writev(socket) | Writer::Uring { socket, .. }) = self;
        let _ = nix::sys::socket::shutdown(socket.as_raw_fd(), nix::sys::socket::Shutdown::Write);
    }
}

/// Shuts a socket down both ways when dropped, unless defused.
struct ShutdownOnDrop(Option<Arc<TcpStream>>);

impl ShutdownOnDrop {
    fn defuse(mut self) {
        self.0 = None;
    }
}

impl Drop for ShutdownOnDrop {
    fn drop(&mut self) {
        if let Some(socket) = self.0.take() {
            let _ = nix::sys::socket::shutdown(socket.as_raw_fd(), nix::sys::socket::Shutdown::Both);
        }
    }
}

/// Writes replies in request order, gathering those already done into one write; a reply's
/// in-flight slot is freed once it is written. Fails when the client accepts no bytes of a
/// write for `write_timeout`.
pub(super) async fn write_replies(
    mut writer: Writer,
    mut queue: mpsc::Receiver<Queued>,
    metrics: &PageServiceMetrics,
    write_timeout: Duration,
) -> anyhow::Result<()> {
    // Holds at most MAX_IN_FLIGHT: every entry holds a slot.
    let mut order: ReplyOrder<Queued> = ReplyOrder::new();
    let mut chunks: Vec<Bytes> = Vec::new();
    loop {
        if order.is_empty() {
            match queue.recv().await {
                Some(queued) => order.push(queued),
                None => break,
            }
        }
        while let Ok(queued) = queue.try_recv() {
            order.push(queued);
        }
        // The oldest reply goes first, whenever it is done; then whatever is done behind it.
        if let Some(front) = order.front_mut() {
            front.resolve().await?;
        }
        for queued in order.iter_mut().take(MAX_REPLIES_PER_WRITE) {
            match &queued.pending {
                Pending::Ready(_) => {}
                Pending::Task(task) if task.is_finished() => queued.resolve().await?,
                Pending::Task(_) => break,
            }
        }
        let batch = order.next_batch(MAX_REPLIES_PER_WRITE);
        let mut close = false;
        let mut slots = Vec::with_capacity(batch.len());
        for Queued { pending, slot } in batch {
            let Pending::Ready(reply) = pending else {
                anyhow::bail!("a reply was taken for writing before it was ready");
            };
            chunks.extend(reply.chunks);
            close |= reply.close;
            slots.push(slot);
        }
        metrics.replies_per_write.observe(slots.len() as f64);
        match tokio::time::timeout(write_timeout, writer.write_all(&mut chunks, slots.len(), metrics)).await {
            Ok(written) => written?,
            Err(_) => anyhow::bail!("the client accepted no reply for {write_timeout:?}"),
        }
        drop(slots);
        if close {
            break;
        }
    }
    writer.shutdown();
    Ok(())
}

/// Writes every chunk, resuming mid-chunk after a partial write.
async fn write_all_vectored(
    socket: &TcpStream,
    chunks: &mut Vec<Bytes>,
    metrics: &PageServiceMetrics,
) -> std::io::Result<()> {
    let mut start = 0;
    while start < chunks.len() {
        let slices: Vec<IoSlice<'_>> = chunks[start..].iter().map(|c| IoSlice::new(c)).collect();
        let mut written = match socket.try_write_vectored(&slices) {
            Ok(written) => written,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                drop(slices);
                socket.writable().await?;
                continue;
            }
            Err(e) => return Err(e),
        };
        metrics.send_syscalls.with_label_values(&["epoll"]).inc();
        metrics.sends.with_label_values(&["epoll"]).inc();
        metrics.sent_bytes.with_label_values(&["epoll"]).inc_by(written as u64);
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while written > 0 && start < chunks.len() {
            let chunk = &mut chunks[start];
            let n = written.min(chunk.len());
            chunk.advance(n);
            written -= n;
            if chunk.is_empty() {
                start += 1;
            }
        }
    }
    chunks.clear();
    Ok(())
}
