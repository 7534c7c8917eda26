"""WeightVersion: its status (chain, storage verification, release), waking what derives from it, and release.

Run by the version's own events (main.py) and, woken in process (`WAKEUPS`), when a version it is based on changes,
its verification backoff runs out, or what blocks its release changes. Either way under the version's lock, writing
the status itself.

Release: the operator holds its own finalizer, `RELEASE_FINALIZER`, added next to its first status patch and
removed by the reconcile of a deleted version once nothing blocks it. A blocked release is a state, not a failure:
it is logged once, shown in `status.releaseBlockers`, and woken again when the blockers change (`recheck_releases`,
from the events of the objects that can block), with `FERRY_RELEASE_RETRY_SECONDS` only as a safety net.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from ferry.api.conditions import condition_dicts, find_condition, now_rfc3339
from ferry.api.models import (
    GROUP,
    MAX_CHAIN_LENGTH,
    EventAction,
    InvalidObject,
    WeightVersion,
    WeightVersionConditionType,
    WeightVersionStatus,
)
from ferry.api.models import WeightVersionEventReason as WVEvent
from ferry.chain import VersionView, dependents, resolve_chain
from ferry_operator import kubeaio, metrics, verification
from ferry_operator.config import CONFIG
from ferry_operator.events import EVENTS, emit_transitions
from ferry_operator.handlers import retention
from ferry_operator.indexes import Indexes
from ferry_operator.indexkeys import dependents_of
from ferry_operator.kubeapi import ML, WV
from ferry_operator.versions import (
    VersionStatusPlan,
    plan_version_status,
    release_blockers,
    storage_from_status,
)
from ferry_operator.wakeups import RETRY_SECONDS, WAKEUPS

log = logging.getLogger("ferry.operator")

RELEASE_FINALIZER = f"{GROUP}/release"

# namespace -> name -> the blockers last found, of each deleted version this process holds unreleased: what
# `recheck_releases` compares with. A few entries per namespace, not every version.
_blocked: dict[str, dict[str, tuple[str, ...]]] = {}


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


def parse(body: Mapping[str, Any], logger: logging.Logger = log) -> WeightVersion | None:
    """The typed version, parsed once per reconcile; None (logged) for a spec that does not validate, which an
    older schema may have let in: such a version is left alone rather than crash every reconcile."""
    try:
        return WeightVersion.from_body(body)
    except InvalidObject as error:
        logger.error("skipping %s", error)
        return None


async def _write_status(
    namespace: str,
    name: str,
    body: Mapping[str, Any],
    current: WeightVersionStatus | None,
    plan: VersionStatusPlan,
    memo: kopf.Memo,
) -> None:
    patch = plan.patch(current)
    written = await kubeaio.patch_status(WV[2], namespace, name, patch)
    if written is not None:  # events older than this write say nothing new (main.py skips them)
        memo["written"] = written["metadata"]["resourceVersion"]
    before = condition_dicts(current.conditions) if current else []
    first_ready = current is None or not current.readyTime  # readyTime is set the first time it is Ready
    emit_transitions(body, before, patch["conditions"], memo.setdefault("announced", {}), first_ready=first_ready)


async def reconcile(
    namespace: str, name: str, memo: kopf.Memo, body: Mapping[str, Any] | None = None, logger: logging.Logger = log
) -> None:
    """Derive the version's status from the indexes and write it where it differs; hold its release finalizer,
    and release a deleted version nothing needs. `body` None: woken, read the object now (the lock is held first,
    so a write by its own handler just before is seen)."""
    indexes: Indexes = memo.indexes
    async with WAKEUPS.lock(memo):
        if body is None:
            body = await kubeaio.get_object(WV[2], namespace, name)
            if body is None:
                return
        version = parse(body, logger)
        if version is None:
            return
        started = time.perf_counter()
        chain = resolve_chain(name, indexes.version_lookup(namespace), MAX_CHAIN_LENGTH)
        storage = await verification.storage_report(
            version.metadata.uid,
            namespace,
            name,
            version.spec,
            storage_from_status(version),
            memo,
            retry=_retry(namespace, name),
        )
        deleting = bool(version.metadata.deletionTimestamp)
        blocked = blockers(namespace, name, indexes) if deleting else []
        plan = plan_version_status(version, chain, storage, release_blockers=blocked, now=now_rfc3339())
        writes = []
        if plan.differs_from(version.status):
            writes.append(_write_status(namespace, name, body, version.status, plan, memo))
        finalizers = list(body["metadata"].get("finalizers") or [])
        uid = version.metadata.uid
        if RELEASE_FINALIZER in finalizers:
            memo.pop("finalizer", None)  # held: should it go again (an apply that leaves it out), add it again
        elif not deleting and memo.get("finalizer") != uid:
            writes.append(_hold(namespace, name, uid, finalizers, memo))
        await asyncio.gather(*writes)  # independent fields: the finalizer costs no round trip of latency
        if deleting and RELEASE_FINALIZER in finalizers:
            await _release(namespace, name, body, blocked, memo, logger)
        if plan.became_ready:
            logger.info("%s/%s is Ready (chain %s)", namespace, name, " → ".join(plan.status.chain or []))
        metrics.record_phase(namespace, name, plan.status.phase)
        metrics.RECONCILES.labels(kind="WeightVersion", phase=plan.status.phase).inc()
        metrics.RECONCILE_SECONDS.labels(kind="WeightVersion").observe(time.perf_counter() - started)


async def _hold(namespace: str, name: str, uid: str, finalizers: list[str], memo: kopf.Memo) -> None:
    """Add the release finalizer; remembered per uid, so that the events of the status patch sent alongside,
    whose bodies may not show the finalizer yet, do not send it again. A failed request must not keep the
    reconcile from waking what derives from the version: it is tried again in a moment."""
    try:
        added = await kubeaio.add_finalizer(WV[2], namespace, name, uid, finalizers, RELEASE_FINALIZER)
    except Exception as exc:
        log.warning("%s/%s: release finalizer not added (%r); again in %.0fs", namespace, name, exc, RETRY_SECONDS)
        WAKEUPS.later(WV[2], namespace, name, RETRY_SECONDS)
        return
    if added:
        memo["finalizer"] = uid


async def _release(
    namespace: str, name: str, body: Mapping[str, Any], blocked: list[str], memo: kopf.Memo, logger: logging.Logger
) -> None:
    """Deletion is a release: the finalizer holds the version while anything still depends on it, consumer pods
    attached to it on any node included. Called under the version's lock with the status already written."""
    held = _blocked.setdefault(namespace, {})
    if blocked:
        if name not in held:
            logger.info("%s/%s: release blocked by %s", namespace, name, ", ".join(blocked))
        held[name] = tuple(blocked)
        WAKEUPS.later(WV[2], namespace, name, CONFIG.release_retry_seconds)  # the safety net, not the trigger
        return
    held.pop(name, None)
    # Until the finalizer is gone a wake stays set, so a failed request here is tried again even from an event.
    WAKEUPS.later(WV[2], namespace, name, RETRY_SECONDS)
    if not await retention.release_storage(namespace, name, body, memo.indexes.versions):
        WAKEUPS.later(WV[2], namespace, name, retention.STORAGE_RETRY_SECONDS)
        return
    metadata = body["metadata"]
    finalizers = list(metadata.get("finalizers") or [])
    if await kubeaio.remove_finalizer(WV[2], namespace, name, metadata["uid"], finalizers, RELEASE_FINALIZER):
        logger.info("%s/%s released", namespace, name)
        EVENTS.post(body, reason=WVEvent.RELEASED, message="no dependents left; releasing", action=EventAction.RELEASE)


