//! The vocabulary that the daemon (`pageserver`) and the redo child (`walredo-proc`) share: the
//! WAL position [`Lsn`], the page key [`BufferTag`], and the limits every layer checks against
//! ([`PAGE_SIZE`], [`MAX_RECORD_LEN`], [`MAX_RECORDS_PER_REQUEST`]); and [`wal`], a pure
//! decoder of PostgreSQL 15 WAL (pages, records, block references, full-page images) that both
//! the daemon and the operator tool `pagectl` can use; [`checksum`], PostgreSQL's data page
//! checksum, and [`control_file`], what the daemon reads of a cluster's `pg_control`.
//!
//! It exists so that each of these is defined once and no module has to import "upward" (storage
//! from a wire protocol, a tenant from the page service) just to name a key or an LSN.
//!
//! **Invariants:** pure code with no I/O and no dependency on either crate that uses it; no
//! input makes anything here panic.

use std::fmt;
use std::str::FromStr;

pub mod checksum;
pub mod control_file;
pub mod keys;
pub mod wal;

use serde::{Deserialize, Serialize};

/// Size of a page in bytes (PostgreSQL's `BLCKSZ`).
pub const PAGE_SIZE: usize = 8192;
/// Largest encoded redo record (kind byte included), in storage, on the page service and on
/// the redo pipe alike.
pub const MAX_RECORD_LEN: usize = 16384;
/// Most records one redo request may carry, and so the longest chain a GetPage may need.
pub const MAX_RECORDS_PER_REQUEST: usize = 65536;
/// Most bytes (image and records) one GetPage may read to rebuild a page; checked from the index
/// before anything is read.
pub const MAX_RECONSTRUCT_BYTES: u64 = 256 << 20;
/// Size of the wire form of a [`BufferTag`].
pub const BUFFER_TAG_LEN: usize = 17;

/// A WAL position. Displays like PostgreSQL, high and low 32 bits in hex: `16/B374D848`;
/// serializes as a plain integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The page service's "latest" sentinel: never a position that can be ingested.
    pub const LATEST: Lsn = Lsn(u64::MAX);
    /// Not a valid position (PostgreSQL's `InvalidXLogRecPtr`); never ingested either.
    pub const INVALID: Lsn = Lsn(0);

    /// Whether this value is reserved (0 or the "latest" sentinel) and so cannot name a record.
    pub fn is_reserved(self) -> bool {
        self == Lsn::INVALID || self == Lsn::LATEST
    }

    /// The position `bytes` further on; `None` past the last position.
    pub fn checked_add(self, bytes: u64) -> Option<Lsn> {
        self.0.checked_add(bytes).map(Lsn)
    }

    /// Bytes from `earlier` up to this position; 0 if `earlier` is not below it.
    pub fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// The start of the `size`-byte block (a WAL page, say) this position lies in; a `size` of
    /// 0 leaves it where it is.
    pub fn block_start(self, size: u64) -> Lsn {
        Lsn(self.0 - self.0.checked_rem(size).unwrap_or(0))
    }

    /// The first multiple of `align` at or above this position (`MAXALIGN`, where the next
    /// record may start); `None` past the last position or for an `align` of 0.
    pub fn checked_align_up(self, align: u64) -> Option<Lsn> {
        self.0.checked_next_multiple_of(align).map(Lsn)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if *self == Lsn::LATEST {
            return f.write_str("latest");
        }
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Self {
        Lsn(v)
    }
}

/// Why a string is not an LSN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseLsnError(String);

impl fmt::Display for ParseLsnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid LSN {:?}: want X/X (hex), a decimal integer, or \"latest\"", self.0)
    }
}

impl std::error::Error for ParseLsnError {}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    /// Accepts PostgreSQL's `X/X` form, a decimal integer, or `latest`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(s.to_owned());
        if s == "latest" {
            return Ok(Lsn::LATEST);
        }
        if let Some((hi, lo)) = s.split_once('/') {
            let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
            let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
            return Ok(Lsn(u64::from(hi) << 32 | u64::from(lo)));
        }
        s.parse::<u64>().map(Lsn).map_err(|_| err())
    }
}

