"""ModelLoad: choose nodes, plan the WeightReplicas, and aggregate their progress into conditions.

Pure functions over the typed ModelLoad (parsed once per reconcile), the object dicts of its replicas, their
Leases and the nodes (kopf index snapshots: parsing every replica of a large ModelLoad on each reconcile would cost
more than the few keys read here), and a clock, so scheduling, rollout and stall detection are unit-testable.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ferry.api.conditions import get_condition, set_condition, with_condition
from ferry.api.liveness import DEFAULT_LEASE_SECONDS, lease_is_live, lease_node, parse_time
from ferry.api.models import (
    API_VERSION,
    DEFAULT_MAX_UNAVAILABLE,
    LABEL_MODEL,
    LABEL_MODELLOAD,
    LABEL_NODE,
    LABEL_PLACEMENT,
    LABEL_VERSION,
    PLACEMENT_PODS,
    PLACEMENT_POOL,
    AttemptOutcome,
    DegradedReason,
    EnginesAttachedReason,
    LiveReason,
    ModelLoad,
    ModelLoadConditionType,
    ModelLoadPhase,
    ModelLoadReadyReason,
    ModelLoadSpec,
    ModelLoadStatus,
    PeerStalledReason,
    ProgressingReason,
    ReplicaConditionType,
    ReplicaPhase,
    ReplicaReason,
    RolloutStrategy,
    label_value,
    replica_lease_name,
)
from ferry.chain import VersionView


@dataclass(frozen=True)
class VersionProblem:
    """Why the desired WeightVersion cannot be placed (yet): a Ready=False reason and its message."""

    reason: str
    message: str


def version_problem(spec: ModelLoadSpec, version: VersionView | None) -> VersionProblem | None:
    """None when the desired version exists, is Ready and is of the ModelLoad's model; else the Ready=False
    reason, while which nothing is created or rolled out."""
    desired = spec.desiredVersion
    if version is None:
        return VersionProblem(ModelLoadReadyReason.VERSION_NOT_FOUND, f"WeightVersion {desired} does not exist")
    if version.model_name != spec.modelName:
        return VersionProblem(
            ModelLoadReadyReason.MODEL_MISMATCH,
            f"WeightVersion {desired} is of model {version.model_name!r}, but this ModelLoad serves "
            f"{spec.modelName!r}; no replica is created",
        )
    if not version.ready:
        return VersionProblem(
            ModelLoadReadyReason.VERSION_NOT_READY,
            f"WeightVersion {desired} is not Ready (see `kubectl describe wv {desired}`)",
        )
    return None


# ---------------------------------------------------------------- scheduling

REPLICA_HASH_CHARS = 10


def replica_name(modelload: str, node: str) -> str:
    """Deterministic, DNS-safe and collision-free: `<modelload>-<node>-<hash of the pair>`. The joined names alone
    collide (ModelLoad `a-b` on node `c`, `a` on node `b-c`); the hash tells such pairs apart. At most 63
    characters: the name is also a label value (`ferry.dev/replica` on its Lease)."""
    digest = hashlib.sha256(f"{modelload}/{node}".encode()).hexdigest()[:REPLICA_HASH_CHARS]
    prefix = f"{modelload}-{node}".lower()[: 63 - REPLICA_HASH_CHARS - 1].rstrip("-.")
    return f"{prefix}-{digest}"


def node_matches(node: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    return all(labels.get(k) == v for k, v in selector.items())


def choose_nodes(
    spec: ModelLoadSpec,
    nodes: Iterable[Mapping[str, Any]],
    current: Iterable[str],
    holders: Iterable[str],
    *,
    salt: str,
) -> list[str]:
    """Nodes for `spec.replicas` replicas. Current placements stay (no churn); new ones go first to nodes that
    already hold the desired version (a free, local source), then spread by a stable hash."""
    eligible = [n["metadata"]["name"] for n in nodes if node_matches(n, spec.nodeSelector)]
    eligible_set = set(eligible)
    wanted = spec.replicas
    keep = [n for n in current if n in eligible_set][:wanted]
    holding = set(holders)

    def preference(node: str) -> tuple[int, str]:
        return (0 if node in holding else 1, hashlib.sha256(f"{salt}/{node}".encode()).hexdigest())

    extra = sorted((n for n in eligible if n not in keep), key=preference)
    return keep + extra[: max(0, wanted - len(keep))]


# ---------------------------------------------------------------- weights follow pods

_FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class PodFacts:
    """What placement needs of a Pod: its labels, and the node it holds now (None: unbound, terminating or
    finished, so it needs no replica)."""

    name: str
    uid: str
    labels: Mapping[str, str]
    node: str | None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PodFacts:
        meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
        holds = not meta.get("deletionTimestamp") and status.get("phase") not in _FINISHED
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            labels=dict(meta.get("labels") or {}),
            node=(spec.get("nodeName") or None) if holds else None,
        )


def selector_matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics: every matchLabels pair and every requirement holds; `{}` matches all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for req in selector.get("matchExpressions") or []:
        key, op, values = req["key"], req["operator"], req.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }.get(op, False)  # an unknown operator matches nothing (the CRD admits none)
        if not ok:
            return False
    return True


def followed_nodes(selector: Mapping[str, Any] | None, pods: Iterable[PodFacts]) -> set[str]:
    """Nodes where a pod matching `selector` is bound now; None selector: none (the ModelLoad follows no pods)."""
    if selector is None:
        return set()
    return {p.node for p in pods if p.node and selector_matches(selector, p.labels)}


def attached(replica: Mapping[str, Any]) -> bool:
    """A consumer pod holds this replica's bytes, as its agent reports (`attachedPods`, `attachments`)."""
    status = replica.get("status") or {}
    return bool(status.get("attachedPods")) or bool(status.get("attachments"))


