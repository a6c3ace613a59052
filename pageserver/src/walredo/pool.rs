//! A tenant's redo children: the pool the manager picks from, its size set by the adaptive
//! worker controller ([`crate::worker_controller`]), and the daemon-wide budget of children
//! beyond the first of each tenant.
//!
//! - Requests go to the child with the fewest requests in flight (ties: the oldest).
//! - The first child is spawned by the request that needs it (as with one child per tenant); the
//!   others are spawned in the background when the controller's target is above the pool size,
//!   one at a time, never on the request path, each taking a token of the [`ChildBudget`]; a
//!   child leaves one at a time when the target is below the size, only when it has nothing in
//!   flight, and gives its token back.
//! - The controller runs every [`PERIOD`] on measurements of that period: requests started and
//!   finished, the children's busy time (time with at least one request in flight), the
//!   requests' total time (so their wait beyond the busy time, and the average in flight). A
//!   pool with nothing left to decide (no request in the period, at most one child, nothing
//!   spinning) puts its controller to sleep until the next request, so that idle tenants cost
//!   no wake-ups.
//!
//! **Invariants:** a retired child is never picked; tokens held = children beyond the first
//! (`len - 1`, or 0), so the budget counts every extra child of the daemon exactly once; the
//! pool never grows past `max_pool_size`, nor past the budget.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::pipeline::Patience;
use super::process::{InUse, Process};
use crate::metrics::sharded::{ShardedSums, TENANT_SHARDS};
use crate::worker_controller::{Decision, Observation};

/// How often the controller looks at a pool.
pub const PERIOD: Duration = Duration::from_millis(100);

/// Children beyond the first of each tenant, daemon-wide: thousands of tenants must not fork
/// thousands of extra processes. The first child of a tenant needs no token (one child per
/// tenant is the baseline, stopped when idle).
#[derive(Debug)]
pub struct ChildBudget {
    cap: usize,
    used: AtomicUsize,
}

impl ChildBudget {
    pub fn new(cap: usize) -> Arc<ChildBudget> {
        Arc::new(ChildBudget { cap, used: AtomicUsize::new(0) })
    }

    /// The daemon's budget: 4 extra children per CPU.
    pub fn global() -> Arc<ChildBudget> {
        static GLOBAL: OnceLock<Arc<ChildBudget>> = OnceLock::new();
        Arc::clone(GLOBAL.get_or_init(|| ChildBudget::new(4 * cpus())))
    }

    fn try_take(&self) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| (u < self.cap).then_some(u + 1))
            .is_ok()
    }

    fn give_back(&self) {
        let _ = self.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_sub(1));
    }

    /// Tokens taken now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

/// CPUs available to the daemon (at least 1).
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Largest `walredo_pool_max`: redo children of one tenant.
pub const MAX_POOL_SIZE: usize = 64;

/// The default largest pool of a tenant: one child per CPU, at least 2 (redo is CPU work in the
/// child; more children than CPUs only queue on the CPUs instead of the pipes).
pub fn default_max_pool_size() -> usize {
    cpus().max(2)
}

/// The children in service of one tenant.
pub(crate) struct Pool {
    children: Vec<Arc<Process>>,
    /// Budget tokens held: one per child beyond the first.
    tokens: usize,
    budget: Arc<ChildBudget>,
    /// Children taken out of service because they stalled, while requests may still wait on
    /// them (until they exit: killed as hung, or drained).
    stalled: Vec<Weak<Process>>,
}

impl Pool {
    pub(crate) fn new(budget: Arc<ChildBudget>) -> Pool {
        Pool { children: Vec::new(), tokens: 0, budget, stalled: Vec::new() }
    }

    pub(crate) fn len(&self) -> usize {
        self.children.len()
    }

    pub(crate) fn children(&self) -> &[Arc<Process>] {
        &self.children
    }

    /// The least-loaded child, counted as in use; children that exited on their own leave
    /// first (they must not eat a request's one retry), and so do children that stalled
    /// (work waits on them and they made no progress for `patience.stall`): they are added to
    /// `stalled`, for the caller to retire, and no new request queues on them.
    pub(crate) fn pick(&mut self, patience: Patience, stalled: &mut Vec<Arc<Process>>) -> Option<InUse> {
        if self.children.iter().any(|p| p.has_exited()) {
            self.children.retain(|p| !p.has_exited());
            self.settle_tokens();
        }
        // Only a child with work can stall: no clock read while the pool is idle.
        if self.children.iter().any(|p| p.in_flight.load(Ordering::Relaxed) > 0) {
            let now = Instant::now();
            if self.children.iter().any(|p| p.stalled(now, patience)) {
                let (gone, kept) =
                    std::mem::take(&mut self.children).into_iter().partition(|p| p.stalled(now, patience));
                self.children = kept;
                self.settle_tokens();
                self.stalled.extend(gone.iter().map(Arc::downgrade));
                stalled.extend(gone);
            }
        }
        let best = self.children.iter().min_by_key(|p| p.in_flight.load(Ordering::Relaxed))?;
        Some(InUse::new(best))
    }

