//! Pipelining bookkeeping shared by both process kinds: reply assembly and reply matching.
//!
//! Many requests are in flight on one child. Each request is written whole under the stdin lock
//! (by itself or, queued behind it, by the request that holds the lock: `write_queue.rs`) and
//! takes a sequence number there; the child answers strictly in order, so the `n`-th reply
//! read belongs to sequence number `n`. Whoever holds the stdout lock reads replies until its own
//! has arrived, parking the others' replies in [`Replies`] for their owners to take.
//!
//! Time and failure: [`Progress`] records when the child last showed progress (sent a reply,
//! or made room in a full pipe) or became busy (took work while it had none), so that a
//! request is timed against the child's progress, not against its place in the queue. Bytes
//! the pipe takes while the child has older requests are not progress: a stopped child's pipe
//! takes a megabyte. With work waiting and no progress for [`Patience::stall`], the child is
//! *stalled*: requests behind the oldest one leave it for another child
//! ([`ProcessError::Stalled`]); for [`Patience::timeout`], it is *hung*: the oldest request
//! fails with [`ProcessError::Timeout`] and the child is killed. A write that ends partway
//! through a frame marks the stream broken ([`PipeWriter::broken`]) at once.
//!
//! Invariants:
//! - no byte follows a partial frame: a writer that finds [`PipeWriter::broken`] writes nothing;
//! - a reply is handed only to the request with its sequence number: a request that gave up
//!   after its write (cancelled, timed out) marks its slot abandoned and its reply is dropped
//!   when it arrives, so it can never be taken by the next request (the gap Neon left open);
//! - [`ReplyReader`] reads pages straight into the allocation the returned `Bytes` point into
//!   (no copy): one read takes every reply the pipe holds, up to what is left of a chunk of
//!   [`READ_CHUNK_REPLIES`] page replies, and each page is a slice of that chunk; only the
//!   unfinished reply at a chunk's end is copied, into the next chunk;
//! - the holder of the stdout lock parks every complete reply it has read before it gives the
//!   lock up ([`Shared::park_read`]), so no reply waits in the reader for the next holder;
//! - nothing here trusts the child: every header is checked, a bad one is a [`FrameError`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::task::Waker;
use std::time::{Duration, Instant};

use bytes::buf::Limit;
use bytes::{BufMut, Bytes, BytesMut};
use page_types::PAGE_SIZE;
use walredo_proc::protocol::{self, ErrorCode, FrameError, Hello, ReplyKind, HEADER_LEN};

use super::metrics::StopCause;
use crate::util::lock;

/// How a round trip failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProcessError {
    /// The child made no progress for this long while work waited on it: it is hung.
    #[error("no progress of the walredo process within {0:?}")]
    Timeout(Duration),
    /// The request waited this long behind other requests of a child that is working; the
    /// child is not blamed.
    #[error("waited {0:?} behind other requests for the walredo process")]
    QueueTimeout(Duration),
    /// The child made no progress for the stall window while this request waited behind its
    /// oldest one: the request leaves it for another child (it was not the one the child was
    /// working on, and redo is a pure function). `hung`: for the whole timeout, and the child
    /// is to be killed (it holds part of this request's frame, or is simply hung).
    #[error("the walredo process made no progress while this request waited behind others")]
    Stalled { hung: bool },
    #[error("{0:#}")]
    Io(anyhow::Error),
    #[error("protocol violation by the child: {0}")]
    Protocol(#[from] FrameError),
}

impl ProcessError {
    pub(crate) fn stop_cause(&self) -> StopCause {
        match self {
            ProcessError::Timeout(_)
            | ProcessError::QueueTimeout(_)
            | ProcessError::Stalled { hung: true } => StopCause::Timeout,
            ProcessError::Stalled { hung: false } => StopCause::Stalled,
            ProcessError::Io(_) => StopCause::Crashed,
            ProcessError::Protocol(_) => StopCause::ProtocolViolation,
        }
    }
}

/// A decoded reply of the child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ChildReply {
    Hello(Hello),
    Page(Bytes),
    Error(ErrorCode, String),
}

