#![allow(clippy::unwrap_used)]

use super::*;
use crate::pg15::{record_type_name, BlockHeader, Pg15Record, FLAG_WILL_INIT};
use proptest::prelude::*;

const END_LSN: u64 = 0x1_0000_0100;
const XID: u32 = 731;

fn block(id: u8, blkno: u32) -> BlockHeader<'static> {
    BlockHeader { id, flags: 0, fork: 0, spcnode: 1663, dbnode: 5, relnode: 16384, blkno, data: &[] }
}

fn record<'a>(info: u8, main: &'a [u8], blocks: Vec<BlockHeader<'static>>) -> Pg15Record<'a> {
    Pg15Record {
        rmid: 16,
        info,
        xid: XID,
        lsn: END_LSN - 0x40,
        end_lsn: END_LSN,
        target: 0,
        blocks,
        main_data: main,
    }
}

/// `blocks` as (id, blkno).
fn blocks(ids: &[(u8, u32)]) -> Vec<BlockHeader<'static>> {
    ids.iter().map(|&(id, blkno)| block(id, blkno)).collect()
}

fn apply(rec: &Pg15Record<'_>, id: u8, page: &mut Page) -> Result<(), RedoError> {
    let block = rec.blocks.iter().find(|b| b.id == id).unwrap();
    redo(&Target { record: rec, block }, page)
}

/// A live leaf tuple of `size` bytes (at least 16) pointing at heap (7, `heap_off`), its
/// next offset `next`, the payload filled with `fill`.
fn leaf(size: usize, heap_off: u16, next: u16, fill: u8) -> Vec<u8> {
    let mut t = vec![fill; size];
    t[..4].copy_from_slice(&(SPGIST_LIVE | (size as u32) << 2).to_le_bytes());
    t[4..6].copy_from_slice(&next.to_le_bytes());
    t[6..12].copy_from_slice(&item_pointer(7, heap_off));
    t
}

/// A live inner tuple with a `prefix`-byte prefix and one 8-byte node per entry of `nodes`
/// (its downlink).
fn inner(prefix: usize, nodes: &[(u32, u16)]) -> Vec<u8> {
    let size = 8 + prefix + 8 * nodes.len();
    let mut t = vec![0xAB; size];
    let word = SPGIST_LIVE | (nodes.len() as u32) << 3 | (prefix as u32) << 16;
    t[..4].copy_from_slice(&word.to_le_bytes());
    t[4..6].copy_from_slice(&(size as u16).to_le_bytes());
    t[6..8].fill(0);
    for (i, &(blk, off)) in nodes.iter().enumerate() {
        let at = 8 + prefix + 8 * i;
        t[at..at + 6].copy_from_slice(&item_pointer(blk, off));
        t[at + 6..at + 8].copy_from_slice(&8u16.to_le_bytes());
    }
    t
}

/// An SP-GiST page (`SpGistInitPage`) with `items` added in order and the counters set.
fn spg_page(flags: u16, items: &[Vec<u8>], n_redirection: u16, n_placeholder: u16) -> Box<Page> {
    let mut page = Box::new([0u8; BLCKSZ]);
    bufpage::page_init(&mut page, SPGIST_SPECIAL_SIZE);
    Opaque { flags, n_redirection, n_placeholder, page_id: SPGIST_PAGE_ID }.write(&mut page).unwrap();
    for (i, item) in items.iter().enumerate() {
        bufpage::page_add_item(&mut page, item, (i + 1) as u16, false, false).unwrap();
    }
    page
}

fn item(page: &Page, off: u16) -> Vec<u8> {
    bufpage::page_get_item(page, off).unwrap().to_vec()
}

fn counters(page: &Page) -> (u16, u16) {
    let op = Opaque::read(page).unwrap();
    (op.n_redirection, op.n_placeholder)
}

fn node_tid(tuple: &[u8], prefix: usize, i: usize) -> [u8; 6] {
    let at = 8 + prefix + 8 * i;
    tuple[at..at + 6].try_into().unwrap()
}

fn state(xid: u32, build: bool) -> [u8; 8] {
    let mut s = [0u8; 8];
    s[..4].copy_from_slice(&xid.to_le_bytes());
    s[4] = u8::from(build);
    s
}

fn offsets(offs: &[u16]) -> Vec<u8> {
    offs.iter().flat_map(|o| o.to_le_bytes()).collect()
}

