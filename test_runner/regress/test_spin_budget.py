"""Spinning and blocking round trips stay within a daemon-wide budget (ARCHITECTURE.md, "The
pool"): at most a quarter of the CPUs (at least one) of redo children spin at once, and at most
as many `auto` tenants take the blocking path, however many tenants have a busy connection.

Eight tenants with one connection each, one GetPage at a time, no page cache (every request a
redo): each tenant's controller on its own would spin a child and block (the daemon before the
budget did, on all eight); the budget lets one do so on this machine, while every tenant is
served.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

TENANTS = 8
SHAPE = ["--relations", "1", "--blocks", "32", "--chain-length", "4"]


def _pagebench(ps, *args, wait=True):
    command = [str(ps.bin.parent / "pagebench"), *args, "--page-service", "%s:%d" % ps.pg_addr,
               "--http", "%s:%d" % ps.http_addr]
    if not wait:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{command}:\n{result.stderr}"
    return result


def test_busy_tenants_spin_and_block_only_within_the_daemon_wide_budget(pageserver_factory):
    slots = max(1, len(os.sched_getaffinity(0)) // 4)
    ps = pageserver_factory(page_cache_size=0, compaction="off")
    _pagebench(ps, "ingest", "--tenant", "spin", "--tenants", str(TENANTS), *SHAPE)
    load = _pagebench(ps, "get-page", "--tenant", "spin", "--tenants", str(TENANTS), "--connections", "1",
                      "--depth", "1", "--duration", "4", wait=False)
    tenants = [f"spin-{i}" for i in range(TENANTS)]
    most_spinning, most_blocking, samples = 0, 0, 0
    try:
        # After the controllers' first periods, for 2.5 s.
        time.sleep(1.0)
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            children = [c for t in tenants for c in ps.http.tenant_status(t)["walredo"]["pool"]["children"]]
            spinning = sum(1 for c in children if c["spin_us"] > 0)
            blocking = len({c["pid"] for c in children if c["path"] == "sync"})
            most_spinning, most_blocking = max(most_spinning, spinning), max(most_blocking, blocking)
            samples += 1
            time.sleep(0.05)
    finally:
        out, err = load.communicate(timeout=60)
    assert load.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["requests"] > 0, out
    # A slot moves between tenants from one period to the next: one more may show meanwhile.
    assert most_spinning <= slots + 1, f"{most_spinning} children spun at once ({samples} samples)"
    assert most_blocking <= slots + 1, f"{most_blocking} children blocked at once ({samples} samples)"
    served = [ps.http.tenant_status(t)["counters"]["get_page_requests"] for t in tenants]
    assert all(n > 0 for n in served), served


def _hog():
    while True:
        pass


def test_cpu_pressure_holds_back_every_slot(pageserver_factory):
    """Real CPU pressure: busy loops pinned to a few of the daemon's CPUs, three per CPU, so that
    tasks there always wait for one. While the daemon reports the budget held back
    (`pageserver_wal_redo_spin_held_back`), no redo child spins and no tenant blocks; the
    pressure is the kernel's stall time, which the daemon reads each 100 ms period."""
    import multiprocessing

    with open("/proc/pressure/cpu") as f:
        assert f.readline().startswith("some "), "this kernel reports no CPU pressure"
    cpus = sorted(os.sched_getaffinity(0))
    ps = pageserver_factory(page_cache_size=0, compaction="off")
    _pagebench(ps, "ingest", "--tenant", "hogged", *SHAPE)
    load = _pagebench(ps, "get-page", "--tenant", "hogged", "--connections", "1", "--depth", "1",
                      "--duration", "6", wait=False)
    hogs = []
    held_back_samples, violations = 0, []
    try:
        time.sleep(1.0)
        for cpu in cpus[:4]:
            for _ in range(3):
                hog = multiprocessing.get_context("fork").Process(target=_hog, daemon=True)
                hog.start()
                os.sched_setaffinity(hog.pid, {cpu})
                hogs.append(hog)
        deadline = time.monotonic() + 3.0
        previous = 0.0
        while time.monotonic() < deadline:
            held_back = ps.http.metrics().value("pageserver_wal_redo_spin_held_back")
            children = ps.http.tenant_status("hogged")["walredo"]["pool"]["children"]
            # The children follow the grants of the next period: look one sample after.
            if held_back == 1 and previous == 1:
                held_back_samples += 1
                busy = [c for c in children if c["spin_us"] > 0 or c["path"] == "sync"]
                if busy:
                    violations.append(busy)
            previous = held_back
            time.sleep(0.15)
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.join()
        out, err = load.communicate(timeout=60)
    assert load.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["requests"] > 0, out
    assert held_back_samples > 0, "the daemon never reported CPU pressure under the busy loops"
    assert not violations, f"children spun or blocked while held back: {violations[:3]}"
