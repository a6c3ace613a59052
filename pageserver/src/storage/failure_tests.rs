//! Tests of storage write failures with real faults: a tmpfs that fills up (ENOSPC), a
//! descriptor limit (EMFILE, in a child process so that no other test shares the limit), a
//! file that cannot be deleted (EBUSY: a bind mount over it); and, through test hooks, the
//! failures this machine cannot produce (a failed fsync, a failed truncate). What they check: a
//! failure is visible (state, metrics, `wait_lsn`), nothing answered with an error is stored,
//! ingest recovers without a reopen once the cause is gone, seals included; a fatal failure
//! stops seals and compaction too; and whatever compaction meets, the timeline opens again
//! with every acknowledged value.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use page_types::Lsn;

use super::test_support::*;
use super::{
    CompactionConf, GetError, IngestError, Pass, PassStats, ReconstructData, Step, StorageMetrics, Timeline,
    WaitLsnError,
};

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

/// A contiguous writer (a WAL receiver) whose batches failed with the disk full learns it from
/// its next batch, however late that comes: the retry being due does not let the next batch be
/// stored above the lost ones; a batch following what is durable is accepted again.
#[tokio::test]
async fn a_contiguous_writer_is_refused_after_a_failed_group_even_once_the_retry_is_due() {
    let fs = Tmpfs::mount(2 << 20);
    let dir = fs.path().join("timeline");
    let tl = open(&dir, 1 << 30, &metrics());
    let first = tl.submit_after(Lsn(0), batch(vec![(key(10), 10, image(10))])).await.unwrap();
    assert_eq!(first.await.unwrap(), Lsn(10));
    let filler = fill(fs.path(), 4096);
    let lost = tl.submit_after(Lsn(10), batch(vec![(key(20), 20, image(20))])).await.unwrap();
    assert!(matches!(lost.await, Err(IngestError::StorageUnavailable { fatal: false, .. })));
    std::fs::remove_file(filler).unwrap();
    // The writer did not look at the failure before its next batch, and the retry is due.
    let deadline = Instant::now() + DEADLINE;
    let err = loop {
        match tl.submit_after(Lsn(20), batch(vec![(key(30), 30, image(30))])).await {
            Err(IngestError::StorageUnavailable { fatal: false, .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => break e,
            Ok(_) => panic!("a batch above the lost one was queued"),
        }
    };
    assert!(matches!(err, IngestError::NotContiguous { after: Lsn(20), last: Lsn(10) }), "{err}");
    assert!(!has_image(&tl, 30) && !has_image(&tl, 20) && tl.last_durable_lsn() == Lsn(10));
    // Resumed from what is durable, the writer goes on.
    let again = tl.submit_after(Lsn(10), batch(vec![(key(20), 20, image(20))])).await.unwrap();
    assert_eq!(again.await.unwrap(), Lsn(20));
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

/// A pass that creates no image and drops nothing: every read gives the same answer before and
/// after it, so no redo is needed to compare. Outputs of 4 KiB: several of them.
const KEEP_ALL: CompactionConf =
    CompactionConf { image_threshold: usize::MAX, image_bytes: 0, gc_horizon: u64::MAX, layer_size: 4096 };
const KEYS: u32 = 16;
const LAYER_SIZE: u64 = 2000;

/// Ingests `rounds` rounds of one record per key; returns the last LSN.
async fn fill_records(tl: &Timeline, rounds: u64) -> u64 {
    let mut last = 0;
    for round in 0..rounds {
        let values = (0..KEYS)
            .map(|k| {
                last = round * 100 + u64::from(k) + 1;
                (key(k), last, record(&format!("k{k}r{round}")))
            })
            .collect();
        tl.ingest(batch(values)).await.unwrap();
    }
    last
}

/// What every key reads at a few LSNs up to `last`.
fn contents(tl: &Timeline, last: u64) -> Vec<Result<ReconstructData, String>> {
    let lsns = (1..=last).step_by(37).chain([last]);
    lsns.flat_map(|lsn| (0..KEYS).map(move |k| (k, lsn)))
        .map(|(k, lsn)| tl.get_reconstruct_data(key(k), Lsn(lsn), NO_LIMITS).map_err(|e| e.to_string()))
        .collect()
}

fn layer_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".layer"))
        .collect();
    v.sort();
    v
}

/// Runs `pass` to its end (or its first error).
fn run_pass(pass: &mut Pass) -> anyhow::Result<PassStats> {
    loop {
        match pass.run_slice(Duration::from_millis(1))? {
            Step::Continue => {}
            Step::NeedImage(_) => pass.provide_image(None),
            Step::Done(stats) => return Ok(stats),
        }
    }
}

/// A timeline in `dir` whose compaction failed at the directory fsync after the manifest
/// naming its outputs was renamed into place: after a crash either manifest may be the one.
/// Returns what it read before, its last LSN and its layer files before the pass (the inputs).
async fn install_with_failed_directory_fsync(
    dir: &Path,
    m: &Arc<StorageMetrics>,
) -> (Vec<Result<ReconstructData, String>>, u64, Vec<String>) {
    let tl = open(dir, LAYER_SIZE, m);
    let last = fill_records(&tl, 20).await;
    tl.freeze().await.unwrap();
    let before = contents(&tl, last);
    let inputs = layer_files(dir);
    assert!(inputs.len() > 3, "{inputs:?}");
    let mut pass = tl.begin_compaction(KEEP_ALL).unwrap().unwrap();
    tl.fail_next_manifest_sync();
    let err = run_pass(&mut pass).unwrap_err();
    assert!(format!("{err:#}").contains("injected directory fsync failure"), "{err:#}");
    drop(pass);

    // The outcome is unknown, as after any failed fsync: the timeline refuses ingests until it
    // is reopened, and keeps serving what it has.
    let state = tl.write_error().expect("the failed install is visible");
    assert!(state.fatal && state.error.contains("injected directory fsync failure"), "{state:?}");
    let refused = tl.ingest(batch(vec![(key(0), last + 1, record("x"))])).await.unwrap_err();
    assert!(matches!(refused, IngestError::StorageUnavailable { fatal: true, .. }), "{refused}");
    assert_eq!(contents(&tl, last), before);
    (before, last, inputs)
}

