"""No ambient credentials for tenants: a WeightVersion without `credentialsSecret` gets the platform's own S3
credentials (the operator's and the agents' environment) only where the admin's `ambientCredentials` allow them.
Real operator and agent processes, the real apiserver and SeaweedFS, whose one identity reads every bucket (as an
instance role would):

- namespace `thief` naming `victim`'s object is refused by the operator (AmbientCredentialsDenied), and a version
  naming a listener the thief runs sends it nothing; with its own Secret, the request there carries the tenant's
  key, never the platform's;
- an operator that let the thief's version through (a broader rule, since narrowed) does not make the agent load
  it: the replica fails with the reason and serves nothing, while `victim`, allowed, serves its own bytes.
"""

from __future__ import annotations

import base64
import http.server
import json
import threading
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ferry.ambient import ENV
from ferry_dev.localcluster import DEV_AMBIENT_CREDENTIALS, ManagedProcess
from tests.support.agents import content_sha256, node, read_back, start_agent
from tests.support.objects import (
    BUCKET,
    apply,
    condition,
    get,
    ml_body,
    publish_full,
    tensors,
    uri,
    wait_for,
    wait_reason,
    wv_body,
)
from tests.support.operators import OperatorHandle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# Every namespace, its own folder of the bucket only, at the default endpoint.
OWN_FOLDER = json.dumps([{"namespaces": ["*"], "prefixes": [f"s3://{BUCKET}/{{namespace}}/"]}])


class Listener:
    """An HTTP server on 127.0.0.1 that records every request's headers and refuses it (403)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append({k.lower(): v for k, v in self.headers.items()})
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


@pytest.fixture
def thief(cluster) -> Iterator[str]:
    name = f"thief-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def operator_with(cluster, s3, tmp_path) -> Iterator:
    """Starts the operator with a given ambientCredentials policy, in place of the session's (which the next test's
    `operator` fixture starts again)."""
    OperatorHandle.stop_all()
    handle = OperatorHandle(cluster, s3, tmp_path / "operator")
    started: list[ManagedProcess] = []

    def start(policy: str) -> ManagedProcess:
        started.append(handle.spawn(f"operator-{len(started)}", {ENV: policy}))
        return started[-1]

    yield start
    for process in started:
        process.stop()
    OperatorHandle.handles.remove(handle)


def secret(cluster, namespace: str, name: str, access: str, key: str) -> None:
    data = {
        k: base64.b64encode(v.encode()).decode()
        for k, v in (("AWS_ACCESS_KEY_ID", access), ("AWS_SECRET_ACCESS_KEY", key))
    }
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": data}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def stolen(thief: str, victim: str, name: str = "v1", **kwargs) -> dict:
    """A WeightVersion of `thief` that names `victim`'s object and no credentialsSecret."""
    body = wv_body(thief, name, **kwargs)
    body["spec"]["storage"]["uri"] = uri(victim, "v1")
    return body


def sha(weights: dict[str, np.ndarray]) -> str:
    return content_sha256({name: torch.from_numpy(array) for name, array in weights.items()})


def test_the_operator_uses_its_credentials_only_where_the_admin_allows(
    cluster, s3, namespace, thief, listener, operator_with
):
    victim = namespace
    publish_full(s3, victim, "v1", tensors(11))
    operator = operator_with(OWN_FOLDER)
    apply(cluster, victim, wv_body(victim, "v1"))
    apply(cluster, thief, stolen(thief, victim))
    wait_reason(cluster, victim, "v1", "Ready", "True", "Verified")  # allowed: its own folder

    refused = condition(
        wait_reason(cluster, thief, "v1", "StorageVerified", "False", "AmbientCredentialsDenied"), "StorageVerified"
    )
    for part in (thief, uri(victim, "v1"), "ambientCredentials", "credentialsSecret"):
        assert part in refused["message"], refused
    assert condition(get(cluster, thief, "wv", "v1"), "Ready")["status"] == "False"

    # Its own folder, but at an endpoint the thief runs: refused before any request reaches it.
    apply(cluster, thief, wv_body(thief, "v2", endpoint=listener.url))
    obj = wait_reason(cluster, thief, "v2", "StorageVerified", "False", "AmbientCredentialsDenied")
    assert listener.url in condition(obj, "StorageVerified")["message"]
    # With a Secret of its own the operator does go there (so the listener is heard), signed with that key alone.
    secret(cluster, thief, "own", "thief-key", "thief-secret")
    apply(cluster, thief, wv_body(thief, "v3", endpoint=listener.url, secret="own"))
    wait_reason(cluster, thief, "v3", "StorageVerified", "False", "AccessDenied")
    assert listener.requests, "the operator never reached the listener"
    signed = [r.get("authorization", "") for r in listener.requests]
    assert all("Credential=thief-key/" in a for a in signed), signed
    assert not any(s3.access_key in a for a in signed), signed  # the platform's key never went there
    assert operator.alive


def test_the_agent_refuses_a_version_its_policy_does_not_allow(cluster, s3, namespace, thief, operator_with, tmp_path):
    victim, pool = namespace, namespace
    mine = tensors(21)
    publish_full(s3, victim, "v1", mine)
    operator_with(DEV_AMBIENT_CREDENTIALS)  # a broad rule: the thief's version is verified (the admin narrows later)
    apply(cluster, victim, wv_body(victim, "v1"))
    apply(cluster, thief, stolen(thief, victim))
    wait_reason(cluster, thief, "v1", "Ready", "True", "Verified")
    node(cluster, f"{pool}-n", {"ferry.dev/pool": pool})
    agent = start_agent(cluster, tmp_path, f"{pool}-n", s3=s3, args=["--ambient-credentials", OWN_FOLDER])

    def replica(ns: str) -> dict:
        items = json.loads(cluster.kubectl("get", "wr", "-n", ns, "-o", "json").stdout)["items"]
        return items[0] if items else {}

    def describe() -> str:
        return json.dumps([replica(ns).get("status") for ns in (victim, thief)], indent=1) + agent.log_tail(30)

    try:
        apply(cluster, thief, ml_body(thief, pool=pool))
        failed = wait_for(
            lambda: (r := replica(thief)) and (r.get("status") or {}).get("phase") == "Failed" and r,
            90,
            "the thief's replica Failed",
            describe,
        )
        status = failed["status"]
        assert "may not read" in status["message"] and uri(victim, "v1") in status["message"], status
        assert "ambientCredentials" in status["message"] and not status.get("ranks"), status
        tried = {a["source"]: a["reason"] for a in status.get("attempts") or []}
        assert tried.get("ObjectStorage") == "AmbientCredentialsDenied", status
        assert not (tmp_path / f"store-{pool}-n" / thief).exists(), "the thief's load stored bytes"

        apply(cluster, victim, ml_body(victim, pool=pool))  # allowed on the same agent: its own bytes
        served = wait_for(
            lambda: (r := replica(victim)) and (r.get("status") or {}).get("phase") == "Serving" and r,
            90,
            "the victim's replica Serving",
            describe,
        )
        assert read_back(served["status"]["ranks"][0], served["metadata"]["name"]) == sha(mine)
        assert (replica(thief).get("status") or {}).get("phase") != "Serving", describe()
    finally:
        for ns in (victim, thief):
            cluster.kubectl("delete", "ml", "serve", "-n", ns, "--wait=false", check=False)
        agent.stop()
