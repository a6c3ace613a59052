//! Redo of Heap and Heap2 records (PostgreSQL 15's `heapam.c`, `heap_redo` and `heap2_redo`,
//! with `heap_page_prune_execute` of `pruneheap.c` and `heap_execute_freeze_tuple`), for the
//! record's target block. The visibility map's page of VISIBLE is [`super::visibilitymap`]'s;
//! the map bits a heap record clears arrive as a separate [`super::VmClear`].
//!
//! Applied: Heap INSERT(+INIT), DELETE, UPDATE(+INIT), HOT_UPDATE(+INIT), LOCK, INPLACE,
//! CONFIRM; Heap2 PRUNE, VACUUM, FREEZE_PAGE, VISIBLE (both blocks), MULTI_INSERT(+INIT),
//! LOCK_UPDATED. Not applied (`Unsupported`; none changes a page): Heap TRUNCATE, Heap2
//! REWRITE and NEW_CID.
//!
//! The structs read are `heapam_xlog.h`'s (little-endian, C layout): `xl_heap_insert` (3 bytes),
//! `xl_heap_delete` (8), `xl_heap_update` (14), `xl_heap_lock` (8), `xl_heap_inplace` and
//! `xl_heap_confirm` (2), `xl_heap_header` (5), `xl_heap_prune` (8), `xl_heap_vacuum` (2),
//! `xl_heap_freeze_page` (6) with 12-byte `xl_heap_freeze_tuple`s, `xl_heap_visible` (5),
//! `xl_heap_multi_insert` (4 + offsets) with 7-byte `xl_multi_insert_tuple`s at even offsets,
//! `xl_heap_lock_updated` (8).
//!
//! UPDATE and HOT_UPDATE touch two parts: the old tuple (block 1 when it is on another page)
//! and the new one (block 0). Stored for block 1, only the old part applies; for block 0 of a
//! record without block 1 (same page), both do, the new tuple's prefix and suffix coming from
//! the old tuple on that page.
//!
//! Invariants: nothing panics on any record or page; a record shorter than its struct is
//! `Malformed`; an offset past the line pointers, a line pointer that is not what PostgreSQL
//! asserts, or a tuple that does not fit is `DoesNotFit` (PostgreSQL PANICs or corrupts memory).

use super::bufpage::{self, page_add_item, page_get_item_mut, page_get_max_offset};
use super::{RedoError, Target};
use crate::page::{self, ItemId, Page, LP_DEAD, LP_NORMAL, LP_REDIRECT};

// Heap (rmgr 10) operations, `info & XLOG_HEAP_OPMASK`.
const XLOG_HEAP_INSERT: u8 = 0x00;
const XLOG_HEAP_DELETE: u8 = 0x10;
const XLOG_HEAP_UPDATE: u8 = 0x20;
const XLOG_HEAP_HOT_UPDATE: u8 = 0x40;
const XLOG_HEAP_CONFIRM: u8 = 0x50;
const XLOG_HEAP_LOCK: u8 = 0x60;
const XLOG_HEAP_INPLACE: u8 = 0x70;
const XLOG_HEAP_OPMASK: u8 = 0x70;
/// The operation's page starts from `PageInit`.
const XLOG_HEAP_INIT_PAGE: u8 = 0x80;
// Heap2 (rmgr 9) operations.
const XLOG_HEAP2_PRUNE: u8 = 0x10;
const XLOG_HEAP2_VACUUM: u8 = 0x20;
const XLOG_HEAP2_FREEZE_PAGE: u8 = 0x30;
const XLOG_HEAP2_VISIBLE: u8 = 0x40;
const XLOG_HEAP2_MULTI_INSERT: u8 = 0x50;
const XLOG_HEAP2_LOCK_UPDATED: u8 = 0x60;

// xl_heap_insert / xl_heap_multi_insert flags.
const XLH_INSERT_ALL_VISIBLE_CLEARED: u8 = 1 << 0;
const XLH_INSERT_ALL_FROZEN_SET: u8 = 1 << 5;
// xl_heap_update flags.
const XLH_UPDATE_OLD_ALL_VISIBLE_CLEARED: u8 = 1 << 0;
const XLH_UPDATE_NEW_ALL_VISIBLE_CLEARED: u8 = 1 << 1;
const XLH_UPDATE_PREFIX_FROM_OLD: u8 = 1 << 5;
const XLH_UPDATE_SUFFIX_FROM_OLD: u8 = 1 << 6;
// xl_heap_delete flags.
const XLH_DELETE_ALL_VISIBLE_CLEARED: u8 = 1 << 0;
const XLH_DELETE_IS_SUPER: u8 = 1 << 3;
const XLH_DELETE_IS_PARTITION_MOVE: u8 = 1 << 4;
// infobits_set of delete, update, lock.
const XLHL_XMAX_IS_MULTI: u8 = 0x01;
const XLHL_XMAX_LOCK_ONLY: u8 = 0x02;
const XLHL_XMAX_EXCL_LOCK: u8 = 0x04;
const XLHL_XMAX_KEYSHR_LOCK: u8 = 0x08;
const XLHL_KEYS_UPDATED: u8 = 0x10;
// xl_heap_freeze_tuple frzflags.
const XLH_FREEZE_XVAC: u8 = 0x02;
const XLH_INVALID_XVAC: u8 = 0x04;

// t_infomask (htup_details.h).
pub const HEAP_XMAX_KEYSHR_LOCK: u16 = 0x0010;
pub const HEAP_COMBOCID: u16 = 0x0020;
pub const HEAP_XMAX_EXCL_LOCK: u16 = 0x0040;
pub const HEAP_XMAX_LOCK_ONLY: u16 = 0x0080;
pub const HEAP_XMAX_SHR_LOCK: u16 = HEAP_XMAX_EXCL_LOCK | HEAP_XMAX_KEYSHR_LOCK;
pub const HEAP_LOCK_MASK: u16 = HEAP_XMAX_SHR_LOCK | HEAP_XMAX_EXCL_LOCK | HEAP_XMAX_KEYSHR_LOCK;
pub const HEAP_XMAX_COMMITTED: u16 = 0x0400;
pub const HEAP_XMAX_INVALID: u16 = 0x0800;
pub const HEAP_XMAX_IS_MULTI: u16 = 0x1000;
pub const HEAP_MOVED: u16 = 0x4000 | 0x8000;
pub const HEAP_XMAX_BITS: u16 =
    HEAP_XMAX_COMMITTED | HEAP_XMAX_INVALID | HEAP_XMAX_IS_MULTI | HEAP_LOCK_MASK | HEAP_XMAX_LOCK_ONLY;
// t_infomask2.
pub const HEAP_KEYS_UPDATED: u16 = 0x2000;
pub const HEAP_HOT_UPDATED: u16 = 0x4000;

/// `SizeofHeapTupleHeader`.
pub const HEAP_TUPLE_HEADER: usize = 23;
const SIZE_OF_HEAP_HEADER: usize = 5;
const FROZEN_TRANSACTION_ID: u32 = 2;
/// `MovedPartitionsBlockNumber` / `MovedPartitionsOffsetNumber`.
const MOVED_PARTITIONS_BLOCK: u32 = 0xFFFF_FFFF;
const MOVED_PARTITIONS_OFFSET: u16 = 0xFFFD;

/// Field offsets in `HeapTupleHeaderData`.
const T_XMIN: usize = 0;
const T_XMAX: usize = 4;
const T_FIELD3: usize = 8;
const T_CTID: usize = 12;
const T_INFOMASK2: usize = 18;
const T_INFOMASK: usize = 20;
const T_HOFF: usize = 22;

