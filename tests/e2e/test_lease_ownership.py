"""Replica Leases under the chart's real RBAC and admission policy, with agents that talk to the apiserver as the
chart's agent ServiceAccount (a TokenRequest bound to an agent Pod object on their node, as the kubelet mounts it):

- An agent replaces a replica's Lease written before the node label existed (which the policy lets no agent
  update) with its own, labelled one: after an upgrade the replica is Live again, with no manual step.
- A Lease squatted by another node's agent (labelled with that node, which the policy admits) is deleted by the
  real operator, with an Event on the ModelLoad, and the rightful agent's Lease makes the replica Live again.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from kubernetes import client
from safetensors.torch import save_file

from ferry.api.models import LABEL_NODE, ModelLoadEventReason
from ferry_agent.kube.registry import lease_body, lease_name
from ferry_dev.localcluster import LocalCluster, binary, write_kubeconfig
from ferry_operator.modelloads import replica_name
from tests.support.agents import node, replica, seed_arg, start_agent, wait_phase
from tests.support.objects import apply, get, ml_body, wait_for, wait_reason, wv_body

pytestmark = pytest.mark.e2e

CHART = Path(__file__).resolve().parents[2] / "charts" / "ferry"
APPLIED_KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


@dataclass
class Chart:
    """The chart's RBAC and admission policy for one release, serving the tenant namespace `tenant`."""

    cluster: LocalCluster
    release: str  # it contains "ferry": the chart's full name is the release name, so the agent's SA is <release>-agent
    release_ns: str
    tenant: str
    workdir: Path

    def token(self, node_name: str) -> str:
        """A token of the agent's ServiceAccount for the apiserver, bound to an agent Pod on `node_name`."""
        path = self.cluster.pod_token(
            node_name,
            f"https://127.0.0.1:{self.cluster.api_port}/",
            self.workdir / f"api-token-{node_name}",
            **self.pod(node_name),
        )
        return path.read_text()

    def pod(self, node_name: str) -> dict[str, str]:
        """The agent Pod on `node_name` that its tokens are bound to (and its worker tokens too)."""
        return {"namespace": self.release_ns, "service_account": f"{self.release}-agent", "pod": f"agent-{node_name}"}

    def kubeconfig(self, node_name: str) -> Path:
        path = self.workdir / f"agent-{node_name}.kubeconfig"
        return write_kubeconfig(path, self.cluster.server, self.cluster.pki.ca_cert, token=self.token(node_name))

    def leases(self, node_name: str) -> client.CoordinationV1Api:
        cfg = client.Configuration()
        cfg.host = self.cluster.server
        cfg.ssl_ca_cert = str(self.cluster.pki.ca_cert)
        cfg.api_key = {"authorization": f"Bearer {self.token(node_name)}"}
        return client.CoordinationV1Api(client.ApiClient(cfg))


