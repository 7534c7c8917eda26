"""The node-local checkpoint store: atomic artifacts, update/commit/rollback, crash recovery (including a real
SIGKILL mid-write), quota eviction that never touches an active chain; plus the streamed delta decoder and shard
header checks it relies on (ferry.checkpoint_format)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zstandard

from ferry import checkpoint_format as ckpt
from ferry_agent.store.checkpoints import (
    MARKER,
    STATE_FILE,
    ArtifactKind,
    ArtifactRef,
    CheckpointCacheCapacityError,
    CheckpointStore,
    StoreStatus,
    VersionIdentity,
    chain_refs,
    index_digest,
    model_key,
)

pytestmark = pytest.mark.unit

FULL, DELTA, MAT = ArtifactKind.FULL, ArtifactKind.DELTA, ArtifactKind.MATERIALIZED


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    s = CheckpointStore(tmp_path / "store", quota_bytes=1 << 30)
    yield s
    s.close()


def put(store: CheckpointStore, model: str, kind: ArtifactKind, version: str, nbytes: int = 1000) -> Path:
    with store.write(ArtifactRef(model, kind, version), {"uri": f"s3://b/{version}"}) as tmp:
        (tmp / "data.bin").write_bytes(b"x" * nbytes)
    return store.path(ArtifactRef(model, kind, version))


def debris(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))


def activate(store: CheckpointStore, model: str, chain: tuple[str, ...]) -> None:
    with store.update(model, chain[-1], chain) as update:
        update.commit()


# ---------------------------------------------------------------- artifacts


def test_write_is_atomic_and_fingerprinted(store: CheckpointStore) -> None:
    ref = ArtifactRef("ns/org/llama", FULL, "v1")
    final = store.path(ref)
    assert final.parent.parent.name == "org%2Fllama" and final.parent.parent.parent.name == "ns"  # one component each
    with store.write(ref, {"uri": "s3://b/v1/model.safetensors.index.json"}) as tmp:
        assert tmp.name == "v1.tmp" and not final.exists()
        (tmp / "a.safetensors").write_bytes(b"abc")
        assert store.artifact(ref) is None
    assert store.artifact(ref) == final and not debris(store.root)
    assert json.loads((final / MARKER).read_text())["files"] == {"a.safetensors": 3}
    assert store.source(ref) == {"uri": "s3://b/v1/model.safetensors.index.json"}
    with pytest.raises(FileExistsError, match="immutable"), store.write(ref, {}):
        pass


def test_writes_are_fsynced_before_they_are_renamed(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    put(store, "ns/m", FULL, "v0")  # the folders exist; creating them is fsynced too, which is not checked here
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    ref = ArtifactRef("ns/m", FULL, "v1")
    with store.write(ref, {}) as tmp:
        (tmp / "a.safetensors").write_bytes(b"abc")
    final = store.path(ref)
    # The data, the marker (itself written as tmp + rename) and the folder, all before the rename.
    assert synced[:3] == [str(tmp / "a.safetensors"), str(tmp / MARKER) + ".tmp", str(tmp)]
    assert synced[3:] == [str(final.parent)]  # then the rename itself is made durable
    synced.clear()
    activate(store, "ns/m", ("v1",))
    assert str(store.model_dir("ns/m") / STATE_FILE) + ".tmp" in synced and str(store.model_dir("ns/m")) in synced


def test_failed_write_leaves_nothing(store: CheckpointStore) -> None:
    ref = ArtifactRef("ns/m", DELTA, "v2")
    with pytest.raises(RuntimeError, match="boom"), store.write(ref, {}) as tmp:
        (tmp / "part").write_bytes(b"half")
        raise RuntimeError("boom")
    assert not store.path(ref).exists() and not debris(store.root)


def test_artifact_whose_files_changed_is_discarded(store: CheckpointStore) -> None:
    path = put(store, "ns/m", FULL, "v1")
    (path / "data.bin").write_bytes(b"short")
    assert store.artifact(ArtifactRef("ns/m", FULL, "v1")) is None
    assert not path.exists() and not debris(store.root)


@pytest.mark.parametrize(
    ("model", "version"),
    [
        ("ns/..", "v1"),
        ("ns/", "v1"),
        ("m", "v1"),
        ("", "v1"),
        ("NS/m", "v1"),
        ("../m", "v1"),
        ("ns/m", "v1.tmp"),
        ("ns/m", "a/b"),
        ("ns/m", ""),
    ],
)
def test_names_that_cannot_be_stored(store: CheckpointStore, model: str, version: str) -> None:
    with pytest.raises(ValueError, match="cannot be stored"):
        store.path(ArtifactRef(model, FULL, version))


# ---------------------------------------------------------------- updates


def test_update_commit_and_rollback(store: CheckpointStore) -> None:
    assert store.state("ns/m").version is None
    with store.update("ns/m", "v1", ("v1",)) as update:
        state = store.state("ns/m")
        assert (state.status, state.version, state.target) == (StoreStatus.UPDATING, None, "v1")
        put(store, "ns/m", FULL, "v1")
        update.commit()
    assert (store.state("ns/m").status, store.state("ns/m").version) == (StoreStatus.READY, "v1")

    with pytest.raises(RuntimeError, match="apply failed"), store.update("ns/m", "v2", ("v1", "v2")):
        assert store.state("ns/m").status == StoreStatus.UPDATING
        raise RuntimeError("apply failed")
    state = store.state("ns/m")
    assert (state.status, state.version, state.chain, state.target) == (StoreStatus.READY, "v1", ("v1",), None)

    with store.update("ns/m", "v2", ("v1", "v2")) as update, pytest.raises(RuntimeError, match="not in the store"):
        update.commit()  # materialized/v2 was never written
    assert store.state("ns/m").version == "v1"


def test_prepare_then_activate_or_release(store: CheckpointStore) -> None:
    """What a multi-rank replica's leader does: prepare (not active, but protected), then activate once every
    rank has loaded, or release when the replica gives up."""
    put(store, "ns/m", FULL, "v1")
    activate(store, "ns/m", ("v1",))
    put(store, "ns/m", DELTA, "v2")
    with store.update("ns/m", "v2", ("v1", "v2")) as update:
        put(store, "ns/m", MAT, "v2")
        update.commit(activate=False)
    state = store.state("ns/m")
    assert (state.status, state.version, state.target, state.target_chain) == (
        StoreStatus.READY,
        "v1",
        "v2",
        ("v1", "v2"),
    )
    assert ArtifactRef("ns/m", MAT, "v2") in store.protected()  # prepared: not evictable while the ranks load it
    assert store.prepared_head("ns/m", ("v1", "v2")) == store.path(ArtifactRef("ns/m", MAT, "v2"))
    assert store.prepared_head("ns/m", ("v1",)) is not None and store.prepared_head("ns/m", ("v1", "v3")) is None

    with pytest.raises(RuntimeError, match="not the prepared version"):
        store.activate("ns/m", "v3", ("v1", "v3"))
    store.activate("ns/m", "v2", ("v1", "v2"))
    state = store.state("ns/m")
    assert (state.version, state.chain, state.target) == ("v2", ("v1", "v2"), None)
    store.activate("ns/m", "v2", ("v1", "v2"))  # already active: a no-op

    with store.update("ns/m", "v2", ("v1", "v2")) as update:  # prepared again while active
        update.commit(activate=False)
    store.activate("ns/m", "v2", ("v1", "v2"))
    assert store.state("ns/m").target is None  # the duplicate mark is dropped

    put(store, "ns/m", DELTA, "v3")
    put(store, "ns/m", MAT, "v3")
    with store.update("ns/m", "v3", ("v1", "v2", "v3")) as update:
        update.commit(activate=False)
    store.release_prepared("ns/m", "v3")
    state = store.state("ns/m")
    assert (state.version, state.target) == ("v2", None)
    assert ArtifactRef("ns/m", MAT, "v3") not in store.protected()


# ---------------------------------------------------------------- recovery


def test_recover_removes_debris_and_undoes_an_interrupted_update(store: CheckpointStore) -> None:
    put(store, "ns/m", FULL, "v1")
    activate(store, "ns/m", ("v1",))
    put(store, "ns/m", DELTA, "v2")
    model_dir = store.model_dir("ns/m")
    (model_dir / "materialized" / "v3.tmp").mkdir(parents=True)
    (model_dir / "materialized" / "v3.tmp" / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    (model_dir / "deltas" / "v3.tmp").mkdir()
    (model_dir / "full" / "v9").mkdir()  # no marker: never completed
    (model_dir / "full" / "v9" / "data.bin").write_bytes(b"?")
    (model_dir / "state.json.tmp").write_text("{")
    state = json.loads((model_dir / STATE_FILE).read_text())
    state.update(status="UPDATING", target="v3", target_chain=["v1", "v2", "v3"])
    (model_dir / STATE_FILE).write_text(json.dumps(state))

    actions = store.recover()
    assert any("interrupted" in a for a in actions) and any("v9" in a for a in actions)
    assert not debris(store.root) and not (model_dir / "full" / "v9").exists()
    state = store.state("ns/m")
    assert (state.status, state.version, state.chain, state.target) == (StoreStatus.READY, "v1", ("v1",), None)
    assert store.artifact(ArtifactRef("ns/m", DELTA, "v2")) is not None  # complete artifacts survive
    assert store.recover() == []  # idempotent


def test_recover_rebuilds_an_unreadable_or_dangling_state(store: CheckpointStore) -> None:
    store.model_dir("ns/a").mkdir(parents=True)
    (store.model_dir("ns/a") / STATE_FILE).write_text('{"status": "READ')
    put(store, "ns/b", FULL, "v1")
    activate(store, "ns/b", ("v1",))
    store.discard(ArtifactRef("ns/b", FULL, "v1"))  # e.g. removed by hand
    actions = store.recover()
    assert any("unreadable" in a for a in actions) and any("no longer stored" in a for a in actions)
    for model in ("ns/a", "ns/b"):
        assert (store.state(model).status, store.state(model).version) == (StoreStatus.READY, None)


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from ferry_agent.store.checkpoints import ArtifactKind, ArtifactRef, CheckpointStore

    store = CheckpointStore(Path(sys.argv[1]), 1 << 30)
    with store.update("ns/m", "v2", ("v1", "v2")):
        with store.write(ArtifactRef("ns/m", ArtifactKind.MATERIALIZED, "v2"), {}) as tmp:
            with open(tmp / "model-00001-of-00001.safetensors", "wb") as f:
                f.write(b"half of the shard")
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_sigkill_mid_write_then_recover(store: CheckpointStore) -> None:
    put(store, "ns/m", FULL, "v1")
    activate(store, "ns/m", ("v1",))
    put(store, "ns/m", DELTA, "v2")
    child = subprocess.run([sys.executable, "-c", CHILD, str(store.root)], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    tmp = store.model_dir("ns/m") / "materialized" / "v2.tmp"
    assert (tmp / "model-00001-of-00001.safetensors").read_bytes() == b"half of the shard"
    assert store.state("ns/m").status == StoreStatus.UPDATING

    restarted = CheckpointStore(store.root, 1 << 30)  # the dead child's flock is gone with it
    try:
        assert restarted.recover()
        assert not debris(store.root)
        state = restarted.state("ns/m")
        assert (state.status, state.version) == (StoreStatus.READY, "v1")
        with restarted.update("ns/m", "v2", ("v1", "v2")) as update:  # the update can now run to completion
            put(restarted, "ns/m", MAT, "v2")
            update.commit()
        assert restarted.state("ns/m").chain == ("v1", "v2")
    finally:
        restarted.close()


# ---------------------------------------------------------------- quota


def test_chain_refs_protect_root_deltas_and_head_only() -> None:
    assert chain_refs("ns/m", ("v1", "v2", "v3")) == {
        ArtifactRef("ns/m", FULL, "v1"),
        ArtifactRef("ns/m", DELTA, "v2"),
        ArtifactRef("ns/m", DELTA, "v3"),
        ArtifactRef("ns/m", MAT, "v3"),
    }
    assert chain_refs("ns/m", ("v1",)) == {ArtifactRef("ns/m", FULL, "v1")}


def test_eviction_order_never_touches_active_chains(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store", quota_bytes=20_000)
    try:
        sizes = 1000
        active = ("v1", "v2", "v3")
        for kind, version in [(FULL, "v1"), (DELTA, "v2"), (DELTA, "v3"), (MAT, "v3"), (MAT, "v2")]:
            put(store, "ns/m", kind, version, sizes)
        activate(store, "ns/m", active)
        for kind, version in [(FULL, "old"), (DELTA, "old2"), (MAT, "old2"), (MAT, "older")]:
            put(store, "ns/m", kind, version, sizes)
        put(store, "ns/n", FULL, "w1", sizes)  # another model's active chain
        activate(store, "ns/n", ("w1",))
        put(store, "ns/n", DELTA, "w2", sizes)  # pinned below by an update in progress
        t = time.time() - 1000
        for i, artifact in enumerate(reversed(store.artifacts())):  # deterministic ages, newest listed first
            os.utime(artifact.path, (t + i, t + i))

        protected = chain_refs("ns/m", active) | {ArtifactRef("ns/n", FULL, "w1"), ArtifactRef("ns/n", DELTA, "w2")}
        evictable = [a for a in store.artifacts() if a.ref not in protected]
        order = sorted(evictable, key=lambda a: ([MAT, DELTA, FULL].index(a.ref.kind), a.mtime))
        assert [a.ref.kind for a in order] == [MAT, MAT, MAT, DELTA, FULL]
        with store.update("ns/n", "w2", ("w1", "w2")):
            free = store.quota_bytes - store.usage()
            evicted = store.reserve(free + order[0].size + order[1].size + 1)  # three artifacts must go
            assert evicted == [a.ref for a in order[:3]]
            with pytest.raises(CheckpointCacheCapacityError, match="active chains") as exc:
                store.reserve(store.quota_bytes)
            assert "ns/m:full/v1" in str(exc.value)
            # What a load outside an update reads (a streamed replay's base) is spared: the next candidate goes.
            free = store.quota_bytes - store.usage()
            assert store.reserve(free + 1, protect=[order[3].ref]) == [order[4].ref]
        remaining = {a.ref for a in store.artifacts()}
        assert protected <= remaining and order[3].ref in remaining  # the failed reserve evicted nothing (nor [4])
        assert store.reserve(0) == []
    finally:
        store.close()


# ---------------------------------------------------------------- format helpers the store's users rely on


def test_streamed_xor_matches_the_reference_decoder() -> None:
    rng = np.random.default_rng(7)
    base = rng.standard_normal(300_000).astype(np.float32)
    new = base.copy()
    new[1000:90_000] = rng.standard_normal(89_000)
    files = ckpt.build_xor_delta({"w": base}, {"w": new}, version="v2", base_version="v1")
    index = ckpt.parse_index(files[ckpt.INDEX_NAME])
    shard = files[index.weight_map["w"]]
    layout = ckpt.check_shard(shard, len(shard), {"w"})
    info = layout.infos["w"]
    frame = shard[layout.data_start + info.begin : layout.data_start + info.end]
    target = base.view(np.uint8).copy()
    # It returns the adler32 of what it wrote, computed block by block as it goes.
    assert ckpt.apply_xor_delta_into(target, frame, chunk_bytes=4096) == layout.checksums["w"]
    reference = ckpt.apply_xor_delta(base, frame, layout.checksums["w"])
    assert target.tobytes() == reference.tobytes() == new.tobytes()
    assert ckpt.adler32_hex(target) == layout.checksums["w"]
    # From a base elsewhere (a held version's memory) straight into fresh memory: the base is only read.
    fresh, source = np.zeros_like(target), base.view(np.uint8).copy()
    assert ckpt.apply_xor_delta_into(fresh, frame, source, chunk_bytes=5000) == layout.checksums["w"]
    assert fresh.tobytes() == new.tobytes() and source.tobytes() == base.tobytes()
    with pytest.raises(ValueError, match="base must be"):
        ckpt.apply_xor_delta_into(fresh, frame, source[:-1])


def test_adler32_is_zlibs() -> None:
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
    assert ckpt.adler32(data) == zlib.adler32(data)
    assert ckpt.adler32(data[1000:], ckpt.adler32(data[:1000])) == zlib.adler32(data)
    assert ckpt.adler32_hex(b"") == "00000001"


@pytest.mark.parametrize(
    ("mangle", "match"),
    [
        (lambda f: f[:-7], "truncated|does not decode"),
        (lambda f: f + b"junk", "does not decode"),
        (lambda f: f + zstandard.ZstdCompressor().compress(b"extra"), "more than"),
        (lambda f: b"\x00" * 16, "zstd header"),
    ],
    ids=["truncated", "trailing-garbage", "trailing-frame", "not-zstd"],
)
def test_streamed_xor_rejects_bad_frames(mangle, match: str) -> None:
    target = np.zeros(50_000, dtype=np.uint8)
    frame = zstandard.ZstdCompressor(level=1).compress(np.ones(50_000, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match=match):
        ckpt.apply_xor_delta_into(target, mangle(frame))
    with pytest.raises(ValueError, match="declares"):
        ckpt.apply_xor_delta_into(np.zeros(10, dtype=np.uint8), frame)


def test_check_shard_rejects_inconsistent_shards() -> None:
    files = ckpt.build_full_checkpoint({"a": np.ones(16, np.float32), "b": np.zeros(4, np.int64)}, shard_bytes=1 << 20)
    shard = files["model-00001-of-00001.safetensors"]
    assert ckpt.check_shard(shard, len(shard), {"a", "b"}).size == len(shard)
    with pytest.raises(ckpt.InvalidShard, match="truncated"):
        ckpt.check_shard(shard, len(shard) - 1, {"a", "b"})
    with pytest.raises(ckpt.InvalidShard, match="longer"):
        ckpt.check_shard(shard, len(shard) + 1, {"a", "b"})
    with pytest.raises(ckpt.InvalidShard, match=r"lacks tensors .*'c'"):
        ckpt.check_shard(shard, len(shard), {"a", "b", "c"})
    with pytest.raises(ckpt.InvalidShard, match=r"not in the index: \['b'\]"):
        ckpt.check_shard(shard, len(shard), {"a"})
    unchecked = ckpt.build_full_checkpoint({"a": np.ones(4, np.float32)}, 1 << 20)["model-00001-of-00001.safetensors"]
    length, header = ckpt.parse_safetensors_header(unchecked)
    header["__metadata__"] = {"a": "XYZ"}
    body = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    forged = len(body).to_bytes(8, "little") + body + unchecked[8 + length :]
    with pytest.raises(ckpt.InvalidShard, match="no valid adler32"):
        ckpt.check_shard(forged, len(forged), {"a"})


# ---------------------------------------------------------------- identity


def ident(uid: str, digest: str | None = "d1", namespace: str = "ns", uri: str = "s3://b/m/i.json") -> VersionIdentity:
    return VersionIdentity(namespace, uid, uri, digest)


def test_a_stored_copy_is_used_only_for_the_identity_it_was_written_from(store: CheckpointStore) -> None:
    ref = ArtifactRef("ns/m", FULL, "v1")
    with store.write(ref, {"uri": "s3://b/m/i.json"}, [ident("u1")]) as tmp:
        (tmp / "data.bin").write_bytes(b"x")
    assert store.identity(ref) == (ident("u1"),)
    assert store.artifact(ref, [ident("u1")]) is not None
    assert store.artifact(ref, [ident("u1", digest=None)]) is not None  # no recorded digest: not compared
    # A republished name (new uid), another index, another URI or a chain of another length: ignored and dropped.
    for other in ([ident("u2")], [ident("u1", digest="d2")], [ident("u1", uri="s3://b/x/i.json")], []):
        probe = ArtifactRef("ns/m", DELTA, "probe")
        with store.write(probe, {}, [ident("u1")]) as tmp:
            (tmp / "data.bin").write_bytes(b"x")
        assert store.artifact(probe, other) is None and not store.path(probe).exists()
    legacy = put(store, "ns/m", FULL, "v2")  # a marker without identity (written before identities existed)
    assert store.artifact(ArtifactRef("ns/m", FULL, "v2"), [ident("u1")]) is None and not legacy.exists()


def test_namespaces_never_share_a_path(store: CheckpointStore) -> None:
    a, b = ArtifactRef(model_key("tenant-a", "m"), FULL, "v1"), ArtifactRef(model_key("tenant-b", "m"), FULL, "v1")
    assert store.path(a) != store.path(b) and store.path(a).parent.parent.parent.name == "tenant-a"
    for ref, uid in ((a, "ua"), (b, "ub")):
        with store.write(ref, {}, [ident(uid, namespace=ref.model.split("/")[0])]) as tmp:
            (tmp / "data.bin").write_bytes(uid.encode())
    assert (store.artifact(b, [ident("ub", namespace="tenant-b")]) / "data.bin").read_bytes() == b"ub"
    assert store.artifact(b, [ident("ua", namespace="tenant-a")]) is None  # the other tenant's identity
    assert (store.artifact(a, [ident("ua", namespace="tenant-a")]) / "data.bin").read_bytes() == b"ua"
    assert {x.ref for x in store.artifacts()} == {a}


def test_a_materialized_copy_matches_its_whole_chain(store: CheckpointStore) -> None:
    ref = ArtifactRef("ns/m", MAT, "v2")
    chain = [ident("u1"), ident("u2", uri="s3://b/m/v2.json")]
    with store.write(ref, {}, chain) as tmp:
        (tmp / "data.bin").write_bytes(b"x")
    assert store.artifact(ref, chain) is not None
    assert store.artifact(ref, [ident("u1-republished"), chain[1]]) is None  # its root changed: other bytes


def test_recover_removes_model_folders_of_the_layout_without_namespaces(store: CheckpointStore) -> None:
    put(store, "ns/full", FULL, "v1")  # a model named like a kind, in the namespaced layout: kept
    activate(store, "ns/full", ("v1",))
    legacy = store.root / "m"
    (legacy / "full" / "v1").mkdir(parents=True)
    (legacy / "full" / "v1" / MARKER).write_text("{}")
    (legacy / STATE_FILE).write_text("{}")
    actions = store.recover()
    assert not legacy.exists() and any("without namespaces" in a for a in actions)
    assert store.artifact(ArtifactRef("ns/full", FULL, "v1")) is not None and store.state("ns/full").version == "v1"


def test_index_digest_is_sha256_hex() -> None:
    assert index_digest(b"{}") == "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
