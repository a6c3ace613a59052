//! The reply path of a connection: replies as frames of shared bytes, the queue that writes
//! them in request order and runs the requests not yet done ([`Replies`], with the policy of
//! [`super::reply_order`]; the connection's loop drives it), and the writers that put bytes on
//! the socket ([`SocketWriter`]).
//!
//! A reply is a list of `Bytes` chunks: a header encoded for it, and for a page the page's own
//! bytes, shared with the page cache or the redo reply (never copied into a send buffer). A
//! writer sends the chunks of a batch of replies as they are.
//!
//! A [`SocketWriter`] sends each batch one of two ways, as [`IoChoice`] says at that batch:
//! - one vectored `write` on the connection's own socket (tokio), resuming mid-chunk after a
//!   short write;
//! - through the io_uring ring of the executor thread it runs on ([`super::uring`]), which sends
//!   the batches of that thread's connections with one submit when the thread runs out of
//!   work; the connection does not wait for the send (the batch's slots are freed when it is
//!   sent, which is what holds the reader back from a client that does not read).
//!
//! Invariant: a reply's in-flight slot is freed only once its bytes are written, so a client
//! that does not read holds at most [`super::MAX_IN_FLIGHT`] replies of its own.

use std::future::Future;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use nix::sys::socket::Shutdown;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinHandle;

use super::chunks::consume;
use super::io_choice::IoChoice;
use super::proto::{self, ErrorCode, ServerMessage};
use super::reply_order::{self, ReplyOrder};
use super::uring::{Job, Link, Ring, Rings};
use super::{ConnectionSlot, PageServiceMetrics, MAX_REPLIES_PER_WRITE};

/// One reply frame, and whether the connection closes after it.
pub(super) struct OutgoingReply {
    body: Body,
    pub(super) close: bool,
}

/// A reply's bytes.
enum Body {
    /// A whole frame.
    Frame(Bytes),
    /// A page: its header is encoded when the reply is written, into the connection's header
    /// buffer ([`Replies`]), and the page's bytes follow as they are.
    Page { request_id: u64, lsn: u64, page: Bytes },
    /// Nothing.
    Nothing,
}

impl OutgoingReply {
    pub(super) fn message(message: &ServerMessage) -> OutgoingReply {
        let mut out = BytesMut::new();
        message.encode(&mut out);
        OutgoingReply { body: Body::Frame(out.freeze()), close: false }
    }

    pub(super) fn error(
        metrics: &PageServiceMetrics,
        request_id: u64,
        code: ErrorCode,
        message: String,
    ) -> OutgoingReply {
        metrics.errors.with_label_values(&[code.name()]).inc();
        let mut reply = OutgoingReply::message(&ServerMessage::Error { request_id, code, message });
        reply.close = code.closes_connection();
        reply
    }

    pub(super) fn page(request_id: u64, lsn: u64, page: Bytes) -> OutgoingReply {
        OutgoingReply { body: Body::Page { request_id, lsn, page }, close: false }
    }

    /// Nothing to send; the connection closes.
    pub(super) fn close() -> OutgoingReply {
        OutgoingReply { body: Body::Nothing, close: true }
    }
}

/// Page headers encoded into one buffer of this size at a time: the headers of a connection's
/// replies share an allocation (each header a slice of it), which is reused once they are sent.
const HEADER_BUFFER: usize = 64 * proto::PAGE_REPLY_HEADER_LEN;

/// A request that runs in the connection's own task: [`Replies`] polls it (it starts there),
/// alongside the connection's other requests.
pub(super) type InlineRequest = Pin<Box<dyn Future<Output = OutgoingReply> + Send>>;

/// A reply on its way.
pub(super) enum Pending {
    Ready(OutgoingReply),
    /// A request on a task of its own.
    Task(JoinHandle<OutgoingReply>),
    /// A request not yet started ([`InlineRequest`]).
    Inline(InlineRequest),
    /// A task or an inline request among the ones [`Replies`] runs, its reply not there yet.
    Running,
}

