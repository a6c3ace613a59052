//! Hash redo, record type by record type, on pages built by hand; and random records on random
//! and on valid hash pages, which must never panic.

#![allow(clippy::unwrap_used)]

use super::layout::{self, get_f64, get_u16, get_u32, meta, Opaque, HASHO_PAGE_ID, INVALID};
use super::*;
use crate::page::{self, ItemId, BLCKSZ, LP_DEAD, LP_NORMAL};
use crate::pg15::{BlockHeader, Pg15Record, FLAG_DATA_INCLUDED, FLAG_HAS_DATA, FLAG_WILL_INIT};
use proptest::prelude::*;

const END_LSN: u64 = 0x1_0000_0100;

fn block(id: u8, blkno: u32, data: &[u8]) -> BlockHeader<'_> {
    let flags = if data.is_empty() { 0 } else { FLAG_HAS_DATA | FLAG_DATA_INCLUDED };
    BlockHeader { id, flags, fork: 0, spcnode: 1663, dbnode: 5, relnode: 16400, blkno, data }
}

fn record<'a>(info: u8, main: &'a [u8], blocks: Vec<BlockHeader<'a>>) -> Pg15Record<'a> {
    Pg15Record {
        rmid: crate::pg15::redo::RM_HASH,
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

/// A hash index tuple as `_hash_form_tuple` makes it: the heap TID, `t_info` its size (16,
/// `MAXALIGN`ed by `index_form_tuple`), the 4-byte hash key, padding.
fn itup(heap_block: u16, heap_off: u16, hash: u32) -> Vec<u8> {
    let mut t = Vec::with_capacity(16);
    for v in [0u16, heap_block, heap_off, 16] {
        t.extend_from_slice(&v.to_le_bytes());
    }
    t.extend_from_slice(&hash.to_le_bytes());
    t.extend_from_slice(&[0; 4]);
    t
}

fn op(prev: u32, next: u32, bucket: u32, flag: u16) -> Opaque {
    Opaque { prev, next, bucket, flag, page_id: HASHO_PAGE_ID }
}

/// A bucket or overflow page with `op` and `items` added in order.
fn hash_page(o: Opaque, items: &[Vec<u8>]) -> Box<Page> {
    let mut page = Box::new([0u8; BLCKSZ]);
    layout::init_buf(&mut page, 0, 0, 0);
    o.write(&mut page).unwrap();
    for (i, item) in items.iter().enumerate() {
        bufpage::page_add_item(&mut page, item, (i + 1) as u16, false, false).unwrap();
    }
    page
}

fn bucket(n: u32) -> Opaque {
    op(3, INVALID, n, layout::LH_BUCKET_PAGE)
}

fn items_of(page: &Page) -> Vec<Vec<u8>> {
    let n = bufpage::page_get_max_offset(page);
    (1..=n).map(|i| bufpage::page_get_item(page, i).unwrap().to_vec()).collect()
}

fn tuples(n: u32) -> Vec<Vec<u8>> {
    (1..=n).map(|k| itup(1, k as u16, k * 10)).collect()
}

/// The metapage of a new index of two buckets, as `_hash_init` leaves it after its bitmap page.
fn metapage() -> Box<Page> {
    let mut page = Box::new([0u8; BLCKSZ]);
    layout::init_metapage(&mut page, 0.0, 450, 307);
    layout::put_u32(&mut page[..], meta::MAPP, 3).unwrap();
    layout::put_u32(&mut page[..], meta::NMAPS, 1).unwrap();
    page
}

fn meta_u32(page: &Page, at: usize) -> u32 {
    get_u32(&page[..], at).unwrap()
}

fn u16s(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `page` must equal `want` under `hash_mask` (which masks the stale bytes a deletion leaves in
/// the hole), with the record's end as its LSN.
fn assert_masked(page: &Page, want: &Page) {
    assert_eq!(page::page_lsn(page), END_LSN);
    let (mut a, mut b) = (page.to_vec(), want.to_vec());
    crate::pg15::mask::hash_mask(&mut a);
    crate::pg15::mask::hash_mask(&mut b);
    assert_eq!(a, b);
}

/// `page` must equal `want` but for the LSN, which must be the record's end.
fn assert_page(page: &Page, want: &Page) {
    assert_eq!(page::page_lsn(page), END_LSN);
    assert_eq!(page[8..], want[8..]);
}

#[test]
fn init_meta_page_builds_the_metapage_of_two_buckets() {
    let mut main = 0.0f64.to_le_bytes().to_vec();
    main.extend_from_slice(&450u32.to_le_bytes());
    main.extend_from_slice(&307u16.to_le_bytes());
    let rec = record(XLOG_HASH_INIT_META_PAGE, &main, vec![block(0, 0, &[])]);
    let mut page = Box::new([0x5Au8; BLCKSZ]);
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(page::page_lsn(&page), END_LSN);
    assert_eq!((page::pd_lower(&page), page::pd_upper(&page), page::pd_special(&page)), (4568, 8176, 8176));
    assert_eq!(Opaque::read(&page).unwrap(), op(INVALID, INVALID, INVALID, layout::LH_META_PAGE));
    let p = &page[..];
    assert_eq!((get_u32(p, meta::MAGIC), get_u32(p, meta::VERSION)), (Some(0x0644_0640), Some(4)));
    assert_eq!(get_f64(p, meta::NTUPLES), Some(0.0));
    assert_eq!(
        [meta::FFACTOR, meta::BSIZE, meta::BMSIZE, meta::BMSHIFT].map(|at| get_u16(p, at).unwrap()),
        [307, 8152, 4096, 15]
    );
    assert_eq!(
        [
            meta::MAXBUCKET,
            meta::HIGHMASK,
            meta::LOWMASK,
            meta::OVFLPOINT,
            meta::FIRSTFREE,
            meta::NMAPS,
            meta::PROCID
        ]
        .map(|at| get_u32(p, at).unwrap()),
        [1, 3, 1, 1, 0, 0, 450]
    );
    assert_eq!(get_u32(p, meta::SPARES + 4), Some(1));
    let nonzero: usize = page[meta::SPARES..BLCKSZ - 16].iter().filter(|b| **b != 0).count();
    assert_eq!(nonzero, 1, "every spare but one and every mapp entry are zero");

    let nan = f64::NAN.to_le_bytes().iter().chain(&main[8..]).copied().collect::<Vec<u8>>();
    let rec = record(XLOG_HASH_INIT_META_PAGE, &nan, vec![block(0, 0, &[])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
    let rec = record(XLOG_HASH_INIT_META_PAGE, &main[..13], vec![block(0, 0, &[])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
    let rec = record(XLOG_HASH_INIT_META_PAGE, &main, vec![block(0, 0, &[]), block(1, 1, &[])]);
    assert!(matches!(apply(&rec, 1, &mut page), Err(RedoError::Malformed(_))));
}

#[test]
fn init_bitmap_page_sets_every_bit_and_lists_the_page_in_the_metapage() {
    let main = 4096u16.to_le_bytes();
    let rec = record(XLOG_HASH_INIT_BITMAP_PAGE, &main, vec![block(0, 3, &[]), block(1, 0, &[])]);
    let mut bitmap = Box::new([0x11u8; BLCKSZ]);
    apply(&rec, 0, &mut bitmap).unwrap();
    assert_eq!(page::pd_lower(&bitmap), 24 + 4096);
    assert!(bitmap[24..24 + 4096].iter().all(|b| *b == 0xFF));
    assert!(bitmap[24 + 4096..8176].iter().all(|b| *b == 0));
    assert_eq!(Opaque::read(&bitmap).unwrap(), op(INVALID, INVALID, INVALID, layout::LH_BITMAP_PAGE));

    let mut page = Box::new([0u8; BLCKSZ]);
    layout::init_metapage(&mut page, 0.0, 450, 307);
    apply(&rec, 1, &mut page).unwrap();
    assert_eq!((meta_u32(&page, meta::MAPP), meta_u32(&page, meta::NMAPS)), (3, 1), "maxbucket 1: block 3");
    assert_eq!(page::page_lsn(&page), END_LSN);
    layout::put_u32(&mut page[..], meta::NMAPS, layout::HASH_MAX_BITMAPS).unwrap();
    assert!(matches!(apply(&rec, 1, &mut page), Err(RedoError::DoesNotFit(_))), "hashm_mapp full");

    let too_big = 8153u16.to_le_bytes();
    let rec = record(XLOG_HASH_INIT_BITMAP_PAGE, &too_big, vec![block(0, 3, &[])]);
    assert!(matches!(apply(&rec, 0, &mut bitmap), Err(RedoError::DoesNotFit(_))));
}

#[test]
fn insert_adds_the_tuple_at_its_offset_and_counts_it_in_the_metapage() {
    let mut page = hash_page(bucket(1), &[itup(1, 1, 10), itup(1, 3, 30)]);
    let new = itup(1, 2, 20);
    let rec = record(XLOG_HASH_INSERT, &[2, 0], vec![block(0, 2, &new), block(1, 0, &[])]);
    apply(&rec, 0, &mut page).unwrap();
    let mut want = hash_page(bucket(1), &[itup(1, 1, 10), itup(1, 3, 30)]);
    bufpage::page_add_item(&mut want, &new, 2, false, false).unwrap();
    assert_page(&page, &want);
    assert_eq!(items_of(&page), vec![itup(1, 1, 10), new.clone(), itup(1, 3, 30)]);
    let mut mp = metapage();
    layout::put_f64(&mut mp[..], meta::NTUPLES, 41.0).unwrap();
    apply(&rec, 1, &mut mp).unwrap();
    assert_eq!(get_f64(&mp[..], meta::NTUPLES), Some(42.0));
    let past = record(XLOG_HASH_INSERT, &[9, 0], vec![block(0, 2, &new)]);
    assert!(matches!(apply(&past, 0, &mut page), Err(RedoError::DoesNotFit(_))));
}

#[test]
fn add_ovfl_page_links_the_new_page_and_updates_bitmap_and_metapage() {
    // A new overflow page 9 after page 2 of bucket 1; bit 5 set; a new bitmap page 10.
    let main = [0x00, 0x10, 0];
    let (bucket_no, bit, firstfree) = (1u32.to_le_bytes(), 5u32.to_le_bytes(), 6u32.to_le_bytes());
    let rec = record(
        XLOG_HASH_ADD_OVFL_PAGE,
        &main,
        vec![
            block(0, 9, &bucket_no),
            block(1, 2, &[]),
            block(2, 3, &bit),
            block(3, 10, &[]),
            block(4, 0, &firstfree),
        ],
    );
    let mut ovfl = Box::new([0xEEu8; BLCKSZ]);
    apply(&rec, 0, &mut ovfl).unwrap();
    assert_page(&ovfl, &hash_page(op(2, INVALID, 1, layout::LH_OVERFLOW_PAGE), &[]));
    let mut left = hash_page(bucket(1), &tuples(3));
    apply(&rec, 1, &mut left).unwrap();
    assert_eq!(Opaque::read(&left).unwrap(), Opaque { next: 9, ..bucket(1) });
    let mut bitmap = Box::new([0u8; BLCKSZ]);
    layout::init_bitmap(&mut bitmap, 4096).unwrap();
    bitmap[24..28].fill(0);
    apply(&rec, 2, &mut bitmap).unwrap();
    assert_eq!(&bitmap[24..28], &[0x20, 0, 0, 0]);
    let mut newmap = Box::new([0u8; BLCKSZ]);
    apply(&rec, 3, &mut newmap).unwrap();
    assert_eq!((page::pd_lower(&newmap), newmap[24 + 4095]), (24 + 4096, 0xFF));
    let mut mp = metapage();
    apply(&rec, 4, &mut mp).unwrap();
    assert_eq!(meta_u32(&mp, meta::FIRSTFREE), 6);
    assert_eq!(meta_u32(&mp, meta::SPARES + 4), 3, "one for the page, one for the new bitmap");
    assert_eq!((meta_u32(&mp, meta::NMAPS), meta_u32(&mp, meta::MAPP + 4)), (2, 10));

    // Found in a bitmap: only hashm_firstfree changes.
    let found = [0x00, 0x10, 1];
    let rec = record(XLOG_HASH_ADD_OVFL_PAGE, &found, vec![block(0, 9, &bucket_no), block(4, 0, &firstfree)]);
    let mut mp = metapage();
    apply(&rec, 4, &mut mp).unwrap();
    let mut want = metapage();
    layout::put_u32(&mut want[..], meta::FIRSTFREE, 6).unwrap();
    assert_page(&mp, &want);
    assert!(matches!(apply(&rec, 0, &mut ovfl), Err(RedoError::Malformed(_))), "no block 1 to link back to");
    let rec = record(XLOG_HASH_ADD_OVFL_PAGE, &found, vec![block(0, 9, &[1, 0]), block(1, 2, &[])]);
    assert!(matches!(apply(&rec, 0, &mut ovfl), Err(RedoError::Malformed(_))), "bucket cut short");
}

#[test]
fn split_allocate_page_marks_the_old_bucket_creates_the_new_and_grows_the_metapage() {
    // Bucket 1 splits into bucket 3 (block 4): new masks 7/3, splitpoint 2 with 1 spare.
    let mut main = 3u32.to_le_bytes().to_vec();
    main.extend_from_slice(&u16s(&[layout::LH_BUCKET_PAGE | layout::LH_BUCKET_BEING_SPLIT]));
    main.extend_from_slice(&u16s(&[layout::LH_BUCKET_PAGE | layout::LH_BUCKET_BEING_POPULATED]));
    main.push(3);
    let data: Vec<u8> = [3u32, 7, 2, 1].iter().flat_map(|v| v.to_le_bytes()).collect();
    let rec = record(
        XLOG_HASH_SPLIT_ALLOCATE_PAGE,
        &main,
        vec![block(0, 2, &[]), block(1, 4, &[]), block(2, 0, &data)],
    );
    let mut old = hash_page(bucket(1), &tuples(2));
    apply(&rec, 0, &mut old).unwrap();
    assert_eq!(
        Opaque::read(&old).unwrap(),
        op(3, INVALID, 1, layout::LH_BUCKET_PAGE | layout::LH_BUCKET_BEING_SPLIT)
    );
    let mut new = Box::new([0u8; BLCKSZ]);
    apply(&rec, 1, &mut new).unwrap();
    assert_page(
        &new,
        &hash_page(op(3, INVALID, 3, layout::LH_BUCKET_PAGE | layout::LH_BUCKET_BEING_POPULATED), &[]),
    );
    let mut mp = metapage();
    apply(&rec, 2, &mut mp).unwrap();
    assert_eq!(
        [meta::MAXBUCKET, meta::LOWMASK, meta::HIGHMASK, meta::OVFLPOINT, meta::SPARES + 8]
            .map(|at| meta_u32(&mp, at)),
        [3, 3, 7, 2, 1]
    );

    // Masks only; then a splitpoint past hashm_spares, and data cut short.
    main[8] = 1;
    let rec = record(XLOG_HASH_SPLIT_ALLOCATE_PAGE, &main, vec![block(2, 0, &data[..8])]);
    let mut mp = metapage();
    apply(&rec, 2, &mut mp).unwrap();
    assert_eq!([meta::MAXBUCKET, meta::OVFLPOINT].map(|at| meta_u32(&mp, at)), [3, 1]);
    main[8] = 2;
    let bad: Vec<u8> = [98u32, 1].iter().flat_map(|v| v.to_le_bytes()).collect();
    let rec = record(XLOG_HASH_SPLIT_ALLOCATE_PAGE, &main, vec![block(2, 0, &bad)]);
    assert!(matches!(apply(&rec, 2, &mut mp), Err(RedoError::DoesNotFit(_))));
    main[8] = 3;
    let rec = record(XLOG_HASH_SPLIT_ALLOCATE_PAGE, &main, vec![block(2, 0, &data[..12])]);
    assert!(matches!(apply(&rec, 2, &mut mp), Err(RedoError::Malformed(_))));
}

#[test]
fn split_page_without_its_image_and_split_complete_and_cleanup() {
    let mut page = hash_page(bucket(1), &tuples(2));
    let rec = record(XLOG_HASH_SPLIT_PAGE, &[], vec![block(0, 2, &[])]);
    assert!(
        matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(m)) if m.contains("full-page image"))
    );

    let main = u16s(&[layout::LH_BUCKET_PAGE, layout::LH_BUCKET_PAGE | layout::LH_PAGE_HAS_DEAD_TUPLES]);
    let rec = record(XLOG_HASH_SPLIT_COMPLETE, &main, vec![block(0, 2, &[]), block(1, 4, &[])]);
    let mut old = hash_page(op(3, INVALID, 1, layout::LH_BUCKET_PAGE | layout::LH_BUCKET_BEING_SPLIT), &[]);
    apply(&rec, 0, &mut old).unwrap();
    assert_eq!(Opaque::read(&old).unwrap().flag, layout::LH_BUCKET_PAGE);
    let mut new =
        hash_page(op(3, INVALID, 3, layout::LH_BUCKET_PAGE | layout::LH_BUCKET_BEING_POPULATED), &[]);
    apply(&rec, 1, &mut new).unwrap();
    assert_eq!(Opaque::read(&new).unwrap().flag, layout::LH_BUCKET_PAGE | layout::LH_PAGE_HAS_DEAD_TUPLES);
    assert_eq!(page::page_lsn(&new), END_LSN);

    let rec = record(XLOG_HASH_SPLIT_CLEANUP, &[], vec![block(0, 2, &[])]);
    let flags =
        layout::LH_BUCKET_PAGE | layout::LH_BUCKET_NEEDS_SPLIT_CLEANUP | layout::LH_PAGE_HAS_DEAD_TUPLES;
    let mut page = hash_page(op(3, INVALID, 1, flags), &tuples(1));
    apply(&rec, 0, &mut page).unwrap();
    assert_eq!(Opaque::read(&page).unwrap().flag, layout::LH_BUCKET_PAGE | layout::LH_PAGE_HAS_DEAD_TUPLES);
}

/// The data of the write page of MOVE_PAGE_CONTENTS and SQUEEZE_PAGE.
fn moved(offsets: &[u16], tups: &[Vec<u8>]) -> Vec<u8> {
    let mut d = u16s(offsets);
    for t in tups {
        d.extend_from_slice(t);
    }
    d
}

#[test]
fn move_page_contents_adds_to_the_write_page_and_deletes_from_the_read_page() {
    let (a, b) = (itup(2, 1, 15), itup(2, 2, 45));
    let data1 = moved(&[2, 4], &[a.clone(), b.clone()]);
    let data2 = u16s(&[1, 3]);
    let main = [2, 0, 0];
    let rec = record(
        XLOG_HASH_MOVE_PAGE_CONTENTS,
        &main,
        vec![block(0, 2, &[]), block(1, 5, &data1), block(2, 9, &data2)],
    );
    let mut primary = hash_page(op(3, 5, 1, layout::LH_BUCKET_PAGE), &tuples(1));
    let before = primary.clone();
    apply(&rec, 0, &mut primary).unwrap();
    assert_eq!(primary, before, "the primary bucket page is only locked");
    let mut write = hash_page(op(2, 9, 1, layout::LH_OVERFLOW_PAGE), &[itup(1, 1, 10), itup(1, 3, 30)]);
    apply(&rec, 1, &mut write).unwrap();
    assert_eq!(items_of(&write), vec![itup(1, 1, 10), a.clone(), itup(1, 3, 30), b]);
    assert_eq!(page::page_lsn(&write), END_LSN);
    let mut read =
        hash_page(op(5, INVALID, 1, layout::LH_OVERFLOW_PAGE), &[a, itup(2, 9, 20), itup(2, 2, 45)]);
    apply(&rec, 2, &mut read).unwrap();
    assert_eq!(items_of(&read), vec![itup(2, 9, 20)]);

    // More tuples than offsets, a tuple cut short, an odd offset list.
    let rec = record(XLOG_HASH_MOVE_PAGE_CONTENTS, &[1, 0, 0], vec![block(1, 5, &data1)]);
    assert!(matches!(apply(&rec, 1, &mut write), Err(RedoError::Malformed(_))));
    let rec = record(XLOG_HASH_MOVE_PAGE_CONTENTS, &main, vec![block(1, 5, &data1[..data1.len() - 3])]);
    assert!(matches!(apply(&rec, 1, &mut write), Err(RedoError::Malformed(_))));
    let rec = record(XLOG_HASH_MOVE_PAGE_CONTENTS, &main, vec![block(2, 9, &[1, 0, 2])]);
    assert!(matches!(apply(&rec, 2, &mut read), Err(RedoError::Malformed(_))));
}

fn squeeze_main(prev: u32, next: u32, ntups: u16, prim: bool, prev_same: bool) -> Vec<u8> {
    let mut m = prev.to_le_bytes().to_vec();
    m.extend_from_slice(&next.to_le_bytes());
    m.extend_from_slice(&ntups.to_le_bytes());
    m.extend_from_slice(&[u8::from(prim), u8::from(prev_same)]);
    m
}

#[test]
fn squeeze_page_moves_tuples_frees_the_page_and_relinks_its_neighbours() {
    // Chain 2 -> 5 -> 9 -> 11; page 9's tuple goes to 5; 9 is freed (bit 3 of bitmap 3).
    let t = itup(4, 4, 99);
    let data1 = moved(&[2], std::slice::from_ref(&t));
    let (bit, firstfree) = (3u32.to_le_bytes(), 3u32.to_le_bytes());
    let main = squeeze_main(5, 11, 1, false, true);
    let rec = record(
        XLOG_HASH_SQUEEZE_PAGE,
        &main,
        vec![
            block(0, 2, &[]),
            block(1, 5, &data1),
            block(2, 9, &[]),
            block(4, 11, &[]),
            block(5, 3, &bit),
            block(6, 0, &firstfree),
        ],
    );
    let mut write = hash_page(op(2, 9, 1, layout::LH_OVERFLOW_PAGE), &tuples(1));
    apply(&rec, 1, &mut write).unwrap();
    assert_page(&write, &hash_page(op(2, 11, 1, layout::LH_OVERFLOW_PAGE), &[itup(1, 1, 10), t]));
    let mut freed = hash_page(op(5, 11, 1, layout::LH_OVERFLOW_PAGE), &tuples(1));
    apply(&rec, 2, &mut freed).unwrap();
    assert_page(&freed, &hash_page(op(INVALID, INVALID, INVALID, layout::LH_UNUSED_PAGE), &[]));
    let mut next = hash_page(op(9, INVALID, 1, layout::LH_OVERFLOW_PAGE), &tuples(2));
    apply(&rec, 4, &mut next).unwrap();
    assert_eq!(Opaque::read(&next).unwrap().prev, 5);
    let mut bitmap = Box::new([0u8; BLCKSZ]);
    layout::init_bitmap(&mut bitmap, 4096).unwrap();
    apply(&rec, 5, &mut bitmap).unwrap();
    assert_eq!(&bitmap[24..28], &[0xF7, 0xFF, 0xFF, 0xFF]);
    let mut mp = metapage();
    apply(&rec, 6, &mut mp).unwrap();
    assert_eq!(meta_u32(&mp, meta::FIRSTFREE), 3);

    // The write page is not the previous page: block 3 is relinked; no tuples moved.
    let main = squeeze_main(5, INVALID, 0, true, false);
    let rec = record(XLOG_HASH_SQUEEZE_PAGE, &main, vec![block(1, 2, &[]), block(3, 5, &[])]);
    let mut prim = hash_page(op(3, 5, 1, layout::LH_BUCKET_PAGE), &tuples(1));
    let mut want = prim.clone();
    apply(&rec, 1, &mut prim).unwrap();
    assert_page(&prim, &want);
    let mut prev = hash_page(op(2, 9, 1, layout::LH_OVERFLOW_PAGE), &tuples(1));
    apply(&rec, 3, &mut prev).unwrap();
    assert_eq!(Opaque::read(&prev).unwrap().next, INVALID);
    // ... and with the write page the previous page, block 3 is not touched at all.
    let main = squeeze_main(5, INVALID, 0, true, true);
    let rec = record(XLOG_HASH_SQUEEZE_PAGE, &main, vec![block(1, 2, &[]), block(3, 5, &[])]);
    want = prev.clone();
    apply(&rec, 3, &mut prev).unwrap();
    assert_eq!(prev, want);
}

#[test]
fn delete_removes_the_offsets_and_may_clear_the_dead_mark() {
    let flags = layout::LH_OVERFLOW_PAGE | layout::LH_PAGE_HAS_DEAD_TUPLES;
    let data = u16s(&[1, 3, 4]);
    let rec = record(XLOG_HASH_DELETE, &[1, 0], vec![block(0, 2, &[]), block(1, 5, &data)]);
    let mut primary = hash_page(bucket(1), &tuples(1));
    let before = primary.clone();
    apply(&rec, 0, &mut primary).unwrap();
    assert_eq!(primary, before);
    let mut page = hash_page(op(2, INVALID, 1, flags), &tuples(5));
    apply(&rec, 1, &mut page).unwrap();
    assert_masked(
        &page,
        &hash_page(op(2, INVALID, 1, layout::LH_OVERFLOW_PAGE), &[itup(1, 2, 20), itup(1, 5, 50)]),
    );
    assert_eq!(Opaque::read(&page).unwrap().flag, layout::LH_OVERFLOW_PAGE);
    let keep = record(XLOG_HASH_DELETE, &[0, 0], vec![block(0, 2, &[]), block(1, 5, &data)]);
    let mut page = hash_page(op(2, INVALID, 1, flags), &tuples(5));
    apply(&keep, 1, &mut page).unwrap();
    assert_eq!(Opaque::read(&page).unwrap().flag, flags);
    let unsorted = u16s(&[4, 1, 3]);
    let rec = record(XLOG_HASH_DELETE, &[1, 0], vec![block(1, 5, &unsorted)]);
    assert!(matches!(apply(&rec, 1, &mut page), Err(RedoError::DoesNotFit(_))));
}

#[test]
fn update_meta_page_sets_the_tuple_count() {
    let main = 1234.0f64.to_le_bytes();
    let rec = record(XLOG_HASH_UPDATE_META_PAGE, &main, vec![block(0, 0, &[])]);
    let mut mp = metapage();
    apply(&rec, 0, &mut mp).unwrap();
    let mut want = metapage();
    layout::put_f64(&mut want[..], meta::NTUPLES, 1234.0).unwrap();
    assert_page(&mp, &want);
}

#[test]
fn vacuum_one_page_deletes_the_dead_tuples_and_uncounts_them() {
    let mut main = 900u32.to_le_bytes().to_vec();
    main.extend_from_slice(&2i32.to_le_bytes());
    main.extend_from_slice(&u16s(&[2, 3]));
    let rec = record(XLOG_HASH_VACUUM_ONE_PAGE, &main, vec![block(0, 2, &[]), block(1, 0, &[])]);
    let mut page =
        hash_page(op(3, INVALID, 1, layout::LH_BUCKET_PAGE | layout::LH_PAGE_HAS_DEAD_TUPLES), &tuples(4));
    for off in [2, 3] {
        let mut id = bufpage::item_id(&page, off).unwrap();
        id.flags = LP_DEAD;
        bufpage::set_item_id(&mut page, off, id).unwrap();
    }
    apply(&rec, 0, &mut page).unwrap();
    assert_masked(&page, &hash_page(bucket(1), &[itup(1, 1, 10), itup(1, 4, 40)]));
    assert_eq!(Opaque::read(&page).unwrap().flag, layout::LH_BUCKET_PAGE);
    assert!(
        (1..=2).all(|o| bufpage::item_id(&page, o).unwrap().flags == LP_NORMAL),
        "the survivors keep their flags"
    );
    let mut mp = metapage();
    layout::put_f64(&mut mp[..], meta::NTUPLES, 10.0).unwrap();
    apply(&rec, 1, &mut mp).unwrap();
    assert_eq!(get_f64(&mp[..], meta::NTUPLES), Some(8.0));
    let short = record(XLOG_HASH_VACUUM_ONE_PAGE, &main[..10], vec![block(0, 2, &[])]);
    assert!(matches!(apply(&short, 0, &mut page), Err(RedoError::Malformed(_))));
    let mut negative = main.clone();
    negative[4..8].copy_from_slice(&(-1i32).to_le_bytes());
    let rec = record(XLOG_HASH_VACUUM_ONE_PAGE, &negative, vec![block(0, 2, &[])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Malformed(_))));
}

/// A block of a record under construction: id, block number, data.
type Blk = (u8, u32, Vec<u8>);

/// Each block's redo needs only its own data: a record stored for one block, encoded with the
/// other blocks' data dropped (as past the encoding's length limit), redoes it the same.
#[test]
fn every_block_redoes_without_the_other_blocks_data() {
    let t = itup(4, 4, 99);
    let data1 = moved(&[2], &[t]);
    let (four, bit) = (1u32.to_le_bytes(), 5u32.to_le_bytes());
    let squeeze = squeeze_main(5, 11, 1, false, false);
    let cases: Vec<(u8, Vec<u8>, Vec<Blk>)> = vec![
        (
            XLOG_HASH_ADD_OVFL_PAGE,
            vec![0, 0x10, 0],
            vec![
                (0, 9, four.to_vec()),
                (1, 2, vec![]),
                (2, 3, bit.to_vec()),
                (3, 10, vec![]),
                (4, 0, four.to_vec()),
            ],
        ),
        (
            XLOG_HASH_SQUEEZE_PAGE,
            squeeze,
            vec![
                (1, 5, data1),
                (2, 9, vec![]),
                (3, 2, vec![]),
                (4, 11, vec![]),
                (5, 3, bit.to_vec()),
                (6, 0, four.to_vec()),
            ],
        ),
    ];
    for (info, main, blocks) in cases {
        let full = record(info, &main, blocks.iter().map(|(id, b, d)| block(*id, *b, d)).collect());
        for (id, _, _) in &blocks {
            let stripped = record(
                info,
                &main,
                blocks.iter().map(|(i, b, d)| block(*i, *b, if i == id { &d[..] } else { &[] })).collect(),
            );
            let mut out = Vec::new();
            Pg15Record { target: *id, ..stripped }.encode(&mut out).unwrap();
            let is_meta = *id == 6 || (*id == 4 && info == XLOG_HASH_ADD_OVFL_PAGE);
            let mut a = if is_meta { metapage() } else { hash_page(bucket(1), &tuples(1)) };
            let mut b = a.clone();
            apply(&full, *id, &mut a).unwrap();
            crate::pg15::redo::apply(&out, &mut b).unwrap().unwrap();
            assert_eq!(a, b, "type {info:#x} block {id}");
        }
    }
}

#[test]
fn unknown_types_and_blocks_are_errors_and_a_done_record_is_skipped() {
    let mut page = hash_page(bucket(1), &tuples(2));
    let rec = record(0xD0, &[], vec![block(0, 2, &[])]);
    assert!(matches!(apply(&rec, 0, &mut page), Err(RedoError::Unsupported(n)) if n == "Hash info 0xd0"));
    let rec = record(XLOG_HASH_INSERT, &[1, 0], vec![block(0, 2, &[]), block(2, 7, &[])]);
    assert!(matches!(apply(&rec, 2, &mut page), Err(RedoError::Malformed(_))));
    // Through the dispatch: a page already past the record is left alone.
    let t = itup(1, 9, 90);
    let rec = Pg15Record { target: 0, ..record(XLOG_HASH_INSERT, &[1, 0], vec![block(0, 2, &t)]) };
    let mut out = Vec::new();
    rec.encode(&mut out).unwrap();
    page::set_page_lsn(&mut page, END_LSN);
    let before = page.clone();
    crate::pg15::redo::apply(&out, &mut page).unwrap().unwrap();
    assert_eq!(page, before);
    page::set_page_lsn(&mut page, 1);
    crate::pg15::redo::apply(&out, &mut page).unwrap().unwrap();
    assert_eq!(items_of(&page)[0], t);
}

/// Pages a hash index has: a bucket page with tuples (one dead), a metapage, a bitmap page, an
/// unused page, all zeros.
fn valid_page(kind: u8) -> Box<Page> {
    match kind % 5 {
        0 => {
            let mut page = hash_page(op(3, 9, 1, layout::LH_BUCKET_PAGE), &tuples(6));
            bufpage::set_item_id(&mut page, 2, ItemId { off: 8160 - 16, flags: LP_DEAD, len: 16 }).unwrap();
            page
        }
        1 => metapage(),
        2 => {
            let mut page = Box::new([0u8; BLCKSZ]);
            layout::init_bitmap(&mut page, 4096).unwrap();
            page
        }
        3 => hash_page(op(INVALID, INVALID, INVALID, layout::LH_UNUSED_PAGE), &[]),
        _ => Box::new([0u8; BLCKSZ]),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16384))]

    #[test]
    fn random_records_on_random_pages_never_panic(
        op in 0u8..16,
        id in 0u8..8,
        main in proptest::collection::vec(any::<u8>(), 0..40),
        data in proptest::collection::vec(any::<u8>(), 0..96),
        bytes in proptest::collection::vec(any::<u8>(), 0..64),
        at in 0usize..BLCKSZ,
        kind in 0u8..6,
    ) {
        let mut page = if kind < 5 { valid_page(kind) } else { Box::new([0xA5u8; BLCKSZ]) };
        let end = (at + bytes.len()).min(BLCKSZ);
        page[at..end].copy_from_slice(&bytes[..end - at]);
        let blocks = (0..7).map(|i| block(i, u32::from(i) + 1, if i == id { &data[..] } else { &[] })).collect();
        let rec = record(op << 4, &main, blocks);
        if id < 7 {
            let _ = apply(&rec, id, &mut page);
        }
        let mut masked = page.to_vec();
        crate::pg15::mask::hash_mask(&mut masked);
    }

    #[test]
    fn records_of_valid_shape_with_random_values_on_valid_pages_never_panic(
        op in 0u8..13,
        words in proptest::collection::vec(any::<u32>(), 4),
        small in proptest::collection::vec(0u16..12, 6),
        tuple_sizes in proptest::collection::vec(0u16..40, 0..4),
        kind in 0u8..5,
    ) {
        let mut main: Vec<u8> = Vec::new();
        for w in &words {
            main.extend_from_slice(&w.to_le_bytes());
        }
        // Small counts and offsets where each struct has them, so that the loops run.
        for at in [0usize, 8, 12] {
            main[at..at + 2].copy_from_slice(&small[at % 6].to_le_bytes());
        }
        main[4..8].copy_from_slice(&i32::from(small[1]).to_le_bytes());
        let mut data = u16s(&small);
        for size in &tuple_sizes {
            let mut t = vec![0u8; usize::from(*size).max(8)];
            t[6..8].copy_from_slice(&size.to_le_bytes());
            data.extend_from_slice(&t);
        }
        for id in 0..7 {
            let blocks = (0..7).map(|i| BlockHeader {
                flags: FLAG_WILL_INIT | FLAG_HAS_DATA,
                ..block(i, u32::from(i) + 1, &data)
            }).collect();
            let rec = record(op << 4, &main, blocks);
            let mut page = valid_page(kind);
            let _ = apply(&rec, id, &mut page);
            let short: Vec<BlockHeader<'_>> = (0..7).map(|i| block(i, u32::from(i) + 1, &data[..4])).collect();
            let rec = record(op << 4, &main, short);
            let _ = apply(&rec, id, &mut valid_page(kind));
        }
    }
}
