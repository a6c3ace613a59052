"""Durability: a clean restart keeps everything acknowledged; so does `kill -9` in the middle of
a stream of ingests (nothing beyond the acknowledged batches is required, but a batch is stored
whole or not at all)."""

import os
import threading

import pytest

from fixtures import oracle as o
from fixtures.daemon import other_kind
from fixtures.page_client import ConnectionClosed, PageConnection
from fixtures.util import wait_until
from fixtures.workload import HistoryBuilder, make_keys, query_lsns, verify

# A crash leaves the daemon's redo children and its storage to be cleaned up or recovered; both
# may be reported as WARN. The patterns are deliberately narrow to those topics.
CRASH_WARNINGS = [r"(?i)walredo", r"(?i)redo (child|process)", r"(?i)(torn|truncat|recover|replay|checksum)"]


def _all_requests(rs, keys, limit=30):
    return [(k, lsn) for k in keys for lsn in query_lsns(rs, k, limit=limit)]


def test_restart_keeps_acknowledged_records(pageserver, process_kind):
    t1 = pageserver.create_tenant()
    t2 = pageserver.create_tenant(kind=other_kind(process_kind))
    keys = make_keys(10)
    b1, b2 = HistoryBuilder(seed=31), HistoryBuilder(seed=32, start_lsn=2**40)
    with pageserver.connect(t1) as c1, pageserver.connect(t2) as c2:
        for _ in range(5):
            c1.ingest(b1.batch(keys, 30))
            c2.ingest(b2.batch(keys, 30))
    pageserver.http.set_tenant_config(t1, {"walredo_process_kind": other_kind(process_kind)})
    pageserver.http.set_tenant_config(t2, {"walredo_process_kind": None})

    for cycle in range(2):
        pageserver.restart()
        listed = {t["id"]: t for t in pageserver.http.list_tenants()}
        assert set(listed) == {t1, t2}
        # overrides are stored with the tenant
        assert listed[t1]["config"]["walredo_process_kind"] == other_kind(process_kind)
        assert listed[t1]["effective_config"]["walredo_process_kind"] == other_kind(process_kind)
        assert listed[t2]["config"].get("walredo_process_kind") is None
        assert listed[t2]["effective_config"]["walredo_process_kind"] == process_kind
        for t, b in ((t1, b1), (t2, b2)):
            assert listed[t]["last_durable_lsn"] == b.rs.last_lsn
            with pageserver.connect(t) as conn:
                assert conn.hello_ok.last_durable_lsn == b.rs.last_lsn
                verify(conn, b.rs, _all_requests(b.rs, keys))
                # ingest continues above the recovered LSN
                conn.ingest(b.batch(keys, 20))
                verify(conn, b.rs, _all_requests(b.rs, keys, limit=5))


def test_kill9_after_ack_keeps_everything(pageserver, process_kind):
    pageserver.allowed_errors.extend(CRASH_WARNINGS)
    t = pageserver.create_tenant()
    keys = make_keys(8)
    b = HistoryBuilder(seed=41)
    with pageserver.connect(t) as conn:
        for _ in range(3):
            conn.ingest(b.batch(keys, 40))
        verify(conn, b.rs, [(k, b.rs.last_lsn) for k in keys])  # redo children are running
    pageserver.kill()
    pageserver.start()
    assert pageserver.http.tenant_status(t)["last_durable_lsn"] == b.rs.last_lsn
    with pageserver.connect(t) as conn:
        verify(conn, b.rs, _all_requests(b.rs, keys))


def test_kill9_during_ingest_stream(pageserver, process_kind):
    pageserver.allowed_errors.extend(CRASH_WARNINGS)
    t = pageserver.create_tenant()
    keys = make_keys(12)
    b = HistoryBuilder(seed=42)
    acked = []  # last LSN of each acknowledged batch, in order
    state = {"inflight": None, "error": None}
    lock = threading.Lock()
    conn = pageserver.connect(t)

    def ingest_forever():
        try:
            while True:
                values = b.batch(keys, 25)
                with lock:
                    state["inflight"] = (values[0][1], values[-1][1])
                durable = conn.ingest(values, timeout=30)
                assert durable == values[-1][1], (durable, values[-1][1])
                with lock:
                    acked.append(durable)
                    state["inflight"] = None
        except TimeoutError as e:
            state["error"] = e
            state["unexpected"] = True
        except (ConnectionClosed, ConnectionError) as e:
            state["error"] = e  # expected: the daemon was killed
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            state["error"] = e
            state["unexpected"] = True

    thread = threading.Thread(target=ingest_forever, daemon=True)
    thread.start()
    wait_until(lambda: len(acked) >= 40 or state["error"], timeout=60, desc="40 acknowledged batches")
    assert not state.get("unexpected"), state["error"]
    pageserver.kill()
    thread.join(30)
    assert not thread.is_alive()
    assert not state.get("unexpected"), state["error"]
    conn.close()
    last_acked = acked[-1]
    inflight = state["inflight"]

    pageserver.start()
    durable = pageserver.http.tenant_status(t)["last_durable_lsn"]
    assert durable >= last_acked
    # all or nothing: the only batch that may be there unacknowledged is the one in flight, whole
    allowed = {last_acked} | ({inflight[1]} if inflight else set())
    assert durable in allowed, f"durable {durable}, last acknowledged {last_acked}, in flight {inflight}"

    rs = b.rs.truncated(durable)
    with pageserver.connect(t) as conn:
        assert conn.hello_ok.last_durable_lsn == durable
        verify(conn, rs, _all_requests(rs, keys), last_durable=durable)
        # the daemon goes on ingesting after recovery
        b2 = HistoryBuilder(seed=43, rs=rs)
        conn.ingest(b2.batch(keys, 25))
        verify(conn, b2.rs, [(k, lsn) for k in keys for lsn in query_lsns(b2.rs, k, limit=4)])


