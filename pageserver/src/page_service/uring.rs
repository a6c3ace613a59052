//! The io_uring writer (`page_service_io = "io_uring"`): a ring per executor thread, through
//! which the connections that run on that thread send their reply batches, all of them with one
//! `io_uring_enter` when the thread runs out of work (what Valkey does before it sleeps).
//!
//! A connection hands each batch ([`Job`]: the batch's chunks of shared `Bytes`, the in-flight
//! slots of its replies, whether the connection closes after it) to the ring of the thread it
//! runs on and goes on at once: it does not wait for the send. The ring makes the batch's
//! `SENDMSG` (an iovec per chunk: the page bytes are sent from where they are, never copied) and
//! keeps it; the thread's park hook ([`crate::util::park`]) submits everything kept since the
//! last park in one `io_uring_enter` and handles what completed in it, at once (`MSG_DONTWAIT`:
//! a send completes within the submit): a finished batch frees its slots (the connection may
//! read on), sends FIN if it closes the connection and starts that connection's next batch; a
//! short send resumes where it stopped; a full socket waits for room with a `POLL_ADD`; a failed
//! send records the error, shuts the socket down and drops the connection's queued batches. No
//! batch crosses to another thread, and no thread is woken for it.
//!
//! A poll that completes without `POLLOUT` found no room: its client sent FIN, and io_uring
//! reports `POLLRDHUP` whatever the poll asks for, so every poll of that full socket completes
//! at once. Such a batch is not sent again at once (that loop would hold the thread and the
//! ring's lock for good) but by the reaper, after [`RETRY_MIN`], doubled at each such wake
//! without progress up to [`STALL_CHECK`]: a client that shut down its side may still read,
//! and one that does not is given up at its write timeout, as with FIN or without, as the
//! `writev` writer does (which waits for epoll's `EPOLLOUT`).
//!
//! What completes later (a `POLL_ADD` when the socket has room, a zero-copy notification) is
//! signalled on the ring's eventfd (kept quiet while the ring is submitted, with
//! `IORING_CQ_EVENTFD_DISABLED`: what completes within a submit is handled right after it),
//! which the ring's reaper task waits for on tokio's reactor; the reaper also shuts
//! down the socket of a batch that made no progress for its connection's write timeout (it looks
//! every [`STALL_CHECK`] while a batch waits for room).
//!
//! Entries wait for the park only where the park is sure to come ([`crate::util::park::defers`]:
//! an executor thread of a runtime with the hook, not right after a `block_in_place`), and only
//! up to [`DEFER_MAX`] of them; elsewhere they are submitted at once, by the connection's task.
//! A connection's batches keep their order: while the connection has a batch in a ring, its next
//! batches go to that same ring (which sends them one after another), wherever the connection
//! runs now; with none, its next batch goes to the ring of its current thread.
//!
//! Zero-copy: a batch of at least [`ZERO_COPY_MIN`] bytes may go as `SENDMSG_ZC` (see
//! [`ZeroCopy`] for which): its first completion says what was sent, and a notification later
//! says the kernel is done with the pages (and whether it copied them after all). The send is
//! over at the first completion: its reply slots are freed and its connection's next batch
//! starts; the job lingers in its ring slot, holding its chunks, until the last notification.
//!
//! A ring error (an `io_uring_enter` failing other than `EINTR`) ends that ring: the
//! connections with batches in it are closed (their bytes would be lost mid-stream), the ring
//! refuses jobs, [`super::io_choice::IoChoice`] never chooses the writer again, and every
//! connection writes its next batches itself (`writev`); a WARN and the gauge
//! `pageserver_page_service_io_uring_failed` say so.
//!
//! So the batches of one connection leave in order, one at a time; a connection whose client
//! stops reading holds only its own batches (parked on its poll), every other connection's
//! sends go on.
//!
//! **Invariants** (what makes the `unsafe` pushes sound):
//! - a job's chunks, iovecs and `msghdr` stay where they are, owned by the ring, from the push
//!   of an operation that points at them until its completion is reaped, and the chunks of a
//!   zero-copy send until its notification is reaped;
//! - a job holds the connection's socket (an `Arc` of it, in its [`Link`]) until its last
//!   operation completed, so the descriptor the kernel uses is never closed and its number
//!   reused underneath;
//! - a connection that ends abruptly (abort, a failure) shuts its socket down, which makes
//!   the ring's operations on it complete at once (with an error);
//! - at teardown (a failure, or the ring's thread and runtime gone), the ring's operations are
//!   cancelled, and their completions waited for, before any buffer is freed: with one
//!   `IORING_REGISTER_SYNC_CANCEL` (Linux 6.0), or where the kernel lacks it (5.6 to 5.19,
//!   [`Support::sync_cancel`]) by shutting their sockets down and an `ASYNC_CANCEL` per
//!   operation, then reaping until none is pending ([`cancel_each`]); both wait at most
//!   [`CANCEL_WAIT`], and what is still pending then keeps its buffers for good (an ERROR says
//!   so). The chunks of a zero-copy send whose notification has not come are never freed (the
//!   kernel may still read them: a retransmission must not send reused memory).

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::Shutdown;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit};
use tokio::task::AbortHandle;

use super::chunks::consume;
use super::{ConnectionSlot, PageServiceMetrics};
use crate::util::{lock, park};

/// Submission queue entries per ring (the completion queue has twice as many; the kernel keeps
/// what overflows).
const ENTRIES: u32 = 512;
/// Most iovecs in one `SENDMSG` (the kernel's `UIO_MAXIOV`); a longer batch goes in parts.
const MAX_IOVECS: usize = 1024;
/// Most entries a ring keeps for its thread's park; with more, they are submitted at once: a
/// thread that serves many connections without running out of work sends every 32 batches (one
/// `io_uring_enter` for 32 or more; 8, 32 and 128 measured alike on 2 vCPUs, docs/performance.md).
const DEFER_MAX: usize = 32;
/// `user_data` bit of a job's `POLL_ADD` (the rest is the job's slot).
const POLL: u64 = 1 << 62;
/// `user_data` bit of the operations a teardown makes itself (`ASYNC_CANCEL`, its timer):
/// their completions are no job's.
const TEARDOWN: u64 = 1 << 61;
/// How long a teardown waits for the ring's operations to end once cancelled; what is still
/// pending then keeps its buffers (leaked).
const CANCEL_WAIT: Duration = Duration::from_secs(5);
/// `IORING_SEND_ZC_REPORT_USAGE` (in a zero-copy send's `ioprio`): its notification says
/// whether the kernel had to copy the bytes after all.
const ZC_REPORT_USAGE: u16 = 8;
/// `IORING_NOTIF_USAGE_ZC_COPIED`: set in a notification's result when the kernel copied.
const ZC_COPIED: u32 = 1 << 31;
/// Sends of at least this many bytes go zero-copy (`SENDMSG_ZC`) while the connection's sends
/// are not copied anyway. Below it, pinning the pages and the extra notification cost more than
/// the copy they save (the kernel's MSG_ZEROCOPY documentation puts the break-even at about
/// 10 KB): a lone page reply is sent plain, a batch of two or more goes zero-copy.
pub const ZERO_COPY_MIN: usize = 10 * 1024;
/// How often a ring's reaper looks for batches that wait for room longer than their
/// connection's write timeout (while one waits).
const STALL_CHECK: Duration = Duration::from_millis(250);
/// How long a batch whose poll woke without room waits before it is sent again (see
/// [`InFlight::wait_to_retry`]): doubled at each such wake without progress, up to
/// [`STALL_CHECK`]; back to this once bytes go.
const RETRY_MIN: Duration = Duration::from_millis(1);

/// Faults a test can make a ring inject: the answers of kernels older than the test machine's,
/// a failed `io_uring_enter`.
#[cfg(test)]
#[derive(Debug, Default)]
pub(super) struct Hooks {
    /// The next `io_uring_enter` that submits fails (as on an unexpected kernel error).
    pub(super) fail_next_submit: AtomicBool,
    /// Zero-copy sends carry a flag this kernel does not know, so that it answers `EINVAL` as
    /// Linux 6.1 does to `IORING_SEND_ZC_REPORT_USAGE`.
    pub(super) zc_unknown_flag: AtomicBool,
    /// The kernel lacks `IORING_REGISTER_SYNC_CANCEL` (Linux 5.6 to 5.19), as the probe finds
    /// there: teardowns cancel one operation at a time.
    pub(super) no_sync_cancel: AtomicBool,
}

/// A flag of a zero-copy send that no kernel knows (the test machine's answers `EINVAL`).
#[cfg(test)]
const ZC_UNKNOWN_FLAG: u16 = 1 << 15;

/// What the kernel's io_uring offers the writer.
#[derive(Debug, Clone, Copy)]
pub struct Support {
    /// `SENDMSG_ZC` (Linux 6.1) with `IORING_SEND_ZC_REPORT_USAGE` (Linux 6.2): zero-copy sends.
    pub zero_copy: bool,
    /// `IORING_REGISTER_SYNC_CANCEL` (Linux 6.0): a ring's teardown cancels its operations in
    /// one call; without it, one `ASYNC_CANCEL` per operation ([`cancel_each`]).
    pub sync_cancel: bool,
}

