//! From a decoded WAL record to the values a tenant stores: for each block reference, a page
//! image if the record carries one to apply (`BKPIMAGE_APPLY`), else the record itself in the
//! `pg15` family's encoding, for that block (what the redo child needs to redo it). Both at the
//! record's end LSN, PostgreSQL's page LSN after redo, so that GetPage at LSN X sees every record
//! that ended at or before X.
//!
//! Check-only images (`wal_consistency_checking`, without `BKPIMAGE_APPLY`) are not stored:
//! the block gets the record, as if there were no image.
//!
//! Heap records whose flags say they cleared a heap page's visibility-map bits
//! (`ALL_VISIBLE_CLEARED`, `ALL_FROZEN_CLEARED`) change a page they do not reference, the map's:
//! for each map page they touch, a [`VmClear`] value is derived, at the same LSN (after the
//! record's own values: a key's values within a record keep block order).
//!
//! Invariant: pure; a record that cannot be stored (an image that does not restore, a record
//! too long for the family's encoding) is an error naming its LSN, never a value dropped.

use bytes::Bytes;
use page_types::wal::DecodedRecord;
use page_types::{BufferTag, Lsn};
use walredo_proc::page::{self, pd_upper, Page};
use walredo_proc::pg15::{
    BlockHeader, Pg15Record, VmClear, FLAG_HAD_IMAGE, FLAG_HAS_DATA, FLAG_WILL_INIT, HEAPBLOCKS_PER_VM_PAGE,
    VM_ALL_FROZEN, VM_ALL_VISIBLE,
};

use crate::storage::Value;

/// Why a record could not become values.
#[derive(Debug, thiserror::Error)]
pub enum ValueError {
    #[error("record at {lsn}: block {block}: {source}")]
    Image { lsn: Lsn, block: u8, source: page_types::wal::ImageError },
    #[error("record at {lsn} ({kind}): {source}")]
    Encode { lsn: Lsn, kind: String, source: walredo_proc::pg15::Pg15Error },
}

/// What redo does after restoring an image: `pd_lsn` becomes the record's end LSN, unless the
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

/// Appends the values of `record` to `out`, in block id order.
pub fn record_values(
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

/// The visibility-map fork (2).
const VM_FORK: u8 = 2;
/// Resource managers and heap record flags (PostgreSQL 15's `heapam_xlog.h`).
const RM_HEAP2: u8 = 9;
const RM_HEAP: u8 = 10;
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
        record_values(&rec, &mut out).unwrap();
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
        record_values(&rec, &mut out).unwrap();
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
        record_values(&hot, &mut out).unwrap();
        let (_, _, Value::Record(v)) = &out[1] else { panic!() };
        assert_eq!(VmClear::decode(v).unwrap().clears, vec![(0, 3), (0, 3)]);
        // LOCK clears the all-frozen bit only; without the flag, nothing is derived.
        let mut lock = record(vec![block(0, None)]);
        lock.info = 0x60;
        lock.main_data = Bytes::from(vec![0, 0, 0, 0, 1, 0, 0, 0x01]);
        let mut out = Vec::new();
        record_values(&lock, &mut out).unwrap();
        let (_, _, Value::Record(v)) = &out[1] else { panic!() };
        assert_eq!(VmClear::decode(v).unwrap().clears, vec![(0, VM_ALL_FROZEN)]);
        lock.main_data = Bytes::from(vec![0, 0, 0, 0, 1, 0, 0, 0]);
        let mut out = Vec::new();
        record_values(&lock, &mut out).unwrap();
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn a_new_page_keeps_its_zero_lsn_and_a_broken_image_is_an_error_naming_the_record() {
        let mut out = Vec::new();
        record_values(&record(vec![block(0, Some((true, 0)))]), &mut out).unwrap();
        let Value::Image(page) = &out[0].2 else { panic!() };
        assert_eq!(&page[..8], &[0; 8]);
        let mut bad = block(0, Some((true, 512)));
        if let Some(image) = bad.image.as_mut() {
            image.bytes = Bytes::from_static(b"short");
        }
        let err = record_values(&record(vec![bad]), &mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("1/28"), "{err}");
    }
}
