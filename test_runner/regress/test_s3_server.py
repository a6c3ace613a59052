"""The S3 server of the remote-storage tests (`fixtures/s3.py`, versitygw's posix backend): an
object is the file `root/<bucket>/<key>`, read and written by a client signing with the
server's credentials (`env()`); while paused the server accepts connections but does not reply, and it
replies again once resumed.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client

import pytest


def s3_request(server, method: str, path: str, body: bytes = b"",
               secret_key: str | None = None) -> tuple[int, bytes]:
    """`method path` signed with AWS Signature Version 4, as an S3 client (the daemon) signs."""
    creds = server.env()
    secret = secret_key or creds["AWS_SECRET_ACCESS_KEY"]
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    host = f"127.0.0.1:{server.port}"
    payload_hash = hashlib.sha256(body).hexdigest()
    headers = {"host": host, "x-amz-content-sha256": payload_hash, "x-amz-date": amz_date}
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, path, "", *(f"{k}:{headers[k]}" for k in sorted(headers)), "",
                           signed, payload_hash])
    scope = f"{day}/{server.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for part in [day, server.region, "s3", "aws4_request"]:
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds['AWS_ACCESS_KEY_ID']}/{scope}, "
                                f"SignedHeaders={signed}, Signature={signature}")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_s3_server_objects_pause_resume(s3_server):
    bucket = s3_server.bucket
    # An object planted as a file is listed, and served under its key with the credentials.
    key = "tenants/t-1/timeline/layer-0001"
    path = s3_server.object_path(key)
    assert path == s3_server.root / "pageserver-test" / key
    path.parent.mkdir(parents=True)
    path.write_bytes(b"layer bytes")
    assert s3_server.list_objects() == [key]
    assert s3_server.list_objects("tenants/t-1/") == [key]
    assert s3_server.list_objects("tenants/t-2/") == []
    assert s3_request(s3_server, "GET", f"/{bucket}/{key}") == (200, b"layer bytes")
    status, body = s3_request(s3_server, "GET", f"/{bucket}/{key}", secret_key="not-the-secret")
    assert status == 403, body

    # An object PUT through S3 is a file; versitygw's own entries beside it (`.sgwtmp/`, made by
    # the first PUT) are no objects.
    status, body = s3_request(s3_server, "PUT", f"/{bucket}/tenants/t-1/manifest", b"manifest")
    assert status == 200, body
    assert s3_server.object_path("tenants/t-1/manifest").read_bytes() == b"manifest"
    assert any(p.name.startswith(".") for p in (s3_server.root / bucket).iterdir())
    assert s3_server.list_objects() == ["tenants/t-1/manifest", key]

    # Paused: the kernel accepts the connection, no reply comes.
    s3_server.pause()
    conn = http.client.HTTPConnection("127.0.0.1", s3_server.port, timeout=1)
    with pytest.raises(TimeoutError):  # socket.timeout
        conn.request("GET", "/")
        conn.getresponse()
    conn.close()

    s3_server.resume()
    assert s3_request(s3_server, "GET", f"/{bucket}/{key}") == (200, b"layer bytes")
