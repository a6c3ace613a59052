//! `pagectl chain`: cuts a chain of real PostgreSQL 15 records of one block out of WAL written
//! with `wal_consistency_checking`, as a fixture for `bench_walredo`'s `pg15-*` workloads.
//!
//! It turns each record into the values the daemon stores (`ingest::wal_values`, as
//! `redocheck` does) and follows one block: a point where its page is known (an applied
//! full-page image, or the check image of a record of the block: PostgreSQL's page after it)
//! followed by `--records` N record values of the block, every one of the `pg15` family and
//! applied without error by the child's redo (`walredo_proc::pg15::redo`), the N-th carrying a
//! check image. An image, or a record the redo does not apply, starts the search over from
//! there. Without `--key` it first counts the record values of every block and takes the one
//! with the most.
//!
//! The fixture file (`--out`), little-endian:
//! `magic "PG15CHN1" | base page (8192) | n u32 | n x (lsn u64 | len u32 | pg15 value bytes) |
//! expected page (8192)`; each lsn is the value's LSN (its record's end LSN, as the daemon keys
//! it), the base page has `pd_lsn` set to the LSN it was taken at (as the daemon stores an
//! image), and the expected page is PostgreSQL's check image after the N-th record, unmasked.
//! `benches/src/lib.rs` reads it.
//!
//! Before writing, the N values are applied to the base page again, and the result must equal
//! the expected page once both are masked as PostgreSQL masks them (the `rm_mask` of the last
//! record's resource manager: `walredo_proc::pg15::mask`, e.g. `heap_mask`, `btree_mask`,
//! `gin_mask`, `gist_mask`); otherwise nothing is written and the command fails. Prints one
//! JSON object: the block, the base, the LSN range, the record types, the sizes.
//!
//! Invariant: reads the WAL only; writes `--out` only, and only a checked chain.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use anyhow::{bail, Context};
use bytes::Bytes;
use page_types::wal::DecodedRecord;
use page_types::{BufferTag, Lsn};
use pageserver::ingest::wal_values;
use pageserver::storage::Value;
use walredo_proc::page::{set_page_lsn, Page, BLCKSZ};
use walredo_proc::pg15::{mask, redo, Pg15Record};

/// The first bytes of a fixture file.
pub const MAGIC: &[u8; 8] = b"PG15CHN1";

pub struct Args {
    pub paths: Vec<PathBuf>,
    /// The block; `None`: the one with the most record values.
    pub key: Option<BufferTag>,
    /// Record values in the chain (N).
    pub records: usize,
    pub out: Option<PathBuf>,
    pub start: Option<Lsn>,
    pub end: Option<Lsn>,
}

/// Parses `<spcnode>/<dbnode>/<relnode>/<forknum>/<blknum>`, e.g. `1663/5/16397/0/0`.
pub fn parse_key(s: &str) -> Result<BufferTag, String> {
    let parts: Vec<&str> = s.split('/').collect();
    let [spc, db, rel, fork, blk] = parts.as_slice() else {
        return Err(format!("{s:?}: expected <spc>/<db>/<rel>/<fork>/<blk>"));
    };
    let num = |what: &str, v: &str| v.parse::<u32>().map_err(|e| format!("{what} {v:?}: {e}"));
    Ok(BufferTag {
        spcnode: num("spcnode", spc)?,
        dbnode: num("dbnode", db)?,
        relnode: num("relnode", rel)?,
        forknum: fork.parse::<u8>().map_err(|e| format!("forknum {fork:?}: {e}"))?,
        blknum: num("blknum", blk)?,
    })
}

/// A record value of the chain, with PostgreSQL's page after it where the record carried one.
struct Link {
    lsn: Lsn,
    value: Bytes,
    rmid: u8,
    check: Option<Box<Page>>,
}

