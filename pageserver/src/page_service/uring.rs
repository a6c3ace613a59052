//! The io_uring writer: threads that own a ring each and send the reply batches of many
//! connections with one `io_uring_enter` per round (`page_service_io = "io_uring"`).
//!
//! A connection hands a batch ([`Job`]: its socket, the batch's chunks of shared `Bytes`, a
//! channel for the outcome) to its ring's queue and waits on the channel. The ring's thread
//! loops: take every job queued meanwhile, build one `SENDMSG` per job (an iovec per chunk:
//! the page bytes are sent from where they are, never copied), submit them all and wait for
//! completions in one `io_uring_enter`, then handle what completed: a short send resumes where
//! it stopped, a full socket (`EAGAIN`: the sockets are non-blocking) waits with a `POLL_ADD`
//! for room and sends again, an error or the end of the batch answers the connection. A queued
//! job wakes the thread through an eventfd whose read is always pending on the ring.
//!
//! So a connection whose client stops reading holds only its own job (parked on its poll);
//! every other connection's sends go on. Slow readers never block the thread.
//!
//! **Invariants** (what makes the `unsafe` pushes sound):
//! - a job's chunks, iovecs and `msghdr` stay where they are, owned by the thread, from the
//!   push of an operation that points at them until its completion is reaped;
//! - a job holds the connection's socket (an `Arc` of it) until its last operation completed,
//!   so the descriptor the kernel uses is never closed and its number reused underneath;
//! - a connection that gives up on a job (timeout, abort) shuts the socket down, which makes
//!   its pending operations complete at once (with an error), so no job outlives its
//!   connection by more than a round.

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Buf, Bytes};
use io_uring::{cqueue, opcode, squeue, types, IoUring, Probe};
use nix::sys::eventfd::{EfdFlags, EventFd};
use tokio::sync::oneshot;

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

/// One batch of one connection, for a ring to send.
pub(super) struct Job {
    /// The connection's socket: held until the job's last operation completed, so its
    /// descriptor is never closed (and its number reused) under the kernel.
    pub(super) socket: Arc<tokio::net::TcpStream>,
    pub(super) chunks: Vec<Bytes>,
    pub(super) replies: usize,
    pub(super) done: oneshot::Sender<io::Result<()>>,
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
        if shared.dead.load(Ordering::Acquire) {
            return Err(job);
        }
        let was_empty = {
            let mut queue = lock(&shared.queue);
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
}

impl InFlight {
    fn new(job: Job) -> InFlight {
        // SAFETY: msghdr is plain data; all zero is an empty message.
        let msg: libc::msghdr = unsafe { std::mem::zeroed() };
        InFlight { job, start: 0, iovecs: Vec::new(), msg: Box::new(msg) }
    }

    /// The `SENDMSG` of what is left (up to [`MAX_IOVECS`] chunks).
    fn send(&mut self, slot: usize) -> squeue::Entry {
        self.iovecs.clear();
        for chunk in self.job.chunks[self.start..].iter().take(MAX_IOVECS) {
            self.iovecs
                .push(libc::iovec { iov_base: chunk.as_ptr() as *mut libc::c_void, iov_len: chunk.len() });
        }
        self.msg.msg_iov = self.iovecs.as_mut_ptr();
        self.msg.msg_iovlen = self.iovecs.len() as _;
        opcode::SendMsg::new(types::Fd(self.job.socket.as_raw_fd()), &*self.msg as *const libc::msghdr)
            // MSG_DONTWAIT: a full socket completes at once (a short send, or EAGAIN) instead
            // of the kernel retrying inside the ring, so waiting for room is ours to see and
            // count, the same on every kernel.
            .flags((libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) as u32)
            .build()
            .user_data(slot as u64)
    }

    /// Waits for room in the socket.
    fn poll(&self, slot: usize) -> squeue::Entry {
        opcode::PollAdd::new(types::Fd(self.job.socket.as_raw_fd()), libc::POLLOUT as u32)
            .build()
            .user_data(slot as u64 | POLL)
    }

    /// Counts `sent` bytes off the front; whether everything is sent.
    fn advance(&mut self, mut sent: usize) -> bool {
        while sent > 0 && self.start < self.job.chunks.len() {
            let chunk = &mut self.job.chunks[self.start];
            let n = sent.min(chunk.len());
            chunk.advance(n);
            sent -= n;
            if chunk.is_empty() {
                self.start += 1;
            }
        }
        while self.start < self.job.chunks.len() && self.job.chunks[self.start].is_empty() {
            self.start += 1;
        }
        self.start == self.job.chunks.len()
    }
}

/// The jobs in flight, by slot (a slot is reused once its job is done).
#[derive(Default)]
struct Slots {
    jobs: Vec<Option<InFlight>>,
    free: Vec<usize>,
    busy: usize,
}

impl Slots {
    fn insert(&mut self, job: InFlight) -> usize {
        self.busy += 1;
        match self.free.pop() {
            Some(slot) => {
                self.jobs[slot] = Some(job);
                slot
            }
            None => {
                self.jobs.push(Some(job));
                self.jobs.len() - 1
            }
        }
    }

