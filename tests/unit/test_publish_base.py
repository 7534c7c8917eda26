"""`ferry.publish.base`: a delta's base rebuilt from the stored chain, over an in-memory fake S3."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import ClientError

from ferry import checkpoint_format as ckpt
from ferry.api.models import MAX_CHAIN_LENGTH
from ferry.publish.base import replay_base
from ferry.publish.errors import PublishError
from ferry.publish.weights import Weights, build_files, load_weights

pytestmark = pytest.mark.unit

BUCKET = "weights"


class FakeS3:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put_version(self, version: str, files: dict[str, bytes]) -> None:
        for name, data in files.items():
            self.objects[f"{version}/{name}"] = data

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        if Bucket != BUCKET or Key not in self.objects:
            error = {"Error": {"Code": "NoSuchKey", "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 404}}
            raise ClientError(error, "GetObject")
        return {"Body": io.BytesIO(self.objects[Key])}


def locate(version: str) -> str:
    return f"s3://{BUCKET}/{version}/{ckpt.INDEX_NAME}"


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layer.{i}": rng.standard_normal(64).astype(np.float32) for i in range(4)}


def weights(arrays: dict[str, np.ndarray]) -> Weights:
    return Weights(dict(arrays), {name: "F32" for name in arrays})


def test_replays_the_stored_chain() -> None:
    fake = FakeS3()
    v1, v2, v3 = tensors(1), tensors(1), tensors(1)
    v2["layer.1"] = v2["layer.1"] + 1
    v3["layer.1"], v3["layer.3"] = v2["layer.1"] * 2, v3["layer.3"] - 1
    fake.put_version("v1", build_files(weights(v1), version="v1", shard_bytes=1 << 20))
    fake.put_version("v2", build_files(weights(v2), version="v2", shard_bytes=1 << 20, base=("v1", weights(v1))))
    fake.put_version("v3", build_files(weights(v3), version="v3", shard_bytes=1 << 20, base=("v2", weights(v2))))
    rebuilt = replay_base(fake, "v3", locate)
    assert rebuilt.arrays.keys() == v3.keys()
    for name, array in v3.items():
        assert rebuilt.arrays[name].tobytes() == array.tobytes(), name


def test_a_cycle_in_the_stored_indexes_is_refused() -> None:
    fake = FakeS3()
    a, b = tensors(1), tensors(2)
    fake.put_version("v1", ckpt.build_xor_delta(a, b, version="v1", base_version="v2"))
    fake.put_version("v2", ckpt.build_xor_delta(b, a, version="v2", base_version="v1"))
    with pytest.raises(PublishError, match="cycle: v1 → v2 → v1"):
        replay_base(fake, "v1", locate)


def test_a_chain_longer_than_the_limit_is_refused() -> None:
    fake = FakeS3()
    a, b = tensors(1), tensors(2)
    for i in range(1, MAX_CHAIN_LENGTH + 2):
        fake.put_version(f"v{i}", ckpt.build_xor_delta(a, b, version=f"v{i}", base_version=f"v{i - 1}"))
    with pytest.raises(PublishError, match=f"more than {MAX_CHAIN_LENGTH} versions"):
        replay_base(fake, f"v{MAX_CHAIN_LENGTH + 1}", locate)


def test_an_index_of_another_version_is_refused() -> None:
    fake = FakeS3()
    a, b = tensors(1), tensors(2)
    fake.put_version("v2", ckpt.build_xor_delta(a, b, version="v9", base_version="v1"))
    with pytest.raises(PublishError, match="is the delta of 'v9', not of 'v2'"):
        replay_base(fake, "v2", locate)


def test_a_missing_base_is_named() -> None:
    fake = FakeS3()
    fake.put_version("v2", ckpt.build_xor_delta(tensors(1), tensors(2), version="v2", base_version="v1"))
    with pytest.raises(PublishError, match=f"{locate('v1')} does not exist"):
        replay_base(fake, "v2", locate)


def test_loads_what_it_wrote(tmp_path: Path) -> None:
    files = build_files(weights(tensors(3)), version="v1", shard_bytes=1 << 20)
    for name, data in files.items():
        if name != ckpt.INDEX_NAME:
            (tmp_path / name).write_bytes(data)
    loaded = load_weights(tmp_path)
    assert {n: a.tobytes() for n, a in loaded.arrays.items()} == {n: a.tobytes() for n, a in tensors(3).items()}
