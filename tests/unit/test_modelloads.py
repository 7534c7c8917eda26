"""ModelLoad scheduling, rolling version changes and status aggregation, without a cluster."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from ferry.api.models import ModelLoad, merge_patch, replica_lease_name
from ferry.chain import VersionView
from ferry_operator.modelloads import (
    aggregate_status,
    choose_nodes,
    foreign_leases,
    holders,
    live_conditions,
    matching_nodes,
    plan_replicas,
    renewed_after_expiry,
    replica_body,
    replica_leases,
    replica_name,
    retarget_ops,
    stale_replicas,
    stall_deadline,
    stalled_replicas,
    version_problem,
)

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def ts(ago: float) -> str:
    return (NOW - dt.timedelta(seconds=ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def node(name, gpu=True, unschedulable=False):
    return {
        "metadata": {"name": name, "labels": {"gpu": "yes"} if gpu else {}},
        "spec": {"unschedulable": unschedulable},
    }


def ml(replicas=3, version="v2", status=None):
    return ModelLoad.from_body(
        {
            "metadata": {"name": "serve", "namespace": "ns", "uid": "u-1", "generation": 4},
            "spec": {
                "modelName": "m",
                "desiredVersion": version,
                "replicas": replicas,
                "nodeSelector": {"gpu": "yes"},
                "transfer": {"stallSeconds": 30},
            },
            "status": status or {},
        }
    )


def wr(node_name, version="v2", phase="Serving", **status):
    return {
        "metadata": {"name": replica_name("serve", node_name)},
        "spec": {"nodeName": node_name, "version": version},
        "status": {"phase": phase, "version": version, **status},
    }


def lease(node_name, ago=1, **spec):
    return {
        "metadata": {"labels": {"ferry.dev/node": node_name}},
        "spec": {"renewTime": ts(ago), "leaseDurationSeconds": 15, **spec},
    }


RA, RB, RC = (replica_name("serve", n) for n in "abc")


def live(*nodes):
    return {replica_lease_name(replica_name("serve", n)): lease(n) for n in nodes}


def test_choose_nodes_respects_selector_keeps_placements_and_prefers_holders():
    nodes = [node("a"), node("b"), node("c"), node("d"), node("cpu", gpu=False), node("cordoned", unschedulable=True)]
    chosen = choose_nodes(ml(replicas=3).spec, nodes, ["c"], ["d"], salt="s")
    assert chosen[:2] == ["c", "d"]
    assert len(chosen) == 3 and set(chosen) <= {"a", "b", "c", "d"}
    assert len(choose_nodes(ml(replicas=9).spec, nodes, [], [], salt="s")) == 4


def test_plan_creates_owned_replicas_and_scales_down():
    plan = plan_replicas(ml(replicas=2), [], [node("a"), node("b"), node("c")], [])
    assert len(plan.create) == 2 and not plan.delete
    names = [b["metadata"]["name"] for b in plan.create]
    assert names == sorted(names), "created in name order, so agents agree on the first loader"
    body = plan.create[0]
    owner = body["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("ModelLoad", "u-1", True)
    assert body["metadata"]["labels"]["ferry.dev/node"] == body["spec"]["nodeName"]
    assert body["spec"]["version"] == "v2"
    existing = [wr("a"), wr("b"), wr("c")]
    down = plan_replicas(ml(replicas=1), existing, [node("a"), node("b"), node("c")], [])
    assert len(down.delete) == 2 and not down.create


def test_version_change_rolls_one_replica_at_a_time():
    nodes = [node("a"), node("b"), node("c")]
    old = [wr("a", "v1"), wr("b", "v1"), wr("c", "v1")]
    first = plan_replicas(ml(version="v2"), old, nodes, [])
    assert len(first.retarget) == 1
    moving = [wr("a", "v2", phase="Loading"), wr("b", "v1"), wr("c", "v1")]
    assert plan_replicas(ml(version="v2"), moving, nodes, []).retarget == [], "wait while one is in flight"
    unseen = [wr("a", "v1"), wr("b", "v1"), wr("c", "v1")]
    unseen[0]["spec"]["version"] = "v2"  # retargeted, but its agent still serves v1
    assert plan_replicas(ml(version="v2"), unseen, nodes, []).retarget == []
    moved = [wr("a", "v2"), wr("b", "v1"), wr("c", "v1")]
    assert len(plan_replicas(ml(version="v2"), moved, nodes, []).retarget) == 1


def conds(status):
    return {c.type: c for c in status.conditions}


def test_all_serving_is_ready():
    replicas = [wr("a"), wr("b"), wr("c")]
    status = aggregate_status(ml(), replicas, live("a", "b", "c"), nodes_available=3, now=NOW, now_text=ts(0))
    c = conds(status)
    assert status.ready == "3/3" and status.phase == "Ready" and status.loadedVersion == "v2"
    assert (c["Ready"].status, c["Ready"].reason) == ("True", "AllReplicasReady")
    assert c["Progressing"].status == "False" and c["Degraded"].status == "False"
    assert c["PeerStalled"].status == "False"
    assert all(x.observedGeneration == 4 for x in c.values())


def test_a_resync_of_an_unchanged_load_writes_nothing():
    replicas = [wr("a"), wr("b"), wr("c", phase="Loading")]
    first = aggregate_status(ml(), replicas, live("a", "b", "c"), nodes_available=3, now=NOW, now_text=ts(0))
    written = merge_patch(None, first)
    again = aggregate_status(
        ml(status=written), replicas, live("a", "b", "c"), nodes_available=3, now=NOW, now_text=ts(-60)
    )
    assert again == ml(status=written).status and merge_patch(first, again) == written


def test_expired_lease_is_stale_and_degraded():
    replicas = [wr("a"), wr("b"), wr("c")]
    status = aggregate_status(ml(), replicas, live("a", "b"), nodes_available=3, now=NOW, now_text=ts(0))
    c = conds(status)
    assert status.readyReplicas == 2 and status.phase == "Degraded"
    assert c["Degraded"].reason == "ReplicaStale" and replica_name("serve", "c") in c["Degraded"].message


def test_staleness_is_derived_from_the_lease_every_time():
    """Level-based: a replica whose Lease is renewed again is not stale, whatever was recorded before."""
    recorded = live_conditions([wr("c")], {}, NOW, ts(0))[RC]  # the Lease is gone: Live=False
    back = [wr("a"), wr("b"), wr("c", conditions=recorded)]
    assert stale_replicas(back, live("a", "b"), NOW) == [RC]
    assert stale_replicas(back, live("a", "b", "c"), NOW) == []
    status = aggregate_status(ml(), back, live("a", "b", "c"), nodes_available=3, now=NOW, now_text=ts(0))
    assert status.phase == "Ready" and conds(status)["Degraded"].status == "False"
    assert stale_replicas([wr("c", phase="Loading")], {}, NOW) == [], "no Lease is expected before it loaded"


def test_live_condition_follows_the_lease_and_is_written_only_on_change():
    expired = {replica_lease_name(RA): lease("a", 20, holderIdentity="agent-a")}
    first = live_conditions([wr("a")], expired, NOW, ts(0))[RA]
    (cond,) = first
    assert (cond["type"], cond["status"], cond["reason"]) == ("Live", "False", "LeaseExpired")
    assert "agent-a" in cond["message"] and ts(20) in cond["message"]
    assert live_conditions([wr("a", conditions=first)], expired, NOW, ts(0)) == {}
    renewed = live_conditions([wr("a", conditions=first)], live("a"), NOW, ts(0))[RA]
    assert [(c["status"], c["reason"]) for c in renewed] == [("True", "LeaseRenewed")]
    assert live_conditions([wr("b")], {}, NOW, ts(0))[RB][0]["reason"] == "LeaseMissing"


def test_a_lease_written_for_another_node_does_not_keep_a_replica_live():
    squatted = {replica_lease_name(RA): lease("b")}  # node b's agent wrote the Lease name of a replica on a
    (cond,) = live_conditions([wr("a")], squatted, NOW, ts(0))[RA]
    assert (cond["status"], cond["reason"]) == ("False", "LeaseOfOtherNode")
    assert stale_replicas([wr("a")], squatted, NOW) == [RA]


def test_a_renewal_after_a_gap_longer_than_the_lease_is_noticed():
    assert renewed_after_expiry(NOW - dt.timedelta(seconds=45), lease("a"))
    assert not renewed_after_expiry(NOW - dt.timedelta(seconds=6), lease("a"))
    assert not renewed_after_expiry(None, lease("a"))


def test_stalled_peer_names_replica_source_bytes_and_time():
    loading = wr("c", phase="Loading", source=f"peer/{RA}", bytesDone=1024, bytesTotal=4096, lastProgressTime=ts(45))
    replicas = [wr("a"), wr("b"), loading]
    stalled = stalled_replicas(replicas, 30, NOW)
    assert [s.replica for s in stalled] == [RC]
    status = aggregate_status(ml(), replicas, live("a", "b"), nodes_available=3, now=NOW, now_text=ts(0))
    message = conds(status)["PeerStalled"].message
    for part in (RC, f"peer/{RA}", "1024 of 4096 bytes", "45s", ts(45)):
        assert part in message
    assert conds(status)["Progressing"].reason == "Loading"


def test_the_stall_deadline_is_the_next_loading_replica_to_go_quiet():
    slow = wr("a", phase="Loading", lastProgressTime=ts(20))
    fresh = wr("b", phase="Loading", lastProgressTime=ts(5))
    stalled = wr("c", phase="Loading", lastProgressTime=ts(45))  # already stalled: no deadline of its own
    assert stall_deadline([fresh, slow, stalled, wr("d")], 30, NOW) == NOW + dt.timedelta(seconds=10)
    assert stall_deadline([stalled, wr("d")], 30, NOW) is None


def test_fallback_to_object_storage_is_degraded():
    attempts = [{"source": f"peer/{RA}", "outcome": "Failed"}, {"source": "ObjectStorage", "outcome": "Loaded"}]
    replicas = [wr("a"), wr("b"), wr("c", source="s3", attempts=attempts)]
    status = aggregate_status(ml(), replicas, live("a", "b", "c"), nodes_available=3, now=NOW, now_text=ts(0))
    c = conds(status)
    assert c["Degraded"].reason == "FellBackToObjectStorage" and c["Ready"].status == "True"


def test_not_enough_nodes_is_explained():
    status = aggregate_status(ml(replicas=5), [wr("a")], live("a"), nodes_available=1, now=NOW, now_text=ts(0))
    ready = conds(status)["Ready"]
    assert ready.reason == "InsufficientNodes" and "only 1 nodes" in ready.message


def test_replica_names_are_dns_safe():
    long = replica_name("m" * 40, "node-" + "x" * 60)
    assert len(long) <= 63 and long == long.lower()
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", long)
    # Cut right after a separator: no "-" or "." is left before the hash.
    cut = replica_name("m" * 51, "node")
    assert len(cut) <= 63 and "--" not in cut and re.fullmatch(r"m{51}-[0-9a-f]{10}", cut)
    assert replica_name("serve", "node-a") == replica_name("serve", "node-a")  # stable across reconciles


def test_replica_names_of_different_pairs_never_collide():
    """ModelLoad `a-b` on node `c` and ModelLoad `a` on node `b-c` both join to `a-b-c`."""
    assert replica_name("a-b", "c") != replica_name("a", "b-c")
    assert replica_name("a-b", "c").startswith("a-b-c-") and replica_name("a", "b-c").startswith("a-b-c-")
    long = "x" * 60
    assert replica_name(long, "node-1") != replica_name(long, "node-2")  # the prefix is cut before the nodes differ
    a = ml()
    b = a.model_copy(update={"metadata": a.metadata.model_copy(update={"name": "serve-x"})})
    bodies = [replica_body(a, "x-n", "v2"), replica_body(b, "n", "v2")]
    assert bodies[0]["metadata"]["name"] != bodies[1]["metadata"]["name"]


def test_a_replica_serving_an_older_object_of_the_desired_name_is_not_ready():
    """`v2` deleted and published again: a replica still serving the old object's bytes (its versionUid) is not
    counted ready, whatever its phase and version name say."""
    replicas = [wr("a", versionUid="new"), wr("b", versionUid="new"), wr("c", versionUid="old")]
    status = aggregate_status(
        ml(), replicas, live("a", "b", "c"), nodes_available=3, now=NOW, now_text=ts(0), version_uid="new"
    )
    ready = conds(status)["Ready"]
    assert status.readyReplicas == 2 and status.phase != "Ready" and status.loadedVersion is None
    assert (ready.status, ready.reason) == ("False", "ReplicasNotReady")
    assert f"{RC} serve an older WeightVersion named v2" in ready.message
    replicas[2] = wr("c", versionUid="new")
    status = aggregate_status(
        ml(), replicas, live("a", "b", "c"), nodes_available=3, now=NOW, now_text=ts(0), version_uid="new"
    )
    assert status.phase == "Ready" and status.readyReplicas == 3


def test_leases_that_name_another_node_or_none_are_to_be_deleted():
    squatted = lease("b")
    squatted["metadata"]["uid"] = "lease-uid-1"
    unlabelled = {"metadata": {"uid": "lease-uid-2"}, "spec": lease("c")["spec"]}
    leases = {**live("a"), replica_lease_name(RB): squatted, replica_lease_name(RC): unlabelled}
    wrs = [wr("a"), wr("b", phase="Loading"), wr("c")]
    wrs[1]["spec"]["nodeName"] = "a"  # RB's name, but placed on a: node b squats its Lease
    found = foreign_leases(wrs, leases)
    assert [(f.replica, f.lease, f.uid, f.node) for f in found] == [
        (RB, replica_lease_name(RB), "lease-uid-1", "b"),
        (RC, replica_lease_name(RC), "lease-uid-2", None),
    ]
    assert "labelled for node b, but the replica is on node a" in found[0].message()
    assert "without a ferry.dev/node label" in found[1].message()
    deleting = {**wrs[1], "metadata": {**wrs[1]["metadata"], "deletionTimestamp": ts(1)}}
    assert foreign_leases([wrs[0], deleting], leases) == []


def view(name="v2", model="m", ready=True):
    return VersionView(name, model, "FullCheckpoint", None, None, ready, False, True)


@pytest.mark.parametrize(
    ("version", "reason"),
    [(None, "VersionNotFound"), (view(ready=False), "VersionNotReady"), (view(model="other"), "ModelMismatch")],
)
def test_an_unplaceable_version_creates_and_moves_nothing(version, reason):
    spec = ml().spec
    problem = version_problem(spec, version)
    assert problem is not None and problem.reason == reason and "v2" in problem.message
    nodes = [node("a"), node("b"), node("c")]
    fresh = plan_replicas(ml(), [], nodes, [], placeable=False)
    assert fresh.create == [] and fresh.retarget == []
    old = [wr("a", "v1"), wr("b", "v1")]
    rolling = plan_replicas(ml(replicas=2), old, nodes, [], placeable=False)
    assert rolling.create == [] and rolling.retarget == [] and rolling.delete == []
    status = aggregate_status(ml(), [], {}, nodes_available=3, problem=problem, now=NOW, now_text=ts(0))
    assert conds(status)["Ready"].reason == reason and status.phase == "Pending"


def test_a_ready_version_of_the_model_is_placeable():
    assert version_problem(ml().spec, view()) is None


def test_what_a_reconcile_gathers_holders_leases_and_matching_nodes():
    serving = [wr("a", versionUid="u-new"), wr("b", versionUid="u-old"), wr("c", phase="Loading")]
    assert holders(serving, "v2", "u-new") == {"a"}  # b serves an older object of the name, c nothing yet
    found = {replica_lease_name(RA): [lease("a")], replica_lease_name(RB): []}
    assert replica_leases([wr("a"), wr("b")], lambda name: found.get(name, [])) == {replica_lease_name(RA): lease("a")}
    nodes = [node("a"), node("b", gpu=False), node("c", unschedulable=True)]
    assert matching_nodes(nodes, ml().spec) == 1


def test_some_replicas_serving_and_none_on_the_way_is_degraded_not_pending():
    """2 of 3 serve and only 2 nodes match: nothing is loading or behind, yet the ModelLoad is short of replicas."""
    replicas = [wr("a"), wr("b")]
    leases = {replica_lease_name(r["metadata"]["name"]): lease(r["spec"]["nodeName"]) for r in replicas}
    status = aggregate_status(ml(replicas=3), replicas, leases, nodes_available=2, now=NOW, now_text=ts(0))
    c = conds(status)
    assert (status.phase, status.ready) == ("Degraded", "2/3")
    assert (c["Ready"].reason, c["Degraded"].status, c["Degraded"].reason) == (
        "InsufficientNodes",
        "True",
        "InsufficientNodes",
    )
    assert "1 of 3 replicas have no node" in c["Degraded"].message
    assert (c["PeerStalled"].status, c["PeerStalled"].reason) == ("False", "NotStalled")
    none = aggregate_status(ml(replicas=3), [], {}, nodes_available=0, now=NOW, now_text=ts(0))
    assert none.phase == "Pending"


def test_a_retarget_is_tested_on_the_replica_as_read():
    """The apiserver applies the move only to that very replica still at the version the plan read: a retarget
    from a lagging read (the replica moved on since) is refused, never a move back."""
    wr = replica_body(ml(version="v1"), "n1", "v1")
    wr["metadata"]["uid"] = "u-1"
    ops = retarget_ops(wr, "v2")
    assert ops[:2] == [
        {"op": "test", "path": "/metadata/uid", "value": "u-1"},
        {"op": "test", "path": "/spec/version", "value": "v1"},
    ]
    assert {"op": "replace", "path": "/spec/version", "value": "v2"} in ops
    assert {"op": "add", "path": "/metadata/labels/ferry.dev~1version", "value": "v2"} in ops
    wr["spec"]["version"] = "v3"  # read again after a newer reconcile moved it
    assert retarget_ops(wr, "v2")[1]["value"] == "v3"
