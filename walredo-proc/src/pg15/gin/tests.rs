//! Unit tests of GIN redo: each record type on each block it touches, errors where PostgreSQL
//! would stop, and random records on random and valid pages (never a panic).

use super::posting::{self, ItemPointer};
use super::*;
use crate::pg15::{BlockHeader, Pg15Record, FLAG_HAS_DATA, FLAG_WILL_INIT};
use proptest::prelude::*;

const END_LSN: u64 = 0x1_0000_0100;

fn block(id: u8, blkno: u32, data: &[u8]) -> BlockHeader<'_> {
    let flags = if data.is_empty() { 0 } else { FLAG_HAS_DATA };
    BlockHeader { id, flags, fork: 0, spcnode: 1663, dbnode: 5, relnode: 16384, blkno, data }
}

fn init_block(id: u8, blkno: u32, data: &[u8]) -> BlockHeader<'_> {
    BlockHeader { flags: FLAG_WILL_INIT | FLAG_HAS_DATA, ..block(id, blkno, data) }
}

fn record<'a>(info: u8, main: &'a [u8], blocks: Vec<BlockHeader<'a>>) -> Pg15Record<'a> {
    Pg15Record {
        rmid: 13,
        info,
        xid: 700,
        lsn: END_LSN - 0x40,
        end_lsn: END_LSN,
        target: 0,
        blocks,
        main_data: main,
    }
}

/// Applies `rec` to `page` as its block `id`.
fn apply(rec: &Pg15Record<'_>, id: u8, page: &mut Page) -> Result<(), RedoError> {
    let block = rec.blocks.iter().find(|b| b.id == id).unwrap();
    redo(&Target { record: rec, block }, page)
}

/// `GinInitPage(page, flags)` with `rightlink` and `maxoff`.
fn gin_page(flags: u16, rightlink: u32, maxoff: u16) -> Box<Page> {
    let mut page = Box::new([0u8; BLCKSZ]);
    bufpage::page_init(&mut page, GIN_SPECIAL_SIZE);
    Opaque { rightlink, maxoff, flags }.write(&mut page).unwrap();
    page
}

/// A posting-tree leaf holding `segs` (each a whole segment).
pub(super) fn data_leaf(segs: &[Vec<u8>]) -> Box<Page> {
    let mut page = gin_page(GIN_DATA | GIN_LEAF | GIN_COMPRESSED, INVALID_BLOCK, 0);
    let all = segs.concat();
    page[DATA_START..DATA_START + all.len()].copy_from_slice(&all);
    leaf::set_data_size(&mut page, all.len()).unwrap();
    page
}

/// An entry or list page with `flags` and `items` added in order.
fn tuple_page(flags: u16, items: &[Vec<u8>]) -> Box<Page> {
    let mut page = gin_page(flags, INVALID_BLOCK, 0);
    for (i, item) in items.iter().enumerate() {
        bufpage::page_add_item(&mut page, item, (i + 1) as u16, false, false).unwrap();
    }
    page
}

/// An index tuple of `size` bytes (a multiple of 8, at least 8) with t_tid (blk, off), its
/// payload filled with `fill`.
fn tup(blk: u32, off: u16, size: usize, fill: u8) -> Vec<u8> {
    let mut t = vec![fill; size];
    t[0..6].copy_from_slice(&ItemPointer { block: blk, offset: off }.bytes());
    t[6..8].copy_from_slice(&(size as u16).to_le_bytes());
    t
}

fn items(n: u16, fill: u8) -> Vec<Vec<u8>> {
    (1..=n).map(|i| tup(1, i, 16 + 8 * usize::from(i % 3), fill.wrapping_add(i as u8))).collect()
}

fn items_of(page: &Page) -> Vec<Vec<u8>> {
    let n = bufpage::page_get_max_offset(page);
    (1..=n).map(|i| bufpage::page_get_item(page, i).unwrap().to_vec()).collect()
}

fn ip(block: u32, offset: u16) -> ItemPointer {
    ItemPointer { block, offset }
}

fn seg(items: &[ItemPointer]) -> Vec<u8> {
    posting::encode(items, BLCKSZ).unwrap().0
}

/// A posting item: child block, then key.
fn pitem(child: u32, key: ItemPointer) -> Vec<u8> {
    [&block_id_bytes(child)[..], &key.bytes()].concat()
}

