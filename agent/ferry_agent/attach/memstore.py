"""The agent's host memory for resident versions: sealed memfd chunks, one copy for every use.

A CPU version is loaded by its strategy (peer READ, S3 replay, local seed) straight into fresh `memfd_create`
chunks, mapped shared and writable (`HostStore.allocate`). `HostStore.seal` then maps the very same pages again,
read-only and at the same address (`MAP_FIXED` over the writable mapping, through an `O_RDONLY` descriptor, so no
writable mapping is left), and seals each chunk `F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL`. From
then on nobody, the agent and a NIXL peer included, can change, resize or unseal those bytes: the tensors the
loader filled are what NIXL registers for peer reads, what a delta replays on, and what attach hands to engine pods
by `SCM_RIGHTS`. Why F_SEAL_WRITE and not F_SEAL_FUTURE_WRITE: docs/security.md.

Chunks are reference counted by the versions that place tensors in them, so a delta version that shares its base's
unchanged tensors keeps the base's chunks alive as long as either is held. The store counts the tensor bytes of
every live chunk once (`resident_bytes`) and refuses an allocation beyond its budget (`MemoryBudgetExceeded`).

`seal_tensors` is the copy path, for tensors that do not live in host memory (a CUDA replica's): it allocates,
copies and seals in one call. `map_sealed` is the no-copy path for chunks another process wrote and sealed (a
rank's share of its local leader's landing, `ranks.landing`): the store takes their descriptors over.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ferry.checkpoint_format import adler32
from ferry.client.protocol import MAX_FDS, REQUIRED_SEALS
from ferry_agent.store.resident import ResidentWeights, TensorSpec, parse_dtype, spec_of

log = logging.getLogger("ferry.agent.memstore")

# `share(version)`: the names of the tensors a new version has the very bytes of in `version` (a held one).
Share = Callable[["SealedVersion"], Iterable[str]]

# Chunks stay at most this big (a tensor larger than it gets a chunk of its own); offsets are 256-B aligned, which
# satisfies every dtype and vectorised copies.
CHUNK_BYTES = 1 << 30
ALIGN = 256

_MAP_FIXED = 0x10
_MADV_HUGEPAGE = 14
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


# The host's policy for huge pages in shared memory, which memfd chunks are. With `advise` (or `within_size`,
# `always`, `force`) the chunks' `MADV_HUGEPAGE` gives them 2 MiB pages: a fresh 256 MiB target faults in ~8x
# faster and every consumer maps 512x fewer pages. `never` (many distributions' default) and `deny` keep 4 KiB pages.
SHMEM_HUGE_PAGES = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
_SHMEM_HUGE_MODES = frozenset({"always", "within_size", "advise", "force"})


def shmem_huge_pages(setting: Path = SHMEM_HUGE_PAGES) -> tuple[str | None, bool]:
    """The host's shmem huge-page mode (the bracketed word of `shmem_enabled`; None where the kernel has no such
    setting) and whether the agent's chunks get huge pages under it."""
    try:
        words = setting.read_text().split()
    except OSError:
        return None, False
    mode = next((w.strip("[]") for w in words if w.startswith("[")), None)
    return mode, mode in _SHMEM_HUGE_MODES


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class MemoryBudgetExceeded(RuntimeError):
    """An allocation would take the agent's resident host memory beyond its budget."""

    def __init__(self, needed: int, available: int, budget: int) -> None:
        super().__init__(f"needs {needed} bytes of host memory, {available} of the {budget}-byte budget are available")
        self.needed = needed
        self.available = available
        self.budget = budget


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
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk": self.chunk,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "adler32": self.adler32,
        }

    def identity(self) -> tuple[str, tuple[int, ...], str]:
        return self.dtype, self.shape, self.sha256