/// Whether io_uring can send here: a ring can be set up (not refused by the kernel, a seccomp
/// filter or `kernel.io_uring_disabled`), knows the operations the writer uses, and completes
/// a no-op. The error says why not.
///
/// Zero-copy is offered only if a zero-copy send with the flags the writer gives it completes:
/// Linux 6.1 has `SENDMSG_ZC` but answers `EINVAL` to `IORING_SEND_ZC_REPORT_USAGE` (6.2), which
/// the opcode probe does not show. The opcode probe does not cover register operations either:
/// `IORING_REGISTER_SYNC_CANCEL` is probed by calling it ([`sync_cancel_works`]).
pub fn probe() -> Result<Support, String> {
    probe_with(ZC_REPORT_USAGE)
}

/// [`probe`], with zero-copy sends carrying `zc_ioprio`.
fn probe_with(zc_ioprio: u16) -> Result<Support, String> {
    let mut ring = IoUring::new(8).map_err(|e| format!("io_uring_setup failed: {e}"))?;
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(|e| format!("the io_uring probe failed: {e}"))?;
    let needed = [
        (opcode::SendMsg::CODE, "SENDMSG"),
        (opcode::PollAdd::CODE, "POLL_ADD"),
        (opcode::AsyncCancel::CODE, "ASYNC_CANCEL"),
        (opcode::Timeout::CODE, "TIMEOUT"),
    ];
    for (code, name) in needed {
        if !probe.is_supported(code) {
            return Err(format!("the kernel's io_uring lacks {name}"));
        }
    }
    let nop = opcode::Nop::new().build().user_data(1);
    // SAFETY: a no-op points at no memory.
    unsafe { ring.submission().push(&nop) }.map_err(|_| "the probe ring is full".to_string())?;
    ring.submit_and_wait(1).map_err(|e| format!("io_uring_enter failed: {e}"))?;
    let result = ring.completion().next().map(|cqe| cqe.result());
    match result {
        Some(res) if res >= 0 => {}
        Some(res) => return Err(format!("a no-op failed: {}", io::Error::from_raw_os_error(-res))),
        None => return Err("a no-op did not complete".to_string()),
    }
    let sync_cancel = sync_cancel_works(&ring);
    let zero_copy = probe.is_supported(opcode::SendMsgZc::CODE) && zero_copy_send_works(&mut ring, zc_ioprio);
    Ok(Support { zero_copy, sync_cancel })
}

/// Whether the kernel has `IORING_REGISTER_SYNC_CANCEL` (Linux 6.0): a cancel of an operation
/// that does not exist answers `ENOENT` there; an older kernel answers `EINVAL` (an unknown
/// register operation).
fn sync_cancel_works(ring: &IoUring) -> bool {
    match ring.submitter().register_sync_cancel(None, types::CancelBuilder::user_data(u64::MAX)) {
        Ok(()) => true,
        Err(e) => e.raw_os_error() == Some(libc::ENOENT),
    }
}

/// Whether a `SENDMSG_ZC` with `ioprio` completes: one byte to a UDP socket on loopback that
/// sends to itself.
fn zero_copy_send_works(ring: &mut IoUring, ioprio: u16) -> bool {
    /// Static: the kernel may read it until the send's notification, which is not waited for.
    static BYTE: [u8; 1] = [0];
    let Ok(socket) = std::net::UdpSocket::bind((std::net::Ipv4Addr::LOCALHOST, 0)) else { return false };
    let Ok(()) = socket.local_addr().and_then(|addr| socket.connect(addr)) else { return false };
    let mut iovec = Box::new(libc::iovec { iov_base: BYTE.as_ptr() as *mut libc::c_void, iov_len: 1 });
    // SAFETY: msghdr is plain data; all zero is an empty message.
    let mut msg: Box<libc::msghdr> = Box::new(unsafe { std::mem::zeroed() });
    msg.msg_iov = &mut *iovec;
    msg.msg_iovlen = 1;
    let send = opcode::SendMsgZc::new(types::Fd(socket.as_raw_fd()), &*msg)
        .flags(libc::MSG_DONTWAIT as u32)
        .ioprio(ioprio)
        .build()
        .user_data(2);
    // SAFETY: `msg` and `iovec` outlive the operation: its completion is reaped below before
    // they go, or they are leaked if the wait for it fails; the byte is static.
    if unsafe { ring.submission().push(&send) }.is_err() {
        return false;
    }
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                // The send may still be pending: what it points at stays.
                std::mem::forget((msg, iovec));
                return false;
            }
        }
    }
    // The send's completion comes first (a notification may follow it; it needs nothing of
    // ours).
    ring.completion().next().is_some_and(|cqe| cqe.result() >= 0)
}

/// What a connection and the ring share about the connection.
pub(super) struct Link {
    id: u64,
    socket: Arc<TcpStream>,
    /// The connection's slot of `max_connections`: held as long as the socket is (a ring's
    /// job may hold it after its connection ended), so that sockets stay within the bound.
    _connection_slot: Option<Arc<ConnectionSlot>>,
    /// A batch that makes no progress this long gets the socket shut down.
    write_timeout: Duration,
    /// Why the ring gave up on the connection (the socket is shut down then).
    failed: Mutex<Option<String>>,
    /// Whether this connection's large sends go zero-copy: [`ZeroCopy`] as a `u8`.
    zero_copy: AtomicU8,
    /// Batches handed to the ring and not yet sent (or failed).
    unsent: AtomicUsize,
}

/// What a connection's zero-copy sends have shown. Its first large send goes zero-copy as a
/// probe, the others plain until the probe's notification says whether the kernel sent from
/// the pages (then they all go zero-copy) or copied them anyway (a device that cannot send from
/// user pages: then they all go plain).
///
/// A peer on this host never gets a probe: the kernel copies every zero-copy send on local
/// delivery, and on kernel 6.18 a zero-copy segment queued to a local client with a tiny
/// receive window stalled that connection for more than 30 s (a plain one does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum ZeroCopy {
    Untried = 0,
    Probing = 1,
    Works = 2,
    /// Sent plain: a probe came back copied, or the peer is on this host.
    Plain = 3,
}

impl ZeroCopy {
    /// Where a connection starts: plain for a peer on this host (loopback, or one of this
    /// host's own addresses), else untried.
    fn for_socket(socket: &TcpStream) -> ZeroCopy {
        match (socket.peer_addr(), socket.local_addr()) {
            (Ok(peer), Ok(local)) if !is_loopback(peer.ip()) && peer.ip() != local.ip() => ZeroCopy::Untried,
            _ => ZeroCopy::Plain,
        }
    }
}

fn is_loopback(ip: std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(ip) => ip.is_loopback(),
        std::net::IpAddr::V6(ip) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

impl Link {
    fn zero_copy(&self) -> ZeroCopy {
        match self.zero_copy.load(Ordering::Relaxed) {
            0 => ZeroCopy::Untried,
            1 => ZeroCopy::Probing,
            2 => ZeroCopy::Works,
            _ => ZeroCopy::Plain,
        }
    }

    fn set_zero_copy(&self, state: ZeroCopy) {
        self.zero_copy.store(state as u8, Ordering::Relaxed);
    }
}

impl Link {
    pub(super) fn new(
        socket: Arc<TcpStream>,
        connection_slot: Option<Arc<ConnectionSlot>>,
        write_timeout: Duration,
    ) -> Arc<Link> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
        let zero_copy = AtomicU8::new(ZeroCopy::for_socket(&socket) as u8);
        Arc::new(Link {
            id,
            socket,
            _connection_slot: connection_slot,
            write_timeout,
            failed: Mutex::new(None),
            zero_copy,
            unsent: AtomicUsize::new(0),
        })
    }

    /// The ring still has batches of this connection to send: its next bytes must follow
    /// them through the ring.
    pub(super) fn sending(&self) -> bool {
        self.unsent.load(Ordering::Acquire) > 0
    }

    /// Why the ring gave up on this connection, if it did.
    pub(super) fn failure(&self) -> Option<String> {
        lock(&self.failed).clone()
    }

    /// Shuts the socket down: operations on it end, the reader sees the end.
    pub(super) fn shut_down(&self, how: Shutdown) {
        let _ = nix::sys::socket::shutdown(self.socket.as_raw_fd(), how);
    }
}

/// One batch of one connection, for a ring to send.
pub(super) struct Job {
    pub(super) link: Arc<Link>,
    pub(super) chunks: Vec<Bytes>,
    /// The in-flight slots of the batch's replies: freed once it is sent.
    pub(super) slots: Vec<OwnedSemaphorePermit>,
    /// FIN after this batch: the connection closes.
    pub(super) close: bool,
}

/// What the rings of one page service share.
struct Hub {
    support: Support,
    metrics: Arc<PageServiceMetrics>,
    /// A ring failed (or could not be set up): rings take no more jobs, and connections write
    /// with `writev`.
    dead: AtomicBool,
    #[cfg(test)]
    hooks: Arc<Hooks>,
}

