"""File descriptors: a flood of page service connections that never say Hello must not starve
storage of descriptors.

The daemon runs under a low descriptor limit (set by a wrapper with `ulimit`, as an operator's
default of 1024 would be, only smaller). It raises its soft limit to the hard one at start, keeps
a reserve for storage and the management API, and caps page service connections to what
remains. Under a flood, ingest that seals a new layer (a new file) still works, and so does the
management API.
"""

from __future__ import annotations

import re
import socket
import stat

from fixtures import oracle as o
from fixtures.daemon import default_bin_dir
from fixtures.oracle import Key
from fixtures.util import wait_until

K = Key.rel_block(9100, 1)
CAPPED = r"page service connections capped at"
REFUSED = r"refusing a connection: too many connections"


def limited_bin_dir(tmp_path, soft: int, hard: int):
    """A directory with a `pageserver` that runs the real one under the given RLIMIT_NOFILE."""
    d = tmp_path / f"nofile-{soft}-{hard}"
    d.mkdir()
    wrapper = d / "pageserver"
    real = default_bin_dir() / "pageserver"
    wrapper.write_text(f'#!/bin/sh\nulimit -Sn {soft} && ulimit -Hn {hard} && exec "{real}" "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return d


def nofile_limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no 'Max open files' line")


def test_soft_fd_limit_is_raised_to_the_hard_limit(pageserver_factory, tmp_path):
    ps = pageserver_factory(start=False)
    ps.bin = limited_bin_dir(tmp_path, 256, 4096) / "pageserver"
    ps.start()
    assert nofile_limits(ps.pid) == (4096, 4096)


def test_connection_flood_does_not_starve_storage_of_descriptors(pageserver_factory, tmp_path):
    ps = pageserver_factory(start=False, layer_size="64 KiB")
    ps.bin = limited_bin_dir(tmp_path, 256, 256) / "pageserver"
    ps.allowed_errors += [CAPPED, REFUSED]
    ps.start()
    assert nofile_limits(ps.pid) == (256, 256)
    tenant = ps.create_tenant()
    conn = ps.connect(tenant)
    rs = o.RecordSet()
    first = [(K, 10, o.RECORD, o.init_page(0))]
    rs.add_batch(first)
    assert conn.ingest(first) == 10

    flood = []
    try:
        for _ in range(400):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(ps.pg_addr)
            flood.append(s)
        # the daemon has taken what it can of the flood
        wait_until(lambda: ps.http.metrics().value("pageserver_page_service_connections") >= 2,
                   timeout=20, desc="the flood to be accepted")

        lsn = 10
        for blk in range(24):  # 24 images of 8 KiB: at least one seal, each a new file
            lsn += 1
            values = [(Key.rel_block(9101, blk), lsn, o.IMAGE, bytes([blk]) * o.PAGE_SIZE)]
            rs.add_batch(values)
            assert conn.ingest(values) == lsn
        assert ps.http.tenant_status(tenant)["storage"]["layers"] >= 1
        assert conn.get_page(K) == rs.get_page(K, lsn)
    finally:
        for s in flood:
            s.close()
    conn.close()
    log = ps.log_path.read_text()
    assert re.search(CAPPED, log), "no log line says the connections were capped"
