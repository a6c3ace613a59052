//! Prepared transactions' state files (`pg_twophase/<xid>`) from the WAL, as values of their
//! keys (`keys::two_phase_key`), as PostgreSQL 15 keeps them (`twophase.c`):
//!
//! - `XLOG_XACT_PREPARE`: its main data is the state (`TwoPhaseFileHeader`, then the
//!   subtransactions, relations, statistics, invalidations and the resource managers' records
//!   up to the end sentinel); the file a checkpoint writes for it (`RecreateTwoPhaseFile`) is
//!   that data followed by its CRC-32C, and `ReadTwoPhaseFile` wants its header's `total_len`
//!   to be the file's size. Stored in 8 KiB chunks at blocks 0, 1, ... (storage keeps values of
//!   at most a page; a PREPARE with many subtransactions, relations or locks is longer), the
//!   last one shorter (empty when the file is a multiple of 8 KiB);
//! - COMMIT PREPARED and ABORT PREPARED (the two-phase id from [`XactEnd`]): chunk 0 empty, the
//!   file removed (`RemoveTwoPhaseFile`).
//!
//! A reader takes chunks from 0 up to the first shorter one: the chunks of one PREPARE are all
//! at its LSN, so a longer file prepared earlier under the same xid (after wraparound) leaves
//! nothing behind that is read. All at the record's end LSN.
//!
//! Invariant: pure; nothing panics on any record.

use bytes::Bytes;
use page_types::keys;
use page_types::wal::rmgr::RM_XACT_ID;
use page_types::wal::DecodedRecord;
use page_types::{BufferTag, Lsn, PAGE_SIZE};

use super::xact::{self, XactEnd};
use crate::storage::Value;

/// `XLOG_XACT_PREPARE` (`xl_info & XLOG_XACT_OPMASK`).
const PREPARE: u8 = 0x10;
const OPMASK: u8 = 0x70;
/// `TWOPHASE_MAGIC` of PostgreSQL 15.
const TWOPHASE_MAGIC: u32 = 0x57F9_4534;

/// Appends the two-phase values of `record` (`xact`: the transaction it ends, if any). An error
/// says what of a PREPARE record is wrong.
pub fn two_phase_values(
    record: &DecodedRecord,
    xact: Option<&XactEnd>,
    out: &mut Vec<(BufferTag, Lsn, Value)>,
) -> Result<(), &'static str> {
    let lsn = record.end_lsn;
    if let Some(end) = xact.filter(|_| xact::ends_prepared(record)) {
        out.push((keys::two_phase_key(end.xid, 0), lsn, Value::Image(Bytes::new())));
        return Ok(());
    }
    if record.rmid != RM_XACT_ID || record.info & OPMASK != PREPARE {
        return Ok(());
    }
    let (xid, file) = state_file(&record.main_data)?;
    for (chunk, part) in (0u32..).zip(chunks(&file)) {
        out.push((keys::two_phase_key(xid, chunk), lsn, Value::Image(file.slice(part))));
    }
    Ok(())
}

/// The prepared transaction's xid and its state file, from a PREPARE record's main data.
fn state_file(data: &[u8]) -> Result<(u32, Bytes), &'static str> {
    let word = |at: usize| data.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let (Some(magic), Some(total_len), Some(xid)) = (word(0), word(4), word(8)) else {
        return Err("a PREPARE record shorter than its header");
    };
    if magic != TWOPHASE_MAGIC {
        return Err("a PREPARE record without PostgreSQL 15's two-phase magic");
    }
    if xid == 0 {
        return Err("a PREPARE record of no transaction (xid 0)");
    }
    if usize::try_from(total_len).ok() != data.len().checked_add(4) {
        return Err("a PREPARE record whose length is not its header's total_len less the checksum");
    }
    let mut file = Vec::with_capacity(data.len() + 4);
    file.extend_from_slice(data);
    file.extend_from_slice(&crc32c::crc32c(data).to_le_bytes());
    Ok((xid, Bytes::from(file)))
}

