"""The operator's S3 client for verifications and deletions: `ferry.s3`'s shared client with the verification
profile, its connection pool as large as the requests that share it (each verification's index read, and the
shard header reads of the verifications under way: see verification.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferry import s3
from ferry_operator.config import CONFIG


def client_for(endpoint: str | None, region: str | None, credentials: Mapping[str, str] | None) -> Any:
    return s3.client(endpoint, region, credentials, s3.verification(pool=2 * CONFIG.verify_concurrency))