/// A heap tuple's header, over at least [`HEAP_TUPLE_HEADER`] bytes (callers check).
struct Tuple<'a>(&'a mut [u8]);

impl Tuple<'_> {
    fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.0[at], self.0[at + 1]])
    }
    fn put_u16(&mut self, at: usize, v: u16) {
        self.0[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
    fn put_u32(&mut self, at: usize, v: u32) {
        self.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn infomask(&self) -> u16 {
        self.u16(T_INFOMASK)
    }
    fn infomask2(&self) -> u16 {
        self.u16(T_INFOMASK2)
    }
    fn set_infomask(&mut self, v: u16) {
        self.put_u16(T_INFOMASK, v);
    }
    fn set_infomask2(&mut self, v: u16) {
        self.put_u16(T_INFOMASK2, v);
    }
    fn set_xmin(&mut self, xid: u32) {
        self.put_u32(T_XMIN, xid);
    }
    fn set_xmax(&mut self, xid: u32) {
        self.put_u32(T_XMAX, xid);
    }
    /// `t_cid` or `t_xvac`, the same four bytes.
    fn set_field3(&mut self, v: u32) {
        self.put_u32(T_FIELD3, v);
    }
    fn set_ctid(&mut self, blkno: u32, offnum: u16) {
        self.put_u16(T_CTID, (blkno >> 16) as u16);
        self.put_u16(T_CTID + 2, blkno as u16);
        self.put_u16(T_CTID + 4, offnum);
    }
    /// `HeapTupleHeaderSetCmin(tup, FirstCommandId)`.
    fn set_cmin_first(&mut self) {
        self.set_field3(0);
        self.set_infomask(self.infomask() & !HEAP_COMBOCID);
    }
    /// `HeapTupleHeaderSetCmax(tup, FirstCommandId, false)`: the same bytes as cmin.
    fn set_cmax_first(&mut self) {
        self.set_cmin_first();
    }
    /// The common start of delete, update (old), lock and lock-updated: xmax bits and
    /// `HEAP_MOVED` cleared, `HEAP_KEYS_UPDATED` cleared, then `fix_infomask_from_infobits`.
    fn reset_xmax_bits(&mut self, infobits: u8, hot: Option<bool>) {
        let mut mask = self.infomask() & !(HEAP_XMAX_BITS | HEAP_MOVED);
        let mut mask2 = self.infomask2() & !HEAP_KEYS_UPDATED;
        match hot {
            Some(true) => mask2 |= HEAP_HOT_UPDATED,
            Some(false) => mask2 &= !HEAP_HOT_UPDATED,
            None => {}
        }
        mask &= !(HEAP_XMAX_IS_MULTI | HEAP_XMAX_LOCK_ONLY | HEAP_XMAX_KEYSHR_LOCK | HEAP_XMAX_EXCL_LOCK);
        if infobits & XLHL_XMAX_IS_MULTI != 0 {
            mask |= HEAP_XMAX_IS_MULTI;
        }
        if infobits & XLHL_XMAX_LOCK_ONLY != 0 {
            mask |= HEAP_XMAX_LOCK_ONLY;
        }
        if infobits & XLHL_XMAX_EXCL_LOCK != 0 {
            mask |= HEAP_XMAX_EXCL_LOCK;
        }
        if infobits & XLHL_XMAX_KEYSHR_LOCK != 0 {
            mask |= HEAP_XMAX_KEYSHR_LOCK;
        }
        if infobits & XLHL_KEYS_UPDATED != 0 {
            mask2 |= HEAP_KEYS_UPDATED;
        }
        self.set_infomask(mask);
        self.set_infomask2(mask2);
    }
}

/// Reads the record's structs with length checks.
struct Fields<'t> {
    bytes: &'t [u8],
    name: String,
    what: &'static str,
}

impl Fields<'_> {
    fn need(&self, len: usize) -> Result<(), RedoError> {
        if self.bytes.len() < len {
            return Err(RedoError::Malformed(format!(
                "{}: {} of {} bytes, shorter than {len}",
                self.name,
                self.what,
                self.bytes.len()
            )));
        }
        Ok(())
    }
    fn u8(&self, at: usize) -> Result<u8, RedoError> {
        self.need(at + 1)?;
        Ok(self.bytes[at])
    }
    fn u16(&self, at: usize) -> Result<u16, RedoError> {
        self.need(at + 2)?;
        Ok(u16::from_le_bytes([self.bytes[at], self.bytes[at + 1]]))
    }
    fn u32(&self, at: usize) -> Result<u32, RedoError> {
        self.need(at + 4)?;
        Ok(u32::from_le_bytes([self.bytes[at], self.bytes[at + 1], self.bytes[at + 2], self.bytes[at + 3]]))
    }
}

fn main_data<'t>(t: &Target<'_, 't>) -> Fields<'t> {
    Fields { bytes: t.record.main_data, name: t.type_name(), what: "main data" }
}

fn block_data<'t>(t: &Target<'_, 't>) -> Fields<'t> {
    Fields { bytes: t.data(), name: t.type_name(), what: "block data" }
}

fn does_not_fit(t: &Target<'_, '_>, what: impl std::fmt::Display) -> RedoError {
    RedoError::DoesNotFit(format!("{}: {what}", t.type_name()))
}

fn malformed(t: &Target<'_, '_>, what: impl std::fmt::Display) -> RedoError {
    RedoError::Malformed(format!("{}: {what}", t.type_name()))
}

/// The tuple of line pointer `offnum`, which must exist and be `LP_NORMAL` ("invalid lp") and
/// hold at least a tuple header.
fn normal_tuple<'p>(t: &Target<'_, '_>, page: &'p mut Page, offnum: u16) -> Result<Tuple<'p>, RedoError> {
    if offnum == 0 || page_get_max_offset(page) < offnum || bufpage::item_id(page, offnum)?.flags != LP_NORMAL
    {
        return Err(does_not_fit(t, format!("invalid lp {offnum}")));
    }
    any_tuple(t, page, offnum)
}

/// The tuple of line pointer `offnum` whatever its flags (`PageGetItem` without the checks
/// PostgreSQL leaves to assertions), with at least a tuple header.
fn any_tuple<'p>(t: &Target<'_, '_>, page: &'p mut Page, offnum: u16) -> Result<Tuple<'p>, RedoError> {
    let item = page_get_item_mut(page, offnum)?;
    if item.len() < HEAP_TUPLE_HEADER {
        return Err(does_not_fit(t, format!("tuple {offnum} of {} bytes has no header", item.len())));
    }
    Ok(Tuple(item))
}

/// `PageSetPrunable(page, xid)`.
fn set_prunable(page: &mut Page, xid: u32) {
    let prune = page::pd_prune_xid(page);
    if prune == 0 || transaction_id_precedes(xid, prune) {
        bufpage::set_pd_prune_xid(page, xid);
    }
}

/// `TransactionIdPrecedes`: modulo-2^32 comparison of normal ids, plain for special ones.
fn transaction_id_precedes(a: u32, b: u32) -> bool {
    if a < 3 || b < 3 {
        return a < b;
    }
    (a.wrapping_sub(b) as i32) < 0
}

fn check_new_offset(t: &Target<'_, '_>, page: &Page, offnum: u16) -> Result<(), RedoError> {
    if u32::from(page_get_max_offset(page)) + 1 < u32::from(offnum) {
        return Err(does_not_fit(t, format!("invalid max offset number for offset {offnum}")));
    }
    Ok(())
}

