"""The chart as users run it: `helm install` into a cluster with two real kubelet nodes (containerd, runc, CNI
bridges), from the daemonless dev images. The operator Deployment and the agent DaemonSet become Ready through their
probes; `ferry publish` + a ModelLoad loads a version onto both nodes (one from S3, one pod to pod from the peer);
a consumer pod attaches the served tensors through its own hostPath socket (docs/consumers.md); a deleted agent pod
comes back and its replica recovers; `helm upgrade` rolls the pods; `helm uninstall` keeps the CRDs and the custom
resources. The tests run in order and share one release."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ferry_dev import localimages
from tests.support.pods import (
    FERRY_CHART,
    create_tenant,
    describe,
    ferry_publish,
    ferry_values,
    helm,
    kubectl,
    pods,
    ready,
    wait_for,
)

pytestmark = pytest.mark.pods

NS = "ferry-system"
TENANT = "team-a"
RELEASE = "ferry"
BUCKET = "pods-models"
AGENT = "app.kubernetes.io/component=agent"
OPERATOR = "app.kubernetes.io/component=operator"
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"


def all_ready(stack) -> dict[str, list[dict]] | None:
    """The operator pod and one agent pod per node, all Ready (and no others left over)."""
    agents, operators = pods(stack, NS, AGENT), pods(stack, NS, OPERATOR)
    nodes = {p["spec"].get("nodeName") for p in agents if ready(p)}
    every_node = nodes == {n.name for n in stack.nodes.nodes}
    if len(agents) == 2 and every_node and len(operators) == 1 and ready(operators[0]):
        return {"agent": agents, "operator": operators}
    return None


@pytest.fixture(scope="module")
def release(pod_stack, tmp_path_factory):
    stack = pod_stack
    create_tenant(stack, TENANT, NS)
    for node in stack.nodes.nodes:
        kubectl(stack, "label", "node", node.name, f"ferry.dev/pool={TENANT}")
    values = ferry_values(tmp_path_factory.mktemp("values"), TENANT)
    # The local cluster applies crds/ at start: the release adopts those CRDs (as an upgrade from a chart that
    # shipped crds/ does) and then owns them.
    helm(stack, "install", RELEASE, str(FERRY_CHART), "-n", NS, "-f", str(values), "--take-ownership")
    return values


def test_install_operator_and_agents_ready_through_probes(pod_stack, release):
    stack = pod_stack
    up = wait_for(lambda: all_ready(stack), 300, "operator and 2 agents Ready", lambda: describe(stack, NS, INSTANCE))
    (op,) = up["operator"]
    container = op["spec"]["containers"][0]
    assert container["readinessProbe"]["tcpSocket"] == {"port": "healthz"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["image"] == f"ferry-operator:{stack.image_tag}"
    for agent in up["agent"]:
        (c,) = agent["spec"]["containers"]
        ready, live = c["readinessProbe"]["httpGet"], c["livenessProbe"]["httpGet"]
        assert (ready["path"], live["path"], ready["port"]) == ("/readyz", "/metrics", "metrics")
        status = agent["status"]["containerStatuses"][0]
        assert status["ready"] and status["restartCount"] == 0, status
    # Each node's hostPath store is its own, and the init container handed it to the agent's user.
    for node in stack.nodes.nodes:
        store = node.host_path("/var/lib/ferry/checkpoints")
        assert store.is_dir() and store.stat().st_uid == localimages.UID
        # Setgid and group-writable, so a pods/<uid> the kubelet makes first is the agent's (docs/consumers.md).
        for sockets in (node.host_path("/run/ferry"), node.host_path("/run/ferry/pods")):
            assert sockets.stat().st_mode & 0o7777 == 0o2775, sockets


def make_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal((64, 64)).astype(np.float32) for i in range(4)}


def publish(stack, tmp: Path, version: str, seed: int) -> dict[str, np.ndarray]:
    weights = make_weights(seed)
    source = tmp / f"{version}.safetensors"
    save_file(weights, str(source))
    ferry_publish(
        stack,
        source,
        version=version,
        model="m",
        bucket=BUCKET,
        tenant=TENANT,
        describe=lambda: describe(stack, NS, INSTANCE),
    )
    return weights


def replicas(stack) -> list[dict]:
    return json.loads(kubectl(stack, "get", "weightreplicas", "-n", TENANT, "-o", "json"))["items"]


def completed_since(status: dict, since: datetime | None) -> bool:
    done = status.get("completedTime")
    return since is None or (done is not None and datetime.fromisoformat(done.replace("Z", "+00:00")) >= since)


def loaded(stack, version: str, count: int, since: datetime | None = None) -> list[dict] | None:
    """The replicas Serving `version`, when there are `count` (each loaded at or after `since`)."""
    items = [
        r
        for r in replicas(stack)
        if (status := r.get("status") or {}).get("phase") == "Serving"
        and status.get("version") == version
        and completed_since(status, since)
    ]
    return items if len(items) == count else None


def modelload(stack, version: str, count: int) -> None:
    body = {
        "apiVersion": "ferry.dev/v1alpha1",
        "kind": "ModelLoad",
        "metadata": {"name": "serve", "namespace": TENANT},
        "spec": {
            "modelName": "m",
            "desiredVersion": version,
            "replicas": count,
            "device": "cpu",
            "nodeSelector": {"ferry.dev/pool": TENANT},
            "transfer": {"timeoutSeconds": 60},
        },
    }
    kubectl(stack, "apply", "-f", "-", input=json.dumps(body))


def test_modelload_loads_onto_both_nodes_from_s3_then_from_the_peer(pod_stack, release, tmp_path):
    stack = pod_stack
    publish(stack, tmp_path, "v1", seed=1)
    modelload(stack, "v1", 1)
    (first,) = wait_for(lambda: loaded(stack, "v1", 1), 240, "v1 on one node", lambda: describe(stack, NS, INSTANCE))
    assert first["status"]["source"] == "s3", first["status"]
    modelload(stack, "v1", 2)
    both = wait_for(lambda: loaded(stack, "v1", 2), 240, "v1 on both nodes", lambda: describe(stack, NS, INSTANCE))
    second = next(r for r in both if r["metadata"]["name"] != first["metadata"]["name"])
    assert second["status"]["source"] == f"peer/{first['metadata']['name']}", second["status"]
    assert {r["spec"]["nodeName"] for r in both} == {n.name for n in stack.nodes.nodes}
    assert all(r["status"]["bytesDone"] > 0 for r in both), [r["status"] for r in both]


# The consumer pod's program: attach the ModelLoad through this pod's socket, hash every tensor's bytes in name
# order, and report what of the node's attach directory it can see.
CONSUMER = r"""
import errno, hashlib, json, os
import torch
from ferry.client import attach