/// An inner posting-tree page with `pitems`.
fn data_inner(pitems: &[Vec<u8>]) -> Box<Page> {
    let mut page = gin_page(GIN_DATA, INVALID_BLOCK, pitems.len() as u16);
    let all = pitems.concat();
    page[DATA_START..DATA_START + all.len()].copy_from_slice(&all);
    leaf::set_data_size(&mut page, all.len()).unwrap();
    page
}

/// `page` must equal `want` but for the LSN, which must be the record's end.
fn assert_page(page: &Page, want: &Page) {
    assert_eq!(page::page_lsn(page), END_LSN);
    assert_eq!(page[8..], want[8..]);
}

fn insert_main(flags: u16, children: Option<(u32, u32)>) -> Vec<u8> {
    let mut m = flags.to_le_bytes().to_vec();
    if let Some((l, r)) = children {
        m.extend_from_slice(&block_id_bytes(l));
        m.extend_from_slice(&block_id_bytes(r));
    }
    m
}

fn metadata(head: u32, tail: u32, npending: u32) -> Vec<u8> {
    let mut m = vec![0u8; GIN_META_SIZE];
    m[0..4].copy_from_slice(&head.to_le_bytes());
    m[4..8].copy_from_slice(&tail.to_le_bytes());
    m[8..12].copy_from_slice(&1234u32.to_le_bytes());
    m[12..16].copy_from_slice(&npending.to_le_bytes());
    m[16..24].copy_from_slice(&77i64.to_le_bytes());
    m[48..52].copy_from_slice(&2i32.to_le_bytes());
    m[36] = 0xAB; // padding, copied as it is
    m
}

fn update_meta_main(meta: &[u8], prev_tail: u32, new_rightlink: u32, ntuples: i32) -> Vec<u8> {
    let mut m = vec![0u8; 88];
    m[0..12].copy_from_slice(&[0x7F, 6, 0, 0, 5, 0, 0, 0, 0, 0x40, 0, 0]);
    m[16..72].copy_from_slice(meta);
    m[72..76].copy_from_slice(&prev_tail.to_le_bytes());
    m[76..80].copy_from_slice(&new_rightlink.to_le_bytes());
    m[80..84].copy_from_slice(&ntuples.to_le_bytes());
    m
}

/// The metapage as `GinInitMetabuffer` and the copied `meta` leave it.
fn meta_page(meta: &[u8]) -> Box<Page> {
    let mut page = gin_page(GIN_META, INVALID_BLOCK, 0);
    page[24..80].copy_from_slice(meta);
    page::set_pd_lower(&mut page, 80);
    page
}

#[test]
fn create_ptree_makes_a_compressed_leaf_of_the_main_datas_posting_lists() {
    let lists = [seg(&[ip(1, 1), ip(1, 2), ip(7, 3)]), seg(&[ip(9, 1), ip(400, 2)])].concat();
    let main = [&(lists.len() as u32).to_le_bytes()[..], &lists].concat();
    let rec = record(XLOG_GIN_CREATE_PTREE, &main, vec![init_block(0, 5, &[])]);
    let mut page = Box::new([0x55u8; BLCKSZ]);
    apply(&rec, 0, &mut page).unwrap();
    let want = data_leaf(std::slice::from_ref(&lists));
    assert_page(&page, &want);
    assert_eq!(page::pd_lower(&page) as usize, DATA_START + lists.len());
    assert_eq!(page[24..32], [0; 8], "no right bound");
    let short = [&100u32.to_le_bytes()[..], &lists].concat();
    let rec = record(XLOG_GIN_CREATE_PTREE, &short, vec![init_block(0, 5, &[])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
    let huge = [&9000u32.to_le_bytes()[..], &[0u8; 9000][..]].concat();
    let rec = record(XLOG_GIN_CREATE_PTREE, &huge, vec![init_block(0, 5, &[])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::DoesNotFit(_))));
}

fn entry_data(offset: u16, is_delete: bool, tuple: &[u8]) -> Vec<u8> {
    [&offset.to_le_bytes()[..], &[u8::from(is_delete), 0], tuple].concat()
}

#[test]
fn insert_on_an_entry_leaf_adds_or_replaces_the_tuple_at_its_offset() {
    let old = items(4, 0x10);
    let new = tup(3, 9, 24, 0xEE);
    let main = insert_main(GIN_INSERT_ISLEAF, None);
    let data = entry_data(2, false, &new);
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 4, &data)]);
    let mut page = tuple_page(GIN_LEAF, &old);
    apply(&rec, 0, &mut page).unwrap();
    let mut want = tuple_page(GIN_LEAF, &old);
    bufpage::page_add_item(&mut want, &new, 2, false, false).unwrap();
    assert_page(&page, &want);
    assert_eq!(items_of(&page)[1], new);

    // isDelete: the old tuple at the offset goes first (a posting list that grew).
    let data = entry_data(3, true, &new);
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 4, &data)]);
    let mut page = tuple_page(GIN_LEAF, &old);
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(items_of(&page), vec![old[0].clone(), old[1].clone(), new.clone(), old[3].clone()]);

    let bad = entry_data(9, true, &new);
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 4, &bad)]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::DoesNotFit(_))));
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 4, &data[..10])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 4, &data), block(1, 5, &[])]);
    assert!(matches!(apply(&rec, 1, &mut page), Err(RedoError::Malformed(_))), "a leaf has no child");
    let full = entry_data(1, false, &tup(1, 1, 4000, 0));
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 4, &full)]);
    let mut page = tuple_page(GIN_LEAF, &[tup(1, 1, 4000, 0), tup(1, 2, 4000, 0)]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::DoesNotFit(_))));
}

