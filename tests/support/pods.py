"""Helpers for tests of real pods on the local kubelet nodes (tests/pods, the `pod_stack` fixture): kubectl and helm
against the stack's cluster, the ferry chart's dev values, the tenant namespace it serves, and `ferry publish`."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import yaml

from ferry_dev import localimages
from ferry_dev.localcluster import REPO_ROOT, binary
from tests.support import objects

FERRY_CHART = REPO_ROOT / "charts" / "ferry"
SECRET = "s3-credentials"


def kubectl(stack, *args: str, check: bool = True, input: str | None = None) -> str:
    return stack.cluster.kubectl(*args, check=check, input=input).stdout


def helm(stack, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(stack.cluster.workdir), "KUBECONFIG": str(stack.cluster.kubeconfig)}
    proc = subprocess.run([binary("helm"), *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stderr}\n{proc.stdout}"
    return proc.stdout


# Each poll is a kubectl process: once a second, on a machine whose cores also run two kubelets and their pods.
wait_for = functools.partial(objects.wait_for, interval=1)


def pods(stack, namespace: str, selector: str) -> list[dict]:
    return json.loads(kubectl(stack, "get", "pods", "-n", namespace, "-l", selector, "-o", "json"))["items"]


def ready(pod: dict) -> bool:
    conditions = {c["type"]: c["status"] for c in (pod.get("status") or {}).get("conditions") or []}
    return pod["metadata"].get("deletionTimestamp") is None and conditions.get("Ready") == "True"


def describe(stack, namespace: str, selector: str) -> str:
    """Every pod, the namespace's latest events and the selected pods' last log lines: why a wait timed out."""
    out = kubectl(stack, "get", "pods", "-A", "-o", "wide", check=False)
    events = kubectl(stack, "get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False)
    logs = "\n".join(
        kubectl(stack, "logs", "-n", namespace, p["metadata"]["name"], "--all-containers", "--tail=20", check=False)
        for p in pods(stack, namespace, selector)
    )
    return f"{out}\n{events[-3000:]}\n{logs[-4000:]}"


def ferry_values(tmp: Path, tenant: str, **overrides) -> Path:
    """The ferry chart's values for the dev images, serving `tenant`, with small requests (two agents and the
    operator share this machine's two cores); `a__b=value` overrides set nested keys."""
    values = localimages.dev_chart_values()
    values["tenantNamespaces"] = [{"name": tenant, "secretNames": [SECRET]}]
    values["operator"]["resources"] = {
        "requests": {"cpu": "50m", "memory": "128Mi", "ephemeral-storage": "16Mi"},
        "limits": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "256Mi"},
    }
    values["agent"]["resources"] = {
        "requests": {"cpu": "100m", "memory": "256Mi", "ephemeral-storage": "16Mi"},
        "limits": {"cpu": "2", "memory": "4Gi", "ephemeral-storage": "1Gi"},
    }
    for key, value in overrides.items():
        target = values
        *path, last = key.split("__")
        for p in path:
            target = target.setdefault(p, {})
        target[last] = value
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def create_tenant(stack, tenant: str, release_namespace: str) -> None:
    """The tenant namespace with the S3 credentials Secret its WeightVersions name, and the release's namespace."""
    kubectl(stack, "create", "namespace", tenant)
    kubectl(stack, "create", "namespace", release_namespace)
    kubectl(
        stack,
        "create",
        "secret",
        "generic",
        SECRET,
        "-n",
        tenant,
        f"--from-literal=AWS_ACCESS_KEY_ID={stack.s3.access_key}",
        f"--from-literal=AWS_SECRET_ACCESS_KEY={stack.s3.secret_key}",
    )


def ferry_publish(stack, source: Path, *, version: str, model: str, bucket: str, tenant: str, describe) -> None:
    """`ferry publish SOURCE --wait` into `tenant`, the checkpoint under s3://BUCKET/MODEL."""
    stack.s3.create_bucket(bucket)
    env = {**stack.s3.env(), "AWS_ENDPOINT_URL": stack.s3_endpoint, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferry.cli",
            "publish",
            str(source),
            "--version",
            version,
            "--uri-prefix",
            f"s3://{bucket}/{model}",
            "--model",
            model,
            "--endpoint",
            stack.s3_endpoint,
            "--credentials-secret",
            SECRET,
            "-n",
            tenant,
            "--kubeconfig",
            str(stack.cluster.kubeconfig),
            "--wait",
            "--timeout",
            "180",
            "-q",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"{proc.stderr}\n{describe()}"
