"""ObjectStorageStrategy: replay chains from a real S3 server (SeaweedFS) through the node-local checkpoint store.

The chain-validation tests need no server and are marked `unit`; everything that moves bytes is `cluster`.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ferry import checkpoint_format as ckpt
from ferry import s3
from ferry.api.models import AttemptReason
from ferry.s3 import new_client, verification
from ferry.storage import StorageReason, verify_checkpoint
from ferry_agent.store.checkpoints import ArtifactRef, CheckpointStore, StoreStatus, chain_refs
from ferry_agent.strategies.chain import LoadContext, StrategyFailed
from ferry_agent.strategies.object_storage import replay as replay_module
from ferry_agent.strategies.object_storage import stream as stream_module
from ferry_agent.strategies.object_storage.strategy import ObjectStorageStrategy
from tests.support.objects import forged
from tests.support.s3 import (
    DELTA,
    FULL,
    KEY,
    MAT,
    MODEL,
    NAMESPACE,
    Registry,
    Weights,
    ctx,
    debris,
    delta,
    evolve,
    full,
    publish_chain3,
    resident_shas,
    shas,
    weights,
    wv,
)
from tests.support.slow_s3 import SlowRelay

# ---------------------------------------------------------------- replay


@pytest.mark.cluster
def test_replay_equals_independent_full_checkpoints(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    _, w2, w3 = chain3
    publish_chain3(registry, chain3)
    registry.publish("f2", full(w2))
    registry.publish("f3", full(w3))
    replay_store = CheckpointStore(tmp_path / "replay", 1 << 30)
    full_store = CheckpointStore(tmp_path / "full", 1 << 30)
    reports: list[tuple[int, int, str]] = []
    replay = registry.strategy(replay_store, progress=lambda *r: reports.append(r))
    independent = registry.strategy(full_store)

    r3 = replay.load(ctx("v3"))
    f3 = independent.load(ctx("f3"))
    assert (r3.source, r3.chain, r3.reused) == ("s3", ("v1", "v2", "v3"), None)
    assert resident_shas(r3) == resident_shas(f3) == shas(w3)
    assert r3.resident.content_sha256() == f3.resident.content_sha256() and r3.resident.digest == f3.resident.digest
    assert r3.bytes_moved == sum(a.nbytes for a in w3.values()) and r3.bytes_downloaded > r3.bytes_moved
    assert reports and reports[-1][0] == reports[-1][1]
    assert reports[0][2] == registry.uri("v1") and registry.uri("v3").rpartition("/")[0] in reports[-1][2]
    full_store.flush()  # its entries are written behind the load
    assert replay_store.state(KEY).version == "v3" and not debris(tmp_path)

    # v2 replays from what the store already holds (full/v1 and deltas/v2 came with v3): nothing downloaded.
    r2 = replay.load(ctx("v2"))
    assert (r2.reused, r2.bytes_downloaded) == ("full/v1", 0)
    assert resident_shas(r2) == resident_shas(independent.load(ctx("f2"))) == shas(w2)

    # A non-CPU pool goes through a host buffer per tensor (checksummed there); `meta` runs that path without a GPU.
    elsewhere = replay.load(ctx("v3", device="meta"))
    assert elsewhere.resident.device.type == "meta" and elsewhere.resident.digest == r3.resident.digest

    again = replay.load(ctx("v3"))
    assert (again.reused, again.bytes_downloaded) == ("materialized/v3", 0)
    assert resident_shas(again) == shas(w3)

    # A fourth version downloads only its own delta and starts from materialized/v3.
    w4 = evolve(w3, 4, ["layers.1.mlp.weight"])
    files4 = delta(w3, w4, "v4", "v3")
    registry.publish("v4", files4, "XorDelta", "v3")
    r4 = replay.load(ctx("v4"))
    assert (r4.reused, r4.bytes_downloaded) == ("materialized/v3", sum(map(len, files4.values())))
    assert resident_shas(r4) == shas(w4) and r4.chain == ("v1", "v2", "v3", "v4")

    with pytest.raises(StrategyFailed, match="digest") as exc:
        replay.load(ctx("v4", expected_manifest_digest="0" * 64))
    assert not exc.value.mutated
    replay_store.close()
    full_store.close()


@pytest.mark.cluster
def test_corrupted_delta_byte_is_caught_and_the_store_keeps_its_state(
    registry: Registry, store: CheckpointStore
) -> None:
    w1 = weights(11)
    w2 = evolve(w1, 12, ["embed.weight"], scramble=True)
    registry.publish("v1", full(w1))
    files = delta(w1, w2, "v2", "v1")
    shard = ckpt.delta_shard_name(0, 1)
    header_len, header = ckpt.parse_safetensors_header(files[shard])
    begin, end = header["embed.weight"]["data_offsets"]
    corrupted = bytearray(files[shard])
    corrupted[ckpt.HEADER_PREFIX_BYTES + header_len + (begin + end) // 2] ^= 0x40
    files[shard] = bytes(corrupted)
    registry.publish("v2", files, "XorDelta", "v1")
    strategy = registry.strategy(store)
    strategy.load(ctx("v1"))

    with pytest.raises(StrategyFailed) as exc:
        strategy.load(ctx("v2"))
    message = str(exc.value)
    assert not exc.value.mutated
    assert registry.uri("v2", shard) in message and "'embed.weight'" in message and "adler32" in message

    state = store.state(KEY)
    assert (state.status, state.version, state.chain) == (StoreStatus.READY, "v1", ("v1",))
    assert store.artifact(ArtifactRef(KEY, DELTA, "v2")) is None  # the bad delta is not kept
    assert store.artifact(ArtifactRef(KEY, MAT, "v2")) is None and not debris(store.root)
    again = strategy.load(ctx("v1"))
    assert (again.reused, again.bytes_downloaded) == ("full/v1", 0) and resident_shas(again) == shas(w1)


@pytest.mark.cluster
@pytest.mark.parametrize("missing", ["delta", "full"])
def test_missing_shard_fails_before_anything_is_stored(
    registry: Registry, store: CheckpointStore, missing: str
) -> None:
    w1 = weights(21)
    files = full(w1)
    registry.publish("v1", files)
    registry.publish("v2", delta(w1, evolve(w1, 22, ["mask"]), "v2", "v1"), "XorDelta", "v1")
    if missing == "delta":
        version, shard = "v2", ckpt.delta_shard_name(0, 1)
    else:
        version, shard = "v1", ckpt.parse_index(files[ckpt.INDEX_NAME]).shards[1]
    registry.delete(version, shard)

    with pytest.raises(StrategyFailed) as exc:
        registry.strategy(store).load(ctx("v2"))
    assert not exc.value.mutated
    assert f"{registry.uri(version, shard)} does not exist" in str(exc.value)
    # The whole chain is validated first: not even the (intact) full checkpoint was downloaded.
    assert store.artifacts() == [] and store.state(KEY).version is None and not debris(store.root)


CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from ferry import checkpoint_format as ckpt
    from ferry_agent.store.checkpoints import CheckpointStore
    from ferry_agent.strategies.object_storage.strategy import ObjectStorageStrategy
    from ferry_agent.strategies.chain import LoadContext

    root, versions, endpoint, key, secret, model, version = sys.argv[1:]
    apply, applied = ckpt.apply_xor_delta_into, []

    def apply_then_die(target, frame, *args):
        checksum = apply(target, frame, *args)
        applied.append(1)
        if len(applied) == 2:  # mid-replay: one tensor of v2 in, the rest of v2 and all of v3 still to go
            os.kill(os.getpid(), signal.SIGKILL)
        return checksum

    ckpt.apply_xor_delta_into = apply_then_die
    strategy = ObjectStorageStrategy(
        namespace="tenant-a", fetch_version=json.loads(Path(versions).read_text()).get,
        credentials=lambda storage: {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret},
        store=CheckpointStore(Path(root), 1 << 30), default_endpoint=endpoint, download_workers=1,
    )
    strategy.load(LoadContext(model=model, version=version, rank=0, target_id="child"))
    """
)


