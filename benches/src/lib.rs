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
//!
//! The `pg15-*` workloads ([`Pg15Chain`]) are real PostgreSQL 15 WAL: a block's page and the
//! next 1, 10 or 100 record values of that block as the daemon stores them, read from the
//! fixtures in `benches/data/` (made with `pagectl chain`, see `benches/data/README.md`): a hot
//! heap page (`pg15-heap-*`: HOT updates, locks, a prune), a btree leaf (`pg15-btree-*`:
//! inserts and posting-list splits), a GIN posting-tree leaf (`pg15-gin-*`: item pointers
//! inserted, one VACUUM) and a GiST leaf (`pg15-gist-*`: entries inserted, one VACUUM). Their
//! expected page is computed here with the child's own redo (`walredo_proc::pg15::redo::apply`),
//! which is exactly what the child returns; loading checks that it equals PostgreSQL's page of
//! the fixture once both are masked as PostgreSQL masks them (`walredo_proc::pg15::mask`), and
//! fails otherwise.
//!
//! [`contending_threads`] and [`at_once`] are shared by the benches of work that threads do at
//! once on shared state (`bench_metrics`, `bench_shared_lines`).

use std::path::PathBuf;

use anyhow::{bail, ensure, Context};
use bytes::Bytes;
use page_types::{BufferTag, Lsn};
use walredo_proc::page::{Page, BLCKSZ};
use walredo_proc::pg15::{mask, redo, Pg15Record};
use walredo_proc::protocol::{self, HEADER_LEN};
use walredo_proc::record::Record;

/// The request shapes of the bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkloadKind {
    /// `H`: the child answers a zero page without doing anything.
    Ping,
    /// No base image; init page plus one insert of [`SHORT_TUPLE_LEN`] bytes (about 1.1 KB).
    Short,
    /// A base image, one large put-bytes and [`MEDIUM_SMALL_RECORDS`] small tuple records
    /// (about 26 KB).
    Medium,
    /// A base image and a chain of real PostgreSQL 15 records of its block, from a fixture.
    Pg15(Pg15Chain),
}

impl WorkloadKind {
    /// The synthetic workloads (the `pg15-*` ones are [`Pg15Chain::ALL`]).
    pub const ALL: [WorkloadKind; 3] = [WorkloadKind::Ping, WorkloadKind::Short, WorkloadKind::Medium];

    /// The name in benchmark ids: `ping`, `short`, `medium`, `pg15-heap-10`, ...
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::Ping => "ping",
            WorkloadKind::Short => "short",
            WorkloadKind::Medium => "medium",
            WorkloadKind::Pg15(chain) => chain.name(),
        }
    }
}

/// The fixtures of the `pg15-*` workloads: a page and its next 1, 10 or 100 records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pg15Chain {
    /// pgbench_branches block 0 during the pgbench run: HOT updates, row locks, a prune.
    Heap1,
    Heap10,
    Heap100,
    /// A leaf of `mix_k` during an insert of duplicates: inserts and posting-list splits.
    Btree1,
    Btree10,
    Btree100,
    /// The rightmost leaf of a GIN posting tree (`garr_a`, fastupdate off): item pointers
    /// appended by inserts, and in the 100 a VACUUM that removes those of deleted rows.
    Gin1,
    Gin10,
    Gin100,
    /// A GiST leaf of points (`gpt_p`): entries inserted one by one, and in the 100 a VACUUM
    /// that removes those of deleted rows.
    Gist1,
    Gist10,
    Gist100,
}

impl Pg15Chain {
    /// Every chain, by family (heap, btree, GIN, GiST), each family as 1, 10, 100 records.
    pub const ALL: [Pg15Chain; 12] = [
        Pg15Chain::Heap1,
        Pg15Chain::Heap10,
        Pg15Chain::Heap100,
        Pg15Chain::Btree1,
        Pg15Chain::Btree10,
        Pg15Chain::Btree100,
        Pg15Chain::Gin1,
        Pg15Chain::Gin10,
        Pg15Chain::Gin100,
        Pg15Chain::Gist1,
        Pg15Chain::Gist10,
        Pg15Chain::Gist100,
    ];

