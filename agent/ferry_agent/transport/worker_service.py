"""The per-rank Worker gRPC service (manifest + tensor read leases), and its client helpers.

Semantics follow ModelExpress's worker server: identity validated on every call,
UNAVAILABLE while draining, NOT_FOUND for an unknown or expired lease, lease TTL
ceil(2*max(120, transfer timeout) + 30) seconds, lazy expiry, and `drain(timeout)` that re-opens the
source and raises `TimeoutError` when readers do not finish in time. A source grants at most `max_readers` leases
at once (RESOURCE_EXHAUSTED beyond: the reader goes to another holder), and every lease says which tensors it
covers (`holdings`: all of them for a Serving source, those checked so far for a loading one) with their adler32.

With a `ReadGuard` (`worker_auth`; what the node agent and its ranks always use) every call is authenticated
first and a manifest or lease is granted only to an agent whose node is assigned the served version; without
one (`guard=None`) the service is open, which only the standalone test/bench source (`ferry_dev.source_main`) uses.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from concurrent import futures
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import torch

from ferry import checkpoint_format as ckpt
from ferry_agent.store.resident import ResidentWeights, TensorSpec, manifest_digest
from ferry_agent.transport.holdings import Holdings, HoldingsView
from ferry_agent.transport.nixl import ManifestMismatchError, NixlPeer, RemoteTensor, describe
from ferry_agent.transport.proto import worker_pb2, worker_pb2_grpc
from ferry_agent.transport.worker_auth import AccessDenied, ReadGuard, bearer_metadata

log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_TRANSFER_TIMEOUT_S = 300.0
DEFAULT_RPC_TIMEOUT_S = 5.0
MAX_HOLDINGS_WAIT_MS = 2000  # a long-polling reader holds one of the server's threads at most this long
# NIXL metadata grows with registered regions (~180 kB for 4096); manifests of big models are larger still.
_MAX_MESSAGE = 64 << 20
_GRPC_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE), ("grpc.max_receive_message_length", _MAX_MESSAGE)]


def lease_ttl_seconds(transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S) -> int:
    """One metadata handshake plus one bounded receive, with slack."""
    return math.ceil(2 * max(120.0, transfer_timeout_s) + 30)


@dataclass(frozen=True)
class SourceIdentity:
    agent_name: str
    instance_id: str = ""

    def to_proto(self) -> worker_pb2.SourceIdentity:
        return worker_pb2.SourceIdentity(agent_name=self.agent_name, instance_id=self.instance_id)


class SourceDraining(RuntimeError):
    """The source is draining and grants no new reads."""


class SourceBusy(RuntimeError):
    """The source serves its `max_readers` already."""


class LeaseNotHeld(PermissionError):
    """A release of a lease that another reader holds."""


class TensorReadLeases:
    """Read leases of one rank. `clock` is the lease time source (injectable for tests)."""

    def __init__(
        self,
        ttl_s: float | None = None,
        *,
        transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        max_readers: int | None = None,
        on_grant: Callable[[], None] | None = None,
    ) -> None:
        """`on_grant()`: runs after each lease granted (the NIXL pump hurries: the reader connects next)."""
        self.ttl_s = float(ttl_s) if ttl_s is not None else float(lease_ttl_seconds(transfer_timeout_s))
        if not self.ttl_s > 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s!r}")
        if max_readers is not None and max_readers < 1:
            raise ValueError(f"max_readers must be positive, got {max_readers!r}")
        self.max_readers = max_readers
        self._on_grant = on_grant
        self.peak = 0  # the most leases active at once so far
        self._clock = clock
        self._cond = threading.Condition()
        self._deadlines: dict[str, float] = {}
        self._holders: dict[str, str] = {}  # lease id -> who acquired it ("" when unauthenticated)
        self._accepting = True

    def _prune(self) -> None:
        now = self._clock()
        for lease_id in [k for k, deadline in self._deadlines.items() if deadline <= now]:
            del self._deadlines[lease_id]
            self._holders.pop(lease_id, None)
            log.warning("tensor read lease %s expired without release", lease_id)
        self._cond.notify_all()

    @property
    def accepting(self) -> bool:
        with self._cond:
            return self._accepting

    def acquire(self, holder: str = "") -> str:
        with self._cond:
            if not self._accepting:
                raise SourceDraining("source is draining")
            self._prune()
            if self.max_readers is not None and len(self._deadlines) >= self.max_readers:
                raise SourceBusy(f"{len(self._deadlines)} readers, the most this source serves at once")
            lease_id = uuid.uuid4().hex
            self._deadlines[lease_id] = self._clock() + self.ttl_s
            self._holders[lease_id] = holder
            self.peak = max(self.peak, len(self._deadlines))
        if self._on_grant is not None:
            self._on_grant()
        return lease_id

    def release(self, lease_id: str, holder: str = "") -> bool:
        """False when the lease is unknown or already expired; `LeaseNotHeld` when `holder` did not acquire it."""
        with self._cond:
            self._prune()
            if lease_id in self._deadlines and self._holders.get(lease_id, "") != holder:
                raise LeaseNotHeld(f"tensor read lease {lease_id} is held by another reader")
            found = self._deadlines.pop(lease_id, None) is not None
            self._holders.pop(lease_id, None)
            self._cond.notify_all()
            return found

    def active_count(self) -> int:
        with self._cond:
            self._prune()
            return len(self._deadlines)

    def drain(self, timeout_s: float) -> None:
        """Stop granting leases and wait (real time) until none is active; leaves the source closed.

        On timeout the source accepts reads again and `TimeoutError` is raised: the caller must not
        mutate tensors that readers may still be copying.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._accepting = False
            while True:
                self._prune()
                if not self._deadlines:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._accepting = True
                    raise TimeoutError(f"{len(self._deadlines)} tensor read lease(s) still active after {timeout_s:g}s")
                self._cond.wait(min(remaining, 0.05))  # short slices so lazy expiry is noticed

    def resume(self) -> None:
        """Accept reads again after a completed drain (e.g. the tensors were not changed after all)."""
        with self._cond:
            self._accepting = True


