"""The S3 clients of object-storage loads: bulk settings, each request bounded by the transfer timeout, shared
process-wide."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ferry.storage import s3_client
from ferry_agent.transport.worker_service import DEFAULT_TRANSFER_TIMEOUT_S

S3_ATTEMPTS = 3  # tries of one S3 request (botocore standard retries), all within the transfer timeout


def request_timeouts(timeout_s: float) -> tuple[float, float]:
    """(connect, read) timeouts of one try of an S3 request, so that all `S3_ATTEMPTS` tries of one request
    fit in `timeout_s` (the transfer timeout): a hung endpoint fails a load in bounded time. The read timeout
    is the longest silence on the socket (capped at 60 s), not the duration of a whole ranged GET."""
    per_try = timeout_s / S3_ATTEMPTS
    connect = min(5.0, per_try / 2)
    return connect, min(60.0, per_try - connect)


def bulk_s3_client(
    endpoint: str | None,
    region: str | None,
    credentials: Mapping[str, str] | None,
    workers: int,
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
) -> Any:
    """The verifier's client with bulk settings: `workers` ranged GETs of up to 16 MiB run at once, each
    request bounded by `timeout_s` (see `request_timeouts`)."""
    connect, read = request_timeouts(timeout_s)
    return s3_client(
        endpoint, region, credentials, connect_timeout=connect, read_timeout=read, max_attempts=S3_ATTEMPTS,
        max_pool_connections=max(10, workers),
    )  # fmt: skip


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def cached_client(
    endpoint: str | None, region: str | None, creds: Mapping[str, str] | None, workers: int, timeout_s: float
) -> Any:
    """Creating a boto3 client costs tens of milliseconds and the agent builds strategies per load, so clients
    are shared process-wide, one per endpoint, region, identity, pool size and timeout (boto3 clients are
    thread-safe)."""
    key = (endpoint, region, tuple(sorted((creds or {}).items())), workers, timeout_s)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = bulk_s3_client(endpoint, region, creds, workers, timeout_s)
        return _clients[key]
