//! The sizing policy of a pool of workers: how many workers to keep, how many of them busy-poll
//! between requests and for how long, and whether callers should block or yield.
//!
//! Why: a fixed pool is wrong at one end or the other. One worker (one redo child per tenant
//! today) is too few under load: requests queue behind it while the CPU has room. A fixed larger
//! pool wastes CPU and memory at low load, and how its idle workers wait matters as much as how
//! many there are: a worker that sleeps between requests makes the next one pay a wake-up
//! (28-55 us for a sleeping child on this machine, against about 3 us per round trip when both
//! sides spin), and one that spins burns a CPU. Valkey's adaptive IO threads showed the shape of
//! the fix: size the pool from a smoothed measure of the load, grow at once, shrink slowly. This
//! module decides; the pool that uses it (each tenant's pool of redo children, `walredo::pool`)
//! measures one period at a time, calls [`WorkerController::update`], and spawns, retires,
//! spins or parks workers to match.
//!
//! It is generic: a "worker" is anything that serves one request at a time (a redo child now,
//! a socket writer thread later), and a "request" is one unit of its work.
//!
//! **Invariant: pure.** No I/O, no clock reads, no async, no knowledge of what a worker is: every
//! input is an [`Observation`] the caller measured over one period, so the policy is testable
//! with synthetic traces and the caller owns all side effects.
//!
//! # The policy
//!
//! **Demand** (Little's law: the average number of busy workers is arrival rate x service time,
//! which is the busy time per unit of time): `demand = busy / period`. If requests waited longer
//! for a worker than they were served (mean queue wait per completion > mean service time per
//! completion; both are per completion, so the sums are compared), one more worker pays, and
//! `demand += 1`. This is the signal for a pool whose bottleneck is local CPU: queue wait against
//! service time, as Valkey's later design adds a worker when the average queue depth is above 1.
//! Demand is capped at `max_workers`: the pool cannot be larger, and one absurd sample must not
//! hold the average up for long.
//!
//! **Smoothing** (Valkey's adaptive IO threads): `avg = max(0.8 x avg + 0.2 x demand, demand)`.
//! The average jumps up with the demand at once and decays slowly, so a pool sized for a burst
//! stays for the next burst instead of flapping.
//!
//! **Size**: `target = clamp(ceil(avg x headroom), min_workers, max_workers)` (a hair of float
//! error above an integer does not add a worker); but `min_workers` while at most one request is
//! in flight on average: one request at a time keeps one worker busy however busy it is, and a
//! second one would only take turns with it. The pool grows to the target at once (the
//! caller spawns in the background). It shrinks by one worker only once the target has stayed
//! below the current size for `shrink_after` of observed periods, and the clock then restarts:
//! a spawn costs milliseconds, so a burst grows the pool at once and an idle pool gives back one
//! worker per `shrink_after` (Valkey's later design: one per second at depth 0; .NET's thread
//! pool likewise changes its size a few times a second at most). A target back at or above the
//! current size stops the clock, and so does a period in which requests wait on a worker that
//! makes no progress (`stuck`): a hung worker's requests neither arrive nor finish, which would
//! read as no demand, and the pool never shrinks while they wait. The policy never pins the pool small to probe a no-load
//! baseline (Envoy's adaptive concurrency does, and its docs admit a burst of rejections).
//!
//! **Spin** (the round-trip floor measured here): spinning pays only while requests arrive faster
//! than the spin window covers; past it the spinner burns CPU and still goes to sleep. It pays
//! with one request at a time too: bench_walredo `short/1`, after 300 ms of load, 10-14 us with
//! both sides spinning against 21-23 us parked (a fresh runtime's first moments showed 7 us
//! parked, when the scheduler happened to put both sides on one CPU; it does not stay so). The mean
//! idle gap of a worker between requests is `gap = (period x workers - busy) / arrivals` (idle
//! worker time per request, with `workers` the live count). If there were arrivals and
//! `gap <= spin_max`: `spin = clamp(2 x gap, spin_min, spin_max)` and
//! `spinning = min(target, max_spinning)`; else `spin = 0` and `spinning = 0` (park: plain
//! blocking). A period without arrivals parks everyone at once: the pool is quiescent within one
//! period.
//!
//! **Wait** (for a pool whose caller can either block or yield; Neon measured the blocking round
//! trip faster at low concurrency and yielding better at high): `in_flight_avg < sync_below` gives
//! [`Wait::Block`], `> async_above` gives [`Wait::Yield`], in between the last one holds
//! (hysteresis); the first is `Block`. The defaults (2 and 4 requests in flight) are starting
//! points to re-measure with bench_walredo once the pool exists.
//!
//! **Invariant: no panics on input.** A zero period counts as a period of zero load (no demand,
//! no arrivals, nothing in flight, no time for the shrink clock); an `in_flight_avg` that is NaN,
//! infinite or negative counts as 0; duration and count arithmetic saturates.
//! **Invariant:** `min_workers <= workers <= max_workers`; `spinning <= min(workers,
//! max_spinning)`; `spin` is zero exactly when `spinning` is zero, else in
//! `[spin_min, spin_max]`.

