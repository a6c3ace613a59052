//! The daemon-wide budget of active waiting: redo children that busy-poll between requests
//! (with the sync readers that busy-poll for their replies), and `auto` tenants whose round
//! trips block an executor thread (the sync path, with its `block_in_place` hand-off).
//!
//! Why: each of these buys latency with CPU, and pays only while one tenant's requests come
//! faster than a wake-up. Each tenant's controller decides for itself; with one busy
//! connection per tenant on a 16-core machine, 16 tenants spun and handed off on every core
//! (about 290 us of CPU per GetPage, against 91 for the same daemon at 64 x 8 on one tenant),
//! and the latency they bought was lost to the contention they made. So the controllers' wishes
//! go through this budget:
//! - **Slots:** at most a quarter of the CPUs (at least one) are granted at once. A slot is one
//!   spinning child, or, for an `auto` tenant, the blocking path; a tenant with none parks its
//!   children and yields while it waits.
//! - **Where the gain per CPU is highest:** a spinner saves a wake-up per request and costs the
//!   idle gap between its requests (up to its window), so its gain per CPU is about the wake-up
//!   over the gap: the slots go to the tenants with the shortest idle gap per child, one slot
//!   each before any tenant gets a second.
//! - **None when the machine is busy:** when the CPUs are more than 75% busy, not counting one
//!   CPU per granted slot (what the spinners themselves may use), no slot is granted until the
//!   rest falls below 60%. Read from `/proc/stat`; where it cannot be read, the machine counts
//!   as not busy.
//!
//! Each manager's controller loop bids once per period ([`SpinBudget::grant`]); the grants are
//! recomputed at most once per period for all bids at once, so the cost per period is one sort
//! of the bidding tenants, whatever their number.
//!
//! **Invariant:** slots granted <= slots; the allocation ([`allocate`]) and the busy rule
//! ([`Busy`]) are pure and tested on their own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::pool::{cpus, PERIOD};
use crate::util::lock;

/// A bid older than this is dropped (its manager stopped bidding without withdrawing).
const BID_LIFETIME: Duration = Duration::from_millis(300);
/// Busy above this share of the CPUs (not counting the granted spinners).
const BUSY_ABOVE: f64 = 0.75;
/// Not busy again below this share.
const CALM_BELOW: f64 = 0.60;

/// One manager's wish for a period.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Bid {
    /// Gain per CPU: higher goes first (see the module doc).
    pub(crate) score: f64,
    /// Slots wanted, at least 1.
    pub(crate) wanted: usize,
}

/// The daemon-wide budget; see the module doc.
#[derive(Debug)]
pub struct SpinBudget {
    slots: usize,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    bids: HashMap<u64, (Bid, Instant)>,
    grants: HashMap<u64, usize>,
    computed: Option<Instant>,
    busy: Busy,
    cpu_times: Option<CpuTimes>,
}

impl SpinBudget {
    /// A budget of `slots` slots (at least 1).
    pub fn new(slots: usize) -> Arc<SpinBudget> {
        Arc::new(SpinBudget {
            slots: slots.max(1),
            state: Mutex::new(State {
                bids: HashMap::new(),
                grants: HashMap::new(),
                computed: None,
                busy: Busy::default(),
                cpu_times: None,
            }),
        })
    }

    /// The daemon's budget: a quarter of the CPUs, at least 1.
    pub fn global() -> Arc<SpinBudget> {
        static GLOBAL: OnceLock<Arc<SpinBudget>> = OnceLock::new();
        Arc::clone(GLOBAL.get_or_init(|| SpinBudget::new(slots_for_cpus(cpus()))))
    }

    /// Files manager `id`'s bid for this period (`None`: it wants nothing) and returns the
    /// slots granted to it, as of the last recomputation (at most one period old).
    pub(crate) fn grant(&self, id: u64, bid: Option<Bid>, now: Instant) -> usize {
        let mut state = lock(&self.state);
        match bid {
            Some(bid) if bid.wanted > 0 => {
                state.bids.insert(id, (bid, now));
            }
            _ => {
                state.bids.remove(&id);
                state.grants.remove(&id);
            }
        }
        if state.computed.is_none_or(|at| now.saturating_duration_since(at) >= PERIOD) {
            self.recompute(&mut state, now);
        }
        state.grants.get(&id).copied().unwrap_or(0)
    }

