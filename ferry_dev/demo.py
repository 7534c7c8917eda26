"""`make demo`: the whole system on one machine.

A real etcd + kube-apiserver + kube-controller-manager, a SeaweedFS S3 server, the operator (`kopf run`) and three
node agents (one process per simulated GPU node). A trainer publishes a tiny Llama as a full checkpoint and an XOR
delta with `ferry publish`; a ModelLoad puts the model on three nodes: the first replica reads it from S3, the
others copy it from peers over NIXL. An inference engine (a real transformers Llama in its own process, as a pod on
the first node) attaches to its node's copy and generates. Then the desired version moves to the delta: every
replica holds v1 and the delta is small, so each applies it from S3 to its own copy, one replica at a time, and the
engine refits only the tensors that changed and generates what the trainer's v2 generates. Last, a tensor-parallel
ModelLoad puts two replicas of two ranks each (one process per simulated GPU, agreeing through a gloo group) on
two nodes: each rank holds half the tensors and copies it from the same rank of the other replica. The rank
processes start with the agents (`--warm-ranks 2`), so the load does not wait for them. Every command it prints
can be pasted into another shell (after the two `export` lines it prints first). Ctrl-C tears everything down.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ferry.api.models import API_VERSION, LABEL_MODELLOAD
from ferry_dev.demo_engine import build_model, generate
from ferry_dev.localcluster import LocalCluster, ManagedProcess, S3Server, local_stack, start_operator

MODEL = "llama-tiny"
NAMESPACE = "default"
BUCKET = "ferry-models"
NODES = ["gpu-node-1", "gpu-node-2", "gpu-node-3"]
TP_LOAD = f"{MODEL}-tp2"
SECRET = "ferry-s3"  # the S3 keys the operator and the agents read the versions with
ENGINE_NODE = NODES[0]


def say(text: str) -> None:
    print(f"\n\033[1m==> {text}\033[0m", flush=True)


def show(cluster: LocalCluster, *args: str) -> None:
    print(f"$ kubectl {shlex.join(args)}")
    print(cluster.kubectl(*args, check=False).stdout.rstrip(), flush=True)


def model_config(size_mib: int) -> dict:
    """A tiny Llama of about `size_mib` of float32 weights (a decoder layer is about 2.8 MiB)."""
    layers = max(2, round((size_mib - 1) / 2.8))
    return {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }


def make_weights(directory: Path, config: dict, base: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The trainer's checkpoint: a fresh Llama's state dict; with a base, a quarter of its tensors move (a step)."""
    if base is None:
        weights = {k: v.contiguous() for k, v in build_model(config, seed=0).state_dict().items()}
    else:
        gen = torch.Generator().manual_seed(2)
        weights = {
            k: (v + 0.05 * torch.randn(v.shape, generator=gen)) if i % 4 == 0 else v.clone()
            for i, (k, v) in enumerate(base.items())
        }
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(directory / "model.safetensors"))
    return weights


def trainer_tokens(config: dict, weights: dict[str, torch.Tensor]) -> list[int]:
    """What the trainer's own copy of these weights generates."""
    model = build_model(config)
    model.load_state_dict(weights)
    return generate(model)


def publish(cluster: LocalCluster, s3: S3Server, source: Path, version: str, base: str | None) -> None:
    args = [
        "publish",
        str(source),
        "--version",
        version,
        "--model",
        MODEL,
        "--uri-prefix",
        f"s3://{BUCKET}/{MODEL}",
        "--endpoint",
        s3.endpoint,
        "--credentials-secret",
        SECRET,
        "--layout-signature",
        f"{MODEL}/f32/tp1",
        "-n",
        NAMESPACE,
        "--wait",
        "--timeout",
        "120",
    ]
    if base:
        args += ["--base", base]
    if not sys.stdout.isatty():
        args.append("--quiet")  # the progress line redraws itself: only on a terminal
    print(f"$ ferry {shlex.join(args)}", flush=True)
    env = {**os.environ, **cluster.env(), **publisher_env(s3)}
    subprocess.run([sys.executable, "-m", "ferry.cli", *args], check=True, env=env)


def stored_bytes(cluster: LocalCluster, version: str) -> int:
    """What the version's objects hold (`status.totalBytes`, from the operator's verification)."""
    path = "jsonpath={.status.totalBytes}"
    return int(cluster.kubectl("get", "wv", version, "-n", NAMESPACE, "-o", path).stdout)


