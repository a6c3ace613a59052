//! GIN's compressed posting lists (PostgreSQL 15's `ginpostinglist.c`): sorted heap item
//! pointers stored as segments, each the first item in full then the deltas between items,
//! varbyte-encoded.
//!
//! Layout of a segment (`GinPostingList`, `ginblock.h`): `first` (an `ItemPointerData`: block
//! number as two `u16`, high half first, then the offset number), `nbytes` (`u16`), then
//! `nbytes` bytes of deltas, padded with one zero byte to an even length: a segment takes
//! `8 + SHORTALIGN(nbytes)` bytes ([`segment_size`]), and segments follow each other without
//! gaps.
//!
//! An item pointer is the integer `block << 11 | offset` for the deltas; each delta is stored
//! 7 bits a byte, low bits first, the high bit saying another byte follows, at most 7 bytes
//! (the seventh keeps all 8 of its bits). [`encode`] writes exactly PostgreSQL's bytes
//! (`ginCompressPostingList`, its zeroed padding byte included): redo re-encodes segments
//! (`GIN_SEGMENT_ADDITEMS`, the conversion of a pre-9.4 page) and the result must be the
//! primary's.
//!
//! Where PostgreSQL only asserts (items out of order, a delta running past its segment), these
//! return a [`CodecError`]; the caller turns it into the record's error. Invariants: pure; never
//! panics on any bytes.

/// `MaxHeapTuplesPerPageBits`: the offset number's bits in an encoded item pointer.
const OFFSET_BITS: u32 = 11;
/// `MaxBytesPerInteger`.
const MAX_BYTES_PER_INTEGER: usize = 7;
/// `offsetof(GinPostingList, bytes)`: the segment's header.
pub const SEGMENT_HEADER: usize = 8;
/// `sizeof(ItemPointerData)`.
pub const ITEM_POINTER_SIZE: usize = 6;

/// A heap item pointer (`ItemPointerData`), ordered as `ginCompareItemPointers` orders them:
/// by block, then offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ItemPointer {
    pub block: u32,
    pub offset: u16,
}

impl ItemPointer {
    /// The item pointer stored at the start of `b` (6 bytes), if `b` is long enough.
    pub fn read(b: &[u8]) -> Option<ItemPointer> {
        let b = b.get(..ITEM_POINTER_SIZE)?;
        let hi = u16::from_le_bytes([b[0], b[1]]);
        let lo = u16::from_le_bytes([b[2], b[3]]);
        Some(ItemPointer {
            block: u32::from(hi) << 16 | u32::from(lo),
            offset: u16::from_le_bytes([b[4], b[5]]),
        })
    }

    /// Its 6 bytes as PostgreSQL stores them.
    pub fn bytes(self) -> [u8; ITEM_POINTER_SIZE] {
        let [a, b] = ((self.block >> 16) as u16).to_le_bytes();
        let [c, d] = (self.block as u16).to_le_bytes();
        let [e, f] = self.offset.to_le_bytes();
        [a, b, c, d, e, f]
    }

    /// `itemptr_to_uint64`. (PostgreSQL asserts the offset fits its 11 bits; a larger one is
    /// or-ed in as it is, as a build without assertions does.)
    fn to_u64(self) -> u64 {
        u64::from(self.block) << OFFSET_BITS | u64::from(self.offset)
    }

    /// `uint64_to_itemptr`: the block number is the low 32 bits above the offset's.
    fn from_u64(v: u64) -> ItemPointer {
        ItemPointer { block: (v >> OFFSET_BITS) as u32, offset: (v & ((1 << OFFSET_BITS) - 1)) as u16 }
    }
}

/// Why posting-list bytes are not a valid list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("posting list segment cut short at byte {0}")]
    Truncated(usize),
    #[error("posting list delta runs past its segment")]
    DeltaPastSegment,
    #[error("posting list items out of order")]
    Unordered,
    #[error("posting list of {items} items does not fit {max} bytes")]
    TooLong { items: usize, max: usize },
}

/// `SHORTALIGN`.
fn shortalign(n: usize) -> usize {
    n + (n & 1)
}

/// `SizeOfGinPostingList` of the segment at the start of `b`: its header and its padded
/// bytes. An error if the header is cut short (not if the bytes are: see [`segment`]).
pub fn segment_size(b: &[u8]) -> Result<usize, CodecError> {
    let nbytes = b.get(6..8).ok_or(CodecError::Truncated(b.len()))?;
    Ok(SEGMENT_HEADER + shortalign(usize::from(u16::from_le_bytes([nbytes[0], nbytes[1]]))))
}

/// The segment at the start of `b`, whole (as [`segment_size`] counts it); an error if `b`
/// ends before it does.
pub fn segment(b: &[u8]) -> Result<&[u8], CodecError> {
    let size = segment_size(b)?;
    b.get(..size).ok_or(CodecError::Truncated(b.len()))
}

