"""ModelLoad apply → Ready for 1, 3 and 8 replicas (agents as processes), peers-first against S3-only.

The reference is the same load with `sourceOrder: [ObjectStorage]`, measured in the same run on the same agents
(fresh checkpoint stores each round). Reports wall time to Ready, how many replicas read S3 vs a peer, and the
bytes fetched from S3 (the fan-out saving). Writes bench/results/modelload.json and modelload.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from _common import write_results
from safetensors.torch import save_file

from ferry.api.models import API_VERSION
from ferry.localcluster import LocalCluster, ManagedProcess, local_stack, start_operator, wait_until

MODEL = "bench"


def publish(cluster: LocalCluster, s3, root: Path, size_mib: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn((1024, 1024), generator=gen) for i in range(size_mib // 4)}
    src = root / "weights"
    src.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(src / "model.safetensors"))
    s3.create_bucket("bench")
    import subprocess

    subprocess.run(
        [sys.executable, "-m", "ferry.cli", "publish", str(src), "--version", "v1", "--model", MODEL,
         "--uri-prefix", "s3://bench/m", "--kubeconfig", str(cluster.kubeconfig), "--wait", "-q"],
        check=True, env={**os.environ, **s3.env()},
    )  # fmt: skip


def start_agents(cluster: LocalCluster, s3, root: Path, n: int, tag: str) -> list[ManagedProcess]:
    agents = []
    for i in range(n):
        node = f"{tag}-{i}"
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"bench": tag}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
        store = root / "stores" / node
        shutil.rmtree(store, ignore_errors=True)
        argv = [sys.executable, "-m", "ferry_agent", "--node", node, "--checkpoint-dir", str(store),
                "--poll-seconds", "0.2", "--retry-seconds", "1", *cluster.agent_identity_args(node)]  # fmt: skip
        env = {**os.environ, **cluster.env(), **s3.env(), "UCX_NET_DEVICES": "lo"}
        agents.append(ManagedProcess(node, argv, root / "logs" / f"{node}.log", env=env).start())
    time.sleep(3)  # agents import torch/NIXL before they poll
    return agents


def one_round(cluster: LocalCluster, s3, root: Path, n: int, order: list[str]) -> dict:
    tag = f"r{n}-{'p' if 'Peer' in order else 's'}"
    namespace = tag
    cluster.kubectl("create", "namespace", namespace)
    agents = start_agents(cluster, s3, root, n, tag)
    try:
        wv = json.loads(cluster.kubectl("get", "wv", "v1", "-n", "default", "-o", "json").stdout)
        body = {"apiVersion": API_VERSION, "kind": "WeightVersion", "metadata": {"name": "v1"}, "spec": wv["spec"]}
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
        cluster.kubectl("wait", "--for=condition=Ready", "wv/v1", "-n", namespace, "--timeout=60s")
        ml = {
            "apiVersion": API_VERSION, "kind": "ModelLoad", "metadata": {"name": "m"},
            "spec": {"modelName": MODEL, "desiredVersion": "v1", "replicas": n, "device": "cpu",
                     "nodeSelector": {"bench": tag}, "sourceOrder": order},
        }  # fmt: skip
        started = time.monotonic()
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(ml))

        def ready() -> bool:
            status = json.loads(cluster.kubectl("get", "ml", "m", "-n", namespace, "-o", "json").stdout).get("status")
            return bool(status) and status.get("readyReplicas") == n

        wait_until(ready, 600, f"{n} replicas Ready")
        seconds = time.monotonic() - started
        items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
        sources = [r["status"]["source"] for r in items]
        return {
            "replicas": n,
            "source_order": "+".join(order),
            "seconds_to_ready": round(seconds, 2),
            "from_s3": sum(s == "s3" for s in sources),
            "from_peer": sum(s.startswith("peer/") for s in sources),
            "s3_bytes": sum(r["status"]["bytesDone"] for r in items if r["status"]["source"] == "s3"),
        }
    finally:
        for a in agents:
            a.stop()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", default="1,3,8")
    parser.add_argument("--size-mib", type=int, default=128)
    args = parser.parse_args()
    rows = []
    with local_stack() as (cluster, s3):
        root = cluster.workdir.parent
        operator = start_operator(cluster, root / "operator", env={**s3.env(), "FERRY_RESYNC_SECONDS": "1"})
        publish(cluster, s3, root, args.size_mib)
        for n in (int(x) for x in args.replicas.split(",")):
            for order in (["Peer", "ObjectStorage"], ["ObjectStorage"]):
                row = one_round(cluster, s3, root, n, order)
                rows.append(row)
                print(json.dumps(row), flush=True)
        operator.stop()
    lines = [
        f"model {args.size_mib} MiB; S3-only is the reference measured in the same run",
        "",
        "| replicas | peers first: s to Ready | S3 only: s to Ready | ratio | peers first: S3 reads / peer copies "
        "| S3 bytes, peers first vs S3 only |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for peer, s3only in zip(rows[::2], rows[1::2], strict=True):
        lines.append(
            f"| {peer['replicas']} | {peer['seconds_to_ready']:.1f} | {s3only['seconds_to_ready']:.1f} | "
            f"{s3only['seconds_to_ready'] / peer['seconds_to_ready']:.2f}x | {peer['from_s3']} / {peer['from_peer']} "
            f"| {peer['s3_bytes'] >> 20} MiB vs {s3only['s3_bytes'] >> 20} MiB |"
        )
    write_results("modelload", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
