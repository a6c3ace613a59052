"""The local disk as a cache of the bucket (docs/rfcs/0009-remote-storage.md, step 3), against a
real S3 server: under a small `max_local_disk` the daemon evicts uploaded layers and a read that
needs one downloads it; an attached tenant serves before any layer is on its disk; while the
bucket is stopped and the layers not yet in it reach the bound, ingest is refused with a clear
error, and goes on once the uploads catch up, with nothing acknowledged lost. (A read of an
evicted layer waits for the bucket: it is not tried while the server is stopped.)"""

import time

from fixtures.page_client import PageServiceError
from fixtures.util import wait_until
from fixtures.wal_source import page_service_io  # noqa: F401 (a fixture: one writer is enough here)
from fixtures.workload import HistoryBuilder, get_pages, make_keys, query_lsns, verify

# Small layers, a short seal timer, and a bound of a few layers.
SETTINGS = {"layer_size": "64 KiB", "checkpoint_timeout": "300 ms", "compaction": "off",
            "max_local_disk": "1 MiB"}
BOUND = 1 << 20


def _requests(rs, keys, limit=8):
    return [(k, lsn) for k in keys for lsn in query_lsns(rs, k, limit=limit)]


def _uploaded_tenant(pageserver_factory, s3_server, prefix, seed, n_keys, layers, settings=SETTINGS):
    """A node with a tenant of `layers` layers (batches with half of the values images), all in
    the bucket: (raw args, env, node, tenant, keys, history)."""
    raw, env = [s3_server.remote_storage_setting(prefix)], s3_server.env()
    ps = pageserver_factory(raw_args=raw, env=env, **settings)
    t = ps.create_tenant()
    keys = make_keys(n_keys)
    b = HistoryBuilder(seed=seed)
    with ps.connect(t) as conn:
        while ps.http.tenant_status(t)["storage"]["layers"] < layers:
            conn.ingest(b.batch(keys, 40, image_prob=0.5))
    _wait_uploaded(ps, t, b.rs.last_lsn)
    return raw, env, ps, t, keys, b


def _wait_uploaded(ps, t, lsn):
    wait_until(lambda: ps.http.tenant_status(t)["remote"]["remote_consistent_lsn"] >= lsn, timeout=60)


def _metric(ps, name):
    return ps.http.metrics().value(name) or 0


def test_layers_evicted_under_a_small_disk_bound_are_downloaded_by_the_reads_that_need_them(
        pageserver_factory, s3_server):
    _, _, a, t, keys, b = _uploaded_tenant(pageserver_factory, s3_server, "", 41, 32, 48)

    # Uploaded layers are evicted down to the bound; the manifest still lists them all.
    def evicted():
        storage = a.http.tenant_status(t)["storage"]
        return (_metric(a, "pageserver_storage_resident_layer_bytes") <= BOUND
                and storage["resident_layers"] < storage["layers"] and storage)
    storage = wait_until(evicted, timeout=30, desc="eviction down to max_local_disk")
    assert _metric(a, "pageserver_storage_layer_evictions_total") >= storage["layers"] - storage["resident_layers"]

    # The status counts the files on disk (the evictor may be in a round: look until both agree).
    def on_disk():
        resident = a.http.tenant_status(t)["storage"]["resident_layers"]
        files = len(list((a.workdir / "tenants" / t / "timeline").glob("layer_*.layer")))
        return files == resident and files
    assert wait_until(on_disk, timeout=10, desc="the files on disk to be the resident layers") < storage["layers"]

    # Every page, old versions included: the reads download the evicted layers they need.
    downloads = _metric(a, "pageserver_storage_layer_downloads_total")
    with a.connect(t) as conn:
        verify(conn, b.rs, _requests(b.rs, keys))
    assert _metric(a, "pageserver_storage_layer_downloads_total") > downloads
    # ...and the evictor trims the disk again.
    wait_until(lambda: _metric(a, "pageserver_storage_resident_layer_bytes") <= BOUND, timeout=30)

    # A restart takes the layers missing from the disk as evicted ones.
    a.restart()
    assert a.http.tenant_status(t)["storage"]["resident_layers"] < storage["layers"]
    with a.connect(t) as conn:
        verify(conn, b.rs, _requests(b.rs, keys, limit=3))


