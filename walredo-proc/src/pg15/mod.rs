//! The `pg15` record family: a PostgreSQL 15 WAL record as the daemon stores it for one of its
//! blocks and sends it to the child, beside the synthetic family of `record.rs` (docs/walredo-protocol.md,
//! "The pg15 family").
//!
//! A record of this family is what redo of one block needs from one WAL record: the record's
//! resource manager, info bits, transaction id and LSNs, its main data, and its block references
//! (relation, fork, block number, flags), with the data of the block it is stored for (always)
//! and of the others (while the encoding stays within [`MAX_RECORD_LEN`]). Full-page images are
//! never carried: an image the record asks to apply is stored as the block's image instead.
//!
//! Encoding, version 1, little-endian:
//! `kind = 0x10 | version = 1 | rmid u8 | info u8 | xid u32 | lsn u64 | end_lsn u64 |
//! target u8 | nblocks u8 | nblocks x (id u8 | flags u8 | fork u8 | spcnode u32 | dbnode u32 |
//! relnode u32 | blkno u32 | data_len u16 | data) | main_len u32 | main data`;
//! `target` is the block id the value is for; flags: [`FLAG_WILL_INIT`], [`FLAG_HAS_DATA`] (the
//! record had data for the block), [`FLAG_DATA_INCLUDED`] (and it is here), [`FLAG_HAD_IMAGE`].
//!
//! [`redo`] applies the family to pages ([`heap`], [`btree`], [`gin`], [`gist`], [`hash`], [`visibilitymap`],
//! [`sequence`], [`generic`], [`brin`], [`spgist`], and the SLRUs' [`slru`]); a record it does not apply yet fails its request with `unsupported_record`, naming the resource manager
//! and record type.
//! What those routines share is defined here, below all of them: [`RedoError`] and [`Target`]
//! (the record's target block). [`redo`] dispatches to the routines, so they do not import it
//! (ARCHITECTURE.md, "Layers and imports").
//!
//! Invariants: pure, no I/O; [`Pg15Record::decode`] never panics on input and checks every
//! length; [`Pg15Record::encode`] never writes more than [`MAX_RECORD_LEN`] bytes.

pub mod brin;
pub mod btree;
pub mod bufpage;
pub mod generic;
pub mod gin;
pub mod gist;
pub mod hash;
pub mod heap;
pub mod mask;
pub mod redo;
pub mod sequence;
pub mod slru;
pub mod spgist;
pub mod visibilitymap;

use page_types::MAX_RECORD_LEN;

/// The first byte of every record of the family (one of the kinds `record.rs` leaves to it).
pub const KIND_PG15: u8 = 0x10;
/// The first byte of a [`VmClear`]: visibility-map bits a heap record clears without a block
/// reference to the map's page.
pub const KIND_PG15_VM_CLEAR: u8 = 0x11;
/// The first byte of a [`VmTruncate`]: the map bits an SMGR truncate clears on the map page
/// that keeps part of its bits.
pub const KIND_PG15_VM_TRUNCATE: u8 = 0x12;
/// The first byte of a [`slru::ClogSet`]: the status a transaction's commit or abort gives to
/// the transactions of one CLOG page.
pub const KIND_PG15_CLOG_SET: u8 = 0x13;
/// The first byte of a [`slru::SlruWrite`]: bytes a MultiXact record writes at places of an
/// SLRU page.
pub const KIND_PG15_SLRU_WRITE: u8 = 0x14;
/// `VISIBILITYMAP_ALL_VISIBLE` and `VISIBILITYMAP_ALL_FROZEN`: a heap block's two bits.
pub const VM_ALL_VISIBLE: u8 = 0x01;
pub const VM_ALL_FROZEN: u8 = 0x02;
/// Heap blocks one visibility-map page covers (PostgreSQL 15, 8 KiB pages: 2 bits per heap
/// block in the page after its 24-byte header).
pub const HEAPBLOCKS_PER_VM_PAGE: u32 = (8192 - 24) * 4;
/// The encoding's version, the second byte.
pub const FORMAT_VERSION: u8 = 1;
/// `BKPBLOCK_WILL_INIT`: redo does not read the page's previous contents.
pub const FLAG_WILL_INIT: u8 = 0x01;
/// The WAL record had data for this block.
pub const FLAG_HAS_DATA: u8 = 0x02;
/// ...and the data is in this encoding.
pub const FLAG_DATA_INCLUDED: u8 = 0x04;
/// The WAL record had a full-page image of this block (applied as the block's image if
/// `BKPIMAGE_APPLY`; never carried here).
pub const FLAG_HAD_IMAGE: u8 = 0x08;

