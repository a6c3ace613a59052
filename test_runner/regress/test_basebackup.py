"""The base backup (issue 48, docs/http-api.md): a tenant that followed a PostgreSQL 15 primary
builds a tar that an unpatched PostgreSQL 15 starts on, as a primary and as a hot standby, with
no WAL replay, and that answers as the primary does (`pg_dumpall`, the rows, the checksums of
every page it reads), at the LSN asked for: the cluster state the WAL changes (the CLOG,
MultiXacts, the counters, prepared transactions) is the tenant's as of that LSN.
"""

from __future__ import annotations

import tarfile

import pytest

from fixtures import basebackup
from fixtures.postgres import Postgres
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_int

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def primary(tmp_path):
    pg = Postgres(tmp_path / "primary", settings={"autovacuum": "off", "max_prepared_transactions": "5"}, initdb_args=["--data-checksums"]).init().start()
    pg.pgbench("-i", "-s", "1", "-q")
    pg.sql("CREATE TABLE items (id bigserial PRIMARY KEY, tags text[], body text)")
    pg.sql("INSERT INTO items (tags, body) SELECT ARRAY['t' || (i % 7)], repeat('x', i % 3000) FROM generate_series(1, 2000) i")
    pg.sql("CREATE INDEX items_tags ON items USING gin (tags)")
    pg.sql("CREATE UNLOGGED TABLE scratch (id int PRIMARY KEY, v text)")
    pg.sql("INSERT INTO scratch SELECT i, 'v' FROM generate_series(1, 500) i")
    pg.sql("CREATE DATABASE app2")
    pg.sql("CREATE TABLE other (id int, v text)", db="app2")
    pg.sql("INSERT INTO other SELECT i, md5(i::text) FROM generate_series(1, 3000) i", db="app2")
    pg.sql("CHECKPOINT")
    yield pg
    pg.stop()


def test_postgres_starts_on_the_backup_and_answers_as_the_primary(primary, pageserver_factory, tmp_path):
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    durable = caught_up(ps, tenant, primary)["wal_source"]["durable_lsn"]

    tar_path = tmp_path / "backup.tar"
    status, headers, body = basebackup.fetch(ps, tenant, tar_path)
    assert status == 200, body
    assert headers["Content-Type"] == "application/x-tar"
    served = headers["x-basebackup-lsn"]
    assert lsn_int(served) >= durable
    with tarfile.open(tar_path) as archive:
        names = archive.getnames()
    assert names[-1] == "global/pg_control", "pg_control comes last: a tar cut short is seen to be"
    for name in ["PG_VERSION", "postgresql.conf", "pg_hba.conf", "global/pg_filenode.map", "pg_xact/0000",
                 "pg_twophase", "pg_wal/archive_status"]:
        assert name in names, name
    assert sum(1 for n in names if n.startswith("pg_wal/0000")) == 1
    assert not any(n.endswith("_fsm") for n in names), "the free space maps are left out"

    ours = basebackup.start_on(tar_path, tmp_path / "ours")
    try:
        log = ours.logfile.read_text()
        assert "database system was shut down at" in log, log
        assert "redo starts" not in log, "no WAL replayed"
        assert ours.sql("select pg_is_in_recovery()") == "f"
        # Every page read is checked against its checksum (the cluster has data checksums).
        assert ours.sql("select count(*), sum(abalance) from pgbench_accounts") == \
            primary.sql("select count(*), sum(abalance) from pgbench_accounts")
        assert ours.sql("select count(*) from items where tags @> ARRAY['t3']") == \
            primary.sql("select count(*) from items where tags @> ARRAY['t3']")
        assert ours.sql("select count(*) from scratch") == "0", "an unlogged table starts empty"
        assert basebackup.dump(ours) == basebackup.dump(primary)
        ours.sql("INSERT INTO scratch VALUES (1, 'new')")
        ours.sql("INSERT INTO other VALUES (-1, 'new')", db="app2")
        ours.sql("CHECKPOINT")
    finally:
        ours.stop()

    standby_tar = tmp_path / "standby.tar"
    status, _, body = basebackup.fetch(ps, tenant, standby_tar, lsn=served, standby=True)
    assert status == 200, body
    standby = basebackup.start_on(standby_tar, tmp_path / "standby", settings={"hot_standby": "on"})
    try:
        assert standby.sql("select pg_is_in_recovery()") == "t"
        assert standby.sql("select count(*) from other", db="app2") == "3000"
        standby.sql("select pg_promote()")
        standby.sql("INSERT INTO other VALUES (-2, 'promoted')", db="app2")
    finally:
        standby.stop()


