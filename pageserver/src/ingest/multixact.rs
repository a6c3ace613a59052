//! The MultiXact SLRUs (`pg_multixact/offsets`, `pg_multixact/members`) from the WAL, as values
//! of their pages, as PostgreSQL 15's `multixact_redo` changes the files:
//!
//! - `CREATE_ID` (`xl_multixact_create { mid; moff; int nmembers; members[] { xid; status } }`):
//!   `RecordNewMultiXact` writes `moff` at entry `mid % 2048` of offsets page `mid / 2048`, and
//!   the next multixact's offset, `moff + nmembers` (1 where that is 0), at the entry of `mid +
//!   1` (1 where that is 0), as PostgreSQL 15's minor releases since the fix of the
//!   multixact-members race do (a primary of an older release writes it with the next
//!   multixact's own record: the same bytes); and for member `i` at offset `o = moff + i`
//!   (modulo 2^32) its xid and its status byte on members page `o / 1636`, in its group of 4
//!   (`(o / 4) % 409`, 20 bytes: 4 status bytes, then 4 xids); one `pg15` [`SlruWrite`] value
//!   per page touched, which the redo child copies in;
//! - `ZERO_OFF_PAGE`, `ZERO_MEM_PAGE` (`int pageno`): an image of zeros;
//! - `TRUNCATE_ID` (`{ oldestMultiDB; startTruncOff; endTruncOff; startTruncMemb; endTruncMemb }`):
//!   the members segments from `startTruncMemb`'s up to `endTruncMemb`'s, wrapping after the
//!   last (`PerformMembersTruncation`), and the offsets segments before the one of the multixact
//!   before `endTruncOff` from `startTruncOff`'s on (`PerformOffsetsTruncation`: PostgreSQL
//!   keeps none older, as for the CLOG), each a drop marker (`keys::slru_segment_drop_key`).
//!
//! The counters these records move (next multixact and offset, oldest multixact) are
//! `super::counters`'; it reads the records with [`create`] and [`truncate`].
//!
//! Invariant: pure; nothing panics on any record (every count is checked against the bytes).

use bytes::Bytes;
use page_types::keys::{self, SlruKind, SLRU_PAGES_PER_SEGMENT};
use page_types::wal::rmgr::RM_MULTIXACT_ID;
use page_types::wal::DecodedRecord;
use page_types::{BufferTag, Lsn, PAGE_SIZE};
use walredo_proc::pg15::slru::SlruWrite;

use crate::storage::Value;

/// `multixact_redo`'s operations (`xl_info & 0xF0`).
const ZERO_OFF_PAGE: u8 = 0x00;
const ZERO_MEM_PAGE: u8 = 0x10;
const CREATE_ID: u8 = 0x20;
const TRUNCATE_ID: u8 = 0x30;
/// `MULTIXACT_OFFSETS_PER_PAGE`: a 4-byte offset per multixact.
const OFFSETS_PER_PAGE: u32 = PAGE_SIZE as u32 / 4;
/// Members in a group (`MULTIXACT_MEMBERS_PER_MEMBERGROUP`), a group's bytes (4 status bytes
/// and 4 xids), groups per page, members per page.
const MEMBERS_PER_GROUP: u32 = 4;
const GROUP_SIZE: u32 = 20;
const GROUPS_PER_PAGE: u32 = PAGE_SIZE as u32 / GROUP_SIZE;
const MEMBERS_PER_PAGE: u32 = GROUPS_PER_PAGE * MEMBERS_PER_GROUP;
/// Offsets segments in the multixact id space (2^32 ids, 2048 a page, 32 pages a segment).
const OFFSETS_SEGMENTS: u32 =
    (1u64 << 32).div_ceil(OFFSETS_PER_PAGE as u64 * SLRU_PAGES_PER_SEGMENT as u64) as u32;
/// The last members segment (`MXOffsetToMemberSegment(MaxMultiXactOffset)`).
const LAST_MEMBERS_SEGMENT: u32 = u32::MAX / MEMBERS_PER_PAGE / SLRU_PAGES_PER_SEGMENT;

/// A `CREATE_ID` record: the multixact, its first member's offset, its members (xid, status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Create {
    pub multi: u32,
    pub offset: u32,
    pub members: Vec<(u32, u32)>,
}

