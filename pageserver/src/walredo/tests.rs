//! Tests of background redo requests against the real `walredo-proc` child, for both process
//! kinds: foreground requests go first, background requests alone are served and not starved
//! by a closed-loop foreground load, and a background request waiting for its turn is
//! cancel-safe and holds no child.
//!
//! Here rather than in `tests/walredo.rs` because they look at the manager's insides (the
//! priority queue, a child's in-flight count) to know when every request has reached the point
//! the test is about. Waits are on conditions with deadlines, never sleeps as synchronisation.

use walredo_proc::record::Record;

use super::*;

const KINDS: [ProcessKind; 2] = [ProcessKind::Sync, ProcessKind::Async];

fn manager_of(kind: ProcessKind, idle_timeout: Duration) -> (Arc<WalRedoManager>, prometheus::Registry) {
    let mut conf = WalRedoConf::with_binary(crate::test_support::walredo_proc_binary());
    conf.process_kind = kind;
    conf.timeout = Duration::from_secs(20);
    conf.idle_timeout = idle_timeout;
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(WalRedoMetrics::new(&registry).expect("register metrics"));
    (WalRedoManager::new("tenant-test", conf, metrics), registry)
}

fn manager(kind: ProcessKind) -> Arc<WalRedoManager> {
    manager_of(kind, DEFAULT_IDLE_TIMEOUT).0
}

fn tag(blknum: u32) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum }
}

/// Records of a request that builds a distinct page for `n` from nothing.
fn records_for(n: u32) -> Vec<(u64, Bytes)> {
    let encode = |record: Record<'_>| {
        let mut out = Vec::new();
        record.encode(&mut out);
        Bytes::from(out)
    };
    let tuple = format!("tuple of request {n} ").repeat(20);
    vec![
        (0x100, encode(Record::InitPage { special_size: 0 })),
        (0x200, encode(Record::InsertTuple { offnum: 0, data: tuple.as_bytes() })),
        (0x300, encode(Record::PutBytes { offset: 8000, data: &n.to_be_bytes() })),
    ]
}

/// The page those records make, computed here with the same apply code.
fn expected_for(n: u32) -> Bytes {
    let mut page: Box<Page> = Box::new([0; BLCKSZ]);
    for (lsn, record) in records_for(n) {
        Record::decode(&record).expect("valid record").apply(&mut page, lsn).expect("record applies");
    }
    Bytes::copy_from_slice(&page[..])
}

async fn foreground(manager: &WalRedoManager, n: u32) -> Result<Bytes, RedoError> {
    manager.request_redo(tag(n), 0x300, None, &records_for(n)).await
}

async fn background(manager: &WalRedoManager, n: u32) -> Result<Bytes, RedoError> {
    manager.request_redo_background(tag(n), 0x300, None, &records_for(n)).await
}

fn check(result: Result<Bytes, RedoError>, n: u32, what: &str) {
    let page = result.unwrap_or_else(|e| panic!("{what}: request {n} failed: {e}"));
    assert!(page == expected_for(n), "{what}: request {n} got another page");
}

fn pid_of(manager: &WalRedoManager) -> Option<u32> {
    manager.status().process.map(|p| p.pid)
}

/// Requests that have taken the child in service.
fn on_the_child(manager: &WalRedoManager) -> usize {
    lock(&manager.process).as_ref().map_or(0, |p| p.in_flight.load(Ordering::Relaxed))
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).expect("signal the child");
}

/// Waits until `condition` holds, failing the test after `within`.
async fn wait_for(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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
        let answered = Arc::new(Mutex::new(Vec::new()));
        let spawn = |n: u32| {
            let (manager, answered) = (Arc::clone(&manager), Arc::clone(&answered));
            tokio::spawn(async move {
                let result = if n == FOREGROUND {
                    foreground(&manager, n).await
                } else {
                    background(&manager, n).await
                };
                lock(&answered).push(n);
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
        wait_for("the foreground request to take the child", Duration::from_secs(10), || {
            on_the_child(&manager) + manager.priority.background_waiting() == BACKGROUND as usize + 1
        })
        .await;
        signal(pid, nix::sys::signal::Signal::SIGCONT);
        for task in tasks {
            let (n, result) = task.await.expect("task");
            check(result, n, kind.as_str());
        }
        let answered = lock(&answered).clone();
        let position = answered.iter().position(|&n| n == FOREGROUND).expect("foreground answered");
        assert!(
            position <= 1,
            "{kind}: the foreground request waited behind {position} background requests: {answered:?}"
        );
        assert_eq!(pid_of(&manager), Some(pid), "{kind}: the child was replaced");
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_requests_alone_are_served() {
    for kind in KINDS {
        let (manager, registry) = manager_of(kind, DEFAULT_IDLE_TIMEOUT);
        // Without records: the base image, no child, not counted.
        let base = Bytes::from(vec![7u8; BLCKSZ]);
        let page = manager.request_redo_background(tag(1), 0x300, Some(base.clone()), &[]).await;
        assert_eq!(page.expect("base image"), base);
        assert_eq!(pid_of(&manager), None, "{kind}: a child for a request without records");
        // Invalid: rejected before anything else.
        let invalid = manager.request_redo_background(tag(1), 0x100, None, &records_for(1)).await;
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

        // Waiting for the one background slot, behind a request on a stopped child.
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager).expect("a child");
        signal(pid, nix::sys::signal::Signal::SIGSTOP);
        let tasks: Vec<_> = (10..13u32)
            .map(|n| {
                let manager = Arc::clone(&manager);
                tokio::spawn(async move { (n, background(&manager, n).await) })
            })
            .collect();
        wait_for("the background requests to queue", Duration::from_secs(10), || {
            on_the_child(&manager) == 1 && manager.priority.background_waiting() == 2
        })
        .await;
        // Drop one of the waiting ones (which one waits where is the runtime's business).
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
