//! Hash index pages as PostgreSQL 15's `hash.h` lays them out (x86-64, 8 KiB pages), and the
//! page initialisations redo repeats: `_hash_pageinit`, `_hash_initbuf` (a bucket or overflow
//! page), `_hash_initbitmapbuffer` (a bitmap page), `_hash_init_metabuffer` (the metapage, with
//! the splitpoint arithmetic of `hashutil.c` it needs).
//!
//! Every page's special space is `HashPageOpaqueData` (16 bytes at `pd_special`:
//! `hasho_prevblkno`, `hasho_nextblkno`, `hasho_bucket` `u32`, `hasho_flag`, `hasho_page_id`
//! `u16`). The metapage (block 0) holds `HashMetaPageData` right after the page header; a bitmap
//! page holds its bit array there (`uint32` words: bit `n` is byte `n / 8`, bit `n % 8` on a
//! little-endian machine).
//!
//! Invariants: pure; nothing panics on any page: a special space that does not fit the page is
//! `None`, an array index past its array is an error.

use crate::page::{self, Page, BLCKSZ, PAGE_HEADER_SIZE};
use crate::pg15::bufpage;

/// `hasho_flag` page types (`LH_PAGE_TYPE` bits) and flags.
pub const LH_UNUSED_PAGE: u16 = 0;
pub const LH_OVERFLOW_PAGE: u16 = 1 << 0;
pub const LH_BUCKET_PAGE: u16 = 1 << 1;
pub const LH_BITMAP_PAGE: u16 = 1 << 2;
pub const LH_META_PAGE: u16 = 1 << 3;
pub const LH_BUCKET_BEING_POPULATED: u16 = 1 << 4;
pub const LH_BUCKET_BEING_SPLIT: u16 = 1 << 5;
pub const LH_BUCKET_NEEDS_SPLIT_CLEANUP: u16 = 1 << 6;
pub const LH_PAGE_HAS_DEAD_TUPLES: u16 = 1 << 7;
pub const LH_PAGE_TYPE: u16 = LH_OVERFLOW_PAGE | LH_BUCKET_PAGE | LH_BITMAP_PAGE | LH_META_PAGE;

/// `HASHO_PAGE_ID`, the last two bytes of every hash page.
pub const HASHO_PAGE_ID: u16 = 0xFF80;
/// `InvalidBlockNumber` and `InvalidBucket`.
pub const INVALID: u32 = 0xFFFF_FFFF;
/// `sizeof(HashPageOpaqueData)`.
pub const HASH_SPECIAL_SIZE: usize = 16;
pub const HASH_MAGIC: u32 = 0x0644_0640;
pub const HASH_VERSION: u32 = 4;
/// `HASH_MAX_SPLITPOINTS`: `(32 - 10) * 4 + 10`, the length of `hashm_spares`.
pub const HASH_MAX_SPLITPOINTS: u32 = 98;
/// `HASH_MAX_BITMAPS` for 8 KiB pages, the length of `hashm_mapp`.
pub const HASH_MAX_BITMAPS: u32 = 1024;
/// `HashGetMaxBitmapSize`: the bytes between the page header and the special space.
pub const MAX_BITMAP_SIZE: usize = BLCKSZ - PAGE_HEADER_SIZE - HASH_SPECIAL_SIZE;
const SPLITPOINT_GROUPS_WITH_ONE_PHASE: u32 = 10;
const SPLITPOINT_PHASE_BITS: u32 = 2;
const SPLITPOINT_PHASE_MASK: u32 = (1 << SPLITPOINT_PHASE_BITS) - 1;

/// Byte offsets in the page of the `HashMetaPageData` fields (it starts right after the header).
pub mod meta {
    use crate::page::PAGE_HEADER_SIZE as H;
    pub const MAGIC: usize = H;
    pub const VERSION: usize = H + 4;
    /// `double`.
    pub const NTUPLES: usize = H + 8;
    pub const FFACTOR: usize = H + 16;
    pub const BSIZE: usize = H + 18;
    pub const BMSIZE: usize = H + 20;
    pub const BMSHIFT: usize = H + 22;
    pub const MAXBUCKET: usize = H + 24;
    pub const HIGHMASK: usize = H + 28;
    pub const LOWMASK: usize = H + 32;
    pub const OVFLPOINT: usize = H + 36;
    pub const FIRSTFREE: usize = H + 40;
    pub const NMAPS: usize = H + 44;
    pub const PROCID: usize = H + 48;
    pub const SPARES: usize = H + 52;
    pub const MAPP: usize = SPARES + 4 * super::HASH_MAX_SPLITPOINTS as usize;
    /// `sizeof(HashMetaPageData)`: the fields end at 4540, padded to the `double`'s alignment.
    pub const SIZE: usize = 4544;
}

/// `HashPageOpaqueData`, at `pd_special`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opaque {
    pub prev: u32,
    pub next: u32,
    pub bucket: u32,
    pub flag: u16,
    pub page_id: u16,
}

impl Opaque {
    fn at(page: &Page) -> Option<usize> {
        let at = usize::from(page::pd_special(page));
        (at.checked_add(HASH_SPECIAL_SIZE)? <= BLCKSZ).then_some(at)
    }

