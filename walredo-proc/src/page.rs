//! The PostgreSQL page layout as the redo records see it: an 8 KiB page with a 24-byte
//! little-endian header, an array of 4-byte line pointers growing up from the header, tuples
//! growing down from `pd_special`, and the special space at the end. The layout is specified in
//! `docs/walredo-protocol.md`, "The page layout".
//!
//! This module only reads and writes fields; what a record does with them lives in
//! [`crate::record`].
//!
//! Invariants:
//! - nothing here panics on any page contents: header fields are read at constant offsets, line
//!   pointers are read and written with bounds-checked accessors that return `None` past the page;
//! - [`check_header`] is the one place that decides whether a header is valid, and the
//!   [`Bounds`] it returns is the only way to get at `pd_lower`/`pd_upper`/`pd_special` as
//!   trusted values.

use std::ops::Range;

/// Size of a page in bytes.
pub const BLCKSZ: usize = page_types::PAGE_SIZE;
/// A page, in PostgreSQL's on-disk layout.
pub type Page = [u8; BLCKSZ];
/// Size of the page header; the line pointer array starts here.
pub const PAGE_HEADER_SIZE: usize = 24;
/// Tuples start at multiples of this and occupy a multiple of it.
pub const MAXALIGN: usize = 8;
/// Size of one line pointer.
pub const ITEM_ID_SIZE: usize = 4;
/// PostgreSQL's page layout version, stored in the low byte of `pd_pagesize_version`.
pub const PG_PAGE_LAYOUT_VERSION: u16 = 4;
/// `pd_pagesize_version` of a freshly initialised page.
pub const PAGE_SIZE_VERSION: u16 = BLCKSZ as u16 | PG_PAGE_LAYOUT_VERSION;

/// Line pointer flags (`lp_flags`): unused slot, no storage.
pub const LP_UNUSED: u8 = 0;
/// A live tuple at `lp_off`, `lp_len` bytes long.
pub const LP_NORMAL: u8 = 1;
/// HOT redirect: `lp_off` is the offset number of another slot; no storage.
pub const LP_REDIRECT: u8 = 2;
/// A deleted tuple; its storage stays until prune.
pub const LP_DEAD: u8 = 3;

const LSN_HIGH: usize = 0;
const LSN_LOW: usize = 4;
const CHECKSUM: usize = 8;
const FLAGS: usize = 10;
const LOWER: usize = 12;
const UPPER: usize = 14;
const SPECIAL: usize = 16;
const PAGESIZE_VERSION: usize = 18;
const PRUNE_XID: usize = 20;

/// Rounds `len` up to a multiple of [`MAXALIGN`]. Saturates instead of overflowing (no slice is
/// long enough to reach that).
pub fn maxalign(len: usize) -> usize {
    len.saturating_add(MAXALIGN - 1) & !(MAXALIGN - 1)
}

/// Only called with the constant field offsets above, all below [`PAGE_HEADER_SIZE`].
fn get_u16(page: &Page, at: usize) -> u16 {
    u16::from_le_bytes([page[at], page[at + 1]])
}

fn put_u16(page: &mut Page, at: usize, value: u16) {
    let [a, b] = value.to_le_bytes();
    page[at] = a;
    page[at + 1] = b;
}

fn get_u32(page: &Page, at: usize) -> u32 {
    u32::from_le_bytes([page[at], page[at + 1], page[at + 2], page[at + 3]])
}

fn put_u32(page: &mut Page, at: usize, value: u32) {
    let [a, b, c, d] = value.to_le_bytes();
    page[at] = a;
    page[at + 1] = b;
    page[at + 2] = c;
    page[at + 3] = d;
}

/// `pd_lsn`: the LSN of the last record applied, stored as two little-endian `u32` (high, low).
pub fn page_lsn(page: &Page) -> u64 {
    (u64::from(get_u32(page, LSN_HIGH)) << 32) | u64::from(get_u32(page, LSN_LOW))
}

