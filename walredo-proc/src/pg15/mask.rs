//! PostgreSQL 15's page masks (`rm_mask`): what a page may differ in after redo without being
//! wrong, as `wal_consistency_checking` compares a replayed page with the primary's.
//!
//! `heap_mask` (heapam.c), `btree_mask` (nbtxlog.c), `gin_mask` (ginxlog.c), `gist_mask` (gistxlog.c), `hash_mask`
//! (hash_xlog.c), `seq_mask`
//! (sequence.c), `generic_mask` (generic_xlog.c), `brin_mask` (brin_xlog.c) and `spg_mask` (spgxlog.c), with the `bufmask.c` helpers they call.
//! The redo child does not use them; they live beside the redo routines (as PostgreSQL keeps
//! each `rm_mask` beside its `rm_redo`) so that every checker of this redo masks alike:
//! `pagectl redocheck` and `pagectl chain`, and the `pg15-*` workloads of `bench_walredo`.
//!
//! Invariants: pure, no I/O; never panics on any 8 KiB page (a header that is not sane masks
//! less, never reads out of bounds).

use crate::page::BLCKSZ;

use super::brin::{BRIN_EVACUATE_PAGE, BRIN_PAGETYPE_META, BRIN_PAGETYPE_REGULAR};
use super::redo::{
    RM_BRIN, RM_BTREE, RM_GENERIC, RM_GIN, RM_GIST, RM_HASH, RM_HEAP, RM_HEAP2, RM_SEQ, RM_SPGIST,
};

/// Masks `page` as PostgreSQL masks the pages of `rmid`'s records (its `rm_mask`), LSN and
/// checksum only for a resource manager without one here.
pub fn mask(rmid: u8, page: &mut [u8]) {
    if page.len() != BLCKSZ {
        return;
    }
    match rmid {
        RM_HEAP | RM_HEAP2 => heap_mask(page),
        RM_BTREE => btree_mask(page),
        RM_GIN => gin_mask(page),
        RM_GIST => gist_mask(page),
        RM_HASH => hash_mask(page),
        RM_SEQ => seq_mask(page),
        RM_GENERIC => generic_mask(page),
        RM_BRIN => brin_mask(page),
        RM_SPGIST => spg_mask(page),
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

/// `hash_mask` (PostgreSQL 15's hash_xlog.c): LSN, checksum, hint bits, the hole; everything
/// after the header of an unused page (`mask_page_content`, `pd_lower` and `pd_upper` too);
/// the line pointer flags of bucket and overflow pages (LP_DEAD is set without WAL); and
/// `LH_PAGE_HAS_DEAD_TUPLES`. The special space is read where `pd_special` says, as PostgreSQL
/// does (on an all-zeros page that is the header's `pd_lower`); one that would not fit in the
/// page is left as it is.
pub fn hash_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    mask_unused_space(page);
    let special = u16_at(page, 16);
    if special + 16 > BLCKSZ {
        return;
    }
    let flag_at = special + 12;
    match u16_at(page, flag_at) & 0x0F {
        // LH_UNUSED_PAGE: mask_page_content.
        0 => {
            page[24..].fill(0);
            page[12..16].fill(0);
        }
        // LH_BUCKET_PAGE, LH_OVERFLOW_PAGE.
        0x02 | 0x01 => mask_lp_flags(page),
        _ => {}
    }
    let flag = u16_at(page, flag_at) as u16 & !0x80;
    page[flag_at..flag_at + 2].copy_from_slice(&flag.to_le_bytes());
}

/// `seq_mask` (sequence.c): LSN, checksum, the hole. (The tuple is compared whole: replay
/// rebuilds it from the record, as the primary wrote it when it logged it.)
pub fn seq_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_unused_space(page);
}

/// `generic_mask` (generic_xlog.c): LSN, checksum, the hole.
pub fn generic_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_unused_space(page);
}

/// `brin_mask` (brin_xlog.c): LSN, checksum, hint bits; the hole of a regular page, and of a
/// metapage whose `pd_lower` is past the header (a revmap page's entries lie in its "hole");
/// and `BRIN_EVACUATE_PAGE`, which is not WAL-logged. PostgreSQL 15 does not mask that flag,
/// later releases do: the tuple moves of an evacuation are UPDATE records whose old page the
/// primary had flagged (a PostgreSQL 15 standby checking them reports an inconsistent page).
pub fn brin_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    let special = u16_at(page, 16);
    if special < 24 || special + 8 > BLCKSZ {
        return;
    }
    let page_type = u16_at(page, special + 6) as u16;
    if page_type == BRIN_PAGETYPE_REGULAR || (page_type == BRIN_PAGETYPE_META && u16_at(page, 12) > 24) {
        mask_unused_space(page);
    }
    let flags = u16_at(page, special + 4) as u16 & !BRIN_EVACUATE_PAGE;
    page[special + 4..special + 6].copy_from_slice(&flags.to_le_bytes());
}

