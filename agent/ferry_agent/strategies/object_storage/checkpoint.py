"""What one object-storage load works on: the versions of its replay chain (`Link`), each validated checkpoint
(`Checkpoint`, of `Shard`s) and the `Plan` that builds the target from them; and `LoadError`, every failure of a
load (the S3 errors translated by `s3_error`), which the strategy turns into `StrategyFailed`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ferry import checkpoint_format as ckpt
from ferry import s3
from ferry_agent.store.checkpoints import ArtifactRef, VersionIdentity, head_ref
from ferry_agent.store.resident import TensorSpec

CHECKSUMS_FILE = "checksums.json"  # materialized/<v>/: adler32 per tensor of version v
CHAIN_FILE = "chain.json"  # materialized/<v>/: the replay chain it was built from


class LoadError(Exception):
    """A failure whose message becomes the StrategyFailed message; `discard` names a stored artifact found
    corrupt, which is removed so that a retry fetches it again."""

    def __init__(self, message: str, discard: ArtifactRef | None = None) -> None:
        super().__init__(message)
        self.discard = discard


@dataclass(frozen=True)
class Link:
    """One version of the replay chain, as the API describes it."""

    name: str
    format: str
    base: str | None
    storage: Mapping[str, Any]
    bucket: str
    key: str  # of the index
    namespace: str
    uid: str
    index_digest: str | None  # status.indexDigest, recorded by the operator when it verified the version

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def expected(self) -> VersionIdentity:
        """What a stored copy of this version must have been written from."""
        return VersionIdentity(self.namespace, self.uid, self.uri, self.index_digest)

    def shard_key(self, shard: str) -> str:
        prefix = self.key.rpartition("/")[0]
        return f"{prefix}/{shard}" if prefix else shard

    def shard_uri(self, shard: str) -> str:
        return f"s3://{self.bucket}/{self.shard_key(shard)}"


@dataclass(frozen=True)
class Shard:
    name: str
    layout: ckpt.ShardLayout
    header: bytes  # the validated first `data_start` bytes; a downloaded file must start with exactly these


@dataclass
class Checkpoint:
    """One validated checkpoint: in the store (`path`) or still in S3 (`path` is None until downloaded)."""

    link: Link
    ref: ArtifactRef
    index_raw: bytes
    index: ckpt.CheckpointIndex
    shards: dict[str, Shard]
    checksums: dict[str, str]  # tensor → adler32 of the version's bytes (deltas: of the changed tensors)
    path: Path | None
    identity: tuple[VersionIdentity, ...]  # of the versions its bytes come from (a materialized one: its chain)
    client: Any = None

    def where(self, shard: str | None = None) -> str:
        """For messages: the S3 object, and the local copy when reading from the store."""
        uri = self.link.shard_uri(shard) if shard else self.link.uri
        if self.path is None:
            return uri
        return f"{self.path / shard if shard else self.path} (stored copy of {uri})"

    @property
    def stored_bytes(self) -> int:
        return len(self.index_raw) + sum(s.layout.size for s in self.shards.values())


@dataclass
class Plan:
    model: str
    chain: tuple[str, ...]
    base: Checkpoint  # the full root, or a materialized version of the chain: where replay starts
    deltas: list[Checkpoint]  # applied after `base`, in chain order
    layout: dict[str, tuple[Shard, ckpt.TensorInfo]]  # tensor → where it lives in base (and so in the target)
    specs: list[TensorSpec]
    reused: str | None
    # The base version held in the agent's host memory (a `memstore.SealedVersion`, referenced by the load): replay
    # reads the base bytes from its sealed chunks, so the store need not hold the base.
    held: Any = None
    head: ArtifactRef = field(init=False)

    def __post_init__(self) -> None:
        self.head = head_ref(self.model, self.chain)

    @property
    def target_checksums(self) -> dict[str, str]:
        """Each tensor's adler32 in the target: the base's, then each delta's for the tensors it changes."""
        checksums = dict(self.base.checksums)
        for delta in self.deltas:
            checksums.update(delta.checksums)
        return checksums

    @property
    def tensor_specs(self) -> list[TensorSpec]:
        """Every tensor of the target (every rank's), by name."""
        return layout_specs(self.layout)


def layout_specs(layout: Mapping[str, tuple[Shard, ckpt.TensorInfo]]) -> list[TensorSpec]:
    """The specs of the tensors of `layout` (tensor → where it lives in a shard), by name."""
    return [
        TensorSpec(name, f"torch.{ckpt.TORCH_DTYPES[info.dtype]}", info.shape, info.nbytes)
        for name, (_, info) in sorted(layout.items())
    ]


def s3_error(exc: Exception, uri: str) -> LoadError:
    """The load's error for a failed S3 request, worded by the one translator (`ferry.s3.translate`)."""
    return LoadError(str(s3.translate(exc, uri)))
