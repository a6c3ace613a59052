//! `pagectl redocheck`: checks the redo child's PostgreSQL 15 redo against PostgreSQL's own
//! pages, record by record, and times it.
//!
//! It reads WAL written with `wal_consistency_checking` (every record carries, for each block
//! it changes, PostgreSQL's page after the record: a "check image"), turns each record into the
//! values the daemon stores (`ingest::wal_values`), and for each block value that is a
//! record applies it with the child's redo (`walredo_proc::pg15::redo`) to the page the block
//! had after its previous record (PostgreSQL's check image of that record, so that one wrong
//! record does not hide or cause the next), then compares the result with this record's check
//! image, both masked as PostgreSQL masks the record's resource manager's pages (its
//! `rm_mask`: `heap_mask`, `btree_mask`, `gin_mask`, `gist_mask`, `hash_mask`, `spg_mask`, `seq_mask`,
//! `generic_mask`, `brin_mask`;
//! `walredo_proc::pg15::mask`). An applied full-page image becomes the block's page; a derived
//! visibility-map clear is applied to the map page it is for (there is no check image of it:
//! the map page's next record checks it).
//!
//! Prints one JSON object: per record type (`Heap INSERT`, ...) the block values `checked`,
//! `matched`, `unsupported`, `failed` (the redo returned another error), `no_base` (no page
//! known before the record: the first record of a block that is not a full-page image or an
//! initialisation), `applied` (the values the redo applied without error), the median
//! nanoseconds of one apply and their total (`total_apply_ns`; the page copy before each apply
//! is not in it); then the first differences
//! (record type, LSN, block, first differing byte), at most `--show` of them.
//!
//! This is a development and operator tool: the tests compare the daemon's pages with
//! PostgreSQL's through their own reader and masks (test_runner/).
//!
//! Invariant: reads the files only; a page that does not match never stops the run.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use page_types::wal::DecodedRecord;
use page_types::{BufferTag, Lsn};
use pageserver::ingest::wal_values;
use pageserver::storage::Value;
use walredo_proc::page::{Page, BLCKSZ};
use walredo_proc::pg15::mask;
use walredo_proc::pg15::redo::{self, RedoError};

pub struct Args {
    pub paths: Vec<PathBuf>,
    pub start: Option<Lsn>,
    pub end: Option<Lsn>,
    /// How many differences to print.
    pub show: usize,
}

#[derive(Default)]
struct TypeStats {
    checked: u64,
    matched: u64,
    unsupported: u64,
    failed: u64,
    no_base: u64,
    nanos: Vec<u64>,
}

/// One difference from PostgreSQL's page.
struct Difference {
    kind: String,
    lsn: Lsn,
    key: BufferTag,
    what: String,
}

pub fn run(args: &Args) -> anyhow::Result<serde_json::Value> {
    let mut pages: HashMap<BufferTag, Box<Page>> = HashMap::new();
    let mut stats: BTreeMap<String, TypeStats> = BTreeMap::new();
    let mut differences: Vec<Difference> = Vec::new();
    let mut failures: Vec<Difference> = Vec::new();
    let mut records = 0u64;
    let mut error: Option<anyhow::Error> = None;
    crate::waldump::for_each_record(&args.paths, args.start, args.end, &mut |rec| {
        records += 1;
        if let Err(e) = check_record(rec, &mut pages, &mut stats, &mut differences, &mut failures, args.show)
        {
            error = Some(e);
            return false;
        }
        true
    })?;
    if let Some(e) = error {
        return Err(e);
    }
    let types: serde_json::Map<String, serde_json::Value> = stats
        .iter_mut()
        .map(|(kind, s)| {
            s.nanos.sort_unstable();
            let median = s.nanos.get(s.nanos.len() / 2).copied();
            let total: u64 = s.nanos.iter().sum();
            (
                kind.clone(),
                serde_json::json!({
                    "checked": s.checked, "matched": s.matched, "unsupported": s.unsupported,
                    "failed": s.failed, "no_base": s.no_base, "applied": s.nanos.len(),
                    "median_apply_ns": median, "total_apply_ns": total,
                }),
            )
        })
        .collect();
    let show = |list: &[Difference]| -> Vec<serde_json::Value> {
        list.iter()
            .map(|d| {
                serde_json::json!({
                    "type": d.kind, "lsn": d.lsn.to_string(), "block": d.key.to_string(), "what": d.what,
                })
            })
            .collect()
    };
    Ok(serde_json::json!({
        "records": records,
        "types": types,
        "differences": show(&differences),
        "failures": show(&failures),
    }))
}

