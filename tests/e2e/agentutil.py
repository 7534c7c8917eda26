"""Helpers for e2e tests with node agents: Node objects, WeightReplicas, agent processes."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from wvutil import get, wait_for

from ferry.api.models import API_VERSION
from ferry.localcluster import ManagedProcess
from ferry_agent.registry import LABEL_MODEL, LABEL_NODE, LABEL_VERSION
from ferry_agent.worker_auth import WORKER_AUDIENCE, TokenFile

# node -> the worker token of the agent started for it (what a reader on that node would hold)
NODE_TOKENS: dict[str, Path] = {}


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


def replica(cluster, namespace: str, name: str, node_name: str, version: str, ranks: int = 1) -> None:
    body = {
        "apiVersion": API_VERSION,
        "kind": "WeightReplica",
        "metadata": {
            "name": name,
            "labels": {LABEL_MODEL: "m", LABEL_VERSION: version, LABEL_NODE: node_name},
        },
        "spec": {
            "modelLoad": "ml", "modelName": "m", "version": version, "nodeName": node_name, "device": "cpu",
            "transfer": {"timeoutSeconds": 30}, "ranks": ranks,
        },
    }  # fmt: skip
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def seed_arg(namespace: str, version: str, path: Path, model: str = "m") -> str:
    """An agent's `--seed`: the file holds that very WeightVersion (namespace, model and name)."""
    return f"{namespace}/{model}/{version}={path}"


def start_agent(
    cluster,
    tmp_path,
    node_name: str,
    *seeds: str,
    retry_seconds: float = 1.0,
    lease_seconds: int = 3,
    s3=None,
    socket_dir: Path | None = None,
) -> ManagedProcess:
    """An agent process for one node; with `s3`, it has a checkpoint store of its own and reads that S3. It holds a
    real worker token bound to a Pod on that node, as the chart's projected volume gives it. With `socket_dir` it
    serves attach sockets for the node's Pods there (else none)."""
    token = cluster.pod_token(node_name, WORKER_AUDIENCE, tmp_path / f"worker-token-{node_name}")
    NODE_TOKENS[node_name] = token
    argv = [
        sys.executable,
        "-m",
        "ferry_agent",
        "--node",
        node_name,
        "--lease-seconds",
        str(lease_seconds),
        "--poll-seconds",
        "3",  # changes arrive through the watch; this is only the resync
        "--retry-seconds",
        str(retry_seconds),
        "--metrics-port",
        "0",
        "--worker-token-file",
        str(token),
        "--socket-dir",
        str(socket_dir or ""),
    ]
    for seed in seeds:
        argv += ["--seed", seed]
    env = {**os.environ, **cluster.env(), "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
    if s3 is not None:
        argv += ["--checkpoint-dir", str(tmp_path / f"store-{node_name}"), "--s3-endpoint", s3.endpoint]
        env.update(s3.env())
    return ManagedProcess(f"agent-{node_name}", argv, tmp_path / f"agent-{node_name}.log", env=env).start()


def wait_phase(cluster, namespace, name, phase, proc, timeout=60):
    return wait_for(
        lambda: (o := get(cluster, namespace, "wr", name)) and (o.get("status") or {}).get("phase") == phase and o,
        timeout, f"{name} {phase}",
        lambda: json.dumps((get(cluster, namespace, "wr", name) or {}).get("status"), indent=1) + proc.log_tail(),
    )  # fmt: skip


def read_back(rank_entry: dict, replica_name: str, token: Path | None = None) -> str:
    """Pull one rank of a replica over NIXL as an independent reader; the content sha256 of what it serves."""
    return content_sha256(pull(rank_entry, replica_name, token))


def serving_node_token(agent_name: str) -> Path:
    """The worker token of the agent that serves as `agent_name` (`<node>-<id>[-r<rank>]`): a reader on that node,
    whose own replica is assigned the version, may read it."""
    nodes = [n for n in NODE_TOKENS if agent_name.startswith(f"{n}-")]
    assert nodes, f"no test agent started for {agent_name}"
    return NODE_TOKENS[max(nodes, key=len)]


def pull(rank_entry: dict, replica_name: str, token: Path | None = None) -> dict[str, torch.Tensor]:
    """A copy of what one rank of a replica serves, read over NIXL by an independent reader holding `token`
    (default: the serving node's worker token)."""
    from ferry_agent.candidate import SourceCandidate
    from ferry_agent.nixl_transfer import NixlPeer
    from ferry_agent.peer_strategy import PeerStrategy, TransferSettings
    from ferry_agent.strategy import LoadContext

    reader = NixlPeer(f"reader-{os.getpid()}-{replica_name}")
    rank = rank_entry["rank"]
    cand = SourceCandidate(replica_name, rank, rank_entry["agentName"], rank_entry["grpcEndpoint"])
    credentials = TokenFile(token or serving_node_token(rank_entry["agentName"]))
    strategy = PeerStrategy(
        peer=reader, candidates=lambda ctx: [cand], settings=TransferSettings(timeout_s=30), credentials=credentials
    )
    try:
        result = strategy.load(LoadContext(model="m", version="any", rank=rank, target_id=f"reader-{replica_name}"))
        tensors = {name: t.clone() for name, t in result.resident.tensors.items()}
        reader.deregister(result.resident)
        return tensors
    finally:
        reader.shutdown()


def agent_metrics(agent: ManagedProcess) -> str:
    """The agent's Prometheus text, from the port it logged at start."""
    import re
    import urllib.request

    match = re.search(r"metrics on (http://\S+)", agent.log_path.read_text(errors="replace"))
    assert match, agent.log_tail()
    return urllib.request.urlopen(match.group(1), timeout=5).read().decode()
