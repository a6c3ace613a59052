//! The end of a transaction as a PostgreSQL 15 WAL record says it (`xact.c`'s
//! `xact_redo_commit`/`xact_redo_abort`, the layout read by `xactdesc.c`'s
//! `ParseCommitRecord`/`ParseAbortRecord`): which transaction ended, committed or aborted, with
//! which subtransactions, dropping which relations. What the ingest steps that follow it read:
//! the CLOG status ([`super::slru`]), the next transaction id ([`super::counters`]) and the
//! relation drops (`super::wal_values`).
//!
//! The main data of COMMIT, ABORT, COMMIT_PREPARED and ABORT_PREPARED: `xact_time` (8 bytes),
//! then with `XLOG_XACT_HAS_INFO` (0x80 in `xl_info`) the `xinfo` word and, in this order, each
//! part it announces: the database (8 bytes), the subtransactions (`nsubxacts`, then as many
//! xids), the relations dropped (`nrels`, then 12 bytes each), the dropped statistics
//! (`nitems`, 12 bytes each), the invalidation messages (commit only: `nmsgs`, 16 bytes each),
//! the two-phase transaction id. The transaction that ended is the record's `xl_xid`, or for a
//! prepared one the two-phase id.
//!
//! Invariant: pure; never panics on any record (every count is checked against the bytes).

use page_types::keys::RelTag;
use page_types::wal::rmgr::RM_XACT_ID;
use page_types::wal::DecodedRecord;

/// `XLOG_XACT_HAS_INFO`.
const HAS_INFO: u8 = 0x80;
/// `XLOG_XACT_OPMASK` and the operations that end a transaction.
const OPMASK: u8 = 0x70;
const COMMIT: u8 = 0x00;
const ABORT: u8 = 0x20;
const COMMIT_PREPARED: u8 = 0x30;
const ABORT_PREPARED: u8 = 0x40;
/// `xinfo` flags.
const HAS_DBINFO: u32 = 1 << 0;
const HAS_SUBXACTS: u32 = 1 << 1;
const HAS_RELFILENODES: u32 = 1 << 2;
const HAS_INVALS: u32 = 1 << 3;
const HAS_TWOPHASE: u32 = 1 << 4;
const HAS_DROPPED_STATS: u32 = 1 << 8;

/// A transaction's end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XactEnd {
    pub committed: bool,
    /// The transaction that ended: the record's xid, or the prepared transaction's.
    pub xid: u32,
    pub subxacts: Vec<u32>,
    /// The relations the transaction dropped (commit) or created (abort): their files go.
    pub dropped: Vec<RelTag>,
}

/// Whether `record` is a COMMIT PREPARED or ABORT PREPARED: the end of a prepared transaction,
/// whose [`XactEnd::xid`] is the two-phase id.
pub fn ends_prepared(record: &DecodedRecord) -> bool {
    record.rmid == RM_XACT_ID && matches!(record.info & OPMASK, COMMIT_PREPARED | ABORT_PREPARED)
}

/// The transaction `record` ends, if it ends one (`Ok(None)`: another record); an error names
/// what of its main data is missing.
pub fn parse(record: &DecodedRecord) -> Result<Option<XactEnd>, &'static str> {
    let op = record.info & OPMASK;
    if record.rmid != RM_XACT_ID || !matches!(op, COMMIT | ABORT | COMMIT_PREPARED | ABORT_PREPARED) {
        return Ok(None);
    }
    let committed = matches!(op, COMMIT | COMMIT_PREPARED);
    let mut r = Cursor { data: &record.main_data, at: 8 };
    if record.main_data.len() < 8 {
        return Err("a transaction record shorter than its timestamp");
    }
    let xinfo = if record.info & HAS_INFO != 0 { r.u32("xinfo")? } else { 0 };
    if xinfo & HAS_DBINFO != 0 {
        r.skip(8, "the database")?;
    }
    let mut subxacts = Vec::new();
    if xinfo & HAS_SUBXACTS != 0 {
        let n = r.count(4, "the subtransactions")?;
        subxacts = (0..n).map(|_| r.u32("a subtransaction")).collect::<Result<_, _>>()?;
    }
    let mut dropped = Vec::new();
    if xinfo & HAS_RELFILENODES != 0 {
        let n = r.count(12, "the relations")?;
        for _ in 0..n {
            let (spcnode, dbnode, relnode) =
                (r.u32("a relation")?, r.u32("a relation")?, r.u32("a relation")?);
            dropped.push(RelTag { spcnode, dbnode, relnode });
        }
    }
    if xinfo & HAS_DROPPED_STATS != 0 {
        let n = r.count(12, "the dropped statistics")?;
        r.skip(n * 12, "the dropped statistics")?;
    }
    if committed && xinfo & HAS_INVALS != 0 {
        let n = r.count(16, "the invalidation messages")?;
        r.skip(n * 16, "the invalidation messages")?;
    }
    let twophase =
        if xinfo & HAS_TWOPHASE != 0 { Some(r.u32("the two-phase transaction id")?) } else { None };
    let xid = match op {
        COMMIT_PREPARED | ABORT_PREPARED => twophase.ok_or("a prepared transaction's end without its id")?,
        _ => record.xid,
    };
    Ok(Some(XactEnd { committed, xid, subxacts, dropped }))
}

