#!/usr/bin/env python3
"""What a branch and a base backup cost: branch creation time on a small and a large tenant,
base backup throughput next to `pg_basebackup` from the primary of the same database, and the
daemon's memory while it streams a backup.

Not a test (pytest collects only test_*.py): the measurement behind docs/performance.md,
"Branches and base backups".

    cargo build --release --bin pageserver
    python3 test_runner/performance/branch_cost.py --bin-dir target/release [--scale 100] \\
        [--branches 20] [--repeat 3] [--config page_cache_size=0] [--discard] [--out FILE.json]

One PostgreSQL 15 primary (`pgbench -i -s 1` into a database `small`, `-s SCALE` into `postgres`
after it), two tenants of one daemon: `small`, which imported the primary before `postgres` was
loaded and was detached then (its history is small), and `large`, imported once it was. Then:

1. **branch creation**: `--branches` branches of each tenant's `main` at its last durable LSN,
   one after the other, alternating the tenants, each timed around its `POST` (the HTTP round
   trip on loopback included); medians;
2. **backup throughput**: `--repeat` times, alternating, the daemon's base backup of `large`
   (`GET .../timeline/main/basebackup` into a file) and `pg_basebackup -Ft -X none -c fast
   --no-manifest` from the primary into a directory, each timed around the whole transfer
   (wall clock, bytes written); medians and the ratio (ours over PostgreSQL's time);
3. **memory**: the daemon's resident set (`VmRSS`) sampled every 5 ms during each of its
   backups; its growth over the value before the backup, per backup. The backup's pages go
   through the page cache, so the first backup of a fresh daemon also fills it to
   `page_cache_size` (`--config page_cache_size=0` measures the stream alone).

Run it with nothing else on the machine. It prints a table and writes everything as JSON with
--out.

Last runs: 2026-11-28, the project's 2-vCPU VM, commit `c1ba896`, scale 100: branch creation
3-4 ms on a 44 MiB and on a 1.5 GiB tenant; our backup 0.7-0.9 of `pg_basebackup`'s time; the
stream's memory 5-23 MiB. 2026-11-29, scale 1300 (`--discard`): 2.7 ms on a 19.2 GiB tenant;
our backup 1.04 of `pg_basebackup`'s time (one sample); 63 MiB of growth, the index block
cache filling (docs/performance.md, "Branches and base backups";
results/2026-11-28-branch-cost.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402
from fixtures.http_client import HttpClient  # noqa: E402
from fixtures.postgres import Postgres  # noqa: E402
from fixtures.waldump import lsn_int  # noqa: E402


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def follow(http: HttpClient, tenant: str, primary: Postgres) -> None:
    """Attaches `tenant` to `primary` and waits until it has imported and caught up."""
    http.create_tenant(tenant)
    resp = http.request("PUT", f"/v1/tenant/{tenant}/wal_source", {"postgres": primary.connstr(), "slot": tenant})
    assert resp.status == 200, resp
    end = lsn_int(primary.sql("select pg_current_wal_insert_lsn()"))
    while True:
        w = http.tenant_status(tenant)["wal_source"]
        if w["state"] == "error":
            raise SystemExit(f"the receiver of {tenant} failed: {w['error']}")
        if w["import"] and w["import"]["done"] and w["durable_lsn"] >= end:
            return
        time.sleep(0.2)


def time_branch(http: HttpClient, tenant: str, name: str) -> float:
    began = time.perf_counter()
    resp = http.create_timeline(tenant, name)
    took = time.perf_counter() - began
    assert resp.status == 201, resp
    return took


def our_backup(daemon: measure.Daemon, tenant: str, dest: Path | None) -> dict:
    """The daemon's backup of `tenant` into `dest` (`None`: counted and dropped), with its memory
    growth sampled meanwhile."""
    before = rss_kib(daemon.pid)
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(daemon.pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.perf_counter()
    size = 0
    with urllib.request.urlopen(f"http://{daemon.http}/v1/tenant/{tenant}/timeline/main/basebackup",
                                timeout=3600) as resp:
        with (open(dest, "wb") if dest is not None else open(os.devnull, "wb")) as out:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                size += len(chunk)
    took = time.perf_counter() - began
    done.set()
    sampler.join()
    return {"seconds": took, "bytes": size, "rss_growth_kib": peak[0] - before}


def their_backup(primary: Postgres, dest: Path | None) -> dict:
    """`pg_basebackup` of `primary` into the directory `dest` (`None`: its tar to standard
    output, counted and dropped)."""
    if dest is None:
        began = time.perf_counter()
        cmd = primary._cmd("pg_basebackup", "-h", str(primary.sockdir), "-p", str(primary.port), "-U", "postgres",
                           "-D", "-", "-Ft", "-X", "none", "-c", "fast", "--no-manifest")
        size = 0
        with subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
            assert proc.stdout is not None
            while chunk := proc.stdout.read(1 << 20):
                size += len(chunk)
        assert proc.returncode == 0, proc.returncode
        return {"seconds": time.perf_counter() - began, "bytes": size}
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    if primary.user is not None:
        shutil.chown(dest, primary.user, primary.user)
    began = time.perf_counter()
    primary.run("pg_basebackup", "-h", str(primary.sockdir), "-p", str(primary.port), "-U", "postgres",
                "-D", str(dest), "-Ft", "-X", "none", "-c", "fast", "--no-manifest", timeout=3600)
    took = time.perf_counter() - began
    return {"seconds": took, "bytes": sum(f.stat().st_size for f in dest.iterdir())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--scale", type=int, default=10)
    ap.add_argument("--branches", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--config", action="append", default=[], help="extra daemon setting k=v")
    ap.add_argument("--discard", action="store_true",
                    help="count the backups' bytes and drop them, writing no file (for databases the disk "
                         "has no room to hold twice more)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.bin_dir = args.bin_dir.resolve()

    base = Path(tempfile.mkdtemp(prefix="branch-cost-"))
    base.chmod(0o755)
    primary = Postgres(base / "primary", settings={"autovacuum": "off", "max_wal_size": "'4GB'",
                                                    "checkpoint_timeout": "'1h'"}).init().start()
    daemon = None
    try:
        primary.sql("CREATE DATABASE small")
        primary.run("pgbench", "-h", str(primary.sockdir), "-p", str(primary.port), "-U", "postgres",
                    "-i", "-s", "1", "-q", "small", timeout=600)
        daemon = measure.Daemon(args.bin_dir, args.config)
        host, port = daemon.http.rsplit(":", 1)
        http = HttpClient((host, int(port)), timeout=3600)
        follow(http, "small", primary)
        # Detached: its history stays what it imported and streamed so far.
        assert http.request("DELETE", "/v1/tenant/small/wal_source").status == 200
        print(f"workload: pgbench -i -s {args.scale}", flush=True)
        primary.pgbench("-i", "-s", str(args.scale), "-q", timeout=3600)
        primary.sql("CHECKPOINT")
        began = time.monotonic()
        follow(http, "large", primary)
        follow_seconds = time.monotonic() - began
        sizes = {t: http.tenant_status(t)["storage"]["disk_bytes"] for t in ("small", "large")}
        print(f"tenants: small {sizes['small'] >> 20} MiB, large {sizes['large'] >> 20} MiB on disk "
              f"(large imported and caught up in {follow_seconds:.0f} s)", flush=True)

        creation = {"small": [], "large": []}
        for i in range(args.branches):
            for tenant in ("small", "large"):
                creation[tenant].append(time_branch(http, tenant, f"b{i}"))

        ours, theirs = [], []
        for i in range(args.repeat):
            ours.append(our_backup(daemon, "large", None if args.discard else base / "ours.tar"))
            theirs.append(their_backup(primary, None if args.discard else base / "theirs"))
            print(f"run {i}: ours {ours[-1]['seconds']:.2f} s ({ours[-1]['bytes'] >> 20} MiB), "
                  f"pg_basebackup {theirs[-1]['seconds']:.2f} s ({theirs[-1]['bytes'] >> 20} MiB)", flush=True)

        med = statistics.median
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "scale": args.scale,
            "config": args.config,
            "tenant_disk_bytes": sizes,
            "branch_creation_ms": {t: {"median": round(med(v) * 1000, 2), "max": round(max(v) * 1000, 2),
                                       "all": [round(x * 1000, 2) for x in v]} for t, v in creation.items()},
            "backup": {
                "ours_seconds": round(med(r["seconds"] for r in ours), 2),
                "ours_mib": round(med(r["bytes"] for r in ours) / (1 << 20), 1),
                "ours_mib_per_s": round(med(r["bytes"] / r["seconds"] for r in ours) / (1 << 20), 1),
                "pg_basebackup_seconds": round(med(r["seconds"] for r in theirs), 2),
                "pg_basebackup_mib": round(med(r["bytes"] for r in theirs) / (1 << 20), 1),
                "pg_basebackup_mib_per_s": round(med(r["bytes"] / r["seconds"] for r in theirs) / (1 << 20), 1),
                "time_ratio_ours_over_pg": round(med(r["seconds"] for r in ours) / med(r["seconds"] for r in theirs), 2),
                "rss_growth_mib": [round(r["rss_growth_kib"] / 1024, 1) for r in ours],
                "runs": {"ours": ours, "pg_basebackup": theirs},
            },
        }
        print(json.dumps({k: v for k, v in result.items() if k != "backup"} |
                         {"backup": {k: v for k, v in result["backup"].items() if k != "runs"}}, indent=1))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if daemon is not None:
            daemon.stop()
        primary.stop()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