d = os.environ["FERRY_SOCKET_DIR"]
others = os.environ["OTHER_POD_UIDS"].split()
seen = {"listing": sorted(os.listdir(d)),
        "others": [q for u in others for q in (f"{d}/../{u}", f"{d}/../pods/{u}", f"/run/ferry/pods/{u}")
                   if os.path.lexists(q)]}
try:
    open(f"{d}/written", "w").close()
    seen["write"] = "ok"
except OSError as exc:
    seen["write"] = errno.errorcode.get(exc.errno, str(exc.errno))
with attach("serve", timeout=120) as w:
    h = hashlib.sha256()
    tensors = w.tensors()
    for name in sorted(tensors):
        h.update(name.encode() + b"\0" + tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    seen.update(version=w.version, model_load=w.model_load, tensors=len(tensors), sha256=h.hexdigest())
print("RESULT " + json.dumps(seen), flush=True)
"""


def tensors_sha256(weights: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode() + b"\0" + np.ascontiguousarray(weights[name]).tobytes())
    return h.hexdigest()


def consumer_pod(image: str, node: str, other_uids: list[str]) -> dict:
    """An engine pod as docs/consumers.md (and the ferry-consumer chart) give it: the agent's hostPath, of which
    the container mounts only pods/$(POD_UID), read-only; from the agent's dev image (torch and ferry.client)."""
    dev = localimages.dev_chart_values()["agent"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "consumer", "namespace": TENANT, "labels": {"app": "consumer"}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "runAsUser": localimages.UID, "runAsGroup": localimages.GID},
            "containers": [
                {
                    "name": "engine",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "args": ["python", "-c", CONSUMER],
                    "env": [
                        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
                        {"name": "FERRY_SOCKET_DIR", "value": "/run/ferry"},
                        {"name": "OTHER_POD_UIDS", "value": " ".join(other_uids)},
                    ],
                    "volumeMounts": [
                        {
                            "name": "ferry",
                            "mountPath": "/run/ferry",
                            "subPathExpr": "pods/$(POD_UID)",
                            "readOnly": True,
                        },
                        *dev["extraVolumeMounts"],
                    ],
                    "resources": {
                        "requests": {"cpu": "50m", "memory": "128Mi"},
                        "limits": {"cpu": "1", "memory": "1Gi"},
                    },
                    "securityContext": {
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            "volumes": [
                {"name": "ferry", "hostPath": {"path": "/run/ferry", "type": "Directory"}},
                *dev["extraVolumes"],
            ],
        },
    }


def test_consumer_pod_attaches_through_its_own_hostpath_socket(pod_stack, release):
    stack = pod_stack
    (replica, *_) = wait_for(
        lambda: loaded(stack, "v1", 2), 240, "v1 on both nodes", lambda: describe(stack, NS, INSTANCE)
    )
    node = stack.nodes.node(replica["spec"]["nodeName"])
    # The node's attach directory holds other pods' sockets (the agent serves every pod on its node): the
    # consumer must see none of them.
    pods_dir = node.host_path("/run/ferry") / "pods"
    other_uids = sorted(p.name for p in pods_dir.iterdir())
    assert other_uids and all((pods_dir / u / "ferry.sock").is_socket() for u in other_uids), other_uids
    kubectl(
        stack,
        "apply",
        "-f",
        "-",
        input=json.dumps(consumer_pod(f"ferry-agent:{stack.image_tag}", node.name, other_uids)),
    )

    def finished() -> str | None:
        pod = json.loads(kubectl(stack, "get", "pod", "consumer", "-n", TENANT, "-o", "json"))
        phase = (pod.get("status") or {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    def logs() -> str:
        return kubectl(stack, "logs", "-n", TENANT, "consumer", check=False)

    try:
        done = wait_for(
            finished, 240, "the consumer pod to finish", lambda: f"{describe(stack, NS, INSTANCE)}\n{logs()}"
        )
        out = logs()
        assert done == "Succeeded", out
        (line,) = [x for x in out.splitlines() if x.startswith("RESULT ")]
        seen = json.loads(line.removeprefix("RESULT "))
        assert (seen["version"], seen["model_load"], seen["tensors"]) == ("v1", "serve", 4), seen
        assert seen["sha256"] == tensors_sha256(make_weights(seed=1)), seen
        # Its mount is its own directory, read-only: only its socket, no other pod's directory, no writes.
        assert seen["listing"] == ["ferry.sock"], seen
        assert seen["others"] == [] and seen["write"] == "EROFS", seen
    finally:
        kubectl(stack, "delete", "pod", "consumer", "-n", TENANT, "--wait=true", "--timeout=120s", check=False)


def lease_holders(stack, node: str) -> set[str]:
    out = kubectl(stack, "get", "leases", "-n", TENANT, "-l", f"ferry.dev/node={node}", "-o", "json")
    return {i["spec"].get("holderIdentity") or "" for i in json.loads(out)["items"]}


def test_deleted_agent_pod_comes_back_and_its_replica_recovers(pod_stack, release):
    stack = pod_stack
    node = stack.nodes.nodes[1].name
    (victim,) = [p for p in pods(stack, NS, AGENT) if p["spec"]["nodeName"] == node]
    old_holders = lease_holders(stack, node)  # the agent's name: <node>-<random>, new in each process
    assert old_holders
    deleted_at = datetime.now(UTC).replace(microsecond=0)
    kubectl(stack, "delete", "pod", "-n", NS, victim["metadata"]["name"], "--wait=true", "--timeout=120s")

    def back():
        up = all_ready(stack)
        return up and all(p["metadata"]["uid"] != victim["metadata"]["uid"] for p in up["agent"])

    wait_for(back, 240, "a new agent pod on the node Ready", lambda: describe(stack, NS, INSTANCE))

    def recovered():
        (replica,) = [r for r in replicas(stack) if r["spec"]["nodeName"] == node]
        status = replica.get("status") or {}
        holders = lease_holders(stack, node)
        # Loaded again after the deletion, its liveness Lease held by the new pod's agent.
        return (
            status.get("phase") == "Serving"
            and status.get("version") == "v1"
            and completed_since(status, deleted_at)
            and holders
            and not holders & old_holders
        )

    wait_for(recovered, 240, f"the replica on {node} Ready under the new agent", lambda: describe(stack, NS, INSTANCE))


def test_upgrade_with_changed_values_rolls_the_pods(pod_stack, release, tmp_path):
    stack = pod_stack
    before = {p["metadata"]["uid"] for p in pods(stack, NS, INSTANCE)}
    values = ferry_values(tmp_path, TENANT, agent__leaseSeconds=20, operator__logFormat="plain")
    upgraded_at = datetime.now(UTC).replace(microsecond=0)
    helm(stack, "upgrade", RELEASE, str(FERRY_CHART), "-n", NS, "-f", str(values))

    def rolled():
        up = all_ready(stack)
        pods_now = (up or {}).get("agent", []) + (up or {}).get("operator", [])
        return up if pods_now and not before & {p["metadata"]["uid"] for p in pods_now} else None

    up = wait_for(rolled, 300, "every pod replaced and Ready", lambda: describe(stack, NS, INSTANCE))
    assert all("--lease-seconds=20" in p["spec"]["containers"][0]["command"] for p in up["agent"])
    assert "--log-format=plain" in up["operator"][0]["spec"]["containers"][0]["command"]
    # The new agents load v1 again (from their node's store or the peer) and serve it.
    wait_for(
        lambda: loaded(stack, "v1", 2, upgraded_at),
        240,
        "both replicas reloaded",
        lambda: describe(stack, NS, INSTANCE),
    )


def test_uninstall_keeps_crds_and_custom_resources(pod_stack, release):
    stack = pod_stack
    helm(stack, "uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "180s")
    wait_for(lambda: not pods(stack, NS, INSTANCE), 180, "the release's pods gone")
    for crd in ("weightversions.ferry.dev", "modelloads.ferry.dev", "weightreplicas.ferry.dev"):
        kubectl(stack, "get", "crd", crd)
    kubectl(stack, "get", "weightversion", "v1", "-n", TENANT)
    kubectl(stack, "get", "modelload", "serve", "-n", TENANT)