const FIXED_LEN: usize = 1 + 1 + 1 + 1 + 4 + 8 + 8 + 1 + 1;
const BLOCK_LEN: usize = 1 + 1 + 1 + 4 * 4 + 2;

/// A block reference of a [`Pg15Record`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHeader<'a> {
    pub id: u8,
    pub flags: u8,
    pub fork: u8,
    pub spcnode: u32,
    pub dbnode: u32,
    pub relnode: u32,
    pub blkno: u32,
    /// The block's data, if [`FLAG_DATA_INCLUDED`].
    pub data: &'a [u8],
}

/// One WAL record, stored for its block `target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pg15Record<'a> {
    pub rmid: u8,
    pub info: u8,
    pub xid: u32,
    pub lsn: u64,
    pub end_lsn: u64,
    pub target: u8,
    pub blocks: Vec<BlockHeader<'a>>,
    pub main_data: &'a [u8],
}

/// Why bytes are not a record of the family (`bad_record`), or a record cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Pg15Error {
    #[error("not a pg15 record (kind {0:#04x})")]
    NotPg15(u8),
    #[error("pg15 record format version {0}, this child reads version {FORMAT_VERSION}")]
    Version(u8),
    #[error("pg15 record truncated at byte {0}")]
    Truncated(usize),
    #[error("pg15 record has {0} bytes after its end")]
    Trailing(usize),
    #[error("pg15 record is for block {target}, which it does not reference")]
    NoTarget { target: u8 },
    #[error("pg15 record of {len} bytes is longer than {MAX_RECORD_LEN}")]
    TooLong { len: usize },
    /// A field out of its range: what it must be.
    #[error("pg15 record field out of range: want {0}")]
    Invalid(&'static str),
}

/// Why a record was not applied (by [`redo::apply`], and by the routines it dispatches to).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedoError {
    /// A record this child does not apply yet: its type name.
    #[error("{0}: not applied by this walredo-proc")]
    Unsupported(String),
    /// The record does not decode, or its data is not what its type carries.
    #[error("{0}")]
    Malformed(String),
    /// The record does not fit the page (an offset past the line pointers, no room, ...).
    #[error("{0}")]
    DoesNotFit(String),
}

/// The record's target block, with what the redo routines need of the record around it.
pub struct Target<'r, 'a> {
    pub record: &'r Pg15Record<'a>,
    pub block: &'r BlockHeader<'a>,
}

impl<'r, 'a> Target<'r, 'a> {
    /// The block's data (empty if the record had none for it).
    pub fn data(&self) -> &'a [u8] {
        self.block.data
    }

    pub fn will_init(&self) -> bool {
        self.block.flags & FLAG_WILL_INIT != 0
    }

    /// The type name, for errors.
    pub fn type_name(&self) -> String {
        self.record.type_name()
    }
}

/// One block's redo of a record: the record (its [`Target`]) and which of its blocks the page
/// is, with what the redo of every resource manager shares: errors that name the record type
/// and the block, bounds-checked reads of the main data, the page's LSN. `M` marks the resource
/// manager whose module adds its own helpers (`impl BlockRedo<'_, '_, '_, Btree>` in
/// `btree.rs`, ...), so that two modules' helpers of one name never meet.
pub struct BlockRedo<'t, 'r, 'a, M> {
    pub target: &'t Target<'r, 'a>,
    pub id: u8,
    marker: std::marker::PhantomData<M>,
}

