//! The io_uring writer: threads that own a ring each and send the reply batches of many
//! connections with one `io_uring_enter` per round (`page_service_io = "io_uring"`).
//!
//! A connection hands each batch ([`Job`]: the batch's chunks of shared `Bytes`, the in-flight
//! slots of its replies, whether the connection closes after it) to its ring's queue and goes
//! on at once: it does not wait for the send. The ring's thread loops: take every job queued
//! meanwhile, start one `SENDMSG` per connection that has none in flight (an iovec per chunk:
//! the page bytes are sent from where they are, never copied), submit them all and wait for
//! completions in one `io_uring_enter`, then handle what completed: a short send resumes where
//! it stopped; a full socket (`MSG_DONTWAIT`: the kernel answers at once) waits for room with a
//! `POLL_ADD`; a finished batch frees its slots (the connection may read on), sends
//! FIN if it closes the connection, and starts that connection's next batch; a failed one
//! records the error, shuts the socket down and drops the connection's queued batches. A
//! queued job wakes the thread through an eventfd whose read is always pending on the ring.
//!
//! Zero-copy: a batch of at least [`ZERO_COPY_MIN`] bytes may go as `SENDMSG_ZC` (see
//! [`ZeroCopy`] for which): its first completion says what was sent, and a notification later
//! says the kernel is done with the pages (and whether it copied them after all). The send is
//! over at the first completion: its reply slots are freed and its connection's next batch
//! starts; the job lingers in its ring slot, holding its chunks, until the last notification.
//!
//! A ring error (an `io_uring_enter` failing other than `EINTR`/`ETIME`) ends the thread: the
//! connections with batches in it are closed (their bytes would be lost mid-stream), the ring
//! is marked dead and refuses jobs, [`super::io_choice::IoChoice`] never chooses it again, and
//! every other connection writes its next batches itself (`writev`); a WARN and the gauge
//! `pageserver_page_service_io_uring_failed` say so.
//!
//! So the batches of one connection leave in order, one at a time; a connection whose client
//! stops reading holds only its own batches (parked on its poll), every other connection's
//! sends go on, and a batch that makes no progress for the connection's write timeout gets
//! its socket shut down (the thread looks at parked batches every [`STALL_CHECK`]).
//!
//! **Invariants** (what makes the `unsafe` pushes sound):
//! - a job's chunks, iovecs and `msghdr` stay where they are, owned by the thread, from the
//!   push of an operation that points at them until its completion is reaped, and the chunks of
//!   a zero-copy send until its notification is reaped;
//! - a job holds the connection's socket (an `Arc` of it, in its [`Link`]) until its last
//!   operation completed, so the descriptor the kernel uses is never closed and its number
//!   reused underneath;
//! - a connection that ends abruptly (abort, a failure) shuts its socket down, which makes
//!   the ring's operations on it complete at once (with an error);
//! - at teardown, the ring's operations are cancelled synchronously before any buffer is freed,
//!   and the chunks of a zero-copy send whose notification has not come are never freed (the
//!   kernel may still read them: a retransmission must not send reused memory).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::Shutdown;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;

use super::chunks::consume;
use super::PageServiceMetrics;
use crate::util::lock;

/// Submission queue entries per ring (the completion queue has twice as many; the kernel keeps
/// what overflows).
const ENTRIES: u32 = 512;
/// Most iovecs in one `SENDMSG` (the kernel's `UIO_MAXIOV`); a longer batch goes in parts.
const MAX_IOVECS: usize = 1024;
/// `user_data` of the eventfd read.
const WAKE: u64 = u64::MAX;
/// `user_data` of the stall check's `TIMEOUT` (kernels without `IORING_FEAT_EXT_ARG`).
const STALL_TIMER: u64 = u64::MAX - 1;
/// `user_data` bit of a job's `POLL_ADD` (the rest is the job's slot).
const POLL: u64 = 1 << 62;
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
/// How often the thread looks for batches that wait for room longer than their connection's
/// write timeout.
const STALL_CHECK: Duration = Duration::from_millis(250);

/// Faults a test can make a ring inject: the answers of kernels older than the test machine's,
/// a failed `io_uring_enter`.
#[cfg(test)]
#[derive(Debug, Default)]
pub(super) struct Hooks {
    /// The next `io_uring_enter` that waits fails (as on an unexpected kernel error).
    pub(super) fail_next_submit: AtomicBool,
    /// Zero-copy sends carry a flag this kernel does not know, so that it answers `EINVAL` as
    /// Linux 6.1 does to `IORING_SEND_ZC_REPORT_USAGE`.
    pub(super) zc_unknown_flag: AtomicBool,
    /// `io_uring_enter` with `IORING_ENTER_EXT_ARG` fails with `EINVAL`, as on Linux 5.6-5.10.
    pub(super) no_ext_arg: AtomicBool,
}

