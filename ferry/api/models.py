"""The ferry.dev/v1alpha1 API. These pydantic models are the source of truth; `make crds` renders the CRDs.

Every field's docstring is its CRD `description` (what `kubectl explain` shows). Next to each kind stand the
enums of its vocabulary: condition types, their reasons and the phases, each member saying when it applies
(docs/conditions.md lists them for users). Writers and readers use these enums, never the strings.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ferry.errors import InvalidInput

GROUP = "ferry.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CATEGORY = "ferry"
MAX_CHAIN_LENGTH = 64
MAX_ATTACHMENTS = 1024  # entries of a WeightReplica's status.attachments

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Every key segment has a character other than a dot: no `.` or `..` (`ferry.s3.parse_s3_uri` refuses them too).
S3_INDEX_URI = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/(\.*[^/.][^/]*/)*[^/]+\.index\.json$"
HTTP_ENDPOINT = r"^https?://[^\s/]+(:[0-9]+)?/?$"
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]


def is_object_name(name: Any) -> bool:
    """Whether `name` is what `ObjectName` admits (a lowercase DNS subdomain of at most 253 characters)."""
    return isinstance(name, str) and len(name) <= 253 and re.fullmatch(DNS_SUBDOMAIN, name) is not None


# Label keys and values as Kubernetes validates them: [prefix/]name, prefix a DNS subdomain of at most 253
# characters, name and value at most 63 alphanumerics with -_. inside (a value may be empty).
LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY = rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{LABEL_NAME}$"
LabelValue = Annotated[str, Field(max_length=63, pattern=rf"^({LABEL_NAME})?$")]
Int64 = Annotated[int, Field(ge=0, json_schema_extra={"format": "int64"})]


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, use_enum_values=True, use_attribute_docstrings=True
    )


class CelRule(_Model):
    """One `x-kubernetes-validations` entry."""

    rule: str
    message: str
    reason: str | None = None
    fieldPath: str | None = None


class PrinterColumn(_Model):
    """One `additionalPrinterColumns` entry: a column of `kubectl get`."""

    name: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    jsonPath: str
    description: str | None = None
    priority: int | None = None  # 1: only with `-o wide`


def condition_column(name: str, condition: str, field: str = "status", *, priority: int | None = None) -> PrinterColumn:
    """A column showing `field` of the condition of type `condition`."""
    path = f'.status.conditions[?(@.type=="{condition}")].{field}'
    return PrinterColumn(name=name, type="string", jsonPath=path, priority=priority)


AGE_COLUMN = PrinterColumn(name="Age", type="date", jsonPath=".metadata.creationTimestamp")

log = logging.getLogger("ferry.api")


class InvalidObject(InvalidInput):
    """An object's spec does not validate against these models (e.g. stored under an older, looser schema)."""


class ObjectMeta(BaseModel):
    """The part of metav1.ObjectMeta that Ferry reads. Not part of the CRD schema (the apiserver owns it), and
    every other field (managedFields, finalizers, ownerReferences, ...) is ignored."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    name: str = ""
    """The object's name."""
    namespace: str = ""
    """The object's namespace."""
    uid: str = ""
    """The object's uid: a deleted and re-created name is another object."""
    generation: int | None = None
    """Incremented on every spec change."""
    creationTimestamp: str | None = None
    """When the object was created (RFC 3339)."""
    deletionTimestamp: str | None = None
    """Set once the object is deleted; its finalizers still hold it."""
    labels: dict[str, str] = Field(default_factory=dict)
    """The object's labels."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """The object's annotations."""


M = TypeVar("M", bound=BaseModel)


def _prune(data: dict[str, Any], error: ValidationError) -> list[str]:
    """Drop from `data` what `error` names: a top-level field, or one entry of a top-level list field. Returns
    the paths dropped."""
    fields: set[str] = set()
    entries: dict[str, set[int]] = {}
    for err in error.errors():
        loc = err["loc"]
        if not loc or not isinstance(loc[0], str) or loc[0] not in data:
            continue
        if len(loc) > 1 and isinstance(loc[1], int) and isinstance(data[loc[0]], list):
            entries.setdefault(loc[0], set()).add(loc[1])
        else:
            fields.add(loc[0])
    for key, indexes in entries.items():
        if key not in fields:
            data[key] = [item for i, item in enumerate(data[key]) if i not in indexes]
    for key in fields:
        del data[key]
    return sorted(fields) + [f"{key}[{i}]" for key, indexes in entries.items() if key not in fields for i in indexes]


def lenient(model: type[M], data: Mapping[str, Any] | None, what: str) -> M | None:
    """`data` as a `model`, leaving out (with a log line) whatever does not validate: a status the operator wrote
    under an older schema must never make a reconcile fail. None: nothing usable (or no data)."""
    if not data:
        return None
    try:
        return model.model_validate(dict(data))
    except ValidationError as error:
        pruned = {k: list(v) if isinstance(v, list) else v for k, v in dict(data).items()}
        dropped = _prune(pruned, error)
        log.warning("%s: ignoring what does not validate (%s): %s", what, ", ".join(dropped) or "-", error)
    try:
        return model.model_validate(pruned)
    except ValidationError as error:
        log.warning("%s: ignored altogether: %s", what, error)
        return None


def merge_patch(current: BaseModel | None, desired: BaseModel) -> dict[str, Any]:
    """The JSON merge patch that turns `current` (say a status as read) into `desired`: every field `desired`
    sets, and null for each field `current` has and `desired` leaves unset (which removes it)."""
    patch = desired.model_dump(mode="json", by_alias=True, exclude_none=True)
    if current is not None:
        for key in current.model_dump(by_alias=True, exclude_none=True):
            patch.setdefault(key, None)
    return patch


