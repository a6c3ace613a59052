//! The redo records (record format version 1): their wire encoding and what applying one does to
//! a page. Specified in `docs/walredo-protocol.md`, "Records" and "The page layout".
//!
//! Invariants:
//! - [`Record::decode`] checks only the kind and the body length (a failure is `bad_record`);
//!   every check on values (special size, byte ranges, offsets) happens in [`Record::apply`]
//!   against the page (a failure is `apply_failed`);
//! - no input panics: every offset and length taken from a record or a page is checked, with
//!   checked arithmetic, before it is used;
//! - apply is atomic: it validates everything first and mutates only once the record is known to
//!   succeed, so a failing record leaves the page unchanged (byte for byte, `pd_lsn` included);
//! - apply does no I/O and allocates only in prune (the page copy and the list of live tuples).

use crate::page::{
    check_header, item_id, maxalign, set_item_id, set_page_lsn, set_pd_lower, set_pd_pagesize_version,
    set_pd_special, set_pd_upper, Bounds, HeaderError, ItemId, Page, BLCKSZ, ITEM_ID_SIZE, LP_DEAD,
    LP_NORMAL, LP_UNUSED, PAGE_HEADER_SIZE, PAGE_SIZE_VERSION,
};
use std::fmt;

/// Version of the record format below. Not sent on the wire: changing it means a new protocol
/// version.
pub const RECORD_FORMAT_VERSION: u32 = 1;
/// Largest encoded record (kind byte included).
pub use page_types::MAX_RECORD_LEN;

pub const KIND_INIT_PAGE: u8 = 0x01;
pub const KIND_INSERT_TUPLE: u8 = 0x02;
pub const KIND_UPDATE_TUPLE: u8 = 0x03;
pub const KIND_DELETE_TUPLE: u8 = 0x04;
pub const KIND_PRUNE: u8 = 0x05;
pub const KIND_SET_BITS: u8 = 0x06;
pub const KIND_CLEAR_BITS: u8 = 0x07;
pub const KIND_PUT_BYTES: u8 = 0x08;
pub const KIND_APPEND: u8 = 0x09;
/// Kinds left to the PostgreSQL record families (0x10: `pg15`, see [`crate::pg15`]); not
/// records of this family, so `bad_record` here.
pub const RESERVED_KINDS: std::ops::RangeInclusive<u8> = 0x10..=0x1f;

