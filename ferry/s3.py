"""Ferry's one S3 layer: URI parsing, boto3 clients (one profile per use, one process-wide cache) and the
translation of botocore errors into Ferry's error classes (`ferry.errors`).

Profiles:
- `verification`: the operator's HEADs and header GETs; short timeouts and few retries, so an unreachable
  endpoint costs a reconcile seconds, not minutes.
- `bulk_download`: the agent's index reads and ranged GETs; a pool as large as its download workers, every try of
  one request within the transfer timeout, a hung endpoint failing a request within `TIMEOUT_ATTEMPTS` tries of
  at most `READ_TIMEOUT_S` of silence each (30 s), a throttled one (`503 SlowDown`) tried again with backoff.
- `publishing`: `ferry publish`'s uploads; more retries, botocore's timeouts.

Retries are Ferry's own (`Retries`, in place of botocore's handler), per request, so per ranged GET of a load:
throttling (`SlowDown`, 503, 429 and botocore's throttling codes) is tried up to `THROTTLED_ATTEMPTS` times with
exponential backoff and full jitter; a timeout up to `TIMEOUT_ATTEMPTS` times (each try already waited its whole
timeout); any other transient failure (5xx, a dropped connection) up to the profile's `max_attempts`.

Every S3 failure is turned into one of the classes below by `translate`, so the operator, the agent and
`ferry publish` agree on what a 404, a 403, a missing credential or a dropped connection means.
"""

from __future__ import annotations

import base64
import binascii
import random
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ferry import checkpoint_format as ckpt
from ferry.errors import Conflict, FerryError, InvalidInput, NotFound, Transient

ACCESS_KEY = "AWS_ACCESS_KEY_ID"
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN = "AWS_SESSION_TOKEN"
BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
MAX_CLIENTS = 64  # distinct endpoint/credential/profile sets kept; the oldest is dropped beyond that
BULK_ATTEMPTS = 3  # tries of one agent S3 request failing transiently, all within the transfer timeout
CONNECT_TIMEOUT_S = 5.0  # the agent's longest wait for a connection to S3
READ_TIMEOUT_S = 15.0  # the agent's longest silence of S3 on a connection (no answer yet, or mid-body)
TIMEOUT_ATTEMPTS = 2  # tries of one request that timed out: a hung S3 fails it in about 2 x READ_TIMEOUT_S
THROTTLED_ATTEMPTS = 8  # tries of one request S3 throttles (SlowDown, 503)
THROTTLE_BACKOFF_S = 0.25  # the first backoff's ceiling after a throttled try, doubled for each further one
TRANSIENT_BACKOFF_S = 0.05  # the same after any other transient failure
MAX_BACKOFF_S = 8.0

_MISSING_CODES = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_DENIED_CODES = {
    "403",
    "AccessDenied",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
}
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


# ---------------------------------------------------------------- errors


class InvalidUri(InvalidInput):
    """Not an `s3://bucket/key` URI Ferry accepts."""


class ObjectMissing(NotFound):
    """The object or its bucket does not exist (404, NoSuchKey, NoSuchBucket)."""


class AccessDenied(InvalidInput):
    """The credentials are wrong or lack permission (403 and its codes)."""


class CredentialsMissing(InvalidInput):
    """No usable credentials: none in the environment, or only half of a key pair."""


class Unreachable(Transient):
    """Network error, timeout, throttling, 5xx or any other botocore failure: the object may be fine."""


class PreconditionFailed(Conflict):
    """A conditional write (`If-None-Match: *`) found the object already there (412, 409)."""


S3Error = ObjectMissing | AccessDenied | CredentialsMissing | Unreachable | PreconditionFailed


def error_code(exc: BaseException) -> str:
    """A botocore ClientError's S3 code (`NoSuchKey`), else its HTTP status as text; "" for other errors."""
    response = getattr(exc, "response", None) or {}
    code = response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(code or "")


def translate(exc: BaseException, what: str) -> FerryError:
    """The Ferry error for a failed S3 request about `what` (e.g. "index s3://b/k"). The message has no final
    period, so callers can end or extend it; `raise translate(exc, what) from exc`."""
    from botocore.exceptions import (
        ClientError,
        HTTPClientError,
        NoCredentialsError,
        PartialCredentialsError,
    )
    from botocore.exceptions import (
        ConnectionError as BotoConnectionError,
    )

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        detail = f"{code or status}: {(error.get('Message') or 'no message').rstrip('.')}"
        if code in _MISSING_CODES or status == 404:
            return ObjectMissing(f"{what} does not exist ({detail})")
        if code in _DENIED_CODES or status == 403:
            return AccessDenied(f"access to {what} was denied ({detail}); check the credentials")
        if code in _CONFLICT_CODES or status in (409, 412):
            return PreconditionFailed(f"{what} already exists ({detail})")
        # 5xx, throttling and anything unexpected: the object may be fine, so it is worth another try.
        return Unreachable(f"reading {what} failed ({detail})")
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return CredentialsMissing(f"no usable S3 credentials to read {what}: {exc}")
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return Unreachable(f"S3 endpoint unreachable while reading {what}: {exc}")
    return Unreachable(f"reading {what} failed: {exc}")


