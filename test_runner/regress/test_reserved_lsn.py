"""Ingest at a reserved LSN is refused at the protocol boundary (docs/page-service-protocol.md).

`0xFFFFFFFFFFFFFFFF` is GetPage's "latest" sentinel: a value stored there would make every
later batch "go backwards" and freeze the tenant's ingest for good, across restarts. LSN 0 is
below every tenant's start. Both are answered `invalid_request`, nothing is stored, and the
connection and the tenant keep working.
"""

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import LATEST, ErrorReply

K = Key.rel_block(6000, 1)


@pytest.mark.parametrize("reserved", [LATEST, 0], ids=["latest", "zero"])
def test_ingest_at_reserved_lsn_is_refused_and_ingest_goes_on(pageserver, tenant, reserved):
    conn = pageserver.connect(tenant)
    rs = o.RecordSet()
    first = [(K, 100, o.RECORD, o.init_page(0))]
    rs.add_batch(first)
    assert conn.ingest(first) == 100

    bad = [(K, 200, o.RECORD, o.insert(b"fine")), (K, reserved, o.RECORD, o.insert(b"reserved"))]
    if reserved == 0:
        bad = [(K, 0, o.RECORD, o.insert(b"reserved"))]
    rid = conn.send_ingest(bad)
    reply = conn.read_reply()
    assert isinstance(reply, ErrorReply), f"a batch at LSN {reserved:#x} was accepted: {reply}"
    assert reply.name == "invalid_request" and reply.request_id == rid, reply
    assert "reserved" in reply.message, reply
    assert pageserver.http.tenant_status(tenant)["last_durable_lsn"] == 100

    # the connection stays open and the tenant's ingest goes on, also after a restart
    more = [(K, 300, o.RECORD, o.insert(b"more"))]
    rs.add_batch(more)
    assert conn.ingest(more) == 300
    assert conn.get_page(K) == rs.get_page(K, 300)
    conn.close()
    pageserver.restart()
    conn = pageserver.connect(tenant)
    last = [(K, 400, o.RECORD, o.insert(b"last"))]
    rs.add_batch(last)
    assert conn.ingest(last) == 400
    assert conn.get_page(K) == rs.get_page(K, 400)
    conn.close()
