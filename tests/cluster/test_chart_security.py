"""kube-score's security and reliability checks, run on `helm template` output (no kube-score binary can be built
from the Go modules available here). Each check names the kube-score test it mirrors; what the chart leaves out on
purpose is listed, with the reason, in the chart README ("Manifest checks")."""

from __future__ import annotations

import pytest

from tests.support.helm import render, sets

pytestmark = pytest.mark.cluster

VARIANTS = {
    "defaults": [],
    "rdma+hostNetwork": sets(agent__rdma__enabled="true", agent__hostNetwork="true"),
    "networkPolicy": sets(networkPolicy__enabled="true"),
}


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]


def containers(pod: dict) -> list[tuple[str, dict]]:
    return [("init", c) for c in pod.get("initContainers", [])] + [("main", c) for c in pod["containers"]]


@pytest.fixture(params=list(VARIANTS), scope="module")
def docs(request, helm_env) -> list[dict]:
    return render(helm_env, *VARIANTS[request.param])


def test_security_context(docs):
    """container-security-context-user-group-id, -privileged, -readonlyrootfilesystem; pod-seccompProfile."""
    for w in workloads(docs):
        pod = w["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for kind, c in containers(pod):
            sc = c["securityContext"]
            assert sc.get("privileged") is not True and sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert "ALL" in sc["capabilities"]["drop"], c["name"]
            if kind == "init":
                # The one root container (README: it only chowns the hostPath directories).
                assert c["name"] == "chown-host-paths" and sc["capabilities"]["add"] == ["CHOWN"]
                continue
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000 and sc["runAsGroup"] >= 10000, c["name"]
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}, c["name"]


def test_resources(docs):
    """container-resources (cpu and memory requests and limits) and container-ephemeral-storage-request-and-limit."""
    for w in workloads(docs):
        for _, c in containers(w["spec"]["template"]["spec"]):
            for bound in ("requests", "limits"):
                assert set(c["resources"][bound]) >= {"cpu", "memory", "ephemeral-storage"}, (c["name"], bound)


def test_images_and_pull_policy(docs):
    """container-image-tag (no `latest`, no untagged image) and container-image-pull-policy."""
    for w in workloads(docs):
        for _, c in containers(w["spec"]["template"]["spec"]):
            name, _, tag = c["image"].rpartition(":")
            assert name and tag and tag != "latest", c["image"]
            assert c["imagePullPolicy"] in ("Always", "IfNotPresent", "Never"), c["name"]


def test_probes(docs):
    """pod-probes: every long-running container has a readiness and a liveness probe."""
    for w in workloads(docs):
        for kind, c in containers(w["spec"]["template"]["spec"]):
            if kind == "main":
                assert "readinessProbe" in c and "livenessProbe" in c, c["name"]


def test_network_policies_select_every_pod(helm_env):
    """pod-networkpolicy, with networkPolicy.enabled: every workload's pods are selected by an Ingress policy; the
    agents admit each other on every port (ephemeral worker and UCX ports), others only on metrics."""
    docs = render(helm_env, *sets(networkPolicy__enabled="true"))
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        selecting = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert len(selecting) == 1 and selecting[0]["spec"]["policyTypes"] == ["Ingress"], w["metadata"]["name"]
    assert not [d for d in render(helm_env) if d["kind"] == "NetworkPolicy"], "NetworkPolicies are opt-in"
