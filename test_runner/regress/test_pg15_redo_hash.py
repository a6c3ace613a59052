"""PostgreSQL 15 hash index redo in the child, checked against PostgreSQL's own pages (issue:
native redo for every resource manager): a tenant follows a primary that runs
`fixtures.pg_workloads.hash_index` with `wal_consistency_checking = 'hash'`; then

- every Hash record at its own LSN, all of them (no sampling): each carries PostgreSQL's page
  after it for every block it references (read here by `fixtures.walreader`, not by the
  daemon); GetPage of that block at the next record's LSN must equal it under PostgreSQL's
  `hash_mask` (`fixtures.pgmask`); matched/total per type is printed, every type the workload
  makes must appear and 100% is required;
- every page at the end: after CHECKPOINT, GetPage at the latest LSN of every block of every
  hash index equals the primary's data file under `hash_mask`;
- `pagectl redocheck` over the same WAL (the child's redo in process, masked by
  `walredo_proc::pg15::mask`) matches every Hash block it checks and fails none.
"""

from __future__ import annotations

import collections
import json
import subprocess
import time

import pytest

from fixtures import pg_workloads
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError
from fixtures.pgmask import hash_mask
from fixtures.postgres import Postgres
from fixtures.redo_check import pipelined
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_text, record_types
from fixtures.walreader import Wal

# What `hash_index` makes: every one of the 13 types. (ADD_OVFL_PAGE's new bitmap page, block 3,
# is not among its blocks: a second bitmap page comes only after 32,768 overflow pages, 256 MiB
# of index; the unit tests cover it.)
HASH_TYPES = [
    "INIT_META_PAGE", "INIT_BITMAP_PAGE", "INSERT", "ADD_OVFL_PAGE", "SPLIT_ALLOCATE_PAGE", "SPLIT_PAGE",
    "SPLIT_COMPLETE", "MOVE_PAGE_CONTENTS", "SQUEEZE_PAGE", "DELETE", "SPLIT_CLEANUP", "UPDATE_META_PAGE",
    "VACUUM_ONE_PAGE",
]


# GetPage requests in flight at once (the daemon answers in order).
WINDOW = 32


def start_pg(tmp_path, **settings) -> Postgres:
    # Images uncompressed: the Python reader's PGLZ is too slow for every image of the run.
    return Postgres(tmp_path / "pg", settings={"autovacuum": "off", "wal_compression": "off", **settings}).init().start()