/// How the search follows the block.
#[derive(Default)]
struct Search {
    /// The known page the chain starts from, with where it came from and its LSN.
    base: Option<(Box<Page>, &'static str, Lsn)>,
    links: Vec<Link>,
    /// `base` with `links` applied.
    page: Option<Box<Page>>,
    /// Values of the block seen, and starting points taken (an image, a check image after a
    /// record the redo did not apply or with nothing known before it).
    seen: u64,
    starts: u64,
}

/// A chain found and checked.
struct Chain {
    base: Box<Page>,
    base_from: &'static str,
    base_lsn: Lsn,
    links: Vec<Link>,
    expected: Box<Page>,
}

pub fn run(args: &Args) -> anyhow::Result<serde_json::Value> {
    if args.records == 0 {
        bail!("--records must be at least 1");
    }
    let (key, busiest) = match args.key {
        Some(key) => (key, None),
        None => {
            let (key, count) = busiest_block(args)?;
            eprintln!("pagectl chain: block {key} has the most record values ({count})");
            (key, Some(count))
        }
    };
    let chain = find(args, key)?;
    let bytes = encode(&chain);
    if let Some(out) = &args.out {
        std::fs::write(out, &bytes).with_context(|| format!("write {}", out.display()))?;
    }
    let mut types: BTreeMap<String, u64> = BTreeMap::new();
    for link in &chain.links {
        let name = match Pg15Record::decode(&link.value) {
            Ok(record) => record.type_name(),
            Err(_) => "derived".to_string(),
        };
        *types.entry(name).or_default() += 1;
    }
    let value_bytes: usize = chain.links.iter().map(|l| l.value.len()).sum();
    let key_form = format!("{}/{}/{}/{}/{}", key.spcnode, key.dbnode, key.relnode, key.forknum, key.blknum);
    Ok(serde_json::json!({
        "key": key_form,
        "block": key.to_string(),
        "busiest_record_values": busiest,
        "base": chain.base_from,
        "base_lsn": chain.base_lsn.to_string(),
        "first_lsn": chain.links.first().map(|l| l.lsn.to_string()),
        "last_lsn": chain.links.last().map(|l| l.lsn.to_string()),
        "records": chain.links.len(),
        "types": types,
        "value_bytes": value_bytes,
        "file_bytes": bytes.len(),
        "out": args.out.as_ref().map(|p| p.display().to_string()),
    }))
}

/// The block with the most record values in the range, and their count.
fn busiest_block(args: &Args) -> anyhow::Result<(BufferTag, u64)> {
    let mut counts: HashMap<BufferTag, u64> = HashMap::new();
    let mut error = None;
    crate::waldump::for_each_record(&args.paths, args.start, args.end, &mut |rec| {
        let mut out = Vec::new();
        if let Err(e) = wal_values::block_values(rec, &mut out) {
            error = Some(anyhow::Error::from(e).context(format!("values of the record at {}", rec.lsn)));
            return false;
        }
        for (key, _, value) in out {
            if matches!(value, Value::Record(_)) {
                *counts.entry(key).or_default() += 1;
            }
        }
        true
    })?;
    if let Some(e) = error {
        return Err(e);
    }
    // Ties go to the smallest key, so that the choice does not depend on hashing.
    counts
        .into_iter()
        .max_by(|(ka, a), (kb, b)| a.cmp(b).then(kb.cmp(ka)))
        .context("no record values in the WAL")
}

/// Walks the WAL until a chain of `args.records` values of `key` is found, and checks it.
fn find(args: &Args, key: BufferTag) -> anyhow::Result<Chain> {
    let mut search = Search::default();
    let mut found: Option<Chain> = None;
    let mut error = None;
    crate::waldump::for_each_record(&args.paths, args.start, args.end, &mut |rec| match step(
        rec,
        key,
        args.records,
        &mut search,
    ) {
        Ok(None) => true,
        Ok(Some(chain)) => {
            found = Some(chain);
            false
        }
        Err(e) => {
            error = Some(e);
            false
        }
    })?;
    if let Some(e) = error {
        return Err(e);
    }
    let chain = found.with_context(|| {
        format!(
            "no chain of {} record values of {key} ({} values seen, {} starting points)",
            args.records, search.seen, search.starts
        )
    })?;
    check(&chain)?;
    Ok(chain)
}

/// Follows `key` through one WAL record; a chain once the N-th value with a check image is in.
fn step(rec: &DecodedRecord, key: BufferTag, n: usize, search: &mut Search) -> anyhow::Result<Option<Chain>> {
    let mut out = Vec::new();
    wal_values::block_values(rec, &mut out)
        .with_context(|| format!("values of the record at {}", rec.lsn))?;
    for (value_key, lsn, value) in out {
        if value_key != key {
            continue;
        }
        search.seen += 1;
        let block = rec.blocks.iter().find(|b| wal_values::key_of(b) == key);
        let check = match block.and_then(|b| b.image.as_ref()) {
            Some(image) => {
                Some(to_page(&image.restore_page().with_context(|| format!("check image at {}", rec.lsn))?)?)
            }
            None => None,
        };
        let bytes = match value {
            Value::Image(bytes) => {
                let page = to_page(&bytes)?;
                search.restart(Some((page, "full-page image", lsn)));
                continue;
            }
            Value::Record(bytes) => bytes,
        };
        if search.page.is_none() && block.is_some_and(|b| b.will_init) {
            search.restart(Some((Box::new([0u8; BLCKSZ]), "zero page (the record initialises it)", rec.lsn)));
        }
        let Some(page) = search.page.as_mut() else {
            // Nothing known before this record: its own check image is the next base.
            search.restart(check.map(|page| with_lsn(page, lsn)).map(|p| (p, "check image", lsn)));
            continue;
        };
        match redo::apply(&bytes, page) {
            None => bail!("the value at {} is not of the pg15 family", rec.lsn),
            Some(Ok(())) => {}
            Some(Err(e)) => {
                eprintln!("pagectl chain: {} at {lsn} not applied ({e}): starting over after it", rec.lsn);
                search.restart(check.map(|page| with_lsn(page, lsn)).map(|p| (p, "check image", lsn)));
                continue;
            }
        }
        search.links.push(Link { lsn, value: bytes, rmid: rec.rmid, check });
        if search.links.len() < n {
            continue;
        }
        let (base, base_from, base_lsn) = search.base.take().context("a chain without a base")?;
        let links = std::mem::take(&mut search.links);
        if let Some(expected) = links.last().and_then(|l| l.check.clone()) {
            return Ok(Some(Chain { base, base_from, base_lsn, links, expected }));
        }
        // The N-th has no check image: start again from the latest link that has one.
        search.rebase(links);
    }
    Ok(None)
}

impl Search {
    /// Drops the chain; `base` (if any) is the new starting point.
    fn restart(&mut self, base: Option<(Box<Page>, &'static str, Lsn)>) {
        self.starts += u64::from(base.is_some());
        self.links.clear();
        self.page = base.as_ref().map(|(page, _, _)| page.clone());
        self.base = base;
    }

    /// Starts the chain again after the last of `links` that has a check image.
    fn rebase(&mut self, mut links: Vec<Link>) {
        let Some(at) = links.iter().rposition(|l| l.check.is_some()) else {
            self.restart(None);
            return;
        };
        let rest = links.split_off(at + 1);
        let Some(last) = links.pop() else { return };
        let Some(check) = last.check else { return };
        self.restart(Some((with_lsn(check, last.lsn), "check image", last.lsn)));
        // Replays the rest on the new base; they applied before, on the same page masked alike.
        for link in rest {
            if let Some(page) = self.page.as_mut() {
                if !matches!(redo::apply(&link.value, page), Some(Ok(()))) {
                    self.restart(None);
                    return;
                }
            }
            self.links.push(link);
        }
    }
}

/// Applies the chain to its base again and compares with PostgreSQL's page, masked.
fn check(chain: &Chain) -> anyhow::Result<()> {
    let mut page = chain.base.clone();
    for link in &chain.links {
        match redo::apply(&link.value, &mut page) {
            Some(Ok(())) => {}
            Some(Err(e)) => bail!("apply the value at {}: {e}", link.lsn),
            None => bail!("the value at {} is not of the pg15 family", link.lsn),
        }
    }
    let rmid = chain.links.last().map_or(0, |l| l.rmid);
    if let Some(at) = mask::first_difference(rmid, &page[..], &chain.expected[..]) {
        bail!(
            "the chain applied to its base differs from PostgreSQL's page at byte {at} (masked), after {}",
            chain.links.last().map_or(chain.base_lsn, |l| l.lsn)
        );
    }
    Ok(())
}

fn encode(chain: &Chain) -> Vec<u8> {
    let values: usize = chain.links.iter().map(|l| 12 + l.value.len()).sum();
    let mut out = Vec::with_capacity(8 + 2 * BLCKSZ + 4 + values);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&chain.base[..]);
    out.extend_from_slice(&(chain.links.len() as u32).to_le_bytes());
    for link in &chain.links {
        out.extend_from_slice(&link.lsn.0.to_le_bytes());
        out.extend_from_slice(&(link.value.len() as u32).to_le_bytes());
        out.extend_from_slice(&link.value);
    }
    out.extend_from_slice(&chain.expected[..]);
    out
}

fn with_lsn(mut page: Box<Page>, lsn: Lsn) -> Box<Page> {
    set_page_lsn(&mut page, lsn.0);
    page
}

fn to_page(bytes: &[u8]) -> anyhow::Result<Box<Page>> {
    let page: &Page = bytes.try_into().map_err(|_| anyhow::anyhow!("a page of {} bytes", bytes.len()))?;
    Ok(Box::new(*page))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_key_takes_five_numbers_and_refuses_anything_else() {
        let key = parse_key("1663/5/16397/0/7").expect("a key");
        assert_eq!(key, BufferTag { spcnode: 1663, dbnode: 5, relnode: 16397, forknum: 0, blknum: 7 });
        for bad in ["", "1663/5/16397/0", "1663/5/16397/0/7/1", "1663/5/x/0/0", "1663/5/1/300/0"] {
            assert!(parse_key(bad).is_err(), "{bad:?} parsed");
        }
    }
}
