#!/usr/bin/env python3
"""How the daemon's memory, restart and reads follow a tenant's size (issue 22's targets).

Not a test: the benchmark behind docs/performance.md, "Storage at size".

    cargo build --release --bins
    python3 test_runner/performance/scale.py --bin-dir target/release --sizes 1,5,20 --out scale.json

For each size (GB of ingested data) a fresh daemon (release build, default settings but
`page_cache_size=0` for the reads, and any `--config`) gets one tenant loaded with `pagebench ingest` (relations of
10,000 pages, an image and `--chain-length` records each, as many relations as the size asks),
then:

- one compaction pass (`POST .../compact`, waited for): its bytes written over the bytes
  ingested (the write amplification of a pass over a freshly loaded tenant), and the disk
  used against the data ingested;
- the daemon's RSS, right after the pass and 12 s later (settled: the allocator hands
  freed pages back 10 s after they were freed), then a restart (SIGTERM, start): the time from the start
  to the first GetPage served, and the RSS after it (and again after the reads below: the
  block cache filled);
- `pagebench get-page`, 8 connections at depth 1, random keys at the latest LSN, `--seconds`:
  requests/s, latency percentiles, the daemon's CPU per request, and per request the reads that
  waited for the disk and the index blocks read (block cache misses); then a restart with the
  default page cache and the same reads again: their rate and the RSS after them, and 12 s
  later (issue 22's memory target is for the default settings); the heap in use and free
  after the first reads.

- with `--update-seconds S`: the update load, after the reads: records (48 bytes written into
  the page) on random pages of the first `--update-relations` relations (the working set), in
  batches of 200, at `--update-rate` records/s for S seconds, with the daemon's automatic
  compaction; then, once the compactor has caught up, the bytes compaction wrote over the bytes
  ingested in that window (its write amplification), the passes by kind, the disk used
  against all the data ingested, and the chains a GetPage of the working set then redoes
  (`chain_lengths`: records per redo request, p50 and p99).

Prints one JSON line per size, a table, and writes JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402
from fixtures.http_client import HttpClient  # noqa: E402
from fixtures import oracle as o  # noqa: E402
from fixtures.oracle import Key  # noqa: E402
from fixtures.page_client import connect  # noqa: E402

BLOCKS = 10_000
SETTLE_S = 12  # seconds after the pass before the RSS is sampled again (rss_settled_bytes)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def one_size(args, gb: float) -> dict:
    per_relation = BLOCKS * (8192 + args.chain_length * 100)
    relations = max(1, round(gb * 1e9 / per_relation))
    shape = ["--relations", str(relations), "--blocks", str(BLOCKS), "--chain-length", str(args.chain_length)]
    daemon = measure.Daemon(args.bin_dir, ["page_cache_size=0", *args.config])
    try:
        began = time.monotonic()
        measure.finish(measure.pagebench(args.bin_dir, daemon, ["ingest", *measure.TENANT_ARGS, *shape]), 7200)
        ingest_s = time.monotonic() - began
        http = HttpClient(addr(daemon.http), timeout=7200)
        m0 = measure.metrics(daemon.http)
        began = time.monotonic()
        r = http.request("POST", "/v1/tenant/bench/compact")
        assert r.status == 200, r
        compact_s = time.monotonic() - began
        m1 = measure.metrics(daemon.http)
        ingested = m1.get("pageserver_storage_ingested_bytes_total", 0.0)
        written = measure.delta(m1, m0, "pageserver_compaction_written_bytes_total")
        disk = du(daemon.workdir / "tenants")
        rss_loaded = rss_bytes(daemon.pid)
        # What the allocator keeps right after the pass is handed back within seconds (jemalloc's
        # background thread purges pages 10 s after they were freed, heap.rs).
        time.sleep(SETTLE_S)
        rss_settled = rss_bytes(daemon.pid)

        restart_s = restart(daemon)
        time.sleep(1)
        rss_restarted = rss_bytes(daemon.pid)

        r0 = measure.metrics(daemon.http)
        run = reads(args, daemon)
        r1 = measure.metrics(daemon.http)
        s = run["summary"]
        requests = max(s["requests"], 1)
        rss_read = rss_bytes(daemon.pid)
        heap_read = heap(daemon)
        # The same reads with the default page cache: the RSS the target is about.
        at = daemon.args.index("page_cache_size=0")
        restart(daemon, daemon.args[:at - 1] + daemon.args[at + 1:])  # without its "-c" too
        cached = reads(args, daemon)
        rss_cached = rss_bytes(daemon.pid)
        # ... and once the server had its chance to hand the freed heap back (every 10 s).
        time.sleep(SETTLE_S)
        rss_cached_settled = rss_bytes(daemon.pid)
        update = update_load(args, daemon, ingested, disk) if args.update_seconds else None
        return {
            "size_gb": gb, "relations": relations, "ingested_bytes": int(ingested),
            "ingest_seconds": round(ingest_s, 1), "compact_seconds": round(compact_s, 1),
            "compaction_write_amplification": round(written / max(ingested, 1), 2),
            "disk_bytes": disk, "disk_over_ingested": round(disk / max(ingested, 1), 2),
            "rss_loaded_bytes": rss_loaded, "rss_settled_bytes": rss_settled,
            "rss_restarted_bytes": rss_restarted, "rss_after_reads_bytes": rss_read,
            "heap_after_reads": heap_read,
            "rss_after_reads_default_page_cache_bytes": rss_cached,
            "rss_settled_after_reads_default_page_cache_bytes": rss_cached_settled,
            "get_page_rps_default_page_cache": round(cached["summary"]["rps"]),
            "restart_to_first_page_seconds": round(restart_s, 3),
            "get_page_rps": round(s["rps"]), "latency_us": s.get("latency_us"),
            "daemon_us_per_request": (run["cpu"] or {}).get("daemon_us_per_request"),
            # Pages rebuilt by redo per GetPage: 0 when every page's newest value is an image.
            # Which pages have records above their newest image depends on when the automatic
            # passes ran during the load, so compare rates only at equal redos.
            "redos_per_request": run["per_request"]["redos"],
            # Plans that had to wait for the disk (the data set beyond the kernel's page cache),
            # and index blocks read (beyond the block cache), per GetPage.
            "reads_offloaded_per_request": round(
                measure.delta(r1, r0, "pageserver_storage_reads_offloaded_total") / requests, 3),
            # Plans made on the blocking pool: an index block they needed was not in the
            # kernel's page cache.
            "plans_offloaded_per_request": round(
                measure.delta(r1, r0, "pageserver_storage_plans_offloaded_total") / requests, 3),
            "index_blocks_read_per_request": round(
                measure.delta(r1, r0, "pageserver_storage_index_block_cache_misses_total") / requests, 3),
            "update": update,
        }
    finally:
        daemon.stop(keep=args.keep)
        if args.keep:
            print(f"kept the {gb} GB work dir: {daemon.workdir}", file=sys.stderr, flush=True)


def restart(daemon, args: list[str] | None = None) -> float:
    """Stops the daemon (SIGTERM) and starts it again (with `args` if given): seconds from the
    start to the first page served."""
    daemon.proc.terminate()
    daemon.proc.wait(timeout=120)
    daemon.log.close()
    daemon.args = args or daemon.args
    began = time.monotonic()
    (daemon.workdir / "ports.json").unlink(missing_ok=True)
    daemon.log = open(daemon.workdir / "pageserver.log", "ab")
    daemon.proc = subprocess.Popen(daemon.args, stdout=daemon.log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    while True:
        try:
            p = json.loads((daemon.workdir / "ports.json").read_text())
            daemon.pg, daemon.http = p["pg"], p["http"]
            with connect(addr(daemon.pg), "bench", timeout=60) as conn:
                conn.get_page(Key(1663, 1, 16384, 0, 0))  # the data set's first page
            break
        except Exception:  # not up yet
            if daemon.proc.poll() is not None:
                raise RuntimeError(f"daemon exited at restart, see {daemon.workdir}/pageserver.log")
            if time.monotonic() - began > 600:
                raise
            time.sleep(0.01)
    return time.monotonic() - began


def heap(daemon) -> dict:
    """The daemon's heap in use and free in the allocator's arenas (bytes; absent before the
    build that exports them)."""
    m = measure.metrics(daemon.http)
    return {"in_use": m.get("pageserver_heap_in_use_bytes"), "free": m.get("pageserver_heap_free_bytes")}


def reads(args, daemon) -> dict:
    """`pagebench get-page` at 8 x 1 on random keys at the latest LSN for `--seconds`."""
    return measure.run_point(args.bin_dir, daemon, {"shape": [], "lsn": "latest"}, 8, 1, None,
                             args.seconds, 1, (40.0, 30.0))


def median_over(values: list[int], reference: int) -> float | None:
    """The median of `values` over `reference` (None without values)."""
    if not values:
        return None
    return round(sorted(values)[len(values) // 2] / max(reference, 1), 2)


def update_load(args, daemon, loaded: float, compacted: int) -> dict:
    """The update load (see the module doc): its ingest, what compaction wrote, the disk
    against `loaded` (the bytes ingested before it) and its own ingest, and against
    `compacted` (the disk right after the operator's pass: about the live data and the GC
    window, when the window is short), sampled every 5 s."""
    http = HttpClient(addr(daemon.http), timeout=600)
    before = http.tenant_status("bench")["compaction"]
    lsn = http.tenant_status("bench")["last_durable_lsn"]
    m0 = measure.metrics(daemon.http)
    rng = random.Random(22)
    batch = 200
    began = time.monotonic()
    sent = 0
    samples = []  # (seconds since the load began, disk bytes)

    def sample():
        """Samples the disk if the last sample is 5 s old (or there is none)."""
        if not samples or time.monotonic() - began - samples[-1][0] >= 5:
            samples.append((round(time.monotonic() - began, 1), du(daemon.workdir / "tenants")))

    with connect(addr(daemon.pg), "bench", timeout=60) as conn:
        while time.monotonic() - began < args.update_seconds:
            values = []
            for _ in range(batch):
                lsn += 1
                key = Key(1663, 1, 16384 + rng.randrange(args.update_relations), 0, rng.randrange(BLOCKS))
                values.append((key, lsn, o.RECORD, o.put_bytes(4096 + rng.randrange(2048), rng.randbytes(48))))
            conn.ingest(values)
            sent += batch
            sample()
            # Steady rate: sleep off what is ahead of schedule.
            ahead = sent / args.update_rate - (time.monotonic() - began)
            if ahead > 0:
                time.sleep(ahead)
    load_s = time.monotonic() - began
    # The compactor catches up with what the load left due.
    while True:
        c = http.tenant_status("bench")["compaction"]
        if (not c["running"] and c["backlog"] < 1.0) or time.monotonic() - began > args.update_seconds + 600:
            break
        sample()
        time.sleep(0.5)
    m1 = measure.metrics(daemon.http)
    after = http.tenant_status("bench")["compaction"]
    chains = chain_lengths(args, daemon)
    ingested = measure.delta(m1, m0, "pageserver_storage_ingested_bytes_total")
    written = measure.delta(m1, m0, "pageserver_compaction_written_bytes_total")
    disk = du(daemon.workdir / "tenants")
    return {
        "seconds": round(load_s, 1), "records": sent, "rate": args.update_rate,
        "working_set_relations": args.update_relations, "ingested_bytes": int(ingested),
        "compaction_written_bytes": int(written),
        "write_amplification": round(written / max(ingested, 1), 2),
        "passes": after["passes"] - before["passes"],
        # GC passes of one layer (absent before the build that has them), and of those the ones
        # that found too little to collect.
        "gc_passes": after.get("gc_passes", 0) - before.get("gc_passes", 0),
        "gc_passes_skipped": after.get("gc_passes_skipped", 0) - before.get("gc_passes_skipped", 0),
        "full_passes": after.get("full_passes", after["passes"]) - before.get("full_passes", before["passes"]),
        "disk_bytes": disk,
        "disk_over_all_ingested": round(disk / max(loaded + ingested, 1), 2),
        "disk_after_operator_pass_bytes": compacted,
        "disk_over_compacted": round(disk / max(compacted, 1), 2),
        "disk_max_over_compacted": round(max([disk, *(b for _, b in samples)]) / max(compacted, 1), 2),
        # The second half of the load and the catch-up: the steady part.
        "disk_median_second_half_over_compacted": median_over(
            [b for t, b in samples if t >= load_s / 2], compacted),
        "disk_samples": samples,
        "chains": chains,
    }


def chain_lengths(args, daemon, pages: int = 4000) -> dict:
    """What a GetPage of the working set redoes once the load is compacted: `pages` distinct
    random pages of it read once each at the latest LSN, and the records of each redo request
    (the chain above the page's newest image) from the daemon's histogram
    (`pageserver_wal_redo_request_records`, buckets of powers of 2: the percentiles are bucket
    bounds), with the share of the reads that needed a redo."""
    m0 = measure.metrics(daemon.http)
    rng = random.Random(50)
    picked = rng.sample(range(args.update_relations * BLOCKS), pages)
    with connect(addr(daemon.pg), "bench", timeout=60) as conn:
        for n in picked:
            conn.get_page(Key(1663, 1, 16384 + n // BLOCKS, 0, n % BLOCKS))
    m1 = measure.metrics(daemon.http)
    family = "pageserver_wal_redo_request_records_bucket{"
    buckets = sorted(
        (float(re.search(r'le="([^"]+)"', name).group(1)), measure.delta(m1, m0, name))
        for name in m1 if name.startswith(family))
    redos = buckets[-1][1] if buckets else 0.0

    def percentile(q: float):
        for le, count in buckets:
            if count >= q * redos:
                return le
        return None

    return {
        "pages": pages, "redo_share": round(redos / pages, 3),
        "records_p50_at_most": percentile(0.5), "records_p99_at_most": percentile(0.99),
        "records_per_redo": round(measure.delta(m1, m0, "pageserver_wal_redo_request_records_sum")
                                  / max(redos, 1), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", type=Path, required=True)
    ap.add_argument("--sizes", default="1", help="GB, comma-separated")
    ap.add_argument("--chain-length", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=10.0, help="of the GetPage run")
    ap.add_argument("--keep", action="store_true", help="keep the daemons' work dirs (for scale_reads.py)")
    ap.add_argument("--update-seconds", type=float, default=0.0, help="of the update load (0: none)")
    ap.add_argument("--update-relations", type=int, default=2, help="the update load's working set")
    ap.add_argument("--update-rate", type=int, default=20000, help="records/s of the update load")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                    help="a daemon setting besides page_cache_size=0 (repeatable)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.bin_dir = args.bin_dir.resolve()
    rows = []
    for gb in (float(x) for x in args.sizes.split(",")):
        row = one_size(args, gb)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| size | ingested | RSS loaded / settled / restarted / after reads / with the page cache | restart to a page | GetPage rps (8x1) | p99 us | redos/GetPage | compaction WA | disk / ingested |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lat = r["latency_us"] or {}
        print(f"| {r['size_gb']} GB | {r['ingested_bytes'] / 1e9:.2f} GB | {r['rss_loaded_bytes'] >> 20} / "
              f"{r['rss_settled_bytes'] >> 20} / {r['rss_restarted_bytes'] >> 20} / {r['rss_after_reads_bytes'] >> 20} / "
              f"{r['rss_after_reads_default_page_cache_bytes'] >> 20} MiB | {r['restart_to_first_page_seconds']} s | {r['get_page_rps']} | "
              f"{lat.get('p99')} | {r['redos_per_request']} | {r['compaction_write_amplification']}x | {r['disk_over_ingested']}x |")
    updates = [r for r in rows if r["update"]]
    if updates:
        print("| size | update load | ingested | compaction wrote | WA | passes (full, GC skipped/GC) | "
              "disk / all ingested | disk / after the pass: end, max, steady median |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in updates:
            u = r["update"]
            print(f"| {r['size_gb']} GB | {u['seconds']} s x {u['rate']}/s | {u['ingested_bytes'] / 1e9:.2f} GB | "
                  f"{u['compaction_written_bytes'] / 1e9:.2f} GB | {u['write_amplification']}x | "
                  f"{u['passes']} ({u['full_passes']}, {u['gc_passes_skipped']}/{u['gc_passes']}) | "
                  f"{u['disk_over_all_ingested']}x | {u['disk_over_compacted']}x, {u['disk_max_over_compacted']}x, "
                  f"{u['disk_median_second_half_over_compacted']}x |")
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
