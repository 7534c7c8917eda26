"""kopf entry point: `kopf run --standalone -A -m ferry_operator.main`.

Handlers stay thin: they gather the current objects (kopf indexes), call the pure domain modules and patch the
result. Everything is re-derived from the objects, so a restart at any point converges to the same status.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
import hashlib
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from ferry.api.conditions import get_condition, now_rfc3339
from ferry.api.liveness import DEFAULT_LEASE_SECONDS
from ferry.api.models import GROUP, LABEL_PLACEMENT, LABEL_VERSION, replica_lease_name, warm_node_label
from ferry.api.models import ModelLoadEventReason as MLEvent
from ferry.api.models import WeightVersionEventReason as WVEvent
from ferry.chain import VersionView, dependents, resolve_chain
from ferry.s3 import credentials_from_secret_data
from ferry.storage import StorageReason, StorageReport, verify_checkpoint

# the pod_placement and retention_handlers imports register their handlers
from ferry_operator import kubeapi, leadership, logfilter, metrics, pod_placement, retention_handlers
from ferry_operator.config import CONFIG
from ferry_operator.deadlines import DEADLINES
from ferry_operator.events import condition_event
from ferry_operator.indexkeys import dependents_of, named, version_keys
from ferry_operator.kubeapi import ML, WR, WV
from ferry_operator.modelloads import (
    LEASE_OF_OTHER_NODE_DELETED,
    aggregate_status,
    fell_back,
    foreign_leases,
    live_conditions,
    node_matches,
    plan_replicas,
    renewal_time,
    renewed_after_expiry,
    serves,
    stale_replicas,
    stall_deadline,
    stalled_replicas,
    version_problem,
)
from ferry_operator.s3clients import client_for
from ferry_operator.versions import (
    CHAIN_RESOLVED,
    READY,
    attachment_blockers,
    plan_version_status,
    release_blockers,
    storage_from_status,
)

RELEASE_FINALIZER = f"{GROUP}/release"
# Annotations the operator touches to have kopf reconcile an object now (their values only need to change).
NUDGE_ANNOTATION = f"{GROUP}/base-ready"  # a version this one depends on, or desires, changed
RETRY_ANNOTATION = f"{GROUP}/verify-retry"  # a storage verification backoff ran out
DEADLINE_ANNOTATION = f"{GROUP}/deadline"  # a Lease expired, or a load may have stalled
DEADLINE_MARGIN = 0.5  # seconds past a deadline before acting on it: the check then sees it passed
EVENT_COMPONENT = "ferry-operator"  # reportingComponent and source.component of every Event the operator posts

log = logging.getLogger("ferry.operator")

# Storage verification backoff per object uid: (attempts, monotonic time of the next allowed attempt).
_verify_backoff: dict[str, tuple[int, float]] = {}
# Verifications run on their own bounded pool, so a burst of new versions neither floods S3 nor starves the
# threads that patch and nudge.
_verify_pool = ThreadPoolExecutor(CONFIG.verify_concurrency, thread_name_prefix="verify")
_verify_slots = asyncio.Semaphore(CONFIG.verify_concurrency)
_background: set[asyncio.Task] = set()


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: every handler here is an event handler or the deletion handler, and neither looks at a diff.
    kopf's default would write a last-handled-configuration annotation at each creation and each annotation change
    (every nudge), one more patch and event per object each time. Add a create/update handler and this must go."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: kopf.Body) -> Any:
        return {}

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        pass


# Set by `configure` when FERRY_LEADER_ELECTION is on: several replicas, one active.
_leadership: leadership.Leadership | None = None


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global _leadership
    settings.persistence.finalizer = RELEASE_FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = CONFIG.watch_server_timeout
    settings.watching.client_timeout = CONFIG.watch_server_timeout + 10
    settings.posting.level = logging.INFO
    settings.execution.max_workers = 8
    logfilter.install()
    task = asyncio.get_running_loop().create_task(DEADLINES.run(), name="deadlines")
    _background.add(task)
    # Short retries for Events: a 403 from a terminating namespace must not stall the shared event-posting queue.
    settings.posting.default_backoffs = settings.posting.logging_backoffs = [0.5, 1, 2]
    settings.posting.reporting_component = EVENT_COMPONENT  # kopf says "kopf"
    settings.posting.event_name_prefix = f"{EVENT_COMPONENT}-"
    settings.posting.reporting_instance = socket.gethostname()
    # Every other request rides out an apiserver restart of about two minutes: kopf ends the whole operator when a
    # watch's retries run out on a 5xx, which a starting apiserver answers for a while.
    settings.networking.error_backoffs = [0.5, 1, 2, 4, 8] + [15] * 7
    if CONFIG.metrics_port >= 0:
        port = metrics.serve(CONFIG.metrics_address, CONFIG.metrics_port)
        log.info("metrics on http://%s:%d/metrics", CONFIG.metrics_address, port)
    _leadership = leadership.from_env()
    if _leadership is not None:
        settings.posting.reporting_instance = _leadership.config.identity
        # Startup handlers run before kopf starts any watch: until this returns, the process is a standby.
        await _leadership.acquire()


@kopf.on.cleanup()
async def step_down(**_: Any) -> None:
    """After the last handler: hand the Lease over now rather than let the standby wait for it to expire."""
    if _leadership is not None:
        await asyncio.to_thread(_leadership.release)


# ---------------------------------------------------------------- indexes (one watch per kind)


@kopf.index(*WV)
def version_index(body: kopf.Body, **_: Any) -> dict:
    """The one index over every WeightVersion (see indexkeys): chains, dependents, retention, shared folders."""
    return version_keys(VersionView.from_body(body))


@kopf.index(*ML)
def desired_index(namespace: str, name: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any) -> dict | None:
    if meta.get("deletionTimestamp"):
        return None
    return {(namespace, spec.get("desiredVersion")): name}


@kopf.index(*WR)
def lease_index(namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict:
    # {} rather than None when the reads end: None would keep the replica's previous entry (a blocker for good).
    if not status.get("activeLeases"):
        return {}
    # The readers hold the served version, which during a version change is not yet spec.version.
    return {(namespace, status.get("version") or spec.get("version")): name}


@kopf.index(*WR)
def attach_index(namespace: str, body: kopf.Body, **_: Any) -> dict:
    """(namespace, version) -> the consumer pods a replica holds it for (`attachment_blockers`). Empty, never None,
    once they are gone: kopf keeps an object's previous entries when its handler returns None."""
    return {(namespace, version): names for version, names in attachment_blockers(body).items()}


