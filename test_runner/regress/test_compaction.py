"""Compaction: a pass keeps every page at every LSN at or above the GC cutoff byte-identical
(checked against the oracle), refuses older LSNs with `below_gc_cutoff`, frees disk, survives
`kill -9` at random moments, and runs by itself when record chains grow."""

import random
import threading
import time

from fixtures.http_client import HttpClient
from fixtures.page_client import LATEST
from fixtures.util import wait_until
from fixtures.workload import HistoryBuilder, get_pages, make_keys, query_lsns, verify

# The file header of `active.seg` (docs/storage-format.md): a segment this long holds no values.
ACTIVE_HEADER_BYTES = 16

CRASH_WARNINGS = [r"(?i)walredo", r"(?i)redo (child|process)", r"(?i)(torn|truncat|recover|replay|checksum)",
                  r"(?i)compaction"]


def _retained(rs, keys, cutoff, limit=40):
    return [(k, lsn) for k in keys for lsn in query_lsns(rs, k, limit=limit) if lsn == LATEST or lsn >= cutoff]


def _fill(ps, tenant, builder, keys, batches, per_batch=80):
    with ps.connect(tenant) as conn:
        for _ in range(batches):
            conn.ingest(builder.batch(keys, per_batch, image_prob=0.02))


def test_compaction_keeps_pages_frees_disk_and_refuses_below_the_cutoff(pageserver_factory):
    ps = pageserver_factory(compaction="off", gc_horizon=3000, layer_size="64 KiB")
    tenant = ps.create_tenant()
    keys = make_keys(12)
    b = HistoryBuilder(seed=71)
    _fill(ps, tenant, b, keys, 30)
    # The 30th batch fills the active segment, whose seal runs after the batch is acknowledged
    # (the layer count changes when it is done). One small batch more: its round finishes that
    # seal first, and it leaves values in the new active segment for the pass to seal.
    _fill(ps, tenant, b, keys, 1, per_batch=10)
    active = ps.timeline_dir(tenant) / "active.seg"
    assert active.stat().st_size > ACTIVE_HEADER_BYTES, "the active segment holds no values"
    before = ps.http.tenant_status(tenant)
    assert before["compaction"]["mode"] == "off" and before["compaction"]["passes"] == 0
    cutoff = b.rs.last_lsn - 3000

    r = ps.http.request("POST", f"/v1/tenant/{tenant}/compact")
    assert r.status == 200, r.body
    p = r.body["pass"]
    assert p["gc_cutoff"] == cutoff
    assert p["images_created"] > 0 and p["values_dropped"] > 0
    # Every layer, and the active segment sealed for the pass, were rewritten and deleted.
    assert p["files_deleted"] == p["input_layers"] == before["storage"]["layers"] + 1

    after = ps.http.tenant_status(tenant)
    assert after["storage"]["disk_bytes"] < before["storage"]["disk_bytes"]
    assert after["storage"]["layers"] == p["output_layers"] < before["storage"]["layers"]
    # The outputs are one run of key-disjoint layers: a lookup looks at one of them.
    assert after["storage"]["runs"] == 1 < before["storage"]["runs"], (before["storage"], after["storage"])
    c = after["compaction"]
    assert (c["passes"], c["gc_cutoff"], c["images_created"]) == (1, cutoff, p["images_created"])
    with ps.connect(tenant) as conn:
        assert verify(conn, b.rs, _retained(b.rs, keys, cutoff)) > 0
        replies = get_pages(conn, [(k, cutoff - 1) for k in keys])
        assert all(getattr(r, "name", None) == "below_gc_cutoff" for r in replies), replies
    m = ps.http.metrics()
    assert m.value("pageserver_compaction_passes_total", result="ok") == 1

    # The cutoff and the pages survive a restart; ingest goes on and compacts again.
    ps.restart()
    assert ps.http.tenant_status(tenant)["compaction"]["gc_cutoff"] == cutoff
    _fill(ps, tenant, b, keys, 5)
    assert ps.http.request("POST", f"/v1/tenant/{tenant}/compact").status == 200
    cutoff = b.rs.last_lsn - 3000
    with ps.connect(tenant) as conn:
        verify(conn, b.rs, _retained(b.rs, keys, cutoff))


