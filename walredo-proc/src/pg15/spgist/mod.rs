//! Redo of SP-GiST records (PostgreSQL 15's `spgxlog.c`), for the record's target block: all
//! eight record types, each page they touch (the target block id says which part of the
//! routine runs).
//!
//! Page layout (`spgist_private.h`): a PostgreSQL page whose special space is
//! `SpGistPageOpaqueData` (8 bytes: `flags`, `nRedirection`, `nPlaceholder`, `spgist_page_id`,
//! each `u16`); `SpGistInitPage` is `PageInit` with that special space, the flags and the page
//! id. Tuples start with a `u32` whose low 2 bits are the tuple state (LIVE, REDIRECT, DEAD,
//! PLACEHOLDER): a leaf or dead tuple has its size in the other 30 bits and `t_info` (the
//! chain's next offset in its low 14 bits) at byte 4; an inner tuple has `allTheSame` (bit 2),
//! `nNodes` (13 bits) and `prefixSize` (16 bits) there, its size a `u16` at byte 4, then the
//! prefix and the nodes (index tuples whose TID is the downlink). A dead tuple (REDIRECT,
//! DEAD, PLACEHOLDER; `spgFormDeadTuple`) is 16 bytes: the word, `t_info` 0, the TID (the
//! redirect's target, else invalid) and an xid (the redirecting transaction, else 0).
//!
//! Records carry every tuple and offset in the **main data** (`spgxlog.h`'s structs as
//! PostgreSQL 15 on x86-64 lays them out, tuples unaligned after them) and no block data, so
//! each block's redo works from the main data and the block numbers of the record's block
//! references (always in the stored record); no part reads another block's data.
//!
//! Blocks per record, as `spgdoinsert.c`/`spgvacuum.c` register them:
//! - ADD_LEAF: 0 the leaf page (the tuple added, or a dead one replaced), 1 the parent whose
//!   downlink now points at it (if `offnumParent` is set).
//! - MOVE_LEAFS: 0 the source page (moved tuples become a redirect and placeholders), 1 the
//!   destination page, 2 the parent.
//! - ADD_NODE: 0 the inner tuple's page (replaced in place when there is no block 1, else by
//!   a redirect to block 1), 1 the page it moved to, 2 the parent (`parentBlk` says which of
//!   0, 1, 2 holds the parent; -1 none).
//! - SPLIT_TUPLE: 0 the prefix tuple's page, 1 the postfix tuple's (unless the same page).
//! - PICKSPLIT: 0 the source leaf page (absent at a root split), 1 the destination leaf page
//!   (if any), 2 the page of the new inner tuple, 3 the parent (unless it is block 2).
//! - VACUUM_LEAF, VACUUM_ROOT, VACUUM_REDIRECT: 0 the page.
//!
//! The metapage (its cache of last-used pages is not WAL-logged) is never a record's block.
//! Where PostgreSQL ERRORs, PANICs or asserts (a replaced tuple that is not a placeholder, a
//! node that is not in its inner tuple, a counter below zero, an unknown op code) or would read
//! past the record on corrupt input, this returns an error. Invariants: pure; never panics on
//! any record or page.

use super::bufpage;
use super::{le_bytes, BlockRedo, RedoError, Target};
use crate::page::{self, Page, BLCKSZ};

/// Record types (`info & 0xF0`; 0x00 was CREATE_INDEX, no longer written).
pub const XLOG_SPGIST_ADD_LEAF: u8 = 0x10;
pub const XLOG_SPGIST_MOVE_LEAFS: u8 = 0x20;
pub const XLOG_SPGIST_ADD_NODE: u8 = 0x30;
pub const XLOG_SPGIST_SPLIT_TUPLE: u8 = 0x40;
pub const XLOG_SPGIST_PICKSPLIT: u8 = 0x50;
pub const XLOG_SPGIST_VACUUM_LEAF: u8 = 0x60;
pub const XLOG_SPGIST_VACUUM_ROOT: u8 = 0x70;
pub const XLOG_SPGIST_VACUUM_REDIRECT: u8 = 0x80;

/// The record types as `pg_waldump` names them (`spg_identify`), by `info >> 4`.
pub const TYPE_NAMES: [Option<&str>; 9] = [
    None,
    Some("ADD_LEAF"),
    Some("MOVE_LEAFS"),
    Some("ADD_NODE"),
    Some("SPLIT_TUPLE"),
    Some("PICKSPLIT"),
    Some("VACUUM_LEAF"),
    Some("VACUUM_ROOT"),
    Some("VACUUM_REDIRECT"),
];

