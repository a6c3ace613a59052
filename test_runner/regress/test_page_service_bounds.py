"""Bounds of a page service connection against careless or hostile clients
(docs/page-service-protocol.md, "Bounds"):

- before Hello, a frame longer than 4 KiB is refused from its length alone;
- a connection idle for `page_service_idle_timeout` (nothing in flight) is closed, while one
  whose requests are still in flight is not;
- at most 256 requests of a connection are in flight: the daemon stops reading beyond that;
- a client that never reads its replies cannot hold up the daemon's shutdown.
"""

from __future__ import annotations

import socket
import struct
import time

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import (
    T_GET_PAGE,
    ErrorReply,
    Page,
    frame,
    get_page_payload,
)
from fixtures.util import wait_until

K = Key.rel_block(9000, 1)
MAX_IN_FLIGHT = 256


def get_page_requests(ps) -> float:
    return ps.http.metrics().value("pageserver_page_service_requests_total", type="get_page") or 0


def test_oversized_frame_before_hello_is_refused_from_its_length(pageserver):
    conn = pageserver.raw_connection(timeout=10)
    # A 5000-byte Hello: within the 8 MiB frame limit, far beyond any Hello. Only the length is
    # sent: the daemon must not wait for (and buffer) the payload.
    conn.send_raw(struct.pack(">IB", 5000, 0x01))
    reply = conn.read_reply(timeout=10)
    assert isinstance(reply, ErrorReply) and reply.name == "frame_too_large", reply
    conn.wait_closed()
    conn.close()


def test_idle_connection_is_closed_but_one_with_requests_in_flight_is_not(pageserver_factory):
    ps = pageserver_factory(page_service_idle_timeout="1 s", wait_lsn_timeout="4 s")
    tenant = ps.create_tenant()
    idle = ps.connect(tenant)
    busy = ps.connect(tenant)
    rid = busy.send_get_page(K, 1000)  # waits for ingest that never comes: 4 s, then lsn_timeout
    started = time.monotonic()

    reply = idle.read_reply(timeout=20)
    assert isinstance(reply, ErrorReply) and reply.name == "idle_timeout", reply
    idle.wait_closed()

    reply = busy.read_reply(timeout=20)
    assert isinstance(reply, ErrorReply) and reply.name == "lsn_timeout" and reply.request_id == rid, reply
    assert time.monotonic() - started >= 3, "the busy connection's request ended early"
    idle.close()
    busy.close()


def test_reader_stops_at_256_requests_in_flight(pageserver, tenant):
    waiting_lsn = 50_000
    conn = pageserver.connect(tenant)
    total = 1000
    conn.send_raw(b"".join(frame(T_GET_PAGE, get_page_payload(i + 1, K, waiting_lsn)) for i in range(total)))
    wait_until(lambda: get_page_requests(pageserver) >= MAX_IN_FLIGHT, timeout=20,
               desc="the daemon to read the first 256 requests")
    # Give an unbounded reader time to show itself (the old daemon read all 1000 at once).
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        assert get_page_requests(pageserver) == MAX_IN_FLIGHT, get_page_requests(pageserver)
        time.sleep(0.05)

    # Once ingest reaches the LSN, every request is answered, in order.
    rs = o.RecordSet()
    values = [(K, waiting_lsn, o.RECORD, o.init_page(0))]
    rs.add_batch(values)
    with pageserver.connect(tenant) as writer:
        assert writer.ingest(values) == waiting_lsn
    want = rs.get_page(K, waiting_lsn)
    for i in range(total):
        reply = conn.read_reply(timeout=30)
        assert isinstance(reply, Page) and reply.request_id == i + 1 and reply.page == want, reply
    assert get_page_requests(pageserver) == total
    conn.close()


def test_shutdown_finishes_while_a_client_never_reads_its_replies(pageserver_factory):
    ps = pageserver_factory()
    ps.allowed_errors.append(r"connections? still open")
    tenant = ps.create_tenant()
    with ps.connect(tenant) as conn:
        assert conn.ingest([(K, 10, o.IMAGE, bytes([3]) * o.PAGE_SIZE)]) == 10

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(ps.pg_addr)
    try:
        sock.sendall(frame(0x01, struct.pack(">IH", 1, len(tenant)) + tenant.encode()))
        sock.setblocking(False)
        requests = b"".join(frame(T_GET_PAGE, get_page_payload(i + 1, K, 10)) for i in range(20_000))
        sent = 0
        deadline = time.monotonic() + 30
        # Pages pile up unread until the daemon's writer blocks on the full socket and it reads
        # no more requests (its count of requests read stops moving).
        last, last_change = -1, time.monotonic()
        while True:
            assert time.monotonic() < deadline, "the daemon kept reading requests"
            try:
                sent += sock.send(requests[sent:sent + 65536])
            except BlockingIOError:
                pass
            read = get_page_requests(ps)
            if read != last:
                last, last_change = read, time.monotonic()
            elif read >= MAX_IN_FLIGHT and time.monotonic() - last_change > 0.5:
                break
            time.sleep(0.02)
        started = time.monotonic()
        ps.stop(timeout=25)  # SIGTERM; the old daemon never exited
        assert time.monotonic() - started < 25
    finally:
        sock.close()
