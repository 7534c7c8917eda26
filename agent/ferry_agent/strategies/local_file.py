"""The LocalFile strategy: a version seeded from a safetensors file on this node (`--seed`), keyed by namespace,
model and version."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ferry_agent.kube.registry import peer_version_problem
from ferry_agent.ranks.sharding import rank_specs
from ferry_agent.store.resident import Allocate, ResidentWeights, spec_of
from ferry_agent.strategies.chain import LoadContext, StrategyFailed


@dataclass(frozen=True)
class SeedKey:
    """Which WeightVersion a seed file holds: a version name alone is not an identity (every tenant may have a
    `v1`), so a seed names its namespace and model too."""

    namespace: str
    model: str
    version: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.model}/{self.version}"


def parse_seed(text: str) -> tuple[SeedKey, Path]:
    """`NAMESPACE/MODEL/VERSION=PATH` (a model name may itself contain `/`) → its key and file; ValueError says
    what is wrong."""
    key, sep, path = text.rpartition("=")
    namespace, _, rest = key.partition("/")
    model, _, version = rest.rpartition("/")
    if not sep or not path or not namespace or not model or not version:
        raise ValueError(f"expected NAMESPACE/MODEL/VERSION=PATH, got {text!r}")
    return SeedKey(namespace, model, version), Path(path)


@dataclass
class LocalLoad:
    resident: ResidentWeights
    bytes_moved: int
    source: str = "local"

    @property
    def source_label(self) -> str:
        return self.source


class LocalFileStrategy:
    """Seeds a version from a safetensors file on this node (how the first replica of a PeerOnly version, or a
    node with a pre-staged checkpoint, starts): this rank's share of its tensors. Available only for the exact
    namespace/model/version the file was configured for, and used only while that WeightVersion exists, is Ready
    and (where the operator recorded them) has the file's tensor count and size."""

    name = "LocalFile"

    def __init__(
        self,
        seeds: Mapping[SeedKey, Path],
        namespace: str,
        fetch_version: Callable[[str], dict | None],
        allocate: Allocate = ResidentWeights.allocate,
    ) -> None:
        self._seeds = seeds
        self._namespace = namespace
        self._fetch_version = fetch_version
        self._allocate = allocate

    def _key(self, ctx: LoadContext) -> SeedKey:
        return SeedKey(self._namespace, ctx.model, ctx.version)

    def is_available(self, ctx: LoadContext) -> bool:
        return self._key(ctx) in self._seeds

    def load(self, ctx: LoadContext) -> LocalLoad:
        from safetensors.torch import load_file

        key = self._key(ctx)
        body = self._fetch_version(ctx.version)
        problem = peer_version_problem(body, name=ctx.version, model=ctx.model)
        if problem is not None:
            raise StrategyFailed(f"seed for {key} not used: {problem}", mutated=False)
        assert body is not None
        path = self._seeds[key]
        try:
            tensors = load_file(str(path), device=ctx.device)
        except (OSError, ValueError) as exc:
            raise StrategyFailed(f"cannot read {path}: {exc}", mutated=False) from exc
        status = body.get("status") or {}
        held = {"tensorCount": len(tensors), "totalBytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        for field, value in held.items():
            if status.get(field) is not None and status[field] != value:
                raise StrategyFailed(
                    f"seed {path} does not hold {key}: {field} {value}, the WeightVersion has {status[field]}",
                    mutated=False,
                )
        ctx.version_uid = str(body["metadata"]["uid"])
        mine = rank_specs([spec_of(n, t) for n, t in sorted(tensors.items())], ctx.rank, ctx.world_size)
        try:
            resident = self._allocate(mine, ctx.device, same_bytes(tensors))
        except (RuntimeError, ValueError) as exc:  # out of memory, or beyond the host-memory budget
            raise StrategyFailed(f"cannot hold the seed {path}: {exc}", mutated=False) from exc
        for spec in mine:  # the file's tensors are a transient copy: the resident one is the allocated memory
            tensor = tensors.pop(spec.name)
            if spec.name not in resident.shared:
                resident.tensors[spec.name].copy_(tensor)
        return LocalLoad(resident, resident.total_bytes)

    def rollback(self, ctx: LoadContext) -> None:
        """Nothing is held before `load` returns."""


def same_bytes(tensors: Mapping[str, Any]) -> Callable[[Any], list[str]]:
    """A `share` for the host store: the names whose bytes in `tensors` are those of a held version's entries
    (by sha256, computed once a tensor and only when asked)."""
    digests: dict[str, str] = {}

    def digest(name: str) -> str:
        if name not in digests:
            flat = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
            digests[name] = hashlib.sha256(flat.cpu().numpy()).hexdigest()
        return digests[name]

    def share(version: Any) -> list[str]:
        return [e.name for e in version.entries if e.name in tensors and e.nbytes and digest(e.name) == e.sha256]

    return share
