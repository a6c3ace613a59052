//! `CREATE DATABASE ... STRATEGY FILE_COPY` as the WAL receiver stores it: PostgreSQL copies
//! the template's files without WAL for their blocks (`XLOG_DBASE_CREATE_FILE_COPY` names only
//! the two databases), so the new database's values are the template's as of the record, read
//! back from storage: every block of every fork (built as GetPage builds it), each fork's
//! size and the relation map, stored as images at the record's end LSN under the new
//! database's keys (the relfilenodes are the template's, as in PostgreSQL's copy).
//!
//! The copy is held in memory as one batch (all values at one LSN): a template of more than
//! [`MAX_COPY_BYTES`] is refused (the receiver's `error` state names the record and the size),
//! never stored in part.
//!
//! Layer: under `tenant`, used by the WAL receiver; it reads through `rel_sizes` and `cluster`
//! and builds pages through the tenant's GetPage ([`PageSource`]).

use std::sync::Arc;

use anyhow::Context;
use bytes::Bytes;
use futures_util::future::BoxFuture;
use page_types::keys::{self, KeyKind, RelTag};
use page_types::{BufferTag, Lsn, PAGE_SIZE};

use super::{cluster, rel_sizes};
use crate::ingest::wal_values::{DatabaseCopy, RelSizes};
use crate::storage::{Timeline, Value};

/// The tenant's GetPage for the copy: the page `key` as of `lsn` (`None`: not found).
pub type PageSource =
    Arc<dyn Fn(BufferTag, Lsn) -> BoxFuture<'static, anyhow::Result<Option<Bytes>>> + Send + Sync>;

/// The largest template a database copy takes (its blocks, in memory until stored).
pub const MAX_COPY_BYTES: u64 = 256 << 20;

/// The values of `copy` at `lsn` (the record's end), read as of `read_at` (a durable LSN at or
/// below the record with every value of the records before it), with the sizes set in `sizes`.
pub async fn values(
    timeline: &Arc<Timeline>,
    pages: &PageSource,
    copy: &DatabaseCopy,
    read_at: Lsn,
    lsn: Lsn,
    sizes: &mut RelSizes,
) -> anyhow::Result<Vec<(BufferTag, Lsn, Value)>> {
    let listed = Arc::clone(timeline);
    let size_keys = tokio::task::spawn_blocking(move || rel_sizes::rel_size_keys(&listed))
        .await
        .context("list the relation sizes")??;
    let mut forks = Vec::new();
    let mut bytes = 0u64;
    for key in size_keys {
        let KeyKind::RelSize { rel, fork } = keys::classify(&key) else { continue };
        if (rel.spcnode, rel.dbnode) != (copy.src_spc, copy.src_db) {
            continue;
        }
        let blocks = rel_sizes::rel_size_at(timeline, rel, fork, read_at)
            .await
            .with_context(|| format!("the size of {rel} fork {fork}"))?;
        if let Some(blocks) = blocks {
            bytes += u64::from(blocks) * PAGE_SIZE as u64;
            forks.push((rel, fork, blocks));
        }
    }
    anyhow::ensure!(
        bytes <= MAX_COPY_BYTES,
        "the template database {} holds {} MiB, more than the {} MiB a database copy takes; \
         use CREATE DATABASE ... STRATEGY WAL_LOG (PostgreSQL 15's default)",
        copy.src_db,
        bytes >> 20,
        MAX_COPY_BYTES >> 20
    );
    let mut out = Vec::with_capacity(forks.len() * 2);
    for (rel, fork, blocks) in forks {
        let new = RelTag { spcnode: copy.spc, dbnode: copy.db, relnode: rel.relnode };
        for blkno in 0..blocks {
            let key = rel.page(fork, blkno);
            if let Some(page) =
                pages(key, read_at).await.with_context(|| format!("read {key} at {read_at}"))?
            {
                out.push((new.page(fork, blkno), lsn, Value::Image(page)));
            }
        }
        sizes.set_copied(new, fork, Some(blocks), lsn, &mut out);
    }
    let map = cluster::image_at(timeline, keys::relmap_key(copy.src_spc, copy.src_db), read_at)
        .await?
        .with_context(|| format!("the template database {} has no relation map", copy.src_db))?;
    out.push((keys::relmap_key(copy.spc, copy.db), lsn, Value::Image(map.1)));
    Ok(out)
}
