//! A posting-tree leaf page rewritten from a record's segment actions (PostgreSQL 15's
//! `ginRedoRecompress`, for `XLOG_GIN_INSERT` on a data leaf and
//! `XLOG_GIN_VACUUM_DATA_LEAF_PAGE`).
//!
//! A compressed leaf holds its posting-list segments ([`super::posting`]) from
//! [`super::DATA_START`] to `pd_lower`. The record's data (`ginxlogRecompressDataLeaf`):
//! `nactions` (`u16`), then per action the segment number (`u8`, counted in the page's old
//! segments), the action (`u8`) and its payload: `GIN_SEGMENT_DELETE` none (the old segment is
//! dropped), `GIN_SEGMENT_INSERT` and `GIN_SEGMENT_REPLACE` a whole segment (added before the
//! old one, or in its place), `GIN_SEGMENT_ADDITEMS` a count (`u16`) and that many item
//! pointers, merged into the old segment, which is re-encoded ([`super::posting::encode`],
//! byte for byte the primary's). Old segments no action names are kept as they are.
//!
//! A leaf page in the uncompressed pre-9.4 format (an array of item pointers, `maxoff` of them)
//! is first converted, as PostgreSQL does: one segment of all its items.
//!
//! The bytes past the new `pd_lower` keep what they held, as PostgreSQL leaves them (its masks
//! ignore the hole). Where PostgreSQL asserts or writes past the page on a corrupt record or
//! page, this returns an error.

use super::posting::{self, CodecError, ItemPointer, ITEM_POINTER_SIZE};
use super::{Opaque, DATA_START, GIN_COMPRESSED, GIN_DATA_PAGE_MAX_DATA_SIZE};
use crate::page::{self, Page, BLCKSZ};
use crate::pg15::RedoError;

/// Segment actions (`ginxlog.h`).
pub const GIN_SEGMENT_DELETE: u8 = 1;
pub const GIN_SEGMENT_INSERT: u8 = 2;
pub const GIN_SEGMENT_REPLACE: u8 = 3;
pub const GIN_SEGMENT_ADDITEMS: u8 = 4;

fn malformed(what: impl std::fmt::Display) -> RedoError {
    RedoError::Malformed(what.to_string())
}

fn no_fit(what: impl std::fmt::Display) -> RedoError {
    RedoError::DoesNotFit(what.to_string())
}

/// The page's posting lists: `DATA_START..pd_lower`, checked to lie within the page.
fn posting_area(page: &Page) -> Result<std::ops::Range<usize>, RedoError> {
    let lower = usize::from(page::pd_lower(page));
    if lower < DATA_START || lower > usize::from(page::pd_special(page)) || lower > BLCKSZ {
        return Err(no_fit(format!("a GIN leaf's pd_lower {lower} outside its posting lists")));
    }
    Ok(DATA_START..lower)
}

/// `GinDataPageSetDataSize`.
pub fn set_data_size(page: &mut Page, size: usize) -> Result<(), RedoError> {
    if size > GIN_DATA_PAGE_MAX_DATA_SIZE {
        return Err(no_fit(format!("{size} bytes of GIN data do not fit a page")));
    }
    page::set_pd_lower(page, (DATA_START + size) as u16);
    Ok(())
}

/// Converts a leaf in the pre-9.4 format to one segment of its items, as `ginRedoRecompress`
/// does before applying the actions.
fn convert_uncompressed(page: &mut Page, op: &mut Opaque) -> Result<(), RedoError> {
    let n = usize::from(op.maxoff);
    let items: Vec<ItemPointer> = page
        .get(DATA_START..DATA_START + n * ITEM_POINTER_SIZE)
        .ok_or_else(|| no_fit(format!("{n} uncompressed items do not fit a page")))?
        .chunks_exact(ITEM_POINTER_SIZE)
        .filter_map(ItemPointer::read)
        .collect();
    let size = if items.is_empty() {
        0
    } else {
        let (seg, packed) = posting::encode(&items, BLCKSZ).map_err(no_fit)?;
        if packed != n || DATA_START + seg.len() > BLCKSZ {
            return Err(no_fit(CodecError::TooLong { items: n, max: BLCKSZ }));
        }
        page[DATA_START..DATA_START + seg.len()].copy_from_slice(&seg);
        seg.len()
    };
    set_data_size(page, size)?;
    op.flags |= GIN_COMPRESSED;
    op.maxoff = 0;
    op.write(page).ok_or_else(|| no_fit("no room for the GIN special space"))
}

