"""Real gloo process groups for tests: `spawn` runs a function on N forked ranks that rendezvous on 127.0.0.1."""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ferry_agent.ranks.agreement import TorchRankGroup
from ferry_agent.strategies.chain import StrategyRecoveryError


def _worker(rank: int, world: int, store_path: str | None, fn: Callable[..., Any], queue: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        from ferry import s3

        s3.forget_clients()  # a forked rank must not share its parent's pooled S3 connections
        # Without a store file: TCP rendezvous at $MASTER_ADDR:$MASTER_PORT, which the parent set.
        store = dist.FileStore(store_path, world) if store_path else None
        with TorchRankGroup.init(rank=rank, world_size=world, store=store, timeout=dt.timedelta(seconds=20)) as g:
            try:
                queue.put((rank, ("ok", fn(g))))
            except StrategyRecoveryError as exc:
                queue.put((rank, ("fatal", str(exc), type(exc.__cause__).__name__)))
    except BaseException as exc:  # anything else is a test bug: report it instead of hanging the parent
        queue.put((rank, ("crash", repr(exc))))


def spawn(tmp_path: Path | None, world: int, fn: Callable[[TorchRankGroup], Any], timeout: float = 30) -> list:
    """Run `fn(group)` on `world` ranks (a FileStore in `tmp_path`, else TCP); each rank's ("ok", value) or
    ("fatal", message, cause type)."""
    # fork: the children inherit the torch this module imported, so a rank starts in milliseconds, not seconds.
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    store = str(tmp_path / "store") if tmp_path else None
    procs = [ctx.Process(target=_worker, args=(r, world, store, fn, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
