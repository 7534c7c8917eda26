"""The chart through kube-score (the real binary, built by hack/build-bins.sh) on `helm template` output: no CRITICAL
finding for the variants users run. What the chart skips on purpose carries a `kube-score/ignore` annotation, is
listed with the reason in the chart README ("Manifest checks"), and is checked here by hand where the ignore would
also hide the main container."""

from __future__ import annotations

import subprocess

import pytest

from ferry_dev.localcluster import binary
from tests.support.helm import CHART, KUBE_VERSION, helm, render, sets

pytestmark = pytest.mark.cluster

VARIANTS = {
    "defaults": [],
    "rdma+hostNetwork": sets(agent__rdma__enabled="true", agent__hostNetwork="true"),
    "operator HA": sets(operator__replicas="2"),
    "pullPolicy Always, no chown": sets(image__pullPolicy="Always", agent__chownHostPaths="false"),
}
# Each ignore the chart may carry, and when (README "Manifest checks").
JUSTIFIED = {"container-image-pull-policy", "container-security-context-user-group-id"}


def kube_score(env: dict[str, str], *values: str) -> subprocess.CompletedProcess:
    manifest = helm(env, "template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, "-n", "ferry-system", *values)
    return subprocess.run(
        [binary("kube-score"), "score", "--output-format", "ci", "-"],
        input=manifest.stdout,
        capture_output=True,
        text=True,
        timeout=120,
    )


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kube_score_finds_nothing_critical(helm_env, variant):
    proc = kube_score(helm_env, *VARIANTS[variant])
    critical = [line for line in proc.stdout.splitlines() if line.startswith("[CRITICAL]")]
    assert proc.returncode == 0 and not critical, proc.stdout + proc.stderr


def test_kube_score_fails_the_chart_without_network_policies(helm_env):
    """The check above can fail: with the NetworkPolicies switched off kube-score flags both workloads."""
    proc = kube_score(helm_env, *sets(networkPolicy__enabled="false"))
    critical = [line for line in proc.stdout.splitlines() if line.startswith("[CRITICAL]")]
    assert proc.returncode == 1
    assert {line.split()[1] for line in critical} == {"ferry-agent/ferry-system", "ferry-operator/ferry-system"}
    assert all("NetworkPolicy" in line for line in critical), critical


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ignored_checks_are_the_justified_ones(helm_env, variant):
    """An ignore annotation names only JUSTIFIED checks, only when it applies; the user/group check it would hide
    for the agent container is made here, and the one root container only chowns."""
    for w in workloads(render(helm_env, *VARIANTS[variant])):
        ignored = set(filter(None, (w["metadata"].get("annotations") or {}).get("kube-score/ignore", "").split(",")))
        assert ignored <= JUSTIFIED, w["metadata"]["name"]
        pod = w["spec"]["template"]["spec"]
        pull = {c["imagePullPolicy"] for c in pod["containers"] + pod.get("initContainers", [])}
        assert ("container-image-pull-policy" in ignored) == (pull != {"Always"})
        assert ("container-security-context-user-group-id" in ignored) == bool(pod.get("initContainers"))
        for c in pod.get("initContainers", []):
            sc = c["securityContext"]
            assert c["name"] == "chown-host-paths" and sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
            assert c["command"][0] == "/bin/chown" and sc["allowPrivilegeEscalation"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] >= 10000 and sc["runAsGroup"] >= 10000, c["name"]


def test_probes_differ(helm_env):
    """Readiness and liveness ask different questions: the agent's /readyz waits for its store recovery, the
    operator's readiness only for its health port (a standby is available)."""
    for w in workloads(render(helm_env, *sets(operator__replicas="2"))):
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert c["readinessProbe"] != c["livenessProbe"], c["name"]
            if c["name"] == "agent":
                assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_network_policies_select_every_pod(helm_env):
    """pod-networkpolicy: by default every workload's pods are selected by one Ingress policy; the agents admit
    each other on every port (ephemeral worker and UCX ports), others only on metrics."""
    docs = render(helm_env)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for w in workloads(docs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        selecting = [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert len(selecting) == 1 and selecting[0]["spec"]["policyTypes"] == ["Ingress"], w["metadata"]["name"]
    off = render(helm_env, *sets(networkPolicy__enabled="false"))
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]
