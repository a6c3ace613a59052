"""Remote storage under faults (docs/rfcs/0009-remote-storage.md, step 2), against a real S3
server (versitygw): the server stopped (SIGSTOP) for 30 s while the tenant ingests and compacts,
and kill -9 of the node at random points of its uploads and deletions; after either, a node with
an empty disk attaches the tenant and serves every page the bucket was known to hold."""

import random
import threading
import time

import pytest

from fixtures.page_client import LATEST
from fixtures.util import wait_until
from fixtures.wal_source import page_service_io  # noqa: F401 (a fixture: one writer is enough here)
from fixtures.workload import HistoryBuilder, make_keys, query_lsns, verify

pytestmark = pytest.mark.timeout(300)

REMOTE = {"layer_size": "64 KiB", "checkpoint_timeout": "300 ms"}
# A kill -9 leaves a torn tail, and restarts log their recovery.
CRASH_WARNINGS = [r"(?i)(torn|truncat|recover|replay)", r"(?i)walredo", r"(?i)redo (child|process)"]


def _remote(ps, tenant):
    return ps.http.tenant_status(tenant)["remote"]


def _requests_up_to(rs, keys, lsn, limit=10):
    return [(k, q) for k in keys for q in query_lsns(rs, k, limit=limit) if q != LATEST and q <= lsn]


def test_ingest_and_compaction_go_on_while_the_s3_server_is_stopped(pageserver_factory, s3_server):
    raw, env = [s3_server.remote_storage_setting()], s3_server.env()
    a = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    a.allowed_errors.append(r"(?i)upload|index|remote")  # the retries while it is stopped
    t = a.create_tenant()
    keys = make_keys(16)
    b = HistoryBuilder(seed=5)
    with a.connect(t) as conn:
        for _ in range(4):
            conn.ingest(b.batch(keys, 40))
    wait_until(lambda: _remote(a, t)["remote_consistent_lsn"] >= b.rs.last_lsn, timeout=30)

    s3_server.pause()
    paused_at = time.monotonic()
    try:
        with a.connect(t) as conn:
            # Ingest is acknowledged all along (locally durable), and a compaction pass runs.
            while time.monotonic() - paused_at < 30:
                conn.ingest(b.batch(keys, 40))
                time.sleep(0.5)
        assert a.http.request("POST", f"/v1/tenant/{t}/compact").status == 200
        behind = _remote(a, t)
        assert behind["remote_consistent_lsn"] < b.rs.last_lsn, behind
    finally:
        s3_server.resume()
    remote = wait_until(lambda: (r := _remote(a, t))["remote_consistent_lsn"] >= b.rs.last_lsn and r,
                        timeout=120, desc="the uploads to catch up")
    wait_until(lambda: _remote(a, t)["queued_deletions"] == 0, timeout=60)
    assert remote["last_error"] is None

    a.kill()
    c = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    assert c.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
    with c.connect(t) as conn:
        verify(conn, b.rs, [(k, q) for k in keys for q in query_lsns(b.rs, k, limit=10)])


def test_kill9_at_any_point_of_uploads_and_deletions_loses_nothing_uploaded(pageserver_factory, s3_server):
    raw, env = [s3_server.remote_storage_setting("k")], s3_server.env()
    rng = random.Random(9)
    for round_no in range(3):
        a = pageserver_factory(raw_args=raw, env=env, **REMOTE)
        a.allowed_errors.extend(CRASH_WARNINGS)
        t = a.create_tenant()
        keys = make_keys(16, seed=round_no)
        b = HistoryBuilder(seed=100 + round_no)
        uploaded = [0]
        stop = threading.Event()

        def watch():
            # The highest remote_consistent_lsn seen before the kill: that much was uploaded.
            while not stop.is_set():
                try:
                    uploaded[0] = max(uploaded[0], _remote(a, t)["remote_consistent_lsn"])
                except Exception:
                    return
                time.sleep(0.05)

        def work():
            try:
                with a.connect(t) as conn:
                    for i in range(1000):
                        conn.ingest(b.batch(keys, 40))
                        if i % 5 == 4:
                            a.http.request("POST", f"/v1/tenant/{t}/compact")
            except Exception:
                pass  # killed

        threads = [threading.Thread(target=watch), threading.Thread(target=work)]
        for th in threads:
            th.start()
        time.sleep(2 + rng.random() * 4)
        a.kill()
        stop.set()
        for th in threads:
            th.join(timeout=30)
        assert uploaded[0] > 0, "nothing was uploaded before the kill"

        # The node comes back on its own disk: it finishes its deletions, and what its index
        # lists is all in the bucket.
        a.start()
        wait_until(lambda: _remote(a, t)["queued_deletions"] == 0 and _remote(a, t)["queued_uploads"] == 0,
                   timeout=60)
        a.stop()

        # A node with an empty disk attaches and serves every page up to what was uploaded.
        c = pageserver_factory(raw_args=raw, env=env, **REMOTE)
        assert c.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
        assert c.http.tenant_status(t)["last_durable_lsn"] >= uploaded[0]
        with c.connect(t) as conn:
            verify(conn, b.rs, _requests_up_to(b.rs, keys, uploaded[0]))
        c.stop()
