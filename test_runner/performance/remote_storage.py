#!/usr/bin/env python3
"""What remote storage costs: upload throughput against ingest throughput, and the time a node
with an empty disk takes to attach a tenant and serve its first page.

Not a test (pytest collects only test_*.py): the measurement behind docs/performance.md,
"Remote storage".

    cargo build --release --bins
    python3 test_runner/performance/remote_storage.py --bin-dir target/release [--gib 1] \\
        [--repeat 3] [--out FILE.json]

A versitygw S3 server (test_runner/fixtures/s3.py; `scripts/test` installs it) on loopback, its
bucket on the same disk. Per repeat:

1. **ingest and upload**: a fresh daemon with `remote_storage` (and `checkpoint_timeout = 1 s`)
   ingests `--gib` GiB with `pagebench ingest` (16 relations, images and 2 records per page);
   the script samples the tenant's `last_durable_lsn` and `remote.remote_consistent_lsn` every
   50 ms. Ingest throughput: bytes on disk over the ingest's wall time; upload throughput: bytes
   uploaded (`pageserver_remote_uploaded_bytes_total`) over the time from the start of the
   ingest until the bucket's index covers the last durable LSN; `lag_s`: how long after the
   ingest ended that took;
2. **attach**: a second fresh daemon attaches the tenant (`POST .../attach`, timed) and answers
   one GetPage (timed from the attach's start).

Run it with nothing else on the machine. It prints a table and writes everything as JSON with
--out.

Last runs: 2026-11-29, the project's 2-vCPU VM, the commit after `932f263`: at 1 GiB, ingest 209
MiB/s, uploads 166 MiB/s, the index covering the last LSN 1.07 s after the ingest ended (the
1 s seal timer and the last layer), attach 1.17 s; at 4 GiB, 163 and 156 MiB/s, 1.09 s, attach
6.39 s (every layer downloaded: docs/performance.md, "Remote storage";
results/2026-11-29-remote-storage.json).
"""

from __future__ import annotations

import argparse
import json
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


def one_round(bin_dir: Path, s3: S3Server, gib: float, prefix: str) -> dict:
    config = [s3.remote_storage_setting(prefix), "checkpoint_timeout=\"1 s\"", "compaction=\"off\""]
    blocks = int(gib * (1 << 30) / 8192 / RELATIONS)
    a = measure.Daemon(bin_dir, config, env=s3.env())
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
        on_disk = status["storage"]["disk_bytes"]
        uploaded = measure.metrics(a.http).get("pageserver_remote_uploaded_bytes_total", 0.0)
        lags = [s[1] - s[2] for s in samples]
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
    finally:
        b.stop()
    return {
        "gib": gib,
        "on_disk_bytes": on_disk,
        "uploaded_bytes": uploaded,
        "ingest_s": ingested - begun,
        "ingest_mib_s": on_disk / (ingested - begun) / (1 << 20),
        "upload_mib_s": uploaded / (caught_up - begun) / (1 << 20),
        "lag_s": caught_up - ingested,
        "max_lag_lsn": max(lags, default=0),
        "attach_s": attached - t0,
        "attach_to_first_page_s": first_page - t0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bin-dir", type=Path, required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path)
    opts = p.parse_args()
    bin_dir = opts.bin_dir.resolve()
    with tempfile.TemporaryDirectory(prefix="remote-storage-") as tmp:
        s3 = S3Server(Path(tmp) / "s3").start()
        try:
            rounds = [one_round(bin_dir, s3, opts.gib, f"r{i}") for i in range(opts.repeat)]
        finally:
            s3.stop()
    keys = ["ingest_mib_s", "upload_mib_s", "lag_s", "attach_s", "attach_to_first_page_s"]
    print(f"{'round':>5} " + " ".join(f"{k:>22}" for k in keys))
    for i, r in enumerate(rounds):
        print(f"{i:>5} " + " ".join(f"{r[k]:>22.2f}" for k in keys))
    medians = {k: statistics.median(r[k] for r in rounds) for k in keys}
    print(f"{'med':>5} " + " ".join(f"{medians[k]:>22.2f}" for k in keys))
    if opts.out:
        opts.out.write_text(json.dumps({"rounds": rounds, "medians": medians}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
