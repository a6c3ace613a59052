//! PostgreSQL 15's `bufpage.c` over a [`Page`]: the page-level primitives the heap and btree
//! redo routines build on (`PageInit`, `PageAddItemExtended`, `PageRepairFragmentation` with its
//! `compactify_tuples`, `PageTruncateLinePointerArray`, the `PageIndex*` deletions and
//! overwrite, `PageGetItem`).
//!
//! Each function leaves the page byte for byte as its PostgreSQL namesake does, including the
//! bytes it does not touch (the stale tuple bytes left in the hole by a compaction, the
//! `PD_HAS_FREE_LINES` hint), so that a page rebuilt here equals the primary's.
//!
//! Invariants: pure, no I/O; nothing here panics on any page contents. Where PostgreSQL
//! `PANIC`s or `ERROR`s on a corrupt page ("corrupted page pointers", "corrupted line
//! pointer", "invalid index offnum") or refuses (`PageAddItem` returning
//! `InvalidOffsetNumber`), these return [`RedoError::DoesNotFit`]; a function that fails may
//! leave the page partly changed (the request fails as a whole). Where PostgreSQL would read or
//! write past the page on a corrupt line pointer without checking, these check and fail too.

use super::RedoError;
use crate::page::{
    self, maxalign, ItemId, Page, BLCKSZ, ITEM_ID_SIZE, LP_NORMAL, LP_UNUSED, MAXALIGN, PAGE_HEADER_SIZE,
};

/// `pd_flags` bits (`bufpage.h`).
pub const PD_HAS_FREE_LINES: u16 = 0x0001;
pub const PD_PAGE_FULL: u16 = 0x0002;
pub const PD_ALL_VISIBLE: u16 = 0x0004;
/// `MaxHeapTuplesPerPage` for 8 KiB pages: `(8192 - 24) / (MAXALIGN(23) + 4)`.
pub const MAX_HEAP_TUPLES_PER_PAGE: u16 = 291;

fn corrupt(what: impl Into<String>) -> RedoError {
    RedoError::DoesNotFit(what.into())
}

/// Sets `pd_flags`.
pub fn set_pd_flags(page: &mut Page, flags: u16) {
    page[10..12].copy_from_slice(&flags.to_le_bytes());
}

/// Sets `pd_prune_xid`.
pub fn set_pd_prune_xid(page: &mut Page, xid: u32) {
    page[20..24].copy_from_slice(&xid.to_le_bytes());
}

fn set_flag(page: &mut Page, flag: u16, on: bool) {
    let flags = page::pd_flags(page);
    set_pd_flags(page, if on { flags | flag } else { flags & !flag });
}

/// `PageSetAllVisible` / `PageClearAllVisible`.
pub fn set_all_visible(page: &mut Page, on: bool) {
    set_flag(page, PD_ALL_VISIBLE, on);
}

/// `PageIsNew`: `pd_upper == 0` (a page never initialised, e.g. all zeros).
pub fn page_is_new(page: &Page) -> bool {
    page::pd_upper(page) == 0
}

/// `PageInit(page, BLCKSZ, special_size)`: zeroes the page and sets an empty header with
/// `MAXALIGN(special_size)` bytes of special space (clamped so the header still fits).
pub fn page_init(page: &mut Page, special_size: usize) {
    let special = maxalign(special_size).min(BLCKSZ - PAGE_HEADER_SIZE - MAXALIGN);
    page.fill(0);
    let at = (BLCKSZ - special) as u16;
    page::set_pd_lower(page, PAGE_HEADER_SIZE as u16);
    page::set_pd_upper(page, at);
    page::set_pd_special(page, at);
    page::set_pd_pagesize_version(page, page::PAGE_SIZE_VERSION);
}

/// `PageGetMaxOffsetNumber`: the number of line pointers `pd_lower` covers.
pub fn page_get_max_offset(page: &Page) -> u16 {
    let lower = usize::from(page::pd_lower(page));
    if lower <= PAGE_HEADER_SIZE {
        0
    } else {
        ((lower - PAGE_HEADER_SIZE) / ITEM_ID_SIZE) as u16
    }
}

/// Line pointer `offnum` (1-based) of the page, whether or not below `pd_lower`: PostgreSQL's
/// `PageGetItemId`, checked against the page's end.
pub fn item_id(page: &Page, offnum: u16) -> Result<ItemId, RedoError> {
    page::item_id(page, usize::from(offnum))
        .ok_or_else(|| corrupt(format!("line pointer {offnum} outside the page")))
}

/// Writes line pointer `offnum`; an error if it is outside the page.
pub fn set_item_id(page: &mut Page, offnum: u16, id: ItemId) -> Result<(), RedoError> {
    page::set_item_id(page, usize::from(offnum), id)
        .ok_or_else(|| corrupt(format!("line pointer {offnum} outside the page")))
}

fn item_range(page: &Page, offnum: u16) -> Result<std::ops::Range<usize>, RedoError> {
    if offnum == 0 || offnum > page_get_max_offset(page) {
        return Err(corrupt(format!("offset {offnum} past the {} line pointers", page_get_max_offset(page))));
    }
    let id = item_id(page, offnum)?;
    let start = usize::from(id.off);
    let end = start + usize::from(id.len);
    if start < PAGE_HEADER_SIZE || end > BLCKSZ {
        return Err(corrupt(format!(
            "line pointer {offnum} (off {}, len {}) outside the page",
            id.off, id.len
        )));
    }
    Ok(start..end)
}