/// Identifies one page: relation (tablespace, database, relation, fork) and block number.
///
/// Field order gives the sort order used by storage (relation, then fork, then block); the wire
/// order is different (see [`BufferTag::encode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufferTag {
    pub spcnode: u32,
    pub dbnode: u32,
    pub relnode: u32,
    pub forknum: u8,
    pub blknum: u32,
}

impl BufferTag {
    /// Appends the 17-byte wire form: forknum, spcnode, dbnode, relnode, blknum (big-endian).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.forknum);
        out.extend_from_slice(&self.spcnode.to_be_bytes());
        out.extend_from_slice(&self.dbnode.to_be_bytes());
        out.extend_from_slice(&self.relnode.to_be_bytes());
        out.extend_from_slice(&self.blknum.to_be_bytes());
    }

    /// Decodes the 17-byte wire form.
    pub fn decode(b: &[u8; BUFFER_TAG_LEN]) -> BufferTag {
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        BufferTag {
            forknum: b[0],
            spcnode: u32_at(1),
            dbnode: u32_at(5),
            relnode: u32_at(9),
            blknum: u32_at(13),
        }
    }
}

impl fmt::Display for BufferTag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}.{} blk {}", self.spcnode, self.dbnode, self.relnode, self.forknum, self.blknum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lsn_displays_like_postgres_and_latest_by_name() {
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn::LATEST.to_string(), "latest");
    }

    #[test]
    fn lsn_parses_its_display_form_decimal_and_latest() {
        assert_eq!("16/B374D848".parse::<Lsn>(), Ok(Lsn(0x16_B374_D848)));
        assert_eq!("100".parse::<Lsn>(), Ok(Lsn(100)));
        assert_eq!("latest".parse::<Lsn>(), Ok(Lsn::LATEST));
        for bad in ["", "/", "1/", "x/1", "1/2/3", "-1", "100000000/0"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn reserved_lsns_are_zero_and_the_sentinel_only() {
        assert!(Lsn::INVALID.is_reserved());
        assert!(Lsn::LATEST.is_reserved());
        assert!(!Lsn(1).is_reserved());
        assert!(!Lsn(u64::MAX - 1).is_reserved());
    }

    #[test]
    fn lsn_arithmetic_stops_at_the_ends_instead_of_wrapping() {
        assert_eq!(Lsn(0x10).checked_add(8), Some(Lsn(0x18)));
        assert_eq!(Lsn(u64::MAX - 1).checked_add(2), None);
        assert_eq!(Lsn(0x30).bytes_since(Lsn(0x10)), 0x20);
        assert_eq!(Lsn(0x10).bytes_since(Lsn(0x30)), 0);
        assert_eq!(Lsn(0x1_0000_2345).block_start(8192), Lsn(0x1_0000_2000));
        assert_eq!(Lsn(0x2000).block_start(8192), Lsn(0x2000));
        assert_eq!(Lsn(0x2345).block_start(0), Lsn(0x2345));
        assert_eq!(Lsn(0x21).checked_align_up(8), Some(Lsn(0x28)));
        assert_eq!(Lsn(0x28).checked_align_up(8), Some(Lsn(0x28)));
        assert_eq!(Lsn(u64::MAX - 1).checked_align_up(8), None);
        assert_eq!(Lsn(0x21).checked_align_up(0), None);
    }

    proptest! {
        #[test]
        fn lsn_display_round_trips(v in any::<u64>()) {
            prop_assert_eq!(Lsn(v).to_string().parse::<Lsn>(), Ok(Lsn(v)));
        }

        #[test]
        fn buffer_tag_wire_form_round_trips(spcnode: u32, dbnode: u32, relnode: u32, forknum: u8, blknum: u32) {
            let tag = BufferTag { spcnode, dbnode, relnode, forknum, blknum };
            let mut out = Vec::new();
            tag.encode(&mut out);
            let raw: [u8; BUFFER_TAG_LEN] = out.as_slice().try_into().expect("17 bytes");
            prop_assert_eq!(BufferTag::decode(&raw), tag);
        }
    }
}
