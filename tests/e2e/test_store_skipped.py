"""The node's checkpoint store is a cache: an agent whose store cannot fit a version still loads it from S3 into
host memory and serves it, skips the store (nothing written, nothing evicted) and says so in the replica's
status (`attempts[]`: ObjectStorage Loaded, reason StoreSkipped, with the store's limit)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ferry.client import attach
from tests.support.agents import node, replica_status, start_agent
from tests.support.consumers import engine_pod
from tests.support.objects import apply, ml_body, publish_full, tensors, wait_for, wait_reason, wv_body

pytestmark = pytest.mark.e2e

QUOTA_GIB = 16 / (1 << 20)  # 16 KiB: far less than the version's 96 KiB


def test_a_version_the_store_cannot_fit_is_served_from_memory(cluster, s3, namespace, operator, tmp_path, socket_root):
    v1 = tensors(41, n=8, shape=(64, 48))
    total = sum(a.nbytes for a in v1.values())
    assert total > QUOTA_GIB * (1 << 30)
    publish_full(s3, namespace, "v1", v1)
    apply(cluster, namespace, wv_body(namespace, "v1"))
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified", timeout=60)
    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    agent = start_agent(
        cluster, tmp_path, node_name, s3=s3, socket_dir=socket_root, args=["--checkpoint-quota-gib", str(QUOTA_GIB)]
    )

    def status() -> dict:
        return replica_status(cluster, namespace)

    def describe() -> str:
        return json.dumps(status(), indent=1) + agent.log_tail(40)

    try:
        pod_dir = socket_root / "pods" / engine_pod(cluster, namespace, node_name)
        apply(cluster, namespace, ml_body(namespace, "v1", 1))
        wait_for(lambda: status().get("phase") == "Serving" and status().get("version") == "v1", 90, "v1", describe)
        assert status()["source"] == "s3" and status()["residentBytes"] == total, describe()
        (loaded,) = [a for a in status()["attempts"] if a["outcome"] == "Loaded"]
        assert (loaded["source"], loaded["reason"]) == ("ObjectStorage", "StoreSkipped"), describe()
        assert re.search(r"served from memory, not stored: checkpoint store .* cannot fit", loaded["message"])
        with attach("serve", socket_dir=pod_dir, timeout=30, version="v1", verify=True) as held:
            for name, expected in v1.items():
                assert np.array_equal(held.tensors()[name].numpy(), expected), name
        store = tmp_path / f"store-{node_name}"
        assert not [p for p in store.rglob("*.safetensors")], "the store was written"
        assert "served from memory only" in agent.log_path.read_text(errors="replace")
    finally:
        agent.stop()
