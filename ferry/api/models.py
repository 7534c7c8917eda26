"""The ferry.dev/v1alpha1 API. These pydantic models are the source of truth; `make crds` renders the CRDs."""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum
from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

GROUP = "ferry.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "ferry"
MAX_CHAIN_LENGTH = 64
MAX_ATTACHMENTS = 1024  # entries of a WeightReplica's status.attachments

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
S3_INDEX_URI = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/([^/]+/)*[^/]+\.index\.json$"
HTTP_ENDPOINT = r"^https?://[^\s/]+(:[0-9]+)?/?$"
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
# Label keys and values as Kubernetes validates them: [prefix/]name, prefix a DNS subdomain of at most 253
# characters, name and value at most 63 alphanumerics with -_. inside (a value may be empty).
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY = rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{LABEL_NAME}$"
LabelValue = Annotated[str, Field(max_length=63, pattern=rf"^({LABEL_NAME})?$")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_enum_values=True)


class CelRule(_Model):
    """One `x-kubernetes-validations` entry."""

    rule: str
    message: str
    reason: str | None = None
    fieldPath: str | None = None


# ---------------------------------------------------------------- shared parts


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Model):
    """metav1.Condition, as the Kubernetes API conventions define it."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    status: ConditionStatus
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON)
    message: str = Field(default="", max_length=32768)
    observedGeneration: int | None = Field(default=None, ge=0)
    lastTransitionTime: str = Field(json_schema_extra={"format": "date-time"})


Conditions = Annotated[
    list[Condition],
    Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    ),
]


class SourceKind(StrEnum):
    PEER = "Peer"
    OBJECT_STORAGE = "ObjectStorage"


class SelectorKind(StrEnum):
    RENDEZVOUS_HASH = "rendezvousHash"
    RANDOM = "random"
    LOAD_AWARE = "loadAware"


class Device(StrEnum):
    CUDA = "cuda"
    CPU = "cpu"


class TransferSpec(_Model):
    timeoutSeconds: int = Field(default=300, ge=1, le=86400, description="Per-candidate transfer timeout.")
    maxSourceAttempts: int = Field(default=3, ge=1, le=16, description="Peers tried before falling back.")
    selector: SelectorKind = SelectorKind.RENDEZVOUS_HASH
    stallSeconds: int = Field(default=60, ge=1, le=86400, description="No progress for this long is a stall.")
    rpcRetries: int = Field(
        default=3,
        ge=0,
        le=10,
        description="Retries of a read-lease RPC (PrepareTensorRead/ReleaseTensorRead) that failed with a transient "
        "error (UNAVAILABLE), before the source counts as failed.",
    )
    rpcBackoffSeconds: float = Field(
        default=0.5,
        ge=0,
        le=30,
        description="Wait before the first lease RPC retry; each further retry waits twice as long.",
    )


# ---------------------------------------------------------------- WeightVersion


class WeightFormat(StrEnum):
    FULL_CHECKPOINT = "FullCheckpoint"
    XOR_DELTA = "XorDelta"
    PEER_ONLY = "PeerOnly"


class StorageLocation(_Model):
    uri: str = Field(
        max_length=2048,
        pattern=S3_INDEX_URI,
        description="s3://bucket/key/model.safetensors.index.json; shards live beside the index.",
    )
    endpoint: str | None = Field(default=None, max_length=512, pattern=HTTP_ENDPOINT)
    region: str | None = Field(default=None, max_length=64)
    credentialsSecret: ObjectName | None = Field(
        default=None, description="Secret in the same namespace with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."
    )


class WeightVersionSpec(_Model):
    cel_rules: ClassVar[list[CelRule]] = [
        CelRule(rule="self == oldSelf", message="spec is immutable: publish a new WeightVersion instead"),
        CelRule(
            rule="self.format != 'XorDelta' || has(self.baseVersion)",
            message="an XorDelta needs spec.baseVersion",
            reason="FieldValueRequired",
            fieldPath=".baseVersion",
        ),
        CelRule(
            rule="self.format == 'XorDelta' || !has(self.baseVersion)",
            message="only an XorDelta may set spec.baseVersion",
            reason="FieldValueForbidden",
            fieldPath=".baseVersion",
        ),
        CelRule(
            rule="self.format == 'PeerOnly' || has(self.storage)",
            message="FullCheckpoint and XorDelta need spec.storage",
            reason="FieldValueRequired",
            fieldPath=".storage",
        ),
    ]

    modelName: str = Field(min_length=1, max_length=253)
    format: WeightFormat
    baseVersion: ObjectName | None = Field(default=None, description="WeightVersion this delta applies to.")
    storage: StorageLocation | None = None
    layoutSignature: str | None = Field(default=None, max_length=256)


class WeightVersionPhase(StrEnum):
    PENDING = "Pending"
    VERIFYING = "Verifying"
    READY = "Ready"
    FAILED = "Failed"
    RELEASING = "Releasing"


class WeightVersionStatus(_Model):
    phase: WeightVersionPhase | None = None
    conditions: Conditions
    observedGeneration: int | None = Field(default=None, ge=0)
    chain: list[str] | None = Field(default=None, max_length=MAX_CHAIN_LENGTH, description="Root to self.")
    chainDepth: int | None = Field(default=None, ge=0, le=MAX_CHAIN_LENGTH)
    totalBytes: int | None = Field(default=None, ge=0, json_schema_extra={"format": "int64"})
    size: str | None = Field(default=None, max_length=32, description="totalBytes for humans, e.g. 1.5Gi.")
    tensorCount: int | None = Field(default=None, ge=0)
    indexDigest: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 (hex) of the index object the operator verified; agents load only an index with this "
        "digest and use a stored copy only if it was written from it.",
    )
    readyTime: str | None = None
    holders: int | None = Field(default=None, ge=0)
    releaseBlockers: list[str] | None = Field(default=None, description="What keeps a deleted version alive.")


class WeightVersion(_Model):
    kind: ClassVar[str] = "WeightVersion"
    plural: ClassVar[str] = "weightversions"
    short_names: ClassVar[list[str]] = ["wv"]
    cel_rules: ClassVar[list[CelRule]] = [
        CelRule(
            rule="!has(self.spec.baseVersion) || self.spec.baseVersion != self.metadata.name",
            message="a WeightVersion cannot be its own base",
            reason="FieldValueInvalid",
            fieldPath=".spec.baseVersion",
        )
    ]
    printer_columns: ClassVar[list[dict]] = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Model", "type": "string", "jsonPath": ".spec.modelName"},
        {"name": "Base", "type": "string", "jsonPath": ".spec.baseVersion"},
        {"name": "Depth", "type": "integer", "jsonPath": ".status.chainDepth"},
        {"name": "Size", "type": "string", "jsonPath": ".status.size"},
        {
            "name": "Reason",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: WeightVersionSpec
    status: WeightVersionStatus | None = None


# ---------------------------------------------------------------- ModelLoad


class RetentionPolicy(_Model):
    """Which WeightVersions of the ModelLoad's model the operator deletes (docs/retention.md)."""

    keepLast: int = Field(
        ge=1,
        le=4096,
        description="Keep the newest N Ready WeightVersions of spec.modelName in this namespace (newest by "
        "creation); delete older Ready ones unless a ModelLoad desires them, a replica holds them, or a kept or "
        "held version replays from them. Several ModelLoads of one model: the largest keepLast wins.",
    )
    deleteStorage: bool = Field(
        default=False,
        description="Also delete a retired version's objects (its index and the shards it names) once it is "
        "released, with its spec.storage.credentialsSecret (which then needs s3:DeleteObject). Several "
        "ModelLoads of one model: only if every policy says so.",
    )


