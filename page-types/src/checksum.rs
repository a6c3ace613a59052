//! PostgreSQL's data page checksum: the value a cluster initialised with `--data-checksums`
//! keeps in a page's `pd_checksum` (bytes 8..10 of the page header) and checks on every read
//! of the page from disk (`pg_checksum_page` in PostgreSQL's `storage/checksum_impl.h`).
//!
//! The algorithm, in short: the page is read as 64 rows of 32 little-endian `u32` words, with
//! the checksum field taken as zero. Each of the 32 columns has its own running hash, started
//! at a fixed constant of its own, and every word of the column is mixed in with
//! `t = hash ^ word; hash = t * FNV_PRIME ^ (t >> 17)` (a variant of FNV-1a); then two rounds
//! of the word 0 mix in the last ones. The 32 hashes are folded with xor, xor'ed with the block
//! number (so that a page written at the wrong block fails), and reduced to 16 bits as
//! `hash % 65535 + 1`, so that a checksum is never 0.
//!
//! Pages are taken in little-endian byte order, as the clusters this daemon follows write
//! them (the WAL decoder reads them so too); a big-endian cluster would checksum other words.
//! A new page (`pd_upper` 0, PostgreSQL's `PageIsNew`) is never checksummed by PostgreSQL and
//! is left alone here too.
//!
//! Invariant: pure; no input makes anything here panic (a page is a `[u8; PAGE_SIZE]`).

use crate::PAGE_SIZE;

/// Offset of `pd_checksum` in the page header.
pub const PD_CHECKSUM_OFFSET: usize = 8;
/// Offset of `pd_upper` in the page header.
const PD_UPPER_OFFSET: usize = 14;

/// Columns hashed side by side (PostgreSQL's `N_SUMS`): part of the algorithm, since another
/// count gives other checksums.
const LANES: usize = 32;
// The page is whole rows of words.
const _: () = assert!(PAGE_SIZE % (LANES * 4) == 0);
/// The FNV-1a prime.
const FNV_PRIME: u32 = 16_777_619;
/// Each column's starting hash (PostgreSQL's `checksumBaseOffsets`): arbitrary values, but
/// these ones, or the checksum is another.
const LANE_SEEDS: [u32; LANES] = [
    0x5B1F36E9, 0xB8525960, 0x02AB50AA, 0x1DE66D2A, 0x79FF467A, 0x9BB9F8A3, 0x217E7CD2, 0x83E13D2C,
    0xF8D4474F, 0xE39EB970, 0x42C6AE16, 0x993216FA, 0x7B093B5D, 0x98DAFF3C, 0xF718902A, 0x0B1C9CDB,
    0xE58F764B, 0x187636BC, 0x5D7B3BB1, 0xE73DE7DE, 0x92BEC979, 0xCCA6C0B2, 0x304A0979, 0x85AA43D4,
    0x783125BB, 0x6CA8EAA2, 0xE407EAC6, 0x4B5CFC3E, 0x9FBF8C76, 0x15CA20BE, 0xF2CA9FD3, 0x959BD756,
];

/// One step of a column's hash.
fn mix(hash: u32, word: u32) -> u32 {
    let t = hash ^ word;
    t.wrapping_mul(FNV_PRIME) ^ (t >> 17)
}

/// The checksum PostgreSQL computes for `page` as block `blkno` of its relation fork; what the
/// page's `pd_checksum` holds does not count. Meaningful for pages that are not new (see
/// [`is_new`]), which are the only ones PostgreSQL checksums.
pub fn page_checksum(page: &[u8; PAGE_SIZE], blkno: u32) -> u16 {
    let mut hashes = LANE_SEEDS;
    for (row, words) in page.chunks_exact(LANES * 4).enumerate() {
        for (lane, (hash, word)) in hashes.iter_mut().zip(words.chunks_exact(4)).enumerate() {
            let mut word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            if row == 0 && lane == PD_CHECKSUM_OFFSET / 4 {
                // pd_checksum is the low half of this word (pd_flags the high half).
                word &= 0xFFFF_0000;
            }
            *hash = mix(*hash, word);
        }
    }
    let folded = hashes.iter().fold(0u32, |acc, &hash| acc ^ mix(mix(hash, 0), 0));
    let reduced = (folded ^ blkno) % 65535 + 1;
    u16::try_from(reduced).expect("a value below 65536")
}

