//! SLRU pages: the commit log (`pg_xact`, PostgreSQL 15's `clog.c`) and the MultiXact
//! offsets and members (`pg_multixact/*`, `multixact.c`), as the daemon derives their changes
//! from the WAL. A [`ClogSet`] is what a transaction's commit or abort (prepared or not) gives
//! one CLOG page it touches: the transactions of that page and the status they end with; the
//! child sets their bits ([`apply_clog_set`]), as `TransactionIdSetTreeStatus` leaves them in
//! redo. An [`SlruWrite`] is bytes written at places of a page: what a MultiXact `CREATE_ID`
//! writes to an offsets page (the new multixact's first member offset, 4 bytes at `4 *
//! (multi % 2048)`) and to each members page (each member's xid and its status byte, in groups
//! of 4 members: 4 status bytes, then 4 xids, 20 bytes a group, 409 groups a page), as
//! `RecordNewMultiXact` writes them; the child copies them ([`apply_slru_write`]).
//!
//! **The CLOG page.** A CLOG page has no header: 2 status bits per transaction, 4 transactions a
//! byte (transaction `x` of the page in byte `x / 4`, bits `2 * (x % 4)`), so 32768 a page
//! ([`CLOG_XACTS_PER_PAGE`]); `TRANSACTION_STATUS_COMMITTED` is 0x01,
//! `TRANSACTION_STATUS_ABORTED` 0x02. A transaction's page is its xid / 32768 (the key's
//! segment: page / 32, its page in the segment: page % 32). PostgreSQL's transient
//! "subcommitted" state (0x03) is never logged: subtransactions end committed or aborted with
//! their parent in the same record, so the value sets both at once.
//!
//! **No page yet.** A page the import did not bring and no zero-page record made has no image:
//! the daemon sends the records without a base page, and the child starts from zeros, which is
//! what PostgreSQL's recovery reads for an SLRU page without a file (`SlruPhysicalReadPage`
//! in recovery). So both values are applicable to any page, with no flag of their own.
//!
//! **Idempotent:** setting a status or writing bytes is the same whether or not the page
//! already has them (a page copied by the base backup after the record), so SLRU pages carry
//! no LSN and none is checked.
//!
//! [`ClogSet`] encoding, little-endian: `kind = 0x13 | version = 1 | rmid u8 | info u8 | lsn
//! u64 | end_lsn u64 | status u8 | form u8 | body`; form 0: `n u16 | n x offset u16` (each
//! below 32768: the transaction's place in the page); form 1: a bitmap of 4096 bytes (bit `o %
//! 8` of byte `o / 8` for offset `o`), for a record with more than 2047 transactions on one
//! page. Either way at most 4118 bytes, below `MAX_RECORD_LEN`.
//!
//! [`SlruWrite`] encoding: `kind = 0x14 | version = 1 | rmid u8 | info u8 | lsn u64 | end_lsn
//! u64 | n u16 | n x (offset u16 | len u8 | len bytes)`, each run of 1 to 255 bytes within the
//! page; runs apply in order.
//!
//! Invariants: pure; decoding checks every length and value; nothing panics on any value or
//! page.

use super::{
    record_type_name, Pg15Error, Reader, RedoError, FORMAT_VERSION, KIND_PG15_CLOG_SET, KIND_PG15_SLRU_WRITE,
};
use crate::page::{Page, BLCKSZ};

/// Transactions per CLOG page (`CLOG_XACTS_PER_PAGE`: 4 a byte).
pub const CLOG_XACTS_PER_PAGE: u32 = BLCKSZ as u32 * 4;
/// `TRANSACTION_STATUS_COMMITTED`.
pub const CLOG_COMMITTED: u8 = 0x01;
/// `TRANSACTION_STATUS_ABORTED`.
pub const CLOG_ABORTED: u8 = 0x02;
/// The bytes of the bitmap form: a bit per transaction of the page.
const BITMAP_LEN: usize = CLOG_XACTS_PER_PAGE as usize / 8;
/// Most offsets in the list form; beyond it the bitmap is smaller.
const MAX_LISTED: usize = (BITMAP_LEN - 2) / 2;
const FORM_LIST: u8 = 0;
const FORM_BITMAP: u8 = 1;

/// The status a transaction record gives to the transactions of one CLOG page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClogSet {
    /// The WAL record's resource manager and info bits (for errors).
    pub rmid: u8,
    pub info: u8,
    pub lsn: u64,
    pub end_lsn: u64,
    /// [`CLOG_COMMITTED`] or [`CLOG_ABORTED`].
    pub status: u8,
    /// The transactions' offsets in the page (xid % [`CLOG_XACTS_PER_PAGE`]), ascending, each
    /// once.
    pub offsets: Vec<u16>,
}

