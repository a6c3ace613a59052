"""Threads are O(1) in the number of tenants: 1000 tenants, each with a durable ingest, run on
about as many daemon threads as 10 do (storage commits share one bounded pool)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from fixtures import oracle as o
from fixtures.oracle import Key

# Threads that may come and go independently of the tenant count (tokio's blocking pool keeps
# idle threads for a while, the HTTP server, ...).
SLACK = 16


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _create_and_ingest(ps, ids):
    def one(tid):
        ps.http.create_tenant(tid)
        with ps.connect(tid) as conn:
            assert conn.ingest([(Key.rel_block(1, 1), 10, o.IMAGE, bytes(8192))]) == 10

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, ids))


def test_thread_count_does_not_grow_with_tenants(pageserver):
    _create_and_ingest(pageserver, [f"few{i:04d}" for i in range(10)])
    with_10 = _threads(pageserver.pid)
    _create_and_ingest(pageserver, [f"many{i:04d}" for i in range(990)])
    assert len(pageserver.http.list_tenants()) == 1000
    with_1000 = _threads(pageserver.pid)
    assert with_1000 <= with_10 + SLACK, f"{with_10} threads with 10 tenants, {with_1000} with 1000"