def placement(replica: Mapping[str, Any]) -> str:
    """Why the replica is kept; replicas from before the label are the warm pool's."""
    return ((replica.get("metadata") or {}).get("labels") or {}).get(LABEL_PLACEMENT) or PLACEMENT_POOL


def replica_body(modelload: ModelLoad, node: str, version: str, placement: str = PLACEMENT_POOL) -> dict[str, Any]:
    meta, spec = modelload.metadata, modelload.spec
    return {
        "apiVersion": API_VERSION,
        "kind": "WeightReplica",
        "metadata": {
            "name": replica_name(meta.name, node),
            "namespace": meta.namespace,
            "labels": {
                LABEL_MODEL: label_value(spec.modelName),
                LABEL_VERSION: label_value(version),
                LABEL_NODE: label_value(node),
                LABEL_MODELLOAD: label_value(meta.name),
                LABEL_PLACEMENT: placement,
            },
            "ownerReferences": [
                {
                    "apiVersion": API_VERSION,
                    "kind": "ModelLoad",
                    "name": meta.name,
                    "uid": meta.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "modelLoad": meta.name,
            "modelName": spec.modelName,
            "version": version,
            "nodeName": node,
            "ranks": spec.ranksPerReplica,
            "device": spec.device,
            "sourceOrder": list(spec.sourceOrder),
            "transfer": spec.transfer.model_dump(mode="json", exclude_none=True),
        },
    }


def retarget_ops(replica: Mapping[str, Any], version: str) -> list[dict[str, Any]]:
    """The JSON patch moving `replica` (as read) to `version`, tested on its uid and its spec.version as read: a
    retarget planned from an older read (a lagging index) is refused by the apiserver, so a replica a newer
    reconcile already moved on is never moved back."""
    label = "/metadata/labels/" + LABEL_VERSION.replace("~", "~0").replace("/", "~1")
    return [
        {"op": "test", "path": "/metadata/uid", "value": replica["metadata"]["uid"]},
        {"op": "test", "path": "/spec/version", "value": replica["spec"]["version"]},
        {"op": "replace", "path": "/spec/version", "value": version},
        {"op": "add", "path": label, "value": label_value(version)},
    ]


@dataclass
class ReplicaPlan:
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    retarget: list[str] = field(default_factory=list)  # replica names whose spec.version moves to desired
    relabel: dict[str, str] = field(default_factory=dict)  # replica name -> its new ferry.dev/placement
    held: list[str] = field(default_factory=list)  # not wanted any more, kept while a consumer is attached
    extra: int = 0  # replicas kept besides the warm pool (followed pods' nodes, held ones)


def max_unavailable(spec: ModelLoadSpec) -> int | None:
    """How many replicas a rollout may have moving or unavailable at once; None: no bound (Parallel). A percentage
    of spec.replicas rounds down, as a Deployment's maxUnavailable, but is at least 1 so every rollout progresses."""
    if spec.rollout.strategy == RolloutStrategy.PARALLEL:
        return None
    value = spec.rollout.maxUnavailable or DEFAULT_MAX_UNAVAILABLE
    if isinstance(value, str):
        value = int(value.removesuffix("%")) * spec.replicas // 100
    return max(1, int(value))


def available(replica: Mapping[str, Any], stale: Iterable[str] = ()) -> bool:
    """Serving some version (the old one, or the new) with a live Lease."""
    return _phase(replica) == ReplicaPhase.SERVING and replica["metadata"]["name"] not in set(stale)


def moving(replica: Mapping[str, Any], desired: str) -> bool:
    """Retargeted to `desired` and not yet serving it (its agent loads it, or is slow or down)."""
    return replica["spec"]["version"] == desired and not serves(replica, desired)


def rollout_moves(
    spec: ModelLoadSpec, kept: list[Mapping[str, Any]], holders: Iterable[str], stale: Iterable[str] = ()
) -> list[str]:
    """Which of the `kept` replicas (placed, not being deleted) move to spec.desiredVersion now. A replica that is
    moving or unavailable counts against the budget (`max_unavailable`): a moving one keeps serving its old version
    (make-before-break) unless its agent cannot, so counting it bounds the replicas that serve neither version
    whatever the agent does. A replica that serves nothing anyway moves at once: that costs no capacity."""
    desired = spec.desiredVersion
    stale = set(stale)
    behind = [r for r in kept if r["spec"]["version"] != desired]
    free = [r["metadata"]["name"] for r in behind if not available(r, stale)]
    serving = [r for r in behind if available(r, stale)]
    # Prefer a node that already holds the new version (a local source), then by name.
    holding = set(holders)
    serving.sort(key=lambda r: (r["spec"]["nodeName"] not in holding, r["metadata"]["name"]))
    limit = max_unavailable(spec)
    if limit is None:
        return sorted(free) + [r["metadata"]["name"] for r in serving]
    counted = sum(1 for r in kept if moving(r, desired) or not available(r, stale))
    return sorted(free) + [r["metadata"]["name"] for r in serving[: max(0, limit - counted)]]


def plan_replicas(
    modelload: ModelLoad,
    replicas: Iterable[Mapping[str, Any]],
    nodes: Iterable[Mapping[str, Any]],
    holders: Iterable[str],
    *,
    placeable: bool = True,
    pod_nodes: Iterable[str] | None = (),
    stale: Iterable[str] = (),
) -> ReplicaPlan:
    """What to create, delete and move to the desired version (`rollout_moves`; `stale`: replicas whose Lease is
    not live). While the desired version is not `placeable` (missing, not Ready, another model's) nothing is
    created or moved to it.

    The replicas kept are the union of the warm pool (`spec.replicas` nodes that match `spec.nodeSelector`,
    `choose_nodes`) and the known nodes in `pod_nodes` (where a pod the ModelLoad follows is bound); a replica
    neither wants is deleted only once no consumer is attached to it. `pod_nodes=None`: the pods are not known yet
    (the operator has not listed them since it started), so no replica kept for pods is deleted."""
    desired = modelload.spec.desiredVersion
    replicas = [r for r in replicas if not r["metadata"].get("deletionTimestamp")]
    by_node = {r["spec"]["nodeName"]: r for r in replicas}
    # The pool keeps its own replicas first; one kept for pods joins it only when the pool lacks a node.
    current = sorted(by_node, key=lambda n: placement(by_node[n]) == PLACEMENT_PODS)
    pool = choose_nodes(modelload.spec, nodes, current, holders, salt=modelload.metadata.name)
    known = {n["metadata"]["name"] for n in nodes}
    follow = {n for n in pod_nodes or () if n in known} - set(pool)
    unknown = pod_nodes is None
    held = {n for n, r in by_node.items() if n not in pool and n not in follow and attached(r)}
    waiting = {n for n, r in by_node.items() if unknown and placement(r) == PLACEMENT_PODS} - set(pool) - held
    chosen = pool + sorted(follow | held | waiting)
    plan = ReplicaPlan(extra=len(chosen) - len(pool))
    plan.delete = sorted(r["metadata"]["name"] for node, r in by_node.items() if node not in chosen)
    plan.held = sorted(by_node[n]["metadata"]["name"] for n in held)
    for node in chosen:
        if node in by_node and placement(by_node[node]) != (want := PLACEMENT_POOL if node in pool else PLACEMENT_PODS):
            plan.relabel[by_node[node]["metadata"]["name"]] = want
    if not placeable:
        return plan
    # Created in name order: an agent that sees its replica also sees every smaller-named one, so all agree on
    # which cold replica reads S3 first (ferry_agent.kube.registry.first_loader).
    plan.create = sorted(
        (
            replica_body(modelload, node, desired, PLACEMENT_POOL if node in pool else PLACEMENT_PODS)
            for node in chosen
            if node not in by_node
        ),
        key=lambda body: body["metadata"]["name"],
    )
    plan.retarget = rollout_moves(modelload.spec, [by_node[n] for n in chosen if n in by_node], holders, stale)
    return plan


def _phase(replica: Mapping[str, Any]) -> str:
    return (replica.get("status") or {}).get("phase") or ReplicaPhase.PENDING


def serves(replica: Mapping[str, Any], version: str, uid: str | None = None) -> bool:
    """Serving `version`; given `uid`, that very WeightVersion object (`status.versionUid`), not an older one of the
    same name that was deleted and republished."""
    status = replica.get("status") or {}
    if uid is not None and status.get("versionUid") != uid:
        return False
    return _phase(replica) == ReplicaPhase.SERVING and status.get("version") == version


def warm_label_changes(
    key: str, replicas: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]], stale: Iterable[str]
) -> dict[str, str | None]:
    """Node -> the value its label `key` (`warm_node_label`) gets, where that differs from what it carries: the
    version a replica there is Serving (not stale); None (remove the label) on a node where none is."""
    stale = set(stale)
    want = {
        r["spec"]["nodeName"]: label_value((r.get("status") or {})["version"])
        for r in replicas
        if not r["metadata"].get("deletionTimestamp")
        and _phase(r) == ReplicaPhase.SERVING
        and (r.get("status") or {}).get("version")
        and r["metadata"]["name"] not in stale
    }
    changes = {}
    for node in nodes:
        name = node["metadata"]["name"]
        if ((node["metadata"].get("labels") or {}).get(key)) != want.get(name):
            changes[name] = want.get(name)
    return changes