impl ClogSet {
    /// Encodes the value; an error for a status other than committed or aborted, or an offset
    /// beyond the page (nothing is written then).
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), Pg15Error> {
        if !matches!(self.status, CLOG_COMMITTED | CLOG_ABORTED)
            || self.offsets.iter().any(|&o| u32::from(o) >= CLOG_XACTS_PER_PAGE)
        {
            return Err(Pg15Error::Invalid("a CLOG status of committed or aborted, offsets in the page"));
        }
        out.extend_from_slice(&[KIND_PG15_CLOG_SET, FORMAT_VERSION, self.rmid, self.info]);
        out.extend_from_slice(&self.lsn.to_le_bytes());
        out.extend_from_slice(&self.end_lsn.to_le_bytes());
        out.push(self.status);
        if self.offsets.len() <= MAX_LISTED {
            out.push(FORM_LIST);
            out.extend_from_slice(&(self.offsets.len() as u16).to_le_bytes());
            for o in &self.offsets {
                out.extend_from_slice(&o.to_le_bytes());
            }
        } else {
            out.push(FORM_BITMAP);
            let mut bitmap = [0u8; BITMAP_LEN];
            for &o in &self.offsets {
                bitmap[usize::from(o) / 8] |= 1 << (o % 8);
            }
            out.extend_from_slice(&bitmap);
        }
        Ok(())
    }

    pub fn decode(bytes: &[u8]) -> Result<ClogSet, Pg15Error> {
        let mut r = Reader { bytes, at: 0 };
        let kind = r.u8()?;
        if kind != KIND_PG15_CLOG_SET {
            return Err(Pg15Error::NotPg15(kind));
        }
        let version = r.u8()?;
        if version != FORMAT_VERSION {
            return Err(Pg15Error::Version(version));
        }
        let (rmid, info, lsn, end_lsn, status, form) =
            (r.u8()?, r.u8()?, r.u64()?, r.u64()?, r.u8()?, r.u8()?);
        if !matches!(status, CLOG_COMMITTED | CLOG_ABORTED) {
            return Err(Pg15Error::Invalid("a CLOG status of committed (1) or aborted (2)"));
        }
        let mut offsets = Vec::new();
        match form {
            FORM_LIST => {
                let n = r.u16()?;
                let list = r.take(usize::from(n) * 2)?;
                for pair in list.chunks_exact(2) {
                    let o = u16::from_le_bytes([pair[0], pair[1]]);
                    if u32::from(o) >= CLOG_XACTS_PER_PAGE {
                        return Err(Pg15Error::Invalid("CLOG offsets below 32768"));
                    }
                    offsets.push(o);
                }
                offsets.sort_unstable();
                offsets.dedup();
            }
            FORM_BITMAP => {
                let bitmap = r.take(BITMAP_LEN)?;
                for (byte, bits) in bitmap.iter().enumerate() {
                    for bit in 0..8u16 {
                        if bits & (1 << bit) != 0 {
                            // Below 4096 * 8 = 32768: fits.
                            offsets.push(byte as u16 * 8 + bit);
                        }
                    }
                }
            }
            _ => return Err(Pg15Error::Invalid("a CLOG value of form 0 (a list) or 1 (a bitmap)")),
        }
        if r.at != bytes.len() {
            return Err(Pg15Error::Trailing(bytes.len() - r.at));
        }
        Ok(ClogSet { rmid, info, lsn, end_lsn, status, offsets })
    }

    pub fn type_name(&self) -> String {
        format!("{} (its CLOG page)", record_type_name(self.rmid, self.info))
    }
}

/// Sets the status of `set`'s transactions in `page`, a CLOG page; the other bits stay.
pub fn apply_clog_set(set: &ClogSet, page: &mut Page) -> Result<(), RedoError> {
    for &o in &set.offsets {
        let (byte, shift) = (usize::from(o) / 4, (o % 4) * 2);
        let Some(b) = page.get_mut(byte) else {
            return Err(RedoError::DoesNotFit(format!("{}: offset {o} past the page", set.type_name())));
        };
        *b = (*b & !(0x03 << shift)) | ((set.status & 0x03) << shift);
    }
    Ok(())
}

