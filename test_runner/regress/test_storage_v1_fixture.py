"""A tenant directory written by the daemon before the timeline manifest existed (storage format
version 1, docs/storage-format.md), checked in as a fixture with the SHA-256 of every page that
daemon served (test_runner/fixtures/data/make_v1_timeline.py). Today's daemon must open it,
serve the same bytes at every recorded LSN, write its manifest, and go on ingesting, also
across a restart."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from fixtures import oracle as o
from fixtures.oracle import Key

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "data" / "v1_timeline"


def _served(conn, expected: dict) -> dict:
    got = {}
    for spec in expected["pages"]:
        blk, lsn = (int(x) for x in spec.split("@"))
        got[spec] = hashlib.sha256(conn.get_page(Key.rel_block(expected["relnode"], blk), lsn)).hexdigest()
    return got


def test_version_1_tenant_written_by_the_old_daemon_serves_the_same_pages(pageserver_factory):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    tenant = expected["tenant"]
    ps = pageserver_factory(start=False)
    shutil.copytree(FIXTURE / tenant, ps.workdir / "tenants" / tenant)
    ps.start()

    status = ps.http.tenant_status(tenant)
    assert status["state"] == "active", status
    assert status["last_durable_lsn"] == expected["last_lsn"], status
    timeline = ps.workdir / "tenants" / tenant / "timeline"
    assert (timeline / "manifest.json").exists(), sorted(p.name for p in timeline.iterdir())
    with ps.connect(tenant) as conn:
        assert _served(conn, expected) == expected["pages"]
        # ingest goes on above the old data, and survives a restart with the old pages intact
        key = Key.rel_block(expected["relnode"], 0)
        latest = conn.get_page(key)
        lsn = expected["last_lsn"] + 1
        assert conn.ingest([(key, lsn, o.RECORD, o.insert(b"after the upgrade"))]) == lsn
        after = o.apply_record(latest, lsn, o.insert(b"after the upgrade"))
    ps.restart()
    with ps.connect(tenant) as conn:
        assert _served(conn, expected) == expected["pages"]
        assert conn.get_page(key) == after
