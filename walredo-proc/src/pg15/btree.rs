//! Redo of Btree records (PostgreSQL 15's `nbtxlog.c`), for the record's target block: every
//! record type, each page it touches (the target block id says which part of the routine runs).
//!
//! Page layout (`nbtree.h`): an index page is a PostgreSQL page whose special space is
//! `BTPageOpaqueData` (16 bytes: `btpo_prev`, `btpo_next`, `btpo_level` `u32`, `btpo_flags`,
//! `btpo_cycleid` `u16`); the metapage (block 0) carries `BTMetaPageData` right after the page
//! header. Records' structs are those of `nbtxlog.h` as PostgreSQL 15 (x86-64) lays them out.
//!
//! Blocks per record, as `nbtinsert.c`/`nbtpage.c`/`nbtdedup.c` register them:
//! - INSERT_LEAF/INSERT_POST: 0 the leaf. INSERT_UPPER: 0 the page, 1 the child whose
//!   incomplete split ends. INSERT_META: those and 2 the metapage.
//! - SPLIT_L/SPLIT_R: 0 the original (left) page, 1 the new right page (initialised), 2 the
//!   old right sibling (its `btpo_prev` becomes block 1), 3 the child whose split ends (upper
//!   levels only).
//! - DEDUP, VACUUM, DELETE: 0 the leaf. MARK_PAGE_HALFDEAD: 0 the leaf (rebuilt), 1 the parent.
//! - UNLINK_PAGE(_META): 0 the deleted page (rebuilt), 1 the left sibling, 2 the right sibling,
//!   3 the half-dead leaf (rebuilt, when an upper page was deleted), 4 the metapage (META).
//! - NEWROOT: 0 the root (rebuilt), 1 the left child (upper levels), 2 the metapage.
//! - META_CLEANUP: 0 the metapage. REUSE_PAGE: no block (only a recovery conflict in
//!   PostgreSQL 15); given a target anyway, the page is left as it is.
//!
//! Where PostgreSQL PANICs or ERRORs (a tuple that does not fit, an offset past the line
//! pointers) this returns an error; where it would read past the record or page on corrupt
//! input, this returns an error too. Invariants: pure; never panics on any record or page.

mod tuple;

use super::bufpage;
use super::{BlockRedo, RedoError, Target};
use crate::page::{self, Page, BLCKSZ, PAGE_HEADER_SIZE};
use tuple::{Interval, INDEX_TUPLE_HEADER};

/// Record types (`info & 0xF0`).
pub const XLOG_BTREE_INSERT_LEAF: u8 = 0x00;
pub const XLOG_BTREE_INSERT_UPPER: u8 = 0x10;
pub const XLOG_BTREE_INSERT_META: u8 = 0x20;
pub const XLOG_BTREE_SPLIT_L: u8 = 0x30;
pub const XLOG_BTREE_SPLIT_R: u8 = 0x40;
pub const XLOG_BTREE_INSERT_POST: u8 = 0x50;
pub const XLOG_BTREE_DEDUP: u8 = 0x60;
pub const XLOG_BTREE_DELETE: u8 = 0x70;
pub const XLOG_BTREE_UNLINK_PAGE: u8 = 0x80;
pub const XLOG_BTREE_UNLINK_PAGE_META: u8 = 0x90;
pub const XLOG_BTREE_NEWROOT: u8 = 0xA0;
pub const XLOG_BTREE_MARK_PAGE_HALFDEAD: u8 = 0xB0;
pub const XLOG_BTREE_VACUUM: u8 = 0xC0;
pub const XLOG_BTREE_REUSE_PAGE: u8 = 0xD0;
pub const XLOG_BTREE_META_CLEANUP: u8 = 0xE0;

/// `btpo_flags` bits.
pub const BTP_LEAF: u16 = 1 << 0;
pub const BTP_ROOT: u16 = 1 << 1;
pub const BTP_DELETED: u16 = 1 << 2;
pub const BTP_META: u16 = 1 << 3;
pub const BTP_HALF_DEAD: u16 = 1 << 4;
pub const BTP_SPLIT_END: u16 = 1 << 5;
pub const BTP_HAS_GARBAGE: u16 = 1 << 6;
pub const BTP_INCOMPLETE_SPLIT: u16 = 1 << 7;
pub const BTP_HAS_FULLXID: u16 = 1 << 8;

/// `P_NONE`: no sibling.
pub const P_NONE: u32 = 0;
/// `BTREE_MAGIC`, in `btm_magic`.
pub const BTREE_MAGIC: u32 = 0x053162;
/// `MAXALIGN(sizeof(BTPageOpaqueData))`.
pub const BT_SPECIAL_SIZE: usize = 16;
/// `sizeof(BTMetaPageData)`: the metapage's `pd_lower` is the header plus this.
pub const BT_META_SIZE: usize = 48;
/// `sizeof(xl_btree_metadata)`.
const XL_METADATA_SIZE: usize = 28;
const P_HIKEY: u16 = 1;
/// `MaxIndexTuplesPerPage`.
const MAX_INDEX_TUPLES: usize = (BLCKSZ - PAGE_HEADER_SIZE) / (8 + 4);

/// Applies a Btree record to the page of its target block.
pub fn redo(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let rec = Rec::new(target);
    match target.record.info & 0xF0 {
        XLOG_BTREE_INSERT_LEAF => rec.insert(page, true, false, false),
        XLOG_BTREE_INSERT_UPPER => rec.insert(page, false, false, false),
        XLOG_BTREE_INSERT_META => rec.insert(page, false, true, false),
        XLOG_BTREE_INSERT_POST => rec.insert(page, true, false, true),
        XLOG_BTREE_SPLIT_L => rec.split(page, true),
        XLOG_BTREE_SPLIT_R => rec.split(page, false),
        XLOG_BTREE_DEDUP => rec.only(0).and_then(|()| rec.dedup(page)),
        XLOG_BTREE_VACUUM => rec.only(0).and_then(|()| rec.vacuum_or_delete(page, true)),
        XLOG_BTREE_DELETE => rec.only(0).and_then(|()| rec.vacuum_or_delete(page, false)),
        XLOG_BTREE_MARK_PAGE_HALFDEAD => rec.mark_page_halfdead(page),
        XLOG_BTREE_UNLINK_PAGE => rec.unlink_page(page, false),
        XLOG_BTREE_UNLINK_PAGE_META => rec.unlink_page(page, true),
        XLOG_BTREE_NEWROOT => rec.newroot(page),
        // PostgreSQL 15 only resolves a recovery conflict; no page changes.
        XLOG_BTREE_REUSE_PAGE => Ok(()),
        XLOG_BTREE_META_CLEANUP => rec.only(0).and_then(|()| rec.restore_meta(page)),
        _ => Err(RedoError::Unsupported(target.type_name())),
    }
}

