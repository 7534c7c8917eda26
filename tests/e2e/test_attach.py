"""An engine pod gets its node's weights through the attach socket: operator + agent process + a consumer process.

A tiny LlamaForCausalLM (fixed seed, no hub) is the seeded PeerOnly version of a ModelLoad. A Pod object bound
to the agent's node (no kubelet runs it) gets a socket from the agent; a separate consumer process with that
pod's directory attaches, `load_into`s a freshly built model, and must hold the very tensors and generate the very
tokens of the original. Killing it with SIGKILL drops its lease; malformed clients leave the agent serving."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ferry.client import request
from tests.e2e.attach_consumer import build_model, greedy, model_tensors, tensors_sha256
from tests.support.agents import agent_metrics, node, seed_arg, start_agent
from tests.support.consumers import consumer, engine_pod, line_of
from tests.support.objects import apply, ml_body, ml_status, wait_for, wv_body

pytestmark = pytest.mark.e2e


def attached(pod_dir: Path) -> list[int]:
    return [v["attached"] for v in request({"op": "list"}, socket_dir=pod_dir, timeout=5)["versions"]]


def test_engine_pod_attaches_loads_and_its_lease_follows_the_process(
    cluster, namespace, operator, tmp_path, socket_root
):
    original = build_model(seed=0)
    served = {n: t.detach().contiguous() for n, t in model_tensors(original).items()}
    checkpoint = tmp_path / "llama-tiny.safetensors"
    save_file(served, str(checkpoint))
    expected_sha, expected_tokens = tensors_sha256(served), greedy(original)

    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, node_name, seed_arg(namespace, "v1", checkpoint), socket_dir=socket_root)
    procs: list[subprocess.Popen] = []

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + agent.log_tail(30)

    try:
        uid = engine_pod(cluster, namespace, node_name)
        pod_dir = socket_root / "pods" / uid
        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket", describe)

        # The consumer starts before the version is served: attach waits until this node serves it.
        procs.append(holder := consumer(pod_dir, "hold"))
        apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), ml_body(namespace, "v1", 1))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "1/1", 90, "1/1 ready", describe)
        out = line_of(holder, describe)
        assert out["version"] == "v1" and out["blocked_loaded"] == []
        wr = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"][0]
        assert out["versionUid"] == wr["status"]["versionUid"]
        assert out["tokens_before"] != expected_tokens  # a fresh model does not already generate them
        assert out["sha256"] == out["served_sha256"] == expected_sha
        assert out["tokens"] == expected_tokens
        assert out["in_place"] and out["loaded"] == len(served)
        assert attached(pod_dir) == [1]
        assert "ferry_agent_attach_leases 1.0" in agent_metrics(agent)

        # SIGKILL: the kernel closes the socket, and with it the lease.
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        wait_for(lambda: attached(pod_dir) == [0], 5, "the lease dropped", describe)
        assert "ferry_agent_attach_leases 0.0" in agent_metrics(agent)

        # Malformed clients: a 4 GiB length prefix, bytes that are not JSON, a frame cut short.
        for garbage in (b"\xff\xff\xff\xff", b"\x00\x00\x00\x05hello", b"\x00\x00\x01\x00{"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bad:
                bad.connect(str(pod_dir / "ferry.sock"))
                bad.sendall(garbage)
                bad.shutdown(socket.SHUT_WR)
                bad.settimeout(10)
                try:
                    while bad.recv(4096):
                        pass
                except ConnectionResetError:
                    pass
        assert agent.alive, describe()
        procs.append(again := consumer(pod_dir, "once"))
        stdout, stderr = again.communicate(timeout=120)
        assert again.returncode == 0, stderr + describe()
        out = json.loads(stdout)
        assert out["sha256"] == expected_sha and out["tokens"] == expected_tokens
        assert attached(pod_dir) == [0]

        # The Pod goes: so does its socket directory.
        cluster.kubectl("delete", "pod", "engine", "-n", namespace, "--grace-period=0", "--force")
        wait_for(lambda: not pod_dir.exists(), 30, "the pod's socket removed", describe)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        agent.stop()


def test_refit_in_place_to_the_next_version_make_before_break(cluster, namespace, operator, tmp_path, socket_root):
    original = build_model(seed=0)
    v1 = {n: t.detach().clone().contiguous() for n, t in model_tensors(original).items()}
    changed = sorted(["lm_head.weight", "model.layers.1.mlp.down_proj.weight"])
    v2 = {n: (t + 0.25 if n in changed else t) for n, t in v1.items()}
    for version, tensors in (("v1", v1), ("v2", v2)):
        save_file(tensors, str(tmp_path / f"{version}.safetensors"))
    v1_tokens = greedy(original)
    with torch.no_grad():
        for name, tensor in model_tensors(original).items():
            tensor.copy_(v2[name])
    v2_tokens, v2_sha = greedy(original), tensors_sha256(v2)
    assert v2_tokens != v1_tokens  # the change is visible in what the model generates

    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    seeds = [seed_arg(namespace, v, tmp_path / f"{v}.safetensors") for v in ("v1", "v2")]
    agent = start_agent(cluster, tmp_path, node_name, *seeds, socket_dir=socket_root)
    proc = None

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + agent.log_tail(30)

    try:
        pod_dir = socket_root / "pods" / engine_pod(cluster, namespace, node_name)
        apply(
            cluster,
            namespace,
            wv_body(namespace, "v1", fmt="PeerOnly"),
            wv_body(namespace, "v2", fmt="PeerOnly"),
            ml_body(namespace, "v1", 1),
        )
        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket", describe)
        proc = consumer(pod_dir, "refit")
        first = line_of(proc, describe)
        assert first["version"] == "v1" and first["tokens"] == v1_tokens != first["tokens_before"]

        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
        )
        second = line_of(proc, describe)
        assert second["version"] == "v2" and second["baseUid"] == second["oldUid"]
        assert second["loaded"] == changed and second["skipped"] == len(v1) - len(changed)
        assert second["tokens"] == v2_tokens and second["sha256"] == v2_sha and second["in_place"]

        # The node serves v2 only, but v1 stays held until the consumer releases it.
        listed = request({"op": "list"}, socket_dir=pod_dir, timeout=5)["versions"]
        assert [(v.get("version"), v["offered"], v["attached"]) for v in listed] == [("v2", True, 1), ("v1", False, 1)]
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert line_of(proc, describe) == {"released": "v1"}
        wait_for(
            lambda: [v["attached"] for v in request({"op": "list"}, socket_dir=pod_dir)["versions"]] == [1],
            5,
            "v1 freed",
            describe,
        )
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        agent.stop()