impl Hub {
    /// Whether a teardown may cancel with `IORING_REGISTER_SYNC_CANCEL`.
    fn sync_cancel(&self) -> bool {
        #[cfg(test)]
        if self.hooks.no_sync_cancel.load(Ordering::Relaxed) {
            return false;
        }
        self.support.sync_cancel
    }

    /// No ring is to be chosen again; a WARN says why.
    fn give_up(&self, why: &str) {
        tracing::warn!(
            "the io_uring writer failed ({why}): the connections with batches in its ring are closed, \
             replies go through writev per connection from now on"
        );
        self.dead.store(true, Ordering::Release);
        self.metrics.uring_failed.set(1);
        self.metrics.choice.ring_chosen.set(0);
    }
}

/// The page service's io_uring writer: a ring per executor thread, set up when a connection
/// first sends through it on that thread.
pub struct Rings(Arc<Hub>);

impl std::fmt::Debug for Rings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rings").field("dead", &self.dead()).finish()
    }
}

thread_local! {
    /// This thread's rings: one per page service (a test process runs several).
    static THREAD_RINGS: RefCell<Vec<Arc<Local>>> = const { RefCell::new(Vec::new()) };
}

impl Rings {
    /// The writer, with what the kernel offers ([`probe`]); its rings come with their threads'
    /// first batches.
    pub fn new(support: Support, metrics: Arc<PageServiceMetrics>) -> Rings {
        Rings(Arc::new(Hub {
            support,
            metrics,
            dead: AtomicBool::new(false),
            #[cfg(test)]
            hooks: Arc::new(Hooks::default()),
        }))
    }

    /// A ring failed: none is chosen again.
    pub(super) fn dead(&self) -> bool {
        self.0.dead.load(Ordering::Acquire)
    }

    /// The faults the rings inject, for a test to set.
    #[cfg(test)]
    pub(super) fn hooks(&self) -> Arc<Hooks> {
        Arc::clone(&self.0.hooks)
    }

    /// The ring of the calling thread, set up at its first use (in a tokio runtime, which runs
    /// its reaper); `None` once the writer is dead, or if no ring can be set up here (the
    /// writer is then dead: a WARN says why).
    pub(super) fn local(&self) -> Option<Ring> {
        if self.dead() {
            return None;
        }
        // None while the thread's storage is torn down: nothing is sent from there.
        let found = THREAD_RINGS.try_with(|rings| {
            let rings = rings.borrow();
            rings.iter().find(|local| Arc::ptr_eq(&local.hub, &self.0)).map(|local| Ring(Arc::clone(local)))
        });
        match found {
            Ok(Some(ring)) => return Some(ring),
            Ok(None) => {}
            Err(_) => return None,
        }
        match Local::start(Arc::clone(&self.0)) {
            Ok(local) => {
                let _ = THREAD_RINGS.try_with(|rings| rings.borrow_mut().push(Arc::clone(&local)));
                park::register(Arc::clone(&local) as Arc<dyn park::Flush>);
                Some(Ring(local))
            }
            Err(e) => {
                self.0.give_up(&format!("could not set up a ring: {e}"));
                None
            }
        }
    }
}

/// A handle on one thread's ring, for a connection.
#[derive(Clone)]
pub(super) struct Ring(Arc<Local>);

/// One executor thread's ring: its connections' batches are pushed by their tasks, submitted
/// when the thread runs out of work ([`park::Flush`]), or at once where nothing may wait
/// ([`Ring::submit`]); what completes in that `io_uring_enter` is handled right after it, and
/// what completes later (room in a full socket, a zero-copy notification) wakes the ring's
/// reaper task through an eventfd.
///
/// A ring lives as long as its thread, or as a connection still has a batch in it; its reaper
/// holds it only while it handles something.
struct Local {
    hub: Arc<Hub>,
    state: Mutex<State>,
    /// `State::ready` holds entries put off until the owning thread parks.
    dirty: AtomicBool,
    /// A job was parked on a full socket: the reaper starts timing stalls.
    parked: Arc<Notify>,
    reaper: OnceLock<AbortHandle>,
}

/// What a ring's lock guards.
struct State {
    ring: IoUring,
    jobs: Jobs,
    /// Entries for the next submit.
    ready: Vec<squeue::Entry>,
    /// Replies handed over since the last submit.
    replies: usize,
    /// Completions being handled (kept for its capacity).
    completed: Vec<cqueue::Entry>,
    /// Operations pushed to the submission queue whose completion has not been reaped (a
    /// zero-copy send's notification aside): what a teardown waits for.
    pending: usize,
    /// The ring failed and was torn down: it takes no more jobs.
    failed: bool,
}

impl Local {
    fn start(hub: Arc<Hub>) -> io::Result<Arc<Local>> {
        let runtime = tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
        let ring = IoUring::new(ENTRIES)?;
        let wake = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)?;
        // Signalled for completions while the ring is not being submitted: those within a
        // submit are handled by whoever submitted (`Local::submit_ready`).
        ring.submitter().register_eventfd(wake.as_fd().as_raw_fd())?;
        // SAFETY: the eventfd owns its descriptor, open (the same file) for as long as the
        // AsyncFd holds it.
        let wake = unsafe { AsyncFd::register_with_interest(wake, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        let jobs = Jobs::new(
            hub.support.zero_copy,
            #[cfg(test)]
            Arc::clone(&hub.hooks),
        );
        let state = State {
            ring,
            jobs,
            ready: Vec::new(),
            replies: 0,
            completed: Vec::new(),
            pending: 0,
            failed: false,
        };
        let local = Arc::new(Local {
            hub,
            state: Mutex::new(state),
            dirty: AtomicBool::new(false),
            parked: Arc::new(Notify::new()),
            reaper: OnceLock::new(),
        });
        let reaper = runtime.spawn(reap(Arc::downgrade(&local), wake, Arc::clone(&local.parked)));
        let _ = local.reaper.set(reaper.abort_handle());
        Ok(local)
    }

    /// This is the calling thread's ring.
    fn is_this_threads(self: &Arc<Local>) -> bool {
        THREAD_RINGS
            .try_with(|rings| rings.borrow().iter().any(|local| Arc::ptr_eq(local, self)))
            .unwrap_or(false)
    }

    /// Submits the ready entries and handles what completed meanwhile, until nothing is left to
    /// submit (a short send is resumed, a full socket gets its `POLL_ADD`).
    ///
    /// The eventfd stays quiet meanwhile (`IORING_CQ_EVENTFD_DISABLED`): what completes within
    /// these submits is handled here, and would only wake the reaper for nothing. A completion
    /// that came between the last look and the eventfd's return is looked for once it is back.
    fn submit_ready(&self, state: &mut State) {
        self.dirty.store(false, Ordering::Relaxed);
        if state.ready.is_empty() {
            return;
        }
        let metrics = &self.hub.metrics;
        let mut parked = false;
        state.ring.completion().disable_eventfd();
        loop {
            while !state.ready.is_empty() {
                // Counted before the submit: once it is made, a client may have its reply (and
                // read the metrics) before this thread gets to count it.
                if state.replies > 0 {
                    metrics.replies_per_submit.observe(state.replies as f64);
                    state.replies = 0;
                }
                let submitted = push_all(&mut state.ring, &mut state.ready, &mut state.pending, metrics)
                    .and_then(|()| {
                        #[cfg(test)]
                        if self.hub.hooks.fail_next_submit.swap(false, Ordering::Relaxed) {
                            return Err(io::Error::from_raw_os_error(libc::EFAULT));
                        }
                        metrics.uring_io.send_syscalls.inc();
                        state.ring.submit()
                    });
                match submitted {
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.fail(state, &e.to_string());
                        return;
                    }
                }
                parked |= self.handle_completions(state);
            }
            state.ring.completion().enable_eventfd();
            if state.ring.completion().is_empty() {
                break;
            }
            state.ring.completion().disable_eventfd();
            parked |= self.handle_completions(state);
        }
        if parked {
            self.parked.notify_one();
        }
    }

    /// The ring failed: it is torn down, and the writer is not chosen again.
    fn fail(&self, state: &mut State, why: &str) {
        self.hub.give_up(why);
        teardown(state, self.hub.sync_cancel(), "the io_uring writer failed");
    }

    /// Handles the completions there are; whether a job was parked on a full socket.
    fn handle_completions(&self, state: &mut State) -> bool {
        let mut completed = std::mem::take(&mut state.completed);
        completed.extend(state.ring.completion());
        let mut parked = false;
        for cqe in completed.drain(..) {
            if !cqueue::notif(cqe.flags()) {
                state.pending = state.pending.saturating_sub(1);
            }
            parked |= complete(&cqe, &mut state.jobs, &mut state.ready, &self.hub.metrics);
        }
        state.completed = completed;
        parked
    }
}

impl park::Flush for Local {
    /// The owning thread runs out of work: what its connections handed over goes now.
    fn flush(&self) {
        if self.dirty.load(Ordering::Relaxed) {
            let mut state = lock(&self.state);
            self.submit_ready(&mut state);
        }
    }
}

