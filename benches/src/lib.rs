//! The workloads of `bench_walredo`: the requests it sends, their exact wire bytes, and the
//! page each one must produce.
//!
//! They live in a library (not in the bench file) so that their sizes are checked by plain unit
//! tests (`cargo test -p benches`) and so that the floor (`floor/echo*`) sends byte for byte the
//! request the manager would send for the same workload.
//!
//! Invariants:
//! - [`Workload::wire`] is what `WalRedoManager::request_redo` writes for the workload (the
//!   protocol's own encoders, `B [P] A* G`), or the 5-byte `H` ping;
//! - [`Workload::expected`] is computed here, without the child, by applying the records with
//!   `Record::apply`; a bench that gets another page from the child fails instead of reporting;
//! - `short` serializes to about 1.1 KB and `medium` to about 26 KB (see the tests), the sizes of
//!   Neon's `short` and `medium` workloads.

use bytes::Bytes;
use walredo_proc::page::{Page, BLCKSZ};
use walredo_proc::protocol::{self, BufferTag, HEADER_LEN};
use walredo_proc::record::Record;

/// The three request shapes of the bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    /// `H`: the child answers a zero page without doing anything.
    Ping,
    /// No base image; init page plus one insert of [`SHORT_TUPLE_LEN`] bytes (about 1.1 KB).
    Short,
    /// A base image, one large put-bytes and [`MEDIUM_SMALL_RECORDS`] small tuple records
    /// (about 26 KB).
    Medium,
}

impl WorkloadKind {
    pub const ALL: [WorkloadKind; 3] = [WorkloadKind::Ping, WorkloadKind::Short, WorkloadKind::Medium];

    /// The name in benchmark ids: `ping`, `short`, `medium`.
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Ping => "ping",
            WorkloadKind::Short => "short",
            WorkloadKind::Medium => "medium",
        }
    }
}

/// Data bytes of the one tuple of `short`.
pub const SHORT_TUPLE_LEN: usize = 1024;
/// Bytes of the one large put-bytes of `medium`.
pub const MEDIUM_LARGE_LEN: usize = 7100;
/// Small records (inserts and in-place updates, alternating) of `medium`.
pub const MEDIUM_SMALL_RECORDS: usize = 100;
/// Data bytes of each small record of `medium`.
pub const MEDIUM_SMALL_LEN: usize = 88;
/// Tuples already in the base image of `medium`.
const MEDIUM_BASE_TUPLES: usize = 10;
/// Length of a page reply frame: header and page.
pub const PAGE_REPLY_LEN: usize = HEADER_LEN + BLCKSZ;

/// The block every workload reconstructs.
pub const TAG: BufferTag = BufferTag { spcnode: 1663, dbnode: 13008, relnode: 16384, forknum: 0, blknum: 42 };
/// LSN of the base image; records follow at [`LSN_STEP`] intervals.
const BASE_LSN: u64 = 0x0000_0001_0000_0000;
const LSN_STEP: u64 = 0x40;

/// One request of the bench, ready to send through the manager or the raw pipes.
#[derive(Debug, Clone)]
pub struct Workload {
    pub kind: WorkloadKind,
    /// The request LSN (that of the last record).
    pub lsn: u64,
    pub base: Option<Bytes>,
    pub records: Vec<(u64, Bytes)>,
    /// The page the child must return.
    pub expected: Bytes,
    /// The request as written to the child's stdin.
    pub wire: Vec<u8>,
}

impl Workload {
    /// Builds the workload; panics only if the record recipes themselves are wrong (a bug here).
    pub fn new(kind: WorkloadKind) -> Workload {
        let (base, records): (Option<Box<Page>>, Vec<Vec<u8>>) = match kind {
            WorkloadKind::Ping => (None, Vec::new()),
            WorkloadKind::Short => (None, short_records()),
            WorkloadKind::Medium => (Some(medium_base()), medium_records()),
        };
        let records: Vec<(u64, Bytes)> = records
            .into_iter()
            .enumerate()
            .map(|(i, record)| (BASE_LSN + LSN_STEP * (i as u64 + 1), Bytes::from(record)))
            .collect();
        let lsn = records.last().map_or(BASE_LSN, |(lsn, _)| *lsn);

        let mut page: Box<Page> = base.clone().unwrap_or_else(|| Box::new([0; BLCKSZ]));
        for (record_lsn, record) in &records {
            Record::decode(record)
                .expect("bench records decode")
                .apply(&mut page, *record_lsn)
                .expect("bench records apply to their page");
        }

        let mut wire = Vec::new();
        if kind == WorkloadKind::Ping {
            protocol::encode_ping(&mut wire);
        } else {
            protocol::encode_begin(&mut wire, &TAG);
            if let Some(base) = &base {
                protocol::encode_push_page(&mut wire, &TAG, base);
            }
            for (record_lsn, record) in &records {
                protocol::encode_apply_raw(&mut wire, *record_lsn, record);
            }
            protocol::encode_get_page(&mut wire, &TAG);
        }

        Workload {
            kind,
            lsn,
            base: base.map(|page| Bytes::copy_from_slice(&page[..])),
            records,
            expected: Bytes::copy_from_slice(&page[..]),
            wire,
        }
    }
}

