"""Which condition changes the operator posts as Events, and which as Warnings (`ferry_operator.events`)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes.client.exceptions import ApiException

from ferry.api.models import EventAction
from ferry.chain import ChainResult
from ferry.storage import StorageReason, StorageReport
from ferry_operator import events as events_module
from ferry_operator.events import condition_action, condition_event, event_body
from ferry_operator.versions import plan_version_status
from tests.support.typed import weight_version

pytestmark = pytest.mark.unit

T0 = "2026-01-01T00:00:00Z"


def c(status: str, reason: str) -> dict:
    return {"status": status, "reason": reason, "message": "m"}


WARN, NORMAL, NONE = True, False, None


@pytest.mark.parametrize(
    ("type_", "before", "after", "expected"),
    [
        # A normal ModelLoad create: only Ready=True is news, and it is Normal.
        ("Ready", None, c("False", "ReplicasNotReady"), NONE),
        ("Ready", None, c("False", "VersionNotReady"), NONE),
        ("Ready", c("False", "VersionNotReady"), c("False", "ReplicasNotReady"), NONE),
        ("Degraded", None, c("False", "AsExpected"), NONE),
        ("PeerStalled", None, c("False", "NotStalled"), NONE),
        ("Progressing", None, c("True", "Loading"), NONE),
        ("Ready", c("False", "ReplicasNotReady"), c("True", "AllReplicasReady"), NORMAL),
        # A rollout: Ready goes False while the replicas move, and back.
        ("Ready", c("True", "AllReplicasReady"), c("False", "ReplicasNotReady"), NORMAL),
        # Problems are Warnings, also at birth and when the problem changes; their end is Normal.
        ("Ready", None, c("False", "VersionNotFound"), WARN),
        ("Ready", c("False", "ReplicasNotReady"), c("False", "ReplicaFailed"), WARN),
        ("Ready", c("False", "ReplicaFailed"), c("False", "ReplicasNotReady"), NORMAL),
        ("Degraded", c("False", "AsExpected"), c("True", "ReplicaStale"), WARN),
        ("Degraded", c("True", "ReplicaStale"), c("True", "ReplicaFailed"), WARN),
        ("Degraded", c("True", "ReplicaStale"), c("False", "AsExpected"), NORMAL),
        ("PeerStalled", c("False", "NotStalled"), c("True", "NoProgress"), WARN),
        # WeightVersions: Ready says it all; waiting on a base or a verification is no problem.
        ("Ready", None, c("True", "Verified"), NORMAL),
        ("Ready", None, c("False", "BaseNotReady"), NONE),
        ("Ready", None, c("False", "ObjectMissing"), WARN),
        ("Ready", c("False", "BaseNotReady"), c("False", "BaseNotFound"), WARN),
        # A deletion waiting for what still needs the version is normal; its release is the Released Event.
        ("Ready", c("True", "Verified"), c("False", "ReleaseBlocked"), NORMAL),
        ("Ready", c("False", "ReleaseBlocked"), c("False", "Releasing"), NONE),
        ("ChainResolved", None, c("True", "Resolved"), NONE),
        ("StorageVerified", c("Unknown", "VerificationPending"), c("False", "ObjectMissing"), NONE),
        # No change, no Event (a resync).
        ("Ready", c("False", "ObjectMissing"), c("False", "ObjectMissing"), NONE),
        ("Ready", c("True", "AllReplicasReady"), c("True", "AllReplicasReady"), NONE),
    ],
)
def test_condition_events(type_, before, after, expected):
    assert condition_event(type_, before, after) is expected


def posted(monkeypatch) -> list[tuple[str, bool]]:
    """(reason, warning) of each Event posted from now on."""
    seen: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        events_module.EVENTS, "post", lambda obj, *, reason, warning=False, **_: seen.append((reason, warning))
    )
    return seen


WV = {"apiVersion": "ferry.dev/v1alpha1", "kind": "WeightVersion", "metadata": {"name": "v1", "namespace": "ns"}}


def test_a_new_version_becoming_ready_is_no_event_and_a_resync_none(monkeypatch):
    """The normal end of a create is not news (thousands at once would be a fifth of the apiserver's work); its
    status says it. Ready ending a problem is (the Warning's end), and so is Ready lost and regained."""
    seen = posted(monkeypatch)
    chain = ChainResult(ok=True, reason="Resolved", message="chain of 1", chain=("v1",))
    ok = StorageReport(ok=True, reason=StorageReason.Verified, message="ok", total_bytes=1, tensor_count=1)
    first = plan_version_status(weight_version("v1"), chain, ok, now=T0).patch(None)
    events_module.emit_transitions(WV, [], first["conditions"], {}, first_ready=True)
    assert seen == []
    again = plan_version_status(weight_version("v1", status=first), chain, ok, now=T0).patch(None)
    old = {x["type"]: x for x in first["conditions"]}
    assert all(condition_event(x["type"], old[x["type"]], x) is None for x in again["conditions"])

    missing = [c("False", "ObjectMissing") | {"type": "Ready"}]
    events_module.emit_transitions(WV, [], missing, announced := {}, first_ready=True)
    ready = [c("True", "Verified") | {"type": "Ready"}]
    events_module.emit_transitions(WV, missing, ready, announced, first_ready=True)
    assert seen == [("ObjectMissing", True), ("Verified", False)]
    # A base that was missing, then not ready yet, then Ready: the story began with an Event, it ends with one.
    waiting = [c("False", "BaseNotReady") | {"type": "Ready"}]
    events_module.emit_transitions(
        WV, [], [c("False", "BaseNotFound") | {"type": "Ready"}], announced := {}, first_ready=True
    )
    events_module.emit_transitions(
        WV, [c("False", "BaseNotFound") | {"type": "Ready"}], waiting, announced, first_ready=True
    )
    events_module.emit_transitions(WV, waiting, ready, announced, first_ready=True)
    assert seen[2:] == [("BaseNotFound", True), ("BaseNotReady", False), ("Verified", False)]
    del seen[2:]
    lost = [c("False", "BaseNotReady") | {"type": "Ready"}]
    events_module.emit_transitions(WV, [c("True", "Verified") | {"type": "Ready"}], lost, {}, first_ready=False)
    events_module.emit_transitions(WV, lost, [c("True", "Verified") | {"type": "Ready"}], {}, first_ready=False)
    assert seen[2:] == [("BaseNotReady", False), ("Verified", False)]


def test_engines_attached_flips_are_normal_events_and_its_birth_is_none():
    attached = {"status": "True", "reason": "Attached"}
    none = {"status": "False", "reason": "NoEngines"}
    older = {"status": "False", "reason": "EnginesOnOlderVersion"}
    assert condition_event("EnginesAttached", None, none) is None
    assert condition_event("EnginesAttached", none, attached) is False
    assert condition_event("EnginesAttached", attached, older) is False
    assert condition_event("EnginesAttached", none, older) is None


def test_every_event_body_names_its_action_and_the_operator():
    wv = {"apiVersion": "ferry.dev/v1alpha1", "kind": "WeightVersion", "metadata": {"name": "v1", "namespace": "ns"}}
    body = event_body(
        wv | {"metadata": wv["metadata"] | {"uid": "u1"}},
        reason="ObjectMissing",
        message="x" * 2000,
        action=EventAction.VERIFY,
        warning=True,
        instance="op-0",
        now=T0,
    )
    assert (body["type"], body["reason"], body["action"]) == ("Warning", "ObjectMissing", "Verify")
    assert (body["reportingComponent"], body["source"], body["reportingInstance"]) == (
        "ferry-operator",
        {"component": "ferry-operator"},
        "op-0",
    )
    assert body["involvedObject"] == {
        "apiVersion": "ferry.dev/v1alpha1",
        "kind": "WeightVersion",
        "name": "v1",
        "namespace": "ns",
        "uid": "u1",
    }
    assert len(body["message"]) == 1024 and body["metadata"] == {"namespace": "ns", "generateName": "ferry-operator-"}


@pytest.mark.parametrize(
    ("kind", "type_", "reason", "action"),
    [
        ("WeightVersion", "Ready", "Verified", "Verify"),
        ("WeightVersion", "Ready", "ObjectMissing", "Verify"),
        ("WeightVersion", "Ready", "ReleaseBlocked", "Release"),
        ("ModelLoad", "Ready", "AllReplicasReady", "Serve"),
        ("ModelLoad", "Degraded", "ReplicaStale", "Serve"),
        ("ModelLoad", "PeerStalled", "NoProgress", "Load"),
        ("ModelLoad", "EnginesAttached", "Attached", "Attach"),
    ],
)
def test_condition_events_have_the_action_of_their_condition(kind, type_, reason, action):
    assert condition_action(kind, type_, reason) == action


def test_the_poster_retries_an_event_without_holding_up_the_others(monkeypatch):
    posted: list[str] = []
    tried: list[str] = []
    failures = {"first": 1}

    async def create_event(namespace: str, body: dict) -> None:
        tried.append(body["message"])
        if body["message"] == "terminating":
            refused = ApiException(status=403, reason="Forbidden")
            raise refused
        if failures.get(body["message"], 0):
            failures[body["message"]] -= 1
            raise OSError("apiserver restarting")
        posted.append(body["message"])

    monkeypatch.setattr(events_module.kubeaio, "create_event", create_event)
    monkeypatch.setattr(events_module, "POST_BACKOFFS", (0.05,))
    ml = {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelLoad", "metadata": {"name": "m", "namespace": "ns"}}

    async def scenario() -> None:
        poster = events_module.EventPoster(workers=2)
        poster.post(ml, reason="ReplicaCreated", message="before start", action=EventAction.CREATE_REPLICA)
        poster.start("op-0")
        for message in ("first", "terminating", "second"):
            poster.post(ml, reason="ReplicaCreated", message=message, action=EventAction.CREATE_REPLICA)
        for _ in range(100):
            if len(posted) == 2:
                break
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert posted == ["second", "first"]  # the first failed once and went after its retry
    assert tried.count("terminating") == 1  # a namespace being deleted takes no Event, now or later