# ---------------------------------------------------------------- status


@dataclass(frozen=True)
class StalledReplica:
    replica: str
    source: str
    bytes_done: int
    bytes_total: int | None
    since: str
    seconds: float

    def message(self) -> str:
        total = f" of {self.bytes_total}" if self.bytes_total else ""
        return (
            f"replica {self.replica} made no progress loading from {self.source or 'an unknown source'} "
            f"for {self.seconds:.0f}s (since {self.since}); {self.bytes_done}{total} bytes done"
        )


def stalled_replicas(
    replicas: Iterable[Mapping[str, Any]], stall_seconds: float, now: dt.datetime
) -> list[StalledReplica]:
    found = []
    for r in replicas:
        status = r.get("status") or {}
        if status.get("phase") == ReplicaPhase.PENDING or not loading_now(r):
            continue
        since = status.get("lastProgressTime") or status.get("startedTime")
        last = parse_time(since)
        if last is None:
            continue
        idle = (now - last).total_seconds()
        if idle >= stall_seconds:
            found.append(
                StalledReplica(
                    replica=r["metadata"]["name"],
                    source=status.get("source") or "",
                    bytes_done=status.get("bytesDone") or 0,
                    bytes_total=status.get("bytesTotal"),
                    since=since,
                    seconds=idle,
                )
            )
    return found