/// A flag of a zero-copy send that no kernel knows (the test machine's answers `EINVAL`).
#[cfg(test)]
const ZC_UNKNOWN_FLAG: u16 = 1 << 15;

/// What the kernel's io_uring offers the writer.
#[derive(Debug, Clone, Copy)]
pub struct Support {
    /// `SENDMSG_ZC` (Linux 6.1) with `IORING_SEND_ZC_REPORT_USAGE` (Linux 6.2): zero-copy sends.
    pub zero_copy: bool,
    /// `IORING_FEAT_EXT_ARG` (Linux 5.11): a wait for completions can carry its own timeout.
    /// Without it, a wait that must end in time for the stall check goes with a `TIMEOUT`
    /// operation.
    pub ext_arg: bool,
}

/// Whether io_uring can send here: a ring can be set up (not refused by the kernel, a seccomp
/// filter or `kernel.io_uring_disabled`), knows the operations the writer uses, and completes
/// a no-op. The error says why not.
///
/// Zero-copy is offered only if a zero-copy send with the flags the writer gives it completes:
/// Linux 6.1 has `SENDMSG_ZC` but answers `EINVAL` to `IORING_SEND_ZC_REPORT_USAGE` (6.2), which
/// the opcode probe does not show.
pub fn probe() -> Result<Support, String> {
    probe_with(ZC_REPORT_USAGE)
}

/// [`probe`], with zero-copy sends carrying `zc_ioprio`.
fn probe_with(zc_ioprio: u16) -> Result<Support, String> {
    let mut ring = IoUring::new(8).map_err(|e| format!("io_uring_setup failed: {e}"))?;
    let mut probe = Probe::new();
    ring.submitter().register_probe(&mut probe).map_err(|e| format!("the io_uring probe failed: {e}"))?;
    for (code, name) in [
        (opcode::SendMsg::CODE, "SENDMSG"),
        (opcode::PollAdd::CODE, "POLL_ADD"),
        (opcode::Read::CODE, "READ"),
    ] {
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
    let zero_copy = probe.is_supported(opcode::SendMsgZc::CODE) && zero_copy_send_works(&mut ring, zc_ioprio);
    Ok(Support { zero_copy, ext_arg: ring.params().is_feature_ext_arg() })
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
    _connection_slot: Option<Arc<OwnedSemaphorePermit>>,
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
        connection_slot: Option<Arc<OwnedSemaphorePermit>>,
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

/// What a connection and its ring's thread share.
struct Shared {
    queue: Mutex<Vec<Job>>,
    wake: EventFd,
    stop: AtomicBool,
    /// The thread is gone (a ring error): jobs are refused, connections write themselves.
    dead: AtomicBool,
    /// Counts the wake-ups' `write`s among the send syscalls.
    metrics: Arc<PageServiceMetrics>,
    #[cfg(test)]
    hooks: Arc<Hooks>,
}

/// The daemon's rings, one thread each; connections are spread over them round-robin.
pub struct Rings {
    rings: Vec<Ring>,
    next: AtomicUsize,
}

impl std::fmt::Debug for Rings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rings").field("threads", &self.rings.len()).finish()
    }
}

/// A handle on one ring, for a connection.
#[derive(Clone)]
pub(super) struct Ring(Arc<Shared>);