/// Assembles replies from the bytes read off the child's stdout.
///
/// Usage: read into [`ReplyReader::spare`] (a `BufMut`: the pipe's read fills it and advances
/// it), then call [`ReplyReader::take`] until it returns `None`.
pub(crate) struct ReplyReader {
    /// Bytes read but not yet taken, at the front of what is left of the current chunk; the
    /// bytes past its length are not initialized (the next read writes them).
    buf: BytesMut,
}

const LARGEST_REPLY: usize = HEADER_LEN + PAGE_SIZE;

/// Page replies one chunk of the reader holds. A child under load runs ahead of the daemon's
/// reader (at 64 x 8 on 2 vCPUs a read found 30-40 replies already in the pipe on average), so
/// one read takes as many as the chunk has room for instead of one read per reply. 15 replies
/// fit the allocator's 128 KiB size class. The chunk lives until the last page sliced from it
/// is dropped: pages handed to a socket go within microseconds, and the page cache keeps a
/// copy of its own ([`crate::page_cache::PageCache::insert`]).
pub(crate) const READ_CHUNK_REPLIES: usize = 15;

impl ReplyReader {
    pub(crate) fn new() -> ReplyReader {
        ReplyReader { buf: BytesMut::new() }
    }

    /// Where the next read goes: the rest of the current chunk, or a new chunk if the rest
    /// cannot hold the reply being read (a page, until its header says otherwise), with that
    /// reply's bytes read so far moved over. Not zeroed first: the read writes the bytes it
    /// reports and no others count.
    pub(crate) fn spare(&mut self) -> Limit<&mut BytesMut> {
        let end = match self.header() {
            Some(Ok(kind)) => HEADER_LEN + kind.payload_len(),
            _ => LARGEST_REPLY,
        };
        let need = end.saturating_sub(self.buf.len()).max(1);
        if self.buf.capacity() - self.buf.len() < need {
            let mut chunk = BytesMut::with_capacity(READ_CHUNK_REPLIES * LARGEST_REPLY);
            chunk.extend_from_slice(&self.buf);
            self.buf = chunk;
        }
        let room = self.buf.capacity() - self.buf.len();
        (&mut self.buf).limit(room)
    }

    /// Whether some bytes of an unfinished reply have been read.
    #[cfg(test)]
    pub(crate) fn has_partial(&self) -> bool {
        !self.buf.is_empty()
    }

    fn header(&self) -> Option<Result<ReplyKind, FrameError>> {
        let header: &[u8; HEADER_LEN] = self.buf.get(..HEADER_LEN)?.try_into().ok()?;
        Some(protocol::decode_reply_header(header))
    }

    /// Takes the next complete reply, if all of it has been read.
    pub(crate) fn take(&mut self) -> Result<Option<ChildReply>, FrameError> {
        let Some(kind) = self.header().transpose()? else {
            return Ok(None);
        };
        let total = HEADER_LEN + kind.payload_len();
        if self.buf.len() < total {
            return Ok(None);
        }
        // The reply's bytes leave the chunk without a copy; the rest of the chunk stays.
        let payload = self.buf.split_to(total).freeze().slice(HEADER_LEN..);
        Ok(Some(match kind {
            ReplyKind::Page => ChildReply::Page(payload),
            ReplyKind::Hello => ChildReply::Hello(Hello::decode(&payload)?),
            ReplyKind::Error { .. } => {
                let (code, message) = protocol::decode_error_payload(&payload);
                ChildReply::Error(code, message)
            }
        }))
    }
}

/// The write side of a child's pipes, kept under the stdin lock by both process kinds.
pub(crate) struct PipeWriter<W> {
    pub(crate) pipe: W,
    /// Sequence number of the next request written.
    next_seq: u64,
    /// A write was cut short (cancelled, timed out, failed) after some of its bytes: the child
    /// holds part of a frame, so no byte may follow. Set under the stdin lock, at once, before
    /// the next writer can take it (the kill that follows takes a moment to land).
    pub(crate) broken: bool,
}

impl<W> PipeWriter<W> {
    pub(crate) fn new(pipe: W) -> PipeWriter<W> {
        PipeWriter { pipe, next_seq: 0, broken: false }
    }

    /// Sequence number the request being written will take.
    pub(crate) fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Takes the sequence number of the request just written whole.
    pub(crate) fn written(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq - 1
    }
}

