//! `pagectl redocheck`: checks the redo child's PostgreSQL 15 redo against PostgreSQL's own
//! pages, record by record, and times it.
//!
//! It reads WAL written with `wal_consistency_checking` (every record carries, for each block
//! it changes, PostgreSQL's page after the record: a "check image"), turns each record into the
//! values the daemon stores (`wal_receiver::values`), and for each block value that is a
//! record applies it with the child's redo (`walredo_proc::pg15::redo`) to the page the block
//! had after its previous record (PostgreSQL's check image of that record, so that one wrong
//! record does not hide or cause the next), then compares the result with this record's check
//! image, both masked as PostgreSQL's `heap_mask` and `btree_mask` mask them. An applied
//! full-page image becomes the block's page; a derived visibility-map clear is applied to the
//! map page it is for (there is no check image of it: the map page's next record checks it).
//!
//! Prints one JSON object: per record type (`Heap INSERT`, ...) the block values `checked`,
//! `matched`, `unsupported`, `failed` (the redo returned another error), `no_base` (no page
//! known before the record: the first record of a block that is not a full-page image or an
//! initialisation), and the median nanoseconds of one apply; then the first differences
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
use pageserver::storage::Value;
use pageserver::tenant::wal_receiver::values;
use walredo_proc::page::{Page, BLCKSZ};
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

