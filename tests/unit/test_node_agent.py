"""The node agent's reconcile (`ferry_agent.node_agent`) over fake WeightReplica and Lease APIs: the status it writes
for a load that fails and for one that succeeds, and make-before-break (`loadingVersion`) when the version moves.

A rank's load itself (`replica_load.load_rank`) and its worker service (`serve_rank`) are fakes that record what
happens, in order, in `events`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from ferry.api.models import LABEL_NODE, AttemptOutcome, AttemptReason, ReplicaPhase, ReplicaReason, replica_lease_name
from ferry_agent import node_agent
from ferry_agent.node_agent import NodeAgent
from ferry_agent.strategies.chain import LoadContext, StrategyFailed
from tests.support.kube_fakes import FakeLeases, FakeObjects, fake_agent

pytestmark = pytest.mark.unit

KEY = ("ns", "wr")
LEASE = replica_lease_name("wr")


def replica(version: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "wr", "generation": 1},
        "spec": {"nodeName": "n1", "version": version, "modelName": "m", "device": "cpu", "ranks": 1},
    }


@dataclass
class Resident:
    version: str
    host: None = None


@dataclass
class Result:
    resident: Resident
    source_label: str = "peer/other"
    bytes_moved: int = 1024


class Server:
    def __init__(self, version: str, events: list[str]) -> None:
        self.version, self.events = version, events
        self.endpoint = f"127.0.0.1:{version}"
        self.leases = type("Leases", (), {"active_count": staticmethod(lambda: 0)})()

    def drain(self, seconds: float) -> None:
        self.events.append(f"drain {self.version}")

    def stop(self) -> None:
        self.events.append(f"stop {self.version}")


class Loads:
    """`load_rank` and `serve_rank` for the agent: versions in `failing` fail (every peer unavailable)."""

    def __init__(self, objects: FakeObjects) -> None:
        self.objects = objects
        self.events: list[str] = []
        self.failing: set[str] = set()
        self.seen_during_load: list[dict[str, Any]] = []
        self.reports: list[tuple[int, int, str]] = []  # progress each load reports, in order
        self.then: Callable[[], None] = lambda: None  # what a load does after its reports

    def load_rank(self, group, ctx: LoadContext, *, configured: str, **kwargs: Any) -> Result:  # type: ignore[no-untyped-def]
        self.events.append(f"load {configured}")
        self.seen_during_load.append(merged(self.objects))
        for report in self.reports:
            kwargs["progress"](*report)
        self.then()
        ctx.version, ctx.version_uid = configured, f"uid-{configured}"
        if configured in self.failing:
            ctx.record("peer/other", AttemptOutcome.FAILED, AttemptReason.SOURCE_UNAVAILABLE, "UNAVAILABLE: refused")
            raise StrategyFailed("no peer source succeeded", mutated=False)
        ctx.record("Peer", AttemptOutcome.LOADED, AttemptReason.LOADED)
        return Result(Resident(configured))

    def serve_rank(self, resident: Resident, peer, **kwargs: Any) -> tuple[Server, dict[str, Any]]:  # type: ignore[no-untyped-def]
        self.events.append(f"serve {resident.version}")
        server = Server(resident.version, self.events)
        return server, {"rank": 0, "agentName": peer.name, "grpcEndpoint": server.endpoint, "state": "Ready"}


def merged(objects: FakeObjects) -> dict[str, Any]:
    """The replica's status as the apiserver holds it after the merge patches so far."""
    status: dict[str, Any] = {}
    for patch in objects.patches:
        status.update(patch)
    return status


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[NodeAgent, FakeObjects, FakeLeases, Loads]]:
    objects, leases = FakeObjects(down=False), FakeLeases()
    loads = Loads(objects)
    monkeypatch.setattr(node_agent, "load_rank", loads.load_rank)
    monkeypatch.setattr(node_agent, "serve_rank", loads.serve_rank)
    a = fake_agent(objects, leases, retry_seconds=60)
    yield a, objects, leases, loads
    a.leases.release(KEY)  # ends the renewing thread


def test_a_load_that_succeeds_serves_with_its_lease(agent) -> None:
    a, objects, leases, loads = agent
    objects.items = [replica("v1")]
    a.reconcile_once()
    assert objects.patches[0]["phase"] == ReplicaPhase.LOADING and objects.patches[0]["version"] == "v1"
    status = merged(objects)
    assert (status["phase"], status["version"], status["loadingVersion"], status["reason"]) == (
        ReplicaPhase.SERVING,
        "v1",
        None,
        None,
    )
    assert (status["source"], status["bytesDone"], status["versionUid"]) == ("peer/other", 1024, "uid-v1")
    assert [(x["source"], x["outcome"], x["reason"]) for x in status["attempts"]] == [("Peer", "Loaded", "Loaded")]
    assert [r["grpcEndpoint"] for r in status["ranks"]] == ["127.0.0.1:v1"]
    lease = leases.leases[LEASE]
    assert lease["spec"]["holderIdentity"] == a.agent_name and lease["metadata"]["labels"][LABEL_NODE] == "n1"
    patches = len(objects.patches)
    objects.items[0]["status"] = status
    a.reconcile_once()  # served and said so: nothing is loaded or written again
    assert loads.events == ["load v1", "serve v1"] and len(objects.patches) == patches


