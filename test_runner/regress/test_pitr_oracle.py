"""The PITR oracle (issue 48): a PostgreSQL 15 started on the pageserver's base backup at an LSN X
answers as PostgreSQL's own point-in-time recovery to X does (`recovery_target_lsn = X`,
`recovery_target_inclusive = off`, from a `pg_basebackup` taken before the workload and the
primary's WAL): `pg_dumpall` (schema and data) of both is the same, at 20 LSNs spread over a
workload of pgbench, DDL, a transaction with more than 64 subtransactions, multixacts (rows
locked FOR SHARE by several sessions at once), prepared transactions (one still prepared at some
LSNs), CREATE DATABASE with both strategies (WAL_LOG, and FILE_COPY of template1 and of a
database with rows) and DROP DATABASE, TRUNCATE, an unlogged table, and a transaction in
progress at several LSNs; among the LSNs: one on a segment boundary (after `pg_switch_wal()`), the
end of a record that crossed a WAL page, the start of a page (right after its header), and
mid-page ones.

PostgreSQL's recovery is one server, stopped and started again with the next target (it goes on
from where it paused); it is paused at each target (`recovery_target_action = pause`), a hot
standby, while `pg_dumpall` reads it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from fixtures import basebackup
from fixtures.postgres import Postgres
from fixtures.util import wait_until
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_int, lsn_text

pytestmark = pytest.mark.timeout(600)

WAL_PAGE = 8192


class Session:
    """A psql session of its own (a transaction kept open across the test's other statements)."""

    def __init__(self, pg: Postgres):
        env = {**os.environ, "PGHOST": str(pg.sockdir), "PGPORT": str(pg.port), "PGDATABASE": "postgres"}
        self.proc = subprocess.Popen(pg._cmd("psql", "-X", "-q", "-v", "ON_ERROR_STOP=1"), stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, env=env)

    def send(self, sql: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(sql + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


def workload(pg: Postgres, tmp_path) -> list[int]:
    """Runs the workload on `pg`, returning the LSNs (insert positions) taken along it."""
    lsns: list[int] = []

    def mark() -> None:
        lsns.append(lsn_int(pg.lsn()))

    pg.pgbench("-t", "200", "-c", "2", "-n")
    mark()
    pg.sql("CREATE TABLE docs (id int PRIMARY KEY, body text, tags text[])")
    pg.sql("CREATE INDEX docs_tags ON docs USING gin (tags)")
    pg.sql("INSERT INTO docs SELECT i, repeat(md5(i::text), 20), ARRAY['t' || (i % 5)] FROM generate_series(1, 2000) i")
    mark()
    # A transaction in progress at the next LSNs: its rows are nobody's yet.
    open_tx = Session(pg)
    open_tx.send("BEGIN; INSERT INTO docs SELECT i, 'open', '{}' FROM generate_series(100001, 100500) i;")
    pg.sql("""DO $$ BEGIN FOR i IN 1..100 LOOP
                BEGIN
                  INSERT INTO docs VALUES (3000 + i, 'sub', '{}');
                  IF i % 7 = 0 THEN RAISE EXCEPTION 'roll this one back'; END IF;
                EXCEPTION WHEN others THEN NULL;
                END;
              END LOOP; END $$""")
    wait_until(lambda: pg.sql("select count(*) from pg_stat_activity where state = 'idle in transaction'") == "1",
               timeout=30, desc="the open transaction to be open")
    mark()
    # Multixacts: several sessions lock the same rows FOR SHARE at once.
    lockers = [Session(pg) for _ in range(3)]
    for s in lockers:
        s.send("BEGIN; SELECT id FROM docs WHERE id <= 300 FOR SHARE;")
    wait_until(lambda: pg.sql("select count(*) from pg_stat_activity where state = 'idle in transaction'") == "4",
               timeout=30, desc="the lockers to hold their locks")
    mark()
    for s in lockers:
        s.send("COMMIT;")
        s.close()
    pg.sql("UPDATE docs SET body = 'after the lockers' WHERE id <= 300")
    mark()
    pg.sql("BEGIN; INSERT INTO docs VALUES (9001, 'prepared', '{}'); PREPARE TRANSACTION 'p1'")
    pg.sql("BEGIN; INSERT INTO docs VALUES (9002, 'prepared then rolled back', '{}'); PREPARE TRANSACTION 'p2'")
    mark()
    pg.sql("ROLLBACK PREPARED 'p2'")
    pg.sql("CREATE UNLOGGED TABLE scratch (id int PRIMARY KEY, v text)")
    pg.sql("INSERT INTO scratch SELECT i, 'v' FROM generate_series(1, 1000) i")
    mark()
    pg.sql("CREATE DATABASE app2")
    pg.sql("CREATE TABLE t2 (id int, v text)", db="app2")
    pg.sql("INSERT INTO t2 SELECT i, md5(i::text) FROM generate_series(1, 3000) i", db="app2")
    mark()
    open_tx.send("COMMIT;")
    open_tx.close()
    pg.sql("COMMIT PREPARED 'p1'")
    mark()
    pg.sql("TRUNCATE pgbench_history")
    pg.sql("ALTER TABLE docs ADD COLUMN extra int DEFAULT 7")
    mark()
    # A segment boundary: the next record starts the next segment.
    pg.sql("select pg_switch_wal()")
    mark()
    pg.pgbench("-t", "100", "-c", "2", "-n")
    mark()
    pg.sql("CREATE DATABASE gone")
    pg.sql("CREATE TABLE g (id int)", db="gone")
    mark()
    # Both strategies: the template's files copied without WAL for their blocks.
    pg.sql("CREATE DATABASE copied TEMPLATE app2 STRATEGY FILE_COPY")
    pg.sql("INSERT INTO t2 SELECT i, 'in the copy' FROM generate_series(3001, 3500) i", db="copied")
    pg.sql("CREATE DATABASE plain STRATEGY FILE_COPY")
    mark()
    pg.sql("DROP DATABASE gone")
    pg.sql("DELETE FROM docs WHERE id % 3 = 0")
    mark()
    pg.sql("VACUUM docs")
    mark()
    pg.pgbench("-t", "50", "-c", "1", "-n")
    mark()
    pg.sql("CREATE INDEX docs_body ON docs (left(body, 10))")
    mark()
    pg.sql("UPDATE pgbench_accounts SET filler = 'x' WHERE aid <= 2000")
    mark()
    pg.sql("DROP TABLE pgbench_history")
    mark()
    pg.sql("INSERT INTO docs SELECT i, 'late', '{}' FROM generate_series(30001, 31000) i")
    mark()
    assert any(lsn % (16 << 20) <= 40 for lsn in lsns), [hex(x) for x in lsns]
    return lsns


RECORD = re.compile(r"len \(rec/tot\):\s*\d+/\s*(\d+), tx:\s*\d+, lsn: ([0-9A-F]+)/([0-9A-F]+)")


def page_edges(pg: Postgres, start: int, end: int) -> list[int]:
    """Two record boundaries of the WAL in [start, end) at WAL page edges (`pg_waldump`): the
    start of the record after the first one that crosses a page (the end of a crossing record),
    and the start of the first record that begins a page, right after its header."""
    pg.sql("CHECKPOINT")  # the WAL up to `end` flushed, for pg_waldump
    text = pg.waldump(lsn_text(start), lsn_text(end))
    records = [(int(hi, 16) << 32 | int(lo, 16), int(tot)) for tot, hi, lo in RECORD.findall(text)]
    after_crossing = next(records[i + 1][0] for i, (lsn, tot) in enumerate(records[:-1])
                          if lsn // WAL_PAGE != (lsn + tot) // WAL_PAGE)
    page_start = next(lsn for lsn, _ in records if lsn % WAL_PAGE in (24, 40))
    return [after_crossing, page_start]


def test_a_backup_at_any_lsn_answers_as_postgresql_point_in_time_recovery(pageserver_factory, tmp_path):
    primary = Postgres(tmp_path / "primary", settings={"autovacuum": "off", "max_prepared_transactions": "5"}).init().start()
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
    try:
        primary.pgbench("-i", "-s", "1", "-q")
        primary.sql("select pg_create_physical_replication_slot('keep', true)")
        tenant = ps.create_tenant()
        attach(ps, tenant, primary)
        pitr = primary.backup_for_replay(tmp_path / "pitr")
        lsns = workload(primary, tmp_path)
        lsns = sorted(set(lsns + page_edges(primary, lsns[0], lsns[-1])))
        assert len(lsns) >= 20, len(lsns)
        caught_up(ps, tenant, primary)
        # The primary's WAL, archived for PostgreSQL's recovery to restore.
        archive = pitr.datadir.parent / "archive"
        primary.copy_wal(archive)
    finally:
        primary.stop()
    (pitr.datadir / "recovery.signal").touch()
    if pitr.user is not None:
        for f in [archive, *archive.iterdir(), pitr.datadir / "recovery.signal"]:
            shutil.chown(f, pitr.user, pitr.user)
    pitr.settings["restore_command"] = f"'cp {archive}/%f %p'"

    for i, x in enumerate(lsns):
        target = lsn_text(x)
        pitr.settings.update({"recovery_target_lsn": f"'{target}'", "recovery_target_inclusive": "off",
                              "recovery_target_action": "pause", "hot_standby": "on"})
        pitr._write_settings()
        pitr.start()
        try:
            wait_until(lambda: pitr.sql("select pg_get_wal_replay_pause_state()") == "paused", timeout=60,
                       desc=f"PostgreSQL's recovery to pause at {target}")
            theirs = basebackup.dump(pitr)
        finally:
            pitr.stop()
        ours_pg, _ = started_on(ps, tenant, tmp_path, f"ours{i}", target)
        try:
            ours = basebackup.dump(ours_pg)
        finally:
            ours_pg.stop()
            shutil.rmtree(tmp_path / f"ours{i}", ignore_errors=True)
        assert ours == theirs, f"at {target} (LSN {i} of {len(lsns)})"


def started_on(ps, tenant, tmp_path, name, lsn):
    tar = tmp_path / f"{name}.tar"
    status, headers, body = basebackup.fetch(ps, tenant, tar, lsn=lsn)
    assert status == 200, body
    pg = basebackup.start_on(tar, tmp_path / name)
    tar.unlink()
    return pg, headers["x-basebackup-lsn"]
