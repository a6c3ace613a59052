"""GiST redo in the child (walredo-proc's `pg15::gist`), checked against PostgreSQL 15's own
pages (issue 47): a tenant follows a primary that runs `fixtures.pg_workloads.gist_mix` with
`wal_consistency_checking = 'gist'`; then

- every GiST record at its own LSN, none skipped: each carries PostgreSQL's page after it for
  each block it changes (a check image, read here by `fixtures.walreader`, not by the daemon);
  GetPage of that block at the next record's LSN must equal it, both masked as PostgreSQL's
  `gist_mask` (`fixtures.pgmask`); matched/total per record type is printed, every type the
  workload makes must appear and 100% must match;
- every page at the end: after CHECKPOINT, GetPage at the latest LSN of every block of every
  GiST index equals the primary's data file, masked;
- `pagectl redocheck` over the same WAL (the child's redo in process, `walredo_proc`'s own
  masks): every GiST block value checked matches, none fails.

PAGE_REUSE and ASSIGN_LSN reference no block: the daemon stores nothing for them, there is no
page to check (ASSIGN_LSN is only written for relations that skip WAL, PAGE_REUSE when a split
reuses a deleted page). The WAL is not compressed here: every image is read, and PGLZ in Python
would take minutes.
"""

from __future__ import annotations

import collections
import json
import subprocess

import pytest

from fixtures import pg_workloads
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError
from fixtures.pgmask import gist_mask
from fixtures.postgres import Postgres
from fixtures.redo_check import pipelined
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_text, record_types
from fixtures.walreader import Wal

# The record types gist_mix makes, each of which must be checked at least once.
MADE = ["Gist PAGE_UPDATE", "Gist PAGE_SPLIT", "Gist DELETE", "Gist PAGE_DELETE"]


def gist_pages(pg: Postgres):
    """(key, PostgreSQL's page) for every block of the main fork of every GiST index of
    database `postgres`, from the data files."""
    rows = pg.sql("""
        select pg_relation_filenode(c.oid), coalesce(nullif(c.reltablespace, 0), 1663), d.oid,
               pg_relation_filepath(c.oid)
        from pg_class c cross join pg_database d join pg_am a on a.oid = c.relam
        where d.datname = 'postgres' and a.amname = 'gist' and c.relkind = 'i'""")
    for line in rows.splitlines():
        rel, spc, db, path = line.split("|")
        data = (pg.datadir / path).read_bytes()
        for seg in range(1, 1000):
            more = pg.datadir / f"{path}.{seg}"
            if not more.exists():
                break
            data += more.read_bytes()
        for blk in range(len(data) // 8192):
            yield Key(int(spc), int(db), int(rel), 0, blk), data[blk * 8192:(blk + 1) * 8192]


@pytest.mark.timeout(600)
def test_every_gist_record_and_page_matches_postgres(tmp_path, pageserver_factory):
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off", "wal_consistency_checking": "'gist'"})
    pg.init().start()
    try:
        pg.sql("select pg_create_physical_replication_slot('keep', true)")
        # Every LSN of the run stays readable.
        ps = pageserver_factory(gc_horizon=1 << 40)
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        tenant = ps.create_tenant()
        start = attach(ps, tenant, pg)["resumed_at"]
        pg_workloads.gist_mix(pg)
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        types = record_types(pg, start, end)
        lsns = sorted(types)
        next_of = dict(zip(lsns, lsns[1:] + [end]))
        wal = Wal(pg.wal_dir)
        tally = collections.Counter()
        matched = collections.Counter()
        failures = []
        def requests():
            for lsn in lsns:
                kind = types[lsn]
                if kind.startswith("Gist ") and lsn >= start:
                    for image in wal.images(lsn):
                        key = Key(image.spcnode, image.dbnode, image.relnode, image.fork, image.blkno)
                        yield key, next_of[lsn], (kind, lsn, key, image.page)

        with ps.connect(tenant) as conn:
            for (kind, lsn, key, want), page in pipelined(conn, requests()):
                tally[kind] += 1
                if isinstance(page, PageServiceError):
                    failures.append((kind, lsn_text(lsn), str(key), str(page)))
                elif gist_mask(page) == gist_mask(want):
                    matched[kind] += 1
                else:
                    failures.append((kind, lsn_text(lsn), str(key), "differs"))
        print("\nmatched/total per record type (every GiST record):")
        for kind in sorted(tally):
            print(f"  {kind:20} {matched[kind]:6}/{tally[kind]}")
        for kind in MADE:
            assert tally[kind] > 0, f"the workload makes {kind} records"
        assert tally["Gist PAGE_SPLIT"] > 50 and tally["Gist PAGE_DELETE"] > 5
        assert not failures, f"{len(failures)} pages differ from PostgreSQL's, e.g. {failures[:10]}"

        # Every page at the end, against the data files.
        pg.sql("CHECKPOINT")
        pages = list(gist_pages(pg))
        assert len(pages) > 150
        differ = []
        with ps.connect(tenant) as conn:
            for key, want in pages:
                try:
                    page = conn.get_page(key, end)
                except PageServiceError as e:
                    differ.append((str(key), str(e)))
                    continue
                if gist_mask(page) != gist_mask(want):
                    differ.append((str(key), "differs"))
        print(f"every page at the end: {len(pages) - len(differ)}/{len(pages)} GiST pages match")
        assert not differ, f"{len(differ)} of {len(pages)} pages differ, e.g. {differ[:10]}"

        # The same WAL through pagectl redocheck.
        out = subprocess.run([str(ps.bin.parent / "pagectl"), "redocheck", "--start", lsn_text(start),
                              "--end", lsn_text(end), str(pg.wal_dir)], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode in (0, 1) and out.stdout.strip(), out.stderr
        report = json.loads(out.stdout)
        gist = {k: v for k, v in report["types"].items() if k.startswith("Gist ")}
        print("pagectl redocheck:", json.dumps(gist, indent=1))
        for kind in MADE:
            t = gist.get(kind, {})
            assert t.get("checked", 0) > 0 and t["matched"] == t["checked"], (kind, t)
            assert t["failed"] == 0 and t["unsupported"] == 0 and t["no_base"] == 0, (kind, t)
        assert not report["differences"] and not report["failures"], report
    finally:
        pg.stop()
