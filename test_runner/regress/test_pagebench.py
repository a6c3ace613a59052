"""pagebench as a tool (ARCHITECTURE.md, `pagebench`): exit status on errors, the key space
read from the daemon instead of shape flags, `ingest --exists-ok` refusing another data set,
several tenants. Tiny data sets and one-second runs: correctness, never speed."""

from __future__ import annotations

import json
import subprocess

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key

SHAPE = ["--relations", "2", "--blocks", "8", "--chain-length", "2", "--seed", "7"]
# The data set's first relation and pagebench's default LSN layout (dataset.rs).
FIRST_RELNODE, SPCNODE, DBNODE = 16384, 1663, 1
FIRST_LSN = 0x0100_0000
REDO_FAILED_WARNING = r"failed to reconstruct a page"


def pagebench(ps, *args, check=True, timeout=120) -> subprocess.CompletedProcess:
    command = [str(ps.bin.parent / "pagebench"), *args, "--page-service", "%s:%d" % ps.pg_addr,
               "--http", "%s:%d" % ps.http_addr]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"{command} failed ({result.returncode}):\n{result.stderr}"
    return result


def summary(result) -> dict:
    lines = result.stdout.strip().splitlines()
    assert lines, f"pagebench printed nothing on stdout:\n{result.stderr}"
    return json.loads(lines[-1])


def test_get_page_exit_status_is_nonzero_when_requests_fail(pageserver):
    """A tenant whose only page cannot be rebuilt: every request fails."""
    pageserver.allowed_errors.append(REDO_FAILED_WARNING)
    tenant = pageserver.create_tenant()
    key = Key(SPCNODE, DBNODE, FIRST_RELNODE, 0, 0)
    # far above the default data set's end LSN, so that no shape check refuses the run
    with pageserver.connect(tenant) as conn:
        conn.ingest([(key, FIRST_LSN + (1 << 30), o.RECORD, o.insert(b"no page to insert into"))])
    run = pagebench(pageserver, "get-page", "--tenant", tenant, "--duration", "1", check=False)
    s = summary(run)
    assert s["errors"] > 0 and s["requests"] == 0, s
    assert run.returncode == 1, f"exit status {run.returncode} with {s['errors']} errors:\n{run.stderr}"
    # tolerated errors
    tolerated = pagebench(pageserver, "get-page", "--tenant", tenant, "--duration", "1",
                          "--max-errors", "1000000000")
    assert summary(tolerated)["errors"] > 0


def test_get_page_discovers_the_key_space_without_shape_flags(pageserver):
    pagebench(pageserver, "ingest", "--tenant", "pb", *SHAPE)
    for lsn in ("latest", "random"):
        run = pagebench(pageserver, "get-page", "--tenant", "pb", "--duration", "1", "--lsn", lsn,
                        "--connections", "2", "--depth", "4")
        s = summary(run)
        assert s["errors"] == 0 and s["requests"] > 0, f"{s}\n{run.stderr}"
        assert s["pages"] == 16, s
    # verify needs the shape, and the shape then checks out
    run = pagebench(pageserver, "get-page", "--tenant", "pb", *SHAPE, "--duration", "1", "--lsn", "random",
                    "--verify")
    assert summary(run)["errors"] == 0, run.stderr


@pytest.mark.parametrize("wrong", [["--relations", "3"], ["--blocks", "9"], ["--chain-length", "1"],
                                   ["--seed", "8"]], ids=["relations", "blocks", "chain", "seed"])
def test_get_page_verify_refuses_another_shape(pageserver, wrong):
    pagebench(pageserver, "ingest", "--tenant", "pb", *SHAPE)
    flags = dict(zip(SHAPE[::2], SHAPE[1::2]))
    flags[wrong[0]] = wrong[1]
    run = pagebench(pageserver, "get-page", "--tenant", "pb", *sum(map(list, flags.items()), []),
                    "--duration", "1", "--verify", check=False)
    assert run.returncode != 0, run.stderr
    assert "data set" in run.stderr, run.stderr


