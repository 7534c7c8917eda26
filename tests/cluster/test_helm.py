"""The Helm chart (charts/ferry) against the real `helm` binary and the real kube-apiserver.

- `helm lint` passes; the values schema is closed (unknown keys fail) and typed.
- Every rendered object is accepted by the apiserver (`kubectl apply --dry-run=server`).
- `helm install` deploys the objects and the CRDs, `helm upgrade` upgrades the CRDs, and `helm uninstall` removes
  the objects but keeps the CRDs (`helm.sh/resource-policy: keep`) and the custom resources.
- The agent's ServiceAccount is least-privilege, proven with `kubectl auth can-i` and with real requests that
  authenticate as that ServiceAccount (a TokenRequest token; RBAC authorization is on).

There are no kubelets, so nothing here waits for pods (`helm install --wait` would hang).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from ferry import ambient
from ferry.api import crdgen, models
from ferry_dev.localcluster import LocalCluster, binary, wait_until, write_kubeconfig
from tests.support.helm import CHART, KUBE_VERSION, helm, render, sets

pytestmark = pytest.mark.cluster

CRD_NAMES = ("weightversions.ferry.dev", "modelloads.ferry.dev", "weightreplicas.ferry.dev")
CLUSTER_SCOPED = (
    "clusterrole,clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding,"
    "mutatingadmissionpolicy,mutatingadmissionpolicybinding"
)


# ---------------------------------------------------------------- helpers


@contextlib.contextmanager
def release(cluster: LocalCluster, env: dict[str, str], namespace: str, *values: str) -> Iterator[str]:
    """`helm install` a uniquely named release; uninstall (and sweep cluster-scoped leftovers) on the way out."""
    name = f"ferry-{namespace}"
    kube = ["--kubeconfig", str(cluster.kubeconfig), "-n", namespace]
    try:
        # The test cluster applies crds/ at start, and a release before this one may have left them (keep): adopt
        # them, as an upgrade from a chart that shipped crds/ does.
        helm(env, "install", name, str(CHART), *kube, "--take-ownership", *values)
        yield name
    finally:
        helm(env, "uninstall", name, *kube, check=False)
        selector = f"app.kubernetes.io/instance={name}"
        cluster.kubectl("delete", CLUSTER_SCOPED, "-l", selector, "--ignore-not-found", check=False)


def exists(cluster: LocalCluster, kind: str, name: str, namespace: str | None = None) -> bool:
    ns = ["-n", namespace] if namespace else []
    proc = cluster.kubectl("get", kind, name, *ns, "-o", "name", check=False)
    if proc.returncode != 0 and "NotFound" not in proc.stderr:
        raise AssertionError(f"kubectl get {kind} {name}: {proc.stderr}")
    return proc.returncode == 0


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    kinds: dict[str, list[dict]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


# ---------------------------------------------------------------- static: lint, schema, render

# Everything that observes Ferry: the monitors (Prometheus operator CRDs), the agent metrics Service, dashboards.
MONITORING = sets(
    operator__metrics__serviceMonitor__enabled="true",
    operator__metrics__serviceMonitor__interval="30s",
    agent__metrics__serviceMonitor__enabled="true",
    agent__metrics__podMonitor__enabled="true",
    agent__metrics__podMonitor__labels__release="kube-prometheus",
    grafana__dashboards__enabled="true",
)


def test_helm_lint_passes(helm_env):
    for values in (
        [],
        sets(agent__rdma__enabled="true", agent__hostNetwork="true", operator__metrics__enabled="false"),
        MONITORING,
    ):
        proc = helm(helm_env, "lint", "--strict", str(CHART), *values)
        assert "0 chart(s) failed" in proc.stdout, proc.stdout


def _object_nodes(schema: dict, path: str, root: dict) -> Iterator[tuple[str, dict]]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        yield from _object_nodes(root["definitions"][name], f"{path}->{name}", root)
        return
    if schema.get("type") == "object":
        yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _object_nodes(sub, f"{path}.{key}", root)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _object_nodes(schema[key], f"{path}[{key}]", root)
    for sub in schema.get("oneOf", []):
        yield from _object_nodes(sub, path, root)


def test_values_schema_is_closed_at_every_level():
    """Objects with named keys forbid others; free-form maps (labels, annotations, resources) type their values."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    nodes = list(_object_nodes(schema, "$", schema))
    assert len(nodes) > 20
    for path, node in nodes:
        if path == "$.global":  # Helm's parent-chart channel; must stay open.
            continue
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} accepts unknown keys"
        else:
            assert isinstance(node.get("additionalProperties"), dict), f"{path} is an untyped free-form object"
    # Every key in values.yaml is described by the schema (otherwise the defaults themselves would be rejected,
    # which `helm lint` above also proves).
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults) <= set(schema["properties"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (sets(iamge__tag="x"), "at '': additional properties 'iamge' not allowed"),
        (sets(agent__iamge="x"), "at '/agent': additional properties 'iamge' not allowed"),
        (sets(operator__config__resyncSecs="5"), "at '/operator/config': additional properties 'resyncSecs'"),
        (sets(agent__rdma__enable="true"), "at '/agent/rdma': additional properties 'enable' not allowed"),
        (sets(image__pullPolicy="Sometimes"), "at '/image/pullPolicy': value must be one of"),
        (sets(operator__logFormat="xml"), "at '/operator/logFormat': value must be one of"),
        (sets(agent__leaseSeconds="soon"), "at '/agent/leaseSeconds': got string, want integer"),
        (sets(agent__hostNetwork="maybe"), "at '/agent/hostNetwork': got string, want boolean"),
        (sets(operator__metrics__port="70000"), "at '/operator/metrics/port'"),
        (sets(operator__replicas="0"), "at '/operator/replicas'"),
        (sets(operator__leaderElection__retryPeriodSeconds="0"), "at '/operator/leaderElection/retryPeriodSeconds'"),
        (sets(agent__metrics__podMonitor__interval="often"), "at '/agent/metrics/podMonitor/interval'"),
        (sets(grafana__dashboards__folder="x"), "at '/grafana/dashboards': additional properties 'folder'"),
        (["--set", "agent.tolerations[0].keyy=x"], "at '/agent/tolerations/0': additional properties 'keyy'"),
        (["--set-string", "agent.ucx.extraEnv.LD_PRELOAD=x"], "invalid propertyName 'LD_PRELOAD'"),
        (sets(agent__runtimeClassName="Nvidia_Runtime"), "at '/agent/runtimeClassName'"),
        (sets(agent__affinity__nodeAfinity__x="y"), "at '/agent/affinity': additional properties 'nodeAfinity'"),
        (sets(agent__gpus__visibleDevices="0;1"), "at '/agent/gpus/visibleDevices'"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_values_schema_rejects_bad_values(helm_env, values, message):
    proc = helm(helm_env, "template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, *values, check=False)
    assert proc.returncode != 0, proc.stdout[:500]
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def test_chart_refuses_kubernetes_older_than_1_30(helm_env):
    """1.30: ValidatingAdmissionPolicy v1 and the node name in Pod-bound ServiceAccount tokens."""
    proc = helm(helm_env, "template", "ferry", str(CHART), "--kube-version", "1.29.9", check=False)
    assert proc.returncode != 0
    assert "incompatible with Kubernetes v1.29.9" in proc.stderr, proc.stderr


def test_crds_render_behind_crds_enabled_and_keep(helm_env):
    """The chart renders each generated CRD once (templates/crds.yaml), kept on uninstall unless crds.keep=false;
    crds.enabled=false renders none."""
    crds = by_kind(render(helm_env))["CustomResourceDefinition"]
    for crd in crds:
        assert crd["metadata"].pop("annotations") == {"helm.sh/resource-policy": "keep"}
        assert crd["metadata"].pop("labels")["app.kubernetes.io/managed-by"] == "Helm"
    assert sorted(crds, key=lambda c: c["metadata"]["name"]) == sorted(
        (crdgen.crd(m) for m in models.RESOURCES), key=lambda c: c["metadata"]["name"]
    )
    unkept = by_kind(render(helm_env, *sets(crds__keep="false")))["CustomResourceDefinition"]
    assert len(unkept) == 3 and not any("annotations" in c["metadata"] for c in unkept)
    assert "CustomResourceDefinition" not in by_kind(render(helm_env, *sets(crds__enabled="false")))


def test_rendered_objects(helm_env):
    docs = by_kind(render(helm_env))
    assert {k: len(v) for k, v in docs.items()} == {
        "CustomResourceDefinition": 3,
        "ServiceAccount": 2,
        "ClusterRole": 4,
        "ClusterRoleBinding": 2,
        "Role": 2,
        "RoleBinding": 2,
        "Service": 1,
        "Deployment": 1,
        "DaemonSet": 1,
        "ValidatingAdmissionPolicy": 2,
        "ValidatingAdmissionPolicyBinding": 2,
        "NetworkPolicy": 2,
    }
    for obj in (o for objs in docs.values() for o in objs):
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "ferry" and labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["helm.sh/chart"] == "ferry-0.1.0" and labels["app.kubernetes.io/name"] == "ferry"

    (deploy,) = docs["Deployment"]
    assert deploy["spec"]["replicas"] == 1
    (op,) = deploy["spec"]["template"]["spec"]["containers"]
    assert op["command"][:9] == [
        "python",
        "-m",
        "kopf",
        "run",
        "--standalone",
        "--all-namespaces",
        "-m",
        "ferry_operator.main",
        "--log-format=json",
    ]
    assert "--liveness=http://0.0.0.0:8081/healthz" in op["command"]
    assert op["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    env = {e["name"]: e.get("value") or e["valueFrom"] for e in op["env"]}
    assert env["FERRY_METRICS_PORT"] == "8080" and env["FERRY_VERIFY_CONCURRENCY"] == "16"
    # One replica, still with leader election: an upgrade's new Pod stands by until the old one hands over.
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    assert env["FERRY_LEADER_ELECTION"] == "true" and env["FERRY_LEADER_ELECTION_LEASE"] == "ferry-operator"
    assert env["FERRY_LEADER_ELECTION_NAMESPACE"] == "ferry-system"
    assert env["FERRY_LEADER_ELECTION_IDENTITY"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["FERRY_STANDBY_HEALTHZ"] == "http://0.0.0.0:8081/healthz", "the same endpoint as kopf's --liveness"
    assert "affinity" not in deploy["spec"]["template"]["spec"] and "PodDisruptionBudget" not in docs
    assert {p["name"]: p["containerPort"] for p in op["ports"]} == {"metrics": 8080, "healthz": 8081}
    (svc,) = docs["Service"]
    assert svc["spec"]["ports"][0]["port"] == 8080
    assert svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]

    (ds,) = docs["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"ferry.dev/gpu": "true"}
    assert pod["tolerations"] and pod["serviceAccountName"] == "ferry-agent"
    (agent,) = pod["containers"]
    node_env = next(e for e in agent["env"] if e["name"] == "NODE_NAME")
    assert node_env["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert agent["resources"]["requests"]["memory"] == "2Gi"
    assert {p["name"] for p in agent["ports"]} == {"metrics"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["checkpoint-store"]["hostPath"]["path"] == "/var/lib/ferry/checkpoints"
    assert "rdma-devices" not in volumes, "RDMA devices must be opt-in"
    # Worker tokens: minted per source (TokenRequest) for the Pod the downward API names; no shared token volume.
    fields = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"] if "valueFrom" in e}
    assert {k: fields[k] for k in ("POD_NAMESPACE", "SERVICE_ACCOUNT", "POD_NAME", "POD_UID")} == {
        "POD_NAMESPACE": "metadata.namespace",
        "SERVICE_ACCOUNT": "spec.serviceAccountName",
        "POD_NAME": "metadata.name",
        "POD_UID": "metadata.uid",
    }
    # Engine pods' attach sockets: a hostPath directory, the same path inside (`--socket-dir` defaults to it).
    assert volumes["attach"]["hostPath"] == {"path": "/run/ferry", "type": "DirectoryOrCreate"}
    assert {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}["attach"] == "/run/ferry"
    assert set(volumes) == {"tmp", "checkpoint-store", "attach"}
    (role,) = [r for r in docs["Role"] if r["metadata"]["name"] == "ferry-agent-worker-token"]
    assert role["metadata"]["namespace"] == "ferry-system" and role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["serviceaccounts/token"],
            "resourceNames": ["ferry-agent"],
            "verbs": ["create"],
        }
    ]
    (binding,) = [b for b in docs["RoleBinding"] if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ferry-agent", "namespace": "ferry-system"}]

    # RDMA on: /dev/infiniband is mounted and IPC_LOCK added; UCX settings reach the env.
    rdma = by_kind(
        render(
            helm_env, *sets(agent__rdma__enabled="true", agent__ucx__netDevices="mlx5_0:1", agent__leaseSeconds="20")
        )
    )
    (agent,) = rdma["DaemonSet"][0]["spec"]["template"]["spec"]["containers"]
    volumes = {v["name"]: v for v in rdma["DaemonSet"][0]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["rdma-devices"]["hostPath"]["path"] == "/dev/infiniband"
    assert {"name": "rdma-devices", "mountPath": "/dev/infiniband"} in agent["volumeMounts"]
    assert "IPC_LOCK" in agent["securityContext"]["capabilities"]["add"]
    assert {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"} in agent["env"]
    assert "--lease-seconds=20" in agent["command"]


GPU_NODE_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100"]}]}
            ]
        }
    }
}
GPU_NODE_VALUES = [
    *sets(agent__runtimeClassName="nvidia", operator__runtimeClassName="runc-sandboxed", operator__replicas="2"),
    "--set-json",
    f"agent.affinity={json.dumps(GPU_NODE_AFFINITY)}",
    "--set-json",
    f"operator.affinity={json.dumps(GPU_NODE_AFFINITY)}",
    "--set-json",
    'agent.resources.limits={"nvidia.com/gpu": 1, "memory": "8Gi"}',
]


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """kind -> pod template spec, of the DaemonSet and the Deployment."""
    return {d["kind"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("DaemonSet", "Deployment")}


def test_gpu_nodes_get_their_runtime_class_affinity_and_devices(helm_env):
    """What GPU nodes need: a RuntimeClass, an affinity (the operator's replaces its default anti-affinity), GPU
    resources, and the devices the NVIDIA runtime shows the agent without a device-plugin request by default."""
    pods = pod_specs(render(helm_env, *GPU_NODE_VALUES))
    agent, operator = pods["DaemonSet"], pods["Deployment"]
    assert agent["runtimeClassName"] == "nvidia" and operator["runtimeClassName"] == "runc-sandboxed"
    assert agent["affinity"] == GPU_NODE_AFFINITY and operator["affinity"] == GPU_NODE_AFFINITY
    container = agent["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"

    defaults = pod_specs(render(helm_env, *sets(operator__replicas="2")))
    assert "runtimeClassName" not in defaults["DaemonSet"] and "affinity" not in defaults["DaemonSet"]
    assert "podAntiAffinity" in defaults["Deployment"]["affinity"]  # two operators spread over nodes by default
    off = render(helm_env, "--set", "agent.gpus.visibleDevices=", "--set", "agent.gpus.driverCapabilities=")
    env = {
        e["name"]
        for d in off
        if d["kind"] == "DaemonSet"
        for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert not env & {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}


def test_the_release_finalizer_policy_renders_where_the_api_is_served(helm_env):
    """A MutatingAdmissionPolicy (admissionregistration.k8s.io/v1, Kubernetes 1.36) only where the cluster serves
    it, and not when turned off; the operator adds the finalizer itself without it."""
    served = ("--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy")
    docs = by_kind(render(helm_env, *served))
    (policy,) = docs["MutatingAdmissionPolicy"]
    (binding,) = docs["MutatingAdmissionPolicyBinding"]
    assert (
        binding["spec"]
        == {"policyName": policy["metadata"]["name"]}
        == {"policyName": "ferry-operator-release-finalizer"}
    )
    assert policy["spec"]["failurePolicy"] == "Ignore", "a policy that cannot run must not block a publish"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["CREATE"] and rule["resources"] == ["weightversions"]
    assert "MutatingAdmissionPolicy" not in by_kind(render(helm_env))  # an older cluster (helm's defaults)
    off = by_kind(render(helm_env, *served, *sets(operator__releaseFinalizerPolicy="false")))
    assert "MutatingAdmissionPolicy" not in off and "MutatingAdmissionPolicyBinding" not in off


def test_monitoring_objects_scrape_the_metrics_ports_and_ship_the_dashboards(helm_env):
    assert not {"ServiceMonitor", "PodMonitor", "ConfigMap"} & set(by_kind(render(helm_env))), "off by default"
    docs = by_kind(render(helm_env, *MONITORING))
    deploy, (ds,) = docs["Deployment"][0], docs["DaemonSet"]
    monitors = {m["metadata"]["name"]: m for m in docs["ServiceMonitor"]}
    services = {s["metadata"]["name"]: s for s in docs["Service"]}
    # Each ServiceMonitor selects exactly its component's metrics Service, on the port the container names.
    for monitor, service, pods in (
        ("ferry-operator", "ferry-operator-metrics", deploy),
        ("ferry-agent", "ferry-agent-metrics", ds),
    ):
        spec = monitors[monitor]["spec"]
        selected = [
            n for n, s in services.items() if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert selected == [service]
        assert services[service]["spec"]["selector"] == pods["spec"]["selector"]["matchLabels"]
        (endpoint,) = spec["endpoints"]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics" and endpoint["honorLabels"] is True
        assert spec["namespaceSelector"] == {"matchNames": ["ferry-system"]}
        (container,) = pods["spec"]["template"]["spec"]["containers"]
        assert "metrics" in {p["name"] for p in container["ports"]}
    assert monitors["ferry-operator"]["spec"]["endpoints"][0]["interval"] == "30s"
    assert services["ferry-agent-metrics"]["spec"]["clusterIP"] == "None", "one scrape target per agent"
    (pod_monitor,) = docs["PodMonitor"]
    assert pod_monitor["spec"]["selector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    assert pod_monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # The dashboards travel byte for byte, labelled for the Grafana sidecar.
    (dashboards,) = docs["ConfigMap"]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = {p.name: p.read_text() for p in (CHART / "dashboards").glob("*.json")}
    assert {k: json.loads(v) for k, v in dashboards["data"].items()} == {k: json.loads(v) for k, v in shipped.items()}
    # The agent metrics Service alone, without the Prometheus operator.
    alone = by_kind(render(helm_env, *sets(agent__metrics__service__enabled="true")))
    assert sorted(s["metadata"]["name"] for s in alone["Service"]) == ["ferry-agent-metrics", "ferry-operator-metrics"]
    assert "ServiceMonitor" not in alone


def test_two_operator_replicas_elect_a_leader(helm_env):
    docs = by_kind(render(helm_env, *sets(operator__replicas="2")))
    (deploy,) = docs["Deployment"]
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    (pdb,) = docs["PodDisruptionBudget"]
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    (term,) = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"] == {
        "topologyKey": "kubernetes.io/hostname",
        "labelSelector": {"matchLabels": selector},
    }
    # The Lease: create (RBAC cannot name what does not exist yet), and get/update of that one name only.
    (role,) = [r for r in docs["Role"] if r["metadata"]["name"] == "ferry-operator-leader-election"]
    assert role["metadata"]["namespace"] == "ferry-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["ferry-operator"],
            "verbs": ["get", "update"],
        },
    ]
    (binding,) = [b for b in docs["RoleBinding"] if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ferry-operator", "namespace": "ferry-system"}]


def test_without_leader_election_one_operator_runs(helm_env):
    docs = by_kind(render(helm_env, *sets(operator__leaderElection__enabled="false")))
    (deploy,) = docs["Deployment"]
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    (op,) = deploy["spec"]["template"]["spec"]["containers"]
    assert not any(e["name"].startswith("FERRY_LEADER_ELECTION") for e in op["env"])
    assert all(r["metadata"]["name"] != "ferry-operator-leader-election" for r in docs["Role"])
    proc = helm(
        helm_env,
        "template",
        "ferry",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *sets(operator__leaderElection__enabled="false", operator__replicas="2"),
        check=False,
    )
    assert proc.returncode != 0 and "operator.replicas > 1 needs operator.leaderElection.enabled" in proc.stderr


def test_cluster_scoped_names_include_the_release(helm_env):
    docs = render(helm_env, release="blue")
    for obj in docs:
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["name"].startswith("blue-"), obj["metadata"]["name"]


def test_tenant_namespaces_get_role_bindings_and_nothing_reads_secrets_cluster_wide(helm_env):
    docs = by_kind(render(helm_env, "--set", "tenantNamespaces={team-a,team-b}", "--set", "agent.secretNames={s3}"))
    bindings = {
        (b["metadata"]["namespace"], b["metadata"]["name"]): b
        for b in docs["RoleBinding"]
        if b["roleRef"]["kind"] == "ClusterRole"
    }
    assert set(bindings) == {(ns, f"ferry-{c}") for ns in ("team-a", "team-b") for c in ("agent", "operator")}
    for (_, name), binding in bindings.items():
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": f"{name}-tenant",
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "ferry-system"}]
    roles = {r["metadata"]["name"]: r["rules"] for r in docs["ClusterRole"]}
    bound_cluster_wide = {b["roleRef"]["name"] for b in docs["ClusterRoleBinding"]}
    assert bound_cluster_wide == {"ferry-agent", "ferry-operator"}
    for name in bound_cluster_wide:
        writes = {"create", "update", "patch", "delete"}
        assert not any(
            "secrets" in r["resources"] or ("leases" in r["resources"] and writes & set(r["verbs"]))
            for r in roles[name]
        ), f"{name} reads Secrets or writes Leases cluster-wide"
    assert {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["s3"]} in roles[
        "ferry-agent-tenant"
    ]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["delete"]} in roles[
        "ferry-operator-tenant"
    ]
    # Weights follow pods: the operator lists and watches Pods in tenant namespaces, nowhere else.
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]} in roles["ferry-operator-tenant"]
    assert not any("pods" in r["resources"] for r in roles["ferry-operator"])
    # Tenants listed by name share the ClusterRoles: the Roles are the agent's own, for minting worker tokens, and
    # the operator's, for its leader-election Lease.
    assert [r["metadata"]["name"] for r in docs["Role"]] == [
        "ferry-agent-worker-token",
        "ferry-operator-leader-election",
    ]
    # No tenant namespaces: no RoleBinding but those Roles' in the release namespace.
    assert [b["roleRef"]["kind"] for b in by_kind(render(helm_env))["RoleBinding"]] == ["Role", "Role"]


def test_a_tenant_namespace_may_list_its_own_secret_names(helm_env, tmp_path):
    """`{name, secretNames}`: a Role per component in that namespace, Secrets limited to those names for the agent and
    the operator; a plain name keeps the shared ClusterRole (any Secret, or the deprecated agent.secretNames)."""
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "tenantNamespaces": [
                    "team-a",
                    {"name": "team-b", "secretNames": ["s3-b"]},
                    {"name": "team-c", "secretNames": ["s3-c", "s3-c2"]},
                ]
            }
        )
    )
    docs = by_kind(render(helm_env, "-f", str(values)))
    refs = {(b["metadata"]["namespace"], b["metadata"]["name"]): b["roleRef"] for b in docs["RoleBinding"]}
    for component in ("agent", "operator"):
        assert refs[("team-a", f"ferry-{component}")]["kind"] == "ClusterRole"
        for ns in ("team-b", "team-c"):
            assert refs[(ns, f"ferry-{component}")] == {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": f"ferry-{component}-tenant",
            }
    own = ("ferry-agent-worker-token", "ferry-operator-leader-election")  # in the release namespace
    roles = {
        (r["metadata"]["namespace"], r["metadata"]["name"]): r["rules"]
        for r in docs["Role"]
        if r["metadata"]["name"] not in own
    }
    assert set(roles) == {(ns, f"ferry-{c}-tenant") for ns in ("team-b", "team-c") for c in ("agent", "operator")}
    cluster_roles = {r["metadata"]["name"]: r["rules"] for r in docs["ClusterRole"]}
    for component in ("agent", "operator"):
        shared = cluster_roles[f"ferry-{component}-tenant"]
        for ns, names in (("team-b", ["s3-b"]), ("team-c", ["s3-c", "s3-c2"])):
            rules = roles[(ns, f"ferry-{component}-tenant")]
            secrets = [r for r in rules if r["resources"] == ["secrets"]]
            assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": names}]
            # Every other rule is the shared role's.
            assert [r for r in rules if r["resources"] != ["secrets"]] == [
                r for r in shared if r["resources"] != ["secrets"]
            ]
        assert not any("resourceNames" in r for r in shared)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "team-b"}, "missing property 'secretNames'"),
        ({"name": "team-b", "secretNames": []}, "minItems: got 0, want 1"),
        ({"name": "team-b", "secretNames": ["s3"], "names": ["x"]}, "additional properties 'names' not allowed"),
        ({"name": "Team-B", "secretNames": ["s3"]}, "does not match pattern"),
    ],
    ids=["no-secret-names", "empty-secret-names", "unknown-key", "bad-namespace"],
)
def test_values_schema_rejects_bad_tenant_entries(helm_env, tmp_path, entry, message):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"tenantNamespaces": [entry]}))
    proc = helm(
        helm_env, "template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(values), check=False
    )
    assert proc.returncode != 0 and "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def test_ambient_credentials_render_the_same_rules_for_operator_and_agents(helm_env, tmp_path):
    """Default: nobody may use the platform's own credentials (no FERRY_AMBIENT_CREDENTIALS, which the operator and
    the agent read as no rule); set, the same JSON reaches both, and the shared module reads it as written."""
    docs = by_kind(render(helm_env))
    containers = [docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]]
    containers.append(docs["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0])
    assert all(ambient.ENV not in _env(c) for c in containers)
    rules = [
        {"namespaces": ["*"], "prefixes": ["s3://models/{namespace}/"]},
        {"namespaces": ["team-a"], "prefixes": ["s3://shared/llama"], "endpoints": ["https://s3.storage.svc:9000"]},
    ]
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"ambientCredentials": rules}))
    docs = by_kind(render(helm_env, "-f", str(values)))
    operator = _env(docs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0])[ambient.ENV]
    agent = _env(docs["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0])[ambient.ENV]
    assert operator == agent and json.loads(operator) == rules
    policy = ambient.AmbientPolicy.parse(agent)
    policy.check("team-b", "s3://models/team-b/v1/model.safetensors.index.json", None, None)
    with pytest.raises(ambient.AmbientCredentialsDenied):
        policy.check("team-b", "s3://models/team-a/v1/model.safetensors.index.json", None, None)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"prefixes": ["s3://models"]}, "missing property 'namespaces'"),
        ({"namespaces": ["Team-A"], "prefixes": ["s3://models"]}, "'oneOf' failed"),
        ({"namespaces": ["a"], "prefixes": ["models/a"]}, "does not match pattern"),
        ({"namespaces": ["a"], "prefixes": ["s3://m"], "endpoints": ["s3.local"]}, "does not match pattern"),
        ({"namespaces": ["a"], "prefixes": ["s3://models"], "bucket": "x"}, "additional properties 'bucket'"),
    ],
    ids=["no-namespaces", "bad-namespace", "bad-prefix", "bad-endpoint", "unknown-key"],
)
def test_values_schema_rejects_bad_ambient_rules(helm_env, tmp_path, rule, message):
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"ambientCredentials": [rule]}))
    proc = helm(
        helm_env, "template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(values), check=False
    )
    assert proc.returncode != 0 and "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def test_admission_policy_names_the_agent_and_the_api_constants(helm_env):
    docs = by_kind(render(helm_env, namespace="ferry-system", release="blue"))
    policies = {p["metadata"]["name"]: p for p in docs["ValidatingAdmissionPolicy"]}
    assert set(policies) == {"blue-ferry-agent-node-scope", "blue-ferry-operator-node-labels"}
    bindings = sorted(
        (b["spec"]["policyName"], b["spec"]["validationActions"]) for b in docs["ValidatingAdmissionPolicyBinding"]
    )
    assert bindings == [(name, ["Deny"]) for name in sorted(policies)]

    # The operator's: Nodes, only warm-node labels (ferry/api/models.py), only for its ServiceAccount.
    operator = policies["blue-ferry-operator-node-labels"]
    assert operator["spec"]["failurePolicy"] == "Fail"
    (match,) = operator["spec"]["matchConditions"]
    assert "'system:serviceaccount:ferry-system:blue-ferry-operator'" in match["expression"]
    assert f"startsWith('{models.WARM_LABEL_PREFIX}')" in json.dumps(operator["spec"]["validations"])
    assert [r["resources"] for r in operator["spec"]["matchConstraints"]["resourceRules"]] == [["nodes"]]

    policy = policies["blue-ferry-agent-node-scope"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    (match,) = policy["spec"]["matchConditions"]
    assert "'system:serviceaccount:ferry-system:blue-ferry-agent'" in match["expression"]
    text = json.dumps(policy["spec"]["validations"])
    # The Lease name prefix and node label the agent writes (ferry/api/models.py).
    assert f"startsWith('{models.REPLICA_LEASE_PREFIX}')" in text and f"'{models.LABEL_NODE}'" in text
    # The audience prefix of worker tokens (ferry/api/models.py).
    assert f"startsWith('{models.WORKER_AUDIENCE_PREFIX}')" in text
    resources = {r for rule in policy["spec"]["matchConstraints"]["resourceRules"] for r in rule["resources"]}
    assert resources == {"weightreplicas", "weightreplicas/status", "leases", "serviceaccounts/token"}


# ---------------------------------------------------------------- the real apiserver


@pytest.mark.parametrize(
    "values",
    [
        [],
        [
            *sets(
                agent__rdma__enabled="true",
                agent__hostNetwork="true",
                agent__ucx__tls="rc\\,tcp",
                agent__secretNames="{s3-creds,other}",
                operator__s3CredentialsSecret="s3-creds",
                operator__config__s3Endpoint="http://s3.example:8333",
            ),
            "--set",
            "imagePullSecrets[0].name=regcred",
        ],
        sets(operator__metrics__enabled="false", agent__enabled="false"),
        sets(operator__replicas="2"),
        sets(agent__metrics__service__enabled="true", grafana__dashboards__enabled="true"),
        GPU_NODE_VALUES,
    ],
    ids=[
        "defaults",
        "rdma-and-options",
        "operator-only",
        "two-operators",
        "metrics-service-and-dashboards",
        "gpu-nodes",
    ],
)
def test_rendered_objects_pass_server_dry_run(cluster, namespace, helm_env, values):
    values = [*values, "--set", f"tenantNamespaces={{{namespace}}}"]
    docs = render(helm_env, *values, namespace=namespace, release=f"dry-{namespace}")
    assert {d["kind"] for d in docs} >= {"CustomResourceDefinition", "ClusterRole", "Deployment"}
    manifest = yaml.safe_dump_all(docs)
    proc = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=manifest, check=False)
    assert proc.returncode == 0, proc.stderr
    accepted = [line for line in proc.stdout.splitlines() if line.endswith("(server dry run)")]
    assert len(accepted) == len(docs), proc.stdout
    # Nothing was persisted.
    assert not exists(cluster, "clusterrole", f"dry-{namespace}-ferry-operator")


