//! PostgreSQL 15's page masks (`rm_mask`): what a page may differ in after redo without being
//! wrong, as `wal_consistency_checking` compares a replayed page with the primary's.
//!
//! `heap_mask` (heapam.c), `btree_mask` (nbtxlog.c), `gin_mask` (ginxlog.c) and `gist_mask`
//! (gistxlog.c), with the
//! `bufmask.c` helpers they call.
//! The redo child does not use them; they live beside the redo routines (as PostgreSQL keeps
//! each `rm_mask` beside its `rm_redo`) so that every checker of this redo masks alike:
//! `pagectl redocheck` and `pagectl chain`, and the `pg15-*` workloads of `bench_walredo`.
//!
//! Invariants: pure, no I/O; never panics on any 8 KiB page (a header that is not sane masks
//! less, never reads out of bounds).

use crate::page::BLCKSZ;

use super::redo::{RM_BTREE, RM_GIN, RM_GIST, RM_HEAP, RM_HEAP2};

/// Masks `page` as PostgreSQL masks the pages of `rmid`'s records: `heap_mask` for Heap and
/// Heap2, `btree_mask` for Btree, `gin_mask` for Gin, `gist_mask` for Gist, LSN and checksum
/// only for any other resource manager.
pub fn mask(rmid: u8, page: &mut [u8]) {
    if page.len() != BLCKSZ {
        return;
    }
    match rmid {
        RM_HEAP | RM_HEAP2 => heap_mask(page),
        RM_BTREE => btree_mask(page),
        RM_GIN => gin_mask(page),
        RM_GIST => gist_mask(page),
        _ => mask_lsn_and_checksum(page),
    }
}

/// The first byte at which `ours` and `theirs` differ once both are masked for `rmid`;
/// `None` if they match.
pub fn first_difference(rmid: u8, ours: &[u8], theirs: &[u8]) -> Option<usize> {
    let mut a = ours.to_vec();
    let mut b = theirs.to_vec();
    mask(rmid, &mut a);
    mask(rmid, &mut b);
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b.iter()).position(|(x, y)| x != y)
}

fn u16_at(page: &[u8], at: usize) -> usize {
    page.get(at..at + 2).map_or(0, |b| usize::from(u16::from_le_bytes([b[0], b[1]])))
}

fn mask_lsn_and_checksum(page: &mut [u8]) {
    page[..8].fill(0);
    page[8..10].fill(0);
}

/// `mask_page_hint_bits`: pd_prune_xid, and PD_PAGE_FULL, PD_HAS_FREE_LINES, PD_ALL_VISIBLE.
fn mask_hint_bits(page: &mut [u8]) {
    page[20..24].fill(0);
    page[10] &= !0x07;
}

/// `mask_unused_space`: the hole between pd_lower and pd_upper, if the header is sane.
fn mask_unused_space(page: &mut [u8]) {
    let (lower, upper, special) = (u16_at(page, 12), u16_at(page, 14), u16_at(page, 16));
    if lower >= 24 && lower <= upper && upper <= special && special <= BLCKSZ {
        page[lower..upper].fill(0);
    }
}

/// The line pointers of a page: (offset, flags, length).
fn line_pointers(page: &[u8]) -> Vec<(usize, u8, usize)> {
    let lower = u16_at(page, 12).clamp(24, BLCKSZ);
    (24..lower)
        .step_by(4)
        .filter_map(|at| page.get(at..at + 4))
        .map(|b| {
            let raw = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            ((raw & 0x7fff) as usize, ((raw >> 15) & 3) as u8, (raw >> 17) as usize)
        })
        .collect()
}

/// `heap_mask` (heapam.c): LSN, checksum, hint bits, the hole; per normal tuple the infomask
/// hint bits (all transaction bits of a tuple whose xmin is not frozen; XMAX_INVALID and
/// XMAX_COMMITTED of a frozen one), t_cid, and the padding after each tuple.
pub fn heap_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    mask_unused_space(page);
    // (A speculative insertion's token in t_ctid is not masked: INSERT .. ON CONFLICT only.)
    for (off, flags, len) in line_pointers(page) {
        let has_storage = len > 0;
        if flags == 1 && off + 23 <= BLCKSZ {
            let infomask = u16_at(page, off + 20) as u16;
            let frozen = infomask & 0x0300 == 0x0300;
            let masked = if frozen { infomask & !0x0800 & !0x0400 } else { infomask & !0xFFF0 };
            page[off + 20..off + 22].copy_from_slice(&masked.to_le_bytes());
            page[off + 8..off + 12].fill(0);
        }
        if has_storage {
            let end = off + len;
            let padded = (end + 7) & !7;
            if padded <= BLCKSZ {
                page[end..padded].fill(0);
            }
        }
    }
}