/// One decoded record. Byte payloads borrow from the buffer it was decoded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<'a> {
    InitPage { special_size: u16 },
    InsertTuple { offnum: u16, data: &'a [u8] },
    UpdateTuple { offnum: u16, data: &'a [u8] },
    DeleteTuple { offnum: u16 },
    Prune,
    SetBits { offset: u16, mask: &'a [u8] },
    ClearBits { offset: u16, mask: &'a [u8] },
    PutBytes { offset: u16, data: &'a [u8] },
    Append { data: &'a [u8] },
}

/// How long a kind's body must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyLen {
    Exactly(usize),
    AtLeast(usize),
}

impl fmt::Display for BodyLen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BodyLen::Exactly(n) => write!(f, "{n}"),
            BodyLen::AtLeast(n) => write!(f, "at least {n}"),
        }
    }
}

/// A record that cannot be decoded (`bad_record`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("empty record")]
    Empty,
    #[error("record of {len} bytes is longer than {MAX_RECORD_LEN}")]
    TooLong { len: usize },
    #[error("unknown record kind {kind:#04x}")]
    UnknownKind { kind: u8 },
    #[error("record kind {kind:#04x} is reserved for raw heap WAL records, not in format version 1")]
    ReservedKind { kind: u8 },
    #[error("{kind} record body is {len} bytes, expected {expected}")]
    BadBodyLength { kind: &'static str, len: usize, expected: BodyLen },
}

/// A record that does not fit the page state (`apply_failed`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    #[error("corrupt page header: {0}")]
    CorruptHeader(#[from] HeaderError),
    #[error("invalid special size {special_size}: must be a multiple of 8 and at most 8168")]
    BadSpecialSize { special_size: u16 },
    #[error("{kind} record has no data")]
    EmptyData { kind: &'static str },
    #[error("page full: need {need} bytes, {free} free")]
    PageFull { need: usize, free: usize },
    #[error("cannot insert at offset {offnum}: past maxoff + 1 (maxoff {maxoff})")]
    InsertPastEnd { offnum: u16, maxoff: usize },
    #[error("cannot insert at offset {offnum}: slot is {}", crate::page::lp_flags_name(*flags))]
    SlotInUse { offnum: u16, flags: u8 },
    #[error("no tuple at offset {offnum}")]
    NoTuple { offnum: u16 },
    #[error("tuple at offset {offnum} is {}, not LP_NORMAL", crate::page::lp_flags_name(*flags))]
    NotNormal { offnum: u16, flags: u8 },
    #[error("corrupt line pointer {slot}: off {off} len {len} is not inside pd_upper {upper}..pd_special {special}")]
    CorruptLinePointer { slot: usize, off: u16, len: u16, upper: usize, special: usize },
    #[error("corrupt tuple lengths: tuples need {need} bytes, {available} between pd_lower and pd_special")]
    CorruptTupleLengths { need: usize, available: usize },
    #[error("range {start}..{end} is outside the page")]
    OutOfPage { start: usize, end: usize },
}

fn kind_name_of(kind: u8) -> &'static str {
    match kind {
        KIND_INIT_PAGE => "init_page",
        KIND_INSERT_TUPLE => "insert_tuple",
        KIND_UPDATE_TUPLE => "update_tuple",
        KIND_DELETE_TUPLE => "delete_tuple",
        KIND_PRUNE => "prune",
        KIND_SET_BITS => "set_bits",
        KIND_CLEAR_BITS => "clear_bits",
        KIND_PUT_BYTES => "put_bytes",
        KIND_APPEND => "append",
        _ => "unknown",
    }
}

/// Splits a body into its leading big-endian `u16` and the rest, which must be exactly
/// `rest_len` bytes (`Exactly`) or at least that many (`AtLeast`).
fn u16_and_rest(kind: u8, body: &[u8], rest: BodyLen) -> Result<(u16, &[u8]), RecordError> {
    let (expected, ok) = match rest {
        BodyLen::Exactly(n) => (BodyLen::Exactly(2 + n), body.len() == 2 + n),
        BodyLen::AtLeast(n) => (BodyLen::AtLeast(2 + n), body.len() >= 2 + n),
    };
    match body.split_first_chunk::<2>() {
        Some((head, tail)) if ok => Ok((u16::from_be_bytes(*head), tail)),
        _ => Err(RecordError::BadBodyLength { kind: kind_name_of(kind), len: body.len(), expected }),
    }
}

impl<'a> Record<'a> {
    /// Decodes one record; the whole buffer is the record. Checks the kind and the body length
    /// only.
    pub fn decode(buf: &'a [u8]) -> Result<Record<'a>, RecordError> {
        if buf.len() > MAX_RECORD_LEN {
            return Err(RecordError::TooLong { len: buf.len() });
        }
        let (&kind, body) = buf.split_first().ok_or(RecordError::Empty)?;
        let record = match kind {
            KIND_INIT_PAGE => {
                Record::InitPage { special_size: u16_and_rest(kind, body, BodyLen::Exactly(0))?.0 }
            }
            KIND_INSERT_TUPLE => {
                let (offnum, data) = u16_and_rest(kind, body, BodyLen::AtLeast(1))?;
                Record::InsertTuple { offnum, data }
            }
            KIND_UPDATE_TUPLE => {
                let (offnum, data) = u16_and_rest(kind, body, BodyLen::AtLeast(1))?;
                Record::UpdateTuple { offnum, data }
            }
            KIND_DELETE_TUPLE => {
                Record::DeleteTuple { offnum: u16_and_rest(kind, body, BodyLen::Exactly(0))?.0 }
            }
            KIND_PRUNE if body.is_empty() => Record::Prune,
            KIND_PRUNE => {
                return Err(RecordError::BadBodyLength {
                    kind: "prune",
                    len: body.len(),
                    expected: BodyLen::Exactly(0),
                })
            }
            KIND_SET_BITS => {
                let (offset, mask) = u16_and_rest(kind, body, BodyLen::AtLeast(1))?;
                Record::SetBits { offset, mask }
            }
            KIND_CLEAR_BITS => {
                let (offset, mask) = u16_and_rest(kind, body, BodyLen::AtLeast(1))?;
                Record::ClearBits { offset, mask }
            }
            KIND_PUT_BYTES => {
                let (offset, data) = u16_and_rest(kind, body, BodyLen::AtLeast(1))?;
                Record::PutBytes { offset, data }
            }
            KIND_APPEND if !body.is_empty() => Record::Append { data: body },
            KIND_APPEND => {
                return Err(RecordError::BadBodyLength {
                    kind: "append",
                    len: 0,
                    expected: BodyLen::AtLeast(1),
                })
            }
            kind if RESERVED_KINDS.contains(&kind) => return Err(RecordError::ReservedKind { kind }),
            kind => return Err(RecordError::UnknownKind { kind }),
        };
        Ok(record)
    }

    /// The kind byte.
    pub fn kind(&self) -> u8 {
        match self {
            Record::InitPage { .. } => KIND_INIT_PAGE,
            Record::InsertTuple { .. } => KIND_INSERT_TUPLE,
            Record::UpdateTuple { .. } => KIND_UPDATE_TUPLE,
            Record::DeleteTuple { .. } => KIND_DELETE_TUPLE,
            Record::Prune => KIND_PRUNE,
            Record::SetBits { .. } => KIND_SET_BITS,
            Record::ClearBits { .. } => KIND_CLEAR_BITS,
            Record::PutBytes { .. } => KIND_PUT_BYTES,
            Record::Append { .. } => KIND_APPEND,
        }
    }

    /// The kind's name as used in logs and metrics: `init_page`, `insert_tuple`, ...
    pub fn kind_name(&self) -> &'static str {
        kind_name_of(self.kind())
    }

    /// The `u16` field and byte payload of the body, whichever the kind has.
    fn parts(&self) -> (Option<u16>, &'a [u8]) {
        match *self {
            Record::InitPage { special_size } => (Some(special_size), &[]),
            Record::DeleteTuple { offnum } => (Some(offnum), &[]),
            Record::Prune => (None, &[]),
            Record::InsertTuple { offnum, data } | Record::UpdateTuple { offnum, data } => {
                (Some(offnum), data)
            }
            Record::SetBits { offset, mask } | Record::ClearBits { offset, mask } => (Some(offset), mask),
            Record::PutBytes { offset, data } => (Some(offset), data),
            Record::Append { data } => (None, data),
        }
    }

    /// Appends the encoding to `out`. Does not check limits: a record built in memory with an
    /// empty payload or more than [`MAX_RECORD_LEN`] bytes encodes to something `decode` rejects.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let (field, payload) = self.parts();
        out.reserve(self.encoded_len());
        out.push(self.kind());
        if let Some(field) = field {
            out.extend_from_slice(&field.to_be_bytes());
        }
        out.extend_from_slice(payload);
    }

    /// The encoding in a new vector.
    pub fn encode_to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        self.encode(&mut out);
        out
    }

    /// Length of the encoding, kind byte included.
    pub fn encoded_len(&self) -> usize {
        let (field, payload) = self.parts();
        1 + field.map_or(0, |_| 2) + payload.len()
    }

    /// Applies the record to `page` and, on success, sets `pd_lsn` to `lsn`. Atomic: on error the
    /// page is unchanged.
    pub fn apply(&self, page: &mut Page, lsn: u64) -> Result<(), ApplyError> {
        let (_, payload) = self.parts();
        let needs_payload =
            !matches!(self, Record::InitPage { .. } | Record::DeleteTuple { .. } | Record::Prune);
        if needs_payload && payload.is_empty() {
            return Err(ApplyError::EmptyData { kind: self.kind_name() });
        }
        match *self {
            Record::InitPage { special_size } => init_page(page, special_size)?,
            Record::InsertTuple { offnum, data } => insert_tuple(page, offnum, data)?,
            Record::UpdateTuple { offnum, data } => update_tuple(page, offnum, data)?,
            Record::DeleteTuple { offnum } => delete_tuple(page, offnum)?,
            Record::Prune => prune(page)?,
            Record::SetBits { offset, mask } => {
                let target = byte_range(page, offset, mask.len())?;
                target.iter_mut().zip(mask).for_each(|(b, m)| *b |= m);
            }
            Record::ClearBits { offset, mask } => {
                let target = byte_range(page, offset, mask.len())?;
                target.iter_mut().zip(mask).for_each(|(b, m)| *b &= !m);
            }
            Record::PutBytes { offset, data } => byte_range(page, offset, data.len())?.copy_from_slice(data),
            Record::Append { data } => append(page, data)?,
        }
        set_page_lsn(page, lsn);
        Ok(())
    }
}

/// `page[offset..offset + len]`, or `OutOfPage` when it passes the end of the page.
fn byte_range(page: &mut Page, offset: u16, len: usize) -> Result<&mut [u8], ApplyError> {
    let start = usize::from(offset);
    let end = start.saturating_add(len);
    page.get_mut(start..end).ok_or(ApplyError::OutOfPage { start, end })
}

/// Converts a page offset or tuple length known to be below [`BLCKSZ`] to a header/pointer field.
fn field(value: usize) -> Result<u16, ApplyError> {
    u16::try_from(value)
        .ok()
        .filter(|&v| v <= ItemId::MAX_FIELD)
        .ok_or(ApplyError::OutOfPage { start: value, end: value })
}

/// Writes `data` at `off` and zero-fills up to `off + aligned`.
fn write_padded(page: &mut Page, off: usize, data: &[u8], aligned: usize) -> Result<(), ApplyError> {
    let end = off.saturating_add(aligned);
    let target = page.get_mut(off..end).ok_or(ApplyError::OutOfPage { start: off, end })?;
    let (head, pad) =
        target.split_at_mut_checked(data.len()).ok_or(ApplyError::OutOfPage { start: off, end })?;
    head.copy_from_slice(data);
    pad.fill(0);
    Ok(())
}