def stall_deadline(replicas: Iterable[Mapping[str, Any]], stall_seconds: float, now: dt.datetime) -> dt.datetime | None:
    """When the next Loading replica that still progresses would count as stalled, if it makes no progress by
    then (None: no such replica). A stall is the absence of events, so this is the moment to look again."""
    times = []
    for r in replicas:
        status = r.get("status") or {}
        last = parse_time(status.get("lastProgressTime") or status.get("startedTime"))
        if status.get("phase") != ReplicaPhase.PENDING and loading_now(r) and last is not None:
            due = last + dt.timedelta(seconds=stall_seconds)
            if due > now:
                times.append(due)
    return min(times, default=None)


def loading_now(replica: Mapping[str, Any]) -> bool:
    """Loading a version: a first load, or a new version next to the served one (`status.loadingVersion`)."""
    status = replica.get("status") or {}
    return _phase(replica) in (ReplicaPhase.PENDING, ReplicaPhase.LOADING) or (
        bool(status.get("loadingVersion")) and not load_failed(replica)
    )


def load_failed(replica: Mapping[str, Any]) -> bool:
    """Failed, or failed to load its `loadingVersion` while still serving the old one (make-before-break)."""
    status = replica.get("status") or {}
    return _phase(replica) == ReplicaPhase.FAILED or bool(
        status.get("loadingVersion")
        and status.get("reason")
        in (ReplicaReason.LOAD_FAILED, ReplicaReason.MEMORY_BUDGET_EXCEEDED, ReplicaReason.RANKS_EXCEED_NODE)
    )


