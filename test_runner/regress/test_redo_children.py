"""The redo child processes: a pool per tenant, started on demand (one child until concurrent load
asks for more, up to walredo_pool_max), replaced when one dies, stopped when idle, and never left
behind (alive or zombie) by a tenant delete or a daemon stop."""

import os
import signal
import subprocess
import time

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.http_client import HttpClient
from fixtures.page_client import ErrorReply, PageServiceError
from fixtures.util import proc_info, proc_state, wait_until

KEY = Key.rel_block(7000, 1)
REDO_WARNINGS = [r"(?i)walredo", r"(?i)redo (child|process)"]


def start_child(ps, tenant, lsn=100):
    """Ingest a short chain and read it back, so the tenant has a redo child; return its pid."""
    values = [(KEY, lsn, o.RECORD, o.init_page(0)), (KEY, lsn + 1, o.RECORD, o.insert(b"tuple"))]
    with ps.connect(tenant) as conn:
        conn.ingest(values)
        page = conn.get_page(KEY)
    assert o.tuple_data(page, 1) == b"tuple"
    return current_child(ps, tenant)


def current_child(ps, tenant):
    status = ps.http.tenant_status(tenant)
    proc = status["walredo"]["process"]
    assert proc is not None, f"no redo child after a redo request: {status['walredo']}"
    pid = proc["pid"]
    # Nothing in the daemon sets a spin window yet: a child blocks between requests.
    assert proc["spin_us"] == 0, f"a fresh child has no spin window: {proc}"
    kids = {p.pid: p for p in ps.redo_children()}
    assert pid in kids, f"status names pid {pid}, but the daemon's walredo-proc children are {sorted(kids)}"
    return kids[pid]


def assert_reaped(ps, child, timeout=10):
    """The child is gone, not a zombie of the daemon."""
    wait_until(lambda: proc_state(child) == "gone", timeout=timeout,
               desc=f"redo child {child.pid} to exit and be reaped (state {proc_state(child)})")
    assert not ps.zombie_children(), ps.zombie_children()


def test_tenant_delete_leaves_no_redo_child(pageserver, process_kind):
    doomed, kept = pageserver.create_tenant(), pageserver.create_tenant()
    child = start_child(pageserver, doomed)
    other = start_child(pageserver, kept)
    assert child.pid != other.pid
    conn = pageserver.connect(doomed)

    assert pageserver.http.delete_tenant(doomed) == {}
    # an open connection of the tenant gets shutting_down and is closed
    if not conn.reply_pending(3.0):
        conn.send_get_page(KEY)
    reply = conn.read_reply(timeout=10)
    assert isinstance(reply, ErrorReply) and reply.name == "shutting_down", reply
    conn.wait_closed()
    conn.close()

    assert_reaped(pageserver, child)
    assert pageserver.http.get(f"/v1/tenant/{doomed}").status == 404
    assert doomed not in [t["id"] for t in pageserver.http.list_tenants()]
    with pytest.raises(PageServiceError) as e:
        pageserver.connect(doomed)
    assert e.value.name == "no_such_tenant"
    # the other tenant and its child are untouched
    assert proc_state(other) == "alive"
    with pageserver.connect(kept) as c:
        assert o.tuple_data(c.get_page(KEY), 1) == b"tuple"
    # the id can be used again, starting empty
    pageserver.create_tenant(doomed)
    with pageserver.connect(doomed) as c:
        assert c.hello_ok.last_durable_lsn == 0
        with pytest.raises(PageServiceError) as e:
            c.get_page(KEY)
        assert e.value.name == "not_found"


def test_daemon_stop_leaves_no_redo_child(pageserver_factory, process_kind):
    ps = pageserver_factory(walredo_process_kind=process_kind)
    tenants = [ps.create_tenant(), ps.create_tenant(kind="sync"), ps.create_tenant(kind="async")]
    children = [start_child(ps, t) for t in tenants]
    assert len({c.pid for c in children}) == 3
    conn = ps.connect(tenants[0])  # an open connection does not hold up the stop
    ps.stop()
    for c in children:
        wait_until(lambda c=c: proc_state(c) == "gone", timeout=10,
                   desc=f"redo child {c.pid} to be gone after stop (state {proc_state(c)})")
    conn.close()


