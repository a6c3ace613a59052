"""GIN redo in the child (walredo-proc's `pg15::gin`), checked against PostgreSQL 15's own pages
(issue 47): a tenant follows a primary that runs `fixtures.pg_workloads.gin_mix` with
`wal_consistency_checking = 'gin'`; then

- every GIN record at its own LSN, none skipped: each carries PostgreSQL's page after it for
  each block it references (a check image, read here by `fixtures.walreader`, not by the
  daemon); GetPage of that block at the next record's LSN must equal it, both masked as
  PostgreSQL's `gin_mask` (`fixtures.pgmask`); matched/total per record type is printed, and
  per kind of page an INSERT changes (entry or posting-tree page, leaf or inner, and the child
  whose split it completes); every type and kind the workload makes must appear, and every
  segment action of posting-tree leaves (DELETE, INSERT, REPLACE, ADDITEMS: the recompression
  redo re-encodes), and 100% must match;
- every page at the end: after CHECKPOINT, GetPage at the latest LSN of every block of every
  GIN index equals the primary's data file, masked;
- `pagectl redocheck` over the same WAL (the child's redo in process, `walredo_proc`'s own
  masks): every GIN block value checked matches, none fails.

Every GIN record type of PostgreSQL 15 is made. SPLIT's halves and root and VACUUM_PAGE's page
arrive as full-page images (GetPage serves the image; only the child of an inner page's SPLIT is
redone), so redocheck checks none of them. The WAL is not compressed here: every image is read,
and PGLZ in Python would take minutes.
"""

from __future__ import annotations

import collections
import json
import re
import struct
import subprocess

import pytest

from fixtures import pg_workloads
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError
from fixtures.pgmask import gin_mask
from fixtures.postgres import Postgres
from fixtures.redo_check import pipelined
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_text, record_types
from fixtures.walreader import Wal

# The record types gin_mix makes, each of which must be checked at least once: all nine. Not
# made: the split of an inner page, whose SPLIT record has the child it completes as block 3
# (hundreds of leaves under one parent); the unit tests cover it.
MADE = ["Gin CREATE_PTREE", "Gin INSERT", "Gin SPLIT", "Gin VACUUM_PAGE", "Gin VACUUM_DATA_LEAF_PAGE",
        "Gin DELETE_PAGE", "Gin UPDATE_META_PAGE", "Gin INSERT_LISTPAGE", "Gin DELETE_LISTPAGE"]
# What an INSERT's blocks are (ginxlog.h's flags, as pg_waldump prints them).
INSERT_KINDS = {("F", "T"): "entry leaf", ("F", "F"): "entry inner", ("T", "T"): "posting leaf",
                ("T", "F"): "posting inner"}
INSERT_DESC = re.compile(r"rmgr: Gin .*lsn: ([0-9A-F]+)/([0-9A-F]+),.*desc: INSERT isdata: (\w) isleaf: (\w)")


SEGMENT_ACTIONS = {1: "DELETE", 2: "INSERT", 3: "REPLACE", 4: "ADDITEMS"}


def segment_actions(data: bytes) -> list[str]:
    """The actions of a posting-tree leaf's record data (`ginxlogRecompressDataLeaf`)."""
    n, pos, out = struct.unpack_from("<H", data, 0)[0], 2, []
    for _ in range(n):
        action = data[pos + 1]
        pos += 2
        if action in (2, 3):  # a whole segment: 8 bytes of header, nbytes padded to even
            nbytes = struct.unpack_from("<H", data, pos + 6)[0]
            pos += 8 + nbytes + (nbytes & 1)
        elif action == 4:  # a count, then that many item pointers
            pos += 2 + 6 * struct.unpack_from("<H", data, pos)[0]
        out.append(SEGMENT_ACTIONS[action])
    return out


def insert_kinds(pg: Postgres, start: int, end: int) -> dict:
    """{LSN: "posting leaf", ...} of every GIN INSERT in [start, end), from pg_waldump."""
    kinds = {}
    for line in pg.waldump(lsn_text(start), lsn_text(end)).splitlines():
        m = INSERT_DESC.search(line)
        if m:
            kinds[(int(m.group(1), 16) << 32) | int(m.group(2), 16)] = INSERT_KINDS[(m.group(3), m.group(4))]
    return kinds