/// Bytes written at places of an SLRU page by one WAL record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlruWrite {
    /// The WAL record's resource manager and info bits (for errors).
    pub rmid: u8,
    pub info: u8,
    pub lsn: u64,
    pub end_lsn: u64,
    /// (byte offset in the page, bytes), each within the page, 1 to 255 bytes.
    pub runs: Vec<(u16, Vec<u8>)>,
}

/// The longest run of an [`SlruWrite`].
const MAX_RUN: usize = u8::MAX as usize;

impl SlruWrite {
    /// The write of `bytes` (byte offset, value; ascending, each offset once, below the page
    /// size), as runs of adjacent bytes.
    pub fn from_bytes(
        rmid: u8,
        info: u8,
        lsn: u64,
        end_lsn: u64,
        bytes: impl IntoIterator<Item = (u16, u8)>,
    ) -> SlruWrite {
        let mut runs: Vec<(u16, Vec<u8>)> = Vec::new();
        for (at, b) in bytes {
            match runs.last_mut() {
                Some((start, run))
                    if run.len() < MAX_RUN && usize::from(*start) + run.len() == usize::from(at) =>
                {
                    run.push(b)
                }
                _ => runs.push((at, vec![b])),
            }
        }
        SlruWrite { rmid, info, lsn, end_lsn, runs }
    }

    /// Encodes the value; an error for a run that is empty, longer than 255 bytes or past the
    /// page, or for a value past `MAX_RECORD_LEN` (nothing is written then).
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), Pg15Error> {
        let len = 22 + self.runs.iter().map(|(_, r)| 3 + r.len()).sum::<usize>();
        if len > page_types::MAX_RECORD_LEN || self.runs.len() > usize::from(u16::MAX) {
            return Err(Pg15Error::TooLong { len });
        }
        if self
            .runs
            .iter()
            .any(|(at, r)| r.is_empty() || r.len() > MAX_RUN || usize::from(*at) + r.len() > BLCKSZ)
        {
            return Err(Pg15Error::Invalid("runs of 1 to 255 bytes within the page"));
        }
        out.extend_from_slice(&[KIND_PG15_SLRU_WRITE, FORMAT_VERSION, self.rmid, self.info]);
        out.extend_from_slice(&self.lsn.to_le_bytes());
        out.extend_from_slice(&self.end_lsn.to_le_bytes());
        out.extend_from_slice(&(self.runs.len() as u16).to_le_bytes());
        for (at, run) in &self.runs {
            out.extend_from_slice(&at.to_le_bytes());
            out.push(run.len() as u8);
            out.extend_from_slice(run);
        }
        Ok(())
    }

    pub fn decode(bytes: &[u8]) -> Result<SlruWrite, Pg15Error> {
        let mut r = Reader { bytes, at: 0 };
        let kind = r.u8()?;
        if kind != KIND_PG15_SLRU_WRITE {
            return Err(Pg15Error::NotPg15(kind));
        }
        let version = r.u8()?;
        if version != FORMAT_VERSION {
            return Err(Pg15Error::Version(version));
        }
        let (rmid, info, lsn, end_lsn, n) = (r.u8()?, r.u8()?, r.u64()?, r.u64()?, r.u16()?);
        let mut runs = Vec::new();
        for _ in 0..n {
            let (at, len) = (r.u16()?, r.u8()?);
            if len == 0 || usize::from(at) + usize::from(len) > BLCKSZ {
                return Err(Pg15Error::Invalid("runs of 1 to 255 bytes within the page"));
            }
            runs.push((at, r.take(usize::from(len))?.to_vec()));
        }
        if r.at != bytes.len() {
            return Err(Pg15Error::Trailing(bytes.len() - r.at));
        }
        Ok(SlruWrite { rmid, info, lsn, end_lsn, runs })
    }

    pub fn type_name(&self) -> String {
        format!("{} (its SLRU page)", record_type_name(self.rmid, self.info))
    }
}

