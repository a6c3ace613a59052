"""A tenant following a real PostgreSQL 15 primary (`PUT /v1/tenant/{id}/wal_source`): every
block reference of the WAL it streams becomes exactly one value, and every visibility-map page a
heap record clears bits of without referencing it one more (both counted from PostgreSQL's own
`pg_waldump`: its block references and its record flags), and so every size, file and CLOG page
(the checkpoint counters, stored once per batch, are read back), also across a kill -9 of the
daemon; a page whose newest value is an applied
full-page image is served with the record's LSN; a page rebuilt by Heap redo is PostgreSQL's;
bad sources and detaching behave.

The child applies every record a PostgreSQL 15 core resource manager changes a page with, so
no page of a primary fails with `unsupported_record` here. That path (a page whose chain holds a
record the child refuses fails alone, naming it; compaction keeps such a key's values and skips
it later) is covered by
`test_compaction_long_chains.py::test_a_long_chain_with_a_record_the_child_refuses_fails_only_as_that_record`
(a custom resource manager's record) and compaction's unit tests."""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import contextmanager

import pytest

from fixtures.fault_io import FaultIo
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError
from fixtures.postgres import Postgres
from fixtures.util import wait_until
from fixtures.pgmask import heap_mask
from fixtures.walreader import Wal, mask_lsn_and_checksum
from fixtures.wal_source import attach, caught_up, counters_values, page_service_io  # noqa: F401 (a fixture)
from fixtures.waldump import Sizes, lsn_int, lsn_text, record_types, twophase_chunks, waldump_records


@pytest.fixture
def pg(tmp_path):
    # No autovacuum: the WAL is the tests' own, so counts taken a moment apart agree.
    # Images compressed with PGLZ, so that the image path the daemon and the reader take is the
    # harder one.
    pg = Postgres(tmp_path / "pg", settings={"autovacuum": "off", "wal_compression": "pglz",
                                             "max_prepared_transactions": "2"}).init().start()
    # The test's own slot keeps the WAL that pg_waldump reads after the tenant's slot moved on.
    pg.sql("select pg_create_physical_replication_slot('keep', true)")
    yield pg
    pg.stop()


def expected_values(pg: Postgres, start: int, end: int, sizes: dict, ps, tenant: str) -> int:
    """Values stored for the records in [start, end): block references, derived map clears,
    relation sizes, files and CLOG pages (`sizes`: the fork sizes at `start`, see `fork_sizes`),
    and the checkpoint counters, once per batch that changed them (read back from the tenant)."""
    records = [r for r in waldump_records(pg, start, end, Sizes(dict(sizes))) if r[0] >= start]
    return sum(len(refs) + len(vm) + other for _, refs, vm, other in records) \
        + counters_values(ps, tenant, [r[0] for r in records], end)