#[test]
fn insert_on_an_entry_inner_page_points_the_old_downlink_right_and_clears_the_childs_flag() {
    let downlinks = vec![tup(10, 0, 16, 1), tup(11, 0, 24, 2), tup(12, 0, 16, 3)];
    let new = tup(20, 0, 16, 9); // the downlink to the left child, 20
    let main = insert_main(0, Some((20, 21)));
    let data = entry_data(2, false, &new);
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 1, &data), block(1, 20, &[])]);
    let mut page = tuple_page(0, &downlinks);
    apply(&rec, 0, &mut page).unwrap();
    let mut repointed = downlinks.clone();
    repointed[1][0..6].copy_from_slice(&ip(21, 0).bytes());
    assert_eq!(
        items_of(&page),
        vec![downlinks[0].clone(), new.clone(), repointed[1].clone(), downlinks[2].clone()]
    );

    let mut child = tuple_page(GIN_LEAF | GIN_INCOMPLETE_SPLIT, &items(2, 0));
    apply(&rec, 1, &mut child).unwrap();
    assert_page(&child, &tuple_page(GIN_LEAF, &items(2, 0)));
    let mut zeros = Box::new([0u8; BLCKSZ]);
    assert!(matches!(apply(&rec, 1, &mut zeros), Err(RedoError::DoesNotFit(_))), "no special space");
    let short = insert_main(0, None);
    let rec = record(XLOG_GIN_INSERT, &short, vec![block(0, 1, &data)]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))), "no child blocks");
}

#[test]
fn insert_on_a_posting_tree_leaf_applies_its_segment_actions() {
    let old = [ip(5, 1), ip(5, 3), ip(8, 2)];
    let page = data_leaf(&[seg(&old)]);
    // ADDITEMS of two items to segment 0.
    let mut data = vec![1, 0, 0, leaf::GIN_SEGMENT_ADDITEMS, 2, 0];
    data.extend_from_slice(&ip(5, 2).bytes());
    data.extend_from_slice(&ip(9, 1).bytes());
    let main = insert_main(GIN_INSERT_ISDATA | GIN_INSERT_ISLEAF, None);
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 7, &data)]);
    let mut p = page.clone();
    apply(&rec, 0, &mut p).unwrap();
    assert_page(&p, &data_leaf(&[seg(&[ip(5, 1), ip(5, 2), ip(5, 3), ip(8, 2), ip(9, 1)])]));
}

