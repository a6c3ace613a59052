//! WAL page headers (PostgreSQL 15's `XLogPageHeaderData` and `XLogLongPageHeaderData`).
//!
//! WAL is a sequence of 8192-byte pages. Each page starts with a short header (24 bytes with
//! its padding): magic, flags, timeline, the page's own address, and how many bytes of a record
//! begun on an earlier page continue here. The first page of each segment file has the long
//! header (40 bytes) instead, which adds the system identifier, the segment size and the page
//! size as cross-checks.
//!
//! **Invariants:** parsing never panics and reads nothing past the slice it is given;
//! [`PageHeader::validate`] accepts a header only if it is a PostgreSQL 15 header for the page at
//! the given position (the checks of `XLogReaderValidatePageHeader`, less the timeline ones).

use crate::Lsn;

use super::{le_u16, le_u32, le_u64, WalDecodeError};

/// Size of a WAL page (PostgreSQL's `XLOG_BLCKSZ`).
pub const WAL_PAGE_SIZE: u64 = 8192;
/// The page magic of PostgreSQL 15 WAL (`XLOG_PAGE_MAGIC`): changes with every WAL format.
pub const XLOG_PAGE_MAGIC: u16 = 0xD110;
/// Size of the short page header, padding included (`SizeOfXLogShortPHD`).
pub const SHORT_PAGE_HEADER_LEN: usize = 24;
/// Size of the long page header, padding included (`SizeOfXLogLongPHD`).
pub const LONG_PAGE_HEADER_LEN: usize = 40;

/// The page's first bytes continue a record begun on an earlier page.
pub const XLP_FIRST_IS_CONTRECORD: u16 = 0x0001;
/// The header is the long one (the first page of a segment).
pub const XLP_LONG_HEADER: u16 = 0x0002;
/// Backup blocks starting on this page are optional (set by `pg_start_backup`-era tools).
pub const XLP_BKP_REMOVABLE: u16 = 0x0004;
/// This page replaces the missing continuation of a record that was never completed: the
/// partial record before it is to be ignored.
pub const XLP_FIRST_IS_OVERWRITE_CONTRECORD: u16 = 0x0008;
/// Every flag PostgreSQL 15 defines.
pub const XLP_ALL_FLAGS: u16 = 0x000F;

/// PostgreSQL's default WAL segment size.
pub const DEFAULT_SEGMENT_SIZE: u32 = 16 << 20;
/// Smallest segment size `initdb --wal-segsize` allows.
pub const MIN_SEGMENT_SIZE: u32 = 1 << 20;
/// Largest segment size `initdb --wal-segsize` allows.
pub const MAX_SEGMENT_SIZE: u32 = 1 << 30;

/// The extra fields of the long header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LongPageHeader {
    /// The cluster's system identifier (from `pg_control`).
    pub system_id: u64,
    /// The segment size the cluster was created with.
    pub seg_size: u32,
    /// The WAL page size (always 8192 for WAL we read).
    pub xlog_blcksz: u32,
}

/// One page header as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageHeader {
    pub magic: u16,
    pub info: u16,
    pub tli: u32,
    pub pageaddr: Lsn,
    /// Bytes of a record begun on an earlier page that remain, this page's included.
    pub rem_len: u32,
    /// Present when `info` has [`XLP_LONG_HEADER`].
    pub long: Option<LongPageHeader>,
}

impl PageHeader {
    /// The header's size: [`LONG_PAGE_HEADER_LEN`] with [`XLP_LONG_HEADER`], else
    /// [`SHORT_PAGE_HEADER_LEN`].
    pub fn size(&self) -> usize {
        header_len(self.info)
    }

