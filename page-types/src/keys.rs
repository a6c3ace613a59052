//! The key space of a PostgreSQL cluster's tenant: which [`BufferTag`]s name relation pages and
//! which name the cluster's other values (relation sizes, SLRU pages and truncated segments, the
//! control file, the relation mapper files, the checkpoint counters, dropped databases, prepared
//! transactions' state files).
//!
//! A relation page keeps PostgreSQL's buffer tag: fork 0 (main), 1 (free space map), 2
//! (visibility map) or 3 (init). Every other value lives at a fork number of 0x80 or more, a
//! range PostgreSQL never uses (its forks are 0..=3), so the two spaces never meet and storage
//! keeps both in one ordered key space:
//!
//! | what | forknum | spcnode | dbnode | relnode | blknum | value |
//! |---|---|---|---|---|---|---|
//! | size of a relation fork | `0x80 + fork` | spc | db | rel | 0 | `u32` LE blocks; empty: dropped |
//! | SLRU page | `0x90` | [`SlruKind`] | 0 | segment no. | page in segment | 8 KiB page; records too |
//! | a truncated SLRU segment | `0x91` | [`SlruKind`] | 0 | segment no. | 0 | empty |
//! | `global/pg_control` | `0xA0` | 0 | 0 | 0 | 0 | the file |
//! | `pg_filenode.map` | `0xA1` | spc | db (0: global) | 0 | 0 | the file (512 bytes) |
//! | the checkpoint counters | `0xA2` | 0 | 0 | 0 | 0 | PostgreSQL's `CheckPoint` (88 bytes) |
//! | the control file's parameters | `0xA3` | 0 | 0 | 0 | 0 | the data of the last `XLOG_PARAMETER_CHANGE` (`xl_parameter_change`) |
//! | a configuration file ([`CONFIG_FILES`]) | `0xA4` | 0 | 0 | its index there | chunk | 8 KiB of the file; the last chunk is shorter (maybe empty) |
//! | a dropped database | `0xB0` | spc | db | 0 | 0 | empty |
//! | a dropped relation | `0xB1` | spc | db | rel | 0 | empty |
//! | a prepared transaction's state file (`pg_twophase/<xid>`) | `0xC0` | 0 | 0 | the xid | chunk | 8 KiB of the file (the PREPARE record's data and its CRC-32C); the last chunk is shorter (maybe empty); chunk 0 empty: committed or rolled back (no file) |
//!
//! Values of these keys are complete in themselves (storage keeps them as images of 0 to 8192
//! bytes): the newest at or below an LSN is the answer, no redo; except SLRU pages, which are
//! pages as relation pages are ([`holds_pages`]): an image, then records (the `pg15` family's
//! CLOG status changes and MultiXact writes) that the redo child applies; a page with records
//! and no image below them is built from zeros, as PostgreSQL's recovery reads an SLRU page it
//! has no file for. An SLRU page whose newest value at or below an LSN is older than a drop of
//! its segment at or below that LSN does not exist then. A relation fork exists at an
//! LSN when its newest size value at or below it is not the dropped marker and no drop of its
//! database is newer than that value. A relation page whose newest value at or below an LSN is
//! older than a drop of its relation or database at or below that LSN belongs to a dropped
//! incarnation of that relfilenode (reused after OID wraparound): not the page as of then.
//!
//! Invariant: pure; no input makes anything here panic.

use crate::BufferTag;

/// PostgreSQL's forks: main, free space map, visibility map, init.
pub const MAIN_FORK: u8 = 0;
pub const FSM_FORK: u8 = 1;
pub const VM_FORK: u8 = 2;
pub const INIT_FORK: u8 = 3;
/// The highest fork number of a relation page.
pub const MAX_FORK: u8 = INIT_FORK;

/// Fork numbers of the values that are not relation pages start here.
pub const FIRST_META_FORK: u8 = 0x80;
const REL_SIZE_FORK: u8 = 0x80;
const SLRU_FORK: u8 = 0x90;
const CONTROL_FILE_FORK: u8 = 0xA0;
const RELMAP_FORK: u8 = 0xA1;
const CHECKPOINT_FORK: u8 = 0xA2;
const PARAMETERS_FORK: u8 = 0xA3;
const SLRU_SEGMENT_DROP_FORK: u8 = 0x91;
const CONFIG_FILE_FORK: u8 = 0xA4;
const DB_DROP_FORK: u8 = 0xB0;
const REL_DROP_FORK: u8 = 0xB1;
const TWO_PHASE_FORK: u8 = 0xC0;

