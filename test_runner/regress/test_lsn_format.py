"""LSNs a person reads (logs, error messages, pagebench's stderr) use PostgreSQL's `X/X` form
(hex high and low 32 bits); JSON keeps integers; the "latest" sentinel never shows as a number."""

from __future__ import annotations

import re
import subprocess

from fixtures import oracle as o
from fixtures.oracle import Key

LSN = 0x16B3748  # 0/16B3748
KEY = Key.rel_block(13000, 1)


def test_daemon_log_shows_lsns_like_postgres(pageserver):
    t = pageserver.create_tenant()
    with pageserver.connect(t) as conn:
        conn.ingest([(KEY, LSN, o.RECORD, o.init_page(0))])
    pageserver.restart()
    loaded = [line for line in pageserver.log_path.read_text().splitlines() if "loaded tenant" in line and "last_durable_lsn" in line]
    assert loaded, "the daemon logs the tenants it loads"
    assert "0/16B3748" in loaded[-1], loaded[-1]
    assert str(LSN) not in loaded[-1], loaded[-1]
    # JSON keeps the integer
    assert pageserver.http.tenant_status(t)["last_durable_lsn"] == LSN


def test_pagebench_stderr_shows_lsns_like_postgres(pageserver, bin_dir):
    http = f"{pageserver.http_addr[0]}:{pageserver.http_addr[1]}"
    pg = f"{pageserver.pg_addr[0]}:{pageserver.pg_addr[1]}"
    result = subprocess.run(
        [str(bin_dir / "pagebench"), "ingest", "--page-service", pg, "--http", http, "--tenant", "lsnfmt",
         "--relations", "1", "--blocks", "4", "--chain-length", "1"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # the data set starts at 0x1000000 = 0/1000000 and has 8 values 8 apart
    assert "LSNs 0/1000000..=0/1000038" in result.stderr, result.stderr
    assert not re.search(r"0x[0-9a-fA-F]+|18446744073709551615", result.stderr), result.stderr
