//! The standard `process_*` metrics every Prometheus exporter has (CPU time, memory, file
//! descriptors, threads, start time), read from `/proc/self` and `getrusage` at each scrape,
//! `pageserver_build_info`, and the heap as the allocator sees it
//! (`pageserver_heap_in_use_bytes`, `pageserver_heap_free_bytes`, [`crate::heap::figures`]):
//! of the resident memory, what the daemon holds and what the allocator keeps for reuse.
//!
//! Written here rather than through the prometheus crate's `process` feature, which pulls in
//! `procfs` and its dependency tree for seven numbers. Linux only, like the daemon. A value that
//! cannot be read is left at its last value: a scrape never fails because of it.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{Counter, Gauge, IntGauge, Opts, Registry};

use crate::metrics::Instruments;

/// `--version` and `/v1/status`: the crate version and the git commit of the build.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_COMMIT: &str = env!("GIT_COMMIT");

/// Registers the process collector and `pageserver_build_info{version, git_commit} 1`.
pub fn register(registry: &Registry) -> anyhow::Result<()> {
    let build_info = IntGauge::with_opts(
        Opts::new("pageserver_build_info", "Build of the running daemon (always 1)")
            .const_label("version", VERSION)
            .const_label("git_commit", GIT_COMMIT),
    )?;
    build_info.set(1);
    registry.register(Box::new(build_info))?;
    registry.register(Box::new(ProcessCollector::new()?))?;
    Ok(())
}

struct Metrics {
    cpu_seconds: Counter,
    open_fds: Gauge,
    max_fds: Gauge,
    virtual_memory: Gauge,
    resident_memory: Gauge,
    start_time: Gauge,
    threads: Gauge,
    heap_in_use: Gauge,
    heap_free: Gauge,
}

impl Instruments for Metrics {
    fn all(&self) -> Vec<&dyn Collector> {
        vec![
            &self.cpu_seconds,
            &self.open_fds,
            &self.max_fds,
            &self.virtual_memory,
            &self.resident_memory,
            &self.start_time,
            &self.threads,
            &self.heap_in_use,
            &self.heap_free,
        ]
    }
}

/// Reads the process's numbers when collected.
pub struct ProcessCollector {
    descs: Vec<Desc>,
    /// Held while updating and collecting, so that two scrapes never interleave.
    metrics: Mutex<Metrics>,
}

impl ProcessCollector {
    pub fn new() -> anyhow::Result<ProcessCollector> {
        let metrics = Metrics {
            cpu_seconds: Counter::new(
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
            )?,
            open_fds: Gauge::new("process_open_fds", "Number of open file descriptors.")?,
            max_fds: Gauge::new("process_max_fds", "Maximum number of open file descriptors.")?,
            virtual_memory: Gauge::new("process_virtual_memory_bytes", "Virtual memory size in bytes.")?,
            resident_memory: Gauge::new("process_resident_memory_bytes", "Resident memory size in bytes.")?,
            start_time: Gauge::new(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
            )?,
            threads: Gauge::new("process_threads", "Number of OS threads in the process.")?,
            heap_in_use: Gauge::new(
                "pageserver_heap_in_use_bytes",
                "Bytes of heap the daemon holds (allocator chunks in use, mapped ones included).",
            )?,
            heap_free: Gauge::new(
                "pageserver_heap_free_bytes",
                "Bytes of free heap the allocator keeps in its arenas for reuse (resident where touched).",
            )?,
        };
        let start = start_time().unwrap_or_else(|| {
            // The collector is made at start-up: close enough when /proc cannot say.
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
        });
        metrics.start_time.set(start);
        Ok(ProcessCollector { descs: metrics.descs(), metrics: Mutex::new(metrics) })
    }
}

impl Collector for ProcessCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let m = self.metrics.lock().unwrap_or_else(|poison| poison.into_inner());
        use nix::sys::resource::{getrlimit, getrusage, Resource, UsageWho};
        if let Ok(usage) = getrusage(UsageWho::RUSAGE_SELF) {
            let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
            let total = secs(usage.user_time()) + secs(usage.system_time());
            m.cpu_seconds.reset();
            m.cpu_seconds.inc_by(total);
        }
        if let Some(open) = crate::fds::open_now() {
            m.open_fds.set(open as f64);
        }
        if let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) {
            m.max_fds.set(soft as f64);
        }
        if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
            let field = |name: &str| -> Option<f64> {
                let line = status.lines().find(|l| l.starts_with(name))?;
                line[name.len()..].split_whitespace().next()?.parse().ok()
            };
            if let Some(kib) = field("VmSize:") {
                m.virtual_memory.set(kib * 1024.0);
            }
            if let Some(kib) = field("VmRSS:") {
                m.resident_memory.set(kib * 1024.0);
            }
            if let Some(threads) = field("Threads:") {
                m.threads.set(threads);
            }
        }
        if let Some(heap) = crate::heap::figures() {
            m.heap_in_use.set(heap.in_use as f64);
            m.heap_free.set(heap.free as f64);
        }
        m.families()
    }
}

/// Boot time (`/proc/stat` btime) plus the process's start in clock ticks after boot
/// (`/proc/self/stat` field 22).
fn start_time() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let boot: f64 = stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
    let own = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &own[own.rfind(')')? + 2..];
    let ticks: f64 = rest.split_whitespace().nth(22 - 3)?.parse().ok()?;
    let per_second = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok()??;
    Some(boot + ticks / per_second as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_metrics_have_plausible_values() {
        let registry = Registry::new();
        register(&registry).unwrap();
        let value = |name: &str| crate::metrics::gathered_value(&registry, name);
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_threads") >= 1.0);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
        let start = value("process_start_time_seconds");
        assert!(start <= now + 1.0 && start > now - 24.0 * 3600.0, "{start} vs {now}");
        assert_eq!(value("pageserver_build_info"), 1.0);
        assert!(value("pageserver_heap_in_use_bytes") > 0.0);
    }
}
