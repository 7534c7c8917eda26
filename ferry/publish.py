"""`ferry publish`: write a full checkpoint or an XOR delta to S3 in the canonical format, then apply its
WeightVersion (reference/modelexpress.md §4, §5.3; docs/checkpoint-format.md; docs/publish.md).

- The objects are built by `ferry.checkpoint_format`, so the operator and the agents read exactly what the
  trainer wrote.
- Writes are immutable: every object is PUT with `If-None-Match: *` (SeaweedFS honours it on PutObject and on
  CompleteMultipartUpload and answers 412). An existing object is compared: identical content is an idempotent
  retry, different content is an `ImmutableConflict` and nothing is overwritten.
- Shards go first and the index last, so a reader never finds an index whose shards are missing. If the index
  already exists with other content, the publish stops before writing anything.
- A delta's base comes from `base_dir` or is rebuilt from S3 by replaying the base's chain (full + deltas).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from pydantic import ValidationError

from ferry import checkpoint_format as ckpt
from ferry.api.conditions import get_condition
from ferry.api.models import (
    API_VERSION,
    DNS_SUBDOMAIN,
    GROUP,
    MAX_CHAIN_LENGTH,
    VERSION,
    ConditionStatus,
    WeightFormat,
    WeightVersion,
    WeightVersionConditionType,
    WeightVersionPhase,
)
from ferry.kube import kube_client

MiB, GiB = 1 << 20, 1 << 30
DEFAULT_SHARD_BYTES = 4 * GiB  # as ModelExpress's full-checkpoint batches
DEFAULT_MULTIPART_THRESHOLD = 64 * MiB
MIN_PART_BYTES = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000
COMPARE_CHUNK = 8 * MiB
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}
_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}

# safetensors dtype → numpy dtype. Dtypes numpy lacks travel as same-width unsigned "carriers"; their real name is
# written back into the shard header after the builders ran (the builders only know numpy arrays).
NUMPY_DTYPES: dict[str, type[np.generic]] = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "F16": np.float16,
    "U32": np.uint32, "I32": np.int32, "F32": np.float32, "U64": np.uint64, "I64": np.int64, "F64": np.float64,
    "C64": np.complex64,
}  # fmt: skip
CARRIERS: dict[str, type[np.generic]] = {
    "BF16": np.uint16,
    "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8,
    "F8_E8M0": np.uint8,
}
TORCH_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16", "float16": "F16",
    "bfloat16": "BF16", "uint32": "U32", "int32": "I32", "float32": "F32", "uint64": "U64", "int64": "I64",
    "float64": "F64", "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}  # fmt: skip


class PublishError(RuntimeError):
    """A publish that must not go ahead; the message says what to fix. The CLI exits 1."""


class ImmutableConflict(PublishError):
    """The object (or WeightVersion) already exists with different content; nothing was overwritten."""


# ---------------------------------------------------------------- weights


@dataclass
class Weights:
    """Tensors as numpy arrays (carriers for dtypes numpy lacks) plus each tensor's safetensors dtype."""

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {name: (self.dtypes[name], tuple(a.shape)) for name, a in self.arrays.items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def add(self, name: str, dtype: str, array: np.ndarray, where: str) -> None:
        if name in self.arrays:
            raise PublishError(f"tensor {name!r} appears twice (again in {where})")
        self.arrays[name] = array
        self.dtypes[name] = dtype


def _numpy_dtype(dtype: str, where: str) -> type[np.generic]:
    found = NUMPY_DTYPES.get(dtype) or CARRIERS.get(dtype)
    if found is None:
        raise PublishError(f"{where}: dtype {dtype} is not supported (supported: {sorted({*NUMPY_DTYPES, *CARRIERS})})")
    return found


def _read_safetensors(data: np.ndarray | bytes, where: str, into: Weights) -> dict[str, str]:
    """Add a safetensors file's tensors (zero-copy views of `data`); returns its `__metadata__` checksums."""
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    try:
        prefix = bytes(buf[: ckpt.HEADER_PREFIX_BYTES])
        length = ckpt.header_length(prefix)
        _, header = ckpt.parse_safetensors_header(bytes(buf[: ckpt.HEADER_PREFIX_BYTES + length]))
        infos = ckpt.tensor_infos(header)
        checksums = ckpt.shard_checksums(header)
    except ckpt.InvalidShard as exc:
        raise PublishError(f"{where} is not a valid safetensors file: {exc}") from exc
    start = ckpt.HEADER_PREFIX_BYTES + length
    if start + ckpt.data_length(infos) > len(buf):
        raise PublishError(f"{where} is truncated: its header describes more data than the file holds")
    for name, info in infos.items():
        raw = buf[start + info.begin : start + info.end]
        into.add(name, info.dtype, raw.view(_numpy_dtype(info.dtype, f"{where}: {name}")).reshape(info.shape), where)
    return checksums


def _read_torch(path: Path, into: Weights) -> None:
    import torch  # heavy: only for .pt inputs

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise PublishError(f"{path} is not a loadable torch state dict: {exc}") from exc
    if not isinstance(state, Mapping):
        raise PublishError(f"{path} holds a {type(state).__name__}, not a state dict (name → tensor)")
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise PublishError(f"{path}: entry {name!r} is not a tensor")
        dtype = TORCH_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise PublishError(f"{path}: tensor {name!r} has unsupported dtype {tensor.dtype}")
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        into.add(name, dtype, raw.view(_numpy_dtype(dtype, name)).reshape(tuple(tensor.shape)), str(path))


def load_weights(path: Path) -> Weights:
    """Tensors from a directory of *.safetensors, one .safetensors file, or a torch state dict (.pt/.pth/.bin)."""
    weights = Weights({}, {})
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise PublishError(f"{path} has no *.safetensors files")
    elif path.is_file():
        files = [path]
    else:
        raise PublishError(f"{path} does not exist")
    for file in files:
        if file.suffix in {".pt", ".pth", ".bin"}:
            _read_torch(file, weights)
        elif file.suffix == ".safetensors":
            if file.stat().st_size == 0:
                raise PublishError(f"{file} is empty")
            _read_safetensors(np.memmap(file, dtype=np.uint8, mode="r"), str(file), weights)
        else:
            raise PublishError(f"{file}: expected a .safetensors file or a torch state dict (.pt, .pth, .bin)")
    if not weights.arrays:
        raise PublishError(f"{path} holds no tensors")
    return weights


def check_same_layout(base: Weights, new: Weights, base_version: str) -> None:
    """A delta keeps every tensor name, dtype and shape (docs/checkpoint-format.md); else publish a full one."""
    old, cur = base.layout(), new.layout()
    problems = [f"missing {n}" for n in sorted(old.keys() - cur.keys())]
    problems += [f"new {n}" for n in sorted(cur.keys() - old.keys())]
    problems += [
        f"{n}: {old[n][0]}{list(old[n][1])} → {cur[n][0]}{list(cur[n][1])}"
        for n in sorted(old.keys() & cur.keys())
        if old[n] != cur[n]
    ]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise PublishError(
            f"the tensors do not match base {base_version!r} ({shown}); a delta cannot change the layout, "
            "publish a FullCheckpoint instead"
        )


def build_files(
    weights: Weights, *, version: str, shard_bytes: int, base: tuple[str, Weights] | None = None
) -> dict[str, bytes]:
    """{file name: bytes}: a full checkpoint, or the XOR delta from `base` = (base version, its weights)."""
    if base is None:
        files = ckpt.build_full_checkpoint(weights.arrays, shard_bytes)
        dtypes: Mapping[str, str] | None = weights.dtypes
    else:
        base_version, base_weights = base
        check_same_layout(base_weights, weights, base_version)
        files = ckpt.build_xor_delta(base_weights.arrays, weights.arrays, version=version, base_version=base_version)
        dtypes = None  # delta shards hold uint8 frames; the layout check above compared the real dtypes
    return {n: d if n == ckpt.INDEX_NAME else ckpt.canonical_shard(d, dtypes) for n, d in files.items()}


# ---------------------------------------------------------------- S3


def parse_size(text: str) -> int:
    """`64MiB`, `4GiB`, `5MB`, `1000` → bytes."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a size such as 64MiB, 4GiB or 1000000")
    unit = (match.group(2) or "b").lower().rstrip("b")
    if not unit:
        return int(match.group(1))
    power = "kmgt".index(unit[0]) + 1
    return int(match.group(1)) * ((1024 if unit.endswith("i") else 1000) ** power)


def split_uri_prefix(prefix: str) -> tuple[str, str]:
    """`s3://bucket[/some/prefix]` → (bucket, "some/prefix/" or "")."""
    if not prefix.startswith("s3://"):
        raise PublishError(f"--uri-prefix {prefix!r} is not an s3://bucket/prefix URI")
    bucket, _, key = prefix[len("s3://") :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise PublishError(f"--uri-prefix {prefix!r}: {bucket!r} is not a valid bucket name")
    key = key.strip("/")
    if any(c.isspace() for c in key) or any(part in {".", ".."} for part in key.split("/")) or "//" in key:
        raise PublishError(f"--uri-prefix {prefix!r} has an invalid key prefix")
    return bucket, f"{key}/" if key else ""


def index_uri(uri_prefix: str, version: str) -> str:
    bucket, key = split_uri_prefix(uri_prefix)
    return f"s3://{bucket}/{key}{version}/{ckpt.INDEX_NAME}"


def _split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def s3_client(endpoint: str | None, region: str | None) -> Any:
    """Credentials come from the usual AWS chain (AWS_ACCESS_KEY_ID, profiles, IRSA...)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint or None,
        region_name=region or None,
        config=Config(
            s3={"addressing_style": "path"} if endpoint else {},  # SeaweedFS/MinIO on an IP need path style
            retries={"total_max_attempts": 5, "mode": "standard"},
            max_pool_connections=32,
        ),
    )