def hash_index_pages(pg: Postgres):
    """(key, PostgreSQL's page) for every block of the main fork of every hash index of database
    `postgres`, from the data files."""
    rows = pg.sql("""
        select pg_relation_filenode(c.oid), coalesce(nullif(c.reltablespace, 0), 1663), d.oid,
               pg_relation_filepath(c.oid)
        from pg_class c cross join pg_database d join pg_am a on a.oid = c.relam
        where d.datname = 'postgres' and a.amname = 'hash'""")
    for line in rows.splitlines():
        rel, spc, db, path = line.split("|")
        data = (pg.datadir / path).read_bytes()
        for blk in range(len(data) // 8192):
            yield Key(int(spc), int(db), int(rel), 0, blk), data[blk * 8192:(blk + 1) * 8192]


@pytest.mark.timeout(600)
def test_every_hash_record_and_page_matches_postgres(tmp_path, pageserver_factory, bin_dir):
    pg = start_pg(tmp_path, wal_consistency_checking="'hash'")
    try:
        pg.sql("select pg_create_physical_replication_slot('keep', true)")
        # Every LSN of the run stays readable.
        ps = pageserver_factory(gc_horizon=1 << 40)
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        tenant = ps.create_tenant()
        start = attach(ps, tenant, pg)["resumed_at"]
        began = time.monotonic()
        pg_workloads.hash_index(pg)
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        print(f"\nworkload and catch-up {time.monotonic() - began:.0f} s")
        types = record_types(pg, start, end)
        lsns = sorted(types)
        next_of = dict(zip(lsns, lsns[1:] + [end]))
        by_type = collections.defaultdict(list)
        for lsn in lsns:
            if types[lsn].startswith("Hash ") and lsn >= start:
                by_type[types[lsn]].append(lsn)
        wal = Wal(pg.wal_dir)
        # GetPage of each check image's block at the next record's LSN, with (type, LSN, key,
        # PostgreSQL's page, whether it is an applied image), read as needed.
        checks = ((key, next_of[lsn], (kind, lsn, key, im.page, im.apply))
                  for kind, records in sorted(by_type.items()) for lsn in records for im in wal.images(lsn)
                  for key in [Key(im.spcnode, im.dbnode, im.relnode, im.fork, im.blkno)])
        tally = collections.defaultdict(lambda: [0, 0])  # type: [matched, total]
        redone = collections.Counter()  # check images of blocks the record is redone on
        failures = []
        with ps.connect(tenant) as conn:
            for (kind, lsn, key, want, applied), page in pipelined(conn, checks, WINDOW):
                tally[kind][1] += 1
                redone[kind] += not applied
                if isinstance(page, PageServiceError):
                    failures.append((kind, lsn_text(lsn), str(key), str(page)))
                elif hash_mask(page, key.blknum) == hash_mask(want, key.blknum):
                    tally[kind][0] += 1
                else:
                    failures.append((kind, lsn_text(lsn), str(key), "differs"))
        print(f"matched/total per record type ({time.monotonic() - began:.0f} s):")
        for kind, (m, t) in sorted(tally.items()):
            print(f"  {kind:28} {m:6}/{t}  ({redone[kind]} by redo, the others full-page images)")
        for name in HASH_TYPES:
            assert tally.get(f"Hash {name}", (0, 0))[1] > 0, f"the workload makes Hash {name} records"
            # SPLIT_PAGE always carries its page (REGBUF_FORCE_IMAGE); every other type is redone.
            assert name == "SPLIT_PAGE" or redone[f"Hash {name}"] > 0, f"Hash {name} is redone somewhere"
        assert not failures, f"{len(failures)} pages differ from PostgreSQL's, e.g. {failures[:10]}"

        # Every page at the end.
        pg.sql("CHECKPOINT")
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        pages = list(hash_index_pages(pg))
        assert len(pages) > 50
        differ = []
        with ps.connect(tenant) as conn:
            for key, want in pages:
                try:
                    page = conn.get_page(key, end)
                except PageServiceError as e:
                    differ.append((str(key), str(e)))
                    continue
                if hash_mask(page, key.blknum) != hash_mask(want, key.blknum):
                    differ.append((str(key), "differs"))
        assert not differ, f"{len(differ)} of {len(pages)} hash pages differ, e.g. {differ[:10]}"

        # The same WAL through `pagectl redocheck`: the child's redo in process, hash-masked.
        out = subprocess.run([str(bin_dir / "pagectl"), "redocheck", "--start", lsn_text(start),
                              "--end", lsn_text(end), "--show", "10", str(pg.wal_dir)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode in (0, 1), out.stderr
        report = json.loads(out.stdout)
        print("pagectl redocheck, matched/checked per Hash type:")
        checked = 0
        for kind, t in sorted(report["types"].items()):
            if kind.startswith("Hash"):
                print(f"  {kind:28} {t['matched']:6}/{t['checked']} failed {t['failed']} unsupported {t['unsupported']}")
                assert t["matched"] == t["checked"] and t["failed"] == 0 and t["unsupported"] == 0, (kind, t)
                checked += t["checked"]
        assert checked >= sum(t for _, t in tally.values()) // 2, "redocheck checks the Hash blocks"
        hash_problems = [d for d in report["differences"] + report["failures"] if d["type"].startswith("Hash")]
        assert not hash_problems, hash_problems
    finally:
        pg.stop()