/// Sets `pd_lsn`.
pub fn set_page_lsn(page: &mut Page, lsn: u64) {
    put_u32(page, LSN_HIGH, (lsn >> 32) as u32);
    put_u32(page, LSN_LOW, lsn as u32);
}

/// `pd_checksum` (kept as is by every record but init page).
pub fn pd_checksum(page: &Page) -> u16 {
    get_u16(page, CHECKSUM)
}

/// `pd_flags` (kept as is by every record but init page).
pub fn pd_flags(page: &Page) -> u16 {
    get_u16(page, FLAGS)
}

/// `pd_lower`: end of the line pointer array. Untrusted; see [`check_header`].
pub fn pd_lower(page: &Page) -> u16 {
    get_u16(page, LOWER)
}

/// `pd_upper`: start of the tuple area. Untrusted; see [`check_header`].
pub fn pd_upper(page: &Page) -> u16 {
    get_u16(page, UPPER)
}

/// `pd_special`: start of the special space. Untrusted; see [`check_header`].
pub fn pd_special(page: &Page) -> u16 {
    get_u16(page, SPECIAL)
}

/// `pd_pagesize_version`: page size ORed with the layout version. Not checked by any record.
pub fn pd_pagesize_version(page: &Page) -> u16 {
    get_u16(page, PAGESIZE_VERSION)
}

/// `pd_prune_xid` (kept as is by every record but init page).
pub fn pd_prune_xid(page: &Page) -> u32 {
    get_u32(page, PRUNE_XID)
}

pub fn set_pd_lower(page: &mut Page, value: u16) {
    put_u16(page, LOWER, value);
}

pub fn set_pd_upper(page: &mut Page, value: u16) {
    put_u16(page, UPPER, value);
}

pub fn set_pd_special(page: &mut Page, value: u16) {
    put_u16(page, SPECIAL, value);
}

pub fn set_pd_pagesize_version(page: &mut Page, value: u16) {
    put_u16(page, PAGESIZE_VERSION, value);
}

/// A decoded line pointer (`ItemIdData`): a little-endian `u32` holding `lp_off` in bits 0-14,
/// `lp_flags` in bits 15-16 and `lp_len` in bits 17-31.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemId {
    /// Offset of the tuple in the page (15 bits).
    pub off: u16,
    /// One of [`LP_UNUSED`], [`LP_NORMAL`], [`LP_REDIRECT`], [`LP_DEAD`] (2 bits).
    pub flags: u8,
    /// Length of the tuple in bytes (15 bits).
    pub len: u16,
}

impl ItemId {
    /// An unused slot with neither offset nor length (the raw value 0).
    pub const UNUSED: ItemId = ItemId { off: 0, flags: LP_UNUSED, len: 0 };

    /// Largest value of `lp_off` and `lp_len`.
    pub const MAX_FIELD: u16 = 0x7FFF;

    /// Decodes the raw little-endian `u32`.
    pub fn from_raw(raw: u32) -> ItemId {
        ItemId { off: (raw & 0x7FFF) as u16, flags: ((raw >> 15) & 0x3) as u8, len: (raw >> 17) as u16 }
    }

    /// Encodes to the raw `u32`; fields wider than their bit width are masked.
    pub fn to_raw(self) -> u32 {
        u32::from(self.off & Self::MAX_FIELD)
            | (u32::from(self.flags & 0x3) << 15)
            | (u32::from(self.len & Self::MAX_FIELD) << 17)
    }
}

/// PostgreSQL's name for a line pointer flag value (only the low two bits count).
pub fn lp_flags_name(flags: u8) -> &'static str {
    match flags & 0x3 {
        LP_UNUSED => "LP_UNUSED",
        LP_NORMAL => "LP_NORMAL",
        LP_REDIRECT => "LP_REDIRECT",
        _ => "LP_DEAD",
    }
}