def test_get_page_on_an_empty_tenant_says_to_ingest(pageserver):
    tenant = pageserver.create_tenant()
    run = pagebench(pageserver, "get-page", "--tenant", tenant, "--duration", "1", check=False)
    assert run.returncode != 0
    assert "pagebench ingest" in run.stderr, run.stderr


@pytest.mark.parametrize("wrong", [["--relations", "3"], ["--relations", "1"], ["--blocks", "4"],
                                   ["--seed", "8"], ["--chain-length", "1"]],
                         ids=["more_relations", "fewer_relations", "fewer_blocks", "seed", "shorter_chain"])
def test_ingest_exists_ok_refuses_another_shape(pageserver, wrong):
    first = summary(pagebench(pageserver, "ingest", "--tenant", "pb", *SHAPE))
    flags = dict(zip(SHAPE[::2], SHAPE[1::2]))
    flags[wrong[0]] = wrong[1]
    run = pagebench(pageserver, "ingest", "--tenant", "pb", *sum(map(list, flags.items()), []), "--exists-ok",
                    check=False)
    assert run.returncode != 0, run.stderr
    assert "another data set" in run.stderr, run.stderr
    st = pageserver.http.tenant_status("pb")
    assert st["last_durable_lsn"] == first["end_lsn"] and st["storage"]["values"] == first["values"], st


def test_ingest_exists_ok_with_the_same_shape_loads_nothing_and_a_longer_chain_continues(pageserver):
    first = summary(pagebench(pageserver, "ingest", "--tenant", "pb", *SHAPE))
    assert first["values"] == 16 * 3
    again = summary(pagebench(pageserver, "ingest", "--tenant", "pb", *SHAPE, "--exists-ok"))
    assert again["values"] == 0, again
    longer = [*SHAPE[:4], "--chain-length", "3", *SHAPE[6:]]
    more = summary(pagebench(pageserver, "ingest", "--tenant", "pb", *longer, "--exists-ok"))
    assert more["values"] == 16, more
    run = pagebench(pageserver, "get-page", "--tenant", "pb", *longer, "--duration", "1", "--verify",
                    "--lsn", "random")
    assert summary(run)["errors"] == 0, run.stderr


def test_ingest_exists_ok_resumes_a_data_set_whose_first_images_are_below_the_gc_cutoff(pageserver_factory):
    # A compaction pass with a short GC window drops the data set's first versions: the check
    # of its seed (page 0 at its first LSN) cannot read them any more, and resuming the load
    # must still work (the key space's shape is checked; the seed cannot be).
    ps = pageserver_factory(compaction="off", gc_horizon=4)
    first = summary(pagebench(ps, "ingest", "--tenant", "pb", *SHAPE))
    r = ps.http.request("POST", "/v1/tenant/pb/compact")
    assert r.status == 200 and r.body["pass"]["gc_cutoff"] > FIRST_LSN, r.body
    longer = [*SHAPE[:4], "--chain-length", "3", *SHAPE[6:]]
    run = pagebench(ps, "ingest", "--tenant", "pb", *longer, "--exists-ok")
    assert summary(run)["values"] == 16, run.stderr
    assert "below the GC cutoff" in run.stderr, run.stderr
    assert ps.http.tenant_status("pb")["last_durable_lsn"] > first["end_lsn"]
    # Another data set is still refused by the shape.
    wrong = [*SHAPE[:2], "--blocks", "9", *SHAPE[4:]]
    refused = pagebench(ps, "ingest", "--tenant", "pb", *wrong, "--exists-ok", check=False)
    assert refused.returncode != 0 and "another data set" in refused.stderr, refused.stderr


