//! Redo of GiST records (PostgreSQL 15's `gistxlog.c`), for the record's target block: every
//! record type, each page it touches (the target block id says which part of the routine runs).
//!
//! Page layout (`gist.h`): an index page is a PostgreSQL page whose special space is
//! `GISTPageOpaqueData` (16 bytes: the NSN as two `u32`, high then low, like `pd_lsn`;
//! `rightlink` `u32`; `flags`, `gist_page_id` `u16`). A deleted page keeps its `deleteXid`
//! (`u64`) right after the header, `pd_lower` past it. Records' structs are `gistxlog.h`'s as
//! PostgreSQL 15 (x86-64) lays them out.
//!
//! Blocks per record, as `gist.c`/`gistvacuum.c`/`gistxlog.c` register them:
//! - PAGE_UPDATE: 0 the page (block data: `ntodelete` offsets, then the tuples to add), 1 the
//!   left child whose split the new downlinks complete (its NSN becomes the record's end LSN,
//!   `F_FOLLOW_RIGHT` cleared).
//! - DELETE (dead leaf tuples removed at insertion): 0 the leaf; the offsets in the main data.
//! - PAGE_SPLIT: 0 the left child (as PAGE_UPDATE's block 1), 1..=npage the pages of the split
//!   in order, each rebuilt from its tuples (block data: `int num`, then the tuples); the root
//!   is first when the root splits.
//! - PAGE_DELETE: 0 the emptied leaf (marked deleted), 1 its parent (the downlink removed).
//! - PAGE_REUSE and ASSIGN_LSN: no block (a recovery conflict, and a no-op that only takes an
//!   LSN); given a target anyway, the page is left as it is.
//!
//! PostgreSQL changes a left child after writing the record that completes its split, so a
//! full-page image of it in that record lacks the change, and redo applies it to the restored
//! image too (`BLK_RESTORED`): [`redo_restored_image`] is that part, for the daemon, which
//! stores such an image instead of the record.
//!
//! One deliberate difference from `gistxlog.c`: DELETE does not set `F_TUPLES_DELETED`, which
//! the primary does not set either (see `Rec::delete`).
//!
//! Where PostgreSQL ERRORs or PANICs (a tuple that does not fit, an offset past the line
//! pointers, an unknown op code) or would read past the record on corrupt input, this returns
//! an error. Invariants: pure; never panics on any record or page.

use super::bufpage;
use super::{le_bytes, BlockRedo, RedoError, Target};
use crate::page::{self, Page, BLCKSZ, PAGE_HEADER_SIZE};

/// Record types (`info & 0xF0`).
pub const XLOG_GIST_PAGE_UPDATE: u8 = 0x00;
pub const XLOG_GIST_DELETE: u8 = 0x10;
pub const XLOG_GIST_PAGE_REUSE: u8 = 0x20;
pub const XLOG_GIST_PAGE_SPLIT: u8 = 0x30;
pub const XLOG_GIST_PAGE_DELETE: u8 = 0x60;
pub const XLOG_GIST_ASSIGN_LSN: u8 = 0x70;

/// `flags` bits.
pub const F_LEAF: u16 = 1 << 0;
pub const F_DELETED: u16 = 1 << 1;
pub const F_TUPLES_DELETED: u16 = 1 << 2;
pub const F_FOLLOW_RIGHT: u16 = 1 << 3;
pub const F_HAS_GARBAGE: u16 = 1 << 4;
/// `gist_page_id` of every GiST page.
pub const GIST_PAGE_ID: u16 = 0xFF81;
/// `sizeof(GISTPageOpaqueData)`.
pub const GIST_SPECIAL_SIZE: usize = 16;
/// `GIST_ROOT_BLKNO`.
pub const GIST_ROOT_BLKNO: u32 = 0;
/// `InvalidBlockNumber`: no right sibling.
pub const INVALID_BLOCK: u32 = u32::MAX;
/// `sizeof(gistxlogPageSplit)`, `SizeOfGistxlogDelete`, `SizeOfGistxlogPageDelete`.
const SPLIT_SIZE: usize = 24;
const DELETE_SIZE: usize = 6;
const PAGE_DELETE_SIZE: usize = 10;
/// `IndexTupleData`: `t_tid` (6 bytes), `t_info` (size in its low 13 bits).
const INDEX_TUPLE_HEADER: usize = 8;
const INDEX_SIZE_MASK: u16 = 0x1FFF;

/// Applies a GiST record to the page of its target block.
pub fn redo(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let rec = Rec::new(target);
    match target.record.info & 0xF0 {
        XLOG_GIST_PAGE_UPDATE => rec.page_update(page),
        XLOG_GIST_DELETE if rec.id == 0 => rec.delete(page),
        XLOG_GIST_PAGE_SPLIT => rec.split(page),
        XLOG_GIST_PAGE_DELETE => rec.page_delete(page),
        // No block in PostgreSQL 15: a recovery conflict, and a no-op that takes an LSN.
        XLOG_GIST_PAGE_REUSE | XLOG_GIST_ASSIGN_LSN => Ok(()),
        XLOG_GIST_DELETE => Err(rec.not_touched()),
        op => Err(rec.malformed(&format!("unknown op code {op:#04x}"))),
    }
}