/// A `TRUNCATE_ID` record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncate {
    pub oldest_multi_db: u32,
    pub start_multi: u32,
    pub end_multi: u32,
    pub start_member: u32,
    pub end_member: u32,
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let b = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// The multixact `record` creates, if it is a `CREATE_ID`.
pub fn create(record: &DecodedRecord) -> Option<Result<Create, &'static str>> {
    if record.rmid != RM_MULTIXACT_ID || record.info & 0xF0 != CREATE_ID {
        return None;
    }
    let data = &record.main_data;
    let parse = || {
        let short = "a MultiXact CREATE_ID shorter than its members";
        let (multi, offset, n) =
            (u32_at(data, 0).ok_or(short)?, u32_at(data, 4).ok_or(short)?, u32_at(data, 8).ok_or(short)?);
        let n =
            usize::try_from(n as i32).map_err(|_| "a MultiXact CREATE_ID with a negative member count")?;
        if n.checked_mul(8).and_then(|b| b.checked_add(12)).is_none_or(|end| end > data.len()) {
            return Err(short);
        }
        let members =
            (0..n).filter_map(|i| Some((u32_at(data, 12 + 8 * i)?, u32_at(data, 16 + 8 * i)?))).collect();
        Ok(Create { multi, offset, members })
    };
    Some(parse())
}

/// The truncation `record` makes, if it is a `TRUNCATE_ID`.
pub fn truncate(record: &DecodedRecord) -> Option<Result<Truncate, &'static str>> {
    if record.rmid != RM_MULTIXACT_ID || record.info & 0xF0 != TRUNCATE_ID {
        return None;
    }
    let word =
        |i: usize| u32_at(&record.main_data, 4 * i).ok_or("a MultiXact TRUNCATE_ID shorter than 20 bytes");
    let parse = || {
        Ok(Truncate {
            oldest_multi_db: word(0)?,
            start_multi: word(1)?,
            end_multi: word(2)?,
            start_member: word(3)?,
            end_member: word(4)?,
        })
    };
    Some(parse())
}

fn page_key(kind: SlruKind, pageno: u32) -> BufferTag {
    keys::slru_page_key(kind, pageno / SLRU_PAGES_PER_SEGMENT, pageno % SLRU_PAGES_PER_SEGMENT)
}

