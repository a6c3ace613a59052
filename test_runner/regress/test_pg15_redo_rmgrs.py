"""PostgreSQL 15 redo in the child of the resource managers beyond heap and btree (issue: every
resource manager), checked against PostgreSQL's own pages. For each, a tenant follows a
primary that runs a workload of `fixtures.pg_workloads` with `wal_consistency_checking` on for
that resource manager; then

- every record at its own LSN (`fixtures.redo_check.check_every_record`, no sampling): each
  check image against GetPage of its block at the record's LSN, masked with PostgreSQL's mask
  for the resource manager (`fixtures.pgmask`); every record type the workload makes must be
  there, and 100% must match;
- the same WAL through `pagectl redocheck` (the child's redo in process, the Rust masks): every
  page of these resource managers checked matches, none fails or is unsupported;
- every page at the end: after CHECKPOINT, GetPage at the latest LSN of every block of the
  relations these records change equals PostgreSQL's data file, masked. A sequence's page is
  compared with what the WAL logged: `nextval` logs the tuple as it will be 32 values on
  (`SEQ_LOG_VALS`) and then changes the page without WAL, so the data file's `last_value` and
  `log_cnt` may differ from the replayed page's, and then they must satisfy
  logged `last_value` = file `last_value` + file `log_cnt` x increment (and the logged
  `log_cnt` is 0); every other byte must be equal (`fixtures.redo_check.sequence_logged_ahead`).
"""

from __future__ import annotations

import pytest

from fixtures import pg_workloads, redo_check
from fixtures.pgmask import brin_mask, generic_mask, seq_mask
from fixtures.postgres import Postgres
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)

# Each test runs a workload on PostgreSQL and checks thousands of pages through the daemon.
pytestmark = pytest.mark.timeout(300)


def follow(tmp_path, pageserver_factory, rmgrs: str):
    """A primary with `wal_consistency_checking` for `rmgrs`, and a daemon tenant following it
    with every LSN kept readable; (pg, ps, tenant, the LSN it follows from)."""
    # Uncompressed images: the check reads thousands of them in Python.
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off", "wal_compression": "off",
                                             "wal_consistency_checking": f"'{rmgrs}'"}).init().start()
    pg.sql("select pg_create_physical_replication_slot('keep', true)")
    ps = pageserver_factory(gc_horizon=1 << 40)
    ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
    tenant = ps.create_tenant()
    start = attach(ps, tenant, pg)["resumed_at"]
    return pg, ps, tenant, start


def assert_redocheck_matches(bin_dir, pg, tmp_path, start: int, end: int, rmgr: str) -> dict:
    """`pagectl redocheck` over [start, end): every page of `rmgr`'s records checked matches;
    its per-type counts of `rmgr`."""
    report = redo_check.redocheck(bin_dir, pg, tmp_path / "wal", start, end)
    mine = {kind: t for kind, t in report["types"].items() if kind.split()[0] == rmgr}
    print(f"\npagectl redocheck, {rmgr}:")
    for kind, t in sorted(mine.items()):
        print(f"  {kind:28} {t['matched']:6}/{t['checked']} failed {t['failed']} unsupported {t['unsupported']} "
              f"no_base {t['no_base']} median {t['median_apply_ns']} ns")
    assert mine and sum(t["checked"] for t in mine.values()) > 0, report["types"]
    for kind, t in mine.items():
        assert t["matched"] == t["checked"] and t["failed"] == 0 and t["unsupported"] == 0, (kind, t, report)
    return mine


