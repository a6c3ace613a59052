//! Tests of the checkpoint codec and the start segment: PostgreSQL 15's own bytes (a fresh
//! `initdb` cluster's `checkPointCopy` and the shutdown checkpoint record it wrote) against
//! ours; X' at every kind of position; the segment read back by the WAL decoder as a reader
//! that looks for the first record of X''s page (as `pg_waldump -s` does) and as one that starts
//! at X' (as PostgreSQL's startup does).

use proptest::prelude::*;

use super::*;
use crate::wal::page::XLP_FIRST_IS_CONTRECORD;
use crate::wal::WalDecoder;

const SEG: u64 = DEFAULT_SEGMENT_SIZE as u64;
const PAGE: u64 = WAL_PAGE_SIZE;

fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect()
}

/// `checkPointCopy` of a cluster just made by PostgreSQL 15.18's `initdb` (shut down), whose
/// `pg_controldata` said: checkpoint and REDO location 0/1500708, TimeLineID 1, PrevTimeLineID
/// 1, full_page_writes on, NextXID 0:724, NextOID 13572, NextMultiXactId 1, NextMultiOffset 0,
/// oldestXID 716 in DB 1, oldestActiveXID 0, oldestMultiXid 1 in DB 1, commit-ts xids 0/0.
const INITDB_CHECKPOINT: &str = concat!(
    "080750010000000001000000010000000100000000000000d402000000000000043500000100000000000000",
    "cc02000001000000010000000100000000000000cf2f0b6b0000000000000000000000000000000000000000",
);
/// The record `initdb` wrote for it at 0/1500708 (`xl_prev` 0/15006C0), as `pg_waldump` shows:
/// "CHECKPOINT_SHUTDOWN redo 0/1500708; tli 1; prev tli 1; fpw true; xid 0:724; oid 13572; ...".
const INITDB_RECORD: &str = concat!(
    "7200000000000000c0065001000000000000000040819934",
    "ff58080750010000000001000000010000000100000000000000d4020000000000000435000001000000000000",
    "00cc02000001000000010000000100000000000000cf2f0b6b0000000000000000000000000000000000000000",
);

fn initdb_checkpoint() -> CheckPoint {
    CheckPoint::decode(&unhex(INITDB_CHECKPOINT)).expect("initdb's checkpoint")
}

#[test]
fn initdb_checkpoint_decodes_to_what_pg_controldata_shows_and_encodes_back_byte_for_byte() {
    let bytes = unhex(INITDB_CHECKPOINT);
    let cp = CheckPoint::decode(&bytes).expect("decode");
    assert_eq!(
        cp,
        CheckPoint {
            redo: Lsn(0x0150_0708),
            this_timeline_id: 1,
            prev_timeline_id: 1,
            full_page_writes: true,
            next_xid: 724,
            next_oid: 13572,
            next_multi: 1,
            next_multi_offset: 0,
            oldest_xid: 716,
            oldest_xid_db: 1,
            oldest_multi: 1,
            oldest_multi_db: 1,
            time: 0x6b0b_2fcf,
            oldest_commit_ts_xid: 0,
            newest_commit_ts_xid: 0,
            oldest_active_xid: 0,
        }
    );
    assert_eq!(cp.encode().to_vec(), bytes);
}

