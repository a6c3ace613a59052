//! Redo of Sequence records (PostgreSQL 15's `seq_redo`, `commands/sequence.c`): its one
//! record type, LOG, rebuilds the sequence's only page from the record every time.
//!
//! A sequence relation is one page: `PageInit` with a 4-byte special space holding
//! `SEQ_MAGIC`, and one heap tuple (the sequence's `last_value`, `log_cnt`, `is_called`) at
//! offset 1. The record's main data is `xl_seq_rec` (the relation's `RelFileNode`, 12 bytes)
//! followed by that tuple; block 0 is the page, registered `WILL_INIT`. `nextval` logs the
//! tuple as it will be after 32 more calls (`SEQ_LOG_VALS`), so a replayed page is the
//! WAL-logged state, ahead of the primary's page between two records.
//!
//! Where PostgreSQL PANICs (an unknown operation, a tuple that does not fit the page) this
//! returns an error, and so does a record for a block other than 0 or without `WILL_INIT`
//! (PostgreSQL's `XLogInitBufferForRedo` would PANIC on the latter).
//! Invariants: pure; never panics on any record or page; on success the whole page is the
//! record's (nothing of the previous page survives).

use super::bufpage;
use super::{RedoError, Target};
use crate::page::{self, maxalign, Page, BLCKSZ};

/// `XLOG_SEQ_LOG`, the only operation (`info & 0xF0`).
pub const XLOG_SEQ_LOG: u8 = 0x00;
/// `SEQ_MAGIC`, in the special space.
pub const SEQ_MAGIC: u32 = 0x1717;
/// `sizeof(sequence_magic)`: the special space.
const SEQ_SPECIAL_SIZE: usize = 4;
/// `sizeof(xl_seq_rec)`: the relation's `RelFileNode` before the tuple.
const XL_SEQ_REC_SIZE: usize = 12;