impl Drop for Local {
    /// The thread and the runtime are gone: what waits is sent if it can go at once
    /// ([`Local::submit_ready`]), the rest is given up ([`teardown`]).
    fn drop(&mut self) {
        if let Some(reaper) = self.reaper.get() {
            reaper.abort();
        }
        let mut state = lock(&self.state);
        self.submit_ready(&mut state);
        if !state.failed {
            teardown(&mut state, self.hub.sync_cancel(), "the io_uring writer stopped");
        }
    }
}

/// A ring's reaper: handles the completions posted after their submit (its eventfd says when),
/// and, while a job is parked on a full socket, shuts down the sockets of those that make no
/// progress for their write timeout (every [`STALL_CHECK`]) and sends again those whose poll
/// woke without room, once their wait is over ([`Jobs::check_stalls`]). Ends when its ring
/// fails or goes.
async fn reap(local: Weak<Local>, wake: AsyncFd<EventFd>, parked_job: Arc<Notify>) {
    loop {
        // When to look at the parked jobs again; `None`: none is parked.
        let next_look = {
            let Some(local) = local.upgrade() else { return };
            let mut state = lock(&local.state);
            if state.failed {
                return;
            }
            let State { jobs, ready, .. } = &mut *state;
            jobs.check_stalls(ready);
            local.submit_ready(&mut state);
            state.jobs.next_look()
        };
        tokio::select! {
            ready = wake.readable() => match ready {
                Ok(mut guard) => {
                    let _ = guard.get_inner().read();
                    guard.clear_ready();
                    if let Some(local) = local.upgrade() {
                        local.hub.metrics.uring_io.send_syscalls.inc();
                    }
                }
                Err(e) => {
                    let Some(local) = local.upgrade() else { return };
                    let mut state = lock(&local.state);
                    local.fail(&mut state, &format!("its eventfd failed: {e}"));
                    return;
                }
            },
            () = tokio::time::sleep_until(next_look.unwrap_or_else(Instant::now).into()),
                if next_look.is_some() => {}
            () = parked_job.notified(), if next_look.is_none() => {}
        }
        let Some(local) = local.upgrade() else { return };
        let mut state = lock(&local.state);
        if state.failed {
            return;
        }
        // A job parked here is timed from the next round on.
        local.handle_completions(&mut state);
        local.submit_ready(&mut state);
    }
}

/// Ends a ring: its operations are cancelled (and waited for) before any buffer goes, then
/// every job is given up (its connection closed); it takes no more jobs. With `sync_cancel`
/// (the kernel has `IORING_REGISTER_SYNC_CANCEL`) in one call, else (or should that call
/// fail) one by one ([`cancel_each`]).
fn teardown(state: &mut State, sync_cancel: bool, why: &str) {
    state.failed = true;
    state.ready.clear();
    // Nothing may be freed while the kernel could still write to it or read from it: cancel
    // every pending operation (and wait for that) before the buffers go.
    let cancelled = if sync_cancel {
        let cancel = state
            .ring
            .submitter()
            .register_sync_cancel(Some(types::Timespec::from(CANCEL_WAIT)), types::CancelBuilder::any());
        match cancel {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => {
                tracing::warn!(
                    "failed to cancel the io_uring writer's operations at once ({e}), \
                     cancelling them one by one"
                );
                cancel_each(state)
            }
        }
    } else {
        cancel_each(state)
    };
    if let Err(e) = cancelled {
        tracing::error!("failed to cancel the io_uring writer's operations, leaking their buffers: {e}");
        state.jobs.fail_all_keeping_buffers(why);
        return;
    }
    // Notifications that came meanwhile free their chunks; the others' are kept.
    reap_cancelled(state);
    let kept = state.jobs.fail_all(why);
    if kept > 0 {
        tracing::warn!(
            "keeping {kept} reply chunks of zero-copy sends whose notification did not come \
             before the io_uring writer stopped (the kernel may still read them)"
        );
    }
}

/// Cancels a ring's operations one at a time, for kernels without
/// `IORING_REGISTER_SYNC_CANCEL` (Linux 5.6 to 5.19): the sockets of the jobs being sent are
/// shut down (their sends and polls end), an `ASYNC_CANCEL` goes for each job's operation,
/// and completions are reaped until none of the ring's operations is pending
/// ([`State::pending`]), for at most [`CANCEL_WAIT`] (a `TIMEOUT` of the ring's own ends the
/// wait). An error if operations are still pending after that (their buffers must then be
/// kept).
fn cancel_each(state: &mut State) -> io::Result<()> {
    if state.pending == 0 {
        return Ok(());
    }
    // Each job being sent has one operation at most: its send, or its poll while parked (one
    // still in `ready`, never pushed, or one waiting to be sent again after a poll that woke
    // without room, has none: it gets ENOENT, harmless).
    let mut cancels = Vec::new();
    for (slot, in_flight) in state.jobs.sending.iter().enumerate() {
        let Some(in_flight) = in_flight.as_ref().filter(|job| !job.lingering) else { continue };
        in_flight.job.link.shut_down(Shutdown::Both);
        let target = slot as u64 | if in_flight.parked { POLL } else { 0 };
        cancels.push(opcode::AsyncCancel::new(target).build().user_data(target | TEARDOWN));
    }
    // Read by the kernel when the timer is submitted (it copies it then).
    let wait = types::Timespec::from(CANCEL_WAIT);
    cancels.push(opcode::Timeout::new(&wait).build().user_data(TEARDOWN));
    for entry in &cancels {
        // SAFETY: a cancel points at no memory; the timer's timespec outlives its submission,
        // below, before this returns.
        while unsafe { state.ring.submission().push(entry) }.is_err() {
            state.ring.submit()?;
        }
    }
    loop {
        match state.ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        let timed_out = reap_cancelled(state);
        if state.pending == 0 {
            return Ok(());
        }
        if timed_out {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{} operations still pending after {CANCEL_WAIT:?}", state.pending),
            ));
        }
    }
}

/// Reaps the completions of a ring being torn down: they end their operations
/// ([`State::pending`]; a zero-copy send's adds the notification still to come), and a
/// notification frees its job's chunks once it was the last; nothing is sent again. Whether the
/// teardown's timer fired.
fn reap_cancelled(state: &mut State) -> bool {
    let mut timed_out = false;
    let completed: Vec<cqueue::Entry> = state.ring.completion().collect();
    for cqe in completed {
        let data = cqe.user_data();
        let slot = (data & !POLL) as usize;
        if data == TEARDOWN {
            timed_out = true;
        } else if data & TEARDOWN != 0 {
            // A cancel's own answer (done, ENOENT, EALREADY): the completion of the operation
            // it cancelled is what counts.
        } else if cqueue::notif(cqe.flags()) {
            state.jobs.notified(slot);
        } else {
            state.pending = state.pending.saturating_sub(1);
            if cqueue::more(cqe.flags()) {
                if let Some(in_flight) = state.jobs.get(slot) {
                    in_flight.notifs += 1;
                }
            }
        }
    }
    timed_out
}

impl Ring {
    /// Hands `job` to the ring; gives it back if the ring failed. The job's entries wait for
    /// the thread's park if this is the calling thread's ring and the thread is sure to park
    /// ([`park::defers`]), up to [`DEFER_MAX`] of them; else they are submitted now.
    pub(super) fn submit(&self, job: Job) -> Result<(), Job> {
        let local = &self.0;
        job.link.unsent.fetch_add(1, Ordering::AcqRel);
        let mut state = lock(&local.state);
        if state.failed {
            job.link.unsent.fetch_sub(1, Ordering::AcqRel);
            return Err(job);
        }
        state.replies += job.slots.len();
        let State { jobs, ready, .. } = &mut *state;
        jobs.arrive(job, ready);
        if state.ready.is_empty() {
            // Queued behind a batch of its connection being sent.
            return Ok(());
        }
        if state.ready.len() < DEFER_MAX && park::defers() && local.is_this_threads() {
            local.dirty.store(true, Ordering::Relaxed);
        } else {
            local.submit_ready(&mut state);
        }
        Ok(())
    }

    /// The ring failed.
    #[cfg(test)]
    fn failed(&self) -> bool {
        lock(&self.0.state).failed
    }
}

/// A job the thread works on, with what its operations point at.
struct InFlight {
    job: Job,
    /// Chunks before this one are sent.
    start: usize,
    iovecs: Vec<libc::iovec>,
    msg: Box<libc::msghdr>,
    /// When it last sent something (or started).
    progress: Instant,
    /// Waiting for room in the socket: its poll is pending, or (`retry_at`) none is.
    parked: bool,
    /// Its last poll woke without room: no operation is pending, the reaper sends it again
    /// from this time on ([`InFlight::wait_to_retry`]).
    retry_at: Option<Instant>,
    /// The wait after the next poll that wakes without room: [`RETRY_MIN`], doubled at each
    /// such wake without progress, up to [`STALL_CHECK`].
    retry_wait: Duration,
    /// Its socket was shut down for a stall (once).
    stalled: bool,
    /// Its sends go zero-copy (`SENDMSG_ZC`).
    zero_copy: bool,
    /// The flags of its zero-copy sends.
    zc_ioprio: u16,
    /// Zero-copy notifications still to come: until the last, the kernel may still read the
    /// chunks, so they stay (the job lingers in its slot after it is sent).
    notifs: usize,
    /// Sent (its reply slots freed, its connection's next job started); only notifications are
    /// awaited.
    lingering: bool,
}

