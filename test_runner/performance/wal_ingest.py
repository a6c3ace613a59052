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
  attached to the primary before the workload (its import, then caught up) and detached, which
  keeps its position where the workload began; attached again after it, it streams the
  recorded WAL as fast as it can; from that attach to its durable LSN reaching the end.

With `--bin-dirs A,B --repeat N` it compares builds on the same WAL: one daemon per build, N
tenants each (each imported before the workload with its own slot), their ingests alternated
(A, B, A, B, ...); the medians per build.

It prints, and writes as JSON with --out, the WAL bytes and records, both elapsed times and
rates, the ingest CPU per value stored next to PostgreSQL's replay CPU per record, the ratio (the issue's target: the pageserver >= 2x PostgreSQL's replay rate), and the
pageserver's CPU seconds; per ingest also the machine's busy CPU seconds (all CPUs, from
/proc/stat: the daemon's, the walsender's, the kernel's writeback), and the daemon's fsyncs,
their seconds and its batches. Both replays read WAL already in the page cache of this machine; the
pageserver's includes the replication connection (PostgreSQL's walsender reads the files).
`--perf FILE` records the first ingest with `perf record -e cpu-clock` (`--perf-call-graph dwarf` for
callers through the release build, which has no frame pointers).

Reference (2026-11-29, the 2-vCPU machine of docs/performance.md, b2b7ba9;
results/2026-11-29-wal-ingest-pipelined.json, run 5): scale 10, 20 s: 177 MB, 722k records, 812k
values; PostgreSQL replays it in 1.17 s, the pageserver ingests it in 0.883 s (median of 7, 0.97 s
of CPU, the machine busy 1.31 s): 1.33x. The target (2x) is not met; what bounds it is in
docs/performance/2026-11-29-wal-ingest-pipelined.md. Runs before
2026-11-29 timed the source's `durable_lsn`, written down once a second: they read 2.0-2.2 s
whatever the ingest took.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fixtures.daemon import Pageserver  # noqa: E402
from fixtures.postgres import Postgres  # noqa: E402
from fixtures.wal_source import attach, caught_up  # noqa: E402
from fixtures.waldump import lsn_int  # noqa: E402


