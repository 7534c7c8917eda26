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
