"""A ModelLoad places nothing until its desired WeightVersion exists, is Ready and is of its model; a replica
that fails says why in `status.reason`. Operator + an agent process + the real apiserver."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import save_file

from tests.support.agents import node, seed_arg, start_agent
from tests.support.objects import apply, condition, get, ml_body, wait_for, wv_body

pytestmark = pytest.mark.e2e


def modelload(namespace: str, version: str, model: str = "m", name: str = "serve") -> dict:
    return ml_body(namespace, version, name=name, model=model, transfer={"timeoutSeconds": 5})


def replicas(cluster, namespace) -> list[dict]:
    return json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]


def ready(cluster, namespace, name="serve") -> dict:
    return condition(get(cluster, namespace, "ml", name), "Ready")


def events(cluster, namespace, name="serve") -> list[dict]:
    out = cluster.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "-o",
        "json",
        "--field-selector",
        f"involvedObject.kind=ModelLoad,involvedObject.name={name}",
    ).stdout
    return json.loads(out)["items"]


def test_nothing_is_placed_until_the_version_is_ready_and_of_the_model(cluster, s3, namespace, operator, tmp_path):
    seed = tmp_path / "v1.safetensors"
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(seed))
    n = f"{namespace}-n0"
    node(cluster, n, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, n, seed_arg(namespace, "v1", seed))

    def describe() -> str:
        return json.dumps((get(cluster, namespace, "ml", "serve") or {}).get("status"), indent=1) + agent.log_tail(20)

    try:
        # A missing version: Ready=False VersionNotFound, and for several seconds no replica and no new Event.
        apply(cluster, namespace, modelload(namespace, "v1"))
        wait_for(lambda: ready(cluster, namespace).get("reason") == "VersionNotFound", 30, "VersionNotFound", describe)
        settled = len(events(cluster, namespace))
        time.sleep(8)
        assert replicas(cluster, namespace) == [], describe()
        assert len(events(cluster, namespace)) == settled, events(cluster, namespace)
        assert settled <= 4, events(cluster, namespace)  # one per condition at most, not one per retry

        # A version that exists but is not Ready (its checkpoint is not in S3): VersionNotReady, and again no
        # replica and no new Event for several seconds while the operator keeps retrying its verification.
        apply(cluster, namespace, wv_body(namespace, "v0"), modelload(namespace, "v0", name="early"))
        wait_for(lambda: ready(cluster, namespace, "early").get("reason") == "VersionNotReady", 30, "v0", describe)
        # The ModelLoad may see v0 before v0's first status is written: its Ready=False follows.
        wait_for(lambda: condition(get(cluster, namespace, "wv", "v0"), "Ready").get("status") == "False", 30, "v0")
        assert "v0 is not Ready" in ready(cluster, namespace, "early")["message"]
        pending = len(events(cluster, namespace, "early"))
        time.sleep(8)
        assert replicas(cluster, namespace) == [], describe()
        assert len(events(cluster, namespace, "early")) == pending <= 4, events(cluster, namespace, "early")

        # Another model's version: ModelMismatch, still nothing created.
        apply(cluster, namespace, wv_body(namespace, "o1", model="other", fmt="PeerOnly"))
        wait_for(lambda: condition(get(cluster, namespace, "wv", "o1"), "Ready").get("status") == "True", 30, "o1")
        apply(cluster, namespace, modelload(namespace, "o1", name="wrong"))
        wait_for(lambda: ready(cluster, namespace, "wrong").get("reason") == "ModelMismatch", 30, "mismatch", describe)
        assert "'other'" in ready(cluster, namespace, "wrong")["message"]
        assert replicas(cluster, namespace) == []

        # The version appears and is Ready: that wakes the ModelLoad (no resync), and the replica is created and
        # serves it.
        apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"))
        wait_for(lambda: ready(cluster, namespace).get("reason") == "AllReplicasReady", 60, "Ready", describe)
        assert [r["spec"]["version"] for r in replicas(cluster, namespace)] == ["v1"]
        assert ready(cluster, namespace, "wrong")["reason"] == "ModelMismatch"
        assert ready(cluster, namespace, "early")["reason"] == "VersionNotReady"
    finally:
        agent.stop()


def test_a_failed_replica_has_a_reason(cluster, namespace, operator, tmp_path):
    n = f"{namespace}-n0"
    node(cluster, n, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, n)  # no seed, and a PeerOnly version is in no store: every source fails
    try:
        apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), modelload(namespace, "v1"))
        failed = wait_for(
            lambda: next(
                (r for r in replicas(cluster, namespace) if (r.get("status") or {}).get("phase") == "Failed"), None
            ),
            60,
            "a Failed replica",
            agent.log_tail,
        )
        assert failed["status"]["reason"] == "LoadFailed", failed["status"]
        assert failed["status"]["message"]
        wait_for(lambda: ready(cluster, namespace).get("reason") == "ReplicaFailed", 30, "ReplicaFailed")
    finally:
        agent.stop()