def test_kill9_during_compaction_loses_nothing(pageserver_factory):
    ps = pageserver_factory(compaction="off", gc_horizon=2000, layer_size="64 KiB")
    ps.allowed_errors.extend(CRASH_WARNINGS)
    tenant = ps.create_tenant()
    keys = make_keys(10)
    b = HistoryBuilder(seed=72)
    rng = random.Random(5)
    cutoff = 0
    for round_ in range(6):
        _fill(ps, tenant, b, keys, 8)
        done = threading.Event()

        def compact():
            try:
                ps.http.request("POST", f"/v1/tenant/{tenant}/compact")
            except Exception:  # the daemon is killed under it
                pass
            done.set()

        t = threading.Thread(target=compact)
        t.start()
        time.sleep(rng.uniform(0.0, 0.05))
        ps.kill()
        t.join(timeout=30)
        ps.start()
        cutoff = ps.http.tenant_status(tenant)["compaction"]["gc_cutoff"]
        assert cutoff <= max(0, b.rs.last_lsn - 2000)
        with ps.connect(tenant) as conn:
            verify(conn, b.rs, _retained(b.rs, keys, cutoff, limit=25))


def test_kill9_during_automatic_passes_of_every_kind_loses_nothing(pageserver_factory):
    # Automatic passes (level 0 above a bottom run, mostly) killed at random moments.
    ps = pageserver_factory(compaction_image_threshold=4, gc_horizon=2000, layer_size="64 KiB")
    ps.allowed_errors.extend(CRASH_WARNINGS)
    tenant = ps.create_tenant()
    keys = make_keys(10)
    b = HistoryBuilder(seed=76)
    rng = random.Random(6)
    killed_in = []
    for round_ in range(8):
        _fill(ps, tenant, b, keys, 3)
        try:
            p = wait_until(lambda: ps.http.tenant_status(tenant)["compaction"]["current_pass"], timeout=10,
                           desc="an automatic pass to start")
            killed_in.append(p["kind"])
        except AssertionError:  # the pass came and went between two looks
            pass
        time.sleep(rng.uniform(0.0, 0.03))
        ps.kill()
        ps.start()
        # A pass after the restart may raise the cutoff at any moment, up to the horizon below
        # the last LSN (the cutoff the killed pass had not made durable yet): check what stays
        # readable whatever it does.
        cutoff = max(ps.http.tenant_status(tenant)["compaction"]["gc_cutoff"], b.rs.last_lsn - 2000)
        with ps.connect(tenant) as conn:
            verify(conn, b.rs, _retained(b.rs, keys, cutoff, limit=25))
    assert "level0" in killed_in, killed_in


def test_compaction_runs_by_itself_when_chains_grow(pageserver_factory):
    ps = pageserver_factory(compaction_image_threshold=4, layer_size="64 KiB")
    tenant = ps.create_tenant()
    keys = make_keys(6)
    b = HistoryBuilder(seed=73)
    _fill(ps, tenant, b, keys, 10)

    def passed():
        c = ps.http.tenant_status(tenant)["compaction"]
        return c["passes"] >= 1 and not c["running"] and c["backlog"] < 1.0

    # Writes have stopped: passes run until the backlog is under the threshold again.
    wait_until(passed, timeout=30, desc="automatic compaction passes to clear the backlog")
    c = ps.http.tenant_status(tenant)["compaction"]
    assert c["mode"] == "sliced" and c["images_created"] > 0 and c["last_pass"]["slices"] >= 1
    with ps.connect(tenant) as conn:
        verify(conn, b.rs, [(k, lsn) for k in keys for lsn in query_lsns(b.rs, k, limit=30)])


