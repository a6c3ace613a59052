"""The daemon-wide budget of bytes in flight to redo (`walredo_memory_budget`).

A GetPage reserves the bytes it reads for reconstruction (image and records) before reading
them, and holds them until its page is built; with the budget taken, another GetPage, of any
tenant, waits (up to `wal_redo_timeout`, then `overloaded`). Here one tenant's redo child is
SIGSTOPped in the middle of a request that takes the whole budget: another tenant's GetPage that
needs redo must wait until the first finishes, and then both are served.
"""

from __future__ import annotations

import os
import signal

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import Page
from fixtures.util import wait_until

BIG = Key.rel_block(9200, 1)
SMALL = Key.rel_block(9200, 2)


def test_redo_waits_for_the_memory_budget_held_by_another_tenant(pageserver_factory):
    ps = pageserver_factory(walredo_memory_budget="1 MiB")
    a, b = ps.create_tenant("budget-a"), ps.create_tenant("budget-b")
    rs_a, rs_b = o.RecordSet(), o.RecordSet()
    conn_a, conn_b = ps.connect(a), ps.connect(b)

    # Tenant a: a chain of about 1.1 MiB of records on BIG, and a small page to start its child.
    lsn = 10
    first = [(BIG, lsn, o.RECORD, o.init_page(0)), (SMALL, lsn, o.RECORD, o.init_page(0))]
    rs_a.add_batch(first)
    conn_a.ingest(first)
    for _ in range(7):
        batch = []
        for _ in range(20):
            lsn += 1
            batch.append((BIG, lsn, o.RECORD, o.put_bytes(100, bytes([lsn % 251]) * 8000)))
        rs_a.add_batch(batch)
        conn_a.ingest(batch)
    last_a = lsn
    values_b = [(SMALL, 10, o.RECORD, o.init_page(0)), (SMALL, 20, o.RECORD, o.insert(b"b"))]
    rs_b.add_batch(values_b)
    conn_b.ingest(values_b)

    assert conn_a.get_page(SMALL) == rs_a.get_page(SMALL, last_a)
    kids = ps.redo_children()
    assert len(kids) == 1, kids  # tenant a's
    child = kids[0].pid
    os.kill(child, signal.SIGSTOP)
    try:
        rid_a = conn_a.send_get_page(BIG)
        wait_until(lambda: ps.http.metrics().value("pageserver_walredo_memory_budget_used_bytes") == 1 << 20,
                   desc="a's request to take the whole budget")
        rid_b = conn_b.send_get_page(SMALL)
        # The old daemon served b at once, with a's 1.1 MiB still in flight.
        assert not conn_b.reply_pending(1.0), "b's redo did not wait for the budget a holds"
    finally:
        os.kill(child, signal.SIGCONT)
    reply = conn_a.read_reply(timeout=30)
    assert isinstance(reply, Page) and reply.request_id == rid_a, reply
    assert reply.page == rs_a.get_page(BIG, last_a)
    reply = conn_b.read_reply(timeout=30)
    assert isinstance(reply, Page) and reply.request_id == rid_b, reply
    assert reply.page == rs_b.get_page(SMALL, 20)
    # Everything given back (a compaction pass may still hold budget for its image of BIG a
    # moment longer: it reserves from the same budget).
    wait_until(lambda: ps.http.metrics().value("pageserver_walredo_memory_budget_used_bytes") == 0,
               desc="the budget given back")
    conn_a.close()
    conn_b.close()