def adler32s(resident: ResidentWeights) -> dict[str, str]:
    """Every tensor's adler32, as the checkpoint format writes it: for a served rank whose load did not check its
    bytes against the version's checksums (a local seed, a store build), so that readers can check theirs."""
    out = {}
    for spec in resident.manifest:
        tensor = resident.tensors[spec.name]
        out[spec.name] = ckpt.adler32_hex(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy())
    return out


def build_manifest(
    resident: ResidentWeights, *, identity: SourceIdentity, rank: int, nixl_metadata: bytes
) -> worker_pb2.TensorManifest:
    return worker_pb2.TensorManifest(
        source=identity.to_proto(),
        rank=rank,
        manifest_digest=resident.digest,
        total_bytes=resident.total_bytes,
        nixl_metadata=nixl_metadata,
        tensors=[
            worker_pb2.TensorDescriptor(
                name=t.name,
                addr=t.addr,
                nbytes=t.nbytes,
                dtype=t.dtype,
                shape=list(t.shape),
                mem_type=t.mem_type,
                device_id=t.device_id,
            )
            for t in describe(resident)
        ],
    )


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        manifest: worker_pb2.TensorManifest,
        leases: TensorReadLeases,
        guard: ReadGuard | None = None,
        holdings: Holdings | None = None,
    ) -> None:
        """`holdings`: what a lease covers (None: nothing can be checked, so nothing can be read)."""
        self._manifest = manifest
        self._leases = leases
        self._guard = guard
        self._holdings = holdings or Holdings([t.name for t in manifest.tensors])

    def _snapshot(self) -> worker_pb2.Holdings:
        return self._holdings.to_proto(readers=self._leases.active_count(), max_readers=self._leases.max_readers)

    def _admit(self, context: grpc.ServicerContext, *, read: bool) -> str:
        """Who calls (the lease holder key; "" when unguarded). Runs before anything else, so a refused caller
        learns nothing about this source, and never sees its NIXL metadata."""
        if self._guard is None:
            return ""
        metadata = context.invocation_metadata()
        try:
            principal = self._guard.admit_read(metadata) if read else self._guard.admit_release(metadata)
        except AccessDenied as exc:
            log.warning("refused a worker call (%s): %s", exc.code.name, exc)
            context.abort(exc.code, str(exc))
        return principal.key

    def _validate(self, request_source: worker_pb2.SourceIdentity, context: grpc.ServicerContext) -> None:
        own = self._manifest.source
        if not request_source.agent_name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "source identity (agent_name) is required")
        if request_source.agent_name != own.agent_name or (
            request_source.instance_id and request_source.instance_id != own.instance_id
        ):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this endpoint serves {own.agent_name}/{own.instance_id}, "
                f"not {request_source.agent_name}/{request_source.instance_id}",
            )

    def GetTensorManifest(
        self, request: worker_pb2.GetTensorManifestRequest, context: grpc.ServicerContext
    ) -> worker_pb2.GetTensorManifestResponse:
        self._admit(context, read=True)
        self._validate(request.source, context)
        if not self._leases.accepting:
            context.abort(grpc.StatusCode.UNAVAILABLE, "source is draining")
        return worker_pb2.GetTensorManifestResponse(manifest=self._manifest)

    def PrepareTensorRead(
        self, request: worker_pb2.PrepareTensorReadRequest, context: grpc.ServicerContext
    ) -> worker_pb2.PrepareTensorReadResponse:
        holder = self._admit(context, read=True)
        self._validate(request.source, context)
        try:
            lease_id = self._leases.acquire(holder)
        except SourceDraining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "source is draining")
        except SourceBusy as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        holdings = self._snapshot()
        log.info(
            "tensor read lease %s granted to %s (%s): %d of %s readers, %s",
            lease_id,
            request.reader or "?",
            holder or "open",
            holdings.readers,
            self._leases.max_readers or "unlimited",
            "complete" if holdings.complete else f"{self._holdings.count} of {len(self._holdings.names)} tensors held",
        )
        return worker_pb2.PrepareTensorReadResponse(
            lease_id=lease_id, ttl_seconds=self._leases.ttl_s, manifest=self._manifest, holdings=holdings
        )

    def GetHoldings(
        self, request: worker_pb2.GetHoldingsRequest, context: grpc.ServicerContext
    ) -> worker_pb2.GetHoldingsResponse:
        self._admit(context, read=True)
        self._validate(request.source, context)
        if not self._leases.accepting:
            context.abort(grpc.StatusCode.UNAVAILABLE, "source is draining")
        self._holdings.wait(request.known, min(request.wait_ms, MAX_HOLDINGS_WAIT_MS) / 1000)
        return worker_pb2.GetHoldingsResponse(holdings=self._snapshot())

    def ReleaseTensorRead(
        self, request: worker_pb2.ReleaseTensorReadRequest, context: grpc.ServicerContext
    ) -> worker_pb2.ReleaseTensorReadResponse:
        holder = self._admit(context, read=False)
        self._validate(request.source, context)
        try:
            found = self._leases.release(request.lease_id, holder)
        except LeaseNotHeld as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if not found:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no active tensor read lease {request.lease_id!r}")
        return worker_pb2.ReleaseTensorReadResponse()