@contextmanager
def pgbench_running(pg: Postgres, seconds: int):
    """`pgbench -c 2 -j 2 -T seconds` in the background while the block runs; then it must
    have succeeded (it is killed if the block fails)."""
    load = subprocess.Popen(pg._cmd("pgbench", "-h", str(pg.sockdir), "-p", str(pg.port), "-c", "2", "-j", "2",
                                    "-T", str(seconds), "-n", "postgres"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield load
        assert load.wait(timeout=120) == 0, load.stderr.read() if load.stderr else ""
    finally:
        if load.poll() is None:
            load.kill()


# `pg` comes first: set up first, it is stopped after the daemons (whose receivers would
# otherwise see it go away).
def test_every_block_reference_is_stored_once_and_pages_are_served(pg, pageserver_factory):
    ps = pageserver_factory(compaction="off")
    tenant = ps.create_tenant()
    status = attach(ps, tenant, pg)
    resumed = status["resumed_at"]
    imported = status["import"]["values"]
    assert resumed == status["import"]["start_lsn"] > 0 and imported > 1000, status
    at_attach = fork_sizes(pg, "true")
    pg.pgbench("-i", "-s", "1", "-q")
    pg.pgbench("-c", "2", "-j", "2", "-T", "4", "-n")
    # Multixacts (a row share-locked, then updated by a subtransaction of the same
    # transaction): values for their offsets and members pages.
    pg.sql("CREATE TABLE mx (i int PRIMARY KEY, v int); INSERT INTO mx SELECT g, 0 FROM generate_series(1, 3000) g")
    pg.sql("""DO $$ BEGIN FOR r IN 1..3000 LOOP
                PERFORM 1 FROM mx WHERE i = r FOR SHARE;
                BEGIN UPDATE mx SET v = 1 WHERE i = r; EXCEPTION WHEN others THEN RAISE; END;
              END LOOP; END $$""")
    # Prepared transactions: a state file each (one of 3000 subtransactions, 12 KB of it, in
    # chunks), emptied by COMMIT PREPARED and ROLLBACK PREPARED.
    pg.sql("BEGIN; INSERT INTO mx VALUES (0, 0); PREPARE TRANSACTION 'small'")
    pg.sql("BEGIN; DO $$ BEGIN FOR r IN 3001..6000 LOOP BEGIN INSERT INTO mx VALUES (r, 0); "
           "EXCEPTION WHEN others THEN RAISE; END; END LOOP; END $$; PREPARE TRANSACTION 'big'")
    pg.sql("COMMIT PREPARED 'small'")
    pg.sql("ROLLBACK PREPARED 'big'")
    # VACUUM sets pages all-visible; the UPDATEs then clear their visibility-map bits.
    pg.sql("VACUUM pgbench_accounts")
    pg.sql("UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid % 997 = 0")
    pg.sql("CHECKPOINT")
    # The first change after the checkpoint logs the page's image; the second only a record.
    pg.sql("UPDATE pgbench_branches SET bbalance = bbalance + 1")
    pg.sql("UPDATE pgbench_branches SET bbalance = bbalance + 1")
    s = caught_up(ps, tenant, pg)
    durable = s["wal_source"]["durable_lsn"]
    assert s["wal_source"]["lag_bytes"] >= 0 and s["wal_source"]["last_message"]
    records = [r for r in waldump_records(pg, resumed, durable, Sizes(dict(at_attach))) if r[0] >= resumed]
    vm_values = sum(len(vm) for _, _, vm, _ in records)
    assert vm_values > 0, "the UPDATEs after VACUUM cleared visibility-map bits"
    other = sum(o for _, _, _, o in records)
    assert other > 20, "pgbench -i creates relations and extends them"
    types = record_types(pg, resumed, durable)
    assert sum(t == "MultiXact CREATE_ID" for t in types.values()) >= 3000, "the multixacts are in the count"
    assert sum(t == "Transaction PREPARE" for t in types.values()) == 2, "the prepares are in the count"
    prepares = [line for line in pg.waldump(lsn_text(resumed), lsn_text(durable)).splitlines() if "desc: PREPARE" in line]
    assert sorted(twophase_chunks(line) for line in prepares) == [1, 2], "a state file of two chunks is in it"
    counters = counters_values(ps, tenant, [r[0] for r in records], durable)
    assert counters > 10, "the counters moved with the transactions"
    wal_values = sum(len(refs) for _, refs, _, _ in records) + vm_values + other + counters
    assert s["storage"]["values"] == imported + wal_values and wal_values > 10_000
    # The slot keeps only what is not durable here. The server goes on writing WAL (a running
    # transactions record every 15 s), which the receiver goes on making durable and reporting:
    # compare with what is durable once the slot has been read, not with the earlier `durable`.
    restart = lsn_int(pg.sql("select restart_lsn from pg_replication_slots where slot_name = 'pageserver'"))
    durable_now = ps.http.tenant_status(tenant)["wal_source"]["durable_lsn"]
    assert resumed <= restart <= durable_now, (restart, durable, durable_now)

    # Full-page images, served as redo leaves them: PostgreSQL's own image bytes (read by an
    # independent reader from pg_wal), with pd_lsn the record's end, which lies between the
    # record's start and the next record's.
    fpis = [(records[i][0], records[i + 1][0], key) for i in range(len(records) - 1)
            for key, applied in records[i][1] if applied]
    wal = Wal(pg.wal_dir)
    # A map page whose newest value is a derived clear needs redo too.
    last_vm = next(vm for _, _, vm, _ in reversed(records) if vm)
    assert len(fpis) > 50
    with ps.connect(tenant) as conn:
        for start, next_start, key in fpis[:: max(1, len(fpis) // 200)]:
            page = conn.get_page(key, next_start)
            pd_lsn = (int.from_bytes(page[0:4], "little") << 32) | int.from_bytes(page[4:8], "little")
            assert start < pd_lsn <= next_start, (key, lsn_text(start), lsn_text(pd_lsn))
            image = next(i for i in wal.images(start)
                         if (i.spcnode, i.dbnode, i.relnode, i.fork, i.blkno) ==
                         (key.spcnode, key.dbnode, key.relnode, key.forknum, key.blknum))
            assert image.apply
            assert mask_lsn_and_checksum(page) == mask_lsn_and_checksum(image.page), (key, lsn_text(start))
        # pgbench_branches' page changed again after its post-checkpoint image: Heap redo
        # rebuilds it, as PostgreSQL has it (its data file after a checkpoint, masked).
        pg.sql("CHECKPOINT")
        # Its record moves the checkpoint counters: a value more, which the count below has.
        s = caught_up(ps, tenant, pg)
        dbnode = int(pg.sql("select oid from pg_database where datname = 'postgres'"))
        path = pg.datadir / pg.sql("select pg_relation_filepath('pgbench_branches')")
        branches = int(pg.sql("select pg_relation_filenode('pgbench_branches')"))
        page = conn.get_page(Key(1663, dbnode, branches, 0, 0), durable)
        assert heap_mask(page) == heap_mask(path.read_bytes()[:8192])
        # A map page whose newest value is a derived clear is rebuilt too (VISIBLE, then clears).
        assert len(conn.get_page(sorted(last_vm, key=lambda k: k.blknum)[0], durable)) == 8192
        start, next_start, key = fpis[0]
        assert len(conn.get_page(key, next_start)) == 8192
        # Its values come from the WAL only: an Ingest is refused, nothing stored.
        with pytest.raises(PageServiceError) as e:
            conn.ingest([(key, durable + 8, 0, b"\0" * 8192)])  # kind 0: an image
        assert e.value.name == "invalid_request" and "wal_source" in str(e.value), e.value
    assert ps.http.tenant_status(tenant)["storage"]["values"] == s["storage"]["values"]
    metrics = ps.http.metrics()
    assert metrics.value("pageserver_wal_receiver_values_total") == s["storage"]["values"] - imported


def test_kill_9_and_a_primary_restart_resume_with_no_gap_and_no_duplicate(pg, pageserver_factory):
    ps = pageserver_factory(compaction="off")
    tenant = ps.create_tenant()
    status = attach(ps, tenant, pg)
    resumed, imported = status["resumed_at"], status["import"]["values"]
    at_attach = fork_sizes(pg, "true")
    pg.pgbench("-i", "-s", "1", "-q")
    with pgbench_running(pg, 6):
        wait_until(lambda: ps.http.tenant_status(tenant)["wal_source"]["durable_lsn"] > resumed + (8 << 20),
                   timeout=60, desc="streaming to be well under way")
        # A kill -9 in the middle of a write leaves a torn tail that the restart cuts (and logs).
        ps.allowed_errors.append(r"(?i)torn tail")
        ps.kill()
        time.sleep(0.5)
        ps.start()
    s = caught_up(ps, tenant, pg)
    assert s["wal_source"]["resumed_at"] > resumed, "the second connection resumed where the first stopped"
    assert s["storage"]["values"] == imported + expected_values(pg, resumed, s["wal_source"]["durable_lsn"],
                                                                at_attach, ps, tenant)
    # A restart of PostgreSQL: the receiver sees the stream end, reconnects, and goes on.
    ps.allowed_errors.append(".*WAL receiver: .*")
    pg.stop()
    # What the stream held when it ended is stored before the connection goes, the shutdown
    # checkpoint included: after a promotion no later connection would stream it again.
    shutdown = lsn_int(pg.controldata()["Latest checkpoint location"])
    wait_until(lambda: ps.http.tenant_status(tenant)["last_durable_lsn"] > shutdown, timeout=30,
               desc="the WAL up to the end of the stream to be durable while the primary is down")
    pg.start()
    pg.pgbench("-c", "2", "-j", "2", "-T", "2", "-n")
    s = caught_up(ps, tenant, pg)
    assert s["wal_source"]["reconnects"] >= 1 and s["wal_source"]["state"] == "streaming", s["wal_source"]
    assert s["wal_source"]["error"] is None, "streaming again clears the last error"
    assert s["storage"]["values"] == imported + expected_values(pg, resumed, s["wal_source"]["durable_lsn"],
                                                                at_attach, ps, tenant)


def test_a_write_failed_while_the_receiver_was_busy_leaves_no_gap(pg, pageserver_factory, tmp_path):
    """A group commit fails with ENOSPC (transient: storage takes ingests again a second later)
    while the receiver is busy persisting its position for longer than that second, with
    batches queued behind a slow commit: the receiver's next batch must not be stored above the
    lost ones. After catch-up, the values stored are those counted from `pg_waldump`."""
    faults = FaultIo(tmp_path / "faults")
    ps = pageserver_factory(compaction="off", env=faults.env)
    ps.allowed_errors += [r".*failed to write to storage.*", r".*WAL receiver.*"]
    tenant = ps.create_tenant()
    status = attach(ps, tenant, pg)
    resumed, imported = status["resumed_at"], status["import"]["values"]
    at_attach = fork_sizes(pg, "true")
    pg.pgbench("-i", "-s", "1", "-q")
    try:
        with pgbench_running(pg, 8):
            wait_until(lambda: ps.http.tenant_status(tenant)["wal_source"]["durable_lsn"] > resumed + (4 << 20),
                       timeout=60, desc="streaming to be well under way")
            faults.set("slow_commit")
            faults.set("arm")
            wait_until(lambda: faults.is_set("failed"), timeout=30, desc="a segment write to fail")
            faults.clear("slow_commit")
    finally:
        faults.clear("slow_commit")
    # The fault came as planned: the write failed while the receiver was busy, more than the
    # storage's retry interval (1 s) before it was free again.
    events = {what: float(at) for at, what in (line.split(" ", 1) for line in faults.events().splitlines())}
    assert events["the persist fsync sleeps"] < events["a segment write fails"] \
        < events["the persist fsync wakes"] - 1.0, faults.events()
    s = caught_up(ps, tenant, pg)
    assert s["wal_source"]["reconnects"] >= 1, "the failed batch ended the connection"
    assert s["storage"]["values"] == imported + expected_values(pg, resumed, s["wal_source"]["durable_lsn"],
                                                                at_attach, ps, tenant)


def slot_restart_lsn(pg: Postgres) -> int:
    return lsn_int(pg.sql("select restart_lsn from pg_replication_slots where slot_name = 'pageserver'"))


def test_the_slot_is_never_told_a_position_the_source_file_lacks(pg, pageserver_factory, tmp_path):
    """The receiver cannot persist its position (the source file's fsync fails) after records
    with no values moved storage's durable LSN past it: the next connection resumes there, and
    must write that position down before it tells the slot, which lets PostgreSQL remove the
    WAL below. A kill -9 right after, and the daemon resumes from its file."""
    faults = FaultIo(tmp_path / "faults")
    ps = pageserver_factory(compaction="off", env=faults.env)
    ps.allowed_errors.append(r".*WAL receiver.*")
    tenant = ps.create_tenant()
    attach(ps, tenant, pg)
    pg.pgbench("-i", "-s", "1", "-q")
    first = caught_up(ps, tenant, pg)["wal_source"]
    faults.set("fail_persist")
    # Ends with a commit record, which carries no value.
    pg.sql("CREATE TABLE t (i int)")
    pg.sql("INSERT INTO t VALUES (1)")
    s = wait_until(lambda: (w := ps.http.tenant_status(tenant)["wal_source"])["reconnects"] > first["reconnects"]
                   and w["state"] == "streaming" and w, timeout=30, desc="a connection after the failed persist")
    assert "the persist fsync fails" in faults.events()
    wait_until(lambda: slot_restart_lsn(pg) >= s["resumed_at"], timeout=30, desc="the first status of it")
    told = slot_restart_lsn(pg)
    ps.kill()
    position = json.loads((ps.timeline_dir(tenant).parent / "wal_source.json").read_text())["position"]
    assert told <= position, (lsn_text(told), lsn_text(position))
    ps.start()
    caught_up(ps, tenant, pg)
    assert slot_restart_lsn(pg) <= json.loads(
        (ps.timeline_dir(tenant).parent / "wal_source.json").read_text())["position"]


def test_bad_sources_are_refused_or_reported_and_detach_stops(pg, pageserver_factory):
    ps = pageserver_factory()
    tenant = ps.create_tenant()
    for body in [{"postgres": "host=x", "slot": "s"}, {"postgres": pg.connstr(), "slot": "Bad-Slot"},
                 {"postgres": pg.connstr() + " sslmode=require", "slot": "s"}, {"postgres": pg.connstr()}]:
        resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/wal_source", body)
        assert resp.status in (400, 422), (body, resp)
    assert ps.http.tenant_status(tenant)["wal_source"] is None
    # Nothing listens there: an error state with its reason, retried, and the tenant serves on.
    dead = f"host=127.0.0.1 port={pg.port + 1 if pg.port < 65535 else 1} user=postgres"
    ps.allowed_errors.append(".*WAL receiver.*")
    resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/wal_source", {"postgres": dead, "slot": "s"})
    assert resp.status == 200, resp
    s = wait_until(lambda: (w := ps.http.tenant_status(tenant)["wal_source"])["state"] == "error" and w,
                   timeout=30, desc="the error state")
    assert "connect" in s["error"], s
    assert ps.http.request("DELETE", f"/v1/tenant/{tenant}/wal_source").status == 200
    assert ps.http.tenant_status(tenant)["wal_source"] is None
    assert ps.http.request("DELETE", f"/v1/tenant/{tenant}/wal_source").status == 404
    # Attached again, after a restart it follows on from the file.
    attach(ps, tenant, pg)
    ps.restart()
    wait_until(lambda: ps.http.tenant_status(tenant)["wal_source"]["state"] == "streaming", timeout=30,
               desc="streaming after the restart")
    # Deleting the tenant stops its receiver: the primary sees the slot's connection go.
    assert pg.sql("select active from pg_replication_slots where slot_name = 'pageserver'") == "t"
    ps.http.delete_tenant(tenant)
    wait_until(lambda: pg.sql("select active from pg_replication_slots where slot_name = 'pageserver'") == "f",
               timeout=10, desc="the slot to be released")


def test_detach_keeps_the_position_and_the_cutoff_and_a_reattach_resumes(pg, pageserver_factory, tmp_path):
    ps = pageserver_factory(compaction="off")
    tenant = ps.create_tenant()
    status = attach(ps, tenant, pg)
    resumed, imp = status["resumed_at"], status["import"]
    at_attach = fork_sizes(pg, "true")
    pg.pgbench("-i", "-s", "1", "-q")
    caught_up(ps, tenant, pg)
    assert ps.http.request("DELETE", f"/v1/tenant/{tenant}/wal_source").status == 200
    source_file = ps.timeline_dir(tenant).parent / "wal_source.json"
    kept = json.loads(source_file.read_text())
    assert kept["detached"] and kept["import"]["end_lsn"] == imp["end_lsn"] and kept["position"] > resumed, kept
    # After a restart the detached tenant's history still starts at the backup's end.
    ps.restart()
    assert ps.http.tenant_status(tenant)["wal_source"] is None
    with ps.connect(tenant) as conn:
        with pytest.raises(PageServiceError) as e:
            conn.get_page(Key(1664, 0, 1262, 0, 0), imp["start_lsn"] - 1)
        assert e.value.name == "below_gc_cutoff", e.value
    # The primary goes on meanwhile; attached again, the tenant resumes where it stopped.
    pg.pgbench("-c", "1", "-T", "1", "-n")
    resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/wal_source", {"postgres": pg.connstr(), "slot": "pageserver"})
    assert resp.status == 200, resp
    w = wait_until(lambda: (w := ps.http.tenant_status(tenant)["wal_source"])["state"] in ("streaming", "error")
                   and w, timeout=30, desc="the receiver to stream or fail")
    assert w["state"] == "streaming" and w["resumed_at"] >= kept["position"], w
    assert w["import"]["attempts"] == 1, "no second import"
    s = caught_up(ps, tenant, pg)
    assert s["storage"]["values"] == imp["values"] + expected_values(pg, resumed, s["wal_source"]["durable_lsn"],
                                                                      at_attach, ps, tenant)
    # Another cluster is refused, naming both system ids.
    ps.allowed_errors.append(r".*WAL receiver.*")
    other = Postgres(tmp_path / "other").init().start()
    try:
        assert ps.http.request("DELETE", f"/v1/tenant/{tenant}/wal_source").status == 200
        resp = ps.http.request("PUT", f"/v1/tenant/{tenant}/wal_source",
                               {"postgres": other.connstr(), "slot": "pageserver"})
        assert resp.status == 200, resp
        w = wait_until(lambda: (w := ps.http.tenant_status(tenant)["wal_source"])["state"] == "error" and w,
                       timeout=30, desc="the other cluster to be refused")
        ids = [other.sql("select system_identifier from pg_control_system()"), kept["system_id"]]
        assert all(i in w["error"] for i in ids) and ids[0] != ids[1], (ids, w["error"])
    finally:
        assert ps.http.request("DELETE", f"/v1/tenant/{tenant}/wal_source").status == 200
        other.stop()


def test_a_reused_relfilenode_serves_the_new_relation_not_the_dropped_one(pg, pageserver_factory):
    """A relation dropped, and its relfilenode given to a new relation (as after OID
    wraparound; here PostgreSQL's binary upgrade mode chooses it): the new relation's pages are
    PostgreSQL's, and a block past its end is not the dropped relation's."""
    ps = pageserver_factory(compaction="off")
    tenant = ps.create_tenant()
    attach(ps, tenant, pg)
    pg.sql("CREATE TABLE gone (i int, t text)")
    pg.sql("INSERT INTO gone SELECT i, repeat('x', 100) FROM generate_series(1, 5000) i")
    node = int(pg.sql("select pg_relation_filenode('gone')"))
    db = int(pg.sql("select oid from pg_database where datname = 'postgres'"))
    old_blocks = int(pg.sql("select pg_relation_size('gone')")) // 8192
    assert old_blocks > 10
    s = caught_up(ps, tenant, pg)
    with ps.connect(tenant) as conn:
        assert len(conn.get_page(Key(1663, db, node, 0, 5), s["wal_source"]["durable_lsn"])) == 8192
    # The file is unlinked at the checkpoint after the drop; then the number may be reused.
    pg.sql("DROP TABLE gone")
    pg.sql("CHECKPOINT")
    ps.allowed_errors.append(r".*WAL receiver.*")
    pg.stop()
    pg.start(options="-b")
    pg.sql(f"select binary_upgrade_set_next_heap_pg_class_oid({node}); "
           f"select binary_upgrade_set_next_heap_relfilenode({node}); "
           f"select binary_upgrade_set_next_pg_type_oid({node + 100000}); "
           f"select binary_upgrade_set_next_array_pg_type_oid({node + 100001}); "
           "create table reborn (i int); insert into reborn values (42)")
    assert int(pg.sql("select pg_relation_filenode('reborn')")) == node
    pg.sql("CHECKPOINT")
    s = caught_up(ps, tenant, pg)
    lsn = s["wal_source"]["durable_lsn"]
    path = pg.datadir / pg.sql("select pg_relation_filepath('reborn')")
    with ps.connect(tenant) as conn:
        assert conn.get_rel_size((1663, db, node), 0, lsn).blocks == 1
        assert heap_mask(conn.get_page(Key(1663, db, node, 0, 0), lsn)) == heap_mask(path.read_bytes()[:8192])
        for blk in (1, 5, old_blocks - 1):
            with pytest.raises(PageServiceError) as e:
                conn.get_page(Key(1663, db, node, 0, blk), lsn)
            assert e.value.name == "not_found", (blk, e.value)


def test_compaction_and_gc_keep_every_page_above_the_cutoff(pg, pageserver_factory):
    # Chains of two records already ask for an image, which the child makes. A GC
    # horizon of 4 MiB puts the cutoff inside the run: what lies below it and is covered by a
    # newer image at or below it goes (the imported images of pages logged again since, older
    # full-page images), the newest image at or below the cutoff stays under what is kept.
    ps = pageserver_factory(compaction="off", compaction_image_threshold=2, gc_horizon=4 << 20)
    tenant = ps.create_tenant()
    resumed = attach(ps, tenant, pg)["resumed_at"]
    pg.pgbench("-i", "-s", "1", "-q")
    pg.pgbench("-c", "2", "-j", "2", "-T", "2", "-n")
    # After a checkpoint, each page's first change logs its image: about 8 MiB of them.
    pg.sql("CHECKPOINT")
    pg.sql("UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid % 100 = 0")
    s = caught_up(ps, tenant, pg)
    durable = s["wal_source"]["durable_lsn"]
    cutoff = durable - (4 << 20)
    records = [r for r in waldump_records(pg, resumed, durable) if r[0] >= resumed]
    fpis = [(records[i][0], records[i + 1][0], key) for i in range(len(records) - 1)
            for key, applied in records[i][1] if applied]
    kept = [f for f in fpis if f[1] >= cutoff]
    assert len(kept) > 10 and any(f[1] < cutoff for f in fpis), "full-page images on both sides of the cutoff"
    keys_before = ps.http.request("GET", f"/v1/tenant/{tenant}/keyspace").body["keys"]
    with ps.connect(tenant) as conn:
        before = {(n, k): conn.get_page(k, n) for _, n, k in kept[:: max(1, len(kept) // 50)]}
    r = ps.http.request("POST", f"/v1/tenant/{tenant}/compact")
    assert r.status == 200, r.body
    p = r.body["pass"]
    assert p["image_failures"] == 0 and p["images_created"] > 0, p
    assert p["gc_cutoff"] >= cutoff and p["values_dropped"] > 0, p
    after = ps.http.tenant_status(tenant)
    assert after["storage"]["values"] == p["values_written"] < s["storage"]["values"], p
    assert after["compaction"]["last_error"] is None
    # No key lost its last value: every page keeps its base.
    assert ps.http.request("GET", f"/v1/tenant/{tenant}/keyspace").body["keys"] == keys_before
    with ps.connect(tenant) as conn:
        for (lsn, key), page in before.items():
            assert conn.get_page(key, lsn) == page, (key, lsn_text(lsn))
        with pytest.raises(PageServiceError) as e:
            conn.get_page(fpis[0][2], fpis[0][1])
        assert e.value.name == "below_gc_cutoff", e.value
    # No page was refused, so no key is set aside as one the child cannot redo.
    assert after["compaction"]["unredoable_keys"] == 0, after["compaction"]


def fork_sizes(pg: Postgres, where: str) -> dict:
    """{((spc, db, relfilenode), fork): blocks or None (no such file)} of the relations of
    database `postgres` (the shared catalogs included) that `where` selects, from the primary's own files (`pg_stat_file`:
    `pg_relation_size` says 0 for a fork that does not exist)."""
    rows = pg.sql(f"""
        select pg_relation_filenode(c.oid), coalesce(nullif(c.reltablespace, 0), 1663),
               case when c.reltablespace = 1664 then 0 else d.oid end, f.fork,
               (pg_stat_file(pg_relation_filepath(c.oid) || f.suffix, true)).size
        from pg_class c, pg_database d,
             (values (0, ''), (1, '_fsm'), (2, '_vm'), (3, '_init')) f(fork, suffix)
        where d.datname = 'postgres' and pg_relation_filenode(c.oid) is not null and ({where})""")
    out = {}
    for line in rows.splitlines():
        rel, spc, db, fork, size = line.split("|")
        out[((int(spc), int(db), int(rel)), int(fork))] = int(size) // 8192 if size else None
    return out


def vm_bits_all_clear(pg: Postgres, relfilenode: int) -> bool:
    """Whether every bit of the primary's visibility map of `relfilenode` is clear (each page:
    the 24-byte header, then the bits)."""
    data = bytes.fromhex(pg.sql(
        "select encode(pg_read_binary_file(pg_relation_filepath(oid) || '_vm'), 'hex') "
        f"from pg_class where pg_relation_filenode(oid) = {relfilenode}"))
    assert data and len(data) % 8192 == 0
    return all(not any(data[p + 24:p + 8192]) for p in range(0, len(data), 8192))


def served_sizes(conn, wanted: dict, lsn: int) -> dict:
    out = {}
    for (rel, fork) in wanted:
        out[(rel, fork)] = conn.get_rel_size(rel, fork, lsn).blocks if conn.get_rel_exists(rel, fork, lsn).exists \
            else None
    return out


def test_relation_sizes_follow_the_wal_at_every_lsn(pg, pageserver_factory):
    ps = pageserver_factory(compaction="off")
    tenant = ps.create_tenant()
    attach(ps, tenant, pg)
    # One client: PostgreSQL extends a relation by more than the block it needs (unlogged,
    # `RelationAddExtraBlocks`) only when backends wait for its extension lock.
    pg.pgbench("-i", "-s", "1", "-q")
    pg.pgbench("-c", "1", "-T", "2", "-n")
    pg.sql("CREATE TABLE t (i int primary key, s text)")
    pg.sql("INSERT INTO t SELECT i, repeat('x', 500) FROM generate_series(1, 20000) i")
    pg.sql("VACUUM t")
    t_rel = int(pg.sql("select pg_relation_filenode('t')"))
    before_truncate = {k: v for k, v in fork_sizes(pg, "c.relname = 't'").items()}
    lsn_before = lsn_int(pg.sql("select pg_current_wal_insert_lsn()"))
    # VACUUM after deleting the tail truncates the heap, its visibility map and its free space map.
    pg.sql("DELETE FROM t WHERE i > 3000")
    pg.sql("VACUUM t")
    pg.sql("CREATE TABLE gone (i int)")
    pg.sql("INSERT INTO gone SELECT generate_series(1, 1000)")
    gone = int(pg.sql("select relfilenode from pg_class where relname = 'gone'"))
    lsn_gone = lsn_int(pg.sql("select pg_current_wal_insert_lsn()"))
    pg.sql("DROP TABLE gone")
    rolled = int(pg.run("psql", "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", input=(
        "BEGIN;\nCREATE TABLE rolled (i int);\nINSERT INTO rolled VALUES (1);\n"
        "SELECT pg_relation_filenode('rolled');\nROLLBACK;\n")).stdout.strip())
    pg.sql("CHECKPOINT")
    s = caught_up(ps, tenant, pg)
    end = s["wal_source"]["durable_lsn"]
    db = int(pg.sql("select oid from pg_database where datname = 'postgres'"))
    # Every relation: the imported catalogs, and those created after the attach.
    primary = fork_sizes(pg, "true")
    assert len(primary) >= 4 * 250, "every relation of the database, catalogs included"
    with ps.connect(tenant) as conn:
        served = served_sizes(conn, primary, end)
        # The free space map is not WAL-logged (a standby builds its own): it exists here only
        # as far as the WAL says (truncations; images of its pages).
        differ = {k: (primary[k], served[k]) for k in primary if k[1] != 1 and primary[k] != served[k]}
        # VACUUM creates and extends a visibility map without WAL (vm_extend) before it knows
        # whether a page will be all-visible; bits it then sets are logged. A map fork with no
        # bit set is thus not in the WAL, and a standby has none: check PostgreSQL's bytes.
        for (rel, fork), (_, here) in list(differ.items()):
            if fork == 2 and here is None and vm_bits_all_clear(pg, rel[2]):
                del differ[(rel, fork)]
        assert not differ, differ
        assert any(v for (rel, fork), v in served.items() if fork == 2), "visibility maps are served"
        # Before the truncation: the sizes then (main and init forks; the maps as above).
        at_before = served_sizes(conn, before_truncate, lsn_before)
        assert {k: v for k, v in at_before.items() if k[1] in (0, 3)} == \
            {k: v for k, v in before_truncate.items() if k[1] in (0, 3)}
        assert at_before[((1663, db, t_rel), 0)] > served[((1663, db, t_rel), 0)] > 0
        # A dropped relation exists until its drop commits; GetRelSize then says not_found.
        assert conn.get_rel_exists((1663, db, gone), 0, lsn_gone).exists
        assert conn.get_rel_size((1663, db, gone), 0, lsn_gone).blocks >= 1
        assert not conn.get_rel_exists((1663, db, gone), 0, end).exists
        with pytest.raises(PageServiceError) as e:
            conn.get_rel_size((1663, db, gone), 0, end)
        assert e.value.name == "not_found", e.value
        # A relation of an aborted transaction is dropped by the abort.
        assert not conn.get_rel_exists((1663, db, rolled), 0, end).exists
        # Not a fork: invalid_request; a page key of another kind is no GetPage.
        with pytest.raises(PageServiceError) as e:
            conn.get_rel_size((1663, db, t_rel), 4, end)
        assert e.value.name == "invalid_request", e.value
        with pytest.raises(PageServiceError) as e:
            conn.get_page(Key(1663, db, t_rel, 0x80, 0), end)
        assert e.value.name == "invalid_request", e.value
