"""Worker-service authentication and authorization (`worker_auth`) with a fake TokenReview and fake replica
assignments, on a real in-process gRPC server; and the bounded retry of lease RPCs with a fake stub."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from kubernetes import client

from ferry.api.models import worker_audience
from ferry_agent.strategies.peer import TransferSettings
from ferry_agent.transport import worker_auth
from ferry_agent.transport.proto import worker_pb2
from ferry_agent.transport.worker_auth import (
    CLOCK_LEEWAY_S,
    NODE_NAME_EXTRA,
    AccessDenied,
    CachedReviewer,
    Review,
    ServedVersion,
    WatchedAssignments,
    WorkerAuth,
    _NamespaceView,
)
from ferry_agent.transport.worker_service import (
    RetryPolicy,
    TensorReadLeases,
    WorkerServer,
    get_tensor_manifest,
    prepare_tensor_read,
    release_tensor_read,
)
from tests.support.workers import IDENTITY, FakeClock, code_of, manifest_proto

pytestmark = pytest.mark.unit

WORKER_AUDIENCE = worker_audience("source-node")  # the audience the source under test reviews for


def _subject(token: str) -> str:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["sub"]


AGENT = "system:serviceaccount:ferry-system:ferry-agent"
SERVED = ServedVersion("ns", "m", "v1")


WALL = 1_800_000_000.0  # the fake wall clock's start (token `exp` and `nbf` are wall-clock times)


def jwt(sub: str, *, aud: object = WORKER_AUDIENCE, exp: object = WALL + 3600, **claims: object) -> str:
    """An unsigned JWT-shaped token with these claims (`aud`/`exp` left out when None)."""

    def part(obj: object) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    body = {"sub": sub, **({"aud": aud} if aud is not None else {}), **({"exp": exp} if exp is not None else {})}
    return f"{part({'alg': 'RS256'})}.{part({**body, **claims})}.c2ln"


class FakeReviewer:
    """Tokens are `user@node`, `user` (no node extra) or `bad` (not authenticated), bare or as the `sub` of a `jwt`;
    `down` raises."""

    def __init__(self, audience: str = WORKER_AUDIENCE) -> None:
        self.audience = audience
        self.calls = 0
        self.down = False

    def review(self, token: str) -> Review:
        self.calls += 1
        if self.down:
            raise ConnectionError("apiserver unreachable")
        subject = _subject(token) if token.count(".") == 2 else token
        if subject == "bad":
            return Review(False, error="invalid bearer token")
        user, _, node = subject.partition("@")
        return Review(True, username=user, extra={NODE_NAME_EXTRA: [node]} if node else {})


def caching(reviewer: FakeReviewer, **kwargs: float) -> tuple[CachedReviewer, FakeClock, FakeClock]:
    """A `CachedReviewer` on fake clocks: (cache, monotonic clock, wall clock at `WALL`)."""
    clock, wall = FakeClock(), FakeClock()
    wall.now = WALL
    return CachedReviewer(reviewer, clock=clock, wall_clock=wall, **kwargs), clock, wall


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
    auth = WorkerAuth(caching(reviewer)[0], assignments, [AGENT])
    srv = WorkerServer(manifest_proto(), guard=auth.guard(SERVED))
    srv.start()
    try:
        good = token(jwt(f"{AGENT}@node-a"))
        reviewer.down = True
        assert code_of(lambda: prepare_tensor_read(srv.endpoint, IDENTITY, credentials=good)) == (
            grpc.StatusCode.UNAVAILABLE
        )
        reviewer.down = False
        prepare_tensor_read(srv.endpoint, IDENTITY, credentials=good).close()
    finally:
        srv.stop(0)


def test_review_cache_keeps_successes_60s_and_refusals_2s() -> None:
    reviewer = FakeReviewer()
    cached, clock, _ = caching(reviewer)
    good, bad = jwt(f"{AGENT}@node-a"), jwt("bad")
    for _ in range(3):
        assert cached.review(good).authenticated
        assert not cached.review(bad).authenticated
    assert reviewer.calls == 2
    clock.now += 2.1  # the refusal expired, the success did not
    cached.review(good)
    cached.review(bad)
    assert reviewer.calls == 3
    clock.now += 58
    cached.review(good)
    assert reviewer.calls == 4


def test_an_accepted_token_keeps_reading_through_an_outage_for_the_grace_only() -> None:
    reviewer = FakeReviewer()
    cached, clock, wall = caching(reviewer, outage_grace_s=600)
    good = jwt(f"{AGENT}@node-a")
    assert cached.review(good).authenticated
    assert not cached.review(jwt("bad")).authenticated
    reviewer.down = True
    clock.now += 300  # past the 60 s cache, inside the grace
    wall.now += 300
    assert cached.review(good).authenticated
    for never_accepted in ("bad", f"{AGENT}@node-b"):  # nobody the API did not accept gets in
        with pytest.raises(ConnectionError):
            cached.review(jwt(never_accepted))
    clock.now += 301
    wall.now += 301
    with pytest.raises(ConnectionError):
        cached.review(good)
    reviewer.down = False
    assert cached.review(good).authenticated


def test_no_acceptance_is_answered_from_the_cache_past_the_tokens_exp() -> None:
    reviewer = FakeReviewer()
    cached, clock, wall = caching(reviewer, outage_grace_s=600)
    short = jwt(f"{AGENT}@node-a", exp=WALL + 30)
    assert cached.review(short).authenticated and reviewer.calls == 1
    clock.now += 10
    wall.now += 10
    assert cached.review(short).authenticated and reviewer.calls == 1  # cached
    clock.now += 25  # inside the 60 s TTL, but past `exp` (inside the leeway): the API decides again
    wall.now += 25
    cached.review(short)
    assert reviewer.calls == 2

    # The outage grace ends at `exp` too: a token accepted a moment ago is not accepted after it expired.
    lasting = jwt(f"{AGENT}@node-a", exp=wall.now + 300)
    assert cached.review(lasting).authenticated
    reviewer.down = True
    clock.now += 200
    wall.now += 200
    assert cached.review(lasting).authenticated  # inside the grace and before `exp`
    clock.now += 101  # still inside the 600 s grace, 1 s past `exp`
    wall.now += 101
    with pytest.raises(ConnectionError):
        cached.review(lasting)
    wall.now += CLOCK_LEEWAY_S  # and past the leeway the token is refused without asking anybody
    calls = reviewer.calls
    refused = cached.review(lasting)
    assert not refused.authenticated and "expired" in refused.error and reviewer.calls == calls


def _part(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).rstrip(b"=").decode()


@pytest.mark.parametrize(
    ("bad_token", "why"),
    [
        ("not-a-jwt", "not a JWT"),
        ("a.b", "not a JWT"),
        (jwt(AGENT) + ".more", "not a JWT"),
        (jwt(AGENT).rsplit(".", 1)[0] + ".", "not a JWT"),  # no signature
        (jwt(AGENT)[:-1] + "+", "not a JWT"),  # not base64url
        ("e30." + _part('{"exp": 1') + ".c2ln", "not a JWT"),  # payload not JSON
        (_part("[]") + "." + jwt(AGENT).split(".", 1)[1], "JSON objects"),  # header not an object
        ("e30." + _part('"sub"') + ".c2ln", "JSON objects"),
        ("e30.\xff.c2ln", "not a JWT"),
        (jwt(AGENT, exp=None), "no valid `exp`"),
        (jwt(AGENT, exp="4102444800"), "no valid `exp`"),
        (jwt(AGENT, exp=True), "no valid `exp`"),
        ("e30." + _part('{"exp": NaN, "aud": "ferry.dev/worker"}') + ".c2ln", "no valid `exp`"),
        (jwt(AGENT, exp=WALL - CLOCK_LEEWAY_S), "expired 30s ago"),
        (jwt(AGENT, exp=WALL - 86400), "expired"),
        (jwt(AGENT, nbf=WALL + CLOCK_LEEWAY_S + 1), "not valid for another"),
        (jwt(AGENT, nbf="soon"), "invalid `nbf`"),
        (jwt(AGENT, aud=None), "not for audience ferry.dev/worker"),
        (jwt(AGENT, aud="ferry.dev/other"), "not for audience ferry.dev/worker"),
        (jwt(AGENT, aud=["ferry.dev/other", "api"]), "not for audience ferry.dev/worker"),
        (jwt(AGENT, aud={"ferry.dev/worker": 1}), "not for audience ferry.dev/worker"),
    ],
)
def test_tokens_that_cannot_be_live_for_the_audience_are_refused_without_a_review(bad_token: str, why: str) -> None:
    reviewer = FakeReviewer()
    cached, _, _ = caching(reviewer)
    result = cached.review(bad_token)
    assert not result.authenticated and why in result.error
    assert reviewer.calls == 0 and len(cached) == 0  # no API call, no cache entry
    # Through WorkerAuth: UNAUTHENTICATED, saying why.
    with pytest.raises(AccessDenied) as info:
        WorkerAuth(cached, FakeAssignments(set()), [AGENT]).authenticate((("authorization", f"Bearer {bad_token}"),))
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED and why in str(info.value)


@pytest.mark.parametrize(
    "live",
    [
        jwt(AGENT),
        jwt(AGENT, aud=["api", WORKER_AUDIENCE]),
        jwt(AGENT, exp=WALL - CLOCK_LEEWAY_S + 1),  # a clock slightly ahead of the apiserver's
        jwt(AGENT, nbf=WALL + CLOCK_LEEWAY_S),  # or slightly behind
        jwt(AGENT, nbf=WALL - 60, iat=WALL - 60),
    ],
)
def test_tokens_that_can_be_live_go_to_the_review(live: str) -> None:
    reviewer = FakeReviewer()
    cached, _, _ = caching(reviewer)
    assert cached.review(live).authenticated and reviewer.calls == 1


def test_the_audience_checked_locally_is_the_reviewers() -> None:
    reviewer = FakeReviewer(audience=worker_audience("node-a"))
    cached, _, _ = caching(reviewer)
    result = cached.review(jwt(f"{AGENT}@node-b"))  # for another source: not what this server reviews for
    assert not result.authenticated and f"not for audience {worker_audience('node-a')}" in result.error
    assert reviewer.calls == 0
    assert cached.review(jwt(f"{AGENT}@node-b", aud=[worker_audience("node-a")])).authenticated
    assert reviewer.calls == 1


def test_the_review_cache_is_bounded_and_refusals_do_not_push_out_acceptances() -> None:
    reviewer = FakeReviewer()
    cached, clock, _ = caching(reviewer, max_entries=8)
    readers = [jwt(f"{AGENT}@node-{i}") for i in range(4)]
    for reader in readers:
        assert cached.review(reader).authenticated
    for i in range(1000):  # a flood of well-formed tokens the API refuses
        assert not cached.review(jwt("bad", jti=str(i))).authenticated
    assert len(cached) == 4 + 8
    reviewer.down = True  # the readers accepted before the outage are all still there
    clock.now += 120
    assert all(cached.review(reader).authenticated for reader in readers)
    reviewer.down = False

    for i in range(1000):  # a flood of tokens the API accepts: the least recently used go first
        cached.review(jwt(f"{AGENT}@flood-{i}"))
        if i % 4 == 0:
            cached.review(readers[0])
    assert len(cached) == 8  # (the refusals expired meanwhile)
    reviewer.down = True
    assert cached.review(readers[0]).authenticated
    with pytest.raises(ConnectionError):
        cached.review(readers[1])
    reviewer.down = False


def test_expired_reviews_are_purged() -> None:
    reviewer = FakeReviewer()
    cached, clock, wall = caching(reviewer, outage_grace_s=600)
    for i in range(10):
        cached.review(jwt("bad", jti=str(i)))
        cached.review(jwt(f"{AGENT}@node-{i}", exp=WALL + 120, jti=str(i)))
        cached.review(jwt(f"{AGENT}@node-{i}", exp=WALL + 3600, jti=str(i)))
    assert len(cached) == 30
    clock.now += 2.5  # past the refusals' TTL
    cached.review(jwt(f"{AGENT}@node-0"))
    assert len(cached) == 21
    wall.now += 121  # past the short tokens' `exp`
    clock.now += 1
    cached.review(jwt(f"{AGENT}@node-0"))
    assert len(cached) == 11
    clock.now += 601  # past TTL and outage grace
    wall.now += 601
    cached.review(jwt(f"{AGENT}@node-0"))
    assert len(cached) == 1


def test_assignments_answer_from_the_last_view_while_the_api_is_down_for_the_grace_only() -> None:
    class Down:
        def assigned(self, node: str, served: ServedVersion) -> bool:
            raise ConnectionError("apiserver unreachable")

    clock = FakeClock()
    view = WatchedAssignments(client.ApiClient(), direct=Down(), outage_grace_s=600, clock=clock)
    ns_view = _NamespaceView.__new__(_NamespaceView)  # no watch thread: the test plays the watch
    ns_view._lock, ns_view._clock = threading.Lock(), clock
    ns_view._items = {
        "wr": {"metadata": {"name": "wr"}, "spec": {"nodeName": "node-a", "modelName": "m", "version": "v1"}}
    }
    ns_view._lost_at, ns_view.closed = None, False
    view._views[("ns", "m")] = ns_view
    assert view.assigned("node-a", SERVED)
    ns_view._lost_at = clock.now  # the watch ended and the API does not answer
    clock.now += 300
    assert view.assigned("node-a", SERVED)
    assert not view.assigned("node-b", SERVED)
    clock.now += 301
    with pytest.raises(ConnectionError):
        view.assigned("node-a", SERVED)


def test_an_idle_view_stops_only_once_in_sync_so_an_outage_keeps_its_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle view out of sync (the API down) keeps trying instead of stopping: a stopped view is replaced by an
    empty one, which could not answer within the outage grace."""
    clock = FakeClock()
    ns_view = _NamespaceView.__new__(_NamespaceView)  # no thread: the test runs the loop
    ns_view._lock, ns_view._clock, ns_view._namespace = threading.Lock(), clock, "ns"
    ns_view._items, ns_view._lost_at, ns_view.closed = {}, clock.now, False
    ns_view._idle_s, ns_view.used_at = 10.0, clock.now - 60  # long idle
    tries = []

    def list_and_watch() -> None:
        tries.append(clock.now)
        if len(tries) < 3:
            raise ConnectionError("apiserver unreachable")
        with ns_view._lock:
            ns_view._lost_at = None  # listed: in sync again (and the watch returns, idle)

    ns_view._list_and_watch = list_and_watch
    monkeypatch.setattr(worker_auth.time, "sleep", lambda seconds: None)
    ns_view._run()
    assert len(tries) == 3 and ns_view.closed


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
