//! What a per-request metric update costs when the threads serving GetPage make it at once:
//! a prometheus `Histogram` observation and `IntCounter` increment, shared by all threads,
//! against the same on `pageserver::metrics::sharded`'s types (a shard per thread), with 1 and 2
//! threads (the 2-vCPU machine's cores) and as many as the machine has CPUs where it has more
//! (`benches::contending_threads`).
//!
//! `cargo bench -p benches --bench bench_metrics`; each figure is the time of one observation
//! and one increment on every thread at once (so with 2 threads, two pairs).
//!
//! ## Results (2026-11-27, 2-vCPU VM, the commit after `1005169`)
//!
//! Criterion's estimate (median of its interval), two runs (`--warm-up-time 1
//! --measurement-time 3`, then `5`):
//!
//! | threads | prometheus, shared | sharded |
//! |---|---:|---:|
//! | 1 | 11.7, 12.8 ns | 12.1, 12.6 ns |
//! | 2 | 59.2, 104.4 ns | 13.7, 9.7 ns |
//!
//! With two threads on two vCPUs the shared types cost 4-11x as much per update (their lines
//! move between the cores at every update); the shards cost what one thread alone pays.
//!
//! ## Results (2026-11-27, 16 cores, commit 520f3a8)
//!
//! The lent 16-core machine (`test_runner/performance/many_cores.sh`, `--measurement-time 2
//! --warm-up-time 1`, cut off by its time limit before `metrics/sharded/16`): prometheus 49.0 ns
//! (1 thread), 376 ns (2), 2.15 us (16); sharded 37.1 ns (1), 39.7 ns (2). The shared types'
//! cost grows with the threads, as on 2 vCPUs; the sharded one's 16-thread figure is still to
//! be measured (docs/performance.md, "Metrics in shards").

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use pageserver::metrics::sharded::{ShardedCounter, ShardedHistogram};
use prometheus::{Histogram, HistogramOpts, IntCounter, Opts};

fn opts() -> HistogramOpts {
    HistogramOpts::new("h_seconds", "h")
        .buckets(prometheus::exponential_buckets(5e-6, 2.0, 22).expect("constant buckets"))
}

fn bench(c: &mut Criterion) {
    // The threads run inside a runtime as the daemon's do (the updates need none).
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let mut group = c.benchmark_group("metrics");
    for threads in benches::contending_threads() {
        group.bench_function(format!("prometheus/{threads}"), |b| {
            let h = Histogram::with_opts(opts()).expect("histogram");
            let n = IntCounter::new("n", "n").expect("counter");
            let update: benches::Op = Arc::new(move |i| {
                h.observe((i % 1000) as f64 * 1e-6);
                n.inc();
            });
            b.iter_custom(|iters| benches::at_once(threads, iters, runtime.handle(), &update));
        });
        group.bench_function(format!("sharded/{threads}"), |b| {
            let h = ShardedHistogram::new(opts()).expect("histogram");
            let n = ShardedCounter::new(Opts::new("n", "n")).expect("counter");
            let update: benches::Op = Arc::new(move |i| {
                h.observe((i % 1000) as f64 * 1e-6);
                n.inc();
            });
            b.iter_custom(|iters| benches::at_once(threads, iters, runtime.handle(), &update));
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