class WorkerServer:
    """Serves one rank's Worker service on `host` (127.0.0.1 by default; the pod IP in a cluster; port 0 picks a
    free port)."""

    def __init__(
        self,
        manifest: worker_pb2.TensorManifest,
        *,
        leases: TensorReadLeases | None = None,
        port: int = 0,
        host: str = "127.0.0.1",
        max_workers: int = 16,
        guard: ReadGuard | None = None,
        holdings: Holdings | None = None,
    ) -> None:
        """`max_workers`: concurrent calls, long-polling `GetHoldings` included."""
        self.leases = leases or TensorReadLeases()
        self.identity = SourceIdentity(manifest.source.agent_name, manifest.source.instance_id)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_GRPC_OPTIONS)
        service = WorkerService(manifest, self.leases, guard, holdings)
        worker_pb2_grpc.add_WorkerServicer_to_server(service, self._server)
        self.host = host
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot bind the worker service to {host}:{port}")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        self._server.start()
        return self.port

    def drain(self, timeout_s: float) -> None:
        self.leases.drain(timeout_s)

    def stop(self, grace_s: float | None = None) -> None:
        self._server.stop(grace_s).wait()


def serve_resident(
    resident: ResidentWeights,
    peer: NixlPeer,
    *,
    rank: int,
    instance_id: str = "",
    port: int = 0,
    host: str = "127.0.0.1",
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
    lease_ttl_s: float | None = None,
    guard: ReadGuard | None = None,
    holdings: Holdings | None = None,
    max_readers: int | None = None,
    base: tuple[str, Collection[str]] | None = None,
) -> WorkerServer:
    """Publish weights as a P2P source: register them (once), serve their manifest and read leases (at most
    `max_readers` at once), and pump NIXL progress so targets can connect. Stop with `server.stop()` then
    `peer.stop_progress()`. `holdings`: what it holds so far, while it loads (pipelined fan-out); None: all of it,
    with the checksums its load checked (`resident.checksums`) or, for a load that had none, computed now.
    `base` (uid, names): these tensors are the very bytes of that WeightVersion (a delta's unchanged tensors), which a
    reader holding it shares instead of reading. `guard` None serves anyone: only for the standalone test/bench
    source."""
    peer.register(resident)
    if holdings is None:
        checksums = resident.checksums or adler32s(resident)
        holdings = Holdings.full([s.name for s in resident.manifest], checksums)
        if base is not None:
            holdings.set_base(*base)
    identity = SourceIdentity(peer.name, instance_id or uuid.uuid4().hex)
    manifest = build_manifest(resident, identity=identity, rank=rank, nixl_metadata=peer.metadata())
    leases = TensorReadLeases(
        lease_ttl_s, transfer_timeout_s=transfer_timeout_s, max_readers=max_readers, on_grant=peer.expedite
    )
    server = WorkerServer(manifest, leases=leases, port=port, host=host, guard=guard, holdings=holdings)
    peer.start_progress()
    server.start()
    return server