/// What the GiST record `info` does to its block `block_id` when it restores that block's
/// full-page image (`BLK_RESTORED`): the left child of PAGE_UPDATE (block 1) and PAGE_SPLIT
/// (block 0) gets the record's end LSN as its NSN and `F_FOLLOW_RIGHT` cleared, which the image
/// (taken before the primary made that change) lacks. Returns whether it changed `page`; a page
/// without room for the GiST special space is left as it is.
pub fn redo_restored_image(info: u8, block_id: u8, end_lsn: u64, page: &mut Page) -> bool {
    let left_child = match info & 0xF0 {
        XLOG_GIST_PAGE_UPDATE => block_id == 1,
        XLOG_GIST_PAGE_SPLIT => block_id == 0,
        _ => false,
    };
    left_child && clear_follow_right(page, end_lsn).is_some()
}

/// `gistRedoClearFollowRight` on the page.
fn clear_follow_right(page: &mut Page, end_lsn: u64) -> Option<()> {
    let mut op = Opaque::read(page)?;
    op.nsn = end_lsn;
    op.flags &= !F_FOLLOW_RIGHT;
    op.write(page)?;
    page::set_page_lsn(page, end_lsn);
    Some(())
}

/// This module's redo of one block: [`BlockRedo`] with the helpers of Gist records.
type Rec<'t, 'r, 'a> = BlockRedo<'t, 'r, 'a, Gist>;

/// Marks [`Rec`]: the helpers below are Gist's alone.
pub enum Gist {}

