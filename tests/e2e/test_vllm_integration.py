"""The vLLM integration (ferry_vllm) against a real agent, with everything of vLLM but vLLM itself.

vLLM cannot run on these machines. What runs: an agent process serving three versions of a tiny Llama, a consumer
process playing an engine pod that uses Ferry's real loader (`--load-format ferry`), weight-transfer engine
(backend `ferry`) and worker extension, over the real `ferry.client`; the refit sidecar `ferry_vllm.refit` as
its own process, calling vLLM's weight-update routes over HTTP. What stands in: the few vLLM base classes those
build on (tests/e2e/vllm_stub, written from vLLM's source), vLLM's HTTP routes (served by the consumer, calling the
engine as vLLM's do) and the model: a transformers LlamaForCausalLM behind vLLM's `load_weights` contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.e2e.attach_consumer import build_model, greedy, model_tensors, tensors_sha256
from tests.support.agents import node, seed_arg, start_agent
from tests.support.consumers import engine_pod, line_of
from tests.support.objects import apply, ml_body, ml_status, wait_for, wv_body

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
# By hand only: an interpreter with vLLM (and ferry installed, for its entry point) runs the engine process with
# vLLM's own base classes, registry and plugin loading instead of the stand-in. CI has no vLLM (docs/vllm.md).
REAL_VLLM = os.environ.get("FERRY_VLLM_PYTHON")
CHANGES = {
    "v2": ["lm_head.weight", "model.layers.1.mlp.down_proj.weight"],
    "v3": ["model.layers.0.self_attn.q_proj.weight"],
}


def versions() -> dict[str, dict[str, torch.Tensor]]:
    out = {"v1": {n: t.detach().clone().contiguous() for n, t in model_tensors(build_model(seed=0)).items()}}
    out["v2"] = {n: (t + 0.25 if n in CHANGES["v2"] else t) for n, t in out["v1"].items()}
    out["v3"] = {n: (t - 0.5 if n in CHANGES["v3"] else t) for n, t in out["v2"].items()}
    return out


def expected(tensors: dict[str, torch.Tensor]) -> tuple[str, list[int]]:
    model = build_model(seed=0)
    with torch.no_grad():
        for name, tensor in model_tensors(model).items():
            tensor.copy_(tensors[name])
    return tensors_sha256(tensors), greedy(model)


def test_vllm_loader_refit_backend_sidecar_and_worker_extension(cluster, namespace, operator, tmp_path, socket_root):
    tensors = versions()
    want = {v: expected(t) for v, t in tensors.items()}
    assert len({tuple(tokens) for _, tokens in want.values()}) == 3  # each version generates its own tokens
    for version, t in tensors.items():
        save_file(t, str(tmp_path / f"{version}.safetensors"))

    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    seeds = [seed_arg(namespace, v, tmp_path / f"{v}.safetensors") for v in tensors]
    agent = start_agent(cluster, tmp_path, node_name, *seeds, socket_dir=socket_root)
    procs: list[subprocess.Popen] = []

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + agent.log_tail(30)

    try:
        pod_dir = socket_root / "pods" / engine_pod(cluster, namespace, node_name)
        apply(
            cluster, namespace, *(wv_body(namespace, v, fmt="PeerOnly") for v in tensors), ml_body(namespace, "v1", 1)
        )
        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket", describe)
        env = {
            **os.environ,
            "FERRY_SOCKET_DIR": str(pod_dir),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE / "vllm_stub"), str(HERE)]),
        }
        engine_env = {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])} if REAL_VLLM else env
        procs.append(
            engine := subprocess.Popen(
                [REAL_VLLM or sys.executable, str(HERE / "vllm_consumer.py"), "serve"],
                env=engine_env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )

        # 1. --load-format ferry: the loader feeds the served version to load_weights; the lease stays held.
        cold = line_of(engine, describe)
        assert cold["version"] == "v1" and cold["blocked_loaded"] == [], cold
        assert (cold["sha256"], cold["tokens"]) == want["v1"] and cold["tokens_before"] != want["v1"][1]
        assert cold["in_place"] and cold["listed"] == [["v1", True, 1]]

        # 2. The sidecar follows the node's versions and drives vLLM's weight-update routes.
        procs.append(
            sidecar := subprocess.Popen(
                [sys.executable, "-m", "ferry_vllm.refit", "serve", "--engine", f"http://127.0.0.1:{cold['port']}"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
        )
        second = line_of(engine, lambda: ((sidecar.poll() is not None and sidecar.stderr.read()) or "") + describe())
        assert second["version"] == "v2" and (second["sha256"], second["tokens"]) == want["v2"]
        assert second["in_place"] and sorted(second["sent"]) == sorted(CHANGES["v2"])
        assert second["skipped"] == len(tensors["v1"]) - len(CHANGES["v2"])
        calls = second["calls"]
        assert calls[0] == "/init_weight_transfer_engine"
        assert calls[-7:] == [
            "/pause?mode=keep",
            "/start_weight_update",
            "/update_weights",
            {"listed": [["v2", True, 1], ["v1", False, 1]]},  # make before break: both held
            "/finish_weight_update",
            {"listed": [["v2", True, 1]]},
            "/resume",
        ]
        sidecar.terminate()
        sidecar.wait(10)

        # 3. collective_rpc's path: the worker extension refits to v3, changed tensors only.
        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v3"}}'
        )
        engine.stdin.write("v3\n")
        engine.stdin.flush()
        third = line_of(engine, describe)
        assert third["version"] == "v3" and (third["sha256"], third["tokens"]) == want["v3"]
        assert third["in_place"] and third["sent"] == CHANGES["v3"] and third["listed"] == [["v3", True, 1]]
        assert third["refit"]["sent"] == 1 and third["refit"]["skipped"] == len(tensors["v1"]) - 1
        assert engine.wait(30) == 0, engine.stderr.read()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        agent.stop()
