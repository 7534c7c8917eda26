"""What the operator makes of the replicas' `status.attachments`: the ModelLoad's attachedPods and EnginesAttached,
the release blockers of an attached WeightVersion, and what retention counts as held. Without a cluster."""

from __future__ import annotations

import datetime as dt

import pytest

from ferry.api.models import (
    EnginesAttachedReason,
    ModelLoad,
    ModelLoadConditionType,
    WeightReplica,
    replica_lease_name,
)
from ferry.chain import ChainReason, ChainResult
from ferry.storage import StorageReason, StorageReport
from ferry_operator.modelloads import aggregate_status, attached_pods, replica_name
from ferry_operator.retention import held_versions
from ferry_operator.versions import attachment_blockers, plan_version_status, release_blockers
from tests.support.typed import weight_version

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
NOW_TEXT = "2026-01-01T12:00:00Z"


def pod(name: str, version: str, uid: str | None = None, **extra) -> dict:
    return {"pod": name, "podNamespace": "ns", "podUid": uid or f"uid-{name}", "version": version, **extra}


def wr(node: str, version: str = "v2", *attachments: dict, phase: str = "Serving") -> dict:
    status = {"phase": phase, "version": version}
    if attachments:
        status |= {"attachments": list(attachments), "attachedPods": len({a["podUid"] for a in attachments})}
    return {
        "metadata": {"name": replica_name("serve", node)},
        "spec": {"nodeName": node, "version": version},
        "status": status,
    }


def typed(replica: dict) -> WeightReplica:
    """`wr` as the attach index parses it."""
    spec = {"modelLoad": "serve", "modelName": "m", **replica["spec"]}
    return WeightReplica.from_body(replica | {"spec": spec})


def ml(version: str = "v2", replicas: int = 2) -> ModelLoad:
    return ModelLoad.from_body(
        {
            "metadata": {"name": "serve", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {"modelName": "m", "desiredVersion": version, "replicas": replicas},
        }
    )


def leases(*nodes: str, ago: float = 1) -> dict:
    renew = (NOW - dt.timedelta(seconds=ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        replica_lease_name(replica_name("serve", n)): {
            "metadata": {"labels": {"ferry.dev/node": n}},
            "spec": {"renewTime": renew, "leaseDurationSeconds": 15},
        }
        for n in nodes
    }


def engines(status: dict) -> dict:
    return next(c for c in status.conditions if c.type == ModelLoadConditionType.ENGINES_ATTACHED)


def test_pods_are_counted_once_over_replicas_connections_and_versions():
    replicas = [
        wr("a", "v2", pod("e0", "v2"), pod("e0", "v1"), pod("e1", "v1")),  # e0 mid-refit holds both
        wr("b", "v2", pod("e2", "v2", rank=0), pod("e2", "v2", rank=1)),
    ]
    found = attached_pods(replicas, "v2")
    assert (found.pods, found.on_desired, found.versions) == (3, 2, ("v1", "v2"))

    status = aggregate_status(ml(), replicas, leases("a", "b"), nodes_available=2, now=NOW, now_text=NOW_TEXT)
    assert status.attachedPods == 3
    cond = engines(status)
    assert (cond.status, cond.reason) == ("True", EnginesAttachedReason.ATTACHED)
    assert cond.message == "2 pods attached to v2; 1 attached only to v1"


def test_pods_on_the_old_version_only_are_not_engines_attached():
    replicas = [wr("a", "v2", pod("e0", "v1")), wr("b", "v1", pod("e1", "v1"))]
    status = aggregate_status(ml(), replicas, leases("a", "b"), nodes_available=2, now=NOW, now_text=NOW_TEXT)
    cond = engines(status)
    assert status.attachedPods == 2
    assert (cond.status, cond.reason) == ("False", "EnginesOnOlderVersion")
    assert cond.message == "2 pods attached, none to v2 yet (they hold v1)"


def test_no_attachments_and_a_stale_replicas_attachments_count_nothing():
    status = aggregate_status(ml(), [wr("a"), wr("b")], leases("a", "b"), nodes_available=2, now=NOW, now_text=NOW_TEXT)
    assert status.attachedPods == 0
    assert (engines(status).status, engines(status).reason) == ("False", "NoEngines")

    # b's agent stopped renewing its Lease: what its status says about consumers is no longer known to be true.
    replicas = [wr("a", "v2", pod("e0", "v2")), wr("b", "v2", pod("e1", "v2"))]
    fresh, expired = leases("a"), leases("b", ago=60)
    status = aggregate_status(ml(), replicas, fresh | expired, nodes_available=2, now=NOW, now_text=NOW_TEXT)
    assert status.attachedPods == 1
    assert engines(status).message == (
        f"1 pod attached to v2; not counted: the attachments of stale {replica_name('serve', 'b')}"
    )


def test_the_condition_keeps_its_transition_time_while_the_counts_change():
    one = aggregate_status(
        ml(), [wr("a", "v2", pod("e0", "v2"))], leases("a"), nodes_available=2, now=NOW, now_text=NOW_TEXT
    )
    body = ml().model_copy(update={"status": one})
    two = aggregate_status(
        body,
        [wr("a", "v2", pod("e0", "v2"), pod("e1", "v2"))],
        leases("a"),
        nodes_available=2,
        now=NOW,
        now_text="2026-01-01T12:05:00Z",
    )
    assert engines(two).lastTransitionTime == NOW_TEXT and engines(two).message == "2 pods attached to v2"


def test_attached_pods_block_the_release_of_the_version_they_hold():
    replica = wr("node-a", "v2", pod("llama-0", "v1"), pod("llama-0", "v2"), pod("llama-1", "v1", rank=1))
    assert attachment_blockers(typed(replica)) == {
        "v1": ("attached: ns/llama-0 on node-a", "attached: ns/llama-1 on node-a"),
        "v2": ("attached: ns/llama-0 on node-a",),
    }
    # Serving a version blocks nothing by itself.
    assert attachment_blockers(typed(wr("node-a", "v1"))) == {}

    blockers = release_blockers([], [], ["wr-b"], ["attached: ns/llama-1 on node-a", "attached: ns/llama-0 on node-b"])
    assert blockers == ["WeightReplica/wr-b", "attached: ns/llama-0 on node-b", "attached: ns/llama-1 on node-a"]
    chain = ChainResult(ok=True, reason=ChainReason.Resolved, message="chain of 1", chain=("v1",))
    storage = StorageReport(ok=True, reason=StorageReason.Verified, message="ok", total_bytes=1, tensor_count=1)
    deleted = weight_version("v1", deleting=True)
    plan = plan_version_status(deleted, chain, storage, release_blockers=blockers[1:], now=NOW_TEXT)
    ready = next(c for c in plan.status.conditions if c.type == "Ready")
    assert plan.status.releaseBlockers == blockers[1:] and ready.reason == "ReleaseBlocked"
    assert "attached: ns/llama-0 on node-b" in ready.message


def test_retention_counts_attached_versions_as_held():
    assert held_versions(wr("a", "v3", pod("e0", "v1"), pod("e1", "v2"))) == {"v1", "v2", "v3"}
