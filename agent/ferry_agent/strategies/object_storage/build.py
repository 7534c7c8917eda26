"""Phase 4 of an object-storage load: build the target in one pass per tensor, in parallel: the base bytes read
into a fresh pool (or shared with a version a pod still holds), every delta applied in place and checked, and
the result materialized in the store."""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from ferry import checkpoint_format as ckpt
from ferry_agent.store.checkpoints import CheckpointStore
from ferry_agent.store.resident import ResidentWeights
from ferry_agent.strategies.chain import LoadContext
from ferry_agent.strategies.object_storage.checkpoint import CHAIN_FILE, CHECKSUMS_FILE, LoadError, Plan
from ferry_agent.strategies.object_storage.files import Countdown, mapped, pread_into, pwrite_all, run_tasks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Step:
    """One delta frame to XOR into a tensor, and the adler32 the tensor must have afterwards."""

    source: mmap.mmap  # the delta shard
    begin: int
    end: int
    checksum: str
    origin: int  # index of the delta in the plan


@dataclass(frozen=True)
class Failure:
    tensor: str
    message: str
    origin: int  # -1: the base checkpoint; i: plan.deltas[i]


def mismatch(got: str, expected: str, *, after_delta: bool = False) -> str | None:
    """Why a tensor whose adler32 is `got` is not the one expected, or None (the load's wording, build or replay)."""
    if got == expected:
        return None
    return f"fails its adler32 check{' after the delta' if after_delta else ''}: got {got}, expected {expected}"


def _apply_step(host: np.ndarray, step: _Step) -> str | None:
    frame = np.frombuffer(step.source, dtype=np.uint8, count=step.end - step.begin, offset=step.begin)
    try:
        got = ckpt.apply_delta_into(host, frame)
    except ValueError as exc:
        return str(exc)
    return mismatch(got, step.checksum, after_delta=True)


def _base_error(source: tuple[int, int], nbytes: int, checksum: str) -> str | None:
    host = np.empty(nbytes, dtype=np.uint8)
    pread_into(source[0], memoryview(host), source[1])
    return mismatch(ckpt.adler32_hex(host), checksum)


def _build_tensor(
    name: str,
    tensor: torch.Tensor | None,
    nbytes: int,
    source: tuple[int, int],
    checksum: str,
    steps: Sequence[_Step],
    out: tuple[int, int, Countdown] | None,
    on_checked: Callable[[str, str], None] | None = None,
) -> Failure | None:
    """One tensor, in one pass: read its base bytes (fd, offset) into the resident pool, apply its deltas in
    order, checking adler32 after each (or of the base bytes when there is none), and write the result to the
    materialized shard (fd, offset, countdown to its fsync) when there is one. `tensor` is None for a tensor
    another rank holds: it is only materialized."""
    flat = None if tensor is None else tensor.reshape(-1).view(torch.uint8)
    # A non-CPU pool is filled through a host buffer of the tensor's size; a CPU pool is worked on directly.
    host = flat.numpy() if flat is not None and flat.device.type == "cpu" else np.empty(nbytes, dtype=np.uint8)
    pread_into(source[0], memoryview(host), source[1])
    if not steps and (error := mismatch(ckpt.adler32_hex(host), checksum)):
        return Failure(name, error, -1)
    for step in steps:
        error = _apply_step(host, step)
        if error is not None:
            # The checks after each delta cover the base too; only on a failure is the base checked on its own
            # (re-read), so that a bad base is not blamed on a good delta.
            base_error = _base_error(source, host.size, checksum)
            return Failure(name, base_error, -1) if base_error else Failure(name, error, step.origin)
    if out is not None:
        pwrite_all(out[0], host, out[1])
        out[2].tick()
    if flat is not None and flat.device.type != "cpu":
        flat.copy_(torch.from_numpy(host))
    if flat is not None and on_checked is not None:  # final and checked: a load that serves while it loads hands it on
        on_checked(name, steps[-1].checksum if steps else checksum)
    return None


def unchanged_since(plan: Plan) -> Callable[[Any], list[str]]:
    """A `share` for the host store: the tensors a held version of the chain (the very WeightVersion object, by
    uid) has the target's bytes of, because no later delta of the chain changes them."""
    links = [plan.base, *plan.deltas]

    def share(version: Any) -> list[str]:
        for i, checkpoint in enumerate(links):
            link = checkpoint.link
            if (link.name, link.uid) == (version.version, version.uid):
                later = {n for d in links[i + 1 :] for shard in d.shards.values() for n in shard.layout.infos}
                return [e.name for e in version.entries if e.name in plan.layout and e.name not in later]
        return []

    return share


