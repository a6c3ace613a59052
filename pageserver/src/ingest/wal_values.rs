//! From a decoded WAL record to the values a tenant stores: for each block reference, a page
//! image if the record carries one to apply (`BKPIMAGE_APPLY`), else the record itself in the
//! `pg15` family's encoding, for that block (what the redo child needs to redo it). Both at the
//! record's end LSN, PostgreSQL's page LSN after redo, so that GetPage at LSN X sees every record
//! that ended at or before X.
//!
//! Check-only images (`wal_consistency_checking`, without `BKPIMAGE_APPLY`) are not stored:
//! the block gets the record, as if there were no image. An applied image gets what the
//! record's redo does to a restored image besides (`redo_restored_image`: a GiST left child's
//! NSN and `F_FOLLOW_RIGHT`, changed by the primary after it logged the image).
//!
//! Heap records whose flags say they cleared a heap page's visibility-map bits
//! (`ALL_VISIBLE_CLEARED`, `ALL_FROZEN_CLEARED`) change a page they do not reference, the map's:
//! for each map page they touch, a [`VmClear`] value is derived, at the same LSN (after the
//! record's own values: a key's values within a record keep block order).
//!
//! **Relation sizes** (`page_types::keys`: a size value per relation fork) follow the WAL as a
//! standby's files would: a block reference beyond the end extends the fork to it, an SMGR
//! create makes an empty fork, an SMGR truncate shortens the main fork and the free-space and
//! visibility maps as PostgreSQL 15 computes them, a commit or abort that drops relations marks
//! all their forks dropped, and a database drop gets a marker of its own (newer than a
//! relation's size value, it means the relation is gone). A relation mapper update stores the
//! new map file. What PostgreSQL does without WAL is not seen: the free space map is not
//! WAL-logged (a standby keeps its own), and extensions that no record references yet (bulk
//! extension under contention) appear when a record first uses the block. Reading them back
//! (a fork's size at an LSN, whether a page belongs to a dropped incarnation) is the read
//! path's, `tenant/rel_sizes.rs`; [`RelSizes`] here is only the receiver's cache of them.
//!
//! Invariant: pure; a record that cannot be stored (an image that does not restore, a record
//! too long for the family's encoding) is an error naming its LSN, never a value dropped.

use std::collections::HashMap;

use bytes::Bytes;
use page_types::keys::{self, RelTag, FSM_FORK, MAIN_FORK, MAX_FORK, VM_FORK};
use page_types::wal::rmgr::{
    RM_DBASE_ID as RM_DBASE, RM_HEAP2_ID as RM_HEAP2, RM_HEAP_ID as RM_HEAP, RM_RELMAP_ID as RM_RELMAP,
    RM_SMGR_ID as RM_SMGR, RM_XLOG_ID as RM_XLOG,
};
use page_types::wal::DecodedRecord;
use page_types::{BufferTag, Lsn, PAGE_SIZE};
use walredo_proc::page::{self, pd_upper, Page};
use walredo_proc::pg15::redo::redo_restored_image;
use walredo_proc::pg15::{
    record_type_name, BlockHeader, Pg15Record, VmClear, VmTruncate, FLAG_HAD_IMAGE, FLAG_HAS_DATA,
    FLAG_WILL_INIT, HEAPBLOCKS_PER_VM_PAGE, VM_ALL_FROZEN, VM_ALL_VISIBLE,
};

use super::counters::{Counters, Redo as _};
use super::{multixact, slru, twophase, xact};
use crate::storage::Value;

/// Why a record could not become values.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    #[error("record at {lsn}: block {block}: {source}")]
    Image { lsn: Lsn, block: u8, source: page_types::wal::ImageError },
    #[error("record at {lsn} ({kind}): {source}")]
    Encode { lsn: Lsn, kind: String, source: walredo_proc::pg15::Pg15Error },
    #[error("record at {lsn} ({kind}): {what}")]
    Malformed { lsn: Lsn, kind: String, what: String },
    /// A record whose effect cannot be followed from the WAL alone.
    #[error("record at {lsn} ({kind}): {what}")]
    Unsupported { lsn: Lsn, kind: String, what: String },
}

/// The sizes of the relation forks the receiver has seen: `Some(blocks)`, or `None` for a fork
/// that does not exist (never created, or dropped). A fork not in the map is unknown: the
/// caller loads what [`RelSizes::missing`] lists (from storage, see
/// `tenant::rel_sizes::rel_size_at`) before [`record_values`] needs it; an unknown fork counts
/// as absent there. Bounded between messages ([`RelSizes::trim`]): a forgotten fork is unknown
/// again.
#[derive(Debug, Default)]
pub struct RelSizes {
    known: HashMap<(RelTag, u8), Option<u32>, ahash::RandomState>,
    /// The keys of each record's [`SizeSlots`] (made once: a state per record costs more than
    /// its few probes).
    slot_keys: ahash::RandomState,
    /// Slots probed to find where a size goes in `out` (tests assert one per size).
    #[cfg(test)]
    probes: u64,
}

impl RelSizes {
    /// Most forks kept between messages ([`RelSizes::trim`]): a table of 2^19 slots of 25
    /// bytes, about 13 MiB a receiver at most. A cluster's relations in use fit (a fork forgotten while in use
    /// costs a wait for the batches in flight and a read of its size); what the map would gain
    /// without bound does not (every fork a connection ever saw: one drop of 10,000 partitions
    /// adds 40,000 dropped forks).
    pub const MAX_FORKS: usize = 1 << 18;

