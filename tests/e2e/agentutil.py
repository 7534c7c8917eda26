"""Helpers for e2e tests with node agents: Node objects, WeightReplicas, agent processes."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from wvutil import get, wait_for

from ferry.api.models import API_VERSION
from ferry.localcluster import ManagedProcess
from ferry_agent.registry import LABEL_MODEL, LABEL_NODE, LABEL_VERSION


def content_sha256(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def node(cluster, name: str, labels: dict[str, str] | None = None) -> None:
    """A Node object through the API: the agent process started for it plays its kubelet-side part."""
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def replica(cluster, namespace: str, name: str, node_name: str, version: str) -> None:
    body = {
        "apiVersion": API_VERSION,
        "kind": "WeightReplica",
        "metadata": {
            "name": name,
            "labels": {LABEL_MODEL: "m", LABEL_VERSION: version, LABEL_NODE: node_name},
        },
        "spec": {
            "modelLoad": "ml", "modelName": "m", "version": version, "nodeName": node_name, "device": "cpu",
            "transfer": {"timeoutSeconds": 30},
        },
    }  # fmt: skip
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def start_agent(cluster, tmp_path, node_name: str, *seeds: str, retry_seconds: float = 1.0) -> ManagedProcess:
    argv = [
        sys.executable,
        "-m",
        "ferry_agent",
        "--node",
        node_name,
        "--lease-seconds",
        "3",
        "--poll-seconds",
        "0.3",
        "--retry-seconds",
        str(retry_seconds),
    ]
    for seed in seeds:
        argv += ["--seed", seed]
    env = {**os.environ, **cluster.env(), "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
    return ManagedProcess(f"agent-{node_name}", argv, tmp_path / f"agent-{node_name}.log", env=env).start()


def wait_phase(cluster, namespace, name, phase, proc, timeout=60):
    return wait_for(
        lambda: (o := get(cluster, namespace, "wr", name)) and (o.get("status") or {}).get("phase") == phase and o,
        timeout, f"{name} {phase}",
        lambda: json.dumps((get(cluster, namespace, "wr", name) or {}).get("status"), indent=1) + proc.log_tail(),
    )  # fmt: skip
