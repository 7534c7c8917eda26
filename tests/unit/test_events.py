"""Which condition changes the operator posts as Events, and which as Warnings (`ferry_operator.events`)."""

from __future__ import annotations

import pytest

from ferry.chain import ChainResult
from ferry.storage import StorageReason, StorageReport
from ferry_operator.events import condition_event
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
        ("PeerStalled", None, c("False", "Progressing"), NONE),
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
        ("PeerStalled", c("False", "Progressing"), c("True", "NoProgress"), WARN),
        # WeightVersions: Ready says it all; waiting on a base or a verification is no problem.
        ("Ready", None, c("True", "Verified"), NORMAL),
        ("Ready", None, c("False", "BaseNotReady"), NONE),
        ("Ready", None, c("False", "ObjectMissing"), WARN),
        ("Ready", c("False", "BaseNotReady"), c("False", "BaseNotFound"), WARN),
        ("Ready", c("True", "Verified"), c("False", "ReleaseBlocked"), WARN),
        ("Ready", c("False", "ReleaseBlocked"), c("False", "Releasing"), NORMAL),
        ("ChainResolved", None, c("True", "Resolved"), NONE),
        ("StorageVerified", c("Unknown", "VerificationPending"), c("False", "ObjectMissing"), NONE),
        # No change, no Event (a resync).
        ("Ready", c("False", "ObjectMissing"), c("False", "ObjectMissing"), NONE),
        ("Ready", c("True", "AllReplicasReady"), c("True", "AllReplicasReady"), NONE),
    ],
)
def test_condition_events(type_, before, after, expected):
    assert condition_event(type_, before, after) is expected


def test_a_verified_version_is_one_normal_event_and_a_resync_none():
    chain = ChainResult(ok=True, reason="Resolved", message="chain of 1", chain=("v1",))
    ok = StorageReport(ok=True, reason=StorageReason.Verified, message="ok", total_bytes=1, tensor_count=1)
    first = plan_version_status(weight_version("v1"), chain, ok, now=T0).patch(None)
    events = [(x["type"], condition_event(x["type"], None, x)) for x in first["conditions"]]
    assert [e for e in events if e[1] is not None] == [("Ready", False)]
    again = plan_version_status(weight_version("v1", status=first), chain, ok, now=T0).patch(None)
    old = {x["type"]: x for x in first["conditions"]}
    assert all(condition_event(x["type"], old[x["type"]], x) is None for x in again["conditions"])


def test_engines_attached_flips_are_normal_events_and_its_birth_is_none():
    attached = {"status": "True", "reason": "Attached"}
    none = {"status": "False", "reason": "NoEngines"}
    older = {"status": "False", "reason": "EnginesOnOlderVersion"}
    assert condition_event("EnginesAttached", None, none) is None
    assert condition_event("EnginesAttached", none, attached) is False
    assert condition_event("EnginesAttached", attached, older) is False
    assert condition_event("EnginesAttached", none, older) is None