/// `btree_mask` (PostgreSQL 15's nbtxlog.c): LSN, checksum, hint bits, the hole; a leaf's line
/// pointer flags; BTP_HAS_GARBAGE, BTP_SPLIT_END and the cycle id. (Before PostgreSQL 14 it also
/// masked a deleted page's content; 15 keeps it, with the page's safexid.)
pub fn btree_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    mask_unused_space(page);
    let special = u16_at(page, 16);
    if special + 16 > BLCKSZ || special < 24 {
        return;
    }
    let flags = u16_at(page, special + 12) as u16;
    if flags & 0x01 != 0 {
        mask_lp_flags(page);
    }
    let special = u16_at(page, 16);
    if special + 16 <= BLCKSZ && special >= 24 {
        let flags = u16_at(page, special + 12) as u16 & !0x40 & !0x20;
        page[special + 12..special + 14].copy_from_slice(&flags.to_le_bytes());
        page[special + 14..special + 16].fill(0);
    }
}

/// `mask_lp_flags`: every used line pointer's flags made `LP_UNUSED` (hint bits such as
/// `LP_DEAD` that an index sets without WAL).
fn mask_lp_flags(page: &mut [u8]) {
    let lower = u16_at(page, 12).clamp(24, BLCKSZ);
    for at in (24..lower).step_by(4) {
        if at + 4 <= BLCKSZ {
            let raw = u32::from_le_bytes([page[at], page[at + 1], page[at + 2], page[at + 3]]);
            if (raw >> 15) & 3 != 0 {
                let unused = raw & !(3 << 15);
                page[at..at + 4].copy_from_slice(&unused.to_le_bytes());
            }
        }
    }
}

/// `gin_mask` (ginxlog.c): LSN, checksum, hint bits (a deleted page's delete xid is in
/// `pd_prune_xid`); a deleted page's whole content and `pd_lower`/`pd_upper` (redo empties a
/// deleted pending-list page the primary only flags), else the hole if `pd_lower` is set.
pub fn gin_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    let special = u16_at(page, 16);
    let deleted = special >= 24
        && special + 8 <= BLCKSZ
        && u16_at(page, special + 6) as u16 & super::gin::GIN_DELETED != 0;
    if deleted {
        page[24..].fill(0);
        page[12..16].fill(0);
    } else if u16_at(page, 12) > 24 {
        mask_unused_space(page);
    }
}

