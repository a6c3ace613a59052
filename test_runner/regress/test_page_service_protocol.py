"""The page service wire protocol (docs/page-service-protocol.md): malformed frames get the
documented Error and a closed connection while other connections keep being served; replies are
in request order with the client's request ids; the largest legal frame is accepted; the
connection limit is enforced."""

import struct

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import (
    LATEST, MAX_FRAME_LEN, T_GET_PAGE, T_HELLO, T_INGEST, ErrorReply, IngestOk, Page,
    PageServiceError, frame, get_page_payload, hello_payload, ingest_payload,
)
from fixtures.util import wait_until
from fixtures.workload import HistoryBuilder, make_keys, verify

KEY = Key.rel_block(9000, 1)


def _hello(tenant):
    return frame(T_HELLO, hello_payload(tenant))


def _get(rid=1, key=KEY, lsn=LATEST):
    return frame(T_GET_PAGE, get_page_payload(rid, key, lsn))


# (what to send, whether Hello goes first, expected error)
BAD_FRAMES = {
    "unknown_type": (lambda t: frame(0x7F), True, "bad_frame"),
    "unknown_type_reply_type": (lambda t: frame(0x82, bytes(16)), True, "bad_frame"),
    "unknown_type_before_hello": (lambda t: frame(0x55), False, "bad_frame"),
    "get_page_short_payload": (lambda t: frame(T_GET_PAGE, bytes(10)), True, "bad_frame"),
    "get_page_long_payload": (lambda t: frame(T_GET_PAGE, get_page_payload(1, KEY, 5) + b"\x00"),
                              True, "bad_frame"),
    "get_page_empty_payload": (lambda t: frame(T_GET_PAGE), True, "bad_frame"),
    "ingest_truncated_value": (
        lambda t: frame(T_INGEST, ingest_payload(1, [(KEY, 5, o.RECORD, o.init_page(0))])[:-1]),
        True, "bad_frame"),
    "ingest_count_too_high": (
        lambda t: frame(T_INGEST, struct.pack(">QI", 1, 2) + ingest_payload(1, [(KEY, 5, o.RECORD, o.init_page(0))])[12:]),
        True, "bad_frame"),
    "ingest_trailing_bytes": (
        lambda t: frame(T_INGEST, ingest_payload(1, [(KEY, 5, o.RECORD, o.init_page(0))]) + b"xx"),
        True, "bad_frame"),
    "get_page_before_hello": (lambda t: _get(), False, "bad_frame"),
    "ingest_before_hello": (lambda t: frame(T_INGEST, ingest_payload(1, [(KEY, 5, o.RECORD, o.init_page(0))])),
                            False, "bad_frame"),
    "second_hello": (lambda t: _hello(t), True, "bad_frame"),
    "hello_short_payload": (lambda t: frame(T_HELLO, b"\x00\x00\x00"), False, "bad_frame"),
    "hello_tenant_len_past_end": (lambda t: frame(T_HELLO, struct.pack(">IH", 1, 50) + b"abc"), False, "bad_frame"),
    "hello_trailing_bytes": (lambda t: frame(T_HELLO, hello_payload(t) + b"!"), False, "bad_frame"),
    "zero_len": (lambda t: struct.pack(">I", 0), True, "frame_too_large"),
    "oversized_len": (lambda t: struct.pack(">IB", MAX_FRAME_LEN + 1, T_INGEST), True, "frame_too_large"),
    "oversized_len_before_hello": (lambda t: struct.pack(">IB", 0xFFFF_FFFF, T_GET_PAGE), False, "frame_too_large"),
    "hello_version_3": (lambda t: frame(T_HELLO, hello_payload(t, version=3)), False, "unsupported_version"),
    "hello_v1_trailing_timeline": (lambda t: frame(T_HELLO, hello_payload(t, version=1) + b"\x00\x04main"), False, "bad_frame"),
    "hello_v2_without_timeline": (lambda t: frame(T_HELLO, struct.pack(">IH", 2, len(t)) + t.encode()), False, "bad_frame"),
    "hello_unknown_timeline": (lambda t: frame(T_HELLO, hello_payload(t, timeline="nope")), False, "no_such_tenant"),
    "hello_version_0": (lambda t: frame(T_HELLO, hello_payload(t, version=0)), False, "unsupported_version"),
    "hello_unknown_tenant": (lambda t: _hello("no-such-tenant"), False, "no_such_tenant"),
}


@pytest.fixture
def served(pageserver, tenant):
    """A tenant with one page, and a witness connection that must keep being served."""
    values = [(KEY, 10, o.RECORD, o.init_page(0)), (KEY, 11, o.RECORD, o.insert(b"witness"))]
    witness = pageserver.connect(tenant)
    witness.ingest(values)
    yield witness
    witness.close()


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_malformed_frame_gets_error_and_close(pageserver, tenant, served, case):
    make, hello_first, want = BAD_FRAMES[case]
    conn = pageserver.raw_connection(timeout=10)
    try:
        if hello_first:
            conn.hello(tenant)
        # a witness request in flight while the bad frame arrives
        rid = served.send_get_page(KEY)
        conn.send_raw(make(tenant))
        reply = conn.read_reply()
        assert isinstance(reply, ErrorReply), f"{case}: expected Error {want}, got {reply}"
        assert reply.name == want, f"{case}: {reply}"
        conn.wait_closed()
    finally:
        conn.close()
    page = served.expect(rid, Page)
    assert o.tuple_data(page.page, 1) == b"witness"
    assert o.tuple_data(served.get_page(KEY, 11), 1) == b"witness"