    /// The name in benchmark ids.
    pub fn name(self) -> &'static str {
        match self {
            Pg15Chain::Heap1 => "pg15-heap-1",
            Pg15Chain::Heap10 => "pg15-heap-10",
            Pg15Chain::Heap100 => "pg15-heap-100",
            Pg15Chain::Btree1 => "pg15-btree-1",
            Pg15Chain::Btree10 => "pg15-btree-10",
            Pg15Chain::Btree100 => "pg15-btree-100",
            Pg15Chain::Gin1 => "pg15-gin-1",
            Pg15Chain::Gin10 => "pg15-gin-10",
            Pg15Chain::Gin100 => "pg15-gin-100",
            Pg15Chain::Gist1 => "pg15-gist-1",
            Pg15Chain::Gist10 => "pg15-gist-10",
            Pg15Chain::Gist100 => "pg15-gist-100",
        }
    }

    /// Records in the chain.
    pub fn records(self) -> usize {
        match self {
            Pg15Chain::Heap1 | Pg15Chain::Btree1 | Pg15Chain::Gin1 | Pg15Chain::Gist1 => 1,
            Pg15Chain::Heap10 | Pg15Chain::Btree10 | Pg15Chain::Gin10 | Pg15Chain::Gist10 => 10,
            Pg15Chain::Heap100 | Pg15Chain::Btree100 | Pg15Chain::Gin100 | Pg15Chain::Gist100 => 100,
        }
    }

    /// The fixture file, under this crate's directory.
    pub fn path(self) -> PathBuf {
        let file = match self {
            Pg15Chain::Heap1 => "pg15-heap-chain-1.bin",
            Pg15Chain::Heap10 => "pg15-heap-chain-10.bin",
            Pg15Chain::Heap100 => "pg15-heap-chain-100.bin",
            Pg15Chain::Btree1 => "pg15-btree-chain-1.bin",
            Pg15Chain::Btree10 => "pg15-btree-chain-10.bin",
            Pg15Chain::Btree100 => "pg15-btree-chain-100.bin",
            Pg15Chain::Gin1 => "pg15-gin-chain-1.bin",
            Pg15Chain::Gin10 => "pg15-gin-chain-10.bin",
            Pg15Chain::Gin100 => "pg15-gin-chain-100.bin",
            Pg15Chain::Gist1 => "pg15-gist-chain-1.bin",
            Pg15Chain::Gist10 => "pg15-gist-chain-10.bin",
            Pg15Chain::Gist100 => "pg15-gist-chain-100.bin",
        };
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data").join(file)
    }
}

/// The first bytes of a chain fixture (`pagectl chain` writes them).
pub const CHAIN_MAGIC: &[u8; 8] = b"PG15CHN1";

/// A chain fixture as `pagectl chain` writes it, little-endian: `magic "PG15CHN1" | base page
/// (8192) | n u32 | n x (lsn u64 | len u32 | pg15 value bytes) | expected page (8192)`.
#[derive(Debug, Clone)]
pub struct ChainFile {
    /// The block's page before the chain (`pd_lsn` set to where it was taken).
    pub base: Box<Page>,
    /// The record values, at their LSNs (each its record's end LSN), in order.
    pub records: Vec<(Lsn, Bytes)>,
    /// PostgreSQL's page after the last record (its consistency-check image, unmasked).
    pub postgres_page: Box<Page>,
}

impl ChainFile {
    pub fn read(path: &std::path::Path) -> anyhow::Result<ChainFile> {
        let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
        ChainFile::parse(&bytes).with_context(|| format!("parse {}", path.display()))
    }

