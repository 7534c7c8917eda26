"""An RL-style soak on the local stack: what tests/e2e/test_soak.py runs bounded and bench/soak_rl.py runs long.

A trainer publishes step after step through the publish API (a full checkpoint every `keyframe_every` steps, XOR
deltas between), and moves the ModelLoad's desiredVersion to each step as soon as its upload ends, without waiting
for it to be Ready. Node agents (real processes, S3 behind them) roll the steps out while retention (`keepLast`,
`deleteStorage`) retires the old ones, and an engine process on one node (`ferry_dev.soak_consumer`) follows every
step with watch + attach + load_into(only_changed=True). Every hold is checked against the sha256 of the tensors
that step published, and counted backward when it goes to an older step than one the engine already held. Every
WeightReplica spec change is watched too, and counted backward when it moves a replica to an older step.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ferry.api.models import API_VERSION, ReplicaPhase
from ferry.publish import PublishOptions, publish
from ferry_dev.localcluster import LocalCluster, ManagedProcess, S3Server, binary, wait_until
from ferry_dev.soak_consumer import tensors_sha256

BUCKET = "soak"
MODEL = "soak"
SECRET = "soak-s3"
MODEL_LOAD = "rl"


@dataclass(frozen=True)
class SoakConfig:
    steps: int = 20
    agents: int = 3
    keyframe_every: int = 8
    keep_last: int = 3
    rollout: str = "Parallel"  # or Rolling
    tensors: int = 8
    shape: tuple[int, int] = (128, 128)
    changed: int = 2  # tensors a step changes
    interval_s: float = 0.2  # between the end of one publish and the next
    settle_timeout_s: float = 120.0


@dataclass
class SoakReport:
    config: SoakConfig
    seconds: float = 0.0
    published_at: dict[str, float] = field(default_factory=dict)
    holds: list[dict[str, Any]] = field(default_factory=list)  # the consumer's lines, in order
    wrong_bytes: list[str] = field(default_factory=list)  # steps held with other bytes than published
    backward_holds: int = 0
    replica_moves: int = 0
    backward_moves: list[str] = field(default_factory=list)
    served_last: dict[str, str] = field(default_factory=dict)  # replica -> the step it serves at the end
    s3_left: list[str] = field(default_factory=list)
    s3_expected: list[str] = field(default_factory=list)
    rss_kib: dict[str, tuple[int, int]] = field(default_factory=dict)  # agent -> (after the first step, at the end)

    @property
    def latencies(self) -> list[float]:
        """Publish end → the engine holds that step, for each step the engine held."""
        return [h["time"] - self.published_at[h["version"]] for h in self.holds if "sha256" in h]

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        steps = self.config.steps
        rss = {a: (end - start) / max(1, steps - 1) for a, (start, end) in self.rss_kib.items()}
        return {
            "steps": steps,
            "seconds": round(self.seconds, 2),
            "steps_per_second": round(steps / self.seconds, 3) if self.seconds else None,
            "holds": sum(1 for h in self.holds if "sha256" in h),
            "wrong_bytes": len(self.wrong_bytes),
            "backward_holds": self.backward_holds,
            "replica_moves": self.replica_moves,
            "backward_moves": len(self.backward_moves),
            "publish_to_engine_p50_s": round(statistics.median(lat), 3) if lat else None,
            "publish_to_engine_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
            "s3_versions_left": len(self.s3_left),
            "s3_versions_expected": len(self.s3_expected),
            "agent_rss_kib_per_step": {a: round(v, 1) for a, v in rss.items()},
        }


def step_name(i: int) -> str:
    return f"step-{i:04d}"


def step_weights(cfg: SoakConfig) -> Iterator[dict[str, torch.Tensor]]:
    """Each step's tensors: step 0 drawn at random, then `changed` tensors moved per step, round robin."""
    gen = torch.Generator().manual_seed(0)
    weights = {f"layers.{i}.weight": torch.randn(cfg.shape, generator=gen) for i in range(cfg.tensors)}
    names = sorted(weights)
    for i in range(cfg.steps):
        if i:
            weights = dict(weights)
            for k in range(cfg.changed):
                name = names[(i * cfg.changed + k) % len(names)]
                weights[name] = weights[name] + torch.randn(cfg.shape, generator=gen) * 1e-3
        yield weights


def expected_chain(cfg: SoakConfig) -> list[str]:
    """The steps retention keeps at the end: the newest keep_last, and the chain each of them replays from."""
    keep: set[str] = set()
    for i in range(max(0, cfg.steps - cfg.keep_last), cfg.steps):
        j = i
        while True:
            keep.add(step_name(j))
            if j % cfg.keyframe_every == 0:
                break
            j -= 1
    return sorted(keep)