    /// Forgets manager `id` (it shut down).
    pub(crate) fn withdraw(&self, id: u64) {
        let mut state = lock(&self.state);
        state.bids.remove(&id);
        state.grants.remove(&id);
    }

    /// Slots granted now, daemon-wide.
    pub fn granted(&self) -> usize {
        lock(&self.state).grants.values().sum()
    }

    fn recompute(&self, state: &mut State, now: Instant) {
        state.computed = Some(now);
        state.bids.retain(|_, (_, at)| now.saturating_duration_since(*at) < BID_LIFETIME);
        let granted: usize = state.grants.values().sum();
        if let Some(times) = CpuTimes::read() {
            if let Some(share) = state.cpu_times.map(|before| times.busy_share_since(&before)) {
                let spinners = granted as f64 / times.cpus.max(1) as f64;
                state.busy.update(share - spinners);
            }
            state.cpu_times = Some(times);
        }
        let slots = if state.busy.is_busy() { 0 } else { self.slots };
        state.grants = allocate(slots, state.bids.iter().map(|(&id, &(bid, _))| (id, bid)));
    }
}

/// Slots for a machine of `cpus` CPUs: a quarter, at least 1.
pub fn slots_for_cpus(cpus: usize) -> usize {
    (cpus / 4).max(1)
}

/// Grants `slots` among `bids`: in rounds, highest score first (ties: lower id), one slot per
/// bidder per round while it wants more. Pure.
pub(crate) fn allocate(slots: usize, bids: impl Iterator<Item = (u64, Bid)>) -> HashMap<u64, usize> {
    let mut bids: Vec<(u64, Bid)> = bids.filter(|(_, b)| b.wanted > 0).collect();
    bids.sort_by(|(a_id, a), (b_id, b)| b.score.total_cmp(&a.score).then(a_id.cmp(b_id)));
    let mut grants: HashMap<u64, usize> = HashMap::new();
    let mut left = slots;
    let mut round = 0;
    while left > 0 {
        let mut gave = false;
        for (id, bid) in &bids {
            if left == 0 {
                break;
            }
            if bid.wanted > round {
                *grants.entry(*id).or_default() += 1;
                left -= 1;
                gave = true;
            }
        }
        if !gave {
            break;
        }
        round += 1;
    }
    grants
}

/// Whether the machine is busy, with hysteresis (see the module doc). Pure.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Busy(bool);

impl Busy {
    /// Takes the share of the CPUs busy over the last period, not counting the granted
    /// spinners (NaN counts as 0).
    pub(crate) fn update(&mut self, share: f64) {
        let share = if share.is_nan() { 0.0 } else { share };
        if share > BUSY_ABOVE {
            self.0 = true;
        } else if share < CALM_BELOW {
            self.0 = false;
        }
    }

    pub(crate) fn is_busy(self) -> bool {
        self.0
    }
}

/// The machine's CPU time counters (`/proc/stat`, first line), in ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CpuTimes {
    busy: u64,
    total: u64,
    cpus: usize,
}

