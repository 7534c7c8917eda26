"""The agent's host memory, through a real agent process: one sealed copy, accounted in the WeightReplica's status,
shared with the version a pod still holds across a refit, and bounded by `--host-memory-budget`."""

from __future__ import annotations

import json
import subprocess

import pytest
from safetensors.torch import save_file

from ferry.client import request
from tests.e2e.attach_consumer import build_model, model_tensors, tensors_sha256
from tests.support.agents import node, replica_status, seed_arg, start_agent
from tests.support.consumers import consumer, engine_pod, line_of
from tests.support.objects import apply, ml_body, ml_status, wait_for, wv_body

pytestmark = pytest.mark.e2e


def nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_version_beyond_the_budget_fails_with_the_reason_and_loads_nothing(
    cluster, namespace, operator, tmp_path, socket_root, monkeypatch
):
    tensors = {n: t.detach().contiguous() for n, t in model_tensors(build_model(seed=0)).items()}
    checkpoint = tmp_path / "v1.safetensors"
    save_file(tensors, str(checkpoint))
    total = nbytes(tensors)
    budget = total // 2
    monkeypatch.setenv("FERRY_AGENT_HOST_MEMORY_BUDGET", str(budget))
    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, node_name, seed_arg(namespace, "v1", checkpoint), socket_dir=socket_root)

    def describe() -> str:
        return json.dumps(replica_status(cluster, namespace), indent=1) + agent.log_tail(30)

    try:
        pod_dir = socket_root / "pods" / engine_pod(cluster, namespace, node_name)
        apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), ml_body(namespace, "v1", 1))
        wait_for(
            lambda: replica_status(cluster, namespace).get("phase") == "Failed", 90, "the replica Failed", describe
        )
        status = replica_status(cluster, namespace)
        assert status["reason"] == "MemoryBudgetExceeded", describe()
        assert (
            f"needs {total} bytes" in status["message"]
            and f"{budget} of the {budget}-byte budget" in (status["message"])
        ), describe()
        assert status.get("residentBytes") in (0, None) and not status.get("residentVersions")
        assert ml_status(cluster, namespace).get("ready") != "1/1"
        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket", describe)
        assert request({"op": "list"}, socket_dir=pod_dir, timeout=5)["versions"] == []  # nothing offered
        assert agent.alive
    finally:
        agent.stop()


def test_resident_bytes_and_a_refit_that_shares_the_held_versions_chunks(
    cluster, namespace, operator, tmp_path, socket_root, monkeypatch
):
    v1 = {n: t.detach().clone().contiguous() for n, t in model_tensors(build_model(seed=0)).items()}
    changed = sorted(["lm_head.weight", "model.layers.1.mlp.down_proj.weight"])
    v2 = {n: (t + 0.25 if n in changed else t) for n, t in v1.items()}
    for version, tensors in (("v1", v1), ("v2", v2)):
        save_file(tensors, str(tmp_path / f"{version}.safetensors"))
    total, changed_bytes = nbytes(v1), nbytes({n: v1[n] for n in changed})
    # Room for v1 and v2's changed tensors, not for a second whole copy: the refit fits only if it shares.
    monkeypatch.setenv("FERRY_AGENT_HOST_MEMORY_BUDGET", str(total + changed_bytes + 4096))
    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    seeds = [seed_arg(namespace, v, tmp_path / f"{v}.safetensors") for v in ("v1", "v2")]
    agent = start_agent(cluster, tmp_path, node_name, *seeds, socket_dir=socket_root)
    proc: subprocess.Popen | None = None

    def status() -> dict:
        return replica_status(cluster, namespace)

    def describe() -> str:
        return json.dumps(status(), indent=1) + agent.log_tail(30)

    try:
        pod_dir = socket_root / "pods" / engine_pod(cluster, namespace, node_name)
        apply(
            cluster,
            namespace,
            wv_body(namespace, "v1", fmt="PeerOnly"),
            wv_body(namespace, "v2", fmt="PeerOnly"),
            ml_body(namespace, "v1", 1),
        )
        wait_for(lambda: status().get("phase") == "Serving", 90, "v1 served", describe)
        assert (status()["residentBytes"], status()["residentVersions"]) == (total, ["v1"]), describe()

        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket", describe)
        proc = consumer(pod_dir, "refit")
        assert line_of(proc, describe)["version"] == "v1"
        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
        )
        second = line_of(proc, describe)
        assert second["version"] == "v2" and second["sha256"] == tensors_sha256(v2), describe()
        assert second["loaded"] == changed

        # v1 is still leased by the pod; v2 holds only its changed tensors anew: shared chunks count once.
        wait_for(lambda: status().get("residentVersions") == ["v1", "v2"], 30, "both versions resident", describe)
        assert status()["phase"] == "Serving" and status()["version"] == "v2"
        assert status()["residentBytes"] == total + changed_bytes, describe()

        proc.stdin.write("\n")  # release v1: v2 keeps the chunks it shares with it, nothing else of v1 is listed
        proc.stdin.flush()
        assert line_of(proc, describe) == {"released": "v1"}
        wait_for(lambda: status().get("residentVersions") == ["v2"], 30, "only v2 resident", describe)
        assert status()["residentBytes"] == total + changed_bytes
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        agent.stop()