/// A queued reply, with the in-flight slot it holds until it is written (a request's; the
/// reply that ends a connection for a reason of its own, such as shutdown, holds none).
pub(super) struct Queued {
    pub(super) pending: Pending,
    pub(super) slot: Option<OwnedSemaphorePermit>,
}

impl reply_order::Queued for Queued {
    /// Its bytes are here: a running request's are once the writer took its outcome.
    fn is_done(&self) -> bool {
        matches!(self.pending, Pending::Ready(_))
    }

    fn closes(&self) -> bool {
        matches!(&self.pending, Pending::Ready(reply) if reply.close)
    }
}

/// A running request's outcome, with its number in the [`ReplyOrder`]: its reply, or why its
/// task gave none (it panicked or was cancelled).
type Outcome = (u64, Result<OutgoingReply, String>);

/// The requests of a connection not yet done, each yielding its outcome.
type Running = FuturesUnordered<Pin<Box<dyn Future<Output = Outcome> + Send>>>;

/// Puts reply bytes on a connection's socket (shared with the connection's reads): with a
/// vectored `write` of its own when tokio's epoll says the socket has room, or through an
/// io_uring ring ([`super::uring`]), as [`IoChoice`] says batch by batch.
pub(super) struct SocketWriter {
    socket: Arc<TcpStream>,
    /// The connection's slot of `max_connections`, held with the socket (by the ring too).
    connection_slot: Arc<ConnectionSlot>,
    choice: Arc<IoChoice>,
    write_timeout: Duration,
    /// The connection's side of the io_uring writer, from its first batch through the ring.
    uring: Option<UringWriter>,
    /// The last period the connection was counted in as writing ([`IoChoice::use_ring`]).
    counted: u64,
}

/// A connection's side of the io_uring writer.
struct UringWriter {
    link: Arc<Link>,
    /// The ring its last batch went to: the next goes there too while that one is unsent.
    ring: Option<Ring>,
    /// The last batch (with the FIN) is handed over or sent: nothing is left to end.
    closed: bool,
}

impl SocketWriter {
    pub(super) fn new(
        socket: Arc<TcpStream>,
        connection_slot: Arc<ConnectionSlot>,
        choice: Arc<IoChoice>,
        write_timeout: Duration,
    ) -> SocketWriter {
        SocketWriter { socket, connection_slot, choice, write_timeout, uring: None, counted: 0 }
    }

    /// Sends a batch: every chunk, then frees the replies' `slots` (the list is left empty;
    /// after an error the connection ends, and its slots with it); with `close`, FIN after it.
    /// Through the ring, it returns once the batch is handed over (the slots are freed when it
    /// is sent), with an error if the ring gave up on the connection. A connection leaves the
    /// ring only once the ring has sent all its batches, so bytes keep their order.
    async fn send(
        &mut self,
        chunks: &mut Vec<Bytes>,
        slots: &mut Vec<OwnedSemaphorePermit>,
        close: bool,
        metrics: &PageServiceMetrics,
    ) -> std::io::Result<()> {
        let want_ring = self.choice.use_ring(&mut self.counted);
        if want_ring && self.uring.is_none() && self.choice.rings().is_some() {
            let link = Link::new(
                Arc::clone(&self.socket),
                Some(Arc::clone(&self.connection_slot)),
                self.write_timeout,
            );
            self.uring = Some(UringWriter { link, ring: None, closed: false });
        }
        // Through a ring while chosen, and while one still has batches of ours.
        if let (Some(uring), Some(rings)) = (&mut self.uring, self.choice.rings()) {
            if want_ring || uring.link.sending() {
                if let Some(ring) = uring.ring(rings) {
                    return uring.send(&ring, std::mem::take(chunks), std::mem::take(slots), close);
                }
            }
        }
        write_all_vectored(&self.socket, chunks, metrics).await?;
        slots.clear();
        if close {
            let _ = nix::sys::socket::shutdown(self.socket.as_raw_fd(), Shutdown::Write);
            if let Some(uring) = &mut self.uring {
                uring.closed = true;
            }
        }
        Ok(())
    }

