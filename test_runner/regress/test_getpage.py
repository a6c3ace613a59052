"""GetPage after ingest, compared with the oracle; waiting for an LSN; not found."""

import collections
import threading
import time

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import LATEST, ErrorReply, Page, PageServiceError
from fixtures.util import wait_until
from fixtures.workload import HistoryBuilder, make_keys, query_lsns, verify


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_histories_match_oracle_at_every_lsn(pageserver, process_kind, tenant, seed):
    # Starts just below 2^32 so that pd_lsn's high word (xlogid) changes on the way.
    b = HistoryBuilder(seed=seed, start_lsn=0xFFFF_F000)
    keys = make_keys(24, seed=seed)
    kinds = collections.Counter()
    with pageserver.connect(tenant) as conn:
        for _ in range(8):
            values = b.batch(keys, 50)
            kinds.update("image" if v[2] == o.IMAGE else v[3][0] for v in values)
            assert conn.ingest(values) == values[-1][1]
        assert b.rs.last_lsn > 2**32
        # the history exercises every record kind and base images
        assert set(kinds) >= {"image", *range(1, 10)}, kinds
        requests = [(k, lsn) for k in keys for lsn in query_lsns(b.rs, k)]
        pages = verify(conn, b.rs, requests)
    assert pages > 500
    status = pageserver.http.tenant_status(tenant)
    assert status["last_durable_lsn"] == b.rs.last_lsn
    assert status["walredo"]["process_kind"] == process_kind
    assert status["counters"]["ingest_batches"] == 8
    assert status["counters"]["ingested_values"] == 8 * 50
    assert status["counters"]["get_page_requests"] >= len(requests)


def test_every_record_kind_in_one_chain(pageserver, process_kind, tenant):
    k = Key.rel_block(2000, 0)
    chain = [
        o.init_page(16),
        o.insert(b"alpha" * 3),  # slot 1
        o.insert(b"beta"),  # slot 2
        o.insert(b"gamma-gamma-gamma", 3),  # slot 3, explicit new slot
        o.update(2, b"BETA"),  # in place
        o.update(1, b"a much longer alpha tuple that moves"),  # elsewhere
        o.delete(3),
        o.set_bits(8180, b"\x0f\x0f"),  # special space
        o.clear_bits(8181, b"\x01"),
        o.put_bytes(1000, b"free-space bytes"),
        o.append(b"appended"),
        o.put_bytes(0, b"\xff" * 8),  # overwritten by pd_lsn
        o.prune(),
        o.insert(b"after prune"),  # reuses slot 3
        o.delete(2),
        o.prune(),
    ]
    rs = o.RecordSet()
    values = [(k, 100 + 10 * i, o.RECORD, rec) for i, rec in enumerate(chain)]
    rs.add_batch(values)
    rs.get_page(k, LATEST)  # the chain applies cleanly in the oracle
    with pageserver.connect(tenant) as conn:
        conn.ingest(values[:8])
        conn.ingest(values[8:])
        requests = [(k, lsn) for lsn in range(95, values[-1][1] + 1, 5)] + [(k, LATEST)]
        verify(conn, rs, requests)
        final = conn.get_page(k)
    assert o.tuple_data(final, 3) == b"after prune"


def test_newest_image_wins_over_older_records(pageserver, process_kind, tenant):
    k = Key.rel_block(2001, 5)
    b = HistoryBuilder(seed=5)
    image1 = b.image(10)
    image2 = bytes(range(256)) * 32  # arbitrary bytes, served as is
    fresh = o.apply_record(o.ZERO_PAGE, 1, o.init_page(0))
    image3 = o.apply_record(fresh, 2, o.insert(b"in the image"))
    values = [
        (k, 10, o.IMAGE, image1),
        (k, 20, o.RECORD, o.put_bytes(4000, b"on image1")),
        (k, 30, o.IMAGE, image2),
        (k, 40, o.IMAGE, image3),
        (k, 50, o.RECORD, o.insert(b"on image3")),
        (k, 60, o.RECORD, o.update(1, b"IN THE IMAGE")),
    ]
    rs = o.RecordSet()
    rs.add_batch(values)
    with pageserver.connect(tenant) as conn:
        conn.ingest(values)
        verify(conn, rs, [(k, lsn) for lsn in (10, 15, 20, 29, 30, 35, 40, 45, 50, 60)] + [(k, LATEST)])
        assert conn.get_page(k, 35) == image2


