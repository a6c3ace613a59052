#!/usr/bin/env python3
"""Two builds side by side on the same real PostgreSQL 15 tenant: GetPage at the latest LSN
with the page cache on (the cached path, where a per-request check costs the most), CPU per
request of each build's daemon, alternated --repeat times, medians and their ratio.

Not a test: the measurement behind docs/performance.md, "The drop check of a PostgreSQL
tenant's GetPage" (a build before a change, `--bin-dir A`, and one after, `--bin-dir B`).

    python3 test_runner/performance/pg_getpage_ab.py --bin-dir old/release --bin-dir new/release

A primary runs `pgbench -i -s SCALE` (the working set fits the default page cache of 128 MiB)
and then `pgbench -c 2 -T 5`; each build's daemon has a tenant `bench` attached to it (a slot
each), caught up and compacted. Then `pagebench get-page` runs each point on the two daemons in
turn, with measure.py's sampling. Prints a JSON line per point and writes JSON with --out.
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
from pg_getpage import lsn_int  # noqa: E402


def attach(daemon, primary: Postgres, slot: str) -> HttpClient:
    host, port = daemon.http.rsplit(":", 1)
    http = HttpClient((host, int(port)), timeout=600)
    http.create_tenant("bench")
    resp = http.request("PUT", "/v1/tenant/bench/wal_source", {"postgres": primary.connstr(), "slot": slot})
    assert resp.status == 200, resp
    return http


def caught_up(http: HttpClient, end: int) -> None:
    while True:
        w = http.tenant_status("bench")["wal_source"]
        if w["state"] == "error":
            raise SystemExit(f"the receiver failed: {w['error']}")
        if w["import"] and w["import"]["done"] and w["durable_lsn"] >= end:
            return
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", type=Path, action="append", required=True, help="twice: A, then B")
    ap.add_argument("--scale", type=int, default=3)
    ap.add_argument("--points", default="1x1,8x1")
    ap.add_argument("--seconds", type=float, default=8.0, help="of each pagebench run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if len(args.bin_dir) != 2:
        ap.error("give --bin-dir twice")
    bins = [b.resolve() for b in args.bin_dir]
    points = [measure.parse_point(p) for p in args.points.split(",")]
    base = Path(tempfile.mkdtemp(prefix="pg-getpage-ab-"))
    base.chmod(0o755)
    primary = Postgres(base / "primary", settings={"autovacuum": "off"}).init().start()
    daemons = []
    try:
        primary.pgbench("-i", "-s", str(args.scale), "-q", timeout=900)
        https = []
        for i, bin_dir in enumerate(bins):
            daemons.append(measure.Daemon(bin_dir, []))
            https.append(attach(daemons[-1], primary, f"bench{i}"))
        primary.pgbench("-c", "2", "-j", "2", "-T", "5", "-n", timeout=900)
        end = lsn_int(primary.sql("select pg_current_wal_insert_lsn()"))
        for http in https:
            caught_up(http, end)
            r = http.request("POST", "/v1/tenant/bench/compact")
            assert r.status == 200, r
        scenario = {"shape": [], "lsn": "latest"}
        rows = []
        for conns, depth, rate in points:
            runs: list[list[dict]] = [[], []]
            for _ in range(args.repeat):
                for i, daemon in enumerate(daemons):
                    runs[i].append(measure.run_point(bins[i], daemon, scenario, conns, depth, rate,
                                                     args.seconds, 1, (40.0, 30.0)))
            row = {"point": measure.point_label(conns, depth, rate)}
            for name, rs in zip("AB", runs):
                per = [r["cpu"]["daemon_us_per_request"] for r in rs if r["cpu"]]
                row[name] = {"daemon_us_per_request": statistics.median(per), "all": per,
                             "rps": [round(r["summary"]["rps"]) for r in rs],
                             "cache_hit_ratio": [r["per_request"]["cache_hit_ratio"] for r in rs]}
            row["B_over_A"] = round(row["B"]["daemon_us_per_request"] / row["A"]["daemon_us_per_request"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.out:
            args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "scale": args.scale,
                                            "bins": [str(b) for b in args.bin_dir], "rows": rows}, indent=1) + "\n")
    finally:
        for d in daemons:
            d.stop()
        primary.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
