"""The streaming S3 path against an in-memory S3 (the real path is in tests/cluster/test_s3_strategy.py): bytes
land in the new pool, each tensor checked, the store written behind the load and crash-safe."""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from botocore.exceptions import ClientError
from botocore.response import StreamingBody

from ferry import checkpoint_format as ckpt
from ferry_agent.attach.memstore import HostStore
from ferry_agent.ranks.landing import MappedLanding, unaccounted
from ferry_agent.ranks.sharding import rank_of_tensors
from ferry_agent.store.checkpoints import ArtifactRef, CheckpointStore, StoreState, StoreStatus
from ferry_agent.store.resident import ResidentWeights, TensorSpec
from ferry_agent.strategies.chain import Leftover, StrategyFailed
from ferry_agent.strategies.object_storage import stream as stream_module
from ferry_agent.strategies.object_storage.strategy import ObjectStorageStrategy
from tests.support.s3 import (
    DELTA,
    FULL,
    KEY,
    MAT,
    NAMESPACE,
    RANGE_BYTES,
    ctx,
    debris,
    delta,
    evolve,
    full,
    resident_shas,
    shas,
    weights,
    wv,
)

pytestmark = pytest.mark.unit

BUCKET = "ferry-s3-strategy"


class MemoryS3:
    """The one call the strategy makes, GET (ranged or not), over a dict of objects: no HEAD, a shard's size comes
    from its probe's Content-Range. `corrupt(key, offset)` flips one byte of every later ranged GET response that
    covers it (the stored object stays intact)."""

    def __init__(self, objects: Mapping[str, bytes]) -> None:
        self.objects = dict(objects)
        self.flips: dict[str, int] = {}
        self.gets = 0

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        self.gets += 1
        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey", "Message": "Not Found"}}, "GetObject")
        data = self.objects[Key]
        begin, end = 0, len(data)
        reply: dict[str, Any] = {}
        if Range is not None:
            first, last = Range.removeprefix("bytes=").split("-")
            begin, end = int(first), min(int(last) + 1, len(data))
            if begin >= len(data):
                raise ClientError({"Error": {"Code": "InvalidRange", "Message": "Range Not Satisfiable"}}, "GetObject")
            reply["ContentRange"] = f"bytes {begin}-{end - 1}/{len(data)}"  # the size, as S3 gives it
        body = bytearray(data[begin:end])
        flip = self.flips.get(Key)
        if flip is not None and begin <= flip < end:
            body[flip - begin] ^= 0x01
        return {**reply, "ContentLength": len(body), "Body": StreamingBody(io.BytesIO(bytes(body)), len(body))}


def publish(files: Mapping[str, bytes], version: str = "v1") -> tuple[MemoryS3, dict[str, dict[str, Any]]]:
    prefix = f"m/{version}"
    s3 = MemoryS3({f"{prefix}/{name}": data for name, data in files.items()})
    versions = {version: wv(version, "FullCheckpoint", uri=f"s3://{BUCKET}/{prefix}/{ckpt.INDEX_NAME}")}
    return s3, versions


def test_a_replay_writes_its_materialized_version_behind_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w1 = weights(10)
    # Half the model's bytes changed past compression: more than a replay from the stored delta is worth.
    w2 = evolve(w1, 11, ["embed.weight", "layers.0.attn.weight", "mask"], scramble=True)
    s3, versions = publish(full(w1))
    s3.objects.update({f"m/v2/{name}": data for name, data in delta(w1, w2, "v2", "v1").items()})
    versions["v2"] = wv("v2", "XorDelta", "v1", uri=f"s3://{BUCKET}/m/v2/{ckpt.INDEX_NAME}")
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    strategy(store, s3, versions).load(ctx("v1"))
    assert store.state(KEY).version == "v1"  # waits for v1's write-behind
    gate = threading.Event()
    write_shard = stream_module.write_shard
    monkeypatch.setattr(stream_module, "write_shard", lambda *args: (gate.wait(60), write_shard(*args)))

    result = strategy(store, s3, versions).load(ctx("v2"))
    assert resident_shas(result) == shas(w2) and result.reused == "full/v1"
    assert not store.path(ArtifactRef(KEY, MAT, "v2")).exists()  # served first, stored behind
    gate.set()
    assert store.state(KEY).version == "v2" and not debris(store.root)
    again = strategy(store, s3, versions).load(ctx("v2"))
    assert (again.reused, again.bytes_downloaded, resident_shas(again)) == ("materialized/v2", 0, shas(w2))
    store.close()


