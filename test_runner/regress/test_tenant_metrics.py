"""Per-tenant metrics (`pageserver_tenant_*{tenant_id}`): exported for the 16 busiest tenants
only, with the tenant's own counts; idle tenants and deleted ones have no series."""

from __future__ import annotations

import pytest

from fixtures import oracle as o
from fixtures.oracle import Key
from fixtures.page_client import PageServiceError

KEY = Key.rel_block(7100, 1)
MISSING = Key.rel_block(7100, 2)
MAX_TENANTS = 16
SERIES = [
    "pageserver_tenant_get_page_seconds_count",
    "pageserver_tenant_get_page_errors_total",
    "pageserver_tenant_wal_redo_seconds_count",
    "pageserver_tenant_wal_redo_errors_total",
    "pageserver_tenant_wal_redo_children",
    "pageserver_tenant_wal_redo_spinning_children",
]


def _exported(metrics, name: str) -> set[str]:
    return {dict(labels)["tenant_id"] for (n, labels), _ in metrics.samples.items() if n == name}


def _load(ps, tenant: str, get_pages: int) -> None:
    with ps.connect(tenant) as conn:
        conn.ingest([(KEY, 10, o.RECORD, o.init_page(0)), (KEY, 20, o.RECORD, o.insert(tenant.encode()))])
        for _ in range(get_pages):
            conn.get_page(KEY)


def test_only_the_busiest_tenants_have_series_with_their_own_counts(pageserver_factory):
    # No page cache: every GetPage is a redo, so the redo series count them too.
    ps = pageserver_factory(page_cache_size=0)
    idle = [ps.create_tenant(f"idle{i}") for i in range(3)]
    busy = [ps.create_tenant(f"busy{i:02d}") for i in range(MAX_TENANTS)]
    for t in idle:
        _load(ps, t, get_pages=0)
    for t in busy:
        _load(ps, t, get_pages=2)

    m = ps.http.metrics()
    for name in SERIES:
        assert _exported(m, name) == set(busy), name
    assert m.value("pageserver_tenant_get_page_seconds_count", tenant_id="busy03") == 2
    assert m.value("pageserver_tenant_wal_redo_seconds_count", tenant_id="busy03") == 2
    assert m.value("pageserver_tenant_get_page_errors_total", tenant_id="busy03") == 0
    assert m.value("pageserver_tenant_wal_redo_children", tenant_id="busy03") >= 1
    assert m.types["pageserver_tenant_get_page_seconds"] == "histogram"

    # One more busy tenant, busier than all: it gets in, and the set stays at the bound.
    hot = ps.create_tenant("hot")
    _load(ps, hot, get_pages=60)
    with ps.connect(hot) as conn:
        with pytest.raises(PageServiceError) as e:
            conn.get_page(MISSING)
        assert e.value.name == "not_found"
    m = ps.http.metrics()
    exported = _exported(m, "pageserver_tenant_get_page_seconds_count")
    assert hot in exported
    assert len(exported) == MAX_TENANTS, exported
    assert not exported & set(idle)
    assert m.value("pageserver_tenant_get_page_seconds_count", tenant_id=hot) == 61
    assert m.value("pageserver_tenant_get_page_errors_total", tenant_id=hot) == 1
    assert m.value("pageserver_tenant_wal_redo_seconds_count", tenant_id=hot) == 60
    # The daemon-wide count is the sum over every tenant, exported or not.
    assert m.value("pageserver_wal_redo_seconds_count") == 60 + 2 * MAX_TENANTS

    ps.http.delete_tenant(hot)
    m = ps.http.metrics()
    for name in SERIES:
        assert hot not in _exported(m, name), name
