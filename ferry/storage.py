"""Verification of a WeightVersion's checkpoint in S3, without downloading tensor data.

The operator reads the index and, per shard, one ranged GET of the safetensors header (the shard's size comes
with it, in the Content-Range). That proves every object exists, the index is canonical and the sizes add up, so
a truncated upload or a mislabelled delta fails at publish time instead of on every node that loads it.
Per-tensor checksums are the agent's job (it has the bytes). The checks are written once (`_verification`), read
through a blocking boto3-like client (`verify_checkpoint`) or an asyncio one (`verify_checkpoint_async`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ferry import checkpoint_format as ckpt
from ferry import s3
from ferry.api.models import StorageReason, WeightFormat

MAX_INDEX_BYTES = 64 * 1024 * 1024  # real indexes are a few MiB at most; refuse to buffer anything bigger
HEADER_PROBE_BYTES = 64 * 1024  # one ranged GET reads most headers whole


@dataclass(frozen=True)
class StorageReport:
    ok: bool
    reason: StorageReason
    message: str
    transient: bool = False  # True: retry later, the checkpoint itself may be fine
    total_bytes: int | None = None  # sum of shard object sizes
    tensor_count: int | None = None  # entries in the index's weight_map
    shard_count: int | None = None
    index_digest: str | None = None  # sha256 (hex) of the index object that was verified


class _Stop(Exception):
    """Carries the report out of the middle of a verification."""

    def __init__(self, report: StorageReport) -> None:
        super().__init__(report.message)
        self.report = report


def _stop(reason: StorageReason, message: str, *, transient: bool = False) -> _Stop:
    sentence = message[:1].upper() + message[1:]  # messages are read in `kubectl describe`
    return _Stop(StorageReport(ok=False, reason=reason, message=sentence, transient=transient))


# The condition reason of each class of S3 failure (`ferry.s3.translate`); any other is transient.
_REASONS: dict[type[Exception], StorageReason] = {
    s3.ObjectMissing: StorageReason.ObjectMissing,
    s3.AccessDenied: StorageReason.AccessDenied,
    s3.CredentialsMissing: StorageReason.CredentialsMissing,
}


def _classify(exc: BaseException, what: str) -> _Stop:
    error = s3.translate(exc, what)
    reason = _REASONS.get(type(error), StorageReason.EndpointUnreachable)
    return _stop(reason, f"{error}.", transient=reason == StorageReason.EndpointUnreachable)


def _call(what: str, fn: Any, **kwargs: Any) -> Any:
    """One S3 request; any failure becomes a classified report."""
    try:
        return fn(**kwargs)
    except (ClientError, BotoCoreError) as exc:
        raise _classify(exc, what) from exc


def _too_big(what: str, size: str) -> _Stop:
    return _stop(StorageReason.IndexInvalid, f"{what} is {size}, too big to be an index.")


def _limit(response: dict[str, Any], what: str, max_bytes: int | None) -> int | None:
    """How much of a body to read: all of it (None) when it declares its length, refused unread when that is over
    `max_bytes`; one byte past `max_bytes` when it declares none, to know."""
    if max_bytes is None:
        return None
    if length := response.get("ContentLength"):
        if length > max_bytes:
            response["Body"].close()
            raise _too_big(what, f"{length} bytes")
        return None
    return max_bytes + 1


def _within(data: bytes, what: str, max_bytes: int | None) -> bytes:
    if max_bytes is not None and len(data) > max_bytes:
        raise _too_big(what, f"over {max_bytes} bytes (its server gave no length)")
    return data


def _read(
    client: Any, bucket: str, key: str, what: str, byte_range: str | None = None, max_bytes: int | None = None
) -> bytes:
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if byte_range:
        kwargs["Range"] = byte_range
    response = _call(what, client.get_object, **kwargs)
    limit = _limit(response, what, max_bytes)
    # The body streams; a connection dropped mid-read is as transient as a failed request.
    if limit is None:
        return _call(what, response["Body"].read)
    with closing(response["Body"]):
        return _within(_call(what, response["Body"].read, amt=limit), what, max_bytes)


def get_prefix(client: Any, bucket: str, key: str, nbytes: int) -> dict[str, Any] | None:
    try:
        return client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{nbytes - 1}")
    except ClientError as exc:
        if s3.error_code(exc) == "InvalidRange":
            return None  # an empty object has no byte 0
        raise


def object_size(response: dict[str, Any]) -> int:
    """From a ranged GET: the size is in its Content-Range (`bytes 0-N/size`), so no HEAD is needed, a request
    fewer per shard. Without a Content-Range the server sent the whole object (it ignored the Range)."""
    content_range = response.get("ContentRange") or ""
    if "/" not in content_range:
        return response["ContentLength"]
    total = content_range.rpartition("/")[2]
    if not total.isdigit():  # `bytes 0-N/*`: the server does not say
        raise ValueError(f"Content-Range {content_range!r} does not give the object's size")
    return int(total)


def _whole_answer(response: dict[str, Any], nbytes: int) -> bool:
    """Whether a probe's answer is no longer than the `nbytes` asked for. Else the server ignored the Range (a whole
    shard may be gigabytes) or does not say how long its answer is: only its prefix is read, the rest closed unread."""
    return 0 < (response.get("ContentLength") or 0) <= nbytes


def _read_prefix(client: Any, bucket: str, key: str, what: str, nbytes: int) -> tuple[bytes, int]:
    """The first `nbytes` of an object and its size, in one ranged GET."""
    response = _call(what, get_prefix, client=client, bucket=bucket, key=key, nbytes=nbytes)
    if response is None:
        return b"", 0
    if _whole_answer(response, nbytes):
        return _call(what, response["Body"].read), object_size(response)
    with closing(response["Body"]):
        return _call(what, response["Body"].read, amt=nbytes), object_size(response)


# ---------------------------------------------------------------- the same reads on an asyncio client
# A client whose `get_object` is a coroutine answering as boto3 does, with a Body whose `read` is a coroutine too
# (`ferry.s3reader.S3Reader`): no thread per request.


async def _acall(what: str, fn: Any, **kwargs: Any) -> Any:
    try:
        return await fn(**kwargs)
    except (ClientError, BotoCoreError) as exc:
        raise _classify(exc, what) from exc


async def _aread(
    client: Any, bucket: str, key: str, what: str, byte_range: str | None = None, max_bytes: int | None = None
) -> bytes:
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if byte_range:
        kwargs["Range"] = byte_range
    response = await _acall(what, client.get_object, **kwargs)
    limit = _limit(response, what, max_bytes)
    if limit is None:
        return await _acall(what, response["Body"].read)
    with closing(response["Body"]):
        return _within(await _acall(what, response["Body"].read, amt=limit), what, max_bytes)


async def _aget_prefix(client: Any, bucket: str, key: str, nbytes: int) -> dict[str, Any] | None:
    try:
        return await client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{nbytes - 1}")
    except ClientError as exc:
        if s3.error_code(exc) == "InvalidRange":
            return None
        raise


async def _aread_prefix(client: Any, bucket: str, key: str, what: str, nbytes: int) -> tuple[bytes, int]:
    response = await _acall(what, _aget_prefix, client=client, bucket=bucket, key=key, nbytes=nbytes)
    if response is None:
        return b"", 0
    if _whole_answer(response, nbytes):
        return await _acall(what, response["Body"].read), object_size(response)
    with closing(response["Body"]):
        return await _acall(what, response["Body"].read, amt=nbytes), object_size(response)


# ---------------------------------------------------------------- the verification, apart from its reads


@dataclass(frozen=True)
class _Read:
    """One GET a verification needs: the whole object (at most `max_bytes`), a `byte_range` of it, or its first
    `probe` bytes with its size."""

    key: str
    what: str
    byte_range: str | None = None
    max_bytes: int | None = None
    probe: int | None = None


# A verification (`_verification`) yields the reads it needs next (a list: done at once) and is sent back their
# results in the same order (a failed read's result is its `_Stop`); it returns the report. The two drivers do the
# reads, blocking or on an event loop; all the checks are written once.

# `map`, or an executor's `map`: runs the shard checks, yielding their results in order.
ShardMap = Callable[[Callable[[str], Any], Iterable[str]], Iterator[Any]]


def _perform(client: Any, bucket: str, read: _Read) -> Any:
    try:
        if read.probe is not None:
            return _read_prefix(client, bucket, read.key, read.what, read.probe)
        return _read(client, bucket, read.key, read.what, read.byte_range, read.max_bytes)
    except _Stop as stop:
        return stop


async def _aperform(client: Any, bucket: str, read: _Read) -> Any:
    try:
        if read.probe is not None:
            return await _aread_prefix(client, bucket, read.key, read.what, read.probe)
        return await _aread(client, bucket, read.key, read.what, read.byte_range, read.max_bytes)
    except _Stop as stop:
        return stop


def verify_checkpoint(
    client: Any, uri: str, *, fmt: str, version: str, base_version: str | None, map_shards: ShardMap = map
) -> StorageReport:
    """Check the checkpoint at `uri` (its index) is complete and canonical for WeightVersion `version`.
    `map_shards` (e.g. a thread pool's `map`) reads the shard headers; in order either way, so the report names
    the first failing shard of the index."""
    steps = _verification(uri, fmt=fmt, version=version, base_version=base_version)
    try:
        bucket, reads = next(steps)
        while True:
            reads = steps.send(list(map_shards(lambda read: _perform(client, bucket, read), reads)))
    except StopIteration as done:
        return done.value
    except _Stop as stop:
        return stop.report


async def verify_checkpoint_async(
    client: Any, uri: str, *, fmt: str, version: str, base_version: str | None
) -> StorageReport:
    """`verify_checkpoint` through an asyncio client: the shard headers read at once on the event loop."""
    steps = _verification(uri, fmt=fmt, version=version, base_version=base_version)
    try:
        bucket, reads = next(steps)
        while True:
            reads = steps.send(list(await asyncio.gather(*(_aperform(client, bucket, read) for read in reads))))
    except StopIteration as done:
        return done.value
    except _Stop as stop:
        return stop.report


def _verification(
    uri: str, *, fmt: str, version: str, base_version: str | None
) -> Generator[Any, list[Any], StorageReport]:
    """The steps of a verification: first yields (bucket, the index read), then lists of reads (`_Steps`)."""
    if fmt == WeightFormat.PEER_ONLY:
        return StorageReport(
            ok=True,
            reason=StorageReason.NotApplicable,
            message="PeerOnly versions are served from memory only.",
        )
    if fmt not in (WeightFormat.FULL_CHECKPOINT, WeightFormat.XOR_DELTA):
        raise ValueError(f"unknown WeightVersion format {fmt!r}")
    delta = fmt == WeightFormat.XOR_DELTA
    try:
        bucket, key = s3.parse_s3_uri(uri)
    except s3.InvalidUri as exc:
        raise _stop(StorageReason.UriInvalid, f"the spec.storage.uri is invalid: {exc}.") from exc
    index_uri = f"s3://{bucket}/{key}"
    prefix = key.rpartition("/")[0] + "/" if "/" in key else ""

    (raw,) = _results((yield bucket, [_Read(key, f"index {index_uri}", max_bytes=MAX_INDEX_BYTES)]))
    try:
        index = ckpt.parse_index(raw)
        if delta:
            ckpt.check_delta_identity(index, version=version, base_version=base_version)
        elif index.is_delta:
            raise ckpt.InvalidIndex(
                f"it is an XorDelta index (of {index.metadata['version']} on "
                f"{index.metadata['base_version']}) but the WeightVersion is a FullCheckpoint"
            )
    except ckpt.InvalidIndex as exc:
        raise _stop(StorageReason.IndexInvalid, f"index {index_uri} is invalid: {exc}.") from exc

    total_bytes = 0
    tensor_bytes = 0
    # Every shard's header is read at once; a failure is reported when its turn comes, as a loop would: the first
    # in index order.
    probes = yield [
        _Read(prefix + shard, f"shard s3://{bucket}/{prefix}{shard}", probe=HEADER_PROBE_BYTES)
        for shard in index.shards
    ]
    for shard, probe in zip(index.shards, probes, strict=True):
        shard_uri = f"s3://{bucket}/{prefix}{shard}"
        first, size = _results([probe])[0]
        header_end = _header_end(first, size, shard_uri)
        if header_end > len(first):  # a header longer than the probe: the rest of it
            (rest,) = _results(
                (yield [_Read(prefix + shard, f"shard {shard_uri}", byte_range=f"bytes={len(first)}-{header_end - 1}")])
            )
            first += rest
        infos = _check_shard(first, size, shard_uri, index.tensors_in(shard), delta)
        total_bytes += size
        tensor_bytes += sum(info.nbytes for info in infos.values())

    declared = index.metadata.get("total_size")
    if declared is not None and declared != tensor_bytes:
        # Mandatory for full checkpoints (parse_index insists on it); checked on deltas when they carry it.
        raise _stop(
            StorageReason.SizeMismatch,
            f"index {index_uri} declares total_size {declared} but its shards hold {tensor_bytes} tensor bytes.",
        )
    shards = len(index.shards)
    kind = "XorDelta" if delta else "FullCheckpoint"
    return StorageReport(
        ok=True,
        reason=StorageReason.Verified,
        message=f"{kind} verified: {len(index.weight_map)} tensors in {shards} shards, {total_bytes} bytes.",
        total_bytes=total_bytes,
        tensor_count=len(index.weight_map),
        shard_count=shards,
        index_digest=hashlib.sha256(raw).hexdigest(),
    )


def _results(results: list[Any]) -> list[Any]:
    """The reads' results, or the first failure raised."""
    for result in results:
        if isinstance(result, _Stop):
            raise result
    return results


def _header_end(first: bytes, size: int, shard_uri: str) -> int:
    """Where a shard's safetensors header ends, from its first bytes and its size."""
    if size < ckpt.HEADER_PREFIX_BYTES:
        raise _stop(StorageReason.SizeMismatch, f"shard {shard_uri} is only {size} bytes; it is truncated.")
    try:
        header_len = ckpt.header_length(first)
    except ckpt.InvalidShard as exc:
        raise _stop(StorageReason.IndexInvalid, f"{exc.describe(shard_uri)}.") from exc
    if ckpt.HEADER_PREFIX_BYTES + header_len > size:
        raise _stop(
            StorageReason.SizeMismatch,
            f"shard {shard_uri} is {size} bytes but its header alone needs "
            f"{ckpt.HEADER_PREFIX_BYTES + header_len}; it is truncated.",
        )
    return ckpt.HEADER_PREFIX_BYTES + header_len


def _check_shard(
    header: bytes, size: int, shard_uri: str, expected: set[str], delta: bool
) -> dict[str, ckpt.TensorInfo]:
    """A shard's tensors, from its whole header and its size, checked by the agent's own rules (`ckpt.check_shard`):
    what is verified here, the agent loads."""
    try:
        return ckpt.check_shard(header, size, expected, delta=delta).infos
    except ckpt.InvalidShard as exc:
        reason = StorageReason.SizeMismatch if exc.rule == ckpt.Rule.SHARD_SIZE else StorageReason.IndexInvalid
        raise _stop(reason, f"{exc.describe(shard_uri)}.") from exc


@dataclass(frozen=True)
class DeletionReport:
    ok: bool
    message: str
    transient: bool = False  # True: worth another try (endpoint down, 5xx)
    deleted: tuple[str, ...] = ()  # s3:// URIs removed


def delete_checkpoint(client: Any, uri: str, *, index_digest: str | None) -> DeletionReport:
    """Delete exactly one version's objects: the shards its index names, then the index (last, so an interrupted
    deletion can be resumed from it). Only if the index is still the one that was verified (`index_digest`)."""
    try:
        bucket, key = s3.parse_s3_uri(uri)
    except s3.InvalidUri as exc:
        return DeletionReport(ok=False, message=f"Not deleted: {exc}.")
    prefix = key.rpartition("/")[0] + "/" if "/" in key else ""
    index_uri = f"s3://{bucket}/{key}"
    try:
        raw = _read(client, bucket, key, f"index {index_uri}", max_bytes=MAX_INDEX_BYTES)
    except _Stop as stop:
        if stop.report.reason == StorageReason.ObjectMissing:
            return DeletionReport(ok=True, message=f"Index {index_uri} is already gone; nothing to delete.")
        return DeletionReport(ok=False, message=stop.report.message, transient=stop.report.transient)
    if index_digest is None:
        return DeletionReport(ok=False, message=f"Not deleted: the operator never verified index {index_uri}.")
    if hashlib.sha256(raw).hexdigest() != index_digest:
        return DeletionReport(
            ok=False, message=f"Not deleted: index {index_uri} is not the one the operator verified for this version."
        )
    try:
        shards = ckpt.parse_index(raw).shards  # plain file names: nothing outside the index's folder
    except ckpt.InvalidIndex as exc:
        return DeletionReport(ok=False, message=f"Not deleted: index {index_uri} is invalid: {exc}.")
    deleted: list[str] = []
    for object_key in [prefix + shard for shard in shards] + [key]:
        object_uri = f"s3://{bucket}/{object_key}"
        try:
            _call(f"object {object_uri}", client.delete_object, Bucket=bucket, Key=object_key)
        except _Stop as stop:
            done = f" (deleted {len(deleted)} of {len(shards) + 1} objects)" if deleted else ""
            return DeletionReport(
                ok=False, message=stop.report.message + done, transient=stop.report.transient, deleted=tuple(deleted)
            )
        deleted.append(object_uri)
    return DeletionReport(
        ok=True, message=f"Deleted {len(deleted)} objects under s3://{bucket}/{prefix}.", deleted=tuple(deleted)
    )
