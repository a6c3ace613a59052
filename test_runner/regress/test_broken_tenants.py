"""A tenant whose files are damaged loads as **broken**; the daemon and every other tenant serve.

Damage: a corrupted sealed layer, and a `tenant.toml` that does not parse. A broken tenant shows
in `GET /v1/tenant/{id}` and `/v1/tenant` with `state: "broken"` and the reason, is counted in
`pageserver_tenants{state="broken"}`, refuses Hello with `tenant_broken`, and can be deleted.
"""

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import ErrorReply, PageServiceError

K = Key.rel_block(7000, 1)
BROKEN_LOG = [r"tenant .* is broken", r"failed to load tenant"]


def _fill_until_sealed(pageserver, tenant: str) -> None:
    conn = pageserver.connect(tenant)
    lsn = 0x100
    for blk in range(24):  # 24 images of 8 KiB: more than one 64 KiB layer
        lsn += 1
        conn.ingest([(Key.rel_block(7001, blk), lsn, o.IMAGE, bytes([blk]) * o.PAGE_SIZE)])
    conn.close()
    layers = pageserver.http.tenant_status(tenant)["storage"]["layers"]
    assert layers >= 1, f"no layer was sealed: {layers}"


def test_damaged_tenants_load_broken_and_others_serve(pageserver_factory):
    ps = pageserver_factory(layer_size="64 KiB")
    ps.allowed_errors += BROKEN_LOG
    good, bad_layer, bad_toml = (ps.create_tenant(f"{name}") for name in ("good", "badlayer", "badtoml"))
    rs = o.RecordSet()
    values = [(K, 10, o.RECORD, o.init_page(0)), (K, 20, o.RECORD, o.insert(b"hello"))]
    rs.add_batch(values)
    with ps.connect(good) as conn:
        assert conn.ingest(values) == 20
    _fill_until_sealed(ps, bad_layer)
    ps.stop()

    layer = sorted(ps.timeline_dir(bad_layer).glob("layer_*.layer"))[0]
    raw = bytearray(layer.read_bytes())
    raw[-60:] = b"\xee" * 60  # the footer
    layer.write_bytes(bytes(raw))
    (ps.workdir / "tenants" / bad_toml / "tenant.toml").write_text("walredo_process_kind = [[[\n")

    ps.start()  # the old daemon refused to start here

    statuses = {t["id"]: t for t in ps.http.list_tenants()}
    assert set(statuses) == {good, bad_layer, bad_toml}, statuses
    assert statuses[good]["state"] == "active", statuses[good]
    for broken in (bad_layer, bad_toml):
        status = ps.http.tenant_status(broken)
        assert status["state"] == "broken", status
        assert status["broken_reason"], status
        assert statuses[broken]["state"] == "broken"
    assert "tenant.toml" in ps.http.tenant_status(bad_toml)["broken_reason"]
    metrics = ps.http.metrics()
    assert metrics.value("pageserver_tenants", state="active") == 1
    assert metrics.value("pageserver_tenants", state="broken") == 2

    for broken in (bad_layer, bad_toml):
        conn = ps.raw_connection()
        try:
            conn.hello(broken)
            raise AssertionError(f"Hello for broken tenant {broken} was accepted")
        except PageServiceError as e:
            assert e.name == "tenant_broken", e
        conn.wait_closed()
        conn.close()

    with ps.connect(good) as conn:
        assert conn.get_page(K) == rs.get_page(K, 20)
        more = [(K, 30, o.RECORD, o.insert(b"more"))]
        rs.add_batch(more)
        assert conn.ingest(more) == 30
        assert conn.get_page(K) == rs.get_page(K, 30)

    # a broken tenant can be deleted, and stays deleted
    ps.http.delete_tenant(bad_layer)
    assert ps.http.get(f"/v1/tenant/{bad_layer}").status == 404
    assert not (ps.workdir / "tenants" / bad_layer).exists()
    assert ps.http.metrics().value("pageserver_tenants", state="broken") == 1
    ps.restart()
    assert {t["id"]: t["state"] for t in ps.http.list_tenants()} == {good: "active", bad_toml: "broken"}
    # and the id can be used again
    ps.create_tenant(bad_layer)
    with ps.connect(bad_layer) as conn:
        assert conn.hello_ok.last_durable_lsn == 0


def test_broken_tenant_does_not_block_creating_or_serving_others(pageserver_factory):
    ps = pageserver_factory()
    ps.allowed_errors += BROKEN_LOG
    bad = ps.create_tenant("bad")
    ps.stop()
    (ps.workdir / "tenants" / bad / "tenant.toml").write_text("no_such_key = 1\n")
    ps.start()
    other = ps.create_tenant()
    with ps.connect(other) as conn:
        assert conn.ingest([(K, 5, o.RECORD, o.init_page(0))]) == 5
    # the broken tenant's id is taken until it is deleted
    resp = ps.http.request("POST", "/v1/tenant", {"id": bad})
    assert resp.status == 409, resp
    resp = ps.http.request("PUT", f"/v1/tenant/{bad}/config", {"walredo_process_kind": "sync"})
    assert resp.status == 409, resp
    assert "broken" in resp.body["error"], resp