def test_a_backup_that_cannot_be_built_is_refused_before_its_first_byte(primary, pageserver_factory, tmp_path):
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    out = tmp_path / "x.tar"
    status, _, body = basebackup.fetch(ps, tenant, out, timeline="other")
    assert status == 404 and b"other" in body, body
    status, _, body = basebackup.fetch(ps, tenant, out, lsn="nonsense")
    assert status == 400, body
    status, _, body = basebackup.fetch(ps, tenant, out, lsn="0/1000000")
    assert status == 410 and b"GC cutoff" in body, body
    status, _, body = basebackup.fetch(ps, "no-such-tenant", out)
    assert status == 404, body
    # A tenant fed through the page service has no PostgreSQL cluster to back up.
    plain = ps.create_tenant()
    status, _, body = basebackup.fetch(ps, plain, out)
    assert status == 409 and b"pg_control" in body, body


def test_a_client_that_goes_away_and_a_daemon_killed_midway_leave_nothing_behind(primary, pageserver_factory, tmp_path):
    """A client that stops reading and closes ends the backup's task (the daemon logs it and
    serves the next backup whole); a kill -9 of the daemon during a stream leaves a tenant that
    serves a whole backup after the restart."""
    import urllib.request

    from fixtures.util import wait_until

    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    caught_up(ps, tenant, primary)
    url = f"{ps.http.base}/v1/tenant/{tenant}/timeline/main/basebackup"

    resp = urllib.request.urlopen(url, timeout=60)
    assert len(resp.read(64 << 10)) == 64 << 10
    resp.close()
    wait_until(lambda: "the client went away" in ps.log_path.read_text(), timeout=60,
               desc="the backup's task to see its client gone")

    def whole_backup(name: str) -> list[str]:
        status, _, body = basebackup.fetch(ps, tenant, tmp_path / name)
        assert status == 200, body
        with tarfile.open(tmp_path / name) as archive:
            names = archive.getnames()
        assert names[-1] == "global/pg_control"
        return names

    first = whole_backup("after-close.tar")

    resp = urllib.request.urlopen(url, timeout=60)
    assert len(resp.read(1 << 20)) == 1 << 20
    ps.kill()
    resp.close()
    ps.start()
    wait_until(lambda: ps.http.tenant_status(tenant)["wal_source"]["state"] == "streaming", timeout=120,
               desc="the tenant to stream again")
    assert whole_backup("after-kill.tar") == first


