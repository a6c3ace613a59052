//! Redo of BRIN records (PostgreSQL 15's `brin_xlog.c`), for the record's target block: every
//! record type, each page it touches (the target block id says which part of the routine runs).
//!
//! Page layout (`brin_page.h`): every BRIN page is a PostgreSQL page with an 8-byte special
//! space (`BrinSpecialSpace`) whose last `u16` is the page type (meta `0xF091`, revmap
//! `0xF092`, regular `0xF093`) and the one before it the flags (`BRIN_EVACUATE_PAGE`, never
//! WAL-logged). The metapage (block 0) holds `BrinMetaPageData` (magic, version,
//! `pagesPerRange`, `lastRevmapPage`: four `u32`) after the header, `pd_lower` just past it. A
//! revmap page holds, after the header and not covered by `pd_lower`, an array of 1360
//! `ItemPointerData` (6 bytes: block high and low `u16`, offset `u16`), one per range: the
//! range's summary tuple on a regular page, or invalid (block `0xFFFFFFFF`, offset 0). Regular
//! pages hold the summary tuples as line pointers and items.
//!
//! Blocks per record (`brin_xlog.h`, x86-64 layouts of the main data):
//! - CREATE_INDEX (`pagesPerRange u32, version u16`): 0 the metapage (initialised).
//! - INSERT (`heapBlk u32, pagesPerRange u32, offnum u16`): 0 the regular page, the new tuple as
//!   its data (initialised first with `XLOG_BRIN_INIT_PAGE`), 1 the revmap page, whose entry
//!   for `heapBlk` then points at (block 0, `offnum`).
//! - UPDATE (`oldOffnum u16`, then at 4 an INSERT's struct): 0 and 1 as INSERT, 2 the old
//!   page, whose tuple at `oldOffnum` is deleted (`PageIndexTupleDeleteNoCompact`).
//! - SAMEPAGE_UPDATE (`offnum u16`): 0 the page, its tuple at `offnum` overwritten.
//! - REVMAP_EXTEND (`targetBlk u32`): 0 the metapage (`lastRevmapPage` = `targetBlk`,
//!   `pd_lower` set), 1 the new revmap page (initialised).
//! - DESUMMARIZE (`pagesPerRange u32, heapBlk u32, regOffset u16`): 0 the revmap page (the
//!   range's entry invalidated), 1 the regular page (its tuple at `regOffset` deleted).
//!
//! A block PostgreSQL initialises must be marked `WILL_INIT` in the record and no other may be
//! (`XLogInitBufferForRedo`/`XLogReadBufferForRedo` PANIC otherwise): this returns `Malformed`.
//! Where PostgreSQL PANICs or ERRORs (an offset past the line pointers, a tuple that does not
//! fit, an unknown operation) or divides by zero (`pagesPerRange` 0), this returns an error.
//! Invariants: pure; never panics on any record or page.

use super::bufpage;
use super::{BlockRedo, RedoError, Target};
use crate::page::{self, maxalign, Page, BLCKSZ, PAGE_HEADER_SIZE};

/// Operations (`info & XLOG_BRIN_OPMASK`).
pub const XLOG_BRIN_CREATE_INDEX: u8 = 0x00;
pub const XLOG_BRIN_INSERT: u8 = 0x10;
pub const XLOG_BRIN_UPDATE: u8 = 0x20;
pub const XLOG_BRIN_SAMEPAGE_UPDATE: u8 = 0x30;
pub const XLOG_BRIN_REVMAP_EXTEND: u8 = 0x40;
pub const XLOG_BRIN_DESUMMARIZE: u8 = 0x50;
pub const XLOG_BRIN_OPMASK: u8 = 0x70;
/// INSERT and UPDATE: the new tuple is the first of a new page, initialised by redo.
pub const XLOG_BRIN_INIT_PAGE: u8 = 0x80;

