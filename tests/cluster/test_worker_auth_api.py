"""`worker_auth` against the real apiserver: TokenReview of real pod-bound tokens (audience, node-name extra,
revocation with the Pod), the local pre-checks and expiry cap of the review cache on real tokens, and the watched
WeightReplica assignments."""

from __future__ import annotations

import base64
import json
import time
import uuid

import pytest

from ferry.api.models import API_VERSION, LABEL_MODEL, LABEL_NODE, worker_audience
from ferry_agent.transport.worker_auth import (
    CLOCK_LEEWAY_S,
    NODE_NAME_EXTRA,
    ApiAssignments,
    CachedReviewer,
    Review,
    ServedVersion,
    TokenReviewer,
    WatchedAssignments,
)

pytestmark = pytest.mark.cluster


def _eventually(predicate, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_token_review_of_pod_bound_tokens(cluster, kube, tmp_path) -> None:
    reviewer = TokenReviewer(kube, worker_audience("source-node"))
    node = f"n-{uuid.uuid4().hex[:6]}"
    good = cluster.pod_token(node, worker_audience("source-node"), tmp_path / "good").read_text()
    review = reviewer.review(good)
    assert review.authenticated and review.username == "system:serviceaccount:ferry-system:ferry-agent"
    assert review.extra[NODE_NAME_EXTRA] == [node]

    for name, audience in (("other", "ferry.dev/other"), ("another-source", worker_audience("another-node"))):
        token = cluster.pod_token(node, audience, tmp_path / name).read_text()
        assert not reviewer.review(token).authenticated, audience

    # A bound token dies with its Pod: deleting the agent Pod revokes what it could read (once the apiserver's own
    # token cache, ~10 s, lets go).
    cluster.kubectl("delete", "pod", f"ferry-agent-{node}", "-n", "ferry-system", "--grace-period=0", "--force")
    _eventually(lambda: not reviewer.review(good).authenticated, "the token to die with its pod", timeout=30)


class CountingReviewer:
    """The real TokenReview, counted; `down` plays an apiserver outage."""

    def __init__(self, kube, audience: str) -> None:  # type: ignore[no-untyped-def]
        self._inner = TokenReviewer(kube, audience)
        self.audience = self._inner.audience
        self.calls = 0
        self.down = False

    def review(self, token: str) -> Review:
        self.calls += 1
        if self.down:
            raise ConnectionError("apiserver unreachable")
        return self._inner.review(token)


def _claims(token: str) -> dict:
    payload = token.split(".")[1]
    return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))


def test_real_tokens_are_prechecked_and_never_accepted_past_their_exp(cluster, kube, tmp_path) -> None:
    """TokenRequest issues nothing shorter than 10 minutes, so the wall clock of the cache moves instead: to before a
    real token's `nbf` and past its `exp`."""
    node = f"n-{uuid.uuid4().hex[:6]}"
    audience = worker_audience(node)
    good = cluster.pod_token(node, audience, tmp_path / "good").read_text()
    other = cluster.pod_token(node, "ferry.dev/other", tmp_path / "other").read_text()
    claims = _claims(good)
    reviewer = CountingReviewer(kube, audience)
    wall = [time.time()]
    cached = CachedReviewer(reviewer, wall_clock=lambda: wall[0])

    # Refused without a TokenReview: another audience's real token, garbage, a real token not valid yet.
    for refused, why in [(other, f"not for audience {audience}"), ("not-a-jwt", "not a JWT")]:
        result = cached.review(refused)
        assert not result.authenticated and why in result.error
    wall[0] = claims["nbf"] - CLOCK_LEEWAY_S - 1
    assert "not valid for another" in cached.review(good).error
    assert reviewer.calls == 0

    wall[0] = time.time()
    assert cached.review(good).authenticated and reviewer.calls == 1
    reviewer.down = True  # an outage: the acceptance answers from the cache...
    assert cached.review(good).authenticated and reviewer.calls == 1
    wall[0] = claims["exp"]  # ...but not once the token has expired, well inside the TTL and the outage grace
    with pytest.raises(ConnectionError):
        cached.review(good)
    reviewer.down = False
    wall[0] = claims["exp"] + CLOCK_LEEWAY_S  # and past the leeway nobody is asked
    calls = reviewer.calls
    result = cached.review(good)
    assert not result.authenticated and "expired" in result.error and reviewer.calls == calls


