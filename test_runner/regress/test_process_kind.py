"""The redo process kinds (sync, async, auto): chosen by the daemon setting, overridden per tenant,
and switched at runtime under load, round the cycle of kinds, without a failed request."""

import random
import threading

from fixtures import oracle as o
from fixtures.daemon import PROCESS_KINDS, other_kind
from fixtures.oracle import Key
from fixtures.page_client import LATEST
from fixtures.util import proc_state, wait_until
from fixtures.workload import HistoryBuilder, make_keys, verify

KEY = Key.rel_block(8000, 1)


def _redo_once(ps, tenant, lsn):
    with ps.connect(tenant) as conn:
        conn.ingest([(KEY, lsn, o.RECORD, o.init_page(0)), (KEY, lsn + 1, o.RECORD, o.insert(b"t"))])
        assert o.tuple_data(conn.get_page(KEY), 1) == b"t"


def _child(ps, tenant):
    proc = ps.http.tenant_status(tenant)["walredo"]["process"]
    assert proc is not None
    assert proc["pid"] in [c.pid for c in ps.redo_children()], proc
    return proc


def kind_gauges(ps):
    m = ps.http.metrics()
    values = {k: m.value("pageserver_walredo_process_kind", kind=k) for k in PROCESS_KINDS}
    assert all(v is not None for v in values.values()), (
        f"pageserver_walredo_process_kind{{kind=sync|async|auto}} missing: {values}")
    return values


def test_default_process_kind_is_auto(pageserver):
    t = pageserver.create_tenant()
    status = pageserver.http.tenant_status(t)
    assert status["config"].get("walredo_process_kind") is None
    assert status["effective_config"]["walredo_process_kind"] == "auto"
    assert status["walredo"]["process_kind"] == "auto"
    _redo_once(pageserver, t, 10)
    assert _child(pageserver, t)["kind"] == "auto"


def test_daemon_setting_chooses_process_kind(pageserver, process_kind):
    t = pageserver.create_tenant()
    status = pageserver.http.tenant_status(t)
    assert status["effective_config"]["walredo_process_kind"] == process_kind
    _redo_once(pageserver, t, 10)
    proc = _child(pageserver, t)
    assert proc["kind"] == process_kind
    assert proc["requests_served"] >= 1
    assert pageserver.http.tenant_status(t)["walredo"]["requests_served"] >= 1


def test_tenant_override_at_create(pageserver, process_kind):
    other = other_kind(process_kind)
    t = pageserver.create_tenant(kind=other)
    plain = pageserver.create_tenant()
    status = pageserver.http.tenant_status(t)
    assert status["config"]["walredo_process_kind"] == other
    assert status["effective_config"]["walredo_process_kind"] == other
    _redo_once(pageserver, t, 10)
    _redo_once(pageserver, plain, 10)
    assert _child(pageserver, t)["kind"] == other
    assert _child(pageserver, plain)["kind"] == process_kind


def test_runtime_switch_under_load(pageserver_factory):
    # A small page cache, so that most GetPage requests need redo while the kind changes.
    ps = pageserver_factory(walredo_process_kind="async", page_cache_size="1 MiB")
    t = ps.create_tenant()
    keys = make_keys(16, relnode=8100)
    b = HistoryBuilder(seed=61)
    with ps.connect(t) as conn:
        for _ in range(6):
            conn.ingest(b.batch(keys, 60))
    rs = b.rs  # read-only from here on, shared by the reader threads
    candidates = [(k, lsn) for k in keys for lsn in rs.lsns(k)] + [(k, LATEST) for k in keys]

    stop = threading.Event()
    failures = []
    counts = []

    def reader(seed):
        rng = random.Random(seed)
        n = 0
        try:
            with ps.connect(t) as c:
                while not stop.is_set():
                    n += verify(c, rs, rng.sample(candidates, 16), window=8, exact_latest=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(f"reader {seed}: {e!r}")
        counts.append(n)

    # a writer on other keys keeps adding LSNs (and reads its own writes back)
    wkeys = make_keys(4, relnode=8200)
    wb = HistoryBuilder(seed=62, start_lsn=rs.last_lsn + 1)
    wb.rs = rs.copy()

    def writer():
        try:
            with ps.connect(t) as c:
                while not stop.is_set():
                    c.ingest(wb.batch(wkeys, 10))
                    verify(c, wb.rs, [(k, LATEST) for k in wkeys])
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(f"writer: {e!r}")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    threads.append(threading.Thread(target=writer))
    for th in threads:
        th.start()
    try:
        kind = "async"
        for i in range(6):
            old_proc = _child(ps, t) if i else None
            before = kind_gauges(ps)
            previous, kind = kind, other_kind(kind)
            status = ps.http.set_tenant_config(t, {"walredo_process_kind": kind})
            assert status["config"]["walredo_process_kind"] == kind
            assert status["effective_config"]["walredo_process_kind"] == kind

            def switched(kind=kind):
                st = ps.http.tenant_status(t)["walredo"]
                return (st["process_kind"] == kind and st["process"] is not None
                        and st["process"]["kind"] == kind and st["process"]["requests_served"] > 0)

            wait_until(switched, timeout=20, desc=f"a {kind} redo child serving requests")
            proc = _child(ps, t)
            if old_proc is not None:
                assert proc["pid"] != old_proc["pid"]
                old = next((c for c in ps.known_children.values() if c.pid == old_proc["pid"]), None)
                assert old is not None
                # the old child finishes its requests and exits (reaped by the daemon)
                wait_until(lambda old=old: proc_state(old) == "gone", timeout=20,
                           desc=f"the old {previous} child {old.pid} to exit")

            def gauges_moved(before=before, kind=kind, previous=previous):
                now = kind_gauges(ps)
                return now[kind] > before[kind] or now[previous] < before[previous]

            wait_until(gauges_moved, timeout=10,
                       desc=f"pageserver_walredo_process_kind to move towards {kind} (before {before})")
            assert not failures, failures
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    assert not any(th.is_alive() for th in threads), "client threads did not stop"
    assert not failures, "\n".join(failures)
    assert sum(counts) > 100, counts
