//! The daemon-wide redo memory budget (`walredo_memory_budget`): bytes read for page
//! reconstruction and not yet done with, shared by every tenant's GetPage requests and by the
//! compactors' page images.
//!
//! Every GetPage that rebuilds a page reserves and releases room here, on whichever executor
//! thread serves it, so the common case (room to spare) is one compare-and-swap of one shared
//! word to reserve and one subtraction to release: no lock, no timer, no clock read, no
//! reference count, and the `used_bytes` gauge is that same word, read at each scrape. Only a
//! reservation that finds no room waits: in line behind those already waiting (a tokio mutex,
//! which is fair), the first of them on a notification that room was given back. While any
//! waits, new reservations queue behind it instead of taking room first, so a large request is
//! not overtaken for ever by small ones. Two threads reserving and releasing at once took 607 ns
//! a pair through the tokio semaphore and gauge this replaces (`benches/bench_shared_lines.rs`).
//!
//! Invariant: bytes reserved <= the budget, except that one request larger than the whole
//! budget takes all of it (it runs alone rather than never).
//! Invariant: a release while anyone waits wakes the first waiter, which checks for room only
//! after it registered for the wake-up, so no release is missed.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, Notify};

use crate::util::Counted;

/// No room was reserved: the budget stayed full for its whole wait.
#[derive(Debug, thiserror::Error)]
#[error(
    "the daemon's redo memory budget (walredo_memory_budget) had no room for this request's {bytes} bytes within {waited:?}"
)]
pub struct Overloaded {
    pub bytes: u64,
    pub waited: Duration,
}

/// Default of `walredo_memory_budget`.
pub const DEFAULT_REDO_MEMORY_BUDGET: u64 = 256 << 20;

/// The daemon-wide budget of bytes read for page reconstruction and not yet done with: a
/// GetPage reserves what it will read (image and records, known from the index) before reading,
/// and holds it until its page is built. See the module doc.
pub struct RedoBudget {
    /// Bytes reserved now; what the `used_bytes` gauge reads.
    used: Arc<AtomicU64>,
    total: u64,
    /// Reservations waiting for room (queued for `turn` or holding it).
    waiting: AtomicUsize,
    /// The waiters' line: the holder is the next to take room.
    turn: Mutex<()>,
    /// Room was given back while someone waited.
    freed: Notify,
    /// Longest wait for room (`wal_redo_timeout`); then the request fails [`Overloaded`].
    wait: Duration,
}

/// Bytes reserved in the [`RedoBudget`], given back on drop.
#[derive(Debug)]
pub struct Reservation<'a> {
    budget: &'a RedoBudget,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let budget = self.budget;
        // SeqCst with the waiter's increment and check: either this sees it waiting, or it
        // sees the room given back here.
        budget.used.fetch_sub(self.bytes, Ordering::SeqCst);
        if budget.waiting.load(Ordering::SeqCst) > 0 {
            budget.freed.notify_waiters();
        }
    }
}

impl std::fmt::Debug for RedoBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedoBudget").field("used", &self.in_use()).field("total", &self.total).finish()
    }
}

impl RedoBudget {
    /// A budget of `bytes` (at least 1) whose bytes in use are kept in `used` (a gauge's
    /// value, e.g. [`crate::metrics::sharded::ReadGauge`]).
    pub fn new(bytes: u64, wait: Duration, used: Arc<AtomicU64>) -> RedoBudget {
        used.store(0, Ordering::Relaxed);
        RedoBudget {
            used,
            total: bytes.max(1),
            waiting: AtomicUsize::new(0),
            turn: Mutex::new(()),
            freed: Notify::new(),
            wait,
        }
    }

