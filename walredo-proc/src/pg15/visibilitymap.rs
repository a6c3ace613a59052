//! The visibility map's pages (PostgreSQL 15's `visibilitymap.c`): the bits Heap2 VISIBLE sets
//! on the map page (its block 0), the derived [`VmClear`] of heap records that clear bits
//! (`visibilitymap_clear` in `heap_xlog_delete`, `_insert`, `_update`, `_lock`, ...), and the
//! derived [`VmTruncate`] of an SMGR truncate (`visibilitymap_prepare_truncate`: the bits of
//! the cut-off heap blocks on the map page that stays are cleared; the LSN is not changed).
//!
//! A map page holds 2 bits per heap block (`VISIBILITYMAP_ALL_VISIBLE`, `_ALL_FROZEN`) in the
//! 8168 bytes after its header: heap block `b` is in byte `(b % 32672) / 4`, at bit
//! `2 * (b % 4)`.
//!
//! **As PostgreSQL does:** a map page that is new (`pd_upper == 0`, e.g. all zeros, the state
//! of a block the map fork was extended with but never written) or whose header is not sane
//! (`RBM_ZERO_ON_ERROR` zeroes it) is `PageInit`ed before the bits are set or cleared
//! (`vm_readbuf`, `heap_xlog_visible`). Setting bits sets the page's LSN only when a bit changed
//! (`visibilitymap_set`); clearing bits never changes the LSN (`visibilitymap_clear` does not
//! WAL-log), but the page is still initialised if it was new.
//!
//! Invariants: pure; nothing panics on any record or page.

use super::bufpage;
use super::{RedoError, Target, VmClear, VmTruncate, HEAPBLOCKS_PER_VM_PAGE};
use crate::page::{self, maxalign, Page, BLCKSZ, PAGE_HEADER_SIZE};

/// `VISIBILITYMAP_VALID_BITS`.
const VALID_BITS: u8 = 0x03;
const HEAPBLOCKS_PER_BYTE: u32 = 4;
/// `PD_VALID_FLAG_BITS`.
const PD_VALID_FLAG_BITS: u16 = 0x0007;

/// The map byte and the shift of heap block `heap_blk`'s bits within its map page.
fn locate(heap_blk: u32) -> (usize, u32) {
    let in_page = heap_blk % HEAPBLOCKS_PER_VM_PAGE;
    let byte = maxalign(PAGE_HEADER_SIZE) + (in_page / HEAPBLOCKS_PER_BYTE) as usize;
    (byte, (heap_blk % HEAPBLOCKS_PER_BYTE) * 2)
}

/// What the buffer manager and `vm_readbuf` make of the page before the map code sees it:
/// a header that fails `PageIsVerified`'s sanity checks is zeroed (`RBM_ZERO_ON_ERROR`), and a
/// new page is initialised.
fn read_map_page(page: &mut Page) {
    let (flags, lower, upper, special) =
        (page::pd_flags(page), page::pd_lower(page), page::pd_upper(page), page::pd_special(page));
    let sane = flags & !PD_VALID_FLAG_BITS == 0
        && lower <= upper
        && upper <= special
        && usize::from(special) <= BLCKSZ
        && usize::from(special) == maxalign(usize::from(special));
    if !bufpage::page_is_new(page) && !sane {
        page.fill(0);
    }
    if bufpage::page_is_new(page) {
        bufpage::page_init(page, 0);
    }
}

/// `heap_xlog_visible`'s map page (block 0): sets the record's bits for the heap block of
/// block 1 (`visibilitymap_set`).
pub fn redo_visible(t: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let main = t.record.main_data;
    let Some(&flags) = main.get(4) else {
        return Err(RedoError::Malformed(format!(
            "{}: main data of {} bytes, shorter than 5",
            t.type_name(),
            main.len()
        )));
    };
    let Some(heap) = t.record.blocks.iter().find(|b| b.id == 1) else {
        return Err(RedoError::Malformed(format!("{}: no heap block (block 1)", t.type_name())));
    };
    if heap.blkno / HEAPBLOCKS_PER_VM_PAGE != t.block.blkno {
        return Err(RedoError::Malformed(format!(
            "{}: heap block {} is not on map page {}",
            t.type_name(),
            heap.blkno,
            t.block.blkno
        )));
    }
    read_map_page(page);
    let flags = flags & VALID_BITS;
    let (byte, shift) = locate(heap.blkno);
    if flags != (page[byte] >> shift) & VALID_BITS {
        page[byte] |= flags << shift;
        if t.record.end_lsn > page::page_lsn(page) {
            page::set_page_lsn(page, t.record.end_lsn);
        }
    }
    Ok(())
}

