//! Tests of storage write failures with real faults: a tmpfs that fills up (ENOSPC) and a
//! descriptor limit (EMFILE, in a child process so that no other test shares the limit). What
//! they check: a failure is visible (state, metrics, `wait_lsn`), nothing answered with an error
//! is stored, and ingest recovers without a reopen once the cause is gone, seals included.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::test_support::*;
use super::{GetError, IngestError, Lsn, StorageMetrics, Timeline, WaitLsnError};

const DEADLINE: Duration = Duration::from_secs(30);

/// Fills the file system of `dir` up, leaving about `leave` bytes free, with a file `filler`.
fn fill(dir: &Path, leave: u64) -> std::path::PathBuf {
    let path = dir.join("filler");
    let stat = nix::sys::statvfs::statvfs(dir).unwrap();
    let free = stat.blocks_available() as u64 * stat.fragment_size() as u64;
    std::fs::write(&path, vec![0u8; free.saturating_sub(leave) as usize]).unwrap();
    path
}

/// Ingests one image at `lsn` until it is accepted (the retry after a failure is due within a
/// second), failing the test after the deadline.
async fn ingest_until_accepted(tl: &Timeline, lsn: u64) {
    let start = Instant::now();
    loop {
        match tl.ingest(batch(vec![(key(lsn as u32 % 64), lsn, image(lsn as u8))])).await {
            Ok(_) => return,
            Err(IngestError::StorageUnavailable { fatal: false, .. }) if start.elapsed() < DEADLINE => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("ingest at {lsn} still failing: {e}"),
        }
    }
}