impl<'t, 'r, 'a, M> BlockRedo<'t, 'r, 'a, M> {
    /// The redo of the block `target` is for.
    pub fn new(target: &'t Target<'r, 'a>) -> Self {
        BlockRedo { target, id: target.block.id, marker: std::marker::PhantomData }
    }

    pub fn malformed(&self, what: &str) -> RedoError {
        RedoError::Malformed(format!("{} (block {}): {what}", self.target.type_name(), self.id))
    }

    pub fn no_fit(&self, what: impl std::fmt::Display) -> RedoError {
        RedoError::DoesNotFit(format!("{} (block {}): {what}", self.target.type_name(), self.id))
    }

    pub fn not_touched(&self) -> RedoError {
        self.malformed("the record does not change this block")
    }

    /// `Ok` if the page is the record's block `id`; for a routine of one block.
    pub fn only(&self, id: u8) -> Result<(), RedoError> {
        if self.id == id {
            Ok(())
        } else {
            Err(self.not_touched())
        }
    }

    /// A page primitive's error, with the record named.
    pub fn wrap(&self, e: RedoError) -> RedoError {
        match e {
            RedoError::DoesNotFit(what) => self.no_fit(what),
            RedoError::Malformed(what) => self.malformed(&what),
            other => other,
        }
    }

    pub fn main(&self) -> &'a [u8] {
        self.target.record.main_data
    }

    /// The block's data (empty if the record had none for it).
    pub fn data(&self) -> &'a [u8] {
        self.target.data()
    }

    /// Whether the record references block `id`.
    pub fn has_block(&self, id: u8) -> bool {
        self.target.record.blocks.iter().any(|b| b.id == id)
    }

    pub fn main_at<const N: usize>(&self, at: usize) -> Result<[u8; N], RedoError> {
        le_bytes(self.main(), at).ok_or_else(|| self.malformed("main data too short"))
    }

    pub fn main_u16(&self, at: usize) -> Result<u16, RedoError> {
        self.main_at(at).map(u16::from_le_bytes)
    }

    pub fn main_u32(&self, at: usize) -> Result<u32, RedoError> {
        self.main_at(at).map(u32::from_le_bytes)
    }

    pub fn main_bool(&self, at: usize) -> Result<bool, RedoError> {
        self.main_at::<1>(at).map(|[b]| b != 0)
    }

    /// The record's end LSN as the page's `pd_lsn`.
    pub fn set_lsn(&self, page: &mut crate::page::Page) {
        crate::page::set_page_lsn(page, self.target.record.end_lsn);
    }
}

/// `N` little-endian bytes of `b` at `at`, if it has them.
pub fn le_bytes<const N: usize>(b: &[u8], at: usize) -> Option<[u8; N]> {
    b.get(at..at.checked_add(N)?)?.try_into().ok()
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Pg15Error> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len())
            .ok_or(Pg15Error::Truncated(self.at))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, Pg15Error> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, Pg15Error> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, Pg15Error> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, Pg15Error> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

