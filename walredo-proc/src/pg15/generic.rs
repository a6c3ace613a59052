//! Redo of Generic WAL records (PostgreSQL 15's `generic_redo`, `access/transam/generic_xlog.c`):
//! the resource manager of extensions that log whole-page changes without redo code of their
//! own (`bloom`, and any extension using `GenericXLogStart`/`GenericXLogFinish`).
//!
//! A record has one type and up to four blocks; each block's data is a delta of the page: a
//! list of fragments `offset u16 | length u16 | length bytes`, each copied to the page at its
//! offset. The delta says nothing about the hole between `pd_lower` and `pd_upper`, which
//! `GenericXLogFinish` zeroes on the primary: redo zeroes it too, then sets `pd_lsn`. A block
//! logged with `GENERIC_XLOG_FULL_IMAGE` carries a full-page image instead, which the daemon
//! stores as the block's image (it never reaches this module).
//!
//! Where PostgreSQL would read or write past the delta or the page on a corrupt record (it
//! checks nothing), or PANIC (a block marked `WILL_INIT`: `XLogReadBufferForRedo` refuses it),
//! this returns an error. Invariants: pure; never panics on any record or page.

use super::{RedoError, Target};
use crate::page::{self, Page, BLCKSZ};

/// Applies a Generic record to the page of its target block.
pub fn redo(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let malformed = |what: String| RedoError::Malformed(format!("{}: {what}", target.type_name()));
    if target.will_init() {
        return Err(malformed("a block marked WILL_INIT".into()));
    }
    let mut delta = target.data();
    while !delta.is_empty() {
        let (Some(offset), Some(length)) = (le_u16(delta, 0), le_u16(delta, 2)) else {
            return Err(malformed(format!("{} bytes left of the delta, no fragment header", delta.len())));
        };
        let (offset, length) = (usize::from(offset), usize::from(length));
        let Some(bytes) = delta.get(4..4 + length) else {
            return Err(malformed(format!("fragment at {offset} of {length} bytes past the delta's end")));
        };
        let Some(dest) = page.get_mut(offset..offset + length) else {
            return Err(malformed(format!("fragment at {offset} of {length} bytes past the page's end")));
        };
        dest.copy_from_slice(bytes);
        delta = &delta[4 + length..];
    }
    let (lower, upper) = (usize::from(page::pd_lower(page)), usize::from(page::pd_upper(page)));
    if lower > upper || upper > BLCKSZ {
        return Err(RedoError::DoesNotFit(format!(
            "{}: pd_lower {lower} above pd_upper {upper}: no hole to zero",
            target.type_name()
        )));
    }
    page[lower..upper].fill(0);
    page::set_page_lsn(page, target.record.end_lsn);
    Ok(())
}

fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at + 2)?;
    Some(u16::from_le_bytes([s[0], s[1]]))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::pg15::{bufpage, redo, BlockHeader, Pg15Record, FLAG_HAS_DATA, FLAG_WILL_INIT};
    use proptest::prelude::*;

    const END_LSN: u64 = 0x2_0000_0200;

    fn block(id: u8, flags: u8, data: &[u8]) -> BlockHeader<'_> {
        BlockHeader {
            id,
            flags,
            fork: 0,
            spcnode: 1663,
            dbnode: 5,
            relnode: 16500,
            blkno: 3 + u32::from(id),
            data,
        }
    }

    fn record<'a>(target: u8, blocks: Vec<BlockHeader<'a>>) -> Pg15Record<'a> {
        Pg15Record {
            rmid: redo::RM_GENERIC,
            info: 0,
            xid: 740,
            lsn: END_LSN - 0x80,
            end_lsn: END_LSN,
            target,
            blocks,
            main_data: &[],
        }
    }

    fn fragment(out: &mut Vec<u8>, offset: u16, bytes: &[u8]) {
        out.extend_from_slice(&offset.to_le_bytes());
        out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
        out.extend_from_slice(bytes);
    }

    fn apply(rec: &Pg15Record<'_>, page: &mut Page) -> Result<(), RedoError> {
        let mut bytes = Vec::new();
        rec.encode(&mut bytes).unwrap();
        redo::apply(&bytes, page).unwrap()
    }

    /// A bloom-like page: special space of 8, content growing `pd_lower` up, garbage in the hole.
    fn page_with_garbage_in_the_hole() -> Box<Page> {
        let mut page = Box::new([0u8; BLCKSZ]);
        bufpage::page_init(&mut page, 8);
        page::set_pd_lower(&mut page, 100);
        page[100..8184].fill(0xEE);
        page
    }

    #[test]
    fn fragments_are_copied_then_the_hole_is_zeroed_and_the_lsn_set() {
        let mut page = page_with_garbage_in_the_hole();
        let mut delta = Vec::new();
        // pd_lower moves up to 200 (the header is in the delta, as GenericXLogFinish logs it).
        fragment(&mut delta, 12, &200u16.to_le_bytes());
        fragment(&mut delta, 100, &[1u8; 100]);
        fragment(&mut delta, 8184, &[9, 8, 7, 6, 5, 4, 3, 2]);
        let rec = record(1, vec![block(0, FLAG_HAS_DATA, b"other"), block(1, FLAG_HAS_DATA, &delta)]);
        apply(&rec, &mut page).unwrap();
        assert_eq!(page::page_lsn(&page), END_LSN);
        assert_eq!(page::pd_lower(&page), 200);
        assert_eq!(&page[100..200], &[1u8; 100]);
        assert!(page[200..8184].iter().all(|b| *b == 0), "the hole is zeroed");
        assert_eq!(&page[8184..], &[9, 8, 7, 6, 5, 4, 3, 2]);
    }

    #[test]
    fn a_block_without_data_only_gets_its_hole_zeroed() {
        let mut page = page_with_garbage_in_the_hole();
        let rec = record(0, vec![block(0, 0, &[])]);
        apply(&rec, &mut page).unwrap();
        assert!(page[100..8184].iter().all(|b| *b == 0));
        assert_eq!(page::pd_lower(&page), 100);
    }

    #[test]
    fn a_page_already_past_the_record_is_left_alone() {
        let mut page = page_with_garbage_in_the_hole();
        page::set_page_lsn(&mut page, END_LSN);
        let before = page.clone();
        let mut delta = Vec::new();
        fragment(&mut delta, 100, &[1u8; 4]);
        apply(&record(0, vec![block(0, FLAG_HAS_DATA, &delta)]), &mut page).unwrap();
        assert_eq!(page, before);
    }

    #[test]
    fn corrupt_deltas_and_pages_are_errors() {
        let mut page = page_with_garbage_in_the_hole();
        let mut past_page = Vec::new();
        fragment(&mut past_page, 8190, &[1, 2, 3]);
        let mut past_delta = Vec::new();
        fragment(&mut past_delta, 100, &[1, 2, 3]);
        past_delta.truncate(past_delta.len() - 1);
        for delta in [&past_page[..], &past_delta[..], &[1, 0, 0][..]] {
            let rec = record(0, vec![block(0, FLAG_HAS_DATA, delta)]);
            assert!(matches!(apply(&rec, &mut page), Err(RedoError::Malformed(_))), "{delta:?}");
        }
        let rec = record(0, vec![block(0, FLAG_HAS_DATA | FLAG_WILL_INIT, &[])]);
        assert!(matches!(apply(&rec, &mut page), Err(RedoError::Malformed(_))));
        let mut upside_down = Vec::new();
        fragment(&mut upside_down, 12, &[0xFF, 0x1F, 0x10, 0x00]);
        let rec = record(0, vec![block(0, FLAG_HAS_DATA, &upside_down)]);
        assert!(matches!(apply(&rec, &mut page), Err(RedoError::DoesNotFit(_))));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_deltas_on_random_and_valid_pages_never_panic(
            data in proptest::collection::vec(any::<u8>(), 0..300),
            frags in proptest::collection::vec((any::<u16>(), proptest::collection::vec(any::<u8>(), 0..40)), 0..6),
            header in proptest::collection::vec(any::<u8>(), 24),
            valid in any::<bool>(),
            flags in any::<u8>(),
        ) {
            let mut page = page_with_garbage_in_the_hole();
            if !valid {
                page[..24].copy_from_slice(&header);
            }
            // Well-formed fragments at random offsets, then random bytes.
            let mut delta = Vec::new();
            for (offset, bytes) in &frags {
                fragment(&mut delta, *offset % 8300, bytes);
            }
            delta.extend_from_slice(&data);
            let rec = record(0, vec![block(0, flags, &delta)]);
            let _ = redo(&Target { record: &rec, block: &rec.blocks[0] }, &mut page);
        }
    }
}