def test_daemon_kill9_redo_children_exit(pageserver, process_kind):
    pageserver.allowed_errors.extend(REDO_WARNINGS)
    children = [start_child(pageserver, pageserver.create_tenant()) for _ in range(2)]
    pageserver.kill()
    # the children see EOF on stdin and exit; their new parent reaps them
    for c in children:
        wait_until(lambda c=c: proc_state(c) != "alive", timeout=10,
                   desc=f"redo child {c.pid} to exit after the daemon was killed")


def test_killed_redo_child_is_replaced(pageserver, process_kind):
    pageserver.allowed_errors.extend(REDO_WARNINGS)
    t = pageserver.create_tenant()
    child = start_child(pageserver, t)
    os.kill(child.pid, signal.SIGKILL)

    with pageserver.connect(t) as conn:
        # a request that raced with the death may fail; after that, requests succeed
        failures = []
        deadline = time.monotonic() + 20
        lsn = 200
        while True:
            conn.ingest([(KEY, lsn, o.RECORD, o.insert(b"n%d" % lsn))])
            try:
                page = conn.get_page(KEY, lsn)
                break
            except PageServiceError as e:
                failures.append(e)
                assert e.name == "redo_failed", e
            assert time.monotonic() < deadline, f"no page served after the child was killed: {failures}"
            lsn += 1
        assert len(failures) <= 1, failures
        assert o.read_header(page).lsn == lsn
    assert_reaped(pageserver, child)
    new = current_child(pageserver, t)
    assert new.pid != child.pid
    status = pageserver.http.tenant_status(t)
    assert str(child.pid) in (status["walredo"]["last_exit"] or ""), status["walredo"]


def test_idle_redo_child_is_stopped_and_restarted_on_demand(pageserver_factory, process_kind):
    ps = pageserver_factory(walredo_process_kind=process_kind, walredo_idle_timeout="1 s")
    t = ps.create_tenant()
    child = start_child(ps, t)
    wait_until(lambda: ps.http.tenant_status(t)["walredo"]["process"] is None, timeout=20,
               desc="the idle redo child to be stopped")
    assert_reaped(ps, child)
    with ps.connect(t) as conn:
        conn.ingest([(KEY, 300, o.RECORD, o.insert(b"again"))])
        assert o.tuple_data(conn.get_page(KEY), 2) == b"again"
    new = current_child(ps, t)
    assert new.pid != child.pid
    assert proc_info(new.pid).ppid == ps.pid


def test_one_redo_child_per_tenant(pageserver, process_kind):
    tenants = [pageserver.create_tenant() for _ in range(3)]
    pids = [start_child(pageserver, t).pid for t in tenants]
    assert len(set(pids)) == 3
    # more requests on the same tenant reuse its child
    with pageserver.connect(tenants[0]) as conn:
        for i in range(5):
            conn.ingest([(KEY, 500 + i, o.RECORD, o.insert(b"more"))])
            conn.get_page(KEY)
    assert current_child(pageserver, tenants[0]).pid == pids[0]
    assert len(pageserver.redo_children()) == 3