/// Builds a tuple for insertion: a zeroed header with the `xl_heap_header` fields, then `body`.
fn new_tuple(infomask2: u16, infomask: u16, hoff: u8, body: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![0u8; HEAP_TUPLE_HEADER];
    for part in body {
        out.extend_from_slice(part);
    }
    let mut tuple = Tuple(&mut out[..]);
    tuple.set_infomask2(infomask2);
    tuple.set_infomask(infomask);
    tuple.0[T_HOFF] = hoff;
    out
}

fn add_tuple(t: &Target<'_, '_>, page: &mut Page, tuple: &[u8], offnum: u16) -> Result<(), RedoError> {
    page_add_item(page, tuple, offnum, true, true)
        .map(|_| ())
        .map_err(|e| does_not_fit(t, format!("failed to add tuple at {offnum}: {e}")))
}

/// Heap (rmgr 10).
pub fn redo_heap(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    match target.record.info & XLOG_HEAP_OPMASK {
        XLOG_HEAP_INSERT => insert(target, page),
        XLOG_HEAP_DELETE => delete(target, page),
        XLOG_HEAP_UPDATE => update(target, page, false),
        XLOG_HEAP_HOT_UPDATE => update(target, page, true),
        XLOG_HEAP_CONFIRM => confirm(target, page),
        XLOG_HEAP_LOCK => lock(target, page),
        XLOG_HEAP_INPLACE => inplace(target, page),
        _ => Err(RedoError::Unsupported(target.type_name())),
    }
}

/// Heap2 (rmgr 9).
pub fn redo_heap2(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    match target.record.info & XLOG_HEAP_OPMASK {
        XLOG_HEAP2_PRUNE => prune(target, page),
        XLOG_HEAP2_VACUUM => vacuum(target, page),
        XLOG_HEAP2_FREEZE_PAGE => freeze_page(target, page),
        XLOG_HEAP2_VISIBLE if target.block.id == 0 => super::visibilitymap::redo_visible(target, page),
        XLOG_HEAP2_VISIBLE => visible(target, page),
        XLOG_HEAP2_MULTI_INSERT => multi_insert(target, page),
        XLOG_HEAP2_LOCK_UPDATED => lock_updated(target, page),
        _ => Err(RedoError::Unsupported(target.type_name())),
    }
}

fn set_lsn(t: &Target<'_, '_>, page: &mut Page) {
    page::set_page_lsn(page, t.record.end_lsn);
}

/// `heap_xlog_insert`.
fn insert(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let main = main_data(t);
    let (offnum, flags) = (main.u16(0)?, main.u8(2)?);
    if t.record.info & XLOG_HEAP_INIT_PAGE != 0 {
        bufpage::page_init(page, 0);
    }
    check_new_offset(t, page, offnum)?;
    let data = block_data(t);
    data.need(SIZE_OF_HEAP_HEADER + 1)?;
    let (infomask2, infomask, hoff) = (data.u16(0)?, data.u16(2)?, data.u8(4)?);
    let mut tuple = new_tuple(infomask2, infomask, hoff, &[&t.data()[SIZE_OF_HEAP_HEADER..]]);
    let mut h = Tuple(&mut tuple[..]);
    h.set_xmin(t.record.xid);
    h.set_cmin_first();
    h.set_ctid(t.block.blkno, offnum);
    add_tuple(t, page, &tuple, offnum)?;
    set_lsn(t, page);
    if flags & XLH_INSERT_ALL_VISIBLE_CLEARED != 0 {
        bufpage::set_all_visible(page, false);
    }
    if flags & XLH_INSERT_ALL_FROZEN_SET != 0 {
        bufpage::set_all_visible(page, true);
    }
    Ok(())
}

/// `heap_xlog_delete`.
fn delete(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let main = main_data(t);
    let (xmax, offnum, infobits, flags) = (main.u32(0)?, main.u16(4)?, main.u8(6)?, main.u8(7)?);
    let mut h = normal_tuple(t, page, offnum)?;
    h.reset_xmax_bits(infobits, Some(false));
    if flags & XLH_DELETE_IS_SUPER == 0 {
        h.set_xmax(xmax);
    } else {
        h.set_xmin(0);
    }
    h.set_cmax_first();
    if flags & XLH_DELETE_IS_PARTITION_MOVE != 0 {
        h.set_ctid(MOVED_PARTITIONS_BLOCK, MOVED_PARTITIONS_OFFSET);
    } else {
        h.set_ctid(t.block.blkno, offnum);
    }
    set_prunable(page, t.record.xid);
    if flags & XLH_DELETE_ALL_VISIBLE_CLEARED != 0 {
        bufpage::set_all_visible(page, false);
    }
    set_lsn(t, page);
    Ok(())
}

/// `heap_xlog_update` (and HOT): the old part for block 1, the new part for block 0, both for
/// block 0 of a same-page update.
fn update(t: &Target<'_, '_>, page: &mut Page, hot: bool) -> Result<(), RedoError> {
    let main = main_data(t);
    let (old_xmax, old_offnum, old_infobits, flags) = (main.u32(0)?, main.u16(4)?, main.u8(6)?, main.u8(7)?);
    let (new_xmax, new_offnum) = (main.u32(8)?, main.u16(12)?);
    let new_block = t.record.blocks.iter().find(|b| b.id == 0).ok_or_else(|| malformed(t, "no block 0"))?;
    let other_page = t.record.blocks.iter().any(|b| b.id == 1);
    let newblk = new_block.blkno;

    let mut old_tuple: Option<Vec<u8>> = None;
    if t.block.id == 1 || !other_page {
        let mut h = normal_tuple(t, page, old_offnum)?;
        h.reset_xmax_bits(old_infobits, Some(hot));
        h.set_xmax(old_xmax);
        h.set_cmax_first();
        h.set_ctid(newblk, new_offnum);
        if !other_page {
            old_tuple = Some(h.0.to_vec());
        }
        set_prunable(page, t.record.xid);
        if flags & XLH_UPDATE_OLD_ALL_VISIBLE_CLEARED != 0 {
            bufpage::set_all_visible(page, false);
        }
        set_lsn(t, page);
        if t.block.id == 1 {
            return Ok(());
        }
    } else if t.block.id != 0 {
        return Err(malformed(t, format!("no part for block {}", t.block.id)));
    }

    if other_page && t.record.info & XLOG_HEAP_INIT_PAGE != 0 {
        bufpage::page_init(page, 0);
    }
    check_new_offset(t, page, new_offnum)?;
    let data = block_data(t);
    let mut at = 0;
    let (mut prefixlen, mut suffixlen) = (0usize, 0usize);
    if flags & XLH_UPDATE_PREFIX_FROM_OLD != 0 {
        prefixlen = usize::from(data.u16(at)?);
        at += 2;
    }
    if flags & XLH_UPDATE_SUFFIX_FROM_OLD != 0 {
        suffixlen = usize::from(data.u16(at)?);
        at += 2;
    }
    let (infomask2, infomask, hoff) = (data.u16(at)?, data.u16(at + 2)?, data.u8(at + 4)?);
    at += SIZE_OF_HEAP_HEADER;
    let rec = &t.data()[at..];
    let old = old_tuple.as_deref();
    let from_old = |range: std::ops::Range<usize>| -> Result<&[u8], RedoError> {
        let old = old.ok_or_else(|| malformed(t, "prefix or suffix from an old tuple on another page"))?;
        old.get(range).ok_or_else(|| does_not_fit(t, "prefix or suffix longer than the old tuple"))
    };
    let mut parts: Vec<&[u8]> = Vec::with_capacity(4);
    if prefixlen > 0 {
        let len = usize::from(hoff)
            .checked_sub(HEAP_TUPLE_HEADER)
            .filter(|len| *len <= rec.len())
            .ok_or_else(|| malformed(t, format!("t_hoff {hoff} does not fit the tuple data")))?;
        let old_hoff = usize::from(old.and_then(|o| o.get(T_HOFF).copied()).unwrap_or(0));
        parts.push(&rec[..len]);
        parts.push(from_old(old_hoff..old_hoff + prefixlen)?);
        parts.push(&rec[len..]);
    } else {
        parts.push(rec);
    }
    if suffixlen > 0 {
        let old_len = old.map_or(0, <[u8]>::len);
        let start = old_len
            .checked_sub(suffixlen)
            .ok_or_else(|| does_not_fit(t, "suffix longer than the old tuple"))?;
        parts.push(from_old(start..old_len)?);
    }
    let mut tuple = new_tuple(infomask2, infomask, hoff, &parts);
    let mut h = Tuple(&mut tuple[..]);
    h.set_xmin(t.record.xid);
    h.set_cmin_first();
    h.set_xmax(new_xmax);
    h.set_ctid(newblk, new_offnum);
    add_tuple(t, page, &tuple, new_offnum)?;
    if flags & XLH_UPDATE_NEW_ALL_VISIBLE_CLEARED != 0 {
        bufpage::set_all_visible(page, false);
    }
    set_lsn(t, page);
    Ok(())
}

