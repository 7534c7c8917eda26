"""Local file I/O of a load's phases (whole positional reads and writes, read-only mappings), the countdown that
finishes a file once its last part is written, and the thread-pool runner they share."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np


class Countdown:
    """Runs `action` in the thread that completes the last of `count` parts (e.g. the last range of a shard)."""

    def __init__(self, count: int, action: Callable[[], None]) -> None:
        self._left = count
        self._lock = threading.Lock()
        self._action = action

    def tick(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._action()


def pwrite_all(fd: int, data: bytes | np.ndarray, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def pread_into(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise OSError(f"file ends {len(buffer) - done} bytes early")
        done += got


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[mmap.mmap]:
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)  # the mapping keeps the file open
    try:
        yield mm
    finally:
        # A view still held by an in-flight traceback makes close() fail; the mapping is then freed with it.
        with contextlib.suppress(BufferError):
            mm.close()


def run_tasks(pool: ThreadPoolExecutor, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run tasks in the pool; on the first failure cancel the rest, wait for running ones (they may hold
    files the caller is about to close) and raise it."""
    futures = [pool.submit(task) for task in tasks]
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    failed = next((f for f in futures if f in done and f.exception() is not None), None)
    if failed is not None:
        for future in futures:
            future.cancel()
        wait(futures)
        raise failed.exception()  # type: ignore[misc]
    return [f.result() for f in futures]