/// Whether the image ingested at `lsn` is what `lsn` reads.
fn has_image(tl: &Timeline, lsn: u64) -> bool {
    match tl.get_reconstruct_data(key(lsn as u32 % 64), Lsn(lsn), NO_LIMITS) {
        Ok(d) => d.image.is_some_and(|(at, img)| at == Lsn(lsn) && img == bytes_of(&image(lsn as u8))),
        Err(GetError::NotFound { .. }) => false,
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn full_disk_is_visible_refuses_ingest_and_ingest_recovers_once_space_is_freed() {
    let fs = Tmpfs::mount(2 << 20);
    let dir = fs.path().join("timeline");
    let m = metrics();
    let tl = open(&dir, 1 << 30, &m);
    for lsn in 1..=5u64 {
        tl.ingest(batch(vec![(key(lsn as u32), lsn, image(lsn as u8))])).await.unwrap();
    }
    let waiter = tokio::spawn({
        let tl = tl.clone();
        async move { tl.wait_lsn(Lsn(1000), DEADLINE).await }
    });
    let filler = fill(fs.path(), 4096);
    let err = tl.ingest(batch(vec![(key(6), 6, image(6))])).await.unwrap_err();
    assert!(matches!(&err, IngestError::StorageUnavailable { fatal: false, .. }), "{err}");
    assert!(err.to_string().contains("No space left"), "{err}");

    let state = tl.write_error().unwrap();
    assert!(!state.fatal && state.error.contains("No space left"), "{state:?}");
    assert_eq!((m.write_errors.get(), m.failed_timelines.get()), (1, 1));
    // A GetPage waiting above the durable LSN learns it at once, and so does a new one.
    let waited = tokio::time::timeout(DEADLINE, waiter).await.unwrap().unwrap();
    assert!(matches!(waited, Err(WaitLsnError::StorageUnavailable { .. })), "{waited:?}");
    let now = tl.wait_lsn(Lsn(7), DEADLINE).await;
    assert!(matches!(now, Err(WaitLsnError::StorageUnavailable { .. })), "{now:?}");
    tl.wait_lsn(Lsn(5), DEADLINE).await.unwrap();

    std::fs::remove_file(filler).unwrap();
    // The refused LSN 6 may be ingested again: nothing of it was stored.
    ingest_until_accepted(&tl, 6).await;
    assert_eq!(tl.write_error(), None);
    assert_eq!(m.failed_timelines.get(), 0);
    tl.wait_lsn(Lsn(6), DEADLINE).await.unwrap();
    drop(tl);

    let tl = open(&dir, 1 << 30, &m);
    assert!((1..=6).all(|lsn| has_image(&tl, lsn)));
    assert_eq!(tl.last_durable_lsn(), Lsn(6));
}

/// Fills the disk at many points of a run that seals every few batches, so that some seal
/// steps fail (manifest writes, index appends, new segments); each time space is freed and
/// ingest goes on without a reopen. At the end every acknowledged batch is served, before and
/// after a reopen, and nothing that was refused is.
#[tokio::test]
async fn full_disk_during_seals_is_retried_and_loses_nothing() {
    let fs = Tmpfs::mount(4 << 20);
    let dir = fs.path().join("timeline");
    let m = metrics();
    let tl = open(&dir, 40_000, &m);
    let mut acked = Vec::new();
    let mut refused = Vec::new();
    let mut lsn = 0u64;
    for leave in (0..8u64).map(|i| 2_000 + i * 4_100) {
        let filler = fill(fs.path(), leave);
        // Ingest until the disk is full (a refusal) ...
        loop {
            lsn += 1;
            match tl.ingest(batch(vec![(key(lsn as u32 % 64), lsn, image(lsn as u8))])).await {
                Ok(_) => acked.push(lsn),
                Err(IngestError::StorageUnavailable { fatal: false, .. }) => {
                    refused.push(lsn);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        // ... then free the space and go on.
        std::fs::remove_file(filler).unwrap();
        lsn += 1;
        ingest_until_accepted(&tl, lsn).await;
        acked.push(lsn);
    }
    assert!(tl.stats().layers >= 3, "{:?}", tl.stats());
    assert!(m.write_errors.get() >= 8);
    let check = |tl: &Timeline| {
        for &lsn in &acked {
            assert!(has_image(tl, lsn), "acknowledged lsn {lsn} lost");
        }
        for &lsn in &refused {
            assert!(!has_image(tl, lsn), "refused lsn {lsn} stored");
        }
    };
    check(&tl);
    drop(tl);
    let tl = open(&dir, 40_000, &m);
    check(&tl);
}

const EMFILE_DIR_ENV: &str = "PAGESERVER_STORAGE_EMFILE_CHILD_DIR";

/// Child role: with a descriptor limit just above what is open, ingests until a seal fails
/// with EMFILE; then raises the limit and ingests until it works again.
fn emfile_child(dir: &Path) {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let m = Arc::new(StorageMetrics::unregistered());
        let tl = open(dir, 20_000, &m);
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let open_fds = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        setrlimit(Resource::RLIMIT_NOFILE, open_fds, hard).unwrap();
        let mut lsn = 0u64;
        let err = loop {
            lsn += 1;
            match tl.ingest(batch(vec![(key(lsn as u32 % 64), lsn, image(lsn as u8))])).await {
                Ok(_) => assert!(lsn < 100, "no EMFILE after {lsn} batches"),
                Err(e) => break e,
            }
        };
        assert!(err.to_string().contains("Too many open files"), "{err}");
        assert!(!tl.write_error().unwrap().fatal);
        setrlimit(Resource::RLIMIT_NOFILE, soft, hard).unwrap();
        ingest_until_accepted(&tl, lsn).await;
        tl.shutdown().await;
        assert!(tl.stats().layers >= 1, "{:?}", tl.stats());
        assert_eq!(tl.write_error(), None);
        println!("LAST {lsn}");
    });
}

#[test]
fn descriptor_limit_during_a_seal_is_retried_once_descriptors_are_free() {
    if let Some(dir) = std::env::var_os(EMFILE_DIR_ENV) {
        return emfile_child(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "storage::failure_tests::descriptor_limit_during_a_seal_is_retried_once_descriptors_are_free",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(EMFILE_DIR_ENV, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let last: u64 = stdout
        .lines()
        .find_map(|l| l.split("LAST ").nth(1))
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or_else(|| panic!("no LAST line: {stdout}"));
    let tl = open(dir.path(), 20_000, &metrics());
    assert_eq!(tl.last_durable_lsn(), Lsn(last));
    assert!(has_image(&tl, last));
}
