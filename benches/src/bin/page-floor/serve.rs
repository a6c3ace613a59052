//! The page service of `page-floor`: the acceptor, and the workers that own the connections.
//!
//! The acceptor blocks in `accept` and hands each connection to the next worker in turn: it
//! pushes the stream on the worker's [`Inbox`] and writes the worker's eventfd. A worker is one
//! thread with its own epoll, the eventfd and its connections in it; nothing it touches on the
//! request path is shared with another thread.
//!
//! Per connection, level-triggered, watching either for reading or (while a reply is not fully
//! written) for writing, never both:
//! - readable: one `read` of what is there into the connection's buffer (64 KiB, grown only to
//!   hold a longer frame whole), then every complete frame is decoded with
//!   `proto::frame_len_max` and `proto::decode_client` (one copy of the bytes read into a
//!   `Bytes` per read, sliced per frame) and answered into the connection's reply list: headers
//!   (`encode_page_header`, HelloOk, Error) encoded into one buffer, each page a slice of the
//!   one static [`PAGE`], never copied. Then one `writev` of the whole list;
//! - a short write (the socket buffer is full) keeps the rest and switches the connection to
//!   EPOLLOUT: the rest goes out, with as many `writev`s as the socket takes, before anything
//!   more is read from that connection (TCP backpressure, as the daemon applies it);
//! - level- rather than edge-triggered: with one read per event, a connection that still has
//!   bytes in its socket is simply reported again by the next `epoll_wait`, with no extra
//!   `read` to find `EAGAIN`, and no connection can starve the others of a worker.
//!
//! A list of more than `IOV_MAX` (1024) slices, which takes over 512 replies from one read, is
//! written by more than one `writev` of the same event.
//!
//! Errors (docs/page-service-protocol.md): a request before Hello or a second Hello is
//! `bad_frame`, a Hello of another version `unsupported_version`, an Ingest `invalid_request`
//! (the floor stores nothing), a frame too long `frame_too_large`, a frame that does not decode
//! `bad_frame`; each ends the connection: the replies before it and the Error are written, the
//! write half is shut down (FIN), and what the client still sends is read and discarded until
//! its EOF, so that a close with unread bytes does not reset the connection before the client
//! has read the Error. A read or write error, or the client's EOF, closes the connection at
//! once. Nothing a client sends can make a worker panic or touch another connection.
//!
//! Bounds: per connection, one frame (at most `MAX_FRAME_LEN`, 8 MiB; `MAX_HELLO_FRAME_LEN`
//! before Hello) and the replies to one read; connections are bounded by the descriptor limit
//! only (an `accept` that fails is logged and retried after 10 ms).

use std::io::{self, IoSlice, Read};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use bytes::{Bytes, BytesMut};
use nix::errno::Errno;
use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use page_types::PAGE_SIZE;
use pageserver::page_service::proto::{
    self, ClientMessage, ErrorCode, ServerMessage, LSN_LATEST, MAX_FRAME_LEN, MAX_HELLO_FRAME_LEN,
    MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};

/// The page of every reply.
static PAGE: [u8; PAGE_SIZE] = [0; PAGE_SIZE];
/// Read buffer of a connection (grown only for a longer frame).
const READ_BUF_LEN: usize = 64 * 1024;
/// Events taken per `epoll_wait`.
const EVENTS: usize = 256;
/// Most slices one `writev` takes (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;
/// The epoll token of a worker's eventfd; a connection's token is its slot number.
const WAKE: u64 = u64::MAX;
/// Pause after a failed `accept` (out of descriptors), so that the acceptor does not spin.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// Where the acceptor leaves a worker's new connections.
pub struct Inbox {
    wake: EventFd,
    queue: Mutex<Vec<TcpStream>>,
}

impl Inbox {
    pub fn new() -> anyhow::Result<Arc<Inbox>> {
        let wake = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .context("create a worker's eventfd")?;
        Ok(Arc::new(Inbox { wake, queue: Mutex::new(Vec::new()) }))
    }

    fn hand(&self, stream: TcpStream) -> anyhow::Result<()> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner).push(stream);
        self.wake.write(1).context("wake a worker")?;
        Ok(())
    }

    fn take(&self) -> Vec<TcpStream> {
        std::mem::take(&mut *self.queue.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Accepts connections for ever, handing them to the workers round-robin.
pub fn accept(listener: TcpListener, inboxes: Vec<Arc<Inbox>>) -> anyhow::Result<()> {
    anyhow::ensure!(!inboxes.is_empty(), "accept: no workers");
    let mut next = 0;
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                inboxes[next].hand(stream)?;
                next = (next + 1) % inboxes.len();
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted) => {}
            Err(e) => {
                eprintln!("page-floor: failed to accept a connection: {e}");
                std::thread::sleep(ACCEPT_RETRY);
            }
        }
    }
}

