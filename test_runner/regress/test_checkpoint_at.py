"""The start point of a base backup (docs/rfcs/0008-postgresql-out.md, step 1), on a real,
unpatched PostgreSQL 15: `pagectl checkpoint-at --lsn X` rewrites a copy of a cleanly stopped
data directory (one WAL segment with a shutdown checkpoint at X', `pg_control` pointing at it),
and PostgreSQL starts on it.

One `initdb`, a table with rows, a clean stop at the shutdown checkpoint S; then for each X (the
end of S's record; mid-page; where the 114-byte record crosses a page; a page boundary; a
segment boundary; just before a segment's end, where the record does not fit and X' is the next
segment's first record position), on a fresh copy: `pg_waldump -s X'` (and from the start of
X''s page) finds the checkpoint; `pg_controldata` shows X' and otherwise what it showed before
(but the times); PostgreSQL starts as a primary ("database system was shut down"), reads the
rows and takes an INSERT; after a kill -9 of the postmaster the directory is refused (not shut
down cleanly), and PostgreSQL recovers from X' by replaying its own WAL, the row included. Once
more with `standby.signal`: read-only at once, then `pg_promote()` and writes. And the
refusals: X below the checkpoint's redo."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from fixtures.postgres import WAL_SEGMENT_BYTES, Postgres
from fixtures.util import all_processes, proc_info, wait_until
from fixtures.waldump import lsn_int, lsn_text

PAGE = 8192
SEG = WAL_SEGMENT_BYTES
RECORD_LEN = 114  # a checkpoint record: 24-byte header, 2-byte data header, 88-byte CheckPoint
ROWS = 1000


def segment_name(lsn: int, timeline: int = 1) -> str:
    segno = lsn // SEG
    per_id = (1 << 32) // SEG
    return f"{timeline:08X}{segno // per_id:08X}{segno % per_id:08X}"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A PostgreSQL 15 cluster with a table of ROWS rows, stopped cleanly; with S, its shutdown
    checkpoint's LSN, and pg_controldata's view of it."""
    pg = Postgres(tmp_path_factory.mktemp("checkpoint-at") / "origin").init().start()
    try:
        pg.sql(f"CREATE TABLE t (i int PRIMARY KEY, v text); "
               f"INSERT INTO t SELECT g, repeat('x', 100) FROM generate_series(1, {ROWS}) g")
    finally:
        pg.stop()
    before = pg.controldata()
    assert before["Database cluster state"] == "shut down"
    s = lsn_int(before["Latest checkpoint location"])
    assert lsn_int(before["Latest checkpoint's REDO location"]) == s
    return pg, s, before


def copy_of(stopped_pg: Postgres, base: Path, **settings: str) -> Postgres:
    """A copy of the stopped cluster in `base`, with its own port and socket. Commits are
    flushed before they return: the tests kill -9 the server after an INSERT."""
    copy = Postgres(base, settings={**stopped_pg.settings_elsewhere(), "synchronous_commit": "on", **settings})
    copy._make_dirs()
    subprocess.run(["cp", "-a", str(stopped_pg.datadir), str(copy.datadir)], check=True, timeout=60)
    copy._write_settings()  # the copied postgresql.conf names the origin's port: later lines win
    return copy


def checkpoint_at(bin_dir: Path, pg: Postgres, x: int) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_dir / "pagectl"), "checkpoint-at", "--lsn", lsn_text(x), str(pg.datadir)],
                          capture_output=True, text=True, timeout=60)


def kill_postmaster(pg: Postgres) -> None:
    """SIGKILL of the postmaster, then a wait until it and its children are gone (a child may
    stay a zombie: it no longer holds shared memory; the postmaster may not, or the next one
    takes its pid in postmaster.pid for a live server)."""
    pid = int((pg.datadir / "postmaster.pid").read_text().split()[0])
    postmaster = proc_info(pid)
    assert postmaster is not None, f"no postmaster {pid}"
    children = [p for p in all_processes() if p.ppid == pid]
    os.kill(pid, signal.SIGKILL)

    def gone() -> bool:
        now = proc_info(pid)
        if now is not None and now.starttime == postmaster.starttime:
            return False
        return all((now := proc_info(c.pid)) is None or now.starttime != c.starttime or now.state in "ZX"
                   for c in children)

    wait_until(gone, timeout=30, desc=f"the killed postmaster {pid} and its children to be gone")
    pg.started = False


