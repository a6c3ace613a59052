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
//! `POLL_ADD`; a finished batch frees its slots (the connection's reader may read on), sends
//! FIN if it closes the connection, and starts that connection's next batch; a failed one
//! records the error, shuts the socket down and drops the connection's queued batches. A
//! queued job wakes the thread through an eventfd whose read is always pending on the ring.
//!
//! So the batches of one connection leave in order, one at a time; a connection whose client
//! stops reading holds only its own batches (parked on its poll), every other connection's
//! sends go on, and a batch that makes no progress for the connection's write timeout gets
//! its socket shut down (the thread looks at parked batches every [`STALL_CHECK`]).
//!
//! **Invariants** (what makes the `unsafe` pushes sound):
//! - a job's chunks, iovecs and `msghdr` stay where they are, owned by the thread, from the
//!   push of an operation that points at them until its completion is reaped;
//! - a job holds the connection's socket (an `Arc` of it, in its [`Link`]) until its last
//!   operation completed, so the descriptor the kernel uses is never closed and its number
//!   reused underneath;
//! - a connection that ends abruptly (abort, a failure) shuts its socket down, which makes
//!   the ring's operations on it complete at once (with an error);
//! - at teardown, the ring's operations are cancelled synchronously before any buffer is freed.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::socket::Shutdown;
use tokio::net::TcpStream;
use tokio::sync::OwnedSemaphorePermit;

use super::writer::consume;
use super::PageServiceMetrics;
use crate::walredo::lock;

/// Submission queue entries per ring (the completion queue has twice as many; the kernel keeps
/// what overflows).
const ENTRIES: u32 = 512;
/// Most iovecs in one `SENDMSG` (the kernel's `UIO_MAXIOV`); a longer batch goes in parts.
const MAX_IOVECS: usize = 1024;
/// `user_data` of the eventfd read.
const WAKE: u64 = u64::MAX;
/// `user_data` bit of a job's `POLL_ADD` (the rest is the job's slot).
const POLL: u64 = 1 << 62;
/// How often the thread looks for batches that wait for room longer than their connection's
/// write timeout.
const STALL_CHECK: Duration = Duration::from_millis(250);

/// Whether io_uring can send here: a ring can be set up (not refused by the kernel, a seccomp
/// filter or `kernel.io_uring_disabled`), knows the operations the writer uses, and completes
/// a no-op. The error says why not.
pub fn probe() -> Result<(), String> {
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
        Some(res) if res >= 0 => Ok(()),
        Some(res) => Err(format!("a no-op failed: {}", io::Error::from_raw_os_error(-res))),
        None => Err("a no-op did not complete".to_string()),
    }
}

/// What a connection and the ring share about the connection.
pub(super) struct Link {
    id: u64,
    socket: Arc<TcpStream>,
    /// A batch that makes no progress this long gets the socket shut down.
    write_timeout: Duration,
    /// Why the ring gave up on the connection (the socket is shut down then).
    failed: Mutex<Option<String>>,
}

