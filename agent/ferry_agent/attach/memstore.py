"""A version's tensors in sealed memfd chunks the agent owns.

Each chunk is a `memfd_create` file, sized with `ftruncate`, written through a temporary shared mapping that is
unmapped again, then sealed `F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL`: from then on nobody (the
agent included) can change, resize or unseal it, so a consumer may map it read-only and trust that what it reads
stays what the manifest describes. The memory lives while any descriptor or mapping of it does: the agent's
descriptors (closed when the version is neither offered nor leased) and each consumer's mappings.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ferry.client.protocol import MAX_FDS, REQUIRED_SEALS

# Chunks stay at most this big (a tensor larger than it gets a chunk of its own); offsets are 256-B aligned, which
# satisfies every dtype and vectorised copies.
CHUNK_BYTES = 1 << 30
ALIGN = 256


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Entry:
    """One tensor of the manifest. `dtype` is the torch name without the `torch.` prefix, e.g. `bfloat16`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk: int
    offset: int
    nbytes: int
    adler32: int
    sha256: str  # what `changed` against another version compares (adler32 is too weak to tell versions apart)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "chunk": self.chunk,
            "offset": self.offset, "nbytes": self.nbytes, "adler32": self.adler32,
        }  # fmt: skip

    def identity(self) -> tuple[str, tuple[int, ...], str]:
        return self.dtype, self.shape, self.sha256


def layout(
    tensors: Mapping[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES
) -> tuple[list[int], dict[str, tuple[int, int]]]:
    """Chunk sizes and each tensor's (chunk, offset), in name order."""
    sizes: list[int] = []
    places: dict[str, tuple[int, int]] = {}
    used = 0
    for name in sorted(tensors):
        nbytes = _aligned(tensors[name].numel() * tensors[name].element_size())
        if not sizes or (used + nbytes > chunk_bytes and used > 0):
            sizes.append(0)
            used = 0
        places[name] = (len(sizes) - 1, used)
        used += nbytes
        sizes[-1] = max(used, ALIGN)  # never an empty chunk: a zero-length file cannot be mapped
    return sizes, places


class SealedVersion:
    """Sealed chunks and their manifest. Reference counted: the agent's offer holds one, each lease one; the
    descriptors close when the count reaches zero."""

    def __init__(self, label: str, fds: list[int], chunk_sizes: list[int], entries: list[Entry]) -> None:
        self.label = label
        self.fds = fds
        self.chunk_sizes = chunk_sizes
        self.entries = entries
        self.total_bytes = sum(e.nbytes for e in entries)
        self._refs = 1
        self._leases = 0
        self._lock = threading.Lock()
        # Set by whoever offers it: the version it was compared with, and the names whose bytes differ from it.
        self.base_uid: str | None = None
        self.changed: frozenset[str] | None = None

    @property
    def closed(self) -> bool:
        return not self.fds

    @property
    def leases(self) -> int:
        return self._leases

    def lease(self) -> None:
        with self._lock:
            if not self.fds:
                raise RuntimeError(f"{self.label} is already freed")
            self._refs += 1
            self._leases += 1

    def unlease(self) -> None:
        with self._lock:
            self._leases -= 1
        self.unref()

    def unref(self) -> None:
        with self._lock:
            self._refs -= 1
            if self._refs > 0:
                return
            fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def manifest(self) -> dict[str, Any]:
        """Chunks and tensors; with a base, each tensor says whether it differs from the base's."""
        tensors = [e.to_json() for e in self.entries]
        if self.changed is not None:
            for t in tensors:
                t["changed"] = t["name"] in self.changed
        return {
            "baseUid": self.base_uid,
            "chunks": [{"index": i, "nbytes": n} for i, n in enumerate(self.chunk_sizes)],
            "tensors": tensors,
        }


def seal_tensors(tensors: Mapping[str, torch.Tensor], label: str, chunk_bytes: int = CHUNK_BYTES) -> SealedVersion:
    """Copy `tensors` (contiguous, any device) into new sealed memfd chunks."""
    if not tensors:
        raise ValueError("a sealed version needs at least one tensor")
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous")
    sizes, places = layout(tensors, chunk_bytes)
    if len(sizes) > MAX_FDS:
        raise ValueError(f"{len(sizes)} chunks exceed the {MAX_FDS} descriptors one attach reply can carry")
    fds: list[int] = []
    entries: list[Entry] = []
    try:
        for index, size in enumerate(sizes):
            fd = os.memfd_create(f"ferry:{label}:{index}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            fds.append(fd)
            os.ftruncate(fd, size)
            names = [n for n in sorted(tensors) if places[n][0] == index]
            entries.extend(_write_chunk(fd, size, index, {n: tensors[n] for n in names}, places))
            # The mapping is gone, so F_SEAL_WRITE can be taken (it fails while any writable mapping exists).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return SealedVersion(label, fds, sizes, entries)


def _write_chunk(
    fd: int, size: int, index: int, tensors: Mapping[str, torch.Tensor], places: Mapping[str, tuple[int, int]]
) -> list[Entry]:
    entries = []
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
        view = memoryview(mapped)
        try:
            target = torch.frombuffer(mapped, dtype=torch.uint8)
            for name, tensor in tensors.items():
                _, offset = places[name]
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    target[offset : offset + nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
                with view[offset : offset + nbytes] as written:  # a slice is an export too: released at once
                    checksum, digest = zlib.adler32(written), hashlib.sha256(written).hexdigest()
                dtype = str(tensor.dtype).removeprefix("torch.")
                entries.append(Entry(name, dtype, tuple(tensor.shape), index, offset, nbytes, checksum, digest))
            del target  # the tensor holds an export of the mapping, which must be released before it closes
        finally:
            view.release()
    return entries