struct Cursor<'a> {
    data: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn skip(&mut self, n: usize, what: &'static str) -> Result<(), &'static str> {
        let end = self.at.checked_add(n).filter(|end| *end <= self.data.len()).ok_or(what)?;
        self.at = end;
        Ok(())
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, &'static str> {
        let at = self.at;
        self.skip(4, what)?;
        Ok(u32::from_le_bytes([self.data[at], self.data[at + 1], self.data[at + 2], self.data[at + 3]]))
    }

    /// A count of items of `size` bytes that must all be there.
    fn count(&mut self, size: usize, what: &'static str) -> Result<usize, &'static str> {
        let n = self.u32(what)? as usize;
        match n.checked_mul(size) {
            Some(bytes) if bytes <= self.data.len() - self.at => Ok(n),
            _ => Err(what),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use bytes::Bytes;
    use page_types::Lsn;

    /// A transaction record of `info` with `xid` and `main` data.
    pub(crate) fn xact_record(info: u8, xid: u32, main: Vec<u8>) -> DecodedRecord {
        DecodedRecord {
            lsn: Lsn(0x1_0000_0028),
            end_lsn: Lsn(0x1_0000_0068),
            xid,
            prev: Lsn(0),
            info,
            rmid: RM_XACT_ID,
            blocks: Vec::new(),
            main_data: Bytes::from(main),
            origin: None,
            toplevel_xid: None,
        }
    }

    /// The main data of a commit or abort with every part `xinfo` may announce.
    pub(crate) fn xact_main(
        subxacts: &[u32],
        rels: &[RelTag],
        twophase: Option<u32>,
        invals: u32,
    ) -> Vec<u8> {
        let mut xinfo = HAS_DBINFO | HAS_DROPPED_STATS;
        let mut main = vec![0u8; 8];
        let mut rest = Vec::new();
        rest.extend_from_slice(&[5, 0, 0, 0, 0x7F, 6, 0, 0]);
        if !subxacts.is_empty() {
            xinfo |= HAS_SUBXACTS;
            rest.extend_from_slice(&(subxacts.len() as u32).to_le_bytes());
            rest.extend(subxacts.iter().flat_map(|x| x.to_le_bytes()));
        }
        if !rels.is_empty() {
            xinfo |= HAS_RELFILENODES;
            rest.extend_from_slice(&(rels.len() as u32).to_le_bytes());
            rest.extend(
                rels.iter().flat_map(|r| [r.spcnode, r.dbnode, r.relnode]).flat_map(u32::to_le_bytes),
            );
        }
        rest.extend_from_slice(&2u32.to_le_bytes());
        rest.extend_from_slice(&[0xEE; 24]);
        if invals > 0 {
            xinfo |= HAS_INVALS;
            rest.extend_from_slice(&invals.to_le_bytes());
            rest.extend(std::iter::repeat_n(0xCC, 16 * invals as usize));
        }
        if let Some(x) = twophase {
            xinfo |= HAS_TWOPHASE;
            rest.extend_from_slice(&x.to_le_bytes());
        }
        main.extend_from_slice(&xinfo.to_le_bytes());
        main.extend(rest);
        main
    }

    #[test]
    fn commits_and_aborts_give_their_transaction_subtransactions_and_relations() {
        let rel = RelTag { spcnode: 1663, dbnode: 5, relnode: 16384 };
        let commit = xact_record(0x80, 900, xact_main(&[901, 70_000], &[rel], None, 3));
        assert_eq!(
            parse(&commit).unwrap(),
            Some(XactEnd { committed: true, xid: 900, subxacts: vec![901, 70_000], dropped: vec![rel] })
        );
        // Without HAS_INFO: the timestamp alone, the record's xid.
        let plain = xact_record(0x20, 42, vec![0; 8]);
        assert_eq!(
            parse(&plain).unwrap(),
            Some(XactEnd { committed: false, xid: 42, subxacts: vec![], dropped: vec![] })
        );
        // A prepared transaction's end: the two-phase id, not the record's xid (0).
        let prepared = xact_record(0xB0, 0, xact_main(&[], &[], Some(777), 1));
        assert_eq!(parse(&prepared).unwrap().map(|e| (e.committed, e.xid)), Some((true, 777)));
        assert!(ends_prepared(&prepared) && !ends_prepared(&commit) && !ends_prepared(&plain));
        let aborted = xact_record(0xC0, 0, xact_main(&[778], &[], Some(777), 0));
        assert!(ends_prepared(&aborted));
        assert_eq!(
            parse(&aborted).unwrap().map(|e| (e.committed, e.xid, e.subxacts)),
            Some((false, 777, vec![778]))
        );
        // An abort has no invalidations: its two-phase id follows the statistics.
        let mut abort = xact_main(&[], &[], Some(5), 0);
        abort[8..12].copy_from_slice(&(HAS_TWOPHASE | HAS_INVALS).to_le_bytes());
        abort.truncate(12);
        abort.extend_from_slice(&5u32.to_le_bytes());
        assert_eq!(parse(&xact_record(0xC0, 0, abort)).unwrap().map(|e| e.xid), Some(5));
        // Other records end no transaction.
        assert_eq!(parse(&xact_record(0x10, 1, vec![0; 64])).unwrap(), None);
        assert_eq!(parse(&xact_record(0x50, 1, vec![0; 64])).unwrap(), None);
    }

    #[test]
    fn short_records_are_errors_naming_the_part() {
        let full = xact_main(&[901, 902], &[RelTag { spcnode: 1, dbnode: 2, relnode: 3 }], Some(9), 2);
        for cut in 0..full.len() {
            let rec = xact_record(0xB0, 1, full[..cut].to_vec());
            assert!(parse(&rec).is_err(), "{cut} bytes");
        }
        assert!(parse(&xact_record(0xB0, 1, full)).is_ok());
        // A huge count is refused before anything is allocated for it.
        let mut huge = vec![0u8; 8];
        huge.extend_from_slice(&HAS_SUBXACTS.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(parse(&xact_record(0x80, 1, huge)), Err("the subtransactions"));
        // A prepared transaction's end must say which.
        assert!(parse(&xact_record(0xB0, 1, vec![0; 8])).is_err());
    }
}
