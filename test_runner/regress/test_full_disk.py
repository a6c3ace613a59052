"""The daemon starts and serves reads on a 100% full disk.

The work dir is a small tmpfs: a tenant is created and loaded, the daemon stops, the disk is
filled to the last byte (`ports.json` removed first, so nothing frees space at start), and the
daemon starts again. It must come up (it writes `ports.json` best-effort: a WARN, and the
addresses are in its log), answer the API, and serve GetPage from what is stored.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time

import pytest

from fixtures import log_check
from fixtures import oracle as o
from fixtures.daemon import Pageserver
from fixtures.oracle import Key
from fixtures.util import wait_until

K1 = Key.rel_block(8000, 1)
K2 = Key.rel_block(8000, 2)
LISTENING = {
    "pg": re.compile(r"page service listening on (\S+):(\d+)"),
    "http": re.compile(r"management API listening on http://(\S+):(\d+)"),
}


@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], check=True)
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(path) -> int:
    """Writes a file until the disk is full to the byte; returns its size."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            block = b"\xff" * chunk
            while True:
                try:
                    n = f.write(block)
                except OSError as e:
                    assert e.errno == errno.ENOSPC, e
                    break
                written += n
                if n < chunk:
                    break
    st = os.statvfs(path)
    assert st.f_bavail == 0, f"the disk still has {st.f_bavail} free blocks"
    return written


def start_without_ports_file(ps: Pageserver, timeout: float = 30.0) -> None:
    """Starts the daemon and finds its addresses in its log, since the full disk has no room
    for ports.json."""
    before = ps.log_path.stat().st_size if ps.log_path.exists() else 0
    ps.proc = ps._spawn()

    def addresses():
        rc = ps.proc.poll()
        assert rc is None, f"pageserver exited with {rc}:\n{log_check.tail(ps.log_path)}"
        with open(ps.log_path, "rb") as f:
            f.seek(before)
            text = f.read().decode(errors="replace")
        found = {name: pat.search(text) for name, pat in LISTENING.items()}
        if all(found.values()):
            return {name: (m.group(1), int(m.group(2))) for name, m in found.items()}
        return None

    try:
        addrs = wait_until(addresses, timeout=timeout, desc="the daemon to log its addresses")
    except AssertionError:
        ps._force_kill()
        raise
    ps.pg_addr, ps.http_addr = addrs["pg"], addrs["http"]
    wait_until(lambda: ps.http.status(), timeout=timeout, desc="the HTTP API to answer")


def test_daemon_starts_and_serves_reads_on_a_full_disk(bin_dir, tmp_path, tmpfs):
    ps = Pageserver(bin_dir, tmpfs / "ps")
    ps.log_path = tmp_path / "pageserver.log"  # the log must not need the full disk
    ps.allowed_errors += [r"ports\.json", r"No space left on device"]
    try:
        ps.start()
        tenant = ps.create_tenant("full")
        rs = o.RecordSet()
        values = [(K1, 10, o.RECORD, o.init_page(0)), (K1, 20, o.RECORD, o.insert(b"one")),
                  (K2, 20, o.IMAGE, bytes([7]) * o.PAGE_SIZE), (K1, 30, o.RECORD, o.insert(b"two"))]
        rs.add_batch(values)
        with ps.connect(tenant) as conn:
            assert conn.ingest(values) == 30
        ps.stop()

        (ps.workdir / "ports.json").unlink()
        fill(tmpfs / "filler")
        start_without_ports_file(ps)  # the old daemon exited here: "write ports file"

        assert ps.http.tenant_status(tenant)["last_durable_lsn"] == 30
        with ps.connect(tenant) as conn:
            assert conn.get_page(K1) == rs.get_page(K1, 30)
            assert conn.get_page(K1, 20) == rs.get_page(K1, 20)
            assert conn.get_page(K2) == rs.get_page(K2, 30)
        assert not (ps.workdir / "ports.json").exists(), "a stale or partial ports.json was left"
        ps.stop()
    finally:
        if ps.running:
            ps._force_kill()
    wait_until(lambda: not ps.leftover_children(), timeout=10, desc="redo children to exit")
    assert not ps.check_log(), ps.check_log()