fn add_leaf_main(new_page: bool, leaf_at: u16, head: u16, parent: u16, node_i: u16, tuple: &[u8]) -> Vec<u8> {
    let mut m = vec![u8::from(new_page), 0];
    for v in [leaf_at, head, parent, node_i] {
        m.extend_from_slice(&v.to_le_bytes());
    }
    m.extend_from_slice(tuple);
    m
}

#[test]
fn record_types_are_named_as_pg_waldump_names_them() {
    assert_eq!(record_type_name(16, XLOG_SPGIST_ADD_LEAF), "SPGist ADD_LEAF");
    assert_eq!(record_type_name(16, XLOG_SPGIST_VACUUM_REDIRECT), "SPGist VACUUM_REDIRECT");
    assert_eq!(record_type_name(16, 0x00), "SPGist info 0x00");
}

#[test]
fn add_leaf_initialises_a_new_page_then_chains_the_next_tuple_to_its_head() {
    let first = leaf(24, 1, 0, 0x11);
    let main = add_leaf_main(true, 1, 0, 0, 0, &first);
    let rec = record(XLOG_SPGIST_ADD_LEAF, &main, blocks(&[(0, 5)]));
    let mut page = Box::new([0xEEu8; BLCKSZ]);
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(
        Opaque::read(&page).unwrap(),
        Opaque { flags: SPGIST_LEAF, n_redirection: 0, n_placeholder: 0, page_id: SPGIST_PAGE_ID }
    );
    assert_eq!(item(&page, 1), first);
    assert_eq!(page::page_lsn(&page), END_LSN);

    // The next tuple of the chain carries the head's old next offset; the head points at it.
    let second = leaf(16, 2, 0, 0x22);
    let main = add_leaf_main(false, 2, 1, 0, 0, &second);
    let rec = record(XLOG_SPGIST_ADD_LEAF, &main, blocks(&[(0, 5)]));
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(item(&page, 2), second);
    assert_eq!(u16::from_le_bytes(item(&page, 1)[4..6].try_into().unwrap()), 2);
}

#[test]
fn add_leaf_replaces_a_placeholder_or_a_dead_tuple_and_nothing_else() {
    let placeholder = dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0);
    let mut page = spg_page(SPGIST_LEAF, &[leaf(16, 1, 0, 1), placeholder.to_vec()], 0, 1);
    let new = leaf(32, 9, 0, 0x33);
    let rec_main = add_leaf_main(false, 2, 0, 0, 0, &new);
    let rec = record(XLOG_SPGIST_ADD_LEAF, &rec_main, blocks(&[(0, 5)]));
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(item(&page, 2), new);
    assert_eq!(counters(&page), (0, 0));
    // A live tuple is not a placeholder.
    let mut again = page.clone();
    assert!(matches!(apply(&rec, 0, &mut again), Err(RedoError::DoesNotFit(_))));

    // offnumLeaf == offnumHeadLeaf: a DEAD tuple replaced in place.
    let dead = dead_tuple(SPGIST_DEAD, INVALID_BLOCK, 0, 0);
    let mut page = spg_page(SPGIST_LEAF, &[dead.to_vec(), leaf(16, 1, 0, 1)], 0, 0);
    let rec_main = add_leaf_main(false, 1, 1, 0, 0, &new);
    let rec = record(XLOG_SPGIST_ADD_LEAF, &rec_main, blocks(&[(0, 5)]));
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(item(&page, 1), new);
    assert_eq!(bufpage::page_get_max_offset(&page), 2);
}

#[test]
fn add_leaf_points_the_parent_node_at_the_new_leaf() {
    let parent_tuple = inner(8, &[(1, 1), (2, 1), (3, 1)]);
    let mut parent = spg_page(0, &[parent_tuple], 0, 0);
    let main = add_leaf_main(false, 4, 0, 1, 2, &leaf(16, 1, 0, 1));
    let rec = record(XLOG_SPGIST_ADD_LEAF, &main, blocks(&[(0, 70_000), (1, 2)]));
    apply(&rec, 1, &mut parent).unwrap();
    let t = item(&parent, 1);
    assert_eq!(node_tid(&t, 8, 2), item_pointer(70_000, 4));
    assert_eq!(node_tid(&t, 8, 1), item_pointer(2, 1));
    // A node the tuple does not have.
    let main = add_leaf_main(false, 4, 0, 1, 3, &leaf(16, 1, 0, 1));
    let rec = record(XLOG_SPGIST_ADD_LEAF, &main, blocks(&[(0, 9), (1, 2)]));
    assert!(matches!(apply(&rec, 1, &mut parent), Err(RedoError::DoesNotFit(_))));
    // Without block 0's reference the parent cannot be updated.
    let rec = record(XLOG_SPGIST_ADD_LEAF, &main, blocks(&[(1, 2)]));
    assert!(matches!(apply(&rec, 1, &mut parent), Err(RedoError::Malformed(_))));
}