    /// Forgets sizes once more than [`RelSizes::MAX_FORKS`] are kept: the forks that do not
    /// exist (dropped, or never created) first, then any, down to three quarters of the cap
    /// (so a trim, a pass over the map, comes at most once per quarter of the cap of forks
    /// learned). A forgotten fork is [`RelSizes::missing`] again and is loaded from storage
    /// like one never seen, which the caller does once its batches in flight are durable: then
    /// storage holds every size this map had (each was stored when it was set).
    ///
    /// Call it between messages only: never between [`RelSizes::missing`] and the
    /// [`record_values`] of the records it was asked for, which need what was loaded for them.
    /// Within one message the map grows by what that message's records touch (at most a few
    /// forks per byte of WAL).
    pub fn trim(&mut self) {
        if self.known.len() <= Self::MAX_FORKS {
            return;
        }
        self.known.retain(|_, blocks| blocks.is_some());
        let mut excess = self.known.len().saturating_sub(Self::MAX_FORKS / 4 * 3);
        if excess > 0 {
            self.known.retain(|_, _| match excess {
                0 => true,
                _ => {
                    excess -= 1;
                    false
                }
            });
        }
        // A message that touched many forks grew the table; give that back.
        if self.known.capacity() > 2 * Self::MAX_FORKS {
            self.known.shrink_to(Self::MAX_FORKS);
        }
    }

    /// The forks `record` needs the size of that are not known yet.
    pub fn missing(&self, record: &DecodedRecord) -> Vec<(RelTag, u8)> {
        let mut out: Vec<(RelTag, u8)> = Vec::new();
        let mut need = |rel: RelTag, fork: u8| {
            if !self.known.contains_key(&(rel, fork)) && !out.contains(&(rel, fork)) {
                out.push((rel, fork));
            }
        };
        for block in &record.blocks {
            need(rel_of(block), block.fork);
        }
        match smgr_op(record) {
            Some(Ok(SmgrOp::Create { rel, fork })) => need(rel, fork),
            Some(Ok(SmgrOp::Truncate { rel, flags, .. })) => {
                for (flag, fork) in
                    [(TRUNCATE_HEAP, MAIN_FORK), (TRUNCATE_VM, VM_FORK), (TRUNCATE_FSM, FSM_FORK)]
                {
                    if flags & flag != 0 {
                        need(rel, fork);
                    }
                }
            }
            _ => {}
        }
        out
    }

    /// Records what storage says of a fork.
    pub fn insert(&mut self, rel: RelTag, fork: u8, blocks: Option<u32>) {
        self.known.insert((rel, fork), blocks);
    }

    /// An empty [`SizeSlots`] for one record.
    fn slots(&self) -> SizeSlots {
        SizeSlots::with_hasher(self.slot_keys.clone())
    }

    fn get(&self, rel: RelTag, fork: u8) -> Option<u32> {
        self.known.get(&(rel, fork)).copied().flatten()
    }

    /// Sets a fork's size and appends its value, unless this record already has a value of
    /// this key in `out` (`slots` says where): then that one is updated, so a record leaves one
    /// value per key, the last size set for it, where the key first appeared. One probe per
    /// size, however many relations a record changes (a commit may drop thousands).
    fn set(
        &mut self,
        rel: RelTag,
        fork: u8,
        blocks: Option<u32>,
        lsn: Lsn,
        out: &mut Vec<(BufferTag, Lsn, Value)>,
        slots: &mut SizeSlots,
    ) {
        self.known.insert((rel, fork), blocks);
        let key = rel.size_key(fork);
        let value = Value::Image(Bytes::from(keys::encode_rel_size(blocks)));
        #[cfg(test)]
        {
            self.probes += 1;
        }
        match slots.get(&key).and_then(|&at| out.get_mut(at)) {
            Some(slot) => slot.2 = value,
            None => {
                slots.insert(key, out.len());
                out.push((key, lsn, value));
            }
        }
    }
}

/// Where one record's size values are in `out`, by key: made for each record, whose values
/// all lie at its end LSN (no two records share one), and that only appends to `out`.
type SizeSlots = HashMap<BufferTag, usize, ahash::RandomState>;

/// A `CREATE DATABASE ... STRATEGY FILE_COPY` (`XLOG_DBASE_CREATE_FILE_COPY`): the database
/// `db` in tablespace `spc` is a copy of `src_db` in `src_spc` as of the record, files copied
/// without WAL for their blocks. Its values are the template's, read back from storage: the
/// WAL receiver makes them (`tenant::database_copy`), not [`record_values`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatabaseCopy {
    pub db: u32,
    pub spc: u32,
    pub src_db: u32,
    pub src_spc: u32,
}

/// The database copy `record` is, if it is one (`xl_dbase_create_file_copy_rec`: db_id,
/// tablespace_id, src_db_id, src_tablespace_id), with the checkpoint counters moved by it as
/// [`record_values`] moves them by any record.
pub fn database_copy(
    record: &DecodedRecord,
    counters: &mut Counters,
) -> Result<Option<DatabaseCopy>, ValueError> {
    if (record.rmid, record.info & 0xF0) != (RM_DBASE, 0x00) {
        return Ok(None);
    }
    let field =
        |at: usize| u32_at(&record.main_data, at).ok_or_else(|| malformed(record, "short database copy"));
    let copy = DatabaseCopy { db: field(0)?, spc: field(4)?, src_db: field(8)?, src_spc: field(12)? };
    let xact = xact::parse(record).map_err(|what| malformed(record, what))?;
    counters.apply(record, xact.as_ref()).map_err(|what| malformed(record, &what))?;
    Ok(Some(copy))
}

impl RelSizes {
    /// Sets the size of a fork a database copy made (`None`: it has none), and its value at
    /// `lsn` in `out`.
    pub fn set_copied(
        &mut self,
        rel: RelTag,
        fork: u8,
        blocks: Option<u32>,
        lsn: Lsn,
        out: &mut Vec<(BufferTag, Lsn, Value)>,
    ) {
        let mut slots = self.slots();
        self.set(rel, fork, blocks, lsn, out, &mut slots);
    }
}

/// page is new (`pd_upper` 0, which PostgreSQL leaves as it is).
fn set_page_lsn(page: &mut [u8], lsn: Lsn) {
    if let Ok(page) = <&mut Page>::try_from(page) {
        if pd_upper(page) != 0 {
            page::set_page_lsn(page, lsn.0);
        }
    }
}

/// The page key of a block reference.
pub fn key_of(block: &page_types::wal::BlockRef) -> BufferTag {
    BufferTag {
        spcnode: block.rel.spcnode,
        dbnode: block.rel.dbnode,
        relnode: block.rel.relnode,
        forknum: block.fork,
        blknum: block.blkno,
    }
}

