"""Weights follow pods (ModelLoad `spec.podSelector`): operator + two agent processes + a consumer process.

A warm pool of one replica on node A (its agent holds the PeerOnly version of a tiny Llama); node B matches no
nodeSelector. A Pod object matching the podSelector, bound to node B (no kubelet runs it), makes the operator create
a replica on B, which B's agent loads from A's replica over NIXL; a consumer process with that pod's socket
directory attaches and holds sha256-identical tensors. Nodes serving the ModelLoad carry its warm-node label.
When the pod goes (graceful deletion: without a kubelet it stays Terminating), B's replica is released; while a
consumer is attached, it stays until the attachment is gone. A deleted ModelLoad leaves no node labelled warm (nor one
deleted while the operator was away).

The agent does not report attachments in WeightReplica status yet (`status.attachments`/`attachedPods`), so this
test writes them as the agent would, while its consumer really holds its lease, and clears them once the consumer
is killed; an agent that reports them writes the same values.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import save_file

from ferry.api.models import LABEL_PLACEMENT, PLACEMENT_PODS, PLACEMENT_POOL, ModelLoadEventReason, warm_node_label
from ferry_operator.modelloads import replica_name
from tests.e2e.attach_consumer import build_model, model_tensors, tensors_sha256
from tests.support.agents import node, seed_arg, start_agent, wait_phase
from tests.support.consumers import consumer, line_of
from tests.support.objects import apply, get, ml_body, ml_status, wait_for, wv_body

pytestmark = pytest.mark.e2e

ENGINE = {"app": "engine"}


def pod(cluster, namespace: str, name: str, node_name: str | None, labels: dict[str, str]) -> str:
    """A Pod object, bound to `node_name` when given (else left unscheduled: no scheduler runs); its uid."""
    spec = {"automountServiceAccountToken": False, "containers": [{"name": "engine", "image": "engine:test"}]}
    if node_name:
        spec["nodeName"] = node_name
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": spec,
    }
    # The namespace's default ServiceAccount may not exist yet (the controller makes it): admission waits for it.
    wait_for(
        lambda: cluster.kubectl("apply", "-f", "-", input=json.dumps(body), check=False).returncode == 0,
        30,
        f"pod {name} created",
    )
    return get(cluster, namespace, "pod", name)["metadata"]["uid"]


def replicas_by_node(cluster, namespace: str) -> dict[str, dict]:
    items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
    return {r["spec"]["nodeName"]: r for r in items}


def node_label(cluster, name: str, key: str) -> str | None:
    return (get(cluster, "", "node", name)["metadata"].get("labels") or {}).get(key)


def events(cluster, namespace: str, reason: str) -> list[str]:
    out = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", f"reason={reason}", "-o", "json")
    return [e["message"] for e in json.loads(out.stdout)["items"]]


def set_attachments(cluster, namespace: str, replica: str, attachments: list[dict]) -> None:
    """What the replica's agent writes about the consumers attached on its node."""
    body = {"status": {"attachments": attachments, "attachedPods": len({a["podUid"] for a in attachments})}}
    cluster.kubectl(
        "patch", "wr", replica, "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(body)
    )


@pytest.fixture
def socket_roots() -> Iterator[dict[str, Path]]:
    roots = {n: Path(tempfile.mkdtemp(prefix=f"ferry-{n}-", dir="/tmp")) for n in ("a", "b")}  # socket paths: short
    yield roots
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)


