//! Tests of the streaming decoder: WAL written by the test encoder (records across pages and
//! segments, switches, overwritten continuations) decodes back equal in any chunking and from
//! either kind of start; damage is reported with its LSN; and no input, random or truncated,
//! makes it panic or loop.

use proptest::prelude::*;

use super::*;
use crate::wal::page::XLP_LONG_HEADER;
use crate::wal::testenc::{arb_record, plain_record, WalWriter};

const SEG: u32 = 1 << 20;

/// Feeds `bytes` in chunks of the given sizes (cycled) and collects records until the decoder
/// needs more than there is or fails. Panics if it returns more records than bytes allow.
fn decode_all(
    decoder: &mut WalDecoder,
    bytes: &[u8],
    chunks: &[usize],
) -> (Vec<DecodedRecord>, Option<WalDecodeError>) {
    let mut out = Vec::new();
    let mut at = 0;
    let mut i = 0;
    loop {
        loop {
            match decoder.next_record() {
                Ok(Some(rec)) => {
                    out.push(rec);
                    assert!(out.len() <= bytes.len() / 24 + 1, "more records than bytes allow");
                }
                Ok(None) => break,
                Err(err) => return (out, Some(err)),
            }
        }
        if at >= bytes.len() {
            return (out, None);
        }
        let n =
            chunks.get(i % chunks.len().max(1)).copied().unwrap_or(bytes.len()).max(1).min(bytes.len() - at);
        decoder.feed(&bytes[at..at + n]);
        at += n;
        i += 1;
    }
}

/// A writer from the start of segment 1 with `records` in it.
fn written(records: &mut [DecodedRecord]) -> WalWriter {
    let mut w = WalWriter::new(u64::from(SEG), SEG);
    for rec in records.iter_mut() {
        w.append(rec);
    }
    w
}

fn big_record(n: usize, fill: u8) -> DecodedRecord {
    plain_record(10, 0x10, vec![fill; n])
}

#[test]
fn records_across_pages_and_segments_decode_in_any_chunking() {
    let mut records: Vec<DecodedRecord> =
        (0..300).map(|i| big_record(10 + (i * 997) % 9000, i as u8)).collect();
    records.push(big_record(3 * SEG as usize / 2, 0xAB)); // spans two segment boundaries
    records.extend((0..20).map(|i| plain_record(1, 0, vec![i; 40])));
    let w = written(&mut records);
    assert!(w.pos > 3 * u64::from(SEG), "the WAL spans several segments");
    for chunks in [vec![w.bytes.len()], vec![8192], vec![1, 7, 8191, 24, 40, 100_000]] {
        let mut decoder = WalDecoder::new(w.start).expect("page start");
        let (got, err) = decode_all(&mut decoder, &w.bytes, &chunks);
        assert_eq!(err, None);
        assert_eq!(got, records, "chunks {chunks:?}");
        assert_eq!(decoder.consumed_lsn(), Lsn(w.pos));
        assert_eq!(decoder.segment_size(), Some(SEG));
        assert_eq!(decoder.system_id(), Some(w.system_id));
    }
}

#[test]
fn one_byte_at_a_time_decodes_the_same_records() {
    let mut records: Vec<DecodedRecord> = (0..40).map(|i| big_record(i * 450, i as u8)).collect();
    let w = written(&mut records);
    let mut decoder = WalDecoder::new(w.start).expect("page start");
    let (got, err) = decode_all(&mut decoder, &w.bytes, &[1]);
    assert_eq!((got, err), (records, None));
    assert_eq!(decoder.fed_lsn(), Lsn(w.pos));
}

#[test]
fn start_at_a_page_inside_a_record_skips_its_continuation() {
    let mut records: Vec<DecodedRecord> = (0..30).map(|i| big_record(3000 + i * 100, i as u8)).collect();
    let w = written(&mut records);
    // Pages whose first bytes continue a record begun before them.
    let mut tried = 0;
    for page in (w.start.0 + 8192..w.pos).step_by(8192) {
        let expected: Vec<_> = records.iter().filter(|r| r.lsn.0 >= page).cloned().collect();
        let off = (page - w.start.0) as usize;
        let mut decoder = WalDecoder::new(Lsn(page)).expect("page start");
        let (mut got, err) = decode_all(&mut decoder, &w.bytes[off..], &[5000]);
        assert_eq!(err, None);
        // The first record starts after the skipped continuation; its prev-link is unchecked.
        if let (Some(g), Some(e)) = (got.first_mut(), expected.first()) {
            g.prev = e.prev;
        }
        assert_eq!(got, expected, "from page {page:X}");
        tried += 1;
    }
    assert!(tried > 10);
}