def test_error_request_ids_are_echoed(pageserver, tenant, served):
    ids = [0, 1, 2**63, 2**64 - 1, 0xDEAD_BEEF]
    for rid in ids:
        served.send_get_page(KEY, LATEST, request_id=rid)
        served.send_get_page(Key.rel_block(9000, 99), LATEST, request_id=rid)  # not_found
        served.send_get_page(KEY, 0, request_id=rid)  # below the first value: not_found
    for rid in ids:
        page, missing, early = served.read_reply(), served.read_reply(), served.read_reply()
        assert isinstance(page, Page) and page.request_id == rid, page
        assert isinstance(missing, ErrorReply) and missing.name == "not_found" and missing.request_id == rid
        assert isinstance(early, ErrorReply) and early.name == "not_found" and early.request_id == rid
    ingest_rid = 2**64 - 2
    served.send_ingest([(KEY, 12, o.RECORD, o.append(b"x"))], request_id=ingest_rid)
    ok = served.read_reply()
    assert isinstance(ok, IngestOk) and ok.request_id == ingest_rid and ok.durable_lsn == 12


def test_pipelined_requests_are_answered_in_order(pageserver, tenant):
    keys = make_keys(8, relnode=9100)
    b = HistoryBuilder(seed=71)
    with pageserver.connect(tenant) as conn:
        conn.ingest(b.batch(keys, 80))
        # mix of found, not found (before the first value) and latest, all sent before reading
        requests = []
        for i in range(300):
            k = keys[i % len(keys)]
            lsns = b.rs.lsns(k)
            requests.append((k, [LATEST, lsns[0] - 1, lsns[-1], lsns[len(lsns) // 2]][i % 4]))
        verify(conn, b.rs, requests, window=300)
        # Ingest and GetPage pipelined on one connection: the GetPage after the Ingest sees it
        values = b.batch(keys, 5)
        rid_ingest = conn.send_ingest(values)
        rid_get = conn.send_get_page(values[-1][0], values[-1][1])
        assert conn.expect(rid_ingest, IngestOk).durable_lsn == values[-1][1]
        assert conn.expect(rid_get, Page).page == b.rs.get_page(values[-1][0], values[-1][1])


def test_largest_frame_is_accepted(pageserver, tenant):
    # payload: request_id, count, then values of 30 bytes + data; frame len = 1 + payload
    images = 1020
    keys = [Key.rel_block(9200, i) for i in range(images + 1)]
    values = [(keys[i], 100 + i, o.IMAGE, bytes([i % 251]) * 8192) for i in range(images)]
    used = 1 + 12 + images * (30 + 8192)
    record_len = MAX_FRAME_LEN - used - 30
    assert 3 < record_len <= 16384
    last = (keys[-1], 100 + images, o.RECORD, o.put_bytes(0, bytes(record_len - 3)))
    values.append(last)
    payload = ingest_payload(7, values)
    assert 1 + len(payload) == MAX_FRAME_LEN
    with pageserver.connect(tenant) as conn:
        conn.send_raw(frame(T_INGEST, payload))
        reply = conn.read_reply(timeout=60)
        assert isinstance(reply, IngestOk) and reply.durable_lsn == 100 + images, reply
        assert conn.get_page(keys[5]) == bytes([5]) * 8192
        assert conn.get_page(keys[-1])[:8] == struct.pack("<II", 0, 100 + images)


def test_connection_limit(pageserver_factory):
    ps = pageserver_factory(max_connections=3)
    ps.allowed_errors.append(r"refusing a connection: too many connections")
    t = ps.create_tenant()
    conns = [ps.connect(t) for _ in range(3)]
    try:
        extra = ps.raw_connection(timeout=10)
        with pytest.raises(PageServiceError) as e:
            extra.hello(t)
        assert e.value.name == "too_many_connections"
        extra.wait_closed()
        extra.close()
        # the three connections are still served
        for c in conns:
            with pytest.raises(PageServiceError) as e:
                c.get_page(KEY)
            assert e.value.name == "not_found"
        # closing one makes room for a new one
        conns.pop().close()

        def can_connect():
            try:
                conns.append(ps.connect(t))
                return True
            except PageServiceError as err:
                assert err.name == "too_many_connections"
                return False

        wait_until(can_connect, timeout=10, desc="a free connection slot")
    finally:
        for c in conns:
            c.close()


def test_hello_ok_reports_version(pageserver, tenant):
    """HelloOk repeats the Hello's version: 2 (naming the timeline), or 1 (meaning `main`)."""
    for version in (2, 1):
        conn = pageserver.raw_connection()
        try:
            conn.send_raw(frame(T_HELLO, hello_payload(tenant, version=version)))
            frame_type, payload = conn.read_frame()
            assert frame_type == 0x81
            assert struct.unpack(">IQ", payload) == (version, 0)
        finally:
            conn.close()