def test_hung_redo_child_stalls_only_its_own_tenant(pageserver_factory, process_kind):
    """A SIGSTOPped child of tenant A, with GetPages of A waiting on it: tenant B still says
    Hello and gets pages, and the management API answers, long before wal_redo_timeout."""
    ps = pageserver_factory(walredo_process_kind=process_kind, wal_redo_timeout="60 s")
    ps.allowed_errors.extend(REDO_WARNINGS + [r"failed to get a page"])
    hung, healthy = ps.create_tenant(), ps.create_tenant()
    keys = [Key.rel_block(7100, blk) for blk in range(16)]
    with ps.connect(hung) as conn:
        conn.ingest([(k, 100 + i, o.RECORD, o.init_page(0)) for i, k in enumerate(keys)])
        conn.get_page(keys[0])
    child = current_child(ps, hung)
    start_child(ps, healthy)

    os.kill(child.pid, signal.SIGSTOP)
    try:
        # More GetPages waiting on the stopped child than the daemon has executor threads.
        stalled = ps.connect(hung)
        for k in keys[1:]:
            stalled.send_get_page(k)
        assert not stalled.reply_pending(0.5), "a GetPage of the stopped child's tenant was answered"

        started = time.monotonic()
        with ps.connect(healthy, timeout=5) as conn:
            conn.ingest([(KEY, 200, o.RECORD, o.insert(b"still served"))], timeout=5)
            assert o.tuple_data(conn.get_page(KEY, timeout=5), 2) == b"still served"
        status = HttpClient(ps.http_addr, timeout=5).status()
        assert status, status
        took = time.monotonic() - started
        assert took < 5, f"the healthy tenant and the API took {took:.1f} s"
    finally:
        os.kill(child.pid, signal.SIGKILL)
    stalled.close()
    assert_reaped(ps, child)


def test_idle_redo_child_killed_from_outside_is_reaped_at_once(pageserver, process_kind):
    pageserver.allowed_errors.extend(REDO_WARNINGS)
    t = pageserver.create_tenant()
    child = start_child(pageserver, t)
    os.kill(child.pid, signal.SIGKILL)
    # Long before the idle timeout: reaped, and the status no longer names a live child.
    assert_reaped(pageserver, child, timeout=3)
    wait_until(lambda: pageserver.http.tenant_status(t)["walredo"]["process"] is None, timeout=3,
               desc="the status to show no live redo child")
    last_exit = pageserver.http.tenant_status(t)["walredo"]["last_exit"] or ""
    assert str(child.pid) in last_exit and "SIGKILL" in last_exit, last_exit


def _pagebench(ps, *args):
    command = [str(ps.bin.parent / "pagebench"), *args, "--page-service", "%s:%d" % ps.pg_addr,
               "--http", "%s:%d" % ps.http_addr]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{command}:\n{result.stderr}"
    return result


@pytest.mark.parametrize("pool_max", [1, 2])
def test_the_pool_grows_under_concurrent_redo_load_up_to_walredo_pool_max(pageserver_factory, pool_max):
    ps = pageserver_factory(page_cache_size=0, walredo_pool_max=pool_max, compaction="off")
    shape = ["--relations", "1", "--blocks", "64", "--chain-length", "4"]
    _pagebench(ps, "ingest", "--tenant", "pool", *shape)
    seen = set()
    # 8 connections of GetPage, each a redo: more than one request in flight, all the time.
    load = subprocess.Popen([str(ps.bin.parent / "pagebench"), "get-page", "--tenant", "pool", "--connections", "8",
                             "--duration", "4", "--page-service", "%s:%d" % ps.pg_addr,
                             "--http", "%s:%d" % ps.http_addr], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            pool = ps.http.tenant_status("pool")["walredo"]["pool"]
            seen.add(len(pool["children"]))
            assert pool["max_children"] == pool_max
            time.sleep(0.05)
    finally:
        out, err = load.communicate(timeout=60)
    assert load.returncode == 0, err
    assert max(seen) == pool_max, f"pool sizes seen: {sorted(seen)}"
    grows = ps.http.metrics().value("pageserver_wal_redo_pool_resizes_total", direction="grow") or 0
    assert (grows >= 1) if pool_max > 1 else (grows == 0), grows
    # Idle again: the pool gives its extra children back (one per second), and the tenant
    # leaves the per-tenant gauge.
    wait_until(lambda: len(ps.http.tenant_status("pool")["walredo"]["pool"]["children"]) == 1, timeout=10,
               desc="the pool to shrink to one child")
    wait_until(lambda: ps.http.metrics().value("pageserver_wal_redo_pool_extra_children", tenant_id="pool") is None,
               timeout=5, desc="the tenant to leave pageserver_wal_redo_pool_extra_children")
    assert len(ps.redo_children()) == 1
