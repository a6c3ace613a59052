//! Tests of the manager against the real `walredo-proc` child, for every process kind:
//! background redo requests (foreground requests go first, background requests alone are
//! served and not starved by a closed-loop foreground load, and one waiting for its turn is
//! cancel-safe and holds no child), and the pool (it grows under concurrent load and shrinks
//! after it, a killed child fails no request and is replaced, the daemon-wide budget caps extra
//! children, children spin under load and park within a second after it).
//!
//! Here rather than in `tests/walredo.rs` because they look at the manager's insides (the
//! priority queue, a child's in-flight count, the pool) to know when every request has reached
//! the point the test is about. Waits are on conditions with deadlines, never sleeps as
//! synchronisation. `tag`, `records_for` and `expected_for` are shared with `process.rs`'s tests.

use walredo_proc::record::Record;

use super::*;
use crate::test_support::wait_for;

const KINDS: [ProcessKind; 3] = ProcessKind::ALL;

fn manager_of(kind: ProcessKind, idle_timeout: Duration) -> (Arc<WalRedoManager>, prometheus::Registry) {
    let mut conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
    conf.process_kind = kind;
    conf.timeout = Duration::from_secs(20);
    // The priority tests queue requests on a child they stopped: they must stay queued there.
    conf.stall_after = Some(conf.timeout);
    conf.idle_timeout = idle_timeout;
    // The priority tests are about the requests queued on one child: a second child (the
    // pool grows while the first is stopped) would take the foreground request off that queue.
    conf.max_pool_size = 1;
    // Nor spin windows: setting one is a frame on the child, counted in flight like a request,
    // which the priority tests would take for the request they wait for.
    conf.adaptive_spin = false;
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(WalRedoMetrics::new(&registry).expect("register metrics"));
    (WalRedoManager::new("tenant-test", conf, metrics), registry)
}

fn manager(kind: ProcessKind) -> Arc<WalRedoManager> {
    manager_of(kind, DEFAULT_IDLE_TIMEOUT).0
}

pub(super) fn tag(blknum: u32) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum }
}

/// Records of a request that builds a distinct page for `n` from nothing.
pub(super) fn records_for(n: u32) -> Vec<(Lsn, Bytes)> {
    let encode = |record: Record<'_>| {
        let mut out = Vec::new();
        record.encode(&mut out);
        Bytes::from(out)
    };
    let tuple = format!("tuple of request {n} ").repeat(20);
    vec![
        (Lsn(0x100), encode(Record::InitPage { special_size: 0 })),
        (Lsn(0x200), encode(Record::InsertTuple { offnum: 0, data: tuple.as_bytes() })),
        (Lsn(0x300), encode(Record::PutBytes { offset: 8000, data: &n.to_be_bytes() })),
    ]
}

/// The page those records make, computed here with the same apply code.
pub(super) fn expected_for(n: u32) -> Bytes {
    let mut page: Box<walredo_proc::page::Page> = Box::new([0; PAGE_SIZE]);
    for (lsn, record) in records_for(n) {
        Record::decode(&record).expect("valid record").apply(&mut page, lsn.0).expect("record applies");
    }
    Bytes::copy_from_slice(&page[..])
}

async fn foreground(manager: &WalRedoManager, n: u32) -> Result<Bytes, RedoError> {
    manager.request_redo(tag(n), Lsn(0x300), None, &records_for(n)).await
}

async fn background(manager: &WalRedoManager, n: u32) -> Result<Bytes, RedoError> {
    manager.request_redo_background(tag(n), Lsn(0x300), None, &records_for(n)).await
}

fn check(result: Result<Bytes, RedoError>, n: u32, what: &str) {
    let page = result.unwrap_or_else(|e| panic!("{what}: request {n} failed: {e}"));
    assert!(page == expected_for(n), "{what}: request {n} got another page");
}

fn pid_of(manager: &WalRedoManager) -> Option<u32> {
    manager.status().process.map(|p| p.pid)
}

