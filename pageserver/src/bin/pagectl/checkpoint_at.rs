//! `pagectl checkpoint-at --lsn X DATADIR`: makes a cleanly shut-down PostgreSQL 15 data
//! directory start at X: what `pg_resetwal -l` does, at any X, not only at a segment start. It is
//! the base backup's start point (docs/rfcs/0008-postgresql-out.md, step 1) checked without the
//! daemon: the tests run it on copies of a stopped cluster and start a stock PostgreSQL on them.
//!
//! It reads `global/pg_control` (`page_types::control_file::ControlFile`), refuses a cluster
//! that was not shut down cleanly (its pages may be ahead of its checkpoint; start it and stop
//! it with `pg_ctl stop`) and an X below the checkpoint's redo (pages could then be above X).
//! It writes the one WAL segment of `page_types::wal::checkpoint::shutdown_checkpoint_segment`
//! (a shutdown checkpoint at X': X taken to 8 bytes and past a page header, or the next
//! segment's first record position when the record would not fit in X's segment), with the
//! checkpoint of `pg_control` but `redo` = X' and the time now, on `pg_control`'s timeline; it
//! removes every other WAL segment (and `.partial` segment, and their `archive_status` files)
//! from `pg_wal`; and it writes `pg_control` with `checkPoint` = X', that checkpoint as
//! `checkPointCopy`, the state "shut down", the time now, and the minimum recovery point and
//! backup fields zero. Every other field (system identifier, parameters, nonce) is kept.
//!
//! Order, so that a crash midway leaves a directory that either starts at X or refuses to start
//! (and the command can be run again): the new segment is written under a temporary name and
//! synced; the old segments are removed; the segment is renamed into place; `pg_control` is
//! replaced last, by a synced temporary file renamed over it. New files get the owner of the
//! files they replace (a root operator working on a directory of the `postgres` user leaves it
//! usable by that user) and mode 0600.
//!
//! Prints one JSON object: `requested` (X), `checkpoint` (X'), `end` (the record's end),
//! `timeline`, `segment` and `control_file` (written, relative to DATADIR), `removed` (the
//! WAL files removed, sorted).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Context};
use page_types::control_file::{ControlFile, DbState};
use page_types::Lsn;

/// `pg_control` relative to the data directory.
const CONTROL_FILE: &str = "global/pg_control";

pub struct Args {
    pub lsn: Lsn,
    pub datadir: PathBuf,
}

/// What was written.
pub struct Outcome {
    pub requested: Lsn,
    pub checkpoint: Lsn,
    pub end: Lsn,
    pub timeline: u32,
    /// Relative to the data directory.
    pub segment: String,
    pub control_file: String,
    pub removed: Vec<String>,
}

impl Outcome {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "requested": self.requested.to_string(),
            "checkpoint": self.checkpoint.to_string(),
            "end": self.end.to_string(),
            "timeline": self.timeline,
            "segment": self.segment,
            "control_file": self.control_file,
            "removed": self.removed,
        })
    }
}

/// A WAL file `pg_resetwal` removes: a segment (24 upper-case hex digits, `IsXLogFileName`) or
/// a partial one (`IsPartialXLogFileName`).
fn is_wal_file(name: &str) -> bool {
    let segment = name.strip_suffix(".partial").unwrap_or(name);
    segment.len() == 24 && segment.bytes().all(|b| b.is_ascii_digit() || (b'A'..=b'F').contains(&b))
}