class RetentionReason(StrEnum):
    """Reasons of the Events retention posts (there is no condition: every deletion is an Event)."""

    VERSION_RETIRED = "VersionRetired"  # Normal, on the ModelLoad: it deleted the named WeightVersion
    RETIREMENT_FAILED = "RetirementFailed"  # Warning, on the ModelLoad: the delete was refused (e.g. RBAC)
    STORAGE_DELETED = "StorageDeleted"  # Normal, on the WeightVersion: its objects are gone as it is released
    STORAGE_NOT_DELETED = "StorageNotDeleted"  # Warning, on the WeightVersion: objects left; the message says why


class EnginesAttachedReason(StrEnum):
    """Reasons of the ModelLoad's `EnginesAttached` condition (docs/conditions.md)."""

    ATTACHED = "Attached"  # True: at least one consumer pod holds the desired version on a live replica
    ON_OLDER_VERSION = "EnginesOnOlderVersion"  # False: pods are attached, but none holds the desired version yet
    NO_ENGINES = "NoEngines"  # False: no consumer pod is attached to a live replica


class SelectorOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(_Model):
    """metav1.LabelSelectorRequirement: `key` `operator` `values`."""

    cel_rules: ClassVar[list[CelRule]] = [
        CelRule(
            rule="(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
            message="In and NotIn need values; Exists and DoesNotExist take none",
            reason="FieldValueInvalid",
            fieldPath=".values",
        ),
    ]

    key: str = Field(
        min_length=1,
        max_length=317,
        pattern=LABEL_KEY,
        description="The label key the requirement applies to ([prefix/]name).",
    )
    operator: SelectorOperator = Field(
        description="In: the label's value is one of values; NotIn: it is none of them (or the label is absent); "
        "Exists / DoesNotExist: the pod has / lacks the label."
    )
    values: list[LabelValue] | None = Field(
        default=None, max_length=64, description="Label values; only with In and NotIn, and then at least one."
    )