fn rel_of(block: &page_types::wal::BlockRef) -> RelTag {
    RelTag { spcnode: block.rel.spcnode, dbnode: block.rel.dbnode, relnode: block.rel.relnode }
}

/// Appends the values of `record` to `out`: its blocks' in block id order, then the derived
/// visibility-map clears, then the relation sizes and files it changes, then its CLOG and
/// MultiXact pages ([`slru`], [`multixact`]), then its two-phase state file ([`twophase`]);
/// `sizes` and `counters` follow. Whether the counters changed (the caller stores
/// them once per batch, [`super::counters`]).
pub fn record_values(
    record: &DecodedRecord,
    sizes: &mut RelSizes,
    counters: &mut Counters,
    out: &mut Vec<(BufferTag, Lsn, Value)>,
) -> Result<bool, ValueError> {
    let xact = xact::parse(record).map_err(|what| malformed(record, what))?;
    block_values(record, out)?;
    let lsn = record.end_lsn;
    let mut slots = sizes.slots();
    for block in &record.blocks {
        let rel = rel_of(block);
        if sizes.get(rel, block.fork).is_none_or(|n| block.blkno >= n) {
            let blocks =
                block.blkno.checked_add(1).ok_or_else(|| malformed(record, "block number 0xFFFFFFFF"))?;
            sizes.set(rel, block.fork, Some(blocks), lsn, out, &mut slots);
        }
    }
    match smgr_op(record).transpose()? {
        Some(SmgrOp::Create { rel, fork }) if sizes.get(rel, fork).is_none() => {
            sizes.set(rel, fork, Some(0), lsn, out, &mut slots);
        }
        Some(SmgrOp::Create { .. }) => {}
        Some(SmgrOp::Truncate { rel, blkno, flags }) => {
            let vm = match blkno % HEAPBLOCKS_PER_VM_PAGE {
                0 => blkno / HEAPBLOCKS_PER_VM_PAGE,
                _ => blkno / HEAPBLOCKS_PER_VM_PAGE + 1,
            };
            // The map page that keeps part of its bits gets the rest cleared, as a standby's
            // redo does (no WAL of its own).
            let map_page = blkno / HEAPBLOCKS_PER_VM_PAGE;
            if flags & TRUNCATE_VM != 0
                && blkno % HEAPBLOCKS_PER_VM_PAGE != 0
                && sizes.get(rel, VM_FORK).is_some_and(|n| n > map_page)
            {
                let mut bytes = Vec::new();
                VmTruncate { lsn: record.lsn.0, end_lsn: record.end_lsn.0, heap_blocks: blkno }
                    .encode(&mut bytes);
                out.push((rel.page(VM_FORK, map_page), lsn, Value::Record(Bytes::from(bytes))));
            }
            for (flag, fork, new) in [
                (TRUNCATE_HEAP, MAIN_FORK, blkno),
                (TRUNCATE_VM, VM_FORK, vm),
                (TRUNCATE_FSM, FSM_FORK, fsm_blocks_after_truncate(blkno)),
            ] {
                // PostgreSQL leaves a fork alone when it is not longer than the new size.
                if flags & flag != 0 && sizes.get(rel, fork).is_some_and(|n| n > new) {
                    sizes.set(rel, fork, Some(new), lsn, out, &mut slots);
                }
            }
        }
        None => {}
    }
    let mut dropped = std::collections::HashSet::new();
    for &rel in xact.as_ref().map_or(&[][..], |x| &x.dropped[..]) {
        for fork in 0..=MAX_FORK {
            sizes.set(rel, fork, None, lsn, out, &mut slots);
        }
        // Pages of this incarnation are not the pages of a relation that reuses its
        // relfilenode later (see `tenant::rel_sizes::dropped_incarnation`).
        if dropped.insert(rel) {
            out.push((rel.drop_key(), lsn, Value::Image(Bytes::new())));
        }
    }
    match (record.rmid, record.info & 0xF0) {
        // XLOG_DBASE_DROP: xl_dbase_drop_rec { db_id, ntablespaces, tablespace_ids[] }.
        (RM_DBASE, 0x20) => {
            let db = u32_at(&record.main_data, 0).ok_or_else(|| malformed(record, "short database drop"))?;
            let n = u32_at(&record.main_data, 4).ok_or_else(|| malformed(record, "short database drop"))?;
            for i in 0..n as usize {
                let spc = u32_at(&record.main_data, 8 + 4 * i)
                    .ok_or_else(|| malformed(record, "short database drop"))?;
                sizes.known.retain(|(rel, _), _| (rel.spcnode, rel.dbnode) != (spc, db));
                out.push((keys::db_drop_key(spc, db), lsn, Value::Image(Bytes::new())));
            }
        }
        // XLOG_DBASE_CREATE_FILE_COPY copies a database's files without WAL for their blocks:
        // its values are read back from storage ([`database_copy`]), which this cannot do.
        (RM_DBASE, 0x00) => {
            return Err(ValueError::Unsupported {
                lsn: record.lsn,
                kind: record_type_name(record.rmid, record.info),
                what: "CREATE DATABASE with STRATEGY FILE_COPY copies files the WAL does not carry: \
                       its values are the template's, read back from storage by the WAL receiver"
                    .into(),
            })
        }
        // XLOG_PARAMETER_CHANGE: xl_parameter_change, what pg_control holds of the settings.
        (RM_XLOG, 0x60) => {
            page_types::control_file::Parameters::decode(&record.main_data)
                .map_err(|what| malformed(record, &what))?;
            out.push((keys::parameters_key(), lsn, Value::Image(record.main_data.clone())));
        }
        // XLOG_RELMAP_UPDATE: xl_relmap_update { dbid, tsid, nbytes, data[nbytes] }: the file.
        (RM_RELMAP, 0x00) => {
            let (Some(db), Some(spc), Some(n)) =
                (u32_at(&record.main_data, 0), u32_at(&record.main_data, 4), u32_at(&record.main_data, 8))
            else {
                return Err(malformed(record, "short relation map update"));
            };
            let file = record
                .main_data
                .get(12..12 + n as usize)
                .filter(|f| f.len() == keys::RELMAP_FILE_SIZE)
                .ok_or_else(|| malformed(record, "relation map update without a 512-byte file"))?;
            out.push((keys::relmap_key(spc, db), lsn, Value::Image(Bytes::copy_from_slice(file))));
        }
        _ => {}
    }
    slru::clog_values(record, xact.as_ref(), counters.oldest_xid, out)
        .map_err(|what| malformed(record, &what))?;
    multixact::multixact_values(record, out).map_err(|what| malformed(record, &what))?;
    twophase::two_phase_values(record, xact.as_ref(), out).map_err(|what| malformed(record, what))?;
    counters.apply(record, xact.as_ref()).map_err(|what| malformed(record, &what))
}

