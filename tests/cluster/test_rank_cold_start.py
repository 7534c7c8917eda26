"""A multi-rank S3 cold start: real gloo ranks (forked processes) replay a full + delta chain from the real S3
through one shared checkpoint store, each loading its share of the tensors (docs/ranks.md)."""

from __future__ import annotations

import errno
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from ferry import checkpoint_format as ckpt
from ferry_agent.ranks.agreement import TorchRankGroup
from ferry_agent.ranks.cold_start import run_cold_start
from ferry_agent.ranks.landing import unaccounted
from ferry_agent.ranks.sharding import rank_of_tensors
from ferry_agent.store.checkpoints import ArtifactKind, ArtifactRef, CheckpointStore
from ferry_agent.store.resident import ResidentWeights, TensorSpec
from ferry_agent.strategies.chain import LoadContext, StrategyFailed
from ferry_agent.strategies.object_storage import stream as stream_module
from tests.support.ranks import spawn
from tests.support.s3 import KEY, MODEL, Registry, Weights, ctx, delta, full, publish_chain3, shas

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


def _rank_load(registry: Registry, roots: list[Path], version: str, configured: list[str | None] | None = None):
    """The function every rank runs: its own store handle (on `roots[rank]`) and strategy, then the cold start."""

    def run(group: TorchRankGroup) -> Any:
        store = CheckpointStore(roots[group.rank], quota_bytes=1 << 30)
        strategy = registry.strategy(store)
        ctx = LoadContext(model=MODEL, version="", rank=group.rank, target_id="replica-0", world_size=group.world_size)
        mine = configured[group.rank] if configured else version
        result = run_cold_start(
            group, ctx, configured=mine, source_order=["ObjectStorage"], strategies={"ObjectStorage": strategy}
        )
        state = store.state(KEY)
        return shas(result.resident.tensors), result.bytes_downloaded, result.reused, (state.version, state.chain)

    return run