const RM_HEAP2: u8 = 9;
const RM_HEAP: u8 = 10;
const RM_BTREE: u8 = 11;

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
            (
                kind.clone(),
                serde_json::json!({
                    "checked": s.checked, "matched": s.matched, "unsupported": s.unsupported,
                    "failed": s.failed, "no_base": s.no_base, "median_apply_ns": median,
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
    values::block_values(rec, &mut out).with_context(|| format!("values of the record at {}", rec.lsn))?;
    let kind = walredo_proc::pg15::record_type_name(rec.rmid, rec.info);
    for (key, _, value) in out {
        let block = rec.blocks.iter().find(|b| values::key_of(b) == key);
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
                            match first_difference(rec.rmid, &page, check) {
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

/// The first byte at which `ours` and PostgreSQL's `theirs` differ once both are masked as
/// PostgreSQL masks pages of `rmid`'s records; `None` if they match.
fn first_difference(rmid: u8, ours: &Page, theirs: &[u8]) -> Option<usize> {
    let mut a = ours.to_vec();
    let mut b = theirs.to_vec();
    for page in [&mut a, &mut b] {
        match rmid {
            RM_HEAP | RM_HEAP2 => heap_mask(page),
            RM_BTREE => btree_mask(page),
            _ => mask_lsn_and_checksum(page),
        }
    }
    a.iter().zip(b.iter()).position(|(x, y)| x != y)
}

fn u16_at(page: &[u8], at: usize) -> usize {
    page.get(at..at + 2).map_or(0, |b| usize::from(u16::from_le_bytes([b[0], b[1]])))
}

fn mask_lsn_and_checksum(page: &mut [u8]) {
    page[..8].fill(0);
    page[8..10].fill(0);
}

/// `mask_page_hint_bits`: pd_prune_xid, and PD_PAGE_FULL, PD_HAS_FREE_LINES, PD_ALL_VISIBLE.
fn mask_hint_bits(page: &mut [u8]) {
    page[20..24].fill(0);
    page[10] &= !0x07;
}

/// `mask_unused_space`: the hole between pd_lower and pd_upper, if the header is sane.
fn mask_unused_space(page: &mut [u8]) {
    let (lower, upper, special) = (u16_at(page, 12), u16_at(page, 14), u16_at(page, 16));
    if lower >= 24 && lower <= upper && upper <= special && special <= BLCKSZ {
        page[lower..upper].fill(0);
    }
}

/// The line pointers of a page: (offset, flags, length).
fn line_pointers(page: &[u8]) -> Vec<(usize, u8, usize)> {
    let lower = u16_at(page, 12).clamp(24, BLCKSZ);
    (24..lower)
        .step_by(4)
        .filter_map(|at| page.get(at..at + 4))
        .map(|b| {
            let raw = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            ((raw & 0x7fff) as usize, ((raw >> 15) & 3) as u8, (raw >> 17) as usize)
        })
        .collect()
}

/// `heap_mask` (heapam.c): LSN, checksum, hint bits, the hole; per normal tuple the infomask
/// hint bits (all transaction bits of a tuple whose xmin is not frozen; XMAX_INVALID and
/// XMAX_COMMITTED of a frozen one), t_cid, and the padding after each tuple.
fn heap_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    mask_unused_space(page);
    // (A speculative insertion's token in t_ctid is not masked: INSERT .. ON CONFLICT only.)
    for (off, flags, len) in line_pointers(page) {
        let has_storage = len > 0;
        if flags == 1 && off + 23 <= BLCKSZ {
            let infomask = u16_at(page, off + 20) as u16;
            let frozen = infomask & 0x0300 == 0x0300;
            let masked = if frozen { infomask & !0x0800 & !0x0400 } else { infomask & !0xFFF0 };
            page[off + 20..off + 22].copy_from_slice(&masked.to_le_bytes());
            page[off + 8..off + 12].fill(0);
        }
        if has_storage {
            let end = off + len;
            let padded = (end + 7) & !7;
            if padded <= BLCKSZ {
                page[end..padded].fill(0);
            }
        }
    }
}

/// `btree_mask` (PostgreSQL 15's nbtxlog.c): LSN, checksum, hint bits, the hole; a leaf's line
/// pointer flags; BTP_HAS_GARBAGE, BTP_SPLIT_END and the cycle id. (Before PostgreSQL 14 it also
/// masked a deleted page's content; 15 keeps it, with the page's safexid.)
fn btree_mask(page: &mut [u8]) {
    mask_lsn_and_checksum(page);
    mask_hint_bits(page);
    mask_unused_space(page);
    let special = u16_at(page, 16);
    if special + 16 > BLCKSZ || special < 24 {
        return;
    }
    let flags = u16_at(page, special + 12) as u16;
    if flags & 0x01 != 0 {
        let lower = u16_at(page, 12).clamp(24, BLCKSZ);
        for at in (24..lower).step_by(4) {
            if at + 4 <= BLCKSZ {
                let raw = u32::from_le_bytes([page[at], page[at + 1], page[at + 2], page[at + 3]]);
                if (raw >> 15) & 3 != 0 {
                    let unused = raw & !(3 << 15);
                    page[at..at + 4].copy_from_slice(&unused.to_le_bytes());
                }
            }
        }
    }
    let special = u16_at(page, 16);
    if special + 16 <= BLCKSZ && special >= 24 {
        let flags = u16_at(page, special + 12) as u16 & !0x40 & !0x20;
        page[special + 12..special + 14].copy_from_slice(&flags.to_le_bytes());
        page[special + 14..special + 16].fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_mask_ignores_hint_bits_of_unfrozen_tuples_but_not_their_data() {
        let mut page = vec![0u8; BLCKSZ];
        page[12..14].copy_from_slice(&28u16.to_le_bytes());
        page[14..16].copy_from_slice(&8000u16.to_le_bytes());
        page[16..18].copy_from_slice(&8192u16.to_le_bytes());
        // One normal tuple of 30 bytes at 8000.
        let lp: u32 = 8000 | (1 << 15) | (30 << 17);
        page[24..28].copy_from_slice(&lp.to_le_bytes());
        let mut other = page.clone();
        other[8000 + 21] = 0x01; // a hint bit: XMIN_COMMITTED, 0x0100 (t_infomask's high byte)
        other[8000 + 31] = 9; // padding after 30 bytes
        other[100] = 5; // the hole
        assert_eq!(first_difference(RM_HEAP, &to_page(&page).unwrap(), &other), None);
        other[8000 + 25] = 1; // tuple data
        assert!(first_difference(RM_HEAP, &to_page(&page).unwrap(), &other).is_some());
    }
}