/// How long requests wait on a child that makes no progress (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Patience {
    /// `wal_redo_timeout`: no progress this long while work waits, and the child is hung (the
    /// oldest request on it fails with [`ProcessError::Timeout`], and it is killed); also the
    /// longest a request waits behind others of a child that works ([`ProcessError::QueueTimeout`]).
    pub(crate) timeout: Duration,
    /// No progress this long while work waits, and the child is stalled: the requests behind
    /// its oldest one leave it ([`ProcessError::Stalled`]), and new ones go elsewhere. At most
    /// `timeout`.
    pub(crate) stall: Duration,
}

impl Patience {
    /// Longest stall window: a child that sends nothing for a second while requests wait has
    /// stopped (a redo takes microseconds to milliseconds, the largest allowed one well under
    /// a second); waiting longer only stalls its tenant.
    pub(crate) const MAX_STALL: Duration = Duration::from_secs(1);

    /// The patience of `timeout`, stalled after a quarter of it or [`Patience::MAX_STALL`].
    pub(crate) fn of_timeout(timeout: Duration) -> Patience {
        Patience { timeout, stall: (timeout / 4).min(Patience::MAX_STALL) }
    }
}

/// When the child last made progress (sent a reply, or took bytes into a pipe it had filled)
/// or became busy (took work while it had none). A child is stalled, or hung, when work waits
/// on it and it makes no progress for the [`Patience`] windows; time spent queueing behind
/// other requests of a working child is not held against it.
pub(crate) struct Progress {
    base: Instant,
    /// Microseconds since `base` at the last progress.
    last_us: AtomicU64,
}

impl Progress {
    pub(crate) fn new() -> Progress {
        Progress { base: Instant::now(), last_us: AtomicU64::new(0) }
    }

    pub(crate) fn mark(&self) {
        let us = u64::try_from(self.base.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.last_us.fetch_max(us, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.base + Duration::from_micros(self.last_us.load(Ordering::Relaxed))
    }

    /// When the child counts as hung, if work waits on it and nothing changes meanwhile.
    pub(crate) fn hung_at(&self, patience: Patience) -> Instant {
        self.last() + patience.timeout
    }

    /// When the child counts as stalled, if work waits on it and nothing changes meanwhile.
    pub(crate) fn stalled_at(&self, patience: Patience) -> Instant {
        self.last() + patience.stall
    }
}

/// The shared state both kinds keep next to their pipes: parked replies, the wake-up of their
/// owners, and the child's progress.
pub(crate) struct Shared {
    /// A std mutex: held only for a few instructions, never across an await, and taken in
    /// `Drop` (abandoning a slot), where an async lock is not possible.
    /// Each waiting request's waker is in it, so a parked reply wakes its owner alone, without
    /// the owner waiting for the stdout lock to find it.
    pub(crate) replies: Mutex<Replies>,
    pub(crate) progress: Progress,
}

/// What a request waiting for its reply gets: the reply (read by another request), or the
/// stdout lock, to read it itself.
pub(crate) enum Turn<G> {
    Reply(ChildReply),
    Reader(G),
}

/// One written request waiting for its reply, with its deadlines.
pub(crate) struct Waiter<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) seq: u64,
    /// Behind other requests, the request gives up at this instant ([`ProcessError::QueueTimeout`]).
    pub(crate) queue_deadline: Instant,
    pub(crate) patience: Patience,
}

impl Shared {
    pub(crate) fn new() -> Shared {
        Shared { replies: Mutex::new(Replies::default()), progress: Progress::new() }
    }

    /// Files a reply read off the pipe and wakes the request it belongs to.
    pub(crate) fn park(&self, reply: ChildReply) {
        self.progress.mark();
        lock(&self.replies).push(reply);
    }

    /// Parks every complete reply `reader` holds, for the holder of the stdout lock to call
    /// before it gives the lock up. A bad header stays where it is, for the next reader's
    /// [`ReplyReader::take`] to report (this holder already has its own reply).
    pub(crate) fn park_read(&self, reader: &mut ReplyReader) {
        while let Ok(Some(reply)) = reader.take() {
            self.park(reply);
        }
    }

