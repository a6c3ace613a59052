//! Small pieces that modules of every layer share, and that belong to none of them.
//!
//! Invariant: depends on nothing in this crate (the bottom layer of ARCHITECTURE.md's table).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// Locks a std mutex, taking the guard even if a panicking thread poisoned it: the data behind
/// every mutex of this crate stays consistent between statements (no invariant is broken across
/// a call that can panic), so a panic elsewhere must not turn into panics here.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A one-way signal that many tasks watch (shutdown, a tenant stopping): raised once, never
/// lowered. Checking it is one atomic load, and a waiting task registers its waker once, not
/// at every poll. (A `CancellationToken` locks a mutex shared by all its clones at every check
/// and every poll of `cancelled()`, and its `Notify` another: with every connection of a busy
/// daemon polling it per request, two locks that every core takes.)
#[derive(Default)]
pub(crate) struct Signal {
    raised: AtomicBool,
    /// The wakers of the watches waiting, by watch number; taken when raised.
    waiters: Mutex<HashMap<u64, Waker>>,
    next: AtomicU64,
}

impl Signal {
    pub(crate) fn raise(&self) {
        self.raised.store(true, Ordering::Release);
        let waiters = std::mem::take(&mut *lock(&self.waiters));
        for waker in waiters.into_values() {
            waker.wake();
        }
    }

    pub(crate) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// A watch for one task to wait with.
    pub(crate) fn watch(self: &Arc<Self>) -> Watch {
        Watch { signal: Arc::clone(self), id: self.next.fetch_add(1, Ordering::Relaxed), waker: None }
    }
}

/// One task's wait for a [`Signal`] (see [`Watch::raised`]).
pub(crate) struct Watch {
    signal: Arc<Signal>,
    id: u64,
    /// The waker registered with the signal, if any.
    waker: Option<Waker>,
}

impl Watch {
    /// Ready once the signal is raised. Cancel-safe; the waker stays registered until the
    /// watch is dropped, and is registered again only when the task's waker changes.
    pub(crate) async fn raised(&mut self) {
        std::future::poll_fn(|cx| self.poll_raised(cx)).await
    }

    fn poll_raised(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.signal.is_raised() {
            return Poll::Ready(());
        }
        if !self.waker.as_ref().is_some_and(|waker| waker.will_wake(cx.waker())) {
            lock(&self.signal.waiters).insert(self.id, cx.waker().clone());
            self.waker = Some(cx.waker().clone());
        }
        // Raised between the first look and the registration: `raise` may have taken the
        // waiters before this one was in.
        if self.signal.is_raised() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if self.waker.is_some() {
            lock(&self.signal.waiters).remove(&self.id);
        }
    }
}

