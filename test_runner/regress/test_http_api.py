"""The management API (docs/http-api.md): tenants, their status and config, errors, metrics."""

import os
import re
import shutil
import subprocess

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError

KEY = Key.rel_block(10000, 1)


def _error(resp, status):
    assert resp.status == status, resp
    assert isinstance(resp.body, dict) and isinstance(resp.body.get("error"), str) and resp.body["error"], resp


def test_status(pageserver):
    st = pageserver.http.status()
    assert isinstance(st["version"], str) and st["version"]
    assert st["tenants"] == 0
    pageserver.create_tenant()
    assert pageserver.http.status()["tenants"] == 1


def test_tenant_lifecycle(pageserver):
    http = pageserver.http
    assert http.list_tenants() == []
    created = http.create_tenant("beta")
    assert created["id"] == "beta"
    assert created["last_durable_lsn"] == 0
    assert created["walredo"]["process"] is None  # no child before the first redo
    http.create_tenant("alpha", {"walredo_process_kind": "sync"})
    http.create_tenant("Gamma_9-x")
    ids = [t["id"] for t in http.list_tenants()]
    assert ids == sorted(["beta", "alpha", "Gamma_9-x"])
    st = http.tenant_status("alpha")
    assert st["config"]["walredo_process_kind"] == "sync"
    assert st["effective_config"]["walredo_process_kind"] == "sync"
    for field in ("storage", "counters", "walredo"):
        assert isinstance(st[field], dict), st
    assert set(st["storage"]) >= {"keys", "values", "layers", "runs", "disk_bytes"}
    assert set(st["counters"]) >= {"get_page_requests", "ingest_batches", "ingested_values"}

    # status follows the data
    with pageserver.connect("alpha") as conn:
        conn.ingest([(KEY, 10, o.RECORD, o.init_page(0)), (KEY, 11, o.RECORD, o.insert(b"a")),
                     (Key.rel_block(10000, 2), 11, o.IMAGE, bytes(8192))])
        conn.get_page(KEY)
        conn.get_page(KEY, 10)
    st = http.tenant_status("alpha")
    assert st["last_durable_lsn"] == 11
    assert st["storage"]["keys"] == 2
    assert st["storage"]["values"] == 3
    assert st["counters"] == {**st["counters"], "get_page_requests": 2, "ingest_batches": 1, "ingested_values": 3}
    assert st["walredo"]["process"]["kind"] == "sync"

    assert http.delete_tenant("beta") == {}
    assert [t["id"] for t in http.list_tenants()] == sorted(["alpha", "Gamma_9-x"])
    assert http.status()["tenants"] == 2


def test_tenant_errors(pageserver):
    http = pageserver.http
    pageserver.create_tenant("exists")
    _error(http.get("/v1/tenant/nope"), 404)
    _error(http.request("DELETE", "/v1/tenant/nope"), 404)
    _error(http.request("PUT", "/v1/tenant/nope/config", {"walredo_process_kind": "sync"}), 404)
    _error(http.request("POST", "/v1/tenant", {"id": "exists"}), 409)
    # the failed create changed nothing
    assert [t["id"] for t in http.list_tenants()] == ["exists"]


@pytest.mark.parametrize(
    "body",
    [
        {"id": ""},
        {"id": "x" * 65},
        {"id": "has space"},
        {"id": "dot.ted"},
        {"id": "slash/ed"},
        {"id": "ünïcode"},
        {"id": 42},
        {},
        {"id": "ok", "config": {"walredo_process_kind": "fast"}},
        {"id": "ok", "config": {"walredo_process_kind": 1}},
        {"id": "ok", "config": "sync"},
    ],
    ids=["empty", "too_long", "space", "dot", "slash", "unicode", "number", "no_id", "bad_kind",
         "kind_not_string", "config_not_object"],
)
def test_create_tenant_bad_request(pageserver, body):
    _error(pageserver.http.request("POST", "/v1/tenant", body), 400)
    assert pageserver.http.list_tenants() == []


def test_create_tenant_malformed_json(pageserver):
    _error(pageserver.http.request("POST", "/v1/tenant", raw=b"{not json"), 400)
    assert pageserver.http.list_tenants() == []


def test_tenant_id_of_64_chars_is_accepted(pageserver):
    tid = "a" * 64
    pageserver.http.create_tenant(tid)
    with pageserver.connect(tid) as conn:
        assert conn.hello_ok.last_durable_lsn == 0


def test_put_config(pageserver):
    http = pageserver.http
    t = pageserver.create_tenant()
    st = http.set_tenant_config(t, {"walredo_process_kind": "sync"})
    assert st["config"]["walredo_process_kind"] == "sync"
    assert st["effective_config"]["walredo_process_kind"] == "sync"
    assert st["walredo"]["process_kind"] == "sync"
    # null falls back to the daemon's setting (auto by default)
    st = http.set_tenant_config(t, {"walredo_process_kind": None})
    assert st["config"].get("walredo_process_kind") is None
    assert st["effective_config"]["walredo_process_kind"] == "auto"
    http.set_tenant_config(t, {"walredo_process_kind": "sync"})
    # absent also falls back: the body replaces the overrides
    st = http.set_tenant_config(t, {})
    assert st["effective_config"]["walredo_process_kind"] == "auto"
    assert http.tenant_status(t)["effective_config"]["walredo_process_kind"] == "auto"


