"""ModelLoad `spec.podSelector` on the real kube-apiserver: a metav1.LabelSelector, validated as Kubernetes does."""

from __future__ import annotations

import json

import pytest

from ferry.api import models

pytestmark = pytest.mark.cluster


def modelload(name: str, selector: dict) -> dict:
    return {
        "apiVersion": models.API_VERSION,
        "kind": "ModelLoad",
        "metadata": {"name": name},
        "spec": {"modelName": "m", "desiredVersion": "v1", "replicas": 0, "podSelector": selector},
    }


@pytest.mark.parametrize(
    ("selector", "accepted"),
    [
        ({}, True),  # every pod of the namespace
        ({"matchLabels": {"app.kubernetes.io/name": "vllm", "tier": ""}}, True),
        (
            {
                "matchExpressions": [
                    {"key": "tier", "operator": "In", "values": ["a", "b"]},
                    {"key": "canary", "operator": "DoesNotExist"},
                    {"key": "gpu", "operator": "Exists"},
                    {"key": "zone", "operator": "NotIn", "values": ["x"]},
                ]
            },
            True,
        ),
        ({"matchExpressions": [{"key": "tier", "operator": "In"}]}, False),  # In without values
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": []}]}, False),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists", "values": ["1"]}]}, False),
        ({"matchExpressions": [{"key": "gpu", "operator": "Gt", "values": ["1"]}]}, False),  # nodes only
        ({"matchExpressions": [{"key": "bad key!", "operator": "Exists"}]}, False),
        ({"matchLabels": {"bad key!": "x"}}, False),
        ({"matchLabels": {"app": "not valid!"}}, False),
        ({"matchLabels": {"app": "v" * 64}}, False),
        ({"matchLabels": {"app": "x"}, "podNames": ["p"]}, False),  # no other field
    ],
)
def test_pod_selector_is_a_label_selector(cluster, namespace, selector, accepted):
    body = modelload("follow", selector)
    result = cluster.kubectl(
        "create", "-n", namespace, "-f", "-", "--validate=strict", input=json.dumps(body), check=False
    )
    assert (result.returncode == 0) == accepted, result.stderr
    if accepted:
        stored = json.loads(cluster.kubectl("get", "ml", "follow", "-n", namespace, "-o", "json").stdout)
        assert stored["spec"]["podSelector"] == selector
        cluster.kubectl("delete", "ml", "follow", "-n", namespace)
    else:
        assert "podSelector" in result.stderr, result.stderr
