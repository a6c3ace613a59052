"""The commit log and the checkpoint counters a tenant keeps from the WAL, checked against the
files of the PostgreSQL 15 primary it follows (docs/rfcs/0008-postgresql-out.md, step 2).

A primary runs commits and aborts, more than a CLOG page of transactions (32768), transactions
with more than 64 subtransactions (some rolled back, one whole tree aborted) across a page
boundary, and prepared transactions committed and rolled back; the daemon restarts halfway
(the counters resume from what it stored), and at the end of the workload the tenant's next
xid is the primary's. The primary is then stopped cleanly: its shutdown checkpoint writes
`pg_xact` and `pg_control`. Once the tenant holds that checkpoint record:

- GetPage of every CLOG page PostgreSQL wrote (each 8 KiB of each `pg_xact` segment file) at
  the latest LSN equals PostgreSQL's page, byte for byte; a page it never wrote is not found;
- GetPage of the checkpoint counters key gives the shutdown checkpoint's `CheckPoint`: the 88
  bytes of `pg_control`'s copy of it, and `pg_controldata`'s NextXID and NextOID.
"""

from __future__ import annotations

import re
import struct

import pytest

from fixtures.oracle import Key
from fixtures.page_client import PageServiceError
from fixtures.postgres import Postgres
from fixtures.util import wait_until
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_int

pytestmark = pytest.mark.timeout(300)

CLOG_XACTS_PER_PAGE = 32768
SLRU_FORK, CHECKPOINT_FORK = 0x90, 0xA2
CLOG = 0  # SlruKind::Clog, the key's spcnode


def clog_key(segno: int, page: int) -> Key:
    return Key(CLOG, 0, segno, SLRU_FORK, page)


def next_xid(pg: Postgres) -> int:
    return int(pg.sql("select pg_current_xact_id()"))


def small_transactions(pg: Postgres, n: int) -> None:
    """`n` transactions that take an xid each, every tenth rolled back, the rest committed."""
    pg.sql(f"""DO $$ BEGIN FOR i IN 1..{n} LOOP
                 PERFORM pg_current_xact_id();
                 IF i % 10 = 0 THEN ROLLBACK; ELSE COMMIT; END IF;
               END LOOP; END $$""")


def savepoints(pg: Postgres, n: int, end: str) -> None:
    """One transaction with `n` subtransactions that each insert (so each has an xid), every
    third rolled back to its savepoint, the rest released; then `end` (COMMIT or ROLLBACK)."""
    script = ["BEGIN;", "INSERT INTO t VALUES (0);"]
    for i in range(1, n + 1):
        script += [f"SAVEPOINT s{i};", f"INSERT INTO t VALUES ({i});",
                   f"ROLLBACK TO SAVEPOINT s{i};" if i % 3 == 0 else f"RELEASE SAVEPOINT s{i};"]
    script.append(f"{end};")
    pg.run("psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", "postgres", input="\n".join(script))


def controldata(pg: Postgres) -> dict[str, str]:
    out = pg.run("pg_controldata", "-D", str(pg.datadir)).stdout
    return dict(line.split(":", 1) for line in out.splitlines() if ":" in line)


def test_clog_pages_and_counters_match_postgres_after_a_clean_shutdown(tmp_path, pageserver_factory):
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off", "max_prepared_transactions": "4"}).init().start()
    ps = pageserver_factory()
    ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
    tenant = ps.create_tenant()
    try:
        attach(ps, tenant, pg)
        pg.sql("CREATE TABLE t (i int)")
        # Up to 40 xids before the end of the first CLOG page; then a tree of 100
        # subtransactions across the boundary.
        first = next_xid(pg)
        assert first < CLOG_XACTS_PER_PAGE - 100, first
        small_transactions(pg, CLOG_XACTS_PER_PAGE - 40 - first)
        savepoints(pg, 100, "COMMIT")
        assert next_xid(pg) > CLOG_XACTS_PER_PAGE, "the tree crossed into the second page"
        caught_up(ps, tenant, pg)
        # The counters resume from what the daemon stored.
        ps.restart()
        savepoints(pg, 80, "ROLLBACK")
        for gid, end in [("p1", "COMMIT PREPARED"), ("p2", "ROLLBACK PREPARED")]:
            pg.run("psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", "postgres",
                   input=f"BEGIN; INSERT INTO t VALUES (-1); PREPARE TRANSACTION '{gid}';")
            pg.sql(f"{end} '{gid}'")
        small_transactions(pg, 2000)
        # Between checkpoints the counters follow the records: the next xid is the primary's
        # (every transaction has ended: it is the snapshot's xmax).
        caught_up(ps, tenant, pg)
        primary_next = int(pg.sql("select pg_snapshot_xmax(pg_current_snapshot())"))
        with ps.connect(tenant) as conn:
            ours = struct.unpack_from("<Q", conn.get_page(Key(0, 0, 0, CHECKPOINT_FORK, 0)), 24)[0]
        assert ours == primary_next, (ours, primary_next)
    finally:
        pg.stop()
    control = controldata(pg)
    assert control["Database cluster state"].strip() == "shut down", control
    checkpoint = lsn_int(control["Latest checkpoint location"].strip())
    # The shutdown checkpoint record starts there: once the tenant holds anything past it, it
    # holds the record's values (its counters).
    wait_until(lambda: ps.http.tenant_status(tenant)["last_durable_lsn"] > checkpoint, timeout=60,
               desc="the tenant to store the shutdown checkpoint")

    pages = 0
    with ps.connect(tenant) as conn:
        segments = sorted((pg.datadir / "pg_xact").iterdir())
        for path in segments:
            data = path.read_bytes()
            assert len(data) % 8192 == 0, (path, len(data))
            for page in range(len(data) // 8192):
                want = data[page * 8192:(page + 1) * 8192]
                ours = conn.get_page(clog_key(int(path.name, 16), page))
                assert ours == want, (path.name, page, first_difference(ours, want))
                pages += 1
        assert pages >= 2, segments
        # A page PostgreSQL never wrote: not found.
        last = segments[-1]
        with pytest.raises(PageServiceError) as e:
            conn.get_page(clog_key(int(last.name, 16), 31))
        assert e.value.name == "not_found", e.value

        counters = conn.get_page(Key(0, 0, 0, CHECKPOINT_FORK, 0))
    pg_control = (pg.datadir / "global" / "pg_control").read_bytes()
    assert counters[:88] == pg_control[40:128], "the shutdown checkpoint's CheckPoint"
    assert counters[88:] == bytes(8192 - 88)
    full_xid, next_oid = struct.unpack_from("<QI", counters, 24)
    epoch, xid = (int(v) for v in re.split(r"\s*:\s*", control["Latest checkpoint's NextXID"].strip()))
    assert (full_xid >> 32, full_xid & 0xFFFF_FFFF) == (epoch, xid), control
    assert next_oid == int(control["Latest checkpoint's NextOID"]), control
    print(f"\n{pages} CLOG pages equal PostgreSQL's; NextXID {epoch}:{xid}, NextOID {next_oid}")


def first_difference(a: bytes, b: bytes) -> str:
    at = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    if at is None:
        return f"lengths {len(a)} and {len(b)}"
    return f"byte {at} (xids {at * 4}..{at * 4 + 3} of the page): ours {a[at]:#04x}, PostgreSQL's {b[at]:#04x}"
