#!/usr/bin/env python3
"""The child's redo cost per record type next to PostgreSQL's own replay of the same WAL.

Not a test (pytest collects only test_*.py): the measurement behind docs/performance.md,
"Redo cost per resource manager".

    cargo build --release --bin pagectl
    python3 test_runner/performance/redo_cost.py --bin-dir target/release [--seconds 4] \\
        [--workload gin_mix ...] [--out FILE.json]

For each workload of `fixtures.pg_workloads` (default: every one that makes the records of a
resource manager: redo_mix for heap and btree, sequences, bloom for generic WAL, brin, gist_mix,
gin_mix, spgist_mix, hash_index), twice on a fresh PostgreSQL 15 (autovacuum off, a base backup
taken before the workload):

1. with `wal_consistency_checking = 'all'`: the backup replays the WAL (PostgreSQL's startup
   process; it also checks every record's page against the record's check image), timed as
   PostgreSQL logs it (`redo done ... elapsed`); then `pagectl redocheck` over the same WAL
   (decode, redo of every block value in process, the same check), timed around the command,
   which reports per record type the applies and their median and total nanoseconds (the redo
   alone: no decoding, no page copy, no check);
2. without it: the same workload again, and the backup's replay of that WAL, timed the same way:
   PostgreSQL's plain replay per record.

PostgreSQL's replay with checks of `gist_mix` fails its own check at the first GiST DELETE
(PostgreSQL 15's `gistRedoDeleteRecord` sets F_TUPLES_DELETED, which the primary does not, and
`gist_mask` keeps the flag); the script records the failure and goes on.

It prints one table per workload and writes everything as JSON with --out. Run it with nothing
else on the machine: PostgreSQL's figures have a resolution of 10 ms, so give small workloads
`--seconds` enough to replay for a second or more.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures import pg_workloads  # noqa: E402
from fixtures.postgres import Postgres  # noqa: E402
from fixtures.waldump import lsn_int  # noqa: E402

WORKLOADS = ["redo_mix", "sequences", "bloom", "brin", "gist_mix", "gin_mix", "spgist_mix", "hash_index"]
# The resource managers (pg_waldump's names, the first word of a record type) each workload is for.
RMGRS = {
    "redo_mix": ("Heap", "Heap2", "Btree"),
    "sequences": ("Sequence",),
    "bloom": ("Generic",),
    "brin": ("BRIN",),
    "gist_mix": ("Gist",),
    "gin_mix": ("Gin",),
    "spgist_mix": ("SPGist",),
    "hash_index": ("Hash",),
}


def run_workload(base: Path, workload: str, seconds: int, checking: bool) -> dict:
    """The workload on a fresh primary, its WAL replayed by a backup taken before it; the WAL
    copied to `base / "wal"` when `checking`."""
    settings = {"autovacuum": "off", "max_wal_size": "'8GB'", "checkpoint_timeout": "'1h'",
                "max_prepared_transactions": "10"}
    if checking:
        settings["wal_consistency_checking"] = "'all'"
    primary = Postgres(base / "primary", settings=settings).init().start()
    try:
        primary.sql("select pg_create_physical_replication_slot('keep', true)")
        replay = primary.backup_for_replay(base / "replay")
        start = primary.lsn("select pg_current_wal_flush_lsn()")
        getattr(pg_workloads, workload)(primary, seconds=seconds)
        end = primary.lsn("select pg_current_wal_flush_lsn()")
        stats = primary.waldump(start, end, "--stats")
        records = int(re.search(r"^Total\s+(\d+)", stats, re.M).group(1))
        primary.sql("select pg_switch_wal()")
        primary.stop()  # the machine's CPUs for the replay alone
        elapsed = cpu = failed = None
        try:
            elapsed, cpu = replay.timed_replay(primary)
        except RuntimeError as e:
            # PostgreSQL's own replay can fail its own check (GiST DELETE: its redo sets
            # F_TUPLES_DELETED, which the primary does not, and gist_mask keeps that flag).
            fatal = [line for line in str(e).splitlines() if "FATAL" in line or "CONTEXT" in line]
            if not fatal:
                raise
            failed = " / ".join(line.split(":  ", 1)[-1] for line in fatal)
        if checking:
            primary.copy_wal(base / "wal")
    finally:
        primary.stop()
    return {"start": start, "end": end, "wal_bytes": lsn_int(end) - lsn_int(start), "records": records,
            "postgres_replay_seconds": elapsed, "postgres_replay_cpu_seconds": cpu, "postgres_replay_failed": failed}


def redocheck(bin_dir: Path, wal: Path, start: str, end: str) -> dict:
    """`pagectl redocheck` over [start, end) of `wal`: its report, with its wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    out = subprocess.run([str(bin_dir / "pagectl"), "redocheck", "--start", start, "--end", end, str(wal)],
                         capture_output=True, text=True)
    wall = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode not in (0, 1) or not out.stdout.strip():
        raise SystemExit(f"pagectl redocheck failed ({out.returncode}): {out.stderr}")
    report = json.loads(out.stdout)
    report["wall_seconds"] = round(wall, 3)
    report["cpu_seconds"] = round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 3)
    return report


