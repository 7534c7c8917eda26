"""A delta replay, streamed: the deltas the store lacks are fetched with parallel ranged GETs into memory, and each
tensor is built as soon as the last of its frames lands, in the thread that fetched it: its base bytes (from the
base version's sealed host memory when the replica still holds that very version, else from the store), XOR each
decoded frame (or write a sparse patch's elements), straight into the new version's memory, its adler32 checked
after every delta (`ckpt.apply_delta_into`). A one-rank replica builds every tensor into its
new pool; a multi-rank leader builds its own share there and every other rank's into that rank's landing
(`ranks.landing`), which the other ranks map. The store entries (the fetched deltas, and materialized/<target>: a
one-rank replay writes it only every few versions over a stored base) are written behind the load
(`store_replay_behind`), so the replica serves without waiting for the disk. Nothing is handed out before every
tensor is checked, so a failure changes nothing a replica serves."""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ferry import checkpoint_format as ckpt
from ferry_agent.store.checkpoints import ArtifactKind, ArtifactRef, CheckpointStore
from ferry_agent.store.resident import ResidentWeights
from ferry_agent.strategies.object_storage.build import Failure, load_error, mismatch
from ferry_agent.strategies.object_storage.checkpoint import Checkpoint, LoadError, Plan
from ferry_agent.strategies.object_storage.download import _Progress
from ferry_agent.strategies.object_storage.files import Countdown, mapped, pwrite_all, run_tasks
from ferry_agent.strategies.object_storage.stream import Artifact, _fetch_range, _Piece, materialized, store_behind

MIN_RANGE_BYTES = 4 << 20


