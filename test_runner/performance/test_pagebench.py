"""pagebench end to end: load a small data set into a real daemon, then drive GetPage for a few
seconds, for each walredo process kind.

Not part of the default run (the test command runs only `test_runner/regress`); run it with
`pytest test_runner/performance` after `cargo build --workspace --bins`
(`PAGESERVER_BIN_DIR` picks another build, e.g. target/release).

It checks that the tool works and that the daemon serves correct pages under pipelined load
(`--verify` compares every page with the one pagebench computes itself); it asserts no speed.
The figures are measured by hand and recorded in docs/performance.md.
"""

from __future__ import annotations

import json
import subprocess

import pytest

SHAPE = ["--relations", "2", "--blocks", "64", "--chain-length", "3", "--seed", "7"]
LATENCY_FIELDS = ["mean", "p50", "p99", "p999", "p9999"]


def pagebench(bin_dir, daemon, *args, check=True, timeout=90) -> subprocess.CompletedProcess:
    pg = "%s:%d" % daemon.pg_addr
    http = "%s:%d" % daemon.http_addr
    command = [str(bin_dir / "pagebench"), *args, "--page-service", pg, "--http", http]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{result.stderr}"
    return result


def last_json_line(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert lines, "pagebench printed nothing on stdout"
    return json.loads(lines[-1])


@pytest.fixture
def pagebench_bin(bin_dir):
    assert (bin_dir / "pagebench").exists(), f"no pagebench in {bin_dir}: cargo build --workspace --bins"
    return bin_dir


def test_pagebench_ingest_then_get_page_serves_verified_pages_without_errors(
        pagebench_bin, pageserver, process_kind):
    tenant = f"bench-{process_kind}"
    ingest = last_json_line(pagebench(pagebench_bin, pageserver, "ingest", "--tenant", tenant, *SHAPE).stdout)
    assert ingest["values"] == 2 * 64 * (1 + 3)
    assert ingest["complete"] is True
    status = pageserver.http.tenant_status(tenant)
    assert status["last_durable_lsn"] == ingest["end_lsn"], status
    assert status["storage"]["values"] == ingest["values"], status

    for lsn in ["latest", "random"]:
        run = pagebench(pagebench_bin, pageserver, "get-page", "--tenant", tenant, *SHAPE,
                        "--connections", "4", "--depth", "4", "--duration", "2", "--lsn", lsn, "--verify")
        summary = last_json_line(run.stdout)
        assert summary["errors"] == 0, f"{summary}\n{run.stderr}"
        assert summary["requests"] > 0, summary
        assert summary["rps"] > 0, summary
        for field in LATENCY_FIELDS:
            assert summary["latency_us"][field] > 0, summary
        assert summary["latency_us"]["p50"] <= summary["latency_us"]["p99"] <= summary["latency_us"]["p9999"]
        assert "requests/s" in run.stderr, "no per-second progress on stderr"


def test_pagebench_ingest_into_existing_tenant_needs_exists_ok_and_then_loads_nothing(
        pagebench_bin, pageserver):
    tenant = "bench-again"
    pagebench(pagebench_bin, pageserver, "ingest", "--tenant", tenant, *SHAPE)

    refused = pagebench(pagebench_bin, pageserver, "ingest", "--tenant", tenant, *SHAPE, check=False)
    assert refused.returncode != 0
    assert "exists" in refused.stderr, refused.stderr

    again = last_json_line(
        pagebench(pagebench_bin, pageserver, "ingest", "--tenant", tenant, *SHAPE, "--exists-ok").stdout)
    assert again["values"] == 0, again


def test_pagebench_get_page_refuses_a_data_set_that_was_not_loaded(pagebench_bin, pageserver, tenant):
    run = pagebench(pagebench_bin, pageserver, "get-page", "--tenant", tenant, *SHAPE, "--duration", "1",
                    check=False)
    assert run.returncode != 0
    assert "pagebench ingest" in run.stderr, run.stderr
