"""The worker service admits only agents whose node is assigned the served version (issue 10 item 5), checked
against the real apiserver with real pod-bound tokens (TokenRequest / TokenReview) and a real agent serving
over NIXL: no token, a wrong-audience token, a token of another identity and a valid token of a node that is not
assigned the version are all refused, with no NIXL metadata; the node's own reader still reads every byte.

A token is for one source (issue 10, replay): a reader's token for the source on node A (audience
ferry.dev/worker/A), replayed by A to the source on node B, is UNAUTHENTICATED there, while B admits the token the
reader mints for B."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable

import grpc
import pytest
import torch
from agentutil import content_sha256, node, read_back, reader_tokens, replica, start_agent, wait_phase
from safetensors.torch import save_file
from wvutil import wait_for

from ferry.api.models import worker_audience
from ferry_agent.proto import worker_pb2, worker_pb2_grpc
from ferry_agent.worker_service import SourceIdentity, get_tensor_manifest, prepare_tensor_read

pytestmark = pytest.mark.e2e


def _refusal(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _raw_prepare(endpoint: str, identity: SourceIdentity, metadata) -> grpc.StatusCode | None:  # type: ignore[no-untyped-def]
    """The bare RPC, so that nothing of a response (no lease, no NIXL metadata) can hide in a client helper: the
    refusal's code, or None for a grant (released at once)."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.PrepareTensorReadRequest(source=identity.to_proto(), reader="intruder")
        try:
            response = stub.PrepareTensorRead(request, timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
        release = worker_pb2.ReleaseTensorReadRequest(source=identity.to_proto(), lease_id=response.lease_id)
        stub.ReleaseTensorRead(release, timeout=10, metadata=metadata)
        return None


def test_only_agents_of_assigned_nodes_read(cluster, namespace, tmp_path):
    gen = torch.Generator().manual_seed(10)
    weights = {f"layers.{i}.weight": torch.randn((64, 128), generator=gen) for i in range(4)}
    seed = tmp_path / "v1.safetensors"
    save_file(weights, str(seed))
    for n in ("node-auth", "node-idle"):
        node(cluster, n)
    agent = start_agent(cluster, tmp_path, "node-auth", f"v1={seed}")
    other_ns = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", other_ns)
    try:
        replica(cluster, namespace, "wr-auth", "node-auth", "v1")
        entry = wait_phase(cluster, namespace, "wr-auth", "Serving", agent)["status"]["ranks"][0]
        endpoint, identity = entry["grpcEndpoint"], SourceIdentity(entry["agentName"])
        # node-idle holds replicas, just not of v1 in this namespace: another version here, and a `v1` that is
        # another tenant's (same name, other namespace). Nobody loads them; they only have to exist.
        replica(cluster, namespace, "wr-idle-v2", "node-idle", "v2")
        replica(cluster, other_ns, "wr-idle-v1", "node-idle", "v1")

        def token(
            name: str, node_name: str, audience: str = worker_audience("node-auth"), sa: str = "ferry-agent"
        ) -> Callable[[], str]:
            path = cluster.pod_token(node_name, audience, tmp_path / name, service_account=sa)
            return lambda: path.read_text()

        refused = {
            "no token": (None, grpc.StatusCode.UNAUTHENTICATED),
            "wrong audience": (token("aud", "node-auth", audience="ferry.dev/other"), grpc.StatusCode.UNAUTHENTICATED),
            "the shared audience of old": (
                token("shared", "node-auth", audience="ferry.dev/worker"),
                grpc.StatusCode.UNAUTHENTICATED,
            ),
            "another source's audience": (
                token("other", "node-auth", audience=worker_audience("node-idle")),
                grpc.StatusCode.UNAUTHENTICATED,
            ),
            "not a token": (lambda: "not-a-jwt", grpc.StatusCode.UNAUTHENTICATED),
            "not the agent": (token("sa", "node-auth", sa="intruder"), grpc.StatusCode.PERMISSION_DENIED),
            "node not assigned": (token("idle", "node-idle"), grpc.StatusCode.PERMISSION_DENIED),
        }
        for what, (creds, code) in refused.items():
            metadata = (("authorization", f"Bearer {creds()}"),) if creds else None
            assert _raw_prepare(endpoint, identity, metadata) == code, what
            assert _refusal(lambda c=creds: get_tensor_manifest(endpoint, identity, credentials=c)) == code, what
            assert _refusal(lambda c=creds: prepare_tensor_read(endpoint, identity, credentials=c)) == code, what
        assert "granted to" not in agent.log_tail(400), "no lease was ever granted"

        # The reader of the serving node (whose replica is assigned v1) reads every byte.
        assert read_back(entry, "wr-auth") == content_sha256(weights)
        # Once node-idle is assigned v1 here, its token that was refused a moment ago reads too; once it is not, no
        # longer.
        replica(cluster, namespace, "wr-idle-v1", "node-idle", "v1")
        assert read_back(entry, "wr-auth", reader_node="node-idle") == content_sha256(weights)
        cluster.kubectl("delete", "wr", "wr-idle-v1", "-n", namespace)
        idle = token("idle", "node-idle")
        wait_for(
            lambda: _raw_prepare(endpoint, identity, (("authorization", f"Bearer {idle()}"),))
            == grpc.StatusCode.PERMISSION_DENIED,
            10, "node-idle refused again",
        )  # fmt: skip
    finally:
        agent.stop()
        cluster.kubectl("delete", "namespace", other_ns, "--wait=false", check=False)


def test_a_token_for_one_source_is_refused_by_another(cluster, namespace, tmp_path):
    """Two sources serve v1; a reader on a node assigned v1 mints its tokens as an agent does (TokenRequest bound to
    its Pod). Source A, had it been compromised, would hold the reader's token for A: B refuses it."""
    gen = torch.Generator().manual_seed(11)
    weights = {f"layers.{i}.weight": torch.randn((32, 64), generator=gen) for i in range(3)}
    seed = tmp_path / "v1.safetensors"
    save_file(weights, str(seed))
    for n in ("node-src-a", "node-src-b", "node-reader"):
        node(cluster, n)
    agents = [start_agent(cluster, tmp_path, n, f"v1={seed}") for n in ("node-src-a", "node-src-b")]
    try:
        entries = {}
        for n, agent in zip(("node-src-a", "node-src-b"), agents, strict=True):
            replica(cluster, namespace, f"wr-{n}", n, "v1")
            entries[n] = wait_phase(cluster, namespace, f"wr-{n}", "Serving", agent)["status"]["ranks"][0]
        replica(cluster, namespace, "wr-reader", "node-reader", "v1")  # the reader's node is assigned v1
        tokens = reader_tokens(cluster, "node-reader")
        for_a, for_b = tokens("node-src-a"), tokens("node-src-b")
        assert for_a != for_b

        def prepare(n: str, token: str) -> grpc.StatusCode | None:
            entry = entries[n]
            return _raw_prepare(entry["grpcEndpoint"], SourceIdentity(entry["agentName"]),
                                (("authorization", f"Bearer {token}"),))  # fmt: skip

        assert prepare("node-src-a", for_a) is None, "A admits the reader's token for A"
        assert prepare("node-src-b", for_a) == grpc.StatusCode.UNAUTHENTICATED, "A's copy replayed to B"
        assert prepare("node-src-a", for_b) == grpc.StatusCode.UNAUTHENTICATED, "B's copy replayed to A"
        assert prepare("node-src-b", for_b) is None, "B admits the reader's token for B"
        # The reader's own load path, which mints per source, reads every byte from either.
        for n in ("node-src-a", "node-src-b"):
            assert read_back(entries[n], f"wr-{n}", reader_node="node-reader") == content_sha256(weights)
    finally:
        for agent in agents:
            agent.stop()


def test_agent_without_a_pod_identity_exits_clearly(cluster, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("POD_NAMESPACE", "SERVICE_ACCOUNT", "POD_NAME", "POD_UID")}
    proc = subprocess.run(
        [sys.executable, "-m", "ferry_agent", "--node", "node-noid", "--pod-name", "ferry-agent-node-noid"],
        env={**env, **cluster.env()}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--pod-namespace, --service-account, --pod-uid missing" in proc.stderr, proc.stderr
    assert "POD_UID" in proc.stderr, proc.stderr