/// `PageGetItem(page, PageGetItemId(page, offnum))`: the `lp_len` bytes at `lp_off` of line
/// pointer `offnum`, which must be in `1..=maxoff` and point inside the page (its flags are not
/// looked at).
pub fn page_get_item(page: &Page, offnum: u16) -> Result<&[u8], RedoError> {
    let range = item_range(page, offnum)?;
    page.get(range).ok_or_else(|| corrupt("item outside the page"))
}

/// The mutable variant of [`page_get_item`].
pub fn page_get_item_mut(page: &mut Page, offnum: u16) -> Result<&mut [u8], RedoError> {
    let range = item_range(page, offnum)?;
    page.get_mut(range).ok_or_else(|| corrupt("item outside the page"))
}

/// The check every `bufpage.c` routine that moves data starts with ("corrupted page
/// pointers"); `aligned_special` adds `pd_special == MAXALIGN(pd_special)`.
fn check_pointers(page: &Page, aligned_special: bool) -> Result<(usize, usize, usize), RedoError> {
    let (lower, upper, special) = (
        usize::from(page::pd_lower(page)),
        usize::from(page::pd_upper(page)),
        usize::from(page::pd_special(page)),
    );
    if lower < PAGE_HEADER_SIZE
        || lower > upper
        || upper > special
        || special > BLCKSZ
        || (aligned_special && special != maxalign(special))
    {
        return Err(corrupt(format!(
            "corrupted page pointers: lower = {lower}, upper = {upper}, special = {special}"
        )));
    }
    Ok((lower, upper, special))
}

/// `PageAddItemExtended(page, item, size, offnum, flags)`: `offnum` 0 (`InvalidOffsetNumber`)
/// takes the first free line pointer (if `PD_HAS_FREE_LINES` says there may be one) or a new
/// one; `overwrite` is `PAI_OVERWRITE` (the slot must be unused, or one past the end), else the
/// line pointers from `offnum` on shift up by one; `is_heap` is `PAI_IS_HEAP` (at most
/// [`MAX_HEAP_TUPLES_PER_PAGE`] line pointers). Returns the offset used; where PostgreSQL
/// returns `InvalidOffsetNumber` (or PANICs on corrupt pointers) this is `DoesNotFit`.
pub fn page_add_item(
    page: &mut Page,
    item: &[u8],
    offnum: u16,
    overwrite: bool,
    is_heap: bool,
) -> Result<u16, RedoError> {
    let (lower, upper, _) = check_pointers(page, false)?;
    let limit = page_get_max_offset(page) + 1;
    let mut offnum = offnum;
    let mut needshuffle = false;
    if offnum != 0 {
        if overwrite {
            if offnum < limit {
                let id = item_id(page, offnum)?;
                if id.flags != LP_UNUSED || id.len != 0 {
                    return Err(corrupt(format!("will not overwrite a used ItemId ({offnum})")));
                }
            }
        } else if offnum < limit {
            needshuffle = true;
        }
    } else if page::pd_flags(page) & PD_HAS_FREE_LINES != 0 {
        offnum = 1;
        while offnum < limit {
            let id = item_id(page, offnum)?;
            if id.flags == LP_UNUSED && id.len == 0 {
                break;
            }
            offnum += 1;
        }
        if offnum >= limit {
            set_flag(page, PD_HAS_FREE_LINES, false);
        }
    } else {
        offnum = limit;
    }
    if offnum > limit {
        return Err(corrupt(format!("specified item offset {offnum} is too large")));
    }
    if is_heap && offnum > MAX_HEAP_TUPLES_PER_PAGE {
        return Err(corrupt("can't put more than MaxHeapTuplesPerPage items in a heap page"));
    }
    let new_lower = if offnum == limit || needshuffle { lower + ITEM_ID_SIZE } else { lower };
    let aligned = maxalign(item.len());
    let Some(new_upper) = upper.checked_sub(aligned).filter(|u| *u >= new_lower) else {
        return Err(corrupt(format!("no room for an item of {} bytes ({} free)", item.len(), upper - lower)));
    };
    if needshuffle {
        let from = PAGE_HEADER_SIZE + usize::from(offnum - 1) * ITEM_ID_SIZE;
        let to = PAGE_HEADER_SIZE + usize::from(limit - 1) * ITEM_ID_SIZE;
        // new_lower = to + 4 <= new_upper <= BLCKSZ
        page.copy_within(from..to, from + ITEM_ID_SIZE);
    }
    set_item_id(page, offnum, ItemId { off: new_upper as u16, flags: LP_NORMAL, len: item.len() as u16 })?;
    page[new_upper..new_upper + item.len()].copy_from_slice(item);
    page::set_pd_lower(page, new_lower as u16);
    page::set_pd_upper(page, new_upper as u16);
    Ok(offnum)
}

/// `itemIdCompactData`: a line pointer's index, its tuple's offset and aligned length.
#[derive(Debug, Clone, Copy)]
struct Compact {
    offsetindex: u16,
    itemoff: usize,
    alignedlen: usize,
}