def publish_delta(s3: MemoryS3, versions: dict[str, Any], files: Mapping[str, bytes]) -> None:
    s3.objects.update({f"m/v2/{name}": data for name, data in files.items()})
    versions["v2"] = wv("v2", "XorDelta", "v1", uri=f"s3://{BUCKET}/m/v2/{ckpt.INDEX_NAME}")


def test_a_delta_replay_streams_and_stores_small_deltas_behind_the_load_materializing_every_few_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w1 = weights(12)
    w2 = evolve(w1, 13, ["embed.weight", "mask"])
    s3, versions = publish(full(w1))
    publish_delta(s3, versions, delta(w1, w2, "v2", "v1"))
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    strategy(store, s3, versions).load(ctx("v1"))
    store.flush()  # the store holds v1, not v2's delta
    gate, writes = threading.Event(), []
    write = store.write

    def gated(ref: ArtifactRef, *args: Any, **kwargs: Any) -> Any:
        writes.append((ref, threading.current_thread().name))
        if threading.current_thread().name.startswith("ferry-store-writer"):
            assert gate.wait(60)
        return write(ref, *args, **kwargs)

    monkeypatch.setattr(store, "write", gated)
    result = strategy(store, s3, versions).load(ctx("v2"))
    assert resident_shas(result) == shas(w2) and result.reused == "full/v1" and result.bytes_downloaded > 0
    # Served before any store entry of v2 exists: the writer waits at its first one (read without the lock,
    # which would wait for it).
    assert not store.path(ArtifactRef(KEY, DELTA, "v2")).exists()
    gate.set()
    store.flush()
    # A small delta (under a quarter of the model) over the stored full/v1: the delta is stored, not a whole
    # materialized copy of v2, and the store's active version stays the one it holds whole.
    assert [ref for ref, _ in writes] == [ArtifactRef(KEY, DELTA, "v2")]
    assert all(thread.startswith("ferry-store-writer") for _, thread in writes)  # none on the load's path
    assert not store.path(ArtifactRef(KEY, MAT, "v2")).exists()
    assert store.state(KEY) == StoreState(StoreStatus.READY, "v1", ("v1",)) and not debris(store.root)
    # The stored delta is the one fetched: the replay from disk reads it, and nothing from S3.
    gets = s3.gets
    again = strategy(store, s3, versions).load(ctx("v2"))
    assert (again.reused, again.bytes_downloaded, s3.gets) == ("full/v1", 0, gets)
    assert resident_shas(again) == shas(w2)
    # A third version whose delta takes the chain's stored deltas past a quarter of the model: materialized/v3
    # is written behind, and v3 becomes the store's active version.
    w3 = evolve(w2, 14, ["layers.0.mlp.weight"], scramble=True)
    s3.objects.update({f"m/v3/{name}": data for name, data in delta(w2, w3, "v3", "v2").items()})
    versions["v3"] = wv("v3", "XorDelta", "v2", uri=f"s3://{BUCKET}/m/v3/{ckpt.INDEX_NAME}")
    writes.clear()
    third = strategy(store, s3, versions).load(ctx("v3"))
    assert resident_shas(third) == shas(w3) and third.reused == "full/v1"
    store.flush()
    assert [ref for ref, _ in writes] == [ArtifactRef(KEY, DELTA, "v3"), ArtifactRef(KEY, MAT, "v3")]
    assert store.state(KEY) == StoreState(StoreStatus.READY, "v3", ("v1", "v2", "v3")) and not debris(store.root)
    again = strategy(store, s3, versions).load(ctx("v3"))
    assert (again.reused, again.bytes_downloaded, resident_shas(again)) == ("materialized/v3", 0, shas(w3))
    store.close()