#[test]
fn insert_on_a_posting_tree_inner_page_repoints_and_adds_the_posting_item() {
    let pitems = vec![pitem(3, ip(10, 1)), pitem(4, ip(20, 1)), pitem(5, ip(0, 0))];
    let page = data_inner(&pitems);
    let new = pitem(4, ip(15, 7));
    let data = [&2u16.to_le_bytes()[..], &new].concat();
    let main = insert_main(GIN_INSERT_ISDATA, Some((4, 9)));
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 2, &data), block(1, 4, &[])]);
    let mut p = page.clone();
    apply(&rec, 0, &mut p).unwrap();
    let want = data_inner(&[pitems[0].clone(), new.clone(), pitem(9, ip(20, 1)), pitems[2].clone()]);
    assert_page(&p, &want);
    assert_eq!(page::pd_lower(&p) as usize, DATA_START + 40);

    for off in [0u16, 4] {
        let data = [&off.to_le_bytes()[..], &new].concat();
        let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 2, &data)]);
        assert!(matches!(apply(&rec, 0, &mut page.clone()), Err(RedoError::DoesNotFit(_))), "offset {off}");
    }
    let full = data_inner(&vec![pitem(1, ip(1, 1)); GIN_DATA_PAGE_MAX_DATA_SIZE / POSTING_ITEM_SIZE]);
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 2, &data)]);
    assert!(matches!(apply(&rec, 0, &mut full.clone()), Err(RedoError::DoesNotFit(_))), "page full");
    let rec = record(XLOG_GIN_INSERT, &main, vec![block(0, 2, &data[..8])]);
    assert!(matches!(apply(&rec, 0, &mut page.clone()), Err(RedoError::Malformed(_))));
}

fn split_main(flags: u16) -> Vec<u8> {
    let mut m = vec![0u8; 28];
    m[12..16].copy_from_slice(&INVALID_BLOCK.to_le_bytes());
    m[16..20].copy_from_slice(&6u32.to_le_bytes());
    m[20..24].copy_from_slice(&7u32.to_le_bytes());
    m[24..26].copy_from_slice(&flags.to_le_bytes());
    m
}

#[test]
fn split_clears_the_childs_flag_and_refuses_the_pages_it_only_has_images_of() {
    let main = split_main(GIN_SPLIT_ROOT);
    let rec = record(
        XLOG_GIN_SPLIT,
        &main,
        vec![block(0, 8, &[]), block(1, 9, &[]), block(2, 1, &[]), block(3, 6, &[])],
    );
    let mut child = tuple_page(GIN_LEAF | GIN_INCOMPLETE_SPLIT, &items(3, 0));
    apply(&rec, 3, &mut child).unwrap();
    assert_page(&child, &tuple_page(GIN_LEAF, &items(3, 0)));
    for id in 0..3 {
        assert!(matches!(apply(&rec, id, &mut child.clone()), Err(RedoError::Malformed(_))), "block {id}");
    }
    // A leaf split has no child; a split that is not the root's has no block 2.
    let main = split_main(GIN_INSERT_ISLEAF);
    let rec = record(XLOG_GIN_SPLIT, &main, vec![block(2, 1, &[]), block(3, 6, &[])]);
    for id in [2, 3] {
        assert!(matches!(apply(&rec, id, &mut child.clone()), Err(RedoError::Malformed(_))), "block {id}");
    }
    let rec = record(XLOG_GIN_SPLIT, &main[..25], vec![block(3, 6, &[])]);
    assert!(matches!(apply(&rec, 3, &mut child), Err(RedoError::Malformed(_))));
}

#[test]
fn vacuum_page_arrives_as_an_image_and_vacuum_data_leaf_applies_actions() {
    let rec = record(XLOG_GIN_VACUUM_PAGE, &[], vec![block(0, 3, &[])]);
    assert!(matches!(apply(&rec, 0, &mut tuple_page(GIN_LEAF, &items(2, 0))), Err(RedoError::Malformed(_))));

    let (a, b) = ([ip(1, 1), ip(1, 2), ip(2, 1)], [ip(3, 1), ip(4, 4)]);
    let page = data_leaf(&[seg(&a), seg(&b)]);
    let smaller = seg(&[ip(1, 1), ip(2, 1)]);
    let data =
        [&[2u8, 0, 0, leaf::GIN_SEGMENT_REPLACE][..], &smaller, &[1, leaf::GIN_SEGMENT_DELETE]].concat();
    let rec = record(XLOG_GIN_VACUUM_DATA_LEAF_PAGE, &[], vec![block(0, 3, &data)]);
    let mut p = page.clone();
    apply(&rec, 0, &mut p).unwrap();
    let want = data_leaf(std::slice::from_ref(&smaller));
    let lower = page::pd_lower(&want) as usize;
    assert_eq!(page::page_lsn(&p), END_LSN);
    assert_eq!(p[8..lower], want[8..lower]);
    assert_eq!(p[BLCKSZ - 8..], want[BLCKSZ - 8..]);
    let rec = record(XLOG_GIN_VACUUM_DATA_LEAF_PAGE, &[], vec![block(0, 3, &data), block(1, 4, &[])]);
    assert!(matches!(apply(&rec, 1, &mut p), Err(RedoError::Malformed(_))));
}