/// This module's redo of one block: [`BlockRedo`] with the helpers of Btree records.
type Rec<'t, 'r, 'a> = BlockRedo<'t, 'r, 'a, Btree>;

/// Marks [`Rec`]: the helpers below are Btree's alone.
pub enum Btree {}

impl Rec<'_, '_, '_> {
    /// Block number of the record's block `id`, if it references one.
    fn blkno(&self, id: u8) -> Option<u32> {
        self.target.record.blocks.iter().find(|b| b.id == id).map(|b| b.blkno)
    }

    /// `btree_xlog_insert`.
    fn insert(&self, page: &mut Page, isleaf: bool, ismeta: bool, posting: bool) -> Result<(), RedoError> {
        match self.id {
            1 if !isleaf => self.clear_incomplete_split(page),
            2 if ismeta => self.restore_meta(page),
            0 => {
                let offnum = self.main_u16(0)?;
                let data = self.data();
                if !posting {
                    self.add_item(page, data, offnum)?;
                } else {
                    let postingoff = le_u16(data, 0).ok_or_else(|| self.malformed("no posting offset"))?;
                    let mut newitem = data.get(2..).unwrap_or_default().to_vec();
                    let prev = offnum.wrapping_sub(1);
                    let oposting = self.get_item(page, prev)?;
                    let nposting = tuple::swap_posting(&mut newitem, oposting, postingoff)?;
                    self.get_item_mut(page, prev)?.copy_from_slice(&nposting);
                    self.add_item(page, &newitem, offnum)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `btree_xlog_split`.
    fn split(&self, page: &mut Page, newitemonleft: bool) -> Result<(), RedoError> {
        let level = self.main_u32(0)?;
        let firstrightoff = self.main_u16(4)?;
        let newitemoff = self.main_u16(6)?;
        let postingoff = self.main_u16(8)?;
        let isleaf = level == 0;
        let origpagenumber = self.blkno(0).ok_or_else(|| self.malformed("no block 0"))?;
        let rightpagenumber = self.blkno(1).ok_or_else(|| self.malformed("no block 1"))?;
        match self.id {
            3 if !isleaf => self.clear_incomplete_split(page),
            1 => {
                bufpage::page_init(page, BT_SPECIAL_SIZE);
                let op = Opaque {
                    prev: origpagenumber,
                    next: self.blkno(2).unwrap_or(P_NONE),
                    level,
                    flags: if isleaf { BTP_LEAF } else { 0 },
                    cycleid: 0,
                };
                self.put_opaque(page, &op)?;
                self.restore_page(page, self.data())?;
                self.set_lsn(page);
                Ok(())
            }
            2 => {
                let mut op = self.opaque(page)?;
                op.prev = rightpagenumber;
                self.put_opaque(page, &op)?;
                self.set_lsn(page);
                Ok(())
            }
            0 => {
                let oop = self.opaque(page)?;
                let mut data = self.data();
                let mut newitem = Vec::new();
                let mut nposting = None;
                // InvalidOffsetNumber: no posting list to replace.
                let mut replacepostingoff = 0u16;
                if newitemonleft || postingoff != 0 {
                    newitem = self.take_tuple(&mut data)?.to_vec();
                    if postingoff != 0 {
                        replacepostingoff = newitemoff.wrapping_sub(1);
                        let oposting = self.get_item(page, replacepostingoff)?;
                        nposting = Some(tuple::swap_posting(&mut newitem, oposting, postingoff)?);
                    }
                }
                let hikey = self.take_tuple(&mut data)?.to_vec();
                if !data.is_empty() {
                    return Err(self.malformed("data after the left page's high key"));
                }
                let parts =
                    SplitLeft { newitem, hikey, nposting, replacepostingoff, firstrightoff, newitemoff };
                self.split_left(page, &oop, isleaf, rightpagenumber, newitemonleft, &parts)
            }
            _ => Err(self.not_touched()),
        }
    }

    /// The original page's part of `btree_xlog_split`: rebuilt on a temporary page with the
    /// new high key, the items left of the split (the new item and the replaced posting list
    /// where they go), in item order, as `_bt_split` built it.
    fn split_left(
        &self,
        page: &mut Page,
        oop: &Opaque,
        isleaf: bool,
        rightpagenumber: u32,
        newitemonleft: bool,
        p: &SplitLeft,
    ) -> Result<(), RedoError> {
        let mut left = self.temp_page_copy_special(page)?;
        self.add_item(&mut left, &p.hikey, P_HIKEY)?;
        let mut leftoff = P_HIKEY + 1;
        let mut off = oop.first_data_key();
        while off < p.firstrightoff {
            if off == p.replacepostingoff {
                if let Some(np) = &p.nposting {
                    let size = crate::page::maxalign(tuple::tuple_size(np)?);
                    let np =
                        np.get(..size).ok_or_else(|| self.no_fit("posting list shorter than its size"))?;
                    self.add_item(&mut left, np, leftoff)?;
                }
                leftoff = leftoff.wrapping_add(1);
                off += 1;
                continue;
            } else if newitemonleft && off == p.newitemoff {
                self.add_item(&mut left, &p.newitem, leftoff)?;
                leftoff = leftoff.wrapping_add(1);
            }
            let item = self.get_item(page, off)?;
            self.add_item(&mut left, item, leftoff)?;
            leftoff = leftoff.wrapping_add(1);
            off += 1;
        }
        if newitemonleft && off == p.newitemoff {
            self.add_item(&mut left, &p.newitem, leftoff)?;
        }
        *page = *left;
        let mut op = self.opaque(page)?;
        op.flags = BTP_INCOMPLETE_SPLIT | if isleaf { BTP_LEAF } else { 0 };
        op.next = rightpagenumber;
        op.cycleid = 0;
        self.put_opaque(page, &op)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `btree_xlog_dedup`: the leaf rebuilt on a temporary page, merging the items of each
    /// logged interval into one posting list.
    fn dedup(&self, page: &mut Page) -> Result<(), RedoError> {
        let nintervals = usize::from(self.main_u16(0)?);
        let intervals: Vec<Interval> = self
            .data()
            .chunks_exact(4)
            .take(nintervals)
            .map(|c| Interval {
                baseoff: u16::from_le_bytes([c[0], c[1]]),
                nitems: u16::from_le_bytes([c[2], c[3]]),
            })
            .collect();
        if intervals.len() != nintervals {
            return Err(self.malformed("fewer intervals than the record counts"));
        }
        let op = self.opaque(page)?;
        let minoff = op.first_data_key();
        let maxoff = self.max_offset(page)?;
        let mut newpage = self.temp_page_copy_special(page)?;
        if op.next != P_NONE {
            let hikey = self.get_item(page, P_HIKEY)?;
            self.add_item(&mut newpage, hikey, P_HIKEY)?;
        }
        let mut state: Option<tuple::DedupState<'_>> = None;
        for offnum in minoff..=maxoff {
            let itup = self.get_item(page, offnum)?;
            let next = match state.take() {
                None => tuple::DedupState::start(itup, offnum, 0)?,
                Some(mut st) => {
                    let merge = intervals
                        .get(st.nintervals)
                        .is_some_and(|iv| st.baseoff == iv.baseoff && st.nitems < iv.nitems);
                    if merge {
                        if !st.save_htid(itup)? {
                            return Err(
                                self.no_fit("deduplication failed to add heap tid to pending posting list")
                            );
                        }
                        st
                    } else {
                        self.dedup_finish(&mut newpage, &mut st)?;
                        tuple::DedupState::start(itup, offnum, st.nintervals)?
                    }
                }
            };
            state = Some(next);
        }
        let Some(mut st) = state else {
            return Err(self.no_fit("deduplication of a page without items"));
        };
        self.dedup_finish(&mut newpage, &mut st)?;
        if op.flags & BTP_HAS_GARBAGE != 0 {
            let mut nop = self.opaque(&newpage)?;
            nop.flags &= !BTP_HAS_GARBAGE;
            self.put_opaque(&mut newpage, &nop)?;
        }
        *page = *newpage;
        self.set_lsn(page);
        Ok(())
    }

    fn dedup_finish(&self, newpage: &mut Page, st: &mut tuple::DedupState<'_>) -> Result<(), RedoError> {
        let tup = st.finish()?;
        let off = self.max_offset(newpage)?.wrapping_add(1);
        self.add_item(newpage, &tup, off)?;
        Ok(())
    }

    /// `btree_xlog_vacuum` and `btree_xlog_delete`: posting lists updated, then items
    /// deleted, `BTP_HAS_GARBAGE` cleared. Neither touches `btpo_cycleid`: on the primary
    /// `_bt_delitems_vacuum` clears it too, but PostgreSQL 15's redo does not (`btree_mask`
    /// masks the cycle id), and this is PostgreSQL's redo.
    fn vacuum_or_delete(&self, page: &mut Page, vacuum: bool) -> Result<(), RedoError> {
        // xl_btree_vacuum { ndeleted, nupdated }; xl_btree_delete { latestRemovedXid, ndeleted, nupdated }
        let at = if vacuum { 0 } else { 4 };
        let ndeleted = usize::from(self.main_u16(at)?);
        let nupdated = usize::from(self.main_u16(at + 2)?);
        let data = self.data();
        let deleted =
            u16s(data, 0, ndeleted).ok_or_else(|| self.malformed("fewer deleted offsets than counted"))?;
        let upd_at = ndeleted * 2;
        let updated = u16s(data, upd_at, nupdated)
            .ok_or_else(|| self.malformed("fewer updated offsets than counted"))?;
        let mut pos = upd_at + nupdated * 2;
        for &off in &updated {
            let ndeletedtids =
                usize::from(le_u16(data, pos).ok_or_else(|| self.malformed("update cut short"))?);
            let tids = u16s(data, pos + 2, ndeletedtids).ok_or_else(|| self.malformed("update cut short"))?;
            pos += 2 + ndeletedtids * 2;
            let orig = self.get_item(page, off)?;
            let itup = tuple::update_posting(orig, &tids)?;
            bufpage::page_index_tuple_overwrite(page, off, &itup).map_err(|e| self.wrap(e))?;
        }
        if ndeleted > 0 {
            bufpage::page_index_multi_delete(page, &deleted).map_err(|e| self.wrap(e))?;
        }
        let mut op = self.opaque(page)?;
        op.flags &= !BTP_HAS_GARBAGE;
        self.put_opaque(page, &op)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `btree_xlog_mark_page_halfdead`.
    fn mark_page_halfdead(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_btree_mark_page_halfdead { poffset u16, leafblk, leftblk, rightblk, topparent }
        match self.id {
            1 => {
                let poffset = self.main_u16(0)?;
                let nextoffset = poffset.wrapping_add(1);
                let rightsib = tuple::tid_block(self.get_item(page, nextoffset)?)?;
                tuple::set_tid_block(self.get_item_mut(page, poffset)?, rightsib)?;
                bufpage::page_index_tuple_delete(page, nextoffset).map_err(|e| self.wrap(e))?;
                self.set_lsn(page);
                Ok(())
            }
            0 => {
                let (leftblk, rightblk, topparent) =
                    (self.main_u32(8)?, self.main_u32(12)?, self.main_u32(16)?);
                self.half_dead_leaf(page, leftblk, rightblk, topparent)
            }
            _ => Err(self.not_touched()),
        }
    }

    /// A leaf rebuilt as half-dead, its high key a dummy pointing to the top parent.
    fn half_dead_leaf(&self, page: &mut Page, prev: u32, next: u32, topparent: u32) -> Result<(), RedoError> {
        bufpage::page_init(page, BT_SPECIAL_SIZE);
        let op = Opaque { prev, next, level: 0, flags: BTP_HALF_DEAD | BTP_LEAF, cycleid: 0 };
        self.put_opaque(page, &op)?;
        // BTreeTupleSetTopParent on a zeroed IndexTupleData with t_info = its size.
        let mut trunctuple = [0u8; INDEX_TUPLE_HEADER];
        tuple::set_tid_block(&mut trunctuple, topparent)?;
        trunctuple[6..8].copy_from_slice(&(INDEX_TUPLE_HEADER as u16 | 0x2000).to_le_bytes());
        self.add_item(page, &trunctuple, P_HIKEY)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `btree_xlog_unlink_page`.
    fn unlink_page(&self, page: &mut Page, meta: bool) -> Result<(), RedoError> {
        // xl_btree_unlink_page { leftsib, rightsib, level, (pad), safexid u64 at 16,
        // leafleftsib, leafrightsib, leaftopparent }
        let (leftsib, rightsib) = (self.main_u32(0)?, self.main_u32(4)?);
        match self.id {
            1 if leftsib != P_NONE => {
                let mut op = self.opaque(page)?;
                op.next = rightsib;
                self.put_opaque(page, &op)?;
                self.set_lsn(page);
                Ok(())
            }
            0 => {
                let level = self.main_u32(8)?;
                let safexid = le_u64(self.main(), 16).ok_or_else(|| self.malformed("main data too short"))?;
                bufpage::page_init(page, BT_SPECIAL_SIZE);
                // BTPageSetDeleted: the safexid right after the header; pd_upper = pd_special.
                let mut flags = BTP_DELETED | BTP_HAS_FULLXID;
                if level == 0 {
                    flags |= BTP_LEAF;
                }
                let op = Opaque { prev: leftsib, next: rightsib, level, flags, cycleid: 0 };
                self.put_opaque(page, &op)?;
                page[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + 8].copy_from_slice(&safexid.to_le_bytes());
                page::set_pd_lower(page, (PAGE_HEADER_SIZE + 8) as u16);
                page::set_pd_upper(page, page::pd_special(page));
                self.set_lsn(page);
                Ok(())
            }
            2 => {
                let mut op = self.opaque(page)?;
                op.prev = leftsib;
                self.put_opaque(page, &op)?;
                self.set_lsn(page);
                Ok(())
            }
            3 => {
                let (l, r, top) = (self.main_u32(24)?, self.main_u32(28)?, self.main_u32(32)?);
                self.half_dead_leaf(page, l, r, top)
            }
            4 if meta => self.restore_meta(page),
            _ => Err(self.not_touched()),
        }
    }

    /// `btree_xlog_newroot`.
    fn newroot(&self, page: &mut Page) -> Result<(), RedoError> {
        // xl_btree_newroot { rootblk, level }
        let level = self.main_u32(4)?;
        match self.id {
            0 => {
                bufpage::page_init(page, BT_SPECIAL_SIZE);
                let flags = BTP_ROOT | if level == 0 { BTP_LEAF } else { 0 };
                let op = Opaque { prev: P_NONE, next: P_NONE, level, flags, cycleid: 0 };
                self.put_opaque(page, &op)?;
                if level > 0 {
                    self.restore_page(page, self.data())?;
                }
                self.set_lsn(page);
                Ok(())
            }
            1 if level > 0 => self.clear_incomplete_split(page),
            2 => self.restore_meta(page),
            _ => Err(self.not_touched()),
        }
    }

    /// `_bt_clear_incomplete_split`.
    fn clear_incomplete_split(&self, page: &mut Page) -> Result<(), RedoError> {
        let mut op = self.opaque(page)?;
        op.flags &= !BTP_INCOMPLETE_SPLIT;
        self.put_opaque(page, &op)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `_bt_restore_meta`: the metapage rebuilt from the block's `xl_btree_metadata`.
    fn restore_meta(&self, page: &mut Page) -> Result<(), RedoError> {
        let d = self.data();
        if d.len() < XL_METADATA_SIZE {
            return Err(self.malformed("metadata shorter than xl_btree_metadata"));
        }
        let field = |i: usize| le_u32(d, i * 4).unwrap_or_default();
        bufpage::page_init(page, BT_SPECIAL_SIZE);
        let md = PAGE_HEADER_SIZE;
        // btm_magic, btm_version, btm_root, btm_level, btm_fastroot, btm_fastlevel,
        // btm_last_cleanup_num_delpages; then btm_last_cleanup_num_heap_tuples (f64 at 32)
        // and btm_allequalimage (at 40).
        let words = [BTREE_MAGIC, field(0), field(1), field(2), field(3), field(4), field(5)];
        for (i, w) in words.iter().enumerate() {
            page[md + i * 4..md + i * 4 + 4].copy_from_slice(&w.to_le_bytes());
        }
        page[md + 32..md + 40].copy_from_slice(&(-1.0f64).to_le_bytes());
        page[md + 40] = d[24];
        let op = Opaque { prev: 0, next: 0, level: 0, flags: BTP_META, cycleid: 0 };
        self.put_opaque(page, &op)?;
        page::set_pd_lower(page, (md + BT_META_SIZE) as u16);
        self.set_lsn(page);
        Ok(())
    }

    /// `_bt_restore_page`: the tuples of an image of `pd_upper..pd_special` added back in
    /// reverse, so that the first (lowest) is the last item.
    fn restore_page(&self, page: &mut Page, from: &[u8]) -> Result<(), RedoError> {
        let mut items = Vec::new();
        let mut rest = from;
        while !rest.is_empty() {
            if items.len() >= MAX_INDEX_TUPLES {
                return Err(self.malformed("more tuples than a page holds"));
            }
            items.push(self.take_tuple(&mut rest)?);
        }
        let n = items.len();
        for (i, item) in items.iter().enumerate().rev() {
            // n <= MAX_INDEX_TUPLES, so this fits in u16.
            self.add_item(page, item, (n - i) as u16)?;
        }
        Ok(())
    }

    /// The next `MAXALIGN(IndexTupleSize)` bytes of `data`, a tuple of the record.
    fn take_tuple<'d>(&self, data: &mut &'d [u8]) -> Result<&'d [u8], RedoError> {
        let size =
            crate::page::maxalign(tuple::tuple_size(data).map_err(|_| self.malformed("tuple cut short"))?);
        if size == 0 || size > data.len() {
            return Err(self.malformed("tuple cut short"));
        }
        let (tup, rest) = data.split_at(size);
        *data = rest;
        Ok(tup)
    }

    /// `PageGetTempPageCopySpecial`: an empty page with this page's special space.
    fn temp_page_copy_special(&self, page: &Page) -> Result<Box<Page>, RedoError> {
        let bounds = page::check_header(page).map_err(|e| self.no_fit(e))?;
        let special = bounds.special();
        let mut temp = Box::new([0u8; BLCKSZ]);
        bufpage::page_init(&mut temp, BLCKSZ - special);
        temp[special..].copy_from_slice(&page[special..]);
        Ok(temp)
    }

    fn opaque(&self, page: &Page) -> Result<Opaque, RedoError> {
        Opaque::read(page).ok_or_else(|| self.no_fit("no room for the btree special space"))
    }

    fn put_opaque(&self, page: &mut Page, op: &Opaque) -> Result<(), RedoError> {
        op.write(page).ok_or_else(|| self.no_fit("no room for the btree special space"))
    }

    fn add_item(&self, page: &mut Page, item: &[u8], offnum: u16) -> Result<(), RedoError> {
        bufpage::page_add_item(page, item, offnum, false, false).map_err(|e| self.wrap(e))?;
        Ok(())
    }

    fn get_item<'p>(&self, page: &'p Page, offnum: u16) -> Result<&'p [u8], RedoError> {
        bufpage::page_get_item(page, offnum).map_err(|e| self.wrap(e))
    }

    fn get_item_mut<'p>(&self, page: &'p mut Page, offnum: u16) -> Result<&'p mut [u8], RedoError> {
        bufpage::page_get_item_mut(page, offnum).map_err(|e| self.wrap(e))
    }

    fn max_offset(&self, page: &Page) -> Result<u16, RedoError> {
        Ok(bufpage::page_get_max_offset(page))
    }
}

/// What the original page of a split is rebuilt from.
struct SplitLeft {
    newitem: Vec<u8>,
    hikey: Vec<u8>,
    nposting: Option<Vec<u8>>,
    replacepostingoff: u16,
    firstrightoff: u16,
    newitemoff: u16,
}

/// `BTPageOpaqueData`, at `pd_special`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opaque {
    pub prev: u32,
    pub next: u32,
    pub level: u32,
    pub flags: u16,
    pub cycleid: u16,
}

