"""Which condition changes become Kubernetes Events, which of those are Warnings, and the posting of every Event
the operator sends (`EVENTS`).

One Event per real state change: a condition flips, a problem appears or changes, or a problem clears. The
conditions a condition summarises say nothing new (a WeightVersion's Ready carries the reason of the first failing
one; a ModelLoad's Progressing is told by the ReplicaCreated/RollingOut Events of the replicas it moves), and a
condition born in its resting state (Degraded=False, or Ready=False while things are merely under way) is no news.
Warning only for problems: never for the steps of a normal create or rollout.

The operator posts its core/v1 Events itself rather than through kopf, whose Events all say `action: "Action?"`:
each carries an `EventAction` and is reported by `ferry-operator`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import socket
from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from ferry.api.models import (
    ChainReason,
    ConditionStatus,
    EventAction,
    ModelLoadConditionType,
    ModelLoadReadyReason,
    StorageReason,
    WeightVersionConditionType,
    WeightVersionReadyReason,
)
from ferry_operator import kubeaio

ANNOUNCED = frozenset(
    {ModelLoadConditionType.READY, ModelLoadConditionType.DEGRADED, ModelLoadConditionType.PEER_STALLED}
)
# Conditions whose True is the problem.
NEGATIVE = frozenset({ModelLoadConditionType.DEGRADED, ModelLoadConditionType.PEER_STALLED})
# Ready=False reasons that are steps of normal progress: waiting on a verification, a base, a load, a release
# (also one that waits for what still needs the version).
WAITING_REASONS = frozenset(
    {
        StorageReason.VerificationPending,
        ChainReason.BaseNotReady,
        WeightVersionReadyReason.RELEASING,
        WeightVersionReadyReason.RELEASE_BLOCKED,
        ModelLoadReadyReason.REPLICAS_NOT_READY,
        ModelLoadReadyReason.VERSION_NOT_READY,
    }
)


def is_problem(type_: str, status: str, reason: str) -> bool:
    if type_ in NEGATIVE:
        return status == ConditionStatus.TRUE
    return status == ConditionStatus.FALSE and reason not in WAITING_REASONS


def condition_event(
    type_: str, before: Mapping[str, Any] | None, after: Mapping[str, Any], *, quiet_ready: bool = False
) -> bool | None:
    """None: the change from `before` (None: the condition is new) to `after` is no Event; else whether it is a
    Warning. `quiet_ready`: Ready=True from nothing is no Event either (a new WeightVersion's first Ready)."""
    if (
        type_ == ModelLoadConditionType.ENGINES_ATTACHED
    ):  # informational: a pod attaching or the last one leaving is news, never a problem
        unknown = ConditionStatus.UNKNOWN
        flipped = before is not None and before.get("status", unknown) not in (unknown, after.get("status"))
        return False if flipped else None
    if type_ not in ANNOUNCED:
        return None
    status, reason = after.get("status", ConditionStatus.UNKNOWN), after.get("reason", "")
    warning = is_problem(type_, status, reason)
    if before is None or before.get("status", ConditionStatus.UNKNOWN) == ConditionStatus.UNKNOWN:
        ready = type_ == ModelLoadConditionType.READY and status == ConditionStatus.TRUE
        return warning if warning or (ready and not quiet_ready) else None
    was = (before.get("status"), before.get("reason", ""))
    if was == (status, reason):
        return None
    if was[0] != status or warning or is_problem(type_, *was):
        return warning
    return None  # one step of progress to the next (e.g. VersionNotReady → ReplicasNotReady): no news


RELEASE_REASONS = frozenset({WeightVersionReadyReason.RELEASE_BLOCKED, WeightVersionReadyReason.RELEASING})
# The action of a condition's Events, by the object's kind and the condition's type.
CONDITION_ACTIONS = {
    ("WeightVersion", WeightVersionConditionType.READY): EventAction.VERIFY,
    ("ModelLoad", ModelLoadConditionType.READY): EventAction.SERVE,
    ("ModelLoad", ModelLoadConditionType.DEGRADED): EventAction.SERVE,
    ("ModelLoad", ModelLoadConditionType.PEER_STALLED): EventAction.LOAD,
    ("ModelLoad", ModelLoadConditionType.ENGINES_ATTACHED): EventAction.ATTACH,
}


def condition_action(kind: str, type_: str, reason: str) -> EventAction:
    if kind == "WeightVersion" and reason in RELEASE_REASONS:
        return EventAction.RELEASE
    return CONDITION_ACTIONS.get((kind, type_), EventAction.VERIFY if kind == "WeightVersion" else EventAction.SERVE)


def emit_transitions(
    body: Mapping[str, Any], before: list, after: list, announced: dict[str, tuple], *, first_ready: bool = False
) -> None:
    """Post the Events of the condition changes from `before` to `after` (`condition_event` says which).
    `announced` is the object's memo of what was last posted per condition. `first_ready`: the object has never
    been Ready (a new WeightVersion): its Ready=True is no Event unless its Ready had an Event before (a problem,
    whose end this is). The normal end of a create is not news (its status says it: phase, readyTime), and at
    thousands of versions published at once those Events would cost the apiserver a fifth of its work."""
    old = {c["type"]: c for c in before}
    for c in after:
        quiet = first_ready and c["type"] not in announced  # (after an announced problem, its end is news)
        warning = condition_event(c["type"], old.get(c["type"]), c, quiet_ready=quiet)
        if warning is not None and first_time(announced, c["type"], (c["status"], c["reason"])):
            EVENTS.post(
                body,
                reason=c["reason"],
                message=f"{c['type']}={c['status']}: {c['message']}",
                action=condition_action(body["kind"], c["type"], c["reason"]),
                warning=warning,
            )


def first_time(announced: dict[str, tuple], key: str, value: tuple) -> bool:
    """Record `value` as the last one announced for `key`; False when it already was. Two reconciles of one
    object can both see the same change in a stale body: one Event per change is enough."""
    if announced.get(key) == value:
        return False
    announced[key] = value
    return True


COMPONENT = "ferry-operator"  # reportingComponent and source.component of every Event the operator posts
MAX_MESSAGE = 1024  # the apiserver refuses longer Event messages
POST_BACKOFFS = (0.5, 1.0, 2.0)  # between the tries of an Event the apiserver could not take (5xx, unreachable)
# Not tried again: the namespace is terminating (403) or gone (404), or the Event is refused as it is.
FINAL_STATUSES = frozenset({400, 403, 404, 409, 422})

log = logging.getLogger("ferry.operator.events")


def event_body(
    obj: Mapping[str, Any], *, reason: str, message: str, action: EventAction, warning: bool, instance: str, now: str
) -> dict[str, Any]:
    """A core/v1 Event about `obj` (a body, or apiVersion, kind and metadata of one)."""
    metadata = obj["metadata"]
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"namespace": metadata["namespace"], "generateName": f"{COMPONENT}-"},
        "involvedObject": {
            "apiVersion": obj["apiVersion"],
            "kind": obj["kind"],
            "name": metadata["name"],
            "namespace": metadata["namespace"],
            "uid": metadata.get("uid"),
        },
        "type": "Warning" if warning else "Normal",
        "reason": str(reason),
        "message": message,
        "action": str(action),
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
        "source": {"component": COMPONENT},  # the "From" of `kubectl describe`
        "firstTimestamp": now,
        "lastTimestamp": now,
        "eventTime": now,
        "count": 1,
    }


