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

import json

import pytest

from fixtures import pg_workloads
from fixtures.page_client import PageServiceError
from fixtures.pgmask import gist_mask
from fixtures.postgres import Postgres
from fixtures.redo_check import check_every_record, pipelined, redocheck, relation_pages
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)

# The record types gist_mix makes, each of which must be checked at least once.
MADE = ["Gist PAGE_UPDATE", "Gist PAGE_SPLIT", "Gist DELETE", "Gist PAGE_DELETE"]


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
        check = check_every_record(ps, tenant, pg, start, end, {"Gist": gist_mask})
        tally = {kind: t for kind, (_, t) in check.tally.items()}
        for kind in MADE:
            assert tally.get(kind, 0) > 0, f"the workload makes {kind} records"
        assert tally["Gist PAGE_SPLIT"] > 50 and tally["Gist PAGE_DELETE"] > 5
        assert not check.failures, f"{len(check.failures)} pages differ from PostgreSQL's, e.g. {check.failures[:10]}"

        # Every page at the end, against the data files.
        pg.sql("CHECKPOINT")
        pages = list(relation_pages(pg, "postgres", am="gist"))
        assert len(pages) > 150
        differ = []
        with ps.connect(tenant) as conn:
            for (key, _, want), page in pipelined(conn, ((p[0], end, p) for p in pages)):
                if isinstance(page, PageServiceError):
                    differ.append((str(key), str(page)))
                elif gist_mask(page) != gist_mask(want):
                    differ.append((str(key), "differs"))
        print(f"every page at the end: {len(pages) - len(differ)}/{len(pages)} GiST pages match")
        assert not differ, f"{len(differ)} of {len(pages)} pages differ, e.g. {differ[:10]}"

        # The same WAL through pagectl redocheck.
        report = redocheck(ps.bin.parent, pg, tmp_path / "wal", start, end)
        gist = {k: v for k, v in report["types"].items() if k.startswith("Gist ")}
        print("pagectl redocheck:", json.dumps(gist, indent=1))
        for kind in MADE:
            t = gist.get(kind, {})
            assert t.get("checked", 0) > 0 and t["matched"] == t["checked"], (kind, t)
            assert t["failed"] == 0 and t["unsupported"] == 0 and t["no_base"] == 0, (kind, t)
        assert not report["differences"] and not report["failures"], report
    finally:
        pg.stop()
