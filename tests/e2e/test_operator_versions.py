"""WeightVersion lifecycle through the real apiserver, real S3 and a real `kopf run` operator process."""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.request
from itertools import pairwise

import pytest
import yaml

from ferry import checkpoint_format as cf
from ferry_dev.localcluster import free_port
from tests.support.helm import render
from tests.support.objects import (
    apply,
    condition,
    forged,
    get,
    ml_body,
    publish_delta,
    publish_full,
    put_files,
    tensors,
    wait_for,
    wait_reason,
    wv_body,
)

pytestmark = pytest.mark.e2e


def publish_chain(s3, ns: str, names: list[str]) -> None:
    weights = tensors(0)
    publish_full(s3, ns, names[0], weights)
    for previous, name in pairwise(names):
        new = {k: v + 1 if k.endswith("0.weight") else v for k, v in weights.items()}
        publish_delta(s3, ns, name, previous, weights, new)
        weights = new


def ferry_annotations(obj: dict) -> dict[str, str]:
    return {k: v for k, v in (obj["metadata"].get("annotations") or {}).items() if k.startswith("ferry.dev/")}


def test_full_then_two_deltas_go_ready_in_order(cluster, s3, namespace, operator):
    publish_chain(s3, namespace, ["v1", "v2", "v3"])
    # Applied newest first: the deltas must wait for their bases, then follow promptly.
    apply(cluster, namespace, wv_body(namespace, "v3", base="v2"), wv_body(namespace, "v2", base="v1"))
    apply(cluster, namespace, ml_body(namespace, "v3"))  # no node in its pool: it can only wait for v3
    wait_reason(cluster, namespace, "v3", "ChainResolved", "False", "BaseNotFound")
    wait_reason(cluster, namespace, "v2", "ChainResolved", "False", "BaseNotFound")
    apply(cluster, namespace, wv_body(namespace, "v1"))
    cluster.kubectl("wait", "--for=condition=Ready", "wv/v3", "-n", namespace, "--timeout=60s")
    # v3 Ready wakes the ModelLoad desiring it: it now lacks only nodes.
    wait_for(
        lambda: condition(get(cluster, namespace, "ml", "serve"), "Ready").get("reason") == "InsufficientNodes",
        30,
        "the ModelLoad woken by v3",
    )
    # The deltas and the ModelLoad were woken in process: nothing wrote onto the user's objects to get there.
    for kind, name in (("wv", "v1"), ("wv", "v2"), ("wv", "v3"), ("ml", "serve")):
        assert ferry_annotations(get(cluster, namespace, kind, name)) == {}, (kind, name)
    objs = {n: get(cluster, namespace, "wv", n) for n in ("v1", "v2", "v3")}
    ready_times = [condition(objs[n], "Ready")["lastTransitionTime"] for n in ("v1", "v2", "v3")]
    assert ready_times == sorted(ready_times)
    status = objs["v3"]["status"]
    assert status["phase"] == "Ready"
    assert status["chain"] == ["v1", "v2", "v3"]
    assert status["chainDepth"] == 3
    assert status["tensorCount"] == 1 and status["totalBytes"] > 0
    assert objs["v1"]["status"]["tensorCount"] == 4
    for c in status["conditions"]:
        assert c["observedGeneration"] == 1
    assert objs["v1"]["metadata"]["finalizers"] == ["ferry.dev/release"]
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.name=v3").stdout
    assert "BaseNotFound" in events and "Verified" in events


def test_last_transition_time_moves_only_on_flips(cluster, s3, namespace, operator):
    publish_chain(s3, namespace, ["v1"])
    apply(cluster, namespace, wv_body(namespace, "v1"))
    obj = wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
    before = {c["type"]: c["lastTransitionTime"] for c in obj["status"]["conditions"]}
    time.sleep(3)  # time passes, and reconciles from other events: nothing flips
    after = {c["type"]: c["lastTransitionTime"] for c in get(cluster, namespace, "wv", "v1")["status"]["conditions"]}
    assert before == after