/// `flags` bits.
pub const SPGIST_META: u16 = 1 << 0;
pub const SPGIST_DELETED: u16 = 1 << 1;
pub const SPGIST_LEAF: u16 = 1 << 2;
pub const SPGIST_NULLS: u16 = 1 << 3;
/// `spgist_page_id` of every SP-GiST page.
pub const SPGIST_PAGE_ID: u16 = 0xFF82;
/// `sizeof(SpGistPageOpaqueData)`.
pub const SPGIST_SPECIAL_SIZE: usize = 8;
/// Where the metapage's cache of last-used pages lies (`SpGistMetaPageData` after the page
/// header: `magicNumber`, then 8 x (`blkno`, `freeSpace`)), which is not WAL-logged.
pub const META_CACHE: std::ops::Range<usize> = 28..92;

/// Tuple states (`tupstate`).
pub const SPGIST_LIVE: u32 = 0;
pub const SPGIST_REDIRECT: u32 = 1;
pub const SPGIST_DEAD: u32 = 2;
pub const SPGIST_PLACEHOLDER: u32 = 3;

/// `SGDTSIZE`: a dead tuple's size.
const SGDTSIZE: usize = 16;
/// The smallest tuple a record may carry: a leaf or inner tuple's header.
const MIN_TUPLE: usize = 8;
/// `MaxIndexTuplesPerPage`: the offsets one multi-delete may name.
const MAX_INDEX_TUPLES: usize = 680;
const INVALID_BLOCK: u32 = u32::MAX;
const INVALID_OFFSET: u16 = 0;
/// `SGLT_SET_NEXTOFFSET`'s mask: the next offset is the low 14 bits of `t_info`.
const NEXT_OFFSET_MASK: u16 = 0x3FFF;

/// Sizes of the records' fixed parts (`sizeof` or `SizeOf...`).
const ADD_LEAF_SIZE: usize = 10;
const MOVE_LEAFS_SIZE: usize = 20;
const ADD_NODE_SIZE: usize = 20;
const SPLIT_TUPLE_SIZE: usize = 6;
const PICKSPLIT_SIZE: usize = 28;
const VACUUM_LEAF_SIZE: usize = 16;
const VACUUM_ROOT_SIZE: usize = 12;
const VACUUM_REDIRECT_SIZE: usize = 8;

/// Applies an SP-GiST record to the page of its target block.
pub fn redo(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let rec = Rec::new(target);
    match target.record.info & 0xF0 {
        XLOG_SPGIST_ADD_LEAF => rec.add_leaf(page),
        XLOG_SPGIST_MOVE_LEAFS => rec.move_leafs(page),
        XLOG_SPGIST_ADD_NODE => rec.add_node(page),
        XLOG_SPGIST_SPLIT_TUPLE => rec.split_tuple(page),
        XLOG_SPGIST_PICKSPLIT => rec.picksplit(page),
        XLOG_SPGIST_VACUUM_LEAF => rec.vacuum_leaf(page),
        XLOG_SPGIST_VACUUM_ROOT => rec.vacuum_root(page),
        XLOG_SPGIST_VACUUM_REDIRECT => rec.vacuum_redirect(page),
        op => Err(rec.malformed(&format!("unknown op code {op:#04x}"))),
    }
}

/// `spgxlogState`: the inserting transaction and whether the index is being built.
#[derive(Debug, Clone, Copy)]
struct State {
    my_xid: u32,
    is_build: bool,
}

/// What a multi-delete leaves at the offsets it removes (`spgPageIndexMultiDelete`'s
/// arguments): the state of the first offset listed, of the others, and a redirect's target.
struct DeadTuples {
    first: u32,
    rest: u32,
    blkno: u32,
    offnum: u16,
}

/// A reader of the main data, from its start.
struct Main<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Main<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let out = self.data.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(out)
    }

    fn offsets(&mut self, n: usize) -> Option<Vec<u16>> {
        let b = self.take(n.checked_mul(2)?)?;
        Some(b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
    }

    /// A tuple whose size `size_of` reads from its header.
    fn tuple(&mut self, size_of: fn(&[u8]) -> Option<usize>) -> Option<&'a [u8]> {
        let size = size_of(self.data.get(self.at..)?)?;
        if size < MIN_TUPLE {
            return None;
        }
        self.take(size)
    }
}

/// A leaf (or dead) tuple's size: the high 30 bits of its first word.
fn leaf_size(t: &[u8]) -> Option<usize> {
    Some((u32::from_le_bytes(le_bytes(t, 0)?) >> 2) as usize)
}

/// An inner tuple's size: the `u16` at byte 4.
fn inner_size(t: &[u8]) -> Option<usize> {
    Some(usize::from(u16::from_le_bytes(le_bytes(t, 4)?)))
}

