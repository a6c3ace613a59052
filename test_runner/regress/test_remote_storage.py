"""Layers in S3-compatible object storage (docs/rfcs/0009-remote-storage.md), against a real S3
server (versitygw) and against a directory (`local_path`): uploads follow seals, a node with an
empty disk attaches a tenant from the bucket and serves every page, a detached tenant's writes
are all in the bucket, a stale node deletes nothing, and wrong credentials stop the daemon at
start; a tenant that follows PostgreSQL moves to a new node and goes on streaming. (A missing or
damaged object, and eviction: test_remote_eviction.py.)"""

import json
import time

import pytest

from fixtures import basebackup
from fixtures.postgres import Postgres
from fixtures.util import wait_until
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture: one writer is enough here)
from fixtures.waldump import lsn_int
from fixtures.workload import HistoryBuilder, make_keys, query_lsns, verify

# Small layers and a short seal timer, so that a few batches make several uploads.
REMOTE = {"layer_size": "64 KiB", "checkpoint_timeout": "300 ms", "compaction": "off"}


def _requests(rs, keys, limit=12):
    return [(k, lsn) for k in keys for lsn in query_lsns(rs, k, limit=limit)]


def _remote_args(kind, s3_server, tmp_path):
    if kind == "s3":
        return [s3_server.remote_storage_setting("pfx/")], s3_server.env()
    return [f'remote_storage={{local_path="{tmp_path / "bucket"}"}}'], {}


def _resume_lsn(s3_server, prefix, tenant):
    """Where a node attaching `tenant` from the bucket resumes streaming: the WAL source
    position in the index of generation 1 of its `main`."""
    index = s3_server.object_path(f"{prefix}/tenants/{tenant}/timelines/main/index_part.json-00000001")
    return json.loads(index.read_text())["metadata"]["wal_source"]["position"]


def _uploaded(ps, tenant, lsn, timeout=30):
    """Waits until the bucket's index covers `lsn`; returns the tenant's remote status."""
    wait_until(lambda: ps.http.tenant_status(tenant)["remote"]["remote_consistent_lsn"] >= lsn,
               timeout=timeout)
    return ps.http.tenant_status(tenant)["remote"]


@pytest.mark.parametrize("kind", ["s3", "local_path"])
def test_a_tenant_outlives_its_node_and_a_detach_keeps_every_write(pageserver_factory, s3_server, tmp_path, kind):
    raw, env = _remote_args(kind, s3_server, tmp_path)
    a = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    t = a.create_tenant()
    keys = make_keys(24)
    b = HistoryBuilder(seed=7)
    with a.connect(t) as conn:
        for _ in range(12):
            conn.ingest(b.batch(keys, 40))
    remote = _uploaded(a, t, b.rs.last_lsn)
    assert remote["generation"] == "00000001"
    assert remote["queued_uploads"] == 0 and remote["remote_layers"] >= 2, remote
    metrics = a.http.metrics()
    assert metrics.value("pageserver_remote_uploaded_layers_total") >= remote["remote_layers"]
    if kind == "s3":
        objects = s3_server.list_objects(f"pfx/tenants/{t}/")
        assert f"pfx/tenants/{t}/generations/00000001" in objects
        assert f"pfx/tenants/{t}/timelines/main/index_part.json-00000001" in objects
        index = json.loads(s3_server.object_path(f"pfx/tenants/{t}/timelines/main/index_part.json-00000001").read_text())
        assert index["disk_consistent_lsn"] == b.rs.last_lsn
        for layer in index["layers"]:
            name = f"pfx/tenants/{t}/timelines/main/{layer['name']}-00000001"
            assert name in objects
            assert s3_server.object_path(name).stat().st_size == layer["size"]

    # The node's disk is lost: kill -9, and a node with an empty disk attaches the tenant.
    a.kill()
    c = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    resp = c.http.request("POST", f"/v1/tenant/{t}/attach")
    assert resp.status == 201, resp
    status = c.http.tenant_status(t)
    assert status["last_durable_lsn"] == b.rs.last_lsn
    assert status["remote"]["generation"] == "00000002"
    with c.connect(t) as conn:
        verify(conn, b.rs, _requests(b.rs, keys))
        for _ in range(4):
            conn.ingest(b.batch(keys, 40))
    # Attaching again where it is attached is refused.
    assert c.http.request("POST", f"/v1/tenant/{t}/attach").status == 409

    # Detach: everything durable is uploaded first, then the tenant is gone from the node.
    resp = c.http.request("POST", f"/v1/tenant/{t}/detach")
    assert resp.status == 200, resp
    assert c.http.request("GET", f"/v1/tenant/{t}").status == 404
    assert not (c.workdir / "tenants" / t).exists()
    d = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    assert d.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
    assert d.http.tenant_status(t)["remote"]["generation"] == "00000003"
    with d.connect(t) as conn:
        verify(conn, b.rs, _requests(b.rs, keys))
    # A restart keeps the generation (it is no attach).
    d.restart()
    assert d.http.tenant_status(t)["remote"]["generation"] == "00000003"
    # A tenant the bucket does not hold, and attach without a bucket, are refused.
    assert d.http.request("POST", "/v1/tenant/nosuch/attach").status == 404
    plain = pageserver_factory()
    assert plain.http.request("POST", f"/v1/tenant/{t}/attach").status == 400


