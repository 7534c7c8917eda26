"""Storage verification of a WeightVersion's checkpoint objects, with its backoff.

A failed verification is tried again after a backoff that doubles per attempt (FERRY_VERIFY_BACKOFF_SECONDS up to
FERRY_VERIFY_BACKOFF_MAX_SECONDS): the objects may be uploaded after the apply, the endpoint may come back. The
attempts are counted in the version's kopf memo, so they go with the object; the deadline scheduler wakes the
version when its backoff runs out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import kopf

from ferry.ambient import AmbientCredentialsDenied
from ferry.api.models import StorageReason, WeightVersionSpec
from ferry.s3 import credentials_from_secret_data
from ferry.storage import StorageReport, verify_checkpoint, verify_checkpoint_async
from ferry_operator import kubeapi, metrics
from ferry_operator.config import CONFIG
from ferry_operator.deadlines import DEADLINES
from ferry_operator.s3clients import client_for, reader_for

# At most this many verifications at once, so a burst of new versions does not flood S3. Against an explicit
# endpoint they run on the event loop (s3reader), a checkpoint's shard headers read at once. AWS's own endpoints
# go through boto3, blocking: on a bounded pool of threads, the shard headers on a second pool as large (a
# verification thread waits on them), one round trip per version rather than one per shard. s3clients sizes the
# connection pool for both.
_verify_slots = asyncio.Semaphore(CONFIG.verify_concurrency)
_verify_pool = ThreadPoolExecutor(CONFIG.verify_concurrency, thread_name_prefix="verify")
_shard_pool = ThreadPoolExecutor(CONFIG.verify_concurrency, thread_name_prefix="verify-shard")


def _map_shards(check: Callable[[str], Any], shards: Iterable[str]) -> Iterator[Any]:
    shards = list(shards)
    return map(check, shards) if len(shards) < 2 else _shard_pool.map(check, shards)


@dataclass(frozen=True)
class Backoff:
    """Failed attempts so far, and the monotonic time before which no new one is made."""

    attempts: int = 0
    not_before: float = 0.0

    def after_failure(self, now: float, initial: float, maximum: float) -> tuple[Backoff, float]:
        """The backoff after one more failure at `now`, and its delay in seconds."""
        delay = min(maximum, initial * 2**self.attempts)
        return Backoff(self.attempts + 1, now + delay), delay


def _credentials(namespace: str, secret: str | None) -> dict[str, str] | None:
    if not secret:
        return None
    return credentials_from_secret_data(kubeapi.read_secret_data(namespace, secret))


async def verify_storage(namespace: str, name: str, spec: WeightVersionSpec) -> StorageReport:
    """Read the checkpoint's index and shard headers from object storage."""
    storage = spec.storage
    if storage is None or not storage.uri:
        return StorageReport(ok=True, reason=StorageReason.NotApplicable, message="PeerOnly: nothing stored")
    try:
        secret = storage.credentialsSecret
        credentials = await asyncio.to_thread(_credentials, namespace, secret) if secret else None
    except kubeapi.NotFound:
        return StorageReport(
            ok=False,
            reason=StorageReason.CredentialsMissing,
            message=f"Secret {storage.credentialsSecret} (spec.storage.credentialsSecret) does not exist",
        )
    except ValueError as exc:
        return StorageReport(ok=False, reason=StorageReason.CredentialsMissing, message=str(exc))
    if credentials is None:
        # The operator's own credentials: not one request, not even to the endpoint, unless the admin allows it.
        try:
            CONFIG.ambient_credentials.check(namespace, storage.uri, storage.endpoint, CONFIG.s3_endpoint)
        except AmbientCredentialsDenied as exc:
            return StorageReport(ok=False, reason=StorageReason.AmbientCredentialsDenied, message=f"{exc}.")
    endpoint = storage.endpoint or CONFIG.s3_endpoint
    checkpoint = {"fmt": spec.format, "version": name, "base_version": spec.baseVersion}
    if endpoint:
        return await verify_checkpoint_async(
            reader_for(endpoint, storage.region, credentials), storage.uri, **checkpoint
        )
    client = client_for(None, storage.region, credentials)
    return await asyncio.get_running_loop().run_in_executor(
        _verify_pool, lambda: verify_checkpoint(client, storage.uri, map_shards=_map_shards, **checkpoint)
    )


async def storage_report(
    uid: str,
    namespace: str,
    name: str,
    spec: WeightVersionSpec,
    recorded: StorageReport | None,
    memo: kopf.Memo,
    retry: Callable[[], Awaitable[None]],
) -> StorageReport | None:
    """The storage outcome to show: `recorded` (this generation's, from the status) when it stands or while
    backing off, else a fresh verification. After a failure, `retry` runs when the backoff is over."""
    if (
        recorded is not None
        and recorded.ok
        and (recorded.index_digest or recorded.reason == StorageReason.NotApplicable)
    ):
        return recorded  # the objects are immutable: verified once is verified (and its index digest recorded)
    backoff: Backoff = memo.get("verify_backoff") or Backoff()
    if recorded is not None and time.monotonic() < backoff.not_before:
        return recorded  # backing off: keep showing the last outcome until the next attempt
    async with _verify_slots:
        report = await verify_storage(namespace, name, spec)
    if report.ok:
        memo.pop("verify_backoff", None)
        DEADLINES.cancel(("verify", uid))
    else:
        # The objects may appear later (uploaded after the apply), the endpoint may come back: the backoff running
        # out is the next event.
        memo["verify_backoff"], delay = backoff.after_failure(
            time.monotonic(), CONFIG.verify_backoff_seconds, CONFIG.verify_backoff_max_seconds
        )
        DEADLINES.after(("verify", uid), delay, retry)
    metrics.VERIFICATIONS.labels(result=str(report.reason)).inc()
    return report


def forget(uid: str) -> None:
    """A deleted version's retry (its memo, with the attempts, goes with it)."""
    DEADLINES.cancel(("verify", uid))