/// `compactify_tuples`: moves the tuples of `items` (at least one; each `itemoff +
/// alignedlen <= BLCKSZ`, their total at most `pd_special - pd_lower`) to the end of the page,
/// the first at the highest address, closing the gaps, and sets their `lp_off` and
/// `pd_upper`. `presorted` (the items in descending `itemoff`) takes PostgreSQL's `memmove`
/// path, else the copy through a scratch page; both leave the same bytes.
fn compactify_tuples(items: &[Compact], page: &mut Page, presorted: bool) -> Result<(), RedoError> {
    let Some(first) = items.first() else {
        return Ok(());
    };
    let special = usize::from(page::pd_special(page));
    let pd_upper = usize::from(page::pd_upper(page));
    let end = |c: &Compact| c.itemoff + c.alignedlen;
    let bad = || corrupt("corrupted item lengths");
    // Skips the tuples already in place at the end of the page; returns (i, upper).
    let skip_in_place = |items: &[Compact]| {
        let mut upper = special;
        let mut i = 0;
        while i < items.len() && upper == end(&items[i]) {
            upper -= items[i].alignedlen;
            i += 1;
        }
        (i, upper)
    };
    let mut scratch: Option<Box<Page>> = None;
    let (mut i, mut upper) = if presorted {
        skip_in_place(items)
    } else {
        let mut buf = Box::new([0u8; BLCKSZ]);
        let maxoff = usize::from(page_get_max_offset(page));
        let start = if items.len() < maxoff / 4 {
            for c in items {
                let r = c.itemoff..end(c);
                buf.get_mut(r.clone()).ok_or_else(bad)?.copy_from_slice(page.get(r).ok_or_else(bad)?);
            }
            (0, special)
        } else {
            let (i, upper) = skip_in_place(items);
            if upper > pd_upper {
                buf[pd_upper..upper].copy_from_slice(&page[pd_upper..upper]);
            }
            (i, upper)
        };
        scratch = Some(buf);
        start
    };
    // PostgreSQL leaves `itemidptr` at the last item when every one was in place.
    let at = items.get(i).or(items.last()).unwrap_or(first);
    let (mut copy_tail, mut copy_head) = (end(at), end(at));
    let flush = |page: &mut Page, upper: usize, head: usize, tail: usize| -> Result<(), RedoError> {
        let len = tail.checked_sub(head).ok_or_else(bad)?;
        if upper.checked_add(len).filter(|e| *e <= BLCKSZ).is_none() || tail > BLCKSZ {
            return Err(bad());
        }
        match &scratch {
            None => page.copy_within(head..tail, upper),
            Some(buf) => page[upper..upper + len].copy_from_slice(&buf[head..tail]),
        }
        Ok(())
    };
    while i < items.len() {
        let c = items[i];
        if copy_head != end(&c) {
            flush(page, upper, copy_head, copy_tail)?;
            copy_tail = end(&c);
        }
        upper = upper.checked_sub(c.alignedlen).ok_or_else(bad)?;
        copy_head = c.itemoff;
        let mut id = item_id(page, c.offsetindex + 1)?;
        id.off = upper as u16;
        set_item_id(page, c.offsetindex + 1, id)?;
        i += 1;
    }
    flush(page, upper, copy_head, copy_tail)?;
    page::set_pd_upper(page, upper as u16);
    Ok(())
}

/// `PageRepairFragmentation` (PostgreSQL 14+): compacts the storage of the used line pointers
/// to the end of the page (in line-pointer order, [`compactify_tuples`]), zeroes unused line
/// pointers, truncates unused ones off the end of the array, and sets or clears
/// `PD_HAS_FREE_LINES`.
pub fn page_repair_fragmentation(page: &mut Page) -> Result<(), RedoError> {
    let (lower, upper, special) = check_pointers(page, true)?;
    let nline = page_get_max_offset(page);
    let mut items = Vec::with_capacity(usize::from(nline));
    let (mut nunused, mut totallen, mut finalusedlp) = (0usize, 0usize, 0u16);
    let mut last_offset = special;
    let mut presorted = true;
    for i in 1..=nline {
        let id = item_id(page, i)?;
        if id.flags != LP_UNUSED {
            if id.len != 0 {
                let itemoff = usize::from(id.off);
                if last_offset > itemoff {
                    last_offset = itemoff;
                } else {
                    presorted = false;
                }
                let alignedlen = maxalign(usize::from(id.len));
                if itemoff < upper || itemoff >= special || itemoff + alignedlen > BLCKSZ {
                    return Err(corrupt(format!("corrupted line pointer: {itemoff}")));
                }
                totallen += alignedlen;
                items.push(Compact { offsetindex: i - 1, itemoff, alignedlen });
            }
            finalusedlp = i;
        } else {
            set_item_id(page, i, ItemId::UNUSED)?;
            nunused += 1;
        }
    }
    if items.is_empty() {
        page::set_pd_upper(page, special as u16);
    } else {
        if totallen > special - lower {
            return Err(corrupt(format!(
                "corrupted item lengths: total {totallen}, available space {}",
                special - lower
            )));
        }
        compactify_tuples(&items, page, presorted)?;
    }
    if finalusedlp != nline {
        let nunusedend = usize::from(nline - finalusedlp);
        nunused -= nunusedend;
        page::set_pd_lower(page, (lower - ITEM_ID_SIZE * nunusedend) as u16);
    }
    set_flag(page, PD_HAS_FREE_LINES, nunused > 0);
    Ok(())
}

