"""Who is attached, through the API: an agent process writes its consumers into the WeightReplica's status, the
operator counts them on the ModelLoad (attachedPods, EnginesAttached) and holds the release of a WeightVersion a
pod is attached to until it is gone.

A Pod object bound to the agent's node (no kubelet runs it) gets its socket; a separate consumer process with that
pod's directory attaches the ModelLoad (`attach_consumer.py`, Ferry's own stack unimportable) and holds it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest
from safetensors.torch import save_file

from tests.e2e.attach_consumer import build_model, model_tensors
from tests.support.agents import node, seed_arg, start_agent
from tests.support.consumers import consumer, engine_pod, line_of
from tests.support.objects import apply, condition, get, ml_body, ml_status, wait_for, wv_body

pytestmark = pytest.mark.e2e


def printed_column(cluster, namespace: str, kind: str, header: str) -> str:
    """The `kubectl get` column `header` of the one object of `kind`, cut at the header's offset (empty columns
    before it would shift a split())."""
    head, row = cluster.kubectl("get", kind, "-n", namespace).stdout.splitlines()[:2]
    start = head.index(f" {header} ") + 1
    return row[start:].split()[0]


def replica_status(cluster, namespace: str) -> dict:
    items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
    assert len(items) == 1, items
    return items[0].get("status") or {}


def held(cluster, namespace: str) -> list[tuple[str, str, str]]:
    """The replica's attachments as (pod, podUid, version)."""
    return [(a["pod"], a["podUid"], a["version"]) for a in replica_status(cluster, namespace).get("attachments") or []]


def engines(cluster, namespace: str) -> tuple[str, str, int | None]:
    ml = get(cluster, namespace, "ml", "serve")
    cond = condition(ml, "EnginesAttached")
    return cond.get("status"), cond.get("reason"), ((ml or {}).get("status") or {}).get("attachedPods")


def checkpoints(tmp_path, versions: tuple[str, ...]) -> dict:
    tensors = {n: t.detach().contiguous() for n, t in model_tensors(build_model(seed=0)).items()}
    paths = {}
    for i, version in enumerate(versions):
        paths[version] = tmp_path / f"{version}.safetensors"
        save_file({n: t + i for n, t in tensors.items()}, str(paths[version]))
    return paths


def test_attached_pod_is_counted_and_blocks_the_release_of_its_version_until_killed(
    cluster, namespace, operator, tmp_path, socket_root
):
    paths = checkpoints(tmp_path, ("v1", "v2"))
    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    agent = start_agent(
        cluster, tmp_path, node_name, *(seed_arg(namespace, v, p) for v, p in paths.items()), socket_dir=socket_root
    )
    holder: subprocess.Popen | None = None

    def describe() -> str:
        wv = (get(cluster, namespace, "wv", "v1") or {}).get("status")
        return json.dumps({"ml": ml_status(cluster, namespace), "v1": wv}, indent=1) + agent.log_tail(30)

    try:
        uid = engine_pod(cluster, namespace, node_name, name="llama-0")
        pod_dir = socket_root / "pods" / uid
        apply(
            cluster,
            namespace,
            wv_body(namespace, "v1", fmt="PeerOnly"),
            wv_body(namespace, "v2", fmt="PeerOnly"),
            ml_body(namespace, "v1", 1),
        )
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "1/1", 90, "1/1 ready", describe)
        assert held(cluster, namespace) == [] and engines(cluster, namespace)[:2] == ("False", "NoEngines")

        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket", describe)
        holder = consumer(pod_dir, "hold")
        assert line_of(holder, describe)["version"] == "v1"
        wait_for(lambda: held(cluster, namespace) == [("llama-0", uid, "v1")], 30, "llama-0 in attachments", describe)
        status = replica_status(cluster, namespace)
        assert status["attachedPods"] == 1
        assert status["attachments"][0]["podNamespace"] == namespace and "rank" not in status["attachments"][0]
        wait_for(lambda: engines(cluster, namespace) == ("True", "Attached", 1), 30, "EnginesAttached", describe)
        assert printed_column(cluster, namespace, "ml", "ATTACHED") == "1"
        assert printed_column(cluster, namespace, "wr", "ATTACHED") == "1"

        # The node moves to v2; the engine has not refit and keeps v1 (the agent no longer offers it).
        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
        )
        wait_for(lambda: ml_status(cluster, namespace).get("loadedVersion") == "v2", 90, "v2 loaded", describe)
        assert replica_status(cluster, namespace)["version"] == "v2"
        assert held(cluster, namespace) == [("llama-0", uid, "v1")]
        wait_for(
            lambda: engines(cluster, namespace) == ("False", "EnginesOnOlderVersion", 1),
            30,
            "engines on the older version",
            describe,
        )

        # Nothing desires v1 and no replica serves it, but a pod holds it: its release waits, naming the pod.
        cluster.kubectl("delete", "wv", "v1", "-n", namespace, "--wait=false")
        blocker = f"attached: {namespace}/llama-0 on {node_name}"
        wait_for(
            lambda: (
                ((get(cluster, namespace, "wv", "v1") or {}).get("status") or {}).get("releaseBlockers") == [blocker]
            ),
            30,
            "v1 blocked by llama-0",
            describe,
        )
        time.sleep(3)  # the replica's other events (progress, renewals) recheck the release: still held
        v1 = get(cluster, namespace, "wv", "v1")
        assert v1 is not None and v1["status"]["phase"] == "Releasing", describe()
        assert condition(v1, "Ready")["reason"] == "ReleaseBlocked" and blocker in condition(v1, "Ready")["message"]

        # SIGKILL: the kernel closes the socket, the agent lets the lease go, and the release goes ahead.
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        wait_for(lambda: held(cluster, namespace) == [], 30, "the attachment dropped", describe)
        assert replica_status(cluster, namespace)["attachedPods"] == 0
        wait_for(lambda: get(cluster, namespace, "wv", "v1") is None, 30, "v1 released", describe)
        wait_for(lambda: engines(cluster, namespace) == ("False", "NoEngines", 0), 30, "no engines", describe)
        assert agent.alive and ml_status(cluster, namespace).get("ready") == "1/1"
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        agent.stop()


