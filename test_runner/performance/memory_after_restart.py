#!/usr/bin/env python3
"""What one tenant costs in memory once the daemon restarts: issue 50, item 2 (one tenant of
200,000 pages x chain 10, 2.2M values, compaction off, no page cache; target RSS <= 96 MiB after
a clean restart).

Not a test (pytest collects only test_*.py): the measurement behind docs/performance.md.

    cargo build --release --bins
    python3 test_runner/performance/memory_after_restart.py --bin-dirs <old build>,target/release \\
        [--blocks 200000] [--chain 10] [--out FILE.json]

For each build, in turn: a fresh daemon (`compaction=off`, `page_cache_size=0`) loads the tenant
with `pagebench ingest` (1 relation, `--blocks` pages, an image and `--chain` records each), then
is stopped (SIGTERM) and started again on the same directory; 2 s later the script reads its RSS
(`VmRSS`), the heap jemalloc reports (`pageserver_heap_in_use_bytes`, `_free_bytes`) and the
tenant's storage status (layers, runs). RSS right after the ingest is reported too.

Last run: 2026-11-29, the project's 2-vCPU VM: `b43e2f3` 193 MiB after the restart (heap in use
137 MB: the active segment's index, a million small records), the commit after `d41b1dc` (the
active segment sealed at 262,144 values too) 14 MiB (docs/performance.md, "Memory";
results/2026-11-29-memory-after-restart.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402

CONFIG = ["compaction=off", "page_cache_size=0"]


def rss_kib(pid: int) -> int:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])


def one(bin_dir: Path, blocks: int, chain: int) -> dict:
    d = measure.Daemon(bin_dir, CONFIG)
    workdir = d.workdir
    try:
        measure.finish(measure.pagebench(bin_dir, d, ["ingest", "--tenant", "bench", "--relations", "1",
                                                      "--blocks", str(blocks), "--chain-length", str(chain)]), 900)
        after_ingest = rss_kib(d.pid)
    finally:
        d.stop(keep=True)
    d = measure.Daemon(bin_dir, CONFIG, workdir=workdir)
    try:
        time.sleep(2)
        rss = rss_kib(d.pid)
        with urllib.request.urlopen(f"http://{d.http}/v1/tenant/bench", timeout=10) as resp:
            storage = json.loads(resp.read())["storage"]
        m = measure.metrics(d.http)
    finally:
        d.stop()
    return {
        "build": bin_dir.name,
        "rss_after_ingest_mib": round(after_ingest / 1024, 1),
        "rss_after_restart_mib": round(rss / 1024, 1),
        "heap_in_use_mb": round(m.get("pageserver_heap_in_use_bytes", 0) / 1e6, 1),
        "heap_free_mb": round(m.get("pageserver_heap_free_bytes", 0) / 1e6, 1),
        "values": storage["values"],
        "layers": storage["layers"],
        "runs": storage["runs"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dirs", required=True, help="comma-separated build directories, measured in turn")
    p.add_argument("--blocks", type=int, default=200_000)
    p.add_argument("--chain", type=int, default=10)
    p.add_argument("--out", type=Path)
    opts = p.parse_args()
    results = [one(Path(b).resolve(), opts.blocks, opts.chain) for b in opts.bin_dirs.split(",")]
    for r in results:
        print(json.dumps(r))
    if opts.out:
        opts.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
