//! Priority of foreground (GetPage) redo over background redo (a compactor materializing pages),
//! per manager.
//!
//! Why: a child answers in the order requests were written, so whatever a background request
//! writes ahead of a GetPage request adds its redo time to that GetPage's latency. Background
//! work can wait; a client cannot.
//!
//! The mechanism is one count and one wake-up, in front of the child's writer, shared by both
//! process kinds (the count one atomic word, so that the GetPage path takes no lock here):
//! - every foreground attempt holds a [`WriteTicket`] from before it looks for a child (so a
//!   request waiting for a spawn counts) until its request is written whole (by itself or by
//!   the request holding the writer lock: `write_queue.rs`), or failed. The count of tickets is
//!   the foreground writer queue;
//! - a background request first takes the manager's one background slot (a fair async mutex:
//!   background requests go one at a time, in arrival order, and the slot is held until the
//!   request is answered), then waits for its turn ([`Priority::yield_to_foreground`]).
//!
//! **The rule:** a background request holding the slot goes as soon as the foreground writer
//! queue is empty, or has been empty at some moment since it started waiting (a closed-loop
//! GetPage load empties it between requests, even if the next one arrives before the background
//! task runs), or after waiting `max_defer` (the manager passes `wal_redo_timeout`) at the latest,
//! so that an overload with a queue that never empties cannot starve it forever. When it goes,
//! it joins the child's write queue, which is written in order (FIFO): it never overtakes a
//! foreground request already queued there.
//!
//! Invariants:
//! - a foreground request waits behind at most one background request (the slot);
//! - waiting here blocks no thread, and is cancel-safe: dropping a waiting background request
//!   releases its place (and the slot) at once; dropping a ticket can only end a wait;
//! - nothing here touches a child: a waiting background request neither spawns a child nor
//!   keeps an idle one alive.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

use crate::util::Counted;

/// The foreground count's bits of [`Priority::queue`]; the bits above count its emptyings.
const COUNT: u64 = u32::MAX as u64;
/// One emptying of the foreground writer queue, in [`Priority::queue`].
const EMPTIED: u64 = COUNT + 1;

/// One manager's foreground writer queue and background slot.
///
/// Every foreground attempt enters and leaves the queue, on whichever thread serves it: both
/// are one atomic operation on one word (no lock), and the leaving notifies only while a
/// request waits for the queue to empty ([`Priority::yield_to_foreground`]).
pub(crate) struct Priority {
    /// Foreground attempts queued for (or holding) the writer, or waiting for a child to write
    /// to (the low 32 bits), and how many times that count went down to zero (the high 32
    /// bits, wrapping): one word, so that a leaving that empties the queue counts the emptying
    /// in the same step.
    queue: AtomicU64,
    /// Requests in [`Priority::yield_to_foreground`], waiting on `emptied`.
    yielding: AtomicUsize,
    /// Notified (all waiters) each time the foreground writer queue becomes empty while a
    /// request yields.
    emptied: Notify,
    /// Background requests waiting for the slot or for their turn.
    background_waiting: AtomicUsize,
    /// The one background request in flight. A tokio mutex: held across the whole request, and
    /// fair, so background requests take their turns in arrival order.
    background: tokio::sync::Mutex<()>,
}

impl Priority {
    pub(crate) fn new() -> Priority {
        Priority {
            queue: AtomicU64::new(0),
            yielding: AtomicUsize::new(0),
            emptied: Notify::new(),
            background_waiting: AtomicUsize::new(0),
            background: tokio::sync::Mutex::new(()),
        }
    }

