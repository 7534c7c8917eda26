"""The consumer Helm helper (charts/ferry-consumer, a library chart) through the real `helm` and kube-apiserver.

The example engine chart (examples/vllm-engine) uses the library's named templates. Rendered, every container
that attaches mounts only its own pod's directory of the agent's socket directory, read-only, where
FERRY_SOCKET_DIR says, and that directory is the one the ferry chart's agent serves the pod's socket in; the
apiserver accepts the pod spec. No kubelet runs here, so subPathExpr's expansion itself is the kubelet's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ferry.api.models import ModelLoad, warm_node_label
from tests.support.helm import CONSUMER_LIBRARY, KUBE_VERSION, helm, render, sets, vendored_example

pytestmark = pytest.mark.cluster

UID = "0b7e6c38-4a2f-4d7e-9c1a-5f3e2d1c0b9a"


@pytest.fixture(scope="module")
def engine_chart(helm_env, tmp_path_factory) -> Path:
    """The example chart, copied (with the library it depends on found by absolute path) and its dependency
    vendored by `helm dependency build`."""
    return vendored_example(tmp_path_factory.mktemp("charts"), lambda *args: helm(helm_env, *args))


def rendered(helm_env, chart: Path, *values: str, namespace: str = "default") -> dict[str, dict]:
    """The example's objects by kind (one of each)."""
    out = helm(helm_env, "template", "engine", str(chart), "--kube-version", KUBE_VERSION, "-n", namespace, *values)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), [d["kind"] for d in docs]
    return by_kind


def pod_spec(helm_env, chart: Path, *values: str) -> dict:
    return rendered(helm_env, chart, *values)["Deployment"]["spec"]["template"]["spec"]


def test_the_library_chart_lints(helm_env):
    helm(helm_env, "lint", str(CONSUMER_LIBRARY))


def test_the_example_chart_lints(helm_env, engine_chart):
    helm(helm_env, "lint", str(engine_chart))
    helm(helm_env, "lint", str(engine_chart), *sets(refit__enabled="true", modelLoad__create="false"))


def test_vllm_args_begin_with_the_model_after_the_images_vllm_serve(helm_env, engine_chart):
    (vllm,) = pod_spec(helm_env, engine_chart)["containers"]
    assert "command" not in vllm  # the image's entrypoint: `vllm serve`
    assert vllm["args"][:4] == [
        "meta-llama/Llama-3.1-8B-Instruct",
        "--port=8000",
        "--load-format=ferry",
        '--model-loader-extra-config={"model_load":"llama"}',
    ]
    other = pod_spec(helm_env, engine_chart, *sets(**{"command[0]": "python", "args[0]": "-m", "args[1]": "my_engine"}))
    (engine,) = other["containers"]
    assert (engine["command"], engine["args"]) == (["python"], ["-m", "my_engine"])


def test_pods_go_only_to_agent_nodes(helm_env, engine_chart):
    spec = pod_spec(helm_env, engine_chart)
    (agent,) = [d for d in render(helm_env) if d["kind"] == "DaemonSet"]
    # The nodes where the ferry chart's agent runs, and so where the attach hostPath (type Directory) appears.
    assert spec["nodeSelector"] == agent["spec"]["template"]["spec"]["nodeSelector"] == {"ferry.dev/gpu": "true"}


