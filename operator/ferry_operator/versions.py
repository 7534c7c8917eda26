"""WeightVersion status, derived from the current objects alone (level-based), so any restart converges.

Pure: the kopf handlers feed in the object, a chain result and a storage report, and patch what comes out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ferry.api.conditions import get_condition, human_bytes, set_condition
from ferry.api.models import (
    ChainReason,
    ConditionStatus,
    StorageReason,
    WeightVersionConditionType,
    WeightVersionPhase,
    WeightVersionReadyReason,
)
from ferry.chain import ChainResult
from ferry.storage import StorageReport

CHAIN_RESOLVED = WeightVersionConditionType.CHAIN_RESOLVED
STORAGE_VERIFIED = WeightVersionConditionType.STORAGE_VERIFIED
READY = WeightVersionConditionType.READY

READY_REASON = WeightVersionReadyReason.VERIFIED
RELEASE_BLOCKED = WeightVersionReadyReason.RELEASE_BLOCKED
VERIFICATION_PENDING = StorageReason.VerificationPending

# Spec is immutable, so these can only be fixed by publishing a new version.
PERMANENT_REASONS = frozenset(
    {
        ChainReason.ChainCycle,
        ChainReason.ChainTooLong,
        ChainReason.ModelMismatch,
        ChainReason.LayoutMismatch,
        ChainReason.UnsupportedFormat,
        StorageReason.IndexInvalid,
        StorageReason.SizeMismatch,
    }
)


@dataclass
class VersionStatusPlan:
    status: dict[str, Any]
    became_ready: bool = False

    def differs_from(self, current: Mapping[str, Any] | None) -> bool:
        current = current or {}
        return any(current.get(k) != v for k, v in self.status.items())


def storage_from_status(status: Mapping[str, Any], generation: int | None) -> StorageReport | None:
    """The verification outcome recorded for this generation, if any (None: never checked)."""
    cond = get_condition(status.get("conditions"), STORAGE_VERIFIED)
    if cond is None or cond.get("status") == ConditionStatus.UNKNOWN or cond.get("observedGeneration") != generation:
        return None
    reason = StorageReason(cond.get("reason", StorageReason.Verified))
    ok = cond.get("status") == ConditionStatus.TRUE
    return StorageReport(
        ok=ok,
        reason=reason,
        message=cond.get("message", ""),
        transient=reason == StorageReason.EndpointUnreachable,
        total_bytes=status.get("totalBytes") if ok else None,
        tensor_count=status.get("tensorCount") if ok else None,
        index_digest=status.get("indexDigest") if ok else None,
    )


def plan_version_status(
    body: Mapping[str, Any],
    chain: ChainResult,
    storage: StorageReport | None,
    *,
    release_blockers: Iterable[str] = (),
    now: str,
) -> VersionStatusPlan:
    """The full desired status. `storage` None means not verified yet; a transient report keeps the last good
    StorageVerified=True (a flaky endpoint must not flap a Ready version)."""
    metadata = body.get("metadata") or {}
    current: Mapping[str, Any] = body.get("status") or {}
    generation = metadata.get("generation")
    conditions = list(current.get("conditions") or [])
    previous = {c["type"]: c.get("status") for c in conditions}

    conditions = set_condition(
        conditions, CHAIN_RESOLVED, chain.ok, str(chain.reason), chain.message, generation=generation, now=now
    )

    kept_good = storage is not None and storage.transient and previous.get(STORAGE_VERIFIED) == ConditionStatus.TRUE
    if storage is None:
        conditions = set_condition(
            conditions, STORAGE_VERIFIED, ConditionStatus.UNKNOWN, VERIFICATION_PENDING,
            "checking the checkpoint objects in object storage", generation=generation, now=now,
        )  # fmt: skip
    elif not kept_good:
        conditions = set_condition(
            conditions, STORAGE_VERIFIED, storage.ok, str(storage.reason), storage.message,
            generation=generation, now=now,
        )  # fmt: skip
    storage_ok = kept_good or (storage is not None and storage.ok)

    deleting = bool(metadata.get("deletionTimestamp"))
    blockers = list(release_blockers)
    if chain.ok and storage_ok:
        ready_reason, ready_message = READY_REASON, f"{chain.message} Storage verified."
    elif not chain.ok:
        ready_reason, ready_message = str(chain.reason), chain.message
    elif storage is None:
        ready_reason, ready_message = VERIFICATION_PENDING, "waiting for storage verification"
    else:
        ready_reason, ready_message = str(storage.reason), storage.message
    ready = chain.ok and storage_ok and not deleting
    if deleting:
        ready_reason = RELEASE_BLOCKED if blockers else WeightVersionReadyReason.RELEASING
        ready_message = (
            f"release is blocked by {', '.join(blockers)}" if blockers else "released; waiting for the finalizer"
        )
    conditions = set_condition(conditions, READY, ready, ready_reason, ready_message, generation=generation, now=now)

    if deleting:
        phase = WeightVersionPhase.RELEASING
    elif ready:
        phase = WeightVersionPhase.READY
    elif ready_reason in PERMANENT_REASONS:
        phase = WeightVersionPhase.FAILED
    elif storage is None and chain.ok:
        phase = WeightVersionPhase.VERIFYING
    else:
        phase = WeightVersionPhase.PENDING

    status: dict[str, Any] = {
        "phase": str(phase),
        "conditions": conditions,
        "observedGeneration": generation,
        "chain": list(chain.chain) if chain.ok else current.get("chain"),
        "chainDepth": chain.depth if chain.ok else current.get("chainDepth"),
        "releaseBlockers": blockers or None,
    }
    if storage is not None and storage.ok:
        status["totalBytes"] = storage.total_bytes
        status["tensorCount"] = storage.tensor_count
        status["size"] = human_bytes(storage.total_bytes) if storage.total_bytes is not None else None
        status["indexDigest"] = storage.index_digest
    if ready:
        status["readyTime"] = current.get("readyTime") or now

    return VersionStatusPlan(status=status, became_ready=ready and previous.get(READY) != ConditionStatus.TRUE)


def release_blockers(
    dependent_versions: Iterable[str],
    desiring_modelloads: Iterable[str],
    leasing_replicas: Iterable[str],
    attached: Iterable[str] = (),
) -> list[str]:
    """Everything that must go before a deleted version may be released, named for `kubectl describe`; `attached`
    are `attachment_blockers` of replicas holding it for consumer pods."""
    return (
        [f"WeightVersion/{d}" for d in sorted(set(dependent_versions))]
        + [f"ModelLoad/{m}" for m in sorted(set(desiring_modelloads))]
        + [f"WeightReplica/{r}" for r in sorted(set(leasing_replicas))]
        + sorted(set(attached))
    )


def attachment_blockers(replica: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Per version a replica's consumers hold (`status.attachments`), its blockers: `attached: <ns>/<pod> on
    <node>`. A version a replica merely serves blocks nothing; one that a pod is attached to must stay."""
    node = (replica.get("spec") or {}).get("nodeName") or "?"
    found: dict[str, set[str]] = {}
    for entry in (replica.get("status") or {}).get("attachments") or []:
        found.setdefault(entry["version"], set()).add(f"attached: {entry['podNamespace']}/{entry['pod']} on {node}")
    return {version: tuple(sorted(names)) for version, names in found.items()}
