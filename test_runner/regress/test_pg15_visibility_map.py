"""Visibility-map pages served for a PostgreSQL 15 primary (issue: resource managers, the
visibility-map finding), compared with the primary's data files and with PostgreSQL's own
streaming standby of the same primary.

`CREATE DATABASE` with the default `WAL_LOG` strategy WAL-logs the copy of every relation of the
template as full-page images taken as of a standard page. A map page keeps its bits after its
24-byte header, where a standard page has its hole (`pd_lower` 24, `pd_upper` 8192), so the
image carries none of them: whoever replays that WAL, the daemon or PostgreSQL's own standby,
has the new database's map pages with no bit set where the primary's have them. An unset bit is
safe (an index-only scan visits the heap, VACUUM looks at the page again); a set bit the
primary's page lacks would not be (rows taken as visible to all that are not). So:

- every map page served (both databases, every relation) has no bit the primary's lacks;
- every map page served equals the standby's, as PostgreSQL's own replay leaves it (the LSN
  and checksum masked);
- the bits the copy loses are counted and printed; the primary has bits in the new database's
  map pages, so the first check is not empty.
"""

from __future__ import annotations

from fixtures.oracle import Key
from fixtures.page_client import PageServiceError
from fixtures.pgmask import lsn_mask
from fixtures.postgres import Postgres
from fixtures.redo_check import map_bits, map_bits_lacking
from fixtures.util import wait_until
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_int

PAGE = 8192


def vm_files(pg: Postgres, db: str):
    """(key, path of the map fork) of every relation of `db` that has a map fork on disk."""
    dbnode = int(pg.sql(f"select oid from pg_database where datname = '{db}'"))
    rows = pg.sql("""
        select pg_relation_filenode(c.oid), coalesce(nullif(c.reltablespace, 0), 1663),
               pg_relation_filepath(c.oid)
        from pg_class c where pg_relation_filenode(c.oid) is not null""", db=db)
    for line in rows.splitlines():
        rel, spc, path = line.split("|")
        if int(spc) == 1664:
            continue  # the shared catalogs: not copied by CREATE DATABASE, in both databases' lists
        yield Key(int(spc), dbnode, int(rel), 2, 0), path + "_vm"


def blocks(datadir, path: str) -> list[bytes]:
    f = datadir / path
    if not f.exists():
        return []
    data = f.read_bytes()
    return [data[i:i + PAGE] for i in range(0, len(data) // PAGE * PAGE, PAGE)]


def test_map_pages_have_no_bit_the_primary_lacks_and_equal_postgres_own_standby(tmp_path, pageserver_factory):
    # With `synchronous_commit` on: VACUUM sets a page all-visible only once its rows' hint bits
    # are set, and PostgreSQL sets no hint bit for a commit whose record is not yet flushed.
    pg = Postgres(tmp_path / "primary", settings={"autovacuum": "off", "synchronous_commit": "on"}).init().start()
    standby = None
    try:
        ps = pageserver_factory()
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        tenant = ps.create_tenant()
        attach(ps, tenant, pg)
        standby = pg.standby(tmp_path / "standby").start()

        # Bits set by VACUUM (Heap2 VISIBLE records) in the existing database, then a copy of
        # the template by the WAL_LOG strategy, then bits set by VACUUM in the copy.
        pg.sql("create table t (id int primary key, v text)")
        pg.sql("insert into t select g, repeat('x', 200) from generate_series(1, 20000) g")
        pg.sql("vacuum t")
        pg.sql("create database app")  # STRATEGY WAL_LOG, the default of PostgreSQL 15
        pg.sql("create table u (id int primary key, v text)", db="app")
        pg.sql("insert into u select g, repeat('y', 200) from generate_series(1, 20000) g", db="app")
        pg.sql("vacuum u", db="app")
        pg.sql("delete from u where id % 100 = 0", db="app")  # clears some of u's bits again
        pg.sql("checkpoint")
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        # The standby replays past `end`, then a restartpoint writes its pages to its files.
        wait_until(lambda: lsn_int(standby.sql("select pg_last_wal_replay_lsn()")) >= end,
                   timeout=60, desc="the standby to replay up to the daemon's LSN")
        standby.sql("checkpoint")

        compared = lost = lost_pages = primary_bits_in_app = served_bits = 0
        failures = []
        with ps.connect(tenant) as conn:
            for db in ["postgres", "app"]:
                for key, path in vm_files(pg, db):
                    theirs = blocks(pg.datadir, path)
                    standby_pages = blocks(standby.datadir, path)
                    for blk, primary_page in enumerate(theirs):
                        k = Key(key.spcnode, key.dbnode, key.relnode, 2, blk)
                        try:
                            ours = conn.get_page(k, end)
                        except PageServiceError as e:
                            # A map page PostgreSQL extended (zeros, without WAL) and no record
                            # set a bit in: no WAL names it.
                            if e.name == "not_found" and map_bits(primary_page) == 0:
                                ours = bytes(PAGE)
                            else:
                                failures.append((db, str(k), str(e)))
                                continue
                        compared += 1
                        served_bits += map_bits(ours)
                        extra = map_bits_lacking(ours, primary_page)
                        if extra:
                            failures.append((db, str(k), f"bits the primary lacks at bytes {extra[:5]}"))
                        standby_page = standby_pages[blk] if blk < len(standby_pages) else bytes(PAGE)
                        if lsn_mask(ours) != lsn_mask(standby_page):
                            failures.append((db, str(k), "differs from the standby's page"))
                        missing = map_bits(primary_page) - map_bits(ours)
                        if missing:
                            lost += missing
                            lost_pages += 1
                        if db == "app":
                            primary_bits_in_app += map_bits(primary_page)
        print(f"\n{compared} map pages compared, {served_bits} bits served; {lost_pages} of them lack {lost} "
              "of the primary's bits (as the standby's do)")
        assert compared > 50, "both databases have map pages"
        assert primary_bits_in_app > 0, "the primary has bits set in the new database's map pages"
        assert served_bits > 0, "VACUUM set bits in both databases, which the daemon serves"
        assert not failures, f"{len(failures)} map pages differ, e.g. {failures[:10]}"
    finally:
        if standby is not None:
            standby.stop()
        pg.stop()
