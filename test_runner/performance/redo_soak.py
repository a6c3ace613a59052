#!/usr/bin/env python3
"""The long form of test_pg15_redo.py's record-by-record check: a longer PostgreSQL 15 workload
with `wal_consistency_checking = 'all'`, and every record of it that the child applies (not a
sample: every resource manager's, SPGist included) applied with the child's redo and compared
with PostgreSQL's page.

Not a test (pytest collects only test_*.py); it runs for minutes and writes gigabytes of WAL.

    cargo build --release --bin pagectl
    python3 test_runner/performance/redo_soak.py --bin-dir target/release --seconds 10 \\
        [--workload redo_mix] [--workload gin_mix] [--workload brin] [--keep DIR]

Every workload of `fixtures.pg_workloads` runs for about `--seconds` (past its fixed first part):
`redo_mix` (heap, btree: pgbench), `btree_edges` (fixed work only), `sequences`, `bloom` (generic
WAL), `brin`, `gist_mix`, `gin_mix`, `spgist_mix` (rounds of their own records until the time is
up) and `hash_index` (whose row counts scale with it). Measured on the 2-vCPU machine with
`--seconds 5` (2026-11-28): sequences 60k records (1,744 Sequence LOG), bloom 536k (169k
Generic), brin 274k (94k BRIN), all matched.

For each workload it records the WAL (`record_pg_wal.py`), runs
`pagectl redocheck` on it, prints matched/checked per record type, and exits 1 if any page
differs or any apply failed. The WAL is removed afterwards unless --keep names a directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--seconds", type=int, default=10, help="of each workload's pgbench run (about 0.5 GB of WAL a second)")
    ap.add_argument("--workload", action="append", help="a function of fixtures.pg_workloads (default: redo_mix)")
    ap.add_argument("--keep", type=Path, help="keep the recorded WAL under this directory")
    args = ap.parse_args()
    clean = True
    for workload in args.workload or ["redo_mix"]:
        base = Path(tempfile.mkdtemp(prefix="redo-soak-")) if args.keep is None else args.keep / workload
        wal = base / "wal"
        try:
            subprocess.run([sys.executable, str(HERE / "record_pg_wal.py"), "--out", str(wal), "--workload", workload,
                            "--consistency-checking", "--seconds", str(args.seconds)], check=True)
            out = subprocess.run([str(args.bin_dir / "pagectl"), "redocheck", "--show", "20", str(wal)],
                                 capture_output=True, text=True)
            if out.returncode not in (0, 1) or not out.stdout.strip():
                print(out.stderr, file=sys.stderr)
                return 2
            report = json.loads(out.stdout)
            print(f"{workload}: {report['records']} records")
            for kind, t in report["types"].items():
                if t["checked"] or t["failed"] or t["unsupported"]:
                    print(f"  {kind:32} {t['matched']:8} / {t['checked']:<8} failed {t['failed']} "
                          f"unsupported {t['unsupported']}")
            for d in report["differences"] + report["failures"]:
                print(f"  DIFFERS: {d}")
            clean = clean and out.returncode == 0
        finally:
            if args.keep is None:
                shutil.rmtree(base, ignore_errors=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
