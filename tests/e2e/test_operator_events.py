"""The Events the operator posts, read back from the real apiserver: a normal create of a WeightVersion and a
ModelLoad served by two agents is Normal Events only (none for the version, whose first Ready is no news), one per
state change (none again on the reconciles that
follow), all reported by `ferry-operator` with the action the operator took (not kopf's "Action?"); a real
problem (the checkpoint's objects are missing) is one Warning, however often the verification is retried."""

from __future__ import annotations

import json
import re
import urllib.request
from collections import Counter

import pytest

from tests.support.agents import node, start_agent
from tests.support.objects import apply, ml_body, ml_status, publish_full, tensors, wait_for, wait_reason, wv_body

pytestmark = pytest.mark.e2e


def events_of(cluster, namespace: str, uid: str) -> list[dict]:
    items = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    return [e for e in items if e["involvedObject"].get("uid") == uid]


def counted(operator, metric: str, label: str) -> float:
    """The sum of the operator's counter `metric` over the series with `label` (e.g. kind="ModelLoad")."""
    text = urllib.request.urlopen(operator.metrics_url, timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{metric}{{[^}}]*{re.escape(label)}[^}}]*}} (\S+)$", text, re.M))


def summary(events: list[dict]) -> list[tuple[str, str, str]]:
    return sorted((e["type"], e["reason"], e["message"]) for e in events)


def actions(events: list[dict]) -> list[tuple[str, str, str]]:
    return sorted((e["type"], e["reason"], e["action"]) for e in events)


def assert_ours_and_unique(events: list[dict]) -> None:
    assert {(e["reportingComponent"], e["source"]["component"]) for e in events} == {
        ("ferry-operator", "ferry-operator")
    }
    repeated = [k for k, n in Counter(summary(events)).items() if n > 1]
    assert not repeated, repeated


def test_a_normal_create_posts_normal_events_once(cluster, s3, namespace, operator, tmp_path):
    names = [f"{namespace}-n{i}" for i in range(2)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    agents = [start_agent(cluster, tmp_path, n, s3=s3) for n in names]

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + "".join(a.log_tail(10) for a in agents)

    try:
        publish_full(s3, namespace, "v1", tensors(31))
        apply(cluster, namespace, wv_body(namespace, "v1"), ml_body(namespace, "v1", 2))
        wv = wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "2/2", 90, "2/2 ready", describe)
        ml = json.loads(cluster.kubectl("get", "ml", "serve", "-n", namespace, "-o", "json").stdout)
        # Reconciles that find nothing new post nothing: cause a few (there is no resync timer), then read the Events.
        done = counted(operator, "ferry_reconciles_total", 'kind="ModelLoad"')
        for i in range(3):
            cluster.kubectl("annotate", "--overwrite", "ml", "serve", "-n", namespace, f"test.ferry.dev/poke={i}")
        wait_for(
            lambda: counted(operator, "ferry_reconciles_total", 'kind="ModelLoad"') >= done + 3,
            30,
            "three more ModelLoad reconciles",
        )

        version_events = events_of(cluster, namespace, wv["metadata"]["uid"])
        assert actions(version_events) == []  # a new version's first Ready is no news: its status says it
        load_events = events_of(cluster, namespace, ml["metadata"]["uid"])
        assert_ours_and_unique(load_events)
        assert actions(load_events) == [
            ("Normal", "AllReplicasReady", "Serve"),
            ("Normal", "ReplicaCreated", "CreateReplica"),
            ("Normal", "ReplicaCreated", "CreateReplica"),
        ], summary(load_events)
    finally:
        for a in agents:
            a.stop()


def test_missing_objects_are_one_warning(cluster, namespace, operator):
    apply(cluster, namespace, wv_body(namespace, "gone"))  # nothing was published under its URI
    wv = wait_reason(cluster, namespace, "gone", "Ready", "False", "ObjectMissing")
    # The verification is retried with backoff (1 s doubling to 4 s here): let it fail several more times.
    missing = 'result="ObjectMissing"'
    tried = counted(operator, "ferry_storage_verifications_total", missing)
    wait_for(
        lambda: counted(operator, "ferry_storage_verifications_total", missing) >= tried + 3,
        60,
        "three more verifications",
    )
    events = events_of(cluster, namespace, wv["metadata"]["uid"])
    assert_ours_and_unique(events)
    assert actions(events) == [("Warning", "ObjectMissing", "Verify")], summary(events)

    # Deleted, and nothing needs it: its problem gives way to the release (Normal), and it is released.
    cluster.kubectl("delete", "wv", "gone", "-n", namespace)
    events = wait_for(
        lambda: (found := events_of(cluster, namespace, wv["metadata"]["uid"])) and len(found) == 3 and found,
        20,
        "the Released Event",
    )
    assert_ours_and_unique(events)
    assert actions(events) == [
        ("Normal", "Released", "Release"),
        ("Normal", "Releasing", "Release"),
        ("Warning", "ObjectMissing", "Verify"),
    ], summary(events)
