"""kopf entry point: `kopf run --standalone -A -m ferry_operator.main`.

Handlers stay thin: they gather the current objects (kopf indexes), call the pure domain modules and patch the
result. Everything is re-derived from the objects, so a restart at any point converges to the same status.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import functools
import logging
import time
from typing import Any

import kopf

from ferry.api.conditions import now_rfc3339
from ferry.api.models import GROUP, LABEL_VERSION
from ferry.chain import VersionView, dependents, resolve_chain
from ferry.storage import (
    StorageReason,
    StorageReport,
    credentials_from_secret_data,
    s3_client,
    verify_checkpoint,
)
from ferry_operator import kubeapi, metrics, retention_handlers  # the import registers retention's handlers
from ferry_operator.config import CONFIG
from ferry_operator.kubeapi import ML, WR, WV
from ferry_operator.modelloads import (
    DEGRADED,
    LEASE_OF_OTHER_NODE_DELETED,
    PEER_STALLED,
    PROGRESSING,
    aggregate_status,
    foreign_leases,
    live_conditions,
    node_matches,
    plan_replicas,
    renewal_time,
    renewed_after_expiry,
    serves,
    stale_replicas,
    version_problem,
)
from ferry_operator.versions import (
    READY,
    plan_version_status,
    release_blockers,
    storage_from_status,
)

RELEASE_FINALIZER = f"{GROUP}/release"
NUDGE_ANNOTATION = f"{GROUP}/base-ready"

log = logging.getLogger("ferry.operator")

# Storage verification backoff per object uid: (attempts, monotonic time of the next allowed attempt).
_verify_backoff: dict[str, tuple[int, float]] = {}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = RELEASE_FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.watching.server_timeout = CONFIG.watch_server_timeout
    settings.watching.client_timeout = CONFIG.watch_server_timeout + 10
    settings.posting.level = logging.INFO
    settings.execution.max_workers = 8
    # Short retries for Events: a 403 from a terminating namespace must not stall the shared event-posting queue.
    settings.posting.default_backoffs = settings.posting.logging_backoffs = [0.5, 1, 2]
    # Every other request rides out an apiserver restart of about two minutes: kopf ends the whole operator when a
    # watch's retries run out on a 5xx, which a starting apiserver answers for a while.
    settings.networking.error_backoffs = [0.5, 1, 2, 4, 8] + [15] * 7
    if CONFIG.metrics_port >= 0:
        port = metrics.serve(CONFIG.metrics_address, CONFIG.metrics_port)
        log.info("metrics on http://%s:%d/metrics", CONFIG.metrics_address, port)


# ---------------------------------------------------------------- indexes (one watch per kind)


@kopf.index(*WV)
def version_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): VersionView.from_body(body)}


@kopf.index(*ML)
def desired_index(namespace: str, name: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any) -> dict | None:
    if meta.get("deletionTimestamp"):
        return None
    return {(namespace, spec.get("desiredVersion")): name}


@kopf.index(*WR)
def lease_index(namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict | None:
    if not status.get("activeLeases"):
        return None
    # The readers hold the served version, which during a version change is not yet spec.version.
    return {(namespace, status.get("version") or spec.get("version")): name}


def _lookup(index: kopf.Index, namespace: str):
    def lookup(name: str) -> VersionView | None:
        store = index.get((namespace, name))
        return next(iter(store), None) if store else None

    return lookup


def _views_in(index: kopf.Index, namespace: str) -> list[VersionView]:
    return [view for (ns, _), store in index.items() if ns == namespace for view in store]


# (object uid, condition type) -> (status, reason) last announced as an Event. The timer and the event handler of one
# object can both see the same flip in a stale body; one Event per flip is enough.
_announced: dict[tuple[str, str], tuple[str, str]] = {}


def _announce(body: kopf.Body, type_: str, status: str, reason: str, message: str, *, warning: bool) -> None:
    key = (body["metadata"]["uid"], type_)
    if _announced.get(key) == (status, reason):
        return
    _announced[key] = (status, reason)
    (kopf.warn if warning else kopf.info)(body, reason=reason, message=f"{type_}={status}: {message}")


def _forget_announced(body: kopf.Body) -> None:
    uid = body["metadata"].get("uid")
    for key in [k for k in _announced if k[0] == uid]:
        del _announced[key]


# ---------------------------------------------------------------- WeightVersion reconcile


def _credentials(namespace: str, storage: dict) -> dict[str, str] | None:
    secret = storage.get("credentialsSecret")
    if not secret:
        return None
    return credentials_from_secret_data(kubeapi.read_secret_data(namespace, secret))


@functools.lru_cache(maxsize=64)
def _cached_client(endpoint: str | None, region: str | None, credentials: tuple[tuple[str, str], ...]) -> Any:
    # Creating a boto3 client costs far more than a verification; clients are thread-safe once built.
    return s3_client(endpoint, region, dict(credentials) or None)


def _verify_storage(namespace: str, spec: dict, name: str) -> StorageReport:
    storage = spec.get("storage") or {}
    if not storage.get("uri"):
        return StorageReport(ok=True, reason=StorageReason.NotApplicable, message="PeerOnly: nothing stored")
    try:
        credentials = _credentials(namespace, storage)
    except kubeapi.NotFound:
        return StorageReport(
            ok=False,
            reason=StorageReason.CredentialsMissing,
            message=f"Secret {storage['credentialsSecret']} (spec.storage.credentialsSecret) does not exist",
        )
    except ValueError as exc:
        return StorageReport(ok=False, reason=StorageReason.CredentialsMissing, message=str(exc))
    client = _cached_client(
        storage.get("endpoint") or CONFIG.s3_endpoint,
        storage.get("region"),
        tuple(sorted((credentials or {}).items())),
    )
    return verify_checkpoint(
        client, storage["uri"], fmt=spec["format"], version=name, base_version=spec.get("baseVersion")
    )


async def _storage_report(namespace: str, name: str, uid: str, body: kopf.Body) -> StorageReport | None:
    recorded = storage_from_status(body.get("status") or {}, body["metadata"].get("generation"))
    if (
        recorded is not None
        and recorded.ok
        and (recorded.index_digest or recorded.reason == StorageReason.NotApplicable)
    ):
        return recorded  # the objects are immutable: verified once is verified (and its index digest recorded)
    attempts, not_before = _verify_backoff.get(uid, (0, 0.0))
    if recorded is not None and time.monotonic() < not_before:
        return recorded  # backing off: keep showing the last outcome until the next attempt
    report = await asyncio.to_thread(_verify_storage, namespace, dict(body["spec"]), name)
    if report.ok:
        _verify_backoff.pop(uid, None)
    else:
        delay = min(CONFIG.verify_backoff_max, CONFIG.verify_backoff_initial * 2**attempts)
        _verify_backoff[uid] = (attempts + 1, time.monotonic() + delay)
    metrics.VERIFICATIONS.labels(result=str(report.reason)).inc()
    return report


def _blockers(
    namespace: str, name: str, version_index: kopf.Index, desired_index: kopf.Index, lease_index: kopf.Index
) -> list[str]:
    return release_blockers(
        dependents(name, _views_in(version_index, namespace)),
        desired_index.get((namespace, name), []),
        lease_index.get((namespace, name), []),
    )


async def _reconcile_version(
    namespace: str, name: str, body: kopf.Body, patch: kopf.Patch, logger: logging.Logger,
    version_index: kopf.Index, desired_index: kopf.Index, lease_index: kopf.Index,
) -> None:  # fmt: skip
    started = time.perf_counter()
    chain = resolve_chain(name, _lookup(version_index, namespace), CONFIG.max_chain_length)
    storage = await _storage_report(namespace, name, body["metadata"]["uid"], body)
    blockers = (
        _blockers(namespace, name, version_index, desired_index, lease_index)
        if body["metadata"].get("deletionTimestamp")
        else []
    )
    plan = plan_version_status(body, chain, storage, release_blockers=blockers, now=now_rfc3339())
    if plan.differs_from(body.get("status")):
        patch.status.update(plan.status)
    for t in plan.transitions:
        _announce(body, t.type, t.status, t.reason, t.message, warning=t.warning)
    if plan.became_ready:
        logger.info("%s/%s is Ready (chain %s)", namespace, name, " → ".join(plan.status["chain"] or []))
    metrics.record_phase(namespace, name, plan.status["phase"])
    metrics.RECONCILES.labels(kind="WeightVersion", phase=plan.status["phase"]).inc()
    metrics.RECONCILE_SECONDS.labels(kind="WeightVersion").observe(time.perf_counter() - started)


@kopf.on.event(*WV)
async def version_changed(event: dict, namespace: str, name: str, body: kopf.Body, patch: kopf.Patch,
                          logger: logging.Logger, version_index: kopf.Index, desired_index: kopf.Index,
                          lease_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    if event.get("type") == "DELETED":
        metrics.forget(namespace, name)
        _forget_announced(body)
        return
    await _reconcile_version(namespace, name, body, patch, logger, version_index, desired_index, lease_index)
    await _wake_dependents(namespace, name, body, version_index, desired_index)


async def _wake_dependents(
    namespace: str, name: str, body: kopf.Body, version_index: kopf.Index, desired_index: kopf.Index
) -> None:
    """Once this version's Ready=True is persisted (seen in this very event, and so in the index), re-trigger the
    deltas still waiting on it, and the ModelLoads that desire it (a trainer patches desiredVersion right after
    `ferry publish`, before the version is verified), now rather than at their next resync. A nudge that sets the
    same stamp again changes nothing, so no further event follows."""
    if not VersionView.from_body(body).ready:
        return
    stamp = f"{name}@{(body.get('status') or {}).get('readyTime', '')}"
    waiting = [v.name for v in _views_in(version_index, namespace) if v.base_version == name and not v.ready]
    loads = list(desired_index.get((namespace, name), []))
    await asyncio.gather(
        *(asyncio.to_thread(kubeapi.nudge, WV[2], namespace, d, NUDGE_ANNOTATION, stamp) for d in waiting),
        *(asyncio.to_thread(kubeapi.nudge, ML[2], namespace, m, NUDGE_ANNOTATION, stamp) for m in loads),
    )


@kopf.timer(*WV, interval=CONFIG.resync_seconds, initial_delay=CONFIG.resync_seconds)
async def version_resync(namespace: str, name: str, body: kopf.Body, patch: kopf.Patch, logger: logging.Logger,
                         version_index: kopf.Index, desired_index: kopf.Index, lease_index: kopf.Index,
                         **_: Any) -> None:  # fmt: skip
    """Level-based safety net: missed nudges, S3 objects that appear later, operator restarts."""
    status = body.get("status") or {}
    if status.get("phase") == "Ready" and not body["metadata"].get("deletionTimestamp"):
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == READY), None)
        if ready and ready.get("observedGeneration") == body["metadata"].get("generation"):
            chain = resolve_chain(name, _lookup(version_index, namespace), CONFIG.max_chain_length)
            if chain.ok:
                return
    await _reconcile_version(namespace, name, body, patch, logger, version_index, desired_index, lease_index)


@kopf.on.delete(*WV)
async def release_version(namespace: str, name: str, body: kopf.Body, patch: kopf.Patch,
                          version_index: kopf.Index, desired_index: kopf.Index, lease_index: kopf.Index,
                          storage_folder_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    """Deletion is a release: the finalizer holds the version while anything still depends on it."""
    blockers = _blockers(namespace, name, version_index, desired_index, lease_index)
    if not blockers:
        await retention_handlers.release_storage(namespace, name, body, storage_folder_index)
        kopf.info(body, reason="Released", message="no dependents left; releasing")
        return
    chain = resolve_chain(name, _lookup(version_index, namespace), CONFIG.max_chain_length)
    storage = storage_from_status(body.get("status") or {}, body["metadata"].get("generation"))
    plan = plan_version_status(body, chain, storage, release_blockers=blockers, now=now_rfc3339())
    if plan.differs_from(body.get("status")):
        patch.status.update(plan.status)
        kopf.warn(body, reason="ReleaseBlocked", message=f"release waits for {', '.join(blockers)}")
    raise kopf.TemporaryError(f"release blocked by {', '.join(blockers)}", delay=CONFIG.release_retry_seconds)


# ---------------------------------------------------------------- ModelLoad → WeightReplicas


def _snapshot(body: kopf.Body) -> dict:
    return copy.deepcopy(dict(body))


@kopf.index("", "v1", "nodes")
def node_index(name: str, body: kopf.Body, **_: Any) -> dict:
    return {name: {"metadata": {"name": name, "labels": dict(body.metadata.labels)}, "spec": dict(body.spec)}}


@kopf.index(*WR)
def replica_index(namespace: str, spec: kopf.Spec, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, spec.get("modelLoad")): _snapshot(body)}


@kopf.index("coordination.k8s.io", "v1", "leases", labels={f"{GROUP}/replica": kopf.PRESENT})
def replica_lease_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): _snapshot(body)}


def _emit_transitions(body: kopf.Body, before: list, after: list) -> None:
    old = {c["type"]: c["status"] for c in before}
    for c in after:
        if old.get(c["type"], "Unknown") != c["status"]:
            bad = c["status"] == "True" if c["type"] in (DEGRADED, PEER_STALLED) else c["status"] == "False"
            warning = c["type"] != PROGRESSING and bad
            _announce(body, c["type"], c["status"], c["reason"], c["message"], warning=warning)


async def _reconcile_modelload(
    namespace: str, name: str, body: kopf.Body, patch: kopf.Patch,
    node_index: kopf.Index, replica_index: kopf.Index, replica_lease_index: kopf.Index, version_index: kopf.Index,
) -> None:  # fmt: skip
    started = time.perf_counter()
    if body["metadata"].get("deletionTimestamp"):
        return  # ownerReferences let the garbage collector remove the replicas
    model_load = _snapshot(body)
    replicas = list(replica_index.get((namespace, name), []))
    nodes = [n for store in node_index.values() for n in store]
    desired = body["spec"]["desiredVersion"]
    view = _lookup(version_index, namespace)(desired)
    uid = (view.uid or None) if view else None
    holders = {
        r["spec"]["nodeName"]
        for (ns, _), store in replica_index.items() if ns == namespace
        for r in store
        if serves(r, desired, uid)
    }  # fmt: skip
    problem = version_problem(body["spec"], view)
    leases = {n: lease for (ns, n), store in replica_lease_index.items() if ns == namespace for lease in store}
    now = dt.datetime.now(dt.UTC)
    stale = stale_replicas(replicas, leases, now)
    plan = plan_replicas(model_load, replicas, nodes, holders, placeable=problem is None, stale=stale)
    for wr in plan.create:
        await asyncio.to_thread(kubeapi.create_replica, wr)
        kopf.info(body, reason="ReplicaCreated", message=f"{wr['metadata']['name']} on {wr['spec']['nodeName']}")
    for replica in plan.delete:
        await asyncio.to_thread(kubeapi.delete_replica, namespace, replica)
        kopf.info(body, reason="ReplicaDeleted", message=replica)
    if plan.retarget:  # at once: a Parallel rollout of N replicas must not wait for N patches in a row
        await asyncio.gather(
            *(asyncio.to_thread(kubeapi.retarget_replica, namespace, r, desired, LABEL_VERSION) for r in plan.retarget)
        )
        kopf.info(body, reason="RollingOut", message=f"{', '.join(plan.retarget)} move to {desired}")

    # A Lease that names another node (or none) would keep the replica's own agent from writing its Lease for good:
    # delete it, and the agent creates its own at its next renewal. Until then the replica is not Live.
    for foreign in foreign_leases(replicas, leases):
        if await asyncio.to_thread(kubeapi.delete_lease, namespace, foreign.lease, foreign.uid):
            kopf.warn(body, reason=LEASE_OF_OTHER_NODE_DELETED, message=foreign.message())
    # Staleness is the Leases' to say, every time: the operator records it in the replicas' `Live` condition
    # (its own field) and never in their phase, which is the agent's.
    for replica, conditions in live_conditions(replicas, leases, now, now_rfc3339()).items():
        await asyncio.to_thread(kubeapi.set_replica_conditions, namespace, replica, conditions)
    matching = sum(1 for n in nodes if node_matches(n, body["spec"].get("nodeSelector") or {}))
    status = aggregate_status(
        model_load, replicas, leases, nodes_available=matching, now=now, now_text=now_rfc3339(),
        problem=problem, version_uid=uid,
    )  # fmt: skip
    current_status = body.get("status") or {}
    if any(current_status.get(k) != v for k, v in status.items()):
        patch.status.update(status)
        _emit_transitions(body, list(current_status.get("conditions") or []), status["conditions"])
    metrics.RECONCILES.labels(kind="ModelLoad", phase=status["phase"]).inc()
    metrics.RECONCILE_SECONDS.labels(kind="ModelLoad").observe(time.perf_counter() - started)


@kopf.on.event(*ML)
async def modelload_changed(event: dict, namespace: str, name: str, body: kopf.Body, patch: kopf.Patch,
                            node_index: kopf.Index, replica_index: kopf.Index, replica_lease_index: kopf.Index,
                            version_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    if event.get("type") == "DELETED":
        _forget_announced(body)
        return
    await _reconcile_modelload(
        namespace, name, body, patch, node_index, replica_index, replica_lease_index, version_index
    )


@kopf.timer(*ML, interval=CONFIG.resync_seconds, initial_delay=1)
async def modelload_resync(namespace: str, name: str, body: kopf.Body, patch: kopf.Patch,
                           node_index: kopf.Index, replica_index: kopf.Index, replica_lease_index: kopf.Index,
                           version_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    """Lease expiry and stalls are the passage of time, not events: re-derive them periodically."""
    await _reconcile_modelload(
        namespace, name, body, patch, node_index, replica_index, replica_lease_index, version_index
    )


# (namespace, Lease name) -> the last renewal time seen.
_lease_renewals: dict[tuple[str, str], dt.datetime | None] = {}


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={f"{GROUP}/replica": kopf.PRESENT})
async def replica_lease_changed(event: dict, namespace: str, name: str, body: kopf.Body, labels: kopf.Labels,
                                replica_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    """A replica's Lease that appears, goes away, or is renewed after it had expired: re-reconcile its ModelLoad
    now, so that a replica whose agent is back is live (and ready) within a lease period, not at the next resync.
    Ordinary renewals change nothing."""
    key = (namespace, name)
    kind = event.get("type")
    if kind == "DELETED":
        _lease_renewals.pop(key, None)
        changed = True
    else:
        previous = _lease_renewals.get(key)
        _lease_renewals[key] = renewal_time(body)
        changed = kind == "ADDED" or renewed_after_expiry(previous, body)
    replica = labels.get(f"{GROUP}/replica")
    if not changed or not replica:
        return
    owner = next(
        (r["spec"].get("modelLoad") for (ns, _), store in replica_index.items() if ns == namespace
         for r in store if r["metadata"]["name"] == replica),
        None,
    )  # fmt: skip
    if owner:
        await asyncio.to_thread(kubeapi.nudge, ML[2], namespace, owner, f"{GROUP}/lease",
                                f"{replica}@{body['metadata'].get('resourceVersion')}")  # fmt: skip


# (namespace, replica) -> its (phase, version, loadingVersion, reason) last seen.
_replica_phases: dict[tuple[str, str], tuple | None] = {}


@kopf.on.event(*WR)
async def replica_changed(event: dict, namespace: str, name: str, spec: kopf.Spec, status: kopf.Status,
                          **_: Any) -> None:  # fmt: skip
    """A replica changed phase or served version, started or failed loading a new one next to it (or went away):
    re-reconcile its ModelLoad now, not at the next resync. A make-before-break switch stays Serving throughout."""
    key = (namespace, name)
    state = (
        None
        if event.get("type") == "DELETED"
        else (status.get("phase"), status.get("version"), status.get("loadingVersion"), status.get("reason"))
    )
    if _replica_phases.get(key, "") == state:
        return
    _replica_phases[key] = state
    if state is None:
        _replica_phases.pop(key, None)
    owner = spec.get("modelLoad")
    if owner:
        phase = f"{state[0]}:{state[1]}" if state else "None"
        await asyncio.to_thread(kubeapi.nudge, ML[2], namespace, owner, f"{GROUP}/replica-phase", f"{name}={phase}")
