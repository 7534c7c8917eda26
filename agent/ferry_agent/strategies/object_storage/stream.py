"""The streaming path of a full load the store lacks: parallel ranged GETs read straight into the new version's
memory (each tensor's bytes where they will be served from), every tensor checked (adler32 of the shard header)
as soon as its last range lands; then the node's store is written behind the load, from that same memory
(`store_behind`: also materialized/<target> of a delta replay).

A CPU pool (the agent's host store) is read into directly; for other devices each tensor lands in a host
buffer first and is copied over once checked (the buffers are kept for the store write). Nothing is handed out
before every tensor is checked, so a failure changes nothing a replica serves."""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from botocore.exceptions import BotoCoreError, ClientError, ReadTimeoutError, ResponseStreamingError

from ferry import checkpoint_format as ckpt
from ferry_agent.store.checkpoints import ArtifactRef, CheckpointStore, VersionIdentity
from ferry_agent.store.resident import ResidentWeights
from ferry_agent.strategies.object_storage.checkpoint import (
    CHAIN_FILE,
    CHECKSUMS_FILE,
    Checkpoint,
    LoadError,
    Plan,
    Shard,
    s3_error,
)
from ferry_agent.strategies.object_storage.download import _Progress
from ferry_agent.strategies.object_storage.files import Countdown, pwrite_all, run_tasks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Piece:
    """Where bytes [begin, end) of a shard object land: `target` (a writable byte view of that length), and the
    countdown of the tensor they belong to (None: the shard header)."""

    begin: int
    end: int
    target: memoryview
    done: Countdown | None


