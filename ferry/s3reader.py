"""A lean asyncio S3 reader for small GETs: the operator's verification reads (an index, a shard's header) at
thousands of versions. boto3 spends about 2 ms of CPU on each such request (endpoint rules, event hooks, header
and response parsing) and a thread to wait in; this signs with SigV4 itself and sends over one aiohttp connection
pool on the event loop (its HTTP parser is C).

It offers the one call `ferry.storage` makes, `get_object(Bucket=, Key=, Range=)`, as a coroutine answering what
boto3 answers (`ContentLength`, `ContentRange`, a `Body` whose `read` is a coroutine), and raises botocore's own
exceptions (`ClientError` with the S3 error code, `EndpointConnectionError`, `NoCredentialsError`), so
`ferry.s3.translate` classifies its failures exactly as it does boto3's. Only for an explicit endpoint (path-style
URLs, as `ferry.s3` uses there): AWS itself, with its region redirects, stays with boto3. Credentials: the given
ones, else botocore's usual chain (environment, profile, IRSA), whose refreshable credentials are read per request.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

import aiohttp
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
    """The streamed body, as boto3's: read it (a coroutine), or close it unread (an index too big to buffer)."""

    def __init__(self, response: aiohttp.ClientResponse, endpoint: str) -> None:
        self._response = response
        self._endpoint = endpoint

    async def read(self, amt: int | None = None) -> bytes:
        """The whole body, or at most its first `amt` bytes (then close the rest unread)."""
        try:
            if amt is None:
                return await self._response.read()
            parts, left = [], amt
            while left > 0 and (part := await self._response.content.read(left)):
                parts.append(part)
                left -= len(part)
            return b"".join(parts)
        except (aiohttp.ClientError, TimeoutError) as exc:  # dropped mid-body: as transient as a failed GET
            raise EndpointConnectionError(endpoint_url=self._endpoint, error=exc) from exc
        finally:
            self._response.release()

    def close(self) -> None:
        self._response.close()  # the rest is not read: the connection is not reused


class S3Reader:
    """GETs from one endpoint with one set of credentials, on the event loop it is first used on."""

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
        self._chain: Any = None  # botocore's credentials, when none were given (False: there are none)
        self._chain_lock = asyncio.Lock()
        self._profile = profile
        self._session: aiohttp.ClientSession | None = None

    async def _keys(self) -> tuple[str, str, str | None]:
        given = self._credentials
        if given.get(s3.ACCESS_KEY) and given.get(s3.SECRET_KEY):
            return given[s3.ACCESS_KEY], given[s3.SECRET_KEY], given.get(s3.SESSION_TOKEN)
        if self._chain is None:  # the chain may ask a metadata endpoint or STS: not on the event loop, and once
            async with self._chain_lock:
                if self._chain is None:
                    self._chain = await asyncio.to_thread(_credential_chain)
        if not self._chain:
            raise NoCredentialsError()
        refresh = getattr(self._chain, "refresh_needed", None)
        if refresh is not None and refresh():
            frozen = await asyncio.to_thread(self._chain.get_frozen_credentials)
        else:
            frozen = self._chain.get_frozen_credentials()
        return frozen.access_key, frozen.secret_key, frozen.token

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            profile = self._profile
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=profile.max_pool_connections),
                timeout=aiohttp.ClientTimeout(sock_connect=profile.connect_timeout, sock_read=profile.read_timeout),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def get_object(self, *, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        """boto3's `get_object` for what storage.py reads (its argument names too)."""
        quoted = f"/{Bucket}/{urllib.parse.quote(Key, safe='/-_.~')}"
        path, url = self._prefix + quoted, self._base + quoted
        attempts = self._profile.max_attempts
        for attempt in range(attempts):
            access, secret, token = await self._keys()
            headers = self._signer.headers("GET", self._host, path, access, secret, token, dt.datetime.now(dt.UTC))
            if Range:
                headers["Range"] = Range
            last = attempt == attempts - 1
            try:
                response = await self._session_now().get(url, headers=headers, allow_redirects=False)
            except (aiohttp.ClientError, TimeoutError) as exc:
                if last:
                    raise EndpointConnectionError(endpoint_url=self._base, error=exc) from exc
            else:
                if response.status < 300:
                    return {
                        "ContentLength": response.content_length or 0,
                        "ContentRange": response.headers.get("Content-Range"),
                        "Body": _Body(response, self._base),
                    }
                try:
                    body = await response.read()
                except (aiohttp.ClientError, TimeoutError):
                    body = b""
                finally:
                    response.release()
                if last or response.status not in RETRY_STATUSES:
                    raise _client_error(response.status, body)
            await asyncio.sleep(RETRY_DELAY * 2**attempt)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _credential_chain() -> Any:
    import botocore.session

    return botocore.session.Session().get_credentials() or False


def _client_error(status: int, body: bytes) -> ClientError:
    fields = dict(_XML_FIELD.findall(body.decode("utf-8", "replace")))
    error = {"Code": fields.get("Code") or str(status), "Message": fields.get("Message") or ""}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


_readers: dict[tuple[Any, ...], S3Reader] = {}
_closing: set[asyncio.Task] = set()


def reader(
    endpoint: str, region: str | None, credentials: Mapping[str, str] | None, profile: s3.ClientProfile
) -> S3Reader:
    """The process-wide reader for these settings (its pooled connections reused), as `ferry.s3.client`; called on
    the one event loop that uses them."""
    key = (endpoint, region, tuple(sorted((credentials or {}).items())), profile)
    found = _readers.get(key)
    if found is None:
        if len(_readers) >= s3.MAX_CLIENTS:
            oldest = _readers.pop(next(iter(_readers)))
            task = asyncio.get_running_loop().create_task(oldest.close())
            _closing.add(task)
            task.add_done_callback(_closing.discard)
        found = _readers[key] = S3Reader(endpoint, region, credentials, profile)
    return found