def test_sequence_records_match_postgres_at_their_lsn_and_the_logged_state_at_the_end(
        tmp_path, pageserver_factory, bin_dir):
    pg, ps, tenant, start = follow(tmp_path, pageserver_factory, "sequence")
    try:
        pg_workloads.sequences(pg)
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        check = redo_check.check_every_record(ps, tenant, pg, start, end, {"Sequence": seq_mask})
        # 300 nextval of one sequence alone log 10 times.
        assert check.tally.get("Sequence LOG", (0, 0))[1] > 30, check.tally
        assert not check.failures, f"{len(check.failures)} pages differ from PostgreSQL's, e.g. {check.failures[:10]}"
        assert_redocheck_matches(bin_dir, pg, tmp_path, start, end, "Sequence")

        pg.sql("CHECKPOINT")
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        exact = ahead = 0
        failures = []
        with ps.connect(tenant) as conn:
            for db in ("postgres", "seqdb"):
                increments = dict(line.split("|") for line in pg.sql(
                    "select c.relname, s.seqincrement from pg_sequence s join pg_class c on c.oid = s.seqrelid",
                    db=db).splitlines())
                pages = list(redo_check.relation_pages(pg, db, relkind="S"))
                assert len(pages) >= (3 if db == "postgres" else 1), pages
                for key, name, want in pages:
                    ours = conn.get_page(key, end)
                    if seq_mask(ours) == seq_mask(want):
                        exact += 1
                        continue
                    why = redo_check.sequence_logged_ahead(ours, want, int(increments[name]))
                    if why is None:
                        ahead += 1
                    else:
                        failures.append((db, name, why))
        print(f"\nsequence pages at the end: {exact} equal, {ahead} logged ahead of the data file")
        assert not failures, failures
        # seq_down's last change was a setval; the others' a nextval.
        assert exact >= 1 and ahead >= 3, (exact, ahead)
    finally:
        pg.stop()


def test_generic_records_of_bloom_match_postgres_at_their_lsn_and_at_the_end(
        tmp_path, pageserver_factory, bin_dir):
    pg, ps, tenant, start = follow(tmp_path, pageserver_factory, "generic")
    try:
        pg_workloads.bloom(pg)
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        check = redo_check.check_every_record(ps, tenant, pg, start, end, {"Generic": generic_mask})
        # pg_waldump names Generic WAL's one record type "Generic" (generic_identify).
        assert check.tally.get("Generic Generic", (0, 0))[1] > 100, check.tally
        assert not check.failures, f"{len(check.failures)} pages differ from PostgreSQL's, e.g. {check.failures[:10]}"
        assert_redocheck_matches(bin_dir, pg, tmp_path, start, end, "Generic")

        pg.sql("CHECKPOINT")
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        pages = list(redo_check.relation_pages(pg, "postgres", am="bloom"))
        assert len(pages) > 20, len(pages)
        with ps.connect(tenant) as conn:
            differ = [(str(key), name) for key, name, want in pages
                      if generic_mask(conn.get_page(key, end)) != generic_mask(want)]
        assert not differ, f"{len(differ)} of {len(pages)} bloom pages differ, e.g. {differ[:10]}"
    finally:
        pg.stop()


def test_brin_records_match_postgres_at_their_lsn_and_at_the_end(tmp_path, pageserver_factory, bin_dir):
    pg, ps, tenant, start = follow(tmp_path, pageserver_factory, "brin")
    try:
        pg_workloads.brin(pg)
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        # (brin_mask masks BRIN_EVACUATE_PAGE, which PostgreSQL 15's does not: the old page of an
        # evacuation's UPDATEs has it set in its check image, and no record logs it.)
        check = redo_check.check_every_record(ps, tenant, pg, start, end, {"BRIN": brin_mask})
        # Every type and both INIT variants. (A revmap extension that evacuates a regular page
        # moves its tuples with UPDATE records; a new page for one of them is UPDATE+INIT.)
        for kind in ["BRIN CREATE_INDEX", "BRIN INSERT", "BRIN INSERT+INIT", "BRIN UPDATE", "BRIN UPDATE+INIT",
                     "BRIN SAMEPAGE_UPDATE", "BRIN REVMAP_EXTEND", "BRIN DESUMMARIZE"]:
            assert check.tally.get(kind, (0, 0))[1] > 0, f"the workload makes {kind} records: {check.tally}"
        assert not check.failures, f"{len(check.failures)} pages differ from PostgreSQL's, e.g. {check.failures[:10]}"
        assert_redocheck_matches(bin_dir, pg, tmp_path, start, end, "BRIN")

        pg.sql("CHECKPOINT")
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        pages = list(redo_check.relation_pages(pg, "postgres", am="brin"))
        # Each index's metapage, revmap pages (two for br_v's 1600-odd ranges) and regular pages.
        assert len(pages) > 10, len(pages)
        with ps.connect(tenant) as conn:
            differ = [(str(key), name) for key, name, want in pages
                      if brin_mask(conn.get_page(key, end)) != brin_mask(want)]
        assert not differ, f"{len(differ)} of {len(pages)} BRIN pages differ, e.g. {differ[:10]}"
    finally:
        pg.stop()
