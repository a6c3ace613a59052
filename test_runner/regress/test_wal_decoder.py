"""The PostgreSQL 15 WAL decoder (`page_types::wal`, through `pagectl waldump --stats`) against
PostgreSQL's own `pg_waldump --stats` on WAL that a real PostgreSQL 15 wrote: pgbench init, a
10 s pgbench run, DELETEs and VACUUM. Every record in the range must decode (a decode error
fails `pagectl`), and the record count, in total and per resource manager, must equal
PostgreSQL's."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from fixtures.postgres import Postgres


def pg_waldump_stats(pg: Postgres, start: str, end: str) -> dict[str, int]:
    out = pg.waldump(start, end, "--stats")
    counts = {}
    for line in out.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\b", line)
        if m and m.group(1) == "Total":
            counts["__total__"] = int(m.group(2))
        elif m and int(m.group(2)) > 0:  # pg_waldump lists every resource manager, 0 included
            counts[m.group(1)] = int(m.group(2))
    return counts


@pytest.fixture
def recorded_wal(tmp_path):
    """A PostgreSQL 15 that ran pgbench; yields it with the LSN range of that work."""
    pg = Postgres(tmp_path / "pg").init().start()
    try:
        # The slot keeps the WAL of the range from being recycled by the checkpoints.
        pg.sql("select pg_create_physical_replication_slot('keep', true)")
        start = pg.lsn()
        pg.pgbench("-i", "-s", "1", "-q")
        pg.pgbench("-c", "2", "-j", "2", "-T", "10", "-n")
        pg.sql("DELETE FROM pgbench_accounts WHERE aid % 7 = 0")
        pg.sql("VACUUM")
        pg.sql("CHECKPOINT")
        end = pg.lsn()
        yield pg, start, end
    finally:
        pg.stop()


def test_every_record_of_a_pgbench_wal_decodes_and_the_counts_equal_pg_waldump(recorded_wal, bin_dir, tmp_path):
    pg, start, end = recorded_wal
    expected = pg_waldump_stats(pg, start, end)
    assert expected.get("__total__", 0) > 10_000, f"too little WAL to compare: {expected}"
    # The decoder reads copies (the server's files belong to its user and keep changing).
    wal = tmp_path / "wal"
    pg.copy_wal(wal)
    out = subprocess.run(
        [str(bin_dir / "pagectl"), "waldump", "--stats", "--start", start, "--end", end, str(wal)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    got = dict(stats["rmgrs"])
    got["__total__"] = stats["records"]
    assert got == expected, f"pagectl {got}\npg_waldump {expected}"
    # The workload's kinds are all there (a decoder that skipped a kind would not match above,
    # but say what the WAL held).
    for rmgr in ("Heap", "Heap2", "Btree", "Transaction", "XLOG"):
        assert got.get(rmgr, 0) > 0, got
    assert stats["fpi"] > 0, stats
