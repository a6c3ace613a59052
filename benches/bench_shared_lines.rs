//! What per-GetPage work on state that every core shares costs when the threads serving GetPage
//! do it at once, on 1 and 2 threads (the 2-vCPU machine's cores) and as many as the machine has
//! CPUs where it has more (`benches::contending_threads`):
//! - `redo_budget/*`: the daemon-wide redo memory budget (`pageserver::redo_budget`): one
//!   reservation of a chain10 read (about 12 KiB) and its release, with room to spare (the
//!   common case), inside a runtime as the daemon's are;
//! - `record_copies/*`: a chain10 lookup's 10 records of 700 bytes taken from the active
//!   segment's record copies (16 buffers of 64 KiB, as commit groups leave them, each record in
//!   another buffer) and passed on as the daemon passes them (snapshot, plan, redo request: 3
//!   owners each, then dropped): `shared` as slices of the group buffers (each owner changes
//!   the buffer's reference count, a line every core shares), `own` copied first into one
//!   buffer of the lookup's own (`Index::snapshot` since `2171669`).
//!
//! - `timer/*`: a tokio timer as a request's wait for its reply makes one (`timeout_at` around
//!   a future that is not ready at its first poll): made, registered by that poll, and dropped
//!   (cancelled) when the future is done; every executor thread of the runtime shares its timer
//!   driver.
//!
//! `cargo bench -p benches --bench bench_shared_lines`; each figure is the time of one
//! operation on every thread at once (so with 2 threads, two).
//!
//! ## Results (2026-11-27, 2-vCPU VM)
//!
//! Criterion's estimate (median of its interval), `--warm-up-time 1 --measurement-time 3`.
//!
//! `redo_budget` (`417aad3` and the commit after it): `417aad3`'s budget (a tokio semaphore
//! behind a timeout, an `Arc` clone of it per reservation, a prometheus gauge added to and
//! subtracted from) run once just before the change, the lock-free budget three times after:
//!
//! | threads | tokio semaphore and gauge (`417aad3`) | one shared word |
//! |---|---:|---:|
//! | 1 | 95.1 ns | 35.0, 34.8, 35.0 ns |
//! | 2 | 606.9 ns | 66.5, 56.0, 53.4 ns |
//!
//! With two threads the semaphore's release (which always takes its waiters' lock), the
//! `Arc` and the gauge moved four lines between the cores per pair; now one word moves.
//!
//! `record_copies` (`2171669`), two runs:
//!
//! | threads | shared | own |
//! |---|---:|---:|
//! | 1 | 348.8, 352.4 ns | 569.1, 580.4 ns |
//! | 2 | 1670.2, 1027.0 ns | 853.8, 816.2 ns |
//!
//! Alone, the copy costs a thread 0.22 us more per lookup (7 KB copied, one allocation more);
//! with a second thread taking records of the same buffers, the shared counts cost more than
//! that (1.2-2.0x the own copy's time).
//!
//! `timer` (the commit after `799b438`), two runs: 1 thread 85.7, 87.3 ns; 2 threads 278.2,
//! 264.7 ns (3.1x): the runtime's timer driver is one lock. A redo request that waits for its
//! reply on the yielding path makes one or two such timers (its pipe's readiness, its turn to
//! read); the reply writes and the writes to the child make none when they are done at once
//! (`util::timeout_if_pending`).
//!
//! ## Results (2026-11-27, 16 cores, commit 520f3a8)
//!
//! The lent 16-core machine (`test_runner/performance/many_cores.sh`, `--measurement-time 2
//! --warm-up-time 1`; its time limit cut the run off before `record_copies/own/16` and the ids
//! after it):
//!
//! | threads | redo_budget/reserve | timer/register | record_copies/shared | record_copies/own |
//! |---|---:|---:|---:|---:|
//! | 1 | 61 ns | 287 ns | 0.92 us | 1.18 us |
//! | 2 | 183 ns | 1.27 us | 3.19 us | 1.41 us |
//! | 16 | 1.53 us | 42.1 us | 12.5 us | |
//!
//! Every thread doing nothing else is the worst case: per GetPage the daemon does each once or
//! twice among some 40 us of other work. The timer's 16-thread figure includes the runtime's
//! wake-ups that each `yield_now` makes (docs/performance.md, "Issue 23 on 16 cores at
//! `520f3a8`").

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use futures_util::FutureExt;
use pageserver::redo_budget::RedoBudget;