/// `xl_smgr_truncate.flags`.
const TRUNCATE_HEAP: u32 = 0x1;
const TRUNCATE_VM: u32 = 0x2;
const TRUNCATE_FSM: u32 = 0x4;

fn malformed(record: &DecodedRecord, what: &str) -> ValueError {
    ValueError::Malformed {
        lsn: record.lsn,
        kind: record_type_name(record.rmid, record.info),
        what: what.to_string(),
    }
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let b = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn rel_at(data: &[u8], at: usize) -> Option<RelTag> {
    Some(RelTag { spcnode: u32_at(data, at)?, dbnode: u32_at(data, at + 4)?, relnode: u32_at(data, at + 8)? })
}

enum SmgrOp {
    Create { rel: RelTag, fork: u8 },
    Truncate { rel: RelTag, blkno: u32, flags: u32 },
}

/// An SMGR record's operation (`None`: not an SMGR create or truncate).
fn smgr_op(record: &DecodedRecord) -> Option<Result<SmgrOp, ValueError>> {
    let data = &record.main_data;
    match (record.rmid, record.info & 0xF0) {
        // xl_smgr_create { RelFileNode rnode; ForkNumber forkNum }.
        (RM_SMGR, 0x10) => Some(match (rel_at(data, 0), u32_at(data, 12)) {
            (Some(rel), Some(fork)) if fork <= u32::from(MAX_FORK) => {
                Ok(SmgrOp::Create { rel, fork: fork as u8 })
            }
            _ => Err(malformed(record, "short SMGR create, or a fork beyond 3")),
        }),
        // xl_smgr_truncate { BlockNumber blkno; RelFileNode rnode; int flags }.
        (RM_SMGR, 0x20) => Some(match (u32_at(data, 0), rel_at(data, 4), u32_at(data, 16)) {
            (Some(blkno), Some(rel), Some(flags)) => Ok(SmgrOp::Truncate { rel, blkno, flags }),
            _ => Err(malformed(record, "short SMGR truncate")),
        }),
        _ => None,
    }
}

/// Blocks of the free space map after truncating its heap to `heap_blocks`
/// (`FreeSpaceMapPrepareTruncateRel`: up to the leaf page of the first removed heap block, that
/// page kept when it keeps some of its slots). The map is a tree of three levels; physical
/// page order is depth first, so leaf page `n` comes after the upper pages above it.
fn fsm_blocks_after_truncate(heap_blocks: u32) -> u32 {
    // Leaf slots per map page: (BLCKSZ - 24 - 4) nodes, of which BLCKSZ / 2 - 1 are not leaves.
    const PAGE: u64 = PAGE_SIZE as u64;
    const SLOTS: u64 = (PAGE - 24 - 4) - (PAGE / 2 - 1);
    let (leaf, slot) = (u64::from(heap_blocks) / SLOTS, u64::from(heap_blocks) % SLOTS);
    // `fsm_logical_to_physical` of a bottom-level page.
    let mut pages = 0u64;
    let mut n = leaf;
    for _ in 0..3 {
        pages += n + 1;
        n /= SLOTS;
    }
    let physical = pages - 1;
    let blocks = if slot > 0 { physical + 1 } else { physical };
    u32::try_from(blocks).unwrap_or(u32::MAX)
}

/// Appends the values of `record`'s block references and the visibility-map pages it clears.
pub fn block_values(
    record: &DecodedRecord,
    out: &mut Vec<(BufferTag, Lsn, Value)>,
) -> Result<(), ValueError> {
    let lsn = record.end_lsn;
    let headers: Vec<BlockHeader<'_>> = record
        .blocks
        .iter()
        .map(|b| BlockHeader {
            id: b.id,
            flags: (if b.will_init { FLAG_WILL_INIT } else { 0 })
                | (if b.has_data { FLAG_HAS_DATA } else { 0 })
                | (if b.image.is_some() { FLAG_HAD_IMAGE } else { 0 }),
            fork: b.fork,
            spcnode: b.rel.spcnode,
            dbnode: b.rel.dbnode,
            relnode: b.rel.relnode,
            blkno: b.blkno,
            data: &b.data,
        })
        .collect();
    for block in &record.blocks {
        let value = match &block.image {
            Some(image) if image.apply => {
                let mut page = image.restore_page().map_err(|source| ValueError::Image {
                    lsn: record.lsn,
                    block: block.id,
                    source,
                })?;
                set_page_lsn(&mut page, lsn);
                // What redo does to the restored image (a GiST left child's NSN and flag).
                if let Ok(page) = <&mut Page>::try_from(&mut page[..]) {
                    redo_restored_image(record.rmid, record.info, block.id, lsn.0, page);
                }
                Value::Image(Bytes::from(page))
            }
            _ => {
                let encoded = Pg15Record {
                    rmid: record.rmid,
                    info: record.info,
                    xid: record.xid,
                    lsn: record.lsn.0,
                    end_lsn: record.end_lsn.0,
                    target: block.id,
                    blocks: headers.clone(),
                    main_data: &record.main_data,
                };
                let mut bytes = Vec::new();
                encoded.encode(&mut bytes).map_err(|source| ValueError::Encode {
                    lsn: record.lsn,
                    kind: encoded.type_name(),
                    source,
                })?;
                Value::Record(Bytes::from(bytes))
            }
        };
        out.push((key_of(block), lsn, value));
    }
    for (key, clear) in vm_clears(record) {
        // A record that also references the map page changes it itself (never seen for these
        // records; kept out rather than stored twice at one LSN).
        if record.blocks.iter().any(|b| key_of(b) == key) {
            continue;
        }
        let mut bytes = Vec::new();
        clear.encode(&mut bytes).map_err(|source| ValueError::Encode {
            lsn: record.lsn,
            kind: clear.type_name(),
            source,
        })?;
        out.push((key, lsn, Value::Record(Bytes::from(bytes))));
    }
    Ok(())
}

/// Heap record flags (PostgreSQL 15's `heapam_xlog.h`).
const ALL_VISIBLE_CLEARED: u8 = 0x01;
const UPDATE_NEW_ALL_VISIBLE_CLEARED: u8 = 0x02;
const LOCK_ALL_FROZEN_CLEARED: u8 = 0x01;

/// The visibility-map pages a heap record clears bits of without referencing them, with the
/// heap blocks and bits, one entry per map page.
fn vm_clears(record: &DecodedRecord) -> Vec<(BufferTag, VmClear)> {
    let flags_at = |offset: usize| record.main_data.get(offset).copied().unwrap_or(0);
    let block = |id: u8| record.blocks.iter().find(|b| b.id == id);
    let both = VM_ALL_VISIBLE | VM_ALL_FROZEN;
    // (heap block reference, bits cleared)
    let mut cleared: Vec<(&page_types::wal::BlockRef, u8)> = Vec::new();
    let op = record.info & 0x70;
    match (record.rmid, op) {
        // INSERT: xl_heap_insert { offnum u16, flags u8 }.
        (RM_HEAP, 0x00) if flags_at(2) & ALL_VISIBLE_CLEARED != 0 => {
            cleared.extend(block(0).map(|b| (b, both)))
        }
        // DELETE: xl_heap_delete { xmax u32, offnum u16, infobits u8, flags u8 }.
        (RM_HEAP, 0x10) if flags_at(7) & ALL_VISIBLE_CLEARED != 0 => {
            cleared.extend(block(0).map(|b| (b, both)))
        }
        // UPDATE, HOT_UPDATE: xl_heap_update { old_xmax u32, old_offnum u16, old_infobits u8,
        // flags u8, .. }; the old page is block 1, or block 0 when it is the same page.
        (RM_HEAP, 0x20 | 0x40) => {
            let flags = flags_at(7);
            if flags & ALL_VISIBLE_CLEARED != 0 {
                cleared.extend(block(1).or(block(0)).map(|b| (b, both)));
            }
            if flags & UPDATE_NEW_ALL_VISIBLE_CLEARED != 0 {
                cleared.extend(block(0).map(|b| (b, both)));
            }
        }
        // LOCK: xl_heap_lock { locking_xid u32, offnum u16, infobits i8, flags u8 }.
        (RM_HEAP, 0x60) if flags_at(7) & LOCK_ALL_FROZEN_CLEARED != 0 => {
            cleared.extend(block(0).map(|b| (b, VM_ALL_FROZEN)))
        }
        // MULTI_INSERT: xl_heap_multi_insert { flags u8, .. }.
        (RM_HEAP2, 0x50) if flags_at(0) & ALL_VISIBLE_CLEARED != 0 => {
            cleared.extend(block(0).map(|b| (b, both)))
        }
        // LOCK_UPDATED: xl_heap_lock_updated { xmax u32, offnum u16, infobits u8, flags u8 }.
        (RM_HEAP2, 0x60) if flags_at(7) & LOCK_ALL_FROZEN_CLEARED != 0 => {
            cleared.extend(block(0).map(|b| (b, VM_ALL_FROZEN)))
        }
        _ => {}
    }
    let mut out: Vec<(BufferTag, VmClear)> = Vec::new();
    for (heap, bits) in cleared {
        let key = BufferTag { forknum: VM_FORK, blknum: heap.blkno / HEAPBLOCKS_PER_VM_PAGE, ..key_of(heap) };
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, clear)) => clear.clears.push((heap.blkno, bits)),
            None => out.push((
                key,
                VmClear {
                    rmid: record.rmid,
                    info: record.info,
                    lsn: record.lsn.0,
                    end_lsn: record.end_lsn.0,
                    clears: vec![(heap.blkno, bits)],
                },
            )),
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use page_types::wal::rmgr::RM_XACT_ID as RM_XACT;
    use page_types::wal::{BlockImage, BlockRef, ImageCompression, RelFileNode};
    use walredo_proc::pg15::FLAG_DATA_INCLUDED;

    fn block(id: u8, image: Option<(bool, u16)>) -> BlockRef {
        let image = image.map(|(apply, pd_upper)| {
            let mut page = vec![0u8; 8192];
            page[14..16].copy_from_slice(&pd_upper.to_le_bytes());
            page[100] = id;
            BlockImage {
                bytes: Bytes::from(page),
                hole_offset: 0,
                hole_length: 0,
                compression: ImageCompression::None,
                apply,
            }
        });
        BlockRef {
            id,
            rel: RelFileNode { spcnode: 1663, dbnode: 5, relnode: 16384 },
            fork: 0,
            blkno: u32::from(id) * 10,
            will_init: false,
            has_data: true,
            data: Bytes::from(vec![id; 3]),
            image,
        }
    }

    fn record(blocks: Vec<BlockRef>) -> DecodedRecord {
        DecodedRecord {
            lsn: Lsn(0x1_0000_0028),
            end_lsn: Lsn(0x1_0000_2068),
            xid: 9,
            prev: Lsn(0x1_0000_0000),
            info: 0x20,
            rmid: 10,
            blocks,
            main_data: Bytes::from_static(b"main"),
            origin: None,
            toplevel_xid: None,
        }
    }

    #[test]
    fn applied_images_become_images_at_the_end_lsn_and_the_rest_records_for_their_block() {
        let rec = record(vec![block(0, Some((true, 512))), block(1, None), block(2, Some((false, 512)))]);
        let mut out = Vec::new();
        block_values(&rec, &mut out).unwrap();
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(|(_, lsn, _)| *lsn == rec.end_lsn));
        assert_eq!(out[1].0.blknum, 10);
        let Value::Image(page) = &out[0].2 else { panic!("block 0 carries an applied image") };
        // pd_lsn is the record's end, as redo leaves it: xlogid then xrecoff.
        assert_eq!(&page[..8], &[1, 0, 0, 0, 0x68, 0x20, 0, 0]);
        assert_eq!(page[100], 0);
        for (i, (_, _, value)) in out.iter().enumerate().skip(1) {
            let Value::Record(bytes) = value else { panic!("block {i} is a record") };
            let r = Pg15Record::decode(bytes).unwrap();
            assert_eq!((r.target, r.rmid, r.info, r.main_data), (i as u8, 10, 0x20, &b"main"[..]));
            let target = r.blocks.iter().find(|b| b.id == r.target).unwrap();
            assert_eq!(target.data, &[i as u8; 3][..]);
            assert!(target.flags & FLAG_DATA_INCLUDED != 0);
        }
        // A check-only image (no BKPIMAGE_APPLY) is not stored; its block gets the record.
        let Value::Record(bytes) = &out[2].2 else { panic!() };
        assert!(Pg15Record::decode(bytes).unwrap().blocks[2].flags & FLAG_HAD_IMAGE != 0);
    }

    #[test]
    fn heap_records_that_clear_visibility_bits_get_a_value_for_each_map_page() {
        // UPDATE across pages: old page 40000 (block 1), new page 0 (block 0), both cleared:
        // two map pages (40000 / 32672 = 1, 0 / 32672 = 0), the old page's first.
        let mut rec = record(vec![block(0, None), block(1, None)]);
        rec.blocks[1].blkno = 40000;
        rec.main_data = Bytes::from(vec![0, 0, 0, 0, 1, 0, 0, 0x03, 0, 0, 0, 0, 2, 0]);
        let mut out = Vec::new();
        block_values(&rec, &mut out).unwrap();
        assert_eq!(out.len(), 4, "two block values and two map pages");
        let (k2, lsn2, Value::Record(v2)) = &out[2] else { panic!() };
        assert_eq!((k2.forknum, k2.blknum, k2.relnode, *lsn2), (2, 1, 16384, rec.end_lsn));
        assert_eq!(VmClear::decode(v2).unwrap().clears, vec![(40000, 3)]);
        let (k3, _, Value::Record(v3)) = &out[3] else { panic!() };
        assert_eq!((k3.forknum, k3.blknum), (2, 0));
        assert_eq!(VmClear::decode(v3).unwrap().clears, vec![(0, 3)]);
        // The same page for both (a HOT update): one map value with the block once per flag.
        let mut hot = record(vec![block(0, None)]);
        hot.info = 0x40;
        hot.main_data = rec.main_data.clone();
        let mut out = Vec::new();
        block_values(&hot, &mut out).unwrap();
        let (_, _, Value::Record(v)) = &out[1] else { panic!() };
        assert_eq!(VmClear::decode(v).unwrap().clears, vec![(0, 3), (0, 3)]);
        // LOCK clears the all-frozen bit only; without the flag, nothing is derived.
        let mut lock = record(vec![block(0, None)]);
        lock.info = 0x60;
        lock.main_data = Bytes::from(vec![0, 0, 0, 0, 1, 0, 0, 0x01]);
        let mut out = Vec::new();
        block_values(&lock, &mut out).unwrap();
        let (_, _, Value::Record(v)) = &out[1] else { panic!() };
        assert_eq!(VmClear::decode(v).unwrap().clears, vec![(0, VM_ALL_FROZEN)]);
        lock.main_data = Bytes::from(vec![0, 0, 0, 0, 1, 0, 0, 0]);
        let mut out = Vec::new();
        block_values(&lock, &mut out).unwrap();
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn an_applied_image_of_a_gist_left_child_gets_the_nsn_and_loses_follow_right() {
        // A GiST leaf image with F_FOLLOW_RIGHT (0x08) set, NSN 0, special space at 8176.
        let mut image = block(1, Some((true, 8176)));
        let mut page = vec![0u8; 8192];
        page[12..14].copy_from_slice(&24u16.to_le_bytes());
        page[14..16].copy_from_slice(&8176u16.to_le_bytes());
        page[16..18].copy_from_slice(&8176u16.to_le_bytes());
        page[8176 + 12] = 0x01 | 0x08;
        if let Some(img) = image.image.as_mut() {
            img.bytes = Bytes::from(page);
        }
        let mut rec = record(vec![block(0, None), image]);
        (rec.rmid, rec.info, rec.main_data) = (14, 0x00, Bytes::from_static(&[0, 0, 1, 0]));
        let mut out = Vec::new();
        block_values(&rec, &mut out).unwrap();
        let Value::Image(child) = &out[1].2 else { panic!("block 1 carries an applied image") };
        assert_eq!(&child[8176..8184], &[1, 0, 0, 0, 0x68, 0x20, 0, 0], "NSN: the record's end");
        assert_eq!(child[8176 + 12], 0x01, "F_FOLLOW_RIGHT cleared");
        // The same image for a Heap record's block, or GiST's block 0 of PAGE_UPDATE: as it is.
        for (rmid, id) in [(10, 1), (14, 0)] {
            let mut img = rec.blocks[1].clone();
            img.id = id;
            let mut other = record(vec![img]);
            (other.rmid, other.info) = (rmid, 0x00);
            let mut out = Vec::new();
            block_values(&other, &mut out).unwrap();
            let Value::Image(page) = &out[0].2 else { panic!() };
            assert_eq!(page[8176 + 12], 0x09, "rmgr {rmid} block {id}");
        }
    }

    #[test]
    fn a_new_page_keeps_its_zero_lsn_and_a_broken_image_is_an_error_naming_the_record() {
        let mut out = Vec::new();
        block_values(&record(vec![block(0, Some((true, 0)))]), &mut out).unwrap();
        let Value::Image(page) = &out[0].2 else { panic!() };
        assert_eq!(&page[..8], &[0; 8]);
        let mut bad = block(0, Some((true, 512)));
        if let Some(image) = bad.image.as_mut() {
            image.bytes = Bytes::from_static(b"short");
        }
        let err = block_values(&record(vec![bad]), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("1/28"), "{err}");
    }

    fn sized(sizes: &mut RelSizes, rec: &DecodedRecord) -> Vec<(BufferTag, Option<u32>)> {
        let mut out = Vec::new();
        record_values(rec, sizes, &mut Counters::default(), &mut out).unwrap();
        out.into_iter()
            .filter(|(k, _, _)| matches!(keys::classify(k), keys::KeyKind::RelSize { .. }))
            .map(|(k, lsn, v)| {
                assert_eq!(lsn, rec.end_lsn);
                let Value::Image(bytes) = v else { panic!("sizes are images") };
                (k, keys::decode_rel_size(&bytes).unwrap())
            })
            .collect()
    }

    fn rel() -> RelTag {
        RelTag { spcnode: 1663, dbnode: 5, relnode: 16384 }
    }

    fn main_only(rmid: u8, info: u8, main_data: Vec<u8>) -> DecodedRecord {
        let mut rec = record(Vec::new());
        (rec.rmid, rec.info, rec.main_data) = (rmid, info, Bytes::from(main_data));
        rec
    }

    #[test]
    fn block_references_beyond_the_end_extend_their_fork_once_per_record() {
        let mut sizes = RelSizes::default();
        // Blocks 0, 10 and 20 of an unknown (absent) fork: one size value, 21.
        let rec = record(vec![block(0, None), block(1, None), block(2, None)]);
        assert_eq!(sizes.missing(&rec), vec![(rel(), 0)]);
        sizes.insert(rel(), 0, None);
        assert!(sizes.missing(&rec).is_empty());
        assert_eq!(sized(&mut sizes, &rec), vec![(rel().size_key(0), Some(21))]);
        // Within the fork: nothing.
        assert_eq!(sized(&mut sizes, &record(vec![block(1, None)])), vec![]);
    }

    #[test]
    fn smgr_create_truncate_and_drops_follow_postgres() {
        let mut sizes = RelSizes::default();
        let smgr = |info: u8, words: &[u32]| {
            main_only(RM_SMGR, info, words.iter().flat_map(|w| w.to_le_bytes()).collect())
        };
        // CREATE of the VM fork: empty; again: unchanged.
        let create = smgr(0x10, &[1663, 5, 16384, 2]);
        assert_eq!(sizes.missing(&create), vec![(rel(), 2)]);
        sizes.insert(rel(), 2, None);
        assert_eq!(sized(&mut sizes, &create), vec![(rel().size_key(2), Some(0))]);
        assert_eq!(sized(&mut sizes, &create), vec![]);
        // TRUNCATE to 40000 heap blocks of a fork of 100000, VM of 4, FSM of 30: the heap to
        // 40000, the VM to 2 pages (40000 is inside map page 1), the FSM to 12 pages (heap
        // block 40000 is in leaf 9, physical block 11 after the root and the upper page; it
        // keeps some of its slots, so it stays).
        sizes.insert(rel(), 0, Some(100_000));
        sizes.insert(rel(), 2, Some(4));
        sizes.insert(rel(), 1, Some(30));
        let truncate = smgr(0x20, &[40_000, 1663, 5, 16384, 7]);
        assert_eq!(
            sized(&mut sizes, &truncate),
            vec![
                (rel().size_key(0), Some(40_000)),
                (rel().size_key(2), Some(2)),
                (rel().size_key(1), Some(12))
            ]
        );
        // A fork already short enough is left alone.
        assert_eq!(sized(&mut sizes, &truncate), vec![]);
        // The map page that keeps part of its bits (page 1: 40000 is inside it) gets the rest
        // cleared, while the map reaches it.
        sizes.insert(rel(), 2, Some(4));
        let mut out = Vec::new();
        record_values(&truncate, &mut sizes, &mut Counters::default(), &mut out).unwrap();
        let (key, _, Value::Record(bytes)) = &out[0] else { panic!("the map value first") };
        assert_eq!(*key, rel().page(2, 1));
        assert_eq!(VmTruncate::decode(bytes).unwrap().heap_blocks, 40_000);
        sizes.insert(rel(), 2, Some(1));
        let mut out = Vec::new();
        record_values(&truncate, &mut sizes, &mut Counters::default(), &mut out).unwrap();
        assert!(out.iter().all(|(k, _, _)| !keys::is_rel_page(k)), "a map that ends before page 1: nothing");
        // A commit dropping the relation: every fork dropped.
        let mut commit = vec![0u8; 8];
        commit.extend_from_slice(&(1u32 << 2).to_le_bytes());
        commit.extend_from_slice(&1u32.to_le_bytes());
        commit.extend([1663u32, 5, 16384].iter().flat_map(|w| w.to_le_bytes()));
        let dropped = sized(&mut sizes, &main_only(RM_XACT, 0x80, commit.clone()));
        assert_eq!(dropped, (0..=MAX_FORK).map(|f| (rel().size_key(f), None)).collect::<Vec<_>>());
        // And the relation's drop marker, once, at the commit's LSN: its pages so far are of a
        // dropped incarnation of the relfilenode.
        let mut out = Vec::new();
        record_values(
            &main_only(RM_XACT, 0x80, commit_dropping(&[rel(), rel()])),
            &mut sizes,
            &mut Counters::default(),
            &mut out,
        )
        .unwrap();
        let markers: Vec<_> = out.iter().filter(|(k, _, _)| *k == rel().drop_key()).collect();
        assert_eq!(markers.len(), 1, "{out:?}");
        assert!(
            matches!(markers[0], (_, lsn, Value::Image(b)) if b.is_empty() && *lsn == Lsn(0x1_0000_2068))
        );
        // Without XLOG_XACT_HAS_INFO there is nothing to drop; a short list is an error.
        assert_eq!(sized(&mut sizes, &main_only(RM_XACT, 0x00, commit.clone())), vec![]);
        commit.truncate(commit.len() - 1);
        assert!(record_values(
            &main_only(RM_XACT, 0x80, commit),
            &mut sizes,
            &mut Counters::default(),
            &mut Vec::new()
        )
        .is_err());
        // A database drop: a marker, and the database's forks forgotten.
        sizes.insert(rel(), 0, Some(3));
        let mut out = Vec::new();
        let drop = main_only(RM_DBASE, 0x20, [5u32, 1, 1663].iter().flat_map(|w| w.to_le_bytes()).collect());
        record_values(&drop, &mut sizes, &mut Counters::default(), &mut out).unwrap();
        assert_eq!(out.iter().map(|(k, _, _)| *k).collect::<Vec<_>>(), vec![keys::db_drop_key(1663, 5)]);
        assert_eq!(sizes.missing(&record(vec![block(0, None)])), vec![(rel(), 0)]);
        // FILE_COPY is refused by name.
        let copy = main_only(RM_DBASE, 0x00, vec![0; 16]);
        let err = record_values(&copy, &mut sizes, &mut Counters::default(), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("FILE_COPY"), "{err}");
    }

    /// The main data of a commit (`XLOG_XACT_HAS_INFO`) that drops `rels`.
    fn commit_dropping(rels: &[RelTag]) -> Vec<u8> {
        let mut data = vec![0u8; 8];
        data.extend_from_slice(&(1u32 << 2).to_le_bytes());
        data.extend_from_slice(&(rels.len() as u32).to_le_bytes());
        data.extend(rels.iter().flat_map(|r| [r.spcnode, r.dbnode, r.relnode]).flat_map(u32::to_le_bytes));
        data
    }

    #[test]
    fn a_commit_dropping_ten_thousand_relations_finds_each_size_slot_in_linear_probes() {
        let rels: Vec<RelTag> = (0..10_000).map(|i| RelTag { relnode: 20_000 + i, ..rel() }).collect();
        let commit = main_only(RM_XACT, 0x80, commit_dropping(&rels));
        let mut sizes = RelSizes::default();
        let dropped = sized(&mut sizes, &commit);
        let want: Vec<_> = rels.iter().flat_map(|r| (0..=MAX_FORK).map(|f| (r.size_key(f), None))).collect();
        assert_eq!(dropped, want);
        // One probe per size is linear; a scan of the record's values so far for each was
        // n^2 / 2 (8 * 10^8 for these 40,000 sizes, seconds of an executor thread).
        let sets = want.len() as u64;
        assert!(sizes.probes < 4 * sets, "{} probes to set {sets} sizes", sizes.probes);
        // The same values as a small case, in order, one per key: a relation listed twice
        // keeps its first place.
        let (a, b) = (rels[0], rels[1]);
        let mut sizes = RelSizes::default();
        let small = sized(&mut sizes, &main_only(RM_XACT, 0x80, commit_dropping(&[a, b, a])));
        let want: Vec<_> =
            [a, b].iter().flat_map(|r| (0..=MAX_FORK).map(|f| (r.size_key(f), None))).collect();
        assert_eq!(small, want);
    }

    #[test]
    fn past_its_cap_the_size_map_forgets_dropped_forks_first_and_a_forgotten_fork_is_missing_again() {
        let max = RelSizes::MAX_FORKS;
        let rel_n = |i: usize| RelTag { relnode: 100_000 + i as u32, ..rel() };
        let needs = |i: usize| {
            let mut b = block(0, None);
            b.rel.relnode = rel_n(i).relnode;
            record(vec![b])
        };
        // Half the cap of live forks, then a commit dropping relations (4 forks each) that
        // takes the map past its cap: the dropped forks go first, the live ones stay.
        let mut sizes = RelSizes::default();
        let live = max / 2;
        for i in 0..live {
            sizes.insert(rel_n(i), MAIN_FORK, Some(1));
        }
        let dropped: Vec<RelTag> = (live..live + max / 8 + 1000).map(rel_n).collect();
        record_values(
            &main_only(RM_XACT, 0x80, commit_dropping(&dropped)),
            &mut sizes,
            &mut Counters::default(),
            &mut Vec::new(),
        )
        .unwrap();
        assert!(sizes.known.len() > max);
        sizes.trim();
        assert_eq!(sizes.known.len(), live, "only the dropped forks were forgotten");
        assert_eq!(
            sizes.missing(&needs(live)),
            vec![(rel_n(live), MAIN_FORK)],
            "a forgotten fork is missing"
        );
        assert!(sizes.missing(&needs(0)).is_empty() && sizes.missing(&needs(live - 1)).is_empty());
        // Live forks past the cap: some are forgotten, and reported missing again.
        for i in live..max + 10 {
            sizes.insert(rel_n(i), MAIN_FORK, Some(1));
        }
        sizes.trim();
        assert!(sizes.known.len() <= max, "{} forks kept", sizes.known.len());
        let forgotten = (0..max + 10).find(|&i| !sizes.missing(&needs(i)).is_empty());
        assert!(forgotten.is_some(), "past the cap, some fork is forgotten");
        // Under the cap nothing is forgotten.
        let kept = sizes.known.len();
        sizes.insert(rel(), MAIN_FORK, None);
        sizes.trim();
        assert_eq!(sizes.known.len(), kept + 1);
    }

    #[test]
    fn fsm_sizes_after_truncate_match_postgres_layout() {
        // Heap blocks 0: nothing left of the map (the root and the first leaf's path: 0).
        assert_eq!(fsm_blocks_after_truncate(0), 2);
        // One heap block keeps the root, the upper page and leaf 0: 3 pages.
        assert_eq!(fsm_blocks_after_truncate(1), 3);
        assert_eq!(fsm_blocks_after_truncate(4069), 3);
        assert_eq!(fsm_blocks_after_truncate(4070), 4);
    }
}
