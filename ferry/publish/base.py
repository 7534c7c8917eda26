"""A delta's base rebuilt from S3: the base's replay chain (resolved by `ferry.chain`) is read index by index,
its full checkpoint loaded and every delta applied, adler32 checked."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from botocore.exceptions import ClientError

from ferry import checkpoint_format as ckpt
from ferry import s3
from ferry.api.models import WeightFormat
from ferry.chain import VersionView, resolve_chain
from ferry.publish.errors import InvalidPublish, PublishNotFound, publish_error
from ferry.publish.weights import Weights, read_safetensors


def _get(client: Any, uri: str) -> bytes:
    try:
        bucket, key = s3.parse_s3_uri(uri)
    except s3.InvalidUri as exc:
        raise InvalidPublish(str(exc)) from exc
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as exc:
        error = s3.translate(exc, uri)
        if isinstance(error, s3.ObjectMissing):
            raise PublishNotFound(f"{uri} does not exist") from exc
        raise publish_error(error) from exc


def _sibling(index: str, shard: str) -> str:
    return index.rsplit("/", 1)[0] + "/" + shard


def _index(client: Any, uri: str) -> ckpt.CheckpointIndex:
    try:
        return ckpt.parse_index(_get(client, uri))
    except ckpt.InvalidIndex as exc:
        raise InvalidPublish(f"{uri} is not a canonical index: {exc}") from exc


def _shards(client: Any, uri: str, index: ckpt.CheckpointIndex) -> Iterator[tuple[str, Weights, dict[str, str]]]:
    """(shard name, its tensors, its checksums) for every shard, checked against the index."""
    for shard in index.shards:
        part = Weights({}, {})
        checksums = read_safetensors(_get(client, _sibling(uri, shard)), _sibling(uri, shard), part)
        if set(part.arrays) != index.tensors_in(shard):
            raise InvalidPublish(f"{_sibling(uri, shard)} does not hold the tensors its index maps to it")
        yield shard, part, checksums


def _chain(client: Any, version: str, locate: Callable[[str], str]) -> list[tuple[str, ckpt.CheckpointIndex]]:
    """(index URI, index) of every version of `version`'s chain, root first. The stored indexes are the links:
    a delta index names its base, so the chain is what was uploaded, whatever the API says."""
    indexes: dict[str, tuple[str, ckpt.CheckpointIndex]] = {}

    def lookup(name: str) -> VersionView:
        uri = locate(name)
        index = _index(client, uri)
        if index.is_delta and index.metadata["version"] != name:
            raise InvalidPublish(f"{uri} is the delta of {index.metadata['version']!r}, not of {name!r}")
        indexes[name] = (uri, index)
        return VersionView(
            name=name,
            model_name="",  # the base's model is checked by `locate`
            format=WeightFormat.XOR_DELTA if index.is_delta else WeightFormat.FULL_CHECKPOINT,
            base_version=index.metadata["base_version"] if index.is_delta else None,
            layout_signature=None,
            ready=True,
            deleting=False,
            has_storage=True,
        )

    result = resolve_chain(version, lookup)
    if not result.ok:
        raise InvalidPublish(f"the chain of {version!r} cannot be replayed: {result.message}")
    return [indexes[name] for name in result.chain]


def replay_base(client: Any, version: str, locate: Callable[[str], str]) -> Weights:
    """The full weights of `version`: its chain's full checkpoint with every delta applied, adler32 checked."""
    (root_uri, root), *deltas = _chain(client, version, locate)
    weights = Weights({}, {})
    for _, part, checksums in _shards(client, root_uri, root):
        for name, array in part.arrays.items():
            if ckpt.adler32_hex(array.reshape(-1).view(np.uint8)) != checksums.get(name):
                raise InvalidPublish(f"tensor {name!r} in {root_uri} fails its adler32 check")
            weights.add(name, part.dtypes[name], array, root_uri)
    for uri, index in deltas:
        for _, part, checksums in _shards(client, uri, index):
            for name, frame in part.arrays.items():
                if name not in weights.arrays:
                    raise InvalidPublish(f"{uri} changes tensor {name!r}, which its base does not have")
                try:
                    weights.arrays[name] = ckpt.apply_delta(weights.arrays[name], frame, checksums.get(name, ""))
                except ValueError as exc:
                    raise InvalidPublish(f"{uri}: tensor {name!r}: {exc}") from exc
    return weights
