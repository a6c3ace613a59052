//! Tests of record decoding and page restore: round trips through the test encoder, the
//! CRC, PostgreSQL's consistency checks on block headers, and arbitrary bytes.

use bytes::Bytes;
use proptest::prelude::*;

use super::*;
use crate::wal::testenc::{arb_record, encode_record, make_image, plain_record, runs_page};

fn decode_at(lsn: u64, bytes: Vec<u8>) -> Result<DecodedRecord, WalDecodeError> {
    let end = Lsn(lsn + bytes.len() as u64);
    decode_record(Lsn(lsn), end, Bytes::from(bytes))
}

/// A record of `body` (what follows the header) with a correct length and CRC.
fn record_with_body(rmid: u8, body: &[u8]) -> Vec<u8> {
    let header = XLogRecordHeader {
        tot_len: (XLOG_RECORD_HEADER_LEN + body.len()) as u32,
        xid: 1,
        prev: Lsn(0x100),
        info: 0,
        rmid,
        crc: 0,
    };
    let mut out = Vec::new();
    header.encode(&mut out);
    out.extend_from_slice(body);
    let crc = record_crc(&out).expect("whole header");
    out[XL_CRC_OFFSET..XLOG_RECORD_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
    out
}

fn block_header(id: u8, fork_flags: u8, data_len: u16) -> Vec<u8> {
    let mut b = vec![id, fork_flags];
    b.extend_from_slice(&data_len.to_le_bytes());
    b
}

const REL: [u8; 12] = [0x7f, 6, 0, 0, 5, 0, 0, 0, 0, 0x40, 0, 0];

#[test]
fn record_with_blocks_same_rel_and_main_data_decodes_its_fields() {
    let mut body = Vec::new();
    body.extend(block_header(0, BKPBLOCK_HAS_DATA | 1, 3));
    body.extend_from_slice(&REL);
    body.extend_from_slice(&7u32.to_le_bytes());
    body.extend(block_header(2, BKPBLOCK_SAME_REL | BKPBLOCK_WILL_INIT, 0));
    body.extend_from_slice(&9u32.to_le_bytes());
    body.extend_from_slice(&[XLR_BLOCK_ID_ORIGIN, 4, 0, XLR_BLOCK_ID_TOPLEVEL_XID, 8, 0, 0, 0]);
    body.extend_from_slice(&[XLR_BLOCK_ID_DATA_SHORT, 2]);
    body.extend_from_slice(b"abc");
    body.extend_from_slice(b"zz");
    let rec = decode_at(0x1000, record_with_body(10, &body)).expect("valid record");
    assert_eq!(rec.rmgr_name(), "Heap");
    assert_eq!(rec.len(), (24 + body.len()) as u64);
    let rel = RelFileNode { spcnode: 1663, dbnode: 5, relnode: 16384 };
    assert_eq!(rec.blocks.len(), 2);
    assert_eq!((rec.blocks[0].rel, rec.blocks[0].fork, rec.blocks[0].blkno), (rel, 1, 7));
    assert_eq!(&rec.blocks[0].data[..], b"abc");
    assert_eq!((rec.blocks[1].id, rec.blocks[1].rel, rec.blocks[1].blkno), (2, rel, 9));
    assert!(rec.blocks[1].will_init && !rec.blocks[1].has_data);
    assert_eq!((rec.origin, rec.toplevel_xid), (Some(4), Some(8)));
    assert_eq!(&rec.main_data[..], b"zz");
}

#[test]
fn record_with_a_flipped_byte_fails_its_crc() {
    let mut bytes = encode_record(&plain_record(1, 0, b"commit".to_vec()), Lsn(8));
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    let err = decode_at(0x2000, bytes).expect_err("crc");
    assert!(matches!(err, WalDecodeError::Crc { lsn: Lsn(0x2000), .. }), "{err}");
    assert!(err.to_string().contains("0/2000"), "the error names the LSN: {err}");
}

#[test]
fn record_block_headers_that_break_postgres_checks_are_malformed() {
    let blk = |id: u8, flags: u8, len: u16, same_rel: bool| {
        let mut b = block_header(id, flags, len);
        if !same_rel {
            b.extend_from_slice(&REL);
        }
        b.extend_from_slice(&1u32.to_le_bytes());
        b
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("HAS_DATA with no data", blk(0, BKPBLOCK_HAS_DATA, 0, false)),
        ("data without HAS_DATA", [blk(0, 0, 2, false), vec![1, 2]].concat()),
        ("out-of-order ids", [blk(3, 0, 0, false), blk(3, 0, 0, false)].concat()),
        ("decreasing ids", [blk(3, 0, 0, false), blk(1, 0, 0, false)].concat()),
        ("SAME_REL first", blk(0, BKPBLOCK_SAME_REL, 0, true)),
        ("block id 33", blk(33, 0, 0, false)),
        ("lengths short", [blk(0, BKPBLOCK_HAS_DATA, 5, false), vec![1, 2]].concat()),
        ("lengths long", [blk(0, BKPBLOCK_HAS_DATA, 1, false), vec![1, 2]].concat()),
        ("truncated block header", vec![0, 0]),
        ("main data longer than the record", vec![XLR_BLOCK_ID_DATA_LONG, 0xff, 0xff, 0xff, 0xff, 1]),
        ("bytes after the main data", vec![XLR_BLOCK_ID_DATA_SHORT, 1, 1, 2]),
    ];
    for (what, body) in cases {
        let err = decode_at(0x3000, record_with_body(10, &body)).expect_err(what);
        assert!(matches!(err, WalDecodeError::Malformed { lsn: Lsn(0x3000), .. }), "{what}: {err}");
    }
}

#[test]
fn image_headers_that_break_postgres_checks_are_malformed() {
    let img = |bimg_len: u16, hole_offset: u16, info: u8, hole_length: Option<u16>| {
        let mut b = block_header(0, BKPBLOCK_HAS_IMAGE, 0);
        b.extend_from_slice(&bimg_len.to_le_bytes());
        b.extend_from_slice(&hole_offset.to_le_bytes());
        b.push(info);
        if let Some(h) = hole_length {
            b.extend_from_slice(&h.to_le_bytes());
        }
        b.extend_from_slice(&REL);
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend(std::iter::repeat_n(0u8, usize::from(bimg_len)));
        b
    };
    let cases = vec![
        ("hole flag, offset 0", img(8000, 0, BKPIMAGE_HAS_HOLE, None)),
        ("hole flag, full length", img(8192, 10, BKPIMAGE_HAS_HOLE, None)),
        ("no hole flag, hole offset", img(8192, 10, 0, None)),
        ("not compressed, short", img(8000, 0, 0, None)),
        ("compressed, full length", img(8192, 0, BKPIMAGE_COMPRESS_PGLZ, None)),
        ("hole past the page", img(8000, 8100, BKPIMAGE_HAS_HOLE, None)),
        (
            "compressed hole past the page",
            img(100, 8000, BKPIMAGE_HAS_HOLE | BKPIMAGE_COMPRESS_PGLZ, Some(500)),
        ),
    ];
    for (what, body) in cases {
        let err = decode_at(0x3000, record_with_body(10, &body)).expect_err(what);
        assert!(matches!(err, WalDecodeError::Malformed { .. }), "{what}: {err}");
    }
    let ok =
        decode_at(0x3000, record_with_body(10, &img(8000, 100, BKPIMAGE_HAS_HOLE | BKPIMAGE_APPLY, None)));
    let image = ok.expect("valid image").blocks[0].image.clone().expect("has image");
    assert_eq!((image.hole_offset, image.hole_length, image.apply), (100, 192, true));
}

#[test]
fn record_header_with_bad_length_or_rmgr_is_rejected() {
    let mut bytes = encode_record(&plain_record(22, 0, Vec::new()), Lsn(0));
    assert!(matches!(decode_at(0x10, bytes.clone()), Err(WalDecodeError::Rmgr { rmid: 22, .. })));
    bytes[17] = 10;
    bytes[0] = 25;
    assert!(decode_at(0x10, bytes).is_err(), "xl_tot_len disagrees with the bytes");
    assert!(matches!(decode_at(0x10, vec![0; 10]), Err(WalDecodeError::RecordLength { .. })));
}

#[test]
fn image_compressed_with_lz4_or_zstd_names_wal_compression() {
    for compression in [ImageCompression::Lz4, ImageCompression::Zstd] {
        let image = BlockImage {
            bytes: Bytes::from_static(b"x"),
            hole_offset: 0,
            hole_length: 0,
            compression,
            apply: true,
        };
        let err = image.restore_page().expect_err("unsupported");
        assert!(err.to_string().contains("wal_compression"), "{err}");
    }
}

#[test]
fn image_restore_fills_the_hole_with_zeros() {
    let mut page = runs_page(3);
    let image = make_image(&mut page, 100, 1000, false, true);
    assert_eq!(image.bytes.len(), 8192 - 1000);
    assert_eq!(image.restore_page().expect("restores"), page);
    assert!(page[100..1100].iter().all(|&b| b == 0));
    let mut page = runs_page(4);
    let image = make_image(&mut page, 0, 0, true, false);
    assert_eq!(image.compression, ImageCompression::Pglz);
    assert_eq!(image.restore_page().expect("restores"), page);
    let broken = BlockImage { bytes: image.bytes.slice(..image.bytes.len() - 1), ..image };
    assert!(matches!(broken.restore_page(), Err(ImageError::Pglz(_))));
}

proptest! {
    #[test]
    fn encoded_records_decode_back_equal(mut rec in arb_record(), lsn in (1u64..1 << 40).prop_map(|l| l * 8)) {
        let bytes = encode_record(&rec, Lsn(lsn - 8));
        rec.lsn = Lsn(lsn);
        rec.end_lsn = Lsn(lsn + bytes.len() as u64);
        rec.prev = Lsn(lsn - 8);
        let decoded = decode_record(rec.lsn, rec.end_lsn, Bytes::from(bytes));
        prop_assert_eq!(decoded, Ok(rec));
    }

    #[test]
    fn images_restore_to_their_page(seed in any::<u8>(), hole_offset in 0u16..8192, hole_length in 0u16..8192, pglz in any::<bool>()) {
        let mut page = runs_page(seed);
        let image = make_image(&mut page, hole_offset, hole_length, pglz, true);
        prop_assert_eq!(image.restore_page(), Ok(page));
    }

    #[test]
    fn decode_never_panics_on_bytes_with_a_valid_crc(rmid in 0u8..22, body in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = decode_at(0x5000, record_with_body(rmid, &body));
    }

    #[test]
    fn decode_never_panics_on_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode_at(0x5000, bytes);
    }
}
