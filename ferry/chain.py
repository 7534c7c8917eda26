"""Replay-chain resolution for WeightVersions (ModelExpress §5.5 semantics, on Kubernetes objects).

A FullCheckpoint or PeerOnly version is its own chain. An XorDelta is replayed from a FullCheckpoint root
through its `baseVersion` links; the whole chain must be structurally sound before the direct base's readiness
is even considered, so that a permanent defect (a cycle, a model mismatch) is reported as such and not
masked by a transient one.

Pure: the caller supplies `lookup` (for example over a kopf index or an informer cache); no I/O here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ferry.api.conditions import find_condition
from ferry.api.models import (
    MAX_CHAIN_LENGTH,
    ChainReason,
    ConditionStatus,
    WeightFormat,
    WeightVersion,
    WeightVersionConditionType,
)


@dataclass(frozen=True)
class VersionView:
    """What chain resolution needs from one WeightVersion object."""

    name: str
    model_name: str
    format: str  # FullCheckpoint | XorDelta | PeerOnly; a str so that any value is reported, not a crash
    base_version: str | None
    layout_signature: str | None
    ready: bool
    deleting: bool
    has_storage: bool
    uid: str = ""  # metadata.uid: a deleted and republished name is another object
    namespace: str = ""
    created: str = ""  # metadata.creationTimestamp (RFC 3339, so it sorts as text): retention's publish order
    ready_time: str = ""  # status.readyTime
    storage_uri: str = ""

    @classmethod
    def of(cls, version: WeightVersion) -> VersionView:
        """From the typed object; `ready` = the status `Ready` condition is True."""
        meta, spec, status = version.metadata, version.spec, version.status
        ready = find_condition(status.conditions if status else None, WeightVersionConditionType.READY)
        storage_uri = spec.storage.uri if spec.storage else ""
        return cls(
            name=meta.name,
            model_name=spec.modelName,
            format=spec.format,
            base_version=spec.baseVersion or None,
            layout_signature=spec.layoutSignature or None,
            ready=ready is not None and ready.status == ConditionStatus.TRUE,
            deleting=bool(meta.deletionTimestamp),
            has_storage=bool(storage_uri),
            uid=meta.uid,
            namespace=meta.namespace,
            created=meta.creationTimestamp or "",
            ready_time=(status.readyTime if status else None) or "",
            storage_uri=storage_uri,
        )

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> VersionView:
        """From a Kubernetes object dict (or a kopf Body); raises `InvalidObject` on a spec that does not
        validate."""
        return cls.of(WeightVersion.from_body(body))


@dataclass(frozen=True)
class ChainResult:
    ok: bool
    reason: ChainReason
    message: str
    chain: tuple[str, ...] = ()  # root → self; () unless ok

    @property
    def depth(self) -> int:
        return len(self.chain)


def _fail(reason: ChainReason, message: str) -> ChainResult:
    return ChainResult(ok=False, reason=reason, message=message)


def _no_storage(name: str, fmt: str) -> str:
    # Replay downloads every link from object storage (ModelExpress: "no legal source").
    return f"{fmt} {name} has no spec.storage, so it cannot be replayed from object storage."


def _path(names: Iterable[str], limit: int = 8) -> str:
    """`a → b → c`, elided in the middle so a long cycle still fits a condition message."""
    items = list(names)
    if len(items) > limit:
        half = limit // 2
        items = [*items[:half], f"… ({len(items) - limit} more) …", *items[-half:]]
    return " → ".join(items)


def resolve_chain(
    name: str, lookup: Callable[[str], VersionView | None], max_length: int = MAX_CHAIN_LENGTH
) -> ChainResult:
    """Resolve the replay chain of WeightVersion `name`, root first.

    At most `max_length` lookups happen, so a very long or cyclic chain is cut off without an unbounded walk.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    target = lookup(name)
    if target is None:
        return _fail(ChainReason.BaseNotFound, f"WeightVersion {name} does not exist.")

    walked: list[VersionView] = [target]  # self → root while walking
    position = {target.name: 0}
    layout_owner = target if target.layout_signature else None
    current = target
    while True:
        if current.format == WeightFormat.FULL_CHECKPOINT:
            if current.base_version is not None:
                return _fail(
                    ChainReason.UnsupportedFormat,
                    f"FullCheckpoint {current.name} sets baseVersion {current.base_version}; "
                    "a full checkpoint must be the root of its chain.",
                )
            if current is not target and not current.has_storage:
                return _fail(ChainReason.UnsupportedFormat, _no_storage(current.name, "FullCheckpoint"))
            break
        if current.format == WeightFormat.PEER_ONLY:
            if current is target:
                break
            return _fail(
                ChainReason.UnsupportedFormat,
                f"{walked[-2].name} is a delta on {current.name}, which is PeerOnly and has no stored "
                "weights to replay from; a delta's base must be a FullCheckpoint or XorDelta.",
            )
        if current.format != WeightFormat.XOR_DELTA:
            return _fail(
                ChainReason.UnsupportedFormat,
                f"WeightVersion {current.name} has unsupported format {current.format!r}; "
                "expected FullCheckpoint, XorDelta or PeerOnly.",
            )
        if current.base_version is None:
            return _fail(ChainReason.UnsupportedFormat, f"XorDelta {current.name} has no baseVersion.")
        if not current.has_storage:
            return _fail(ChainReason.UnsupportedFormat, _no_storage(current.name, "XorDelta"))

        base_name = current.base_version
        if base_name in position:
            cycle = [v.name for v in walked[position[base_name] :]] + [base_name]
            return _fail(ChainReason.ChainCycle, f"The baseVersion links form a cycle: {_path(cycle)}.")
        if len(walked) >= max_length:
            # Adding the base would exceed the limit, and the root is still further away.
            return _fail(
                ChainReason.ChainTooLong,
                f"The replay chain of {name} has more than {max_length} versions "
                f"(gave up at {current.name} → {base_name}); "
                "publish a new FullCheckpoint to start a fresh chain.",
            )
        base = lookup(base_name)
        if base is None:
            where = "" if current is target else f", in the chain {_path([v.name for v in walked] + [base_name])}"
            return _fail(
                ChainReason.BaseNotFound,
                f"Base version {base_name} of {current.name} does not exist{where}.",
            )
        if base.model_name != target.model_name:
            return _fail(
                ChainReason.ModelMismatch,
                f"{name} is for model {target.model_name!r} but its chain includes {base.name}, "
                f"which is for model {base.model_name!r}.",
            )
        if base.layout_signature:
            if layout_owner is None:
                layout_owner = base
            elif base.layout_signature != layout_owner.layout_signature:
                return _fail(
                    ChainReason.LayoutMismatch,
                    f"The layoutSignature of {layout_owner.name} ({layout_owner.layout_signature!r}) differs "
                    f"from that of {base.name} ({base.layout_signature!r}); "
                    "a delta chain needs one parameter layout.",
                )
        position[base_name] = len(walked)
        walked.append(base)
        current = base

    if len(walked) > 1:
        direct = walked[1]
        if direct.deleting:
            return _fail(
                ChainReason.BaseNotReady,
                f"Base version {direct.name} is being released (deletionTimestamp is set); "
                "a delta cannot depend on it.",
            )
        if not direct.ready:
            return _fail(ChainReason.BaseNotReady, f"Base version {direct.name} is not Ready yet.")
    chain = tuple(v.name for v in reversed(walked))
    if len(chain) == 1:
        message = f"{name} is a {target.format} and needs no base."
    else:
        message = f"Replay chain of {len(chain)} versions: {_path(chain)}."
    return ChainResult(ok=True, reason=ChainReason.Resolved, message=message, chain=chain)


def dependents(name: str, all_views: Iterable[VersionView]) -> list[str]:
    """Names (sorted) of non-deleting versions whose baseVersion is `name`: they block releasing it."""
    return sorted(v.name for v in all_views if v.base_version == name and not v.deleting)