/// `decode_varbyte`, within `b` from `*at`: PostgreSQL reads on past the segment's end on a
/// delta cut short; this is an error.
fn decode_varbyte(b: &[u8], at: &mut usize) -> Result<u64, CodecError> {
    let mut val = 0u64;
    for i in 0..MAX_BYTES_PER_INTEGER {
        let c = u64::from(*b.get(*at).ok_or(CodecError::DeltaPastSegment)?);
        *at += 1;
        if i == MAX_BYTES_PER_INTEGER - 1 {
            // The seventh byte keeps all its bits (no continuation bit is looked at).
            return Ok(val | c << 42);
        }
        val |= (c & 0x7F) << (7 * i);
        if c & 0x80 == 0 {
            break;
        }
    }
    Ok(val)
}

/// `encode_varbyte`: appends `val` to `out`.
fn encode_varbyte(mut val: u64, out: &mut Vec<u8>) {
    while val > 0x7F {
        out.push(0x80 | (val & 0x7F) as u8);
        val >>= 7;
    }
    out.push(val as u8);
}

/// `ginPostingListDecodeAllSegments` over `b`: the items of every segment in it, appended to
/// `out`; the segments must fill `b` exactly. Items are taken as stored (no order check).
pub fn decode_all(mut b: &[u8], out: &mut Vec<ItemPointer>) -> Result<(), CodecError> {
    while !b.is_empty() {
        let seg = segment(b)?;
        decode_segment(seg, out)?;
        b = &b[seg.len()..];
    }
    Ok(())
}

/// The items of one segment (as [`segment`] returns it), appended to `out`.
pub fn decode_segment(seg: &[u8], out: &mut Vec<ItemPointer>) -> Result<(), CodecError> {
    let first = ItemPointer::read(seg).ok_or(CodecError::Truncated(seg.len()))?;
    let nbytes = usize::from(u16::from_le_bytes([seg[6], seg[7]]));
    let bytes = seg.get(SEGMENT_HEADER..SEGMENT_HEADER + nbytes).ok_or(CodecError::Truncated(seg.len()))?;
    out.push(first);
    let mut val = first.to_u64();
    let mut at = 0;
    while at < bytes.len() {
        val = val.wrapping_add(decode_varbyte(bytes, &mut at)?);
        out.push(ItemPointer::from_u64(val));
    }
    Ok(())
}

/// `ginCompressPostingList(items, n, maxsize)`: the segment holding as many of `items` as fit
/// in `maxsize` bytes (rounded down to even), and how many that is. `items` must be non-empty
/// and strictly ascending (PostgreSQL asserts both).
pub fn encode(items: &[ItemPointer], maxsize: usize) -> Result<(Vec<u8>, usize), CodecError> {
    let Some(&first) = items.first() else {
        return Err(CodecError::TooLong { items: 0, max: maxsize });
    };
    let maxsize = maxsize & !1;
    let maxbytes = maxsize
        .checked_sub(SEGMENT_HEADER)
        .filter(|m| *m > 0)
        .ok_or(CodecError::TooLong { items: items.len(), max: maxsize })?;
    let mut bytes = Vec::with_capacity(maxbytes.min(items.len() * MAX_BYTES_PER_INTEGER));
    let mut prev = first.to_u64();
    let mut packed = 1;
    let mut buf = Vec::with_capacity(10);
    for item in &items[1..] {
        let val = item.to_u64();
        if val <= prev {
            return Err(CodecError::Unordered);
        }
        buf.clear();
        encode_varbyte(val - prev, &mut buf);
        if buf.len() > maxbytes - bytes.len() {
            break; // output is full
        }
        bytes.extend_from_slice(&buf);
        prev = val;
        packed += 1;
    }
    let nbytes = bytes.len();
    let mut seg = Vec::with_capacity(SEGMENT_HEADER + shortalign(nbytes));
    seg.extend_from_slice(&first.bytes());
    seg.extend_from_slice(&(nbytes as u16).to_le_bytes());
    seg.extend_from_slice(&bytes);
    if nbytes % 2 == 1 {
        seg.push(0);
    }
    Ok((seg, packed))
}

