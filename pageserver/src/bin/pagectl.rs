//! `pagectl`: the operator tool for what the daemon stores and ingests, run by hand or by
//! tests, never by the daemon.
//!
//! - `pagectl waldump [--start X/X] [--end X/X] [--stats] <pg_wal dir or segment files...>`
//!   decodes PostgreSQL 15 WAL segment files with the pageserver's own decoder
//!   (`page_types::wal`) and prints one line per record, or with `--stats` one JSON object of
//!   counts per resource manager that can be compared with `pg_waldump --stats`
//!   ([`waldump`] has the details).
//!
//! - `pagectl receivewal --source <connstr> --slot <name> [--start X/X] [--end X/X] --dir <dir>`
//!   streams WAL from a PostgreSQL 15 primary with the daemon's replication client into
//!   segment files laid out as in `pg_wal` ([`receivewal`]): a check that a WAL source is
//!   reachable and streams.
//!
//! - `pagectl basebackup --source <connstr> [--list]` takes a base backup of a PostgreSQL 15
//!   server with the daemon's replication client and runs it through the importer without
//!   storing it ([`basebackup`]); prints one JSON object: the start and end LSNs, the values
//!   per class, and with `--list` every file with its size and class.
//!
//! - `pagectl redocheck [--start X/X] [--end X/X] [--show N] <pg_wal dir or segments...>`
//!   applies every record of WAL written with `wal_consistency_checking` with the redo child's
//!   PostgreSQL redo and compares each page with PostgreSQL's check image ([`redocheck`]);
//!   prints one JSON object of matches per record type, apply times and the first
//!   differences; exit status 1 when any page differs or any apply failed.
//!
//! - `pagectl chain [--key <spc>/<db>/<rel>/<fork>/<blk>] --records N [--out FILE] [--start X/X]
//!   [--end X/X] <pg_wal dir or segments...>` cuts N consecutive PostgreSQL 15 record values of
//!   one block (without `--key`: the block with the most) out of WAL written with
//!   `wal_consistency_checking`, checks that the redo child's redo of them gives PostgreSQL's
//!   page, and writes them with the base and expected pages as a `bench_walredo` fixture
//!   ([`chain`]); prints one JSON object describing the chain.
//!
//! - `pagectl checkpoint-at --lsn X/X <datadir>` makes a cleanly shut-down PostgreSQL 15 data
//!   directory start at X: one WAL segment with a shutdown checkpoint at X' (X taken to a
//!   record position) and a `pg_control` that points at it, as `pg_resetwal -l` does at a
//!   segment start ([`checkpoint_at`]); prints one JSON object: X', the record's end and the
//!   files written and removed.
//!
//! This file only parses arguments and maps the outcome to an exit status: 0 when the WAL asked
//! for was read to its end (the end of the range, or the end of readable WAL: zeros, a recycled
//! segment, a record cut off by the end of the last file); 1 with the message on stderr for any
//! other decode error or an unreadable file; 2 for bad arguments.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use page_types::Lsn;

// A binary's root resolves `mod` next to itself (src/bin/); its modules live in src/bin/pagectl/.
#[path = "pagectl/basebackup.rs"]
mod basebackup;
#[path = "pagectl/chain.rs"]
mod chain;
#[path = "pagectl/checkpoint_at.rs"]
mod checkpoint_at;
#[path = "pagectl/receivewal.rs"]
mod receivewal;
#[path = "pagectl/redocheck.rs"]
mod redocheck;
#[path = "pagectl/waldump.rs"]
mod waldump;

