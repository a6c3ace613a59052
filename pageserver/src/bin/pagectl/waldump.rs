//! `pagectl waldump`: reads PostgreSQL WAL segment files in order, feeds them to the pure
//! decoder (`page_types::wal::WalDecoder`) and prints what it decodes.
//!
//! Segment files are named like PostgreSQL's (`TTTTTTTTXXXXXXXXYYYYYYYY`: timeline, then the
//! segment number in two halves); the segment size is read from the first file's long page
//! header. The range: from `--start` (the first record that starts at or after it, as
//! `pg_waldump` finds it; by default the first record that starts in the first segment) to
//! `--end`, exclusive, as `pg_waldump` reads it: a record counts only if all its bytes lie
//! below `--end`. (At a record boundary, which is what `pg_current_wal_lsn()` gives, that is
//! every record that starts below it; an `--end` inside a record leaves that record out, as
//! `pg_waldump` does, so the two always count the same.) Reading stops without error at the end of
//! readable WAL: zeros, a recycled segment (an older page address), a record cut off by the end
//! of the last file, or a missing segment; any other decode error is an error.
//!
//! `--stats` prints one JSON object: `start` (the first record's LSN), `end` (the last record's
//! end), `records`, `rmgrs` (records per resource manager name, as `pg_waldump` names them,
//! only those with records) and `fpi` (full-page images, applied or not).
//!
//! **Invariants:** reads files only, in segment order, each at most once; memory is one read
//! buffer plus what the decoder holds (one record being assembled), whatever the WAL size.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use page_types::wal::page::{valid_segment_size, PageHeader, LONG_PAGE_HEADER_LEN, WAL_PAGE_SIZE};
use page_types::wal::{DecodedRecord, WalDecoder};
use page_types::Lsn;

/// What to read and print.
#[derive(Debug)]
pub struct Args {
    pub start: Option<Lsn>,
    pub end: Option<Lsn>,
    pub stats: bool,
    pub paths: Vec<PathBuf>,
}

/// Bytes read from a segment file at a time.
const READ_CHUNK: usize = 1 << 20;

/// A segment file and where it sits.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    path: PathBuf,
    tli: u32,
    /// `log` and `seg` of the name, as written.
    log: u32,
    seg: u32,
}

/// Parses a segment file name: 24 upper-case hex digits (`IsXLogFileName`).
fn parse_segment_name(name: &str) -> Option<(u32, u32, u32)> {
    if name.len() != 24 || !name.bytes().all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b)) {
        return None;
    }
    let part = |i: usize| name.get(i..i + 8).and_then(|s| u32::from_str_radix(s, 16).ok());
    Some((part(0)?, part(8)?, part(16)?))
}

impl Segment {
    /// The segment's number for segments of `seg_size` bytes (`XLogFromFileName`).
    fn segno(&self, seg_size: u32) -> u64 {
        let per_log = 0x1_0000_0000u64 / u64::from(seg_size);
        u64::from(self.log) * per_log + u64::from(self.seg)
    }
}

/// The segment files named by `paths` (directories are listed; other files in them are
/// ignored), of one timeline, in name order.
fn find_segments(paths: &[PathBuf]) -> anyhow::Result<Vec<Segment>> {
    let mut segments = Vec::new();
    let mut add = |path: PathBuf, from_dir: bool| -> anyhow::Result<()> {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        match parse_segment_name(name) {
            Some((tli, log, seg)) => segments.push(Segment { path, tli, log, seg }),
            None if from_dir => {}
            None => bail!("{} is not named like a WAL segment (24 hex digits)", path.display()),
        }
        Ok(())
    };
    for path in paths {
        if path.is_dir() {
            let entries = std::fs::read_dir(path).with_context(|| format!("list {}", path.display()))?;
            for entry in entries {
                let entry = entry.with_context(|| format!("list {}", path.display()))?;
                add(entry.path(), true)?;
            }
        } else {
            add(path.clone(), false)?;
        }
    }
    segments.sort_by(|a, b| (a.tli, a.log, a.seg, &a.path).cmp(&(b.tli, b.log, b.seg, &b.path)));
    segments.dedup_by(|a, b| (a.tli, a.log, a.seg) == (b.tli, b.log, b.seg));
    let Some(first) = segments.first() else {
        bail!("no WAL segment files found in {}", display_paths(paths));
    };
    if segments.iter().any(|s| s.tli != first.tli) {
        bail!("segment files of several timelines found: name the files of one");
    }
    Ok(segments)
}