def test_a_status_reason_the_operator_no_longer_knows_is_verified_again(cluster, s3, namespace, operator):
    """A status written by an older operator (here: a StorageVerified reason this one does not know) is read as far
    as it is understood: the version is verified again, not left to a reconcile that fails on it."""
    publish_chain(s3, namespace, ["v1"])
    apply(cluster, namespace, wv_body(namespace, "v1"))
    obj = wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
    conditions = [
        c | {"status": "False", "reason": "OlderReason", "message": "written by an older operator"}
        if c["type"] == "StorageVerified"
        else c
        for c in obj["status"]["conditions"]
    ]
    patch = json.dumps({"status": {"conditions": conditions}})
    cluster.kubectl("patch", "wv", "v1", "-n", namespace, "--subresource=status", "--type=merge", "-p", patch)
    wait_reason(cluster, namespace, "v1", "StorageVerified", "True", "Verified")
    assert condition(get(cluster, namespace, "wv", "v1"), "Ready")["status"] == "True"


@pytest.mark.parametrize(
    ("case", "reason", "phase"),
    [
        ("missing-base", "BaseNotFound", "Pending"),
        ("model-mismatch", "ModelMismatch", "Failed"),
        ("cycle", "ChainCycle", "Failed"),
        ("layout", "LayoutMismatch", "Failed"),
        ("peer-only-base", "UnsupportedFormat", "Failed"),
    ],
)
def test_chain_failures_are_reported(cluster, s3, namespace, operator, case, reason, phase):
    publish_chain(s3, namespace, ["v1", "d1", "d2"])
    bodies = {
        "missing-base": [wv_body(namespace, "d1", base="nope")],
        "model-mismatch": [wv_body(namespace, "v1", model="other"), wv_body(namespace, "d1", base="v1")],
        "cycle": [wv_body(namespace, "d1", base="d2"), wv_body(namespace, "d2", base="d1")],
        "layout": [wv_body(namespace, "v1", layout="a"), wv_body(namespace, "d1", base="v1", layout="b")],
        "peer-only-base": [wv_body(namespace, "v1", fmt="PeerOnly"), wv_body(namespace, "d1", base="v1")],
    }[case]
    apply(cluster, namespace, *bodies)
    obj = wait_reason(cluster, namespace, "d1", "ChainResolved", "False", reason)
    wait_for(lambda: get(cluster, namespace, "wv", "d1")["status"].get("phase") == phase, 10, f"phase {phase}")
    ready = condition(obj, "Ready")
    assert ready["status"] == "False" and ready["reason"] == reason and ready["message"]


def test_chain_longer_than_64_fails(cluster, s3, namespace, operator):
    names = [f"v{i}" for i in range(66)]
    bodies = [wv_body(namespace, names[0], fmt="PeerOnly")] + [
        wv_body(namespace, n, base=b) for b, n in pairwise(names)
    ]
    # Only the chain structure matters here: v65 is 66 versions deep whatever the storage says.
    bodies[1]["spec"]["format"] = "XorDelta"
    bodies[0] = wv_body(namespace, names[0])
    apply(cluster, namespace, *bodies)
    obj = wait_reason(cluster, namespace, "v65", "ChainResolved", "False", "ChainTooLong", timeout=60)
    assert "more than 64" in condition(obj, "ChainResolved")["message"]
    assert obj["status"]["phase"] == "Failed"


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("missing-index", "ObjectMissing"),
        ("missing-shard", "ObjectMissing"),
        ("corrupt-index", "IndexInvalid"),
        ("truncated-shard", "SizeMismatch"),
    ],
)
def test_storage_failures_are_reported(cluster, s3, namespace, operator, case, reason):
    files = cf.build_full_checkpoint(tensors(1), shard_bytes=4 << 10)
    shard = next(f for f in sorted(files) if f.endswith(".safetensors"))
    if case == "missing-index":
        files.pop(cf.INDEX_NAME)
    elif case == "missing-shard":
        files.pop(shard)
    elif case == "corrupt-index":
        files[cf.INDEX_NAME] = b"{not json"
    else:
        files[shard] = files[shard][:-10]
    put_files(s3, namespace, "v1", files)
    apply(cluster, namespace, wv_body(namespace, "v1"))
    obj = wait_reason(cluster, namespace, "v1", "StorageVerified", "False", reason)
    assert condition(obj, "Ready")["reason"] == reason
    if case.startswith("missing"):
        assert "s3://" in condition(obj, "StorageVerified")["message"]


