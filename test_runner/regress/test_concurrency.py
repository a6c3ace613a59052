"""Many clients at once: 32 connections over several tenants, each pipelining GetPage requests
while ingest goes on; every answer must match the oracle."""

import random
import threading

from fixtures.page_client import LATEST
from fixtures.workload import HistoryBuilder, make_keys, verify

CONNECTIONS = 32
REQUESTS_PER_CONNECTION = 60


def test_many_concurrent_clients(pageserver, process_kind):
    tenants = [pageserver.create_tenant(kind=kind) for kind in ("sync", "async", None, None)]
    keys = make_keys(12, relnode=9500)
    histories = {}
    for i, t in enumerate(tenants):
        b = HistoryBuilder(seed=80 + i)
        with pageserver.connect(t) as conn:
            for _ in range(3):
                conn.ingest(b.batch(keys, 50))
        histories[t] = b.rs

    # open every connection first, so that all 32 are connected at the same time
    conns = [pageserver.connect(tenants[i % len(tenants)]) for i in range(CONNECTIONS)]
    barrier = threading.Barrier(CONNECTIONS)
    failures = []
    done = []

    def client(i):
        conn = conns[i]
        rs = histories[tenants[i % len(tenants)]]
        rng = random.Random(i)
        requests = []
        for _ in range(REQUESTS_PER_CONNECTION):
            k = rng.choice(keys)
            lsns = rs.lsns(k)
            requests.append((k, rng.choice(lsns + [lsns[0] - 1, LATEST])))
        try:
            barrier.wait(timeout=30)
            done.append(verify(conn, rs, requests, window=16))
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CONNECTIONS)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(90)
    finally:
        for c in conns:
            c.close()
    assert not any(th.is_alive() for th in threads)
    assert not failures, "\n".join(failures[:10])
    assert len(done) == CONNECTIONS
    assert sum(done) > CONNECTIONS * REQUESTS_PER_CONNECTION // 2


def test_concurrent_ingest_and_reads_on_one_tenant(pageserver, process_kind):
    t = pageserver.create_tenant()
    keys = make_keys(8, relnode=9600)
    b = HistoryBuilder(seed=90)
    with pageserver.connect(t) as conn:
        conn.ingest(b.batch(keys, 40))
    lock = threading.Lock()
    snapshots = [b.rs.copy()]  # record sets as of each acknowledged batch
    stop = threading.Event()
    failures = []

    def writer():
        try:
            with pageserver.connect(t) as c:
                for _ in range(15):
                    values = b.batch(keys, 20)
                    c.ingest(values)
                    with lock:
                        snapshots.append(b.rs.copy())
        except BaseException as e:  # noqa: BLE001
            failures.append(f"writer: {e!r}")
        finally:
            stop.set()

    def reader(i):
        rng = random.Random(i)
        try:
            with pageserver.connect(t) as c:
                while not stop.is_set():
                    with lock:
                        rs = snapshots[-1]
                    # explicit LSNs up to an acknowledged one: the answer cannot change later
                    reqs = [(k, rng.choice(rs.lsns(k) or [1])) for k in rng.sample(keys, 4)]
                    verify(c, rs, reqs)
        except BaseException as e:  # noqa: BLE001
            failures.append(f"reader {i}: {e!r}")

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    assert not any(th.is_alive() for th in threads)
    assert not failures, "\n".join(failures)
    with pageserver.connect(t) as c:
        verify(c, b.rs, [(k, LATEST) for k in keys])