impl CpuTimes {
    fn read() -> Option<CpuTimes> {
        CpuTimes::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// From `/proc/stat`: the `cpu` line's fields (idle and iowait are not busy), and the
    /// number of `cpuN` lines. `None` on anything unexpected.
    fn parse(text: &str) -> Option<CpuTimes> {
        let mut lines = text.lines();
        let first = lines.next()?;
        let mut fields = first.split_ascii_whitespace();
        if fields.next()? != "cpu" {
            return None;
        }
        let ticks: Vec<u64> = fields.map(|f| f.parse().ok()).collect::<Option<_>>()?;
        if ticks.len() < 5 {
            return None;
        }
        let total = ticks.iter().fold(0u64, |sum, t| sum.saturating_add(*t));
        let idle = ticks[3].saturating_add(ticks[4]);
        let cpus = lines.take_while(|l| l.starts_with("cpu")).count();
        Some(CpuTimes { busy: total.saturating_sub(idle), total, cpus })
    }

    /// Share of the CPUs busy between `before` and `self` (0 if no time passed).
    fn busy_share_since(&self, before: &CpuTimes) -> f64 {
        let total = self.total.saturating_sub(before.total);
        if total == 0 {
            return 0.0;
        }
        self.busy.saturating_sub(before.busy) as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bid(score: f64, wanted: usize) -> Bid {
        Bid { score, wanted }
    }

    #[test]
    fn slots_go_to_the_shortest_gaps_one_each_before_any_second() {
        let bids = [(1, bid(10.0, 2)), (2, bid(50.0, 3)), (3, bid(20.0, 1)), (4, bid(5.0, 1))];
        let grants = allocate(5, bids.into_iter());
        assert_eq!(grants.get(&2), Some(&2));
        assert_eq!(grants.get(&3), Some(&1));
        assert_eq!(grants.get(&1), Some(&1));
        assert_eq!(grants.get(&4), Some(&1));
        assert_eq!(grants.values().sum::<usize>(), 5);
        // Four slots: one each, none a second.
        assert!(allocate(4, bids.into_iter()).values().all(|&g| g == 1));

        // Fewer slots than bidders: the highest scores only.
        let grants = allocate(1, bids.into_iter());
        assert_eq!(grants, HashMap::from([(2, 1)]));
        // More slots than wanted: each gets what it wants, the rest stays free.
        assert_eq!(allocate(100, bids.into_iter()).values().sum::<usize>(), 7);
        // No slots (a busy machine): nothing.
        assert!(allocate(0, bids.into_iter()).is_empty());
    }

    #[test]
    fn odd_scores_never_panic_and_never_exceed_the_slots() {
        let bids = [f64::NAN, f64::INFINITY, -1.0, 0.0, f64::NEG_INFINITY];
        for slots in 0..8 {
            let grants = allocate(slots, bids.iter().enumerate().map(|(i, &s)| (i as u64, bid(s, 2))));
            assert!(grants.values().sum::<usize>() <= slots);
        }
    }

    #[test]
    fn busy_turns_on_above_three_quarters_and_off_below_sixty_percent() {
        let mut busy = Busy::default();
        for (share, expect) in [
            (0.5, false),
            (0.74, false),
            (0.76, true),
            (0.7, true),
            (0.61, true),
            (0.59, false),
            (f64::NAN, false),
        ] {
            busy.update(share);
            assert_eq!(busy.is_busy(), expect, "share {share}");
        }
    }

    #[test]
    fn a_budget_grants_its_slots_to_its_best_bidders_and_forgets_withdrawn_ones() {
        let budget = SpinBudget::new(2);
        let now = Instant::now();
        // The first bid computes the grants.
        assert_eq!(budget.grant(1, Some(bid(1.0, 1)), now), 1);
        // Others bid within the period: granted at the next recomputation.
        assert_eq!(budget.grant(2, Some(bid(3.0, 1)), now), 0);
        assert_eq!(budget.grant(3, Some(bid(2.0, 1)), now), 0);
        let later = now + PERIOD;
        assert_eq!(budget.grant(1, Some(bid(1.0, 1)), later), 0, "lower score than 2 and 3");
        assert_eq!(budget.grant(2, Some(bid(3.0, 1)), later), 1);
        assert_eq!(budget.grant(3, Some(bid(2.0, 1)), later), 1);
        assert!(budget.granted() <= 2);
        budget.withdraw(2);
        // A bid not renewed expires.
        let much_later = later + BID_LIFETIME + PERIOD;
        assert_eq!(budget.grant(1, Some(bid(1.0, 1)), much_later), 1);
        assert_eq!(budget.granted(), 1);
    }

    #[test]
    fn proc_stat_is_parsed_and_odd_text_refused() {
        let text = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 50 0 25 400 25 0 0 0 0 0\ncpu1 50 0 25 400 25 0 0 0 0 0\nintr 1\n";
        let t = CpuTimes::parse(text).expect("parses");
        assert_eq!(t, CpuTimes { busy: 150, total: 1000, cpus: 2 });
        let later = CpuTimes { busy: 250, total: 1200, cpus: 2 };
        assert_eq!(later.busy_share_since(&t), 0.5);
        assert_eq!(t.busy_share_since(&t), 0.0);
        for bad in ["", "intr 1", "cpu a b c d e", "cpu 1 2 3"] {
            assert_eq!(CpuTimes::parse(bad), None, "{bad:?}");
        }
        assert!(CpuTimes::read().is_some(), "this machine has a /proc/stat");
    }
}
