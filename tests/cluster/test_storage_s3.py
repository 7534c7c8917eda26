"""Storage verification against a real S3 server (SeaweedFS): real HTTP errors, real credentials checks."""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import numpy as np
import pytest

from ferry import checkpoint_format as ckpt
from ferry.s3 import new_client, verification
from ferry.storage import StorageReason, StorageReport, verify_checkpoint
from ferry_dev.localcluster import S3Server, free_port

pytestmark = pytest.mark.cluster

BUCKET = "ferry-verify"


@pytest.fixture(scope="module")
def s3_server(s3: S3Server) -> S3Server:
    """The session's SeaweedFS (tests/conftest.py), with this module's bucket."""
    s3.create_bucket(BUCKET)
    return s3


@pytest.fixture(scope="module")
def client(s3_server: S3Server) -> Any:
    """The verifier's own client, with the server's real credentials."""
    return new_client(
        s3_server.endpoint,
        "us-east-1",
        {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key},
        verification(),
    )


def upload(s3_server: S3Server, files: dict[str, bytes]) -> str:
    """Publish under a fresh prefix; returns the index URI."""
    prefix = f"llama/{uuid.uuid4().hex[:8]}/"
    writer = s3_server.client()
    for name, data in files.items():
        writer.put_object(Bucket=BUCKET, Key=prefix + name, Body=data)
    return f"s3://{BUCKET}/{prefix}{ckpt.INDEX_NAME}"


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.weight": rng.standard_normal((32, 16)).astype(np.float32) for i in range(6)}


def full(client: Any, uri: str) -> StorageReport:
    return verify_checkpoint(client, uri, fmt="FullCheckpoint", version="v1", base_version=None)


def test_verified_full_checkpoint(s3_server: S3Server, client: Any) -> None:
    files = ckpt.build_full_checkpoint(weights(1), shard_bytes=4096)
    report = full(client, upload(s3_server, files))
    assert report.ok and report.reason == StorageReason.Verified, report.message
    assert report.tensor_count == 6 and report.shard_count == 3
    assert report.total_bytes == sum(len(data) for name, data in files.items() if name != ckpt.INDEX_NAME)


def test_verified_delta(s3_server: S3Server, client: Any) -> None:
    base = weights(1)
    new = {name: array.copy() for name, array in base.items()}
    new["layers.2.weight"][0] += 1
    uri = upload(s3_server, ckpt.build_xor_delta(base, new, version="v2", base_version="v1"))
    report = verify_checkpoint(client, uri, fmt="XorDelta", version="v2", base_version="v1")
    assert report.ok and report.reason == StorageReason.Verified, report.message
    assert (report.tensor_count, report.shard_count) == (1, 1)
    mislabelled = verify_checkpoint(client, uri, fmt="XorDelta", version="v3", base_version="v2")
    assert mislabelled.reason == StorageReason.IndexInvalid


def test_missing_index(client: Any) -> None:
    uri = f"s3://{BUCKET}/nowhere/{ckpt.INDEX_NAME}"
    report = full(client, uri)
    assert (report.ok, report.reason, report.transient) == (False, StorageReason.ObjectMissing, False)
    assert uri in report.message


def test_missing_bucket(client: Any) -> None:
    report = full(client, f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/{ckpt.INDEX_NAME}")
    assert report.reason == StorageReason.ObjectMissing


def test_missing_shard(s3_server: S3Server, client: Any) -> None:
    files = ckpt.build_full_checkpoint(weights(2), shard_bytes=4096)
    del files["model-00002-of-00003.safetensors"]
    report = full(client, upload(s3_server, files))
    assert report.reason == StorageReason.ObjectMissing
    assert "model-00002-of-00003.safetensors" in report.message and report.message.count("s3://") == 1


def test_truncated_shard(s3_server: S3Server, client: Any) -> None:
    files = ckpt.build_full_checkpoint(weights(3), shard_bytes=4096)
    files["model-00003-of-00003.safetensors"] = files["model-00003-of-00003.safetensors"][:-10]
    report = full(client, upload(s3_server, files))
    assert report.reason == StorageReason.SizeMismatch and not report.transient
    assert "model-00003-of-00003.safetensors" in report.message and "truncated" in report.message


def test_corrupt_index_json(s3_server: S3Server, client: Any) -> None:
    files = ckpt.build_full_checkpoint(weights(4), shard_bytes=4096)
    files[ckpt.INDEX_NAME] = files[ckpt.INDEX_NAME][:-20]
    report = full(client, upload(s3_server, files))
    assert report.reason == StorageReason.IndexInvalid and "not valid JSON" in report.message


def test_total_size_mismatch(s3_server: S3Server, client: Any) -> None:
    files = ckpt.build_full_checkpoint(weights(5), shard_bytes=4096)
    index = json.loads(files[ckpt.INDEX_NAME])
    index["metadata"]["total_size"] += 1
    files[ckpt.INDEX_NAME] = json.dumps(index).encode()
    report = full(client, upload(s3_server, files))
    assert report.reason == StorageReason.SizeMismatch and str(index["metadata"]["total_size"]) in report.message


@pytest.mark.parametrize(
    ("access_key", "secret_key"),
    [(None, "wrong-secret"), ("nobody", "wrong-secret")],
    ids=["wrong-secret", "unknown-key"],
)
def test_wrong_credentials_are_denied(s3_server: S3Server, access_key: str | None, secret_key: str) -> None:
    uri = upload(s3_server, ckpt.build_full_checkpoint(weights(6), shard_bytes=1 << 20))
    bad = new_client(
        s3_server.endpoint,
        "us-east-1",
        {"AWS_ACCESS_KEY_ID": access_key or s3_server.access_key, "AWS_SECRET_ACCESS_KEY": secret_key},
        verification(),
    )
    report = full(bad, uri)
    assert (report.ok, report.reason, report.transient) == (False, StorageReason.AccessDenied, False), report.message
    assert uri in report.message


def test_unreachable_endpoint_is_transient() -> None:
    closed = new_client(
        f"http://127.0.0.1:{free_port()}",
        "us-east-1",
        {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"},
        dataclasses.replace(verification(), connect_timeout=1, max_attempts=1),
    )
    report = full(closed, f"s3://{BUCKET}/x/{ckpt.INDEX_NAME}")
    assert (report.ok, report.reason, report.transient) == (False, StorageReason.EndpointUnreachable, True)