def test_ranks_split_a_replayed_chain_bit_for_bit(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    publish_chain3(registry, chain3)
    registry.publish("v3-full", full(chain3[2]))
    root = tmp_path / "node-store"
    results = spawn(tmp_path, 2, _rank_load(registry, [root, root], "v3"), timeout=90)
    assert all(r[0] == "ok" for r in results), results
    (shas0, down0, _, state0), (shas1, down1, _, _) = (r[1] for r in results)
    assert shas0 and shas1 and not set(shas0) & set(shas1)  # each rank holds its share, no tensor twice
    assert {**shas0, **shas1} == shas(chain3[2])  # together: exactly v3 as published in full
    assert down0 > 0 and down1 == 0  # only the local leader downloads; rank 1 maps what it landed
    assert state0 == ("v3", ("v1", "v2", "v3"))  # stored behind, activated only after both ranks loaded
    assert CheckpointStore(root, quota_bytes=1 << 30).artifact(ArtifactRef(KEY, ArtifactKind.MATERIALIZED, "v3"))

    # A second cold start of the same version on the same node reads only the store.
    (tmp_path / "again").mkdir()
    again = spawn(tmp_path / "again", 2, _rank_load(registry, [root, root], "v3"), timeout=90)
    assert [r[1][1] for r in again] == [0, 0] and {**again[0][1][0], **again[1][1][0]} == shas(chain3[2])

    # The independently written full v3, cold-started the same way, splits identically and matches bit for bit.
    (tmp_path / "full").mkdir()
    direct = spawn(tmp_path / "full", 2, _rank_load(registry, [root, root], "v3-full"), timeout=90)
    assert [r[1][0] for r in direct] == [shas0, shas1]


def test_a_rank_that_cannot_see_the_leaders_store_fails_every_rank(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    """When the node's store holds the version, every rank reads its own share from it: a rank whose store is
    another one (misconfigured) fails them all, and the leader's prepared mark is released."""
    registry.publish("v1", full(chain3[0]))
    roots = [tmp_path / "leader-store", tmp_path / "elsewhere"]  # rank 1 misconfigured with its own store
    leader = CheckpointStore(roots[0], quota_bytes=1 << 30)
    registry.strategy(leader).load(ctx("v1"))  # a one-rank load stored it on the leader's node
    leader.flush()
    results = spawn(tmp_path, 2, _rank_load(registry, roots, "v1"), timeout=90)
    for status, message, _cause in results:
        assert status == "fatal", results
        assert message.startswith("S3 cold start of 'v1' failed in s3_engine_loaded: rank 1: StrategyFailed:")
        assert "neither prepared nor active in this node's checkpoint store" in message
    state = leader.state(KEY)
    assert (state.version, state.target) == ("v1", None)  # as it was, and the prepared mark released


def test_ranks_configured_with_different_versions_fail_before_any_download(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    registry.publish("v1", full(chain3[0]))
    root = tmp_path / "node-store"
    results = spawn(tmp_path, 2, _rank_load(registry, [root, root], "", configured=["v1", "v9"]), timeout=60)
    for status, message, _cause in results:
        assert status == "fatal"
        assert "rank 0 pins 'v1' but rank 1 is configured with 'v9'" in message
    assert not CheckpointStore(root, quota_bytes=1).model_dir(KEY).exists()  # nothing fetched or written


def test_a_follower_finding_a_corrupt_tensor_discards_the_stored_copy(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    """The leader checks only its own tensors of a stored checkpoint; a follower that finds one of its own
    corrupt must drop the stored copy, so that the replica's retry downloads it again instead of failing forever."""
    registry.publish("v1", full(chain3[0]))
    store = CheckpointStore(tmp_path / "node-store", quota_bytes=1 << 30)
    strategy = registry.strategy(store)

    def rank(r: int) -> LoadContext:
        return LoadContext(model=MODEL, version="v1", rank=r, target_id="replica-0", world_size=2)

    strategy.load(LoadContext(model=MODEL, version="v1", rank=0, target_id="replica-0"))  # one rank: stores v1
    store.flush()  # written behind
    assert strategy.lead(rank(0)) is None  # stored: every rank reads its own share of it
    follower = max(strategy.load_prepared(rank(1)).resident.manifest, key=lambda spec: spec.nbytes).name
    path = store.artifact(ArtifactRef(KEY, ArtifactKind.FULL, "v1"))
    assert path is not None
    index = json.loads((path / ckpt.INDEX_NAME).read_text())
    name = index["weight_map"][follower]
    shard = path / name
    in_shard = {t for t, s in index["weight_map"].items() if s == name}
    layout = ckpt.check_shard(shard.read_bytes(), shard.stat().st_size, in_shard)
    with open(shard, "r+b") as f:  # flip one byte of the follower's tensor, keeping the size
        f.seek(layout.data_start + layout.infos[follower].begin)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(StrategyFailed, match=rf"tensor '{re.escape(follower)}' fails its adler32 check"):
        strategy.load_prepared(rank(1))
    assert store.artifact(ArtifactRef(KEY, ArtifactKind.FULL, "v1")) is None  # fetched again on retry


def _rank_load_counting(
    registry: Registry,
    roots: list[Path],
    version: str,
    fail_allocate_on: int | None = None,
    overlap: Path | None = None,
):
    """Like `_rank_load`, also counting the bytes of this rank's S3 GETs and of its reads from the store, and
    with an allocation (and a take-over of its landed share) that fails on rank `fail_allocate_on`. A follower
    records whether the store held anything of `version` while it loaded its share (`stored_while_loading`). With
    `overlap`, rank 0's read from the store waits (at most 20 s) for rank 1's to start (`overlapped`): it can only
    see it if both ranks read the store at the same time."""

    def run(group: TorchRankGroup) -> Any:
        from botocore.response import StreamingBody

        from ferry_agent.strategies.object_storage import build

        # Observed in this forked rank only: the bytes its S3 response bodies return, and its builds from the store.
        counted: dict[str, Any] = {"s3": 0, "store_reads": 0}

        def while_loading() -> None:
            if group.rank:
                refs = [ArtifactRef(KEY, kind, version) for kind in ArtifactKind]
                counted["stored_while_loading"] = [str(r) for r in refs if store.path(r).exists()]

        real_read, real_readinto = StreamingBody.read, StreamingBody.readinto

        def counting_read(self: StreamingBody, amt: int | None = None) -> bytes:
            data = real_read(self, amt)
            counted["s3"] += len(data)
            return data

        def counting_readinto(self: StreamingBody, b: Any) -> int:
            n = real_readinto(self, b)
            counted["s3"] += n or 0
            return n

        real_read_into = stream_module._read_into

        def counting_read_into(body: Any, view: memoryview) -> int:
            direct = stream_module._socket_reader(body) is not None  # past StreamingBody's methods: counted here
            n = real_read_into(body, view)
            counted["s3"] += n if direct else 0
            return n

        StreamingBody.read = counting_read  # type: ignore[method-assign]
        StreamingBody.readinto = counting_readinto  # type: ignore[method-assign]
        stream_module._read_into = counting_read_into
        real_build = build.build

        def counting_build(*args: Any, **kwargs: Any) -> Any:
            counted["store_reads"] += 1
            while_loading()
            if overlap is not None:
                (overlap / f"rank{group.rank}").touch()
                if group.rank == 0:
                    deadline = time.monotonic() + 20
                    while not (overlap / "rank1").exists() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    counted["overlapped"] = (overlap / "rank1").exists()
            return real_build(*args, **kwargs)

        import ferry_agent.strategies.object_storage.strategy as strategy_module

        strategy_module.build = counting_build  # type: ignore[attr-defined]

        def allocate(specs: Any, device: str, share: Any = None) -> Any:
            if group.rank == fail_allocate_on:
                raise RuntimeError("out of memory on this rank")
            return ResidentWeights.allocate(specs, device)

        def map_sealed(fds: Any, *args: Any) -> Any:
            while_loading()
            if group.rank == fail_allocate_on:
                for fd in fds:
                    os.close(fd)
                raise OSError(errno.ENOMEM, "out of memory on this rank")
            return unaccounted(fds, *args)

        store = CheckpointStore(roots[group.rank], quota_bytes=1 << 30)
        strategy = registry.strategy(store, allocate=allocate)
        ctx = LoadContext(model=MODEL, version="", rank=group.rank, target_id="replica-0", world_size=group.world_size)
        result = run_cold_start(
            group,
            ctx,
            configured=version,
            source_order=["ObjectStorage"],
            strategies={"ObjectStorage": strategy},
            map_sealed=map_sealed,
        )
        state = store.state(KEY)  # waits for the write-behind
        return shas(result.resident.tensors), result.bytes_downloaded, dict(counted), (state.version, state.chain)

    return run


def test_a_full_cold_start_reads_s3_once_and_the_follower_maps_the_leaders_copy(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    """One read from S3 for the whole replica: the follower maps its share of the leader's landed memory,
    and neither reads S3 nor the node's store (here it is even given a store of its own, which stays empty)."""
    w1 = chain3[0]
    registry.publish("v1", full(w1))
    roots = [tmp_path / "node-store", tmp_path / "follower-store"]
    results = spawn(tmp_path, 2, _rank_load_counting(registry, roots, "v1"), timeout=90)
    assert all(r[0] == "ok" for r in results), results
    (shas0, down0, counted0, state0), (shas1, down1, counted1, state1) = (r[1] for r in results)
    assert shas0 and shas1 and not set(shas0) & set(shas1)
    assert {**shas0, **shas1} == shas(w1)
    total = sum(len(data) for data in full(w1).values()) - len(full(w1)[ckpt.INDEX_NAME])
    assert down0 > 0 and counted0["s3"] >= total  # the leader fetched every shard byte, once
    assert down1 == 0 and counted1 == {"s3": 0, "store_reads": 0, "stored_while_loading": []}
    assert counted0["store_reads"] == 0  # streamed: the store is written behind, never read back
    assert state0 == ("v1", ("v1",))  # stored and activated once both ranks had loaded
    assert state1 == (None, ()) and not CheckpointStore(roots[1], quota_bytes=1).model_dir(KEY).exists()
    leader = CheckpointStore(roots[0], quota_bytes=1 << 30)
    assert leader.artifact(ArtifactRef(KEY, ArtifactKind.FULL, "v1")) is not None

    # The stored copy is the version: the next cold start reads only the store, bit for bit the same split.
    (tmp_path / "again").mkdir()
    again = spawn(tmp_path / "again", 2, _rank_load(registry, [roots[0], roots[0]], "v1"), timeout=90)
    assert [r[1][0] for r in again] == [shas0, shas1] and [r[1][1] for r in again] == [0, 0]


def test_a_follower_failing_on_the_leaders_landing_fails_every_rank_and_stores_nothing(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    registry.publish("v1", full(chain3[0]))
    root = tmp_path / "node-store"
    results = spawn(tmp_path, 2, _rank_load_counting(registry, [root, root], "v1", fail_allocate_on=1), timeout=90)
    for status, message, _cause in results:
        assert status == "fatal", results
        assert message.startswith("S3 cold start of 'v1' failed in s3_engine_loaded: rank 1: StrategyFailed:")
        assert "out of memory on this rank" in message
    store = CheckpointStore(root, quota_bytes=1 << 30)
    assert store.state(KEY).version is None  # never activated, and the landing never stored


def test_a_corrupt_tensor_of_the_followers_share_fails_every_rank_in_the_leaders_stream(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    """The leader checks every rank's tensors as they land; the follower never sees bytes that failed."""
    w1 = chain3[0]
    files = full(w1)
    owner = rank_of_tensors([TensorSpec(n, str(t.dtype), t.shape, t.nbytes) for n, t in w1.items()], 2)
    index = ckpt.parse_index(files[ckpt.INDEX_NAME])
    name = next(n for n in sorted(owner) if owner[n] == 1 and w1[n].nbytes)
    shard = index.weight_map[name]
    header_len, header = ckpt.parse_safetensors_header(files[shard])
    begin, end = header[name]["data_offsets"]
    corrupted = bytearray(files[shard])
    corrupted[ckpt.HEADER_PREFIX_BYTES + header_len + (begin + end) // 2] ^= 0x08
    registry.publish("v1", {**files, shard: bytes(corrupted)})
    root = tmp_path / "node-store"
    results = spawn(tmp_path, 2, _rank_load_counting(registry, [root, root], "v1"), timeout=90)
    for status, message, _cause in results:
        assert status == "fatal", results
        assert message.startswith("S3 cold start of 'v1' failed in s3_local_leader_prepared: rank 0: StrategyFailed:")
        assert f"tensor {name!r} fails its adler32 check" in message
    store = CheckpointStore(root, quota_bytes=1 << 30)
    assert store.state(KEY).version is None and store.artifacts() == []


def test_a_two_rank_delta_streams_once_and_the_follower_maps_its_share_of_the_result(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    """A delta on a version the node's store holds: the leader replays it once, streaming the delta from S3 onto
    the stored base, its share into its pool and the follower's into the follower's landing, which the follower
    maps; the delta and materialized/v2 are stored only after both ranks loaded (not on the critical path)."""
    w1, w2, _ = chain3
    registry.publish("v1", full(w1))
    registry.publish("v2", delta(w1, w2, "v2", "v1"), "XorDelta", "v1")
    root = tmp_path / "node-store"
    (tmp_path / "v1").mkdir()
    first = spawn(tmp_path / "v1", 2, _rank_load(registry, [root, root], "v1"), timeout=90)  # v1 stored behind
    assert all(r[0] == "ok" for r in first), first
    (tmp_path / "v2").mkdir()
    results = spawn(tmp_path / "v2", 2, _rank_load_counting(registry, [root, root], "v2"), timeout=90)
    assert all(r[0] == "ok" for r in results), results
    (shas0, down0, counted0, state0), (shas1, down1, counted1, _) = (r[1] for r in results)
    assert shas0 and shas1 and not set(shas0) & set(shas1)
    assert {**shas0, **shas1} == shas(w2)  # bit for bit v2, each tensor's sha256
    delta_bytes = sum(len(data) for data in delta(w1, w2, "v2", "v1").values())
    assert 0 < down0 <= delta_bytes and counted0["s3"] > 0  # only the delta came from S3, once
    assert counted0["store_reads"] == 0  # streamed: the leader built nothing from the store on the critical path
    assert down1 == 0 and counted1 == {"s3": 0, "store_reads": 0, "stored_while_loading": []}
    assert state0 == ("v2", ("v1", "v2"))  # written behind and activated once both ranks had loaded
    store = CheckpointStore(root, quota_bytes=1 << 30)
    assert store.artifact(ArtifactRef(KEY, ArtifactKind.MATERIALIZED, "v2")) is not None
    assert store.artifact(ArtifactRef(KEY, ArtifactKind.DELTA, "v2")) is not None

    # The stored result is v2: the next cold start reads only the store, bit for bit the same split.
    (tmp_path / "again").mkdir()
    again = spawn(tmp_path / "again", 2, _rank_load(registry, [root, root], "v2"), timeout=90)
    assert [r[1][0] for r in again] == [shas0, shas1] and [r[1][1] for r in again] == [0, 0]


def test_when_the_store_holds_the_version_every_rank_reads_its_share_at_once(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    """The leader only marks the stored version prepared; the ranks then read their shares from the store at the
    same time (rank 0's read waits for rank 1's to start: it would wait forever if rank 1 read only after it)."""
    registry.publish("v1", full(chain3[0]))
    root = tmp_path / "node-store"
    registry.strategy(CheckpointStore(root, quota_bytes=1 << 30)).load(ctx("v1"))  # the node's store holds v1
    overlap = tmp_path / "overlap"
    overlap.mkdir()
    results = spawn(tmp_path, 2, _rank_load_counting(registry, [root, root], "v1", overlap=overlap), timeout=90)
    assert all(r[0] == "ok" for r in results), results
    (shas0, down0, counted0, state0), (shas1, down1, counted1, _) = (r[1] for r in results)
    assert {**shas0, **shas1} == shas(chain3[0]) and not set(shas0) & set(shas1)
    assert (down0, down1, counted0["s3"], counted1["s3"]) == (0, 0, 0, 0)
    assert counted0["store_reads"] == counted1["store_reads"] == 1  # each rank reads its own share, once
    assert counted0["overlapped"] is True
    assert state0 == ("v1", ("v1",))
    assert CheckpointStore(root, quota_bytes=1 << 30).state(KEY).target is None  # the prepared mark is gone


def test_a_corrupt_delta_frame_fails_every_rank_and_stores_nothing(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    w1, w2, _ = chain3
    registry.publish("v1", full(w1))
    files = delta(w1, w2, "v2", "v1")
    index = ckpt.parse_index(files[ckpt.INDEX_NAME])
    owner = rank_of_tensors([TensorSpec(n, str(t.dtype), t.shape, t.nbytes) for n, t in w1.items()], 2)
    name = next(n for n in sorted(index.weight_map) if owner[n] == 1)  # a frame of the follower's share
    shard = index.weight_map[name]
    header_len, header = ckpt.parse_safetensors_header(files[shard])
    begin, end = header[name]["data_offsets"]
    corrupted = bytearray(files[shard])
    corrupted[ckpt.HEADER_PREFIX_BYTES + header_len + (begin + end) // 2] ^= 0x08
    registry.publish("v2", {**files, shard: bytes(corrupted)}, "XorDelta", "v1")
    root = tmp_path / "node-store"
    registry.strategy(CheckpointStore(root, quota_bytes=1 << 30)).load(ctx("v1"))  # the node's store holds v1
    results = spawn(tmp_path, 2, _rank_load_counting(registry, [root, root], "v2"), timeout=90)
    for status, message, _cause in results:
        assert status == "fatal", results
        assert message.startswith("S3 cold start of 'v2' failed in s3_local_leader_prepared: rank 0: StrategyFailed:")
        assert f"tensor {name!r}" in message and "delta shard" in message
    store = CheckpointStore(root, quota_bytes=1 << 30)
    state = store.state(KEY)
    assert (state.version, state.target) == ("v1", None)
    assert {(a.ref.kind, a.ref.version) for a in store.artifacts()} == {(ArtifactKind.FULL, "v1")}