/// Writes `write`'s runs into `page`, an SLRU page.
pub fn apply_slru_write(write: &SlruWrite, page: &mut Page) -> Result<(), RedoError> {
    for (at, run) in &write.runs {
        let at = usize::from(*at);
        let Some(dest) = page.get_mut(at..at + run.len()) else {
            return Err(RedoError::DoesNotFit(format!("{}: bytes {at}.. past the page", write.type_name())));
        };
        dest.copy_from_slice(run);
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::pg15::redo;
    use proptest::prelude::*;

    fn set(status: u8, offsets: Vec<u16>) -> ClogSet {
        ClogSet { rmid: 1, info: 0x00, lsn: 0x1_0000_0028, end_lsn: 0x1_0000_0068, status, offsets }
    }

    fn status_of(page: &Page, o: u16) -> u8 {
        (page[usize::from(o) / 4] >> ((o % 4) * 2)) & 0x03
    }

    #[test]
    fn a_commit_sets_its_transactions_bits_and_leaves_the_others() {
        let mut page = Box::new([0u8; BLCKSZ]);
        // Offsets 1 and 2 share byte 0 with 0 and 3; 32767 is the page's last.
        page[0] = 0b1000_0010; // 0: aborted, 3: aborted
        let mut bytes = Vec::new();
        set(CLOG_COMMITTED, vec![1, 2, 32767]).encode(&mut bytes).unwrap();
        assert_eq!(bytes.len(), 22 + 2 + 6, "the list form");
        redo::apply(&bytes, &mut page).unwrap().unwrap();
        assert_eq!(page[0], 0b1001_0110);
        assert_eq!(status_of(&page, 32767), CLOG_COMMITTED);
        assert!(page[1..8191].iter().all(|&b| b == 0));
        // Applied again: the same page.
        let before = page.clone();
        redo::apply(&bytes, &mut page).unwrap().unwrap();
        assert_eq!(page, before);
        // An abort of a committed transaction's slot overwrites both bits.
        let mut bytes = Vec::new();
        set(CLOG_ABORTED, vec![1]).encode(&mut bytes).unwrap();
        redo::apply(&bytes, &mut page).unwrap().unwrap();
        assert_eq!(status_of(&page, 1), CLOG_ABORTED);
        assert_eq!(set(CLOG_ABORTED, vec![1]).type_name(), "Transaction COMMIT (its CLOG page)");
    }

    #[test]
    fn many_transactions_go_as_a_bitmap_and_decode_to_the_same_set() {
        let many: Vec<u16> = (0..5000u16).map(|i| i * 6 + 1).collect();
        for offsets in [many, vec![], vec![7], (0..MAX_LISTED as u16).collect()] {
            let value = set(CLOG_ABORTED, offsets);
            let mut bytes = Vec::new();
            value.encode(&mut bytes).unwrap();
            assert!(bytes.len() <= 22 + BITMAP_LEN, "{} bytes", bytes.len());
            assert_eq!(ClogSet::decode(&bytes).unwrap(), value);
        }
    }

    #[test]
    fn broken_values_are_errors_and_bad_ones_are_not_encoded() {
        let mut bytes = Vec::new();
        set(CLOG_COMMITTED, vec![3, 4]).encode(&mut bytes).unwrap();
        assert_eq!(ClogSet::decode(&bytes[..bytes.len() - 1]), Err(Pg15Error::Truncated(bytes.len() - 4)));
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(ClogSet::decode(&long), Err(Pg15Error::Trailing(1)));
        let mut subcommitted = bytes.clone();
        subcommitted[20] = 0x03;
        assert!(matches!(ClogSet::decode(&subcommitted), Err(Pg15Error::Invalid(_))));
        let mut form = bytes.clone();
        form[21] = 2;
        assert!(matches!(ClogSet::decode(&form), Err(Pg15Error::Invalid(_))));
        let mut past = bytes.clone();
        past[24..26].copy_from_slice(&32768u16.to_le_bytes());
        assert!(matches!(ClogSet::decode(&past), Err(Pg15Error::Invalid(_))));
        let mut none = Vec::new();
        assert!(set(0x03, vec![1]).encode(&mut none).is_err());
        assert!(set(CLOG_COMMITTED, vec![40000]).encode(&mut none).is_err());
        assert!(none.is_empty());
        // Through the child's dispatch: a broken value is `Malformed`.
        let mut page = Box::new([0u8; BLCKSZ]);
        assert!(matches!(redo::apply(&long, &mut page), Some(Err(RedoError::Malformed(_)))));
    }

    fn write(runs: Vec<(u16, Vec<u8>)>) -> SlruWrite {
        SlruWrite { rmid: 6, info: 0x20, lsn: 0x28, end_lsn: 0x60, runs }
    }

    #[test]
    fn a_write_copies_its_runs_and_leaves_the_rest() {
        let value = SlruWrite::from_bytes(6, 0x20, 0x28, 0x60, [(0, 1), (1, 2), (2, 3), (100, 9), (8191, 7)]);
        assert_eq!(value.runs, vec![(0, vec![1, 2, 3]), (100, vec![9]), (8191, vec![7])]);
        assert_eq!(value.type_name(), "MultiXact CREATE_ID (its SLRU page)");
        let mut bytes = Vec::new();
        value.encode(&mut bytes).unwrap();
        assert_eq!(SlruWrite::decode(&bytes).unwrap(), value);
        let mut page = Box::new([0xEEu8; BLCKSZ]);
        redo::apply(&bytes, &mut page).unwrap().unwrap();
        assert_eq!((&page[..4], page[100], page[101], page[8191]), (&[1, 2, 3, 0xEE][..], 9, 0xEE, 7));
        // A whole page of bytes: runs of 255, within a record's bound.
        let all = SlruWrite::from_bytes(6, 0x20, 0, 0, (0..BLCKSZ as u16).map(|i| (i, i as u8)));
        assert_eq!(all.runs.len(), BLCKSZ.div_ceil(MAX_RUN));
        let mut bytes = Vec::new();
        all.encode(&mut bytes).unwrap();
        let mut page = Box::new([0u8; BLCKSZ]);
        redo::apply(&bytes, &mut page).unwrap().unwrap();
        assert!(page.iter().enumerate().all(|(i, &b)| b == i as u8));
    }

    #[test]
    fn broken_writes_are_errors_and_bad_ones_are_not_encoded() {
        let mut bytes = Vec::new();
        write(vec![(8, vec![1, 2])]).encode(&mut bytes).unwrap();
        assert!(matches!(SlruWrite::decode(&bytes[..bytes.len() - 1]), Err(Pg15Error::Truncated(_))));
        let mut past = bytes.clone();
        past[22..24].copy_from_slice(&8191u16.to_le_bytes());
        assert!(matches!(SlruWrite::decode(&past), Err(Pg15Error::Invalid(_))));
        let mut empty = bytes.clone();
        empty[24] = 0;
        assert!(SlruWrite::decode(&empty).is_err());
        let mut none = Vec::new();
        for bad in [vec![(8191, vec![1, 2])], vec![(0, vec![])], vec![(0, vec![0; 256])]] {
            assert!(write(bad).encode(&mut none).is_err());
        }
        assert!(matches!(
            write((0..70).map(|i| (i * 100, vec![0; 255])).collect()).encode(&mut none),
            Err(Pg15Error::TooLong { .. })
        ));
        assert!(none.is_empty());
    }

    proptest! {
        #[test]
        fn writes_decode_and_apply_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut bytes = bytes;
            if bytes.len() > 2 {
                bytes[0] = KIND_PG15_SLRU_WRITE;
                bytes[1] = FORMAT_VERSION;
            }
            let mut page = Box::new([0x55u8; BLCKSZ]);
            if let Ok(write) = SlruWrite::decode(&bytes) {
                prop_assert!(apply_slru_write(&write, &mut page).is_ok());
            }
            let _ = redo::apply(&bytes, &mut page);
        }

        #[test]
        fn decode_and_apply_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200), bitmap in any::<bool>()) {
            let mut bytes = bytes;
            if bytes.len() > 22 {
                bytes[0] = KIND_PG15_CLOG_SET;
                bytes[1] = FORMAT_VERSION;
                bytes[20] = 1 + bytes[20] % 2;
                bytes[21] = u8::from(bitmap);
                if bitmap {
                    bytes.resize(22 + BITMAP_LEN, 0xA5);
                }
            }
            let mut page = Box::new([0x55u8; BLCKSZ]);
            if let Ok(set) = ClogSet::decode(&bytes) {
                prop_assert!(apply_clog_set(&set, &mut page).is_ok());
            }
            let _ = redo::apply(&bytes, &mut page);
        }

        #[test]
        fn any_set_round_trips_and_sets_exactly_its_bits(
            offsets in proptest::collection::btree_set(0u16..32768, 0..3000),
            committed in any::<bool>(),
        ) {
            let status = if committed { CLOG_COMMITTED } else { CLOG_ABORTED };
            let value = set(status, offsets.iter().copied().collect());
            let mut bytes = Vec::new();
            value.encode(&mut bytes).unwrap();
            prop_assert_eq!(&ClogSet::decode(&bytes).unwrap(), &value);
            let mut page = Box::new([0u8; BLCKSZ]);
            apply_clog_set(&value, &mut page).unwrap();
            for o in 0..32768u16 {
                let want = if offsets.contains(&o) { status } else { 0 };
                prop_assert_eq!(status_of(&page, o), want);
            }
        }
    }
}