@pytest.mark.parametrize(
    "raw",
    [b'{"walredo_process_kind": "fast"}', b'{"walredo_process_kind": 3}', b"[1]", b"nope"],
    ids=["bad_kind", "kind_not_string", "not_object", "not_json"],
)
def test_put_config_bad_body(pageserver, raw):
    t = pageserver.create_tenant(kind="sync")
    _error(pageserver.http.request("PUT", f"/v1/tenant/{t}/config", raw=raw), 400)
    st = pageserver.http.tenant_status(t)
    assert st["effective_config"]["walredo_process_kind"] == "sync"


def test_delete_tenant_removes_data(pageserver):
    t = pageserver.create_tenant()
    with pageserver.connect(t) as conn:
        conn.ingest([(KEY, 10, o.RECORD, o.init_page(0))])
    before = sorted(p.name for p in pageserver.workdir.rglob("*") if t in p.name)
    assert before, "the tenant has no files named after it in the work dir"
    pageserver.http.delete_tenant(t)
    left = [p for p in pageserver.workdir.rglob("*") if t in str(p.relative_to(pageserver.workdir))]
    assert not left, left
    pageserver.restart()
    _error(pageserver.http.get(f"/v1/tenant/{t}"), 404)
    with pytest.raises(PageServiceError) as e:
        pageserver.connect(t)
    assert e.value.name == "no_such_tenant"


METRIC_PREFIXES = ["pageserver_wal_redo_", "pageserver_storage_", "pageserver_page_cache_",
                   "pageserver_page_service_"]


def test_metrics(pageserver):
    t = pageserver.create_tenant()
    with pageserver.connect(t) as conn:
        conn.ingest([(KEY, 10, o.RECORD, o.init_page(0)), (KEY, 11, o.RECORD, o.insert(b"m"))])
        conn.get_page(KEY)
        conn.get_page(KEY)
    resp = pageserver.http.get("/metrics")
    assert resp.status == 200
    ctype = next(v for k, v in resp.headers.items() if k.lower() == "content-type")
    assert ctype.replace(" ", "").startswith("text/plain;version=0.0.4"), ctype
    m = pageserver.http.metrics()
    names = m.names()
    # ours are prefixed pageserver_; process_* are the standard ones every exporter has
    ours = [n for n in names if not n.startswith("process_")]
    assert all(n.startswith("pageserver_") for n in ours), sorted(n for n in ours if not n.startswith("pageserver_"))
    for prefix in METRIC_PREFIXES:
        assert any(n.startswith(prefix) for n in names), f"no metric family {prefix}*: {sorted(names)}"
    assert m.value("pageserver_walredo_process_kind", kind="async") is not None
    assert m.value("pageserver_walredo_process_kind", kind="sync") is not None
    # families declare their type
    for name in names:
        base = name
        for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
            if base.endswith(suffix) and base[: -len(suffix)] in m.types:
                base = base[: -len(suffix)]
        assert base in m.types or name in m.types, f"{name} has no # TYPE line"


@pytest.mark.parametrize("path", ["/nope", "/v1/tenants", "/v1/tenant/t1/nope", "/metrics/extra"])
def test_unknown_route_answers_a_json_404(pageserver, path):
    for method in ("GET", "POST", "DELETE"):
        _error(pageserver.http.request(method, path), 404)


@pytest.mark.parametrize("method,path", [("POST", "/v1/status"), ("DELETE", "/v1/tenant"),
                                         ("POST", "/v1/tenant/t1"), ("GET", "/v1/tenant/t1/config"),
                                         ("PUT", "/metrics")])
def test_wrong_method_answers_a_json_405_with_allow(pageserver, method, path):
    resp = pageserver.http.request(method, path)
    _error(resp, 405)
    allow = next((v for k, v in resp.headers.items() if k.lower() == "allow"), "")
    assert allow, resp.headers


def _git_commit_of_tree() -> str | None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def test_version_status_and_build_info_carry_the_git_commit(pageserver, bin_dir):
    commit = pageserver.http.status()["git_commit"]
    assert re.fullmatch(r"[0-9a-f]{7,40}|unknown", commit), commit
    version = subprocess.run([str(bin_dir / "pageserver"), "--version"], capture_output=True, text=True,
                             timeout=30)
    assert version.returncode == 0, version.stderr
    assert commit in version.stdout, version.stdout
    m = pageserver.http.metrics()
    assert m.value("pageserver_build_info", git_commit=commit) == 1.0, m.names()
    tree = _git_commit_of_tree()
    if tree is not None:
        # built from this checkout: the commit is known (it may be an ancestor of HEAD when
        # the binary is older than the last commit, so only check that it is not "unknown")
        assert commit != "unknown"