/// Byte range of line pointer `slot` (1-based), or `None` for slot 0 or a slot past the page.
pub fn item_id_range(slot: usize) -> Option<Range<usize>> {
    let start = slot.checked_sub(1)?.checked_mul(ITEM_ID_SIZE)?.checked_add(PAGE_HEADER_SIZE)?;
    let end = start.checked_add(ITEM_ID_SIZE)?;
    (end <= BLCKSZ).then_some(start..end)
}

/// Reads line pointer `slot` (1-based), whether or not it is below `pd_lower`; `None` for slot 0
/// or a slot past the page.
pub fn item_id(page: &Page, slot: usize) -> Option<ItemId> {
    let bytes: [u8; ITEM_ID_SIZE] = page.get(item_id_range(slot)?)?.try_into().ok()?;
    Some(ItemId::from_raw(u32::from_le_bytes(bytes)))
}

/// Writes line pointer `slot` (1-based); `None` (and nothing written) for slot 0 or a slot past
/// the page. Does not touch `pd_lower`.
#[must_use = "the slot may be past the page"]
pub fn set_item_id(page: &mut Page, slot: usize, id: ItemId) -> Option<()> {
    page.get_mut(item_id_range(slot)?)?.copy_from_slice(&id.to_raw().to_le_bytes());
    Some(())
}

/// Why a header is not valid for the tuple records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("pd_lower {lower} < {PAGE_HEADER_SIZE}")]
    LowerBelowHeader { lower: u16 },
    #[error("pd_lower {lower} is not {PAGE_HEADER_SIZE} + 4k")]
    LowerMisaligned { lower: u16 },
    #[error("pd_lower {lower} > pd_upper {upper}")]
    LowerAboveUpper { lower: u16, upper: u16 },
    #[error("pd_upper {upper} > pd_special {special}")]
    UpperAboveSpecial { upper: u16, special: u16 },
    #[error("pd_special {special} > {BLCKSZ}")]
    SpecialPastPage { special: u16 },
    #[error("pd_special {special} is not a multiple of {MAXALIGN}")]
    SpecialMisaligned { special: u16 },
}

/// The checked `pd_lower`, `pd_upper` and `pd_special` of a page.
///
/// **Invariant:** `24 <= lower <= upper <= special <= 8192`, `lower` is `24 + 4k` and `special`
/// is a multiple of 8. Only [`check_header`] builds one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    lower: usize,
    upper: usize,
    special: usize,
}

impl Bounds {
    pub fn lower(&self) -> usize {
        self.lower
    }

    pub fn upper(&self) -> usize {
        self.upper
    }

    pub fn special(&self) -> usize {
        self.special
    }

    /// Number of line pointers (`maxoff`); slots `1..=maxoff` exist.
    pub fn maxoff(&self) -> usize {
        (self.lower - PAGE_HEADER_SIZE) / ITEM_ID_SIZE
    }

    /// Free space between the line pointer array and the tuples: `pd_upper - pd_lower`.
    pub fn free(&self) -> usize {
        self.upper - self.lower
    }

    /// The aligned storage `lp_off..lp_off + MAXALIGN(lp_len)` of an `LP_NORMAL` pointer, or
    /// `None` when the pointer is corrupt: `lp_len` is 0 or the storage is not inside
    /// `[pd_upper, pd_special)`.
    pub fn tuple_extent(&self, id: ItemId) -> Option<Range<usize>> {
        let start = usize::from(id.off);
        let end = start.checked_add(maxalign(usize::from(id.len)))?;
        (id.len > 0 && start >= self.upper && end <= self.special).then_some(start..end)
    }
}