#[derive(Parser, Debug)]
#[command(name = "pagectl", about = "Operator tool of the pageserver", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Decode PostgreSQL 15 WAL segment files: one line per record, or counts with --stats.
    Waldump {
        /// First record: the first one that starts at or after this LSN (default: the first
        /// record that starts in the first segment).
        #[arg(long)]
        start: Option<Lsn>,
        /// Stop before the first record that does not end at or below this LSN, as pg_waldump
        /// does (default: the end of readable WAL).
        #[arg(long)]
        end: Option<Lsn>,
        /// Print one JSON object of counts (records, per resource manager, full-page images)
        /// instead of one line per record.
        #[arg(long)]
        stats: bool,
        /// A pg_wal directory, or segment files (named like 000000010000000000000001).
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Stream WAL from a PostgreSQL 15 primary over physical replication into segment files,
    /// with the pageserver's replication client; prints a JSON summary when `--end` is reached.
    Receivewal {
        /// libpq keyword/value connection string, e.g. "host=db1 port=5432 user=replicator".
        #[arg(long)]
        source: String,
        /// Physical replication slot; created (reserving WAL) if missing.
        #[arg(long)]
        slot: String,
        /// Where to start (default: the start of the segment of the server's flush position).
        #[arg(long)]
        start: Option<Lsn>,
        /// Stop once everything below this LSN is received (default: stream until killed).
        #[arg(long)]
        end: Option<Lsn>,
        /// Directory for the segment files (created if missing).
        #[arg(long)]
        dir: PathBuf,
    },
    /// Apply PostgreSQL 15 WAL written with wal_consistency_checking with the redo child's
    /// redo, record by record, and compare each page with PostgreSQL's check image.
    Redocheck {
        /// First record (default: the first that starts in the first segment).
        #[arg(long)]
        start: Option<Lsn>,
        /// Stop before the first record that does not end at or below this LSN.
        #[arg(long)]
        end: Option<Lsn>,
        /// How many differences and failures to print.
        #[arg(long, default_value_t = 10)]
        show: usize,
        /// A pg_wal directory, or segment files.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Cut a chain of N PostgreSQL 15 records of one block out of WAL written with
    /// wal_consistency_checking, check it against PostgreSQL's page, and write it as a
    /// bench_walredo fixture.
    Chain {
        /// The block, as <spcnode>/<dbnode>/<relnode>/<forknum>/<blknum> (default: the block
        /// with the most record values, printed on stderr).
        #[arg(long, value_parser = chain::parse_key)]
        key: Option<page_types::BufferTag>,
        /// Record values in the chain.
        #[arg(long)]
        records: usize,
        /// The fixture file to write (default: only print the chain).
        #[arg(long)]
        out: Option<PathBuf>,
        /// First record (default: the first that starts in the first segment).
        #[arg(long)]
        start: Option<Lsn>,
        /// Stop before the first record that does not end at or below this LSN.
        #[arg(long)]
        end: Option<Lsn>,
        /// A pg_wal directory, or segment files.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Take a base backup of a PostgreSQL 15 server and run it through the importer without
    /// storing it; prints a JSON summary (start and end LSNs, values per class).
    Basebackup {
        /// libpq keyword/value connection string, e.g. "host=db1 port=5432 user=replicator".
        #[arg(long)]
        source: String,
        /// Also list every file: archive, path, size, and how it is imported.
        #[arg(long)]
        list: bool,
    },
    /// Make a cleanly shut-down PostgreSQL 15 data directory start at an LSN: write one WAL
    /// segment with a shutdown checkpoint there and point pg_control at it (pg_resetwal -l at
    /// any LSN); prints a JSON summary.
    CheckpointAt {
        /// Where the cluster is to start: the end of a record at or above the cluster's
        /// checkpoint (no page of the directory may have a higher LSN).
        #[arg(long)]
        lsn: Lsn,
        /// The data directory (its WAL segments are replaced).
        datadir: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Basebackup { source, list } => {
            let args = basebackup::Args { source, list };
            let outcome = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(anyhow::Error::from)
                .and_then(|runtime| runtime.block_on(basebackup::run(&args)));
            match outcome {
                Ok(b) => {
                    println!("{}", basebackup_json(&b, list));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    use std::io::Write as _;
                    let _ = writeln!(std::io::stderr(), "pagectl basebackup: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Receivewal { source, slot, start, end, dir } => {
            let args = receivewal::Args { source, slot, start, end, dir };
            let outcome = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(anyhow::Error::from)
                .and_then(|runtime| runtime.block_on(receivewal::run(&args)));
            match outcome {
                Ok(r) => {
                    let summary = serde_json::json!({
                        "start": r.start.to_string(),
                        "end": r.end.to_string(),
                        "timeline": r.timeline,
                        "created_slot": r.created_slot,
                    });
                    println!("{summary}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    use std::io::Write as _;
                    let _ = writeln!(std::io::stderr(), "pagectl receivewal: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Redocheck { start, end, show, paths } => {
            let args = redocheck::Args { paths, start, end, show };
            match redocheck::run(&args) {
                Ok(report) => {
                    println!("{report}");
                    let clean = report["differences"].as_array().is_some_and(|d| d.is_empty())
                        && report["failures"].as_array().is_some_and(|f| f.is_empty());
                    if clean {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    }
                }
                Err(e) => {
                    use std::io::Write as _;
                    let _ = writeln!(std::io::stderr(), "pagectl redocheck: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Chain { key, records, out, start, end, paths } => {
            let args = chain::Args { paths, key, records, out, start, end };
            match chain::run(&args) {
                Ok(report) => {
                    println!("{report}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    use std::io::Write as _;
                    let _ = writeln!(std::io::stderr(), "pagectl chain: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Command::CheckpointAt { lsn, datadir } => {
            let args = checkpoint_at::Args { lsn, datadir };
            match checkpoint_at::run(&args) {
                Ok(outcome) => {
                    println!("{}", outcome.to_json());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    use std::io::Write as _;
                    let _ = writeln!(std::io::stderr(), "pagectl checkpoint-at: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Waldump { start, end, stats, paths } => {
            let args = waldump::Args { start, end, stats, paths };
            match waldump::run(&args, &mut std::io::stdout().lock()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    use std::io::Write as _;
                    let _ = writeln!(std::io::stderr(), "pagectl waldump: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

fn basebackup_json(b: &basebackup::Backup, list: bool) -> serde_json::Value {
    let p = &b.progress;
    let mut out = serde_json::json!({
        "start": b.start.to_string(),
        "end": b.end.to_string(),
        "timeline": b.timeline,
        "system_id": b.system_id,
        "tablespaces": b.tablespaces.iter().map(|t| serde_json::json!({
            "oid": t.oid, "location": t.location, "size_kb": t.size_kb,
        })).collect::<Vec<_>>(),
        "archives": p.archives,
        "files": p.files,
        "skipped_files": p.skipped_files,
        "bytes": p.bytes,
        "server_bytes": b.server_bytes,
        "partial_tails": p.partial_tails,
        "values": {
            "rel": p.rel_pages,
            "slru": p.slru_pages,
            "control": p.control_files,
            "relmap": p.relmaps,
            "config": p.config_files,
            "twophase": p.two_phase_files,
            "rel_size": p.rel_sizes,
        },
    });
    if list {
        out["file_list"] = b
            .files
            .iter()
            .map(|f| {
                serde_json::json!({
                    "archive": f.archive, "path": f.path, "size": f.size, "class": f.class.class(),
                })
            })
            .collect();
    }
    out
}