impl<'a> Pg15Record<'a> {
    /// Decodes a stored record; borrows its payloads from `bytes`.
    pub fn decode(bytes: &'a [u8]) -> Result<Pg15Record<'a>, Pg15Error> {
        if bytes.len() > MAX_RECORD_LEN {
            return Err(Pg15Error::TooLong { len: bytes.len() });
        }
        let mut r = Reader { bytes, at: 0 };
        let kind = r.u8()?;
        if kind != KIND_PG15 {
            return Err(Pg15Error::NotPg15(kind));
        }
        let version = r.u8()?;
        if version != FORMAT_VERSION {
            return Err(Pg15Error::Version(version));
        }
        let (rmid, info, xid, lsn, end_lsn) = (r.u8()?, r.u8()?, r.u32()?, r.u64()?, r.u64()?);
        let (target, nblocks) = (r.u8()?, r.u8()?);
        let mut blocks = Vec::with_capacity(usize::from(nblocks));
        for _ in 0..nblocks {
            let (id, flags, fork) = (r.u8()?, r.u8()?, r.u8()?);
            let (spcnode, dbnode, relnode, blkno) = (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
            let len = r.u16()?;
            let data = r.take(usize::from(len))?;
            blocks.push(BlockHeader { id, flags, fork, spcnode, dbnode, relnode, blkno, data });
        }
        let main_len = r.u32()?;
        let main_data = r.take(usize::try_from(main_len).map_err(|_| Pg15Error::Truncated(r.at))?)?;
        if r.at != bytes.len() {
            return Err(Pg15Error::Trailing(bytes.len() - r.at));
        }
        if !blocks.iter().any(|b| b.id == target) {
            return Err(Pg15Error::NoTarget { target });
        }
        Ok(Pg15Record { rmid, info, xid, lsn, end_lsn, target, blocks, main_data })
    }

    /// Encodes the record. The target block's data is always carried, the other blocks' while
    /// the whole stays within [`MAX_RECORD_LEN`] (their [`FLAG_DATA_INCLUDED`] says which are);
    /// `TooLong` if even the target's data and the main data do not fit.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), Pg15Error> {
        let target_data = self
            .blocks
            .iter()
            .find(|b| b.id == self.target)
            .map(|b| b.data.len())
            .ok_or(Pg15Error::NoTarget { target: self.target })?;
        let mut len = FIXED_LEN + self.blocks.len() * BLOCK_LEN + 4 + self.main_data.len() + target_data;
        if len > MAX_RECORD_LEN || self.blocks.len() > usize::from(u8::MAX) {
            return Err(Pg15Error::TooLong { len });
        }
        // One allocation: at most every block's data (those that do not fit are left out).
        let all_data: usize = self.blocks.iter().map(|b| b.data.len()).sum();
        out.reserve((len - target_data + all_data).min(MAX_RECORD_LEN));
        let start = out.len();
        out.extend_from_slice(&[KIND_PG15, FORMAT_VERSION, self.rmid, self.info]);
        out.extend_from_slice(&self.xid.to_le_bytes());
        out.extend_from_slice(&self.lsn.to_le_bytes());
        out.extend_from_slice(&self.end_lsn.to_le_bytes());
        out.extend_from_slice(&[self.target, self.blocks.len() as u8]);
        for b in &self.blocks {
            let include = b.id == self.target
                || (len + b.data.len() <= MAX_RECORD_LEN && u16::try_from(b.data.len()).is_ok());
            if include && b.id != self.target {
                len += b.data.len();
            }
            let data: &[u8] = if include { b.data } else { &[] };
            let Ok(data_len) = u16::try_from(data.len()) else {
                out.truncate(start);
                return Err(Pg15Error::TooLong { len: data.len() });
            };
            let mut flags = b.flags & !FLAG_DATA_INCLUDED;
            if include && !data.is_empty() {
                flags |= FLAG_DATA_INCLUDED;
            }
            out.extend_from_slice(&[b.id, flags, b.fork]);
            for v in [b.spcnode, b.dbnode, b.relnode, b.blkno] {
                out.extend_from_slice(&v.to_le_bytes());
            }
            out.extend_from_slice(&data_len.to_le_bytes());
            out.extend_from_slice(data);
        }
        out.extend_from_slice(&(self.main_data.len() as u32).to_le_bytes());
        out.extend_from_slice(self.main_data);
        debug_assert!(out.len() - start <= MAX_RECORD_LEN);
        Ok(())
    }

    /// The record's type as PostgreSQL names it: resource manager and operation, e.g.
    /// `Heap INSERT+INIT` or `Btree INSERT_LEAF`; unknown operations by their info bits.
    pub fn type_name(&self) -> String {
        record_type_name(self.rmid, self.info)
    }
}

/// `Heap INSERT+INIT`, `Heap2 PRUNE`, `Btree SPLIT_L`, `Gin INSERT`, `Gist PAGE_SPLIT`, `Sequence LOG`, ...: the
/// resource manager and the operation as `pg_waldump` names them (PostgreSQL 15's `*desc.c`
/// `rm_identify`; Generic WAL's one operation is `Generic`, so `Generic Generic`) for the
/// families this project redoes, `<rmgr> info 0x..` for the others.
pub fn record_type_name(rmid: u8, info: u8) -> String {
    let rmgr = page_types::wal::rmgr::rmgr_name(rmid).unwrap_or(std::borrow::Cow::Borrowed("invalid"));
    let op = info & 0x70;
    let name: Option<&str> = match rmid {
        // Heap: XLOG_HEAP_OPMASK 0x70; 0x80 is XLOG_HEAP_INIT_PAGE.
        redo::RM_HEAP => {
            ["INSERT", "DELETE", "UPDATE", "TRUNCATE", "HOT_UPDATE", "CONFIRM", "LOCK", "INPLACE"]
                .get(usize::from(op >> 4))
                .copied()
        }
        redo::RM_HEAP2 => [
            "REWRITE",
            "PRUNE",
            "VACUUM",
            "FREEZE_PAGE",
            "VISIBLE",
            "MULTI_INSERT",
            "LOCK_UPDATED",
            "NEW_CID",
        ]
        .get(usize::from(op >> 4))
        .copied(),
        redo::RM_BTREE => match info & 0xF0 {
            0x00 => Some("INSERT_LEAF"),
            0x10 => Some("INSERT_UPPER"),
            0x20 => Some("INSERT_META"),
            0x30 => Some("SPLIT_L"),
            0x40 => Some("SPLIT_R"),
            0x50 => Some("INSERT_POST"),
            0x60 => Some("DEDUP"),
            0x70 => Some("DELETE"),
            0x80 => Some("UNLINK_PAGE"),
            0x90 => Some("UNLINK_PAGE_META"),
            0xA0 => Some("NEWROOT"),
            0xB0 => Some("MARK_PAGE_HALFDEAD"),
            0xC0 => Some("VACUUM"),
            0xD0 => Some("REUSE_PAGE"),
            0xE0 => Some("META_CLEANUP"),
            _ => None,
        },
        redo::RM_GIN => match info & 0xF0 {
            0x10 => Some("CREATE_PTREE"),
            0x20 => Some("INSERT"),
            0x30 => Some("SPLIT"),
            0x40 => Some("VACUUM_PAGE"),
            0x50 => Some("DELETE_PAGE"),
            0x60 => Some("UPDATE_META_PAGE"),
            0x70 => Some("INSERT_LISTPAGE"),
            0x80 => Some("DELETE_LISTPAGE"),
            0x90 => Some("VACUUM_DATA_LEAF_PAGE"),
            _ => None,
        },
        redo::RM_GIST => match info & 0xF0 {
            0x00 => Some("PAGE_UPDATE"),
            0x10 => Some("DELETE"),
            0x20 => Some("PAGE_REUSE"),
            0x30 => Some("PAGE_SPLIT"),
            0x60 => Some("PAGE_DELETE"),
            0x70 => Some("ASSIGN_LSN"),
            _ => None,
        },
        redo::RM_SEQ => (info & 0xF0 == 0).then_some("LOG"),
        redo::RM_GENERIC => Some("Generic"),
        redo::RM_BRIN => {
            ["CREATE_INDEX", "INSERT", "UPDATE", "SAMEPAGE_UPDATE", "REVMAP_EXTEND", "DESUMMARIZE"]
                .get(usize::from(op >> 4))
                .copied()
        }
        redo::RM_HASH => hash::TYPE_NAMES.get(usize::from(info >> 4)).copied(),
        redo::RM_SPGIST => spgist::TYPE_NAMES.get(usize::from(info >> 4)).copied().flatten(),
        page_types::wal::rmgr::RM_XACT_ID => {
            ["COMMIT", "PREPARE", "ABORT", "COMMIT_PREPARED", "ABORT_PREPARED", "ASSIGNMENT", "INVALIDATIONS"]
                .get(usize::from(op >> 4))
                .copied()
        }
        page_types::wal::rmgr::RM_CLOG_ID => match info & 0xF0 {
            0x00 => Some("ZEROPAGE"),
            0x10 => Some("TRUNCATE"),
            _ => None,
        },
        page_types::wal::rmgr::RM_MULTIXACT_ID => {
            ["ZERO_OFF_PAGE", "ZERO_MEM_PAGE", "CREATE_ID", "TRUNCATE_ID"]
                .get(usize::from(info >> 4))
                .copied()
        }
        page_types::wal::rmgr::RM_XLOG_ID => match info & 0xF0 {
            0xA0 => Some("FPI"),
            0xB0 => Some("FPI_FOR_HINT"),
            _ => None,
        },
        _ => None,
    };
    match name {
        Some(name)
            if matches!(rmid, redo::RM_HEAP | redo::RM_HEAP2 | redo::RM_BRIN)
                && info & 0x80 != 0
                && matches!(name, "INSERT" | "UPDATE" | "HOT_UPDATE" | "MULTI_INSERT") =>
        {
            format!("{rmgr} {name}+INIT")
        }
        Some(name) => format!("{rmgr} {name}"),
        None => format!("{rmgr} info {info:#04x}"),
    }
}

/// Visibility-map bits cleared by a heap record that does not reference the map's page
/// (`ALL_VISIBLE_CLEARED`, `ALL_FROZEN_CLEARED` in its flags): the daemon derives one for each
/// map page such a record touches and stores it at the record's end LSN, for that page.
/// Encoding, little-endian: `kind = 0x11 | version = 1 | rmid u8 | info u8 | lsn u64 |
/// end_lsn u64 | n u8 | n x (heap block u32 | bits u8)`, bits of [`VM_ALL_VISIBLE`] and
/// [`VM_ALL_FROZEN`] to clear.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmClear {
    pub rmid: u8,
    pub info: u8,
    pub lsn: u64,
    pub end_lsn: u64,
    pub clears: Vec<(u32, u8)>,
}