/// The derived map-bit clears of a heap record: for each (heap block, bits), those bits
/// cleared; the LSN is left as it is.
pub fn apply_clear(clear: &VmClear, page: &mut Page) -> Result<(), RedoError> {
    read_map_page(page);
    for &(heap_blk, bits) in &clear.clears {
        let (byte, shift) = locate(heap_blk);
        let mask = (bits & VALID_BITS) << shift;
        if page[byte] & mask != 0 {
            page[byte] &= !mask;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn clear(clears: Vec<(u32, u8)>) -> VmClear {
        VmClear { rmid: 10, info: 0x10, lsn: 0x100, end_lsn: 0x140, clears }
    }

    #[test]
    fn clear_on_a_corrupt_header_zeroes_and_initialises_the_page() {
        let mut page = Box::new([0xFFu8; BLCKSZ]);
        apply_clear(&clear(vec![(0, 3)]), &mut page).expect("applies");
        assert_eq!((page::pd_lower(&page), page::pd_upper(&page), page::page_lsn(&page)), (24, 8192, 0));
        assert!(page[24..].iter().all(|&b| b == 0));
    }

    #[test]
    fn clear_takes_only_the_named_bits_of_the_block_modulo_the_page() {
        let mut page = Box::new([0u8; BLCKSZ]);
        bufpage::page_init(&mut page, 0);
        page::set_page_lsn(&mut page, 0x99);
        page[24 + 8167] = 0xFF;
        let last = HEAPBLOCKS_PER_VM_PAGE * 3 - 1; // the last block of map page 2
        apply_clear(&clear(vec![(last, VALID_BITS), (last - 1, 0x02)]), &mut page).expect("applies");
        assert_eq!(page[24 + 8167], 0b0001_1111);
        assert_eq!(page::page_lsn(&page), 0x99, "clears leave the LSN");
    }

    proptest! {
        #[test]
        fn clears_never_panic_on_random_pages(
            noise in proptest::collection::vec((0usize..BLCKSZ, any::<u8>()), 0..64),
            clears in proptest::collection::vec((any::<u32>(), any::<u8>()), 0..20),
        ) {
            let mut page = Box::new([0u8; BLCKSZ]);
            for (at, b) in noise {
                page[at] = b;
            }
            prop_assert!(apply_clear(&clear(clears), &mut page).is_ok());
        }
    }
}

/// The map's bytes start after the page header (`PageGetContents`: MAXALIGN(24)).
const MAP_START: usize = 24;

/// [`VmTruncate`]: clears every bit of the heap blocks from `heap_blocks` on that this map
/// page holds (the tail of its byte for a block inside one, and every byte after it); a new
/// page is initialised first, as `vm_readbuf` does.
pub fn apply_truncate(t: &VmTruncate, page: &mut Page) -> Result<(), RedoError> {
    read_map_page(page);
    let within = t.heap_blocks % HEAPBLOCKS_PER_VM_PAGE;
    // Four heap blocks a byte, two bits each.
    let byte = MAP_START + (within / 4) as usize;
    let bit = (within % 4) * 2;
    let Some(first) = page.get_mut(byte) else {
        return Err(RedoError::DoesNotFit(format!("{}: map byte {byte} past the page", t.type_name())));
    };
    *first &= (1u8 << bit) - 1;
    if let Some(rest) = page.get_mut(byte + 1..) {
        rest.fill(0);
    }
    Ok(())
}

#[cfg(test)]
mod truncate_tests {
    use super::*;

    #[test]
    fn a_truncate_inside_a_byte_keeps_the_bits_of_the_blocks_before_it_only() {
        let mut page = [0xFFu8; 8192];
        bufpage::page_init(&mut page, 0);
        page[MAP_START..].fill(0xFF);
        page[..8].fill(0xFF);
        // 32672 + 6: map page 1, byte 1 (blocks 4..8), two blocks kept in it (4 bits).
        apply_truncate(&VmTruncate { lsn: 1, end_lsn: 2, heap_blocks: 32_678 }, &mut page).unwrap();
        assert_eq!(page[MAP_START], 0xFF);
        assert_eq!(page[MAP_START + 1], 0x0F);
        assert!(page[MAP_START + 2..].iter().all(|b| *b == 0));
        assert_eq!(&page[..8], &[0xFF; 8], "the page LSN stays");
    }
}