impl Rings {
    /// Starts `threads` writer threads with a ring each, using what the kernel offers
    /// ([`probe`]).
    pub fn start(
        threads: usize,
        support: Support,
        metrics: Arc<PageServiceMetrics>,
    ) -> anyhow::Result<Rings> {
        let mut rings = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let ring =
                IoUring::new(ENTRIES).map_err(|e| anyhow::anyhow!("failed to set up an io_uring: {e}"))?;
            let shared = Arc::new(Shared {
                queue: Mutex::new(Vec::new()),
                wake: EventFd::from_flags(EfdFlags::EFD_CLOEXEC)
                    .map_err(|e| anyhow::anyhow!("failed to create an eventfd: {e}"))?,
                stop: AtomicBool::new(false),
                dead: AtomicBool::new(false),
                metrics: Arc::clone(&metrics),
                #[cfg(test)]
                hooks: Arc::new(Hooks::default()),
            });
            let (thread_shared, metrics) = (Arc::clone(&shared), Arc::clone(&metrics));
            std::thread::Builder::new()
                .name(format!("ps-uring-{i}"))
                .spawn(move || run(ring, &thread_shared, support, &metrics))
                .map_err(|e| anyhow::anyhow!("failed to start an io_uring writer thread: {e}"))?;
            rings.push(Ring(shared));
        }
        Ok(Rings { rings, next: AtomicUsize::new(0) })
    }

    /// Every ring's thread is gone (a ring error).
    pub(super) fn dead(&self) -> bool {
        self.rings.iter().all(|ring| ring.0.dead.load(Ordering::Acquire))
    }

    /// The faults the first ring injects, for a test to set.
    #[cfg(test)]
    pub(super) fn hooks(&self) -> Arc<Hooks> {
        Arc::clone(&self.rings[0].0.hooks)
    }

    /// The ring for a new connection: the next one whose thread is alive, if any is.
    pub(super) fn pick(&self) -> Ring {
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let ring = |i: usize| &self.rings[i % self.rings.len()];
        let alive = (first..first + self.rings.len()).map(ring).find(|r| !r.0.dead.load(Ordering::Acquire));
        alive.unwrap_or_else(|| ring(first)).clone()
    }
}

impl Drop for Rings {
    fn drop(&mut self) {
        for ring in &self.rings {
            ring.0.stop.store(true, Ordering::Release);
            let _ = ring.0.wake.write(1);
        }
    }
}

