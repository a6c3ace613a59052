//! What the daemon-wide redo memory budget (`pageserver::redo_budget`) costs per GetPage when
//! the threads serving GetPage reserve and release room in it at once: one reservation of a
//! chain10 read (about 12 KiB) and its release, with room to spare (the common case), on 1 and
//! 2 threads (the 2-vCPU machine's cores), inside a runtime as the daemon's are.
//!
//! `cargo bench -p benches --bench bench_redo_budget`; each figure is the time of one
//! reservation and its release on every thread at once (so with 2 threads, two pairs).
//!
//! ## Results (2026-11-27, 2-vCPU VM, `417aad3` and the commit after it)
//!
//! Criterion's estimate (median of its interval), `--warm-up-time 1 --measurement-time 3`:
//! `417aad3`'s budget (a tokio semaphore behind a timeout, an `Arc` clone of it per
//! reservation, a prometheus gauge added to and subtracted from) run once just before the
//! change, the lock-free budget three times after it:
//!
//! | threads | tokio semaphore and gauge (`417aad3`) | one shared word |
//! |---|---:|---:|
//! | 1 | 95.1 ns | 35.0, 34.8, 35.0 ns |
//! | 2 | 606.9 ns | 66.5, 56.0, 53.4 ns |
//!
//! With two threads the semaphore's release (which always takes its waiters' lock), the
//! `Arc` and the gauge moved four lines between the cores per pair; now one word moves. Not
//! yet run on 16 cores, where every executor thread serving a GetPage that rebuilds a page
//! makes one such pair.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use futures_util::FutureExt;
use pageserver::redo_budget::RedoBudget;

/// What a chain10 GetPage reserves: its image, 10 records and their bookkeeping.
const HOLDS: u64 = 12 << 10;

/// `iters` reservations and releases on each of `threads` threads at once; the time of the
/// slowest.
fn run(threads: usize, iters: u64, budget: &Arc<RedoBudget>, runtime: &tokio::runtime::Runtime) -> Duration {
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (start, budget, handle) = (Arc::clone(&start), Arc::clone(budget), runtime.handle().clone());
            std::thread::spawn(move || {
                let _runtime = handle.enter();
                start.wait();
                let began = Instant::now();
                for _ in 0..iters {
                    let reserved = budget.reserve(HOLDS).now_or_never();
                    assert!(matches!(reserved, Some(Ok(_))), "the budget had room");
                }
                began.elapsed()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("a bench thread panicked")).max().unwrap_or_default()
}

fn bench(c: &mut Criterion) {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let mut group = c.benchmark_group("redo_budget");
    for threads in [1, 2] {
        group.bench_function(format!("reserve/{threads}"), |b| {
            let used = Arc::new(AtomicU64::new(0));
            let budget = Arc::new(RedoBudget::new(256 << 20, Duration::from_secs(60), used));
            b.iter_custom(|iters| run(threads, iters, &budget, &runtime));
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