/// `PageTruncateLinePointerArray`: drops the unused line pointers at the end of the array
/// (keeping at least one), and sets `PD_HAS_FREE_LINES` if unused ones remain before them.
pub fn page_truncate_line_pointer_array(page: &mut Page) {
    let (mut countdone, mut sethint) = (false, false);
    let mut nunusedend = 0usize;
    let mut i = page_get_max_offset(page);
    while i >= 1 {
        let used = page::item_id(page, usize::from(i)).is_some_and(|id| id.flags != LP_UNUSED);
        if !countdone && i > 1 {
            if used {
                countdone = true;
            } else {
                nunusedend += 1;
            }
        } else if !used {
            sethint = true;
            break;
        }
        i -= 1;
    }
    if nunusedend > 0 {
        let lower = usize::from(page::pd_lower(page));
        page::set_pd_lower(page, lower.saturating_sub(ITEM_ID_SIZE * nunusedend) as u16);
    }
    set_flag(page, PD_HAS_FREE_LINES, sethint);
}

/// The checks the `PageIndex*` routines make of line pointer `offnum`: in `1..=nline`, storage
/// aligned and inside `[pd_upper, pd_special]`. Returns (line pointer, offset, length).
fn index_item(
    page: &Page,
    offnum: u16,
    upper: usize,
    special: usize,
) -> Result<(ItemId, usize, usize), RedoError> {
    let nline = page_get_max_offset(page);
    if offnum == 0 || offnum > nline {
        return Err(corrupt(format!("invalid index offnum: {offnum}")));
    }
    let id = item_id(page, offnum)?;
    let (offset, size) = (usize::from(id.off), usize::from(id.len));
    if offset < upper || offset + size > special || offset != maxalign(offset) {
        return Err(corrupt(format!("corrupted line pointer: offset = {offset}, size = {size}")));
    }
    Ok((id, offset, size))
}

/// Moves the tuple bytes `[pd_upper, offset)` up by `by` (the room a deleted or shrunk tuple at
/// `offset` leaves), as the `PageIndex*` routines' `memmove(addr + size, addr, ...)`.
fn shift_tuples_before(page: &mut Page, upper: usize, offset: usize, by: usize) -> Result<(), RedoError> {
    if offset > upper {
        if offset + by > BLCKSZ {
            return Err(corrupt("tuple move past the page"));
        }
        page.copy_within(upper..offset, upper + by);
    }
    Ok(())
}

/// Adds `by` to the `lp_off` of line pointers `1..=nline` with storage at or below `offset`
/// (`only_with_storage`: skip those without, as `PageIndexTupleDeleteNoCompact` does; else
/// every one, as `PageIndexTupleDelete`).
fn adjust_offsets(
    page: &mut Page,
    nline: u16,
    offset: usize,
    by: isize,
    only_with_storage: bool,
) -> Result<(), RedoError> {
    for i in 1..=nline {
        let mut id = item_id(page, i)?;
        if (!only_with_storage || id.len != 0) && usize::from(id.off) <= offset {
            id.off = ((isize::from(id.off as i16) + by) & 0x7FFF) as u16;
            set_item_id(page, i, id)?;
        }
    }
    Ok(())
}

/// `PageIndexTupleDelete`: removes line pointer `offnum` (the later ones move down one slot)
/// and its tuple, closing the gap.
pub fn page_index_tuple_delete(page: &mut Page, offnum: u16) -> Result<(), RedoError> {
    let (lower, upper, special) = check_pointers(page, true)?;
    let nline = page_get_max_offset(page);
    let (_, offset, size) = index_item(page, offnum, upper, special)?;
    let size = maxalign(size);
    let at = PAGE_HEADER_SIZE + usize::from(offnum - 1) * ITEM_ID_SIZE;
    if lower > at + ITEM_ID_SIZE {
        page.copy_within(at + ITEM_ID_SIZE..lower, at);
    }
    shift_tuples_before(page, upper, offset, size)?;
    page::set_pd_upper(page, (upper + size) as u16);
    page::set_pd_lower(page, (lower - ITEM_ID_SIZE) as u16);
    if lower - ITEM_ID_SIZE > PAGE_HEADER_SIZE {
        adjust_offsets(page, nline - 1, offset, size as isize, false)?;
    }
    Ok(())
}

