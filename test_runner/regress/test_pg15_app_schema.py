"""Every page at the end, in both databases (issue 47): a PostgreSQL 15 primary with an ordinary
application's schema (`fixtures.pg_workloads.app_schema`: bigserial keys; GIN on arrays, jsonb
with both operator classes and trigrams; GiST on trigrams, ranges and points; SP-GiST on
points; hash, BRIN, bloom, partial and expression btrees; a partitioned table, TOAST, an
unlogged table, a refreshed materialized view; VACUUM FULL, REINDEX, TRUNCATE, two-phase commit)
in database `postgres` and in a second one made by `CREATE DATABASE`, followed by a tenant
attached with `PUT /v1/tenant/{id}/wal_source`. After a CHECKPOINT, every block of every relation
of both databases (the catalogs, shared ones included, and the indexes of each access method)
is fetched with GetPage, pipelined, and compared with PostgreSQL's data files:

- main forks (init forks of unlogged relations, whose main forks no WAL names) under
  PostgreSQL's mask for the relation's access method (`fixtures.pgmask`); a sequence's page may
  be logged ahead of the file (`fixtures.redo_check.sequence_logged_ahead`);
- visibility-map forks: no bit the file lacks (`fixtures.redo_check.map_bits_lacking`), and
  none of the file's lost but in the maps of the template's catalogs that `CREATE DATABASE`
  copied into the second database (the copy carries none of their bits, docs/http-api.md);
- the free space map is not compared (not WAL-logged as PostgreSQL keeps it).

The pages are compared as of the CHECKPOINT's redo point: every change before it is in the
files, and a change after it (say, a catalog page pruned by the listing's sessions) is in neither. No
GetPage may fail, but for a map page PostgreSQL extended without WAL that has no bit set (as in
test_pg15_visibility_map.py). Blocks per access method are printed, and each access method,
kind of relation and fork the schema means to cover must have blocks in both databases.
"""

from __future__ import annotations

import collections
import time

import pytest

from fixtures import pg_workloads
from fixtures.page_client import PageServiceError
from fixtures.pgmask import BY_ACCESS_METHOD, seq_mask
from fixtures.postgres import Postgres
from fixtures.redo_check import (fork_pages, map_bits, map_bits_lacking, pipelined, relations,
                                 sequence_logged_ahead)
from fixtures.wal_source import attach, caught_up, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import lsn_int

pytestmark = pytest.mark.timeout(300)

MASKS = BY_ACCESS_METHOD
DATABASES = ["postgres", "app2"]
# What each database's blocks must include: (access method, fork) and the kinds of relation.
COVERED = [(kind, "main") for kind in [*MASKS, "sequence"]] + \
          [(kind, "init") for kind in ["btree", "gin", "gist", "spgist", "hash", "brin", "bloom", "sequence"]] + \
          [("heap", "vm"), ("heap (toast)", "main"), ("heap (matview)", "main")]
PARTITIONS = ["events_jan", "events_feb", "events_mar", "events_other"]
FORK_NAME = {0: "main", 2: "vm", 3: "init"}
# Relations of initdb have OIDs below it: in `app2`, the copies of template1's catalogs.
FIRST_NORMAL_OID = 16384


