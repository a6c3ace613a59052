//! Threads are O(1) in the number of walredo children: stderr logging and exit waiting are
//! tokio tasks, not a thread or two per child. Its own test binary, so that no other test's
//! threads come and go while it counts.

use std::sync::Arc;
use std::time::Duration;

use pageserver::test_support::walredo_proc_binary;
use pageserver::walredo::{ProcessKind, WalRedoConf, WalRedoManager, WalRedoMetrics};

/// Threads of this process, from the kernel's list.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").expect("list /proc/self/task").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_live_children_do_not_add_threads_per_child() {
    const CHILDREN: usize = 40;
    let registry = prometheus::Registry::new();
    let metrics = Arc::new(WalRedoMetrics::new(&registry).expect("register metrics"));
    let mut managers = Vec::new();
    // Warm up: the first child starts the blocking pool and tokio's process machinery.
    for kind in [ProcessKind::Sync, ProcessKind::Async] {
        let mut conf = WalRedoConf::with_binary(walredo_proc_binary());
        conf.process_kind = kind;
        conf.timeout = Duration::from_secs(20);
        let manager = WalRedoManager::new(&format!("warm-{kind}"), conf, Arc::clone(&metrics));
        manager.ping().await.expect("ping");
        managers.push(manager);
    }
    let before = threads();
    for n in 0..CHILDREN {
        let mut conf = WalRedoConf::with_binary(walredo_proc_binary());
        conf.process_kind = if n % 2 == 0 { ProcessKind::Sync } else { ProcessKind::Async };
        conf.timeout = Duration::from_secs(20);
        let manager = WalRedoManager::new(&format!("tenant-{n}"), conf, Arc::clone(&metrics));
        manager.ping().await.expect("ping");
        managers.push(manager);
    }
    let live = managers.iter().filter(|m| m.status().process.is_some()).count();
    assert_eq!(live, CHILDREN + 2, "every manager has a live child");
    let after = threads();
    // A few blocking-pool threads may come and go; nothing per child.
    assert!(
        after <= before + 8,
        "{CHILDREN} live children added {} threads ({before} -> {after})",
        after.saturating_sub(before)
    );
    for manager in managers {
        manager.shutdown().await;
    }
}