/// `PageIndexMultiDelete`: removes the line pointers `itemnos` (ascending) and their tuples;
/// two or fewer go through [`page_index_tuple_delete`], more through a compaction.
pub fn page_index_multi_delete(page: &mut Page, itemnos: &[u16]) -> Result<(), RedoError> {
    if itemnos.len() <= 2 {
        for &off in itemnos.iter().rev() {
            page_index_tuple_delete(page, off)?;
        }
        return Ok(());
    }
    let (lower, upper, special) = check_pointers(page, true)?;
    let nline = page_get_max_offset(page);
    let mut items = Vec::with_capacity(usize::from(nline));
    let mut newitemids = Vec::with_capacity(usize::from(nline));
    let (mut totallen, mut nextitm) = (0usize, 0usize);
    let mut last_offset = special;
    let mut presorted = true;
    for offnum in 1..=nline {
        let (id, offset, size) = index_item(page, offnum, upper, special)?;
        if itemnos.get(nextitm) == Some(&offnum) {
            nextitm += 1;
        } else {
            if last_offset > offset {
                last_offset = offset;
            } else {
                presorted = false;
            }
            let alignedlen = maxalign(size);
            if offset + alignedlen > BLCKSZ {
                return Err(corrupt(format!("corrupted line pointer: offset = {offset}, size = {size}")));
            }
            totallen += alignedlen;
            items.push(Compact { offsetindex: newitemids.len() as u16, itemoff: offset, alignedlen });
            newitemids.push(id);
        }
    }
    if nextitm != itemnos.len() {
        return Err(corrupt("incorrect index offsets supplied"));
    }
    if totallen > special - lower {
        return Err(corrupt(format!(
            "corrupted item lengths: total {totallen}, available space {}",
            special - lower
        )));
    }
    for (i, id) in newitemids.iter().enumerate() {
        set_item_id(page, i as u16 + 1, *id)?;
    }
    page::set_pd_lower(page, (PAGE_HEADER_SIZE + newitemids.len() * ITEM_ID_SIZE) as u16);
    if items.is_empty() {
        page::set_pd_upper(page, special as u16);
        Ok(())
    } else {
        compactify_tuples(&items, page, presorted)
    }
}

/// `PageIndexTupleDeleteNoCompact`: removes the tuple of `offnum`, closing the gap, and marks
/// its line pointer unused (or drops it if it is the last).
pub fn page_index_tuple_delete_no_compact(page: &mut Page, offnum: u16) -> Result<(), RedoError> {
    let (lower, upper, special) = check_pointers(page, true)?;
    let mut nline = page_get_max_offset(page);
    let (_, offset, size) = index_item(page, offnum, upper, special)?;
    let size = maxalign(size);
    let mut new_lower = lower;
    if offnum < nline {
        set_item_id(page, offnum, ItemId::UNUSED)?;
    } else {
        new_lower = lower - ITEM_ID_SIZE;
        page::set_pd_lower(page, new_lower as u16);
        nline -= 1;
    }
    shift_tuples_before(page, upper, offset, size)?;
    page::set_pd_upper(page, (upper + size) as u16);
    if new_lower > PAGE_HEADER_SIZE {
        adjust_offsets(page, nline, offset, size as isize, true)?;
    }
    Ok(())
}