    pub fn parse(bytes: &[u8]) -> anyhow::Result<ChainFile> {
        let mut at = 0usize;
        let mut take = |n: usize| -> anyhow::Result<&[u8]> {
            let end = at.checked_add(n).filter(|end| *end <= bytes.len()).context("truncated")?;
            let out = &bytes[at..end];
            at = end;
            Ok(out)
        };
        ensure!(take(CHAIN_MAGIC.len())? == CHAIN_MAGIC, "not a chain fixture (magic)");
        let base = to_page(take(BLCKSZ)?)?;
        let n = u32::from_le_bytes(take(4)?.try_into().context("n")?);
        let mut records = Vec::new();
        for _ in 0..n {
            let lsn = u64::from_le_bytes(take(8)?.try_into().context("lsn")?);
            let len = u32::from_le_bytes(take(4)?.try_into().context("len")?);
            let value = take(usize::try_from(len).context("len")?)?;
            records.push((Lsn(lsn), Bytes::copy_from_slice(value)));
        }
        let postgres_page = to_page(take(BLCKSZ)?)?;
        ensure!(take(1).is_err(), "trailing bytes after the expected page");
        Ok(ChainFile { base, records, postgres_page })
    }
}

fn to_page(bytes: &[u8]) -> anyhow::Result<Box<Page>> {
    let page: &Page = bytes.try_into().context("a page")?;
    Ok(Box::new(*page))
}

/// Applies pg15 record values to `page` with the child's redo, as the child does.
pub fn apply_pg15(page: &mut Page, records: &[(Lsn, Bytes)]) -> anyhow::Result<()> {
    for (lsn, value) in records {
        match redo::apply(value, page) {
            Some(Ok(())) => {}
            Some(Err(e)) => bail!("apply the record at {lsn}: {e}"),
            None => bail!("the value at {lsn} is not of the pg15 family"),
        }
    }
    Ok(())
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
    /// The block the request is for ([`TAG`], or the fixture's block for `pg15-*`).
    pub tag: BufferTag,
    /// The request LSN (that of the last record).
    pub lsn: Lsn,
    pub base: Option<Bytes>,
    pub records: Vec<(Lsn, Bytes)>,
    /// The page the child must return.
    pub expected: Bytes,
    /// The request as written to the child's stdin.
    pub wire: Vec<u8>,
}

impl Workload {
    /// Builds the workload; panics only if the record recipes themselves are wrong (a bug here),
    /// or for `pg15-*` if its fixture does not load (see [`Workload::pg15`]).
    pub fn new(kind: WorkloadKind) -> Workload {
        let (base, records): (Option<Box<Page>>, Vec<Vec<u8>>) = match kind {
            WorkloadKind::Ping => (None, Vec::new()),
            WorkloadKind::Short => (None, short_records()),
            WorkloadKind::Medium => (Some(medium_base()), medium_records()),
            WorkloadKind::Pg15(chain) => {
                return Workload::pg15(chain).unwrap_or_else(|e| panic!("load {}: {e:#}", chain.name()))
            }
        };
        let records: Vec<(Lsn, Bytes)> = records
            .into_iter()
            .enumerate()
            .map(|(i, record)| (Lsn(BASE_LSN + LSN_STEP * (i as u64 + 1)), Bytes::from(record)))
            .collect();
        let lsn = records.last().map_or(Lsn(BASE_LSN), |(lsn, _)| *lsn);

        let mut page: Box<Page> = base.clone().unwrap_or_else(|| Box::new([0; BLCKSZ]));
        for (record_lsn, record) in &records {
            Record::decode(record)
                .expect("bench records decode")
                .apply(&mut page, record_lsn.0)
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
                protocol::encode_apply_raw(&mut wire, record_lsn.0, record);
            }
            protocol::encode_get_page(&mut wire, &TAG);
        }

        Workload {
            kind,
            tag: TAG,
            lsn,
            base: base.map(|page| Bytes::copy_from_slice(&page[..])),
            records,
            expected: Bytes::copy_from_slice(&page[..]),
            wire,
        }
    }
}

