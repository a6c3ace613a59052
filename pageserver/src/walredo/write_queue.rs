//! Combined writes: the requests queued for a child's stdin are written together, in one
//! vectored write where the pipe has room, by whichever of them holds the stdin lock.
//!
//! Why: under load many requests wait for one child's stdin (at 64 x 8 on 2 vCPUs, dozens at a
//! time, most of them while the pipe is full). Written one by one, each took the lock in turn (a
//! wake-up and a task switch), made a `writev` of its own and, where the child slept, woke it.
//! Written together, the bytes the pipe has room for go in one `writev`.
//!
//! How: a request enters the child's queue as an [`Intent`] that shares it (an `Arc`), so that
//! another request's future can write it, and its own future can be dropped at any time without
//! pulling the bytes from under a write. Then it waits ([`Queued::turn`]) until it is written, or fails, or until
//! it gets the stdin lock with its intent still queued: then it takes the whole queue
//! ([`Batch::take`]) and writes it in order, each intent taking its sequence number when its last
//! byte is written. The lock is FIFO, and so is the queue: requests are written in the order
//! they queued, as before.
//!
//! Failure and time, as for one request (see `pipeline.rs`), applied to the batch in order:
//! the intent being written is the one the child's stall or hang is judged by. Stalled with
//! none of its bytes written, it and every intent behind it leave the child
//! ([`ProcessError::Stalled`]); partly written, the writer waits until the child is hung, and
//! then it fails as the oldest request did before ([`ProcessError::Timeout`] or
//! `Stalled { hung: true }`), the ones behind it `Stalled { hung: true }`. A failed write
//! fails it and everything behind it. Every owner gets its own error and handles it as before.
//!
//! Invariants:
//! - an intent is written at most once, whole and in queue order, by the holder of the stdin
//!   lock: `Queued` -> `Taken` under the queue's lock, then `Written(seq)` or `Failed`;
//! - no byte follows a partial frame: a batch dropped with its current intent partly written
//!   fences the writer (`broken`) and runs the holder's `on_broken_write`; the intents behind
//!   it fail; untouched intents of a batch dropped between writes go back to the front of
//!   the queue, as if their writer had never taken them;
//! - a reply reaches no other request: an owner that leaves before its intent is written
//!   withdraws it (`Queued`) or marks it gone (`Taken`: the writer abandons its reply slot once
//!   it has a sequence number); one that leaves after abandons the slot itself.

use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use super::pipeline::{Patience, PipeWriter, ProcessError, Shared};
use super::request::{Cursor, Request, SLICES_PER_WRITE};
use crate::util::lock;

/// The requests queued for one child's stdin, oldest first.
#[derive(Default)]
pub(crate) struct WriteQueue {
    intents: Mutex<VecDeque<Arc<Intent>>>,
}

/// One queued request.
pub(crate) struct Intent {
    request: Arc<Request>,
    state: Mutex<IntentState>,
}

struct IntentState {
    stage: Stage,
    /// The owner's waker, while it waits for the intent to be written.
    waker: Option<Waker>,
    /// The owner left while the intent was being written: its reply slot is to be abandoned.
    owner_gone: bool,
}

#[derive(Clone)]
enum Stage {
    Queued,
    /// In a writer's batch.
    Taken,
    Written(u64),
    Failed(Failure),
    /// The owner left while it was queued: writers skip it.
    Withdrawn,
}

/// How an intent failed, for its owner to turn into its [`ProcessError`].
#[derive(Clone, Debug)]
enum Failure {
    Timeout(Duration),
    Stalled { hung: bool },
    Io(Arc<str>),
}

impl Failure {
    fn of(e: &ProcessError) -> Failure {
        match e {
            ProcessError::Timeout(t) => Failure::Timeout(*t),
            ProcessError::Stalled { hung } => Failure::Stalled { hung: *hung },
            other => Failure::Io(format!("{other:#}").into()),
        }
    }