def test_checkpoints_the_agent_would_refuse_are_not_ready_naming_the_tensor_and_the_rule(
    cluster, s3, namespace, operator
):
    """Overlapping data_offsets and a dtype Ferry cannot load (F128): verified by the agent's own rules, not Ready."""

    def overlap(header: dict) -> None:  # layer1's bytes start halfway into layer0's
        begin, end = header["layer1.weight"]["data_offsets"]
        header["layer1.weight"]["data_offsets"] = [begin - 2048, end - 2048]

    def f128(header: dict) -> None:  # the same 4096 bytes, as 256 16-byte elements
        header["layer1.weight"].update(dtype="F128", shape=[256])

    base = cf.build_full_checkpoint(tensors(1), shard_bytes=8 << 10)  # layer0 and layer1 (4 KiB each) in shard 1
    put_files(s3, namespace, "overlap", forged(base, overlap))
    put_files(s3, namespace, "wide", forged(base, f128))
    apply(cluster, namespace, wv_body(namespace, "overlap"), wv_body(namespace, "wide"))
    expected = {
        "overlap": "tensor 'layer1.weight': data_offsets [2048, 6144] overlap tensor 'layer0.weight''s [0, 4096] "
        "(rule offsets-disjoint).",
        "wide": "tensor 'layer1.weight': dtype 'F128' is not one of the fixed-width dtypes Ferry loads",
    }
    for version, said in expected.items():
        obj = wait_reason(cluster, namespace, version, "StorageVerified", "False", "IndexInvalid")
        message = condition(obj, "StorageVerified")["message"]
        assert said in message and "model-00001-of-00002.safetensors has a malformed header" in message, message
        ready = condition(obj, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "IndexInvalid") and obj["status"]["phase"] != "Ready"


def test_object_appearing_later_flips_storage_verified(cluster, s3, namespace, operator):
    apply(cluster, namespace, wv_body(namespace, "v1"))
    wait_reason(cluster, namespace, "v1", "StorageVerified", "False", "ObjectMissing")
    assert get(cluster, namespace, "wv", "v1")["status"]["phase"] == "Pending"
    publish_chain(s3, namespace, ["v1"])
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified", timeout=30)
    assert ferry_annotations(get(cluster, namespace, "wv", "v1")) == {}  # the backoff's retry touched nothing


def _secret(cluster, namespace, name, access, secret):
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name},
        "data": {
            "AWS_ACCESS_KEY_ID": base64.b64encode(access.encode()).decode(),
            "AWS_SECRET_ACCESS_KEY": base64.b64encode(secret.encode()).decode(),
        },
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def test_credentials_from_secret(cluster, s3, namespace, operator):
    publish_chain(s3, namespace, ["v1", "v2", "v3"])
    _secret(cluster, namespace, "good", s3.access_key, s3.secret_key)
    _secret(cluster, namespace, "bad", s3.access_key, "wrong-secret")
    apply(
        cluster,
        namespace,
        wv_body(namespace, "v1", secret="good", endpoint=s3.endpoint),
        wv_body(namespace, "v2", base="v1", secret="bad", endpoint=s3.endpoint),
        wv_body(namespace, "v3", base="v1", secret="absent", endpoint=s3.endpoint),
    )
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
    wait_reason(cluster, namespace, "v2", "StorageVerified", "False", "AccessDenied")
    obj = wait_reason(cluster, namespace, "v3", "StorageVerified", "False", "CredentialsMissing")
    assert "absent" in condition(obj, "StorageVerified")["message"]