def test_automatic_passes_take_level0_and_full_passes_come_as_the_runs_grow(pageserver_factory):
    # Small layers and a low image threshold: every batch makes a pass due. Most take only the
    # layers sealed since the last pass (level 0, or the runs stacked above the bottom one);
    # a full pass rewrites everything once the runs above the bottom one hold as much as it.
    ps = pageserver_factory(compaction_image_threshold=4, layer_size="64 KiB")
    tenant = ps.create_tenant()
    keys = make_keys(20)
    b = HistoryBuilder(seed=75)

    def partial_passes():
        c = ps.http.tenant_status(tenant)["compaction"]
        return c["passes"] - c["full_passes"]

    for _ in range(40):
        passes = ps.http.tenant_status(tenant)["compaction"]["passes"]
        # Two batches: about 8 new records per key, twice the threshold: a pass is due.
        _fill(ps, tenant, b, keys, 2)
        wait_until(lambda: ps.http.tenant_status(tenant)["compaction"]["passes"] > passes, timeout=30,
                   desc="an automatic pass")
        if ps.http.tenant_status(tenant)["compaction"]["full_passes"] >= 2 and partial_passes() >= 8:
            break
    c = ps.http.tenant_status(tenant)["compaction"]
    assert c["full_passes"] >= 2 and partial_passes() >= 8, c
    assert c["failed_passes"] == 0, c
    with ps.connect(tenant) as conn:
        verify(conn, b.rs, [(k, lsn) for k in keys for lsn in query_lsns(b.rs, k, limit=25)])


def test_automatic_gc_passes_collect_the_layers_that_newer_images_shadow(pageserver_factory):
    # A bottom run of 60 keys (one full pass), then updates of its 12 lowest keys only: level 0
    # passes give them newer images, which shadow their values in the bottom run's first
    # layers. GC passes of those layers collect them without a full pass, and every retained
    # page stays as the oracle has it.
    ps = pageserver_factory(compaction_image_threshold=4, gc_horizon=2000, layer_size="64 KiB")
    tenant = ps.create_tenant()
    keys = make_keys(60)
    b = HistoryBuilder(seed=77)
    _fill(ps, tenant, b, keys, 12)
    assert ps.http.request("POST", f"/v1/tenant/{tenant}/compact").status == 200
    bottom = ps.http.tenant_status(tenant)["storage"]
    assert bottom["runs"] == 1 and bottom["layers"] > 3, bottom
    hot = sorted(keys)[:12]

    def collected():
        c = ps.http.tenant_status(tenant)["compaction"]
        return c["gc_passes"] - c["gc_passes_skipped"]

    for _ in range(60):
        _fill(ps, tenant, b, hot, 2)
        time.sleep(0.2)
        if collected() >= 1:
            break

    def settled():
        c = ps.http.tenant_status(tenant)["compaction"]
        return c if not c["running"] and c["backlog"] < 1.0 else None

    # Passes run until nothing is due (so the cutoff stays where it is while pages are read).
    c = wait_until(settled, timeout=60, desc="the compactor to catch up")
    assert collected() >= 1, c
    assert c["full_passes"] == 1 and c["failed_passes"] == 0, c
    assert c["gc_cutoff"] > 0
    with ps.connect(tenant) as conn:
        verify(conn, b.rs, _retained(b.rs, keys, c["gc_cutoff"], limit=25))
    ps.restart()
    c = wait_until(settled, timeout=60, desc="the compactor to catch up")
    with ps.connect(tenant) as conn:
        verify(conn, b.rs, _retained(b.rs, keys, c["gc_cutoff"], limit=25))