    /// What the intents behind the one that failed with `self` get: they were not being
    /// written, so a hung child is a stall for them, not their own timeout.
    fn behind(&self) -> Failure {
        match self {
            Failure::Timeout(_) | Failure::Stalled { hung: true } => Failure::Stalled { hung: true },
            other => other.clone(),
        }
    }

    fn error(self) -> ProcessError {
        match self {
            Failure::Timeout(t) => ProcessError::Timeout(t),
            Failure::Stalled { hung } => ProcessError::Stalled { hung },
            Failure::Io(message) => ProcessError::Io(anyhow::anyhow!("{message}")),
        }
    }
}

impl Intent {
    fn set(&self, stage: Stage) {
        let waker = {
            let mut state = lock(&self.state);
            state.stage = stage;
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// The intent is written whole with sequence number `seq`: its owner is woken, or, gone,
    /// its reply slot abandoned.
    fn written(&self, seq: u64, shared: &Shared) {
        let (gone, waker) = {
            let mut state = lock(&self.state);
            state.stage = Stage::Written(seq);
            (state.owner_gone, state.waker.take())
        };
        if gone {
            lock(&shared.replies).abandon(seq);
        } else if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// What a queued request's wait for its write ends with.
pub(crate) enum WriteTurn<G> {
    /// Written whole (by this request or another) with this sequence number.
    Written(u64),
    /// The stdin lock, with this request still queued: the holder writes the queue.
    Writer(G),
}

/// A request's place in its child's write queue, held by the request's own future; dropped
/// before the request has its sequence number, it withdraws the request (see the module doc).
pub(crate) struct Queued<'a> {
    intent: Arc<Intent>,
    shared: &'a Shared,
    /// The caller has the sequence number and its reply slot (a `Claim`).
    settled: bool,
}

impl WriteQueue {
    /// Queues `request` for the child's stdin.
    pub(crate) fn push<'a>(&self, shared: &'a Shared, request: &Arc<Request>) -> Queued<'a> {
        let intent = Arc::new(Intent {
            request: Arc::clone(request),
            state: Mutex::new(IntentState { stage: Stage::Queued, waker: None, owner_gone: false }),
        });
        lock(&self.intents).push_back(Arc::clone(&intent));
        Queued { intent, shared, settled: false }
    }

    /// Intents queued and not withdrawn (tests).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.intents).iter().filter(|i| matches!(lock(&i.state).stage, Stage::Queued)).count()
    }
}

