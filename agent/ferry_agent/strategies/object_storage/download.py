"""Phase 3 of an object-storage load: fetch what the store lacks with parallel ranged GETs straight into the
artifacts' tmp files, checking each shard as soon as its last range lands."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
from botocore.exceptions import BotoCoreError, ClientError

from ferry import checkpoint_format as ckpt
from ferry_agent.store.checkpoints import ArtifactKind, CheckpointStore
from ferry_agent.strategies.object_storage.checkpoint import Checkpoint, LoadError, Shard, s3_error
from ferry_agent.strategies.object_storage.files import Countdown, mapped, pwrite_all, run_tasks
from ferry_agent.strategies.progress import Progress, ProgressThrottle

PROGRESS_INTERVAL_S = 1.0


class _Progress:
    """Thread-safe byte counter that forwards throttled (done, total, source) reports; `source` names the S3
    objects being read, so that a stall report says what the load waits on."""

    def __init__(self, callback: Progress | None, total: int, source: str) -> None:
        self._throttle = ProgressThrottle(callback, PROGRESS_INTERVAL_S)
        self._lock = threading.Lock()
        self.total = total
        self.done = 0
        self.source = source
        self._throttle(0, total, source)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            self._throttle(self.done, self.total, self.source)


# Per-tensor tasks report a failure rather than raise it, so that no traceback keeps a view of a mapping alive.
Verdict = tuple[str, str | None]  # (tensor, error or None)


def _check_region(mm: mmap.mmap, name: str, offset: int, nbytes: int, checksum: str) -> Verdict:
    got = ckpt.adler32_hex(np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset))
    return name, None if got == checksum else f"got {got}, expected {checksum}"


def _first_error(verdicts: Sequence[Verdict]) -> tuple[str, str] | None:
    return next(((name, msg) for name, msg in verdicts if msg is not None), None)


def _fetch_range(
    checkpoint: Checkpoint, shard: Shard, fd: int, begin: int, end: int, progress: _Progress, finish: Countdown
) -> None:
    """One ranged GET, written at its offset in the shard's file; the shard's last range finishes the shard."""
    link = checkpoint.link
    uri = link.shard_uri(shard.name)
    try:
        response = checkpoint.client.get_object(
            Bucket=link.bucket, Key=link.shard_key(shard.name), Range=f"bytes={begin}-{end - 1}"
        )
        data = response["Body"].read()
    except (ClientError, BotoCoreError) as exc:
        raise s3_error(exc, uri) from exc
    if len(data) != end - begin:
        raise LoadError(
            f"shard {uri}: the ranged GET of bytes {begin}-{end - 1} returned {len(data)} bytes; "
            "the object changed or is truncated"
        )
    pwrite_all(fd, data, begin)
    progress.add(len(data))
    finish.tick()


def _finish_shard(checkpoint: Checkpoint, shard: Shard, path: Path, fd: int) -> None:
    """A shard is downloaded: check its header is the one validated and (full checkpoints) every tensor's
    adler32, then start its write-back, overlapping the downloads still running (the commit's fsync is then
    cheap)."""
    if os.pread(fd, shard.layout.data_start, 0) != shard.header:
        raise LoadError(f"shard {checkpoint.where(shard.name)} changed while it was downloaded")
    if checkpoint.ref.kind == ArtifactKind.FULL:
        with mapped(path) as mm:
            bad = _first_error(
                [
                    _check_region(
                        mm, name, shard.layout.data_start + info.begin, info.nbytes, shard.layout.checksums[name]
                    )
                    for name, info in shard.layout.infos.items()
                ]
            )
        if bad is not None:
            raise LoadError(
                f"shard {checkpoint.link.shard_uri(shard.name)}: tensor {bad[0]!r} fails its adler32 check ({bad[1]})"
            )
    os.fdatasync(fd)


def download(
    store: CheckpointStore,
    fetch: list[Checkpoint],
    pool: ThreadPoolExecutor,
    timings: dict[str, float],
    *,
    report: Progress | None,
    range_bytes: int,
) -> None:
    """Ranged parallel GETs straight into the artifacts' tmp files. Each shard is checked (header, and every
    full tensor's adler32) as soon as its last range lands, so an artifact is only renamed into the store
    once all of it is verified."""
    t = time.monotonic()
    progress = _Progress(
        report,
        sum(s.layout.size for c in fetch for s in c.shards.values()),
        ", ".join(c.link.uri.rpartition("/")[0] + "/" for c in fetch),  # the folders the shards are read from
    )
    with contextlib.ExitStack() as stack:
        tasks: list[Callable[[], None]] = []
        for checkpoint in fetch:
            tmp = stack.enter_context(store.write(checkpoint.ref, {"uri": checkpoint.link.uri}, checkpoint.identity))
            (tmp / ckpt.INDEX_NAME).write_bytes(checkpoint.index_raw)
            for shard in checkpoint.shards.values():
                path = tmp / shard.name
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                stack.callback(os.close, fd)  # LIFO: closed before the artifact is committed
                os.ftruncate(fd, shard.layout.size)
                ranges = [
                    (begin, min(begin + range_bytes, shard.layout.size))
                    for begin in range(0, shard.layout.size, range_bytes)
                ]
                finish = Countdown(len(ranges), partial(_finish_shard, checkpoint, shard, path, fd))
                tasks.extend(partial(_fetch_range, checkpoint, shard, fd, b, e, progress, finish) for b, e in ranges)
        run_tasks(pool, tasks)
        timings["download"] = time.monotonic() - t  # with the checks and write-back it overlaps
        t = time.monotonic()
    timings["commit"] = time.monotonic() - t  # fsync + rename of every downloaded artifact
    for checkpoint in fetch:
        checkpoint.path = store.path(checkpoint.ref)
