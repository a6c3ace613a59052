"""The shutdown oracle (issue 48): a primary stopped cleanly writes everything to its data
directory at its shutdown checkpoint; the pageserver's base backup at that checkpoint (the end of
its record) must be that data directory:

- the SLRU files (`pg_xact`, `pg_multixact/offsets`, `pg_multixact/members`), every
  `pg_filenode.map` and `pg_twophase/` byte for byte;
- every block of every relation file, under PostgreSQL's masks for its access method (the
  free space maps left out: PostgreSQL rebuilds them; a visibility-map page may lack a bit the
  primary has, never have one it lacks, and a map page PostgreSQL added without WAL may be
  missing; a sequence's page may be logged ahead; an unlogged relation's main fork is a copy of
  its init fork; trailing pages PostgreSQL added without WAL are all zeros);
- `pg_control`'s checkpoint counters (`pg_controldata` of both).
"""

from __future__ import annotations

import shutil
import tarfile

import pytest

from fixtures import basebackup
from fixtures.pgmask import BY_ACCESS_METHOD, seq_mask
from fixtures.postgres import Postgres
from fixtures.redo_check import FORK_SUFFIX, file_pages, map_bits_lacking, relations, sequence_logged_ahead
from fixtures.util import wait_until
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_int

pytestmark = pytest.mark.timeout(300)

COUNTERS = ["NextXID", "NextOID", "NextMultiXactId", "NextMultiOffset", "oldestXID", "oldestXID's DB",
            "oldestMultiXid", "oldestMulti's DB", "full_page_writes", "TimeLineID"]
SLRU_DIRS = ["pg_xact", "pg_multixact/offsets", "pg_multixact/members", "pg_twophase"]


class Dir:
    """A data directory that is no running server (what `file_pages` reads)."""

    def __init__(self, datadir):
        self.datadir = datadir


def workload(pg: Postgres) -> None:
    pg.pgbench("-i", "-s", "1", "-q")
    pg.pgbench("-t", "300", "-c", "2", "-n")
    pg.sql("CREATE TABLE docs (id bigserial PRIMARY KEY, body text, tags text[], at point)")
    pg.sql("INSERT INTO docs (body, tags, at) SELECT repeat(md5(i::text), i % 40), ARRAY['t' || (i % 9)], "
           "point(i % 100, i / 100) FROM generate_series(1, 3000) i")
    for index in ["CREATE INDEX ON docs USING gin (tags)", "CREATE INDEX ON docs USING gist (at)",
                  "CREATE INDEX ON docs USING spgist (at)", "CREATE INDEX ON docs USING hash (body)",
                  "CREATE INDEX ON docs USING brin (id)"]:
        pg.sql(index)
    pg.sql("UPDATE docs SET body = 'short' WHERE id % 4 = 0")
    pg.sql("DELETE FROM docs WHERE id % 11 = 0")
    pg.sql("VACUUM docs")
    pg.sql("CREATE UNLOGGED TABLE scratch (id int PRIMARY KEY, v text)")
    pg.sql("INSERT INTO scratch SELECT i, 'v' FROM generate_series(1, 500) i")
    pg.sql("""DO $$ BEGIN FOR i IN 1..90 LOOP
                BEGIN
                  INSERT INTO docs (body) VALUES ('sub ' || i);
                  IF i % 5 = 0 THEN RAISE EXCEPTION 'rolled back'; END IF;
                EXCEPTION WHEN others THEN NULL;
                END;
              END LOOP; END $$""")
    # Multixacts: a row locked, then updated in a subtransaction (two members each).
    pg.sql("""DO $$ BEGIN FOR i IN 1..300 LOOP
                PERFORM 1 FROM pgbench_accounts WHERE aid = i FOR SHARE;
                BEGIN UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = i; END;
                COMMIT;
              END LOOP; END $$""")
    pg.sql("BEGIN; INSERT INTO docs (body) VALUES ('prepared, left so'); PREPARE TRANSACTION 'left'")
    pg.sql("BEGIN; INSERT INTO docs (body) VALUES ('prepared, committed'); PREPARE TRANSACTION 'done'")
    pg.sql("COMMIT PREPARED 'done'")
    pg.sql("CREATE DATABASE app2")
    pg.sql("CREATE TABLE t2 (id int PRIMARY KEY, v text)", db="app2")
    pg.sql("INSERT INTO t2 SELECT i, md5(i::text) FROM generate_series(1, 4000) i", db="app2")
    pg.sql("CREATE SEQUENCE s2", db="app2")
    pg.sql("SELECT nextval('s2') FROM generate_series(1, 50)", db="app2")
    pg.sql("CREATE DATABASE app3 TEMPLATE app2 STRATEGY FILE_COPY")
    pg.sql("INSERT INTO t2 SELECT i, 'in the copy' FROM generate_series(4001, 4500) i", db="app3")