def test_a_stale_node_deletes_nothing_the_newer_node_reads(pageserver_factory, s3_server):
    raw, env = [s3_server.remote_storage_setting()], s3_server.env()
    old = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    old.allowed_errors.append("another node attached this tenant")
    t = old.create_tenant()
    keys = make_keys(16)
    b = HistoryBuilder(seed=11)
    with old.connect(t) as conn:
        for _ in range(8):
            conn.ingest(b.batch(keys, 40))
    _uploaded(old, t, b.rs.last_lsn)

    # A newer node attaches while the old one runs on.
    new = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    assert new.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
    objects_at_attach = set(s3_server.list_objects(f"tenants/{t}/timelines/"))
    newer = HistoryBuilder(seed=12, rs=b.rs.copy())
    with new.connect(t) as conn:
        for _ in range(4):
            conn.ingest(newer.batch(keys, 40))
    _uploaded(new, t, newer.rs.last_lsn)

    # The old node keeps writing and compacts: its uploads carry its generation, and the
    # layers its compaction replaced are not deleted (the newer node's index lists them).
    stale_history = HistoryBuilder(seed=13, rs=b.rs.copy())
    with old.connect(t) as conn:
        for _ in range(4):
            conn.ingest(stale_history.batch(keys, 40))
    assert old.http.request("POST", f"/v1/tenant/{t}/compact").status == 200
    wait_until(lambda: old.http.tenant_status(t)["remote"]["stale"], timeout=30)
    remaining = set(s3_server.list_objects(f"tenants/{t}/timelines/"))
    assert objects_at_attach <= remaining, objects_at_attach - remaining
    assert old.http.tenant_status(t)["remote"]["queued_deletions"] > 0

    # A third node reads everything the newer node wrote, and nothing of the stale one's.
    third = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    assert third.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
    with third.connect(t) as conn:
        verify(conn, newer.rs, _requests(newer.rs, keys))


def test_wrong_credentials_stop_the_daemon_at_start(pageserver_factory, s3_server):
    env = dict(s3_server.env(), AWS_SECRET_ACCESS_KEY="wrong")
    d = pageserver_factory(start=False, raw_args=[s3_server.remote_storage_setting()], env=env)
    d.allowed_errors.append("pageserver failed: load tenants: remote storage")
    code, out = d.run_expect_failure()
    assert code != 0
    assert "remote storage" in out and "refused a listing" in out, out


def test_a_tenant_following_postgres_moves_to_a_node_with_an_empty_disk(pageserver_factory, s3_server, tmp_path):
    """The slot is told no more than the bucket holds; after the node's disk is lost, a new
    node attaches, streams the rest from the slot, and a PostgreSQL started on its base backup
    answers as the primary does."""
    pg = Postgres(tmp_path / "primary", settings={"autovacuum": "off"}).init().start()
    try:
        pg.pgbench("-i", "-s", "1", "-q")
        raw, env = [s3_server.remote_storage_setting("p")], s3_server.env()
        # No seal by time: nothing is uploaded until the compaction asked for below.
        a = pageserver_factory(raw_args=raw, env=env, checkpoint_timeout="1 h", compaction="off")
        a.allowed_errors.append(".*WAL receiver.*")
        t = a.create_tenant()
        attach(a, t, pg)
        pg.pgbench("-t", "300", "-c", "2", "-n")
        caught_up(a, t, pg)
        assert a.http.tenant_status(t)["remote"]["remote_consistent_lsn"] == 0

        def reported():
            row = pg.sql("select coalesce(flush_lsn, '0/0') from pg_stat_replication").strip()
            return lsn_int(row) if row else 0
        # Streamed and durable here, but not in the bucket: the slot is not told.
        time.sleep(2.5)
        assert reported() == 0
        mark = lsn_int(pg.lsn())
        pg.sql("INSERT INTO pgbench_history (tid, bid, aid, delta) VALUES (1, 1, 1, 1)")
        caught_up(a, t, pg)
        assert a.http.request("POST", f"/v1/tenant/{t}/compact").status == 200
        _uploaded(a, t, mark)
        uploaded = a.http.tenant_status(t)["remote"]["remote_consistent_lsn"]
        wait_until(lambda: reported() >= mark, timeout=30, desc="the slot to be told")
        assert reported() <= _resume_lsn(s3_server, "p", t), uploaded

        # The node's disk is lost; the primary goes on.
        a.kill()
        pg.pgbench("-t", "200", "-c", "2", "-n")
        b = pageserver_factory(raw_args=raw, env=env, checkpoint_timeout="1 s")
        b.allowed_errors.append(".*WAL receiver.*")
        assert b.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
        wait_until(lambda: b.http.tenant_status(t)["wal_source"]["state"] == "streaming", timeout=60)
        caught_up(b, t, pg)
        expected = basebackup.dump(pg)
        tar = tmp_path / "b.tar"
        status, _, body = basebackup.fetch(b, t, tar)
        assert status == 200, body
        copy = basebackup.start_on(tar, tmp_path / "copy")
        try:
            assert basebackup.dump(copy) == expected
        finally:
            copy.stop()
    finally:
        pg.stop()


