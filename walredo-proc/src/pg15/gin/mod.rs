//! Redo of GIN records (PostgreSQL 15's `ginxlog.c`), for the record's target block: every
//! record type, each page it touches (the target block id says which part of the routine runs).
//!
//! Page layout (`ginblock.h`): a GIN page is a PostgreSQL page whose special space is
//! `GinPageOpaqueData` (8 bytes: `rightlink` `u32`, `maxoff` `u16`, `flags` `u16`). Entry-tree
//! pages and pending-list pages hold index tuples behind line pointers; posting-tree (data)
//! pages hold, after the header, the page's right bound (an item pointer, 8 bytes aligned) then
//! from [`DATA_START`] either downlinks (`PostingItem`: child block as two `u16`, high first,
//! then a key item pointer; 10 bytes each, `maxoff` of them) on an inner page, or compressed
//! posting lists up to `pd_lower` on a leaf ([`leaf`], [`posting`]). The metapage (block 0)
//! holds `GinMetaPageData` (56 bytes, `pd_lower` past it). A deleted page keeps its delete xid
//! in `pd_prune_xid`. Records' structs are `ginxlog.h`'s as PostgreSQL 15 (x86-64) lays them
//! out.
//!
//! Blocks per record, as `ginbtree.c`, `gindatapage.c`, `ginentrypage.c`, `ginfast.c` and
//! `ginvacuum.c` register them:
//! - CREATE_PTREE: 0 the new posting tree's root leaf, rebuilt from the main data (the size,
//!   then the posting lists).
//! - INSERT (main data: flags, and on an inner page the left and right child whose split the
//!   insert completes): 0 the page, by its kind: an entry page (block data: offset, isDelete,
//!   the tuple; an inner page's downlink at the offset first points at the right child), a
//!   posting-tree leaf (the segment actions of [`leaf`]), a posting-tree inner page (offset,
//!   the new `PostingItem`; the old one at the offset first points at the right child);
//!   1 the left child, whose `GIN_INCOMPLETE_SPLIT` is cleared.
//! - SPLIT: 0 and 1 the two halves and 2 the root of a root split arrive as full-page images
//!   (forced); 3 the left child whose split the insert completes, as INSERT's block 1.
//! - VACUUM_PAGE (an entry leaf cleaned by VACUUM): 0 arrives as a full-page image.
//! - VACUUM_DATA_LEAF_PAGE: 0 a posting-tree leaf, its segment actions ([`leaf`]).
//! - DELETE_PAGE (an emptied posting-tree page): 0 the page (`GIN_DELETED`, delete xid), 1 its
//!   parent (the downlink removed), 2 its left sibling (the right link moved past it).
//! - UPDATE_META_PAGE (a fast-update insert): 0 the metapage, rebuilt from the main data's
//!   metadata; 1 either the pending list's tail page (the block data's tuples appended, its
//!   `maxoff`, here a count of heap tuples, plus one) or the old tail, linked to a new sublist.
//! - INSERT_LISTPAGE: 0 a pending-list page, rebuilt from its block data's tuples.
//! - DELETE_LISTPAGE (pending-list cleanup): 0 the metapage, as above; 1..=ndeleted the deleted
//!   list pages, each made an empty `GIN_DELETED` page.
//!
//! No block's redo needs another block's data: each uses its own block data and the main
//! data, both always in the record as the daemon stores it for that block. An image-only block
//! (SPLIT 0 to 2, VACUUM_PAGE 0) reached here without its image is an error, as in PostgreSQL.
//! Nothing is left for a restored image to do: the primary clears a child's incomplete-split
//! flag before it logs the record, so an image of the child already has it cleared.
//!
//! Where PostgreSQL ERRORs or PANICs (a tuple that does not fit, an unknown op code, a split
//! without its images), only asserts (an offset past the items), or would read past the record
//! or write past the page on corrupt input, this returns an error. Invariants: pure; never
//! panics on any record or page.

pub mod leaf;
pub mod posting;

use super::bufpage;
use super::{le_bytes, BlockRedo, RedoError, Target};
use crate::page::{self, Page, BLCKSZ, PAGE_HEADER_SIZE};

