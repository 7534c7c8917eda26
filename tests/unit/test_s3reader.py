"""The lean asyncio S3 reader (`ferry.s3reader`): its SigV4 signature is botocore's, byte for byte, and its
answers and failures are boto3's as `ferry.storage` and `ferry.s3.translate` read them (against a local stub
server; the e2e tests verify through it against SeaweedFS)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from ferry import s3, s3reader, storage
from ferry.s3reader import EMPTY_SHA256, S3Reader, Signer

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 12, 4, 13, 14, 15, tzinfo=dt.UTC)
WHOLE = 8_000_000  # bytes of the object whose server ignores Range


@pytest.mark.parametrize("token", [None, "session-token"])
def test_the_signature_is_botocores(monkeypatch, token):
    import botocore.auth

    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: NOW.replace(tzinfo=None))
    url = "http://127.0.0.1:8333/bucket/a%20dir/model-00001-of-00002.safetensors"
    request = AWSRequest(method="GET", url=url, headers={"X-Amz-Content-SHA256": EMPTY_SHA256})
    S3SigV4Auth(Credentials("AKID", "SECRET", token), "s3", "eu-west-1").add_auth(request)
    ours = Signer("eu-west-1").headers(
        "GET", "127.0.0.1:8333", "/bucket/a%20dir/model-00001-of-00002.safetensors", "AKID", "SECRET", token, NOW
    )
    assert ours["Authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"]
    assert ours.get("x-amz-security-token") == request.headers.get("X-Amz-Security-Token")


class Stub(http.server.BaseHTTPRequestHandler):
    """GET /bucket/<key>: 'ok' (honouring a `bytes=a-b` Range), 'whole' (8 MB, ignoring it), 'unsized' (the same,
    with no Content-Length: it ends when the connection does), 'missing' 404, 'denied' 403, 'flaky' one 503."""

    seen: list[tuple[str, str | None, str | None]] = []
    flaky = 1

    def do_GET(self) -> None:
        Stub.seen.append((self.path, self.headers.get("Range"), self.headers.get("Authorization")))
        key = self.path.split("/", 2)[2]
        if key == "missing":
            return self._error(404, "NoSuchKey", "The specified key does not exist.")
        if key == "denied":
            return self._error(403, "SignatureDoesNotMatch", "The signature does not match.")
        if key == "flaky" and Stub.flaky:
            Stub.flaky -= 1
            return self._error(503, "SlowDown", "Reduce your request rate.")
        data = b"0123456789" * (WHOLE // 10 if key in ("whole", "unsized") else 1)
        wanted = self.headers.get("Range")
        if key == "unsized":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            with contextlib.suppress(ConnectionError):
                self.wfile.write(data)
            return
        if wanted and key != "whole":
            first, last = (int(x) for x in wanted.removeprefix("bytes=").split("-"))
            part = data[first : last + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {first}-{first + len(part) - 1}/{len(data)}")
        else:
            part = data
            self.send_response(200)
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        with contextlib.suppress(ConnectionError):  # a reader that wanted less closes the rest unread
            self.wfile.write(part)

    def _error(self, status: int, code: str, message: str) -> None:
        body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    Stub.http_version = "HTTP/1.1"
    Stub.seen.clear()
    Stub.flaky = 1
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def reader(endpoint: str) -> S3Reader:
    creds = {s3.ACCESS_KEY: "AKID", s3.SECRET_KEY: "SECRET"}
    return S3Reader(endpoint, None, creds, s3.verification(pool=2))


async def closing(r: S3Reader, work: Any) -> Any:
    try:
        return await work
    finally:
        await r.close()


def test_answers_are_boto3s(endpoint):
    async def scenario() -> tuple:
        r = reader(endpoint)
        try:
            whole = await r.get_object(Bucket="b", Key="ok")
            body = await whole["Body"].read()
            prefix = await storage._aread_prefix(r, "b", "ok", "shard", 4)
            flaky = await (await r.get_object(Bucket="b", Key="flaky"))["Body"].read()
            return whole, body, prefix, flaky
        finally:
            await r.close()

    whole, body, prefix, flaky = asyncio.run(scenario())
    assert whole["ContentLength"] == 10 and whole["ContentRange"] is None and body == b"0123456789"
    assert prefix == (b"0123", 10)  # the size from the Content-Range
    assert flaky == b"0123456789"  # a 503 is tried again
    path, _, authorization = Stub.seen[0]
    assert path == "/b/ok" and authorization.startswith("AWS4-HMAC-SHA256 Credential=AKID/")
    assert Stub.seen[1][1] == "bytes=0-3"


def test_a_server_that_ignores_the_range_is_read_no_further_than_the_probe(endpoint):
    """Against a server that answers a probe with the whole object, both readers take only the probe's bytes (and
    the object's size from its Content-Length)."""
    r = reader(endpoint)
    prefix = asyncio.run(closing(r, storage._aread_prefix(r, "b", "whole", "shard", 4)))
    assert prefix == (b"0123", WHOLE)
    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="AKID", aws_secret_access_key="SECRET", region_name="us-east-1"
    )
    assert storage._read_prefix(client, "b", "whole", "shard", 4) == (b"0123", WHOLE)
    assert [range_ for _, range_, _ in Stub.seen] == ["bytes=0-3"] * 2


