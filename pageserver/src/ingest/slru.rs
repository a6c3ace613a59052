//! The commit log (`pg_xact`) from the WAL, as values of its SLRU pages
//! (`keys::slru_page_key(SlruKind::Clog, ..)`), as PostgreSQL 15's redo changes the files
//! (`clog.c`'s `clog_redo`, `xact_redo`'s `TransactionIdSetTreeStatus`):
//!
//! - a transaction's commit or abort, prepared or not ([`XactEnd`]): for each CLOG page its
//!   transaction and subtransactions are on, one `pg15` [`ClogSet`] value (committed or
//!   aborted, the offsets of that page's xids), which the redo child applies to the page; a
//!   page with no value yet is built from zeros (see `walredo_proc::pg15::slru`);
//! - `CLOG_ZEROPAGE` (`int pageno`): an image of zeros;
//! - `CLOG_TRUNCATE` (`xl_clog_truncate { int pageno; oldestXact; oldestXactDb }`): PostgreSQL
//!   removes every segment file before the cutoff page's segment; here each such segment gets a
//!   drop marker (`keys::slru_segment_drop_key`, an empty image), from the segment of the
//!   oldest xid the counters held before the record up to the cutoff's, modulo the 4096
//!   segments of the CLOG's xid space. PostgreSQL truncates up to the oldest xid's segment
//!   every time it moves the oldest xid (`vac_truncate_clog`), so no older segment exists; a
//!   range past half the space (the counters and the record disagree) drops nothing.
//!
//! All at the record's end LSN, one value per key and record.
//!
//! Invariant: pure; nothing panics on any record.

use bytes::Bytes;
use page_types::keys::{self, SlruKind, SLRU_PAGES_PER_SEGMENT};
use page_types::wal::rmgr::RM_CLOG_ID;
use page_types::wal::DecodedRecord;
use page_types::{BufferTag, Lsn, PAGE_SIZE};
use walredo_proc::pg15::slru::{ClogSet, CLOG_ABORTED, CLOG_COMMITTED, CLOG_XACTS_PER_PAGE};

use super::xact::XactEnd;
use crate::storage::Value;

/// `clog_redo`'s operations (`xl_info & 0xF0`).
const CLOG_ZEROPAGE: u8 = 0x00;
const CLOG_TRUNCATE: u8 = 0x10;
/// CLOG segments in the xid space (2^32 xids, 32768 a page, 32 pages a segment).
const CLOG_SEGMENTS: u32 =
    (1u64 << 32).div_ceil(CLOG_XACTS_PER_PAGE as u64 * SLRU_PAGES_PER_SEGMENT as u64) as u32;

/// The CLOG page of `xid`: (segment, page in the segment, offset in the page).
pub fn clog_place(xid: u32) -> (u32, u32, u16) {
    let page = xid / CLOG_XACTS_PER_PAGE;
    (page / SLRU_PAGES_PER_SEGMENT, page % SLRU_PAGES_PER_SEGMENT, (xid % CLOG_XACTS_PER_PAGE) as u16)
}

fn clog_key_of_page(pageno: u32) -> BufferTag {
    keys::slru_page_key(SlruKind::Clog, pageno / SLRU_PAGES_PER_SEGMENT, pageno % SLRU_PAGES_PER_SEGMENT)
}