@pytest.mark.cluster
def test_sigkill_mid_apply_then_recover(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    publish_chain3(registry, chain3)
    root = tmp_path / "store"
    first = CheckpointStore(root, 1 << 30)
    registry.strategy(first).load(ctx("v1"))
    first.close()
    versions = tmp_path / "versions.json"
    versions.write_text(json.dumps(registry.versions))
    server = registry.server
    argv = [str(root), str(versions), server.endpoint, server.access_key, server.secret_key, MODEL, "v3"]
    child = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr

    model_dir = first.model_dir(KEY)
    # Mid-replay the store is as it was: the deltas stream into memory, and their store entries and
    # materialized/v3 are written only behind a load that succeeded (a crash during that write:
    # test_sigkill_during_the_write_behind_leaves_no_usable_entry).
    assert not (model_dir / "deltas").exists() and not (model_dir / "materialized").exists()
    assert json.loads((model_dir / "state.json").read_text())["status"] == "READY"

    restarted = CheckpointStore(root, 1 << 30)
    restarted.recover()
    assert not debris(root)
    state = restarted.state(KEY)
    assert (state.status, state.version) == (StoreStatus.READY, "v1")

    # The retry fetches the deltas again and replays correctly on the stored v1.
    result = registry.strategy(restarted).load(ctx("v3"))
    assert result.reused == "full/v1" and result.bytes_downloaded > 0
    assert resident_shas(result) == shas(chain3[2])
    restarted.flush()
    assert restarted.state(KEY).version == "v3"
    restarted.close()


@pytest.mark.cluster
def test_small_deltas_are_stored_and_replayed_from_disk_and_a_whole_copy_is_written_every_few_versions(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], store: CheckpointStore
) -> None:
    w1 = chain3[0]
    registry.publish("v1", full(w1))
    w2 = evolve(w1, 21, ["mask"])  # a delta of a few bytes over the stored full/v1
    registry.publish("v2", delta(w1, w2, "v2", "v1"), "XorDelta", "v1")
    strategy = registry.strategy(store)
    strategy.load(ctx("v1"))
    r2 = strategy.load(ctx("v2"))
    assert resident_shas(r2) == shas(w2) and r2.reused == "full/v1"
    store.flush()
    # The delta is stored, not a whole materialized/v2; the active version stays the one stored whole.
    assert (
        store.artifact(ArtifactRef(KEY, DELTA, "v2")) is not None
        and not store.path(ArtifactRef(KEY, MAT, "v2")).exists()
    )
    assert (store.state(KEY).version, store.state(KEY).chain) == ("v1", ("v1",)) and not debris(store.root)
    again = strategy.load(ctx("v2"))  # from disk: full/v1 and the stored delta
    assert (again.reused, again.bytes_downloaded, resident_shas(again)) == ("full/v1", 0, shas(w2))

    # Half the model changed: the chain's stored deltas pass a quarter of it, so v3 is stored whole and active.
    w3 = evolve(w2, 22, ["embed.weight", "layers.0.attn.weight"], scramble=True)
    registry.publish("v3", delta(w2, w3, "v3", "v2"), "XorDelta", "v2")
    r3 = strategy.load(ctx("v3"))
    assert resident_shas(r3) == shas(w3) and r3.reused == "full/v1"
    store.flush()
    assert (store.state(KEY).version, store.state(KEY).chain) == ("v3", ("v1", "v2", "v3"))
    again = strategy.load(ctx("v3"))
    assert (again.reused, again.bytes_downloaded, resident_shas(again)) == ("materialized/v3", 0, shas(w3))

    # A store that holds a version's delta but not its base (here: full/v1 discarded) fetches the base and
    # replays the stored delta on it; it once served the fetched base as the version.
    store.discard(ArtifactRef(KEY, FULL, "v1"))
    store.discard(ArtifactRef(KEY, MAT, "v3"))
    r2 = strategy.load(ctx("v2"))
    assert (r2.reused, resident_shas(r2)) == (None, shas(w2))