def fell_back(replica: Mapping[str, Any]) -> bool:
    """Loaded from object storage after a peer was tried and failed."""
    status = replica.get("status") or {}
    if status.get("source") != "s3":
        return False
    return any(
        a.get("source", "").startswith("peer/") and a.get("outcome") == AttemptOutcome.FAILED
        for a in status.get("attempts") or []
    )


@dataclass(frozen=True)
class Liveness:
    """A replica's `Live` condition, derived from its Lease alone."""

    live: bool
    reason: LiveReason
    message: str


def liveness(replica: Mapping[str, Any], leases: Mapping[str, Mapping[str, Any]], now: dt.datetime) -> Liveness:
    name = replica_lease_name(replica["metadata"]["name"])
    lease = leases.get(name)
    if lease is None:
        return Liveness(False, LiveReason.LEASE_MISSING, f"no Lease {name}")
    spec = lease.get("spec") or {}
    node = (replica.get("spec") or {}).get("nodeName")
    if lease_node(lease) != node:
        return Liveness(
            False, LiveReason.LEASE_OF_OTHER_NODE, f"Lease {name} is labelled for node {lease_node(lease)}, not {node}"
        )
    if lease_is_live(lease, now):
        return Liveness(True, LiveReason.LEASE_RENEWED, f"{spec.get('holderIdentity')} renews Lease {name}")
    return Liveness(
        False,
        LiveReason.LEASE_EXPIRED,
        f"Lease {name} not renewed for {spec.get('leaseDurationSeconds') or DEFAULT_LEASE_SECONDS}s "
        f"(last {spec.get('renewTime') or spec.get('acquireTime')} by {spec.get('holderIdentity')})",
    )


@dataclass(frozen=True)
class ForeignLease:
    """A replica's Lease that does not name the replica's node: its label says `node` (None: no label)."""

    replica: str
    replica_node: str
    lease: str
    uid: str
    node: str | None

    def message(self) -> str:
        found = f"labelled for node {self.node}" if self.node else f"without a {LABEL_NODE} label"
        return (
            f"deleted Lease {self.lease} of replica {self.replica}: {found}, but the replica is on node "
            f"{self.replica_node}; its agent writes it again"
        )