/// Page types, the special space's last `u16`.
pub const BRIN_PAGETYPE_META: u16 = 0xF091;
pub const BRIN_PAGETYPE_REVMAP: u16 = 0xF092;
pub const BRIN_PAGETYPE_REGULAR: u16 = 0xF093;
/// The flags' bit of a page whose tuples are being moved out (not WAL-logged).
pub const BRIN_EVACUATE_PAGE: u16 = 1;
/// `BRIN_META_MAGIC`.
pub const BRIN_META_MAGIC: u32 = 0xA8109CFA;
/// `sizeof(BrinSpecialSpace)`.
pub const BRIN_SPECIAL_SIZE: usize = 8;
/// `REVMAP_PAGE_MAXITEMS`: the item pointers of a revmap page.
pub const REVMAP_PAGE_MAXITEMS: u32 =
    ((BLCKSZ - PAGE_HEADER_SIZE - BRIN_SPECIAL_SIZE) / ITEM_POINTER_SIZE) as u32;
const ITEM_POINTER_SIZE: usize = 6;
/// `sizeof(BrinMetaPageData)`.
const BRIN_META_SIZE: usize = 16;

/// Applies a BRIN record to the page of its target block.
pub fn redo(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let rec = Rec::new(target);
    let info = target.record.info;
    match (info & XLOG_BRIN_OPMASK, rec.id) {
        (XLOG_BRIN_CREATE_INDEX, 0) => rec.create_index(page),
        (XLOG_BRIN_INSERT, 0 | 1) => rec.insert_update(page, 0),
        (XLOG_BRIN_UPDATE, 0 | 1) => rec.insert_update(page, 4),
        (XLOG_BRIN_UPDATE, 2) => rec.delete_tuple(page, 0),
        (XLOG_BRIN_SAMEPAGE_UPDATE, 0) => rec.samepage_update(page),
        (XLOG_BRIN_REVMAP_EXTEND, 0) => rec.extend_metapage(page),
        (XLOG_BRIN_REVMAP_EXTEND, 1) => rec.init_revmap_page(page),
        (XLOG_BRIN_DESUMMARIZE, 0) => rec.desummarize(page),
        (XLOG_BRIN_DESUMMARIZE, 1) => rec.delete_tuple(page, 8),
        (0x60 | 0x70, _) => Err(rec.malformed("unknown operation")),
        _ => Err(rec.malformed("the record does not change this block")),
    }
}

/// This module's redo of one block: [`BlockRedo`] with the helpers of Brin records.
type Rec<'t, 'r, 'a> = BlockRedo<'t, 'r, 'a, Brin>;

/// Marks [`Rec`]: the helpers below are Brin's alone.
pub enum Brin {}