def recheck_releases(namespace: str, indexes: Indexes) -> None:
    """An object of `namespace` changed (the indexes already show it): wake each blocked release whose blockers
    that changed, so a release goes as soon as its last blocker does. Only the blocked releases are looked at."""
    for name, was in list(_blocked.get(namespace, {}).items()):
        if tuple(blockers(namespace, name, indexes)) != was:
            WAKEUPS.wake(WV[2], namespace, name)


async def reconcile_woken(namespace: str, name: str, memo: kopf.Memo) -> None:
    await reconcile(namespace, name, memo)


def forget(namespace: str, name: str, body: Mapping[str, Any]) -> None:
    """The version is gone: drop what the process kept of it (kopf drops its memo)."""
    metrics.forget(namespace, name)
    verification.forget(body["metadata"]["uid"])
    held = _blocked.get(namespace, {})
    held.pop(name, None)
    if not held:
        _blocked.pop(namespace, None)
    WAKEUPS.forget(WV[2], namespace, name)


def signature(version: WeightVersion) -> tuple:
    """What others derive from a version: its identity, readiness, release and why its chain is (not) resolved."""
    conditions = version.status.conditions if version.status else None
    reasons = tuple(
        getattr(find_condition(conditions, t), "reason", None)
        for t in (WeightVersionConditionType.READY, WeightVersionConditionType.CHAIN_RESOLVED)
    )
    return (version.metadata.uid, bool(version.metadata.deletionTimestamp), reasons, VersionView.of(version).ready)


def wake_watchers(
    event: Mapping[str, Any], namespace: str, name: str, body: Mapping[str, Any], memo: kopf.Memo
) -> None:
    """Event-driven, not a resync: once a change of this version is persisted (seen in this very event, and so in
    the index), wake the versions based on it and the ModelLoads that desire it. Nothing else has to poll."""
    gone = event.get("type") == "DELETED"
    if not gone:
        version = parse(body)
        if version is None:
            return
        previous = memo.get("signature")
        memo["signature"] = signature(version)
        if previous == memo["signature"] or (previous is None and event.get("type") is None):
            return  # unchanged, or first seen in the startup listing (everything is reconciled then anyway)
    indexes: Indexes = memo.indexes
    for version in dependents_of(indexes.versions, namespace, name):
        WAKEUPS.wake(WV[2], namespace, version.name)
    for load in indexes.desired.get((namespace, name), []):
        WAKEUPS.wake(ML[2], namespace, load)
