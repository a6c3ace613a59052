"""SP-GiST redo in the child (walredo-proc's `pg15::spgist`), checked against PostgreSQL 15's
own pages (issue 47): a tenant follows a primary that runs `fixtures.pg_workloads.spgist_mix`
with `wal_consistency_checking = 'spgist'` and uncompressed WAL; then

- every SPGist record at its own LSN, none skipped (`fixtures.redo_check.check_every_record`):
  each check image against GetPage of its block at the record's LSN, both masked as
  PostgreSQL's `spg_mask` (`fixtures.pgmask`); matched/total per record type is printed, every
  type the workload makes must appear and 100% must match;
- the same WAL through `pagectl redocheck` (the child's redo in process, the Rust masks);
- every page at the end: after CHECKPOINT, GetPage at the latest LSN of every block of every
  SP-GiST index equals the primary's data file, masked (the metapage's cache of last-used
  pages, which is not WAL-logged, masked too).

All eight record types are made. The build path's variants (placeholders instead of redirects
while `isBuild`) are not: an index built on a filled table is WAL-logged as full-page images
(`log_newpage_range`), so the records never carry `isBuild` in PostgreSQL 15; the unit tests
cover them.
"""

from __future__ import annotations

import pytest

from fixtures import pg_workloads, redo_check
from fixtures.page_client import PageServiceError
from fixtures.pgmask import spg_mask
from fixtures.postgres import Postgres
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)

# Every record type of spgxlog.c; spgist_mix makes each.
MADE = ["SPGist ADD_LEAF", "SPGist MOVE_LEAFS", "SPGist ADD_NODE", "SPGist SPLIT_TUPLE", "SPGist PICKSPLIT",
        "SPGist VACUUM_LEAF", "SPGist VACUUM_ROOT", "SPGist VACUUM_REDIRECT"]


@pytest.mark.timeout(600)
def test_every_spgist_record_and_page_matches_postgres(tmp_path, pageserver_factory, bin_dir):
    # Uncompressed images: the check reads thousands of them in Python.
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off", "wal_compression": "off",
                                             "wal_consistency_checking": "'spgist'"}).init().start()
    try:
        pg.sql("select pg_create_physical_replication_slot('keep', true)")
        # Every LSN of the run stays readable.
        ps = pageserver_factory(gc_horizon=1 << 40)
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        tenant = ps.create_tenant()
        start = attach(ps, tenant, pg)["resumed_at"]
        pg_workloads.spgist_mix(pg, seconds=0)
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]

        check = redo_check.check_every_record(ps, tenant, pg, start, end, {"SPGist": spg_mask})
        for kind in MADE:
            assert check.tally.get(kind, (0, 0))[1] > 0, f"the workload makes {kind} records: {check.tally}"
        assert check.tally["SPGist PICKSPLIT"][1] > 20 and check.tally["SPGist ADD_LEAF"][1] > 1000, check.tally
        assert not check.failures, f"{len(check.failures)} pages differ from PostgreSQL's, e.g. {check.failures[:10]}"

        report = redo_check.redocheck(bin_dir, pg, tmp_path / "wal", start, end)
        mine = {kind: t for kind, t in report["types"].items() if kind.startswith("SPGist ")}
        print("\npagectl redocheck, SPGist:")
        for kind, t in sorted(mine.items()):
            print(f"  {kind:28} {t['matched']:6}/{t['checked']} failed {t['failed']} unsupported {t['unsupported']}"
                  f" no_base {t['no_base']}")
        for kind in MADE:
            t = mine.get(kind, {})
            assert t.get("checked", 0) > 0 and t["matched"] == t["checked"], (kind, t)
            assert t["failed"] == 0 and t["unsupported"] == 0 and t["no_base"] == 0, (kind, t)
        assert not report["differences"] and not report["failures"], report

        # Every page at the end, against the data files.
        pg.sql("CHECKPOINT")
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        pages = list(redo_check.relation_pages(pg, "postgres", am="spgist"))
        assert len(pages) > 60, len(pages)
        differ = []
        with ps.connect(tenant) as conn:
            for key, name, want in pages:
                try:
                    page = conn.get_page(key, end)
                except PageServiceError as e:
                    differ.append((name, str(key), str(e)))
                    continue
                if spg_mask(page) != spg_mask(want):
                    differ.append((name, str(key), "differs"))
        print(f"every page at the end: {len(pages) - len(differ)}/{len(pages)} SP-GiST pages match")
        assert not differ, f"{len(differ)} of {len(pages)} pages differ, e.g. {differ[:10]}"
    finally:
        pg.stop()
