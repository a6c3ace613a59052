"""Storage write failures with a real full disk: the tenants directory is a small tmpfs that a
test fills up. A failure is visible (tenant status, metrics, one log line per episode), a
GetPage above the durable LSN gets `storage_unavailable` at once, nothing refused is stored, and
ingest works again without a restart once space is freed (docs/storage-format.md, "Write
failures")."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import ErrorReply, IngestOk, Page
from fixtures.util import wait_until

TMPFS_SIZE = 8 << 20
EPISODE_LINE = "failed to write to storage"


def _image(i: int) -> bytes:
    return bytes([i % 251 + 1]) * 8192


def _batch(lsn: int):
    return [(Key.rel_block(7000, lsn % 16), lsn, o.IMAGE, _image(lsn))]


@pytest.fixture
def tmpfs_daemon(pageserver_factory):
    """A daemon whose `<workdir>/tenants` is a tmpfs of TMPFS_SIZE bytes."""
    d = pageserver_factory(start=False)
    tenants = d.workdir / "tenants"
    tenants.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(tenants)], check=True)
    try:
        d.start()
        yield d, tenants
        if d.running:
            d.stop()
    finally:
        subprocess.run(["umount", "-l", str(tenants)], check=False)


def _fill(directory) -> str:
    """Fills the file system of `directory` completely; returns the filler's path."""
    path = os.path.join(directory, "filler")
    st = os.statvfs(directory)
    with open(path, "wb") as f:
        try:
            f.write(bytes(st.f_bavail * st.f_frsize))
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            pass  # full: that was the point
    return path


def test_full_disk_is_visible_and_ingest_recovers_without_restart(tmpfs_daemon):
    d, tenants = tmpfs_daemon
    d.allowed_errors.append(EPISODE_LINE)
    t = d.create_tenant()
    conn = d.connect(t)
    for lsn in range(1, 11):
        assert conn.ingest(_batch(lsn)) == lsn
    status = d.http.tenant_status(t)
    assert status["storage"]["write_error"] is None
    errors_before = d.http.metrics().value("pageserver_storage_write_errors_total")

    filler = _fill(tenants)
    rid = conn.send_ingest(_batch(11))
    reply = conn.read_reply()
    assert isinstance(reply, ErrorReply) and reply.request_id == rid, reply
    assert reply.name == "storage_unavailable", reply

    status = d.http.tenant_status(t)
    we = status["storage"]["write_error"]
    assert we is not None and not we["fatal"] and "No space left" in we["error"], we
    assert we["since"].endswith("Z"), we
    assert status["last_durable_lsn"] == 10
    m = d.http.metrics()
    assert m.value("pageserver_storage_write_errors_total") > errors_before
    assert m.value("pageserver_storage_failed_timelines") == 1

    # A GetPage above the durable LSN gets its code at once (not after wait_lsn_timeout), the
    # connection stays open, and pages at or below it are still served.
    start = time.monotonic()
    rid = conn.send_get_page(Key.rel_block(7000, 1), 11)
    reply = conn.read_reply(timeout=10)
    assert isinstance(reply, ErrorReply) and reply.name == "storage_unavailable", reply
    assert time.monotonic() - start < 10
    assert conn.get_page(Key.rel_block(7000, 10), 10) == _image(10)

    os.unlink(filler)

    def retried():
        rid = conn.send_ingest(_batch(11))
        reply = conn.read_reply()
        if isinstance(reply, IngestOk):
            return reply
        assert isinstance(reply, ErrorReply) and reply.name == "storage_unavailable", reply
        return None

    assert wait_until(retried, timeout=30, desc="ingest to work again").durable_lsn == 11
    status = d.http.tenant_status(t)
    assert status["storage"]["write_error"] is None
    assert d.http.metrics().value("pageserver_storage_failed_timelines") == 0
    assert conn.get_page(Key.rel_block(7000, 11), 11) == _image(11)
    conn.close()

    episodes = [line for line in d.log_path.read_text().splitlines() if EPISODE_LINE in line]
    assert len(episodes) == 1, episodes

    d.restart()
    with d.connect(t) as conn:
        assert conn.hello_ok.last_durable_lsn == 11
        for lsn in range(1, 12):
            reply = conn.get_page_reply(Key.rel_block(7000, lsn % 16), lsn)
            assert isinstance(reply, Page) and reply.page == _image(lsn), lsn
