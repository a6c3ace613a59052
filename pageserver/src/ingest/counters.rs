//! The checkpoint counters a WAL receiver keeps: PostgreSQL 15's `CheckPoint`
//! (`catalog/pg_control.h`) as the WAL has left it, stored under `keys::checkpoint_key` as its
//! 88 bytes (a 64-bit little-endian build's layout, padding zero), so that a base backup at any
//! LSN can start a cluster with counters past everything the WAL below it used.
//!
//! Seeded from the imported `pg_control`'s copy of the last checkpoint
//! ([`from_control_file`]: bytes 40..128 of the file) or from the last stored value
//! ([`decode`]), then moved by the records as a standby's redo moves its counters
//! ([`Redo::apply`]): a `CHECKPOINT_SHUTDOWN` sets them all (`xlog_redo`); a
//! `CHECKPOINT_ONLINE` takes its fields but treats the next xid, next multixact and the oldest
//! xid and multixact as minimums and keeps the next OID (an online checkpoint's is from its
//! start, older than the `NEXTOID` records since); `NEXTOID` sets the next OID; every record's
//! `xl_xid` and a commit's or abort's subtransactions move the next xid past them
//! (`AdvanceNextFullTransactionIdPastXid`, the epoch counted on wraparound); a
//! `CLOG_TRUNCATE` raises the oldest xid to its own (the primary's `SetTransactionIdLimit`
//! follows it at once); a MultiXact `CREATE_ID` moves the next multixact and member offset past
//! its own (`MultiXactAdvanceNextMXact`) and the next xid past its members', a `TRUNCATE_ID`
//! sets the oldest multixact (`SetMultiXactIdLimit`).
//!
//! The counters are `page_types`' `CheckPoint` ([`Counters`]), and their redo the [`Redo`]
//! trait on it.
//!
//! Invariant: pure; nothing panics on any bytes or record.

use page_types::control_file::ControlFile;
use page_types::wal::checkpoint::CheckPoint;
use page_types::wal::rmgr::{RM_CLOG_ID, RM_XLOG_ID};
use page_types::wal::DecodedRecord;

use super::multixact;
use super::xact::XactEnd;

/// `xl_info` of XLOG records (`& 0xF0`).
const XLOG_CHECKPOINT_SHUTDOWN: u8 = 0x00;
const XLOG_CHECKPOINT_ONLINE: u8 = 0x10;
const XLOG_NEXTOID: u8 = 0x30;
const CLOG_TRUNCATE: u8 = 0x10;
/// `FirstNormalTransactionId`: 0 to 2 are special.
const FIRST_NORMAL_XID: u32 = 3;

/// The counters: PostgreSQL 15's `CheckPoint`, whose codec is `page_types`'.
pub type Counters = CheckPoint;

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Whether xid `a` comes after `b` (`TransactionIdFollows`: modulo 2^32 for normal xids).
fn follows(a: u32, b: u32) -> bool {
    if a < FIRST_NORMAL_XID || b < FIRST_NORMAL_XID {
        return a > b;
    }
    (a.wrapping_sub(b) as i32) > 0
}

