"""Ingest requests the daemon must refuse with `invalid_request`, storing nothing of the batch,
keeping the connection open and usable."""

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import ErrorReply, IngestOk

K1 = Key.rel_block(5000, 1)
K2 = Key.rel_block(5000, 2)
NEW = Key.rel_block(5000, 3)  # only ever written by refused batches
DURABLE = 1000  # the tenant's last durable LSN before each refused batch


def _good(key, lsn):
    return (key, lsn, o.RECORD, o.set_bits(100, b"\x01"))


BAD_BATCHES = {
    "lsn_backwards_in_batch": [_good(NEW, 1010), _good(K2, 1005)],
    "lsn_equal_to_durable": [_good(NEW, DURABLE)],
    "lsn_below_durable": [_good(NEW, DURABLE - 500)],
    "image_too_short": [_good(NEW, 1010), (K2, 1011, o.IMAGE, bytes(8191))],
    "image_too_long": [_good(NEW, 1010), (K2, 1011, o.IMAGE, bytes(8193))],
    "empty_image": [_good(NEW, 1010), (K2, 1011, o.IMAGE, b"")],
    "empty_record": [_good(NEW, 1010), (K2, 1011, o.RECORD, b"")],
    "record_too_large": [_good(NEW, 1010), (K2, 1011, o.RECORD, o.append(bytes(16384)))],
    "duplicate_key_at_lsn": [_good(NEW, 1010), _good(K2, 1011), _good(K2, 1011)],
    "empty_batch": [],
}


@pytest.fixture
def loaded(pageserver, tenant):
    conn = pageserver.connect(tenant)
    rs = o.RecordSet()
    values = [(K1, 10, o.RECORD, o.init_page(0)), (K1, 20, o.RECORD, o.insert(b"k1")),
              (K2, 20, o.RECORD, o.init_page(8)), (K2, DURABLE, o.RECORD, o.insert(b"k2"))]
    rs.add_batch(values)
    assert conn.ingest(values) == DURABLE
    yield conn, rs
    conn.close()


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_ingest_is_refused_whole_and_connection_stays_usable(pageserver, tenant, loaded, case):
    conn, rs = loaded
    rid = conn.send_ingest(BAD_BATCHES[case], request_id=0x1234_5678_9ABC)
    reply = conn.read_reply()
    assert isinstance(reply, ErrorReply), f"{case}: expected invalid_request, got {reply}"
    assert reply.name == "invalid_request", reply
    assert reply.request_id == rid

    # nothing of the batch was stored
    assert pageserver.http.tenant_status(tenant)["last_durable_lsn"] == DURABLE
    conn.send_get_page(NEW)
    r = conn.read_reply()
    assert isinstance(r, ErrorReply) and r.name == "not_found", r
    assert conn.get_page(K2) == rs.get_page(K2, DURABLE)

    # the connection is still usable: a valid batch goes through
    good = [(NEW, DURABLE + 1, o.RECORD, o.init_page(0)), (K1, DURABLE + 2, o.RECORD, o.insert(b"more"))]
    rs.add_batch(good)
    assert conn.ingest(good) == DURABLE + 2
    assert conn.get_page(NEW) == rs.get_page(NEW, DURABLE + 2)
    assert conn.get_page(K1) == rs.get_page(K1, DURABLE + 2)


def test_refused_batch_between_pipelined_good_ones(pageserver, tenant, loaded):
    conn, rs = loaded
    first = [(K1, 1100, o.RECORD, o.insert(b"one"))]
    bad = [(K2, 1050, o.RECORD, o.insert(b"backwards"))]  # below 1100 once `first` is durable
    third = [(K2, 1200, o.RECORD, o.insert(b"three"))]
    rs.add_batch(first)
    rs.add_batch(third)
    r1 = conn.send_ingest(first)
    r2 = conn.send_ingest(bad)
    r3 = conn.send_ingest(third)
    a, b, c = conn.read_reply(), conn.read_reply(), conn.read_reply()
    assert isinstance(a, IngestOk) and (a.request_id, a.durable_lsn) == (r1, 1100), a
    assert isinstance(b, ErrorReply) and b.name == "invalid_request" and b.request_id == r2, b
    assert isinstance(c, IngestOk) and (c.request_id, c.durable_lsn) == (r3, 1200), c
    assert conn.get_page(K1) == rs.get_page(K1, 1200)
    assert conn.get_page(K2) == rs.get_page(K2, 1200)