/// Pages per SLRU segment (PostgreSQL's `SLRU_PAGES_PER_SEGMENT`).
pub const SLRU_PAGES_PER_SEGMENT: u32 = 32;
/// Size of a relation mapper file (`pg_filenode.map`).
pub const RELMAP_FILE_SIZE: usize = 512;
/// Size of `global/pg_control`.
pub const CONTROL_FILE_SIZE: usize = 8192;
/// The configuration files of a data directory that a tenant keeps from its import, so that a
/// base backup of it starts as the primary was configured (the index in this list is the key's).
pub const CONFIG_FILES: [&str; 4] =
    ["postgresql.conf", "postgresql.auto.conf", "pg_hba.conf", "pg_ident.conf"];
/// The largest configuration file kept (PostgreSQL's sample `postgresql.conf` is 29 KB).
pub const CONFIG_FILE_MAX_BYTES: usize = 1 << 20;

/// A relation: tablespace, database, relfilenode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RelTag {
    pub spcnode: u32,
    pub dbnode: u32,
    pub relnode: u32,
}

impl RelTag {
    /// The relation that `key` (a page, a size or a drop marker of a relation) names.
    pub fn of(key: &BufferTag) -> RelTag {
        RelTag { spcnode: key.spcnode, dbnode: key.dbnode, relnode: key.relnode }
    }

    /// The key whose values mark the drops of this relation (every fork).
    pub fn drop_key(self) -> BufferTag {
        BufferTag {
            spcnode: self.spcnode,
            dbnode: self.dbnode,
            relnode: self.relnode,
            forknum: REL_DROP_FORK,
            blknum: 0,
        }
    }

    /// Block `blknum` of `fork`.
    pub fn page(self, fork: u8, blknum: u32) -> BufferTag {
        BufferTag { spcnode: self.spcnode, dbnode: self.dbnode, relnode: self.relnode, forknum: fork, blknum }
    }

    /// The key of the size of `fork` of this relation.
    pub fn size_key(self, fork: u8) -> BufferTag {
        self.page(REL_SIZE_FORK.saturating_add(fork), 0)
    }
}

impl std::fmt::Display for RelTag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}/{}", self.spcnode, self.dbnode, self.relnode)
    }
}

/// The SLRUs a tenant keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SlruKind {
    /// `pg_xact`: commit status of transactions.
    Clog,
    /// `pg_multixact/offsets`.
    MultiXactOffsets,
    /// `pg_multixact/members`.
    MultiXactMembers,
}

impl SlruKind {
    fn to_u32(self) -> u32 {
        match self {
            SlruKind::Clog => 0,
            SlruKind::MultiXactOffsets => 1,
            SlruKind::MultiXactMembers => 2,
        }
    }

    fn from_u32(v: u32) -> Option<SlruKind> {
        match v {
            0 => Some(SlruKind::Clog),
            1 => Some(SlruKind::MultiXactOffsets),
            2 => Some(SlruKind::MultiXactMembers),
            _ => None,
        }
    }

    /// Its directory in a data directory.
    pub fn dir(self) -> &'static str {
        match self {
            SlruKind::Clog => "pg_xact",
            SlruKind::MultiXactOffsets => "pg_multixact/offsets",
            SlruKind::MultiXactMembers => "pg_multixact/members",
        }
    }
}

/// The key of page `page` (0..32) of SLRU segment `segno`.
pub fn slru_page_key(kind: SlruKind, segno: u32, page: u32) -> BufferTag {
    BufferTag { spcnode: kind.to_u32(), dbnode: 0, relnode: segno, forknum: SLRU_FORK, blknum: page }
}

/// The key whose values mark the truncations of SLRU segment `segno` (PostgreSQL removed its
/// file): pages older than such a value are gone.
pub fn slru_segment_drop_key(kind: SlruKind, segno: u32) -> BufferTag {
    BufferTag {
        spcnode: kind.to_u32(),
        dbnode: 0,
        relnode: segno,
        forknum: SLRU_SEGMENT_DROP_FORK,
        blknum: 0,
    }
}