use std::time::Duration;

use anyhow::{ensure, Context};

/// Default smallest pool: one worker. Stopping the last one when idle is the pool's own idle
/// timer's business, not this policy's.
pub const DEFAULT_MIN_WORKERS: usize = 1;
/// Default sizing margin above the smoothed demand.
pub const DEFAULT_HEADROOM: f64 = 1.25;
/// Default time the target must stay below the pool size before one worker goes.
pub const DEFAULT_SHRINK_AFTER: Duration = Duration::from_secs(1);
/// Default longest spin window.
pub const DEFAULT_SPIN_MAX: Duration = Duration::from_micros(200);
/// Default shortest spin window (the spin-then-block pipes measured here spun 25-200 us).
pub const DEFAULT_SPIN_MIN: Duration = Duration::from_micros(20);
/// Default concurrency below which callers block ([`Wait::Block`]).
pub const DEFAULT_SYNC_BELOW: f64 = 2.0;
/// Default concurrency above which callers yield ([`Wait::Yield`]).
pub const DEFAULT_ASYNC_ABOVE: f64 = 4.0;

/// Weight of the old average per period (Valkey's 0.8).
const AVG_KEEP: f64 = 0.8;
/// Weight of the new demand per period (Valkey's 0.2).
const AVG_NEW: f64 = 0.2;
/// Float error tolerated above an integer before `ceil` rounds up to the next worker.
const CEIL_SLACK: f64 = 1e-9;

/// How many workers may spin at once on a machine with `ncpus` CPUs: half of them, at least 1
/// (spinners beyond that take CPU from the work itself).
pub fn max_spinning_for_cpus(ncpus: usize) -> usize {
    (ncpus / 2).max(1)
}

/// The controller's settings: defaults are constants, only the caps come from the caller. Use
/// [`WorkerControllerConf::new`] and [`WorkerControllerConf::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerControllerConf {
    /// Smallest pool; >= 1.
    pub min_workers: usize,
    /// Largest pool (the caller's per-pool cap); >= `min_workers`.
    pub max_workers: usize,
    /// Margin above the smoothed demand; finite and >= 1.
    pub headroom: f64,
    /// How long the target must stay below the pool size before one worker goes; > 0.
    pub shrink_after: Duration,
    /// Longest spin window, and the longest idle gap worth spinning for; >= `spin_min`.
    pub spin_max: Duration,
    /// Shortest spin window; > 0.
    pub spin_min: Duration,
    /// How many workers may spin at once (e.g. [`max_spinning_for_cpus`]); >= 1. May exceed
    /// `max_workers` (then every worker may spin).
    pub max_spinning: usize,
    /// Average requests in flight below which callers block ([`Wait::Block`]); finite and > 0.
    pub sync_below: f64,
    /// Average requests in flight above which callers yield ([`Wait::Yield`]); finite and
    /// >= `sync_below`.
    pub async_above: f64,
}

impl WorkerControllerConf {
    /// The default settings with the caller's caps: at most `max_workers` workers, at most
    /// `max_spinning` of them spinning.
    pub fn new(max_workers: usize, max_spinning: usize) -> WorkerControllerConf {
        WorkerControllerConf {
            min_workers: DEFAULT_MIN_WORKERS,
            max_workers,
            headroom: DEFAULT_HEADROOM,
            shrink_after: DEFAULT_SHRINK_AFTER,
            spin_max: DEFAULT_SPIN_MAX,
            spin_min: DEFAULT_SPIN_MIN,
            max_spinning,
            sync_below: DEFAULT_SYNC_BELOW,
            async_above: DEFAULT_ASYNC_ABOVE,
        }
    }

    /// Checks the ranges documented on each field; the error names the field and its value.
    pub fn validate(&self) -> anyhow::Result<()> {
        let WorkerControllerConf {
            min_workers,
            max_workers,
            headroom,
            shrink_after,
            spin_max,
            spin_min,
            max_spinning,
            sync_below,
            async_above,
        } = *self;
        ensure!(min_workers >= 1, "min_workers must be >= 1, got {min_workers}");
        ensure!(
            max_workers >= min_workers,
            "max_workers must be >= min_workers ({min_workers}), got {max_workers}"
        );
        ensure!(headroom.is_finite() && headroom >= 1.0, "headroom must be finite and >= 1, got {headroom}");
        ensure!(!shrink_after.is_zero(), "shrink_after must be > 0");
        ensure!(!spin_min.is_zero(), "spin_min must be > 0");
        ensure!(spin_max >= spin_min, "spin_max ({spin_max:?}) must be >= spin_min ({spin_min:?})");
        ensure!(max_spinning >= 1, "max_spinning must be >= 1, got {max_spinning}");
        ensure!(
            sync_below.is_finite() && sync_below > 0.0,
            "sync_below must be finite and > 0, got {sync_below}"
        );
        ensure!(
            async_above.is_finite() && async_above >= sync_below,
            "async_above must be finite and >= sync_below ({sync_below}), got {async_above}"
        );
        Ok(())
    }