def test_every_page_of_an_application_schema_matches_postgres_in_both_databases(tmp_path, pageserver_factory):
    began = time.monotonic()
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off", "max_prepared_transactions": "4"}).init().start()
    try:
        # Every LSN of the run stays readable.
        ps = pageserver_factory(gc_horizon=1 << 40)
        ps.allowed_errors.append(".*WAL receiver.*")  # the primary stops before the daemon
        tenant = ps.create_tenant()
        attach(ps, tenant, pg)
        pg_workloads.app_schema(pg)
        pg.sql("CHECKPOINT")
        rels = {db: relations(pg, db) for db in DATABASES}
        increments = {db: dict(map(int, line.split("|")) for line in pg.sql(
            "select seqrelid::int8, seqincrement from pg_sequence", db=db).splitlines()) for db in DATABASES}
        # The listing's sessions may have pruned catalog pages: a second CHECKPOINT writes them,
        # and what comes after its redo point is compared in neither.
        pg.sql("CHECKPOINT")
        at = lsn_int(pg.sql("select redo_lsn from pg_control_checkpoint()"))
        caught_up(ps, tenant, pg)
        print(f"\nworkload and catch-up: {time.monotonic() - began:.0f} s")

        def requests():
            seen = set()
            for db in DATABASES:
                for rel in rels[db]:
                    for fork in [3] if rel.unlogged else [0, 2, 3]:
                        for blk, want in enumerate(fork_pages(pg, rel, fork)):
                            key = rel.key(fork, blk)
                            if key not in seen:  # the shared catalogs, listed in both
                                seen.add(key)
                                yield key, at, (db, rel, key, want)

        blocks = collections.Counter()  # (db, kind, fork): blocks compared
        failures = []
        logged_ahead = unextended_maps = 0
        lost_bits = collections.Counter()  # (db, whether of a catalog): the file's map bits ours lacks
        by_name = collections.Counter()  # (db, relation): blocks compared
        with ps.connect(tenant) as conn:
            for (db, rel, key, want), ours in pipelined(conn, requests()):
                fork = FORK_NAME[key.forknum]
                why = compare(rel, key.forknum, key.blknum, ours, want, increments[db])
                if why == "not extended":
                    unextended_maps += 1
                    continue
                if why == "logged ahead":
                    logged_ahead += 1
                elif why is not None:
                    failures.append((db, rel.name, rel.kind, fork, key.blknum, why))
                if fork == "vm" and not isinstance(ours, PageServiceError) and map_bits(want) > map_bits(ours):
                    lost_bits[(db, rel.oid < FIRST_NORMAL_OID)] += map_bits(want) - map_bits(ours)
                blocks[(db, rel.kind + {"t": " (toast)", "m": " (matview)"}.get(rel.relkind, ""), fork)] += 1
                by_name[(db, rel.name)] += 1

        print(f"every page at the end ({time.monotonic() - began:.0f} s): blocks compared per access method and fork")
        for label, fork in sorted({(k, f) for _, k, f in blocks}):
            print(f"  {label:16} {fork:5} " + "  ".join(f"{db} {blocks[(db, label, fork)]:5}" for db in DATABASES))
        print(f"  sequence pages logged ahead of the file: {logged_ahead}; map pages PostgreSQL extended without"
              f" WAL (no bit): {unextended_maps}; map bits the file has and ours lacks: "
              + ", ".join(f"{db} {'catalogs' if catalog else 'the others'} {n}" for (db, catalog), n in sorted(lost_bits.items())))
        assert not failures, f"{len(failures)} pages differ from PostgreSQL's, e.g. {failures[:10]}"
        missing = [(db, kind, fork) for db in DATABASES for kind, fork in COVERED if blocks[(db, kind, fork)] == 0]
        missing += [(db, name) for db in DATABASES for name in PARTITIONS if by_name[(db, name)] == 0]
        assert not missing, f"the schema no longer covers {missing}"
        # Only the copy of the template's catalogs by CREATE DATABASE loses map bits (docs/http-api.md).
        assert set(lost_bits) <= {("app2", True)}, lost_bits
    finally:
        pg.stop()


def compare(rel, fork: int, blk: int, ours, want: bytes, increments: dict[int, int]) -> str | None:
    """None if our page (or GetPage's error) `ours` of block `blk` of `rel`'s `fork` is what
    PostgreSQL's page `want` says it must be; "logged ahead" for a sequence's page logged ahead
    of the file, "not extended" for a map page no WAL names; else what differs."""
    if isinstance(ours, PageServiceError):
        # A map page PostgreSQL extended (zeros, without WAL) and no record set a bit in.
        if fork == 2 and ours.name == "not_found" and map_bits(want) == 0:
            return "not extended"
        return str(ours)
    if fork == 2:
        extra = map_bits_lacking(ours, want)
        return f"bits the primary lacks at bytes {extra[:5]}" if extra else None
    if rel.kind == "sequence":
        if seq_mask(ours) == seq_mask(want):
            return None
        return sequence_logged_ahead(ours, want, increments[rel.oid]) or "logged ahead"
    mask = MASKS.get(rel.kind)
    if mask is None:
        return "no mask for its access method"
    return None if mask(ours, blk) == mask(want, blk) else "differs"