class _Resource(_Model):
    """A Ferry kind: metadata, spec and status, parsed once from the object dict (or kopf Body) the apiserver
    sent."""

    kind: ClassVar[str]
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    """The object's metadata (crdgen renders it as ObjectMeta, not from this model)."""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Self:
        """The typed object. A spec that does not validate raises `InvalidObject` (the caller logs and skips the
        object); the status, written by Ferry itself, keeps what validates."""
        metadata = lenient(ObjectMeta, body.get("metadata"), f"{cls.kind} metadata") or ObjectMeta()
        where = f"{cls.kind} {metadata.namespace}/{metadata.name}"
        try:
            spec = cls.model_validate({"spec": dict(body.get("spec") or {})}).spec
        except ValidationError as error:
            raise InvalidObject(f"{where}: spec does not validate: {error}") from error
        status_type = get_args(cls.model_fields["status"].annotation)[0]  # the status model of `X | None`
        status = lenient(status_type, body.get("status"), f"{where} status")
        return cls.model_construct(metadata=metadata, spec=spec, status=status)


# ---------------------------------------------------------------- shared parts


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Model):
    """A metav1.Condition, as the Kubernetes API conventions define it."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
    )
    """The aspect this condition reports, e.g. Ready (docs/conditions.md lists each kind's types)."""
    status: ConditionStatus
    """True, False or Unknown."""
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON)
    """Why the condition has its status, in CamelCase, from a fixed list per type (docs/conditions.md)."""
    message: str = Field(default="", max_length=32768)
    """What happened, for people: names the objects involved."""
    observedGeneration: int | None = Field(default=None, ge=0)
    """metadata.generation of the object when the condition was set."""
    lastTransitionTime: str = Field(json_schema_extra={"format": "date-time"})
    """When status last changed (RFC 3339); a new reason or message with the same status keeps it."""


Conditions = Annotated[
    list[Condition],
    Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    ),
]


class SourceKind(StrEnum):
    PEER = "Peer"  # another node's replica of the same version, over NIXL
    OBJECT_STORAGE = "ObjectStorage"  # the version's checkpoint in S3


class SelectorKind(StrEnum):
    RENDEZVOUS_HASH = "rendezvousHash"  # each target ranks the peers by a hash of (target, peer): load spreads evenly
    RANDOM = "random"  # a random order per load
    LOAD_AWARE = "loadAware"  # the peers with the fewest active read leases first


class Device(StrEnum):
    CUDA = "cuda"
    CPU = "cpu"


class TransferSpec(_Model):
    """How an agent copies a version: timeouts, retries and peer choice."""

    timeoutSeconds: int = Field(default=300, ge=1, le=86400)
    """Per-candidate transfer timeout: a peer or an S3 request (all its tries together) that takes longer fails."""
    maxSourceAttempts: int = Field(default=3, ge=1, le=16)
    """Peers tried before falling back to the next source kind of sourceOrder."""
    selector: SelectorKind = SelectorKind.RENDEZVOUS_HASH
    """The order in which peers are tried: rendezvousHash (spread by a stable hash), random, or loadAware (fewest
    active read leases first)."""
    stallSeconds: int = Field(default=60, ge=1, le=86400)
    """No progress for this long is a stall: the ModelLoad's PeerStalled condition turns True, and a peer whose READ
    completed no chunk for this long is left for the other holders (or object storage) without restarting the load."""
    rpcRetries: int = Field(default=3, ge=0, le=10)
    """Retries of a read-lease RPC (PrepareTensorRead/ReleaseTensorRead) that failed with a transient error
    (UNAVAILABLE), before the source counts as failed."""
    rpcBackoffSeconds: float = Field(default=0.5, ge=0, le=30)
    """Wait before the first lease RPC retry; each further retry waits twice as long."""
    maxReadersPerSource: int = Field(default=4, ge=1, le=1024)
    """Read leases one replica grants at once, whether it serves or still loads (a reader that finds it full reads
    from another holder): bounds how many peers share one source's network and memory bandwidth, so that a
    fan-out becomes a tree of holders instead of everyone on the first one."""
    chunkMiB: int = Field(default=16, ge=1, le=65536)
    """Pipelined fan-out: the unit a reader reads, checks and serves on (consecutive tensors of at least this
    size): a replica still loading serves the chunks it holds."""


SourceOrder = Annotated[
    list[SourceKind],
    Field(
        default_factory=lambda: [SourceKind.PEER, SourceKind.OBJECT_STORAGE],
        min_length=1,
        max_length=2,
        json_schema_extra={"x-kubernetes-list-type": "set", "default": ["Peer", "ObjectStorage"]},
    ),
]
# `{}` lets the apiserver fill the nested defaults.
Transfer = Annotated[TransferSpec, Field(default_factory=TransferSpec, json_schema_extra={"default": {}})]


# ---------------------------------------------------------------- WeightVersion


class WeightFormat(StrEnum):
    FULL_CHECKPOINT = "FullCheckpoint"  # a whole checkpoint in object storage
    XOR_DELTA = "XorDelta"  # the bytes that changed since spec.baseVersion, XORed; replayed on the base
    PEER_ONLY = "PeerOnly"  # nothing stored: the bytes exist only on replicas (published from a running engine)


class StorageLocation(_Model):
    """Where a version's checkpoint lives in S3-compatible object storage."""

    uri: str = Field(max_length=2048, pattern=S3_INDEX_URI)
    """s3://bucket/key/model.safetensors.index.json; the shards it names live beside the index."""
    endpoint: str | None = Field(default=None, max_length=512, pattern=HTTP_ENDPOINT)
    """S3 endpoint URL, e.g. http://seaweedfs.storage:8333; unset: the operator's and agents' default endpoint."""
    region: str | None = Field(default=None, max_length=64)
    """S3 region; unset: the client's default."""
    credentialsSecret: ObjectName | None = None
    """Secret in the same namespace with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY; unset: the operator's and
    agents' own credentials, only where the cluster admin's ambientCredentials allow them for this namespace, bucket,
    prefix and endpoint (else StorageVerified is False with reason AmbientCredentialsDenied)."""