/// Appends the MultiXact values of `record`; an error says what of it is missing or does not
/// encode.
pub fn multixact_values(
    record: &DecodedRecord,
    out: &mut Vec<(BufferTag, Lsn, Value)>,
) -> Result<(), String> {
    if record.rmid != RM_MULTIXACT_ID {
        return Ok(());
    }
    let lsn = record.end_lsn;
    let write = |kind: SlruKind, pageno: u32, bytes: Vec<(u16, u8)>, out: &mut Vec<_>| {
        let value = SlruWrite::from_bytes(record.rmid, record.info, record.lsn.0, lsn.0, bytes);
        let mut encoded = Vec::new();
        value.encode(&mut encoded).map_err(|e| e.to_string())?;
        out.push((page_key(kind, pageno), lsn, Value::Record(Bytes::from(encoded))));
        Ok::<(), String>(())
    };
    match record.info & 0xF0 {
        op @ (ZERO_OFF_PAGE | ZERO_MEM_PAGE) => {
            let pageno =
                u32_at(&record.main_data, 0).ok_or("a MultiXact zero-page record without its page")?;
            let kind =
                if op == ZERO_OFF_PAGE { SlruKind::MultiXactOffsets } else { SlruKind::MultiXactMembers };
            out.push((page_key(kind, pageno), lsn, Value::Image(Bytes::from_static(&[0; PAGE_SIZE]))));
        }
        CREATE_ID => {
            let Some(Ok(c)) = create(record) else {
                return Err("a MultiXact CREATE_ID shorter than its members".into());
            };
            // This multixact's offset, and the next one's (multixact 0 and offset 0 are
            // skipped), on one offsets page or two.
            let next_multi = c.multi.wrapping_add(1).max(1);
            let next_offset = c.offset.wrapping_add(c.members.len() as u32).max(1);
            let entry = |multi: u32, offset: u32| {
                let at = (multi % OFFSETS_PER_PAGE * 4) as u16;
                (0..4u16).map(move |i| (at + i, offset.to_le_bytes()[usize::from(i)]))
            };
            let (page, next_page) = (c.multi / OFFSETS_PER_PAGE, next_multi / OFFSETS_PER_PAGE);
            if page == next_page {
                let both = entry(c.multi, c.offset).chain(entry(next_multi, next_offset));
                write(SlruKind::MultiXactOffsets, page, both.collect(), out)?;
            } else {
                write(SlruKind::MultiXactOffsets, page, entry(c.multi, c.offset).collect(), out)?;
                write(SlruKind::MultiXactOffsets, next_page, entry(next_multi, next_offset).collect(), out)?;
            }
            // Page -> (byte, value), pages in the order the members reach them.
            let mut pages: Vec<(u32, std::collections::BTreeMap<u16, u8>)> = Vec::new();
            for (i, &(xid, status)) in c.members.iter().enumerate() {
                let o = c.offset.wrapping_add(i as u32);
                let status =
                    u8::try_from(status).map_err(|_| format!("a MultiXact member status {status}"))?;
                let group = (o / MEMBERS_PER_GROUP % GROUPS_PER_PAGE * GROUP_SIZE) as u16;
                let slot = (o % MEMBERS_PER_GROUP) as u16;
                let page = o / MEMBERS_PER_PAGE;
                let bytes = match pages.iter_mut().find(|(p, _)| *p == page) {
                    Some((_, bytes)) => bytes,
                    None => {
                        pages.push((page, Default::default()));
                        &mut pages.last_mut().expect("just pushed").1
                    }
                };
                bytes.insert(group + slot, status);
                for (k, b) in xid.to_le_bytes().into_iter().enumerate() {
                    bytes.insert(group + 4 + slot * 4 + k as u16, b);
                }
            }
            for (page, bytes) in pages {
                write(SlruKind::MultiXactMembers, page, bytes.into_iter().collect(), out)?;
            }
        }
        TRUNCATE_ID => {
            let Some(Ok(t)) = truncate(record) else {
                return Err("a MultiXact TRUNCATE_ID shorter than 20 bytes".into());
            };
            let drop =
                |kind, segno| (keys::slru_segment_drop_key(kind, segno), lsn, Value::Image(Bytes::new()));
            let mut segno = t.start_member / MEMBERS_PER_PAGE / SLRU_PAGES_PER_SEGMENT;
            let end = t.end_member / MEMBERS_PER_PAGE / SLRU_PAGES_PER_SEGMENT;
            while segno != end {
                out.push(drop(SlruKind::MultiXactMembers, segno));
                segno = if segno == LAST_MEMBERS_SEGMENT { 0 } else { segno + 1 };
            }
            // `PreviousMultiXactId`: multixact 0 is invalid, so before 1 comes the last.
            let before_end = if t.end_multi <= 1 { u32::MAX } else { t.end_multi - 1 };
            let cutoff = before_end / OFFSETS_PER_PAGE / SLRU_PAGES_PER_SEGMENT;
            let first = t.start_multi / OFFSETS_PER_PAGE / SLRU_PAGES_PER_SEGMENT;
            let count = (cutoff + OFFSETS_SEGMENTS - first) % OFFSETS_SEGMENTS;
            if count <= OFFSETS_SEGMENTS / 2 {
                out.extend(
                    (0..count).map(|i| drop(SlruKind::MultiXactOffsets, (first + i) % OFFSETS_SEGMENTS)),
                );
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
    use walredo_proc::pg15::redo;

    fn multixact(info: u8, words: &[u32]) -> DecodedRecord {
        let mut rec = xact_record(info, 0, words.iter().flat_map(|w| w.to_le_bytes()).collect());
        rec.rmid = RM_MULTIXACT_ID;
        rec
    }

    /// The pages `out`'s writes make from zero pages, by key.
    fn pages(out: &[(BufferTag, Lsn, Value)]) -> Vec<(BufferTag, Box<[u8; PAGE_SIZE]>)> {
        out.iter()
            .map(|(key, lsn, value)| {
                assert_eq!(lsn.0, 0x1_0000_0068);
                let Value::Record(bytes) = value else { panic!("a record") };
                let mut page = Box::new([0u8; PAGE_SIZE]);
                redo::apply(bytes, &mut page).unwrap().unwrap();
                (*key, page)
            })
            .collect()
    }

    #[test]
    fn create_writes_the_offset_and_each_member_where_postgres_does() {
        // Multixact 2049 (offsets page 1, entry 1; the next, 2050, entry 2) with members at
        // offsets 1634..1638: the last two members of members page 0 (group 408, slots 2 and
        // 3), then page 1's first three (group 0, slots 0 to 2).
        let members: Vec<u32> = (0..5).flat_map(|i| [1000 + i, i % 6]).collect();
        let rec = multixact(0x20, &[[2049, 1634, 5].as_slice(), &members].concat());
        let c = create(&rec).unwrap().unwrap();
        assert_eq!((c.multi, c.offset, c.members.len(), c.members[4]), (2049, 1634, 5, (1004, 4)));
        let mut out = Vec::new();
        multixact_values(&rec, &mut out).unwrap();
        let got = pages(&out);
        assert_eq!(
            got.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            vec![
                keys::slru_page_key(SlruKind::MultiXactOffsets, 0, 1),
                keys::slru_page_key(SlruKind::MultiXactMembers, 0, 0),
                keys::slru_page_key(SlruKind::MultiXactMembers, 0, 1),
            ]
        );
        let (offsets, m0, m1) = (&got[0].1, &got[1].1, &got[2].1);
        assert_eq!(&offsets[4..12], &[1634u32.to_le_bytes(), 1639u32.to_le_bytes()].concat()[..]);
        assert!(offsets[..4].iter().chain(&offsets[12..]).all(|&b| b == 0));
        let g = 408 * 20;
        assert_eq!(&m0[g..g + 4], &[0, 0, 0, 1], "status bytes of slots 2 and 3");
        assert_eq!(&m0[g + 12..g + 20], &[232, 3, 0, 0, 233, 3, 0, 0], "xids 1000 and 1001");
        assert_eq!(&m1[..4], &[2, 3, 4, 0]);
        assert_eq!(&m1[4..16], &[234, 3, 0, 0, 235, 3, 0, 0, 236, 3, 0, 0]);
        assert!(m1[16..].iter().all(|&b| b == 0));
        // The last multixact of a page: the next one's offset on the next page. Offset 0 and
        // multixact 0 are skipped.
        let mut out = Vec::new();
        multixact_values(&multixact(0x20, &[4095, u32::MAX, 1, 7, 1]), &mut out).unwrap();
        let got = pages(&out);
        assert_eq!(got[0].0, keys::slru_page_key(SlruKind::MultiXactOffsets, 0, 1));
        assert_eq!(&got[0].1[8188..], &u32::MAX.to_le_bytes());
        assert_eq!(got[1].0, keys::slru_page_key(SlruKind::MultiXactOffsets, 0, 2));
        assert_eq!(&got[1].1[..8], &[1, 0, 0, 0, 0, 0, 0, 0], "multixact 4096 starts at 1");
        let mut out = Vec::new();
        multixact_values(&multixact(0x20, &[u32::MAX, 5, 0]), &mut out).unwrap();
        let got = pages(&out);
        assert_eq!(got[1].0, keys::slru_page_key(SlruKind::MultiXactOffsets, 0, 0));
        assert_eq!(&got[1].1[4..8], &5u32.to_le_bytes(), "after the last multixact comes 1");
        // Short or negative counts, and statuses past a byte, are errors.
        assert!(multixact_values(&multixact(0x20, &[1, 1, 2, 7, 0]), &mut Vec::new()).is_err());
        assert!(multixact_values(&multixact(0x20, &[1, 1, u32::MAX]), &mut Vec::new()).is_err());
        assert!(multixact_values(&multixact(0x20, &[1, 1, 1, 7, 256]), &mut Vec::new()).is_err());
    }

    #[test]
    fn zero_pages_and_truncations_follow_postgres() {
        let mut out = Vec::new();
        multixact_values(&multixact(0x00, &[33]), &mut out).unwrap();
        multixact_values(&multixact(0x10, &[2]), &mut out).unwrap();
        assert_eq!(
            out.iter().map(|(k, _, _)| *k).collect::<Vec<_>>(),
            vec![
                keys::slru_page_key(SlruKind::MultiXactOffsets, 1, 1),
                keys::slru_page_key(SlruKind::MultiXactMembers, 0, 2)
            ]
        );
        assert!(out.iter().all(|(_, _, v)| matches!(v, Value::Image(b) if b.len() == PAGE_SIZE)));
        // Members from offset 1 (segment 0) to 3 * 52352 + 5 (segment 3): segments 0, 1, 2.
        // Offsets from multixact 5 (segment 0) to 70000 (the one before it, 69999, is in
        // segment 1): segment 0.
        let seg_members = MEMBERS_PER_PAGE * SLRU_PAGES_PER_SEGMENT;
        let mut out = Vec::new();
        multixact_values(&multixact(0x30, &[5, 5, 70_000, 1, 3 * seg_members + 5]), &mut out).unwrap();
        let drops: Vec<(u32, u32)> = out.iter().map(|(k, _, _)| (k.spcnode, k.relnode)).collect();
        assert_eq!(drops, vec![(2, 0), (2, 1), (2, 2), (1, 0)]);
        assert!(out
            .iter()
            .all(|(k, _, v)| k.forknum == 0x91 && matches!(v, Value::Image(b) if b.is_empty())));
        // Members wrap after the last segment.
        let mut out = Vec::new();
        let last = LAST_MEMBERS_SEGMENT * seg_members;
        multixact_values(&multixact(0x30, &[5, 1, 1, last, 5]), &mut out).unwrap();
        assert_eq!(out.iter().map(|(k, _, _)| k.relnode).collect::<Vec<_>>(), vec![LAST_MEMBERS_SEGMENT]);
        assert!(multixact_values(&multixact(0x30, &[5, 1, 1, 1]), &mut Vec::new()).is_err());
    }
}
