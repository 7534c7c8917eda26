"""Helpers for e2e tests: publish canonical checkpoints to the real S3 and read WeightVersion status."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ferry import checkpoint_format as cf
from ferry.api.models import API_VERSION
from ferry_dev.localcluster import LocalCluster, S3Server

BUCKET = "e2e-models"


def tensors(seed: int, n: int = 4, shape: tuple[int, int] = (32, 32)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer{i}.weight": rng.standard_normal(shape).astype(np.float32) for i in range(n)}


def uri(namespace: str, version: str) -> str:
    return f"s3://{BUCKET}/{namespace}/{version}/{cf.INDEX_NAME}"


def put_files(s3: S3Server, namespace: str, version: str, files: dict[str, bytes]) -> None:
    s3.create_bucket(BUCKET)
    client = s3.client()
    for filename, data in files.items():
        client.put_object(Bucket=BUCKET, Key=f"{namespace}/{version}/{filename}", Body=data)


def forged(files: dict[str, bytes], change: Callable[[dict[str, Any]], None]) -> dict[str, bytes]:
    """A checkpoint whose first shard's header `change` edits (its parsed JSON, entries by tensor name), the shard's
    data cut or zero-padded to what the edited header describes: it breaks a header rule, yet is as long as it says,
    its index and checksums as they were."""
    shard = min(name for name in files if name != cf.INDEX_NAME)
    length, header = cf.parse_safetensors_header(files[shard])
    change(header)
    end = max(e["data_offsets"][1] for name, e in header.items() if name != cf.METADATA_KEY)
    data = files[shard][cf.HEADER_PREFIX_BYTES + length :][:end].ljust(end, b"\0")
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return {**files, shard: struct.pack("<Q", len(text)) + text + data}


def publish_full(s3: S3Server, namespace: str, version: str, weights: dict[str, np.ndarray]) -> None:
    put_files(s3, namespace, version, cf.build_full_checkpoint(weights, shard_bytes=8 << 10))


def publish_delta(s3: S3Server, namespace: str, version: str, base: str, old: dict, new: dict) -> None:
    put_files(s3, namespace, version, cf.build_xor_delta(old, new, version=version, base_version=base))


def wv_body(
    namespace: str,
    name: str,
    *,
    base: str | None = None,
    model: str = "m",
    fmt: str | None = None,
    layout: str | None = None,
    secret: str | None = None,
    endpoint: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"modelName": model, "format": fmt or ("XorDelta" if base else "FullCheckpoint")}
    if spec["format"] != "PeerOnly":
        spec["storage"] = {"uri": uri(namespace, name)}
        if secret:
            spec["storage"]["credentialsSecret"] = secret
        if endpoint:
            spec["storage"]["endpoint"] = endpoint
    if base:
        spec["baseVersion"] = base
    if layout:
        spec["layoutSignature"] = layout
    return {"apiVersion": API_VERSION, "kind": "WeightVersion", "metadata": {"name": name}, "spec": spec}


def ml_body(
    namespace: str,
    version: str = "v1",
    replicas: int = 1,
    *,
    name: str = "serve",
    model: str = "m",
    pool: str | None = None,
    transfer: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A CPU ModelLoad on the nodes labelled `ferry.dev/pool=<pool>` (default: the namespace's own pool)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ModelLoad",
        "metadata": {"name": name},
        "spec": {
            "modelName": model,
            "desiredVersion": version,
            "replicas": replicas,
            "device": "cpu",
            "nodeSelector": {"ferry.dev/pool": pool or namespace},
            "transfer": transfer or {"timeoutSeconds": 30},
            **spec,
        },
    }


def ml_status(cluster: LocalCluster, namespace: str, name: str = "serve") -> dict:
    return (get(cluster, namespace, "ml", name) or {}).get("status") or {}


def apply(cluster: LocalCluster, namespace: str, *bodies: dict) -> None:
    docs = {"apiVersion": "v1", "kind": "List", "items": list(bodies)}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(docs))


def get(cluster: LocalCluster, namespace: str, kind: str, name: str) -> dict | None:
    result = cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    if result.returncode != 0:
        if "NotFound" in result.stderr:
            return None
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)


def condition(obj: dict | None, type_: str) -> dict:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def wait_for(predicate, timeout: float, what: str, describe=lambda: "", interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{describe()}")


def wait_reason(
    cluster: LocalCluster, namespace: str, name: str, type_: str, status: str, reason: str, timeout: float = 30
) -> dict:
    def check():
        obj = get(cluster, namespace, "wv", name)
        c = condition(obj, type_)
        return obj if c.get("status") == status and c.get("reason") == reason else None

    return wait_for(
        check,
        timeout,
        f"{name} {type_}={status}/{reason}",
        lambda: json.dumps((get(cluster, namespace, "wv", name) or {}).get("status"), indent=1),
    )