# ---------------------------------------------------------------------------------------------- client


@dataclass(frozen=True)
class SourceManifest:
    """A source's manifest as the target sees it."""

    identity: SourceIdentity
    rank: int
    digest: str
    total_bytes: int
    nixl_metadata: bytes
    tensors: tuple[RemoteTensor, ...]

    @classmethod
    def from_proto(cls, msg: worker_pb2.TensorManifest) -> SourceManifest:
        manifest = cls(
            identity=SourceIdentity(msg.source.agent_name, msg.source.instance_id),
            rank=msg.rank,
            digest=msg.manifest_digest,
            total_bytes=msg.total_bytes,
            nixl_metadata=bytes(msg.nixl_metadata),
            tensors=tuple(
                RemoteTensor(
                    name=t.name,
                    addr=t.addr,
                    nbytes=t.nbytes,
                    dtype=t.dtype,
                    shape=tuple(t.shape),
                    mem_type=t.mem_type,
                    device_id=t.device_id,
                )
                for t in msg.tensors
            ),
        )
        specs = [TensorSpec(t.name, t.dtype, t.shape, t.nbytes) for t in manifest.tensors]
        if manifest_digest(specs) != manifest.digest:
            raise ManifestMismatchError("source manifest does not match its own digest")
        return manifest

    @property
    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(t.name, t.dtype, t.shape, t.nbytes) for t in self.tensors]


# Errors that the source itself answered with: they say nothing against the connection.
_ANSWERED = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.INVALID_ARGUMENT,
    }
)


@dataclass(eq=False)
class _Channel:
    channel: grpc.Channel
    users: int = 0
    used_at: float = 0.0
    dropped: bool = False  # out of the pool: closed when its last call ends