def foreign_leases(
    replicas: Iterable[Mapping[str, Any]], leases: Mapping[str, Mapping[str, Any]]
) -> list[ForeignLease]:
    """Leases that the operator deletes so that the replica's own agent can write its Lease: one labelled for
    another node (that node's agent may create any `ferry-wr-*` name labelled with its own node, and the admission
    policy then keeps the rightful agent from ever updating it), or one without the label (written by an agent
    older than it, which no agent may update under the policy)."""
    found = []
    for r in replicas:
        node = (r.get("spec") or {}).get("nodeName")
        name = replica_lease_name(r["metadata"]["name"])
        lease = leases.get(name)
        if lease is None or r["metadata"].get("deletionTimestamp") or not node or lease_node(lease) == node:
            continue
        uid = (lease.get("metadata") or {}).get("uid", "")
        found.append(ForeignLease(r["metadata"]["name"], node, name, uid, lease_node(lease)))
    return found


def stale_replicas(
    replicas: Iterable[Mapping[str, Any]], leases: Mapping[str, Mapping[str, Any]], now: dt.datetime
) -> list[str]:
    """Replicas that their agent says it serves, but whose Lease it does not renew. Level-based: derived from the
    Leases on every call and never recorded, so a replica whose Lease is renewed again is at once not stale."""
    return sorted(
        r["metadata"]["name"]
        for r in replicas
        if _phase(r) == ReplicaPhase.SERVING and not liveness(r, leases, now).live
    )


def renewal_time(lease: Mapping[str, Any]) -> dt.datetime | None:
    spec = lease.get("spec") or {}
    return parse_time(spec.get("renewTime") or spec.get("acquireTime"))


def renewed_after_expiry(previous: dt.datetime | None, lease: Mapping[str, Any]) -> bool:
    """Whether the Lease had expired between the renewal seen before (`previous`) and this one: its agent is back
    (it was frozen, or could not reach the apiserver)."""
    renewed = renewal_time(lease)
    duration = (lease.get("spec") or {}).get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS
    return previous is not None and renewed is not None and renewed - previous > dt.timedelta(seconds=duration)


def live_conditions(
    replicas: Iterable[Mapping[str, Any]], leases: Mapping[str, Mapping[str, Any]], now: dt.datetime, now_text: str
) -> dict[str, list[dict[str, Any]]]:
    """The replicas whose recorded `Live` condition differs from their Lease now: name → its new conditions.
    The operator writes only `status.conditions` of a WeightReplica; the agent owns every other field."""
    updates = {}
    for r in replicas:
        if r["metadata"].get("deletionTimestamp"):
            continue
        status = r.get("status") or {}
        now_live = liveness(r, leases, now)
        recorded = get_condition(status.get("conditions"), ReplicaConditionType.LIVE) or {}
        if (recorded.get("status"), recorded.get("reason")) == (str(now_live.live), now_live.reason):
            continue
        updates[r["metadata"]["name"]] = set_condition(
            status.get("conditions"),
            ReplicaConditionType.LIVE,
            now_live.live,
            now_live.reason,
            now_live.message,
            generation=r["metadata"].get("generation"),
            now=now_text,
        )
    return updates


@dataclass(frozen=True)
class Attached:
    """Consumer pods attached to a ModelLoad's replicas, from their `status.attachments`."""

    pods: int  # distinct pods, whatever version they hold
    on_desired: int  # of them, holding the desired version
    versions: tuple[str, ...]  # every version held
    uncounted: tuple[str, ...]  # stale replicas whose attachments are not counted (their agent is not renewing)

    def condition(self, desired: str) -> tuple[bool, EnginesAttachedReason, str]:
        """`EnginesAttached`: True while at least one pod holds the desired version."""
        stale = f"; not counted: the attachments of stale {', '.join(self.uncounted)}" if self.uncounted else ""
        if self.on_desired:
            others = self.pods - self.on_desired
            older = ", ".join(v for v in self.versions if v != desired)
            rest = f"; {others} attached only to {older}" if others else ""
            return True, EnginesAttachedReason.ATTACHED, f"{_pods(self.on_desired)} attached to {desired}{rest}{stale}"
        if self.pods:
            return (
                False,
                EnginesAttachedReason.ON_OLDER_VERSION,
                f"{_pods(self.pods)} attached, none to {desired} yet (they hold {', '.join(self.versions)}){stale}",
            )
        return False, EnginesAttachedReason.NO_ENGINES, f"no pod is attached to a replica of this ModelLoad{stale}"


