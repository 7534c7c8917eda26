"""The consumer Helm helper (charts/ferry-consumer, a library chart) through the real `helm` and kube-apiserver.

The example engine chart (examples/vllm-engine) uses the library's named templates. Rendered, every container
that attaches mounts only its own pod's directory of the agent's socket directory, read-only, where
FERRY_SOCKET_DIR says, and that directory is the one the ferry chart's agent serves the pod's socket in; the
apiserver accepts the pod spec. No kubelet runs here, so subPathExpr's expansion itself is the kubelet's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.support.helm import KUBE_VERSION, helm, render, sets

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ROOT / "charts" / "ferry-consumer"
EXAMPLE = ROOT / "examples" / "vllm-engine"
UID = "0b7e6c38-4a2f-4d7e-9c1a-5f3e2d1c0b9a"


@pytest.fixture(scope="module")
def engine_chart(helm_env, tmp_path_factory) -> Path:
    """The example chart, copied (with the library it depends on found by absolute path) and its dependency
    vendored by `helm dependency build`."""
    chart = tmp_path_factory.mktemp("charts") / "vllm-engine"
    shutil.copytree(EXAMPLE, chart, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    (dep,) = meta["dependencies"]
    assert dep["repository"] == "file://../../charts/ferry-consumer"  # what the repository's layout needs
    dep["repository"] = f"file://{LIBRARY}"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    helm(helm_env, "dependency", "build", str(chart))
    return chart


def pod_spec(helm_env, chart: Path, *values: str) -> dict:
    out = helm(helm_env, "template", "engine", str(chart), "--kube-version", KUBE_VERSION, *values).stdout
    (deployment,) = [d for d in yaml.safe_load_all(out) if d]
    assert deployment["kind"] == "Deployment"
    return deployment["spec"]["template"]["spec"]


def test_the_library_chart_lints(helm_env):
    helm(helm_env, "lint", str(LIBRARY))


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
