"""The reader's worker tokens (`worker_auth.ReaderTokens`) with a fake TokenRequest API and a fake clock: one token
per source node with that node's audience, bound to the reader's own Pod, renewed halfway through its lifetime, and
still sent while renewing fails but it has not expired."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from kubernetes import client

from ferry_agent.config import AgentConfig
from ferry_agent.transport import worker_auth
from ferry_agent.transport.worker_auth import EXPIRY_MARGIN_S, PodIdentity, ReaderTokens, TokenUnavailable

pytestmark = pytest.mark.unit

ME = PodIdentity("ferry-system", "ferry-agent", "ferry-agent-x1", "uid-1")
T0 = 1_000_000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class FakeTokenRequests:
    """`create_namespaced_service_account_token`: records each request and answers a numbered token that expires
    `lifetime_s` after the clock's now, or raises while `failing`."""

    def __init__(self, clock: FakeClock, lifetime_s: float = 600) -> None:
        self.clock = clock
        self.lifetime_s = lifetime_s
        self.requests: list[tuple[str, str, Any]] = []
        self.failing = False

    def create_namespaced_service_account_token(self, name: str, namespace: str, body: Any) -> Any:
        if self.failing:
            raise client.ApiException(status=503, reason="Service Unavailable")
        self.requests.append((name, namespace, body.spec))
        expires = dt.datetime.fromtimestamp(self.clock.now + self.lifetime_s, dt.UTC)
        token = f"token-{len(self.requests)}-{body.spec.audiences[0]}"
        return client.AuthenticationV1TokenRequest(
            spec=body.spec, status=client.V1TokenRequestStatus(token=token, expiration_timestamp=expires)
        )


@pytest.fixture
def setup() -> tuple[ReaderTokens, FakeTokenRequests, FakeClock]:
    clock = FakeClock()
    api = FakeTokenRequests(clock)
    tokens = ReaderTokens(client.ApiClient(), ME, clock=clock)
    tokens._core = api  # type: ignore[assignment]  # the fake TokenRequest API
    return tokens, api, clock


def test_one_token_per_source_node_bound_to_the_readers_pod(setup) -> None:
    tokens, api, _ = setup
    assert tokens("node-a") == "token-1-ferry.dev/worker/node-a"
    assert tokens("node-b") == "token-2-ferry.dev/worker/node-b"
    assert tokens("node-a") == "token-1-ferry.dev/worker/node-a"  # cached, not minted again
    assert len(api.requests) == 2
    for name, namespace, spec in api.requests:
        assert (name, namespace) == ("ferry-agent", "ferry-system")
        ref = spec.bound_object_ref
        assert (ref.kind, ref.api_version, ref.name, ref.uid) == ("Pod", "v1", "ferry-agent-x1", "uid-1")
        assert spec.expiration_seconds == worker_auth.TOKEN_EXPIRATION_S
    assert [spec.audiences for _, _, spec in api.requests] == [["ferry.dev/worker/node-a"], ["ferry.dev/worker/node-b"]]


def test_renewed_halfway_through_its_lifetime(setup) -> None:
    tokens, api, clock = setup
    first = tokens("node-a")
    clock.now = T0 + 299
    assert tokens("node-a") == first
    clock.now = T0 + 300
    renewed = tokens("node-a")
    assert renewed != first and len(api.requests) == 2
    clock.now = T0 + 599  # 299 s into the renewed token's 600
    assert tokens("node-a") == renewed and len(api.requests) == 2


def test_a_failed_renewal_keeps_the_current_token_until_it_nearly_expires(setup) -> None:
    tokens, api, clock = setup
    first = tokens("node-a")
    api.failing = True
    clock.now = T0 + 600 - EXPIRY_MARGIN_S - 1
    assert tokens("node-a") == first
    clock.now = T0 + 600 - EXPIRY_MARGIN_S
    with pytest.raises(TokenUnavailable, match="503"):
        tokens("node-a")
    with pytest.raises(TokenUnavailable, match=r"ferry\.dev/worker/node-b"):  # never minted: nothing to fall back on
        tokens("node-b")
    api.failing = False
    assert tokens("node-a") != first


def test_a_source_without_a_node_gets_no_token(setup) -> None:
    tokens, api, _ = setup
    with pytest.raises(TokenUnavailable, match="node name"):
        tokens("")
    assert api.requests == []


def test_arguments_name_the_missing_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("POD_UID", "POD_NAMESPACE", "SERVICE_ACCOUNT", "POD_NAME"):
        monkeypatch.delenv(name, raising=False)
    flags = ["--node", "node-a", "--pod-namespace", "ns", "--service-account", "sa", "--pod-name", "p"]
    args = AgentConfig.from_args(flags)
    with pytest.raises(ValueError, match="--pod-uid missing"):
        worker_auth.from_arguments(args, client.ApiClient(), "node-a")
    args = AgentConfig.from_args([*flags, "--pod-uid", "u"])
    tokens, auth = worker_auth.from_arguments(args, client.ApiClient(), "node-a")
    assert tokens.identity == PodIdentity("ns", "sa", "p", "u")
    assert auth.allowed_identities == {"system:serviceaccount:ns:sa"}