#[test]
fn our_shutdown_record_is_initdb_s_but_for_the_prev_link() {
    let theirs = unhex(INITDB_RECORD);
    assert_eq!(theirs.len(), CHECKPOINT_RECORD_LEN);
    let mut ours = shutdown_checkpoint_record(&initdb_checkpoint()).to_vec();
    assert_eq!(&ours[8..16], &[0; 8], "xl_prev 0");
    // With initdb's prev-link and the CRC computed again, the bytes are initdb's.
    ours[8..16].copy_from_slice(&theirs[8..16]);
    let crc = record_crc(&ours).expect("header");
    ours[XL_CRC_OFFSET..XLOG_RECORD_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    assert_eq!(ours, theirs);
}

#[test]
fn bad_checkpoint_bytes_are_errors() {
    let mut bytes = unhex(INITDB_CHECKPOINT);
    assert_eq!(CheckPoint::decode(&bytes[..87]), Err(CheckPointError::Length { len: 87 }));
    assert_eq!(CheckPoint::decode(&[]), Err(CheckPointError::Length { len: 0 }));
    bytes[FULL_PAGE_WRITES] = 2;
    assert_eq!(CheckPoint::decode(&bytes), Err(CheckPointError::FullPageWrites { value: 2 }));
}

fn lsn_of(x: u64) -> Lsn {
    shutdown_checkpoint_lsn(Lsn(x), DEFAULT_SEGMENT_SIZE).expect("a start point")
}

#[test]
fn the_start_point_is_x_aligned_past_page_headers_and_inside_one_segment() {
    let s = 5 * SEG; // a segment start
                     // On a record boundary already, mid-page.
    assert_eq!(lsn_of(s + 3 * PAGE + 0x100), Lsn(s + 3 * PAGE + 0x100));
    // The end of a record: the next 8-byte boundary.
    assert_eq!(lsn_of(s + 3 * PAGE + 0x172), Lsn(s + 3 * PAGE + 0x178));
    // On a page boundary, or in a header: past the short header.
    assert_eq!(lsn_of(s + 3 * PAGE), Lsn(s + 3 * PAGE + 24));
    assert_eq!(lsn_of(s + 3 * PAGE + 5), Lsn(s + 3 * PAGE + 24));
    assert_eq!(lsn_of(s + 3 * PAGE - 3), Lsn(s + 3 * PAGE + 24), "aligned up onto the page boundary");
    // On a segment boundary: past the long header.
    assert_eq!(lsn_of(s), Lsn(s + 40));
    assert_eq!(lsn_of(s + 33), Lsn(s + 40));
    assert_eq!(lsn_of(s + 40), Lsn(s + 40));
    // A record that crosses a page stays where it is.
    assert_eq!(lsn_of(s + 3 * PAGE - 16), Lsn(s + 3 * PAGE - 16));
    // The last page of a segment: the record fits if it ends by the segment's end...
    assert_eq!(lsn_of(s + SEG - 120), Lsn(s + SEG - 120));
    assert_eq!(lsn_of(s + SEG - 126), Lsn(s + SEG - 120));
    // ...and otherwise starts the next segment.
    assert_eq!(lsn_of(s + SEG - 119), Lsn(s + SEG + 40));
    assert_eq!(lsn_of(s + SEG - 112), Lsn(s + SEG + 40));
    assert_eq!(lsn_of(s + SEG - 8), Lsn(s + SEG + 40));
    assert_eq!(lsn_of(s + SEG - 1), Lsn(s + SEG + 40));
}

#[test]
fn start_points_that_cannot_be_written_are_refused() {
    let cp = initdb_checkpoint();
    assert_eq!(
        shutdown_checkpoint_segment(Lsn(SEG), 1, 7, 1 << 20, &cp),
        Err(StartPointError::SegmentSize { size: 1 << 20 })
    );
    assert_eq!(shutdown_checkpoint_segment(Lsn(SEG), 0, 7, SEG as u32, &cp), Err(StartPointError::Timeline));
    for x in [0, 1, SEG - 1, u64::MAX, u64::MAX - SEG] {
        assert_eq!(
            shutdown_checkpoint_segment(Lsn(x), 1, 7, SEG as u32, &cp),
            Err(StartPointError::Lsn { lsn: Lsn(x) })
        );
    }
}

#[test]
fn segment_file_names_are_postgresql_s() {
    assert_eq!(segment_file_name(1, Lsn(0x0150_0708), SEG as u32), "000000010000000000000001");
    assert_eq!(segment_file_name(3, Lsn(0x1_FF00_0000), SEG as u32), "0000000300000001000000FF");
    assert_eq!(segment_file_name(1, Lsn(0x2_0000_0028), SEG as u32), "000000010000000200000000");
}

/// Decodes `seg` from `from` to the end of the written WAL (the zeros after the record, or the
/// end of the segment when the record fills it): the records.
fn decode_from(seg: &StartSegment, from: u64) -> Vec<crate::wal::DecodedRecord> {
    let seg_start = seg.lsn.0 - seg.lsn.0 % SEG;
    let mut decoder = WalDecoder::with_segment_size(Lsn(from), SEG as u32).expect("a valid start");
    // The record's pages and the one after: zeros there end the WAL.
    let to = (seg.end_lsn.0 - seg.end_lsn.0 % PAGE + 2 * PAGE).min(seg_start + SEG);
    decoder.feed(&seg.bytes[(from - seg_start) as usize..(to - seg_start) as usize]);
    let mut records = Vec::new();
    loop {
        match decoder.next_record() {
            Ok(Some(record)) => records.push(record),
            Ok(None) => {
                assert_eq!(decoder.consumed_lsn(), Lsn(seg_start + SEG), "stopped before the segment's end");
                return records;
            }
            Err(e) => {
                assert!(e.is_end_of_wal(), "decoding from {}: {e}", Lsn(from));
                return records;
            }
        }
    }
}

/// Writes the start segment for `x` and checks everything a reader relies on.
fn check_start_segment(x: u64) -> StartSegment {
    let mut cp = initdb_checkpoint();
    cp.next_xid = (3 << 32) | 9999;
    cp.time = 1_700_000_000;
    let seg = shutdown_checkpoint_segment(Lsn(x), 2, 0x6b0a_e4c3_106e_cd5f, DEFAULT_SEGMENT_SIZE, &cp)
        .expect("a start segment");
    let lsn = seg.lsn.0;
    assert!(lsn >= x && lsn % MAXALIGN == 0, "X' {} for X {}", seg.lsn, Lsn(x));
    assert_eq!(seg.checkpoint, CheckPoint { redo: seg.lsn, ..cp });
    assert_eq!(seg.bytes.len(), SEG as usize);
    let seg_start = lsn - lsn % SEG;
    assert_eq!(seg.file_name, segment_file_name(2, Lsn(seg_start), SEG as u32));
    assert!(seg.end_lsn.0 <= seg_start + SEG, "the record ends in the segment");

    // Page 0: PostgreSQL validates the long header of a segment before reading any page of it.
    let first = PageHeader::parse(&seg.bytes).expect("a header");
    first.validate(Lsn(seg_start), Some(DEFAULT_SEGMENT_SIZE)).expect("a valid long header");
    assert_eq!(first.long.map(|l| l.system_id), Some(0x6b0a_e4c3_106e_cd5f));
    assert_eq!(first.tli, 2);

    // X''s page: the continuation it claims ends at X'.
    let page = lsn - lsn % PAGE;
    let header = PageHeader::parse(&seg.bytes[(page - seg_start) as usize..]).expect("a header");
    header.validate(Lsn(page), Some(DEFAULT_SEGMENT_SIZE)).expect("a valid header");
    assert_eq!(page + header.size() as u64 + u64::from(header.rem_len), lsn);
    assert_eq!(header.info & XLP_FIRST_IS_CONTRECORD != 0, header.rem_len > 0);

    // As pg_waldump -s finds it (from the page start) and as the startup reads it (at X').
    for from in [page, lsn] {
        let records = decode_from(&seg, from);
        assert_eq!(records.len(), 1, "from {}", Lsn(from));
        let record = &records[0];
        assert_eq!((record.lsn, record.end_lsn), (seg.lsn, seg.end_lsn));
        assert_eq!((record.rmid, record.info, record.xid, record.prev), (RM_XLOG_ID, 0, 0, Lsn(0)));
        assert!(record.blocks.is_empty());
        assert_eq!(CheckPoint::decode(&record.main_data), Ok(seg.checkpoint));
    }
    // Nothing else in the segment: with the headers and the record wiped, zeros.
    let mut rest = seg.bytes.clone();
    let mut wipe = |from: u64, len: usize| rest[(from - seg_start) as usize..][..len].fill(0);
    wipe(seg_start, first.size());
    wipe(page, header.size());
    let mut pos = lsn;
    let mut left = CHECKPOINT_RECORD_LEN;
    while left > 0 {
        let n = left.min((PAGE - pos % PAGE) as usize);
        wipe(pos, n);
        left -= n;
        pos += n as u64;
        if left > 0 {
            wipe(pos, SHORT_PAGE_HEADER_LEN);
            pos += SHORT_PAGE_HEADER_LEN as u64;
        }
    }
    assert!(rest == vec![0u8; SEG as usize], "only the headers and the record are written");
    seg
}

#[test]
fn start_segments_at_every_kind_of_position_decode_back_to_the_checkpoint() {
    let s = 0x1_2300_0000; // a segment start above 4 GiB: the file name's middle part is 1
    for x in [
        s + 3 * PAGE + 0x172, // the end of a record mid-page
        s + 40,               // the first record position of a segment
        s + 3 * PAGE,         // a page boundary
        s + 3 * PAGE + 7,     // inside a page header
        s,                    // a segment boundary
        s + 5 * PAGE - 16,    // the record crosses a page
        s + 5 * PAGE - 112,   // it ends exactly at a page end
        s + SEG - 120,        // the last that fits in the segment
        s + SEG - 60,         // does not fit: the next segment
    ] {
        check_start_segment(x);
    }
}

#[test]
fn a_record_crossing_a_page_gets_a_continuation_header() {
    let s = 7 * SEG;
    let seg = check_start_segment(s + 2 * PAGE - 16);
    let next = PageHeader::parse(&seg.bytes[(2 * PAGE) as usize..]).expect("a header");
    assert_eq!(next.info, XLP_FIRST_IS_CONTRECORD);
    assert_eq!(next.rem_len as usize, CHECKPOINT_RECORD_LEN - 16);
    assert_eq!(seg.end_lsn, Lsn(s + 2 * PAGE + 24 + CHECKPOINT_RECORD_LEN as u64 - 16));
}

#[test]
fn a_record_that_would_leave_the_segment_starts_the_next_one() {
    let s = 7 * SEG;
    let seg = check_start_segment(s + SEG - 64);
    assert_eq!(seg.lsn, Lsn(s + SEG + 40));
    assert_eq!(seg.file_name, "000000020000000000000008");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn any_x_gives_a_start_segment_that_decodes(x in SEG..(1u64 << 40)) {
        check_start_segment(x);
    }

    #[test]
    fn any_x_near_a_page_or_segment_end_gives_a_start_segment_that_decodes(
        page in 1u64..(SEG / PAGE), before in 0u64..160,
    ) {
        check_start_segment(3 * SEG + page * PAGE - before);
    }
}