impl Queued<'_> {
    /// Whether the intent is still in the queue.
    fn stage(&self) -> Stage {
        lock(&self.intent.state).stage.clone()
    }

    /// Waits until this request is written (its sequence number), fails, or holds the stdin
    /// lock with its request still queued (the guard: the caller writes the queue with a
    /// [`Batch`] and calls again).
    ///
    /// Behind a child that makes no progress for the stall window, or past `queue_deadline`,
    /// a request still queued leaves ([`ProcessError::Stalled`], [`ProcessError::QueueTimeout`]);
    /// one in a writer's batch waits for the writer's verdict. The child's busy clock starts
    /// when the lock is taken with no request on the child. Cancel-safe: it only waits.
    pub(crate) async fn turn<'m, W>(
        &mut self,
        stdin: &'m tokio::sync::Mutex<PipeWriter<W>>,
        queue_deadline: Instant,
        patience: Patience,
    ) -> Result<WriteTurn<tokio::sync::MutexGuard<'m, PipeWriter<W>>>, ProcessError> {
        loop {
            match self.stage() {
                Stage::Written(seq) => {
                    self.settled = true;
                    return Ok(WriteTurn::Written(seq));
                }
                Stage::Failed(failure) => {
                    self.settled = true;
                    return Err(failure.error());
                }
                Stage::Queued | Stage::Taken | Stage::Withdrawn => {}
            }
            // A free lock is taken without a timer (the common case at low load).
            if let Ok(guard) = stdin.try_lock() {
                if let Some(turn) = self.holding(guard) {
                    return Ok(turn);
                }
                continue;
            }
            let settled = std::future::poll_fn(|cx| {
                let mut state = lock(&self.intent.state);
                match state.stage {
                    Stage::Written(_) | Stage::Failed(_) => Poll::Ready(()),
                    _ => {
                        state.waker = Some(cx.waker().clone());
                        Poll::Pending
                    }
                }
            });
            // Only a queued request can leave; one in a writer's batch waits for its verdict
            // (the writer judges the child by the request it is writing), with no timer: past
            // the stall, a timer would fire at once, again and again.
            let deadline = matches!(self.stage(), Stage::Queued)
                .then(|| self.shared.progress.stalled_at(patience).min(queue_deadline));
            let timer = async {
                match deadline {
                    Some(wake) => tokio::time::sleep_until(wake.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = settled => {}
                guard = stdin.lock() => {
                    if let Some(turn) = self.holding(guard) {
                        return Ok(turn);
                    }
                }
                () = timer => {
                    if let Some(e) = self.shared.behind_expired(Instant::now(), queue_deadline, patience) {
                        let mut state = lock(&self.intent.state);
                        if let Stage::Queued = state.stage {
                            state.stage = Stage::Withdrawn;
                            drop(state);
                            self.settled = true;
                            return Err(e);
                        }
                        // Taken into a writer's batch meanwhile: its verdict comes.
                    }
                }
            }
        }
    }

    /// With the stdin lock: the turn to write, if this request is still queued (else the lock
    /// goes back and the caller looks at the intent again).
    fn holding<G: std::ops::Deref<Target = PipeWriter<W>>, W>(&self, guard: G) -> Option<WriteTurn<G>> {
        if !matches!(self.stage(), Stage::Queued) {
            return None;
        }
        // The oldest request on the child starts its busy clock (it may have had none for
        // hours: its last progress says nothing about this request).
        if lock(&self.shared.replies).next_to_read() == guard.next_seq() {
            self.shared.progress.mark();
        }
        Some(WriteTurn::Writer(guard))
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let mut state = lock(&self.intent.state);
        state.waker = None;
        match state.stage {
            Stage::Queued => state.stage = Stage::Withdrawn,
            Stage::Taken => state.owner_gone = true,
            Stage::Written(seq) => {
                drop(state);
                lock(&self.shared.replies).abandon(seq);
            }
            Stage::Failed(_) | Stage::Withdrawn => {}
        }
    }
}

/// The queue taken by the holder of the stdin lock, being written; see the module doc.
pub(crate) struct Batch<'a, W, F: FnOnce()> {
    pub(crate) writer: &'a mut PipeWriter<W>,
    shared: &'a Shared,
    queue: &'a WriteQueue,
    /// Not yet written whole, in order; the front is being written.
    intents: VecDeque<Arc<Intent>>,
    /// How much of the front intent is written.
    at: Cursor,
    /// Runs if the batch is dropped with its front intent partly written.
    on_cancel: Option<F>,
}

