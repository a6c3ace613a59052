//! End-to-end tests of the walredo manager against the real `walredo-proc` child, for every
//! process kind (and `auto` on each of its paths, see [`KINDS`]): correctness under
//! pipelining, cancellation, crashes, hangs, bad records, the sandbox, idle stop, kind switch
//! and shutdown.
//!
//! Hermetic: every test makes its own manager and metrics registry; waits are on conditions
//! with deadlines, never sleeps as synchronisation.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use page_types::{BufferTag, Lsn, MAX_RECORD_LEN};
use pageserver::test_support::walredo_proc_binary;
use pageserver::walredo::{ProcessKind, RedoError, Wait, WalRedoConf, WalRedoManager, WalRedoMetrics};
use walredo_proc::page::{Page, BLCKSZ};
use walredo_proc::protocol::ErrorCode;
use walredo_proc::record::Record;

/// A process kind as a test runs it: `auto` as the daemon runs it (the controller keeps it on
/// the blocking path under most of these tests' light load), and pinned to the yielding path,
/// so that every test covers both of its ways to wait.
#[derive(Debug, Clone, Copy)]
struct Kind(ProcessKind, Option<Wait>);

const KINDS: [Kind; 4] = [
    Kind(ProcessKind::Sync, None),
    Kind(ProcessKind::Async, None),
    Kind(ProcessKind::Auto, None),
    Kind(ProcessKind::Auto, Some(Wait::Yield)),
];

impl From<ProcessKind> for Kind {
    fn from(kind: ProcessKind) -> Kind {
        Kind(kind, None)
    }
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.1 {
            None => write!(f, "{}", self.0),
            Some(path) => write!(f, "{} ({} path)", self.0, path.as_str()),
        }
    }
}

fn conf(kind: impl Into<Kind>) -> WalRedoConf {
    let Kind(kind, wait) = kind.into();
    let mut conf = WalRedoConf::with_binary(walredo_proc_binary());
    conf.process_kind = kind;
    conf.auto_wait = wait;
    conf.timeout = Duration::from_secs(20);
    conf
}

fn manager_with(conf: WalRedoConf) -> (Arc<WalRedoManager>, prometheus::Registry) {
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(WalRedoMetrics::new(&registry).expect("register metrics"));
    (WalRedoManager::new("tenant-test", conf, metrics), registry)
}

fn tag(blknum: u32) -> BufferTag {
    BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum }
}

fn encode(record: Record<'_>) -> Bytes {
    let mut out = Vec::new();
    record.encode(&mut out);
    Bytes::from(out)
}

/// Records of a request that builds a distinct page for `n` from nothing: init, two tuples.
fn records_for(n: u32) -> Vec<(Lsn, Bytes)> {
    let tuple = format!("tuple of request {n} ").repeat(20);
    vec![
        (Lsn(0x100), encode(Record::InitPage { special_size: 0 })),
        (Lsn(0x200), encode(Record::InsertTuple { offnum: 0, data: tuple.as_bytes() })),
        (Lsn(0x300), encode(Record::PutBytes { offset: 8000, data: &n.to_be_bytes() })),
    ]
}

/// The page those records make, computed in this process with the same apply code: the test
/// is about transport and matching, the apply itself is tested in walredo-proc.
fn expected_for(n: u32) -> Bytes {
    let mut page: Box<Page> = Box::new([0; BLCKSZ]);
    for (lsn, record) in records_for(n) {
        Record::decode(&record).expect("valid record").apply(&mut page, lsn.0).expect("record applies");
    }
    Bytes::copy_from_slice(&page[..])
}

async fn redo(manager: &WalRedoManager, n: u32) -> Result<Bytes, RedoError> {
    manager.request_redo(tag(n), Lsn(0x300), None, &records_for(n)).await
}

/// Compares two byte strings, reporting the first difference instead of both strings.
fn assert_same_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at byte {at}: got {:#04x}, want {:#04x}", got[at], want[at]);
    }
}

/// Starts one task per `n` in `range`, each running `redo(n)`; the tasks yield `(n, result)`.
fn spawn_redos(
    manager: &Arc<WalRedoManager>,
    range: std::ops::Range<u32>,
) -> Vec<tokio::task::JoinHandle<(u32, Result<Bytes, RedoError>)>> {
    range
        .map(|n| {
            let manager = Arc::clone(manager);
            tokio::spawn(async move { (n, redo(&manager, n).await) })
        })
        .collect()
}