/// Record types (`info & 0xF0`).
pub const XLOG_GIN_CREATE_PTREE: u8 = 0x10;
pub const XLOG_GIN_INSERT: u8 = 0x20;
pub const XLOG_GIN_SPLIT: u8 = 0x30;
pub const XLOG_GIN_VACUUM_PAGE: u8 = 0x40;
pub const XLOG_GIN_DELETE_PAGE: u8 = 0x50;
pub const XLOG_GIN_UPDATE_META_PAGE: u8 = 0x60;
pub const XLOG_GIN_INSERT_LISTPAGE: u8 = 0x70;
pub const XLOG_GIN_DELETE_LISTPAGE: u8 = 0x80;
pub const XLOG_GIN_VACUUM_DATA_LEAF_PAGE: u8 = 0x90;

/// `flags` bits of the page.
pub const GIN_DATA: u16 = 1 << 0;
pub const GIN_LEAF: u16 = 1 << 1;
pub const GIN_DELETED: u16 = 1 << 2;
pub const GIN_META: u16 = 1 << 3;
pub const GIN_LIST: u16 = 1 << 4;
pub const GIN_LIST_FULLROW: u16 = 1 << 5;
pub const GIN_INCOMPLETE_SPLIT: u16 = 1 << 6;
pub const GIN_COMPRESSED: u16 = 1 << 7;
/// `flags` of INSERT and SPLIT records.
pub const GIN_INSERT_ISDATA: u16 = 0x01;
pub const GIN_INSERT_ISLEAF: u16 = 0x02;
pub const GIN_SPLIT_ROOT: u16 = 0x04;
/// `sizeof(GinPageOpaqueData)`.
pub const GIN_SPECIAL_SIZE: usize = 8;
/// `InvalidBlockNumber`.
pub const INVALID_BLOCK: u32 = u32::MAX;
/// `GinDataPageGetData`: after the header and the right bound.
pub const DATA_START: usize = PAGE_HEADER_SIZE + 8;
/// `GinDataPageMaxDataSize`.
pub const GIN_DATA_PAGE_MAX_DATA_SIZE: usize = BLCKSZ - DATA_START - GIN_SPECIAL_SIZE;
/// `sizeof(PostingItem)`.
pub const POSTING_ITEM_SIZE: usize = 10;
/// `sizeof(GinMetaPageData)`: the metapage's `pd_lower` is the header plus this.
pub const GIN_META_SIZE: usize = 56;
/// Where `GinMetaPageData` is in `ginxlogUpdateMeta` (after a `RelFileNode`, 8-aligned) and
/// the fields after it; the least of the struct each record needs.
const UPDATE_META_METADATA: usize = 16;
const UPDATE_META_PREV_TAIL: usize = 72;
const UPDATE_META_NEW_RIGHTLINK: usize = 76;
const UPDATE_META_NTUPLES: usize = 80;
/// `offsetof(ginxlogInsertEntry, tuple)`.
const INSERT_ENTRY_TUPLE: usize = 4;
/// `ginxlogSplit`'s `flags`.
const SPLIT_FLAGS: usize = 24;
/// `IndexTupleData`: `t_tid` (6 bytes), `t_info` (size in its low 13 bits).
const INDEX_TUPLE_HEADER: usize = 8;
const INDEX_SIZE_MASK: u16 = 0x1FFF;

/// Applies a GIN record to the page of its target block.
pub fn redo(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let rec = Rec::new(target);
    match target.record.info & 0xF0 {
        XLOG_GIN_CREATE_PTREE => rec.only(0).and_then(|()| rec.create_ptree(page)),
        XLOG_GIN_INSERT => rec.insert(page),
        XLOG_GIN_SPLIT => rec.split(page),
        XLOG_GIN_VACUUM_PAGE => {
            Err(rec.malformed("replay of gin entry tree page vacuum did not restore the page"))
        }
        XLOG_GIN_VACUUM_DATA_LEAF_PAGE => rec.only(0).and_then(|()| rec.vacuum_data_leaf(page)),
        XLOG_GIN_DELETE_PAGE => rec.delete_page(page),
        XLOG_GIN_UPDATE_META_PAGE => rec.update_meta(page),
        XLOG_GIN_INSERT_LISTPAGE => rec.only(0).and_then(|()| rec.insert_listpage(page)),
        XLOG_GIN_DELETE_LISTPAGE => rec.delete_listpages(page),
        op => Err(rec.malformed(&format!("gin_redo: unknown op code {op}"))),
    }
}