def test_an_index_of_no_given_length_is_read_no_further_than_its_limit(endpoint):
    """A server that sends an index with no Content-Length (to its connection's end) is read one byte past the
    limit, then refused, by both readers."""
    r = reader(endpoint)
    with pytest.raises(storage._Stop) as stop:
        asyncio.run(closing(r, storage._aread(r, "b", "unsized", "index s3://b/unsized", max_bytes=1000)))
    client = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="AKID", aws_secret_access_key="SECRET", region_name="us-east-1"
    )
    with pytest.raises(storage._Stop) as blocking:
        storage._read(client, "b", "unsized", "index s3://b/unsized", max_bytes=1000)
    for refused in (stop, blocking):
        report = refused.value.report
        assert report.reason == "IndexInvalid" and "is over 1000 bytes (its server gave no length)" in report.message


@pytest.mark.parametrize(
    ("key", "reason"),
    [("missing", "ObjectMissing"), ("denied", "AccessDenied")],
)
def test_failures_are_classified_as_boto3s(endpoint, key, reason):
    r = reader(endpoint)
    with pytest.raises(storage._Stop) as stop:
        asyncio.run(closing(r, storage._aread(r, "b", key, f"index s3://b/{key}")))
    assert stop.value.report.reason == reason and f"s3://b/{key}" in stop.value.report.message


def test_an_unreachable_endpoint_is_transient():
    dead = S3Reader("http://127.0.0.1:9", None, {s3.ACCESS_KEY: "a", s3.SECRET_KEY: "b"}, s3.verification(pool=1))
    with pytest.raises(storage._Stop) as stop:
        asyncio.run(closing(dead, storage._aread(dead, "b", "k", "index s3://b/k")))
    assert stop.value.report.reason == "EndpointUnreachable" and stop.value.report.transient


def test_readers_are_shared_per_endpoint_and_credentials(endpoint):
    profile = s3.verification(pool=2)
    one = s3reader.reader(endpoint, None, {s3.ACCESS_KEY: "a", s3.SECRET_KEY: "b"}, profile)
    assert s3reader.reader(endpoint, None, {s3.ACCESS_KEY: "a", s3.SECRET_KEY: "b"}, profile) is one
    assert s3reader.reader(endpoint, None, {s3.ACCESS_KEY: "a", s3.SECRET_KEY: "c"}, profile) is not one


def test_without_credentials_the_chain_is_asked_once(endpoint, monkeypatch):
    """botocore's chain (environment, profile, IRSA) off the event loop, once for many concurrent reads."""
    asked: list[int] = []

    def chain() -> Credentials:
        asked.append(1)
        return Credentials("CHAIN", "SECRET")

    monkeypatch.setattr(s3reader, "_credential_chain", chain)
    r = S3Reader(endpoint, None, None, s3.verification(pool=4))

    async def reads() -> list[dict]:
        return list(await asyncio.gather(*(r.get_object(Bucket="b", Key="ok") for _ in range(5))))

    assert len(asyncio.run(closing(r, reads()))) == 5
    assert asked == [1] and all("Credential=CHAIN/" in seen[2] for seen in Stub.seen)