def layout(specs: Iterable[TensorSpec], chunk_bytes: int = CHUNK_BYTES) -> tuple[list[int], dict[str, tuple[int, int]]]:
    """Chunk sizes and each tensor's (chunk, offset), in name order."""
    sizes: list[int] = []
    places: dict[str, tuple[int, int]] = {}
    used = 0
    for spec in sorted(specs, key=lambda s: s.name):
        nbytes = _aligned(spec.nbytes)
        if not sizes or (used + nbytes > chunk_bytes and used > 0):
            sizes.append(0)
            used = 0
        places[spec.name] = (len(sizes) - 1, used)
        used += nbytes
        sizes[-1] = max(used, ALIGN)  # never an empty chunk: a zero-length file cannot be mapped
    return sizes, places


class Chunk:
    """One memfd: written once, then sealed. Counted by the versions (and the load in progress) that use it; its
    descriptor closes with the last of them, its pages go with the last mapping (the agent's, or a consumer's)."""

    def __init__(self, label: str, size: int, payload: int, on_free: Callable[[Chunk], None]) -> None:
        self.fd = os.memfd_create(f"ferry:{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.payload = payload  # tensor bytes placed in it: what accounting counts (alignment padding is not)
        self.sealed = False
        self._refs = 1
        self._lock = threading.Lock()
        self._on_free = on_free

    @classmethod
    def adopt(cls, fd: int, size: int, payload: int, on_free: Callable[[Chunk], None]) -> Chunk:
        """A sealed chunk another process made (a rank process's), by a descriptor of it this process owns now."""
        cls.check_sealed(fd, "chunk")
        if os.fstat(fd).st_size < size:
            raise ValueError(f"chunk of {os.fstat(fd).st_size} bytes, expected {size}")
        chunk = cls.__new__(cls)
        chunk.fd, chunk.size, chunk.payload, chunk.sealed = fd, size, payload, True
        chunk._refs, chunk._lock, chunk._on_free = 1, threading.Lock(), on_free
        return chunk

    @staticmethod
    def check_sealed(fd: int, what: str) -> None:
        """Raise unless `fd` is a memfd nobody can write, grow, shrink or unseal any more."""
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise ValueError(f"{what} is not sealed (seals {seals:#x})")

    def ref(self) -> None:
        with self._lock:
            if self._refs <= 0:
                raise RuntimeError("chunk already freed")
            self._refs += 1

    def unref(self) -> None:
        with self._lock:
            self._refs -= 1
            if self._refs > 0:
                return
            fd, self.fd = self.fd, -1
        os.close(fd)
        self._on_free(self)

    def seal(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
        self.sealed = True


class _Mapping:
    """The agent's mapping of one chunk; unmapped when the last tensor viewing it (through `buffer`) is gone."""

    def __init__(self, chunk: Chunk, *, writable: bool) -> None:
        if writable:
            addr = _libc.mmap(None, chunk.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, chunk.fd, 0)
        else:
            addr = _map_readonly(chunk, None)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {chunk.size} bytes failed: {os.strerror(err)}")
        if writable:
            # Huge pages for the chunk where the host allows them for shmem (`shmem_enabled` = advise): every
            # consumer then maps 2 MiB at a time instead of faulting 4 KiB pages in. Advice only; ignored otherwise.
            _libc.madvise(addr, chunk.size, _MADV_HUGEPAGE)
        self.addr: int = addr
        self.size = chunk.size
        self.chunk = chunk
        weakref.finalize(self, _libc.munmap, addr, chunk.size)

    def tensor(self) -> torch.Tensor:
        """The whole chunk as bytes; the mapping lives while this tensor or a view of it does."""
        buffer = (ctypes.c_ubyte * self.size).from_address(self.addr)
        buffer.owner = self  # type: ignore[attr-defined]
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def make_readonly(self) -> None:
        """The same pages, read-only, at the same address: every tensor viewing them stays valid."""
        addr = _map_readonly(self.chunk, self.addr)
        if addr != self.addr:
            err = ctypes.get_errno()
            raise OSError(err, f"read-only remap failed: {os.strerror(err)}")

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview((ctypes.c_ubyte * nbytes).from_address(self.addr + offset)).cast("B")


def _map_readonly(chunk: Chunk, at: int | None) -> int | None:
    # An O_RDONLY descriptor: a shared mapping of it is not writable, so it does not stand in F_SEAL_WRITE's way.
    ro = os.open(f"/proc/self/fd/{chunk.fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        flags = mmap.MAP_SHARED | (_MAP_FIXED if at is not None else 0)
        return _libc.mmap(at, chunk.size, mmap.PROT_READ, flags, ro, 0)
    finally:
        os.close(ro)


def _tensors(
    mappings: Sequence[_Mapping], specs: Iterable[TensorSpec], places: Mapping[str, tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """Each spec's tensor: a view at its place (chunk index, offset) in the mapped chunks, checked against it."""
    pools = [m.tensor() for m in mappings]
    tensors: dict[str, torch.Tensor] = {}
    for spec in specs:
        index, offset = places[spec.name]
        raw = pools[index][offset : offset + spec.nbytes]
        tensors[spec.name] = raw.view(parse_dtype(spec.dtype)).reshape(spec.shape)
        if spec_of(spec.name, tensors[spec.name]) != spec:
            raise ValueError(f"inconsistent manifest entry {spec}")
    return tensors


@dataclass
class _Building:
    """A version being loaded into host memory: its chunks (fresh ones writable, shared ones sealed already)."""

    key: Hashable
    chunks: list[Chunk]
    mappings: list[_Mapping]
    places: dict[str, tuple[int, int]]  # tensor -> (index into chunks, offset)
    shared: dict[str, Entry]  # tensors placed in a base's chunk: their entry there (its bytes are known)
    base: SealedVersion | None  # the version shared with, held while loading
    sealed: SealedVersion | None = None


class SealedVersion:
    """Sealed chunks and their manifest. Reference counted: the replica holds one while it serves it, the attach
    offer one, each lease one; at zero its chunks are let go (each closes when no other version uses it)."""

    def __init__(
        self,
        label: str,
        chunks: list[Chunk],
        entries: list[Entry],
        *,
        key: Hashable = None,
        version: str = "",
        uid: str | None = None,
    ) -> None:
        self.label = label
        self.key = key
        self.version = version
        self.uid = uid  # of the WeightVersion object, when known: what a delta's base must be to share with it
        self.chunks = chunks
        self.entries = entries
        self.total_bytes = sum(e.nbytes for e in entries)
        self._refs = 1
        self._leases = 0
        self._lock = threading.Lock()
        # Set by whoever offers it: the version it was compared with, and the names whose bytes differ from it.
        self.base_uid: str | None = None
        self.changed: frozenset[str] | None = None

    @property
    def fds(self) -> list[int]:
        return [c.fd for c in self.chunks]

    @property
    def chunk_sizes(self) -> list[int]:
        return [c.size for c in self.chunks]

    @property
    def closed(self) -> bool:
        return not self.chunks

    @property
    def leases(self) -> int:
        return self._leases

    def ref(self) -> None:
        with self._lock:
            if not self.chunks:
                raise RuntimeError(f"{self.label} is already freed")
            self._refs += 1

    def lease(self) -> None:
        with self._lock:
            if not self.chunks:
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
            chunks, self.chunks = self.chunks, []
        for chunk in chunks:
            chunk.unref()

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


class HostStore:
    """Every chunk this agent holds, with a budget (None: unlimited) on the tensor bytes in them."""

    def __init__(self, budget_bytes: int | None = None, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._chunks: dict[int, Chunk] = {}  # id -> live chunk
        self._versions: list[SealedVersion] = []  # sealed and not yet freed
        self._refused: dict[Hashable, MemoryBudgetExceeded] = {}  # the last allocation refused, per replica
        self.on_change: Callable[[], None] = lambda: None  # called when memory is freed (the agent republishes)

    # ------------------------------------------------------------------ accounting

    def resident_bytes(self, key: Hashable = None) -> int:
        """Tensor bytes in live chunks: of the versions of replica `key`, or of all (None); a chunk shared by
        several versions counts once."""
        with self._lock:
            if key is None:
                return sum(c.payload for c in self._chunks.values())
            chunks = {id(c): c for v in self._versions if v.key == key for c in v.chunks}
            return sum(c.payload for c in chunks.values())

    def versions(self, key: Hashable) -> list[SealedVersion]:
        """The sealed versions of replica `key` that are still held (served, offered or leased)."""
        with self._lock:
            return [v for v in self._versions if v.key == key and not v.closed]

    def check_budget(self, needed: int) -> None:
        """Raise MemoryBudgetExceeded if `needed` more bytes would not fit."""
        if self.budget_bytes is None:
            return
        available = max(0, self.budget_bytes - self.resident_bytes())
        if needed > available:
            raise MemoryBudgetExceeded(needed, available, self.budget_bytes)

    def add(self, version: SealedVersion) -> SealedVersion:
        """Count a version whose chunks were made elsewhere (`adopt_rank`, `combined`)."""
        with self._lock:
            self._chunks.update((id(c), c) for c in version.chunks)
            self._versions = [v for v in self._versions if not v.closed] + [version]
        return version

    def _freed(self, chunk: Chunk) -> None:
        with self._lock:
            self._chunks.pop(id(chunk), None)
        self.on_change()

    # ------------------------------------------------------------------ loading

    def allocator(self, key: Hashable, label: str) -> Callable[[Sequence[TensorSpec], str], ResidentWeights]:
        """What a strategy allocates its target with: host memory of this store on `cpu`, device memory else."""

        def allocate(specs: Sequence[TensorSpec], device: str, share: Share | None = None) -> ResidentWeights:
            if torch.device(device).type != "cpu":
                return ResidentWeights.allocate(specs, device)
            try:
                return self.allocate(key, specs, label, share)
            except MemoryBudgetExceeded as exc:  # a strategy turns it into a miss; the agent wants the reason
                self._refused[key] = exc
                raise

        self._refused.pop(key, None)
        return allocate

    def take_refusal(self, key: Hashable) -> MemoryBudgetExceeded | None:
        """Why the last load of `key` (through `allocator`) could not allocate, if the budget was why."""
        return self._refused.pop(key, None)

    def allocate(
        self,
        key: Hashable,
        specs: Sequence[TensorSpec],
        label: str,
        share: Share | None = None,
        *,
        chunk_bytes: int | None = None,
    ) -> ResidentWeights:
        """Host memory for `specs`, the result sealed with `seal`. Fresh writable chunks, except for the tensors
        `share` says a version of `key` still held has the very bytes of (`share(version)`: those names): those are
        views of that version's sealed chunks, read-only, listed in `ResidentWeights.shared`, and the loader must
        leave them alone. Memory of a result dropped unsealed (a failed load) is given back when it is collected."""
        specs = list(specs)
        if not specs:
            raise ValueError("a version needs at least one tensor")
        base, reused = self._base(key, specs, share)
        try:
            fresh = [s for s in specs if s.name not in reused]
            sizes, places = layout(fresh, chunk_bytes or self.chunk_bytes) if fresh else ([], {})
            base_chunks = sorted({e.chunk for e in reused.values()})
            count = len(sizes) + len(base_chunks)
            if count > MAX_FDS:
                raise ValueError(f"{count} chunks exceed the {MAX_FDS} descriptors one attach reply can carry")
            payloads = [0] * len(sizes)
            for spec in fresh:
                payloads[places[spec.name][0]] += spec.nbytes
            with self._lock:  # the check and the reservation together: two loads cannot both take the last bytes
                if self.budget_bytes is not None:
                    available = max(0, self.budget_bytes - sum(c.payload for c in self._chunks.values()))
                    if sum(payloads) > available:
                        raise MemoryBudgetExceeded(sum(payloads), available, self.budget_bytes)
                chunks: list[Chunk] = []
                try:
                    for index, (size, payload) in enumerate(zip(sizes, payloads, strict=True)):
                        chunks.append(Chunk(f"{label}:{index}", size, payload, self._freed))
                except BaseException:
                    for chunk in chunks:
                        os.close(chunk.fd)
                    raise
                self._chunks.update((id(c), c) for c in chunks)
            assert base is not None or not base_chunks
            for index in base_chunks:  # held by this version too, for as long as it lives
                base.chunks[index].ref()
                chunks.append(base.chunks[index])
        except BaseException:
            if base is not None:
                base.unref()
            raise
        if base is not None and not reused:
            base.unref()
            base = None
        shared = {}
        for name, entry in reused.items():
            index = len(sizes) + base_chunks.index(entry.chunk)
            places[name] = (index, entry.offset)
            shared[name] = entry
        try:
            mappings = [_Mapping(c, writable=i < len(sizes)) for i, c in enumerate(chunks)]
            tensors = _tensors(mappings, specs, places)
        except BaseException:
            for chunk in chunks:
                chunk.unref()
            if base is not None:
                base.unref()
            raise
        resident = ResidentWeights(tensors)
        resident.shared = frozenset(shared)
        # Held until sealed (or dropped): a loader may read the base's other tensors too (a delta replays on them).
        resident.shared_from = base
        building = _Building(key, chunks, mappings, places, shared, base)
        resident.host = building
        weakref.finalize(resident, _drop_unsealed, building)
        if shared:
            log.info(
                "%s shares %d of %d tensors (%d bytes) with %s",
                label,
                len(shared),
                len(specs),
                sum(e.nbytes for e in shared.values()),
                base.label if base else "",
            )
        return resident

    def map_sealed(
        self,
        key: Hashable,
        fds: Sequence[int],
        sizes: Sequence[int],
        specs: Sequence[TensorSpec],
        places: Mapping[str, tuple[int, int]],
    ) -> ResidentWeights:
        """Weights that are views of sealed chunks another process wrote (a local leader's landing): this store
        takes `fds` over (each closes with its chunk), maps them read-only and counts them for `key`; `seal` then
        only writes the manifest. Raises, closing every descriptor, if a chunk is not sealed or not `sizes` big, or a
        tensor lies outside its chunk. Nothing is copied, and nothing can write these pages any more."""
        specs = list(specs)
        chunks: list[Chunk] = []
        try:
            if not specs:
                raise ValueError("a version needs at least one tensor")
            if len(fds) > MAX_FDS:
                raise ValueError(f"{len(fds)} chunks exceed the {MAX_FDS} descriptors one attach reply can carry")
            payloads = [0] * len(sizes)
            for spec in specs:
                index, offset = places[spec.name]
                if not 0 <= index < len(sizes) or offset < 0 or offset + spec.nbytes > sizes[index]:
                    raise ValueError(f"tensor {spec.name!r} lies outside its chunk")
                payloads[index] += spec.nbytes
            for fd, size, payload in zip(fds, sizes, payloads, strict=True):
                if os.fstat(fd).st_size != size:
                    raise ValueError(f"chunk of {os.fstat(fd).st_size} bytes, expected {size}")
                chunks.append(Chunk.adopt(fd, size, payload, self._freed))
        except BaseException:
            for fd in fds[len(chunks) :]:
                os.close(fd)
            for chunk in chunks:
                chunk.unref()
            raise
        with self._lock:
            self._chunks.update((id(c), c) for c in chunks)
        try:
            mappings = [_Mapping(c, writable=False) for c in chunks]
            tensors = _tensors(mappings, specs, places)
        except BaseException:
            for chunk in chunks:
                chunk.unref()
            raise
        resident = ResidentWeights(tensors)
        building = _Building(key, chunks, mappings, dict(places), {}, None)
        resident.host = building
        weakref.finalize(resident, _drop_unsealed, building)
        return resident

    def _base(
        self, key: Hashable, specs: Sequence[TensorSpec], share: Share | None
    ) -> tuple[SealedVersion | None, dict[str, Entry]]:
        """The held version of `key` that shares the most bytes with the new one (held by the caller from here on:
        it unrefs it), and the entries it shares."""
        if share is None:
            return None, {}
        wanted = {s.name: s for s in specs}
        best: tuple[SealedVersion | None, dict[str, Entry]] = (None, {})
        for version in self.versions(key):
            try:
                version.ref()
            except RuntimeError:  # freed meanwhile
                continue
            names = set(share(version))
            entries = {
                e.name: e
                for e in version.entries
                if e.name in names
                and e.nbytes
                and e.name in wanted
                and (f"torch.{e.dtype}", e.shape, e.nbytes)
                == (wanted[e.name].dtype, wanted[e.name].shape, wanted[e.name].nbytes)
            }
            if sum(e.nbytes for e in entries.values()) > sum(e.nbytes for e in best[1].values()):
                if best[0] is not None:
                    best[0].unref()
                best = (version, entries)
            else:
                version.unref()
        return best

    def seal(self, resident: ResidentWeights, label: str, version: str = "", uid: str | None = None) -> SealedVersion:
        """Make `resident` (from `allocate`, fully written, registered with no NIXL agent) read-only and sealed, in
        place; the one SealedVersion of it (a second call returns the same)."""
        building = resident.host
        if not isinstance(building, _Building):
            raise ValueError("these weights are not in this store's host memory")
        if building.sealed is not None:
            return building.sealed
        if resident.registration is not None:
            raise RuntimeError("deregister the weights from NIXL before sealing them (a registration may pin pages)")
        for mapping in building.mappings:
            if not mapping.chunk.sealed:
                mapping.make_readonly()
                mapping.chunk.seal()
        entries = []
        checked = resident.checksums or {}  # what the load checked these very bytes against
        for spec in resident.manifest:
            shared = building.shared.get(spec.name)
            index, offset = building.places[spec.name]
            if shared is not None:
                entries.append(
                    Entry(
                        spec.name, shared.dtype, shared.shape, index, offset, spec.nbytes, shared.adler32, shared.sha256
                    )
                )
                continue
            with building.mappings[index].view(offset, spec.nbytes) as view:
                known = checked.get(spec.name)
                checksum = int(known, 16) if known else adler32(view)
                digest = hashlib.sha256(view).hexdigest()
            dtype = spec.dtype.removeprefix("torch.")
            entries.append(Entry(spec.name, dtype, spec.shape, index, offset, spec.nbytes, checksum, digest))
        # The building's reference on each chunk becomes the version's.
        sealed = SealedVersion(label, list(building.chunks), entries, key=building.key, version=version, uid=uid)
        building.sealed = sealed
        with self._lock:
            self._versions = [v for v in self._versions if not v.closed] + [sealed]
        if building.base is not None:  # its chunks that the new version uses, it holds itself
            building.base.unref()
            building.base = resident.shared_from = None
        return sealed


def entry_of(t: Mapping[str, Any]) -> Entry:
    """An entry as `ranks.worker` reports it: the manifest entry and its sha256."""
    return Entry(
        str(t["name"]),
        str(t["dtype"]),
        tuple(int(d) for d in t["shape"]),
        int(t["chunk"]),
        int(t["offset"]),
        int(t["nbytes"]),
        int(t["adler32"]),
        str(t["sha256"]),
    )


def sealed_of(resident: ResidentWeights) -> SealedVersion | None:
    """The sealed version `resident` is, when it lives in a HostStore and is sealed."""
    building = resident.host
    return building.sealed if isinstance(building, _Building) else None


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_bytes(text: str) -> int:
    """A Kubernetes-style quantity of bytes: `68719476736`, `64Gi`, `500M`."""
    value = text.strip()
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if u and value.endswith(u)), "")
    number = value[: len(value) - len(unit)]
    if not number.isdigit():
        raise ValueError(f"not a byte quantity: {text!r} (e.g. 64Gi, 500M, 1073741824)")
    return int(number) * _UNITS[unit]


def adopt_rank(
    store: HostStore, key: Hashable, label: str, version: str, uid: str | None, pid: int, memory: Mapping[str, Any]
) -> SealedVersion:
    """The sealed share a rank process `pid` serves (`memory`: its `fds`, `chunks` sizes and `tensors`), as a
    version of this store: the agent opens each chunk through `/proc/<pid>/fd/<n>`, so the memory stays while
    the agent holds it, whatever the rank process does later. Raises if a chunk is not sealed or too small."""
    chunks: list[Chunk] = []
    entries = [entry_of(t) for t in memory["tensors"]]
    payloads = [0] * len(memory["chunks"])
    for e in entries:
        payloads[e.chunk] += e.nbytes
    try:
        for fd, size, payload in zip(memory["fds"], memory["chunks"], payloads, strict=True):
            mine = os.open(f"/proc/{pid}/fd/{int(fd)}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                chunks.append(Chunk.adopt(mine, int(size), payload, store._freed))
            except BaseException:
                os.close(mine)
                raise
    except BaseException:
        for chunk in chunks:
            chunk.unref()
        raise
    for e in entries:
        if not 0 <= e.chunk < len(chunks) or e.offset + e.nbytes > chunks[e.chunk].size:
            for chunk in chunks:
                chunk.unref()
            raise ValueError(f"tensor {e.name!r} lies outside its chunk")
    return store.add(SealedVersion(label, chunks, entries, key=key, version=version, uid=uid))


def combined(store: HostStore, label: str, shares: Sequence[SealedVersion]) -> SealedVersion:
    """One version of every share's chunks and tensors (attach without a rank); holds each chunk too."""
    chunks: list[Chunk] = []
    entries: list[Entry] = []
    for share in shares:
        base = len(chunks)
        for chunk in share.chunks:
            chunk.ref()
            chunks.append(chunk)
        entries.extend(
            Entry(e.name, e.dtype, e.shape, base + e.chunk, e.offset, e.nbytes, e.adler32, e.sha256)
            for e in share.entries
        )
    if len(chunks) > MAX_FDS:
        for chunk in chunks:
            chunk.unref()
        raise ValueError(f"{len(chunks)} chunks exceed the {MAX_FDS} descriptors one attach reply can carry")
    first = shares[0]
    entries.sort(key=lambda e: e.name)
    return store.add(SealedVersion(label, chunks, entries, key=first.key, version=first.version, uid=first.uid))


def _drop_unsealed(building: _Building) -> None:
    if building.sealed is None:
        for chunk in building.chunks:
            chunk.unref()
        if building.base is not None:
            building.base.unref()


def seal_tensors(
    tensors: Mapping[str, torch.Tensor],
    label: str,
    chunk_bytes: int = CHUNK_BYTES,
    *,
    store: HostStore | None = None,
    key: Hashable = None,
    version: str = "",
) -> SealedVersion:
    """Copy `tensors` (contiguous, any device) into new sealed memfd chunks (of `store`, counted for `key`)."""
    if not tensors:
        raise ValueError("a sealed version needs at least one tensor")
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous")
    store = store or HostStore()
    target = store.allocate(key, [spec_of(n, t) for n, t in tensors.items()], label, chunk_bytes=chunk_bytes)
    for name, tensor in tensors.items():
        if tensor.numel():
            target.tensors[name].copy_(tensor.detach())
    return store.seal(target, label, version)
