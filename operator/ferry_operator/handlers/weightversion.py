"""WeightVersion: its status (chain, storage verification, release), waking what derives from it, and release.

Run by the version's own events (main.py) and, woken in process (`WAKEUPS`), when a version it is based on changes
or its verification backoff runs out. Either way under the version's lock, writing the status itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from ferry.api.conditions import get_condition, now_rfc3339
from ferry.api.models import WeightVersionEventReason as WVEvent
from ferry.api.models import WeightVersionSpec
from ferry.chain import VersionView, dependents, resolve_chain
from ferry_operator import kubeapi, metrics, retention_handlers, verification
from ferry_operator.config import CONFIG
from ferry_operator.events import emit_transitions
from ferry_operator.indexes import Indexes
from ferry_operator.indexkeys import dependents_of
from ferry_operator.kubeapi import ML, WV
from ferry_operator.versions import CHAIN_RESOLVED, READY, plan_version_status, release_blockers, storage_from_status
from ferry_operator.wakeups import WAKEUPS

log = logging.getLogger("ferry.operator")


def blockers(namespace: str, name: str, indexes: Indexes) -> list[str]:
    return release_blockers(
        dependents(name, dependents_of(indexes.versions, namespace, name)),
        indexes.desired.get((namespace, name), []),
        indexes.leases.get((namespace, name), []),
        [blocker for names in indexes.attachments.get((namespace, name), []) for blocker in names],
    )


def _retry(namespace: str, name: str) -> Callable[[], Awaitable[None]]:
    async def wake() -> None:
        WAKEUPS.wake(WV[2], namespace, name)

    return wake


async def _write_status(namespace: str, name: str, body: Mapping[str, Any], status: dict, memo: kopf.Memo) -> None:
    await asyncio.to_thread(kubeapi.patch_status, WV[2], namespace, name, status)
    before = list((body.get("status") or {}).get("conditions") or [])
    emit_transitions(body, before, status["conditions"], memo.setdefault("announced", {}))


async def reconcile(
    namespace: str, name: str, memo: kopf.Memo, body: Mapping[str, Any] | None = None, logger: logging.Logger = log
) -> None:
    """Derive the version's status from the indexes and write it where it differs. `body` None: woken, read the
    object now (the lock is held first, so a write by its own handler just before is seen)."""
    indexes: Indexes = memo.indexes
    async with WAKEUPS.lock(memo):
        if body is None:
            body = await asyncio.to_thread(kubeapi.get_object, WV[2], namespace, name)
            if body is None:
                return
        started = time.perf_counter()
        spec = WeightVersionSpec.model_validate(dict(body["spec"]))  # the typed spec, parsed once
        chain = resolve_chain(name, indexes.version_lookup(namespace), CONFIG.max_chain_length)
        recorded = storage_from_status(body.get("status") or {}, body["metadata"].get("generation"))
        storage = await verification.storage_report(
            body["metadata"]["uid"], namespace, name, spec, recorded, memo, retry=_retry(namespace, name)
        )
        deleting = bool(body["metadata"].get("deletionTimestamp"))
        blocked = blockers(namespace, name, indexes) if deleting else []
        plan = plan_version_status(body, chain, storage, release_blockers=blocked, now=now_rfc3339())
        if plan.differs_from(body.get("status")):
            await _write_status(namespace, name, body, plan.status, memo)
        if plan.became_ready:
            logger.info("%s/%s is Ready (chain %s)", namespace, name, " → ".join(plan.status["chain"] or []))
        metrics.record_phase(namespace, name, plan.status["phase"])
        metrics.RECONCILES.labels(kind="WeightVersion", phase=plan.status["phase"]).inc()
        metrics.RECONCILE_SECONDS.labels(kind="WeightVersion").observe(time.perf_counter() - started)


async def reconcile_woken(namespace: str, name: str, memo: kopf.Memo) -> None:
    await reconcile(namespace, name, memo)


def forget(namespace: str, name: str, body: Mapping[str, Any]) -> None:
    """The version is gone: drop what the process kept of it (kopf drops its memo)."""
    metrics.forget(namespace, name)
    verification.forget(body["metadata"].get("uid"))
    WAKEUPS.forget(WV[2], namespace, name)


def signature(body: Mapping[str, Any]) -> tuple:
    """What others derive from a version: its identity, readiness, release and why its chain is (not) resolved."""
    conditions = (body.get("status") or {}).get("conditions")
    return (
        body["metadata"].get("uid"),
        bool(body["metadata"].get("deletionTimestamp")),
        tuple((get_condition(conditions, t) or {}).get("reason") for t in (READY, CHAIN_RESOLVED)),
        VersionView.from_body(body).ready,
    )


def wake_watchers(
    event: Mapping[str, Any], namespace: str, name: str, body: Mapping[str, Any], memo: kopf.Memo
) -> None:
    """Event-driven, not a resync: once a change of this version is persisted (seen in this very event, and so in
    the index), wake the versions based on it and the ModelLoads that desire it. Nothing else has to poll."""
    gone = event.get("type") == "DELETED"
    if not gone:
        previous = memo.get("signature")
        memo["signature"] = signature(body)
        if previous == memo["signature"] or (previous is None and event.get("type") is None):
            return  # unchanged, or first seen in the startup listing (everything is reconciled then anyway)
    indexes: Indexes = memo.indexes
    for version in dependents_of(indexes.versions, namespace, name):
        WAKEUPS.wake(WV[2], namespace, version.name)
    for load in indexes.desired.get((namespace, name), []):
        WAKEUPS.wake(ML[2], namespace, load)


async def release(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo) -> None:
    """Deletion is a release: the finalizer holds the version while anything still depends on it, consumer pods
    attached to it on any node included."""
    indexes: Indexes = memo.indexes
    blocked = blockers(namespace, name, indexes)
    if not blocked:
        await retention_handlers.release_storage(namespace, name, body, indexes.versions)
        kopf.info(body, reason=WVEvent.RELEASED, message="no dependents left; releasing")
        return
    async with WAKEUPS.lock(memo):
        chain = resolve_chain(name, indexes.version_lookup(namespace), CONFIG.max_chain_length)
        storage = storage_from_status(body.get("status") or {}, body["metadata"].get("generation"))
        plan = plan_version_status(body, chain, storage, release_blockers=blocked, now=now_rfc3339())
        if plan.differs_from(body.get("status")):
            await _write_status(namespace, name, body, plan.status, memo)
    raise kopf.TemporaryError(f"release blocked by {', '.join(blocked)}", delay=CONFIG.release_retry_seconds)
