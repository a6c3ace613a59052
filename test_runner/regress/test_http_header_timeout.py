"""The management API bounds how long a client may take to send a request's headers
(docs/http-api.md): a client that trickles them, a byte now and then, is cut off, while the
API keeps serving everyone else."""

from __future__ import annotations

import socket
import time

import pytest

# pageserver::http::HTTP_HEADER_READ_TIMEOUT is 10 s; the listener's idle timeout (60 s) alone
# never fires while a byte arrives every second.
HEADER_READ_TIMEOUT = 10.0


@pytest.fixture
def page_service_io():
    """One run, with the default writer: the management API does not use the page service's
    writers (the run per writer only doubled this test's 10 s)."""
    return "auto"


def test_client_trickling_its_headers_is_cut_off_and_others_are_served(pageserver):
    sock = socket.create_connection(pageserver.http_addr, timeout=5)
    try:
        sock.sendall(b"GET /v1/status HTTP/1.1\r\n")
        start = time.monotonic()
        closed_after = None
        while time.monotonic() - start < HEADER_READ_TIMEOUT + 15:
            try:
                sock.sendall(b"X")  # never ends the header block
                sock.settimeout(1.0)
                data = sock.recv(4096)
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - start
                break
            # hyper answers 408 Request Timeout or just closes
            closed_after = time.monotonic() - start
            assert data == b"" or data.startswith(b"HTTP/1.1 408"), data
            break
        assert closed_after is not None, "a client trickling its headers was never cut off"
        assert closed_after >= HEADER_READ_TIMEOUT - 1, f"cut off after {closed_after:.1f} s"
        # everyone else is served meanwhile and after
        assert pageserver.http.status()["tenants"] == 0
    finally:
        sock.close()