/// The key of the checkpoint counters: PostgreSQL's `CheckPoint` as the WAL left it (next
/// transaction id, next OID, multixact counters, oldest transaction ids, ...).
pub fn checkpoint_key() -> BufferTag {
    BufferTag { spcnode: 0, dbnode: 0, relnode: 0, forknum: CHECKPOINT_FORK, blknum: 0 }
}

/// The key of the control file's parameters as the WAL changed them (`XLOG_PARAMETER_CHANGE`:
/// `max_connections`, `max_prepared_transactions`, `wal_level`, ...).
pub fn parameters_key() -> BufferTag {
    BufferTag { spcnode: 0, dbnode: 0, relnode: 0, forknum: PARAMETERS_FORK, blknum: 0 }
}

/// The key of `global/pg_control`.
pub fn control_file_key() -> BufferTag {
    BufferTag { spcnode: 0, dbnode: 0, relnode: 0, forknum: CONTROL_FILE_FORK, blknum: 0 }
}

/// The key of a relation mapper file: the shared one is tablespace 1664 (`pg_global`),
/// database 0; a database's own is in its tablespace.
pub fn relmap_key(spcnode: u32, dbnode: u32) -> BufferTag {
    BufferTag { spcnode, dbnode, relnode: 0, forknum: RELMAP_FORK, blknum: 0 }
}

/// The key of chunk `chunk` (8 KiB each) of configuration file `index` of [`CONFIG_FILES`].
pub fn config_file_key(index: u32, chunk: u32) -> BufferTag {
    BufferTag { spcnode: 0, dbnode: 0, relnode: index, forknum: CONFIG_FILE_FORK, blknum: chunk }
}

/// The key of chunk `chunk` (8 KiB each, as [`config_file_key`]'s) of the two-phase state file
/// of prepared transaction `xid` (`pg_twophase/<xid>`); an empty chunk 0 means the transaction
/// was committed or rolled back, its file removed.
pub fn two_phase_key(xid: u32, chunk: u32) -> BufferTag {
    BufferTag { spcnode: 0, dbnode: 0, relnode: xid, forknum: TWO_PHASE_FORK, blknum: chunk }
}

/// The key whose values mark the drops of a database in a tablespace.
pub fn db_drop_key(spcnode: u32, dbnode: u32) -> BufferTag {
    BufferTag { spcnode, dbnode, relnode: 0, forknum: DB_DROP_FORK, blknum: 0 }
}

/// What a key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// A page of a relation fork.
    RelPage,
    /// The size of a relation fork.
    RelSize {
        rel: RelTag,
        fork: u8,
    },
    Slru {
        kind: SlruKind,
        segno: u32,
        page: u32,
    },
    /// The truncation marker of an SLRU segment.
    SlruSegmentDrop {
        kind: SlruKind,
        segno: u32,
    },
    ControlFile,
    RelMap,
    /// A chunk of configuration file `index` of [`CONFIG_FILES`].
    ConfigFile {
        index: u32,
        chunk: u32,
    },
    /// The checkpoint counters.
    Checkpoint,
    /// The control file's parameters.
    Parameters,
    DbDrop,
    RelDrop {
        rel: RelTag,
    },
    /// A chunk of the two-phase state file of prepared transaction `xid`.
    TwoPhase {
        xid: u32,
        chunk: u32,
    },
    /// A key that names nothing of the above.
    Unknown,
}