#[test]
fn start_at_a_record_boundary_mid_page_decodes_from_that_record() {
    let mut records: Vec<DecodedRecord> = (0..50).map(|i| big_record(100 + i * 37, i as u8)).collect();
    let w = written(&mut records);
    for k in [1, 17, 49] {
        let off = (records[k].lsn.0 - w.start.0) as usize;
        let mut decoder = WalDecoder::new(records[k].lsn).expect("record boundary");
        let (got, err) = decode_all(&mut decoder, &w.bytes[off..], &[333]);
        assert_eq!((got, err), (records[k..].to_vec(), None));
    }
    // The end of a record (unaligned) is as good as the next record's start.
    let mut decoder = WalDecoder::new(records[3].end_lsn).expect("record end");
    let off = (records[3].end_lsn.0.next_multiple_of(8) - w.start.0) as usize;
    let (got, _) = decode_all(&mut decoder, &w.bytes[off..], &[1000]);
    assert_eq!(got.first().map(|r| r.lsn), Some(records[4].lsn));
}

#[test]
fn start_inside_a_page_header_is_refused() {
    assert!(matches!(WalDecoder::new(Lsn(8192 + 16)), Err(WalDecodeError::InvalidStart { .. })));
    assert!(WalDecoder::new(Lsn(u64::MAX - 3)).is_err());
    assert!(WalDecoder::with_segment_size(Lsn(0), 12345).is_err());
}

#[test]
fn xlog_switch_skips_the_rest_of_its_segment() {
    let mut w = WalWriter::new(u64::from(SEG), SEG);
    let mut before = vec![big_record(5000, 1), big_record(10, 2)];
    for rec in &mut before {
        w.append(rec);
    }
    let switch = w.switch();
    assert_eq!(w.pos, 2 * u64::from(SEG), "zeros up to the segment end");
    let mut after = vec![big_record(9000, 3), big_record(10, 4)];
    for rec in &mut after {
        w.append(rec);
    }
    let expected: Vec<_> = before.into_iter().chain([switch]).chain(after).collect();
    let mut decoder = WalDecoder::new(w.start).expect("page start");
    let (got, err) = decode_all(&mut decoder, &w.bytes, &[4096]);
    assert_eq!((got, err), (expected, None));
}

#[test]
fn overwritten_contrecord_drops_the_partial_record() {
    let mut w = WalWriter::new(u64::from(SEG), SEG);
    let mut first = big_record(100, 1);
    w.append(&mut first);
    let mut lost = big_record(12000, 2);
    w.append_bytes_of(&mut lost, Some(5000));
    w.overwrite_contrecord();
    let mut next = plain_record(0, 0x90, vec![0; 16]);
    w.append(&mut next);
    let mut decoder = WalDecoder::new(w.start).expect("page start");
    let (got, err) = decode_all(&mut decoder, &w.bytes, &[700]);
    assert_eq!((got, err), (vec![first, next], None));
}

#[test]
fn zeros_after_the_last_record_are_the_end_of_wal() {
    let mut records = vec![big_record(100, 1), big_record(200, 2)];
    let mut w = written(&mut records);
    let mut bytes = w.bytes.clone();
    bytes.resize(bytes.len() + 3 * 8192, 0);
    let mut decoder = WalDecoder::new(w.start).expect("page start");
    let (got, err) = decode_all(&mut decoder, &bytes, &[8192]);
    assert_eq!(got, records);
    let err = err.expect("zeros are not a record");
    assert!(err.is_end_of_wal(), "{err}");
    assert!(matches!(err, WalDecodeError::RecordLength { len: 0, .. }));
    // Asked again, the decoder repeats the error rather than going on.
    assert_eq!(decoder.next_record(), Err(err));

    // Zeros from a page start: a zeroed page header.
    let next_page = w.pos.next_multiple_of(8192);
    let mut decoder = WalDecoder::new(Lsn(next_page)).expect("page start");
    let (got, err) = decode_all(&mut decoder, &[0; 8192], &[100]);
    assert!(got.is_empty());
    assert!(matches!(err, Some(WalDecodeError::PageMagic { magic: 0, .. })));
    assert!(err.expect("zeros").is_end_of_wal());
    w.append(&mut big_record(1, 1));
}