/// A reader of the record's action data.
struct Actions<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Actions<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], RedoError> {
        let out = self
            .data
            .get(self.at..self.at.saturating_add(n))
            .ok_or_else(|| malformed(format!("segment actions cut short at byte {}", self.at)))?;
        self.at += n;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, RedoError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, RedoError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    /// A whole segment (`SizeOfGinPostingList` bytes; PostgreSQL skips `SHORTALIGN` of that,
    /// the same number).
    fn segment(&mut self) -> Result<&'a [u8], RedoError> {
        let rest = self.data.get(self.at..).unwrap_or_default();
        let size = posting::segment_size(rest).map_err(|e| malformed(format!("a new segment: {e}")))?;
        self.take(size)
    }
}

/// `ginRedoRecompress`: applies the segment actions in `data` (a `ginxlogRecompressDataLeaf`)
/// to the leaf `page`.
pub fn recompress(page: &mut Page, data: &[u8]) -> Result<(), RedoError> {
    let mut op = Opaque::read(page).ok_or_else(|| no_fit("no room for the GIN special space"))?;
    if op.flags & GIN_COMPRESSED == 0 {
        convert_uncompressed(page, &mut op)?;
    }
    let area = posting_area(page)?;
    // The old segments, copied (PostgreSQL copies the tail once it starts to modify).
    let old = page[area].to_vec();
    let mut out: Vec<u8> = Vec::with_capacity(old.len() + data.len());
    let mut pos = 0usize;
    let mut segno = 0usize;
    let old_segment = |pos: usize| -> Result<&[u8], RedoError> {
        posting::segment(&old[pos..]).map_err(|e| no_fit(format!("the page's segment at {pos}: {e}")))
    };
    let mut actions = Actions { data, at: 0 };
    let nactions = actions.u16()?;
    for _ in 0..nactions {
        let a_segno = usize::from(actions.u8()?);
        let mut action = actions.u8()?;
        let mut newseg: Vec<u8> = Vec::new();
        let mut items: Vec<ItemPointer> = Vec::new();
        match action {
            GIN_SEGMENT_INSERT | GIN_SEGMENT_REPLACE => newseg = actions.segment()?.to_vec(),
            GIN_SEGMENT_ADDITEMS => {
                let n = usize::from(actions.u16()?);
                items = actions
                    .take(n * ITEM_POINTER_SIZE)?
                    .chunks_exact(ITEM_POINTER_SIZE)
                    .filter_map(ItemPointer::read)
                    .collect();
            }
            _ => {}
        }
        if a_segno < segno {
            return Err(malformed(format!("an action on segment {a_segno} after segment {segno}")));
        }
        // The segments up to the one this action is about stay as they are.
        while segno < a_segno {
            if pos >= old.len() {
                return Err(no_fit(format!("an action on segment {a_segno} of {segno}")));
            }
            let seg = old_segment(pos)?;
            out.extend_from_slice(seg);
            pos += seg.len();
            segno += 1;
        }
        let at_end = pos == old.len();
        if action == GIN_SEGMENT_ADDITEMS {
            if at_end {
                return Err(no_fit(format!("items added to segment {a_segno}, past the last")));
            }
            let mut olditems = Vec::new();
            posting::decode_segment(old_segment(pos)?, &mut olditems).map_err(no_fit)?;
            let merged = posting::merge(&items, &olditems);
            let (seg, packed) = posting::encode(&merged, BLCKSZ).map_err(no_fit)?;
            if packed != merged.len() {
                return Err(no_fit(CodecError::TooLong { items: merged.len(), max: BLCKSZ }));
            }
            newseg = seg;
            action = GIN_SEGMENT_REPLACE;
        }
        match action {
            GIN_SEGMENT_INSERT => out.extend_from_slice(&newseg),
            GIN_SEGMENT_DELETE | GIN_SEGMENT_REPLACE => {
                if at_end {
                    return Err(no_fit(format!("segment {a_segno} replaced or deleted, past the last")));
                }
                pos += old_segment(pos)?.len();
                segno += 1;
                if action == GIN_SEGMENT_REPLACE {
                    out.extend_from_slice(&newseg);
                }
            }
            other => return Err(malformed(format!("unexpected GIN leaf action: {other}"))),
        }
    }
    out.extend_from_slice(&old[pos..]);
    if DATA_START + out.len() > usize::from(page::pd_special(page)) {
        return Err(no_fit(format!("{} bytes of segments past the special space", out.len())));
    }
    set_data_size(page, out.len())?;
    page[DATA_START..DATA_START + out.len()].copy_from_slice(&out);
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::pg15::gin::tests::data_leaf;
    use proptest::prelude::*;

    fn ip(block: u32, offset: u16) -> ItemPointer {
        ItemPointer { block, offset }
    }

    fn seg(items: &[ItemPointer]) -> Vec<u8> {
        posting::encode(items, BLCKSZ).unwrap().0
    }

    fn items_of(page: &Page) -> Vec<ItemPointer> {
        let mut out = Vec::new();
        posting::decode_all(&page[posting_area(page).unwrap()], &mut out).unwrap();
        out
    }

    fn range(from: u32, to: u32) -> Vec<ItemPointer> {
        (from..to).map(|b| ip(b, 1 + (b % 7) as u16)).collect()
    }

    /// `page` has `want`'s header, segments and special space (the hole is not compared).
    fn assert_same_leaf(page: &Page, want: &Page) {
        let lower = usize::from(page::pd_lower(want));
        assert!(page[..lower] == want[..lower], "the header or segments differ");
        assert!(page[BLCKSZ - 8..] == want[BLCKSZ - 8..], "the special space differs");
    }

    /// An action of `segno`, `action` with `payload`.
    fn act(segno: u8, action: u8, payload: &[u8]) -> Vec<u8> {
        [&[segno, action][..], payload].concat()
    }

    fn actions(list: &[Vec<u8>]) -> Vec<u8> {
        [&(list.len() as u16).to_le_bytes()[..], &list.concat()].concat()
    }

    fn additems(items: &[ItemPointer]) -> Vec<u8> {
        let mut b = (items.len() as u16).to_le_bytes().to_vec();
        for i in items {
            b.extend_from_slice(&i.bytes());
        }
        b
    }

    #[test]
    fn each_action_rewrites_only_its_segment() {
        let (s0, s1, s2) = (range(10, 40), range(100, 160), range(300, 310));
        let segs = [seg(&s0), seg(&s1), seg(&s2)];
        let page = data_leaf(&segs);

        // DELETE the middle one.
        let mut p = page.clone();
        recompress(&mut p, &actions(&[act(1, GIN_SEGMENT_DELETE, &[])])).unwrap();
        assert_same_leaf(&p, &data_leaf(&[segs[0].clone(), segs[2].clone()]));

        // INSERT before segment 1 and at the end.
        let new = seg(&range(50, 60));
        let tail = seg(&range(400, 420));
        let mut p = page.clone();
        recompress(&mut p, &actions(&[act(1, GIN_SEGMENT_INSERT, &new), act(3, GIN_SEGMENT_INSERT, &tail)]))
            .unwrap();
        let want = data_leaf(&[segs[0].clone(), new.clone(), segs[1].clone(), segs[2].clone(), tail.clone()]);
        assert!(p[..] == want[..], "the page differs");

        // REPLACE segment 0 by a shorter one: the page shrinks, the hole keeps the old bytes.
        let shorter = seg(&s0[..5]);
        let mut p = page.clone();
        recompress(&mut p, &actions(&[act(0, GIN_SEGMENT_REPLACE, &shorter)])).unwrap();
        let want = data_leaf(&[shorter.clone(), segs[1].clone(), segs[2].clone()]);
        let lower = usize::from(page::pd_lower(&want));
        assert_same_leaf(&p, &want);
        let old_lower = usize::from(page::pd_lower(&page));
        assert!(p[lower..old_lower] == page[lower..old_lower], "the hole keeps the old bytes");
    }

    #[test]
    fn additems_merges_and_re_encodes_as_postgres_encodes_the_whole_segment() {
        let old = range(100, 160);
        let added = vec![ip(99, 3), ip(120, 9), ip(161, 1)];
        let page = data_leaf(&[seg(&range(1, 50)), seg(&old), seg(&range(500, 510))]);
        let mut p = page.clone();
        recompress(&mut p, &actions(&[act(1, GIN_SEGMENT_ADDITEMS, &additems(&added))])).unwrap();
        let merged = posting::merge(&added, &old);
        let want = data_leaf(&[seg(&range(1, 50)), seg(&merged), seg(&range(500, 510))]);
        assert!(p[..] == want[..], "the page differs");
        assert_eq!(items_of(&p).len(), 49 + 63 + 10);
    }

    #[test]
    fn a_pre_9_4_leaf_becomes_one_segment_first() {
        let items = range(5, 70);
        let mut page = data_leaf(&[]);
        let mut op = Opaque::read(&page).unwrap();
        op.flags &= !GIN_COMPRESSED;
        op.maxoff = items.len() as u16;
        op.write(&mut page).unwrap();
        for (i, it) in items.iter().enumerate() {
            page[DATA_START + 6 * i..DATA_START + 6 * i + 6].copy_from_slice(&it.bytes());
        }
        page::set_pd_lower(&mut page, 24); // pre-9.4 pages did not set it
        recompress(&mut page, &actions(&[act(1, GIN_SEGMENT_INSERT, &seg(&range(80, 90)))])).unwrap();
        let want = [range(5, 70), range(80, 90)].concat();
        assert_eq!(items_of(&page), want);
        let op = Opaque::read(&page).unwrap();
        assert_eq!((op.flags & GIN_COMPRESSED, op.maxoff), (GIN_COMPRESSED, 0));
    }

    #[test]
    fn broken_actions_are_errors_not_panics() {
        let page = data_leaf(&[seg(&range(10, 40)), seg(&range(100, 160))]);
        let bad = [
            actions(&[act(2, GIN_SEGMENT_DELETE, &[])]), // past the last
            actions(&[act(5, GIN_SEGMENT_DELETE, &[])]), // far past
            actions(&[act(2, GIN_SEGMENT_ADDITEMS, &additems(&[ip(999, 1)]))]), // past the last
            actions(&[act(0, 9, &[])]),                  // unknown action
            actions(&[act(1, GIN_SEGMENT_DELETE, &[]), act(0, GIN_SEGMENT_DELETE, &[])]), // backwards
            actions(&[act(0, GIN_SEGMENT_REPLACE, &[1, 2, 3])]), // cut segment
            actions(&[act(0, GIN_SEGMENT_ADDITEMS, &[5, 0, 1])]), // cut items
            vec![3, 0],                                  // no actions
            vec![1],
        ];
        for data in bad {
            let mut p = page.clone();
            assert!(recompress(&mut p, &data).is_err(), "{data:?}");
        }
        // Segments that would not fit the page.
        let big = seg(&(0..3000).map(|i| ip(i * 100_000, 1)).collect::<Vec<_>>());
        let mut p = page.clone();
        let data = actions(&[act(0, GIN_SEGMENT_INSERT, &big), act(0, GIN_SEGMENT_INSERT, &big)]);
        assert!(matches!(recompress(&mut p, &data), Err(RedoError::DoesNotFit(_))));
    }

    /// Records of PostgreSQL 15 (`gin_mix`, as the pytest runs it): the leaf before (the check
    /// image of the block's previous record), the leaf after (the record's check image), then the
    /// record's block data. An INSERT adding items to one segment, then merging small segments
    /// (ADDITEMS, DELETE, REPLACE); an INSERT appending a new segment (REPLACE, INSERT); a VACUUM
    /// (DELETE, REPLACE).
    const POSTGRES_RECORDS: [(&str, &[u8]); 3] = [
        ("insert, additems", include_bytes!("testdata/leaf_insert_additems.bin")),
        ("insert, new segment", include_bytes!("testdata/leaf_insert_new_segment.bin")),
        ("vacuum", include_bytes!("testdata/leaf_vacuum.bin")),
    ];

    fn fixture(bytes: &[u8]) -> (Box<Page>, Box<Page>, &[u8]) {
        let page = |at: usize| Box::new(<Page>::try_from(&bytes[at..at + BLCKSZ]).unwrap());
        (page(0), page(BLCKSZ), &bytes[2 * BLCKSZ..])
    }

    #[test]
    fn postgres_segments_decode_ascending_and_re_encode_to_the_same_bytes() {
        let mut segments = 0;
        for (name, bytes) in POSTGRES_RECORDS {
            let (before, after, _) = fixture(bytes);
            for page in [&before, &after] {
                let mut area = &page[posting_area(page).unwrap()];
                let mut all = Vec::new();
                while !area.is_empty() {
                    let seg = posting::segment(area).unwrap();
                    let mut items = Vec::new();
                    posting::decode_segment(seg, &mut items).unwrap();
                    let (again, n) = posting::encode(&items, seg.len()).unwrap();
                    assert_eq!((n, &again[..]), (items.len(), seg), "{name}: segment {segments}");
                    all.extend(items);
                    area = &area[seg.len()..];
                    segments += 1;
                }
                assert!(all.windows(2).all(|w| w[0] < w[1]), "{name}: items ascending");
                assert!(all.len() > 100, "{name}: {} items", all.len());
            }
        }
        assert!(segments > 50, "{segments} segments");
    }

    #[test]
    fn postgres_records_rebuild_postgres_leaves_byte_for_byte() {
        for (name, bytes) in POSTGRES_RECORDS {
            let (before, after, data) = fixture(bytes);
            let mut page = before.clone();
            recompress(&mut page, data).unwrap();
            assert_ne!(page[..], before[..], "{name}: the record changes the leaf");
            // Beyond the LSN, PostgreSQL's page up to pd_lower and its special space.
            let lower = usize::from(page::pd_lower(&after));
            assert_eq!(page::pd_lower(&page), page::pd_lower(&after), "{name}");
            assert!(page[8..lower] == after[8..lower], "{name}: the segments differ");
            assert!(page[BLCKSZ - 8..] == after[BLCKSZ - 8..], "{name}: the special space differs");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

        #[test]
        fn random_actions_on_random_leaves_never_panic(
            data in proptest::collection::vec(any::<u8>(), 0..120),
            lower in 0u16..9000,
            compressed in any::<bool>(),
            maxoff in 0u16..3000,
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
        ) {
            let mut page = data_leaf(&[seg(&range(10, 40)), seg(&range(100, 160))]);
            page[DATA_START..DATA_START + bytes.len()].copy_from_slice(&bytes);
            page::set_pd_lower(&mut page, lower);
            let mut op = Opaque::read(&page).unwrap();
            if !compressed {
                op.flags &= !GIN_COMPRESSED;
            }
            op.maxoff = maxoff;
            op.write(&mut page).unwrap();
            let _ = recompress(&mut page, &data);
        }

        /// Well-formed actions built from random splits of random lists: the page's items are
        /// those the actions say.
        #[test]
        fn valid_actions_leave_the_items_they_describe(
            blocks in proptest::collection::btree_set(0u32..100_000, 30..300),
            cuts in proptest::collection::vec(any::<u8>(), 1..6),
            choice in proptest::collection::vec(0u8..4, 1..6),
        ) {
            let all: Vec<ItemPointer> = blocks.into_iter().map(|b| ip(b, 1)).collect();
            // Old segments: `all` cut at up to 5 points, every other item left out.
            let mut bounds: Vec<usize> = cuts.iter().map(|c| usize::from(*c) * all.len() / 256).collect();
            bounds.push(0);
            bounds.push(all.len());
            bounds.sort_unstable();
            bounds.dedup();
            let pieces: Vec<&[ItemPointer]> = bounds.windows(2).map(|w| &all[w[0]..w[1]]).collect();
            let old: Vec<Vec<ItemPointer>> =
                pieces.iter().map(|p| p.iter().step_by(2).copied().collect()).collect();
            let page = data_leaf(&old.iter().map(|s| seg(s)).collect::<Vec<_>>());
            let mut want: Vec<Vec<ItemPointer>> = Vec::new();
            let mut acts = Vec::new();
            for (i, (piece, olds)) in pieces.iter().zip(&old).enumerate() {
                match choice.get(i).copied().unwrap_or(0) {
                    0 => want.push(olds.clone()),
                    1 => acts.push(act(i as u8, GIN_SEGMENT_DELETE, &[])),
                    2 => {
                        let added: Vec<ItemPointer> = piece.iter().skip(1).step_by(2).copied().collect();
                        if added.is_empty() {
                            want.push(olds.clone());
                            continue;
                        }
                        acts.push(act(i as u8, GIN_SEGMENT_ADDITEMS, &additems(&added)));
                        want.push(piece.to_vec());
                    }
                    _ => {
                        let mut p = piece.to_vec();
                        p.pop();
                        if p.is_empty() {
                            acts.push(act(i as u8, GIN_SEGMENT_DELETE, &[]));
                        } else {
                            acts.push(act(i as u8, GIN_SEGMENT_REPLACE, &seg(&p)));
                            want.push(p);
                        }
                    }
                }
            }
            let mut p = page.clone();
            recompress(&mut p, &actions(&acts)).unwrap();
            prop_assert_eq!(items_of(&p), want.concat());
            let want_page = data_leaf(&want.iter().map(|s| seg(s)).collect::<Vec<_>>());
            let lower = usize::from(page::pd_lower(&want_page));
            prop_assert_eq!(&p[..lower], &want_page[..lower]);
        }
    }
}