class WeightVersionSpec(_Model):
    """An immutable published version of a model's weights."""

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
    """The model these weights are of; ModelLoads of this modelName may desire this version."""
    format: WeightFormat
    """FullCheckpoint: a whole checkpoint in spec.storage. XorDelta: the XOR of what changed since baseVersion, in
    spec.storage. PeerOnly: nothing stored; replicas copy it from peers only."""
    baseVersion: ObjectName | None = None
    """XorDelta only: the WeightVersion (same namespace and modelName) this delta applies to."""
    storage: StorageLocation | None = None
    """Where the checkpoint is stored; required unless format is PeerOnly."""
    layoutSignature: str | None = Field(default=None, max_length=256)
    """Optional fingerprint of the tensor layout (names, shapes, dtypes); versions of one chain must not differ in
    a non-empty one."""


class WeightVersionConditionType(StrEnum):
    """WeightVersion `status.conditions`, written by the operator."""

    CHAIN_RESOLVED = "ChainResolved"  # True: the replay chain (root to self) is sound and the direct base is Ready
    STORAGE_VERIFIED = "StorageVerified"  # True: the index and every shard exist and add up (or PeerOnly)
    READY = "Ready"  # True: both of the above; False carries the first failing condition's reason


class ChainReason(StrEnum):
    """Reasons of the WeightVersion `ChainResolved` condition."""

    Resolved = "Resolved"  # True: the chain is sound and the direct base (if any) is Ready
    BaseNotFound = "BaseNotFound"  # a baseVersion names a WeightVersion that does not exist (yet)
    BaseNotReady = "BaseNotReady"  # the direct base exists but is not Ready, or is being released
    ModelMismatch = "ModelMismatch"  # a version in the chain is for a different modelName
    ChainCycle = "ChainCycle"  # baseVersion links loop back on themselves
    ChainTooLong = "ChainTooLong"  # more versions than the replay limit (MAX_CHAIN_LENGTH)
    LayoutMismatch = "LayoutMismatch"  # two non-empty layoutSignatures in the chain differ
    UnsupportedFormat = "UnsupportedFormat"  # PeerOnly base, FullCheckpoint with a base, delta without one, unknown


class StorageReason(StrEnum):
    """Reasons of the WeightVersion `StorageVerified` condition."""

    Verified = "Verified"  # True: index, shards and sizes all check out
    NotApplicable = "NotApplicable"  # True: PeerOnly, nothing is stored
    VerificationPending = "VerificationPending"  # Unknown: not checked yet (also Ready=False meanwhile)
    ObjectMissing = "ObjectMissing"  # the index, a shard or the bucket does not exist
    IndexInvalid = "IndexInvalid"  # index or a shard header is not canonical, or not for this version
    UriInvalid = "UriInvalid"  # spec.storage.uri is not an s3:// URI Ferry reads (e.g. a `..` segment)
    SizeMismatch = "SizeMismatch"  # a shard is truncated/padded, or total_size disagrees with the shards
    AccessDenied = "AccessDenied"  # the credentials are wrong or lack permission
    CredentialsMissing = "CredentialsMissing"  # no credentials, or the Secret lacks a key
    # no credentialsSecret, and the admin's ambientCredentials allow no platform credentials for it (docs/security.md)
    AmbientCredentialsDenied = "AmbientCredentialsDenied"
    EndpointUnreachable = "EndpointUnreachable"  # network error, timeout or 5xx: transient, retry