    /// The pool size for a smoothed demand: `clamp(ceil(avg x headroom), min_workers,
    /// max_workers)`, with a hair of float error above an integer ignored. NaN counts as 0.
    pub fn target_for(&self, avg: f64) -> usize {
        // `as` saturates, and NaN.max(0.0) is 0.
        let want = (avg * self.headroom - CEIL_SLACK).ceil().max(0.0) as usize;
        want.max(self.min_workers).min(self.max_workers)
    }
}

/// How a caller waits for a worker: it blocks the calling thread, or it yields to the reactor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// A blocking round trip on the calling thread: no reactor wake-up, best at low concurrency.
    Block,
    /// Yield to the reactor while the worker works: best at high concurrency.
    Yield,
}

impl Wait {
    /// Its name in the walredo status (the `path` of the pool's controller and of each child):
    /// `sync` for blocking, `async` for yielding.
    pub fn as_str(self) -> &'static str {
        match self {
            Wait::Block => "sync",
            Wait::Yield => "async",
        }
    }
}

/// What the pool should look like until the next update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Target pool size, in `[min_workers, max_workers]`.
    pub workers: usize,
    /// How many of the workers busy-poll between requests; <= `min(workers, max_spinning)`,
    /// zero exactly when `spin` is zero.
    pub spinning: usize,
    /// How long a spinning worker polls before it parks; zero = park at once (plain blocking).
    pub spin: Duration,
    /// How callers should reach a worker.
    pub wait: Wait,
}

/// One period's measurements, from the caller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// Length of the period (e.g. 100 ms). Zero counts as a period of zero load.
    pub period: Duration,
    /// Requests started in the period.
    pub arrivals: u64,
    /// Requests finished in the period. The policy compares means per completion, which divide
    /// by the same count, so it compares the sums and does not need this; it is here so that
    /// one observation carries the period's whole story for logs and metrics.
    pub completions: u64,
    /// Sum of service time: the time workers held a request during the period.
    pub busy: Duration,
    /// Sum of the time requests waited for a worker during the period.
    pub queue_wait: Duration,
    /// Time-averaged requests in flight (waiting or served) over the period, from the caller's
    /// integral. NaN, infinite or negative counts as 0.
    pub in_flight_avg: f64,
    /// Live workers now.
    pub workers: usize,
    /// Requests wait on a worker that has made no progress for a whole period (a hung
    /// worker): the pool must not shrink, although its requests neither arrive nor finish.
    pub stuck: bool,
}

impl Observation {
    /// The average number of busy workers this period asks for (see the module doc): `busy /
    /// period`, plus one when requests waited longer than they were served, capped at `cap`.
    /// Zero for a zero period.
    pub fn demand(&self, cap: usize) -> f64 {
        if self.period.is_zero() {
            return 0.0;
        }
        let mut demand = self.busy.as_nanos() as f64 / self.period.as_nanos() as f64;
        if self.queue_wait > self.busy {
            demand += 1.0;
        }
        demand.min(cap as f64)
    }

    /// The mean idle gap of a live worker between requests: idle worker time over the period
    /// divided by arrivals (at least 1), saturating; zero when the workers were busy throughout.
    pub fn idle_gap(&self) -> Duration {
        let capacity = self.period.as_nanos().saturating_mul(self.workers as u128);
        let idle = capacity.saturating_sub(self.busy.as_nanos());
        let gap = idle / u128::from(self.arrivals.max(1));
        u64::try_from(gap).map(Duration::from_nanos).unwrap_or(Duration::MAX)
    }

    /// `in_flight_avg`, with NaN, infinities and negatives as 0, and 0 for a zero period.
    fn in_flight(&self) -> f64 {
        let x = self.in_flight_avg;
        if self.period.is_zero() || !x.is_finite() || x < 0.0 {
            0.0
        } else {
            x
        }
    }
}

/// The pool-sizing controller; see the module doc.
#[derive(Debug, Clone)]
pub struct WorkerController {
    conf: WorkerControllerConf,
    /// Smoothed demand, in `[0, max_workers]`.
    avg: f64,
    /// How long the target has been below `last.workers` (observed periods, summed).
    below_for: Duration,
    last: Decision,
}