def test_a_view_no_grant_asks_stops_watching_and_the_next_grant_sees_the_api_of_now(cluster, kube, namespace) -> None:
    """An idle view stops (every replica write would be an event to it); what changed meanwhile is not missed."""
    direct_calls = []

    class CountingDirect(ApiAssignments):
        def assigned(self, node: str, served: ServedVersion) -> bool:
            direct_calls.append(node)
            return super().assigned(node, served)

    def replica(name: str, version: str) -> str:
        return json.dumps(
            {
                "apiVersion": API_VERSION,
                "kind": "WeightReplica",
                "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_NODE: "n1", LABEL_MODEL: "m"}},
                "spec": {"modelLoad": "ml", "modelName": "m", "version": version, "nodeName": "n1", "device": "cpu"},
            }
        )

    served = ServedVersion(namespace, "m", "v1")
    cluster.kubectl("apply", "-f", "-", input=replica("wr-1", "v1"))
    assignments = WatchedAssignments(kube, direct=CountingDirect(kube), idle_s=1.0)
    assert assignments.assigned("n1", served)
    view = assignments._views[(namespace, "m")]
    _eventually(lambda: view.snapshot()[1] is None, "the view in sync")
    calls = len(direct_calls)
    assert assignments.assigned("n1", served) and len(direct_calls) == calls  # answered by the view
    time.sleep(1.2)
    cluster.kubectl("apply", "-f", "-", input=replica("wr-2", "v1"))  # an event: the idle view stops on it
    _eventually(lambda: view.closed, "the idle view stopped")
    # Missed by the stopped view, which still says n1 holds v1: a grant must not believe it.
    cluster.kubectl("apply", "-f", "-", input=replica("wr-1", "v2"))
    cluster.kubectl("delete", "wr", "wr-2", "-n", namespace)
    assert any(wr["spec"]["version"] == "v1" for wr in view.snapshot()[0])
    _eventually(lambda: not assignments.assigned("n1", served), "n1 no longer on v1")
    assert assignments._views[(namespace, "m")] is not view, "a new view for the next grant"
    assert assignments.assigned("n1", ServedVersion(namespace, "m", "v2"))


def test_watched_assignments_follow_the_replicas(cluster, kube, namespace) -> None:
    direct_calls = []

    class CountingDirect:
        def assigned(self, node: str, served: ServedVersion) -> bool:
            direct_calls.append(node)
            return False

    assignments = WatchedAssignments(kube, direct=CountingDirect())
    served = ServedVersion(namespace, "m", "v1")
    assert assignments.assigned("n1", served) is False  # nothing assigned yet

    body = {
        "apiVersion": API_VERSION,
        "kind": "WeightReplica",
        "metadata": {"name": "wr-1", "namespace": namespace, "labels": {LABEL_NODE: "n1", LABEL_MODEL: "m"}},
        "spec": {"modelLoad": "ml", "modelName": "m", "version": "v1", "nodeName": "n1", "device": "cpu"},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    _eventually(lambda: assignments.assigned("n1", served), "the new replica in the watched view")
    calls = len(direct_calls)
    assert not assignments.assigned("n2", served)  # another node
    assert not assignments.assigned("n1", ServedVersion(namespace, "m", "v2"))  # another version
    assert len(direct_calls) == calls, "in sync: no API read per grant"
    assert not assignments.assigned("n1", ServedVersion(namespace, "other-model", "v1"))  # a view of its own
    # A replica of another model is not in this model's view (its writes are no events to it).
    other = json.loads(json.dumps(body))
    other["metadata"].update(name="wr-other", labels={LABEL_NODE: "n1", LABEL_MODEL: "other-model"})
    other["spec"]["modelName"] = "other-model"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(other))
    _eventually(
        lambda: assignments.assigned("n1", ServedVersion(namespace, "other-model", "v1")), "the other model's view"
    )
    assert [wr["metadata"]["name"] for wr in assignments._views[(namespace, "m")].snapshot()[0]] == ["wr-1"]

    cluster.kubectl("delete", "wr", "wr-1", "-n", namespace)
    _eventually(lambda: not assignments.assigned("n1", served), "the deletion in the watched view")