# Ready=False reasons of phase Failed: only the publisher can mend them. Those of a broken chain or checkpoint are for
# good (publish a new version); the operator keeps retrying, with backoff, the ones mended in place (a Secret, its
# keys, the bucket's policy), so such a version still becomes Ready once they are. A missing object stays Pending:
# a WeightVersion may be applied before its objects are uploaded.
VERSION_FAILED_FOR_GOOD = frozenset(
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
VERSION_FAILED_UNTIL_MENDED = frozenset({StorageReason.CredentialsMissing, StorageReason.AccessDenied})


class WeightVersionReadyReason(StrEnum):
    """Reasons of the WeightVersion `Ready` condition besides the first failing condition's (a ChainReason or a
    StorageReason, e.g. VerificationPending)."""

    VERIFIED = "Verified"  # True: the chain is resolved and the storage verified
    RELEASE_BLOCKED = "ReleaseBlocked"  # False: deleted, but status.releaseBlockers still need it
    RELEASING = "Releasing"  # False: deleted and needed no more; the finalizer is about to go


class WeightVersionEventReason(StrEnum):
    """Reasons of the Events the operator posts on a WeightVersion besides condition changes and retention's."""

    RELEASED = "Released"  # Normal: nothing depends on it any more, the finalizer goes


class WeightVersionPhase(StrEnum):
    PENDING = "Pending"  # waiting on something that may appear (a base, an object, credentials)
    VERIFYING = "Verifying"  # the chain is resolved; the storage is not verified yet
    READY = "Ready"  # Ready=True: replicas may load it
    FAILED = "Failed"  # only the publisher can mend it (VERSION_FAILED_FOR_GOOD, VERSION_FAILED_UNTIL_MENDED)
    RELEASING = "Releasing"  # deleted; waits until nothing needs it


class WeightVersionStatus(_Model):
    """What the operator found: the chain, the verified storage, readiness. Written by the operator alone."""

    phase: WeightVersionPhase | None = None
    """Pending, Verifying, Ready, Failed (permanent: publish a new version) or Releasing."""
    conditions: Conditions
    """ChainResolved, StorageVerified and Ready (docs/conditions.md)."""
    observedGeneration: int | None = Field(default=None, ge=0)
    """metadata.generation the status was computed for."""
    chain: list[str] | None = Field(default=None, max_length=MAX_CHAIN_LENGTH)
    """The replay chain, root to self: the versions an agent applies in order."""
    chainDepth: int | None = Field(default=None, ge=0, le=MAX_CHAIN_LENGTH)
    """Number of deltas on top of the root (0 for a FullCheckpoint or PeerOnly)."""
    totalBytes: Int64 | None = None
    """Bytes of the verified checkpoint's shards."""
    size: str | None = Field(default=None, max_length=32)
    """totalBytes for humans, e.g. 1.5Gi."""
    tensorCount: int | None = Field(default=None, ge=0)
    """Tensors named by the verified index."""
    indexDigest: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """sha256 (hex) of the index object the operator verified; agents load only an index with this digest and use
    a stored copy only if it was written from it."""
    readyTime: str | None = None
    """When the version first became Ready (RFC 3339)."""
    releaseBlockers: list[str] | None = None
    """What keeps a deleted version alive: WeightVersion/<delta>, ModelLoad/<name>, WeightReplica/<name> or
    attached: <namespace>/<pod> on <node>."""


class WeightVersion(_Resource):
    """An immutable, published version of a model's weights (a checkpoint or a delta in object storage, or bytes
    only peers hold), verified by the operator before replicas load it."""

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
    printer_columns: ClassVar[list[PrinterColumn]] = [
        PrinterColumn(name="Phase", type="string", jsonPath=".status.phase"),
        condition_column("Ready", WeightVersionConditionType.READY),
        PrinterColumn(name="Model", type="string", jsonPath=".spec.modelName"),
        PrinterColumn(name="Base", type="string", jsonPath=".spec.baseVersion"),
        PrinterColumn(name="Depth", type="integer", jsonPath=".status.chainDepth"),
        PrinterColumn(name="Size", type="string", jsonPath=".status.size"),
        condition_column("Reason", WeightVersionConditionType.READY, "reason", priority=1),
        AGE_COLUMN,
    ]

    spec: WeightVersionSpec
    """The published version; immutable."""
    status: WeightVersionStatus | None = None
    """Written by the operator."""


# ---------------------------------------------------------------- ModelLoad


class RetentionPolicy(_Model):
    """Which WeightVersions of the ModelLoad's model the operator deletes (docs/retention.md)."""

    keepLast: int = Field(ge=1, le=4096)
    """Keep the newest N Ready WeightVersions of spec.modelName in this namespace (newest by creation); delete
    older Ready ones unless a ModelLoad desires them, a replica holds them, or a kept or held version replays from
    them. Several ModelLoads of one model: the largest keepLast wins."""
    deleteStorage: bool = False
    """Also delete a retired version's objects (its index and the shards it names) once it is released, with its
    spec.storage.credentialsSecret (which then needs s3:DeleteObject). Several ModelLoads of one model: only if
    every policy says so."""


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

    key: str = Field(min_length=1, max_length=317, pattern=LABEL_KEY)
    """The label key the requirement applies to ([prefix/]name)."""
    operator: SelectorOperator
    """In: the label's value is one of values; NotIn: it is none of them (or the label is absent);
    Exists / DoesNotExist: the pod has / lacks the label."""
    values: list[LabelValue] | None = Field(default=None, max_length=64)
    """Label values; only with In and NotIn, and then at least one."""


def _label_keys_rule(field: str) -> dict:
    """A CEL rule on a map that every key is a valid label key ([prefix/]name)."""
    return {
        "x-kubernetes-validations": [
            {
                "rule": f"self.all(k, k.matches('{LABEL_KEY}') && (!k.contains('/') || k.indexOf('/') <= 253))",
                "message": f"every {field} key must be a valid label key ([prefix/]name)",
                "reason": "FieldValueInvalid",
            }
        ]
    }


class LabelSelector(_Model):
    """metav1.LabelSelector. Every requirement must hold (AND); an empty selector matches every pod."""

    matchLabels: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=64, json_schema_extra=_label_keys_rule("matchLabels")
    )
    """Labels a pod must carry with exactly these values."""
    matchExpressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=64)
    """Set-based requirements, all of which must hold."""


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

    strategy: RolloutStrategy = RolloutStrategy.ROLLING
    """Parallel: every replica moves to the new version at once. Rolling: at most maxUnavailable replicas move at a
    time. Either way a moving replica keeps serving its old version (to peers and attached pods) until the new one
    is resident (make-before-break), so a Parallel rollout loses no capacity; it holds both versions' bytes on
    every node meanwhile."""
    maxUnavailable: int | str | None = Field(default=None, json_schema_extra=lambda schema: _int_or_percent(schema))
    """Rolling only: how many replicas may be moving (retargeted, not yet serving the new version) or unavailable
    (serving nothing) at once; an integer >= 1 or a percentage of spec.replicas (rounded down, at least 1). Unset:
    25%. A moving replica still serves its old version, so the replicas that serve neither version never exceed
    it."""

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
    """Which version of a model to keep resident, on how many and which nodes, and how to move to a new one."""

    modelName: str = Field(min_length=1, max_length=253)
    """The model to load; spec.desiredVersion must be a WeightVersion of this modelName."""
    desiredVersion: ObjectName
    """Name of the WeightVersion (same namespace) to make resident; change it to roll out a new version."""
    nodeSelector: dict[str, LabelValue] = Field(
        default_factory=dict, max_length=64, json_schema_extra=_label_keys_rule("nodeSelector")
    )
    """Node labels a node must carry to hold a replica of the warm pool (keys and values are validated as
    labels)."""
    replicas: int = Field(default=1, ge=0, le=4096)
    """Size of the warm pool: how many nodes matching nodeSelector hold a replica (podSelector may add more)."""
    ranksPerReplica: int = Field(default=1, ge=1, le=1024)
    """Processes (one per GPU) of one node that together hold a replica; each holds its share of the tensors and
    copies it from the same rank of a peer (docs/ranks.md)."""
    device: Device = Device.CUDA
    """Where a replica holds the weights: cuda (GPU memory) or cpu (host memory)."""
    sourceOrder: SourceOrder
    """The sources a replica loads from, in order: Peer (another node's replica of the version), ObjectStorage
    (the checkpoint in spec.storage of the WeightVersion)."""
    transfer: Transfer
    """Timeouts, retries and peer choice of every load."""
    retention: RetentionPolicy | None = None
    """Delete old WeightVersions of this model; unset: the operator deletes none."""
    podSelector: LabelSelector | None = None
    """Weights follow pods: every node where a Pod of this namespace matching the selector is bound (spec.nodeName
    set, not terminating, not Succeeded or Failed) holds a replica too, in addition to the `replicas` warm pool on
    nodeSelector nodes (docs/consumers.md). A node whose matching pods are gone keeps its replica while any
    consumer is still attached. Unset: the warm pool alone."""
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra={"default": {}})
    """How replicas move to a new desiredVersion; unset: Rolling with maxUnavailable 25%."""