def test_get_page_not_found(pageserver, tenant):
    written = Key.rel_block(3000, 1)
    never = Key.rel_block(3000, 2)
    with pageserver.connect(tenant) as conn:
        # empty tenant: nothing at all
        with pytest.raises(PageServiceError) as e:
            conn.get_page(never, LATEST)
        assert e.value.name == "not_found"
        conn.ingest([(written, 500, o.RECORD, o.init_page(0))])
        for key, lsn in [(never, LATEST), (never, 500), (written, 499), (written, 1)]:
            rid = conn.send_get_page(key, lsn, request_id=0xABCD_0000 + lsn % 1000)
            reply = conn.read_reply()
            assert isinstance(reply, ErrorReply), reply
            assert reply.name == "not_found", reply
            assert reply.request_id == rid
        # the connection is still usable
        reply = conn.get_page_reply(written, LATEST)
        assert reply.lsn == 500
        assert o.read_header(reply.page).lower == 24


def test_get_page_above_durable_lsn_waits_for_ingest(pageserver, tenant):
    k = Key.rel_block(4000, 1)
    rs = o.RecordSet()
    first = [(k, 100, o.RECORD, o.init_page(0))]
    second = [(k, 200, o.RECORD, o.insert(b"x" * 10)), (k, 300, o.RECORD, o.insert(b"y" * 20))]
    rs.add_batch(first + second)
    with pageserver.connect(tenant) as reader, pageserver.connect(tenant) as writer:
        writer.ingest(first)
        rid = reader.send_get_page(k, 250)
        # not answered while ingest has not reached 250
        assert not reader.reply_pending(0.5), "GetPage above the durable LSN answered early"
        assert writer.ingest(second) == 300
        reply = reader.expect(rid, Page, timeout=10)
        assert reply.lsn == 250
        assert reply.page == rs.get_page(k, 250)


def test_get_page_waits_across_several_ingests(pageserver, tenant):
    k = Key.rel_block(4001, 1)
    b = HistoryBuilder(seed=11, start_lsn=1000)
    with pageserver.connect(tenant) as reader, pageserver.connect(tenant) as writer:
        writer.ingest(b.batch([k], 5))
        target = b.rs.last_lsn + 1000  # reached after a few more batches
        rid = reader.send_get_page(k, target)
        result = {}

        def read():
            try:
                result["reply"] = reader.expect(rid, Page, timeout=30)
            except Exception as e:  # noqa: BLE001 - checked below
                result["error"] = e

        t = threading.Thread(target=read)
        t.start()
        while b.rs.last_lsn < target:
            assert "reply" not in result and "error" not in result, result
            writer.ingest(b.batch([k], 5))
        t.join(30)
        assert not t.is_alive()
        assert "error" not in result, result
        assert result["reply"].page == b.rs.get_page(k, target)


def test_get_page_lsn_timeout(pageserver_factory):
    ps = pageserver_factory(wait_lsn_timeout="500 ms")
    t = ps.create_tenant()
    k = Key.rel_block(4002, 1)
    with ps.connect(t) as conn:
        conn.ingest([(k, 100, o.RECORD, o.init_page(0))])
        started = time.monotonic()
        rid = conn.send_get_page(k, 101)
        reply = conn.read_reply(timeout=20)
        elapsed = time.monotonic() - started
        assert isinstance(reply, ErrorReply) and reply.name == "lsn_timeout", reply
        assert reply.request_id == rid
        assert elapsed >= 0.4, f"lsn_timeout after {elapsed:.3f} s, before wait_lsn_timeout"
        # connection stays open; a page at the durable LSN is served
        assert conn.get_page_reply(k, 100).lsn == 100
        # after an ingest reaches the LSN, the same request succeeds
        conn.ingest([(k, 101, o.RECORD, o.insert(b"late"))])
        assert o.tuple_data(conn.get_page(k, 101), 1) == b"late"


