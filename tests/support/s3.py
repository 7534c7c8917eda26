"""Helpers for the S3 strategy tests: weights, canonical checkpoints in the real S3, WeightVersion bodies."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ferry import checkpoint_format as ckpt
from ferry_agent.store.checkpoints import ArtifactKind, CheckpointStore, model_key
from ferry_agent.strategies.chain import LoadContext
from ferry_agent.strategies.object_storage.strategy import ObjectStorageStrategy, S3LoadResult
from ferry_dev.localcluster import S3Server

BUCKET = "ferry-s3-strategy"
MODEL = "org/llama"
NAMESPACE = "tenant-a"  # of the replica and of every WeightVersion it reads
KEY = model_key(NAMESPACE, MODEL)  # the model in the checkpoint store
SHARD_BYTES = 200 * 1024  # several shards per full checkpoint
RANGE_BYTES = 48 * 1024  # several ranged GETs per shard
FULL, DELTA, MAT = ArtifactKind.FULL, ArtifactKind.DELTA, ArtifactKind.MATERIALIZED

Weights = dict[str, np.ndarray]


def weights(seed: int) -> Weights:
    """Mixed dtypes and shapes, including a 0-d and an empty tensor."""
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((128, 256)).astype(np.float32),
        "layers.0.attn.weight": rng.standard_normal((256, 256)).astype(np.float16),
        "layers.0.mlp.weight": rng.standard_normal((64, 512)).astype(np.float32),
        "layers.1.mlp.weight": rng.standard_normal((300, 100)).astype(np.float32),
        "norm.scale": np.float32(rng.standard_normal()).reshape(()),
        "step": rng.integers(0, 1 << 40, 3, dtype=np.int64),
        "mask": rng.integers(0, 2, 17).astype(bool),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def evolve(base: Weights, seed: int, names: list[str], *, scramble: bool = False) -> Weights:
    """A new version: a slice of each named tensor redrawn, or (`scramble`) every byte XORed with noise, which
    makes the delta frame incompressible (so one flipped stored byte flips one decoded byte)."""
    rng = np.random.default_rng(seed)
    new = {name: array.copy() for name, array in base.items()}
    for name in names:
        raw = new[name].reshape(-1).view(np.uint8)
        if scramble:
            raw ^= rng.integers(0, 256, raw.size, dtype=np.uint8)
        else:
            raw[raw.size // 4 : raw.size // 2] = rng.integers(0, 256, raw.size // 2 - raw.size // 4, dtype=np.uint8)
    return new


def sprinkle(base: Weights, seed: int, fraction: float) -> Weights:
    """A new version as an RL step makes it: `fraction` of every tensor's elements, scattered, get new values."""
    rng = np.random.default_rng(seed)
    new = {name: array.copy() for name, array in base.items()}
    for array in new.values():
        flat = array.reshape(-1)
        if flat.size == 0:
            continue
        at = rng.choice(flat.size, max(1, int(flat.size * fraction)), replace=False)
        elements = flat.view(np.uint8).reshape(flat.size, -1)
        if array.dtype == np.bool_:
            elements[at] ^= np.uint8(1)
        else:  # every byte of the element differs, by a random amount
            elements[at] ^= rng.integers(1, 256, elements[at].shape, dtype=np.uint8)
    return new


def full(tensors: Weights) -> dict[str, bytes]:
    return ckpt.build_full_checkpoint(tensors, SHARD_BYTES)


def delta(base: Weights, new: Weights, version: str, base_version: str, *, sparse: bool = False) -> dict[str, bytes]:
    return ckpt.build_xor_delta(base, new, version=version, base_version=base_version, sparse=sparse)


def wv(
    name: str,
    fmt: str = "XorDelta",
    base: str | None = None,
    *,
    uri: str | None = None,
    ready: bool = True,
    model: str = MODEL,
    endpoint: str | None = None,
) -> dict[str, Any]:
    """A WeightVersion object as the API returns it."""
    spec: dict[str, Any] = {"modelName": model, "format": fmt}
    if base:
        spec["baseVersion"] = base
    if fmt != "PeerOnly":
        spec["storage"] = {"uri": uri or f"s3://{BUCKET}/nowhere/{name}/{ckpt.INDEX_NAME}"}
        if endpoint:
            spec["storage"]["endpoint"] = endpoint
    status = "True" if ready else "False"
    return {
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": str(uuid.uuid4())},
        "spec": spec,
        "status": {
            "conditions": [
                {"type": "Ready", "status": status, "reason": "Ready", "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ]
        },
    }


class Registry:
    """Publishes checkpoints to S3 under a fresh prefix and answers `fetch_version` like the API would."""

    def __init__(self, server: S3Server) -> None:
        self.server = server
        self.client = server.client()
        self.prefix = f"llama/{uuid.uuid4().hex[:8]}"
        self.versions: dict[str, dict[str, Any]] = {}

    def key(self, version: str, file: str) -> str:
        return f"{self.prefix}/{version}/{file}"

    def uri(self, version: str, file: str = ckpt.INDEX_NAME) -> str:
        return f"s3://{BUCKET}/{self.key(version, file)}"

    def publish(
        self, name: str, files: Mapping[str, bytes], fmt: str = "FullCheckpoint", base: str | None = None
    ) -> None:
        for file, data in files.items():
            self.client.put_object(Bucket=BUCKET, Key=self.key(name, file), Body=data)
        self.versions[name] = wv(name, fmt, base, uri=self.uri(name))  # endpoint: the strategy's default

    def delete(self, version: str, file: str) -> None:
        self.client.delete_object(Bucket=BUCKET, Key=self.key(version, file))

    def strategy(self, store: CheckpointStore, *, endpoint: str | None = None, **kwargs: Any) -> ObjectStorageStrategy:
        """A strategy reading this registry's versions, from the server or from `endpoint` (a relay in front of it)."""
        creds = {"AWS_ACCESS_KEY_ID": self.server.access_key, "AWS_SECRET_ACCESS_KEY": self.server.secret_key}
        return ObjectStorageStrategy(
            namespace=NAMESPACE,
            fetch_version=self.versions.get,
            credentials=lambda storage: creds,
            store=store,
            default_endpoint=endpoint or self.server.endpoint,
            download_workers=4,
            range_bytes=RANGE_BYTES,
            **kwargs,
        )


def ctx(version: str, **kwargs: Any) -> LoadContext:
    return LoadContext(model=MODEL, version=version, rank=0, target_id="replica-0", **kwargs)


def shas(tensors: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's raw bytes."""
    out = {}
    for name, t in tensors.items():
        raw = t.reshape(-1).view(torch.uint8).numpy() if isinstance(t, torch.Tensor) else np.ascontiguousarray(t)
        out[name] = hashlib.sha256(raw.tobytes()).hexdigest()
    return out


def resident_shas(result: S3LoadResult) -> dict[str, str]:
    return shas(result.resident.tensors)


def debris(root: Path) -> list[Path]:
    return list(root.rglob("*.tmp"))


def publish_chain3(registry: Registry, chain3: tuple[Weights, Weights, Weights]) -> None:
    w1, w2, w3 = chain3
    registry.publish("v1", full(w1))
    registry.publish("v2", delta(w1, w2, "v2", "v1"), "XorDelta", "v1")
    registry.publish("v3", delta(w2, w3, "v3", "v2"), "XorDelta", "v2")