class ModelLoadConditionType(StrEnum):
    """ModelLoad `status.conditions`, written by the operator."""

    READY = "Ready"  # True: every replica serves desiredVersion (that very WeightVersion object) with a live Lease
    PROGRESSING = "Progressing"  # True: replicas load (a first load, or a new version next to the served one)
    DEGRADED = "Degraded"  # True: a replica failed, is stale, or fell back from peers to object storage
    PEER_STALLED = "PeerStalled"  # True: a loading replica made no progress for transfer.stallSeconds
    ENGINES_ATTACHED = "EnginesAttached"  # True: a consumer pod holds desiredVersion (informational)


class ModelLoadReadyReason(StrEnum):
    """Reasons of the ModelLoad's `Ready` condition."""

    ALL_REPLICAS_READY = "AllReplicasReady"  # True: every replica serves desiredVersion with a live Lease
    REPLICAS_NOT_READY = "ReplicasNotReady"  # False: some replicas do not serve it yet (loading, rolling out)
    REPLICA_FAILED = "ReplicaFailed"  # False: a replica failed, or failed to load its loadingVersion
    INSUFFICIENT_NODES = "InsufficientNodes"  # False: fewer nodes match nodeSelector than `replicas`
    VERSION_NOT_FOUND = "VersionNotFound"  # False: the desired WeightVersion does not exist; nothing is placed
    VERSION_NOT_READY = "VersionNotReady"  # False: the desired WeightVersion is not Ready; nothing is placed
    MODEL_MISMATCH = "ModelMismatch"  # False: the desired WeightVersion is of another modelName; nothing is placed


class ProgressingReason(StrEnum):
    """Reasons of the ModelLoad's `Progressing` condition."""

    LOADING = "Loading"  # True: replicas load (a first load, or a new version next to the served one)
    ROLLING_OUT = "RollingOut"  # True: replicas still on an older version move within spec.rollout
    COMPLETE = "Complete"  # False: nothing loads and every replica is ready
    IDLE = "Idle"  # False: nothing loads, but not every replica is ready (e.g. a failure, too few nodes)


class DegradedReason(StrEnum):
    """Reasons of the ModelLoad's `Degraded` condition (True: the first problem found; the message lists all)."""

    REPLICA_FAILED = "ReplicaFailed"  # True: a replica failed, or failed to load its loadingVersion
    REPLICA_STALE = "ReplicaStale"  # True: a Serving replica is not Live (its Lease expired or is gone)
    FELL_BACK_TO_OBJECT_STORAGE = "FellBackToObjectStorage"  # True: a peer failed and object storage served
    INSUFFICIENT_NODES = "InsufficientNodes"  # True: fewer nodes match spec.nodeSelector than spec.replicas
    AS_EXPECTED = "AsExpected"  # False: none of these


class PeerStalledReason(StrEnum):
    """Reasons of the ModelLoad's `PeerStalled` condition."""

    NO_PROGRESS = "NoProgress"  # True: a loading replica made no progress for transfer.stallSeconds
    NOT_STALLED = "NotStalled"  # False: no loading replica is stalled


class EnginesAttachedReason(StrEnum):
    """Reasons of the ModelLoad's `EnginesAttached` condition (docs/conditions.md)."""

    ATTACHED = "Attached"  # True: at least one consumer pod holds the desired version on a live replica
    ON_OLDER_VERSION = "EnginesOnOlderVersion"  # False: pods are attached, but none holds the desired version yet
    NO_ENGINES = "NoEngines"  # False: no consumer pod is attached to a live replica


class ModelLoadEventReason(StrEnum):
    """Reasons of the Events the operator posts on a ModelLoad besides condition changes and retention's."""

    REPLICA_CREATED = "ReplicaCreated"  # Normal: the operator created the named WeightReplica
    REPLICA_DELETED = "ReplicaDeleted"  # Normal: the operator deleted the named WeightReplica
    ROLLING_OUT = "RollingOut"  # Normal: replicas were moved to the desired version
    LEASE_OF_OTHER_NODE_DELETED = "LeaseOfOtherNodeDeleted"  # Warning: a replica's Lease named another node
    REPLICA_HELD_BY_CONSUMERS = "ReplicaHeldByConsumers"  # Normal: an unwanted replica stays while pods attach