def test_ingest_with_rate_and_duration_paces_the_load_and_stops_at_an_acknowledged_lsn(pageserver):
    summary(pagebench(pageserver, "ingest", "--tenant", "pb", *SHAPE))
    # A long chain that 1.5 s at 200 values/s cannot finish: the duration ends the load.
    longer = [*SHAPE[:4], "--chain-length", "1000", *SHAPE[6:]]
    paced = summary(pagebench(pageserver, "ingest", "--tenant", "pb", *longer, "--exists-ok",
                              "--rate", "200", "--duration", "1.5"))
    # Paced, not as fast as the daemon takes them (16000 values would load in well under 1.5 s):
    # about 300, with a generous margin for a slow machine.
    assert 100 <= paced["values"] <= 600, paced
    st = pageserver.http.tenant_status("pb")
    assert st["last_durable_lsn"] == paced["acked_lsn"] and st["storage"]["values"] == 48 + paced["values"], st
    # The paced load stopped on a batch boundary: an unpaced resume finishes the data set, and
    # every page is right.
    rest = summary(pagebench(pageserver, "ingest", "--tenant", "pb", *longer, "--exists-ok"))
    assert rest["values"] == 16 * 1001 - 48 - paced["values"], rest
    run = pagebench(pageserver, "get-page", "--tenant", "pb", *longer, "--duration", "1", "--verify",
                    "--lsn", "random")
    assert summary(run)["errors"] == 0, run.stderr


@pytest.mark.parametrize("flag", [["--rate", "0"], ["--rate", "nan"], ["--duration=-1"], ["--duration", "inf"],
                                  ["--duration", "1e300"]])
def test_ingest_refuses_a_bad_rate_or_duration(pageserver, flag):
    result = pagebench(pageserver, "ingest", "--tenant", "pb", *SHAPE, *flag, check=False)
    assert result.returncode != 0 and "check --" in result.stderr, result.stderr


def test_get_page_open_loop_rate_steps_and_series(pageserver, tmp_path):
    summary(pagebench(pageserver, "ingest", "--tenant", "pb", *SHAPE))
    series = tmp_path / "series.jsonl"
    run = pagebench(pageserver, "get-page", "--tenant", "pb", "--rate", "100:1s,300:1s", "--connections", "2",
                    "--series", str(series))
    s = summary(run)
    assert s["errors"] == 0 and [step["rps"] for step in s["rate"]] == [100, 300], s
    # About 400 requests on schedule (100 + 300), whatever the daemon's speed: open loop.
    assert 300 <= s["requests"] <= 450, s
    lines = [json.loads(line) for line in series.read_text().splitlines()]
    assert [line["target_rps"] for line in lines[:2]] == [100, 300], lines
    assert sum(line["requests"] for line in lines) == s["requests"], lines
    assert all(line["latency_us"]["p50"] <= line["latency_us"]["max"] for line in lines if line["requests"]), lines
    bad = pagebench(pageserver, "get-page", "--tenant", "pb", "--rate", "100:1s", "--duration", "1", check=False)
    assert bad.returncode != 0 and "check --" in bad.stderr, bad.stderr


def test_get_page_drives_several_tenants(pageserver):
    loaded = summary(pagebench(pageserver, "ingest", "--tenant", "multi", "--tenants", "3", *SHAPE))
    assert loaded["tenants"] == 3 and loaded["values"] == 3 * 16 * 3, loaded
    run = pagebench(pageserver, "get-page", "--tenant", "multi", "--tenants", "3", "--duration", "1",
                    "--depth", "2")
    s = summary(run)
    assert s["tenants"] == 3 and s["errors"] == 0 and s["pages"] == 3 * 16, s
    for i in range(3):
        st = pageserver.http.tenant_status(f"multi-{i}")
        assert st["counters"]["get_page_requests"] > 0, st
    # `all`: every tenant of the daemon, each with its own connections
    pagebench(pageserver, "ingest", "--tenant", "other", *SHAPE)
    s = summary(pagebench(pageserver, "get-page", "--tenants", "all", "--duration", "1", *SHAPE, "--verify"))
    assert s["tenants"] == 4 and s["errors"] == 0, s
    assert pageserver.http.tenant_status("other")["counters"]["get_page_requests"] > 0


def test_pagebench_whose_stdout_reader_went_away_ends_normally(pageserver):
    """`pagebench ... | head -1`: the reader is gone before the summary line is written."""
    pagebench(pageserver, "ingest", "--tenant", "gone", *SHAPE)
    command = [str(pageserver.bin.parent / "pagebench"), "get-page", "--tenant", "gone", "--duration", "1",
               "--page-service", "%s:%d" % pageserver.pg_addr, "--http", "%s:%d" % pageserver.http_addr]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=60)
    assert "panicked" not in stderr, stderr
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{stderr}"