@pytest.mark.timeout(180)
def test_a_primary_stops_at_once_and_its_shutdown_checkpoint_is_in_the_bucket(pageserver_factory, s3_server,
                                                                              tmp_path):
    """A fast shutdown of PostgreSQL waits until the standby reports its WAL flushed up to the
    shutdown checkpoint, and with remote storage the daemon reports no more than the bucket's
    index resumes from. The shutdown checkpoint has the daemon seal and upload at once (the
    seal timer here is an hour away), so the primary stops within `pg_ctl`'s wait, and a node
    attaching from the bucket resumes after the checkpoint. (Before, the flush reported stopped
    at the last value's LSN, short of the WAL's 8-byte aligned end, and `pg_ctl` gave up.)"""
    pg = Postgres(tmp_path / "primary", settings={"autovacuum": "off"}).init().start()
    try:
        raw, env = [s3_server.remote_storage_setting("p")], s3_server.env()
        ps = pageserver_factory(raw_args=raw, env=env, checkpoint_timeout="1 h", compaction="off")
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        t = ps.create_tenant()
        attach(ps, t, pg)
        pg.sql("CREATE TABLE t (id int PRIMARY KEY)")
        pg.sql("INSERT INTO t SELECT generate_series(1, 1000)")
        # An index in the bucket (a pass seals the active segment), then values not in it: the
        # flush reported is valid and behind (with none, PostgreSQL takes the write position).
        caught_up(ps, t, pg)
        assert ps.http.request("POST", f"/v1/tenant/{t}/compact").status == 200
        wait_until(lambda: ps.http.tenant_status(t)["remote"]["remote_layers"] > 0, timeout=30,
                   desc="an index in the bucket")
        pg.sql("INSERT INTO t SELECT generate_series(1001, 2000)")
        caught_up(ps, t, pg)
        out = pg.run("pg_ctl", "-D", str(pg.datadir), "-m", "fast", "-w", "-t", "60", "stop", check=False)
        assert out.returncode == 0, f"the primary did not stop: {out.stdout} {out.stderr}"
        pg.started = False
        checkpoint = lsn_int(pg.controldata()["Latest checkpoint location"])
        assert pg.controldata()["Database cluster state"] == "shut down"
        assert _resume_lsn(s3_server, "p", t) > checkpoint
    finally:
        pg.stop()


def test_branches_move_with_their_tenant(pageserver_factory, s3_server):
    """A branch's index carries its ancestor and branch point: the attached tenant serves the
    branch (its own writes over its parent's history at the point) beside `main`."""
    raw, env = [s3_server.remote_storage_setting()], s3_server.env()
    a = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    t = a.create_tenant()
    keys = make_keys(16)
    main = HistoryBuilder(seed=31)
    with a.connect(t) as conn:
        for _ in range(6):
            conn.ingest(main.batch(keys, 40))
        at_point = main.rs.copy()
        for _ in range(3):
            conn.ingest(main.batch(keys, 40))
    point = at_point.last_lsn
    resp = a.http.create_timeline(t, "dev", ancestor_start_lsn=point)
    assert resp.status == 201, resp
    dev = HistoryBuilder(seed=32, rs=at_point)
    with a.connect(t, timeline="dev") as conn:
        for _ in range(4):
            conn.ingest(dev.batch(keys, 40))
    _uploaded(a, t, main.rs.last_lsn)
    wait_until(lambda: a.http.timeline_status(t, "dev")["remote"]["remote_consistent_lsn"] >= dev.rs.last_lsn,
               timeout=30)
    assert f"tenants/{t}/timelines/dev/index_part.json-00000001" in s3_server.list_objects(f"tenants/{t}/")

    a.kill()
    c = pageserver_factory(raw_args=raw, env=env, **REMOTE)
    assert c.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
    status = c.http.timeline_status(t, "dev")
    assert (status["ancestor_timeline_id"], status["ancestor_lsn"]) == ("main", point)
    with c.connect(t) as conn:
        verify(conn, main.rs, _requests(main.rs, keys))
    with c.connect(t, timeline="dev") as conn:
        verify(conn, dev.rs, _requests(dev.rs, keys))
