"""Leader election rules (`ferry_operator.leadership.Elector`) against an in-memory Lease store with
resourceVersion conflicts, and a clock the test moves. The real apiserver and processes: tests/e2e/test_operator_ha.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from dataclasses import dataclass

import pytest
from kubernetes.client.exceptions import ApiException

from ferry_operator.leadership import ElectionConfig, Elector, Leadership

pytestmark = pytest.mark.unit


@dataclass
class Response:
    data: bytes


class Leases:
    """One namespace's Leases, with the apiserver's optimistic concurrency on replace."""

    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self.version = 0

    def _store(self, body: dict) -> Response:
        self.version += 1
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(self.version)
        self.objects[body["metadata"]["name"]] = body
        return Response(json.dumps(body).encode())

    def read_namespaced_lease(self, name, namespace, **_):
        if name not in self.objects:
            raise ApiException(status=404)
        return Response(json.dumps(self.objects[name]).encode())

    def create_namespaced_lease(self, namespace, body, **_):
        if body["metadata"]["name"] in self.objects:
            raise ApiException(status=409)
        return self._store(body)

    def replace_namespaced_lease(self, name, namespace, body, **_):
        if body["metadata"].get("resourceVersion") != self.objects[name]["metadata"]["resourceVersion"]:
            raise ApiException(status=409)
        return self._store(body)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def candidate(leases: Leases, clock: Clock, name: str) -> Elector:
    config = ElectionConfig("ns", "op", name, lease_duration=10, renew_deadline=7, retry_period=2)
    return Elector(leases, config, clock)  # type: ignore[arg-type]


def test_one_leader_a_standby_and_takeover_after_the_lease_duration_on_the_standbys_clock():
    leases, clock = Leases(), Clock()
    a, b = candidate(leases, clock, "a"), candidate(leases, clock, "b")
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    assert b.holder == "a" and leases.objects["op"]["spec"]["leaseTransitions"] == 0
    clock.now += 9
    assert a.try_acquire_or_renew(), "the holder renews"
    clock.now += 9.5
    assert not b.try_acquire_or_renew(), "renewed 9.5 s ago as b saw it: still valid"
    # a dies. Whatever renewTime says (another node's clock), b counts from when it saw the record change.
    leases.objects["op"]["spec"]["renewTime"] = "2000-01-01T00:00:00.000000Z"
    leases.objects["op"]["metadata"]["resourceVersion"] = "99"
    assert not b.try_acquire_or_renew(), "a changed record starts b's count again"
    clock.now += 10.5
    assert b.try_acquire_or_renew()
    spec = leases.objects["op"]["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"], spec["leaseDurationSeconds"]) == ("b", 1, 10)
    assert not a.try_acquire_or_renew() and a.holder == "b", "the old leader learns it lost"


def test_of_two_candidates_taking_an_expired_lease_one_wins():
    leases, clock = Leases(), Clock()
    a, b, c = (candidate(leases, clock, n) for n in "abc")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew() and not c.try_acquire_or_renew()
    clock.now += 11
    stale = copy.deepcopy(leases.objects["op"])
    assert b.try_acquire_or_renew()
    # c read the same record before b wrote: its write carries the old resourceVersion and is refused.
    leases.read_namespaced_lease = lambda *_, **__: Response(json.dumps(stale).encode())  # type: ignore[method-assign]
    assert not c.try_acquire_or_renew()
    assert leases.objects["op"]["spec"]["holderIdentity"] == "b"


def test_a_released_lease_is_taken_at_once_and_a_release_without_leading_writes_nothing():
    leases, clock = Leases(), Clock()
    a, b = candidate(leases, clock, "a"), candidate(leases, clock, "b")
    b.release()
    assert leases.objects == {}
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    a.release()
    assert leases.objects["op"]["spec"]["holderIdentity"] is None
    assert b.try_acquire_or_renew(), "no waiting for the duration"


def test_timing_must_leave_the_leader_time_to_stop():
    with pytest.raises(ValueError, match="renewDeadline"):
        ElectionConfig("ns", "op", "a", lease_duration=10, renew_deadline=10, retry_period=2)


@pytest.mark.parametrize("failure", ["apiserver away", "taken"])
def test_the_leader_stops_when_it_cannot_renew_or_the_lease_is_taken(failure):
    leases = Leases()
    config = ElectionConfig("ns", "op", "a", lease_duration=2, renew_deadline=0.5, retry_period=0.05)
    lost = threading.Event()
    why: list[str] = []
    leadership = Leadership(Elector(leases, config), on_lost=lambda m: (why.append(m), lost.set()))  # type: ignore[arg-type]
    asyncio.run(leadership.acquire())
    if failure == "taken":
        leases.objects["op"]["spec"]["holderIdentity"] = "b"
        leases.objects["op"]["metadata"]["resourceVersion"] = "99"
    else:

        def refuse(*_, **__):
            raise ApiException(status=503)

        leases.read_namespaced_lease = refuse  # type: ignore[method-assign]
    assert lost.wait(10), "the leader kept going"
    assert ("held by b" if failure == "taken" else "not renewed for 0.5s") in why[0]
    leadership.release()