def test_a_flipped_byte_of_a_streamed_delta_frame_fails_its_tensor_and_stores_nothing(tmp_path: Path) -> None:
    w1 = weights(14)
    w2 = evolve(w1, 15, ["embed.weight"], scramble=True)
    files = delta(w1, w2, "v2", "v1")
    shard = ckpt.delta_shard_name(0, 1)
    header_len, header = ckpt.parse_safetensors_header(files[shard])
    begin, end = header["embed.weight"]["data_offsets"]
    s3, versions = publish(full(w1))
    publish_delta(s3, versions, files)
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    strategy(store, s3, versions).load(ctx("v1"))
    store.flush()
    s3.flips[f"m/v2/{shard}"] = ckpt.HEADER_PREFIX_BYTES + header_len + (begin + end) // 2

    with pytest.raises(StrategyFailed) as exc:
        strategy(store, s3, versions).load(ctx("v2"))
    message = str(exc.value)
    assert not exc.value.mutated and "'embed.weight'" in message and "adler32" in message
    assert f"s3://{BUCKET}/m/v2/{shard}" in message and "applying v2 on v1" in message
    store.flush()
    assert store.artifact(ArtifactRef(KEY, DELTA, "v2")) is None and store.artifact(ArtifactRef(KEY, MAT, "v2")) is None
    assert store.state(KEY) == StoreState(StoreStatus.READY, "v1", ("v1",)) and not debris(store.root)

    s3.flips.clear()
    assert resident_shas(strategy(store, s3, versions).load(ctx("v2"))) == shas(w2)
    store.close()


def test_a_delta_replays_on_the_version_held_in_host_memory_when_the_store_lacks_it(tmp_path: Path) -> None:
    w1 = weights(16)
    w2 = evolve(w1, 17, ["embed.weight", "mask"])
    s3, versions = publish(full(w1))
    files2 = delta(w1, w2, "v2", "v1")
    publish_delta(s3, versions, files2)
    host, key = HostStore(), (NAMESPACE, "replica-0")
    # v1 came from elsewhere (a peer, say): it is held in host memory, and this node's store is empty.
    elsewhere = CheckpointStore(tmp_path / "elsewhere", 1 << 30)
    v1 = strategy(elsewhere, s3, versions, allocate=host.allocator(key, "r")).load(ctx("v1"))
    elsewhere.close()
    sealed = host.seal(v1.resident, "r:v1", "v1", versions["v1"]["metadata"]["uid"])
    del v1
    store = CheckpointStore(tmp_path / "store", 1 << 30)

    def on(store: CheckpointStore) -> ObjectStorageStrategy:  # what the agent gives a one-rank load
        return strategy(store, s3, versions, allocate=host.allocator(key, "r"), held=lambda: host.versions(key))

    result = on(store).load(ctx("v2"))
    assert resident_shas(result) == shas(w2)
    # Only the delta was fetched (not v1's data), and the tensors it leaves alone are v1's very chunks.
    assert (result.reused, result.bytes_downloaded) == ("held/v1", sum(map(len, files2.values())))
    assert result.resident.shared == {n for n, a in w1.items() if a.nbytes} - {"embed.weight", "mask"}
    store.flush()
    # The store keeps what came from object storage: the delta. Not a whole copy of v2, whose base came from
    # elsewhere (a peer's copy is not stored either), so its active version is still none.
    assert store.artifact(ArtifactRef(KEY, DELTA, "v2")) is not None
    assert store.artifact(ArtifactRef(KEY, FULL, "v1")) is None and store.artifact(ArtifactRef(KEY, MAT, "v2")) is None
    assert store.state(KEY) == StoreState(StoreStatus.READY) and not debris(store.root)
    del result
    # v1 is gone from memory: v1 comes from S3 and the stored delta replays on it (the streamed full load once
    # served the fetched base as v2 whenever the store held a delta but not its base).
    sealed.unref()
    again = strategy(store, s3, versions).load(ctx("v2"))
    assert (again.reused, again.bytes_downloaded, resident_shas(again)) == (
        None,
        sum(map(len, full(w1).values())),
        shas(w2),
    )
    store.close()


def test_a_held_version_of_another_weightversion_object_is_not_a_base(tmp_path: Path) -> None:
    w1 = weights(18)
    w2 = evolve(w1, 19, ["embed.weight"])
    s3, versions = publish(full(w1))
    publish_delta(s3, versions, delta(w1, w2, "v2", "v1"))
    host, key = HostStore(), (NAMESPACE, "replica-0")
    elsewhere = CheckpointStore(tmp_path / "elsewhere", 1 << 30)
    v1 = strategy(elsewhere, s3, versions, allocate=host.allocator(key, "r")).load(ctx("v1"))
    elsewhere.close()
    # Held as v1 of a WeightVersion object since deleted: the chain's v1 now has another uid.
    sealed = host.seal(v1.resident, "r:v1", "v1", "uid-of-the-deleted-v1")
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    held = strategy(store, s3, versions, allocate=host.allocator(key, "r"), held=lambda: host.versions(key))
    result = held.load(ctx("v2"))
    assert result.reused is None and result.bytes_downloaded > sum(a.nbytes for a in w1.values())
    assert resident_shas(result) == shas(w2) and not result.resident.shared
    sealed.unref()
    store.close()