impl Link {
    pub(super) fn new(socket: Arc<TcpStream>, write_timeout: Duration) -> Arc<Link> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed) as u64;
        Arc::new(Link { id, socket, write_timeout, failed: Mutex::new(None) })
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
    /// Starts `threads` writer threads with a ring each.
    pub fn start(threads: usize, metrics: Arc<PageServiceMetrics>) -> anyhow::Result<Rings> {
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
            });
            let (thread_shared, metrics) = (Arc::clone(&shared), Arc::clone(&metrics));
            std::thread::Builder::new()
                .name(format!("ps-uring-{i}"))
                .spawn(move || run(ring, &thread_shared, &metrics))
                .map_err(|e| anyhow::anyhow!("failed to start an io_uring writer thread: {e}"))?;
            rings.push(Ring(shared));
        }
        Ok(Rings { rings, next: AtomicUsize::new(0) })
    }

    /// The ring for a new connection.
    pub(super) fn pick(&self) -> Ring {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.rings.len();
        self.rings[i].clone()
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
        let was_empty = {
            let mut queue = lock(&shared.queue);
            // Under the queue's lock, as the thread's last look at the queue: a job is either
            // refused here or taken (and given up) there, never stranded.
            if shared.dead.load(Ordering::Acquire) {
                return Err(job);
            }
            let was_empty = queue.is_empty();
            queue.push(job);
            was_empty
        };
        // The thread takes the whole queue when it wakes: one wake per non-empty queue.
        if was_empty {
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
}

impl InFlight {
    fn new(job: Job) -> InFlight {
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
        }
    }

    /// The `SENDMSG` of what is left (up to [`MAX_IOVECS`] chunks).
    fn send(&mut self, slot: usize) -> squeue::Entry {
        self.parked = false;
        self.iovecs.clear();
        for chunk in self.job.chunks[self.start..].iter().take(MAX_IOVECS) {
            self.iovecs
                .push(libc::iovec { iov_base: chunk.as_ptr() as *mut libc::c_void, iov_len: chunk.len() });
        }
        self.msg.msg_iov = self.iovecs.as_mut_ptr();
        self.msg.msg_iovlen = self.iovecs.len() as _;
        opcode::SendMsg::new(types::Fd(self.job.link.socket.as_raw_fd()), &*self.msg as *const libc::msghdr)
            // MSG_DONTWAIT: a full socket completes at once (a short send, or EAGAIN) instead
            // of the kernel retrying inside the ring, so waiting for room is ours to see, time
            // and count, the same on every kernel.
            .flags((libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) as u32)
            .build()
            .user_data(slot as u64)
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

/// What the thread holds: the jobs being sent, by slot (one per connection at most), and the
/// jobs queued behind them, by connection.
#[derive(Default)]
struct Jobs {
    sending: Vec<Option<InFlight>>,
    /// Slots of `sending` that are `None`, for reuse.
    free: Vec<usize>,
    /// Per connection with a job being sent: its jobs waiting behind it, in order.
    behind: HashMap<u64, VecDeque<Job>>,
}

impl Jobs {
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

    /// Starts sending `job` (its connection has no other job being sent).
    fn start(&mut self, job: Job, ready: &mut Vec<squeue::Entry>) {
        let mut in_flight = InFlight::new(job);
        if in_flight.advance(0) {
            // Nothing to send (a close without a last reply).
            self.done(in_flight, Ok(()), ready);
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

    /// No job is being sent (so none waits behind one either).
    fn sending_none(&self) -> bool {
        self.sending.len() == self.free.len()
    }

    fn get(&mut self, slot: usize) -> Option<&mut InFlight> {
        self.sending.get_mut(slot).and_then(Option::as_mut)
    }

    /// Ends the job in `slot`.
    fn finish(&mut self, slot: usize, result: io::Result<()>, ready: &mut Vec<squeue::Entry>) {
        if let Some(in_flight) = self.sending.get_mut(slot).and_then(Option::take) {
            self.free.push(slot);
            self.done(in_flight, result, ready);
        }
    }

    /// A job is over: its slots are freed (dropped with it); its connection's next job starts,
    /// or on failure its connection is given up.
    fn done(&mut self, in_flight: InFlight, result: io::Result<()>, ready: &mut Vec<squeue::Entry>) {
        let job = in_flight.job;
        let link = Arc::clone(&job.link);
        let close = job.close;
        drop(job);
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
    fn fail_all(&mut self, why: &str) {
        let mut ignored = Vec::new();
        for slot in 0..self.sending.len() {
            self.finish(slot, Err(io::Error::other(why.to_string())), &mut ignored);
        }
        for (_, queue) in self.behind.drain() {
            for job in queue {
                *lock(&job.link.failed) = Some(why.to_string());
                job.link.shut_down(Shutdown::Both);
            }
        }
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
fn run(mut ring: IoUring, shared: &Shared, metrics: &PageServiceMetrics) {
    let mut jobs = Jobs::default();
    let mut wake_buf = Box::new([0u8; 8]);
    let mut ready: Vec<squeue::Entry> = vec![wake_read(shared, &mut wake_buf)];
    let stall_check = types::Timespec::from(STALL_CHECK);
    let failure = loop {
        let arrived = std::mem::take(&mut *lock(&shared.queue));
        let replies: usize = arrived.iter().map(|job| job.slots.len()).sum();
        for job in arrived {
            jobs.arrive(job, &mut ready);
        }
        if shared.stop.load(Ordering::Acquire) && jobs.sending_none() {
            break None;
        }
        if let Err(e) = push_all(&mut ring, &mut ready, metrics) {
            break Some(e);
        }
        if replies > 0 {
            metrics.replies_per_submit.observe(replies as f64);
        }
        metrics.uring_io.send_syscalls.inc();
        // With a job parked on a full socket, wake up now and then to time it out.
        let waited = if jobs.check_stalls() {
            let args = types::SubmitArgs::new().timespec(&stall_check);
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
            complete(&cqe, &mut jobs, &mut ready, shared, &mut wake_buf, metrics);
        }
    };
    if let Some(e) = failure {
        tracing::error!("the io_uring writer failed, its connections are closed: {e}");
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
            drop(ring);
            jobs.fail_all(STOPPED);
        }
    }
    // Jobs queued meanwhile are given up too (their connections close); from now on jobs are
    // refused (`Ring::submit`).
    let queued = {
        let mut queue = lock(&shared.queue);
        shared.dead.store(true, Ordering::Release);
        std::mem::take(&mut *queue)
    };
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
        if entry.get_opcode() == u32::from(opcode::SendMsg::CODE) {
            metrics.uring_io.sends.inc();
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
        e => jobs.finish(slot, Err(io::Error::from_raw_os_error(-e)), ready),
    }
}