impl Opaque {
    fn at(page: &Page) -> Option<usize> {
        let at = usize::from(page::pd_special(page));
        (at.checked_add(BT_SPECIAL_SIZE)? <= BLCKSZ).then_some(at)
    }

    /// The special space of `page`; `None` if `pd_special` leaves no room for it.
    pub fn read(page: &Page) -> Option<Opaque> {
        let at = Self::at(page)?;
        Some(Opaque {
            prev: le_u32(page, at)?,
            next: le_u32(page, at + 4)?,
            level: le_u32(page, at + 8)?,
            flags: le_u16(page, at + 12)?,
            cycleid: le_u16(page, at + 14)?,
        })
    }

    pub fn write(&self, page: &mut Page) -> Option<()> {
        let at = Self::at(page)?;
        page[at..at + 4].copy_from_slice(&self.prev.to_le_bytes());
        page[at + 4..at + 8].copy_from_slice(&self.next.to_le_bytes());
        page[at + 8..at + 12].copy_from_slice(&self.level.to_le_bytes());
        page[at + 12..at + 14].copy_from_slice(&self.flags.to_le_bytes());
        page[at + 14..at + 16].copy_from_slice(&self.cycleid.to_le_bytes());
        Some(())
    }

    /// `P_FIRSTDATAKEY`: 1 on the rightmost page of a level (no high key), else 2.
    fn first_data_key(&self) -> u16 {
        if self.next == P_NONE {
            P_HIKEY
        } else {
            P_HIKEY + 1
        }
    }
}

fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_le_bytes([s[0], s[1]]))
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(u64::from_le_bytes(a))
}

/// `n` little-endian `u16` at `at`.
fn u16s(b: &[u8], at: usize, n: usize) -> Option<Vec<u16>> {
    let end = at.checked_add(n.checked_mul(2)?)?;
    Some(b.get(at..end)?.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::tuple::tests::{leaf_tuple, posting};
    use super::*;
    use crate::pg15::{BlockHeader, Pg15Record, FLAG_HAS_DATA, FLAG_WILL_INIT};
    use proptest::prelude::*;

    const END_LSN: u64 = 0x1_0000_0100;

    fn block(id: u8, blkno: u32, data: &[u8]) -> BlockHeader<'_> {
        BlockHeader {
            id,
            flags: FLAG_HAS_DATA | FLAG_WILL_INIT,
            fork: 0,
            spcnode: 1663,
            dbnode: 5,
            relnode: 16384,
            blkno,
            data,
        }
    }

    fn record<'a>(info: u8, main: &'a [u8], blocks: Vec<BlockHeader<'a>>) -> Pg15Record<'a> {
        Pg15Record {
            rmid: 11,
            info,
            xid: 700,
            lsn: END_LSN - 0x40,
            end_lsn: END_LSN,
            target: 0,
            blocks,
            main_data: main,
        }
    }

    /// Applies `rec` to `page` as its block `id`.
    fn apply(rec: &Pg15Record<'_>, id: u8, page: &mut Page) -> Result<(), RedoError> {
        let block = rec.blocks.iter().find(|b| b.id == id).unwrap();
        redo(&Target { record: rec, block }, page)
    }

    /// A btree page (`_bt_pageinit`) with `op` and `items` added in order.
    fn bt_page(op: Opaque, items: &[Vec<u8>]) -> Box<Page> {
        let mut page = Box::new([0u8; BLCKSZ]);
        bufpage::page_init(&mut page, BT_SPECIAL_SIZE);
        op.write(&mut page).unwrap();
        for (i, item) in items.iter().enumerate() {
            bufpage::page_add_item(&mut page, item, (i + 1) as u16, false, false).unwrap();
        }
        page
    }

    fn leaf(next: u32) -> Opaque {
        Opaque { prev: P_NONE, next, level: 0, flags: BTP_LEAF, cycleid: 0 }
    }

    fn items_of(page: &Page) -> Vec<Vec<u8>> {
        let n = bufpage::page_get_max_offset(page);
        (1..=n).map(|i| bufpage::page_get_item(page, i).unwrap().to_vec()).collect()
    }

    /// `page` must equal `want` but for the LSN, which must be the record's end.
    fn assert_page(page: &Page, want: &Page) {
        assert_eq!(page::page_lsn(page), END_LSN);
        assert_eq!(page[8..], want[8..]);
    }

    fn keys(n: u64) -> Vec<Vec<u8>> {
        (1..=n).map(|k| leaf_tuple(1, k as u16, k)).collect()
    }

    #[test]
    fn insert_leaf_in_the_middle_shifts_line_pointers() {
        let mut page = bt_page(leaf(P_NONE), &[leaf_tuple(1, 1, 10), leaf_tuple(1, 3, 30)]);
        let item = leaf_tuple(1, 2, 20);
        let rec = record(XLOG_BTREE_INSERT_LEAF, &[2, 0], vec![block(0, 1, &item)]);
        apply(&rec, 0, &mut page).unwrap();
        let mut want = bt_page(leaf(P_NONE), &[leaf_tuple(1, 1, 10), leaf_tuple(1, 3, 30)]);
        bufpage::page_add_item(&mut want, &item, 2, false, false).unwrap();
        assert_page(&page, &want);
        assert_eq!(items_of(&page), vec![leaf_tuple(1, 1, 10), item, leaf_tuple(1, 3, 30)]);
    }

    #[test]
    fn insert_meta_clears_the_childs_split_and_rebuilds_the_metapage() {
        let mut child = bt_page(Opaque { flags: BTP_LEAF | BTP_INCOMPLETE_SPLIT, ..leaf(9) }, &keys(2));
        let mut meta = [0u8; 28];
        for (i, v) in [4u32, 3, 1, 3, 1, 0].iter().enumerate() {
            meta[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        meta[24] = 1;
        let downlink = leaf_tuple(9, 0, 5);
        let rec = record(
            XLOG_BTREE_INSERT_META,
            &[2, 0],
            vec![block(0, 3, &downlink), block(1, 8, &[]), block(2, 0, &meta)],
        );
        apply(&rec, 1, &mut child).unwrap();
        assert_eq!(Opaque::read(&child).unwrap().flags, BTP_LEAF);
        assert_eq!(page::page_lsn(&child), END_LSN);
        let mut metapage = Box::new([0xAAu8; BLCKSZ]);
        apply(&rec, 2, &mut metapage).unwrap();
        assert_eq!(page::pd_lower(&metapage), 72);
        assert_eq!(page::pd_upper(&metapage), 8176);
        assert_eq!(le_u32(&metapage[..], 24), Some(BTREE_MAGIC));
        assert_eq!(le_u32(&metapage[..], 28), Some(4));
        assert_eq!(le_u32(&metapage[..], 32), Some(3), "root");
        assert_eq!(metapage[56..64], (-1.0f64).to_le_bytes());
        assert_eq!(metapage[64], 1);
        assert_eq!(Opaque::read(&metapage).unwrap().flags, BTP_META);
        assert!(metapage[72..8176].iter().all(|&b| b == 0));
    }

    #[test]
    fn insert_post_splits_the_posting_list_before_the_new_item() {
        let old = posting(7, &[(1, 1), (1, 3), (1, 5)]);
        let mut page = bt_page(leaf(P_NONE), &[old]);
        let mut data = 1u16.to_le_bytes().to_vec();
        data.extend_from_slice(&leaf_tuple(1, 2, 7));
        let rec = record(XLOG_BTREE_INSERT_POST, &[2, 0], vec![block(0, 1, &data)]);
        apply(&rec, 0, &mut page).unwrap();
        assert_eq!(items_of(&page), vec![posting(7, &[(1, 1), (1, 2), (1, 3)]), leaf_tuple(1, 5, 7)]);
    }

    /// `xl_btree_split` main data.
    fn split_main(level: u32, firstrightoff: u16, newitemoff: u16, postingoff: u16) -> Vec<u8> {
        let mut m = level.to_le_bytes().to_vec();
        for v in [firstrightoff, newitemoff, postingoff] {
            m.extend_from_slice(&v.to_le_bytes());
        }
        m
    }

    /// A right page's tuples as `_bt_split` logs them: `pd_upper..pd_special`.
    fn upper_image(items: &[Vec<u8>]) -> Vec<u8> {
        items.iter().rev().flatten().copied().collect()
    }

    #[test]
    fn split_of_a_full_leaf_rebuilds_both_halves_and_relinks_the_sibling() {
        // A rightmost-but-one leaf (high key at 1) full of 16-byte tuples, split at item 200,
        // the new item going left at 100.
        let mut all = vec![leaf_tuple(0, 0, 10_000)];
        all.extend(keys(406));
        let mut orig = bt_page(Opaque { prev: 4, next: 6, level: 0, flags: BTP_LEAF, cycleid: 3 }, &all);
        assert!(bufpage::page_add_item(&mut orig, &leaf_tuple(1, 1, 1), 0, false, false).is_err(), "full");
        let newitem = leaf_tuple(2, 2, 99);
        let hikey = leaf_tuple(0, 0, 199);
        let right: Vec<Vec<u8>> = std::iter::once(all[0].clone()).chain(all[200..].iter().cloned()).collect();
        let mut right_items = vec![leaf_tuple(0, 0, 10_000)];
        right_items.extend(all[200..].iter().cloned());
        let right_img = upper_image(&right_items);
        let mut left_data = newitem.clone();
        left_data.extend_from_slice(&hikey);
        let main = split_main(0, 200, 100, 0);
        let rec = record(
            XLOG_BTREE_SPLIT_L,
            &main,
            vec![block(0, 5, &left_data), block(1, 9, &right_img), block(2, 6, &[])],
        );

        let mut rpage = Box::new([0x55u8; BLCKSZ]);
        apply(&rec, 1, &mut rpage).unwrap();
        let want_right = bt_page(Opaque { prev: 5, next: 6, level: 0, flags: BTP_LEAF, cycleid: 0 }, &right);
        assert_page(&rpage, &want_right);

        apply(&rec, 0, &mut orig).unwrap();
        let mut left = vec![hikey];
        left.extend(all[1..99].iter().cloned());
        left.push(newitem);
        left.extend(all[99..199].iter().cloned());
        let want_left = bt_page(
            Opaque { prev: 4, next: 9, level: 0, flags: BTP_LEAF | BTP_INCOMPLETE_SPLIT, cycleid: 0 },
            &left,
        );
        assert_page(&orig, &want_left);

        let mut sib = bt_page(Opaque { prev: 5, ..leaf(P_NONE) }, &keys(3));
        apply(&rec, 2, &mut sib).unwrap();
        assert_eq!(Opaque::read(&sib).unwrap().prev, 9);
    }

    #[test]
    fn split_with_a_posting_list_split_puts_the_new_posting_list_on_the_left() {
        // hikey, a, P (TIDs 1, 3, 5 of key 2), c, d; the new item (key 2, TID 2) goes right at
        // 4 and swaps with P's last TID.
        let p = posting(2, &[(1, 1), (1, 3), (1, 5)]);
        let items = [leaf_tuple(0, 0, 9), leaf_tuple(1, 9, 1), p, leaf_tuple(1, 7, 3), leaf_tuple(1, 8, 4)];
        let mut orig = bt_page(Opaque { flags: BTP_LEAF | BTP_HAS_GARBAGE, ..leaf(6) }, &items);
        let hikey = leaf_tuple(0, 0, 2);
        let mut left_data = leaf_tuple(1, 2, 2);
        left_data.extend_from_slice(&hikey);
        let main = split_main(0, 4, 4, 1);
        let right_img = upper_image(&[leaf_tuple(0, 0, 9), leaf_tuple(1, 5, 2), leaf_tuple(1, 7, 3)]);
        let rec = record(XLOG_BTREE_SPLIT_R, &main, vec![block(0, 5, &left_data), block(1, 9, &right_img)]);
        apply(&rec, 0, &mut orig).unwrap();
        assert_eq!(items_of(&orig), vec![hikey, leaf_tuple(1, 9, 1), posting(2, &[(1, 1), (1, 2), (1, 3)])]);
        assert_eq!(
            Opaque::read(&orig).unwrap(),
            Opaque { flags: BTP_LEAF | BTP_INCOMPLETE_SPLIT, ..leaf(9) }
        );
        let mut bad = items_of(&orig);
        bad.truncate(1);
        let mut short = bt_page(leaf(6), &bad);
        assert!(apply(&rec, 0, &mut short).is_err(), "no posting list at 3");
    }

    #[test]
    fn split_r_of_an_upper_page_clears_the_childs_split() {
        let main = split_main(1, 2, 3, 0);
        let hikey = leaf_tuple(0, 0, 2);
        let right_img = upper_image(&[leaf_tuple(7, 0, 3)]);
        let rec = record(
            XLOG_BTREE_SPLIT_R,
            &main,
            vec![block(0, 5, &hikey), block(1, 9, &right_img), block(3, 7, &[])],
        );
        let mut child = bt_page(Opaque { flags: BTP_LEAF | BTP_INCOMPLETE_SPLIT, ..leaf(8) }, &keys(1));
        apply(&rec, 3, &mut child).unwrap();
        assert_eq!(Opaque::read(&child).unwrap().flags, BTP_LEAF);
        let mut rpage = Box::new([0u8; BLCKSZ]);
        apply(&rec, 1, &mut rpage).unwrap();
        assert_eq!(
            Opaque::read(&rpage).unwrap(),
            Opaque { prev: 5, next: P_NONE, level: 1, flags: 0, cycleid: 0 }
        );
        let mut orig = bt_page(Opaque { level: 1, flags: 0, ..leaf(P_NONE) }, &keys(2));
        apply(&rec, 0, &mut orig).unwrap();
        assert_eq!(items_of(&orig), vec![hikey, leaf_tuple(1, 1, 1)]);
        assert_eq!(Opaque::read(&orig).unwrap().flags, BTP_INCOMPLETE_SPLIT);
    }

    #[test]
    fn dedup_merges_each_interval_into_a_posting_list() {
        let items = vec![
            leaf_tuple(0, 0, 100),
            leaf_tuple(1, 1, 5),
            leaf_tuple(1, 2, 5),
            posting(5, &[(1, 3), (1, 4)]),
            leaf_tuple(1, 5, 6),
            leaf_tuple(1, 6, 7),
            leaf_tuple(1, 7, 7),
        ];
        let mut page = bt_page(Opaque { flags: BTP_LEAF | BTP_HAS_GARBAGE, ..leaf(3) }, &items);
        let mut data = Vec::new();
        for (baseoff, nitems) in [(2u16, 3u16), (6, 2)] {
            data.extend_from_slice(&baseoff.to_le_bytes());
            data.extend_from_slice(&nitems.to_le_bytes());
        }
        let rec = record(XLOG_BTREE_DEDUP, &[2, 0], vec![block(0, 1, &data)]);
        apply(&rec, 0, &mut page).unwrap();
        let want = bt_page(
            leaf(3),
            &[
                leaf_tuple(0, 0, 100),
                posting(5, &[(1, 1), (1, 2), (1, 3), (1, 4)]),
                leaf_tuple(1, 5, 6),
                posting(7, &[(1, 6), (1, 7)]),
            ],
        );
        assert_page(&page, &want);
    }

    #[test]
    fn vacuum_updates_posting_lists_then_deletes_and_clears_has_garbage() {
        let items = vec![leaf_tuple(1, 1, 1), posting(2, &[(2, 1), (2, 2), (2, 3)]), leaf_tuple(1, 3, 3)];
        let mut page = bt_page(Opaque { flags: BTP_LEAF | BTP_HAS_GARBAGE, ..leaf(P_NONE) }, &items);
        // ndeleted 1 (offset 1), nupdated 1 (offset 2, TIDs 0 and 2 removed)
        let data: Vec<u8> = [1u16, 2, 2, 0, 2].iter().flat_map(|v| v.to_le_bytes()).collect();
        let rec = record(XLOG_BTREE_VACUUM, &[1, 0, 1, 0], vec![block(0, 1, &data)]);
        apply(&rec, 0, &mut page).unwrap();
        assert_eq!(items_of(&page), vec![leaf_tuple(2, 2, 2), leaf_tuple(1, 3, 3)]);
        assert_eq!(Opaque::read(&page).unwrap(), leaf(P_NONE));
        assert_eq!(page::page_lsn(&page), END_LSN);
        let short = record(XLOG_BTREE_VACUUM, &[4, 0, 1, 0], vec![block(0, 1, &data)]);
        assert!(matches!(apply(&short, 0, &mut page), Err(RedoError::Malformed(_))));
    }

    /// `btree_xlog_vacuum` and `btree_xlog_delete` leave `btpo_cycleid` as it is: only
    /// `_bt_delitems_vacuum` on the primary clears it, and `btree_mask` masks the difference.
    #[test]
    fn vacuum_and_delete_keep_the_cycle_id_as_postgresql_redo_does() {
        let items = vec![leaf_tuple(1, 1, 1), posting(2, &[(2, 1), (2, 2), (2, 3)]), leaf_tuple(1, 3, 3)];
        let before = Opaque { cycleid: 9, flags: BTP_LEAF | BTP_HAS_GARBAGE, ..leaf(P_NONE) };
        let after = Opaque { cycleid: 9, ..leaf(P_NONE) };
        let data: Vec<u8> = [1u16, 2, 2, 0, 2].iter().flat_map(|v| v.to_le_bytes()).collect();
        let vacuum = record(XLOG_BTREE_VACUUM, &[1, 0, 1, 0], vec![block(0, 1, &data)]);
        let delete = record(XLOG_BTREE_DELETE, &[0, 0, 0, 0, 1, 0, 1, 0], vec![block(0, 1, &data)]);
        for (rec, name) in [(vacuum, "VACUUM"), (delete, "DELETE")] {
            let mut page = bt_page(before, &items);
            apply(&rec, 0, &mut page).unwrap();
            assert_eq!(Opaque::read(&page).unwrap(), after, "{name} keeps the cycle id");
        }
    }

    #[test]
    fn halfdead_unlink_and_newroot_rebuild_their_pages() {
        // MARK_PAGE_HALFDEAD: parent items 1 (hikey), 2 -> 10, 3 -> 11; poffset 2.
        let mut parent = bt_page(
            Opaque { level: 1, flags: 0, ..leaf(8) },
            &[leaf_tuple(0, 0, 50), leaf_tuple(10, 0, 5), leaf_tuple(11, 0, 6)],
        );
        let main: Vec<u8> = [2u32, 10, 4, 11, 0xFFFF_FFFF]
            .iter()
            .enumerate()
            .flat_map(|(i, v)| if i == 0 { vec![2, 0, 0, 0] } else { v.to_le_bytes().to_vec() })
            .collect();
        let rec = record(XLOG_BTREE_MARK_PAGE_HALFDEAD, &main, vec![block(0, 10, &[]), block(1, 7, &[])]);
        apply(&rec, 1, &mut parent).unwrap();
        assert_eq!(items_of(&parent), vec![leaf_tuple(0, 0, 50), leaf_tuple(11, 0, 5)]);
        let mut leafpage = bt_page(leaf(11), &keys(2));
        apply(&rec, 0, &mut leafpage).unwrap();
        assert_eq!(
            Opaque::read(&leafpage).unwrap(),
            Opaque { prev: 4, next: 11, level: 0, flags: BTP_HALF_DEAD | BTP_LEAF, cycleid: 0 }
        );
        assert_eq!(items_of(&leafpage), vec![vec![0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 8, 0x20]]);

        // UNLINK_PAGE of a leaf: 10 between 4 and 11.
        let mut main = Vec::new();
        for v in [4u32, 11, 0, 0] {
            main.extend_from_slice(&v.to_le_bytes());
        }
        main.extend_from_slice(&0x0001_2345_6789_u64.to_le_bytes());
        for v in [0u32, 0, 0xFFFF_FFFF] {
            main.extend_from_slice(&v.to_le_bytes());
        }
        let rec = record(
            XLOG_BTREE_UNLINK_PAGE,
            &main,
            vec![block(0, 10, &[]), block(1, 4, &[]), block(2, 11, &[])],
        );
        apply(&rec, 0, &mut leafpage).unwrap();
        assert_eq!(
            Opaque::read(&leafpage).unwrap(),
            Opaque {
                prev: 4,
                next: 11,
                level: 0,
                flags: BTP_DELETED | BTP_HAS_FULLXID | BTP_LEAF,
                cycleid: 0
            }
        );
        assert_eq!((page::pd_lower(&leafpage), page::pd_upper(&leafpage)), (32, 8176));
        assert_eq!(le_u64(&leafpage[..], 24), Some(0x0001_2345_6789));
        let mut left = bt_page(leaf(10), &keys(1));
        apply(&rec, 1, &mut left).unwrap();
        assert_eq!(Opaque::read(&left).unwrap().next, 11);
        let mut right = bt_page(Opaque { prev: 10, ..leaf(P_NONE) }, &keys(1));
        apply(&rec, 2, &mut right).unwrap();
        assert_eq!(Opaque::read(&right).unwrap().prev, 4);

        // NEWROOT at level 1 with two downlinks.
        let downlinks = [leaf_tuple(3, 0, 0), leaf_tuple(9, 0, 200)];
        let img = upper_image(&downlinks);
        let rec = record(
            XLOG_BTREE_NEWROOT,
            &[12, 0, 0, 0, 1, 0, 0, 0],
            vec![block(0, 12, &img), block(1, 3, &[]), block(2, 0, &[0; 28])],
        );
        let mut root = Box::new([0u8; BLCKSZ]);
        apply(&rec, 0, &mut root).unwrap();
        assert_page(
            &root,
            &bt_page(Opaque { prev: 0, next: 0, level: 1, flags: BTP_ROOT, cycleid: 0 }, &downlinks),
        );
    }

    #[test]
    fn reuse_page_leaves_the_page_alone_and_unknown_blocks_are_errors() {
        let mut page = bt_page(leaf(P_NONE), &keys(3));
        let before = page.clone();
        let rec = record(XLOG_BTREE_REUSE_PAGE, &[0; 24], vec![block(0, 1, &[])]);
        apply(&rec, 0, &mut page).unwrap();
        assert_eq!(page, before);
        let rec = record(XLOG_BTREE_INSERT_LEAF, &[1, 0], vec![block(0, 1, &[]), block(5, 1, &[])]);
        assert!(matches!(apply(&rec, 5, &mut page), Err(RedoError::Malformed(_))));
        let rec = record(0xF0, &[], vec![block(0, 1, &[])]);
        assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Unsupported(_))));
    }

    proptest! {
        #[test]
        fn random_records_on_random_pages_never_panic(
            op in 0u8..16,
            id in 0u8..5,
            main in proptest::collection::vec(any::<u8>(), 0..48),
            data in proptest::collection::vec(any::<u8>(), 0..96),
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            at in 0usize..BLCKSZ,
            built in any::<bool>(),
        ) {
            let mut page = if built {
                bt_page(leaf(if at % 2 == 0 { P_NONE } else { 7 }), &[leaf_tuple(1, 1, 1), posting(2, &[(1, 2), (1, 3), (1, 4)]), leaf_tuple(1, 5, 2)])
            } else {
                Box::new([0u8; BLCKSZ])
            };
            let end = (at + bytes.len()).min(BLCKSZ);
            page[at..end].copy_from_slice(&bytes[..end - at]);
            let blocks = (0..5).map(|i| block(i, u32::from(i) + 1, if i == id { &data[..] } else { &[] })).collect();
            let rec = record(op << 4, &main, blocks);
            let _ = apply(&rec, id, &mut page);
        }

        #[test]
        fn random_tuples_in_valid_records_never_panic(
            op in prop::sample::select(vec![0u8, 0x10, 0x30, 0x40, 0x50, 0x60, 0x70, 0xA0, 0xB0, 0xC0]),
            offs in proptest::collection::vec(0u16..8, 4),
            data in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut page = bt_page(leaf(7), &[leaf_tuple(0, 0, 9), leaf_tuple(1, 1, 1), posting(2, &[(1, 2), (1, 3), (1, 4)]), leaf_tuple(1, 5, 2)]);
            let main: Vec<u8> = offs.iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut d = Vec::new();
            d.extend_from_slice(&main);
            d.extend_from_slice(&data);
            for id in 0..4 {
                let blocks = (0..4).map(|i| block(i, u32::from(i) + 1, &d)).collect();
                let rec = record(op, &main, blocks);
                let _ = apply(&rec, id, &mut page.clone());
                let _ = apply(&rec, id, &mut page);
            }
        }
    }
}