fn check_record(
    rec: &DecodedRecord,
    pages: &mut HashMap<BufferTag, Box<Page>>,
    stats: &mut BTreeMap<String, TypeStats>,
    differences: &mut Vec<Difference>,
    failures: &mut Vec<Difference>,
    show: usize,
) -> anyhow::Result<()> {
    let mut out = Vec::new();
    wal_values::block_values(rec, &mut out)
        .with_context(|| format!("values of the record at {}", rec.lsn))?;
    let kind = walredo_proc::pg15::record_type_name(rec.rmid, rec.info);
    for (key, _, value) in out {
        let block = rec.blocks.iter().find(|b| wal_values::key_of(b) == key);
        let check = match block.and_then(|b| b.image.as_ref()) {
            Some(image) => Some(image.restore_page().with_context(|| format!("check image at {}", rec.lsn))?),
            None => None,
        };
        match value {
            Value::Image(bytes) => {
                pages.insert(key, to_page(&bytes)?);
            }
            Value::Record(bytes) => {
                let will_init = block.is_some_and(|b| b.will_init);
                let kind = if block.is_some() { kind.clone() } else { format!("{kind} (map clear)") };
                let s = stats.entry(kind.clone()).or_default();
                let mut page = match pages.get(&key) {
                    Some(page) => page.clone(),
                    None if will_init => Box::new([0u8; BLCKSZ]),
                    // A derived map clear of a page not seen yet: nothing to apply it to.
                    None if block.is_none() => continue,
                    None => {
                        s.no_base += 1;
                        if let Some(check) = &check {
                            pages.insert(key, to_page(check)?);
                        }
                        continue;
                    }
                };
                let began = Instant::now();
                let applied = redo::apply(&bytes, &mut page);
                let nanos = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
                match applied {
                    None => anyhow::bail!("the value at {} is not of the pg15 family", rec.lsn),
                    Some(Err(RedoError::Unsupported(_))) => s.unsupported += 1,
                    Some(Err(e)) => {
                        s.failed += 1;
                        if failures.len() < show {
                            failures.push(Difference {
                                kind: kind.clone(),
                                lsn: rec.lsn,
                                key,
                                what: e.to_string(),
                            });
                        }
                    }
                    Some(Ok(())) => {
                        s.nanos.push(nanos);
                        if let Some(check) = &check {
                            s.checked += 1;
                            match mask::first_difference(rec.rmid, &page[..], check) {
                                None => s.matched += 1,
                                Some(at) if differences.len() < show => differences.push(Difference {
                                    kind: kind.clone(),
                                    lsn: rec.lsn,
                                    key,
                                    what: format!("first differing byte {at} (masked)"),
                                }),
                                Some(_) => {}
                            }
                        }
                    }
                }
                // PostgreSQL's page goes on, where it has one; else ours.
                match &check {
                    Some(check) => {
                        pages.insert(key, to_page(check)?);
                    }
                    None => {
                        pages.insert(key, page);
                    }
                }
            }
        }
    }
    Ok(())
}

fn to_page(bytes: &[u8]) -> anyhow::Result<Box<Page>> {
    let page: &Page = bytes.try_into().map_err(|_| anyhow::anyhow!("a page of {} bytes", bytes.len()))?;
    Ok(Box::new(*page))
}
