//! Page checksums on the pages a tenant serves. A cluster made with `initdb --data-checksums`
//! checks every page it reads against its `pd_checksum`, and the field of a page stored or
//! rebuilt here is what the full-page image or the imported file had when it was taken, not the
//! checksum of the page as it is now. So when the tenant's cluster has data checksums, a page
//! gets PostgreSQL's checksum for its block number (`page_types::checksum`) as it is built,
//! before the page cache sees it; for any other tenant the field is served as stored.
//!
//! Where the setting comes from: the cluster's `global/pg_control`, which the import stores
//! (`page_types::keys::control_file_key`) and nothing rewrites, read the first time a page is
//! built and kept while the tenant is loaded. A cluster's setting cannot change while it runs
//! (`pg_checksums` works on a stopped cluster), and a restart of the daemon reads it again from
//! storage: nothing new to persist. Only a tenant that follows PostgreSQL asks (its
//! `follows_postgres`; a tenant fed through the page service never has the file); one without
//! the file yet serves pages as stored and looks for it again at the next page it builds.
//!
//! Cost, for clusters with data checksums only: one pass over the page per rebuilt page, and a
//! copy of it where the stored checksum was not already right.
//!
//! Invariant: a page is served with a checksum only when pg_control says so; a page PostgreSQL
//! takes as new (`pd_upper` 0) never gets one.

use std::sync::atomic::{AtomicU8, Ordering};

use anyhow::Context;
use bytes::{Bytes, BytesMut};
use page_types::{checksum, control_file, keys, BufferTag, Lsn, PAGE_SIZE};

use crate::storage::{GetError, ReadLimits, Timeline};

/// Not known yet: the tenant has not found its pg_control.
const UNKNOWN: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

/// Whether a tenant's cluster has data checksums, once known.
#[derive(Debug, Default)]
pub(crate) struct DataChecksums {
    state: AtomicU8,
}

impl DataChecksums {
    /// `page`, block `key` as of `lsn`, as it is served: with PostgreSQL's checksum for its
    /// block number if the tenant's cluster has data checksums (learnt from its pg_control as
    /// of `lsn`, a durable LSN the page was read at), else as it is.
    ///
    /// Cancel-safe: dropping it abandons a read of pg_control; nothing is half done.
    pub(crate) async fn apply(
        &self,
        timeline: &Timeline,
        key: BufferTag,
        lsn: Lsn,
        page: Bytes,
    ) -> anyhow::Result<Bytes> {
        if !self.enabled(timeline, lsn).await? {
            return Ok(page);
        }
        let Ok(stored) = <&[u8; PAGE_SIZE]>::try_from(&page[..]) else {
            return Ok(page);
        };
        if checksum::is_new(stored) {
            return Ok(page);
        }
        let sum = checksum::page_checksum(stored, key.blknum);
        if checksum::stored_checksum(stored) == sum {
            return Ok(page);
        }
        let mut served = BytesMut::from(&page[..]);
        served[checksum::PD_CHECKSUM_OFFSET..checksum::PD_CHECKSUM_OFFSET + 2]
            .copy_from_slice(&sum.to_le_bytes());
        Ok(served.freeze())
    }

