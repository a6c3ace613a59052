"""The pageserver's replication client (`postgres/pq.rs`, driven by `pagectl
receivewal`) against a real PostgreSQL 15: the WAL it streams is byte for byte what the server
wrote into its own `pg_wal`, it decodes like PostgreSQL's, the slot it reports to keeps what it
has not made durable, and SCRAM authentication works with the right password and fails
clearly with a wrong one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fixtures.postgres import Postgres
from fixtures.util import wait_until


def lsn_int(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def segment_bytes(wal_dir: Path, start: int, end: int, seg_size: int = 16 << 20, tli: int = 1) -> bytes:
    """WAL bytes [start, end) read from the segment files of `wal_dir`."""
    out = bytearray()
    at = start
    while at < end:
        segno, offset = divmod(at, seg_size)
        n = min(end - at, seg_size - offset)
        name = f"{tli:08X}{segno // (0x100000000 // seg_size):08X}{segno % (0x100000000 // seg_size):08X}"
        with open(wal_dir / name, "rb") as f:
            f.seek(offset)
            chunk = f.read(n)
        assert len(chunk) == n, f"{name} is short at {offset}"
        out += chunk
        at += n
    return bytes(out)


def receivewal(bin_dir, pg: Postgres, dest: Path, *args: str, user: str = "postgres", password: str | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    source = pg.connstr(user=user, **({"password": password} if password else {}))
    out = subprocess.run(
        [str(bin_dir / "pagectl"), "receivewal", "--source", source, "--dir", str(dest), *args],
        capture_output=True, text=True, timeout=120,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


@pytest.fixture
def pg(tmp_path):
    pg = Postgres(tmp_path / "pg").init()
    # A replication role that must authenticate with SCRAM over TCP (first matching line wins).
    hba = pg.datadir / "pg_hba.conf"
    hba.write_text("host replication rep 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    pg.start()
    yield pg
    pg.stop()


def test_streamed_wal_is_byte_identical_to_pg_wal_and_decodes_like_postgres(pg, bin_dir, tmp_path):
    pg.sql("select pg_create_physical_replication_slot('ps', true)")
    start = pg.lsn()
    pg.pgbench("-i", "-s", "1", "-q")
    pg.pgbench("-c", "2", "-j", "2", "-T", "3", "-n")
    end = pg.lsn()
    dest = tmp_path / "received"
    # From the start of the segment, as pg_receivewal does: the files are whole from there.
    seg_start = lsn_int(start) - lsn_int(start) % (16 << 20)
    seg_start_text = f"{seg_start >> 32:X}/{seg_start & 0xFFFFFFFF:X}"
    out = receivewal(bin_dir, pg, dest, "--slot", "ps", "--start", seg_start_text, "--end", end)
    summary = json.loads(out.stdout)
    assert (summary["start"], summary["end"], summary["timeline"]) == (seg_start_text, end, 1), summary
    assert summary["created_slot"] is False
    got = segment_bytes(dest, seg_start, lsn_int(end))
    want = segment_bytes(pg.wal_dir, seg_start, lsn_int(end))
    assert len(got) == lsn_int(end) - seg_start > 1 << 20
    assert got == want, "the streamed WAL differs from pg_wal"
    # The slot was told what is durable here (the server takes the last status update in).
    wait_until(lambda: lsn_int(pg.sql("select restart_lsn from pg_replication_slots where slot_name = 'ps'"))
               >= lsn_int(end), timeout=10, desc="the slot's restart_lsn to reach the end")
    # Our decoder reads the streamed copy like PostgreSQL reads its own.
    dump = subprocess.run([str(bin_dir / "pagectl"), "waldump", "--stats", "--start", start, "--end", end, str(dest)],
                          capture_output=True, text=True, timeout=120)
    assert dump.returncode == 0, dump.stderr
    theirs = pg.waldump(start, end, "--stats")
    total = next(int(line.split()[1]) for line in theirs.splitlines() if line.startswith("Total"))
    assert json.loads(dump.stdout)["records"] == total


def test_a_missing_slot_is_created_and_scram_authenticates(pg, bin_dir, tmp_path):
    pg.sql("create role rep with replication login password 'sekret'")
    start = pg.lsn()
    pg.sql("create table t as select generate_series(1, 1000) i")
    end = pg.lsn()
    out = receivewal(bin_dir, pg, tmp_path / "r", "--slot", "fresh", "--start", start, "--end", end,
                     user="rep", password="sekret")
    assert json.loads(out.stdout)["created_slot"] is True
    assert pg.sql("select slot_type from pg_replication_slots where slot_name = 'fresh'") == "physical"
    bad = receivewal(bin_dir, pg, tmp_path / "bad", "--slot", "fresh", "--start", start, "--end", end,
                     user="rep", password="wrong", check=False)
    assert bad.returncode == 1
    assert "password authentication failed" in bad.stderr, bad.stderr
    assert "wrong" not in bad.stderr
    none = receivewal(bin_dir, pg, tmp_path / "none", "--slot", "fresh", user="rep", check=False)
    assert none.returncode == 1 and "password" in none.stderr, none.stderr