def _error_code(exc: Exception) -> str:
    response = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode"))


class Progress:
    """One stderr line, redrawn in place: bytes done of total and the rate. Thread-safe."""

    def __init__(self, label: str, total: int, stream: TextIO | None) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.done = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._drawn >= 0.1 or self.done >= self.total:
                self._drawn = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        if self.stream is None:
            return
        rate = self.done / max(now - self.started, 1e-6) / 1e6
        pct = 100 * self.done // self.total if self.total else 100
        line = f"{self.label}: {self.done / 1e6:.2f}/{self.total / 1e6:.2f} MB ({pct}%) {rate:.1f} MB/s"
        self.stream.write(f"\r{line:<78}")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class ImmutableWriter:
    """Writes objects under one prefix, never overwriting: a conflicting existing object is an error."""

    client: Any
    bucket: str
    prefix: str
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD
    workers: int = 8
    progress: Progress | None = None

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}"

    def part_size(self, size: int) -> int:
        return max(MIN_PART_BYTES, self.multipart_threshold, math.ceil(size / MAX_PARTS))

    def put(self, name: str, data: bytes) -> bool:
        """True if written, False if an identical object was already there (an idempotent retry)."""
        key = self.prefix + name
        # HEAD first: a retry of a big shard then costs a HEAD (plus an ETag check), not a re-upload.
        if self.matches(name, data):
            self._advance(len(data))
            return False
        try:
            if len(data) >= self.multipart_threshold:
                self._multipart(key, data)
            else:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
                self._advance(len(data))
        except Exception as exc:
            if _error_code(exc) not in _CONFLICT_CODES:
                raise
            # Someone wrote it between our HEAD and PUT (a multipart upload already counted its parts).
            if len(data) < self.multipart_threshold:
                self._advance(len(data))
            if not self.matches(name, data):
                raise self._conflict(name, data) from exc
            return False
        return True

    def matches(self, name: str, data: bytes) -> bool:
        """False if absent, True if present with exactly `data`, ImmutableConflict otherwise."""
        key = self.prefix + name
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            if _error_code(exc) in _MISSING_CODES:
                return False
            raise
        if head["ContentLength"] != len(data):
            raise self._conflict(name, data, stored=head["ContentLength"])
        if head.get("ETag", "").strip('"') == self._etag(data):
            return True
        body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        view, offset = memoryview(data), 0
        for chunk in body.iter_chunks(COMPARE_CHUNK):
            if view[offset : offset + len(chunk)] != chunk:
                raise self._conflict(name, data)
            offset += len(chunk)
        if offset != len(data):
            raise self._conflict(name, data, stored=offset)
        return True

    def _etag(self, data: bytes) -> str:
        """The S3 ETag our own upload would have had: MD5, or MD5 of the part MD5s plus `-N` for multipart."""
        if len(data) < self.multipart_threshold:
            return hashlib.md5(data, usedforsecurity=False).hexdigest()
        size = self.part_size(len(data))
        digests = [hashlib.md5(data[i : i + size], usedforsecurity=False).digest() for i in range(0, len(data), size)]
        return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"

    def _multipart(self, key: str, data: bytes) -> None:
        size = self.part_size(len(data))
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]

        def part(number: int) -> dict[str, Any]:
            body = data[(number - 1) * size : number * size]
            etag = self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )["ETag"]
            self._advance(len(body))
            return {"PartNumber": number, "ETag": etag}

        try:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                parts = list(pool.map(part, range(1, math.ceil(len(data) / size) + 1)))
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*"
            )
        except BaseException:
            # An abandoned upload keeps its parts (and costs storage) until aborted.
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def _advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.add(n)

    def _conflict(self, name: str, data: bytes, stored: int | None = None) -> ImmutableConflict:
        sizes = f" ({stored} bytes stored, {len(data)} to write)" if stored is not None else ""
        return ImmutableConflict(
            f"{self.uri(name)} already exists with different content{sizes}; published objects are immutable, "
            "so nothing was overwritten: publish under a new version name"
        )