impl Rec<'_, '_, '_> {
    /// PostgreSQL initialises the block (`XLogInitBufferForRedo`) exactly when the record marks
    /// it `WILL_INIT`.
    fn expect_init(&self, init: bool) -> Result<(), RedoError> {
        match (init, self.target.will_init()) {
            (true, false) => Err(self.malformed("a block redo initialises is not marked WILL_INIT")),
            (false, true) => Err(self.malformed("a block redo reads is marked WILL_INIT")),
            _ => Ok(()),
        }
    }

    /// The new tuple: the block's data.
    fn tuple(&self) -> Result<&[u8], RedoError> {
        match self.target.data() {
            [] => Err(self.malformed("no tuple in the block's data")),
            data => Ok(data),
        }
    }

    /// `brin_xlog_createidx`: `brin_metapage_init`.
    fn create_index(&self, page: &mut Page) -> Result<(), RedoError> {
        self.expect_init(true)?;
        let pages_per_range = self.main_u32(0)?;
        let version = self.main_u16(4)?;
        page_init(page, BRIN_PAGETYPE_META);
        let md = PAGE_HEADER_SIZE;
        for (i, v) in [BRIN_META_MAGIC, u32::from(version), pages_per_range, 0].iter().enumerate() {
            page[md + 4 * i..md + 4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        page::set_pd_lower(page, (md + BRIN_META_SIZE) as u16);
        self.set_lsn(page);
        Ok(())
    }

    /// `brin_xlog_insert_update`, with its `xl_brin_insert` at `at` of the main data: block 0
    /// gets the tuple, block 1 (the revmap) the pointer to it.
    fn insert_update(&self, page: &mut Page, at: usize) -> Result<(), RedoError> {
        let heap_blk = self.main_u32(at)?;
        let pages_per_range = self.main_u32(at + 4)?;
        let offnum = self.main_u16(at + 8)?;
        if self.id == 1 {
            self.expect_init(false)?;
            let Some(regular) = self.target.record.blocks.iter().find(|b| b.id == 0) else {
                return Err(self.malformed("no block 0 (the regular page)"));
            };
            self.set_revmap_entry(page, pages_per_range, heap_blk, regular.blkno, offnum)?;
        } else {
            let init = self.target.record.info & XLOG_BRIN_INIT_PAGE != 0;
            self.expect_init(init)?;
            let tuple = self.tuple()?;
            if init {
                page_init(page, BRIN_PAGETYPE_REGULAR);
            }
            if bufpage::page_get_max_offset(page) + 1 < offnum {
                return Err(self.no_fit(format!("offset {offnum} past the page's line pointers")));
            }
            bufpage::page_add_item(page, tuple, offnum, true, false)
                .map_err(|e| self.no_fit(format!("failed to add the tuple: {e}")))?;
        }
        self.set_lsn(page);
        Ok(())
    }

    /// UPDATE's old page (offset at 0) and DESUMMARIZE's regular page (at 8): the tuple is
    /// removed, its line pointer left unused.
    fn delete_tuple(&self, page: &mut Page, at: usize) -> Result<(), RedoError> {
        self.expect_init(false)?;
        let offnum = self.main_u16(at)?;
        bufpage::page_index_tuple_delete_no_compact(page, offnum).map_err(|e| self.no_fit(e))?;
        self.set_lsn(page);
        Ok(())
    }

    /// `brin_xlog_samepage_update`.
    fn samepage_update(&self, page: &mut Page) -> Result<(), RedoError> {
        self.expect_init(false)?;
        let offnum = self.main_u16(0)?;
        let tuple = self.tuple()?;
        bufpage::page_index_tuple_overwrite(page, offnum, tuple)
            .map_err(|e| self.no_fit(format!("failed to replace the tuple: {e}")))?;
        self.set_lsn(page);
        Ok(())
    }

    /// `brin_xlog_revmap_extend`'s metapage.
    fn extend_metapage(&self, page: &mut Page) -> Result<(), RedoError> {
        self.expect_init(false)?;
        let target_blk = self.main_u32(0)?;
        let at = PAGE_HEADER_SIZE + 12;
        page[at..at + 4].copy_from_slice(&target_blk.to_le_bytes());
        page::set_pd_lower(page, (PAGE_HEADER_SIZE + BRIN_META_SIZE) as u16);
        self.set_lsn(page);
        Ok(())
    }

    /// `brin_xlog_revmap_extend`'s new revmap page.
    fn init_revmap_page(&self, page: &mut Page) -> Result<(), RedoError> {
        self.expect_init(true)?;
        page_init(page, BRIN_PAGETYPE_REVMAP);
        self.set_lsn(page);
        Ok(())
    }

    /// `brin_xlog_desummarize_page`'s revmap page.
    fn desummarize(&self, page: &mut Page) -> Result<(), RedoError> {
        self.expect_init(false)?;
        let pages_per_range = self.main_u32(0)?;
        let heap_blk = self.main_u32(4)?;
        self.set_revmap_entry(page, pages_per_range, heap_blk, u32::MAX, 0)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `brinSetHeapBlockItemptr`: the revmap entry of the range holding `heap_blk` points at
    /// (`blkno`, `offnum`), or is invalid if `offnum` is 0 (`ItemPointerIsValid`).
    fn set_revmap_entry(
        &self,
        page: &mut Page,
        pages_per_range: u32,
        heap_blk: u32,
        blkno: u32,
        offnum: u16,
    ) -> Result<(), RedoError> {
        let Some(range) = heap_blk.checked_div(pages_per_range) else {
            return Err(self.malformed("pagesPerRange 0"));
        };
        let blkno = if offnum == 0 { u32::MAX } else { blkno };
        let at = maxalign(PAGE_HEADER_SIZE) + (range % REVMAP_PAGE_MAXITEMS) as usize * ITEM_POINTER_SIZE;
        // The last entry ends at 24 + 1360 x 6 = 8184, inside the page.
        page[at..at + 2].copy_from_slice(&((blkno >> 16) as u16).to_le_bytes());
        page[at + 2..at + 4].copy_from_slice(&(blkno as u16).to_le_bytes());
        page[at + 4..at + 6].copy_from_slice(&offnum.to_le_bytes());
        Ok(())
    }
}

/// `brin_page_init`: `PageInit` with the BRIN special space, of page type `page_type`.
fn page_init(page: &mut Page, page_type: u16) {
    bufpage::page_init(page, BRIN_SPECIAL_SIZE);
    let at = BLCKSZ - BRIN_SPECIAL_SIZE + 6;
    page[at..at + 2].copy_from_slice(&page_type.to_le_bytes());
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::page::{ItemId, LP_NORMAL, LP_UNUSED};
    use crate::pg15::{redo, BlockHeader, Pg15Record, FLAG_HAS_DATA, FLAG_WILL_INIT};
    use proptest::prelude::*;

    const END_LSN: u64 = 0x3_0000_0300;

    fn block(id: u8, blkno: u32, init: bool, data: &[u8]) -> BlockHeader<'_> {
        BlockHeader {
            id,
            flags: FLAG_HAS_DATA | if init { FLAG_WILL_INIT } else { 0 },
            fork: 0,
            spcnode: 1663,
            dbnode: 5,
            relnode: 16600,
            blkno,
            data,
        }
    }

    fn record<'a>(info: u8, main: &'a [u8], target: u8, blocks: Vec<BlockHeader<'a>>) -> Pg15Record<'a> {
        Pg15Record {
            rmid: redo::RM_BRIN,
            info,
            xid: 0,
            lsn: END_LSN - 0x40,
            end_lsn: END_LSN,
            target,
            blocks,
            main_data: main,
        }
    }

    /// Applies `rec` to `page` as its target block, through the family's decoder.
    fn apply(rec: &Pg15Record<'_>, page: &mut Page) -> Result<(), RedoError> {
        let mut bytes = Vec::new();
        rec.encode(&mut bytes).unwrap();
        redo::apply(&bytes, page).unwrap()
    }

    fn insert_main(heap_blk: u32, pages_per_range: u32, offnum: u16) -> Vec<u8> {
        let mut m = heap_blk.to_le_bytes().to_vec();
        m.extend_from_slice(&pages_per_range.to_le_bytes());
        m.extend_from_slice(&offnum.to_le_bytes());
        m
    }

    /// A BRIN summary tuple of `len` bytes (its contents do not matter to redo).
    fn tuple(len: usize, fill: u8) -> Vec<u8> {
        vec![fill; len]
    }

    fn regular(tuples: &[Vec<u8>]) -> Box<Page> {
        let mut page = Box::new([0u8; BLCKSZ]);
        page_init(&mut page, BRIN_PAGETYPE_REGULAR);
        for t in tuples {
            bufpage::page_add_item(&mut page, t, 0, true, false).unwrap();
        }
        page
    }

    fn revmap_entry(page: &Page, index: usize) -> (u32, u16) {
        let at = 24 + index * 6;
        let hi = u16::from_le_bytes([page[at], page[at + 1]]);
        let lo = u16::from_le_bytes([page[at + 2], page[at + 3]]);
        (u32::from(hi) << 16 | u32::from(lo), u16::from_le_bytes([page[at + 4], page[at + 5]]))
    }

    fn header(page: &Page) -> (u16, u16, u16) {
        (page::pd_lower(page), page::pd_upper(page), page::pd_special(page))
    }

    #[test]
    fn create_index_initialises_the_metapage() {
        let mut main = 4u32.to_le_bytes().to_vec();
        main.extend_from_slice(&1u16.to_le_bytes());
        let mut page = Box::new([0x55u8; BLCKSZ]);
        apply(&record(0x00, &main, 0, vec![block(0, 0, true, &[])]), &mut page).unwrap();
        assert_eq!(page::page_lsn(&page), END_LSN);
        assert_eq!(header(&page), (40, 8184, 8184));
        assert_eq!(&page[24..40], &[0xFA, 0x9C, 0x10, 0xA8, 1, 0, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&page[8184..], &[0, 0, 0, 0, 0, 0, 0x91, 0xF0]);
        assert!(page[40..8184].iter().all(|b| *b == 0));
    }

    #[test]
    fn insert_init_starts_a_regular_page_and_the_revmap_points_at_the_tuple() {
        let t = tuple(21, 7);
        let main = insert_main(4000, 2, 1);
        let rec = record(0x90, &main, 0, vec![block(0, 9, true, &t), block(1, 2, false, &[])]);
        let mut page = Box::new([0x55u8; BLCKSZ]);
        apply(&rec, &mut page).unwrap();
        assert_eq!(header(&page), (28, 8160, 8184));
        assert_eq!(bufpage::page_get_item(&page, 1).unwrap(), &t[..]);
        assert_eq!(&page[8184..], &[0, 0, 0, 0, 0, 0, 0x93, 0xF0]);
        assert_eq!(page::page_lsn(&page), END_LSN);
        // The revmap: range 2000 is entry 2000 - 1360 = 640 of its page.
        let rec = Pg15Record { target: 1, ..rec };
        let mut revmap = Box::new([0u8; BLCKSZ]);
        page_init(&mut revmap, BRIN_PAGETYPE_REVMAP);
        apply(&rec, &mut revmap).unwrap();
        assert_eq!(revmap_entry(&revmap, 640), (9, 1));
        assert_eq!(revmap_entry(&revmap, 639), (0, 0));
        assert_eq!(page::page_lsn(&revmap), END_LSN);
        assert_eq!(header(&revmap), (24, 8184, 8184), "pd_lower does not cover the entries");
    }

    #[test]
    fn insert_into_an_unused_line_pointer_overwrites_it() {
        let mut page = regular(&[tuple(16, 1), tuple(16, 2), tuple(16, 3)]);
        bufpage::page_index_tuple_delete_no_compact(&mut page, 2).unwrap();
        let t = tuple(24, 9);
        let main = insert_main(7, 1, 2);
        apply(&record(0x10, &main, 0, vec![block(0, 5, false, &t), block(1, 1, false, &[])]), &mut page)
            .unwrap();
        assert_eq!(bufpage::page_get_item(&page, 2).unwrap(), &t[..]);
        assert_eq!(bufpage::page_get_max_offset(&page), 3);
        // An offset two past the line pointers is what PostgreSQL PANICs on.
        page::set_page_lsn(&mut page, 0);
        let main = insert_main(7, 1, 5);
        let rec = record(0x10, &main, 0, vec![block(0, 5, false, &t), block(1, 1, false, &[])]);
        assert!(matches!(apply(&rec, &mut page), Err(RedoError::DoesNotFit(_))));
    }

    #[test]
    fn update_deletes_the_old_tuple_on_its_own_page_and_inserts_on_the_new() {
        let t = tuple(30, 4);
        let mut main = 2u16.to_le_bytes().to_vec();
        main.extend_from_slice(&[0, 0]); // padding before xl_brin_insert
        main.extend_from_slice(&insert_main(10, 1, 1));
        let blocks = vec![block(0, 8, true, &t), block(1, 1, false, &[]), block(2, 3, false, &[])];
        let rec = record(0xA0, &main, 2, blocks);
        let mut old = regular(&[tuple(16, 1), tuple(16, 2), tuple(16, 3)]);
        apply(&rec, &mut old).unwrap();
        assert_eq!(bufpage::item_id(&old, 2).unwrap(), ItemId { off: 0, flags: LP_UNUSED, len: 0 });
        assert_eq!(bufpage::page_get_item(&old, 3).unwrap(), &[3u8; 16]);
        assert_eq!(page::pd_upper(&old), 8184 - 32);
        let mut new = Box::new([0u8; BLCKSZ]);
        apply(&Pg15Record { target: 0, ..rec.clone() }, &mut new).unwrap();
        assert_eq!(bufpage::page_get_item(&new, 1).unwrap(), &t[..]);
        let mut revmap = Box::new([0u8; BLCKSZ]);
        page_init(&mut revmap, BRIN_PAGETYPE_REVMAP);
        apply(&Pg15Record { target: 1, ..rec }, &mut revmap).unwrap();
        assert_eq!(revmap_entry(&revmap, 10), (8, 1));
    }

    #[test]
    fn samepage_update_overwrites_in_place() {
        let mut page = regular(&[tuple(16, 1), tuple(16, 2)]);
        let t = tuple(40, 8);
        apply(&record(0x30, &2u16.to_le_bytes(), 0, vec![block(0, 2, false, &t)]), &mut page).unwrap();
        assert_eq!(bufpage::page_get_item(&page, 2).unwrap(), &t[..]);
        assert_eq!(bufpage::page_get_item(&page, 1).unwrap(), &[1u8; 16]);
        assert_eq!(bufpage::item_id(&page, 2).unwrap().flags, LP_NORMAL);
        let huge = tuple(8150, 1);
        page::set_page_lsn(&mut page, 0);
        let main = 1u16.to_le_bytes();
        let rec = record(0x30, &main, 0, vec![block(0, 2, false, &huge)]);
        assert!(matches!(apply(&rec, &mut page), Err(RedoError::DoesNotFit(_))));
    }

    #[test]
    fn revmap_extend_moves_the_metapage_on_and_initialises_the_new_revmap_page() {
        let mut meta = Box::new([0u8; BLCKSZ]);
        let mut main = 1u32.to_le_bytes().to_vec();
        main.extend_from_slice(&1u16.to_le_bytes());
        apply(&record(0x00, &main, 0, vec![block(0, 0, true, &[])]), &mut meta).unwrap();
        let main = 2u32.to_le_bytes();
        let rec = record(0x40, &main, 0, vec![block(0, 0, false, &[]), block(1, 2, true, &[])]);
        page::set_page_lsn(&mut meta, 1);
        apply(&rec, &mut meta).unwrap();
        assert_eq!(&meta[36..40], &2u32.to_le_bytes());
        assert_eq!(page::pd_lower(&meta), 40);
        let mut revmap = regular(&[tuple(16, 1)]);
        apply(&Pg15Record { target: 1, ..rec }, &mut revmap).unwrap();
        assert_eq!(header(&revmap), (24, 8184, 8184));
        assert_eq!(&revmap[8184..], &[0, 0, 0, 0, 0, 0, 0x92, 0xF0]);
        assert!(revmap[24..8184].iter().all(|b| *b == 0));
    }

    #[test]
    fn desummarize_invalidates_the_entry_and_removes_the_tuple() {
        let mut main = 1u32.to_le_bytes().to_vec();
        main.extend_from_slice(&1365u32.to_le_bytes());
        main.extend_from_slice(&1u16.to_le_bytes());
        let rec = record(0x50, &main, 0, vec![block(0, 2, false, &[]), block(1, 6, false, &[])]);
        let mut revmap = Box::new([0u8; BLCKSZ]);
        page_init(&mut revmap, BRIN_PAGETYPE_REVMAP);
        revmap[24 + 5 * 6..24 + 6 * 6].copy_from_slice(&[0, 0, 6, 0, 1, 0]);
        apply(&rec, &mut revmap).unwrap();
        assert_eq!(revmap_entry(&revmap, 5), (u32::MAX, 0));
        let mut reg = regular(&[tuple(16, 1), tuple(16, 2)]);
        apply(&Pg15Record { target: 1, ..rec }, &mut reg).unwrap();
        assert_eq!(bufpage::item_id(&reg, 1).unwrap().flags, LP_UNUSED);
        assert_eq!(bufpage::page_get_item(&reg, 2).unwrap(), &[2u8; 16]);
    }

    #[test]
    fn records_postgres_would_panic_on_are_errors() {
        let t = tuple(16, 1);
        let mut page = regular(std::slice::from_ref(&t));
        let main = insert_main(1, 0, 1);
        let malformed = [
            // pagesPerRange 0: PostgreSQL divides by it.
            record(0x10, &main, 1, vec![block(0, 2, false, &t), block(1, 1, false, &[])]),
            // INIT_PAGE without WILL_INIT, and WILL_INIT without INIT_PAGE.
            record(0x90, &main, 0, vec![block(0, 2, false, &t), block(1, 1, false, &[])]),
            record(0x10, &main, 0, vec![block(0, 2, true, &t), block(1, 1, false, &[])]),
            // No tuple, a block the record does not change, an unknown operation, short main data.
            record(0x10, &main, 0, vec![block(0, 2, false, &[]), block(1, 1, false, &[])]),
            record(0x10, &main, 2, vec![block(0, 2, false, &t), block(2, 1, false, &[])]),
            record(0x60, &main, 0, vec![block(0, 2, false, &t)]),
            record(0x30, &[1], 0, vec![block(0, 2, false, &t)]),
            record(0x40, &[2, 0, 0, 0], 1, vec![block(0, 0, false, &[]), block(1, 2, false, &[])]),
        ];
        for rec in &malformed {
            assert!(matches!(apply(rec, &mut page.clone()), Err(RedoError::Malformed(_))), "{rec:?}");
        }
        let main = [1, 0, 0, 0, 0, 0, 0, 0, 9, 0];
        let rec = record(0x50, &main, 1, vec![block(1, 2, false, &[])]);
        assert!(matches!(apply(&rec, &mut page), Err(RedoError::DoesNotFit(_))), "no tuple 9");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn random_records_on_random_and_valid_pages_never_panic(
            info in any::<u8>(),
            id in 0u8..4,
            init in any::<bool>(),
            main in proptest::collection::vec(any::<u8>(), 0..24),
            small in proptest::collection::vec(0u8..4, 0..24),
            data in proptest::collection::vec(any::<u8>(), 0..120),
            junk in proptest::collection::vec(any::<u8>(), 0..64),
            at in 0usize..BLCKSZ,
            kind in 0u8..4,
        ) {
            let mut page = match kind {
                0 => regular(&[tuple(16, 1), tuple(24, 2), tuple(16, 3)]),
                1 => {
                    let mut p = Box::new([0u8; BLCKSZ]);
                    page_init(&mut p, BRIN_PAGETYPE_REVMAP);
                    p
                }
                2 => Box::new([0u8; BLCKSZ]),
                _ => regular(&[tuple(16, 1)]),
            };
            let end = (at + junk.len()).min(BLCKSZ);
            if kind == 3 {
                page[at..end].copy_from_slice(&junk[..end - at]);
            }
            // Small numbers make offsets and pagesPerRange that reach the page's line pointers.
            let main = if init { small } else { main };
            let blocks = (0..4).map(|i| block(i, u32::from(i) + 1, init && i == id, &data)).collect();
            let rec = record(info, &main, id, blocks);
            let _ = redo(&Target { record: &rec, block: &rec.blocks[usize::from(id)] }, &mut page);
        }
    }
}