def test_hello_reports_durable_lsn_of_each_tenant(pageserver):
    t1, t2 = pageserver.create_tenant(), pageserver.create_tenant()
    k = make_keys(1)[0]
    with pageserver.connect(t1) as conn:
        assert conn.hello_ok.last_durable_lsn == 0
        conn.ingest([(k, 77, o.RECORD, o.init_page(0))])
    conn = PageConnection(pageserver.pg_addr)
    try:
        assert conn.hello(t1).last_durable_lsn == 77
    finally:
        conn.close()
    with pageserver.connect(t2) as conn:
        assert conn.hello_ok.last_durable_lsn == 0


def test_small_layers_survive_restart(pageserver_factory, process_kind):
    # 1 MiB layers: a few MiB of values are sealed into several immutable layers
    ps = pageserver_factory(walredo_process_kind=process_kind, layer_size="1 MiB")
    t = ps.create_tenant()
    keys = make_keys(40, relnode=12000)
    b = HistoryBuilder(seed=44)
    with ps.connect(t) as conn:
        for _ in range(12):
            conn.ingest(b.batch(keys, 60, image_prob=0.5))
        verify(conn, b.rs, _all_requests(b.rs, keys, limit=6))
    layers = ps.http.tenant_status(t)["storage"]["layers"]
    images = sum(v.kind == o.IMAGE for k in keys for v in b.rs.values[k])
    assert images * 8192 > 2 * 1024 * 1024
    assert layers >= 2, f"{layers} layers after {images} images of 8 KiB with 1 MiB layers"
    ps.restart()
    st = ps.http.tenant_status(t)
    assert st["last_durable_lsn"] == b.rs.last_lsn
    assert st["storage"]["values"] == sum(len(b.rs.lsns(k)) for k in keys)
    with ps.connect(t) as conn:
        verify(conn, b.rs, _all_requests(b.rs, keys, limit=12))


def _active_segment(ps, tenant):
    # docs/storage-format.md: the timeline directory holds the append-only `active.seg`
    segs = [p for p in ps.workdir.rglob("active.seg") if tenant in str(p)]
    assert len(segs) == 1, segs
    return segs[0]


@pytest.mark.parametrize("damage", ["garbage_appended", "last_frame_cut"])
def test_torn_tail_is_cut_and_never_served(pageserver, damage):
    pageserver.allowed_errors.append(r"(?i)torn tail")
    t = pageserver.create_tenant()
    keys = make_keys(6, relnode=12500)
    b = HistoryBuilder(seed=45)
    sizes, lsns = [], []
    seg = _active_segment(pageserver, t)
    with pageserver.connect(t) as conn:
        for _ in range(4):
            lsns.append(conn.ingest(b.batch(keys, 20)))
            sizes.append(seg.stat().st_size)  # the batch's frame is durable once acknowledged
    pageserver.stop()
    assert seg.stat().st_size == sizes[-1]
    if damage == "garbage_appended":
        with open(seg, "ab") as f:
            f.write(bytes(range(256)) * 3)  # a partial frame: bad magic / incomplete
        durable = lsns[-1]
    else:
        os.truncate(seg, sizes[-2] + (sizes[-1] - sizes[-2]) // 2)  # the last frame, torn
        durable = lsns[-2]
    pageserver.start()
    assert pageserver.http.tenant_status(t)["last_durable_lsn"] == durable
    torn = pageserver.http.metrics().value("pageserver_storage_torn_tail_truncations_total")
    assert torn is not None and torn >= 1, torn
    rs = b.rs.truncated(durable)
    with pageserver.connect(t) as conn:
        verify(conn, rs, _all_requests(rs, keys))
        b2 = HistoryBuilder(seed=46, rs=rs)
        conn.ingest(b2.batch(keys, 20))
    pageserver.restart()
    with pageserver.connect(t) as conn:
        verify(conn, b2.rs, _all_requests(b2.rs, keys, limit=6))