fn move_leafs_main(
    to_delete: &[u16],
    to_insert: &[u16],
    tuples: &[Vec<u8>],
    new_page: bool,
    build: bool,
) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&(to_delete.len() as u16).to_le_bytes());
    m.extend_from_slice(&[u8::from(new_page), 0, 0, 0]);
    m.extend_from_slice(&1u16.to_le_bytes()); // offnumParent
    m.extend_from_slice(&0u16.to_le_bytes()); // nodeI
    m.extend_from_slice(&[0, 0]);
    m.extend_from_slice(&state(XID, build));
    m.extend_from_slice(&offsets(to_delete));
    m.extend_from_slice(&offsets(to_insert));
    for t in tuples {
        m.extend_from_slice(t);
    }
    m
}

#[test]
fn move_leafs_fills_the_destination_redirects_the_source_and_relinks_the_parent() {
    let src_items = vec![leaf(16, 1, 0, 1), leaf(24, 2, 0, 2), leaf(16, 3, 0, 3)];
    let moved = vec![leaf(16, 1, 0, 1), leaf(16, 3, 2, 3), leaf(40, 4, 1, 4)];
    let main = move_leafs_main(&[3, 1], &[1, 2, 3], &moved, true, false);
    let rec = record(XLOG_SPGIST_MOVE_LEAFS, &main, blocks(&[(0, 4), (1, 9), (2, 1)]));

    let mut dst = Box::new([0u8; BLCKSZ]);
    apply(&rec, 1, &mut dst).unwrap();
    assert_eq!((1..=3).map(|o| item(&dst, o)).collect::<Vec<_>>(), moved);

    let mut src = spg_page(SPGIST_LEAF, &src_items, 0, 0);
    apply(&rec, 0, &mut src).unwrap();
    // The first offset listed (3) becomes the redirect to the last inserted tuple.
    assert_eq!(item(&src, 3), dead_tuple(SPGIST_REDIRECT, 9, 3, XID));
    assert_eq!(item(&src, 1), dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0));
    assert_eq!(item(&src, 2), src_items[1]);
    assert_eq!(counters(&src), (1, 1));
    assert_eq!(&item(&src, 3)[12..16], &XID.to_le_bytes());

    let mut parent = spg_page(0, &[inner(0, &[(4, 1)])], 0, 0);
    apply(&rec, 2, &mut parent).unwrap();
    assert_eq!(node_tid(&item(&parent, 1), 0, 0), item_pointer(9, 3));

    // During a build, placeholders only.
    let main = move_leafs_main(&[3, 1], &[1, 2, 3], &moved, true, true);
    let rec = record(XLOG_SPGIST_MOVE_LEAFS, &main, blocks(&[(0, 4), (1, 9), (2, 1)]));
    let mut src = spg_page(SPGIST_LEAF, &src_items, 0, 0);
    apply(&rec, 0, &mut src).unwrap();
    assert_eq!(counters(&src), (0, 2));
}

fn add_node_main(
    offnum: u16,
    offnum_new: u16,
    new_page: bool,
    parent_blk: i8,
    build: bool,
    tuple: &[u8],
) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&offnum.to_le_bytes());
    m.extend_from_slice(&offnum_new.to_le_bytes());
    m.push(u8::from(new_page));
    m.push(parent_blk as u8);
    m.extend_from_slice(&1u16.to_le_bytes()); // offnumParent
    m.extend_from_slice(&1u16.to_le_bytes()); // nodeI
    m.extend_from_slice(&[0, 0]);
    m.extend_from_slice(&state(XID, build));
    m.extend_from_slice(tuple);
    m
}

