"""S3 throughput of the ObjectStorage strategy on a local SeaweedFS, against plain baselines, in one run.

    ~/.cache/ferry/venv/bin/python bench/bench_s3.py [--size 256M --shards 4 --workers 8]

- full load: `ObjectStorageStrategy.load` of a FullCheckpoint into an empty store (validate, ranged GETs read
  straight into the agent's host memory (a `HostStore`'s shared-memory chunks, as the agent loads a CPU
  version; `--shmem-huge-pages advise` gives them 2 MiB pages), adler32 of every tensor as its last range lands;
  the store entry is written behind, off the load's critical path) vs the same ranged GETs with plain boto3 into
  memory (same client settings, workers and range size). Also timed until the store entry is durable
  (`CheckpointStore.flush`).
- full load vs purpose-built clients (the `bench` extra; `_s3_clients.py`), in the same rounds as the boto3
  baseline and the full load (each round runs each once): obstore ranged GETs into memory (same workers and
  ranges), and the Run:ai model streamer's `SafetensorsStreamer` reading the same shards from s3:// into CPU
  tensors (same concurrency and request size; its C++ reader is the AWS CRT S3 client), once into fresh memory as
  a serving process's first load does, once reusing the memory of its previous load, freed just before (on this
  VM the streamer is ~4x faster and burns ~4x less CPU then). Every byte is sha256-checked; a client that is not
  installed is a printed note and its rows are skipped. 2026-12-03, 256 MiB, 2-core VM, 4 runs: the full load
  over obstore 0.86 / 1.31 / 1.17 / 0.97 and obstore over boto3 1.00 / 0.88 / 1.02 / 1.27 (no consistent win, so
  the streaming path keeps boto3, reading straight into the pool); over the Run:ai streamer 5.1 / 4.9 into fresh
  memory and 1.3 / 1.4 reusing memory (docs/benchmarks.md).
- warm load: the same version again, now served from the store (no S3 data traffic).
- full load, 2 ranks: the desired-version cold start of a two-rank replica (two forked processes in a gloo group,
  kept for every round as the agent keeps its rank processes between loads; an empty store each round): the local
  leader streams the checkpoint once (its share into its pool, the other rank's into a sealed shared-memory
  landing), the other rank serves its share from that landing as it is (mapped read-only, no copy); timed until
  both ranks hold their shares (the slower rank), in the same rounds as the boto3 baseline and the one-rank load.
  Also from a store that holds the version (each rank reads its own share, at the same time), against the
  one-rank warm load in the same rounds, and a delta on a store holding v1 (the leader replays it once, the other
  rank maps its share of the result), in the delta rounds.
- delta apply: the strategy's build phase for an XorDelta that touches every tensor (read v1 into the pool,
  streamed zstd decode + XOR + adler32, write materialized/v2 and start its write-back) vs numpy XOR of in-memory
  buffers of the same sizes (one thread, XOR only); for scale, the warm load's build phase (read + adler32 only),
  the decoder alone on in-memory frames (`apply_xor_delta_into`), and the whole delta load (store holds v1).
Writes bench/results/s3.json and s3.md. GB/s means 1e9 bytes per second; delta rates count target tensor bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import torch
import torch.distributed as dist
from _common import add_shmem_argument, shmem_huge_pages, summary
from _s3_clients import (
    missing,
    obstore_ranged_gets,
    obstore_store,
    runai_streamer_load,
    s3torchconnector_client,
    s3torchconnector_load,
)

from ferry import checkpoint_format as ckpt
from ferry import s3
from ferry.api.conditions import set_condition
from ferry.api.models import WeightVersionConditionType, WeightVersionReadyReason
from ferry_agent.attach.memstore import HostStore
from ferry_agent.ranks.agreement import TorchRankGroup
from ferry_agent.ranks.cold_start import run_cold_start
from ferry_agent.store.checkpoints import CheckpointStore, model_key
from ferry_agent.strategies.chain import LoadContext
from ferry_agent.strategies.object_storage.replay import ranges_of
from ferry_agent.strategies.object_storage.strategy import DEFAULT_RANGE_BYTES, ObjectStorageStrategy, S3LoadResult
from ferry_agent.transport.worker_service import DEFAULT_TRANSFER_TIMEOUT_S
from ferry_dev.localcluster import S3Server

MIB = 1 << 20
BUCKET = "ferry-bench"
MODEL = "bench-model"


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def make_weights(total: int, tensor_bytes: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    count = max(1, total // tensor_bytes)
    return {
        f"layers.{i}.weight": np.frombuffer(rng.bytes(tensor_bytes), dtype=np.float32).reshape(-1, 1024).copy()
        for i in range(count)
    }


def evolve(base: dict[str, np.ndarray], seed: int, fraction: float) -> dict[str, np.ndarray]:
    """Every tensor changes: a contiguous `fraction` of its bytes is redrawn (a fine-tuning step touches all)."""
    rng = np.random.default_rng(seed)
    new = {}
    for name, array in base.items():
        raw = array.reshape(-1).view(np.uint8).copy()
        span = int(raw.size * fraction)
        start = int(rng.integers(0, raw.size - span + 1))
        raw[start : start + span] = np.frombuffer(rng.bytes(span), dtype=np.uint8)
        new[name] = raw.view(array.dtype).reshape(array.shape)
    return new


def shas(tensors: dict[str, Any]) -> dict[str, str]:
    out = {}
    for name, t in tensors.items():
        raw = t.reshape(-1).view(torch.uint8).numpy() if isinstance(t, torch.Tensor) else t
        out[name] = hashlib.sha256(raw.tobytes()).hexdigest()
    return out


def version(name: str, fmt: str, uri: str, base: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"modelName": MODEL, "format": fmt, "storage": {"uri": uri}}
    if base:
        spec["baseVersion"] = base
    ready = set_condition([], WeightVersionConditionType.READY, True, WeightVersionReadyReason.VERIFIED)
    return {"metadata": {"name": name, "uid": f"uid-{name}"}, "spec": spec, "status": {"conditions": ready}}


def raw_ranged_gets(client: Any, objects: dict[str, int], workers: int, range_bytes: int) -> dict[str, bytearray]:
    """The baseline: parallel ranged GETs of the same shard objects into preallocated memory."""
    buffers = {key: bytearray(size) for key, size in objects.items()}

    def fetch(key: str, begin: int, end: int) -> None:
        body = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={begin}-{end - 1}")["Body"].read()
        memoryview(buffers[key])[begin:end] = body

    jobs = [(k, b, min(b + range_bytes, size)) for k, size in objects.items() for b in range(0, size, range_bytes)]
    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(fetch, *job) for job in jobs]:
            future.result()
    return buffers


def rounds(fns: dict[str, Callable[[], float | None]], reps: int) -> dict[str, list[float]]:
    """Runs the functions in turn, reps+1 rounds (the first is a warm-up), so that each compared pair sees the same
    machine load; a function may return its own measured seconds."""
    out: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(reps + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            inner = fn()
            if round_:
                out[name].append(inner if inner is not None else time.perf_counter() - start)
    return out


class Ranks:
    """`ranks` forked rank processes in one gloo group, kept for every cold start of the row, as the node agent keeps
    its rank processes between loads (`ranks.supervisor.RankPool`); `load(root)` is one cold start of the replica into
    the empty store at `root`."""

    def __init__(self, make: Callable[[CheckpointStore], ObjectStorageStrategy], root: Path, ranks: int) -> None:
        root.mkdir(parents=True)
        fork = mp.get_context("fork")
        self._results = fork.Queue()
        self._pipes = []
        self._procs = []
        for rank in range(ranks):
            ours, theirs = fork.Pipe()
            self._pipes.append(ours)
            self._procs.append(fork.Process(target=self._rank, args=(make, root, rank, ranks, theirs)))
            self._procs[-1].start()

    def _rank(
        self, make: Callable[[CheckpointStore], ObjectStorageStrategy], root: Path, rank: int, ranks: int, pipe: Any
    ) -> None:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        s3.forget_clients()  # a forked rank must not share its parent's pooled S3 connections
        with TorchRankGroup.init(rank=rank, world_size=ranks, store=dist.FileStore(str(root / "gloo"), ranks)) as g:
            while (job := pipe.recv()) is not None:
                root, version = job
                ctx = LoadContext(model=MODEL, version="", rank=rank, target_id="bench", world_size=ranks)
                store = CheckpointStore(root, quota_bytes=64 << 30)
                strategy = make(store)
                g.all_gather_object(None)  # start together
                start = time.perf_counter()
                result = run_cold_start(
                    g, ctx, configured=version, source_order=["ObjectStorage"], strategies={"ObjectStorage": strategy}
                )
                seconds = time.perf_counter() - start
                part = shas(dict(result.resident.tensors))
                del result  # this rank's share goes before the next load
                store.close()  # the leader's write-behind finishes before the next load (untimed)
                self._results.put((rank, seconds, part))

    def load(self, store: Path, version: str = "v1") -> tuple[float, dict[str, str]]:
        """The slower rank's seconds, and every tensor's sha256 across the ranks."""
        for pipe in self._pipes:
            pipe.send((store, version))
        outcomes = [self._results.get(timeout=600) for _ in self._procs]
        union: dict[str, str] = {}
        for _, _, part in outcomes:
            union.update(part)
        return max(seconds for _, seconds, _ in outcomes), union

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.send(None)
        for proc in self._procs:
            proc.join(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="256M", help="full checkpoint tensor bytes")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--tensor-mib", type=int, default=8)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--range-mib", type=int, default=DEFAULT_RANGE_BYTES // MIB)
    parser.add_argument("--delta-fraction", type=float, default=0.1, help="share of each tensor's bytes changed")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--only", choices=["all", "delta"], default="all", help="delta: only the delta rows (and their numpy baseline)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    add_shmem_argument(parser)
    args = parser.parse_args(argv)
    size, range_bytes = parse_size(args.size), args.range_mib * MIB

    work = Path(tempfile.mkdtemp(prefix="ferry-bench-s3-"))
    server = S3Server(work / "s3")
    try:
        server.start()
        server.create_bucket(BUCKET)
        with shmem_huge_pages(args.shmem_huge_pages) as mode:
            report = {"shmem_huge_pages": mode, **run(server, work, args, size, range_bytes)}
    finally:
        if server.process:
            server.process.kill()  # throwaway data; a graceful SeaweedFS stop takes ~25 s
        shutil.rmtree(work, ignore_errors=True)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "s3.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "s3.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out / 's3.json'} and {args.out / 's3.md'}")
    return 0 if report["verified_sha256"] else 1


def run(server: S3Server, work: Path, args: argparse.Namespace, size: int, range_bytes: int) -> dict[str, Any]:
    w1 = make_weights(size, args.tensor_mib * MIB, seed=1)
    w2 = evolve(w1, seed=2, fraction=args.delta_fraction)
    total = sum(a.nbytes for a in w1.values())
    uploader = server.client()
    versions: dict[str, dict[str, Any]] = {}
    stored: dict[str, dict[str, bytes]] = {}
    for name, files, fmt, base in [
        ("v1", ckpt.build_full_checkpoint(w1, -(-total // args.shards)), "FullCheckpoint", None),
        ("v2", ckpt.build_xor_delta(w1, w2, "v2", "v1"), "XorDelta", "v1"),
    ]:
        for file, data in files.items():
            uploader.put_object(Bucket=BUCKET, Key=f"{name}/{file}", Body=data)
        versions[name] = version(name, fmt, f"s3://{BUCKET}/{name}/{ckpt.INDEX_NAME}", base)
        stored[name] = files
    full_objects = {f"v1/{f}": len(d) for f, d in stored["v1"].items() if f != ckpt.INDEX_NAME}
    object_shas = {f"v1/{f}": hashlib.sha256(d).hexdigest() for f, d in stored["v1"].items()}
    delta_bytes = sum(len(d) for d in stored["v2"].values())
    delta_objects = {f"v2/{f}": len(d) for f, d in stored["v2"].items() if f != ckpt.INDEX_NAME}
    del stored
    creds = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}

    stores: dict[Path, CheckpointStore] = {}

    host = HostStore()  # what the agent loads a CPU version into: shared-memory chunks (`memstore`)

    def loader(store: CheckpointStore) -> ObjectStorageStrategy:
        return ObjectStorageStrategy(
            namespace="bench",
            allocate=host.allocator("bench", "bench"),
            fetch_version=versions.get,
            credentials=lambda _: creds,
            store=store,
            default_endpoint=server.endpoint,
            download_workers=args.workers,
            range_bytes=range_bytes,
        )

    def strategy(root: Path) -> ObjectStorageStrategy:
        stores[root] = CheckpointStore(root, quota_bytes=64 << 30)
        return loader(stores[root])

    ctx = {v: LoadContext(model=MODEL, version=v, rank=0, target_id="bench") for v in versions}
    last: dict[str, S3LoadResult] = {}
    timings: dict[str, list[dict[str, float]]] = {"full": [], "warm": []}

    def empty_store() -> ObjectStorageStrategy:
        if work / "cold" in stores:  # the previous cold store's write-behind finishes first (untimed)
            stores.pop(work / "cold").close()
        shutil.rmtree(work / "cold", ignore_errors=True)  # one cold store at a time keeps the disk tidy
        return strategy(work / "cold")

    until_stored: list[float] = []

    def full_load() -> float:
        result = empty_store().load(ctx["v1"])
        start = time.perf_counter()
        stores[work / "cold"].flush()
        until_stored.append(result.seconds + time.perf_counter() - start)
        last["full"] = result
        timings["full"].append(dict(result.timings))
        return result.seconds

    warm: list[ObjectStorageStrategy] = []

    def warm_load() -> float:
        if not warm:  # the store fills on the first call
            warm.append(strategy(work / "warm"))
            warm[0].load(ctx["v1"])
        result = warm[0].load(ctx["v1"])
        last["warm"] = result
        timings["warm"].append(dict(result.timings))
        return result.seconds

    client = s3.new_client(server.endpoint, None, creds, s3.bulk_download(args.workers, DEFAULT_TRANSFER_TIMEOUT_S))

    def raw_gets() -> None:
        raw_ranged_gets(client, full_objects, args.workers, range_bytes)

    # The purpose-built clients, on the same objects (their rows are skipped when the bench extra is absent).
    notes = [note for note in (missing("obstore"), missing("runai_streamer"), missing("s3torchconnector")) if note]
    references: dict[str, Callable[[], None]] = {}
    got: dict[str, Any] = {}
    if not missing("obstore"):
        store = obstore_store(server.endpoint, creds, BUCKET, DEFAULT_TRANSFER_TIMEOUT_S)

        def obstore_gets() -> None:
            got["obstore"] = obstore_ranged_gets(store, full_objects, args.workers, range_bytes)

        references["obstore_ranged_gets"] = obstore_gets
    if not missing("runai_streamer"):
        uris = [f"s3://{BUCKET}/{key}" for key in full_objects]

        def runai_streamer() -> None:
            # Into fresh memory, as the first load of a serving process: the previous load's tensors are still held.
            got["runai"] = runai_streamer_load(server.endpoint, creds, uris, args.workers, range_bytes)

        def runai_streamer_reusing() -> None:
            # The previous load's tensors freed first: the streamer's allocations reuse that memory, which on this
            # VM makes it several times faster (and less CPU-bound) than into fresh memory.
            got.pop("runai_reusing", None)
            got["runai_reusing"] = runai_streamer_load(server.endpoint, creds, uris, args.workers, range_bytes)

        references["runai_streamer"] = runai_streamer
        references["runai_streamer_reusing_memory"] = runai_streamer_reusing
    if not missing("s3torchconnector"):
        crt = s3torchconnector_client(server.endpoint, creds, range_bytes)

        def s3torchconnector_gets() -> None:
            got["s3torchconnector"] = s3torchconnector_load(
                crt, server.endpoint, creds, BUCKET, full_objects, args.workers
            )

        references["s3torchconnector"] = s3torchconnector_gets

    ranked_shas: list[dict[str, str]] = []
    ranks: Ranks | None = None

    def ranked_full_load() -> float:
        assert ranks is not None
        store = work / "ranked" / f"store-{len(ranked_shas)}"
        seconds, union = ranks.load(store)
        shutil.rmtree(store, ignore_errors=True)
        ranked_shas.append(union)
        return seconds

    warm_ranked_shas: list[dict[str, str]] = []

    def ranked_warm_load() -> float:
        assert ranks is not None
        store = work / "ranked-warm"
        if not warm_ranked_shas:  # the store fills on the first call
            ranks.load(store)
        seconds, union = ranks.load(store)
        warm_ranked_shas.append(union)
        return seconds

    delta_ranked_shas: list[dict[str, str]] = []

    def ranked_delta_load() -> float:
        """v2 on a node whose store holds v1 (each round fetches and stores the delta and materialized/v2 again)."""
        assert ranks is not None
        store = work / "ranked-delta"
        if not delta_ranked_shas:
            ranks.load(store)
        model_dir = CheckpointStore(store, quota_bytes=64 << 30).model_dir(model_key("bench", MODEL))
        for kind in ("materialized", "deltas"):
            shutil.rmtree(model_dir / kind, ignore_errors=True)
        seconds, union = ranks.load(store, "v2")
        delta_ranked_shas.append(union)
        return seconds

    def raw_delta_gets() -> None:  # the S3 floor of a delta load: its frames' bytes, in the load's ranges
        size = ranges_of(sum(delta_objects.values()), range_bytes, args.workers)
        raw_ranged_gets(client, delta_objects, args.workers, size)

    ranks = Ranks(loader, work / "ranked", 2)  # kept for every round, as the agent keeps its rank processes
    delta = delta_rows(
        host, strategy, empty_store, stores, work, ctx, w1, w2, total, args.reps, raw_delta_gets, ranked_delta_load
    )
    results: dict[str, Any] = dict(delta["results"])
    verified = delta["verified"] and all(union == shas(w2) for union in delta_ranked_shas)
    full_ratios: dict[str, float] = {}
    if args.only == "all":
        paired = rounds(
            {
                "raw": raw_gets,
                **references,
                "full": full_load,
                "ranked": ranked_full_load,
                "warm": warm_load,
                "ranked_warm": ranked_warm_load,
            },
            args.reps,
        )
        raw, full, ranked, warm = paired["raw"], paired["full"], paired["ranked"], paired["warm"]
        verified = (
            verified
            and shas(dict(last["full"].resident.tensors)) == shas(w1)
            and shas(dict(last["warm"].resident.tensors)) == shas(w1)
            and all(union == shas(w1) for union in ranked_shas + warm_ranked_shas)
            and (
                all(
                    {k: hashlib.sha256(v).hexdigest() for k, v in got[reader].items()}
                    == {k: object_shas[k] for k in full_objects}
                    for reader in ("obstore", "s3torchconnector")
                    if reader in got
                )
            )
            and all(shas(got[k]) == shas(w1) for k in ("runai", "runai_reusing") if k in got)
        )
        results.update(
            {
                "strategy_full_load": summary(total, full),
                "strategy_full_load_until_stored": summary(total, until_stored[1:]),
                "strategy_full_load_2_ranks": summary(total, ranked),
                "raw_boto3_ranged_gets": summary(total, raw),
                "strategy_warm_load_from_store": summary(total, warm),
                "strategy_warm_load_2_ranks": summary(total, paired["ranked_warm"]),
                "strategy_warm_build_phase": summary(total, [t["build"] for t in timings["warm"][1:]]),
                **{name: summary(total, paired[name]) for name in references},
            }
        )
        med = {k: v["gbps_median"] for k, v in results.items()}
        full_ratios = {
            "full_load_vs_raw_gets": round(med["strategy_full_load"] / med["raw_boto3_ranged_gets"], 3),
            "full_load_until_stored_vs_raw_gets": round(
                med["strategy_full_load_until_stored"] / med["raw_boto3_ranged_gets"], 3
            ),
            "full_load_2_ranks_vs_raw_gets": round(med["strategy_full_load_2_ranks"] / med["raw_boto3_ranged_gets"], 3),
            "full_load_2_ranks_vs_1_rank": round(med["strategy_full_load_2_ranks"] / med["strategy_full_load"], 3),
            "warm_load_vs_raw_gets": round(med["strategy_warm_load_from_store"] / med["raw_boto3_ranged_gets"], 3),
            "warm_load_2_ranks_vs_1_rank": round(
                med["strategy_warm_load_2_ranks"] / med["strategy_warm_load_from_store"], 3
            ),
            "warm_build_vs_numpy_xor": round(med["strategy_warm_build_phase"] / med["numpy_xor_in_memory"], 3),
            **{f"full_load_vs_{name}": round(med["strategy_full_load"] / med[name], 3) for name in references},
            **{f"{name}_vs_raw_gets": round(med[name] / med["raw_boto3_ranged_gets"], 3) for name in references},
        }
    ranks.close()
    timings["delta"] = delta["timings"]
    return {
        "host": f"{platform.node()} ({os.cpu_count()} cpus)",
        "torch": torch.__version__,
        "boto3": boto3.__version__,
        "clients": {dist: _version(dist) for dist in ("obstore", "runai-model-streamer", "s3torchconnector")},
        "only": args.only,
        "reps": args.reps,
        "bytes": total,
        "shards": len(full_objects),
        "tensors": len(w1),
        "tensor_mib": args.tensor_mib,
        "workers": args.workers,
        "range_mib": range_bytes // MIB,
        "delta_fraction": args.delta_fraction,
        "delta_stored_bytes": delta_bytes,
        "results": results,
        "phase_seconds_median": {
            kind: {k: round(statistics.median(t.get(k, 0.0) for t in runs), 4) for k in runs[0]}
            for kind, runs in timings.items()
            if runs
        },
        "ratios": {**delta["ratios"], **full_ratios},
        "skipped": notes if args.only == "all" else [],
        "verified_sha256": verified,
    }


def delta_rows(
    host: HostStore,
    strategy: Callable[[Path], ObjectStorageStrategy],
    empty_store: Callable[[], ObjectStorageStrategy],
    stores: dict[Path, CheckpointStore],
    work: Path,
    ctx: dict[str, LoadContext],
    w1: dict[str, np.ndarray],
    w2: dict[str, np.ndarray],
    total: int,
    reps: int,
    raw_delta_gets: Callable[[], None],
    ranked_delta_load: Callable[[], float],
) -> dict[str, Any]:
    """The delta rows, in the same rounds as their numpy baseline (each round runs each once): the whole load of
    v2 on a store holding v1 (its build phase too), the same with v1 also held in the agent's host memory (its
    sealed chunks: what a replica that serves v1 replays on), the same for a two-rank replica, the decoder alone on
    in-memory frames, and the S3 floor (plain boto3 ranged GETs of the delta's objects into memory)."""
    # Baselines for the delta: the same XOR in memory (numpy only), and the decoder on in-memory frames.
    xors = {n: np.bitwise_xor(w1[n].reshape(-1).view(np.uint8), w2[n].reshape(-1).view(np.uint8)) for n in w1}
    targets = {n: w1[n].reshape(-1).view(np.uint8).copy() for n in w1}
    frames = {n: _frame(ckpt.build_xor_delta({n: w1[n]}, {n: w2[n]}, "b", "a"), n) for n in w1}

    def numpy_xor() -> None:
        for n, target in targets.items():
            np.bitwise_xor(target, xors[n], out=target)

    def decoder_in_memory() -> None:
        for n, target in targets.items():
            ckpt.apply_xor_delta_into(target, frames[n])

    last: dict[str, S3LoadResult] = {}
    phases: list[dict[str, float]] = []
    builds: list[float] = []

    def delta_load() -> float:
        s = empty_store()
        s.load(ctx["v1"])
        stores[work / "cold"].flush()  # the store holds v1
        result = s.load(ctx["v2"])
        last["delta"] = result
        phases.append(dict(result.timings))
        builds.append(result.timings.get("build", result.seconds))
        return result.seconds

    # v1 sealed in the host store, as the agent holds a version it serves; the store holds it too.
    held_root = work / "held"
    held_strategy = strategy(held_root)
    v1 = held_strategy.load(ctx["v1"])
    sealed = host.seal(v1.resident, "bench:v1", "v1", "uid-v1")
    del v1
    stores[held_root].flush()

    def delta_load_held() -> float:
        model_dir = stores[held_root].model_dir(model_key("bench", MODEL))
        for kind in ("materialized", "deltas"):  # each round fetches the delta again
            shutil.rmtree(model_dir / kind, ignore_errors=True)
        last.pop("held", None)  # the previous round's v2 goes before the next one is allocated
        result = held_strategy.load(ctx["v2"])
        last["held"] = result
        stores[held_root].flush()
        return result.seconds

    fns: dict[str, Callable[[], float | None]] = {
        "numpy_xor_in_memory": numpy_xor,
        "decoder_in_memory": decoder_in_memory,
        "strategy_delta_load": delta_load,
        "strategy_delta_load_v1_held": delta_load_held,
        "strategy_delta_load_2_ranks": ranked_delta_load,
        "raw_boto3_delta_gets": raw_delta_gets,
    }
    paired = rounds(fns, reps)
    verified = shas(dict(last["delta"].resident.tensors)) == shas(w2) and shas(
        dict(last["held"].resident.tensors)
    ) == shas(w2)
    last.clear()
    sealed.unref()
    results = {name: summary(total, seconds) for name, seconds in paired.items()}
    results["strategy_delta_build_phase"] = summary(total, builds[1:])
    med = {k: v["gbps_median"] for k, v in results.items()}
    base = med["numpy_xor_in_memory"]
    ratios = {
        "delta_build_vs_numpy_xor": round(med["strategy_delta_build_phase"] / base, 3),
        "decoder_vs_numpy_xor": round(med["decoder_in_memory"] / base, 3),
        "delta_load_vs_numpy_xor": round(med["strategy_delta_load"] / base, 3),
        "delta_load_v1_held_vs_numpy_xor": round(med["strategy_delta_load_v1_held"] / base, 3),
        "delta_load_vs_delta_gets": round(med["strategy_delta_load"] / med["raw_boto3_delta_gets"], 3),
        "delta_load_2_ranks_vs_delta_gets": round(med["strategy_delta_load_2_ranks"] / med["raw_boto3_delta_gets"], 3),
        "delta_load_2_ranks_vs_1_rank": round(med["strategy_delta_load_2_ranks"] / med["strategy_delta_load"], 3),
    }
    return {"results": results, "ratios": ratios, "verified": verified, "timings": phases[1:]}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _frame(files: dict[str, bytes], name: str) -> bytes:
    shard = files[ckpt.delta_shard_name(0, 1)]
    layout = ckpt.check_shard(shard, len(shard), {name})
    info = layout.infos[name]
    return shard[layout.data_start + info.begin : layout.data_start + info.end]


def markdown(report: dict[str, Any]) -> str:
    r, ratio = report["results"], report["ratios"]

    def cell(key: str) -> str:
        return f"{r[key]['gbps_median']:.2f} ({r[key]['gbps_best']:.2f})"

    phases = report["phase_seconds_median"]
    labels = {
        "obstore_ranged_gets": "obstore ranged GETs into memory (same workers and ranges)",
        "runai_streamer": "Run:ai model streamer, `SafetensorsStreamer` from s3:// into CPU tensors (same "
        "concurrency and request size), into fresh memory",
        "runai_streamer_reusing_memory": "same streamer, its previous load's memory freed just before (reused)",
        "s3torchconnector": "s3torchconnector (Mountpoint client on the AWS CRT): whole objects read into memory, "
        "the CRT's parallel part GETs of the same size",
    }
    clients = [
        f"| full, empty store | {cell('strategy_full_load')} | {cell(name)} {label} | "
        f"{ratio[f'full_load_vs_{name}']:.2f} |"
        for name, label in labels.items()
        if name in r
    ]
    against_boto3 = ", ".join(f"{name} {ratio[f'{name}_vs_raw_gets']:.2f}" for name in labels if name in r)
    versions = "".join(f" · {dist} {v}" for dist, v in report["clients"].items() if v)
    full_rows = (
        [
            f"| full, empty store | {cell('strategy_full_load')} | {cell('raw_boto3_ranged_gets')} boto3 ranged GETs "
            f"into memory | {ratio['full_load_vs_raw_gets']:.2f} |",
            *clients,
            f"| full, empty store, until the store entry is durable (write-behind done) | "
            f"{cell('strategy_full_load_until_stored')} | same boto3 baseline | "
            f"{ratio['full_load_until_stored_vs_raw_gets']:.2f} |",
            f"| full, empty store, 2 ranks (leader fetches once, the other rank maps its share) | "
            f"{cell('strategy_full_load_2_ranks')} | same boto3 baseline | "
            f"{ratio['full_load_2_ranks_vs_raw_gets']:.2f} |",
            f"| full, empty store, 2 ranks vs 1 rank (same rounds) | {cell('strategy_full_load_2_ranks')} | "
            f"{cell('strategy_full_load')} | {ratio['full_load_2_ranks_vs_1_rank']:.2f} |",
            f"| full, from the store | {cell('strategy_warm_load_from_store')} | same boto3 baseline | "
            f"{ratio['warm_load_vs_raw_gets']:.2f} |",
            f"| full, from the store, 2 ranks vs 1 rank (same rounds) | {cell('strategy_warm_load_2_ranks')} | "
            f"{cell('strategy_warm_load_from_store')} | {ratio['warm_load_2_ranks_vs_1_rank']:.2f} |",
            f"| warm build phase (read only, for scale) | {cell('strategy_warm_build_phase')} | numpy XOR in memory "
            f"(below) | {ratio['warm_build_vs_numpy_xor']:.2f} |",
        ]
        if "strategy_full_load" in r
        else []
    )
    return "\n".join(
        [
            "# S3 throughput (ObjectStorage strategy on local SeaweedFS, CPU target)",
            "",
            f"{report['host']} · torch {report['torch']} · boto3 {report['boto3']}{versions} · "
            f"reps {report['reps']} (+1 warm-up) · {report['bytes'] // MIB} MiB in {report['shards']} shards, "
            f"{report['tensors']} tensors of {report['tensor_mib']} MiB · {report['workers']} workers · "
            f"{report['range_mib']} MiB ranges · delta changes {report['delta_fraction']:.0%} of every tensor "
            f"({report['delta_stored_bytes'] // 1024} KiB stored) · loads land in the agent's shared-memory chunks, "
            f"shmem huge pages `{report['shmem_huge_pages']}` · median (best) GB/s over the checkpoint's tensor bytes",
            "",
            "| load | strategy | baseline | ratio |",
            "|---|---|---|---|",
            *full_rows,
            f"| delta decoder in memory (zstd + XOR + adler32) | {cell('decoder_in_memory')} | "
            f"{cell('numpy_xor_in_memory')} numpy XOR in memory (same rounds) | {ratio['decoder_vs_numpy_xor']:.2f} |",
            f"| delta load end to end, store holds v1 | {cell('strategy_delta_load')} | same numpy baseline | "
            f"{ratio['delta_load_vs_numpy_xor']:.2f} |",
            f"| delta build phase of that load | {cell('strategy_delta_build_phase')} | same numpy baseline | "
            f"{ratio['delta_build_vs_numpy_xor']:.2f} |",
            f"| delta load end to end, v1 held in host memory (and stored) | {cell('strategy_delta_load_v1_held')} | "
            f"same numpy baseline | {ratio['delta_load_v1_held_vs_numpy_xor']:.2f} |",
            f"| delta load end to end, store holds v1 | {cell('strategy_delta_load')} | "
            f"{cell('raw_boto3_delta_gets')} boto3 ranged GETs of the delta's objects alone (its S3 floor) | "
            f"{ratio['delta_load_vs_delta_gets']:.2f} |",
            f"| delta load end to end, store holds v1, 2 ranks | {cell('strategy_delta_load_2_ranks')} | same "
            f"delta GETs | {ratio['delta_load_2_ranks_vs_delta_gets']:.2f} |",
            f"| delta load, 2 ranks vs 1 rank (same rounds) | {cell('strategy_delta_load_2_ranks')} | "
            f"{cell('strategy_delta_load')} | {ratio['delta_load_2_ranks_vs_1_rank']:.2f} |",
            "",
            *([f"The purpose-built clients' throughput over boto3's: {against_boto3}."] if against_boto3 else []),
            *report["skipped"],
            "",
            "The full load's download phase includes every tensor's adler32 check as its last range lands (the "
            "store is written behind). A delta load is timed from resolving the chain to the new version in memory "
            "with every tensor's adler32 checked (validation, the delta's ranged GETs, decoding); its build phase is "
            "the decode and apply alone.",
            "",
            "Median seconds per phase: "
            + "; ".join(f"{kind}: " + ", ".join(f"{k} {v:.3f}" for k, v in p.items()) for kind, p in phases.items()),
            "",
            f"sha256 of every loaded tensor: {'ok' if report['verified_sha256'] else 'MISMATCH'}",
            "",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
