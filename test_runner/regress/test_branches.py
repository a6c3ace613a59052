"""Timelines and branches (issue 48, docs/http-api.md): a branch of a tenant that follows a
PostgreSQL 15 primary is made at an LSN without copying anything, reads its ancestor's history
there (three levels deep), and an unpatched PostgreSQL started on its base backup answers as the
primary did at that LSN (`pg_dumpall` taken from the primary then), whatever the ancestor stored
later and whatever its GC dropped; branches survive a restart and a kill -9 during their
creation leaves no branch or a whole one.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from fixtures import basebackup
from fixtures.oracle import Key
from fixtures.page_client import PageConnection
from fixtures.postgres import Postgres
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.util import wait_until
from fixtures.waldump import lsn_int, lsn_text

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def primary(tmp_path):
    pg = Postgres(tmp_path / "primary", settings={"autovacuum": "off"}).init().start()
    pg.pgbench("-i", "-s", "1", "-q")
    pg.sql("CREATE TABLE notes (id bigserial PRIMARY KEY, body text)")
    pg.sql("INSERT INTO notes (body) SELECT md5(i::text) FROM generate_series(1, 3000) i")
    yield pg
    pg.stop()


def started_on_backup(ps, tenant, timeline, tmp_path, name, lsn=None):
    tar = tmp_path / f"{name}.tar"
    status, headers, body = basebackup.fetch(ps, tenant, tar, lsn=lsn, timeline=timeline)
    assert status == 200, body
    return basebackup.start_on(tar, tmp_path / name), headers["x-basebackup-lsn"]


def dump_of_backup(ps, tenant, timeline, tmp_path, name, lsn=None) -> str:
    pg, _ = started_on_backup(ps, tenant, timeline, tmp_path, name, lsn)
    try:
        return basebackup.dump(pg)
    finally:
        pg.stop()


def test_branches_answer_as_the_primary_did_at_their_point(primary, pageserver_factory, tmp_path):
    # GC as aggressive as it goes: every pass cuts at the last durable LSN, but for the branches.
    ps = pageserver_factory(gc_horizon=0)
    ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    caught_up(ps, tenant, primary)
    at_point = basebackup.dump(primary)
    point = ps.http.tenant_status(tenant)["last_durable_lsn"]

    made = ps.http.create_timeline(tenant, "b1")
    assert made.status == 201, made
    assert made.body["ancestor_timeline_id"] == "main" and made.body["ancestor_lsn"] == point, made
    assert made.body["durable_lsn"] == point and made.body["storage"]["values"] == 0, "nothing is copied"

    # The primary goes on; the branch does not see it.
    primary.pgbench("-t", "300", "-c", "2", "-n")
    primary.sql("UPDATE notes SET body = 'changed' WHERE id % 3 = 0")
    primary.sql("CREATE TABLE later (id int)")
    caught_up(ps, tenant, primary)
    at_end = basebackup.dump(primary)
    assert at_end != at_point

    # Three levels: b2 of b1 and b3 of b2, at b1's point (by its text form).
    for child, parent in [("b2", "b1"), ("b3", "b2")]:
        made = ps.http.create_timeline(tenant, child, parent, lsn_text(point))
        assert made.status == 201, made
    listed = {t["timeline_id"]: t for t in ps.http.list_timelines(tenant)}
    assert list(listed) == ["main", "b1", "b2", "b3"]
    assert listed["b3"]["ancestor_timeline_id"] == "b2" and listed["b3"]["ancestor_lsn"] == point
    assert listed["main"]["branch_points"] == [point] and listed["b1"]["branch_points"] == [point]

    # GC of main, as far as it may go: it stops at the branch point.
    ps.http.request("POST", f"/v1/tenant/{tenant}/timeline/main/compact")
    gc_cutoff = ps.http.timeline_status(tenant, "main")["gc_cutoff"]
    assert gc_cutoff == point, (gc_cutoff, point)

    # The page service serves a branch named in its Hello (protocol version 2); version 1 means main.
    db = int(primary.sql("select oid from pg_database where datname = 'postgres'"))
    notes = Key(1663, db, int(primary.sql("select pg_relation_filenode('notes')")), 0, 0)
    main_conn, leaf_conn, v1_conn = ps.connect(tenant), ps.connect(tenant, timeline="b3"), PageConnection(ps.pg_addr)
    try:
        v1_conn.hello(tenant, version=1)
        assert v1_conn.hello_ok.last_durable_lsn == ps.http.timeline_status(tenant, "main")["durable_lsn"]
        assert leaf_conn.hello_ok.last_durable_lsn == point
        at_point_page = main_conn.get_page(notes, point)
        assert leaf_conn.get_page(notes) == at_point_page
        assert v1_conn.get_page(notes) == main_conn.get_page(notes) != at_point_page, "rows of it were updated"
    finally:
        for conn in (main_conn, leaf_conn, v1_conn):
            conn.close()

    assert dump_of_backup(ps, tenant, "b3", tmp_path, "on-b3") == at_point
    assert dump_of_backup(ps, tenant, "main", tmp_path, "on-main") == at_end

    # What is refused, and why.
    refused = [
        (ps.http.create_timeline(tenant, "b1"), 409, "already has"),
        (ps.http.create_timeline(tenant, "main"), 409, "already has"),
        (ps.http.create_timeline(tenant, "x", "nope"), 404, "no timeline"),
        (ps.http.create_timeline(tenant, "bad/id"), 400, "invalid timeline id"),
        (ps.http.create_timeline(tenant, "x", "main", point - 8), 410, "GC cutoff"),
        (ps.http.create_timeline(tenant, "x", "main", "FF/0"), 409, "above the last durable LSN"),
        (ps.http.create_timeline("no-such-tenant", "x"), 404, "no tenant"),
        (ps.http.delete_timeline(tenant, "b2"), 409, "has branches (b3)"),
        (ps.http.delete_timeline(tenant, "main"), 409, "delete the tenant"),
        (ps.http.delete_timeline(tenant, "nope"), 404, "no timeline"),
    ]
    for resp, status, words in refused:
        assert resp.status == status and words in resp.body["error"], resp

    # A restart loads them, ancestors first, and they answer the same.
    ps.stop()
    ps.start()
    assert [t["timeline_id"] for t in ps.http.list_timelines(tenant)] == ["main", "b1", "b2", "b3"]
    assert ps.http.timeline_status(tenant, "b2")["ancestor_timeline_id"] == "b1"
    assert dump_of_backup(ps, tenant, "b2", tmp_path, "on-b2") == at_point

    # Leaves go first; then the point is let go and main's GC goes on.
    for leaf in ["b3", "b2", "b1"]:
        assert ps.http.delete_timeline(tenant, leaf).status == 200
    assert ps.http.timeline_status(tenant, "main")["branch_points"] == []
    assert not any(n for n in os.listdir(ps.workdir / "tenants" / tenant / "branches") if not n.startswith(".")), \
        "no branch directory is left"
    primary.sql("INSERT INTO later VALUES (1)")
    caught_up(ps, tenant, primary)
    ps.http.request("POST", f"/v1/tenant/{tenant}/timeline/main/compact")
    assert ps.http.timeline_status(tenant, "main")["gc_cutoff"] > point


def test_a_kill_during_branch_creation_leaves_no_branch_or_a_whole_one(primary, pageserver_factory, tmp_path):
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")
    # A kill between the new branch's active.seg being created and its header being synced
    # leaves an empty file, which recovery recreates (docs/storage-format.md, step 7).
    ps.allowed_errors.append("recreating active.seg with a torn header len=0")
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    caught_up(ps, tenant, primary)
    at_point = basebackup.dump(primary)
    for i, delay in enumerate([0.0, 0.001, 0.003]):
        name = f"k{i}"
        http = ps.http

        def create(http=http, name=name):
            try:
                http.create_timeline(tenant, name)
            except OSError:
                pass  # the daemon died under it

        creating = threading.Thread(target=create, daemon=True)
        creating.start()
        time.sleep(delay)
        ps.kill()
        creating.join(timeout=30)
        ps.start()
        branches = ps.workdir / "tenants" / tenant / "branches"
        if branches.exists():
            assert not [n for n in os.listdir(branches) if n.startswith(".creating-")], "a leftover stayed"
        names = [t["timeline_id"] for t in ps.http.list_timelines(tenant)]
        if name in names:
            assert ps.http.timeline_status(tenant, name)["ancestor_timeline_id"] == "main"
        else:
            # Not there: it can be made now.
            assert ps.http.create_timeline(tenant, name).status == 201
    # Every branch made (before or after a kill) is whole: PostgreSQL starts on the last.
    assert dump_of_backup(ps, tenant, "k2", tmp_path, "on-k2") == at_point


def test_a_branch_takes_writes_from_the_postgresql_started_on_it(primary, pageserver_factory, tmp_path):
    """The PostgreSQL started on a branch's backup is the branch's primary: attached as the
    branch's WAL source, its writes (before and after a crash of it) are in the branch's later
    backups (and survive a restart of the daemon), and never in the parent's."""
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")  # the primaries stop before the daemon
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    caught_up(ps, tenant, primary)
    assert ps.http.create_timeline(tenant, "dev").status == 201
    # A PostgreSQL not started on a branch's backup is refused as its source: main's primary
    # has other WAL where the branch's backup would start.
    assert ps.http.create_timeline(tenant, "wrong").status == 201
    resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/timeline/wrong/wal_source",
                           {"postgres": primary.connstr(), "slot": "wrong"})
    assert resp.status == 200, resp
    primary.sql("INSERT INTO notes (body) VALUES ('after the branch point')")
    refused = wait_until(lambda: (w := ps.http.timeline_status(tenant, "wrong")["wal_source"])["state"] == "error"
                         and w, timeout=60, desc="the wrong source to be refused")
    assert "was not started on the branch's base backup" in refused["error"], refused
    assert ps.http.timeline_status(tenant, "wrong")["storage"]["values"] == 0, "nothing of it was stored"
    assert ps.http.delete_timeline(tenant, "wrong").status == 200
    primary.sql("select pg_drop_replication_slot('wrong')")
    dev_pg, start = started_on_backup(ps, tenant, "dev", tmp_path, "dev")
    try:
        resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/timeline/dev/wal_source",
                               {"postgres": dev_pg.connstr(), "slot": "pageserver"})
        assert resp.status == 200, resp
        dev_pg.sql("CREATE TABLE on_dev (id int PRIMARY KEY, v text)")
        dev_pg.sql("INSERT INTO on_dev SELECT i, md5(i::text) FROM generate_series(1, 5000) i")
        dev_pg.sql("UPDATE notes SET body = 'dev' WHERE id < 500")
        dev_pg.sql("DELETE FROM pgbench_accounts WHERE aid % 10 = 0")
        primary.sql("INSERT INTO notes (body) VALUES ('main only')")

        def branch_caught_up(end: int):
            s = ps.http.timeline_status(tenant, "dev")
            return s["wal_source"] and s["wal_source"]["durable_lsn"] >= end and s
        status = wait_until(lambda: branch_caught_up(lsn_int(dev_pg.lsn())), timeout=120,
                            desc="the branch to catch up with its primary")
        assert status["wal_source"]["resumed_at"] == lsn_int(start), "streamed from the backup's start point"
        # A crash of the branch's primary: it restarts by replaying its own WAL, and the
        # branch goes on following it.
        dev_pg.stop("immediate")
        dev_pg.start()
        assert "redo starts at" in dev_pg.logfile.read_text(), "crash recovery replayed its WAL"
        dev_pg.sql("INSERT INTO on_dev SELECT i, 'after the crash' FROM generate_series(5001, 6000) i")
        wait_until(lambda: branch_caught_up(lsn_int(dev_pg.lsn())), timeout=120,
                   desc="the branch to catch up with its restarted primary")
        on_dev = basebackup.dump(dev_pg)
    finally:
        dev_pg.stop()
    caught_up(ps, tenant, primary)
    on_main = basebackup.dump(primary)
    assert "on_dev" in on_dev and "on_dev" not in on_main and "main only" not in on_dev
    assert dump_of_backup(ps, tenant, "dev", tmp_path, "dev-again") == on_dev
    assert dump_of_backup(ps, tenant, "main", tmp_path, "main-now") == on_main
    ps.stop()
    ps.start()
    assert dump_of_backup(ps, tenant, "dev", tmp_path, "dev-restarted") == on_dev
