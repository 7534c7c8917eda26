"""The ObjectStorage load strategy: a WeightVersion's weights from S3, through the node's checkpoint store.

ModelExpress semantics, in four phases:

1. Resolve the replay chain with the operator's `resolve_chain` (at most 64 links, rooted at a FullCheckpoint).
   Every link must be Ready, of this model, and stored in S3.
2. Validate everything before changing anything: every index (canonical shape, delta identity, safe shard names)
   and every shard header (exact object size, the tensor set the index promises, checksums), delta tensors
   against the root's layout. Loading starts from the newest version of the chain the store already holds, so
   only what is missing is fetched (and validated) from S3.
3. Download what is missing with parallel ranged GETs into the store (tmp + fsync + rename), checking every full
   tensor's adler32 before the rename.
4. Build the target in one pass per tensor, in parallel: read the base bytes straight into a freshly allocated
   `ResidentWeights` pool (CPU: the agent's host store; through a host buffer for other devices), from the store,
   or from the base version's sealed host memory when a pod still holds that very version (then the tensors no
   delta changes are not copied at all: the new version shares the base's chunks), check their adler32, apply
   each delta in place (streamed zstd, numpy XOR) checking the exact decoded size and adler32 after each, and
   write the result to `materialized/<target>` (tmp + fsync + rename). Then activate the version in the store.

A stored artifact is used only for the exact versions it was written from (namespace, WeightVersion uid, storage
URI, index digest: `checkpoint_store.VersionIdentity`); an index fetched from S3 must have the sha256 the operator
recorded as `status.indexDigest` when it verified the version. Every S3 request is bounded by the transfer
timeout (`spec.transfer.timeoutSeconds`: all tries of one request together), and the S3 object a load waits on
is its progress `source`, so a hung endpoint fails the load in bounded time and a stall names what it waits on.

Every failure is `StrategyFailed(mutated=False)`: the new pool is never handed out, so nothing the replica served
changes, and the store goes back to its last activated version. An artifact found corrupt is discarded, so a
retry downloads it again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from botocore.exceptions import BotoCoreError, ClientError

from ferry import checkpoint_format as ckpt
from ferry.api.models import MAX_CHAIN_LENGTH, WeightFormat
from ferry.chain import VersionView, resolve_chain
from ferry.storage import (
    HEADER_PROBE_BYTES,
    MAX_INDEX_BYTES,
    parse_s3_uri,
    s3_client,
)
from ferry_agent.ranks.sharding import rank_specs
from ferry_agent.store.checkpoints import (
    ArtifactKind,
    ArtifactRef,
    CheckpointCacheCapacityError,
    CheckpointStore,
    VersionIdentity,
    head_ref,
    index_digest,
    model_key,
)
from ferry_agent.store.resident import ResidentWeights, TensorSpec, manifest_digest
from ferry_agent.strategies.chain import LoadContext, StrategyFailed
from ferry_agent.strategies.peer import ProgressThrottle
from ferry_agent.transport.worker_service import DEFAULT_TRANSFER_TIMEOUT_S

log = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_RANGE_BYTES = 16 * MIB
PROGRESS_INTERVAL_S = 1.0
CHECKSUMS_FILE = "checksums.json"  # materialized/<v>/: adler32 per tensor of version v
CHAIN_FILE = "chain.json"  # materialized/<v>/: the replay chain it was built from
SOURCE = "s3"
S3_ATTEMPTS = 3  # tries of one S3 request (botocore standard retries), all within the transfer timeout

Progress = Callable[[int, int, str], None]

# safetensors dtype → torch dtype; a checkpoint with any other dtype is refused before anything is fetched.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "U16": torch.uint16, "I16": torch.int16,
    "F16": torch.float16, "BF16": torch.bfloat16, "U32": torch.uint32, "I32": torch.int32, "F32": torch.float32,
    "U64": torch.uint64, "I64": torch.int64, "F64": torch.float64, "C64": torch.complex64,
}  # fmt: skip


@dataclass(frozen=True)
class S3LoadResult:
    resident: ResidentWeights
    bytes_moved: int  # bytes placed in memory (the version's tensor bytes)
    bytes_downloaded: int  # fetched from S3 by this load; 0 when the store already held everything
    chain: tuple[str, ...]  # root → target
    reused: str | None  # the stored artifact the load started from, e.g. "materialized/v2"
    seconds: float
    timings: Mapping[str, float]  # seconds per phase: validate, download (+ checks), build, commit (fsync + rename)
    source: str = SOURCE


class _LoadError(Exception):
    """A failure whose message becomes the StrategyFailed message; `discard` names a stored artifact found
    corrupt, which is removed so that a retry fetches it again."""

    def __init__(self, message: str, discard: ArtifactRef | None = None) -> None:
        super().__init__(message)
        self.discard = discard


@dataclass(frozen=True)
class _Link:
    """One version of the replay chain, as the API describes it."""

    name: str
    format: str
    base: str | None
    storage: Mapping[str, Any]
    bucket: str
    key: str  # of the index
    namespace: str
    uid: str
    index_digest: str | None  # status.indexDigest, recorded by the operator when it verified the version

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def expected(self) -> VersionIdentity:
        """What a stored copy of this version must have been written from."""
        return VersionIdentity(self.namespace, self.uid, self.uri, self.index_digest)

    def shard_key(self, shard: str) -> str:
        prefix = self.key.rpartition("/")[0]
        return f"{prefix}/{shard}" if prefix else shard

    def shard_uri(self, shard: str) -> str:
        return f"s3://{self.bucket}/{self.shard_key(shard)}"


@dataclass(frozen=True)
class _Shard:
    name: str
    layout: ckpt.ShardLayout
    header: bytes  # the validated first `data_start` bytes; a downloaded file must start with exactly these


@dataclass
class _Checkpoint:
    """One validated checkpoint: in the store (`path`) or still in S3 (`path` is None until downloaded)."""

    link: _Link
    ref: ArtifactRef
    index_raw: bytes
    index: ckpt.CheckpointIndex
    shards: dict[str, _Shard]
    checksums: dict[str, str]  # tensor → adler32 of the version's bytes (deltas: of the changed tensors)
    path: Path | None
    identity: tuple[VersionIdentity, ...]  # of the versions its bytes come from (a materialized one: its chain)
    client: Any = None

    def where(self, shard: str | None = None) -> str:
        """For messages: the S3 object, and the local copy when reading from the store."""
        uri = self.link.shard_uri(shard) if shard else self.link.uri
        if self.path is None:
            return uri
        return f"{self.path / shard if shard else self.path} (stored copy of {uri})"

    @property
    def stored_bytes(self) -> int:
        return len(self.index_raw) + sum(s.layout.size for s in self.shards.values())


@dataclass
class _Plan:
    model: str
    chain: tuple[str, ...]
    base: _Checkpoint  # the full root, or a materialized version of the chain: where replay starts
    deltas: list[_Checkpoint]  # applied after `base`, in chain order
    layout: dict[str, tuple[_Shard, ckpt.TensorInfo]]  # tensor → where it lives in base (and so in the target)
    specs: list[TensorSpec]
    reused: str | None
    head: ArtifactRef = field(init=False)

    def __post_init__(self) -> None:
        self.head = head_ref(self.model, self.chain)


class _Progress:
    """Thread-safe byte counter that forwards throttled (done, total, source) reports; `source` names the S3
    objects being read, so that a stall report says what the load waits on."""

    def __init__(self, callback: Progress | None, total: int, source: str) -> None:
        self._throttle = ProgressThrottle(callback, PROGRESS_INTERVAL_S)
        self._lock = threading.Lock()
        self.total = total
        self.done = 0
        self.source = source
        self._throttle(0, total, source)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            self._throttle(self.done, self.total, self.source)


class _Countdown:
    """Runs `action` in the thread that completes the last of `count` parts (e.g. the last range of a shard)."""

    def __init__(self, count: int, action: Callable[[], None]) -> None:
        self._left = count
        self._lock = threading.Lock()
        self._action = action

    def tick(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._action()


def request_timeouts(timeout_s: float) -> tuple[float, float]:
    """(connect, read) timeouts of one try of an S3 request, so that all `S3_ATTEMPTS` tries of one request
    fit in `timeout_s` (the transfer timeout): a hung endpoint fails a load in bounded time. The read timeout
    is the longest silence on the socket (capped at 60 s), not the duration of a whole ranged GET."""
    per_try = timeout_s / S3_ATTEMPTS
    connect = min(5.0, per_try / 2)
    return connect, min(60.0, per_try - connect)


def bulk_s3_client(
    endpoint: str | None,
    region: str | None,
    credentials: Mapping[str, str] | None,
    workers: int,
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
) -> Any:
    """The verifier's client with bulk settings: `workers` ranged GETs of up to 16 MiB run at once, each
    request bounded by `timeout_s` (see `request_timeouts`)."""
    connect, read = request_timeouts(timeout_s)
    return s3_client(
        endpoint, region, credentials, connect_timeout=connect, read_timeout=read, max_attempts=S3_ATTEMPTS,
        max_pool_connections=max(10, workers),
    )  # fmt: skip


def _s3_error(exc: Exception, uri: str) -> _LoadError:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        detail = f"{code or status}: {(error.get('Message') or 'no message').rstrip('.')}"
        if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "NotFound"):
            return _LoadError(f"{uri} does not exist ({detail})")
        if status == 403:
            return _LoadError(f"access to {uri} was denied ({detail}); check the credentials")
        return _LoadError(f"reading {uri} failed ({detail})")
    return _LoadError(f"reading {uri} failed: {exc}")


def _pwrite_all(fd: int, data: bytes | np.ndarray, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pread_into(fd: int, buffer: memoryview, offset: int) -> None:
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], offset + done)
        if got == 0:
            raise OSError(f"file ends {len(buffer) - done} bytes early")
        done += got


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[mmap.mmap]:
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)  # the mapping keeps the file open
    try:
        yield mm
    finally:
        # A view still held by an in-flight traceback makes close() fail; the mapping is then freed with it.
        with contextlib.suppress(BufferError):
            mm.close()


# Per-tensor tasks report a failure rather than raise it, so that no traceback keeps a view of a mapping alive.
Verdict = tuple[str, str | None]  # (tensor, error or None)


def _check_region(mm: mmap.mmap, name: str, offset: int, nbytes: int, checksum: str) -> Verdict:
    got = ckpt.adler32_hex(np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset))
    return name, None if got == checksum else f"got {got}, expected {checksum}"


@dataclass(frozen=True)
class _Step:
    """One delta frame to XOR into a tensor, and the adler32 the tensor must have afterwards."""

    source: mmap.mmap  # the delta shard
    begin: int
    end: int
    checksum: str
    origin: int  # index of the delta in the plan


@dataclass(frozen=True)
class _Failure:
    tensor: str
    message: str
    origin: int  # -1: the base checkpoint; i: plan.deltas[i]


def _apply_step(host: np.ndarray, step: _Step) -> str | None:
    frame = np.frombuffer(step.source, dtype=np.uint8, count=step.end - step.begin, offset=step.begin)
    try:
        ckpt.apply_xor_delta_into(host, frame)
    except ValueError as exc:
        return str(exc)
    got = ckpt.adler32_hex(host)
    return (
        None
        if got == step.checksum
        else f"fails its adler32 check after the delta: got {got}, expected {step.checksum}"
    )


def _base_error(source: tuple[int, int], nbytes: int, checksum: str) -> str | None:
    host = np.empty(nbytes, dtype=np.uint8)
    _pread_into(source[0], memoryview(host), source[1])
    got = ckpt.adler32_hex(host)
    return None if got == checksum else f"fails its adler32 check: got {got}, expected {checksum}"


def _build_tensor(
    name: str,
    tensor: torch.Tensor | None,
    nbytes: int,
    source: tuple[int, int],
    checksum: str,
    steps: Sequence[_Step],
    out: tuple[int, int, _Countdown] | None,
) -> _Failure | None:
    """One tensor, in one pass: read its base bytes (fd, offset) into the resident pool, apply its deltas in
    order, checking adler32 after each (or of the base bytes when there is none), and write the result to the
    materialized shard (fd, offset, countdown to its fsync) when there is one. `tensor` is None for a tensor
    another rank holds: it is only materialized."""
    flat = None if tensor is None else tensor.reshape(-1).view(torch.uint8)
    # A non-CPU pool is filled through a host buffer of the tensor's size; a CPU pool is worked on directly.
    host = flat.numpy() if flat is not None and flat.device.type == "cpu" else np.empty(nbytes, dtype=np.uint8)
    _pread_into(source[0], memoryview(host), source[1])
    if not steps:
        got = ckpt.adler32_hex(host)
        if got != checksum:
            return _Failure(name, f"fails its adler32 check: got {got}, expected {checksum}", -1)
    for step in steps:
        error = _apply_step(host, step)
        if error is not None:
            # The checks after each delta cover the base too; only on a failure is the base checked on its own
            # (re-read), so that a bad base is not blamed on a good delta.
            base_error = _base_error(source, host.size, checksum)
            return _Failure(name, base_error, -1) if base_error else _Failure(name, error, step.origin)
    if out is not None:
        _pwrite_all(out[0], host, out[1])
        out[2].tick()
    if flat is not None and flat.device.type != "cpu":
        flat.copy_(torch.from_numpy(host))
    return None


def _fetch_range(
    checkpoint: _Checkpoint, shard: _Shard, fd: int, begin: int, end: int, progress: _Progress, finish: _Countdown
) -> None:
    """One ranged GET, written at its offset in the shard's file; the shard's last range finishes the shard."""
    link = checkpoint.link
    uri = link.shard_uri(shard.name)
    try:
        response = checkpoint.client.get_object(
            Bucket=link.bucket, Key=link.shard_key(shard.name), Range=f"bytes={begin}-{end - 1}"
        )
        data = response["Body"].read()
    except (ClientError, BotoCoreError) as exc:
        raise _s3_error(exc, uri) from exc
    if len(data) != end - begin:
        raise _LoadError(
            f"shard {uri}: the ranged GET of bytes {begin}-{end - 1} returned {len(data)} bytes; "
            "the object changed or is truncated"
        )
    _pwrite_all(fd, data, begin)
    progress.add(len(data))
    finish.tick()


def _finish_shard(checkpoint: _Checkpoint, shard: _Shard, path: Path, fd: int) -> None:
    """A shard is downloaded: check its header is the one validated and (full checkpoints) every tensor's
    adler32, then start its write-back, overlapping the downloads still running (the commit's fsync is then
    cheap)."""
    if os.pread(fd, shard.layout.data_start, 0) != shard.header:
        raise _LoadError(f"shard {checkpoint.where(shard.name)} changed while it was downloaded")
    if checkpoint.ref.kind == ArtifactKind.FULL:
        with _mapped(path) as mm:
            bad = _first_error(
                [
                    _check_region(
                        mm, name, shard.layout.data_start + info.begin, info.nbytes, shard.layout.checksums[name]
                    )
                    for name, info in shard.layout.infos.items()
                ]
            )
        if bad is not None:
            raise _LoadError(
                f"shard {checkpoint.link.shard_uri(shard.name)}: tensor {bad[0]!r} fails its adler32 check ({bad[1]})"
            )
    os.fdatasync(fd)


def _unchanged_since(plan: _Plan) -> Callable[[Any], list[str]]:
    """A `share` for the host store: the tensors a held version of the chain (the very WeightVersion object, by
    uid) has the target's bytes of, because no later delta of the chain changes them."""
    links = [plan.base, *plan.deltas]

    def share(version: Any) -> list[str]:
        for i, checkpoint in enumerate(links):
            link = checkpoint.link
            if (link.name, link.uid) == (version.version, version.uid):
                later = {n for d in links[i + 1 :] for shard in d.shards.values() for n in shard.layout.infos}
                return [e.name for e in version.entries if e.name in plan.layout and e.name not in later]
        return []

    return share


