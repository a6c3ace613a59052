//! The async runtime's own figures, read from tokio's runtime metrics at each scrape:
//! `pageserver_executor_workers`, `pageserver_executor_busy_seconds_total` (time the worker
//! threads spent running tasks, all workers together), `pageserver_executor_parks_total` (times
//! a worker thread ran out of work and went to sleep), `pageserver_executor_alive_tasks` and
//! `pageserver_executor_global_queue_depth`.
//!
//! Why: the daemon's CPU per request grows with its executor threads, and where no profiler
//! runs (the 16-core measurement machine has no perf), these say whether the runtime is the
//! cause. Busy seconds over the wall time and the workers is how full the executor is; parks per
//! request is how often a request's work put a thread to sleep and woke it (each park is a
//! `futex` or `epoll_wait` and a wake-up, several microseconds on a VM). `measure.py` reports
//! both per run.
//!
//! Reading them costs nothing on the request path: tokio keeps these counters per worker
//! anyway; the scrape sums them. Only the stable metrics of tokio are used (no
//! `tokio_unstable`).

use std::sync::Mutex;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, Registry};
use tokio::runtime::Handle;

use crate::metrics::Instruments;

/// Registers the collector of `runtime`'s figures.
pub fn register(registry: &Registry, runtime: Handle) -> anyhow::Result<()> {
    registry.register(Box::new(ExecutorCollector::new(runtime)?))?;
    Ok(())
}

struct Metrics {
    workers: Gauge,
    busy_seconds: Counter,
    parks: Counter,
    alive_tasks: Gauge,
    global_queue_depth: Gauge,
}

impl Instruments for Metrics {
    fn all(&self) -> Vec<&dyn Collector> {
        vec![&self.workers, &self.busy_seconds, &self.parks, &self.alive_tasks, &self.global_queue_depth]
    }
}

/// Reads one runtime's figures when collected.
pub struct ExecutorCollector {
    runtime: Handle,
    descs: Vec<Desc>,
    /// Held while updating and collecting, so that two scrapes never interleave.
    metrics: Mutex<Metrics>,
}

impl ExecutorCollector {
    pub fn new(runtime: Handle) -> anyhow::Result<ExecutorCollector> {
        let metrics = Metrics {
            workers: Gauge::new("pageserver_executor_workers", "Worker threads of the async runtime")?,
            busy_seconds: Counter::new(
                "pageserver_executor_busy_seconds_total",
                "Time the async runtime's worker threads spent running tasks, all workers together",
            )?,
            parks: Counter::new(
                "pageserver_executor_parks_total",
                "Times a worker thread of the async runtime ran out of work and went to sleep",
            )?,
            alive_tasks: Gauge::new("pageserver_executor_alive_tasks", "Tasks alive in the async runtime")?,
            global_queue_depth: Gauge::new(
                "pageserver_executor_global_queue_depth",
                "Tasks in the async runtime's global queue, waiting for a worker",
            )?,
        };
        Ok(ExecutorCollector { runtime, descs: metrics.descs(), metrics: Mutex::new(metrics) })
    }
}

impl Collector for ExecutorCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let m = self.metrics.lock().unwrap_or_else(|poison| poison.into_inner());
        let figures = self.runtime.metrics();
        let workers = figures.num_workers();
        let busy: f64 = (0..workers).map(|w| figures.worker_total_busy_duration(w).as_secs_f64()).sum();
        let parks: u64 = (0..workers).map(|w| figures.worker_park_count(w)).sum();
        m.workers.set(workers as f64);
        // Both only grow (tokio's per-worker counters are monotonic); set to the sum.
        m.busy_seconds.reset();
        m.busy_seconds.inc_by(busy);
        m.parks.reset();
        m.parks.inc_by(parks as f64);
        m.alive_tasks.set(figures.num_alive_tasks() as f64);
        m.global_queue_depth.set(figures.global_queue_depth() as f64);
        m.families()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::metrics::gathered_value as value;

    #[test]
    fn figures_follow_the_runtime() {
        let runtime =
            tokio::runtime::Builder::new_multi_thread().worker_threads(3).enable_all().build().unwrap();
        let registry = Registry::new();
        register(&registry, runtime.handle().clone()).unwrap();
        assert_eq!(value(&registry, "pageserver_executor_workers"), 3.0);
        let busy_before = value(&registry, "pageserver_executor_busy_seconds_total");
        let parks_before = value(&registry, "pageserver_executor_parks_total");
        // Work that keeps a worker busy for a while, then sleeps between rounds (each sleep
        // with nothing else to run parks the workers).
        runtime.block_on(async {
            for _ in 0..20 {
                tokio::spawn(async {
                    let until = std::time::Instant::now() + std::time::Duration::from_millis(5);
                    while std::time::Instant::now() < until {
                        std::hint::spin_loop();
                    }
                })
                .await
                .unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
        });
        let busy = value(&registry, "pageserver_executor_busy_seconds_total") - busy_before;
        let parks = value(&registry, "pageserver_executor_parks_total") - parks_before;
        assert!(busy >= 0.09, "20 tasks of 5 ms ran, busy {busy} s");
        assert!(parks >= 10.0, "the workers slept between 20 rounds, parks {parks}");
        // A task alive now is counted.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = runtime.spawn(async move {
            let _ = rx.await;
        });
        assert!(value(&registry, "pageserver_executor_alive_tasks") >= 1.0);
        tx.send(()).unwrap();
        runtime.block_on(task).unwrap();
    }
}
