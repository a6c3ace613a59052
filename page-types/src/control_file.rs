//! What the daemon reads of a PostgreSQL 15 cluster's control file (`global/pg_control`, which
//! the import stores under [`crate::keys::control_file_key`]): whether the cluster has data
//! checksums.
//!
//! The file is PostgreSQL's `ControlFileData` (`catalog/pg_control.h`) as a 64-bit
//! little-endian build lays it out, zero-padded to 8192 bytes. The offsets below follow from
//! PostgreSQL 15's struct (`pg_control_version` 1300) and were checked against the files of
//! clusters made with and without `initdb --data-checksums` (and `pg_controldata`'s "Data
//! page checksum version"): the test vectors below are two such files. The CRC-32C of the
//! fields before `crc` is checked, so a file of another layout or a damaged one is an error,
//! not a wrong answer.
//!
//! Invariant: pure; no input makes anything here panic.

/// `PG_CONTROL_VERSION` of PostgreSQL 15.
pub const PG15_CONTROL_VERSION: u32 = 1300;

/// Offset of `pg_control_version` (after the 8-byte `system_identifier`).
const VERSION_OFFSET: usize = 8;
/// Offset of `data_checksum_version` in PostgreSQL 15's layout.
const DATA_CHECKSUM_VERSION_OFFSET: usize = 252;
/// Offset of `crc`, the CRC-32C of every byte before it.
const CRC_OFFSET: usize = 288;

/// Why a control file was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlFileError {
    #[error("pg_control is {len} bytes, shorter than PostgreSQL 15's control data")]
    TooShort { len: usize },
    #[error("pg_control version {found}: want PostgreSQL 15's {PG15_CONTROL_VERSION}")]
    Version { found: u32 },
    #[error("pg_control CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Crc { stored: u32, computed: u32 },
}

fn u32_at(file: &[u8], offset: usize) -> Option<u32> {
    let bytes = file.get(offset..offset + 4)?;
    Some(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

/// The cluster's `data_checksum_version` (0: no data checksums; PostgreSQL 15 knows only 1,
/// `PG_DATA_CHECKSUM_VERSION`, besides), from the bytes of its `global/pg_control`.
pub fn data_checksum_version(file: &[u8]) -> Result<u32, ControlFileError> {
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
    u32_at(file, DATA_CHECKSUM_VERSION_OFFSET).ok_or_else(too_short)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The control data (the first 296 bytes; the rest of the 8192 are zeros) of two clusters
    /// made by PostgreSQL 15's `initdb`, the first with `--data-checksums` ("Data page checksum
    /// version: 1" says `pg_controldata`), the second without ("0").
    const WITH_CHECKSUMS: &str = concat!(
        "5fcd6e10c3e40a6b1405000025770d0c0600000000000000cae40a6b00000000f814740100000000f814740100000000",
        "01000000010000000100000000000000d402000000000000043500000100000000000000cc0200000100000001000000",
        "0100000000000000c3e40a6b0000000000000000000000000000000000000000e8030000000000000000000000000000",
        "00000000000000000000000000000000000000000000000000000000010000000000000064000000080000000a000000",
        "000000004000000000000000080000000000000087d63241002000000000020000200000000000014000000020000000",
        "cc0700000008000001000000010000002fce0081ae76c5bcaf627eb279f55b7581305bfd0e60dfa81c8f895dd8ca1bbf",
        "fb2997df00000000",
    );
    const WITHOUT_CHECKSUMS: &str = concat!(
        "7e3da59ac3e40a6b1405000025770d0c0100000000000000c4e40a6b0000000018075001000000001807500100000000",
        "01000000010000000100000000000000d402000000000000043500000100000000000000cc0200000100000001000000",
        "0100000000000000c4e40a6b0000000000000000000000000000000000000000e8030000000000000000000000000000",
        "00000000000000000000000000000000000000000000000000000000010000000000000064000000080000000a000000",
        "000000004000000000000000080000000000000087d63241002000000000020000200000000000014000000020000000",
        "cc0700000008000001000000000000006cbd3e4d1f2aa82379569a2a7669cc9fac5c54b2fefcc92b22d773a84693a07f",
        "edb00c7d00000000",
    );

    fn control_file(hex: &str) -> Vec<u8> {
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

    proptest! {
        #[test]
        fn any_bytes_give_an_answer_or_an_error_never_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = data_checksum_version(&bytes);
        }
    }
}
