"""Records that do not apply: the GetPage that needs them gets `redo_failed`; everything else is
still served, on the same connection, by the same daemon."""

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import LATEST
from fixtures.workload import HistoryBuilder, make_keys, verify

# records that decode but do not fit the page built by BASE (apply_failed in the child)
FAILING = {
    "delete_missing_tuple": o.delete(5),
    "update_missing_tuple": o.update(9, b"x"),
    "delete_dead_tuple": o.delete(2),
    "insert_into_used_slot": o.insert(b"x", 1),
    "insert_page_full": o.insert(bytes(8150)),  # free space is 8144
    "put_bytes_off_page": o.put_bytes(8190, b"abcd"),
    "set_bits_off_page": o.set_bits(0xFFFF, b"\x01"),
    "init_bad_special_size": o.init_page(12),
}
BASE = [o.init_page(0), o.insert(b"first"), o.insert(b"second"), o.delete(2)]
# a redo failure is logged as a WARN (bad data, handled); nothing else may be
REDO_FAILED_WARNING = r"failed to reconstruct a page: redo rejected by walredo process \(apply_failed\)"


def test_record_that_does_not_apply_fails_only_that_request(pageserver, process_kind, tenant):
    pageserver.allowed_errors.append(REDO_FAILED_WARNING)
    rs = o.RecordSet()
    keys = {}
    lsn = 100
    values = []
    for i, name in enumerate(sorted(FAILING)):
        k = Key.rel_block(6000, i)
        keys[name] = k
        for rec in BASE:
            values.append((k, lsn, o.RECORD, rec))
            lsn += 1
        values.append((k, lsn, o.RECORD, FAILING[name]))
        lsn += 1
        values.append((k, lsn, o.RECORD, o.insert(b"after the failure")))
        lsn += 1
    healthy = Key.rel_block(6001, 0)
    values += [(healthy, lsn, o.RECORD, o.init_page(0)), (healthy, lsn + 1, o.RECORD, o.insert(b"ok"))]
    rs.add_batch(values)
    with pageserver.connect(tenant) as conn:
        conn.ingest(values)
        for name, k in keys.items():
            lsns = rs.lsns(k)
            bad_lsn = lsns[len(BASE)]
            # oracle agrees the record fails, and names it
            with pytest.raises(o.ApplyFailed) as exc:
                rs.get_page(k, LATEST)
            assert exc.value.lsn == bad_lsn, name
            # below the failing record: served; at and above it: redo_failed
            requests = [(k, bad_lsn - 1), (k, bad_lsn), (k, lsns[-1]), (k, LATEST), (healthy, LATEST)]
            verify(conn, rs, requests)
        # the connection and the tenant still work: a new image replaces the broken history
        k = keys["delete_missing_tuple"]
        img = rs.get_page(k, rs.lsns(k)[len(BASE) - 1])
        fix = [(k, rs.last_lsn + 1, o.IMAGE, img), (k, rs.last_lsn + 2, o.RECORD, o.insert(b"fixed"))]
        rs.add_batch(fix)
        conn.ingest(fix)
        verify(conn, rs, [(k, LATEST), (healthy, LATEST)])


def test_redo_failures_interleaved_with_good_requests(pageserver, process_kind, tenant):
    """Pipelined good and failing requests on one connection: answers stay in order and right."""
    pageserver.allowed_errors.append(REDO_FAILED_WARNING)
    b = HistoryBuilder(seed=21)
    keys = make_keys(6, relnode=6100)
    bad = Key.rel_block(6200, 0)
    with pageserver.connect(tenant) as conn:
        conn.ingest(b.batch(keys, 60))
        lsn = b.rs.last_lsn + 1
        broken = [(bad, lsn, o.RECORD, o.init_page(0)), (bad, lsn + 1, o.RECORD, o.update(1, b"nothing"))]
        b.rs.add_batch(broken)
        conn.ingest(broken)
        conn.ingest(b.batch(keys, 30))
        requests = []
        for i, k in enumerate(keys * 5):
            requests.append((k, LATEST if i % 2 else b.rs.lsns(k)[i % len(b.rs.lsns(k))]))
            requests.append((bad, LATEST))
        verify(conn, b.rs, requests, window=16)
