//! PostgreSQL 15's control file (`global/pg_control`, which the import stores under
//! [`crate::keys::control_file_key`]): [`ControlFile`], every field of `ControlFileData`
//! (`catalog/pg_control.h`), read and written byte-exact, and [`data_checksum_version`], the
//! one field the daemon reads today (whether the cluster has data checksums).
//!
//! The file is `ControlFileData` as a 64-bit little-endian build lays it out (296 bytes with
//! the struct's tail padding), zero-padded to 8192 bytes; its last field, `crc`, at offset 288,
//! is the CRC-32C of every byte before it. The offsets below follow from PostgreSQL 15's struct
//! (`pg_control_version` 1300, the same layout since PostgreSQL 13) with C's alignment (a
//! `bool` takes one byte, and the next `int` or 8-byte field starts at its own alignment), and
//! were checked against files `initdb` made, with and without `--data-checksums`, running and
//! shut down, and `pg_controldata`'s view of them: the test vectors below are such files, and
//! each decodes and encodes back to the same bytes. The CRC and the version are checked, so a
//! file of another layout or a damaged one is an error, not a wrong answer; the padding bytes
//! are not read, and are written as zeros (as PostgreSQL writes them).
//!
//! Invariant: pure; no input makes anything here panic.

use std::fmt;

use crate::keys::CONTROL_FILE_SIZE;
use crate::wal::checkpoint::{
    shutdown_checkpoint_lsn, shutdown_checkpoint_segment, CheckPoint, CheckPointError, StartPointError,
    StartSegment, CHECKPOINT_LEN,
};
use crate::Lsn;

/// `PG_CONTROL_VERSION` of PostgreSQL 15.
pub const PG15_CONTROL_VERSION: u32 = 1300;
/// `MOCK_AUTH_NONCE_LEN`.
pub const MOCK_AUTH_NONCE_LEN: usize = 32;
/// `FLOATFORMAT_VALUE`, the constant PostgreSQL checks `floatFormat` against.
pub const FLOAT_FORMAT_VALUE: f64 = 1234567.0;

// Offsets in `ControlFileData` (64-bit layout; the gaps are alignment padding).
const SYSTEM_IDENTIFIER: usize = 0;
/// Offset of `pg_control_version` (after the 8-byte `system_identifier`).
const VERSION_OFFSET: usize = 8;
const CATALOG_VERSION_NO: usize = 12;
const STATE: usize = 16; // an enum (4 bytes), then 4 bytes of padding
const TIME: usize = 24;
const CHECKPOINT: usize = 32;
const CHECKPOINT_COPY: usize = 40; // 88 bytes
const UNLOGGED_LSN: usize = 128;
const MIN_RECOVERY_POINT: usize = 136;
const MIN_RECOVERY_POINT_TLI: usize = 144; // then 4 bytes of padding
const BACKUP_START_POINT: usize = 152;
const BACKUP_END_POINT: usize = 160;
const BACKUP_END_REQUIRED: usize = 168; // bool, then 3 bytes of padding
const WAL_LEVEL: usize = 172;
const WAL_LOG_HINTS: usize = 176; // bool, then 3 bytes of padding
const MAX_CONNECTIONS: usize = 180;
const MAX_WORKER_PROCESSES: usize = 184;
const MAX_WAL_SENDERS: usize = 188;
const MAX_PREPARED_XACTS: usize = 192;
const MAX_LOCKS_PER_XACT: usize = 196;
const TRACK_COMMIT_TIMESTAMP: usize = 200; // bool, then 3 bytes of padding
const MAX_ALIGN: usize = 204;
const FLOAT_FORMAT: usize = 208;
const BLCKSZ: usize = 216;
const RELSEG_SIZE: usize = 220;
const XLOG_BLCKSZ: usize = 224;
const XLOG_SEG_SIZE: usize = 228;
const NAME_DATA_LEN: usize = 232;
const INDEX_MAX_KEYS: usize = 236;
const TOAST_MAX_CHUNK_SIZE: usize = 240;
const LOBLKSIZE: usize = 244;
const FLOAT8_BY_VAL: usize = 248; // bool, then 3 bytes of padding
/// Offset of `data_checksum_version` in PostgreSQL 15's layout.
const DATA_CHECKSUM_VERSION_OFFSET: usize = 252;
const MOCK_AUTHENTICATION_NONCE: usize = 256;
/// Offset of `crc`, the CRC-32C of every byte before it.
const CRC_OFFSET: usize = 288;
/// The bytes PostgreSQL reads: the fields and the CRC.
const CONTROL_DATA_LEN: usize = CRC_OFFSET + 4;