impl WorkerController {
    /// A controller with no demand seen, `min_workers` workers, none spinning and callers
    /// blocking; fails on an invalid conf (see [`WorkerControllerConf::validate`]).
    pub fn new(conf: WorkerControllerConf) -> anyhow::Result<WorkerController> {
        conf.validate().context("validate worker controller conf")?;
        let last =
            Decision { workers: conf.min_workers, spinning: 0, spin: Duration::ZERO, wait: Wait::Block };
        Ok(WorkerController { conf, avg: 0.0, below_for: Duration::ZERO, last })
    }

    /// Takes one period's observation and returns the decision for the next period (also kept
    /// as [`WorkerController::last`]).
    pub fn update(&mut self, obs: Observation) -> Decision {
        let conf = &self.conf;

        let demand = obs.demand(conf.max_workers);
        // `max(0.8 x avg + 0.2 x demand, demand)`, written so that a demand at or above the
        // average is taken exactly (a steady load keeps a steady average, no float creep).
        self.avg =
            if demand >= self.avg { demand } else { (AVG_KEEP * self.avg + AVG_NEW * demand).max(demand) };
        // With at most one request in flight on average, a second worker could only take turns
        // with the first: `min_workers` then, however busy the one worker is.
        let target = if obs.in_flight() <= 1.0 { conf.min_workers } else { conf.target_for(self.avg) };

        let current = self.last.workers;
        let workers = if target >= current {
            self.below_for = Duration::ZERO;
            target
        } else if obs.stuck {
            // A hung worker's requests stop arriving and finishing, which reads as no demand:
            // hold the pool until they are gone.
            self.below_for = Duration::ZERO;
            current
        } else {
            self.below_for = self.below_for.saturating_add(obs.period);
            if self.below_for >= conf.shrink_after {
                self.below_for = Duration::ZERO;
                // target < current, and target >= min_workers: stays in range.
                current - 1
            } else {
                current
            }
        };

        let (spinning, spin) = if obs.period.is_zero() || obs.arrivals == 0 {
            (0, Duration::ZERO)
        } else {
            let gap = obs.idle_gap();
            if gap > conf.spin_max {
                (0, Duration::ZERO)
            } else {
                let spin = gap.saturating_mul(2).min(conf.spin_max).max(conf.spin_min);
                (workers.min(conf.max_spinning), spin)
            }
        };

        let in_flight = obs.in_flight();
        let wait = if in_flight < conf.sync_below {
            Wait::Block
        } else if in_flight > conf.async_above {
            Wait::Yield
        } else {
            self.last.wait
        };

        self.last = Decision { workers, spinning, spin, wait };
        self.last
    }

    /// The decision returned by the last [`WorkerController::update`] (`min_workers`, parked,
    /// sync before any).
    pub fn last(&self) -> Decision {
        self.last
    }

    /// The smoothed demand (average busy workers, with the queueing bonus), in
    /// `[0, max_workers]`.
    pub fn smoothed_demand(&self) -> f64 {
        self.avg
    }