def _lookup(index: kopf.Index, namespace: str):
    def lookup(name: str) -> VersionView | None:
        store = index.get(named(namespace, name))
        return next(iter(store), None) if store else None

    return lookup


def _nudge_later(plural: str, namespace: str, name: str, annotation: str, value: str):
    async def nudge() -> None:
        await asyncio.to_thread(kubeapi.nudge, plural, namespace, name, annotation, value)

    return nudge


# (object uid, condition type or `RollingOut/<replica>`) -> what was last announced as an Event. Two handler runs
# of one object can both see the same change in a stale body; one Event per change is enough.
_announced: dict[tuple[str, str], tuple[str, str]] = {}


def _emit_transitions(body: kopf.Body, before: list, after: list) -> None:
    """The Events of the condition changes from `before` to `after` (`ferry_operator.events` says which)."""
    old = {c["type"]: c for c in before}
    for c in after:
        warning = condition_event(c["type"], old.get(c["type"]), c)
        if warning is not None and _first_time(body, c["type"], (c["status"], c["reason"])):
            message = f"{c['type']}={c['status']}: {c['message']}"
            (kopf.warn if warning else kopf.info)(body, reason=c["reason"], message=message)


def _first_time(body: kopf.Body, key: str, value: tuple[str, str]) -> bool:
    """Record `value` as the last one announced for (`body`, `key`); False when it already was."""
    slot = (body["metadata"]["uid"], key)
    if _announced.get(slot) == value:
        return False
    _announced[slot] = value
    return True


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
    client = client_for(storage.get("endpoint") or CONFIG.s3_endpoint, storage.get("region"), credentials)
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
    async with _verify_slots:
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(_verify_pool, _verify_storage, namespace, dict(body["spec"]), name)
    if report.ok:
        _verify_backoff.pop(uid, None)
        DEADLINES.cancel(("verify", uid))
    else:
        # The objects may appear later (uploaded after the apply), the endpoint may come back: the backoff running
        # out is the next event.
        delay = min(CONFIG.verify_backoff_max, CONFIG.verify_backoff_initial * 2**attempts)
        _verify_backoff[uid] = (attempts + 1, time.monotonic() + delay)
        DEADLINES.after(
            ("verify", uid), delay, _nudge_later(WV[2], namespace, name, RETRY_ANNOTATION, str(attempts + 1))
        )
    metrics.VERIFICATIONS.labels(result=str(report.reason)).inc()
    return report


