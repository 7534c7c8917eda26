"""Verification of a WeightVersion's checkpoint in S3, without downloading tensor data.

The operator reads the index and, per shard, a HEAD plus a ranged GET of the safetensors header. That proves
every object exists, the index is canonical and the sizes add up, so a truncated upload or a mislabelled delta
fails at publish time instead of on every node that loads it. Per-tensor checksums are the agent's job (it has
the bytes).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from ferry import checkpoint_format as ckpt
from ferry.api.models import StorageReason, WeightFormat

ACCESS_KEY = "AWS_ACCESS_KEY_ID"
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
SESSION_TOKEN = "AWS_SESSION_TOKEN"
MAX_INDEX_BYTES = 64 * 1024 * 1024  # real indexes are a few MiB at most; refuse to buffer anything bigger
HEADER_PROBE_BYTES = 64 * 1024  # one ranged GET reads most headers whole
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_MISSING_CODES = {"404", "NoSuchKey", "NoSuchBucket", "NotFound"}
_DENIED_CODES = {
    "403",
    "AccessDenied",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AllAccessDisabled",
}


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


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/key` → (bucket, key); ValueError on anything else."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise ValueError(f"{uri!r} is not an s3:// URI")
    bucket, sep, key = uri[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"{uri!r} has an invalid bucket name {bucket!r}")
    if not sep or not key or key.endswith("/") or any(c.isspace() for c in key):
        raise ValueError(f"{uri!r} has no object key (expected s3://bucket/path/{ckpt.INDEX_NAME})")
    return bucket, key


def s3_client(
    endpoint: str | None,
    region: str | None,
    credentials: Mapping[str, str] | None,
    *,
    connect_timeout: float = 3.0,
    read_timeout: float = 10.0,
    max_attempts: int = 3,
    max_pool_connections: int = 10,
) -> Any:
    """A boto3 S3 client for verification: path-style (SeaweedFS, MinIO), short timeouts and few retries, so
    an unreachable endpoint costs a reconcile seconds, not minutes. Without `credentials`: the environment."""
    creds = credentials or {}
    # A private session: boto3's default session is not safe to share between handler threads.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint or None,
        region_name=region or None,
        aws_access_key_id=creds.get(ACCESS_KEY),
        aws_secret_access_key=creds.get(SECRET_KEY),
        aws_session_token=creds.get(SESSION_TOKEN),
        config=Config(
            s3={"addressing_style": "path"},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": max_attempts, "mode": "standard"},  # counts the first try
            max_pool_connections=max_pool_connections,
        ),
    )


def credentials_from_secret_data(data: Mapping[str, str] | None) -> dict[str, str]:
    """A Kubernetes Secret's base64 `.data` → credentials for `s3_client`; ValueError names a bad key."""
    data = data or {}
    creds: dict[str, str] = {}
    for key in (ACCESS_KEY, SECRET_KEY, SESSION_TOKEN):
        if key not in data:
            if key == SESSION_TOKEN:
                continue
            raise ValueError(f"Secret data has no key {key}")
        try:
            value = base64.b64decode(data[key], validate=True).decode().strip()
        except (binascii.Error, UnicodeDecodeError, TypeError) as exc:
            raise ValueError(f"Secret key {key} is not valid base64 text") from exc
        if not value and key != SESSION_TOKEN:
            raise ValueError(f"Secret key {key} is empty")
        if value:
            creds[key] = value
    return creds


def _client_error(exc: ClientError, what: str) -> _Stop:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    detail = f"{code or status}: {(error.get('Message') or 'no message').rstrip('.')}"
    if code in _MISSING_CODES or status == 404:
        return _stop(StorageReason.ObjectMissing, f"{what} does not exist ({detail}).")
    if code in _DENIED_CODES or status == 403:
        return _stop(
            StorageReason.AccessDenied,
            f"access to {what} was denied ({detail}); check the credentials Secret.",
        )
    # 5xx, throttling and anything unexpected: the object may be fine, so report it as transient and retry.
    return _stop(StorageReason.EndpointUnreachable, f"reading {what} failed ({detail}).", transient=True)


def _call(what: str, fn: Any, **kwargs: Any) -> Any:
    """One S3 request; any failure becomes a classified report."""
    try:
        return fn(**kwargs)
    except ClientError as exc:
        raise _client_error(exc, what) from exc
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise _stop(StorageReason.CredentialsMissing, f"no usable S3 credentials to read {what}: {exc}.") from exc
    except (BotoConnectionError, HTTPClientError) as exc:
        raise _stop(
            StorageReason.EndpointUnreachable,
            f"S3 endpoint unreachable while reading {what}: {exc}.",
            transient=True,
        ) from exc
    except BotoCoreError as exc:
        raise _stop(StorageReason.EndpointUnreachable, f"reading {what} failed: {exc}.", transient=True) from exc


def _read(
    client: Any, bucket: str, key: str, what: str, byte_range: str | None = None, max_bytes: int | None = None
) -> bytes:
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if byte_range:
        kwargs["Range"] = byte_range
    response = _call(what, client.get_object, **kwargs)
    if max_bytes is not None and response["ContentLength"] > max_bytes:
        response["Body"].close()
        raise _stop(
            StorageReason.IndexInvalid,
            f"{what} is {response['ContentLength']} bytes, too big to be an index.",
        )
    # The body streams; a connection dropped mid-read is as transient as a failed request.
    return _call(what, response["Body"].read)


