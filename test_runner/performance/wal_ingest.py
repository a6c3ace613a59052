"""WAL ingest of a real PostgreSQL 15 workload against PostgreSQL's own replay of the same WAL.

Not a test (pytest collects only test_*.py): the benchmark behind docs/performance.md, "WAL
ingest against PostgreSQL's replay".

    cargo build --release --bins
    python3 test_runner/performance/wal_ingest.py --bin-dir target/release --scale 10 --duration 20

It starts a PostgreSQL 15 primary (autovacuum off), takes a base backup with pg_basebackup, runs
`pgbench -i -s SCALE` and `pgbench -c 4 -T DURATION` on the primary (the WAL kept by a slot),
then replays that WAL twice, one after the other, on the same machine:

- PostgreSQL: the base backup started with the workload's WAL in its pg_wal; replay is what
  PostgreSQL itself logs (`redo done at ... elapsed: S s`), from the backup's checkpoint to the
  end of the WAL;
- the pageserver (release build, defaults, `compaction=off` so that only ingest runs): a tenant
  attached to the primary with its position set to where the workload began, so it streams the
  recorded WAL as fast as it can; from the attach to its durable LSN reaching the end.

It prints, and writes as JSON with --out, the WAL bytes and records, both elapsed times and
rates, the ratio (the issue's target: the pageserver >= 2x PostgreSQL's replay rate), and the
pageserver's CPU seconds. Both replays read WAL already in the page cache of this machine; the
pageserver's includes the replication connection (PostgreSQL's walsender reads the files).
`--perf FILE` records the daemon's ingest with `perf record -e cpu-clock -g`.

Reference (2026-11-25, the 2-vCPU machine of docs/performance.md, commit after 33d845f with the
pipelined ingest; results/2026-11-25-wal-ingest-*.json): scale 10, 20 s: 184 MB, 834k records,
740k values; PostgreSQL replays it in 1.31 s (141 MB/s), the pageserver ingests it in 2.02 s
(92 MB/s, 1.73 s of CPU): 0.65x, and 0.59x in a second run. The target (2x) is not met; what
bounds it is in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.daemon import Pageserver  # noqa: E402
from fixtures.postgres import Postgres  # noqa: E402
from fixtures.waldump import lsn_int  # noqa: E402


def cpu_seconds(pid: int) -> float:
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--perf", type=Path, help="record the daemon's ingest with perf (cpu-clock) into this file")
    args = ap.parse_args()
    args.bin_dir = args.bin_dir.resolve()

    base = Path(tempfile.mkdtemp(prefix="wal-ingest-"))
    os.chmod(base, 0o755)
    settings = {"autovacuum": "off", "max_wal_size": "'4GB'", "checkpoint_timeout": "'1h'"}
    primary = Postgres(base / "primary", settings=settings).init().start()
    ps = None
    try:
        primary.sql("select pg_create_physical_replication_slot('bench', true)")
        # The base backup PostgreSQL replays from (its own checkpoint, before the workload).
        replay = primary.backup_for_replay(base / "replay")
        start = primary.lsn("select pg_current_wal_flush_lsn()")
        print(f"workload: pgbench -i -s {args.scale}, then -c 4 -T {args.duration}", flush=True)
        primary.pgbench("-i", "-s", str(args.scale), "-q", timeout=900)
        primary.pgbench("-c", "4", "-j", "2", "-T", str(args.duration), "-n", timeout=900)
        end = primary.lsn("select pg_current_wal_flush_lsn()")
        wal_bytes = lsn_int(end) - lsn_int(start)
        stats = primary.waldump(start, end, "--stats")
        records = int(re.search(r"^Total\s+(\d+)", stats, re.M).group(1))
        print(f"WAL {start} .. {end}: {wal_bytes / 1e6:.1f} MB, {records} records", flush=True)

        # PostgreSQL's replay: the backup, with the workload's WAL in its pg_wal.
        primary.stop()  # the machine's CPUs for the replay alone
        began = time.monotonic()
        pg_elapsed, pg_cpu = replay.timed_replay(primary)
        pg_wall = time.monotonic() - began
        primary.start()

        # The pageserver's ingest of the same WAL, from the same starting point.
        ps = Pageserver(args.bin_dir, base / "pageserver", {"compaction": "off"}, None, None)
        ps.start()
        tenant = ps.create_tenant("bench")
        source = {"postgres": primary.connstr(), "slot": "bench"}
        tenant_dir = base / "pageserver" / "tenants" / tenant
        (tenant_dir / "wal_source.json").write_text(json.dumps({**source, "position": lsn_int(start)}))
        perf = None
        if args.perf:
            import subprocess
            perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "2000", "-g", "-o", str(args.perf),
                                     "-p", str(ps.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)
        cpu0 = cpu_seconds(ps.pid)
        began = time.monotonic()
        resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/wal_source", source)
        assert resp.status == 200, resp
        while True:
            w = ps.http.tenant_status(tenant)["wal_source"]
            if w["durable_lsn"] >= lsn_int(end):
                break
            if w["state"] == "error":
                raise SystemExit(f"the receiver failed: {w['error']}")
            time.sleep(0.02)
        ps_elapsed = time.monotonic() - began
        ps_cpu = cpu_seconds(ps.pid) - cpu0
        if perf is not None:
            import signal
            perf.send_signal(signal.SIGINT)
            perf.wait(timeout=60)
        values = ps.http.tenant_status(tenant)["storage"]["values"]

        result = {
            "date": time.strftime("%Y-%m-%d"),
            "scale": args.scale,
            "duration": args.duration,
            "wal_bytes": wal_bytes,
            "records": records,
            "values": values,
            "postgres_replay_seconds": pg_elapsed,
            "postgres_replay_cpu_seconds": pg_cpu,
            "postgres_start_seconds": round(pg_wall, 3),
            "pageserver_ingest_seconds": round(ps_elapsed, 3),
            "pageserver_cpu_seconds": round(ps_cpu, 3),
            "postgres_mb_per_s": round(wal_bytes / 1e6 / pg_elapsed, 1),
            "pageserver_mb_per_s": round(wal_bytes / 1e6 / ps_elapsed, 1),
            "ratio": round(pg_elapsed / ps_elapsed, 2),
        }
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if ps is not None and ps.running:
            ps.stop()
        primary.stop()
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