def _blockers(
    namespace: str, name: str, version_index: kopf.Index, desired_index: kopf.Index, lease_index: kopf.Index,
    attach_index: kopf.Index,
) -> list[str]:  # fmt: skip
    return release_blockers(
        dependents(name, dependents_of(version_index, namespace, name)),
        desired_index.get((namespace, name), []),
        lease_index.get((namespace, name), []),
        [blocker for names in attach_index.get((namespace, name), []) for blocker in names],
    )


async def _reconcile_version(
    namespace: str, name: str, body: kopf.Body, patch: kopf.Patch, logger: logging.Logger,
    version_index: kopf.Index, desired_index: kopf.Index, lease_index: kopf.Index, attach_index: kopf.Index,
) -> None:  # fmt: skip
    started = time.perf_counter()
    chain = resolve_chain(name, _lookup(version_index, namespace), CONFIG.max_chain_length)
    storage = await _storage_report(namespace, name, body["metadata"]["uid"], body)
    blockers = (
        _blockers(namespace, name, version_index, desired_index, lease_index, attach_index)
        if body["metadata"].get("deletionTimestamp")
        else []
    )
    plan = plan_version_status(body, chain, storage, release_blockers=blockers, now=now_rfc3339())
    if plan.differs_from(body.get("status")):
        patch.status.update(plan.status)
        _emit_transitions(body, list((body.get("status") or {}).get("conditions") or []), plan.status["conditions"])
    if plan.became_ready:
        logger.info("%s/%s is Ready (chain %s)", namespace, name, " → ".join(plan.status["chain"] or []))
    metrics.record_phase(namespace, name, plan.status["phase"])
    metrics.RECONCILES.labels(kind="WeightVersion", phase=plan.status["phase"]).inc()
    metrics.RECONCILE_SECONDS.labels(kind="WeightVersion").observe(time.perf_counter() - started)