    /// The settings in use.
    pub fn conf(&self) -> &WorkerControllerConf {
        &self.conf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_millis(100);
    const ZERO: Duration = Duration::ZERO;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    fn ctl(max_workers: usize, max_spinning: usize) -> WorkerController {
        WorkerController::new(WorkerControllerConf::new(max_workers, max_spinning)).expect("valid conf")
    }

    /// A 100 ms period: `busy` of service over `arrivals` requests, all completed, none waited,
    /// `workers` live, and as many in flight on average as were busy (Little's law, no queue).
    fn obs(busy: Duration, arrivals: u64, workers: usize) -> Observation {
        Observation {
            period: PERIOD,
            arrivals,
            completions: arrivals,
            busy,
            queue_wait: ZERO,
            in_flight_avg: busy.as_secs_f64() / PERIOD.as_secs_f64(),
            workers,
            stuck: false,
        }
    }

    fn idle(workers: usize) -> Observation {
        obs(ZERO, 0, workers)
    }

    fn decision(workers: usize, spinning: usize, spin: Duration, wait: Wait) -> Decision {
        Decision { workers, spinning, spin, wait }
    }

    /// The invariants every decision keeps, whatever the input.
    fn assert_in_range(c: &WorkerController, d: Decision) {
        let conf = c.conf();
        assert!((conf.min_workers..=conf.max_workers).contains(&d.workers), "{d:?}");
        assert!(d.spinning <= d.workers.min(conf.max_spinning), "{d:?}");
        assert_eq!(d.spin.is_zero(), d.spinning == 0, "{d:?}");
        if !d.spin.is_zero() {
            assert!((conf.spin_min..=conf.spin_max).contains(&d.spin), "{d:?}");
        }
        let avg = c.smoothed_demand();
        assert!(avg.is_finite() && (0.0..=conf.max_workers as f64).contains(&avg), "{avg}");
    }

    #[test]
    fn new_controller_starts_with_min_workers_parked_on_the_sync_path() {
        let c = ctl(8, 1);
        assert_eq!(c.last(), decision(1, 0, ZERO, Wait::Block));
        assert_eq!(c.smoothed_demand(), 0.0);
        let mut c = c;
        assert_eq!(c.update(idle(1)), decision(1, 0, ZERO, Wait::Block));
    }

    #[test]
    fn step_up_grows_the_pool_to_the_target_at_once() {
        let mut c = ctl(16, 1);
        assert_eq!(c.update(idle(1)), decision(1, 0, ZERO, Wait::Block));

        // 300 ms busy in 100 ms: demand 3, target ceil(3 x 1.25) = 4, in one step. The one live
        // worker was busy throughout (gap 0): the shortest spin. In flight 3: the path holds.
        let d = c.update(obs(ms(300), 3000, 1));
        assert_eq!(d, decision(4, 1, us(20), Wait::Block));
        assert_eq!(c.smoothed_demand(), 3.0);

        // Requests waited longer than they were served: demand 3 + 1 = 4, target 5. Four live
        // workers idle 100 ms in all over 3000 arrivals: gap 33 333 ns, spin twice that.
        let d = c.update(Observation { queue_wait: ms(500), in_flight_avg: 8.0, ..obs(ms(300), 3000, 4) });
        assert_eq!(d, decision(5, 1, Duration::from_nanos(66_666), Wait::Yield));
        assert_eq!(c.smoothed_demand(), 4.0);
    }

    #[test]
    fn queue_wait_longer_than_service_adds_one_worker_of_demand() {
        // Waiting exactly as long as served: no extra worker.
        let even = Observation { queue_wait: ms(200), ..obs(ms(200), 100, 2) };
        assert_eq!(even.demand(16), 2.0);
        assert_eq!(ctl(16, 1).update(even).workers, 3);

        // One nanosecond longer: one more worker of demand, target ceil(3 x 1.25) = 4.
        let longer = Observation { queue_wait: ms(200) + Duration::from_nanos(1), ..even };
        assert_eq!(longer.demand(16), 3.0);
        assert_eq!(ctl(16, 1).update(longer).workers, 4);

        // Requests waiting for a pool with no live worker, none served: demand 1, but half a
        // request in flight on average: one worker.
        let empty = Observation {
            period: PERIOD,
            arrivals: 5,
            completions: 0,
            busy: ZERO,
            queue_wait: ms(50),
            in_flight_avg: 0.5,
            workers: 0,
            stuck: false,
        };
        assert_eq!(empty.demand(16), 1.0);
        assert_eq!(ctl(16, 1).update(empty).workers, 1);
        // The same with two requests in flight: target ceil(1 x 1.25) = 2.
        assert_eq!(ctl(16, 1).update(Observation { in_flight_avg: 2.0, ..empty }).workers, 2);

        // The bonus counts against the cap too.
        assert_eq!(longer.demand(2), 2.0);
    }

    #[test]
    fn one_request_at_a_time_keeps_one_worker_however_busy() {
        let mut c = ctl(8, 1);
        // A closed loop of one client: the worker holds a request 95% of the time, never two.
        for _ in 0..30 {
            let d = c.update(obs(ms(95), 1900, 1));
            assert_eq!(d.workers, 1);
        }
        // A second client: 1.9 in flight, demand 1.9, target ceil(2.375) = 3.
        assert_eq!(c.update(obs(ms(190), 3800, 1)).workers, 3);
    }

    #[test]
    fn ramp_grows_the_pool_step_by_step_with_the_load() {
        let mut c = ctl(16, 1);
        let mut sizes = Vec::new();
        for k in 1..=6u64 {
            let live = c.last().workers;
            let d = c.update(obs(ms(100 * k), 1000, live));
            // A rising demand is taken as is: the average jumps up.
            assert_eq!(c.smoothed_demand(), k as f64);
            sizes.push(d.workers);
        }
        // ceil(k x 1.25) for k = 2..=6; at k = 1 one request is in flight on average: one worker.
        assert_eq!(sizes, [1, 3, 4, 5, 7, 8]);

        // A steady load holds the size.
        for _ in 0..20 {
            assert_eq!(c.update(obs(ms(600), 1000, 8)).workers, 8);
            assert_eq!(c.smoothed_demand(), 6.0);
        }
    }

    #[test]
    fn burst_then_idle_parks_at_once_and_shrinks_one_worker_per_second_down_to_min() {
        let mut c = ctl(8, 2);
        // Burst: demand 4, target 5 at once. The first period's one worker was busy throughout
        // (gap 0: the shortest spin); in the second, five live workers idle 100 ms in all over
        // 4000 arrivals: gap 25 us, spin 50 us. At most two spin.
        assert_eq!(c.update(obs(ms(400), 4000, 1)), decision(5, 2, us(20), Wait::Block));
        assert_eq!(c.update(obs(ms(400), 4000, 5)), decision(5, 2, us(50), Wait::Block));

        // Idle: everyone parks in the first idle period; the average decays below the size at
        // once (target 4, then less), so one worker goes every 10 periods of 100 ms, to 1.
        for i in 1..=60usize {
            let live = c.last().workers;
            let d = c.update(idle(live));
            let want = 5usize.saturating_sub(i / 10).max(1);
            assert_eq!(d, decision(want, 0, ZERO, Wait::Block), "idle period {i}");
        }
        assert!(c.smoothed_demand() < 1e-5);
    }

    #[test]
    fn a_pool_with_requests_stuck_on_a_hung_worker_never_shrinks() {
        // Two workers under load, then one hangs: its requests neither arrive nor finish, so
        // the periods look idle but for its busy time.
        let mut c = ctl(4, 1);
        assert_eq!(c.update(Observation { in_flight_avg: 6.0, ..obs(ms(150), 3000, 2) }).workers, 2);
        let stalled = Observation { in_flight_avg: 0.0, stuck: true, ..obs(ms(100), 0, 2) };
        for _ in 0..50 {
            assert_eq!(c.update(stalled).workers, 2, "shrank while requests waited on a hung worker");
        }
        // Once nothing is stuck, the same periods shrink it after the usual second.
        let calm = Observation { stuck: false, ..stalled };
        let shrunk = (0..10).map(|_| c.update(calm).workers).collect::<Vec<_>>();
        assert_eq!(shrunk.last(), Some(&1), "{shrunk:?}");
        assert!(shrunk[..9].iter().all(|&w| w == 2), "{shrunk:?}");
    }

    #[test]
    fn target_back_at_the_pool_size_restarts_the_shrink_clock() {
        let mut c = ctl(8, 1);
        assert_eq!(c.update(obs(ms(400), 4000, 1)).workers, 5);
        for i in 1..=9 {
            assert_eq!(c.update(idle(5)).workers, 5, "idle period {i}");
        }
        // 900 ms below: one more idle period would shrink. A burst brings the target back to 5.
        assert_eq!(c.update(obs(ms(400), 4000, 5)).workers, 5);
        for i in 1..=9 {
            assert_eq!(c.update(idle(5)).workers, 5, "idle period {i} after the second burst");
        }
        assert_eq!(c.update(idle(5)).workers, 4);
    }

    #[test]
    fn steady_low_load_keeps_one_worker_on_the_sync_path_spinning_only_for_short_gaps() {
        let mut c = ctl(8, 1);
        // 1000 requests of 20 us in 100 ms, one at a time (0.2 in flight): one worker, on the
        // sync path, spinning: idle gap 80 us, spin 160 us.
        for i in 0..10 {
            let d = c.update(obs(ms(20), 1000, 1));
            assert_eq!(d, decision(1, 1, us(160), Wait::Block), "period {i}");
        }
        // The same requests overlapping (1.5 in flight, still the sync path): the same spin;
        // the pool stays at ceil(0.2 x 1.25) = 1 worker.
        let overlapping = |o: Observation| Observation { in_flight_avg: 1.5, ..o };
        for i in 0..10 {
            let d = c.update(overlapping(obs(ms(20), 1000, 1)));
            assert_eq!(d, decision(1, 1, us(160), Wait::Block), "period {i}");
        }
        // 100 requests of 20 us: idle gap 980 us, longer than any spin: parked.
        for i in 0..10 {
            let d = c.update(overlapping(obs(ms(2), 100, 1)));
            assert_eq!(d, decision(1, 0, ZERO, Wait::Block), "period {i}");
        }
        // The edge: a gap of exactly spin_max spins for spin_max; a few ns longer parks.
        assert_eq!(c.update(overlapping(obs(ZERO, 500, 1))), decision(1, 1, us(200), Wait::Block));
        assert_eq!(obs(ZERO, 499, 1).idle_gap(), Duration::from_nanos(200_400));
        assert_eq!(c.update(overlapping(obs(ZERO, 499, 1))), decision(1, 0, ZERO, Wait::Block));
        // A gap far below spin_min still spins spin_min (900 ns gap).
        assert_eq!(c.update(overlapping(obs(ms(10), 100_000, 1))), decision(1, 1, us(20), Wait::Block));
    }

    #[test]
    fn high_concurrency_takes_the_async_path_at_the_cap() {
        let mut c = ctl(4, 1);
        // 32 in flight on average, four workers busy throughout and requests queued behind them.
        let busy = Observation { queue_wait: ms(2000), in_flight_avg: 32.0, ..obs(ms(400), 40_000, 4) };
        for i in 0..5 {
            assert_eq!(c.update(busy), decision(4, 1, us(20), Wait::Yield), "period {i}");
            assert_eq!(c.smoothed_demand(), 4.0);
        }
    }

    #[test]
    fn path_holds_between_the_thresholds() {
        let mut c = ctl(8, 1);
        let trace = [
            (1.0, Wait::Block),
            (3.0, Wait::Block),
            (4.0, Wait::Block),
            (4.01, Wait::Yield),
            (3.0, Wait::Yield),
            (2.0, Wait::Yield),
            (4.0, Wait::Yield),
            (1.99, Wait::Block),
            (2.0, Wait::Block),
            (5.0, Wait::Yield),
            (0.0, Wait::Block),
        ];
        for (n, (in_flight, want)) in trace.into_iter().enumerate() {
            let d = c.update(Observation { in_flight_avg: in_flight, ..obs(ms(10), 100, 1) });
            assert_eq!(d.wait, want, "step {n}: in flight {in_flight}");
        }
    }

    #[test]
    fn pool_never_exceeds_max_workers_and_an_absurd_sample_decays_from_the_cap() {
        let mut c = ctl(3, 8);
        // Demand 100 (+1 for the queue): capped at 3, so every worker may spin (max_spinning 8).
        let flood = Observation { queue_wait: ms(20_000), in_flight_avg: 100.0, ..obs(ms(10_000), 1000, 1) };
        assert_eq!(c.update(flood), decision(3, 3, us(20), Wait::Yield));
        assert_eq!(c.smoothed_demand(), 3.0);

        // Then no busy time, but 1.5 requests in flight on average (so the one-request rule does
        // not apply): from an average of 3 (not 101), the target falls below 3 in the third
        // period (3 x 0.8^3 x 1.25 = 1.92), and the pool shrinks 10 periods later. Uncapped
        // (101), the clock would only have started in the 17th period.
        let light = Observation { in_flight_avg: 1.5, ..idle(3) };
        for i in 1..=11 {
            assert_eq!(c.update(light).workers, 3, "light period {i}");
        }
        assert_eq!(c.update(light).workers, 2);
    }

    #[test]
    fn spinning_workers_are_capped_by_max_spinning_and_by_the_pool() {
        // Five workers, 2.5 us gap: the shortest spin, for two of them.
        let load = obs(ms(400), 40_000, 5);
        assert_eq!(ctl(8, 2).update(load), decision(5, 2, us(20), Wait::Block));
        // With room for eight spinners, all five spin.
        assert_eq!(ctl(8, 8).update(load), decision(5, 5, us(20), Wait::Block));
        // A one-worker pool spins one, however many may (requests overlapping: 1.5 in flight).
        let one = Observation { in_flight_avg: 1.5, ..obs(ms(20), 1000, 1) };
        assert_eq!(ctl(8, 8).update(one), decision(1, 1, us(160), Wait::Block));

        assert_eq!(max_spinning_for_cpus(0), 1);
        assert_eq!(max_spinning_for_cpus(1), 1);
        assert_eq!(max_spinning_for_cpus(2), 1);
        assert_eq!(max_spinning_for_cpus(8), 4);
        assert_eq!(max_spinning_for_cpus(9), 4);
    }

    #[test]
    fn zero_period_counts_as_zero_load_and_does_not_move_the_shrink_clock() {
        let absurd = Observation {
            period: ZERO,
            arrivals: u64::MAX,
            completions: u64::MAX,
            busy: Duration::MAX,
            queue_wait: Duration::MAX,
            in_flight_avg: 1e9,
            workers: usize::MAX,
            stuck: false,
        };
        let mut c = ctl(8, 2);
        assert_eq!(c.update(absurd), decision(1, 0, ZERO, Wait::Block));
        assert_eq!(c.smoothed_demand(), 0.0);

        // After a burst, zero-length periods decay the average but no time passes: no shrink.
        assert_eq!(c.update(obs(ms(400), 4000, 5)).workers, 5);
        for _ in 0..100 {
            assert_eq!(c.update(absurd), decision(5, 0, ZERO, Wait::Block));
        }
        // Real idle time does: 10 periods later, one worker goes.
        for _ in 0..9 {
            assert_eq!(c.update(idle(5)).workers, 5);
        }
        assert_eq!(c.update(idle(5)).workers, 4);
    }

    #[test]
    fn bad_in_flight_counts_as_zero() {
        for bad in [f64::NAN, -f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0, f64::MIN] {
            let mut c = ctl(8, 1);
            assert_eq!(
                c.update(Observation { in_flight_avg: 10.0, ..obs(ms(10), 100, 1) }).wait,
                Wait::Yield
            );
            let d = c.update(Observation { in_flight_avg: bad, ..obs(ms(10), 100, 1) });
            assert_eq!(d.wait, Wait::Block, "in flight {bad}");
        }
    }

    #[test]
    fn extreme_inputs_never_panic_and_stay_in_range() {
        // Everything at its limit over one nanosecond: demand capped, workers busy throughout.
        let mut c = ctl(8, 2);
        let flood = Observation {
            period: Duration::from_nanos(1),
            arrivals: u64::MAX,
            completions: u64::MAX,
            busy: Duration::MAX,
            queue_wait: Duration::MAX,
            in_flight_avg: f64::MAX,
            workers: usize::MAX,
            stuck: false,
        };
        assert_eq!(c.update(flood), decision(8, 2, us(20), Wait::Yield));
        assert_eq!(c.smoothed_demand(), 8.0);

        // The longest period, nothing busy: idle capacity saturates; the gap is huge: parked.
        let mut c = ctl(8, 2);
        let vast =
            Observation { period: Duration::MAX, busy: ZERO, queue_wait: ZERO, in_flight_avg: 0.0, ..flood };
        assert_eq!(vast.idle_gap(), Duration::MAX);
        assert_eq!(c.update(vast), decision(1, 0, ZERO, Wait::Block));

        // A grid of odd values keeps every invariant.
        let durations =
            [ZERO, Duration::from_nanos(1), us(20), ms(100), Duration::from_secs(10), Duration::MAX];
        let counts = [0, 1, 1000, u64::MAX];
        let floats = [f64::NAN, f64::INFINITY, -1.0, 0.0, 3.0, 1e300];
        let workers = [0, 1, 5, usize::MAX];
        for conf in [WorkerControllerConf::new(1, 1), WorkerControllerConf::new(8, 2)] {
            let mut c = WorkerController::new(conf).expect("valid conf");
            for period in durations {
                for busy in durations {
                    for arrivals in counts {
                        for (i, &in_flight_avg) in floats.iter().enumerate() {
                            let obs = Observation {
                                period,
                                arrivals,
                                completions: arrivals / 2,
                                busy,
                                queue_wait: durations[i % durations.len()],
                                in_flight_avg,
                                workers: workers[i % workers.len()],
                                stuck: i % 2 == 0,
                            };
                            let d = c.update(obs);
                            assert_in_range(&c, d);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn validate_rejects_out_of_range_settings() {
        let d = || WorkerControllerConf::new(8, 2);
        assert!(d().validate().is_ok());
        let bad: Vec<(&str, WorkerControllerConf)> = vec![
            ("min_workers", WorkerControllerConf { min_workers: 0, ..d() }),
            ("max_workers", WorkerControllerConf::new(0, 1)),
            ("max_workers", WorkerControllerConf { min_workers: 9, ..d() }),
            ("headroom", WorkerControllerConf { headroom: 0.99, ..d() }),
            ("headroom", WorkerControllerConf { headroom: f64::NAN, ..d() }),
            ("headroom", WorkerControllerConf { headroom: f64::INFINITY, ..d() }),
            ("shrink_after", WorkerControllerConf { shrink_after: ZERO, ..d() }),
            ("spin_min", WorkerControllerConf { spin_min: ZERO, ..d() }),
            ("spin_max", WorkerControllerConf { spin_max: us(10), ..d() }),
            ("max_spinning", WorkerControllerConf::new(8, 0)),
            ("sync_below", WorkerControllerConf { sync_below: 0.0, ..d() }),
            ("sync_below", WorkerControllerConf { sync_below: -1.0, ..d() }),
            ("sync_below", WorkerControllerConf { sync_below: f64::NAN, ..d() }),
            ("async_above", WorkerControllerConf { async_above: 1.0, ..d() }),
            ("async_above", WorkerControllerConf { async_above: f64::NAN, ..d() }),
            ("async_above", WorkerControllerConf { async_above: f64::INFINITY, ..d() }),
        ];
        for (field, conf) in bad {
            let err = conf.validate().expect_err(field);
            assert!(err.to_string().starts_with(field), "{field}: {err}");
            let err = WorkerController::new(conf).expect_err(field);
            assert!(format!("{err:#}").contains(field), "{field}: {err:#}");
        }
        // Boundaries that are allowed.
        let ok = [
            WorkerControllerConf::new(1, 1),
            WorkerControllerConf { min_workers: 8, ..d() },
            WorkerControllerConf::new(2, 64),
            WorkerControllerConf { headroom: 1.0, ..d() },
            WorkerControllerConf { spin_max: DEFAULT_SPIN_MIN, ..d() },
            WorkerControllerConf { async_above: DEFAULT_SYNC_BELOW, ..d() },
        ];
        for conf in ok {
            assert!(conf.validate().is_ok(), "{conf:?}");
        }
    }

    #[test]
    fn target_for_ignores_float_error_above_an_integer() {
        let conf = WorkerControllerConf::new(16, 1);
        // 0.8 x 3 x 1.25 is 3.0000000000000004 in f64: still three workers.
        assert_eq!(conf.target_for(0.8 * 3.0), 3);
        assert_eq!(conf.target_for(2.4 + 1e-6), 4);
        assert_eq!(conf.target_for(0.0), 1);
        assert_eq!(conf.target_for(f64::NAN), 1);
        assert_eq!(conf.target_for(-5.0), 1);
        assert_eq!(conf.target_for(f64::INFINITY), 16);
        assert_eq!(conf.target_for(1e300), 16);
    }
}