class RetentionReason(StrEnum):
    """Reasons of the Events retention posts (there is no condition: every deletion is an Event)."""

    VERSION_RETIRED = "VersionRetired"  # Normal, on the ModelLoad: it deleted the named WeightVersion
    RETIREMENT_FAILED = "RetirementFailed"  # Warning, on the ModelLoad: the delete was refused (e.g. RBAC)
    STORAGE_DELETED = "StorageDeleted"  # Normal, on the WeightVersion: its objects are gone as it is released
    STORAGE_NOT_DELETED = "StorageNotDeleted"  # Warning, on the WeightVersion: objects left; the message says why


class EventAction(StrEnum):
    """`action` of the Events the operator posts: what it did or tried about the object (`reason` says how it
    went)."""

    VERIFY = "Verify"  # WeightVersion: its chain and objects were checked (its Ready changed)
    RELEASE = "Release"  # WeightVersion: a deletion is held for what still needs it, or released
    SERVE = "Serve"  # ModelLoad: its replicas' readiness changed (Ready, Degraded)
    LOAD = "Load"  # ModelLoad: a peer load stalled or moves again (PeerStalled)
    ATTACH = "Attach"  # ModelLoad: consumer pods attached or left (EnginesAttached)
    CREATE_REPLICA = "CreateReplica"
    DELETE_REPLICA = "DeleteReplica"  # also a replica kept while consumers are attached to it
    ROLL_OUT = "RollOut"
    DELETE_LEASE = "DeleteLease"
    RETIRE = "Retire"  # retention deleted (or could not delete) a WeightVersion
    DELETE_STORAGE = "DeleteStorage"  # a released version's objects deleted (or left)


class ModelLoadPhase(StrEnum):
    """A summary of the conditions, for `kubectl get`."""

    PENDING = "Pending"  # nothing loads and not every replica is ready (e.g. the version is missing or not Ready)
    PROGRESSING = "Progressing"  # replicas load or roll out
    READY = "Ready"  # Ready=True
    DEGRADED = "Degraded"  # a replica failed or is stale, or some serve and the rest cannot (e.g. too few nodes)


class ModelLoadStatus(_Model):
    """The replicas' progress, aggregated by the operator (which alone writes it)."""

    phase: ModelLoadPhase | None = None
    """Pending, Progressing, Ready or Degraded: a summary of the conditions."""
    replicas: int | None = Field(default=None, ge=0)
    """Replicas wanted: the warm pool and those kept on the nodes of followed or attached pods."""
    readyReplicas: int | None = Field(default=None, ge=0)
    """Replicas that serve desiredVersion (that very WeightVersion object) with a live Lease."""
    ready: str | None = Field(default=None, max_length=32)
    """readyReplicas/replicas, for kubectl."""
    loadedVersion: str | None = None
    """The last desiredVersion that every replica served (Ready=True)."""
    attachedPods: int | None = Field(default=None, ge=0)
    """Consumer pods attached to this ModelLoad's live replicas (any version they hold), over all nodes."""
    warmNodeLabel: str | None = Field(default=None, max_length=317)
    """The node label key the operator sets, to the version served, on every node where a replica of this
    ModelLoad is Serving: engine pods may prefer such nodes (preferred node affinity, docs/consumers.md)."""
    conditions: Conditions
    """Ready, Progressing, Degraded, PeerStalled and EnginesAttached (docs/conditions.md)."""
    observedGeneration: int | None = Field(default=None, ge=0)
    """metadata.generation the status was computed for."""


class ModelLoad(_Resource):
    """Keeps a version of a model resident (in GPU or host memory) on a set of nodes, one WeightReplica per node,
    and moves them to a new desiredVersion by rolling out."""

    kind: ClassVar[str] = "ModelLoad"
    plural: ClassVar[str] = "modelloads"
    short_names: ClassVar[list[str]] = ["ml"]
    cel_rules: ClassVar[list[CelRule]] = []
    printer_columns: ClassVar[list[PrinterColumn]] = [
        PrinterColumn(name="Model", type="string", jsonPath=".spec.modelName"),
        PrinterColumn(name="Desired", type="string", jsonPath=".spec.desiredVersion"),
        PrinterColumn(name="Ready", type="string", jsonPath=".status.ready"),
        PrinterColumn(name="Phase", type="string", jsonPath=".status.phase"),
        PrinterColumn(name="Attached", type="integer", jsonPath=".status.attachedPods"),
        PrinterColumn(name="Loaded", type="string", jsonPath=".status.loadedVersion", priority=1),
        condition_column("Reason", ModelLoadConditionType.READY, "reason", priority=1),
        AGE_COLUMN,
    ]

    spec: ModelLoadSpec
    """What to keep resident, and where."""
    status: ModelLoadStatus | None = None
    """Written by the operator."""


# ---------------------------------------------------------------- WeightReplica


class WeightReplicaSpec(_Model):
    """One node's copy of a ModelLoad's version. Written by the operator; the node's agent loads it."""

    cel_rules: ClassVar[list[CelRule]] = [
        CelRule(rule="self.nodeName == oldSelf.nodeName", message="spec.nodeName is immutable"),
    ]

    modelLoad: ObjectName
    """The ModelLoad (same namespace) this replica belongs to."""
    modelName: str = Field(min_length=1, max_length=253)
    """The ModelLoad's modelName."""
    version: ObjectName
    """The WeightVersion to serve; the operator moves it during a rollout."""
    nodeName: ObjectName
    """The node whose agent loads and serves this replica; immutable."""
    ranks: int = Field(default=1, ge=1, le=1024)
    """The ModelLoad's ranksPerReplica."""
    device: Device = Device.CUDA
    """The ModelLoad's device."""
    sourceOrder: SourceOrder
    """The ModelLoad's sourceOrder."""
    transfer: Transfer
    """The ModelLoad's transfer settings."""


