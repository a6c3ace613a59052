"""Stopping the daemon (README.md, "Stopping"): SIGTERM or SIGINT stops it cleanly whatever
happened to its stderr; a second SIGTERM/SIGINT, or SIGQUIT, exits at once."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.util import wait_until

KEY = Key.rel_block(12000, 1)
# Exit status of an immediate exit (second signal, SIGQUIT): not a clean stop.
IMMEDIATE_EXIT_STATUS = 1


def test_sigterm_stops_the_daemon_after_its_stderr_reader_went_away(pageserver_factory):
    """`pageserver ... 2>&1 | head -3`: the reader exits, log writes then fail with EPIPE."""
    ps = pageserver_factory(start=False)
    ps.workdir.mkdir(parents=True)
    ps.proc = subprocess.Popen(ps.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env=ps._env(), cwd=ps.workdir)
    ports = ps.workdir / "ports.json"
    wait_until(ports.exists, timeout=30, desc="the daemon to listen")
    assert ps.proc.stdout is not None
    for _ in range(3):
        assert ps.proc.stdout.readline(), "the daemon logs its start"
    ps.proc.stdout.close()  # the reader goes away: every later log write fails with EPIPE

    ps.proc.send_signal(signal.SIGTERM)
    try:
        rc = ps.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("SIGTERM did not stop a daemon whose stderr reader went away") from None
    finally:
        ps._force_kill()
    assert rc == 0, f"exit status {rc}"


def _daemon_with_a_redo_stuck_in_flight(pageserver_factory):
    """A daemon whose shutdown waits for a GetPage stuck on a SIGSTOPped redo child."""
    ps = pageserver_factory(walredo_process_kind="async", wal_redo_timeout="1 h", page_cache_size=0)
    tenant = ps.create_tenant()
    conn = ps.connect(tenant)
    conn.ingest([(KEY, 10, o.RECORD, o.init_page(0)), (KEY, 11, o.RECORD, o.insert(b"a"))])
    conn.get_page(KEY, 11)  # starts the redo child
    [child] = ps.redo_children()
    ps.allowed_errors.append(".")  # an immediate exit is not clean, and says so
    return ps, conn, child, tenant


def _pending(pid: int, sig: signal.Signals) -> bool:
    """Whether `sig` is pending for the process (not yet taken by any thread)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("ShdPnd:"):
                return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    return False


def _exited_at_once(ps) -> None:
    """An immediate exit leaves the redo child to notice EOF on its own, as after SIGKILL."""
    ps._force_kill()
    ps.orphaned_children.update(ps.known_children)
    ps.known_children.clear()


@pytest.mark.parametrize("first,second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT),
                                          (signal.SIGTERM, signal.SIGQUIT)],
                         ids=["term-term", "int-int", "term-quit"])
def test_second_signal_during_a_slow_shutdown_exits_at_once(pageserver_factory, first, second):
    ps, conn, child, tenant = _daemon_with_a_redo_stuck_in_flight(pageserver_factory)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        conn.send_get_page(KEY, 10)  # waits for the stopped child (wal_redo_timeout: 1 h)
        # In flight before the signal: else the shutdown has nothing to wait for.
        wait_until(lambda: ps.http.tenant_status(tenant)["counters"]["get_page_requests"] == 2, timeout=10,
                   desc="the daemon to take the GetPage")
        ps.proc.send_signal(first)
        wait_until(lambda: "shutting down" in ps.log_path.read_text(), timeout=10,
                   desc="the daemon to start shutting down")
        assert ps.proc.poll() is None, "the shutdown waits for the request in flight"
        ps.proc.send_signal(second)
        try:
            rc = ps.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a second signal ({second.name}) did not exit at once") from None
        assert rc == IMMEDIATE_EXIT_STATUS, f"exit status {rc}"
        assert "exiting at once" in ps.log_path.read_text()
    finally:
        _exited_at_once(ps)
        conn.close()
        try:
            os.kill(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigquit_exits_at_once(pageserver_factory):
    ps, conn, _child, _tenant = _daemon_with_a_redo_stuck_in_flight(pageserver_factory)
    try:
        ps.proc.send_signal(signal.SIGQUIT)
        rc = ps.proc.wait(timeout=10)
        assert rc == IMMEDIATE_EXIT_STATUS, f"exit status {rc}"
    finally:
        _exited_at_once(ps)
        conn.close()


def test_second_sigterm_exits_at_once_while_logging_blocks_every_thread(pageserver_factory):
    """stderr is a pipe nobody reads: once it is full every log write blocks, the async runtime's
    threads with it. A second SIGTERM must still end the daemon (the escape hatch of a wedged
    daemon), so signals cannot depend on the runtime."""
    from fixtures.http_client import HttpClient
    import json
    ps = pageserver_factory(start=False)
    ps.workdir.mkdir(parents=True)
    ps.proc = subprocess.Popen(ps.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, env={**ps._env(), "RUST_LOG": "debug"},
                               cwd=ps.workdir)
    try:
        ports = ps.workdir / "ports.json"
        wait_until(lambda: ports.exists() and json.loads(ports.read_text()).get("http"), timeout=30,
                   desc="the daemon to listen")
        host, port = json.loads(ports.read_text())["http"].rsplit(":", 1)
        http = HttpClient((host, int(port)), timeout=2.0)
        stuck = False
        for i in range(20000):  # each request logs; the pipe holds 64 KiB
            try:
                http.request("POST", "/v1/tenant", {"id": f"fill-{i}"})
            except OSError:  # a timeout: the daemon is blocked writing its log
                stuck = True
                break
        assert stuck, "the daemon never blocked on its full stderr pipe"
        ps.proc.send_signal(signal.SIGTERM)
        # Signals of one kind do not queue: send the second once the first was taken.
        wait_until(lambda: not _pending(ps.pid, signal.SIGTERM), timeout=10,
                   desc="the daemon to take the first SIGTERM")
        assert ps.proc.poll() is None
        ps.proc.send_signal(signal.SIGTERM)
        try:
            rc = ps.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            raise AssertionError("a second SIGTERM did not end a daemon blocked on its log") from None
        assert rc == IMMEDIATE_EXIT_STATUS, f"exit status {rc}"
    finally:
        _exited_at_once(ps)