def upload_files(writer: ImmutableWriter, files: Mapping[str, bytes]) -> tuple[list[str], list[str]]:
    """Shards first, the index last. Returns (written, already identical). An index already stored with other
    content stops everything before a single object is written."""
    index = files[ckpt.INDEX_NAME]
    writer.matches(ckpt.INDEX_NAME, index)
    written: list[str] = []
    identical: list[str] = []
    for name in [*sorted(n for n in files if n != ckpt.INDEX_NAME), ckpt.INDEX_NAME]:
        (written if writer.put(name, files[name]) else identical).append(name)
    return written, identical


# ---------------------------------------------------------------- base from S3


def _get(client: Any, uri: str) -> bytes:
    bucket, key = _split_uri(uri)
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        if _error_code(exc) in _MISSING_CODES | {"NoSuchBucket"}:
            raise PublishError(f"{uri} does not exist") from exc
        raise


def _sibling(index: str, shard: str) -> str:
    return index.rsplit("/", 1)[0] + "/" + shard


def _index(client: Any, uri: str) -> ckpt.CheckpointIndex:
    try:
        return ckpt.parse_index(_get(client, uri))
    except ckpt.InvalidIndex as exc:
        raise PublishError(f"{uri} is not a canonical index: {exc}") from exc


def _shards(client: Any, uri: str, index: ckpt.CheckpointIndex) -> Iterator[tuple[str, Weights, dict[str, str]]]:
    """(shard name, its tensors, its checksums) for every shard, checked against the index."""
    for shard in index.shards:
        part = Weights({}, {})
        checksums = _read_safetensors(_get(client, _sibling(uri, shard)), _sibling(uri, shard), part)
        if set(part.arrays) != index.tensors_in(shard):
            raise PublishError(f"{_sibling(uri, shard)} does not hold the tensors its index maps to it")
        yield shard, part, checksums


