"""ModelLoad → WeightReplicas: place, create, retarget and delete replicas, keep their `Live` conditions and the
Leases honest, and aggregate the ModelLoad's status.

Run by the ModelLoad's own events (main.py) and, woken in process (`WAKEUPS`), when one of its replicas, their
Leases, the nodes, its followed pods or its desired version change, or a Lease or stall deadline passes. Either way
under the ModelLoad's lock, writing the status itself.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from ferry.api.conditions import condition_dicts, now_rfc3339
from ferry.api.models import (
    LABEL_PLACEMENT,
    EventAction,
    InvalidObject,
    ModelLoad,
    merge_patch,
    warm_node_label,
)
from ferry.api.models import ModelLoadEventReason as MLEvent
from ferry_operator import kubeapi, metrics, pod_placement
from ferry_operator.deadlines import DEADLINES
from ferry_operator.events import EVENTS, emit_transitions, first_time
from ferry_operator.indexes import Indexes
from ferry_operator.kubeapi import ML
from ferry_operator.modelloads import (
    aggregate_status,
    foreign_leases,
    holders,
    live_conditions,
    matching_nodes,
    plan_replicas,
    replica_leases,
    retarget_ops,
    stale_replicas,
    stall_deadline,
    stall_seconds,
    stalled_replicas,
    version_problem,
)
from ferry_operator.wakeups import WAKEUPS

log = logging.getLogger("ferry.operator")

DEADLINE_MARGIN = 0.5  # seconds past a deadline before acting on it: the check then sees it passed


def wake_later(namespace: str, name: str) -> Callable[[], Awaitable[None]]:
    """A deadline callback that wakes the ModelLoad."""

    async def wake() -> None:
        WAKEUPS.wake(ML[2], namespace, name)

    return wake


async def reconcile(namespace: str, name: str, memo: kopf.Memo, body: Mapping[str, Any] | None = None) -> None:
    """Always from the object as it is now, read under the lock: kopf replays every queued event, and acting on an
    older event's `body` would move replicas back to a version desired before. `body` (the event's) is not used."""
    del body
    async with WAKEUPS.lock(memo):
        fresh = await asyncio.to_thread(kubeapi.get_object, ML[2], namespace, name)
        if fresh is None:
            return
        await _reconcile(namespace, name, fresh, memo)


async def reconcile_woken(namespace: str, name: str, memo: kopf.Memo) -> None:
    await reconcile(namespace, name, memo)


async def _reconcile(namespace: str, name: str, body: Mapping[str, Any], memo: kopf.Memo) -> None:
    indexes: Indexes = memo.indexes
    announced: dict[str, tuple] = memo.setdefault("announced", {})
    started = time.perf_counter()
    try:
        model_load = ModelLoad.from_body(body)  # parsed once; the replicas, Leases and nodes stay index snapshots
    except InvalidObject as error:
        log.error("skipping %s", error)
        return
    if model_load.metadata.deletionTimestamp:
        return  # ownerReferences let the garbage collector remove the replicas
    spec = model_load.spec
    replicas = list(indexes.replicas.get((namespace, name), []))
    nodes = indexes.all_nodes()
    desired = spec.desiredVersion
    view = indexes.version_lookup(namespace)(desired)
    uid = (view.uid or None) if view else None
    serving = holders(indexes.replicas.get(("serving", namespace, desired), []), desired, uid)
    problem = version_problem(spec, view)
    leases = replica_leases(replicas, lambda lease: indexes.replica_leases.get((namespace, lease), []))
    now = dt.datetime.now(dt.UTC)
    stale = stale_replicas(replicas, leases, now)
    # pod_placement keeps the selector as a dict in its process-wide state, between reconciles.
    selector = spec.podSelector.model_dump(mode="json", exclude_none=True) if spec.podSelector else None
    pod_nodes = pod_placement.pod_nodes(namespace, name, selector)
    plan = plan_replicas(
        model_load, replicas, nodes, serving, placeable=problem is None, pod_nodes=pod_nodes, stale=stale
    )
    for wr in plan.create:
        if await asyncio.to_thread(kubeapi.create_replica, wr):  # False: an earlier reconcile created it
            EVENTS.post(
                body,
                reason=MLEvent.REPLICA_CREATED,
                message=f"{wr['metadata']['name']} on {wr['spec']['nodeName']}",
                action=EventAction.CREATE_REPLICA,
            )
    for replica in plan.delete:
        if await asyncio.to_thread(kubeapi.delete_replica, namespace, replica):
            EVENTS.post(body, reason=MLEvent.REPLICA_DELETED, message=replica, action=EventAction.DELETE_REPLICA)
    if plan.retarget:  # at once: a Parallel rollout of N replicas must not wait for N patches in a row
        by_name = {r["metadata"]["name"]: r for r in replicas}
        moved = await asyncio.gather(
            *(
                asyncio.to_thread(kubeapi.retarget_replica, namespace, r, retarget_ops(by_name[r], desired))
                for r in plan.retarget
            )
        )
        # A refused one moved since it was read: the next reconcile (its change wakes one) plans it again.
        done = [r for r, ok in zip(plan.retarget, moved, strict=True) if ok]
        # One Event per step; a stale index that retargets the same replicas again posts none.
        fresh = [r for r in done if first_time(announced, f"RollingOut/{r}", ("RollingOut", desired))]
        if fresh:
            message = f"{', '.join(fresh)} move to {desired}"
            EVENTS.post(body, reason=MLEvent.ROLLING_OUT, message=message, action=EventAction.ROLL_OUT)
    for replica, placement in plan.relabel.items():
        await asyncio.to_thread(kubeapi.label_replica, namespace, replica, LABEL_PLACEMENT, placement)
    pod_placement.announce_held(body, plan.held, memo.setdefault("held", set()))

    # A Lease that names another node (or none) would keep the replica's own agent from writing its Lease for good:
    # delete it, and the agent creates its own at its next renewal. Until then the replica is not Live.
    for foreign in foreign_leases(replicas, leases):
        if await asyncio.to_thread(kubeapi.delete_lease, namespace, foreign.lease, foreign.uid):
            EVENTS.post(
                body,
                reason=MLEvent.LEASE_OF_OTHER_NODE_DELETED,
                message=foreign.message(),
                action=EventAction.DELETE_LEASE,
                warning=True,
            )
    # Staleness is the Leases' to say, every time: the operator records it in the replicas' `Live` condition
    # (its own field) and never in their phase, which is the agent's.
    for replica, conditions in live_conditions(replicas, leases, now, now_rfc3339()).items():
        await asyncio.to_thread(kubeapi.set_replica_conditions, namespace, replica, conditions)
    await pod_placement.sync_warm_labels(namespace, name, replicas, nodes, stale)
    status = aggregate_status(
        model_load,
        replicas,
        leases,
        nodes_available=matching_nodes(nodes, spec),
        now=now,
        now_text=now_rfc3339(),
        problem=problem,
        version_uid=uid,
        extra_replicas=plan.extra,
    )
    status = status.model_copy(update={"warmNodeLabel": warm_node_label(namespace, name)})
    patch = merge_patch(model_load.status, status)
    if status != model_load.status:
        # Only onto the object as read: a newer generation (its event queued already) writes its own status, so
        # observedGeneration never goes down.
        rv = body["metadata"].get("resourceVersion")
        if not await asyncio.to_thread(kubeapi.patch_status, ML[2], namespace, name, patch, rv):
            return
        before = condition_dicts(model_load.status.conditions) if model_load.status else []
        emit_transitions(body, before, patch["conditions"], announced)
    # A load that stops progressing sends no event: its stall deadline is one. A stalled one that progresses again
    # must wake this ModelLoad (replica_changed), where ordinary progress does not.
    stalled: set[tuple[str, str]] = memo.stalled
    seconds = stall_seconds(spec)
    for r in replicas:
        stalled.discard((namespace, r["metadata"]["name"]))
    stalled.update((namespace, s.replica) for s in stalled_replicas(replicas, seconds, now))
    stall = stall_deadline(replicas, seconds, now)
    if stall is None:
        DEADLINES.cancel(("stall", namespace, name))
    else:
        DEADLINES.after(
            ("stall", namespace, name), (stall - now).total_seconds() + DEADLINE_MARGIN, wake_later(namespace, name)
        )
    metrics.record_modelload(namespace, name, patch, replicas)
    metrics.RECONCILES.labels(kind="ModelLoad", phase=status.phase).inc()
    metrics.RECONCILE_SECONDS.labels(kind="ModelLoad").observe(time.perf_counter() - started)


def forget(namespace: str, name: str) -> None:
    """The ModelLoad is gone: no wakes, no stall deadline (kopf drops its memo)."""
    WAKEUPS.forget(ML[2], namespace, name)
    DEADLINES.cancel(("stall", namespace, name))
    metrics.forget_modelload(namespace, name)