fn encode(record: Record<'_>) -> Vec<u8> {
    record.encode_to_vec()
}

/// Init page, then one insert of a 1 KiB tuple.
fn short_records() -> Vec<Vec<u8>> {
    let tuple = pattern(SHORT_TUPLE_LEN, 1);
    vec![
        encode(Record::InitPage { special_size: 16 }),
        encode(Record::InsertTuple { offnum: 0, data: &tuple }),
    ]
}

/// A page with a special space and [`MEDIUM_BASE_TUPLES`] tuples, as a base image.
fn medium_base() -> Box<Page> {
    let mut page: Box<Page> = Box::new([0; BLCKSZ]);
    Record::InitPage { special_size: 16 }.apply(&mut page, BASE_LSN - 1).expect("init the base page");
    for i in 0..MEDIUM_BASE_TUPLES {
        let tuple = pattern(80, i as u8);
        Record::InsertTuple { offnum: 0, data: &tuple }
            .apply(&mut page, BASE_LSN)
            .expect("fill the base page");
    }
    page
}

/// One large put-bytes into the free space (like a full-page-write blob), then inserts and
/// in-place updates of the new tuples, alternating.
fn medium_records() -> Vec<Vec<u8>> {
    let mut records = Vec::with_capacity(1 + MEDIUM_SMALL_RECORDS);
    // The base page has pd_lower = 24 + 4 * 10 = 64 and pd_upper = 8176 - 10 * 80 = 7376: the
    // blob stays inside the free space, so the base tuples keep their data.
    records.push(encode(Record::PutBytes { offset: 272, data: &pattern(MEDIUM_LARGE_LEN, 7) }));
    for i in 0..MEDIUM_SMALL_RECORDS / 2 {
        let offnum = (MEDIUM_BASE_TUPLES + i + 1) as u16;
        records.push(encode(Record::InsertTuple { offnum: 0, data: &pattern(MEDIUM_SMALL_LEN, i as u8) }));
        records.push(encode(Record::UpdateTuple { offnum, data: &pattern(MEDIUM_SMALL_LEN, !(i as u8)) }));
    }
    records
}

/// `len` bytes that differ from one seed to the next and are not all zero.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_request_is_about_1_1_kb() {
        let short = Workload::new(WorkloadKind::Short);
        assert_eq!(short.records.len(), 2);
        assert!(short.base.is_none());
        assert!((1050..=1150).contains(&short.wire.len()), "short request is {} bytes", short.wire.len());
    }

    #[test]
    fn medium_request_is_about_26_kb_with_many_small_records_and_one_large() {
        let medium = Workload::new(WorkloadKind::Medium);
        assert!(medium.base.is_some());
        assert_eq!(medium.records.len(), 1 + MEDIUM_SMALL_RECORDS);
        let large = medium.records.iter().filter(|(_, r)| r.len() > 4096).count();
        assert_eq!(large, 1);
        assert!(
            (25_000..=27_000).contains(&medium.wire.len()),
            "medium request is {} bytes",
            medium.wire.len()
        );
    }

    #[test]
    fn ping_is_the_five_byte_h_frame_and_expects_a_zero_page() {
        let ping = Workload::new(WorkloadKind::Ping);
        assert_eq!(ping.wire, b"H\0\0\0\x04");
        assert!(ping.expected.iter().all(|&b| b == 0));
    }

    #[test]
    fn expected_pages_carry_the_request_lsn_and_the_written_tuples() {
        let short = Workload::new(WorkloadKind::Short);
        let page: &Page = short.expected.as_ref().try_into().expect("a page");
        assert_eq!(walredo_proc::page::page_lsn(page), short.lsn);
        assert_eq!(walredo_proc::page::pd_lower(page), 28);
        let medium = Workload::new(WorkloadKind::Medium);
        let page: &Page = medium.expected.as_ref().try_into().expect("a page");
        assert_eq!(walredo_proc::page::page_lsn(page), medium.lsn);
        assert_eq!(
            usize::from(walredo_proc::page::pd_lower(page)),
            24 + 4 * (MEDIUM_BASE_TUPLES + MEDIUM_SMALL_RECORDS / 2)
        );
    }
}
