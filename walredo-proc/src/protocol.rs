//! The walredo wire protocol: framing and messages in both directions (see docs/walredo-protocol.md).

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