    /// The special space of `page`; `None` if `pd_special` leaves no room for it.
    pub fn read(page: &Page) -> Option<Opaque> {
        let at = Self::at(page)?;
        Some(Opaque {
            prev: get_u32(page, at)?,
            next: get_u32(page, at + 4)?,
            bucket: get_u32(page, at + 8)?,
            flag: get_u16(page, at + 12)?,
            page_id: get_u16(page, at + 14)?,
        })
    }

    pub fn write(&self, page: &mut Page) -> Option<()> {
        let at = Self::at(page)?;
        put_u32(page, at, self.prev)?;
        put_u32(page, at + 4, self.next)?;
        put_u32(page, at + 8, self.bucket)?;
        put_u16(page, at + 12, self.flag)?;
        put_u16(page, at + 14, self.page_id)
    }
}

pub fn get_u16(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_le_bytes([s[0], s[1]]))
}

pub fn get_u32(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

pub fn get_f64(b: &[u8], at: usize) -> Option<f64> {
    let s = b.get(at..at.checked_add(8)?)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(s);
    Some(f64::from_le_bytes(a))
}

pub fn put_u16(b: &mut [u8], at: usize, v: u16) -> Option<()> {
    b.get_mut(at..at.checked_add(2)?)?.copy_from_slice(&v.to_le_bytes());
    Some(())
}

pub fn put_u32(b: &mut [u8], at: usize, v: u32) -> Option<()> {
    b.get_mut(at..at.checked_add(4)?)?.copy_from_slice(&v.to_le_bytes());
    Some(())
}

pub fn put_f64(b: &mut [u8], at: usize, v: f64) -> Option<()> {
    b.get_mut(at..at.checked_add(8)?)?.copy_from_slice(&v.to_le_bytes());
    Some(())
}

/// `_hash_pageinit` then `_hash_initbuf`'s special space: a bucket or overflow page.
pub fn init_buf(page: &mut Page, max_bucket: u32, num_bucket: u32, flag: u16) {
    bufpage::page_init(page, HASH_SPECIAL_SIZE);
    let op = Opaque { prev: max_bucket, next: INVALID, bucket: num_bucket, flag, page_id: HASHO_PAGE_ID };
    // The special space of a page just initialised always fits.
    let _ = op.write(page);
}

/// `_hash_initbitmapbuffer(buf, bmsize, true)`: every bit of the first `bmsize` bytes set ("in
/// use"), `pd_lower` just past them. `None` if `bmsize` is more than the page holds.
pub fn init_bitmap(page: &mut Page, bmsize: u16) -> Option<()> {
    let bmsize = usize::from(bmsize);
    if bmsize > MAX_BITMAP_SIZE {
        return None;
    }
    bufpage::page_init(page, HASH_SPECIAL_SIZE);
    let op = Opaque {
        prev: INVALID,
        next: INVALID,
        bucket: INVALID,
        flag: LH_BITMAP_PAGE,
        page_id: HASHO_PAGE_ID,
    };
    op.write(page)?;
    page[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + bmsize].fill(0xFF);
    page::set_pd_lower(page, (PAGE_HEADER_SIZE + bmsize) as u16);
    Some(())
}

/// `_hash_init_metabuffer(buf, num_tuples, procid, ffactor, true)`: the metapage of an index
/// sized for `num_tuples` at `ffactor` tuples per bucket (at least 2 buckets, at most 2^30).
pub fn init_metapage(page: &mut Page, num_tuples: f64, procid: u32, ffactor: u16) {
    let dnumbuckets = num_tuples / f64::from(ffactor);
    let num_buckets = if dnumbuckets <= 2.0 {
        2
    } else if dnumbuckets >= f64::from(0x4000_0000u32) {
        0x4000_0000
    } else {
        // C's conversion of a double in (2, 2^30) to uint32: truncation.
        get_totalbuckets(spareindex(dnumbuckets as u32))
    };
    let spare_index = spareindex(num_buckets);
    bufpage::page_init(page, HASH_SPECIAL_SIZE);
    let op =
        Opaque { prev: INVALID, next: INVALID, bucket: INVALID, flag: LH_META_PAGE, page_id: HASHO_PAGE_ID };
    let _ = op.write(page);
    let bsize = MAX_BITMAP_SIZE as u16;
    let lshift = leftmost_one_pos(u32::from(bsize));
    let highmask = nextpower2(num_buckets + 1) - 1;
    let words: [(usize, u32); 10] = [
        (meta::MAGIC, HASH_MAGIC),
        (meta::VERSION, HASH_VERSION),
        (meta::MAXBUCKET, num_buckets - 1),
        (meta::HIGHMASK, highmask),
        (meta::LOWMASK, highmask >> 1),
        (meta::OVFLPOINT, spare_index),
        (meta::FIRSTFREE, 0),
        (meta::NMAPS, 0),
        (meta::PROCID, procid),
        (meta::SPARES + 4 * spare_index as usize, 1),
    ];
    for (at, v) in words {
        let _ = put_u32(page, at, v);
    }
    let halves: [(usize, u16); 4] = [
        (meta::FFACTOR, ffactor),
        (meta::BSIZE, bsize),
        (meta::BMSIZE, 1 << lshift),
        (meta::BMSHIFT, (lshift + 3) as u16),
    ];
    for (at, v) in halves {
        let _ = put_u16(page, at, v);
    }
    let _ = put_f64(page, meta::NTUPLES, 0.0);
    page::set_pd_lower(page, (PAGE_HEADER_SIZE + meta::SIZE) as u16);
}

/// `pg_leftmost_one_pos32` (of a nonzero value).
fn leftmost_one_pos(v: u32) -> u32 {
    31 - v.max(1).leading_zeros()
}

/// `pg_ceil_log2_32`.
fn ceil_log2(v: u32) -> u32 {
    if v < 2 {
        0
    } else {
        leftmost_one_pos(v - 1) + 1
    }
}

/// `pg_nextpower2_32` (of a value in `1..=2^31`).
fn nextpower2(v: u32) -> u32 {
    if v & v.wrapping_sub(1) == 0 {
        v
    } else {
        1u32.checked_shl(leftmost_one_pos(v) + 1).unwrap_or(0)
    }
}

/// `_hash_spareindex`: the splitpoint phase of bucket count `num_bucket`.
pub fn spareindex(num_bucket: u32) -> u32 {
    let group = ceil_log2(num_bucket);
    if group < SPLITPOINT_GROUPS_WITH_ONE_PHASE {
        return group;
    }
    let mut phases = SPLITPOINT_GROUPS_WITH_ONE_PHASE;
    phases += (group - SPLITPOINT_GROUPS_WITH_ONE_PHASE) << SPLITPOINT_PHASE_BITS;
    phases + ((num_bucket.wrapping_sub(1) >> (group - (SPLITPOINT_PHASE_BITS + 1))) & SPLITPOINT_PHASE_MASK)
}

/// `_hash_get_totalbuckets`: the buckets allocated up to splitpoint phase `phase` (at most
/// phase 93, 2^30 buckets, for what [`spareindex`] returns).
pub fn get_totalbuckets(phase: u32) -> u32 {
    if phase < SPLITPOINT_GROUPS_WITH_ONE_PHASE {
        return 1 << phase;
    }
    let group = SPLITPOINT_GROUPS_WITH_ONE_PHASE
        + ((phase - SPLITPOINT_GROUPS_WITH_ONE_PHASE) >> SPLITPOINT_PHASE_BITS);
    let before = 1u32.checked_shl(group - 1).unwrap_or(0);
    let within = ((phase - SPLITPOINT_GROUPS_WITH_ONE_PHASE) & SPLITPOINT_PHASE_MASK) + 1;
    before.wrapping_add((before >> SPLITPOINT_PHASE_BITS).wrapping_mul(within))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitpoint_arithmetic_follows_hashutil() {
        // One phase per group below 2^10 buckets, four above.
        assert_eq!((spareindex(2), spareindex(3), spareindex(512), spareindex(513)), (1, 2, 9, 10));
        assert_eq!(
            (spareindex(1024), spareindex(1025), spareindex(1280), spareindex(1281)),
            (13, 14, 14, 15)
        );
        assert_eq!((get_totalbuckets(1), get_totalbuckets(9), get_totalbuckets(10)), (2, 512, 640));
        assert_eq!((get_totalbuckets(13), get_totalbuckets(14)), (1024, 1280));
        assert_eq!(spareindex(0x4000_0000), 93);
        assert_eq!(get_totalbuckets(93), 0x4000_0000);
        assert_eq!((nextpower2(3), nextpower2(4), nextpower2(5)), (4, 4, 8));
        assert_eq!(meta::MAPP + 4 * HASH_MAX_BITMAPS as usize, PAGE_HEADER_SIZE + 4540);
    }

    #[test]
    fn a_metapage_for_many_tuples_has_more_buckets() {
        let mut page = Box::new([0u8; BLCKSZ]);
        init_metapage(&mut page, 100_000.0, 450, 307);
        // 325.7 buckets: phase of 325 is 9 (512 buckets).
        assert_eq!(get_u32(&page[..], meta::MAXBUCKET), Some(511));
        assert_eq!(get_u32(&page[..], meta::HIGHMASK), Some(1023));
        assert_eq!(get_u32(&page[..], meta::LOWMASK), Some(511));
        assert_eq!(get_u32(&page[..], meta::OVFLPOINT), Some(9));
        assert_eq!(get_u32(&page[..], meta::SPARES + 36), Some(1));
        assert_eq!(
            (get_u16(&page[..], meta::BMSIZE), get_u16(&page[..], meta::BMSHIFT)),
            (Some(4096), Some(15))
        );
        assert_eq!(page::pd_lower(&page), 4568);
        let mut page = Box::new([0u8; BLCKSZ]);
        init_metapage(&mut page, f64::NAN, 450, 0);
        assert_eq!(get_u32(&page[..], meta::MAXBUCKET), Some(0), "no panic on nonsense");
    }
}