pub fn run(args: &Args) -> anyhow::Result<Outcome> {
    let datadir = &args.datadir;
    let control_path = datadir.join(CONTROL_FILE);
    let old_bytes = fs::read(&control_path).with_context(|| format!("read {}", control_path.display()))?;
    let old =
        ControlFile::decode(&old_bytes).with_context(|| format!("decode {}", control_path.display()))?;
    ensure!(
        old.state == DbState::Shutdowned,
        "{} was not shut down cleanly: pg_control says \"{}\", not \"shut down\" (start PostgreSQL on it and stop \
         it with pg_ctl stop)",
        datadir.display(),
        old.state
    );
    let redo = old.checkpoint_copy.redo;
    ensure!(
        args.lsn >= redo,
        "--lsn {} is below the cluster's checkpoint redo {redo}: its pages may be newer than that",
        args.lsn
    );
    let now = SystemTime::now().duration_since(UNIX_EPOCH).context("read the clock")?.as_secs() as i64;
    let timeline = old.checkpoint_copy.this_timeline_id;
    let (new, start) = old
        .started_at(&old.checkpoint_copy, args.lsn, now)
        .with_context(|| format!("write the start segment for {}", args.lsn))?;

    let pg_wal = datadir.join("pg_wal");
    let wal_owner = fs::metadata(&pg_wal).with_context(|| format!("stat {}", pg_wal.display()))?;
    let segment_tmp = pg_wal.join(format!("{}.checkpoint-at", start.file_name));
    write_synced(&segment_tmp, &start.bytes, (wal_owner.uid(), wal_owner.gid()))?;

    let mut removed = Vec::new();
    for entry in fs::read_dir(&pg_wal).with_context(|| format!("list {}", pg_wal.display()))? {
        let entry = entry.with_context(|| format!("list {}", pg_wal.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_wal_file(&name) && entry.file_type().is_ok_and(|t| t.is_file()) {
            fs::remove_file(entry.path()).with_context(|| format!("remove {}", entry.path().display()))?;
            removed.push(format!("pg_wal/{name}"));
        }
    }
    let archive_status = pg_wal.join("archive_status");
    if archive_status.is_dir() {
        for entry in
            fs::read_dir(&archive_status).with_context(|| format!("list {}", archive_status.display()))?
        {
            let entry = entry.with_context(|| format!("list {}", archive_status.display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let segment = name.strip_suffix(".ready").or_else(|| name.strip_suffix(".done"));
            if segment.is_some_and(is_wal_file) {
                fs::remove_file(entry.path())
                    .with_context(|| format!("remove {}", entry.path().display()))?;
                removed.push(format!("pg_wal/archive_status/{name}"));
            }
        }
    }
    removed.sort();
    let segment_path = pg_wal.join(&start.file_name);
    fs::rename(&segment_tmp, &segment_path)
        .with_context(|| format!("rename into {}", segment_path.display()))?;
    sync_dir(&pg_wal)?;

    let control_owner =
        fs::metadata(&control_path).with_context(|| format!("stat {}", control_path.display()))?;
    let control_tmp = control_path.with_extension("checkpoint-at");
    write_synced(&control_tmp, &new.encode(), (control_owner.uid(), control_owner.gid()))?;
    fs::rename(&control_tmp, &control_path)
        .with_context(|| format!("rename into {}", control_path.display()))?;
    if let Some(global) = control_path.parent() {
        sync_dir(global)?;
    }
    Ok(Outcome {
        requested: args.lsn,
        checkpoint: start.lsn,
        end: start.end_lsn,
        timeline,
        segment: format!("pg_wal/{}", start.file_name),
        control_file: CONTROL_FILE.to_owned(),
        removed,
    })
}

/// Writes `bytes` to a new file at `path` (mode 0600, owned by `owner`), synced.
fn write_synced(path: &Path, bytes: &[u8], owner: (u32, u32)) -> anyhow::Result<()> {
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    file.write_all(bytes).with_context(|| format!("write {}", path.display()))?;
    let meta = file.metadata().with_context(|| format!("stat {}", path.display()))?;
    if (meta.uid(), meta.gid()) != owner {
        std::os::unix::fs::fchown(&file, Some(owner.0), Some(owner.1))
            .with_context(|| format!("give {} the owner of the data directory", path.display()))?;
    }
    file.sync_all().with_context(|| format!("sync {}", path.display()))
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("sync {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wal_files_are_segments_and_partial_segments_only() {
        assert!(is_wal_file("000000010000000000000001"));
        assert!(is_wal_file("00000001000000020000003F.partial"));
        assert!(!is_wal_file("00000002.history"));
        assert!(!is_wal_file("000000010000000000000001.checkpoint-at"));
        assert!(!is_wal_file("00000001000000000000000a"));
        assert!(!is_wal_file("archive_status"));
    }
}
