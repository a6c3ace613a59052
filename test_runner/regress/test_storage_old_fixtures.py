"""Tenant directories written by older daemons, checked in as fixtures with the SHA-256 of every
page those daemons served (test_runner/fixtures/data/make_timeline_fixture.py): `v1_timeline`,
storage format version 1 (before the timeline manifest), `v2_timeline`, version 2 (a
manifest, layers made by seals and by compaction, a GC cutoff, relation sizes; see
docs/storage-format.md), and `v3_timeline`, the same data in version 3 (block indexes) with the
layer names and the manifest of the build before names carried key ranges and generations.
Today's daemon must open each, serve the same bytes at every recorded LSN, write its manifest,
and go on ingesting, also across a restart; then a compaction pass rewrites the old layers into
files named and checksummed as today's are, and every recorded page is still served the same,
before and after one more restart."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError

DATA = Path(__file__).resolve().parent.parent / "fixtures" / "data"
# What today's daemon names a layer: level, key range, LSN range, generation.
LAYER_NAME = re.compile(r"^layer_L[01]_([0-9A-F]{34})-([0-9A-F]{34})_([0-9A-F]{16})-([0-9A-F]{16})_g([0-9A-F]{16})\.layer$")


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), a byte at a time: slow, enough for the fixtures' few hundred KiB."""
    table = _crc_table()
    crc = 0xFFFFFFFF
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@functools.cache
def _crc_table() -> tuple[int, ...]:
    def entry(c: int) -> int:
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        return c
    return tuple(entry(i) for i in range(256))


def _check_listed_layers(timeline: Path) -> list[str]:
    """Every layer the manifest lists has today's name and the file's size and crc32c; returns
    the names."""
    manifest = json.loads((timeline / "manifest.json").read_text().rsplit("crc32c=", 1)[0])
    assert manifest["version"] == 3, manifest
    for layer in manifest["layers"]:
        m = LAYER_NAME.match(layer["name"])
        assert m, layer
        assert (int(m.group(3), 16), int(m.group(4), 16)) == (layer["first_lsn"], layer["last_lsn"]), layer
        assert int(m.group(5), 16) <= manifest["generation"], (layer, manifest["generation"])
        data = (timeline / layer["name"]).read_bytes()
        assert (len(data), crc32c(data)) == (layer["size"], layer["crc32c"]), layer
    return [layer["name"] for layer in manifest["layers"]]


def _page(expected: dict, spec: str) -> tuple[Key, int]:
    """`blk@lsn` (v1: a block of the main fork of `relnode`) or `relnode/fork/blk@lsn`."""
    where, lsn = spec.split("@")
    parts = [int(x) for x in where.split("/")]
    if len(parts) == 1:
        return Key.rel_block(expected["relnode"], parts[0]), int(lsn)
    relnode, fork, blk = parts
    return Key.rel_block(relnode, blk, fork), int(lsn)


def _served(conn, expected: dict) -> dict:
    got = {}
    for spec in expected["pages"]:
        key, lsn = _page(expected, spec)
        got[spec] = hashlib.sha256(conn.get_page(key, lsn)).hexdigest()
    return got


def _sizes(conn, expected: dict) -> dict:
    """`relnode/fork@lsn`: the fork's size in blocks, or None where it does not exist."""
    got = {}
    for spec in expected.get("sizes", {}):
        where, lsn = spec.split("@")
        relnode, fork = (int(x) for x in where.split("/"))
        rel, lsn = (1663, 5, relnode), int(lsn)
        got[spec] = conn.get_rel_size(rel, fork, lsn).blocks if conn.get_rel_exists(rel, fork, lsn).exists else None
    return got


def _check(conn, expected: dict) -> None:
    assert _served(conn, expected) == expected["pages"]
    assert _sizes(conn, expected) == expected.get("sizes", {})
    cutoff = expected.get("gc_cutoff", 0)
    if cutoff:
        with pytest.raises(PageServiceError) as e:
            conn.get_page(_page(expected, next(iter(expected["pages"])))[0], cutoff - 1)
        assert e.value.name == "below_gc_cutoff"


def test_crc32c_matches_the_castagnoli_check_value():
    assert crc32c(b"123456789") == 0xE3069283


@pytest.mark.parametrize("name", ["v1_timeline", "v2_timeline", "v3_timeline"], ids=["v1", "v2", "v3"])
def test_tenant_written_by_an_old_daemon_serves_the_same_pages(pageserver_factory, name):
    fixture = DATA / name
    expected = json.loads((fixture / "expected.json").read_text())
    tenant = expected["tenant"]
    old_files = sorted(p.name for p in (fixture / tenant / "timeline").iterdir())
    # What the old daemon left, less its lock (an flock target, never checked in).
    assert old_files == [f for f in expected["files"] if f != "lock"]
    old_layers = [f for f in old_files if f.endswith(".layer")]
    # Compaction only when asked: the pass below is the one that rewrites the old layers.
    ps = pageserver_factory(start=False, compaction="off")
    shutil.copytree(fixture / tenant, ps.workdir / "tenants" / tenant)
    ps.start()

    status = ps.http.tenant_status(tenant)
    assert status["state"] == "active", status
    assert status["last_durable_lsn"] == expected["last_lsn"], status
    assert status["compaction"]["gc_cutoff"] == expected.get("gc_cutoff", 0), status
    timeline = ps.timeline_dir(tenant)
    assert (timeline / "manifest.json").exists(), sorted(p.name for p in timeline.iterdir())
    with ps.connect(tenant) as conn:
        _check(conn, expected)
        # ingest goes on above the old data, and survives a restart with the old pages intact
        key = _page(expected, next(iter(expected["pages"])))[0]
        latest = conn.get_page(key)
        lsn = expected["last_lsn"] + 1
        assert conn.ingest([(key, lsn, o.RECORD, o.insert(b"after the upgrade"))]) == lsn
        after = o.apply_record(latest, lsn, o.insert(b"after the upgrade"))
    ps.restart()
    with ps.connect(tenant) as conn:
        _check(conn, expected)
        assert conn.get_page(key) == after

    # A pass rewrites every old layer (and the active segment, sealed for it) into today's
    # format and deletes them; the pages stay the same, also across a restart.
    r = ps.http.request("POST", f"/v1/tenant/{tenant}/compact")
    assert r.status == 200, r
    p = r.body["pass"]
    assert p is not None and p["input_layers"] >= len(old_layers) + 1 and p["values_read"] > 0, p
    assert p["files_deleted"] == p["input_layers"], p
    left = sorted(f.name for f in timeline.iterdir())
    assert not set(old_layers) & set(left), left
    assert sorted(_check_listed_layers(timeline)) == [f for f in left if f.endswith(".layer")], left
    assert ps.http.tenant_status(tenant)["compaction"]["gc_cutoff"] == expected.get("gc_cutoff", 0)
    with ps.connect(tenant) as conn:
        _check(conn, expected)
        assert conn.get_page(key) == after
    ps.restart()
    with ps.connect(tenant) as conn:
        _check(conn, expected)
        assert conn.get_page(key) == after