fn delete_main(parent_offset: u16, right_link: u32, delete_xid: u32) -> Vec<u8> {
    let mut m = vec![0u8; 12];
    m[0..2].copy_from_slice(&parent_offset.to_le_bytes());
    m[4..8].copy_from_slice(&right_link.to_le_bytes());
    m[8..12].copy_from_slice(&delete_xid.to_le_bytes());
    m
}

#[test]
fn delete_page_marks_the_page_drops_its_downlink_and_relinks_its_left_sibling() {
    let main = delete_main(2, 30, 4242);
    let rec =
        record(XLOG_GIN_DELETE_PAGE, &main, vec![block(0, 12, &[]), block(1, 2, &[]), block(2, 11, &[])]);
    let mut deleted = data_leaf(&[]);
    apply(&rec, 0, &mut deleted).unwrap();
    let mut want = gin_page(GIN_DATA | GIN_LEAF | GIN_COMPRESSED | GIN_DELETED, INVALID_BLOCK, 0);
    page::set_pd_lower(&mut want, DATA_START as u16);
    bufpage::set_pd_prune_xid(&mut want, 4242);
    assert_page(&deleted, &want);

    let pitems = vec![pitem(11, ip(10, 1)), pitem(12, ip(20, 1)), pitem(30, ip(0, 0))];
    let mut parent = data_inner(&pitems);
    apply(&rec, 1, &mut parent).unwrap();
    let want = data_inner(&[pitems[0].clone(), pitems[2].clone()]);
    let lower = page::pd_lower(&want) as usize;
    assert_eq!(parent[8..lower], want[8..lower]);
    assert_eq!(parent[BLCKSZ - 8..], want[BLCKSZ - 8..]);

    let mut left = data_leaf(&[seg(&[ip(1, 1)])]);
    Opaque { rightlink: 12, maxoff: 0, flags: GIN_DATA | GIN_LEAF | GIN_COMPRESSED }
        .write(&mut left)
        .unwrap();
    apply(&rec, 2, &mut left).unwrap();
    assert_page(&left, &data_leaf(&[seg(&[ip(1, 1)])]).tap_rightlink(30));

    let past = delete_main(4, 30, 1);
    let rec = record(XLOG_GIN_DELETE_PAGE, &past, vec![block(1, 2, &[]), block(3, 2, &[])]);
    assert!(matches!(apply(&rec, 1, &mut data_inner(&pitems)), Err(RedoError::DoesNotFit(_))));
    assert!(matches!(apply(&rec, 3, &mut data_inner(&pitems)), Err(RedoError::Malformed(_))));
    let rec = record(XLOG_GIN_DELETE_PAGE, &past[..10], vec![block(1, 2, &[])]);
    assert!(matches!(apply(&rec, 1, &mut data_inner(&pitems)), Err(RedoError::Malformed(_))));
}

trait TapRightlink {
    fn tap_rightlink(self, rightlink: u32) -> Self;
}

impl TapRightlink for Box<Page> {
    fn tap_rightlink(mut self, rightlink: u32) -> Self {
        let mut op = Opaque::read(&self).unwrap();
        op.rightlink = rightlink;
        op.write(&mut self).unwrap();
        self
    }
}

