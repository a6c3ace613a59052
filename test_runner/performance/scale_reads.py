#!/usr/bin/env python3
"""GetPage on kept data sets of `scale.py`, builds side by side: how a read-path change does at
each size, on the same bytes.

Not a test: a benchmark behind docs/performance.md, "Storage at size".

    python3 test_runner/performance/scale.py --bin-dir <old> --sizes 1,5 --keep  # names the kept dirs
    python3 test_runner/performance/scale_reads.py --bin-dirs <old>,<new> --workdirs <dir1>,<dir5> --rounds 2

Each round, for each work dir and each build in turn (alternated, so machine noise falls on
all alike): the work dir's files are read once (so that the kernel's page cache holds them, as
it does right after `scale.py` wrote them, if memory allows; with `--cold` they are dropped
from it instead, every 0.5 s of the run, so that reads go to the disk as on a tenant larger
than the machine's memory), a daemon of that build starts on
it (`page_cache_size=0`), and `pagebench get-page` runs 8 connections at depth 1, random keys at
the latest LSN, for `--seconds`: requests/s, latency percentiles, the daemon's CPU per request,
and per request the index blocks read (block cache misses), the plans and the reads that
waited for the disk on the blocking pool, and the pages rebuilt by redo (compare data sets only
at equal redos). Prints a table of the medians per work
dir and build; `--out` writes every run as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402


def warm(workdir: Path) -> None:
    for f in sorted((workdir / "tenants").rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(1 << 20):
                    pass


def evict(workdir: Path) -> None:
    """Drops the work dir's files from the kernel's page cache (they are clean: fsync'd)."""
    for f in sorted((workdir / "tenants").rglob("*")):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def evict_until(workdir: Path, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        evict(workdir)


def one_run(bin_dir: Path, workdir: Path, seconds: float, cold: bool) -> dict:
    if not cold:
        warm(workdir)
    daemon = measure.Daemon(bin_dir, ["page_cache_size=0"], workdir=workdir)
    stop = threading.Event()
    try:
        time.sleep(1)
        if cold:
            # Every 0.5 s for the whole run, as memory pressure would on a tenant larger than
            # the machine's memory (once would not do: after pagebench's start, which asks the
            # daemon for the key space or checks the data set, every index block was in the
            # page cache again when the load began; GetPages sent without pagebench found
            # them all cold).
            threading.Thread(target=evict_until, args=(workdir, stop), daemon=True).start()
            evict(workdir)
        m0 = measure.metrics(daemon.http)
        run = measure.run_point(bin_dir, daemon, {"shape": [], "lsn": "latest"}, 8, 1, None, seconds, 1,
                                (40.0, 30.0))
        m1 = measure.metrics(daemon.http)
    finally:
        stop.set()
        daemon.stop(keep=True)
    s = run["summary"]
    requests = max(s["requests"], 1)
    return {
        "rps": round(s["rps"]), "latency_us": s.get("latency_us"),
        "daemon_us_per_request": (run["cpu"] or {}).get("daemon_us_per_request"),
        "redos_per_request": run["per_request"]["redos"],
        "index_blocks_read_per_request": round(
            measure.delta(m1, m0, "pageserver_storage_index_block_cache_misses_total") / requests, 3),
        "plans_offloaded_per_request": round(
            measure.delta(m1, m0, "pageserver_storage_plans_offloaded_total") / requests, 3),
        "reads_offloaded_per_request": round(
            measure.delta(m1, m0, "pageserver_storage_reads_offloaded_total") / requests, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dirs", required=True, help="builds, comma-separated")
    ap.add_argument("--workdirs", required=True, help="kept work dirs of scale.py, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--cold", action="store_true",
                    help="drop the data from the kernel's page cache every 0.5 s of each run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bins = [Path(b).resolve() for b in args.bin_dirs.split(",")]
    dirs = [Path(d).resolve() for d in args.workdirs.split(",")]
    runs = []
    for r in range(args.rounds):
        for d in dirs:
            for b in bins:
                # Names only: results get checked in, paths of this machine do not.
                row = {"round": r, "workdir": d.name, "bin_dir": b.name, "cold": args.cold,
                       **one_run(b, d, args.seconds, args.cold)}
                print(json.dumps(row), flush=True)
                runs.append(row)
    print("| data set | build | GetPage rps (8 x 1) | p50 us | p99 us | daemon CPU us/request | index blocks read/request | plans offloaded/request | reads offloaded/request | redos/request |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d in dirs:
        for b in bins:
            mine = [x for x in runs if x["workdir"] == d.name and x["bin_dir"] == b.name]

            def med(f):
                vals = [v for v in (f(x) for x in mine) if v is not None]
                return statistics.median(vals) if vals else None

            print(f"| {d.name} | {b.name} | {med(lambda x: x['rps']):.0f} | "
                  f"{med(lambda x: (x['latency_us'] or {}).get('p50'))} | "
                  f"{med(lambda x: (x['latency_us'] or {}).get('p99'))} | "
                  f"{med(lambda x: x['daemon_us_per_request'])} | {med(lambda x: x['index_blocks_read_per_request'])} | "
                  f"{med(lambda x: x.get('plans_offloaded_per_request'))} | "
                  f"{med(lambda x: x.get('reads_offloaded_per_request'))} | "
                  f"{med(lambda x: x.get('redos_per_request'))} |")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