def _pods(n: int) -> str:
    return f"{n} pod" if n == 1 else f"{n} pods"


def attached_pods(replicas: Iterable[Mapping[str, Any]], desired: str, stale: Iterable[str] = ()) -> Attached:
    """Distinct pods (by uid) over the replicas' attachments; a stale replica's are left out: its agent is gone or
    cut off, and its consumers' sockets with it."""
    stale = set(stale)
    pods: set[str] = set()
    on_desired: set[str] = set()
    versions: set[str] = set()
    uncounted = []
    for r in replicas:
        entries = (r.get("status") or {}).get("attachments") or []
        if r["metadata"]["name"] in stale:
            if entries:
                uncounted.append(r["metadata"]["name"])
            continue
        for entry in entries:
            pods.add(entry["podUid"])
            versions.add(entry["version"])
            if entry["version"] == desired:
                on_desired.add(entry["podUid"])
    return Attached(len(pods), len(on_desired), tuple(sorted(versions)), tuple(sorted(uncounted)))


def aggregate_status(
    modelload: ModelLoad,
    replicas: list[Mapping[str, Any]],
    leases: Mapping[str, Mapping[str, Any]],
    *,
    nodes_available: int,
    problem: VersionProblem | None = None,
    now: dt.datetime,
    now_text: str,
    version_uid: str | None = None,
    extra_replicas: int = 0,
) -> ModelLoadStatus:
    """The ModelLoad's status (all of it: the fields not set here are kept from the current one). With
    `version_uid` (the desired WeightVersion's metadata.uid), a replica is ready only while it serves that very
    object. `extra_replicas`: those kept besides the warm pool (`ReplicaPlan.extra`)."""
    spec = modelload.spec
    current = modelload.status or ModelLoadStatus()
    generation = modelload.metadata.generation
    desired = spec.desiredVersion
    pool = spec.replicas
    wanted = pool + extra_replicas
    stale = set(stale_replicas(replicas, leases, now))
    ready = [r for r in replicas if serves(r, desired, version_uid) and r["metadata"]["name"] not in stale]
    # Serving the name, but an older object of it (deleted and republished): not ready, whatever phase and name say.
    outdated = sorted(
        r["metadata"]["name"] for r in replicas if serves(r, desired) and not serves(r, desired, version_uid)
    )
    failed = [r for r in replicas if load_failed(r)]
    loading = [r for r in replicas if loading_now(r)]
    behind = [r for r in replicas if r["spec"]["version"] != desired]
    stalled = stalled_replicas(replicas, stall_seconds(spec), now)
    fallbacks = [r["metadata"]["name"] for r in replicas if fell_back(r)]

    conds = current.conditions

    def put(type_: str, ok: bool, reason: str, message: str) -> None:
        nonlocal conds
        conds = with_condition(conds, type_, ok, reason, message, generation=generation, now=now_text)

    all_ready = len(ready) >= wanted and not behind
    if all_ready:
        put(
            ModelLoadConditionType.READY,
            True,
            ModelLoadReadyReason.ALL_REPLICAS_READY,
            f"{len(ready)}/{wanted} replicas serve {desired}",
        )
    elif problem:
        put(ModelLoadConditionType.READY, False, problem.reason, problem.message)
    elif pool > nodes_available:
        put(
            ModelLoadConditionType.READY,
            False,
            ModelLoadReadyReason.INSUFFICIENT_NODES,
            f"{pool} replicas requested but only {nodes_available} nodes match spec.nodeSelector",
        )
    elif failed:
        r = failed[0]
        put(
            ModelLoadConditionType.READY,
            False,
            ModelLoadReadyReason.REPLICA_FAILED,
            f"{r['metadata']['name']}: {(r.get('status') or {}).get('message', '')}",
        )
    else:
        older = f"; {', '.join(outdated)} serve an older WeightVersion named {desired}" if outdated else ""
        put(
            ModelLoadConditionType.READY,
            False,
            ModelLoadReadyReason.REPLICAS_NOT_READY,
            f"{len(ready)}/{wanted} replicas serve {desired}{older}",
        )

    if behind or loading:
        reason = ProgressingReason.ROLLING_OUT if behind else ProgressingReason.LOADING
        names = ", ".join(sorted(r["metadata"]["name"] for r in (behind or loading))[:5])
        put(
            ModelLoadConditionType.PROGRESSING,
            True,
            reason,
            f"{len(loading)} loading, {len(behind)} still on an older version ({names})",
        )
    else:
        idle = ProgressingReason.COMPLETE if all_ready else ProgressingReason.IDLE
        put(ModelLoadConditionType.PROGRESSING, False, idle, "no replica is loading")

    problems = []
    if failed:
        problems.append(
            (DegradedReason.REPLICA_FAILED, f"failed: {', '.join(sorted(r['metadata']['name'] for r in failed))}")
        )
    if stale:
        problems.append((DegradedReason.REPLICA_STALE, f"lease expired: {', '.join(sorted(stale))}"))
    if fallbacks:
        problems.append(
            (
                DegradedReason.FELL_BACK_TO_OBJECT_STORAGE,
                f"peers failed, loaded from S3: {', '.join(sorted(fallbacks))}",
            )
        )
    if pool > nodes_available:
        problems.append(
            (
                DegradedReason.INSUFFICIENT_NODES,
                f"{pool - nodes_available} of {pool} replicas have no node: {nodes_available} match spec.nodeSelector",
            )
        )
    if problems:
        put(ModelLoadConditionType.DEGRADED, True, problems[0][0], "; ".join(m for _, m in problems))
    else:
        put(
            ModelLoadConditionType.DEGRADED,
            False,
            DegradedReason.AS_EXPECTED,
            "no failed, stale or fallen-back replicas",
        )

    if stalled:
        put(
            ModelLoadConditionType.PEER_STALLED,
            True,
            PeerStalledReason.NO_PROGRESS,
            "; ".join(s.message() for s in stalled),
        )
    else:
        put(ModelLoadConditionType.PEER_STALLED, False, PeerStalledReason.NOT_STALLED, "no replica is stalled")

    attached = attached_pods(replicas, desired, stale)
    engines, engines_reason, engines_message = attached.condition(desired)
    put(ModelLoadConditionType.ENGINES_ATTACHED, engines, str(engines_reason), engines_message)

    if all_ready:
        phase = ModelLoadPhase.READY
    elif failed or stale:
        phase = ModelLoadPhase.DEGRADED
    elif loading or behind:
        phase = ModelLoadPhase.PROGRESSING
    elif ready:  # some serve, and nothing is on its way for the rest (too few nodes, say)
        phase = ModelLoadPhase.DEGRADED
    else:
        phase = ModelLoadPhase.PENDING
    update: dict[str, Any] = {
        "phase": str(phase),
        "replicas": wanted,
        "readyReplicas": len(ready),
        "ready": f"{len(ready)}/{wanted}",
        "attachedPods": attached.pods,
        "conditions": conds,
        "observedGeneration": generation,
    }
    if all_ready:
        update["loadedVersion"] = desired
    return current.model_copy(update=update)


# ---------------------------------------------------------------- what a reconcile gathers from the indexes


def holders(serving: Iterable[Mapping[str, Any]], desired: str, uid: str | None) -> set[str]:
    """Nodes whose replica (of any ModelLoad) serves that very desired version: free, local sources."""
    return {r["spec"]["nodeName"] for r in serving if serves(r, desired, uid)}


def replica_leases(
    replicas: Iterable[Mapping[str, Any]], lookup: Callable[[str], Iterable[Mapping[str, Any]]]
) -> dict[str, Mapping[str, Any]]:
    """The replicas' Leases by name; `lookup` gives the Leases of one name (none, or one)."""
    return {
        lease_name: lease
        for r in replicas
        for lease_name in [replica_lease_name(r["metadata"]["name"])]
        for lease in lookup(lease_name)
    }


def matching_nodes(nodes: Iterable[Mapping[str, Any]], spec: ModelLoadSpec) -> int:
    """How many nodes the ModelLoad's `spec.nodeSelector` admits."""
    return sum(1 for n in nodes if node_matches(n, spec.nodeSelector))


def stall_seconds(spec: ModelLoadSpec) -> float:
    return float(spec.transfer.stallSeconds)
