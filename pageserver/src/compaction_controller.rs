//! The CPU-share policy of the time-sliced background compactor: how much CPU compaction may
//! take, as short slices of work separated by computed gaps.
//!
//! Why: a compaction pass run as one long block inside a periodic task takes the executor away
//! from GetPage requests for milliseconds at a time, which is exactly what foreground tail latency
//! sees. Valkey's time-sliced defrag showed the fix: run the background work on its own timer in
//! short slices (slice `D` on, gap `D x (1 - P) / P` off for a target CPU share `P`), so no
//! foreground request waits behind more than one slice. This module decides `P`, `D` and the gap;
//! the driver loop (elsewhere) runs the slices, measures, and calls [`Controller::update`].
//!
//! **Invariant: pure.** No I/O, no clock reads, no async: every input (debt, observed scheduling
//! delay, planned and actual timer gaps) is passed in, so the policy is testable with synthetic
//! traces and the driver owns all side effects.
//!
//! The share is the product of two controllers:
//!
//! - **Backlog share** (ScyllaDB's backlog controller): the normalized compaction debt (1.0 =
//!   "at the compaction threshold") maps to a share. Debt `<= 0` gives 0: nothing to do, no
//!   slices. Debt in `(0, 1)` gives `floor`: there is some work (or the caller asked for a pass)
//!   but no hurry. Debt `>= 1` rises linearly from `floor` at 1 to `cap` at `full_debt`, and stays
//!   at `cap` above. The aim, as in ScyllaDB, is to compact no faster than needed to keep the
//!   debt from growing: a larger debt earns more CPU, a small one stays cheap.
//! - **Latency guard** (CockroachDB's elastic CPU limiter, as AIMD): a multiplier `m` in
//!   `[0, 1]`, starting at 1. Each update whose observed foreground scheduling delay (the
//!   driver's p99 over the period) is above `latency_target` multiplies `m` by `decrease`; one at
//!   or below the target adds `increase`, up to 1. Backing off fast and returning slowly keeps a
//!   foreground burst from paying for compaction twice. The guard updates whether or not there
//!   is debt: it tracks foreground health, which compaction must respect when it starts again.
//!
//! Effective share = `max(floor, backlog_share x m)` while debt > 0, 0 otherwise.
//! **Invariant:** while there is debt the share never drops below `floor`, so the guard can slow
//! compaction but never stop it, and debt cannot grow without bound under a permanently
//! unhealthy foreground. **Invariant:** the share is always in `[0, cap]`, and is 0 exactly when
//! the debt is 0 (or NaN, or negative): see [`Decision`] for how "idle" is represented.
//!
//! **Late timer** (Valkey's anti-starvation): if the gap timer fires late, the compactor got less
//! CPU than its share; [`Controller::slice_for`] lengthens the next slice in proportion
//! (`slice x actual / planned`) so the share holds over time, capped at `max_slice` so one
//! long stall cannot turn into one long slice that hurts the foreground.
//!
//! **Invariant: no panics on input.** Any `f64` debt (NaN, infinities, negatives, subnormals) and
//! any `Duration` are accepted; duration arithmetic saturates instead of panicking.

use std::time::Duration;

use anyhow::{ensure, Context};

/// Default minimum share while there is debt: 5%, CockroachDB's elastic floor.
pub const DEFAULT_FLOOR: f64 = 0.05;
/// Default maximum share: half a core's worth of the executor.
pub const DEFAULT_CAP: f64 = 0.5;
/// Default normalized debt at which the backlog share reaches the cap.
pub const DEFAULT_FULL_DEBT: f64 = 4.0;
/// Default slice of work: short enough that a GetPage waiting behind it barely notices.
pub const DEFAULT_SLICE: Duration = Duration::from_millis(1);
/// Default cap for a late timer's longer slice.
pub const DEFAULT_MAX_SLICE: Duration = Duration::from_millis(4);
/// Default foreground health threshold: executor scheduling delay p99.
pub const DEFAULT_LATENCY_TARGET: Duration = Duration::from_millis(2);
/// Default additive increase of the guard multiplier per healthy period.
pub const DEFAULT_INCREASE: f64 = 0.1;
/// Default multiplicative decrease of the guard multiplier per unhealthy period.
pub const DEFAULT_DECREASE: f64 = 0.5;