    /// Takes `process` out of service because it stalled (see [`Pool::pick`]); whether it
    /// was in service.
    pub(crate) fn remove_stalled(&mut self, process: &Arc<Process>) -> bool {
        let removed = self.remove(process);
        if removed {
            self.stalled.push(Arc::downgrade(process));
        }
        removed
    }

    /// Whether requests may be waiting on a child that makes no progress: one in service that
    /// has had work and no progress for `period`, or one taken out of service for a stall that
    /// has not exited yet.
    pub(crate) fn stuck(&mut self, now: Instant, period: Duration) -> bool {
        self.stalled.retain(|p| p.upgrade().is_some_and(|p| !p.has_exited()));
        !self.stalled.is_empty() || self.children.iter().any(|p| p.stuck_for(now, period))
    }

    /// Whether one more child may join in the background: the pool has its first child (that
    /// one is spawned by the request that needs it), is below `max`, and a budget token is
    /// free. Takes the token; the caller must then [`Pool::add`] or [`Pool::cancel_growth`].
    pub(crate) fn reserve(&mut self, max: usize) -> bool {
        if self.children.is_empty() || self.children.len() >= max {
            return false;
        }
        if !self.budget.try_take() {
            return false;
        }
        self.tokens += 1;
        true
    }

    /// A reservation that did not end in a child (the spawn failed or was not needed).
    pub(crate) fn cancel_growth(&mut self) {
        self.settle_tokens();
    }

    pub(crate) fn add(&mut self, process: Arc<Process>) {
        self.children.push(process);
        self.settle_tokens();
    }

    /// Takes `process` out of the pool; whether it was in it.
    pub(crate) fn remove(&mut self, process: &Arc<Process>) -> bool {
        let before = self.children.len();
        self.children.retain(|p| !Arc::ptr_eq(p, process));
        self.settle_tokens();
        self.children.len() < before
    }

    /// Takes out every child matching `f`.
    pub(crate) fn remove_where(&mut self, f: impl Fn(&Process) -> bool) -> Vec<Arc<Process>> {
        let (gone, kept) = std::mem::take(&mut self.children).into_iter().partition(|p| f(p));
        self.children = kept;
        self.settle_tokens();
        gone
    }

    /// Takes out the child idle the longest among those with nothing in flight, if the pool
    /// has more than `keep`.
    pub(crate) fn shrink_one(&mut self, keep: usize) -> Option<Arc<Process>> {
        if self.children.len() <= keep {
            return None;
        }
        let idle = self
            .children
            .iter()
            .filter(|p| p.in_flight.load(Ordering::Relaxed) == 0)
            .max_by_key(|p| p.idle_for())?
            .clone();
        self.remove(&idle);
        Some(idle)
    }

    /// Gives back the tokens of children that left, or takes none for the first child.
    fn settle_tokens(&mut self) {
        let wanted = self.children.len().saturating_sub(1);
        while self.tokens > wanted {
            self.tokens -= 1;
            self.budget.give_back();
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        for _ in 0..self.tokens {
            self.budget.give_back();
        }
    }
}

/// Counters the request path bumps and the controller reads once per period: in shards (at
/// most [`TENANT_SHARDS`], 1 KiB), since one busy tenant's requests are served by every
/// executor thread and each bumps them twice.
#[derive(Debug)]
pub(crate) struct Load {
    /// [`ARRIVALS`], [`COMPLETIONS`], [`REQUEST_NANOS`], [`SERVED`].
    sums: ShardedSums,
    /// The controller sleeps until the next request: nothing to measure or decide meanwhile.
    parked: AtomicBool,
    wake: tokio::sync::Notify,
}

/// Requests started, of [`Load`]'s sums.
const ARRIVALS: usize = 0;
/// Requests finished.
const COMPLETIONS: usize = 1;
/// Nanoseconds of finished requests (from taking a child to the reply).
const REQUEST_NANOS: usize = 2;
/// Requests answered (the manager's `requests_served`).
const SERVED: usize = 3;

impl Default for Load {
    fn default() -> Load {
        Load {
            sums: ShardedSums::new(4, TENANT_SHARDS),
            parked: AtomicBool::new(false),
            wake: Default::default(),
        }
    }
}

impl Load {
    /// A request starts: counted, and the controller woken if it sleeps.
    pub(crate) fn arrive(&self) {
        self.sums.add(ARRIVALS, 1);
        if self.parked.load(Ordering::Relaxed) && self.parked.swap(false, Ordering::AcqRel) {
            self.wake.notify_one();
        }
    }

