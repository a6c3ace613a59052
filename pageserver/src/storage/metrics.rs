//! Prometheus metrics of the storage layer, created once per process and shared by every
//! timeline (`Arc<StorageMetrics>`), so they are totals over all tenants.
//!
//! **Invariant:** every fsync the storage performs goes through [`StorageMetrics::fsync`], so
//! `pageserver_storage_fsyncs_total` counts them all (group commits, seals, directory syncs).

use std::time::Instant;

use anyhow::Context;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntGauge, Registry};

use crate::metrics::sharded::ShardedCounter;

/// The storage metrics, registered in the caller's registry.
#[derive(Debug, Clone)]
pub struct StorageMetrics {
    pub ingested_batches: IntCounter,
    pub ingested_values: IntCounter,
    pub ingested_bytes: IntCounter,
    pub fsyncs: IntCounter,
    pub fsync_seconds: Histogram,
    pub group_commit_batches: Histogram,
    pub layer_files: IntGauge,
    pub torn_tail_truncations: IntCounter,
    /// Failed commit rounds and seal attempts (write, fsync, file creation, ...).
    pub write_errors: IntCounter,
    /// Timelines whose storage writes are currently failing (transiently or for good).
    pub failed_timelines: IntGauge,
    /// GetPage reads served from the kernel's page cache on the calling (executor) thread.
    /// In shards (`metrics::sharded`): every GetPage that is not a cache hit counts it.
    pub reads_inline: ShardedCounter,
    /// GetPage reads that would have waited for the disk, run on the blocking pool instead.
    pub reads_offloaded: IntCounter,
    /// GetPage plans that needed an index block the kernel's page cache did not hold, made on
    /// the blocking pool instead.
    pub plans_offloaded: IntCounter,
    /// Layers fetched on demand (`storage::residence`): count, seconds each (their bytes are
    /// the source's to count: `pageserver_remote_downloaded_bytes_total`).
    pub layer_downloads: IntCounter,
    pub layer_download_seconds: Histogram,
    /// Layers evicted from local disk ([`super::Timeline::evict`]).
    pub layer_evictions: IntCounter,
    /// Bytes of resident layer files over all timelines, as the evictor last counted them.
    pub resident_layer_bytes: IntGauge,
}

