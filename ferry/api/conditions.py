"""Kubernetes-convention conditions: lastTransitionTime moves only when status flips."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from ferry.api.models import Condition, ConditionStatus


def now_rfc3339(*, micro: bool = False) -> str:
    """Now (UTC) in whole seconds, or with `micro` in microseconds (a Lease's MicroTime, a load's start and end)."""
    now = dt.datetime.now(dt.UTC)
    if micro:
        return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return now.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    conditions: Iterable[Mapping[str, Any]] | None,
    type_: str,
    status: bool | str,
    reason: str,
    message: str = "",
    *,
    generation: int | None = None,
    now: str | None = None,
) -> list[dict[str, Any]]:
    """Return a new condition list with `type_` set; other conditions are kept in order. Enum members (the types
    and reasons of ferry.api.models) are stored as plain strings."""
    status_text = _status_text(status)
    result: list[dict[str, Any]] = []
    found = False
    for existing in conditions or ():
        if existing.get("type") != type_:
            result.append(dict(existing))
            continue
        found = True
        flipped = existing.get("status") != status_text
        result.append(
            _condition(
                type_,
                status_text,
                reason,
                message,
                generation,
                (now or now_rfc3339()) if flipped else existing.get("lastTransitionTime") or now or now_rfc3339(),
            )
        )
    if not found:
        result.append(_condition(type_, status_text, reason, message, generation, now or now_rfc3339()))
    return result


def with_condition(
    conditions: Iterable[Condition],
    type_: str,
    status: bool | str,
    reason: str,
    message: str = "",
    *,
    generation: int | None = None,
    now: str | None = None,
) -> list[Condition]:
    """`set_condition` on typed conditions: a new list with `type_` set, lastTransitionTime moved only when the
    status flips."""
    status_text = _status_text(status)
    when = now or now_rfc3339()
    result: list[Condition] = []
    found = False
    for existing in conditions:
        if existing.type != type_:
            result.append(existing)
            continue
        found = True
        kept = existing.status == status_text
        result.append(
            _typed(type_, status_text, reason, message, generation, existing.lastTransitionTime if kept else when)
        )
    if not found:
        result.append(_typed(type_, status_text, reason, message, generation, when))
    return result


def _typed(type_: str, status: str, reason: str, message: str, generation: int | None, when: str) -> Condition:
    # Not validated here, as set_condition's dicts are not: the apiserver judges what is written.
    return Condition.model_construct(
        type=str(type_),
        status=status,
        reason=str(reason),
        message=message,
        observedGeneration=generation,
        lastTransitionTime=when,
    )


def find_condition(conditions: Iterable[Condition] | None, type_: str) -> Condition | None:
    return next((c for c in conditions or () if c.type == type_), None)


def condition_dicts(conditions: Iterable[Condition]) -> list[dict[str, Any]]:
    """Typed conditions as the object carries them (what operator/ferry_operator/events.py compares)."""
    return [c.model_dump(mode="json", exclude_none=True) for c in conditions]


def _status_text(status: bool | str) -> str:
    return str(status) if isinstance(status, str) else str(ConditionStatus.TRUE if status else ConditionStatus.FALSE)


def _condition(type_: str, status: str, reason: str, message: str, generation: int | None, when: str) -> dict:
    cond: dict[str, Any] = {
        "type": str(type_),
        "status": status,
        "reason": str(reason),
        "message": message,
        "lastTransitionTime": when,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def get_condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def is_true(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == ConditionStatus.TRUE


def human_bytes(n: int) -> str:
    """Binary units, like kubectl quantities: 512Mi, 1.5Gi."""
    value = float(n)
    for unit in ("", "Ki", "Mi", "Gi", "Ti", "Pi"):
        if value < 1024 or unit == "Pi":
            return f"{int(value)}{unit}" if value == int(value) else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")