    /// For a request that is not the oldest on the child (queued to write, or written behind
    /// others), at `now`: whether it must leave the child, which is stalled
    /// ([`ProcessError::Stalled`]), or give up, having waited past `queue_deadline` behind a
    /// child that works ([`ProcessError::QueueTimeout`]); `None`: it waits on.
    pub(crate) fn behind_expired(
        &self,
        now: Instant,
        queue_deadline: Instant,
        patience: Patience,
    ) -> Option<ProcessError> {
        if now >= self.progress.stalled_at(patience) {
            return Some(ProcessError::Stalled { hung: now >= self.progress.hung_at(patience) });
        }
        (now >= queue_deadline).then_some(ProcessError::QueueTimeout(patience.timeout))
    }

    /// For the request `seq` being written, with `written` bytes of it in the pipe, after a
    /// wait for room ended at `now`: whether it fails (`Some`) or waits on. Hung, the child
    /// is killed either way: the oldest request on it fails with [`ProcessError::Timeout`],
    /// one behind others leaves it ([`ProcessError::Stalled`]). Stalled, a request with
    /// nothing written yet leaves it; one with a part written cannot (the child holds part
    /// of its frame) and waits until the child is hung.
    pub(crate) fn write_expired(
        &self,
        seq: u64,
        written: usize,
        now: Instant,
        patience: Patience,
    ) -> Option<ProcessError> {
        if now >= self.progress.hung_at(patience) {
            let oldest = lock(&self.replies).next_to_read() >= seq;
            return Some(if oldest {
                ProcessError::Timeout(patience.timeout)
            } else {
                ProcessError::Stalled { hung: true }
            });
        }
        (written == 0 && now >= self.progress.stalled_at(patience))
            .then_some(ProcessError::Stalled { hung: false })
    }

    /// Until when a writer may wait for room in the pipe before it looks again (see
    /// [`Shared::write_expired`]).
    pub(crate) fn write_deadline(&self, written: usize, patience: Patience) -> Instant {
        if written == 0 {
            self.progress.stalled_at(patience)
        } else {
            self.progress.hung_at(patience)
        }
    }
}

impl Waiter<'_> {
    /// The reply if it is parked, else whether this request's reply is the next to be read.
    pub(crate) fn take(&self) -> Result<ChildReply, bool> {
        let mut replies = lock(&self.shared.replies);
        match replies.take(self.seq) {
            Some(reply) => Ok(reply),
            None => Err(replies.next_to_read() == self.seq),
        }
    }

    /// Whether requests written before this one still wait for their replies (the child has not
    /// got to this one). Looks only: a parked reply stays for [`Waiter::take`].
    fn behind(&self) -> bool {
        lock(&self.shared.replies).next_to_read() < self.seq
    }

    /// Waits for the reply to be parked or for the stdout lock, whichever comes first.
    ///
    /// At the head of the queue the wait is the child's time, which the lock holder bounds;
    /// behind others, the queue's own bound and the child's stall apply. Cancel-safe: it only
    /// waits.
    pub(crate) async fn turn<'m, T>(
        &self,
        stdout: &'m tokio::sync::Mutex<T>,
    ) -> Result<Turn<tokio::sync::MutexGuard<'m, T>>, ProcessError> {
        loop {
            let at_head = match self.take() {
                Ok(reply) => return Ok(Turn::Reply(reply)),
                Err(at_head) => at_head,
            };
            let queue = async {
                if at_head {
                    std::future::pending().await
                } else {
                    tokio::time::sleep_until(self.read_deadline(false).into()).await
                }
            };
            let parked = std::future::poll_fn(|cx| lock(&self.shared.replies).poll_take(self.seq, cx));
            tokio::select! {
                reply = parked => return Ok(Turn::Reply(reply)),
                guard = stdout.lock() => return Ok(Turn::Reader(guard)),
                // A reply parked meanwhile is taken at the top of the loop, never dropped here.
                () = queue => {
                    if self.behind() {
                        if let Some(e) = self.shared.behind_expired(Instant::now(), self.queue_deadline, self.patience) {
                            return Err(e);
                        }
                    }
                }
            }
        }
    }

    /// Until when the holder of the stdout lock may wait for the next reply.
    pub(crate) fn read_deadline(&self, at_head: bool) -> Instant {
        if at_head {
            self.shared.progress.hung_at(self.patience)
        } else {
            self.shared.progress.stalled_at(self.patience).min(self.queue_deadline)
        }
    }

    /// After a read deadline passed: the child is hung with this request the oldest on it
    /// ([`ProcessError::Timeout`]), or stalled with this request behind others
    /// ([`ProcessError::Stalled`]), or this request waited too long behind others
    /// ([`ProcessError::QueueTimeout`]), or none of these (the child made progress meanwhile)
    /// and the wait goes on (`None`).
    pub(crate) fn expired(&self) -> Option<ProcessError> {
        let now = Instant::now();
        if self.behind() {
            return self.shared.behind_expired(now, self.queue_deadline, self.patience);
        }
        (now >= self.shared.progress.hung_at(self.patience))
            .then_some(ProcessError::Timeout(self.patience.timeout))
    }
}