/// Whether PostgreSQL takes the page as new (`PageIsNew`: `pd_upper` 0), which it never
/// checksums: an all-zero page of an extended relation.
pub fn is_new(page: &[u8; PAGE_SIZE]) -> bool {
    page[PD_UPPER_OFFSET] == 0 && page[PD_UPPER_OFFSET + 1] == 0
}

/// The page's `pd_checksum`.
pub fn stored_checksum(page: &[u8; PAGE_SIZE]) -> u16 {
    u16::from_le_bytes([page[PD_CHECKSUM_OFFSET], page[PD_CHECKSUM_OFFSET + 1]])
}

/// Sets the page's `pd_checksum` to its checksum as block `blkno`, as PostgreSQL does before it
/// writes a page; a new page is left as it is. Whether it set it.
pub fn set_page_checksum(page: &mut [u8; PAGE_SIZE], blkno: u32) -> bool {
    if is_new(page) {
        return false;
    }
    let checksum = page_checksum(page, blkno);
    page[PD_CHECKSUM_OFFSET..PD_CHECKSUM_OFFSET + 2].copy_from_slice(&checksum.to_le_bytes());
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The page of the test vectors: byte `i` is `(i * 7 + i / 256) % 256`.
    fn pattern_page() -> [u8; PAGE_SIZE] {
        let mut page = [0u8; PAGE_SIZE];
        for (i, b) in page.iter_mut().enumerate() {
            *b = ((i * 7 + i / 256) % 256) as u8;
        }
        page
    }

    /// PostgreSQL 15's answers (pageinspect's `page_checksum(page, blkno)`, a `smallint`, read
    /// here as unsigned) for the pages below: its own `pg_checksum_page`.
    #[test]
    fn checksums_match_postgresql_15s_page_checksum() {
        let page = pattern_page();
        assert!(!is_new(&page));
        for (blkno, want) in [(0, 15923), (1, 15922), (12345, 3626), (4_294_967_294, 49615)] {
            assert_eq!(page_checksum(&page, blkno), want, "pattern page, block {blkno}");
        }
        let ones = [0xFFu8; PAGE_SIZE];
        for (blkno, want) in [(0, 3612), (7, 3619)] {
            assert_eq!(page_checksum(&ones, blkno), want, "0xFF page, block {blkno}");
        }
    }

    #[test]
    fn the_stored_checksum_does_not_count_but_every_other_byte_does() {
        let mut page = pattern_page();
        let before = page_checksum(&page, 3);
        page[PD_CHECKSUM_OFFSET] ^= 0xFF;
        page[PD_CHECKSUM_OFFSET + 1] ^= 0x5A;
        assert_eq!(page_checksum(&page, 3), before);
        // pd_flags shares the checksum's word: it counts.
        page[PD_CHECKSUM_OFFSET + 2] ^= 1;
        assert_ne!(page_checksum(&page, 3), before);
        page[PD_CHECKSUM_OFFSET + 2] ^= 1;
        page[PAGE_SIZE - 1] ^= 1;
        assert_ne!(page_checksum(&page, 3), before);
    }

    #[test]
    fn setting_the_checksum_writes_it_and_leaves_new_pages_alone() {
        let mut page = pattern_page();
        assert!(set_page_checksum(&mut page, 12345));
        assert_eq!(stored_checksum(&page), 3626);
        let mut rest = pattern_page();
        rest[PD_CHECKSUM_OFFSET..PD_CHECKSUM_OFFSET + 2].copy_from_slice(&3626u16.to_le_bytes());
        assert_eq!(page, rest, "only pd_checksum changes");

        let mut new = [0u8; PAGE_SIZE];
        assert!(is_new(&new));
        assert!(!set_page_checksum(&mut new, 1));
        assert_eq!(new, [0u8; PAGE_SIZE]);
    }

    proptest! {
        #[test]
        fn checksum_never_panics_and_is_never_zero(bytes in proptest::collection::vec(any::<u8>(), PAGE_SIZE), blkno: u32) {
            let mut page: [u8; PAGE_SIZE] = bytes.as_slice().try_into().expect("a page of bytes");
            let checksum = page_checksum(&page, blkno);
            prop_assert_ne!(checksum, 0);
            if set_page_checksum(&mut page, blkno) {
                prop_assert_eq!(stored_checksum(&page), checksum);
            }
        }
    }
}