fn pid_of(manager: &WalRedoManager) -> Option<u32> {
    manager.status().process.map(|p| p.pid)
}

/// Waits until `condition` holds, failing the test after `within`.
async fn wait_for(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether `pid` is gone for good: no process and no zombie.
fn is_reaped(pid: u32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).expect("signal the child");
}

#[test]
fn manager_and_daemon_agree_on_the_default_process_kind() {
    let daemon_default =
        pageserver::config::PageServerConf::from_table(std::path::Path::new("workdir"), toml::Table::new())
            .expect("default settings")
            .tenants
            .walredo
            .process_kind;
    assert_eq!(WalRedoConf::with_binary(walredo_proc_binary()).process_kind, daemon_default);
    assert_eq!(ProcessKind::default(), daemon_default);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redo_from_nothing_and_from_base_image_gives_exact_pages() {
    for kind in KINDS {
        let (manager, _) = manager_with(conf(kind));
        assert_same_bytes(&redo(&manager, 1).await.expect("redo"), &expected_for(1), &kind.to_string());

        // On top of a base image: only the record above it is applied.
        let base = expected_for(2);
        let record = encode(Record::SetBits { offset: 7000, mask: &[0x0f] });
        let page = manager
            .request_redo(tag(2), Lsn(0x400), Some(base.clone()), &[(Lsn(0x400), record)])
            .await
            .expect("redo");
        assert_eq!(page[7000], 0x0f, "{kind}");
        assert_eq!(walredo_proc::page::page_lsn(page[..].try_into().expect("page")), 0x400);
        assert_same_bytes(&page[8..7000], &base[8..7000], "page below the set bits, past pd_lsn");
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_without_records_returns_base_image_without_a_child() {
    for kind in KINDS {
        let (manager, _) = manager_with(conf(kind));
        let base = expected_for(3);
        let page = manager.request_redo(tag(3), Lsn(0x500), Some(base.clone()), &[]).await.expect("redo");
        assert_eq!(page, base);
        assert_eq!(pid_of(&manager), None, "{kind}: no child should be spawned");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_rejected_before_reaching_the_child() {
    let (manager, _) = manager_with(conf(ProcessKind::Async));
    let short_base = Bytes::from_static(b"not a page");
    let result = manager.request_redo(tag(1), Lsn(1), Some(short_base), &records_for(1)).await;
    assert!(matches!(result, Err(RedoError::InvalidRequest(_))), "{result:?}");
    let result = manager.request_redo(tag(1), Lsn(1), None, &[]).await;
    assert!(matches!(result, Err(RedoError::InvalidRequest(_))), "{result:?}");
    let too_long = Bytes::from(vec![0x08; MAX_RECORD_LEN + 1]);
    let result = manager.request_redo(tag(1), Lsn(1), None, &[(Lsn(1), too_long)]).await;
    assert!(matches!(result, Err(RedoError::InvalidRequest(_))), "{result:?}");
    // Records above the request LSN make no sense.
    let result = manager.request_redo(tag(1), Lsn(0x200), None, &records_for(1)).await;
    assert!(matches!(result, Err(RedoError::InvalidRequest(_))), "{result:?}");
    assert_eq!(pid_of(&manager), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_requests_on_one_child_all_get_their_own_page() {
    for kind in KINDS {
        let (manager, _) = manager_with(conf(kind));
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager);
        let tasks = spawn_redos(&manager, 0..64);
        for task in tasks {
            let (n, result) = task.await.expect("task");
            assert_same_bytes(&result.expect("redo"), &expected_for(n), &format!("{kind}: request {n}"));
        }
        let status = manager.status();
        assert_eq!(pid_of(&manager), pid, "{kind}: one child served all");
        assert_eq!(status.requests_served, 65);
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spin_window_of_the_child_shows_in_the_status_and_redo_stays_correct() {
    for kind in KINDS {
        let (manager, _) = manager_with(conf(kind));
        let set = manager.set_spin(Duration::from_micros(100)).await.expect("set_spin");
        assert_eq!(set, None, "{kind}: without a child there is nothing to set");
        assert_eq!(pid_of(&manager), None, "{kind}: set_spin spawns no child");
        assert_same_bytes(&redo(&manager, 0).await.expect("redo"), &expected_for(0), &kind.to_string());
        let spin_us = |manager: &WalRedoManager| manager.status().process.expect("a child").spin_us;
        assert_eq!(spin_us(&manager), 0, "{kind}: a child starts parked");

        let set = manager.set_spin(Duration::from_micros(150)).await.expect("set_spin");
        assert_eq!(set, pid_of(&manager), "{kind}");
        assert_eq!(spin_us(&manager), 150, "{kind}");
        let json = serde_json::to_value(manager.status()).expect("status as JSON");
        assert_eq!(json["process"]["spin_us"], 150, "{kind}: {json}");

        // Pipelined requests with window changes among them, some of them cancelled halfway:
        // every request still gets its own page.
        let tasks = spawn_redos(&manager, 1..49);
        let mut setters = Vec::new();
        for i in 0..12u64 {
            let manager = Arc::clone(&manager);
            setters.push(tokio::spawn(async move { manager.set_spin(Duration::from_micros(i * 40)).await }));
        }
        for (i, setter) in setters.iter().enumerate() {
            if i % 3 == 0 {
                tokio::task::yield_now().await;
                setter.abort();
            }
        }
        for task in tasks {
            let (n, result) = task.await.expect("task");
            assert_same_bytes(&result.expect("redo"), &expected_for(n), &format!("{kind}: request {n}"));
        }
        for setter in setters {
            if let Ok(result) = setter.await {
                result.expect("set_spin");
            }
        }
        // Cut to the 1 ms cap; zero parks it again.
        manager.set_spin(Duration::from_millis(10)).await.expect("set_spin");
        assert_eq!(spin_us(&manager), 1000, "{kind}");
        assert_same_bytes(&redo(&manager, 50).await.expect("redo"), &expected_for(50), &kind.to_string());
        manager.set_spin(Duration::ZERO).await.expect("set_spin");
        assert_eq!(spin_us(&manager), 0, "{kind}");
        assert_eq!(manager.status().requests_served, 50, "{kind}: S frames are not requests");
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setting_spin_windows_does_not_keep_an_idle_child_alive() {
    for kind in KINDS {
        let mut conf = conf(kind);
        conf.idle_timeout = Duration::from_millis(300);
        let (manager, _) = manager_with(conf);
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager).expect("a child");
        // A controller repeating and changing its decision every period, and no requests.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut round = 0u64;
        while pid_of(&manager) == Some(pid) {
            assert!(Instant::now() < deadline, "{kind}: set_spin kept the idle child alive");
            manager.set_spin(Duration::from_micros(round % 2 * 50)).await.expect("set_spin");
            round += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(round > 5, "{kind}: the child stopped before the windows were set ({round} rounds)");
        wait_for("the idle child to be reaped", Duration::from_secs(10), || is_reaped(pid)).await;
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_requests_do_not_corrupt_other_requests() {
    for kind in KINDS {
        let (manager, _) = manager_with(conf(kind));
        manager.ping().await.expect("ping");
        for round in 0..5u32 {
            let tasks = spawn_redos(&manager, round * 100..round * 100 + 40);
            // Cancel every third request at whatever point it has reached.
            for (i, task) in tasks.iter().enumerate() {
                if i % 3 == 0 {
                    tokio::task::yield_now().await;
                    task.abort();
                }
            }
            for task in tasks {
                match task.await {
                    Ok((n, result)) => assert_same_bytes(
                        &result.expect("redo"),
                        &expected_for(n),
                        &format!("{kind}: request {n}"),
                    ),
                    Err(e) => assert!(e.is_cancelled(), "{e}"),
                }
            }
        }
        // And afterwards nothing is left over in the pipeline.
        for n in 1000..1010 {
            assert_same_bytes(&redo(&manager, n).await.expect("redo"), &expected_for(n), &kind.to_string());
        }
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_request_dropped_after_its_write_leaves_no_orphan_reply() {
    // Poll a request until it has written and waits for its reply, then drop it: its reply
    // must not reach the next request (the gap in Neon's pipelining).
    let (manager, _) = manager_with(conf(ProcessKind::Async));
    manager.ping().await.expect("ping");
    let mut dropped_waiting = 0;
    // A fast child may answer within the first polls; go on (bounded) until enough requests
    // were really dropped while waiting.
    for n in 0..2000u32 {
        if n >= 100 && dropped_waiting >= 10 {
            break;
        }
        let mut request = Box::pin(redo(&manager, n));
        let polls = 1 + n % 3;
        let mut finished = false;
        for _ in 0..polls {
            let poll = std::future::poll_fn(|cx| std::task::Poll::Ready(request.as_mut().poll(cx))).await;
            if poll.is_ready() {
                finished = true;
                break;
            }
        }
        if !finished {
            dropped_waiting += 1;
        }
        drop(request);
        let m = 10_000 + n;
        assert_same_bytes(&redo(&manager, m).await.expect("redo"), &expected_for(m), &format!("request {m}"));
    }
    assert!(dropped_waiting >= 10, "only {dropped_waiting} requests were dropped while waiting for a reply");
    manager.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_of_the_child_fails_requests_cleanly_and_a_new_child_serves_the_next() {
    for kind in KINDS {
        let (manager, _) = manager_with(conf(kind));
        manager.ping().await.expect("ping");
        let old_pid = pid_of(&manager).expect("a child");
        let tasks = spawn_redos(&manager, 0..32);
        signal(old_pid, nix::sys::signal::Signal::SIGKILL);
        for task in tasks {
            let (n, result) = task.await.expect("task");
            match result {
                Ok(page) => assert_same_bytes(&page, &expected_for(n), &kind.to_string()),
                Err(RedoError::ProcessFailed(_)) => {}
                Err(other) => panic!("{kind}: unexpected error {other}"),
            }
        }
        assert_same_bytes(
            &redo(&manager, 99).await.expect("redo after the crash"),
            &expected_for(99),
            "after crash",
        );
        let new_pid = pid_of(&manager).expect("a child");
        assert_ne!(new_pid, old_pid, "{kind}");
        wait_for("the killed child to be reaped", Duration::from_secs(10), || is_reaped(old_pid)).await;
        manager.shutdown().await;
        assert!(is_reaped(new_pid));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_child_times_out_within_the_configured_time_and_is_replaced() {
    for kind in KINDS {
        let mut conf = conf(kind);
        conf.timeout = Duration::from_millis(500);
        let (manager, _) = manager_with(conf);
        manager.ping().await.expect("ping");
        let old_pid = pid_of(&manager).expect("a child");
        signal(old_pid, nix::sys::signal::Signal::SIGSTOP);

        let started = Instant::now();
        let result = redo(&manager, 1).await;
        let took = started.elapsed();
        assert!(matches!(result, Err(RedoError::Timeout(_))), "{kind}: {result:?}");
        assert!(took >= Duration::from_millis(500), "{kind}: gave up early, after {took:?}");
        assert!(took < Duration::from_secs(10), "{kind}: took {took:?}");

        assert_same_bytes(
            &redo(&manager, 2).await.expect("redo on a new child"),
            &expected_for(2),
            "new child",
        );
        assert_ne!(pid_of(&manager), Some(old_pid));
        wait_for("the stopped child to be killed and reaped", Duration::from_secs(10), || is_reaped(old_pid))
            .await;
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_record_fails_only_its_request_and_the_child_lives_on() {
    for kind in KINDS {
        let (manager, _) = manager_with(conf(kind));
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager);
        let mut tasks = Vec::new();
        for n in 0..20u32 {
            let manager = Arc::clone(&manager);
            tasks.push(tokio::spawn(async move {
                if n % 5 == 0 {
                    // Deleting a tuple of an empty page does not apply; an unknown kind does not decode.
                    let bad = if n % 10 == 0 {
                        encode(Record::DeleteTuple { offnum: 7 })
                    } else {
                        Bytes::from_static(&[0x7f, 1, 2])
                    };
                    let records =
                        vec![(Lsn(0x100), encode(Record::InitPage { special_size: 0 })), (Lsn(0x200), bad)];
                    (n, manager.request_redo(tag(n), Lsn(0x200), None, &records).await)
                } else {
                    (n, redo(&manager, n).await)
                }
            }));
        }
        for task in tasks {
            let (n, result) = task.await.expect("task");
            match (n % 10, result) {
                (0, Err(RedoError::Rejected { code: ErrorCode::ApplyFailed, message })) => {
                    assert!(message.contains("0/200"), "{message}")
                }
                (5, Err(RedoError::Rejected { code: ErrorCode::BadRecord, .. })) => {}
                (_, Ok(page)) if n % 5 != 0 => assert_same_bytes(&page, &expected_for(n), "valid request"),
                (_, other) => panic!("{kind}: request {n}: unexpected {other:?}"),
            }
        }
        assert_eq!(pid_of(&manager), pid, "{kind}: the child survived the bad records");
        manager.shutdown().await;
    }
}

/// A manager of `kind` whose child runs with the test hook `flag`, after a ping that made the
/// child break its sandbox: the ping failed with the child, which died of SIGSYS.
async fn ping_kills_the_child_with_sigsys(kind: Kind, flag: &str) -> Arc<WalRedoManager> {
    let mut conf = conf(kind);
    conf.args = vec![flag.to_string()];
    let (manager, _) = manager_with(conf);
    let result = manager.ping().await;
    assert!(matches!(result, Err(RedoError::ProcessFailed(_))), "{kind}: {result:?}");
    wait_for("the killed child's exit status", Duration::from_secs(10), || {
        manager.status().last_exit.is_some_and(|exit| exit.contains("SIGSYS"))
    })
    .await;
    manager
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forbidden_syscall_in_the_sandbox_kills_the_child_and_the_manager_recovers() {
    for kind in KINDS {
        let manager = ping_kills_the_child_with_sigsys(kind, "--test-forbidden-syscall-on-ping").await;
        // Redo requests never trigger the test hook: a new child serves them.
        assert_same_bytes(
            &redo(&manager, 5).await.expect("redo after SIGSYS"),
            &expected_for(5),
            "after SIGSYS",
        );
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_child_is_stopped_and_respawned_on_demand() {
    for kind in KINDS {
        let mut conf = conf(kind);
        conf.idle_timeout = Duration::from_millis(200);
        let (manager, registry) = manager_with(conf);
        manager.ping().await.expect("ping");
        let old_pid = pid_of(&manager).expect("a child");
        wait_for("the idle child to stop", Duration::from_secs(10), || pid_of(&manager).is_none()).await;
        wait_for("the idle child to be reaped", Duration::from_secs(10), || is_reaped(old_pid)).await;
        let stopped = metric(&registry, "pageserver_wal_redo_process_stopped_total", "idle");
        assert_eq!(stopped, 1.0, "{kind}");
        manager.ping().await.expect("ping after idle stop");
        assert_ne!(pid_of(&manager), Some(old_pid));
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kind_switch_at_runtime_drains_the_old_child_and_spawns_the_new_kind() {
    use ProcessKind::{Async, Auto, Sync};
    for (from, to) in [(Sync, Async), (Sync, Auto), (Auto, Async), (Async, Auto)] {
        let what = format!("{from} -> {to}");
        let (manager, registry) = manager_with(conf(from));
        manager.ping().await.expect("ping");
        let old_pid = pid_of(&manager).expect("a child");
        assert_eq!(metric(&registry, "pageserver_walredo_process_kind", from.as_str()), 1.0, "{what}");

        // Requests keep flowing while the kind changes; none may fail.
        let load = spawn_redos(&manager, 0..200);
        tokio::task::yield_now().await;
        manager.set_process_kind(to);
        for task in load {
            let (n, result) = task.await.expect("task");
            assert_same_bytes(&result.expect("redo during the switch"), &expected_for(n), &what);
        }
        manager.ping().await.expect("ping");
        let status = manager.status();
        assert_eq!(status.process_kind, to, "{what}");
        let process = status.process.expect("a child");
        assert_eq!(process.kind, to, "{what}");
        assert_ne!(process.pid, old_pid, "{what}");
        wait_for("the old child to exit", Duration::from_secs(10), || is_reaped(old_pid)).await;
        assert_eq!(metric(&registry, "pageserver_walredo_process_kind", from.as_str()), 0.0, "{what}");
        assert!(metric(&registry, "pageserver_walredo_process_kind", to.as_str()) >= 1.0, "{what}");
        assert_eq!(
            metric(&registry, "pageserver_wal_redo_process_stopped_total", "kind_change"),
            1.0,
            "{what}"
        );
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_in_flight_requests_and_leaves_no_child() {
    for kind in KINDS {
        let (manager, registry) = manager_with(conf(kind));
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager).expect("a child");
        let tasks = spawn_redos(&manager, 0..16);
        tokio::task::yield_now().await;
        manager.shutdown().await;
        assert!(is_reaped(pid), "{kind}: shutdown returned with the child alive");
        for task in tasks {
            let (n, result) = task.await.expect("task");
            match result {
                Ok(page) => assert_same_bytes(&page, &expected_for(n), "during shutdown"),
                Err(RedoError::ShuttingDown) => {}
                Err(other) => panic!("{kind}: unexpected error {other}"),
            }
        }
        assert!(matches!(manager.ping().await, Err(RedoError::ShuttingDown)));
        assert_eq!(pid_of(&manager), None);
        assert_eq!(metric(&registry, "pageserver_walredo_process_kind", &kind.to_string()), 0.0);
    }
}

/// Reads one labelled sample from the registry's text exposition (0 when absent).
fn metric(registry: &prometheus::Registry, name: &str, label_value: &str) -> f64 {
    let text = prometheus::TextEncoder::new().encode_to_string(&registry.gather()).expect("encode metrics");
    text.lines()
        .filter(|line| {
            line.starts_with(&format!("{name}{{")) && line.contains(&format!("=\"{label_value}\""))
        })
        .find_map(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_dropped_mid_flight_does_not_keep_the_child_from_its_idle_stop() {
    let mut conf = conf(ProcessKind::Async);
    conf.idle_timeout = Duration::from_millis(200);
    let (manager, _) = manager_with(conf);
    manager.ping().await.expect("ping");
    let pid = pid_of(&manager).expect("a child");
    // Poll once: the request takes the child and writes, then is dropped before its reply. A
    // fast child can answer within that one poll; then try again, until one is dropped waiting.
    let mut dropped_waiting = false;
    for n in 0..100 {
        let mut request = Box::pin(redo(&manager, n));
        let poll = std::future::poll_fn(|cx| std::task::Poll::Ready(request.as_mut().poll(cx))).await;
        if poll.is_pending() {
            dropped_waiting = true;
            break;
        }
    }
    assert!(dropped_waiting, "every request was answered within its first poll");
    wait_for("the idle child to stop", Duration::from_secs(10), || pid_of(&manager).is_none()).await;
    wait_for("the idle child to be reaped", Duration::from_secs(10), || is_reaped(pid)).await;
    manager.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_child_killed_from_outside_is_reaped_and_leaves_service_at_once() {
    for kind in KINDS {
        let (manager, registry) = manager_with(conf(kind));
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager).expect("a child");
        signal(pid, nix::sys::signal::Signal::SIGKILL);
        // Long before the idle timeout (180 s): no zombie, no live child in the status.
        wait_for("the killed child to be reaped", Duration::from_secs(3), || is_reaped(pid)).await;
        wait_for("the status to show no child", Duration::from_secs(3), || pid_of(&manager).is_none()).await;
        let last_exit = manager.status().last_exit.expect("an exit status");
        assert!(last_exit.contains(&pid.to_string()) && last_exit.contains("SIGKILL"), "{kind}: {last_exit}");
        assert_eq!(metric(&registry, "pageserver_walredo_process_kind", &kind.to_string()), 0.0, "{kind}");
        assert_eq!(metric(&registry, "pageserver_wal_redo_process_stopped_total", "crashed"), 1.0, "{kind}");
        // The next request gets a new child at the first try.
        manager.ping().await.expect("ping after the kill");
        assert_eq!(metric(&registry, "pageserver_wal_redo_requests_total", "process_failed"), 0.0, "{kind}");
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executable_mapping_in_the_sandbox_kills_the_child_with_sigsys() {
    for kind in KINDS {
        let manager = ping_kills_the_child_with_sigsys(kind, "--test-exec-mapping-on-ping").await;
        manager.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_child_cannot_reserve_a_gigabyte_under_its_memory_limit() {
    let mut conf = conf(ProcessKind::Async);
    conf.args = vec!["--test-big-allocation-on-ping".to_string()];
    let (manager, _) = manager_with(conf);
    let result = manager.ping().await;
    assert!(matches!(result, Err(RedoError::ProcessFailed(_))), "{result:?}");
    // Status 3: the reservation was refused (without a limit the child answers the ping).
    wait_for("the child's exit status", Duration::from_secs(10), || {
        manager.status().last_exit.is_some_and(|exit| exit.contains("exited with status 3"))
    })
    .await;
    manager.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_child_with_a_long_queue_is_not_killed_for_queueing() {
    for kind in KINDS {
        let mut conf = conf(kind);
        // Each reply takes 150 ms: 16 requests queue for 2.4 s, each reply comes well in time.
        conf.args = vec!["--no-seccomp".to_string(), "--test-slow-redo-ms=150".to_string()];
        conf.timeout = Duration::from_secs(1);
        let (manager, registry) = manager_with(conf);
        manager.ping().await.expect("ping");
        let pid = pid_of(&manager);
        let mut served = 0;
        for task in spawn_redos(&manager, 0..16) {
            let (n, result) = task.await.expect("task");
            match result {
                Ok(page) => {
                    assert_same_bytes(&page, &expected_for(n), &kind.to_string());
                    served += 1;
                }
                // The queue has its own bound and error; the child is not blamed for it.
                Err(e) => assert!(e.to_string().contains("queue"), "{kind}: request {n}: {e}"),
            }
        }
        assert!(served >= 3, "{kind}: only {served} served");
        assert_eq!(pid_of(&manager), pid, "{kind}: the healthy child was replaced");
        assert_eq!(metric(&registry, "pageserver_wal_redo_process_stopped_total", "timeout"), 0.0, "{kind}");
        manager.shutdown().await;
    }
}

/// Pids of this process's children.
fn children_of_this_process() -> Vec<u32> {
    let mut pids = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("list tasks").flatten() {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            pids.extend(text.split_whitespace().filter_map(|pid| pid.parse::<u32>().ok()));
        }
    }
    pids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_that_never_says_hello_fails_queued_requests_together_not_one_after_another() {
    let mut conf = conf(ProcessKind::Async);
    conf.binary = "/bin/sh".into();
    conf.args = vec!["-c".to_string(), "exec /bin/sleep 60".to_string()];
    conf.timeout = Duration::from_secs(1);
    let (manager, _) = manager_with(conf);
    let started = Instant::now();
    let pings: Vec<_> = (0..6)
        .map(|_| {
            let manager = Arc::clone(&manager);
            tokio::spawn(async move { (manager.ping().await, started.elapsed()) })
        })
        .collect();
    for ping in pings {
        let (result, took) = ping.await.expect("task");
        assert!(result.is_err(), "{result:?}");
        // One spawn's deadline (1 s) for all of them, not one per queued request (6 s).
        assert!(took < Duration::from_secs(3), "a queued request failed only after {took:?}: {result:?}");
    }
    manager.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kind_change_during_a_spawn_does_not_install_a_child_of_the_old_kind() {
    let mut conf = conf(ProcessKind::Sync);
    let binary = walredo_proc_binary();
    conf.binary = "/bin/sh".into();
    // A slow start (0.5 s before the hello), so the kind changes while the child spawns.
    conf.args = vec!["-c".to_string(), format!("/bin/sleep 0.5; exec {}", binary.display())];
    let (manager, _) = manager_with(conf);
    let ping = tokio::spawn({
        let manager = Arc::clone(&manager);
        async move { manager.ping().await }
    });
    // Other tests of this binary have children too: look for this one's wrapper.
    let spawning = || {
        children_of_this_process().into_iter().any(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmdline| String::from_utf8_lossy(&cmdline).contains("/bin/sleep 0.5; exec"))
        })
    };
    wait_for("the spawn to start", Duration::from_secs(10), spawning).await;
    manager.set_process_kind(ProcessKind::Async);
    ping.await.expect("task").expect("ping");
    manager.ping().await.expect("ping");
    let status = manager.status();
    assert_eq!(status.process.map(|p| p.kind), Some(ProcessKind::Async), "{:?}", status.last_exit);
    manager.shutdown().await;
}