def cpu_seconds(pid: int) -> float:
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def machine_seconds() -> tuple[float, float]:
    """The machine's busy and iowait CPU seconds so far, all CPUs together (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle, iowait = fields[3], fields[4]
    busy = sum(fields[:8]) - idle - iowait
    tick = os.sysconf("SC_CLK_TCK")
    return busy / tick, iowait / tick


def ingest(ps, tenant: str, source: dict, end: int, perf_file: Path | None, call_graph: str) -> dict:
    """Attaches `tenant` again (it resumes from its position, with no import) and times its
    ingest of the WAL up to `end`: seconds and the daemon's CPU seconds."""
    perf = None
    if perf_file:
        perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "2000", "--call-graph", call_graph,
                                 "-o", str(perf_file), "-p", str(ps.pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
    cpu0 = cpu_seconds(ps.pid)
    busy0, iowait0 = machine_seconds()
    m0 = ps.http.metrics()
    began = time.monotonic()
    resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/wal_source", source)
    assert resp.status == 200, resp
    # The timeline's durable LSN, which follows each settled batch: the source's `durable_lsn`
    # is written down only at its status updates (1 s apart), which quantized the time taken
    # (every run before 2026-11-29 read 2.0-2.2 s).
    while True:
        s = ps.http.tenant_status(tenant)
        if s["last_durable_lsn"] >= end:
            break
        if s["wal_source"]["state"] == "error":
            raise SystemExit(f"the receiver failed: {s['wal_source']['error']}")
        time.sleep(0.01)
    elapsed = time.monotonic() - began
    cpu = cpu_seconds(ps.pid) - cpu0
    busy, iowait = (a - b for a, b in zip(machine_seconds(), (busy0, iowait0)))
    m1 = ps.http.metrics()

    def delta(name: str) -> float:
        return (m1.value(name) or 0.0) - (m0.value(name) or 0.0)

    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
    assert ps.http.request("DELETE", f"/v1/tenant/{tenant}/wal_source").status == 200
    values = ps.http.tenant_status(tenant)["storage"]["values"]
    # What the machine's CPUs did meanwhile: the daemon's share of `busy`, the rest is the
    # primary's walsender, the kernel's writeback and whatever else runs (this script's polls).
    return {"seconds": round(elapsed, 3), "cpu_seconds": round(cpu, 3), "values": values,
            "machine_busy_cpu_seconds": round(busy, 3), "machine_iowait_seconds": round(iowait, 3),
            "cpus": os.cpu_count(), "fsyncs": int(delta("pageserver_storage_fsyncs_total")),
            "fsync_seconds": round(delta("pageserver_storage_fsync_seconds_sum"), 3),
            "batches": int(delta("pageserver_storage_ingested_batches_total"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--bin-dirs", help="builds to compare on the same WAL, comma separated (default: --bin-dir); "
                    "their ingests alternate, --repeat each")
    ap.add_argument("--repeat", type=int, default=1, help="ingests of the WAL per build (one tenant each)")
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--perf", type=Path, help="record the first build's first ingest with perf (cpu-clock) into "
                    "this file")
    ap.add_argument("--perf-call-graph", default="fp", help="perf record --call-graph: fp (default) or dwarf "
                    "(callers through code built without frame pointers, at a higher cost)")
    args = ap.parse_args()
    builds = [Path(b).resolve() for b in args.bin_dirs.split(",")] if args.bin_dirs else [args.bin_dir.resolve()]

    base = Path(tempfile.mkdtemp(prefix="wal-ingest-"))
    os.chmod(base, 0o755)
    settings = {"autovacuum": "off", "max_wal_size": "'4GB'", "checkpoint_timeout": "'1h'",
                "max_replication_slots": str(len(builds) * args.repeat + 4)}
    primary = Postgres(base / "primary", settings=settings).init().start()
    daemons = []
    try:
        # One daemon per build; per build and repeat a tenant imported from the primary before
        # the workload and caught up, then detached: it keeps its position, and its own slot the
        # WAL from there.
        tenants = []  # (build, daemon, tenant, source), in the order their ingests alternate
        for i, build in enumerate(builds):
            ps = Pageserver(build, base / f"pageserver-{i}", {"compaction": "off"}, None, None)
            ps.start()
            daemons.append(ps)
        for r in range(args.repeat):
            for i, ps in enumerate(daemons):
                slot = f"bench_{i}_{r}"
                primary.sql(f"select pg_create_physical_replication_slot('{slot}', true)")
                tenant = ps.create_tenant(f"bench{r}")
                attach(ps, tenant, primary, slot=slot)
                caught_up(ps, tenant, primary)
                assert ps.http.request("DELETE", f"/v1/tenant/{tenant}/wal_source").status == 200
                tenants.append((i, ps, tenant, {"postgres": primary.connstr(), "slot": slot}))
        # The base backup PostgreSQL replays from (its own checkpoint, before the workload; after
        # the imports, whose checkpoints would have let the primary remove the WAL this one needs).
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

        # The pageserver's ingests of the same WAL, the builds alternated.
        runs = [[] for _ in builds]
        for n, (i, ps, tenant, source) in enumerate(tenants):
            run = ingest(ps, tenant, source, lsn_int(end), args.perf if n == 0 else None, args.perf_call_graph)
            print(f"build {i}: {run}", flush=True)
            runs[i].append(run)

        def median(xs):
            return sorted(xs)[len(xs) // 2]

        result = {
            "date": time.strftime("%Y-%m-%d"),
            "scale": args.scale,
            "duration": args.duration,
            "wal_bytes": wal_bytes,
            "records": records,
            "postgres_replay_seconds": pg_elapsed,
            "postgres_replay_cpu_seconds": pg_cpu,
            "postgres_start_seconds": round(pg_wall, 3),
            "postgres_mb_per_s": round(wal_bytes / 1e6 / pg_elapsed, 1),
            "builds": [],
        }
        for i, build_runs in enumerate(runs):
            seconds = median([r["seconds"] for r in build_runs])
            cpu = median([r["cpu_seconds"] for r in build_runs])
            values = build_runs[0]["values"]
            result["builds"].append({
                "build": i,
                "values": values,
                "runs": build_runs,
                "pageserver_ingest_seconds": seconds,
                "pageserver_cpu_seconds": cpu,
                "pageserver_mb_per_s": round(wal_bytes / 1e6 / seconds, 1),
                # Ingest CPU per value stored, next to PostgreSQL's replay CPU per record.
                "pageserver_cpu_us_per_value": round(cpu * 1e6 / max(values, 1), 2),
                "postgres_cpu_us_per_record": round(pg_cpu * 1e6 / max(records, 1), 2),
                "ratio": round(pg_elapsed / seconds, 2),
            })
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        for ps in daemons:
            if ps.running:
                ps.stop()
        primary.stop()
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
