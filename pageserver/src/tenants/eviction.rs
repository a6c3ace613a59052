//! The local disk as a cache of the bucket: one task per daemon keeps the layer files of all
//! tenants under `max_local_disk` by evicting, least recently read first, layers that the
//! bucket's index of their timeline lists (`storage::Timeline::evict`; a read fetches one back).
//! Layers not yet in the bucket are never evicted: when they alone exceed the bound (the bucket
//! is unreachable or slow), every timeline refuses ingest with a clear error until uploads catch
//! up (reads go on; one that needs an evicted layer waits for the bucket).
//!
//! Each round (every [`PERIOD`]) advances the read clock (`storage::tick_read_clock`), counts
//! the resident layers, and, above the bound, evicts down to [`LOW_WATER`] of it, so that a
//! disk near the bound is not trimmed a layer at a time. The bound is checked once a round:
//! what is ingested within a round can pass it.
//!
//! **Invariant:** a layer is evicted only if its timeline's uploader has it in the index it
//! uploaded last, and its tenant's generation was not taken over by another node (a stale
//! node's layers may be deleted from the bucket by the newer one).

use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Tenants;
use crate::storage::{self, StorageMetrics};
use crate::tenant::Tenant;

/// How often the evictor looks.
pub(crate) const PERIOD: Duration = Duration::from_secs(1);
/// Above the bound, evict down to this share of it.
const LOW_WATER: f64 = 0.9;

/// Runs the evictor over the timelines `tenants` serves until `cancel` (or they are dropped).
pub(crate) async fn run(
    tenants: Weak<Tenants>,
    max_local_disk: u64,
    metrics: Arc<StorageMetrics>,
    cancel: CancellationToken,
) {
    let mut refusing = false;
    loop {
        tokio::select! {
            () = tokio::time::sleep(PERIOD) => {}
            () = cancel.cancelled() => return,
        }
        storage::tick_read_clock();
        let Some(tenants) = tenants.upgrade() else { return };
        let timelines = tenants.serving();
        drop(tenants);
        let metrics = Arc::clone(&metrics);
        let round =
            tokio::task::spawn_blocking(move || round(&timelines, max_local_disk, &metrics, refusing)).await;
        match round {
            Ok(now_refusing) => refusing = now_refusing,
            Err(e) => tracing::error!("eviction round failed: {e}"),
        }
    }
}

/// One round over `timelines` (blocking: unlinks); whether ingest is refused after it.
fn round(timelines: &[Arc<Tenant>], max: u64, metrics: &StorageMetrics, refusing: bool) -> bool {
    let mut total = 0u64;
    let mut candidates = Vec::new();
    for (i, t) in timelines.iter().enumerate() {
        let uploaded = t.remote.as_ref().filter(|r| !r.status().stale);
        for l in t.timeline.resident_layers() {
            total += l.size;
            if l.evictable && uploaded.is_some_and(|r| r.is_uploaded(&l.name)) {
                candidates.push((l.last_read, i, l.name, l.size));
            }
        }
    }
    if total > max {
        let target = (max as f64 * LOW_WATER) as u64;
        candidates.sort();
        for (_, i, name, size) in candidates {
            if total <= target {
                break;
            }
            match timelines[i].timeline.evict(&name) {
                Ok(true) => total -= size,
                Ok(false) => {}
                Err(e) => tracing::warn!(
                    tenant_id = timelines[i].id,
                    layer = name,
                    "could not evict a layer: {e:#}"
                ),
            }
        }
    }
    metrics.resident_layer_bytes.set(total as i64);
    let refuse = total > max;
    if refuse || refusing {
        let why = refuse.then(|| {
            format!(
                "the layer files on local disk ({total} bytes) exceed max_local_disk ({max} bytes) and \
                 none of them can be evicted: the rest is not in the bucket yet; ingest resumes once \
                 uploads catch up"
            )
        });
        if refuse != refusing {
            match &why {
                Some(why) => tracing::warn!("refusing ingest: {why}"),
                None => tracing::info!(total, max, "layer files back under max_local_disk: ingest resumes"),
            }
        }
        for t in timelines {
            t.timeline.refuse_ingest(why.clone());
        }
    }
    refuse
}