/// An fsync-like call failed. Marks the error as one that is not retried: after a failed
/// fsync the kernel may have dropped the dirty pages (PostgreSQL's "fsyncgate"), so a later
/// successful fsync would not prove that the data is on disk.
#[derive(Debug, thiserror::Error)]
#[error("fsync failed")]
pub struct FsyncFailed(#[source] pub std::io::Error);

impl StorageMetrics {
    /// Creates the metrics and registers them in `registry`. Fails if they are already there.
    /// Outside storage, [`super::register_metrics`] is the way in: it registers the block
    /// cache's metrics too.
    pub(super) fn new(registry: &Registry) -> anyhow::Result<Self> {
        let counter = |name: &str, help: &str| -> anyhow::Result<IntCounter> {
            let c = IntCounter::new(name, help).with_context(|| format!("create {name}"))?;
            registry.register(Box::new(c.clone())).with_context(|| format!("register {name}"))?;
            Ok(c)
        };
        let histogram = |name: &str, help: &str, buckets: Vec<f64>| -> anyhow::Result<Histogram> {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .with_context(|| format!("create {name}"))?;
            registry.register(Box::new(h.clone())).with_context(|| format!("register {name}"))?;
            Ok(h)
        };
        let gauge = |name: &str, help: &str| -> anyhow::Result<IntGauge> {
            let g = IntGauge::new(name, help).with_context(|| format!("create {name}"))?;
            registry.register(Box::new(g.clone())).with_context(|| format!("register {name}"))?;
            Ok(g)
        };
        let layer_files = IntGauge::new(
            "pageserver_storage_layer_files",
            "Sealed layer files currently open, over all timelines",
        )
        .context("create pageserver_storage_layer_files")?;
        registry
            .register(Box::new(layer_files.clone()))
            .context("register pageserver_storage_layer_files")?;
        Ok(StorageMetrics {
            ingested_batches: counter(
                "pageserver_storage_ingested_batches_total",
                "Ingest batches made durable",
            )?,
            ingested_values: counter(
                "pageserver_storage_ingested_values_total",
                "Values (images and records) made durable",
            )?,
            ingested_bytes: counter(
                "pageserver_storage_ingested_bytes_total",
                "Value bytes made durable (payload only, no framing)",
            )?,
            fsyncs: counter(
                "pageserver_storage_fsyncs_total",
                "fsync/fdatasync calls on storage files and directories",
            )?,
            fsync_seconds: histogram(
                "pageserver_storage_fsync_seconds",
                "Duration of storage fsync/fdatasync calls",
                prometheus::exponential_buckets(0.000_05, 2.0, 16).context("fsync_seconds buckets")?,
            )?,
            group_commit_batches: histogram(
                "pageserver_storage_group_commit_batches",
                "Ingest batches made durable by one group-commit fsync",
                prometheus::exponential_buckets(1.0, 2.0, 12).context("group_commit_batches buckets")?,
            )?,
            layer_files,
            torn_tail_truncations: counter(
                "pageserver_storage_torn_tail_truncations_total",
                "Torn or corrupt active-segment tails cut during recovery",
            )?,
            write_errors: counter(
                "pageserver_storage_write_errors_total",
                "Failed storage commit rounds and seal attempts (ENOSPC, EMFILE, EIO, ...)",
            )?,
            failed_timelines: gauge(
                "pageserver_storage_failed_timelines",
                "Timelines whose storage writes are failing now (ingest refused)",
            )?,
            reads_inline: {
                let c = ShardedCounter::new(prometheus::Opts::new(
                    "pageserver_storage_reads_inline_total",
                    "GetPage reads served from the kernel's page cache on the executor thread",
                ))?;
                registry.register(Box::new(c.clone()))?;
                c
            },
            reads_offloaded: counter(
                "pageserver_storage_reads_offloaded_total",
                "GetPage reads that would have waited for the disk, run on the blocking pool instead",
            )?,
            plans_offloaded: counter(
                "pageserver_storage_plans_offloaded_total",
                "GetPage plans that needed an index block not in the kernel's page cache, made on the blocking pool instead",
            )?,
            layer_downloads: counter(
                "pageserver_storage_layer_downloads_total",
                "Layers downloaded from remote storage on demand (a read needed a layer not on local disk)",
            )?,
            layer_download_seconds: histogram(
                "pageserver_storage_layer_download_seconds",
                "Duration of one on-demand layer download (download, check, fsync, open)",
                prometheus::exponential_buckets(0.001, 2.0, 16).context("layer_download_seconds buckets")?,
            )?,
            layer_evictions: counter(
                "pageserver_storage_layer_evictions_total",
                "Layers evicted from local disk (their file deleted; the bucket holds them)",
            )?,
            resident_layer_bytes: gauge(
                "pageserver_storage_resident_layer_bytes",
                "Bytes of layer files on local disk over all timelines (counted by the evictor, under max_local_disk)",
            )?,
        })
    }

    /// Metrics registered in a throwaway registry, for tests.
    #[cfg(test)]
    pub(crate) fn unregistered() -> Self {
        StorageMetrics::new(&Registry::new()).expect("fresh registry has no metrics")
    }

    /// Runs one fsync-like call, timing and counting it. Its error is an [`FsyncFailed`].
    pub(crate) fn fsync<T>(&self, f: impl FnOnce() -> std::io::Result<T>) -> Result<T, FsyncFailed> {
        let start = Instant::now();
        let r = f();
        self.fsyncs.inc();
        self.fsync_seconds.observe(start.elapsed().as_secs_f64());
        r.map_err(FsyncFailed)
    }
}