    fn get(&mut self, slot: usize) -> Option<&mut InFlight> {
        self.jobs.get_mut(slot).and_then(Option::as_mut)
    }

    /// Ends the job in `slot` with `result` for its connection.
    fn finish(&mut self, slot: usize, result: io::Result<()>) {
        if let Some(done) = self.jobs.get_mut(slot).and_then(Option::take) {
            self.busy -= 1;
            self.free.push(slot);
            let _ = done.job.done.send(result);
        }
    }

    /// Ends every job with an error. Only once the ring has no operation pending on them.
    fn fail_all(&mut self, why: &str) {
        for slot in 0..self.jobs.len() {
            self.finish(slot, Err(io::Error::other(why.to_string())));
        }
    }

    /// Ends every job with an error, but keeps (leaks) what their operations point at: for a
    /// ring whose pending operations could not be cancelled.
    fn fail_all_keeping_buffers(mut self, why: &str) {
        for job in self.jobs.iter_mut().flatten() {
            let done = std::mem::replace(&mut job.job.done, oneshot::channel().0);
            let _ = done.send(Err(io::Error::other(why.to_string())));
        }
        std::mem::forget(self);
    }
}

/// The thread of one ring.
fn run(mut ring: IoUring, shared: &Shared, metrics: &PageServiceMetrics) {
    let mut slots = Slots::default();
    let mut wake_buf = Box::new([0u8; 8]);
    let mut ready: Vec<squeue::Entry> = vec![wake_read(shared, &mut wake_buf)];
    let failure = loop {
        let jobs = std::mem::take(&mut *lock(&shared.queue));
        let mut replies = 0;
        for job in jobs {
            replies += job.replies;
            let slot = slots.insert(InFlight::new(job));
            if let Some(job) = slots.get(slot) {
                ready.push(job.send(slot));
            }
        }
        if shared.stop.load(Ordering::Acquire) && slots.busy == 0 {
            break None;
        }
        if let Err(e) = push_all(&mut ring, &mut ready, metrics) {
            break Some(e);
        }
        if replies > 0 {
            metrics.replies_per_submit.observe(replies as f64);
        }
        metrics.send_syscalls.with_label_values(&["io_uring"]).inc();
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => break Some(e),
        }
        let completed: Vec<cqueue::Entry> = ring.completion().collect();
        for cqe in completed {
            complete(&cqe, &mut slots, &mut ready, shared, &mut wake_buf, metrics);
        }
    };
    shared.dead.store(true, Ordering::Release);
    if let Some(e) = failure {
        tracing::error!("the io_uring writer failed, its connections write on their own from now on: {e}");
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
            slots.fail_all_keeping_buffers(STOPPED);
            std::mem::forget(wake_buf);
        }
        _ => {
            drop(ring);
            slots.fail_all(STOPPED);
        }
    }
    // Jobs queued meanwhile fail too; their connections close.
    for job in std::mem::take(&mut *lock(&shared.queue)) {
        let _ = job.done.send(Err(io::Error::other(STOPPED)));
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
            metrics.sends.with_label_values(&["io_uring"]).inc();
        }
        loop {
            // SAFETY: the entry points into a job's InFlight (chunks, iovecs, msghdr) or the
            // wake buffer, which stay put until its completion is reaped (module invariants).
            if unsafe { ring.submission().push(&entry) }.is_ok() {
                break;
            }
            metrics.send_syscalls.with_label_values(&["io_uring"]).inc();
            ring.submit()?;
        }
    }
    Ok(())
}

/// Handles one completion.
fn complete(
    cqe: &cqueue::Entry,
    slots: &mut Slots,
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
    let Some(job) = slots.get(slot) else { return };
    if data & POLL != 0 {
        // Room in the socket, or an error the send will report.
        if res < 0 && res != -libc::EINTR {
            slots.finish(slot, Err(io::Error::from_raw_os_error(-res)));
        } else {
            ready.push(job.send(slot));
        }
        return;
    }
    match res {
        0 if !job.advance(0) => slots.finish(slot, Err(io::ErrorKind::WriteZero.into())),
        sent if sent >= 0 => {
            metrics.sent_bytes.with_label_values(&["io_uring"]).inc_by(sent as u64);
            if job.advance(sent as usize) {
                slots.finish(slot, Ok(()));
            } else {
                ready.push(job.send(slot));
            }
        }
        e if e == -libc::EAGAIN => {
            metrics.send_waits.inc();
            ready.push(job.poll(slot));
        }
        e if e == -libc::EINTR => ready.push(job.send(slot)),
        e => slots.finish(slot, Err(io::Error::from_raw_os_error(-e))),
    }
}