def test_attachments_outlive_an_apiserver_outage_and_an_agent_restart_and_a_restarted_agent_clears_its_predecessors(
    cluster, namespace, operator, tmp_path, socket_root
):
    paths = checkpoints(tmp_path, ("v1",))
    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    seeds = (seed_arg(namespace, "v1", paths["v1"]),)
    agent = start_agent(cluster, tmp_path, node_name, *seeds, socket_dir=socket_root)
    holder: subprocess.Popen | None = None

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + agent.log_tail(30)

    try:
        uid = engine_pod(cluster, namespace, node_name, name="llama-0")
        pod_dir = socket_root / "pods" / uid
        apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), ml_body(namespace, "v1", 1))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "1/1", 90, "1/1 ready", describe)
        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket", describe)

        # The engine attaches while the apiserver is down: the socket answers, and the status follows later.
        cluster.stop_apiserver()
        try:
            holder = consumer(pod_dir, "hold")
            assert line_of(holder, describe)["version"] == "v1"
            assert agent.alive
        finally:
            cluster.start_apiserver()
        wait_for(lambda: held(cluster, namespace) == [("llama-0", uid, "v1")], 60, "written after the outage", describe)
        wait_for(lambda: engines(cluster, namespace) == ("True", "Attached", 1), 30, "EnginesAttached", describe)

        # The agent dies (its consumers' sockets with it); llama-0 still maps v1. Its client connects to the next
        # agent and announces what it maps: that agent lists llama-0 again (its own entry: a later `since`).
        (before,) = replica_status(cluster, namespace)["attachments"]
        agent.kill()
        agent = start_agent(cluster, tmp_path, node_name, *seeds, socket_dir=socket_root)
        wait_for(
            lambda: [a["since"] > before["since"] for a in replica_status(cluster, namespace)["attachments"]] == [True],
            60,
            "llama-0 announced to the next agent",
            describe,
        )
        assert held(cluster, namespace) == [("llama-0", uid, "v1")]
        assert re.search(rf"pod {namespace}/llama-0 still maps serve v1 \(announced\)", agent.log_tail(200))
        wait_for(lambda: engines(cluster, namespace) == ("True", "Attached", 1), 30, "EnginesAttached", describe)

        # The agent dies, and llama-0 while it is down: the status still names llama-0 until an agent says
        # otherwise. The next agent of the node holds no lease of llama-0, and clears it.
        agent.kill()
        holder.kill()
        holder.wait()
        assert held(cluster, namespace) == [("llama-0", uid, "v1")]
        agent = start_agent(cluster, tmp_path, node_name, *seeds, socket_dir=socket_root)
        wait_for(lambda: held(cluster, namespace) == [], 60, "the old agent's attachment cleared", describe)
        assert replica_status(cluster, namespace)["attachedPods"] == 0
        wait_for(lambda: engines(cluster, namespace) == ("False", "NoEngines", 0), 30, "no engines", describe)
    finally:
        if not cluster.process("kube-apiserver").alive:
            cluster.start_apiserver()
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        agent.stop()
