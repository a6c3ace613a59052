//! A tenant's key space as the daemon reports it (`GET /v1/tenant/{id}/keyspace`,
//! docs/http-api.md): what `get-page` chooses keys and LSNs from, and what `ingest --exists-ok`
//! and `get-page --verify` compare with the data set's shape.
//!
//! Only relation pages (forks 0 to 3) are kept: the other keys of a tenant that follows
//! PostgreSQL (relation sizes, SLRU pages, files; `page_types::keys`) are no GetPage's.
//!
//! Keys are kept as the daemon sends them, block ranges per relation fork, with the running
//! count of keys before each range: key number `i` is found by a binary search, so millions of
//! pages cost a few bytes per range, not per key.

use crate::client::{Client, ServerError};
use anyhow::{bail, Context};
use page_types::{BufferTag, Lsn};
use pageserver::page_service::proto::ErrorCode;
use serde::Deserialize;

use crate::dataset::{Shape, FIRST_LSN, LSN_STEP};
use crate::http;

/// One inclusive block range of one relation fork.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    /// The key of the range's first block.
    pub first: BufferTag,
    /// Blocks in the range.
    pub blocks: u64,
    /// Keys in the ranges before this one.
    pub before: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpace {
    pub ranges: Vec<Range>,
    pub keys: u64,
    /// Every key has a value at this LSN and above.
    pub all_keys_from: u64,
    pub last_durable_lsn: u64,
}

#[derive(Deserialize)]
struct Wire {
    last_durable_lsn: u64,
    lsn_range: Option<WireLsnRange>,
    relations: Vec<WireRelation>,
}

#[derive(Deserialize)]
struct WireLsnRange {
    all_keys_from: u64,
}

#[derive(Deserialize)]
struct WireRelation {
    spcnode: u32,
    dbnode: u32,
    relnode: u32,
    forknum: u8,
    blocks: Vec<[u32; 2]>,
}

impl KeySpace {
    /// Asks the daemon at `http_addr` for the key space of `tenant`.
    ///
    /// Cancel-safe: one HTTP exchange, nothing kept.
    pub async fn fetch(http_addr: &str, tenant: &str) -> anyhow::Result<KeySpace> {
        let path = format!("/v1/tenant/{tenant}/keyspace");
        let response = http::request_json(http_addr, "GET", &path, None).await?;
        match response.status {
            200 => KeySpace::parse(&response.body)
                .with_context(|| format!("read the key space of tenant {tenant}")),
            404 => bail!("tenant {tenant} does not exist: run `pagebench ingest` first"),
            status => bail!("GET {path}: HTTP {status}: {}", response.body.trim()),
        }
    }

    pub fn parse(body: &str) -> anyhow::Result<KeySpace> {
        let wire: Wire = serde_json::from_str(body).context("parse the key space")?;
        let mut ranges = Vec::new();
        let mut keys = 0u64;
        for rel in wire.relations.iter().filter(|r| r.forknum <= page_types::keys::MAX_FORK) {
            for &[first, last] in &rel.blocks {
                anyhow::ensure!(first <= last, "block range [{first}, {last}] is inverted");
                let blocks = u64::from(last - first) + 1;
                let first = BufferTag {
                    spcnode: rel.spcnode,
                    dbnode: rel.dbnode,
                    relnode: rel.relnode,
                    forknum: rel.forknum,
                    blknum: first,
                };
                ranges.push(Range { first, blocks, before: keys });
                keys += blocks;
            }
        }
        let all_keys_from = wire.lsn_range.map_or(0, |r| r.all_keys_from);
        Ok(KeySpace { ranges, keys, all_keys_from, last_durable_lsn: wire.last_durable_lsn })
    }

    /// Key number `index` (`index < self.keys`), in key order.
    pub fn key(&self, index: u64) -> BufferTag {
        let at = self.ranges.partition_point(|r| r.before <= index).saturating_sub(1);
        let range = &self.ranges[at];
        // `index - before < blocks <= u32 range` by construction.
        BufferTag { blknum: range.first.blknum + (index - range.before) as u32, ..range.first }
    }

    /// Checks that this is (a prefix of, when `complete` is false) the data set of `shape`:
    /// the same keys, and a last durable LSN that is one of the data set's value LSNs. Says
    /// what differs.
    pub fn check_shape(&self, shape: &Shape, complete: bool) -> anyhow::Result<()> {
        let lsn = self.last_durable_lsn;
        if self.keys == 0 && !complete {
            return Ok(());
        }
        if lsn < FIRST_LSN || (lsn - FIRST_LSN) % LSN_STEP != 0 || lsn > shape.end_lsn() {
            bail!(
                "its last durable LSN {} is not one of the data set's value LSNs ({}..={} in steps of {LSN_STEP})",
                Lsn(lsn),
                Lsn(FIRST_LSN),
                Lsn(shape.end_lsn())
            );
        }
        if complete && lsn != shape.end_lsn() {
            bail!(
                "it is at LSN {}, not at the data set's end LSN {} (an interrupted ingest? run `pagebench ingest --exists-ok` to finish it)",
                Lsn(lsn),
                Lsn(shape.end_lsn())
            );
        }
        let stored_values = (lsn - FIRST_LSN) / LSN_STEP + 1;
        let expected = expected_ranges(shape, stored_values.min(shape.pages()));
        let found: Vec<(BufferTag, u64)> = self.ranges.iter().map(|r| (r.first, r.blocks)).collect();
        if found != expected {
            let describe = |ranges: &[(BufferTag, u64)]| match ranges.first() {
                None => "no keys".to_string(),
                Some((first, _)) => format!(
                    "{} keys in {} ranges, the first from {first}",
                    ranges.iter().map(|r| r.1).sum::<u64>(),
                    ranges.len()
                ),
            };
            bail!("its keys differ: {} where the data set has {}", describe(&found), describe(&expected));
        }
        Ok(())
    }
}

