"""Which condition changes become Kubernetes Events, and which of those are Warnings.

One Event per real state change: a condition flips, a problem appears or changes, or a problem clears. The
conditions a condition summarises say nothing new (a WeightVersion's Ready carries the reason of the first failing
one; a ModelLoad's Progressing is told by the ReplicaCreated/RollingOut Events of the replicas it moves), and a
condition born in its resting state (Degraded=False, or Ready=False while things are merely under way) is no news.
Warning only for problems: never for the steps of a normal create or rollout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from ferry.api.models import ChainReason, ConditionStatus, ModelLoadReadyReason, WeightVersionReadyReason
from ferry_operator.modelloads import DEGRADED, ENGINES_ATTACHED, PEER_STALLED, READY, VERSION_NOT_READY
from ferry_operator.versions import VERIFICATION_PENDING

ANNOUNCED = frozenset({READY, DEGRADED, PEER_STALLED})
# Conditions whose True is the problem.
NEGATIVE = frozenset({DEGRADED, PEER_STALLED})
# Ready=False reasons that are steps of normal progress: waiting on a verification, a base, a load, a release.
WAITING_REASONS = frozenset(
    {
        VERIFICATION_PENDING,
        ChainReason.BaseNotReady,
        WeightVersionReadyReason.RELEASING,
        ModelLoadReadyReason.REPLICAS_NOT_READY,
        VERSION_NOT_READY,
    }
)


def is_problem(type_: str, status: str, reason: str) -> bool:
    if type_ in NEGATIVE:
        return status == ConditionStatus.TRUE
    return status == ConditionStatus.FALSE and reason not in WAITING_REASONS


def condition_event(type_: str, before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> bool | None:
    """None: the change from `before` (None: the condition is new) to `after` is no Event; else whether it is a
    Warning."""
    if type_ == ENGINES_ATTACHED:  # informational: a pod attaching or the last one leaving is news, never a problem
        unknown = ConditionStatus.UNKNOWN
        flipped = before is not None and before.get("status", unknown) not in (unknown, after.get("status"))
        return False if flipped else None
    if type_ not in ANNOUNCED:
        return None
    status, reason = after.get("status", ConditionStatus.UNKNOWN), after.get("reason", "")
    warning = is_problem(type_, status, reason)
    if before is None or before.get("status", ConditionStatus.UNKNOWN) == ConditionStatus.UNKNOWN:
        return warning if warning or (type_ == READY and status == ConditionStatus.TRUE) else None
    was = (before.get("status"), before.get("reason", ""))
    if was == (status, reason):
        return None
    if was[0] != status or warning or is_problem(type_, *was):
        return warning
    return None  # one step of progress to the next (e.g. VersionNotReady → ReplicasNotReady): no news


def emit_transitions(body: Mapping[str, Any], before: list, after: list, announced: dict[str, tuple]) -> None:
    """Post the Events of the condition changes from `before` to `after` (`condition_event` says which).
    `announced` is the object's memo of what was last posted per condition."""
    old = {c["type"]: c for c in before}
    for c in after:
        warning = condition_event(c["type"], old.get(c["type"]), c)
        if warning is not None and first_time(announced, c["type"], (c["status"], c["reason"])):
            message = f"{c['type']}={c['status']}: {c['message']}"
            (kopf.warn if warning else kopf.info)(body, reason=c["reason"], message=message)


def first_time(announced: dict[str, tuple], key: str, value: tuple) -> bool:
    """Record `value` as the last one announced for `key`; False when it already was. Two reconciles of one
    object can both see the same change in a stale body: one Event per change is enough."""
    if announced.get(key) == value:
        return False
    announced[key] = value
    return True