/// The byte ranges of a file's chunks: each [`PAGE_SIZE`] bytes, the last one shorter (empty
/// when the file is a multiple of a page). The import's configuration and state files are cut
/// the same way.
pub(crate) fn chunks(file: &[u8]) -> impl Iterator<Item = std::ops::Range<usize>> {
    let len = file.len();
    (0..=len / PAGE_SIZE).map(move |i| i * PAGE_SIZE..((i + 1) * PAGE_SIZE).min(len))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::ingest::xact::tests::{xact_main, xact_record};

    /// A PREPARE record's main data for `xid`, `len` bytes (at least the 12 of the header read).
    fn prepare_data(xid: u32, len: usize) -> Vec<u8> {
        let mut data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        data[0..4].copy_from_slice(&TWOPHASE_MAGIC.to_le_bytes());
        data[4..8].copy_from_slice(&(len as u32 + 4).to_le_bytes());
        data[8..12].copy_from_slice(&xid.to_le_bytes());
        data
    }

    fn values_of(record: &DecodedRecord) -> Vec<(BufferTag, Bytes)> {
        let xact = xact::parse(record).unwrap();
        let mut out = Vec::new();
        two_phase_values(record, xact.as_ref(), &mut out).unwrap();
        out.into_iter()
            .map(|(k, lsn, v)| {
                assert_eq!(lsn, record.end_lsn);
                let Value::Image(bytes) = v else { panic!("two-phase values are images") };
                (k, bytes)
            })
            .collect()
    }

    #[test]
    fn a_prepare_stores_its_data_and_crc_and_its_end_empties_the_file() {
        let data = prepare_data(745, 296);
        let out = values_of(&xact_record(0x10, 745, data.clone()));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, keys::two_phase_key(745, 0));
        let file = &out[0].1;
        assert_eq!(&file[..296], &data[..]);
        // PostgreSQL's CRC-32C of the data (INIT_CRC32C, COMP_CRC32C, FIN_CRC32C), little-endian:
        // the standard CRC-32C, whose check value is that of "123456789".
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(&file[296..], &crc32c::crc32c(&data).to_le_bytes());
        // COMMIT PREPARED and ABORT PREPARED of it (xinfo HAS_TWOPHASE): chunk 0 empty.
        for info in [0xB0, 0xC0] {
            let end = xact_record(info, 0, xact_main(&[746], &[], Some(745), 0));
            assert_eq!(values_of(&end), vec![(keys::two_phase_key(745, 0), Bytes::new())]);
        }
        // A plain commit or abort, another record: nothing.
        assert!(values_of(&xact_record(0x80, 745, xact_main(&[], &[], None, 1))).is_empty());
        assert!(values_of(&xact_record(0x20, 745, vec![0; 8])).is_empty());
        assert!(values_of(&xact_record(0x50, 745, vec![0; 64])).is_empty());
    }

    #[test]
    fn a_long_state_file_is_stored_in_page_chunks_ending_with_a_shorter_one() {
        // 20000 bytes of data, 20004 of file: 8192, 8192, 3620.
        let data = prepare_data(9, 20_000);
        let out = values_of(&xact_record(0x10, 9, data.clone()));
        let lens: Vec<usize> = out.iter().map(|(_, b)| b.len()).collect();
        assert_eq!(lens, vec![8192, 8192, 3620]);
        assert_eq!(
            out.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            (0..3).map(|c| keys::two_phase_key(9, c)).collect::<Vec<_>>()
        );
        let file: Vec<u8> = out.iter().flat_map(|(_, b)| b.iter().copied()).collect();
        assert_eq!(&file[..20_000], &data[..]);
        // A file of exactly two pages ends with an empty chunk.
        let out = values_of(&xact_record(0x10, 9, prepare_data(9, 2 * 8192 - 4)));
        assert_eq!(out.iter().map(|(_, b)| b.len()).collect::<Vec<_>>(), vec![8192, 8192, 0]);
    }

    #[test]
    fn a_prepare_that_is_not_postgres_15s_state_is_an_error() {
        let good = prepare_data(9, 64);
        for cut in 0..12 {
            let rec = xact_record(0x10, 9, good[..cut].to_vec());
            assert!(two_phase_values(&rec, None, &mut Vec::new()).is_err(), "{cut} bytes");
        }
        let mut bad_magic = good.clone();
        bad_magic[0] ^= 1;
        let mut no_xid = good.clone();
        no_xid[8..12].copy_from_slice(&[0; 4]);
        let mut bad_len = good.clone();
        bad_len[4..8].copy_from_slice(&64u32.to_le_bytes());
        for data in [bad_magic, no_xid, bad_len] {
            assert!(two_phase_values(&xact_record(0x10, 9, data), None, &mut Vec::new()).is_err());
        }
        assert!(two_phase_values(&xact_record(0x10, 9, good), None, &mut Vec::new()).is_ok());
    }
}