    /// A foreground attempt enters the writer queue; it leaves it when the ticket drops.
    pub(crate) fn foreground(&self) -> WriteTicket<'_> {
        self.queue.fetch_add(1, Ordering::SeqCst);
        WriteTicket(Some(self))
    }

    /// Waits for the manager's background slot, then for the turn of its holder
    /// ([`Priority::yield_to_foreground`]); the slot is held until the returned turn drops.
    ///
    /// Cancel-safe: dropped while it waits, it holds nothing.
    pub(crate) async fn background_turn(&self, max_defer: Duration) -> BackgroundTurn<'_> {
        let _waiting = Counted::new(&self.background_waiting);
        let slot = self.background.lock().await;
        self.yield_to_foreground(max_defer).await;
        BackgroundTurn { _slot: slot }
    }

    /// Waits while foreground requests are queued for the writer: returns once the queue is
    /// empty or has been empty at some moment since the call, or after `max_defer`.
    ///
    /// Cancel-safe: it only waits.
    pub(crate) async fn yield_to_foreground(&self, max_defer: Duration) {
        let deadline = tokio::time::Instant::now() + max_defer;
        // Counted before the first look at the queue (SeqCst on both sides): a ticket that
        // empties the queue after that look sees this request and notifies it.
        let _yielding = Counted::new(&self.yielding);
        let seen = self.queue.load(Ordering::SeqCst) & !COUNT;
        loop {
            let notified = self.emptied.notified();
            tokio::pin!(notified);
            // Registered before the check, so that an emptying right after it is not missed.
            notified.as_mut().enable();
            let queue = self.queue.load(Ordering::SeqCst);
            if queue & COUNT == 0 || queue & !COUNT != seen {
                return;
            }
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// Background requests waiting for the slot or their turn.
    #[cfg(test)]
    pub(crate) fn background_waiting(&self) -> usize {
        self.background_waiting.load(Ordering::SeqCst)
    }

    /// Foreground attempts in the writer queue.
    #[cfg(test)]
    pub(crate) fn foreground_queued(&self) -> usize {
        (self.queue.load(Ordering::SeqCst) & COUNT) as usize
    }
}

/// A foreground attempt's place in the writer queue (see the module doc), or no place (a
/// background request, which is held back before it looks for a child instead).
pub(crate) struct WriteTicket<'a>(Option<&'a Priority>);

impl WriteTicket<'_> {
    /// The ticket of a request that does not count in the foreground writer queue.
    pub(crate) fn none() -> WriteTicket<'static> {
        WriteTicket(None)
    }
}

impl Drop for WriteTicket<'_> {
    fn drop(&mut self) {
        let Some(priority) = self.0 else { return };
        // The last one out counts the emptying in the same step.
        let left =
            priority.queue.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |queue| match queue & COUNT {
                0 => None,
                1 => Some((queue & !COUNT).wrapping_add(EMPTIED)),
                _ => Some(queue - 1),
            });
        let emptied = matches!(left, Ok(queue) if queue & COUNT == 1);
        if emptied && priority.yielding.load(Ordering::SeqCst) > 0 {
            priority.emptied.notify_waiters();
        }
    }
}

