"""Retention end to end: the real operator retires old WeightVersions of a delta chain, a real agent's replica holds
an old one (and with it its base) until it lets go, and deleteStorage removes exactly the retired versions' objects
from the real S3."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tests.support.agents import node, replica, start_agent, wait_phase
from tests.support.objects import BUCKET, apply, get, ml_body, publish_delta, publish_full, tensors, wait_for, wv_body

pytestmark = pytest.mark.e2e

NAMES = ["v1", "v2", "v3", "v4", "v5", "v6"]
KEYFRAMES = {"v1", "v4"}  # full checkpoints; every other version is an XorDelta on the one before


def publish(s3, namespace: str) -> list[dict]:
    weights, bodies, previous = tensors(7), [], None
    for step, name in enumerate(NAMES):
        new = {k: (v + np.float32(step)) if k.endswith("0.weight") else v for k, v in weights.items()}
        if name in KEYFRAMES:
            publish_full(s3, namespace, name, new)
            body = wv_body(namespace, name, secret="s3", endpoint=s3.endpoint)
        else:
            publish_delta(s3, namespace, name, previous, weights, new)
            body = wv_body(namespace, name, base=previous, secret="s3", endpoint=s3.endpoint)
        bodies.append(body)
        weights, previous = new, name
    return bodies


def stored(s3, namespace: str) -> dict[str, set[str]]:
    """Version folder -> object names, as the bucket lists them."""
    out: dict[str, set[str]] = {}
    for page in s3.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{namespace}/"):
        for obj in page.get("Contents", []):
            _, version, filename = obj["Key"].split("/", 2)
            out.setdefault(version, set()).add(filename)
    return out


def versions(cluster, namespace: str) -> dict[str, dict]:
    items = json.loads(cluster.kubectl("get", "wv", "-n", namespace, "-o", "json").stdout)["items"]
    return {wv["metadata"]["name"]: wv for wv in items}


def events(cluster, namespace: str, name: str, reason: str) -> list[str]:
    out = cluster.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "-o",
        "json",
        "--field-selector",
        f"involvedObject.name={name},reason={reason}",
    ).stdout
    return sorted(e["message"] for e in json.loads(out)["items"])


def test_retention_keeps_the_newest_their_bases_and_what_a_reader_holds(cluster, s3, namespace, operator, tmp_path):
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3"},
        "data": {
            k: base64.b64encode(v.encode()).decode()
            for k, v in (("AWS_ACCESS_KEY_ID", s3.access_key), ("AWS_SECRET_ACCESS_KEY", s3.secret_key))
        },
    }
    apply(cluster, namespace, secret, *publish(s3, namespace))
    for name in NAMES:
        cluster.kubectl("wait", "--for=condition=Ready", f"wv/{name}", "-n", namespace, "--timeout=60s")
    published = stored(s3, namespace)
    assert sorted(published) == NAMES

    # A reader: a replica on a real agent, loaded from S3 by replaying v1 → v2, still serving v2.
    reader_node = f"{namespace}-n"
    node(cluster, reader_node, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, reader_node, s3=s3)
    try:
        replica(cluster, namespace, "reader", reader_node, "v2")
        held = wait_phase(cluster, namespace, "reader", "Serving", agent)
        assert held["status"]["version"] == "v2"

        # keepLast 2 keeps v5 and v6; v6 replays from v4 → v5, v2 is held and replays from v1: only v3 can go.
        policy = {"keepLast": 2, "deleteStorage": True}
        apply(cluster, namespace, ml_body(namespace, "v6", 0, retention=policy))
        wait_for(lambda: "v3" not in versions(cluster, namespace), 90, "v3 retired and released")
        left = versions(cluster, namespace)
        assert sorted(left) == ["v1", "v2", "v4", "v5", "v6"]
        assert not any(wv["metadata"].get("deletionTimestamp") for wv in left.values())
        retired = events(cluster, namespace, "serve", "VersionRetired")
        assert len(retired) == 1 and retired[0].startswith("deleted WeightVersion v3:"), retired
        assert events(cluster, namespace, "v3", "StorageDeleted"), "v3's objects were not reported deleted"
        assert stored(s3, namespace) == {k: v for k, v in published.items() if k != "v3"}

        # The reader lets go: v2, and then nothing needs v1 either.
        cluster.kubectl("delete", "wr", "reader", "-n", namespace)
        wait_for(lambda: sorted(versions(cluster, namespace)) == ["v4", "v5", "v6"], 90, "v1 and v2 retired")
        retired = events(cluster, namespace, "serve", "VersionRetired")
        assert [m.split(":")[0] for m in retired] == [f"deleted WeightVersion {v}" for v in ("v1", "v2", "v3")]
        wait_for(lambda: sorted(stored(s3, namespace)) == ["v4", "v5", "v6"], 90, "v1 and v2 objects deleted")
        assert stored(s3, namespace) == {k: published[k] for k in ("v4", "v5", "v6")}
        for name in ("v4", "v5", "v6"):
            assert get(cluster, namespace, "wv", name)["status"]["phase"] == "Ready"
    finally:
        cluster.kubectl("delete", "ml", "serve", "-n", namespace, "--wait=false", check=False)
        agent.stop()


def test_objects_stay_without_the_namespaces_own_credentials(cluster, s3, namespace, operator):
    # No credentialsSecret: the operator verifies with its own credentials but never deletes with them.
    for step, name in enumerate(["v1", "v2", "v3"]):
        publish_full(s3, namespace, name, tensors(step))
    apply(cluster, namespace, *[wv_body(namespace, n) for n in ("v1", "v2", "v3")])
    for name in ("v1", "v2", "v3"):
        cluster.kubectl("wait", "--for=condition=Ready", f"wv/{name}", "-n", namespace, "--timeout=60s")
    published = stored(s3, namespace)
    apply(cluster, namespace, ml_body(namespace, "v3", 0, retention={"keepLast": 3, "deleteStorage": True}))
    try:
        wait_for(lambda: get(cluster, namespace, "ml", "serve"), 10, "the ModelLoad")
        # Tightening the policy is a ModelLoad change: it runs the policy again.
        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"retention":{"keepLast":1}}}'
        )
        wait_for(lambda: sorted(versions(cluster, namespace)) == ["v3"], 90, "v1 and v2 retired")
        for name in ("v1", "v2"):
            why = wait_for(lambda n=name: events(cluster, namespace, n, "StorageNotDeleted"), 10, f"{name} warned")
            assert "credentialsSecret" in why[0], why
        assert stored(s3, namespace) == published
    finally:
        cluster.kubectl("delete", "ml", "serve", "-n", namespace, "--wait=false", check=False)
