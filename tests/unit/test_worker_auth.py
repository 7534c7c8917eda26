"""Worker-service authentication and authorization (`worker_auth`) with a fake TokenReview and fake replica
assignments, on a real in-process gRPC server; and the bounded retry of lease RPCs with a fake stub."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from kubernetes import client
from test_leases import IDENTITY, FakeClock, code_of, manifest_proto

from ferry_agent.peer_strategy import TransferSettings
from ferry_agent.proto import worker_pb2
from ferry_agent.worker_auth import (
    NODE_NAME_EXTRA,
    CachedReviewer,
    Review,
    ServedVersion,
    WatchedAssignments,
    WorkerAuth,
    _NamespaceView,
)
from ferry_agent.worker_service import (
    RetryPolicy,
    TensorReadLeases,
    WorkerServer,
    get_tensor_manifest,
    prepare_tensor_read,
    release_tensor_read,
)

pytestmark = pytest.mark.unit

AGENT = "system:serviceaccount:ferry-system:ferry-agent"
SERVED = ServedVersion("ns", "m", "v1")


class FakeReviewer:
    """Tokens are `user@node`, `user` (no node extra) or `bad` (not authenticated); `down` raises."""

    def __init__(self) -> None:
        self.calls = 0
        self.down = False

    def review(self, token: str) -> Review:
        self.calls += 1
        if self.down:
            raise ConnectionError("apiserver unreachable")
        if token == "bad":
            return Review(False, error="invalid bearer token")
        user, _, node = token.partition("@")
        return Review(True, username=user, extra={NODE_NAME_EXTRA: [node]} if node else {})


class FakeAssignments:
    def __init__(self, assigned: set[tuple[str, ServedVersion]]) -> None:
        self.assigned_to = assigned
        self.calls = 0

    def assigned(self, node: str, served: ServedVersion) -> bool:
        self.calls += 1
        return (node, served) in self.assigned_to


@pytest.fixture
def assignments() -> FakeAssignments:
    return FakeAssignments({("node-a", SERVED)})


@pytest.fixture
def auth(assignments: FakeAssignments) -> WorkerAuth:
    return WorkerAuth(FakeReviewer(), assignments, [AGENT])


@pytest.fixture
def server(auth: WorkerAuth) -> Iterator[WorkerServer]:
    srv = WorkerServer(manifest_proto(), leases=TensorReadLeases(60), guard=auth.guard(SERVED))
    srv.start()
    yield srv
    srv.stop(0)


def token(value: str):  # type: ignore[no-untyped-def]
    return lambda: value


def test_a_reader_on_an_assigned_node_gets_manifest_and_lease(server: WorkerServer) -> None:
    good = token(f"{AGENT}@node-a")
    assert get_tensor_manifest(server.endpoint, IDENTITY, credentials=good).nixl_metadata == b"nixl-blob"
    lease = prepare_tensor_read(server.endpoint, IDENTITY, credentials=good)
    assert server.leases.active_count() == 1
    lease.close()
    assert server.leases.active_count() == 0


@pytest.mark.parametrize(
    ("credential", "code"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED),  # no token at all
        ("bad", grpc.StatusCode.UNAUTHENTICATED),  # TokenReview says no (wrong audience, expired, forged)
        ("system:serviceaccount:other:default@node-a", grpc.StatusCode.PERMISSION_DENIED),  # not an agent
        (AGENT, grpc.StatusCode.PERMISSION_DENIED),  # an agent token not bound to a pod on a node
        (f"{AGENT}@node-b", grpc.StatusCode.PERMISSION_DENIED),  # an agent whose node is not assigned v1
    ],
)
def test_refused_readers_get_no_manifest_and_no_lease(
    server: WorkerServer, credential: str | None, code: grpc.StatusCode
) -> None:
    creds = token(credential) if credential is not None else None
    # Refused before the identity check too: a stranger does not even learn whom it talks to.
    for ident in (IDENTITY, IDENTITY.__class__("someone-else")):
        assert code_of(lambda i=ident: get_tensor_manifest(server.endpoint, i, credentials=creds)) == code
        assert code_of(lambda i=ident: prepare_tensor_read(server.endpoint, i, credentials=creds)) == code
    assert server.leases.active_count() == 0


def test_assignment_is_checked_per_grant(server: WorkerServer, assignments: FakeAssignments) -> None:
    good = token(f"{AGENT}@node-a")
    prepare_tensor_read(server.endpoint, IDENTITY, credentials=good).close()
    assignments.assigned_to.clear()  # the replica moved away: the next grant is refused at once
    assert code_of(lambda: prepare_tensor_read(server.endpoint, IDENTITY, credentials=good)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # Another version of the same model, or the same version name in another namespace, is not v1 of ns.
    assignments.assigned_to.update(
        {("node-a", ServedVersion("ns", "m", "v2")), ("node-a", ServedVersion("x", "m", "v1"))}
    )
    assert code_of(lambda: get_tensor_manifest(server.endpoint, IDENTITY, credentials=good)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )


def test_only_the_holder_releases_a_lease(server: WorkerServer, assignments: FakeAssignments) -> None:
    assignments.assigned_to.add(("node-c", SERVED))
    lease = prepare_tensor_read(server.endpoint, IDENTITY, credentials=token(f"{AGENT}@node-a"))
    for other in (None, f"{AGENT}@node-c"):
        creds = token(other) if other else None
        code = code_of(lambda c=creds: release_tensor_read(server.endpoint, IDENTITY, lease.lease_id, credentials=c))
        assert code == (grpc.StatusCode.UNAUTHENTICATED if other is None else grpc.StatusCode.PERMISSION_DENIED)
    assert server.leases.active_count() == 1
    lease.close()
    assert server.leases.active_count() == 0


def test_api_errors_are_unavailable_and_not_cached(assignments: FakeAssignments) -> None:
    reviewer = FakeReviewer()
    auth = WorkerAuth(CachedReviewer(reviewer), assignments, [AGENT])
    srv = WorkerServer(manifest_proto(), guard=auth.guard(SERVED))
    srv.start()
    try:
        good = token(f"{AGENT}@node-a")
        reviewer.down = True
        assert code_of(lambda: prepare_tensor_read(srv.endpoint, IDENTITY, credentials=good)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        reviewer.down = False
        prepare_tensor_read(srv.endpoint, IDENTITY, credentials=good).close()
    finally:
        srv.stop(0)


def test_review_cache_keeps_successes_60s_and_refusals_2s() -> None:
    reviewer, clock = FakeReviewer(), FakeClock()
    cached = CachedReviewer(reviewer, clock=clock)
    for _ in range(3):
        assert cached.review(f"{AGENT}@node-a").authenticated
        assert not cached.review("bad").authenticated
    assert reviewer.calls == 2
    clock.now += 2.1  # the refusal expired, the success did not
    cached.review(f"{AGENT}@node-a")
    cached.review("bad")
    assert reviewer.calls == 3
    clock.now += 58
    cached.review(f"{AGENT}@node-a")
    assert reviewer.calls == 4


def test_an_accepted_token_keeps_reading_through_an_outage_for_the_grace_only() -> None:
    reviewer, clock = FakeReviewer(), FakeClock()
    cached = CachedReviewer(reviewer, outage_grace_s=600, clock=clock)
    assert cached.review(f"{AGENT}@node-a").authenticated
    assert not cached.review("bad").authenticated
    reviewer.down = True
    clock.now += 300  # past the 60 s cache, inside the grace
    assert cached.review(f"{AGENT}@node-a").authenticated
    for never_accepted in ("bad", f"{AGENT}@node-b"):  # nobody the API did not accept gets in
        with pytest.raises(ConnectionError):
            cached.review(never_accepted)
    clock.now += 301
    with pytest.raises(ConnectionError):
        cached.review(f"{AGENT}@node-a")
    reviewer.down = False
    assert cached.review(f"{AGENT}@node-a").authenticated


def test_assignments_answer_from_the_last_view_while_the_api_is_down_for_the_grace_only() -> None:
    class Down:
        def assigned(self, node: str, served: ServedVersion) -> bool:
            raise ConnectionError("apiserver unreachable")

    clock = FakeClock()
    view = WatchedAssignments(client.ApiClient(), direct=Down(), outage_grace_s=600, clock=clock)
    ns_view = _NamespaceView.__new__(_NamespaceView)  # no watch thread: the test plays the watch
    ns_view._lock, ns_view._clock = threading.Lock(), clock
    ns_view._items = {"wr": {"metadata": {"name": "wr"}, "spec": {"nodeName": "node-a", "modelName": "m",
                                                                  "version": "v1"}}}  # fmt: skip
    ns_view._lost_at = None
    view._views["ns"] = ns_view
    assert view.assigned("node-a", SERVED)
    ns_view._lost_at = clock.now  # the watch ended and the API does not answer
    clock.now += 300
    assert view.assigned("node-a", SERVED)
    assert not view.assigned("node-b", SERVED)
    clock.now += 301
    with pytest.raises(ConnectionError):
        view.assigned("node-a", SERVED)


def test_an_allowed_identity_is_required(assignments: FakeAssignments) -> None:
    with pytest.raises(ValueError):
        WorkerAuth(FakeReviewer(), assignments, [])


# ------------------------------------------------------------------------------------------ retries


class Unavailable(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


class FlakyStub:
    """Fails the first `failures` calls of each lease RPC with `code`, then answers."""

    def __init__(self, failures: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.failures = failures
        self.code = code
        self.calls: list[tuple[str, object]] = []

    def _maybe_fail(self, name: str, metadata: object) -> None:
        self.calls.append((name, metadata))
        if sum(1 for n, _ in self.calls if n == name) <= self.failures:
            raise Unavailable(self.code)

    def PrepareTensorRead(self, request, timeout, metadata):  # type: ignore[no-untyped-def]
        self._maybe_fail("prepare", metadata)
        return worker_pb2.PrepareTensorReadResponse(lease_id="L", ttl_seconds=60, manifest=manifest_proto())

    def ReleaseTensorRead(self, request, timeout, metadata):  # type: ignore[no-untyped-def]
        self._maybe_fail("release", metadata)
        return worker_pb2.ReleaseTensorReadResponse()


def connect_to(stub: FlakyStub):  # type: ignore[no-untyped-def]
    @contextmanager
    def connect(endpoint: str) -> Iterator[FlakyStub]:
        yield stub

    return connect


def test_lease_rpcs_retry_unavailable_with_backoff() -> None:
    slept: list[float] = []
    stub = FlakyStub(failures=2)
    policy = RetryPolicy(retries=3, backoff_s=0.5, sleep=slept.append)
    lease = prepare_tensor_read("ep", IDENTITY, retry=policy, credentials=token("t"), connect=connect_to(stub))
    lease.close()
    assert [n for n, _ in stub.calls] == ["prepare"] * 3 + ["release"] * 3
    assert slept == [0.5, 1.0, 0.5, 1.0]  # doubling, per RPC
    assert all(m == (("authorization", "Bearer t"),) for _, m in stub.calls)  # every attempt carries the token


def test_lease_rpc_retries_are_bounded() -> None:
    slept: list[float] = []
    stub = FlakyStub(failures=5)
    policy = RetryPolicy(retries=2, backoff_s=0.25, sleep=slept.append)
    with pytest.raises(grpc.RpcError) as info:
        prepare_tensor_read("ep", IDENTITY, retry=policy, connect=connect_to(stub))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(stub.calls) == 3 and slept == [0.25, 0.5]


@pytest.mark.parametrize("code", [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND])
def test_only_transient_errors_are_retried(code: grpc.StatusCode) -> None:
    stub = FlakyStub(failures=1, code=code)
    with pytest.raises(grpc.RpcError):
        prepare_tensor_read("ep", IDENTITY, retry=RetryPolicy(retries=3, backoff_s=0), connect=connect_to(stub))
    assert len(stub.calls) == 1


def test_retry_settings_come_from_spec_transfer() -> None:
    assert TransferSettings.from_spec({}).retry == RetryPolicy(3, 0.5)
    assert TransferSettings.from_spec({"rpcRetries": 0, "rpcBackoffSeconds": 2}).retry == RetryPolicy(0, 2.0)
    with pytest.raises(ValueError):
        TransferSettings(rpc_retries=-1)