/// The read side of a child's pipes, kept under the stdout lock by both process kinds.
pub(crate) struct PipeReader<R> {
    pub(crate) pipe: R,
    pub(crate) replies: ReplyReader,
}

impl<R> PipeReader<R> {
    pub(crate) fn new(pipe: R) -> PipeReader<R> {
        PipeReader { pipe, replies: ReplyReader::new() }
    }
}

/// Replies read off the pipe but not yet taken by their requests, by sequence number.
#[derive(Default)]
pub(crate) struct Replies {
    /// Sequence number of `slots[0]`.
    first: u64,
    /// `None`: taken or abandoned; trailing `None`s are trimmed from the front.
    slots: VecDeque<Option<ChildReply>>,
    /// Requests that gave up before their reply was read.
    abandoned: BTreeSet<u64>,
    /// Requests waiting for their reply to be parked, woken one by one as their reply arrives.
    wakers: BTreeMap<u64, Waker>,
}

impl Replies {
    /// Sequence number of the next reply to be read.
    pub(crate) fn next_to_read(&self) -> u64 {
        self.first + self.slots.len() as u64
    }

    /// Files the next reply read off the pipe.
    pub(crate) fn push(&mut self, reply: ChildReply) {
        let seq = self.next_to_read();
        let keep = !self.abandoned.remove(&seq);
        self.slots.push_back(keep.then_some(reply));
        self.trim();
        if let Some(waker) = self.wakers.remove(&seq) {
            waker.wake();
        }
    }

    /// Takes the reply for `seq` if it has been read, else registers `cx` to be woken when it is.
    pub(crate) fn poll_take(
        &mut self,
        seq: u64,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<ChildReply> {
        match self.take(seq) {
            Some(reply) => std::task::Poll::Ready(reply),
            None => {
                self.wakers.insert(seq, cx.waker().clone());
                std::task::Poll::Pending
            }
        }
    }

    /// Takes the reply for `seq`, if it has been read.
    pub(crate) fn take(&mut self, seq: u64) -> Option<ChildReply> {
        self.wakers.remove(&seq);
        let index = usize::try_from(seq.checked_sub(self.first)?).ok()?;
        let reply = self.slots.get_mut(index)?.take();
        self.trim();
        reply
    }

    /// Gives up on `seq`: its reply is dropped, now or when it arrives.
    pub(crate) fn abandon(&mut self, seq: u64) {
        self.wakers.remove(&seq);
        if seq >= self.next_to_read() {
            self.abandoned.insert(seq);
        } else if let Some(slot) = seq
            .checked_sub(self.first)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.slots.get_mut(i))
        {
            *slot = None;
            self.trim();
        }
    }

    /// Replies held for requests.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }

    fn trim(&mut self) {
        while let Some(None) = self.slots.front() {
            self.slots.pop_front();
            self.first += 1;
        }
    }
}

/// A written request waiting for its reply; if dropped before [`Claim::done`], abandons its
/// slot, so that the reply is dropped when it arrives instead of reaching another request.
pub(crate) struct Claim<'a> {
    replies: &'a Mutex<Replies>,
    seq: u64,
    done: bool,
}