/// The controller's settings. Use [`ControllerConf::default`] and [`ControllerConf::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct ControllerConf {
    /// Minimum CPU share while there is debt, in (0, 1].
    pub floor: f64,
    /// Maximum CPU share, in [floor, 1].
    pub cap: f64,
    /// Normalized debt at which the backlog share reaches `cap`; finite and > 1 (debt 1.0 is
    /// "at threshold", where the share is `floor`).
    pub full_debt: f64,
    /// Target length of one slice of work; > 0.
    pub slice: Duration,
    /// Longest slice a late timer can earn; >= `slice`.
    pub max_slice: Duration,
    /// Foreground scheduling delay (p99) above which the foreground is unhealthy; > 0.
    pub latency_target: Duration,
    /// Additive increase of the guard multiplier per healthy period, in (0, 1].
    pub increase: f64,
    /// Factor applied to the guard multiplier per unhealthy period, in [0, 1).
    pub decrease: f64,
}

impl Default for ControllerConf {
    fn default() -> Self {
        ControllerConf {
            floor: DEFAULT_FLOOR,
            cap: DEFAULT_CAP,
            full_debt: DEFAULT_FULL_DEBT,
            slice: DEFAULT_SLICE,
            max_slice: DEFAULT_MAX_SLICE,
            latency_target: DEFAULT_LATENCY_TARGET,
            increase: DEFAULT_INCREASE,
            decrease: DEFAULT_DECREASE,
        }
    }
}

impl ControllerConf {
    /// Checks the ranges documented on each field; the error names the field and its value.
    pub fn validate(&self) -> anyhow::Result<()> {
        let ControllerConf { floor, cap, full_debt, slice, max_slice, latency_target, increase, decrease } =
            *self;
        ensure!(floor > 0.0 && floor <= 1.0, "floor must be in (0, 1], got {floor}");
        ensure!(cap >= floor && cap <= 1.0, "cap must be in [floor, 1] = [{floor}, 1], got {cap}");
        ensure!(
            full_debt.is_finite() && full_debt > 1.0,
            "full_debt must be finite and > 1, got {full_debt}"
        );
        ensure!(!slice.is_zero(), "slice must be > 0");
        ensure!(max_slice >= slice, "max_slice ({max_slice:?}) must be >= slice ({slice:?})");
        ensure!(!latency_target.is_zero(), "latency_target must be > 0");
        ensure!(increase > 0.0 && increase <= 1.0, "increase must be in (0, 1], got {increase}");
        ensure!((0.0..1.0).contains(&decrease), "decrease must be in [0, 1), got {decrease}");
        Ok(())
    }

    /// The backlog share for a normalized debt, before the latency guard: 0 for no debt (NaN
    /// and negatives count as none), `floor` below 1, linear from `floor` at 1 to `cap` at
    /// `full_debt`, `cap` above.
    pub fn backlog_share(&self, debt: f64) -> f64 {
        if debt.is_nan() || debt <= 0.0 {
            return 0.0;
        }
        if debt < 1.0 {
            return self.floor;
        }
        if debt >= self.full_debt {
            return self.cap;
        }
        let t = (debt - 1.0) / (self.full_debt - 1.0);
        (self.floor + (self.cap - self.floor) * t).clamp(self.floor, self.cap)
    }
}

/// What the driver should do until the next update: run slices of `slice` separated by `gap`.
///
/// "Idle" is explicit: [`Decision::IDLE`] has `share == 0`, `slice == 0` and `gap == 0`, and
/// [`Decision::is_idle`] says so; an idle driver runs no slices and waits for its next update.
/// A running decision has `share` in (0, 1] and `slice > 0`; `gap = slice x (1 - share) / share`,
/// zero at share 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// Target fraction of one executor thread's time spent compacting, in [0, 1].
    pub share: f64,
    /// Work per slice; zero when idle.
    pub slice: Duration,
    /// Pause after each slice; zero when idle or at share 1.
    pub gap: Duration,
}

