//! Relation sizes and relation drops as the read path sees them, read from a tenant's
//! timeline: the size of a relation fork at an LSN ([`rel_size_at`], GetRelSize and
//! GetRelExists, and the WAL receiver's size cache), whether a page's newest value belongs to a
//! dropped incarnation of its relfilenode ([`dropped_incarnation`]) and what PostgreSQL reads at
//! a page no value of the relation wrote ([`unwritten_page`]), and every size key a timeline
//! holds ([`rel_size_keys`]). The values themselves are written by the ingest side
//! (`crate::ingest`: the base-backup import and the WAL-to-values step), in the key space of
//! `page_types::keys`.
//!
//! **The sizes an interrupted import stored** ([`rel_size_keys`], which a retry marks dropped
//! where its backup lacks them) are found without reading the key space, whose every key a
//! whole-tenant listing would hold at once (gigabytes for a terabyte cluster). In key order a
//! relation's size keys follow its pages (forks 0 to 3, then sizes at 0x80 up), so they are
//! not one range a range read could take; a skip scan of each layer goes from a relation's
//! first key to just below its sizes and from there to the next relation
//! (`keys::rel_sizes_skip`), reading at most one index block per key it lands on. Its memory
//! is the size keys, one per relation fork, whatever the relations' pages. Recording the keys
//! each attempt stores (in `wal_source.json` or a file of their own) would bound it as well,
//! but adds durable state to keep in step with storage across crashes, and an import
//! interrupted by an earlier build would have no such record; the scan needs neither.
//!
//! Invariant: reads only (no value is written here); a size is served from storage as stored,
//! nothing is cached across calls. Layer: under `tenant`, used by `tenant.rs` and the WAL
//! receiver; it imports `storage` only.

use bytes::Bytes;
use page_types::keys::{self, RelTag};
use page_types::{BufferTag, Lsn};

use crate::storage::{DiskWait, GetError, ReadLimits, Timeline};