def replay_base(client: Any, version: str, locate: Callable[[str], str]) -> Weights:
    """The full weights of `version`: its chain's full checkpoint with every delta applied, adler32 checked."""
    links: list[tuple[str, str, ckpt.CheckpointIndex]] = []
    current = version
    while True:
        if len(links) >= MAX_CHAIN_LENGTH or current in {v for v, _, _ in links}:
            raise PublishError(f"the chain of {version!r} is longer than {MAX_CHAIN_LENGTH} or has a cycle")
        uri = locate(current)
        index = _index(client, uri)
        links.append((current, uri, index))
        if not index.is_delta:
            break
        if index.metadata["version"] != current:
            raise PublishError(f"{uri} is the delta of {index.metadata['version']!r}, not of {current!r}")
        current = index.metadata["base_version"]
    _, root_uri, root = links[-1]
    weights = Weights({}, {})
    for _, part, checksums in _shards(client, root_uri, root):
        for name, array in part.arrays.items():
            if ckpt.adler32_hex(array.reshape(-1).view(np.uint8)) != checksums.get(name):
                raise PublishError(f"tensor {name!r} in {root_uri} fails its adler32 check")
            weights.add(name, part.dtypes[name], array, root_uri)
    for _, uri, index in reversed(links[:-1]):
        for _, part, checksums in _shards(client, uri, index):
            for name, frame in part.arrays.items():
                if name not in weights.arrays:
                    raise PublishError(f"{uri} changes tensor {name!r}, which its base does not have")
                try:
                    weights.arrays[name] = ckpt.apply_xor_delta(weights.arrays[name], frame, checksums.get(name, ""))
                except ValueError as exc:
                    raise PublishError(f"{uri}: tensor {name!r}: {exc}") from exc
    return weights


