"""A trainer publishes from its own memory (`ferry.trainer.Publisher`): operator + SeaweedFS + a real agent process;
the trainer pod's socket is the one an engine pod gets. The agent authorizes the pod's ServiceAccount with a
SubjectAccessReview, the trainer copies a tiny Llama's state_dict into the agent's chunks, the agent seals them and
writes the canonical objects behind: byte-identical to `ferry publish` of the same state_dict (full, then an XOR
delta with base), and the WeightVersion becomes Ready. A ServiceAccount without the right, and another namespace,
are refused before anything is allocated or written."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest
import torch
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ferry.publish import PublishOptions, publish
from ferry.trainer import Publisher, PublishError
from tests.e2e.attach_consumer import build_model, model_tensors
from tests.support.agents import node, start_agent
from tests.support.consumers import engine_pod
from tests.support.objects import condition, get, wait_for

pytestmark = pytest.mark.e2e

BUCKET = "ferry-trainer"
SECRET = "s3-creds"


def _apply(cluster, namespace: str, body: dict) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def _trainer_account(cluster, namespace: str, name: str) -> None:
    """A ServiceAccount that may create WeightVersions in `namespace` (a Role and its RoleBinding)."""
    _apply(cluster, namespace, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
    rbac = "rbac.authorization.k8s.io/v1"
    _apply(
        cluster,
        namespace,
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": {"name": "publish"},
            "rules": [{"apiGroups": ["ferry.dev"], "resources": ["weightversions"], "verbs": ["create", "get"]}],
        },
    )
    _apply(
        cluster,
        namespace,
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {"name": "publish"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "publish"},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    )


def _objects(s3, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def _ferry_publish(s3, tmp_path, state: dict[str, torch.Tensor], prefix: str, version: str, base=None) -> None:
    """`ferry publish --no-apply` of the same tensors (a torch state dict file), as a trainer would run it."""
    path = tmp_path / f"{version}.pt"
    torch.save(state, path)
    base_dir = None
    if base is not None:
        base_dir = tmp_path / f"{base[0]}.pt"
        torch.save(base[1], base_dir)
    publish(
        PublishOptions(
            source=path,
            version=version,
            uri_prefix=f"s3://{BUCKET}/{prefix}",
            base=base[0] if base else None,
            base_dir=base_dir,
            endpoint=s3.endpoint,
            apply=False,
        )
    )


def test_trainer_publishes_from_memory_byte_identical_to_ferry_publish(
    cluster, s3, namespace, operator, tmp_path, socket_root, monkeypatch
):
    s3.create_bucket(BUCKET)
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)  # the reference `ferry publish` below
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "stringData": s3.env()}
    _apply(cluster, namespace, secret)
    _trainer_account(cluster, namespace, "trainer")
    node_name = f"{namespace}-n0"
    node(cluster, node_name)
    agent = start_agent(cluster, tmp_path, node_name, socket_dir=socket_root, s3=s3)
    run = uuid.uuid4().hex[:8]

    def describe() -> str:
        return agent.log_tail(40)

    try:
        uid = engine_pod(cluster, namespace, node_name, "trainer", service_account="trainer")
        pod_dir = socket_root / "pods" / uid
        wait_for(lambda: (pod_dir / "ferry.sock").exists(), 30, "the trainer pod's socket", describe)
        pub = Publisher(
            "llama",
            f"s3://{BUCKET}/{run}/trainer",
            namespace=namespace,
            endpoint=s3.endpoint,
            credentials_secret=SECRET,
            layout_signature="llama/f32/tp1",
            socket_dir=pod_dir,
        )
        step1 = {n: t.detach().clone() for n, t in model_tensors(build_model(seed=0)).items()}
        h1 = pub.publish(step1, version="step-1")
        # The sealed bytes the agent holds are the trainer's.
        assert h1.sha256 == {n: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for n, t in step1.items()}
        uri = h1.wait_durable(timeout=120)
        assert uri == f"s3://{BUCKET}/{run}/trainer/step-1/model.safetensors.index.json"

        # Step 2: a few tensors change; published as the XOR delta of step-1, which the agent holds.
        step2 = {n: t.clone() for n, t in step1.items()}
        for name in sorted(step2)[:3]:
            step2[name] += 0.5
        pub.publish(step2, version="step-2", base="step-1").wait_durable(timeout=120)

        _ferry_publish(s3, tmp_path, step1, f"{run}/cli", "step-1")
        _ferry_publish(s3, tmp_path, step2, f"{run}/cli", "step-2", base=("step-1", step1))
        for version in ("step-1", "step-2"):
            mine = _objects(s3, f"{run}/trainer/{version}/")
            reference = _objects(s3, f"{run}/cli/{version}/")
            assert mine and mine.keys() == reference.keys(), (sorted(mine), sorted(reference))
            for name in mine:
                assert mine[name] == reference[name], f"{version}/{name} differs from ferry publish's"

        for version, fmt in (("step-1", "FullCheckpoint"), ("step-2", "XorDelta")):
            wv = wait_for(
                lambda v=version: (
                    (o := get(cluster, namespace, "weightversion", v))
                    and (o.get("status") or {}).get("phase") == "Ready"
                    and o
                ),
                120,
                f"{version} Ready",
                lambda v=version: json.dumps(get(cluster, namespace, "weightversion", v), indent=1) + describe(),
            )
            assert wv["spec"]["format"] == fmt and wv["spec"]["storage"]["credentialsSecret"] == SECRET
            assert condition(wv, "Ready")["status"] == "True"
        assert get(cluster, namespace, "weightversion", "step-2")["spec"]["baseVersion"] == "step-1"

        # Publishing the same name again is a conflict, not an overwrite.
        with pytest.raises(PublishError) as again:
            pub.publish(step2, version="step-1")
        assert again.value.code == "Conflict"
        pub.close()
    finally:
        agent.stop()


def test_a_pod_without_the_right_or_another_namespace_is_refused_and_nothing_is_written(
    cluster, s3, namespace, tmp_path, socket_root
):
    s3.create_bucket(BUCKET)
    _trainer_account(cluster, namespace, "trainer")
    _apply(cluster, namespace, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "engine"}})
    node_name = f"{namespace}-n0"
    node(cluster, node_name)
    agent = start_agent(cluster, tmp_path, node_name, socket_dir=socket_root, s3=s3)
    run = uuid.uuid4().hex[:8]
    tensors = {"w": torch.ones(8, 8)}
    try:
        engine_uid = engine_pod(cluster, namespace, node_name, "engine", service_account="engine")
        trainer_uid = engine_pod(cluster, namespace, node_name, "trainer", service_account="trainer")
        for uid in (engine_uid, trainer_uid):
            wait_for(lambda u=uid: (socket_root / "pods" / u / "ferry.sock").exists(), 30, "sockets", agent.log_tail)

        # The ServiceAccount may not create WeightVersions: the apiserver refuses its own real token too.
        token = cluster.kubectl("create", "token", "engine", "-n", namespace).stdout.strip()
        cfg = client.Configuration()
        cfg.host, cfg.ssl_ca_cert = cluster.server, str(cluster.pki.ca_cert)
        cfg.api_key = {"authorization": f"Bearer {token}"}
        wv = {"apiVersion": "ferry.dev/v1alpha1", "kind": "WeightVersion", "metadata": {"name": "probe"}, "spec": {}}
        with pytest.raises(ApiException) as direct:
            client.CustomObjectsApi(client.ApiClient(cfg)).create_namespaced_custom_object(
                "ferry.dev", "v1alpha1", namespace, "weightversions", wv
            )
        assert direct.value.status == 403
        refused = Publisher("llama", f"s3://{BUCKET}/{run}", socket_dir=socket_root / "pods" / engine_uid)
        with pytest.raises(PublishError) as denied:
            refused.publish(tensors, version="v1")
        assert denied.value.code == "Forbidden" and f"system:serviceaccount:{namespace}:engine" in str(denied.value)

        # A pod that may publish in its namespace may not publish into another.
        other = Publisher(
            "llama", f"s3://{BUCKET}/{run}", namespace="default", socket_dir=socket_root / "pods" / trainer_uid
        )
        with pytest.raises(PublishError) as elsewhere:
            other.publish(tensors, version="v1")
        assert elsewhere.value.code == "Forbidden"
        assert get(cluster, namespace, "weightversion", "v1") is None
        assert get(cluster, "default", "weightversion", "v1") is None
        assert not s3.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{run}/").get("Contents")
        refused.close()
        other.close()
    finally:
        agent.stop()