def _socket_reader(body: Any) -> Callable[[memoryview], int] | None:
    """The `readinto` of the http.client response under botocore's body and urllib3's response: it receives
    straight into the view, where urllib3 2's own `readinto` reads into a temporary bytes object and copies it over
    (one more pass over every byte a load fetches, ~10 % of a 256 MiB load here). None where the layers are not
    those (another client, a body urllib3 decodes or has buffered): the load then reads through them."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or not hasattr(body, "_amount_read"):
        return None
    if not (hasattr(raw, "_fp_bytes_read") and hasattr(raw, "length_remaining") and hasattr(raw, "headers")):
        return None
    if raw.headers.get("content-encoding", "identity") != "identity" or len(getattr(raw, "_decoded_buffer", ())):
        return None
    return fp.readinto


def _read_into(body: Any, view: memoryview) -> int:
    direct = _socket_reader(body)
    reader = direct or body.readinto
    got = 0
    try:
        while got < len(view):
            n = reader(view[got:])
            if not n:
                break
            got += n
    except TimeoutError as exc:  # raised past urllib3 and botocore: as they would have raised it
        raise ReadTimeoutError(endpoint_url="", error=exc) from exc
    except (OSError, http.client.HTTPException) as exc:
        raise ResponseStreamingError(error=exc) from exc
    if direct is not None:
        # What the layers above count, as if they had read it: urllib3 then sees the body end and pools the
        # connection again, and botocore checks the count against Content-Length.
        raw = body._raw_stream
        raw._fp_bytes_read += got
        if raw.length_remaining is not None:
            raw.length_remaining -= got
        body._amount_read += got
    return got


def _fetch_range(
    checkpoint: Checkpoint, shard: Shard, begin: int, end: int, pieces: list[_Piece], progress: _Progress
) -> None:
    """One ranged GET, its body read piece by piece into the memory each byte belongs in (no staging copy)."""
    link = checkpoint.link
    uri = link.shard_uri(shard.name)
    short = LoadError(
        f"shard {uri}: the ranged GET of bytes {begin}-{end - 1} did not return exactly {end - begin} bytes; "
        "the object changed or is truncated"
    )
    try:
        response = checkpoint.client.get_object(
            Bucket=link.bucket, Key=link.shard_key(shard.name), Range=f"bytes={begin}-{end - 1}"
        )
        body = response["Body"]
        try:
            if response.get("ContentLength", end - begin) != end - begin:
                raise short
            for piece in pieces:
                lo, hi = max(piece.begin, begin), min(piece.end, end)
                view = piece.target[lo - piece.begin : hi - piece.begin]
                if _read_into(body, view) != len(view):
                    raise short
                progress.add(len(view))
            if body.read(1):
                raise short
        finally:
            body.close()
    except (ClientError, BotoCoreError) as exc:
        raise s3_error(exc, uri) from exc
    for piece in pieces:
        if piece.done is not None:
            piece.done.tick()  # the tensor's last range: checked now, in this thread, while others download


def _check(
    uri: str,
    name: str,
    host: np.ndarray,
    checksum: str,
    device: torch.Tensor | None,
    on_checked: Callable[[str, str], None] | None = None,
    *,
    kept: bool = False,
) -> None:
    got = ckpt.adler32_hex(host)
    if got != checksum:
        # Raised into the range's task: the load stops (the other ranges are cancelled) at the first bad tensor.
        where = "kept from the failed load, changed since it was checked" if kept else "fails its adler32 check"
        raise LoadError(f"shard {uri}: tensor {name!r} {where} (got {got}, expected {checksum})")
    if device is not None:
        device.copy_(torch.from_numpy(host))
    if on_checked is not None:  # final now: a load that serves while it loads hands it to peers
        on_checked(name, checksum)


@dataclass
class Streamed:
    """A full checkpoint streamed into memory: every tensor's checked bytes (`hosts`, views of the resident
    pool where it is on the CPU), what `store_behind` writes to the store; the bytes fetched, and the tensors
    (and their bytes) the pool already held."""

    checkpoint: Checkpoint
    hosts: dict[str, np.ndarray]
    fetched: int = 0
    kept: int = 0
    kept_bytes: int = 0


def _ranges(spans: list[tuple[int, int]], range_bytes: int) -> list[tuple[int, int]]:
    """Ranged GETs of at most `range_bytes` over `spans` of one object, adjacent spans merged (what is fetched:
    everything but the tensors a load kept)."""
    runs: list[list[int]] = []
    for begin, end in sorted(s for s in spans if s[1] > s[0]):
        if runs and runs[-1][1] == begin:
            runs[-1][1] = end
        else:
            runs.append([begin, end])
    return [(b, min(b + range_bytes, end)) for begin, end in runs for b in range(begin, end, range_bytes)]


def stream(
    plan: Plan,
    resident: ResidentWeights,
    pool: ThreadPoolExecutor,
    timings: dict[str, float],
    *,
    report: Callable[[int, int, str], None] | None,
    range_bytes: int,
    into: Mapping[str, np.ndarray] | None = None,
    on_checked: Callable[[str, str], None] | None = None,
    kept: Mapping[str, str] | None = None,
) -> Streamed:
    """Fetch `plan.base` (a full checkpoint, not in the store) with parallel ranged GETs into `resident`; a
    tensor `resident` lacks lands in `into[name]` (another rank's share: `ranks.landing`) where given.
    `on_checked(name, adler32)`: each tensor of `resident` once its bytes passed their check. `kept`: tensors
    `resident` already holds with these adler32s (what a failed peer load checked); each whose adler32 is the
    shard header's is not fetched, only checked again where it is."""
    base = plan.base
    t = time.monotonic()
    folder = base.link.uri.rpartition("/")[0] + "/"  # what a stall report names
    hosts: dict[str, np.ndarray] = {}
    headers: dict[str, bytearray] = {}
    checks: list[Callable[[], None]] = []  # with no range to wait for: the kept tensors and the empty ones
    shard_spans: list[tuple[Shard, list[tuple[int, int, memoryview, Callable[[], None] | None]]]] = []
    streamed = Streamed(base, hosts)
    for shard in base.shards.values():
        layout = shard.layout
        headers[shard.name] = bytearray(layout.data_start)
        spans: list[tuple[int, int, memoryview, Callable[[], None] | None]] = [
            (0, layout.data_start, memoryview(headers[shard.name]), None)
        ]
        uri = base.link.shard_uri(shard.name)
        for name, info in layout.infos.items():
            tensor = resident.tensors.get(name)
            flat = None if tensor is None or name in resident.shared else tensor.reshape(-1).view(torch.uint8)
            on_cpu = flat is not None and flat.device.type == "cpu"
            if on_cpu:
                host = flat.numpy()
            elif flat is None and into is not None and name in into:
                host = into[name]
            else:
                host = np.empty(info.nbytes, dtype=np.uint8)
            hosts[name] = host
            mine = on_checked if tensor is not None and name not in resident.shared else None
            check = partial(_check, uri, name, host, layout.checksums[name], None if on_cpu else flat, mine)
            if on_cpu and kept and kept.get(name) == layout.checksums[name]:
                checks.append(partial(check, kept=True))
                streamed.kept += 1
                streamed.kept_bytes += info.nbytes
                continue
            begin = layout.data_start + info.begin
            spans.append((begin, begin + info.nbytes, memoryview(host).cast("B"), check))
        shard_spans.append((shard, spans))
    fetches: list[tuple[Shard, int, int, list[_Piece]]] = []
    for shard, spans in shard_spans:
        ranges = _ranges([(b, e) for b, e, _, _ in spans], range_bytes)
        pieces: dict[tuple[int, int], list[_Piece]] = {r: [] for r in ranges}
        for lo, hi, view, check in spans:
            overlapping = [(b, e) for b, e in ranges if b < hi and e > lo]
            if check is not None and not overlapping:  # an empty tensor: nothing to fetch
                checks.append(check)
                continue
            done = None if check is None else Countdown(len(overlapping), check)
            for r in overlapping:
                pieces[r].append(_Piece(lo, hi, view, done))
        fetches.extend((shard, b, e, sorted(pieces[(b, e)], key=lambda p: p.begin)) for b, e in ranges)
    streamed.fetched = sum(e - b for _, b, e, _ in fetches)
    progress = _Progress(report, streamed.fetched, folder)
    tasks = [partial(_fetch_range, base, shard, b, e, p, progress) for shard, b, e, p in fetches]
    run_tasks(pool, tasks + checks)
    for name, header in headers.items():
        if bytes(header) != base.shards[name].header:
            raise LoadError(f"shard {base.where(name)} changed while it was downloaded")
    timings["download"] = time.monotonic() - t  # with every tensor's check
    return streamed


@dataclass(frozen=True)
class Artifact:
    """A store entry to write behind a load: `fill(tmp)` writes its files, then `CheckpointStore.write` fsyncs
    and renames them into place."""

    ref: ArtifactRef
    source: dict[str, Any]
    identity: tuple[VersionIdentity, ...]
    fill: Callable[[Path], None]
    nbytes: int


def store_behind(
    store: CheckpointStore, plan: Plan, artifacts: list[Artifact], head_wanted: Callable[[], bool] | None = None
) -> None:
    """Queue the store write of what a load built in memory: each artifact in order (tmp + fsync + rename each),
    and then the store's active version, unless another load changed it meanwhile. The last artifact is the
    target's head (its full or materialized copy); `head_wanted()` False, asked once the others are written,
    leaves it and the activation out (the store keeps its active version). Called under the store lock, once the
    load's own update is over."""
    before = store.state(plan.model)

    def job() -> None:
        with store.lock(), store.update(plan.model, plan.chain[-1], plan.chain) as update:
            *rest, head = artifacts
            for artifact in rest:
                _write(store, artifact)
            if head_wanted is not None and not head_wanted():
                return
            _write(store, head)
            if update.previous == before:  # else another load activated a version meanwhile: keep it
                update.commit(activate=True)

    store.write_behind(job, ", ".join(str(a.ref) for a in artifacts))


def _write(store: CheckpointStore, artifact: Artifact) -> None:
    if store.artifact(artifact.ref, artifact.identity) is None:
        store.reserve(artifact.nbytes)
        with store.write(artifact.ref, artifact.source, artifact.identity) as tmp:
            artifact.fill(tmp)


def store_full_behind(store: CheckpointStore, plan: Plan, streamed: Streamed) -> None:
    """The store entry of a streamed full checkpoint, from the checked bytes in memory."""
    checkpoint = streamed.checkpoint

    def fill(tmp: Path) -> None:
        (tmp / ckpt.INDEX_NAME).write_bytes(checkpoint.index_raw)
        for shard in checkpoint.shards.values():
            write_shard(tmp / shard.name, shard, streamed.hosts)

    source = {"uri": checkpoint.link.uri}
    store_behind(store, plan, [Artifact(checkpoint.ref, source, checkpoint.identity, fill, checkpoint.stored_bytes)])


def materialized(plan: Plan, hosts: Mapping[str, np.ndarray]) -> Artifact:
    """materialized/<target> of a replayed chain, from the new version's memory (every tensor's bytes, in CPU
    memory: checked after each delta, and never written once handed out)."""
    base = plan.base
    checksums = plan.target_checksums

    def fill(tmp: Path) -> None:
        (tmp / ckpt.INDEX_NAME).write_bytes(base.index_raw)
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1, sort_keys=True))
        chain = {"version": plan.chain[-1], "full_version": plan.chain[0], "deltas": plan.chain[1:]}
        (tmp / CHAIN_FILE).write_text(json.dumps(chain))
        for shard in base.shards.values():
            write_shard(tmp / shard.name, shard, hosts)

    identity = base.identity + tuple(i for d in plan.deltas for i in d.identity)
    source = {"uri": plan.deltas[-1].link.uri, "chain": list(plan.chain)}
    return Artifact(plan.head, source, identity, fill, base.stored_bytes)


def write_shard(path: os.PathLike[str], shard: Shard, hosts: Mapping[str, np.ndarray]) -> None:
    """One shard file from the checked header and tensor bytes; `CheckpointStore.write` fsyncs it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, shard.header, 0)
        os.ftruncate(fd, shard.layout.size)
        for name, info in shard.layout.infos.items():
            if info.nbytes:
                pwrite_all(fd, hosts[name], shard.layout.data_start + info.begin)
    finally:
        os.close(fd)