# ---------------------------------------------------------------- Kubernetes


@contextlib.contextmanager
def kube_errors(what: str) -> Iterator[None]:
    """Kubernetes client failures as PublishError naming the step."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        yield
    except ApiException as exc:
        detail = exc.reason
        with contextlib.suppress(Exception):
            detail = json.loads(exc.body)["message"]
        raise PublishError(f"{what}: the Kubernetes API answered {exc.status}: {detail}") from exc
    except (ConfigException, HTTPError, OSError) as exc:
        raise PublishError(f"{what}: {exc}") from exc


def _custom(api: Any) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(api)


def read_weight_version(api: Any, namespace: str, name: str) -> dict[str, Any] | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return _custom(api).get_namespaced_custom_object(GROUP, VERSION, namespace, "weightversions", name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def weight_version_body(
    *,
    name: str,
    model: str,
    base_version: str | None,
    uri: str,
    endpoint: str | None = None,
    region: str | None = None,
    credentials_secret: str | None = None,
    layout_signature: str | None = None,
) -> dict[str, Any]:
    """The WeightVersion manifest, validated by the pydantic API models before anything is uploaded."""
    storage = {"uri": uri, "endpoint": endpoint, "region": region, "credentialsSecret": credentials_secret}
    spec = {
        "modelName": model,
        "format": WeightFormat.XOR_DELTA if base_version else WeightFormat.FULL_CHECKPOINT,
        "baseVersion": base_version,
        "storage": {k: v for k, v in storage.items() if v},
        "layoutSignature": layout_signature,
    }
    try:
        model_obj = WeightVersion.model_validate({"spec": spec})
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise PublishError(f"invalid WeightVersion: {details}") from exc
    return {
        "apiVersion": API_VERSION,
        "kind": WeightVersion.kind,
        "metadata": {"name": name},
        "spec": model_obj.spec.model_dump(mode="json", exclude_none=True),
    }


def apply_weight_version(api: Any, namespace: str, body: dict[str, Any]) -> bool:
    """Create it; True if created, False if an identical one exists. A different spec is an ImmutableConflict."""
    from kubernetes.client.exceptions import ApiException

    name = body["metadata"]["name"]
    try:
        _custom(api).create_namespaced_custom_object(GROUP, VERSION, namespace, "weightversions", body)
        return True
    except ApiException as exc:
        if exc.status != 409:
            raise
    _check_existing(read_weight_version(api, namespace, name), body, namespace)
    return False


def _check_existing(existing: dict[str, Any] | None, body: dict[str, Any], namespace: str) -> None:
    if existing is not None and existing.get("spec") != body["spec"]:
        raise ImmutableConflict(
            f"WeightVersion {namespace}/{body['metadata']['name']} already exists with spec "
            f"{json.dumps(existing.get('spec'), sort_keys=True)}, not {json.dumps(body['spec'], sort_keys=True)}; "
            "WeightVersions are immutable: publish under a new version name"
        )


def wait_ready(api: Any, namespace: str, name: str, timeout: float, poll: float = 1.0) -> None:
    """Until the operator marks it Ready; a Failed phase (a permanent reason) ends the wait at once."""
    deadline = time.monotonic() + timeout
    last = "no status yet"
    while True:
        obj = read_weight_version(api, namespace, name) or {}
        status = obj.get("status") or {}
        ready = get_condition(status.get("conditions"), WeightVersionConditionType.READY)
        if status.get("phase") == WeightVersionPhase.READY or (ready and ready.get("status") == ConditionStatus.TRUE):
            return
        if ready:
            last = f"{status.get('phase')}: {ready.get('reason')}: {ready.get('message')}"
        if status.get("phase") == WeightVersionPhase.FAILED:
            raise PublishError(f"WeightVersion {namespace}/{name} failed ({last})")
        if time.monotonic() >= deadline:
            raise PublishError(f"WeightVersion {namespace}/{name} is not Ready after {timeout:.0f}s ({last})")
        time.sleep(poll)


# ---------------------------------------------------------------- the whole publish


@dataclass(frozen=True)
class PublishOptions:
    source: Path
    version: str
    uri_prefix: str
    model: str | None = None
    base: str | None = None
    base_dir: Path | None = None
    layout_signature: str | None = None
    endpoint: str | None = None
    region: str | None = None
    credentials_secret: str | None = None
    namespace: str = "default"
    kubeconfig: str | None = None
    apply: bool = True
    wait: bool = False
    wait_timeout: float = 300.0
    shard_bytes: int = DEFAULT_SHARD_BYTES
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD
    workers: int = 8


@dataclass
class PublishResult:
    uri: str
    format: str
    written: list[str] = field(default_factory=list)
    identical: list[str] = field(default_factory=list)
    stored_bytes: int = 0
    weight_version: str | None = None  # "created" | "unchanged" | None with --no-apply


def _validate(opts: PublishOptions) -> None:
    for what, name in (("--version", opts.version), ("--base", opts.base)):
        if name is not None and (len(name) > 253 or not re.fullmatch(DNS_SUBDOMAIN, name)):
            raise PublishError(f"{what} {name!r} is not a valid object name (lowercase DNS subdomain)")
    if opts.base == opts.version:
        raise PublishError(f"a version cannot be its own base ({opts.version!r})")
    if opts.base_dir is not None and opts.base is None:
        raise PublishError("--base-dir needs --base (the version those weights are)")
    if opts.apply and not opts.model:
        raise PublishError("--model is required to apply the WeightVersion (or pass --no-apply)")
    if opts.wait and not opts.apply:
        raise PublishError("--wait needs the WeightVersion to be applied (drop --no-apply)")
    if opts.shard_bytes <= 0 or opts.multipart_threshold <= 0 or opts.workers <= 0:
        raise PublishError("--shard-size, --multipart-threshold and --workers must be positive")


def _base_locator(opts: PublishOptions, api: Any | None) -> Callable[[str], str]:
    """Where a chain version's index lives: its WeightVersion's storage.uri, or with --no-apply the layout
    `<uri-prefix>/<version>/` this command writes."""
    if api is None:
        return lambda version: index_uri(opts.uri_prefix, version)

    def locate(version: str) -> str:
        with kube_errors(f"reading WeightVersion {opts.namespace}/{version}"):
            wv = read_weight_version(api, opts.namespace, version)
        if wv is None:
            raise PublishError(f"base WeightVersion {opts.namespace}/{version} not found; pass --base-dir")
        spec = wv.get("spec") or {}
        if version == opts.base and spec.get("modelName") != opts.model:
            raise PublishError(f"base {version!r} is a version of model {spec.get('modelName')!r}, not {opts.model!r}")
        uri = (spec.get("storage") or {}).get("uri")
        if not uri:
            raise PublishError(f"base WeightVersion {version!r} has no storage ({spec.get('format')}); pass --base-dir")
        return uri

    return locate


def publish(opts: PublishOptions, *, progress: TextIO | None = None) -> PublishResult:
    """Validate, build, upload (index last), then apply and optionally wait. Raises PublishError. `progress`:
    where the upload progress line goes (the CLI passes stderr)."""
    from botocore.exceptions import BotoCoreError, ClientError

    _validate(opts)
    uri = index_uri(opts.uri_prefix, opts.version)
    bucket, key_prefix = _split_uri(uri.rsplit("/", 1)[0] + "/")
    body = None
    api = None
    if opts.apply:
        body = weight_version_body(
            name=opts.version, model=opts.model or "", base_version=opts.base, uri=uri, endpoint=opts.endpoint,
            region=opts.region, credentials_secret=opts.credentials_secret, layout_signature=opts.layout_signature,
        )  # fmt: skip
        with kube_errors("checking the WeightVersion before the upload"):
            api = kube_client(opts.kubeconfig)
            existing = read_weight_version(api, opts.namespace, opts.version)
        # Fail before uploading anything if the version name is already taken by a different spec.
        _check_existing(existing, body, opts.namespace)
    client = s3_client(opts.endpoint, opts.region)
    try:
        weights = load_weights(opts.source)
        base = None
        if opts.base is not None:
            locate = _base_locator(opts, api)
            base_weights = load_weights(opts.base_dir) if opts.base_dir else replay_base(client, opts.base, locate)
            base = (opts.base, base_weights)
        files = build_files(weights, version=opts.version, shard_bytes=opts.shard_bytes, base=base)
        total = sum(len(d) for d in files.values())
        bar = Progress(f"uploading {opts.version}", total, progress)
        writer = ImmutableWriter(client, bucket, key_prefix, opts.multipart_threshold, opts.workers, bar)
        try:
            written, identical = upload_files(writer, files)
        finally:
            bar.close()
    except (BotoCoreError, ClientError) as exc:
        raise PublishError(f"S3 request failed: {exc}") from exc
    result = PublishResult(
        uri=uri,
        format=WeightFormat.XOR_DELTA if opts.base else WeightFormat.FULL_CHECKPOINT,
        written=written,
        identical=identical,
        stored_bytes=total,
    )
    if api is not None and body is not None:
        with kube_errors(f"applying WeightVersion {opts.namespace}/{opts.version}"):
            result.weight_version = "created" if apply_weight_version(api, opts.namespace, body) else "unchanged"
            if opts.wait:
                wait_ready(api, opts.namespace, opts.version, opts.wait_timeout)
    return result
