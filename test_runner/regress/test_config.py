"""Settings (docs/settings.md): bad keys and values stop the daemon at start-up with a message
naming the key; the config file and `-c` overrides are applied; `--help` says what the daemon is
and how to set it."""

import subprocess

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key

BAD = [
    ("no_such_key=1", "no_such_key"),
    ("walredo_process_kind=fast", "walredo_process_kind"),
    ("walredo_process_kind=3", "walredo_process_kind"),
    ('wait_lsn_timeout="soon"', "wait_lsn_timeout"),
    ('wal_redo_timeout="5 parsecs"', "wal_redo_timeout"),
    ("walredo_idle_timeout=true", "walredo_idle_timeout"),
    ('page_cache_size="lots"', "page_cache_size"),
    ('layer_size="-1 MiB"', "layer_size"),
    ("max_connections=-1", "max_connections"),
    ('max_connections="many"', "max_connections"),
    ("log_format=xml", "log_format"),
    # out of range: would overflow deadlines, or ask for absurd amounts of memory
    ('wal_redo_timeout="500000000000 years"', "wal_redo_timeout"),
    ('walredo_idle_timeout="500000000000 years"', "walredo_idle_timeout"),
    ('wait_lsn_timeout="500000000000 years"', "wait_lsn_timeout"),
    ('page_cache_size="4096 GiB"', "page_cache_size"),
    ('layer_size="1 TiB"', "layer_size"),
    ("max_connections=100000000000", "max_connections"),
    ("walredo_pool_max=0", "walredo_pool_max"),
    ("walredo_pool_max=65", "walredo_pool_max"),
    ("walredo_pool_max=-1", "walredo_pool_max"),
    ('wal_max_record_size="2 GiB"', "wal_max_record_size"),
    ('wal_max_record_size="64 KiB"', "wal_max_record_size"),
]


@pytest.mark.parametrize("arg,key", BAD, ids=[a for a, _ in BAD])
def test_bad_setting_refuses_to_start(pageserver_factory, arg, key):
    ps = pageserver_factory(start=False, raw_args=[arg])
    rc, output = ps.run_expect_failure()
    assert rc == 2, output
    assert key in output, f"the output does not name {key}:\n{output}"
    assert "panicked" not in output, output
    assert not (ps.workdir / "ports.json").exists()
    ps.allowed_errors.append(".")  # its start-up error is the point of the test


def test_bad_key_in_config_file_refuses_to_start(pageserver_factory):
    ps = pageserver_factory(start=False)
    ps.workdir.mkdir(parents=True)
    (ps.workdir / "pageserver.toml").write_text('walredo_process_kind = "sync"\nbogus_setting = 5\n')
    rc, output = ps.run_expect_failure()
    assert rc != 0
    assert "bogus_setting" in output, output
    ps.allowed_errors.append(".")


def test_bare_page_cache_size_below_one_mib_is_refused_as_a_neon_page_count(pageserver_factory):
    ps = pageserver_factory(start=False, raw_args=["page_cache_size=16384"])
    rc, output = ps.run_expect_failure()
    assert rc == 2, output
    assert "page_cache_size" in output and "page count" in output, output
    ps.allowed_errors.append(".")


def test_config_file_and_overrides(pageserver_factory):
    ps = pageserver_factory(start=False, raw_args=['wait_lsn_timeout="300 ms"'])
    ps.workdir.mkdir(parents=True)
    (ps.workdir / "pageserver.toml").write_text(
        'walredo_process_kind = "sync"\nwait_lsn_timeout = "60 s"\npage_cache_size = "4 MiB"\n')
    ps.start()
    t = ps.create_tenant()
    assert ps.http.tenant_status(t)["effective_config"]["walredo_process_kind"] == "sync"
    # the -c override wins over the file: a GetPage ahead of ingest fails fast
    k = Key.rel_block(11000, 1)
    with ps.connect(t) as conn:
        conn.ingest([(k, 10, o.RECORD, o.init_page(0))])
        conn.send_get_page(k, 11)
        reply = conn.read_reply(timeout=10)
        assert getattr(reply, "name", None) == "lsn_timeout", reply


def test_duration_and_size_forms(pageserver_factory):
    ps = pageserver_factory(wait_lsn_timeout="3 min", wal_redo_timeout="60 s", walredo_idle_timeout="500 ms",
                            page_cache_size=1048576, layer_size="1 MiB", max_connections=10)
    t = ps.create_tenant()
    with ps.connect(t) as conn:
        conn.ingest([(Key.rel_block(11000, 2), 10, o.RECORD, o.init_page(0))])
        assert conn.get_page(Key.rel_block(11000, 2))[12:14] == b"\x18\x00"


def test_json_log_format_writes_only_json_lines(pageserver_factory):
    import json
    ps = pageserver_factory(log_format="json")
    t = ps.create_tenant()
    k = Key.rel_block(11000, 3)
    with ps.connect(t) as conn:
        conn.ingest([(k, 10, o.RECORD, o.init_page(0)), (k, 11, o.RECORD, o.insert(b"j"))])
        conn.get_page(k)  # a redo child starts and logs through the daemon
    ps.restart()
    ps.stop()
    lines = [line for line in ps.log_path.read_text().splitlines() if not line.startswith("==== test runner")]
    assert lines
    for line in lines:
        event = json.loads(line)  # fails on any plain-text line
        assert {"timestamp", "level", "fields"} <= set(event), line
    assert any(json.loads(line)["fields"].get("message") == "loaded tenant" for line in lines)


def test_help_says_what_the_daemon_is_and_how_to_set_it(bin_dir):
    out = subprocess.run([str(bin_dir / "pageserver"), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    # The first line is the binary's description (the doc of its argument struct).
    assert out.stdout.startswith("The pageserver daemon: stores pages"), out.stdout
    assert "--workdir" in out.stdout and "--config-override" in out.stdout, out.stdout