# ---------------------------------------------------------------- URIs


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` → (bucket, key); InvalidUri (a ValueError) on anything else."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise InvalidUri(f"{uri!r} is not an s3:// URI")
    bucket, sep, key = uri[len("s3://") :].partition("/")
    if not BUCKET.fullmatch(bucket):
        raise InvalidUri(f"{uri!r} has an invalid bucket name {bucket!r}")
    if not sep or not key or key.endswith("/") or any(c.isspace() for c in key):
        raise InvalidUri(f"{uri!r} has no object key (expected s3://bucket/path/{ckpt.INDEX_NAME})")
    if any(not part.strip(".") for part in key.split("/")):
        # Clients and servers resolve `.` and `..` (and drop empty segments) differently, so such a key may name
        # another object than the one signed: S3 then answers 403 SignatureDoesNotMatch, a credentials problem.
        raise InvalidUri(f"{uri!r} has an empty, '.' or '..' segment in its object key")
    return bucket, key


def parse_s3_prefix(prefix: str) -> tuple[str, str]:
    """`s3://bucket[/some/prefix]` → (bucket, "some/prefix/" or ""); InvalidUri on anything else."""
    if not prefix.startswith("s3://"):
        raise InvalidUri(f"{prefix!r} is not an s3://bucket/prefix URI")
    bucket, _, key = prefix[len("s3://") :].partition("/")
    if not BUCKET.fullmatch(bucket):
        raise InvalidUri(f"{prefix!r}: {bucket!r} is not a valid bucket name")
    key = key.strip("/")
    if any(c.isspace() for c in key) or any(part in {".", ".."} for part in key.split("/")) or "//" in key:
        raise InvalidUri(f"{prefix!r} has an invalid key prefix")
    return bucket, f"{key}/" if key else ""


# ---------------------------------------------------------------- credentials and clients


def credentials_from_secret_data(data: Mapping[str, str] | None) -> dict[str, str]:
    """A Kubernetes Secret's base64 `.data` → credentials for `client`; InvalidInput names a bad key."""
    data = data or {}
    creds: dict[str, str] = {}
    for key in (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN):
        if key not in data:
            if key == SESSION_TOKEN:
                continue
            raise InvalidInput(f"Secret data has no key {key}")
        try:
            value = base64.b64decode(data[key], validate=True).decode().strip()
        except (binascii.Error, UnicodeDecodeError, TypeError) as exc:
            raise InvalidInput(f"Secret key {key} is not valid base64 text") from exc
        if not value and key != SESSION_TOKEN:
            raise InvalidInput(f"Secret key {key} is empty")
        if value:
            creds[key] = value
    return creds


@dataclass(frozen=True)
class ClientProfile:
    """How a client talks to S3. `addressing`: "path" always uses path-style URLs (SeaweedFS, MinIO); "auto"
    does so only with a custom endpoint and leaves AWS to botocore."""

    connect_timeout: float
    read_timeout: float
    max_attempts: int  # counts the first try
    max_pool_connections: int
    addressing: Literal["path", "auto"] = "path"
    timeout_attempts: int = TIMEOUT_ATTEMPTS  # tries of a request whose connect or read timed out
    throttled_attempts: int = THROTTLED_ATTEMPTS  # tries of a request S3 throttled


class Retries:
    """botocore's `needs-retry` handler for Ferry's clients: the delay before the next try of a request, None for
    no more tries. Which failures are throttling and which transient is botocore's standard classification; 503
    counts as throttling (S3's `SlowDown`, also from servers that send no code)."""

    def __init__(self, profile: ClientProfile) -> None:
        from botocore.retries import standard

        self._profile = profile
        self._context = standard.RetryEventAdapter().create_retry_context
        self._throttled = standard.ThrottledRetryableChecker()
        self._transient = standard.TransientRetryableChecker()

    def __call__(self, **kwargs: Any) -> float | None:
        from botocore.exceptions import ConnectTimeoutError, ReadTimeoutError

        context = self._context(**kwargs)
        status = getattr(context.http_response, "status_code", None)
        if self._throttled.is_retryable(context) or status in (429, 503):
            limit, base = self._profile.throttled_attempts, THROTTLE_BACKOFF_S
        elif isinstance(context.caught_exception, (ConnectTimeoutError, ReadTimeoutError)):
            limit, base = self._profile.timeout_attempts, TRANSIENT_BACKOFF_S
        elif self._transient.is_retryable(context):
            limit, base = self._profile.max_attempts, TRANSIENT_BACKOFF_S
        else:
            return None
        if context.attempt_number >= limit:
            return None
        return random.random() * min(base * 2 ** (context.attempt_number - 1), MAX_BACKOFF_S)