/// Checks the bytes, not only the keys: the first page's image must be the one `shape` (its
/// seed) makes. Needs the image of page 0 stored (any non-empty data set of `shape`); once GC
/// dropped it (its LSN below the tenant's GC cutoff) the seed cannot be checked, which is said
/// on stderr, and only the keys were.
///
/// Cancel-safe: one request on `client`; dropping it leaves the client unusable.
pub async fn check_seed(client: &mut Client, shape: &Shape) -> anyhow::Result<()> {
    let lsn = shape.lsn_of_value(0);
    let page = match client.get_page(shape.key(0), lsn).await {
        Ok((_, page)) => page,
        Err(e) if e.downcast_ref::<ServerError>().is_some_and(|e| e.code == ErrorCode::BelowGcCutoff) => {
            errln!(
                "pagebench: page 0's image (LSN {}) is below the GC cutoff: the data set's keys are checked, its seed {} is not",
                Lsn(lsn),
                shape.seed
            );
            return Ok(());
        }
        Err(e) => return Err(e.context(format!("read page 0 at LSN {}", Lsn(lsn)))),
    };
    if page[..] != shape.image(0)[..] {
        bail!("its page 0 at LSN {} is not the image seed {} makes", Lsn(lsn), shape.seed);
    }
    Ok(())
}

/// The block ranges of the first `pages` pages of `shape` (one range per relation).
fn expected_ranges(shape: &Shape, pages: u64) -> Vec<(BufferTag, u64)> {
    let blocks = u64::from(shape.blocks);
    (0..pages.div_ceil(blocks))
        .map(|relation| {
            let first = relation * blocks;
            (shape.key(first), blocks.min(pages - first))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape { relations: 3, blocks: 5, chain_length: 2, seed: 1 }
    }

    /// The daemon's answer for the first `pages` pages of `shape()` at `lsn`.
    fn wire(pages: u64, lsn: u64) -> String {
        let s = shape();
        let relations: Vec<_> = expected_ranges(&s, pages)
            .into_iter()
            .map(|(k, n)| {
                serde_json::json!({"spcnode": k.spcnode, "dbnode": k.dbnode, "relnode": k.relnode,
                                   "forknum": k.forknum, "blocks": [[0, n - 1]]})
            })
            .collect();
        serde_json::json!({"tenant_id": "t", "last_durable_lsn": lsn, "keys": pages,
                           "lsn_range": {"first": FIRST_LSN, "all_keys_from": FIRST_LSN, "last": lsn},
                           "relations": relations})
        .to_string()
    }

    #[test]
    fn key_numbers_map_into_the_ranges_in_order() {
        let ks = KeySpace::parse(&wire(15, shape().end_lsn())).unwrap();
        assert_eq!(ks.keys, 15);
        for page in 0..15 {
            assert_eq!(ks.key(page), shape().key(page), "page {page}");
        }
        let gaps = r#"{"last_durable_lsn": 9, "lsn_range": {"first": 1, "all_keys_from": 5, "last": 9},
            "relations": [{"spcnode": 1, "dbnode": 2, "relnode": 3, "forknum": 0, "blocks": [[0, 1], [10, 12]]}]}"#;
        let ks = KeySpace::parse(gaps).unwrap();
        assert_eq!((ks.keys, ks.all_keys_from), (5, 5));
        let blocks: Vec<u32> = (0..5).map(|i| ks.key(i).blknum).collect();
        assert_eq!(blocks, [0, 1, 10, 11, 12]);
    }

    #[test]
    fn check_shape_accepts_the_data_set_and_its_prefixes_only() {
        let s = shape();
        let full = KeySpace::parse(&wire(15, s.end_lsn())).unwrap();
        full.check_shape(&s, true).unwrap();
        full.check_shape(&s, false).unwrap();
        // interrupted during the images: the first 7 pages
        let prefix = KeySpace::parse(&wire(7, s.lsn_of_value(6))).unwrap();
        prefix.check_shape(&s, false).unwrap();
        assert!(format!("{:#}", prefix.check_shape(&s, true).unwrap_err()).contains("interrupted"));
        // interrupted in a later round: every page exists
        KeySpace::parse(&wire(15, s.lsn_of_value(20))).unwrap().check_shape(&s, false).unwrap();

        let other = |relations, blocks, chain_length| Shape { relations, blocks, chain_length, seed: 1 };
        for wrong in [other(4, 5, 2), other(3, 4, 2), other(3, 5, 1), other(2, 5, 2)] {
            assert!(full.check_shape(&wrong, false).is_err(), "{wrong:?}");
        }
        // a longer chain continues the same data set
        full.check_shape(&other(3, 5, 3), false).unwrap();
        assert!(full.check_shape(&other(3, 5, 3), true).is_err());
        KeySpace::parse(&wire(0, 0)).unwrap().check_shape(&s, false).unwrap();
    }
}
