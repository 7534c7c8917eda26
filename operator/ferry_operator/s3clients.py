"""One boto3 S3 client per (endpoint, region, credentials), shared by every verification and deletion: building a
client costs far more than a verification, and a shared client reuses its pooled connections."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ferry.storage import s3_client
from ferry_operator.config import CONFIG

MAX_CLIENTS = 64  # distinct endpoint/credential sets kept; the oldest is dropped beyond that

_clients: dict[tuple, Any] = {}
_lock = threading.Lock()


def client_for(endpoint: str | None, region: str | None, credentials: Mapping[str, str] | None) -> Any:
    key = (endpoint, region, tuple(sorted((credentials or {}).items())))
    with _lock:  # one build per key even when a burst of verifications all miss at once
        found = _clients.get(key)
        if found is None:
            if len(_clients) >= MAX_CLIENTS:
                del _clients[next(iter(_clients))]
            # Clients are thread-safe once built; the pool is as large as the verifications that share it.
            found = _clients[key] = s3_client(
                endpoint, region, dict(credentials or {}) or None, max_pool_connections=CONFIG.verify_concurrency
            )
        return found