/// Requests that have taken a child in service.
fn on_the_child(manager: &WalRedoManager) -> usize {
    lock(&manager.pool).children().iter().map(|p| p.in_flight.load(Ordering::Relaxed)).sum()
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).expect("signal the child");
}

fn counter(registry: &prometheus::Registry, name: &str) -> f64 {
    let text = prometheus::TextEncoder::new().encode_to_string(&registry.gather()).expect("encode metrics");
    text.lines()
        .filter(|line| line.starts_with(&format!("{name} ")))
        .find_map(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreground_request_is_answered_before_queued_background_requests() {
    const BACKGROUND: u32 = 4;
    const FOREGROUND: u32 = 100;
    for kind in KINDS {
        let manager = manager(kind);
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager).expect("a child");
        // Hold the child busy: whatever is written stays in the pipe, unanswered.
        signal(pid, nix::sys::signal::Signal::SIGSTOP);
        let spawn = |n: u32| {
            let manager = Arc::clone(&manager);
            tokio::spawn(async move {
                let result = if n == FOREGROUND {
                    foreground(&manager, n).await
                } else {
                    background(&manager, n).await
                };
                (n, result)
            })
        };
        let mut tasks: Vec<_> = (0..BACKGROUND).map(spawn).collect();
        // Each background request is on the child or waiting for its turn (without priority:
        // all of them on the child).
        wait_for("the background requests to queue", Duration::from_secs(10), || {
            on_the_child(&manager) + manager.priority.background_waiting() == BACKGROUND as usize
        })
        .await;
        tasks.push(spawn(FOREGROUND));
        // Written whole (its ticket is gone), not only counted on the child.
        wait_for("the foreground request to be written to the child", Duration::from_secs(10), || {
            on_the_child(&manager) + manager.priority.background_waiting() == BACKGROUND as usize + 1
                && manager.priority.foreground_queued() == 0
        })
        .await;
        // The child answers in the order of its pipe, so what is in the pipe now is the order:
        // one background request, then the foreground one; the others wait for their turn,
        // not written. (The order in which the request tasks finish is no evidence: a task
        // woken first may run last on a busy machine.)
        assert_eq!(
            (on_the_child(&manager), manager.priority.background_waiting()),
            (2, BACKGROUND as usize - 1),
            "{kind}: (requests on the child, background requests held back)"
        );
        signal(pid, nix::sys::signal::Signal::SIGCONT);
        for task in tasks {
            let (n, result) = task.await.expect("task");
            check(result, n, kind.as_str());
        }
        assert_eq!(pid_of(&manager), Some(pid), "{kind}: the child was replaced");
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_requests_alone_are_served() {
    for kind in KINDS {
        let (manager, registry) = manager_of(kind, DEFAULT_IDLE_TIMEOUT);
        // Without records: the base image, no child, not counted.
        let base = Bytes::from(vec![7u8; PAGE_SIZE]);
        let page = manager.request_redo_background(tag(1), Lsn(0x300), Some(base.clone()), &[]).await;
        assert_eq!(page.expect("base image"), base);
        assert_eq!(pid_of(&manager), None, "{kind}: a child for a request without records");
        // Invalid: rejected before anything else.
        let invalid = manager.request_redo_background(tag(1), Lsn(0x100), None, &records_for(1)).await;
        assert!(matches!(invalid, Err(RedoError::InvalidRequest(_))), "{kind}: {invalid:?}");

        let tasks: Vec<_> = (0..8u32)
            .map(|n| {
                let manager = Arc::clone(&manager);
                tokio::spawn(async move { (n, background(&manager, n).await) })
            })
            .collect();
        for task in tasks {
            let (n, result) = task.await.expect("task");
            check(result, n, kind.as_str());
        }
        for n in 8..11 {
            check(background(&manager, n).await, n, kind.as_str());
            assert_eq!(manager.priority.background_waiting(), 0);
        }
        assert_eq!(counter(&registry, "pageserver_wal_redo_background_requests_total"), 11.0, "{kind}");
        assert_eq!(manager.status().requests_served, 11, "{kind}");
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_request_is_not_starved_by_a_closed_loop_foreground_load() {
    for kind in KINDS {
        let manager = manager(kind);
        manager.ping().await.expect("ping");
        let stop = tokio_util::sync::CancellationToken::new();
        let clients: Vec<_> = (0..4u32)
            .map(|client| {
                let (manager, stop) = (Arc::clone(&manager), stop.clone());
                tokio::spawn(async move {
                    let mut served = 0u32;
                    while !stop.is_cancelled() {
                        let n = client * 100_000 + served % 1000;
                        check(foreground(&manager, n).await, n, "foreground");
                        served += 1;
                    }
                    served
                })
            })
            .collect();
        let loaded = manager.status().requests_served + 100;
        wait_for("the foreground load to run", Duration::from_secs(10), || {
            manager.status().requests_served >= loaded
        })
        .await;
        // Well within wal_redo_timeout (20 s), the bound after which it would go anyway: it goes
        // because the writer queue empties between the clients' requests.
        let started = Instant::now();
        let result = tokio::time::timeout(Duration::from_secs(10), background(&manager, 7)).await;
        let took = started.elapsed();
        stop.cancel();
        check(result.unwrap_or_else(|_| panic!("{kind}: starved for {took:?}")), 7, kind.as_str());
        for client in clients {
            assert!(client.await.expect("client") > 0, "{kind}: a client was starved");
        }
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_request_dropped_while_waiting_for_its_turn_leaves_no_trace() {
    for kind in KINDS {
        let manager = manager(kind);
        // Waiting behind a foreground request (here: its ticket, as if queued to write).
        let ticket = manager.priority.foreground();
        let waiting = tokio::spawn({
            let manager = Arc::clone(&manager);
            async move { background(&manager, 1).await }
        });
        wait_for("the background request to wait", Duration::from_secs(10), || {
            manager.priority.background_waiting() == 1
        })
        .await;
        assert_eq!(pid_of(&manager), None, "{kind}: a waiting background request spawned a child");
        waiting.abort();
        assert!(waiting.await.is_err_and(|e| e.is_cancelled()), "{kind}");
        assert_eq!(manager.priority.background_waiting(), 0, "{kind}");
        drop(ticket);

        // Waiting for the one background slot, behind a request on a stopped child. The one on
        // the child goes first, so that the test knows which ones wait: a request blocked in
        // the sync kind's `poll` cannot be dropped until its child answers (sync_pipes.rs,
        // "Cancellation"), so dropping that one instead would leave two waiting.
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager).expect("a child");
        signal(pid, nix::sys::signal::Signal::SIGSTOP);
        let spawn = |n: u32| {
            let manager = Arc::clone(&manager);
            tokio::spawn(async move { (n, background(&manager, n).await) })
        };
        let mut tasks = vec![spawn(10)];
        wait_for("the first background request to reach the child", Duration::from_secs(10), || {
            on_the_child(&manager) == 1
        })
        .await;
        tasks.extend([spawn(11), spawn(12)]);
        wait_for("the background requests to queue", Duration::from_secs(10), || {
            on_the_child(&manager) == 1 && manager.priority.background_waiting() == 2
        })
        .await;
        // Drop one of the waiting ones.
        tasks[1].abort();
        wait_for("the dropped request to leave", Duration::from_secs(10), || {
            manager.priority.background_waiting() == 1
        })
        .await;
        signal(pid, nix::sys::signal::Signal::SIGCONT);
        for task in tasks {
            match task.await {
                Ok((n, result)) => check(result, n, kind.as_str()),
                Err(e) => assert!(e.is_cancelled(), "{kind}: {e}"),
            }
        }
        // Later requests, of both classes, get their own pages.
        for n in 20..24 {
            check(background(&manager, n).await, n, kind.as_str());
            check(foreground(&manager, n + 100).await, n + 100, kind.as_str());
        }
        assert_eq!(pid_of(&manager), Some(pid), "{kind}: the child was replaced");
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_background_request_does_not_keep_an_idle_child_alive() {
    for kind in KINDS {
        let (manager, _) = manager_of(kind, Duration::from_millis(200));
        manager.ping().await.expect("ping");
        let old_pid = pid_of(&manager).expect("a child");
        let ticket = manager.priority.foreground();
        let waiting = tokio::spawn({
            let manager = Arc::clone(&manager);
            async move { background(&manager, 3).await }
        });
        wait_for("the background request to wait", Duration::from_secs(10), || {
            manager.priority.background_waiting() == 1
        })
        .await;
        wait_for("the idle child to stop", Duration::from_secs(10), || pid_of(&manager).is_none()).await;
        assert_eq!(manager.priority.background_waiting(), 1, "{kind}: went before its turn");
        drop(ticket);
        check(waiting.await.expect("task"), 3, kind.as_str());
        assert_ne!(pid_of(&manager), Some(old_pid), "{kind}");
        manager.shutdown().await;
    }
}

// ---------------------------------------------------------------- the pool

fn pool_manager(kind: ProcessKind, max_pool_size: usize, budget: Arc<ChildBudget>) -> Arc<WalRedoManager> {
    let mut conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
    conf.process_kind = kind;
    conf.timeout = Duration::from_secs(20);
    conf.max_pool_size = max_pool_size;
    conf.budget = budget;
    // Its own spin budget: other tests' managers must not take its slots, nor the CPU pressure
    // they make hold them back.
    conf.spin_budget = SpinBudget::without_pressure(spin_budget::slots_for_cpus(pool::cpus()));
    let metrics = Arc::new(WalRedoMetrics::new(&prometheus::Registry::new()).expect("register metrics"));
    WalRedoManager::new("tenant-pool", conf, metrics)
}

/// `clients` tasks sending requests back to back until `stop`; each checks every page. Returns
/// the requests served, or panics on the first failure.
fn load(
    manager: &Arc<WalRedoManager>,
    clients: u32,
    stop: &CancellationToken,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..clients)
        .map(|c| {
            let (manager, stop) = (Arc::clone(manager), stop.clone());
            tokio::spawn(async move {
                let mut served = 0u64;
                while !stop.is_cancelled() {
                    let n = c * 1_000_000 + served as u32;
                    check(foreground(&manager, n).await, n, "pool load");
                    served += 1;
                }
                served
            })
        })
        .collect()
}

fn pids(manager: &WalRedoManager) -> Vec<u32> {
    manager.status().pool.children.iter().map(|p| p.pid).collect()
}

fn gone(pid: u32) -> bool {
    // Reaped: no /proc entry (a zombie would still have one).
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_grows_under_concurrent_load_and_shrinks_when_it_stops() {
    for kind in KINDS {
        let budget = ChildBudget::new(8);
        let manager = pool_manager(kind, 3, Arc::clone(&budget));
        // One client, one request at a time: one child, however long it runs.
        let stop = CancellationToken::new();
        let one = load(&manager, 1, &stop);
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert_eq!(pids(&manager).len(), 1, "{kind}: one client grew the pool");
        stop.cancel();
        for client in one {
            client.await.expect("client task");
        }

        let stop = CancellationToken::new();
        let clients = load(&manager, 8, &stop);
        wait_for(&format!("{kind}: the pool to grow to 3 under 8 clients"), Duration::from_secs(10), || {
            pids(&manager).len() == 3
        })
        .await;
        assert_eq!(budget.used(), 2, "{kind}: the two extra children hold a token each");
        let status = manager.status();
        let controller = status.pool.controller.expect("the controller has run");
        assert!(controller.in_flight_avg > 1.0 && controller.target_children >= 2, "{kind}: {controller:?}");
        // Requests reach every child (least loaded first).
        wait_for(&format!("{kind}: every child to serve"), Duration::from_secs(10), || {
            manager.status().pool.children.iter().all(|p| p.requests_served > 0)
        })
        .await;
        let grown = pids(&manager);
        stop.cancel();
        for client in clients {
            assert!(client.await.expect("client task") > 0);
        }

        // Idle: one child leaves per second, down to one; the ones that left are reaped.
        wait_for(&format!("{kind}: the pool to shrink to 1"), Duration::from_secs(10), || {
            pids(&manager).len() == 1
        })
        .await;
        assert_eq!(budget.used(), 0, "{kind}: tokens given back");
        let left: Vec<u32> = grown.iter().copied().filter(|p| !pids(&manager).contains(p)).collect();
        assert_eq!(left.len(), 2, "{kind}: {grown:?} -> {:?}", pids(&manager));
        wait_for(&format!("{kind}: the retired children to be reaped"), Duration::from_secs(10), || {
            left.iter().all(|&p| gone(p))
        })
        .await;
        manager.shutdown().await;
        assert!(grown.iter().all(|&p| gone(p)), "{kind}: a child outlived shutdown");
    }
}

/// The paths of the children in service.
fn paths(manager: &WalRedoManager) -> Vec<&'static str> {
    manager.status().pool.children.iter().map(|p| p.path).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_children_yield_while_many_requests_overlap_and_block_again_after() {
    let manager = pool_manager(ProcessKind::Auto, 2, ChildBudget::new(8));
    // One request at a time: the blocking path.
    let stop = CancellationToken::new();
    let one = load(&manager, 1, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(paths(&manager), ["sync"], "one client");
    stop.cancel();
    for client in one {
        client.await.expect("client task");
    }

    // 16 at a time: every child yields, also the one spawned for the load.
    let stop = CancellationToken::new();
    let clients = load(&manager, 16, &stop);
    wait_for("the children to take the async path under 16 clients", Duration::from_secs(10), || {
        paths(&manager) == ["async", "async"]
    })
    .await;
    let controller = manager.status().pool.controller.expect("the controller has run");
    assert_eq!(controller.path, "async", "{controller:?}");
    assert!(controller.in_flight_avg > 4.0, "{controller:?}");
    stop.cancel();
    for client in clients {
        assert!(client.await.expect("client task") > 0);
    }
    // Idle: back to blocking within a period or two.
    wait_for("the children to block again after the load", Duration::from_secs(2), || {
        paths(&manager).iter().all(|&p| p == "sync")
    })
    .await;
    manager.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_child_of_a_pool_under_load_fails_no_request_and_the_pool_refills() {
    for kind in KINDS {
        let manager = pool_manager(kind, 2, ChildBudget::new(8));
        let stop = CancellationToken::new();
        let clients = load(&manager, 8, &stop);
        wait_for(&format!("{kind}: the pool to grow to 2"), Duration::from_secs(10), || {
            pids(&manager).len() == 2
        })
        .await;
        let victim = pids(&manager)[1];
        signal(victim, nix::sys::signal::Signal::SIGKILL);
        wait_for(&format!("{kind}: the killed child to be replaced"), Duration::from_secs(10), || {
            let now = pids(&manager);
            now.len() == 2 && !now.contains(&victim)
        })
        .await;
        stop.cancel();
        // Every client checked every page and none failed (a request on the killed child was
        // retried on the other one).
        for client in clients {
            assert!(client.await.expect("client task") > 0, "{kind}: a client served nothing");
        }
        assert!(gone(victim), "{kind}: the killed child is not reaped");
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_wide_budget_caps_extra_children_across_tenants() {
    let budget = ChildBudget::new(1);
    let (a, b) = (
        pool_manager(ProcessKind::Async, 3, Arc::clone(&budget)),
        pool_manager(ProcessKind::Async, 3, Arc::clone(&budget)),
    );
    let stop = CancellationToken::new();
    let mut clients = load(&a, 8, &stop);
    clients.extend(load(&b, 8, &stop));
    wait_for("one extra child", Duration::from_secs(10), || pids(&a).len() + pids(&b).len() == 3).await;
    // Growth goes on being asked for, and refused: still 3 children (1 + 1 + one extra).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(pids(&a).len() + pids(&b).len(), 3);
    assert_eq!(budget.used(), 1);
    stop.cancel();
    for client in clients {
        client.await.expect("client task");
    }
    a.shutdown().await;
    b.shutdown().await;
    assert_eq!(budget.used(), 0, "shutdown gives every token back");
}

/// CPU time (user + system) of a process so far, from /proc; zero once it is gone.
fn cpu_time(pid: u32) -> Duration {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return Duration::ZERO;
    };
    let fields: Vec<&str> = stat[stat.rfind(')').expect("comm ends") + 2..].split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100) as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_spin_under_load_and_park_within_a_second_after_it() {
    for kind in KINDS {
        let manager = pool_manager(kind, 2, ChildBudget::new(8));
        let stop = CancellationToken::new();
        // Two clients back to back: requests arrive faster than the spin window.
        let clients = load(&manager, 2, &stop);
        wait_for(&format!("{kind}: a child to spin under load"), Duration::from_secs(10), || {
            manager.status().pool.children.iter().any(|p| p.spin_us > 0)
        })
        .await;
        stop.cancel();
        for client in clients {
            assert!(client.await.expect("client task") > 0);
        }
        let stopped = Instant::now();
        wait_for(&format!("{kind}: every child to park"), Duration::from_secs(2), || {
            manager.status().pool.children.iter().all(|p| p.spin_us == 0)
        })
        .await;
        assert!(
            stopped.elapsed() < Duration::from_millis(1500),
            "{kind}: parked after {:?}",
            stopped.elapsed()
        );
        // Parked children sleep: over a second they use (almost) no CPU.
        let pids = pids(&manager);
        let before: Vec<Duration> = pids.iter().map(|&p| cpu_time(p)).collect();
        tokio::time::sleep(Duration::from_secs(1)).await;
        for (pid, before) in pids.iter().zip(before) {
            let used = cpu_time(*pid).saturating_sub(before);
            assert!(used < Duration::from_millis(50), "{kind}: idle child {pid} used {used:?} of CPU in 1 s");
        }
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_controller_of_an_idle_tenant_sleeps_until_the_next_request() {
    let manager = pool_manager(ProcessKind::Async, 2, ChildBudget::new(8));
    check(foreground(&manager, 1).await, 1, "first request");
    // A period without requests, one child, nothing spinning: the controller goes to sleep.
    wait_for("a settled period", Duration::from_secs(5), || {
        manager.status().pool.controller.is_some_and(|c| c.arrivals == 0 && c.spinning == 0)
    })
    .await;
    let settled = manager.status().pool.controller;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(manager.status().pool.controller, settled, "the controller ran periods while idle");
    // A request wakes it: a period that saw it.
    check(foreground(&manager, 2).await, 2, "waking request");
    wait_for("the controller to see the request", Duration::from_secs(2), || {
        manager.status().pool.controller.is_some_and(|c| c.arrivals >= 1)
    })
    .await;
    manager.shutdown().await;
}

// ---------------------------------------------------------------- a stopped child

/// A child stopped with requests on it and more arriving: the oldest request fails with a
/// timeout counted from when it reached the child (requests written into the stopped child's
/// pipe later are not its progress), the child is killed then, and every request queued behind
/// the oldest one is served by another child, long before that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_behind_a_stopped_child_move_to_another_and_its_oldest_fails_at_the_timeout() {
    const TIMEOUT: Duration = Duration::from_secs(3);
    for kind in KINDS {
        let mut conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
        conf.process_kind = kind;
        conf.timeout = TIMEOUT;
        conf.max_pool_size = 1;
        let registry = prometheus::Registry::new();
        let metrics = Arc::new(WalRedoMetrics::new(&registry).expect("register metrics"));
        let manager = WalRedoManager::new("tenant-stopped", conf, metrics);
        manager.ping().await.expect("ping");
        let stopped = pid_of(&manager).expect("a child");
        signal(stopped, nix::sys::signal::Signal::SIGSTOP);

        let started = Instant::now();
        let oldest = tokio::spawn({
            let manager = Arc::clone(&manager);
            async move { foreground(&manager, 0).await }
        });
        wait_for("the oldest request to reach the child", Duration::from_secs(10), || {
            on_the_child(&manager) == 1
        })
        .await;
        // More requests arrive every 100 ms while the child is stopped; each must be served.
        let mut later = Vec::new();
        for n in 1..=20u32 {
            let manager = Arc::clone(&manager);
            later.push(tokio::spawn(async move { (n, Instant::now(), foreground(&manager, n).await) }));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for task in later {
            let (n, sent, result) = task.await.expect("request task");
            check(result, n, &format!("{kind}: a request behind the stopped child"));
            assert!(sent.elapsed() < TIMEOUT, "{kind}: request {n} waited out the timeout");
        }
        let result = oldest.await.expect("request task");
        let took = started.elapsed();
        assert!(matches!(result, Err(RedoError::Timeout(_))), "{kind}: {result:?}");
        assert!(
            took < TIMEOUT + Duration::from_secs(1),
            "{kind}: the stopped child was timed out after {took:?}"
        );
        wait_for("the stopped child to be killed and reaped", Duration::from_secs(10), || gone(stopped))
            .await;
        assert!(counter(&registry, "pageserver_wal_redo_requests_moved_total") >= 1.0, "{kind}");
        assert!(!pids(&manager).contains(&stopped), "{kind}");
        manager.shutdown().await;
    }
}

// ---------------------------------------------------------------- the spin budget

/// Four tenants each with one client back to back (each would spin on its own) and a spin
/// budget of one slot: at most one child spins at any time, and at most one `auto` tenant
/// blocks; every request is still served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_spin_and_block_only_within_the_daemon_wide_budget() {
    let spin_budget = SpinBudget::without_pressure(1);
    let managers: Vec<Arc<WalRedoManager>> = (0..4)
        .map(|i| {
            let mut conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
            conf.process_kind = ProcessKind::Auto;
            conf.timeout = Duration::from_secs(20);
            conf.max_pool_size = 1;
            conf.spin_budget = Arc::clone(&spin_budget);
            let metrics = Arc::new(WalRedoMetrics::new(&prometheus::Registry::new()).expect("metrics"));
            WalRedoManager::new(&format!("tenant-{i}"), conf, metrics)
        })
        .collect();
    let stop = CancellationToken::new();
    let clients: Vec<_> = managers.iter().flat_map(|m| load(m, 1, &stop)).collect();
    let mut spun = false;
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let statuses: Vec<WalRedoStatus> = managers.iter().map(|m| m.status()).collect();
        let spinning: usize =
            statuses.iter().map(|s| s.pool.children.iter().filter(|p| p.spin_us > 0).count()).sum();
        let blocking = statuses.iter().filter(|s| s.pool.children.iter().any(|p| p.path == "sync")).count();
        // A slot moves between two periods: the tenant that lost it parks in the next one.
        assert!(spinning <= 2, "{spinning} children spin with one slot: {statuses:?}");
        assert!(blocking <= 2, "{blocking} tenants block with one slot: {statuses:?}");
        spun |= spinning > 0;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(spun, "the one slot was never used");
    assert!(spin_budget.granted() <= 1);
    stop.cancel();
    for client in clients {
        assert!(client.await.expect("client task") > 0);
    }
    for manager in managers {
        manager.shutdown().await;
    }
}

/// Every outcome a failed request is counted by has its counter in
/// `pageserver_wal_redo_requests_total` (one per outcome, made at start).
#[test]
fn every_failure_outcome_has_its_counter() {
    let metrics = WalRedoMetrics::new(&prometheus::Registry::new()).expect("metrics");
    let rejected = |code| RedoError::Rejected { code, message: String::new() };
    let errors = [
        rejected(ErrorCode::UnsupportedRecord),
        rejected(ErrorCode::ApplyFailed),
        RedoError::Timeout(Duration::ZERO),
        RedoError::QueueTimeout(Duration::ZERO),
        RedoError::ProcessFailed(anyhow::anyhow!("gone")),
        RedoError::InvalidRequest(String::new()),
        RedoError::ShuttingDown,
    ];
    let labels: std::collections::BTreeSet<&str> = errors.iter().map(|e| e.result_label()).collect();
    assert_eq!(labels.len(), metrics::FAILED_RESULTS.len(), "one outcome per counter");
    for label in labels {
        assert!(metrics.requests_failed(label).is_some(), "{label}");
    }
}