@kopf.on.event(*WV)
async def version_changed(event: dict, namespace: str, name: str, body: kopf.Body, patch: kopf.Patch,
                          logger: logging.Logger, version_index: kopf.Index, desired_index: kopf.Index,
                          lease_index: kopf.Index, attach_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    if event.get("type") == "DELETED":
        metrics.forget(namespace, name)
        _forget_announced(body)
        uid = body["metadata"].get("uid")
        _verify_backoff.pop(uid, None)
        DEADLINES.cancel(("verify", uid))
        await _wake_watchers(event, namespace, name, body, version_index, desired_index)
        return
    await _reconcile_version(namespace, name, body, patch, logger, version_index, desired_index, lease_index,
                             attach_index)  # fmt: skip
    await _wake_watchers(event, namespace, name, body, version_index, desired_index)


# (namespace, name) -> what the versions that depend on this one, and the ModelLoads that desire it, last saw.
_signatures: dict[tuple[str, str], tuple] = {}


def _signature(body: kopf.Body) -> tuple:
    """What others derive from a version: its identity, readiness, release and why its chain is (not) resolved."""
    conditions = (body.get("status") or {}).get("conditions")
    return (
        body["metadata"].get("uid"),
        bool(body["metadata"].get("deletionTimestamp")),
        tuple((get_condition(conditions, t) or {}).get("reason") for t in (READY, CHAIN_RESOLVED)),
        VersionView.from_body(body).ready,
    )


async def _wake_watchers(event: dict, namespace: str, name: str, body: kopf.Body, version_index: kopf.Index,
                         desired_index: kopf.Index) -> None:  # fmt: skip
    """Event-driven, not a resync: once a change of this version is persisted (seen in this very event, and so in
    the index), re-trigger the versions based on it and the ModelLoads that desire it. Nothing else has to poll."""
    key = (namespace, name)
    gone = event.get("type") == "DELETED"
    previous = _signatures.pop(key, None) if gone else _signatures.get(key)
    if not gone:
        _signatures[key] = _signature(body)
        if previous == _signatures[key] or (previous is None and event.get("type") is None):
            return  # unchanged, or first seen in the startup listing (everything is reconciled then anyway)
    stamp = f"{name}@{body['metadata'].get('resourceVersion', '')}"
    targets = [(WV[2], v.name) for v in dependents_of(version_index, namespace, name)]
    targets += [(ML[2], load) for load in desired_index.get((namespace, name), [])]
    await asyncio.gather(
        *(asyncio.to_thread(kubeapi.nudge, plural, namespace, target, NUDGE_ANNOTATION, stamp)
          for plural, target in targets)
    )  # fmt: skip


@kopf.on.delete(*WV)
async def release_version(namespace: str, name: str, body: kopf.Body, patch: kopf.Patch,
                          version_index: kopf.Index, desired_index: kopf.Index, lease_index: kopf.Index,
                          attach_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    """Deletion is a release: the finalizer holds the version while anything still depends on it, consumer pods
    attached to it on any node included."""
    blockers = _blockers(namespace, name, version_index, desired_index, lease_index, attach_index)
    if not blockers:
        await retention_handlers.release_storage(namespace, name, body, version_index)
        kopf.info(body, reason=WVEvent.RELEASED, message="no dependents left; releasing")
        return
    chain = resolve_chain(name, _lookup(version_index, namespace), CONFIG.max_chain_length)
    storage = storage_from_status(body.get("status") or {}, body["metadata"].get("generation"))
    plan = plan_version_status(body, chain, storage, release_blockers=blockers, now=now_rfc3339())
    if plan.differs_from(body.get("status")):
        patch.status.update(plan.status)
        _emit_transitions(body, list((body.get("status") or {}).get("conditions") or []), plan.status["conditions"])
    raise kopf.TemporaryError(f"release blocked by {', '.join(blockers)}", delay=CONFIG.release_retry_seconds)


# ---------------------------------------------------------------- ModelLoad → WeightReplicas


def _snapshot(body: kopf.Body) -> dict:
    return copy.deepcopy(dict(body))


def _node_view(name: str, body: kopf.Body) -> dict:
    return {"metadata": {"name": name, "labels": dict(body.metadata.labels)}, "spec": dict(body.spec)}


@kopf.index("", "v1", "nodes")
def node_index(name: str, body: kopf.Body, **_: Any) -> dict:
    return {name: _node_view(name, body)}


@kopf.index(*WR)
def replica_index(namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, body: kopf.Body,
                  **_: Any) -> dict:  # fmt: skip
    """By (namespace, ModelLoad); also by name (a Lease's replica) and by the version it reports (holders)."""
    snapshot = _snapshot(body)
    keys = {(namespace, spec.get("modelLoad")): snapshot, ("replica", namespace, name): snapshot}
    if status.get("version"):
        keys[("serving", namespace, status["version"])] = snapshot
    return keys


@kopf.index("coordination.k8s.io", "v1", "leases", labels={f"{GROUP}/replica": kopf.PRESENT})
def replica_lease_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): _snapshot(body)}


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
    serving = replica_index.get(("serving", namespace, desired), [])
    holders = {r["spec"]["nodeName"] for r in serving if serves(r, desired, uid)}
    problem = version_problem(body["spec"], view)
    leases = {
        lease_name: lease
        for r in replicas
        for lease_name in [replica_lease_name(r["metadata"]["name"])]
        for lease in replica_lease_index.get((namespace, lease_name), [])
    }
    now = dt.datetime.now(dt.UTC)
    stale = stale_replicas(replicas, leases, now)
    pod_nodes = pod_placement.pod_nodes(namespace, name, body["spec"].get("podSelector"))
    plan = plan_replicas(
        model_load, replicas, nodes, holders, placeable=problem is None, pod_nodes=pod_nodes, stale=stale
    )
    for wr in plan.create:
        if await asyncio.to_thread(kubeapi.create_replica, wr):  # False: an earlier reconcile created it
            kopf.info(
                body, reason=MLEvent.REPLICA_CREATED, message=f"{wr['metadata']['name']} on {wr['spec']['nodeName']}"
            )
    for replica in plan.delete:
        if await asyncio.to_thread(kubeapi.delete_replica, namespace, replica):
            kopf.info(body, reason=MLEvent.REPLICA_DELETED, message=replica)
    if plan.retarget:  # at once: a Parallel rollout of N replicas must not wait for N patches in a row
        await asyncio.gather(
            *(asyncio.to_thread(kubeapi.retarget_replica, namespace, r, desired, LABEL_VERSION) for r in plan.retarget)
        )
        # One Event per step; a stale index that retargets the same replicas again posts none.
        fresh = [r for r in plan.retarget if _first_time(body, f"RollingOut/{r}", ("RollingOut", desired))]
        if fresh:
            kopf.info(body, reason=MLEvent.ROLLING_OUT, message=f"{', '.join(fresh)} move to {desired}")
    for replica, placement in plan.relabel.items():
        await asyncio.to_thread(kubeapi.label_replica, namespace, replica, LABEL_PLACEMENT, placement)
    pod_placement.announce_held(body, plan.held)

    # A Lease that names another node (or none) would keep the replica's own agent from writing its Lease for good:
    # delete it, and the agent creates its own at its next renewal. Until then the replica is not Live.
    for foreign in foreign_leases(replicas, leases):
        if await asyncio.to_thread(kubeapi.delete_lease, namespace, foreign.lease, foreign.uid):
            kopf.warn(body, reason=LEASE_OF_OTHER_NODE_DELETED, message=foreign.message())
    # Staleness is the Leases' to say, every time: the operator records it in the replicas' `Live` condition
    # (its own field) and never in their phase, which is the agent's.
    for replica, conditions in live_conditions(replicas, leases, now, now_rfc3339()).items():
        await asyncio.to_thread(kubeapi.set_replica_conditions, namespace, replica, conditions)
    await pod_placement.sync_warm_labels(namespace, name, replicas, nodes, stale)
    matching = sum(1 for n in nodes if node_matches(n, body["spec"].get("nodeSelector") or {}))
    status = aggregate_status(
        model_load, replicas, leases, nodes_available=matching, now=now, now_text=now_rfc3339(),
        problem=problem, version_uid=uid, extra_replicas=plan.extra,
    )  # fmt: skip
    status["warmNodeLabel"] = warm_node_label(namespace, name)
    current_status = body.get("status") or {}
    if any(current_status.get(k) != v for k, v in status.items()):
        patch.status.update(status)
        _emit_transitions(body, list(current_status.get("conditions") or []), status["conditions"])
    # A load that stops progressing sends no event: its stall deadline is one. A stalled one that progresses again
    # must wake this ModelLoad (replica_changed), where ordinary progress does not.
    stall_seconds = _stall_seconds(body["spec"])
    for r in replicas:
        _stalled.discard((namespace, r["metadata"]["name"]))
    _stalled.update((namespace, s.replica) for s in stalled_replicas(replicas, stall_seconds, now))
    stall = stall_deadline(replicas, stall_seconds, now)
    if stall is None:
        DEADLINES.cancel(("stall", namespace, name))
    else:
        DEADLINES.after(
            ("stall", namespace, name), (stall - now).total_seconds() + DEADLINE_MARGIN,
            _nudge_later(ML[2], namespace, name, DEADLINE_ANNOTATION, f"stall@{stall.isoformat()}"),
        )  # fmt: skip
    metrics.record_modelload(namespace, name, status, replicas)
    metrics.RECONCILES.labels(kind="ModelLoad", phase=status["phase"]).inc()
    metrics.RECONCILE_SECONDS.labels(kind="ModelLoad").observe(time.perf_counter() - started)


