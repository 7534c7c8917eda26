"""`ModelLoad.spec.rollout` on a real kube-apiserver: its default, and the CEL rules on maxUnavailable."""

from __future__ import annotations

import json

import pytest

from ferry.api import models

pytestmark = pytest.mark.cluster


def modelload(name: str, rollout: dict | None) -> dict:
    spec: dict = {"modelName": "m", "desiredVersion": "v1"}
    if rollout is not None:
        spec["rollout"] = rollout
    return {"apiVersion": models.API_VERSION, "kind": "ModelLoad", "metadata": {"name": name}, "spec": spec}


def apply(cluster, namespace: str, body: dict, *, check: bool = True):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body), check=check)


def test_rollout_defaults_to_rolling(cluster, namespace):
    apply(cluster, namespace, modelload("plain", None))
    spec = json.loads(cluster.kubectl("get", "ml", "plain", "-n", namespace, "-o", "json").stdout)["spec"]
    assert spec["rollout"] == {"strategy": "Rolling"}


@pytest.mark.parametrize("value", [1, 8, "25%", "100%"])
def test_max_unavailable_accepts_a_count_or_a_percentage(cluster, namespace, value):
    apply(cluster, namespace, modelload("ok", {"strategy": "Rolling", "maxUnavailable": value}))
    spec = json.loads(cluster.kubectl("get", "ml", "ok", "-n", namespace, "-o", "json").stdout)["spec"]
    assert spec["rollout"]["maxUnavailable"] == value


@pytest.mark.parametrize("value", [0, -2, "0%", "101%", "3", "half"])
def test_max_unavailable_rejects_what_cannot_move_a_replica(cluster, namespace, value):
    result = apply(cluster, namespace, modelload("bad", {"strategy": "Rolling", "maxUnavailable": value}), check=False)
    assert result.returncode != 0 and "spec.rollout.maxUnavailable" in result.stderr, result.stderr


def test_parallel_takes_no_budget(cluster, namespace):
    result = apply(cluster, namespace, modelload("bad", {"strategy": "Parallel", "maxUnavailable": 1}), check=False)
    assert result.returncode != 0 and "maxUnavailable applies to the Rolling strategy only" in result.stderr
    result = apply(cluster, namespace, modelload("bad", {"strategy": "AllAtOnce"}), check=False)
    assert result.returncode != 0 and "spec.rollout.strategy" in result.stderr