impl Decision {
    /// No debt: no slices.
    pub const IDLE: Decision = Decision { share: 0.0, slice: Duration::ZERO, gap: Duration::ZERO };

    /// The decision for a share and slice length. A share that is not > 0 (including NaN) or a
    /// zero slice gives [`Decision::IDLE`]; a share above 1 counts as 1. A tiny share saturates
    /// the gap at `Duration::MAX` instead of panicking.
    pub fn with_share(share: f64, slice: Duration) -> Decision {
        if share.is_nan() || share <= 0.0 || slice.is_zero() {
            return Decision::IDLE;
        }
        let share = share.min(1.0);
        let gap = secs_saturating(slice.as_secs_f64() * ((1.0 - share) / share));
        Decision { share, slice, gap }
    }

    /// Whether there is nothing to run.
    pub fn is_idle(&self) -> bool {
        self.slice.is_zero()
    }

    /// The pause after `worked` of work, so that work and pause keep the share: the gap of a
    /// full slice, in proportion. A turn cut short (its pass needed a page from the redo
    /// child, or finished) pauses less; zero when idle or at share 1.
    pub fn gap_after(&self, worked: Duration) -> Duration {
        if self.is_idle() {
            return Duration::ZERO;
        }
        secs_saturating(worked.as_secs_f64() * ((1.0 - self.share) / self.share))
    }
}

/// One period's measurements, from the driver.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// Normalized compaction debt: 1.0 = at the compaction threshold. NaN and negatives count
    /// as 0.
    pub debt: f64,
    /// Foreground executor scheduling delay over the period (p99).
    pub sched_delay: Duration,
}

/// The backlog controller with its latency guard; see the module doc.
#[derive(Debug, Clone)]
pub struct Controller {
    conf: ControllerConf,
    /// The guard multiplier, in [0, 1].
    m: f64,
    last: Decision,
}

impl Controller {
    /// A controller with the guard at 1 and an idle last decision; fails on an invalid conf
    /// (see [`ControllerConf::validate`]).
    pub fn new(conf: ControllerConf) -> anyhow::Result<Controller> {
        conf.validate().context("validate compaction controller conf")?;
        Ok(Controller { conf, m: 1.0, last: Decision::IDLE })
    }

    /// Takes one period's observation, moves the latency guard, and returns the decision for
    /// the next period (also kept as [`Controller::last`]).
    pub fn update(&mut self, obs: Observation) -> Decision {
        let conf = &self.conf;
        self.m = if obs.sched_delay > conf.latency_target {
            self.m * conf.decrease
        } else {
            (self.m + conf.increase).min(1.0)
        }
        .clamp(0.0, 1.0);

        let backlog = conf.backlog_share(obs.debt);
        self.last = if backlog > 0.0 {
            let share = (backlog * self.m).max(conf.floor).min(conf.cap);
            Decision::with_share(share, conf.slice)
        } else {
            Decision::IDLE
        };
        self.last
    }

    /// The slice to run after a gap: `decision.slice`, lengthened by `actual / planned` when the
    /// timer fired late (so the share holds over time), capped at `max_slice`, never below
    /// `decision.slice`. A planned gap of zero gives `decision.slice`; an idle decision gives 0.
    pub fn slice_for(&self, decision: Decision, planned_gap: Duration, actual_gap: Duration) -> Duration {
        let base = decision.slice;
        if decision.is_idle() || planned_gap.is_zero() || actual_gap <= planned_gap {
            return base;
        }
        let ratio = actual_gap.as_secs_f64() / planned_gap.as_secs_f64();
        let longer = secs_saturating(base.as_secs_f64() * ratio);
        longer.min(self.conf.max_slice).max(base)
    }

    /// The guard multiplier `m`, in [0, 1] (1 = foreground healthy, no throttling).
    pub fn guard(&self) -> f64 {
        self.m
    }

    /// The decision returned by the last [`Controller::update`] ([`Decision::IDLE`] before any).
    pub fn last(&self) -> Decision {
        self.last
    }

