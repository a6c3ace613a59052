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
//! - **None under CPU pressure:** when some task of the daemon's cgroup waited for a CPU in more
//!   than 35% of the last period (the kernel's pressure stall information: the cgroup's
//!   `cpu.pressure`, else the machine's `/proc/pressure/cpu`), there is no CPU to buy latency
//!   with: a spinner or a blocked thread holds one that someone else waits for. No slot is
//!   granted then, until the share falls below 25%. Unlike a busy share, the stall time tells a
//!   full machine whose tasks each find a CPU (one connection, its reader and its child: about
//!   17% on 2 vCPUs, where spinning pays) from one where they queue (eight connections: 50-70%).
//!   Where neither file can be read, there is no such signal, and the slots alone bound the
//!   spinning.
//!
//! Each manager's controller loop bids once per period ([`SpinBudget::grant`]); the grants are
//! recomputed at most once per period for all bids at once, so the cost per period is one sort
//! of the bidding tenants, whatever their number.
//!
//! **Invariant:** slots granted <= slots; the allocation ([`allocate`]) and the pressure rule
//! ([`Pressure`]) are pure and tested on their own.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::pool::{cpus, PERIOD};
use crate::util::lock;

/// A bid older than this is dropped (its manager stopped bidding without withdrawing).
const BID_LIFETIME: Duration = Duration::from_millis(300);
/// Under pressure above this share of the time with some task waiting for a CPU.
const PRESSED_ABOVE: f64 = 0.35;
/// Not under pressure again below this share.
const EASED_BELOW: f64 = 0.25;

/// One manager's wish for a period.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Bid {
    /// Gain per CPU: higher goes first (see the module doc).
    pub(crate) score: f64,
    /// Slots wanted, at least 1.
    pub(crate) wanted: usize,
}

/// Cumulative time some task waited for a CPU, or `None` where it cannot be read.
type StallClock = Box<dyn Fn() -> Option<Duration> + Send + Sync>;

/// The daemon-wide budget; see the module doc.
pub struct SpinBudget {
    slots: usize,
    stalled: StallClock,
    state: Mutex<State>,
}

impl std::fmt::Debug for SpinBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpinBudget").field("slots", &self.slots).field("state", &self.state).finish()
    }
}

#[derive(Debug)]
struct State {
    bids: HashMap<u64, (Bid, Instant)>,
    grants: HashMap<u64, usize>,
    computed: Option<Instant>,
    pressure: Pressure,
    /// The stall clock's last reading, and when it was taken.
    stalled: Option<(Instant, Duration)>,
}

impl SpinBudget {
    /// A budget of `slots` slots (at least 1), held back by the CPU pressure of the daemon's
    /// cgroup (see the module doc).
    pub fn new(slots: usize) -> Arc<SpinBudget> {
        SpinBudget::with_stall_clock(slots, Box::new(|| read_stalled(pressure_file()?)))
    }

    /// A budget whose CPU pressure is read from `stalled` (tests script it).
    pub(crate) fn with_stall_clock(slots: usize, stalled: StallClock) -> Arc<SpinBudget> {
        Arc::new(SpinBudget {
            slots: slots.max(1),
            stalled,
            state: Mutex::new(State {
                bids: HashMap::new(),
                grants: HashMap::new(),
                computed: None,
                pressure: Pressure::default(),
                stalled: None,
            }),
        })
    }