def test_unreachable_endpoint_is_transient(cluster, s3, namespace, operator):
    dead = f"http://127.0.0.1:{free_port()}"
    # The tenant's own credentials: the operator's are never sent to an endpoint the admin did not allow.
    _secret(cluster, namespace, "s3", s3.access_key, s3.secret_key)
    apply(cluster, namespace, wv_body(namespace, "v1", secret="s3", endpoint=dead))
    obj = wait_reason(cluster, namespace, "v1", "StorageVerified", "False", "EndpointUnreachable")
    assert obj["status"]["phase"] == "Pending"


def test_release_waits_for_dependents_and_modelloads(cluster, s3, namespace, operator):
    publish_chain(s3, namespace, ["v1", "v2"])
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    cluster.kubectl("wait", "--for=condition=Ready", "wv/v2", "-n", namespace, "--timeout=60s")
    ml = {
        "apiVersion": "ferry.dev/v1alpha1",
        "kind": "ModelLoad",
        "metadata": {"name": "serve"},
        "spec": {"modelName": "m", "desiredVersion": "v1"},
    }
    apply(cluster, namespace, ml)
    cluster.kubectl("delete", "wv", "v1", "-n", namespace, "--wait=false")
    obj = wait_for(
        lambda: (o := get(cluster, namespace, "wv", "v1")) and o["status"].get("phase") == "Releasing" and o,
        20,
        "v1 Releasing",
    )
    blocked = condition(obj, "Ready")
    assert blocked["reason"] == "ReleaseBlocked"
    assert "WeightVersion/v2" in blocked["message"] and "ModelLoad/serve" in blocked["message"]
    assert obj["status"]["releaseBlockers"] == ["WeightVersion/v2", "ModelLoad/serve"]

    cluster.kubectl("delete", "wv", "v2", "-n", namespace)
    wait_for(
        lambda: get(cluster, namespace, "wv", "v1")["status"].get("releaseBlockers") == ["ModelLoad/serve"],
        20,
        "only the ModelLoad blocks",
    )
    assert get(cluster, namespace, "wv", "v1") is not None
    cluster.kubectl("delete", "ml", "serve", "-n", namespace)
    wait_for(lambda: get(cluster, namespace, "wv", "v1") is None, 20, "v1 released")
    # The operator deleted nothing itself: the ModelLoad and v2 are gone only because the test deleted them.

    # Woken by the deletions, not retried on a timer (the safety net is an hour here); and a blocked release is a
    # state, told once at INFO, not a handler failing.
    lines = [line for line in operator.process.log_tail(1_000_000).splitlines() if f"{namespace}/v1" in line]
    assert not [line for line in lines if "[ERROR" in line or "[WARNING" in line], lines
    blocked = [line for line in lines if "release blocked by" in line]
    assert len(blocked) == 1 and "[INFO" in blocked[0] and "WeightVersion/v2, ModelLoad/serve" in blocked[0], lines
    assert len([line for line in lines if line.endswith(f"{namespace}/v1 released")]) == 1, lines


def _refused_version_patches(cluster) -> int:
    """PATCHes of WeightVersions the apiserver has refused with 422 so far (its request counter)."""
    lines = cluster.kubectl("get", "--raw", "/metrics").stdout.splitlines()
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in lines
        if line.startswith("apiserver_request_total{")
        and 'resource="weightversions"' in line
        and 'verb="PATCH"' in line
        and 'code="422"' in line
    )


def _releases_elsewhere(cluster, namespace: str) -> list[str]:
    """WeightVersions outside `namespace` being deleted, or in a namespace that is: an earlier test's, released as
    its namespace goes, whose finalizer patches may be refused (422: the list changed since it was read) and
    counted with this test's."""
    spaces = json.loads(cluster.kubectl("get", "namespaces", "-o", "json").stdout)["items"]
    going = {n["metadata"]["name"] for n in spaces if n["metadata"].get("deletionTimestamp")}
    items = json.loads(cluster.kubectl("get", "wv", "-A", "-o", "json").stdout)["items"]
    return [
        f"{m['namespace']}/{m['name']}"
        for m in (item["metadata"] for item in items)
        if m["namespace"] != namespace and (m.get("deletionTimestamp") or m["namespace"] in going)
    ]


