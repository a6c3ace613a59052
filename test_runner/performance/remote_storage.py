#!/usr/bin/env python3
"""What remote storage costs: upload throughput against ingest throughput, the time a node
with an empty disk takes to attach a tenant and serve its first page, and GetPage of a page whose
layer must be downloaded, against the same page once resident and on a node that never evicted.

Not a test (pytest collects only test_*.py): the measurement behind docs/performance.md,
"Remote storage".

    cargo build --release --bins
    python3 test_runner/performance/remote_storage.py --bin-dir target/release [--gib 1] \\
        [--repeat 3] [--pages 200] [--max-local-disk "4 GiB"] [--out FILE.json]

A versitygw S3 server (test_runner/fixtures/s3.py; `scripts/test` installs it) on loopback, its
bucket on the same disk. Per repeat:

1. **ingest and upload**: a fresh daemon with `remote_storage` (and `checkpoint_timeout = 1 s`)
   ingests `--gib` GiB with `pagebench ingest` (16 relations, images and 2 records per page);
   the script samples the tenant's `last_durable_lsn` and `remote.remote_consistent_lsn` every
   50 ms. Ingest throughput: bytes on disk over the ingest's wall time; upload throughput: bytes
   uploaded (`pageserver_remote_uploaded_bytes_total`) over the time from the start of the
   ingest until the bucket's index covers the last durable LSN; `lag_s`: how long after the
   ingest ended that took;
   Then `--pages` random pages are read one at a time (`page_cache_size = 0` on both daemons:
   every GetPage reads its layers): **never evicted**;
2. **attach**: a second fresh daemon attaches the tenant (`POST .../attach`, timed: no layer is
   downloaded, each object is checked by a HEAD) and answers one GetPage (timed from the
   attach's start). Then the same pages, one at a time: a GetPage during which
   `pageserver_storage_layer_downloads_total` grew is **downloaded** (its layer came from the
   bucket first); the same pages again: **resident**.

`--max-local-disk` bounds the first daemon's layer files (a tenant larger than the disk can
hold twice: the bucket is on the same disk).

Run it with nothing else on the machine. It prints a table and writes everything as JSON with
--out.

Last runs: 2026-11-29, the project's 2-vCPU VM, the commit after `7a94bb4` (on-demand downloads):
at 1 GiB (median of 3), ingest 215 MiB/s, uploads 189 MiB/s, lag 0.73 s, attach 0.017 s, the first
page 0.20 s after the attach began; GetPage p50 88 ms downloaded, 0.13 ms resident, 0.14 ms never
evicted; at 20 GiB (`--max-local-disk "4 GiB"`), 194 and 193 MiB/s, attach 0.20 s, first page
0.67 s, GetPage p50 126 ms downloaded (docs/performance.md, "Remote storage";
results/2026-11-29-remote-storage-on-demand.json). Before: attach 1.17 s at 1 GiB, 6.39 s at 4 GiB
with every layer downloaded (results/2026-11-29-remote-storage.json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measure  # noqa: E402
from fixtures.http_client import HttpClient  # noqa: E402
from fixtures.oracle import Key  # noqa: E402
from fixtures.page_client import PageConnection  # noqa: E402
from fixtures.s3 import S3Server  # noqa: E402

RELATIONS = 16
CHAIN = 2


def addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def read_pages(pg: str, http: str, pages: list[Key], downloads: bool = False) -> list[tuple[float, bool]]:
    """GetPage of each page, one at a time: its latency in ms, and (with `downloads`) whether a
    layer was downloaded meanwhile."""
    out = []
    counter = "pageserver_storage_layer_downloads_total"
    with PageConnection(addr(pg)) as conn:
        conn.hello("t1")
        for key in pages:
            before = measure.metrics(http).get(counter, 0.0) if downloads else 0.0
            t0 = time.perf_counter()
            conn.get_page(key)
            ms = (time.perf_counter() - t0) * 1000
            out.append((ms, downloads and measure.metrics(http).get(counter, 0.0) > before))
    return out


def percentiles(ms: list[float]) -> dict:
    if not ms:
        return {"n": 0}
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p99_ms": q[98], "max_ms": max(ms)}


def one_round(bin_dir: Path, s3: S3Server, gib: float, prefix: str, n_pages: int,
              max_local_disk: str | None) -> dict:
    config = [s3.remote_storage_setting(prefix), "checkpoint_timeout=\"1 s\"", "compaction=\"off\"",
              "page_cache_size=0"]
    blocks = int(gib * (1 << 30) / 8192 / RELATIONS)
    rng = random.Random(prefix)
    pages = [Key(1663, 1, 16384 + rng.randrange(RELATIONS), 0, rng.randrange(blocks)) for _ in range(n_pages)]
    bound = [f'max_local_disk="{max_local_disk}"'] if max_local_disk else []
    a = measure.Daemon(bin_dir, config + bound, env=s3.env())
    samples: list[tuple[float, int, int]] = []
    try:
        http = HttpClient(addr(a.http))
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                try:  # pagebench creates the tenant
                    s = http.tenant_status("t1")
                    samples.append((time.monotonic(), s["last_durable_lsn"], s["remote"]["remote_consistent_lsn"]))
                except Exception:
                    pass
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        begun = time.monotonic()
        sampler.start()
        subprocess.run([str(bin_dir / "pagebench"), "ingest", "--tenant", "t1", "--relations", str(RELATIONS),
                        "--blocks", str(blocks), "--chain-length", str(CHAIN), "--page-service", a.pg,
                        "--http", a.http], check=True, stdout=subprocess.DEVNULL)
        ingested = time.monotonic()
        last = http.tenant_status("t1")["last_durable_lsn"]
        while http.tenant_status("t1")["remote"]["remote_consistent_lsn"] < last:
            time.sleep(0.05)
        caught_up = time.monotonic()
        stop.set()
        sampler.join()
        status = http.tenant_status("t1")
        layer_bytes = sum(layer["size"] for layer in status_layers(s3, prefix))
        uploaded = measure.metrics(a.http).get("pageserver_remote_uploaded_bytes_total", 0.0)
        lags = [s[1] - s[2] for s in samples]
        never_evicted = [ms for ms, _ in read_pages(a.pg, a.http, pages)] if max_local_disk is None else []
    finally:
        a.stop()

    b = measure.Daemon(bin_dir, config, env=s3.env())
    try:
        http = HttpClient(addr(b.http), timeout=600)
        t0 = time.monotonic()
        resp = http.request("POST", "/v1/tenant/t1/attach")
        assert resp.status == 201, resp
        attached = time.monotonic()
        with PageConnection(addr(b.pg)) as conn:
            conn.hello("t1")
            conn.get_page(Key(1663, 1, 16384, 0, 0))
        first_page = time.monotonic()
        first_reads = read_pages(b.pg, b.http, pages, downloads=True)
        resident = [ms for ms, _ in read_pages(b.pg, b.http, pages)]
    finally:
        b.stop()
    return {
        "gib": gib,
        "layer_bytes": layer_bytes,
        "uploaded_bytes": uploaded,
        "ingest_s": ingested - begun,
        "ingest_mib_s": layer_bytes / (ingested - begun) / (1 << 20),
        "upload_mib_s": uploaded / (caught_up - begun) / (1 << 20),
        "lag_s": caught_up - ingested,
        "max_lag_lsn": max(lags, default=0),
        "attach_s": attached - t0,
        "attach_to_first_page_s": first_page - t0,
        "get_page_never_evicted": percentiles(never_evicted),
        "get_page_downloaded": percentiles([ms for ms, d in first_reads if d]),
        "get_page_first_read_layer_resident": percentiles([ms for ms, d in first_reads if not d]),
        "get_page_resident": percentiles(resident),
    }


def status_layers(s3: S3Server, prefix: str) -> list[dict]:
    """The layers of the newest index of tenant t1's `main` in the bucket."""
    names = [o for o in s3.list_objects(f"{prefix}/tenants/t1/timelines/main/") if "/index_part.json-" in o]
    newest = max(names, key=lambda o: o.rsplit("-", 1)[1])
    return json.loads(s3.object_path(newest).read_text())["layers"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", type=Path, required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--pages", type=int, default=200)
    p.add_argument("--max-local-disk", help="the first daemon's max_local_disk (no GetPage on it then)")
    p.add_argument("--out", type=Path)
    opts = p.parse_args()
    bin_dir = opts.bin_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="remote-storage-") as tmp:
        s3 = S3Server(Path(tmp) / "s3").start()
        try:
            rounds = [one_round(bin_dir, s3, opts.gib, f"r{i}", opts.pages, opts.max_local_disk)
                      for i in range(opts.repeat)]
        finally:
            s3.stop()
    keys = ["ingest_mib_s", "upload_mib_s", "lag_s", "attach_s", "attach_to_first_page_s"]
    print(f"{'round':>5} " + " ".join(f"{k:>22}" for k in keys))
    for i, r in enumerate(rounds):
        print(f"{i:>5} " + " ".join(f"{r[k]:>22.2f}" for k in keys))
    medians = {k: statistics.median(r[k] for r in rounds) for k in keys}
    print(f"{'med':>5} " + " ".join(f"{medians[k]:>22.2f}" for k in keys))
    print("GetPage, ms (medians over rounds):")
    for kind in ["never_evicted", "downloaded", "first_read_layer_resident", "resident"]:
        got = [r[f"get_page_{kind}"] for r in rounds if r[f"get_page_{kind}"]["n"]]
        if got:
            line = {q: statistics.median(g[q] for g in got) for q in ["p50_ms", "p99_ms", "max_ms"]}
            medians[f"get_page_{kind}"] = line
            print(f"  {kind:>26}: n={sum(g['n'] for g in got):>5} "
                  + " ".join(f"{q}={v:.2f}" for q, v in line.items()))
    if opts.out:
        opts.out.write_text(json.dumps({"rounds": rounds, "medians": medians}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