/// Applies a Sequence record to the page of its target block.
pub fn redo(target: &Target<'_, '_>, page: &mut Page) -> Result<(), RedoError> {
    let malformed = |what: &str| RedoError::Malformed(format!("{}: {what}", target.type_name()));
    if target.record.info & 0xF0 != XLOG_SEQ_LOG {
        return Err(malformed("unknown operation"));
    }
    if target.block.id != 0 {
        return Err(malformed("the record does not change this block"));
    }
    if !target.will_init() {
        return Err(malformed("the sequence page is not marked WILL_INIT"));
    }
    let Some(tuple) = target.record.main_data.get(XL_SEQ_REC_SIZE..) else {
        return Err(malformed("main data shorter than xl_seq_rec"));
    };
    let mut local = Box::new([0u8; BLCKSZ]);
    bufpage::page_init(&mut local, SEQ_SPECIAL_SIZE);
    let special = BLCKSZ - maxalign(SEQ_SPECIAL_SIZE);
    local[special..special + 4].copy_from_slice(&SEQ_MAGIC.to_le_bytes());
    bufpage::page_add_item(&mut local, tuple, 1, false, false).map_err(|e| {
        RedoError::DoesNotFit(format!("{}: failed to add the tuple: {e}", target.type_name()))
    })?;
    page::set_page_lsn(&mut local, target.record.end_lsn);
    *page = *local;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::pg15::{redo, BlockHeader, Pg15Record, FLAG_WILL_INIT};
    use proptest::prelude::*;

    const END_LSN: u64 = 0x1_0000_0100;

    /// A sequence tuple as `nextval` logs it: a 24-byte heap tuple header (frozen xmin,
    /// XMAX_INVALID, t_hoff 24, 3 attributes) and `last_value`, `log_cnt`, `is_called`.
    fn seq_tuple(last_value: i64, log_cnt: i64, is_called: bool) -> Vec<u8> {
        let mut t = vec![0u8; 24];
        t[0..4].copy_from_slice(&2u32.to_le_bytes()); // FrozenTransactionId
        t[18..20].copy_from_slice(&3u16.to_le_bytes()); // natts
        t[20..22].copy_from_slice(&(0x0300u16 | 0x0800).to_le_bytes());
        t[22] = 24;
        t.extend_from_slice(&last_value.to_le_bytes());
        t.extend_from_slice(&log_cnt.to_le_bytes());
        t.push(u8::from(is_called));
        t
    }

    fn main_data(tuple: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        for v in [1663u32, 5, 16390] {
            m.extend_from_slice(&v.to_le_bytes());
        }
        m.extend_from_slice(tuple);
        m
    }

    fn record<'a>(info: u8, flags: u8, id: u8, main: &'a [u8]) -> Pg15Record<'a> {
        Pg15Record {
            rmid: redo::RM_SEQ,
            info,
            xid: 0,
            lsn: END_LSN - 0x50,
            end_lsn: END_LSN,
            target: id,
            blocks: vec![BlockHeader {
                id,
                flags,
                fork: 0,
                spcnode: 1663,
                dbnode: 5,
                relnode: 16390,
                blkno: 0,
                data: &[],
            }],
            main_data: main,
        }
    }

    fn apply(rec: &Pg15Record<'_>, page: &mut Page) -> Result<(), RedoError> {
        let mut bytes = Vec::new();
        rec.encode(&mut bytes).unwrap();
        redo::apply(&bytes, page).unwrap()
    }

    #[test]
    fn log_rebuilds_the_page_with_the_magic_and_the_tuple_whatever_was_there() {
        let tuple = seq_tuple(33, 0, true);
        let main = main_data(&tuple);
        // XLR_CHECK_CONSISTENCY (0x02) in the info bits does not change the operation.
        let rec = record(0x02, FLAG_WILL_INIT, 0, &main);
        let mut page = Box::new([0xAAu8; BLCKSZ]);
        page::set_page_lsn(&mut page, END_LSN + 1000);
        apply(&rec, &mut page).unwrap();
        assert_eq!(page::page_lsn(&page), END_LSN);
        assert_eq!((page::pd_lower(&page), page::pd_upper(&page), page::pd_special(&page)), (28, 8136, 8184));
        assert_eq!(page::pd_flags(&page), 0);
        assert_eq!(&page[8184..8192], &[0x17, 0x17, 0, 0, 0, 0, 0, 0]);
        assert_eq!(bufpage::page_get_item(&page, 1).unwrap(), &tuple[..]);
        assert_eq!(&page[28..8136], &vec![0u8; 8136 - 28][..], "the hole is zeros");
        assert_eq!(&page[8136 + 41..8184], &[0u8; 7], "the tuple's padding is zeros");
    }

    #[test]
    fn records_that_postgres_would_panic_on_are_errors() {
        let main = main_data(&seq_tuple(1, 32, true));
        let mut page = Box::new([0u8; BLCKSZ]);
        let cases = [
            record(0x10, FLAG_WILL_INIT, 0, &main),
            record(0x00, 0, 0, &main),
            record(0x00, FLAG_WILL_INIT, 1, &main),
            record(0x00, FLAG_WILL_INIT, 0, &main[..11]),
        ];
        for rec in &cases {
            assert!(matches!(apply(rec, &mut page), Err(RedoError::Malformed(_))), "{rec:?}");
        }
        let huge = main_data(&[7u8; 8200]);
        assert!(matches!(
            apply(&record(0, FLAG_WILL_INIT, 0, &huge), &mut page),
            Err(RedoError::DoesNotFit(_))
        ));
        assert_eq!(page[..], [0u8; BLCKSZ][..], "a failed record leaves the page");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn random_records_on_random_pages_never_panic(
            info in any::<u8>(),
            flags in any::<u8>(),
            id in 0u8..3,
            main in proptest::collection::vec(any::<u8>(), 0..200),
            long in 0usize..9000,
            fill in any::<u8>(),
        ) {
            let mut main = main;
            main.resize(main.len().max(long), 0x5A);
            let rec = record(info, flags, id, &main);
            let mut page = Box::new([fill; BLCKSZ]);
            let _ = redo(&Target { record: &rec, block: &rec.blocks[0] }, &mut page);
        }
    }
}