#[tokio::test]
async fn directory_fsync_failing_after_the_install_rename_keeps_every_file_and_the_reopen_serves_all() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let (before, last, inputs) = install_with_failed_directory_fsync(dir.path(), &m).await;
    let files = layer_files(dir.path());
    let kept: Vec<&String> = inputs.iter().filter(|f| files.contains(f)).collect();
    assert_eq!(kept.len(), inputs.len(), "inputs deleted: {files:?}");
    assert!(files.len() > inputs.len(), "the outputs were removed: {files:?}");

    // Whichever manifest the disk kept, the reopen serves every value (here, the new one: the
    // rename happened, so the outputs, and the inputs go).
    let tl = open(dir.path(), LAYER_SIZE, &m);
    assert_eq!(contents(&tl, last), before);
    assert_eq!(tl.write_error(), None);
    tl.ingest(batch(vec![(key(0), last + 1, record("after"))])).await.unwrap();
    assert!(inputs.iter().all(|f| !dir.path().join(f).exists()), "{:?}", layer_files(dir.path()));
}

#[tokio::test]
async fn an_output_missing_at_open_keeps_the_compaction_inputs_it_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let (_, _, inputs) = install_with_failed_directory_fsync(dir.path(), &m).await;
    let listed = super::manifest::read(dir.path()).unwrap().unwrap();
    assert_eq!(listed.deleting, inputs, "the new manifest is in place");
    let output = listed.layers.first().unwrap().name.clone();
    // Lost behind the manifest's back (a damaged disk, a person): the open must not delete
    // what still holds the data.
    let _ = std::fs::remove_file(dir.path().join(&output));

    let err = format!(
        "{:#}",
        Timeline::open(dir.path(), super::StorageConf { layer_size: LAYER_SIZE, ..Default::default() }, m)
            .err()
            .unwrap()
    );
    assert!(err.contains(&output) && err.contains("kept"), "{err}");
    let files = layer_files(dir.path());
    assert!(inputs.iter().all(|f| files.contains(f)), "inputs deleted: {files:?}");
}

#[tokio::test]
async fn a_compaction_input_that_cannot_be_deleted_stays_listed_and_the_reopen_deletes_it() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), LAYER_SIZE, &m);
    let last = fill_records(&tl, 20).await;
    tl.freeze().await.unwrap();
    let before = contents(&tl, last);
    let inputs = layer_files(dir.path());
    let mut pass = tl.begin_compaction(KEEP_ALL).unwrap().unwrap();
    let busy = BindMount::over(&dir.path().join(&inputs[0]));
    let stats = run_pass(&mut pass).unwrap();
    assert_eq!(stats.files_deleted, inputs.len() as u64 - 1, "{stats:?}");
    assert_eq!(contents(&tl, last), before);
    assert_eq!(tl.write_error(), None, "a file left over is no write failure");
    drop(pass);
    drop(tl);
    drop(busy);

    let tl = open(dir.path(), LAYER_SIZE, &m);
    assert_eq!(contents(&tl, last), before);
    assert!(!dir.path().join(&inputs[0]).exists(), "the leftover input was not deleted at open");
}

#[tokio::test]
async fn a_failed_cut_stops_seals_and_compaction_and_the_reopen_serves_every_acknowledged_batch() {
    let dir = tempfile::tempdir().unwrap();
    let m = metrics();
    let tl = open(dir.path(), 1 << 30, &m);
    for lsn in 1..=5u64 {
        tl.ingest(batch(vec![(key(lsn as u32), lsn, image(lsn as u8))])).await.unwrap();
    }
    // A group of 24 KiB fails its fsync, and cutting it off fails too: the file is longer than
    // what was acknowledged, and the timeline has failed for good.
    tl.fail_next_fsync();
    tl.fail_next_cut();
    let values = (6..=8u64).map(|lsn| (key(lsn as u32), lsn, image(lsn as u8))).collect();
    let err = tl.ingest(batch(values)).await.unwrap_err();
    assert!(matches!(&err, IngestError::StorageUnavailable { fatal: true, .. }), "{err}");
    assert!(err.to_string().contains("injected truncate failure"), "{err}");

    // Compaction asks for a seal, then a pass: neither may write on a timeline in this state.
    let frozen = tl.freeze().await;
    let begun = tl.begin_compaction(KEEP_ALL).map(|p| p.is_some());
    let layers = tl.stats().layers;
    drop(tl);

    let tl = Timeline::open(
        dir.path(),
        super::StorageConf { layer_size: 1 << 30, ..Default::default() },
        m.clone(),
    )
    .unwrap_or_else(|e| panic!("the timeline no longer opens: {e:#}"));
    assert!((1..=5).all(|lsn| has_image(&tl, lsn)), "an acknowledged batch was lost");
    assert!(frozen.is_err(), "a seal ran after the failed cut");
    assert!(begun.is_err(), "a compaction pass began after the failed cut: {begun:?}");
    assert_eq!(layers, 0);
}