    /// Whether the cluster has data checksums; reads pg_control at `lsn` until found.
    async fn enabled(&self, timeline: &Timeline, lsn: Lsn) -> anyhow::Result<bool> {
        match self.state.load(Ordering::Relaxed) {
            ON => return Ok(true),
            OFF => return Ok(false),
            _ => {}
        }
        let limits = ReadLimits { max_records: 0, max_bytes: keys::CONTROL_FILE_SIZE as u64 };
        let plan = match timeline.plan_read_async(keys::control_file_key(), lsn, limits).await {
            Ok(plan) => plan,
            Err(GetError::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(anyhow::Error::new(e)).context("look up pg_control"),
        };
        let data = timeline.read_planned(plan).await.context("read pg_control")?;
        let Some((at, file)) = data.image else {
            anyhow::bail!("pg_control is stored as records, not as the file");
        };
        let version =
            control_file::data_checksum_version(&file).with_context(|| format!("pg_control at {at}"))?;
        let on = version != 0;
        let state = if on { ON } else { OFF };
        if self.state.compare_exchange(UNKNOWN, state, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            tracing::info!(
                data_checksums = on,
                data_checksum_version = version,
                "read the cluster's pg_control"
            );
        }
        Ok(on)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::storage::{IngestBatch, StorageConf, StorageMetrics, Value};

    const KEY: BufferTag = BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum: 7 };

    /// A PostgreSQL 15 control file with `data_checksum_version` set as given (only the fields
    /// `page_types::control_file` reads, which has the real files for its tests).
    fn control_file(data_checksum_version: u32) -> Bytes {
        let mut file = vec![0u8; keys::CONTROL_FILE_SIZE];
        file[8..12].copy_from_slice(&control_file::PG15_CONTROL_VERSION.to_le_bytes());
        file[252..256].copy_from_slice(&data_checksum_version.to_le_bytes());
        let crc = crc32c::crc32c(&file[..288]);
        file[288..292].copy_from_slice(&crc.to_le_bytes());
        Bytes::from(file)
    }

    /// A page that is not new, with a checksum field that is stale (0x1234).
    fn page() -> Bytes {
        let mut page = vec![0u8; PAGE_SIZE];
        page[8..10].copy_from_slice(&0x1234u16.to_le_bytes());
        page[12..14].copy_from_slice(&32u16.to_le_bytes()); // pd_lower
        page[14..16].copy_from_slice(&8000u16.to_le_bytes()); // pd_upper
        page[8000..8010].copy_from_slice(b"some tuple");
        Bytes::from(page)
    }

    fn timeline(dir: &std::path::Path) -> Arc<Timeline> {
        Timeline::open(dir, StorageConf::default(), Arc::new(StorageMetrics::unregistered())).expect("open")
    }

    async fn store(timeline: &Timeline, lsn: u64, value: Bytes) {
        let values = vec![(keys::control_file_key(), Lsn(lsn), Value::Image(value))];
        timeline.ingest(IngestBatch { values }).await.expect("ingest");
    }

    fn checksum_of(page: &Bytes) -> u16 {
        u16::from_le_bytes([page[8], page[9]])
    }

    #[tokio::test]
    async fn pages_get_postgresqls_checksum_once_pg_control_says_the_cluster_has_them() {
        let dir = tempfile::tempdir().expect("temp dir");
        let timeline = timeline(dir.path());
        let checksums = DataChecksums::default();
        // No pg_control yet: served as stored, and not decided.
        timeline
            .ingest(IngestBatch { values: vec![(KEY, Lsn(1), Value::Image(page()))] })
            .await
            .expect("ingest");
        assert_eq!(checksums.apply(&timeline, KEY, Lsn(1), page()).await.expect("apply"), page());
        assert_eq!(checksums.state.load(Ordering::Relaxed), UNKNOWN);

        store(&timeline, 2, control_file(1)).await;
        let served = checksums.apply(&timeline, KEY, Lsn(2), page()).await.expect("apply");
        let raw: &[u8; PAGE_SIZE] = served[..].try_into().expect("a page");
        assert_eq!(checksum_of(&served), checksum::page_checksum(raw, 7));
        assert_ne!(checksum_of(&served), 0x1234);
        assert_eq!(served[10..], page()[10..], "only pd_checksum changes");
        // The same page at another block has another checksum.
        let other = BufferTag { blknum: 8, ..KEY };
        assert_ne!(
            checksum_of(&checksums.apply(&timeline, other, Lsn(2), page()).await.expect("apply")),
            checksum_of(&served)
        );
        // A page already right is served as it is, without a copy.
        let right = served.clone();
        assert_eq!(
            checksums.apply(&timeline, KEY, Lsn(2), served).await.expect("apply").as_ptr(),
            right.as_ptr()
        );
        // A new page is never checksummed.
        let new = Bytes::from(vec![0u8; PAGE_SIZE]);
        assert_eq!(checksums.apply(&timeline, KEY, Lsn(2), new.clone()).await.expect("apply"), new);
        timeline.shutdown().await;
    }

    #[tokio::test]
    async fn a_cluster_without_data_checksums_gets_pages_as_stored() {
        let dir = tempfile::tempdir().expect("temp dir");
        let timeline = timeline(dir.path());
        store(&timeline, 1, control_file(0)).await;
        let checksums = DataChecksums::default();
        assert_eq!(checksums.apply(&timeline, KEY, Lsn(1), page()).await.expect("apply"), page());
        assert_eq!(checksums.state.load(Ordering::Relaxed), OFF);
        timeline.shutdown().await;
    }

    #[tokio::test]
    async fn a_damaged_pg_control_fails_the_page_naming_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let timeline = timeline(dir.path());
        let mut file = control_file(1).to_vec();
        file[252] = 0; // after the CRC was computed
        store(&timeline, 1, Bytes::from(file)).await;
        let checksums = DataChecksums::default();
        let err = checksums.apply(&timeline, KEY, Lsn(1), page()).await.expect_err("a damaged file");
        assert!(format!("{err:#}").contains("pg_control"), "{err:#}");
        assert_eq!(checksums.state.load(Ordering::Relaxed), UNKNOWN);
        timeline.shutdown().await;
    }
}