def verification(pool: int = 10) -> ClientProfile:
    """The operator's: `pool` verifications share the client."""
    return ClientProfile(
        connect_timeout=3.0, read_timeout=10.0, max_attempts=3, max_pool_connections=pool, timeout_attempts=3
    )


def request_timeouts(timeout_s: float) -> tuple[float, float]:
    """(connect, read) timeouts of one try of an S3 request, so that all `BULK_ATTEMPTS` tries of one request
    fit in `timeout_s` (the transfer timeout): a hung endpoint fails a load in bounded time. The read timeout
    is the longest silence on the socket (at most `READ_TIMEOUT_S`), not the duration of a whole ranged GET."""
    per_try = timeout_s / BULK_ATTEMPTS
    connect = min(CONNECT_TIMEOUT_S, per_try / 2)
    return connect, min(READ_TIMEOUT_S, per_try - connect)


def bulk_download(workers: int, timeout_s: float) -> ClientProfile:
    """The agent's: `workers` ranged GETs run at once, each request bounded by `timeout_s`."""
    connect, read = request_timeouts(timeout_s)
    return ClientProfile(
        connect_timeout=connect, read_timeout=read, max_attempts=BULK_ATTEMPTS, max_pool_connections=max(10, workers)
    )


def publishing() -> ClientProfile:
    """`ferry publish`'s: botocore's default timeouts, more retries, a pool for parallel part uploads."""
    return ClientProfile(
        connect_timeout=60.0,
        read_timeout=60.0,
        max_attempts=5,
        max_pool_connections=32,
        addressing="auto",
        timeout_attempts=5,
    )


def new_client(
    endpoint: str | None, region: str | None, credentials: Mapping[str, str] | None, profile: ClientProfile
) -> Any:
    """A fresh boto3 S3 client; without `credentials` it uses the usual AWS chain (environment, profiles, IRSA)."""
    import boto3
    import botocore.session
    from botocore.config import Config

    creds = credentials or {}
    path_style = profile.addressing == "path" or bool(endpoint)
    # A private session: boto3's default session is not safe to share between threads. Its data loader (the parsed
    # service models, what makes a session's first client cost ~0.1-0.3 s) is the process's one, read-only.
    session = botocore.session.Session()
    session.register_component("data_loader", _loader())
    built = boto3.session.Session(botocore_session=session).client(
        "s3",
        endpoint_url=endpoint or None,
        region_name=region or None,
        aws_access_key_id=creds.get(ACCESS_KEY),
        aws_secret_access_key=creds.get(SECRET_KEY),
        aws_session_token=creds.get(SESSION_TOKEN),
        config=Config(
            s3={"addressing_style": "path"} if path_style else {},
            connect_timeout=profile.connect_timeout,
            read_timeout=profile.read_timeout,
            retries={"total_max_attempts": profile.max_attempts, "mode": "standard"},
            max_pool_connections=profile.max_pool_connections,
        ),
    )
    events = built.meta.events
    events.unregister("needs-retry.s3", unique_id="retry-config-s3")  # botocore's standard handler: Ferry's instead
    events.register("needs-retry.s3", Retries(profile), unique_id="ferry-retries-s3")
    return built


_data_loader: Any = None
_data_loader_lock = threading.Lock()


def _loader() -> Any:
    global _data_loader
    with _data_loader_lock:
        if _data_loader is None:
            import botocore.loaders

            _data_loader = botocore.loaders.create_loader()
        return _data_loader


def prewarm() -> None:
    """Parse the S3 service model now (no request is made), so that the first client of this process is cheap: a
    rank process does it while it starts, off its load's critical path."""
    new_client("http://127.0.0.1:9", "us-east-1", {ACCESS_KEY: "prewarm", SECRET_KEY: "prewarm"}, bulk_download(1, 1))


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def client(
    endpoint: str | None, region: str | None, credentials: Mapping[str, str] | None, profile: ClientProfile
) -> Any:
    """The process-wide client for these settings. Building one costs tens of milliseconds, far more than a
    verification, and a shared client reuses its pooled connections; boto3 clients are thread-safe once built."""
    key = (endpoint, region, tuple(sorted((credentials or {}).items())), profile)
    with _clients_lock:  # one build per key even when a burst of requests all miss at once
        found = _clients.get(key)
        if found is None:
            if len(_clients) >= MAX_CLIENTS:
                del _clients[next(iter(_clients))]
            found = _clients[key] = new_client(endpoint, region, dict(credentials or {}) or None, profile)
        return found


def forget_clients() -> None:
    """Drop every cached client: a forked process must not share its parent's pooled connections."""
    with _clients_lock:
        _clients.clear()