@pytest.mark.cluster
def test_quota_eviction_never_evicts_the_active_chain(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every replayed version materialized (however small its delta), so that each load activates its version:
    # what eviction keeps of the active chains is the subject here.
    monkeypatch.setattr(replay_module, "MATERIALIZE_AFTER", 0)
    w3 = chain3[2]
    publish_chain3(registry, chain3)
    w4 = evolve(w3, 5, ["mask"])
    files4 = delta(w3, w4, "v4", "v3")
    registry.publish("v4", files4, "XorDelta", "v3")

    # Learn the sizes with a roomy store, then replay the same loads under a quota that fits exactly one more
    # delta: the v4 load must evict something, and the only artifact outside every protected set is the
    # intermediate materialized/v2.
    probe = CheckpointStore(tmp_path / "probe", 1 << 30)
    for version in ("v2", "v3"):
        registry.strategy(probe).load(ctx(version))
    quota = probe.usage() + sum(map(len, files4.values())) + 16 * 1024
    probe.close()

    store = CheckpointStore(tmp_path / "store", quota)
    strategy = registry.strategy(store)
    for version in ("v2", "v3"):
        strategy.load(ctx(version))
    before = {a.ref for a in store.artifacts()}
    assert ArtifactRef(KEY, MAT, "v2") in before

    result = strategy.load(ctx("v4"))
    assert resident_shas(result) == shas(w4) and result.reused == "materialized/v3"
    after = {a.ref for a in store.artifacts()}
    assert before - after == {ArtifactRef(KEY, MAT, "v2")}
    assert chain_refs(KEY, ("v1", "v2", "v3", "v4")) <= after and store.usage() <= quota

    # Another model that cannot fit without evicting the active chain: nothing evicted, the store skipped (it is a
    # cache), the version served from memory all the same. (It needs more than the free room plus materialized/v3,
    # which is evictable now that v4 is active.)
    huge = {"huge": np.ones((1024, 1024), np.uint8)}
    registry.publish("big", full(huge))
    registry.versions["big"]["spec"]["modelName"] = "other"
    big = strategy.load(LoadContext(model="other", version="big", rank=0, target_id="r"))
    assert resident_shas(big) == shas(huge) and big.reason == AttemptReason.STORE_SKIPPED
    assert "served from memory, not stored" in big.detail and "cannot fit" in big.detail
    assert f"{KEY}:full/v1" in big.detail
    store.flush()
    assert {a.ref for a in store.artifacts()} == after
    assert (store.state(KEY).status, store.state(KEY).version) == (StoreStatus.READY, "v4")
    assert resident_shas(strategy.load(ctx("v4"))) == shas(w4)
    store.close()


# ---------------------------------------------------------------- chain validation (no server needed)


def offline(store: CheckpointStore, versions: Mapping[str, dict[str, Any]]) -> ObjectStorageStrategy:
    def no_credentials(storage: Mapping[str, Any]) -> None:
        raise RuntimeError("offline test: reaching S3 means the chain was accepted")

    return ObjectStorageStrategy(
        namespace=NAMESPACE, fetch_version=versions.get, credentials=no_credentials, store=store
    )


def linear(n: int) -> dict[str, dict[str, Any]]:
    versions = {"v0": wv("v0", "FullCheckpoint")}
    versions.update({f"v{i}": wv(f"v{i}", base=f"v{i - 1}") for i in range(1, n)})
    return versions


def fails(store: CheckpointStore, versions: Mapping[str, dict[str, Any]], version: str) -> str:
    with pytest.raises(StrategyFailed) as exc:
        offline(store, versions).load(ctx(version))
    assert not exc.value.mutated
    assert store.artifacts() == [] and store.state(KEY).version is None
    return str(exc.value)


@pytest.mark.unit
def test_cycle_is_refused(store: CheckpointStore) -> None:
    versions = {"a": wv("a", base="b"), "b": wv("b", base="c"), "c": wv("c", base="a")}
    message = fails(store, versions, "a")
    assert "ChainCycle" in message and "cycle: a → b → c → a" in message


@pytest.mark.unit
def test_chain_longer_than_64_is_refused_and_64_accepted(store: CheckpointStore) -> None:
    message = fails(store, linear(65), "v64")
    assert "ChainTooLong" in message and "more than 64" in message
    accepted = fails(store, linear(64), "v63")
    assert "reaching S3 means the chain was accepted" in accepted


@pytest.mark.unit
@pytest.mark.parametrize(
    ("not_ready", "target", "match"),
    [
        ("v1", "v2", "BaseNotReady: Base version v1 is not Ready"),
        ("v1", "v3", r"WeightVersion v1 \(in the replay chain of v3\) is not Ready"),
        ("v3", "v3", "WeightVersion v3 is not Ready"),
    ],
)
def test_links_must_all_be_ready(store: CheckpointStore, not_ready: str, target: str, match: str) -> None:
    versions = {"v1": wv("v1", "FullCheckpoint"), "v2": wv("v2", base="v1"), "v3": wv("v3", base="v2")}
    versions[not_ready]["status"]["conditions"][0]["status"] = "False"
    assert re.search(match, fails(store, versions, target))


@pytest.mark.unit
def test_model_mismatch_peer_only_and_availability(store: CheckpointStore) -> None:
    versions = {
        "v1": wv("v1", "FullCheckpoint", model="mistral"),
        "p1": wv("p1", "PeerOnly"),
        "d1": wv("d1", base="missing"),
    }
    assert "for model 'mistral', not 'org/llama'" in fails(store, versions, "v1")
    assert "PeerOnly" in fails(store, versions, "p1")
    assert "BaseNotFound" in fails(store, versions, "d1")
    assert "cannot be stored" in fails(store, {"v1.tmp": wv("v1.tmp", "FullCheckpoint")}, "v1.tmp")
    strategy = offline(store, versions)
    assert strategy.is_available(ctx("v1")) and not strategy.is_available(ctx("p1"))
    assert not strategy.is_available(ctx("nope"))
    strategy.rollback(ctx("v1"))  # holds nothing


# ---------------------------------------------------------------- streaming full loads, store written behind


@pytest.mark.cluster
def test_a_full_load_serves_before_the_store_write_behind_finished(
    registry: Registry, store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    w1 = weights(31)
    registry.publish("v1", full(w1))
    gate, writing = threading.Event(), threading.Event()
    write_shard = stream_module.write_shard

    def blocked(*args: Any) -> None:
        writing.set()
        assert gate.wait(60)
        write_shard(*args)

    monkeypatch.setattr(stream_module, "write_shard", blocked)
    result = registry.strategy(store).load(ctx("v1"))
    assert (result.source, result.reused, result.chain) == ("s3", None, ("v1",))
    assert resident_shas(result) == shas(w1)
    # Served while the store's writer is blocked inside the entry (looked at on disk: the lock would wait for it).
    assert writing.wait(60) and not gate.is_set()
    model_dir = store.model_dir(KEY)
    assert (model_dir / "full" / "v1.tmp").is_dir() and not (model_dir / "full" / "v1").exists()
    gate.set()
    store.flush()
    state = store.state(KEY)
    assert (state.status, state.version) == (StoreStatus.READY, "v1") and not debris(store.root)
    again = registry.strategy(store).load(ctx("v1"))
    assert (again.reused, again.bytes_downloaded) == ("full/v1", 0) and resident_shas(again) == shas(w1)


WRITE_BEHIND_CHILD = textwrap.dedent(
    """
    import hashlib, json, os, signal, sys, threading
    import torch
    from pathlib import Path
    from ferry_agent.store.checkpoints import CheckpointStore
    from ferry_agent.strategies.object_storage import stream
    from ferry_agent.strategies.object_storage.strategy import ObjectStorageStrategy
    from ferry_agent.strategies.chain import LoadContext

    root, versions, endpoint, key, secret, model, version = sys.argv[1:]
    served, write_shard, written = threading.Event(), stream.write_shard, []

    def write_then_die(*args):
        served.wait()
        write_shard(*args)
        written.append(1)
        if len(written) == 2:  # mid-entry: two shard files written, the others and the rename still to go
            os.kill(os.getpid(), signal.SIGKILL)

    stream.write_shard = write_then_die
    store = CheckpointStore(Path(root), 1 << 30)
    strategy = ObjectStorageStrategy(
        namespace="tenant-a", fetch_version=json.loads(Path(versions).read_text()).get,
        credentials=lambda storage: {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret},
        store=store, default_endpoint=endpoint, range_bytes=48 * 1024,
    )
    result = strategy.load(LoadContext(model=model, version=version, rank=0, target_id="child"))
    print(json.dumps({n: hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                      for n, t in result.resident.tensors.items()}), flush=True)
    served.set()
    store.flush()
    """
)


@pytest.mark.cluster
@pytest.mark.parametrize("version", ["v1", "v3"])
def test_sigkill_during_the_write_behind_leaves_no_usable_entry(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path, version: str
) -> None:
    """v1: the full checkpoint streamed from S3 into an empty store; v3: a replay on the stored v1, whose
    materialized/v3 is written behind. The writer is killed after two of the entry's shard files."""
    assert len(ckpt.parse_index(full(chain3[0])[ckpt.INDEX_NAME]).shards) > 2
    publish_chain3(registry, chain3)
    root = tmp_path / "store"
    if version == "v3":
        first = CheckpointStore(root, 1 << 30)
        registry.strategy(first).load(ctx("v1"))
        first.close()
    versions = tmp_path / "versions.json"
    versions.write_text(json.dumps(registry.versions))
    server = registry.server
    argv = [str(root), str(versions), server.endpoint, server.access_key, server.secret_key, MODEL, version]
    child = subprocess.run(
        [sys.executable, "-c", WRITE_BEHIND_CHILD, *argv], capture_output=True, text=True, timeout=120
    )
    expected = shas(chain3[int(version[1]) - 1])
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert json.loads(child.stdout) == expected  # it served every tensor before the writer died

    store = CheckpointStore(root, 1 << 30)
    kind = "full" if version == "v1" else "materialized"
    model_dir = store.model_dir(KEY)
    half = model_dir / kind / f"{version}.tmp"
    assert sum(p.suffix == ".safetensors" for p in half.iterdir()) == 2 and not (model_dir / kind / version).exists()
    assert json.loads((model_dir / "state.json").read_text())["status"] == "UPDATING"
    actions = store.recover()
    assert any(f"{version}.tmp" in a for a in actions) and any("interrupted" in a for a in actions)
    assert not debris(root) and store.state(KEY).version == (None if version == "v1" else "v1")

    result = registry.strategy(store).load(ctx(version))
    assert resident_shas(result) == expected
    assert (result.reused, result.bytes_downloaded == 0) == ((None, False) if version == "v1" else ("full/v1", True))
    store.flush()
    again = registry.strategy(store).load(ctx(version))
    assert (again.reused, again.bytes_downloaded) == (f"{kind}/{version}", 0) and resident_shas(again) == expected
    store.close()


@pytest.mark.cluster
def test_a_corrupted_byte_of_a_full_shard_in_s3_fails_its_tensor(registry: Registry, store: CheckpointStore) -> None:
    w1 = weights(33)
    files = full(w1)
    shard = ckpt.parse_index(files[ckpt.INDEX_NAME]).shards[0]
    header_len, header = ckpt.parse_safetensors_header(files[shard])
    name = next(n for n, h in header.items() if n != "__metadata__" and h["data_offsets"][1] > h["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    corrupted = bytearray(files[shard])
    corrupted[ckpt.HEADER_PREFIX_BYTES + header_len + (begin + end) // 2] ^= 0x08
    registry.publish("v1", {**files, shard: bytes(corrupted)})

    with pytest.raises(StrategyFailed) as exc:
        registry.strategy(store).load(ctx("v1"))
    assert not exc.value.mutated
    assert f"shard {registry.uri('v1', shard)}: tensor {name!r} fails its adler32 check" in str(exc.value)
    assert store.artifacts() == [] and store.state(KEY).version is None and not debris(store.root)

    registry.publish("v1", files)  # repaired: the retry loads it
    assert resident_shas(registry.strategy(store).load(ctx("v1"))) == shas(w1)


@pytest.mark.cluster
def test_ranges_are_received_straight_into_the_pool_on_pooled_connections(
    registry: Registry, store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every range of a full load is read by http.client straight into the pool (not through urllib3's copying
    `readinto`), and the layers above still count it: each connection goes back to the pool and is reused."""
    w1 = weights(34)
    registry.publish("v1", full(w1))
    direct, connections = [], set()
    socket_reader = stream_module._socket_reader

    def spied(body: Any) -> Any:
        reader = socket_reader(body)
        direct.append(reader is not None)
        connections.add(id(body._raw_stream._connection))
        return reader

    monkeypatch.setattr(stream_module, "_socket_reader", spied)
    result = registry.strategy(store).load(ctx("v1"))
    assert resident_shas(result) == shas(w1)
    # many more ranges than the strategy's 4 workers, on no more connections than workers
    assert len(direct) >= 8 and all(direct)
    assert len(connections) <= 4


@pytest.mark.cluster
def test_a_range_cut_mid_body_fails_the_load_naming_its_shard(
    registry: Registry, s3_server: Any, store: CheckpointStore
) -> None:
    w1 = weights(35)
    registry.publish("v1", full(w1))
    relay = SlowRelay(s3_server.endpoint, rate=1e12, cut=(b"Range: bytes=49152-", 20_000))
    try:
        with pytest.raises(StrategyFailed) as exc:
            registry.strategy(store, endpoint=relay.endpoint).load(ctx("v1"))
    finally:
        relay.close()
    assert not exc.value.mutated
    shard = rf"{re.escape(registry.uri('v1', ''))}model-\d+-of-\d+\.safetensors"
    cut = "the ranged GET of bytes 49152-98303 did not return exactly 49152 bytes"
    assert re.search(rf"shard {shard}: {cut}", str(exc.value)), str(exc.value)
    assert store.artifacts() == [] and store.state(KEY).version is None and not debris(store.root)
    # the same load through the server itself
    assert resident_shas(registry.strategy(store).load(ctx("v1"))) == shas(w1)


def _overlap(header: dict[str, Any]) -> None:
    """The second tensor's bytes start halfway into the first's: each tensor still spans what its shape says."""
    first, second = sorted((n for n in header if n != ckpt.METADATA_KEY), key=lambda n: header[n]["data_offsets"])[:2]
    begin, end = header[second]["data_offsets"]
    shift = (header[first]["data_offsets"][1] - header[first]["data_offsets"][0]) // 2
    header[second]["data_offsets"] = [begin - shift, end - shift]


def _f128(header: dict[str, Any]) -> None:
    """A tensor relabelled F128 (16-byte elements), its shape shrunk so that the span still matches it."""
    name = max(n for n in header if n != ckpt.METADATA_KEY)
    entry = header[name]
    entry["dtype"], entry["shape"] = "F128", [(entry["data_offsets"][1] - entry["data_offsets"][0]) // 16]


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("change", "rule"), [(_overlap, "offsets-disjoint"), (_f128, "dtype-known")], ids=["overlap", "f128"]
)
def test_a_shard_the_operator_refuses_the_agent_refuses_with_the_same_words(
    registry: Registry, store: CheckpointStore, change: Any, rule: str
) -> None:
    """One validation (`ckpt.check_shard`): the operator's verification and the agent's load, over the same objects
    in S3, refuse the same shard naming the same tensor and rule."""
    files = forged(ckpt.build_full_checkpoint(weights(31), shard_bytes=1 << 30), change)  # one shard
    registry.publish("v1", files)
    creds = {"AWS_ACCESS_KEY_ID": registry.server.access_key, "AWS_SECRET_ACCESS_KEY": registry.server.secret_key}
    client = new_client(registry.server.endpoint, "us-east-1", creds, verification())
    report = verify_checkpoint(client, registry.uri("v1"), fmt="FullCheckpoint", version="v1", base_version=None)
    assert not report.ok and report.reason == StorageReason.IndexInvalid, report
    shard = min(f for f in files if f != ckpt.INDEX_NAME)
    sentence = f"shard {registry.uri('v1', shard)} has a malformed header: tensor '"
    assert report.message.startswith(sentence[:1].upper() + sentence[1:]) and f"(rule {rule})." in report.message
    with pytest.raises(StrategyFailed) as exc:
        registry.strategy(store).load(ctx("v1"))
    said = report.message[0].lower() + report.message[1:-1]  # the operator's sentence, as a load error's clause
    assert said in str(exc.value) and store.artifacts() == []


@pytest.mark.cluster
@pytest.mark.parametrize(
    "pattern", [b"^GET ", rb"model-00001-of-\d+\.safetensors .*Range: bytes=49152-"], ids=["every-request", "one-range"]
)
def test_throttled_requests_are_retried_within_the_load(
    registry: Registry, s3_server: Any, store: CheckpointStore, pattern: bytes
) -> None:
    """`503 SlowDown` answers (the first requests of the load, index read included, or one data range again and
    again) are retried per request with backoff: the load succeeds, with the exact bytes."""
    w1 = weights(36)
    registry.publish("v1", full(w1))
    relay = SlowRelay(s3_server.endpoint, rate=1e12, throttle=(pattern, 4))
    try:
        result = registry.strategy(store, endpoint=relay.endpoint).load(ctx("v1"))
    finally:
        relay.close()
    assert relay.throttled == 4
    assert resident_shas(result) == shas(w1)


@pytest.mark.cluster
def test_a_hung_s3_fails_the_load_within_the_default_request_timeouts(
    registry: Registry, s3_server: Any, store: CheckpointStore
) -> None:
    """S3 accepts the connection and never answers: with the default settings (a 300 s transfer timeout) the index
    read fails after its tries of at most 15 s of silence each, naming the index and the timeout."""
    w1 = weights(37)
    registry.publish("v1", full(w1))
    relay = SlowRelay(s3_server.endpoint, rate=1e12)
    relay.hold()
    failures: list[BaseException] = []

    def load() -> None:
        try:
            registry.strategy(store, endpoint=relay.endpoint).load(ctx("v1"))
        except BaseException as exc:
            failures.append(exc)

    loader = threading.Thread(target=load, daemon=True)
    try:
        loader.start()
        loader.join(s3.TIMEOUT_ATTEMPTS * s3.READ_TIMEOUT_S + 15)  # well under a minute, backoffs and startup included
        assert not loader.is_alive(), "the load still waits on a hung S3"
    finally:
        relay.close()
    assert len(failures) == 1 and isinstance(failures[0], StrategyFailed) and not failures[0].mutated
    message = str(failures[0])
    assert registry.uri("v1") in message and "Read timeout" in message, message
    assert store.artifacts() == [] and store.state(KEY).version is None


@pytest.mark.cluster
def test_a_store_that_cannot_fit_the_version_is_skipped_and_the_load_serves_from_memory(
    registry: Registry, chain3: tuple[Weights, Weights, Weights], tmp_path: Path
) -> None:
    """A full load streamed into memory and a delta replay onto a held base: with a store too small for either,
    both serve the exact bytes, say StoreSkipped, and leave the store as it was (nothing written behind)."""
    w1, w2, _ = chain3
    publish_chain3(registry, chain3)
    store = CheckpointStore(tmp_path / "tiny", 4096)
    strategy = registry.strategy(store)
    first = strategy.load(ctx("v1"))
    assert resident_shas(first) == shas(w1) and first.reason == AttemptReason.STORE_SKIPPED
    assert re.search(r"served from memory, not stored: checkpoint store .* cannot fit \d+ more bytes", first.detail)
    store.flush()
    assert store.artifacts() == [] and store.state(KEY).version is None and not debris(store.root)

    # A roomy store holding v1, then too small for v2's delta and materialized/v2: the replay on the stored base
    # streams, serves, and writes nothing.
    roomy = CheckpointStore(tmp_path / "roomy", 1 << 30)
    registry.strategy(roomy).load(ctx("v1"))
    roomy.flush()
    stored = {a.ref for a in roomy.artifacts()}
    roomy.quota_bytes = roomy.usage() + 1024
    second = registry.strategy(roomy).load(ctx("v2"))
    assert resident_shas(second) == shas(w2) and second.reason == AttemptReason.STORE_SKIPPED
    roomy.flush()
    assert {a.ref for a in roomy.artifacts()} == stored and roomy.state(KEY).version == "v1"
    store.close()
    roomy.close()