class ChannelPool:
    """One gRPC channel per source endpoint, kept between calls: a lease, its holdings polls and its release ride
    one connection (a fresh one cost ~2 ms of a 64 MiB load's ~10). What a fresh channel per call gave stays true:
    every call still names the source's identity (a replaced source at the same endpoint is refused, never read),
    and a channel whose call failed without an answer from the source (unreachable, timed out, ...) leaves the
    pool, so the next call to that endpoint connects afresh instead of waiting out a reconnect back-off. A channel
    idle for `idle_s` is closed (at the next call)."""

    def __init__(self, idle_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._channels: dict[str, _Channel] = {}

    def _close(self, entry: _Channel) -> None:
        # Closing a channel cancels its calls in flight: only once no call uses it.
        if entry.dropped and entry.users == 0:
            entry.channel.close()

    @contextmanager
    def stub(self, endpoint: str) -> Iterator[worker_pb2_grpc.WorkerStub]:
        with self._lock:
            now = self._clock()
            for key, idle in list(self._channels.items()):
                if idle.users == 0 and now - idle.used_at > self._idle_s:
                    del self._channels[key]
                    idle.dropped = True
                    self._close(idle)
            entry = self._channels.get(endpoint)
            if entry is None:
                entry = self._channels[endpoint] = _Channel(grpc.insecure_channel(endpoint, options=_GRPC_OPTIONS))
            entry.users += 1
        try:
            yield worker_pb2_grpc.WorkerStub(entry.channel)
        except BaseException as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)) else None
            if code in _ANSWERED:
                raise  # the source answered: the connection is fine
            with self._lock:
                if self._channels.get(endpoint) is entry:
                    del self._channels[endpoint]
                entry.dropped = True
            raise
        finally:
            with self._lock:
                entry.users -= 1
                entry.used_at = self._clock()
                self._close(entry)

    def close(self) -> None:
        with self._lock:
            entries, self._channels = list(self._channels.values()), {}
            for entry in entries:
                entry.dropped = True
                self._close(entry)


CHANNELS = ChannelPool()  # the process's channels to the sources it reads from
_stub = CHANNELS.stub


Connect = Callable[[str], AbstractContextManager[Any]]  # endpoint -> a Worker stub for one call
Credentials = Callable[[], str]  # the reader's bearer token, read again for every call (it rotates)
SourceCredentials = Callable[[str], str]  # a source's node -> the reader's bearer token for that source alone
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class RetryPolicy:
    """Lease RPCs retried on a transient error (UNAVAILABLE: a restarting or briefly unreachable source, or one
    that cannot reach the API to check the reader): up to `retries` more attempts, waiting `backoff_s`, then
    twice that, and so on. Anything else fails at once."""

    retries: int = 0
    backoff_s: float = 0.5
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"rpcRetries must be a non-negative integer, got {self.retries!r}")
        if not self.backoff_s >= 0:
            raise ValueError(f"rpcBackoffSeconds must be >= 0, got {self.backoff_s!r}")

    def call(self, attempt: Callable[[], _T], what: str) -> _T:
        for n in range(self.retries + 1):
            try:
                return attempt()
            except grpc.RpcError as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                if code not in TRANSIENT_CODES or n == self.retries:
                    raise
                delay = self.backoff_s * 2**n
                log.info("%s: %s, retry %d/%d in %.2fs", what, code.name, n + 1, self.retries, delay)
                self.sleep(delay)
        raise AssertionError("unreachable")  # the last attempt returns or raises


NO_RETRY = RetryPolicy()


def _metadata(credentials: Credentials | None) -> tuple[tuple[str, str], ...] | None:
    return bearer_metadata(credentials()) if credentials is not None else None


def _check_identity(manifest: SourceManifest, expected: SourceIdentity) -> None:
    got = manifest.identity
    if got.agent_name != expected.agent_name or (expected.instance_id and got.instance_id != expected.instance_id):
        raise RuntimeError(f"source answered as {got.agent_name}/{got.instance_id}, expected {expected.agent_name}")


def get_tensor_manifest(
    endpoint: str,
    identity: SourceIdentity,
    *,
    timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    credentials: Credentials | None = None,
    connect: Connect = _stub,
) -> SourceManifest:
    with connect(endpoint) as stub:
        response = stub.GetTensorManifest(
            worker_pb2.GetTensorManifestRequest(source=identity.to_proto()),
            timeout=timeout_s,
            metadata=_metadata(credentials),
        )
    manifest = SourceManifest.from_proto(response.manifest)
    _check_identity(manifest, identity)
    return manifest