    /// Parses a header from the start of `bytes`; `None` while `bytes` is too short to hold it
    /// (24 bytes, or 40 once the flags say the header is long).
    pub fn parse(bytes: &[u8]) -> Option<PageHeader> {
        let magic = le_u16(bytes, 0)?;
        let info = le_u16(bytes, 2)?;
        if bytes.len() < header_len(info) {
            return None; // the padding counts: the caller takes the whole header at once
        }
        let tli = le_u32(bytes, 4)?;
        let pageaddr = Lsn(le_u64(bytes, 8)?);
        let rem_len = le_u32(bytes, 16)?;
        let long = if info & XLP_LONG_HEADER != 0 {
            Some(LongPageHeader {
                system_id: le_u64(bytes, 24)?,
                seg_size: le_u32(bytes, 32)?,
                xlog_blcksz: le_u32(bytes, 36)?,
            })
        } else {
            None
        };
        Some(PageHeader { magic, info, tli, pageaddr, rem_len, long })
    }

    /// Checks the header of the page at `at`: the magic, the flags, that `pageaddr` is `at`,
    /// and for a long header that it describes a usable segment size and page size and sits at
    /// the start of a segment of that size. `seg_size`, when known, also requires a long
    /// header at every segment start.
    pub fn validate(&self, at: Lsn, seg_size: Option<u32>) -> Result<(), WalDecodeError> {
        if self.magic != XLOG_PAGE_MAGIC {
            return Err(WalDecodeError::PageMagic { lsn: at, magic: self.magic });
        }
        if self.info & !XLP_ALL_FLAGS != 0 {
            return Err(WalDecodeError::PageInfo { lsn: at, info: self.info });
        }
        if self.pageaddr != at {
            return Err(WalDecodeError::PageAddr { lsn: at, pageaddr: self.pageaddr });
        }
        match (self.long, seg_size) {
            (Some(long), _) => {
                let bad = |reason: String| Err(WalDecodeError::LongHeader { lsn: at, reason });
                if long.xlog_blcksz as u64 != WAL_PAGE_SIZE {
                    return bad(format!("XLOG_BLCKSZ is {}, expected {WAL_PAGE_SIZE}", long.xlog_blcksz));
                }
                if !valid_segment_size(long.seg_size) {
                    return bad(format!(
                        "segment size {} is not a power of two from 1 MiB to 1 GiB",
                        long.seg_size
                    ));
                }
                if let Some(known) = seg_size {
                    if known != long.seg_size {
                        return bad(format!(
                            "segment size {} differs from the earlier {known}",
                            long.seg_size
                        ));
                    }
                }
                if at.0 % u64::from(long.seg_size) != 0 {
                    return bad(format!(
                        "long header is not at the start of a {}-byte segment",
                        long.seg_size
                    ));
                }
            }
            (None, Some(seg)) if seg != 0 && at.0 % u64::from(seg) == 0 => {
                return Err(WalDecodeError::MissingLongHeader { lsn: at });
            }
            (None, _) => {}
        }
        Ok(())
    }

    /// Appends the header's bytes (24 or 40, zero padding included).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.magic.to_le_bytes());
        out.extend_from_slice(&self.info.to_le_bytes());
        out.extend_from_slice(&self.tli.to_le_bytes());
        out.extend_from_slice(&self.pageaddr.0.to_le_bytes());
        out.extend_from_slice(&self.rem_len.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        if self.info & XLP_LONG_HEADER != 0 {
            let long = self.long.unwrap_or(LongPageHeader { system_id: 0, seg_size: 0, xlog_blcksz: 0 });
            out.extend_from_slice(&long.system_id.to_le_bytes());
            out.extend_from_slice(&long.seg_size.to_le_bytes());
            out.extend_from_slice(&long.xlog_blcksz.to_le_bytes());
        }
    }
}

/// The size of a header with flags `info`.
pub fn header_len(info: u16) -> usize {
    if info & XLP_LONG_HEADER != 0 {
        LONG_PAGE_HEADER_LEN
    } else {
        SHORT_PAGE_HEADER_LEN
    }
}

