"""The pageserver's base backup client (`postgres/pq.rs`, `ingest/tar.rs`, `ingest/import.rs`,
driven by `pagectl basebackup`) against a real PostgreSQL 15: after pgbench's tables and a
table in a tablespace of its own, it lists the same files with the same sizes as PostgreSQL's
own `pg_basebackup -Ft`, classes every relation file as a relation segment (and the control
file, the mapper files and the commit log as theirs), makes one value per block, and its start
LSN is one the server has passed."""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from fixtures.postgres import Postgres

# Files whose contents differ between two backups by design: the label and start time.
DIFFERENT_PER_BACKUP = {"backup_label"}

RELATION_FILE = re.compile(r"^(global|base/\d+|PG_15_\d+/\d+)/\d+(_(fsm|vm|init))?(\.\d+)?$")


def lsn_int(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def owned_dir(pg: Postgres, path: Path) -> Path:
    """A directory the server's user can write (PostgreSQL runs as `postgres` under root)."""
    path.mkdir(parents=True)
    if pg.user is not None:
        entry = pwd.getpwnam(pg.user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return path


@pytest.fixture
def pg(tmp_path):
    # No autovacuum: nothing may change the files between the two backups compared.
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off"}).init().start()
    yield pg
    pg.stop()


def test_basebackup_lists_the_files_of_pg_basebackup_and_classes_every_relation(pg, bin_dir, tmp_path):
    pg.pgbench("-i", "-s", "1", "-q")
    ts_dir = owned_dir(pg, tmp_path / "ts")
    pg.sql(f"create tablespace ts location '{ts_dir}'")
    pg.sql("create table in_ts (i int, t text) tablespace ts")
    pg.sql("insert into in_ts select i, repeat('x', 100) from generate_series(1, 5000) i")
    pg.sql("checkpoint")
    ts_oid = int(pg.sql("select oid from pg_tablespace where spcname = 'ts'"))

    # PostgreSQL's own archives.
    theirs_dir = owned_dir(pg, tmp_path / "theirs")
    pg.run("pg_basebackup", "-D", str(theirs_dir), "-Ft", "-X", "none", "--no-manifest", "-c", "fast")
    theirs: dict[tuple[str, str], int] = {}
    for archive in sorted(theirs_dir.glob("*.tar")):
        with tarfile.open(archive) as t:
            for m in t.getmembers():
                if m.isfile():
                    theirs[(archive.name, m.name)] = m.size
    assert (f"{ts_oid}.tar", next(p for a, p in theirs if a == f"{ts_oid}.tar")) in theirs

    out = subprocess.run([str(bin_dir / "pagectl"), "basebackup", "--source", pg.connstr(), "--list"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    after = pg.sql("select pg_current_wal_lsn()")
    summary = json.loads(out.stdout)
    ours = {(f["archive"], f["path"]): f for f in summary["file_list"]}

    # The same files, with the same sizes (the label's file differs by its text); only
    # pg_basebackup asks for tablespace_map (TABLESPACE_MAP), which the importer does not need.
    assert not ours.keys() - theirs.keys(), sorted(ours.keys() - theirs.keys())
    assert theirs.keys() - ours.keys() == {("base.tar", "tablespace_map")}, sorted(theirs.keys() - ours.keys())
    assert ("base.tar", "backup_label") in ours
    sizes_differ = {k: (ours[k]["size"], theirs[k]) for k in ours.keys() & theirs.keys()
                    if ours[k]["size"] != theirs[k] and k[1] not in DIFFERENT_PER_BACKUP}
    assert not sizes_differ, sizes_differ

    # Every relation file is a relation segment; the other kinds are what they are.
    rel_files = [f for (_, p), f in ours.items() if RELATION_FILE.match(p)]
    assert len(rel_files) > 100
    assert all(f["class"] == "rel" for f in rel_files), [f for f in rel_files if f["class"] != "rel"]
    assert all(f["class"] != "rel" for (_, p), f in ours.items() if not RELATION_FILE.match(p))
    assert ours[("base.tar", "global/pg_control")]["class"] == "control"
    assert ours[("base.tar", "global/pg_filenode.map")]["class"] == "relmap"
    assert ours[("base.tar", "pg_xact/0000")]["class"] == "slru"
    in_ts = [f for (a, _), f in ours.items() if a == f"{ts_oid}.tar" and f["class"] == "rel"]
    assert in_ts and any(f["size"] > 8192 * 50 for f in in_ts), in_ts
    assert [t for t in summary["tablespaces"] if t["oid"] == ts_oid][0]["location"] == str(ts_dir)

    # One value per block; the control file; a size per relation fork.
    values = summary["values"]
    assert values["rel"] == sum(f["size"] // 8192 for f in rel_files)
    assert values["control"] == 1
    assert values["relmap"] == sum(1 for f in ours.values() if f["class"] == "relmap")
    assert values["rel_size"] == len(rel_files)  # no relation here has a second segment
    assert summary["partial_tails"] == 0

    # The tablespaces' archives come first, the control file last (the server sends it after
    # everything else, so that it is at least as new as the files).
    assert summary["file_list"][0]["archive"] == f"{ts_oid}.tar"
    assert summary["file_list"][-1]["path"] == "global/pg_control"
    # Our count of archive bytes (headers, padding, trailers) is the server's.
    assert summary["bytes"] == summary["server_bytes"] > 0

    assert lsn_int(summary["start"]) <= lsn_int(summary["end"]) <= lsn_int(after)
    assert summary["timeline"] == 1
    assert summary["system_id"] == pg.run("pg_controldata", "-D", str(pg.datadir)).stdout.split(
        "Database system identifier:")[1].split()[0]