/// Serves the connections handed to `inbox` for ever; `lsn` is the LSN of "latest".
pub fn worker(inbox: Arc<Inbox>, lsn: u64) -> anyhow::Result<()> {
    let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).context("create an epoll instance")?;
    epoll.add(&inbox.wake, EpollEvent::new(EpollFlags::EPOLLIN, WAKE)).context("watch the eventfd")?;
    let mut conns = Slab::default();
    let mut events = vec![EpollEvent::empty(); EVENTS];
    loop {
        let n = match epoll.wait(&mut events, EpollTimeout::NONE) {
            Ok(n) => n,
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e).context("wait for events"),
        };
        let mut woken = false;
        for event in &events[..n] {
            if event.data() == WAKE {
                woken = true;
                continue;
            }
            let slot = event.data() as usize;
            let Some(conn) = conns.get_mut(slot) else { continue };
            let watching = conn.watching;
            match conn.on_event(lsn) {
                Next::Watch(interest) if interest == watching => {}
                Next::Watch(interest) => {
                    let mut event = EpollEvent::new(interest.flags(), slot as u64);
                    match epoll.modify(&conn.stream, &mut event) {
                        Ok(()) => conn.watching = interest,
                        Err(e) => {
                            eprintln!("page-floor: failed to change a connection's epoll interest: {e}");
                            drop(conns.remove(slot));
                        }
                    }
                }
                // Closing the descriptor takes it out of the epoll set.
                Next::Close => drop(conns.remove(slot)),
            }
        }
        // New connections only after the batch: a slot freed above is not reused by a
        // connection that would then get the old one's remaining events.
        if woken {
            adopt(&epoll, &inbox, &mut conns)?;
        }
    }
}

/// Registers the connections waiting in `inbox`.
fn adopt(epoll: &Epoll, inbox: &Inbox, conns: &mut Slab) -> anyhow::Result<()> {
    match inbox.wake.read() {
        Ok(_) | Err(Errno::EAGAIN) => {}
        Err(e) => return Err(e).context("read the eventfd"),
    }
    for stream in inbox.take() {
        if let Err(e) = stream.set_nonblocking(true) {
            eprintln!("page-floor: failed to make a connection non-blocking: {e}");
            continue;
        }
        // Replies leave in one writev already; Nagle would only hold back a short tail.
        let _ = stream.set_nodelay(true);
        let slot = conns.insert(Conn::new(stream));
        let Some(conn) = conns.get_mut(slot) else { continue };
        if let Err(e) = epoll.add(&conn.stream, EpollEvent::new(Interest::Read.flags(), slot as u64)) {
            eprintln!("page-floor: failed to watch a connection: {e}");
            drop(conns.remove(slot));
        }
    }
    Ok(())
}

/// A worker's connections by slot; a slot is reused once its connection is closed.
#[derive(Default)]
struct Slab {
    slots: Vec<Option<Conn>>,
    free: Vec<usize>,
}

