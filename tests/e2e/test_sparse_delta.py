"""Sparse delta patches through the real parts: `ferry publish` writes an RL-like step (2% of every tensor's
elements changed) as a format-version-2 delta of patches, the real operator verifies it, and a real agent replays it
from SeaweedFS onto its full base and serves exactly the trainer's bytes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ferry import checkpoint_format as ckpt
from ferry.publish import PublishOptions, publish
from ferry_dev.soak import environment
from tests.support.agents import content_sha256, node, read_back, replica, start_agent, wait_phase
from tests.support.objects import BUCKET, apply, wait_reason

pytestmark = pytest.mark.e2e


def step(base: dict[str, torch.Tensor], seed: int, fraction: float) -> dict[str, torch.Tensor]:
    """`fraction` of every tensor's elements, scattered, get new values (as an RL step changes them)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in base.items():
        new = tensor.clone().reshape(-1)
        at = torch.randperm(new.numel(), generator=gen)[: max(1, int(new.numel() * fraction))]
        new[at] += torch.rand(at.numel(), generator=gen).to(new.dtype) + 1
        out[name] = new.reshape(tensor.shape)
    return out


def test_a_sparse_step_is_published_verified_and_replayed_from_s3_byte_exact(
    cluster, s3, namespace, operator, tmp_path
):
    gen = torch.Generator().manual_seed(11)
    v1 = {f"layers.{i}.weight": torch.randn((256, 256), generator=gen).to(torch.bfloat16) for i in range(4)}
    v1["norm.weight"] = torch.randn((4096,), generator=gen)
    v2 = step(v1, seed=12, fraction=0.02)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "s3"},
        "stringData": {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key},
    }
    apply(cluster, namespace, secret)
    s3.create_bucket(BUCKET)
    for name, weights, base in (("v1", v1, None), ("v2", v2, "v1")):
        (tmp_path / name).mkdir()
        save_file(weights, str(tmp_path / name / "model.safetensors"))
        opts = PublishOptions(
            source=tmp_path / name,
            version=name,
            uri_prefix=f"s3://{BUCKET}/{namespace}",
            model="m",
            base=base,
            base_dir=tmp_path / base if base else None,
            endpoint=s3.endpoint,
            credentials_secret="s3",
            namespace=namespace,
            kubeconfig=str(cluster.kubeconfig),
        )
        with environment(s3.env()):
            publish(opts)
        wait_reason(cluster, namespace, name, "Ready", "True", "Verified")

    # What S3 holds for v2: a version 2 delta whose every tensor is a patch, about the size of the changed elements.
    client = s3.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{namespace}/v2/")["Contents"]]
    index = json.loads(client.get_object(Bucket=BUCKET, Key=f"{namespace}/v2/{ckpt.INDEX_NAME}")["Body"].read())
    assert index["metadata"]["format_version"] == 2 and index["metadata"]["delta_encoding"] == "xor+sparse", index
    stored = sum(client.head_object(Bucket=BUCKET, Key=k)["ContentLength"] for k in keys if k.endswith(".safetensors"))
    changed = sum(
        int((v2[n].view(torch.uint8) != v1[n].view(torch.uint8)).reshape(v1[n].numel(), -1).any(1).sum())
        * (4 + v1[n].element_size())
        for n in v1
    )
    assert stored < 2 * changed, (stored, changed)  # whole-tensor XOR frames of random changes would be ~10x this

    node(cluster, f"{namespace}-n")
    agent = start_agent(cluster, tmp_path, f"{namespace}-n", s3=s3)
    try:
        replica(cluster, namespace, "wr-sparse", f"{namespace}-n", "v2")
        served = wait_phase(cluster, namespace, "wr-sparse", "Serving", agent)
        assert served["status"]["source"].startswith("s3"), served["status"]
        assert read_back(served["status"]["ranks"][0], "wr-sparse") == content_sha256(v2)
    finally:
        agent.stop()
