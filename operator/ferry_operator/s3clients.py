"""The operator's S3 clients: for verifications, a lean reader (`ferry.s3reader`: signed GETs over a urllib3
pool, a fraction of boto3's CPU per request) wherever the endpoint is explicit, else boto3; for deletions,
`ferry.s3`'s shared boto3 client. Either's connection pool is as large as the requests that share it (each
verification's index read, and the shard header reads of the verifications under way: see verification.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferry import s3, s3reader
from ferry_operator.config import CONFIG


def _profile() -> s3.ClientProfile:
    return s3.verification(pool=2 * CONFIG.verify_concurrency)


def reader_for(endpoint: str | None, region: str | None, credentials: Mapping[str, str] | None) -> Any:
    """What verification reads through: `get_object` as boto3's."""
    if endpoint:
        return s3reader.reader(endpoint, region, credentials, _profile())
    return client_for(endpoint, region, credentials)


def client_for(endpoint: str | None, region: str | None, credentials: Mapping[str, str] | None) -> Any:
    return s3.client(endpoint, region, credentials, _profile())