// SAFETY: the raw pointers of its `msghdr` and iovecs point into the job's own chunks and
// iovecs, which move with it; a ring's jobs are reached only under its lock, by one thread at a
// time.
unsafe impl Send for InFlight {}

impl InFlight {
    fn new(job: Job, zero_copy: bool) -> InFlight {
        // SAFETY: msghdr is plain data; all zero is an empty message.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        InFlight {
            job,
            start: 0,
            iovecs: Vec::new(),
            msg: Box::new(msg),
            progress: Instant::now(),
            parked: false,
            retry_at: None,
            retry_wait: RETRY_MIN,
            stalled: false,
            zero_copy,
            zc_ioprio: ZC_REPORT_USAGE,
            notifs: 0,
            lingering: false,
        }
    }

    /// The `SENDMSG` (or `SENDMSG_ZC`) of what is left (up to [`MAX_IOVECS`] chunks).
    fn send(&mut self, slot: usize) -> squeue::Entry {
        self.parked = false;
        self.retry_at = None;
        self.iovecs.clear();
        for chunk in self.job.chunks[self.start..].iter().take(MAX_IOVECS) {
            self.iovecs
                .push(libc::iovec { iov_base: chunk.as_ptr() as *mut libc::c_void, iov_len: chunk.len() });
        }
        self.msg.msg_iov = self.iovecs.as_mut_ptr();
        self.msg.msg_iovlen = self.iovecs.len() as _;
        let fd = types::Fd(self.job.link.socket.as_raw_fd());
        let msg = &*self.msg as *const libc::msghdr;
        // MSG_DONTWAIT: a full socket completes at once (a short send, or EAGAIN) instead of
        // the kernel retrying inside the ring, so waiting for room is ours to see, time and
        // count, the same on every kernel.
        let flags = (libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) as u32;
        let entry = if self.zero_copy {
            opcode::SendMsgZc::new(fd, msg).flags(flags).ioprio(self.zc_ioprio).build()
        } else {
            opcode::SendMsg::new(fd, msg).flags(flags).build()
        };
        entry.user_data(slot as u64)
    }

    /// Waits for room in the socket.
    fn poll(&mut self, slot: usize) -> squeue::Entry {
        self.parked = true;
        opcode::PollAdd::new(types::Fd(self.job.link.socket.as_raw_fd()), libc::POLLOUT as u32)
            .build()
            .user_data(slot as u64 | POLL)
    }

    /// Its poll woke without room: the client sent FIN (io_uring polls for `POLLRDHUP`
    /// whatever the mask asks), and from then on every poll of the full socket completes at
    /// once, so a send now would find it full again, in a loop. Yet the client may still read
    /// (it shut down only its side): the job stays parked, with no operation pending, until the
    /// reaper sends it again after `retry_wait` ([`Jobs::check_stalls`]), and it is given up
    /// at the write timeout, as is any job whose client does not read.
    fn wait_to_retry(&mut self) {
        self.retry_at = Some(Instant::now() + self.retry_wait);
        self.retry_wait = (self.retry_wait * 2).min(STALL_CHECK);
    }

    /// Counts `sent` bytes off the front; whether everything is sent.
    fn advance(&mut self, sent: usize) -> bool {
        if sent > 0 {
            self.progress = Instant::now();
            self.retry_wait = RETRY_MIN;
        }
        consume(&mut self.job.chunks, &mut self.start, sent)
    }
}

/// What the thread holds: the jobs being sent (or lingering for zero-copy notifications), by
/// slot (one being sent per connection at most), and the jobs queued behind them, by
/// connection.
struct Jobs {
    sending: Vec<Option<InFlight>>,
    /// Slots of `sending` that are `None`, for reuse.
    free: Vec<usize>,
    /// Per connection with a job being sent: its jobs waiting behind it, in order.
    behind: HashMap<u64, VecDeque<Job>>,
    /// The kernel has `SENDMSG_ZC`.
    zero_copy: bool,
    #[cfg(test)]
    hooks: Arc<Hooks>,
}

impl Jobs {
    fn new(zero_copy: bool, #[cfg(test)] hooks: Arc<Hooks>) -> Jobs {
        Jobs {
            sending: Vec::new(),
            free: Vec::new(),
            behind: HashMap::new(),
            zero_copy,
            #[cfg(test)]
            hooks,
        }
    }

    /// Takes a job from a connection: sent next if its connection has none being sent, else
    /// queued behind. Returns the `SENDMSG` to push, if any.
    fn arrive(&mut self, job: Job, ready: &mut Vec<squeue::Entry>) {
        match self.behind.get_mut(&job.link.id) {
            Some(queue) => queue.push_back(job),
            None => {
                self.behind.insert(job.link.id, VecDeque::new());
                self.start(job, ready);
            }
        }
    }

    /// Starts sending `job` (its connection has no other job being sent): zero-copy if it is
    /// large enough and its connection's zero-copy sends are not known to be copied anyway
    /// ([`ZeroCopy`]).
    fn start(&mut self, job: Job, ready: &mut Vec<squeue::Entry>) {
        let large = self.zero_copy && job.chunks.iter().map(Bytes::len).sum::<usize>() >= ZERO_COPY_MIN;
        let zero_copy = large
            && match job.link.zero_copy() {
                ZeroCopy::Untried => {
                    job.link.set_zero_copy(ZeroCopy::Probing);
                    true
                }
                ZeroCopy::Works => true,
                ZeroCopy::Probing | ZeroCopy::Plain => false,
            };
        let mut in_flight = InFlight::new(job, zero_copy);
        #[cfg(test)]
        if self.hooks.zc_unknown_flag.load(Ordering::Relaxed) {
            in_flight.zc_ioprio |= ZC_UNKNOWN_FLAG;
        }
        if in_flight.advance(0) {
            // Nothing to send (a close without a last reply).
            let Job { link, close, .. } = in_flight.job;
            self.done(link, close, Ok(()), ready);
            return;
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.sending.push(None);
                self.sending.len() - 1
            }
        };
        ready.push(in_flight.send(slot));
        self.sending[slot] = Some(in_flight);
    }

    fn get(&mut self, slot: usize) -> Option<&mut InFlight> {
        self.sending.get_mut(slot).and_then(Option::as_mut)
    }

    fn release(&mut self, slot: usize) {
        if self.sending.get_mut(slot).and_then(Option::take).is_some() {
            self.free.push(slot);
        }
    }

    /// Ends the sending of the job in `slot`: its reply slots are freed and its connection goes
    /// on ([`Jobs::done`]); the job itself (its chunks) stays until its last zero-copy
    /// notification.
    fn finish(&mut self, slot: usize, result: io::Result<()>, ready: &mut Vec<squeue::Entry>) {
        let Some(in_flight) = self.get(slot).filter(|job| !job.lingering) else { return };
        let (link, close) = (Arc::clone(&in_flight.job.link), in_flight.job.close);
        drop(std::mem::take(&mut in_flight.job.slots));
        if in_flight.notifs > 0 {
            in_flight.lingering = true;
        } else {
            self.release(slot);
        }
        self.done(link, close, result, ready);
    }

    /// A zero-copy notification for the job in `slot` came: the kernel is done with the bytes
    /// of one of its sends.
    fn notified(&mut self, slot: usize) {
        let Some(in_flight) = self.get(slot) else { return };
        in_flight.notifs = in_flight.notifs.saturating_sub(1);
        if in_flight.lingering && in_flight.notifs == 0 {
            self.release(slot);
        }
    }

    /// A connection's job is sent (or failed): FIN if it was the last; its next job starts, or
    /// on failure the connection is given up.
    fn done(&mut self, link: Arc<Link>, close: bool, result: io::Result<()>, ready: &mut Vec<squeue::Entry>) {
        link.unsent.fetch_sub(1, Ordering::AcqRel);
        match result {
            Ok(()) if close => link.shut_down(Shutdown::Write),
            Ok(()) => {}
            Err(e) => {
                tracing::debug!("io_uring send failed, closing the connection: {e}");
                *lock(&link.failed) = Some(e.to_string());
                link.shut_down(Shutdown::Both);
                self.behind.remove(&link.id);
                return;
            }
        }
        let next = self.behind.get_mut(&link.id).and_then(VecDeque::pop_front);
        match next {
            Some(next) => self.start(next, ready),
            None => {
                self.behind.remove(&link.id);
            }
        }
    }

    /// Shuts down the sockets of parked jobs without progress for their write timeout (their
    /// polls then complete and their sends fail), and sends again the jobs whose poll woke
    /// without room once their wait is over (at once, if shut down).
    fn check_stalls(&mut self, ready: &mut Vec<squeue::Entry>) {
        let now = Instant::now();
        for (slot, job) in self.sending.iter_mut().enumerate() {
            let Some(job) = job.as_mut().filter(|j| j.parked) else { continue };
            if !job.stalled && now.duration_since(job.progress) >= job.job.link.write_timeout {
                job.stalled = true;
                tracing::debug!(
                    "a client accepted no reply for {:?}, closing its connection",
                    job.job.link.write_timeout
                );
                job.job.link.shut_down(Shutdown::Both);
            }
            if job.retry_at.is_some_and(|at| at <= now || job.stalled) {
                ready.push(job.send(slot));
            }
        }
    }

    /// When the reaper is to look at the parked jobs again ([`Jobs::check_stalls`]): in
    /// [`STALL_CHECK`], or sooner for a job waiting to be sent again; `None` if none is parked.
    fn next_look(&self) -> Option<Instant> {
        let later = Instant::now() + STALL_CHECK;
        let parked = self.sending.iter().flatten().filter(|job| job.parked);
        parked.map(|job| job.retry_at.map_or(later, |at| at.min(later))).min()
    }

    /// Gives every job up (the ring is gone). Only once no operation is pending on them.
    ///
    /// The chunks of a zero-copy send whose notification has not come are kept (leaked): the
    /// kernel may still read their pages (a retransmission), so their memory must not be reused.
    /// Returns how many chunks were kept: at most one batch per connection, once per ring.
    fn fail_all(&mut self, why: &str) -> usize {
        let mut ignored = Vec::new();
        let mut kept = 0;
        for slot in 0..self.sending.len() {
            self.finish(slot, Err(io::Error::other(why.to_string())), &mut ignored);
            if let Some(in_flight) = self.get(slot).filter(|job| job.notifs > 0) {
                let chunks = std::mem::take(&mut in_flight.job.chunks);
                kept += chunks.len();
                std::mem::forget(chunks);
            }
            self.release(slot);
        }
        for (_, queue) in self.behind.drain() {
            for job in queue {
                *lock(&job.link.failed) = Some(why.to_string());
                job.link.shut_down(Shutdown::Both);
            }
        }
        kept
    }

    /// Gives every job up but keeps (leaks) what their operations point at: for a ring whose
    /// pending operations could not be cancelled.
    fn fail_all_keeping_buffers(&mut self, why: &str) {
        let links = self.sending.iter().flatten().map(|job| &job.job.link);
        for link in links.chain(self.behind.values().flatten().map(|job| &job.link)) {
            *lock(&link.failed) = Some(why.to_string());
            link.shut_down(Shutdown::Both);
        }
        std::mem::forget(std::mem::take(&mut self.sending));
        std::mem::forget(std::mem::take(&mut self.behind));
        self.free.clear();
    }
}