/// `heap_xlog_confirm`: a speculative insertion's tuple points at itself.
fn confirm(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let offnum = main_data(t).u16(0)?;
    normal_tuple(t, page, offnum)?.set_ctid(t.block.blkno, offnum);
    set_lsn(t, page);
    Ok(())
}

/// `heap_xlog_lock`.
fn lock(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let main = main_data(t);
    let (locking_xid, offnum, infobits) = (main.u32(0)?, main.u16(4)?, main.u8(6)?);
    let mut h = normal_tuple(t, page, offnum)?;
    h.reset_xmax_bits(infobits, None);
    let mask = h.infomask();
    let locked_only = mask & HEAP_XMAX_LOCK_ONLY != 0
        || mask & (HEAP_XMAX_IS_MULTI | HEAP_LOCK_MASK) == HEAP_XMAX_EXCL_LOCK;
    if locked_only {
        h.set_infomask2(h.infomask2() & !HEAP_HOT_UPDATED);
        h.set_ctid(t.block.blkno, offnum);
    }
    h.set_xmax(locking_xid);
    h.set_cmax_first();
    set_lsn(t, page);
    Ok(())
}

/// `heap_xlog_lock_updated`.
fn lock_updated(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let main = main_data(t);
    let (xmax, offnum, infobits) = (main.u32(0)?, main.u16(4)?, main.u8(6)?);
    let mut h = normal_tuple(t, page, offnum)?;
    h.reset_xmax_bits(infobits, None);
    h.set_xmax(xmax);
    set_lsn(t, page);
    Ok(())
}

/// `heap_xlog_inplace`: the tuple's data after its header replaced, same length.
fn inplace(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let offnum = main_data(t).u16(0)?;
    let new = t.data();
    let h = normal_tuple(t, page, offnum)?;
    let hoff = usize::from(h.0[T_HOFF]);
    if h.0.len().checked_sub(hoff) != Some(new.len()) {
        return Err(does_not_fit(
            t,
            format!("wrong tuple length: {} bytes for {} - {hoff}", new.len(), h.0.len()),
        ));
    }
    h.0[hoff..].copy_from_slice(new);
    set_lsn(t, page);
    Ok(())
}