class ReplicaPhase(StrEnum):
    """A WeightReplica's `status.phase`, written by the node agent alone."""

    PENDING = "Pending"  # the agent has not taken it up yet (no phase written)
    LOADING = "Loading"  # a first load: nothing is served yet
    SERVING = "Serving"  # `status.version` is resident and served (to peers and attached pods)
    FAILED = "Failed"  # serves nothing: `status.reason` says why


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
    # More ranks than the node runs: its GPUs (cuda), its agent's --max-rank-processes, or what that cap leaves beside
    # the rank processes of its other loads (retried with the load backoff). No rank process was started.
    RANKS_EXCEED_NODE = "RanksExceedNode"


class AttemptOutcome(StrEnum):
    LOADED = "Loaded"  # this source delivered the version
    FAILED = "Failed"  # it was tried and failed; `reason` and `message` say how
    SKIPPED = "Skipped"  # it was not tried (unavailable, or its manifest did not match)


class AttemptReason(StrEnum):
    """Why an attempt (`status.attempts[].reason`) ended as it did: a strategy of the chain (Peer, ObjectStorage,
    LocalFile) or one peer (peer/<replica>). `message` says the rest."""

    LOADED = "Loaded"  # the source delivered the version
    # Loaded from object storage into memory only: the node's checkpoint store cannot fit the version (its quota
    # or its disk, with every evictable artifact gone); it is served all the same, and not stored
    STORE_SKIPPED = "StoreSkipped"
    UNAVAILABLE = "Unavailable"  # the strategy cannot serve this load (no peer, no store, no seed): not tried
    FAILED = "Failed"  # the source failed without changing the target; the next one is tried
    FAILED_MUTATED = "FailedMutated"  # the strategy failed after writing into the target, which was reset for the next
    # ObjectStorage: no credentialsSecret, and the admin's ambientCredentials do not allow the agent's own here
    AMBIENT_CREDENTIALS_DENIED = "AmbientCredentialsDenied"
    RECOVERY_FAILED = "RecoveryFailed"  # the target could not be reset after a failure: the chain stops
    UNEXPECTED_ERROR = "UnexpectedError"  # the strategy raised an error it does not declare (a bug); the next is tried
    MANIFEST_MISMATCH = "ManifestMismatch"  # the peer's tensor manifest is not the advertised (or expected) one
    SOURCE_UNAVAILABLE = "SourceUnavailable"  # the peer's worker service did not answer (gRPC UNAVAILABLE)
    SOURCE_RPC_TIMEOUT = "SourceRpcTimeout"  # a worker RPC to the peer ran past its deadline
    SOURCE_IDENTITY_MISMATCH = "SourceIdentityMismatch"  # the peer's worker service is another agent than listed
    UNAUTHENTICATED = "Unauthenticated"  # the peer did not accept this agent's worker token
    PERMISSION_DENIED = "PermissionDenied"  # the peer refused this node: it is not assigned the version
    SOURCE_RPC_FAILED = "SourceRpcFailed"  # any other gRPC error of the peer
    WORKER_TOKEN_UNAVAILABLE = "WorkerTokenUnavailable"  # this agent could not mint a worker token for the peer's node
    TRANSFER_TIMEOUT = "TransferTimeout"  # the NIXL READ from the peer ran past spec.transfer.timeoutSeconds
    TRANSFER_STALLED = (
        "TransferStalled"  # the NIXL READ from the peer completed no chunk for spec.transfer.stallSeconds
    )
    TRANSFER_FAILED = "TransferFailed"  # the NIXL READ from the peer failed
    TIMEOUT = "Timeout"  # the transfer budget (spec.transfer.timeoutSeconds) ran out before the READ from the peer


class LoadAttempt(_Model):
    """One source a load tried."""

    source: str = Field(max_length=512)
    """A source kind (Peer, ObjectStorage, LocalFile) or one peer (peer/<replica>)."""
    outcome: AttemptOutcome
    """Loaded, Failed or Skipped."""
    reason: str = Field(default="", max_length=128)
    """Why, in CamelCase (e.g. SourceUnavailable, TransferTimeout)."""
    message: str = Field(default="", max_length=4096)
    """The error, for people."""
    time: str | None = None
    """When the attempt ended (RFC 3339)."""


class RankState(StrEnum):
    READY = "Ready"  # the rank's share is resident and its worker service hands it to readers
    LOADING = "Loading"  # the rank is still loading; its worker service hands out the tensors it holds, checked


class RankEndpoint(_Model):
    """Where peers read one rank's share of the served version."""

    rank: int = Field(ge=0)
    """The rank, 0 to spec.ranks-1."""
    agentName: str = Field(max_length=253)
    """NIXL agent name of the rank's process, unique per process."""
    grpcEndpoint: str = Field(max_length=512)
    """host:port of the rank's worker service, where readers take read leases and the NIXL metadata."""
    tensorCount: int = Field(ge=0)
    """Tensors of this rank's share."""
    manifestDigest: str = Field(max_length=128)
    """Digest of the share's manifest (names, shapes, dtypes, sizes); a reader checks the one it gets against it."""
    state: RankState = RankState.READY
    """Ready: readers may copy from this rank. Loading (in `loadingRanks`): they may copy what it holds so far."""


class Attachment(_Model):
    """A consumer pod that holds this replica's bytes through the node's attach socket (a lease per connection)."""

    pod: ObjectName
    """Name of the consumer Pod."""
    podNamespace: ObjectName
    """Namespace of the consumer Pod."""
    podUid: str = Field(max_length=128)
    """uid of the consumer Pod; its socket is pods/<uid>/ferry.sock."""
    version: ObjectName
    """WeightVersion the pod holds; during a refit a pod may hold two."""
    rank: int | None = Field(default=None, ge=0)
    """Rank share held; empty when the pod holds all shares."""
    since: str | None = None
    """When the lease was taken (RFC 3339)."""