def build(
    store: CheckpointStore,
    allocate: Callable[..., ResidentWeights],
    ctx: LoadContext,
    plan: Plan,
    pool: ThreadPoolExecutor,
    timings: dict[str, float],
    *,
    on_checked: Callable[[str, str], None] | None = None,
) -> ResidentWeights:
    """Fill a new pool from the base, applying the deltas on the way, and (when there are deltas) write the result
    to materialized/<target> in the same pass (the other ranks of a replica read it from the store). The base is
    read, never changed or renamed, so the previous good version stays intact until the new one is committed.
    `on_checked(name, adler32)`: each tensor of the pool once built and checked (a load that serves as it loads)."""
    base = plan.base
    assert base.path is not None and all(d.path is not None for d in plan.deltas)
    t = time.monotonic()
    try:
        resident = allocate(plan.specs, ctx.device, unchanged_since(plan))
    except (RuntimeError, ValueError) as exc:  # e.g. out of device memory
        nbytes = sum(s.nbytes for s in plan.specs)
        raise LoadError(f"cannot allocate {nbytes} bytes on {ctx.device}: {exc}") from exc
    checksums = plan.target_checksums
    # A delta replays on the very base version a pod still holds in host memory (the same WeightVersion
    # object): its tensors' bytes are read from that sealed memory, not from the store's copy on disk.
    held = resident.shared_from
    in_memory: dict[str, tuple[int, int]] = {}
    if plan.deltas and held is not None and (held.version, held.uid) == (base.link.name, base.link.uid):
        in_memory = {e.name: (held.chunks[e.chunk].fd, e.offset) for e in held.entries}
        log.info("replaying %s on %s in host memory", plan.chain[-1], base.link.name)
    with contextlib.ExitStack() as stack:
        sources: dict[str, int] = {}
        for shard in base.shards:
            sources[shard] = os.open(base.path / shard, os.O_RDONLY)
            stack.callback(os.close, sources[shard])
        outputs: dict[str, tuple[int, Countdown]] = {}
        if plan.deltas:
            identity = base.identity + tuple(i for d in plan.deltas for i in d.identity)
            tmp = stack.enter_context(
                store.write(plan.head, {"uri": plan.deltas[-1].link.uri, "chain": list(plan.chain)}, identity)
            )
            (tmp / ckpt.INDEX_NAME).write_bytes(base.index_raw)
            (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1, sort_keys=True))
            (tmp / CHAIN_FILE).write_text(
                json.dumps({"version": plan.chain[-1], "full_version": plan.chain[0], "deltas": plan.chain[1:]})
            )
            for shard in base.shards.values():
                fd = os.open(tmp / shard.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                stack.callback(os.close, fd)  # LIFO: closed before the commit
                pwrite_all(fd, shard.header, 0)
                os.ftruncate(fd, shard.layout.size)
                # Write-back of a finished shard overlaps building the others; the commit's fsync is then cheap.
                outputs[shard.name] = (fd, Countdown(len(shard.layout.infos), partial(os.fdatasync, fd)))
        steps: dict[str, list[_Step]] = {}
        for origin, delta in enumerate(plan.deltas):
            assert delta.path is not None
            for shard in delta.shards.values():
                mm = stack.enter_context(mapped(delta.path / shard.name))
                for name, info in shard.layout.infos.items():
                    begin = shard.layout.data_start + info.begin
                    step = _Step(mm, begin, begin + info.nbytes, shard.layout.checksums[name], origin)
                    steps.setdefault(name, []).append(step)
        tasks = []
        for name, (shard, info) in plan.layout.items():
            # None: another rank's, or a held version's (shared, read-only), built only to be materialized.
            tensor = None if name in resident.shared else resident.tensors.get(name)
            if tensor is None and not outputs:
                continue
            offset = shard.layout.data_start + info.begin
            out = (outputs[shard.name][0], offset, outputs[shard.name][1]) if outputs else None
            source = in_memory.get(name) or (sources[shard.name], offset)
            tasks.append(
                partial(
                    _build_tensor,
                    name,
                    tensor,
                    info.nbytes,
                    source,
                    base.checksums[name],
                    steps.get(name, ()),
                    out,
                    on_checked,
                )
            )
        failure = next((f for f in run_tasks(pool, tasks) if f is not None), None)
        if failure is not None:
            raise load_error(plan, failure)
        timings["build"] = time.monotonic() - t
        t = time.monotonic()
    if outputs:
        timings["commit"] = timings.get("commit", 0.0) + time.monotonic() - t  # fsync + rename
    return resident


def load_error(plan: Plan, failure: Failure) -> LoadError:
    """The load's error for a tensor that failed its check; the artifact at fault is discarded."""
    if failure.origin < 0:
        shard = plan.layout[failure.tensor][0].name
        return LoadError(
            f"stored checkpoint {plan.base.where(shard)}: tensor {failure.tensor!r} {failure.message}; "
            "it is discarded and fetched again on retry",
            discard=plan.base.ref,
        )
    delta = plan.deltas[failure.origin]
    return LoadError(
        f"delta shard {delta.where(delta.index.weight_map[failure.tensor])}: tensor {failure.tensor!r} "
        f"{failure.message} (applying {delta.link.name} on {delta.link.base}); "
        "the store stays at its previous version",
        discard=delta.ref,
    )