/// Reads `n` offset numbers from `data` at `at`.
fn offsets(t: &Target<'_, '_>, data: &[u8], at: usize, n: usize) -> Result<Vec<u16>, RedoError> {
    let bytes = at
        .checked_add(n * 2)
        .and_then(|end| data.get(at..end))
        .ok_or_else(|| malformed(t, format!("{n} offsets at {at} past {} bytes", data.len())))?;
    Ok(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

fn set_lp(t: &Target<'_, '_>, page: &mut Page, offnum: u16, id: ItemId) -> Result<(), RedoError> {
    if offnum == 0 || offnum > page_get_max_offset(page) {
        return Err(does_not_fit(
            t,
            format!("offset {offnum} past the {} line pointers", page_get_max_offset(page)),
        ));
    }
    bufpage::set_item_id(page, offnum, id)
}

/// `heap_xlog_prune` and `heap_page_prune_execute`: redirects, dead and unused line pointers,
/// then `PageRepairFragmentation`.
fn prune(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let main = main_data(t);
    let (nredirected, ndead) = (usize::from(main.u16(4)?), usize::from(main.u16(6)?));
    let data = t.data();
    let all = offsets(t, data, 0, data.len() / 2)?;
    if all.len() < 2 * nredirected + ndead {
        return Err(malformed(
            t,
            format!("{} offsets for {nredirected} redirects and {ndead} dead", all.len()),
        ));
    }
    let (redirected, rest) = all.split_at(2 * nredirected);
    let (dead, unused) = rest.split_at(ndead);
    for pair in redirected.chunks_exact(2) {
        set_lp(t, page, pair[0], ItemId { off: pair[1], flags: LP_REDIRECT, len: 0 })?;
    }
    for &off in dead {
        set_lp(t, page, off, ItemId { off: 0, flags: LP_DEAD, len: 0 })?;
    }
    for &off in unused {
        set_lp(t, page, off, ItemId::UNUSED)?;
    }
    bufpage::page_repair_fragmentation(page).map_err(|e| does_not_fit(t, e))?;
    set_lsn(t, page);
    Ok(())
}

/// `heap_xlog_vacuum`: dead line pointers become unused, then `PageTruncateLinePointerArray`.
fn vacuum(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let nunused = usize::from(main_data(t).u16(0)?);
    for off in offsets(t, t.data(), 0, nunused)? {
        set_lp(t, page, off, ItemId::UNUSED)?;
    }
    bufpage::page_truncate_line_pointer_array(page);
    set_lsn(t, page);
    Ok(())
}

/// `heap_xlog_freeze_page`: `heap_execute_freeze_tuple` for each `xl_heap_freeze_tuple`.
fn freeze_page(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    const FREEZE_TUPLE: usize = 12;
    let ntuples = usize::from(main_data(t).u16(4)?);
    let data = block_data(t);
    data.need(ntuples * FREEZE_TUPLE)?;
    for i in 0..ntuples {
        let at = i * FREEZE_TUPLE;
        let (xmax, offnum) = (data.u32(at)?, data.u16(at + 4)?);
        let (infomask2, infomask, frzflags) = (data.u16(at + 6)?, data.u16(at + 8)?, data.u8(at + 10)?);
        if offnum == 0 || offnum > page_get_max_offset(page) {
            return Err(does_not_fit(t, format!("freeze of offset {offnum} past the line pointers")));
        }
        let mut h = any_tuple(t, page, offnum)?;
        h.set_xmax(xmax);
        if frzflags & XLH_FREEZE_XVAC != 0 {
            h.set_field3(FROZEN_TRANSACTION_ID);
        }
        if frzflags & XLH_INVALID_XVAC != 0 {
            h.set_field3(0);
        }
        h.set_infomask(infomask);
        h.set_infomask2(infomask2);
    }
    set_lsn(t, page);
    Ok(())
}

/// `heap_xlog_visible`, the heap page (block 1): `PD_ALL_VISIBLE` set, the page's LSN left as
/// it is.
///
/// PostgreSQL 15 sets the heap page's LSN here only when `XLogHintBitIsNeeded()` (data
/// checksums or `wal_log_hints`), a setting of the cluster that no record carries. The one
/// trace of it in WAL is an image of this block to apply: `log_heap_visible` registers the
/// heap page with `REGBUF_NO_IMAGE` unless hint bits are WAL-logged, and such an image is
/// restored by `XLogReadBufferForRedo` (`BLK_RESTORED`), nothing more done. The daemon stores
/// that image as the block's value (with the record's end LSN), so a VISIBLE record that
/// reaches this routine never has one: [`super::FLAG_HAD_IMAGE`] here is a check-only image
/// (`wal_consistency_checking` logs one whatever `REGBUF_NO_IMAGE` says) and tells nothing.
/// So this does what PostgreSQL does with checksums and `wal_log_hints` off, its default:
/// no LSN. With either on, PostgreSQL's page would carry this record's end LSN; ours keeps the
/// older one (masked by `heap_mask`; an older `pd_lsn` never makes a later record be skipped).
fn visible(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    main_data(t).need(5)?;
    if t.block.id != 1 {
        return Err(malformed(t, format!("no part for block {}", t.block.id)));
    }
    bufpage::set_all_visible(page, true);
    Ok(())
}

/// `heap_xlog_multi_insert`.
fn multi_insert(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    const MULTI_INSERT_TUPLE: usize = 7;
    let main = main_data(t);
    let (flags, ntuples) = (main.u8(0)?, usize::from(main.u16(2)?));
    let isinit = t.record.info & XLOG_HEAP_INIT_PAGE != 0;
    let offs = if isinit { Vec::new() } else { offsets(t, t.record.main_data, 4, ntuples)? };
    if isinit {
        bufpage::page_init(page, 0);
    }
    let data = block_data(t);
    let mut at = 0usize;
    for i in 0..ntuples {
        let offnum = if isinit {
            u16::try_from(i + 1).map_err(|_| malformed(t, "too many tuples"))?
        } else {
            offs.get(i).copied().ok_or_else(|| malformed(t, "missing offset"))?
        };
        check_new_offset(t, page, offnum)?;
        at += at % 2;
        let (datalen, infomask2, infomask, hoff) =
            (usize::from(data.u16(at)?), data.u16(at + 2)?, data.u16(at + 4)?, data.u8(at + 6)?);
        at += MULTI_INSERT_TUPLE;
        data.need(at + datalen)?;
        let mut tuple = new_tuple(infomask2, infomask, hoff, &[&t.data()[at..at + datalen]]);
        at += datalen;
        let mut h = Tuple(&mut tuple[..]);
        h.set_xmin(t.record.xid);
        h.set_cmin_first();
        h.set_ctid(t.block.blkno, offnum);
        add_tuple(t, page, &tuple, offnum)?;
    }
    if at != t.data().len() {
        return Err(malformed(t, format!("total tuple length mismatch: {at} of {} bytes", t.data().len())));
    }
    set_lsn(t, page);
    if flags & XLH_INSERT_ALL_VISIBLE_CLEARED != 0 {
        bufpage::set_all_visible(page, false);
    }
    if flags & XLH_INSERT_ALL_FROZEN_SET != 0 {
        bufpage::set_all_visible(page, true);
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::page::{item_id, page_lsn, BLCKSZ, LP_UNUSED};
    use crate::pg15::bufpage::{page_get_item, PD_ALL_VISIBLE};
    use crate::pg15::redo::{apply, RM_HEAP, RM_HEAP2};
    use crate::pg15::{BlockHeader, Pg15Record, FLAG_HAD_IMAGE, FLAG_HAS_DATA, FLAG_WILL_INIT};
    use proptest::prelude::*;

    const BLK: u32 = 5;

    struct Rec {
        rmid: u8,
        info: u8,
        xid: u32,
        end_lsn: u64,
        target: u8,
        blocks: Vec<(u8, u32, u8, Vec<u8>)>,
        main: Vec<u8>,
    }

    fn rec(rmid: u8, info: u8, main: Vec<u8>, data: Vec<u8>) -> Rec {
        let flags = FLAG_HAS_DATA | if info & XLOG_HEAP_INIT_PAGE != 0 { FLAG_WILL_INIT } else { 0 };
        Rec { rmid, info, xid: 700, end_lsn: 0x100, target: 0, blocks: vec![(0, BLK, flags, data)], main }
    }

    impl Rec {
        fn at(mut self, end_lsn: u64) -> Rec {
            self.end_lsn = end_lsn;
            self
        }
        fn apply(&self, page: &mut Page) -> Result<(), RedoError> {
            let blocks = self
                .blocks
                .iter()
                .map(|(id, blkno, flags, data)| BlockHeader {
                    id: *id,
                    flags: *flags,
                    fork: 0,
                    spcnode: 1663,
                    dbnode: 5,
                    relnode: 16384,
                    blkno: *blkno,
                    data,
                })
                .collect();
            let r = Pg15Record {
                rmid: self.rmid,
                info: self.info,
                xid: self.xid,
                lsn: self.end_lsn.saturating_sub(8),
                end_lsn: self.end_lsn,
                target: self.target,
                blocks,
                main_data: &self.main,
            };
            let mut bytes = Vec::new();
            r.encode(&mut bytes).unwrap();
            apply(&bytes, page).unwrap()
        }
    }

    fn xl_header(infomask2: u16, infomask: u16, hoff: u8) -> Vec<u8> {
        let mut v = infomask2.to_le_bytes().to_vec();
        v.extend_from_slice(&infomask.to_le_bytes());
        v.push(hoff);
        v
    }

    /// An INSERT of a tuple with `t_hoff` 24 (one byte of null bitmap, zero) and `body`.
    fn insert_rec(offnum: u16, init: bool, body: &[u8]) -> Rec {
        let mut main = offnum.to_le_bytes().to_vec();
        main.push(0);
        let mut data = xl_header(3, 0x0802 | HEAP_COMBOCID, 24);
        data.push(0);
        data.extend_from_slice(body);
        rec(RM_HEAP, if init { 0x80 } else { 0x00 }, main, data)
    }

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_le_bytes([b[at], b[at + 1]])
    }
    fn u32_at(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
    }
    fn ctid(b: &[u8]) -> (u32, u16) {
        ((u32::from(u16_at(b, 12)) << 16) | u32::from(u16_at(b, 14)), u16_at(b, 16))
    }

    /// A page with tuples at offsets 1..=n (32 bytes: `t_hoff` 24, body `[i; 8]`), at LSN 0x10 * n.
    fn page_with(n: u16) -> Box<Page> {
        let mut page = Box::new([0u8; BLCKSZ]);
        insert_rec(1, true, &[1; 8]).at(0x10).apply(&mut page).unwrap();
        for i in 2..=n {
            insert_rec(i, false, &[i as u8; 8]).at(0x10 * u64::from(i)).apply(&mut page).unwrap();
        }
        page
    }

    #[test]
    fn insert_init_on_a_zero_page_builds_the_tuple_header_and_sets_the_lsn() {
        let mut page = Box::new([0u8; BLCKSZ]);
        insert_rec(1, true, &[1, 2, 3, 4]).at(0x200).apply(&mut page).unwrap();
        let id = item_id(&page, 1).unwrap();
        assert_eq!((id.off, id.flags, id.len), (8160, LP_NORMAL, 28));
        let t = page_get_item(&page, 1).unwrap();
        assert_eq!(u32_at(t, 0), 700, "xmin is the record's xid");
        assert_eq!((u32_at(t, 4), u32_at(t, 8)), (0, 0), "no xmax, cmin 0");
        assert_eq!(ctid(t), (BLK, 1));
        assert_eq!((u16_at(t, 18), u16_at(t, 20), t[22]), (3, 0x0802, 24), "HEAP_COMBOCID cleared");
        assert_eq!(&t[23..], &[0, 1, 2, 3, 4]);
        assert_eq!((page::pd_lower(&page), page::pd_upper(&page), page_lsn(&page)), (28, 8160, 0x200));
    }

    #[test]
    fn insert_past_the_next_offset_or_over_a_used_one_does_not_fit() {
        let mut page = page_with(1);
        assert!(matches!(
            insert_rec(3, false, &[0; 4]).at(0x300).apply(&mut page),
            Err(RedoError::DoesNotFit(_))
        ));
        assert!(matches!(
            insert_rec(1, false, &[0; 4]).at(0x300).apply(&mut page),
            Err(RedoError::DoesNotFit(_))
        ));
        let mut zero = Box::new([0u8; BLCKSZ]);
        assert!(insert_rec(1, false, &[0; 4]).apply(&mut zero).is_err(), "no init on a zero page");
        let mut short = insert_rec(2, false, &[]);
        short.blocks[0].3.truncate(5);
        assert!(matches!(short.at(0x300).apply(&mut page), Err(RedoError::Malformed(_))));
    }

    #[test]
    fn insert_flags_clear_and_set_all_visible() {
        let mut page = page_with(1);
        bufpage::set_all_visible(&mut page, true);
        let mut r = insert_rec(2, false, &[2; 8]).at(0x300);
        r.main[2] = XLH_INSERT_ALL_VISIBLE_CLEARED;
        r.apply(&mut page).unwrap();
        assert_eq!(page::pd_flags(&page) & PD_ALL_VISIBLE, 0);
    }

    fn delete_rec(offnum: u16, infobits: u8, flags: u8) -> Rec {
        let mut main = 900u32.to_le_bytes().to_vec();
        main.extend_from_slice(&offnum.to_le_bytes());
        main.extend_from_slice(&[infobits, flags]);
        rec(RM_HEAP, 0x10, main, vec![])
    }

    #[test]
    fn delete_sets_xmax_infobits_ctid_and_prune_xid() {
        let mut page = page_with(2);
        bufpage::set_all_visible(&mut page, true);
        {
            let t = page_get_item_mut(&mut page, 2).unwrap();
            t[20..22].copy_from_slice(&(0x0802u16 | HEAP_XMAX_COMMITTED | HEAP_COMBOCID).to_le_bytes());
            t[18..20].copy_from_slice(&(3u16 | HEAP_HOT_UPDATED).to_le_bytes());
        }
        let mut r = delete_rec(2, XLHL_KEYS_UPDATED, XLH_DELETE_ALL_VISIBLE_CLEARED).at(0x300);
        r.xid = 650;
        r.apply(&mut page).unwrap();
        let t = page_get_item(&page, 2).unwrap();
        assert_eq!(u32_at(t, 4), 900);
        assert_eq!(u16_at(t, 20), 0x0002, "xmax bits and combocid cleared");
        assert_eq!(u16_at(t, 18), 3 | HEAP_KEYS_UPDATED, "hot cleared, keys updated");
        assert_eq!(ctid(t), (BLK, 2));
        assert_eq!(page::pd_prune_xid(&page), 650);
        assert_eq!(page::pd_flags(&page) & PD_ALL_VISIBLE, 0);
        assert_eq!(page_lsn(&page), 0x300);
        // An older xid lowers pd_prune_xid, a newer one does not.
        let mut r = delete_rec(1, 0, XLH_DELETE_IS_PARTITION_MOVE).at(0x400);
        r.xid = 800;
        r.apply(&mut page).unwrap();
        assert_eq!(page::pd_prune_xid(&page), 650);
        assert_eq!(ctid(page_get_item(&page, 1).unwrap()), (0xFFFF_FFFF, 0xFFFD));
        assert!(matches!(delete_rec(3, 0, 0).at(0x500).apply(&mut page), Err(RedoError::DoesNotFit(_))));
    }

    #[test]
    fn delete_already_in_the_page_is_skipped() {
        let mut page = page_with(1);
        let before = page.clone();
        delete_rec(1, 0, 0).at(page_lsn(&page)).apply(&mut page).unwrap();
        assert_eq!(page, before);
    }

    fn update_main(old_offnum: u16, flags: u8, new_offnum: u16) -> Vec<u8> {
        let mut main = 901u32.to_le_bytes().to_vec();
        main.extend_from_slice(&old_offnum.to_le_bytes());
        main.extend_from_slice(&[XLHL_KEYS_UPDATED, flags]);
        main.extend_from_slice(&0u32.to_le_bytes());
        main.extend_from_slice(&new_offnum.to_le_bytes());
        main
    }

    #[test]
    fn hot_update_on_one_page_takes_prefix_and_suffix_from_the_old_tuple() {
        let mut page = Box::new([0u8; BLCKSZ]);
        insert_rec(1, true, b"abcdefgh").apply(&mut page).unwrap();
        let mut data = 2u16.to_le_bytes().to_vec();
        data.extend_from_slice(&3u16.to_le_bytes());
        data.extend_from_slice(&xl_header(3 | 0x8000, 0x0802, 24));
        data.push(0); // the null bitmap byte
        data.extend_from_slice(b"XY");
        let flags = XLH_UPDATE_PREFIX_FROM_OLD | XLH_UPDATE_SUFFIX_FROM_OLD;
        rec(RM_HEAP, 0x40, update_main(1, flags, 2), data).at(0x300).apply(&mut page).unwrap();
        let old = page_get_item(&page, 1).unwrap();
        assert_eq!(u32_at(old, 4), 901);
        assert_eq!(ctid(old), (BLK, 2));
        assert_eq!(u16_at(old, 18), 3 | HEAP_HOT_UPDATED | HEAP_KEYS_UPDATED);
        let new = page_get_item(&page, 2).unwrap();
        assert_eq!(&new[23..], b"\0abXYfgh");
        assert_eq!((u32_at(new, 0), u32_at(new, 4)), (700, 0));
        assert_eq!(ctid(new), (BLK, 2));
        assert_eq!(u16_at(new, 18), 3 | 0x8000);
        assert_eq!(page::pd_prune_xid(&page), 700);
        assert_eq!(page_lsn(&page), 0x300);
    }

    #[test]
    fn update_across_pages_applies_the_old_part_to_block_one_and_the_new_to_block_zero() {
        let mut old_page = page_with(1);
        bufpage::set_all_visible(&mut old_page, true);
        let mut data = xl_header(3, 0x0802, 24);
        data.extend_from_slice(&[0, 9, 9]);
        let flags = XLH_UPDATE_OLD_ALL_VISIBLE_CLEARED;
        let mut r = rec(RM_HEAP, 0x20 | 0x80, update_main(1, flags, 1), data);
        r.blocks.push((1, 77, 0, vec![]));
        r.target = 1;
        r.end_lsn = 0x300;
        r.apply(&mut old_page).unwrap();
        let old = page_get_item(&old_page, 1).unwrap();
        assert_eq!((u32_at(old, 4), ctid(old)), (901, (BLK, 1)));
        assert_eq!(u16_at(old, 18) & HEAP_HOT_UPDATED, 0);
        assert_eq!(page::pd_flags(&old_page) & PD_ALL_VISIBLE, 0);
        assert_eq!(page_get_max_offset(&old_page), 1, "no new tuple on the old page");
        r.target = 0;
        let mut new_page = Box::new([0xAAu8; BLCKSZ]);
        r.apply(&mut new_page).unwrap();
        let new = page_get_item(&new_page, 1).unwrap();
        assert_eq!(&new[23..], &[0, 9, 9]);
        assert_eq!(page_lsn(&new_page), 0x300);
        // A prefix needs the old tuple on the same page.
        let mut bad = r;
        bad.main[7] = XLH_UPDATE_PREFIX_FROM_OLD;
        bad.blocks[0].3.splice(0..0, [1, 0]);
        assert!(matches!(bad.apply(&mut Box::new([0u8; BLCKSZ])), Err(RedoError::Malformed(_))));
    }

    #[test]
    fn lock_only_clears_hot_and_points_ctid_at_itself() {
        let mut page = page_with(1);
        {
            let t = page_get_item_mut(&mut page, 1).unwrap();
            t[18..20].copy_from_slice(&(3u16 | HEAP_HOT_UPDATED).to_le_bytes());
            t[12..18].copy_from_slice(&[0, 0, 9, 0, 4, 0]);
        }
        let mut main = 555u32.to_le_bytes().to_vec();
        main.extend_from_slice(&1u16.to_le_bytes());
        main.extend_from_slice(&[XLHL_XMAX_LOCK_ONLY | XLHL_XMAX_EXCL_LOCK, 0]);
        rec(RM_HEAP, 0x60, main.clone(), vec![]).at(0x300).apply(&mut page).unwrap();
        let t = page_get_item(&page, 1).unwrap();
        assert_eq!((u32_at(t, 4), ctid(t)), (555, (BLK, 1)));
        assert_eq!(u16_at(t, 18), 3);
        assert_eq!(u16_at(t, 20), 0x0002 | HEAP_XMAX_LOCK_ONLY | HEAP_XMAX_EXCL_LOCK);
        // LOCK_UPDATED sets xmax and bits but leaves ctid.
        main[6] = XLHL_XMAX_KEYSHR_LOCK;
        {
            let t = page_get_item_mut(&mut page, 1).unwrap();
            t[12..18].copy_from_slice(&[0, 0, 9, 0, 4, 0]);
        }
        rec(RM_HEAP2, 0x60, main, vec![]).at(0x400).apply(&mut page).unwrap();
        let t = page_get_item(&page, 1).unwrap();
        assert_eq!((u32_at(t, 4), ctid(t)), (555, (9, 4)));
        assert_eq!(u16_at(t, 20), 0x0002 | HEAP_XMAX_KEYSHR_LOCK);
    }

    #[test]
    fn inplace_replaces_the_data_of_the_same_length_only() {
        let mut page = page_with(1);
        rec(RM_HEAP, 0x70, 1u16.to_le_bytes().to_vec(), vec![7; 8]).at(0x300).apply(&mut page).unwrap();
        assert_eq!(&page_get_item(&page, 1).unwrap()[24..], &[7; 8]);
        assert_eq!(page_get_item(&page, 1).unwrap()[23], 0, "the bitmap byte before t_hoff stays");
        let r = rec(RM_HEAP, 0x70, 1u16.to_le_bytes().to_vec(), vec![7; 9]).at(0x400);
        assert!(matches!(r.apply(&mut page), Err(RedoError::DoesNotFit(_))));
    }

    #[test]
    fn confirm_points_ctid_at_the_tuple() {
        let mut page = page_with(1);
        page_get_item_mut(&mut page, 1).unwrap()[12..18].copy_from_slice(&[0, 0, 0, 0, 0xFE, 0xFF]);
        rec(RM_HEAP, 0x50, 1u16.to_le_bytes().to_vec(), vec![]).at(0x300).apply(&mut page).unwrap();
        assert_eq!(ctid(page_get_item(&page, 1).unwrap()), (BLK, 1));
    }

    fn offs(list: &[u16]) -> Vec<u8> {
        list.iter().flat_map(|o| o.to_le_bytes()).collect()
    }

    #[test]
    fn prune_redirects_kills_frees_and_compacts() {
        let mut page = page_with(4);
        // Tuples are 32 bytes: 1 at 8160, 2 at 8128, 3 at 8096, 4 at 8064.
        let mut main = 0u32.to_le_bytes().to_vec();
        main.extend_from_slice(&1u16.to_le_bytes());
        main.extend_from_slice(&1u16.to_le_bytes());
        rec(RM_HEAP2, 0x10, main, offs(&[1, 3, 2, 4])).at(0x300).apply(&mut page).unwrap();
        let lp = |o| {
            let id = item_id(&page, o).unwrap();
            (id.off, id.flags, id.len)
        };
        assert_eq!(lp(1), (3, LP_REDIRECT, 0));
        assert_eq!(lp(2), (0, LP_DEAD, 0));
        assert_eq!(lp(3), (8160, LP_NORMAL, 32));
        assert_eq!(page_get_max_offset(&page), 3, "the unused last line pointer is truncated");
        assert_eq!(page::pd_upper(&page), 8160);
        assert_eq!(&page_get_item(&page, 3).unwrap()[24..], &[3; 8]);
        assert_eq!(page_lsn(&page), 0x300);
        let mut bad = rec(RM_HEAP2, 0x10, vec![0, 0, 0, 0, 2, 0, 0, 0], offs(&[1]));
        bad.end_lsn = 0x400;
        assert!(matches!(bad.apply(&mut page), Err(RedoError::Malformed(_))));
        let past = rec(RM_HEAP2, 0x10, vec![0; 8], offs(&[9])).at(0x400);
        assert!(matches!(past.apply(&mut page), Err(RedoError::DoesNotFit(_))));
    }

    #[test]
    fn vacuum_frees_dead_pointers_and_truncates_the_array() {
        let mut page = page_with(3);
        rec(RM_HEAP2, 0x10, vec![0, 0, 0, 0, 0, 0, 2, 0], offs(&[2, 3])).at(0x200).apply(&mut page).unwrap();
        rec(RM_HEAP2, 0x20, 2u16.to_le_bytes().to_vec(), offs(&[2, 3])).at(0x300).apply(&mut page).unwrap();
        assert_eq!(page_get_max_offset(&page), 1);
        assert_eq!(page::pd_flags(&page) & bufpage::PD_HAS_FREE_LINES, 0);
        assert_eq!(item_id(&page, 2).unwrap().flags, LP_UNUSED);
        let short = rec(RM_HEAP2, 0x20, 3u16.to_le_bytes().to_vec(), offs(&[1])).at(0x400);
        assert!(matches!(short.apply(&mut page), Err(RedoError::Malformed(_))));
    }

    #[test]
    fn freeze_page_sets_xmax_xvac_and_infomasks() {
        let mut page = page_with(2);
        let mut main = 100u32.to_le_bytes().to_vec();
        main.extend_from_slice(&1u16.to_le_bytes());
        let mut data = 0u32.to_le_bytes().to_vec();
        data.extend_from_slice(&2u16.to_le_bytes());
        data.extend_from_slice(&0x0003u16.to_le_bytes());
        data.extend_from_slice(&0x0B02u16.to_le_bytes());
        data.extend_from_slice(&[XLH_FREEZE_XVAC, 0]);
        rec(RM_HEAP2, 0x30, main, data).at(0x300).apply(&mut page).unwrap();
        let t = page_get_item(&page, 2).unwrap();
        assert_eq!((u32_at(t, 4), u32_at(t, 8), u16_at(t, 18), u16_at(t, 20)), (0, 2, 3, 0x0B02));
        assert_eq!(page_lsn(&page), 0x300);
    }

    #[test]
    fn multi_insert_with_and_without_init_places_each_tuple() {
        let tuple = |body: &[u8]| {
            let mut v = (body.len() as u16 + 1).to_le_bytes().to_vec();
            v.extend_from_slice(&xl_header(3, 0x0802, 24));
            v.push(0);
            v.extend_from_slice(body);
            v
        };
        let mut data = tuple(&[1; 3]); // 11 bytes: the next header starts at 12
        data.push(0xEE);
        data.extend_from_slice(&tuple(&[2; 4]));
        let mut page = Box::new([0u8; BLCKSZ]);
        rec(RM_HEAP2, 0x50 | 0x80, vec![0, 0, 2, 0], data.clone()).at(0x200).apply(&mut page).unwrap();
        assert_eq!(&page_get_item(&page, 1).unwrap()[23..], &[0, 1, 1, 1]);
        assert_eq!(&page_get_item(&page, 2).unwrap()[23..], &[0, 2, 2, 2, 2]);
        assert_eq!(ctid(page_get_item(&page, 2).unwrap()), (BLK, 2));
        let mut main = vec![XLH_INSERT_ALL_FROZEN_SET, 0, 2, 0];
        main.extend_from_slice(&offs(&[4, 3]));
        let r = rec(RM_HEAP2, 0x50, main.clone(), data.clone()).at(0x300);
        assert!(r.apply(&mut page).is_err(), "offset 4 past the end");
        main[4..].copy_from_slice(&offs(&[3, 4]));
        rec(RM_HEAP2, 0x50, main.clone(), data.clone()).at(0x300).apply(&mut page).unwrap();
        assert_eq!(page_get_max_offset(&page), 4);
        assert_eq!(page::pd_flags(&page) & PD_ALL_VISIBLE, PD_ALL_VISIBLE);
        data.push(0);
        let r = rec(RM_HEAP2, 0x50 | 0x80, vec![0, 0, 2, 0], data).at(0x400);
        assert!(matches!(r.apply(&mut page), Err(RedoError::Malformed(_))), "trailing bytes");
    }

    /// PostgreSQL 15's default (no data checksums, `wal_log_hints` off): the heap page of
    /// VISIBLE gets `PD_ALL_VISIBLE` and keeps its LSN, with or without a check-only image.
    #[test]
    fn visible_on_the_heap_page_sets_all_visible_and_keeps_the_page_lsn() {
        for flags in [0, FLAG_HAD_IMAGE] {
            let mut r = rec(RM_HEAP2, 0x40, vec![0, 0, 0, 0, 3], vec![]).at(0x300);
            r.blocks = vec![(0, 0, 0, vec![]), (1, 6, flags, vec![])];
            r.target = 1;
            let mut heap = page_with(1);
            assert_eq!(page_lsn(&heap), 0x10);
            r.apply(&mut heap).unwrap();
            assert_eq!(page::pd_flags(&heap) & PD_ALL_VISIBLE, PD_ALL_VISIBLE);
            assert_eq!(page_lsn(&heap), 0x10, "block flags {flags:#x}: the heap page's LSN stays");
        }
    }

    #[test]
    fn visible_sets_the_heap_flag_on_block_one_and_the_map_bits_on_block_zero() {
        let mut r = rec(RM_HEAP2, 0x40, vec![0, 0, 0, 0, 3], vec![]).at(0x300);
        r.blocks = vec![(0, 0, 0, vec![]), (1, 6, 0, vec![])];
        r.target = 1;
        let mut heap = page_with(1);
        r.apply(&mut heap).unwrap();
        assert_eq!(page::pd_flags(&heap) & PD_ALL_VISIBLE, PD_ALL_VISIBLE);
        r.target = 0;
        let mut map = Box::new([0u8; BLCKSZ]);
        r.apply(&mut map).unwrap();
        assert_eq!((page::pd_lower(&map), page::pd_upper(&map)), (24, 8192), "initialised");
        assert_eq!(map[24 + 1], 0b0011_0000, "heap block 6: byte 1, bits 4-5");
        assert_eq!(page_lsn(&map), 0x300);
        // The same bits again change nothing, not even the LSN.
        let again = Rec { end_lsn: 0x400, ..r };
        again.apply(&mut map).unwrap();
        assert_eq!(page_lsn(&map), 0x300);
        let clear =
            crate::pg15::VmClear { rmid: 10, info: 0x10, lsn: 0x480, end_lsn: 0x500, clears: vec![(6, 1)] };
        let mut bytes = Vec::new();
        clear.encode(&mut bytes).unwrap();
        apply(&bytes, &mut map).unwrap().unwrap();
        assert_eq!((map[25], page_lsn(&map)), (0b0010_0000, 0x300));
        let mut zero = Box::new([0u8; BLCKSZ]);
        apply(&bytes, &mut zero).unwrap().unwrap();
        assert_eq!((page::pd_upper(&zero), page_lsn(&zero)), (8192, 0), "a zero map page is initialised");
    }

    #[test]
    fn truncate_and_new_cid_are_unsupported() {
        let mut page = page_with(1);
        let r = rec(RM_HEAP, 0x30, vec![0; 16], vec![]).at(0x300);
        assert!(matches!(r.apply(&mut page), Err(RedoError::Unsupported(name)) if name == "Heap TRUNCATE"));
        let r = rec(RM_HEAP2, 0x70, vec![0; 16], vec![]).at(0x300);
        assert!(matches!(r.apply(&mut page), Err(RedoError::Unsupported(_))));
    }

    proptest! {
        #[test]
        fn random_heap_records_never_panic(
            rmid in prop_oneof![Just(RM_HEAP), Just(RM_HEAP2)],
            info in any::<u8>(),
            main in proptest::collection::vec(any::<u8>(), 0..40),
            data in proptest::collection::vec(any::<u8>(), 0..120),
            two_blocks in any::<bool>(),
            target in 0u8..2,
            sane in any::<bool>(),
            noise in proptest::collection::vec((0usize..BLCKSZ, any::<u8>()), 0..40),
            small in proptest::collection::vec(0u8..6, 0..20),
        ) {
            let mut page = if sane { page_with(4) } else { Box::new([0u8; BLCKSZ]) };
            for (at, b) in noise {
                page[at] = b;
            }
            // Small values make offsets and counts hit the page's line pointers often.
            let mut main = main;
            for (i, v) in small.iter().enumerate() {
                if let Some(b) = main.get_mut(i * 2) { *b = *v; }
            }
            let mut r = rec(rmid, info, main, data).at(0x10000);
            if two_blocks {
                r.blocks.push((1, 6, 0, vec![]));
                r.target = target;
            }
            let _ = r.apply(&mut page);
        }
    }
}