impl Workload {
    /// Loads a `pg15-*` workload from its fixture: the block's page as the base image, the
    /// record values, the request for the fixture's block, and the page the child must return,
    /// computed with the child's redo; fails if that page is not PostgreSQL's (masked).
    pub fn pg15(chain: Pg15Chain) -> anyhow::Result<Workload> {
        let file = ChainFile::read(&chain.path())?;
        ensure!(
            file.records.len() == chain.records(),
            "{} records, {} expected",
            file.records.len(),
            chain.records()
        );
        let (lsn, last) = file.records.last().context("no records")?;
        let first = Pg15Record::decode(&file.records[0].1).context("decode the first record")?;
        let block = first.blocks.iter().find(|b| b.id == first.target).context("the target block")?;
        let tag = BufferTag {
            spcnode: block.spcnode,
            dbnode: block.dbnode,
            relnode: block.relnode,
            forknum: block.fork,
            blknum: block.blkno,
        };
        let rmid = Pg15Record::decode(last).context("decode the last record")?.rmid;

        let mut page = file.base.clone();
        apply_pg15(&mut page, &file.records)?;
        if let Some(at) = mask::first_difference(rmid, &page[..], &file.postgres_page[..]) {
            bail!("the redo of the chain differs from PostgreSQL's page at byte {at} (masked)");
        }

        let mut wire = Vec::new();
        protocol::encode_begin(&mut wire, &tag);
        protocol::encode_push_page(&mut wire, &tag, &file.base);
        for (record_lsn, record) in &file.records {
            protocol::encode_apply_raw(&mut wire, record_lsn.0, record);
        }
        protocol::encode_get_page(&mut wire, &tag);

        Ok(Workload {
            kind: WorkloadKind::Pg15(chain),
            tag,
            lsn: *lsn,
            base: Some(Bytes::copy_from_slice(&file.base[..])),
            records: file.records,
            expected: Bytes::copy_from_slice(&page[..]),
            wire,
        })
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

/// An operation, called with a number that differs from call to call and thread to thread.
pub type Op = std::sync::Arc<dyn Fn(u64) + Send + Sync>;

/// `iters` calls of `op` on each of `threads` threads at once, each thread inside `runtime`;
/// the time of the slowest thread (for criterion's `iter_custom`).
pub fn at_once(threads: usize, iters: u64, runtime: &tokio::runtime::Handle, op: &Op) -> std::time::Duration {
    let start = std::sync::Arc::new(std::sync::Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (start, op, runtime) =
                (std::sync::Arc::clone(&start), std::sync::Arc::clone(op), runtime.clone());
            std::thread::spawn(move || {
                let _runtime = runtime.enter();
                start.wait();
                let began = std::time::Instant::now();
                for i in 0..iters {
                    op(i * 7 + t as u64);
                }
                began.elapsed()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("a bench thread panicked")).max().unwrap_or_default()
}

/// The thread counts of the benches of work on shared state: 1 and 2, and the machine's CPUs
/// where it has more (16 on the lent 16-core machine, where `many_cores.sh` runs them).
pub fn contending_threads() -> Vec<usize> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut threads = vec![1, 2];
    if cpus > 2 {
        threads.push(cpus);
    }
    threads
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
        assert_eq!(Lsn(walredo_proc::page::page_lsn(page)), short.lsn);
        assert_eq!(walredo_proc::page::pd_lower(page), 28);
        let medium = Workload::new(WorkloadKind::Medium);
        let page: &Page = medium.expected.as_ref().try_into().expect("a page");
        assert_eq!(Lsn(walredo_proc::page::page_lsn(page)), medium.lsn);
        assert_eq!(
            usize::from(walredo_proc::page::pd_lower(page)),
            24 + 4 * (MEDIUM_BASE_TUPLES + MEDIUM_SMALL_RECORDS / 2)
        );
    }

    #[test]
    fn pg15_workloads_load_with_their_record_counts_and_sizes() {
        for chain in Pg15Chain::ALL {
            let w = Workload::new(WorkloadKind::Pg15(chain));
            assert_eq!(w.records.len(), chain.records(), "{}", chain.name());
            assert!(w.base.is_some());
            assert_eq!(w.lsn, w.records.last().expect("records").0);
            // B + P (a page) + one A per record + G; pg15 values of these records are small (65-95
            // bytes; a prune or a VACUUM's removal carries its offsets or segments: a few hundred).
            let values: usize = w.records.iter().map(|(_, r)| r.len()).sum();
            assert!(values < 100 * chain.records(), "{}: {values} bytes of values", chain.name());
            assert!(
                w.wire.len() > BLCKSZ + values
                    && w.wire.len() < BLCKSZ + values + 100 * (chain.records() + 4),
                "{}: {} bytes on the wire",
                chain.name(),
                w.wire.len()
            );
            let size = std::fs::metadata(chain.path()).expect("the fixture").len();
            assert!(size < 40_000, "{}: the fixture is {size} bytes", chain.name());
        }
    }

    #[test]
    fn pg15_expected_page_is_the_redo_of_the_fixture_and_postgres_page_masked() {
        for chain in Pg15Chain::ALL {
            let w = Workload::new(WorkloadKind::Pg15(chain));
            let file = ChainFile::read(&chain.path()).expect("the fixture");
            let mut page = file.base.clone();
            apply_pg15(&mut page, &file.records).expect("the chain applies");
            assert!(w.expected[..] == page[..], "{}", chain.name());
            let rmid = Pg15Record::decode(&file.records[0].1).expect("a pg15 record").rmid;
            assert_eq!(
                mask::first_difference(rmid, &page[..], &file.postgres_page[..]),
                None,
                "{}",
                chain.name()
            );
            // The chain changes the page: the masked base is not already the result.
            assert!(mask::first_difference(rmid, &file.base[..], &file.postgres_page[..]).is_some());
            assert_eq!(Lsn(walredo_proc::page::page_lsn(&page)), w.lsn, "{}: pd_lsn", chain.name());
        }
    }

    #[test]
    fn pg15_chains_of_a_family_are_for_one_block_and_share_their_base() {
        let families: Vec<Vec<Workload>> = Pg15Chain::ALL
            .chunks(3)
            .map(|family| family.iter().map(|&c| Workload::new(WorkloadKind::Pg15(c))).collect())
            .collect();
        assert_eq!(families.len(), 4, "heap, btree, GIN, GiST");
        for family in &families {
            assert_eq!(family.iter().map(|w| w.records.len()).collect::<Vec<_>>(), [1, 10, 100]);
            assert!(family.iter().all(|w| w.tag == family[0].tag && w.base == family[0].base));
            // A shorter chain is the start of the longer one.
            assert!(family[2].records.starts_with(&family[1].records));
            assert!(family[1].records.starts_with(&family[0].records));
        }
        // Four blocks, and each family's records are of its own access method.
        let tags: std::collections::HashSet<BufferTag> = families.iter().map(|f| f[0].tag).collect();
        assert_eq!(tags.len(), 4);
        let rmids: Vec<u8> = families
            .iter()
            .map(|f| Pg15Record::decode(&f[2].records[0].1).expect("a pg15 record").rmid)
            .collect();
        use walredo_proc::pg15::redo::{RM_BTREE, RM_GIN, RM_GIST, RM_HEAP};
        assert_eq!(rmids, [RM_HEAP, RM_BTREE, RM_GIN, RM_GIST]);
    }

    #[test]
    fn chain_file_refuses_a_wrong_magic_a_truncated_file_and_trailing_bytes() {
        let good = std::fs::read(Pg15Chain::Heap1.path()).expect("the fixture");
        assert!(ChainFile::parse(&good).is_ok());
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(ChainFile::parse(&bad).is_err());
        assert!(ChainFile::parse(&good[..good.len() - 1]).is_err());
        let mut long = good;
        long.push(0);
        assert!(ChainFile::parse(&long).is_err());
    }
}