def test_the_release_finalizer_is_added_without_a_refused_patch(cluster, s3, namespace, operator):
    """The operator adds its finalizer itself, next to its status patch: not kopf's patch that tests the
    resourceVersion of the event it handles, which the status patch has just moved (a 422 per new version)."""
    publish_chain(s3, namespace, ["v1", "v2", "v3"])
    wait_for(lambda: not _releases_elsewhere(cluster, namespace), 60, "earlier tests' versions released")
    refused = _refused_version_patches(cluster)
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    v3 = wv_body(namespace, "v3", base="v2")
    v3["metadata"]["finalizers"] = ["example.com/keep"]  # someone else's: kept, ours goes after it
    apply(cluster, namespace, v3)
    held = {"v1": ["ferry.dev/release"], "v2": ["ferry.dev/release"], "v3": ["example.com/keep", "ferry.dev/release"]}
    for name, finalizers in held.items():
        wait_reason(cluster, namespace, name, "Ready", "True", "Verified")
        wait_for(
            lambda n=name, f=finalizers: get(cluster, namespace, "wv", n)["metadata"].get("finalizers") == f,
            20,
            f"{name} held",
        )
    assert _refused_version_patches(cluster) == refused, _releases_elsewhere(cluster, namespace)
    # No admission policy here: the finalizer is the operator's own patch, not the creator's.
    finalizer_owners = _owners(cluster, namespace, "v1", "finalizers")
    assert finalizer_owners and not finalizer_owners & _owners(cluster, namespace, "v1", "spec")

    # Released, the operator takes only its own finalizer away.
    cluster.kubectl("delete", "wv", "v3", "-n", namespace, "--wait=false")
    wait_for(
        lambda: get(cluster, namespace, "wv", "v3")["metadata"].get("finalizers") == ["example.com/keep"],
        20,
        "v3 released by the operator",
    )
    cluster.kubectl(
        "patch", "wv", "v3", "-n", namespace, "--type=json", "-p", '[{"op":"remove","path":"/metadata/finalizers"}]'
    )
    wait_for(lambda: get(cluster, namespace, "wv", "v3") is None, 20, "v3 gone")


def _owners(cluster, namespace: str, name: str, field: str) -> set[str]:
    """The field managers of the version's `metadata.<field>` or `<field>` (its managedFields), those of the status
    subresource apart."""
    args = ("get", "wv", name, "-n", namespace, "-o", "json", "--show-managed-fields")
    managed = json.loads(cluster.kubectl(*args).stdout)["metadata"]["managedFields"]
    return {
        m["manager"]
        for m in managed
        if not m.get("subresource") and f'"f:{field}"' in json.dumps(m.get("fieldsV1") or {})
    }