def measure(bin_dir: Path, workload: str, seconds: int) -> dict:
    base = Path(tempfile.mkdtemp(prefix="redo-cost-"))
    try:
        checked = run_workload(base / "checked", workload, seconds, checking=True)
        report = redocheck(bin_dir, base / "checked" / "wal", checked["start"], checked["end"])
        plain = run_workload(base / "plain", workload, seconds, checking=False)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    types = report["types"]
    applied = sum(t["applied"] for t in types.values())
    apply_ns = sum(t["total_apply_ns"] for t in types.values())
    mismatched = sum(t["checked"] - t["matched"] + t["failed"] + t["unsupported"] for t in types.values())
    return {
        "workload": workload,
        "checked": {**checked, "redocheck_wall_seconds": report["wall_seconds"],
                    "redocheck_cpu_seconds": report["cpu_seconds"], "values_applied": applied,
                    "apply_seconds": round(apply_ns / 1e9, 4), "not_matched": mismatched},
        "plain": plain,
        "types": {kind: {"applied": t["applied"], "median_apply_ns": t["median_apply_ns"],
                         "total_apply_ns": t["total_apply_ns"]}
                  for kind, t in types.items() if kind.split()[0] in RMGRS[workload]},
    }


def show(m: dict) -> None:
    c, p = m["checked"], m["plain"]
    us = lambda seconds, n: f"{seconds * 1e6 / n:7.2f}" if n else "      -"  # noqa: E731
    print(f"\n{m['workload']}: checked WAL {c['wal_bytes'] / 1e6:.1f} MB, {c['records']} records; "
          f"plain WAL {p['wal_bytes'] / 1e6:.1f} MB, {p['records']} records")
    print(f"  PostgreSQL replay, plain WAL      {p['postgres_replay_seconds']:7.2f} s  "
          f"{us(p['postgres_replay_seconds'], p['records'])} us/record (CPU {p['postgres_replay_cpu_seconds']:.2f} s)")
    if c["postgres_replay_failed"]:
        print(f"  PostgreSQL replay + checks        failed: {c['postgres_replay_failed']}")
    else:
        print(f"  PostgreSQL replay + checks        {c['postgres_replay_seconds']:7.2f} s  "
              f"{us(c['postgres_replay_seconds'], c['records'])} us/record (CPU {c['postgres_replay_cpu_seconds']:.2f} s)")
    print(f"  pagectl redocheck (decode+redo+check) {c['redocheck_wall_seconds']:7.2f} s  "
          f"{us(c['redocheck_wall_seconds'], c['records'])} us/record (CPU {c['redocheck_cpu_seconds']:.2f} s)")
    print(f"  child's redo alone                {c['apply_seconds']:7.3f} s  {us(c['apply_seconds'], c['values_applied'])} us/value "
          f"({c['values_applied']} values; not matched: {c['not_matched']})")
    for kind, t in sorted(m["types"].items()):
        print(f"    {kind:30} {t['applied']:8} values  median {t['median_apply_ns'] or 0:7} ns")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--seconds", type=int, default=4, help="passed to each workload (its timed part)")
    ap.add_argument("--workload", action="append", choices=WORKLOADS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    for workload in args.workload or WORKLOADS:
        m = measure(args.bin_dir.resolve(), workload, args.seconds)
        show(m)
        results.append(m)
    if args.out:
        doc = {"date": time.strftime("%Y-%m-%d"), "seconds": args.seconds, "workloads": results}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(m["checked"]["not_matched"] == 0 for m in results) else 1


if __name__ == "__main__":
    sys.exit(main())