class LabelSelector(_Model):
    """metav1.LabelSelector. Every requirement must hold (AND); an empty selector matches every pod."""

    matchLabels: dict[str, LabelValue] = Field(
        default_factory=dict,
        max_length=64,
        description="Labels a pod must carry with exactly these values.",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, k.matches('{LABEL_KEY}') && (!k.contains('/') || k.indexOf('/') <= 253))",
                    "message": "every matchLabels key must be a valid label key ([prefix/]name)",
                    "reason": "FieldValueInvalid",
                }
            ]
        },
    )
    matchExpressions: list[LabelSelectorRequirement] = Field(
        default_factory=list, max_length=64, description="Set-based requirements, all of which must hold."
    )


class RolloutStrategy(StrEnum):
    PARALLEL = "Parallel"  # every replica moves at once (each keeps serving its old version until the new is resident)
    ROLLING = "Rolling"  # at most `maxUnavailable` replicas move at a time


# A count or a percentage of spec.replicas, as a Deployment's maxUnavailable.
INT_OR_PERCENT = r"^(100|[1-9]?[0-9])%$"


def _int_or_percent(schema: dict) -> None:
    """The schema of a Kubernetes IntOrString of at least 1 (or 1%): no anyOf, which a structural schema forbids."""
    schema.pop("anyOf", None)
    schema["x-kubernetes-int-or-string"] = True
    schema["x-kubernetes-validations"] = [
        {
            "rule": f"type(self) == int ? self >= 1 : self.matches('{INT_OR_PERCENT}') && self != '0%'",
            "message": "must be an integer >= 1 or a percentage such as 25%",
            "reason": "FieldValueInvalid",
        }
    ]


