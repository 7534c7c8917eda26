"""The source registry in CRDs: which WeightReplicas may a target read from, and how a loaded one is published.

Pure functions over Kubernetes object dicts, so the rules are unit-testable without a cluster:
a source is a Serving WeightReplica of the exact version (name, and WeightVersion uid when known), with a Ready
entry for the same rank and a live Lease; or a replica still loading that very version (`status.loadingRanks`,
`loadingVersionUid`), which serves the tensors it holds so far (pipelined fan-out). A loading replica has no Lease
yet: a dead one is found out by its worker service not answering.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from ferry.api.conditions import is_true
from ferry.api.liveness import DEFAULT_LEASE_SECONDS, lease_is_live
from ferry.api.models import (
    GROUP,
    LABEL_MODEL,
    LABEL_NODE,
    LABEL_VERSION,
    RankState,
    ReplicaPhase,
    WeightVersionConditionType,
)
from ferry.api.models import replica_lease_name as lease_name
from ferry_agent.strategies.candidate import SourceCandidate

__all__ = ["DEFAULT_LEASE_SECONDS", "LABEL_MODEL", "LABEL_NODE", "LABEL_VERSION", "lease_is_live", "lease_name"]


def source_candidates(
    replicas: Iterable[Mapping[str, Any]],
    leases: Mapping[str, Mapping[str, Any]],
    *,
    version: str,
    rank: int,
    self_replica: str,
    now: dt.datetime,
    world_size: int = 1,
    version_uid: str | None = None,
) -> list[SourceCandidate]:
    """Sources for one rank of `version`, from WeightReplica objects and Leases keyed by name. Only replicas
    with the same number of ranks qualify: rank r of a replica holds a share of the tensors that depends on it.
    With `version_uid`, only replicas that serve that very WeightVersion object (`status.versionUid`): a deleted
    and republished name is another version, whose old bytes must never be copied."""
    found = []
    for wr in replicas:
        name = wr["metadata"]["name"]
        status = wr.get("status") or {}
        if name == self_replica or wr["metadata"].get("deletionTimestamp"):
            continue
        if (wr.get("spec") or {}).get("ranks", 1) != world_size:
            continue
        if status.get("phase") != ReplicaPhase.SERVING or status.get("version") != version:
            continue
        if version_uid is not None and status.get("versionUid") != version_uid:
            continue
        if not lease_is_live(leases.get(lease_name(name)), now, node=(wr.get("spec") or {}).get("nodeName")):
            continue
        found += _rank_candidates(
            wr, status.get("ranks"), rank, RankState.READY, active_leases=status.get("activeLeases")
        )
    return found


def _rank_candidates(
    wr: Mapping[str, Any], entries: Iterable[Mapping[str, Any]] | None, rank: int, state: RankState, **extra: Any
) -> list[SourceCandidate]:
    """The source of `rank` among a replica's rank entries (`status.ranks` or `status.loadingRanks`) in `state`."""
    return [
        SourceCandidate(
            replica=wr["metadata"]["name"],
            rank=rank,
            agent_name=entry["agentName"],
            grpc_endpoint=entry["grpcEndpoint"],
            tensor_count=entry.get("tensorCount", 0),
            manifest_digest=entry.get("manifestDigest", ""),
            node=(wr.get("spec") or {}).get("nodeName") or "",
            **extra,
        )
        for entry in entries or ()
        if entry.get("rank") == rank and entry.get("state", RankState.READY) == state
    ]


def loading_version(status: Mapping[str, Any]) -> str | None:
    """The version a replica is loading: its `loadingVersion` (next to a served one), or its `version` while Loading."""
    if status.get("loadingVersion"):
        return status["loadingVersion"]
    return status.get("version") if status.get("phase") == ReplicaPhase.LOADING else None


def holder_candidates(
    replicas: Iterable[Mapping[str, Any]],
    *,
    version: str,
    rank: int,
    self_replica: str,
    world_size: int = 1,
    version_uid: str,
) -> list[SourceCandidate]:
    """Replicas still loading the very WeightVersion object `version_uid` of that name that serve what they hold
    of `rank` (`status.loadingRanks`)."""
    found = []
    for wr in replicas:
        name = wr["metadata"]["name"]
        status = wr.get("status") or {}
        spec = wr.get("spec") or {}
        if name == self_replica or wr["metadata"].get("deletionTimestamp") or spec.get("ranks", 1) != world_size:
            continue
        if loading_version(status) != version or status.get("loadingVersionUid") != version_uid:
            continue
        found += _rank_candidates(wr, status.get("loadingRanks"), rank, RankState.LOADING, loading=True)
    return found


def peer_version_problem(body: Mapping[str, Any] | None, *, name: str, model: str) -> str | None:
    """Why a target must not copy WeightVersion `name` (its object, or None if missing) from peers, or None.
    The agent checks this itself: the operator's retarget may lag a deleted, failed or republished version."""
    if body is None:
        return f"WeightVersion {name} does not exist"
    if (body.get("metadata") or {}).get("deletionTimestamp"):
        return f"WeightVersion {name} is being deleted"
    if (body.get("spec") or {}).get("modelName") != model:
        return f"WeightVersion {name} is for model {(body.get('spec') or {}).get('modelName')!r}, not {model!r}"
    if not is_true((body.get("status") or {}).get("conditions"), WeightVersionConditionType.READY):
        return f"WeightVersion {name} is not Ready"
    return None


def lease_body(
    replica: str, holder: str, now: str, duration: int = DEFAULT_LEASE_SECONDS, *, node: str
) -> dict[str, Any]:
    """The replica's liveness Lease. It carries the agent's node: the chart's admission policy lets an agent write
    only Leases labelled with the node its token is bound to."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": lease_name(replica), "labels": {f"{GROUP}/replica": replica, LABEL_NODE: node}},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration,
            "acquireTime": now,
            "renewTime": now,
        },
    }


def first_loader(
    replicas: Iterable[Mapping[str, Any]], *, version: str, self_replica: str, exclude: Collection[str] = ()
) -> str:
    """Among replicas assigned `version` that are not serving it yet (self included), the one that goes to object
    storage when no peer has it; the others wait for it and copy from it, so N cold replicas cost one S3 read.
    Deterministic (smallest name), so every agent agrees without talking. `exclude`: replicas a reader found dead
    (a loading replica has no Lease to say so), so that the next one takes over."""
    loading = {self_replica}
    for wr in replicas:
        status = wr.get("status") or {}
        if wr["metadata"].get("deletionTimestamp") or (wr.get("spec") or {}).get("version") != version:
            continue
        if wr["metadata"]["name"] in exclude:
            continue
        # A replica moving from an older version serves that one (make-before-break) while it loads this one.
        moving = status.get("phase") == ReplicaPhase.SERVING and status.get("version") != version
        if status.get("phase") in (None, ReplicaPhase.PENDING, ReplicaPhase.LOADING) or moving:
            loading.add(wr["metadata"]["name"])
    return min(loading)