/// This module's redo of one block: [`BlockRedo`] with the helpers of Gin records.
type Rec<'t, 'r, 'a> = BlockRedo<'t, 'r, 'a, Gin>;

/// Marks [`Rec`]: the helpers below are Gin's alone.
pub enum Gin {}

impl Rec<'_, '_, '_> {
    fn opaque(&self, page: &Page) -> Result<Opaque, RedoError> {
        Opaque::read(page).ok_or_else(|| self.no_fit("no room for the GIN special space"))
    }

    fn put_opaque(&self, page: &mut Page, op: &Opaque) -> Result<(), RedoError> {
        op.write(page).ok_or_else(|| self.no_fit("no room for the GIN special space"))
    }

    /// `GinInitPage(page, flags, BLCKSZ)`.
    fn init_page(&self, page: &mut Page, flags: u16) -> Result<(), RedoError> {
        bufpage::page_init(page, GIN_SPECIAL_SIZE);
        self.put_opaque(page, &Opaque { rightlink: INVALID_BLOCK, maxoff: 0, flags })
    }

    /// `ginRedoClearIncompleteSplit`.
    fn clear_incomplete_split(&self, page: &mut Page) -> Result<(), RedoError> {
        let mut op = self.opaque(page)?;
        op.flags &= !GIN_INCOMPLETE_SPLIT;
        self.put_opaque(page, &op)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `ntuples` index tuples from `data`, each `IndexTupleSize` bytes, which must fill it.
    fn tuples<'d>(&self, mut data: &'d [u8], ntuples: i32) -> Result<Vec<&'d [u8]>, RedoError> {
        let n = usize::try_from(ntuples).map_err(|_| self.malformed(&format!("{ntuples} tuples")))?;
        let mut out = Vec::with_capacity(n.min(data.len() / INDEX_TUPLE_HEADER));
        for _ in 0..n {
            let size = tuple_size(data).ok_or_else(|| self.malformed("tuple cut short"))?;
            if size == 0 || size > data.len() {
                return Err(self.malformed(&format!("tuple of {size} bytes in {} left", data.len())));
            }
            let (tup, rest) = data.split_at(size);
            out.push(tup);
            data = rest;
        }
        if !data.is_empty() {
            return Err(self.malformed(&format!("{} bytes after {n} tuples", data.len())));
        }
        Ok(out)
    }

    /// `tuples` added from offset `off` on, each at the next offset (`PageAddItem`).
    fn add_tuples(&self, page: &mut Page, tuples: &[&[u8]], mut off: u16) -> Result<(), RedoError> {
        for tup in tuples {
            bufpage::page_add_item(page, tup, off, false, false)
                .map_err(|e| self.no_fit(format!("failed to add item to index page: {e}")))?;
            off = off.checked_add(1).ok_or_else(|| self.no_fit("too many items"))?;
        }
        Ok(())
    }

    /// `ginRedoCreatePTree`: ginxlogCreatePostingTree { size u32 }, then the posting lists.
    fn create_ptree(&self, page: &mut Page) -> Result<(), RedoError> {
        let size = self.main_u32(0)? as usize;
        let lists = self
            .main()
            .get(4..4usize.saturating_add(size))
            .ok_or_else(|| self.malformed(&format!("{size} bytes of posting lists announced")))?;
        self.init_page(page, GIN_DATA | GIN_LEAF | GIN_COMPRESSED)?;
        leaf::set_data_size(page, size).map_err(|e| self.wrap(e))?;
        page[DATA_START..DATA_START + size].copy_from_slice(lists);
        self.set_lsn(page);
        Ok(())
    }

    /// `ginRedoInsert`: ginxlogInsert { flags u16 }, then on an inner page the left and right
    /// child (`BlockIdData` each).
    fn insert(&self, page: &mut Page) -> Result<(), RedoError> {
        let flags = self.main_u16(0)?;
        let is_leaf = flags & GIN_INSERT_ISLEAF != 0;
        let right_child = if is_leaf { INVALID_BLOCK } else { block_id(self.main_at(6)?) };
        match self.id {
            1 if !is_leaf => self.clear_incomplete_split(page),
            0 => {
                let data = self.target.data();
                if flags & GIN_INSERT_ISDATA == 0 {
                    self.insert_entry(page, data, right_child)?;
                } else if is_leaf {
                    leaf::recompress(page, data).map_err(|e| self.wrap(e))?;
                } else {
                    self.insert_data_internal(page, data, right_child)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `ginRedoInsertEntry`: ginxlogInsertEntry { offset u16, isDelete bool, tuple at 4 }.
    fn insert_entry(&self, page: &mut Page, data: &[u8], right_child: u32) -> Result<(), RedoError> {
        let cut = || self.malformed("block data too short");
        let offset = u16::from_le_bytes(le_bytes(data, 0).ok_or_else(cut)?);
        let is_delete = *data.get(2).ok_or_else(cut)? != 0;
        let rest = data.get(INSERT_ENTRY_TUPLE..).ok_or_else(cut)?;
        let size = tuple_size(rest).ok_or_else(cut)?;
        let itup = rest.get(..size).filter(|t| !t.is_empty()).ok_or_else(cut)?;
        if right_child != INVALID_BLOCK {
            // Update the link to the right page after a split (GinSetDownlink).
            let old = bufpage::page_get_item_mut(page, offset).map_err(|e| self.wrap(e))?;
            let tid = old.get_mut(..6).ok_or_else(|| self.no_fit("downlink tuple shorter than its tid"))?;
            tid.copy_from_slice(&posting::ItemPointer { block: right_child, offset: 0 }.bytes());
        }
        if is_delete {
            bufpage::page_index_tuple_delete(page, offset).map_err(|e| self.wrap(e))?;
        }
        bufpage::page_add_item(page, itup, offset, false, false)
            .map_err(|e| self.no_fit(format!("failed to add item to index page: {e}")))?;
        Ok(())
    }

    /// `ginRedoInsertData` on an inner page: ginxlogInsertDataInternal { offset u16,
    /// newitem PostingItem }.
    fn insert_data_internal(&self, page: &mut Page, data: &[u8], right_child: u32) -> Result<(), RedoError> {
        let cut = || self.malformed("block data too short");
        let offset = u16::from_le_bytes(le_bytes(data, 0).ok_or_else(cut)?);
        let newitem: [u8; POSTING_ITEM_SIZE] = le_bytes(data, 2).ok_or_else(cut)?;
        let mut op = self.opaque(page)?;
        let maxoff = usize::from(op.maxoff);
        let off = usize::from(offset);
        if off == 0 || off > maxoff {
            return Err(self.no_fit(format!("posting item {offset} of {maxoff}")));
        }
        if (maxoff + 1) * POSTING_ITEM_SIZE > GIN_DATA_PAGE_MAX_DATA_SIZE {
            return Err(self.no_fit(format!("no room for posting item {} on the page", maxoff + 1)));
        }
        // The old downlink at the offset now points at the right child (PostingItemSetBlockNumber).
        let at = posting_item_at(off);
        page[at..at + 4].copy_from_slice(&block_id_bytes(right_child));
        // GinDataPageAddPostingItem at the offset: the items from there move up one.
        let end = posting_item_at(maxoff + 1);
        page.copy_within(at..end, at + POSTING_ITEM_SIZE);
        page[at..at + POSTING_ITEM_SIZE].copy_from_slice(&newitem);
        op.maxoff += 1;
        self.put_opaque(page, &op)?;
        leaf::set_data_size(page, usize::from(op.maxoff) * POSTING_ITEM_SIZE).map_err(|e| self.wrap(e))
    }

    /// `ginRedoSplit`: ginxlogSplit { node, rrlink, leftChildBlkno, rightChildBlkno, flags u16
    /// at 24 }. The halves and the root are images; only the child is redone here.
    fn split(&self, page: &mut Page) -> Result<(), RedoError> {
        let flags = self.main_u16(SPLIT_FLAGS)?;
        match self.id {
            3 if flags & GIN_INSERT_ISLEAF == 0 => self.clear_incomplete_split(page),
            0 => Err(self.malformed("GIN split record did not contain a full-page image of left page")),
            1 => Err(self.malformed("GIN split record did not contain a full-page image of right page")),
            2 if flags & GIN_SPLIT_ROOT != 0 => {
                Err(self.malformed("GIN split record did not contain a full-page image of root page"))
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `ginRedoVacuumDataLeafPage`: the block data is ginxlogVacuumDataLeafPage, the segment
    /// actions.
    fn vacuum_data_leaf(&self, page: &mut Page) -> Result<(), RedoError> {
        leaf::recompress(page, self.target.data()).map_err(|e| self.wrap(e))?;
        self.set_lsn(page);
        Ok(())
    }

    /// `ginRedoDeletePage`: ginxlogDeletePage { parentOffset u16, rightLink u32 at 4,
    /// deleteXid u32 at 8 }.
    fn delete_page(&self, page: &mut Page) -> Result<(), RedoError> {
        let parent_offset = self.main_u16(0)?;
        let right_link = self.main_u32(4)?;
        let delete_xid = self.main_u32(8)?;
        if self.id > 2 {
            return Err(self.not_touched());
        }
        let mut op = self.opaque(page)?;
        match self.id {
            0 => {
                op.flags |= GIN_DELETED;
                self.put_opaque(page, &op)?;
                bufpage::set_pd_prune_xid(page, delete_xid);
            }
            1 => {
                // GinPageDeletePostingItem.
                let (off, maxoff) = (usize::from(parent_offset), usize::from(op.maxoff));
                if off == 0 || off > maxoff || posting_item_at(maxoff + 1) > BLCKSZ {
                    return Err(self.no_fit(format!("posting item {parent_offset} of {maxoff}")));
                }
                let at = posting_item_at(off);
                page.copy_within(at + POSTING_ITEM_SIZE..posting_item_at(maxoff + 1), at);
                op.maxoff -= 1;
                self.put_opaque(page, &op)?;
                leaf::set_data_size(page, usize::from(op.maxoff) * POSTING_ITEM_SIZE)
                    .map_err(|e| self.wrap(e))?;
            }
            2 => {
                op.rightlink = right_link;
                self.put_opaque(page, &op)?;
            }
            _ => return Err(self.not_touched()),
        }
        self.set_lsn(page);
        Ok(())
    }

    /// The metapage rebuilt from `metadata` (`GinInitMetabuffer`, then the metadata copied).
    fn restore_meta(&self, page: &mut Page, metadata: &[u8]) -> Result<(), RedoError> {
        let metadata = metadata.get(..GIN_META_SIZE).ok_or_else(|| self.malformed("main data too short"))?;
        self.init_page(page, GIN_META)?;
        page[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + GIN_META_SIZE].copy_from_slice(metadata);
        page::set_pd_lower(page, (PAGE_HEADER_SIZE + GIN_META_SIZE) as u16);
        self.set_lsn(page);
        Ok(())
    }

    /// `ginRedoUpdateMetapage`: ginxlogUpdateMeta { node, metadata at 16, prevTail u32 at 72,
    /// newRightlink u32 at 76, ntuples i32 at 80 }.
    fn update_meta(&self, page: &mut Page) -> Result<(), RedoError> {
        let prev_tail = self.main_u32(UPDATE_META_PREV_TAIL)?;
        let new_rightlink = self.main_u32(UPDATE_META_NEW_RIGHTLINK)?;
        let ntuples = i32::from_le_bytes(self.main_at(UPDATE_META_NTUPLES)?);
        match self.id {
            0 => self.restore_meta(page, self.main().get(UPDATE_META_METADATA..).unwrap_or_default()),
            1 if ntuples > 0 => {
                // Insert into the tail page.
                let tuples = self.tuples(self.target.data(), ntuples)?;
                let off = if page::pd_lower(page) as usize <= PAGE_HEADER_SIZE {
                    1
                } else {
                    bufpage::page_get_max_offset(page) + 1
                };
                self.add_tuples(page, &tuples, off)?;
                let mut op = self.opaque(page)?;
                op.maxoff = op.maxoff.wrapping_add(1);
                self.put_opaque(page, &op)?;
                self.set_lsn(page);
                Ok(())
            }
            1 if prev_tail != INVALID_BLOCK => {
                // The old tail, linked to the new sublist.
                let mut op = self.opaque(page)?;
                op.rightlink = new_rightlink;
                self.put_opaque(page, &op)?;
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `ginRedoInsertListPage`: ginxlogInsertListPage { rightlink u32, ntuples i32 }.
    fn insert_listpage(&self, page: &mut Page) -> Result<(), RedoError> {
        let rightlink = self.main_u32(0)?;
        let ntuples = i32::from_le_bytes(self.main_at(4)?);
        let tuples = self.tuples(self.target.data(), ntuples)?;
        self.init_page(page, GIN_LIST)?;
        let op = if rightlink == INVALID_BLOCK {
            // The tail of a sublist.
            Opaque { rightlink, maxoff: 1, flags: GIN_LIST | GIN_LIST_FULLROW }
        } else {
            Opaque { rightlink, maxoff: 0, flags: GIN_LIST }
        };
        self.put_opaque(page, &op)?;
        self.add_tuples(page, &tuples, 1)?;
        self.set_lsn(page);
        Ok(())
    }

    /// `ginRedoDeleteListPages`: ginxlogDeleteListPages { metadata, ndeleted i32 at 56 }.
    fn delete_listpages(&self, page: &mut Page) -> Result<(), RedoError> {
        let ndeleted = i32::from_le_bytes(self.main_at(GIN_META_SIZE)?);
        match self.id {
            0 => self.restore_meta(page, self.main()),
            id if i32::from(id) <= ndeleted => {
                self.init_page(page, GIN_DELETED)?;
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }
}

/// `GinPageOpaqueData`, at `pd_special`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opaque {
    pub rightlink: u32,
    pub maxoff: u16,
    pub flags: u16,
}

impl Opaque {
    /// Where the special space starts, if `pd_special` leaves room for it after the header.
    fn at(page: &Page) -> Option<usize> {
        let at = usize::from(page::pd_special(page));
        (at >= PAGE_HEADER_SIZE && at + GIN_SPECIAL_SIZE <= BLCKSZ).then_some(at)
    }

    /// The special space of `page`; `None` if `pd_special` leaves no room for it.
    pub fn read(page: &Page) -> Option<Opaque> {
        let at = Self::at(page)?;
        Some(Opaque {
            rightlink: u32::from_le_bytes(le_bytes(page, at)?),
            maxoff: u16::from_le_bytes(le_bytes(page, at + 4)?),
            flags: u16::from_le_bytes(le_bytes(page, at + 6)?),
        })
    }

    pub fn write(&self, page: &mut Page) -> Option<()> {
        let at = Self::at(page)?;
        page[at..at + 4].copy_from_slice(&self.rightlink.to_le_bytes());
        page[at + 4..at + 6].copy_from_slice(&self.maxoff.to_le_bytes());
        page[at + 6..at + 8].copy_from_slice(&self.flags.to_le_bytes());
        Some(())
    }
}

/// Where posting item `off` (1-based) of an inner data page starts (`GinDataPageGetPostingItem`).
fn posting_item_at(off: usize) -> usize {
    DATA_START + (off - 1) * POSTING_ITEM_SIZE
}

/// `BlockIdGetBlockNumber`: two `u16`, high first.
fn block_id(b: [u8; 4]) -> u32 {
    u32::from(u16::from_le_bytes([b[0], b[1]])) << 16 | u32::from(u16::from_le_bytes([b[2], b[3]]))
}

/// `BlockIdSet`.
fn block_id_bytes(blkno: u32) -> [u8; 4] {
    let [a, b] = ((blkno >> 16) as u16).to_le_bytes();
    let [c, d] = (blkno as u16).to_le_bytes();
    [a, b, c, d]
}

/// `IndexTupleSize` of the tuple at the start of `data`; `None` if its header is cut short.
fn tuple_size(data: &[u8]) -> Option<usize> {
    let info: [u8; 2] = le_bytes(data.get(..INDEX_TUPLE_HEADER)?, 6)?;
    Some(usize::from(u16::from_le_bytes(info) & INDEX_SIZE_MASK))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests;