impl Ring {
    /// Queues `job`; gives it back if the ring's thread is gone.
    pub(super) fn submit(&self, job: Job) -> Result<(), Job> {
        let shared = &self.0;
        job.link.unsent.fetch_add(1, Ordering::AcqRel);
        let was_empty = {
            let mut queue = lock(&shared.queue);
            // Under the queue's lock, as the thread's last look at the queue: a job is either
            // refused here or taken (and given up) there, never stranded.
            if shared.dead.load(Ordering::Acquire) {
                job.link.unsent.fetch_sub(1, Ordering::AcqRel);
                return Err(job);
            }
            let was_empty = queue.is_empty();
            queue.push(job);
            was_empty
        };
        // The thread takes the whole queue when it wakes: one wake per non-empty queue. The
        // wake's `write` is a syscall spent on sending, and counted so.
        if was_empty {
            shared.metrics.uring_io.send_syscalls.inc();
            let _ = shared.wake.write(1);
        }
        Ok(())
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
    /// Waiting for room in the socket.
    parked: bool,
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

    /// Counts `sent` bytes off the front; whether everything is sent.
    fn advance(&mut self, sent: usize) -> bool {
        if sent > 0 {
            self.progress = Instant::now();
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

    /// No job is being sent or lingers (so none waits behind one either).
    fn sending_none(&self) -> bool {
        self.sending.len() == self.free.len()
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

    /// Shuts down the sockets of parked jobs without progress for their write timeout; their
    /// polls then complete and their sends fail. Whether any job is parked.
    fn check_stalls(&mut self) -> bool {
        let mut parked = false;
        for job in self.sending.iter_mut().flatten().filter(|j| j.parked) {
            parked = true;
            if !job.stalled && job.progress.elapsed() >= job.job.link.write_timeout {
                job.stalled = true;
                tracing::debug!(
                    "a client accepted no reply for {:?}, closing its connection",
                    job.job.link.write_timeout
                );
                job.job.link.shut_down(Shutdown::Both);
            }
        }
        parked
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
    fn fail_all_keeping_buffers(self, why: &str) {
        let links = self.sending.iter().flatten().map(|job| &job.job.link);
        for link in links.chain(self.behind.values().flatten().map(|job| &job.link)) {
            *lock(&link.failed) = Some(why.to_string());
            link.shut_down(Shutdown::Both);
        }
        std::mem::forget(self);
    }
}

/// The thread of one ring.
fn run(mut ring: IoUring, shared: &Shared, support: Support, metrics: &PageServiceMetrics) {
    let mut jobs = Jobs::new(
        support.zero_copy,
        #[cfg(test)]
        Arc::clone(&shared.hooks),
    );
    let mut wake_buf = Box::new([0u8; 8]);
    let mut ready: Vec<squeue::Entry> = vec![wake_read(shared, &mut wake_buf)];
    // Read by the kernel when an operation or a wait that points at it is submitted.
    let stall_check = types::Timespec::from(STALL_CHECK);
    // Without EXT_ARG: a stall check `TIMEOUT` is pending on the ring.
    let mut timer_armed = false;
    let failure = loop {
        let arrived = std::mem::take(&mut *lock(&shared.queue));
        let replies: usize = arrived.iter().map(|job| job.slots.len()).sum();
        for job in arrived {
            jobs.arrive(job, &mut ready);
        }
        if shared.stop.load(Ordering::Acquire) && jobs.sending_none() {
            break None;
        }
        // With a job parked on a full socket, wake up now and then to time it out: the wait
        // carries a timeout (EXT_ARG), or a `TIMEOUT` operation completes.
        let parked = jobs.check_stalls();
        if parked && !support.ext_arg && !timer_armed {
            ready.push(opcode::Timeout::new(&stall_check).build().user_data(STALL_TIMER));
            timer_armed = true;
        }
        if let Err(e) = push_all(&mut ring, &mut ready, metrics) {
            break Some(e);
        }
        if replies > 0 {
            metrics.replies_per_submit.observe(replies as f64);
        }
        metrics.uring_io.send_syscalls.inc();
        #[cfg(test)]
        if shared.hooks.fail_next_submit.swap(false, Ordering::Relaxed) {
            break Some(io::Error::from_raw_os_error(libc::EFAULT));
        }
        let waited = if parked && support.ext_arg {
            let args = types::SubmitArgs::new().timespec(&stall_check);
            #[cfg(test)]
            if shared.hooks.no_ext_arg.load(Ordering::Relaxed) {
                break Some(io::Error::from_raw_os_error(libc::EINVAL));
            }
            ring.submitter().submit_with_args(1, &args)
        } else {
            ring.submit_and_wait(1)
        };
        match waited {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted || e.raw_os_error() == Some(libc::ETIME) => {}
            Err(e) => break Some(e),
        }
        let completed: Vec<cqueue::Entry> = ring.completion().collect();
        for cqe in completed {
            if cqe.user_data() == STALL_TIMER {
                timer_armed = false;
                continue;
            }
            complete(&cqe, &mut jobs, &mut ready, shared, &mut wake_buf, metrics);
        }
    };
    if let Some(e) = &failure {
        tracing::warn!(
            "the io_uring writer failed ({e}): the connections with batches in it are closed, \
             replies go through writev per connection from now on"
        );
    }
    const STOPPED: &str = "the io_uring writer stopped";
    // Nothing may be freed while the kernel could still write to it or read from it: cancel
    // every pending operation (and wait for that) before the buffers go.
    let cancel = ring
        .submitter()
        .register_sync_cancel(Some(types::Timespec::new().sec(5)), types::CancelBuilder::any());
    match cancel {
        Err(e) if e.raw_os_error() != Some(libc::ENOENT) => {
            tracing::error!("could not cancel the io_uring writer's operations, leaking their buffers: {e}");
            jobs.fail_all_keeping_buffers(STOPPED);
            std::mem::forget(wake_buf);
        }
        _ => {
            // Notifications that came meanwhile free their chunks; the others' are kept.
            let notified: Vec<usize> = ring
                .completion()
                .filter(|cqe| cqueue::notif(cqe.flags()) && cqe.user_data() & POLL == 0)
                .map(|cqe| cqe.user_data() as usize)
                .collect();
            for slot in notified {
                jobs.notified(slot);
            }
            drop(ring);
            let kept = jobs.fail_all(STOPPED);
            if kept > 0 {
                tracing::warn!(
                    "keeping {kept} reply chunks of zero-copy sends whose notification did not come \
                     before the io_uring writer stopped (the kernel may still read them)"
                );
            }
        }
    }
    // Jobs queued meanwhile are given up too (their connections close); from now on jobs are
    // refused (`Ring::submit`).
    let queued = {
        let mut queue = lock(&shared.queue);
        shared.dead.store(true, Ordering::Release);
        std::mem::take(&mut *queue)
    };
    if failure.is_some() {
        metrics.uring_failed.set(1);
        metrics.choice.ring_chosen.set(0);
    }
    for job in queued {
        *lock(&job.link.failed) = Some(STOPPED.to_string());
        job.link.shut_down(Shutdown::Both);
    }
}

/// The read of the wake eventfd, always pending on the ring.
fn wake_read(shared: &Shared, buf: &mut [u8; 8]) -> squeue::Entry {
    opcode::Read::new(types::Fd(shared.wake.as_fd().as_raw_fd()), buf.as_mut_ptr(), 8).build().user_data(WAKE)
}

/// Pushes every ready entry, submitting when the queue is full.
fn push_all(
    ring: &mut IoUring,
    ready: &mut Vec<squeue::Entry>,
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
                break;
            }
            metrics.uring_io.send_syscalls.inc();
            ring.submit()?;
        }
    }
    Ok(())
}

/// Handles one completion.
fn complete(
    cqe: &cqueue::Entry,
    jobs: &mut Jobs,
    ready: &mut Vec<squeue::Entry>,
    shared: &Shared,
    wake_buf: &mut [u8; 8],
    metrics: &PageServiceMetrics,
) {
    let (data, res) = (cqe.user_data(), cqe.result());
    if data == WAKE {
        ready.push(wake_read(shared, wake_buf));
        return;
    }
    let slot = (data & !POLL) as usize;
    let Some(job) = jobs.get(slot) else { return };
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
        return;
    }
    if cqueue::more(cqe.flags()) {
        // A zero-copy send: its notification follows.
        job.notifs += 1;
    }
    if data & POLL != 0 {
        // Room in the socket, or an error the send will report.
        if res < 0 && res != -libc::EINTR {
            jobs.finish(slot, Err(io::Error::from_raw_os_error(-res)), ready);
        } else {
            ready.push(job.send(slot));
        }
        return;
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

    #[tokio::test]
    async fn a_zero_copy_probe_that_comes_back_copied_turns_the_connection_plain() {
        let support = probe().expect("io_uring works on this machine");
        assert!(support.zero_copy, "the kernel has SENDMSG_ZC");
        let metrics = Arc::new(PageServiceMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let rings = Rings::start(1, support, Arc::clone(&metrics)).expect("start a ring");
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
        let ring = rings.pick();
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
    //! injected through [`Hooks`]) and against a failing ring.
    use std::io::Read;

    use nix::sys::socket::{self as sock, sockopt};

    use super::tests::batch;
    use super::*;

    const DEADLINE: Duration = Duration::from_secs(20);

    fn start() -> (Rings, Arc<Hooks>, Arc<PageServiceMetrics>) {
        start_with(probe().expect("io_uring works on this machine"))
    }

    fn start_with(support: Support) -> (Rings, Arc<Hooks>, Arc<PageServiceMetrics>) {
        let metrics = Arc::new(PageServiceMetrics::new(&prometheus::Registry::new()).expect("metrics"));
        let rings = Rings::start(1, support, Arc::clone(&metrics)).expect("start a ring");
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

    #[tokio::test]
    async fn a_zero_copy_send_the_kernel_refuses_is_resent_plain_and_its_connection_turns_plain() {
        let (rings, hooks, metrics) = start();
        hooks.zc_unknown_flag.store(true, Ordering::Relaxed);
        let (mut client, link) = connection(false, false, Duration::from_secs(10));
        link.set_zero_copy(ZeroCopy::Untried);
        let ring = rings.pick();
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

    #[tokio::test]
    async fn a_kernel_without_ext_arg_times_out_a_parked_send_and_serves_the_others() {
        // What the probe says on such a kernel, which answers EXT_ARG waits with EINVAL.
        let support = Support { ext_arg: false, ..probe().expect("io_uring works on this machine") };
        let (rings, hooks, metrics) = start_with(support);
        hooks.no_ext_arg.store(true, Ordering::Relaxed);
        let ring = rings.pick();
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

        // The parked send is given up after its write timeout, without progress.
        wait_for("the stalled connection to be shut down", || stalled.failure().is_some());
        assert!(!stalled.sending());
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

    #[tokio::test]
    async fn a_ring_that_fails_keeps_the_chunks_of_zero_copy_sends_not_yet_notified() {
        let (rings, hooks, metrics) = start();
        let (_client, link) = connection(true, false, Duration::from_secs(60));
        link.set_zero_copy(ZeroCopy::Untried);
        let dropped = Arc::new(AtomicUsize::new(0));
        let chunks: Vec<Bytes> = (0..64u8)
            .map(|p| Bytes::from_owner(Tracked { bytes: vec![p; 8192], dropped: Arc::clone(&dropped) }))
            .collect();
        let ring = rings.pick();
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
        wait_for("the ring to fail", || ring.0.dead.load(Ordering::Acquire));
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            0,
            "pages of a zero-copy send freed before its notification"
        );
    }
}
