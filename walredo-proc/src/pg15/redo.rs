//! Redo of the `pg15` family: a stored PostgreSQL 15 WAL record applied to the page of the
//! block it is stored for, as PostgreSQL's own redo routines leave it (`heapam.c`'s
//! `heap_redo`/`heap2_redo`, `nbtxlog.c`'s `btree_redo`, `ginxlog.c`'s `gin_redo`, `gistxlog.c`'s `gist_redo`, `hash_xlog.c`'s `hash_redo`, `spgxlog.c`'s `spg_redo`,
//! `visibilitymap.c`, `seq_redo`, `generic_redo`, `brin_redo`).
//!
//! [`apply`] decodes the record and dispatches on its resource manager: [`super::heap`]
//! (Heap and Heap2, with the heap side of VISIBLE), [`super::btree`] (Btree), [`super::gin`] (Gin),
//! [`super::visibilitymap`] (the map page of VISIBLE, and the derived [`super::VmClear`] and
//! [`super::VmTruncate`]), [`super::sequence`] (Sequence), [`super::generic`] (Generic WAL),
//! [`super::brin`] (BRIN), [`super::gist`] (Gist), [`super::hash`] (Hash), [`super::spgist`] (SPGist),
//! [`super::slru`] (the derived [`ClogSet`] of a transaction's commit or abort, on a CLOG page:
//! `clog.c`'s `TransactionIdSetTreeStatus` in `xact_redo`; the derived [`SlruWrite`] of a
//! MultiXact `CREATE_ID`, on its offsets and members pages: `RecordNewMultiXact`). [`redo_restored_image`] is the part
//! of a record's redo that PostgreSQL applies to a full-page image it restores (`BLK_RESTORED`).
//! A record of another resource manager, or of a type not applied yet, is
//! [`RedoError::Unsupported`] naming it.
//!
//! **As PostgreSQL's redo does:** a record whose end LSN is at or below the page's LSN is
//! already in the page and is skipped (`XLogReadBufferForRedo`'s `BLK_DONE`; it happens to a
//! page copied by a base backup after the record changed it), except a record that
//! initialises its block (`will_init`), which starts from a zeroed page whatever was there;
//! a page the routine changes gets the record's end LSN as `pd_lsn`, except where PostgreSQL's
//! routine leaves it: the heap page of Heap2 VISIBLE (as with data checksums and `wal_log_hints`
//! off, which no record can tell; [`super::heap`]).
//!
//! Invariants: pure, no I/O; nothing panics on any record or page (every offset and length is
//! checked); a record that does not fit the page it is applied to is [`RedoError::DoesNotFit`]
//! (corrupt input, or a page that is not what the WAL expects), never a page silently made
//! different.

use super::slru::{ClogSet, SlruWrite};
use super::{
    Pg15Record, Target, VmClear, VmTruncate, KIND_PG15, KIND_PG15_CLOG_SET, KIND_PG15_SLRU_WRITE,
    KIND_PG15_VM_CLEAR, KIND_PG15_VM_TRUNCATE,
};
use crate::page::Page;

/// The error of [`apply`]. It is defined in the parent, beside [`Target`]: the routines this
/// module dispatches to return it, and they do not import this module.
pub use super::RedoError;

/// Applies `bytes`, a record of the PostgreSQL families, to `page`. `None` if `bytes` is of
/// neither family (the synthetic records of `record.rs`).
pub fn apply(bytes: &[u8], page: &mut Page) -> Option<Result<(), RedoError>> {
    match bytes.first() {
        Some(&KIND_PG15) => Some(apply_record(bytes, page)),
        Some(&KIND_PG15_VM_CLEAR) => Some(
            VmClear::decode(bytes)
                .map_err(|e| RedoError::Malformed(e.to_string()))
                .and_then(|clear| super::visibilitymap::apply_clear(&clear, page)),
        ),
        Some(&KIND_PG15_VM_TRUNCATE) => Some(
            VmTruncate::decode(bytes)
                .map_err(|e| RedoError::Malformed(e.to_string()))
                .and_then(|t| super::visibilitymap::apply_truncate(&t, page)),
        ),
        Some(&KIND_PG15_CLOG_SET) => Some(
            ClogSet::decode(bytes)
                .map_err(|e| RedoError::Malformed(e.to_string()))
                .and_then(|set| super::slru::apply_clog_set(&set, page)),
        ),
        Some(&KIND_PG15_SLRU_WRITE) => Some(
            SlruWrite::decode(bytes)
                .map_err(|e| RedoError::Malformed(e.to_string()))
                .and_then(|write| super::slru::apply_slru_write(&write, page)),
        ),
        _ => None,
    }
}

fn apply_record(bytes: &[u8], page: &mut Page) -> Result<(), RedoError> {
    let record = Pg15Record::decode(bytes).map_err(|e| RedoError::Malformed(e.to_string()))?;
    let Some(block) = record.blocks.iter().find(|b| b.id == record.target) else {
        return Err(RedoError::Malformed(format!("{}: no block {}", record.type_name(), record.target)));
    };
    let target = Target { record: &record, block };
    if !target.will_init() && crate::page::page_lsn(page) >= record.end_lsn {
        return Ok(());
    }
    match record.rmid {
        RM_HEAP2 => super::heap::redo_heap2(&target, page),
        RM_HEAP => super::heap::redo_heap(&target, page),
        RM_BTREE => super::btree::redo(&target, page),
        RM_GIN => super::gin::redo(&target, page),
        RM_GIST => super::gist::redo(&target, page),
        RM_SEQ => super::sequence::redo(&target, page),
        RM_GENERIC => super::generic::redo(&target, page),
        RM_BRIN => super::brin::redo(&target, page),
        RM_HASH => super::hash::redo(&target, page),
        RM_SPGIST => super::spgist::redo(&target, page),
        _ => Err(RedoError::Unsupported(record.type_name())),
    }
}

/// What the redo of the record (`rmid`, `info`) does to its block `block_id` beyond restoring
/// the block's full-page image (PostgreSQL's `BLK_RESTORED`), for the daemon, which stores such
/// an image instead of the record: GiST's left child gets its NSN and loses `F_FOLLOW_RIGHT`
/// ([`super::gist::redo_restored_image`]); every other resource manager applied here takes the
/// image as it is. `end_lsn` is the record's; returns whether `page` changed.
pub fn redo_restored_image(rmid: u8, info: u8, block_id: u8, end_lsn: u64, page: &mut Page) -> bool {
    rmid == RM_GIST && super::gist::redo_restored_image(info, block_id, end_lsn, page)
}

/// Resource managers (PostgreSQL 15's `rmgrlist.h`).
pub use page_types::wal::rmgr::{
    RM_BRIN_ID as RM_BRIN, RM_BTREE_ID as RM_BTREE, RM_GENERIC_ID as RM_GENERIC, RM_GIN_ID as RM_GIN,
    RM_GIST_ID as RM_GIST, RM_HASH_ID as RM_HASH, RM_HEAP2_ID as RM_HEAP2, RM_HEAP_ID as RM_HEAP,
    RM_SEQ_ID as RM_SEQ, RM_SPGIST_ID as RM_SPGIST,
};