/// `DBState`: what the cluster was doing when `pg_control` was last written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbState {
    Startup = 0,
    /// A clean shutdown: the checkpoint is the last record, nothing to replay.
    Shutdowned = 1,
    ShutdownedInRecovery = 2,
    Shutdowning = 3,
    InCrashRecovery = 4,
    InArchiveRecovery = 5,
    InProduction = 6,
}

impl DbState {
    fn from_u32(value: u32) -> Option<DbState> {
        Some(match value {
            0 => DbState::Startup,
            1 => DbState::Shutdowned,
            2 => DbState::ShutdownedInRecovery,
            3 => DbState::Shutdowning,
            4 => DbState::InCrashRecovery,
            5 => DbState::InArchiveRecovery,
            6 => DbState::InProduction,
            _ => return None,
        })
    }
}

impl fmt::Display for DbState {
    /// As `pg_controldata` prints it ("Database cluster state").
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DbState::Startup => "starting up",
            DbState::Shutdowned => "shut down",
            DbState::ShutdownedInRecovery => "shut down in recovery",
            DbState::Shutdowning => "shutting down",
            DbState::InCrashRecovery => "in crash recovery",
            DbState::InArchiveRecovery => "in archive recovery",
            DbState::InProduction => "in production",
        })
    }
}

/// The parameters a primary logs when they change (`XLOG_PARAMETER_CHANGE`'s
/// `xl_parameter_change`): what `pg_control` holds of its settings, which a hot standby needs at
/// least.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parameters {
    pub max_connections: i32,
    pub max_worker_processes: i32,
    pub max_wal_senders: i32,
    pub max_prepared_xacts: i32,
    pub max_locks_per_xact: i32,
    pub wal_level: i32,
    pub wal_log_hints: bool,
    pub track_commit_timestamp: bool,
}

impl Parameters {
    /// The bytes of `xl_parameter_change`: six `int`s, then two `bool`s (26 bytes; the record
    /// carries it padded to 28).
    pub fn decode(data: &[u8]) -> Result<Parameters, String> {
        if data.len() < 26 {
            return Err(format!("xl_parameter_change of {} bytes, expected 26 or more", data.len()));
        }
        let int =
            |i: usize| i32::from_le_bytes([data[4 * i], data[4 * i + 1], data[4 * i + 2], data[4 * i + 3]]);
        let flag = |at: usize| match data[at] {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(format!("xl_parameter_change: a bool of {other} at byte {at}")),
        };
        Ok(Parameters {
            max_connections: int(0),
            max_worker_processes: int(1),
            max_wal_senders: int(2),
            max_prepared_xacts: int(3),
            max_locks_per_xact: int(4),
            wal_level: int(5),
            wal_log_hints: flag(24)?,
            track_commit_timestamp: flag(25)?,
        })
    }