/// `spg_mask` (spgxlog.c): LSN, checksum, hint bits, the hole if `pd_lower` is set. And,
/// beyond PostgreSQL's, the metapage's cache of last-used pages, which SP-GiST updates without
/// WAL (no record touches the metapage, so `wal_consistency_checking` never compares it; a
/// page served against the data file's would differ there).
pub fn spg_mask(page: &mut [u8]) {
    use super::spgist::{META_CACHE, SPGIST_META, SPGIST_PAGE_ID};
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    mask_unused_space(page);
    let special = u16_at(page, 16);
    if special >= 24 && special + 8 <= BLCKSZ {
        let flags = u16_at(page, special) as u16;
        if flags & SPGIST_META != 0 && u16_at(page, special + 6) as u16 == SPGIST_PAGE_ID {
            page[META_CACHE].fill(0);
        }
    }
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
    fn seq_and_generic_masks_ignore_the_lsn_and_the_hole_only() {
        let mut page = vec![0u8; BLCKSZ];
        page[12..14].copy_from_slice(&28u16.to_le_bytes());
        page[14..16].copy_from_slice(&8136u16.to_le_bytes());
        page[16..18].copy_from_slice(&8184u16.to_le_bytes());
        for rmid in [RM_SEQ, RM_GENERIC] {
            let mut other = page.clone();
            other[3] = 1; // pd_lsn
            other[1000] = 1; // the hole
            assert_eq!(first_difference(rmid, &page, &other), None);
            other[20] = 1; // pd_prune_xid: not a hint here
            assert_eq!(first_difference(rmid, &page, &other), Some(20));
            other[20] = 0;
            other[8140] = 1; // the tuple
            assert_eq!(first_difference(rmid, &page, &other), Some(8140));
        }
    }

    #[test]
    fn brin_mask_ignores_the_hole_of_regular_pages_and_the_evacuate_flag_but_not_revmap_entries() {
        let brin_page = |page_type: u16| {
            let mut page = vec![0u8; BLCKSZ];
            page[12..14].copy_from_slice(&28u16.to_le_bytes());
            page[14..16].copy_from_slice(&8100u16.to_le_bytes());
            page[16..18].copy_from_slice(&8184u16.to_le_bytes());
            page[8190..8192].copy_from_slice(&page_type.to_le_bytes());
            page
        };
        let regular = brin_page(BRIN_PAGETYPE_REGULAR);
        let mut other = regular.clone();
        other[1000] = 1; // the hole
        other[8188] = 1; // BRIN_EVACUATE_PAGE
        other[10] = 0x02; // PD_PAGE_FULL
        assert_eq!(first_difference(RM_BRIN, &regular, &other), None);
        other[8189] = 1; // another flag
        assert_eq!(first_difference(RM_BRIN, &regular, &other), Some(8189));
        let revmap = brin_page(0xF092);
        let mut other = revmap.clone();
        other[1000] = 1; // a revmap entry: not masked
        assert_eq!(first_difference(RM_BRIN, &revmap, &other), Some(1000));
    }

    fn hash_page(flag: u16) -> Vec<u8> {
        let mut page = vec![0u8; BLCKSZ];
        for (at, v) in [(12, 28u16), (14, 8160), (16, 8176), (18, 0x2004)] {
            page[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        let lp: u32 = 8160 | (1 << 15) | (16 << 17);
        page[24..28].copy_from_slice(&lp.to_le_bytes());
        page[8160..8176].fill(7);
        page[8176 + 12..8176 + 14].copy_from_slice(&flag.to_le_bytes());
        page[8190..8192].copy_from_slice(&0xFF80u16.to_le_bytes());
        page
    }

    #[test]
    fn hash_mask_ignores_dead_marks_and_unused_pages_but_not_tuples() {
        let bucket = hash_page(0x02);
        let mut other = bucket.clone();
        let dead: u32 = 8160 | (3 << 15) | (16 << 17);
        other[24..28].copy_from_slice(&dead.to_le_bytes());
        other[8176 + 12] |= 0x80; // LH_PAGE_HAS_DEAD_TUPLES
        assert_eq!(first_difference(RM_HASH, &bucket, &other), None);
        other[8170] = 1;
        assert_eq!(first_difference(RM_HASH, &bucket, &other), Some(8170));
        // A bitmap page keeps its line pointer flags; a metapage its contents.
        let (bitmap, mut dead_bitmap) = (hash_page(0x04), hash_page(0x04));
        dead_bitmap[24..28].copy_from_slice(&dead.to_le_bytes());
        assert_eq!(first_difference(RM_HASH, &bitmap, &dead_bitmap), Some(26));
        // An unused page masks to its header, whatever it holds; an all-zero page masks to zeros.
        let (unused, mut other) = (hash_page(0), hash_page(0));
        other[100..8000].fill(9);
        assert_eq!(first_difference(RM_HASH, &unused, &other), None);
        let mut zeros = vec![0u8; BLCKSZ];
        hash_mask(&mut zeros);
        assert!(zeros.iter().all(|b| *b == 0));
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
        for rmid in [RM_HEAP, RM_HEAP2, RM_BTREE, RM_GIN, RM_GIST, RM_HASH, RM_SEQ, RM_GENERIC, RM_BRIN, 0] {
            mask(rmid, &mut page);
        }
        assert_eq!(&page[..10], &[0u8; 10]);
    }
}