def test_a_fast_load_writes_its_progress_with_its_serving_patch_not_on_its_own(agent) -> None:
    """Every status write is an event to the operator and to every agent watching the namespace's replicas."""
    a, objects, _, loads = agent
    loads.reports = [(0, 0, "peer/a"), (0, 100, "peer/a"), (40, 100, "peer/b")]
    objects.items = [replica("v1")]
    a.reconcile_once()
    assert [p.get("phase") for p in objects.patches] == [ReplicaPhase.LOADING, ReplicaPhase.SERVING]
    assert merged(objects)["source"] == "peer/other"  # the load's result, not its last report


def test_a_slow_load_writes_the_progress_of_its_first_seconds_then_even_if_it_reports_nothing_more(
    agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load stuck on a peer right after its first report still names that peer in its status (what the ModelLoad's
    PeerStalled condition quotes), once the quiet start is over; later reports are written as they come."""
    a, objects, _, loads = agent
    monkeypatch.setattr(node_agent, "QUIET_START_S", 0.05)
    seen: list[dict[str, Any]] = []

    def stuck() -> None:
        time.sleep(0.5)
        seen.append(merged(objects))
        loads.reports = []

    loads.reports = [(0, 100, "peer/a")]
    loads.then = stuck
    objects.items = [replica("v1")]
    a.reconcile_once()
    assert (seen[0]["phase"], seen[0]["source"], seen[0]["bytesTotal"]) == (ReplicaPhase.LOADING, "peer/a", 100)
    assert [p.get("phase") for p in objects.patches] == [ReplicaPhase.LOADING, None, ReplicaPhase.SERVING]


def test_a_completion_waits_for_the_serving_patch_even_when_the_load_ends_after_its_quiet_start(
    agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, objects, _, loads = agent
    monkeypatch.setattr(node_agent, "QUIET_START_S", 0.05)
    loads.reports = [(100, 100, "peer/a")]
    loads.then = lambda: time.sleep(0.3)  # e.g. the target's synchronize, after every byte landed
    objects.items = [replica("v1")]
    a.reconcile_once()
    assert [p.get("phase") for p in objects.patches] == [ReplicaPhase.LOADING, ReplicaPhase.SERVING]


def test_a_load_that_fails_says_why_and_is_not_retried_before_its_backoff(agent) -> None:
    a, objects, leases, loads = agent
    loads.failing.add("v1")
    objects.items = [replica("v1")]
    a.reconcile_once()
    status = merged(objects)
    assert (status["phase"], status["version"], status["reason"]) == (
        ReplicaPhase.FAILED,
        "v1",
        ReplicaReason.LOAD_FAILED,
    )
    assert "no peer source succeeded" in status["message"]
    assert [(x["source"], x["outcome"], x["reason"]) for x in status["attempts"]] == [
        ("peer/other", "Failed", "SourceUnavailable")
    ]
    assert LEASE not in leases.leases and not a.leases.held(KEY)
    objects.items[0]["status"] = status
    a.reconcile_once()
    assert loads.events == ["load v1"], "retried only after --retry-seconds"
    objects.items = [replica("v2")]
    a.reconcile_once()
    assert loads.events == ["load v1", "load v2", "serve v2"], "a new version is tried at once"


def test_a_new_version_loads_next_to_the_served_one_which_is_released_only_after(agent) -> None:
    a, objects, leases, loads = agent
    objects.items = [replica("v1")]
    a.reconcile_once()
    objects.items = [{**replica("v2"), "status": merged(objects)}]
    before = len(objects.patches)
    a.reconcile_once()
    during = loads.seen_during_load[-1]
    assert (during["phase"], during["version"], during["loadingVersion"]) == (ReplicaPhase.SERVING, "v1", "v2")
    assert during["ranks"][0]["grpcEndpoint"] == "127.0.0.1:v1", "v1 stays the published source while v2 loads"
    assert loads.events == ["load v1", "serve v1", "load v2", "serve v2", "drain v1", "stop v1"]
    assert "phase" not in objects.patches[before], "the start of the v2 load leaves the phase (Serving v1) alone"
    status = merged(objects)
    assert (status["phase"], status["version"], status["loadingVersion"]) == (ReplicaPhase.SERVING, "v2", None)
    assert status["ranks"][0]["grpcEndpoint"] == "127.0.0.1:v2" and status["versionUid"] == "uid-v2"
    assert leases.leases[LEASE]["spec"]["holderIdentity"] == a.agent_name, "the Lease is kept across the switch"


def test_a_new_version_that_fails_leaves_the_served_one_serving(agent) -> None:
    a, objects, leases, loads = agent
    objects.items = [replica("v1")]
    a.reconcile_once()
    loads.failing.add("v2")
    objects.items = [{**replica("v2"), "status": merged(objects)}]
    a.reconcile_once()
    status = merged(objects)
    assert (status["phase"], status["version"], status["loadingVersion"], status["reason"]) == (
        ReplicaPhase.SERVING,
        "v1",
        "v2",
        ReplicaReason.LOAD_FAILED,
    )
    assert status["ranks"][0]["grpcEndpoint"] == "127.0.0.1:v1" and status["versionUid"] == "uid-v1"
    assert [x["reason"] for x in status["attempts"]] == ["SourceUnavailable"]
    assert "stop v1" not in loads.events and a.leases.held(KEY) and LEASE in leases.leases
    objects.items = [{**replica("v1"), "status": status}]  # spec back on the served version: the failure is moot
    a.reconcile_once()
    status = merged(objects)
    assert (status["phase"], status["version"], status["loadingVersion"]) == (ReplicaPhase.SERVING, "v1", None)
    assert loads.events.count("load v1") == 1, "nothing is reloaded"