@kopf.on.event(*ML)
async def modelload_changed(event: dict, namespace: str, name: str, body: kopf.Body, patch: kopf.Patch,
                            node_index: kopf.Index, replica_index: kopf.Index, replica_lease_index: kopf.Index,
                            version_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    if event.get("type") == "DELETED":
        metrics.forget_modelload(namespace, name)
        _forget_announced(body)
        return
    await _reconcile_modelload(
        namespace, name, body, patch, node_index, replica_index, replica_lease_index, version_index
    )


def _stall_seconds(spec: kopf.Spec) -> float:
    return float((spec.get("transfer") or {}).get("stallSeconds", 60))


# (namespace, Lease name) -> the last renewal time seen.
_lease_renewals: dict[tuple[str, str], dt.datetime | None] = {}


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={f"{GROUP}/replica": kopf.PRESENT})
async def replica_lease_changed(event: dict, namespace: str, name: str, body: kopf.Body, labels: kopf.Labels,
                                replica_index: kopf.Index, **_: Any) -> None:  # fmt: skip
    """A replica's Lease that appears, goes away, or is renewed after it had expired: re-reconcile its ModelLoad
    now, so that a replica whose agent is back is live (and ready) within a lease period. Ordinary renewals change
    nothing but the Lease's expiry deadline: only a Lease that is not renewed in time wakes its ModelLoad."""
    key = (namespace, name)
    kind = event.get("type")
    replica = labels.get(f"{GROUP}/replica")
    owner = next((r["spec"].get("modelLoad") for r in replica_index.get(("replica", namespace, replica), [])), None)
    if kind == "DELETED":
        _lease_renewals.pop(key, None)
        DEADLINES.cancel(("lease", namespace, name))
        changed = True
    else:
        previous = _lease_renewals.get(key)
        renewed = _lease_renewals[key] = renewal_time(body)
        changed = kind == "ADDED" or renewed_after_expiry(previous, body)
        if renewed is not None and owner:
            duration = (body.get("spec") or {}).get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS
            expires = renewed + dt.timedelta(seconds=duration) - dt.datetime.now(dt.UTC)
            DEADLINES.after(
                ("lease", namespace, name), expires.total_seconds() + DEADLINE_MARGIN,
                _nudge_later(ML[2], namespace, owner, DEADLINE_ANNOTATION, f"{name}@{renewed.isoformat()}"),
            )  # fmt: skip
    if changed and owner:
        await asyncio.to_thread(kubeapi.nudge, ML[2], namespace, owner, f"{GROUP}/lease",
                                f"{replica}@{body['metadata'].get('resourceVersion')}")  # fmt: skip