def test_install_then_uninstall_keeps_crds_and_resources(cluster, namespace, helm_env):
    with release(cluster, helm_env, namespace) as name:
        kube = ["--kubeconfig", str(cluster.kubeconfig), "-n", namespace]
        status = json.loads(helm(helm_env, "status", name, *kube, "-o", "json").stdout)
        assert status["info"]["status"] == "deployed", status["info"]
        listed = json.loads(helm(helm_env, "list", *kube, "-o", "json").stdout)
        assert [(r["name"], r["status"]) for r in listed] == [(name, "deployed")]
        notes = helm(helm_env, "get", "notes", name, *kube).stdout
        assert f"kubectl -n {namespace} get deployment {name}-operator" in notes, notes
        assert "`helm upgrade` upgrades them" in notes and "`helm uninstall` leaves them" in notes, notes

        # The release owns the CRDs, so `helm upgrade` applies the chart's schema over an older one in the cluster.
        for crd in CRD_NAMES:
            meta = json.loads(cluster.kubectl("get", "crd", crd, "-o", "json").stdout)["metadata"]
            assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm", crd
            assert meta["annotations"]["meta.helm.sh/release-name"] == name, crd
            assert meta["annotations"]["helm.sh/resource-policy"] == "keep", crd
        explain = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/storage/description"
        cluster.kubectl(
            "patch",
            "crd",
            "weightversions.ferry.dev",
            "--type=json",
            "-p",
            json.dumps([{"op": "replace", "path": explain, "value": "older"}]),
        )
        helm(helm_env, "upgrade", name, str(CHART), *kube, "--reuse-values")
        live = json.loads(cluster.kubectl("get", "crd", "weightversions.ferry.dev", "-o", "json").stdout)
        spec = live["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        generated = crdgen.openapi_schema(models.WeightVersion)["properties"]["spec"]
        assert spec["properties"]["storage"]["description"] == generated["properties"]["storage"]["description"]

        for kind, obj in [
            ("deployment", f"{name}-operator"),
            ("daemonset", f"{name}-agent"),
            ("serviceaccount", f"{name}-operator"),
            ("serviceaccount", f"{name}-agent"),
            ("service", f"{name}-operator-metrics"),
        ]:
            assert exists(cluster, kind, obj, namespace), f"{kind}/{obj} missing after install"
        for kind in ("clusterrole", "clusterrolebinding"):
            for component in ("operator", "agent"):
                assert exists(cluster, kind, f"{name}-{component}"), f"{kind}/{name}-{component} missing"
        for kind in ("validatingadmissionpolicy", "validatingadmissionpolicybinding"):
            assert exists(cluster, kind, f"{name}-agent-node-scope"), f"{kind} missing"
        # The apiserver serves MutatingAdmissionPolicy (1.36): helm installs the release finalizer policy.
        for kind in ("mutatingadmissionpolicy", "mutatingadmissionpolicybinding"):
            assert exists(cluster, kind, f"{name}-operator-release-finalizer"), f"{kind} missing"

        # A custom resource created while the release is installed.
        wv = {
            "apiVersion": models.API_VERSION,
            "kind": "WeightVersion",
            "metadata": {"name": "keep-me"},
            "spec": {
                "modelName": "m",
                "format": "FullCheckpoint",
                "storage": {"uri": "s3://models/m/keep-me/model.safetensors.index.json"},
            },
        }

        # Created with the operator's release finalizer by the policy (once the admission plugin has read it).
        def create(*dry_run: str) -> dict:
            args = ("create", *dry_run, "-n", namespace, "-o", "json", "-f", "-")
            return json.loads(cluster.kubectl(*args, input=json.dumps(wv)).stdout)

        wait_until(
            lambda: create("--dry-run=server")["metadata"].get("finalizers") == ["ferry.dev/release"],
            30,
            "the release finalizer policy in force",
        )
        assert create()["metadata"]["finalizers"] == ["ferry.dev/release"]
        # No operator may run here to release it: let the namespace go at the end.
        finalizers = '[{"op":"remove","path":"/metadata/finalizers"}]'
        cluster.kubectl("patch", "weightversion", "keep-me", "-n", namespace, "--type=json", "-p", finalizers)

        proc = helm(helm_env, "uninstall", name, *kube)
        assert "uninstalled" in proc.stdout

        for kind, obj in [
            ("deployment", f"{name}-operator"),
            ("daemonset", f"{name}-agent"),
            ("serviceaccount", f"{name}-agent"),
            ("service", f"{name}-operator-metrics"),
        ]:
            assert not exists(cluster, kind, obj, namespace), f"{kind}/{obj} survived uninstall"
        for component in ("operator", "agent"):
            assert not exists(cluster, "clusterrole", f"{name}-{component}")
            assert not exists(cluster, "clusterrolebinding", f"{name}-{component}")
        assert not exists(cluster, "validatingadmissionpolicy", f"{name}-agent-node-scope")
        assert not exists(cluster, "mutatingadmissionpolicy", f"{name}-operator-release-finalizer")
        assert json.loads(helm(helm_env, "list", *kube, "-o", "json").stdout) == []

        # Kept: the CRDs (still Established) and every custom resource.
        for crd in CRD_NAMES:
            out = json.loads(cluster.kubectl("get", "crd", crd, "-o", "json").stdout)
            conditions = {c["type"]: c["status"] for c in out["status"]["conditions"]}
            assert conditions.get("Established") == "True", crd
        assert exists(cluster, "weightversion", "keep-me", namespace)


# ---------------------------------------------------------------- least privilege for the agent


AGENT_ALLOWED = [
    ("get", "weightreplicas.ferry.dev"),
    ("list", "weightreplicas.ferry.dev"),
    ("watch", "weightreplicas.ferry.dev"),
    ("patch", "weightreplicas.ferry.dev/status"),
    ("update", "weightreplicas.ferry.dev/status"),
    ("get", "weightversions.ferry.dev"),
    ("list", "weightversions.ferry.dev"),
    ("watch", "weightversions.ferry.dev"),
    ("get", "secrets/s3-creds"),
    ("create", "tokenreviews.authentication.k8s.io"),
    ("create", "subjectaccessreviews.authorization.k8s.io"),  # a trainer pod's right to publish
    ("create", "weightversions.ferry.dev"),  # a trainer pod's publish, after that review (tenant namespaces only)
    ("list", "pods"),
    ("watch", "pods"),  # attach sockets for the node's pods
    *[(verb, "leases.coordination.k8s.io") for verb in ("create", "get", "list", "watch", "update", "patch", "delete")],
]
AGENT_DENIED = [
    *[(verb, "weightversions.ferry.dev") for verb in ("update", "patch", "delete", "deletecollection")],
    ("patch", "weightversions.ferry.dev/status"),
    *[(verb, "weightreplicas.ferry.dev") for verb in ("create", "update", "patch", "delete")],
    *[(verb, "modelloads.ferry.dev") for verb in ("get", "list", "create", "update", "patch", "delete")],
    ("patch", "modelloads.ferry.dev/status"),
    ("get", "secrets/other-secret"),
    ("list", "secrets"),
    ("watch", "secrets"),
    ("create", "secrets"),
    ("create", "events"),
    ("get", "pods"),
    ("create", "pods"),
    ("delete", "pods"),
    ("list", "nodes"),
    ("patch", "nodes"),
    ("create", "deployments.apps"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
]


def can_i(cluster: LocalCluster, namespace: str, user: str, verb: str, resource: str) -> bool:
    args = ["auth", "can-i", verb]
    if resource.endswith("/status"):
        args += [resource.removesuffix("/status"), "--subresource=status"]
    else:
        args.append(resource)
    # The groups a real ServiceAccount token carries.
    groups = ["--as-group=system:serviceaccounts", f"--as-group=system:serviceaccounts:{user.split(':')[2]}"]
    proc = cluster.kubectl(*args, "-n", namespace, f"--as={user}", *groups, check=False)
    answer = proc.stdout.strip()
    assert answer in ("yes", "no"), f"can-i {verb} {resource}: {proc.stdout} {proc.stderr}"
    return answer == "yes"


def test_agent_rbac_is_least_privilege(cluster, namespace, helm_env, tmp_path):
    """What RBAC grants. Which node's objects an agent may write, the admission policy decides: test_rbac.py."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"tenantNamespaces": [{"name": namespace, "secretNames": ["s3-creds"]}]}))
    with release(cluster, helm_env, namespace, "-f", str(values)) as name:
        agent_sa = f"system:serviceaccount:{namespace}:{name}-agent"
        allowed = [(v, r) for v, r in AGENT_ALLOWED if not can_i(cluster, namespace, agent_sa, v, r)]
        denied = [(v, r) for v, r in AGENT_DENIED if can_i(cluster, namespace, agent_sa, v, r)]
        assert not allowed, f"agent lacks {allowed}"
        assert not denied, f"agent may {denied}"
        # The agent watches replicas cluster-wide, but Secrets and Leases only in tenant namespaces.
        assert can_i(cluster, "kube-system", agent_sa, "list", "weightreplicas.ferry.dev")
        for verb, resource in [
            ("get", "secrets/s3-creds"),
            ("create", "leases.coordination.k8s.io"),
            ("delete", "leases.coordination.k8s.io"),
            ("create", "weightversions.ferry.dev"),
        ]:
            assert not can_i(cluster, "kube-system", agent_sa, verb, resource), f"agent may {verb} {resource}"
        # The operator's role is broader than the agent's; it too reads Secrets only in tenant namespaces (only the
        # listed ones), and deletes Leases only there (a replica's Lease written for another node). It writes only
        # its leader-election Lease, in the release namespace (here also the tenant namespace).
        operator_sa = f"system:serviceaccount:{namespace}:{name}-operator"
        assert can_i(cluster, namespace, operator_sa, "get", "secrets/s3-creds")
        assert not can_i(cluster, namespace, operator_sa, "get", "secrets/other-secret")
        assert not can_i(cluster, "kube-system", operator_sa, "get", "secrets/s3-creds")
        assert can_i(cluster, namespace, operator_sa, "delete", "leases.coordination.k8s.io")
        assert not can_i(cluster, "kube-system", operator_sa, "delete", "leases.coordination.k8s.io")
        leader_lease = f"leases.coordination.k8s.io/{name}-operator"
        assert can_i(cluster, namespace, operator_sa, "create", "leases.coordination.k8s.io")
        assert can_i(cluster, namespace, operator_sa, "update", leader_lease)
        assert not can_i(cluster, namespace, operator_sa, "update", "leases.coordination.k8s.io/ferry-wr-x")
        assert not can_i(cluster, namespace, operator_sa, "patch", leader_lease)
        for verb in ("create", "update"):
            assert not can_i(cluster, "kube-system", operator_sa, verb, leader_lease), verb
        assert can_i(cluster, namespace, operator_sa, "create", "weightreplicas.ferry.dev")
        assert can_i(cluster, namespace, operator_sa, "patch", "weightversions.ferry.dev/status")
        assert not can_i(cluster, namespace, operator_sa, "create", "weightversions.ferry.dev")
        # Retention deletes WeightVersions, in tenant namespaces only, and never a whole collection.
        assert can_i(cluster, namespace, operator_sa, "delete", "weightversions.ferry.dev")
        assert not can_i(cluster, "kube-system", operator_sa, "delete", "weightversions.ferry.dev")
        assert not can_i(cluster, namespace, operator_sa, "deletecollection", "weightversions.ferry.dev")
        assert not can_i(cluster, namespace, operator_sa, "delete", "modelloads.ferry.dev")
        # Weights follow pods: it lists and watches Pods in tenant namespaces only, and reads or writes none.
        for verb in ("list", "watch"):
            assert can_i(cluster, namespace, operator_sa, verb, "pods"), verb
            assert not can_i(cluster, "kube-system", operator_sa, verb, "pods"), verb
        for verb in ("get", "create", "update", "patch", "delete"):
            assert not can_i(cluster, namespace, operator_sa, verb, "pods"), verb
        # Warm-node labels: it patches Nodes (the admission policy allows warm.ferry.dev/* labels alone,
        # test_rbac.py); it creates, updates, deletes none and writes no Node status.
        assert can_i(cluster, namespace, operator_sa, "patch", "nodes")
        for verb, resource in [
            ("create", "nodes"),
            ("update", "nodes"),
            ("delete", "nodes"),
            ("patch", "nodes/status"),
        ]:
            assert not can_i(cluster, namespace, operator_sa, verb, resource), (verb, resource)

        # Real requests, authenticated as the agent's ServiceAccount with a TokenRequest token.
        token = cluster.kubectl("create", "token", f"{name}-agent", "-n", namespace, "--duration=10m").stdout.strip()
        agent_cfg = write_kubeconfig(tmp_path / "agent.kubeconfig", cluster.server, cluster.pki.ca_cert, token=token)

        def as_agent(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
            return subprocess.run(
                [binary("kubectl"), f"--kubeconfig={agent_cfg}", "-n", namespace, *args],
                capture_output=True,
                text=True,
                input=input,
                timeout=60,
            )

        who = json.loads(as_agent("auth", "whoami", "-o", "json").stdout)
        assert who["status"]["userInfo"]["username"] == agent_sa

        wv = {
            "apiVersion": models.API_VERSION,
            "kind": "WeightVersion",
            "metadata": {"name": "v1"},
            "spec": {
                "modelName": "m",
                "format": "FullCheckpoint",
                "storage": {"uri": "s3://models/m/v1/model.safetensors.index.json"},
            },
        }
        wr = {
            "apiVersion": models.API_VERSION,
            "kind": "WeightReplica",
            "metadata": {"name": "m-node-a", "labels": {"ferry.dev/node": "node-a"}},
            "spec": {"modelLoad": "m", "modelName": "m", "version": "v1", "nodeName": "node-a"},
        }
        ml = {
            "apiVersion": models.API_VERSION,
            "kind": "ModelLoad",
            "metadata": {"name": "m"},
            "spec": {"modelName": "m", "desiredVersion": "v1", "replicas": 1},
        }
        # Creating a WeightVersion in a tenant namespace is allowed: a trainer pod's publish (after its own review).
        forbidden = [
            ("create", "WeightReplica", as_agent("create", "-f", "-", input=json.dumps(wr))),
            ("create", "ModelLoad", as_agent("create", "-f", "-", input=json.dumps(ml))),
        ]
        cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(wv))
        cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(wr))
        cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(ml))
        label = ["--type=merge", "-p", '{"metadata":{"labels":{"tampered":"yes"}}}']
        forbidden += [
            ("patch", "WeightVersion", as_agent("patch", "weightversion", "v1", *label)),
            ("delete", "WeightVersion", as_agent("delete", "weightversion", "v1", "--wait=false")),
            ("patch", "WeightReplica", as_agent("patch", "weightreplica", "m-node-a", *label)),
            ("delete", "WeightReplica", as_agent("delete", "weightreplica", "m-node-a", "--wait=false")),
            ("get", "ModelLoad", as_agent("get", "modelload", "m")),
            ("patch", "ModelLoad", as_agent("patch", "modelload", "m", *label)),
            ("delete", "ModelLoad", as_agent("delete", "modelload", "m", "--wait=false")),
            ("list", "Secrets", as_agent("get", "secrets")),
        ]
        for verb, what, proc in forbidden:
            assert proc.returncode != 0 and "Forbidden" in proc.stderr, f"agent could {verb} {what}: {proc.stdout}"

        # Status writes go through the agent's own code path: the official client's PATCH on /status (kubectl
        # would GET the subresource first, which the agent never does and is not granted).
        api = config.new_client_from_config(config_file=str(agent_cfg))
        objects = client.CustomObjectsApi(api)
        with pytest.raises(ApiException) as denied:
            objects.patch_namespaced_custom_object_status(
                models.GROUP, models.VERSION, namespace, "weightversions", "v1", {"status": {"phase": "Ready"}}
            )
        assert denied.value.status == 403

        # What the agent reads for a living: its replicas (cluster-wide) and their versions. Its writes (replica
        # status, Leases) need a token bound to a Pod on a node: test_rbac.py.
        listed = as_agent("get", "weightreplicas", "-A", "-l", "ferry.dev/node=node-a", "-o", "name")
        assert listed.returncode == 0 and listed.stdout.strip() == "weightreplica.ferry.dev/m-node-a", listed.stderr
        assert as_agent("get", "weightversion", "v1", "-o", "name").returncode == 0
        api.close()

        # Versions and loads are untouched by all the denied attempts.
        assert exists(cluster, "weightversion", "v1", namespace) and exists(cluster, "modelload", "m", namespace)