    /// The settings in use.
    pub fn conf(&self) -> &ControllerConf {
        &self.conf
    }
}

/// Seconds to a `Duration` without panicking: NaN and negatives give zero, too large gives
/// `Duration::MAX`.
fn secs_saturating(secs: f64) -> Duration {
    if secs.is_nan() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEALTHY: Duration = Duration::from_micros(500);
    const UNHEALTHY: Duration = Duration::from_millis(10);

    #[test]
    fn gap_after_keeps_the_share_for_the_work_done() {
        let d = Decision::with_share(0.2, Duration::from_millis(1));
        assert_eq!(d.gap_after(Duration::from_millis(1)), d.gap);
        assert_eq!(d.gap_after(Duration::from_micros(250)), Duration::from_millis(1));
        assert_eq!(Decision::IDLE.gap_after(Duration::from_millis(5)), Duration::ZERO);
        assert_eq!(
            Decision::with_share(1.0, Duration::from_millis(1)).gap_after(Duration::from_millis(3)),
            Duration::ZERO
        );
    }

    fn ctl() -> Controller {
        Controller::new(ControllerConf::default()).expect("default conf is valid")
    }

    fn obs(debt: f64, sched_delay: Duration) -> Observation {
        Observation { debt, sched_delay }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn idle_trace_with_no_debt_runs_no_slices() {
        let mut c = ctl();
        assert!(c.last().is_idle());
        for delay in [HEALTHY, UNHEALTHY, HEALTHY] {
            let d = c.update(obs(0.0, delay));
            assert_eq!(d, Decision::IDLE);
            assert!(d.is_idle());
            assert_eq!(d.share, 0.0);
            assert_eq!(d.slice, Duration::ZERO);
        }
        assert_eq!(c.last(), Decision::IDLE);
    }

    #[test]
    fn debt_step_maps_to_floor_linear_and_cap() {
        let mut c = ctl();
        // 0 -> idle; 0.5 -> floor; 1 -> floor; 2 -> 1/3 of the way; 4 and 6 -> cap; 0 -> idle.
        let trace = [
            (0.0, 0.0),
            (0.5, 0.05),
            (1.0, 0.05),
            (2.0, 0.05 + 0.45 / 3.0),
            (4.0, 0.5),
            (6.0, 0.5),
            (0.0, 0.0),
        ];
        for (debt, want) in trace {
            let d = c.update(obs(debt, HEALTHY));
            assert!(close(d.share, want), "debt {debt}: share {} want {want}", d.share);
            assert_eq!(d.is_idle(), want == 0.0, "debt {debt}");
            if !d.is_idle() {
                assert_eq!(d.slice, DEFAULT_SLICE);
            }
        }
    }

    #[test]
    fn latency_burst_backs_off_multiplicatively_and_recovers_in_nine_periods() {
        let mut c = ctl();
        // Debt 4: backlog share = cap = 0.5.
        assert!(close(c.update(obs(4.0, HEALTHY)).share, 0.5));
        assert_eq!(c.guard(), 1.0);

        let mut prev = 0.5;
        for (i, want_m) in [0.5, 0.25, 0.125].into_iter().enumerate() {
            let d = c.update(obs(4.0, UNHEALTHY));
            assert!(close(c.guard(), want_m), "period {i}: m {}", c.guard());
            assert!(close(d.share, 0.5 * want_m), "period {i}: share {}", d.share);
            assert!(d.share < prev && d.share >= DEFAULT_FLOOR);
            prev = d.share;
        }

        // m = 0.125 needs ceil(0.875 / 0.1) = 9 healthy periods to reach 1 again.
        for n in 1..=9 {
            let d = c.update(obs(4.0, HEALTHY));
            assert!(d.share > prev, "period {n}: share must rise");
            prev = d.share;
            if n < 9 {
                assert!(d.share < 0.5, "recovered too early, after {n} periods");
                assert!(close(c.guard(), 0.125 + 0.1 * n as f64));
            } else {
                assert_eq!(c.guard(), 1.0);
                assert!(close(d.share, 0.5));
            }
        }
        // And it stays there.
        assert!(close(c.update(obs(4.0, HEALTHY)).share, 0.5));
    }

    #[test]
    fn latency_burst_never_pushes_share_below_floor() {
        let mut c = ctl();
        // Debt 2.5: backlog share 0.275; m = 0.125 would give 0.034, below the floor.
        for _ in 0..3 {
            c.update(obs(2.5, UNHEALTHY));
        }
        assert!(close(c.guard(), 0.125));
        assert_eq!(c.last().share, DEFAULT_FLOOR);
        // However long the burst lasts.
        for _ in 0..2000 {
            let d = c.update(obs(2.5, UNHEALTHY));
            assert_eq!(d.share, DEFAULT_FLOOR);
            assert!(!d.is_idle());
        }
        assert!(c.guard() >= 0.0 && c.guard() < 1e-6);
    }

    #[test]
    fn rising_debt_ramp_gives_non_decreasing_shares() {
        let mut c = ctl();
        let mut prev = 0.0;
        let mut shares = Vec::new();
        for i in 0..=60 {
            let debt = f64::from(i) * 0.125;
            let d = c.update(obs(debt, HEALTHY));
            assert!(d.share >= prev, "debt {debt}: share {} < {prev}", d.share);
            prev = d.share;
            shares.push(d.share);
        }
        assert_eq!(shares[0], 0.0);
        assert_eq!(shares[1], DEFAULT_FLOOR);
        assert_eq!(*shares.last().expect("non-empty"), DEFAULT_CAP);
        // Strictly rising between debt 1 and full_debt (indices 8..=32).
        for w in shares[8..=32].windows(2) {
            assert!(w[1] > w[0], "{w:?}");
        }
    }

    #[test]
    fn gap_follows_share_and_late_timer_slice_is_capped() {
        let ms = Duration::from_millis;
        // Share 0.25: 1 ms on, 3 ms off (Valkey's numbers at 25%).
        let d = Decision::with_share(0.25, ms(1));
        assert_eq!(d.gap, ms(3));
        // Share 0.5: gap = slice; 0.05: 19 slices.
        assert_eq!(Decision::with_share(0.5, ms(1)).gap, ms(1));
        assert_eq!(Decision::with_share(0.05, ms(1)).gap, ms(19));
        // Share 1.0 (and above): no gap.
        assert_eq!(Decision::with_share(1.0, ms(1)).gap, Duration::ZERO);
        assert_eq!(Decision::with_share(3.0, ms(1)).share, 1.0);
        // Share 0: idle.
        assert!(Decision::with_share(0.0, ms(1)).is_idle());

        // A full-share controller gives zero gaps.
        let conf = ControllerConf { cap: 1.0, ..ControllerConf::default() };
        let mut full = Controller::new(conf).expect("valid");
        let d = full.update(obs(100.0, HEALTHY));
        assert_eq!((d.share, d.gap), (1.0, Duration::ZERO));

        let c = ctl();
        let d = Decision::with_share(0.25, ms(1));
        // On time or early: the plain slice.
        assert_eq!(c.slice_for(d, ms(3), ms(3)), ms(1));
        assert_eq!(c.slice_for(d, ms(3), ms(1)), ms(1));
        // Twice as late: twice the slice.
        assert_eq!(c.slice_for(d, ms(3), ms(6)), ms(2));
        // 1.5x late: 1.5x the slice.
        assert_eq!(c.slice_for(d, ms(2), ms(3)), Duration::from_micros(1500));
        // Very late: capped at max_slice (4 ms).
        assert_eq!(c.slice_for(d, ms(3), ms(300)), DEFAULT_MAX_SLICE);
        // Planned zero (share 1): the plain slice, however late.
        assert_eq!(c.slice_for(d, Duration::ZERO, ms(50)), ms(1));
        // Idle: nothing.
        assert_eq!(c.slice_for(Decision::IDLE, ms(3), ms(6)), Duration::ZERO);
    }

    #[test]
    fn validate_rejects_out_of_range_settings() {
        assert!(ControllerConf::default().validate().is_ok());
        let d = ControllerConf::default;
        let bad: Vec<(&str, ControllerConf)> = vec![
            ("floor", ControllerConf { floor: 0.0, ..d() }),
            ("floor", ControllerConf { floor: 1.5, ..d() }),
            ("floor", ControllerConf { floor: f64::NAN, ..d() }),
            ("cap", ControllerConf { cap: 0.01, ..d() }),
            ("cap", ControllerConf { cap: 1.1, ..d() }),
            ("cap", ControllerConf { cap: f64::NAN, ..d() }),
            ("full_debt", ControllerConf { full_debt: 1.0, ..d() }),
            ("full_debt", ControllerConf { full_debt: f64::INFINITY, ..d() }),
            ("slice", ControllerConf { slice: Duration::ZERO, ..d() }),
            ("max_slice", ControllerConf { max_slice: Duration::from_micros(500), ..d() }),
            ("latency_target", ControllerConf { latency_target: Duration::ZERO, ..d() }),
            ("increase", ControllerConf { increase: 0.0, ..d() }),
            ("increase", ControllerConf { increase: f64::NAN, ..d() }),
            ("decrease", ControllerConf { decrease: 1.0, ..d() }),
            ("decrease", ControllerConf { decrease: -0.1, ..d() }),
        ];
        for (field, conf) in bad {
            let err = conf.validate().expect_err(field);
            assert!(err.to_string().starts_with(field), "{field}: {err}");
            let err = Controller::new(conf).expect_err(field);
            assert!(format!("{err:#}").contains(field), "{field}: {err:#}");
        }
        // Boundaries that are allowed.
        let ok = [
            ControllerConf { floor: 1.0, cap: 1.0, ..d() },
            ControllerConf { cap: 0.05, ..d() },
            ControllerConf { decrease: 0.0, increase: 1.0, ..d() },
            ControllerConf { max_slice: DEFAULT_SLICE, ..d() },
        ];
        for conf in ok {
            assert!(conf.validate().is_ok(), "{conf:?}");
        }
    }

    #[test]
    fn odd_inputs_never_panic_and_stay_in_range() {
        let mut c = ctl();
        let debts = [
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -1.0,
            -0.0,
            f64::MIN,
            f64::MAX,
            f64::MIN_POSITIVE,
            f64::MIN_POSITIVE / 4.0, // subnormal
            f64::EPSILON,
            1.0 - f64::EPSILON,
        ];
        for delay in [Duration::ZERO, HEALTHY, UNHEALTHY, Duration::MAX] {
            for debt in debts {
                let d = c.update(obs(debt, delay));
                assert!(d.share.is_finite() && (0.0..=DEFAULT_CAP).contains(&d.share));
                assert!((0.0..=1.0).contains(&c.guard()));
                let want_idle = debt.is_nan() || debt <= 0.0;
                assert_eq!(d.is_idle(), want_idle, "debt {debt}");
                if !want_idle {
                    assert!(d.share >= DEFAULT_FLOOR);
                }
            }
        }
        // The unhealthy delays above lowered the guard; a fresh controller gives the cap.
        assert_eq!(ctl().update(obs(f64::INFINITY, HEALTHY)).share, DEFAULT_CAP);

        // Duration arithmetic saturates.
        let d = Decision::with_share(f64::MIN_POSITIVE, Duration::from_secs(1));
        assert_eq!(d.gap, Duration::MAX);
        assert!(Decision::with_share(f64::NAN, Duration::from_secs(1)).is_idle());
        assert!(Decision::with_share(-1.0, Duration::from_secs(1)).is_idle());
        assert!(Decision::with_share(f64::NEG_INFINITY, Duration::from_secs(1)).is_idle());
        assert_eq!(Decision::with_share(f64::INFINITY, Duration::MAX).gap, Duration::ZERO);
        let d = c.last();
        assert_eq!(c.slice_for(d, Duration::from_nanos(1), Duration::MAX), DEFAULT_MAX_SLICE);
        assert_eq!(c.slice_for(d, Duration::MAX, Duration::MAX), DEFAULT_SLICE);
    }
}
