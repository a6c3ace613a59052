#!/usr/bin/env python3
"""Records the WAL of a workload (`fixtures.pg_workloads`) on a fresh PostgreSQL 15 into a
directory of segment files, for `pagectl redocheck` and the redo benchmarks.

    test_runner/performance/record_pg_wal.py --out DIR [--workload redo_mix] [--consistency-checking] [--seconds N]

With `--consistency-checking`, `wal_consistency_checking = 'all'`: every record carries a
check image of each block it changes (PostgreSQL's own page after the record).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fixtures import pg_workloads  # noqa: E402
from fixtures.postgres import Postgres  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--workload", default="redo_mix")
    ap.add_argument("--consistency-checking", action="store_true")
    ap.add_argument("--seconds", type=int, default=4, help="of the pgbench run in the workload")
    args = ap.parse_args()
    settings = {"autovacuum": "off", "full_page_writes": "on"}
    if args.consistency_checking:
        settings["wal_consistency_checking"] = "'all'"
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp) / "pg", settings=settings).init().start()
        try:
            # A slot keeps every segment from here on (checkpoints would recycle them).
            pg.sql("select pg_create_physical_replication_slot('record', true)")
            start = pg.sql("select pg_walfile_name(pg_current_wal_lsn())")
            getattr(pg_workloads, args.workload)(pg, seconds=args.seconds)
            end = pg.sql("select pg_current_wal_lsn()")
            pg.sql("select pg_switch_wal()")
        finally:
            pg.stop()
        args.out.mkdir(parents=True, exist_ok=True)
        copied = pg.copy_wal(args.out)
    print(f"recorded {len(copied)} segments from {start} to {end} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