/// Checks that the header is valid for the tuple records: `24 <= pd_lower <= pd_upper <=
/// pd_special <= 8192`, `pd_lower` is `24 + 4k` and `pd_special` is a multiple of 8.
/// `pd_upper` need not be aligned and `pd_pagesize_version` is not looked at.
pub fn check_header(page: &Page) -> Result<Bounds, HeaderError> {
    let (lower, upper, special) = (pd_lower(page), pd_upper(page), pd_special(page));
    let header = PAGE_HEADER_SIZE as u16;
    if lower < header {
        return Err(HeaderError::LowerBelowHeader { lower });
    }
    if (lower - header) % ITEM_ID_SIZE as u16 != 0 {
        return Err(HeaderError::LowerMisaligned { lower });
    }
    if lower > upper {
        return Err(HeaderError::LowerAboveUpper { lower, upper });
    }
    if upper > special {
        return Err(HeaderError::UpperAboveSpecial { upper, special });
    }
    if usize::from(special) > BLCKSZ {
        return Err(HeaderError::SpecialPastPage { special });
    }
    if usize::from(special) % MAXALIGN != 0 {
        return Err(HeaderError::SpecialMisaligned { special });
    }
    Ok(Bounds { lower: lower.into(), upper: upper.into(), special: special.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_with(lower: u16, upper: u16, special: u16) -> Box<Page> {
        let mut page = Box::new([0u8; BLCKSZ]);
        page[12..14].copy_from_slice(&lower.to_le_bytes());
        page[14..16].copy_from_slice(&upper.to_le_bytes());
        page[16..18].copy_from_slice(&special.to_le_bytes());
        page
    }

    #[test]
    fn maxalign_rounds_up_to_multiple_of_eight() {
        assert_eq!(maxalign(0), 0);
        assert_eq!(maxalign(1), 8);
        assert_eq!(maxalign(8), 8);
        assert_eq!(maxalign(9), 16);
        assert_eq!(maxalign(usize::MAX), usize::MAX & !7);
    }

    #[test]
    fn set_page_lsn_writes_high_then_low_little_endian() {
        let mut page = [0u8; BLCKSZ];
        set_page_lsn(&mut page, 0x0102_0304_0506_0708);
        assert_eq!(page[..8], [0x04, 0x03, 0x02, 0x01, 0x08, 0x07, 0x06, 0x05]);
        assert!(page[8..].iter().all(|&b| b == 0));
        assert_eq!(page_lsn(&page), 0x0102_0304_0506_0708);
    }

    #[test]
    fn header_fields_read_at_their_offsets() {
        let mut page = [0u8; BLCKSZ];
        for (i, b) in page[..24].iter_mut().enumerate() {
            *b = i as u8;
        }
        assert_eq!(pd_checksum(&page), 0x0908);
        assert_eq!(pd_flags(&page), 0x0b0a);
        assert_eq!(pd_lower(&page), 0x0d0c);
        assert_eq!(pd_upper(&page), 0x0f0e);
        assert_eq!(pd_special(&page), 0x1110);
        assert_eq!(pd_pagesize_version(&page), 0x1312);
        assert_eq!(pd_prune_xid(&page), 0x1716_1514);
        set_pd_lower(&mut page, 0xaabb);
        set_pd_upper(&mut page, 0xccdd);
        set_pd_special(&mut page, 0xeeff);
        set_pd_pagesize_version(&mut page, 0x2004);
        assert_eq!(page[12..20], [0xbb, 0xaa, 0xdd, 0xcc, 0xff, 0xee, 0x04, 0x20]);
    }

    #[test]
    fn item_id_packs_off_flags_len_into_bits() {
        let id = ItemId { off: 8176, flags: LP_DEAD, len: 13 };
        assert_eq!(id.to_raw(), 8176 | (3 << 15) | (13 << 17));
        assert_eq!(ItemId::from_raw(id.to_raw()), id);
        assert_eq!(ItemId::from_raw(u32::MAX), ItemId { off: 0x7FFF, flags: 3, len: 0x7FFF });
        assert_eq!(ItemId::UNUSED.to_raw(), 0);
    }

    #[test]
    fn item_id_slot_one_is_right_after_the_header() {
        let mut page = [0u8; BLCKSZ];
        let id = ItemId { off: 8184, flags: LP_NORMAL, len: 5 };
        assert_eq!(set_item_id(&mut page, 2, id), Some(()));
        assert_eq!(page[28..32], (8184u32 | (1 << 15) | (5 << 17)).to_le_bytes());
        assert_eq!(item_id(&page, 2), Some(id));
    }

    #[test]
    fn item_id_out_of_page_slot_is_none() {
        let mut page = [0u8; BLCKSZ];
        let last = (BLCKSZ - PAGE_HEADER_SIZE) / ITEM_ID_SIZE;
        assert!(item_id(&page, last).is_some());
        assert_eq!(item_id(&page, last + 1), None);
        assert_eq!(item_id(&page, 0), None);
        assert_eq!(item_id(&page, usize::MAX), None);
        assert_eq!(set_item_id(&mut page, last + 1, ItemId::UNUSED), None);
        assert_eq!(set_item_id(&mut page, 0, ItemId::UNUSED), None);
    }

    #[test]
    fn check_header_accepts_fresh_and_full_pages() {
        let b = check_header(&page_with(24, 8192, 8192)).expect("valid");
        assert_eq!((b.lower(), b.upper(), b.special(), b.maxoff(), b.free()), (24, 8192, 8192, 0, 8168));
        let b = check_header(&page_with(40, 40, 8000)).expect("valid");
        assert_eq!((b.maxoff(), b.free()), (4, 0));
        assert!(check_header(&page_with(28, 8001, 8184)).is_ok(), "pd_upper need not be aligned");
    }

    #[test]
    fn check_header_rejects_each_broken_rule() {
        let cases = [
            (page_with(0, 0, 0), HeaderError::LowerBelowHeader { lower: 0 }),
            (page_with(20, 8192, 8192), HeaderError::LowerBelowHeader { lower: 20 }),
            (page_with(26, 8192, 8192), HeaderError::LowerMisaligned { lower: 26 }),
            (page_with(32, 28, 8192), HeaderError::LowerAboveUpper { lower: 32, upper: 28 }),
            (page_with(24, 8192, 8184), HeaderError::UpperAboveSpecial { upper: 8192, special: 8184 }),
            (page_with(24, 100, 8200), HeaderError::SpecialPastPage { special: 8200 }),
            (page_with(24, 100, 8190), HeaderError::SpecialMisaligned { special: 8190 }),
        ];
        for (page, want) in cases {
            assert_eq!(check_header(&page), Err(want));
        }
        assert_eq!(HeaderError::LowerBelowHeader { lower: 20 }.to_string(), "pd_lower 20 < 24");
    }

    #[test]
    fn tuple_extent_requires_storage_inside_upper_and_special() {
        let b = check_header(&page_with(28, 8000, 8184)).expect("valid");
        let normal = |off, len| ItemId { off, flags: LP_NORMAL, len };
        assert_eq!(b.tuple_extent(normal(8000, 13)), Some(8000..8016));
        assert_eq!(b.tuple_extent(normal(8176, 8)), Some(8176..8184));
        assert_eq!(b.tuple_extent(normal(8177, 1)), None, "aligned end past pd_special");
        assert_eq!(b.tuple_extent(normal(7992, 8)), None, "below pd_upper");
        assert_eq!(b.tuple_extent(normal(8000, 0)), None, "no storage");
        assert_eq!(b.tuple_extent(normal(0x7FFF, 0x7FFF)), None);
    }

    #[test]
    fn lp_flags_name_names_all_four() {
        assert_eq!(
            [LP_UNUSED, LP_NORMAL, LP_REDIRECT, LP_DEAD].map(lp_flags_name),
            ["LP_UNUSED", "LP_NORMAL", "LP_REDIRECT", "LP_DEAD"]
        );
    }
}
