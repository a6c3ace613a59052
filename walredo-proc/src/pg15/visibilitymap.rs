//! The visibility map's pages (PostgreSQL 15's `visibilitymap.c`): the bits of VISIBLE on the
//! map page, the derived [`VmClear`] of heap records, and the derived [`VmTruncate`] of an SMGR
//! truncate (`visibilitymap_prepare_truncate`: the bits of the cut-off heap blocks on the map
//! page that stays are cleared; the page's LSN is not changed).
//!
//! Not applied yet (each is `Unsupported`).

use super::redo::RedoError;
use super::{VmClear, VmTruncate, HEAPBLOCKS_PER_VM_PAGE};
use crate::page::Page;

pub fn apply_clear(clear: &VmClear, _page: &mut Page) -> Result<(), RedoError> {
    Err(RedoError::Unsupported(clear.type_name()))
}

/// The map's bytes start after the page header (`PageGetContents`: MAXALIGN(24)).
const MAP_START: usize = 24;

/// [`VmTruncate`]: clears every bit of the heap blocks from `heap_blocks` on that this map
/// page holds (the tail of its byte for a block inside one, and every byte after it).
pub fn apply_truncate(t: &VmTruncate, page: &mut Page) -> Result<(), RedoError> {
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
        // 32672 + 6: map page 1, byte 1 (blocks 4..8), two blocks kept in it (4 bits).
        apply_truncate(&VmTruncate { lsn: 1, end_lsn: 2, heap_blocks: 32_678 }, &mut page).unwrap();
        assert_eq!(page[MAP_START], 0xFF);
        assert_eq!(page[MAP_START + 1], 0x0F);
        assert!(page[MAP_START + 2..].iter().all(|b| *b == 0));
        assert_eq!(&page[..8], &[0xFF; 8], "the page LSN stays");
    }
}