impl Slab {
    fn insert(&mut self, conn: Conn) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some(conn);
                slot
            }
            None => {
                self.slots.push(Some(conn));
                self.slots.len() - 1
            }
        }
    }

    fn get_mut(&mut self, slot: usize) -> Option<&mut Conn> {
        self.slots.get_mut(slot).and_then(Option::as_mut)
    }

    fn remove(&mut self, slot: usize) -> Option<Conn> {
        let conn = self.slots.get_mut(slot).and_then(Option::take);
        if conn.is_some() {
            self.free.push(slot);
        }
        conn
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Interest {
    Read,
    Write,
}

impl Interest {
    fn flags(self) -> EpollFlags {
        match self {
            Interest::Read => EpollFlags::EPOLLIN,
            Interest::Write => EpollFlags::EPOLLOUT,
        }
    }
}

/// What a connection needs after an event.
enum Next {
    Watch(Interest),
    Close,
}

/// How far a flush got.
enum Flushed {
    All,
    /// The socket took part of it: the rest waits for EPOLLOUT.
    Partly,
    Failed,
}

/// One piece of the reply list.
enum Segment {
    /// Bytes of `Conn::heads`: page headers and whole small replies, adjacent ones merged.
    Head(Range<usize>),
    /// The static page.
    Page,
}

impl Segment {
    fn len(&self) -> usize {
        match self {
            Segment::Head(range) => range.len(),
            Segment::Page => PAGE_SIZE,
        }
    }
}

struct Conn {
    stream: TcpStream,
    watching: Interest,
    /// Bytes read and not yet decoded: `input[start..end]`.
    input: Vec<u8>,
    start: usize,
    end: usize,
    hello: bool,
    /// An Error that ends the connection is queued: once written, shut down and drain.
    closing: bool,
    /// Write half shut down: what comes in is read and dropped until EOF.
    draining: bool,
    /// Replies not yet written: `out[sent..]`, of which the first has `skip` bytes written.
    heads: BytesMut,
    out: Vec<Segment>,
    sent: usize,
    skip: usize,
}

impl Conn {
    fn new(stream: TcpStream) -> Conn {
        Conn {
            stream,
            watching: Interest::Read,
            input: vec![0; READ_BUF_LEN],
            start: 0,
            end: 0,
            hello: false,
            closing: false,
            draining: false,
            heads: BytesMut::with_capacity(4096),
            out: Vec::new(),
            sent: 0,
            skip: 0,
        }
    }

    fn on_event(&mut self, lsn: u64) -> Next {
        match self.watching {
            Interest::Read => self.on_readable(lsn),
            Interest::Write => {
                let flushed = self.flush();
                self.after_flush(flushed)
            }
        }
    }

    fn on_readable(&mut self, lsn: u64) -> Next {
        if self.draining {
            return match (&self.stream).read(&mut self.input) {
                Ok(0) => Next::Close,
                Ok(_) => Next::Watch(Interest::Read),
                Err(e) if retry_later(&e) => Next::Watch(Interest::Read),
                Err(_) => Next::Close,
            };
        }
        self.make_room();
        match (&self.stream).read(&mut self.input[self.end..]) {
            // EOF: nothing is owed (a connection is read only once its replies are written).
            Ok(0) => return Next::Close,
            Ok(n) => self.end += n,
            Err(e) if retry_later(&e) => return Next::Watch(Interest::Read),
            Err(_) => return Next::Close,
        }
        if !self.answer_frames(lsn) {
            self.closing = true;
        }
        let flushed = self.flush();
        self.after_flush(flushed)
    }

    /// Moves undecoded bytes to the front, and grows the buffer when a frame longer than it
    /// has begun (its length is checked against the limit before it is decoded).
    fn make_room(&mut self) {
        if self.start > 0 {
            self.input.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.input.len() {
            // Full of one frame that began and is longer than the buffer (a complete one would
            // have been answered): grow to hold it whole. Its length was checked against the
            // limit when it was found incomplete.
            let declared = self
                .input
                .get(..4)
                .map_or(0, |len| 4 + u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize);
            let grown = declared.min(4 + MAX_FRAME_LEN as usize).max(self.input.len() + 1);
            self.input.resize(grown, 0);
        }
    }

    /// Decodes and answers every complete frame read; false when the connection must close
    /// (its Error is queued; nothing after it is answered).
    fn answer_frames(&mut self, lsn: u64) -> bool {
        let limit = |hello: bool| if hello { MAX_FRAME_LEN } else { MAX_HELLO_FRAME_LEN };
        // A partial frame (say, a long Ingest arriving) is left in place, not copied again.
        match proto::frame_len_max(&self.input[self.start..self.end], limit(self.hello)) {
            Ok(None) => return true,
            Ok(Some(_)) => {}
            Err(e) => {
                self.push_error(0, e.code(), &e.to_string());
                return false;
            }
        }
        let chunk = Bytes::copy_from_slice(&self.input[self.start..self.end]);
        let mut at = 0;
        let keep = loop {
            let rest = chunk.get(at..).unwrap_or_default();
            match proto::frame_len_max(rest, limit(self.hello)) {
                Ok(None) => break true,
                Ok(Some(len)) => {
                    let message = proto::decode_client(chunk.slice(at..at + len));
                    at += len;
                    if !self.answer(message, lsn) {
                        break false;
                    }
                }
                Err(e) => {
                    self.push_error(0, e.code(), &e.to_string());
                    break false;
                }
            }
        };
        self.start += at;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        keep
    }

    /// Queues the reply to one message; false if it was an Error that closes the connection.
    fn answer(&mut self, message: Result<ClientMessage, proto::DecodeError>, lsn: u64) -> bool {
        let (code, request_id, message): (ErrorCode, u64, String) = match message {
            Err(e) => (e.code(), 0, e.to_string()),
            Ok(ClientMessage::Hello { .. }) if self.hello => {
                (ErrorCode::BadFrame, 0, "Hello may come only once".into())
            }
            Ok(ClientMessage::Hello { version, .. })
                if !(MIN_PROTOCOL_VERSION..=PROTOCOL_VERSION).contains(&version) =>
            {
                (
                    ErrorCode::UnsupportedVersion,
                    0,
                    format!("protocol version {version}, this server speaks {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION}"),
                )
            }
            Ok(ClientMessage::Hello { version, .. }) => {
                self.hello = true;
                let ok = ServerMessage::HelloOk { version, last_durable_lsn: lsn };
                self.push_head(|out| ok.encode(out));
                return true;
            }
            Ok(_) if !self.hello => (ErrorCode::BadFrame, 0, "the first message must be Hello".into()),
            Ok(ClientMessage::GetPage { request_id, lsn: asked, .. }) => {
                let served = if asked == LSN_LATEST { lsn } else { asked };
                self.push_head(|out| proto::encode_page_header(out, request_id, served, PAGE_SIZE));
                self.out.push(Segment::Page);
                return true;
            }
            Ok(
                ClientMessage::Ingest { request_id, .. }
                | ClientMessage::GetRelSize { request_id, .. }
                | ClientMessage::GetRelExists { request_id, .. },
            ) => (ErrorCode::InvalidRequest, request_id, "page-floor serves GetPage only".into()),
        };
        self.push_error(request_id, code, &message);
        false
    }

    fn push_error(&mut self, request_id: u64, code: ErrorCode, message: &str) {
        let error = ServerMessage::Error { request_id, code, message: message.to_string() };
        self.push_head(|out| error.encode(out));
    }

    /// Appends bytes to `heads` and their segment to the list (merged with the one before
    /// when adjacent: a HelloOk and the next page header make one slice).
    fn push_head(&mut self, encode: impl FnOnce(&mut BytesMut)) {
        let start = self.heads.len();
        encode(&mut self.heads);
        let end = self.heads.len();
        if let Some(Segment::Head(last)) = self.out.last_mut() {
            if last.end == start {
                last.end = end;
                return;
            }
        }
        self.out.push(Segment::Head(start..end));
    }

    /// Writes the reply list: one `writev` unless it has more than [`IOV_MAX`] slices or the
    /// socket takes only part of it.
    fn flush(&mut self) -> Flushed {
        while self.sent < self.out.len() {
            let pending = &self.out[self.sent..];
            let mut iov = Vec::with_capacity(pending.len().min(IOV_MAX));
            for (i, segment) in pending.iter().take(IOV_MAX).enumerate() {
                let bytes: &[u8] = match segment {
                    Segment::Head(range) => self.heads.get(range.clone()).unwrap_or_default(),
                    Segment::Page => &PAGE,
                };
                let skip = if i == 0 { self.skip } else { 0 };
                iov.push(IoSlice::new(bytes.get(skip..).unwrap_or_default()));
            }
            let wanted: usize = iov.iter().map(|slice| slice.len()).sum();
            let written = match nix::sys::uio::writev(&self.stream, &iov) {
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return Flushed::Partly,
                Err(_) => return Flushed::Failed,
            };
            self.advance(written);
            if written < wanted {
                return Flushed::Partly;
            }
        }
        self.out.clear();
        self.heads.clear();
        self.sent = 0;
        self.skip = 0;
        Flushed::All
    }

    /// Marks `n` more bytes of the list as written.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some(segment) = self.out.get(self.sent) else { return };
            let left = segment.len().saturating_sub(self.skip);
            if n < left {
                self.skip += n;
                return;
            }
            n -= left;
            self.sent += 1;
            self.skip = 0;
        }
    }

    fn after_flush(&mut self, flushed: Flushed) -> Next {
        match flushed {
            Flushed::Partly => Next::Watch(Interest::Write),
            Flushed::Failed => Next::Close,
            Flushed::All if self.closing && !self.draining => {
                // The Error is out: FIN after it, then read until the client's EOF.
                if self.stream.shutdown(Shutdown::Write).is_err() {
                    return Next::Close;
                }
                self.draining = true;
                Next::Watch(Interest::Read)
            }
            Flushed::All => Next::Watch(Interest::Read),
        }
    }
}

/// A read that found nothing (or was interrupted): level-triggered epoll reports it again.
fn retry_later(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted)
}
