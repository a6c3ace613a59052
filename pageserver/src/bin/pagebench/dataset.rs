//! The synthetic data set of `pagebench`: which pages exist, the LSN of every value, and the
//! bytes of every image and record, all derived from the shape (`--relations`, `--blocks`,
//! `--chain-length`) and `--seed` alone. `ingest` writes it; `get-page --verify` recomputes the
//! expected page locally (get-page takes keys and LSNs from the daemon's key space).
//!
//! A data set with a longer chain continues one with a shorter chain (round `k`'s records depend
//! on the seed, the page and `k` only), so `ingest --exists-ok` may lengthen the chain of a
//! loaded data set; any other change of shape is refused.
//!
//! LSN layout (value `v` has LSN `FIRST_LSN + v * LSN_STEP`, `N` = relations x blocks pages):
//! - values `0..N`: one image per page, page `p` at value `p` (round 0);
//! - then `chain_length` rounds: round `k` (1-based) gives every page one record, page `p` at
//!   value `k * N + p`.
//!
//! So every page exists at every LSN from [`Shape::images_done_lsn`] on, and at
//! [`Shape::end_lsn`] (the last value) every page has an image and exactly `chain_length`
//! records above it.
//!
//! Invariant: every record applies. An image is `init page` plus 2 to 8 tuples of 32 to 200
//! bytes (at most 1632 bytes of tuples and pointers), so its tuple area is at least 64 bytes;
//! records are `insert tuple` (8 to 56 bytes, only in rounds 1 to 64: at most 3840 bytes more),
//! or `put bytes`, `set bits`, `clear bits` of at most 32 bytes inside the image's tuple area,
//! which touch neither the header nor a line pointer. 24 + 1632 + 3840 < 8192: the page never
//! fills, whatever the chain length.
//!
//! The generator is a SplitMix64 written here rather than `rand`: the data set must stay the
//! same for a seed across versions of this tool, and `rand` does not promise stable streams.

use bytes::Bytes;
use page_types::BufferTag;
use pageserver::page_service::proto::{IngestValue, ValueKind};
use walredo_proc::page::{maxalign, Page, BLCKSZ};
use walredo_proc::record::Record;

/// LSN of the first value. Well above 0, so that a fresh tenant (last durable LSN 0) accepts it.
pub const FIRST_LSN: u64 = 0x0100_0000;
/// Distance between the LSNs of consecutive values: random LSNs mostly fall between values,
/// which exercises "the newest value at or below the LSN".
pub const LSN_STEP: u64 = 8;
/// Tablespace, database and first relation number of the data set's relations.
const SPCNODE: u32 = 1663;
const DBNODE: u32 = 1;
const FIRST_RELNODE: u32 = 16384;
/// Defaults of the shape flags.
pub const DEFAULT_RELATIONS: u32 = 4;
pub const DEFAULT_BLOCKS: u32 = 1024;
pub const DEFAULT_CHAIN_LENGTH: u32 = 4;
pub const DEFAULT_SEED: u64 = 1;
/// Rounds that may insert tuples; later rounds only modify bytes (see the module invariant).
const MAX_INSERT_ROUNDS: u32 = 64;

/// The shape of the data set; the same flags for `ingest` and `get-page`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub relations: u32,
    pub blocks: u32,
    pub chain_length: u32,
    pub seed: u64,
}

impl Shape {
    /// Number of pages (relations x blocks).
    pub fn pages(&self) -> u64 {
        u64::from(self.relations) * u64::from(self.blocks)
    }

    /// Number of values: one image and `chain_length` records per page.
    pub fn values(&self) -> u64 {
        self.pages() * (1 + u64::from(self.chain_length))
    }

    pub fn lsn_of_value(&self, value: u64) -> u64 {
        FIRST_LSN + value * LSN_STEP
    }

    /// The index of the first value whose LSN is above `lsn`.
    pub fn first_value_above(&self, lsn: u64) -> u64 {
        if lsn < FIRST_LSN {
            return 0;
        }
        ((lsn - FIRST_LSN) / LSN_STEP + 1).min(self.values())
    }

    /// From this LSN on, every page exists (its image is stored).
    pub fn images_done_lsn(&self) -> u64 {
        self.lsn_of_value(self.pages().saturating_sub(1))
    }

    /// The LSN of the last value.
    pub fn end_lsn(&self) -> u64 {
        self.lsn_of_value(self.values().saturating_sub(1))
    }