def test_one_hot_key_makes_a_pass_due_whatever_the_average(pageserver_factory):
    # 100 keys with an image each, then 40 records on one of them: on average 0.4 records per
    # key (a twentieth of the image threshold 8), but one chain of 40, over 4 x 8.
    ps = pageserver_factory()
    tenant = ps.create_tenant()
    keys = make_keys(100)
    b = HistoryBuilder(seed=74)
    images = [v for k in keys for v in b.batch([k], 1, image_prob=1.0)]
    with ps.connect(tenant) as conn:
        conn.ingest(images)
        conn.ingest(b.batch([keys[0]], 40, image_prob=0.0))

    def passed():
        c = ps.http.tenant_status(tenant)["compaction"]
        return c["passes"] >= 1 and not c["running"] and c["backlog"] < 1.0

    wait_until(passed, timeout=30, desc="a compaction pass due to the hot key")
    c = ps.http.tenant_status(tenant)["compaction"]
    assert c["images_created"] == 1 and c["last_pass"]["images_created"] == 1, c
    with ps.connect(tenant) as conn:
        verify(conn, b.rs, [(k, lsn) for k in keys[:5] for lsn in query_lsns(b.rs, k, limit=20)])


def _slow_pass_daemon(pageserver_factory):
    """A daemon whose passes take at most 2% of a CPU: a pass of a few thousand values lasts
    seconds, longer than any client here waits for its answer."""
    return pageserver_factory(compaction="off", gc_horizon=1 << 40, layer_size="64 KiB",
                              raw_args=["compaction_cpu_floor=0.02", "compaction_cpu_cap=0.02"])


def _compact_and_go_away(ps, tenant):
    """POSTs a compaction with a client that gives up after half a second."""
    client = HttpClient(ps.http_addr, timeout=0.5)
    try:
        r = client.request("POST", f"/v1/tenant/{tenant}/compact")
    except OSError:  # the timeout: the client went away with the pass running
        return None
    return r


def _in_progress(ps, tenant):
    p = ps.http.tenant_status(tenant)["compaction"]["current_pass"]
    return p if p is not None and 0 < p["values_read"] < p["input_values"] // 2 else None


def test_compact_call_whose_client_goes_away_runs_on_and_shows_its_progress(pageserver_factory):
    ps = _slow_pass_daemon(pageserver_factory)
    tenant = ps.create_tenant()
    keys = make_keys(40)
    b = HistoryBuilder(seed=75)
    _fill(ps, tenant, b, keys, 60)
    assert _compact_and_go_away(ps, tenant) is None, "the pass ended within half a second"

    p = wait_until(lambda: _in_progress(ps, tenant), timeout=60, desc="the pass to show its progress")
    assert p["requested"] is True and p["started_at"].endswith("Z"), p
    assert p["input_values"] == sum(len(b.rs.lsns(k)) for k in keys), p

    def ended():
        c = ps.http.tenant_status(tenant)["compaction"]
        return c if c["passes"] == 1 else None

    c = wait_until(ended, timeout=120, desc="the pass to end without its client")
    assert c["current_pass"] is None and c["failed_passes"] == 0, c
    assert c["last_pass"]["values_read"] == p["input_values"], c
    with ps.connect(tenant) as conn:
        verify(conn, b.rs, [(k, lsn) for k in keys[:10] for lsn in query_lsns(b.rs, k, limit=20)])


def test_shutdown_during_a_pass_says_so_and_loses_nothing(pageserver_factory):
    ps = _slow_pass_daemon(pageserver_factory)
    tenant = ps.create_tenant()
    keys = make_keys(40)
    b = HistoryBuilder(seed=76)
    _fill(ps, tenant, b, keys, 60)
    assert _compact_and_go_away(ps, tenant) is None, "the pass ended within half a second"
    wait_until(lambda: _in_progress(ps, tenant), timeout=60, desc="the pass to be under way")
    layers = ps.http.tenant_status(tenant)["storage"]["layers"]

    ps.stop()  # SIGTERM, with the pass half done
    cancelled = [line for line in ps.log_path.read_text().splitlines()
                 if "compaction pass cancelled by shutdown" in line]
    assert len(cancelled) == 1, cancelled
    assert "outputs are removed" in cancelled[0] and "values_read=" in cancelled[0], cancelled

    ps.start()
    status = ps.http.tenant_status(tenant)
    assert status["compaction"]["passes"] == 0 and status["storage"]["layers"] == layers, status
    with ps.connect(tenant) as conn:
        verify(conn, b.rs, [(k, lsn) for k in keys[:10] for lsn in query_lsns(b.rs, k, limit=20)])