def engine_pod(cluster: LocalCluster, namespace: str, node: str) -> str:
    """A Pod object bound to `node` (no kubelet runs it; the agent gives it a socket): its uid."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "engine", "namespace": namespace},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "containers": [{"name": "engine", "image": "engine:soak"}],
        },
    }
    # The namespace's default ServiceAccount may not exist yet (the controller makes it): admission waits for it.
    wait_until(
        lambda: cluster.kubectl("apply", "-f", "-", input=json.dumps(body), check=False).returncode == 0,
        30,
        "the engine pod created",
    )
    out = cluster.kubectl("get", "pod", "engine", "-n", namespace, "-o", "jsonpath={.metadata.uid}")
    return out.stdout.strip()


def start_agents(
    cluster: LocalCluster, s3: S3Server, root: Path, namespace: str, count: int, socket_dir: Path
) -> list[ManagedProcess]:
    agents = []
    for i in range(count):
        node = f"{namespace}-n{i}"
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"ferry.dev/pool": namespace}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
        argv = [
            sys.executable,
            "-m",
            "ferry_agent",
            "--node",
            node,
            "--lease-seconds",
            "3",
            "--poll-seconds",
            "3",
            "--retry-seconds",
            "1",
            "--metrics-port",
            "0",
            *cluster.agent_identity_args(node),
            "--socket-dir",
            str(socket_dir) if i == 0 else "",
            "--checkpoint-dir",
            str(root / f"store-{node}"),
            "--s3-endpoint",
            s3.endpoint,
        ]
        env = {**os.environ, **cluster.env(), **s3.env(), "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
        agents.append(ManagedProcess(f"agent-{node}", argv, root / f"agent-{node}.log", env=env).start())
    return agents


def rss_kib(process: ManagedProcess) -> int:
    for line in Path(f"/proc/{process.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """The publish API signs with the environment's credentials, as `ferry publish` does: set for its calls only."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ReplicaWatch:
    """Every WeightReplica spec.version change in the namespace, from a kubectl watch: (replica, step) in order."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.moves: list[tuple[str, str]] = []
        self._proc = subprocess.Popen(
            [
                binary("kubectl"),
                f"--kubeconfig={cluster.kubeconfig}",
                "get",
                "wr",
                "-n",
                namespace,
                "--watch",
                "--output-watch-events",
                "-o",
                "json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        last: dict[str, str] = {}
        decoder, buffer = json.JSONDecoder(), ""
        for line in self._proc.stdout:
            buffer += line
            with contextlib.suppress(json.JSONDecodeError):
                event, _ = decoder.raw_decode(buffer.strip())
                buffer = ""
                obj = event.get("object") or {}
                name, version = obj["metadata"]["name"], (obj.get("spec") or {}).get("version")
                if version and last.get(name) != version:
                    last[name] = version
                    self.moves.append((name, version))

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait(5)
        self._thread.join(5)


def run_soak(
    cluster: LocalCluster, s3: S3Server, root: Path, namespace: str, cfg: SoakConfig, socket_dir: Path
) -> SoakReport:
    """The soak, in `namespace` (which must exist), against an operator the caller runs."""
    report = SoakReport(cfg)
    s3.create_bucket(BUCKET)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": namespace},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(secret))
    agents = start_agents(cluster, s3, root, namespace, cfg.agents, socket_dir)
    watcher = ReplicaWatch(cluster, namespace)
    consumer: subprocess.Popen | None = None
    expected: dict[str, str] = {}
    try:
        uid = engine_pod(cluster, namespace, f"{namespace}-n0")
        pod_dir = socket_dir / "pods" / uid
        wait_until(lambda: (pod_dir / "ferry.sock").exists(), 30, "the engine pod's socket", agents[0])
        with open(root / "consumer.log", "w") as log:  # the child keeps its own descriptor
            consumer = subprocess.Popen(
                [sys.executable, "-m", "ferry_dev.soak_consumer", MODEL_LOAD, "60"],
                env={**os.environ, "FERRY_SOCKET_DIR": str(pod_dir), "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        started = time.monotonic()
        previous: tuple[str, Path] | None = None
        for i, weights in enumerate(step_weights(cfg)):
            name, source = step_name(i), root / "steps" / step_name(i)
            source.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(source / "model.safetensors"))
            expected[name] = tensors_sha256(weights)
            delta = previous is not None and i % cfg.keyframe_every != 0
            opts = PublishOptions(
                source=source,
                version=name,
                uri_prefix=f"s3://{BUCKET}/{namespace}",
                model=MODEL,
                base=previous[0] if delta else None,
                base_dir=previous[1] if delta else None,
                endpoint=s3.endpoint,
                credentials_secret=SECRET,
                namespace=namespace,
                kubeconfig=str(cluster.kubeconfig),
            )
            with environment(s3.env()):
                publish(opts)
            report.published_at[name] = time.time()
            if i == 0:
                cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(model_load(namespace, cfg)))
            else:
                patch = json.dumps({"spec": {"desiredVersion": name}})
                cluster.kubectl("patch", "ml", MODEL_LOAD, "-n", namespace, "--type", "merge", "-p", patch)
            previous = (name, source)
            time.sleep(cfg.interval_s)
            if i == 0:
                report.rss_kib = {a.name: (rss_kib(a), 0) for a in agents}
        last = step_name(cfg.steps - 1)
        report.served_last = wait_served(cluster, namespace, last, cfg, agents)
        report.seconds = time.monotonic() - started
        report.holds = read_holds(consumer, last, cfg.settle_timeout_s)
        report.rss_kib = {a.name: (report.rss_kib[a.name][0], rss_kib(a)) for a in agents}
        report.s3_expected = expected_chain(cfg)
        report.s3_left = wait_retired(s3, namespace, report.s3_expected, cfg.settle_timeout_s)
    finally:
        watcher.stop()
        if consumer is not None:
            consumer.kill()
            consumer.wait(5)
        for agent in agents:
            agent.stop()
    order = {step_name(i): i for i in range(cfg.steps)}
    highest = -1
    for hold in report.holds:
        if "sha256" not in hold:
            continue
        if hold["sha256"] != expected[hold["version"]]:
            report.wrong_bytes.append(hold["version"])
        if order[hold["version"]] < highest:
            report.backward_holds += 1
        highest = max(highest, order[hold["version"]])
    report.replica_moves = len(watcher.moves)
    at: dict[str, int] = {}
    for replica, version in watcher.moves:
        if replica in at and order[version] < at[replica]:
            report.backward_moves.append(f"{replica}: {step_name(at[replica])} -> {version}")
        at[replica] = order[version]
    return report


def model_load(namespace: str, cfg: SoakConfig) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelLoad",
        "metadata": {"name": MODEL_LOAD},
        "spec": {
            "modelName": MODEL,
            "desiredVersion": step_name(0),
            "replicas": cfg.agents,
            "device": "cpu",
            "nodeSelector": {"ferry.dev/pool": namespace},
            "transfer": {"timeoutSeconds": 30},
            "retention": {"keepLast": cfg.keep_last, "deleteStorage": True},
            "rollout": {"strategy": cfg.rollout},
        },
    }


def wait_served(
    cluster: LocalCluster, namespace: str, last: str, cfg: SoakConfig, agents: list[ManagedProcess]
) -> dict[str, str]:
    """Every replica serves `last`: {replica: the step it serves}."""
    served: dict[str, str] = {}

    def all_serve() -> bool:
        out = cluster.kubectl("get", "wr", "-n", namespace, "-o", "json")
        items = json.loads(out.stdout)["items"]
        served.clear()
        for wr in items:
            status = wr.get("status") or {}
            serving = status.get("phase") == ReplicaPhase.SERVING and not status.get("loadingVersion")
            served[wr["metadata"]["name"]] = status.get("version", "") if serving else ""
        return len(items) == cfg.agents and all(v == last for v in served.values())

    with contextlib.suppress(Exception):
        wait_until(all_serve, cfg.settle_timeout_s, f"every replica serving {last}")
    for agent in agents:
        if not agent.alive:
            raise RuntimeError(f"{agent.name} died:\n{agent.log_tail()}")
    return dict(served)


def read_holds(consumer: subprocess.Popen, last: str, timeout: float) -> list[dict[str, Any]]:
    """The consumer's lines until it holds `last` (or `timeout` passes)."""
    holds: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([consumer.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = consumer.stdout.readline() if ready else ""
        if not line:
            break
        holds.append(json.loads(line))
        if holds[-1].get("version") == last and "sha256" in holds[-1]:
            break
    return holds


def stored_versions(s3: S3Server, namespace: str) -> list[str]:
    names: set[str] = set()
    for page in s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{namespace}/"):
        for obj in page.get("Contents", []):
            names.add(obj["Key"].split("/")[1])
    return sorted(names)


def wait_retired(s3: S3Server, namespace: str, expected: list[str], timeout: float) -> list[str]:
    """The versions S3 still holds once retention has had `timeout` to delete the others."""
    deadline = time.monotonic() + timeout
    while (left := stored_versions(s3, namespace)) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