/// One of a count of things in progress (requests waiting, say) while it lives: added on
/// creation, taken off on drop. `SeqCst`, for counts read across threads to decide whether to
/// wake anyone.
pub(crate) struct Counted<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> Counted<'a> {
    pub(crate) fn new(count: &'a std::sync::atomic::AtomicUsize) -> Counted<'a> {
        count.fetch_add(1, Ordering::SeqCst);
        Counted(count)
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `tokio::time::timeout_at(deadline(), future)`, but with no timer for a future that is done
/// at its first poll (the common case where the request paths use it: a reply batch the socket
/// takes at once, a pipe ready at once). Making a tokio timer reads the clock and clones the
/// runtime's handle (a reference count that every executor thread writes), and registering one
/// takes the runtime's one timer lock. `None` if `deadline` passed first.
pub(crate) async fn timeout_if_pending<F: std::future::Future>(
    deadline: impl FnOnce() -> tokio::time::Instant,
    future: F,
) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    if let Poll::Ready(output) = std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await {
        return Some(output);
    }
    tokio::time::timeout_at(deadline(), future).await.ok()
}

/// Work an executor thread puts off until it runs out of tasks: the page service's io_uring
/// writer queues the reply batches of the connections that ran on a thread and submits them all
/// at once when the thread is about to sleep (what Valkey does before it sleeps), instead of a
/// syscall per batch.
///
/// Putting work off is sound only on a thread that is sure to run [`before_park`] before it
/// sleeps: an executor thread of a runtime built with it as `on_thread_park`, from its first
/// park on ([`defers`]), and not after [`block_in_place`] (whose thread may give its worker up
/// and never park as one again) until its next park. Elsewhere (a runtime without the hook,
/// `block_on`'s thread, the blocking pool) the work is done at once.
pub mod park {
    use std::cell::{Cell, RefCell};
    use std::sync::Arc;

    /// What a thread runs before it sleeps.
    pub trait Flush: Send + Sync {
        fn flush(&self);
    }

    thread_local! {
        /// This thread runs [`before_park`] before it sleeps, until it blocks.
        static DEFERS: Cell<bool> = const { Cell::new(false) };
        static FLUSHES: RefCell<Vec<Arc<dyn Flush>>> = const { RefCell::new(Vec::new()) };
    }

    /// The runtime's `on_thread_park` hook: runs this thread's flushes; from now on, work may
    /// be put off on this thread.
    pub fn before_park() {
        DEFERS.set(true);
        run_flushes();
    }

    /// Whether work put off on this thread is sure to be done before the thread sleeps.
    pub fn defers() -> bool {
        DEFERS.get()
    }

    /// Has this thread run `flush` before it sleeps (and before it blocks), for as long as the
    /// thread lives.
    pub fn register(flush: Arc<dyn Flush>) {
        // Not while the thread's storage is torn down (the thread then never parks again).
        let _ = FLUSHES.try_with(|flushes| flushes.borrow_mut().push(flush));
    }

    fn run_flushes() {
        let _ = FLUSHES.try_with(|flushes| flushes.borrow().iter().for_each(|flush| flush.flush()));
    }

    /// Runs `f`, which blocks its thread, without stalling the other tasks of a multi-thread
    /// runtime (`tokio::task::block_in_place`); what this thread put off is done first, and
    /// nothing is put off on it again until it parks as an executor thread.
    pub fn block_in_place<R>(f: impl FnOnce() -> R) -> R {
        match tokio::runtime::Handle::try_current() {
            Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                run_flushes();
                DEFERS.set(false);
                tokio::task::block_in_place(f)
            }
            _ => f(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A future done at its first poll needs no timer: it passes on a runtime without one
    /// (where making a timer panics); the others time out, or finish, as with `timeout_at`.
    #[test]
    fn timeout_if_pending_makes_no_timer_for_a_future_done_at_once() {
        let no_timers = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let done =
            no_timers.block_on(timeout_if_pending(|| unreachable!("no deadline is needed"), async { 7 }));
        assert_eq!(done, Some(7));
        let timers = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let soon = || tokio::time::Instant::now() + std::time::Duration::from_millis(20);
        assert_eq!(timers.block_on(timeout_if_pending(soon, std::future::pending::<()>())), None);
        let later = async {
            tokio::task::yield_now().await;
            8
        };
        assert_eq!(timers.block_on(timeout_if_pending(soon, later)), Some(8));
    }

    #[tokio::test]
    async fn a_signal_wakes_every_watch_waiting_and_stays_raised() {
        let signal = Arc::new(Signal::default());
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let mut watch = signal.watch();
                tokio::spawn(async move { watch.raised().await })
            })
            .collect();
        tokio::task::yield_now().await;
        let mut late = signal.watch();
        // Not raised: a poll registers and waits.
        assert!(futures_util::FutureExt::now_or_never(late.raised()).is_none());
        assert!(!signal.is_raised());
        signal.raise();
        for task in waiting {
            tokio::time::timeout(std::time::Duration::from_secs(5), task).await.unwrap().unwrap();
        }
        late.raised().await;
        signal.watch().raised().await;
        assert!(signal.is_raised());
        assert!(lock(&signal.waiters).is_empty(), "raising takes the waiters");
    }

    #[tokio::test]
    async fn a_dropped_watch_leaves_no_waker_behind() {
        let signal = Arc::new(Signal::default());
        let mut watch = signal.watch();
        assert!(futures_util::FutureExt::now_or_never(watch.raised()).is_none());
        assert_eq!(lock(&signal.waiters).len(), 1);
        drop(watch);
        assert!(lock(&signal.waiters).is_empty());
    }
}
