"""Fixtures for the end-to-end tests (ARCHITECTURE.md, `test_runner/`).

- `pageserver_factory(**config)`: start a daemon in its own temp work dir on free ports; every
  daemon started is stopped at teardown (SIGTERM, exit status 0), then checked: no redo child
  outlives it, and its log has no ERROR/WARN line the test did not allow
  (`daemon.allowed_errors.append(regex)`).
- `pageserver`: one daemon with the default config, or with `walredo_process_kind` set from the
  `process_kind` fixture when the test uses it.
- `process_kind`: "sync", "async" and "auto"; a test that takes it runs once per kind.
- `page_service_io`: "epoll" and "io_uring": every test that starts a daemon runs once per
  writer (the daemon gets `page_service_io` unless the test sets it). The default, "auto",
  picks one of the two by load: test_page_service_io.py covers its switches.
- `tenant`: a fresh tenant on `pageserver`.
- `s3_server`: a started S3 server (versitygw, `fixtures/s3.py`) in `<tmp_path>/s3`, with the
  bucket `pageserver-test`; stopped at teardown (resumed first when paused). It must still be
  running then, unless the test stopped it.

The binary is `$PAGESERVER_BIN_DIR/pageserver` (default `<repo>/target/debug`).
"""

from __future__ import annotations

import pytest

from fixtures import log_check
from fixtures.daemon import IO_MODES, PROCESS_KINDS, Pageserver, default_bin_dir, new_tenant_id
from fixtures.s3 import S3Server
from fixtures.util import wait_until


@pytest.fixture(scope="session")
def bin_dir():
    d = default_bin_dir()
    assert (d / "pageserver").exists(), (
        f"no pageserver binary in {d}: run `cargo build --workspace --bins` or set PAGESERVER_BIN_DIR"
    )
    return d


@pytest.fixture(params=PROCESS_KINDS)
def process_kind(request):
    return request.param


@pytest.fixture(params=IO_MODES)
def page_service_io(request):
    return request.param


@pytest.fixture
def pageserver_factory(bin_dir, tmp_path, page_service_io):
    daemons: list[Pageserver] = []

    def make(start: bool = True, raw_args: list[str] | None = None, env: dict | None = None,
             **config) -> Pageserver:
        if not any(arg.startswith("page_service_io") for arg in raw_args or []):
            config.setdefault("page_service_io", page_service_io)
        d = Pageserver(bin_dir, tmp_path / f"pageserver{len(daemons)}", config, raw_args, env)
        daemons.append(d)
        if start:
            d.start()
        return d

    yield make

    problems = []
    for d in daemons:
        if d.running:
            try:
                d.stop()
            except AssertionError as e:
                problems.append(str(e))
        if d.proc is not None:
            d._force_kill()
        try:
            wait_until(lambda d=d: not d.leftover_children(), timeout=10,
                       desc="redo children to exit")
        except AssertionError:
            problems.append(f"redo children left behind by {d.workdir}: {d.leftover_children()}")
        bad = d.check_log()
        if bad:
            shown = "\n".join(bad[:30])
            problems.append(f"unexpected ERROR/WARN lines in {d.log_path} ({len(bad)}):\n{shown}")
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.fixture
def pageserver(request, pageserver_factory):
    config = {}
    if "process_kind" in request.fixturenames:
        config["walredo_process_kind"] = request.getfixturevalue("process_kind")
    return pageserver_factory(**config)


@pytest.fixture
def tenant(pageserver):
    return pageserver.create_tenant(new_tenant_id())


@pytest.fixture
def s3_server(tmp_path):
    server = S3Server(tmp_path / "s3").start()
    yield server
    died = server.proc is not None and server.proc.poll() is not None
    server.stop()  # SIGCONT first when paused
    if died:
        pytest.fail(f"versitygw exited during the test; log tail ({server.log_path}):\n"
                    + log_check.tail(server.log_path), pytrace=False)
