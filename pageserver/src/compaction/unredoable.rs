//! The keys whose record chain the redo child cannot redo, as a tenant's compactor remembers
//! them, so that a pass does not ask for the same failing page again on every pass.
//!
//! A chain that holds a record the child does not apply (`unsupported_record`: a Gin record at
//! every insert into a GIN index's pending list, until the child applies them) fails the same
//! way each time it is redone. The child's error names the failing record's LSN (docs/walredo-protocol.md:
//! "names the LSN of the failing record"); the compactor keeps it per key and skips a piece of
//! the key's chain that holds it. What can make the redo succeed again is a newer image of the
//! key above that record (the chain then starts above it), or a new child binary (a restart,
//! which forgets everything here): a piece that starts at or above the remembered LSN forgets
//! the key.
//!
//! **Trust:** the LSN comes from the child, which is not trusted once it has seen a request;
//! it is kept only if it is the LSN of one of the request's own records, and it only ever
//! makes compaction skip an image of that tenant's key (the key keeps its values, GetPage is
//! unchanged).
//!
//! **Invariants:** pure (no I/O, no clock); at most [`UNREDOABLE_KEYS_MAX`] keys per tenant
//! (beyond that the one with the oldest failing record is forgotten: it is tried once more).

use std::collections::HashMap;

use bytes::Bytes;
use page_types::{BufferTag, Lsn};
use walredo_proc::protocol::ErrorCode;

use crate::walredo::RedoError;

/// Most keys remembered per tenant: about 40 bytes each, so at most about 160 KiB a tenant.
pub const UNREDOABLE_KEYS_MAX: usize = 4096;

/// Per key, the LSN of a record of its chain that the child could not redo.
#[derive(Debug)]
pub struct Unredoable {
    keys: HashMap<BufferTag, Lsn>,
    max: usize,
}

impl Default for Unredoable {
    fn default() -> Self {
        Unredoable::with_max(UNREDOABLE_KEYS_MAX)
    }
}

impl Unredoable {
    pub fn with_max(max: usize) -> Unredoable {
        Unredoable { keys: HashMap::new(), max: max.max(1) }
    }

    /// Whether the redo of `key` from its image at `from` (`None`: no image) up to `lsn`
    /// applies a record remembered as failing: then it would fail again. A chain that starts
    /// at or above that record (a newer image came) forgets the key.
    pub fn fails(&mut self, key: BufferTag, from: Option<Lsn>, lsn: Lsn) -> bool {
        let Some(&at) = self.keys.get(&key) else {
            return false;
        };
        if from.is_some_and(|from| from >= at) {
            self.keys.remove(&key);
            return false;
        }
        at <= lsn
    }

    /// Remembers what a failed redo of `key` with `records` says, if it is a record the child
    /// does not apply.
    pub fn failed(&mut self, key: BufferTag, records: &[(Lsn, Bytes)], error: &RedoError) {
        if let Some(at) = unsupported_at(error, records) {
            self.remember(key, at);
        }
    }

    fn remember(&mut self, key: BufferTag, at: Lsn) {
        if self.keys.len() >= self.max && !self.keys.contains_key(&key) {
            let oldest = self.keys.iter().min_by_key(|(_, at)| **at).map(|(k, _)| *k);
            if let Some(oldest) = oldest {
                self.keys.remove(&oldest);
            }
        }
        self.keys.insert(key, at);
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }
}

/// The LSN of the record an `unsupported_record` error names ("... at LSN X/X: ..."), if it is
/// one of `records`' (the child is not trusted to name one).
fn unsupported_at(error: &RedoError, records: &[(Lsn, Bytes)]) -> Option<Lsn> {
    let RedoError::Rejected { code: ErrorCode::UnsupportedRecord, message } = error else {
        return None;
    };
    let (_, rest) = message.split_once("at LSN ")?;
    let word = rest.split(|c: char| c == ':' || c.is_whitespace()).next()?;
    let at: Lsn = word.parse().ok()?;
    records.iter().any(|(lsn, _)| *lsn == at).then_some(at)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn key(blknum: u32) -> BufferTag {
        BufferTag { spcnode: 1663, dbnode: 5, relnode: 16384, forknum: 0, blknum }
    }

    fn unsupported(message: &str) -> RedoError {
        RedoError::Rejected { code: ErrorCode::UnsupportedRecord, message: message.into() }
    }

    fn records(lsns: &[u64]) -> Vec<(Lsn, Bytes)> {
        lsns.iter().map(|&l| (Lsn(l), Bytes::new())).collect()
    }

    #[test]
    fn a_failing_record_is_skipped_until_a_chain_starts_at_or_above_it() {
        let mut u = Unredoable::default();
        let e = unsupported("record at LSN 0/28: Gin info 0x20: not applied by this walredo-proc");
        u.failed(key(1), &records(&[0x20, 0x28, 0x30]), &e);
        assert_eq!(u.len(), 1);
        // From nothing or from an image below it, up to it or beyond: it would fail again.
        assert!(u.fails(key(1), None, Lsn(0x28)));
        assert!(u.fails(key(1), Some(Lsn(0x10)), Lsn(0x90)));
        // A piece that ends below it does not apply it; another key is not concerned.
        assert!(!u.fails(key(1), Some(Lsn(0x10)), Lsn(0x20)));
        assert!(!u.fails(key(2), None, Lsn(0x90)));
        assert_eq!(u.len(), 1);
        // An image at or above it: tried again, and forgotten.
        assert!(!u.fails(key(1), Some(Lsn(0x28)), Lsn(0x90)));
        assert_eq!(u.len(), 0);
        assert!(!u.fails(key(1), None, Lsn(0x90)));
    }

    #[test]
    fn only_an_unsupported_record_of_the_request_is_remembered() {
        let mut u = Unredoable::default();
        let recs = records(&[0x20, 0x28]);
        // Another code, an LSN not in the request, no LSN at all.
        let other = RedoError::Rejected {
            code: ErrorCode::ApplyFailed,
            message: "record at LSN 0/28: does not fit".into(),
        };
        u.failed(key(1), &recs, &other);
        u.failed(key(1), &recs, &unsupported("record at LSN 0/99: Gin info 0x20"));
        u.failed(key(1), &recs, &unsupported("Gin info 0x20"));
        u.failed(key(1), &recs, &RedoError::Timeout(std::time::Duration::from_secs(1)));
        assert_eq!(u.len(), 0);
        u.failed(key(1), &recs, &unsupported("record at LSN 0/20: Gin info 0x20"));
        assert!(u.fails(key(1), None, Lsn(0x28)));
    }

    #[test]
    fn past_the_cap_the_oldest_failing_record_is_forgotten() {
        let mut u = Unredoable::with_max(3);
        for i in 1..=5u32 {
            let lsn = u64::from(i) * 8;
            u.failed(key(i), &records(&[lsn]), &unsupported(&format!("record at LSN {}: x", Lsn(lsn))));
            assert!(u.len() <= 3);
        }
        assert_eq!(u.len(), 3);
        assert!(!u.fails(key(1), None, Lsn(100)) && !u.fails(key(2), None, Lsn(100)));
        assert!((3..=5).all(|i| u.fails(key(i), None, Lsn(100))));
    }
}