@pytest.fixture(scope="module")
def chart(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chart]:
    suffix = uuid.uuid4().hex[:6]
    workdir = tmp_path_factory.mktemp("lease-ownership")
    c = Chart(cluster, f"ferry-lo-{suffix}", f"lo-sys-{suffix}", f"lo-tenant-{suffix}", workdir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_") and k != "KUBECONFIG"}
    env.update({f"HELM_{kind}_HOME": str(workdir / "helm" / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")})
    try:
        for ns in (c.release_ns, c.tenant):
            cluster.kubectl("create", "namespace", ns)
        out = subprocess.run(
            [
                binary("helm"),
                "template",
                c.release,
                str(CHART),
                "--kube-version",
                "1.36.3",
                "-n",
                c.release_ns,
                "--set",
                f"tenantNamespaces={{{c.tenant}}}",
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=True,
        ).stdout
        docs = [d for d in yaml.safe_load_all(out) if d and d["kind"] in APPLIED_KINDS]
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        yield c
    finally:
        kinds = "clusterrole,clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding"
        cluster.kubectl(
            "delete", kinds, "-l", f"app.kubernetes.io/instance={c.release}", "--ignore-not-found", check=False
        )
        for ns in (c.release_ns, c.tenant):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def seed_file(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(5)
    path = tmp_path / "seed.safetensors"
    save_file({f"layers.{i}.weight": torch.randn((64, 64), generator=gen) for i in range(3)}, str(path))
    return path


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def read_lease(cluster: LocalCluster, namespace: str, replica_name_: str) -> dict | None:
    return get(cluster, namespace, "lease", lease_name(replica_name_))


def policy_denies(chart: Chart, node_name: str, call) -> bool:
    """The premise, checked before the agent runs: the policy is in force for this token."""
    try:
        call(chart.leases(node_name))
    except client.ApiException as exc:
        return exc.status == 403 and "-agent-node-scope' denied request" in exc.body
    return False


def test_an_agent_replaces_a_lease_written_before_the_node_label(chart, cluster, operator, tmp_path):
    ns, node_name, name = chart.tenant, f"lo-up-{uuid.uuid4().hex[:6]}", "wr-up"
    node(cluster, node_name)
    apply(cluster, ns, wv_body(ns, "v1", fmt="PeerOnly"))
    wait_reason(cluster, ns, "v1", "Ready", "True", "Verified")
    old = lease_body(name, "agent-before-the-label", now(), 15, node=node_name)
    del old["metadata"]["labels"][LABEL_NODE]
    apply(cluster, ns, old)
    old_uid = read_lease(cluster, ns, name)["metadata"]["uid"]
    take = {"metadata": {"labels": {LABEL_NODE: node_name}}, "spec": {"holderIdentity": "x"}}
    wait_for(
        lambda: policy_denies(chart, node_name, lambda api: api.patch_namespaced_lease(lease_name(name), ns, take)),
        30,
        "the admission policy in force",
    )

    agent = start_agent(
        cluster,
        tmp_path,
        node_name,
        seed_arg(ns, "v1", seed_file(tmp_path)),
        kubeconfig=chart.kubeconfig(node_name),
        pod=chart.pod(node_name),
    )
    try:
        replica(cluster, ns, name, node_name, "v1")
        serving = wait_phase(cluster, ns, name, "Serving", agent)
        holder = serving["status"]["ranks"][0]["agentName"]

        def ours() -> dict | None:
            lease = read_lease(cluster, ns, name)
            labels = (lease or {}).get("metadata", {}).get("labels") or {}
            return lease if labels.get(LABEL_NODE) == node_name and lease["spec"]["holderIdentity"] == holder else None

        def describe() -> str:
            return json.dumps(read_lease(cluster, ns, name), indent=1) + agent.log_tail(30)

        first = wait_for(ours, 30, "the agent's own, labelled Lease", describe)
        assert first["metadata"]["uid"] != old_uid  # deleted and created again: no agent may update the old one
        assert "had no ferry.dev/node label" in agent.log_tail(200)
        # And it keeps renewing it, under the policy.
        wait_for(
            lambda: (lease := ours()) and lease["spec"]["renewTime"] > first["spec"]["renewTime"],
            30,
            "a renewal",
            describe,
        )
    finally:
        agent.stop()
        cluster.kubectl("delete", "node", node_name, "--ignore-not-found", check=False)


def test_the_operator_deletes_a_lease_squatted_by_another_node(chart, cluster, operator, tmp_path):
    ns, suffix = chart.tenant, uuid.uuid4().hex[:6]
    pool, rightful, squatter = f"lo-pool-{suffix}", f"lo-a-{suffix}", f"lo-b-{suffix}"
    node(cluster, rightful, {"ferry.dev/pool": pool})
    node(cluster, squatter)  # not in the pool: the ModelLoad places nothing there
    apply(cluster, ns, wv_body(ns, "v2", fmt="PeerOnly"))
    wait_reason(cluster, ns, "v2", "Ready", "True", "Verified")
    name = replica_name("serve", rightful)

    # Node b's agent takes the name of node a's replica before node a's agent does: labelled with its own node, the
    # policy admits it, and from then on refuses every update of it by node a's agent.
    squat = lease_body(name, "agent-of-node-b", now(), 3600, node=squatter)
    created = wait_for(lambda: _try_create(chart.leases(squatter), ns, squat), 30, "the squatter's Lease")
    take = {"metadata": {"labels": {LABEL_NODE: rightful}}, "spec": {"holderIdentity": "x"}}
    assert policy_denies(chart, rightful, lambda api: api.patch_namespaced_lease(lease_name(name), ns, take))

    agent = start_agent(
        cluster,
        tmp_path,
        rightful,
        seed_arg(ns, "v2", seed_file(tmp_path)),
        kubeconfig=chart.kubeconfig(rightful),
        pod=chart.pod(rightful),
    )

    def describe() -> str:
        return json.dumps([get(cluster, ns, "wr", name), read_lease(cluster, ns, name)], indent=1) + agent.log_tail(30)

    try:
        apply(cluster, ns, ml_body(ns, "v2", pool=pool))
        serving = wait_phase(cluster, ns, name, "Serving", agent)
        holder = serving["status"]["ranks"][0]["agentName"]

        def live() -> dict | None:
            wr = get(cluster, ns, "wr", name) or {}
            cond = next((c for c in (wr.get("status") or {}).get("conditions") or [] if c["type"] == "Live"), {})
            return wr if (cond.get("status"), cond.get("reason")) == ("True", "LeaseRenewed") else None

        wait_for(live, 60, "the replica Live again", describe)
        lease = read_lease(cluster, ns, name)
        assert lease["metadata"]["uid"] != created.metadata.uid
        assert lease["metadata"]["labels"][LABEL_NODE] == rightful and lease["spec"]["holderIdentity"] == holder
        ml = wait_for(
            lambda: (m := get(cluster, ns, "ml", "serve")) and (m.get("status") or {}).get("phase") == "Ready" and m,
            30,
            "the ModelLoad Ready",
            describe,
        )
        assert ml["status"]["ready"] == "1/1"
        reason = ModelLoadEventReason.LEASE_OF_OTHER_NODE_DELETED
        selector = f"involvedObject.kind=ModelLoad,involvedObject.name=serve,reason={reason}"
        events = json.loads(
            cluster.kubectl("get", "events", "-n", ns, "-o", "json", "--field-selector", selector).stdout
        )
        events = events["items"]
        assert events, describe()
        message = events[0]["message"]
        assert name in message and f"labelled for node {squatter}" in message and f"on node {rightful}" in message
    finally:
        cluster.kubectl("delete", "ml", "serve", "-n", ns, "--wait=false", check=False)
        agent.stop()
        cluster.kubectl("delete", "node", rightful, squatter, "--ignore-not-found", check=False)


def _try_create(api: client.CoordinationV1Api, namespace: str, body: dict) -> client.V1Lease | None:
    """RBAC and the policy take effect once the apiserver's informers see them: retried until then."""
    try:
        return api.create_namespaced_lease(namespace, body)
    except client.ApiException as exc:
        if exc.status == 403:
            return None
        raise