def page_start(lsn: int) -> int:
    return lsn - lsn % PAGE


def start_lsn(x: int) -> int:
    """X' as the RFC states it: X to 8 bytes, past a page header (40 bytes at a segment start,
    24 otherwise); the next segment's first record position when the record does not fit."""
    at = -(-x // 8) * 8
    header = 40 if page_start(at) % SEG == 0 else 24
    at = max(at, page_start(at) + header)
    end, left = at, RECORD_LEN
    while True:
        n = min(left, PAGE - end % PAGE)
        end, left = end + n, left - n
        if left == 0:
            return at
        if end % SEG == 0:
            return end + 40
        end += 24


def cases(s: int) -> dict[str, tuple[int, int]]:
    """The X of each case and the X' expected, written out (`start_lsn` is checked against
    them). All but the first are in the segments after S's, so that they are above S whatever
    S is."""
    base = s - s % SEG + SEG  # the segment after S's
    return {
        "end_of_S": (s + RECORD_LEN, start_lsn(s + RECORD_LEN)),
        "mid_page": (base + 3 * PAGE + 0x3A3, base + 3 * PAGE + 0x3A8),
        "record_crosses_a_page": (base + 5 * PAGE - 0x2E, base + 5 * PAGE - 0x28),
        "page_boundary": (base + 7 * PAGE, base + 7 * PAGE + 24),
        "segment_boundary": (base + SEG, base + SEG + 40),
        "segment_end_no_room": (base + 2 * SEG - 0x44, base + 2 * SEG + 40),
    }


def check_start_point(bin_dir: Path, pg: Postgres, x: int, expected: int, before: dict[str, str]) -> dict:
    """Runs checkpoint-at on `pg` (stopped) and checks the files it wrote with PostgreSQL's own
    tools; returns its JSON."""
    old_segments = sorted(p.name for p in pg.wal_dir.iterdir() if len(p.name) == 24)
    out = checkpoint_at(bin_dir, pg, x)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["requested"] == lsn_text(x)
    assert result["checkpoint"] == lsn_text(expected), f"X {lsn_text(x)}"
    assert start_lsn(x) == expected
    end = lsn_int(result["end"])
    crosses = page_start(expected) != page_start(end - 1)
    assert end == expected + RECORD_LEN + (24 if crosses else 0)
    assert result["segment"] == f"pg_wal/{segment_name(expected)}"
    assert result["removed"] == [f"pg_wal/{name}" for name in old_segments]
    assert sorted(p.name for p in pg.wal_dir.iterdir() if len(p.name) == 24) == [segment_name(expected)]

    # pg_waldump finds the record at X', and from the start of X''s page (the continuation the
    # page header claims leads to it).
    for start in (expected, page_start(expected)):
        dump = pg.run("pg_waldump", "-p", str(pg.wal_dir), "-s", lsn_text(start), "-e", lsn_text(end)).stdout
        lines = [line for line in dump.splitlines() if line.startswith("rmgr:")]
        assert len(lines) == 1, dump
        assert f"lsn: {expected >> 32:X}/{expected & 0xFFFFFFFF:08X}, prev 0/00000000" in lines[0], lines[0]
        assert f"CHECKPOINT_SHUTDOWN redo {lsn_text(expected)}; tli 1; prev tli 1;" in lines[0], lines[0]
        assert lines[0].endswith("; shutdown"), lines[0]

    # pg_control: X', and what it said before but for the times.
    after = pg.controldata()
    assert after["Latest checkpoint location"] == lsn_text(expected)
    assert after["Latest checkpoint's REDO location"] == lsn_text(expected)
    assert after["Latest checkpoint's REDO WAL file"] == segment_name(expected)
    changed = {"Latest checkpoint location", "Latest checkpoint's REDO location", "Latest checkpoint's REDO WAL file",
               "pg_control last modified", "Time of latest checkpoint"}
    assert {k: v for k, v in after.items() if k not in changed} == {k: v for k, v in before.items() if k not in changed}
    return result


@pytest.mark.parametrize("case", ["end_of_S", "mid_page", "record_crosses_a_page", "page_boundary",
                                  "segment_boundary", "segment_end_no_room"])
def test_postgresql_starts_at_x_and_recovers_its_own_wal_after_a_crash(stopped, bin_dir, tmp_path, case):
    origin, s, before = stopped
    x, expected = cases(s)[case]
    pg = copy_of(origin, tmp_path / "pg")
    try:
        check_start_point(bin_dir, pg, x, expected, before)

        pg.start()
        log = pg.logfile.read_text()
        assert "database system was shut down at" in log, log
        assert pg.sql("SELECT count(*), sum(i) FROM t") == f"{ROWS}|{ROWS * (ROWS + 1) // 2}"
        pg.sql("INSERT INTO t VALUES (-1, 'after X')")
        assert lsn_int(pg.lsn("SELECT pg_current_wal_flush_lsn()")) > expected + RECORD_LEN

        kill_postmaster(pg)
        # A directory that was not shut down cleanly is refused, and left as it was.
        control = (pg.datadir / "global" / "pg_control").read_bytes()
        out = checkpoint_at(bin_dir, pg, x)
        assert out.returncode == 1 and "was not shut down cleanly" in out.stderr and "in production" in out.stderr, out
        assert (pg.datadir / "global" / "pg_control").read_bytes() == control

        logged = len(pg.logfile.read_text())
        pg.start()
        log = pg.logfile.read_text()[logged:]
        assert "database system was not properly shut down; automatic recovery in progress" in log, log
        assert "redo starts at" in log, log
        assert pg.sql("SELECT count(*), min(i) FROM t") == f"{ROWS + 1}|-1"
        assert pg.sql("SELECT v FROM t WHERE i = -1") == "after X"
    finally:
        pg.stop()
    shutil.rmtree(pg.base, ignore_errors=True)


def test_a_standby_started_at_x_is_read_only_until_promoted(stopped, bin_dir, tmp_path):
    origin, s, before = stopped
    x, expected = cases(s)["record_crosses_a_page"]
    pg = copy_of(origin, tmp_path / "pg", hot_standby="on")
    try:
        check_start_point(bin_dir, pg, x, expected, before)
        (pg.datadir / "standby.signal").touch()
        if pg.user is not None:
            shutil.chown(pg.datadir / "standby.signal", pg.user, pg.user)

        pg.start()
        log = pg.logfile.read_text()
        assert "database system was shut down at" in log and "entering standby mode" in log, log
        assert pg.sql("SELECT pg_is_in_recovery(), count(*) FROM t") == f"t|{ROWS}"
        with pytest.raises(RuntimeError, match="read-only transaction"):
            pg.sql("INSERT INTO t VALUES (-1, 'on a standby')")

        assert pg.sql("SELECT pg_promote()") == "t"
        assert pg.sql("SELECT pg_is_in_recovery()") == "f"
        pg.sql("INSERT INTO t VALUES (-1, 'promoted')")
        assert pg.sql("SELECT count(*) FROM t") == str(ROWS + 1)
    finally:
        pg.stop()
    shutil.rmtree(pg.base, ignore_errors=True)


def test_an_x_below_the_checkpoint_is_refused_and_nothing_changes(stopped, bin_dir, tmp_path):
    origin, s, _ = stopped
    pg = copy_of(origin, tmp_path / "pg")
    control = (pg.datadir / "global" / "pg_control").read_bytes()
    segments = sorted(p.name for p in pg.wal_dir.iterdir())
    out = checkpoint_at(bin_dir, pg, s - 8)
    assert out.returncode == 1, out
    assert f"below the cluster's checkpoint redo {lsn_text(s)}" in out.stderr, out.stderr
    assert (pg.datadir / "global" / "pg_control").read_bytes() == control
    assert sorted(p.name for p in pg.wal_dir.iterdir()) == segments
    shutil.rmtree(pg.base, ignore_errors=True)
