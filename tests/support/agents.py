"""Helpers for e2e tests with node agents: Node objects, WeightReplicas, agent processes."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import torch
from kubernetes import client, config
from safetensors.torch import save_file

from ferry.api.models import API_VERSION
from ferry_agent.kube.registry import LABEL_MODEL, LABEL_NODE, LABEL_VERSION
from ferry_agent.transport.proto import worker_pb2, worker_pb2_grpc
from ferry_agent.transport.worker_auth import PodIdentity, ReaderTokens
from ferry_dev.localcluster import LocalCluster, ManagedProcess
from tests.support.objects import get, wait_for

# node -> the cluster an agent was started for it in (where a reader on that node mints its worker tokens)
AGENT_NODES: dict[str, LocalCluster] = {}


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
            "modelLoad": "ml",
            "modelName": "m",
            "version": version,
            "nodeName": node_name,
            "device": "cpu",
            "transfer": {"timeoutSeconds": 30},
            "ranks": ranks,
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Four 256x256 tensors drawn from `seed`: the checkpoint of the seeded rollout tests."""
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn((256, 256), generator=gen) for i in range(4)}


def seeded_agents(cluster, tmp_path, namespace: str, count: int = 3) -> dict[str, ManagedProcess]:
    """`count` nodes of the namespace's pool (`ferry.dev/pool`), each with an agent seeded with v1 = weights(1) and
    v2 = weights(2)."""
    files = {}
    for version, seed in (("v1", 1), ("v2", 2)):
        files[version] = tmp_path / f"{version}.safetensors"
        save_file(weights(seed), str(files[version]))
    names = [f"{namespace}-n{i}" for i in range(count)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    seeds = [seed_arg(namespace, v, files[v]) for v in ("v1", "v2")]
    return {n: start_agent(cluster, tmp_path, n, *seeds) for n in names}


def replica_status(cluster, namespace: str) -> dict:
    """The status of the first WeightReplica in `namespace` (these tests make one); {} while there is none."""
    items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
    return (items[0].get("status") or {}) if items else {}


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
    kubeconfig: Path | None = None,
    pod: dict[str, str] | None = None,
    socket_dir: Path | None = None,
    args: Sequence[str] = (),
) -> ManagedProcess:
    """An agent process for one node; with `s3`, it has a checkpoint store of its own and reads that S3. It runs as
    a Pod on that node (`LocalCluster.agent_pod`), as the chart's downward-API env says, and mints real worker
    tokens bound to it. It talks to the apiserver as admin, or with `kubeconfig` (e.g. its ServiceAccount's
    Pod-bound token; `pod` then names that Pod: `agent_pod`'s namespace, service_account and pod). With
    `socket_dir` it serves attach sockets for the node's Pods there (else none); `args` are further flags."""
    AGENT_NODES[node_name] = cluster
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
        *cluster.agent_identity_args(node_name, **(pod or {})),
        "--socket-dir",
        str(socket_dir or ""),
        *args,
    ]
    for seed in seeds:
        argv += ["--seed", seed]
    env = {**os.environ, **cluster.env(), "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    if s3 is not None:
        argv += ["--checkpoint-dir", str(tmp_path / f"store-{node_name}"), "--s3-endpoint", s3.endpoint]
        env.update(s3.env())
    return ManagedProcess(f"agent-{node_name}", argv, tmp_path / f"agent-{node_name}.log", env=env).start()


def wait_phase(cluster, namespace, name, phase, proc, timeout=60):
    return wait_for(
        lambda: (o := get(cluster, namespace, "wr", name)) and (o.get("status") or {}).get("phase") == phase and o,
        timeout,
        f"{name} {phase}",
        lambda: json.dumps((get(cluster, namespace, "wr", name) or {}).get("status"), indent=1) + proc.log_tail(),
    )


def read_back(rank_entry: dict, replica_name: str, reader_node: str | None = None) -> str:
    """Pull one rank of a replica over NIXL as an independent reader; the content sha256 of what it serves."""
    return content_sha256(pull(rank_entry, replica_name, reader_node))


def serving_node(agent_name: str) -> str:
    """The node of the agent that serves as `agent_name` (`<node>-<id>[-r<rank>]`)."""
    nodes = [n for n in AGENT_NODES if agent_name.startswith(f"{n}-")]
    assert nodes, f"no test agent started for {agent_name}"
    return max(nodes, key=len)


def reader_tokens(cluster: LocalCluster, node_name: str) -> ReaderTokens:
    """The worker tokens a reader on `node_name` mints, as its agent does: TokenRequests against the real
    apiserver for the agent's ServiceAccount, bound to that node's agent Pod, one audience per source node. One
    per node and cluster, kept like an agent keeps its own: a reader that read before an apiserver outage still
    holds its tokens during it."""
    key = (str(cluster.kubeconfig), node_name)
    if key not in _READERS:
        me = cluster.agent_pod(node_name)
        identity = PodIdentity(me["podNamespace"], me["serviceAccount"], me["podName"], me["podUid"])
        _READERS[key] = ReaderTokens(_admin_api(str(cluster.kubeconfig)), identity)
    return _READERS[key]


_READERS: dict[tuple[str, str], ReaderTokens] = {}


@functools.cache
def _admin_api(kubeconfig: str) -> client.ApiClient:
    return config.new_client_from_config(config_file=kubeconfig)


def pull(rank_entry: dict, replica_name: str, reader_node: str | None = None) -> dict[str, torch.Tensor]:
    """A copy of what one rank of a replica serves, read over NIXL by an independent reader on `reader_node`
    (default: the serving node, whose own replica is assigned the version) with the tokens it mints."""
    from ferry_agent.strategies.candidate import SourceCandidate
    from ferry_agent.strategies.chain import LoadContext
    from ferry_agent.strategies.peer import PeerStrategy, TransferSettings
    from ferry_agent.transport.nixl import NixlPeer

    reader = NixlPeer(f"reader-{os.getpid()}-{replica_name}")
    rank = rank_entry["rank"]
    source = serving_node(rank_entry["agentName"])
    cand = SourceCandidate(replica_name, rank, rank_entry["agentName"], rank_entry["grpcEndpoint"], node=source)
    credentials = reader_tokens(AGENT_NODES[source], reader_node or source)
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


def bare_calls(endpoint: str, agent_name: str, token: str | None) -> dict[str, grpc.StatusCode | None]:
    """Each worker RPC, bare (nothing of a response, no lease or NIXL metadata, can hide in a client helper), with
    `token` as the bearer (none when None): per RPC the refusal's code, or None when it answered. A granted lease is
    released at once; "release" names a lease nobody holds (an admitted caller gets NOT_FOUND)."""
    metadata = (("authorization", f"Bearer {token}"),) if token is not None else None
    source = worker_pb2.SourceIdentity(agent_name=agent_name)
    codes: dict[str, grpc.StatusCode | None] = {}
    with grpc.insecure_channel(endpoint) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        calls = {
            "manifest": (stub.GetTensorManifest, worker_pb2.GetTensorManifestRequest(source=source)),
            "prepare": (stub.PrepareTensorRead, worker_pb2.PrepareTensorReadRequest(source=source, reader="probe")),
            "release": (stub.ReleaseTensorRead, worker_pb2.ReleaseTensorReadRequest(source=source, lease_id="none")),
        }
        for name, (rpc, request) in calls.items():
            try:
                response = rpc(request, timeout=10, metadata=metadata)
            except grpc.RpcError as exc:
                codes[name] = exc.code()
                continue
            codes[name] = None
            if name == "prepare":
                release = worker_pb2.ReleaseTensorReadRequest(source=source, lease_id=response.lease_id)
                stub.ReleaseTensorRead(release, timeout=10, metadata=metadata)
    return codes


def agent_metrics(agent: ManagedProcess) -> str:
    """The agent's Prometheus text, from the port it logged at start."""
    import re
    import urllib.request

    match = re.search(r"metrics on (http://\S+)", agent.log_path.read_text(errors="replace"))
    assert match, agent.log_tail()
    return urllib.request.urlopen(match.group(1), timeout=5).read().decode()


def rank_processes(agent: ManagedProcess) -> set[int]:
    """The pids of the agent's rank processes (its children that run `ferry_agent.ranks.worker`), serving or idle."""
    assert agent.proc is not None
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == agent.proc.pid and b"ferry_agent.ranks.worker" in cmdline:
            found.add(int(entry.name))
    return found


def lent_ranks(agent: ManagedProcess, namespace: str, replica_name: str) -> list[int]:
    """The pids, by rank, of the rank processes the agent lent to the last load of `replica_name` (its log)."""
    marker = f"{namespace}/{replica_name}: "
    lines = [line for line in agent.log_path.read_text(errors="replace").splitlines() if marker in line]
    lent = [line.split("(pids ", 1)[1].split(";", 1)[0] for line in lines if "rank processes (pids " in line]
    assert lent, f"no load of {replica_name} in the agent's log"
    return [int(pid) for pid in lent[-1].split(",")]


def memfds(pid: int) -> dict[str, str]:
    """The memfds process `pid` maps, by name, with the permissions of their mapping (/proc/<pid>/maps)."""
    out = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/memfd:ferry:"):
            out[fields[5].removeprefix("/memfd:").removesuffix(" (deleted)")] = fields[1]
    return out
