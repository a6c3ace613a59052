#!/usr/bin/env python3
"""GetPage of a real PostgreSQL 15 database against the synthetic chain10 data set, in one run.

Not a test: the benchmark behind docs/performance.md, "GetPage of real pages".

    cargo build --release --bins
    python3 test_runner/performance/pg_getpage.py --bin-dir target/release --scale 10 --duration 20

A PostgreSQL 15 primary runs `pgbench -i -s SCALE`; a daemon (release build,
`page_cache_size=0`, so that every GetPage is rebuilt) has a tenant `bench` attached to it
(the base backup import), which then streams the WAL of `pgbench -c 4 -T DURATION` and
catches up; a second daemon has the
synthetic chain10 data set of `measure.py` (10 relations x 1000 pages, an image and 10
records each; `compaction=off`, so that it stays so) as its tenant `bench`. Then `pagebench get-page` runs each point (connections x
depth, at the latest LSN, keys uniform over each tenant's pages) on the two daemons in turn,
--repeat times, with measure.py's sampling: requests/s, latency, and CPU per request of the
daemon and of its redo children. The real tenant's chains are what the workload left (a page
of pgbench_accounts holds an image from the import or a full-page write and the records
after it) once a compaction pass (asked for after the catch-up, as the daemon would run it)
made images where chains are long; `--config` adds daemon settings to both.

Prints a table and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402
from fixtures.http_client import HttpClient  # noqa: E402
from fixtures.postgres import Postgres  # noqa: E402


def lsn_int(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--duration", type=int, default=20, help="seconds of the pgbench run on the primary")
    ap.add_argument("--points", default="1x1,8x1,64x8")
    ap.add_argument("--seconds", type=float, default=10.0, help="of each pagebench run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="pagebench's runtime threads")
    ap.add_argument("--config", action="append", default=[], help="extra daemon setting k=v (both daemons)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.bin_dir = args.bin_dir.resolve()
    config = ["page_cache_size=0", *args.config]
    points = [measure.parse_point(p) for p in args.points.split(",")]

    base = Path(tempfile.mkdtemp(prefix="pg-getpage-"))
    base.chmod(0o755)
    primary = Postgres(base / "primary", settings={"autovacuum": "off", "max_wal_size": "'4GB'"}).init().start()
    daemons = []
    try:
        print(f"workload: pgbench -i -s {args.scale}, then -c 4 -T {args.duration} streamed", flush=True)
        primary.pgbench("-i", "-s", str(args.scale), "-q", timeout=900)
        real = measure.Daemon(args.bin_dir, config)
        daemons.append(real)
        host, port = real.http.rsplit(":", 1)
        http = HttpClient((host, int(port)), timeout=600)
        http.create_tenant("bench")
        began = time.monotonic()
        resp = http.request("PUT", "/v1/tenant/bench/wal_source", {"postgres": primary.connstr(), "slot": "bench"})
        assert resp.status == 200, resp
        # The run's WAL is streamed into the tenant: its pages are the import's images or
        # full-page writes with the records after them.
        primary.pgbench("-c", "4", "-j", "2", "-T", str(args.duration), "-n", timeout=900)
        # The insert position: with synchronous_commit off the flush position lags the commits.
        end = lsn_int(primary.sql("select pg_current_wal_insert_lsn()"))
        while True:
            w = http.tenant_status("bench")["wal_source"]
            if w["state"] == "error":
                raise SystemExit(f"the receiver failed: {w['error']}")
            if w["import"] and w["import"]["done"] and w["durable_lsn"] >= end:
                break
            time.sleep(0.1)
        # A compaction pass now (the daemon would run it soon anyway): hot pages get images,
        # so that chains are what the product serves, not what 20 s of updates stacked up.
        r = http.request("POST", "/v1/tenant/bench/compact")
        assert r.status == 200, r
        status = http.tenant_status("bench")
        print(f"tenant bench: imported, streamed and caught up in {time.monotonic() - began:.1f} s; "
              f"{status['storage']['keys']} keys, {status['storage']['values']} values", flush=True)
        # chain10 stays chains of 10: no compaction pass may turn them into images.
        synthetic = measure.Daemon(args.bin_dir, [*config, "compaction=off"])
        daemons.append(synthetic)
        shape = measure.SCENARIOS["chain10"]["shape"]
        measure.finish(measure.pagebench(args.bin_dir, synthetic, ["ingest", *measure.TENANT_ARGS, *shape]), 900)

        scenario = {"shape": [], "lsn": "latest"}
        quiet = (40.0, 30.0)
        rows = []
        for conns, depth, rate in points:
            runs = {"real": [], "chain10": []}
            for _ in range(args.repeat):
                for name, daemon in (("real", real), ("chain10", synthetic)):
                    runs[name].append(measure.run_point(args.bin_dir, daemon, scenario, conns, depth, rate,
                                                        args.seconds, args.threads, quiet))
            row = {"point": measure.point_label(conns, depth, rate)}
            for name, rs in runs.items():
                best = sorted(rs, key=lambda r: r["summary"]["rps"])[len(rs) // 2]
                row[name] = {
                    "rps": round(best["summary"]["rps"]),
                    "p50_us": best["summary"].get("latency_us", {}).get("p50"),
                    "p99_us": best["summary"].get("latency_us", {}).get("p99"),
                    "daemon_us_per_request": (best["cpu"] or {}).get("daemon_us_per_request"),
                    "cpu_us_per_request": (best["cpu"] or {}).get("cpu_us_per_request"),
                    "redo_us_mean": best["per_request"]["redo_us_mean"],
                    "all_rps": [round(r["summary"]["rps"]) for r in rs],
                }
            row["ratio"] = round(row["real"]["rps"] / max(row["chain10"]["rps"], 1), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "scale": args.scale,
            "duration": args.duration,
            "config": config,
            "tenant": {"keys": status["storage"]["keys"], "values": status["storage"]["values"]},
            "rows": rows,
            "median_ratio": statistics.median(r["ratio"] for r in rows),
        }
        print("| point | real rps | chain10 rps | real / chain10 | real CPU us/req (daemon) | chain10 CPU us/req (daemon) |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['point']} | {r['real']['rps']} | {r['chain10']['rps']} | {r['ratio']} | "
                  f"{r['real']['cpu_us_per_request']} ({r['real']['daemon_us_per_request']}) | "
                  f"{r['chain10']['cpu_us_per_request']} ({r['chain10']['daemon_us_per_request']}) |")
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        for d in daemons:
            d.stop()
        primary.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