/// What `key` names.
pub fn classify(key: &BufferTag) -> KeyKind {
    let rel = RelTag::of(key);
    match key.forknum {
        f if f <= MAX_FORK => KeyKind::RelPage,
        f if (REL_SIZE_FORK..=REL_SIZE_FORK + MAX_FORK).contains(&f) && key.blknum == 0 => {
            KeyKind::RelSize { rel, fork: f - REL_SIZE_FORK }
        }
        SLRU_FORK if key.dbnode == 0 && key.blknum < SLRU_PAGES_PER_SEGMENT => {
            match SlruKind::from_u32(key.spcnode) {
                Some(kind) => KeyKind::Slru { kind, segno: key.relnode, page: key.blknum },
                None => KeyKind::Unknown,
            }
        }
        SLRU_SEGMENT_DROP_FORK if key.dbnode == 0 && key.blknum == 0 => match SlruKind::from_u32(key.spcnode)
        {
            Some(kind) => KeyKind::SlruSegmentDrop { kind, segno: key.relnode },
            None => KeyKind::Unknown,
        },
        CONTROL_FILE_FORK if *key == control_file_key() => KeyKind::ControlFile,
        CHECKPOINT_FORK if *key == checkpoint_key() => KeyKind::Checkpoint,
        PARAMETERS_FORK if *key == parameters_key() => KeyKind::Parameters,
        RELMAP_FORK if key.relnode == 0 && key.blknum == 0 => KeyKind::RelMap,
        CONFIG_FILE_FORK
            if key.spcnode == 0 && key.dbnode == 0 && (key.relnode as usize) < CONFIG_FILES.len() =>
        {
            KeyKind::ConfigFile { index: key.relnode, chunk: key.blknum }
        }
        DB_DROP_FORK if key.relnode == 0 && key.blknum == 0 => KeyKind::DbDrop,
        REL_DROP_FORK if key.blknum == 0 => KeyKind::RelDrop { rel },
        TWO_PHASE_FORK if key.spcnode == 0 && key.dbnode == 0 => {
            KeyKind::TwoPhase { xid: key.relnode, chunk: key.blknum }
        }
        _ => KeyKind::Unknown,
    }
}

/// Whether `key` names a relation page (GetPage's keys); the rest are the cluster's other
/// values, whose stored images may be shorter than a page.
pub fn is_rel_page(key: &BufferTag) -> bool {
    key.forknum <= MAX_FORK
}

/// Whether `key`'s values are 8 KiB pages that redo builds (an image, then records above it):
/// relation pages and SLRU pages. Every other key holds images only.
pub fn holds_pages(key: &BufferTag) -> bool {
    is_rel_page(key) || matches!(classify(key), KeyKind::Slru { .. })
}

/// Where a scan for the relation size keys in key order may go from `key` (any key): the
/// greatest key such that no size key lies above `key` and at or below it. In key order
/// (`BufferTag`'s: tablespace, database, relation, fork, block) a relation's size keys follow
/// its pages, so they are not one range: from a relation's page the scan goes to just below
/// its first size key, from a size key past the rest of its fork, and from any other key past
/// every key of its (tablespace, database, relation).
pub fn rel_sizes_skip(key: &BufferTag) -> BufferTag {
    let forknum = match key.forknum {
        f if f < REL_SIZE_FORK => REL_SIZE_FORK - 1,
        f if f <= REL_SIZE_FORK + MAX_FORK => f,
        _ => u8::MAX,
    };
    BufferTag { forknum, blknum: u32::MAX, ..*key }
}

/// The value of a relation size key: `Some(blocks)`, or `None` for the dropped marker.
pub fn encode_rel_size(blocks: Option<u32>) -> Vec<u8> {
    blocks.map(|b| b.to_le_bytes().to_vec()).unwrap_or_default()
}

