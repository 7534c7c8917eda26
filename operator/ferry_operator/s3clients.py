"""The operator's S3 clients: for verifications against an explicit endpoint, a lean asyncio reader
(`ferry.s3reader`: signed GETs on the event loop, a fraction of boto3's CPU per request); for AWS's own endpoints
and for deletions, `ferry.s3`'s shared boto3 client. Either's connection pool is as large as the requests that
share it (each verification's index read, and the shard header reads of the verifications under way: see
verification.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferry import s3, s3reader
from ferry_operator.config import CONFIG


def _profile() -> s3.ClientProfile:
    return s3.verification(pool=2 * CONFIG.verify_concurrency)


def reader_for(endpoint: str, region: str | None, credentials: Mapping[str, str] | None) -> s3reader.S3Reader:
    return s3reader.reader(endpoint, region, credentials, _profile())


def client_for(endpoint: str | None, region: str | None, credentials: Mapping[str, str] | None) -> Any:
    return s3.client(endpoint, region, credentials, _profile())