def block_differs(rel, fork: int, blk: int, ours: bytes, theirs: bytes) -> str | None:
    if fork == 2:
        extra = map_bits_lacking(ours, theirs)
        return f"map bits the primary lacks at bytes {extra[:5]}" if extra else None
    if rel.kind == "sequence":
        if seq_mask(ours) == seq_mask(theirs):
            return None
        return sequence_logged_ahead(ours, theirs, 1)
    mask = BY_ACCESS_METHOD.get(rel.kind)
    if mask is None:
        return f"no mask for access method {rel.kind}"
    return None if mask(ours, blk) == mask(theirs, blk) else "differs"


def test_a_backup_at_the_shutdown_checkpoint_is_the_primarys_data_directory(pageserver_factory, tmp_path):
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off", "max_prepared_transactions": "4"}).init().start()
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
    tenant = ps.create_tenant()
    try:
        attach(ps, tenant, pg)
        workload(pg)
        caught_up(ps, tenant, pg)
        rels = {db: relations(pg, db) for db in ["postgres", "app2", "app3"]}
    finally:
        pg.stop()
    control = pg.controldata()
    assert control["Database cluster state"] == "shut down", control
    checkpoint = lsn_int(control["Latest checkpoint location"])
    durable = wait_until(lambda: (d := ps.http.tenant_status(tenant)["last_durable_lsn"]) > checkpoint and d,
                         timeout=60, desc="the tenant to store the shutdown checkpoint")

    tar = tmp_path / "backup.tar"
    status, _, body = basebackup.fetch(ps, tenant, tar, lsn=f"{durable >> 32:X}/{durable & 0xFFFFFFFF:X}")
    assert status == 200, body
    ours_dir = tmp_path / "ours"
    with tarfile.open(tar) as archive:
        archive.extractall(ours_dir, filter="data")
    if pg.user is not None:  # pg_controldata runs as the server's user
        for path in [ours_dir, *ours_dir.rglob("*")]:
            shutil.chown(path, pg.user, pg.user)
    ours = Dir(ours_dir)

    # The SLRUs, the prepared transactions' state files and the relation maps, byte for byte.
    compared = 0
    for directory in SLRU_DIRS:
        theirs_files = sorted(p.name for p in (pg.datadir / directory).iterdir())
        ours_files = sorted(p.name for p in (ours_dir / directory).iterdir())
        assert ours_files == theirs_files, directory
        for name in theirs_files:
            assert (ours_dir / directory / name).read_bytes() == (pg.datadir / directory / name).read_bytes(), \
                f"{directory}/{name}"
            compared += 1
    assert len(list((pg.datadir / "pg_twophase").iterdir())) == 1, "the one transaction left prepared"
    maps = [p.relative_to(pg.datadir) for p in pg.datadir.rglob("pg_filenode.map")]
    assert len(maps) == 6, maps  # global, template0, template1, postgres, app2 and app3
    for path in maps:
        assert (ours_dir / path).read_bytes() == (pg.datadir / path).read_bytes(), str(path)

    # Every block of every relation file.
    problems, blocks = [], 0
    for db, listed in rels.items():
        for rel in listed:
            if rel.dbnode == 0 and db != "postgres":
                continue  # the shared catalogs, once
            for fork in ([3] if rel.unlogged else [0, 2, 3]):
                theirs_pages = file_pages(pg, rel.path + FORK_SUFFIX[fork])
                ours_pages = file_pages(ours, rel.path + FORK_SUFFIX[fork])
                # Pages PostgreSQL added without WAL: a heap's empty ones (all zeros), a
                # visibility map's (no bit of it is ours: they read as unset, which is safe).
                extra = [] if fork == 2 else theirs_pages[len(ours_pages):]
                if len(ours_pages) > len(theirs_pages) or any(p != bytes(8192) for p in extra):
                    problems.append((db, rel.name, fork, f"{len(ours_pages)} blocks, PostgreSQL has {len(theirs_pages)}"))
                for blk, (o, t) in enumerate(zip(ours_pages, theirs_pages)):
                    blocks += 1
                    why = block_differs(rel, fork, blk, o, t)
                    if why is not None:
                        problems.append((db, rel.name, fork, blk, why))
            if rel.unlogged:
                init = file_pages(ours, rel.path + FORK_SUFFIX[3])
                assert file_pages(ours, rel.path) == init, f"{rel.name}: the main fork is a copy of the init fork"
    assert not problems, problems[:20]
    assert blocks > 1000, blocks

    # The checkpoint counters.
    ours_control = pg.controldata(ours_dir)
    for field in COUNTERS:
        key = f"Latest checkpoint's {field}"
        assert ours_control[key] == control[key], (key, ours_control[key], control[key])