#[test]
fn damage_is_reported_at_its_lsn() {
    let mut records: Vec<DecodedRecord> = (0..10).map(|i| big_record(3000, i)).collect();
    let w = written(&mut records);
    let decode = |bytes: &[u8]| {
        let mut decoder = WalDecoder::new(w.start).expect("page start");
        decode_all(&mut decoder, bytes, &[bytes.len()])
    };

    // A flipped payload byte: the CRC of that record, and every record before it intact.
    let mut bytes = w.bytes.clone();
    let victim = &records[4];
    bytes[(victim.lsn.0 - w.start.0) as usize + 100] ^= 0x40;
    let (got, err) = decode(&bytes);
    assert_eq!(got, records[..4].to_vec());
    assert!(matches!(err, Some(WalDecodeError::Crc { lsn, .. }) if lsn == victim.lsn), "{err:?}");

    // A page address from the future (not a recycled segment): not the end of WAL.
    let mut bytes = w.bytes.clone();
    bytes[8192 + 8 + 5] ^= 1;
    let (_, err) = decode(&bytes);
    let err = err.expect("pageaddr");
    assert!(matches!(err, WalDecodeError::PageAddr { lsn, .. } if lsn == Lsn(w.start.0 + 8192)), "{err}");
    assert!(!err.is_end_of_wal());

    // A continuation page without its flag, and with the wrong remaining length.
    let mut bytes = w.bytes.clone();
    bytes[8192 + 2] &= !(XLP_FIRST_IS_CONTRECORD as u8);
    let (_, err) = decode(&bytes);
    assert!(matches!(err, Some(WalDecodeError::MissingContrecord { .. })), "{err:?}");
    let mut bytes = w.bytes.clone();
    bytes[8192 + 16] ^= 1;
    let (_, err) = decode(&bytes);
    assert!(matches!(err, Some(WalDecodeError::ContrecordLength { .. })), "{err:?}");

    // A prev-link pointing elsewhere.
    let mut bytes = w.bytes.clone();
    let at = (records[2].lsn.0 - w.start.0) as usize + 8;
    bytes[at] ^= 8;
    let (got, err) = decode(&bytes);
    assert_eq!(got.len(), 2);
    assert!(matches!(err, Some(WalDecodeError::PrevLink { lsn, .. }) if lsn == records[2].lsn), "{err:?}");

    // A short header where a segment starts.
    let seg_end = u64::from(SEG) * 2;
    if w.pos > seg_end + 40 {
        let mut bytes = w.bytes.clone();
        bytes[(seg_end - w.start.0) as usize + 2] &= !(XLP_LONG_HEADER as u8);
        let (_, err) = decode(&bytes);
        assert!(err.is_some());
    }
}

