"""A delta from S3 replays on the base version a pod still holds in the agent's host memory: the base's bytes come
from that sealed memory (the store's copy on disk is corrupted first, so a replay that read it would fail its
checks), unchanged tensors share the base's chunks, and the replica's residentBytes say so; the delta's frames
stream from S3 and the store is written behind."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from ferry.client import attach
from tests.support.agents import node, replica_status, start_agent
from tests.support.consumers import engine_pod
from tests.support.objects import apply, ml_body, publish_delta, publish_full, tensors, wait_for, wait_reason, wv_body

pytestmark = pytest.mark.e2e


def shards(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.safetensors") if p.is_file())


def data_of(shard: Path) -> bytes:
    raw = shard.read_bytes()
    (header,) = struct.unpack("<Q", raw[:8])
    return raw[8 + header :]


def corrupt(shard: Path) -> None:
    """Overwrite a shard's tensor bytes (its size kept, so the store still takes it for complete)."""
    size = len(data_of(shard))
    with shard.open("r+b") as f:
        (header,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header)
        f.write(bytes([0x5A]) * size)


def test_a_delta_replays_on_the_held_base_in_host_memory(cluster, s3, namespace, operator, tmp_path, socket_root):
    v1 = tensors(31, n=8, shape=(64, 48))
    changed = ["layer2.weight", "layer5.weight"]
    v2 = {k: (a + 1 if k in changed else a) for k, a in v1.items()}
    publish_full(s3, namespace, "v1", v1)
    publish_delta(s3, namespace, "v2", "v1", v1, v2)
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    wait_reason(cluster, namespace, "v2", "Ready", "True", "Verified", timeout=60)
    total, changed_bytes = sum(a.nbytes for a in v1.values()), sum(v1[n].nbytes for n in changed)
    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, node_name, s3=s3, socket_dir=socket_root)

    def status() -> dict:
        return replica_status(cluster, namespace)

    def describe() -> str:
        return json.dumps(status(), indent=1) + agent.log_tail(40)

    try:
        pod_dir = socket_root / "pods" / engine_pod(cluster, namespace, node_name)
        apply(cluster, namespace, ml_body(namespace, "v1", 1))
        wait_for(lambda: status().get("phase") == "Serving" and status()["version"] == "v1", 90, "v1", describe)
        assert status()["source"] == "s3" and status()["residentBytes"] == total

        with attach("serve", socket_dir=pod_dir, timeout=30, version="v1") as held:
            folder = tmp_path / f"store-{node_name}"
            # Written behind the load: the entry is renamed into place, complete, after the replica serves.
            stored = wait_for(lambda: [p for p in shards(folder) if "/full/v1/" in str(p)], 30, "full/v1 stored")
            assert stored == shards(folder)
            for shard in stored:
                corrupt(shard)  # v1 on disk: a replay that read it would fail its adler32 and fetch v1 again
            cluster.kubectl(
                "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
            )
            wait_for(
                lambda: status().get("phase") == "Serving" and status()["version"] == "v2", 90, "v2 served", describe
            )
            assert status()["source"] == "s3"
            # Never read: still the bytes written over it (a failed replay discards and fetches the copy again).
            assert all(set(data_of(p)) == {0x5A} for p in stored), describe()
            # The agent's one-rank loads take the streaming paths (not the store first, as a multi-rank leader's):
            # v1 straight from S3 into host memory, v2's delta frames decoded as they land; each store written behind.
            log = agent.log_path.read_text(errors="replace")
            for version, source in (("v1", "S3"), ("v2", "held/v1")):
                line = f"loaded {version} .* from {source} in .*; streamed, the store is written behind"
                assert re.search(line, log), describe()
            assert (status()["residentBytes"], status()["residentVersions"]) == (total + changed_bytes, ["v1", "v2"])
            with attach("serve", socket_dir=pod_dir, timeout=30, version="v2", verify=True) as new:
                for name, expected in v2.items():
                    assert np.array_equal(new.tensors()[name].numpy(), expected), name
            for name, expected in v1.items():  # what the pod holds never changed
                assert np.array_equal(held.tensors()[name].numpy(), expected), name
        wait_for(lambda: status().get("residentVersions") == ["v2"], 30, "v1 released", describe)
    finally:
        agent.stop()
