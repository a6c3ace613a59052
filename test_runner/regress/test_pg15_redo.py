"""PostgreSQL 15 redo in the child, checked against PostgreSQL's own pages (issue: native
redo): a tenant follows a primary that runs `fixtures.pg_workloads.redo_mix`; then

- every record at its own LSN: with `wal_consistency_checking` on, each Heap, Heap2 and Btree
  record carries PostgreSQL's page after it for each block it changes (read here by
  `fixtures.walreader`, not by the daemon); GetPage of that block at that record's LSN must
  equal it, masked as PostgreSQL's `heap_mask`/`btree_mask` (`fixtures.pgmask`). Records of
  each type are sampled evenly (all of a rare type); matched/total per type is printed and
  100% is required;
- in time: the hottest page at 5 LSNs spread over the run equals the check image of the last
  record that changed it at or below each;
- every page at the end: after CHECKPOINT, GetPage at the latest LSN of every block of every
  relation fork (heap, index, visibility map; not the free space map, which PostgreSQL does not
  WAL-log) equals the primary's data file, masked; also after a kill -9 of the daemon in the
  middle of the workload and of a redo child while pages are read.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

from fixtures import pg_workloads, redo_check
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError
from fixtures.pgmask import btree_mask, heap_mask, lsn_mask
from fixtures.postgres import Postgres
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_text, record_types, waldump_records
from fixtures.walreader import Wal

# How many records of one type are checked (evenly spaced over the run).
PER_TYPE = 60
MASKS = {"Heap": heap_mask, "Heap2": heap_mask, "Btree": btree_mask}


def start_pg(tmp_path, **settings) -> Postgres:
    return Postgres(tmp_path / "pg", settings={"autovacuum": "off", "wal_compression": "pglz", **settings}).init().start()


def test_every_record_matches_postgres_check_image_at_its_lsn(tmp_path, pageserver_factory):
    pg = start_pg(tmp_path, wal_consistency_checking="'heap,heap2,btree'")
    try:
        pg.sql("select pg_create_physical_replication_slot('keep', true)")
        # Every LSN of the run stays readable (the checked WAL is large: check images).
        ps = pageserver_factory(gc_horizon=1 << 40)
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        tenant = ps.create_tenant()
        start = attach(ps, tenant, pg)["resumed_at"]
        pg_workloads.redo_mix(pg, seconds=1)
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        types = record_types(pg, start, end)
        lsns = sorted(types)
        next_of = dict(zip(lsns, lsns[1:] + [end]))
        by_type = collections.defaultdict(list)
        for lsn in lsns:
            if types[lsn].split()[0] in MASKS and lsn >= start:
                by_type[types[lsn]].append(lsn)
        wal = Wal(pg.wal_dir)
        tally = {}
        failures = []
        with ps.connect(tenant) as conn:
            for kind, records in sorted(by_type.items()):
                step = max(1, len(records) // PER_TYPE)
                matched = total = 0
                for lsn in records[::step]:
                    for image in wal.images(lsn):
                        if image.fork == 1:
                            continue  # the free space map: never a record's page here
                        key = Key(image.spcnode, image.dbnode, image.relnode, image.fork, image.blkno)
                        mask = MASKS[kind.split()[0]]
                        total += 1
                        try:
                            page = conn.get_page(key, next_of[lsn])
                        except PageServiceError as e:
                            failures.append((kind, lsn_text(lsn), str(key), str(e)))
                            continue
                        if mask(page, key.blknum) == mask(image.page, key.blknum):
                            matched += 1
                        else:
                            failures.append((kind, lsn_text(lsn), str(key), "differs"))
                tally[kind] = (matched, total)
        print("\nmatched/total per record type:")
        for kind, (m, t) in sorted(tally.items()):
            print(f"  {kind:28} {m:6}/{t}")
        assert sum(t for _, t in tally.values()) > 500
        for kind in ["Heap INSERT", "Heap HOT_UPDATE", "Heap UPDATE", "Heap DELETE", "Heap LOCK",
                     "Heap2 PRUNE", "Heap2 VACUUM", "Heap2 VISIBLE", "Heap2 MULTI_INSERT+INIT",
                     "Btree INSERT_LEAF", "Btree SPLIT_L", "Btree SPLIT_R", "Btree DEDUP", "Btree VACUUM"]:
            assert tally.get(kind, (0, 0))[1] > 0, f"the workload makes {kind} records"
        assert not failures, f"{len(failures)} pages differ from PostgreSQL's, e.g. {failures[:10]}"

        # In time: the hottest page (pgbench_branches' only one) at 5 LSNs spread over the run
        # equals PostgreSQL's check image of the last record that changed it at or below each.
        dbnode = int(pg.sql("select oid from pg_database where datname = 'postgres'"))
        hot = Key(1663, dbnode, int(pg.sql("select pg_relation_filenode('pgbench_branches')")), 0, 0)
        touching = [lsn for lsn, refs, _, _ in waldump_records(pg, start, end)
                    if any(k == hot for k, _ in refs) and types.get(lsn, "").split()[0] in MASKS]
        assert len(touching) > 100, "pgbench updates its branch row in every transaction"
        with ps.connect(tenant) as conn:
            for i in range(5):
                at = touching[(len(touching) - 1) * i // 4]
                image = next(im for im in wal.images(at)
                             if (im.spcnode, im.dbnode, im.relnode, im.fork, im.blkno) ==
                             (hot.spcnode, hot.dbnode, hot.relnode, hot.forknum, hot.blknum))
                page = conn.get_page(hot, next_of[at])
                assert heap_mask(page) == heap_mask(image.page), (i, lsn_text(at))
    finally:
        pg.stop()


def relation_pages(pg: Postgres):
    """(key, mask, PostgreSQL's page) for every block of the main, init and visibility-map forks
    of every relation of database `postgres` (shared catalogs included), from the data files;
    the heap mask for tables, the btree mask for btree indexes, the LSN mask for the maps."""
    rows = pg.sql("""
        select pg_relation_filenode(c.oid), coalesce(nullif(c.reltablespace, 0), 1663),
               case when c.reltablespace = 1664 then 0 else d.oid end,
               pg_relation_filepath(c.oid), coalesce(a.amname, 'heap')
        from pg_class c cross join pg_database d left join pg_am a on a.oid = c.relam
        where d.datname = 'postgres' and pg_relation_filenode(c.oid) is not null""")
    for line in rows.splitlines():
        rel, spc, db, path, am = line.split("|")
        if am not in ("heap", "btree"):
            continue
        for fork, suffix, mask in [(0, "", heap_mask if am == "heap" else btree_mask), (2, "_vm", lsn_mask),
                                   (3, "_init", heap_mask if am == "heap" else btree_mask)]:
            for blk, page in enumerate(redo_check.file_pages(pg, path + suffix)):
                yield Key(int(spc), int(db), int(rel), fork, blk), mask, page


def test_every_page_at_the_end_matches_the_data_files_also_after_kill_9(tmp_path, pageserver_factory):
    pg = start_pg(tmp_path)
    try:
        ps = pageserver_factory()
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        ps.allowed_errors.append(".*walredo.*")  # the redo child killed
        tenant = ps.create_tenant()
        attach(ps, tenant, pg)
        # The daemon is killed while the workload runs, and comes back.
        load = threading.Thread(target=pg_workloads.redo_mix, args=(pg,), kwargs={"seconds": 3})
        load.start()
        time.sleep(1.5)
        # A kill -9 in the middle of a write leaves a torn tail that the restart cuts (and logs).
        ps.allowed_errors.append(r"(?i)torn tail")
        ps.kill()
        time.sleep(0.3)
        ps.start()
        load.join(timeout=300)
        assert not load.is_alive()
        end = caught_up(ps, tenant, pg)["wal_source"]["durable_lsn"]
        pg.sql("CHECKPOINT")
        pages = list(relation_pages(pg))
        assert len(pages) > 3000
        failures = []
        killed = False
        with ps.connect(tenant) as conn:
            for i, (key, mask, want) in enumerate(pages):
                if i == len(pages) // 2 and not killed:
                    # A redo child killed while pages are read: the next request gets another.
                    for child in ps.redo_children():
                        os.kill(child.pid, signal.SIGKILL)
                        killed = True
                for attempt in range(3):
                    try:
                        page = conn.get_page(key, end)
                        break
                    except PageServiceError as e:
                        if e.name == "not_found" and want == bytes(8192):
                            # Under extension lock contention PostgreSQL 15 extends a heap by
                            # extra blocks without WAL (RelationAddExtraBlocks); such a page stays
                            # all zeros in the data files until a record initializes it, and no
                            # WAL names it: nothing for the daemon to know.
                            page = None
                            break
                        if attempt == 2 or e.name not in ("internal", "redo_failed"):
                            failures.append((str(key), str(e)))
                            page = None
                            break
                if page is not None and mask(page, key.blknum) != mask(want, key.blknum):
                    failures.append((str(key), "differs"))
        assert killed, "a redo child was killed mid-way"
        assert not failures, f"{len(failures)} of {len(pages)} pages differ, e.g. {failures[:10]}"
    finally:
        pg.stop()