    /// No more replies (the reader is done): FIN once everything is sent.
    pub(super) async fn finish(&mut self, metrics: &PageServiceMetrics) -> std::io::Result<()> {
        self.send(&mut Vec::new(), &mut Vec::new(), true, metrics).await
    }
}

impl UringWriter {
    /// The ring for the next batch: the one with this connection's unsent batches if there
    /// are any (so that the batches keep their order), else the current thread's; none if the
    /// writer is dead (and nothing of ours is in a ring).
    fn ring(&mut self, rings: &Rings) -> Option<Ring> {
        if self.link.sending() {
            if let Some(ring) = &self.ring {
                return Some(ring.clone());
            }
        }
        self.ring = rings.local();
        self.ring.clone()
    }

    fn send(
        &mut self,
        ring: &Ring,
        chunks: Vec<Bytes>,
        slots: Vec<OwnedSemaphorePermit>,
        close: bool,
    ) -> std::io::Result<()> {
        if let Some(why) = self.link.failure() {
            return Err(std::io::Error::other(why));
        }
        let job = Job { link: Arc::clone(&self.link), chunks, slots, close };
        match ring.submit(job) {
            Ok(()) => {
                self.closed = close;
                Ok(())
            }
            Err(_) => Err(std::io::Error::other("the io_uring writer stopped")),
        }
    }
}

impl Drop for UringWriter {
    /// A connection that ends without handing over its last batch (aborted at shutdown, or
    /// failed) shuts its socket down: the ring's operations on it end at once.
    fn drop(&mut self) {
        if !self.closed {
            self.link.shut_down(Shutdown::Both);
        }
    }
}

/// A connection's replies from queued to written: the order they leave in, the requests still
/// running (polled here, in the connection's own task, by whoever awaits
/// [`Replies::next_done`]), and what the next write is made of (its chunks, its replies' slots,
/// the buffer its page headers are encoded into), kept from write to write.
///
/// Replies leave in request order: the oldest goes first, whenever it is done, with those done
/// right behind it ([`ReplyOrder`]). A reply's in-flight slot is freed once it is written.
pub(super) struct Replies {
    // Holds at most MAX_IN_FLIGHT requests: every one holds a slot.
    order: ReplyOrder<Queued>,
    running: Running,
    chunks: Vec<Bytes>,
    slots: Vec<OwnedSemaphorePermit>,
    headers: BytesMut,
}

impl Replies {
    pub(super) fn new() -> Replies {
        Replies {
            order: ReplyOrder::new(),
            running: Running::new(),
            chunks: Vec::new(),
            slots: Vec::new(),
            headers: BytesMut::new(),
        }
    }

    /// Queues a reply; a request not yet done starts running (an inline one at the next poll
    /// of [`Replies::next_done`] or [`Replies::collect_done`]). Whether more may follow (not
    /// after a reply that closes the connection).
    pub(super) fn push(&mut self, mut queued: Queued) -> bool {
        if reply_order::Queued::is_done(&queued) {
            let closes = reply_order::Queued::closes(&queued);
            self.order.push(queued);
            return !closes;
        }
        let pending = std::mem::replace(&mut queued.pending, Pending::Running);
        let number = self.order.push(queued);
        match pending {
            Pending::Inline(request) => {
                self.running.push(Box::pin(async move { (number, Ok(request.await)) }))
            }
            Pending::Task(task) => self.running.push(Box::pin(async move {
                (number, task.await.map_err(|e| format!("request task failed: {e}")))
            })),
            Pending::Ready(_) | Pending::Running => {}
        }
        true
    }

    /// No reply is queued.
    pub(super) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// A request is still running.
    pub(super) fn running(&self) -> bool {
        !self.running.is_empty()
    }

    /// The oldest reply is done: the next write can go.
    pub(super) fn front_done(&self) -> bool {
        self.order.front().is_some_and(reply_order::Queued::is_done)
    }

