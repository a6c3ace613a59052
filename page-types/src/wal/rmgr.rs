//! PostgreSQL 15's resource manager ids and the names `pg_waldump` prints for them
//! (`src/include/access/rmgrlist.h`), so that our counts can be compared with its `--stats`.
//!
//! **Invariants:** the table is PostgreSQL 15's, in id order; ids 128 to 255 are custom
//! resource managers (named `custom###` as `pg_waldump` does); every other id is invalid.

/// `RM_XLOG_ID`: checkpoints, switches, full-page writes, parameter changes.
pub const RM_XLOG_ID: u8 = 0;
/// The resource managers whose records the pageserver reads beyond counting them.
pub const RM_XACT_ID: u8 = 1;
pub const RM_SMGR_ID: u8 = 2;
pub const RM_CLOG_ID: u8 = 3;
pub const RM_DBASE_ID: u8 = 4;
pub const RM_MULTIXACT_ID: u8 = 6;
pub const RM_RELMAP_ID: u8 = 7;
pub const RM_HEAP2_ID: u8 = 9;
pub const RM_HEAP_ID: u8 = 10;
pub const RM_BTREE_ID: u8 = 11;
pub const RM_GIN_ID: u8 = 13;
pub const RM_GIST_ID: u8 = 14;
pub const RM_SEQ_ID: u8 = 15;
pub const RM_SPGIST_ID: u8 = 16;
pub const RM_BRIN_ID: u8 = 17;
pub const RM_GENERIC_ID: u8 = 20;
pub const RM_HASH_ID: u8 = 12;
/// The largest built-in id in PostgreSQL 15 (`RM_MAX_BUILTIN_ID`).
pub const RM_MAX_BUILTIN_ID: u8 = 21;
/// The first id for custom (extension) resource managers (`RM_MIN_CUSTOM_ID`).
pub const RM_MIN_CUSTOM_ID: u8 = 128;

/// `XLOG_CHECKPOINT_SHUTDOWN` in `xl_info` of an [`RM_XLOG_ID`] record: a checkpoint written at
/// a clean shutdown (its main data is a `CheckPoint`, [`super::checkpoint`]).
pub const XLOG_CHECKPOINT_SHUTDOWN: u8 = 0x00;
/// `XLOG_CHECKPOINT_ONLINE`: a checkpoint written while the server runs.
pub const XLOG_CHECKPOINT_ONLINE: u8 = 0x10;
/// `XLOG_SWITCH` in `xl_info` of an [`RM_XLOG_ID`] record: the rest of the segment is unused.
pub const XLOG_SWITCH: u8 = 0x40;

/// The built-in resource managers, indexed by id.
pub const BUILTIN_RMGR_NAMES: [&str; RM_MAX_BUILTIN_ID as usize + 1] = [
    "XLOG",
    "Transaction",
    "Storage",
    "CLOG",
    "Database",
    "Tablespace",
    "MultiXact",
    "RelMap",
    "Standby",
    "Heap2",
    "Heap",
    "Btree",
    "Hash",
    "Gin",
    "Gist",
    "Sequence",
    "SPGist",
    "BRIN",
    "CommitTs",
    "ReplicationOrigin",
    "Generic",
    "LogicalMessage",
];

/// Whether a record may carry `rmid` in PostgreSQL 15 (`RmgrIdIsValid`).
pub fn rmgr_id_is_valid(rmid: u8) -> bool {
    rmid <= RM_MAX_BUILTIN_ID || rmid >= RM_MIN_CUSTOM_ID
}

/// The name `pg_waldump` prints for `rmid`: a built-in name, `custom###`, or `None` for an id
/// no PostgreSQL 15 record can have.
pub fn rmgr_name(rmid: u8) -> Option<std::borrow::Cow<'static, str>> {
    if let Some(name) = BUILTIN_RMGR_NAMES.get(usize::from(rmid)) {
        return Some(std::borrow::Cow::Borrowed(name));
    }
    if rmid >= RM_MIN_CUSTOM_ID {
        return Some(std::borrow::Cow::Owned(format!("custom{rmid:03}")));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmgr_names_follow_postgres_15_ids() {
        assert_eq!(rmgr_name(0).as_deref(), Some("XLOG"));
        assert_eq!(rmgr_name(9).as_deref(), Some("Heap2"));
        assert_eq!(rmgr_name(10).as_deref(), Some("Heap"));
        assert_eq!(rmgr_name(11).as_deref(), Some("Btree"));
        assert_eq!(rmgr_name(21).as_deref(), Some("LogicalMessage"));
        assert_eq!(rmgr_name(22), None);
        assert_eq!(rmgr_name(127), None);
        assert_eq!(rmgr_name(128).as_deref(), Some("custom128"));
        assert!(!rmgr_id_is_valid(22) && rmgr_id_is_valid(21) && rmgr_id_is_valid(255));
    }
}