#[test]
fn add_node_replaces_in_place_or_moves_leaving_a_redirect() {
    let old = inner(8, &[(3, 1)]);
    let bigger = inner(8, &[(3, 1), (4, 1)]);
    let mut page = spg_page(0, &[inner(0, &[(5, 5)]), old.clone()], 0, 0);
    let main = add_node_main(2, 0, false, -1, false, &bigger);
    let rec = record(XLOG_SPGIST_ADD_NODE, &main, blocks(&[(0, 1)]));
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(item(&page, 2), bigger);

    // Moved to block 1 (a new page, also the parent's), a redirect left on block 0.
    let main = add_node_main(2, 1, true, 1, false, &bigger);
    let rec = record(XLOG_SPGIST_ADD_NODE, &main, blocks(&[(0, 1), (1, 8)]));
    let mut new = Box::new([0u8; BLCKSZ]);
    apply(&rec, 1, &mut new).unwrap();
    assert_eq!(node_tid(&item(&new, 1), 8, 1), item_pointer(8, 1));
    let main = add_node_main(2, 1, true, 2, false, &bigger);
    let rec = record(XLOG_SPGIST_ADD_NODE, &main, blocks(&[(0, 1), (1, 8), (2, 3)]));
    let mut new = Box::new([0u8; BLCKSZ]);
    apply(&rec, 1, &mut new).unwrap();
    assert_eq!(item(&new, 1), bigger);
    assert_eq!(Opaque::read(&new).unwrap().flags, 0);
    let mut orig = spg_page(0, &[inner(0, &[(5, 5)]), old.clone()], 0, 0);
    apply(&rec, 0, &mut orig).unwrap();
    assert_eq!(item(&orig, 2), dead_tuple(SPGIST_REDIRECT, 8, 1, XID));
    assert_eq!(counters(&orig), (1, 0));
    let mut parent = spg_page(0, &[inner(0, &[(1, 2), (1, 2)])], 0, 0);
    apply(&rec, 2, &mut parent).unwrap();
    assert_eq!(node_tid(&item(&parent, 1), 0, 1), item_pointer(8, 1));
    assert_eq!(node_tid(&item(&parent, 1), 0, 0), item_pointer(1, 2));

    // Parent on the original page (parentBlk 0): its node is relinked there.
    let main = add_node_main(2, 1, false, 0, true, &bigger);
    let rec = record(XLOG_SPGIST_ADD_NODE, &main, blocks(&[(0, 1), (1, 8)]));
    let mut orig = spg_page(0, &[inner(0, &[(1, 2), (1, 2)]), old], 0, 0);
    apply(&rec, 0, &mut orig).unwrap();
    assert_eq!(item(&orig, 2), dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0));
    assert_eq!(counters(&orig), (0, 1));
    assert_eq!(node_tid(&item(&orig, 1), 0, 1), item_pointer(8, 1));
    let rec = record(XLOG_SPGIST_ADD_NODE, &main, blocks(&[(0, 1), (1, 8), (2, 3)]));
    assert!(matches!(apply(&rec, 2, &mut orig), Err(RedoError::Malformed(_))));
}

fn split_main(
    prefix_at: u16,
    postfix_at: u16,
    new_page: bool,
    same: bool,
    prefix: &[u8],
    postfix: &[u8],
) -> Vec<u8> {
    let mut m = Vec::new();
    m.extend_from_slice(&prefix_at.to_le_bytes());
    m.extend_from_slice(&postfix_at.to_le_bytes());
    m.push(u8::from(new_page));
    m.push(u8::from(same));
    m.extend_from_slice(prefix);
    m.extend_from_slice(postfix);
    m
}

#[test]
fn split_tuple_puts_the_prefix_in_place_and_the_postfix_where_it_goes() {
    let prefix = inner(8, &[(2, 3)]);
    let postfix = inner(16, &[(4, 1), (4, 2)]);
    let main = split_main(1, 2, false, true, &prefix, &postfix);
    let rec = record(XLOG_SPGIST_SPLIT_TUPLE, &main, blocks(&[(0, 2)]));
    let mut page = spg_page(0, &[inner(0, &[(4, 1), (4, 2)])], 0, 0);
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!((item(&page, 1), item(&page, 2)), (prefix.clone(), postfix.clone()));

    let main = split_main(1, 1, true, false, &prefix, &postfix);
    let rec = record(XLOG_SPGIST_SPLIT_TUPLE, &main, blocks(&[(0, 2), (1, 3)]));
    let mut other = Box::new([0u8; BLCKSZ]);
    apply(&rec, 1, &mut other).unwrap();
    assert_eq!(item(&other, 1), postfix);
    let mut page = spg_page(0, &[inner(0, &[(4, 1), (4, 2)])], 0, 0);
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(item(&page, 1), prefix);
    assert_eq!(bufpage::page_get_max_offset(&page), 1);
    // Cut short: the postfix tuple is missing.
    let short = split_main(1, 1, true, false, &prefix, &[]);
    let rec = record(XLOG_SPGIST_SPLIT_TUPLE, &short, blocks(&[(0, 2), (1, 3)]));
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
}