def gin_pages(pg: Postgres):
    """(key, PostgreSQL's page) for every block of the main fork of every GIN index of database
    `postgres`, from the data files."""
    rows = pg.sql("""
        select pg_relation_filenode(c.oid), coalesce(nullif(c.reltablespace, 0), 1663), d.oid,
               pg_relation_filepath(c.oid)
        from pg_class c cross join pg_database d join pg_am a on a.oid = c.relam
        where d.datname = 'postgres' and a.amname = 'gin' and c.relkind = 'i'""")
    for line in rows.splitlines():
        rel, spc, db, path = line.split("|")
        data = (pg.datadir / path).read_bytes()
        for blk in range(len(data) // 8192):
            yield Key(int(spc), int(db), int(rel), 0, blk), data[blk * 8192:(blk + 1) * 8192]


@pytest.mark.timeout(600)
def test_every_gin_record_and_page_matches_postgres(tmp_path, pageserver_factory):
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off", "wal_consistency_checking": "'gin'"})
    pg.init().start()
    try:
        pg.sql("select pg_create_physical_replication_slot('keep', true)")
        # Every LSN of the run stays readable.
        ps = pageserver_factory(gc_horizon=1 << 40)
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        tenant = ps.create_tenant()
        start = attach(ps, tenant, pg)["resumed_at"]
        pg_workloads.gin_mix(pg)
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        types = record_types(pg, start, end)
        inserts = insert_kinds(pg, start, end)
        lsns = sorted(types)
        next_of = dict(zip(lsns, lsns[1:] + [end]))
        wal = Wal(pg.wal_dir)
        tally = collections.Counter()
        matched = collections.Counter()
        actions = collections.Counter()  # segment actions of posting-tree leaf records
        failures = []
        def requests():
            for lsn in lsns:
                kind = types[lsn]
                if not kind.startswith("Gin ") or lsn < start:
                    continue
                # With consistency checking every block has an image, in block id order.
                for i, image in enumerate(wal.images(lsn)):
                    key = Key(image.spcnode, image.dbnode, image.relnode, image.fork, image.blkno)
                    kinds = [kind]
                    if kind == "Gin INSERT":
                        kinds.append(f"  {'child' if i == 1 else inserts[lsn]}")
                    if i == 0 and (kind == "Gin VACUUM_DATA_LEAF_PAGE" or kinds[1:] == ["  posting leaf"]):
                        actions.update(segment_actions(image.data))
                    yield key, next_of[lsn], (kinds, lsn, key, image.page)

        with ps.connect(tenant) as conn:
            for (kinds, lsn, key, want), page in pipelined(conn, requests()):
                for k in kinds:
                    tally[k] += 1
                if isinstance(page, PageServiceError):
                    failures.append((kinds[0], lsn_text(lsn), str(key), str(page)))
                elif gin_mask(page) == gin_mask(want):
                    for k in kinds:
                        matched[k] += 1
                else:
                    failures.append((kinds[0], lsn_text(lsn), str(key), "differs"))
        print("\nmatched/total per record type (every GIN block of every GIN record):")
        for kind in sorted(tally, key=lambda k: (k.strip() != k, k)):
            print(f"  {kind:28} {matched[kind]:6}/{tally[kind]}")
        print("segment actions of posting-tree leaf records:", dict(actions))
        for kind in MADE + [f"  {k}" for k in [*INSERT_KINDS.values(), "child"]]:
            assert tally[kind] > 0, f"the workload makes {kind.strip()} records"
        assert set(actions) == set(SEGMENT_ACTIONS.values()), actions
        assert not failures, f"{len(failures)} pages differ from PostgreSQL's, e.g. {failures[:10]}"

        # Every page at the end, against the data files.
        pg.sql("CHECKPOINT")
        pages = list(gin_pages(pg))
        assert len(pages) > 60, len(pages)
        differ = []
        with ps.connect(tenant) as conn:
            for key, want in pages:
                try:
                    page = conn.get_page(key, end)
                except PageServiceError as e:
                    differ.append((str(key), str(e)))
                    continue
                if gin_mask(page) != gin_mask(want):
                    differ.append((str(key), "differs"))
        print(f"every page at the end: {len(pages) - len(differ)}/{len(pages)} GIN pages match")
        assert not differ, f"{len(differ)} of {len(pages)} pages differ, e.g. {differ[:10]}"

        # The same WAL through pagectl redocheck.
        out = subprocess.run([str(ps.bin.parent / "pagectl"), "redocheck", "--start", lsn_text(start),
                              "--end", lsn_text(end), str(pg.wal_dir)], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode in (0, 1) and out.stdout.strip(), out.stderr
        report = json.loads(out.stdout)
        gin = {k: v for k, v in report["types"].items() if k.startswith("Gin ")}
        print("pagectl redocheck:", json.dumps(gin, indent=1))
        # Applied by the child: all but the images (VACUUM_PAGE, and SPLIT but for the child
        # of an inner page's split, which gin_mix may not make).
        for kind in set(MADE) - {"Gin VACUUM_PAGE", "Gin SPLIT"}:
            t = gin.get(kind, {})
            assert t.get("checked", 0) > 0 and t["matched"] == t["checked"], (kind, t)
        for kind, t in gin.items():
            assert t["failed"] == 0 and t["unsupported"] == 0 and t["no_base"] == 0, (kind, t)
        assert not report["differences"] and not report["failures"], report
    finally:
        pg.stop()


@pytest.mark.timeout(600)
def test_a_metapage_of_more_fast_update_records_than_one_redo_request_is_served_after_compaction(
        tmp_path, pageserver_factory):
    """Issue 47's finding: a GIN index with fastupdate logs an UPDATE_META_PAGE record of its
    metapage for every row inserted, and the metapage gets no image from the WAL (the record
    initialises it), so its chain grows without bound. Past one redo request's 65536 records
    GetPage rebuilds it in pieces (it failed before: `redo_failed`); compaction images the page
    (it could not while the child refused GIN records), and before and after it the page and
    every other page of the index are served as PostgreSQL's."""
    rows = 66_000
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off"})
    pg.init().start()
    try:
        ps = pageserver_factory(compaction="off", gc_horizon=1 << 40, page_cache_size=0)
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        ps.http_timeout = 300.0
        tenant = ps.create_tenant()
        attach(ps, tenant, pg)
        pg.sql("CREATE TABLE fast (id int, a int[])")
        # A pending list never cleaned up: every row is one more metapage record.
        pg.sql("CREATE INDEX fast_a ON fast USING gin (a) WITH (fastupdate = on, gin_pending_list_limit = 1000000)")
        pg.sql(f"INSERT INTO fast SELECT i, ARRAY[i % 10] FROM generate_series(1, {rows}) i")
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        pg.sql("CHECKPOINT")
        path = pg.sql("select pg_relation_filepath('fast_a')")
        rel, db = int(pg.sql("select pg_relation_filenode('fast_a')")), int(path.split("/")[1])
        data = (pg.datadir / path).read_bytes()
        meta = Key(1663, db, rel, 0, 0)
        assert struct.unpack_from("<q", data, 24 + 16)[0] == rows, "every row is in the pending list"
        with ps.connect(tenant, timeout=120) as conn:
            assert gin_mask(conn.get_page(meta, end)) == gin_mask(data[:8192]), "the metapage, in pieces"
            r = ps.http.request("POST", f"/v1/tenant/{tenant}/compact")
            assert r.status == 200, r.body
            assert r.body["pass"]["image_failures"] == 0 and r.body["pass"]["images_created"] >= 2, r.body
            for blk in range(len(data) // 8192):
                page = conn.get_page(Key(1663, db, rel, 0, blk), end)
                assert gin_mask(page) == gin_mask(data[blk * 8192:(blk + 1) * 8192]), blk
    finally:
        pg.stop()