impl VmClear {
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), Pg15Error> {
        let n = u8::try_from(self.clears.len()).map_err(|_| Pg15Error::TooLong { len: self.clears.len() })?;
        out.extend_from_slice(&[KIND_PG15_VM_CLEAR, FORMAT_VERSION, self.rmid, self.info]);
        out.extend_from_slice(&self.lsn.to_le_bytes());
        out.extend_from_slice(&self.end_lsn.to_le_bytes());
        out.push(n);
        for (block, bits) in &self.clears {
            out.extend_from_slice(&block.to_le_bytes());
            out.push(*bits);
        }
        Ok(())
    }

    pub fn decode(bytes: &[u8]) -> Result<VmClear, Pg15Error> {
        let mut r = Reader { bytes, at: 0 };
        let kind = r.u8()?;
        if kind != KIND_PG15_VM_CLEAR {
            return Err(Pg15Error::NotPg15(kind));
        }
        let version = r.u8()?;
        if version != FORMAT_VERSION {
            return Err(Pg15Error::Version(version));
        }
        let (rmid, info, lsn, end_lsn, n) = (r.u8()?, r.u8()?, r.u64()?, r.u64()?, r.u8()?);
        let mut clears = Vec::with_capacity(usize::from(n));
        for _ in 0..n {
            clears.push((r.u32()?, r.u8()?));
        }
        if r.at != bytes.len() {
            return Err(Pg15Error::Trailing(bytes.len() - r.at));
        }
        Ok(VmClear { rmid, info, lsn, end_lsn, clears })
    }

    pub fn type_name(&self) -> String {
        format!("{} (its visibility-map clear)", record_type_name(self.rmid, self.info))
    }
}