    pub fn key(&self, page: u64) -> BufferTag {
        let blocks = u64::from(self.blocks.max(1));
        BufferTag {
            spcnode: SPCNODE,
            dbnode: DBNODE,
            relnode: FIRST_RELNODE + (page / blocks) as u32,
            forknum: 0,
            blknum: (page % blocks) as u32,
        }
    }

    /// The page index of a key of this data set, if it is one.
    pub fn page_of_key(&self, key: &BufferTag) -> Option<u64> {
        let relation = key.relnode.checked_sub(FIRST_RELNODE)?;
        let in_set = key.spcnode == SPCNODE
            && key.dbnode == DBNODE
            && key.forknum == 0
            && relation < self.relations
            && key.blknum < self.blocks;
        in_set.then(|| u64::from(relation) * u64::from(self.blocks) + u64::from(key.blknum))
    }

    /// Value number `value`: (page, round); round 0 is the image.
    fn locate(&self, value: u64) -> (u64, u32) {
        let pages = self.pages().max(1);
        (value % pages, (value / pages) as u32)
    }

    /// The LSN of the value of `page` in `round`.
    fn lsn_of(&self, page: u64, round: u32) -> u64 {
        self.lsn_of_value(u64::from(round) * self.pages() + page)
    }

    /// Builds value number `value` (`value < self.values()`).
    pub fn value(&self, value: u64) -> IngestValue {
        let (page, round) = self.locate(value);
        let key = self.key(page);
        let lsn = self.lsn_of_value(value);
        if round == 0 {
            let image = self.image(page);
            IngestValue { key, lsn, kind: ValueKind::Image, data: Bytes::copy_from_slice(&image[..]) }
        } else {
            IngestValue { key, lsn, kind: ValueKind::Record, data: Bytes::from(self.record(page, round)) }
        }
    }

    /// Encoded size of a value in an Ingest frame (key, lsn, kind, length, data).
    pub fn encoded_len(value: &IngestValue) -> usize {
        17 + 8 + 1 + 4 + value.data.len()
    }

    /// Tuple lengths of the image of `page`; drawn first from the page's stream, so that the
    /// records can find the tuple area without building the image.
    fn image_tuple_lengths(&self, rng: &mut SplitMix64) -> Vec<usize> {
        let count = 2 + rng.below(7) as usize;
        (0..count).map(|_| 32 + rng.below(169) as usize).collect()
    }

    /// Start of the image's tuple area (`pd_upper` of the image).
    fn tuple_area_start(&self, page: u64) -> usize {
        let mut rng = SplitMix64::for_value(self.seed, page, 0);
        BLCKSZ - self.image_tuple_lengths(&mut rng).iter().map(|&len| maxalign(len)).sum::<usize>()
    }

    /// The image of `page`: `init page` and its tuples, applied at the image's LSN.
    pub fn image(&self, page: u64) -> Box<Page> {
        let lsn = self.lsn_of(page, 0);
        let mut rng = SplitMix64::for_value(self.seed, page, 0);
        let lengths = self.image_tuple_lengths(&mut rng);
        let mut image: Box<Page> = Box::new([0; BLCKSZ]);
        Record::InitPage { special_size: 0 }
            .apply(&mut image, lsn)
            .expect("init page with special size 0 always applies");
        let mut data = Vec::new();
        for len in lengths {
            data.resize(len, 0);
            rng.fill(&mut data);
            Record::InsertTuple { offnum: 0, data: &data }
                .apply(&mut image, lsn)
                .expect("the image's tuples fit (module invariant)");
        }
        image
    }

    /// The encoded record of `page` in `round` (1-based).
    pub fn record(&self, page: u64, round: u32) -> Vec<u8> {
        let area_start = self.tuple_area_start(page);
        let mut rng = SplitMix64::for_value(self.seed, page, round);
        let mut choice = rng.below(4);
        if choice == 0 && round > MAX_INSERT_ROUNDS {
            choice = 1;
        }
        let bytes = |rng: &mut SplitMix64, min: u64, max: u64| {
            let mut data = vec![0; (min + rng.below(max - min + 1)) as usize];
            rng.fill(&mut data);
            // Never an all-zero mask or payload: every record changes something visible.
            data[0] |= 1;
            data
        };
        let offset_for = |rng: &mut SplitMix64, len: usize| {
            let span = (BLCKSZ - len - area_start) as u64;
            (area_start as u64 + rng.below(span + 1)) as u16
        };
        match choice {
            0 => {
                let data = bytes(&mut rng, 8, 56);
                Record::InsertTuple { offnum: 0, data: &data }.encode_to_vec()
            }
            1 => {
                let data = bytes(&mut rng, 1, 32);
                let offset = offset_for(&mut rng, data.len());
                Record::PutBytes { offset, data: &data }.encode_to_vec()
            }
            2 => {
                let mask = bytes(&mut rng, 1, 8);
                let offset = offset_for(&mut rng, mask.len());
                Record::SetBits { offset, mask: &mask }.encode_to_vec()
            }
            _ => {
                let mask = bytes(&mut rng, 1, 8);
                let offset = offset_for(&mut rng, mask.len());
                Record::ClearBits { offset, mask: &mask }.encode_to_vec()
            }
        }
    }