/// Whether multixact id (or member offset) `a` comes before `b`, modulo 2^32
/// (`MultiXactIdPrecedes`, `MultiXactOffsetPrecedes`).
fn multi_precedes(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// A stored value of the counters: a `CheckPoint`'s 88 bytes.
pub fn decode(bytes: &[u8]) -> Result<Counters, String> {
    CheckPoint::decode(bytes).map_err(|e| e.to_string())
}

/// The `checkPointCopy` of a PostgreSQL 15 `pg_control` (its version and CRC checked).
pub fn from_control_file(file: &[u8]) -> Result<Counters, String> {
    ControlFile::decode(file).map(|control| control.checkpoint_copy).map_err(|e| e.to_string())
}

/// What the redo of records does to the counters.
pub trait Redo {
    /// Moves the next xid past `xid`; whether it moved.
    fn advance_next_xid(&mut self, xid: u32) -> bool;
    /// What `record` does to the counters (`xact`: the transaction it ends, if any); whether
    /// they changed.
    fn apply(&mut self, record: &DecodedRecord, xact: Option<&XactEnd>) -> Result<bool, String>;
}

impl Redo for Counters {
    /// Moves the next xid past `xid` (`AdvanceNextFullTransactionIdPastXid`): a normal xid at
    /// or after it (modulo 2^32) makes it `xid + 1`, skipping the special xids and counting an
    /// epoch when the 32 bits wrap. Whether it moved.
    fn advance_next_xid(&mut self, xid: u32) -> bool {
        let next = self.next_xid as u32;
        if xid < FIRST_NORMAL_XID || !(xid == next || follows(xid, next)) {
            return false;
        }
        let mut new = xid.wrapping_add(1);
        if new < FIRST_NORMAL_XID {
            new = FIRST_NORMAL_XID;
        }
        let mut epoch = self.next_xid >> 32;
        if new < next {
            epoch += 1;
        }
        self.next_xid = (epoch << 32) | u64::from(new);
        true
    }

    /// An XLOG checkpoint record that is not a `CheckPoint` is an error.
    fn apply(&mut self, record: &DecodedRecord, xact: Option<&XactEnd>) -> Result<bool, String> {
        let before = *self;
        self.advance_next_xid(record.xid);
        for &sub in xact.map_or(&[][..], |x| &x.subxacts[..]) {
            self.advance_next_xid(sub);
        }
        let data = &record.main_data;
        match (record.rmid, record.info & 0xF0) {
            (RM_XLOG_ID, XLOG_CHECKPOINT_SHUTDOWN) => {
                *self = decode(data)?;
            }
            (RM_XLOG_ID, XLOG_CHECKPOINT_ONLINE) => {
                let record = decode(data)?;
                let mut new = Counters {
                    next_xid: self.next_xid.max(record.next_xid),
                    next_oid: self.next_oid,
                    ..record
                };
                if multi_precedes(record.next_multi, self.next_multi) {
                    new.next_multi = self.next_multi;
                }
                if multi_precedes(record.next_multi_offset, self.next_multi_offset) {
                    new.next_multi_offset = self.next_multi_offset;
                }
                if multi_precedes(record.oldest_multi, self.oldest_multi) {
                    (new.oldest_multi, new.oldest_multi_db) = (self.oldest_multi, self.oldest_multi_db);
                }
                if !follows(record.oldest_xid, self.oldest_xid) {
                    (new.oldest_xid, new.oldest_xid_db) = (self.oldest_xid, self.oldest_xid_db);
                }
                *self = new;
            }
            (RM_XLOG_ID, XLOG_NEXTOID) => {
                let oid = data.get(..4).ok_or("a NEXTOID record without its OID")?;
                self.next_oid = u32_at(oid, 0);
            }
            // xl_clog_truncate { int pageno; TransactionId oldestXact; Oid oldestXactDb; }
            (RM_CLOG_ID, CLOG_TRUNCATE) => {
                let truncate = data.get(..12).ok_or("a CLOG truncate shorter than 12 bytes")?;
                let (xid, db) = (u32_at(truncate, 4), u32_at(truncate, 8));
                if follows(xid, self.oldest_xid) {
                    (self.oldest_xid, self.oldest_xid_db) = (xid, db);
                }
            }
            _ => {}
        }
        if let Some(create) = multixact::create(record) {
            let create = create?;
            for &(xid, _) in &create.members {
                self.advance_next_xid(xid);
            }
            let (next, offset) =
                (create.multi.wrapping_add(1), create.offset.wrapping_add(create.members.len() as u32));
            if multi_precedes(self.next_multi, next) {
                self.next_multi = next;
            }
            if multi_precedes(self.next_multi_offset, offset) {
                self.next_multi_offset = offset;
            }
        }
        if let Some(truncate) = multixact::truncate(record) {
            let truncate = truncate?;
            (self.oldest_multi, self.oldest_multi_db) = (truncate.end_multi, truncate.oldest_multi_db);
        }
        Ok(*self != before)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::ingest::xact::tests::xact_record;
    use bytes::Bytes;
    use proptest::prelude::*;

    /// The control data of a PostgreSQL 15 `initdb` (the first 296 bytes of its `pg_control`;
    /// page-types' test vector of a cluster with data checksums), `pg_controldata`: NextXID 0:724, NextOID 13572, NextMultiXactId 1, NextMultiOffset 0,
    /// oldestXID 716 in database 1, oldestMultiXid 1 in database 1.
    const CONTROL: &str = include_str!("../../../page-types/testdata/pg_control-initdb-checksums.hex");

    /// The file of the test vector (hex lines).
    fn control() -> Vec<u8> {
        let hex: String = CONTROL.split_whitespace().collect();
        let mut file: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        file.resize(8192, 0);
        file
    }

    fn xlog(info: u8, xid: u32, main: Vec<u8>) -> DecodedRecord {
        let mut rec = xact_record(info, xid, main);
        rec.rmid = RM_XLOG_ID;
        rec
    }

    #[test]
    fn the_imported_control_file_seeds_the_counters_and_they_round_trip() {
        let file = control();
        let c = from_control_file(&file).unwrap();
        assert_eq!((c.next_xid, c.next_oid, c.next_multi, c.next_multi_offset), (724, 13572, 1, 0));
        assert_eq!((c.oldest_xid, c.oldest_xid_db, c.oldest_multi, c.oldest_multi_db), (716, 1, 1, 1));
        assert_eq!((c.this_timeline_id, c.prev_timeline_id, c.full_page_writes), (1, 1, true));
        assert_eq!(c.redo, page_types::Lsn(0x0174_14F8));
        assert_eq!(&c.encode()[..], &file[40..128], "the copy's bytes, padding included");
        assert_eq!(decode(&c.encode()), Ok(c));
        let mut damaged = file.clone();
        damaged[64] ^= 1;
        assert!(from_control_file(&damaged).unwrap_err().contains("CRC"));
        assert!(decode(&[0; 87]).is_err());
    }

    #[test]
    fn records_move_the_counters_as_redo_does() {
        let mut c = from_control_file(&control()).unwrap();
        // An xid below the next changes nothing; at or above it moves it past.
        assert_eq!(c.apply(&xact_record(0x00, 700, vec![0; 8]), None), Ok(false));
        assert_eq!(c.apply(&xact_record(0x00, 724, vec![0; 8]), None), Ok(true));
        assert_eq!(c.next_xid, 725);
        // Subtransactions of a commit count too.
        let end = XactEnd { committed: true, xid: 725, subxacts: vec![726, 900], dropped: vec![] };
        assert_eq!(c.apply(&xact_record(0x00, 725, vec![0; 8]), Some(&end)), Ok(true));
        assert_eq!(c.next_xid, 901);
        // NEXTOID sets the OID, whatever it was.
        assert_eq!(c.apply(&xlog(0x30, 0, 24_576u32.to_le_bytes().to_vec()), None), Ok(true));
        assert_eq!(c.next_oid, 24_576);
        assert!(c.apply(&xlog(0x30, 0, vec![1, 2]), None).is_err());
        // An online checkpoint from before: its next xid and OID do not go back; its other
        // fields are taken.
        let mut online = c;
        (online.next_xid, online.next_oid, online.redo, online.oldest_xid) =
            (800, 16_384, page_types::Lsn(0x0200_0000), 750);
        assert_eq!(c.apply(&xlog(0x10, 0, online.encode().to_vec()), None), Ok(true));
        assert_eq!(
            (c.next_xid, c.next_oid, c.redo, c.oldest_xid),
            (901, 24_576, page_types::Lsn(0x0200_0000), 750)
        );
        // A shutdown checkpoint sets everything.
        let mut shutdown = c;
        (shutdown.next_xid, shutdown.next_oid, shutdown.oldest_xid) = (850, 16_000, 740);
        assert_eq!(c.apply(&xlog(0x00, 0, shutdown.encode().to_vec()), None), Ok(true));
        assert_eq!(c, shutdown);
        assert!(c.apply(&xlog(0x00, 0, vec![0; 40]), None).is_err());
        // CLOG_TRUNCATE raises the oldest xid, never lowers it.
        let mut truncate = xlog(0x10, 0, [3u32, 800, 5].iter().flat_map(|w| w.to_le_bytes()).collect());
        truncate.rmid = RM_CLOG_ID;
        assert_eq!(c.apply(&truncate, None), Ok(true));
        assert_eq!((c.oldest_xid, c.oldest_xid_db), (800, 5));
        assert_eq!(c.apply(&truncate, None), Ok(false));
        // Other XLOG records leave them.
        assert_eq!(c.apply(&xlog(0x20, 0, Vec::new()), None), Ok(false));
        // A multixact: the next one and the next member offset past it, the next xid past its
        // members; an older one moves nothing.
        let create = |multi: u32, offset: u32, xids: &[u32]| {
            let mut main: Vec<u8> =
                [multi, offset, xids.len() as u32].iter().flat_map(|w| w.to_le_bytes()).collect();
            main.extend(xids.iter().flat_map(|x| [*x, 1]).flat_map(u32::to_le_bytes));
            let mut rec = xlog(0x20, 0, main);
            rec.rmid = 6;
            rec
        };
        (c.next_multi, c.next_multi_offset) = (10, 100);
        assert_eq!(c.apply(&create(10, 100, &[c.next_xid as u32 + 5, 7]), None), Ok(true));
        assert_eq!((c.next_multi, c.next_multi_offset, c.next_xid), (11, 102, 856));
        assert_eq!(c.apply(&create(4, 50, &[7]), None), Ok(false));
        assert_eq!(c.apply(&create(11, 102, &[7]), None), Ok(true));
        let mut short = create(12, 102, &[7]);
        short.main_data = short.main_data.slice(..16);
        assert!(c.apply(&short, None).is_err());
        // A truncation sets the oldest multixact.
        let mut truncate = xlog(0x30, 0, [9u32, 1, 8, 1, 90].iter().flat_map(|w| w.to_le_bytes()).collect());
        truncate.rmid = 6;
        assert_eq!(c.apply(&truncate, None), Ok(true));
        assert_eq!((c.oldest_multi, c.oldest_multi_db), (8, 9));
    }

    #[test]
    fn the_next_xid_counts_an_epoch_when_it_wraps_and_skips_the_special_xids() {
        let mut c = from_control_file(&control()).unwrap();
        c.next_xid = (7 << 32) | u64::from(u32::MAX - 1);
        assert!(c.advance_next_xid(u32::MAX - 1));
        assert_eq!(c.next_xid, (7 << 32) | u64::from(u32::MAX));
        assert!(c.advance_next_xid(u32::MAX));
        assert_eq!(c.next_xid, (8 << 32) | 3, "past the special xids 0 to 2, in the next epoch");
        assert!(c.advance_next_xid(10));
        assert_eq!(c.next_xid, (8 << 32) | 11);
        assert!(!c.advance_next_xid(u32::MAX), "an xid of the last epoch");
        assert!(!c.advance_next_xid(2) && !c.advance_next_xid(0), "special xids move nothing");
    }

    proptest! {
        #[test]
        fn any_record_moves_the_counters_without_panicking(
            rmid in prop_oneof![Just(RM_XLOG_ID), Just(RM_CLOG_ID), any::<u8>()],
            info in any::<u8>(),
            xid in any::<u32>(),
            main in proptest::collection::vec(any::<u8>(), 0..120),
        ) {
            let mut c = from_control_file(&control()).unwrap();
            let mut rec = xact_record(info, xid, main);
            rec.rmid = rmid;
            let _ = c.apply(&rec, None);
            rec.main_data = Bytes::new();
            let _ = c.apply(&rec, None);
        }
    }
}
