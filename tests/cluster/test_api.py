"""The three CRDs on a real kube-apiserver: established, accepting valid objects, and CEL rejecting bad ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry.api import models

pytestmark = pytest.mark.cluster

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"


def wv(name: str, fmt: str = "FullCheckpoint", base: str | None = None, uri: str | None = None, **spec) -> dict:
    body = {
        "apiVersion": models.API_VERSION,
        "kind": "WeightVersion",
        "metadata": {"name": name},
        "spec": {
            "modelName": "m",
            "format": fmt,
            "storage": {"uri": uri or f"s3://models/m/{name}/model.safetensors.index.json"},
            **spec,
        },
    }
    if base:
        body["spec"]["baseVersion"] = base
    return body


def apply(cluster, namespace: str, body: dict, *, check: bool = True):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body), check=check)


def test_api_version_is_stamped(cluster):
    version = json.loads(cluster.get_raw("/version"))
    assert version["gitVersion"].startswith("v1.36."), version


def test_crds_are_established(cluster):
    for plural in ("weightversions", "modelloads", "weightreplicas"):
        out = cluster.kubectl("get", f"crd/{plural}.ferry.dev", "-o", "json").stdout
        conditions = {c["type"]: c["status"] for c in json.loads(out)["status"]["conditions"]}
        assert conditions.get("Established") == "True", conditions


def test_category_lists_all_kinds(cluster):
    out = cluster.kubectl("api-resources", "--categories=ferry", "-o", "name").stdout.split()
    assert sorted(out) == ["modelloads.ferry.dev", "weightreplicas.ferry.dev", "weightversions.ferry.dev"]


def test_samples_are_accepted(cluster, namespace):
    out = cluster.kubectl("apply", "-n", namespace, "-f", str(SAMPLES)).stdout
    assert "llama-tiny-v3 created" in out
    assert "modelload.ferry.dev/llama-tiny created" in out
    ml = json.loads(cluster.kubectl("get", "ml", "llama-tiny", "-n", namespace, "-o", "json").stdout)
    assert ml["spec"]["transfer"]["selector"] == "rendezvousHash"


def test_defaults_are_applied_by_the_apiserver(cluster, namespace):
    body = {
        "apiVersion": models.API_VERSION,
        "kind": "ModelLoad",
        "metadata": {"name": "defaults"},
        "spec": {"modelName": "m", "desiredVersion": "v1"},
    }
    apply(cluster, namespace, body)
    spec = json.loads(cluster.kubectl("get", "ml", "defaults", "-n", namespace, "-o", "json").stdout)["spec"]
    assert spec["replicas"] == 1
    assert spec["sourceOrder"] == ["Peer", "ObjectStorage"]
    assert spec["transfer"] == {
        "timeoutSeconds": 300,
        "maxSourceAttempts": 3,
        "selector": "rendezvousHash",
        "stallSeconds": 60,
        "rpcRetries": 3,
        "rpcBackoffSeconds": 0.5,
        "maxReadersPerSource": 4,
        "chunkMiB": 16,
    }


def test_spec_is_immutable(cluster, namespace):
    apply(cluster, namespace, wv("v1"))
    changed = wv("v1", uri="s3://models/elsewhere/model.safetensors.index.json")
    result = apply(cluster, namespace, changed, check=False)
    assert result.returncode != 0
    assert "spec is immutable" in result.stderr


def test_adding_a_field_to_spec_is_also_rejected(cluster, namespace):
    apply(cluster, namespace, wv("v1"))
    result = apply(cluster, namespace, wv("v1", layoutSignature="new"), check=False)
    assert "spec is immutable" in result.stderr


def test_status_may_change_while_spec_is_frozen(cluster, namespace):
    apply(cluster, namespace, wv("v1"))
    patch = json.dumps({"status": {"phase": "Verifying"}})
    cluster.kubectl("patch", "wv", "v1", "-n", namespace, "--subresource=status", "--type=merge", "-p", patch)
    out = cluster.kubectl("get", "wv", "v1", "-n", namespace, "-o", "jsonpath={.status.phase}").stdout
    assert out == "Verifying"


def test_delta_without_base_is_rejected(cluster, namespace):
    result = apply(cluster, namespace, wv("d1", fmt="XorDelta"), check=False)
    assert result.returncode != 0
    assert "an XorDelta needs spec.baseVersion" in result.stderr


def test_full_checkpoint_with_base_is_rejected(cluster, namespace):
    result = apply(cluster, namespace, wv("f1", base="v0"), check=False)
    assert "only an XorDelta may set spec.baseVersion" in result.stderr


def test_version_cannot_be_its_own_base(cluster, namespace):
    result = apply(cluster, namespace, wv("self", fmt="XorDelta", base="self"), check=False)
    assert "cannot be its own base" in result.stderr


@pytest.mark.parametrize(
    "uri",
    [
        "http://models/m/model.safetensors.index.json",
        "s3://models/m/model.safetensors",
        "s3://Bad_Bucket/m/model.safetensors.index.json",
        "s3:///model.safetensors.index.json",
        "s3://models/m/../model.safetensors.index.json",
        "s3://models/./m/model.safetensors.index.json",
    ],
)
def test_bad_storage_uri_is_rejected(cluster, namespace, uri):
    result = apply(cluster, namespace, wv("bad-uri", uri=uri), check=False)
    assert result.returncode != 0
    assert "spec.storage.uri" in result.stderr


def test_full_checkpoint_needs_storage(cluster, namespace):
    body = wv("nostore")
    del body["spec"]["storage"]
    result = apply(cluster, namespace, body, check=False)
    assert "need spec.storage" in result.stderr


def test_peer_only_version_needs_no_storage(cluster, namespace):
    body = wv("peer-only", fmt="PeerOnly")
    del body["spec"]["storage"]
    apply(cluster, namespace, body)


def test_modelload_bounds(cluster, namespace):
    body = {
        "apiVersion": models.API_VERSION,
        "kind": "ModelLoad",
        "metadata": {"name": "bad"},
        "spec": {"modelName": "m", "desiredVersion": "v1", "replicas": -1, "transfer": {"timeoutSeconds": 0}},
    }
    result = apply(cluster, namespace, body, check=False)
    assert "spec.replicas" in result.stderr
    assert "spec.transfer.timeoutSeconds" in result.stderr


def test_unknown_selector_is_rejected(cluster, namespace):
    body = {
        "apiVersion": models.API_VERSION,
        "kind": "ModelLoad",
        "metadata": {"name": "bad-selector"},
        "spec": {"modelName": "m", "desiredVersion": "v1", "transfer": {"selector": "roundRobin"}},
    }
    result = apply(cluster, namespace, body, check=False)
    assert "spec.transfer.selector" in result.stderr


def test_weightreplica_node_is_immutable(cluster, namespace):
    body = {
        "apiVersion": models.API_VERSION,
        "kind": "WeightReplica",
        "metadata": {"name": "r1"},
        "spec": {"modelLoad": "ml", "modelName": "m", "version": "v1", "nodeName": "node-a"},
    }
    apply(cluster, namespace, body)
    body["spec"]["nodeName"] = "node-b"
    result = apply(cluster, namespace, body, check=False)
    assert "spec.nodeName is immutable" in result.stderr


def test_kubectl_get_shows_the_columns(cluster, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", str(SAMPLES / "01-weightversions.yaml"))
    patch = json.dumps(
        {
            "status": {
                "phase": "Ready",
                "chainDepth": 2,
                "size": "1.5Gi",
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Verified",
                        "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z",
                    }
                ],
            }
        }
    )
    cluster.kubectl(
        "patch", "wv", "llama-tiny-v2", "-n", namespace, "--subresource=status", "--type=merge", "-p", patch
    )
    out = cluster.kubectl("get", "wv", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "READY", "MODEL", "BASE", "DEPTH", "SIZE", "AGE"]
    row = next(line.split() for line in out if line.startswith("llama-tiny-v2"))
    assert row[:7] == ["llama-tiny-v2", "Ready", "True", "llama-tiny", "llama-tiny-v1", "2", "1.5Gi"]
    wide = cluster.kubectl("get", "wv", "-n", namespace, "-o", "wide").stdout.splitlines()[0].split()
    assert "REASON" in wide
    everything = cluster.kubectl("get", "ferry", "-n", namespace).stdout
    assert "weightversion.ferry.dev/llama-tiny-v1" in everything


@pytest.mark.parametrize(
    ("selector", "accepted"),
    [
        ({"ferry.dev/pool": "a", "gpu": "", "example.com/x_y.z": "A-1"}, True),
        ({"in valid key!": "x"}, False),
        ({"/name": "x"}, False),
        ({"a/b/c": "x"}, False),
        ({"k" * 64: "x"}, False),
        ({"gpu": "not valid!"}, False),
        ({"gpu": "v" * 64}, False),
    ],
)
def test_node_selector_keys_and_values_are_labels(cluster, namespace, selector, accepted):
    body = {
        "apiVersion": models.API_VERSION,
        "kind": "ModelLoad",
        "metadata": {"name": "selector"},
        "spec": {"modelName": "m", "desiredVersion": "v1", "nodeSelector": selector},
    }
    result = apply(cluster, namespace, body, check=False)
    assert (result.returncode == 0) == accepted, result.stderr
    if not accepted:
        assert "nodeSelector" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("field", "says"),
    [
        ("weightversion.spec.storage", "Where the checkpoint is stored"),
        ("weightversion.spec.storage.credentialsSecret", "AWS_ACCESS_KEY_ID"),
        ("modelload.spec.transfer.selector", "rendezvousHash"),
        ("modelload.status.phase", "a summary of the conditions"),
        ("weightreplica.status.ranks.grpcEndpoint", "worker service"),
    ],
)
def test_kubectl_explain_tells_what_to_write(cluster, field, says):
    """Every field's docstring in ferry/api/models.py reaches `kubectl explain` through the CRD."""
    out = cluster.kubectl("explain", field).stdout
    assert says in " ".join(out.split()), out


def test_phases_are_the_api_vocabulary(cluster, namespace):
    """status.phase takes only the values of the phase enums: not Loaded, which nothing ever wrote."""
    apply(
        cluster,
        namespace,
        {
            "apiVersion": models.API_VERSION,
            "kind": "WeightReplica",
            "metadata": {"name": "wr-phase"},
            "spec": {"modelLoad": "ml", "modelName": "m", "version": "v1", "nodeName": "node-a"},
        },
    )

    def set_phase(kind: str, name: str, phase: str):
        patch = json.dumps({"status": {"phase": phase}})
        return cluster.kubectl(
            "patch", kind, name, "-n", namespace, "--subresource=status", "--type=merge", "-p", patch, check=False
        )

    assert set_phase("wr", "wr-phase", models.ReplicaPhase.SERVING).returncode == 0
    refused = set_phase("wr", "wr-phase", "Loaded")
    assert refused.returncode != 0 and "Unsupported value" in refused.stderr, refused.stderr
    cluster.kubectl("apply", "-n", namespace, "-f", str(SAMPLES))
    assert set_phase("ml", "llama-tiny", models.ModelLoadPhase.DEGRADED).returncode == 0
    assert set_phase("ml", "llama-tiny", "Serving").returncode != 0