    /// A request's round trip is over, after `took` on its child.
    pub(crate) fn finish(&self, took: Duration) {
        self.sums.add(REQUEST_NANOS, u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
        self.sums.add(COMPLETIONS, 1);
    }

    /// A request was answered.
    pub(crate) fn served(&self) {
        self.sums.add(SERVED, 1);
    }

    /// Requests answered so far.
    pub(crate) fn requests_served(&self) -> u64 {
        self.sums.sum(SERVED)
    }

    /// Waits for the next request (the controller of an idle pool). Cancel-safe.
    pub(crate) async fn next_arrival(&self) {
        let notified = self.wake.notified();
        tokio::pin!(notified);
        // Registered before the flag is set: an arrival in between is not lost.
        notified.as_mut().enable();
        self.parked.store(true, Ordering::Release);
        notified.await;
    }
}

/// What the controller read at the last period, to take differences from.
pub(crate) struct Sampler {
    at: Instant,
    arrivals: u64,
    completions: u64,
    request_nanos: u64,
    busy: HashMap<u32, Duration>,
}

impl Sampler {
    pub(crate) fn new() -> Sampler {
        Sampler { at: Instant::now(), arrivals: 0, completions: 0, request_nanos: 0, busy: HashMap::new() }
    }

    /// Starts the next period now, keeping the counts read so far (after the controller slept:
    /// what happened meanwhile is the next period's, but not the length of the sleep).
    pub(crate) fn restart_period(&mut self) {
        self.at = Instant::now();
    }

    /// The observation of the period since the last call; `stuck` as [`Pool::stuck`] says.
    pub(crate) fn observe(&mut self, load: &Load, children: &[Arc<Process>], stuck: bool) -> Observation {
        let now = Instant::now();
        let period = now.saturating_duration_since(self.at);
        let arrivals = load.sums.sum(ARRIVALS);
        let completions = load.sums.sum(COMPLETIONS);
        let request_nanos = load.sums.sum(REQUEST_NANOS);
        let mut busy = Duration::ZERO;
        let mut seen = HashMap::with_capacity(children.len());
        for child in children {
            let total = child.busy_time();
            // A child new in this period counts from its start (busy 0 then).
            busy += total.saturating_sub(self.busy.get(&child.pid).copied().unwrap_or_default());
            seen.insert(child.pid, total);
        }
        let requests = Duration::from_nanos(request_nanos.saturating_sub(self.request_nanos));
        let obs = Observation {
            period,
            arrivals: arrivals.saturating_sub(self.arrivals),
            completions: completions.saturating_sub(self.completions),
            busy,
            queue_wait: requests.saturating_sub(busy),
            in_flight_avg: if period.is_zero() { 0.0 } else { requests.as_secs_f64() / period.as_secs_f64() },
            workers: children.len(),
            stuck,
        };
        *self = Sampler { at: now, arrivals, completions, request_nanos, busy: seen };
        obs
    }
}

/// The controller's last look at a pool, for the tenant status.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ControllerStatus {
    /// Inputs of the last period.
    pub period_ms: f64,
    pub arrivals: u64,
    pub completions: u64,
    pub busy_ms: f64,
    pub queue_wait_ms: f64,
    pub in_flight_avg: f64,
    /// The smoothed demand (busy children asked for).
    pub demand: f64,
    /// The last decision.
    pub target_children: usize,
    pub spinning: usize,
    pub spin_us: u64,
    /// How the children wait, by [`crate::worker_controller::Wait::as_str`]: `sync` (block) or
    /// `async` (yield).
    pub path: &'static str,
}

impl ControllerStatus {
    pub(crate) fn new(obs: &Observation, demand: f64, d: &Decision) -> ControllerStatus {
        let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
        ControllerStatus {
            period_ms: ms(obs.period),
            arrivals: obs.arrivals,
            completions: obs.completions,
            busy_ms: ms(obs.busy),
            queue_wait_ms: ms(obs.queue_wait),
            in_flight_avg: (obs.in_flight_avg * 1000.0).round() / 1000.0,
            demand: (demand * 1000.0).round() / 1000.0,
            target_children: d.workers,
            spinning: d.spinning,
            spin_us: d.spin.as_micros() as u64,
            path: d.wait.as_str(),
        }
    }
}