#[test]
fn update_meta_rebuilds_the_metapage_and_appends_to_the_tail_or_links_a_new_sublist() {
    let meta = metadata(3, 4, 2);
    let tuples = [tup(7, 1, 24, 0xA1), tup(7, 1, 16, 0xA2)];
    let data = tuples.concat();
    let main = update_meta_main(&meta, INVALID_BLOCK, INVALID_BLOCK, 2);
    let rec = record(XLOG_GIN_UPDATE_META_PAGE, &main, vec![init_block(0, 0, &[]), block(1, 4, &data)]);
    let mut page = Box::new([0x33u8; BLCKSZ]);
    apply(&rec, 0, &mut page).unwrap();
    assert_page(&page, &meta_page(&meta));

    // The tail page: the tuples after its own, one more heap tuple in maxoff.
    let old = items(3, 0x50);
    let mut tail = tuple_page(GIN_LIST | GIN_LIST_FULLROW, &old);
    Opaque { rightlink: INVALID_BLOCK, maxoff: 5, flags: GIN_LIST | GIN_LIST_FULLROW }
        .write(&mut tail)
        .unwrap();
    apply(&rec, 1, &mut tail).unwrap();
    let mut all = old.clone();
    all.extend(tuples.iter().cloned());
    let mut want = tuple_page(GIN_LIST | GIN_LIST_FULLROW, &all);
    Opaque { rightlink: INVALID_BLOCK, maxoff: 6, flags: GIN_LIST | GIN_LIST_FULLROW }
        .write(&mut want)
        .unwrap();
    assert_page(&tail, &want);
    // An empty tail page gets them from offset 1.
    let mut empty = gin_page(GIN_LIST, INVALID_BLOCK, 0);
    apply(&rec, 1, &mut empty).unwrap();
    assert_eq!(items_of(&empty), tuples.to_vec());

    // A new sublist: the old tail links to its head.
    let main = update_meta_main(&meta, 4, 9, 0);
    let rec = record(XLOG_GIN_UPDATE_META_PAGE, &main, vec![init_block(0, 0, &[]), block(1, 4, &[])]);
    let mut tail = tuple_page(GIN_LIST | GIN_LIST_FULLROW, &old);
    apply(&rec, 1, &mut tail).unwrap();
    assert_page(&tail, &tuple_page(GIN_LIST | GIN_LIST_FULLROW, &old).tap_rightlink(9));

    // Neither: block 1 is not touched. Counts that disagree with the data are errors.
    let main = update_meta_main(&meta, INVALID_BLOCK, INVALID_BLOCK, 0);
    let rec = record(XLOG_GIN_UPDATE_META_PAGE, &main, vec![init_block(0, 0, &[]), block(1, 4, &[])]);
    assert!(matches!(apply(&rec, 1, &mut tail.clone()), Err(RedoError::Malformed(_))));
    for n in [1, 3] {
        let main = update_meta_main(&meta, INVALID_BLOCK, INVALID_BLOCK, n);
        let rec = record(XLOG_GIN_UPDATE_META_PAGE, &main, vec![init_block(0, 0, &[]), block(1, 4, &data)]);
        assert!(matches!(apply(&rec, 1, &mut tail.clone()), Err(RedoError::Malformed(_))), "{n} tuples");
    }
    let rec = record(XLOG_GIN_UPDATE_META_PAGE, &main[..80], vec![init_block(0, 0, &[])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
}

#[test]
fn insert_listpage_rebuilds_the_page_with_a_full_row_flag_on_a_sublists_tail() {
    let tuples = [tup(3, 2, 32, 0xB1), tup(3, 2, 16, 0xB2), tup(3, 2, 24, 0xB3)];
    let data = tuples.concat();
    for (rightlink, maxoff, flags) in [(INVALID_BLOCK, 1, GIN_LIST | GIN_LIST_FULLROW), (17, 0, GIN_LIST)] {
        let main = [&rightlink.to_le_bytes()[..], &3i32.to_le_bytes()].concat();
        let rec = record(XLOG_GIN_INSERT_LISTPAGE, &main, vec![init_block(0, 16, &data)]);
        let mut page = Box::new([0x77u8; BLCKSZ]);
        apply(&rec, 0, &mut page).unwrap();
        let mut want = tuple_page(flags, &tuples);
        Opaque { rightlink, maxoff, flags }.write(&mut want).unwrap();
        assert_page(&page, &want);
    }
    let main = [&17u32.to_le_bytes()[..], &(-1i32).to_le_bytes()].concat();
    let rec = record(XLOG_GIN_INSERT_LISTPAGE, &main, vec![init_block(0, 16, &data)]);
    assert!(matches!(apply(&rec, 0, &mut Box::new([0u8; BLCKSZ])), Err(RedoError::Malformed(_))));
    let main = [&17u32.to_le_bytes()[..], &3i32.to_le_bytes()].concat();
    let rec = record(XLOG_GIN_INSERT_LISTPAGE, &main, vec![init_block(0, 16, &data[..60])]);
    assert!(matches!(apply(&rec, 0, &mut Box::new([0u8; BLCKSZ])), Err(RedoError::Malformed(_))));
}

#[test]
fn delete_listpage_rebuilds_the_metapage_and_empties_each_deleted_page() {
    let meta = metadata(INVALID_BLOCK, INVALID_BLOCK, 0);
    let main = [&meta[..], &2i32.to_le_bytes(), &[0; 4]].concat();
    let rec = record(
        XLOG_GIN_DELETE_LISTPAGE,
        &main,
        vec![init_block(0, 0, &[]), init_block(1, 3, &[]), init_block(2, 4, &[]), init_block(3, 5, &[])],
    );
    let mut page = Box::new([0x11u8; BLCKSZ]);
    apply(&rec, 0, &mut page).unwrap();
    assert_page(&page, &meta_page(&meta));
    for id in [1, 2] {
        let mut list = tuple_page(GIN_LIST, &items(4, 0));
        apply(&rec, id, &mut list).unwrap();
        assert_page(&list, &gin_page(GIN_DELETED, INVALID_BLOCK, 0));
    }
    assert!(matches!(apply(&rec, 3, &mut page), Err(RedoError::Malformed(_))), "past ndeleted");
    let rec = record(XLOG_GIN_DELETE_LISTPAGE, &main[..58], vec![init_block(0, 0, &[])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
}

#[test]
fn unknown_op_codes_are_errors() {
    for op in [0x00, 0xA0, 0xF0] {
        let rec = record(op, &[0; 100], vec![block(0, 1, &[])]);
        assert!(matches!(apply(&rec, 0, &mut data_leaf(&[])), Err(RedoError::Malformed(_))), "{op:#x}");
    }
    for op in [XLOG_GIN_CREATE_PTREE, XLOG_GIN_VACUUM_DATA_LEAF_PAGE, XLOG_GIN_INSERT_LISTPAGE] {
        let rec = record(op, &[0; 100], vec![block(0, 1, &[]), block(1, 2, &[])]);
        assert!(matches!(apply(&rec, 1, &mut data_leaf(&[])), Err(RedoError::Malformed(_))), "{op:#x}");
    }
}

/// A valid page of each kind (an entry leaf, an entry inner page, a posting-tree leaf and
/// inner page, a list page, the metapage, a deleted page), a few items of random sizes.
fn valid_page(kind: u8, sizes: &[u8]) -> Box<Page> {
    let tuples: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, s)| tup(3, i as u16 + 1, 8 + 8 * usize::from(s % 12), *s))
        .collect();
    match kind % 7 {
        0 => tuple_page(GIN_LEAF, &tuples),
        1 => tuple_page(0, &tuples),
        2 => {
            let items: Vec<ItemPointer> =
                sizes.iter().enumerate().map(|(i, s)| ip(i as u32 * 300 + u32::from(*s), 1)).collect();
            if items.is_empty() {
                data_leaf(&[])
            } else {
                data_leaf(&items.chunks(5).map(seg).collect::<Vec<_>>())
            }
        }
        3 => {
            data_inner(&sizes.iter().map(|s| pitem(u32::from(*s), ip(u32::from(*s), 1))).collect::<Vec<_>>())
        }
        4 => tuple_page(GIN_LIST, &tuples),
        5 => meta_page(&metadata(1, 2, 3)),
        _ => gin_page(GIN_DELETED, INVALID_BLOCK, 0),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_records_on_random_pages_never_panic(
        op in 0u8..16,
        id in 0u8..5,
        main in proptest::collection::vec(any::<u8>(), 0..100),
        data in proptest::collection::vec(any::<u8>(), 0..96),
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
        at in 0usize..BLCKSZ,
        kind in 0u8..8,
        sizes in proptest::collection::vec(any::<u8>(), 0..20),
    ) {
        let mut page = if kind == 7 { Box::new([0u8; BLCKSZ]) } else { valid_page(kind, &sizes) };
        let end = (at + bytes.len()).min(BLCKSZ);
        page[at..end].copy_from_slice(&bytes[..end - at]);
        let blocks = (0..5).map(|i| block(i, u32::from(i), if i == id { &data[..] } else { &[] })).collect();
        let rec = record(op << 4, &main, blocks);
        let _ = apply(&rec, id, &mut page);
    }

    /// Well-formed headers (flags, counts, offsets, tuple sizes near the page's) with random
    /// contents, on valid GIN pages of every kind: errors, never a panic.
    #[test]
    fn random_contents_in_valid_records_on_valid_pages_never_panic(
        op in prop::sample::select(vec![
            XLOG_GIN_CREATE_PTREE, XLOG_GIN_INSERT, XLOG_GIN_SPLIT, XLOG_GIN_VACUUM_DATA_LEAF_PAGE,
            XLOG_GIN_DELETE_PAGE, XLOG_GIN_UPDATE_META_PAGE, XLOG_GIN_INSERT_LISTPAGE,
            XLOG_GIN_DELETE_LISTPAGE,
        ]),
        flags in 0u16..8,
        offset in 0u16..24,
        count in -2i32..6,
        tuple_sizes in proptest::collection::vec(0u16..600, 0..6),
        segno in 0u8..6,
        action in 0u8..6,
        blocks_in in proptest::collection::vec(any::<u32>(), 3),
        kind in 0u8..7,
        sizes in proptest::collection::vec(any::<u8>(), 0..20),
    ) {
        let page = valid_page(kind, &sizes);
        let tuples: Vec<u8> = tuple_sizes.iter().flat_map(|s| {
            let mut t = vec![0x5Au8; usize::from(*s).max(8)];
            t[6..8].copy_from_slice(&s.to_le_bytes());
            t
        }).collect();
        let (main, data) = match op {
            XLOG_GIN_CREATE_PTREE => {
                let lists = seg(&[ip(1, 1), ip(blocks_in[0], 2)]);
                ([&(count as u32).to_le_bytes()[..], &lists].concat(), Vec::new())
            }
            XLOG_GIN_INSERT => {
                let main = insert_main(flags, Some((blocks_in[0], blocks_in[1])));
                let data = if flags & GIN_INSERT_ISDATA == 0 {
                    entry_data(offset, count > 0, &tuples)
                } else if flags & GIN_INSERT_ISLEAF != 0 {
                    let mut d = vec![1, 0, segno, action];
                    d.extend_from_slice(&(tuple_sizes.len() as u16).to_le_bytes());
                    d.extend_from_slice(&tuples);
                    d
                } else {
                    [&offset.to_le_bytes()[..], &pitem(blocks_in[2], ip(1, 1))].concat()
                };
                (main, data)
            }
            XLOG_GIN_SPLIT => (split_main(flags), Vec::new()),
            XLOG_GIN_VACUUM_DATA_LEAF_PAGE => {
                let s = seg(&[ip(1, 1), ip(2, 2)]);
                (Vec::new(), [&[2u8, 0, segno, action][..], &s, &[segno, action]].concat())
            }
            XLOG_GIN_DELETE_PAGE => (delete_main(offset, blocks_in[0], blocks_in[1]), Vec::new()),
            XLOG_GIN_UPDATE_META_PAGE => {
                (update_meta_main(&metadata(1, 2, 3), blocks_in[0] % 3, blocks_in[1], count), tuples.clone())
            }
            XLOG_GIN_INSERT_LISTPAGE => {
                let rightlink = blocks_in[0] | 0xFFFF_FFFE;
                ([&rightlink.to_le_bytes()[..], &count.to_le_bytes()].concat(), tuples.clone())
            }
            _ => ([&metadata(1, 2, 3)[..], &count.to_le_bytes(), &[0; 4]].concat(), Vec::new()),
        };
        for id in 0..5u8 {
            let blocks =
                (0..5).map(|i| block(i, u32::from(i), if i == id { &data[..] } else { &[] })).collect();
            let rec = record(op, &main, blocks);
            let _ = apply(&rec, id, &mut page.clone());
        }
    }
}
