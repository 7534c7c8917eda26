"""Placement with `spec.podSelector`: selector matching, which pods hold a node, and the union with the warm pool."""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from ferry.api.models import (
    LABEL_NODE,
    LABEL_PLACEMENT,
    PLACEMENT_PODS,
    PLACEMENT_POOL,
    WARM_LABEL_PREFIX,
    LabelSelector,
    ModelLoad,
    ModelLoadSpec,
    replica_lease_name,
    warm_node_label,
)
from ferry_operator.modelloads import (
    PodFacts,
    aggregate_status,
    followed_nodes,
    plan_replicas,
    replica_body,
    selector_matches,
    warm_label_changes,
)

pytestmark = pytest.mark.unit

LABEL_NAME_MAX = 63


def pod(
    name: str, node: str | None, labels: dict[str, str] | None = None, *, phase: str = "Running", deleting: bool = False
) -> PodFacts:
    meta = {"name": name, "uid": f"uid-{name}", "labels": labels if labels is not None else {"app": "engine"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec = {"nodeName": node} if node else {}
    return PodFacts.from_body({"metadata": meta, "spec": spec, "status": {"phase": phase}})


def node(name: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": labels}, "spec": {}}


def modelload(replicas: int = 1, selector: dict | None = None) -> ModelLoad:
    spec = {"modelName": "m", "desiredVersion": "v1", "replicas": replicas, "nodeSelector": {"pool": "a"}}
    if selector is not None:
        spec["podSelector"] = selector
    return ModelLoad.from_body({"metadata": {"name": "ml", "namespace": "ns", "uid": "u1"}, "spec": spec})


def existing(
    ml: ModelLoad, node_name: str, placement: str | None, *, attached: int = 0, phase: str = "Serving"
) -> dict:
    body = replica_body(ml, node_name, "v1", placement or PLACEMENT_POOL)
    if placement is None:  # created before the label existed
        del body["metadata"]["labels"][LABEL_PLACEMENT]
    body["status"] = {"phase": phase, "version": "v1"}
    if attached:
        body["status"]["attachedPods"] = attached
    return body


NODES = [node("a1", pool="a"), node("a2", pool="a"), node("b1", pool="b"), node("b2", pool="b")]


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ({}, {}, True),  # empty selector: every pod
        ({"matchLabels": {"app": "engine"}}, {"app": "engine", "x": "1"}, True),
        ({"matchLabels": {"app": "engine"}}, {"app": "other"}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]}, {"tier": "b"}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}]}, {}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]}, {}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["a"]}]}, {"tier": "a"}, False),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
        ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": "1"}, False),
        (
            {"matchLabels": {"app": "engine"}, "matchExpressions": [{"key": "canary", "operator": "DoesNotExist"}]},
            {"app": "engine", "canary": "yes"},
            False,
        ),
    ],
)
def test_selector_matches_like_kubernetes(selector, labels, matches):
    assert selector_matches(selector, labels) is matches


def test_only_bound_running_pods_hold_a_node():
    pods = [
        pod("bound", "b1"),
        pod("unbound", None),
        pod("terminating", "b2", deleting=True),
        pod("done", "a1", phase="Succeeded"),
        pod("failed", "a2", phase="Failed"),
        pod("pending", "a2", phase="Pending"),  # bound, its containers not started yet: it needs the weights
        pod("other", "b2", {"app": "other"}),
    ]
    assert followed_nodes({"matchLabels": {"app": "engine"}}, pods) == {"b1", "a2"}
    assert followed_nodes(None, pods) == set()


def test_pod_nodes_join_the_warm_pool():
    ml = modelload(replicas=1, selector={"matchLabels": {"app": "engine"}})
    plan = plan_replicas(ml, [existing(ml, "a1", PLACEMENT_POOL)], NODES, [], pod_nodes={"b1", "gone-node"})
    assert [(b["spec"]["nodeName"], b["metadata"]["labels"][LABEL_PLACEMENT]) for b in plan.create] == [
        ("b1", PLACEMENT_PODS)
    ]  # a pod's node need not match nodeSelector; a node without a Node object gets nothing
    assert plan.delete == [] and plan.extra == 1

    # A pod on a pool node shares the pool's replica: nothing new, nothing extra.
    plan = plan_replicas(ml, [existing(ml, "a1", PLACEMENT_POOL)], NODES, [], pod_nodes={"a1"})
    assert plan.create == [] and plan.delete == [] and plan.extra == 0


def test_a_replica_for_pods_goes_with_its_pods_unless_attached():
    ml = modelload(replicas=1, selector={})
    pool, follower = existing(ml, "a1", PLACEMENT_POOL), existing(ml, "b1", PLACEMENT_PODS)
    plan = plan_replicas(ml, [pool, follower], NODES, [], pod_nodes=set())
    assert plan.delete == [follower["metadata"]["name"]] and plan.held == []

    attached = existing(ml, "b1", PLACEMENT_PODS, attached=1)
    plan = plan_replicas(ml, [pool, attached], NODES, [], pod_nodes=set())
    assert plan.delete == [] and plan.held == [attached["metadata"]["name"]] and plan.extra == 1
    by_attachment = existing(ml, "b1", PLACEMENT_PODS)
    by_attachment["status"]["attachments"] = [{"pod": "p", "podNamespace": "ns", "podUid": "u", "version": "v1"}]
    assert plan_replicas(ml, [pool, by_attachment], NODES, [], pod_nodes=set()).delete == []