/// Pushes every ready entry, submitting when the queue is full.
fn push_all(
    ring: &mut IoUring,
    ready: &mut Vec<squeue::Entry>,
    pending: &mut usize,
    metrics: &PageServiceMetrics,
) -> io::Result<()> {
    for entry in ready.drain(..) {
        let code = entry.get_opcode();
        if code == u32::from(opcode::SendMsg::CODE) {
            metrics.uring_io.sends.inc();
        } else if code == u32::from(opcode::SendMsgZc::CODE) {
            metrics.uring_io.sends.inc();
            metrics.zero_copy_sends.inc();
        }
        loop {
            // SAFETY: the entry points into a job's InFlight (chunks, iovecs, msghdr) or the
            // wake buffer, which stay put until its completion is reaped (module invariants).
            if unsafe { ring.submission().push(&entry) }.is_ok() {
                *pending += 1;
                break;
            }
            metrics.uring_io.send_syscalls.inc();
            ring.submit()?;
        }
    }
    Ok(())
}

/// Handles one completion; whether it parked its job on a full socket.
fn complete(
    cqe: &cqueue::Entry,
    jobs: &mut Jobs,
    ready: &mut Vec<squeue::Entry>,
    metrics: &PageServiceMetrics,
) -> bool {
    let (data, res) = (cqe.user_data(), cqe.result());
    let slot = (data & !POLL) as usize;
    let Some(job) = jobs.get(slot) else { return false };
    if cqueue::notif(cqe.flags()) {
        // The kernel is done with a zero-copy send's bytes; it says whether it copied them.
        let link = &job.job.link;
        if res as u32 & ZC_COPIED != 0 {
            metrics.zero_copy_copied.inc();
            link.set_zero_copy(ZeroCopy::Plain);
        } else if link.zero_copy() == ZeroCopy::Probing {
            link.set_zero_copy(ZeroCopy::Works);
        }
        jobs.notified(slot);
        return false;
    }
    if cqueue::more(cqe.flags()) {
        // A zero-copy send: its notification follows.
        job.notifs += 1;
    }
    if data & POLL != 0 {
        if res < 0 && res != -libc::EINTR {
            jobs.finish(slot, Err(io::Error::from_raw_os_error(-res)), ready);
        } else if res >= 0 && res & i32::from(libc::POLLOUT) == 0 {
            // No room (the client sent FIN: POLLRDHUP; anything else without POLLOUT alike):
            // sent again a little later, not now.
            job.wait_to_retry();
            return true;
        } else {
            // Room in the socket (an error, a shutdown, a reset come with POLLOUT: the send
            // reports them).
            ready.push(job.send(slot));
        }
        return false;
    }
    match res {
        0 if !job.advance(0) => jobs.finish(slot, Err(io::ErrorKind::WriteZero.into()), ready),
        sent if sent >= 0 => {
            metrics.uring_io.sent_bytes.inc_by(sent as u64);
            if job.advance(sent as usize) {
                jobs.finish(slot, Ok(()), ready);
            } else {
                ready.push(job.send(slot));
            }
        }
        e if e == -libc::EAGAIN => {
            metrics.send_waits.inc();
            ready.push(job.poll(slot));
            return true;
        }
        e if e == -libc::EINTR => ready.push(job.send(slot)),
        e if job.zero_copy && (e == -libc::EINVAL || e == -libc::EOPNOTSUPP) => {
            // The kernel refuses this zero-copy send (flags it does not know, a socket that
            // cannot send from user pages): nothing of it was sent; resend plain, and send
            // this connection's batches plain from now on.
            tracing::debug!(
                "a zero-copy send was refused ({}), sending plain",
                io::Error::from_raw_os_error(-e)
            );
            job.zero_copy = false;
            job.job.link.set_zero_copy(ZeroCopy::Plain);
            ready.push(job.send(slot));
        }
        e => jobs.finish(slot, Err(io::Error::from_raw_os_error(-e)), ready),
    }
    false
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    /// A batch of `pages` distinct 8 KiB pages, each after a small header, as replies are.
    pub(super) fn batch(n: u8, pages: usize) -> Vec<Bytes> {
        (0..pages)
            .flat_map(|p| {
                let tag = n.wrapping_mul(16).wrapping_add(p as u8);
                [Bytes::from(vec![tag; 24]), Bytes::from(vec![tag ^ 0xff; 8192])]
            })
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_zero_copy_probe_that_comes_back_copied_turns_the_connection_plain() {
        let support = probe().expect("io_uring works on this machine");
        assert!(support.zero_copy, "the kernel has SENDMSG_ZC");
        let metrics = Arc::new(PageServiceMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let rings = Rings::new(support, Arc::clone(&metrics));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let mut client = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        server.set_nonblocking(true).expect("nonblocking");
        let link = Link::new(
            Arc::new(TcpStream::from_std(server).expect("tokio socket")),
            None,
            Duration::from_secs(10),
        );
        // A peer on this host is never probed; pretend it is remote, to probe.
        assert_eq!(link.zero_copy(), ZeroCopy::Plain);
        link.set_zero_copy(ZeroCopy::Untried);

        // Three batches of four pages at once: the first is the probe, the next go plain while
        // it is out (its notification comes only once the bytes are delivered).
        let ring = rings.local().expect("a ring");
        let mut expected = Vec::new();
        for n in 0..3 {
            let chunks = batch(n, 4);
            expected.extend(chunks.iter().flat_map(|c| c.iter().copied()));
            let job = Job { link: Arc::clone(&link), chunks, slots: Vec::new(), close: false };
            assert!(ring.submit(job).is_ok());
        }
        let mut received = vec![0u8; expected.len()];
        client.read_exact(&mut received).expect("read three batches");
        assert!(received == expected, "the bytes of three batches arrived whole and in order");
        assert_eq!(metrics.zero_copy_sends.get(), 1, "only the probe went zero-copy");

        // Over loopback the kernel copies on delivery, and says so.
        let deadline = Instant::now() + Duration::from_secs(5);
        while metrics.zero_copy_copied.get() == 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(metrics.zero_copy_copied.get(), 1);
        assert_eq!(link.zero_copy(), ZeroCopy::Plain);

        // From then on the connection's large batches go plain; the last one closes it.
        let chunks = batch(3, 4);
        let last: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        assert!(ring.submit(Job { link: Arc::clone(&link), chunks, slots: Vec::new(), close: true }).is_ok());
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).expect("read to FIN");
        assert!(rest == last, "the last batch arrived whole, then FIN");
        assert_eq!(metrics.zero_copy_sends.get(), 1);
        assert_eq!(metrics.uring_io.sends.get(), 4);
    }
}

#[cfg(test)]
mod fault_tests {
    //! The ring against the kernel answers it does not get on this machine (older kernels,
    //! injected through [`Hooks`]), against a failing ring, and when a ring submits (the park
    //! of its thread, a thread that blocks).
    use std::io::Read;

    use nix::sys::socket::{self as sock, sockopt};

    use super::tests::batch;
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(20);

    fn start() -> (Rings, Arc<Hooks>, Arc<PageServiceMetrics>) {
        let metrics = Arc::new(PageServiceMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let rings = Rings::new(probe().expect("io_uring works on this machine"), Arc::clone(&metrics));
        let hooks = rings.hooks();
        (rings, hooks, metrics)
    }

    /// A loopback connection: the client's end (blocking), and the daemon's as a [`Link`] with
    /// `write_timeout`. A client with `small_rcvbuf` has a receive buffer of a few KiB (set
    /// before the handshake): it holds little of a batch it does not read, and the rest waits in
    /// the daemon's socket; with `small_sndbuf` that socket holds little too, so that a large
    /// batch soon finds it full and parks.
    fn connection(
        small_rcvbuf: bool,
        small_sndbuf: bool,
        write_timeout: Duration,
    ) -> (std::net::TcpStream, Arc<Link>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        if small_rcvbuf {
            // Inherited by the accepted socket, the client's end, before its handshake.
            sock::setsockopt(&listener, sockopt::RcvBuf, &4096).expect("SO_RCVBUF");
        }
        let server = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (client, _) = listener.accept().expect("accept");
        if small_sndbuf {
            sock::setsockopt(&server, sockopt::SndBuf, &4096).expect("SO_SNDBUF");
        }
        server.set_nonblocking(true).expect("nonblocking");
        let link =
            Link::new(Arc::new(TcpStream::from_std(server).expect("tokio socket")), None, write_timeout);
        (client, link)
    }

    fn bytes_of(chunks: &[Bytes]) -> Vec<u8> {
        chunks.iter().flat_map(|c| c.iter().copied()).collect()
    }

    fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + DEADLINE;
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_kernel_that_refuses_zc_report_usage_gets_a_ring_without_zero_copy() {
        let support = probe().expect("io_uring works on this machine");
        assert!(support.zero_copy, "this kernel (6.2 or later) takes IORING_SEND_ZC_REPORT_USAGE");
        // As Linux 6.1 answers a zero-copy send with REPORT_USAGE: EINVAL.
        let old = probe_with(ZC_REPORT_USAGE | ZC_UNKNOWN_FLAG).expect("a ring, without zero-copy");
        assert!(!old.zero_copy, "zero-copy offered though the kernel refuses its flags");
    }

    #[test]
    fn sync_cancel_is_probed_by_calling_it() {
        let support = probe().expect("io_uring works on this machine");
        assert!(support.sync_cancel, "this kernel (6.0 or later) has IORING_REGISTER_SYNC_CANCEL");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_zero_copy_send_the_kernel_refuses_is_resent_plain_and_its_connection_turns_plain() {
        let (rings, hooks, metrics) = start();
        hooks.zc_unknown_flag.store(true, Ordering::Relaxed);
        let (mut client, link) = connection(false, false, Duration::from_secs(10));
        link.set_zero_copy(ZeroCopy::Untried);
        let ring = rings.local().expect("a ring");
        let mut expected = Vec::new();
        for n in 0..3 {
            let chunks = batch(n, 4);
            expected.extend(bytes_of(&chunks));
            let job = Job { link: Arc::clone(&link), chunks, slots: Vec::new(), close: n == 2 };
            assert!(ring.submit(job).is_ok());
        }
        let mut received = Vec::new();
        let _ = client.read_to_end(&mut received);
        assert_eq!(received.len(), expected.len(), "every byte of three batches arrived, then FIN");
        assert!(received == expected, "the bytes arrived whole and in order");
        assert_eq!(link.failure(), None);
        assert_eq!(link.zero_copy(), ZeroCopy::Plain, "the connection's sends go plain from then on");
        assert_eq!(metrics.zero_copy_sends.get(), 1, "one zero-copy send tried, none after it");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_parked_send_without_progress_is_given_up_and_the_others_are_served_meanwhile() {
        let (rings, _hooks, metrics) = start();
        let ring = rings.local().expect("a ring");
        let (_stalled_client, stalled) = connection(true, true, Duration::from_secs(1));
        let job = Job { link: Arc::clone(&stalled), chunks: batch(0, 64), slots: Vec::new(), close: false };
        assert!(ring.submit(job).is_ok());
        wait_for("the send to park on a full socket", || metrics.send_waits.get() > 0);

        // Another connection is served meanwhile.
        let (mut client, link) = connection(false, false, Duration::from_secs(10));
        let chunks = batch(1, 4);
        let expected = bytes_of(&chunks);
        let job = Job { link: Arc::clone(&link), chunks, slots: Vec::new(), close: true };
        assert!(ring.submit(job).is_ok(), "the ring takes the next connection's batch");
        let mut received = Vec::new();
        let _ = client.read_to_end(&mut received);
        assert!(received == expected, "the other connection got its batch and FIN");
        assert_eq!(link.failure(), None);

        // The parked send is given up after its write timeout, without progress (the reaper
        // times it).
        wait_for("the stalled connection to be shut down", || stalled.failure().is_some());
        assert!(!stalled.sending());
    }

    /// Whether the client's FIN reached the daemon's end of `link`.
    fn peer_sent_fin(link: &Link) -> bool {
        let mut fd = libc::pollfd { fd: link.socket.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one pollfd on the stack, for a call that does not wait.
        let ready = unsafe { libc::poll(&mut fd, 1, 0) };
        ready == 1 && fd.revents & libc::POLLRDHUP != 0
    }

    /// Most sends a batch may make to a client that sent FIN and reads nothing, from its
    /// first send to its write timeout: a few fill the socket, then one per look of the
    /// reaper. (A writer that resends whenever the socket's poll completes makes hundreds of
    /// thousands: every poll of a half-closed socket completes at once, with `POLLRDHUP`.)
    const FEW_SENDS: u64 = 100;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_sent_fin_and_reads_nothing_is_given_up_at_its_write_timeout_without_a_send_loop() {
        let (rings, _hooks, metrics) = start();
        let ring = rings.local().expect("a ring");
        let write_timeout = Duration::from_secs(1);
        let (client, link) = connection(true, true, write_timeout);
        client.shutdown(std::net::Shutdown::Write).expect("FIN");
        wait_for("the client's FIN to arrive", || peer_sent_fin(&link));

        // Submitted at once (not from the ring's thread), on a thread of its own: a writer that
        // resends in a loop under its ring's lock would never give the thread back.
        let started = Instant::now();
        let job = Job { link: Arc::clone(&link), chunks: batch(0, 64), slots: Vec::new(), close: true };
        let submitter = {
            let ring = ring.clone();
            std::thread::spawn(move || ring.submit(job).is_ok())
        };
        let deadline = started + DEADLINE;
        let over = || submitter.is_finished() && !link.sending();
        while !over() && metrics.uring_io.sends.get() <= FEW_SENDS && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (sends, sending, given_up_after) = (metrics.uring_io.sends.get(), !over(), started.elapsed());
        // Whatever happened, the send ends here (its socket shut down, its client reset), and
        // the submitting thread with it.
        link.shut_down(Shutdown::Both);
        drop(client);
        assert!(submitter.join().expect("the submitting thread"), "the ring took the batch");

        assert!(sends <= FEW_SENDS, "{sends} sends to a full socket whose client sent FIN and reads nothing");
        assert!(!sending, "the batch was not given up within {DEADLINE:?}");
        assert!(link.failure().is_some(), "the connection was given up without an error");
        assert!(
            given_up_after >= write_timeout,
            "given up after {given_up_after:?}, before its write timeout: \
             a client that sent FIN may still read"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_sent_fin_and_reads_late_gets_every_byte() {
        let (rings, _hooks, metrics) = start();
        let ring = rings.local().expect("a ring");
        let (mut client, link) = connection(true, true, Duration::from_secs(10));
        client.shutdown(std::net::Shutdown::Write).expect("FIN");
        wait_for("the client's FIN to arrive", || peer_sent_fin(&link));

        let chunks = batch(0, 16);
        let expected = bytes_of(&chunks);
        let job = Job { link: Arc::clone(&link), chunks, slots: Vec::new(), close: true };
        // On a thread of its own, as above.
        let submitter = {
            let ring = ring.clone();
            std::thread::spawn(move || ring.submit(job).is_ok())
        };
        wait_for("the send to wait for room", || metrics.send_waits.get() > 0);
        client.set_read_timeout(Some(DEADLINE)).expect("read timeout");
        let mut received = Vec::new();
        let read = client.read_to_end(&mut received);
        link.shut_down(Shutdown::Both);
        assert!(submitter.join().expect("the submitting thread"), "the ring took the batch");

        read.expect("read to FIN");
        assert!(received == expected, "the bytes arrived whole and in order, then FIN");
        assert_eq!(link.failure(), None);
    }

    /// Page bytes that count their owner's drop.
    struct Tracked {
        bytes: Vec<u8>,
        dropped: Arc<AtomicUsize>,
    }

    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.bytes
        }
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ring_that_fails_keeps_the_chunks_of_zero_copy_sends_not_yet_notified() {
        let (rings, hooks, metrics) = start();
        let (_client, link) = connection(true, false, Duration::from_secs(60));
        link.set_zero_copy(ZeroCopy::Untried);
        let dropped = Arc::new(AtomicUsize::new(0));
        let chunks: Vec<Bytes> = (0..64u8)
            .map(|p| Bytes::from_owner(Tracked { bytes: vec![p; 8192], dropped: Arc::clone(&dropped) }))
            .collect();
        let ring = rings.local().expect("a ring");
        assert!(ring
            .submit(Job { link: Arc::clone(&link), chunks, slots: Vec::new(), close: false })
            .is_ok());
        // The kernel took the whole batch (zero-copy bytes are not charged to the socket's send
        // buffer), but most of it waits in the socket for the client, who reads nothing: the
        // send is over, its notification has not come.
        wait_for("the zero-copy send to complete", || !link.sending());
        assert!(metrics.zero_copy_sends.get() >= 1, "the batch went zero-copy");
        assert_eq!(metrics.zero_copy_copied.get(), 0, "no notification yet");

        // The ring fails at its next submit, which a batch of another connection brings about.
        hooks.fail_next_submit.store(true, Ordering::Relaxed);
        let (_other_client, other) = connection(false, false, Duration::from_secs(60));
        let _ = ring.submit(Job { link: other, chunks: batch(1, 1), slots: Vec::new(), close: false });
        wait_for("the ring to fail", || ring.failed());
        assert!(rings.dead(), "the writer is not chosen again");
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            0,
            "pages of a zero-copy send freed before its notification"
        );
    }

    /// Counts the ERROR events logged on the threads it is the default subscriber of.
    struct CountErrors(Arc<AtomicUsize>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for CountErrors {
        fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
            if *event.metadata().level() == tracing::Level::ERROR {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// A batch of 64 pages whose chunks count their drops in `dropped`.
    fn tracked_batch(dropped: &Arc<AtomicUsize>) -> Vec<Bytes> {
        (0..64u8)
            .map(|p| Bytes::from_owner(Tracked { bytes: vec![p; 8192], dropped: Arc::clone(dropped) }))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_ring_failing_on_a_kernel_without_sync_cancel_frees_its_chunks_once_cancelled() {
        use tracing_subscriber::layer::SubscriberExt;
        // The ring fails on this thread (the test's, which submits at once): its teardown logs
        // here.
        let errors = Arc::new(AtomicUsize::new(0));
        let _logs = tracing::subscriber::set_default(
            tracing_subscriber::registry().with(CountErrors(Arc::clone(&errors))),
        );
        let (rings, hooks, metrics) = start();
        hooks.no_sync_cancel.store(true, Ordering::Relaxed);
        let ring = rings.local().expect("a ring");
        // A batch parked on a full socket: its POLL_ADD is pending in the kernel, pointing at
        // nothing, but the job's chunks and iovecs stay until it completes.
        let (_client, link) = connection(true, true, Duration::from_secs(60));
        let dropped = Arc::new(AtomicUsize::new(0));
        let job =
            Job { link: Arc::clone(&link), chunks: tracked_batch(&dropped), slots: Vec::new(), close: false };
        assert!(ring.submit(job).is_ok());
        wait_for("the send to park on a full socket", || metrics.send_waits.get() > 0);

        // The ring fails at its next submit, which a batch of another connection brings about.
        hooks.fail_next_submit.store(true, Ordering::Relaxed);
        let (_other_client, other) = connection(false, false, Duration::from_secs(60));
        let _ = ring.submit(Job { link: other, chunks: batch(1, 1), slots: Vec::new(), close: false });
        wait_for("the ring to fail", || ring.failed());
        assert!(rings.dead(), "the writer is not chosen again");
        assert_eq!(errors.load(Ordering::SeqCst), 0, "an ERROR was logged at the ring's teardown");
        assert_eq!(dropped.load(Ordering::SeqCst), 64, "the parked batch's chunks were leaked");
        assert_eq!(lock(&ring.0.state).pending, 0, "the buffers went before every operation completed");
        assert_eq!(link.failure().as_deref(), Some("the io_uring writer failed"));
        assert!(!link.sending(), "the connection still counts a batch in the ring");
    }

    /// A runtime whose threads run the park hook, as the daemon's do, once they parked (so
    /// that they put work off).
    fn runtime_with_park_hook() -> tokio::runtime::Runtime {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .on_thread_park(park::before_park)
            .build()
            .expect("a runtime");
        std::thread::sleep(Duration::from_millis(100));
        runtime
    }

    #[test]
    fn the_batches_of_a_threads_connections_go_in_one_submit_when_it_runs_out_of_work() {
        let runtime = runtime_with_park_hook();
        let _entered = runtime.enter();
        let (rings, _hooks, metrics) = start();
        let (clients, links): (Vec<_>, Vec<_>) =
            (0..8).map(|_| connection(false, false, Duration::from_secs(10))).unzip();
        let syscalls = metrics.uring_io.send_syscalls.get();
        let task_metrics = Arc::clone(&metrics);
        let sent_before_park = runtime.block_on(async move {
            let task = tokio::spawn(async move {
                let ring = rings.local().expect("a ring");
                for (n, link) in links.into_iter().enumerate() {
                    let job = Job { link, chunks: batch(n as u8, 1), slots: Vec::new(), close: true };
                    assert!(ring.submit(job).is_ok());
                }
                task_metrics.uring_io.sends.get()
            });
            task.await.expect("the task ran")
        });
        assert_eq!(sent_before_park, 0, "the batches were kept while the thread had work");
        for (n, mut client) in clients.into_iter().enumerate() {
            let mut received = Vec::new();
            client.read_to_end(&mut received).expect("read to FIN");
            assert!(received == bytes_of(&batch(n as u8, 1)), "connection {n} got its batch, then FIN");
        }
        assert_eq!(metrics.uring_io.sends.get(), 8);
        assert_eq!(
            metrics.uring_io.send_syscalls.get() - syscalls,
            1,
            "the thread's park submitted the eight batches in one io_uring_enter"
        );
    }

    #[test]
    fn a_thread_about_to_block_submits_what_it_kept_first() {
        let runtime = runtime_with_park_hook();
        let _entered = runtime.enter();
        let (rings, _hooks, _metrics) = start();
        let (mut client, link) = connection(false, false, Duration::from_secs(10));
        client.set_read_timeout(Some(Duration::from_secs(5))).expect("read timeout");
        let chunks = batch(7, 1);
        let expected = bytes_of(&chunks);
        let len = expected.len();
        let received = runtime.block_on(async move {
            let task = tokio::spawn(async move {
                let ring = rings.local().expect("a ring");
                assert!(ring.submit(Job { link, chunks, slots: Vec::new(), close: false }).is_ok());
                // The thread blocks (and may hand its worker over for good) before it runs out
                // of work: what it kept goes first, or the client would wait in vain.
                park::block_in_place(|| {
                    let mut buf = vec![0u8; len];
                    client.read_exact(&mut buf).map(|()| buf)
                })
            });
            task.await.expect("the task ran")
        });
        let received = received.expect("the batch arrived while its thread blocked");
        assert!(received == expected, "the batch arrived whole");
    }

    #[test]
    fn a_ring_whose_thread_ends_gives_up_its_parked_sends_and_frees_their_chunks() {
        ring_whose_thread_ends_frees_the_chunks_of_its_parked_send(false);
    }

    #[test]
    fn a_ring_whose_thread_ends_on_a_kernel_without_sync_cancel_frees_the_chunks_of_its_parked_send() {
        ring_whose_thread_ends_frees_the_chunks_of_its_parked_send(true);
    }

    /// A send parked on a full socket when the runtime (and so the ring's thread) goes; on a
    /// kernel with or without `IORING_REGISTER_SYNC_CANCEL`.
    fn ring_whose_thread_ends_frees_the_chunks_of_its_parked_send(no_sync_cancel: bool) {
        let runtime = runtime_with_park_hook();
        let entered = runtime.enter();
        let (rings, hooks, metrics) = start();
        hooks.no_sync_cancel.store(no_sync_cancel, Ordering::Relaxed);
        let (_client, link) = connection(true, true, Duration::from_secs(60));
        let dropped = Arc::new(AtomicUsize::new(0));
        let job =
            Job { link: Arc::clone(&link), chunks: tracked_batch(&dropped), slots: Vec::new(), close: false };
        runtime.block_on(async move {
            let task = tokio::spawn(async move {
                assert!(rings.local().expect("a ring").submit(job).is_ok());
            });
            task.await.expect("the task ran");
        });
        wait_for("the send to park on a full socket", || metrics.send_waits.get() > 0);
        assert!(link.sending());
        assert_eq!(dropped.load(Ordering::SeqCst), 0);

        // The runtime and its threads go: their rings are torn down, not kept by their reapers.
        drop(entered);
        drop(runtime);
        assert_eq!(dropped.load(Ordering::SeqCst), 64, "the parked batch's chunks were leaked");
        assert_eq!(link.failure().as_deref(), Some("the io_uring writer stopped"));
        assert!(!link.sending(), "the connection still counts a batch in the ring");
    }
}