PROCESS_METRICS = ["process_cpu_seconds_total", "process_open_fds", "process_max_fds",
                   "process_virtual_memory_bytes", "process_resident_memory_bytes",
                   "process_start_time_seconds", "process_threads"]


def test_standard_process_metrics_are_exported(pageserver):
    import time
    m = pageserver.http.metrics()
    for name in PROCESS_METRICS:
        assert m.value(name) is not None, f"no {name}: {sorted(m.names())}"
    assert m.value("process_open_fds") >= 3
    assert m.value("process_max_fds") >= m.value("process_open_fds")
    assert m.value("process_resident_memory_bytes") > 1 << 20
    # the heap in use is part of the resident memory; what is free is kept for reuse
    assert 0 < m.value("pageserver_heap_in_use_bytes") < m.value("process_virtual_memory_bytes")
    assert m.value("pageserver_heap_free_bytes") >= 0
    assert 1 <= m.value("process_threads") < 1000
    started = m.value("process_start_time_seconds")
    assert time.time() - 3600 < started <= time.time() + 1, started


def test_executor_metrics_follow_the_work(pageserver):
    """The async runtime's figures: its workers, and busy time and parks that grow as requests
    are served (each request on an idle daemon wakes a worker that then sleeps again)."""
    import os
    t = pageserver.create_tenant()
    before = pageserver.http.metrics()
    workers = before.value("pageserver_executor_workers")
    # tokio's default: one worker per CPU the daemon may use (fewer under a cgroup CPU quota)
    assert 1 <= workers <= len(os.sched_getaffinity(pageserver.proc.pid)), workers
    with pageserver.connect(t) as conn:
        conn.ingest([(KEY, 10, o.RECORD, o.init_page(0)), (KEY, 11, o.RECORD, o.insert(b"x"))])
        for _ in range(50):
            conn.get_page(KEY)
    after = pageserver.http.metrics()
    parks = after.value("pageserver_executor_parks_total") - before.value("pageserver_executor_parks_total")
    busy = (after.value("pageserver_executor_busy_seconds_total")
            - before.value("pageserver_executor_busy_seconds_total"))
    assert parks >= 50, parks
    assert busy > 0, busy
    assert after.value("pageserver_executor_alive_tasks") >= 1
    assert after.value("pageserver_executor_global_queue_depth") >= 0


def test_metrics_pass_promtool_check(pageserver):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/test installs it (Debian package prometheus)"
    t = pageserver.create_tenant()
    with pageserver.connect(t) as conn:
        conn.ingest([(KEY, 10, o.RECORD, o.init_page(0)), (KEY, 11, o.RECORD, o.insert(b"m"))])
        conn.get_page(KEY)
    text = pageserver.http.metrics_text()
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, f"promtool check metrics:\n{result.stdout}{result.stderr}"


def test_listen_addresses_accept_host_names(pageserver_factory):
    ps = pageserver_factory(raw_args=['listen_pg_addr="localhost:0"', 'listen_http_addr="localhost:0"'])
    assert ps.http.status()["tenants"] == 0
    t = ps.create_tenant()
    with ps.connect(t) as conn:
        conn.ingest([(KEY, 10, o.RECORD, o.init_page(0))])


def test_keyspace(pageserver):
    http = pageserver.http
    t = pageserver.create_tenant()
    empty = _ok_json(http.get(f"/v1/tenant/{t}/keyspace"))
    assert empty == {"tenant_id": t, "last_durable_lsn": 0, "keys": 0, "lsn_range": None, "relations": []}
    with pageserver.connect(t) as conn:
        conn.ingest([(Key.rel_block(10000, 0), 10, o.IMAGE, bytes(8192)),
                     (Key.rel_block(10000, 1), 11, o.RECORD, o.init_page(0)),
                     (Key.rel_block(10000, 2), 12, o.IMAGE, bytes(8192)),
                     (Key.rel_block(10000, 5), 13, o.IMAGE, bytes(8192)),
                     (Key.rel_block(10001, 0), 14, o.IMAGE, bytes(8192))])
        conn.ingest([(Key.rel_block(10000, 0), 20, o.RECORD, o.insert(b"x"))])
    ks = _ok_json(http.get(f"/v1/tenant/{t}/keyspace"))
    assert ks["keys"] == 5
    assert ks["last_durable_lsn"] == 20
    assert ks["lsn_range"] == {"first": 10, "all_keys_from": 14, "last": 20}
    k = Key.rel_block(10000, 0)
    rel = {"spcnode": k.spcnode, "dbnode": k.dbnode, "forknum": k.forknum}
    assert ks["relations"] == [{**rel, "relnode": 10000, "blocks": [[0, 2], [5, 5]]},
                               {**rel, "relnode": 10001, "blocks": [[0, 0]]}]
    _error(http.get("/v1/tenant/nope/keyspace"), 404)


def _ok_json(resp):
    assert resp.status == 200, resp
    return resp.body