/// `gist_mask` (gistxlog.c): LSN, checksum, hint bits, the hole; the NSN, `F_FOLLOW_RIGHT`
/// (set on both: the primary clears it on a split's left child after logging the record that
/// does it in redo), a leaf's line pointer flags, `F_HAS_GARBAGE` (redo never sets it).
pub fn gist_mask(page: &mut [u8]) {
    use super::gist::{F_FOLLOW_RIGHT, F_HAS_GARBAGE, F_LEAF};
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    mask_unused_space(page);
    let special = u16_at(page, 16);
    if special < 24 || special + 16 > BLCKSZ {
        return;
    }
    page[special..special + 8].fill(0);
    let flags = u16_at(page, special + 12) as u16 | F_FOLLOW_RIGHT;
    if flags & F_LEAF != 0 {
        mask_lp_flags(page);
    }
    page[special + 12..special + 14].copy_from_slice(&(flags & !F_HAS_GARBAGE).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_mask_ignores_hint_bits_of_unfrozen_tuples_but_not_their_data() {
        let mut page = vec![0u8; BLCKSZ];
        page[12..14].copy_from_slice(&28u16.to_le_bytes());
        page[14..16].copy_from_slice(&8000u16.to_le_bytes());
        page[16..18].copy_from_slice(&8192u16.to_le_bytes());
        // One normal tuple of 30 bytes at 8000.
        let lp: u32 = 8000 | (1 << 15) | (30 << 17);
        page[24..28].copy_from_slice(&lp.to_le_bytes());
        let mut other = page.clone();
        other[8000 + 21] = 0x01; // a hint bit: XMIN_COMMITTED, 0x0100 (t_infomask's high byte)
        other[8000 + 31] = 9; // padding after 30 bytes
        other[100] = 5; // the hole
        assert_eq!(first_difference(RM_HEAP, &page, &other), None);
        other[8000 + 25] = 1; // tuple data
        assert!(first_difference(RM_HEAP, &page, &other).is_some());
    }

    #[test]
    fn gist_mask_ignores_nsn_follow_right_garbage_and_leaf_lp_flags_but_not_the_rightlink() {
        let mut page = vec![0u8; BLCKSZ];
        page[12..14].copy_from_slice(&28u16.to_le_bytes());
        page[14..16].copy_from_slice(&8160u16.to_le_bytes());
        page[16..18].copy_from_slice(&8176u16.to_le_bytes());
        let lp: u32 = 8160 | (1 << 15) | (16 << 17);
        page[24..28].copy_from_slice(&lp.to_le_bytes());
        page[8176 + 12] = 0x01; // F_LEAF
        page[8176 + 14..8176 + 16].copy_from_slice(&0xFF81u16.to_le_bytes());
        let mut other = page.clone();
        other[8176..8184].copy_from_slice(&[0, 0, 0, 1, 0x28, 0, 0, 0]); // the NSN
        other[8176 + 12] |= 0x08 | 0x10; // F_FOLLOW_RIGHT, F_HAS_GARBAGE
        other[24 + 2] |= 0x01; // LP_NORMAL -> LP_DEAD: lp_flags' high bit
        assert_eq!(first_difference(RM_GIST, &page, &other), None);
        other[8176 + 12] |= 0x04; // F_TUPLES_DELETED is not masked
        assert_eq!(first_difference(RM_GIST, &page, &other), Some(8176 + 12));
        other[8176 + 12] &= !0x04;
        other[8176 + 8] = 7; // the rightlink
        assert_eq!(first_difference(RM_GIST, &page, &other), Some(8176 + 8));
        other[8176 + 8] = 0;
        page[8176 + 12] = 0; // an inner page keeps its line pointer flags
        other[8176 + 12] = 0;
        assert_eq!(first_difference(RM_GIST, &page, &other), Some(26));
    }

    #[test]
    fn gin_mask_ignores_a_deleted_pages_content_and_the_hole_but_not_a_live_pages_data() {
        let mut page = vec![0u8; BLCKSZ];
        page[12..14].copy_from_slice(&80u16.to_le_bytes());
        page[14..16].copy_from_slice(&8184u16.to_le_bytes());
        page[16..18].copy_from_slice(&8184u16.to_le_bytes());
        page[8184 + 6] = 0x08; // GIN_META
        let mut other = page.clone();
        other[20] = 9; // pd_prune_xid
        other[100] = 5; // the hole
        assert_eq!(first_difference(RM_GIN, &page, &other), None);
        other[60] = 1; // the metadata
        assert_eq!(first_difference(RM_GIN, &page, &other), Some(60));
        // Deleted: everything after the header but pd_special, pd_pagesize_version.
        page[8184 + 6] = 0x04;
        other[8184 + 6] = 0x04 | 0x10;
        other[12] = 24;
        other[8000] = 3;
        assert_eq!(first_difference(RM_GIN, &page, &other), None);
        other[18] = 1; // pd_pagesize_version
        assert_eq!(first_difference(RM_GIN, &page, &other), Some(18));
    }

    #[test]
    fn masks_never_panic_on_a_page_with_a_nonsense_header() {
        let mut page = vec![0xffu8; BLCKSZ];
        for rmid in [RM_HEAP, RM_HEAP2, RM_BTREE, RM_GIN, RM_GIST, 0] {
            mask(rmid, &mut page);
        }
        assert_eq!(&page[..10], &[0u8; 10]);
    }
}