    /// The settings a hot standby must have at least these values of (`CheckRequiredParameterValues`),
    /// by their names in `postgresql.conf`.
    pub fn standby_minimums(&self) -> [(&'static str, i32); 5] {
        [
            ("max_connections", self.max_connections),
            ("max_worker_processes", self.max_worker_processes),
            ("max_wal_senders", self.max_wal_senders),
            ("max_prepared_transactions", self.max_prepared_xacts),
            ("max_locks_per_transaction", self.max_locks_per_xact),
        ]
    }
}

/// PostgreSQL 15's `ControlFileData`, every field, in its order.
#[derive(Debug, Clone, PartialEq)]
pub struct ControlFile {
    pub system_identifier: u64,
    pub pg_control_version: u32,
    pub catalog_version_no: u32,
    pub state: DbState,
    /// When `pg_control` was last written (`pg_time_t`, seconds since the Unix epoch).
    pub time: i64,
    /// Where the last checkpoint record is.
    pub checkpoint: Lsn,
    /// That record's `CheckPoint`.
    pub checkpoint_copy: CheckPoint,
    /// The fake LSN counter of unlogged relations.
    pub unlogged_lsn: Lsn,
    pub min_recovery_point: Lsn,
    pub min_recovery_point_tli: u32,
    pub backup_start_point: Lsn,
    pub backup_end_point: Lsn,
    pub backup_end_required: bool,
    /// `wal_level`: 0 minimal, 1 replica, 2 logical.
    pub wal_level: i32,
    pub wal_log_hints: bool,
    pub max_connections: i32,
    pub max_worker_processes: i32,
    pub max_wal_senders: i32,
    pub max_prepared_xacts: i32,
    pub max_locks_per_xact: i32,
    pub track_commit_timestamp: bool,
    pub max_align: u32,
    /// [`FLOAT_FORMAT_VALUE`] on every build we serve.
    pub float_format: f64,
    pub blcksz: u32,
    pub relseg_size: u32,
    pub xlog_blcksz: u32,
    pub xlog_seg_size: u32,
    pub name_data_len: u32,
    pub index_max_keys: u32,
    pub toast_max_chunk_size: u32,
    pub loblksize: u32,
    pub float8_by_val: bool,
    /// 0: no data checksums; PostgreSQL 15 knows only 1 (`PG_DATA_CHECKSUM_VERSION`) besides.
    pub data_checksum_version: u32,
    pub mock_authentication_nonce: [u8; MOCK_AUTH_NONCE_LEN],
}

/// Why a control file was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlFileError {
    #[error("pg_control is {len} bytes, shorter than PostgreSQL 15's control data")]
    TooShort { len: usize },
    #[error("pg_control version {found}: want PostgreSQL 15's {PG15_CONTROL_VERSION}")]
    Version { found: u32 },
    #[error("pg_control CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Crc { stored: u32, computed: u32 },
    #[error("pg_control's cluster state is {found}, not one PostgreSQL 15 writes")]
    State { found: u32 },
    #[error("pg_control's {field} is {value}, not a bool (0 or 1)")]
    Bool { field: &'static str, value: u8 },
    #[error("pg_control's checkpoint copy: {0}")]
    CheckPoint(#[from] CheckPointError),
}

fn u32_at(file: &[u8], offset: usize) -> Option<u32> {
    let bytes = file.get(offset..offset + 4)?;
    Some(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

fn u64_at(file: &[u8], offset: usize) -> Option<u64> {
    let bytes: [u8; 8] = file.get(offset..offset + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// Checks the length, the version and the CRC: after it, every field is in `file`.
fn check(file: &[u8]) -> Result<(), ControlFileError> {
    let too_short = || ControlFileError::TooShort { len: file.len() };
    let stored = u32_at(file, CRC_OFFSET).ok_or_else(too_short)?;
    let found = u32_at(file, VERSION_OFFSET).ok_or_else(too_short)?;
    if found != PG15_CONTROL_VERSION {
        return Err(ControlFileError::Version { found });
    }
    let computed = crc32c::crc32c(&file[..CRC_OFFSET]);
    if computed != stored {
        return Err(ControlFileError::Crc { stored, computed });
    }
    Ok(())
}

/// The cluster's `data_checksum_version` (0: no data checksums; PostgreSQL 15 knows only 1,
/// `PG_DATA_CHECKSUM_VERSION`, besides), from the bytes of its `global/pg_control`.
pub fn data_checksum_version(file: &[u8]) -> Result<u32, ControlFileError> {
    check(file)?;
    u32_at(file, DATA_CHECKSUM_VERSION_OFFSET).ok_or(ControlFileError::TooShort { len: file.len() })
}

impl ControlFile {
    /// This file with `parameters` in place of its own.
    pub fn with_parameters(&self, p: &Parameters) -> ControlFile {
        ControlFile {
            max_connections: p.max_connections,
            max_worker_processes: p.max_worker_processes,
            max_wal_senders: p.max_wal_senders,
            max_prepared_xacts: p.max_prepared_xacts,
            max_locks_per_xact: p.max_locks_per_xact,
            wal_level: p.wal_level,
            wal_log_hints: p.wal_log_hints,
            track_commit_timestamp: p.track_commit_timestamp,
            ..self.clone()
        }
    }

    /// Reads `global/pg_control` (the whole file, or at least its first 292 bytes): the
    /// version and the CRC are checked, then every field.
    pub fn decode(file: &[u8]) -> Result<ControlFile, ControlFileError> {
        check(file)?;
        let too_short = || ControlFileError::TooShort { len: file.len() };
        let u32_at = |at| u32_at(file, at).ok_or_else(too_short);
        let i32_at = |at| u32_at(at).map(|v| v as i32);
        let lsn_at = |at| u64_at(file, at).map(Lsn).ok_or_else(too_short);
        let bool_at = |at, field| match file.get(at) {
            Some(0) => Ok(false),
            Some(1) => Ok(true),
            Some(&value) => Err(ControlFileError::Bool { field, value }),
            None => Err(too_short()),
        };
        let state = u32_at(STATE)?;
        let checkpoint_copy = CheckPoint::decode(
            file.get(CHECKPOINT_COPY..CHECKPOINT_COPY + CHECKPOINT_LEN).ok_or_else(too_short)?,
        )?;
        let mut mock_authentication_nonce = [0u8; MOCK_AUTH_NONCE_LEN];
        mock_authentication_nonce.copy_from_slice(
            file.get(MOCK_AUTHENTICATION_NONCE..MOCK_AUTHENTICATION_NONCE + MOCK_AUTH_NONCE_LEN)
                .ok_or_else(too_short)?,
        );
        Ok(ControlFile {
            system_identifier: u64_at(file, SYSTEM_IDENTIFIER).ok_or_else(too_short)?,
            pg_control_version: u32_at(VERSION_OFFSET)?,
            catalog_version_no: u32_at(CATALOG_VERSION_NO)?,
            state: DbState::from_u32(state).ok_or(ControlFileError::State { found: state })?,
            time: u64_at(file, TIME).ok_or_else(too_short)? as i64,
            checkpoint: lsn_at(CHECKPOINT)?,
            checkpoint_copy,
            unlogged_lsn: lsn_at(UNLOGGED_LSN)?,
            min_recovery_point: lsn_at(MIN_RECOVERY_POINT)?,
            min_recovery_point_tli: u32_at(MIN_RECOVERY_POINT_TLI)?,
            backup_start_point: lsn_at(BACKUP_START_POINT)?,
            backup_end_point: lsn_at(BACKUP_END_POINT)?,
            backup_end_required: bool_at(BACKUP_END_REQUIRED, "backupEndRequired")?,
            wal_level: i32_at(WAL_LEVEL)?,
            wal_log_hints: bool_at(WAL_LOG_HINTS, "wal_log_hints")?,
            max_connections: i32_at(MAX_CONNECTIONS)?,
            max_worker_processes: i32_at(MAX_WORKER_PROCESSES)?,
            max_wal_senders: i32_at(MAX_WAL_SENDERS)?,
            max_prepared_xacts: i32_at(MAX_PREPARED_XACTS)?,
            max_locks_per_xact: i32_at(MAX_LOCKS_PER_XACT)?,
            track_commit_timestamp: bool_at(TRACK_COMMIT_TIMESTAMP, "track_commit_timestamp")?,
            max_align: u32_at(MAX_ALIGN)?,
            float_format: f64::from_bits(u64_at(file, FLOAT_FORMAT).ok_or_else(too_short)?),
            blcksz: u32_at(BLCKSZ)?,
            relseg_size: u32_at(RELSEG_SIZE)?,
            xlog_blcksz: u32_at(XLOG_BLCKSZ)?,
            xlog_seg_size: u32_at(XLOG_SEG_SIZE)?,
            name_data_len: u32_at(NAME_DATA_LEN)?,
            index_max_keys: u32_at(INDEX_MAX_KEYS)?,
            toast_max_chunk_size: u32_at(TOAST_MAX_CHUNK_SIZE)?,
            loblksize: u32_at(LOBLKSIZE)?,
            float8_by_val: bool_at(FLOAT8_BY_VAL, "float8ByVal")?,
            data_checksum_version: u32_at(DATA_CHECKSUM_VERSION_OFFSET)?,
            mock_authentication_nonce,
        })
    }

    /// X', where a cluster started at `x` has its shutdown checkpoint record (see
    /// [`crate::wal::checkpoint`]), for this cluster's WAL segment size: what
    /// [`ControlFile::started_at`] puts in `checkPoint`.
    pub fn start_point(&self, x: Lsn) -> Result<Lsn, StartPointError> {
        shutdown_checkpoint_lsn(x, self.xlog_seg_size)
    }

    /// The control file and the WAL segment that start this cluster at `x` (see
    /// [`crate::wal::checkpoint`]): a shutdown checkpoint of `counters` at X' (its `redo` and
    /// `time` set), and this file with `state` shut down, `checkPoint` X', no minimum recovery
    /// point and no backup in progress; every other field (the cluster's constants and
    /// parameters) as it is. `now`: seconds since the epoch. The pages of the data directory
    /// must be those of `x` (no page LSN above it).
    pub fn started_at(
        &self,
        counters: &CheckPoint,
        x: Lsn,
        now: i64,
    ) -> Result<(ControlFile, StartSegment), StartPointError> {
        let checkpoint = CheckPoint { time: now, ..*counters };
        let start = shutdown_checkpoint_segment(
            x,
            checkpoint.this_timeline_id,
            self.system_identifier,
            self.xlog_seg_size,
            &checkpoint,
        )?;
        let control = ControlFile {
            state: DbState::Shutdowned,
            time: now,
            checkpoint: start.lsn,
            checkpoint_copy: start.checkpoint,
            min_recovery_point: Lsn::INVALID,
            min_recovery_point_tli: 0,
            backup_start_point: Lsn::INVALID,
            backup_end_point: Lsn::INVALID,
            backup_end_required: false,
            ..self.clone()
        };
        Ok((control, start))
    }

    /// The 8192 bytes of `global/pg_control`: the fields, the CRC-32C over them, zeros after.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; CONTROL_FILE_SIZE];
        let mut put = |at: usize, bytes: &[u8]| out[at..at + bytes.len()].copy_from_slice(bytes);
        put(SYSTEM_IDENTIFIER, &self.system_identifier.to_le_bytes());
        put(VERSION_OFFSET, &self.pg_control_version.to_le_bytes());
        put(CATALOG_VERSION_NO, &self.catalog_version_no.to_le_bytes());
        put(STATE, &(self.state as u32).to_le_bytes());
        put(TIME, &self.time.to_le_bytes());
        put(CHECKPOINT, &self.checkpoint.0.to_le_bytes());
        put(CHECKPOINT_COPY, &self.checkpoint_copy.encode());
        put(UNLOGGED_LSN, &self.unlogged_lsn.0.to_le_bytes());
        put(MIN_RECOVERY_POINT, &self.min_recovery_point.0.to_le_bytes());
        put(MIN_RECOVERY_POINT_TLI, &self.min_recovery_point_tli.to_le_bytes());
        put(BACKUP_START_POINT, &self.backup_start_point.0.to_le_bytes());
        put(BACKUP_END_POINT, &self.backup_end_point.0.to_le_bytes());
        put(BACKUP_END_REQUIRED, &[u8::from(self.backup_end_required)]);
        put(WAL_LEVEL, &self.wal_level.to_le_bytes());
        put(WAL_LOG_HINTS, &[u8::from(self.wal_log_hints)]);
        put(MAX_CONNECTIONS, &self.max_connections.to_le_bytes());
        put(MAX_WORKER_PROCESSES, &self.max_worker_processes.to_le_bytes());
        put(MAX_WAL_SENDERS, &self.max_wal_senders.to_le_bytes());
        put(MAX_PREPARED_XACTS, &self.max_prepared_xacts.to_le_bytes());
        put(MAX_LOCKS_PER_XACT, &self.max_locks_per_xact.to_le_bytes());
        put(TRACK_COMMIT_TIMESTAMP, &[u8::from(self.track_commit_timestamp)]);
        put(MAX_ALIGN, &self.max_align.to_le_bytes());
        put(FLOAT_FORMAT, &self.float_format.to_bits().to_le_bytes());
        put(BLCKSZ, &self.blcksz.to_le_bytes());
        put(RELSEG_SIZE, &self.relseg_size.to_le_bytes());
        put(XLOG_BLCKSZ, &self.xlog_blcksz.to_le_bytes());
        put(XLOG_SEG_SIZE, &self.xlog_seg_size.to_le_bytes());
        put(NAME_DATA_LEN, &self.name_data_len.to_le_bytes());
        put(INDEX_MAX_KEYS, &self.index_max_keys.to_le_bytes());
        put(TOAST_MAX_CHUNK_SIZE, &self.toast_max_chunk_size.to_le_bytes());
        put(LOBLKSIZE, &self.loblksize.to_le_bytes());
        put(FLOAT8_BY_VAL, &[u8::from(self.float8_by_val)]);
        put(DATA_CHECKSUM_VERSION_OFFSET, &self.data_checksum_version.to_le_bytes());
        put(MOCK_AUTHENTICATION_NONCE, &self.mock_authentication_nonce);
        let crc = crc32c::crc32c(&out[..CRC_OFFSET]);
        out[CRC_OFFSET..CONTROL_DATA_LEN].copy_from_slice(&crc.to_le_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The control data (the first 296 bytes; the rest of the 8192 are zeros) of two clusters
    /// made by PostgreSQL 15's `initdb`, the first with `--data-checksums` ("Data page checksum
    /// version: 1" says `pg_controldata`), the second without ("0").
    const WITH_CHECKSUMS: &str = include_str!("../testdata/pg_control-initdb-checksums.hex");
    const WITHOUT_CHECKSUMS: &str = concat!(
        "7e3da59ac3e40a6b1405000025770d0c0100000000000000c4e40a6b0000000018075001000000001807500100000000",
        "01000000010000000100000000000000d402000000000000043500000100000000000000cc0200000100000001000000",
        "0100000000000000c4e40a6b0000000000000000000000000000000000000000e8030000000000000000000000000000",
        "00000000000000000000000000000000000000000000000000000000010000000000000064000000080000000a000000",
        "000000004000000000000000080000000000000087d63241002000000000020000200000000000014000000020000000",
        "cc0700000008000001000000000000006cbd3e4d1f2aa82379569a2a7669cc9fac5c54b2fefcc92b22d773a84693a07f",
        "edb00c7d00000000",
    );

    /// A cluster just made by PostgreSQL 15.18's `initdb` (no data checksums), shut down; its
    /// `pg_controldata` is in `shut_down_control_file_has_the_fields_pg_controldata_shows`.
    const SHUT_DOWN: &str = concat!(
        "b4380f77ce2f0b6b1405000025770d0c0100000000000000cf2f0b6b0000000008075001000000000807500100000000",
        "01000000010000000100000000000000d402000000000000043500000100000000000000cc0200000100000001000000",
        "0100000000000000cf2f0b6b0000000000000000000000000000000000000000e8030000000000000000000000000000",
        "00000000000000000000000000000000000000000000000000000000010000000000000064000000080000000a000000",
        "000000004000000000000000080000000000000087d63241002000000000020000200000000000014000000020000000",
        "cc070000000800000100000000000000f7876c84a2f387a1e11ef2ac7b8c6c99850cd564e358753e8d0de637714386cb",
        "0a29eb3700000000",
    );

    fn control_file(hex: &str) -> Vec<u8> {
        let hex: String = hex.split_whitespace().collect();
        let mut file: Vec<u8> =
            (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect();
        file.resize(crate::keys::CONTROL_FILE_SIZE, 0);
        file
    }

    #[test]
    fn postgresql_15_control_files_say_whether_the_cluster_has_data_checksums() {
        assert_eq!(data_checksum_version(&control_file(WITH_CHECKSUMS)), Ok(1));
        assert_eq!(data_checksum_version(&control_file(WITHOUT_CHECKSUMS)), Ok(0));
    }

    #[test]
    fn a_damaged_short_or_foreign_control_file_is_an_error() {
        let mut file = control_file(WITH_CHECKSUMS);
        file[DATA_CHECKSUM_VERSION_OFFSET] = 0;
        assert!(matches!(data_checksum_version(&file), Err(ControlFileError::Crc { .. })));

        let file = control_file(WITH_CHECKSUMS);
        assert_eq!(data_checksum_version(&file[..100]), Err(ControlFileError::TooShort { len: 100 }));
        assert_eq!(data_checksum_version(&[]), Err(ControlFileError::TooShort { len: 0 }));

        let mut file = control_file(WITH_CHECKSUMS);
        file[VERSION_OFFSET..VERSION_OFFSET + 4].copy_from_slice(&1201u32.to_le_bytes());
        assert_eq!(data_checksum_version(&file), Err(ControlFileError::Version { found: 1201 }));
    }

    #[test]
    fn postgresql_15_control_files_decode_and_encode_back_byte_for_byte() {
        for hex in [WITH_CHECKSUMS, WITHOUT_CHECKSUMS, SHUT_DOWN] {
            let file = control_file(hex);
            let decoded = ControlFile::decode(&file).expect("decode");
            assert_eq!(decoded.encode(), file);
            assert_eq!(Ok(decoded.data_checksum_version), data_checksum_version(&file));
        }
        let running = ControlFile::decode(&control_file(WITH_CHECKSUMS)).expect("decode");
        assert_eq!(running.state, DbState::InProduction);
        assert_eq!(running.data_checksum_version, 1);
    }

    #[test]
    fn shut_down_control_file_has_the_fields_pg_controldata_shows() {
        // pg_controldata of that cluster: identifier 7713311350609361076, catalog version
        // 202209061, "shut down", checkpoint 0/1500708, fake LSN counter 0/3E8, minimum
        // recovery 0/0 on timeline 0, backup 0/0 and 0/0 not required, wal_level replica,
        // wal_log_hints off, max_connections 100, max_worker_processes 8, max_wal_senders 10,
        // max_prepared_xacts 0, max_locks_per_xact 64, track_commit_timestamp off, alignment 8,
        // block size 8192, 131072 blocks per segment, WAL block 8192, WAL segment 16777216,
        // identifiers 64, index columns 32, TOAST chunk 1996, large-object chunk 2048, float8
        // by value, checksum version 0, and this nonce.
        let c = ControlFile::decode(&control_file(SHUT_DOWN)).expect("decode");
        let nonce = "f7876c84a2f387a1e11ef2ac7b8c6c99850cd564e358753e8d0de637714386cb";
        let expected = ControlFile {
            system_identifier: 7713311350609361076,
            pg_control_version: 1300,
            catalog_version_no: 202209061,
            state: DbState::Shutdowned,
            time: c.time,
            checkpoint: Lsn(0x0150_0708),
            checkpoint_copy: CheckPoint { redo: Lsn(0x0150_0708), ..c.checkpoint_copy },
            unlogged_lsn: Lsn(0x3E8),
            min_recovery_point: Lsn(0),
            min_recovery_point_tli: 0,
            backup_start_point: Lsn(0),
            backup_end_point: Lsn(0),
            backup_end_required: false,
            wal_level: 1,
            wal_log_hints: false,
            max_connections: 100,
            max_worker_processes: 8,
            max_wal_senders: 10,
            max_prepared_xacts: 0,
            max_locks_per_xact: 64,
            track_commit_timestamp: false,
            max_align: 8,
            float_format: FLOAT_FORMAT_VALUE,
            blcksz: 8192,
            relseg_size: 131072,
            xlog_blcksz: 8192,
            xlog_seg_size: 16 << 20,
            name_data_len: 64,
            index_max_keys: 32,
            toast_max_chunk_size: 1996,
            loblksize: 2048,
            float8_by_val: true,
            data_checksum_version: 0,
            mock_authentication_nonce: std::array::from_fn(|i| {
                u8::from_str_radix(&nonce[2 * i..2 * i + 2], 16).expect("hex")
            }),
        };
        assert_eq!(c, expected);
        // The checkpoint copy and the file's own time: the same second, as initdb wrote both.
        assert_eq!(c.checkpoint_copy.time, c.time);
        assert_eq!(c.checkpoint_copy.next_xid, 724);
        assert_eq!(c.state.to_string(), "shut down");
    }

    #[test]
    fn a_changed_control_file_encodes_with_a_new_crc_and_decodes_to_the_change() {
        let mut c = ControlFile::decode(&control_file(SHUT_DOWN)).expect("decode");
        c.checkpoint = Lsn(0x3_0000_1234);
        c.checkpoint_copy.redo = c.checkpoint;
        c.state = DbState::InProduction;
        c.backup_end_required = true;
        let file = c.encode();
        assert_eq!(file.len(), CONTROL_FILE_SIZE);
        assert!(file[CONTROL_DATA_LEN..].iter().all(|&b| b == 0));
        assert_eq!(ControlFile::decode(&file), Ok(c));
    }

    /// `file` with byte `at` set to `value` and the CRC made right again.
    fn with_byte(hex: &str, at: usize, value: u8) -> Vec<u8> {
        let mut file = control_file(hex);
        file[at] = value;
        let crc = crc32c::crc32c(&file[..CRC_OFFSET]);
        file[CRC_OFFSET..CONTROL_DATA_LEN].copy_from_slice(&crc.to_le_bytes());
        file
    }

    #[test]
    fn values_postgresql_never_writes_are_errors() {
        assert_eq!(
            ControlFile::decode(&with_byte(SHUT_DOWN, STATE, 7)),
            Err(ControlFileError::State { found: 7 })
        );
        assert_eq!(
            ControlFile::decode(&with_byte(SHUT_DOWN, WAL_LOG_HINTS, 2)),
            Err(ControlFileError::Bool { field: "wal_log_hints", value: 2 })
        );
        assert!(matches!(
            ControlFile::decode(&with_byte(SHUT_DOWN, CHECKPOINT_COPY + 16, 9)),
            Err(ControlFileError::CheckPoint(CheckPointError::FullPageWrites { value: 9 }))
        ));
        let mut file = control_file(SHUT_DOWN);
        file[CHECKPOINT] ^= 1;
        assert!(matches!(ControlFile::decode(&file), Err(ControlFileError::Crc { .. })));
        assert_eq!(ControlFile::decode(&file[..291]), Err(ControlFileError::TooShort { len: 291 }));
        assert!(ControlFile::decode(&control_file(SHUT_DOWN)[..CONTROL_DATA_LEN]).is_ok());
    }

    proptest! {
        #[test]
        fn any_bytes_give_an_answer_or_an_error_never_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = data_checksum_version(&bytes);
            let _ = ControlFile::decode(&bytes);
        }

        #[test]
        fn any_fields_postgresql_could_write_decode_and_encode_back(
            mut bytes in proptest::collection::vec(any::<u8>(), CONTROL_DATA_LEN..400),
        ) {
            bytes[VERSION_OFFSET..VERSION_OFFSET + 4].copy_from_slice(&PG15_CONTROL_VERSION.to_le_bytes());
            let state = u32::from(bytes[STATE] % 7);
            bytes[STATE..STATE + 4].copy_from_slice(&state.to_le_bytes());
            for at in [BACKUP_END_REQUIRED, WAL_LOG_HINTS, TRACK_COMMIT_TIMESTAMP, FLOAT8_BY_VAL, CHECKPOINT_COPY + 16] {
                bytes[at] %= 2;
            }
            let crc = crc32c::crc32c(&bytes[..CRC_OFFSET]);
            bytes[CRC_OFFSET..CONTROL_DATA_LEN].copy_from_slice(&crc.to_le_bytes());
            let decoded = ControlFile::decode(&bytes);
            prop_assert!(decoded.is_ok(), "{:?}", decoded);
            let encoded = decoded.expect("checked").encode();
            // The same fields (compared as bytes: floatFormat may be a NaN); only padding
            // changes, to zeros.
            let again = ControlFile::decode(&encoded).map(|c| c.encode());
            prop_assert_eq!(again, Ok(encoded.clone()));
            let differ = (0..CRC_OFFSET).filter(|&i| encoded[i] != bytes[i]).collect::<Vec<_>>();
            prop_assert!(differ.iter().all(|&i| encoded[i] == 0), "bytes {:?} differ", differ);
        }
    }
}