/// The size of `fork` of `rel` as of `lsn` from `timeline`: `None` if it does not exist then
/// (no size value, the dropped marker, or a drop of its database newer than its size value).
/// A value read like a page's image (no redo), through [`Timeline::read_planned`]: for the page
/// service's GetRelSize and for the receiver's sizes alike.
pub async fn rel_size_at(
    timeline: &Timeline,
    rel: RelTag,
    fork: u8,
    lsn: Lsn,
) -> Result<Option<u32>, GetError> {
    let limits = ReadLimits { max_records: 0, max_bytes: page_types::PAGE_SIZE as u64 };
    let data = match timeline.plan_read_async(rel.size_key(fork), lsn, limits).await {
        Ok(plan) => timeline.read_planned(plan).await?,
        Err(GetError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let dropped = timeline.version_at(keys::db_drop_key(rel.spcnode, rel.dbnode), lsn, DiskWait::Allowed)?;
    let bad = |what: String| GetError::Io(anyhow::anyhow!("the size of {rel} fork {fork}: {what}"));
    let Some((at, bytes)) = &data.image else {
        return Err(bad("the size key holds records, not a value".into()));
    };
    let blocks = keys::decode_rel_size(bytes).map_err(|e| bad(format!("at {at}: {e}")))?;
    Ok(blocks.filter(|_| dropped.is_none_or(|d| d < *at)))
}

/// Every relation size key `timeline` holds, in key order (the sizes an interrupted import
/// may have stored), by a skip scan ([`Timeline::scan_keys`], [`keys::rel_sizes_skip`]): at
/// most an index block per relation and size key in each layer, whatever the relations' pages.
/// Blocking: call it from a blocking thread.
pub fn rel_size_keys(timeline: &Timeline) -> anyhow::Result<Vec<BufferTag>> {
    timeline
        .scan_keys(&|key| matches!(keys::classify(key), keys::KeyKind::RelSize { .. }), &keys::rel_sizes_skip)
}

/// Whether the newest value of relation page `key` at or below `lsn`, at `version` (`None`: it
/// has none), belongs to a dropped incarnation of its relfilenode: a drop of its relation or of
/// its database lies above it, at or below `lsn`. The page PostgreSQL has then is not that
/// value: a block the new relation extended to without WAL (bulk extension) reads as zeros, a
/// block past its end does not exist ([`unwritten_page`]). Reads only the index.
pub fn dropped_incarnation(
    timeline: &Timeline,
    key: BufferTag,
    version: Option<Lsn>,
    lsn: Lsn,
    wait: DiskWait,
) -> Result<bool, GetError> {
    let rel = RelTag::of(&key);
    let newer = |drop: Option<Lsn>| drop.is_some_and(|d| version.is_none_or(|v| v < d));
    Ok(newer(timeline.version_at(rel.drop_key(), lsn, wait)?)
        || newer(timeline.version_at(keys::db_drop_key(key.spcnode, key.dbnode), lsn, wait)?))
}

/// What PostgreSQL reads at relation page `key` as of `lsn` when no value written to that
/// block belongs to the relation then: within the fork's size, a page it extended to without
/// WAL (all zeros); past it, or in a fork that does not exist, nothing (`Ok(None)`).
pub async fn unwritten_page(
    timeline: &Timeline,
    key: BufferTag,
    lsn: Lsn,
) -> Result<Option<Bytes>, GetError> {
    static ZERO_PAGE: [u8; page_types::PAGE_SIZE] = [0; page_types::PAGE_SIZE];
    let rel = RelTag::of(&key);
    let size = rel_size_at(timeline, rel, key.forknum, lsn).await?;
    Ok(size.filter(|n| key.blknum < *n).map(|_| Bytes::from_static(&ZERO_PAGE)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::Value;
    use page_types::keys::{MAIN_FORK, VM_FORK};

    fn rel() -> RelTag {
        RelTag { spcnode: 1663, dbnode: 5, relnode: 16384 }
    }

    #[tokio::test]
    async fn rel_size_keys_read_index_blocks_per_relation_not_per_page() {
        use crate::storage::{IngestBatch, StorageConf, StorageMetrics};
        const PAGES: u32 = 3000;
        let dir = tempfile::tempdir().unwrap();
        let metrics = std::sync::Arc::new(StorageMetrics::unregistered());
        let tl = Timeline::open(dir.path(), StorageConf::default(), metrics).unwrap();
        let rels: Vec<RelTag> = (0..6).map(|i| RelTag { relnode: 16384 + i, ..rel() }).collect();
        let size = |blocks: Option<u32>| Value::Image(Bytes::from(keys::encode_rel_size(blocks)));
        let ingest = |lsn: u64, values: Vec<(BufferTag, Value)>| {
            let values = values.into_iter().map(|(k, v)| (k, Lsn(lsn), v)).collect();
            tl.ingest(IngestBatch { values })
        };
        let pages = |r: RelTag, fork: u8| {
            (0..PAGES).map(move |b| (r.page(fork, b), Value::Record(Bytes::from_static(b"r"))))
        };
        // A first layer: the cluster's other keys, every relation's pages (the main fork, and
        // the map of one), and the sizes of four of them.
        let mut others: Vec<(BufferTag, Value)> =
            (0..32).map(|p| (keys::slru_page_key(keys::SlruKind::Clog, 0, p), size(None))).collect();
        others.push((keys::control_file_key(), size(None)));
        others.push((keys::relmap_key(1663, 5), size(None)));
        others.push((keys::db_drop_key(1663, 4), size(None)));
        ingest(1, others).await.unwrap();
        for (i, r) in rels.iter().enumerate() {
            ingest(2 + i as u64, pages(*r, MAIN_FORK).collect()).await.unwrap();
        }
        ingest(10, pages(rels[1], VM_FORK).collect()).await.unwrap();
        let mut want =
            vec![rels[0].size_key(0), rels[1].size_key(0), rels[1].size_key(2), rels[3].size_key(0)];
        ingest(11, want.iter().map(|k| (*k, size(Some(PAGES)))).collect()).await.unwrap();
        tl.freeze().await.unwrap();
        // A second layer: more pages, a dropped marker; the active segment: one more size.
        ingest(20, pages(rels[2], MAIN_FORK).chain(pages(rels[5], MAIN_FORK)).collect()).await.unwrap();
        ingest(21, vec![(rels[4].size_key(0), size(None)), (rels[0].size_key(0), size(None))]).await.unwrap();
        tl.freeze().await.unwrap();
        ingest(30, vec![(rels[5].size_key(1), size(Some(1)))]).await.unwrap();
        want.extend([rels[4].size_key(0), rels[5].size_key(1)]);
        want.sort();

        let before = tl.index_blocks_read();
        assert_eq!(rel_size_keys(&tl).unwrap(), want);
        let (after, blocks) = tl.index_blocks_read();
        // What a scan is led to in each layer: the first key of each relation (and of each
        // other key's group), and each size key; at most one index block for each.
        let read = after - before.0;
        let led_to = 2 * (rels.len() + 4 + want.len() + 1) as u64;
        assert!(read <= led_to, "{read} index blocks of {blocks} read for {} size keys", want.len());
        assert!(blocks > 4 * led_to, "a test with only {blocks} index blocks shows nothing");
    }
}