    /// Runs the running requests without waiting, and takes the outcomes of those done.
    pub(super) fn collect_done(&mut self) -> anyhow::Result<()> {
        while let Some(Some(outcome)) = self.running.next().now_or_never() {
            done(&mut self.order, outcome)?;
        }
        Ok(())
    }

    /// Runs the running requests until one is done, and takes its outcome; never ready while
    /// none runs. Cancel-safe: an outcome is taken only when the call completes.
    pub(super) async fn next_done(&mut self) -> anyhow::Result<()> {
        match self.running.next().await {
            Some(outcome) => done(&mut self.order, outcome),
            None => std::future::pending().await,
        }
    }

    /// Writes the next batch (nothing if the oldest reply is not done); whether it closed the
    /// connection. Fails when the client accepts no bytes of it for `write_timeout`.
    pub(super) async fn write_next(
        &mut self,
        writer: &mut SocketWriter,
        metrics: &PageServiceMetrics,
        write_timeout: Duration,
    ) -> anyhow::Result<bool> {
        let (mut replies, mut close) = (0, false);
        for Queued { pending, slot } in self.order.next_batch(MAX_REPLIES_PER_WRITE) {
            let Pending::Ready(reply) = pending else {
                anyhow::bail!("a reply was taken for writing before it was ready");
            };
            match reply.body {
                Body::Frame(frame) => self.chunks.push(frame),
                Body::Page { request_id, lsn, page } => {
                    if self.headers.capacity() - self.headers.len() < proto::PAGE_REPLY_HEADER_LEN {
                        // Takes back the buffer if every header in it is gone, else a new one.
                        self.headers.reserve(HEADER_BUFFER);
                    }
                    proto::encode_page_header(&mut self.headers, request_id, lsn, page.len());
                    self.chunks.push(self.headers.split().freeze());
                    self.chunks.push(page);
                }
                Body::Nothing => {}
            }
            replies += 1;
            close |= reply.close;
            self.slots.extend(slot);
        }
        if replies == 0 {
            return Ok(false);
        }
        metrics.replies_per_write.observe(replies as f64);
        let send = writer.send(&mut self.chunks, &mut self.slots, close, metrics);
        match crate::util::timeout_if_pending(|| tokio::time::Instant::now() + write_timeout, send).await {
            Some(sent) => sent?,
            None => anyhow::bail!("the client accepted no reply for {write_timeout:?}"),
        }
        Ok(close)
    }
}

/// Takes a running request's outcome into its queued reply.
fn done(order: &mut ReplyOrder<Queued>, (number, reply): Outcome) -> anyhow::Result<()> {
    let reply = reply.map_err(anyhow::Error::msg)?;
    match order.get_mut(number) {
        Some(queued) => queued.pending = Pending::Ready(reply),
        None => anyhow::bail!("reply {number} finished but is not queued"),
    }
    Ok(())
}

/// Most chunks in one vectored `write`: a whole batch (a header and a page per reply).
const MAX_SLICES: usize = 2 * MAX_REPLIES_PER_WRITE;

/// Writes every chunk, resuming mid-chunk after a partial write.
async fn write_all_vectored(
    socket: &TcpStream,
    chunks: &mut Vec<Bytes>,
    metrics: &PageServiceMetrics,
) -> std::io::Result<()> {
    let mut start = 0;
    while start < chunks.len() {
        let written = {
            // On the stack: no allocation per write.
            let mut slices = [IoSlice::new(&[]); MAX_SLICES];
            let n = (chunks.len() - start).min(MAX_SLICES);
            for (slice, chunk) in slices.iter_mut().zip(&chunks[start..start + n]) {
                *slice = IoSlice::new(chunk);
            }
            socket.try_write_vectored(&slices[..n])
        };
        let written = match written {
            Ok(written) => written,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                socket.writable().await?;
                continue;
            }
            Err(e) => return Err(e),
        };
        metrics.epoll_io.send_syscalls.inc();
        metrics.epoll_io.sends.inc();
        metrics.epoll_io.sent_bytes.inc_by(written as u64);
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        consume(chunks, &mut start, written);
    }
    chunks.clear();
    Ok(())
}