# (namespace, replica) -> what its ModelLoad derives from it, as last seen.
_replica_states: dict[tuple[str, str], tuple] = {}
_stalled: set[tuple[str, str]] = set()  # (namespace, replica) its ModelLoad last found stalled


def _attached_digest(status: kopf.Status) -> str:
    held = sorted(f"{e.get('podUid')}/{e.get('version')}" for e in status.get("attachments") or [])
    return hashlib.sha256("\n".join(held).encode()).hexdigest()[:12]


@kopf.on.event(*WR)
async def replica_changed(event: dict, namespace: str, name: str, body: kopf.Body, spec: kopf.Spec,
                          status: kopf.Status, **_: Any) -> None:  # fmt: skip
    """A replica changed what its ModelLoad's status is made of (phase, the version it serves or loads next to it,
    a failure, a fallback, who is attached) or went away: re-reconcile the ModelLoad now. Progress within a load
    changes nothing there."""
    key = (namespace, name)
    if event.get("type") == "DELETED":
        state: tuple | None = None
        _replica_states.pop(key, None)
        _stalled.discard(key)
    else:
        state = (
            status.get("phase"), status.get("version"), status.get("versionUid"), spec.get("version"),
            status.get("loadingVersion"), status.get("reason"),
            spec.get("nodeName"), fell_back(body), bool(body["metadata"].get("deletionTimestamp")),
            status.get("lastProgressTime") if key in _stalled else None,
            _attached_digest(status),
        )  # fmt: skip
        if _replica_states.get(key) == state:
            return
        _replica_states[key] = state
    owner = spec.get("modelLoad")
    if owner:
        phase = state[0] if state else None
        await asyncio.to_thread(kubeapi.nudge, ML[2], namespace, owner, f"{GROUP}/replica-phase",
                                f"{name}={phase}@{body['metadata'].get('resourceVersion', '')}")  # fmt: skip


_node_views: dict[str, dict] = {}


@kopf.on.event("", "v1", "nodes")
async def node_changed(event: dict, name: str, body: kopf.Body, desired_index: kopf.Index, **_: Any) -> None:
    """A node that appears, goes, or changes labels or schedulability moves placements: wake every ModelLoad.
    Status heartbeats (most node events) change neither."""
    view = None if event.get("type") == "DELETED" else _node_view(name, body)
    previous = _node_views.pop(name, None) if view is None else _node_views.get(name)
    if view is not None:
        _node_views[name] = view
        if previous == view or (previous is None and event.get("type") is None):
            return
    loads = {(ns, load) for (ns, _), store in desired_index.items() for load in store}
    stamp = f"{name}@{body['metadata'].get('resourceVersion', '')}"
    await asyncio.gather(
        *(asyncio.to_thread(kubeapi.nudge, ML[2], ns, load, f"{GROUP}/node", stamp) for ns, load in loads)
    )