def test_latest_resolves_to_last_durable_lsn(pageserver, tenant):
    k1, k2 = Key.rel_block(4003, 1), Key.rel_block(4003, 2)
    with pageserver.connect(tenant) as conn:
        assert conn.ingest([(k1, 10, o.RECORD, o.init_page(0))]) == 10
        assert conn.ingest([(k2, 20, o.RECORD, o.init_page(8)), (k2, 20 + 1, o.RECORD, o.append(b"z"))]) == 21
        reply = conn.get_page_reply(k1, LATEST)
        assert reply.lsn == 21  # the last durable LSN, not the key's last LSN
        assert o.read_header(reply.page).lsn == 10
    hello = pageserver.raw_connection()
    try:
        assert hello.hello(tenant).last_durable_lsn == 21
    finally:
        hello.close()
    wait_until(lambda: pageserver.http.tenant_status(tenant)["last_durable_lsn"] == 21, timeout=5,
               desc="status last_durable_lsn")


def test_sigterm_answers_waiting_get_page_with_shutting_down(pageserver):
    """A GetPage waiting for an LSN does not hold up shutdown: it gets shutting_down."""
    t = pageserver.create_tenant()
    k = Key.rel_block(4004, 1)
    conn = pageserver.connect(t)
    try:
        conn.ingest([(k, 100, o.RECORD, o.init_page(0))])
        rid = conn.send_get_page(k, 1000)  # waits up to wait_lsn_timeout (60 s by default)
        assert not conn.reply_pending(0.3)
        started = time.monotonic()
        pageserver.stop(timeout=10)
        assert time.monotonic() - started < 10
        reply = conn.read_reply(timeout=5)
        assert isinstance(reply, ErrorReply) and reply.name == "shutting_down", reply
        assert reply.request_id in (rid, 0), reply
        conn.wait_closed()
    finally:
        conn.close()


def test_tenant_delete_answers_waiting_get_page_with_shutting_down(pageserver):
    t, other = pageserver.create_tenant(), pageserver.create_tenant()
    k = Key.rel_block(4005, 1)
    conn = pageserver.connect(t)
    try:
        conn.ingest([(k, 100, o.RECORD, o.init_page(0))])
        conn.send_get_page(k, 1000)
        assert not conn.reply_pending(0.3)
        started = time.monotonic()
        pageserver.http.delete_tenant(t)
        reply = conn.read_reply(timeout=10)
        assert isinstance(reply, ErrorReply) and reply.name == "shutting_down", reply
        assert time.monotonic() - started < 10
        conn.wait_closed()
    finally:
        conn.close()
    with pageserver.connect(other) as c:
        assert c.hello_ok.last_durable_lsn == 0


def test_tenants_are_isolated(pageserver, process_kind):
    t1, t2 = pageserver.create_tenant(), pageserver.create_tenant()
    keys = make_keys(6, relnode=4100)  # the same keys in both tenants
    b1 = HistoryBuilder(seed=101, start_lsn=10_000)
    b2 = HistoryBuilder(seed=102, start_lsn=5)  # each tenant has its own LSN sequence
    with pageserver.connect(t1) as c1, pageserver.connect(t2) as c2:
        for _ in range(3):
            c1.ingest(b1.batch(keys, 30))
            c2.ingest(b2.batch(keys, 30))
        verify(c1, b1.rs, [(k, lsn) for k in keys for lsn in query_lsns(b1.rs, k, limit=8)])
        verify(c2, b2.rs, [(k, lsn) for k in keys for lsn in query_lsns(b2.rs, k, limit=8)])
        assert c1.get_page(keys[0]) != c2.get_page(keys[0])