/// The background slot, held by the one background request in flight.
pub(crate) struct BackgroundTurn<'a> {
    _slot: tokio::sync::MutexGuard<'a, ()>,
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;

    use super::*;

    const LONG: Duration = Duration::from_secs(60);

    /// Polls `future` once; whether it finished.
    async fn poll_once<F: Future + Unpin>(future: &mut F) -> bool {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx).is_ready())).await
    }

    /// Foreground tickets taken and dropped on several threads at once, the queue emptying
    /// now and then: every yield returns within a few seconds (none misses the emptying it
    /// waits for, which would hold it for `LONG`), and the count ends at zero.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn yields_see_every_emptying_while_tickets_come_and_go_on_many_threads() {
        let priority = std::sync::Arc::new(Priority::new());
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let foreground: Vec<_> = (0..3)
            .map(|t| {
                let (priority, stop) = (std::sync::Arc::clone(&priority), std::sync::Arc::clone(&stop));
                tokio::spawn(async move {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let ticket = priority.foreground();
                        if (i + t) % 4 == 0 {
                            tokio::task::yield_now().await;
                        }
                        drop(ticket);
                        i += 1;
                        if i % 64 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                })
            })
            .collect();
        for _ in 0..500 {
            let yielded =
                tokio::time::timeout(Duration::from_secs(5), priority.yield_to_foreground(LONG)).await;
            assert!(yielded.is_ok(), "a yield missed the queue's emptying");
        }
        stop.store(true, Ordering::Relaxed);
        for task in foreground {
            task.await.unwrap();
        }
        assert_eq!(priority.foreground_queued(), 0);
        assert_eq!(priority.yielding.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn background_goes_at_once_without_foreground_requests() {
        let priority = Priority::new();
        let mut turn = Box::pin(priority.background_turn(LONG));
        assert!(poll_once(&mut turn).await);
        assert_eq!(priority.background_waiting(), 0);
    }

    #[tokio::test]
    async fn background_waits_while_a_foreground_request_is_queued_to_write() {
        let priority = Priority::new();
        let ticket = priority.foreground();
        let mut turn = Box::pin(priority.background_turn(LONG));
        assert!(!poll_once(&mut turn).await);
        tokio::task::yield_now().await;
        assert!(!poll_once(&mut turn).await, "went with a foreground request queued");
        assert_eq!(priority.background_waiting(), 1);
        drop(ticket);
        assert!(poll_once(&mut turn).await, "the queue emptied but the background request waits");
    }

    #[tokio::test]
    async fn background_goes_if_the_queue_emptied_even_if_refilled_before_it_looked() {
        let priority = Priority::new();
        let first = priority.foreground();
        let mut turn = Box::pin(priority.background_turn(LONG));
        assert!(!poll_once(&mut turn).await);
        drop(first);
        // The next request of a closed loop arrives before the background task runs.
        let _second = priority.foreground();
        assert!(poll_once(&mut turn).await, "starved by a closed-loop foreground load");
    }

    #[tokio::test]
    async fn background_goes_after_max_defer_under_a_queue_that_never_empties() {
        // Real time (the crate's tokio has no paused clock): only a lower bound is asserted,
        // which a timer cannot break, and a generous deadline against starvation.
        let max_defer = Duration::from_millis(100);
        let priority = Priority::new();
        let mut tickets = vec![priority.foreground(), priority.foreground()];
        let started = std::time::Instant::now();
        let mut turn = Box::pin(priority.background_turn(max_defer));
        // The queue turns over but is never empty.
        while !poll_once(&mut turn).await {
            tokio::time::sleep(Duration::from_millis(5)).await;
            tickets.push(priority.foreground());
            tickets.remove(0);
            assert!(started.elapsed() < Duration::from_secs(30), "starved");
        }
        assert!(started.elapsed() >= max_defer, "went after {:?}, before its bound", started.elapsed());
        assert_eq!(priority.foreground_queued(), 2);
    }

    #[tokio::test]
    async fn one_background_request_at_a_time_in_arrival_order() {
        let priority = Priority::new();
        let first = priority.background_turn(LONG).await;
        let mut second = Box::pin(priority.background_turn(LONG));
        let mut third = Box::pin(priority.background_turn(LONG));
        assert!(!poll_once(&mut second).await);
        assert!(!poll_once(&mut third).await);
        assert_eq!(priority.background_waiting(), 2);
        drop(first);
        assert!(!poll_once(&mut third).await, "overtook an earlier background request");
        let Poll::Ready(second) = futures_poll(&mut second).await else { panic!("second did not go") };
        assert!(!poll_once(&mut third).await, "two background requests in flight");
        drop(second);
        assert!(poll_once(&mut third).await);
    }

    #[tokio::test]
    async fn dropping_a_waiting_background_request_lets_the_next_one_go() {
        let priority = Priority::new();
        let ticket = priority.foreground();
        let mut first = Box::pin(priority.background_turn(LONG));
        let mut second = Box::pin(priority.background_turn(LONG));
        assert!(!poll_once(&mut first).await);
        assert!(!poll_once(&mut second).await);
        drop(first); // holds the slot, waiting for its turn
        assert_eq!(priority.background_waiting(), 1);
        assert!(!poll_once(&mut second).await, "a foreground request is still queued");
        drop(ticket);
        assert!(poll_once(&mut second).await);
        assert_eq!(priority.foreground_queued(), 0);
    }

    /// Polls `future` once, returning its output if it finished.
    async fn futures_poll<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx))).await
    }
}