fn init_page(page: &mut Page, special_size: u16) -> Result<(), ApplyError> {
    let size = usize::from(special_size);
    if size % 8 != 0 || size > BLCKSZ - PAGE_HEADER_SIZE {
        return Err(ApplyError::BadSpecialSize { special_size });
    }
    let special = field(BLCKSZ - size)?;
    page.fill(0);
    set_pd_lower(page, PAGE_HEADER_SIZE as u16);
    set_pd_upper(page, special);
    set_pd_special(page, special);
    set_pd_pagesize_version(page, PAGE_SIZE_VERSION);
    Ok(())
}

/// The line pointer at `offnum`, which must exist and be `LP_NORMAL` with sound storage.
fn normal_tuple(page: &Page, bounds: &Bounds, offnum: u16) -> Result<ItemId, ApplyError> {
    let slot = usize::from(offnum);
    if slot == 0 || slot > bounds.maxoff() {
        return Err(ApplyError::NoTuple { offnum });
    }
    let id = item_id(page, slot).ok_or(ApplyError::NoTuple { offnum })?;
    if id.flags != LP_NORMAL {
        return Err(ApplyError::NotNormal { offnum, flags: id.flags });
    }
    check_pointer(bounds, slot, id)?;
    Ok(id)
}

fn check_pointer(bounds: &Bounds, slot: usize, id: ItemId) -> Result<std::ops::Range<usize>, ApplyError> {
    bounds.tuple_extent(id).ok_or(ApplyError::CorruptLinePointer {
        slot,
        off: id.off,
        len: id.len,
        upper: bounds.upper(),
        special: bounds.special(),
    })
}

/// Takes `MAXALIGN(len)` bytes (plus `extra` for a new line pointer) below `pd_upper`; returns
/// the new `pd_upper` where the data goes.
fn take_space(bounds: &Bounds, len: usize, extra: usize) -> Result<usize, ApplyError> {
    let aligned = maxalign(len);
    let need = aligned.saturating_add(extra);
    if need > bounds.free() {
        return Err(ApplyError::PageFull { need, free: bounds.free() });
    }
    Ok(bounds.upper() - aligned)
}

fn insert_tuple(page: &mut Page, offnum: u16, data: &[u8]) -> Result<(), ApplyError> {
    let bounds = check_header(page)?;
    let maxoff = bounds.maxoff();
    let is_unused = |slot| item_id(page, slot).map(|id| id.flags) == Some(LP_UNUSED);
    let slot = match usize::from(offnum) {
        0 => (1..=maxoff).find(|&slot| is_unused(slot)).unwrap_or(maxoff + 1),
        slot if slot == maxoff + 1 || (slot <= maxoff && is_unused(slot)) => slot,
        slot if slot > maxoff => return Err(ApplyError::InsertPastEnd { offnum, maxoff }),
        slot => {
            let flags = item_id(page, slot).map_or(LP_UNUSED, |id| id.flags);
            return Err(ApplyError::SlotInUse { offnum, flags });
        }
    };
    let new_slot = slot > maxoff;
    let off = take_space(&bounds, data.len(), if new_slot { ITEM_ID_SIZE } else { 0 })?;
    let id = ItemId { off: field(off)?, flags: LP_NORMAL, len: field(data.len())? };
    let lower = field(bounds.lower() + if new_slot { ITEM_ID_SIZE } else { 0 })?;
    write_padded(page, off, data, maxalign(data.len()))?;
    set_item_id(page, slot, id).ok_or(ApplyError::NoTuple { offnum })?;
    set_pd_upper(page, id.off);
    set_pd_lower(page, lower);
    Ok(())
}

fn update_tuple(page: &mut Page, offnum: u16, data: &[u8]) -> Result<(), ApplyError> {
    let bounds = check_header(page)?;
    let old = normal_tuple(page, &bounds, offnum)?;
    let old_aligned = maxalign(usize::from(old.len));
    let (off, aligned, in_place) = if maxalign(data.len()) <= old_aligned {
        (usize::from(old.off), old_aligned, true)
    } else {
        (take_space(&bounds, data.len(), 0)?, maxalign(data.len()), false)
    };
    let id = ItemId { off: field(off)?, flags: LP_NORMAL, len: field(data.len())? };
    write_padded(page, off, data, aligned)?;
    set_item_id(page, usize::from(offnum), id).ok_or(ApplyError::NoTuple { offnum })?;
    if !in_place {
        set_pd_upper(page, id.off);
    }
    Ok(())
}

fn delete_tuple(page: &mut Page, offnum: u16) -> Result<(), ApplyError> {
    let bounds = check_header(page)?;
    let id = normal_tuple(page, &bounds, offnum)?;
    set_item_id(page, usize::from(offnum), ItemId { flags: LP_DEAD, ..id })
        .ok_or(ApplyError::NoTuple { offnum })
}

fn append(page: &mut Page, data: &[u8]) -> Result<(), ApplyError> {
    let bounds = check_header(page)?;
    let off = take_space(&bounds, data.len(), 0)?;
    let upper = field(off)?;
    write_padded(page, off, data, maxalign(data.len()))?;
    set_pd_upper(page, upper);
    Ok(())
}

/// A live tuple to move: current offset, slot, length.
struct Live {
    off: usize,
    slot: usize,
    len: usize,
}