impl<'a> Claim<'a> {
    pub(crate) fn new(replies: &'a Mutex<Replies>, seq: u64) -> Claim<'a> {
        Claim { replies, seq, done: false }
    }

    /// The outcome of the wait for the reply: once it is taken (`Ok`) there is nothing to
    /// abandon; an error leaves the slot abandoned, so a late reply is dropped on arrival.
    pub(crate) fn settle(
        mut self,
        reply: Result<ChildReply, ProcessError>,
    ) -> Result<ChildReply, ProcessError> {
        self.done = reply.is_ok();
        reply
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.done {
            lock(self.replies).abandon(self.seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_reply(fill: u8) -> Vec<u8> {
        let mut out = Vec::new();
        protocol::encode_page_reply_header(&mut out);
        out.extend_from_slice(&[fill; PAGE_SIZE]);
        out
    }

    fn error_reply(message: &str) -> Vec<u8> {
        let mut out = Vec::new();
        protocol::encode_error_reply(&mut out, ErrorCode::ApplyFailed, message);
        out
    }

    /// Feeds `stream` to a reader in chunks of at most `chunk` bytes, collecting replies.
    fn feed(stream: &[u8], chunk: usize) -> Vec<ChildReply> {
        let mut reader = ReplyReader::new();
        let mut replies = Vec::new();
        let mut pos = 0;
        while pos < stream.len() {
            let mut spare = reader.spare();
            let n = spare.remaining_mut().min(chunk).min(stream.len() - pos);
            assert!(n > 0, "reader must always want more bytes before a reply is complete");
            spare.put_slice(&stream[pos..pos + n]);
            pos += n;
            while let Some(reply) = reader.take().unwrap() {
                replies.push(reply);
            }
        }
        assert!(!reader.has_partial());
        replies
    }

    #[test]
    fn reader_splits_mixed_replies_for_any_chunking() {
        let mut stream = page_reply(1);
        stream.extend(error_reply("bad"));
        stream.extend(error_reply("worse"));
        stream.extend(page_reply(2));
        for chunk in [1, 3, 5, 7, 100, 8197, 100_000] {
            let replies = feed(&stream, chunk);
            assert_eq!(replies.len(), 4, "chunk {chunk}");
            assert_eq!(replies[0], ChildReply::Page(Bytes::from(vec![1; PAGE_SIZE])));
            assert_eq!(replies[1], ChildReply::Error(ErrorCode::ApplyFailed, "bad".into()));
            assert_eq!(replies[2], ChildReply::Error(ErrorCode::ApplyFailed, "worse".into()));
            assert_eq!(replies[3], ChildReply::Page(Bytes::from(vec![2; PAGE_SIZE])));
        }
    }

    #[test]
    fn reader_reads_a_chunk_of_page_replies_in_one_read_without_copying() {
        let stream: Vec<u8> = (0..READ_CHUNK_REPLIES as u8).flat_map(page_reply).collect();
        let mut reader = ReplyReader::new();
        let mut spare = reader.spare();
        assert!(spare.remaining_mut() >= stream.len());
        let spare_ptr = spare.chunk_mut().as_mut_ptr().cast_const();
        spare.put_slice(&stream);
        for n in 0..READ_CHUNK_REPLIES {
            let Some(ChildReply::Page(page)) = reader.take().unwrap() else { panic!("expected a page") };
            assert_eq!(page, vec![n as u8; PAGE_SIZE]);
            // The page is the very buffer the read went into, past its header.
            assert_eq!(page.as_ptr(), spare_ptr.wrapping_add(n * LARGEST_REPLY + HEADER_LEN));
        }
        assert_eq!(reader.take().unwrap(), None);
    }

    #[test]
    fn a_reply_cut_at_the_end_of_a_chunk_is_finished_in_the_next() {
        let count = READ_CHUNK_REPLIES + 3;
        let stream: Vec<u8> = (0..count as u8).flat_map(page_reply).collect();
        // A short error reply first, so that the chunk ends partway through a page reply.
        let mut stream_with_error = error_reply("first");
        stream_with_error.extend(&stream);
        let mut reader = ReplyReader::new();
        let mut pos = 0;
        let mut pages = 0;
        while pos < stream_with_error.len() {
            let mut spare = reader.spare();
            let n = spare.remaining_mut().min(stream_with_error.len() - pos);
            spare.put_slice(&stream_with_error[pos..pos + n]);
            pos += n;
            while let Some(reply) = reader.take().unwrap() {
                if let ChildReply::Page(page) = reply {
                    assert_eq!(page, vec![pages as u8; PAGE_SIZE]);
                    pages += 1;
                }
            }
        }
        assert_eq!(pages, count);
        assert!(!reader.has_partial());
    }

    #[test]
    fn park_read_hands_every_complete_reply_to_its_request_and_leaves_a_bad_one() {
        let shared = Shared::new();
        let mut reader = ReplyReader::new();
        let mut stream: Vec<u8> = (0..3).flat_map(page_reply).collect();
        stream.extend_from_slice(b"p\0\0\0\x09");
        reader.spare().put_slice(&stream);
        shared.park_read(&mut reader);
        for seq in 0..3 {
            assert_eq!(
                lock(&shared.replies).take(seq),
                Some(ChildReply::Page(Bytes::from(vec![seq as u8; PAGE_SIZE])))
            );
        }
        assert!(reader.take().is_err(), "the bad header is left for the next reader to report");
    }

    #[test]
    fn reader_rejects_a_bad_header() {
        let mut reader = ReplyReader::new();
        reader.spare().put_slice(b"p\0\0\0\x09");
        assert!(reader.take().is_err());
    }

    #[test]
    fn replies_go_to_their_own_sequence_numbers() {
        let mut replies = Replies::default();
        replies.push(ChildReply::Error(ErrorCode::BadRequest, "0".into()));
        replies.push(ChildReply::Error(ErrorCode::BadRequest, "1".into()));
        assert_eq!(replies.take(1), Some(ChildReply::Error(ErrorCode::BadRequest, "1".into())));
        assert_eq!(replies.take(2), None);
        assert_eq!(replies.take(0), Some(ChildReply::Error(ErrorCode::BadRequest, "0".into())));
        assert_eq!(replies.held(), 0);
        assert_eq!(replies.next_to_read(), 2);
    }

    #[test]
    fn a_parked_reply_wakes_its_own_request_only() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let counts: Vec<_> =
            (0..3).map(|_| std::sync::Arc::new(Count(std::sync::atomic::AtomicUsize::new(0)))).collect();
        let mut replies = Replies::default();
        for (seq, count) in counts.iter().enumerate() {
            let waker = std::task::Waker::from(std::sync::Arc::clone(count));
            let mut cx = std::task::Context::from_waker(&waker);
            assert!(replies.poll_take(seq as u64, &mut cx).is_pending());
        }
        replies.push(ChildReply::Page(Bytes::from_static(b"for request 0")));
        let woken: Vec<usize> =
            counts.iter().map(|c| c.0.load(std::sync::atomic::Ordering::Relaxed)).collect();
        assert_eq!(woken, [1, 0, 0]);
        assert_eq!(replies.take(0), Some(ChildReply::Page(Bytes::from_static(b"for request 0"))));
    }

    #[test]
    fn stale_abandon_of_a_trimmed_slot_touches_no_other_reply() {
        let mut replies = Replies::default();
        replies.push(ChildReply::Page(Bytes::from_static(b"for request 0")));
        replies.push(ChildReply::Page(Bytes::from_static(b"for request 1")));
        assert_eq!(replies.take(0), Some(ChildReply::Page(Bytes::from_static(b"for request 0"))));
        replies.abandon(0); // late: its slot is gone already
        assert_eq!(replies.take(1), Some(ChildReply::Page(Bytes::from_static(b"for request 1"))));
    }

    #[test]
    fn abandoned_reply_is_dropped_not_handed_to_the_next_request() {
        let mut replies = Replies::default();
        replies.abandon(0); // gave up before its reply was read
        replies.push(ChildReply::Page(Bytes::from_static(b"for request 0")));
        replies.push(ChildReply::Page(Bytes::from_static(b"for request 1")));
        assert_eq!(replies.take(1), Some(ChildReply::Page(Bytes::from_static(b"for request 1"))));
        assert_eq!(replies.held(), 0);

        // Gave up after its reply was read: dropped at once.
        replies.push(ChildReply::Page(Bytes::from_static(b"for request 2")));
        replies.abandon(2);
        assert_eq!(replies.held(), 0);
        assert_eq!(replies.take(2), None);
    }
}