/// Whether `size` is a segment size PostgreSQL can be initialized with (`IsValidWalSegSize`).
pub fn valid_segment_size(size: u32) -> bool {
    size.is_power_of_two() && (MIN_SEGMENT_SIZE..=MAX_SEGMENT_SIZE).contains(&size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long_header(at: u64) -> PageHeader {
        PageHeader {
            magic: XLOG_PAGE_MAGIC,
            info: XLP_LONG_HEADER,
            tli: 1,
            pageaddr: Lsn(at),
            rem_len: 0,
            long: Some(LongPageHeader { system_id: 7, seg_size: DEFAULT_SEGMENT_SIZE, xlog_blcksz: 8192 }),
        }
    }

    #[test]
    fn page_header_encoding_round_trips_with_its_padding() {
        let short = PageHeader {
            magic: XLOG_PAGE_MAGIC,
            info: XLP_FIRST_IS_CONTRECORD,
            tli: 3,
            pageaddr: Lsn(0x1_0000_2000),
            rem_len: 99,
            long: None,
        };
        let mut out = Vec::new();
        short.encode(&mut out);
        assert_eq!(out.len(), SHORT_PAGE_HEADER_LEN);
        assert_eq!(PageHeader::parse(&out), Some(short));
        let long = long_header(0x100_0000);
        let mut out = Vec::new();
        long.encode(&mut out);
        assert_eq!(out.len(), LONG_PAGE_HEADER_LEN);
        assert_eq!(long.size(), LONG_PAGE_HEADER_LEN);
        assert_eq!(PageHeader::parse(&out), Some(long));
        assert_eq!(PageHeader::parse(&out[..39]), None, "a long header needs all 40 bytes");
        assert_eq!(PageHeader::parse(&out[..23]), None);
        assert_eq!(PageHeader::parse(&out[..20]), None, "the padding is part of the header");
    }

    #[test]
    fn page_header_validation_rejects_magic_flags_address_and_segment_mismatches() {
        let at = Lsn(0x100_0000);
        assert_eq!(long_header(at.0).validate(at, None), Ok(()));
        assert_eq!(long_header(at.0).validate(at, Some(DEFAULT_SEGMENT_SIZE)), Ok(()));

        let mut h = long_header(at.0);
        h.magic = 0xD10D;
        assert!(matches!(h.validate(at, None), Err(WalDecodeError::PageMagic { magic: 0xD10D, .. })));
        let mut h = long_header(at.0);
        h.info |= 0x10;
        assert!(matches!(h.validate(at, None), Err(WalDecodeError::PageInfo { .. })));
        let h = long_header(0);
        let err = h.validate(at, None).expect_err("pageaddr differs");
        assert!(err.is_end_of_wal(), "an older pageaddr is a recycled segment: {err}");
        let h = long_header(at.0 + 0x100_0000);
        assert!(!h.validate(at, None).expect_err("pageaddr differs").is_end_of_wal());

        let mut h = long_header(at.0);
        h.long = Some(LongPageHeader { system_id: 7, seg_size: 3 << 20, xlog_blcksz: 8192 });
        assert!(matches!(h.validate(at, None), Err(WalDecodeError::LongHeader { .. })));
        let mut h = long_header(at.0);
        h.long = Some(LongPageHeader { system_id: 7, seg_size: DEFAULT_SEGMENT_SIZE, xlog_blcksz: 4096 });
        assert!(matches!(h.validate(at, None), Err(WalDecodeError::LongHeader { .. })));
        let mid = Lsn(at.0 + 8192);
        assert!(matches!(long_header(mid.0).validate(mid, None), Err(WalDecodeError::LongHeader { .. })));
        assert!(matches!(
            long_header(at.0).validate(at, Some(1 << 20)),
            Err(WalDecodeError::LongHeader { .. })
        ));

        let short =
            PageHeader { magic: XLOG_PAGE_MAGIC, info: 0, tli: 1, pageaddr: at, rem_len: 0, long: None };
        assert_eq!(short.validate(at, None), Ok(()));
        assert_eq!(
            short.validate(at, Some(DEFAULT_SEGMENT_SIZE)),
            Err(WalDecodeError::MissingLongHeader { lsn: at })
        );
    }

    #[test]
    fn zeroed_page_is_the_end_of_wal() {
        let zeros = [0u8; LONG_PAGE_HEADER_LEN];
        let h = PageHeader::parse(&zeros).expect("24 bytes");
        assert!(h.validate(Lsn(8192), None).expect_err("zero magic").is_end_of_wal());
    }
}