fn display_paths(paths: &[PathBuf]) -> String {
    paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The segment size from the long page header at the start of `path`.
fn read_segment_size(path: &Path) -> anyhow::Result<u32> {
    let mut head = [0u8; LONG_PAGE_HEADER_LEN];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .with_context(|| format!("read the first page header of {}", path.display()))?;
    let long = PageHeader::parse(&head).and_then(|h| h.long);
    match long {
        Some(long) if valid_segment_size(long.seg_size) => Ok(long.seg_size),
        Some(long) => {
            bail!("{}: invalid segment size {} in the long page header", path.display(), long.seg_size)
        }
        None => bail!(
            "{}: the first page has no long header (not a WAL segment, or not PostgreSQL 15)",
            path.display()
        ),
    }
}

/// Counts for `--stats`.
#[derive(Debug, Default, PartialEq, Eq)]
struct Stats {
    first: Option<Lsn>,
    end: Option<Lsn>,
    records: u64,
    rmgrs: BTreeMap<String, u64>,
    fpi: u64,
}

impl Stats {
    fn add(&mut self, rec: &DecodedRecord) {
        self.first.get_or_insert(rec.lsn);
        self.end = Some(rec.end_lsn);
        self.records += 1;
        *self.rmgrs.entry(rec.rmgr_name().into_owned()).or_default() += 1;
        self.fpi += rec.blocks.iter().filter(|b| b.image.is_some()).count() as u64;
    }

    fn to_json(&self, start: Lsn) -> serde_json::Value {
        let first = self.first.unwrap_or(start);
        serde_json::json!({
            "start": first.to_string(),
            "end": self.end.unwrap_or(first).to_string(),
            "records": self.records,
            "rmgrs": self.rmgrs,
            "fpi": self.fpi,
        })
    }
}

/// An LSN as `pg_waldump` prints it: the low half zero-padded.
fn waldump_lsn(lsn: Lsn) -> String {
    format!("{:X}/{:08X}", lsn.0 >> 32, lsn.0 & 0xffff_ffff)
}

fn fork_name(fork: u8) -> String {
    match fork {
        0 => "main".to_owned(),
        1 => "fsm".to_owned(),
        2 => "vm".to_owned(),
        3 => "init".to_owned(),
        n => format!("fork{n}"),
    }
}

/// One line per record, close to `pg_waldump`'s (no rmgr-specific description).
fn record_line(rec: &DecodedRecord) -> String {
    let fpi_len: u64 = rec.blocks.iter().filter_map(|b| b.image.as_ref()).map(|i| i.bytes.len() as u64).sum();
    let tot = rec.len();
    let mut line = format!(
        "rmgr: {:<11} len (rec/tot): {:>6}/{:>6}, tx: {:>10}, lsn: {}, prev {}, info: 0x{:02X}, main data: {} bytes",
        rec.rmgr_name(),
        tot.saturating_sub(fpi_len),
        tot,
        rec.xid,
        waldump_lsn(rec.lsn),
        waldump_lsn(rec.prev),
        rec.info,
        rec.main_data.len(),
    );
    for b in &rec.blocks {
        line.push_str(&format!(
            ", blkref #{}: rel {}/{}/{} fork {} blk {}",
            b.id,
            b.rel.spcnode,
            b.rel.dbnode,
            b.rel.relnode,
            fork_name(b.fork),
            b.blkno
        ));
        if let Some(image) = &b.image {
            line.push_str(if image.apply { " FPW" } else { " FPW (not applied)" });
        }
        if b.will_init {
            line.push_str(" (init)");
        }
    }
    line
}

/// Reads the WAL `args` name and writes what it decodes to `out`.
pub fn run(args: &Args, out: &mut dyn Write) -> anyhow::Result<()> {
    let mut stats = Stats::default();
    let start = for_each_record(&args.paths, args.start, args.end, &mut |rec| {
        if args.stats {
            stats.add(rec);
            true
        } else {
            // stdout went away (`| head`): nothing more to say
            writeln!(out, "{}", record_line(rec)).is_ok()
        }
    })?;
    if args.stats {
        let _ = writeln!(out, "{}", stats.to_json(start));
    }
    Ok(())
}

/// Calls `each` with every record of the range (see the module doc) in order, until it says
/// `false`; returns the start used.
pub fn for_each_record(
    paths: &[PathBuf],
    start: Option<Lsn>,
    end: Option<Lsn>,
    each: &mut dyn FnMut(&DecodedRecord) -> bool,
) -> anyhow::Result<Lsn> {
    let segments = find_segments(paths)?;
    let first = segments.first().context("no segment files")?;
    let seg_size = read_segment_size(&first.path)?;
    let seg = u64::from(seg_size);
    let first_start = Lsn(first.segno(seg_size).saturating_mul(seg));
    let asked = start.is_some();
    let start = start.unwrap_or(first_start);
    if start.is_reserved() && asked {
        bail!("--start {start} is not a WAL position");
    }
    let end = end.unwrap_or(Lsn::LATEST);
    let start_segno = start.0 / seg;
    let Some(index) = segments.iter().position(|s| s.segno(seg_size) == start_segno) else {
        bail!("no segment file holds the start {start} (the first is {})", first.path.display());
    };

    let page_start = start.0 - start.0 % WAL_PAGE_SIZE;
    let mut decoder =
        WalDecoder::with_segment_size(Lsn(page_start), seg_size).context("start the decoder")?;
    let mut buf = vec![0u8; READ_CHUNK];
    'files: for (expected_segno, segment) in (start_segno..).zip(segments.get(index..).unwrap_or_default()) {
        if segment.segno(seg_size) != expected_segno {
            break; // a missing segment: the readable WAL ends here
        }
        let path = &segment.path;
        let mut file = File::open(path).with_context(|| format!("open {}", path.display()))?;
        let mut read_total = 0u64;
        if segment.segno(seg_size) == start_segno {
            let offset = page_start % seg;
            file.seek(SeekFrom::Start(offset)).with_context(|| format!("seek in {}", path.display()))?;
            read_total = offset;
        }
        loop {
            let n = file.read(&mut buf).with_context(|| format!("read {}", path.display()))?;
            if n == 0 {
                break;
            }
            read_total += n as u64;
            decoder.feed(buf.get(..n).unwrap_or_default());
            loop {
                match decoder.next_record() {
                    Ok(Some(rec)) => {
                        if rec.lsn < start {
                            continue;
                        }
                        if rec.end_lsn > end {
                            break 'files; // as pg_waldump: only records wholly below --end
                        }
                        if !each(&rec) {
                            break 'files;
                        }
                    }
                    Ok(None) => break,
                    Err(e) if e.is_end_of_wal() => break 'files,
                    Err(e) => return Err(e).with_context(|| format!("decode {}", path.display())),
                }
            }
        }
        if read_total < seg {
            break; // a short file: nothing after it can follow on
        }
    }
    Ok(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_parse_like_postgres() {
        assert_eq!(parse_segment_name("000000010000000000000001"), Some((1, 0, 1)));
        assert_eq!(parse_segment_name("0000000200000003000000FF"), Some((2, 3, 0xFF)));
        assert_eq!(parse_segment_name("000000010000000000000001.partial"), None);
        assert_eq!(parse_segment_name("0000000100000000000000ff"), None, "lower case is not PostgreSQL's");
        assert_eq!(parse_segment_name("archive_status"), None);
        let s = Segment { path: PathBuf::new(), tli: 1, log: 3, seg: 2 };
        assert_eq!(s.segno(16 << 20), 3 * 256 + 2);
        assert_eq!(s.segno(1 << 30), 3 * 4 + 2);
    }

    #[test]
    fn lsns_print_like_pg_waldump() {
        assert_eq!(waldump_lsn(Lsn(0x1A2B3C8)), "0/01A2B3C8");
        assert_eq!(waldump_lsn(Lsn(0x1_0000_0000)), "1/00000000");
    }

    #[test]
    fn directory_without_segments_is_an_error() {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::write(dir.path().join("not-a-segment"), b"x").expect("write");
        let err = find_segments(&[dir.path().to_path_buf()]).expect_err("no segments");
        assert!(err.to_string().contains("no WAL segment files"), "{err}");
        let err = find_segments(&[dir.path().join("not-a-segment")]).expect_err("bad name");
        assert!(err.to_string().contains("not named like a WAL segment"), "{err}");
    }

    use page_types::wal::page::{LongPageHeader, XLOG_PAGE_MAGIC, XLP_FIRST_IS_CONTRECORD, XLP_LONG_HEADER};
    use page_types::wal::record::{record_crc, XLOG_RECORD_HEADER_LEN, XL_CRC_OFFSET};
    use page_types::wal::XLogRecordHeader;

    const SEG: u64 = 1 << 20;

    /// Writes WAL of 1 MiB segments from the start of segment 1: records of rmgr `rmid` with
    /// `len` bytes of short or long main data. Returns (lsn, end) of each record.
    struct Wal {
        bytes: Vec<u8>,
        pos: u64,
        prev: u64,
        spans: Vec<(u64, u64)>,
    }

    impl Wal {
        fn new() -> Wal {
            Wal { bytes: Vec::new(), pos: SEG, prev: 0, spans: Vec::new() }
        }

        fn header(&mut self, rem_len: u32) {
            let long = self.pos % SEG == 0;
            let info = if long { XLP_LONG_HEADER } else { 0 }
                | if rem_len > 0 { XLP_FIRST_IS_CONTRECORD } else { 0 };
            let h = PageHeader {
                magic: XLOG_PAGE_MAGIC,
                info,
                tli: 1,
                pageaddr: Lsn(self.pos),
                rem_len,
                long: long.then_some(LongPageHeader {
                    system_id: 1,
                    seg_size: SEG as u32,
                    xlog_blcksz: 8192,
                }),
            };
            let before = self.bytes.len();
            h.encode(&mut self.bytes);
            self.pos += (self.bytes.len() - before) as u64;
        }

        fn record(&mut self, rmid: u8, len: usize) {
            while self.pos % 8 != 0 {
                self.bytes.push(0);
                self.pos += 1;
            }
            if self.pos % WAL_PAGE_SIZE == 0 {
                self.header(0);
            }
            let mut rec = Vec::new();
            let tot_len = (XLOG_RECORD_HEADER_LEN + 5 + len) as u32;
            XLogRecordHeader { tot_len, xid: 1, prev: Lsn(self.prev), info: 0, rmid, crc: 0 }
                .encode(&mut rec);
            rec.push(254);
            rec.extend_from_slice(&(len as u32).to_le_bytes());
            rec.extend(std::iter::repeat_n(7u8, len));
            let crc = record_crc(&rec).expect("whole header");
            rec[XL_CRC_OFFSET..XLOG_RECORD_HEADER_LEN].copy_from_slice(&crc.to_le_bytes());
            let lsn = self.pos;
            let mut off = 0;
            while off < rec.len() {
                if self.pos % WAL_PAGE_SIZE == 0 {
                    self.header((rec.len() - off) as u32);
                }
                let n = ((WAL_PAGE_SIZE - self.pos % WAL_PAGE_SIZE) as usize).min(rec.len() - off);
                self.bytes.extend_from_slice(&rec[off..off + n]);
                self.pos += n as u64;
                off += n;
            }
            self.spans.push((lsn, self.pos));
            self.prev = lsn;
        }

        /// Writes the WAL as segment files in a new directory, zero-filled to whole segments.
        fn files(&self, skip_segment: Option<u64>) -> tempfile::TempDir {
            let dir = tempfile::tempdir().expect("temp dir");
            let mut bytes = self.bytes.clone();
            bytes.resize(bytes.len().next_multiple_of(SEG as usize), 0);
            for (i, seg) in bytes.chunks(SEG as usize).enumerate() {
                let segno = 1 + i as u64;
                if Some(segno) != skip_segment {
                    std::fs::write(dir.path().join(format!("00000001{:08X}{:08X}", 0, segno)), seg)
                        .expect("write");
                }
            }
            dir
        }
    }

    fn stats(dir: &Path, start: Option<u64>, end: Option<u64>) -> anyhow::Result<serde_json::Value> {
        let args =
            Args { start: start.map(Lsn), end: end.map(Lsn), stats: true, paths: vec![dir.to_path_buf()] };
        let mut out = Vec::new();
        run(&args, &mut out)?;
        Ok(serde_json::from_slice(&out)?)
    }

    /// 3000 records of 3 rmgrs over about 3 segments, some crossing pages and segments.
    fn sample() -> Wal {
        let mut wal = Wal::new();
        for i in 0..3000usize {
            wal.record([10u8, 11, 1][i % 3], (i * 37) % 2000);
        }
        wal
    }

    #[test]
    fn stats_count_every_record_and_stop_quietly_at_the_zeros() {
        let wal = sample();
        let dir = wal.files(None);
        let json = stats(dir.path(), None, None).expect("reads to the end");
        assert_eq!(json["records"], 3000);
        assert_eq!(json["rmgrs"], serde_json::json!({"Heap": 1000, "Btree": 1000, "Transaction": 1000}));
        assert_eq!(json["fpi"], 0);
        assert_eq!(json["start"], Lsn(wal.spans[0].0).to_string());
        assert_eq!(json["end"], Lsn(wal.pos).to_string());
    }

    #[test]
    fn range_is_first_record_at_or_after_start_to_records_wholly_below_end() {
        let wal = sample();
        let dir = wal.files(None);
        for (start, end) in [
            (SEG + 1, 2 * SEG),
            (SEG + 40, 2 * SEG + 12345),
            (2 * SEG, 3 * SEG + 8),
            (2 * SEG + 8192, wal.pos),
        ] {
            let expected = wal.spans.iter().filter(|&&(lsn, rec_end)| lsn >= start && rec_end <= end).count();
            let json = stats(dir.path(), Some(start), Some(end)).expect("reads the range");
            assert_eq!(json["records"], expected, "range {:X}..{:X}", start, end);
        }
        // A record that crosses --end is left out, as pg_waldump leaves it out.
        let (lsn, rec_end) =
            *wal.spans.iter().find(|&&(lsn, end)| end - lsn > 100 && lsn > SEG + 8192).expect("one");
        let json = stats(dir.path(), Some(lsn), Some(rec_end - 1)).expect("reads");
        assert_eq!(json["records"], 0);
        let json = stats(dir.path(), Some(lsn), Some(rec_end)).expect("reads");
        assert_eq!(json["records"], 1);
    }

    #[test]
    fn missing_segment_ends_the_readable_wal() {
        let wal = sample();
        assert!(wal.pos > 3 * SEG, "the sample spans segment 3");
        let dir = wal.files(Some(3));
        let json = stats(dir.path(), None, None).expect("stops at the gap");
        let expected = wal.spans.iter().filter(|&&(_, end)| end <= 3 * SEG).count();
        assert_eq!(json["records"], expected);
    }

    #[test]
    fn damaged_record_is_an_error_naming_its_lsn() {
        let mut wal = sample();
        let (lsn, _) = wal.spans[100];
        let at = (lsn - SEG) as usize + XLOG_RECORD_HEADER_LEN + 2;
        wal.bytes[at] ^= 0xff;
        let dir = wal.files(None);
        let err = stats(dir.path(), None, None).expect_err("crc");
        assert!(format!("{err:#}").contains(&Lsn(lsn).to_string()), "{err:#}");
    }

    #[test]
    fn record_lines_name_rmgr_lsn_and_prev() {
        let wal = sample();
        let dir = wal.files(None);
        let args = Args {
            start: None,
            end: Some(Lsn(wal.spans[2].1)),
            stats: false,
            paths: vec![dir.path().to_path_buf()],
        };
        let mut out = Vec::new();
        run(&args, &mut out).expect("reads");
        let text = String::from_utf8(out).expect("utf8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("rmgr: Heap "), "{}", lines[0]);
        assert!(
            lines[1].contains(&format!(
                "lsn: {}, prev {}",
                waldump_lsn(Lsn(wal.spans[1].0)),
                waldump_lsn(Lsn(wal.spans[0].0))
            )),
            "{}",
            lines[1]
        );
        assert!(lines[2].starts_with("rmgr: Transaction "), "{}", lines[2]);
    }
}