def test_a_backup_at_each_commit_has_exactly_the_transactions_committed_before_it(primary, pageserver_factory,
                                                                                   tmp_path):
    """What the WAL changes after the import (the CLOG, the counters, MultiXacts) is in a backup
    at any LSN: after each of several transactions (one with 70 subtransactions, some rolled
    back; rows locked by several sessions), a backup at the insert position holds exactly what
    PostgreSQL counted then, and the server started on it takes new transactions whose xids do
    not collide with any the primary used (a new row is visible, old ones unchanged)."""
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    primary.sql("CREATE TABLE ledger (id int PRIMARY KEY, note text)")
    points = []
    for i in range(4):
        first = i * 1000
        subxacts = "".join(
            f"SAVEPOINT s{j}; INSERT INTO ledger VALUES ({first + 500 + j}, 'sub'); "
            + (f"ROLLBACK TO SAVEPOINT s{j}; " if j % 3 == 0 else "")
            for j in range(70)
        ) if i == 2 else ""
        primary.sql(f"BEGIN; INSERT INTO ledger SELECT g, 'row' FROM generate_series({first}, {first + 99}) g; "
                    f"{subxacts}COMMIT;")
        primary.sql(f"BEGIN; INSERT INTO ledger VALUES ({first + 400}, 'aborted'); ROLLBACK;")
        # Rows share-locked by two transactions at once: a MultiXact on them.
        primary.sql(f"BEGIN; SELECT * FROM ledger WHERE id < {first + 10} FOR SHARE; "
                    f"SELECT count(*) FROM (SELECT * FROM ledger WHERE id < {first + 10} FOR KEY SHARE) s; COMMIT;")
        points.append((primary.lsn(), primary.sql("select count(*), sum(id) from ledger")))
    caught_up(ps, tenant, primary)

    for n, (lsn, counted) in enumerate(points):
        tar_path = tmp_path / f"at-{n}.tar"
        status, _, body = basebackup.fetch(ps, tenant, tar_path, lsn=lsn)
        assert status == 200, body
        ours = basebackup.start_on(tar_path, tmp_path / f"ours-{n}")
        try:
            assert ours.sql("select count(*), sum(id) from ledger") == counted, lsn
            ours.sql("INSERT INTO ledger VALUES (-1, 'after the backup')")
            assert ours.sql("select count(*), sum(id) from ledger where id >= 0") == counted
            assert ours.sql("select note from ledger where id = -1") == "after the backup"
        finally:
            ours.stop()
    ours = basebackup.start_on(tar_path, tmp_path / "last")
    try:
        assert basebackup.dump(ours) == basebackup.dump(primary)
    finally:
        ours.stop()


def test_a_backup_holds_the_transactions_prepared_at_its_lsn(primary, pageserver_factory, tmp_path):
    """A transaction prepared at X and not yet committed or rolled back is in a backup at X
    (`pg_twophase/<xid>`): PostgreSQL started on it lists it and can commit it; one committed
    or rolled back by X is not there (its changes as the CLOG says), nor one prepared after X."""
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    primary.sql("CREATE TABLE twophase (id int PRIMARY KEY, note text)")
    before = primary.lsn()
    primary.sql("BEGIN; INSERT INTO twophase VALUES (1, 'prepared'); PREPARE TRANSACTION 'a'")
    primary.sql("BEGIN; INSERT INTO twophase VALUES (2, 'committed'); PREPARE TRANSACTION 'b'")
    primary.sql("COMMIT PREPARED 'b'")
    primary.sql("BEGIN; INSERT INTO twophase VALUES (3, 'rolled back'); PREPARE TRANSACTION 'c'")
    primary.sql("ROLLBACK PREPARED 'c'")
    xid = int(primary.sql("select transaction from pg_prepared_xacts where gid = 'a'"))
    caught_up(ps, tenant, primary)

    tar_path = tmp_path / "latest.tar"
    status, _, body = basebackup.fetch(ps, tenant, tar_path)
    assert status == 200, body
    with tarfile.open(tar_path) as archive:
        twophase = [n for n in archive.getnames() if n.startswith("pg_twophase/")]
    assert twophase == [f"pg_twophase/{xid:08X}"], twophase
    ours = basebackup.start_on(tar_path, tmp_path / "latest")
    try:
        assert ours.sql("select gid from pg_prepared_xacts") == "a"
        assert ours.sql("select string_agg(id::text, ',' order by id) from twophase") == "2"
        ours.sql("COMMIT PREPARED 'a'")
        assert ours.sql("select string_agg(id::text, ',' order by id) from twophase") == "1,2"
        assert ours.sql("select count(*) from pg_prepared_xacts") == "0"
    finally:
        ours.stop()

    tar_path = tmp_path / "before.tar"
    status, _, body = basebackup.fetch(ps, tenant, tar_path, lsn=before)
    assert status == 200, body
    with tarfile.open(tar_path) as archive:
        assert not any(n.startswith("pg_twophase/") for n in archive.getnames())
    ours = basebackup.start_on(tar_path, tmp_path / "before")
    try:
        assert ours.sql("select count(*) from pg_prepared_xacts") == "0"
        assert ours.sql("select count(*) from twophase") == "0"
    finally:
        ours.stop()
    primary.sql("COMMIT PREPARED 'a'")