def ranges_of(total: int, range_bytes: int, workers: int) -> int:
    """The ranged GETs' size for `total` bytes of deltas: small enough that every worker has some and decoding
    starts early (a delta is small), at most `range_bytes`."""
    return max(MIN_RANGE_BYTES, min(range_bytes, -(-total // (2 * workers))))


@dataclass(frozen=True)
class _Step:
    """One delta frame to XOR into a tensor, and the adler32 the tensor must have afterwards."""

    frame: Callable[[], memoryview | np.ndarray]  # its bytes, once they are in memory
    checksum: str
    origin: int  # index of the delta in the plan


class _Base:
    """A tensor's base bytes, mapped read-only for the load: the held version's sealed chunks, or the store's copy
    of the base (immutable once renamed into place; a discarded one is unlinked, never truncated, so a mapping of
    it stays valid). XORing straight from the mapping into the new pool reads the base once. A multi-rank leader's
    held version has only its own share: the other tensors' base bytes are the store's."""

    def __init__(self, plan: Plan, resident: ResidentWeights, stack: contextlib.ExitStack) -> None:
        base = plan.base
        held = plan.held if plan.held is not None else resident.shared_from
        self.checksums = dict(base.checksums)
        self.arrays: dict[str, np.ndarray] = {}
        self.in_memory: set[str] = set()  # the tensors read from sealed host memory
        if held is not None and (held.version, held.uid) == (base.link.name, base.link.uid):
            chunks: dict[int, mmap.mmap] = {}
            for e in held.entries:
                if e.chunk not in chunks:
                    chunks[e.chunk] = stack.enter_context(_mapped_fd(held.chunks[e.chunk].fd))
                self.arrays[e.name] = np.frombuffer(chunks[e.chunk], dtype=np.uint8, count=e.nbytes, offset=e.offset)
                self.checksums[e.name] = f"{e.adler32:08x}"
                self.in_memory.add(e.name)
        rest = [name for name in plan.layout if name not in self.arrays]
        if rest:
            assert base.path is not None
            shards = {name: stack.enter_context(mapped(base.path / name)) for name in base.shards}
            for name in rest:
                shard, info = plan.layout[name]
                offset = shard.layout.data_start + info.begin
                self.arrays[name] = np.frombuffer(shards[shard.name], dtype=np.uint8, count=info.nbytes, offset=offset)
        stack.callback(self.arrays.clear)  # before the mappings close

    def error(self, name: str) -> str | None:
        """Why the base bytes of `name` are not the ones the base version has, or None."""
        return mismatch(ckpt.adler32_hex(self.arrays[name]), self.checksums[name])


@contextlib.contextmanager
def _mapped_fd(fd: int) -> Any:
    mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        yield mm
    finally:
        with contextlib.suppress(BufferError):  # a view held by an in-flight traceback: freed with it
            mm.close()


def _build(
    plan: Plan,
    name: str,
    target: np.ndarray,
    base: _Base,
    steps: list[_Step],
    on_checked: Callable[[str, str], None] | None,
) -> None:
    """One tensor: the base bytes, then each delta in order (the first XORed from the base straight into the
    target), checking the adler32 after each (of the base bytes when there is none), then `on_checked(name,
    adler32)`. Raises the load's error; a bad base is not blamed on a good delta."""
    failure: Failure | None = None
    if not steps:
        np.copyto(target, base.arrays[name])
        if error := mismatch(ckpt.adler32_hex(target), base.checksums[name]):
            failure = Failure(name, error, -1)
    for i, step in enumerate(steps):
        try:
            got = ckpt.apply_delta_into(target, step.frame(), base.arrays[name] if i == 0 else None)
            error = mismatch(got, step.checksum, after_delta=True)
        except ValueError as exc:
            error = str(exc)
        if error is not None:
            base_error = base.error(name)
            failure = Failure(name, base_error, -1) if base_error else Failure(name, error, step.origin)
            break
    if failure is None:
        if on_checked is not None:  # final and checked: a load that serves while it loads hands it to peers
            on_checked(name, steps[-1].checksum if steps else base.checksums[name])
        return
    if failure.origin < 0 and name in base.in_memory:  # sealed memory changed: nothing on disk to discard
        raise LoadError(f"tensor {name!r} of {plan.base.link.name} held in host memory {failure.message}")
    raise load_error(plan, failure)


@dataclass(frozen=True)
class Replayed:
    """What a streamed replay built, for the store write behind it: the fetched deltas' shard objects (by version,
    then shard; their headers checked) and every tensor's checked bytes of the target (`hosts`)."""

    fetched: dict[str, dict[str, bytearray]]
    hosts: dict[str, np.ndarray]


def replay(
    plan: Plan,
    resident: ResidentWeights,
    pool: Any,
    timings: dict[str, float],
    *,
    report: Callable[[int, int, str], None] | None,
    range_bytes: int,
    workers: int,
    on_checked: Callable[[str, str], None] | None = None,
    into: Mapping[str, np.ndarray] | None = None,
) -> Replayed:
    """Build the target of `plan` (its base in the store or held in memory; deltas in the store or in S3) into
    `resident` (a CPU pool), a tensor it lacks into `into[name]` (another rank's share: `ranks.landing`),
    streaming the deltas the store lacks; `on_checked(name, adler32)` as each tensor of `resident` is built and
    checked."""
    t = time.monotonic()
    remote = [d for d in plan.deltas if d.path is None]
    fetched: dict[str, dict[str, bytearray]] = {
        d.link.name: {s.name: bytearray(s.layout.size) for s in d.shards.values()} for d in remote
    }
    folders = ", ".join(d.link.uri.rpartition("/")[0] + "/" for d in remote)
    progress = _Progress(report, sum(s.layout.size for d in remote for s in d.shards.values()), folders)
    with contextlib.ExitStack() as stack:
        base = _Base(plan, resident, stack)
        steps: dict[str, list[_Step]] = {}
        waits: dict[str, int] = {}  # tensor -> ranged GETs its frames wait for
        spans: dict[tuple[str, str], list[tuple[int, int, str]]] = {}  # (version, shard) -> frames (begin, end, name)
        for origin, delta in enumerate(plan.deltas):
            for shard in delta.shards.values():
                if delta.path is None:
                    memory: Any = fetched[delta.link.name][shard.name]
                else:
                    memory = stack.enter_context(mapped(delta.path / shard.name))
                for name, info in shard.layout.infos.items():
                    begin = shard.layout.data_start + info.begin
                    frame = partial(_frame, memory, begin, info.nbytes)
                    steps.setdefault(name, []).append(_Step(frame, shard.layout.checksums[name], origin))
                    if delta.path is None:
                        spans.setdefault((delta.link.name, shard.name), []).append((begin, begin + info.nbytes, name))
        size = ranges_of(sum(s.layout.size for d in remote for s in d.shards.values()), range_bytes, workers)
        ranges: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for delta in remote:
            for shard in delta.shards.values():
                key = (delta.link.name, shard.name)
                ranges[key] = [(b, min(b + size, shard.layout.size)) for b in range(0, shard.layout.size, size)]
                for begin, end, name in spans.get(key, ()):
                    waits[name] = waits.get(name, 0) + sum(1 for b, e in ranges[key] if b < end and e > begin)
        local: list[Callable[[], None]] = []
        done: dict[str, Countdown] = {}
        hosts: dict[str, np.ndarray] = {}
        for name in plan.layout:
            tensor = resident.tensors.get(name)
            if tensor is None and into is not None:
                target = into[name]
            else:
                target = resident.tensors[name].reshape(-1).view(torch.uint8).numpy()
            hosts[name] = target
            if name in resident.shared:  # the held version's very bytes, in place
                continue
            mine = on_checked if tensor is not None else None  # another rank's share is not served from here
            build = partial(_build, plan, name, target, base, steps.get(name, []), mine)
            if waits.get(name):
                done[name] = Countdown(waits[name], build)
            else:
                local.append(build)
        tasks: list[Callable[[], None]] = []
        for delta in remote:
            for shard in delta.shards.values():
                key = (delta.link.name, shard.name)
                buffer = memoryview(fetched[delta.link.name][shard.name])
                for b, e in ranges[key]:
                    # One piece per frame it covers (each ticks its tensor), the bytes between them (the header)
                    # as pieces of their own: the GET's body is read into the shard's buffer in order.
                    pieces = []
                    at = b
                    for begin, end, name in sorted(spans.get(key, ())):
                        if not (b < end and e > begin):  # as counted in `waits`: every count gets its tick
                            continue
                        if begin > at:
                            pieces.append(_Piece(at, begin, buffer[at:begin], None))
                        lo = max(begin, b)
                        pieces.append(_Piece(lo, min(end, e), buffer[lo : min(end, e)], done[name]))
                        at = min(end, e)
                    if at < e:
                        pieces.append(_Piece(at, e, buffer[at:e], None))
                    tasks.append(partial(_fetch_range, delta, shard, b, e, pieces, progress))
        run_tasks(pool, tasks + local)
        for delta in remote:
            for shard in delta.shards.values():
                if bytes(fetched[delta.link.name][shard.name][: shard.layout.data_start]) != shard.header:
                    raise LoadError(f"shard {delta.where(shard.name)} changed while it was downloaded")
    timings["build"] = time.monotonic() - t  # the deltas' ranged GETs, and every tensor built and checked
    return Replayed(fetched, hosts)


def _frame(memory: Any, begin: int, nbytes: int) -> np.ndarray:
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes, offset=begin)


# A one-rank replay writes materialized/<target> once the chain's deltas stored past its newest stored base exceed
# this share of the model (as `replica_load.deltas_first` reads deltas of at most a quarter from S3).
MATERIALIZE_AFTER = 1 / 4


def store_replay_behind(store: CheckpointStore, plan: Plan, replayed: Replayed, *, every_version: bool) -> None:
    """Queue the store entries of a streamed replay: each fetched delta (its checked objects), then
    materialized/<target> from the new version's memory and the store's active version. Without `every_version`
    the materialized copy (a whole model written and fsynced per version and node, on the CPU and disk the rest of
    a rollout needs) is written only when `materialize` says so; the store's active version then stays the last
    one it holds whole. A multi-rank leader writes it every time: the other ranks load the prepared head."""
    fetched = replayed.fetched
    artifacts = [_delta_artifact(d, fetched[d.link.name]) for d in plan.deltas if d.link.name in fetched]
    wanted = None if every_version else partial(materialize, store, plan)
    store_behind(store, plan, [*artifacts, materialized(plan, replayed.hosts)], wanted)


def materialize(store: CheckpointStore, plan: Plan) -> bool:
    """Whether to store materialized/<target> of a one-rank replay: only when the store holds a base of the chain
    (its root full, or a materialized version) and the deltas stored past it exceed `MATERIALIZE_AFTER` of the
    model. Below that, a load without the version in memory (a restart) replays them from disk for little more
    than reading a whole copy. Without a stored base the chain's bytes came from a peer, whose copies the store
    does not keep either. Every artifact is checked against the chain's identities, as a load checks it."""
    chain = plan.chain
    identity = plan.base.identity + tuple(i for d in plan.deltas for i in d.identity)
    for at in range(len(chain) - 2, -1, -1):
        kind = ArtifactKind.MATERIALIZED if at else ArtifactKind.FULL
        if store.artifact(ArtifactRef(plan.model, kind, chain[at]), identity[: at + 1]) is not None:
            break
    else:
        return False
    stored = 0
    for i in range(at + 1, len(chain)):
        path = store.artifact(ArtifactRef(plan.model, ArtifactKind.DELTA, chain[i]), identity[i : i + 1])
        if path is None:  # the chain cannot be replayed from the store: a whole copy is what it can keep
            return True
        stored += sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return stored > plan.base.stored_bytes * MATERIALIZE_AFTER


def _delta_artifact(delta: Checkpoint, shards: dict[str, bytearray]) -> Artifact:
    def fill(tmp: Path) -> None:
        (tmp / ckpt.INDEX_NAME).write_bytes(delta.index_raw)
        for name, data in shards.items():
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                pwrite_all(fd, data, 0)
            finally:
                os.close(fd)

    return Artifact(delta.ref, {"uri": delta.link.uri}, delta.identity, fill, delta.stored_bytes)