/// `ginMergeItemPointers(a, b)`: the sorted union of two ascending lists, each item once.
pub fn merge(a: &[ItemPointer], b: &[ItemPointer]) -> Vec<ItemPointer> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                out.push(b[j]);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(block: u32, offset: u16) -> ItemPointer {
        ItemPointer { block, offset }
    }

    fn decode(seg: &[u8]) -> Vec<ItemPointer> {
        let mut out = Vec::new();
        decode_all(seg, &mut out).unwrap();
        out
    }

    #[test]
    fn a_segment_is_the_first_item_then_varbyte_deltas_padded_to_even() {
        // (0,1) then (0,2): delta 1; then (1,1): delta 2047 = 0x7FF (two bytes).
        let (seg, n) = encode(&[ip(0, 1), ip(0, 2), ip(1, 1)], 256).unwrap();
        assert_eq!(n, 3);
        assert_eq!(seg, vec![0, 0, 0, 0, 1, 0, 3, 0, 0x01, 0xFF, 0x0F, 0]);
        assert_eq!(segment_size(&seg).unwrap(), 12);
        assert_eq!(decode(&seg), vec![ip(0, 1), ip(0, 2), ip(1, 1)]);
        // The block number's halves: high first.
        let (seg, _) = encode(&[ip(0x0001_0002, 7)], 256).unwrap();
        assert_eq!(seg, vec![1, 0, 2, 0, 7, 0, 0, 0]);
    }

    #[test]
    fn the_largest_delta_takes_seven_bytes_the_last_keeping_all_its_bits() {
        let items = [ip(0, 1), ip(u32::MAX, 2047)];
        let (seg, n) = encode(&items, 64).unwrap();
        assert_eq!((n, seg.len()), (2, 8 + 8), "7 bytes of delta, padded");
        assert_eq!(&seg[8..15], &[0xFE, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]);
        assert_eq!(decode(&seg), items);
        // A seventh byte with its high bit set is data, as PostgreSQL reads it.
        let mut b = vec![0, 0, 0, 0, 1, 0, 7, 0];
        b.extend_from_slice(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x81, 0]);
        assert_eq!(decode(&b), vec![ip(0, 1), ItemPointer::from_u64(1 + (0x81 << 42))]);
    }

    #[test]
    fn encode_stops_at_the_size_given_as_postgres_does() {
        let items: Vec<_> = (1..=100).map(|i| ip(i * 1000, 1)).collect();
        // Each delta of 1000 blocks is 2048000 (21 bits): 3 bytes. The size is rounded down to
        // even: 39 leaves 30 bytes for deltas.
        let (seg, n) = encode(&items, 8 + 3 * 10 + 1).unwrap();
        assert_eq!((n, seg.len()), (11, 8 + 30));
        let (all, n) = encode(&items, 8192).unwrap();
        assert_eq!((n, all.len()), (100, 8 + 99 * 3 + 1));
        assert_eq!(all[all.len() - 1], 0, "the padding byte is zero");
        assert!(matches!(encode(&items, 8), Err(CodecError::TooLong { .. })));
        assert!(matches!(encode(&[], 100), Err(CodecError::TooLong { .. })));
        assert_eq!(encode(&[ip(1, 2), ip(1, 2)], 100), Err(CodecError::Unordered));
    }

    #[test]
    fn broken_segments_are_errors() {
        let (seg, _) = encode(&[ip(0, 1), ip(5, 1), ip(900, 3)], 256).unwrap();
        for cut in 0..seg.len() {
            assert!(decode_all(&seg[..cut], &mut Vec::new()).is_err() || cut == 0, "cut at {cut}");
        }
        let mut open = seg.clone();
        let n = usize::from(open[6]);
        open[8 + n - 1] |= 0x80; // the last delta says another byte follows
        assert_eq!(decode_all(&open, &mut Vec::new()), Err(CodecError::DeltaPastSegment));
    }

    #[test]
    fn merge_keeps_one_of_each_in_order() {
        let a = [ip(1, 1), ip(1, 5), ip(3, 1)];
        let b = [ip(1, 2), ip(1, 5), ip(4, 1)];
        assert_eq!(merge(&a, &b), vec![ip(1, 1), ip(1, 2), ip(1, 5), ip(3, 1), ip(4, 1)]);
        assert_eq!(merge(&[], &b), b.to_vec());
        assert_eq!(merge(&b, &[]), b.to_vec());
    }

    fn ascending() -> impl Strategy<Value = Vec<ItemPointer>> {
        proptest::collection::btree_set((0u32..=u32::MAX, 1u16..2048), 1..400)
            .prop_map(|s| s.into_iter().map(|(b, o)| ip(b, o)).collect())
    }

    proptest! {
        #[test]
        fn random_posting_lists_round_trip(items in ascending(), max in 8usize..2000) {
            let (seg, n) = encode(&items, 8192).unwrap();
            prop_assert_eq!(n, items.len());
            prop_assert_eq!(decode(&seg), items.clone());
            prop_assert_eq!(segment_size(&seg).unwrap(), seg.len());
            // A smaller limit keeps a prefix, within the limit, and it decodes back.
            if let Ok((seg, n)) = encode(&items, max) {
                prop_assert!(seg.len() <= max & !1 && n >= 1);
                prop_assert_eq!(decode(&seg), items[..n].to_vec());
            }
        }

        #[test]
        fn decoding_random_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode_all(&bytes, &mut Vec::new());
        }
    }
}