    /// A budget that never sees CPU pressure: for tests of the slots alone, which other tests
    /// running beside them would otherwise hold back.
    #[cfg(test)]
    pub(crate) fn without_pressure(slots: usize) -> Arc<SpinBudget> {
        SpinBudget::with_stall_clock(slots, Box::new(|| Some(Duration::ZERO)))
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

    /// Whether CPU pressure holds every slot back now.
    pub fn pressed(&self) -> bool {
        lock(&self.state).pressure.is_pressed()
    }

    fn recompute(&self, state: &mut State, now: Instant) {
        state.computed = Some(now);
        state.bids.retain(|_, (_, at)| now.saturating_duration_since(*at) < BID_LIFETIME);
        match (self.stalled)() {
            Some(stalled) => {
                if let Some((at, before)) = state.stalled {
                    let wall = now.saturating_duration_since(at);
                    if !wall.is_zero() {
                        state
                            .pressure
                            .update(stalled.saturating_sub(before).as_secs_f64() / wall.as_secs_f64());
                    }
                }
                state.stalled = Some((now, stalled));
            }
            // No signal (any more): the slots alone bound the spinning, not a stale verdict.
            None => {
                state.pressure = Pressure::default();
                state.stalled = None;
            }
        }
        let slots = if state.pressure.is_pressed() { 0 } else { self.slots };
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

/// Whether the CPUs are under pressure, with hysteresis (see the module doc). Pure.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pressure(bool);

impl Pressure {
    /// Takes the share of the last period in which some task waited for a CPU (NaN counts
    /// as 0).
    pub(crate) fn update(&mut self, share: f64) {
        let share = if share.is_nan() { 0.0 } else { share };
        if share > PRESSED_ABOVE {
            self.0 = true;
        } else if share < EASED_BELOW {
            self.0 = false;
        }
    }

    pub(crate) fn is_pressed(self) -> bool {
        self.0
    }
}

/// The file with the CPU pressure of the daemon's cgroup (cgroup v2), else the machine's;
/// `None` where neither can be read. Found once.
fn pressure_file() -> Option<&'static Path> {
    static FILE: OnceLock<Option<PathBuf>> = OnceLock::new();
    FILE.get_or_init(|| {
        let cgroup = std::fs::read_to_string("/proc/self/cgroup")
            .ok()
            .zip(std::fs::read_to_string("/proc/self/mountinfo").ok());
        let own = cgroup.and_then(|(cgroup, mounts)| cgroup_pressure_file(&cgroup, &mounts));
        [own, Some(PathBuf::from("/proc/pressure/cpu"))]
            .into_iter()
            .flatten()
            .find(|f| read_stalled(f).is_some())
    })
    .as_deref()
}

/// `cpu.pressure` of this process's cgroup v2 (`/proc/self/cgroup`'s `0::` line) under the
/// cgroup2 mount (`/proc/self/mountinfo`). Pure.
fn cgroup_pressure_file(cgroup: &str, mountinfo: &str) -> Option<PathBuf> {
    let path = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?;
    let mount = mountinfo.lines().find_map(|l| {
        let (mount, fs) = l.split_once(" - ")?;
        (fs.split_ascii_whitespace().next()? == "cgroup2").then(|| mount.split_ascii_whitespace().nth(4))?
    })?;
    Some(Path::new(mount).join(path.trim_start_matches('/')).join("cpu.pressure"))
}

fn read_stalled(file: &Path) -> Option<Duration> {
    parse_stalled(&std::fs::read_to_string(file).ok()?)
}

/// The `some` line's `total` (microseconds in which some task waited for a CPU) of a pressure
/// file. `None` on anything unexpected. Pure.
fn parse_stalled(text: &str) -> Option<Duration> {
    let some = text.lines().find_map(|l| l.strip_prefix("some "))?;
    let total = some.split_ascii_whitespace().find_map(|f| f.strip_prefix("total="))?;
    Some(Duration::from_micros(total.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

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
        // No slots (CPU pressure): nothing.
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
    fn pressure_turns_on_above_35_percent_and_off_below_25() {
        let mut pressure = Pressure::default();
        for (share, expect) in [
            (0.1, false),
            (0.34, false),
            (0.36, true),
            (0.3, true),
            (0.26, true),
            (0.24, false),
            (1.0, true),
            (f64::NAN, false),
        ] {
            pressure.update(share);
            assert_eq!(pressure.is_pressed(), expect, "share {share}");
        }
    }

    #[test]
    fn a_budget_grants_its_slots_to_its_best_bidders_and_forgets_withdrawn_ones() {
        let budget = SpinBudget::without_pressure(2);
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

    /// The rule the stall time replaced (the CPUs more than 75% busy, not counting one CPU per
    /// granted slot) could not fire once every slot was granted: a quarter of the CPUs as
    /// slots leaves at most 75% to the rest. This one holds the slots back whenever tasks wait
    /// for a CPU, every slot granted or not, and grants them again once they do not.
    #[test]
    fn a_budget_holds_its_slots_back_while_tasks_wait_for_a_cpu() {
        let stalled_us = Arc::new(AtomicU64::new(0));
        let clock = Arc::clone(&stalled_us);
        let budget = SpinBudget::with_stall_clock(
            1,
            Box::new(move || Some(Duration::from_micros(clock.load(Ordering::Relaxed)))),
        );
        let mut now = Instant::now();
        let mut period = |stalled_share: f64| {
            now += PERIOD;
            stalled_us.fetch_add((PERIOD.as_micros() as f64 * stalled_share) as u64, Ordering::Relaxed);
            budget.grant(1, Some(bid(1.0, 1)), now)
        };
        assert_eq!(period(0.0), 1);
        assert_eq!(period(0.1), 1);
        // Its one slot granted, and tasks waiting half the time: held back.
        assert_eq!(period(0.5), 0);
        assert!(budget.pressed());
        assert_eq!(budget.granted(), 0);
        assert_eq!(period(0.3), 0, "between the thresholds: still held back");
        assert_eq!(period(0.2), 1);
        assert!(!budget.pressed());
    }

    /// Where the stall time cannot be read, the slots alone bound the spinning; also when it
    /// could be read before and was under pressure then.
    #[test]
    fn a_budget_without_a_stall_clock_grants_its_slots() {
        let budget = SpinBudget::with_stall_clock(1, Box::new(|| None));
        let now = Instant::now();
        for i in 0..3 {
            assert_eq!(budget.grant(1, Some(bid(1.0, 2)), now + PERIOD * i), 1);
            assert!(!budget.pressed());
        }

        // Stalled all the time, then unreadable.
        let calls = Arc::new(AtomicU64::new(0));
        let clock = Arc::clone(&calls);
        let budget = SpinBudget::with_stall_clock(
            1,
            Box::new(move || {
                let n = clock.fetch_add(1, Ordering::Relaxed);
                (n < 3).then(|| PERIOD * n as u32)
            }),
        );
        assert_eq!(budget.grant(1, Some(bid(1.0, 1)), now), 1);
        assert_eq!(budget.grant(1, Some(bid(1.0, 1)), now + PERIOD), 0);
        assert!(budget.pressed());
        assert_eq!(budget.grant(1, Some(bid(1.0, 1)), now + PERIOD * 2), 0);
        assert_eq!(budget.grant(1, Some(bid(1.0, 1)), now + PERIOD * 3), 1, "no signal, no pressure");
        assert!(!budget.pressed());
    }

    #[test]
    fn pressure_files_are_parsed_and_odd_text_refused() {
        let text = "some avg10=0.24 avg60=7.69 avg300=18.19 total=7836011574\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_stalled(text), Some(Duration::from_micros(7_836_011_574)));
        for bad in ["", "full avg10=0 total=5", "some avg10=0.24", "some total=x", "some total=-1"] {
            assert_eq!(parse_stalled(bad), None, "{bad:?}");
        }
        let mountinfo = "25 30 0:23 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs ro\n\
                         36 25 0:31 / /sys/fs/cgroup/unified rw,nosuid,nodev shared:10 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup_pressure_file("1:cpu:/\n0::/system.slice/pageserver.service\n", mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/unified/system.slice/pageserver.service/cpu.pressure"))
        );
        assert_eq!(
            cgroup_pressure_file("0::/\n", mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/unified/cpu.pressure"))
        );
        // cgroup v1 only, or no cgroup2 mount: none.
        assert_eq!(cgroup_pressure_file("1:cpu:/\n", mountinfo), None);
        assert_eq!(cgroup_pressure_file("0::/\n", "25 30 0:23 / /sys/fs/cgroup rw - tmpfs tmpfs ro\n"), None);
        // This machine's kernel has the pressure stall information (Linux 4.20 and later).
        assert!(pressure_file().and_then(read_stalled).is_some(), "no CPU pressure file found");
    }
}