impl Rec<'_, '_, '_> {
    fn opaque(&self, page: &Page) -> Result<Opaque, RedoError> {
        Opaque::read(page).ok_or_else(|| self.no_fit("no room for the GiST special space"))
    }

    fn put_opaque(&self, page: &mut Page, op: &Opaque) -> Result<(), RedoError> {
        op.write(page).ok_or_else(|| self.no_fit("no room for the GiST special space"))
    }

    fn clear_follow_right(&self, page: &mut Page) -> Result<(), RedoError> {
        clear_follow_right(page, self.target.record.end_lsn)
            .ok_or_else(|| self.no_fit("no room for the GiST special space"))
    }

    /// The tuples of `data`, each `IndexTupleSize` bytes, to its end.
    fn tuples<'d>(&self, mut data: &'d [u8]) -> Result<Vec<&'d [u8]>, RedoError> {
        let mut out = Vec::new();
        while !data.is_empty() {
            let size = tuple_size(data).ok_or_else(|| self.malformed("tuple cut short"))?;
            if size == 0 || size > data.len() {
                return Err(self.malformed(&format!("tuple of {size} bytes in {} left", data.len())));
            }
            let (tup, rest) = data.split_at(size);
            out.push(tup);
            data = rest;
        }
        Ok(out)
    }

    /// `gistfillbuffer`-like: `tuples` added from offset `off` on, each at the next offset.
    fn add_tuples(&self, page: &mut Page, tuples: &[&[u8]], mut off: u16) -> Result<(), RedoError> {
        for tup in tuples {
            bufpage::page_add_item(page, tup, off, false, false)
                .map_err(|e| self.no_fit(format!("failed to add item to GiST index page: {e}")))?;
            off = off.checked_add(1).ok_or_else(|| self.no_fit("too many items"))?;
        }
        Ok(())
    }

    /// `gistRedoPageUpdateRecord`.
    fn page_update(&self, page: &mut Page) -> Result<(), RedoError> {
        match self.id {
            1 => self.clear_follow_right(page),
            0 => {
                // gistxlogPageUpdate { ntodelete u16, ntoinsert u16 }
                let ntodelete = u16::from_le_bytes(self.main_at(0)?);
                let ntoinsert = u16::from_le_bytes(self.main_at(2)?);
                let mut data = self.target.data();
                let cut = || self.malformed("block data too short");
                if ntodelete == 1 && ntoinsert == 1 {
                    // One tuple replaced in place, as gistplacetopage does.
                    let offnum = u16::from_le_bytes(le_bytes(data, 0).ok_or_else(cut)?);
                    let rest = &data[2..];
                    let size = tuple_size(rest).ok_or_else(cut)?;
                    let itup = rest.get(..size).filter(|t| !t.is_empty()).ok_or_else(cut)?;
                    bufpage::page_index_tuple_overwrite(page, offnum, itup)
                        .map_err(|e| self.no_fit(format!("failed to add item to GiST index page: {e}")))?;
                    data = &rest[size..];
                } else if ntodelete > 0 {
                    let n = usize::from(ntodelete) * 2;
                    let todelete: Vec<u16> = data
                        .get(..n)
                        .ok_or_else(cut)?
                        .chunks_exact(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]))
                        .collect();
                    data = &data[n..];
                    bufpage::page_index_multi_delete(page, &todelete).map_err(|e| self.wrap(e))?;
                    let mut op = self.opaque(page)?;
                    if op.flags & F_LEAF != 0 {
                        op.flags |= F_TUPLES_DELETED;
                        self.put_opaque(page, &op)?;
                    }
                }
                if !data.is_empty() {
                    let tuples = self.tuples(data)?;
                    let off = if bufpage::page_get_max_offset(page) == 0 {
                        1
                    } else {
                        bufpage::page_get_max_offset(page) + 1
                    };
                    self.add_tuples(page, &tuples, off)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `gistRedoDeleteRecord`: gistxlogDelete { latestRemovedXid u32, ntodelete u16 }, then
    /// the offsets, in the main data. `F_HAS_GARBAGE` cleared, as on the primary
    /// (`gistprunepage`); **unlike PostgreSQL's redo, `F_TUPLES_DELETED` is left as it is**,
    /// as the primary leaves it: PostgreSQL 15's redo sets it, so a standby's page differs from
    /// the primary's in a flag `gist_mask` does not mask (PostgreSQL 15.18's own recovery with
    /// `wal_consistency_checking = 'gist'` stops there with "inconsistent page found"). No
    /// PostgreSQL 15 code reads the flag; the page served equals the primary's.
    fn delete(&self, page: &mut Page) -> Result<(), RedoError> {
        let main = self.main();
        if main.len() > DELETE_SIZE {
            let ntodelete = usize::from(u16::from_le_bytes(self.main_at(4)?));
            let todelete: Vec<u16> = main
                .get(DELETE_SIZE..DELETE_SIZE + 2 * ntodelete)
                .ok_or_else(|| self.malformed("fewer offsets than counted"))?
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect();
            bufpage::page_index_multi_delete(page, &todelete).map_err(|e| self.wrap(e))?;
        }
        let mut op = self.opaque(page)?;
        op.flags &= !F_HAS_GARBAGE;
        self.put_opaque(page, &op)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `gistRedoPageSplitRecord`: gistxlogPageSplit { origrlink u32, (pad), orignsn u64 at 8,
    /// origleaf bool at 16, npage u16 at 18, markfollowright bool at 20 }.
    fn split(&self, page: &mut Page) -> Result<(), RedoError> {
        if self.main().len() < SPLIT_SIZE {
            return Err(self.malformed("main data too short"));
        }
        let origrlink = u32::from_le_bytes(self.main_at(0)?);
        let orignsn = u64::from_le_bytes(self.main_at(8)?);
        let origleaf = self.main()[16] != 0;
        let npage = u16::from_le_bytes(self.main_at(18)?);
        let markfollowright = self.main()[20] != 0;
        if self.id == 0 {
            return self.clear_follow_right(page);
        }
        if u16::from(self.id) > npage {
            return Err(self.not_touched());
        }
        let i = u16::from(self.id) - 1;
        let blkno_of = |id: u16| {
            u8::try_from(id)
                .ok()
                .and_then(|id| self.target.record.blocks.iter().find(|b| b.id == id))
                .map(|b| b.blkno)
                .ok_or_else(|| self.malformed(&format!("no block {id} of the {npage} split pages")))
        };
        let blkno = self.target.block.blkno;
        // PostgreSQL decides this page by page, in order: the root comes first.
        let mut isrootsplit = false;
        for id in 1..=self.id {
            isrootsplit |= blkno_of(u16::from(id))? == GIST_ROOT_BLKNO;
        }
        let data = self.target.data();
        let num = i32::from_le_bytes(le_bytes(data, 0).ok_or_else(|| self.malformed("no tuple count"))?);
        let tuples = self.tuples(&data[4..])?;
        if usize::try_from(num).ok() != Some(tuples.len()) {
            return Err(self.malformed(&format!("{num} tuples counted, {} logged", tuples.len())));
        }
        bufpage::page_init(page, GIST_SPECIAL_SIZE);
        let flags = if origleaf && blkno != GIST_ROOT_BLKNO { F_LEAF } else { 0 };
        let mut op = Opaque { nsn: 0, rightlink: INVALID_BLOCK, flags, page_id: GIST_PAGE_ID };
        self.put_opaque(page, &op)?;
        self.add_tuples(page, &tuples, 1)?;
        op.nsn = orignsn;
        op.flags &= !F_FOLLOW_RIGHT;
        if blkno != GIST_ROOT_BLKNO {
            let last = i + 1 == npage;
            op.rightlink = if last { origrlink } else { blkno_of(i + 2)? };
            if !last && !isrootsplit && markfollowright {
                op.flags |= F_FOLLOW_RIGHT;
            }
        }
        self.put_opaque(page, &op)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `gistRedoPageDelete`: gistxlogPageDelete { deleteXid u64, downlinkOffset u16 at 8 }.
    fn page_delete(&self, page: &mut Page) -> Result<(), RedoError> {
        if self.main().len() < PAGE_DELETE_SIZE {
            return Err(self.malformed("main data too short"));
        }
        match self.id {
            0 => {
                // GistPageSetDeleted.
                let delete_xid: [u8; 8] = self.main_at(0)?;
                let mut op = self.opaque(page)?;
                op.flags |= F_DELETED;
                self.put_opaque(page, &op)?;
                page::set_pd_lower(page, (PAGE_HEADER_SIZE + 8) as u16);
                page[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + 8].copy_from_slice(&delete_xid);
                self.set_lsn(page);
                Ok(())
            }
            1 => {
                let downlink = u16::from_le_bytes(self.main_at(8)?);
                bufpage::page_index_tuple_delete(page, downlink).map_err(|e| self.wrap(e))?;
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }
}

/// `GISTPageOpaqueData`, at `pd_special`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opaque {
    pub nsn: u64,
    pub rightlink: u32,
    pub flags: u16,
    pub page_id: u16,
}

impl Opaque {
    /// Where the special space starts, if `pd_special` leaves room for it after the header.
    fn at(page: &Page) -> Option<usize> {
        let at = usize::from(page::pd_special(page));
        (at >= PAGE_HEADER_SIZE && at + GIST_SPECIAL_SIZE <= BLCKSZ).then_some(at)
    }

    /// The special space of `page`; `None` if `pd_special` leaves no room for it.
    pub fn read(page: &Page) -> Option<Opaque> {
        let at = Self::at(page)?;
        let word = |i: usize| u32::from_le_bytes([page[i], page[i + 1], page[i + 2], page[i + 3]]);
        let half = |i: usize| u16::from_le_bytes([page[i], page[i + 1]]);
        Some(Opaque {
            nsn: (u64::from(word(at)) << 32) | u64::from(word(at + 4)),
            rightlink: word(at + 8),
            flags: half(at + 12),
            page_id: half(at + 14),
        })
    }

    pub fn write(&self, page: &mut Page) -> Option<()> {
        let at = Self::at(page)?;
        page[at..at + 4].copy_from_slice(&((self.nsn >> 32) as u32).to_le_bytes());
        page[at + 4..at + 8].copy_from_slice(&(self.nsn as u32).to_le_bytes());
        page[at + 8..at + 12].copy_from_slice(&self.rightlink.to_le_bytes());
        page[at + 12..at + 14].copy_from_slice(&self.flags.to_le_bytes());
        page[at + 14..at + 16].copy_from_slice(&self.page_id.to_le_bytes());
        Some(())
    }
}

/// `IndexTupleSize` of the tuple at the start of `data`; `None` if its header is cut short.
fn tuple_size(data: &[u8]) -> Option<usize> {
    let info: [u8; 2] = le_bytes(data.get(..INDEX_TUPLE_HEADER)?, 6)?;
    Some(usize::from(u16::from_le_bytes(info) & INDEX_SIZE_MASK))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::pg15::{BlockHeader, Pg15Record, FLAG_HAS_DATA};
    use proptest::prelude::*;

    const END_LSN: u64 = 0x1_0000_0100;

    fn block(id: u8, blkno: u32, data: &[u8]) -> BlockHeader<'_> {
        let flags = if data.is_empty() { 0 } else { FLAG_HAS_DATA };
        BlockHeader { id, flags, fork: 0, spcnode: 1663, dbnode: 5, relnode: 16384, blkno, data }
    }

    fn record<'a>(info: u8, main: &'a [u8], blocks: Vec<BlockHeader<'a>>) -> Pg15Record<'a> {
        Pg15Record {
            rmid: 14,
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

    /// An index tuple of `size` bytes (a multiple of 8, at least 8) pointing at (blk, off),
    /// its payload filled with `fill`.
    fn tup(blk: u32, off: u16, size: usize, fill: u8) -> Vec<u8> {
        let mut t = vec![fill; size];
        t[0..2].copy_from_slice(&((blk >> 16) as u16).to_le_bytes());
        t[2..4].copy_from_slice(&(blk as u16).to_le_bytes());
        t[4..6].copy_from_slice(&off.to_le_bytes());
        t[6..8].copy_from_slice(&(size as u16).to_le_bytes());
        t
    }

    /// A GiST page (`gistinitpage`) with `op` and `items` added in order.
    fn gist_page(op: Opaque, items: &[Vec<u8>]) -> Box<Page> {
        let mut page = Box::new([0u8; BLCKSZ]);
        bufpage::page_init(&mut page, GIST_SPECIAL_SIZE);
        op.write(&mut page).unwrap();
        for (i, item) in items.iter().enumerate() {
            bufpage::page_add_item(&mut page, item, (i + 1) as u16, false, false).unwrap();
        }
        page
    }

    fn opaque(flags: u16) -> Opaque {
        Opaque { nsn: 0x7_0000_0010, rightlink: INVALID_BLOCK, flags, page_id: GIST_PAGE_ID }
    }

    fn items(n: u16, fill: u8) -> Vec<Vec<u8>> {
        (1..=n).map(|i| tup(1, i, 16 + 8 * usize::from(i % 3), fill.wrapping_add(i as u8))).collect()
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

    fn update_main(ntodelete: u16, ntoinsert: u16) -> Vec<u8> {
        [ntodelete.to_le_bytes(), ntoinsert.to_le_bytes()].concat()
    }

    #[test]
    fn page_update_appends_tuples_and_clears_the_left_childs_follow_right() {
        let mut page = gist_page(opaque(F_LEAF), &items(3, 0));
        let new = [tup(2, 1, 24, 0xA1), tup(2, 2, 16, 0xA2)];
        let main = update_main(0, 2);
        let data = new.concat();
        let rec = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &data)]);
        apply(&rec, 0, &mut page).unwrap();
        let mut all = items(3, 0);
        all.extend(new.iter().cloned());
        assert_page(&page, &gist_page(opaque(F_LEAF), &all));

        let mut empty = gist_page(opaque(F_LEAF), &[]);
        apply(&rec, 0, &mut empty).unwrap();
        assert_eq!(items_of(&empty), new.to_vec(), "an empty page gets them from offset 1");

        let downlink = tup(9, 0xFFFF, 16, 3);
        let main = update_main(0, 1);
        let rec = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &downlink), block(1, 8, &[])]);
        let mut child = gist_page(Opaque { rightlink: 9, ..opaque(F_LEAF | F_FOLLOW_RIGHT) }, &items(2, 0));
        apply(&rec, 1, &mut child).unwrap();
        let want = Opaque { nsn: END_LSN, rightlink: 9, ..opaque(F_LEAF) };
        assert_page(&child, &gist_page(want, &items(2, 0)));
    }

    #[test]
    fn page_update_of_one_tuple_for_one_overwrites_it_in_place() {
        let old = items(4, 0x10);
        let mut page = gist_page(opaque(0), &old);
        let newer = tup(7, 0xFFFF, 40, 0xEE);
        let data = [&2u16.to_le_bytes()[..], &newer].concat();
        let main = update_main(1, 1);
        let rec = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &data)]);
        apply(&rec, 0, &mut page).unwrap();
        let mut want = gist_page(opaque(0), &old);
        bufpage::page_index_tuple_overwrite(&mut want, 2, &newer).unwrap();
        assert_page(&page, &want);
        assert_eq!(items_of(&page)[1], newer);
        let bad = [&9u16.to_le_bytes()[..], &newer].concat();
        let main = update_main(1, 1);
        let rec = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &bad)]);
        assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::DoesNotFit(_))));
    }

    #[test]
    fn page_update_deletes_then_appends_and_marks_a_leaf_only() {
        // A downlink replaced by two (an inner page): delete 2, add two at the end.
        let old = items(3, 0x20);
        let new = [tup(11, 0xFFFF, 16, 1), tup(12, 0xFFFF, 24, 2)];
        let data = [&2u16.to_le_bytes()[..], &new.concat()].concat();
        let main = update_main(1, 2);
        let rec = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &data)]);
        let mut page = gist_page(opaque(0), &old);
        apply(&rec, 0, &mut page).unwrap();
        assert_eq!(items_of(&page), vec![old[0].clone(), old[2].clone(), new[0].clone(), new[1].clone()]);
        assert_eq!(Opaque::read(&page).unwrap().flags, 0);

        // VACUUM of a leaf: three offsets deleted, F_TUPLES_DELETED.
        let old = items(6, 0x30);
        let data: Vec<u8> = [1u16, 3, 6].iter().flat_map(|v| v.to_le_bytes()).collect();
        let main = update_main(3, 0);
        let rec = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &data)]);
        let mut page = gist_page(opaque(F_LEAF), &old);
        apply(&rec, 0, &mut page).unwrap();
        let mut want = gist_page(opaque(F_LEAF | F_TUPLES_DELETED), &old);
        bufpage::page_index_multi_delete(&mut want, &[1, 3, 6]).unwrap();
        assert_page(&page, &want);
        assert_eq!(items_of(&page), vec![old[1].clone(), old[3].clone(), old[4].clone()]);

        let main = update_main(4, 0);
        let short = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &data)]);
        assert!(matches!(apply(&short, 0, &mut page), Err(RedoError::Malformed(_))));
        let main = update_main(0, 1);
        let cut = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &new[1][..20])]);
        assert!(matches!(apply(&cut, 0, &mut page), Err(RedoError::Malformed(_))));
        let main = update_main(0, 1);
        let zero = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &[0u8; 8])]);
        assert!(matches!(apply(&zero, 0, &mut page), Err(RedoError::Malformed(_))), "a 0-byte tuple");
        let full = vec![tup(1, 1, 4096, 0); 2].concat();
        let main = update_main(0, 2);
        let rec = record(XLOG_GIST_PAGE_UPDATE, &main, vec![block(0, 4, &full)]);
        assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::DoesNotFit(_))));
    }

    #[test]
    fn delete_removes_the_main_datas_offsets_and_clears_has_garbage_as_the_primary_does() {
        let old = items(5, 0x40);
        let mut page = gist_page(opaque(F_LEAF | F_HAS_GARBAGE), &old);
        let mut main = 77u32.to_le_bytes().to_vec();
        for v in [2u16, 2, 5] {
            main.extend_from_slice(&v.to_le_bytes());
        }
        let rec = record(XLOG_GIST_DELETE, &main, vec![block(0, 4, &[])]);
        apply(&rec, 0, &mut page).unwrap();
        // Not F_TUPLES_DELETED, which PostgreSQL's redo sets and the primary does not.
        let mut want = gist_page(opaque(F_LEAF), &old);
        bufpage::page_index_multi_delete(&mut want, &[2, 5]).unwrap();
        assert_page(&page, &want);
        let short = record(XLOG_GIST_DELETE, &main[..8], vec![block(0, 4, &[])]);
        assert!(matches!(apply(&short, 0, &mut page), Err(RedoError::Malformed(_))));
        let only_flags = record(XLOG_GIST_DELETE, &main[..6], vec![block(0, 4, &[])]);
        let mut page = gist_page(opaque(F_LEAF | F_HAS_GARBAGE), &old);
        apply(&only_flags, 0, &mut page).unwrap();
        assert_page(&page, &gist_page(opaque(F_LEAF), &old));
        let mut marked = gist_page(opaque(F_LEAF | F_TUPLES_DELETED | F_HAS_GARBAGE), &old);
        apply(&only_flags, 0, &mut marked).unwrap();
        assert_eq!(Opaque::read(&marked).unwrap().flags, F_LEAF | F_TUPLES_DELETED, "kept");
    }

    fn split_main(
        origrlink: u32,
        orignsn: u64,
        origleaf: bool,
        npage: u16,
        markfollowright: bool,
    ) -> Vec<u8> {
        let mut m = vec![0u8; SPLIT_SIZE];
        m[0..4].copy_from_slice(&origrlink.to_le_bytes());
        m[8..16].copy_from_slice(&orignsn.to_le_bytes());
        m[16] = u8::from(origleaf);
        m[18..20].copy_from_slice(&npage.to_le_bytes());
        m[20] = u8::from(markfollowright);
        m
    }

    fn split_data(tuples: &[Vec<u8>]) -> Vec<u8> {
        [&(tuples.len() as i32).to_le_bytes()[..], &tuples.concat()].concat()
    }

    #[test]
    fn split_of_a_leaf_rebuilds_each_page_and_links_them_with_follow_right() {
        let (left, right) = (items(5, 0x50), items(4, 0x60));
        let (dl, dr) = (split_data(&left), split_data(&right));
        let main = split_main(21, 0x3_0000_0040, true, 2, true);
        let rec =
            record(XLOG_GIST_PAGE_SPLIT, &main, vec![block(0, 2, &[]), block(1, 7, &dl), block(2, 12, &dr)]);
        let mut lpage = Box::new([0x55u8; BLCKSZ]);
        apply(&rec, 1, &mut lpage).unwrap();
        let lop = Opaque {
            nsn: 0x3_0000_0040,
            rightlink: 12,
            flags: F_LEAF | F_FOLLOW_RIGHT,
            page_id: GIST_PAGE_ID,
        };
        assert_page(&lpage, &gist_page(lop, &left));
        let mut rpage = Box::new([0u8; BLCKSZ]);
        apply(&rec, 2, &mut rpage).unwrap();
        let rop = Opaque { rightlink: 21, flags: F_LEAF, ..lop };
        assert_page(&rpage, &gist_page(rop, &right));
        // The left child of the split page's parent level.
        let mut child = gist_page(Opaque { rightlink: 3, ..opaque(F_FOLLOW_RIGHT) }, &items(2, 1));
        apply(&rec, 0, &mut child).unwrap();
        assert_eq!(Opaque::read(&child).unwrap(), Opaque { nsn: END_LSN, rightlink: 3, ..opaque(0) });
        // Without markfollowright (an index build's split), no flag.
        let main = split_main(21, 0x3_0000_0040, true, 2, false);
        let rec = record(XLOG_GIST_PAGE_SPLIT, &main, vec![block(1, 7, &dl), block(2, 12, &dr)]);
        apply(&rec, 1, &mut lpage).unwrap();
        assert_eq!(Opaque::read(&lpage).unwrap().flags, F_LEAF);
    }

    #[test]
    fn split_of_the_root_keeps_it_an_inner_page_and_never_marks_follow_right() {
        let (root, a, b) =
            (vec![tup(5, 0xFFFF, 16, 1), tup(6, 0xFFFF, 16, 2)], items(3, 0x70), items(3, 0x80));
        let (d0, d1, d2) = (split_data(&root), split_data(&a), split_data(&b));
        let main = split_main(INVALID_BLOCK, 0, true, 3, true);
        let rec =
            record(XLOG_GIST_PAGE_SPLIT, &main, vec![block(1, 0, &d0), block(2, 5, &d1), block(3, 6, &d2)]);
        let base = Opaque { nsn: 0, rightlink: INVALID_BLOCK, flags: 0, page_id: GIST_PAGE_ID };
        let mut page = gist_page(opaque(F_LEAF), &items(9, 0));
        apply(&rec, 1, &mut page).unwrap();
        assert_page(&page, &gist_page(base, &root));
        apply(&rec, 2, &mut page).unwrap();
        assert_page(&page, &gist_page(Opaque { rightlink: 6, flags: F_LEAF, ..base }, &a));
        apply(&rec, 3, &mut page).unwrap();
        assert_page(&page, &gist_page(Opaque { flags: F_LEAF, ..base }, &b));
    }

    #[test]
    fn split_refuses_broken_counts_missing_blocks_and_pages_it_does_not_have() {
        let a = items(3, 0x70);
        let main = split_main(INVALID_BLOCK, 0, true, 2, true);
        let mut page = Box::new([0u8; BLCKSZ]);
        let mut wrong = split_data(&a);
        wrong[0] = 4;
        for (blocks, id) in [
            (vec![block(1, 5, &wrong[..]), block(2, 6, &wrong[..])], 1),
            (vec![block(1, 5, &wrong[..2])], 1),
            (vec![block(1, 5, &wrong[..])], 1),
            (vec![block(1, 5, &[]), block(2, 6, &[]), block(3, 9, &[])], 3),
        ] {
            let rec = record(XLOG_GIST_PAGE_SPLIT, &main, blocks);
            assert!(matches!(apply(&rec, id, &mut page), Err(RedoError::Malformed(_))));
        }
        let d = split_data(&a);
        let rec = record(XLOG_GIST_PAGE_SPLIT, &main, vec![block(1, 5, &d)]);
        assert!(matches!(apply(&rec, 1, &mut page), Err(RedoError::Malformed(_))), "no block 2 to link to");
        let rec = record(XLOG_GIST_PAGE_SPLIT, &main[..20], vec![block(1, 5, &d)]);
        assert!(matches!(apply(&rec, 1, &mut page), Err(RedoError::Malformed(_))));
    }

    #[test]
    fn page_delete_marks_the_leaf_deleted_and_removes_the_downlink() {
        let mut main = 0x0001_2345_6789_u64.to_le_bytes().to_vec();
        main.extend_from_slice(&2u16.to_le_bytes());
        let rec = record(XLOG_GIST_PAGE_DELETE, &main, vec![block(0, 10, &[]), block(1, 3, &[])]);
        let mut leaf = gist_page(Opaque { rightlink: 11, ..opaque(F_LEAF | F_TUPLES_DELETED) }, &[]);
        apply(&rec, 0, &mut leaf).unwrap();
        assert_eq!(Opaque::read(&leaf).unwrap().flags, F_LEAF | F_TUPLES_DELETED | F_DELETED);
        assert_eq!((page::pd_lower(&leaf), page::pd_upper(&leaf)), (32, 8176));
        assert_eq!(leaf[24..32], 0x0001_2345_6789_u64.to_le_bytes());
        let downlinks = items(3, 0x90);
        let mut parent = gist_page(opaque(0), &downlinks);
        apply(&rec, 1, &mut parent).unwrap();
        let mut want = gist_page(opaque(0), &downlinks);
        bufpage::page_index_tuple_delete(&mut want, 2).unwrap();
        assert_page(&parent, &want);
        let mut one = gist_page(opaque(0), &downlinks[..1]);
        assert!(matches!(apply(&rec, 1, &mut one), Err(RedoError::DoesNotFit(_))));
        let short = record(XLOG_GIST_PAGE_DELETE, &main[..9], vec![block(0, 10, &[])]);
        assert!(matches!(apply(&short, 0, &mut leaf), Err(RedoError::Malformed(_))));
    }

    #[test]
    fn reuse_and_assign_lsn_leave_the_page_alone_and_unknown_ops_or_blocks_are_errors() {
        let mut page = gist_page(opaque(F_LEAF), &items(3, 0));
        let before = page.clone();
        for op in [XLOG_GIST_PAGE_REUSE, XLOG_GIST_ASSIGN_LSN] {
            apply(&record(op, &[0; 24], vec![block(0, 1, &[])]), 0, &mut page).unwrap();
            assert_eq!(page, before);
        }
        for (op, id) in [
            (0x40, 0),
            (0x50, 0),
            (XLOG_GIST_DELETE, 1),
            (XLOG_GIST_PAGE_UPDATE, 2),
            (XLOG_GIST_PAGE_DELETE, 2),
        ] {
            let rec = record(op, &[0; 24], vec![block(0, 1, &[]), block(id, 2, &[])]);
            assert!(matches!(apply(&rec, id, &mut page), Err(RedoError::Malformed(_))), "{op:#x} {id}");
        }
        let mut zeros = Box::new([0u8; BLCKSZ]);
        let rec = record(XLOG_GIST_DELETE, &[0; 6], vec![block(0, 1, &[])]);
        assert!(matches!(apply(&rec, 0, &mut zeros), Err(RedoError::DoesNotFit(_))), "no special space");
    }

    #[test]
    fn a_restored_left_child_image_gets_the_nsn_and_loses_follow_right() {
        let page = gist_page(opaque(F_LEAF | F_FOLLOW_RIGHT), &items(2, 0));
        let mut want = gist_page(Opaque { nsn: END_LSN, ..opaque(F_LEAF) }, &items(2, 0));
        page::set_page_lsn(&mut want, END_LSN);
        for (info, id, changes) in [
            (XLOG_GIST_PAGE_UPDATE, 1, true),
            (XLOG_GIST_PAGE_SPLIT, 0, true),
            (XLOG_GIST_PAGE_UPDATE, 0, false),
            (XLOG_GIST_PAGE_SPLIT, 1, false),
            (XLOG_GIST_PAGE_DELETE, 0, false),
        ] {
            let mut p = page.clone();
            assert_eq!(redo_restored_image(info, id, END_LSN, &mut p), changes);
            assert_eq!(p == want, changes, "{info:#x} block {id}");
        }
        let mut zeros = [0u8; BLCKSZ];
        assert!(!redo_restored_image(XLOG_GIST_PAGE_SPLIT, 0, END_LSN, &mut zeros));
        assert_eq!(zeros, [0u8; BLCKSZ]);
    }

    /// A leaf and an inner page with a few tuples of random sizes.
    fn valid_page(leaf: bool, sizes: &[u8]) -> Box<Page> {
        let items: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, s)| tup(3, i as u16 + 1, 8 + 8 * usize::from(s % 12), *s))
            .collect();
        gist_page(opaque(if leaf { F_LEAF } else { 0 }), &items)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn random_records_on_random_pages_never_panic(
            op in 0u8..16,
            id in 0u8..5,
            main in proptest::collection::vec(any::<u8>(), 0..40),
            data in proptest::collection::vec(any::<u8>(), 0..96),
            bytes in proptest::collection::vec(any::<u8>(), 0..64),
            at in 0usize..BLCKSZ,
            kind in 0u8..3,
            sizes in proptest::collection::vec(any::<u8>(), 0..20),
        ) {
            let mut page = match kind {
                0 => Box::new([0u8; BLCKSZ]),
                k => valid_page(k == 1, &sizes),
            };
            let end = (at + bytes.len()).min(BLCKSZ);
            page[at..end].copy_from_slice(&bytes[..end - at]);
            let blocks = (0..5).map(|i| block(i, u32::from(i), if i == id { &data[..] } else { &[] })).collect();
            let rec = record(op << 4, &main, blocks);
            let _ = apply(&rec, id, &mut page);
            let _ = redo_restored_image(op << 4, id, END_LSN, &mut page);
        }

        /// Well-formed headers (counts, offsets, tuple sizes near the page's) with random
        /// contents, on valid GiST pages: errors, never a panic.
        #[test]
        fn random_tuples_in_valid_records_on_valid_pages_never_panic(
            op in prop::sample::select(vec![XLOG_GIST_PAGE_UPDATE, XLOG_GIST_DELETE, XLOG_GIST_PAGE_SPLIT, XLOG_GIST_PAGE_DELETE]),
            counts in proptest::collection::vec(0u16..8, 2),
            offs in proptest::collection::vec(0u16..24, 0..8),
            tuple_sizes in proptest::collection::vec(0u16..600, 0..6),
            flags in any::<[u8; 3]>(),
            npage in 0u16..5,
            leaf in any::<bool>(),
            sizes in proptest::collection::vec(any::<u8>(), 0..20),
        ) {
            let page = valid_page(leaf, &sizes);
            let offsets: Vec<u8> = offs.iter().flat_map(|v| v.to_le_bytes()).collect();
            let tuples: Vec<u8> = tuple_sizes.iter().flat_map(|s| {
                let mut t = vec![0x5Au8; usize::from(*s).max(8)];
                t[6..8].copy_from_slice(&s.to_le_bytes());
                t
            }).collect();
            let main = match op {
                XLOG_GIST_PAGE_UPDATE => update_main(counts[0], counts[1]),
                XLOG_GIST_DELETE => [&[0u8; 4][..], &counts[0].to_le_bytes(), &offsets].concat(),
                XLOG_GIST_PAGE_SPLIT => {
                    let mut m = split_main(u32::from(flags[0]), 5, flags[1] % 2 == 0, npage, flags[2] % 2 == 0);
                    m[16] = flags[1];
                    m
                }
                _ => [&7u64.to_le_bytes()[..], &offs.first().copied().unwrap_or(1).to_le_bytes()].concat(),
            };
            let data = match op {
                XLOG_GIST_PAGE_SPLIT => [&(tuple_sizes.len() as i32).to_le_bytes()[..], &tuples].concat(),
                _ => [&offsets[..], &tuples].concat(),
            };
            for id in 0..5u8 {
                let blocks = (0..5).map(|i| block(i, u32::from(flags[0] % 3) * u32::from(i), &data)).collect();
                let rec = record(op, &main, blocks);
                let _ = apply(&rec, id, &mut page.clone());
            }
        }
    }
}