    /// Reserves `bytes` (at most the whole budget), waiting for room up to the budget's wait.
    ///
    /// Cancel-safe: dropped while waiting, nothing is reserved.
    pub async fn reserve(&self, bytes: u64) -> Result<Reservation<'_>, Overloaded> {
        let want = bytes.clamp(1, self.total);
        if self.waiting.load(Ordering::SeqCst) == 0 && self.try_take(want) {
            return Ok(Reservation { budget: self, bytes: want });
        }
        self.reserve_in_line(want).await.map_err(|()| Overloaded { bytes, waited: self.wait })
    }

    /// The slow path of [`RedoBudget::reserve`]: in line behind the reservations already
    /// waiting, then until room is given back, up to the budget's wait.
    async fn reserve_in_line(&self, want: u64) -> Result<Reservation<'_>, ()> {
        let _waiting = Counted::new(&self.waiting);
        let in_line = async {
            let _turn = self.turn.lock().await;
            loop {
                let freed = self.freed.notified();
                tokio::pin!(freed);
                // Registered before the check: a release after it wakes this one.
                freed.as_mut().enable();
                if self.try_take(want) {
                    return;
                }
                freed.await;
            }
        };
        // The timeout polls `in_line` first: room taken is never dropped by the timer.
        match tokio::time::timeout(self.wait, in_line).await {
            Ok(()) => Ok(Reservation { budget: self, bytes: want }),
            Err(_) => Err(()),
        }
    }

    /// Takes `want` bytes if they fit now.
    fn try_take(&self, want: u64) -> bool {
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                (used + want <= self.total).then_some(used + want)
            })
            .is_ok()
    }

    /// Bytes reserved now.
    pub fn in_use(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use futures_util::FutureExt;

    fn budget(bytes: u64, wait: Duration) -> RedoBudget {
        RedoBudget::new(bytes, wait, Arc::new(AtomicU64::new(0)))
    }

    #[tokio::test]
    async fn redo_budget_makes_requests_wait_then_refuses_them_as_overloaded() {
        let budget = budget(1 << 20, Duration::from_millis(50));
        let big = budget.reserve(600 << 10).await.unwrap();
        assert_eq!(budget.in_use(), 600 << 10);
        // Does not fit next to `big`: waits, then is refused.
        let err = budget.reserve(600 << 10).await.unwrap_err();
        assert_eq!(err.bytes, 600 << 10);
        // Fits next to it.
        let small = budget.reserve(8192).await.unwrap();
        drop((big, small));
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn redo_budget_gives_a_request_larger_than_itself_the_whole_budget() {
        let budget = Arc::new(budget(1 << 20, Duration::from_millis(50)));
        let huge = budget.reserve(12 << 20).await.unwrap();
        assert_eq!(budget.in_use(), 1 << 20);
        assert!(budget.reserve(1).await.is_err());
        drop(huge);
        let waiting = tokio::spawn({
            let budget = Arc::clone(&budget);
            async move { budget.reserve(1 << 20).await.map(drop) }
        });
        waiting.await.unwrap().unwrap();
    }

    /// While a large request waits for room, a small one that would fit queues behind it
    /// instead of taking the room first; both get theirs once room is given back.
    #[tokio::test]
    async fn a_small_request_does_not_overtake_a_waiting_large_one() {
        let budget = Arc::new(budget(1 << 20, Duration::from_secs(30)));
        let first = budget.reserve(600 << 10).await.unwrap();
        let large = tokio::spawn({
            let budget = Arc::clone(&budget);
            async move { budget.reserve(600 << 10).await.map(|r| r.bytes) }
        });
        while budget.waiting.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // 8 KiB fits next to `first`, but the large request came before it.
        let small = budget.reserve(8 << 10);
        tokio::pin!(small);
        assert!(small.as_mut().now_or_never().is_none(), "the small request overtook the large one");
        drop(first);
        assert_eq!(large.await.unwrap().unwrap(), 600 << 10);
        let small = small.await.unwrap();
        assert_eq!(budget.in_use(), 8 << 10);
        drop(small);
        assert_eq!(budget.in_use(), 0);
    }

    /// Many tasks on several threads reserving and releasing at once: every one gets its room
    /// (no release is missed by a waiter), the budget is never exceeded, and all of it comes
    /// back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_tasks_at_once_never_exceed_the_budget_and_all_get_room() {
        let budget = Arc::new(budget(100 << 10, Duration::from_secs(30)));
        let tasks: Vec<_> = (0..16u64)
            .map(|t| {
                let budget = Arc::clone(&budget);
                tokio::spawn(async move {
                    for i in 0..500u64 {
                        let bytes = ((t * 7919 + i * 104_729) % (40 << 10)) + 1;
                        let reserved = budget.reserve(bytes).await.unwrap();
                        assert!(budget.in_use() <= 100 << 10, "{} in use", budget.in_use());
                        if i % 3 == 0 {
                            tokio::task::yield_now().await;
                        }
                        drop(reserved);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(budget.in_use(), 0);
        assert_eq!(budget.waiting.load(Ordering::SeqCst), 0);
    }
}