#[allow(clippy::too_many_arguments)]
fn picksplit_main(
    root: bool,
    to_delete: &[u16],
    to_insert: &[u16],
    select: &[u8],
    init: [bool; 3],
    offnum_inner: u16,
    inner_is_parent: bool,
    inner_tuple: &[u8],
    leaves: &[Vec<u8>],
) -> Vec<u8> {
    let mut m = vec![u8::from(root), 0];
    m.extend_from_slice(&(to_delete.len() as u16).to_le_bytes());
    m.extend_from_slice(&(to_insert.len() as u16).to_le_bytes());
    m.extend_from_slice(&[u8::from(init[0]), u8::from(init[1])]);
    m.extend_from_slice(&offnum_inner.to_le_bytes());
    m.extend_from_slice(&[u8::from(init[2]), 0, u8::from(inner_is_parent), 0]);
    m.extend_from_slice(&1u16.to_le_bytes()); // offnumParent
    m.extend_from_slice(&0u16.to_le_bytes()); // nodeI
    m.extend_from_slice(&[0, 0]);
    m.extend_from_slice(&state(XID, false));
    m.extend_from_slice(&offsets(to_delete));
    m.extend_from_slice(&offsets(to_insert));
    m.extend_from_slice(select);
    m.extend_from_slice(inner_tuple);
    for l in leaves {
        m.extend_from_slice(l);
    }
    m
}

#[test]
fn picksplit_of_the_root_rebuilds_it_as_an_inner_page_over_new_leaves() {
    let inner_tuple = inner(0, &[(2, 1), (3, 1)]);
    let leaves = vec![leaf(16, 1, 0, 1), leaf(16, 2, 0, 2)];
    let main =
        picksplit_main(true, &[], &[1, 2], &[1, 1], [false, true, true], 1, false, &inner_tuple, &leaves);
    let rec = record(XLOG_SPGIST_PICKSPLIT, &main, blocks(&[(1, 2), (2, 0)]));
    let mut root = spg_page(SPGIST_LEAF, &[leaf(16, 1, 0, 1), leaf(16, 2, 0, 2)], 0, 0);
    apply(&rec, 2, &mut root).unwrap();
    assert_eq!(Opaque::read(&root).unwrap().flags, 0);
    assert_eq!(item(&root, 1), inner_tuple);
    assert_eq!(bufpage::page_get_max_offset(&root), 1);
    let mut dest = Box::new([0u8; BLCKSZ]);
    apply(&rec, 1, &mut dest).unwrap();
    assert_eq!((item(&dest, 1), item(&dest, 2)), (leaves[0].clone(), leaves[1].clone()));
}