class EventPoster:
    """Queued on the event loop, posted by a few workers, an Event the apiserver could not take tried again
    briefly: posting never holds up a reconcile, and no Event (nor its retries) holds up the others."""

    def __init__(self, workers: int = 4) -> None:
        self.instance = socket.gethostname()  # reportingInstance: the leader's identity when elected
        self._workers = workers
        self._queue: asyncio.Queue[tuple[dict[str, Any], int]] | None = None  # (Event, tries so far)
        self._tasks: set[asyncio.Task] = set()

    def start(self, instance: str | None = None) -> None:
        if instance:
            self.instance = instance
        self._queue = asyncio.Queue()
        for i in range(self._workers):
            self._tasks.add(asyncio.get_running_loop().create_task(self._work(), name=f"events-{i}"))

    def post(
        self,
        obj: Mapping[str, Any],
        *,
        reason: str,
        message: str,
        action: EventAction,
        warning: bool = False,
    ) -> None:
        """On the event loop. Before `start` (outside the operator) the Event is only logged."""
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = event_body(
            obj, reason=reason, message=message, action=action, warning=warning, instance=self.instance, now=now
        )
        if self._queue is None:
            log.debug("not posted (no poster running): %s", body)
            return
        self._queue.put_nowait((body, 0))

    async def _work(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            body, tries = await self._queue.get()
            try:
                await kubeaio.create_event(body["metadata"]["namespace"], body)
            except Exception as exc:
                why = f"{exc.status} {exc.reason}: {exc.body}" if isinstance(exc, ApiException) else repr(exc)
                if isinstance(exc, ApiException) and exc.status in FINAL_STATUSES:
                    log.debug("Event %s on %s not posted: %s", body["reason"], body["involvedObject"], why)
                elif tries < len(POST_BACKOFFS):  # again later, without holding this worker up meanwhile
                    loop.call_later(POST_BACKOFFS[tries], self._queue.put_nowait, (body, tries + 1))
                else:
                    log.warning("Event %s on %s not posted: %s", body["reason"], body["involvedObject"], why)


EVENTS = EventPoster()
