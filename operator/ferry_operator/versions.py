"""WeightVersion status, derived from the current objects alone (level-based), so any restart converges.

Pure: the kopf handlers feed in the object, a chain result and a storage report, and patch what comes out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ferry.api.conditions import find_condition, human_bytes, with_condition
from ferry.api.models import (
    ChainReason,
    ConditionStatus,
    StorageReason,
    WeightReplica,
    WeightVersion,
    WeightVersionConditionType,
    WeightVersionPhase,
    WeightVersionReadyReason,
    WeightVersionStatus,
    merge_patch,
)
from ferry.chain import ChainResult
from ferry.storage import StorageReport

STORAGE_REASONS = frozenset(StorageReason)

# Spec is immutable, so these can only be fixed by publishing a new version.
PERMANENT_REASONS = frozenset(
    {
        ChainReason.ChainCycle,
        ChainReason.ChainTooLong,
        ChainReason.ModelMismatch,
        ChainReason.LayoutMismatch,
        ChainReason.UnsupportedFormat,
        StorageReason.IndexInvalid,
        StorageReason.UriInvalid,
        StorageReason.SizeMismatch,
    }
)


@dataclass
class VersionStatusPlan:
    status: WeightVersionStatus
    became_ready: bool = False

    def differs_from(self, current: WeightVersionStatus | None) -> bool:
        return self.status != current

    def patch(self, current: WeightVersionStatus | None) -> dict[str, Any]:
        """The status subresource patch from `current` (as read) to the plan."""
        return merge_patch(current, self.status)


def storage_from_status(version: WeightVersion) -> StorageReport | None:
    """The verification outcome recorded for the version's generation, if any (None: never checked)."""
    status = version.status
    cond = find_condition(status.conditions, WeightVersionConditionType.STORAGE_VERIFIED) if status else None
    if cond is None or cond.status == ConditionStatus.UNKNOWN or cond.observedGeneration != version.metadata.generation:
        return None
    if cond.reason not in STORAGE_REASONS:  # an older operator's reason: verify again
        return None
    reason = StorageReason(cond.reason)
    ok = cond.status == ConditionStatus.TRUE
    return StorageReport(
        ok=ok,
        reason=reason,
        message=cond.message,
        transient=reason == StorageReason.EndpointUnreachable,
        total_bytes=status.totalBytes if ok else None,
        tensor_count=status.tensorCount if ok else None,
        index_digest=status.indexDigest if ok else None,
    )


def plan_version_status(
    version: WeightVersion,
    chain: ChainResult,
    storage: StorageReport | None,
    *,
    release_blockers: Iterable[str] = (),
    now: str,
) -> VersionStatusPlan:
    """The full desired status. `storage` None means not verified yet; a transient report keeps the last good
    StorageVerified=True (a flaky endpoint must not flap a Ready version)."""
    generation = version.metadata.generation
    current = version.status or WeightVersionStatus()
    conditions = current.conditions
    previous = {c.type: c.status for c in conditions}

    conditions = with_condition(
        conditions,
        WeightVersionConditionType.CHAIN_RESOLVED,
        chain.ok,
        chain.reason,
        chain.message,
        generation=generation,
        now=now,
    )

    kept_good = (
        storage is not None
        and storage.transient
        and previous.get(WeightVersionConditionType.STORAGE_VERIFIED) == ConditionStatus.TRUE
    )
    if storage is None:
        conditions = with_condition(
            conditions,
            WeightVersionConditionType.STORAGE_VERIFIED,
            ConditionStatus.UNKNOWN,
            StorageReason.VerificationPending,
            "checking the checkpoint objects in object storage",
            generation=generation,
            now=now,
        )
    elif not kept_good:
        conditions = with_condition(
            conditions,
            WeightVersionConditionType.STORAGE_VERIFIED,
            storage.ok,
            storage.reason,
            storage.message,
            generation=generation,
            now=now,
        )
    storage_ok = kept_good or (storage is not None and storage.ok)

    deleting = bool(version.metadata.deletionTimestamp)
    blockers = list(release_blockers)
    if chain.ok and storage_ok:
        ready_reason, ready_message = WeightVersionReadyReason.VERIFIED, f"{chain.message} Storage verified."
    elif not chain.ok:
        ready_reason, ready_message = str(chain.reason), chain.message
    elif storage is None:
        ready_reason, ready_message = StorageReason.VerificationPending, "waiting for storage verification"
    else:
        ready_reason, ready_message = str(storage.reason), storage.message
    ready = chain.ok and storage_ok and not deleting
    if deleting:
        ready_reason = WeightVersionReadyReason.RELEASE_BLOCKED if blockers else WeightVersionReadyReason.RELEASING
        ready_message = (
            f"release is blocked by {', '.join(blockers)}" if blockers else "released; waiting for the finalizer"
        )
    conditions = with_condition(
        conditions, WeightVersionConditionType.READY, ready, ready_reason, ready_message, generation=generation, now=now
    )

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

    # The fields not set here (a failed chain's last resolved one, the last verified sizes) are kept.
    update: dict[str, Any] = {
        "phase": str(phase),
        "conditions": conditions,
        "observedGeneration": generation,
        "releaseBlockers": blockers or None,
    }
    if chain.ok:
        update |= {"chain": list(chain.chain), "chainDepth": chain.depth}
    if storage is not None and storage.ok:
        update |= {
            "totalBytes": storage.total_bytes,
            "tensorCount": storage.tensor_count,
            "size": human_bytes(storage.total_bytes) if storage.total_bytes is not None else None,
            "indexDigest": storage.index_digest,
        }
    if ready:
        update["readyTime"] = current.readyTime or now
    return VersionStatusPlan(
        status=current.model_copy(update=update),
        became_ready=ready and previous.get(WeightVersionConditionType.READY) != ConditionStatus.TRUE,
    )


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


def attachment_blockers(replica: WeightReplica) -> dict[str, tuple[str, ...]]:
    """Per version a replica's consumers hold (`status.attachments`), its blockers: `attached: <ns>/<pod> on
    <node>`. A version a replica merely serves blocks nothing; one that a pod is attached to must stay."""
    node = replica.spec.nodeName or "?"
    found: dict[str, set[str]] = {}
    for entry in (replica.status.attachments if replica.status else None) or []:
        found.setdefault(entry.version, set()).add(f"attached: {entry.podNamespace}/{entry.pod} on {node}")
    return {version: tuple(sorted(names)) for version, names in found.items()}