/// Appends the CLOG values of `record` (`xact`: the transaction it ends, if any);
/// `oldest_xid`: the counters' oldest xid before the record. An error says what of the record
/// is missing or does not encode.
pub fn clog_values(
    record: &DecodedRecord,
    xact: Option<&XactEnd>,
    oldest_xid: u32,
    out: &mut Vec<(BufferTag, Lsn, Value)>,
) -> Result<(), String> {
    let lsn = record.end_lsn;
    if let Some(end) = xact {
        let status = if end.committed { CLOG_COMMITTED } else { CLOG_ABORTED };
        // (segment, page) -> offsets, in the order the pages first appear.
        let mut pages: Vec<((u32, u32), Vec<u16>)> = Vec::new();
        for xid in std::iter::once(end.xid).chain(end.subxacts.iter().copied()) {
            // Invalid, bootstrap and frozen xids have no status to set.
            if xid < 3 {
                continue;
            }
            let (segno, page, offset) = clog_place(xid);
            match pages.iter_mut().find(|(p, _)| *p == (segno, page)) {
                Some((_, offsets)) => offsets.push(offset),
                None => pages.push(((segno, page), vec![offset])),
            }
        }
        for ((segno, page), mut offsets) in pages {
            offsets.sort_unstable();
            offsets.dedup();
            let set = ClogSet {
                rmid: record.rmid,
                info: record.info,
                lsn: record.lsn.0,
                end_lsn: record.end_lsn.0,
                status,
                offsets,
            };
            let mut bytes = Vec::new();
            set.encode(&mut bytes).map_err(|e| e.to_string())?;
            out.push((
                keys::slru_page_key(SlruKind::Clog, segno, page),
                lsn,
                Value::Record(Bytes::from(bytes)),
            ));
        }
        return Ok(());
    }
    if record.rmid != RM_CLOG_ID {
        return Ok(());
    }
    let word = |at: usize| {
        record
            .main_data
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or("a CLOG record shorter than its fields")
    };
    match record.info & 0xF0 {
        CLOG_ZEROPAGE => {
            let pageno = word(0)?;
            out.push((clog_key_of_page(pageno), lsn, Value::Image(Bytes::from_static(&[0; PAGE_SIZE]))));
        }
        CLOG_TRUNCATE => {
            let (pageno, _oldest_xact) = (word(0)?, word(4)?);
            let cutoff = (pageno / SLRU_PAGES_PER_SEGMENT) % CLOG_SEGMENTS;
            let first = clog_place(oldest_xid).0 % CLOG_SEGMENTS;
            let count = (cutoff + CLOG_SEGMENTS - first) % CLOG_SEGMENTS;
            if count <= CLOG_SEGMENTS / 2 {
                for i in 0..count {
                    let segno = (first + i) % CLOG_SEGMENTS;
                    out.push((
                        keys::slru_segment_drop_key(SlruKind::Clog, segno),
                        lsn,
                        Value::Image(Bytes::new()),
                    ));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::ingest::xact::tests::xact_record;

    fn sets(out: &[(BufferTag, Lsn, Value)]) -> Vec<(BufferTag, ClogSet)> {
        out.iter()
            .map(|(k, lsn, v)| {
                let Value::Record(bytes) = v else { panic!("a record") };
                let set = ClogSet::decode(bytes).unwrap();
                assert_eq!((lsn.0, set.end_lsn), (0x1_0000_0068, 0x1_0000_0068));
                (*k, set)
            })
            .collect()
    }

    fn clog(info: u8, words: &[u32]) -> DecodedRecord {
        let mut rec = xact_record(info, 0, words.iter().flat_map(|w| w.to_le_bytes()).collect());
        rec.rmid = RM_CLOG_ID;
        rec
    }

    #[test]
    fn a_transaction_gets_one_value_per_clog_page_it_is_on() {
        // 32767 is the last xid of page 0; 32768 the first of page 1; 32 * 32768 the first of
        // segment 1.
        let end = XactEnd {
            committed: true,
            xid: 32_767,
            subxacts: vec![5, 32_768, 1 << 20, 6, 5],
            dropped: vec![],
        };
        let mut out = Vec::new();
        clog_values(&xact_record(0x00, 32_767, vec![0; 8]), Some(&end), 3, &mut out).unwrap();
        let got = sets(&out);
        let keys: Vec<BufferTag> = got.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            vec![
                keys::slru_page_key(SlruKind::Clog, 0, 0),
                keys::slru_page_key(SlruKind::Clog, 0, 1),
                keys::slru_page_key(SlruKind::Clog, 1, 0),
            ]
        );
        assert_eq!(got[0].1.offsets, vec![5, 6, 32_767]);
        assert_eq!(got[1].1.offsets, vec![0]);
        assert_eq!(got[2].1.offsets, vec![0]);
        assert!(got.iter().all(|(_, s)| s.status == CLOG_COMMITTED));
        // An abort: aborted; special xids are left out.
        let end = XactEnd { committed: false, xid: 2, subxacts: vec![9], dropped: vec![] };
        let mut out = Vec::new();
        clog_values(&xact_record(0x20, 2, vec![0; 8]), Some(&end), 3, &mut out).unwrap();
        let got = sets(&out);
        assert_eq!((got.len(), got[0].1.status, got[0].1.offsets.clone()), (1, CLOG_ABORTED, vec![9]));
        // Thousands of subtransactions on one page: one value, within a record's bound.
        let end = XactEnd { committed: true, xid: 100, subxacts: (101..30_000).collect(), dropped: vec![] };
        let mut out = Vec::new();
        clog_values(&xact_record(0x00, 100, vec![0; 8]), Some(&end), 3, &mut out).unwrap();
        assert_eq!(sets(&out)[0].1.offsets.len(), 29_900);
    }

    #[test]
    fn zeropage_is_a_zero_image_and_truncate_drops_the_segments_before_the_cutoff() {
        let mut out = Vec::new();
        clog_values(&clog(0x00, &[33]), None, 3, &mut out).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, keys::slru_page_key(SlruKind::Clog, 1, 1));
        assert!(matches!(&out[0].2, Value::Image(b) if b.len() == PAGE_SIZE && b.iter().all(|&x| x == 0)));
        // Oldest xid in segment 2 (2 * 2^20), cutoff page 5 * 32 + 7: segments 2, 3, 4.
        let mut out = Vec::new();
        clog_values(&clog(0x10, &[5 * 32 + 7, 5 << 20, 1]), None, (2 << 20) + 17, &mut out).unwrap();
        let dropped: Vec<BufferTag> = out.iter().map(|(k, _, _)| *k).collect();
        assert_eq!(
            dropped,
            (2..5).map(|s| keys::slru_segment_drop_key(SlruKind::Clog, s)).collect::<Vec<_>>()
        );
        assert!(out.iter().all(|(_, _, v)| matches!(v, Value::Image(b) if b.is_empty())));
        // Across the wraparound: from segment 4094 to segment 1.
        let mut out = Vec::new();
        clog_values(&clog(0x10, &[32 + 3, 1 << 20, 1]), None, 4094 << 20, &mut out).unwrap();
        let segs: Vec<u32> = out.iter().map(|(k, _, _)| k.relnode).collect();
        assert_eq!(segs, vec![4094, 4095, 0]);
        // The cutoff in the oldest xid's own segment, or behind it: nothing.
        for oldest in [5 << 20, 100 << 20] {
            let mut out = Vec::new();
            clog_values(&clog(0x10, &[5 * 32, 5 << 20, 1]), None, oldest, &mut out).unwrap();
            assert!(out.is_empty(), "oldest {oldest}: {out:?}");
        }
        // Short records are errors; other records give nothing.
        assert!(clog_values(&clog(0x10, &[1]), None, 3, &mut Vec::new()).is_err());
        assert!(clog_values(&clog(0x00, &[]), None, 3, &mut Vec::new()).is_err());
        let mut out = Vec::new();
        clog_values(&xact_record(0x10, 9, vec![0; 8]), None, 3, &mut out).unwrap();
        assert!(out.is_empty());
    }
}