class WeightReplicaStatus(_Model):
    """One writer per field: the node agent writes everything but `conditions`, which the operator writes."""

    phase: ReplicaPhase | None = None
    """Pending, Loading, Serving or Failed. Written by the node agent alone. Whether the agent is alive is its
    Lease's to say (the `Live` condition), not a phase's."""
    version: str | None = None
    """The version this replica serves (phase Serving), or loads or failed to load when it serves none."""
    servingVersion: str | None = None
    """The version peers and attached pods are served from right now, and nothing else: empty while a first load
    runs or after it failed, kept while a make-before-break load of `loadingVersion` runs (the Serves column)."""
    loadingVersion: str | None = None
    """A version change in flight (make-before-break): the version the agent loads while it keeps serving
    `version` to peers and attached pods; once resident it becomes `version` and this clears. While set, bytesDone,
    bytesTotal, source, startedTime, lastProgressTime and attempts describe this load (ranks, versionUid and
    activeLeases the served version); reason LoadFailed says its last attempt failed (retried with backoff, the old
    version still served)."""
    versionUid: str | None = Field(default=None, max_length=128)
    """uid of the WeightVersion object the served bytes came from; peers copy only from replicas of the same uid,
    so a deleted and republished name never serves old bytes."""
    source: str | None = None
    """While loading: what the load waits on (peer/<replica>, or the s3:// objects it reads). Once Serving: where
    the bytes came from: peer/<replica>, s3 or local (the node's checkpoint store)."""
    bytesDone: Int64 | None = None
    """Bytes loaded so far."""
    bytesTotal: Int64 | None = None
    """Bytes to load; empty while unknown."""
    progress: str | None = Field(default=None, max_length=64)
    """The load's progress for people, e.g. `42% 1.2Gi/s`: percent of bytesTotal (or the bytes so far while the
    total is not known) and the average rate since startedTime. Written by the agent."""
    startedTime: str | None = None
    """When the current load started (RFC 3339)."""
    completedTime: str | None = None
    """When the last load completed (RFC 3339)."""
    lastProgressTime: str | None = None
    """When the current load last moved bytes (RFC 3339); stall detection counts from it."""
    attempts: list[LoadAttempt] | None = Field(default=None, max_length=64)
    """Every source the current (or last) load tried, in order."""
    ranks: Annotated[
        list[RankEndpoint] | None,
        Field(
            default=None, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["rank"]}
        ),
    ]
    """One entry per rank of the served version: where peers read it."""
    loadingRanks: Annotated[
        list[RankEndpoint] | None,
        Field(
            default=None, json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["rank"]}
        ),
    ]
    """While a rank loads (phase Loading, or `loadingVersion`): where peers read the tensors it holds so far
    (pipelined fan-out; state Loading). Written once when the load starts serving, cleared when it ends."""
    loadingVersionUid: str | None = Field(default=None, max_length=128)
    """uid of the WeightVersion object `loadingRanks` serve (peers read only from a load of the same object)."""
    activeLeases: int | None = Field(default=None, ge=0)
    """Read leases peers hold on the served version now (the loadAware selector prefers idle sources)."""
    attachments: list[Attachment] | None = Field(default=None, max_length=MAX_ATTACHMENTS)
    """Consumer pods attached on this node, one entry per held version (at most 1024 listed; attachedPods counts
    them all)."""
    attachedPods: int | None = Field(default=None, ge=0)
    """Distinct consumer pods attached."""
    residentBytes: Int64 | None = None
    """Host memory the agent holds for this replica, over every version it still keeps."""
    residentVersions: list[str] | None = Field(default=None, max_length=64)
    """WeightVersions whose bytes the agent holds for this replica."""
    reason: ReplicaReason | None = None
    """Why the replica is Failed, or why loading loadingVersion failed (CamelCase); empty otherwise."""
    message: str | None = Field(default=None, max_length=4096)
    """What the agent is doing, or the error, for people."""
    conditions: Conditions
    """Written by the operator: `Live` says whether the agent renews the replica's Lease (`ferry-wr-<replica>`). A
    Serving replica that is not Live is stale: no source, not ready."""
    observedGeneration: int | None = Field(default=None, ge=0)
    """metadata.generation the agent last acted on."""


class WeightReplica(_Resource):
    """One node's copy of a ModelLoad's version: the operator places it, the node's agent loads and serves it."""

    kind: ClassVar[str] = "WeightReplica"
    plural: ClassVar[str] = "weightreplicas"
    short_names: ClassVar[list[str]] = ["wr"]
    cel_rules: ClassVar[list[CelRule]] = []
    printer_columns: ClassVar[list[PrinterColumn]] = [
        PrinterColumn(name="Node", type="string", jsonPath=".spec.nodeName"),
        PrinterColumn(name="Version", type="string", jsonPath=".spec.version"),
        PrinterColumn(name="Phase", type="string", jsonPath=".status.phase"),
        PrinterColumn(name="Serves", type="string", jsonPath=".status.servingVersion"),
        PrinterColumn(name="Loading", type="string", jsonPath=".status.loadingVersion"),
        PrinterColumn(name="Source", type="string", jsonPath=".status.source"),
        condition_column("Live", ReplicaConditionType.LIVE),
        PrinterColumn(name="Attached", type="integer", jsonPath=".status.attachedPods"),
        PrinterColumn(name="Progress", type="string", jsonPath=".status.progress", priority=1),
        AGE_COLUMN,
    ]

    spec: WeightReplicaSpec
    """Written by the operator."""
    status: WeightReplicaStatus | None = None
    """Written by the node agent, except `conditions` (the operator)."""


RESOURCES: list[type[_Resource]] = [WeightVersion, ModelLoad, WeightReplica]


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