def strategy(store: CheckpointStore, s3: MemoryS3, versions: Mapping[str, Any], **kwargs: Any) -> ObjectStorageStrategy:
    out = ObjectStorageStrategy(
        namespace=NAMESPACE,
        fetch_version=versions.get,
        credentials=lambda storage: None,
        store=store,
        download_workers=3,
        range_bytes=RANGE_BYTES,
        **kwargs,
    )
    out._client = lambda link: s3  # type: ignore[method-assign]
    out._planner._client = out._client
    return out


def test_a_load_serves_before_its_store_write_and_a_later_load_uses_the_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = weights(7)
    s3, versions = publish(full(w))
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    gate, writing = threading.Event(), threading.Event()
    write_shard = stream_module.write_shard

    def blocked(*args: Any) -> None:
        writing.set()
        assert gate.wait(60)
        write_shard(*args)

    monkeypatch.setattr(stream_module, "write_shard", blocked)
    result = strategy(store, s3, versions).load(ctx("v1"))
    assert resident_shas(result) == shas(w) and (result.reused, result.source) == (None, "s3")
    # Served while the store writer is blocked mid-entry (read without the lock, which would wait for it).
    assert writing.wait(60) and not gate.is_set()
    assert not store.path(ArtifactRef(KEY, FULL, "v1")).exists()
    gate.set()
    store.flush()
    assert store.state(KEY).version == "v1" and not debris(store.root)
    gets = s3.gets
    again = strategy(store, s3, versions).load(ctx("v1"))
    assert (again.reused, again.bytes_downloaded, s3.gets) == ("full/v1", 0, gets)
    assert resident_shas(again) == shas(w)
    store.close()