/// PostgreSQL's `PageRepairFragmentation` then `PageTruncateLinePointerArray`, as the spec says.
fn prune(page: &mut Page) -> Result<(), ApplyError> {
    let bounds = check_header(page)?;
    let maxoff = bounds.maxoff();
    // Validate everything before touching the page.
    let mut live = Vec::with_capacity(maxoff);
    let mut need = 0usize;
    for slot in 1..=maxoff {
        let Some(id) = item_id(page, slot) else { break };
        if id.flags == LP_NORMAL {
            check_pointer(&bounds, slot, id)?;
            need += maxalign(usize::from(id.len));
            live.push(Live { off: usize::from(id.off), slot, len: usize::from(id.len) });
        }
    }
    let available = bounds.special() - bounds.lower();
    if need > available {
        return Err(ApplyError::CorruptTupleLengths { need, available });
    }
    live.sort_unstable_by(|a, b| b.off.cmp(&a.off).then(a.slot.cmp(&b.slot)));

    let old = *page;
    page.get_mut(bounds.upper()..bounds.special())
        .ok_or(ApplyError::OutOfPage { start: bounds.upper(), end: bounds.special() })?
        .fill(0);
    for slot in 1..=maxoff {
        if matches!(item_id(page, slot), Some(id) if id.flags == LP_UNUSED || id.flags == LP_DEAD) {
            set_item_id(page, slot, ItemId::UNUSED).ok_or(ApplyError::NoTuple { offnum: 0 })?;
        }
    }
    let mut upper = bounds.special();
    for t in &live {
        let aligned = maxalign(t.len);
        upper -= aligned;
        let end = t.off + t.len;
        let data = old.get(t.off..end).ok_or(ApplyError::OutOfPage { start: t.off, end })?;
        write_padded(page, upper, data, aligned)?;
        let id = ItemId { off: field(upper)?, flags: LP_NORMAL, len: field(t.len)? };
        set_item_id(page, t.slot, id).ok_or(ApplyError::NoTuple { offnum: 0 })?;
    }
    let kept = (1..=maxoff).rev().find(|&slot| item_id(page, slot).is_some_and(|id| id.flags != LP_UNUSED));
    set_pd_lower(page, field(PAGE_HEADER_SIZE + ITEM_ID_SIZE * kept.unwrap_or(0))?);
    set_pd_upper(page, field(upper)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page::LP_REDIRECT;
    use proptest::prelude::*;

    const VERSION: u16 = 8192 | 4;

    /// A raw line pointer, spelled out from the layout table.
    fn lp(off: u32, flags: u32, len: u32) -> u32 {
        off | (flags << 15) | (len << 17)
    }

    /// Writes `bytes` at `at`.
    fn put(page: &mut Page, at: usize, bytes: &[u8]) {
        page[at..at + bytes.len()].copy_from_slice(bytes);
    }

    /// Writes the header fields the records change, byte by byte.
    fn header(page: &mut Page, lsn: u64, lower: u16, upper: u16, special: u16) {
        put(page, 0, &((lsn >> 32) as u32).to_le_bytes());
        put(page, 4, &(lsn as u32).to_le_bytes());
        put(page, 12, &lower.to_le_bytes());
        put(page, 14, &upper.to_le_bytes());
        put(page, 16, &special.to_le_bytes());
        put(page, 18, &VERSION.to_le_bytes());
    }

    /// A zero page with this header, these line pointers from slot 1 and these bytes, built
    /// without the code under test.
    fn raw_page(
        lsn: u64,
        (lower, upper, special): (u16, u16, u16),
        lps: &[u32],
        bytes: &[(usize, &[u8])],
    ) -> Box<Page> {
        let mut page = Box::new([0u8; BLCKSZ]);
        header(&mut page, lsn, lower, upper, special);
        for (i, raw) in lps.iter().enumerate() {
            put(&mut page, 24 + 4 * i, &raw.to_le_bytes());
        }
        for (at, b) in bytes {
            put(&mut page, *at, b);
        }
        page
    }

    fn apply(page: &mut Page, record: Record<'_>, lsn: u64) {
        if let Err(e) = record.apply(page, lsn) {
            panic!("{record:?} failed: {e}");
        }
    }

    /// Applies `record`, expects `want` and checks that the page did not change.
    fn assert_fails_unchanged(page: &mut Page, record: Record<'_>, want: ApplyError) {
        let before = *page;
        assert_eq!(record.apply(page, 99), Err(want));
        assert!(page[..] == before[..], "{record:?} changed the page although it failed");
    }

    /// Page with special 8176, slot 1 normal 13 bytes at 8160, slot 2 dead 5 bytes at 8152,
    /// slot 3 unused.
    fn three_slots() -> Box<Page> {
        raw_page(
            7,
            (36, 8152, 8176),
            &[lp(8160, 1, 13), lp(8152, 3, 5), 0],
            &[(8160, &[0x11; 13]), (8152, &[0x22; 5])],
        )
    }

    #[test]
    fn init_page_on_garbage_gives_zero_page_with_fresh_header() {
        let mut page = Box::new([0xAB; BLCKSZ]);
        apply(&mut page, Record::InitPage { special_size: 16 }, 0x1_0000_0002);
        assert!(page[..] == raw_page(0x1_0000_0002, (24, 8176, 8176), &[], &[])[..]);
        apply(&mut page, Record::InitPage { special_size: 8168 }, 3);
        assert!(page[..] == raw_page(3, (24, 24, 24), &[], &[])[..]);
    }

    #[test]
    fn init_page_with_bad_special_size_fails_with_bad_special_size() {
        let mut page = Box::new([0xAB; BLCKSZ]);
        for special_size in [9, 8176, 8192, u16::MAX] {
            assert_fails_unchanged(
                &mut page,
                Record::InitPage { special_size },
                ApplyError::BadSpecialSize { special_size },
            );
        }
    }

    #[test]
    fn insert_into_fresh_page_places_padded_tuple_below_special() {
        let mut page = raw_page(0, (24, 8176, 8176), &[], &[]);
        page[24..8176].fill(0xEE);
        apply(&mut page, Record::InsertTuple { offnum: 0, data: &[0xAA; 10] }, 5);
        let mut want = raw_page(5, (28, 8160, 8176), &[lp(8160, 1, 10)], &[(8160, &[0xAA; 10])]);
        want[28..8160].fill(0xEE);
        assert!(page[..] == want[..]);
    }

    #[test]
    fn insert_with_offnum_zero_reuses_first_unused_slot() {
        let mut page = three_slots();
        page[40] = 0x77; // garbage in the free space stays
        apply(&mut page, Record::InsertTuple { offnum: 0, data: b"abc" }, 8);
        let want = raw_page(
            8,
            (36, 8144, 8176),
            &[lp(8160, 1, 13), lp(8152, 3, 5), lp(8144, 1, 3)],
            &[(8160, &[0x11; 13]), (8152, &[0x22; 5]), (8144, b"abc"), (40, &[0x77])],
        );
        assert!(page[..] == want[..]);
    }

    #[test]
    fn insert_at_maxoff_plus_one_adds_a_slot() {
        let mut page = three_slots();
        apply(&mut page, Record::InsertTuple { offnum: 4, data: &[0x33; 8] }, 8);
        let want = raw_page(
            8,
            (40, 8144, 8176),
            &[lp(8160, 1, 13), lp(8152, 3, 5), 0, lp(8144, 1, 8)],
            &[(8160, &[0x11; 13]), (8152, &[0x22; 5]), (8144, &[0x33; 8])],
        );
        assert!(page[..] == want[..]);
    }

    #[test]
    fn insert_into_named_unused_slot_keeps_pd_lower() {
        let mut page = three_slots();
        apply(&mut page, Record::InsertTuple { offnum: 3, data: &[0x44; 9] }, 8);
        let want = raw_page(
            8,
            (36, 8136, 8176),
            &[lp(8160, 1, 13), lp(8152, 3, 5), lp(8136, 1, 9)],
            &[(8160, &[0x11; 13]), (8152, &[0x22; 5]), (8136, &[0x44; 9])],
        );
        assert!(page[..] == want[..]);
    }

    #[test]
    fn insert_past_maxoff_plus_one_fails_with_insert_past_end() {
        let mut page = three_slots();
        let rec = Record::InsertTuple { offnum: 5, data: b"x" };
        assert_fails_unchanged(&mut page, rec, ApplyError::InsertPastEnd { offnum: 5, maxoff: 3 });
        let rec = Record::InsertTuple { offnum: u16::MAX, data: b"x" };
        assert_fails_unchanged(&mut page, rec, ApplyError::InsertPastEnd { offnum: u16::MAX, maxoff: 3 });
    }

    #[test]
    fn insert_into_used_slot_fails_with_slot_in_use() {
        let mut page = three_slots();
        let rec = Record::InsertTuple { offnum: 2, data: b"x" };
        assert_fails_unchanged(&mut page, rec, ApplyError::SlotInUse { offnum: 2, flags: LP_DEAD });
        assert_eq!(
            ApplyError::SlotInUse { offnum: 2, flags: LP_DEAD }.to_string(),
            "cannot insert at offset 2: slot is LP_DEAD"
        );
    }

    #[test]
    fn insert_into_full_page_fails_with_page_full() {
        // 12 bytes free: a 9-byte tuple needs 16 + 4 for a new slot.
        let mut page = raw_page(0, (28, 40, 8176), &[lp(8160, 1, 8)], &[]);
        let rec = Record::InsertTuple { offnum: 0, data: &[1; 9] };
        assert_fails_unchanged(&mut page, rec, ApplyError::PageFull { need: 20, free: 12 });
        assert_eq!(
            ApplyError::PageFull { need: 112, free: 40 }.to_string(),
            "page full: need 112 bytes, 40 free"
        );
    }

    #[test]
    fn insert_that_exactly_fills_page_succeeds() {
        let mut page = raw_page(0, (24, 44, 8192), &[], &[]);
        apply(&mut page, Record::InsertTuple { offnum: 1, data: &[9; 16] }, 1);
        assert!(page[..] == raw_page(1, (28, 28, 8192), &[lp(28, 1, 16)], &[(28, &[9; 16])])[..]);
    }

    #[test]
    fn insert_into_corrupt_header_fails_with_corrupt_header() {
        let mut page = raw_page(0, (20, 8192, 8192), &[], &[]);
        let want = ApplyError::CorruptHeader(HeaderError::LowerBelowHeader { lower: 20 });
        assert_eq!(want.to_string(), "corrupt page header: pd_lower 20 < 24");
        assert_fails_unchanged(&mut page, Record::InsertTuple { offnum: 0, data: b"x" }, want);
        let mut page = raw_page(0, (26, 8192, 8192), &[], &[]);
        let want = ApplyError::CorruptHeader(HeaderError::LowerMisaligned { lower: 26 });
        assert_fails_unchanged(&mut page, Record::InsertTuple { offnum: 0, data: b"x" }, want);
    }

    #[test]
    fn update_with_same_aligned_size_rewrites_in_place() {
        let mut page = three_slots();
        apply(&mut page, Record::UpdateTuple { offnum: 1, data: &[0x55; 9] }, 8);
        let want = raw_page(
            8,
            (36, 8152, 8176),
            &[lp(8160, 1, 9), lp(8152, 3, 5), 0],
            &[(8160, &[0x55; 9]), (8152, &[0x22; 5])],
        );
        assert!(page[..] == want[..]);
    }

    #[test]
    fn update_with_larger_aligned_size_moves_below_pd_upper() {
        let mut page = three_slots();
        apply(&mut page, Record::UpdateTuple { offnum: 1, data: &[0x66; 17] }, 8);
        let want = raw_page(
            8,
            (36, 8128, 8176),
            &[lp(8128, 1, 17), lp(8152, 3, 5), 0],
            &[(8160, &[0x11; 13]), (8152, &[0x22; 5]), (8128, &[0x66; 17])],
        );
        assert!(page[..] == want[..]);
    }

    #[test]
    fn update_of_missing_or_non_normal_tuple_fails() {
        let mut page = three_slots();
        for offnum in [0, 4, 7, u16::MAX] {
            let rec = Record::UpdateTuple { offnum, data: b"x" };
            assert_fails_unchanged(&mut page, rec, ApplyError::NoTuple { offnum });
        }
        assert_eq!(ApplyError::NoTuple { offnum: 7 }.to_string(), "no tuple at offset 7");
        let rec = Record::UpdateTuple { offnum: 2, data: b"x" };
        assert_fails_unchanged(&mut page, rec, ApplyError::NotNormal { offnum: 2, flags: LP_DEAD });
        let rec = Record::UpdateTuple { offnum: 3, data: b"x" };
        assert_fails_unchanged(&mut page, rec, ApplyError::NotNormal { offnum: 3, flags: LP_UNUSED });
    }

    #[test]
    fn update_elsewhere_on_full_page_fails_with_page_full() {
        let mut page = raw_page(0, (28, 40, 8192), &[lp(8184, 1, 8)], &[]);
        let rec = Record::UpdateTuple { offnum: 1, data: &[0; 9] };
        assert_fails_unchanged(&mut page, rec, ApplyError::PageFull { need: 16, free: 12 });
    }

    #[test]
    fn update_of_pointer_outside_tuple_area_fails_with_corrupt_line_pointer() {
        let corrupt =
            |off, len| ApplyError::CorruptLinePointer { slot: 1, off, len, upper: 8000, special: 8176 };
        for (off, len) in [(7992, 8), (8176, 8), (8170, 3), (8100, 0), (0x7FFF, 0x7FFF)] {
            let mut page = raw_page(0, (28, 8000, 8176), &[lp(off.into(), 1, len.into())], &[]);
            assert_fails_unchanged(
                &mut page,
                Record::UpdateTuple { offnum: 1, data: b"x" },
                corrupt(off, len),
            );
            assert_fails_unchanged(&mut page, Record::DeleteTuple { offnum: 1 }, corrupt(off, len));
            assert_fails_unchanged(&mut page, Record::Prune, corrupt(off, len));
        }
    }

    #[test]
    fn delete_of_normal_tuple_marks_it_dead_and_keeps_storage() {
        let mut page = three_slots();
        apply(&mut page, Record::DeleteTuple { offnum: 1 }, 9);
        let want = raw_page(
            9,
            (36, 8152, 8176),
            &[lp(8160, 3, 13), lp(8152, 3, 5), 0],
            &[(8160, &[0x11; 13]), (8152, &[0x22; 5])],
        );
        assert!(page[..] == want[..]);
    }

    #[test]
    fn delete_of_non_normal_tuple_fails_with_not_normal() {
        let mut page = three_slots();
        assert_fails_unchanged(
            &mut page,
            Record::DeleteTuple { offnum: 2 },
            ApplyError::NotNormal { offnum: 2, flags: LP_DEAD },
        );
        assert_fails_unchanged(
            &mut page,
            Record::DeleteTuple { offnum: 3 },
            ApplyError::NotNormal { offnum: 3, flags: LP_UNUSED },
        );
        assert_fails_unchanged(
            &mut page,
            Record::DeleteTuple { offnum: 4 },
            ApplyError::NoTuple { offnum: 4 },
        );
        let mut page = raw_page(0, (28, 8000, 8176), &[lp(8, 2, 0)], &[]);
        assert_fails_unchanged(
            &mut page,
            Record::DeleteTuple { offnum: 1 },
            ApplyError::NotNormal { offnum: 1, flags: LP_REDIRECT },
        );
    }

    #[test]
    fn delete_on_corrupt_header_fails_with_corrupt_header() {
        let mut page = raw_page(0, (28, 8192, 8184), &[lp(8184, 1, 8)], &[]);
        let want = ApplyError::CorruptHeader(HeaderError::UpperAboveSpecial { upper: 8192, special: 8184 });
        assert_fails_unchanged(&mut page, Record::DeleteTuple { offnum: 1 }, want);
    }

    #[test]
    fn prune_reclaims_dead_and_garbage_and_keeps_redirects() {
        // Slot 1 redirect to 3, slot 2 dead, slot 3 normal at 8100 (garbage around it), slot 4 unused
        // with stale fields, slot 5 dead: 2 and 4 become zero, 5 is truncated.
        let mut page = raw_page(
            1,
            (44, 8000, 8184),
            &[lp(3, 2, 0), lp(8050, 3, 10), lp(8100, 1, 11), lp(8000, 0, 4), lp(8001, 3, 1)],
            &[(8100, &[0x33; 11])],
        );
        page[8000..8100].fill(0xEE);
        page[8111..8184].fill(0xEF);
        page[8184..].fill(0x5C); // special space stays
        apply(&mut page, Record::Prune, 2);
        let mut want =
            raw_page(2, (36, 8168, 8184), &[lp(3, 2, 0), 0, lp(8168, 1, 11)], &[(8168, &[0x33; 11])]);
        want[8184..].fill(0x5C);
        assert!(page[..] == want[..]);
    }

    #[test]
    fn prune_of_page_without_tuples_empties_it() {
        let mut page = raw_page(1, (32, 8000, 8192), &[lp(8000, 3, 8), 0], &[(8000, &[1; 192])]);
        apply(&mut page, Record::Prune, 2);
        assert!(page[..] == raw_page(2, (24, 8192, 8192), &[], &[])[..]);
    }

    #[test]
    fn prune_with_equal_offsets_orders_by_slot_and_copies_both() {
        let mut page =
            raw_page(1, (32, 8176, 8192), &[lp(8184, 1, 3), lp(8184, 1, 8)], &[(8184, b"abcdefgh")]);
        apply(&mut page, Record::Prune, 2);
        let want = raw_page(
            2,
            (32, 8176, 8192),
            &[lp(8184, 1, 3), lp(8176, 1, 8)],
            &[(8184, b"abc"), (8176, b"abcdefgh")],
        );
        assert!(page[..] == want[..]);
    }

    #[test]
    fn prune_with_overlapping_tuples_that_do_not_fit_fails_with_corrupt_tuple_lengths() {
        // Three pointers share 4000 bytes at 4192: re-packed they would need 12000.
        let lps = [lp(4192, 1, 4000); 3];
        let mut page = raw_page(1, (36, 4192, 8192), &lps, &[]);
        let want = ApplyError::CorruptTupleLengths { need: 12000, available: 8192 - 36 };
        assert_fails_unchanged(&mut page, Record::Prune, want);
    }

    #[test]
    fn bit_records_change_only_their_bytes_on_any_header() {
        let mut page = Box::new([0xF0; BLCKSZ]);
        apply(&mut page, Record::SetBits { offset: 100, mask: &[0x0F, 0x01] }, 1);
        apply(&mut page, Record::ClearBits { offset: 8190, mask: &[0x30, 0xFF] }, 2);
        apply(&mut page, Record::PutBytes { offset: 4000, data: b"xyz" }, 3);
        let mut want = Box::new([0xF0; BLCKSZ]);
        put(&mut want, 0, &[0, 0, 0, 0, 3, 0, 0, 0]);
        put(&mut want, 100, &[0xFF, 0xF1]);
        put(&mut want, 8190, &[0xC0, 0x00]);
        put(&mut want, 4000, b"xyz");
        assert!(page[..] == want[..]);
    }

    #[test]
    fn put_bytes_on_pd_lsn_is_overwritten_by_the_lsn() {
        let mut page = Box::new([0u8; BLCKSZ]);
        apply(&mut page, Record::PutBytes { offset: 2, data: &[0xFF; 10] }, 0x0000_0001_0000_0002);
        let want = raw_page(0, (0, 0, 0), &[], &[]);
        let mut want = *want;
        put(&mut want, 0, &[1, 0, 0, 0, 2, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF]);
        put(&mut want, 18, &[0, 0]);
        assert!(page[..] == want[..]);
    }

    #[test]
    fn byte_records_past_the_page_fail_with_out_of_page() {
        let mut page = Box::new([0x42; BLCKSZ]);
        let oob = ApplyError::OutOfPage { start: 8190, end: 8200 };
        assert_eq!(oob.to_string(), "range 8190..8200 is outside the page");
        assert_fails_unchanged(&mut page, Record::SetBits { offset: 8190, mask: &[1; 10] }, oob.clone());
        assert_fails_unchanged(&mut page, Record::ClearBits { offset: 8190, mask: &[1; 10] }, oob.clone());
        assert_fails_unchanged(&mut page, Record::PutBytes { offset: 8190, data: &[1; 10] }, oob);
        let far = ApplyError::OutOfPage { start: 65535, end: 65536 };
        assert_fails_unchanged(&mut page, Record::PutBytes { offset: u16::MAX, data: b"x" }, far);
    }

    #[test]
    fn append_writes_padded_data_below_pd_upper_without_pointer() {
        let mut page = raw_page(0, (24, 8192, 8192), &[], &[]);
        page[100..8192].fill(0xEE);
        apply(&mut page, Record::Append { data: b"hello" }, 4);
        let mut want = raw_page(4, (24, 8184, 8192), &[], &[(8184, b"hello")]);
        want[100..8184].fill(0xEE);
        assert!(page[..] == want[..]);
    }

    #[test]
    fn append_on_full_or_corrupt_page_fails() {
        let mut page = raw_page(0, (24, 32, 8192), &[], &[]);
        assert_fails_unchanged(
            &mut page,
            Record::Append { data: &[0; 9] },
            ApplyError::PageFull { need: 16, free: 8 },
        );
        let mut page = raw_page(0, (24, 32, 8196), &[], &[]);
        let want = ApplyError::CorruptHeader(HeaderError::SpecialPastPage { special: 8196 });
        assert_fails_unchanged(&mut page, Record::Append { data: b"x" }, want);
    }

    #[test]
    fn apply_of_in_memory_record_without_data_fails_with_empty_data() {
        let mut page = raw_page(0, (24, 8192, 8192), &[], &[]);
        assert_fails_unchanged(
            &mut page,
            Record::InsertTuple { offnum: 0, data: &[] },
            ApplyError::EmptyData { kind: "insert_tuple" },
        );
        assert_fails_unchanged(
            &mut page,
            Record::Append { data: &[] },
            ApplyError::EmptyData { kind: "append" },
        );
        assert_fails_unchanged(
            &mut page,
            Record::SetBits { offset: 0, mask: &[] },
            ApplyError::EmptyData { kind: "set_bits" },
        );
    }

    #[test]
    fn sequence_of_inserts_updates_deletes_and_prune_gives_exact_layout() {
        let mut page = Box::new([0x5A; BLCKSZ]);
        apply(&mut page, Record::InitPage { special_size: 16 }, 1);
        apply(&mut page, Record::InsertTuple { offnum: 0, data: &[b'A'; 10] }, 2); // slot 1 at 8160
        apply(&mut page, Record::InsertTuple { offnum: 0, data: &[b'B'; 20] }, 3); // slot 2 at 8136
        apply(&mut page, Record::InsertTuple { offnum: 3, data: &[b'C'; 5] }, 4); // slot 3 at 8128
        apply(&mut page, Record::UpdateTuple { offnum: 3, data: &[b'c'; 7] }, 5); // in place
        apply(&mut page, Record::UpdateTuple { offnum: 1, data: &[b'a'; 20] }, 6); // elsewhere, 8104
        apply(&mut page, Record::InsertTuple { offnum: 0, data: b"DDD" }, 7); // slot 4 at 8096
        apply(&mut page, Record::DeleteTuple { offnum: 2 }, 8);
        apply(&mut page, Record::DeleteTuple { offnum: 4 }, 9);
        let before_prune = raw_page(
            9,
            (40, 8096, 8176),
            &[lp(8104, 1, 20), lp(8136, 3, 20), lp(8128, 1, 7), lp(8096, 3, 3)],
            &[
                (8096, b"DDD"),
                (8104, &[b'a'; 20]),
                (8128, &[b'c'; 7]),
                (8136, &[b'B'; 20]),
                (8160, &[b'A'; 10]),
            ],
        );
        assert!(page[..] == before_prune[..]);

        apply(&mut page, Record::Prune, 10);
        // Highest offset first: slot 3 (8128) goes right below pd_special, then slot 1.
        let after_prune = raw_page(
            10,
            (36, 8144, 8176),
            &[lp(8144, 1, 20), 0, lp(8168, 1, 7)],
            &[(8144, &[b'a'; 20]), (8168, &[b'c'; 7])],
        );
        assert!(page[..] == after_prune[..]);

        apply(&mut page, Record::InsertTuple { offnum: 0, data: &[b'E'; 8] }, 11);
        let reused = raw_page(
            11,
            (36, 8136, 8176),
            &[lp(8144, 1, 20), lp(8136, 1, 8), lp(8168, 1, 7)],
            &[(8144, &[b'a'; 20]), (8168, &[b'c'; 7]), (8136, &[b'E'; 8])],
        );
        assert!(page[..] == reused[..]);
    }

    #[test]
    fn encode_writes_kind_then_big_endian_field_then_payload() {
        assert_eq!(
            Record::InsertTuple { offnum: 0x0102, data: b"xy" }.encode_to_vec(),
            [2, 1, 2, b'x', b'y']
        );
        assert_eq!(Record::InitPage { special_size: 16 }.encode_to_vec(), [1, 0, 16]);
        assert_eq!(Record::Prune.encode_to_vec(), [5]);
        assert_eq!(Record::Append { data: b"z" }.encode_to_vec(), [9, b'z']);
        let mut out = vec![0xAA];
        Record::DeleteTuple { offnum: 7 }.encode(&mut out);
        assert_eq!(out, [0xAA, 4, 0, 7]);
    }

    #[test]
    fn kind_name_names_every_kind() {
        let names = [
            Record::InitPage { special_size: 0 },
            Record::InsertTuple { offnum: 0, data: b"x" },
            Record::UpdateTuple { offnum: 0, data: b"x" },
            Record::DeleteTuple { offnum: 0 },
            Record::Prune,
            Record::SetBits { offset: 0, mask: b"x" },
            Record::ClearBits { offset: 0, mask: b"x" },
            Record::PutBytes { offset: 0, data: b"x" },
            Record::Append { data: b"x" },
        ]
        .map(|r| r.kind_name());
        let want = [
            "init_page",
            "insert_tuple",
            "update_tuple",
            "delete_tuple",
            "prune",
            "set_bits",
            "clear_bits",
            "put_bytes",
            "append",
        ];
        assert_eq!(names, want);
    }

    #[test]
    fn decode_of_empty_or_too_long_record_fails() {
        assert_eq!(Record::decode(&[]), Err(RecordError::Empty));
        let mut long = vec![KIND_APPEND; MAX_RECORD_LEN + 1];
        assert_eq!(Record::decode(&long), Err(RecordError::TooLong { len: 16385 }));
        long.pop();
        assert_eq!(Record::decode(&long), Ok(Record::Append { data: &long[1..] }));
    }

    #[test]
    fn decode_of_unknown_or_reserved_kind_fails() {
        assert_eq!(Record::decode(&[0x42, 0, 0]), Err(RecordError::UnknownKind { kind: 0x42 }));
        assert_eq!(RecordError::UnknownKind { kind: 0x42 }.to_string(), "unknown record kind 0x42");
        assert_eq!(Record::decode(&[0x00]), Err(RecordError::UnknownKind { kind: 0 }));
        assert_eq!(Record::decode(&[0x10, 1]), Err(RecordError::ReservedKind { kind: 0x10 }));
        assert_eq!(Record::decode(&[0x1f]), Err(RecordError::ReservedKind { kind: 0x1f }));
        assert_eq!(Record::decode(&[0x20]), Err(RecordError::UnknownKind { kind: 0x20 }));
    }

    #[test]
    fn decode_of_wrong_body_length_fails_with_bad_body_length() {
        let bad = |kind, len, expected| Err(RecordError::BadBodyLength { kind, len, expected });
        assert_eq!(Record::decode(&[1, 0]), bad("init_page", 1, BodyLen::Exactly(2)));
        assert_eq!(Record::decode(&[1, 0, 0, 0]), bad("init_page", 3, BodyLen::Exactly(2)));
        assert_eq!(Record::decode(&[2, 0, 1]), bad("insert_tuple", 2, BodyLen::AtLeast(3)));
        assert_eq!(Record::decode(&[3]), bad("update_tuple", 0, BodyLen::AtLeast(3)));
        assert_eq!(Record::decode(&[4, 0]), bad("delete_tuple", 1, BodyLen::Exactly(2)));
        assert_eq!(Record::decode(&[5, 0]), bad("prune", 1, BodyLen::Exactly(0)));
        assert_eq!(Record::decode(&[6, 0, 0]), bad("set_bits", 2, BodyLen::AtLeast(3)));
        assert_eq!(Record::decode(&[7, 0]), bad("clear_bits", 1, BodyLen::AtLeast(3)));
        assert_eq!(Record::decode(&[8, 0, 0]), bad("put_bytes", 2, BodyLen::AtLeast(3)));
        assert_eq!(Record::decode(&[9]), bad("append", 0, BodyLen::AtLeast(1)));
        assert_eq!(
            RecordError::BadBodyLength { kind: "insert_tuple", len: 2, expected: BodyLen::AtLeast(3) }
                .to_string(),
            "insert_tuple record body is 2 bytes, expected at least 3"
        );
    }

    #[test]
    fn decode_reads_big_endian_fields() {
        assert_eq!(Record::decode(&[1, 0x01, 0x00]), Ok(Record::InitPage { special_size: 256 }));
        assert_eq!(Record::decode(&[4, 0x12, 0x34]), Ok(Record::DeleteTuple { offnum: 0x1234 }));
        assert_eq!(Record::decode(&[7, 0, 9, 0xF0]), Ok(Record::ClearBits { offset: 9, mask: &[0xF0] }));
        assert_eq!(Record::decode(&[5]), Ok(Record::Prune));
    }

    /// An owned record: (kind 1..=9, field, payload). Payloads are non-empty. Tuple kinds and
    /// small offsets are favoured so that built pages hold tuples and records often succeed.
    fn arb_parts() -> impl Strategy<Value = (u8, u16, Vec<u8>)> {
        let kind =
            prop_oneof![1 => Just(KIND_INIT_PAGE), 4 => Just(KIND_INSERT_TUPLE), 2 => 3u8..=5, 2 => 6u8..=9];
        let field = prop_oneof![
            4 => 0u16..8,
            1 => 0u16..24,
            1 => (0u16..1100).prop_map(|v| v * 8),
            1 => any::<u16>(),
        ];
        let payload = prop_oneof![
            4 => prop::collection::vec(any::<u8>(), 1..64),
            1 => prop::collection::vec(any::<u8>(), 1..9000),
        ];
        (kind, field, payload)
    }

    fn record_from((kind, field, payload): &(u8, u16, Vec<u8>)) -> Record<'_> {
        let (field, data) = (*field, payload.as_slice());
        match kind {
            1 => Record::InitPage { special_size: field },
            2 => Record::InsertTuple { offnum: field, data },
            3 => Record::UpdateTuple { offnum: field, data },
            4 => Record::DeleteTuple { offnum: field },
            5 => Record::Prune,
            6 => Record::SetBits { offset: field, mask: data },
            7 => Record::ClearBits { offset: field, mask: data },
            8 => Record::PutBytes { offset: field, data },
            _ => Record::Append { data },
        }
    }

    /// Pages: random bytes, a valid header over random bytes, or a page built by records.
    fn arb_page() -> impl Strategy<Value = Box<Page>> {
        let garbage = prop::collection::vec(any::<u8>(), BLCKSZ);
        let header_over_garbage = (garbage.clone(), 0usize..64, 0usize..=8192, 0usize..=1024).prop_map(
            |(bytes, slots, upper, special_size)| {
                let mut page = Box::new([0u8; BLCKSZ]);
                page.copy_from_slice(&bytes);
                let lower = 24 + 4 * slots;
                let special = 8192 - special_size * 8 % ((8192 - lower) / 8 * 8 + 8);
                let upper = upper.clamp(lower, special);
                header(&mut page, 0, lower as u16, upper as u16, special as u16);
                page
            },
        );
        let tuple_record = (
            prop_oneof![4 => Just(KIND_INSERT_TUPLE), 1 => 3u8..=5, 1 => Just(KIND_APPEND)],
            0u16..6,
            prop::collection::vec(any::<u8>(), 1..200),
        );
        let built = prop::collection::vec(tuple_record, 0..24).prop_map(|records| {
            let mut page = Box::new([0u8; BLCKSZ]);
            apply(&mut page, Record::InitPage { special_size: 16 }, 1);
            for parts in &records {
                let _ = record_from(parts).apply(&mut page, 2);
            }
            page
        });
        prop_oneof![
            garbage.prop_map(|b| Box::new(<[u8; BLCKSZ]>::try_from(b).expect("len"))),
            header_over_garbage,
            built
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn encode_then_decode_gives_the_same_record(parts in arb_parts()) {
            let record = record_from(&parts);
            let bytes = record.encode_to_vec();
            prop_assert_eq!(bytes.len(), record.encoded_len());
            prop_assert_eq!(Record::decode(&bytes), Ok(record));
        }

        #[test]
        fn decode_of_arbitrary_bytes_never_panics_and_reencodes_exactly(
            bytes in prop_oneof![
                prop::collection::vec(any::<u8>(), 0..40),
                (0u8..0x22, prop::collection::vec(any::<u8>(), 0..5)).prop_map(|(k, mut v)| { v.insert(0, k); v }),
                prop::collection::vec(any::<u8>(), 16380..16390),
            ]
        ) {
            if let Ok(record) = Record::decode(&bytes) {
                prop_assert_eq!(record.encode_to_vec(), bytes);
            }
        }

        #[test]
        fn apply_to_any_page_never_panics_and_fails_without_change(
            mut page in arb_page(), parts in arb_parts(), lsn in any::<u64>()
        ) {
            let record = record_from(&parts);
            let before = *page;
            let was_valid = check_header(&before).is_ok();
            match record.apply(&mut page, lsn) {
                Ok(()) => {
                    prop_assert_eq!(crate::page::page_lsn(&page), lsn);
                    let tuple_kind = matches!(record, Record::InitPage { .. } | Record::InsertTuple { .. }
                        | Record::UpdateTuple { .. } | Record::DeleteTuple { .. } | Record::Prune | Record::Append { .. });
                    if tuple_kind && (was_valid || matches!(record, Record::InitPage { .. })) {
                        prop_assert!(check_header(&page).is_ok(), "{:?} broke the header", record);
                    }
                }
                Err(_) => prop_assert!(page[..] == before[..], "{:?} failed but changed the page", record),
            }
        }

        #[test]
        fn prune_keeps_every_normal_tuple_and_nothing_else(page in arb_page()) {
            let mut page = page;
            let Ok(bounds) = check_header(&page) else { return Ok(()) };
            let live: Vec<(usize, Vec<u8>)> = (1..=bounds.maxoff())
                .filter_map(|slot| item_id(&page, slot).filter(|id| id.flags == LP_NORMAL).map(|id| (slot, id)))
                .filter_map(|(slot, id)| {
                    let start = usize::from(id.off);
                    page.get(start..start + usize::from(id.len)).map(|b| (slot, b.to_vec()))
                })
                .collect();
            if Record::Prune.apply(&mut page, 5).is_err() {
                return Ok(());
            }
            let after = check_header(&page).expect("prune keeps the header valid");
            for (slot, bytes) in &live {
                let id = item_id(&page, *slot).expect("slot");
                prop_assert_eq!(id.flags, LP_NORMAL);
                let start = usize::from(id.off);
                prop_assert_eq!(&page[start..start + bytes.len()], &bytes[..]);
            }
            for slot in 1..=after.maxoff() {
                let id = item_id(&page, slot).expect("slot");
                prop_assert!(id.flags != LP_DEAD);
                prop_assert!(id.flags != LP_UNUSED || id == ItemId::UNUSED);
            }
            let lowest = live.iter().map(|(s, _)| usize::from(item_id(&page, *s).expect("slot").off)).min();
            prop_assert_eq!(after.upper(), lowest.unwrap_or(after.special()));
        }
    }
}