def test_an_attached_tenant_serves_before_any_layer_is_on_its_disk(pageserver_factory, s3_server):
    raw, env, a, t, keys, b = _uploaded_tenant(pageserver_factory, s3_server, "att", 43, 24, 24)
    a.kill()

    c = pageserver_factory(raw_args=raw, env=env, **SETTINGS)
    assert c.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
    storage = c.http.tenant_status(t)["storage"]
    assert storage["resident_layers"] == 0 and storage["layers"] >= 24, storage
    assert not list((c.workdir / "tenants" / t / "timeline").glob("layer_*.layer"))
    with c.connect(t) as conn:
        verify(conn, b.rs, _requests(b.rs, keys))
    assert _metric(c, "pageserver_storage_layer_downloads_total") > 0


def test_a_missing_object_fails_the_attach_and_a_damaged_one_the_read_naming_it(pageserver_factory, s3_server):
    settings = dict(SETTINGS, max_local_disk="1 GiB")
    raw, env, a, t, keys, b = _uploaded_tenant(pageserver_factory, s3_server, "", 21, 8, 3, settings)
    a.stop()
    layers = [o for o in s3_server.list_objects(f"tenants/{t}/timelines/main/") if "/layer_" in o]
    path = s3_server.object_path(layers[0])
    good = path.read_bytes()

    # Missing: the attach fails, naming the object, and leaves nothing.
    path.unlink()
    c = pageserver_factory(raw_args=raw, env=env, **settings)
    c.allowed_errors.append("management request failed")
    resp = c.http.request("POST", f"/v1/tenant/{t}/attach")
    assert resp.status == 500, resp
    assert layers[0].rsplit("/", 1)[1] in resp.body["error"], resp.body
    assert c.http.request("GET", f"/v1/tenant/{t}").status == 404
    assert list((c.workdir / "tenants").iterdir()) == []

    # Damaged, of the right size: the attach cannot tell; every read that needs it fails,
    # naming it, and none answers a wrong page. Whole again, it serves.
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))
    c.allowed_errors.append("crc32c")
    assert c.http.request("POST", f"/v1/tenant/{t}/attach").status == 201
    requests = _requests(b.rs, keys)
    with c.connect(t) as conn:
        replies = get_pages(conn, requests)
    errors = [r for r in replies if not hasattr(r, "page")]
    assert errors, "no read needed the damaged layer"
    for e in errors:
        assert "crc32c" in e.message and layers[0].rsplit("/", 1)[1] in e.message, e
    path.write_bytes(good)
    with c.connect(t) as conn:
        verify(conn, b.rs, requests)


def test_ingest_is_refused_while_the_bound_holds_only_layers_not_in_the_bucket(pageserver_factory, s3_server):
    _, _, a, t, keys, b = _uploaded_tenant(pageserver_factory, s3_server, "full", 47, 32, 4)
    a.allowed_errors.append(r"(?i)upload|index|remote|refusing ingest|WAL receiver")

    s3_server.pause()
    refused = None
    try:
        with a.connect(t) as conn:
            deadline = time.monotonic() + 60
            while refused is None and time.monotonic() < deadline:
                batch = b.batch(keys, 40, image_prob=0.5)
                try:
                    conn.ingest(batch)
                except PageServiceError as e:
                    refused = (batch, e)
        assert refused is not None, "ingest was never refused"
        batch, e = refused
        assert e.name == "storage_unavailable" and "max_local_disk" in e.reply.message, e
        assert "not in the bucket" in e.reply.message, e
    finally:
        s3_server.resume()

    # The uploads catch up, layers are evicted, and the refused batch is taken.
    def taken():
        try:
            with a.connect(t) as conn:
                conn.ingest(batch)
            return True
        except PageServiceError:
            return False
    wait_until(taken, timeout=120, desc="ingest to resume")
    wait_until(lambda: _metric(a, "pageserver_storage_resident_layer_bytes") <= BOUND, timeout=60)
    with a.connect(t) as conn:
        verify(conn, b.rs, _requests(b.rs, keys))