impl<'a, W, F: FnOnce()> Batch<'a, W, F> {
    /// Takes every queued intent for `writer` (the holder of the stdin lock). A writer an
    /// earlier request broke fails them all. `on_cancel` runs if the batch is dropped with a
    /// request partly written.
    pub(crate) fn take(
        writer: &'a mut PipeWriter<W>,
        shared: &'a Shared,
        queue: &'a WriteQueue,
        on_cancel: Option<F>,
    ) -> Batch<'a, W, F> {
        let mut intents = VecDeque::new();
        for intent in lock(&queue.intents).drain(..) {
            let mut state = lock(&intent.state);
            if let Stage::Queued = state.stage {
                state.stage = Stage::Taken;
                drop(state);
                intents.push_back(intent);
            }
        }
        let mut batch = Batch { writer, shared, queue, intents, at: Cursor::default(), on_cancel };
        if batch.writer.broken {
            batch.fail(&ProcessError::Io(anyhow::anyhow!(
                "walredo stdin holds a partial frame of a cut-short request"
            )));
        }
        batch
    }

    /// Whether every intent of the batch is written or failed.
    pub(crate) fn finished(&self) -> bool {
        self.intents.is_empty()
    }

    /// Sequence number the front intent will take.
    pub(crate) fn seq(&self) -> u64 {
        self.writer.next_seq()
    }

    /// Bytes of the front intent written.
    pub(crate) fn written(&self) -> usize {
        self.at.written()
    }

    /// Calls `write` with the writer's pipe and the batch's unwritten bytes from the front on,
    /// as many slices as one write takes; the caller passes what it wrote to [`Batch::advance`].
    pub(crate) fn write_with<R>(&mut self, write: impl FnOnce(&mut W, &[IoSlice<'_>]) -> R) -> R {
        let mut slices = [IoSlice::new(&[]); SLICES_PER_WRITE];
        let mut filled = 0;
        for (i, intent) in self.intents.iter().enumerate() {
            if filled == slices.len() {
                break;
            }
            let at = if i == 0 { self.at } else { Cursor::default() };
            filled += intent.request.slices(&at, &mut slices[filled..]);
        }
        write(&mut self.writer.pipe, &slices[..filled])
    }

    /// `n` more bytes are written: every intent written whole takes its sequence number.
    pub(crate) fn advance(&mut self, mut n: usize) {
        while let Some(front) = self.intents.front() {
            let left = front.request.len() - self.at.written();
            if n < left {
                front.request.advance(&mut self.at, n);
                return;
            }
            n -= left;
            let Some(intent) = self.intents.pop_front() else { return };
            self.at = Cursor::default();
            intent.written(self.writer.written(), self.shared);
        }
        debug_assert_eq!(n, 0, "advanced past the end of the batch");
    }

    /// The write failed with `e`: the front intent fails with it, those behind with what it
    /// means for them ([`Failure::behind`]); a partly written front fences the writer.
    pub(crate) fn fail(&mut self, e: &ProcessError) {
        let failure = Failure::of(e);
        if self.at.written() > 0 {
            self.writer.broken = true;
        }
        self.on_cancel = None;
        if let Some(front) = self.intents.pop_front() {
            front.set(Stage::Failed(failure.clone()));
        }
        for intent in self.intents.drain(..) {
            intent.set(Stage::Failed(failure.behind()));
        }
        self.at = Cursor::default();
    }
}

impl<W, F: FnOnce()> Drop for Batch<'_, W, F> {
    fn drop(&mut self) {
        if self.intents.is_empty() {
            return;
        }
        if self.at.written() > 0 {
            // Cut short partway through a frame (the holder's future was dropped): the stream
            // is broken, and so are the requests behind it.
            self.writer.broken = true;
            if let Some(on_cancel) = self.on_cancel.take() {
                on_cancel();
            }
            let failure = Failure::Io("a request written with this one was cut short partway".into());
            for intent in self.intents.drain(..) {
                intent.set(Stage::Failed(failure.clone()));
            }
            return;
        }
        // Dropped between writes: nothing of them reached the child; back to the front of the
        // queue for the next holder, in order.
        let mut queue = lock(&self.queue.intents);
        for intent in self.intents.drain(..).rev() {
            let mut state = lock(&intent.state);
            if state.owner_gone {
                continue;
            }
            state.stage = Stage::Queued;
            drop(state);
            queue.push_front(intent);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::walredo::pipeline::ChildReply;
    use bytes::Bytes;
    use std::future::Future;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A pipe that takes at most `room` bytes in all, recording each write.
    #[derive(Default)]
    struct Sink {
        writes: Vec<Vec<u8>>,
        room: usize,
    }

    impl Sink {
        fn write(&mut self, slices: &[IoSlice<'_>]) -> usize {
            let mut out = Vec::new();
            for slice in slices {
                let take = slice.len().min(self.room - out.len());
                out.extend_from_slice(&slice[..take]);
            }
            self.room -= out.len();
            let n = out.len();
            self.writes.push(out);
            n
        }
    }

    fn request(fill: u8, len: usize) -> Arc<Request> {
        Arc::new(Request::frames(vec![fill; len]))
    }

    fn patience() -> Patience {
        Patience { timeout: Duration::from_secs(60), stall: Duration::from_secs(15) }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap()
    }

    type Stdin = tokio::sync::Mutex<PipeWriter<Sink>>;

    fn stdin(room: usize) -> Stdin {
        tokio::sync::Mutex::new(PipeWriter::new(Sink { writes: Vec::new(), room }))
    }

    async fn written(queued: &mut Queued<'_>, stdin: &Stdin) -> Result<u64, ProcessError> {
        match queued.turn(stdin, Instant::now() + Duration::from_secs(60), patience()).await? {
            WriteTurn::Written(seq) => Ok(seq),
            WriteTurn::Writer(_) => panic!("expected the request written by another"),
        }
    }

    /// The stdin lock, taken by `queued` with its request still queued.
    async fn take_lock<'m>(
        queued: &mut Queued<'_>,
        stdin: &'m Stdin,
    ) -> tokio::sync::MutexGuard<'m, PipeWriter<Sink>> {
        match queued.turn(stdin, Instant::now() + Duration::from_secs(60), patience()).await.unwrap() {
            WriteTurn::Writer(writer) => writer,
            WriteTurn::Written(_) => panic!("expected the lock with the request still queued"),
        }
    }

    /// Writes the whole batch in as many writes as the sink takes.
    fn write_all<F: FnOnce()>(batch: &mut Batch<'_, Sink, F>) {
        while !batch.finished() {
            let n = batch.write_with(|sink, slices| sink.write(slices));
            assert!(n > 0, "the sink is full");
            batch.advance(n);
        }
    }

    #[test]
    fn queued_requests_are_written_together_in_order_each_with_its_sequence_number() {
        rt().block_on(async {
            let (shared, queue, stdin) = (Shared::new(), WriteQueue::default(), stdin(usize::MAX));
            let mut queued: Vec<_> =
                (0..3u8).map(|i| queue.push(&shared, &request(i, 10 + i as usize))).collect();
            let mut writer = take_lock(&mut queued[0], &stdin).await;
            let mut batch = Batch::take(&mut writer, &shared, &queue, None::<fn()>);
            write_all(&mut batch);
            drop(batch);
            let writes = std::mem::take(&mut writer.pipe.writes);
            drop(writer);
            let expected: Vec<u8> = (0..3u8).flat_map(|i| vec![i; 10 + i as usize]).collect();
            assert_eq!(writes, vec![expected], "one write for the three requests");
            for (seq, q) in queued.iter_mut().enumerate() {
                assert_eq!(written(q, &stdin).await.unwrap(), seq as u64);
            }
            assert_eq!(queue.len(), 0);
        });
    }

    #[test]
    fn an_owner_gone_while_its_request_is_written_abandons_its_reply() {
        rt().block_on(async {
            let (shared, queue, stdin) = (Shared::new(), WriteQueue::default(), stdin(usize::MAX));
            let mut first = queue.push(&shared, &request(1, 8));
            let second = queue.push(&shared, &request(2, 8));
            let mut writer = take_lock(&mut first, &stdin).await;
            let mut batch = Batch::take(&mut writer, &shared, &queue, None::<fn()>);
            drop(second); // its future dropped while its request is in the batch
            write_all(&mut batch);
            drop(batch);
            drop(writer);
            assert_eq!(written(&mut first, &stdin).await.unwrap(), 0);
            let mut replies = lock(&shared.replies);
            replies.push(ChildReply::Page(Bytes::from_static(b"for 0")));
            replies.push(ChildReply::Page(Bytes::from_static(b"for 1")));
            assert_eq!(replies.take(1), None, "the reply of the request that left is dropped");
            assert_eq!(replies.take(0), Some(ChildReply::Page(Bytes::from_static(b"for 0"))));
            assert_eq!(replies.held(), 0);
        });
    }

    #[test]
    fn a_batch_dropped_between_writes_puts_its_requests_back_in_order() {
        rt().block_on(async {
            let (shared, queue, stdin) = (Shared::new(), WriteQueue::default(), stdin(8));
            let mut queued: Vec<_> = (0..3u8).map(|i| queue.push(&shared, &request(i, 8))).collect();
            let mut writer = take_lock(&mut queued[0], &stdin).await;
            let cancelled = AtomicBool::new(false);
            let mut batch =
                Batch::take(&mut writer, &shared, &queue, Some(|| cancelled.store(true, Ordering::Relaxed)));
            let n = batch.write_with(|sink, slices| sink.write(slices));
            batch.advance(n); // the first request whole, then the pipe is full
            drop(batch); // the holder's future dropped while it waits for room
            assert!(!writer.broken && !cancelled.load(Ordering::Relaxed), "no partial frame");
            writer.pipe.room = usize::MAX;
            drop(writer);
            assert_eq!(queue.len(), 2);
            assert_eq!(written(&mut queued[0], &stdin).await.unwrap(), 0);
            let mut writer = take_lock(&mut queued[1], &stdin).await;
            let mut batch = Batch::take(&mut writer, &shared, &queue, None::<fn()>);
            write_all(&mut batch);
            drop(batch);
            assert_eq!(writer.pipe.writes[1], [vec![1u8; 8], vec![2u8; 8]].concat());
            drop(writer);
            assert_eq!(written(&mut queued[1], &stdin).await.unwrap(), 1);
            assert_eq!(written(&mut queued[2], &stdin).await.unwrap(), 2);
        });
    }

    #[test]
    fn a_batch_cut_partway_through_a_request_fences_the_writer_and_fails_the_rest() {
        rt().block_on(async {
            let (shared, queue, stdin) = (Shared::new(), WriteQueue::default(), stdin(8 + 3));
            let mut queued: Vec<_> = (0..3u8).map(|i| queue.push(&shared, &request(i, 8))).collect();
            let mut writer = take_lock(&mut queued[0], &stdin).await;
            let cancelled = AtomicBool::new(false);
            let mut batch =
                Batch::take(&mut writer, &shared, &queue, Some(|| cancelled.store(true, Ordering::Relaxed)));
            let n = batch.write_with(|sink, slices| sink.write(slices));
            batch.advance(n); // the first whole, 3 bytes of the second
            drop(batch);
            assert!(writer.broken && cancelled.load(Ordering::Relaxed));
            drop(writer);
            assert_eq!(written(&mut queued[0], &stdin).await.unwrap(), 0);
            for q in &mut queued[1..] {
                assert!(matches!(written(q, &stdin).await, Err(ProcessError::Io(_))));
            }
            // A request queued later finds the stream broken and writes nothing.
            let mut later = queue.push(&shared, &request(9, 8));
            let mut writer = take_lock(&mut later, &stdin).await;
            let batch = Batch::take(&mut writer, &shared, &queue, None::<fn()>);
            assert!(batch.finished());
            drop(batch);
            assert_eq!(writer.pipe.writes.len(), 1, "nothing follows the partial frame");
            drop(writer);
            assert!(matches!(written(&mut later, &stdin).await, Err(ProcessError::Io(_))));
        });
    }

    #[test]
    fn a_hang_times_the_request_being_written_out_and_moves_the_rest() {
        rt().block_on(async {
            let (shared, queue, stdin) = (Shared::new(), WriteQueue::default(), stdin(3));
            let mut queued: Vec<_> = (0..3u8).map(|i| queue.push(&shared, &request(i, 8))).collect();
            let mut writer = take_lock(&mut queued[0], &stdin).await;
            let mut batch = Batch::take(&mut writer, &shared, &queue, None::<fn()>);
            let n = batch.write_with(|sink, slices| sink.write(slices));
            batch.advance(n); // 3 bytes of the first, then the child is hung
            batch.fail(&ProcessError::Timeout(Duration::from_secs(60)));
            drop(batch);
            assert!(writer.broken);
            drop(writer);
            assert!(matches!(written(&mut queued[0], &stdin).await, Err(ProcessError::Timeout(_))));
            for q in &mut queued[1..] {
                assert!(matches!(written(q, &stdin).await, Err(ProcessError::Stalled { hung: true })));
            }
        });
    }

    #[test]
    fn a_stall_before_any_byte_moves_the_whole_batch_without_fencing() {
        rt().block_on(async {
            let (shared, queue, stdin) = (Shared::new(), WriteQueue::default(), stdin(0));
            let mut queued: Vec<_> = (0..2u8).map(|i| queue.push(&shared, &request(i, 8))).collect();
            let mut writer = take_lock(&mut queued[0], &stdin).await;
            let mut batch = Batch::take(&mut writer, &shared, &queue, None::<fn()>);
            batch.fail(&ProcessError::Stalled { hung: false });
            drop(batch);
            assert!(!writer.broken);
            drop(writer);
            for q in &mut queued {
                assert!(matches!(written(q, &stdin).await, Err(ProcessError::Stalled { hung: false })));
            }
        });
    }

    #[test]
    fn a_request_in_a_stalled_writers_batch_waits_for_its_verdict_without_spinning() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        rt().block_on(async {
            let (shared, queue, stdin) = (Shared::new(), WriteQueue::default(), stdin(0));
            let patience = Patience { timeout: Duration::from_secs(60), stall: Duration::from_millis(20) };
            let far = Instant::now() + Duration::from_secs(60);
            let mut first = queue.push(&shared, &request(0, 8));
            let mut second = queue.push(&shared, &request(1, 8));
            let WriteTurn::Writer(mut writer) = first.turn(&stdin, far, patience).await.unwrap() else {
                panic!("the first request takes the free lock")
            };
            let mut batch = Batch::take(&mut writer, &shared, &queue, None::<fn()>);
            tokio::time::sleep(Duration::from_millis(40)).await; // the child is stalled now
            let count = Arc::new(Count(std::sync::atomic::AtomicUsize::new(0)));
            let waker = Waker::from(Arc::clone(&count));
            let mut cx = std::task::Context::from_waker(&waker);
            let mut turn = std::pin::pin!(second.turn(&stdin, far, patience));
            assert!(turn.as_mut().poll(&mut cx).is_pending());
            assert_eq!(count.0.load(Ordering::Relaxed), 0, "it waits without waking itself");
            batch.fail(&ProcessError::Stalled { hung: false }); // the writer's verdict
            assert!(count.0.load(Ordering::Relaxed) > 0);
            let Poll::Ready(verdict) = turn.as_mut().poll(&mut cx) else { panic!("the verdict is in") };
            assert!(matches!(verdict, Err(ProcessError::Stalled { hung: false })));
        });
    }

    #[test]
    fn a_queued_request_leaves_a_stalled_child_while_another_holds_the_lock() {
        rt().block_on(async {
            let (shared, queue, stdin) = (Shared::new(), WriteQueue::default(), stdin(0));
            let holder = stdin.lock().await; // a writer stuck on a full pipe
            let mut queued = queue.push(&shared, &request(1, 8));
            let patience = Patience { timeout: Duration::from_millis(400), stall: Duration::from_millis(50) };
            let turn = queued.turn(&stdin, Instant::now() + Duration::from_secs(60), patience).await;
            assert!(matches!(turn, Err(ProcessError::Stalled { hung: false })));
            assert_eq!(queue.len(), 0, "withdrawn: no later writer writes it");
            drop(holder);
        });
    }
}
