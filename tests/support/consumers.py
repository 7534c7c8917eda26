"""Helpers for e2e tests of engine pods: Pod objects bound to a node, and consumer processes that attach through the
pod's socket (`tests/e2e/attach_consumer.py`) and report in JSON lines."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

from tests.support.objects import get, wait_for

ROOT = Path(__file__).resolve().parents[2]
CONSUMER = ROOT / "tests" / "e2e" / "attach_consumer.py"


def engine_pod(
    cluster, namespace: str, node_name: str, name: str = "engine", service_account: str | None = None
) -> str:
    """A Pod object bound to `node_name` (running as `service_account`, default the namespace's default); its uid."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node_name,
            "automountServiceAccountToken": False,
            **({"serviceAccountName": service_account} if service_account else {}),
            "containers": [{"name": "engine", "image": "engine:test"}],
        },
    }
    # The namespace's default ServiceAccount may not exist yet (the controller makes it): admission waits for it.
    wait_for(
        lambda: cluster.kubectl("apply", "-f", "-", input=json.dumps(body), check=False).returncode == 0,
        30,
        f"pod {name} created",
    )
    return get(cluster, namespace, "pod", name)["metadata"]["uid"]


def consumer(pod_dir: Path, mode: str) -> subprocess.Popen:
    """`attach_consumer.py serve MODE` as the engine of the pod whose socket directory is `pod_dir`."""
    env = {**os.environ, "FERRY_SOCKET_DIR": str(pod_dir), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(CONSUMER), "serve", mode],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def line_of(proc: subprocess.Popen, describe, timeout: float = 120) -> dict:
    """The consumer's next JSON line (or why there is none)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        raise AssertionError(f"consumer said nothing: {proc.stderr.read()}{describe()}")
    return json.loads(line)
