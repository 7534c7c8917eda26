"""`make demo`: the whole system on one machine.

A real etcd + kube-apiserver + kube-controller-manager, a SeaweedFS S3 server, the operator (`kopf run`) and three
node agents (one process per simulated GPU node). A trainer publishes a full checkpoint and an XOR delta with
`ferry publish`; a ModelLoad puts the model on three nodes: the first replica replays it from S3, the others copy
it from peers over NIXL. Then the desired version moves to the delta and rolls out. Last, a tensor-parallel
ModelLoad puts two replicas of two ranks each (one process per simulated GPU, agreeing through a gloo group) on
two nodes: each rank holds half the tensors and copies it from the same rank of the other replica. The rank
processes start with the agents (`--warm-ranks 2`), so the load does not wait for them. Ctrl-C tears everything
down.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ferry.api.models import API_VERSION, LABEL_MODELLOAD
from ferry_dev.localcluster import LocalCluster, ManagedProcess, S3Server, local_stack, start_operator

MODEL = "llama-tiny"
NAMESPACE = "default"
BUCKET = "ferry-models"
NODES = ["gpu-node-1", "gpu-node-2", "gpu-node-3"]
TP_LOAD = f"{MODEL}-tp2"


def say(text: str) -> None:
    print(f"\n\033[1m==> {text}\033[0m", flush=True)


def show(cluster: LocalCluster, *args: str) -> None:
    print(f"$ kubectl {' '.join(args)}")
    print(cluster.kubectl(*args, check=False).stdout.rstrip(), flush=True)


def make_weights(directory: Path, seed: int, base: dict[str, torch.Tensor] | None, size_mib: int) -> dict:
    """`size_mib` of float32 layers; with a base, a quarter of the layers change (a fine-tuning step)."""
    gen = torch.Generator().manual_seed(seed)
    layers = max(4, size_mib // 4)
    if base is None:
        weights = {f"model.layers.{i}.mlp.weight": torch.randn((1024, 1024), generator=gen) for i in range(layers)}
    else:
        weights = {
            k: (v + 0.01 * torch.randn(v.shape, generator=gen)) if i % 4 == 0 else v.clone()
            for i, (k, v) in enumerate(base.items())
        }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"))
    return weights


def publish(cluster: LocalCluster, s3: S3Server, source: Path, version: str, base: str | None) -> None:
    argv = [
        sys.executable,
        "-m",
        "ferry.cli",
        "publish",
        str(source),
        "--version",
        version,
        "--model",
        MODEL,
        "--uri-prefix",
        f"s3://{BUCKET}/{MODEL}",
        "--layout-signature",
        f"{MODEL}/f32/tp1",
        "-n",
        NAMESPACE,
        "--kubeconfig",
        str(cluster.kubeconfig),
        "--wait",
        "--timeout",
        "120",
    ]
    if base:
        argv += ["--base", base]
    print(f"$ ferry publish {source.name} --version {version}" + (f" --base {base}" if base else ""), flush=True)
    subprocess.run(argv, check=True, env={**os.environ, **s3.env()})


def start_agents(cluster: LocalCluster, s3: S3Server, workdir: Path) -> list[ManagedProcess]:
    agents = []
    for node in NODES:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"ferry.dev/gpu": "true"}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
        # The Pod the chart would run it as: the agent mints its worker tokens bound to it.
        argv = [
            sys.executable,
            "-m",
            "ferry_agent",
            "--node",
            node,
            "--checkpoint-dir",
            str(workdir / node),
            "--poll-seconds",
            "2",
            "--retry-seconds",
            "1",
            *cluster.agent_identity_args(node),
            # Two rank processes started with the agent, idle until the tensor-parallel load below lends them.
            "--warm-ranks",
            "2",
        ]
        env = {**os.environ, **cluster.env(), **s3.env(), "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
        agents.append(ManagedProcess(f"agent-{node}", argv, workdir / f"agent-{node}.log", env=env).start())
    return agents


def _time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def summary(cluster: LocalCluster, model_load: str = MODEL) -> None:
    items = replicas_of(cluster, model_load)
    print(f"{'replica':<28} {'node':<12} {'version':<14} {'source':<32} {'bytes':>12} {'seconds':>8} {'GB/s':>6}")
    for r in sorted(items, key=lambda r: r["status"].get("completedTime") or ""):
        st = r["status"]
        start, end = _time(st.get("startedTime")), _time(st.get("completedTime"))
        seconds = (end - start).total_seconds() if start and end else float("nan")
        rate = (st.get("bytesDone") or 0) / seconds / 1e9 if seconds and seconds > 0 else float("nan")
        print(
            f"{r['metadata']['name']:<28} {r['spec']['nodeName']:<12} {st.get('version', ''):<14} "
            f"{st.get('source', ''):<32} {st.get('bytesDone') or 0:>12} {seconds:>8.2f} {rate:>6.2f}"
        )


def replicas_of(cluster: LocalCluster, model_load: str) -> list[dict]:
    selector = f"{LABEL_MODELLOAD}={model_load}"
    return json.loads(cluster.kubectl("get", "wr", "-n", NAMESPACE, "-l", selector, "-o", "json").stdout)["items"]


def rank_table(cluster: LocalCluster, model_load: str) -> None:
    """Who serves which rank: one process (NIXL agent + worker service) per rank."""
    items = replicas_of(cluster, model_load)
    print(f"{'replica':<28} {'rank':>4} {'tensors':>7}  {'NIXL agent':<32} worker endpoint")
    for r in sorted(items, key=lambda r: r["metadata"]["name"]):
        for e in sorted(r["status"].get("ranks") or [], key=lambda e: e["rank"]):
            print(
                f"{r['metadata']['name']:<28} {e['rank']:>4} {e['tensorCount']:>7}  {e['agentName']:<32} "
                f"{e['grpcEndpoint']}"
            )


def wait_modelload(cluster: LocalCluster, version: str, timeout: float = 180, name: str = MODEL) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ml = json.loads(cluster.kubectl("get", "ml", name, "-n", NAMESPACE, "-o", "json").stdout)
        status = ml.get("status") or {}
        if status.get("loadedVersion") == version and status.get("readyReplicas") == ml["spec"]["replicas"]:
            return
        time.sleep(0.5)
    show(cluster, "describe", "ml", name, "-n", NAMESPACE)
    raise TimeoutError(f"ModelLoad {name} did not reach {version}")


def wait_for_interrupt() -> None:
    stop = False

    def handler(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    while not stop:
        time.sleep(0.5)


def run(wait: bool, workdir: Path | None, size_mib: int) -> int:
    say("Starting etcd, kube-apiserver, kube-controller-manager and SeaweedFS S3 on 127.0.0.1")
    with local_stack(workdir) as (cluster, s3):
        root = cluster.workdir.parent
        print(f"  apiserver {cluster.server}   S3 {s3.endpoint}\n  export KUBECONFIG={cluster.kubeconfig}")
        s3.create_bucket(BUCKET)
        say("Starting the operator (kopf run) and three node agents")
        operator = start_operator(cluster, root / "operator", env=s3.env())
        agents = start_agents(cluster, s3, root / "agents")
        print(f"  logs under {root}")
        try:
            say(f"Trainer: publish v1 (full, {size_mib} MiB) and v2 (XOR delta of a quarter of the layers)")
            v1 = make_weights(root / "train" / "step-1", 1, None, size_mib)
            make_weights(root / "train" / "step-2", 2, v1, size_mib)
            publish(cluster, s3, root / "train" / "step-1", f"{MODEL}-v1", None)
            publish(cluster, s3, root / "train" / "step-2", f"{MODEL}-v2", f"{MODEL}-v1")
            show(cluster, "get", "wv", "-n", NAMESPACE)

            say("Apply a ModelLoad: 3 replicas of v1")
            ml = {
                "apiVersion": API_VERSION,
                "kind": "ModelLoad",
                "metadata": {"name": MODEL},
                "spec": {
                    "modelName": MODEL,
                    "desiredVersion": f"{MODEL}-v1",
                    "replicas": 3,
                    "device": "cpu",
                    "nodeSelector": {"ferry.dev/gpu": "true"},
                },
            }
            cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(ml))
            wait_modelload(cluster, f"{MODEL}-v1")
            show(cluster, "get", "ml,wr", "-n", NAMESPACE, "-o", "wide")
            summary(cluster)

            say("Roll out v2: one replica at a time; the first applies the delta, the others copy it from a peer")
            patch = json.dumps({"spec": {"desiredVersion": f"{MODEL}-v2"}})
            cluster.kubectl("patch", "ml", MODEL, "-n", NAMESPACE, "--type=merge", "-p", patch)
            wait_modelload(cluster, f"{MODEL}-v2")
            show(cluster, "get", "ml,wr", "-n", NAMESPACE, "-o", "wide")
            summary(cluster)
            show(cluster, "describe", "ml", MODEL, "-n", NAMESPACE)

            say("Tensor parallel: a ModelLoad of 2 replicas x 2 ranks of v2; each rank holds half the tensors")
            tp = {
                "apiVersion": API_VERSION,
                "kind": "ModelLoad",
                "metadata": {"name": TP_LOAD},
                "spec": {
                    "modelName": MODEL,
                    "desiredVersion": f"{MODEL}-v2",
                    "replicas": 2,
                    "ranksPerReplica": 2,
                    "device": "cpu",
                    "nodeSelector": {"ferry.dev/gpu": "true"},
                },
            }
            cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(tp))
            wait_modelload(cluster, f"{MODEL}-v2", name=TP_LOAD)
            summary(cluster, TP_LOAD)
            rank_table(cluster, TP_LOAD)

            if wait:
                say("Everything stays up for kubectl (KUBECONFIG above). Ctrl-C to tear down.")
                wait_for_interrupt()
        finally:
            say("Tearing down")
            for agent in agents:
                agent.stop()
            operator.stop()
    print("done")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry-demo", description=__doc__)
    parser.add_argument("--no-wait", action="store_true", help="tear down right after the walkthrough")
    parser.add_argument("--workdir", type=Path, help="keep state here instead of a temporary directory")
    parser.add_argument("--size-mib", type=int, default=128, help="model size")
    args = parser.parse_args(argv)
    try:
        return run(wait=not args.no_wait and sys.stdin.isatty(), workdir=args.workdir, size_mib=args.size_mib)
    except (subprocess.CalledProcessError, TimeoutError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