/// This module's redo of one block: [`BlockRedo`] with the helpers of SP-GiST records.
type Rec<'t, 'r, 'a> = BlockRedo<'t, 'r, 'a, Spgist>;

/// Marks [`Rec`]: the helpers below are SP-GiST's alone.
pub enum Spgist {}

impl Rec<'_, '_, '_> {
    /// A reader of the main data from its start.
    fn cursor(&self) -> Main<'_> {
        Main { data: self.target.record.main_data, at: 0 }
    }

    /// The fixed part of the record, `size` bytes; an error if the main data is shorter.
    fn header(&self, size: usize) -> Result<&[u8], RedoError> {
        self.target.record.main_data.get(..size).ok_or_else(|| self.malformed("main data too short"))
    }

    fn cut(&self) -> RedoError {
        self.malformed("main data cut short")
    }

    /// The block number of the record's block `id`.
    fn blkno_of(&self, id: u8) -> Result<u32, RedoError> {
        self.target
            .record
            .blocks
            .iter()
            .find(|b| b.id == id)
            .map(|b| b.blkno)
            .ok_or_else(|| self.malformed(&format!("no block {id}")))
    }

    /// `SpGistInitBuffer`.
    fn init(&self, page: &mut Page, flags: u16) -> Result<(), RedoError> {
        bufpage::page_init(page, SPGIST_SPECIAL_SIZE);
        let op = Opaque { flags, n_redirection: 0, n_placeholder: 0, page_id: SPGIST_PAGE_ID };
        op.write(page).ok_or_else(|| self.no_fit("no room for the SP-GiST special space"))
    }

    fn leaf_flags(stores_nulls: bool) -> u16 {
        SPGIST_LEAF | if stores_nulls { SPGIST_NULLS } else { 0 }
    }

    fn opaque(&self, page: &Page) -> Result<Opaque, RedoError> {
        Opaque::read(page).ok_or_else(|| self.no_fit("no room for the SP-GiST special space"))
    }

    fn put_opaque(&self, page: &mut Page, op: &Opaque) -> Result<(), RedoError> {
        op.write(page).ok_or_else(|| self.no_fit("no room for the SP-GiST special space"))
    }

    /// Adds `n` to (`up`), or takes `n` from, `nRedirection` (`redirect`) or `nPlaceholder`;
    /// a count that would go below zero or past `u16::MAX` (PostgreSQL asserts) is `DoesNotFit`.
    fn count(&self, page: &mut Page, redirect: bool, n: u16, up: bool) -> Result<(), RedoError> {
        let mut op = self.opaque(page)?;
        let field = if redirect { &mut op.n_redirection } else { &mut op.n_placeholder };
        *field = if up { field.checked_add(n) } else { field.checked_sub(n) }.ok_or_else(|| {
            self.no_fit(format!(
                "{} count {} cannot {} by {n}",
                if redirect { "redirection" } else { "placeholder" },
                field,
                if up { "grow" } else { "shrink" }
            ))
        })?;
        self.put_opaque(page, &op)
    }

    /// `PageAddItem(page, tuple, offnum)` that must land at `offnum`.
    fn add_at(&self, page: &mut Page, tuple: &[u8], offnum: u16) -> Result<(), RedoError> {
        match bufpage::page_add_item(page, tuple, offnum, false, false) {
            Ok(at) if at == offnum => Ok(()),
            Ok(at) => Err(self.no_fit(format!("item of size {} added at {at}, not {offnum}", tuple.len()))),
            Err(e) => {
                Err(self
                    .no_fit(format!("failed to add item of size {} to SPGiST index page: {e}", tuple.len())))
            }
        }
    }

    /// `PageIndexTupleDelete` then `PageAddItem` at the same offset: the tuple replaced.
    fn replace(&self, page: &mut Page, tuple: &[u8], offnum: u16) -> Result<(), RedoError> {
        bufpage::page_index_tuple_delete(page, offnum).map_err(|e| self.wrap(e))?;
        self.add_at(page, tuple, offnum)
    }

    /// `addOrReplaceTuple`: `tuple` added at `offnum`, replacing the placeholder there if
    /// `offnum` is an existing line pointer.
    fn add_or_replace(&self, page: &mut Page, tuple: &[u8], offnum: u16) -> Result<(), RedoError> {
        let maxoff = bufpage::page_get_max_offset(page);
        if offnum <= maxoff {
            let old = bufpage::page_get_item(page, offnum).map_err(|e| self.wrap(e))?;
            let state = le_bytes::<4>(old, 0).map(|w| u32::from_le_bytes(w) & 3);
            if state != Some(SPGIST_PLACEHOLDER) {
                return Err(self
                    .no_fit(format!("SPGiST tuple to be replaced (offset {offnum}) is not a placeholder")));
            }
            self.count(page, false, 1, false)?;
            bufpage::page_index_tuple_delete(page, offnum).map_err(|e| self.wrap(e))?;
        } else if offnum == INVALID_OFFSET || offnum > maxoff + 1 {
            return Err(self.no_fit(format!("offset {offnum} past the {maxoff} line pointers")));
        }
        self.add_at(page, tuple, offnum)
    }

    /// `spgUpdateNodeLink`: node `node_i` of the inner tuple at `offnum` points at
    /// (`blkno`, `target`).
    fn update_node_link(
        &self,
        page: &mut Page,
        offnum: u16,
        node_i: u16,
        blkno: u32,
        target: u16,
    ) -> Result<(), RedoError> {
        let tuple = bufpage::page_get_item_mut(page, offnum).map_err(|e| self.wrap(e))?;
        let word = le_bytes::<4>(tuple, 0)
            .map(u32::from_le_bytes)
            .ok_or_else(|| self.no_fit(format!("inner tuple at {offnum} too short")))?;
        let n_nodes = (word >> 3) & 0x1FFF;
        let mut at = 8 + (word >> 16) as usize;
        for i in 0..n_nodes {
            let info = le_bytes::<2>(tuple, at + 6).map(u16::from_le_bytes).ok_or_else(|| {
                self.no_fit(format!("node {i} of the inner tuple at {offnum} past its end"))
            })?;
            if i == u32::from(node_i) {
                let tid = tuple
                    .get_mut(at..at + 6)
                    .ok_or_else(|| self.no_fit("node past the inner tuple's end"))?;
                tid.copy_from_slice(&item_pointer(blkno, target));
                return Ok(());
            }
            at += usize::from(info & 0x1FFF);
        }
        Err(self.no_fit(format!("failed to find requested node {node_i} in SPGiST inner tuple at {offnum}")))
    }

    /// `SGLT_SET_NEXTOFFSET` on the leaf tuple at `offnum`.
    fn set_next_offset(&self, page: &mut Page, offnum: u16, next: u16) -> Result<(), RedoError> {
        let tuple = bufpage::page_get_item_mut(page, offnum).map_err(|e| self.wrap(e))?;
        let info = le_bytes::<2>(tuple, 4)
            .map(u16::from_le_bytes)
            .ok_or_else(|| self.no_fit(format!("leaf tuple at {offnum} too short")))?;
        let info = (info & !NEXT_OFFSET_MASK) | (next & NEXT_OFFSET_MASK);
        tuple[4..6].copy_from_slice(&info.to_le_bytes());
        Ok(())
    }

    /// `spgPageIndexMultiDelete`: the tuples at `itemnos` replaced by dead tuples, the first
    /// listed of state `dead.first`, the others `dead.rest`; the page's counters follow.
    fn multi_delete(
        &self,
        page: &mut Page,
        itemnos: &[u16],
        dead: &DeadTuples,
        state: State,
    ) -> Result<(), RedoError> {
        let Some(&first) = itemnos.first() else {
            return Ok(());
        };
        if itemnos.len() > MAX_INDEX_TUPLES {
            return Err(self.malformed(&format!("{} offsets to delete", itemnos.len())));
        }
        let mut sorted = itemnos.to_vec();
        sorted.sort_unstable();
        bufpage::page_index_multi_delete(page, &sorted).map_err(|e| self.wrap(e))?;
        for &itemno in &sorted {
            let tupstate = if itemno == first { dead.first } else { dead.rest };
            let tuple = dead_tuple(tupstate, dead.blkno, dead.offnum, state.my_xid);
            self.add_at(page, &tuple, itemno)?;
            match tupstate {
                SPGIST_REDIRECT => self.count(page, true, 1, true)?,
                SPGIST_PLACEHOLDER => self.count(page, false, 1, true)?,
                _ => {}
            }
        }
        Ok(())
    }

    /// `spgRedoAddLeaf`: spgxlogAddLeaf { newPage bool, storesNulls bool, offnumLeaf u16 at 2,
    /// offnumHeadLeaf u16 at 4, offnumParent u16 at 6, nodeI u16 at 8 }, then the leaf tuple.
    fn add_leaf(&self, page: &mut Page) -> Result<(), RedoError> {
        let h = self.header(ADD_LEAF_SIZE)?;
        let (new_page, stores_nulls) = (h[0] != 0, h[1] != 0);
        let (leaf, head, parent, node_i) = (u16_at(h, 2), u16_at(h, 4), u16_at(h, 6), u16_at(h, 8));
        match self.id {
            0 => {
                let mut main = self.cursor();
                main.at = ADD_LEAF_SIZE;
                let tuple = main.tuple(leaf_size).ok_or_else(|| self.cut())?;
                if new_page {
                    self.init(page, Self::leaf_flags(stores_nulls))?;
                }
                if leaf != head {
                    // The usual case: the tuple added by SpGistPageAddNewItem.
                    self.add_or_replace(page, tuple, leaf)?;
                    if head != INVALID_OFFSET {
                        self.set_next_offset(page, head, leaf)?;
                    }
                } else {
                    // A DEAD tuple replaced.
                    self.replace(page, tuple, leaf)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            1 if parent != INVALID_OFFSET => {
                let blkno_leaf = self.blkno_of(0)?;
                self.update_node_link(page, parent, node_i, blkno_leaf, leaf)?;
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `spgRedoMoveLeafs`: spgxlogMoveLeafs { nMoves u16, newPage bool at 2, replaceDead bool
    /// at 3, storesNulls bool at 4, offnumParent u16 at 6, nodeI u16 at 8, stateSrc at 12 },
    /// then the offsets deleted (nMoves), inserted (nMoves + 1, or 1 if replaceDead), the
    /// inserted leaf tuples.
    fn move_leafs(&self, page: &mut Page) -> Result<(), RedoError> {
        let h = self.header(MOVE_LEAFS_SIZE)?;
        let n_moves = usize::from(u16_at(h, 0));
        let (new_page, replace_dead, stores_nulls) = (h[2] != 0, h[3] != 0, h[4] != 0);
        let (parent, node_i) = (u16_at(h, 6), u16_at(h, 8));
        let state = state_at(h, 12);
        let n_insert = if replace_dead { 1 } else { n_moves + 1 };
        let mut main = self.cursor();
        main.at = MOVE_LEAFS_SIZE;
        let to_delete = main.offsets(n_moves).ok_or_else(|| self.cut())?;
        let to_insert = main.offsets(n_insert).ok_or_else(|| self.cut())?;
        let last = to_insert.last().copied().unwrap_or(INVALID_OFFSET);
        match self.id {
            1 => {
                let mut tuples = Vec::with_capacity(n_insert);
                for _ in 0..n_insert {
                    tuples.push(main.tuple(leaf_size).ok_or_else(|| self.cut())?);
                }
                if new_page {
                    self.init(page, Self::leaf_flags(stores_nulls))?;
                }
                for (tuple, &off) in tuples.iter().zip(&to_insert) {
                    self.add_or_replace(page, tuple, off)?;
                }
                self.set_lsn(page);
                Ok(())
            }
            0 => {
                let blkno_dst = self.blkno_of(1)?;
                let first = if state.is_build { SPGIST_PLACEHOLDER } else { SPGIST_REDIRECT };
                let dead = DeadTuples { first, rest: SPGIST_PLACEHOLDER, blkno: blkno_dst, offnum: last };
                self.multi_delete(page, &to_delete, &dead, state)?;
                self.set_lsn(page);
                Ok(())
            }
            2 => {
                let blkno_dst = self.blkno_of(1)?;
                self.update_node_link(page, parent, node_i, blkno_dst, last)?;
                self.set_lsn(page);
                Ok(())
            }
            _ => Err(self.not_touched()),
        }
    }

    /// `spgRedoAddNode`: spgxlogAddNode { offnum u16, offnumNew u16 at 2, newPage bool at 4,
    /// parentBlk i8 at 5, offnumParent u16 at 6, nodeI u16 at 8, stateSrc at 12 }, then the
    /// new inner tuple.
    fn add_node(&self, page: &mut Page) -> Result<(), RedoError> {
        let h = self.header(ADD_NODE_SIZE)?;
        let (offnum, offnum_new, new_page) = (u16_at(h, 0), u16_at(h, 2), h[4] != 0);
        let parent_blk = h[5] as i8;
        let (parent, node_i) = (u16_at(h, 6), u16_at(h, 8));
        let state = state_at(h, 12);
        let mut main = self.cursor();
        main.at = ADD_NODE_SIZE;
        let tuple = main.tuple(inner_size).ok_or_else(|| self.cut())?;
        if !self.has_block(1) {
            // Updated in place.
            if self.id != 0 {
                return Err(self.not_touched());
            }
            self.replace(page, tuple, offnum)?;
            self.set_lsn(page);
            return Ok(());
        }
        let blkno_new = self.blkno_of(1)?;
        match self.id {
            1 => {
                if new_page {
                    self.init(page, 0)?;
                }
                self.add_or_replace(page, tuple, offnum_new)?;
                if parent_blk == 1 {
                    self.update_node_link(page, parent, node_i, blkno_new, offnum_new)?;
                }
            }
            0 => {
                let dead = if state.is_build {
                    dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, INVALID_OFFSET, state.my_xid)
                } else {
                    dead_tuple(SPGIST_REDIRECT, blkno_new, offnum_new, state.my_xid)
                };
                self.replace(page, &dead, offnum)?;
                self.count(page, !state.is_build, 1, true)?;
                if parent_blk == 0 {
                    self.update_node_link(page, parent, node_i, blkno_new, offnum_new)?;
                }
            }
            2 if parent_blk == 2 => self.update_node_link(page, parent, node_i, blkno_new, offnum_new)?,
            _ => return Err(self.not_touched()),
        }
        self.set_lsn(page);
        Ok(())
    }

    /// `spgRedoSplitTuple`: spgxlogSplitTuple { offnumPrefix u16, offnumPostfix u16 at 2,
    /// newPage bool at 4, postfixBlkSame bool at 5 }, then the prefix and the postfix inner
    /// tuples.
    fn split_tuple(&self, page: &mut Page) -> Result<(), RedoError> {
        let h = self.header(SPLIT_TUPLE_SIZE)?;
        let (prefix_at, postfix_at) = (u16_at(h, 0), u16_at(h, 2));
        let (new_page, same) = (h[4] != 0, h[5] != 0);
        let mut main = self.cursor();
        main.at = SPLIT_TUPLE_SIZE;
        let prefix = main.tuple(inner_size).ok_or_else(|| self.cut())?;
        let postfix = main.tuple(inner_size).ok_or_else(|| self.cut())?;
        match self.id {
            1 if !same => {
                if new_page {
                    self.init(page, 0)?;
                }
                self.add_or_replace(page, postfix, postfix_at)?;
            }
            0 => {
                self.replace(page, prefix, prefix_at)?;
                if same {
                    self.add_or_replace(page, postfix, postfix_at)?;
                }
            }
            _ => return Err(self.not_touched()),
        }
        self.set_lsn(page);
        Ok(())
    }

    /// `spgRedoPickSplit`: spgxlogPickSplit { isRootSplit bool, nDelete u16 at 2, nInsert u16
    /// at 4, initSrc bool at 6, initDest bool at 7, offnumInner u16 at 8, initInner bool at 10,
    /// storesNulls bool at 11, innerIsParent bool at 12, offnumParent u16 at 14, nodeI u16 at
    /// 16, stateSrc at 20 }, then the offsets deleted (nDelete) and inserted (nInsert), a page
    /// selector byte per inserted tuple (0 source, else destination), the new inner tuple, the
    /// leaf tuples.
    fn picksplit(&self, page: &mut Page) -> Result<(), RedoError> {
        let h = self.header(PICKSPLIT_SIZE)?;
        let is_root_split = h[0] != 0;
        let (n_delete, n_insert) = (usize::from(u16_at(h, 2)), usize::from(u16_at(h, 4)));
        let (init_src, init_dest) = (h[6] != 0, h[7] != 0);
        let offnum_inner = u16_at(h, 8);
        let (init_inner, stores_nulls, inner_is_parent) = (h[10] != 0, h[11] != 0, h[12] != 0);
        let (parent, node_i) = (u16_at(h, 14), u16_at(h, 16));
        let state = state_at(h, 20);
        let mut main = self.cursor();
        main.at = PICKSPLIT_SIZE;
        let to_delete = main.offsets(n_delete).ok_or_else(|| self.cut())?;
        let to_insert = main.offsets(n_insert).ok_or_else(|| self.cut())?;
        let select = main.take(n_insert).ok_or_else(|| self.cut())?;
        let inner = main.tuple(inner_size).ok_or_else(|| self.cut())?;
        let blkno_inner = self.blkno_of(2)?;
        match self.id {
            0 | 1 => {
                let dest = self.id == 1;
                if !dest && is_root_split {
                    return Err(self.not_touched());
                }
                let mut leaves = Vec::new();
                for (i, &off) in to_insert.iter().enumerate() {
                    let tuple = main.tuple(leaf_size).ok_or_else(|| self.cut())?;
                    if (select[i] != 0) == dest {
                        leaves.push((tuple, off));
                    }
                }
                let init = if dest { init_dest } else { init_src };
                if init {
                    self.init(page, Self::leaf_flags(stores_nulls))?;
                } else if !dest {
                    let dead = if state.is_build {
                        DeadTuples {
                            first: SPGIST_PLACEHOLDER,
                            rest: SPGIST_PLACEHOLDER,
                            blkno: INVALID_BLOCK,
                            offnum: 0,
                        }
                    } else {
                        DeadTuples {
                            first: SPGIST_REDIRECT,
                            rest: SPGIST_PLACEHOLDER,
                            blkno: blkno_inner,
                            offnum: offnum_inner,
                        }
                    };
                    self.multi_delete(page, &to_delete, &dead, state)?;
                }
                for (tuple, off) in leaves {
                    self.add_or_replace(page, tuple, off)?;
                }
            }
            2 => {
                if init_inner {
                    self.init(page, if stores_nulls { SPGIST_NULLS } else { 0 })?;
                }
                self.add_or_replace(page, inner, offnum_inner)?;
                if inner_is_parent {
                    self.update_node_link(page, parent, node_i, blkno_inner, offnum_inner)?;
                }
            }
            3 => self.update_node_link(page, parent, node_i, blkno_inner, offnum_inner)?,
            _ => return Err(self.not_touched()),
        }
        self.set_lsn(page);
        Ok(())
    }

    /// `spgRedoVacuumLeaf`: spgxlogVacuumLeaf { nDead, nPlaceholder, nMove, nChain (u16),
    /// stateSrc at 8 }, then the offsets to make DEAD, to make PLACEHOLDER, to move from, to
    /// move to, the chain tuples and their new next offsets.
    fn vacuum_leaf(&self, page: &mut Page) -> Result<(), RedoError> {
        if self.id != 0 {
            return Err(self.not_touched());
        }
        let h = self.header(VACUUM_LEAF_SIZE)?;
        let counts = [u16_at(h, 0), u16_at(h, 2), u16_at(h, 4), u16_at(h, 6)].map(usize::from);
        let state = state_at(h, 8);
        let mut main = self.cursor();
        main.at = VACUUM_LEAF_SIZE;
        let mut list = |n: usize| main.offsets(n).ok_or_else(|| self.cut());
        let to_dead = list(counts[0])?;
        let to_placeholder = list(counts[1])?;
        let move_src = list(counts[2])?;
        let move_dest = list(counts[2])?;
        let chain_src = list(counts[3])?;
        let chain_dest = list(counts[3])?;
        let dead = |s| DeadTuples { first: s, rest: s, blkno: INVALID_BLOCK, offnum: INVALID_OFFSET };
        self.multi_delete(page, &to_dead, &dead(SPGIST_DEAD), state)?;
        self.multi_delete(page, &to_placeholder, &dead(SPGIST_PLACEHOLDER), state)?;
        // See vacuumLeafPage: the line pointers swap, then the sources become placeholders.
        let maxoff = bufpage::page_get_max_offset(page);
        for (&src, &dst) in move_src.iter().zip(&move_dest) {
            if src == 0 || dst == 0 || src > maxoff || dst > maxoff {
                return Err(self.no_fit(format!("move {src} -> {dst} past the {maxoff} line pointers")));
            }
            let a = bufpage::item_id(page, src).map_err(|e| self.wrap(e))?;
            let b = bufpage::item_id(page, dst).map_err(|e| self.wrap(e))?;
            bufpage::set_item_id(page, src, b).map_err(|e| self.wrap(e))?;
            bufpage::set_item_id(page, dst, a).map_err(|e| self.wrap(e))?;
        }
        self.multi_delete(page, &move_src, &dead(SPGIST_PLACEHOLDER), state)?;
        for (&src, &next) in chain_src.iter().zip(&chain_dest) {
            self.set_next_offset(page, src, next)?;
        }
        self.set_lsn(page);
        Ok(())
    }

    /// `spgRedoVacuumRoot`: spgxlogVacuumRoot { nDelete u16, stateSrc at 4 }, then the
    /// offsets (in order) deleted.
    fn vacuum_root(&self, page: &mut Page) -> Result<(), RedoError> {
        if self.id != 0 {
            return Err(self.not_touched());
        }
        let h = self.header(VACUUM_ROOT_SIZE)?;
        let mut main = self.cursor();
        main.at = VACUUM_ROOT_SIZE;
        let to_delete = main.offsets(usize::from(u16_at(h, 0))).ok_or_else(|| self.cut())?;
        bufpage::page_index_multi_delete(page, &to_delete).map_err(|e| self.wrap(e))?;
        self.set_lsn(page);
        Ok(())
    }

    /// `spgRedoVacuumRedirect`: spgxlogVacuumRedirect { nToPlaceholder u16, firstPlaceholder
    /// u16 at 2, newestRedirectXid u32 at 4 }, then the redirects to make placeholders; the
    /// placeholders from `firstPlaceholder` to the page's end are removed.
    fn vacuum_redirect(&self, page: &mut Page) -> Result<(), RedoError> {
        if self.id != 0 {
            return Err(self.not_touched());
        }
        let h = self.header(VACUUM_REDIRECT_SIZE)?;
        let n = u16_at(h, 0);
        let first_placeholder = u16_at(h, 2);
        let mut main = self.cursor();
        main.at = VACUUM_REDIRECT_SIZE;
        let to_placeholder = main.offsets(usize::from(n)).ok_or_else(|| self.cut())?;
        for &off in &to_placeholder {
            let tuple = bufpage::page_get_item_mut(page, off).map_err(|e| self.wrap(e))?;
            let word = le_bytes::<4>(tuple, 0).map(u32::from_le_bytes);
            match (word, tuple.get_mut(6..12)) {
                (Some(word), Some(pointer)) => {
                    pointer.copy_from_slice(&item_pointer(INVALID_BLOCK, INVALID_OFFSET));
                    tuple[..4].copy_from_slice(&((word & !3) | SPGIST_PLACEHOLDER).to_le_bytes());
                }
                _ => return Err(self.no_fit(format!("redirect tuple at {off} too short"))),
            }
        }
        self.count(page, true, n, false)?;
        self.count(page, false, n, true)?;
        if first_placeholder != INVALID_OFFSET {
            let max = bufpage::page_get_max_offset(page);
            if first_placeholder > max.saturating_add(1) {
                return Err(self
                    .no_fit(format!("first placeholder {first_placeholder} past the {max} line pointers")));
            }
            let to_delete: Vec<u16> = (first_placeholder..=max).collect();
            let removed = u16::try_from(to_delete.len()).map_err(|_| self.no_fit("too many placeholders"))?;
            self.count(page, false, removed, false)?;
            bufpage::page_index_multi_delete(page, &to_delete).map_err(|e| self.wrap(e))?;
        }
        self.set_lsn(page);
        Ok(())
    }
}

/// `spgFormDeadTuple`: a REDIRECT points at (`blkno`, `offnum`) and carries `xid`; the other
/// states an invalid pointer and xid 0.
fn dead_tuple(tupstate: u32, blkno: u32, offnum: u16, xid: u32) -> [u8; SGDTSIZE] {
    let mut t = [0u8; SGDTSIZE];
    t[..4].copy_from_slice(&(tupstate | ((SGDTSIZE as u32) << 2)).to_le_bytes());
    if tupstate == SPGIST_REDIRECT {
        t[6..12].copy_from_slice(&item_pointer(blkno, offnum));
        t[12..16].copy_from_slice(&xid.to_le_bytes());
    } else {
        t[6..12].copy_from_slice(&item_pointer(INVALID_BLOCK, INVALID_OFFSET));
    }
    t
}

/// `ItemPointerData`: the block number's high then low half, then the offset.
fn item_pointer(blkno: u32, offnum: u16) -> [u8; 6] {
    let mut p = [0u8; 6];
    p[0..2].copy_from_slice(&((blkno >> 16) as u16).to_le_bytes());
    p[2..4].copy_from_slice(&(blkno as u16).to_le_bytes());
    p[4..6].copy_from_slice(&offnum.to_le_bytes());
    p
}

/// `SpGistPageOpaqueData`, at `pd_special`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opaque {
    pub flags: u16,
    pub n_redirection: u16,
    pub n_placeholder: u16,
    pub page_id: u16,
}

impl Opaque {
    fn at(page: &Page) -> Option<usize> {
        let at = usize::from(page::pd_special(page));
        (at >= crate::page::PAGE_HEADER_SIZE && at + SPGIST_SPECIAL_SIZE <= BLCKSZ).then_some(at)
    }

    /// The special space of `page`; `None` if `pd_special` leaves no room for it.
    pub fn read(page: &Page) -> Option<Opaque> {
        let at = Self::at(page)?;
        let half = |i: usize| u16::from_le_bytes([page[at + i], page[at + i + 1]]);
        Some(Opaque { flags: half(0), n_redirection: half(2), n_placeholder: half(4), page_id: half(6) })
    }

    pub fn write(&self, page: &mut Page) -> Option<()> {
        let at = Self::at(page)?;
        for (i, v) in
            [self.flags, self.n_redirection, self.n_placeholder, self.page_id].into_iter().enumerate()
        {
            page[at + 2 * i..at + 2 * i + 2].copy_from_slice(&v.to_le_bytes());
        }
        Some(())
    }
}

/// The `u16` of a fixed part at `at` (the caller checked its length).
fn u16_at(h: &[u8], at: usize) -> u16 {
    le_bytes(h, at).map_or(0, u16::from_le_bytes)
}

/// `spgxlogState` at `at`: `myXid` u32, `isBuild` bool.
fn state_at(h: &[u8], at: usize) -> State {
    State {
        my_xid: le_bytes(h, at).map_or(0, u32::from_le_bytes),
        is_build: h.get(at + 4).is_some_and(|&b| b != 0),
    }
}

#[cfg(test)]
mod tests;
