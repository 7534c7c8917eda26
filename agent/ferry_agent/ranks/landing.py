"""The node's one copy of a multi-rank S3 load: the local leader lands the other ranks' tensors in shared memory,
and each of them maps it and copies out its share (docs/ranks.md).

The leader streams the whole checkpoint from S3 once, its own share straight into its pool and every other rank's
into one `memfd` (`Landing`), checking each tensor's adler32 as its last range arrives. It then seals the memfd
(`F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL`, after remapping its own pages read-only, as
`attach.memstore` does), so the bytes the leader checked are the bytes every follower reads: nobody can change them
afterwards. A follower opens the leader's descriptor through `/proc/<pid>/fd/<n>` (the ranks are one node agent's
children, under one uid), maps it read-only and copies its tensors into its own pool (`copy_share`). The leader
keeps the memfd open until every rank has loaded, and its pages until the node's store entry is written behind.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ferry.client.protocol import REQUIRED_SEALS
from ferry_agent.attach.memstore import Chunk, _Mapping
from ferry_agent.store.resident import ResidentWeights, TensorSpec

ALIGN = 256  # every tensor's offset: satisfies every dtype and vectorised copies


class Landing:
    """One memfd holding the tensors of the ranks other than the leader, by rank."""

    def __init__(self, shares: Mapping[int, Sequence[TensorSpec]], label: str) -> None:
        places: dict[int, list[tuple[TensorSpec, int]]] = {}
        size = 0
        for rank, specs in sorted(shares.items()):
            for spec in specs:
                places.setdefault(rank, []).append((spec, size))
                size += -(-spec.nbytes // ALIGN) * ALIGN
        size = max(size, ALIGN)  # a zero-length file cannot be mapped
        self._chunk = Chunk(label, size, size, on_free=lambda _chunk: None)
        try:
            self._mapping = _Mapping(self._chunk, writable=True)
        except BaseException:
            self._chunk.unref()
            raise
        pages = self._mapping.tensor()
        self._places = places
        self.size = size
        # Where the stream lands each tensor; they stay valid (the pages mapped) as long as any view of them lives.
        self.views: dict[str, np.ndarray] = {
            spec.name: pages[offset : offset + spec.nbytes].numpy()
            for entries in places.values()
            for spec, offset in entries
        }
        self._open = True

    def seal(self) -> None:
        """No more writes, by anybody: the same pages read-only here, then the memfd sealed."""
        self._mapping.make_readonly()
        self._chunk.seal()

    def descriptor(self) -> dict[str, Any]:
        """What a follower maps (picklable: it travels in the phase collective)."""
        return {
            "pid": os.getpid(),
            "fd": self._chunk.fd,
            "size": self.size,
            "shares": {
                rank: [(s.name, s.dtype, list(s.shape), s.nbytes, offset) for s, offset in entries]
                for rank, entries in self._places.items()
            },
        }

    def close(self) -> None:
        """Close the descriptor (once every follower has its copy); `views` keep the pages until they go."""
        if self._open:
            self._open = False
            self._chunk.unref()


class MappedLanding:
    """A follower's read-only view of its local leader's landing."""

    def __init__(self, descriptor: Mapping[str, Any], rank: int) -> None:
        path = f"/proc/{int(descriptor['pid'])}/fd/{int(descriptor['fd'])}"
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise ValueError(f"the local leader's landing {path} is not sealed (seals {seals:#x})")
            size = int(descriptor["size"])
            if os.fstat(fd).st_size != size:
                raise ValueError(f"the local leader's landing {path} has {os.fstat(fd).st_size} bytes, not {size}")
            # Private and writable, never written: no copy-on-write happens, and torch takes the buffer without
            # a read-only warning. The memfd is sealed, so these pages are the leader's checked bytes.
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        shares = descriptor["shares"]
        entries = shares.get(rank) or shares.get(str(rank)) or []
        self.specs = [TensorSpec(name, dtype, tuple(shape), nbytes) for name, dtype, shape, nbytes, _ in entries]
        self._offsets = {name: offset for name, _, _, _, offset in entries}

    def copy_share(self, resident: ResidentWeights, pool: ThreadPoolExecutor) -> None:
        """Copy this rank's tensors into `resident` (its own pool, on any device), in parallel."""
        pages = torch.frombuffer(self._map, dtype=torch.uint8)

        def copy(spec: TensorSpec) -> None:
            if spec.nbytes:
                offset = self._offsets[spec.name]
                resident.tensors[spec.name].reshape(-1).view(torch.uint8).copy_(pages[offset : offset + spec.nbytes])

        for future in [pool.submit(copy, spec) for spec in self.specs]:
            future.result()
