"""The initial import of a tenant attached to a PostgreSQL 15 primary: a base backup taken over
the replication connection becomes the tenant's first values, so that it serves every block of
every relation, catalogs and other databases included, as PostgreSQL's own data files hold it,
with every relation fork's size; its history starts at the backup's end (below it: GC cutoff);
an import killed midway begins again and ends the same."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from fixtures.fault_io import FaultIo
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError
from fixtures.postgres import Postgres
from fixtures.util import wait_until
from fixtures.wal_source import attach, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_int

REL_FILE = re.compile(r"^(\d+)(_fsm|_vm|_init)?(?:\.(\d+))?$")
FORK = {None: 0, "_fsm": 1, "_vm": 2, "_init": 3}
RELSEG_BLOCKS = 131072



@pytest.fixture
def pg(tmp_path):
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off"}).init().start()
    yield pg
    pg.stop()


def relation_files(datadir: Path) -> dict:
    """{(spc, db, rel, fork): [bytes of segment 0, 1, ..]} of every relation file of the data
    directory (global/ and base/<db>/)."""
    out: dict = {}
    dirs = [(1664, 0, datadir / "global")] + [(1663, int(d.name), d) for d in (datadir / "base").iterdir() if d.name.isdigit()]
    for spc, db, d in dirs:
        for f in d.iterdir():
            m = REL_FILE.match(f.name)
            if not m:
                continue
            key = (spc, db, int(m.group(1)), FORK[m.group(2)])
            segs = out.setdefault(key, {})
            segs[int(m.group(3) or 0)] = f.read_bytes()
    return {k: b"".join(segs[i] for i in sorted(segs)) for k, segs in out.items()}


def attach_and_import(ps, tenant: str, pg: Postgres) -> dict:
    """Attaches and waits until the WAL reached the backup's end (the tenant's history starts)."""
    attach(ps, tenant, pg)
    return wait_until(lambda: (s := ps.http.tenant_status(tenant)["wal_source"])["durable_lsn"]
                      >= s["import"]["end_lsn"] and s, timeout=120, desc="the WAL to reach the backup's end")


def check_every_block(ps, tenant: str, pg: Postgres) -> int:
    """Every block of every relation fork served at the latest LSN equals the primary's file,
    and every fork's size its file's; returns the blocks compared."""
    pg.sql("CHECKPOINT")
    files = relation_files(pg.datadir)
    assert len(files) > 500, "catalogs of three databases"
    flush = lsn_int(pg.sql("select pg_current_wal_flush_lsn()"))
    wait_until(lambda: ps.http.tenant_status(tenant)["wal_source"]["durable_lsn"] >= flush, timeout=60,
               desc="the tenant to catch up")
    compared = 0
    with ps.connect(tenant) as conn:
        for (spc, db, rel, fork), data in sorted(files.items()):
            blocks = len(data) // 8192
            if blocks == 0:
                assert conn.get_rel_exists((spc, db, rel), fork, flush).exists, (spc, db, rel, fork)
            assert conn.get_rel_size((spc, db, rel), fork, flush).blocks == blocks, (spc, db, rel, fork)
            for blk in range(blocks):
                page = conn.get_page(Key(spc, db, rel, fork, blk), flush)
                assert page == data[blk * 8192:(blk + 1) * 8192], (spc, db, rel, fork, blk)
                compared += 1
    return compared


def test_import_serves_every_block_of_every_relation_as_the_data_files(pg, pageserver_factory):
    pg.pgbench("-i", "-s", "1", "-q")
    pg.sql("CREATE DATABASE other")
    pg.sql("CREATE TABLE o (i int primary key, t text)", db="other")
    pg.sql("INSERT INTO o SELECT i, md5(i::text) FROM generate_series(1, 5000) i", db="other")
    pg.sql("VACUUM", db="other")
    ps = pageserver_factory(compaction="off")
    tenant = ps.create_tenant()
    s = attach_and_import(ps, tenant, pg)
    imp = s["import"]
    assert imp["attempts"] == 1 and imp["start_lsn"] <= imp["end_lsn"] <= s["durable_lsn"], imp
    assert imp["values"] > 3000 and imp["bytes"] >= imp["files"] * 512, imp
    assert check_every_block(ps, tenant, pg) > 3000
    # The history starts at the backup's end.
    with ps.connect(tenant) as conn:
        with pytest.raises(PageServiceError) as e:
            conn.get_page(Key(1664, 0, 1262, 0, 0), imp["start_lsn"] - 1)
        assert e.value.name == "below_gc_cutoff", e.value
    # The cluster's other files are values of their own: pg_control, the relation maps of
    # the shared catalogs and of each database, the pages of pg_xact.
    ks = ps.http.request("GET", f"/v1/tenant/{tenant}/keyspace").body
    meta = {(r["forknum"], r["spcnode"], r["dbnode"]): r["blocks"] for r in ks["relations"] if r["forknum"] >= 0x80}
    assert (0xA0, 0, 0) in meta
    dbs = [int(d) for d in pg.sql("select oid from pg_database").split()]
    assert {(0xA1, 1664, 0)} | {(0xA1, 1663, db) for db in dbs} <= set(meta), meta.keys()
    xact = sum((pg.datadir / "pg_xact" / f).stat().st_size for f in ["0000"]) // 8192
    assert meta[(0x90, 0, 0)] == [[0, xact - 1]], meta[(0x90, 0, 0)]
    # A restart keeps the import: the tenant streams on and still serves every block.
    ps.restart()
    pg.pgbench("-c", "1", "-T", "1", "-n")
    s2 = wait_until(lambda: (w := ps.http.tenant_status(tenant)["wal_source"])["state"] == "streaming" and w,
                    timeout=30, desc="streaming after the restart")
    assert s2["import"]["attempts"] == 1 and s2["import"]["done"]


def test_an_import_killed_midway_begins_again_and_ends_the_same(pg, pageserver_factory):
    pg.pgbench("-i", "-s", "4", "-q")
    ps = pageserver_factory(compaction="off")
    tenant = ps.create_tenant()
    resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/wal_source", {"postgres": pg.connstr(), "slot": "pageserver"})
    assert resp.status == 200, resp
    s = wait_until(lambda: (w := ps.http.tenant_status(tenant)["wal_source"])["import"]
                   and w["import"]["values"] > 500 and w, timeout=60, interval=0.01, desc="the import under way")
    assert not s["import"]["done"], "the kill must come while the import runs"
    # A kill -9 in the middle of a write leaves a torn tail that the restart cuts (and logs).
    ps.allowed_errors.append(r"(?i)torn tail")
    ps.kill()
    # The primary changes meanwhile: the second backup sees the change.
    pg.sql("DELETE FROM pgbench_accounts WHERE aid % 2 = 0")
    pg.sql("VACUUM pgbench_accounts")
    ps.start()
    s = wait_until(lambda: (w := ps.http.tenant_status(tenant)["wal_source"])["state"] == "streaming"
                   and w["import"]["done"] and w, timeout=120, desc="the second import to finish")
    assert s["import"]["attempts"] == 2, s
    assert check_every_block(ps, tenant, pg) > 7000


def refused_while_importing(conn) -> None:
    """Every read of the tenant fails with `import_incomplete`."""
    for read in (lambda: conn.get_page(Key(1664, 0, 1262, 0, 0)),
                 lambda: conn.get_rel_size((1664, 0, 1262), 0),
                 lambda: conn.get_rel_exists((1664, 0, 1262), 0)):
        with pytest.raises(PageServiceError) as e:
            read()
        assert e.value.name == "import_incomplete", e.value


def test_reads_are_refused_while_the_import_is_incomplete_also_after_a_restart(pg, pageserver_factory, tmp_path):
    faults = FaultIo(tmp_path / "faults")
    # Every write of the tenant's storage takes 200 ms longer: the import lasts.
    faults.set("slow_commit")
    ps = pageserver_factory(compaction="off", env=faults.env)
    tenant = ps.create_tenant()
    resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/wal_source", {"postgres": pg.connstr(), "slot": "pageserver"})
    assert resp.status == 200, resp
    wait_until(lambda: (w := ps.http.tenant_status(tenant)["wal_source"])["import"] and w["import"]["values"] > 0,
               timeout=60, interval=0.01, desc="the import under way")
    with ps.connect(tenant) as conn:
        refused_while_importing(conn)
    assert not ps.http.tenant_status(tenant)["wal_source"]["import"]["done"]
    # Interrupted, and the primary is away when the daemon comes back: the import stays undone.
    ps.allowed_errors += [r"(?i)torn tail", r".*WAL receiver.*"]
    ps.kill()
    pg.stop()
    faults.clear("slow_commit")
    ps.start()
    w = ps.http.tenant_status(tenant)["wal_source"]
    assert not w["import"]["done"] and w["import"]["attempts"] == 1, w
    with ps.connect(tenant) as conn:
        refused_while_importing(conn)
    # Once an import is complete, the tenant serves.
    pg.start()
    s = attach_and_import(ps, tenant, pg)
    assert s["import"]["attempts"] == 2, s
    with ps.connect(tenant) as conn:
        assert len(conn.get_page(Key(1664, 0, 1262, 0, 0))) == 8192
        assert conn.get_rel_exists((1664, 0, 1262), 0).exists