/// `PageIndexTupleOverwrite`: replaces the tuple of `offnum` by `item` in place, moving the
/// tuples before it by the change in aligned size; keeps the line pointer's flags.
/// `DoesNotFit` where PostgreSQL returns false (no room).
pub fn page_index_tuple_overwrite(page: &mut Page, offnum: u16, item: &[u8]) -> Result<(), RedoError> {
    let (lower, upper, special) = check_pointers(page, true)?;
    let itemcount = page_get_max_offset(page);
    let (mut id, offset, oldsize) = index_item(page, offnum, upper, special)?;
    let oldsize = maxalign(oldsize);
    let newsize = maxalign(item.len());
    if newsize > oldsize + (upper - lower) || item.len() > usize::from(ItemId::MAX_FIELD) {
        return Err(corrupt(format!("no room to overwrite item {offnum} with {} bytes", item.len())));
    }
    let size_diff = oldsize as isize - newsize as isize;
    let new_upper = (upper as isize + size_diff) as usize;
    if size_diff != 0 {
        if offset > upper {
            page.copy_within(upper..offset, new_upper);
        }
        page::set_pd_upper(page, new_upper as u16);
        adjust_offsets(page, itemcount, offset, size_diff, true)?;
    }
    let new_off = (offset as isize + size_diff) as usize;
    id.off = new_off as u16;
    id.len = item.len() as u16;
    set_item_id(page, offnum, id)?;
    page.get_mut(new_off..new_off + item.len())
        .ok_or_else(|| corrupt("overwritten item past the page"))?
        .copy_from_slice(item);
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fresh(special: usize) -> Box<Page> {
        let mut page = Box::new([0u8; BLCKSZ]);
        page_init(&mut page, special);
        page
    }

    /// A heap page with items of the given lengths added in order, each filled with its number.
    fn with_items(lens: &[usize]) -> Box<Page> {
        let mut page = fresh(0);
        for (i, len) in lens.iter().enumerate() {
            page_add_item(&mut page, &vec![i as u8 + 1; *len], 0, false, true).unwrap();
        }
        page
    }

    fn lp(page: &Page, off: u16) -> (u16, u8, u16) {
        let id = item_id(page, off).unwrap();
        (id.off, id.flags, id.len)
    }

    fn bounds(page: &Page) -> (u16, u16, u16) {
        (page::pd_lower(page), page::pd_upper(page), page::pd_special(page))
    }

    #[test]
    fn page_init_with_special_space_sets_an_empty_header() {
        let page = fresh(13);
        assert_eq!(bounds(&page), (24, 8176, 8176));
        assert_eq!(page::pd_pagesize_version(&page), 0x2004);
        assert!(!page_is_new(&page) && page_is_new(&[0u8; BLCKSZ]));
        assert_eq!(page_get_max_offset(&page), 0);
    }

    #[test]
    fn page_add_item_appends_at_the_top_of_free_space() {
        let mut page = fresh(0);
        assert_eq!(page_add_item(&mut page, &[7; 10], 0, false, true).unwrap(), 1);
        assert_eq!(page_add_item(&mut page, &[8; 20], 0, false, true).unwrap(), 2);
        assert_eq!(lp(&page, 1), (8176, LP_NORMAL, 10));
        assert_eq!(lp(&page, 2), (8152, LP_NORMAL, 20));
        assert_eq!(bounds(&page), (32, 8152, 8192));
        assert_eq!(page_get_item(&page, 2).unwrap(), &[8; 20]);
        assert_eq!(&page[8176..8186], &[7; 10]);
    }

    #[test]
    fn page_add_item_without_overwrite_shuffles_later_line_pointers() {
        let mut page = with_items(&[8, 8]);
        assert_eq!(page_add_item(&mut page, &[9; 8], 1, false, false).unwrap(), 1);
        assert_eq!(lp(&page, 1), (8168, LP_NORMAL, 8));
        assert_eq!(lp(&page, 2), (8184, LP_NORMAL, 8));
        assert_eq!(lp(&page, 3), (8176, LP_NORMAL, 8));
        assert_eq!(bounds(&page).0, 36);
    }

    #[test]
    fn page_add_item_overwrite_refuses_a_used_slot_and_fills_an_unused_one() {
        let mut page = with_items(&[8, 8]);
        assert!(page_add_item(&mut page, &[9; 8], 1, true, true).is_err());
        assert!(page_add_item(&mut page, &[9; 8], 4, true, true).is_err(), "past limit");
        set_item_id(&mut page, 1, ItemId::UNUSED).unwrap();
        assert_eq!(page_add_item(&mut page, &[9; 8], 1, true, true).unwrap(), 1);
        assert_eq!(lp(&page, 1), (8168, LP_NORMAL, 8));
        assert_eq!(bounds(&page).0, 32, "no new line pointer");
    }

    #[test]
    fn page_add_item_takes_a_free_line_pointer_only_when_hinted() {
        let mut page = with_items(&[8, 8]);
        set_item_id(&mut page, 1, ItemId::UNUSED).unwrap();
        assert_eq!(page_add_item(&mut page, &[9; 8], 0, false, true).unwrap(), 3, "no hint");
        set_pd_flags(&mut page, PD_HAS_FREE_LINES);
        assert_eq!(page_add_item(&mut page, &[9; 8], 0, false, true).unwrap(), 1);
        assert_eq!(page::pd_flags(&page), PD_HAS_FREE_LINES, "the hint stays");
        assert_eq!(page_add_item(&mut page, &[9; 8], 0, false, true).unwrap(), 4);
        assert_eq!(page::pd_flags(&page), 0, "a wrong hint is cleared");
    }

    #[test]
    fn page_add_item_without_room_or_past_the_heap_limit_fails() {
        let mut page = fresh(0);
        assert!(page_add_item(&mut page, &[0; 8161], 0, false, true).is_err());
        assert_eq!(page_add_item(&mut page, &[0; 8160], 0, false, true).unwrap(), 1);
        let mut page = fresh(0);
        page::set_pd_lower(&mut page, 24 + 4 * MAX_HEAP_TUPLES_PER_PAGE);
        assert!(page_add_item(&mut page, &[0; 1], 0, false, true).is_err());
        assert!(page_add_item(&mut page, &[0; 1], 0, false, false).is_ok());
        page::set_pd_upper(&mut page, 10);
        assert!(page_add_item(&mut page, &[0; 1], 0, false, false).is_err(), "corrupt pointers");
    }

    #[test]
    fn repair_fragmentation_presorted_closes_gaps_and_hints_free_lines() {
        let mut page = with_items(&[8, 16, 8]);
        // lp1 8184, lp2 8168, lp3 8160
        set_item_id(&mut page, 2, ItemId { off: 8168, flags: LP_UNUSED, len: 16 }).unwrap();
        page_repair_fragmentation(&mut page).unwrap();
        assert_eq!(lp(&page, 1), (8184, LP_NORMAL, 8));
        assert_eq!(lp(&page, 2), (0, LP_UNUSED, 0), "zeroed");
        assert_eq!(lp(&page, 3), (8176, LP_NORMAL, 8));
        assert_eq!(&page[8176..8184], &[3; 8]);
        assert_eq!(bounds(&page), (36, 8176, 8192));
        assert_eq!(page::pd_flags(&page) & PD_HAS_FREE_LINES, PD_HAS_FREE_LINES);
    }

    #[test]
    fn repair_fragmentation_not_presorted_lays_tuples_in_line_pointer_order() {
        let mut page = with_items(&[8, 8, 8, 8]);
        // Swap where lp1 and lp2 point: lp1 -> 8176 (bytes 2), lp2 -> 8184 (bytes 1).
        set_item_id(&mut page, 1, ItemId { off: 8176, flags: LP_NORMAL, len: 8 }).unwrap();
        set_item_id(&mut page, 2, ItemId { off: 8184, flags: LP_NORMAL, len: 8 }).unwrap();
        set_item_id(&mut page, 3, ItemId { off: 0, flags: crate::page::LP_DEAD, len: 0 }).unwrap();
        page_repair_fragmentation(&mut page).unwrap();
        assert_eq!(lp(&page, 1), (8184, LP_NORMAL, 8));
        assert_eq!(lp(&page, 2), (8176, LP_NORMAL, 8));
        assert_eq!(lp(&page, 4), (8168, LP_NORMAL, 8));
        assert_eq!(
            (&page[8184..8192], &page[8176..8184], &page[8168..8176]),
            (&[2u8; 8][..], &[1u8; 8][..], &[4u8; 8][..])
        );
        assert_eq!(bounds(&page), (40, 8168, 8192));
        assert_eq!(page::pd_flags(&page) & PD_HAS_FREE_LINES, 0, "dead is not unused");
    }

    #[test]
    fn repair_fragmentation_not_presorted_with_few_survivors_copies_each_through_scratch() {
        let mut page = with_items(&[8; 12]);
        // Offsets: lp n at 8192 - 8n. Keep lp 3 (pointing at lp 11's bytes) and lp 9 (at lp 2's).
        for n in 1..=12 {
            set_item_id(&mut page, n, ItemId { off: 0, flags: crate::page::LP_DEAD, len: 0 }).unwrap();
        }
        set_item_id(&mut page, 3, ItemId { off: 8192 - 88, flags: LP_NORMAL, len: 8 }).unwrap();
        set_item_id(&mut page, 9, ItemId { off: 8192 - 16, flags: LP_NORMAL, len: 8 }).unwrap();
        page_repair_fragmentation(&mut page).unwrap();
        assert_eq!(lp(&page, 3), (8184, LP_NORMAL, 8));
        assert_eq!(lp(&page, 9), (8176, LP_NORMAL, 8));
        assert_eq!((&page[8184..8192], &page[8176..8184]), (&[11u8; 8][..], &[2u8; 8][..]));
        assert_eq!(bounds(&page), (72, 8176, 8192));
    }

    #[test]
    fn repair_fragmentation_truncates_trailing_unused_line_pointers() {
        let mut page = with_items(&[8, 8, 8]);
        set_pd_flags(&mut page, PD_HAS_FREE_LINES);
        set_item_id(&mut page, 2, ItemId::UNUSED).unwrap();
        set_item_id(&mut page, 3, ItemId::UNUSED).unwrap();
        page_repair_fragmentation(&mut page).unwrap();
        assert_eq!(bounds(&page), (28, 8184, 8192));
        assert_eq!(page::pd_flags(&page), 0);
        set_item_id(&mut page, 1, ItemId::UNUSED).unwrap();
        page_repair_fragmentation(&mut page).unwrap();
        assert_eq!(bounds(&page), (24, 8192, 8192));
    }

    #[test]
    fn repair_fragmentation_rejects_a_pointer_outside_the_tuples() {
        let mut page = with_items(&[8]);
        set_item_id(&mut page, 1, ItemId { off: 100, flags: LP_NORMAL, len: 8 }).unwrap();
        assert!(page_repair_fragmentation(&mut page).is_err());
    }

    #[test]
    fn truncate_line_pointer_array_keeps_one_and_hints_inner_unused() {
        let mut page = with_items(&[8, 8, 8, 8]);
        for off in [2, 3, 4] {
            set_item_id(&mut page, off, ItemId::UNUSED).unwrap();
        }
        page_truncate_line_pointer_array(&mut page);
        assert_eq!((bounds(&page).0, page::pd_flags(&page)), (28, 0));
        let mut page = with_items(&[8, 8, 8]);
        set_item_id(&mut page, 1, ItemId::UNUSED).unwrap();
        set_item_id(&mut page, 3, ItemId::UNUSED).unwrap();
        page_truncate_line_pointer_array(&mut page);
        assert_eq!((bounds(&page).0, page::pd_flags(&page)), (32, PD_HAS_FREE_LINES));
        let mut page = with_items(&[8]);
        set_item_id(&mut page, 1, ItemId::UNUSED).unwrap();
        page_truncate_line_pointer_array(&mut page);
        assert_eq!((bounds(&page).0, page::pd_flags(&page)), (28, PD_HAS_FREE_LINES), "never to zero");
    }

    #[test]
    fn index_tuple_delete_removes_the_pointer_and_shifts_tuples_before_it() {
        let mut page = fresh(16);
        for (i, len) in [8usize, 16, 8].iter().enumerate() {
            page_add_item(&mut page, &vec![i as u8 + 1; *len], 0, false, false).unwrap();
        }
        // lp1 8168, lp2 8152, lp3 8144
        page_index_tuple_delete(&mut page, 2).unwrap();
        assert_eq!(bounds(&page), (32, 8160, 8176));
        assert_eq!(lp(&page, 1), (8168, LP_NORMAL, 8));
        assert_eq!(lp(&page, 2), (8160, LP_NORMAL, 8));
        assert_eq!(page_get_item(&page, 2).unwrap(), &[3; 8]);
        assert!(page_index_tuple_delete(&mut page, 3).is_err());
        assert!(page_index_tuple_delete(&mut page, 0).is_err());
    }

    #[test]
    fn index_multi_delete_compacts_the_survivors() {
        let mut page = fresh(16);
        for i in 0..5u8 {
            page_add_item(&mut page, &[i + 1; 8], 0, false, false).unwrap();
        }
        page_index_multi_delete(&mut page, &[1, 3, 4]).unwrap();
        assert_eq!(bounds(&page), (32, 8160, 8176));
        assert_eq!(lp(&page, 1), (8168, LP_NORMAL, 8));
        assert_eq!(lp(&page, 2), (8160, LP_NORMAL, 8));
        assert_eq!(
            (page_get_item(&page, 1).unwrap(), page_get_item(&page, 2).unwrap()),
            (&[2u8; 8][..], &[5u8; 8][..])
        );
        assert!(page_index_multi_delete(&mut page, &[2, 1, 1]).is_err(), "out of order");
        let mut page = fresh(16);
        for i in 0..3u8 {
            page_add_item(&mut page, &[i + 1; 8], 0, false, false).unwrap();
        }
        page_index_multi_delete(&mut page, &[1, 3]).unwrap();
        assert_eq!(bounds(&page), (28, 8168, 8176));
        assert_eq!(page_get_item(&page, 1).unwrap(), &[2; 8]);
    }

    #[test]
    fn index_tuple_delete_no_compact_leaves_an_unused_pointer_except_the_last() {
        let mut page = fresh(16);
        for i in 0..3u8 {
            page_add_item(&mut page, &[i + 1; 8], 0, false, false).unwrap();
        }
        page_index_tuple_delete_no_compact(&mut page, 2).unwrap();
        assert_eq!(bounds(&page), (36, 8160, 8176));
        assert_eq!(lp(&page, 2), (0, LP_UNUSED, 0));
        assert_eq!(lp(&page, 3), (8160, LP_NORMAL, 8));
        page_index_tuple_delete_no_compact(&mut page, 3).unwrap();
        assert_eq!(bounds(&page), (32, 8168, 8176));
    }

    #[test]
    fn index_tuple_overwrite_grows_and_shrinks_in_place() {
        let mut page = fresh(16);
        for i in 0..3u8 {
            page_add_item(&mut page, &[i + 1; 8], 0, false, false).unwrap();
        }
        // lp1 8168, lp2 8160, lp3 8152
        page_index_tuple_overwrite(&mut page, 2, &[9; 20]).unwrap();
        assert_eq!(bounds(&page), (36, 8136, 8176));
        assert_eq!(lp(&page, 2), (8144, LP_NORMAL, 20));
        assert_eq!(lp(&page, 3), (8136, LP_NORMAL, 8));
        assert_eq!(lp(&page, 1), (8168, LP_NORMAL, 8));
        assert_eq!(page_get_item(&page, 3).unwrap(), &[3; 8]);
        page_index_tuple_overwrite(&mut page, 2, &[7; 3]).unwrap();
        assert_eq!(bounds(&page), (36, 8152, 8176));
        assert_eq!(lp(&page, 2), (8160, LP_NORMAL, 3));
        assert_eq!(page_get_item(&page, 3).unwrap(), &[3; 8]);
        assert!(page_index_tuple_overwrite(&mut page, 1, &[0; 8200]).is_err());
    }

    proptest! {
        #[test]
        fn bufpage_functions_never_panic_on_random_pages(
            header in proptest::collection::vec(any::<u8>(), 24),
            lps in proptest::collection::vec(any::<u32>(), 0..40),
            off in any::<u16>(),
            offs in proptest::collection::vec(0u16..45, 0..6),
            item in proptest::collection::vec(any::<u8>(), 0..64),
            which in 0u8..7,
        ) {
            let mut page = Box::new([0u8; BLCKSZ]);
            page[..24].copy_from_slice(&header);
            for (i, raw) in lps.iter().enumerate() {
                page[24 + 4 * i..28 + 4 * i].copy_from_slice(&raw.to_le_bytes());
            }
            let off = off % 50;
            let _ = match which {
                0 => page_add_item(&mut page, &item, off, off % 2 == 0, off % 3 == 0).map(|_| ()),
                1 => page_repair_fragmentation(&mut page),
                2 => { page_truncate_line_pointer_array(&mut page); Ok(()) }
                3 => page_index_tuple_delete(&mut page, off),
                4 => page_index_multi_delete(&mut page, &offs),
                5 => page_index_tuple_delete_no_compact(&mut page, off),
                _ => page_index_tuple_overwrite(&mut page, off, &item),
            };
            let _ = page_get_item(&page, off);
        }

        #[test]
        fn repair_fragmentation_on_sane_pages_keeps_every_tuple(
            lens in proptest::collection::vec(1usize..200, 1..30),
            kill in proptest::collection::vec(any::<bool>(), 30),
        ) {
            let mut page = fresh(0);
            let mut want = Vec::new();
            for (i, len) in lens.iter().enumerate() {
                if page_add_item(&mut page, &vec![i as u8; *len], 0, false, true).is_err() {
                    break;
                }
                want.push((i as u16 + 1, vec![i as u8; *len]));
            }
            for (n, _) in want.clone() {
                if kill[usize::from(n) - 1] {
                    set_item_id(&mut page, n, ItemId::UNUSED).unwrap();
                }
            }
            page_repair_fragmentation(&mut page).unwrap();
            let mut upper = BLCKSZ;
            for (n, bytes) in want {
                if n > page_get_max_offset(&page) || item_id(&page, n).unwrap().flags == LP_UNUSED {
                    continue;
                }
                upper -= maxalign(bytes.len());
                prop_assert_eq!(usize::from(item_id(&page, n).unwrap().off), upper);
                prop_assert_eq!(page_get_item(&page, n).unwrap(), &bytes[..]);
            }
            prop_assert_eq!(usize::from(page::pd_upper(&page)), upper);
        }
    }
}