class RolloutSpec(_Model):
    """How the operator moves the replicas to a new desiredVersion (docs/architecture.md, Rollouts)."""

    cel_rules: ClassVar[list[CelRule]] = [
        CelRule(
            rule="self.strategy == 'Rolling' || !has(self.maxUnavailable)",
            message="maxUnavailable applies to the Rolling strategy only",
            reason="FieldValueForbidden",
            fieldPath=".maxUnavailable",
        ),
    ]

    strategy: RolloutStrategy = Field(
        default=RolloutStrategy.ROLLING,
        description="Parallel: every replica moves to the new version at once. Rolling: at most maxUnavailable "
        "replicas move at a time. Either way a moving replica keeps serving its old version (to peers and attached "
        "pods) until the new one is resident (make-before-break), so a Parallel rollout loses no capacity; it "
        "holds both versions' bytes on every node meanwhile.",
    )
    maxUnavailable: int | str | None = Field(
        default=None,
        description="Rolling only: how many replicas may be moving (retargeted, not yet serving the new version) "
        "or unavailable (serving nothing) at once; an integer >= 1 or a percentage of spec.replicas (rounded down, "
        "at least 1). Unset: 25%. A moving replica still serves its old version, so the replicas that serve "
        "neither version never exceed it.",
        json_schema_extra=lambda schema: _int_or_percent(schema),
    )

    @field_validator("maxUnavailable")
    @classmethod
    def _budget(cls, value: int | str | None) -> int | str | None:
        if value is None or (isinstance(value, int) and value >= 1):
            return value
        if isinstance(value, str) and re.match(INT_OR_PERCENT, value) and value != "0%":
            return value
        raise ValueError("must be an integer >= 1 or a percentage such as 25%")


DEFAULT_MAX_UNAVAILABLE = "25%"


class ModelLoadSpec(_Model):
    modelName: str = Field(min_length=1, max_length=253)
    desiredVersion: ObjectName = Field(description="Name of the WeightVersion to make resident.")
    nodeSelector: dict[str, LabelValue] = Field(
        default_factory=dict,
        max_length=64,
        description="Node labels a node must carry to hold a replica (keys and values are validated as labels).",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(k, k.matches('{LABEL_KEY}') && (!k.contains('/') || k.indexOf('/') <= 253))",
                    "message": "every nodeSelector key must be a valid label key ([prefix/]name)",
                    "reason": "FieldValueInvalid",
                }
            ]
        },
    )
    replicas: int = Field(default=1, ge=0, le=4096)
    ranksPerReplica: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Processes (one per GPU) of one node that together hold a replica; each holds its share of the "
        "tensors and copies it from the same rank of a peer (docs/ranks.md).",
    )
    device: Device = Device.CUDA
    sourceOrder: list[SourceKind] = Field(
        default_factory=lambda: [SourceKind.PEER, SourceKind.OBJECT_STORAGE],
        min_length=1,
        max_length=2,
        json_schema_extra={"x-kubernetes-list-type": "set", "default": ["Peer", "ObjectStorage"]},
    )
    # `{}` lets the apiserver fill the nested defaults.
    transfer: TransferSpec = Field(default_factory=TransferSpec, json_schema_extra={"default": {}})
    retention: RetentionPolicy | None = Field(
        default=None, description="Delete old WeightVersions of this model; unset: the operator deletes none."
    )
    podSelector: LabelSelector | None = Field(
        default=None,
        description="Weights follow pods: every node where a Pod of this namespace matching the selector is bound "
        "(spec.nodeName set, not terminating, not Succeeded or Failed) holds a replica too, in addition to the "
        "`replicas` warm pool on nodeSelector nodes (docs/consumers.md). A node whose matching pods are gone "
        "keeps its replica while any consumer is still attached. Unset: the warm pool alone.",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How replicas move to a new desiredVersion; unset: Rolling with maxUnavailable 25%.",
        json_schema_extra={"default": {}},
    )


class ModelLoadStatus(_Model):
    phase: str | None = Field(default=None, max_length=64)
    replicas: int | None = Field(default=None, ge=0)
    readyReplicas: int | None = Field(default=None, ge=0)
    ready: str | None = Field(default=None, max_length=32, description="readyReplicas/replicas, for kubectl.")
    loadedVersion: str | None = None
    attachedPods: int | None = Field(
        default=None,
        ge=0,
        description="Consumer pods attached to this ModelLoad's live replicas (any version they hold), over all nodes.",
    )
    warmNodeLabel: str | None = Field(
        default=None,
        max_length=317,
        description="The node label key the operator sets, to the version served, on every node where a replica "
        "of this ModelLoad is Serving: engine pods may prefer such nodes (preferred node affinity, "
        "docs/consumers.md).",
    )
    conditions: Conditions
    observedGeneration: int | None = Field(default=None, ge=0)


