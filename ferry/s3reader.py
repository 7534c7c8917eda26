"""A lean S3 reader for small GETs: the operator's verification reads (an index, a shard's header) at thousands of
versions. boto3 spends about 2 ms of CPU on each such request (endpoint rules, event hooks, header and response
parsing), more than the request costs the server; this signs with SigV4 itself and sends over a urllib3 pool.

It offers the one call `ferry.storage` makes, `get_object(Bucket=, Key=, Range=)`, answering what boto3 answers
(`ContentLength`, `ContentRange`, a `Body` to read), and raises botocore's own exceptions (`ClientError` with the
S3 error code, `EndpointConnectionError`, `NoCredentialsError`), so `ferry.s3.translate` classifies its failures
exactly as it does boto3's. Only for an explicit endpoint (path-style URLs, as `ferry.s3` uses there): AWS itself,
with its region redirects, stays with boto3. Credentials: the given ones, else botocore's usual chain (environment,
profile, IRSA), whose refreshable credentials are read per request.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

import urllib3
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from ferry import s3

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
DEFAULT_REGION = "us-east-1"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_DELAY = 0.1  # seconds before the second try, doubled for each further one
_XML_FIELD = re.compile(r"<(Code|Message)>([^<]*)</\1>")


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


class Signer:
    """AWS Signature Version 4 of a bodiless S3 request, with the day's signing key cached."""

    def __init__(self, region: str) -> None:
        self.region = region
        self._keys: dict[tuple[str, str], bytes] = {}  # (secret key, day) -> signing key

    def _key(self, secret: str, day: str) -> bytes:
        key = self._keys.get((secret, day))
        if key is None:
            key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret}".encode(), day), self.region), "s3"), "aws4_request")
            self._keys = {(secret, day): key}  # only today's
        return key

    def headers(
        self, method: str, host: str, path: str, access: str, secret: str, token: str | None, now: dt.datetime
    ) -> dict[str, str]:
        """The headers that sign `method host path` (path already URI-encoded, no query)."""
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        signed = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp}
        if token:
            signed["x-amz-security-token"] = token
        names = ";".join(sorted(signed))
        canonical = "\n".join(
            [method, path, "", *(f"{k}:{signed[k]}" for k in sorted(signed)), "", names, EMPTY_SHA256]
        )
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._key(secret, day), to_sign.encode(), hashlib.sha256).hexdigest()
        authorization = f"AWS4-HMAC-SHA256 Credential={access}/{scope}, SignedHeaders={names}, Signature={signature}"
        return {**{k: v for k, v in signed.items() if k != "host"}, "Authorization": authorization}


class _Body:
    """The streamed body, as boto3's: read it, or close it unread (an index too big to buffer)."""

    def __init__(self, response: urllib3.BaseHTTPResponse) -> None:
        self._response = response

    def read(self) -> bytes:
        try:
            return self._response.read()
        except urllib3.exceptions.HTTPError as exc:  # a connection dropped mid-body: as transient as a failed GET
            raise EndpointConnectionError(endpoint_url=self._response.geturl() or "", error=exc) from exc
        finally:
            self._response.release_conn()

    def close(self) -> None:
        self._response.close()  # the rest is not read: the connection cannot be reused
        self._response.release_conn()


class S3Reader:
    """GETs from one endpoint with one set of credentials; thread-safe, connections pooled."""

    def __init__(
        self, endpoint: str, region: str | None, credentials: Mapping[str, str] | None, profile: s3.ClientProfile
    ) -> None:
        parsed = urllib.parse.urlsplit(endpoint)
        self._base = f"{parsed.scheme}://{parsed.netloc}{parsed.path.rstrip('/')}"
        self._host = parsed.netloc
        self._prefix = parsed.path.rstrip("/")
        # boto3's choice: the given region, else the environment's, else us-east-1 (which S3-compatible stores accept)
        region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
        self._signer = Signer(region)
        self._credentials = dict(credentials or {})
        self._chain: Any = None  # botocore's credentials, when none were given
        self._chain_lock = threading.Lock()
        self._attempts = profile.max_attempts
        self._pool = urllib3.PoolManager(
            maxsize=profile.max_pool_connections,
            block=True,
            retries=False,
            timeout=urllib3.Timeout(connect=profile.connect_timeout, read=profile.read_timeout),
        )

    def _keys(self) -> tuple[str, str, str | None]:
        given = self._credentials
        if given.get(s3.ACCESS_KEY) and given.get(s3.SECRET_KEY):
            return given[s3.ACCESS_KEY], given[s3.SECRET_KEY], given.get(s3.SESSION_TOKEN)
        with self._chain_lock:
            if self._chain is None:
                import botocore.session

                self._chain = botocore.session.Session().get_credentials() or False
        if not self._chain:
            raise NoCredentialsError()
        frozen = self._chain.get_frozen_credentials()
        return frozen.access_key, frozen.secret_key, frozen.token

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        """boto3's `get_object` for what storage.py reads (its argument names too)."""
        quoted = f"/{Bucket}/{urllib.parse.quote(Key, safe='/-_.~')}"
        path, url = self._prefix + quoted, self._base + quoted
        for attempt in range(self._attempts):
            access, secret, token = self._keys()
            headers = self._signer.headers("GET", self._host, path, access, secret, token, dt.datetime.now(dt.UTC))
            if Range:
                headers["Range"] = Range
            last = attempt == self._attempts - 1
            try:
                response = self._pool.request("GET", url, headers=headers, preload_content=False)
            except urllib3.exceptions.HTTPError as exc:
                if last:
                    raise EndpointConnectionError(endpoint_url=self._base, error=exc) from exc
            else:
                if response.status < 300:
                    return {
                        "ContentLength": int(response.headers.get("Content-Length") or 0),
                        "ContentRange": response.headers.get("Content-Range"),
                        "Body": _Body(response),
                    }
                body = response.read()
                response.release_conn()
                if last or response.status not in RETRY_STATUSES:
                    raise _client_error(response.status, body)
            time.sleep(RETRY_DELAY * 2**attempt)
        raise AssertionError("unreachable")


def _client_error(status: int, body: bytes) -> ClientError:
    fields = dict(_XML_FIELD.findall(body.decode("utf-8", "replace")))
    error = {"Code": fields.get("Code") or str(status), "Message": fields.get("Message") or ""}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


_readers: dict[tuple[Any, ...], S3Reader] = {}
_readers_lock = threading.Lock()


def reader(
    endpoint: str, region: str | None, credentials: Mapping[str, str] | None, profile: s3.ClientProfile
) -> S3Reader:
    """The process-wide reader for these settings (its pooled connections reused), as `ferry.s3.client`."""
    key = (endpoint, region, tuple(sorted((credentials or {}).items())), profile)
    with _readers_lock:
        found = _readers.get(key)
        if found is None:
            if len(_readers) >= s3.MAX_CLIENTS:
                del _readers[next(iter(_readers))]
            found = _readers[key] = S3Reader(endpoint, region, credentials, profile)
        return found