def test_pods_not_yet_listed_delete_no_replica_kept_for_pods():
    ml = modelload(replicas=1, selector={})
    pool, follower = existing(ml, "a1", PLACEMENT_POOL), existing(ml, "b1", PLACEMENT_PODS)
    plan = plan_replicas(ml, [pool, follower], NODES, [], pod_nodes=None)
    assert plan.delete == [] and plan.create == [] and plan.held == []


def test_the_pool_keeps_its_own_replicas_before_those_kept_for_pods():
    """The pod's node leaves the pool alone (no churn), and when its pod goes the pod's replica goes, not the pool's,
    whichever order the index lists them in."""
    ml = modelload(replicas=1, selector={})
    pool, follower = existing(ml, "a2", None), existing(ml, "a1", PLACEMENT_PODS)  # a1: also a nodeSelector node
    for order in ([pool, follower], [follower, pool]):
        plan = plan_replicas(ml, order, NODES, [], pod_nodes=set())
        assert plan.delete == [follower["metadata"]["name"]] and plan.relabel == {}

    # Scaled up: the pool takes the replica already on a matching node, and says so in its label.
    ml2 = modelload(replicas=2, selector={})
    plan = plan_replicas(ml2, [pool, follower], NODES, [], pod_nodes={"a1"})
    assert plan.create == [] and plan.relabel == {follower["metadata"]["name"]: PLACEMENT_POOL}
    # Scaled down with a pod still on a pool node: that replica stays, now for the pod.
    ml0 = modelload(replicas=0, selector={})
    plan = plan_replicas(ml0, [pool], NODES, [], pod_nodes={"a2"})
    assert plan.delete == [] and plan.relabel == {pool["metadata"]["name"]: PLACEMENT_PODS} and plan.extra == 1


def test_without_a_pod_selector_a_replica_for_pods_goes():
    ml = modelload(replicas=1)
    follower = existing(ml, "b1", PLACEMENT_PODS)
    plan = plan_replicas(ml, [existing(ml, "a1", PLACEMENT_POOL), follower], NODES, [])
    assert plan.delete == [follower["metadata"]["name"]]


def test_followed_replicas_count_in_status_but_not_against_node_supply():
    ml = modelload(replicas=1, selector={})
    replicas = [existing(ml, "a1", PLACEMENT_POOL), existing(ml, "b1", PLACEMENT_PODS, phase="Loading")]
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    lease = {
        "metadata": {"labels": {LABEL_NODE: "a1"}},
        "spec": {"renewTime": "2026-01-01T00:00:00Z", "leaseDurationSeconds": 15, "holderIdentity": "agent"},
    }
    leases = {replica_lease_name(replicas[0]["metadata"]["name"]): lease}
    status = aggregate_status(
        ml, replicas, leases, nodes_available=1, now=now, now_text="2026-01-01T00:00:00Z", extra_replicas=1
    )
    assert status.ready == "1/2" and status.replicas == 2
    ready = next(c for c in status.conditions if c.type == "Ready")
    assert ready.reason == "ReplicasNotReady", ready  # not InsufficientNodes: the pool has its one node


def test_warm_label_fits_kubernetes_names_for_any_modelload():
    longest = warm_node_label("n" * 63, "m" * 253)
    name = longest.removeprefix(WARM_LABEL_PREFIX)
    assert len(name) <= LABEL_NAME_MAX and name[0].isalnum() and name[-1].isalnum()
    assert warm_node_label("a-b", "c") != warm_node_label("a", "b-c")
    assert warm_node_label("n" * 63, "m" * 253 + "x") != longest  # cut alike, told apart by the hash
    assert warm_node_label("team-a", "llama").startswith(f"{WARM_LABEL_PREFIX}team-a_llama-")


def test_warm_labels_follow_serving_replicas():
    ml = modelload()
    key = warm_node_label("ns", "ml")
    serving, loading = existing(ml, "a1", PLACEMENT_POOL), existing(ml, "b1", PLACEMENT_PODS, phase="Loading")
    stale = existing(ml, "a2", PLACEMENT_POOL)
    nodes = [node("a1"), {"metadata": {"name": "b1", "labels": {key: "v0"}}}, node("a2"), node("b2")]
    assert warm_label_changes(key, [serving, loading, stale], nodes, [stale["metadata"]["name"]]) == {
        "a1": "v1",
        "b1": None,
    }
    nodes[0]["metadata"]["labels"][key] = "v1"
    assert warm_label_changes(key, [serving], nodes, []) == {"b1": None}


def test_pod_selector_schema():
    spec = ModelLoadSpec.model_validate(
        {
            "modelName": "m",
            "desiredVersion": "v1",
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "vllm"},
                "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a"]}],
            },
        }
    )
    assert isinstance(spec.podSelector, LabelSelector)
    with pytest.raises(ValidationError):
        ModelLoadSpec.model_validate(
            {
                "modelName": "m",
                "desiredVersion": "v1",
                "podSelector": {"matchExpressions": [{"key": "t", "operator": "Near"}]},
            }
        )
