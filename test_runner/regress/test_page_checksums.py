"""Page checksums: a tenant following a cluster made with `initdb --data-checksums` serves every
page (rebuilt by redo, an image as stored, a page-cache hit, and again after a restart of the
daemon) with the `pd_checksum` PostgreSQL computes for it at its block number: pageinspect's
`page_checksum(page, blkno)`, PostgreSQL's own `pg_checksum_page`, run by that cluster on the
served bytes. A tenant following a cluster without data checksums serves the field as
PostgreSQL left it: 0, since such a cluster never writes a checksum (one computed by mistake is
never 0)."""

from __future__ import annotations

import pytest

from fixtures.oracle import Key
from fixtures.postgres import Postgres
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)


@pytest.fixture(params=[True, False], ids=["data_checksums", "no_checksums"])
def pg(request, tmp_path):
    # No autovacuum: the pages are the test's own changes.
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off"},
                  initdb_args=["--data-checksums"] if request.param else []).init().start()
    yield pg
    pg.stop()


def pd_checksum(page: bytes) -> int:
    return int.from_bytes(page[8:10], "little")


def postgres_checksums(pg: Postgres, pages: list[tuple[int, bytes]]) -> list[int | None]:
    """PostgreSQL's checksum of each (block number, page), in order; None for a new page,
    which PostgreSQL does not checksum. One query, sent on psql's stdin (the pages are too
    large for its command line)."""
    rows = ",\n".join(f"({i}, {blkno}, '{page.hex()}')" for i, (blkno, page) in enumerate(pages))
    sql = (f"SELECT page_checksum(decode(h, 'hex'), b)::int & 65535 FROM (VALUES {rows}) v(n, b, h) "
           "ORDER BY n;\n")
    out = pg.run("psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d", "postgres", input=sql).stdout
    got = [int(line) if line else None for line in out.splitlines()]
    assert len(got) == len(pages), out[:500]
    return got


def served_keys(conn, pg: Postgres, lsn: int) -> list[Key]:
    """Every block, at `lsn`, of the main forks of the test's table, its primary key's btree
    and pg_class (imported pages, some changed by the WAL), and of the table's visibility map."""
    db = int(pg.sql("select oid from pg_database where datname = 'postgres'"))
    keys = []
    for rel, forks in [("t", [0, 2]), ("t_pkey", [0]), ("pg_class", [0])]:
        node = int(pg.sql(f"select pg_relation_filenode('{rel}')"))
        for fork in forks:
            blocks = conn.get_rel_size((1663, db, node), fork, lsn).blocks
            keys += [Key(1663, db, node, fork, b) for b in range(blocks)]
    return keys


# `pg` comes first: set up first, it is stopped after the daemon (whose receiver would
# otherwise see it go away).
def test_served_pages_carry_postgresqls_checksum_only_for_a_cluster_with_data_checksums(pg, pageserver_factory):
    checksums = pg.sql("show data_checksums") == "on"
    ps = pageserver_factory(compaction="off")
    tenant = ps.create_tenant()
    attach(ps, tenant, pg)
    pg.sql("CREATE EXTENSION pageinspect")
    pg.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pg.sql("INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, 3000) g")
    pg.sql("UPDATE t SET v = 'y' WHERE id % 7 = 0")
    pg.sql("DELETE FROM t WHERE id % 11 = 0")
    # VACUUM prunes the pages and sets visibility-map bits; the UPDATEs after the checkpoint
    # log each page's image first, then only records, which the redo child applies.
    pg.sql("VACUUM t")
    pg.sql("CHECKPOINT")
    pg.sql("UPDATE t SET v = 'z' WHERE id % 13 = 0")
    pg.sql("UPDATE t SET v = 'w' WHERE id % 13 = 0")
    lsn = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]

    with ps.connect(tenant) as conn:
        keys = served_keys(conn, pg, lsn)
        served = [conn.get_page(key, lsn) for key in keys]
        # The same pages again: page-cache hits now.
        assert [conn.get_page(key, lsn) for key in keys] == served
    assert len(keys) > 60 and any(k.forknum == 2 for k in keys), keys

    if checksums:
        want = postgres_checksums(pg, [(key.blknum, page) for key, page in zip(keys, served)])
        wrong = [(key, pd_checksum(page), w) for key, page, w in zip(keys, served, want)
                 if pd_checksum(page) != w and w is not None]
        assert not wrong, f"{len(wrong)} of {len(keys)} pages: (key, served, PostgreSQL's) {wrong[:5]}"
        # PostgreSQL checksums every page but a new one (pd_upper 0).
        assert all(page[14:16] == b"\0\0" for page, w in zip(served, want) if w is None)
    else:
        nonzero = [(key, pd_checksum(page)) for key, page in zip(keys, served) if pd_checksum(page) != 0]
        assert not nonzero, nonzero[:5]

    # A restarted daemon learns the setting again from what it stored.
    ps.restart()
    with ps.connect(tenant) as conn:
        assert [conn.get_page(key, lsn) for key in keys] == served