/// Reads a relation size value: `Ok(Some(blocks))`, `Ok(None)` (dropped), or an error for
/// bytes that are neither.
pub fn decode_rel_size(value: &[u8]) -> Result<Option<u32>, String> {
    match value.len() {
        0 => Ok(None),
        4 => Ok(Some(u32::from_le_bytes([value[0], value[1], value[2], value[3]]))),
        n => Err(format!("relation size value of {n} bytes, want 4 (or 0: dropped)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_key_classifies_as_what_made_it_and_pages_stay_pages() {
        let rel = RelTag { spcnode: 1663, dbnode: 5, relnode: 16384 };
        for fork in 0..=MAX_FORK {
            assert_eq!(classify(&rel.page(fork, 7)), KeyKind::RelPage);
            assert!(is_rel_page(&rel.page(fork, 7)));
            assert_eq!(classify(&rel.size_key(fork)), KeyKind::RelSize { rel, fork });
            assert!(!is_rel_page(&rel.size_key(fork)));
        }
        assert_eq!(
            classify(&slru_page_key(SlruKind::MultiXactMembers, 3, 31)),
            KeyKind::Slru { kind: SlruKind::MultiXactMembers, segno: 3, page: 31 }
        );
        assert_eq!(
            classify(&slru_segment_drop_key(SlruKind::Clog, 4095)),
            KeyKind::SlruSegmentDrop { kind: SlruKind::Clog, segno: 4095 }
        );
        assert_eq!(classify(&checkpoint_key()), KeyKind::Checkpoint);
        assert_eq!(classify(&parameters_key()), KeyKind::Parameters);
        assert!(holds_pages(&slru_page_key(SlruKind::Clog, 0, 3)) && holds_pages(&rel.page(MAIN_FORK, 1)));
        for other in
            [checkpoint_key(), control_file_key(), slru_segment_drop_key(SlruKind::Clog, 0), rel.size_key(0)]
        {
            assert!(!holds_pages(&other), "{other:?}");
        }
        assert_eq!(classify(&control_file_key()), KeyKind::ControlFile);
        assert_eq!(classify(&relmap_key(1664, 0)), KeyKind::RelMap);
        assert_eq!(classify(&config_file_key(2, 3)), KeyKind::ConfigFile { index: 2, chunk: 3 });
        assert_eq!(classify(&config_file_key(CONFIG_FILES.len() as u32, 0)), KeyKind::Unknown);
        assert_eq!(classify(&db_drop_key(1663, 5)), KeyKind::DbDrop);
        assert_eq!(classify(&rel.drop_key()), KeyKind::RelDrop { rel });
        assert!(!is_rel_page(&rel.drop_key()));
        assert_eq!(
            classify(&two_phase_key(0xDEAD_BEEF, 2)),
            KeyKind::TwoPhase { xid: 0xDEAD_BEEF, chunk: 2 }
        );
        assert!(!is_rel_page(&two_phase_key(7, 0)) && !holds_pages(&two_phase_key(7, 0)));
        assert_eq!(classify(&BufferTag { spcnode: 1663, ..two_phase_key(7, 0) }), KeyKind::Unknown);
        assert_eq!(
            classify(&BufferTag { forknum: 0x90, spcnode: 9, ..control_file_key() }),
            KeyKind::Unknown
        );
        assert_eq!(classify(&BufferTag { forknum: 4, ..control_file_key() }), KeyKind::Unknown);
        assert_eq!(classify(&BufferTag { forknum: 0xFF, ..control_file_key() }), KeyKind::Unknown);
    }

    #[test]
    fn a_scan_for_relation_sizes_skips_no_size_key() {
        let mut all = Vec::new();
        for (spcnode, dbnode) in [(0, 0), (1663, 5)] {
            for relnode in [0, 1, 16384, u32::MAX] {
                for forknum in [0, 3, 4, 0x7F, 0x80, 0x81, 0x83, 0x84, 0x90, 0xA0, 0xC0, 0xFF] {
                    for blknum in [0, 1, u32::MAX] {
                        all.push(BufferTag { spcnode, dbnode, relnode, forknum, blknum });
                    }
                }
            }
        }
        let sizes: Vec<&BufferTag> =
            all.iter().filter(|k| matches!(classify(k), KeyKind::RelSize { .. })).collect();
        for key in &all {
            let skip = rel_sizes_skip(key);
            assert!(skip >= *key, "{key:?} skips back to {skip:?}");
            assert!(!sizes.iter().any(|s| *s > key && **s <= skip), "{key:?} skips to {skip:?}");
        }
        // A relation's pages are skipped to its sizes, a size past the rest of its fork, a
        // database's relation map past the other keys of relation 0.
        let rel = RelTag { spcnode: 1663, dbnode: 5, relnode: 16384 };
        assert!(rel_sizes_skip(&rel.page(MAIN_FORK, 0)) > rel.page(INIT_FORK, u32::MAX));
        assert!(rel_sizes_skip(&rel.size_key(MAX_FORK)) > rel.size_key(MAX_FORK));
        assert!(rel_sizes_skip(&relmap_key(1663, 5)) > db_drop_key(1663, 5));
    }

    #[test]
    fn relation_sizes_round_trip_and_bad_lengths_are_errors() {
        assert_eq!(decode_rel_size(&encode_rel_size(Some(42))), Ok(Some(42)));
        assert_eq!(decode_rel_size(&encode_rel_size(None)), Ok(None));
        assert!(decode_rel_size(&[1, 2, 3]).is_err());
    }
}
