"""The commit log, the MultiXact SLRUs and the checkpoint counters a tenant keeps from the WAL,
checked against the files of the PostgreSQL 15 primary it follows
(docs/rfcs/0008-postgresql-out.md, step 2).

A primary runs commits and aborts, more than a CLOG page of transactions (32768), transactions
with more than 64 subtransactions (some rolled back, one whole tree aborted) across a page
boundary, prepared transactions committed and rolled back, and thousands of multixacts (a row
locked, then updated by a subtransaction: two members each) over several offsets and members
pages; the daemon restarts halfway (the counters resume from what it stored), and after an
online checkpoint the tenant's next xid and next multixact are the primary's. The primary is
then stopped cleanly: its shutdown checkpoint writes `pg_xact`, `pg_multixact` and
`pg_control`. Once the tenant holds that checkpoint record:

- GetPage of every SLRU page PostgreSQL wrote (each 8 KiB of each segment file of `pg_xact`,
  `pg_multixact/offsets` and `pg_multixact/members`) at the latest LSN equals PostgreSQL's
  page, byte for byte; a page it never wrote is not found;
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
# The SLRUs' directories and their kinds (page_types::keys::SlruKind, the key's spcnode).
SLRUS = {"pg_xact": 0, "pg_multixact/offsets": 1, "pg_multixact/members": 2}


def slru_key(kind: int, segno: int, page: int) -> Key:
    return Key(kind, 0, segno, SLRU_FORK, page)


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


def multixacts(pg: Postgres, rows: int) -> None:
    """`rows` multixacts and more in one transaction: each row share-locked, then updated by a
    subtransaction (another xid of the same transaction; the exception clause makes the block
    one), which makes the row's xmax a multixact of the two."""
    pg.sql(f"CREATE TABLE m (i int PRIMARY KEY, v int); INSERT INTO m SELECT g, 0 FROM generate_series(1, {rows}) g")
    pg.sql(f"""DO $$ BEGIN FOR r IN 1..{rows} LOOP
                 PERFORM 1 FROM m WHERE i = r FOR SHARE;
                 BEGIN UPDATE m SET v = v + 1 WHERE i = r; EXCEPTION WHEN others THEN RAISE; END;
               END LOOP; END $$""")


def tenant_counters(conn) -> tuple[int, int, int]:
    """(next xid, next multixact, next member offset) of the tenant's counters at the latest LSN."""
    page = conn.get_page(Key(0, 0, 0, CHECKPOINT_FORK, 0))
    full_xid, _oid, next_multi, next_offset = struct.unpack_from("<QIII", page, 24)
    return full_xid, next_multi, next_offset


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
        multixacts(pg, 5000)
        # After an online checkpoint, the counters as the records left them are the
        # primary's: the next xid (every transaction has ended: it is the snapshot's xmax),
        # the next multixact and member offset (none since the checkpoint began).
        pg.sql("CHECKPOINT")
        caught_up(ps, tenant, pg)
        next_xid_now = int(pg.sql("select pg_snapshot_xmax(pg_current_snapshot())"))
        next_multi, next_offset = (int(v) for v in pg.sql(
            "select next_multixact_id, next_multi_offset from pg_control_checkpoint()").split("|"))
        with ps.connect(tenant) as conn:
            ours = tenant_counters(conn)
        assert ours == (next_xid_now, next_multi, next_offset), (ours, next_xid_now, next_multi, next_offset)
        assert next_multi > 5000 and next_offset > 10_000, (next_multi, next_offset)
    finally:
        pg.stop()
    control = pg.controldata()
    assert control["Database cluster state"].strip() == "shut down", control
    checkpoint = lsn_int(control["Latest checkpoint location"].strip())
    # The shutdown checkpoint record starts there: once the tenant holds anything past it, it
    # holds the record's values (its counters).
    wait_until(lambda: ps.http.tenant_status(tenant)["last_durable_lsn"] > checkpoint, timeout=60,
               desc="the tenant to store the shutdown checkpoint")

    pages = {}
    with ps.connect(tenant) as conn:
        for directory, kind in SLRUS.items():
            segments = sorted((pg.datadir / directory).iterdir())
            pages[directory] = 0
            for path in segments:
                data = path.read_bytes()
                assert len(data) % 8192 == 0, (path, len(data))
                for page in range(len(data) // 8192):
                    want = data[page * 8192:(page + 1) * 8192]
                    ours = conn.get_page(slru_key(kind, int(path.name, 16), page))
                    assert ours == want, (directory, path.name, page, first_difference(ours, want))
                    pages[directory] += 1
            # A page PostgreSQL never wrote: not found.
            with pytest.raises(PageServiceError) as e:
                conn.get_page(slru_key(kind, int(segments[-1].name, 16), 31))
            assert e.value.name == "not_found", e.value
        # 35000 xids (32768 a page); more than 5000 multixacts (2048 a page) of 2 members
        # or more (1636 a page).
        assert pages["pg_xact"] >= 2 and pages["pg_multixact/offsets"] >= 3 \
            and pages["pg_multixact/members"] >= 7, pages

        counters = conn.get_page(Key(0, 0, 0, CHECKPOINT_FORK, 0))
    pg_control = (pg.datadir / "global" / "pg_control").read_bytes()
    assert counters[:88] == pg_control[40:128], "the shutdown checkpoint's CheckPoint"
    assert counters[88:] == bytes(8192 - 88)
    full_xid, next_oid = struct.unpack_from("<QI", counters, 24)
    epoch, xid = (int(v) for v in re.split(r"\s*:\s*", control["Latest checkpoint's NextXID"].strip()))
    assert (full_xid >> 32, full_xid & 0xFFFF_FFFF) == (epoch, xid), control
    assert next_oid == int(control["Latest checkpoint's NextOID"]), control
    print(f"\nSLRU pages equal to PostgreSQL's: {pages}; NextXID {epoch}:{xid}, NextOID {next_oid}")


def first_difference(a: bytes, b: bytes) -> str:
    at = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), None)
    if at is None:
        return f"lengths {len(a)} and {len(b)}"
    return f"byte {at}: ours {a[at]:#04x}, PostgreSQL's {b[at]:#04x}"