def publisher_env(s3: S3Server) -> dict[str, str]:
    """The trainer's own S3 keys (the AWS chain), as the `export` line the demo prints sets them."""
    return {k: v for k, v in s3.env().items() if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}


def credentials_secret(cluster: LocalCluster, s3: S3Server) -> None:
    """The readers' keys, as a Secret in the versions' namespace (here the trainer's own keys)."""
    keys = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key}
    literal = " ".join(f"--from-literal={k}=${k}" for k in keys)
    print(f"$ kubectl create secret generic {SECRET} -n {NAMESPACE} {literal}")
    cluster.kubectl(
        "create", "secret", "generic", SECRET, "-n", NAMESPACE, *(f"--from-literal={k}={v}" for k, v in keys.items())
    )


def start_agents(cluster: LocalCluster, s3: S3Server, workdir: Path, socket_dir: Path) -> list[ManagedProcess]:
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
            # The engine's node gives each of its pods an attach socket (the chart mounts it into the pod).
            "--socket-dir",
            str(socket_dir) if node == ENGINE_NODE else "",
        ]
        env = {**os.environ, **cluster.env(), **s3.env(), "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
        agents.append(ManagedProcess(f"agent-{node}", argv, workdir / f"agent-{node}.log", env=env).start())
    return agents


def _time(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def summary(cluster: LocalCluster, model_load: str = MODEL) -> None:
    items = replicas_of(cluster, model_load)
    print(f"{'replica':<36} {'node':<12} {'version':<14} {'source':<32} {'bytes':>12} {'seconds':>8} {'GB/s':>6}")
    for r in sorted(items, key=lambda r: r["status"].get("completedTime") or ""):
        st = r["status"]
        start, end = _time(st.get("startedTime")), _time(st.get("completedTime"))
        seconds = (end - start).total_seconds() if start and end else float("nan")
        rate = (st.get("bytesDone") or 0) / seconds / 1e9 if seconds and seconds > 0 else float("nan")
        print(
            f"{r['metadata']['name']:<36} {r['spec']['nodeName']:<12} {st.get('version', ''):<14} "
            f"{st.get('source', ''):<32} {st.get('bytesDone') or 0:>12} {seconds:>8.2f} {rate:>6.2f}"
        )


def replicas_of(cluster: LocalCluster, model_load: str) -> list[dict]:
    selector = f"{LABEL_MODELLOAD}={model_load}"
    return json.loads(cluster.kubectl("get", "wr", "-n", NAMESPACE, "-l", selector, "-o", "json").stdout)["items"]


def rank_table(cluster: LocalCluster, model_load: str) -> None:
    """Who serves which rank: one process (NIXL agent + worker service) per rank."""
    items = replicas_of(cluster, model_load)
    print(f"{'replica':<36} {'rank':>4} {'tensors':>7}  {'NIXL agent':<32} worker endpoint")
    for r in sorted(items, key=lambda r: r["metadata"]["name"]):
        for e in sorted(r["status"].get("ranks") or [], key=lambda e: e["rank"]):
            print(
                f"{r['metadata']['name']:<36} {e['rank']:>4} {e['tensorCount']:>7}  {e['agentName']:<32} "
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


def start_engine(cluster: LocalCluster, root: Path, socket_dir: Path, config: dict) -> subprocess.Popen:
    """The engine pod: a Pod object bound to ENGINE_NODE (no kubelet here: its process runs beside the demo, with
    the pod's socket directory, as the chart's consumer library mounts it)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "engine", "namespace": NAMESPACE},
        "spec": {
            "nodeName": ENGINE_NODE,
            "automountServiceAccountToken": False,
            "containers": [{"name": "engine", "image": "vllm-like:demo"}],
        },
    }
    deadline = time.monotonic() + 30  # admission waits for the namespace's default ServiceAccount
    while cluster.kubectl("apply", "-f", "-", input=json.dumps(pod), check=False).returncode != 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the engine Pod could not be created")
        time.sleep(0.5)
    uid = cluster.kubectl("get", "pod", "engine", "-n", NAMESPACE, "-o", "jsonpath={.metadata.uid}").stdout.strip()
    pod_dir = socket_dir / "pods" / uid
    config_path = root / "engine-config.json"
    config_path.write_text(json.dumps(config))
    with open(root / "engine.log", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "ferry_dev.demo_engine", MODEL, str(config_path)],
            env={**os.environ, "FERRY_SOCKET_DIR": str(pod_dir), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )


def engine_says(engine: subprocess.Popen, expected: list[int], timeout: float = 120) -> None:
    """The engine's next step, printed; its tokens must be the trainer's."""
    ready, _, _ = select.select([engine.stdout], [], [], timeout)
    line = engine.stdout.readline() if ready else ""
    if not line:
        raise TimeoutError("the engine said nothing (see engine.log)")
    step = json.loads(line)
    verb = "loaded" if step["copied"] == step["tensors"] else "refit"
    print(
        f"  engine: {verb} {step['version']}: copied {step['copied']} of {step['tensors']} tensors in place, "
        f"paused {step['pausedMs']:.0f} ms; generates {step['tokens']}"
    )
    same = step["tokens"] == expected
    print(f"  trainer's own {step['version']} generates {expected}: {'the same' if same else 'DIFFERENT'}")
    if not same:
        raise TimeoutError(f"the engine's {step['version']} generates other tokens than the trainer's")


def engines_attached(cluster: LocalCluster) -> None:
    jsonpath = '{range .status.conditions[?(@.type=="EnginesAttached")]}{.status} {.reason}: {.message}{end}'
    show(cluster, "get", "ml", MODEL, "-n", NAMESPACE, "-o", f"jsonpath={jsonpath}")


def wait_engines_attached(cluster: LocalCluster, version: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ml = json.loads(cluster.kubectl("get", "ml", MODEL, "-n", NAMESPACE, "-o", "json").stdout)
        for c in (ml.get("status") or {}).get("conditions") or []:
            if c["type"] == "EnginesAttached" and c["status"] == "True" and version in c.get("message", ""):
                return
        time.sleep(0.5)
    raise TimeoutError(f"the ModelLoad never showed the engine attached to {version}")


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
        tools = Path(sys.executable).parent  # kubectl and ferry
        print(f"  apiserver {cluster.server}   S3 {s3.endpoint}   logs under {root}")
        print("  to paste the commands below into another shell, first:")
        print(f"  export KUBECONFIG={cluster.kubeconfig} PATH={tools}:$PATH")
        keys = " ".join(f"{k}={v}" for k, v in publisher_env(s3).items())
        print(f"  export {keys}  # the trainer's S3 keys")
        s3.create_bucket(BUCKET)
        say("Starting the operator (kopf run) and three node agents")
        socket_dir = root / "sockets"
        operator = start_operator(cluster, root / "operator", env=s3.env())
        agents = start_agents(cluster, s3, root / "agents", socket_dir)
        engine: subprocess.Popen | None = None
        try:
            config = model_config(size_mib)
            say(f"Trainer: publish a {size_mib} MiB Llama as v1 (full) and v2 (XOR delta: a quarter of its tensors)")
            credentials_secret(cluster, s3)
            v1 = make_weights(root / "train" / "step-1", config, None)
            v2 = make_weights(root / "train" / "step-2", config, v1)
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

            say(f"An engine pod on {ENGINE_NODE} attaches to its node's v1 (no copy: it maps the agent's memory)")
            engine = start_engine(cluster, root, socket_dir, config)
            engine_says(engine, trainer_tokens(config, v1))
            wait_engines_attached(cluster, f"{MODEL}-v1")
            engines_attached(cluster)

            share = stored_bytes(cluster, f"{MODEL}-v2") / stored_bytes(cluster, f"{MODEL}-v1")
            say(
                f"Roll out v2, one replica at a time (Rolling). Each replica holds v1 and the delta is {share:.0%} of "
                "the model, so each applies it from S3 to its own copy; the engine then refits what changed"
            )
            patch = json.dumps({"spec": {"desiredVersion": f"{MODEL}-v2"}})
            cluster.kubectl("patch", "ml", MODEL, "-n", NAMESPACE, "--type=merge", "-p", patch)
            print(f"$ kubectl patch ml {MODEL} -n {NAMESPACE} --type=merge -p {shlex.quote(patch)}")
            wait_modelload(cluster, f"{MODEL}-v2")
            engine_says(engine, trainer_tokens(config, v2))
            wait_engines_attached(cluster, f"{MODEL}-v2")
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
            if engine is not None:
                engine.kill()
                engine.wait(5)
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