def test_a_transaction_prepared_before_the_import_is_in_the_backup(primary, pageserver_factory, tmp_path):
    """A transaction prepared, and checkpointed into `pg_twophase/`, before the tenant imported
    its primary comes with the import's files: PostgreSQL started on a backup lists it and
    commits it."""
    primary.sql("CREATE TABLE early (id int)")
    primary.sql("BEGIN; INSERT INTO early VALUES (7); PREPARE TRANSACTION 'early'")
    primary.sql("CHECKPOINT")
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")
    tenant = ps.create_tenant()
    attach(ps, tenant, primary)
    caught_up(ps, tenant, primary)
    tar_path = tmp_path / "backup.tar"
    status, _, body = basebackup.fetch(ps, tenant, tar_path)
    assert status == 200, body
    ours = basebackup.start_on(tar_path, tmp_path / "ours")
    try:
        assert ours.sql("select gid from pg_prepared_xacts") == "early"
        ours.sql("COMMIT PREPARED 'early'")
        assert ours.sql("select id from early") == "7"
    finally:
        ours.stop()
    primary.sql("COMMIT PREPARED 'early'")


def test_settings_the_primary_raised_after_the_import_are_the_backups(pageserver_factory, tmp_path):
    """A primary that raised `max_prepared_transactions` after the tenant's import (ALTER SYSTEM
    and a restart: `XLOG_PARAMETER_CHANGE`) and then left more transactions prepared than the
    old setting allowed: PostgreSQL starts on the backup (as a primary, and as a hot standby
    then promoted) with all of them, and pg_control has the primary's parameters as of X. (The
    kept configuration files are the import's: the backup raises the settings there.)"""
    pg = Postgres(tmp_path / "primary", settings={"autovacuum": "off", "max_prepared_transactions": "2"}).init().start()
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")  # the primary restarts, and stops before the daemon
    tenant = ps.create_tenant()
    try:
        attach(ps, tenant, pg)
        pg.sql("ALTER SYSTEM SET max_prepared_transactions = 6")
        pg.sql("ALTER SYSTEM SET max_locks_per_transaction = 128")
        pg.stop()
        pg.start()
        for i in range(4):
            pg.sql(f"BEGIN; CREATE TABLE p{i} (id int); PREPARE TRANSACTION 'p{i}'")
        caught_up(ps, tenant, pg)
    finally:
        pg.stop()
    for standby in (False, True):
        tar = tmp_path / f"backup-{standby}.tar"
        status, _, body = basebackup.fetch(ps, tenant, tar, standby=standby)
        assert status == 200, body
        ours = basebackup.start_on(tar, tmp_path / f"ours-{standby}", settings={"hot_standby": "on"})
        try:
            if standby:
                # A standby lists prepared transactions once it is promoted.
                assert ours.sql("select pg_is_in_recovery()") == "t"
                assert ours.sql("select pg_promote()") == "t"
            assert ours.sql("select count(*) from pg_prepared_xacts") == "4"
            assert ours.sql("show max_prepared_transactions") == "6"
            control = ours.controldata()
            assert control["max_prepared_xacts setting"] == "6", control
            assert control["max_locks_per_xact setting"] == "128", control
        finally:
            ours.stop()
