"""The worker service admits only agents whose node is assigned the served version (issue 10 item 5), checked
against the real apiserver with real pod-bound tokens (TokenRequest / TokenReview) and a real agent serving
over NIXL: no token, a wrong-audience token, garbage, an expired or not yet valid token (without a TokenReview, all
of these), a token of another identity and a valid token of a node that is not assigned the version are all refused,
with no NIXL metadata; the node's own reader still reads every byte. Only the reader that took a lease releases it:
another assigned agent's release is refused and the lease stays counted.

A token is for one source (issue 10, replay): a reader's token for the source on node A (audience
ferry.dev/worker/A), replayed by A to the source on node B, is UNAUTHENTICATED there, while B admits the token the
reader mints for B."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import grpc
import pytest
import torch
from safetensors.torch import save_file

from ferry.api.models import worker_audience
from ferry_agent.transport.worker_service import (
    SourceIdentity,
    get_tensor_manifest,
    prepare_tensor_read,
    release_tensor_read,
)
from tests.support.agents import (
    bare_calls,
    content_sha256,
    node,
    read_back,
    reader_tokens,
    replica,
    seed_arg,
    start_agent,
    wait_phase,
)
from tests.support.objects import apply, get, wait_for, wait_reason, wv_body

pytestmark = pytest.mark.e2e


def _refusal(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _rewritten(token: str, **claims: int) -> str:
    """`token` with some of its claims replaced (its signature no longer matches)."""
    header, payload, signature = token.split(".")
    decoded = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    encoded = base64.urlsafe_b64encode(json.dumps({**decoded, **claims}).encode()).rstrip(b"=").decode()
    return f"{header}.{encoded}.{signature}"


def _token_reviews(cluster) -> int:  # type: ignore[no-untyped-def]
    """TokenReviews the apiserver has answered so far (its request counter)."""
    lines = cluster.kubectl("get", "--raw", "/metrics").stdout.splitlines()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in lines
        if line.startswith("apiserver_request_total{") and 'resource="tokenreviews"' in line
    )


def test_only_agents_of_assigned_nodes_read(cluster, namespace, operator, tmp_path):
    gen = torch.Generator().manual_seed(10)
    weights = {f"layers.{i}.weight": torch.randn((64, 128), generator=gen) for i in range(4)}
    seed = tmp_path / "v1.safetensors"
    save_file(weights, str(seed))
    for n in ("node-auth", "node-idle"):
        node(cluster, n)
    apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"))  # a seed serves only a Ready version
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
    agent = start_agent(cluster, tmp_path, "node-auth", seed_arg(namespace, "v1", seed))
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

        real = token("real", "node-auth")()
        # Refused by the agent's local checks, before any TokenReview: these first.
        local = {
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
            # TokenRequest issues nothing that expires in under 10 minutes: a real token's claims, rewritten.
            "expired": (lambda: _rewritten(real, exp=int(time.time()) - 3600), grpc.StatusCode.UNAUTHENTICATED),
            "not valid yet": (lambda: _rewritten(real, nbf=int(time.time()) + 3600), grpc.StatusCode.UNAUTHENTICATED),
        }
        refused = {
            **local,
            "not the agent": (token("sa", "node-auth", sa="intruder"), grpc.StatusCode.PERMISSION_DENIED),
            "node not assigned": (token("idle", "node-idle"), grpc.StatusCode.PERMISSION_DENIED),
        }
        reviews = _token_reviews(cluster)
        for what, (creds, code) in refused.items():
            bare = bare_calls(endpoint, identity.agent_name, creds() if creds else None)
            assert bare["manifest"] == bare["prepare"] == code, (what, bare)
            assert _refusal(lambda c=creds: get_tensor_manifest(endpoint, identity, credentials=c)) == code, what
            assert _refusal(lambda c=creds: prepare_tensor_read(endpoint, identity, credentials=c)) == code, what
            if what in local:
                assert _token_reviews(cluster) == reviews, f"{what}: the agent asked the apiserver"
        assert _token_reviews(cluster) > reviews, "the counter sees the agent's reviews"
        assert "granted to" not in agent.log_tail(400), "no lease was ever granted"

        # The reader of the serving node (whose replica is assigned v1) reads every byte.
        assert read_back(entry, "wr-auth") == content_sha256(weights)
        # Once node-idle is assigned v1 here, its token that was refused a moment ago reads too; once it is not, no
        # longer.
        replica(cluster, namespace, "wr-idle-v1", "node-idle", "v1")
        assert read_back(entry, "wr-auth", reader_node="node-idle") == content_sha256(weights)

        # Both nodes are assigned now; the lease node-auth's reader takes is still its own to release.
        def minted(reader: str) -> Callable[[], str]:
            return lambda: reader_tokens(cluster, reader)("node-auth")

        own, idle = minted("node-auth"), minted("node-idle")

        def counted(n: int) -> bool:
            return (get(cluster, namespace, "wr", "wr-auth")["status"].get("activeLeases") or 0) == n

        lease = prepare_tensor_read(endpoint, identity, credentials=own)
        wait_for(lambda: counted(1), 20, "the source to count the lease")
        for other in (idle, None):
            assert _refusal(lambda c=other: release_tensor_read(endpoint, identity, lease.lease_id, credentials=c)) == (
                grpc.StatusCode.PERMISSION_DENIED if other else grpc.StatusCode.UNAUTHENTICATED
            )
        # Still held: with a second lease of its own the source counts two (after a release it would count one).
        second = prepare_tensor_read(endpoint, identity, credentials=own)
        wait_for(lambda: counted(2), 20, "the source to count both leases")
        lease.close()  # the holder's own release succeeds (raises otherwise)
        second.close()
        wait_for(lambda: counted(0), 20, "the source to count no lease")

        cluster.kubectl("delete", "wr", "wr-idle-v1", "-n", namespace)
        idle = token("idle", "node-idle")
        wait_for(
            lambda: bare_calls(endpoint, identity.agent_name, idle())["prepare"] == grpc.StatusCode.PERMISSION_DENIED,
            10,
            "node-idle refused again",
        )
    finally:
        agent.stop()
        cluster.kubectl("delete", "namespace", other_ns, "--wait=false", check=False)


def test_a_token_for_one_source_is_refused_by_another(cluster, namespace, operator, tmp_path):
    """Two sources serve v1; a reader on a node assigned v1 mints its tokens as an agent does (TokenRequest bound to
    its Pod). Source A, had it been compromised, would hold the reader's token for A: B refuses it."""
    gen = torch.Generator().manual_seed(11)
    weights = {f"layers.{i}.weight": torch.randn((32, 64), generator=gen) for i in range(3)}
    seed = tmp_path / "v1.safetensors"
    save_file(weights, str(seed))
    for n in ("node-src-a", "node-src-b", "node-reader"):
        node(cluster, n)
    apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"))
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
    agents = [start_agent(cluster, tmp_path, n, seed_arg(namespace, "v1", seed)) for n in ("node-src-a", "node-src-b")]
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
            return bare_calls(entry["grpcEndpoint"], entry["agentName"], token)["prepare"]

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
        env={**env, **cluster.env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "--pod-namespace, --service-account, --pod-uid missing" in proc.stderr, proc.stderr
    assert "POD_UID" in proc.stderr, proc.stderr
