//! The cluster's state beyond relations, read back from a tenant's timeline (the room
//! ARCHITECTURE.md names `tenant/cluster/`): the checkpoint counters as of an LSN
//! ([`counters_at`], where the WAL receiver resumes them), and whether an SLRU page's newest
//! value belongs to a segment truncated since ([`slru_segment_dropped`], GetPage of SLRU
//! pages). The values themselves are written by the ingest side (`crate::ingest::counters`,
//! `crate::ingest::slru`), in the key space of `page_types::keys`.
//!
//! Invariant: reads only; nothing is cached across calls. Layer: under `tenant`, used by
//! `tenant.rs` and the WAL receiver; it imports `storage` and `ingest` only.

use anyhow::Context;
use page_types::control_file::ControlFile;
use page_types::keys::{self, SlruKind};
use page_types::{BufferTag, Lsn, PAGE_SIZE};

use crate::ingest::counters::{self, Counters};
use crate::storage::{DiskWait, GetError, ReadLimits, Timeline};

/// The image of `key` (a key whose values are images) as of `lsn`, with its LSN; `None` if it
/// has none.
pub(crate) async fn image_at(
    timeline: &Timeline,
    key: BufferTag,
    lsn: Lsn,
) -> anyhow::Result<Option<(Lsn, bytes::Bytes)>> {
    let limits = ReadLimits { max_records: 0, max_bytes: PAGE_SIZE as u64 };
    let plan = match timeline.plan_read_async(key, lsn, limits).await {
        Ok(plan) => plan,
        Err(GetError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(anyhow::Error::new(e)).with_context(|| format!("look up {key}")),
    };
    let data = timeline.read_planned(plan).await.with_context(|| format!("read {key}"))?;
    data.image.map(Some).with_context(|| format!("{key} holds records, not a value"))
}

/// The checkpoint counters as of `lsn`: the newest stored value, else (none stored yet: only
/// the import) the imported `pg_control`'s copy of its last checkpoint.
pub async fn counters_at(timeline: &Timeline, lsn: Lsn) -> anyhow::Result<Counters> {
    if let Some((at, value)) = image_at(timeline, keys::checkpoint_key(), lsn).await? {
        return counters::decode(&value).map_err(|e| anyhow::anyhow!("the checkpoint counters at {at}: {e}"));
    }
    let (at, file) = image_at(timeline, keys::control_file_key(), lsn)
        .await?
        .context("no pg_control stored (the import stores it)")?;
    counters::from_control_file(&file).map_err(|e| anyhow::anyhow!("pg_control at {at}: {e}"))
}

/// The cluster's `pg_control` as the import stored it (nothing rewrites it), as of `lsn`.
pub async fn control_file_at(timeline: &Timeline, lsn: Lsn) -> anyhow::Result<ControlFile> {
    let (at, file) = image_at(timeline, keys::control_file_key(), lsn)
        .await?
        .context("no pg_control stored (the import stores it)")?;
    ControlFile::decode(&file).map_err(|e| anyhow::anyhow!("pg_control at {at}: {e}"))
}

/// Whether SLRU segment `segno` of `kind` was truncated after `version` (the LSN of a page's
/// newest value), at or below `lsn`: then the page does not exist as of `lsn`. Reads only the
/// index.
pub fn slru_segment_dropped(
    timeline: &Timeline,
    kind: SlruKind,
    segno: u32,
    version: Lsn,
    lsn: Lsn,
    wait: DiskWait,
) -> Result<bool, GetError> {
    let dropped = timeline.version_at(keys::slru_segment_drop_key(kind, segno), lsn, wait)?;
    Ok(dropped.is_some_and(|d| d > version))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::storage::{IngestBatch, StorageConf, StorageMetrics, Value};

    fn timeline(dir: &std::path::Path) -> Arc<Timeline> {
        Timeline::open(dir, StorageConf::default(), Arc::new(StorageMetrics::unregistered())).unwrap()
    }

    async fn store(tl: &Timeline, lsn: u64, key: BufferTag, value: Bytes) {
        tl.ingest(IngestBatch { values: vec![(key, Lsn(lsn), Value::Image(value))] }).await.unwrap();
    }

    #[tokio::test]
    async fn counters_come_from_the_newest_value_else_from_pg_control() {
        let dir = tempfile::tempdir().unwrap();
        let tl = timeline(dir.path());
        assert!(counters_at(&tl, Lsn::LATEST).await.is_err(), "neither");
        // A pg_control that is not PostgreSQL 15's is an error naming it.
        store(&tl, 1, keys::control_file_key(), Bytes::from(vec![0u8; 8192])).await;
        let err = counters_at(&tl, Lsn::LATEST).await.unwrap_err();
        assert!(format!("{err:#}").contains("pg_control at 0/1"), "{err:#}");
        let mut c = Counters { next_xid: 1000, ..Counters::default() };
        store(&tl, 5, keys::checkpoint_key(), Bytes::copy_from_slice(&c.encode())).await;
        c.next_xid = 2000;
        store(&tl, 9, keys::checkpoint_key(), Bytes::copy_from_slice(&c.encode())).await;
        assert_eq!(counters_at(&tl, Lsn(8)).await.unwrap().next_xid, 1000);
        assert_eq!(counters_at(&tl, Lsn::LATEST).await.unwrap().next_xid, 2000);
        store(&tl, 10, keys::checkpoint_key(), Bytes::from_static(b"short")).await;
        assert!(counters_at(&tl, Lsn::LATEST).await.is_err());
    }

    #[tokio::test]
    async fn a_segment_dropped_after_a_page_s_value_hides_it_until_a_newer_value() {
        let dir = tempfile::tempdir().unwrap();
        let tl = timeline(dir.path());
        store(&tl, 10, keys::slru_segment_drop_key(SlruKind::Clog, 3), Bytes::new()).await;
        let dropped = |version: u64, lsn: u64| {
            slru_segment_dropped(&tl, SlruKind::Clog, 3, Lsn(version), Lsn(lsn), DiskWait::Allowed).unwrap()
        };
        assert!(dropped(5, 10) && dropped(5, 20));
        assert!(!dropped(5, 9), "not yet dropped");
        assert!(!dropped(12, 20), "a page written after the drop");
        assert!(!slru_segment_dropped(&tl, SlruKind::Clog, 4, Lsn(5), Lsn(20), DiskWait::Allowed).unwrap());
    }
}