class ModelLoad(_Model):
    kind: ClassVar[str] = "ModelLoad"
    plural: ClassVar[str] = "modelloads"
    short_names: ClassVar[list[str]] = ["ml"]
    cel_rules: ClassVar[list[CelRule]] = []
    printer_columns: ClassVar[list[dict]] = [
        {"name": "Model", "type": "string", "jsonPath": ".spec.modelName"},
        {"name": "Desired", "type": "string", "jsonPath": ".spec.desiredVersion"},
        {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Attached", "type": "integer", "jsonPath": ".status.attachedPods"},
        {"name": "Loaded", "type": "string", "jsonPath": ".status.loadedVersion", "priority": 1},
        {
            "name": "Reason",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
            "priority": 1,
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: ModelLoadSpec
    status: ModelLoadStatus | None = None


# ---------------------------------------------------------------- WeightReplica


class WeightReplicaSpec(_Model):
    cel_rules: ClassVar[list[CelRule]] = [
        CelRule(rule="self.nodeName == oldSelf.nodeName", message="spec.nodeName is immutable"),
    ]

    modelLoad: ObjectName
    modelName: str = Field(min_length=1, max_length=253)
    version: ObjectName
    nodeName: ObjectName
    ranks: int = Field(default=1, ge=1, le=1024, description="The ModelLoad's ranksPerReplica.")
    device: Device = Device.CUDA
    sourceOrder: list[SourceKind] = Field(
        default_factory=lambda: [SourceKind.PEER, SourceKind.OBJECT_STORAGE],
        min_length=1,
        max_length=2,
        json_schema_extra={"x-kubernetes-list-type": "set", "default": ["Peer", "ObjectStorage"]},
    )
    # `{}` lets the apiserver fill the nested defaults.
    transfer: TransferSpec = Field(default_factory=TransferSpec, json_schema_extra={"default": {}})


class ReplicaPhase(StrEnum):
    PENDING = "Pending"
    LOADING = "Loading"
    LOADED = "Loaded"
    SERVING = "Serving"
    FAILED = "Failed"


class ReplicaConditionType(StrEnum):
    """WeightReplica `status.conditions`, written by the operator alone (the agent writes the other fields)."""

    LIVE = "Live"  # the agent renews the replica's Lease; re-derived from the Lease on every reconcile


class LiveReason(StrEnum):
    LEASE_RENEWED = "LeaseRenewed"  # True: renewed within its leaseDurationSeconds
    LEASE_EXPIRED = "LeaseExpired"  # False: not renewed within its leaseDurationSeconds
    LEASE_MISSING = "LeaseMissing"  # False: no Lease (the agent takes it once the replica is loaded)
    LEASE_OF_OTHER_NODE = "LeaseOfOtherNode"  # False: the Lease's ferry.dev/node is not the replica's spec.nodeName


class ReplicaReason(StrEnum):
    """Why a WeightReplica is Failed (`status.reason`), or why loading its `loadingVersion` failed while it still
    serves the old version (phase Serving); empty otherwise."""

    LOAD_FAILED = "LoadFailed"  # every source of the chain failed; `message` names each failure
    RANK_EXITED = "RankExited"  # a rank process of a loaded replica died; the agent reloads it
    MEMORY_BUDGET_EXCEEDED = "MemoryBudgetExceeded"  # the version does not fit the agent's --host-memory-budget


class AttemptOutcome(StrEnum):
    LOADED = "Loaded"
    FAILED = "Failed"
    SKIPPED = "Skipped"


class LoadAttempt(_Model):
    source: str = Field(max_length=512)
    outcome: AttemptOutcome
    reason: str = Field(default="", max_length=128)
    message: str = Field(default="", max_length=4096)
    time: str | None = None


class RankState(StrEnum):
    READY = "Ready"
    DRAINING = "Draining"


class RankEndpoint(_Model):
    rank: int = Field(ge=0)
    agentName: str = Field(max_length=253)
    metadataEndpoint: str = Field(default="", max_length=512)
    grpcEndpoint: str = Field(max_length=512)
    tensorCount: int = Field(ge=0)
    manifestDigest: str = Field(max_length=128)
    state: RankState = RankState.READY


class Attachment(_Model):
    """A consumer pod that holds this replica's bytes through the node's attach socket (a lease per connection)."""

    pod: ObjectName = Field(description="Name of the consumer Pod.")
    podNamespace: ObjectName = Field(description="Namespace of the consumer Pod.")
    podUid: str = Field(max_length=128, description="uid of the consumer Pod; its socket is pods/<uid>/ferry.sock.")
    version: ObjectName = Field(description="WeightVersion the pod holds; during a refit a pod may hold two.")
    rank: int | None = Field(default=None, ge=0, description="Rank share held; empty when the pod holds all shares.")
    since: str | None = Field(default=None, description="When the lease was taken (RFC 3339).")


class WeightReplicaStatus(_Model):
    phase: ReplicaPhase | None = Field(
        default=None,
        description="Written by the node agent alone. Whether the agent is alive is its Lease's to say (the `Live` "
        "condition), not a phase's.",
    )
    version: str | None = Field(
        default=None,
        description="The version this replica serves (phase Serving), or loads or failed to load when it serves none.",
    )
    loadingVersion: str | None = Field(
        default=None,
        description="A version change in flight (make-before-break): the version the agent loads while it keeps "
        "serving `version` to peers and attached pods; once resident it becomes `version` and this clears. While "
        "set, bytesDone, bytesTotal, source, startedTime, lastProgressTime and attempts describe this load (ranks, "
        "versionUid and activeLeases the served version); reason LoadFailed says its last attempt failed (retried "
        "with backoff, the old version still served).",
    )
    versionUid: str | None = Field(
        default=None,
        max_length=128,
        description="uid of the WeightVersion object the served bytes came from; peers copy only from replicas "
        "of the same uid, so a deleted and republished name never serves old bytes.",
    )
    source: str | None = Field(default=None, description="peer/<replica> or s3.")
    bytesDone: int | None = Field(default=None, ge=0, json_schema_extra={"format": "int64"})
    bytesTotal: int | None = Field(default=None, ge=0, json_schema_extra={"format": "int64"})
    progress: str | None = Field(
        default=None,
        max_length=64,
        description="The load's progress for people, e.g. `42% 1.2Gi/s`: percent of bytesTotal (or the bytes so far "
        "while the total is not known) and the average rate since startedTime. Written by the agent.",
    )
    startedTime: str | None = None
    completedTime: str | None = None
    lastProgressTime: str | None = None
    attempts: list[LoadAttempt] | None = Field(default=None, max_length=64)
    ranks: Annotated[
        list[RankEndpoint] | None,
        Field(
            default=None, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["rank"]}
        ),
    ]
    activeLeases: int | None = Field(default=None, ge=0)
    attachments: list[Attachment] | None = Field(
        default=None,
        max_length=MAX_ATTACHMENTS,
        description="Consumer pods attached on this node, one entry per held version (at most 1024 listed; "
        "attachedPods counts them all).",
    )
    attachedPods: int | None = Field(default=None, ge=0, description="Distinct consumer pods attached.")
    residentBytes: int | None = Field(
        default=None,
        ge=0,
        json_schema_extra={"format": "int64"},
        description="Host memory the agent holds for this replica, over every version it still keeps.",
    )
    residentVersions: list[str] | None = Field(
        default=None, max_length=64, description="WeightVersions whose bytes the agent holds for this replica."
    )
    reason: ReplicaReason | None = Field(default=None, description="Why the replica is Failed (CamelCase).")
    message: str | None = Field(default=None, max_length=4096)
    conditions: Conditions = Field(
        description="Written by the operator: `Live` says whether the agent renews the replica's Lease "
        "(`ferry-wr-<replica>`). A Serving replica that is not Live is stale: no source, not ready.",
    )
    observedGeneration: int | None = Field(default=None, ge=0)


class WeightReplica(_Model):
    kind: ClassVar[str] = "WeightReplica"
    plural: ClassVar[str] = "weightreplicas"
    short_names: ClassVar[list[str]] = ["wr"]
    cel_rules: ClassVar[list[CelRule]] = []
    printer_columns: ClassVar[list[dict]] = [
        {"name": "Node", "type": "string", "jsonPath": ".spec.nodeName"},
        {"name": "Version", "type": "string", "jsonPath": ".spec.version"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Serves", "type": "string", "jsonPath": ".status.version"},
        {"name": "Loading", "type": "string", "jsonPath": ".status.loadingVersion"},
        {"name": "Source", "type": "string", "jsonPath": ".status.source"},
        {"name": "Live", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Live")].status'},
        {"name": "Attached", "type": "integer", "jsonPath": ".status.attachedPods"},
        {"name": "Progress", "type": "string", "jsonPath": ".status.progress", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: WeightReplicaSpec
    status: WeightReplicaStatus | None = None


RESOURCES: list[type[_Model]] = [WeightVersion, ModelLoad, WeightReplica]


# ---------------------------------------------------------------- names shared by operator and agent

LABEL_MODEL = f"{GROUP}/model"
LABEL_VERSION = f"{GROUP}/version"
LABEL_NODE = f"{GROUP}/node"
# Readers present to the worker service of the source on node N a token with audience `ferry.dev/worker/N`, so a
# source cannot replay a token it received to another source.
WORKER_AUDIENCE_PREFIX = f"{GROUP}/worker/"
LABEL_MODELLOAD = f"{GROUP}/modelload"
# Why the operator keeps a WeightReplica: "pool" (the `replicas` warm pool; also when the label is absent) or
# "pods" (only a matching pod on its node, or a consumer still attached there, keeps it).
LABEL_PLACEMENT = f"{GROUP}/placement"
PLACEMENT_POOL, PLACEMENT_PODS = "pool", "pods"
# Node labels `warm.ferry.dev/<name>=<version>` say where a ModelLoad's replica is Serving (`warm_node_label`).
WARM_LABEL_PREFIX = f"warm.{GROUP}/"
_WARM_HASH_CHARS = 10
REPLICA_LEASE_PREFIX = "ferry-wr-"


def label_value(value: str) -> str:
    """A name as the value of a `ferry.dev/*` label: itself, or a digest when longer than a label value may be."""
    return value if len(value) <= 63 else hashlib.sha256(value.encode()).hexdigest()[:63]


def worker_audience(node: str) -> str:
    """The audience of the worker tokens that the worker services of `node` accept."""
    if not node:
        raise ValueError("a worker token audience needs the source's node name")
    return f"{WORKER_AUDIENCE_PREFIX}{node}"


def warm_node_label(namespace: str, modelload: str) -> str:
    """The node label key for the ModelLoad `namespace/modelload`: `warm.ferry.dev/<namespace>_<modelload>-<hash>`,
    the readable part cut so that the name after the prefix fits Kubernetes' 63 characters, and a hash of the full
    pair that tells cut (or otherwise equal-looking) pairs apart. `_` cannot occur in either name, so the pair
    reads back unambiguously when not cut."""
    digest = hashlib.sha256(f"{namespace}/{modelload}".encode()).hexdigest()[:_WARM_HASH_CHARS]
    readable = f"{namespace}_{modelload}"[: 63 - _WARM_HASH_CHARS - 1].rstrip("-._")
    return f"{WARM_LABEL_PREFIX}{readable}-{digest}"


def replica_lease_name(replica: str) -> str:
    """The coordination Lease an agent renews while it serves `replica`."""
    return f"{REPLICA_LEASE_PREFIX}{replica}"[:253]