@pytest.mark.parametrize(
    ("namespace", "model_load"),
    [("team-a", "llama"), ("n" * 63, "a-model-load-name-long-enough-to-be-cut-" + "x" * 40)],
    ids=["short", "cut"],
)
def test_pods_prefer_the_nodes_the_operator_labels_warm(helm_env, engine_chart, namespace, model_load):
    def preferred(*values: str) -> list[dict]:
        docs = rendered(helm_env, engine_chart, *sets(ferry__modelLoad=model_load), *values, namespace=namespace)
        affinity = docs["Deployment"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity  # never required: weights follow
        return affinity["preferredDuringSchedulingIgnoredDuringExecution"]

    key = warm_node_label(namespace, model_load)  # what the operator writes to the ModelLoad's status
    (term,) = preferred()
    assert term == {"weight": 50, "preference": {"matchExpressions": [{"key": key, "operator": "Exists"}]}}
    (term,) = preferred(*sets(warmNodes__version="v7", warmNodes__weight="80"))
    assert term == {
        "weight": 80,
        "preference": {"matchExpressions": [{"key": key, "operator": "In", "values": ["v7"]}]},
    }


def test_probes_gate_readiness_on_vllms_health(helm_env, engine_chart):
    (vllm,) = pod_spec(helm_env, engine_chart)["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert vllm["ports"] == [{"name": "http", "containerPort": 8000}]
    # The startup probe gives the load its time; liveness starts only after it.
    assert vllm["startupProbe"]["periodSeconds"] * vllm["startupProbe"]["failureThreshold"] >= 600


def test_the_modelload_follows_the_engine_pods(helm_env, engine_chart):
    docs = rendered(helm_env, engine_chart, *sets(modelLoad__replicas="2", modelLoad__device="cpu"))
    ml = ModelLoad.from_body(docs["ModelLoad"])
    assert ml.metadata.name == "llama"  # = ferry.modelLoad, what the engine attaches
    assert (ml.spec.replicas, ml.spec.device, ml.spec.nodeSelector) == (2, "cpu", {"ferry.dev/gpu": "true"})
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert ml.spec.podSelector.matchLabels.items() <= labels.items()
    assert ml.spec.podSelector.matchLabels == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert "ModelLoad" not in rendered(helm_env, engine_chart, *sets(modelLoad__create="false"))


@pytest.mark.parametrize(
    ("values", "host_path", "attaching"),
    [
        ([], "/run/ferry", ["vllm"]),
        (
            [*sets(refit__enabled="true", ferry__hostPath="/var/run/ferry-attach", ferry__mountPath="/ferry")],
            "/var/run/ferry-attach",
            ["vllm", "ferry-refit"],
        ),
    ],
    ids=["defaults", "refit-sidecar-and-paths"],
)
def test_each_attaching_container_mounts_only_its_own_pod_directory(
    helm_env, engine_chart, values, host_path, attaching
):
    spec = pod_spec(helm_env, engine_chart, *values)
    host_volumes = [v for v in spec["volumes"] if "hostPath" in v]
    assert host_volumes == [{"name": "ferry", "hostPath": {"path": host_path, "type": "Directory"}}]
    assert [c["name"] for c in spec["containers"]] == attaching

    # The agent of the ferry chart with the same hostPath serves this pod's socket in <socket-dir>/pods/<uid>.
    agent_docs = render(helm_env, *sets(agent__attach__hostPath=host_path))
    (agent,) = [d for d in agent_docs if d["kind"] == "DaemonSet"]
    (agent_args,) = [c["command"] for c in agent["spec"]["template"]["spec"]["containers"]]
    assert f"--socket-dir={host_path}" in agent_args
    served = f"{host_path}/pods/{UID}/ferry.sock"

    for container in spec["containers"]:
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "ferry"]
        assert mount["subPathExpr"] == "pods/$(POD_UID)" and mount["readOnly"] is True
        assert env["FERRY_SOCKET_DIR"]["value"] == mount["mountPath"]
        assert env["FERRY_MODEL_LOAD"]["value"] == "llama"
        # What the kubelet mounts there for this pod, and where ferry.client looks for the socket in it.
        host_dir = f"{host_path}/{mount['subPathExpr'].replace('$(POD_UID)', UID)}"
        in_pod = f"{env['FERRY_SOCKET_DIR']['value']}/ferry.sock"
        assert served == host_dir + in_pod.removeprefix(mount["mountPath"])


def test_the_engine_pod_spec_passes_server_dry_run(cluster, namespace, helm_env, engine_chart):
    out = helm(
        helm_env,
        "template",
        "engine",
        str(engine_chart),
        "--kube-version",
        KUBE_VERSION,
        "-n",
        namespace,
        *sets(refit__enabled="true"),
    ).stdout
    proc = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=out, check=False)
    assert proc.returncode == 0 and "deployment.apps/engine created (server dry run)" in proc.stdout, proc.stderr
    assert "modelload.ferry.dev/llama created (server dry run)" in proc.stdout, proc.stdout