    /// The page as of `lsn`, computed locally (for `--verify`); `None` before its image.
    pub fn expected_page(&self, page: u64, lsn: u64) -> anyhow::Result<Option<Box<Page>>> {
        if lsn < self.lsn_of(page, 0) {
            return Ok(None);
        }
        let mut image = self.image(page);
        for round in 1..=self.chain_length {
            let record_lsn = self.lsn_of(page, round);
            if record_lsn > lsn {
                break;
            }
            let encoded = self.record(page, round);
            let record = Record::decode(&encoded).map_err(|e| anyhow::anyhow!("decode own record: {e}"))?;
            record.apply(&mut image, record_lsn).map_err(|e| anyhow::anyhow!("apply own record: {e}"))?;
        }
        Ok(Some(image))
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and its stream is fixed by its definition.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The stream of one value of the data set: independent of every other value's.
    fn for_value(seed: u64, page: u64, round: u32) -> Self {
        let mut mix = SplitMix64(seed ^ 0x5eed_da7a_5e7d_a7a5);
        let a = mix.next_u64() ^ page;
        let b = SplitMix64(a).next_u64() ^ (u64::from(round) << 32 | 0x9e37);
        SplitMix64(SplitMix64(b).next_u64())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`), by Lemire's multiply-shift (bias below 2^-32 for our `n`).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let word = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(chain_length: u32) -> Shape {
        Shape { relations: 3, blocks: 5, chain_length, seed: 42 }
    }

    #[test]
    fn lsn_layout_puts_all_images_first_then_one_record_per_page_per_round() {
        let s = shape(2);
        assert_eq!(s.values(), 45);
        assert_eq!(s.images_done_lsn(), FIRST_LSN + 14 * LSN_STEP);
        assert_eq!(s.end_lsn(), FIRST_LSN + 44 * LSN_STEP);
        for v in 0..s.values() {
            let value = s.value(v);
            assert_eq!(value.lsn, s.lsn_of_value(v));
            assert_eq!(s.page_of_key(&value.key), Some(v % 15));
            assert_eq!(value.kind == ValueKind::Image, v < 15);
        }
        assert_eq!(s.first_value_above(0), 0);
        assert_eq!(s.first_value_above(FIRST_LSN), 1);
        assert_eq!(s.first_value_above(FIRST_LSN + 3), 1);
        assert_eq!(s.first_value_above(s.end_lsn()), s.values());
    }

    #[test]
    fn long_chains_always_apply_and_never_fill_the_page() {
        let s = Shape { relations: 2, blocks: 20, chain_length: 300, seed: 7 };
        for page in 0..s.pages() {
            let full = s.expected_page(page, s.end_lsn()).unwrap().unwrap();
            assert_eq!(walredo_proc::page::page_lsn(&full), s.lsn_of(page, 300));
            assert!(walredo_proc::page::check_header(&full).unwrap().free() > 1000);
        }
    }

    #[test]
    fn same_seed_same_bytes_other_seed_other_bytes() {
        let a = shape(3);
        let b = Shape { seed: 43, ..a };
        assert_eq!(a.value(20), a.value(20));
        assert_eq!(a.image(4), a.image(4));
        assert_ne!(a.image(4), b.image(4));
        assert_ne!(a.record(4, 1), b.record(4, 1));
    }

    #[test]
    fn expected_page_follows_the_records_at_or_below_the_lsn() {
        let s = shape(3);
        let page = 7;
        assert!(s.expected_page(page, s.lsn_of(page, 0) - 1).unwrap().is_none());
        let image = s.expected_page(page, s.lsn_of(page, 0)).unwrap().unwrap();
        assert_eq!(&image[..], &s.image(page)[..]);
        let after_one = s.expected_page(page, s.lsn_of(page, 1)).unwrap().unwrap();
        let between = s.expected_page(page, s.lsn_of(page, 2) - 1).unwrap().unwrap();
        assert_eq!(after_one, between);
        assert_ne!(after_one, image);
        assert_eq!(walredo_proc::page::page_lsn(&after_one), s.lsn_of(page, 1));
    }
}