def release_tensor_read(
    endpoint: str,
    identity: SourceIdentity,
    lease_id: str,
    *,
    timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    credentials: Credentials | None = None,
    retry: RetryPolicy = NO_RETRY,
    connect: Connect = _stub,
) -> None:
    def attempt() -> None:
        with connect(endpoint) as stub:
            stub.ReleaseTensorRead(
                worker_pb2.ReleaseTensorReadRequest(source=identity.to_proto(), lease_id=lease_id),
                timeout=timeout_s,
                metadata=_metadata(credentials),
            )

    retry.call(attempt, f"ReleaseTensorRead at {endpoint}")


class TensorReadLease:
    """A granted read lease, covering the tensors `holdings` lists. `close()` releases it once; later calls do
    nothing."""

    def __init__(
        self,
        endpoint: str,
        identity: SourceIdentity,
        lease_id: str,
        ttl_s: float,
        manifest: SourceManifest,
        *,
        holdings: HoldingsView | None = None,
        release_timeout_s: float,
        credentials: Credentials | None = None,
        retry: RetryPolicy = NO_RETRY,
        connect: Connect = _stub,
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.lease_id = lease_id
        self.ttl_s = ttl_s
        self.manifest = manifest
        self.holdings = holdings or HoldingsView(frozenset(), ("",) * len(manifest.tensors), False)
        self._release_timeout_s = release_timeout_s
        self._credentials = credentials
        self._retry = retry
        self._connect = connect
        self._closed = False

    def close(self) -> None:
        """Release the lease; raises `grpc.RpcError` if the source cannot be told (it then expires by TTL)."""
        if self._closed:
            return
        self._closed = True
        release_tensor_read(
            self.endpoint,
            self.identity,
            self.lease_id,
            timeout_s=self._release_timeout_s,
            credentials=self._credentials,
            retry=self._retry,
            connect=self._connect,
        )


def prepare_tensor_read(
    endpoint: str,
    identity: SourceIdentity,
    *,
    reader: str = "",
    timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    release_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    credentials: Credentials | None = None,
    retry: RetryPolicy = NO_RETRY,
    connect: Connect = _stub,
) -> TensorReadLease:
    def attempt() -> worker_pb2.PrepareTensorReadResponse:
        with connect(endpoint) as stub:
            return stub.PrepareTensorRead(
                worker_pb2.PrepareTensorReadRequest(source=identity.to_proto(), reader=reader),
                timeout=timeout_s,
                metadata=_metadata(credentials),
            )

    response = retry.call(attempt, f"PrepareTensorRead at {endpoint}")
    try:
        manifest = SourceManifest.from_proto(response.manifest)
        _check_identity(manifest, identity)
    except BaseException:
        # A lease granted with a response we reject must not be left to expire.
        try:
            release_tensor_read(
                endpoint,
                identity,
                response.lease_id,
                timeout_s=release_timeout_s,
                credentials=credentials,
                retry=retry,
                connect=connect,
            )
        except Exception as exc:
            log.warning("releasing rejected lease %s at %s failed: %s", response.lease_id, endpoint, exc)
        raise
    return TensorReadLease(
        endpoint,
        identity,
        response.lease_id,
        response.ttl_seconds,
        manifest,
        holdings=HoldingsView.from_proto(response.holdings, len(manifest.tensors)),
        release_timeout_s=release_timeout_s,
        credentials=credentials,
        retry=retry,
        connect=connect,
    )


def get_holdings(
    endpoint: str,
    identity: SourceIdentity,
    tensors: int,
    *,
    known: int = 0,
    wait_s: float = 0.0,
    timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    credentials: Credentials | None = None,
    connect: Connect = _stub,
) -> HoldingsView:
    """What a source of `tensors` tensors holds, once it holds more than `known` (waiting up to `wait_s`)."""
    wait_ms = int(min(wait_s * 1000, MAX_HOLDINGS_WAIT_MS))
    with connect(endpoint) as stub:
        response = stub.GetHoldings(
            worker_pb2.GetHoldingsRequest(source=identity.to_proto(), known=known, wait_ms=wait_ms),
            timeout=timeout_s + wait_ms / 1000,
            metadata=_metadata(credentials),
        )
    return HoldingsView.from_proto(response.holdings, tensors)
