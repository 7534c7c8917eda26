"""Resident weights of one rank: named tensors on one device, with a manifest and its digest.

The same code path serves `cpu` (tests) and `cuda` (production). Tensors must be contiguous and are never
copied: a READ must land in the tensor's own memory, and `.contiguous()` would silently redirect it into a
temporary.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

# Offsets inside an allocated pool are rounded up to this, which satisfies every dtype's alignment.
_POOL_ALIGN = 256


@dataclass(frozen=True)
class TensorSpec:
    """One manifest entry. `dtype` is `str(torch.dtype)`, e.g. `torch.bfloat16`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes}


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def manifest_digest(specs: Iterable[TensorSpec]) -> str:
    """sha256 of the canonical manifest JSON: entries sorted by name, sorted keys, no whitespace."""
    entries = [s.to_json() for s in sorted(specs, key=lambda s: s.name)]
    canonical = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())


def mem_type(device: torch.device) -> str:
    """The NIXL memory segment type of a device."""
    return "DRAM" if device.type == "cpu" else "VRAM"


def device_id(device: torch.device) -> int:
    return 0 if device.type == "cpu" else (device.index or 0)


class ResidentWeights:
    """Named tensors of one rank. Registration with NIXL is recorded here so it happens exactly once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("resident weights need at least one tensor")
        devices = {t.device for t in tensors.values()}
        if len(devices) != 1:
            raise ValueError(f"all tensors of a rank must be on one device, got {sorted(map(str, devices))}")
        for name, tensor in tensors.items():
            if not name:
                raise ValueError("tensor names must be non-empty")
            if not tensor.is_contiguous():
                raise ValueError(f"tensor {name!r} is not contiguous; a transfer target must be")
        self._tensors = dict(tensors)
        self.device: torch.device = devices.pop()
        self.manifest: tuple[TensorSpec, ...] = tuple(
            spec_of(name, self._tensors[name]) for name in sorted(self._tensors)
        )
        self.digest = manifest_digest(self.manifest)
        self.total_bytes = sum(s.nbytes for s in self.manifest)
        self.registration: Any = None  # set once by NixlPeer.register
        self.host: Any = None  # the host memory the tensors live in, when a HostStore allocated them
        # Tensors that are views of another held version's sealed memory (same bytes): read-only, never written.
        self.shared: frozenset[str] = frozenset()
        self.shared_from: Any = None  # the held version they are of, until these weights are sealed
        # adler32 hex per tensor, set by a load that checked every tensor against them (what readers check theirs
        # against); None: not known.
        self.checksums: dict[str, str] | None = None

    @classmethod
    def allocate(cls, specs: Iterable[TensorSpec], device: str | torch.device, share: Any = None) -> ResidentWeights:
        """Allocate uninitialised tensors for `specs` as views of one pool, so NIXL registers one region. `share`
        is for allocators that can share a held version's memory (`memstore.HostStore`); here nothing is."""
        specs = list(specs)
        offsets: list[int] = []
        size = 0
        for spec in specs:
            offsets.append(size)
            size += -(-spec.nbytes // _POOL_ALIGN) * _POOL_ALIGN
        pool = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        tensors: dict[str, torch.Tensor] = {}
        for spec, offset in zip(specs, offsets, strict=True):
            dtype = parse_dtype(spec.dtype)
            tensor = pool[offset : offset + spec.nbytes].view(dtype).reshape(spec.shape)
            if spec_of(spec.name, tensor) != spec:
                raise ValueError(f"inconsistent manifest entry {spec}")
            tensors[spec.name] = tensor
        return cls(tensors)

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        return MappingProxyType(self._tensors)

    @property
    def tensor_count(self) -> int:
        return len(self._tensors)

    def storage_regions(self) -> list[tuple[int, int]]:
        """Unique (address, nbytes) of the allocations backing the tensors: what NIXL registers."""
        regions: dict[int, int] = {}
        for tensor in self._tensors.values():
            if tensor.numel() == 0:
                continue  # NIXL cannot register (or move) zero-length regions
            storage = tensor.untyped_storage()
            regions[storage.data_ptr()] = storage.nbytes()
        return sorted(regions.items())

    def content_sha256(self) -> str:
        """sha256 over (name, bytes) in manifest order; copies to host memory, so meant for verification."""
        h = hashlib.sha256()
        for spec in self.manifest:
            h.update(spec.name.encode() + b"\0")
            tensor = self._tensors[spec.name]
            if spec.nbytes:
                h.update(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy())
        return h.hexdigest()


# What a strategy allocates its target with: `(specs, device[, share]) -> ResidentWeights` (`share`:
# `memstore.Share`, the tensors a held version has the same bytes of).
Allocate = Callable[..., ResidentWeights]