def test_a_pod_on_a_second_node_makes_it_load_over_p2p_and_serve_its_consumer(
    cluster, namespace, operator, tmp_path, socket_roots
):
    served = {n: t.detach().contiguous() for n, t in model_tensors(build_model(seed=0)).items()}
    checkpoint = tmp_path / "llama-tiny.safetensors"
    save_file(served, str(checkpoint))
    expected_sha = tensors_sha256(served)

    node_a, node_b = f"{namespace}-a", f"{namespace}-b"
    node(cluster, node_a, {"ferry.dev/pool": namespace})
    node(cluster, node_b, {"ferry.dev/pool": f"{namespace}-engines"})  # in no ModelLoad's nodeSelector
    agent_a = start_agent(
        cluster, tmp_path, node_a, seed_arg(namespace, "v1", checkpoint), socket_dir=socket_roots["a"]
    )
    agent_b = start_agent(cluster, tmp_path, node_b, socket_dir=socket_roots["b"])
    wr_a, wr_b = replica_name("serve", node_a), replica_name("serve", node_b)
    key = warm_node_label(namespace, "serve")
    procs: list[subprocess.Popen] = []

    def describe() -> str:
        return (
            json.dumps(ml_status(cluster, namespace), indent=1)
            + json.dumps(replicas_by_node(cluster, namespace), indent=1)[-3000:]
            + agent_a.log_tail(15)
            + agent_b.log_tail(30)
        )

    try:
        apply(
            cluster,
            namespace,
            wv_body(namespace, "v1", fmt="PeerOnly"),
            ml_body(namespace, "v1", 1, podSelector={"matchLabels": ENGINE}),
        )
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "1/1", 90, "the warm pool ready", describe)
        assert ml_status(cluster, namespace)["warmNodeLabel"] == key
        assert list(replicas_by_node(cluster, namespace)) == [node_a]
        assert replicas_by_node(cluster, namespace)[node_a]["metadata"]["labels"][LABEL_PLACEMENT] == PLACEMENT_POOL
        wait_for(lambda: node_label(cluster, node_a, key) == "v1", 30, "node A labelled warm", describe)
        # Pods the ModelLoad does not follow: another app's pod on B, an engine pod no scheduler has bound.
        pod(cluster, namespace, "other", node_b, {"app": "other"})
        pod(cluster, namespace, "unscheduled", None, ENGINE)

        # An engine pod bound to B: B gets a replica, which its agent copies from A's.
        uid = pod(cluster, namespace, "engine-1", node_b, ENGINE)
        wait_for(lambda: node_b in replicas_by_node(cluster, namespace), 30, "a replica on node B", describe)
        replica_b = wait_phase(cluster, namespace, wr_b, "Serving", agent_b, timeout=90)
        assert replica_b["metadata"]["labels"][LABEL_PLACEMENT] == PLACEMENT_PODS
        assert replica_b["status"]["source"] == f"peer/{wr_a}", replica_b["status"]
        assert sorted(replicas_by_node(cluster, namespace)) == [node_a, node_b]  # nothing for the other pods
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "2/2", 30, "2/2 ready", describe)
        wait_for(lambda: node_label(cluster, node_b, key) == "v1", 30, "node B labelled warm", describe)

        # The engine on B attaches through its pod's socket on B and holds the very tensors published on A.
        pod_dir = socket_roots["b"] / "pods" / uid
        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket on B", describe)
        procs.append(once := consumer(pod_dir, "once"))
        stdout, stderr = once.communicate(timeout=180)
        assert once.returncode == 0, stderr + describe()
        out = json.loads(stdout)
        assert out["version"] == "v1" and out["sha256"] == out["served_sha256"] == expected_sha

        # Scaled down: the pod terminates, nothing is attached, B's replica is released and B is no longer warm.
        cluster.kubectl("delete", "pod", "engine-1", "-n", namespace, "--wait=false")
        assert get(cluster, namespace, "pod", "engine-1")["metadata"].get("deletionTimestamp")
        wait_for(lambda: node_b not in replicas_by_node(cluster, namespace), 30, "B's replica released", describe)
        wait_for(lambda: node_label(cluster, node_b, key) is None, 30, "node B no longer warm", describe)
        assert list(replicas_by_node(cluster, namespace)) == [node_a] and node_label(cluster, node_a, key) == "v1"
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "1/1", 30, "back to the warm pool", describe)

        # Up again, and this time a consumer is attached when the pod goes: the replica stays until it lets go.
        uid = pod(cluster, namespace, "engine-2", node_b, ENGINE)
        wait_phase(cluster, namespace, wr_b, "Serving", agent_b, timeout=90)
        pod_dir = socket_roots["b"] / "pods" / uid
        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the pod's socket on B", describe)
        procs.append(holder := consumer(pod_dir, "hold"))
        assert line_of(holder, describe, timeout=180)["sha256"] == expected_sha
        attachment = {"pod": "engine-2", "podNamespace": namespace, "podUid": uid, "version": "v1"}
        set_attachments(cluster, namespace, wr_b, [attachment])
        cluster.kubectl("delete", "pod", "engine-2", "-n", namespace, "--wait=false")
        wait_for(
            lambda: any(wr_b in m for m in events(cluster, namespace, ModelLoadEventReason.REPLICA_HELD_BY_CONSUMERS)),
            30,
            "held",
            describe,
        )
        held = replicas_by_node(cluster, namespace)[node_b]
        assert not held["metadata"].get("deletionTimestamp") and held["status"]["phase"] == "Serving"

        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        set_attachments(cluster, namespace, wr_b, [])
        wait_for(lambda: node_b not in replicas_by_node(cluster, namespace), 30, "released once detached", describe)
        assert agent_a.alive and agent_b.alive, describe()

        # The ModelLoad goes: no node is warm for it any more. Nor for one that went while the operator was away.
        cluster.kubectl("delete", "ml", "serve", "-n", namespace)
        wait_for(lambda: node_label(cluster, node_a, key) is None, 30, "node A no longer warm", describe)
        orphan = warm_node_label(namespace, "deleted-long-ago")
        cluster.kubectl("label", "node", node_b, f"{orphan}=v1")
        wait_for(lambda: node_label(cluster, node_b, orphan) is None, 30, "an orphaned warm label removed", describe)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for name in ("engine-1", "engine-2", "other", "unscheduled"):
            cluster.kubectl(
                "delete", "pod", name, "-n", namespace, "--grace-period=0", "--force", "--ignore-not-found", check=False
            )
        agent_a.stop()
        agent_b.stop()