def test_the_charts_admission_policy_creates_versions_with_the_release_finalizer(
    cluster, s3, namespace, operator, tmp_path
):
    """The chart's MutatingAdmissionPolicy (rendered by the real `helm template` for a 1.36 apiserver, bound to this
    namespace only) adds `ferry.dev/release` at creation: the operator then sends no finalizer patch, and the
    release still takes the finalizer away."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HELM_") and k != "KUBECONFIG"}
    for kind in ("CACHE", "CONFIG", "DATA"):
        env[f"HELM_{kind}_HOME"] = str(tmp_path / kind.lower())
    docs = render(
        env,
        "--api-versions",
        "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy",
        "-s",
        "templates/operator-finalizer-policy.yaml",
        release=f"p-{namespace}",
    )
    assert [d["kind"] for d in docs] == ["MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"]
    _, binding = docs
    binding["spec"]["matchResources"] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    }
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    try:
        publish_chain(s3, namespace, ["v1", "v2"])
        probe = json.dumps(wv_body(namespace, "v1"))

        def mutated() -> bool:  # the policy is live once the admission plugin has read it
            out = cluster.kubectl(
                "create", "--dry-run=server", "-n", namespace, "-o", "json", "-f", "-", input=probe
            ).stdout
            return json.loads(out)["metadata"].get("finalizers") == ["ferry.dev/release"]

        wait_for(mutated, 30, "the admission policy in force")
        apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
        for name in ("v1", "v2"):
            wait_reason(cluster, namespace, name, "Ready", "True", "Verified")
            assert get(cluster, namespace, "wv", name)["metadata"]["finalizers"] == ["ferry.dev/release"]
            # Written by the create's admission, not by a patch of the operator's (whose manager would own it).
            owners = _owners(cluster, namespace, name, "finalizers")
            assert not owners - _owners(cluster, namespace, name, "spec"), owners
        cluster.kubectl("delete", "wv", "v2", "-n", namespace)  # waits for the release
        assert get(cluster, namespace, "wv", "v2") is None
    finally:
        cluster.kubectl("delete", "-f", "-", "--wait=false", input=yaml.safe_dump_all(docs), check=False)


def test_a_base_being_released_takes_its_delta_out_of_ready(cluster, s3, namespace, operator):
    """Event-driven: the base's deletion wakes the delta at once; no resync has to find it."""
    publish_chain(s3, namespace, ["v1", "v2"])
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    cluster.kubectl("wait", "--for=condition=Ready", "wv/v2", "-n", namespace, "--timeout=60s")
    cluster.kubectl("delete", "wv", "v1", "-n", namespace, "--wait=false")
    obj = wait_reason(cluster, namespace, "v2", "ChainResolved", "False", "BaseNotReady", timeout=20)
    assert "being released" in condition(obj, "ChainResolved")["message"]
    assert condition(obj, "Ready")["status"] == "False" and obj["status"]["phase"] == "Pending"
    cluster.kubectl("delete", "wv", "v2", "-n", namespace)
    wait_for(lambda: get(cluster, namespace, "wv", "v1") is None, 20, "v1 released")


def test_info_log_shows_transitions_not_handler_bookkeeping(cluster, s3, namespace, operator):
    publish_chain(s3, namespace, ["v1", "v2"])
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    cluster.kubectl("wait", "--for=condition=Ready", "wv/v2", "-n", namespace, "--timeout=60s")
    cluster.kubectl("delete", "wv", "v2", "-n", namespace)
    log = operator.process.log_tail(100_000)
    assert f"{namespace}/v2 is Ready (chain v1 → v2)" in log
    mine = [line for line in log.splitlines() if f"{namespace}/" in line]
    assert mine and not [line for line in mine if "succeeded." in line or "is processed:" in line], mine


def test_operator_killed_mid_reconcile_converges(cluster, s3, namespace, operator):
    names = [f"v{i}" for i in range(12)]
    publish_chain(s3, namespace, names)
    apply(cluster, namespace, *[wv_body(namespace, n, base=b) for b, n in zip([None, *names], names, strict=False)])
    wait_for(lambda: condition(get(cluster, namespace, "wv", "v2"), "Ready").get("status") == "True", 30, "v2 Ready")
    operator.kill()
    # Delete and create while it is down: the restart must pick both up.
    cluster.kubectl("delete", "wv", "v11", "-n", namespace, "--wait=false")
    apply(cluster, namespace, wv_body(namespace, "late", base="v10"))
    publish_delta(s3, namespace, "late", "v10", tensors(0), tensors(0))
    operator.start()
    for n in [*names[:-1], "late"]:
        cluster.kubectl("wait", "--for=condition=Ready", f"wv/{n}", "-n", namespace, "--timeout=60s")
    wait_for(lambda: get(cluster, namespace, "wv", "v11") is None, 30, "v11 released after restart")
    assert get(cluster, namespace, "wv", "late")["status"]["chainDepth"] == 12


def test_metrics_endpoint(cluster, s3, namespace, operator):
    publish_chain(s3, namespace, ["v1"])
    apply(cluster, namespace, wv_body(namespace, "v1"))
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
    text = urllib.request.urlopen(operator.metrics_url, timeout=5).read().decode()
    assert 'ferry_reconciles_total{kind="WeightVersion",phase="Ready"}' in text
    assert 'ferry_weightversions{phase="Ready"}' in text
    assert "ferry_reconcile_seconds_bucket" in text