#[test]
fn picksplit_of_a_leaf_redirects_its_moved_tuples_to_the_new_inner_tuple() {
    let inner_tuple = inner(0, &[(4, 1), (9, 1)]);
    let leaves = vec![leaf(16, 1, 0, 1), leaf(24, 3, 0, 3), leaf(16, 5, 0, 5)];
    let src_items = vec![leaf(16, 1, 0, 1), leaf(16, 2, 0, 2), leaf(16, 3, 0, 3)];
    // Source keeps a new leaf at 4; two go to the destination.
    let main = picksplit_main(
        false,
        &[1, 3],
        &[4, 1, 2],
        &[0, 1, 1],
        [false, true, false],
        2,
        true,
        &inner_tuple,
        &leaves,
    );
    let rec = record(XLOG_SPGIST_PICKSPLIT, &main, blocks(&[(0, 4), (1, 9), (2, 6)]));
    let mut src = spg_page(SPGIST_LEAF, &src_items, 0, 0);
    apply(&rec, 0, &mut src).unwrap();
    assert_eq!(item(&src, 1), dead_tuple(SPGIST_REDIRECT, 6, 2, XID));
    assert_eq!(item(&src, 3), dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0));
    assert_eq!(item(&src, 4), leaves[0]);
    assert_eq!(counters(&src), (1, 1));
    let mut dest = Box::new([0u8; BLCKSZ]);
    apply(&rec, 1, &mut dest).unwrap();
    assert_eq!((item(&dest, 1), item(&dest, 2)), (leaves[1].clone(), leaves[2].clone()));
    // The inner page is also the parent: its node 0 now points at the new inner tuple.
    let mut inner_page = spg_page(0, &[inner(0, &[(4, 7)])], 0, 0);
    apply(&rec, 2, &mut inner_page).unwrap();
    assert_eq!(item(&inner_page, 2), inner_tuple);
    assert_eq!(node_tid(&item(&inner_page, 1), 0, 0), item_pointer(6, 2));
    // A parent elsewhere (block 3) gets the same link.
    let rec = record(XLOG_SPGIST_PICKSPLIT, &main, blocks(&[(0, 4), (1, 9), (2, 6), (3, 1)]));
    let mut parent = spg_page(0, &[inner(0, &[(4, 1)])], 0, 0);
    apply(&rec, 3, &mut parent).unwrap();
    assert_eq!(node_tid(&item(&parent, 1), 0, 0), item_pointer(6, 2));
}

fn vacuum_leaf_main(
    dead: &[u16],
    placeholder: &[u16],
    moves: &[(u16, u16)],
    chain: &[(u16, u16)],
) -> Vec<u8> {
    let mut m = Vec::new();
    for n in [dead.len(), placeholder.len(), moves.len(), chain.len()] {
        m.extend_from_slice(&(n as u16).to_le_bytes());
    }
    m.extend_from_slice(&state(XID, false));
    m.extend_from_slice(&offsets(dead));
    m.extend_from_slice(&offsets(placeholder));
    m.extend_from_slice(&offsets(&moves.iter().map(|m| m.0).collect::<Vec<_>>()));
    m.extend_from_slice(&offsets(&moves.iter().map(|m| m.1).collect::<Vec<_>>()));
    m.extend_from_slice(&offsets(&chain.iter().map(|m| m.0).collect::<Vec<_>>()));
    m.extend_from_slice(&offsets(&chain.iter().map(|m| m.1).collect::<Vec<_>>()));
    m
}

#[test]
fn vacuum_leaf_kills_moves_and_rechains() {
    let items: Vec<Vec<u8>> = (1..=5).map(|i| leaf(16, i, 0, i as u8)).collect();
    let mut page = spg_page(SPGIST_LEAF, &items, 0, 0);
    // 1 dead, 2 placeholder, 5 moved to 4 (4's slot gets 5's tuple, 5 a placeholder), 3 -> 4.
    let main = vacuum_leaf_main(&[1], &[2], &[(5, 4)], &[(3, 4)]);
    let rec = record(XLOG_SPGIST_VACUUM_LEAF, &main, blocks(&[(0, 3)]));
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(item(&page, 1), dead_tuple(SPGIST_DEAD, INVALID_BLOCK, 0, 0));
    assert_eq!(item(&page, 2), dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0));
    assert_eq!(item(&page, 4), items[4]);
    assert_eq!(item(&page, 5), dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0));
    assert_eq!(u16::from_le_bytes(item(&page, 3)[4..6].try_into().unwrap()), 4);
    assert_eq!(counters(&page), (0, 2));
    assert_eq!(page::page_lsn(&page), END_LSN);
    // A move past the line pointers.
    let main = vacuum_leaf_main(&[], &[], &[(9, 4)], &[]);
    let rec = record(XLOG_SPGIST_VACUUM_LEAF, &main, blocks(&[(0, 3)]));
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::DoesNotFit(_))));
}

#[test]
fn vacuum_root_deletes_the_listed_tuples() {
    let items: Vec<Vec<u8>> = (1..=4).map(|i| leaf(16 + 8 * usize::from(i), i, 0, i as u8)).collect();
    let mut page = spg_page(SPGIST_LEAF, &items, 0, 0);
    let mut main = 3u16.to_le_bytes().to_vec();
    main.extend_from_slice(&[0, 0]);
    main.extend_from_slice(&state(XID, false));
    main.extend_from_slice(&offsets(&[1, 2, 4]));
    let rec = record(XLOG_SPGIST_VACUUM_ROOT, &main, blocks(&[(0, 1)]));
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(bufpage::page_get_max_offset(&page), 1);
    assert_eq!(item(&page, 1), items[2]);
}