def _run(pool: ThreadPoolExecutor, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run tasks in the pool; on the first failure cancel the rest, wait for running ones (they may hold
    files the caller is about to close) and raise it."""
    futures = [pool.submit(task) for task in tasks]
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    failed = next((f for f in futures if f in done and f.exception() is not None), None)
    if failed is not None:
        for future in futures:
            future.cancel()
        wait(futures)
        raise failed.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


def _first_error(verdicts: Sequence[Verdict]) -> tuple[str, str] | None:
    return next(((name, msg) for name, msg in verdicts if msg is not None), None)


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def _cached_client(
    endpoint: str | None, region: str | None, creds: Mapping[str, str] | None, workers: int, timeout_s: float
) -> Any:
    """Creating a boto3 client costs tens of milliseconds and the agent builds strategies per load, so clients
    are shared process-wide, one per endpoint, region, identity, pool size and timeout (boto3 clients are
    thread-safe)."""
    key = (endpoint, region, tuple(sorted((creds or {}).items())), workers, timeout_s)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = bulk_s3_client(endpoint, region, creds, workers, timeout_s)
        return _clients[key]


class ObjectStorageStrategy:
    """Loads a WeightVersion from object storage, replaying its full + XOR-delta chain through `store`."""

    name = "ObjectStorage"

    def __init__(
        self,
        *,
        namespace: str,
        fetch_version: Callable[[str], Mapping[str, Any] | None],
        credentials: Callable[[Mapping[str, Any]], Mapping[str, str] | None],
        store: CheckpointStore,
        default_endpoint: str | None = None,
        download_workers: int = 8,
        progress: Progress | None = None,
        range_bytes: int = DEFAULT_RANGE_BYTES,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        allocate: Callable[[Sequence[TensorSpec], str], ResidentWeights] = ResidentWeights.allocate,
    ) -> None:
        """`fetch_version(name)`: the WeightVersion object (a dict) of that name in the replica's `namespace`, or
        None. `credentials(storage)`: S3 credentials for a `spec.storage` dict, or None for the environment's.
        `timeout_s` bounds each S3 request, all its tries together (the replica's `spec.transfer.timeoutSeconds`).
        `allocate(specs, device)`: the target's memory (the agent's host store on `cpu`)."""
        if download_workers < 1 or range_bytes < 1 or timeout_s <= 0:
            raise ValueError("download_workers, range_bytes and timeout_s must be positive")
        self._namespace = namespace
        self._timeout_s = float(timeout_s)
        self._fetch_version = fetch_version
        self._credentials = credentials
        self._store = store
        self._default_endpoint = default_endpoint
        self._workers = download_workers
        self._progress = progress
        self._range_bytes = range_bytes
        self._allocate = allocate

    # ------------------------------------------------------------------ LoadStrategy

    def is_available(self, ctx: LoadContext) -> bool:
        """The target version exists and is stored in S3. Errors reading it escape, as the chain expects."""
        body = self._fetch_version(ctx.version)
        return body is not None and bool(((body.get("spec") or {}).get("storage") or {}).get("uri"))

    def load(self, ctx: LoadContext) -> S3LoadResult:
        """Replay `ctx.version` into a new pool and activate it in the store (a one-rank replica); every failure
        is StrategyFailed(mutated=False)."""
        return self.prepare(ctx, activate=True)

    def resolve(self, ctx: LoadContext) -> tuple[str, ...]:
        """The replay chain of `ctx.version`, root first (the ranks of a replica agree on it first)."""
        with self._failures():
            return tuple(link.name for link in self._resolve(ctx))

    def prepare(self, ctx: LoadContext, *, activate: bool) -> S3LoadResult:
        """The local leader's step: fetch what the store lacks, replay the chain and load this rank's tensors
        in the same pass, materializing every rank's tensors in the store. With `activate=False` the store only
        marks the version prepared; `activate()` follows once every rank has loaded it."""
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        with self._failures():
            links = self._resolve(ctx)
            with (
                self._store.lock(),
                ThreadPoolExecutor(self._workers, thread_name_prefix="ferry-s3") as pool,
            ):
                plan = self._plan(ctx, links, pool)
                timings["validate"] = time.monotonic() - t0
                resident, downloaded = self._execute(ctx, plan, pool, timings, activate=activate)
        ctx.version_uid = links[-1].uid
        return self._result(ctx, plan, resident, downloaded, t0, timings)

    def attach(self, ctx: LoadContext, chain: Sequence[str]) -> None:
        """Another rank's check that its local leader prepared `chain` in the node's store."""
        with self._failures():
            self._require_prepared(ctx, tuple(chain))

    def _key(self, ctx: LoadContext) -> str:
        """The replica's model in the store: namespace-scoped, so two tenants' versions never share a path."""
        return model_key(self._namespace, ctx.model)

    def _require_prepared(self, ctx: LoadContext, chain: tuple[str, ...]) -> None:
        if self._store.prepared_head(self._key(ctx), chain) is None:
            raise _LoadError(
                f"{ctx.version} (chain {' → '.join(chain)}) is neither prepared nor active in this node's checkpoint "
                f"store {self._store.root}; every rank of a replica must share its node's store"
            )

    def load_prepared(self, ctx: LoadContext) -> S3LoadResult:
        """Another rank's step: load this rank's tensors from what the local leader prepared (checking every
        tensor's adler32), without fetching or changing anything in the store."""
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        with self._failures():
            links = self._resolve(ctx)
            chain = tuple(link.name for link in links)
            with ThreadPoolExecutor(self._workers, thread_name_prefix="ferry-s3") as pool:
                with self._store.lock():
                    self._require_prepared(ctx, chain)
                    plan = self._plan(ctx, links, pool, remote=False)
                if plan.deltas:
                    raise _LoadError(f"no materialized {ctx.version} in the store: the local leader did not build it")
                timings["validate"] = time.monotonic() - t0
                # The prepared chain is protected in the store's state, so it is read outside the lock.
                resident = self._build(ctx, plan, pool, timings)
        ctx.version_uid = links[-1].uid
        return self._result(ctx, plan, resident, 0, t0, timings)

    def activate(self, ctx: LoadContext, chain: Sequence[str]) -> None:
        """Mark the prepared version active in the store (protecting its chain from eviction)."""
        with self._failures():
            try:
                self._store.activate(self._key(ctx), ctx.version, chain)
            except RuntimeError as exc:
                raise _LoadError(str(exc)) from exc

    def release_prepared(self, ctx: LoadContext) -> None:
        """Undo `prepare(activate=False)` when the replica gives up: the store forgets the prepared version."""
        self._store.release_prepared(self._key(ctx), ctx.version)

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """Every failure is StrategyFailed(mutated=False); an artifact found corrupt is discarded first, so that
        a retry fetches it again instead of failing the same way forever."""
        try:
            yield
        except _LoadError as exc:
            if exc.discard is not None:
                self._store.discard(exc.discard)
            raise StrategyFailed(f"ObjectStorage: {exc}", mutated=False) from exc
        except OSError as exc:  # local I/O (disk full, permissions): the new pool was never handed out
            raise StrategyFailed(f"ObjectStorage: local checkpoint store I/O failed: {exc}", mutated=False) from exc

    @staticmethod
    def _result(
        ctx: LoadContext, plan: _Plan, resident: ResidentWeights, downloaded: int, t0: float, timings: dict[str, float]
    ) -> S3LoadResult:
        seconds = time.monotonic() - t0
        log.info(
            "rank %d/%d loaded %s (%d bytes, chain %s) from %s in %.2fs, %d bytes downloaded",
            ctx.rank, ctx.world_size, ctx.version, resident.total_bytes, " → ".join(plan.chain),
            plan.reused or "S3", seconds, downloaded,
        )  # fmt: skip
        return S3LoadResult(
            resident=resident,
            bytes_moved=resident.total_bytes,
            bytes_downloaded=downloaded,
            chain=plan.chain,
            reused=plan.reused,
            seconds=seconds,
            timings={k: round(v, 6) for k, v in timings.items()},
        )

    def rollback(self, ctx: LoadContext) -> None:
        """Nothing is held after `load` returns or raises: the store restores its own state."""

    # ------------------------------------------------------------------ phase 1: chain

    def _resolve(self, ctx: LoadContext) -> list[_Link]:
        bodies: dict[str, Mapping[str, Any] | None] = {}

        def lookup(name: str) -> VersionView | None:
            if name not in bodies:
                try:
                    bodies[name] = self._fetch_version(name)
                except Exception as exc:
                    raise _LoadError(f"reading WeightVersion {name} failed: {exc}") from exc
            body = bodies[name]
            return None if body is None else VersionView.from_body(body)

        result = resolve_chain(ctx.version, lookup, MAX_CHAIN_LENGTH)
        if not result.ok:
            raise _LoadError(f"cannot replay {ctx.version}: {result.reason}: {result.message}")
        links: list[_Link] = []
        for name in result.chain:
            body = bodies[name] or {}
            view = VersionView.from_body(body)
            where = "" if name == ctx.version else f" (in the replay chain of {ctx.version})"
            if view.format == WeightFormat.PEER_ONLY:
                raise _LoadError(f"{name} is PeerOnly: it is served from memory only and has nothing stored")
            if view.model_name != ctx.model:
                raise _LoadError(f"WeightVersion {name}{where} is for model {view.model_name!r}, not {ctx.model!r}")
            if not view.ready:  # resolve_chain checks only the direct base; replay needs every link
                raise _LoadError(f"WeightVersion {name}{where} is not Ready")
            storage = (body.get("spec") or {}).get("storage") or {}
            try:
                bucket, key = parse_s3_uri(storage.get("uri", ""))
            except ValueError as exc:
                raise _LoadError(f"WeightVersion {name}{where} has no usable spec.storage.uri: {exc}") from exc
            try:
                self._store.path(ArtifactRef(self._key(ctx), ArtifactKind.FULL, name))
            except ValueError as exc:  # e.g. a version named *.tmp, which the store reserves for debris
                raise _LoadError(f"WeightVersion {name}{where}: {exc}") from exc
            metadata = body.get("metadata") or {}
            if metadata.get("namespace", self._namespace) != self._namespace:
                raise _LoadError(f"WeightVersion {name}{where} is of namespace {metadata['namespace']!r}")
            digest = (body.get("status") or {}).get("indexDigest") or None
            links.append(
                _Link(
                    name, view.format, view.base_version, storage, bucket, key,
                    self._namespace, str(metadata.get("uid") or ""), digest,
                )
            )  # fmt: skip
        return links

    # ------------------------------------------------------------------ phase 2: validate (no mutation)

    def _plan(self, ctx: LoadContext, links: list[_Link], pool: ThreadPoolExecutor, *, remote: bool = True) -> _Plan:
        """What to read and apply. With `remote=False` everything must already be in the store (a rank loading
        what its local leader prepared)."""
        model = self._key(ctx)

        def fetch(ref: ArtifactRef, link: _Link) -> _Checkpoint:
            if not remote:
                raise _LoadError(f"{ref} is not in this node's checkpoint store; the local leader did not prepare it")
            return self._remote(ref, link, pool)

        chain = tuple(link.name for link in links)
        base: _Checkpoint | None = None
        start = 0
        for i in range(len(links) - 1, 0, -1):  # the newest materialized version of the chain
            ref = ArtifactRef(model, ArtifactKind.MATERIALIZED, links[i].name)
            base = self._stored(ref, links[i], [link.expected for link in links[: i + 1]])
            if base is not None:
                start = i
                break
        if base is None:
            ref = ArtifactRef(model, ArtifactKind.FULL, links[0].name)
            base = self._stored(ref, links[0]) or fetch(ref, links[0])
        reused = None if base.path is None else f"{base.ref.kind}/{base.ref.version}"
        deltas = []
        for link in links[start + 1 :]:
            ref = ArtifactRef(model, ArtifactKind.DELTA, link.name)
            deltas.append(self._stored(ref, link) or fetch(ref, link))

        layout = {name: (shard, info) for shard in base.shards.values() for name, info in shard.layout.infos.items()}
        for name, (shard, info) in layout.items():
            if info.dtype not in TORCH_DTYPES:
                raise _LoadError(f"tensor {name!r} in {base.where(shard.name)} has dtype {info.dtype}, unsupported")
        for delta in deltas:
            for shard in delta.shards.values():
                for name, info in shard.layout.infos.items():
                    if name not in layout:
                        raise _LoadError(
                            f"delta shard {delta.where(shard.name)} changes tensor {name!r}, which {chain[0]} does "
                            "not have; a layout change needs a new FullCheckpoint"
                        )
                    if info.dtype != "U8" or len(info.shape) != 1:
                        raise _LoadError(
                            f"delta shard {delta.where(shard.name)} stores {name!r} as {info.dtype}{list(info.shape)},"
                            " not as a 1-D U8 zstd frame"
                        )
        specs = rank_specs(
            [
                TensorSpec(name, str(TORCH_DTYPES[info.dtype]), info.shape, info.nbytes)
                for name, (_, info) in sorted(layout.items())
            ],
            ctx.rank,
            ctx.world_size,
        )
        expected = ctx.expected_manifest_digest
        if expected and manifest_digest(specs) != expected:
            raise _LoadError(
                f"the manifest of {ctx.version} in object storage has digest {manifest_digest(specs)}, "
                f"but the replica expects {expected}"
            )
        return _Plan(model, chain, base, deltas, layout, specs, reused)

    @staticmethod
    def _parse_index(raw: bytes, link: _Link, delta: bool, where: str) -> ckpt.CheckpointIndex:
        try:
            index = ckpt.parse_index(raw)
            if delta:
                ckpt.check_delta_identity(index, version=link.name, base_version=link.base)
            elif index.is_delta:
                raise ckpt.InvalidIndex(
                    f"it is an XorDelta index (of {index.metadata['version']} on {index.metadata['base_version']}) "
                    f"but {link.name} is a FullCheckpoint"
                )
        except ckpt.InvalidIndex as exc:
            raise _LoadError(f"index {where} is invalid: {exc}") from exc
        return index

    def _stored(
        self, ref: ArtifactRef, link: _Link, expected: Sequence[VersionIdentity] | None = None
    ) -> _Checkpoint | None:
        """A stored artifact written from exactly the `expected` versions (by default `link`'s alone),
        re-validated (headers only; tensor checksums are checked when read). One of another identity, or broken,
        is discarded and the caller falls back to S3."""
        path = self._store.artifact(ref, [link.expected] if expected is None else expected)
        if path is None:
            return None
        try:
            raw = (path / ckpt.INDEX_NAME).read_bytes()
            if ref.kind != ArtifactKind.MATERIALIZED and link.index_digest not in (None, index_digest(raw)):
                raise ValueError(f"its index does not have the digest {link.index_digest} of {link.uri}")
            index = self._parse_index(raw, link, ref.kind == ArtifactKind.DELTA, str(path))
            shards: dict[str, _Shard] = {}
            for name in index.shards:
                with open(path / name, "rb") as f:
                    prefix = f.read(ckpt.HEADER_PREFIX_BYTES)
                    header = prefix + f.read(ckpt.header_length(prefix))
                layout = ckpt.check_shard(
                    header, (path / name).stat().st_size, index.tensors_in(name), checksummed=True
                )
                shards[name] = _Shard(name, layout, header)
            checksums = {k: v for s in shards.values() for k, v in s.layout.checksums.items()}
            if ref.kind == ArtifactKind.MATERIALIZED:
                checksums = json.loads((path / CHECKSUMS_FILE).read_text())
                if set(checksums) != set(index.weight_map):
                    raise ValueError(f"{CHECKSUMS_FILE} does not cover exactly the tensors of the index")
        except (OSError, ValueError, _LoadError) as exc:  # InvalidIndex/InvalidShard are ValueErrors
            log.warning("discarding stored %s, it is unreadable: %s", ref, exc)
            self._store.discard(ref)
            return None
        return _Checkpoint(link, ref, raw, index, shards, checksums, path, self._store.identity(ref))

    def _remote(self, ref: ArtifactRef, link: _Link, pool: ThreadPoolExecutor) -> _Checkpoint:
        """Fetch and validate a checkpoint's index and every shard header from S3 (HEAD + ranged GET each)."""
        client = self._client(link)
        if self._progress is not None:
            self._progress(0, 0, link.uri)  # what the load waits on, before the first request (stall diagnosis)
        try:
            response = client.get_object(Bucket=link.bucket, Key=link.key)
            if response["ContentLength"] > MAX_INDEX_BYTES:
                response["Body"].close()
                raise _LoadError(f"index {link.uri} is {response['ContentLength']} bytes, too big to be an index")
            raw = response["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            raise _s3_error(exc, link.uri) from exc
        digest = index_digest(raw)
        if link.index_digest is not None and digest != link.index_digest:
            raise _LoadError(
                f"index {link.uri} has sha256 {digest}, but WeightVersion {link.name} was verified with "
                f"{link.index_digest} (status.indexDigest): the object changed after it was published"
            )
        index = self._parse_index(raw, link, ref.kind == ArtifactKind.DELTA, link.uri)
        probed = _run(pool, [lambda s=s: self._probe(client, link, index, s) for s in index.shards])
        shards = {s.name: s for s in probed}
        checksums = {k: v for s in shards.values() for k, v in s.layout.checksums.items()}
        identity = (VersionIdentity(link.namespace, link.uid, link.uri, digest),)
        return _Checkpoint(link, ref, raw, index, shards, checksums, None, identity, client)

    @staticmethod
    def _probe(client: Any, link: _Link, index: ckpt.CheckpointIndex, shard: str) -> _Shard:
        uri, key = link.shard_uri(shard), link.shard_key(shard)

        def get(first: int, last: int) -> bytes:
            response = client.get_object(Bucket=link.bucket, Key=key, Range=f"bytes={first}-{last}")
            return response["Body"].read()

        try:
            size = client.head_object(Bucket=link.bucket, Key=key)["ContentLength"]
            if size < ckpt.HEADER_PREFIX_BYTES:
                raise _LoadError(f"shard {uri} is only {size} bytes; it is truncated")
            head = get(0, min(size, HEADER_PROBE_BYTES) - 1)
            header_end = ckpt.HEADER_PREFIX_BYTES + ckpt.header_length(head)
            if header_end > size:
                raise _LoadError(f"shard {uri} is {size} bytes but its header alone needs {header_end}; truncated")
            if header_end > len(head):
                head += get(len(head), header_end - 1)
            layout = ckpt.check_shard(head, size, index.tensors_in(shard), checksummed=True)
        except (ClientError, BotoCoreError) as exc:
            raise _s3_error(exc, uri) from exc
        except ckpt.InvalidShard as exc:
            raise _LoadError(f"shard {uri} {exc}") from exc
        return _Shard(shard, layout, head[: layout.data_start])

    def _client(self, link: _Link) -> Any:
        endpoint = link.storage.get("endpoint") or self._default_endpoint
        region = link.storage.get("region")
        try:
            creds = self._credentials(link.storage)
        except Exception as exc:
            raise _LoadError(f"no S3 credentials for {link.uri}: {exc}") from exc
        return _cached_client(endpoint, region, creds, self._workers, self._timeout_s)

    # ------------------------------------------------------------------ phase 3: download, apply, place

    def _execute(
        self, ctx: LoadContext, plan: _Plan, pool: ThreadPoolExecutor, timings: dict[str, float], *, activate: bool
    ) -> tuple[ResidentWeights, int]:
        fetch = [c for c in (plan.base, *plan.deltas) if c.path is None]
        downloaded = sum(c.stored_bytes for c in fetch)
        needed = downloaded + (plan.base.stored_bytes if plan.deltas else 0)  # + the materialized target
        with self._store.update(plan.model, ctx.version, plan.chain, protect=[plan.base.ref]) as update:
            try:
                self._store.reserve(needed)
            except CheckpointCacheCapacityError as exc:
                raise _LoadError(str(exc)) from exc
            if fetch:
                self._download(fetch, pool, timings)
            resident = self._build(ctx, plan, pool, timings)
            update.commit(activate=activate)
        return resident, downloaded

    def _download(self, fetch: list[_Checkpoint], pool: ThreadPoolExecutor, timings: dict[str, float]) -> None:
        """Ranged parallel GETs straight into the artifacts' tmp files. Each shard is checked (header, and every
        full tensor's adler32) as soon as its last range lands, so an artifact is only renamed into the store
        once all of it is verified."""
        t = time.monotonic()
        progress = _Progress(
            self._progress,
            sum(s.layout.size for c in fetch for s in c.shards.values()),
            ", ".join(c.link.uri.rpartition("/")[0] + "/" for c in fetch),  # the folders the shards are read from
        )
        with contextlib.ExitStack() as stack:
            tasks: list[Callable[[], None]] = []
            for checkpoint in fetch:
                tmp = stack.enter_context(
                    self._store.write(checkpoint.ref, {"uri": checkpoint.link.uri}, checkpoint.identity)
                )
                (tmp / ckpt.INDEX_NAME).write_bytes(checkpoint.index_raw)
                for shard in checkpoint.shards.values():
                    path = tmp / shard.name
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    stack.callback(os.close, fd)  # LIFO: closed before the artifact is committed
                    os.ftruncate(fd, shard.layout.size)
                    ranges = [
                        (begin, min(begin + self._range_bytes, shard.layout.size))
                        for begin in range(0, shard.layout.size, self._range_bytes)
                    ]
                    finish = _Countdown(len(ranges), partial(_finish_shard, checkpoint, shard, path, fd))
                    tasks.extend(
                        partial(_fetch_range, checkpoint, shard, fd, b, e, progress, finish) for b, e in ranges
                    )
            _run(pool, tasks)
            timings["download"] = time.monotonic() - t  # with the checks and write-back it overlaps
            t = time.monotonic()
        timings["commit"] = time.monotonic() - t  # fsync + rename of every downloaded artifact
        for checkpoint in fetch:
            checkpoint.path = self._store.path(checkpoint.ref)

    def _build(
        self, ctx: LoadContext, plan: _Plan, pool: ThreadPoolExecutor, timings: dict[str, float]
    ) -> ResidentWeights:
        """Fill a new pool from the base, applying the deltas on the way, and (when there are deltas) write the
        result to materialized/<target> in the same pass. The base is read, never changed or renamed, so the
        previous good version stays intact until the new one is committed."""
        base = plan.base
        assert base.path is not None and all(d.path is not None for d in plan.deltas)
        t = time.monotonic()
        try:
            resident = self._allocate(plan.specs, ctx.device, _unchanged_since(plan))
        except (RuntimeError, ValueError) as exc:  # e.g. out of device memory
            nbytes = sum(s.nbytes for s in plan.specs)
            raise _LoadError(f"cannot allocate {nbytes} bytes on {ctx.device}: {exc}") from exc
        checksums = dict(base.checksums)
        for delta in plan.deltas:
            checksums.update(delta.checksums)
        # A delta replays on the very base version a pod still holds in host memory (the same WeightVersion
        # object): its tensors' bytes are read from that sealed memory, not from the store's copy on disk.
        held = resident.shared_from
        in_memory: dict[str, tuple[int, int]] = {}
        if plan.deltas and held is not None and (held.version, held.uid) == (base.link.name, base.link.uid):
            in_memory = {e.name: (held.chunks[e.chunk].fd, e.offset) for e in held.entries}
            log.info("replaying %s on %s in host memory", plan.chain[-1], base.link.name)
        with contextlib.ExitStack() as stack:
            sources: dict[str, int] = {}
            for shard in base.shards:
                sources[shard] = os.open(base.path / shard, os.O_RDONLY)
                stack.callback(os.close, sources[shard])
            outputs: dict[str, tuple[int, _Countdown]] = {}
            if plan.deltas:
                identity = base.identity + tuple(i for d in plan.deltas for i in d.identity)
                tmp = stack.enter_context(
                    self._store.write(plan.head, {"uri": plan.deltas[-1].link.uri, "chain": list(plan.chain)}, identity)
                )
                (tmp / ckpt.INDEX_NAME).write_bytes(base.index_raw)
                (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=1, sort_keys=True))
                (tmp / CHAIN_FILE).write_text(
                    json.dumps({"version": plan.chain[-1], "full_version": plan.chain[0], "deltas": plan.chain[1:]})
                )
                for shard in base.shards.values():
                    fd = os.open(tmp / shard.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    stack.callback(os.close, fd)  # LIFO: closed before the commit
                    _pwrite_all(fd, shard.header, 0)
                    os.ftruncate(fd, shard.layout.size)
                    # Write-back of a finished shard overlaps building the others; the commit's fsync is then cheap.
                    outputs[shard.name] = (fd, _Countdown(len(shard.layout.infos), partial(os.fdatasync, fd)))
            steps: dict[str, list[_Step]] = {}
            for origin, delta in enumerate(plan.deltas):
                assert delta.path is not None
                for shard in delta.shards.values():
                    mm = stack.enter_context(_mapped(delta.path / shard.name))
                    for name, info in shard.layout.infos.items():
                        begin = shard.layout.data_start + info.begin
                        step = _Step(mm, begin, begin + info.nbytes, shard.layout.checksums[name], origin)
                        steps.setdefault(name, []).append(step)
            tasks = []
            for name, (shard, info) in plan.layout.items():
                # None: another rank's, or a held version's (shared, read-only), built only to be materialized.
                tensor = None if name in resident.shared else resident.tensors.get(name)
                if tensor is None and not outputs:
                    continue
                offset = shard.layout.data_start + info.begin
                out = (outputs[shard.name][0], offset, outputs[shard.name][1]) if outputs else None
                source = in_memory.get(name) or (sources[shard.name], offset)
                tasks.append(
                    partial(
                        _build_tensor, name, tensor, info.nbytes, source, base.checksums[name],
                        steps.get(name, ()), out,
                    )
                )  # fmt: skip
            failure = next((f for f in _run(pool, tasks) if f is not None), None)
            if failure is not None:
                raise self._failure(plan, failure)
            timings["build"] = time.monotonic() - t
            t = time.monotonic()
        if plan.deltas:
            timings["commit"] = timings.get("commit", 0.0) + time.monotonic() - t  # fsync + rename
        return resident

    @staticmethod
    def _failure(plan: _Plan, failure: _Failure) -> _LoadError:
        if failure.origin < 0:
            shard = plan.layout[failure.tensor][0].name
            return _LoadError(
                f"stored checkpoint {plan.base.where(shard)}: tensor {failure.tensor!r} {failure.message}; "
                "it is discarded and fetched again on retry",
                discard=plan.base.ref,
            )
        delta = plan.deltas[failure.origin]
        return _LoadError(
            f"delta shard {delta.where(delta.index.weight_map[failure.tensor])}: tensor {failure.tensor!r} "
            f"{failure.message} (applying {delta.link.name} on {delta.link.base}); "
            "the store stays at its previous version",
            discard=delta.ref,
        )