/// What a chain10 GetPage reserves: its image, 10 records and their bookkeeping.
const HOLDS: u64 = 12 << 10;
/// A chain10 lookup's records, and their length.
const RECORDS: usize = 10;
const RECORD_LEN: usize = 700;

/// A lookup's records as slices of the group buffers, passed through three owners.
fn shared_copies(groups: &[Bytes], i: u64) -> usize {
    let snapshot: Vec<Bytes> = (0..RECORDS)
        .map(|r| {
            let g = &groups[(i as usize + r * 5) % groups.len()];
            let at = (r * 4099 + i as usize * 131) % (g.len() - RECORD_LEN);
            g.slice(at..at + RECORD_LEN)
        })
        .collect();
    let plan: Vec<Bytes> = snapshot.to_vec();
    drop(snapshot);
    let request: Vec<Bytes> = plan.to_vec();
    drop(plan);
    request.iter().map(Bytes::len).sum()
}

/// The same records copied into one buffer of the lookup's own first.
fn own_copies(groups: &[Bytes], i: u64) -> usize {
    let mut bytes = Vec::with_capacity(RECORDS * RECORD_LEN);
    for r in 0..RECORDS {
        let g = &groups[(i as usize + r * 5) % groups.len()];
        let at = (r * 4099 + i as usize * 131) % (g.len() - RECORD_LEN);
        bytes.extend_from_slice(&g[at..at + RECORD_LEN]);
    }
    let bytes = Bytes::from(bytes);
    let snapshot: Vec<Bytes> =
        (0..RECORDS).map(|r| bytes.slice(r * RECORD_LEN..(r + 1) * RECORD_LEN)).collect();
    let plan: Vec<Bytes> = snapshot.to_vec();
    drop(snapshot);
    let request: Vec<Bytes> = plan.to_vec();
    drop(plan);
    request.iter().map(Bytes::len).sum()
}

fn bench(c: &mut Criterion) {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let mut group = c.benchmark_group("redo_budget");
    for threads in benches::contending_threads() {
        group.bench_function(format!("reserve/{threads}"), |b| {
            let budget =
                Arc::new(RedoBudget::new(256 << 20, Duration::from_secs(60), Arc::new(AtomicU64::new(0))));
            let op: benches::Op = Arc::new(move |_| {
                let reserved = budget.reserve(HOLDS).now_or_never();
                assert!(matches!(reserved, Some(Ok(_))), "the budget had room");
            });
            b.iter_custom(|iters| benches::at_once(threads, iters, runtime.handle(), &op));
        });
    }
    group.finish();
    let mut group = c.benchmark_group("timer");
    for threads in benches::contending_threads() {
        group.bench_function(format!("register/{threads}"), |b| {
            let op: benches::Op = Arc::new(|_| {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                let mut wait = std::pin::pin!(tokio::time::timeout_at(deadline, tokio::task::yield_now()));
                // The first poll registers the timer (the inner future is not ready yet); the
                // second finds it done, and the drop cancels the timer.
                assert!(wait.as_mut().now_or_never().is_none(), "a yield is pending at first");
                assert!(wait.as_mut().now_or_never().is_some(), "a yield is done at the second poll");
            });
            b.iter_custom(|iters| benches::at_once(threads, iters, runtime.handle(), &op));
        });
    }
    group.finish();
    let groups: Arc<Vec<Bytes>> = Arc::new((0..16u8).map(|g| Bytes::from(vec![g; 64 << 10])).collect());
    let mut group = c.benchmark_group("record_copies");
    for threads in benches::contending_threads() {
        for (name, take) in [("shared", shared_copies as fn(&[Bytes], u64) -> usize), ("own", own_copies)] {
            group.bench_function(format!("{name}/{threads}"), |b| {
                let groups = Arc::clone(&groups);
                let op: benches::Op = Arc::new(move |i| {
                    assert_eq!(std::hint::black_box(take(&groups, i)), RECORDS * RECORD_LEN);
                });
                b.iter_custom(|iters| benches::at_once(threads, iters, runtime.handle(), &op));
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