#[test]
fn a_record_over_the_set_limit_fails_at_its_length_naming_lsn_length_and_limit() {
    const LIMIT: u32 = 64 << 10;
    // 24 bytes of header, the long main data id and its 4-byte length, then the data.
    let at_limit = big_record(LIMIT as usize - 29, 2);
    assert_eq!(crate::wal::testenc::encode_record(&at_limit, Lsn(0)).len(), LIMIT as usize);
    let mut records = vec![big_record(100, 1), at_limit, big_record(LIMIT as usize, 3), big_record(10, 4)];
    let w = written(&mut records);
    let over = &records[2];
    let over_len = LIMIT as usize + 29;
    assert_eq!(crate::wal::testenc::encode_record(over, Lsn(0)).len(), over_len);

    // Without a limit of its own the decoder takes all of them.
    let mut decoder = WalDecoder::with_segment_size(w.start, SEG).expect("page start");
    let (got, err) = decode_all(&mut decoder, &w.bytes, &[8192]);
    assert_eq!((got, err), (records.clone(), None));

    // With one, it fails once the record's length is in: fed only up to its first 8 bytes.
    let mut decoder = WalDecoder::with_segment_size(w.start, SEG).expect("page start").max_record_len(LIMIT);
    let upto = (over.lsn.0 + 8 - w.start.0) as usize;
    let (got, err) = decode_all(&mut decoder, &w.bytes[..upto], &[8192]);
    assert_eq!(got, records[..2].to_vec(), "records up to the limit pass");
    let err = err.expect("the record over the limit");
    assert_eq!(err, WalDecodeError::RecordTooLarge { lsn: over.lsn, len: over_len as u32, max: LIMIT });
    assert!(!err.is_end_of_wal());
    assert_eq!(err.lsn(), over.lsn);
    let text = err.to_string();
    for part in [over.lsn.to_string(), over_len.to_string(), LIMIT.to_string()] {
        assert!(text.contains(&part), "{text} names {part}");
    }
    // Failed for good: more WAL does not resume it.
    decoder.feed(&w.bytes[upto..]);
    assert_eq!(decoder.next_record(), Err(err));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_records_round_trip_in_random_chunks(
        mut records in proptest::collection::vec(arb_record(), 1..30),
        start_page in 120u64..128,
        chunks in proptest::collection::vec(1usize..20000, 1..8),
    ) {
        // Start a few pages before a segment boundary so that records cross it.
        let mut w = WalWriter::new(start_page * 8192, SEG);
        for rec in &mut records {
            w.append(rec);
        }
        let mut decoder = WalDecoder::new(w.start).expect("page start");
        let (got, err) = decode_all(&mut decoder, &w.bytes, &chunks);
        prop_assert_eq!(err, None);
        prop_assert_eq!(got, records);
    }

    #[test]
    fn truncated_wal_gives_a_prefix_of_its_records_and_no_error(
        mut records in proptest::collection::vec(arb_record(), 1..12),
        cut in any::<proptest::sample::Index>(),
        chunks in proptest::collection::vec(1usize..5000, 1..4),
    ) {
        let mut w = WalWriter::new(u64::from(SEG) - 8192, SEG);
        for rec in &mut records {
            w.append(rec);
        }
        let len = cut.index(w.bytes.len() + 1);
        let mut decoder = WalDecoder::new(w.start).expect("page start");
        let (got, err) = decode_all(&mut decoder, &w.bytes[..len], &chunks);
        prop_assert_eq!(err, None);
        let end = w.start.0 + len as u64;
        let expected: Vec<_> = records.iter().filter(|r| r.end_lsn.0 <= end).cloned().collect();
        prop_assert_eq!(got, expected);
    }

    #[test]
    fn damaged_wal_never_panics_and_keeps_the_records_before_the_damage(
        mut records in proptest::collection::vec(arb_record(), 1..8),
        flips in proptest::collection::vec((any::<proptest::sample::Index>(), 1u8..=255), 1..4),
        chunks in proptest::collection::vec(1usize..3000, 1..4),
    ) {
        let mut w = WalWriter::new(u64::from(SEG) - 2 * 8192, SEG);
        for rec in &mut records {
            w.append(rec);
        }
        let mut bytes = w.bytes.clone();
        let mut first = usize::MAX;
        for (at, x) in &flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x;
            first = first.min(i);
        }
        let mut decoder = WalDecoder::new(w.start).expect("page start");
        let (got, _err) = decode_all(&mut decoder, &bytes, &chunks);
        let damaged_at = w.start.0 + first as u64;
        let intact: Vec<_> = records.iter().filter(|r| r.end_lsn.0 <= damaged_at).cloned().collect();
        prop_assert!(got.len() >= intact.len(), "{} records decoded, {} intact", got.len(), intact.len());
        prop_assert_eq!(&got[..intact.len()], &intact[..]);
    }

    #[test]
    fn random_bytes_never_panic_or_loop(
        bytes in proptest::collection::vec(any::<u8>(), 0..20000),
        start in prop_oneof![Just(0u64), Just(8192u64), (3u64..1024).prop_map(|i| i * 8), any::<u64>()],
        chunks in proptest::collection::vec(1usize..5000, 1..4),
    ) {
        if let Ok(mut decoder) = WalDecoder::new(Lsn(start)) {
            let _ = decode_all(&mut decoder, &bytes, &chunks);
        }
    }

    #[test]
    fn random_bytes_behind_a_valid_page_header_never_panic(
        body in proptest::collection::vec(any::<u8>(), 0..30000),
        chunks in proptest::collection::vec(1usize..5000, 1..4),
    ) {
        let mut w = WalWriter::new(u64::from(SEG), SEG);
        let mut rec = plain_record(1, 0, vec![1; 10]);
        w.append(&mut rec);
        let mut bytes = w.bytes.clone();
        bytes.extend_from_slice(&body);
        let mut decoder = WalDecoder::new(w.start).expect("page start");
        let (got, _) = decode_all(&mut decoder, &bytes, &chunks);
        prop_assert!(!got.is_empty());
    }
}