#[test]
fn vacuum_redirect_turns_redirects_into_placeholders_and_drops_the_trailing_ones() {
    let redirect = dead_tuple(SPGIST_REDIRECT, 5, 2, 77).to_vec();
    let placeholder = dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0).to_vec();
    let mut page = spg_page(0, &[inner(0, &[(2, 2)]), redirect.clone(), placeholder.clone(), redirect], 2, 1);
    let mut main = Vec::new();
    main.extend_from_slice(&2u16.to_le_bytes());
    main.extend_from_slice(&3u16.to_le_bytes());
    main.extend_from_slice(&77u32.to_le_bytes());
    main.extend_from_slice(&offsets(&[2, 4]));
    let rec = record(XLOG_SPGIST_VACUUM_REDIRECT, &main, blocks(&[(0, 1)]));
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(bufpage::page_get_max_offset(&page), 2);
    let mut expect = placeholder;
    expect[12..16].copy_from_slice(&77u32.to_le_bytes()); // the xid stays
    assert_eq!(item(&page, 2), expect);
    assert_eq!(counters(&page), (0, 1));
    // More redirects than the page counts.
    let mut short = spg_page(0, &[inner(0, &[(2, 2)]), dead_tuple(SPGIST_REDIRECT, 5, 2, 77).to_vec()], 0, 0);
    let mut main = [&main[..8], &offsets(&[2])[..]].concat();
    main[0] = 1;
    let rec = record(XLOG_SPGIST_VACUUM_REDIRECT, &main, blocks(&[(0, 1)]));
    assert!(matches!(apply(&rec, 0, &mut short), Err(RedoError::DoesNotFit(_))));
}

#[test]
fn unknown_op_codes_short_main_data_and_untouched_blocks_are_errors() {
    let mut page = spg_page(SPGIST_LEAF, &[leaf(16, 1, 0, 1)], 0, 0);
    let before = page.clone();
    for info in [0x00, 0x90, 0xF0] {
        let rec = record(info, &[0; 32], blocks(&[(0, 1)]));
        assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
    }
    for info in (1..=8).map(|i| i << 4) {
        let rec = record(info, &[0; 3], blocks(&[(0, 1), (5, 2)]));
        assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))), "{info:#x}");
        let rec = record(info, &[0; 64], blocks(&[(0, 1), (1, 2), (2, 3), (5, 2)]));
        assert!(matches!(apply(&rec, 5, &mut page), Err(RedoError::Malformed(_))), "{info:#x}");
    }
    assert_eq!(page, before);
}

#[test]
fn spg_mask_masks_the_metapage_cache_but_not_a_leaf_page_content() {
    use crate::pg15::mask::{first_difference, spg_mask};
    let mut meta = Box::new([0u8; BLCKSZ]);
    bufpage::page_init(&mut meta, SPGIST_SPECIAL_SIZE);
    Opaque { flags: SPGIST_META, n_redirection: 0, n_placeholder: 0, page_id: SPGIST_PAGE_ID }
        .write(&mut meta)
        .unwrap();
    page::set_pd_lower(&mut meta, 92);
    meta[24..28].copy_from_slice(&0xBA5E_BA11u32.to_le_bytes());
    let mut other = meta.clone();
    other[40] = 9;
    assert_eq!(first_difference(16, &meta[..], &other[..]), None);
    other[25] = 1; // the magic number is compared
    assert_eq!(first_difference(16, &meta[..], &other[..]), Some(25));

    let page = spg_page(SPGIST_LEAF, &[leaf(16, 1, 0, 1)], 0, 0);
    let mut changed = page.clone();
    let last = BLCKSZ - SPGIST_SPECIAL_SIZE - 1;
    changed[last] ^= 1;
    changed[..8].fill(0xFF);
    assert_eq!(first_difference(16, &page[..], &changed[..]), Some(last));
    let mut masked = changed.to_vec();
    spg_mask(&mut masked);
    assert!(masked[..8].iter().all(|&b| b == 0));
}

