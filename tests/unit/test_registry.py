"""Which WeightReplicas are offered as P2P sources: Serving, exact version, same rank, live Lease, not self."""

from __future__ import annotations

import datetime as dt

import pytest

from ferry.api.models import GROUP, LABEL_NODE, REPLICA_LEASE_PREFIX
from ferry_agent.kube.registry import (
    first_loader,
    holder_candidates,
    lease_body,
    lease_is_live,
    lease_name,
    peer_version_problem,
    source_candidates,
)

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def ts(seconds_ago: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def wr(name, *, phase="Serving", version="v1", rank=0, state="Ready", deleting=False, leases=None):
    meta = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = ts(1)
    return {
        "metadata": meta,
        "status": {
            "phase": phase,
            "version": version,
            "activeLeases": leases,
            "ranks": [
                {
                    "rank": rank,
                    "agentName": f"agent-{name}",
                    "grpcEndpoint": f"127.0.0.1:{5000 + rank}",
                    "tensorCount": 3,
                    "manifestDigest": "abc",
                    "state": state,
                }
            ],
        },
    }


def live(*names, age=1.0):
    return {lease_name(n): lease_body(n, f"agent-{n}", ts(age), duration=15, node=f"node-{n}") for n in names}


def names(cands):
    return [c.replica for c in cands]


def test_only_live_serving_replicas_of_the_exact_version_and_rank():
    replicas = [
        wr("good", leases=2),
        wr("loading", phase="Loading"),
        wr("stale-lease"),
        wr("other-version", version="v2"),
        wr("other-rank", rank=1),
        wr("draining", state="Draining"),
        wr("deleting", deleting=True),
        wr("me"),
    ]
    leases = {
        **live("good", "loading", "other-version", "other-rank", "draining", "deleting", "me"),
        **live("stale-lease", age=60),
    }
    cands = source_candidates(replicas, leases, version="v1", rank=0, self_replica="me", now=NOW)
    assert names(cands) == ["good"]
    c = cands[0]
    assert (c.agent_name, c.grpc_endpoint, c.manifest_digest, c.active_leases) == (
        "agent-good",
        "127.0.0.1:5000",
        "abc",
        2,
    )
    assert c.label == "peer/good"


def test_a_lease_written_by_another_node_does_not_make_a_source():
    replicas = [{**wr("a"), "spec": {"nodeName": "node-a"}}, {**wr("b"), "spec": {"nodeName": "node-b"}}]
    squatted = {lease_name("a"): lease_body("a", "agent-c", ts(1), duration=15, node="node-c"), **live("b")}
    cands = source_candidates(replicas, squatted, version="v1", rank=0, self_replica="x", now=NOW)
    assert names(cands) == ["b"]


def test_a_candidate_names_its_node_which_its_worker_token_is_for():
    replicas = [{**wr("a"), "spec": {"nodeName": "node-a"}}]
    leases = {lease_name("a"): lease_body("a", "agent-a", ts(1), duration=15, node="node-a")}
    (cand,) = source_candidates(replicas, leases, version="v1", rank=0, self_replica="x", now=NOW)
    assert cand.node == "node-a"


def test_no_lease_means_not_a_source():
    assert source_candidates([wr("a")], {}, version="v1", rank=0, self_replica="x", now=NOW) == []


@pytest.mark.parametrize(("age", "expected"), [(0, True), (14.9, True), (15.1, False)])
def test_lease_liveness_boundary(age, expected):
    assert lease_is_live(lease_body("a", "h", ts(age), duration=15, node="n"), NOW) is expected
    assert not lease_is_live(None, NOW)


def test_lease_is_labelled_with_replica_and_node():
    """The chart's admission policy admits an agent's Lease write only when this label names the agent's node."""
    meta = lease_body("m-node-a", "node-a-1234", ts(0), node="node-a")["metadata"]
    assert meta["name"] == lease_name("m-node-a") and meta["name"].startswith(REPLICA_LEASE_PREFIX)
    assert meta["labels"] == {f"{GROUP}/replica": "m-node-a", LABEL_NODE: "node-a"}


def test_with_a_version_uid_only_replicas_of_that_very_weightversion():
    """A deleted and republished name is another version: replicas of the old object are never sources."""
    replicas = [wr("same"), wr("old"), wr("unknown")]
    replicas[0]["status"]["versionUid"] = "uid-2"
    replicas[1]["status"]["versionUid"] = "uid-1"
    leases = live("same", "old", "unknown")
    kwargs = {"version": "v1", "rank": 0, "self_replica": "me", "now": NOW}
    assert names(source_candidates(replicas, leases, **kwargs, version_uid="uid-2")) == ["same"]
    assert names(source_candidates(replicas, leases, **kwargs)) == ["same", "old", "unknown"]


def test_peer_version_problem_needs_an_existing_ready_version_of_the_model():
    def body(model="m", ready="True", deleting=False):
        meta = {"name": "v1", "uid": "u", **({"deletionTimestamp": ts(1)} if deleting else {})}
        conditions = [{"type": "Ready", "status": ready}]
        return {"metadata": meta, "spec": {"modelName": model}, "status": {"conditions": conditions}}

    assert peer_version_problem(body(), name="v1", model="m") is None
    assert peer_version_problem(None, name="v1", model="m") == "WeightVersion v1 does not exist"
    assert "not Ready" in peer_version_problem(body(ready="False"), name="v1", model="m")
    assert "for model 'other'" in peer_version_problem(body(model="other"), name="v1", model="m")
    assert "being deleted" in peer_version_problem(body(deleting=True), name="v1", model="m")


def loading(name, *, version="v1", uid="u1", moving_from=None, rank=0, world=1, endpoint=True):
    status = {"phase": "Serving", "version": moving_from, "loadingVersion": version} if moving_from else {}
    status = status or {"phase": "Loading", "version": version}
    status["loadingVersionUid"] = uid
    if endpoint:
        entry = {"rank": rank, "agentName": f"a-{name}", "grpcEndpoint": f"{name}:1", "state": "Loading"}
        status["loadingRanks"] = [entry]
    spec = {"version": version, "nodeName": f"node-{name}", "ranks": world}
    return {"metadata": {"name": name}, "spec": spec, "status": status}


def test_holders_are_replicas_loading_that_very_version_object_with_an_endpoint():
    replicas = [
        loading("a"),
        loading("b", moving_from="v0"),  # make-before-break: serves v0, loads v1
        loading("c", uid="u-old"),  # another object of the name
        loading("d", version="v2"),
        loading("e", endpoint=False),  # not serving its load (yet)
        loading("f", rank=1),
        loading("g", world=2),
        loading("me"),
    ]
    found = holder_candidates(replicas, version="v1", rank=0, self_replica="me", version_uid="u1")
    assert names(found) == ["a", "b"]
    assert all(c.loading and c.node == f"node-{c.replica}" for c in found)


def test_first_loader_skips_replicas_found_dead():
    replicas = [loading("a"), loading("b"), loading("c")]
    assert first_loader(replicas, version="v1", self_replica="c") == "a"
    assert first_loader(replicas, version="v1", self_replica="c", exclude={"a"}) == "b"
    assert first_loader(replicas, version="v1", self_replica="c", exclude={"a", "b"}) == "c"