/// The visibility-map bits an SMGR TRUNCATE of a heap to `heap_blocks` blocks clears on the map
/// page that keeps some of its bits (PostgreSQL's `visibilitymap_prepare_truncate`, which a
/// standby runs in redo: it writes no WAL for the page), derived by the daemon at ingest and
/// stored for that map page (block `heap_blocks / HEAPBLOCKS_PER_VM_PAGE`) at the record's end
/// LSN. Encoding, little-endian: `kind = 0x12 | version = 1 | lsn u64 | end_lsn u64 |
/// heap_blocks u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmTruncate {
    pub lsn: u64,
    pub end_lsn: u64,
    pub heap_blocks: u32,
}

impl VmTruncate {
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[KIND_PG15_VM_TRUNCATE, FORMAT_VERSION]);
        out.extend_from_slice(&self.lsn.to_le_bytes());
        out.extend_from_slice(&self.end_lsn.to_le_bytes());
        out.extend_from_slice(&self.heap_blocks.to_le_bytes());
    }

    pub fn decode(bytes: &[u8]) -> Result<VmTruncate, Pg15Error> {
        let mut r = Reader { bytes, at: 0 };
        let kind = r.u8()?;
        if kind != KIND_PG15_VM_TRUNCATE {
            return Err(Pg15Error::NotPg15(kind));
        }
        let version = r.u8()?;
        if version != FORMAT_VERSION {
            return Err(Pg15Error::Version(version));
        }
        let (lsn, end_lsn, heap_blocks) = (r.u64()?, r.u64()?, r.u32()?);
        if r.at != bytes.len() {
            return Err(Pg15Error::Trailing(bytes.len() - r.at));
        }
        Ok(VmTruncate { lsn, end_lsn, heap_blocks })
    }

    pub fn type_name(&self) -> String {
        "Storage TRUNCATE (its visibility-map bits)".to_string()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample<'a>(main: &'a [u8], d0: &'a [u8], d1: &'a [u8]) -> Pg15Record<'a> {
        let block = |id, data| BlockHeader {
            id,
            flags: FLAG_HAS_DATA,
            fork: 0,
            spcnode: 1663,
            dbnode: 5,
            relnode: 16384,
            blkno: u32::from(id) + 7,
            data,
        };
        Pg15Record {
            rmid: 10,
            info: 0x80,
            xid: 735,
            lsn: 0x1_0000_0028,
            end_lsn: 0x1_0000_0068,
            target: 1,
            blocks: vec![block(0, d0), block(1, d1)],
            main_data: main,
        }
    }

    #[test]
    fn vm_truncates_round_trip_and_refuse_what_is_cut_or_too_long() {
        let t = VmTruncate { lsn: 0x28, end_lsn: 0x60, heap_blocks: 40_000 };
        let mut out = Vec::new();
        t.encode(&mut out);
        assert_eq!(VmTruncate::decode(&out), Ok(t));
        assert!(VmTruncate::decode(&out[..out.len() - 1]).is_err());
        out.push(0);
        assert_eq!(VmTruncate::decode(&out), Err(Pg15Error::Trailing(1)));
    }

    #[test]
    fn a_record_round_trips_and_names_its_type() {
        let rec = sample(b"main", b"zero", b"one");
        let mut out = Vec::new();
        rec.encode(&mut out).unwrap();
        let back = Pg15Record::decode(&out).unwrap();
        assert_eq!(back.main_data, b"main");
        assert_eq!((back.blocks[0].data, back.blocks[1].data), (&b"zero"[..], &b"one"[..]));
        assert!(back.blocks.iter().all(|b| b.flags & FLAG_DATA_INCLUDED != 0));
        assert_eq!(back.type_name(), "Heap INSERT+INIT");
        assert_eq!(record_type_name(9, 0x10), "Heap2 PRUNE");
        assert_eq!(record_type_name(11, 0x40), "Btree SPLIT_R");
        assert_eq!(record_type_name(0, 0xA0), "XLOG FPI");
        assert_eq!(record_type_name(14, 0x30), "Gist PAGE_SPLIT");
        assert_eq!(record_type_name(12, 0xC0), "Hash VACUUM_ONE_PAGE");
        assert_eq!(record_type_name(12, 0xD0), "Hash info 0xd0");
        assert_eq!(record_type_name(15, 0x02), "Sequence LOG");
        assert_eq!(record_type_name(20, 0x00), "Generic Generic");
        assert_eq!(record_type_name(17, 0xA2), "BRIN UPDATE+INIT");
        assert_eq!(record_type_name(17, 0x50), "BRIN DESUMMARIZE");
        assert_eq!(record_type_name(17, 0x02), "BRIN CREATE_INDEX");
        assert_eq!(record_type_name(13, 0x90), "Gin VACUUM_DATA_LEAF_PAGE");
        assert_eq!(record_type_name(13, 0xA0), "Gin info 0xa0");
        assert_eq!(record_type_name(1, 0xB0), "Transaction COMMIT_PREPARED");
        assert_eq!(record_type_name(1, 0x70), "Transaction info 0x70");
        assert_eq!(record_type_name(3, 0x10), "CLOG TRUNCATE");
        assert_eq!(record_type_name(6, 0x20), "MultiXact CREATE_ID");
        assert_eq!(record_type_name(6, 0x40), "MultiXact info 0x40");
    }

    #[test]
    fn other_blocks_lose_their_data_before_the_record_outgrows_the_limit() {
        let big = vec![7u8; 9000];
        let rec = sample(b"m", &big, &big);
        let mut out = Vec::new();
        rec.encode(&mut out).unwrap();
        assert!(out.len() <= MAX_RECORD_LEN);
        let back = Pg15Record::decode(&out).unwrap();
        assert_eq!(back.blocks[1].data.len(), 9000, "the target keeps its data");
        assert!(back.blocks[0].data.is_empty() && back.blocks[0].flags & FLAG_DATA_INCLUDED == 0);
        assert!(back.blocks[0].flags & FLAG_HAS_DATA != 0);
        let huge = vec![1u8; MAX_RECORD_LEN];
        assert!(matches!(sample(b"", b"", &huge).encode(&mut Vec::new()), Err(Pg15Error::TooLong { .. })));
    }

    #[test]
    fn malformed_records_are_errors() {
        let mut out = Vec::new();
        sample(b"main", b"a", b"b").encode(&mut out).unwrap();
        assert_eq!(Pg15Record::decode(&out[..out.len() - 1]), Err(Pg15Error::Truncated(out.len() - 4)));
        let mut long = out.clone();
        long.push(0);
        assert_eq!(Pg15Record::decode(&long), Err(Pg15Error::Trailing(1)));
        let mut v2 = out.clone();
        v2[1] = 2;
        assert_eq!(Pg15Record::decode(&v2), Err(Pg15Error::Version(2)));
        let mut no_target = out.clone();
        no_target[FIXED_LEN - 2] = 9;
        assert_eq!(Pg15Record::decode(&no_target), Err(Pg15Error::NoTarget { target: 9 }));
        assert_eq!(Pg15Record::decode(&[0x01]), Err(Pg15Error::NotPg15(1)));
        assert_eq!(Pg15Record::decode(&[]), Err(Pg15Error::Truncated(0)));
    }

    #[test]
    fn a_vm_clear_round_trips_and_a_broken_one_is_an_error() {
        let clear =
            VmClear { rmid: 10, info: 0x20, lsn: 0x28, end_lsn: 0x68, clears: vec![(7, 3), (40000, 2)] };
        let mut out = Vec::new();
        clear.encode(&mut out).unwrap();
        assert_eq!(VmClear::decode(&out).unwrap(), clear);
        assert_eq!(clear.type_name(), "Heap UPDATE (its visibility-map clear)");
        assert_eq!(VmClear::decode(&out[..out.len() - 1]), Err(Pg15Error::Truncated(out.len() - 1)));
        assert!(VmClear::decode(&[KIND_PG15]).is_err());
    }

    proptest! {
        #[test]
        fn vm_clear_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut bytes = bytes;
            if bytes.len() > 2 {
                bytes[0] = KIND_PG15_VM_CLEAR;
                bytes[1] = FORMAT_VERSION;
            }
            let _ = VmClear::decode(&bytes);
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200), tweak in any::<bool>()) {
            let mut bytes = bytes;
            if tweak && bytes.len() > 2 {
                bytes[0] = KIND_PG15;
                bytes[1] = FORMAT_VERSION;
            }
            let _ = Pg15Record::decode(&bytes);
        }
    }
}
