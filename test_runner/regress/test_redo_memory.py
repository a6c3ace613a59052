"""`walredo_memory_budget` bounds the daemon's memory for page reconstruction.

One key holds 1500 records of 8 KiB above no image (12 MiB of records), and one connection
pipelines N GetPages at N different LSNs near the top: every one of them reads and sends about
12 MiB. Whatever N, the daemon's peak RSS (VmHWM, reset before each round) may grow by at most
the budget plus 64 MiB: everything a reconstruction holds (what it read, what it sends to the
child, the reply) fits in what it reserved, and nothing is copied on the way.
"""

from __future__ import annotations

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import Page
from fixtures.util import reset_peak_rss, status_kib

KEY = Key.rel_block(9300, 0)
RECORDS = 1500
RECORD_BYTES = 8000
BUDGET_MIB = 64


@pytest.mark.parametrize("n", [16, 64, 256])
def test_peak_rss_of_pipelined_reconstructions_stays_within_the_memory_budget(pageserver_factory, n):
    ps = pageserver_factory(walredo_memory_budget=f"{BUDGET_MIB} MiB", page_cache_size=0,
                            compaction="off")
    t = ps.create_tenant()
    rs = o.RecordSet()
    lsn = 100
    with ps.connect(t) as conn:
        first = [(KEY, lsn, o.RECORD, o.init_page(0))]
        rs.add_batch(first)
        conn.ingest(first)
        while lsn < 100 + RECORDS - 1:
            batch = []
            for _ in range(min(100, 100 + RECORDS - 1 - lsn)):
                lsn += 1
                batch.append((KEY, lsn, o.RECORD, o.put_bytes(64, bytes([lsn % 251]) * RECORD_BYTES)))
            rs.add_batch(batch)
            conn.ingest(batch)
        top = lsn
        # The child is running and the daemon warmed up before the baseline is taken.
        assert conn.get_page(KEY, top) == rs.get_page(KEY, top)
        lsns = [top - i for i in range(n)]
        expected = {v: rs.get_page(KEY, v) for v in lsns}

        baseline = status_kib(ps.pid, "VmRSS")
        reset_peak_rss(ps.pid)
        rids = {conn.send_get_page(KEY, v): v for v in lsns}
        for _ in range(n):
            reply = conn.read_reply(timeout=120)
            assert isinstance(reply, Page), reply
            assert reply.page == expected[rids.pop(reply.request_id)]
        peak = status_kib(ps.pid, "VmHWM")
    growth_mib = (peak - baseline) / 1024
    assert growth_mib < BUDGET_MIB + 64, (
        f"peak RSS grew by {growth_mib:.0f} MiB with {n} reconstructions of 12 MiB in flight "
        f"and a budget of {BUDGET_MIB} MiB"
    )
