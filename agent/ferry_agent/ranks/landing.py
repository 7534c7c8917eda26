"""The node's one copy of a multi-rank S3 load: the local leader lands the other ranks' tensors in shared memory,
and each of them serves its share from those very pages (docs/ranks.md).

The leader streams the whole checkpoint from S3 once, its own share straight into its pool and every other rank's
into memfd chunks of that rank's own (`Landing`, laid out as `attach.memstore` lays out a version: name order,
256-byte offsets, at most 1 GiB a chunk), checking each tensor's adler32 as its last range arrives. It then seals
every chunk (`F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL`, after remapping its own pages read-only),
so the bytes the leader checked are the bytes every follower holds: nobody can change them afterwards. A follower
opens its chunks through `/proc/<leader pid>/fd/<n>` (the ranks are one node agent's children, under one uid),
refuses any that is not sealed or not of its size, and on `cpu` takes them over as its resident share (`share`:
mapped read-only, no copy); on a GPU it copies its tensors out (`copy_share`). The leader keeps its descriptors
until every rank has loaded, and its pages until the node's store entry is written behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ferry_agent.attach.memstore import Chunk, HostStore, _Mapping, layout
from ferry_agent.store.resident import ResidentWeights, TensorSpec, manifest_digest

# `(fds, sizes, specs, places)` -> the weights, views of those sealed chunks (`HostStore.map_sealed` of a replica).
Places = Mapping[str, tuple[int, int]]  # tensor -> (chunk, offset)
MapSealed = Callable[[Sequence[int], Sequence[int], Sequence[TensorSpec], Places], ResidentWeights]


def unaccounted(
    fds: Sequence[int], sizes: Sequence[int], specs: Sequence[TensorSpec], places: Places
) -> ResidentWeights:
    """`map_sealed` into a store of its own: for a rank that has no host store (tests, benches)."""
    return HostStore().map_sealed(None, fds, sizes, specs, places)


class Landing:
    """The tensors of the ranks other than the leader: each rank's in memfd chunks of its own."""

    def __init__(
        self, shares: Mapping[int, Sequence[TensorSpec]], label: str, checksums: Mapping[str, str] | None = None
    ) -> None:
        """`checksums`: each tensor's adler32, which the stream checks as it lands it (handed to the followers, so
        that they serve with them instead of reading every byte again)."""
        self._checksums = checksums or {}
        self._chunks: list[Chunk] = []
        self._mappings: list[_Mapping] = []
        self._ranks: dict[int, dict[str, Any]] = {}
        # Where the stream lands each tensor; they stay valid (the pages mapped) as long as any view of them lives.
        self.views: dict[str, np.ndarray] = {}
        self._open = True
        try:
            for rank, specs in sorted(shares.items()):
                self._add(rank, specs, f"{label}#{rank}")
        except BaseException:
            self.close()
            raise

    def _add(self, rank: int, specs: Sequence[TensorSpec], label: str) -> None:
        sizes, places = layout(specs)
        payloads = [0] * len(sizes)
        for spec in specs:
            payloads[places[spec.name][0]] += spec.nbytes
        first = len(self._chunks)
        for index, (size, payload) in enumerate(zip(sizes, payloads, strict=True)):
            chunk = Chunk(f"{label}:{index}", size, payload, on_free=lambda _chunk: None)
            self._chunks.append(chunk)
            self._mappings.append(_Mapping(chunk, writable=True))
        pages = [m.tensor() for m in self._mappings[first:]]
        for spec in specs:
            index, offset = places[spec.name]
            self.views[spec.name] = pages[index][offset : offset + spec.nbytes].numpy()
        self._ranks[rank] = {
            "fds": [c.fd for c in self._chunks[first:]],
            "sizes": sizes,
            "tensors": [(s.name, s.dtype, list(s.shape), s.nbytes, *places[s.name]) for s in specs],
            "checksums": {s.name: self._checksums[s.name] for s in specs if s.name in self._checksums},
        }

    def seal(self) -> None:
        """No more writes, by anybody: the same pages read-only here, then every chunk sealed."""
        for mapping in self._mappings:
            mapping.make_readonly()
            mapping.chunk.seal()

    def descriptor(self) -> dict[str, Any]:
        """What a follower maps (picklable: it travels in the phase collective)."""
        return {"pid": os.getpid(), "ranks": self._ranks}

    def close(self) -> None:
        """Close the descriptors (once every follower holds its own); `views` keep the pages until they go."""
        if self._open:
            self._open = False
            for chunk in self._chunks:
                chunk.unref()


class MappedLanding:
    """A follower's share of its local leader's landing: its own descriptors of its sealed chunks."""

    def __init__(self, descriptor: Mapping[str, Any], rank: int) -> None:
        ranks = descriptor["ranks"]
        mine = ranks.get(rank) or ranks.get(str(rank))
        if not mine:
            raise ValueError(f"the local leader's landing holds nothing for rank {rank}")
        entries = mine["tensors"]
        self.specs = [TensorSpec(name, dtype, tuple(shape), nbytes) for name, dtype, shape, nbytes, _, _ in entries]
        self.places = {name: (int(chunk), int(offset)) for name, _, _, _, chunk, offset in entries}
        self.sizes = [int(s) for s in mine["sizes"]]
        checksums = dict(mine.get("checksums") or {})
        # What the leader checked each tensor against (the replica serves with them), when it names them all.
        self.checksums = checksums if set(checksums) == set(self.places) else None
        self._fds: list[int] = []
        try:
            for fd, size in zip(mine["fds"], self.sizes, strict=True):
                path = f"/proc/{int(descriptor['pid'])}/fd/{int(fd)}"
                self._fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                if os.fstat(self._fds[-1]).st_size != size:
                    raise ValueError(f"the local leader's landing {path} has {os.fstat(self._fds[-1]).st_size} bytes")
                Chunk.check_sealed(self._fds[-1], f"the local leader's landing {path}")
        except BaseException:
            self.close()
            raise

    def share(self, expected_digest: str | None, map_sealed: MapSealed) -> ResidentWeights:
        """This rank's share in host memory: the landing's pages themselves, read-only (the descriptors are
        `map_sealed`'s from here on)."""
        self.check(expected_digest)
        fds, self._fds = self._fds, []
        resident = map_sealed(fds, self.sizes, self.specs, self.places)
        resident.checksums = self.checksums
        return resident

    def copy_share(self, resident: ResidentWeights, pool: ThreadPoolExecutor) -> None:
        """Copy this rank's tensors into `resident` (its own pool, on another device), in parallel."""
        mine = zip(self._fds, self.sizes, strict=True)
        chunks = [Chunk.adopt(os.dup(fd), size, 0, lambda _chunk: None) for fd, size in mine]
        try:
            pages = [_Mapping(chunk, writable=False).tensor() for chunk in chunks]

            def copy(spec: TensorSpec) -> None:
                if spec.nbytes:
                    index, offset = self.places[spec.name]
                    target = resident.tensors[spec.name].reshape(-1).view(torch.uint8)
                    target.copy_(pages[index][offset : offset + spec.nbytes])

            for future in [pool.submit(copy, spec) for spec in self.specs]:
                future.result()
            resident.checksums = self.checksums
        finally:
            for chunk in chunks:
                chunk.unref()

    def check(self, expected: str | None) -> None:
        """ValueError unless the landed share has the manifest digest the replica expects (when it expects one)."""
        if expected and manifest_digest(self.specs) != expected:
            raise ValueError(
                f"the share the local leader landed has manifest digest {manifest_digest(self.specs)}, "
                f"but the replica expects {expected}"
            )

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