def _get_prefix(client: Any, bucket: str, key: str, nbytes: int) -> dict[str, Any] | None:
    try:
        return client.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{nbytes - 1}")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "InvalidRange":
            return None  # an empty object has no byte 0
        raise


def _read_prefix(client: Any, bucket: str, key: str, what: str, nbytes: int) -> tuple[bytes, int]:
    """The first `nbytes` of an object and its size, in one ranged GET: the size is in its Content-Range
    (`bytes 0-N/size`), so no HEAD is needed, a request fewer per shard."""
    response = _call(what, _get_prefix, client=client, bucket=bucket, key=key, nbytes=nbytes)
    if response is None:
        return b"", 0
    content_range = response.get("ContentRange") or ""
    # Without a Content-Range the server sent the whole object (it ignored the Range).
    size = int(content_range.rpartition("/")[2]) if "/" in content_range else response["ContentLength"]
    return _call(what, response["Body"].read), size


def verify_checkpoint(client: Any, uri: str, *, fmt: str, version: str, base_version: str | None) -> StorageReport:
    """Check the checkpoint at `uri` (its index) is complete and canonical for WeightVersion `version`."""
    if fmt == WeightFormat.PEER_ONLY:
        return StorageReport(
            ok=True,
            reason=StorageReason.NotApplicable,
            message="PeerOnly versions are served from memory only.",
        )
    if fmt not in (WeightFormat.FULL_CHECKPOINT, WeightFormat.XOR_DELTA):
        raise ValueError(f"unknown WeightVersion format {fmt!r}")
    try:
        return _verify(client, uri, delta=fmt == WeightFormat.XOR_DELTA, version=version, base_version=base_version)
    except _Stop as stop:
        return stop.report


def _verify(client: Any, uri: str, *, delta: bool, version: str, base_version: str | None) -> StorageReport:
    try:
        bucket, key = parse_s3_uri(uri)
    except ValueError as exc:
        raise _stop(StorageReason.IndexInvalid, f"the spec.storage.uri is invalid: {exc}.") from exc
    index_uri = f"s3://{bucket}/{key}"
    prefix = key.rpartition("/")[0] + "/" if "/" in key else ""

    raw = _read(client, bucket, key, f"index {index_uri}", max_bytes=MAX_INDEX_BYTES)
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

    # Deltas always carry checksums; a full checkpoint does when its index says so (ours always do).
    checksummed = index.metadata.get("checksum_format") == ckpt.CHECKSUM_FORMAT
    total_bytes = 0
    tensor_bytes = 0
    for shard in index.shards:
        shard_uri = f"s3://{bucket}/{prefix}{shard}"
        size, infos = _check_shard(client, bucket, prefix + shard, shard_uri, index.tensors_in(shard), checksummed)
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


def _check_shard(
    client: Any, bucket: str, key: str, shard_uri: str, expected: set[str], checksummed: bool
) -> tuple[int, dict[str, ckpt.TensorInfo]]:
    """One header GET of a shard → (object size, its tensors), checked against the index."""
    what = f"shard {shard_uri}"
    first, size = _read_prefix(client, bucket, key, what, HEADER_PROBE_BYTES)
    if size < ckpt.HEADER_PREFIX_BYTES:
        raise _stop(StorageReason.SizeMismatch, f"shard {shard_uri} is only {size} bytes; it is truncated.")
    try:
        header_len = ckpt.header_length(first)
        if ckpt.HEADER_PREFIX_BYTES + header_len > size:
            raise _stop(
                StorageReason.SizeMismatch,
                f"shard {shard_uri} is {size} bytes but its header alone needs "
                f"{ckpt.HEADER_PREFIX_BYTES + header_len}; it is truncated.",
            )
        if ckpt.HEADER_PREFIX_BYTES + header_len > len(first):
            first += _read(client, bucket, key, what, f"bytes={len(first)}-{ckpt.HEADER_PREFIX_BYTES + header_len - 1}")
        _, header = ckpt.parse_safetensors_header(first)
        infos = ckpt.tensor_infos(header)
        checksums = ckpt.shard_checksums(header)
    except ckpt.InvalidShard as exc:
        raise _stop(StorageReason.IndexInvalid, f"shard {shard_uri} has a malformed header: {exc}.") from exc

    described = ckpt.HEADER_PREFIX_BYTES + header_len + ckpt.data_length(infos)
    if size != described:
        state = "truncated" if size < described else "longer than its header describes"
        raise _stop(
            StorageReason.SizeMismatch,
            f"shard {shard_uri} is {size} bytes but its header describes {described}; it is {state}.",
        )
    missing, extra = sorted(expected - infos.keys()), sorted(infos.keys() - expected)
    if missing:
        raise _stop(
            StorageReason.IndexInvalid,
            f"shard {shard_uri} lacks tensors the index maps to it: {_names(missing)}.",
        )
    if extra:
        raise _stop(StorageReason.IndexInvalid, f"shard {shard_uri} holds tensors not in the index: {_names(extra)}.")
    unchecked = sorted(name for name in infos if name not in checksums) if checksummed else []
    if unchecked:
        raise _stop(
            StorageReason.IndexInvalid,
            f"shard {shard_uri} has no adler32 checksum for tensors {_names(unchecked)}.",
        )
    return size, infos


def _names(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


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
        bucket, key = parse_s3_uri(uri)
    except ValueError as exc:
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