#[test]
fn a_will_init_block_is_redone_whatever_its_lsn() {
    let first = leaf(24, 1, 0, 0x11);
    let main = add_leaf_main(true, 1, 0, 0, 0, &first);
    let mut b = block(0, 5);
    b.flags = FLAG_WILL_INIT;
    let rec = record(XLOG_SPGIST_ADD_LEAF, &main, vec![b]);
    let mut bytes = Vec::new();
    rec.encode(&mut bytes).unwrap();
    let mut page = Box::new([0u8; BLCKSZ]);
    page::set_page_lsn(&mut page, END_LSN + 1);
    crate::pg15::redo::apply(&bytes, &mut page).unwrap().unwrap();
    assert_eq!(item(&page, 1), first);
}

/// A valid SP-GiST page of leaves (`leaf`) or inner tuples, placeholders and redirects mixed in
/// by `sizes`.
fn valid_page(leaf_page: bool, sizes: &[u8]) -> Box<Page> {
    let mut n_red = 0;
    let mut n_ph = 0;
    let items: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, s)| match s % 5 {
            0 => {
                n_ph += 1;
                dead_tuple(SPGIST_PLACEHOLDER, INVALID_BLOCK, 0, 0).to_vec()
            }
            1 => {
                n_red += 1;
                dead_tuple(SPGIST_REDIRECT, 3, 1, 9).to_vec()
            }
            _ if leaf_page => leaf(16 + 8 * usize::from(s % 7), i as u16 + 1, 0, *s),
            _ => inner(8 * usize::from(s % 3), &vec![(2, 1); usize::from(s % 4)]),
        })
        .collect();
    spg_page(if leaf_page { SPGIST_LEAF } else { 0 }, &items, n_red, n_ph)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_records_on_random_pages_never_panic(
        op in 0u8..16,
        id in 0u8..5,
        main in proptest::collection::vec(any::<u8>(), 0..120),
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
        at in 0usize..BLCKSZ,
        kind in 0u8..3,
        sizes in proptest::collection::vec(any::<u8>(), 0..20),
    ) {
        let mut page = match kind {
            0 => Box::new([0u8; BLCKSZ]),
            k => valid_page(k == 1, &sizes),
        };
        let end = (at + bytes.len()).min(BLCKSZ);
        page[at..end].copy_from_slice(&bytes[..end - at]);
        let rec = record(op << 4, &main, (0..5).map(|i| block(i, u32::from(i) + 1)).collect());
        let _ = apply(&rec, id, &mut page);
        let mut masked = page.to_vec();
        crate::pg15::mask::spg_mask(&mut masked);
    }

    /// Well-formed fixed parts (counts, offsets near the page's, tuples of plausible sizes)
    /// on valid SP-GiST pages: errors, never a panic.
    #[test]
    fn random_tuples_in_valid_records_on_valid_pages_never_panic(
        op in 1u8..9,
        id in 0u8..4,
        flags in any::<[bool; 6]>(),
        counts in proptest::collection::vec(0u16..5, 4),
        offs in proptest::collection::vec(0u16..24, 0..24),
        tuple_sizes in proptest::collection::vec(0usize..300, 0..8),
        nodes in 0u16..6,
        leaf_page in any::<bool>(),
        sizes in proptest::collection::vec(any::<u8>(), 0..24),
    ) {
        let mut page = valid_page(leaf_page, &sizes);
        let b = |x: bool| u8::from(x);
        let mut main = vec![b(flags[0]), b(flags[1])];
        for c in &counts {
            main.extend_from_slice(&c.to_le_bytes());
        }
        main.extend_from_slice(&[b(flags[2]), b(flags[3]), b(flags[4]), b(flags[5])]);
        main.extend_from_slice(&nodes.to_le_bytes());
        main.extend_from_slice(&[0, 0]);
        main.extend_from_slice(&state(XID, flags[3]));
        main.extend_from_slice(&offsets(&offs));
        for (i, &size) in tuple_sizes.iter().enumerate() {
            if i % 2 == 0 {
                main.extend_from_slice(&leaf(16 + size, i as u16, 0, i as u8));
            } else {
                main.extend_from_slice(&inner(8 * (size % 4), &vec![(1, 1); usize::from(nodes)]));
            }
        }
        let rec = record(op << 4, &main, (0..4).map(|i| block(i, u32::from(i) + 1)).collect());
        let _ = apply(&rec, id, &mut page);
    }
}
