"""ModelLoad orchestration end to end: operator + three agent processes + the real apiserver.

Replica 1's agent holds the version locally; the other two load it from peers over NIXL. Then scale down, an
agent dies (its Lease expires → not Live, Degraded), and deleting the ModelLoad garbage-collects its replicas."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.support.agents import node, seed_arg, start_agent
from tests.support.objects import apply, condition, get, ml_body, ml_status, wait_for, wv_body

pytestmark = pytest.mark.e2e


def modelload(namespace: str, replicas: int, version: str = "v1") -> dict:
    return ml_body(namespace, version, replicas, transfer={"timeoutSeconds": 30, "stallSeconds": 20})


def replicas(cluster, namespace) -> list[dict]:
    out = cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout
    return json.loads(out)["items"]


def test_modelload_lifecycle(cluster, namespace, operator, tmp_path):
    gen = torch.Generator().manual_seed(11)
    weights = {f"layers.{i}.weight": torch.randn((256, 256), generator=gen) for i in range(4)}
    seed = tmp_path / "v1.safetensors"
    save_file(weights, str(seed))
    names = [f"{namespace}-n{i}" for i in range(3)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    seeds = {names[0]: [seed_arg(namespace, "v1", seed)]}
    agents = {n: start_agent(cluster, tmp_path, n, *seeds.get(n, [])) for n in names}

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + "".join(a.log_tail(15) for a in agents.values())

    try:
        # The seed holds a PeerOnly version: nothing in S3, served from memory once one node has it.
        apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), modelload(namespace, 3))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 90, "3/3 ready", describe)
        status = ml_status(cluster, namespace)
        assert status["loadedVersion"] == "v1" and status["phase"] == "Ready"
        assert condition({"status": status}, "Ready")["reason"] == "AllReplicasReady"
        items = replicas(cluster, namespace)
        assert sorted(r["spec"]["nodeName"] for r in items) == sorted(names)
        sources = sorted(r["status"]["source"] for r in items)
        assert sources.count("local") == 1 and all(s.startswith("peer/") for s in sources if s != "local"), sources
        for r in items:
            assert r["metadata"]["ownerReferences"][0]["kind"] == "ModelLoad"
        table = cluster.kubectl("get", "ml", "-n", namespace).stdout
        assert "3/3" in table and "Ready" in table
        described = cluster.kubectl("describe", "ml", "serve", "-n", namespace).stdout
        assert "AllReplicasReady" in described and "ReplicaCreated" in described

        # Scale down: one replica goes, the rest keep serving.
        cluster.kubectl("patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"replicas":2}}')
        wait_for(lambda: len(replicas(cluster, namespace)) == 2, 30, "scaled to 2", describe)
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "2/2", 30, "2/2 ready", describe)

        # An agent dies: its Lease expires, the operator says so in the replica's Live condition and the ModelLoad.
        # The phase is the agent's alone: it still says what the agent last wrote.
        victim = replicas(cluster, namespace)[0]
        agents[victim["spec"]["nodeName"]].kill()
        wait_for(
            lambda: condition({"status": ml_status(cluster, namespace)}, "Degraded").get("reason") == "ReplicaStale",
            30,
            "ReplicaStale",
            describe,
        )
        wait_for(
            lambda: (
                condition(get(cluster, namespace, "wr", victim["metadata"]["name"]), "Live").get("reason")
                == "LeaseExpired"
            ),
            30,
            "Live=False",
            describe,
        )
        dead = get(cluster, namespace, "wr", victim["metadata"]["name"])
        assert dead["status"]["phase"] == "Serving" and condition(dead, "Live")["status"] == "False"
        assert ml_status(cluster, namespace)["ready"] == "1/2"

        # Deleting the ModelLoad garbage-collects its replicas (ownerReferences + kube-controller-manager).
        cluster.kubectl("delete", "ml", "serve", "-n", namespace)
        wait_for(lambda: not replicas(cluster, namespace), 60, "replicas collected", describe)
    finally:
        for a in agents.values():
            a.stop()