def test_a_flipped_byte_in_a_ranged_get_fails_its_tensor_and_stores_nothing(tmp_path: Path) -> None:
    w = weights(8)
    files = full(w)
    shard = ckpt.parse_index(files[ckpt.INDEX_NAME]).shards[0]
    header_len, header = ckpt.parse_safetensors_header(files[shard])
    name = next(n for n, h in header.items() if n != "__metadata__" and h["data_offsets"][1] > h["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    s3, versions = publish(files)
    s3.flips[f"m/v1/{shard}"] = ckpt.HEADER_PREFIX_BYTES + header_len + (begin + end) // 2
    store = CheckpointStore(tmp_path / "store", 1 << 30)

    with pytest.raises(StrategyFailed) as exc:
        strategy(store, s3, versions).load(ctx("v1"))
    assert not exc.value.mutated and f"tensor {name!r} fails its adler32 check" in str(exc.value)
    assert shard in str(exc.value)
    assert store.artifacts() == [] and store.state(KEY) == StoreState() and not debris(store.root)

    s3.flips.clear()
    assert resident_shas(strategy(store, s3, versions).load(ctx("v1"))) == shas(w)
    assert store.state(KEY).version == "v1"
    store.close()


def test_a_failed_write_behind_leaves_nothing_and_the_next_load_fetches_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = weights(9)
    s3, versions = publish(full(w))
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    fails = strategy(store, s3, versions)
    written = []

    def broken(*args: Any) -> None:
        written.append(args)
        raise OSError("disk full")

    monkeypatch.setattr(stream_module, "write_shard", broken)
    assert resident_shas(fails.load(ctx("v1"))) == shas(w)
    store.flush()
    monkeypatch.undo()
    assert written and store.artifacts() == [] and not debris(store.root)
    assert store.state(KEY) == StoreState(StoreStatus.READY)
    again = strategy(store, s3, versions).load(ctx("v1"))
    assert again.reused is None and resident_shas(again) == shas(w)
    store.close()


def test_a_multi_rank_leader_replays_on_its_held_share_and_the_store_and_lands_the_others(tmp_path: Path) -> None:
    """A two-rank leader's delta replay: the base bytes of its own tensors from its share of v1 sealed in its host
    memory (the unchanged ones shared, not copied), the other rank's from the store's v1; the other rank's share
    of v2 lands, sealed, in chunks it maps; nothing of v2 is stored before `commit_landed`."""
    w1 = weights(20)
    owner = rank_of_tensors([TensorSpec(n, str(a.dtype), a.shape, a.nbytes) for n, a in w1.items()], 2)
    changed = [next(n for n in sorted(w1) if owner[n] == r and w1[n].nbytes) for r in (0, 1)]
    w2 = evolve(w1, 21, changed)
    s3, versions = publish(full(w1))
    publish_delta(s3, versions, delta(w1, w2, "v2", "v1"))
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    strategy(store, s3, versions).load(ctx("v1"))  # the node's store holds v1
    store.flush()
    host, key = HostStore(), (NAMESPACE, "replica-0")
    leader = strategy(store, s3, versions, allocate=host.allocator(key, "r"))
    assert leader.lead(ctx("v1", world_size=2)) is None  # stored: every rank reads its share from the store
    share = leader.load_prepared(ctx("v1", world_size=2))
    leader.activate(ctx("v1", world_size=2), ("v1",))
    sealed = host.seal(share.resident, "r:v1#0", "v1", versions["v1"]["metadata"]["uid"])  # as a rank serves it
    del share

    result = leader.lead(ctx("v2", world_size=2))
    assert result is not None and result.landed is not None
    mine = {n for n in w1 if owner[n] == 0}
    assert resident_shas(result) == {n: s for n, s in shas(w2).items() if n in mine}
    assert result.resident.shared == {n for n in mine if w1[n].nbytes} - set(changed)  # v1's very pages
    follower = MappedLanding(result.landed.landing.descriptor(), 1)
    theirs = follower.share(None, unaccounted)
    assert shas(dict(theirs.tensors)) == {n: s for n, s in shas(w2).items() if n not in mine}
    assert store.artifact(ArtifactRef(KEY, MAT, "v2")) is None and store.artifact(ArtifactRef(KEY, DELTA, "v2")) is None
    leader.commit_landed(result.landed)
    store.flush()
    assert store.state(KEY).version == "v2" and store.artifact(ArtifactRef(KEY, MAT, "v2")) is not None
    again = strategy(store, s3, versions).load(ctx("v2"))
    assert (again.reused, again.bytes_downloaded, resident_shas(again)) == ("materialized/v2", 0, shas(w2))
    follower.close()
    sealed.unref()
    store.close()


def leftover_of(w: dict[str, Any], kept: list[str], released: list[str]) -> Leftover:
    """A failed peer load's target of `w`'s checkpoint holding (and having checked) the tensors in `kept`."""
    specs = [
        TensorSpec(n, str(torch.from_numpy(np.ascontiguousarray(t)).dtype), t.shape, t.nbytes) for n, t in w.items()
    ]
    target = ResidentWeights.allocate(specs, "cpu")
    checked = {}
    for name in kept:
        raw = np.ascontiguousarray(w[name]).reshape(-1).view(np.uint8)
        target.tensors[name].reshape(-1).view(torch.uint8).numpy()[:] = raw
        checked[name] = ckpt.adler32_hex(raw)
    return Leftover(target, checked, lambda: released.append("released"))


def tensor_spans(files: Mapping[str, bytes]) -> dict[str, tuple[str, int, int]]:
    """Each tensor's (shard, begin, end) in its shard object."""
    out = {}
    for shard in ckpt.parse_index(files[ckpt.INDEX_NAME]).shards:
        header_len, header = ckpt.parse_safetensors_header(files[shard])
        start = ckpt.HEADER_PREFIX_BYTES + header_len
        for name, h in header.items():
            if name != "__metadata__":
                out[name] = (shard, start + h["data_offsets"][0], start + h["data_offsets"][1])
    return out


def test_a_failed_peer_loads_target_is_finished_from_s3_fetching_only_what_it_did_not_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = weights(21)
    files = full(w)
    s3, versions = publish(files)
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    released: list[str] = []
    kept = ["embed.weight", "layers.0.mlp.weight"]
    leftover = leftover_of(w, kept, released)
    c = ctx("v1", leftover=leftover)
    served: list[str] = []
    fetched: list[tuple[str, int, int]] = []  # (shard, begin, end) of every ranged GET of the stream
    fetch_range = stream_module._fetch_range

    def recorded(checkpoint: Any, shard: Any, begin: int, end: int, *args: Any) -> None:
        fetched.append((shard.name, begin, end))
        fetch_range(checkpoint, shard, begin, end, *args)

    monkeypatch.setattr(stream_module, "_fetch_range", recorded)
    result = strategy(store, s3, versions, on_checked=lambda name, _: served.append(name)).load(c)

    assert result.resident is leftover.resident and c.leftover is None and not released
    assert resident_shas(result) == shas(w)
    spans = tensor_spans(files)
    for name in kept:  # no GET touched a byte of a kept tensor
        shard, lo, hi = spans[name]
        assert not [r for r in fetched if r[0] == shard and r[1] < hi and r[2] > lo], name
    kept_bytes = sum(w[n].nbytes for n in kept)
    objects = sum(len(files[s]) for s in ckpt.parse_index(files[ckpt.INDEX_NAME]).shards)
    assert result.bytes_downloaded == sum(e - b for _, b, e in fetched) == objects - kept_bytes
    assert result.detail == (
        f"2 of {len(w)} tensors ({kept_bytes} bytes) kept from the failed load, {objects - kept_bytes} bytes downloaded"
    )
    assert sorted(served) == sorted(w)  # every tensor served on, the kept ones once checked again
    store.flush()  # the store entry written behind holds every byte, the kept tensors' too
    again = strategy(store, s3, versions).load(ctx("v1"))
    assert (again.reused, again.bytes_downloaded) == ("full/v1", 0) and resident_shas(again) == shas(w)
    store.close()


def test_kept_bytes_that_changed_after_their_check_fail_the_load_and_another_manifest_is_not_kept(
    tmp_path: Path,
) -> None:
    w = weights(22)
    files = full(w)
    s3, versions = publish(files)
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    released: list[str] = []
    leftover = leftover_of(w, ["embed.weight"], released)
    leftover.resident.tensors["embed.weight"].reshape(-1).view(torch.uint8)[7] ^= 1
    with pytest.raises(StrategyFailed, match=r"'embed\.weight' kept from the failed load, changed since"):
        strategy(store, s3, versions).load(ctx("v1", leftover=leftover))
    assert store.artifacts() == [] and not debris(store.root)
    assert released == ["released"]  # taken over, so the failed stream frees it (the chain no longer can)

    other = leftover_of({**w, "extra": np.zeros(4, np.float32)}, ["embed.weight"], released)
    c = ctx("v1", leftover=other)
    result = strategy(store, s3, versions).load(c)
    assert result.resident is not other.resident and result.detail == ""
    assert c.leftover is None and released == ["released"] * 2  # freed before the load allocated its own pool
    assert resident_shas(result) == shas(w)
    store.close()


def test_a_leftover_checked_against_other_checksums_than_the_versions_is_not_kept_at_all(tmp_path: Path) -> None:
    # Its holder listed a checksum the version's shard header does not: none of that holder's bytes is trusted
    # (the target may still be served with them), so the load starts from a pool of its own.
    w = weights(23)
    s3, versions = publish(full(w))
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    released: list[str] = []
    good = leftover_of(w, ["embed.weight", "layers.0.mlp.weight"], released)
    wrong = dict(good.checked, **{"layers.0.mlp.weight": "00000000"})
    c = ctx("v1", leftover=Leftover(good.resident, wrong, good.release))
    result = strategy(store, s3, versions).load(c)
    assert result.resident is not good.resident and result.detail == "" and c.leftover is None
    assert released == ["released"] and resident_shas(result) == shas(w)
    store.close()


class SizeWithheld(MemoryS3):
    """A server whose ranged replies do not give the object's size (`bytes 0-N/*`)."""

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        reply = super().get_object(Bucket, Key, Range)
        if "ContentRange" in reply:
            reply["ContentRange"] = reply["ContentRange"].rpartition("/")[0] + "/*"
        return reply


def test_a_shard_whose_size_the_server_withholds_fails_its_validation(tmp_path: Path) -> None:
    w = weights(24)
    s3, versions = publish(full(w))
    store = CheckpointStore(tmp_path / "store", 1 << 30)
    with pytest.raises(StrategyFailed, match=r"does not give the object's size") as exc:
        strategy(store, SizeWithheld(s3.objects), versions).load(ctx("v1"))
    assert not exc.value.mutated and store.artifacts() == []
    store.close()
